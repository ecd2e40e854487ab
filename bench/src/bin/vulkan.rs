//! Vulkan backend measurements.
//!
//! `vulkan kernels [DEVICE]`: per-kernel figures at Qwen3-30B-A3B shapes (hidden 2048,
//! expert intermediate 768, 8 experts per token) for each matmul tuning in `TUNINGS`:
//! achieved GB/s of the m=1 expert FFN (a token's 8 experts in one gate/up + SiLU and one
//! down dispatch, as the executor records them) and of the m=1 dense matvec, with
//! weights in device-local memory and (first tuning) in host-visible memory where ring
//! slots live, and GFLOP/s of the batched expert FFN at 64 tokens per expert. Enough
//! distinct weights are cycled that the L2 cache does not hold them.
//!
//! `vulkan stats [DEVICE] [LANES,ROWS,UNROLL ...]`: what the driver reports about each
//! compiled matmul-family kernel (registers, spill/local memory, shared memory, ... as
//! the driver names them) through VK_KHR_pipeline_executable_properties, for the default
//! tuning and any given ones, specialised as the backend specialises them. vulkano does
//! not expose `CAPTURE_STATISTICS`, so these pipelines are created with raw calls. A
//! device without the extension (lavapipe) gets a one-line error and exit status 2.
//!
//! `vulkan diag VAULT [DEVICE]`: which ring sizes, block sizes and expert paths
//! reproduce token-serial logits bit for bit, and the CPU backend's distance.
//!
//! `vulkan e2e VAULT [PROMPT] [DECODE] [CHUNK] [STREAM_SLOTS] [DEVICE] [MODES]`: prefill
//! and decode tokens/s, CPU vs Vulkan, with every expert held in the ring (`resident`)
//! and with a ring of STREAM_SLOTS slots (`streamed` from the vault); MODES is
//! `resident`, `streamed` or `both` (the default); an optional 8th argument picks the
//! expert path (`zero-copy`, `staged-prefill`, `staged`).

use std::path::Path;
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ash::vk;
use vulkano::device::Device;
use vulkano::pipeline::PipelineLayout;
use vulkano::shader::{ShaderModule, ShaderModuleCreateInfo};
use vulkano::VulkanObject;

use smoe_actors::engine::{Engine, EngineOptions, RingSize};
use smoe_actors::forward_pass::ForwardPass;
use smoe_actors::ring::memory::HostAllocator;
use smoe_actors::tensor::{WeightData, WeightView};
use smoe_actors::vulkan::harness::{
    DescriptorSet, KernelHarness, MatmulArgs, MatmulTuning, Recorder, TestWeight, FLAG_GATHER, FLAG_TABLE,
};
use smoe_actors::vulkan::{
    spirv, ExpertPath, Kernels, VulkanAllocator, VulkanContext, VulkanError, VulkanForward,
};

/// Cheap deterministic pseudo-random weights in [-0.05, 0.05).
fn fill(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
        })
        .collect()
}

fn bf16(v: &[f32]) -> Vec<u16> {
    v.iter().map(|x| (x.to_bits() >> 16) as u16).collect()
}

/// Stacked expert weights: gate, up ((n·inter) × hid) and down ((n·hid) × inter)
/// matrices, expert e at element offset e·inter·hid of each, bound once.
struct Stack {
    gate: TestWeight,
    pair: Arc<DescriptorSet>,
    down: TestWeight,
}

fn upload(h: &KernelHarness, rows: usize, cols: usize, seed: u64, is_bf16: bool, host: bool) -> TestWeight {
    let f = fill(rows * cols, seed);
    let b = bf16(&f);
    let data = if is_bf16 { WeightData::Bf16(&b) } else { WeightData::F32(&f) };
    h.weight(&WeightView { data, rows, cols }, host).expect("upload")
}

