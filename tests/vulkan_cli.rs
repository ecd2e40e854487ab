//! The Vulkan backend through the command line (on lavapipe in CI): `generate
//! --backend vulkan` matches transformers like the CPU backend, and `verify --backend
//! vulkan` passes the identity gate on the device, on bf16 and quantised vaults.
#![cfg(feature = "vulkan")]

mod common;

use std::path::Path;

use common::*;

#[test]
fn generate_on_vulkan_matches_transformers() {
    let dir = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let vault = convert(name, dir.path(), &[]);
        let golden = fixture(name).join("golden_logits.safetensors");
        let (prompt, greedy) = golden_cases(name).remove(1);
        let lpath = dir.path().join(format!("{name}.safetensors"));
        let out = generate_json(
            &vault,
            &prompt,
            greedy.len(),
            &lpath,
            &["--backend", "vulkan", "--chunk-size", "16"],
        );
        assert_eq!(id_list(&out["token_ids"]), greedy, "{name}");
        let (_, ours) = read_f32(&lpath, "logits");
        let (_, theirs) = read_f32(&golden, "case1");
        let max = ours.iter().zip(&theirs).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(max <= 1e-4, "{name}: max |logit diff| {max}");
    }
}

#[test]
fn verify_on_vulkan_passes_on_the_hybrid_fixtures() {
    // DeltaNet layers on the device: layer-major prefill at chunk sizes 1, 7 and 64 is
    // byte-identical to serial replay over the default prompts (the longest 1037 tokens).
    // Qwen3.5-MoE over the default prompts (the longest 1037 tokens: 88 s on lavapipe),
    // Qwen3-Next (fused projections, bf16, tied) over three short ones.
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("q35_f32", dir.path(), &[]);
    let v = vault.to_str().unwrap();
    let out = run_ok(&["verify", "--vault", v, "--backend", "vulkan", "--chunk-sizes", "1,7,64"]);
    assert!(out.contains(" 0 failed") && out.contains("1037"), "q35_f32:\n{out}");
    let vault = convert("next_bf16", dir.path(), &[]);
    let prompts = dir.path().join("prompts.txt");
    let ids =
        |n: usize| format!("[{}]", (0..n).map(|i| (i * 7 % 400).to_string()).collect::<Vec<_>>().join(","));
    std::fs::write(&prompts, format!("{}\n{}\n{}\n", ids(1), ids(8), ids(66))).unwrap();
    let p = prompts.to_str().unwrap();
    let v = vault.to_str().unwrap();
    let out = run_ok(&[
        "verify",
        "--vault",
        v,
        "--backend",
        "vulkan",
        "--prompts",
        p,
        "--chunk-sizes",
        "1,7,64",
        "--tokens",
        "4",
    ]);
    assert!(out.contains("9 passed, 0 failed"), "next_bf16:\n{out}");
}

#[test]
fn verify_on_vulkan_passes() {
    let dir = tempfile::tempdir().unwrap();
    let bf16 = convert("bf16_sharded", dir.path(), &[]);
    // Quantised experts: Q4_K gate/up with Q4_K or (the last two layers) Q6_K down.
    let q4_k_m = dir.path().join("q4_k_m.vault");
    let q = q4_k_m.to_str().unwrap();
    run_ok(&["synth", "--out", q, "--preset", "small", "--seed", "3", "--quant", "q4_k_m"]);
    let prompts = dir.path().join("prompts.txt");
    let ids =
        |n: usize| format!("[{}]", (0..n).map(|i| (i * 7 % 500).to_string()).collect::<Vec<_>>().join(","));
    std::fs::write(&prompts, format!("{}\n{}\n{}\n", ids(1), ids(8), ids(66))).unwrap();
    for vault in [&bf16, &q4_k_m] {
        let out = run_ok(&[
            "verify",
            "--vault",
            vault.to_str().unwrap(),
            "--backend",
            "vulkan",
            "--prompts",
            prompts.to_str().unwrap(),
            "--chunk-sizes",
            "1,7,64",
            "--tokens",
            "4",
        ]);
        assert!(out.contains("9 passed, 0 failed"), "{vault:?}: {out}");
    }
}

