//! The engine on the Vulkan backend: the fixtures' greedy ids, logits against the CPU
//! backend (and transformers) within a measured tolerance, and layer-major blocks
//! byte-identical to token-serial replay on the same backend, with lookahead on or off.
#![cfg(feature = "vulkan")]

mod common;
mod vulkan;

use std::path::Path;
use std::sync::Arc;

use common::*;
use smoe_actors::contract::{ForwardPass, KvState};
use smoe_actors::engine::{Engine, EngineOptions, RingSize, VramSize};
use smoe_actors::ring::memory::HostAllocator;
use smoe_actors::streamer::{FaultInjector, FaultKind, StreamerOptions};
use smoe_actors::vulkan::{ExpertPath, VulkanAllocator, VulkanContext, VulkanPass};

/// Agreement required between the Vulkan and CPU logits, hybrid fixtures included (the
/// recurrent state carries each token's rounding into every later one; measured max on
/// lavapipe: see bench/README.md).
const CPU_TOLERANCE: f32 = 1e-4;
/// Agreement required with the transformers goldens, as for the CPU engine (measured
/// max on lavapipe: see bench/README.md).
const GOLDEN_TOLERANCE: f32 = 1e-4;

fn opts(ring_slots: usize) -> EngineOptions {
    EngineOptions { max_context: 256, ring: RingSize::Slots(ring_slots), ..Default::default() }
}

/// The greedy token of `logits`.
fn argmax(logits: &[f32]) -> u32 {
    smoe_actors::sampler::argmax(logits) as u32
}

/// Prefills `prompt[..n-1]` in blocks of `chunk`, then decodes `steps` greedy tokens;
/// returns the ids and the logits of every decode step. Works on either backend.
fn run_greedy<P: ForwardPass>(
    fwd: &mut P,
    prompt: &[u32],
    steps: usize,
    chunk: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut kv = fwd.new_kv().unwrap();
    let (last, body) = prompt.split_last().unwrap();
    for c in body.chunks(chunk) {
        assert!(fwd.forward(&mut kv, c, false).unwrap().is_none());
    }
    let (mut ids, mut rows) = (Vec::new(), Vec::new());
    let mut next = *last;
    for _ in 0..steps {
        let l = fwd.forward(&mut kv, &[next], true).unwrap().unwrap().to_vec();
        next = argmax(&l);
        ids.push(next);
        rows.push(l);
    }
    assert_eq!(kv.len(), prompt.len() + steps - 1);
    (ids, rows)
}

