//! `smoe-pipeline serve`: an OpenAI-compatible HTTP daemon over the engine, with prefix
//! reuse across requests, a bounded request queue, Prometheus metrics and a graceful
//! shutdown.

mod admission;
mod auth;
pub(crate) mod chat_template;
pub(crate) mod completions;
pub(crate) mod demo;
mod drive;
mod error;
mod listener;
mod metrics;
pub(crate) mod prompt_bound;
pub(crate) mod request;
mod routes;
pub(crate) mod state;
mod stops;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::startup::open_engine;
use anyhow::{Context, Result};
use kameo::actor::Spawn;
use smoe_actors::ring::budget::session_bytes;
use smoe_actors::scheduler::{CancelAll, Drain, Scheduler, SchedulerOptions};
use smoe_proto::human_bytes;
use tokio::sync::watch;

use crate::cli::ServeArgs;
use crate::config::Config;
use crate::tokenizer;
use state::{AppState, RequestDefaults, ServedModel};

/// How often the engine publishes the ring's gauges (slots per state, queued reads).
const GAUGES_EVERY: Duration = Duration::from_millis(500);
/// How often histograms are drained between scrapes.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);
/// How long to wait for connections to close after cancelling in-flight work.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// Runs `serve` until SIGTERM or Ctrl-C.
pub fn run(args: &ServeArgs) -> Result<()> {
    let config = Config::from_args(args)?;
    if args.print_config {
        print!("{}", config.to_toml()?);
        return Ok(());
    }
    init_logging(&config.log_level);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("smoe-http")
        .build()
        .context("cannot start the async runtime")?;
    let result = runtime.block_on(serve(config));
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

/// Logs to stderr at the config's level unless `RUST_LOG` is set.
fn init_logging(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}

async fn serve(config: Config) -> Result<()> {
    let metrics = metrics::install()?;
    let (vault, demo) = match &config.vault {
        Some(v) => (v.clone(), false),
        None => (tokio::task::spawn_blocking(demo::ensure).await.context("demo bootstrap")??, true),
    };
    if demo {
        tracing::warn!("no vault configured: serving the built-in {}", demo::LABEL);
    }
    let (engine, executor) = open_engine(
        &vault,
        &config.engine_options(&vault)?,
        config.backend,
        config.device,
        config.chunk_size,
    )
    .with_context(|| format!("cannot open the vault {}", vault.display()))?;
    if engine.model.max_context < config.max_context {
        tracing::warn!(
            "max_context {} is beyond the model's trained context: using {}",
            config.max_context,
            engine.model.max_context
        );
    }
    let manifest = engine.vault.manifest();
    metrics::publish_vault(manifest, &engine.ring);
    let ring_classes: Vec<String> = engine
        .ring
        .classes()
        .iter()
        .map(|c| format!("{} slots of {}", c.slots, human_bytes(c.stride as u64)))
        .collect();
    let tok = tokenizer::load(&vault).context("serve needs the vault's tokenizer")?;
    let admission = Arc::new(admission::Admission::new(
        config.max_body_bytes,
        Duration::from_secs_f64(config.body_read_timeout),
        &tok,
        engine.vault.resident_check().clone(),
    ));
    let template = chat_template::ChatTemplate::load(&vault)?;
    let cfg = &engine.model.cfg;
    tracing::info!(
        "vault {}: {} layers, {} experts ({} per token, {} per read), vocabulary {}, backend {} (device {}), \
         ring {} ({}), io {}, max_context {}, chunk_size {}, spec_depth {}, lookahead {}; chat template: {}; weights: {}",
        vault.display(),
        cfg.num_hidden_layers,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        human_bytes(manifest.experts.mean_blob_len()),
        cfg.vocab_size,
        config.backend.name(),
        config.device,
        human_bytes(engine.ring.ring_bytes()),
        ring_classes.join(" + "),
        engine.ring.io_mode().name(),
        engine.model.max_context,
        config.chunk_size,
        config.spec_depth,
        config.lookahead,
        template.origin,
        manifest.format_summary()
    );
    let snapshots = engine.model.state_snapshots;
    let per = session_bytes(cfg, engine.model.max_context, snapshots);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let states = match per.states {
        0 => String::new(),
        s => format!(
            " (keys/values {:.1} MiB, DeltaNet states {:.1} MiB, up to {snapshots} state snapshots {:.1} MiB)",
            mib(per.kv),
            mib(s),
            mib(per.snapshots)
        ),
    };
    tracing::info!(
        "KV cache: {:.1} MiB per session at max_context{states}, up to {} sessions ({:.1} MiB)",
        mib(per.total()),
        config.max_sessions,
        mib(per.total() * config.max_sessions as u64)
    );
    let id = match (&config.model_name, demo) {
        (Some(n), _) => n.clone(),
        (None, true) => demo::MODEL_ID.to_string(),
        (None, false) => vault
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "smoe".to_string()),
    };
    let model = ServedModel {
        id,
        created: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        max_context: engine.model.max_context,
        vocab: cfg.vocab_size,
        description: demo.then(|| demo::LABEL.to_string()),
    };
    let scheduler = Scheduler::spawn((
        executor,
        SchedulerOptions { max_queue: config.max_queue, max_sessions: config.max_sessions },
    ));
    let st = Arc::new(AppState {
        scheduler: scheduler.clone(),
        tokenizer: tok,
        template,
        model,
        defaults: RequestDefaults {
            sampling: config.default_sampling(),
            fixed_seed: config.sampling.seed.is_some(),
            max_tokens: config.sampling.max_tokens,
            spec_depth: config.spec_depth,
        },
        api_key: config.api_key.clone(),
        metrics: metrics.clone(),
    });
    let _gauges =
        engine.ring.publish_gauges(GAUGES_EVERY).context("cannot start the ring gauge publisher")?;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(UPKEEP_EVERY);
        loop {
            tick.tick().await;
            metrics.run_upkeep();
        }
    });

    let addr = config.listen_addr()?;
    let listener =
        tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
    let local = listener.local_addr()?;
    eprintln!("smoe-pipeline serve: model `{}` listening on http://{local}", st.model.id);

    let grace = Duration::from_secs_f64(config.shutdown_grace);
    let (stop_tx, mut stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutting down: no new connections; in-flight requests get {grace:?} to finish");
        let _ = stop_tx.send(true);
    });
    let limits = listener::ConnLimits {
        max_connections: config.max_connections,
        header_read_timeout: Duration::from_secs_f64(config.header_read_timeout),
        idle_timeout: Duration::from_secs_f64(config.idle_timeout),
    };
    let server = listener::serve(listener, routes::router(st, admission), limits, stop_rx.clone());
    let mut server = std::pin::pin!(server);
    // The server returns only after the stop signal, once its connections are closed.
    tokio::select! {
        _ = &mut server => return Ok(()),
        _ = stop_rx.wait_for(|s| *s) => {}
    }
    let _ = scheduler.tell(Drain).await;
    tokio::select! {
        _ = &mut server => return Ok(()),
        _ = tokio::time::sleep(grace) => {}
    }
    tracing::warn!("shutdown grace over: cancelling the requests still running or queued");
    let _ = scheduler.tell(CancelAll).await;
    tokio::select! {
        _ = &mut server => {}
        _ = tokio::time::sleep(CLOSE_WAIT) => {
            tracing::warn!("connections still open after cancelling; exiting anyway");
        }
    }
    Ok(())
}

/// Resolves on SIGTERM or Ctrl-C (SIGINT).
async fn wait_for_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot watch SIGTERM ({e}); only Ctrl-C stops the daemon");
                std::future::pending::<()>().await
            }
        }
    };
    tokio::select! {
        _ = term => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
