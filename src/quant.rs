//! The quantisation schemes of `convert --quant` and `synth --quant`: which ggml block
//! format each routed expert matrix is stored in. Resident tensors keep `--dtype`; the
//! experts are what is streamed from disk, so they are what a smaller format pays off for.
//!
//! `q4_k_m` and `q5_k_m` follow llama.cpp's `llama_tensor_get_type` (`llama-quant.cpp`)
//! for expert tensors without an importance matrix: `gate_proj`/`up_proj` in Q4_K (Q5_K),
//! `down_proj` in Q6_K on the layers that get more bits — the first and last eighth of
//! the layers and every third layer between them — and in Q4_K (Q5_K) on the others. So a
//! Q4_K_M vault mixes per layer, as Q4_K_M GGUF files do.
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
    /// The types of `gate_proj`, `up_proj` and `down_proj` of decoder layer `layer` of
    /// `layers`, for experts of `hidden` × `inter` (gate/up rows hold `hidden` elements,
    /// down rows `inter`).
    pub fn expert_types(self, layer: usize, layers: usize, hidden: usize, inter: usize) -> [DType; 3] {
        let (gate_up, down) = match self {
            Quant::Q8_0 => (DType::Q8_0, DType::Q8_0),
            Quant::Q4_0 => (DType::Q4_0, DType::Q4_0),
            Quant::Q6K => (DType::Q6K, DType::Q6K),
            Quant::Q4KM => (DType::Q4K, if more_bits(layer, layers) { DType::Q6K } else { DType::Q4K }),
            Quant::Q5KM => (DType::Q5K, if more_bits(layer, layers) { DType::Q6K } else { DType::Q5K }),
        };
        let gate_up = fit(gate_up, hidden);
        [gate_up, gate_up, fit(down, inter)]
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
}
