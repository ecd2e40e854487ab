// ggml block formats for matmul.comp: the weight binding holds rows of blocks exactly as
// ggml-common.h lays them out (little-endian, bytes unchanged from a GGUF), and a chunk of
// CHUNK = 8 consecutive elements is dequantised from its block as ggml's
// dequantize_row_* does, with the same f32 operations in the same order and every one of
// them `precise` — so each weight is bitwise actors/src/cpu/quant.rs's. Q8_0 and Q4_0
// products and every embedding lookup (EMBED) use these chunks; Q4_K, Q5_K and Q6_K
// products multiply a slice at a time instead (slice_dot.glsl), with the scale products
// and integer-to-float steps defined here. Define exactly one of Q8_0, Q4_0, Q4_K, Q5_K,
// Q6_K before including.
//
// Weight units are bytes (UNIT_BYTES = 1): a row starts ROW_UNITS = (cols / QK) * QB bytes
// after the previous one, and pc.w_off, pc.w2_off and the expert table's offsets are
// byte offsets of row 0.
// Rows are whole blocks (cols % QK == 0), so a row has no tail and a chunk never
// straddles a block. The binding is read in 32-bit words: the row-0 offsets must be
// multiples of 4 (vault parts are 64-byte aligned, bound ranges start aligned); blocks
// of 34, 18 or 210 bytes then start on even bytes, read by WORD16.
//
// A chunk is loaded as a uvec4 (LOAD_W / LOAD_U; integer work only) and dequantised by
// unpack (the float work):
//   x   the block's f16 scale bits (K4 family: d | dmin << 16)
//   y,z the 8 quants, one byte each (element q in byte q % 4 of y for q < 4, else z)
//   w   the sub-block's scale (Q6_K: its i8 byte; K4 family: sc | m << 8)
// Two arithmetic families:
//   BIAS (Q8_0, Q4_0, Q6_K): y = ds * float(q - BIAS), ds = d, or d * sc for Q6_K
//        (Q8_0 stores its i8 quants offset by 128, which is the same integer);
//   K4   (Q4_K, Q5_K):       y = (d * sc) * float(q) - dmin * m.

#define CHUNK 8u
#define FOR_Q(B) FOR8(q, B)
#define WVEC uvec4
#define QUANT
#define UNIT_BYTES 1u
layout(set = 0, binding = 0) readonly buffer W { uint w[]; };
#ifdef GATE_UP
layout(set = 0, binding = 1) readonly buffer U { uint u[]; };
#endif

// The 32 bits at even byte offset o of word buffer B (no read past the word holding the
// last of them).
uint word16_pick(uint lo, uint hi, uint o) {
    return (o & 2u) != 0u ? (lo >> 16) | (hi << 16) : lo;
}
#define WORD16(B, o) word16_pick(B[(o) >> 2], B[((o) >> 2) + (((o) >> 1) & 1u)], (o))

// Byte k of a chunk's quants.
#define QBYTE(c, k) ((((k) < 4u ? (c).y : (c).z) >> (8u * ((k) % 4u))) & 0xFFu)

#if defined(Q8_0)
// block_q8_0: d (f16), qs[32] (i8); y = q * d.
#define QK 32u
#define QB 34u
#define BIAS 128
#define LOAD_BODY(B)                                                                      \
    uint blk = row + (e / QK) * QB;                                                       \
    uint o = blk + 2u + e % QK;                                                           \
    return uvec4(WORD16(B, blk) & 0xFFFFu, WORD16(B, o) ^ 0x80808080u,                    \
                 WORD16(B, o + 4u) ^ 0x80808080u, 0u);
#elif defined(Q4_0)
// block_q4_0: d (f16), qs[16]; element j < 16 is the low nibble of qs[j], element
// j + 16 the high nibble; y = (q - 8) * d.
#define QK 32u
#define QB 18u
#define BIAS 8
#define LOAD_BODY(B)                                                                      \
    uint blk = row + (e / QK) * QB;                                                       \
    uint o = blk + 2u + e % 16u;                                                          \
    uint sh = (e % QK) / 16u * 4u;                                                        \
    return uvec4(WORD16(B, blk) & 0xFFFFu, (WORD16(B, o) >> sh) & 0x0F0F0F0Fu,            \
                 (WORD16(B, o + 4u) >> sh) & 0x0F0F0F0Fu, 0u);
#elif defined(Q6_K)
// block_q6_K: ql[128], qh[64], scales[16] (i8), d (f16). Half n = i / 128 of the block
// has four 32-element groups k; element l of group k is the low (k < 2) or high nibble
// of ql[64n + 32(k & 1) + l] with bits 2k, 2k + 1 of qh[32n + l] above it, minus 32;
// its scale is scales[8n + 2k + l / 16]; y = (d * sc) * (q - 32). With Q6_PADDED
// (`matvec_q6_k_padded`) every block is followed by 14 zero bytes: 224-byte blocks, which
// start on 16-byte boundaries, so slice_dot.glsl reads them by whole vectors
// (actors/src/vulkan/buffers.rs, `Q6K_PADDED_BLOCK`).
#define QK 256u
#ifdef Q6_PADDED
#define QB 224u
#else
#define QB 210u
#endif
#define BIAS 32
#define SUB_SCALE
#define LOAD_BODY(B)                                                                      \
    uint blk = row + (e / QK) * QB;                                                       \
    uint i = e % QK;                                                                      \
    uint n = i / 128u, k = (i % 128u) / 32u, l = i % 32u;                                 \
    uint ql = blk + 64u * n + 32u * (k & 1u) + l;                                         \
    uint qh = blk + 128u + 32u * n + l;                                                   \
    uint ls = (k / 2u) * 4u, hs = 2u * k;                                                 \
    uint so = blk + 192u + 8u * n + 2u * k + l / 16u;                                     \
    return uvec4(WORD16(B, blk + 208u) & 0xFFFFu,                                         \
                 ((WORD16(B, ql) >> ls) & 0x0F0F0F0Fu) | (((WORD16(B, qh) >> hs) & 0x03030303u) << 4), \
                 ((WORD16(B, ql + 4u) >> ls) & 0x0F0F0F0Fu) |                             \
                     (((WORD16(B, qh + 4u) >> hs) & 0x03030303u) << 4),                   \
                 (WORD16(B, so & ~1u) >> (8u * (so & 1u))) & 0xFFu);
