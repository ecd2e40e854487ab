// The dot products of matmul.comp for the block formats it multiplies a *slice* at a
// time instead of quant.glsl's chunks of 8 (which cost several loads, the block header's
// decode and three float operations per weight: the m=1 kernels ran at 10-17% of the
// H200's HBM bandwidth), included by it after quant.glsl:
//   K4 (Q4_K, Q5_K)  slices of 32 weights, ggml's factored form y = (d·sc)·q − (dmin·m);
//   Q6_K             slices of 32 weights, y = (d·sc)·(q − 32).
// A slice is two groups of 16 weights, each under one scale (and min): group g is
// elements e0 + GROUP_E(g) .. e0 + GROUP_E(g) + 15 of the row. Lane l takes slices l,
// l + LANES, ...; it loads a slice's quant bytes 16 at a time and decodes its block's
// scales once per slice, then for each group g in order and each token:
//   S    = q_0·x_0 + ... + q_15·x_15   one fma each, in order, from 0 (q an exact integer:
//                                      the K4 nibble, or Q6_K's quant minus 32)
//   K4:   X = x_0 + ... + x_15          in order, from 0
//         term = (d·sc)·S − (dmin·m)·X
//   Q6_K: term = (d·sc)·S
//   acc  = acc + term
// with d·sc and dmin·m as ggml forms them (quant.glsl). This is the summation order of
// the slice kernels (common.glsl describes the other types'); it does not depend on the
// number of tokens, rows per lane group or unroll, so the m=1 and batched kernels give
// the same bytes. With one input 1 and the rest 0 a result is ggml's dequantised weight
// exactly, as the CPU computes it.
//
// Each format below defines: SLICE_AT (slice s's block byte offset boff, first element
// e0 and format values), SLICE_LOAD_M (the quant words of the row at weight offset row
// into sq[a][0..1] and its group scales into sf[a]), GROUP_E (group g's first element
// after e0), GROUP_QUANTS (group g's 16 quants as floats) and GROUP_TERM (the term from
// sdot and, for K4, xs).

layout(set = 0, binding = 0) readonly buffer W4 { uvec4 w4[]; };
#ifdef GATE_UP
layout(set = 0, binding = 1) readonly buffer U4 { uvec4 u4[]; };
#endif

// The 16 bytes at byte offset o (a multiple of 4) of B: one vector load where every
// offset of the dispatch is a multiple of 16 (`vec`), else four word loads.
#define LD16(B, B4, o, vec)                                                               \
    ((vec) ? B4[(o) >> 4] : uvec4(B[(o) >> 2], B[((o) >> 2) + 1u], B[((o) >> 2) + 2u],    \
                                  B[((o) >> 2) + 3u]))

// Byte values of a quant word as exact floats: the value v (below m + 1) at bit p of n
// (m << p below 2^23) minus bias, through the bits of 2^(23 − p) + v — v masked in place
// into the mantissa under the exponent 23 − p, so no shift — minus 2^(23 − p) + bias.
// Both are integers below 2^24 and so is their difference: the result is exact, the
// value quant.glsl's QFLOAT gives with a shift per byte. The exponent bits (150 − p) << 23
// come from the push constant two23 (matmul_io.glsl), so that the mask and the exponent
// are one instruction.
float byte_float(uint n, uint p, uint m, float bias) {
    precise float f = uintBitsToFloat((n & (m << p)) | (pc.two23 - (p << 23))) - (float(1u << (23u - p)) + bias);
    return f;
}
// The four values at bits p0, p0 + 8, p0 + 16 and p0 + 24 of word n (each below m + 1,
// p0 < 8), as exact floats minus bias, into v[o .. o + 3]: the upper two from n >> 16.
#define BYTE_FLOATS(n, p0, m, bias, v, o)                                                 \
    {                                                                                     \
        uint n_ = (n);                                                                    \
        uint hi_ = n_ >> 16;                                                              \
        v[(o)] = byte_float(n_, (p0), (m), (bias));                                       \
        v[(o) + 1u] = byte_float(n_, (p0) + 8u, (m), (bias));                             \
        v[(o) + 2u] = byte_float(hi_, (p0), (m), (bias));                                 \
        v[(o) + 3u] = byte_float(hi_, (p0) + 8u, (m), (bias));                            \
    }

#define SLICE_W 32u
#define FOR_G(B) FOR2(g, B) // the slice's two groups

