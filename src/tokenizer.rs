//! The vault's tokenizer (HuggingFace `tokenizer.json`) and incremental detokenizing.

use std::path::Path;

use anyhow::{anyhow, Result};
use smoe_actors::vault::files;
use tokenizers::Tokenizer;

/// Loads `tokenizer.json` from a vault directory, through the vault's reader of member
/// files (a regular file inside the vault, of bounded size).
pub fn load(vault_dir: &Path) -> Result<Tokenizer> {
    const NAME: &str = "tokenizer.json";
    let path = vault_dir.join(NAME);
    if let Err(e) = std::fs::symlink_metadata(&path) {
        if e.kind() == std::io::ErrorKind::NotFound {
            anyhow::bail!(
                "{} is missing: this vault has no tokenizer; pass --prompt-ids instead of --prompt",
                path.display()
            );
        }
    }
    let bytes = files::read_member(vault_dir, NAME, files::MAX_METADATA_BYTES)?;
    Tokenizer::from_bytes(bytes).map_err(|e| anyhow!("cannot load {}: {e}", path.display()))
}

/// Tokenizes `text` the way the HuggingFace tokenizer does by default.
pub fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let enc = tok.encode(text, true).map_err(|e| anyhow!("cannot tokenize the prompt: {e}"))?;
    Ok(enc.get_ids().to_vec())
}

/// What a [`Detokenizer`] needs from a tokenizer.
pub trait Decode {
    /// The text of `ids`, special tokens skipped.
    fn decode_ids(&self, ids: &[u32]) -> Result<String>;

    /// Whether `id` adds nothing to any decode: it names no token, or a special token
    /// (which decoding skips).
    fn is_silent(&self, id: u32) -> bool;
}

impl Decode for Tokenizer {
    fn decode_ids(&self, ids: &[u32]) -> Result<String> {
        self.decode(ids, true).map_err(|e| anyhow!("cannot detokenize: {e}"))
    }

    fn is_silent(&self, id: u32) -> bool {
        let special =
            self.get_added_vocabulary().get_added_tokens_decoder().get(&id).is_some_and(|t| t.special);
        special || self.id_to_token(id).is_none()
    }
}

/// Turns a growing list of token ids into text pieces whose concatenation is the decode
/// of all the ids, holding back bytes that do not yet form complete characters.
///
/// The work per token does not grow with the output (the prefix/read offset scheme of
/// HuggingFace's `TextStreamer` and vLLM): a push decodes only a window of recent ids —
/// the ids of the last piece returned, as context (decoders treat a decode's first token
/// specially, e.g. drop its leading space), then the ids not returned yet. A new piece is
/// returned once the window's text has grown past the context's and does not end in
/// U+FFFD (an incomplete UTF-8 sequence); the window then slides to start at the ids of
/// that piece. Each window starts where the text before it ended in a complete
/// character, so it decodes exactly as in a decode of everything.
pub struct Detokenizer<'a, T: Decode = Tokenizer> {
    tok: &'a T,
    /// Every id pushed.
    ids: Vec<u32>,
    /// Start of the decode window: the ids of the last piece returned.
    prefix: usize,
    /// End of the ids whose text has been returned; the ids after it are pending.
    read: usize,
    /// The text of `ids[prefix..read]`.
    prefix_text: String,
}

impl<'a, T: Decode> Detokenizer<'a, T> {
    /// A detokenizer with no tokens yet.
    pub fn new(tok: &'a T) -> Self {
        Detokenizer { tok, ids: Vec::new(), prefix: 0, read: 0, prefix_text: String::new() }
    }