fn max_diff(a: &[Vec<f32>], b: &[f32]) -> f32 {
    a.iter().flatten().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn open(ctx: &Arc<VulkanContext>, vault: &Path, slots: usize, max_rows: usize) -> (Engine, VulkanPass) {
    open_with(ctx, vault, &opts(slots), max_rows)
}

fn open_with(
    ctx: &Arc<VulkanContext>,
    vault: &Path,
    opts: &EngineOptions,
    max_rows: usize,
) -> (Engine, VulkanPass) {
    let alloc = VulkanAllocator::new(ctx.clone());
    let engine = Engine::open(vault, opts, &alloc).unwrap();
    // These tests pick the expert paths; the VRAM tier (which replaces them) is off.
    let fwd =
        VulkanPass::for_engine(ctx.clone(), &alloc, &engine, max_rows, (VramSize::Bytes(0), None)).unwrap();
    (engine, fwd)
}

/// A greedy run: the token ids and the logits of every decode step.
type Run = (Vec<u32>, Vec<Vec<f32>>);

/// Runs each case (prompt, greedy steps) on the Vulkan backend serially (ring of 64
/// slots), in layer-major blocks of 3 and 8 tokens with a ring of 3 slots (smaller than a
/// block's union: the expert work then runs in batches the ring can hold), and on the CPU
/// backend. Layer-major logits must be byte-identical to serial ones, greedy ids equal
/// to the CPU's and logits within [`CPU_TOLERANCE`] of them. Returns each case's Vulkan
/// ids and logits, and the largest |Vulkan − CPU|.
fn check_against_cpu(ctx: &Arc<VulkanContext>, vault: &Path, cases: &[(Vec<u32>, usize)]) -> (Vec<Run>, f32) {
    let cpu = Engine::open(vault, &opts(64), &HostAllocator).unwrap();
    let (_e1, mut serial) = open(ctx, vault, 64, 1);
    let (_e2, mut chunked) = open(ctx, vault, 3, 8);
    let mut worst = 0.0f32;
    let mut out = Vec::new();
    for (i, (prompt, steps)) in cases.iter().enumerate() {
        let (ids, rows) = run_greedy(&mut serial, prompt, *steps, 1);
        for chunk in [3, 8] {
            let (cids, crows) = run_greedy(&mut chunked, prompt, *steps, chunk);
            assert_eq!(cids, ids, "{vault:?} case {i}: chunk {chunk} ids");
            let a: Vec<u32> = rows.iter().flatten().map(|v| v.to_bits()).collect();
            let b: Vec<u32> = crows.iter().flatten().map(|v| v.to_bits()).collect();
            assert!(
                a == b,
                "{vault:?} case {i}: layer-major (chunk {chunk}) logits are not byte-identical to serial"
            );
        }
        let (cpu_ids, cpu_rows) =
            run_greedy(&mut smoe_actors::executor::cpu_pass(&cpu, 1), prompt, *steps, 1);
        assert_eq!(ids, cpu_ids, "{vault:?} case {i}: Vulkan greedy ids differ from the CPU's");
        let flat: Vec<f32> = cpu_rows.iter().flatten().copied().collect();
        let d = max_diff(&rows, &flat);
        worst = worst.max(d);
        assert!(d <= CPU_TOLERANCE, "{vault:?} case {i}: max |Vulkan - CPU| logit {d} > {CPU_TOLERANCE}");
        out.push((ids, rows));
    }
    (out, worst)
}

/// Fixture `name` converted from its checkpoint with `convert_args`: goldens and the CPU.
fn check_fixture(name: &str, convert_args: &[&str]) {
    let Some(ctx) = vulkan::context() else { return };
    let dir = tempfile::tempdir().unwrap();
    let vault = convert(name, dir.path(), convert_args);
    check_vault(&ctx, name, &format!("{convert_args:?}"), &vault);
}

/// Fixture `name`'s golden cases on `vault` (made from it as `how` says): greedy ids
/// equal to transformers', logits within [`GOLDEN_TOLERANCE`] of theirs, and
/// [`check_against_cpu`].
fn check_vault(ctx: &Arc<VulkanContext>, name: &str, how: &str, vault: &Path) {
    let golden = fixture(name).join("golden_logits.safetensors");
    let goldens = golden_cases(name);
    let cases: Vec<(Vec<u32>, usize)> = goldens.iter().map(|(p, g)| (p.clone(), g.len())).collect();
    let (runs, worst_cpu) = check_against_cpu(ctx, vault, &cases);
    let mut worst_golden = 0.0f32;
    for (i, ((ids, rows), (_, greedy))) in runs.iter().zip(&goldens).enumerate() {
        assert_eq!(ids, greedy, "{name} case {i}: Vulkan greedy ids differ from transformers");
        let (_, theirs) = read_f32(&golden, &format!("case{i}"));
        let g = max_diff(rows, &theirs);
        worst_golden = worst_golden.max(g);
        assert!(g <= GOLDEN_TOLERANCE, "{name} case {i}: max |Vulkan - transformers| {g}");
    }
    eprintln!(
        "{name} {how} on {}: max |Vulkan - CPU| = {worst_cpu:e}, max |Vulkan - transformers| = {worst_golden:e}",
        ctx.info.name
    );
}

/// Every GGUF fixture converted with `convert --gguf` (tensors kept in their formats:
/// F32, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, and the Q4_K_M mix whose tied Q6_K embedding
/// is looked up on the device) against transformers loading the GGUF, and the CPU.
#[test]
fn vulkan_gguf_fixtures_match() {
    let Some(ctx) = vulkan::context() else { return };
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "gguf_f32",
        "gguf_bf16",
        "gguf_q8_0",
        "gguf_q4_0",
        "gguf_q4_k",
        "gguf_q5_k",
        "gguf_q6_k",
        "gguf_q4_k_m",
    ] {
        check_vault(&ctx, name, "convert --gguf", &convert_gguf(name, dir.path()));
    }
}