/// Generates `n` tokens of `prompt` on the CPU and on Vulkan with `extra` flags, checks
/// the ids are equal and the logits within 1e-4, and returns the Vulkan run's JSON.
fn vulkan_matches_cpu(
    dir: &Path,
    vault: &Path,
    prompt: &[u32],
    n: usize,
    extra: &[&str],
) -> serde_json::Value {
    let run = |backend: &str| {
        let lpath = dir.join(format!("{backend}.safetensors"));
        let mut flags = vec!["--backend", backend];
        flags.extend_from_slice(extra);
        let out = generate_json(vault, prompt, n, &lpath, &flags);
        (out, read_f32(&lpath, "logits").1)
    };
    let (cpu_out, cpu) = run("cpu");
    let (vk_out, vk) = run("vulkan");
    assert_eq!(id_list(&vk_out["token_ids"]), id_list(&cpu_out["token_ids"]));
    let max = vk.iter().zip(&cpu).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(max <= 1e-4, "max |Vulkan - CPU| {max}");
    vk_out
}

#[test]
fn quantised_vault_generates_on_vulkan_as_on_cpu() {
    // `convert --quant q8_0` on a fixture whose expert rows are not whole K-quant blocks:
    // the experts are Q8_0 blobs the Vulkan backend multiplies in place.
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &["--quant", "q8_0"]);
    let (prompt, greedy) = golden_cases("moe_all").remove(1);
    vulkan_matches_cpu(dir.path(), &vault, &prompt, greedy.len(), &[]);
}

#[test]
fn a_ring_of_size_classes_runs_on_vulkan_as_on_cpu() {
    // Q4_K_M stores some layers' down projections in Q6_K: two blob strides, so two slot
    // size classes, each its own host-visible buffer; a small ring makes every layer evict
    // within its class.
    let dir = tempfile::tempdir().unwrap();
    let vault = dir.path().join("q4km.vault");
    let v = vault.to_str().unwrap();
    run_ok(&["synth", "--out", v, "--preset", "small", "--seed", "5", "--quant", "q4_k_m"]);
    let out = vulkan_matches_cpu(dir.path(), &vault, &[1, 2, 3, 4], 4, &["--ring-slots", "6"]);
    assert_eq!(out["stats"]["ring_classes"].as_array().unwrap().len(), 2, "{out}");
}

#[test]
fn the_phase_profile_times_every_phase_and_changes_no_byte() {
    // `generate --profile` on both backends: the same ids and logits as the CPU within
    // 1e-4, the Vulkan logits byte-identical to a run without the profile, and a profile
    // with host times on both and device times (lavapipe writes timestamps) on Vulkan.
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let prompt: Vec<u32> = (0..11).map(|i| (i * 37 + 5) % 448).collect();
    let flags = ["--profile", "--chunk-size", "4"];
    let out = vulkan_matches_cpu(dir.path(), &vault, &prompt, 3, &flags);
    let profiled = read_f32(&dir.path().join("vulkan.safetensors"), "logits").1;
    let plain = dir.path().join("plain.safetensors");
    generate_json(&vault, &prompt, 3, &plain, &["--backend", "vulkan", "--chunk-size", "4"]);
    let plain = read_f32(&plain, "logits").1;
    assert!(
        profiled.iter().zip(&plain).all(|(a, b)| a.to_bits() == b.to_bits()),
        "the profile changed logits"
    );
    let p = &out["stats"]["profile"];
    assert_eq!(p["device_timed"], true, "{p}");
    for (regime, blocks) in [(0, 3), (1, 3)] {
        let r = &p["regimes"][regime];
        assert_eq!(r["blocks"], blocks, "{r}");
        // Phases in `Phase::ALL` order: attention 2, router gate 5, expert dispatches 10.
        for phase in [2, 5, 10] {
            let t = &r["phases"][phase];
            assert!(t["calls"].as_u64().unwrap() > 0 && t["device"].as_f64().unwrap() > 0.0, "{phase}: {t}");
        }
        assert!(r["phases"][5]["wait"].as_f64().unwrap() > 0.0, "the router gate waits for the device: {r}");
        // Every dispatch is stamped: the gate/up kernel ran and took time, and the kernels'
        // device time is a part of the phases' (the same gaps, less those before a
        // command buffer's first command).
        let kernels = r["kernels"].as_array().unwrap();
        let gate_up = kernels.iter().find(|k| k["name"].as_str().unwrap().starts_with("gate_up"));
        assert!(gate_up.is_some_and(|k| k["device"].as_f64().unwrap() > 0.0), "{r}");
        let sum =
            |v: &[serde_json::Value], key: &str| v.iter().map(|t| t[key].as_f64().unwrap()).sum::<f64>();
        let phases = r["phases"].as_array().unwrap();
        assert!(sum(kernels, "device") <= sum(phases, "device") + 1e-9, "{r}");
    }
}
