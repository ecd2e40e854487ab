//! The Vulkan backend through the command line (on lavapipe in CI): `generate
//! --backend vulkan` matches transformers like the CPU backend, and `verify --backend
//! vulkan` passes the identity gate on the device, on bf16 and quantised vaults.
#![cfg(feature = "vulkan")]

mod common;

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

#[test]
fn vulkan_refuses_quantised_experts_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &["--quant", "q8_0"]);
    let err = run_err(&[
        "generate",
        "--vault",
        vault.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--max-tokens",
        "1",
        "--backend",
        "vulkan",
    ]);
    assert!(err.contains("q8_0") && err.contains("--backend cpu"), "{err}");
}