/// Quantised experts (`synth --preset small --quant SCHEME`: hidden and expert sizes of
/// 256, so every block format applies; Q4_K_M and Q5_K_M keep the down projections of
/// the last two layers in Q6_K) agree with the CPU backend, layer-major and serial alike.
#[test]
fn vulkan_quantised_vaults_match_the_cpu() {
    let Some(ctx) = vulkan::context() else { return };
    let dir = tempfile::tempdir().unwrap();
    let prompt = |n: u32| (0..n).map(|i| (i * 37 + 11) % 512).collect::<Vec<u32>>();
    let cases = [(prompt(1), 3), (prompt(11), 4), (prompt(20), 3)];
    for scheme in ["q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0"] {
        let vault = dir.path().join(format!("{scheme}.vault"));
        let v = vault.to_str().unwrap();
        run_ok(&["synth", "--out", v, "--preset", "small", "--seed", "3", "--quant", scheme]);
        let (_, worst) = check_against_cpu(&ctx, &vault, &cases);
        eprintln!("synth small --quant {scheme} on {}: max |Vulkan - CPU| = {worst:e}", ctx.info.name);
    }
}

#[test]
fn vulkan_all_moe_f32_matches() {
    check_fixture("moe_all", &[]);
}

#[test]
fn vulkan_dense_layer0_gqa_tied_matches() {
    check_fixture("dense0_gqa", &[]);
}

#[test]
fn vulkan_bf16_sharded_matches() {
    check_fixture("bf16_sharded", &[]);
}

/// The hybrid fixtures (Qwen3-Next fused and Qwen3.5-MoE split projections, f32 and
/// bf16, partial RoPE, DeltaNet states on the device): goldens, the CPU, and layer-major
/// blocks byte-identical to serial replay.
#[test]
fn vulkan_hybrid_fixtures_match() {
    let Some(ctx) = vulkan::context() else { return };
    let dir = tempfile::tempdir().unwrap();
    for name in HYBRID_FIXTURES {
        check_vault(&ctx, name, "convert", &convert(name, dir.path(), &[]));
    }
}

/// A hybrid session's cache on the device returns to a state snapshot (a device copy)
/// or to nothing, and resumes byte-identical to a fresh run of the same tokens.
#[test]
fn vulkan_hybrid_state_snapshots_resume_bytewise() {
    let Some(ctx) = vulkan::context() else { return };
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("q35_f32", dir.path(), &[]);
    let (_e, mut fwd) = open(&ctx, &vault, 64, 8);
    let tokens: Vec<u32> = (0..23).map(|i| (i * 37 + 5) % 400).collect();
    // Runs tokens[from..] in blocks of 8, snapshotting after each; the last logits.
    let run = |fwd: &mut VulkanPass, kv: &mut smoe_actors::vulkan::VulkanKvCache, from: usize| {
        let mut last = Vec::new();
        for c in tokens[from..].chunks(8) {
            last = fwd.forward(kv, c, true).unwrap().unwrap().to_vec();
            kv.snapshot();
        }
        last.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
    };
    let mut fresh = fwd.new_kv().unwrap();
    let want = run(&mut fwd, &mut fresh, 0);
    let mut kv = fwd.new_kv().unwrap();
    run(&mut fwd, &mut kv, 0);
    // Snapshots at 8 and (16 apart) never at 16: cutting to 20 returns to 8.
    assert_eq!(kv.reusable(20), 8);
    assert_eq!(kv.truncate(20), 8);
    assert_eq!(run(&mut fwd, &mut kv, 8), want, "resumed from the snapshot at 8");
    // A refused block leaves the cache as it was.
    let len = kv.len();
    assert!(fwd.forward(&mut kv, &[100_000], true).is_err());
    assert_eq!((kv.len(), kv.reusable(20)), (len, 8));
    assert_eq!(kv.truncate(5), 0);
    assert_eq!(run(&mut fwd, &mut kv, 0), want, "restarted from nothing");
    assert!(kv.state_bytes() > 0);
}

