#version 450
// A decode step's MoE block fused into one dispatch, for the benchmarks (`vulkan moe`):
// how much of a device-routed block's time (RMSNorm, router matvec, ranking, expert
// gate/up + SiLU, expert down + combine + residual: five dependent dispatches in the
// executor, ~60-68 µs in situ on an H100 or H200 at Qwen3-30B-A3B's shape, bf16) is the
// hand-off between them. One block, m=1, bf16 weights, hidden H, expert intermediate I, E experts, top-K:
//   xn = nw · (x · r), r = 1 / sqrt(mean(x²) + eps)
//   logits[e] = router[e] · xn
//   p = softmax(logits); the K most probable experts in descending order (ties to the
//   lower index), their weights p renormalised over the K
//   h[k][j] = silu(gate[e_k][j] · xn) · (up[e_k][j] · xn)
//   x[i] = x[i] + Σ_k w_k · (down[e_k][i] · h[k])   (k in rank order)
// A row's dot product follows common.glsl's order (32 lanes, lane l taking chunks of 8
// elements l, l + 32, ..., one fma each, then the fixed tree), so each row's bytes do not
// depend on which workgroup computes it.
// PHASE (push constant `phase` < 5): the block as five dispatches ordered by pipeline
// barriers, as the executor records it (0: the norm, one workgroup, writes xn; 1: the
// router; 2: the ranking, one workgroup; 3: gate/up; 4: down + combine).
// phase 5 (PERSIST): the whole block in one dispatch of G workgroups, all resident at
// once, meeting at two grid barriers (after the router and after gate/up); each
// workgroup forms the norm and the ranking itself (the same operations, so the same
// bytes as the phases), so those two need no hand-off. Vulkan does not promise that a
// dispatch's workgroups run concurrently: the poll gives up after 2^20 tries (wrong
// bytes, never a hang) — a measurement, not an executor path.
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#include "common.glsl"

layout(local_size_x = 256) in;

#define H 2048u          // hidden size
#define H4 256u          // uvec4 chunks (8 bf16) per hidden row
#define I 768u           // expert intermediate size
#define I4 96u           // uvec4 chunks per intermediate row
#define K 8u             // experts per token
#define MAX_E 256u       // experts at most
#define GROUPS 8u        // lane groups (rows) per workgroup
#define PERSIST 5u

// bf16 weights of every layer: per layer the router [E][H], then per expert gate [I][H],
// up [I][H], down [H][I].
layout(set = 0, binding = 0) readonly buffer W4 { uvec4 w4[]; };
// x (H, the residual, updated in place), xn (H), logits (MAX_E), h (K·I), the ranked
// experts (K, as float bits) and their weights (K): written by one workgroup and read by
// others with no pipeline barrier in between in PERSIST, so coherent.
layout(set = 0, binding = 1) coherent buffer Io { float io[]; };
layout(set = 0, binding = 1) coherent buffer Io4 { vec4 io4[]; };
layout(set = 0, binding = 2) coherent buffer Counts { uint counts[]; };
layout(set = 0, binding = 3) readonly buffer Nw { float nw[]; };

#define IO_X 0u
#define IO_XN H
#define IO_LOGITS (2u * H)
#define IO_H (IO_LOGITS + MAX_E)
#define IO_SEL (IO_H + K * I)
#define IO_WT (IO_SEL + K)

layout(push_constant) uniform Params {
    uint layer4;  // uvec4 offset of this layer's weights in the binding (0: one layer a binding)
    uint ne;      // experts (<= MAX_E)
    uint phase;   // 0..4: one phase; PERSIST: all
    uint bar;     // first grid-barrier count of this block (PERSIST)
    uint stop;    // PERSIST: 0 the whole block, else return after stage `stop` (timing of
                  // a prefix: 1 norm, 2 router + grid barrier, 3 ranking + gate/up + grid barrier)
} pc;

