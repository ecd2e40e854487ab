//! `vulkan e2e` and `vulkan diag`: whole forward passes, timed or compared bit for bit.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use smoe_actors::contract::ForwardPass;
use smoe_actors::engine::{Engine, EngineOptions, RingSize, VramSize};
use smoe_actors::ring::memory::HostAllocator;
use smoe_actors::vulkan::harness::KernelHarness;
use smoe_actors::vulkan::{ExpertPath, VulkanAllocator, VulkanContext, VulkanPass};
use smoe_proto::DType;

use crate::kernels::upload;

struct Rates {
    prefill: f64,
    decode: f64,
}

/// The greedy token of `logits`.
fn argmax(logits: &[f32]) -> u32 {
    smoe_actors::sampler::argmax(logits) as u32
}

/// Prefills `prompt` in chunks of `fwd.max_rows()` and decodes `decode` greedy tokens,
/// timing both; returns the rates and the last token id.
fn time_greedy<P: ForwardPass>(fwd: &mut P, prompt: &[u32], decode: usize) -> (Rates, u32) {
    let mut kv = fwd.new_kv().expect("kv");
    let (last, body) = prompt.split_last().expect("prompt");
    let t = Instant::now();
    for c in body.chunks(fwd.max_rows()) {
        fwd.forward(&mut kv, c, false).expect("prefill");
    }
    let prefill = body.len() as f64 / t.elapsed().as_secs_f64();
    let mut next = argmax(fwd.forward(&mut kv, &[*last], true).expect("fwd").expect("logits"));
    let t = Instant::now();
    for _ in 0..decode {
        next = argmax(fwd.forward(&mut kv, &[next], true).expect("fwd").expect("logits"));
    }
    (Rates { prefill, decode: decode as f64 / t.elapsed().as_secs_f64() }, next)
}

fn run_cpu(vault: &Path, opts: &EngineOptions, prompt: &[u32], decode: usize, chunk: usize) -> (Rates, u32) {
    let engine = Engine::open(vault, opts, &HostAllocator).expect("engine");
    time_greedy(&mut smoe_actors::executor::cpu_pass(&engine, chunk), prompt, decode)
}

fn run_vulkan(
    ctx: &Arc<VulkanContext>,
    vault: &Path,
    opts: &EngineOptions,
    prompt: &[u32],
    decode: usize,
    chunk: usize,
    path: Option<ExpertPath>,
) -> (Rates, u32) {
    let alloc = VulkanAllocator::new(ctx.clone());
    let engine = Engine::open(vault, opts, &alloc).expect("engine");
    // An expert path is measured with the VRAM tier (which replaces it) off.
    let vram = if path.is_some() { VramSize::Bytes(0) } else { opts.vram };
    let mut fwd =
        VulkanPass::for_engine(ctx.clone(), &alloc, &engine, chunk, (vram, None)).expect("vulkan forward");
    if let Some(p) = path {
        fwd.set_expert_path(p).expect("path");
    }
    time_greedy(&mut fwd, prompt, decode)
}

/// `vulkan e2e VAULT [PROMPT] [DECODE] [CHUNK] [STREAM_SLOTS] [DEVICE] [MODES] [PATH]`:
/// prefill and decode tok/s of a greedy run, Vulkan and CPU, experts resident or
/// streamed (a markdown table).
pub fn e2e(args: &[String]) {
    let vault = Path::new(&args[0]);
    let num = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (plen, decode, chunk, stream_slots, device) =
        (num(1, 256), num(2, 32), num(3, 64), num(4, 64), num(5, 0));
    let modes = args.get(6).map(String::as_str).unwrap_or("both");
    let path = match args.get(7).map(String::as_str) {
        Some("zero-copy") => Some(ExpertPath::ZeroCopy),
        Some("staged-prefill") => Some(ExpertPath::StagedPrefill),
        Some("staged") => Some(ExpertPath::Staged),
        _ => None,
    };
    let ctx = VulkanContext::new(device).expect("device");
    warm_gpu(&ctx);
    let vocab = smoe_actors::vault::Vault::open(vault).expect("vault").manifest().model.vocab_size as u64;
    let prompt: Vec<u32> = (0..plen as u64).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    println!("vault {} prompt {plen} decode {decode} chunk {chunk} on {}", vault.display(), ctx.info.name);
    println!("| backend | experts | prefill tok/s | decode tok/s | last id |");
    println!("| --- | --- | --- | --- | --- |");
    for (label, ring) in
        [("resident", RingSize::Bytes(u64::MAX / 4)), ("streamed", RingSize::Slots(stream_slots))]
    {
        if modes != "both" && modes != label {
            continue;
        }
        let opts = EngineOptions { max_context: plen + decode + 8, ring, ..Default::default() };
        let (r, id) = run_vulkan(&ctx, vault, &opts, &prompt, decode, chunk, path);
        let p = path.map(|p| format!(" {p:?}")).unwrap_or_default();
        println!("| vulkan{p} | {label} | {:.1} | {:.2} | {id} |", r.prefill, r.decode);
        let (r, id) = run_cpu(vault, &opts, &prompt, decode, chunk);
        println!("| cpu | {label} | {:.1} | {:.2} | {id} |", r.prefill, r.decode);
    }
}

