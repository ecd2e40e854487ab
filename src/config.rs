//! The `serve` configuration: a TOML file (every key optional, unknown keys rejected),
//! overridden by command-line flags, then validated key by key so that every error names
//! the key at fault and why.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Deserializer, Serialize};
use smoe_actors::engine::EngineOptions;
use smoe_actors::executor::BackendKind;
use smoe_actors::sampler::SamplingParams;
use smoe_actors::state_book::DEFAULT_STATE_SNAPSHOTS;
use smoe_actors::streamer::IoChoice;

use crate::cli::{EngineFlags, ServeArgs};
use crate::settings::{self, ByteSize, EngineSettings, Limit};

/// Everything `smoe-pipeline serve` can be told. Field names are the TOML keys.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Vault directory; absent: the built-in tiny random-weight demo model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vault: Option<PathBuf>,
    /// Model id served by `/v1/models` and required in requests; absent: the vault's
    /// directory name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_name: Option<String>,
    /// Address to listen on.
    pub listen: String,
    /// Bearer token required on `/v1/*` when set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    /// Log filter (`error`, `warn`, `info`, `debug`, `trace`, or a tracing directive);
    /// `RUST_LOG` wins when set.
    pub log_level: String,
    /// Compute backend (`cpu` or `vulkan`).
    #[serde(deserialize_with = "parsed")]
    pub backend: BackendKind,
    /// Vulkan device index (see `smoe-pipeline devices`).
    pub device: usize,
    /// Longest sequence (prompt + completion) a session holds.
    pub max_context: usize,
    /// Ring slots (one expert each); conflicts with `ring_bytes`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ring_slots: Option<usize>,
    /// Ring size (bytes, or a string with a unit such as `"12GiB"`); default: sized from
    /// the memory available when neither ring key is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ring_bytes: Option<ByteSize>,
    /// The Vulkan backend's VRAM tier (device-local copies of the experts it multiplies,
    /// filled from the ring), in bytes or with a unit; 0 turns it off. Default: what the
    /// device can spare beside the dense weights, activations, the KV caches of
    /// `max_sessions` sessions and a margin (off where the GPU's memory is the host's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vram_bytes: Option<ByteSize>,
    /// Workgroups of the Vulkan backend's fused MoE front: a device-routed decode step's
    /// router, ranking and expert gate/up in one dispatch, whose workgroups must all run
    /// at once (one an SM: at most the SM count `smoe-pipeline devices` prints; 0: off).
    /// Default: that SM count where the driver reports it (NVIDIA), else off. If they do
    /// not all run at once, the step is computed again the usual way and the front is
    /// turned off (a warning says so).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe_front_groups: Option<u32>,
    /// I/O path: `auto`, `io-uring` or `pread`.
    #[serde(deserialize_with = "parsed")]
    pub io: IoChoice,
    /// Reads in flight (io_uring) or reader threads (pread).
    pub queue_depth: usize,
    /// Prompt tokens per layer-major prefill chunk.
    pub chunk_size: usize,
    /// Gate ranks beyond top-k queued as speculative prefetches during decode (0: off).
    pub spec_depth: usize,
    /// Experts of the next MoE layer a prefill chunk reads ahead while a layer computes
    /// (0: off).
    pub lookahead: usize,
    /// Stored token streams with their KV caches, for prefix reuse.
    pub max_sessions: usize,
    /// DeltaNet state snapshots each stored session keeps (hybrid models), so that a
    /// prompt diverging inside it resumes from the longest one within the common prefix.
    pub state_snapshots: usize,
    /// Requests that may wait behind the running one; more get 429.
    pub max_queue: usize,
    /// Seconds to let in-flight requests finish after SIGTERM/Ctrl-C before cancelling.
    pub shutdown_grace: f64,
    /// Largest request body accepted (bytes, or a string with a unit); larger gets 413.
    pub max_body_bytes: ByteSize,
    /// Seconds a request's head may take to arrive once its first byte has.
    pub header_read_timeout: f64,
    /// Seconds a request's body may take to arrive; slower gets 408.
    pub body_read_timeout: f64,
    /// Seconds a connection may sit with no request in progress before it is closed.
    pub idle_timeout: f64,
    /// Open connections at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Defaults for requests that leave sampling parameters out.
    pub sampling: SamplingDefaults,
}