/// Seconds per round of `record`, timed as `run_timed` submits it: `record` is
/// recorded into one command buffer as often as makes one submission take about 30 ms
/// (so the submission and fence overhead is small); the buffer then runs back to back
/// for at least 300 ms before seven timed submissions, whose median counts. The warm-up
/// matters: the H200's shader clock falls to 345 MHz within a second of idling
/// (nvidia-smi dmon during a run) and one 30 ms submission does not bring it back to
/// 1980 MHz, which made figures taken after host-side set-up several times too slow.
fn time(h: &KernelHarness, mut record: impl FnMut(&mut Recorder) -> Result<(), VulkanError>) -> f64 {
    let one = h.run_timed(&mut record, 1, Duration::from_millis(50), 1).expect("run")[0].as_secs_f64();
    let rounds = ((0.03 / one).ceil() as usize).clamp(1, 4000);
    let mut t = h.run_timed(&mut record, rounds, Duration::from_millis(300), 7).expect("run");
    t.sort();
    t[3].as_secs_f64() / rounds as f64
}

/// Prints one figure: `bytes` moved in `secs`.
fn report(what: &str, secs: f64, bytes: f64) {
    println!(
        "{what}: {:.1} us, {:.0} GB/s ({:.1}% of 4.8 TB/s)",
        secs * 1e6,
        bytes / secs / 1e9,
        bytes / secs / 4.8e12 * 100.0
    );
}

/// The tunings `vulkan kernels` compares: (lanes, rows per lane group, unroll).
const TUNINGS: &[(u32, u32, u32)] = &[(32, 1, 1), (32, 2, 2), (32, 2, 1), (32, 4, 1)];

/// The read ceilings: the read-bandwidth kernel over 512 MiB of device-local memory
/// and 256 MiB of host-visible memory (where ring slots live), at a few grid sizes
/// (less where the device cannot bind that much at once); and the time a dispatch
/// that reads next to nothing takes in a chain.
fn read_ceilings(h: &KernelHarness, max_range: u64) {
    for (host, mib) in [(false, 512usize), (true, 256)] {
        let mib = mib.min((max_range >> 20) as usize / 2);
        let cols = 4096;
        let w = upload(h, (mib << 20) / 4 / cols, cols, 7, false, host);
        let bytes = (mib << 20) as f64;
        let place = if host { "host-visible" } else { "device-local" };
        for groups in [1056u32, 4224, 16896] {
            let secs = time(h, h.read_all(&w, groups, 0).expect("read"));
            report(&format!("read ceiling {place} {mib} MiB, {groups} workgroups"), secs, bytes);
        }
    }
    // The dispatch floor: a chain of dispatches that read 16 bytes each, with the
    // barrier every kernel of a layer step waits on in between.
    let w = upload(h, 1, 4, 7, false, false);
    let mut one = h.read_all(&w, 1, 0).expect("read");
    let secs = time(h, |r| (0..16).try_for_each(|_| one(r))) / 16.0;
    println!("dispatch floor (16-byte read, chained): {:.1} us", secs * 1e6);
}

