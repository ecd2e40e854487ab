//! Refusing a prompt by its byte length, before tokenizing it, where that is sound.
//!
//! A token can be one byte long, so a prompt's byte length does not bound its token
//! count from above; it bounds it from *below* when every token stands for at most `L`
//! bytes of the text: then `tokens ≥ bytes / L`, and a prompt of more than
//! `max_context × L` bytes cannot fit the context whatever its tokens are. That holds for
//! byte-level BPE tokenizers (Qwen, GPT-2 style), with three provisos checked here:
//!
//! * no step may drop text: the normalizer may only be Unicode normalization (NFC, NFD,
//!   NFKC, NFKD) or lowercasing, which shrink text at most 4× per character (U+1D400
//!   `𝐀`, 4 bytes, is `A` under NFKC), so `L` is multiplied by those factors; the
//!   pre-tokenizer may only split (ByteLevel, Split or Punctuation without `Removed`,
//!   Digits), and every byte must be in the vocabulary (so nothing is unknown or
//!   skipped);
//! * added tokens must not absorb neighbouring whitespace (`lstrip`/`rstrip`), and they
//!   count with their own length in `L`;
//! * the tokenizer must not truncate.
//!
//! For any other tokenizer the check is off and prompts are only refused after
//! tokenizing (still on the blocking pool).

use serde_json::Value;
use tokenizers::Tokenizer;

/// Worst-case shrink of a text under each allowed normalizer (bytes in per byte out).
const SHRINK: &[(&str, usize)] = &[("NFC", 3), ("NFD", 3), ("NFKC", 4), ("NFKD", 4), ("Lowercase", 3)];

/// The most bytes of prompt text one token can stand for, when that is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptBound {
    bytes_per_token: Option<usize>,
}

impl PromptBound {
    /// The bound for `tok` (off, with the reason logged, where it would not be sound).
    pub fn of(tok: &Tokenizer) -> PromptBound {
        let json = tok.to_string(false).ok().and_then(|s| serde_json::from_str::<Value>(&s).ok());
        let bound = match json.as_ref().map(bytes_per_token) {
            Some(Ok(n)) => {
                tracing::info!("prompts longer than max_context × {n} bytes are refused before tokenizing");
                Some(n)
            }
            Some(Err(why)) => {
                tracing::info!("prompts are checked against the context only after tokenizing: {why}");
                None
            }
            None => None,
        };
        PromptBound { bytes_per_token: bound }
    }

    /// `Err` with the reason when a text of `bytes` bytes certainly has more than
    /// `max_context` tokens.
    pub fn check(&self, bytes: usize, max_context: usize) -> Result<(), String> {
        match self.bytes_per_token {
            Some(per) if bytes > max_context.saturating_mul(per) => Err(format!(
                "this model's maximum context length is {max_context} tokens, but the prompt is {bytes} bytes \
                 long, more than {max_context} tokens (each token covers at most {per} bytes)"
            )),
            _ => Ok(()),
        }
    }
}

/// `L × shrink` for a tokenizer's JSON, or why the bound is not sound for it.
fn bytes_per_token(t: &Value) -> Result<usize, String> {
    if !t["truncation"].is_null() {
        return Err("the tokenizer truncates".into());
    }
    let shrink = normalizer_shrink(&t["normalizer"])?;
    if !pre_tokenizer_keeps_text(&t["pre_tokenizer"])? {
        return Err("the pre-tokenizer is not byte-level".into());
    }
    let model = &t["model"];
    if model["type"] != "BPE" {
        return Err(format!("the model is {} (not BPE)", model["type"]));
    }
    let vocab = model["vocab"].as_object().ok_or("the BPE vocabulary is missing")?;
    if let Some(b) = byte_alphabet().find(|c| !vocab.contains_key(&c.to_string())) {
        return Err(format!("the byte {b:?} is not in the vocabulary"));
    }
    // ByteLevel writes each byte as one character.
    let mut longest = vocab.keys().map(|k| k.chars().count()).max().unwrap_or(1);
    for a in t["added_tokens"].as_array().into_iter().flatten() {
        if a["lstrip"] == true || a["rstrip"] == true {
            return Err(format!("the added token {} absorbs whitespace", a["content"]));
        }
        longest = longest.max(a["content"].as_str().map_or(0, str::len));
    }
    Ok(longest * shrink)
}

/// How many times a normalizer can shrink text, or why it may drop text.
fn normalizer_shrink(n: &Value) -> Result<usize, String> {
    match n["type"].as_str() {
        None if n.is_null() => Ok(1),
        Some("Sequence") => n["normalizers"]
            .as_array()
            .ok_or("a normalizer sequence without normalizers")?
            .iter()
            .try_fold(1, |acc, n| Ok(acc * normalizer_shrink(n)?)),
        Some(kind) => SHRINK
            .iter()
            .find(|(name, _)| *name == kind)
            .map(|(_, f)| *f)
            .ok_or_else(|| format!("the normalizer {kind} may remove text")),
        None => Err("a normalizer without a type".into()),
    }
}

