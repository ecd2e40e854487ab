//! CPU backend pieces: ggml block formats — exact dequantisation and fused dot products
//! (`quant`), and quantisation of f32 rows (`quantize`).

pub mod quant;
pub mod quantize;