#if defined(K4)
// Group g: the low (0) or high (1) nibbles of the slice's bytes.
#define NEED_XS
#ifdef Q5_K
#define K5(code) code
// Bit j of each qh byte of word x, as 16 above the nibble.
#define HIGH5(x, j) ((((x) >> (j)) & 0x01010101u) << 4)
#else
#define K5(code)
#define HIGH5(x, j) 0u
#endif

// (d·sc_jl, dmin·m_jl, d·sc_jl+1, dmin·m_jl+1) of a block from its first 16 bytes h.
// The m=1 kernels share this work with the twin lane (lane ^ 1, whose slice s ^ 1 lies in
// the same block and needs the same sub-blocks jl, jl + 1; a row's slice count is a
// multiple of 8, so both lanes are active together): this lane (odd = lane & 1) widens d
// (even) or dmin (odd) and forms sub-block jl + odd's products, the twin the others, and
// shuffles exchange them. Each value comes from the same operations as when one lane forms
// them all, so the batched kernels, which amortise the decode over their tokens and
// measured 2-4% slower paired, form them alone and give the same bytes.
vec4 k4_scales(uvec4 h, uint jl, uint odd) {
#if TB == 1
    float mine = f16_to_f32(odd == 0u ? h.x & 0xFFFFu : h.x >> 16);
    float twin = subgroupShuffleXor(mine, 1u);
    float d = odd == 0u ? mine : twin;
    float dmin = odd == 0u ? twin : mine;
    vec2 own = k4_products(d, dmin, k4_scale_min(h.y, h.z, h.w, jl + odd));
    vec2 other = subgroupShuffleXor(own, 1u);
    return odd == 0u ? vec4(own, other) : vec4(other, own);
#else
    float d = f16_to_f32(h.x & 0xFFFFu);
    float dmin = f16_to_f32(h.x >> 16);
    return vec4(k4_products(d, dmin, k4_scale_min(h.y, h.z, h.w, jl)),
                k4_products(d, dmin, k4_scale_min(h.y, h.z, h.w, jl + 1u)));
#endif
}

// The 16 quants of group hf (0: low nibbles, sub-block j; 1: high nibbles, sub-block j)
// of a slice's quant words q (Q5_K: and its qh words h), as exact floats.
void k4_quants(uvec4 q, uvec4 h, uint j, uint hf, out float v[16]) {
#ifdef Q5_K
#define K4_WORD BYTE_FLOATS(((q[wd] >> (4u * hf)) & 0x0F0F0F0Fu) | HIGH5(h[wd], j), 0u, 0x1Fu, 0.0, v, 4u * wd)
#else
#define K4_WORD BYTE_FLOATS(q[wd], 4u * hf, 0xFu, 0.0, v, 4u * wd)
#endif
    FOR4(wd, K4_WORD)
}

// Slice s is the 16 quant bytes qs[16t .. 16t + 15] of block s / 8 (t = s % 8). Their
// low nibbles are the 16 elements 64(t / 2) + 16(t % 2) + 0..15 of the block (sub-block
// jl = 2(t / 2)), their high nibbles the 16 elements 32 further (sub-block jl + 1); Q5_K
// adds 16 where bit jl (jl + 1) of qh[16(t % 2) + n] is set.
#define SLICE_AT                                                                          \
    uint t = s % 8u;                                                                      \
    uint boff = (s / 8u) * QB;                                                            \
    uint e0 = (s / 8u) * QK + 64u * (t / 2u) + 16u * (t % 2u);                            \
    uint jl = 2u * (t / 2u);
#define SLICE_LOAD_M(B, B4, base, row, a)                                                 \
    {                                                                                     \
        uint blk = (base) + (row) + boff;                                               \
        sq[a][0] = LD16(B, B4, blk + QS_AT + 16u * t, vec16);                             \
        K5(sq[a][1] = LD16(B, B4, blk + 16u + 16u * (t % 2u), vec16);)                    \
        sf[a] = k4_scales(LD16(B, B4, blk, vec16), jl, lane & 1u);                        \
    }
#define GROUP_E(g) (32u * (g))
#define GROUP_QUANTS(a, g, qf) k4_quants(sq[a][0], sq[a][1], jl + (g), (g), qf)
#define GROUP_TERM(a, g) sf[a][2u * (g)] * sdot - sf[a][2u * (g) + 1u] * xs

