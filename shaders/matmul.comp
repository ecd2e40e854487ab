#version 450
// Dense projection: out[t][row] = W[row] . x[t] for m tokens (row-major W, f32 or bf16).
// TB = tokens per pass: 1 is the m=1 matvec, 8 the token-batched sibling that reuses each
// weight chunk for 8 tokens. Both follow common.glsl's summation order exactly.
// With GATE_UP the same shape computes the fused SwiGLU front half of an FFN:
// out[t][row] = silu(Wg[row] . x[t]) * (Wu[row] . x[t]).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256) in;

layout(push_constant) uniform Params {
    uint rows;       // output rows of this dispatch
    uint cols;       // inputs per row
    uint m;          // tokens
    uint w_off;      // element offset of row 0 in the weight binding (gate)
    uint w2_off;     // element offset of row 0 of the up weights (GATE_UP only)
    uint x_off;      // act offset of token 0's input
    uint x_stride;   // act elements between tokens' inputs
    uint out_off;    // act offset of (token 0, row 0) of the output
    uint out_stride; // act elements between tokens' outputs
    uint map_off;    // route_u offset of the token map (GATHER / SCATTER)
    uint map_div;    // divisor applied to gathered indices
    uint flags;
} pc;

#ifdef BF16
#define CHUNK 8u
layout(set = 0, binding = 0) readonly buffer W { uint w[]; };
layout(set = 0, binding = 0) readonly buffer W4 { uvec4 w4[]; };
#ifdef GATE_UP
layout(set = 0, binding = 1) readonly buffer U { uint u[]; };
layout(set = 0, binding = 1) readonly buffer U4 { uvec4 u4[]; };
#endif
#define WS(e) (((e) & 1u) == 1u ? bf16_hi(w[(e) >> 1]) : bf16_lo(w[(e) >> 1]))
#define US(e) (((e) & 1u) == 1u ? bf16_hi(u[(e) >> 1]) : bf16_lo(u[(e) >> 1]))
#else
#define CHUNK 4u
layout(set = 0, binding = 0) readonly buffer W { float w[]; };
layout(set = 0, binding = 0) readonly buffer W4 { vec4 w4[]; };
#ifdef GATE_UP
layout(set = 0, binding = 1) readonly buffer U { float u[]; };
layout(set = 0, binding = 1) readonly buffer U4 { vec4 u4[]; };
#endif
#define WS(e) w[e]
#define US(e) u[e]
#endif

#ifdef GATE_UP
#define NACC 2u
#else
#define NACC 1u
#endif

shared float red[NACC * TB * WG_SIZE];

// Loads the CHUNK weights starting at element e (e % CHUNK == 0) into wv[].
#ifdef BF16
#define LOAD_VEC(ARR4, e, wv)                                                          \
    {                                                                                  \
        uvec4 q4 = ARR4[(e) >> 3];                                                     \
        wv[0] = bf16_lo(q4.x); wv[1] = bf16_hi(q4.x); wv[2] = bf16_lo(q4.y);           \
        wv[3] = bf16_hi(q4.y); wv[4] = bf16_lo(q4.z); wv[5] = bf16_hi(q4.z);           \
        wv[6] = bf16_lo(q4.w); wv[7] = bf16_hi(q4.w);                                  \
    }
#else
#define LOAD_VEC(ARR4, e, wv)                                                          \
    {                                                                                  \
        vec4 q4 = ARR4[(e) >> 2];                                                      \
        wv[0] = q4.x; wv[1] = q4.y; wv[2] = q4.z; wv[3] = q4.w;                         \
    }
#endif

uint x_row(uint t) {
    return (pc.flags & FLAG_GATHER) != 0u ? route_u[pc.map_off + t] / pc.map_div : t;
}

float silu(float g) {
    return g / (1.0 + exp(-g));
}

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint lane = tid % LANES;
    uint grp = tid / LANES;
    uint row = gl_WorkGroupID.x * ROWS_PER_WG + grp;
    bool live = row < pc.rows;
    uint nch = pc.cols / CHUNK;
    uint wbase = pc.w_off + row * pc.cols;
    uint ubase = pc.w2_off + row * pc.cols;
    bool vec_ok = pc.cols % CHUNK == 0u && pc.w_off % CHUNK == 0u && pc.w2_off % CHUNK == 0u;

    for (uint t0 = 0u; t0 < pc.m; t0 += TB) {
        precise float acc[TB];
#ifdef GATE_UP
        precise float accu[TB];
#endif
        uint xb[TB];
        for (uint i = 0u; i < TB; i++) {
            acc[i] = 0.0;
#ifdef GATE_UP
            accu[i] = 0.0;
#endif
            xb[i] = pc.x_off + x_row(min(t0 + i, pc.m - 1u)) * pc.x_stride;
        }
        if (live) {
            float wv[CHUNK];
#ifdef GATE_UP
            float uv[CHUNK];
#endif
            float xv[CHUNK];
            for (uint c = lane; c < nch; c += LANES) {
                uint e = c * CHUNK;
                if (vec_ok) {
                    LOAD_VEC(w4, wbase + e, wv)
#ifdef GATE_UP
                    LOAD_VEC(u4, ubase + e, uv)
#endif
                } else {
                    for (uint q = 0u; q < CHUNK; q++) {
                        wv[q] = WS(wbase + e + q);
#ifdef GATE_UP
                        uv[q] = US(ubase + e + q);
#endif
                    }
                }
                for (uint i = 0u; i < TB; i++) {
                    for (uint q = 0u; q < CHUNK; q++) {
                        xv[q] = act[xb[i] + e + q];
                    }
                    for (uint q = 0u; q < CHUNK; q++) {
                        acc[i] = acc[i] + wv[q] * xv[q];
#ifdef GATE_UP
                        accu[i] = accu[i] + uv[q] * xv[q];
#endif
                    }
                }
            }
            if (lane == 0u) {
                for (uint e = nch * CHUNK; e < pc.cols; e++) {
                    float we = WS(wbase + e);
#ifdef GATE_UP
                    float ue = US(ubase + e);
#endif
                    for (uint i = 0u; i < TB; i++) {
                        float xe = act[xb[i] + e];
                        acc[i] = acc[i] + we * xe;
#ifdef GATE_UP
                        accu[i] = accu[i] + ue * xe;
#endif
                    }
                }
            }
        }
        for (uint i = 0u; i < TB; i++) {
            red[i * WG_SIZE + tid] = acc[i];
#ifdef GATE_UP
            red[(TB + i) * WG_SIZE + tid] = accu[i];
#endif
        }
        barrier();
        for (uint s = LANES / 2u; s > 0u; s >>= 1u) {
            if (lane < s) {
                for (uint i = 0u; i < NACC * TB; i++) {
                    precise float r = red[i * WG_SIZE + tid] + red[i * WG_SIZE + tid + s];
                    red[i * WG_SIZE + tid] = r;
                }
            }
            barrier();
        }
        if (live && lane < TB && t0 + lane < pc.m) {
            uint t = t0 + lane;
            float v = red[lane * WG_SIZE + grp * LANES];
#ifdef GATE_UP
            float up = red[(TB + lane) * WG_SIZE + grp * LANES];
            precise float h = silu(v) * up;
            v = h;
#endif
            uint orow = (pc.flags & FLAG_SCATTER) != 0u ? route_u[pc.map_off + t] : t;
            uint o = pc.out_off + orow * pc.out_stride + row;
            if ((pc.flags & FLAG_ACCUMULATE) != 0u) {
                precise float s = act[o] + v;
                act[o] = s;
            } else {
                act[o] = v;
            }
        }
        barrier();
    }
}
