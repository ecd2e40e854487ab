//! The normalised model configuration the engine runs from, independent of which key
//! style the original checkpoint's `config.json` used.

use serde::{Deserialize, Serialize};

/// Most decoder layers a model may have (layer indices are 16-bit in expert keys).
pub const MAX_LAYERS: usize = u16::MAX as usize;
/// Most routed experts per MoE layer (expert indices are 16-bit in expert keys).
pub const MAX_EXPERTS: usize = u16::MAX as usize;

/// Most bytes one session's KV cache may need over the whole trained context (1 PiB;
/// bounds the sizes derived from a model's shape so that none overflows).
pub const MAX_KV_BYTES: u64 = 1 << 50;

/// Shape and hyper-parameters of a Qwen3-MoE style decoder, as stored in the vault
/// manifest. Produced by the checkpoint reader from a HuggingFace `config.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// HuggingFace architecture name the vault was converted from.
    pub architecture: String,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Intermediate width of dense (non-MoE) MLP layers.
    pub intermediate_size: usize,
    /// Intermediate width of each routed expert.
    pub moe_intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (GQA when smaller than `num_attention_heads`).
    pub num_key_value_heads: usize,
    /// Width of one attention head.
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding and LM head).
    pub vocab_size: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f32,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// Longest context the model was trained for.
    pub max_position_embeddings: usize,
    /// Routed experts per MoE layer.
    pub num_experts: usize,
    /// Experts chosen per token (top-k).
    pub num_experts_per_tok: usize,
    /// Whether the top-k routing weights are renormalised to sum to one.
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer is MoE (counting from 1).
    pub decoder_sparse_step: usize,
    /// Layers forced to use the dense MLP.
    pub mlp_only_layers: Vec<usize>,
    /// Whether the LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Token ids that end generation.
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Whether decoder layer `layer` uses the routed-expert MoE block (otherwise the
    /// dense MLP), following the Qwen3-MoE rule.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer) && self.sparse_step_routes(layer)
    }

    /// Indices of the MoE layers, in order (linear in the layer count, however long
    /// `mlp_only_layers` is).
    pub fn moe_layers(&self) -> Vec<usize> {
        let dense: std::collections::HashSet<usize> = self.mlp_only_layers.iter().copied().collect();
        (0..self.num_hidden_layers).filter(|&l| !dense.contains(&l) && self.sparse_step_routes(l)).collect()
    }

    /// The Qwen3-MoE rule without `mlp_only_layers`: experts exist and `layer` is a
    /// multiple of `decoder_sparse_step` (counting from 1).
    fn sparse_step_routes(&self, layer: usize) -> bool {
        self.num_experts > 0
            && self.decoder_sparse_step > 0
            && (layer + 1).is_multiple_of(self.decoder_sparse_step)
    }

    /// Rows of the fused query projection.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Rows of the key (and value) projection.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Checks internal consistency; returns the name of the offending field and why.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("`{name}` must be positive"));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(format!(
                "`num_attention_heads` ({}) must be a multiple of `num_key_value_heads` ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("`head_dim` ({}) must be even for RoPE", self.head_dim));
        }
        if self.num_experts > MAX_EXPERTS || self.num_hidden_layers > MAX_LAYERS {
            return Err(format!(
                "`num_experts` ({}) and `num_hidden_layers` ({}) must be at most {MAX_EXPERTS} and {MAX_LAYERS}",
                self.num_experts, self.num_hidden_layers
            ));
        }
        // Every size derived from the shape (projections, one session's KV cache over the
        // whole trained context) must fit in 64 bits.
        let kv_bytes = [self.head_dim, self.num_hidden_layers, self.max_position_embeddings, 2 * 4]
            .iter()
            .try_fold(self.num_key_value_heads as u64, |acc, &d| acc.checked_mul(d as u64));
        let q_dim = self.num_attention_heads.checked_mul(self.head_dim);
        if q_dim.is_none() || kv_bytes.is_none_or(|b| b > MAX_KV_BYTES) {
            return Err(format!(
                "the attention shape ({} query and {} key/value heads of {} over {} layers and {} positions) \
                 needs more than {MAX_KV_BYTES} bytes of KV cache per session",
                self.num_attention_heads,
                self.num_key_value_heads,
                self.head_dim,
                self.num_hidden_layers,
                self.max_position_embeddings
            ));
        }
        if self.num_experts > 0 {
            if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
                return Err(format!(
                    "`num_experts_per_tok` ({}) must be in 1..={}",
                    self.num_experts_per_tok, self.num_experts
                ));
            }
            if self.moe_intermediate_size == 0 {
                return Err("`moe_intermediate_size` must be positive".into());
            }
        }
        if self.moe_layers().len() < self.num_hidden_layers && self.intermediate_size == 0 {
            return Err("`intermediate_size` must be positive when dense layers exist".into());
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return Err("`rms_norm_eps` must be positive".into());
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 0.0 {
            return Err("`rope_theta` must be positive".into());
        }
        Ok(())
    }
}