/// Long prompts (their context spans several attention chunks and ends inside one)
/// prefilled in layer-major blocks of 7 and 64 tokens give the bytes of token-serial
/// replay (blocks of 1), on a Qwen3-MoE fixture and a hybrid one (gated attention).
#[test]
fn vulkan_long_prompts_prefill_bytewise_at_any_block_size() {
    let Some(ctx) = vulkan::context() else { return };
    let dir = tempfile::tempdir().unwrap();
    for name in ["moe_all", "q35_f32"] {
        let vault = convert(name, dir.path(), &[]);
        let (_e, mut fwd) = open(&ctx, &vault, 64, 64);
        for len in [150, 203] {
            let prompt: Vec<u32> = (0..len).map(|i| (i * 37 + 5) % 400).collect();
            let (ids, rows) = run_greedy(&mut fwd, &prompt, 3, 1);
            let want: Vec<u32> = rows.iter().flatten().map(|v| v.to_bits()).collect();
            for chunk in [7, 64] {
                let (cids, crows) = run_greedy(&mut fwd, &prompt, 3, chunk);
                assert_eq!(cids, ids, "{name} prompt {len}: blocks of {chunk}: ids");
                let got: Vec<u32> = crows.iter().flatten().map(|v| v.to_bits()).collect();
                assert!(
                    got == want,
                    "{name} prompt {len}: blocks of {chunk} are not byte-identical to serial"
                );
            }
        }
    }
}

/// A block that fails inside the pass, after the state copies its cache queued were
/// recorded (an injected read error of an expert it needs), drops the session's states and
/// snapshots: the cache falls back to no reusable prefix, never to a snapshot the failed
/// submission may have half written, and a rerun from nothing is byte-identical to a fresh
/// run.
#[test]
fn vulkan_hybrid_failed_block_drops_the_states_and_snapshots() {
    let Some(ctx) = vulkan::context() else { return };
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("q35_f32", dir.path(), &[]);
    let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 400).collect();
    // Runs tokens in blocks of 8, snapshotting after each, up to a failed block; the last
    // logits and where it failed.
    let run = |fwd: &mut VulkanPass, kv: &mut smoe_actors::vulkan::VulkanKvCache| {
        let mut last = Vec::new();
        for (i, c) in tokens.chunks(8).enumerate() {
            match fwd.forward(kv, c, true) {
                Ok(l) => last = l.unwrap().iter().map(|v| v.to_bits()).collect::<Vec<u32>>(),
                Err(_) => return (last, Some(8 * i)),
            }
            kv.snapshot();
        }
        (last, None)
    };
    // A fresh run, and in its trace an expert first read after the first snapshot.
    let (_e, mut fwd) = open(&ctx, &vault, 64, 8);
    fwd.enable_trace();
    let mut fresh = fwd.new_kv().unwrap();
    let (want, failed) = run(&mut fwd, &mut fresh);
    assert_eq!(failed, None);
    let trace = fwd.take_trace();
    let late = trace.iter().find(|e| !e.hit && e.pos >= 8).expect("an expert first read after block 0");
    // The same run with that read failing once.
    let key = smoe_proto::ExpertKey::new(late.layer, late.expert);
    let fault = Some(Arc::new(FaultInjector::new(key, FaultKind::Eio, 1)));
    let opts = EngineOptions { streamer: StreamerOptions { fault, ..Default::default() }, ..opts(64) };
    let (_e, mut fwd) = open_with(&ctx, &vault, &opts, 8);
    let mut kv = fwd.new_kv().unwrap();
    assert_eq!(run(&mut fwd, &mut kv).1, Some(late.pos), "the block reading {key} fails");
    assert_eq!((kv.len(), kv.reusable(late.pos), kv.reusable(8)), (0, 0, 0), "nothing is reusable");
    assert_eq!(run(&mut fwd, &mut kv), (want, None), "rerun from nothing");
}