// xn (norm to gate/up), then four ranks of h at a time (down): one array.
shared vec4 xh4[4u * I / 4u];
#define xs4 xh4
#define hs4 xh4
shared float red[256];
shared uint order[K];
shared float wts[K];

uint tid() { return gl_LocalInvocationID.x; }
uint lane() { return gl_LocalInvocationID.x % 32u; }
uint group() { return gl_LocalInvocationID.x / 32u; }

// The fixed tree of common.glsl over a lane group's 32 partials (shared strides of at
// least the subgroup size, butterfly shuffles below): lane 0 gets the row's sum. Every
// invocation of the workgroup calls it together.
float row_tree(float a) {
    uint s = 16u;
    if (gl_SubgroupSize < 32u) {
        for (; s >= gl_SubgroupSize; s >>= 1u) {
            red[tid()] = a;
            barrier();
            if (lane() < s) {
                precise float t = a + red[tid() + s];
                a = t;
            }
            barrier();
        }
    }
    for (; s > 0u; s >>= 1u) {
        precise float t = a + subgroupShuffleXor(a, s);
        a = t;
    }
    return a;
}

// The eight bf16 weights of q times the inputs x0, x1, added to acc in order.
void mac8(uvec4 q, vec4 x0, vec4 x1, inout float acc) {
    precise float a = acc;
    a = fma(bf16_lo(q.x), x0.x, a);
    a = fma(bf16_hi(q.x), x0.y, a);
    a = fma(bf16_lo(q.y), x0.z, a);
    a = fma(bf16_hi(q.y), x0.w, a);
    a = fma(bf16_lo(q.z), x1.x, a);
    a = fma(bf16_hi(q.z), x1.y, a);
    a = fma(bf16_lo(q.w), x1.z, a);
    a = fma(bf16_hi(q.w), x1.w, a);
    acc = a;
}

// This lane's partial of hidden-width row `row4` (uvec4 offset) against xs4.
float hidden_dot(uint row4) {
    uvec4 q[8];
    FOR8(c, q[c] = w4[row4 + lane() + 32u * c];)
    precise float acc = 0.0;
    FOR8(c, {
        uint at = 2u * (lane() + 32u * c);
        mac8(q[c], xs4[at], xs4[at + 1u], acc);
    })
    return acc;
}

// The norm of x into xs4 (every invocation of the workgroup).
void norm_into_shared() {
    float xv[8];
    FOR8(j, xv[j] = io[IO_X + tid() + 256u * j];)
    precise float ss = 0.0;
    FOR8(j, ss = ss + xv[j] * xv[j];)
    red[tid()] = ss;
    barrier();
    for (uint s = 128u; s > 0u; s >>= 1u) {
        if (tid() < s) {
            precise float t = red[tid()] + red[tid() + s];
            red[tid()] = t;
        }
        barrier();
    }
    precise float ms = red[0] / float(H);
    precise float r = 1.0 / sqrt(ms + 1e-6);
    barrier();
    FOR8(j, {
        uint e = tid() + 256u * j;
        precise float o = nw[e] * (xv[j] * r);
        xs4[e / 4u][e % 4u] = o;
    })
    barrier();
}

// Router rows of this workgroup (rows g·8 .. g·8 + 7 of every G·8), into io.
void router_rows(uint g, uint groups) {
    uint rounds = (pc.ne + GROUPS * groups - 1u) / (GROUPS * groups);
    for (uint k = 0u; k < rounds; k++) {
        uint row = (k * groups + g) * GROUPS + group();
        float a = row_tree(hidden_dot(pc.layer4 + min(row, pc.ne - 1u) * H4));
        if (row < pc.ne && lane() == 0u) {
            io[IO_LOGITS + row] = a;
        }
    }
}

