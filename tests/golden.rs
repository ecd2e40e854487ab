//! Golden tests: the CPU reference engine against HuggingFace transformers on tiny
//! random-weight Qwen3-MoE checkpoints (greedy ids identical, logits within 1e-4).

mod common;

use common::*;

const TOLERANCE: f32 = 1e-4;

fn check_fixture(name: &str, convert_args: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert(name, dir.path(), convert_args);
    let golden = fixture(name).join("golden_logits.safetensors");
    for (i, (prompt, greedy)) in golden_cases(name).iter().enumerate() {
        let lpath = dir.path().join(format!("logits{i}.safetensors"));
        let out = generate_json(&vault, prompt, greedy.len(), &lpath, &[]);
        assert_eq!(
            &id_list(&out["token_ids"]),
            greedy,
            "{name} case {i}: greedy ids differ from transformers"
        );
        assert_eq!(id_list(&out["prompt_ids"]), *prompt);
        let (shape, ours) = read_f32(&lpath, "logits");
        let (gshape, theirs) = read_f32(&golden, &format!("case{i}"));
        assert_eq!(shape, gshape, "{name} case {i}: logits shape");
        let max = ours.iter().zip(&theirs).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(max <= TOLERANCE, "{name} case {i}: max |logit diff| {max} > {TOLERANCE}");
        let stats = &out["stats"];
        assert_eq!(stats["prefill_tokens"].as_u64().unwrap() as usize, prompt.len());
        assert_eq!(stats["decode_tokens"].as_u64().unwrap() as usize, greedy.len() - 1);
        assert!(stats["blob_reads"].as_u64().unwrap() > 0);
    }
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
