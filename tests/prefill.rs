//! Layer-major prefill: the identity gate (`verify`) on every fixture, the design's
//! I/O arithmetic (each union expert claimed once per chunk and layer), and
//! speculative prefetch and lookahead never changing the arithmetic.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::*;

#[test]
fn verify_passes_on_every_fixture() {
    let dir = tempfile::tempdir().unwrap();
    for name in FIXTURES.iter().chain(HYBRID_FIXTURES) {
        let vault = convert(name, dir.path(), &[]);
        let out = run_ok(&["verify", "--vault", vault.to_str().unwrap(), "--chunk-sizes", "1,7,64"]);
        assert!(out.contains(" 0 failed"), "{name}:\n{out}");
        assert!(out.contains("1037"), "{name}: the default set has a prompt of at least 1000 tokens:\n{out}");
        for len in ["6", "7", "8", "15", "63", "64", "65", "129"] {
            assert!(
                out.lines().any(|l| l.split_whitespace().next() == Some(len)),
                "{name}: no {len}-token prompt"
            );
        }
    }
}

#[test]
fn verify_reads_a_prompt_file_and_rejects_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let v = vault.to_str().unwrap();
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "[1,2,3,4,5,6,7,8,9]\nThe quick brown fox jumps over the lazy dog.\n").unwrap();
    let out =
        run_ok(&["verify", "--vault", v, "--prompts", prompts.to_str().unwrap(), "--chunk-sizes", "2,4"]);
    assert!(out.contains("4 passed, 0 failed"), "{out}");
    std::fs::write(&prompts, "[1,2,\n").unwrap();
    let err = run_err(&["verify", "--vault", v, "--prompts", prompts.to_str().unwrap()]);
    assert!(err.contains("prompts.txt:1") && err.contains("JSON array"), "{err}");
    let err = run_err(&["verify", "--vault", v, "--chunk-sizes", "0"]);
    assert!(err.contains("at least 1"), "{err}");
}

/// One traced claim: expert, hit, bytes read.
type Claim = (u64, bool, u64);

#[test]
fn each_union_expert_is_claimed_once_per_chunk_and_layer() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("bf16_sharded", dir.path(), &[]);
    let prompt: Vec<u32> = (0..150).map(|i| (i * 37 % 500) as u32).collect();
    for (chunk, slots) in [("16", "10000"), ("64", "5"), ("7", "3")] {
        let trace = dir.path().join(format!("trace-{chunk}-{slots}.jsonl"));
        let lp = dir.path().join("l.safetensors");
        let out = generate_json(
            &vault,
            &prompt,
            2,
            &lp,
            &["--chunk-size", chunk, "--ring-slots", slots, "--trace-out", trace.to_str().unwrap()],
        );
        let stats = &out["stats"];
        let unions: Vec<Vec<u64>> = serde_json::from_value(stats["prefill_unions"].clone()).unwrap();
        let c: usize = chunk.parse().unwrap();
        assert_eq!(unions.len(), (prompt.len() - 1).div_ceil(c), "one entry per chunk");
        // Group the prefill claims (rows > 1 or positions before the last prompt token).
        let mut groups: BTreeMap<(u64, u64), Vec<Claim>> = BTreeMap::new();
        // Reads and bytes of the last prompt token's step.
        let mut last_step = (0u64, 0u64);
        for line in std::fs::read_to_string(&trace).unwrap().lines() {
            let e: serde_json::Value = serde_json::from_str(line).unwrap();
            let pos = e["pos"].as_u64().unwrap();
            if pos as usize == prompt.len() - 1 {
                // The last prompt token's step: counted with prefill (the span of ttft).
                last_step.0 += u64::from(!e["hit"].as_bool().unwrap());
                last_step.1 += e["bytes"].as_u64().unwrap();
                continue;
            }
            if pos as usize >= prompt.len() {
                continue; // decode steps
            }
            groups.entry((pos, e["layer"].as_u64().unwrap())).or_default().push((
                e["expert"].as_u64().unwrap(),
                e["hit"].as_bool().unwrap(),
                e["bytes"].as_u64().unwrap(),
            ));
        }
        let moe_layers = [1u64, 3];
        let (mut reads, mut bytes) = (0u64, 0u64);
        for (ci, sizes) in unions.iter().enumerate() {
            for (li, &size) in sizes.iter().enumerate() {
                let claims = &groups[&((ci * c) as u64, moe_layers[li])];
                let distinct: BTreeSet<u64> = claims.iter().map(|c| c.0).collect();
                assert_eq!(
                    distinct.len(),
                    claims.len(),
                    "chunk {ci} layer {li}: an expert was claimed twice"
                );
                let misses = claims.iter().filter(|c| !c.1).count() as u64;
                let hits = claims.len() as u64 - misses;
                assert_eq!(misses + hits, size, "chunk {ci} layer {li}: reads + hits = |union|");
                reads += misses;
                bytes += claims.iter().map(|c| c.2).sum::<u64>();
            }
        }
        assert_eq!(groups.len(), unions.len() * moe_layers.len());
        assert_eq!(stats["prefill_blob_reads"].as_u64().unwrap(), reads + last_step.0);
        assert_eq!(stats["prefill_bytes_read"].as_u64().unwrap(), bytes + last_step.1);
        assert!(stats["union_max"].as_u64().unwrap() <= 16);
    }
}

