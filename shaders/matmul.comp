#version 450
// Dense projection: out[t][row] = W[row] . x[t] for m tokens (row-major W of one weight
// type: f32, or with BF16 / F16 16-bit floats, or with Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K
// ggml blocks dequantised in registers by quant.glsl).
// TB = tokens per pass: 1 is the m=1 matvec, 4 (float weights) or 8 (block formats, whose
// decode is shared by the pass's tokens) the token-batched sibling that reuses each weight
// chunk for TB tokens (shaders.txt sets it per module). All follow common.glsl's summation
// order exactly, so they give the same bytes for every element.
// With GATE_UP the same shape computes the fused SwiGLU front half of an FFN:
// out[t][row] = silu(Wg[row] . x[t]) * (Wu[row] . x[t]).
//
// Layout of the work: a workgroup is WG_SIZE / LANES lane groups; lane group g owns RPT
// consecutive rows and its LANES lanes split every row's dot product (common.glsl). A
// lane loads UNROLL weight chunks of each of its rows before it uses them (bytes in
// flight), and reuses one x chunk for its RPT rows and one weight chunk for TB tokens.
// RPT, UNROLL, LANES and WG_SIZE are specialization constants: RPT, UNROLL and WG_SIZE
// change only which invocation computes what, never an element's summation order; LANES
// is part of the order and is the same for the m=1 and batched kernels of one device.
//
// With FLAG_TABLE one dispatch covers several experts (workgroup y = table entry j):
// entry j = route_u[tab_off + 3j ..] = (weight byte offset, added in weight units
// (UNIT_BYTES) to w_off and w2_off; first pair p0; pair count n); its tokens are pairs
// p0 .. p0 + n - 1, whose input and output rows follow FLAG_GATHER / FLAG_SCATTER (or are
// the pair index itself).
// With FLAG_COMBINE as well (m=1 kernels; a decode step whose k experts are in one
// table, one pair each, the pair list holding their ranks), lane group g of a workgroup
// of k lane groups takes entry g for the workgroup's RPT rows, and the workgroup adds
// their MoE combine to the residual at out_off as accumulate.comp does: per row, the sum
// over ranks r in rank order of y_r · ROUTE_F(wt_off + r), then the residual plus it. The
// y_r are the bytes the kernel writes without the flag, so the result is the bytes of the
// down projection followed by accumulate.comp, without the dispatch between them.
//
// With FRONT (GATE_UP, TB = 1: the front of a device-routed decode step whose k experts
// the VRAM tier holds in one buffer, actors/src/vulkan/device_route.rs) one dispatch of G
// workgroups, all resident at once, forms the router's gate logits, the ranking and the
// experts' gate/up: its workgroups take the router's rows (router.glsl: the bytes of the
// m=1 matvec of the router's weight type), meet at a grid barrier, each ranks the token
// itself (rank.glsl: the bytes of route.comp's ranking), and then take the gate/up
// workgroups of every ranked expert in turn (workgroup (x, y): rank y's expert at its
// tier slot, its output row at rank y), each as the m=1 gate/up's workgroup (x, y) would
// (the same bytes). Workgroup 0 also writes the step's routing words and the host's copy
// of the ranking (rank_tables); the down projection after it reads those words. Vulkan
// does not promise that a dispatch's workgroups run at once: a workgroup that waits too
// long at the grid barrier gives up and marks the step (io[io_out + ne + k + 1]), whose
// results the host then discards.
//
// With EMBED the module is the embedding lookup of a table stored in the weight type
// instead (see its main).
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#define ACT_VEC4
#ifdef FRONT
#define ROUTE_WRITE
#endif
#include "common.glsl"
#define ACT(i) act4[(i) >> 2][(i) & 3u]

// Invocations per workgroup: specialization constant 3, which the host sets per kernel
// (fewer for the m=1 kernels than for the batched ones); 256 where it sets none (the
// embedding lookup). It moves work between workgroups, never an element's summation order.
layout(local_size_x = 256, local_size_x_id = 3) in;
#undef WG_SIZE
#define WG_SIZE gl_WorkGroupSize.x

