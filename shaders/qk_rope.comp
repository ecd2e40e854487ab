#version 450
// Per-head RMSNorm and RoPE (rotate-half over the first rotary dims; partial RoPE leaves
// the others as normalised) of queries and keys, and the K/V append.
// Workgroup (s, t): token t; s < nh is query head s (normalised and rotated in place),
// nh <= s < nh + nkv is key/value head s - nh (key normalised, rotated and written to the
// key cache at position start + t; value copied to the value cache).
// Decode dispatches one token, prefill a chunk; every workgroup's program is the same.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 128) in;

layout(push_constant) uniform Params {
    uint hd;      // head_dim
    uint nh;      // query heads
    uint nkv;     // key/value heads
    uint q_off;   // act offset of token 0's queries
    uint k_off;   // act offset of token 0's keys
    uint v_off;   // act offset of token 0's values
    uint pos_off; // act offset of the position of token 0 (written for each pass)
    float eps;
    uint rh;      // rotary_dim / 2: dims rh.. of the first 2·rh rotate, the rest pass
} pc;

layout(set = 0, binding = 0) readonly buffer Qn { float qn[]; };
layout(set = 0, binding = 1) readonly buffer Kn { float kn[]; };
layout(set = 0, binding = 2) readonly buffer Cos { float rcos[]; };
layout(set = 0, binding = 3) readonly buffer Sin { float rsin[]; };
layout(set = 0, binding = 4) buffer Kc { float kc[]; };
layout(set = 0, binding = 5) buffer Vc { float vc[]; };

#define MAX_HD 512u
shared float xs[MAX_HD];
shared float red[128];

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint s = gl_WorkGroupID.x;
    uint t = gl_WorkGroupID.y;
    uint pos = floatBitsToUint(act[pc.pos_off]) + t;
    uint hd = pc.hd;
    uint half_ = pc.rh;
    uint qd = pc.nh * hd;
    uint kvd = pc.nkv * hd;
    bool is_q = s < pc.nh;
    uint head = is_q ? s : s - pc.nh;
    uint src = is_q ? pc.q_off + t * qd + head * hd : pc.k_off + t * kvd + head * hd;

    precise float ss = 0.0;
    for (uint i = tid; i < hd; i += 128u) {
        float v = act[src + i];
        xs[i] = v;
        ss = ss + v * v;
    }
    red[tid] = ss;
    barrier();
    for (uint st = 64u; st > 0u; st >>= 1u) {
        if (tid < st) {
            precise float r = red[tid] + red[tid + st];
            red[tid] = r;
        }
        barrier();
    }
    precise float ms = red[0] / float(hd);
    precise float r = 1.0 / sqrt(ms + pc.eps);
    for (uint i = tid; i < hd; i += 128u) {
        float w = is_q ? qn[i] : kn[i];
        precise float o = w * (xs[i] * r);
        xs[i] = o;
    }
    barrier();
    uint cache = pos * kvd + head * hd;
    for (uint i = tid; i < half_; i += 128u) {
        float a = xs[i];
        float b = xs[i + half_];
        float c = rcos[pos * half_ + i];
        float sn = rsin[pos * half_ + i];
        precise float lo = a * c - b * sn;
        precise float hi = b * c + a * sn;
        if (is_q) {
            act[src + i] = lo;
            act[src + i + half_] = hi;
        } else {
            kc[cache + i] = lo;
            kc[cache + i + half_] = hi;
        }
    }
    for (uint i = 2u * half_ + tid; i < hd; i += 128u) {
        float o = xs[i];
        if (is_q) {
            act[src + i] = o;
        } else {
            kc[cache + i] = o;
        }
    }
    if (!is_q) {
        uint vsrc = pc.v_off + t * kvd + head * hd;
        for (uint i = tid; i < hd; i += 128u) {
            vc[cache + i] = act[vsrc + i];
        }
    }
}