/// Sampling defaults (`[sampling]` table).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SamplingDefaults {
    /// Softmax temperature (0: greedy).
    pub temperature: f32,
    /// Nucleus threshold (1: off).
    pub top_p: f32,
    /// Keep the K most likely tokens (0: off).
    pub top_k: usize,
    /// HuggingFace-style repetition penalty (1: off).
    pub repetition_penalty: f32,
    /// Seed for requests without one; absent: a fresh random seed per request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Completion length for requests without `max_tokens` (capped by the context left).
    pub max_tokens: usize,
}

/// Stored token streams (serve only).
const MAX_SESSIONS: Limit = Limit { key: "max_sessions", min: 1, max: 1024 };
/// Requests waiting behind the running one (serve only).
const MAX_QUEUE: Limit = Limit { key: "max_queue", min: 0, max: 1 << 20 };
/// Open connections.
const MAX_CONNECTIONS: Limit = Limit { key: "max_connections", min: 1, max: 65536 };
/// Smallest `max_body_bytes`.
const MIN_BODY: ByteSize = ByteSize(1 << 10);
/// Largest `max_body_bytes`.
const MAX_BODY: ByteSize = ByteSize(1 << 30);
/// Shortest connection timeout, in seconds.
const MIN_TIMEOUT: f64 = 0.1;
/// Longest duration setting, in seconds.
const MAX_SECONDS: f64 = 3600.0;

/// Reads a value from its text with its [`FromStr`], so that the key takes exactly what the
/// flag of the same name does (and fails with the same message).
fn parsed<'de, D: Deserializer<'de>, T: FromStr<Err = String>>(d: D) -> Result<T, D::Error> {
    String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
}

/// Checks a duration key in seconds: finite, between `min` and an hour.
fn seconds(key: &str, v: f64, min: f64) -> Result<()> {
    if !(v.is_finite() && (min..=MAX_SECONDS).contains(&v)) {
        bail!(
            "invalid setting {}: must be between {min} and {MAX_SECONDS} seconds, got {v}",
            settings::name(key)
        );
    }
    Ok(())
}

impl Default for Config {
    fn default() -> Self {
        Config {
            vault: None,
            model_name: None,
            listen: "127.0.0.1:8080".into(),
            api_key: None,
            log_level: "info".into(),
            backend: BackendKind::Cpu,
            device: 0,
            max_context: 8192,
            ring_slots: None,
            ring_bytes: None,
            vram_bytes: None,
            moe_front_groups: None,
            io: IoChoice::Auto,
            queue_depth: 8,
            chunk_size: 512,
            spec_depth: 0,
            lookahead: 0,
            max_sessions: 4,
            state_snapshots: DEFAULT_STATE_SNAPSHOTS,
            max_queue: 16,
            shutdown_grace: 10.0,
            max_body_bytes: ByteSize(8 << 20),
            header_read_timeout: 30.0,
            body_read_timeout: 60.0,
            idle_timeout: 60.0,
            max_connections: 256,
            sampling: SamplingDefaults::default(),
        }
    }
}

impl Default for SamplingDefaults {
    fn default() -> Self {
        SamplingDefaults {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            repetition_penalty: 1.0,
            seed: None,
            max_tokens: 512,
        }
    }
}

