//! Model definitions: the resident part of a model (references to every dense tensor in
//! the vault, resolved and shape-checked once at load, plus the RoPE tables) and each
//! family's layer loop, written once over the backends' operations.

pub mod qwen3_moe;

use std::sync::Arc;

use smoe_proto::{ModelConfig, VaultError, MANIFEST_FILE};

use crate::contract::ForwardError;
use crate::tensor::WeightView;
use crate::vault::{TensorRef, Vault};

/// The feed-forward block of one layer.
pub enum FfnRefs {
    /// Dense SwiGLU MLP with resident weights.
    Dense {
        /// `gate_proj` [intermediate, hidden].
        gate: TensorRef,
        /// `up_proj` [intermediate, hidden].
        up: TensorRef,
        /// `down_proj` [hidden, intermediate].
        down: TensorRef,
    },
    /// Routed experts; only the router gate is resident.
    Moe {
        /// Router gate [num_experts, hidden].
        router: TensorRef,
    },
}

/// Resident tensors of one decoder layer.
pub struct LayerRefs {
    /// RMSNorm before attention.
    pub input_norm: TensorRef,
    /// RMSNorm before the feed-forward block.
    pub post_norm: TensorRef,
    /// Query projection [heads·head_dim, hidden].
    pub q: TensorRef,
    /// Key projection [kv_heads·head_dim, hidden].
    pub k: TensorRef,
    /// Value projection [kv_heads·head_dim, hidden].
    pub v: TensorRef,
    /// Output projection [hidden, heads·head_dim].
    pub o: TensorRef,
    /// Per-head RMSNorm on queries [head_dim].
    pub q_norm: TensorRef,
    /// Per-head RMSNorm on keys [head_dim].
    pub k_norm: TensorRef,
    /// The feed-forward block.
    pub ffn: FfnRefs,
}

/// Precomputed RoPE cos/sin tables, `[position][head_dim / 2]` each.
pub struct RopeTable {
    /// cos(pos · inv_freq[i]).
    pub cos: Vec<f32>,
    /// sin(pos · inv_freq[i]).
    pub sin: Vec<f32>,
    /// head_dim / 2.
    pub half: usize,
}

impl RopeTable {
    /// Tables for positions `0..max_pos`, computed in f32 as the reference does.
    pub fn new(theta: f64, head_dim: usize, max_pos: usize) -> Self {
        let half = head_dim / 2;
        let inv: Vec<f32> =
            (0..half).map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32)).collect();
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for &f in &inv {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        RopeTable { cos, sin, half }
    }

    /// Rotates one head vector in place for position `pos` (rotate-half convention).
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let h = self.half;
        let (c, s) = (&self.cos[pos * h..(pos + 1) * h], &self.sin[pos * h..(pos + 1) * h]);
        for i in 0..h {
            let (a, b) = (x[i], x[i + h]);
            x[i] = a * c[i] - b * s[i];
            x[i + h] = b * c[i] + a * s[i];
        }
    }
}

/// A model's configuration and resident weights, shared by every session.
pub struct Model {
    /// The vault the weights are mapped from.
    pub vault: Arc<Vault>,
    /// The model configuration.
    pub cfg: ModelConfig,
    /// Token embedding [vocab, hidden].
    pub embed: TensorRef,
    /// Final RMSNorm [hidden].
    pub norm: TensorRef,
    /// LM head [vocab, hidden] (the embedding when tied).
    pub lm_head: TensorRef,
    /// Per-layer tensors.
    pub layers: Vec<LayerRefs>,
    /// RoPE tables for the supported context.
    pub rope: RopeTable,
    /// Longest sequence (prompt + generated) a session may hold.
    pub max_context: usize,
}