#[test]
fn vulkan_staged_and_zero_copy_prefill_agree_bytewise() {
    let Some(ctx) = vulkan::context() else { return };
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let (_e, mut fwd) = open(&ctx, &vault, 64, 8);
    let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + 5) % 448).collect();
    fwd.set_expert_path(ExpertPath::ZeroCopy).unwrap();
    let (a_ids, a) = run_greedy(&mut fwd, &prompt, 4, 8);
    for path in [ExpertPath::StagedPrefill, ExpertPath::Staged] {
        fwd.set_expert_path(path).unwrap();
        let (b_ids, b) = run_greedy(&mut fwd, &prompt, 4, 8);
        assert_eq!(a_ids, b_ids, "{path:?}");
        assert!(
            a.iter().flatten().zip(b.iter().flatten()).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{path:?}"
        );
    }
}

/// The executor's greedy choice (`forward_greedy`, made on the device without handing the
/// logits over) is the argmax of the logits `forward` hands over, token by token; a pass
/// asked for logits after greedy ones gets them whole.
#[test]
fn vulkan_greedy_choice_is_the_argmax_of_the_logits() {
    let Some(ctx) = vulkan::context() else { return };
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let (_e, mut fwd) = open(&ctx, &vault, 64, 8);
    let prompt: Vec<u32> = (0..13).map(|i| (i * 53 + 7) % 448).collect();
    let (want, rows) = run_greedy(&mut fwd, &prompt, 6, 8);
    let mut kv = fwd.new_kv().unwrap();
    let (last, body) = prompt.split_last().unwrap();
    for c in body.chunks(8) {
        fwd.forward(&mut kv, c, false).unwrap();
    }
    let mut next = *last;
    let mut ids = Vec::new();
    for _ in 0..5 {
        next = fwd.forward_greedy(&mut kv, &[next]).unwrap();
        ids.push(next);
    }
    let logits = fwd.forward(&mut kv, &[next], true).unwrap().unwrap();
    assert_eq!(logits.len(), rows[5].len());
    assert!(logits.iter().zip(&rows[5]).all(|(a, b)| a.to_bits() == b.to_bits()));
    ids.push(argmax(logits));
    assert_eq!(ids, want);
}

#[test]
fn vulkan_bad_input_is_an_error_not_a_panic() {
    let Some(ctx) = vulkan::context() else { return };
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let (_e, mut fwd) = open(&ctx, &vault, 8, 4);
    let mut kv = fwd.new_kv().unwrap();
    let err = fwd.forward(&mut kv, &[100_000], true).unwrap_err().to_string();
    assert!(err.contains("out of the vocabulary"), "{err}");
    let err = fwd.forward(&mut kv, &[1; 5], true).unwrap_err().to_string();
    assert!(err.contains("block of 5 tokens"), "{err}");
    assert!(VulkanContext::new(999).err().unwrap().to_string().contains("--backend cpu"));
}

#[test]
fn vulkan_lookahead_never_changes_a_byte() {
    let Some(ctx) = vulkan::context() else { return };
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let prompt: Vec<u32> = (0..100).map(|i| (i * 37 % 400) as u32).collect();
    // A ring that cannot hold a layer's experts beside the next one's, and one holding all.
    for slots in [6, 64] {
        let run = |lookahead: usize| {
            let (engine, mut fwd) = open_with(&ctx, &vault, &EngineOptions { lookahead, ..opts(slots) }, 16);
            let (ids, rows) = run_greedy(&mut fwd, &prompt, 4, 16);
            (ids, rows, engine.ring.stats())
        };
        let (ids, rows, off) = run(0);
        let (la_ids, la_rows, on) = run(8);
        assert_eq!(ids, la_ids, "{slots} slots");
        let bits = |r: &[Vec<f32>]| r.iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert!(bits(&rows) == bits(&la_rows), "{slots} slots: lookahead changed the logits");
        assert_eq!(off.lookahead_reads, 0);
        assert!(on.lookahead_reads > 0 && on.lookahead_used_bytes <= on.lookahead_bytes, "{on:?}");
        if slots == 64 {
            assert!(on.lookahead_used > 0, "{on:?}");
        }
    }
}