#elif defined(Q4_K) || defined(Q5_K)
// block_q4_K: d, dmin (f16), scales[12] (eight 6-bit scale/min pairs, ggml's
// get_scale_min_k4), qs[128]; block_q5_K adds qh[32] before qs. Sub-block j = i / 32
// (i the element in the block) reads the low (j even) or high (j odd) nibbles of
// qs[32 (j / 2) + l], l = i % 32, and Q5_K adds 16 where bit j of qh[l] is set;
// y = (d * sc_j) * q - dmin * m_j. Blocks are multiples of 4 bytes: aligned reads.
#define QK 256u
#define K4
#ifdef Q5_K
#define QB 176u
#define QS_AT 48u
#define HIGH_BIT(B, o, j) (((B[(o) >> 2] >> (j)) & 0x01010101u) << 4)
#else
#define QB 144u
#define QS_AT 16u
#define HIGH_BIT(B, o, j) 0u
#endif
// ggml's get_scale_min_k4 of sub-block j from a block's scale words y, z, w (its bytes
// 4..15): sc | m << 8.
uint k4_scale_min(uint y, uint z, uint w, uint j) {
    uint bs = 8u * (j & 3u);
    uint a = (y >> bs) & 0xFFu;
    uint b = (z >> bs) & 0xFFu;
    uint c = (w >> bs) & 0xFFu;
    uint sc = j < 4u ? a & 63u : (c & 0x0Fu) | ((a >> 6) << 4);
    uint m = j < 4u ? b & 63u : (c >> 4) | ((b >> 6) << 4);
    return sc | (m << 8);
}
#define LOAD_BODY(B)                                                                      \
    uint blk = row + (e / QK) * QB;                                                       \
    uint i = e % QK;                                                                      \
    uint j = i / 32u, l = i % 32u;                                                        \
    uint o = blk + QS_AT + 32u * (j / 2u) + l;                                            \
    uint sh = 4u * (j & 1u);                                                              \
    return uvec4(B[blk >> 2], ((B[o >> 2] >> sh) & 0x0F0F0F0Fu) | HIGH_BIT(B, blk + 16u + l, j), \
                 ((B[(o >> 2) + 1u] >> sh) & 0x0F0F0F0Fu) | HIGH_BIT(B, blk + 20u + l, j),   \
                 k4_scale_min(B[(blk >> 2) + 1u], B[(blk >> 2) + 2u], B[(blk >> 2) + 3u], j));
#else
#error quant.glsl needs one of Q8_0, Q4_0, Q4_K, Q5_K, Q6_K
#endif

// Bytes between consecutive rows of pc.cols elements.
#define ROW_UNITS (pc.cols / QK * QB)

// The raw chunk of elements e .. e + 7 of the row starting at byte `row`.
uvec4 load_w(uint row, uint e) { LOAD_BODY(w) }
#define LOAD_W(row, e) load_w(row, e)
#ifdef GATE_UP
uvec4 load_u(uint row, uint e) { LOAD_BODY(u) }
#define LOAD_U(row, e) load_u(row, e)
#endif

// float(q - bias) for a small integer q >= 0 without an int-to-float conversion (a
// quarter-rate instruction or slower on NVIDIA GPUs): the bits of 2^23 + q, minus
// 2^23 + bias. Both operands and the difference are integers below 2^24, so the result
// is exact: the bits of float(q - bias).
#define QFLOAT(q, bias) (uintBitsToFloat(0x4B000000u | (q)) - (8388608.0 + float(bias)))

#ifdef K4
// (d·sc, dmin·m) of a sub-block, as dequantize_row_q4_K forms them, from its block's d
// and dmin and k4_scale_min's sc | m << 8.
vec2 k4_products(float d, float dmin, uint sm) {
    precise float ds = d * QFLOAT(sm & 0xFFu, 0);
    precise float dm = dmin * QFLOAT(sm >> 8, 0);
    return vec2(ds, dm);
}
#endif

// The 8 weights of a loaded chunk, as ggml computes them.
void unpack(uvec4 c, out float v[CHUNK]) {
#ifdef K4
    vec2 p = k4_products(f16_to_f32(c.x & 0xFFFFu), f16_to_f32(c.x >> 16), c.w);
    float ds = p.x;
    float dm = p.y;
#define DEQ                                                                               \
    precise float y = ds * QFLOAT(QBYTE(c, q), 0) - dm;                                   \
    v[q] = y;
#else
#ifdef SUB_SCALE
    precise float ds = f16_to_f32(c.x) * QFLOAT(c.w ^ 0x80u, 128); // the i8 scale
#else
    float ds = f16_to_f32(c.x);
#endif
#define DEQ                                                                               \
    precise float y = ds * QFLOAT(QBYTE(c, q), BIAS);                                     \
    v[q] = y;
#endif
    FOR_Q(DEQ)
}
