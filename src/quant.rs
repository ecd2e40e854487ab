//! The quantisation schemes of `convert --quant` and `synth --quant`: which ggml block
//! format each routed expert matrix, and each resident weight matrix, is stored in. The
//! experts are what is streamed from disk; the resident matrices (embeddings, attention,
//! LM head) are what must stay in memory, so a smaller format pays off for both
//! (`--keep-resident` stores the resident ones as `--dtype`).
//!
//! `q4_k_m` and `q5_k_m` follow llama.cpp's `llama_tensor_get_type` (`llama-quant.cpp`)
//! for expert tensors without an importance matrix: `gate_proj`/`up_proj` in Q4_K (Q5_K),
//! `down_proj` in Q6_K on the layers that get more bits — the first and last eighth of
//! the layers and every third layer between them — and in Q4_K (Q5_K) on the others. So a
//! Q4_K_M vault mixes per layer, as Q4_K_M GGUF files do.
//!
//! Resident matrices follow the same function: the token embeddings and the attention
//! `q`/`k`/`o` projections in the scheme's base type, `v_proj` and a dense layer's
//! `down_proj` in Q6_K on the layers that get more bits (K-quant mixes), the LM head in
//! Q6_K (Q8_0 under `q8_0`; a tied embedding counts as the LM head), router gates and norms
//! unquantised (llama.cpp never quantises `ffn_gate_inp`).
//!
//! A matrix whose rows are not a whole number of the chosen format's blocks falls back,
//! as llama.cpp does, to a format that fits: K-quants (256-element blocks) to Q8_0 — where
//! llama.cpp would take Q5_0/Q5_1 for Q4_K/Q5_K, formats without a kernel here — and
//! anything that still does not fit (rows not a multiple of 32) to f16.

use smoe_proto::DType;

/// How the routed experts are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Quant {
    /// Every expert matrix Q8_0 (8.5 bits per weight).
    #[value(name = "q8_0")]
    Q8_0,
    /// Every expert matrix Q4_0 (4.5 bits per weight).
    #[value(name = "q4_0")]
    Q4_0,
    /// llama.cpp's Q4_K_M for experts: gate/up Q4_K, down Q6_K or Q4_K by layer.
    #[value(name = "q4_k_m")]
    Q4KM,
    /// llama.cpp's Q5_K_M for experts: gate/up Q5_K, down Q6_K or Q5_K by layer.
    #[value(name = "q5_k_m")]
    Q5KM,
    /// Every expert matrix Q6_K (6.5625 bits per weight).
    #[value(name = "q6_k")]
    Q6K,
}

/// Whether llama.cpp gives layer `layer` of `layers` more bits (its `use_more_bits`).
fn more_bits(layer: usize, layers: usize) -> bool {
    let (l, n) = (layer as i64, layers as i64);
    l < n / 8 || l >= 7 * n / 8 || (l - n / 8) % 3 == 2
}

/// `ty` if a row of `cols` elements is whole blocks of it, else the fallback (see the
/// module docs).
fn fit(ty: DType, cols: usize) -> DType {
    let fallback = if ty.block_elems() == 256 { DType::Q8_0 } else { DType::F16 };
    match (ty.row_bytes(cols), fallback.row_bytes(cols)) {
        (Some(_), _) => ty,
        (None, Some(_)) => fallback,
        (None, None) => DType::F16,
    }
}

impl Quant {
    /// The type every matrix gets unless a rule gives it more bits.
    fn base(self) -> DType {
        match self {
            Quant::Q8_0 => DType::Q8_0,
            Quant::Q4_0 => DType::Q4_0,
            Quant::Q4KM => DType::Q4K,
            Quant::Q5KM => DType::Q5K,
            Quant::Q6K => DType::Q6K,
        }
    }

    /// The type of a matrix that gets more bits on `layer` of `layers` (`down_proj`,
    /// `v_proj`): Q6_K there under the K-quant mixes, else the base type.
    fn layered(self, layer: usize, layers: usize) -> DType {
        match self {
            Quant::Q4KM | Quant::Q5KM if more_bits(layer, layers) => DType::Q6K,
            _ => self.base(),
        }
    }