impl Config {
    /// Parses TOML text; `origin` names the file in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Config> {
        let de =
            toml::Deserializer::parse(text).map_err(|e| anyhow!("{origin}: {}", e.to_string().trim_end()))?;
        serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            let inner = e.into_inner().to_string();
            let inner = inner.trim_end();
            if key == "." || key.is_empty() {
                anyhow!("{origin}: {inner}")
            } else {
                anyhow!("{origin}: key `{key}`: {inner}")
            }
        })
    }

    /// Reads and parses a config file.
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the config file {}", path.display()))?;
        Config::parse(&text, &format!("config file {}", path.display()))
    }

    /// The config for `serve`: the file (if any), overridden by flags, validated.
    pub fn from_args(args: &ServeArgs) -> Result<Config> {
        let file = match &args.config {
            Some(p) => Config::load(p)?,
            None => Config::default(),
        };
        let mut c = file.with_engine_flags(&args.engine);
        c.apply_flags(args);
        c.validate()?;
        Ok(c)
    }

    /// This config with the engine keys replaced by the engine flags that were given; either
    /// ring flag replaces both ring keys (they exclude each other).
    fn with_engine_flags(self, f: &EngineFlags) -> Config {
        let ring_given = f.ring_slots.is_some() || f.ring_bytes.is_some();
        Config {
            max_context: f.max_context.unwrap_or(self.max_context),
            ring_slots: if ring_given { f.ring_slots } else { self.ring_slots },
            ring_bytes: if ring_given { f.ring_bytes } else { self.ring_bytes },
            vram_bytes: f.vram_bytes.or(self.vram_bytes),
            moe_front_groups: f.moe_front_groups.or(self.moe_front_groups),
            io: f.io.unwrap_or(self.io),
            queue_depth: f.queue_depth.unwrap_or(self.queue_depth),
            chunk_size: f.chunk_size.unwrap_or(self.chunk_size),
            spec_depth: f.spec_depth.unwrap_or(self.spec_depth),
            lookahead: f.lookahead.unwrap_or(self.lookahead),
            backend: f.backend.unwrap_or(self.backend),
            device: f.device.unwrap_or(self.device),
            ..self
        }
    }

    /// Replaces file values with the flags beyond the engine's that were given.
    fn apply_flags(&mut self, a: &ServeArgs) {
        fn set<T: Clone>(dst: &mut T, src: &Option<T>) {
            if let Some(v) = src {
                *dst = v.clone();
            }
        }
        if a.vault.is_some() {
            self.vault = a.vault.clone();
        }
        if a.model_name.is_some() {
            self.model_name = a.model_name.clone();
        }
        if a.api_key.is_some() {
            self.api_key = a.api_key.clone();
        }
        set(&mut self.listen, &a.listen);
        set(&mut self.log_level, &a.log_level);
        set(&mut self.max_sessions, &a.max_sessions);
        set(&mut self.state_snapshots, &a.state_snapshots);
        set(&mut self.max_queue, &a.max_queue);
        set(&mut self.shutdown_grace, &a.shutdown_grace);
        set(&mut self.max_body_bytes, &a.max_body_bytes);
        set(&mut self.header_read_timeout, &a.header_read_timeout);
        set(&mut self.body_read_timeout, &a.body_read_timeout);
        set(&mut self.idle_timeout, &a.idle_timeout);
        set(&mut self.max_connections, &a.max_connections);
    }

    /// Checks every key's range; the error names the key.
    pub fn validate(&self) -> Result<()> {
        self.listen_addr()?;
        if self.model_name.as_deref().is_some_and(|n| n.trim().is_empty()) {
            bail!("invalid config: `model_name` must not be empty");
        }
        if self.api_key.as_deref().is_some_and(str::is_empty) {
            bail!("invalid config: `api_key` must not be empty (leave it out to disable the check)");
        }
        tracing_subscriber::EnvFilter::try_new(&self.log_level).map_err(|e| {
            anyhow!(
                "invalid config: `log_level` {:?} is not a log filter such as info or debug: {e}",
                self.log_level
            )
        })?;
        self.engine_settings().validate()?;
        MAX_SESSIONS.check_usize(self.max_sessions)?;
        MAX_QUEUE.check_usize(self.max_queue)?;
        seconds("shutdown_grace", self.shutdown_grace, 0.0)?;
        if !(MIN_BODY..=MAX_BODY).contains(&self.max_body_bytes) {
            bail!(
                "invalid setting {}: must be between {MIN_BODY} and {MAX_BODY}, got {}",
                settings::name("max_body_bytes"),
                self.max_body_bytes
            );
        }
        seconds("header_read_timeout", self.header_read_timeout, MIN_TIMEOUT)?;
        seconds("body_read_timeout", self.body_read_timeout, MIN_TIMEOUT)?;
        seconds("idle_timeout", self.idle_timeout, MIN_TIMEOUT)?;
        MAX_CONNECTIONS.check_usize(self.max_connections)?;
        let s = &self.sampling;
        if !(s.temperature.is_finite() && (0.0..=100.0).contains(&s.temperature)) {
            bail!("invalid config: `sampling.temperature` must be between 0 and 100, got {}", s.temperature);
        }
        if !(s.top_p > 0.0 && s.top_p <= 1.0) {
            bail!("invalid config: `sampling.top_p` must be in (0, 1], got {}", s.top_p);
        }
        if !(s.repetition_penalty.is_finite() && s.repetition_penalty > 0.0) {
            bail!("invalid config: `sampling.repetition_penalty` must be > 0, got {}", s.repetition_penalty);
        }
        if !(1..=1 << 20).contains(&s.max_tokens) {
            bail!(
                "invalid config: `sampling.max_tokens` must be between 1 and {}, got {}",
                1 << 20,
                s.max_tokens
            );
        }
        Ok(())
    }

    /// The listen address.
    pub fn listen_addr(&self) -> Result<SocketAddr> {
        self.listen.parse().map_err(|_| {
            anyhow!("invalid config: `listen` {:?} is not an address such as 127.0.0.1:8080", self.listen)
        })
    }

    /// The engine keys; their ranges are checked by [`EngineSettings::validate`], the same
    /// check the command-line flags get.
    pub fn engine_settings(&self) -> EngineSettings {
        EngineSettings {
            max_context: self.max_context,
            ring_slots: self.ring_slots,
            ring_bytes: self.ring_bytes,
            vram_bytes: self.vram_bytes,
            moe_front_groups: self.moe_front_groups,
            io: self.io,
            queue_depth: self.queue_depth,
            chunk_size: self.chunk_size,
            spec_depth: self.spec_depth,
            lookahead: self.lookahead,
            backend: self.backend,
            device: self.device,
            state_snapshots: self.state_snapshots,
        }
    }

    /// Engine options for opening the vault in `vault`.
    pub fn engine_options(&self, vault: &Path) -> Result<EngineOptions> {
        self.engine_settings().engine_options(vault, self.max_sessions)
    }

    /// Sampling parameters for a request that set none, before per-request overrides.
    pub fn default_sampling(&self) -> SamplingParams {
        let s = &self.sampling;
        SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            repetition_penalty: s.repetition_penalty,
            seed: s.seed.unwrap_or(0),
        }
    }

    /// The effective config as TOML, with the API key masked.
    pub fn to_toml(&self) -> Result<String> {
        let mut shown = self.clone();
        if shown.api_key.is_some() {
            shown.api_key = Some("<set>".into());
        }
        toml::to_string(&shown).context("cannot print the config")
    }
}

