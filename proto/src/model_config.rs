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
    /// The hybrid family's extra shape (Qwen3-Next, Qwen3.5-MoE): gated-DeltaNet layers
    /// beside gated full attention, a shared expert beside the routed ones. `None` for
    /// Qwen3-MoE.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hybrid: Option<HybridConfig>,
}

/// What mixes tokens in one decoder layer of a hybrid model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Gated softmax attention over a KV cache.
    FullAttention,
    /// Gated DeltaNet linear attention over a conv state and a recurrent state.
    LinearAttention,
}

/// The hybrid family's shape (Qwen3-Next, Qwen3.5-MoE), as transformers' `Qwen3NextConfig`
/// names it.
///
/// Vaults of this family store what transformers computes, in the engine's layout: the
/// zero-centred RMSNorm weights `w` (input, post-attention, q/k and final norms) as
/// `1 + w` in f32 (the sum transformers forms before it multiplies); the query and
/// output-gate halves of `q_proj` as `q_proj` and `output_gate`; the DeltaNet input
/// projections as one `in_proj` with rows `[q | k | v | z | b | a]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HybridConfig {
    /// The mixer of every decoder layer.
    pub layer_types: Vec<LayerType>,
    /// Query/key heads of a DeltaNet layer.
    pub linear_num_key_heads: usize,
    /// Value heads of a DeltaNet layer (a multiple of the key heads).
    pub linear_num_value_heads: usize,
    /// Width of one DeltaNet query/key head.
    pub linear_key_head_dim: usize,
    /// Width of one DeltaNet value head.
    pub linear_value_head_dim: usize,
    /// Taps of the causal depthwise convolution.
    pub linear_conv_kernel_dim: usize,
    /// Fraction of each attention head that RoPE rotates.
    pub partial_rotary_factor: f64,
    /// Multimodal RoPE sections (temporal, height, width) in rotary frequency pairs;
    /// empty when the model has none. Text positions are equal in all three, so every
    /// layout of the sections gives the plain table.
    pub mrope_section: Vec<usize>,
    /// Whether the sections interleave (Qwen3.5) rather than follow each other.
    pub mrope_interleaved: bool,
    /// Intermediate width of the shared expert (0: none).
    pub shared_expert_intermediate_size: usize,
}

impl HybridConfig {
    /// Width of the DeltaNet queries (and keys) of all heads.
    pub fn key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }

    /// Width of the DeltaNet values of all heads.
    pub fn value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// Channels of the causal convolution (`q | k | v`).
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Rows of the fused DeltaNet input projection (`q | k | v | z | b | a`).
    pub fn in_proj_dim(&self) -> usize {
        self.conv_dim() + self.value_dim() + 2 * self.linear_num_value_heads
    }

    /// Floats of one DeltaNet layer's conv state (the last `kernel - 1` inputs).
    pub fn conv_state_len(&self) -> usize {
        self.linear_conv_kernel_dim.saturating_sub(1) * self.conv_dim()
    }

    /// Floats of one DeltaNet layer's recurrent state (`[value head][key dim][value dim]`).
    pub fn recurrent_state_len(&self) -> usize {
        self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
    }

    /// Rotated width of an attention head of `head_dim` (transformers truncates).
    pub fn rotary_dim(&self, head_dim: usize) -> usize {
        (head_dim as f64 * self.partial_rotary_factor) as usize
    }

    /// Checks the hybrid shape against a model of `layers` layers with attention heads
    /// of `head_dim`.
    fn validate(&self, layers: usize, head_dim: usize) -> Result<(), String> {
        if self.layer_types.len() != layers {
            return Err(format!(
                "`layer_types` has {} entries but the model has {layers} layers",
                self.layer_types.len()
            ));
        }
        let positive = [
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("`{name}` must be positive"));
            }
            if v > 1 << 16 {
                return Err(format!("`{name}` ({v}) must be at most 65536"));
            }
        }
        if !self.linear_num_value_heads.is_multiple_of(self.linear_num_key_heads) {
            return Err(format!(
                "`linear_num_value_heads` ({}) must be a multiple of `linear_num_key_heads` ({})",
                self.linear_num_value_heads, self.linear_num_key_heads
            ));
        }
        let f = self.partial_rotary_factor;
        if !(f > 0.0 && f <= 1.0) {
            return Err(format!("`partial_rotary_factor` ({f}) must be in (0, 1]"));
        }
        let rotary = self.rotary_dim(head_dim);
        if rotary == 0 || !rotary.is_multiple_of(2) {
            return Err(format!(
                "`partial_rotary_factor` ({f}) of `head_dim` {head_dim} gives {rotary} rotated dims; it must be even and positive"
            ));
        }
        let pairs: usize = self.mrope_section.iter().sum();
        if !self.mrope_section.is_empty() && pairs != rotary / 2 {
            return Err(format!(
                "`mrope_section` {:?} covers {pairs} frequency pairs but RoPE rotates {} ({rotary} dims)",
                self.mrope_section,
                rotary / 2
            ));
        }
        Ok(())
    }
}

impl ModelConfig {
    /// Experts routed per token, kept within 1..=num_experts (validation already demands
    /// it of MoE models; dense configs carry whatever their file says).
    pub fn experts_per_token(&self) -> usize {
        self.num_experts_per_tok.clamp(1, self.num_experts.max(1))
    }

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

    /// The mixer of decoder layer `layer` (full attention for Qwen3-MoE).
    pub fn layer_type(&self, layer: usize) -> LayerType {
        match &self.hybrid {
            Some(h) => h.layer_types.get(layer).copied().unwrap_or(LayerType::FullAttention),
            None => LayerType::FullAttention,
        }
    }

    /// Indices of the full-attention layers (the ones with a KV cache), in order.
    pub fn attention_layers(&self) -> Vec<usize> {
        (0..self.num_hidden_layers).filter(|&l| self.layer_type(l) == LayerType::FullAttention).collect()
    }

    /// Width RoPE rotates in each attention head.
    pub fn rotary_dim(&self) -> usize {
        self.hybrid.as_ref().map_or(self.head_dim, |h| h.rotary_dim(self.head_dim))
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
        match &self.hybrid {
            Some(h) => h.validate(self.num_hidden_layers, self.head_dim),
            None => Ok(()),
        }
    }
}
