#version 450
// Causal GQA attention in one canonical "split softmax" form, so that a row's bytes do not
// depend on how many tokens a dispatch covers. Row = (query head h, token t) at position
// start + t; it attends to the n = start + t + 1 cached positions, cut into chunks of CH
// positions aligned to absolute positions (chunk c: positions c·CH ..< min(c·CH + CH, n)).
//
//   s_j   = (Σ_d q[d]·k_j[d], d = 0, 1, ... in order) · scale
//   chunk c:  m_c = max_j s_j,  p_j = exp(s_j − m_c),  l_c = Σ_j p_j,  o_c = Σ_j p_j·v_j
//             (j in order)
//   merged in chunk order: (M, L, acc) = (m_0, l_0, o_0); for c ≥ 1: M' = max(M, m_c),
//             a = exp(M − M'), b = exp(m_c − M'), L = L·a + l_c·b, acc = acc·a + o_c·b
//   out   = acc · (1 / L)
//
// Every float operation is `precise` (NoContraction). Three modules:
// - `attention` (fused, layer-major prefill): workgroup = (row tile, KV head); it runs the
//   chunks of its rows in order and merges each as it finishes.
// - `attention_split` (SPLIT, decode): workgroup = (chunk, row tile, KV head); it writes
//   the chunk's (o_c, m_c, l_c) to a partials region of the arena, and
// - `attention_combine` (COMBINE): workgroup = (head, token); merges a row's partials in
//   chunk order.
// The split and fused kernels compute a chunk with the same functions below, and both
// paths merge with `merge`, so the two give every row the same bytes.
//
// A row tile is `rows` consecutive rows of one KV head g: row r of the tile is token
// (y·rows + r) / G, query head g·G + (y·rows + r) % G (G = nh / nkv), so the tile shares
// each staged K/V slice among the group's query heads and among tokens.
#extension GL_GOOGLE_include_directive : require
#define ACT_VEC4
#include "common.glsl"

#ifdef COMBINE
layout(local_size_x = 64) in;
#else
layout(local_size_x = 256) in;
#endif

layout(push_constant) uniform Params {
    uint hd;        // head_dim (a multiple of 4, <= MAX_HD; the split kernel uses its HD)
    uint nh;        // query heads
    uint nkv;       // key/value heads
    uint q_off;     // act offset of token 0's queries (rows of nh · hd; a multiple of 4)
    uint out_off;   // act offset of token 0's output (rows of nh · hd; a multiple of 4)
    uint pos_word;  // routing-buffer word holding the position of token 0 (written before the dispatch)
    float scale;    // 1 / sqrt(head_dim)
    uint m;         // tokens
    uint rows;      // rows per tile (<= MAX_ROWS and <= 4 · (256 / (hd / 4)))
    uint part_off;  // act offset of the partials (SPLIT, COMBINE; a multiple of 4)
    uint part_nc;   // chunk records per row in the partials
} pc;

#ifdef SPLIT
// The split kernel is built per attention shape (`AttentionKernels::split_for`): head_dim,
// query heads per KV head, and the rows each invocation computes in the score step (SR:
// the tile's rows / 4) and the PV step (PR), so that the driver folds the index arithmetic
// and drops the code of rows a decode tile never holds (on the H200 split + combine took
// 20.1 instead of 29.7 us per layer at 512 positions). A row's operations are the same,
// so are its bytes.
layout(constant_id = 0) const uint HD = 128u;
layout(constant_id = 1) const uint GQ = 8u;
layout(constant_id = 2) const uint SR = 8u;
layout(constant_id = 3) const uint PR = 4u;
#else
#define HD pc.hd
#define SR 8u
#define PR 4u
#endif

#define CH 64u          // positions per chunk: part of the arithmetic
#define MAX_HD 256u
#define MAX_ROWS 32u
#define DK 32u          // head dims per staged Q/K slice
#define KS4 9u          // vec4 stride of a staged Q/K slice row (DK + 4 floats)
#define STAGE4 576u     // vec4s of the K/V stage (CH · KS4)
#define NEG_INF (-1.0 / 0.0)

