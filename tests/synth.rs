//! `synth` writes valid, deterministic random-weight vaults (Qwen3-MoE and hybrid) that
//! the engine runs and that pass the identity gate; bad options are rejected clearly.

mod common;

use common::*;

#[test]
fn synth_vaults_are_deterministic_and_pass_verify() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.vault");
    let b = dir.path().join("b.vault");
    // A hybrid model: three DeltaNet layers, then gated attention.
    let c = dir.path().join("c.vault");
    let tok = fixture("moe_all");
    for (v, preset, layers) in [(&a, "tiny", "3"), (&b, "tiny", "3"), (&c, "tiny-hybrid", "4")] {
        run_ok(&[
            "synth",
            "--out",
            v.to_str().unwrap(),
            "--preset",
            preset,
            "--seed",
            "3",
            "--layers",
            layers,
            "--tokenizer",
            tok.to_str().unwrap(),
        ]);
    }
    let manifest = |v: &std::path::Path| std::fs::read_to_string(v.join("manifest.json")).unwrap();
    assert_eq!(manifest(&a), manifest(&b), "same seed, same vault");
    let m: serde_json::Value = serde_json::from_str(&manifest(&a)).unwrap();
    assert_eq!(m["model"]["num_hidden_layers"], 3);
    assert!(m["tokenizer_files"].as_array().unwrap().iter().any(|f| f == "tokenizer.json"));
    let hybrid: serde_json::Value = serde_json::from_str(&manifest(&c)).unwrap();
    let types = &hybrid["model"]["hybrid"]["layer_types"];
    assert_eq!(
        types,
        &serde_json::json!(["linear_attention", "linear_attention", "linear_attention", "full_attention"])
    );
    for v in [&a, &c] {
        let out =
            run_ok(&["verify", "--vault", v.to_str().unwrap(), "--chunk-sizes", "3,16", "--tokens", "4"]);
        assert!(out.contains(" 0 failed"), "{out}");
    }
    let text = run_ok(&[
        "generate",
        "--vault",
        a.to_str().unwrap(),
        "--prompt",
        "Hello",
        "--max-tokens",
        "3",
        "--ignore-eos",
    ]);
    assert!(!text.is_empty());
}

#[test]
fn synth_rejects_bad_options() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.vault");
    let o = out.to_str().unwrap();
    let err = run_err(&["synth", "--out", o, "--preset", "gpt5"]);
    assert!(err.contains("unknown preset") && err.contains("qwen3-30b-a3b"), "{err}");
    let err = run_err(&["synth", "--out", o, "--preset", "tiny", "--layers", "0"]);
    assert!(err.contains("--layers"), "{err}");
    let err = run_err(&["synth", "--out", o, "--preset", "tiny", "--tokenizer", "/nonexistent"]);
    assert!(err.contains("tokenizer.json"), "{err}");
    let err = run_err(&["synth", "--out", o, "--preset", "tiny-hybrid", "--routing", "trained"]);
    assert!(err.contains("--routing uniform"), "{err}");
    let err = run_err(&["synth", "--out", o, "--preset", "qwen3.5-397b-a17b", "--format", "hf"]);
    assert!(err.contains("Qwen3-MoE checkpoints only"), "{err}");
}