#[test]
fn layer_major_and_serial_generate_identical_logits() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("dense0_gqa", dir.path(), &[]);
    let (prompt, greedy) = golden_cases("dense0_gqa").remove(1);
    let a = dir.path().join("a.safetensors");
    let b = dir.path().join("b.safetensors");
    let lm =
        generate_json(&vault, &prompt, greedy.len(), &a, &["--prefill", "layer-major", "--chunk-size", "16"]);
    let se = generate_json(&vault, &prompt, greedy.len(), &b, &["--prefill", "serial"]);
    assert_eq!(id_list(&lm["token_ids"]), greedy);
    assert_eq!(id_list(&se["token_ids"]), greedy);
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap(), "logits bitwise identical");
    assert_eq!(lm["stats"]["prefill_mode"], "layer-major");
    assert_eq!(se["stats"]["prefill_mode"], "serial");
    assert!(lm["stats"]["prefill_tok_s"].as_f64().unwrap() > 0.0);
    // Layer-major reads each union expert once per chunk: fewer claims than serial.
    assert!(
        lm["stats"]["prefill_blob_reads"].as_u64().unwrap()
            + lm["stats"]["prefill_ring_hits"].as_u64().unwrap()
            < se["stats"]["prefill_blob_reads"].as_u64().unwrap()
                + se["stats"]["prefill_ring_hits"].as_u64().unwrap()
    );
}

#[test]
fn speculative_prefetch_never_changes_ids_or_logits() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("bf16_sharded", dir.path(), &[]);
    let (prompt, greedy) = golden_cases("bf16_sharded").remove(1);
    let mut reference: Option<Vec<u8>> = None;
    for (depth, slots) in [("0", "6"), ("4", "6"), ("2", "10000"), ("12", "8")] {
        let lp = dir.path().join(format!("spec{depth}-{slots}.safetensors"));
        let out = generate_json(
            &vault,
            &prompt,
            greedy.len(),
            &lp,
            &["--spec-depth", depth, "--ring-slots", slots],
        );
        assert_eq!(id_list(&out["token_ids"]), greedy, "spec depth {depth}");
        let s = &out["stats"];
        if depth != "0" && slots != "10000" {
            assert!(s["bets_issued"].as_u64().unwrap() > 0, "spec depth {depth}: no bets issued: {s}");
        }
        assert!(s["bets_used"].as_u64().unwrap() <= s["bets_issued"].as_u64().unwrap());
        let bytes = std::fs::read(&lp).unwrap();
        match &reference {
            None => reference = Some(bytes),
            Some(r) => assert!(r == &bytes, "spec depth {depth}: logits differ"),
        }
    }
}