// A reduction over the workgroup's 256 values v (max, or with `add` the sum): each lane
// group's 32 by common.glsl's tree (row_tree's order), then the eight group results in
// order by the first invocation; every invocation gets the result.
shared float grp[GROUPS];
float wg_reduce(float v, bool add) {
    uint s = 16u;
    if (gl_SubgroupSize < 32u) {
        for (; s >= gl_SubgroupSize; s >>= 1u) {
            red[tid()] = v;
            barrier();
            if (lane() < s) {
                precise float t = add ? v + red[tid() + s] : max(v, red[tid() + s]);
                v = t;
            }
            barrier();
        }
    }
    for (; s > 0u; s >>= 1u) {
        float o = subgroupShuffleXor(v, s);
        precise float t = add ? v + o : max(v, o);
        v = t;
    }
    if (lane() == 0u) {
        grp[group()] = v;
    }
    barrier();
    precise float r = grp[0];
    for (uint g = 1u; g < GROUPS; g++) {
        precise float t = add ? r + grp[g] : max(r, grp[g]);
        r = t;
    }
    barrier();
    return r;
}

// The softmax and top-K of the logits into order / wts (every invocation).
shared vec4 ps4[MAX_E / 4u];
void rank() {
    uint t = tid();
    float lg = t < pc.ne ? io[IO_LOGITS + t] : -1.0 / 0.0;
    float gmax = wg_reduce(lg, false);
    precise float v = t < pc.ne ? expf_(lg - gmax) : 0.0;
    precise float q = v / wg_reduce(v, true);
    ps4[t / 4u][t % 4u] = t < pc.ne ? q : -1.0;
    barrier();
    if (t < pc.ne) {
        // Experts before t: more probable, or as probable and of a lower index.
        uint before = 0u;
        for (uint f = 0u; f < (pc.ne + 3u) / 4u; f++) {
            vec4 pf = ps4[f];
            FOR4(c, before += (pf[c] > q || (pf[c] == q && 4u * f + c < t)) ? 1u : 0u;)
        }
        if (before < K) {
            order[before] = t;
        }
    }
    barrier();
    if (t < K) {
        float pk = ps4[order[t] / 4u][order[t] % 4u];
        precise float sum = 0.0;
        for (uint r = 0u; r < K; r++) {
            sum = sum + ps4[order[r] / 4u][order[r] % 4u];
        }
        precise float w = pk / sum;
        wts[t] = w;
    }
    barrier();
}

uint expert4(uint e) {
    return pc.layer4 + pc.ne * H4 + e * 3u * I * H4;
}

// Gate/up rows (K·I of them) of this workgroup, silu(g)·u into io.
void gate_up_rows(uint g, uint groups) {
    uint rows = K * I;
    uint rounds = (rows + GROUPS * groups - 1u) / (GROUPS * groups);
    for (uint k = 0u; k < rounds; k++) {
        uint row = min((k * groups + g) * GROUPS + group(), rows - 1u);
        uint e = order[row / I];
        uint j = row % I;
        uint g4 = expert4(e) + j * H4;
        precise float ag = 0.0;
        precise float au = 0.0;
        uvec4 qg[8];
        uvec4 qu[8];
        FOR8(c, qg[c] = w4[g4 + lane() + 32u * c];)
        FOR8(c, qu[c] = w4[g4 + I * H4 + lane() + 32u * c];)
        FOR8(c, {
            uint at = 2u * (lane() + 32u * c);
            vec4 x0 = xs4[at];
            vec4 x1 = xs4[at + 1u];
            mac8(qg[c], x0, x1, ag);
            mac8(qu[c], x0, x1, au);
        })
        ag = row_tree(ag);
        au = row_tree(au);
        uint want = (k * groups + g) * GROUPS + group();
        if (want < rows && lane() == 0u) {
            precise float hv = silu(ag) * au;
            io[IO_H + row] = hv;
        }
    }
}

