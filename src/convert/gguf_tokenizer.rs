//! The tokenizer of a GGUF model as HuggingFace tokenizer files: `tokenizer.json` (what
//! the `tokenizers` crate loads) and `tokenizer_config.json` (chat template and special
//! tokens), rebuilt from the `tokenizer.*` metadata so that it encodes like the
//! checkpoint's original `tokenizer.json`.
//!
//! llama.cpp's `convert_hf_to_gguf.py` writes a byte-level BPE tokenizer (`tokenizer.ggml.model`
//! = `gpt2`) as: `tokens`, every id of the model's vocabulary (ids the tokenizer lacks
//! become `[PAD<id>]` of type UNUSED); `token_type`, 1 NORMAL for BPE vocabulary entries,
//! 3 CONTROL for added tokens that are special (or look special, `<|…|>`), 4 USER_DEFINED
//! for other added tokens (`<think>`); `merges` as `"left right"` strings in rank order;
//! and `pre`, the name of the pre-tokenizer (its regex is not stored). This module inverts
//! that: NORMAL tokens form the BPE vocabulary, CONTROL and USER_DEFINED tokens the added
//! tokens (special or not), UNUSED ids are left out, and `pre` selects the normaliser
//! and pre-tokenizer the original `tokenizer.json` of that family holds.

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

use super::gguf::{GgufFile, Value as GgufValue};

/// File names written into the vault.
pub const TOKENIZER_JSON: &str = "tokenizer.json";
/// Chat template and special tokens.
pub const TOKENIZER_CONFIG_JSON: &str = "tokenizer_config.json";

/// llama.cpp's `llama_token_type` values in `tokenizer.ggml.token_type`.
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;
const UNUSED: i64 = 5;

/// The pre-tokenizer split regex of Qwen2/Qwen3's `tokenizer.json` (llama.cpp's
/// `LLAMA_VOCAB_PRE_TYPE_QWEN2`).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tokenizer.ggml.pre` values this build knows, with their split regex and normaliser.
const PRE_TOKENIZERS: &[(&str, &str, Option<&str>)] = &[("qwen2", QWEN2_SPLIT, Some("NFC"))];

/// The two tokenizer files of `g`, as (file name, JSON text).
pub fn tokenizer_files(g: &GgufFile) -> Result<Vec<(&'static str, String)>> {
    let model = g.get_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        bail!(
            "GGUF metadata tokenizer.ggml.model is {model:?}; smoe-pipeline converts only byte-level BPE \
             tokenizers (\"gpt2\")"
        );
    }
    let pre = g.get_str("tokenizer.ggml.pre")?;
    let Some(&(_, split, normalizer)) = PRE_TOKENIZERS.iter().find(|(name, ..)| *name == pre) else {
        let known: Vec<&str> = PRE_TOKENIZERS.iter().map(|(n, ..)| *n).collect();
        bail!("GGUF metadata tokenizer.ggml.pre is {pre:?}; smoe-pipeline knows the pre-tokenizers {known:?}");
    };
    let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
    let types = token_types(g, tokens.len())?;
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, (&tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        match ty {
            UNUSED => {}
            CONTROL | USER_DEFINED => added.push(json!({
                "id": id,
                "content": tok,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": ty == CONTROL,
            })),
            _ => {
                if let Some(first) = vocab.insert(tok.to_string(), json!(id)) {
                    bail!("GGUF tokenizer.ggml.tokens holds {tok:?} twice (ids {first} and {id})");
                }
            }
        }
    }
    let merges = g
        .get_str_array("tokenizer.ggml.merges")?
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .filter(|(a, b)| !a.is_empty() && !b.is_empty() && !b.contains(' '))
                .map(|(a, b)| json!([a, b]))
                .with_context(|| format!("GGUF tokenizer.ggml.merges[{i}] is {m:?}, not \"left right\""))
        })
        .collect::<Result<Vec<Value>>>()?;

    let special = |key: &str| -> Result<Option<(u64, &str)>> {
        let key = format!("tokenizer.ggml.{key}_token_id");
        if g.get(&key).is_none() {
            return Ok(None);
        }
        let id = g.get_u64(&key)?;
        let text = tokens
            .get(id as usize)
            .with_context(|| format!("GGUF {key} is {id}, past the {} tokens", tokens.len()))?;
        Ok(Some((id, *text)))
    };
    let (bos, eos, pad) = (special("bos")?, special("eos")?, special("padding")?);
    let add_bos = matches!(g.get("tokenizer.ggml.add_bos_token"), Some(GgufValue::Bool(true)));
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    let post_processor = match (add_bos, bos) {
        (false, _) => byte_level.clone(),
        (true, Some((id, b))) => {
            let bos = |type_id: u32| json!({"SpecialToken": {"id": b, "type_id": type_id}});
            let seq = |s: &str, type_id: u32| json!({"Sequence": {"id": s, "type_id": type_id}});
            json!({"type": "Sequence", "processors": [byte_level, {
                "type": "TemplateProcessing",
                "single": [bos(0), seq("A", 0)],
                "pair": [bos(0), seq("A", 0), bos(1), seq("B", 1)],
                "special_tokens": {b: {"id": b, "ids": [id], "tokens": [b]}},
            }]})
        }
        (true, None) => {
            bail!("GGUF tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing")
        }
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer.map(|n| json!({"type": n})),
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": false},
            byte_level,
        ]},
        "post_processor": post_processor,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        },
    });

    let decoder: Map<String, Value> = added
        .iter()
        .map(|t| {
            let mut t = t.clone();
            let id = t.as_object_mut().and_then(|o| o.remove("id")).unwrap_or_default();
            (id.to_string(), t)
        })
        .collect();
    let mut config = json!({
        "add_bos_token": add_bos,
        "add_prefix_space": false,
        "added_tokens_decoder": decoder,
        "bos_token": bos.map(|(_, t)| t),
        "clean_up_tokenization_spaces": false,
        "eos_token": eos.map(|(_, t)| t),
        "errors": "replace",
        "pad_token": pad.map(|(_, t)| t),
        "split_special_tokens": false,
        "unk_token": null,
    });
    if let Ok(template) = g.get_str("tokenizer.chat_template") {
        config["chat_template"] = json!(template);
    }
    Ok(vec![
        (TOKENIZER_JSON, serde_json::to_string(&tokenizer)?),
        (TOKENIZER_CONFIG_JSON, serde_json::to_string_pretty(&config)?),
    ])
}

/// `tokenizer.ggml.token_type` (every token NORMAL when the key is absent), one per token.
fn token_types(g: &GgufFile, n: usize) -> Result<Vec<i64>> {
    const KEY: &str = "tokenizer.ggml.token_type";
    let Some(v) = g.get(KEY) else { return Ok(vec![1; n]) };
    let bad = || format!("GGUF {KEY} must be an array of {n} integers, one per token");
    let GgufValue::Array(_, items) = v else { bail!(bad()) };
    if items.len() != n {
        bail!(bad());
    }
    items.iter().map(|t| t.as_f64().map(|f| f as i64).with_context(bad)).collect()
}
