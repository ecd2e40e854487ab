//! `synth --format hf` writes a HuggingFace checkpoint that `convert --hf` turns into the
//! very vault `synth` writes directly: the same data files and bytewise the same logits.

mod common;

use std::path::Path;

use common::*;
use serde_json::Value;

fn synth(out: &Path, extra: &[&str]) {
    let tok = fixture("moe_all");
    let mut args = vec![
        "synth",
        "--out",
        out.to_str().unwrap(),
        "--preset",
        "tiny-e128",
        "--seed",
        "5",
        "--tokenizer",
        tok.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    run_ok(&args);
}

fn same_logits_through_hf(dir: &Path, extra: &[&str]) {
    let tag = extra.join("");
    let (direct, ckpt, converted) =
        (dir.join(format!("d{tag}.vault")), dir.join(format!("hf{tag}")), dir.join(format!("c{tag}.vault")));
    synth(&direct, extra);
    let mut hf_args = extra.to_vec();
    hf_args.extend_from_slice(&["--format", "hf", "--shard-mb", "1"]);
    synth(&ckpt, &hf_args);

    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "qwen3_moe");
    assert_eq!(config["num_experts"], 128);
    assert_eq!(config["rope_theta"], 1e6);
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let mut shards: Vec<&str> =
        index["weight_map"].as_object().unwrap().values().map(|v| v.as_str().unwrap()).collect();
    shards.sort_unstable();
    shards.dedup();
    let n = shards.len();
    assert!(n >= 2, "--shard-mb 1 gives several shards");
    for (i, s) in shards.iter().enumerate() {
        assert_eq!(*s, format!("model-{:05}-of-{n:05}.safetensors", i + 1));
    }
    assert!(ckpt.join("tokenizer.json").exists());

    run_ok(&["convert", "--hf", ckpt.to_str().unwrap(), "--out", converted.to_str().unwrap()]);
    let read = |v: &Path, f: &str| std::fs::read(v.join(f)).unwrap();
    for f in ["resident.bin", "experts/layer_000.bin", "experts/layer_003.bin"] {
        assert!(read(&direct, f) == read(&converted, f), "{f} differs after the round trip ({extra:?})");
    }
    let prompt = [3, 141, 59, 26, 5, 358, 97, 9];
    let (la, lb) = (dir.join(format!("a{tag}.safetensors")), dir.join(format!("b{tag}.safetensors")));
    let a = generate_json(&direct, &prompt, 6, &la, &[]);
    let b = generate_json(&converted, &prompt, 6, &lb, &[]);
    assert_eq!(a["token_ids"], b["token_ids"]);
    assert!(std::fs::read(&la).unwrap() == std::fs::read(&lb).unwrap(), "logits differ ({extra:?})");
}

#[test]
fn hf_checkpoint_converts_to_the_direct_vault() {
    let dir = tempfile::tempdir().unwrap();
    same_logits_through_hf(dir.path(), &["--routing", "trained"]);
    same_logits_through_hf(dir.path(), &["--dtype", "f32"]);
}

#[test]
fn hf_checkpoint_is_not_overwritten_without_force() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("hf");
    synth(&ckpt, &["--format", "hf"]);
    assert!(ckpt.join("model.safetensors").exists(), "one shard is written as model.safetensors");
    let o = ckpt.to_str().unwrap();
    let err = run_err(&["synth", "--out", o, "--preset", "tiny", "--format", "hf"]);
    assert!(err.contains("--force"), "{err}");
    run_ok(&["synth", "--out", o, "--preset", "tiny", "--format", "hf", "--force"]);
}
