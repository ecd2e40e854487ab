#version 450
// Dense projection: out[t][row] = W[row] . x[t] for m tokens (row-major W, f32 or bf16).
// TB = tokens per pass: 1 is the m=1 matvec, 8 the token-batched sibling that reuses each
// weight chunk for 8 tokens. Both follow common.glsl's summation order exactly, so they
// give the same bytes for every element.
// With GATE_UP the same shape computes the fused SwiGLU front half of an FFN:
// out[t][row] = silu(Wg[row] . x[t]) * (Wu[row] . x[t]).
//
// Layout of the work: a workgroup is WG_SIZE / LANES lane groups; lane group g owns RPT
// consecutive rows and its LANES lanes split every row's dot product (common.glsl). A
// lane loads UNROLL weight chunks of each of its rows before it uses them (bytes in
// flight), and reuses one x chunk for its RPT rows and one weight chunk for TB tokens.
// RPT, UNROLL and LANES are specialization constants: RPT and UNROLL change only which
// invocation computes what, never an element's summation order; LANES is part of the
// order and is the same for the m=1 and batched kernels of one device.
//
// With FLAG_TABLE one dispatch covers several experts (workgroup y = table entry j):
// entry j = route_u[tab_off + 3j ..] = (weight element offset added to w_off and w2_off,
// first pair p0, pair count n); its tokens are pairs p0 .. p0 + n - 1, whose input and
// output rows follow FLAG_GATHER / FLAG_SCATTER (or are the pair index itself).
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_control_flow_attributes : require
#define ACT_VEC4
#include "common.glsl"
#define ACT(i) act4[(i) >> 2][(i) & 3u]

layout(local_size_x = 256) in;

layout(constant_id = 0) const uint RPT = 1u;     // rows per lane group (<= MAX_RPT)
layout(constant_id = 1) const uint UNROLL = 4u;  // chunks loaded ahead (<= MAX_UNROLL)
layout(constant_id = 2) const uint LANES = 32u;  // lanes per row (power of two <= WG_SIZE)

layout(push_constant) uniform Params {
    uint rows;       // output rows of this dispatch
    uint cols;       // inputs per row
    uint m;          // tokens (without FLAG_TABLE)
    uint w_off;      // element offset of row 0 in the weight binding (gate)
    uint w2_off;     // element offset of row 0 of the up weights (GATE_UP only)
    uint x_off;      // act offset of token 0's input
    uint x_stride;   // act elements between tokens' inputs
    uint out_off;    // act offset of (token 0, row 0) of the output
    uint out_stride; // act elements between tokens' outputs
    uint map_off;    // route_u offset of the token map (GATHER / SCATTER)
    uint map_div;    // divisor applied to gathered indices
    uint flags;
    uint tab_off;    // route_u offset of the expert table (FLAG_TABLE)
} pc;

#if TB > 1
#define MAX_RPT 1u
#else
#define MAX_RPT 4u
#endif
#define MAX_UNROLL 8u

#ifdef BF16
#define CHUNK 8u
#define WVEC uvec4
layout(set = 0, binding = 0) readonly buffer W { uint w[]; };
layout(set = 0, binding = 0) readonly buffer W4 { uvec4 w4[]; };
#ifdef GATE_UP
layout(set = 0, binding = 1) readonly buffer U { uint u[]; };
layout(set = 0, binding = 1) readonly buffer U4 { uvec4 u4[]; };
#endif
#define WS(e) (((e) & 1u) == 1u ? bf16_hi(w[(e) >> 1]) : bf16_lo(w[(e) >> 1]))
#define US(e) (((e) & 1u) == 1u ? bf16_hi(u[(e) >> 1]) : bf16_lo(u[(e) >> 1]))
uint pack2(float lo, float hi) { return (floatBitsToUint(lo) >> 16) | (floatBitsToUint(hi) & 0xFFFF0000u); }
// The CHUNK elements starting at e, as stored, read one by one (any alignment).
#define LOAD_SCALAR(SCAL, e)                                                            \
    uvec4(pack2(SCAL((e)), SCAL((e) + 1u)), pack2(SCAL((e) + 2u), SCAL((e) + 3u)),       \
          pack2(SCAL((e) + 4u), SCAL((e) + 5u)), pack2(SCAL((e) + 6u), SCAL((e) + 7u)))
