//! Golden tests: the CPU reference engine against HuggingFace transformers on tiny
//! random-weight Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE checkpoints (greedy ids
//! identical, logits within 1e-4); the GGUF fixtures are in `convert_gguf.rs`.

mod common;

use common::*;

fn check_fixture(name: &str, convert_args: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert(name, dir.path(), convert_args);
    check_golden(name, &vault, dir.path());
}

#[test]
fn all_moe_f32_matches_transformers() {
    check_fixture("moe_all", &[]);
}

#[test]
fn dense_layer0_gqa_tied_matches_transformers() {
    check_fixture("dense0_gqa", &[]);
}

#[test]
fn bf16_sharded_sparse_step_matches_transformers() {
    check_fixture("bf16_sharded", &[]);
}

#[test]
fn bf16_checkpoint_widened_to_f32_gives_same_results() {
    check_fixture("bf16_sharded", &["--dtype", "f32"]);
}

#[test]
fn qwen3_next_fused_projections_f32_matches_transformers() {
    check_fixture("next_f32", &[]);
}

#[test]
fn qwen3_next_bf16_tied_matches_transformers() {
    check_fixture("next_bf16", &[]);
}

#[test]
fn qwen3_5_moe_split_projections_f32_matches_transformers() {
    check_fixture("q35_f32", &[]);
}

#[test]
fn qwen3_5_moe_vision_language_bf16_text_model_matches_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q35_vl_bf16.vault");
    let hf = fixture("q35_vl_bf16");
    let args = ["convert", "--hf", hf.to_str().unwrap(), "--out", out.to_str().unwrap()];
    let run = run(&args);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let log = String::from_utf8_lossy(&run.stderr);
    assert!(log.contains("skipping") && log.contains("vision tensors"), "{log}");
    assert!(log.contains("2 multi-token-prediction (MTP) tensors"), "{log}");
    check_golden("q35_vl_bf16", &out, dir.path());
}