layout(constant_id = 0) const uint RPT = 1u;     // rows per lane group (<= MAX_RPT)
layout(constant_id = 1) const uint UNROLL = 4u;  // chunks loaded ahead (<= MAX_UNROLL)
layout(constant_id = 2) const uint LANES = 32u;  // lanes per row (power of two <= WG_SIZE)

#include "matmul_io.glsl"

#ifdef FRONT
// With NORM_IN (specialization constant 5: the row's vec4s, 0 for none) the front's
// input is the residual row at x_off, and every workgroup forms its RMSNorm itself
// (norm_in below: rmsnorm.comp's bytes, weights `nw`) into workgroup memory, which its
// router rows and gate/up read; workgroup 0 also stores the row at norm_out for the
// step's later readers. The norm's own dispatch goes, and the workgroups that take no
// router row form it off the critical path (they only wait at the grid barrier). The
// row's array is sized by the constant, so a front declares no more workgroup memory than
// its model needs (with a fixed 16 KiB array the bf16 down projection after the front
// read 16.8 µs against 13.5 on an H100; the driver's L1/shared split follows the
// footprint, and that may be why).
layout(constant_id = 5) const uint NORM_IN = 0u;
layout(set = 0, binding = 6) readonly buffer Nw { float nw[]; };
shared vec4 norm_x4[NORM_IN + 1u];
// Input float i and vec4 i4 of the product (arena offsets).
#define XIN4(i4) (NORM_IN != 0u ? norm_x4[(i4) - (pc.x_off >> 2)] : act4[i4])
#define XIN(i) (NORM_IN != 0u ? norm_x4[((i) - pc.x_off) >> 2][((i) - pc.x_off) & 3u] : ACT(i))
// Per expert of every layer: (tier buffer of its slot or NONE, byte offset in it).
layout(set = 0, binding = 2) readonly buffer Slots { uint slots[]; };
// The host's readback buffer.
layout(set = 0, binding = 3) buffer Io { float io[]; };
// The grid barrier's words: arrivals, then the generation (sense reversal: the last
// workgroup to arrive resets the count and advances the generation, so the words need
// no reset between dispatches).
layout(set = 0, binding = 5) coherent buffer Grid { uint grid[]; };
// The arena as every workgroup reads the gate logits others wrote in this dispatch.
layout(set = 1, binding = 0) coherent buffer ActC { float act_c[]; };
#define MAX_E 512u
#define MAX_RANKS 64u
#define RANK_SLOTS
#define RANK_LOGIT(i) act_c[i]
#include "rank.glsl"

// Polls of the grid barrier's generation before a workgroup gives up.
#define GRID_POLLS (1u << 22)

// Every workgroup arrives, then waits until all have (true), or gives up (false).
bool grid_barrier(uint tid) {
    memoryBarrierBuffer();
    barrier();
    if (tid == 0u) {
        uint gen = atomicAdd(grid[1], 0u);
        if (atomicAdd(grid[0], 1u) == gl_NumWorkGroups.x - 1u) {
            atomicExchange(grid[0], 0u);
            memoryBarrierBuffer();
            atomicAdd(grid[1], 1u);
            rank_bcast = 1.0;
        } else {
            // Met only if the generation moved: a driver may cut the loop short
            // (llvmpipe ends any loop after 65535 rounds).
            for (uint n = 0u; atomicAdd(grid[1], 0u) == gen && n < GRID_POLLS; n++) {
            }
            rank_bcast = atomicAdd(grid[1], 0u) != gen ? 1.0 : 0.0;
        }
    }
    memoryBarrierBuffer();
    barrier();
    bool met = rank_bcast != 0.0;
    barrier();
    return met;
}
#endif

#ifndef FRONT
#define XIN4(i4) act4[i4]
#define XIN(i) ACT(i)
#endif

// Loops whose body indexes a register array (wrow, xb, wq, uq, wv, uv, xq, acc) are
// written FOR_X(BODY) (common.glsl); GU(code) keeps code in the GATE_UP variants only.

#define MAX_UNROLL 8u
#define FOR_V(B) FOR8(v, B) // chunk v < MAX_UNROLL of a lane's batch
#define MAX_RPT 4u
#define FOR_R(B) FOR4(r, B) // row r < MAX_RPT of a lane group
#if TB == 8
#define FOR_I(B) FOR8(i, B) // token i < TB of a pass
#elif TB == 4
#define FOR_I(B) FOR4(i, B)
#elif TB == 1
#define FOR_I(B) FOR1(i, B)
#else
#error TB must be 1, 4 or 8
#endif

