//! `smoe-pipeline gguf-info` on the gguf-py fixtures (tests/fixtures/make_gguf.py): a
//! split model read through its first part, and clean errors for a later part, a
//! truncated file and a tensor type without a kernel.

mod common;

use common::*;

fn gguf(name: &str) -> String {
    fixture("gguf").join(name).to_str().unwrap().to_string()
}

#[test]
fn shows_a_split_model_and_dequantises_a_row() {
    let out =
        run_ok(&["gguf-info", "--gguf", &gguf("split-00001-of-00003.gguf"), "--tensor", "output.weight"]);
    for want in [
        "GGUF v3, 3 part(s), 7 tensors",
        "model: architecture qwen3moe",
        "tokenizer.ggml.tokens (array of string) = [\"a\", \"b\", \"<|im_end|>\", \"é\"]",
        "blk.0.ffn_gate_exps.weight q8_0 [2, 3, 64] 408 bytes (part 2)",
        "output.weight (q6_K, 3 rows × 256 cols) row 0: [",
        "every tensor type is supported",
    ] {
        assert!(out.contains(want), "{want:?} not in:\n{out}");
    }
}

#[test]
fn later_parts_truncated_files_and_unsupported_types_are_clean_errors() {
    let err = run_err(&["gguf-info", "--gguf", &gguf("split-00002-of-00003.gguf")]);
    assert!(err.contains("open the first part") && err.contains("split-00001-of-00003.gguf"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(gguf("tiny.gguf")).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 100]).unwrap();
    let err = run_err(&["gguf-info", "--gguf", cut.to_str().unwrap()]);
    assert!(err.contains("tensor output.weight") && err.contains("the file is truncated"), "{err}");

    // output.weight's info: name, n_dims (u32), two u64 dims, then the type id.
    let mut q3 = bytes.clone();
    let name = b"output.weight";
    let at = q3.windows(name.len()).position(|w| w == name).unwrap() + name.len() + 4 + 16;
    assert_eq!(q3[at..at + 4], 14u32.to_le_bytes(), "q6_K");
    q3[at..at + 4].copy_from_slice(&11u32.to_le_bytes());
    let path = dir.path().join("q3.gguf");
    std::fs::write(&path, q3).unwrap();
    let err = run_err(&["gguf-info", "--gguf", path.to_str().unwrap()]);
    assert!(
        err.contains("tensor output.weight is q3_K") && err.contains("supported: f32, f16, bf16"),
        "{err}"
    );
}