// A row's chunk merged into its running state (M, L, acc); `first` starts the state.
void merge(bool first, float mc, float lc, vec4 oc, inout float M, inout float L, inout vec4 acc) {
    if (first) {
        M = mc;
        L = lc;
        acc = oc;
    } else {
        float m2 = max(M, mc);
        precise float a = expf_(M - m2);
        precise float b = expf_(mc - m2);
        precise float l2 = L * a + lc * b;
        precise vec4 acc2 = acc * a + oc * b;
        M = m2;
        L = l2;
        acc = acc2;
    }
}

// The finished row: acc / L.
vec4 finish(float L, vec4 acc) {
    precise float inv = 1.0 / L;
    precise vec4 o = acc * inv;
    return o;
}

uint START;  // position of token 0 (read from the routing buffer: a kept recording serves any)

#ifndef COMBINE
layout(set = 0, binding = 0) readonly buffer Kc { vec4 kc[]; };
layout(set = 0, binding = 1) readonly buffer Vc { vec4 vc[]; };

shared vec4 qs[MAX_ROWS * KS4];  // a Q slice: row r's dims d0 .. d0 + DK at r · KS4
shared vec4 stage[STAGE4];       // a K slice (position j at j · KS4) or V rows (j · hd/4)
shared float ps[MAX_ROWS * CH];  // the chunk's scores, then probabilities
shared float red[MAX_ROWS * 8u];
shared float cmax[MAX_ROWS];     // m_c per row

uint G;      // query heads per KV head
uint g;      // the KV head
uint tile0;  // the tile's first row (of the KV head's rows)
uint LIVE;   // rows of the tile with a token (only those are computed)

// Positions row r of the tile attends to (0 for rows past the last token).
uint row_n(uint r) {
    uint gr = tile0 + r;
    return (r < pc.rows && gr < pc.m * G) ? START + gr / G + 1u : 0u;
}

// Act offset (vec4) of row r's query or output.
uint row_at(uint base, uint r) {
    uint gr = tile0 + r;
    return (base + (gr / G) * pc.nh * HD + (g * G + gr % G) * HD) / 4u;
}

// Scores of chunk c (positions < nmax are staged) for every row into ps (−inf where
// masked), and their maxima into cmax. Thread (j = tid % CH, rq = tid / CH) owns the
// scores of position j for rows rq + 4i.
void chunk_scores(uint c, uint nmax) {
    uint tid = gl_LocalInvocationID.x;
    uint j = tid % CH, rq = tid / CH;
    uint kvd4 = pc.nkv * HD / 4u;
    precise float s[8];
    FOR8(i, s[i] = 0.0;)
    for (uint d0 = 0u; d0 < HD; d0 += DK) {
        uint w4 = min(DK, HD - d0) / 4u;
        // The slice's Q (rows · w4 <= 256 vec4s) and K (CH · w4 <= 512) are loaded into
        // registers first, all loads in flight at once and while the previous slice's
        // readers finish, then stored.
        vec4 qv = vec4(0.0);
        if (tid < LIVE * w4) {
            qv = act4[row_at(pc.q_off, tid / w4) + d0 / 4u + tid % w4];
        }
        vec4 kv[2];
#define K_LOAD {                                                              \
            uint e = tid + 256u * u;                                          \
            uint pos = c * CH + e / w4;                                       \
            kv[u] = (e < CH * w4 && pos < nmax) ? kc[pos * kvd4 + (g * HD + d0) / 4u + e % w4] : vec4(0.0); \
        }
        FOR2(u, K_LOAD)
#undef K_LOAD
        barrier();
        if (tid < LIVE * w4) {
            qs[(tid / w4) * KS4 + tid % w4] = qv;
        }
        FOR2(u, if (tid + 256u * u < CH * w4) { stage[((tid + 256u * u) / w4) * KS4 + (tid + 256u * u) % w4] = kv[u]; })
        barrier();
        for (uint x = 0u; x < w4; x++) {
            vec4 k = stage[j * KS4 + x];
#define DOT(i) if (i < SR && rq + 4u * i < LIVE) {                            \
                vec4 q = qs[(rq + 4u * i) * KS4 + x];                         \
                s[i] = s[i] + q.x * k.x;                                      \
                s[i] = s[i] + q.y * k.y;                                      \
                s[i] = s[i] + q.z * k.z;                                      \
                s[i] = s[i] + q.w * k.w;                                      \
            }
            FOR8(i, DOT(i))
#undef DOT
        }
    }
