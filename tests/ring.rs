//! The streaming core: ring cache state machine under concurrency, exactness across
//! ring sizes and I/O paths, exact I/O accounting against a plain LRU replay, and
//! fault handling (short read, EIO, checksum) that leaves the engine usable.

mod common;

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::*;
use rand::{Rng, SeedableRng};
use smoe_actors::contract::ForwardPass;
use smoe_actors::cpu::KvCache;
use smoe_actors::engine::{Engine, EngineOptions, RingSize};
use smoe_actors::generation::GenerateRequest;
use smoe_actors::ring::memory::{HostAllocator, SlotAllocator, SlotArena};
use smoe_actors::ring::slots::{CONSUMED, EMPTY, LOADING, READY};
use smoe_actors::sampler::SamplingParams;
use smoe_actors::streamer::{FaultInjector, FaultKind, IoChoice, StreamerOptions};
use smoe_actors::vault::Vault;
use smoe_proto::{ExpertKey, ExpertSource, Lookahead};

const IO_PATHS: [(&str, IoChoice); 2] = [("pread", IoChoice::Pread), ("io-uring", IoChoice::IoUring)];

fn open(vault: &Path, slots: usize, io: IoChoice, fault: Option<Arc<FaultInjector>>) -> Engine {
    open_with(vault, slots, io, fault, &HostAllocator)
}

/// [`open`] with slot memory from `alloc`.
fn open_with(
    vault: &Path,
    slots: usize,
    io: IoChoice,
    fault: Option<Arc<FaultInjector>>,
    alloc: &dyn SlotAllocator,
) -> Engine {
    let opts = EngineOptions {
        max_context: 256,
        ring: RingSize::Slots(slots),
        streamer: StreamerOptions { io, queue_depth: 4, fault },
        ..Default::default()
    };
    Engine::open(vault, &opts, alloc).expect("engine opens")
}

fn greedy(engine: &Engine, prompt: &[u32], n: usize) -> Result<Vec<u32>, String> {
    let mut fwd = smoe_actors::executor::cpu_pass(engine, 1);
    let mut kv = KvCache::new(&engine.model);
    let req = GenerateRequest {
        prompt: prompt.to_vec(),
        max_tokens: n,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        spec_depth: 0,
        logits: false,
    };
    let (_, _, ids) = generate_ids(&mut fwd, &mut kv, &req).map_err(|e| e.to_string())?;
    Ok(ids)
}

