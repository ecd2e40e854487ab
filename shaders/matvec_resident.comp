#version 450
// The m=1 slice kernels (Q4_K, Q5_K, Q6_K: matvec and, with GATE_UP, the fused SwiGLU
// gate/up) with each invocation's inputs held in registers across rows: the same sums
// as matmul.comp at TB = 1, in the same order (slice_dot.glsl), so the same bytes, with
// another split of the work.
//
// matmul.comp's lane l takes slices l, l + LANES, ... of its rows and reads each slice's
// 32 inputs again for every row: on the H200 its Q4_K m=1 kernels read 7× more input than
// weight bytes through L1, which bounds them (bench/probes/q4k_m1.cu). Here invocation
// f of a workgroup owns slice s = f % ns (ns = cols / 32 slices a row, at most the
// workgroup size) of stream f / ns (WG_SIZE / ns streams): it loads its slice's 32 inputs
// once and takes its slice of rows stream, stream + streams, ... of the workgroup's ROWS
// rows, writing each row's two group terms to workgroup memory. Then lane l's chain over
// slices l, l + LANES, ... (acc = acc + term, group 0 then 1, from 0) and the LANES-lane
// tree (v[l] = v[l] + v[l + s], the values lane 0 of matmul.comp's butterfly ends with)
// run from workgroup memory, and the row's result is stored as matmul.comp stores it.
// Rows past the end repeat the last row and are not stored. Each token of a table entry
// (or of m) is one pass.
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#define ACT_VEC4
#include "common.glsl"
#define ACT(i) act4[(i) >> 2][(i) & 3u]

// Invocations per workgroup (specialization constant 3): at least a row's slice count.
layout(local_size_x = 128, local_size_x_id = 3) in;
#undef WG_SIZE
#define WG_SIZE gl_WorkGroupSize.x

layout(constant_id = 0) const uint ROWS = 16u;  // rows per workgroup
layout(constant_id = 2) const uint LANES = 32u; // matmul.comp's lanes per row (the order)

#include "matmul_io.glsl"

#define TB 1
#include "quant.glsl"
#ifdef GATE_UP
#define NACC 2u
#define FOR_K(B) FOR2(k, B) // gate (0) and up (1)
#define GU(code) code
#else
#define NACC 1u
#define FOR_K(B) FOR1(k, B)
#define GU(code)
#endif
#include "slice_dot.glsl"

// Term (row r, accumulator k, group g) of slice s; then each chain's sum, (r, k, lane).
shared float part[ROWS * NACC * 2u * WG_SIZE];
shared float chain[ROWS * NACC * LANES];
#define PART(r, k, g, s) part[(((r) * NACC + (k)) * 2u + (g)) * WG_SIZE + (s)]

void main() {
    // Lane numbering follows subgroups, as in matmul.comp: the twin slice s ^ 1 whose
    // block header k4_scales shares is invocation f ^ 1, in the same subgroup.
    uint f = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;
    uint ns = pc.cols / SLICE_W;
    uint streams = WG_SIZE / ns;
    uint stream = f / ns;
    uint s = f % ns;
    uint lane = f; // k4_scales' twin: lane & 1 is s & 1 (ns is even)
    uvec3 entry = table_entry(gl_WorkGroupID.y);
    uint delta = entry.x / UNIT_BYTES;
    uint p0 = entry.y;
    uint n = entry.z;
    uint wo = pc.w_off + delta;
    uint uo = pc.w2_off + delta;
    bool vec16 = wo % 16u == 0u && uo % 16u == 0u;
    bool xvec = pc.x_off % 4u == 0u && pc.x_stride % 4u == 0u;
    uint rowb = gl_WorkGroupID.x * ROWS;
    SLICE_AT
    for (uint t0 = 0u; t0 < n; t0++) {
        // The slice's inputs of group g in xq[g], and (K4) their sums X, as slice_dot.glsl's
        // SLICE_TOKEN forms them.
        uint xb = pc.x_off + x_row(p0 + t0) * pc.x_stride;
        vec4 xq[2][4];
        float xsum[2];
#define X_GROUP                                                                          \
    {                                                                                    \
        GROUP_INPUTS(xb + e0 + GROUP_E(g), xq[g])                                        \
        GROUP_XSUM(xq[g], x)                                                             \
        XS(xsum[g] = x;)                                                                 \
    }
        FOR_G(X_GROUP)
        // Streams past the last (WG_SIZE not a multiple of ns) take no rows.
        for (uint r = stream < streams ? stream : ROWS; r < ROWS; r += streams) {
            uint row = min(rowb + r, pc.rows - 1u) * ROW_UNITS;
            uvec4 sq[NACC][2];
            vec4 sf[NACC];
            SLICE_LOAD_M(w, w4, wo, row, 0u)
            GU(SLICE_LOAD_M(u, u4, uo, row, 1u))
#define ROW_TERM                                                                         \
    {                                                                                    \
        float qf[16];                                                                    \
        GROUP_QUANTS(k, g, qf);                                                          \
        GROUP_DOT(qf, xq[g], sdot)                                                       \
        XS(float xs = xsum[g];)                                                          \
        precise float term = GROUP_TERM(k, g);                                           \
        PART(r, k, g, s) = term;                                                         \
    }
            FOR_G(FOR_K(ROW_TERM))
        }
        barrier();
        // Lane l's chains, then the tree, in workgroup memory.
        for (uint c = f; c < ROWS * NACC * LANES; c += WG_SIZE) {
            uint l = c % LANES;
            uint rk = c / LANES;
            precise float acc = 0.0;
            for (uint sl = l; sl < ns; sl += LANES) {
                acc = acc + PART(rk / NACC, rk % NACC, 0u, sl);
                acc = acc + PART(rk / NACC, rk % NACC, 1u, sl);
            }
            chain[c] = acc;
        }
        for (uint st = LANES / 2u; st > 0u; st >>= 1u) {
            barrier();
            for (uint c = f; c < ROWS * NACC * LANES; c += WG_SIZE) {
                if (c % LANES < st) {
                    precise float v = chain[c] + chain[c + st];
                    chain[c] = v;
                }
            }
        }
        barrier();
        for (uint r = f; r < ROWS; r += WG_SIZE) {
            uint row = rowb + r;
            if (row < pc.rows) {
                float val = chain[r * NACC * LANES];
                GU(precise float hv = silu(val) * chain[(r * NACC + 1u) * LANES]; val = hv;)
                store_out(out_at(row) + out_row(p0 + t0) * pc.out_stride, val);
            }
        }
        // The next token's terms reuse part and chain.
        barrier();
    }
}