// Down rows (H) of this workgroup with the combine and the residual: two rows of a lane
// group at a time, each rank's dot product into y; h passes through shared memory four
// ranks at a time (12 KiB, which also holds xn before), so that a workgroup's shared
// memory stays small.
void down_rows(uint g, uint groups) {
    uint rounds = (H + GROUPS * groups - 1u) / (GROUPS * groups);
    for (uint k0 = 0u; k0 < rounds; k0 += 2u) {
        float y[2][K];
        FOR2(hf, {
            barrier();
            FOR4(j, { if (j < 3u) { hs4[tid() + 256u * j] = io4[IO_H / 4u + hf * (4u * I / 4u) + tid() + 256u * j]; } })
            barrier();
            FOR2(j, if (k0 + j < rounds) {
                uint row = min(((k0 + j) * groups + g) * GROUPS + group(), H - 1u);
                uvec4 q[4][3];
                FOR4(r, {
                    uint d4 = expert4(order[4u * hf + r]) + 2u * I * H4 + row * I4;
                    FOR2(c, q[r][c] = w4[d4 + lane() + 32u * c];)
                    q[r][2] = w4[d4 + lane() + 64u];
                })
                FOR4(r, {
                    precise float acc = 0.0;
                    FOR2(c, {
                        uint at = (r * I + 8u * (lane() + 32u * c)) / 4u;
                        mac8(q[r][c], hs4[at], hs4[at + 1u], acc);
                    })
                    uint at = (r * I + 8u * (lane() + 64u)) / 4u;
                    mac8(q[r][2], hs4[at], hs4[at + 1u], acc);
                    y[j][4u * hf + r] = row_tree(acc);
                })
            })
        })
        FOR2(j, {
            uint want = ((k0 + j) * groups + g) * GROUPS + group();
            if (k0 + j < rounds && want < H && lane() == 0u) {
                precise float a = 0.0;
                FOR8(r, a = a + y[j][r] * wts[r];)
                precise float x = io[IO_X + want] + a;
                io[IO_X + want] = x;
            }
        })
    }
}

// All G workgroups arrive at count `at`, then go on.
void grid_barrier(uint at, uint groups) {
    memoryBarrierBuffer();
    barrier();
    if (tid() == 0u) {
        atomicAdd(counts[at], 1u);
        for (uint n = 0u; atomicAdd(counts[at], 0u) < groups && n < (1u << 20); n++) {
        }
    }
    memoryBarrierBuffer();
    barrier();
}

void load_xn() {
    xs4[tid()] = io4[IO_XN / 4u + tid()];
    xs4[tid() + 256u] = io4[IO_XN / 4u + tid() + 256u];
    barrier();
}

void load_rank() {
    if (tid() < K) {
        order[tid()] = floatBitsToUint(io[IO_SEL + tid()]);
        wts[tid()] = io[IO_WT + tid()];
    }
    barrier();
}

void main() {
    uint g = gl_WorkGroupID.x;
    uint groups = gl_NumWorkGroups.x;
    if (pc.phase == PERSIST) {
        norm_into_shared();
        if (pc.stop == 1u) {
            return;
        }
        router_rows(g, groups);
        grid_barrier(pc.bar, groups);
        if (pc.stop == 2u) {
            return;
        }
        rank();
        gate_up_rows(g, groups);
        grid_barrier(pc.bar + 1u, groups);
        if (pc.stop == 3u) {
            return;
        }
        down_rows(g, groups);
        return;
    }
    if (pc.phase == 0u) {
        norm_into_shared();
        for (uint e = tid(); e < H; e += 256u) {
            io[IO_XN + e] = xs4[e / 4u][e % 4u];
        }
    } else if (pc.phase == 1u) {
        load_xn();
        router_rows(g, groups);
    } else if (pc.phase == 2u) {
        rank();
        if (tid() < K) {
            io[IO_SEL + tid()] = uintBitsToFloat(order[tid()]);
            io[IO_WT + tid()] = wts[tid()];
        }
    } else if (pc.phase == 3u) {
        load_xn();
        load_rank();
        gate_up_rows(g, groups);
    } else {
        load_rank();
        down_rows(g, groups);
    }
}