fn kernels(device: usize, tunings: &[(u32, u32, u32)]) {
    let ctx = VulkanContext::new(device).expect("device");
    println!(
        "device: {} ({}, Vulkan {}, subgroup {:?})",
        ctx.info.name, ctx.info.driver, ctx.info.api_version, ctx.info.subgroup_size
    );
    // Qwen3-30B-A3B: hidden 2048, expert intermediate 768, 8 experts per token; 48
    // experts (6 groups of 8) so the L2 does not hold the weights.
    let (hid, inter, k, n_exp, tokens) = (2048usize, 768usize, 8usize, 48usize, 64usize);
    for (ti, &(lanes, rows_m1, unroll)) in tunings.iter().enumerate() {
        let tuning = MatmulTuning { lanes, rows_m1, unroll };
        println!("== tuning {tuning:?}");
        let h = KernelHarness::with_tuning(ctx.clone(), 16 << 20, 1 << 16, tuning).expect("harness");
        if ti == 0 {
            read_ceilings(&h, ctx.info.max_storage_buffer_range);
        }
        // The first tuning also runs the m=1 expert FFN with the routing data in host
        // memory, against the executor's placement, and reads weights in place from
        // host-visible memory as ring slots are.
        let host_route = (ti == 0).then(|| h.with_host_route().expect("harness"));
        let xs = fill(tokens * hid, 99);
        h.write_act(0, &xs).expect("x");
        let (x_off, hid_off) = (0u32, (tokens * hid) as u32);
        let y_off = hid_off + (n_exp * tokens * inter) as u32;
        for is_bf16 in [true, false] {
            let dsz = if is_bf16 { 2 } else { 4 };
            let name = if is_bf16 { "bf16" } else { "f32" };
            for host in [false, true] {
                if host && ti != 0 {
                    continue;
                }
                let place = if host { "host-visible (ring slot, zero-copy)" } else { "device-local" };
                let st = {
                    let gate = upload(&h, n_exp * inter, hid, 1, is_bf16, host);
                    let up = upload(&h, n_exp * inter, hid, 2, is_bf16, host);
                    let down = upload(&h, n_exp * hid, inter, 3, is_bf16, host);
                    let pair = h.pair(&gate, &up).expect("pair");
                    Stack { gate, pair, down }
                };
                let bytes = (3 * hid * inter * dsz) as f64;
                let runs: Vec<(&KernelHarness, usize, &str)> = [(&h, 1, ""), (&h, tokens, "")]
                    .into_iter()
                    .chain(host_route.iter().filter(|_| !host).map(|hr| (hr, 1, ", routing in host memory")))
                    .collect();
                for (hh, m, route_place) in runs {
                    // Table: expert e holds pairs e·m .. e·m + m - 1 (token = pair % m).
                    let tab = 1 << 14;
                    let mut route: Vec<u32> = (0..(n_exp * m) as u32).map(|p| p % m as u32).collect();
                    route.resize(tab, 0);
                    for e in 0..n_exp {
                        route.extend([(e * inter * hid) as u32, (e * m) as u32, m as u32]);
                    }
                    hh.write_route(&route).expect("route");
                    let gu = MatmulArgs {
                        rows: inter as u32,
                        cols: hid as u32,
                        x_off,
                        x_stride: hid as u32,
                        out_off: hid_off,
                        out_stride: inter as u32,
                        map_div: 1,
                        flags: FLAG_GATHER | FLAG_TABLE,
                        groups: k as u32,
                        ..Default::default()
                    };
                    let dn = MatmulArgs {
                        rows: hid as u32,
                        cols: inter as u32,
                        x_off: hid_off,
                        x_stride: inter as u32,
                        out_off: y_off,
                        out_stride: hid as u32,
                        flags: FLAG_TABLE,
                        groups: k as u32,
                        ..Default::default()
                    };
                    // The pair as the executor records it, then (m=1, first placement) each
                    // half alone: the gate/up (2/3 of the bytes) and the down projection.
                    let halves = m == 1 && route_place.is_empty() && !host;
                    let parts: &[(bool, bool, &str, f64)] = if halves {
                        &[
                            (true, true, "", 1.0),
                            (true, false, " (gate/up alone)", 2.0 / 3.0),
                            (false, true, " (down alone)", 1.0 / 3.0),
                        ]
                    } else {
                        &[(true, true, "", 1.0)]
                    };
                    for &(with_gu, with_dn, part, share) in parts {
                        let secs = time(hh, |r| {
                            for g in 0..n_exp / k {
                                let tab_off = (tab + 3 * k * g) as u32;
                                if with_gu {
                                    r.gate_up(
                                        st.gate.dtype,
                                        m > 1,
                                        st.pair.clone(),
                                        MatmulArgs { tab_off, ..gu },
                                    )?;
                                }
                                if with_dn {
                                    r.matmul(
                                        st.down.dtype,
                                        m > 1,
                                        st.down.set(),
                                        MatmulArgs { tab_off, ..dn },
                                    )?;
                                }
                            }
                            Ok(())
                        }) / (n_exp / k) as f64;
                        if m == 1 {
                            report(
                                &format!(
                                    "expert FFN m=1 {name} {place}{route_place}, {k} experts fused{part}"
                                ),
                                secs,
                                share * k as f64 * bytes,
                            );
                            continue;
                        }
                        let flops = 2.0 * (k * m) as f64 * 3.0 * (hid * inter) as f64;
                        println!(
                            "expert FFN m={m} {name} {place}, {k} experts fused: {:.1} us, {:.0} GFLOP/s",
                            secs * 1e6,
                            flops / secs / 1e9
                        );
                    }
                }
            }
            // Dense m=1 matvec at the q_proj shape (4096 x 2048), the LM head (151936 x
            // 2048), and 16 x 2048, whose time is the floor of any dispatch in a chain
            // (barrier, launch, one round of loads, reduction).
            for (rows, n) in [(4096usize, 16usize), (151936, 1), (16, 16)] {
                let ws: Vec<TestWeight> =
                    (0..n).map(|i| upload(&h, rows, hid, 1000 + i as u64, is_bf16, false)).collect();
                let a = MatmulArgs {
                    rows: rows as u32,
                    cols: hid as u32,
                    m: 1,
                    x_off,
                    x_stride: hid as u32,
                    out_off: y_off,
                    out_stride: rows as u32,
                    ..Default::default()
                };
                let secs = time(&h, |r| {
                    for w in &ws {
                        r.matmul(w.dtype, false, w.set(), a)?;
                    }
                    Ok(())
                }) / n as f64;
                report(&format!("dense matvec m=1 {name} {rows}x{hid}"), secs, (rows * hid * dsz) as f64);
            }
        }
    }
}