    /// The type of resident tensor `name` (HuggingFace name, `shape` rows × cols) of a
    /// model of `layers` decoder layers whose LM head is `tied` to the embeddings; `None`
    /// for tensors the scheme leaves alone (vectors, router gates, names it does not know).
    pub fn resident_type(self, name: &str, shape: &[usize], layers: usize, tied: bool) -> Option<DType> {
        let &[_, cols] = shape else { return None };
        let layer = || {
            let rest = name.strip_prefix("model.layers.")?;
            rest[..rest.find('.')?].parse::<usize>().ok()
        };
        let head = if self == Quant::Q8_0 { DType::Q8_0 } else { DType::Q6K };
        let ty = match name {
            "lm_head.weight" => head,
            "model.embed_tokens.weight" if tied => head,
            "model.embed_tokens.weight" => self.base(),
            _ if name.ends_with(".mlp.gate.weight") => return None,
            _ if name.ends_with("v_proj.weight") || name.ends_with("down_proj.weight") => {
                self.layered(layer()?, layers)
            }
            _ if ["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj"]
                .iter()
                .any(|p| name.ends_with(&format!(".{p}.weight"))) =>
            {
                self.base()
            }
            _ => return None,
        };
        Some(fit(ty, cols))
    }

    /// The types of `gate_proj`, `up_proj` and `down_proj` of decoder layer `layer` of
    /// `layers`, for experts of `hidden` × `inter` (gate/up rows hold `hidden` elements,
    /// down rows `inter`).
    pub fn expert_types(self, layer: usize, layers: usize, hidden: usize, inter: usize) -> [DType; 3] {
        let gate_up = fit(self.base(), hidden);
        [gate_up, gate_up, fit(self.layered(layer, layers), inter)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_bits_matches_llama_cpp_for_48_layers() {
        // use_more_bits(i, 48): i < 6, i >= 42, or (i - 6) % 3 == 2.
        let more: Vec<usize> = (0..48).filter(|&l| more_bits(l, 48)).collect();
        let mut want: Vec<usize> = (0..6).chain(42..48).collect();
        want.extend((6..42).filter(|l| (l - 6) % 3 == 2));
        want.sort_unstable();
        assert_eq!(more, want);
        assert_eq!((0..4).filter(|&l| more_bits(l, 4)).collect::<Vec<_>>(), [2, 3]);
    }

    #[test]
    fn k_quant_mixes_fall_back_where_rows_are_not_whole_blocks() {
        use DType::*;
        assert_eq!(Quant::Q4KM.expert_types(0, 48, 2048, 768), [Q4K, Q4K, Q6K]);
        assert_eq!(Quant::Q4KM.expert_types(7, 48, 2048, 768), [Q4K, Q4K, Q4K]);
        assert_eq!(Quant::Q5KM.expert_types(8, 48, 2048, 768), [Q5K, Q5K, Q6K]);
        assert_eq!(Quant::Q6K.expert_types(8, 48, 2048, 768), [Q6K, Q6K, Q6K]);
        // The tiny preset's 64 × 32 experts take no 256-element blocks.
        assert_eq!(Quant::Q4KM.expert_types(3, 4, 64, 32), [Q8_0, Q8_0, Q8_0]);
        assert_eq!(Quant::Q4_0.expert_types(0, 4, 64, 48), [Q4_0, Q4_0, F16]);
        assert_eq!(Quant::Q6K.expert_types(0, 4, 64, 20), [Q8_0, Q8_0, F16]);
    }

    #[test]
    fn resident_matrices_follow_llama_cpp_q4_k_m() {
        use DType::*;
        let t = |name: &str, shape: &[usize]| Quant::Q4KM.resident_type(name, shape, 48, false);
        assert_eq!(t("model.embed_tokens.weight", &[151936, 2048]), Some(Q4K));
        assert_eq!(t("lm_head.weight", &[151936, 2048]), Some(Q6K));
        assert_eq!(t("model.layers.0.self_attn.v_proj.weight", &[512, 2048]), Some(Q6K));
        assert_eq!(t("model.layers.7.self_attn.v_proj.weight", &[512, 2048]), Some(Q4K));
        assert_eq!(t("model.layers.7.self_attn.q_proj.weight", &[4096, 2048]), Some(Q4K));
        assert_eq!(t("model.layers.7.self_attn.o_proj.weight", &[2048, 4096]), Some(Q4K));
        assert_eq!(t("model.layers.0.mlp.down_proj.weight", &[2048, 6144]), Some(Q6K));
        assert_eq!(t("model.layers.0.mlp.gate.weight", &[128, 2048]), None);
        assert_eq!(t("model.layers.0.input_layernorm.weight", &[2048]), None);
        assert_eq!(t("model.layers.0.self_attn.q_proj.weight", &[4096, 64]), Some(Q8_0), "K-quant fallback");
        let tied = Quant::Q4KM.resident_type("model.embed_tokens.weight", &[1000, 256], 4, true);
        assert_eq!(tied, Some(Q6K), "a tied embedding is the LM head");
        assert_eq!(Quant::Q8_0.resident_type("lm_head.weight", &[1000, 256], 4, false), Some(Q8_0));
    }
}
