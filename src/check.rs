//! `smoe-pipeline check`: reads a whole vault and verifies every checksum — the resident
//! tensors (the background check every open starts, waited for here) and every expert
//! blob — with a progress bar, listing each fault (file, tensor or layer and expert,
//! offset). Opening a vault never does this; run it after copying or downloading one.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use indicatif::{ProgressBar, ProgressStyle};
use smoe_actors::vault::Vault;

use crate::cli::CheckArgs;

/// Runs `check`: `Ok` when every checksum matches.
pub fn run(args: &CheckArgs) -> Result<()> {
    let start = Instant::now();
    let vault = Vault::open(&args.vault)?;
    let resident = vault.resident_check();
    let (_, resident_bytes) = resident.progress();
    let total = resident_bytes + vault.expert_bytes();
    let bar = ProgressBar::new(total).with_message("checking");
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    while resident.status().is_none() {
        bar.set_position(resident.progress().0);
        std::thread::sleep(Duration::from_millis(50));
    }
    let resident_faults = resident.faults();
    bar.suspend(|| resident_faults.iter().for_each(|e| eprintln!("{e}")));
    bar.set_position(resident_bytes);
    let mut blob_faults = 0;
    vault.verify_experts(&mut |n| bar.inc(n), &mut |e| {
        bar.suspend(|| eprintln!("{e}"));
        blob_faults += 1;
    })?;
    bar.finish_and_clear();
    let m = vault.manifest();
    let blobs = m.experts.layers.len() * m.model.num_experts;
    if !resident_faults.is_empty() || blob_faults > 0 {
        bail!(
            "{}: {} of {} resident tensors and {blob_faults} of {blobs} expert blobs do not match their \
             checksums; the vault is corrupt — re-run `smoe-pipeline convert`",
            args.vault.display(),
            resident_faults.len(),
            m.resident.tensors.len(),
        );
    }
    println!(
        "{}: ok — {} resident tensors and {blobs} expert blobs ({:.1} MB) match their checksums ({:.1} s)",
        args.vault.display(),
        m.resident.tensors.len(),
        total as f64 / 1e6,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
