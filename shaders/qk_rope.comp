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
    uint pos_word; // routing-buffer word holding the position of token 0 (written for each pass)
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
    uint pos = route_u[pc.pos_word] + t;
    uint hd = pc.hd;
    uint half_ = pc.rh;
    uint qd = pc.nh * hd;
    uint kvd = pc.nkv * hd;
    bool is_q = s < pc.nh;
    uint head = is_q ? s : s - pc.nh;
    uint src = is_q ? pc.q_off + t * qd + head * hd : pc.k_off + t * kvd + head * hd;

    uint cache = pos * kvd + head * hd;
    uint vsrc = pc.v_off + t * kvd + head * hd;
    // Everything the workgroup reads is requested first (elements i = tid + 128u of the
    // head, rotary pairs i < half_), so the loads are in flight together instead of one
    // round trip per step.
    float xv[4], wv[4], vv[4], cv[2], sv[2];
#define LOAD_X {                                                               \
        uint i = tid + 128u * u;                                               \
        xv[u] = i < hd ? act[src + i] : 0.0;                                   \
        wv[u] = i < hd ? (is_q ? qn[i] : kn[i]) : 0.0;                         \
        vv[u] = i < hd && !is_q ? act[vsrc + i] : 0.0;                         \
    }
    FOR4(u, LOAD_X)
#define LOAD_ROT {                                                             \
        uint i = tid + 128u * u;                                               \
        cv[u] = i < half_ ? rcos[pos * half_ + i] : 0.0;                       \
        sv[u] = i < half_ ? rsin[pos * half_ + i] : 0.0;                       \
    }
    FOR2(u, LOAD_ROT)
    precise float ss = 0.0;
#define SQUARE if (tid + 128u * u < hd) {                                      \
        xs[tid + 128u * u] = xv[u];                                            \
        ss = ss + xv[u] * xv[u];                                               \
    }
    FOR4(u, SQUARE)
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
#define NORM if (tid + 128u * u < hd) {                                        \
        precise float o = wv[u] * (xv[u] * r);                                 \
        xs[tid + 128u * u] = o;                                                \
    }
    FOR4(u, NORM)
    barrier();
#define ROTATE if (tid + 128u * u < half_) {                                   \
        uint i = tid + 128u * u;                                               \
        float a = xs[i];                                                       \
        float b = xs[i + half_];                                               \
        precise float lo = a * cv[u] - b * sv[u];                              \
        precise float hi = b * cv[u] + a * sv[u];                              \
        if (is_q) {                                                            \
            act[src + i] = lo;                                                 \
            act[src + i + half_] = hi;                                         \
        } else {                                                               \
            kc[cache + i] = lo;                                                \
            kc[cache + i + half_] = hi;                                        \
        }                                                                      \
    }
    FOR2(u, ROTATE)
    for (uint i = 2u * half_ + tid; i < hd; i += 128u) {
        float o = xs[i];
        if (is_q) {
            act[src + i] = o;
        } else {
            kc[cache + i] = o;
        }
    }
    if (!is_q) {
        FOR4(u, if (tid + 128u * u < hd) { vc[cache + tid + 128u * u] = vv[u]; })
    }
}
