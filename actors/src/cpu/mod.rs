//! CPU backend pieces: ggml block formats (exact dequantisation and fused dot products).

pub mod quant;