struct Rates {
    prefill: f64,
    decode: f64,
}

fn argmax(l: &[f32]) -> u32 {
    let mut b = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[b] {
            b = i;
        }
    }
    b as u32
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
    time_greedy(&mut engine.forward(chunk), prompt, decode)
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
    let mut fwd = VulkanForward::for_engine(ctx.clone(), &alloc, &engine, chunk).expect("vulkan forward");
    if let Some(p) = path {
        fwd.set_expert_path(p).expect("path");
    }
    time_greedy(&mut fwd, prompt, decode)
}

fn e2e(args: &[String]) {
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
/// busy GPU runs at rather than the idle one (see [`time`]).
fn warm_gpu(ctx: &Arc<VulkanContext>) {
    let h = KernelHarness::new(ctx.clone(), 1 << 20, 16).expect("harness");
    let w = upload(&h, 2048, 4096, 7, false, false);
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
    let mut fwd = VulkanForward::for_engine(ctx.clone(), &alloc, &engine, chunk).expect("forward");
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
fn diag(args: &[String]) {
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
    let cpu = greedy_logits(&mut engine.forward(1), &prompt, 8);
    let d = cpu.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    let scale = cpu.iter().map(|a| a.abs()).fold(0.0f32, f32::max);
    println!("cpu vs vulkan reference: max |diff| {d:e} (max |logit| {scale:e})");
}

/// What a driver reports about one executable (a compiled shader stage) of a pipeline.
struct Executable {
    name: String,
    description: String,
    subgroup_size: u32,
    /// (name, description, value) of every statistic, in the driver's order.
    stats: Vec<(String, String, String)>,
}

/// A driver-written, NUL-terminated name or description.
fn text(s: Result<&std::ffi::CStr, std::ffi::FromBytesUntilNulError>) -> String {
    s.map(|c| c.to_string_lossy().into_owned()).unwrap_or_else(|_| "?".into())
}

/// Fails on any result but `SUCCESS` and `INCOMPLETE` (fewer entries written than exist;
/// not expected, as the count cannot change between the two calls of the count-then-fill
/// idiom, and what was written is kept).
fn check(what: &str, r: vk::Result) -> Result<(), String> {
    match r {
        vk::Result::SUCCESS | vk::Result::INCOMPLETE => Ok(()),
        e => Err(format!("{what}: {e:?}")),
    }
}

/// The executables of `pipeline` (created with `CAPTURE_STATISTICS_KHR` on `device`,
/// which has VK_KHR_pipeline_executable_properties and `pipelineExecutableInfo` enabled)
/// and their statistics.
fn executables(device: &Device, pipeline: vk::Pipeline) -> Result<Vec<Executable>, String> {
    let f = &device.fns().khr_pipeline_executable_properties;
    let info = vk::PipelineInfoKHR::default().pipeline(pipeline);
    let mut n = 0u32;
    // SAFETY: the extension is enabled on `device` (checked by the caller), `pipeline` is a
    // live pipeline of it, and a null array asks only for the count.
    let r = unsafe {
        (f.get_pipeline_executable_properties_khr)(device.handle(), &info, &mut n, ptr::null_mut())
    };
    check("vkGetPipelineExecutablePropertiesKHR", r)?;
    let mut props = vec![vk::PipelineExecutablePropertiesKHR::default(); n as usize];
    // SAFETY: as above; `props` holds `n` structures with their sType set (`default()`).
    let r = unsafe {
        (f.get_pipeline_executable_properties_khr)(device.handle(), &info, &mut n, props.as_mut_ptr())
    };
    check("vkGetPipelineExecutablePropertiesKHR", r)?;
    props.truncate(n as usize);
    let mut out = Vec::new();
    for (i, p) in props.iter().enumerate() {
        let exe = vk::PipelineExecutableInfoKHR::default().pipeline(pipeline).executable_index(i as u32);
        let mut m = 0u32;
        // SAFETY: as above; `i` is below the executable count the driver reported.
        let r = unsafe {
            (f.get_pipeline_executable_statistics_khr)(device.handle(), &exe, &mut m, ptr::null_mut())
        };
        check("vkGetPipelineExecutableStatisticsKHR", r)?;
        let mut stats = vec![vk::PipelineExecutableStatisticKHR::default(); m as usize];
        // SAFETY: as above; `stats` holds `m` structures with their sType set.
        let r = unsafe {
            (f.get_pipeline_executable_statistics_khr)(device.handle(), &exe, &mut m, stats.as_mut_ptr())
        };
        check("vkGetPipelineExecutableStatisticsKHR", r)?;
        stats.truncate(m as usize);
        let stats = stats
            .iter()
            .map(|s| {
                use vk::PipelineExecutableStatisticFormatKHR as F;
                // SAFETY: `format` names the union member the driver wrote.
                let value = unsafe {
                    match s.format {
                        F::BOOL32 => (s.value.b32 != vk::FALSE).to_string(),
                        F::INT64 => s.value.i64.to_string(),
                        F::UINT64 => s.value.u64.to_string(),
                        F::FLOAT64 => s.value.f64.to_string(),
                        other => format!("(format {other:?}: raw {:#x})", s.value.u64),
                    }
                };
                (text(s.name_as_c_str()), text(s.description_as_c_str()), value)
            })
            .collect();
        out.push(Executable {
            name: text(p.name_as_c_str()),
            description: text(p.description_as_c_str()),
            subgroup_size: p.subgroup_size,
            stats,
        });
    }
    Ok(out)
}

/// Creates a compute pipeline of `module` (entry `main`, specialization constants 0, 1, 2
/// = `spec`) with `layout`, as `Kernels::new` does but with `CAPTURE_STATISTICS_KHR`, and
/// returns what the driver reports about it; the pipeline is destroyed before returning.
fn pipeline_stats(
    device: &Device,
    module: &ShaderModule,
    layout: &PipelineLayout,
    spec: [u32; 3],
) -> Result<Vec<Executable>, String> {
    let entries: Vec<vk::SpecializationMapEntry> = (0..3u32)
        .map(|i| vk::SpecializationMapEntry::default().constant_id(i).offset(4 * i).size(4))
        .collect();
    let data: Vec<u8> = spec.iter().flat_map(|v| v.to_ne_bytes()).collect();
    let spec_info = vk::SpecializationInfo::default().map_entries(&entries).data(&data);
    let stage = vk::PipelineShaderStageCreateInfo::default()
        .stage(vk::ShaderStageFlags::COMPUTE)
        .module(module.handle())
        .name(c"main")
        .specialization_info(&spec_info);
    let info = vk::ComputePipelineCreateInfo::default()
        .flags(vk::PipelineCreateFlags::CAPTURE_STATISTICS_KHR)
        .stage(stage)
        .layout(layout.handle())
        .base_pipeline_index(-1);
    let fns = device.fns();
    let mut pipeline = vk::Pipeline::null();
    // SAFETY: `module` and `layout` are live objects of `device` (the layout was made from
    // the same module's reflection by `Kernels::new`), `info` and everything it points to
    // (stage, specialization entries and data, the entry name) outlive the call, the
    // pipelineExecutableInfo feature that CAPTURE_STATISTICS_KHR needs is enabled (checked
    // by the caller), and one create info writes one pipeline.
    let r = unsafe {
        (fns.v1_0.create_compute_pipelines)(
            device.handle(),
            vk::PipelineCache::null(),
            1,
            &info,
            ptr::null(),
            &mut pipeline,
        )
    };
    if r != vk::Result::SUCCESS {
        return Err(format!("vkCreateComputePipelines: {r:?}"));
    }
    let out = executables(device, pipeline);
    // SAFETY: `pipeline` was created above, no command buffer uses it, and it is destroyed
    // once.
    unsafe { (fns.v1_0.destroy_pipeline)(device.handle(), pipeline, ptr::null()) };
    out
}

/// Prints `error: MSG` and ends the program with status `code`.
fn fail(code: i32, msg: String) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(code)
}

/// `vulkan stats`: the driver's statistics for every matmul-family kernel, specialised
/// for the default tuning and then each of `extra`.
fn stats(device: usize, extra: &[(u32, u32, u32)]) {
    let ctx = VulkanContext::new(device).unwrap_or_else(|e| fail(1, e.to_string()));
    let dev = &ctx.device;
    if !dev.enabled_extensions().khr_pipeline_executable_properties
        || !dev.enabled_features().pipeline_executable_info
    {
        fail(
            2,
            format!(
                "device {device} ({}, {}) does not support VK_KHR_pipeline_executable_properties; its driver reports no pipeline statistics (run this on the GPU's own driver)",
                ctx.info.name, ctx.info.driver
            ),
        );
    }
    println!(
        "device: {} ({}, Vulkan {}, subgroup {:?})",
        ctx.info.name, ctx.info.driver, ctx.info.api_version, ctx.info.subgroup_size
    );
    let d = MatmulTuning::default();
    let mut tunings = vec![d];
    for &(lanes, rows_m1, unroll) in extra {
        let t = MatmulTuning { lanes, rows_m1, unroll };
        if !tunings.contains(&t) {
            tunings.push(t);
        }
    }
    // (module, kernel of a `TypedKernels`, whether it is a token-batched kernel), in the
    // order printed: matvec_f32, matvec_bf16, matmul_f32, ...
    let mut modules = Vec::new();
    for (kind, batched) in
        [("matvec", false), ("matmul", true), ("gate_up", false), ("gate_up_batched", true)]
    {
        for ty in ["f32", "bf16"] {
            let name = format!("{kind}_{ty}");
            let words = spirv(&name).unwrap_or_else(|e| fail(1, e.to_string()));
            // SAFETY: the words are SPIR-V produced by glslc from this repository's shaders,
            // the modules `Kernels::new` loads.
            let module = unsafe { ShaderModule::new(dev.clone(), ShaderModuleCreateInfo::new(&words)) }
                .unwrap_or_else(|e| fail(1, format!("shader module `{name}`: {e}")));
            modules.push((name, kind, ty, batched, module));
        }
    }
    // Statistic name -> the driver's description, in first-seen order.
    let mut legend: Vec<(String, String)> = Vec::new();
    // Building each tuning's kernels checks the tuning as the backend does, before any
    // output; their layouts are reused (a layout depends on the module, not on the
    // specialization constants).
    let built: Vec<(MatmulTuning, Kernels)> = tunings
        .into_iter()
        .map(|t| (t, Kernels::new(dev, t).unwrap_or_else(|e| fail(2, format!("tuning {t:?}: {e}")))))
        .collect();
    for (t, kernels) in built {
        let default = if t == d { " (default)" } else { "" };
        println!("== tuning {t:?}{default}");
        for (name, kind, ty, batched, module) in &modules {
            let typed = if *ty == "bf16" { &kernels.bf16 } else { &kernels.f32 };
            let kernel = match *kind {
                "matvec" => &typed.matvec,
                "matmul" => &typed.matmul,
                "gate_up" => &typed.gate_up,
                _ => &typed.gate_up_batched,
            };
            // As `Kernels::new` specialises them: (rows per lane group, unroll, lanes).
            let spec = if *batched { [1, t.unroll.min(2), t.lanes] } else { [t.rows_m1, t.unroll, t.lanes] };
            println!("{name} (rows {}, unroll {}, lanes {}):", spec[0], spec[1], spec[2]);
            let exes = pipeline_stats(dev, module, &kernel.layout, spec)
                .unwrap_or_else(|e| fail(1, format!("{name}: {e}")));
            if exes.is_empty() {
                println!("  (the driver reports no executables)");
            }
            for e in exes {
                println!("  executable `{}` (subgroup {}): {}", e.name, e.subgroup_size, e.description);
                if e.stats.is_empty() {
                    println!("    (no statistics)");
                }
                for (stat, desc, value) in e.stats {
                    println!("    {stat}: {value}");
                    if !legend.iter().any(|(n, _)| *n == stat) {
                        legend.push((stat, desc));
                    }
                }
            }
        }
    }
    if !legend.is_empty() {
        println!("== statistics, as the driver describes them");
        for (stat, desc) in legend {
            println!("{stat}: {desc}");
        }
    }
}

/// Tunings given after the device (`args[2..]`): LANES,ROWS,UNROLL each; a malformed one
/// ends the program with status 2.
fn parse_tunings(args: &[String]) -> Vec<(u32, u32, u32)> {
    args.iter()
        .skip(2)
        .map(|t| {
            let v: Vec<u32> = t.split(',').filter_map(|x| x.parse().ok()).collect();
            if v.len() != 3 {
                eprintln!("error: tuning `{t}` is not LANES,ROWS,UNROLL (three numbers)");
                std::process::exit(2);
            }
            (v[0], v[1], v[2])
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("kernels") => {
            // Optional tunings after the device: LANES,ROWS,UNROLL ...
            let picked = parse_tunings(&args);
            let tunings = if picked.is_empty() { TUNINGS } else { &picked[..] };
            kernels(args.get(1).and_then(|s| s.parse().ok()).unwrap_or(0), tunings)
        }
        Some("stats") => {
            let device = args.get(1).map_or(Ok(0), |s| s.parse());
            let device = device.unwrap_or_else(|_| fail(2, format!("DEVICE `{}` is not a number", args[1])));
            stats(device, &parse_tunings(&args))
        }
        Some("e2e") if args.len() >= 2 => e2e(&args[1..]),
        Some("diag") if args.len() >= 2 => diag(&args[1..]),
        _ => {
            eprintln!(
                "usage: vulkan kernels [DEVICE] [LANES,ROWS,UNROLL ...] | vulkan stats [DEVICE] [LANES,ROWS,UNROLL ...] | vulkan e2e VAULT [PROMPT] [DECODE] [CHUNK] [STREAM_SLOTS] [DEVICE] [MODES] [PATH] | vulkan diag VAULT [DEVICE]"
            );
            std::process::exit(2);
        }
    }
}