impl From<&EngineFlags> for EngineSettings {
    /// The settings `generate` runs with: the config keys' defaults, overridden by the
    /// engine flags given (as `serve`'s flags override its config file).
    fn from(flags: &EngineFlags) -> Self {
        Config::default().with_engine_flags(flags).engine_settings()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        match Config::parse(text, "test.toml").and_then(|c| c.validate()) {
            Ok(()) => panic!("accepted: {text}"),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn empty_file_gives_defaults() {
        assert_eq!(Config::parse("", "x").unwrap(), Config::default());
        Config::default().validate().unwrap();
    }

    #[test]
    fn errors_name_the_key() {
        assert!(err("chunk_sise = 3").contains("chunk_sise"), "{}", err("chunk_sise = 3"));
        assert!(err("chunk_size = \"big\"").contains("`chunk_size`"));
        assert!(err("chunk_size = 0").contains("`chunk_size`"));
        assert!(err("[sampling]\ntop_p = 0.0").contains("`sampling.top_p`"));
        assert!(err("[sampling]\ntemprature = 1.0").contains("temprature"));
        assert!(err("listen = \"nowhere\"").contains("`listen`"));
        assert!(err("io = \"floppy\"").contains("`io`"));
        assert!(err("ring_slots = 4\nring_bytes = 4096").contains("`ring_slots`"));
        assert!(err("max_sessions = -1").contains("`max_sessions`"));
        assert!(err("state_snapshots = 100").contains("`state_snapshots` (--state-snapshots)"));
        Config::parse("state_snapshots = 0", "x").unwrap().validate().unwrap();
    }

    #[test]
    fn engine_flags_override_the_keys_they_set() {
        let file = Config::parse("ring_slots = 4\nchunk_size = 7\nio = \"io_uring\"", "x").unwrap();
        let flags = EngineFlags {
            ring_bytes: Some(ByteSize(1 << 20)),
            backend: Some(BackendKind::Vulkan),
            ..EngineFlags::default()
        };
        let c = file.with_engine_flags(&flags);
        assert_eq!((c.ring_slots, c.ring_bytes), (None, Some(ByteSize(1 << 20))));
        assert_eq!((c.chunk_size, c.io, c.backend), (7, IoChoice::IoUring, BackendKind::Vulkan));
        assert_eq!(EngineSettings::from(&EngineFlags::default()), Config::default().engine_settings());
    }

    #[test]
    fn printed_config_parses_back() {
        let mut c = Config::parse("vault = \"/v\"\nchunk_size = 7\n[sampling]\nseed = 3", "x").unwrap();
        c.validate().unwrap();
        assert_eq!(Config::parse(&c.to_toml().unwrap(), "x").unwrap(), c);
        c.api_key = Some("secret".into());
        assert!(!c.to_toml().unwrap().contains("secret"));
    }
}