#define STORE(i) if (i < SR && rq + 4u * i < LIVE) {                          \
        precise float v = s[i] * pc.scale;                                    \
        ps[(rq + 4u * i) * CH + j] = c * CH + j < row_n(rq + 4u * i) ? v : NEG_INF; \
    }
    FOR8(i, STORE(i))
#undef STORE
    barrier();
    // Maxima: 8 lanes per row over 8 positions each, then the 8 in order (max is exact).
    if (tid < LIVE * 8u) {
        uint b = (tid / 8u) * CH + (tid % 8u) * 8u;
        float mx = ps[b];
        for (uint k = 1u; k < 8u; k++) {
            mx = max(mx, ps[b + k]);
        }
        red[tid] = mx;
    }
    barrier();
    if (tid < LIVE) {
        float mx = red[tid * 8u];
        for (uint k = 1u; k < 8u; k++) {
            mx = max(mx, red[tid * 8u + k]);
        }
        cmax[tid] = mx;
    }
    barrier();
    // Probabilities of the live scores.
#define PROB(i) if (i < SR && rq + 4u * i < LIVE) {                           \
        uint at = (rq + 4u * i) * CH + j;                                     \
        if (c * CH + j < row_n(rq + 4u * i)) {                                \
            precise float p = expf_(ps[at] - cmax[rq + 4u * i]);                \
            ps[at] = p;                                                       \
        }                                                                     \
    }
    FOR8(i, PROB(i))
#undef PROB
    barrier();
}

// The PV thread layout: thread (d4 = tid % hd/4, rg = tid / (hd/4)) owns dims 4·d4 ..
// 4·d4 + 3 of rows rg + i · (256 / (hd/4)), i < 4.
uint pv_row(uint i) {
    uint hd4 = HD / 4u;
    uint rg = gl_LocalInvocationID.x / hd4;
    return rg < 256u / hd4 ? rg + i * (256u / hd4) : MAX_ROWS;
}

// Positions of chunk c that row r attends to.
uint chunk_count(uint c, uint r) {
    uint n = r < pc.rows ? row_n(r) : 0u;
    return n > c * CH ? min(n - c * CH, CH) : 0u;
}
#endif

void main() {
    START = route_u[pc.pos_word];
#ifdef COMBINE
    uint h = gl_WorkGroupID.x, t = gl_WorkGroupID.y;
    uint hd4 = HD / 4u, d4 = gl_LocalInvocationID.x;
    if (d4 >= hd4) {
        return;
    }
    uint n = START + t + 1u;
    uint nc = (n + CH - 1u) / CH;
    uint rec = pc.part_off / 4u + (t * pc.nh + h) * pc.part_nc * (hd4 + 1u);
    float M = 0.0, L = 0.0;
    vec4 acc = vec4(0.0);
    // Partials are merged (in order) eight chunks at a time, and the next eight chunks'
    // loads are in flight while these merge: a long context's merge waits on device
    // memory once, not once per eight chunks.
    vec4 ml[8], oc[8], nml[8], noc[8];
#define LOAD(c0, i, m, o) if ((c0) + i < nc) {                                 \
        uint at = rec + ((c0) + i) * (hd4 + 1u);                              \
        m[i] = act4[at + hd4];                                                \
        o[i] = act4[at + d4];                                                 \
    }
    FOR8(i, LOAD(0u, i, ml, oc))
    for (uint c0 = 0u; c0 < nc; c0 += 8u) {
        FOR8(i, LOAD(c0 + 8u, i, nml, noc))
        FOR8(i, if (c0 + i < nc) { merge(c0 + i == 0u, ml[i].x, ml[i].y, oc[i], M, L, acc); })
        FOR8(i, ml[i] = nml[i]; oc[i] = noc[i];)
    }