#if defined(Q8_0) || defined(Q4_0) || defined(Q4_K) || defined(Q5_K) || defined(Q6_K)
#include "quant.glsl"
#elif defined(BF16) || defined(F16)
#define UNIT_BYTES 2u
#define CHUNK 8u
#define FOR_Q(B) FOR8(q, B)
#define WVEC uvec4
layout(set = 0, binding = 0) readonly buffer W { uint w[]; };
layout(set = 0, binding = 0) readonly buffer W4 { uvec4 w4[]; };
#ifdef GATE_UP
layout(set = 0, binding = 1) readonly buffer U { uint u[]; };
layout(set = 0, binding = 1) readonly buffer U4 { uvec4 u4[]; };
#endif
#ifdef F16
#define HALF_LO(x) f16_to_f32((x) & 0xFFFFu)
#define HALF_HI(x) f16_to_f32((x) >> 16)
#else
#define HALF_LO(x) bf16_lo(x)
#define HALF_HI(x) bf16_hi(x)
#endif
#define WS(e) (((e) & 1u) == 1u ? HALF_HI(w[(e) >> 1]) : HALF_LO(w[(e) >> 1]))
#define US(e) (((e) & 1u) == 1u ? HALF_HI(u[(e) >> 1]) : HALF_LO(u[(e) >> 1]))
// The stored 16 bits of element e of B.
#define RAW(B, e) ((B[(e) >> 1] >> (16u * ((e) & 1u))) & 0xFFFFu)
#define RAW2(B, e) (RAW(B, (e)) | (RAW(B, (e) + 1u) << 16))
// The CHUNK elements starting at e, as stored, read one by one (any alignment).
#define LOAD_SCALAR(B, e) uvec4(RAW2(B, (e)), RAW2(B, (e) + 2u), RAW2(B, (e) + 4u), RAW2(B, (e) + 6u))
void unpack(uvec4 q, out float v[CHUNK]) {
    v[0] = HALF_LO(q.x); v[1] = HALF_HI(q.x); v[2] = HALF_LO(q.y); v[3] = HALF_HI(q.y);
    v[4] = HALF_LO(q.z); v[5] = HALF_HI(q.z); v[6] = HALF_LO(q.w); v[7] = HALF_HI(q.w);
}
#else
#define UNIT_BYTES 4u
#define CHUNK 4u
#define FOR_Q(B) FOR4(q, B)
#define WVEC vec4
layout(set = 0, binding = 0) readonly buffer W { float w[]; };
layout(set = 0, binding = 0) readonly buffer W4 { vec4 w4[]; };
#ifdef GATE_UP
layout(set = 0, binding = 1) readonly buffer U { float u[]; };
layout(set = 0, binding = 1) readonly buffer U4 { vec4 u4[]; };
#endif
#define WS(e) w[e]
#define US(e) u[e]
#define LOAD_SCALAR(B, e) vec4(B[(e)], B[(e) + 1u], B[(e) + 2u], B[(e) + 3u])
void unpack(vec4 q, out float v[CHUNK]) {
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}
#endif

#ifndef QUANT
// Plain element types: weight units are elements (UNIT_BYTES each), rows are cols units
// apart; chunks are loaded one by one where the vector load does not apply.
#define ROW_UNITS pc.cols
#define LOAD_W(row, e) LOAD_SCALAR(w, (row) + (e))
#define LOAD_U(row, e) LOAD_SCALAR(u, (row) + (e))
#endif

#ifdef GATE_UP
#define NACC 2u
#define FOR_K(B) FOR2(k, B) // gate (0) and up (1) accumulators
#define GU(code) code
#else
#define NACC 1u
#define FOR_K(B) FOR1(k, B)
#define GU(code)
#endif

#if (defined(K4) || defined(Q6_K)) && !defined(EMBED)
#include "slice_dot.glsl"
#endif