#elif defined(Q6_K)
// Group g: ggml's group gp + 2g (below).
// The 16 bytes at even byte offset o of word buffer B: four words, or where o is 2 past a
// multiple of 4 the halves of five, quant.glsl's word16_pick of each pair (the fifth index
// repeats the fourth otherwise, so no word past the one holding the last byte is read).
uvec4 ld16_pick(uint a0, uint a1, uint a2, uint a3, uint a4, uint o) {
    return uvec4(word16_pick(a0, a1, o), word16_pick(a1, a2, o), word16_pick(a2, a3, o),
                 word16_pick(a3, a4, o));
}
#define LD16E(B, o)                                                                       \
    ld16_pick(B[(o) >> 2], B[((o) >> 2) + 1u], B[((o) >> 2) + 2u], B[((o) >> 2) + 3u],     \
              B[((o) >> 2) + 3u + (((o) >> 1) & 1u)], (o))
// The 8 bytes at even byte offset o of word buffer B, likewise from two or three words.
uvec2 ld8_pick(uint a0, uint a1, uint a2, uint o) {
    return uvec2(word16_pick(a0, a1, o), word16_pick(a1, a2, o));
}
#define LD8E(B, o) ld8_pick(B[(o) >> 2], B[((o) >> 2) + 1u], B[((o) >> 2) + 1u + (((o) >> 1) & 1u)], (o))
// The f16 bits at even byte offset o of word buffer B.
#define LD2E(B, o) ((B[(o) >> 2] >> (8u * ((o) & 2u))) & 0xFFFFu)

// d·sc of the slice's two groups from d's bits and the 8 scale bytes of its block half
// (the groups' i8 scales are bytes b and b + 4 of them), as dequantize_row_q6_K forms
// them; in .x and .y.
vec4 q6_scales(uint dbits, uvec2 sc8, uint b) {
    float d = f16_to_f32(dbits);
    vec4 ds = vec4(0.0);
#define Q6_SCALE                                                                          \
    {                                                                                     \
        uint sb = (sc8[g] >> (8u * b)) & 0xFFu;                                           \
        precise float p = d * QFLOAT(sb ^ 0x80u, 128);                                    \
        ds[g] = p;                                                                        \
    }
    FOR2(g, Q6_SCALE)
    return ds;
}

// The 16 quants minus 32 of ggml's group k (0..3) as exact floats, from its low-nibble
// words l (ql bytes of groups 0 and 2, or 1 and 3) and high-bit words h (qh bytes, bits
// 2k and 2k + 1).
void q6_quants(uvec4 l, uvec4 h, uint k, out float v[16]) {
#define Q6_WORD                                                                           \
    BYTE_FLOATS(((l[wd] >> (4u * (k / 2u))) & 0x0F0F0F0Fu) | (((h[wd] >> (2u * k)) & 0x03030303u) << 4), \
                0u, 0x3Fu, 32.0, v, 4u * wd)
    FOR4(wd, Q6_WORD)
}

// dequantize_row_q6_K's loop takes a block half n at a time; element l of its group k
// (0..3) is element 128n + 32k + l of the block, the low (k < 2) or high nibble of
// ql[64n + 32(k % 2) + l] with bits 2k, 2k + 1 of qh[32n + l] above it, scale
// scales[8n + 2k + l / 16]. Slice s is the 16 ql bytes of lanes l = 16h .. 16h + 15 of
// groups gp and gp + 2 (gp = s % 2, h = (s / 2) % 2, n = (s / 4) % 2, block s / 8): its
// group g (0, 1) is ggml's group gp + 2g, elements e0 + 64g .. e0 + 64g + 15.
#define SLICE_AT                                                                          \
    uint boff = (s / 8u) * QB;                                                            \
    uint hn = (s % 8u) / 4u;                                                              \
    uint h = (s % 4u) / 2u;                                                               \
    uint gp = s % 2u;                                                                     \
    uint e0 = (s / 8u) * QK + 128u * hn + 32u * gp + 16u * h;
#ifdef Q6_PADDED
// 224-byte blocks (quant.glsl): the ql and qh bytes and the scales are whole 16-byte
// vectors, the two halves' scales one vector (this half's in .xy or .zw).
#define SLICE_LOAD_M(B, B4, base, row, a)                                                 \
    {                                                                                     \
        uint blk = (base) + (row) + boff;                                               \
        sq[a][0] = LD16(B, B4, blk + 64u * hn + 32u * gp + 16u * h, vec16);               \
        sq[a][1] = LD16(B, B4, blk + 128u + 32u * hn + 16u * h, vec16);                   \
        uvec4 sc16 = LD16(B, B4, blk + 192u, vec16);                                      \
        sf[a] = q6_scales(B[(blk + 208u) >> 2] & 0xFFFFu, hn == 0u ? sc16.xy : sc16.zw, 2u * gp + h); \
    }
