//! The vault's tokenizer (HuggingFace `tokenizer.json`) and incremental detokenizing.

use std::path::Path;

use anyhow::{anyhow, Result};
use tokenizers::Tokenizer;

/// Loads `tokenizer.json` from a vault directory.
pub fn load(vault_dir: &Path) -> Result<Tokenizer> {
    let path = vault_dir.join("tokenizer.json");
    if !path.exists() {
        anyhow::bail!(
            "{} is missing: this vault has no tokenizer; pass --prompt-ids instead of --prompt",
            path.display()
        );
    }
    Tokenizer::from_file(&path).map_err(|e| anyhow!("cannot load {}: {e}", path.display()))
}

/// Tokenizes `text` the way the HuggingFace tokenizer does by default.
pub fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let enc = tok.encode(text, true).map_err(|e| anyhow!("cannot tokenize the prompt: {e}"))?;
    Ok(enc.get_ids().to_vec())
}

/// Turns a growing list of token ids into text pieces, holding back bytes that do not
/// yet form complete characters.
pub struct Detokenizer<'a> {
    tok: &'a Tokenizer,
    ids: Vec<u32>,
    emitted: usize,
}

impl<'a> Detokenizer<'a> {
    /// A detokenizer with no tokens yet.
    pub fn new(tok: &'a Tokenizer) -> Self {
        Detokenizer { tok, ids: Vec::new(), emitted: 0 }
    }

    /// Adds `id`; returns the newly completed text, if any.
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = self.tok.decode(&self.ids, true).map_err(|e| anyhow!("cannot detokenize: {e}"))?;
        if text.ends_with('\u{FFFD}') || text.len() < self.emitted {
            return Ok(String::new());
        }
        let Some(piece) = text.get(self.emitted..).map(str::to_string) else {
            return Ok(String::new());
        };
        self.emitted = text.len();
        Ok(piece)
    }

    /// Text not yet returned by [`Detokenizer::push`] (bytes held back at the end of
    /// generation because they never formed a complete character).
    pub fn flush(&mut self) -> Result<String> {
        let text = self.text()?;
        let rest = text.get(self.emitted..).unwrap_or_default().to_string();
        self.emitted = text.len();
        Ok(rest)
    }

    /// All text decoded so far.
    pub fn text(&self) -> Result<String> {
        self.tok.decode(&self.ids, true).map_err(|e| anyhow!("cannot detokenize: {e}"))
    }
}
