#version 450
// The gated delta rule of one DeltaNet layer (transformers' recurrent form): per value
// head h and row t, with the L2-normed query (times q_scale) and key of its key head,
// β = σ(b), g = −exp(A_log)·softplus(a + dt_bias), the state S (`[key dim][value dim]`)
// decays by exp(g), mem = Sᵀk, S += k ⊗ β(v − mem), out = Sᵀq.
//
// Workgroup x = (value head, tile of COLS value columns); invocation (column, k-lane):
// KL lanes split a column's key-dim sums (lane l takes key rows l, l + KL, ... in order),
// and their partials are added in a fixed tree, ((p0 + p1) + (p2 + p3)). A column of S
// is only ever touched by its own KL invocations.
//
// `delta_rule` runs one row (the decode step); `delta_rule_batched` (BATCHED) runs the
// block's rows in order through the same per-row program, so each row gets the bytes the
// step gives it and layer-major prefill is byte-identical to token-serial replay.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

#define COLS 64u
#define KL 4u
#define MAX_DK 256u

layout(local_size_x = 256) in;

layout(push_constant) uniform Params {
    uint nk;         // key heads
    uint nv;         // value heads (a multiple of nk)
    uint dk;         // key head dim (<= MAX_DK)
    uint dv;         // value head dim
    uint lin_off;    // act offset of row 0's [q | k | v | z | b | a]
    uint lin_stride; // act elements between rows
    uint core_off;   // act offset of row 0's output (rows of nv · dv)
    uint s_off;      // offset of the layer's recurrent state in the state buffer
    uint rows;       // rows (BATCHED only)
    float q_scale;   // 1 / sqrt(dk)
} pc;

layout(set = 0, binding = 0) readonly buffer ALog { float a_log[]; };
layout(set = 0, binding = 1) readonly buffer DtBias { float dt_bias[]; };
layout(set = 0, binding = 2) buffer State { float st[]; };

#ifdef BATCHED
#define ROWS pc.rows
#else
#define ROWS 1u
#endif

shared float qs[MAX_DK];
shared float ks[MAX_DK];
shared float red[WG_SIZE];

// The KL partials of column c in red, added in the fixed tree.
float column_sum(uint c) {
    precise float s = (red[c] + red[c + COLS]) + (red[c + 2u * COLS] + red[c + 3u * COLS]);
    return s;
}

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint tiles = (pc.dv + COLS - 1u) / COLS;
    uint h = gl_WorkGroupID.x / tiles;
    uint c = tid % COLS;
    uint col = (gl_WorkGroupID.x % tiles) * COLS + c;
    uint kl = tid / COLS;
    bool live = col < pc.dv;
    uint kh = h / (pc.nv / pc.nk);
    uint kd = pc.nk * pc.dk;
    uint vd = pc.nv * pc.dv;
    uint sbase = pc.s_off + h * pc.dk * pc.dv + col;
    float ea = expf_(a_log[h]);
    float dtb = dt_bias[h];
    for (uint t = 0u; t < ROWS; t++) {
        uint row = pc.lin_off + t * pc.lin_stride;
        // The previous row's readers of qs, ks and red are done.
        barrier();
        for (uint i = tid; i < pc.dk; i += WG_SIZE) {
            qs[i] = act[row + kh * pc.dk + i];
            ks[i] = act[row + kd + kh * pc.dk + i];
        }
        barrier();
        // Sums of squares: invocations 0..63 of the query, 64..127 of the key.
        precise float p = 0.0;
        if (tid < 128u) {
            for (uint i = tid & 63u; i < pc.dk; i += 64u) {
                float v = tid < 64u ? qs[i] : ks[i];
                p = p + v * v;
            }
        }
        red[tid] = p;
        barrier();
        for (uint s = 32u; s > 0u; s >>= 1u) {
            if (tid < 128u && (tid & 63u) < s) {
                precise float r = red[tid] + red[tid + s];
                red[tid] = r;
            }
            barrier();
        }
        precise float qinv = 1.0 / sqrt(red[0] + 1e-6);
        precise float kinv = 1.0 / sqrt(red[64] + 1e-6);
        barrier();
        for (uint i = tid; i < pc.dk; i += WG_SIZE) {
            precise float q = qs[i] * qinv * pc.q_scale;
            precise float k = ks[i] * kinv;
            qs[i] = q;
            ks[i] = k;
        }
        barrier();
        float bv = act[row + 2u * kd + 2u * vd + h];
        float av = act[row + 2u * kd + 2u * vd + pc.nv + h];
        precise float beta = sigmoid(bv);
        precise float x = av + dtb;
        precise float sp = x > 20.0 ? x : log1pf_(expf_(x));
        precise float g = -ea * sp;
        precise float decay = expf_(g);
        // Decay, and read Sᵀk.
        precise float m = 0.0;
        if (live) {
            for (uint i = kl; i < pc.dk; i += KL) {
                uint si = sbase + i * pc.dv;
                precise float sv = st[si] * decay;
                st[si] = sv;
                m = m + sv * ks[i];
            }
        }
        red[tid] = m;
        barrier();
        precise float mem = column_sum(c);
        float vv = live ? act[row + 2u * kd + h * pc.dv + col] : 0.0;
        precise float d = (vv - mem) * beta;
        // Write k ⊗ d, and read Sᵀq.
        precise float o = 0.0;
        if (live) {
            for (uint i = kl; i < pc.dk; i += KL) {
                uint si = sbase + i * pc.dv;
                precise float sv = st[si] + ks[i] * d;
                st[si] = sv;
                o = o + sv * qs[i];
            }
        }
        barrier();
        red[tid] = o;
        barrier();
        if (live && kl == 0u) {
            act[pc.core_off + t * vd + h * pc.dv + col] = column_sum(c);
        }
    }
}
