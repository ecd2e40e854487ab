//! Start-up feedback: a spinner on the terminal while the engine opens (vault
//! manifest, resident weights, backend upload, ring), and a log line with the time it
//! took. Nothing is drawn when stderr is not a terminal.

use std::path::Path;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use smoe_actors::engine::{Engine, EngineOptions};
use smoe_actors::executor::{BackendKind, Executor, ExecutorError};

/// Opens the engine and a pass over `vault` exactly as [`Executor::open`] does, showing
/// a spinner with the elapsed time meanwhile.
pub fn open_engine(
    vault: &Path,
    opts: &EngineOptions,
    backend: BackendKind,
    device: usize,
    max_rows: usize,
) -> Result<(Engine, Executor), ExecutorError> {
    let spinner = ProgressBar::new_spinner().with_message(format!("opening {}", vault.display()));
    spinner.set_style(
        ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    spinner.enable_steady_tick(Duration::from_millis(100));
    let started = Instant::now();
    let opened = Executor::open(vault, opts, backend, device, max_rows);
    spinner.finish_and_clear();
    if opened.is_ok() {
        tracing::info!("engine open in {:.2} s", started.elapsed().as_secs_f64());
    }
    opened
}