#[test]
fn concurrent_claims_loads_and_evictions_keep_the_invariants() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("bf16_sharded", dir.path(), &[]);
    for (name, io) in IO_PATHS {
        let engine = open(&vault, 5, io, None);
        let ring = engine.ring.clone();
        let cfg = engine.model.cfg.clone();
        let moe: Vec<usize> = cfg.moe_layers();
        let crcs: Vec<Vec<u32>> = engine
            .vault
            .manifest()
            .experts
            .layers
            .iter()
            .map(|l| l.blobs.iter().map(|b| b.crc32c).collect())
            .collect();
        let claims = Arc::new(AtomicU64::new(0));
        std::thread::scope(|scope| {
            for t in 0..8u64 {
                let (ring, moe, crcs, claims, cfg) =
                    (ring.clone(), moe.clone(), crcs.clone(), claims.clone(), cfg.clone());
                scope.spawn(move || {
                    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(t);
                    for _ in 0..300 {
                        let li = rng.random_range(0..moe.len());
                        let key = ExpertKey::new(moe[li], rng.random_range(0..cfg.num_experts));
                        let check = |h: &smoe_proto::ExpertHandle| {
                            assert_eq!(
                                crc32c::crc32c(h),
                                crcs[li][key.expert as usize],
                                "{name}: {key} bytes changed while referenced"
                            );
                        };
                        match rng.random_range(0..6) {
                            0 | 1 => {
                                if rng.random_bool(0.5) {
                                    ring.announce(key);
                                }
                                let h = ring.claim(key).expect("claim succeeds");
                                claims.fetch_add(1, Ordering::Relaxed);
                                assert_eq!(h.key(), key);
                                check(&h);
                                std::thread::yield_now();
                                std::thread::sleep(std::time::Duration::from_micros(
                                    rng.random_range(0..300),
                                ));
                                check(&h);
                            }
                            2 => {
                                ring.bet(key);
                            }
                            3 => {
                                ring.lookahead(key);
                            }
                            4 => {
                                if ring.lookahead(key) == Lookahead::Queued {
                                    ring.withdraw_lookahead(key);
                                }
                            }
                            _ => {
                                if ring.announce(key) {
                                    ring.withdraw(key);
                                }
                            }
                        }
                    }
                });
            }
            // A checker thread validates the structure while the others churn.
            let ring = ring.clone();
            scope.spawn(move || {
                for _ in 0..200 {
                    ring.check_invariants(false).unwrap_or_else(|e| panic!("{name}: {e}"));
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
            });
        });
        // Let speculative reads still in flight land, then check the idle ring.
        for _ in 0..1000 {
            if ring.stats().slots[LOADING as usize] == 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        ring.check_invariants(true).unwrap_or_else(|e| panic!("{name}: {e}"));
        let s = ring.stats();
        let claims = claims.load(Ordering::Relaxed);
        assert_eq!(s.hits + s.misses, claims, "{name}: every claim is a hit or a miss");
        assert_eq!(s.slots.iter().sum::<u64>(), ring.n_slots() as u64, "{name}: slot states conserved");
        assert_eq!(s.slots[EMPTY as usize] + s.slots[READY as usize] + s.slots[CONSUMED as usize], 5);
        let blob = engine.vault.manifest().experts.layers[0].layout.blob_len;
        assert_eq!(s.bytes_read, s.blob_reads * blob, "{name}");
        assert!(s.misses + s.bets_used + s.lookahead_used <= s.blob_reads, "{name}: {s:?}");
        assert!(s.lookahead_used_bytes <= s.lookahead_bytes, "{name}: {s:?}");
        assert_eq!(s.lookahead_bytes, s.lookahead_reads * blob, "{name}: every lookahead read landed: {s:?}");
        assert!(s.bets_used <= s.bets_issued && s.evictions <= s.blob_reads, "{name}: {s:?}");
        assert!(s.evictions >= s.blob_reads - 5, "{name}: every read beyond the slot count evicts: {s:?}");
        assert_eq!(s.read_errors, 0);
    }
}

#[test]
fn ring_size_and_io_path_never_change_the_arithmetic() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["moe_all", "bf16_sharded"] {
        let vault = convert(name, dir.path(), &[]);
        let (prompt, greedy) = golden_cases(name).remove(1);
        let mut reference: Option<Vec<u8>> = None;
        // 1 slot is smaller than one token's working set; 10000 exceeds the whole model.
        for slots in ["1", "3", "10000"] {
            for (io, _) in IO_PATHS {
                let lpath = dir.path().join(format!("{name}-{slots}-{io}.safetensors"));
                let out = generate_json(
                    &vault,
                    &prompt,
                    greedy.len(),
                    &lpath,
                    &["--ring-slots", slots, "--io", io],
                );
                assert_eq!(id_list(&out["token_ids"]), greedy, "{name} slots {slots} io {io}");
                assert_eq!(out["stats"]["io"], io);
                let bytes = std::fs::read(&lpath).unwrap();
                match &reference {
                    None => reference = Some(bytes),
                    Some(r) => assert!(r == &bytes, "{name}: logits differ with {slots} slots via {io}"),
                }
            }
        }
    }
}