impl Model {
    /// Resolves every resident tensor of `vault` and precomputes RoPE for
    /// `max_context` positions (clamped to the model's trained context).
    pub fn load(vault: Arc<Vault>, max_context: usize) -> Result<Model, VaultError> {
        let cfg = vault.manifest().model.clone();
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let norm_vec = |name: &str, n: usize| -> Result<TensorRef, VaultError> {
            let r = vault.resolve(name, &[n])?;
            if vault.view(&r).as_f32().is_none() {
                return Err(VaultError::Manifest {
                    file: vault.dir().join(MANIFEST_FILE),
                    reason: format!("norm weight `{name}` must be stored as f32"),
                });
            }
            Ok(r)
        };
        let embed = vault.resolve("model.embed_tokens.weight", &[v, h])?;
        let lm_head =
            if cfg.tie_word_embeddings { embed.clone() } else { vault.resolve("lm_head.weight", &[v, h])? };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let ffn = if cfg.is_moe_layer(l) {
                FfnRefs::Moe {
                    router: vault.resolve(&format!("{p}.mlp.gate.weight"), &[cfg.num_experts, h])?,
                }
            } else {
                let i = cfg.intermediate_size;
                FfnRefs::Dense {
                    gate: vault.resolve(&format!("{p}.mlp.gate_proj.weight"), &[i, h])?,
                    up: vault.resolve(&format!("{p}.mlp.up_proj.weight"), &[i, h])?,
                    down: vault.resolve(&format!("{p}.mlp.down_proj.weight"), &[h, i])?,
                }
            };
            layers.push(LayerRefs {
                input_norm: norm_vec(&format!("{p}.input_layernorm.weight"), h)?,
                post_norm: norm_vec(&format!("{p}.post_attention_layernorm.weight"), h)?,
                q: vault.resolve(&format!("{p}.self_attn.q_proj.weight"), &[cfg.q_dim(), h])?,
                k: vault.resolve(&format!("{p}.self_attn.k_proj.weight"), &[cfg.kv_dim(), h])?,
                v: vault.resolve(&format!("{p}.self_attn.v_proj.weight"), &[cfg.kv_dim(), h])?,
                o: vault.resolve(&format!("{p}.self_attn.o_proj.weight"), &[h, cfg.q_dim()])?,
                q_norm: norm_vec(&format!("{p}.self_attn.q_norm.weight"), cfg.head_dim)?,
                k_norm: norm_vec(&format!("{p}.self_attn.k_norm.weight"), cfg.head_dim)?,
                ffn,
            });
        }
        let norm = norm_vec("model.norm.weight", h)?;
        let max_context = max_context.clamp(1, cfg.max_position_embeddings);
        let rope = RopeTable::new(cfg.rope_theta, cfg.head_dim, max_context);
        Ok(Model { vault, cfg, embed, norm, lm_head, layers, rope, max_context })
    }

    /// Checks a block of `tokens` at positions `start..` before it runs: the one place
    /// that checks block size, context length and token ids.
    pub fn check_block(&self, start: usize, tokens: &[u32], max_rows: usize) -> Result<(), ForwardError> {
        let m = tokens.len();
        if m == 0 || m > max_rows {
            return Err(ForwardError::BlockSize { rows: m, max: max_rows });
        }
        self.check_context(start + m)?;
        self.check_tokens(tokens)
    }

    /// Checks that a session of `needed` positions fits the context.
    pub fn check_context(&self, needed: usize) -> Result<(), ForwardError> {
        match needed > self.max_context {
            true => Err(ForwardError::ContextFull { needed, max: self.max_context }),
            false => Ok(()),
        }
    }

    /// Checks that every id is in the vocabulary.
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<(), ForwardError> {
        let vocab = self.cfg.vocab_size;
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(&id) => Err(ForwardError::TokenOutOfVocab { id, vocab }),
            None => Ok(()),
        }
    }

    /// Every resident weight matrix the layers project with (for backends that upload
    /// them), each once.
    pub fn matrices(&self) -> impl Iterator<Item = &TensorRef> {
        let per_layer = self.layers.iter().flat_map(|l| {
            let ffn: Vec<&TensorRef> = match &l.ffn {
                FfnRefs::Dense { gate, up, down } => vec![gate, up, down],
                FfnRefs::Moe { router } => vec![router],
            };
            [&l.q, &l.k, &l.v, &l.o].into_iter().chain(ffn)
        });
        per_layer.chain(std::iter::once(&self.lm_head))
    }

    /// Every resident f32 vector (norm weights), each once.
    pub fn vectors(&self) -> impl Iterator<Item = &TensorRef> {
        let per_layer = self.layers.iter().flat_map(|l| [&l.input_norm, &l.post_norm, &l.q_norm, &l.k_norm]);
        per_layer.chain(std::iter::once(&self.norm))
    }

    /// A view of a resident tensor.
    pub fn w(&self, r: &TensorRef) -> WeightView<'_> {
        self.vault.view(r)
    }

    /// A resident 1-D f32 vector (norm weights; checked at load).
    pub fn vec(&self, r: &TensorRef) -> &[f32] {
        self.vault.view(r).as_f32().unwrap_or(&[])
    }
}