void unpack(uvec4 q, out float v[CHUNK]) {
    v[0] = bf16_lo(q.x); v[1] = bf16_hi(q.x); v[2] = bf16_lo(q.y); v[3] = bf16_hi(q.y);
    v[4] = bf16_lo(q.z); v[5] = bf16_hi(q.z); v[6] = bf16_lo(q.w); v[7] = bf16_hi(q.w);
}
#else
#define CHUNK 4u
#define WVEC vec4
layout(set = 0, binding = 0) readonly buffer W { float w[]; };
layout(set = 0, binding = 0) readonly buffer W4 { vec4 w4[]; };
#ifdef GATE_UP
layout(set = 0, binding = 1) readonly buffer U { float u[]; };
layout(set = 0, binding = 1) readonly buffer U4 { vec4 u4[]; };
#endif
#define WS(e) w[e]
#define US(e) u[e]
#define LOAD_SCALAR(SCAL, e) vec4(SCAL((e)), SCAL((e) + 1u), SCAL((e) + 2u), SCAL((e) + 3u))
void unpack(vec4 q, out float v[CHUNK]) {
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}
#endif

#ifdef GATE_UP
#define NACC 2u
#else
#define NACC 1u
#endif

// Accumulator (gate/up k, row r, token i).
#define ACC(k, r, i) ((((k) * MAX_RPT) + (r)) * TB + (i))
#define NA (NACC * MAX_RPT * TB)
shared float red[NA * WG_SIZE];

uint x_row(uint p) {
    return (pc.flags & FLAG_GATHER) != 0u ? route_u[pc.map_off + p] / pc.map_div : p;
}

uint out_row(uint p) {
    return (pc.flags & FLAG_SCATTER) != 0u ? route_u[pc.map_off + p] : p;
}

float silu(float g) {
    precise float d = 1.0 + exp(-g);
    precise float r = g / d;
    return r;
}