/// Whether a pre-tokenizer is byte-level (and drops nothing); `Err` when it may drop
/// text.
fn pre_tokenizer_keeps_text(p: &Value) -> Result<bool, String> {
    let removes = p["behavior"] == "Removed";
    match p["type"].as_str() {
        Some("ByteLevel") => Ok(true),
        Some("Sequence") => p["pretokenizers"]
            .as_array()
            .ok_or("a pre-tokenizer sequence without pre-tokenizers")?
            .iter()
            .try_fold(false, |byte_level, p| Ok(pre_tokenizer_keeps_text(p)? || byte_level)),
        Some("Split" | "Punctuation") if !removes => Ok(false),
        Some("Digits") => Ok(false),
        Some(kind) => Err(format!("the pre-tokenizer {kind} may remove text")),
        None => Err("no byte-level pre-tokenizer".into()),
    }
}

/// The 256 characters byte-level BPE writes bytes as (GPT-2's `bytes_to_unicode`).
fn byte_alphabet() -> impl Iterator<Item = char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256;
    (0u32..256).map(move |b| {
        if printable(b) {
            char::from_u32(b).unwrap_or('?')
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap_or('?')
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A byte-level BPE tokenizer's JSON with every byte and one long token.
    fn byte_level(normalizer: Value, pre: Value) -> Value {
        let mut vocab: serde_json::Map<String, Value> =
            byte_alphabet().enumerate().map(|(i, c)| (c.to_string(), json!(i))).collect();
        vocab.insert("ĠĠĠĠĠĠĠĠ".into(), json!(300));
        json!({
            "truncation": null,
            "normalizer": normalizer,
            "pre_tokenizer": pre,
            "model": {"type": "BPE", "vocab": vocab},
            "added_tokens": [{"content": "<|endoftext|>", "lstrip": false, "rstrip": false}],
        })
    }

    #[test]
    fn sound_only_for_byte_level_bpe_that_drops_nothing() {
        let bl = json!({"type": "ByteLevel"});
        // The longest token: the 13-byte added token; NFC shrinks text up to 3×.
        assert_eq!(bytes_per_token(&byte_level(Value::Null, bl.clone())), Ok(13));
        assert_eq!(bytes_per_token(&byte_level(json!({"type": "NFC"}), bl.clone())), Ok(39));
        let seq =
            json!({"type": "Sequence", "pretokenizers": [{"type": "Split", "behavior": "Isolated"}, bl]});
        assert_eq!(bytes_per_token(&byte_level(json!({"type": "NFKC"}), seq)), Ok(52));
        let strip = byte_level(json!({"type": "Strip"}), json!({"type": "ByteLevel"}));
        assert!(bytes_per_token(&strip).unwrap_err().contains("Strip"));
        let removed = json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "behavior": "Removed"}, {"type": "ByteLevel"}]});
        assert!(bytes_per_token(&byte_level(Value::Null, removed)).is_err());
        assert!(bytes_per_token(&byte_level(Value::Null, json!({"type": "Whitespace"}))).is_err());
        let mut t = byte_level(Value::Null, json!({"type": "ByteLevel"}));
        t["added_tokens"][0]["lstrip"] = json!(true);
        assert!(bytes_per_token(&t).unwrap_err().contains("whitespace"));
        let mut t = byte_level(Value::Null, json!({"type": "ByteLevel"}));
        t["model"]["vocab"].as_object_mut().unwrap().remove("Ġ");
        assert!(bytes_per_token(&t).unwrap_err().contains("not in the vocabulary"));
        let mut t = byte_level(Value::Null, json!({"type": "ByteLevel"}));
        t["truncation"] = json!({"max_length": 512});
        assert!(bytes_per_token(&t).is_err());
    }

    #[test]
    fn refuses_only_beyond_the_bound() {
        let b = PromptBound { bytes_per_token: Some(10) };
        assert!(b.check(1000, 100).is_ok());
        assert!(b.check(1001, 100).unwrap_err().contains("1001 bytes"));
        assert!(PromptBound { bytes_per_token: None }.check(usize::MAX, 1).is_ok());
    }

    #[test]
    fn byte_alphabet_is_gpt2s() {
        let a: Vec<char> = byte_alphabet().collect();
        assert_eq!(a.len(), 256);
        assert_eq!((a[b' ' as usize], a[b'!' as usize], a[0], a[255]), ('Ġ', '!', 'Ā', 'ÿ'));
    }
}
