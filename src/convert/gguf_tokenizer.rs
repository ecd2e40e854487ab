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
//! that: CONTROL and USER_DEFINED tokens become the added tokens (special or not), UNUSED
//! ids are left out, and `pre` selects the normaliser and pre-tokenizer the original
//! `tokenizer.json` of that family holds.
//!
//! Every other token, the added ones too, is an entry of the BPE vocabulary (as in
//! checkpoints whose special tokens sit inside the vocabulary): the `tokenizers` crate
//! ignores an added token's `id` when loading and numbers it after the vocabulary unless
//! the vocabulary holds it, so only this keeps every id wherever the added tokens sit.
//! Merges never produce them, so encoding is unchanged. The file is loaded once written,
//! and every token checked to have its GGUF id.

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

use super::gguf::{GgufFile, Value as GgufValue};

/// The tokenizer file written into the vault.
pub const TOKENIZER_JSON: &str = "tokenizer.json";
/// The file with the chat template and special tokens.
pub const TOKENIZER_CONFIG_JSON: &str = "tokenizer_config.json";

/// `tokenizer.ggml.token_type` of a special added token (llama.cpp's `llama_token_type`).
const CONTROL: i64 = 3;
/// `tokenizer.ggml.token_type` of an added token that is not special.
const USER_DEFINED: i64 = 4;
/// `tokenizer.ggml.token_type` of an id the tokenizer lacks (`[PAD<id>]`).
const UNUSED: i64 = 5;

/// The pre-tokenizer split regex of Qwen2/Qwen3's `tokenizer.json` (llama.cpp's
/// `LLAMA_VOCAB_PRE_TYPE_QWEN2`).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tokenizer.ggml.pre` values this build knows, with their split regex and normaliser.
const PRE_TOKENIZERS: &[(&str, &str, &str)] = &[("qwen2", QWEN2_SPLIT, "NFC")];

/// A special token named by `tokenizer.ggml.<role>_token_id`: its id and text.
type Special<'a> = Option<(u64, &'a str)>;

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
        bail!(
            "GGUF metadata tokenizer.ggml.pre is {pre:?}; smoe-pipeline knows the pre-tokenizers {known:?}"
        );
    };
    let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
    let types = token_types(g, tokens.len())?;
    let (vocab, added) = vocabulary(&tokens, &types)?;
    let special = |role: &str| -> Result<Special<'_>> {
        let key = format!("tokenizer.ggml.{role}_token_id");
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
    let byte_level =
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": normalizer},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": false},
            byte_level,
        ]},
        "post_processor": post_processor(&byte_level, add_bos, bos)?,
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
            "merges": merges(g)?,
        },
    });
    let json = serde_json::to_string(&tokenizer)?;
    check_ids(&json, &tokens, &types)?;

    let decoder: Map<String, Value> = added
        .into_iter()
        .map(|mut t| {
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
    const TEMPLATE: &str = "tokenizer.chat_template";
    if g.get(TEMPLATE).is_some() {
        config["chat_template"] = json!(g.get_str(TEMPLATE)?);
    }
    Ok(vec![(TOKENIZER_JSON, json), (TOKENIZER_CONFIG_JSON, serde_json::to_string_pretty(&config)?)])
}

/// The BPE vocabulary (every token but the UNUSED ones, by id) and the added tokens
/// (CONTROL ones special, USER_DEFINED ones not), as tokenizer.json writes them.
fn vocabulary(tokens: &[&str], types: &[i64]) -> Result<(Map<String, Value>, Vec<Value>)> {
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, (&tok, &ty)) in tokens.iter().zip(types).enumerate() {
        if ty == UNUSED {
            continue;
        }
        if let Some(first) = vocab.insert(tok.to_string(), json!(id)) {
            bail!("GGUF tokenizer.ggml.tokens holds {tok:?} twice (ids {first} and {id})");
        }
        if ty == CONTROL || ty == USER_DEFINED {
            added.push(json!({
                "id": id,
                "content": tok,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": ty == CONTROL,
            }));
        }
    }
    Ok((vocab, added))
}

/// `tokenizer.ggml.merges` (`"left right"` strings) as tokenizer.json's pairs.
fn merges(g: &GgufFile) -> Result<Vec<Value>> {
    g.get_str_array("tokenizer.ggml.merges")?
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .filter(|(a, b)| !a.is_empty() && !b.is_empty() && !b.contains(' '))
                .map(|(a, b)| json!([a, b]))
                .with_context(|| format!("GGUF tokenizer.ggml.merges[{i}] is {m:?}, not \"left right\""))
        })
        .collect()
}