#undef LOAD
    act4[(pc.out_off + (t * pc.nh + h) * HD) / 4u + d4] = finish(L, acc);
#else
#ifdef SPLIT
    G = GQ;
#else
    G = pc.nh / pc.nkv;
#endif
    g = gl_WorkGroupID.z;
    tile0 = gl_WorkGroupID.y * pc.rows;
    LIVE = min(pc.rows, pc.m * G - tile0);
    uint tid = gl_LocalInvocationID.x;
    uint hd4 = HD / 4u;
    uint d4 = tid % hd4;
    // Positions staged: those of the tile's last token.
    uint last = tile0 + LIVE - 1u;
    uint nmax = START + last / G + 1u;
    // V rows per stage.
    uint jv = min(CH, STAGE4 / hd4);
    uint kvd4 = pc.nkv * hd4;
    uint cnt[4];
    precise vec4 o[4];
    precise float l[4];
#ifdef SPLIT
    uint c0 = gl_WorkGroupID.x;
    if (c0 * CH >= nmax) {
        return;
    }
    uint c1 = c0 + 1u;
#else
    uint c0 = 0u;
    uint c1 = (nmax + CH - 1u) / CH;
    float M[4], L[4];
    vec4 acc[4];
    FOR4(i, M[i] = 0.0; L[i] = 0.0; acc[i] = vec4(0.0);)
#endif
    for (uint c = c0; c < c1; c++) {
        chunk_scores(c, nmax);
        FOR4(i, o[i] = vec4(0.0); l[i] = 0.0; cnt[i] = i < PR ? chunk_count(c, pv_row(i)) : 0u;)
        for (uint j0 = 0u; j0 < CH && c * CH + j0 < nmax; j0 += jv) {
            // V rows (jv · hd4 <= STAGE4 = 576 vec4s, at most 3 a thread) loaded like K.
            vec4 vv[4];
#define V_LOAD {                                                              \
                uint e = tid + 256u * u;                                      \
                uint jj = e / hd4;                                            \
                uint pos = c * CH + j0 + jj;                                  \
                vv[u] = (e < jv * hd4 && j0 + jj < CH && pos < nmax) ? vc[pos * kvd4 + g * hd4 + e % hd4] : vec4(0.0); \
            }
            FOR4(u, V_LOAD)
#undef V_LOAD
            barrier();
            FOR4(u, if (tid + 256u * u < jv * hd4) { stage[tid + 256u * u] = vv[u]; })
            barrier();
            uint jn = min(jv, CH - j0);
            for (uint jj = 0u; jj < jn; jj++) {
                vec4 v = stage[jj * hd4 + d4];
#define PV(i) if (i < PR && j0 + jj < cnt[i]) {                                         \
                    float p = ps[pv_row(i) * CH + j0 + jj];                   \
                    o[i] = o[i] + p * v;                                      \
                    l[i] = l[i] + p;                                          \
                }
                FOR4(i, PV(i))
#undef PV
            }
        }
#ifdef SPLIT
        // Record (o_c, (m_c, l_c)) of each row with positions in the chunk.
#define SAVE(i) if (i < PR && cnt[i] > 0u) {                                            \
            uint gr = tile0 + pv_row(i);                                      \
            uint row = (gr / G) * pc.nh + g * G + gr % G;                     \
            uint at = pc.part_off / 4u + (row * pc.part_nc + c) * (hd4 + 1u); \
            act4[at + d4] = o[i];                                             \
            if (d4 == 0u) {                                                   \
                act4[at + hd4] = vec4(cmax[pv_row(i)], l[i], 0.0, 0.0);       \
            }                                                                 \
        }
        FOR4(i, SAVE(i))
#undef SAVE
#else
        FOR4(i, if (cnt[i] > 0u) { merge(c == 0u, cmax[pv_row(i)], l[i], o[i], M[i], L[i], acc[i]); })
#endif
    }
#ifndef SPLIT
    FOR4(i, if (pv_row(i) < pc.rows && row_n(pv_row(i)) > 0u) {
        act4[row_at(pc.out_off, pv_row(i)) + d4] = finish(L[i], acc[i]);
    })
#endif
#endif
}
