//! Quantised vaults: `synth --quant` and `convert --quant` store the routed experts in
//! ggml block formats (per part and per layer, as llama.cpp's mixes do); the engine runs
//! them, reports their format mix, sizes its ring by their real blob stride, and keeps
//! layer-major prefill byte-identical to token-serial replay on them.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use serde_json::Value;

/// The schemes of `--quant`.
const SCHEMES: [&str; 5] = ["q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"];

fn synth(dir: &Path, preset: &str, extra: &[&str]) -> PathBuf {
    let out = dir.join(format!("{preset}{}.vault", extra.join("")));
    let mut args = vec!["synth", "--out", out.to_str().unwrap(), "--preset", preset, "--seed", "5"];
    args.extend_from_slice(extra);
    run_ok(&args);
    out
}

fn manifest(vault: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(vault.join("manifest.json")).unwrap()).unwrap()
}

/// (gate, up, down) types of every MoE layer.
fn layer_types(m: &Value) -> Vec<[String; 3]> {
    let t = |l: &Value, p: &str| l["layout"][p]["dtype"].as_str().unwrap().to_string();
    m["experts"]["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| [t(l, "gate"), t(l, "up"), t(l, "down")])
        .collect()
}

#[test]
fn every_scheme_runs_and_reports_its_format_mix() {
    let dir = tempfile::tempdir().unwrap();
    let logits = dir.path().join("l.safetensors");
    let plain = synth(dir.path(), "small", &[]);
    let plain_stats = generate_json(&plain, &[1, 2, 3], 2, &logits, &[])["stats"].clone();
    let bf16_bytes = plain_stats["bytes_per_expert"].as_u64().unwrap();
    let s = |v: &str| v.to_string();
    for scheme in SCHEMES {
        let vault = synth(dir.path(), "small", &["--quant", scheme]);
        let m = manifest(&vault);
        // The `small` preset has 4 layers; llama.cpp gives layers 2 and 3 of 4 more bits.
        let want: Vec<[String; 3]> = (0..4)
            .map(|l| match (scheme, l >= 2) {
                ("q4_k_m", more) => [s("q4_k"), s("q4_k"), s(if more { "q6_k" } else { "q4_k" })],
                ("q5_k_m", more) => [s("q5_k"), s("q5_k"), s(if more { "q6_k" } else { "q5_k" })],
                (t, _) => [s(t), s(t), s(t)],
            })
            .collect();
        assert_eq!(layer_types(&m), want, "{scheme}");
        let out = generate_json(&vault, &[1, 2, 3, 4, 5], 4, &logits, &[]);
        assert_eq!(out["token_ids"].as_array().unwrap().len(), 4, "{scheme}");
        let st = &out["stats"];
        let lens: Vec<u64> = m["experts"]["layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["layout"]["blob_len"].as_u64().unwrap())
            .collect();
        assert_eq!(st["bytes_per_expert"].as_u64().unwrap(), lens.iter().sum::<u64>() / 4, "{scheme}");
        assert!(st["bytes_per_expert"].as_u64().unwrap() * 5 < bf16_bytes * 3, "{scheme}: {st}");
        let mix = &st["format_mix"];
        // Every resident matrix is quantised but the 4 router gates (norms stay f32).
        let resident = |mix: &Value| -> u64 {
            mix.as_object().unwrap().values().map(|v| v["resident_tensors"].as_u64().unwrap()).sum()
        };
        assert_eq!(resident(mix), resident(&plain_stats["format_mix"]), "{scheme}: {mix}");
        assert_eq!(mix["bf16"]["resident_tensors"], 4, "{scheme}: {mix}");
        assert_eq!(mix["f32"]["resident_tensors"], plain_stats["format_mix"]["f32"]["resident_tensors"]);
        assert_eq!(mix["bf16"]["expert_matrices"], 0, "{scheme}");
        let matrices: u64 =
            mix.as_object().unwrap().values().map(|v| v["expert_matrices"].as_u64().unwrap()).sum();
        assert_eq!(matrices, 4 * 16 * 3, "{scheme}: every expert matrix is counted once");
        // A demand read costs the blob's own length: the prefill read only quantised bytes.
        let reads = st["prefill_blob_reads"].as_u64().unwrap();
        assert!(
            reads > 0 && st["prefill_bytes_read"].as_u64().unwrap() <= reads * lens.iter().max().unwrap()
        );
    }
    // The tiny preset's 64 × 32 experts take no K-quant blocks: Q8_0, as llama.cpp falls back.
    let tiny = synth(dir.path(), "tiny", &["--quant", "q4_k_m"]);
    assert!(layer_types(&manifest(&tiny)).iter().flatten().all(|t| t == "q8_0"));
    generate_json(&tiny, &[7, 8], 2, &logits, &[]);
}

#[test]
fn size_classes_hold_more_quantised_experts_and_never_change_the_arithmetic() {
    let dir = tempfile::tempdir().unwrap();
    let plain = synth(dir.path(), "small", &[]);
    let quant = synth(dir.path(), "small", &["--quant", "q4_k_m"]);
    let budget = 8 * manifest(&plain)["experts"]["layers"][0]["layout"]["blob_stride"].as_u64().unwrap();
    let run = |v: &Path, ring: &[&str], io: &str, tag: &str| {
        let logits = dir.path().join(format!("{tag}.safetensors"));
        let mut extra = ring.to_vec();
        extra.extend(["--io", io]);
        let out = generate_json(v, &[1, 2, 3], 4, &logits, &extra);
        (out, std::fs::read(&logits).unwrap())
    };
    let b = budget.to_string();
    let (p, _) = run(&plain, &["--ring-bytes", &b], "pread", "plain");
    let (q, reference) = run(&quant, &["--ring-bytes", &b], "pread", "quant");
    let (p, q) = (&p["stats"], &q["stats"]);
    assert_eq!(p["ring_slots"], 8, "{p}");
    assert_eq!(p["ring_classes"].as_array().unwrap().len(), 1, "{p}");
    // Q4_K_M keeps some layers' down projections in Q6_K: two blob strides, two classes.
    let classes = q["ring_classes"].as_array().unwrap();
    assert_eq!(classes.len(), 2, "{q}");
    let largest = q["ring_slot_bytes"].as_u64().unwrap();
    let slots = q["ring_slots"].as_u64().unwrap();
    let summed: u64 = classes.iter().map(|c| c["slots"].as_u64().unwrap()).sum();
    let bytes: u64 =
        classes.iter().map(|c| c["slots"].as_u64().unwrap() * c["slot_bytes"].as_u64().unwrap()).sum();
    assert_eq!(summed, slots);
    assert_eq!(bytes, q["ring_bytes"].as_u64().unwrap());
    assert!(bytes <= budget, "{q}");
    // More experts than slots of the largest blob alone would hold, and over 3× bf16.
    assert!(slots > budget / largest && slots >= 3 * 8, "{q}");
    // The arithmetic never depends on the ring: the smallest ring (one slot per class),
    // two in between and one holding everything, on both I/O paths.
    let one_each: u64 = classes.iter().map(|c| c["slot_bytes"].as_u64().unwrap()).sum();
    for ring in [one_each, 3 * one_each, budget / 2, 1 << 40] {
        for io in ["pread", "io-uring"] {
            let r = ring.to_string();
            let (_, logits) = run(&quant, &["--ring-bytes", &r], io, &format!("q-{ring}-{io}"));
            assert!(logits == reference, "logits differ with a ring of {ring} bytes via {io}");
        }
    }
    // One slot cannot serve two size classes: a clear error, not a hang.
    let out = run_err(&[
        "generate",
        "--vault",
        quant.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--ring-slots",
        "1",
    ]);
    assert!(out.contains("2 slot sizes") && out.contains("ring_slots"), "{out}");
}

#[test]
fn a_quantised_vault_passes_verify_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let vault = synth(dir.path(), "small", &["--quant", "q4_k_m"]);
    let out =
        run_ok(&["verify", "--vault", vault.to_str().unwrap(), "--chunk-sizes", "3,16", "--tokens", "4"]);
    assert!(out.contains(" 0 failed"), "{out}");
}

#[test]
fn convert_quantises_experts_and_resident_matrices_unless_told_to_keep_them() {
    let dir = tempfile::tempdir().unwrap();
    let plain = convert("moe_all", dir.path(), &[]);
    let sub = |name: &str| {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        d
    };
    let quant = convert("moe_all", &sub("q"), &["--quant", "q8_0"]);
    let kept = convert("moe_all", &sub("k"), &["--quant", "q8_0", "--keep-resident"]);
    let m = manifest(&quant);
    assert!(layer_types(&m).iter().flatten().all(|t| t == "q8_0"), "{m}");
    assert_eq!(layer_types(&manifest(&kept)), layer_types(&m));
    let read = |v: &Path| std::fs::read(v.join("resident.bin")).unwrap();
    assert_eq!(read(&plain), read(&kept), "--keep-resident stores resident tensors as without --quant");
    // Matrices in Q8_0 (the LM head too, under q8_0), the router gate and norms untouched.
    for t in m["resident"]["tensors"].as_array().unwrap() {
        let (name, dtype) = (t["name"].as_str().unwrap(), t["dtype"].as_str().unwrap());
        let want = if t["shape"].as_array().unwrap().len() == 1 || name.ends_with("mlp.gate.weight") {
            manifest(&plain)["resident"]["tensors"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["name"] == name)
                .unwrap()["dtype"]
                .as_str()
                .unwrap()
                .to_string()
        } else {
            "q8_0".to_string()
        };
        assert_eq!(dtype, want, "{name}");
    }
    let out =
        run_ok(&["verify", "--vault", quant.to_str().unwrap(), "--chunk-sizes", "2,5", "--tokens", "3"]);
    assert!(out.contains(" 0 failed"), "{out}");
    // Q8_0 experts stay close to the f32 model (measured: max |d| = 3% of the logits'
    // spread); a part read in the wrong format or at the wrong offset would not.
    let (prompt, _) = golden_cases("moe_all").remove(0);
    let logits = |v: &Path, name: &str| {
        let path = dir.path().join(name);
        generate_json(v, &prompt, 1, &path, &[]);
        read_f32(&path, "logits").1
    };
    let (want, got) = (logits(&plain, "p.safetensors"), logits(&quant, "q.safetensors"));
    let mean = want.iter().sum::<f32>() / want.len() as f32;
    let spread = (want.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / want.len() as f32).sqrt();
    let max_diff = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(max_diff < 0.1 * spread, "max |d| {max_diff} against a spread of {spread}");
}

#[test]
fn vaults_written_with_one_shared_expert_layout_still_open() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let prompt = [3, 1, 4, 1, 5];
    let logits = dir.path().join("l.safetensors");
    let before = generate_json(&vault, &prompt, 4, &logits, &[]);
    // Rewrite the manifest as earlier builds wrote it: one `experts.layout` with one dtype.
    let mut m = manifest(&vault);
    let layers = m["experts"]["layers"].as_array_mut().unwrap();
    let mut layout = layers[0]["layout"].clone();
    let dtype = layout["gate"]["dtype"].clone();
    for part in ["gate", "up", "down"] {
        layout[part].as_object_mut().unwrap().remove("dtype");
    }
    layout["dtype"] = dtype;
    for l in layers.iter_mut() {
        l.as_object_mut().unwrap().remove("layout");
    }
    m["experts"]["layout"] = layout;
    std::fs::write(vault.join("manifest.json"), m.to_string()).unwrap();
    let after = generate_json(&vault, &prompt, 4, &logits, &[]);
    assert_eq!(before["token_ids"], after["token_ids"]);
}