#[test]
fn a_cancelled_prefill_stops_between_chunks_and_resumes_to_the_same_tokens() {
    use std::cell::Cell;

    use smoe_actors::contract::KvState;
    use smoe_actors::cpu::KvCache;
    use smoe_actors::engine::{Engine, EngineOptions, RingSize};
    use smoe_actors::generation::{generate, GenerateRequest};
    use smoe_actors::ring::memory::HostAllocator;
    use smoe_actors::sampler::SamplingParams;
    use smoe_proto::FinishReason;

    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let (prompt, greedy) = golden_cases("moe_all").remove(1);
    assert!(prompt.len() > 9, "the case needs a few chunks of 4");
    let opts = EngineOptions { max_context: 256, ring: RingSize::Slots(64), ..Default::default() };
    let engine = Engine::open(&vault, &opts, &HostAllocator).unwrap();
    let mut fwd = smoe_actors::executor::cpu_pass(&engine, 4);
    let req = GenerateRequest {
        prompt: prompt.clone(),
        max_tokens: greedy.len(),
        sampling: SamplingParams::default(),
        ignore_eos: true,
        spec_depth: 0,
        logits: false,
    };
    // Cancelled before the third chunk: two chunks ran, nothing was generated.
    let asked = Cell::new(0);
    let mut kv = KvCache::new(&engine.model);
    let (reason, stats) = generate(
        &mut fwd,
        &mut kv,
        &req,
        || {
            asked.set(asked.get() + 1);
            asked.get() == 3
        },
        |_, _| panic!("no token may be generated after a cancelled prefill"),
    )
    .unwrap();
    assert_eq!(
        (reason, kv.len(), stats.prefill_tokens, stats.generated_tokens),
        (FinishReason::Stopped, 8, 8, 0)
    );
    // The kept prefix is valid: resuming on it gives the golden tokens.
    let (reason, stats, ids) = generate_ids(&mut fwd, &mut kv, &req).unwrap();
    assert_eq!((reason, stats.prefill_tokens), (FinishReason::Length, prompt.len() - 8));
    assert_eq!(ids, greedy);
}

#[test]
fn lookahead_never_changes_a_byte_and_counts_what_it_read() {
    let dir = tempfile::tempdir().unwrap();
    // bf16_sharded (16 experts per layer) has dense layers between its MoE layers
    // (lookahead skips them).
    for (name, experts) in [("moe_all", 8), ("bf16_sharded", 16)] {
        let vault = convert(name, dir.path(), &[]);
        let prompt: Vec<u32> = (0..120).map(|i| (i * 37 % 300) as u32).collect();
        // Rings with a few slots beside a layer's union (predictions withdrawn, reads
        // wasted, lookahead and demand competing for slots), and one holding every expert.
        let (small, layer) = ((experts - 2).to_string(), (experts + experts / 2).to_string());
        for (chunk, slots) in [("2", small.as_str()), ("16", layer.as_str()), ("64", "10000")] {
            let run = |lookahead: &str| {
                let lp = dir.path().join(format!("{name}-{chunk}-{slots}-{lookahead}.safetensors"));
                let flags = ["--chunk-size", chunk, "--ring-slots", slots, "--lookahead", lookahead];
                let out = generate_json(&vault, &prompt, 4, &lp, &flags);
                (out, read_f32(&lp, "logits").1)
            };
            let (off, off_logits) = run("0");
            let (on, on_logits) = run("8");
            let case = format!("{name}, chunk {chunk}, {slots} slots");
            assert_eq!(off["token_ids"], on["token_ids"], "{case}");
            let bits = |l: &[f32]| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert!(bits(&off_logits) == bits(&on_logits), "{case}: lookahead changed the logits");
            let (s, s0) = (&on["stats"], &off["stats"]);
            let n = |s: &serde_json::Value, k: &str| s[k].as_u64().unwrap();
            assert_eq!(
                n(s0, "lookahead_reads") + n(s0, "lookahead_bytes"),
                0,
                "{case}: off reads nothing ahead"
            );
            assert!(n(s, "lookahead_reads") > 0, "{case}: {s}");
            assert!(n(s, "lookahead_used_bytes") <= n(s, "lookahead_bytes"), "{case}: {s}");
            assert_eq!(
                n(s, "lookahead_wasted_bytes"),
                n(s, "lookahead_bytes") - n(s, "lookahead_used_bytes"),
                "{case}"
            );
            let io = &s["prefill_io"];
            let share = io["read_busy_share"].as_f64().unwrap();
            assert!(share > 0.0 && share <= 1.0, "{case}: the disk is busy for part of the TTFT: {io}");
            if slots == "10000" {
                // The first chunk's next layers were read ahead in full, into an empty
                // ring, and the chunk's unions used them.
                assert!(n(io, "lookahead_used") > 0, "{case}: {io}");
            }
        }
        // Bad values are refused with the key, the flag and the range named.
        let v = vault.to_str().unwrap();
        let err = run_err(&["generate", "--vault", v, "--prompt-ids", "1,2", "--lookahead", "65537"]);
        assert!(err.contains("`lookahead` (--lookahead): must be between 0 and 65536, got 65537"), "{err}");
        let err = run_err(&["generate", "--vault", v, "--prompt-ids", "1,2", "--lookahead=-3"]);
        assert!(err.contains("--lookahead"), "{err}");
    }
}