#[test]
fn trace_replays_through_a_plain_lru_with_exact_byte_accounting() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let (prompt, _) = golden_cases("moe_all").remove(1);
    let blob_len = {
        let m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(vault.join("manifest.json")).unwrap()).unwrap();
        m["experts"]["layers"][0]["layout"]["blob_len"].as_u64().unwrap()
    };
    for capacity in [1usize, 2, 5, 13, 24] {
        let trace = dir.path().join(format!("trace{capacity}.jsonl"));
        let lp = dir.path().join("l.safetensors");
        let cap = capacity.to_string();
        let out = generate_json(
            &vault,
            &prompt,
            12,
            &lp,
            &["--ring-slots", &cap, "--trace-out", trace.to_str().unwrap()],
        );
        let events: Vec<serde_json::Value> = std::fs::read_to_string(&trace)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert!(!events.is_empty());
        let mut lru: VecDeque<(u64, u64)> = VecDeque::new();
        let (mut missed_bytes, mut misses, mut hits) = (0u64, 0u64, 0u64);
        let mut last_pos = 0;
        for (i, e) in events.iter().enumerate() {
            let key = (e["layer"].as_u64().unwrap(), e["expert"].as_u64().unwrap());
            let pos = e["pos"].as_u64().unwrap();
            assert!(pos >= last_pos, "claims are in execution order");
            last_pos = pos;
            let hit = match lru.iter().position(|k| *k == key) {
                Some(p) => {
                    lru.remove(p);
                    true
                }
                None => {
                    if lru.len() == capacity {
                        lru.pop_front();
                    }
                    false
                }
            };
            lru.push_back(key);
            assert_eq!(e["hit"].as_bool().unwrap(), hit, "capacity {capacity}: claim {i} {e}");
            let bytes = e["bytes"].as_u64().unwrap();
            assert_eq!(bytes, if hit { 0 } else { blob_len }, "claim {i}");
            missed_bytes += bytes;
            if hit {
                hits += 1
            } else {
                misses += 1
            }
        }
        let s = &out["stats"];
        assert_eq!(s["bytes_read"].as_u64().unwrap(), missed_bytes, "capacity {capacity}");
        assert_eq!(s["ring_misses"].as_u64().unwrap(), misses);
        assert_eq!(s["ring_hits"].as_u64().unwrap(), hits);
        assert_eq!(s["blob_reads"].as_u64().unwrap(), misses);
    }
}

/// The first expert the engine claims for `prompt` (from a clean run's trace).
fn first_claimed(engine: &Engine, prompt: &[u32]) -> ExpertKey {
    let mut fwd = smoe_actors::executor::cpu_pass(engine, 1);
    fwd.enable_trace();
    let mut kv = KvCache::new(&engine.model);
    fwd.forward(&mut kv, &prompt[..1], false).unwrap();
    let e = fwd.take_trace()[0];
    ExpertKey::new(e.layer, e.expert)
}

#[test]
fn injected_short_read_and_eio_fail_one_request_then_the_engine_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let (prompt, expected) = golden_cases("moe_all").remove(0);
    for (io_name, io) in IO_PATHS {
        let key = first_claimed(&open(&vault, 64, io, None), &prompt);
        for (kind, needle) in
            [(FaultKind::ShortRead, "short read for"), (FaultKind::Eio, "Input/output error")]
        {
            let fault = Arc::new(FaultInjector::new(key, kind, 1));
            let engine = open(&vault, 4, io, Some(fault));
            let err = greedy(&engine, &prompt, 4).expect_err("the injected fault fails the request");
            assert!(err.contains(needle), "{io_name} {kind:?}: {err}");
            let m = engine.vault.manifest();
            let layer = m.experts.layers.iter().find(|l| l.layer == key.layer as usize).unwrap();
            let offset = layer.blobs[key.expert as usize].offset;
            assert!(err.contains(&layer.file) && err.contains(&format!("offset {offset}")), "{err}");
            if kind == FaultKind::ShortRead {
                assert!(err.contains(&format!("layer {} expert {}", key.layer, key.expert)), "{err}");
            }
            engine.ring.check_invariants(true).unwrap();
            let ids = greedy(&engine, &prompt, expected.len()).expect("the next request succeeds");
            assert_eq!(ids, expected, "{io_name} {kind:?}");
            assert_eq!(engine.ring.stats().read_errors, 1);
        }
    }
}

#[test]
fn checksum_mismatch_fails_the_request_and_a_repaired_blob_is_read_again() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let (prompt, expected) = golden_cases("moe_all").remove(0);
    for (io_name, io) in IO_PATHS {
        let engine = open(&vault, 4, io, None);
        let key = first_claimed(&engine, &prompt);
        let engine = open(&vault, 4, io, None);
        let m = engine.vault.manifest();
        let layer = m.experts.layers.iter().find(|l| l.layer == key.layer as usize).unwrap();
        let offset = layer.blobs[key.expert as usize].offset;
        let file = vault.join(&layer.file);
        let good = std::fs::read(&file).unwrap();
        let mut bad = good.clone();
        bad[offset as usize + 100] ^= 0x10;
        std::fs::write(&file, &bad).unwrap();
        let err = greedy(&engine, &prompt, 4).expect_err("corruption is detected");
        std::fs::write(&file, &good).unwrap();
        let want = format!("checksum mismatch for layer {} expert {}", key.layer, key.expert);
        assert!(err.contains(&want) && err.contains(&format!("offset {offset}")), "{io_name}: {err}");
        let ids = greedy(&engine, &prompt, expected.len()).expect("the repaired blob is read again");
        assert_eq!(ids, expected);
    }
}