#else
#define SLICE_LOAD_M(B, B4, base, row, a)                                                 \
    {                                                                                     \
        uint blk = (base) + (row) + boff;                                               \
        sq[a][0] = LD16E(B, blk + 64u * hn + 32u * gp + 16u * h);                         \
        sq[a][1] = LD16E(B, blk + 128u + 32u * hn + 16u * h);                             \
        sf[a] = q6_scales(LD2E(B, blk + 208u), LD8E(B, blk + 192u + 8u * hn), 2u * gp + h); \
    }
#endif
#define GROUP_E(g) (64u * (g))
#define GROUP_QUANTS(a, g, qf) q6_quants(sq[a][0], sq[a][1], gp + 2u * (g), qf)
#define GROUP_TERM(a, g) sf[a][g] * sdot
#else
#error slice_dot.glsl needs Q4_K, Q5_K or Q6_K
#endif

#ifdef NEED_XS
#define XS(code) code
#else
#define XS(code)
#endif

// The slice loop of matmul.comp's main (its wo, uo, wrow, xb, acc and XV).
#define SLICE_DOT                                                                         \
    bool vec16 = wo % 16u == 0u && uo % 16u == 0u;                                        \
    for (uint s = lane; s < pc.cols / SLICE_W; s += LANES) {                              \
        SLICE_AT                                                                          \
        uvec4 sq[MAX_RPT * NACC][2];                                                      \
        vec4 sf[MAX_RPT * NACC];                                                          \
        FOR_R(SLICE_LOAD)                                                                 \
        FOR_G(SLICE_GROUP)                                                                \
    }
#define SLICE_LOAD                                                                        \
    if (r < RPT) {                                                                        \
        SLICE_LOAD_M(w, w4, wo, wrow[r], r * NACC)                                        \
        GU(SLICE_LOAD_M(u, u4, uo, wrow[r], r * NACC + 1u))                               \
    }
// One group of the slice: its quants as floats, then every token.
#define SLICE_GROUP                                                                       \
    {                                                                                     \
        float qf[MAX_RPT * NACC][16];                                                     \
        FOR_R(FOR_K(SLICE_QUANTS))                                                        \
        uint e = e0 + GROUP_E(g);                                                         \
        FOR_I(SLICE_TOKEN)                                                                \
    }
#define SLICE_QUANTS                                                                      \
    if (r < RPT) {                                                                        \
        GROUP_QUANTS(r * NACC + k, g, qf[r * NACC + k]);                                  \
    }
// A group's 16 inputs from act offset `at` into xq[0..3] (vec4 loads where aligned, XV).
#define GROUP_INPUTS(at, xq)                                                              \
    if (XV) {                                                                             \
        FOR4(c, xq[c] = XIN4(((at) >> 2) + c);)                                           \
    } else {                                                                              \
        FOR4(c, FOR4(b, xq[c][b] = XIN((at) + 4u * c + b);))                              \
    }
// K4: X = x_0 + ... + x_15 of inputs xq, in order, from 0, as `precise float xs`.
#define GROUP_XSUM(xq, xs) XS(precise float xs = 0.0; FOR4(c, FOR4(b, xs = xs + xq[c][b];)))
// S = q_0·x_0 + ... + q_15·x_15 of quants qf and inputs xq, one fma each, in order, from
// 0, as `precise float sdot`.
#define GROUP_DOT(qf, xq, sdot)                                                           \
    precise float sdot = 0.0;                                                             \
    FOR4(c, FOR4(b, sdot = fma(qf[4u * c + b], xq[c][b], sdot);))
// Token i's 16 inputs of the group (K4: and their sum X), then S and the term of every
// row.
#define SLICE_TOKEN                                                                       \
    vec4 xq[4];                                                                           \
    GROUP_INPUTS(xb[i] + e, xq)                                                           \
    GROUP_XSUM(xq, xs)                                                                    \
    FOR_R(FOR_K(SLICE_TERM))
#define SLICE_TERM                                                                        \
    if (r < RPT) {                                                                        \
        GROUP_DOT(qf[r * NACC + k], xq, sdot)                                             \
        precise float term = GROUP_TERM(r * NACC + k, g);                                 \
        acc[ACC(k, r, i)] = acc[ACC(k, r, i)] + term;                                     \
    }
