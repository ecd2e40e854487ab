#version 450
// RMSNorm of one row per workgroup (workgroup y = token): out = w * (x / sqrt(mean(x²) + eps)).
// GATED (`gated_rmsnorm`, the DeltaNet output norm): workgroup x is a value head of n
// elements, normalised in place and multiplied by silu(z) of the same head
// (out = (w * (x * r)) * silu(z), as actors/src/cpu/delta.rs's gated_rmsnorm_row).
// The m=1 and batched dispatches run this same per-row program; a row's result does not
// depend on how many rows were dispatched with it.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
// One invocation per chain of squares (NORM_CHAINS, which matmul.comp's NORM_IN front
// plays to form the same bytes).
#undef WG_SIZE
#define WG_SIZE NORM_CHAINS

layout(local_size_x = NORM_CHAINS) in;

layout(push_constant) uniform Params {
    uint n;          // elements per row
    uint in_off;     // act offset of token 0's row
    uint in_stride;
    uint out_off;
    uint out_stride;
    float eps;
#ifdef GATED
    uint z_off;      // act offset of token 0's z
    uint z_stride;
#endif
} pc;

layout(set = 0, binding = 0) readonly buffer Nw { float nw[]; };

shared float red[WG_SIZE];

#define RC 16u // elements a thread keeps in registers (rows of up to RC · WG_SIZE)
// GATE(code) keeps code in the gated norm only.
#ifdef GATED
#define GATE(code) code
#else
#define GATE(code)
#endif

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint t = gl_WorkGroupID.y;
    uint xi = pc.in_off + t * pc.in_stride;
    uint oi = pc.out_off + t * pc.out_stride;
#ifdef GATED
    uint head = gl_WorkGroupID.x * pc.n;
    xi += head;
    oi += head;
    uint zi = pc.z_off + t * pc.z_stride + head;
#endif
    // Element i = tid + WG_SIZE · j of the row: the first RC of each thread are loaded
    // at once (their loads in flight together) and kept for the second pass; a longer
    // row's rest is read one at a time. The sum of squares runs over j in order.
    // The weights (and z) are loaded with x, so their loads are in flight during the
    // reduction instead of after it.
    float xv[RC];
#define X_LOAD xv[j] = tid + WG_SIZE * j < pc.n ? act[xi + tid + WG_SIZE * j] : 0.0;
    FOR16(j, X_LOAD)
    float wv[RC];
#define W_LOAD wv[j] = tid + WG_SIZE * j < pc.n ? nw[tid + WG_SIZE * j] : 0.0;
    FOR16(j, W_LOAD)
#ifdef GATED
    float zv[RC];
#define Z_LOAD zv[j] = tid + WG_SIZE * j < pc.n ? act[zi + tid + WG_SIZE * j] : 0.0;
    FOR16(j, Z_LOAD)
#endif
    precise float ss = 0.0;
#define X_SQUARE                                                               \
    if (tid + WG_SIZE * j < pc.n) {                                            \
        ss = ss + xv[j] * xv[j];                                               \
    }
    FOR16(j, X_SQUARE)
    for (uint i = tid + RC * WG_SIZE; i < pc.n; i += WG_SIZE) {
        float v = act[xi + i];
        ss = ss + v * v;
    }
    red[tid] = ss;
    barrier();
    for (uint s = WG_SIZE / 2u; s > 0u; s >>= 1u) {
        if (tid < s) {
            precise float r = red[tid] + red[tid + s];
            red[tid] = r;
        }
        barrier();
    }
    float r = rms_scale(red[0], pc.n, pc.eps);
#define Y_STORE                                                                \
    if (tid + WG_SIZE * j < pc.n) {                                            \
        precise float o = wv[j] * (xv[j] * r);                                 \
        GATE(o = o * silu(zv[j]);)                                             \
        act[oi + tid + WG_SIZE * j] = o;                                       \
    }
    FOR16(j, Y_STORE)
    for (uint i = tid + RC * WG_SIZE; i < pc.n; i += WG_SIZE) {
        precise float o = nw[i] * (act[xi + i] * r);
        GATE(o = o * silu(act[zi + i]);)
        act[oi + i] = o;
    }
}