#[test]
fn phase_counters_cover_exactly_their_steps() {
    // Token-serial prefill claims the same experts per step as decode (top-k per MoE
    // layer), so each phase's claims divided by its steps must be that per-step count:
    // prefill covers every prompt token (the last one's step is in ttft), decode exactly
    // the tokens after the first.
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(vault.join("manifest.json")).unwrap()).unwrap();
    let top_k = manifest["model"]["num_experts_per_tok"].as_u64().unwrap();
    let moe_layers = manifest["experts"]["layers"].as_array().unwrap().len() as u64;
    let per_step = top_k * moe_layers;
    let prompt = [3u32, 14, 15, 92, 65, 35];
    let n = 5;
    let out = generate_json(
        &vault,
        &prompt,
        n,
        &dir.path().join("logits.safetensors"),
        &["--prefill", "serial", "--ring-slots", "2"],
    );
    let s = &out["stats"];
    let claims = |phase: &str| {
        s[format!("{phase}_blob_reads")].as_u64().unwrap() + s[format!("{phase}_ring_hits")].as_u64().unwrap()
    };
    assert_eq!(s["decode_tokens"].as_u64().unwrap(), n as u64 - 1);
    assert_eq!(claims("prefill"), prompt.len() as u64 * per_step, "prefill claims: {s}");
    assert_eq!(claims("decode"), (n as u64 - 1) * per_step, "decode claims: {s}");
}

/// Host slot memory with a cap of `max` bytes per arena, counting its arenas (as on a
/// device whose largest single allocation is smaller than a ring size class).
struct Capped {
    max: usize,
    arenas: AtomicU64,
}

impl SlotAllocator for Capped {
    fn allocate(&self, n_slots: usize, slot_bytes: usize) -> std::io::Result<Box<dyn SlotArena>> {
        assert!(n_slots == 1 || n_slots * slot_bytes <= self.max, "an arena over the cap: {n_slots} slots");
        self.arenas.fetch_add(1, Ordering::Relaxed);
        HostAllocator.allocate(n_slots, slot_bytes)
    }

    fn max_arena_bytes(&self) -> Option<usize> {
        Some(self.max)
    }
}

#[test]
fn a_size_class_split_over_several_arenas_computes_as_one_arena() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let (prompt, want) = golden_cases("moe_all").remove(1);
    let stride = Vault::open(&vault).unwrap().max_blob_stride() as usize;
    // Arenas of 1 slot (a cap below one slot) and of 2 slots (the last one holding 1).
    for (max, slots) in [(1, 5), (2 * stride, 7)] {
        for (name, io) in IO_PATHS {
            let alloc = Capped { max, arenas: AtomicU64::new(0) };
            let engine = open_with(&vault, slots, io, None, &alloc);
            assert_eq!(alloc.arenas.load(Ordering::Relaxed), slots.div_ceil((max / stride).max(1)) as u64);
            assert_eq!(
                greedy(&engine, &prompt, want.len()).unwrap(),
                want,
                "{name}, {slots} slots in arenas of {max} bytes"
            );
        }
    }
}

#[test]
fn start_up_touches_no_ring_memory() {
    // Registering every slot as an io_uring fixed buffer at start-up faulted in and
    // pinned the whole ring (seconds per GiB before the first request); slots are now
    // registered and faulted in on their first read.
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    for (name, io) in IO_PATHS {
        let engine = open(&vault, 10_000, io, None);
        assert_eq!(engine.ring.resident_bytes(), 0, "{name}: ring memory resident right after start-up");
        greedy(&engine, &[3, 14, 15], 2).unwrap();
        let used = engine.ring.resident_bytes();
        let slot = engine.vault.max_blob_stride();
        assert!(used >= slot, "{name}: {used} bytes resident after reading experts of {slot} bytes");
    }
}