/// Keeps the GPU reading memory for 300 ms, so timed runs start at the shader clock a
/// busy GPU runs at rather than the idle one (see `kernels::time`).
fn warm_gpu(ctx: &Arc<VulkanContext>) {
    let h = KernelHarness::new(ctx.clone(), 1 << 20, 16).expect("harness");
    let w = upload(&h, 2048, 4096, 7, DType::F32, false);
    h.run_timed(h.read_all(&w, 1056, 0).expect("read"), 1, Duration::from_millis(300), 0).expect("run");
}

/// Greedy run on the Vulkan backend with a given ring, block size and expert path;
/// returns every decode step's logits.
fn diag_run(
    ctx: &Arc<VulkanContext>,
    vault: &Path,
    slots: usize,
    chunk: usize,
    path: ExpertPath,
    prompt: &[u32],
    steps: usize,
) -> Vec<f32> {
    let alloc = VulkanAllocator::new(ctx.clone());
    let opts = EngineOptions { max_context: 256, ring: RingSize::Slots(slots), ..Default::default() };
    let engine = Engine::open(vault, &opts, &alloc).expect("engine");
    let mut fwd = VulkanPass::for_engine(ctx.clone(), &alloc, &engine, chunk, (VramSize::Bytes(0), None))
        .expect("forward");
    fwd.set_expert_path(path).expect("path");
    greedy_logits(&mut fwd, prompt, steps)
}

/// Prefills `prompt` in chunks of `fwd.max_rows()`, then decodes `steps` greedy tokens;
/// returns the logits of every decode step, concatenated.
fn greedy_logits<P: ForwardPass>(fwd: &mut P, prompt: &[u32], steps: usize) -> Vec<f32> {
    let mut kv = fwd.new_kv().expect("kv");
    let (last, body) = prompt.split_last().expect("prompt");
    for c in body.chunks(fwd.max_rows()) {
        fwd.forward(&mut kv, c, false).expect("prefill");
    }
    let mut out = Vec::new();
    let mut next = *last;
    for _ in 0..steps {
        let l = fwd.forward(&mut kv, &[next], true).expect("fwd").expect("logits");
        out.extend_from_slice(l);
        next = argmax(l);
    }
    out
}

/// Which combinations of ring size, block size and expert path reproduce the reference
/// (roomy ring, token-serial, blobs read in place) bit for bit.
pub fn diag(args: &[String]) {
    let vault = Path::new(&args[0]);
    let device = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let ctx = VulkanContext::new(device).expect("device");
    let v = smoe_actors::vault::Vault::open(vault).expect("vault");
    let cfg = &v.manifest().model;
    let all = v.manifest().experts.layers.len() * cfg.num_experts;
    let vocab = cfg.vocab_size as u64;
    let prompt: Vec<u32> = (0..20u64).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    let reference = diag_run(&ctx, vault, all, 1, ExpertPath::ZeroCopy, &prompt, 8);
    let tight = cfg.num_experts_per_tok.saturating_sub(1).max(1);
    for (slots, chunk, path) in [
        (all, 1, ExpertPath::Staged),
        (tight, 1, ExpertPath::ZeroCopy),
        (tight, 1, ExpertPath::Staged),
        (cfg.num_experts_per_tok + 1, 1, ExpertPath::ZeroCopy),
        (cfg.num_experts_per_tok + 1, 1, ExpertPath::Staged),
        (all, 8, ExpertPath::StagedPrefill),
        (all, 8, ExpertPath::ZeroCopy),
        (tight, 8, ExpertPath::StagedPrefill),
        (tight, 8, ExpertPath::ZeroCopy),
        (tight, 8, ExpertPath::Staged),
    ] {
        let got = diag_run(&ctx, vault, slots, chunk, path, &prompt, 8);
        let same = got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits());
        let d = got.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        println!(
            "slots {slots:4} chunk {chunk} {path:?}: {}",
            if same { "identical".to_string() } else { format!("DIFFERS (max {d:e})") }
        );
    }
    // The CPU backend on the same prompt.
    let opts = EngineOptions { max_context: 256, ring: RingSize::Slots(all), ..Default::default() };
    let engine = Engine::open(vault, &opts, &HostAllocator).expect("engine");
    let cpu = greedy_logits(&mut smoe_actors::executor::cpu_pass(&engine, 1), &prompt, 8);
    let d = cpu.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    let scale = cpu.iter().map(|a| a.abs()).fold(0.0f32, f32::max);
    println!("cpu vs vulkan reference: max |diff| {d:e} (max |logit| {scale:e})");
}