// Accumulator (gate/up k, row r, token i); FOR_A visits every one as a, FOR_KI those of
// row r as a and ra, their place in one row's round of the shared tree below.
#define ACC(k, r, i) ((((k) * MAX_RPT) + (r)) * TB + (i))
#define NA (NACC * MAX_RPT * TB)
#define FOR_A(B) FOR_K(FOR_R(FOR_I({ const uint a = ACC(k, r, i); B })))
#define FOR_KI(B) FOR_K(FOR_I({ const uint a = ACC(k, r, i); const uint ra = k * TB + i; B }))
// The shared tree needs one row's accumulators per invocation; FLAG_COMBINE (m=1) keeps up
// to MAX_RPT rows per lane group in it (the front's gate/up never combines, and its large
// workgroups keep shared memory small). Sizing it by RPT (a specialization constant)
// instead crashed lavapipe running the batched kernels.
#if TB == 1 && !defined(FRONT)
shared float red[NA * WG_SIZE];
#else
shared float red[NACC * TB * WG_SIZE];
#endif

#ifdef SLICE_W
#define MATMUL_DOT SLICE_DOT
#else
// The chunk loop of main (its lane, nch, wo, uo, wrow, xb, wvec and acc): lane l takes
// chunks l, l + LANES, ... of every row, UNROLL at a time.
#define MATMUL_DOT                                                                       \
    for (uint c0 = lane; c0 < nch; c0 += UNROLL * LANES) {                               \
        WVEC wq[MAX_UNROLL * MAX_RPT];                                                   \
        GU(WVEC uq[MAX_UNROLL * MAX_RPT];)                                               \
        LOAD_CHUNKS                                                                      \
        FOR_V(CHUNK_STEP)                                                                \
    }
// Load chunk c0 + v * LANES of every row (the last chunk again past the end, unused) ...
#ifndef QUANT
#define LOAD_CHUNKS                                                                      \
    if (wvec) {                                                                          \
        FOR_V(FOR_R(LOAD_VEC))                                                           \
    } else {                                                                             \
        FOR_V(FOR_R(LOAD_ANY))                                                           \
    }
#else
#define LOAD_CHUNKS FOR_V(FOR_R(LOAD_ANY))
#endif
#define LOAD_VEC                                                                         \
    if (v < UNROLL && r < RPT) {                                                         \
        uint c = min(c0 + v * LANES, nch - 1u);                                          \
        wq[v * MAX_RPT + r] = w4[(wo + wrow[r]) / CHUNK + c];                            \
        GU(uq[v * MAX_RPT + r] = u4[(uo + wrow[r]) / CHUNK + c];)                        \
    }
#define LOAD_ANY                                                                         \
    if (v < UNROLL && r < RPT) {                                                         \
        uint e = min(c0 + v * LANES, nch - 1u) * CHUNK;                                  \
        wq[v * MAX_RPT + r] = LOAD_W(wo + wrow[r], e);                                   \
        GU(uq[v * MAX_RPT + r] = LOAD_U(uo + wrow[r], e);)                               \
    }
// ... then use them: chunk v, token i, row r, element q, in the order of common.glsl for
// each accumulator.
#define CHUNK_STEP                                                                       \
    if (v < UNROLL && c0 + v * LANES < nch) {                                            \
        uint e = (c0 + v * LANES) * CHUNK;                                               \
        float wv[MAX_RPT][CHUNK];                                                        \
        GU(float uv[MAX_RPT][CHUNK];)                                                    \
        FOR_R(UNPACK)                                                                    \
        FOR_I(TOKEN)                                                                     \
    }
#define UNPACK                                                                           \
    unpack(wq[v * MAX_RPT + r], wv[r]);                                                  \
    GU(unpack(uq[v * MAX_RPT + r], uv[r]);)
// Inputs e .. e + CHUNK - 1 of token i, element q in xq[q / 4][q % 4] (vec4 loads where
// aligned, XV, else one by one).
#define TOKEN                                                                            \
    vec4 xq[CHUNK / 4u];                                                                 \
    if (XV) {                                                                            \
        FOR_Q(X_VEC)                                                                     \
    } else {                                                                             \
        FOR_Q(X_SCALAR)                                                                  \
    }                                                                                    \
    FOR_R(ROW)