    /// Adds `id`; returns the newly completed text, if any.
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        if self.tok.is_silent(id) {
            return Ok(String::new());
        }
        let text = self.tok.decode_ids(&self.ids[self.prefix..])?;
        if text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        self.advance(text)
    }

    /// Text not yet returned by [`Detokenizer::push`] (bytes held back at the end of
    /// generation because they never formed a complete character).
    pub fn flush(&mut self) -> Result<String> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let text = self.tok.decode_ids(&self.ids[self.prefix..])?;
        self.advance(text)
    }

    /// All text decoded so far.
    pub fn text(&self) -> Result<String> {
        self.tok.decode_ids(&self.ids)
    }

    /// Returns what `text` (the window's text) adds to the context's, and slides the
    /// window to start at the ids it came from; returns nothing (and keeps the window)
    /// when `text` adds nothing.
    fn advance(&mut self, text: String) -> Result<String> {
        let Some(piece) = text.get(self.prefix_text.len()..).filter(|p| !p.is_empty()) else {
            return Ok(String::new());
        };
        let piece = piece.to_string();
        self.prefix = self.read;
        self.read = self.ids.len();
        self.prefix_text = self.tok.decode_ids(&self.ids[self.prefix..self.read])?;
        Ok(piece)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// The fixture tokenizer (byte-level BPE of 381 tokens: most non-ASCII characters
    /// are several byte tokens), counting the ids handed to `decode_ids`.
    struct Counting {
        tok: Tokenizer,
        decoded: Cell<usize>,
    }

    impl Counting {
        fn fixture() -> Counting {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/moe_all");
            Counting { tok: load(&dir).unwrap(), decoded: Cell::new(0) }
        }
    }

    impl Decode for Counting {
        fn decode_ids(&self, ids: &[u32]) -> Result<String> {
            self.decoded.set(self.decoded.get() + ids.len());
            self.tok.decode_ids(ids)
        }

        fn is_silent(&self, id: u32) -> bool {
            self.tok.is_silent(id)
        }
    }

    /// Pushes `ids` one by one, then flushes; returns the pieces.
    fn stream(tok: &Counting, ids: &[u32]) -> Vec<String> {
        let mut d = Detokenizer::new(tok);
        let mut pieces: Vec<String> = ids.iter().map(|&id| d.push(id).unwrap()).collect();
        pieces.push(d.flush().unwrap());
        pieces
    }

    const MULTI_BYTE: &[&str] = &[
        "中文和日本語のテキスト、한국어도。",
        "emoji 😀🎉 and a family 👨‍👩‍👧 and a thumb 👍🏽!",
        "naïve café — “quotes” … ½ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    ];

    #[test]
    fn pieces_join_to_the_full_decode() {
        let tok = Counting::fixture();
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer_golden.json");
        let golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let mut texts: Vec<String> = golden["samples"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["text"].as_str().unwrap().into())
            .collect();
        texts.extend(MULTI_BYTE.iter().map(|s| s.to_string()));
        for text in &texts {
            let ids = encode(&tok.tok, text).unwrap();
            let pieces = stream(&tok, &ids);
            let full = tok.tok.decode(&ids, true).unwrap();
            assert_eq!(pieces.concat(), full, "streaming {text:?}");
            assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "a partial character in {pieces:?}");
        }
        // Every token of the vocabulary and beyond (unknown ids, special tokens): any byte
        // sequence, valid UTF-8 or not.
        let mut x = 0x2545_f491_u32;
        let ids: Vec<u32> = (0..3000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x % 448
            })
            .collect();
        assert_eq!(stream(&tok, &ids).concat(), tok.tok.decode(&ids, true).unwrap());
    }

    #[test]
    fn detokenizing_is_linear_in_the_output() {
        let tok = Counting::fixture();
        let text = MULTI_BYTE.concat().repeat(60);
        let ids = encode(&tok.tok, &text).unwrap();
        let n = 4000;
        assert!(ids.len() >= n, "only {} ids", ids.len());
        let ids = &ids[..n];
        let pieces = stream(&tok, ids);
        assert_eq!(pieces.concat(), tok.tok.decode(ids, true).unwrap());
        // A full decode per token would hand over n²/2 = 8 million ids.
        let per_token = tok.decoded.get() as f64 / n as f64;
        assert!(per_token < 12.0, "{per_token:.1} ids decoded per token");
    }
}