void main() {
    // Lane numbering follows subgroups, so lanes l and l ^ s (s < subgroup size) of a
    // lane group are in one subgroup.
    uint f = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;
    uint lane = f % LANES;
    uint grp = f / LANES;
    uint rowb = (gl_WorkGroupID.x * (WG_SIZE / LANES) + grp) * RPT;
    uint delta = 0u;
    uint p0 = 0u;
    uint n = pc.m;
    if ((pc.flags & FLAG_TABLE) != 0u) {
        uint te = pc.tab_off + 3u * gl_WorkGroupID.y;
        delta = route_u[te];
        p0 = route_u[te + 1u];
        n = route_u[te + 2u];
    }
    uint wo = pc.w_off + delta;
    uint uo = pc.w2_off + delta;
    uint nch = pc.cols / CHUNK;
    bool wvec = pc.cols % CHUNK == 0u && wo % CHUNK == 0u && uo % CHUNK == 0u;
    bool xvec = pc.x_off % 4u == 0u && pc.x_stride % 4u == 0u;
    // Loops run to compile-time bounds, with the specialization constants as guards, so
    // every array below has constant indices once unrolled. Only loops without float
    // arithmetic carry [[unroll]]: spirv-opt's unrolled copies lose NoContraction (the
    // driver may then fuse or reorder them), so the others are left to the driver.
    uint wrow[MAX_RPT];
    [[unroll]] for (uint r = 0u; r < MAX_RPT; r++) {
        wrow[r] = min(rowb + min(r, RPT - 1u), pc.rows - 1u) * pc.cols;
    }

    for (uint t0 = 0u; t0 < n; t0 += TB) {
        precise float acc[NA];
        [[unroll]] for (uint a = 0u; a < NA; a++) {
            acc[a] = 0.0;
        }
        uint xb[TB];
        [[unroll]] for (uint i = 0u; i < TB; i++) {
            xb[i] = pc.x_off + x_row(p0 + min(t0 + i, n - 1u)) * pc.x_stride;
        }
        for (uint c0 = lane; c0 < nch; c0 += UNROLL * LANES) {
            WVEC wq[MAX_UNROLL * MAX_RPT];
#ifdef GATE_UP
            WVEC uq[MAX_UNROLL * MAX_RPT];
#endif
            if (wvec) {
                [[unroll]] for (uint v = 0u; v < MAX_UNROLL; v++) {
                    uint c = min(c0 + v * LANES, nch - 1u);
                    [[unroll]] for (uint r = 0u; r < MAX_RPT; r++) {
                        if (v < UNROLL && r < RPT) {
                            wq[v * MAX_RPT + r] = w4[(wo + wrow[r]) / CHUNK + c];
#ifdef GATE_UP
                            uq[v * MAX_RPT + r] = u4[(uo + wrow[r]) / CHUNK + c];
#endif
                        }
                    }
                }
            } else {
                [[unroll]] for (uint v = 0u; v < MAX_UNROLL; v++) {
                    uint e = min(c0 + v * LANES, nch - 1u) * CHUNK;
                    [[unroll]] for (uint r = 0u; r < MAX_RPT; r++) {
                        if (v < UNROLL && r < RPT) {
                            wq[v * MAX_RPT + r] = LOAD_SCALAR(WS, wo + wrow[r] + e);
#ifdef GATE_UP
                            uq[v * MAX_RPT + r] = LOAD_SCALAR(US, uo + wrow[r] + e);
#endif
                        }
                    }
                }
            }
            for (uint v = 0u; v < MAX_UNROLL; v++) {
                uint e = (c0 + v * LANES) * CHUNK;
                if (v < UNROLL && c0 + v * LANES < nch) {
                    float wv[MAX_RPT][CHUNK];
#ifdef GATE_UP
                    float uv[MAX_RPT][CHUNK];
#endif
                    for (uint r = 0u; r < MAX_RPT; r++) {
                        unpack(wq[v * MAX_RPT + r], wv[r]);
#ifdef GATE_UP
                        unpack(uq[v * MAX_RPT + r], uv[r]);
#endif
                    }
                    for (uint i = 0u; i < TB; i++) {
                        float xv[CHUNK];
                        if (xvec) {
                            for (uint q = 0u; q < CHUNK; q += 4u) {
                                vec4 x4 = act4[(xb[i] + e + q) >> 2];
                                xv[q] = x4.x; xv[q + 1u] = x4.y; xv[q + 2u] = x4.z; xv[q + 3u] = x4.w;
                            }
                        } else {
                            for (uint q = 0u; q < CHUNK; q++) {
                                xv[q] = ACT(xb[i] + e + q);
                            }
                        }
                        for (uint r = 0u; r < MAX_RPT; r++) {
                            if (r < RPT) {
                                for (uint q = 0u; q < CHUNK; q++) {
                                    acc[ACC(0u, r, i)] = acc[ACC(0u, r, i)] + wv[r][q] * xv[q];
#ifdef GATE_UP
                                    acc[ACC(1u, r, i)] = acc[ACC(1u, r, i)] + uv[r][q] * xv[q];
#endif
                                }
                            }
                        }
                    }
                }
            }
        }
        if (lane == 0u) {
            for (uint e = nch * CHUNK; e < pc.cols; e++) {
                for (uint r = 0u; r < MAX_RPT; r++) {
                    if (r < RPT) {
                        float we = WS(wo + wrow[r] + e);
#ifdef GATE_UP
                        float ue = US(uo + wrow[r] + e);
#endif
                        for (uint i = 0u; i < TB; i++) {
                            float xe = ACT(xb[i] + e);
                            acc[ACC(0u, r, i)] = acc[ACC(0u, r, i)] + we * xe;
#ifdef GATE_UP
                            acc[ACC(1u, r, i)] = acc[ACC(1u, r, i)] + ue * xe;
#endif
                        }
                    }
                }
            }
        }
        // The fixed tree of common.glsl: strides of at least the subgroup size through
        // shared memory, smaller ones by butterfly shuffles (the same sums in lane 0).
        uint s = LANES / 2u;
        if (gl_SubgroupSize < LANES) {
            for (uint a = 0u; a < NA; a++) {
                red[a * WG_SIZE + f] = acc[a];
            }
            barrier();
            for (; s >= gl_SubgroupSize; s >>= 1u) {
                if (lane < s) {
                    for (uint a = 0u; a < NA; a++) {
                        precise float t = red[a * WG_SIZE + f] + red[a * WG_SIZE + f + s];
                        red[a * WG_SIZE + f] = t;
                    }
                }
                barrier();
            }
            for (uint a = 0u; a < NA; a++) {
                acc[a] = red[a * WG_SIZE + f];
            }
            barrier();
        }
        for (; s > 0u; s >>= 1u) {
            for (uint a = 0u; a < NA; a++) {
                acc[a] = acc[a] + subgroupShuffleXor(acc[a], s);
            }
        }
        if (lane == 0u) {
            for (uint r = 0u; r < MAX_RPT; r++) {
                uint row = rowb + r;
                for (uint i = 0u; i < TB; i++) {
                    if (r < RPT && row < pc.rows && t0 + i < n) {
                        float val = acc[ACC(0u, r, i)];
#ifdef GATE_UP
                        precise float hv = silu(val) * acc[ACC(1u, r, i)];
                        val = hv;
#endif
                        uint o = pc.out_off + out_row(p0 + t0 + i) * pc.out_stride + row;
                        if ((pc.flags & FLAG_ACCUMULATE) != 0u) {
                            precise float sum = ACT(o) + val;
                            ACT(o) = sum;
                        } else {
                            ACT(o) = val;
                        }
                    }
                }
            }
        }
    }
}
