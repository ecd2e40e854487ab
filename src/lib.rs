//! smoe-pipeline, the application: the command line ([`main`]) and, for the fuzz targets
//! and property tests, the parsers of everything it reads from outside ([`parsers`]).

mod atomic_dir;
mod check;
mod cli;
mod config;
mod convert;
mod devices;
mod generate;
mod gguf_info;
pub mod parsers;
mod quant;
mod routing_stats;
mod serve;
mod settings;
mod startup;
mod synth;
mod tokenizer;
mod vault_writer;
mod verify;

use std::process::ExitCode;

use clap::Parser;
use cli::{Cli, Command};

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Convert(a) => {
            let dtype = a.dtype.as_deref().and_then(smoe_proto::DType::from_name);
            let source = match (a.hf, a.gguf) {
                (Some(dir), _) => convert::Source::Hf(dir),
                (None, Some(file)) => convert::Source::Gguf(file),
                (None, None) => anyhow::bail!("pass --hf DIR or --gguf FILE"),
            };
            let opts = convert::ConvertOptions {
                source,
                out: a.out,
                dtype,
                quant: a.quant,
                keep_resident: a.keep_resident,
                force: a.force,
            };
            let m = convert::convert(&opts)?;
            eprintln!(
                "wrote vault {} ({} layers, {} MoE layers × {} experts; {})",
                opts.out.display(),
                m.model.num_hidden_layers,
                m.experts.layers.len(),
                m.model.num_experts,
                m.format_summary()
            );
            Ok(())
        }
        Command::Generate(a) => generate::run(&a),
        Command::Serve(a) => serve::run(&a),
        Command::Verify(a) => verify::run(&a),
        Command::Check(a) => check::run(&a),
        Command::Synth(a) => synth::run(&a),
        Command::Devices(a) => devices::run(&a),
        Command::GgufInfo(a) => gguf_info::run(&a),
    }
}

/// The `smoe-pipeline` command: parses the command line, runs it, and reports an error
/// on stderr.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // `serve` sets up logging itself, at its configured level.
    if !matches!(cli.command, Command::Serve(_)) {
        tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            )
            .with_writer(std::io::stderr)
            .init();
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