/// The post-processor: byte-level, and with `add_bos` the BOS token before every
/// sequence.
fn post_processor(byte_level: &Value, add_bos: bool, bos: Special<'_>) -> Result<Value> {
    match (add_bos, bos) {
        (false, _) => Ok(byte_level.clone()),
        (true, Some((id, b))) => {
            let bos = |type_id: u32| json!({"SpecialToken": {"id": b, "type_id": type_id}});
            let seq = |s: &str, type_id: u32| json!({"Sequence": {"id": s, "type_id": type_id}});
            Ok(json!({"type": "Sequence", "processors": [byte_level, {
                "type": "TemplateProcessing",
                "single": [bos(0), seq("A", 0)],
                "pair": [bos(0), seq("A", 0), bos(1), seq("B", 1)],
                "special_tokens": {b: {"id": b, "ids": [id], "tokens": [b]}},
            }]}))
        }
        (true, None) => {
            bail!("GGUF tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing")
        }
    }
}

/// Loads `json` with the `tokenizers` crate and checks that every token of the GGUF but
/// the UNUSED ones has its GGUF id.
fn check_ids(json: &str, tokens: &[&str], types: &[i64]) -> Result<()> {
    let tok = tokenizers::Tokenizer::from_bytes(json.as_bytes())
        .map_err(|e| anyhow::anyhow!("the tokenizer.json made from the GGUF does not load: {e}"))?;
    for (id, (t, _)) in tokens.iter().zip(types).enumerate().filter(|(_, (_, &ty))| ty != UNUSED) {
        if tok.token_to_id(t) != Some(id as u32) {
            bail!(
                "the tokenizer.json made from the GGUF gives token {t:?} the id {:?}, not {id}",
                tok.token_to_id(t)
            );
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::gguf::tests::{gstr, strings, u32b, Builder};

    /// A vocabulary of `<s>`, `h`, `i`, `hi` and `<think>` (USER_DEFINED) of tokenizer
    /// `model` and pre-tokenizer `pre`, with extra keys.
    fn vocab_of(model: &str, pre: &str, extra: &[(&[u8], u32, Vec<u8>)]) -> GgufFile {
        let mut types = u32b(5);
        types.extend(5u64.to_le_bytes());
        [3i32, 1, 1, 1, 4].iter().for_each(|t| types.extend(t.to_le_bytes()));
        let mut b = Builder::new()
            .kv(b"tokenizer.ggml.model", 8, gstr(model.as_bytes()))
            .kv(b"tokenizer.ggml.pre", 8, gstr(pre.as_bytes()))
            .kv(b"tokenizer.ggml.tokens", 9, strings(&["<s>", "h", "i", "hi", "<think>"]))
            .kv(b"tokenizer.ggml.token_type", 9, types)
            .kv(b"tokenizer.ggml.merges", 9, strings(&["h i"]))
            .kv(b"tokenizer.ggml.bos_token_id", 4, u32b(0));
        for (k, code, v) in extra {
            b = b.kv(k, *code, v.clone());
        }
        let dir = tempfile::tempdir().unwrap();
        GgufFile::open(&b.write(dir.path(), "t.gguf")).unwrap()
    }

    fn vocab(extra: &[(&[u8], u32, Vec<u8>)]) -> GgufFile {
        vocab_of("gpt2", "qwen2", extra)
    }

    fn load(g: &GgufFile) -> (tokenizers::Tokenizer, Value) {
        let files = tokenizer_files(g).unwrap();
        let tok = tokenizers::Tokenizer::from_bytes(files[0].1.as_bytes()).unwrap();
        (tok, serde_json::from_str(&files[1].1).unwrap())
    }

    #[test]
    fn added_tokens_special_or_not_and_no_bos_by_default() {
        let (tok, cfg) = load(&vocab(&[]));
        assert_eq!(tok.encode("hi<think>hi", true).unwrap().get_ids(), [3, 4, 3]);
        assert_eq!(tok.decode(&[0, 3, 4], true).unwrap(), "hi<think>");
        assert_eq!(cfg["bos_token"], "<s>");
        assert!(cfg["eos_token"].is_null() && cfg.get("chat_template").is_none());
        assert_eq!(cfg["added_tokens_decoder"]["4"]["special"], false);
    }

    #[test]
    fn add_bos_token_prefixes_bos() {
        let (tok, cfg) = load(&vocab(&[(b"tokenizer.ggml.add_bos_token", 7, vec![1])]));
        assert_eq!(tok.encode("hi", true).unwrap().get_ids(), [0, 3]);
        assert_eq!(cfg["add_bos_token"], true);
    }

    #[test]
    fn unsupported_tokenizers_are_errors() {
        let err = |g: GgufFile| format!("{:#}", tokenizer_files(&g).unwrap_err());
        let e = err(vocab_of("llama", "default", &[]));
        assert!(e.contains("tokenizer.ggml.model is \"llama\"") && e.contains("(\"gpt2\")"), "{e}");
        let e = err(vocab_of("gpt2", "llama-bpe", &[]));
        assert!(e.contains("tokenizer.ggml.pre is \"llama-bpe\"") && e.contains("[\"qwen2\"]"), "{e}");
        let e = err(vocab(&[(b"tokenizer.ggml.eos_token_id", 4, u32b(9))]));
        assert!(e.contains("eos_token_id is 9, past the 5 tokens"), "{e}");
    }
}