#define X_VEC                                                                            \
    if (q % 4u == 0u) {                                                                  \
        xq[q / 4u] = XIN4((xb[i] + e + q) >> 2);                                         \
    }
#define X_SCALAR xq[q / 4u][q % 4u] = XIN(xb[i] + e + q);
#define ROW                                                                              \
    if (r < RPT) {                                                                       \
        FOR_Q(MAC)                                                                       \
    }
#define MAC                                                                              \
    acc[ACC(0u, r, i)] = fma(wv[r][q], xq[q / 4u][q % 4u], acc[ACC(0u, r, i)]);          \
    GU(acc[ACC(1u, r, i)] = fma(uv[r][q], xq[q / 4u][q % 4u], acc[ACC(1u, r, i)]);)
#endif

#ifdef EMBED
// Embedding lookup: out[t][j] = W[route_u[map_off + t] - x_off][j] for the m tokens whose
// ids fall in the bound rows x_off .. x_off + rows - 1 (a large table is bound in several
// row ranges, one dispatch each). Workgroup y is token t; invocation x widens or
// dequantises chunk x of its row (the last one the tail of a row of a float type).
#define EMBED_STORE ACT(o + q) = v[q];
void main() {
    uint row = route_u[pc.map_off + gl_WorkGroupID.y] - pc.x_off;
    uint c = gl_GlobalInvocationID.x;
    uint nch = pc.cols / CHUNK;
    if (row >= pc.rows || c > nch) {
        return;
    }
    uint base = pc.w_off + row * ROW_UNITS;
    uint o = pc.out_off + gl_WorkGroupID.y * pc.out_stride + c * CHUNK;
    if (c < nch) {
        float v[CHUNK];
        unpack(LOAD_W(base, c * CHUNK), v);
        FOR_Q(EMBED_STORE)
    }
#ifndef QUANT
    for (uint e = nch * CHUNK; c == nch && e < pc.cols; e++) {
        ACT(o + e - nch * CHUNK) = WS(base + e);
    }
#endif
}
#else
#ifdef FRONT
// The m=1 gate/up of workgroup `wg` over the ranked experts (main below).
void matmul_wg(uvec2 wg) {
#define WG wg
#else
void main() {
#define WG gl_WorkGroupID
#endif
    // Lane numbering follows subgroups, so lanes l and l ^ s (s < subgroup size) of a
    // lane group are in one subgroup.
    uint f = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;
    uint lane = f % LANES;
    uint grp = f / LANES;
    // FLAG_COMBINE: the workgroup's lane groups share its rows, one table entry each.
    bool comb = TB == 1 && (pc.flags & FLAG_COMBINE) != 0u;
    uint rowb = comb ? WG.x * RPT : (WG.x * (WG_SIZE / LANES) + grp) * RPT;
#ifdef FRONT
    // Rank y's expert, one pair; no pair where the tier buffer does not hold it (a step
    // the host voids).
    bool held = rank_order[WG.y] < pc.ne && rank_slot[WG.y].x == 0u;
    uvec3 entry = held ? uvec3(rank_slot[WG.y].y, WG.y, 1u) : uvec3(0u, WG.y, 0u);
#else
    uvec3 entry = table_entry(comb ? grp : WG.y);
#endif
    uint delta = entry.x / UNIT_BYTES;
    uint p0 = entry.y;
    uint n = entry.z;
    uint wo = pc.w_off + delta;
    uint uo = pc.w2_off + delta;
    uint nch = pc.cols / CHUNK;
#ifndef QUANT
    bool wvec = pc.cols % CHUNK == 0u && wo % CHUNK == 0u && uo % CHUNK == 0u;
#endif
    bool xvec = pc.x_off % 4u == 0u && pc.x_stride % 4u == 0u;
    // Loops over the specialization constants run to their compile-time bounds (FOR_X),
    // with the constants as guards.
    uint wrow[MAX_RPT];
#define WROW wrow[r] = min(rowb + min(r, RPT - 1u), pc.rows - 1u) * ROW_UNITS;
    FOR_R(WROW)

    // A combining workgroup makes one pass whatever its entries' counts (an expert the
    // buffer does not hold has count 0, only in a step the host voids), so every lane
    // group meets its barriers.
#if TB == 1
    uint t_lo = 0u;
    uint t_hi = comb ? 1u : n;
#else
    // Workgroup row y of a token-split product takes its span of the tokens (each
    // product's order is the same whichever workgroup forms it).
    uint t_lo = pc.span == 0u ? 0u : WG.y * pc.span;
    uint t_hi = pc.span == 0u ? n : min(n, t_lo + pc.span);
#endif
    for (uint t0 = t_lo; t0 < t_hi; t0 += TB) {
        precise float acc[NA];
#define ZERO acc[a] = 0.0;
        FOR_A(ZERO)
        uint xb[TB];
#define XB xb[i] = pc.x_off + x_row(p0 + min(t0 + i, n - 1u)) * pc.x_stride;
        FOR_I(XB)
        // The input loads' alignment test sits outside the loops (the dot product is
        // written twice, with XV a constant), so no branch separates a token's loads from
        // the previous token's products.
        if (xvec) {
#define XV true
            MATMUL_DOT
#undef XV
        } else {
#define XV false
            MATMUL_DOT
#undef XV
        }
#ifndef QUANT
        if (lane == 0u) {
            for (uint e = nch * CHUNK; e < pc.cols; e++) {
#define TAIL_ROW                                                                         \
    if (r < RPT) {                                                                       \
        float we = WS(wo + wrow[r] + e);                                                 \
        GU(float ue = US(uo + wrow[r] + e);)                                             \
        FOR_I(TAIL_MAC)                                                                  \
    }
#define TAIL_MAC                                                                         \
    float xe = XIN(xb[i] + e);                                                           \
    acc[ACC(0u, r, i)] = fma(we, xe, acc[ACC(0u, r, i)]);                                \
    GU(acc[ACC(1u, r, i)] = fma(ue, xe, acc[ACC(1u, r, i)]);)
                FOR_R(TAIL_ROW)
            }
        }
#endif
        // The fixed tree of common.glsl: strides of at least the subgroup size through
        // shared memory, smaller ones by butterfly shuffles (the same sums in lane 0, and
        // in every lane of the lane group's first subgroup: the tail below relies on it).
        // The shared strides take one row of the lane group at a time (a row's accumulators
        // fill red), so the batched kernels' red stays one row's size whatever their rows.
        uint s = LANES / 2u;
        if (gl_SubgroupSize < LANES) {
#define TO_SHARED red[ra * WG_SIZE + f] = acc[a];
#define TREE_SHARED                                                                      \
    precise float t = red[ra * WG_SIZE + f] + red[ra * WG_SIZE + f + h];                 \
    red[ra * WG_SIZE + f] = t;
#define FROM_SHARED acc[a] = red[ra * WG_SIZE + f];
#define ROW_TREE                                                                         \
    if (r < RPT) {                                                                       \
        FOR_KI(TO_SHARED)                                                                \
        barrier();                                                                       \
        for (uint h = LANES / 2u; h >= gl_SubgroupSize; h >>= 1u) {                      \
            if (lane < h) {                                                              \
                FOR_KI(TREE_SHARED)                                                      \
            }                                                                            \
            barrier();                                                                   \
        }                                                                                \
        FOR_KI(FROM_SHARED)                                                              \
        barrier();                                                                       \
    }
            FOR_R(ROW_TREE)
            s = gl_SubgroupSize / 2u;
        }
        for (; s > 0u; s >>= 1u) {
#define TREE_SHUFFLE acc[a] = acc[a] + subgroupShuffleXor(acc[a], s);
            FOR_A(TREE_SHUFFLE)
        }
#if TB == 1
        if (comb) {
            // Each entry's rows at its rank (red is free: the tree above ends with a
            // barrier where it used it), 0 for an expert the table's buffer does not hold
            // (count 0: a step the host voids, whose sums stay finite), then the combine
            // of row rowb + f.
            if (lane == 0u) {
                uint rank = min(out_row(p0), WG_SIZE / LANES - 1u);
                FOR_R(if (r < RPT) { red[rank * RPT + r] = n > 0u ? acc[ACC(0u, r, 0u)] : 0.0; })
            }
            barrier();
            uint row = rowb + f;
            if (f < RPT && row < pc.rows) {
                uint xi = pc.out_off + row;
                float res = ACT(xi);
                precise float a = 0.0;
                for (uint r = 0u; r < WG_SIZE / LANES; r++) {
                    a = a + red[r * RPT + f] * ROUTE_F(pc.wt_off + r);
                }
                precise float x = res + a;
                ACT(xi) = x;
            }
            continue;
        }
#endif
        // After the tree every lane of the lane group's first subgroup holds every sum, so
        // its lanes finish the pass's outputs in parallel: lane j takes outputs j, j + sw,
        // ... (output r·TB + i is row r, token i), picked from the accumulators by
        // compile-time indices, then the SiLU product and the store (the same operations
        // on the same sums whichever lane does them, so the same bytes).
        uint sw = min(gl_SubgroupSize, LANES);
        for (uint o = lane; lane < sw && o < RPT * TB; o += sw) {
            float val = 0.0;
            GU(float up = 0.0;)
#define PICK                                                                             \
    if (r < RPT && r * TB + i == o) {                                                    \
        val = acc[ACC(0u, r, i)];                                                        \
        GU(up = acc[ACC(1u, r, i)];)                                                     \
    }
            FOR_R(FOR_I(PICK))
            uint row = rowb + o / TB;
            uint i = o % TB;
            if (row < pc.rows && t0 + i < n) {
                GU(precise float hv = silu(val) * up; val = hv;)
                store_out(out_at(row) + out_row(p0 + t0 + i) * pc.out_stride, val);
            }
        }
    }
}

#ifdef FRONT
#include "router.glsl"

// NORM_IN: the RMSNorm of the residual row (pc.cols inputs at x_off) into norm_x4, in
// rmsnorm.comp's order whatever this workgroup's size: its 256 invocations' chains
// (chain c adds the squares of inputs c, c + 256, ... in order), its tree over them, its
// scale (rms_scale), then w · (x · r) per input; `first` also stores the row at norm_out.
void norm_in(uint tid, bool first) {
    uint n = pc.cols;
    for (uint c = tid; c < NORM_CHAINS; c += WG_SIZE) {
        precise float ss = 0.0;
        for (uint i = c; i < n; i += NORM_CHAINS) {
            float v = ACT(pc.x_off + i);
            ss = ss + v * v;
        }
        red[c] = ss;
    }
    barrier();
    for (uint s = NORM_CHAINS / 2u; s > 0u; s >>= 1u) {
        for (uint c = tid; c < s; c += WG_SIZE) {
            precise float t = red[c] + red[c + s];
            red[c] = t;
        }
        barrier();
    }
    float r = rms_scale(red[0], n, pc.eps);
    for (uint i = tid; i < n; i += WG_SIZE) {
        precise float o = nw[i] * (ACT(pc.x_off + i) * r);
        norm_x4[i >> 2][i & 3u] = o;
        if (first) {
            ACT(pc.norm_out + i) = o;
        }
    }
    // Every invocation has read red[0] and the row is whole before anyone goes on.
    barrier();
}

void main() {
    uint tid = gl_LocalInvocationIndex;
    uint nwg = gl_NumWorkGroups.x;
    bool first = gl_WorkGroupID.x == 0u;
    if (NORM_IN != 0u) {
        norm_in(tid, first);
    }
    router_rows(gl_WorkGroupID.x, nwg);
    bool met = grid_barrier(tid);
    if (!met && tid == 0u) {
        io[pc.io_out + pc.ne + pc.k + 1u] = 1.0;
    }
    rank_token(pc.logits, pc.ne, pc.k, pc.ranks, pc.norm != 0u, first, pc.slot_off, tid, WG_SIZE);
    if (first) {
        rank_tables(pc.tab_out, pc.io_out, pc.ne, pc.k, pc.ranks, 1u, tid, WG_SIZE);
    }
    // The gate/up's workgroups (x, y): x over its rows, y over the k ranks.
    uint gx = (pc.rows + WG_SIZE / LANES * RPT - 1u) / (WG_SIZE / LANES * RPT);
    for (uint v = gl_WorkGroupID.x; v < gx * pc.k; v += nwg) {
        matmul_wg(uvec2(v % gx, v / gx));
    }
}
#endif
#endif