#[test]
fn warmup_runs_the_request_once_so_the_measured_run_finds_its_experts_in_the_ring() {
    let dir = tempfile::tempdir().unwrap();
    let vault = dir.path().join("tiny.vault");
    run_ok(&["synth", "--out", vault.to_str().unwrap(), "--preset", "tiny"]);
    let prompt = [3, 1, 4, 1, 5, 9, 2, 6];
    let (cold_l, warm_l) = (dir.path().join("c.safetensors"), dir.path().join("w.safetensors"));
    let flags = ["--ring-bytes", "1GiB"];
    let cold = generate_json(&vault, &prompt, 4, &cold_l, &flags);
    let warm = generate_json(&vault, &prompt, 4, &warm_l, &[&flags[..], &["--warmup"]].concat());
    let reads = |o: &serde_json::Value, k: &str| o["stats"][k].as_u64().unwrap();
    assert!(reads(&cold, "prefill_blob_reads") > 0, "{cold}");
    assert_eq!(reads(&warm, "prefill_blob_reads") + reads(&warm, "decode_blob_reads"), 0, "{warm}");
    assert_eq!(cold["token_ids"], warm["token_ids"]);
    assert_eq!(read_f32(&cold_l, "logits").1, read_f32(&warm_l, "logits").1, "a warm ring changes no byte");
}

/// Waits until no read is in flight.
fn settle(engine: &Engine) {
    for _ in 0..2000 {
        if engine.ring.stats().slots[LOADING as usize] == 0 {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    panic!("reads still in flight");
}

#[test]
fn lookahead_takes_only_idle_slots_and_counts_used_and_wasted_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    for (name, io) in IO_PATHS {
        let engine = open(&vault, 6, io, None);
        let ring = &engine.ring;
        let blob = engine.vault.manifest().experts.layers[0].layout.blob_len;
        let key = |l: usize, e: usize| ExpertKey::new(l, e);
        // Layer 0 announces 4 experts (as a routed layer does): 2 of the 6 slots stay idle.
        for e in 0..4 {
            assert!(ring.announce(key(0, e)), "{name}");
        }
        let ahead: Vec<Lookahead> = (0..8).map(|e| ring.lookahead(key(1, e))).collect();
        assert_eq!(&ahead[..3], [Lookahead::Queued, Lookahead::Queued, Lookahead::Refused], "{name}");
        assert_eq!(ring.lookahead(key(1, 0)), Lookahead::Resident, "{name}: already on its way");
        settle(&engine);
        // The announced experts were never evicted: their claims are the misses that read them.
        let held: Vec<_> = (0..4).map(|e| ring.claim(key(0, e)).unwrap()).collect();
        assert!(held.iter().all(|h| !h.info().hit), "{name}");
        assert_eq!(ring.stats().evictions, 0, "{name}");
        drop(held);
        // Layer 0 is idle now: a lookahead for layer 2 takes its 4 slots, but neither
        // layer 1's unclaimed lookahead reads nor (for layer 1) a slot of layer 1.
        let ahead: Vec<Lookahead> = (0..6).map(|e| ring.lookahead(key(2, e))).collect();
        assert_eq!(ahead.iter().filter(|&&a| a == Lookahead::Queued).count(), 4, "{name}: {ahead:?}");
        assert_eq!(ahead[4], Lookahead::Refused, "{name}");
        assert_eq!(
            ring.lookahead(key(1, 5)),
            Lookahead::Refused,
            "{name}: only layers 1 and 2's reads are left"
        );
        settle(&engine);
        ring.check_invariants(true).unwrap_or_else(|e| panic!("{name}: {e}"));
        // Layer 1 routes to expert 0 only: it is a hit; expert 1 is withdrawn (read already,
        // so wasted) and becomes the first slot a miss evicts.
        let h = ring.claim(key(1, 0)).unwrap();
        assert!(h.info().hit && h.info().bytes == 0, "{name}");
        drop(h);
        ring.withdraw_lookahead(key(1, 1));
        ring.withdraw_lookahead(key(1, 0)); // claimed already: nothing happens
        drop(ring.claim(key(0, 7)).unwrap());
        assert_eq!(ring.lookahead(key(1, 0)), Lookahead::Resident, "{name}: the claimed read stays");
        assert!(!ring.claim(key(1, 1)).unwrap().info().hit, "{name}: the wasted read went first");
        settle(&engine);
        let s = ring.stats();
        assert_eq!((s.lookahead_reads, s.lookahead_used, s.lookahead_cancelled), (6, 1, 0), "{name}: {s:?}");
        assert_eq!((s.lookahead_bytes, s.lookahead_used_bytes), (6 * blob, blob), "{name}: {s:?}");
        assert!(s.read_busy_ns > 0, "{name}: {s:?}");
        ring.check_invariants(true).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}
