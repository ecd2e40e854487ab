#version 450
// Causal GQA attention of one (query head, token) per workgroup: token t (position
// start + t) attends to positions 0..=start + t of the cache. Softmax in three passes
// (max, sum of exponentials, weighted values) with per-thread partials combined by a
// fixed tree, so the result of a row is the same in a decode step and in a prefill chunk.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 128) in;

layout(push_constant) uniform Params {
    uint hd;       // head_dim
    uint nh;       // query heads
    uint nkv;      // key/value heads
    uint q_off;    // act offset of token 0's queries
    uint out_off;  // act offset of token 0's attention output
    uint pos_off;  // act offset of the position of token 0 (written for each pass)
    float scale;   // 1 / sqrt(head_dim)
} pc;

layout(set = 0, binding = 0) readonly buffer Kc { float kc[]; };
layout(set = 0, binding = 1) readonly buffer Vc { float vc[]; };

#define MAX_HD 512u
#define TILE 128u
shared float qs[MAX_HD];
shared float ps[TILE];
shared float red[128];

float score(uint j, uint kbase, uint kvd) {
    precise float d = 0.0;
    uint k0 = j * kvd + kbase;
    for (uint i = 0u; i < pc.hd; i++) {
        d = d + qs[i] * kc[k0 + i];
    }
    precise float sc = d * pc.scale;
    return sc;
}

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint head = gl_WorkGroupID.x;
    uint t = gl_WorkGroupID.y;
    uint hd = pc.hd;
    uint qd = pc.nh * hd;
    uint kvd = pc.nkv * hd;
    uint g = head / (pc.nh / pc.nkv);
    uint kbase = g * hd;
    uint n = floatBitsToUint(act[pc.pos_off]) + t + 1u;
    uint qsrc = pc.q_off + t * qd + head * hd;
    for (uint i = tid; i < hd; i += 128u) {
        qs[i] = act[qsrc + i];
    }
    barrier();

    float mx = -1.0 / 0.0;
    for (uint j = tid; j < n; j += 128u) {
        mx = max(mx, score(j, kbase, kvd));
    }
    red[tid] = mx;
    barrier();
    for (uint s = 64u; s > 0u; s >>= 1u) {
        if (tid < s) {
            red[tid] = max(red[tid], red[tid + s]);
        }
        barrier();
    }
    float gmax = red[0];
    barrier();

    precise float sum = 0.0;
    for (uint j = tid; j < n; j += 128u) {
        sum = sum + exp(score(j, kbase, kvd) - gmax);
    }
    red[tid] = sum;
    barrier();
    for (uint s = 64u; s > 0u; s >>= 1u) {
        if (tid < s) {
            precise float r = red[tid] + red[tid + s];
            red[tid] = r;
        }
        barrier();
    }
    float gsum = red[0];

    precise float o[MAX_HD / 128u];
    for (uint k = 0u; k < MAX_HD / 128u; k++) {
        o[k] = 0.0;
    }
    for (uint j0 = 0u; j0 < n; j0 += TILE) {
        uint j = j0 + tid;
        if (j < n) {
            precise float p = exp(score(j, kbase, kvd) - gmax) / gsum;
            ps[tid] = p;
        }
        barrier();
        uint cnt = min(TILE, n - j0);
        for (uint k = 0u; k < MAX_HD / 128u; k++) {
            uint d = tid + k * 128u;
            if (d < hd) {
                for (uint jj = 0u; jj < cnt; jj++) {
                    o[k] = o[k] + ps[jj] * vc[(j0 + jj) * kvd + kbase + d];
                }
            }
        }
        barrier();
    }
    uint dst = pc.out_off + t * qd + head * hd;
    for (uint k = 0u; k < MAX_HD / 128u; k++) {
        uint d = tid + k * 128u;
        if (d < hd) {
            act[dst + d] = o[k];
        }
    }
}
