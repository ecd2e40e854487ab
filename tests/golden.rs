//! Golden tests: the CPU reference engine against HuggingFace transformers on tiny
//! random-weight Qwen3-MoE checkpoints (greedy ids identical, logits within 1e-4); the
//! GGUF fixtures are in `convert_gguf.rs`.

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
