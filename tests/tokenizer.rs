//! Text prompts go through the vault's tokenizer exactly as HuggingFace tokenizes them,
//! and generated ids come back as streamed text.

mod common;

use common::*;

#[test]
fn text_prompts_tokenize_like_transformers_and_stream_text() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let v = vault.to_str().unwrap();
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("tokenizer_golden.json")).unwrap()).unwrap();
    for s in golden["samples"].as_array().unwrap() {
        let text = s["text"].as_str().unwrap();
        let out: serde_json::Value = serde_json::from_str(&run_ok(&[
            "generate",
            "--vault",
            v,
            "--prompt",
            text,
            "--max-tokens",
            "3",
            "--ignore-eos",
            "--json",
        ]))
        .unwrap();
        assert_eq!(id_list(&out["prompt_ids"]), id_list(&s["ids"]), "tokenizing {text:?}");
        assert_eq!(id_list(&out["token_ids"]).len(), 3);
    }
    // Streamed text equals the JSON text of the same greedy run.
    let args = ["generate", "--vault", v, "--prompt", "Hello world", "--max-tokens", "8", "--ignore-eos"];
    let streamed = run_ok(&args);
    let mut json_args = args.to_vec();
    json_args.push("--json");
    let out: serde_json::Value = serde_json::from_str(&run_ok(&json_args)).unwrap();
    assert_eq!(streamed.trim_end_matches('\n'), out["text"].as_str().unwrap());
    assert!(!streamed.trim().is_empty());
}
