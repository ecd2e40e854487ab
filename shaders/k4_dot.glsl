// The dot products of matmul.comp for the K4 block family (Q4_K, Q5_K), included by it
// after quant.glsl: ggml's factored form y = (d·sc)·q − (dmin·m) summed a sub-block half
// at a time, so a lane decodes a block's scales once per 32 weights, loads them 16 bytes
// at a time and spends one fused multiply-add per weight (quant.glsl's chunks of 8 cost
// six loads, two f16 widenings, the scale decode and three float operations per weight,
// about 11% of the H200's HBM bandwidth at m=1).
//
// A row of QK = 256-element blocks is cut into slices of 32 weights: slice s is the 16
// quant bytes qs[16t .. 16t + 15] of block s / 8 (t = s % 8). Their low nibbles are the
// 16 elements 64(t / 2) + 16(t % 2) + 0..15 of the block (sub-block jl = 2(t / 2)), their
// high nibbles the 16 elements 32 further (sub-block jl + 1); Q5_K adds 16 where bit jl
// (jl + 1) of qh[16(t % 2) + n] is set. Lane l takes slices l, l + LANES, ...; for each
// slice, the low half and then the high half, and each token:
//   S   = q_0·x_0 + ... + q_15·x_15   one fma each, in order, from 0
//   X   = x_0 + ... + x_15            in order, from 0
//   acc = acc + ((d·sc)·S − (dmin·m)·X)
// with d·sc and dmin·m as ggml forms them (quant.glsl's k4_products). This is the
// summation order of the K4 kernels (common.glsl describes the other types'); it does not
// depend on the number of tokens, rows per lane group or unroll, so the m=1 and batched
// kernels give the same bytes. With one input 1 and the rest 0 a result is
// (d·sc)·q − dmin·m exactly, the weight itself, as the CPU computes it.

layout(set = 0, binding = 0) readonly buffer W4 { uvec4 w4[]; };
#ifdef GATE_UP
layout(set = 0, binding = 1) readonly buffer U4 { uvec4 u4[]; };
#endif

// The 16 bytes at byte offset o (a multiple of 4) of B: one vector load where every
// offset of the dispatch is a multiple of 16 (`vec`), else four word loads.
#define LD16(B, B4, o, vec)                                                               \
    ((vec) ? B4[(o) >> 4] : uvec4(B[(o) >> 2], B[((o) >> 2) + 1u], B[((o) >> 2) + 2u],    \
                                  B[((o) >> 2) + 3u]))

#ifdef Q5_K
#define K5(code) code
// Bit j of each qh byte of word x, as 16 above the nibble.
#define HIGH5(x, j) ((((x) >> (j)) & 0x01010101u) << 4)
#else
#define K5(code)
#define HIGH5(x, j) 0u
#endif

// (d·sc_jl, dmin·m_jl, d·sc_jl+1, dmin·m_jl+1) of a block from its first 16 bytes h.
vec4 k4_scales(uvec4 h, uint jl) {
    float d = f16_to_f32(h.x & 0xFFFFu);
    float dmin = f16_to_f32(h.x >> 16);
    return vec4(k4_products(d, dmin, k4_scale_min(h.y, h.z, h.w, jl)),
                k4_products(d, dmin, k4_scale_min(h.y, h.z, h.w, jl + 1u)));
}

// The 16 quants of half hf (0: low nibbles, sub-block j; 1: high nibbles, sub-block j)
// of a slice's quant words q (Q5_K: and its qh words h), as exact floats.
void k4_quants(uvec4 q, uvec4 h, uint j, uint hf, out float v[16]) {
#define K4_WORD                                                                           \
    {                                                                                     \
        uint n4 = ((q[wd] >> (4u * hf)) & 0x0F0F0F0Fu) | HIGH5(h[wd], j);                 \
        FOR4(b, precise float f = QFLOAT((n4 >> (8u * b)) & 0xFFu, 0); v[4u * wd + b] = f;) \
    }
    FOR4(wd, K4_WORD)
}

// The slice loop of matmul.comp's main (its wo, uo, wrow, xb, xvec and acc).
#define K4_DOT                                                                            \
    bool vec16 = wo % 16u == 0u && uo % 16u == 0u;                                        \
    for (uint s = lane; s < pc.cols / 32u; s += LANES) {                                  \
        uint t = s % 8u;                                                                  \
        uint boff = (s / 8u) * QB;                                                        \
        uint e0 = (s / 8u) * QK + 64u * (t / 2u) + 16u * (t % 2u);                        \
        uint jl = 2u * (t / 2u);                                                          \
        uvec4 qw[MAX_RPT * NACC];                                                         \
        uvec4 hq[MAX_RPT * NACC];                                                         \
        vec4 sc4[MAX_RPT * NACC];                                                         \
        FOR_R(K4_LOAD)                                                                    \
        FOR2(hf, K4_HALF)                                                                 \
    }
// Row r's block header, quants (and Q5_K's high bits) of the slice, and its scales, from
// matrix B (row 0 at byte `base`) into entry a.
#define K4_LOAD_M(B, B4, base, a)                                                         \
    {                                                                                     \
        uint blk = (base) + wrow[r] + boff;                                               \
        qw[a] = LD16(B, B4, blk + QS_AT + 16u * t, vec16);                                \
        K5(hq[a] = LD16(B, B4, blk + 16u + 16u * (t % 2u), vec16);)                       \
        sc4[a] = k4_scales(LD16(B, B4, blk, vec16), jl);                                  \
    }
#define K4_LOAD                                                                           \
    if (r < RPT) {                                                                        \
        K4_LOAD_M(w, w4, wo, r * NACC)                                                    \
        GU(K4_LOAD_M(u, u4, uo, r * NACC + 1u))                                           \
    }
// One half of the slice: its quants as floats, then every token.
#define K4_HALF                                                                           \
    {                                                                                     \
        float qf[MAX_RPT * NACC][16];                                                     \
        FOR_R(FOR_K(K4_QUANTS))                                                           \
        uint e = e0 + 32u * hf;                                                           \
        FOR_I(K4_TOKEN)                                                                   \
    }
#define K4_QUANTS                                                                         \
    if (r < RPT) {                                                                        \
        k4_quants(qw[r * NACC + k], hq[r * NACC + k], jl + hf, hf, qf[r * NACC + k]);     \
    }
// Token i's 16 inputs of the half, their sum X, then S and the term of every row.
#define K4_TOKEN                                                                          \
    vec4 xq[4];                                                                           \
    if (xvec) {                                                                           \
        FOR4(c, xq[c] = act4[((xb[i] + e) >> 2) + c];)                                    \
    } else {                                                                              \
        FOR4(c, FOR4(b, xq[c][b] = ACT(xb[i] + e + 4u * c + b);))                         \
    }                                                                                     \
    precise float xs = 0.0;                                                               \
    FOR4(c, FOR4(b, xs = xs + xq[c][b];))                                                 \
    FOR_R(FOR_K(K4_TERM))
#define K4_TERM                                                                           \
    if (r < RPT) {                                                                        \
        precise float sdot = 0.0;                                                         \
        FOR4(c, FOR4(b, sdot = fma(qf[r * NACC + k][4u * c + b], xq[c][b], sdot);))       \
        precise float term = sc4[r * NACC + k][2u * hf] * sdot - sc4[r * NACC + k][2u * hf + 1u] * xs; \
        acc[ACC(k, r, i)] = acc[ACC(k, r, i)] + term;                                     \
    }
