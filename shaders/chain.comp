#version 450
// Dependent-dispatch experiment for the benchmarks (`vulkan chain`): a chain of m=1 f32
// matvecs (2048 columns), each reading the previous one's output. Between two links the
// dependency is either a pipeline barrier (the executor's way) or, with no barrier
// recorded, a completion count in device memory: each workgroup of a link adds 1 to its
// link's count after its output is written (made visible first), and each workgroup of
// the next link waits until the count reaches the previous link's workgroup count before
// reading its input. With MODE_EARLY a workgroup loads its weight rows into registers
// before it waits, so the next link's weight reads overlap the previous link's tail. This
// relies on the device launching a later dispatch's workgroups only after all of an
// earlier one's (no Vulkan guarantee): a measurement, not an executor path.
// MODE_NULL links return at once: a chain of them prices a dependent dispatch of G
// workgroups with no work in it (a decode step's nulled kernels cost ~4.6 µs each in situ
// at full clock).
// MODE_PERSIST runs a whole chain in one dispatch of G workgroups (all resident at once:
// G is small), each taking its share of every link's rows in turn and then meeting the
// others at a grid barrier (a count per link in device memory, polled by an atomic add
// of 0, or with MODE_POLL_LOAD by an acquiring atomic load, which does not write the
// line every workgroup polls) — what a layer fused into one dispatch would pay per
// dependent step; with MODE_EARLY a workgroup loads its first rows of the next link
// before it waits. Links alternate between the inputs at in_off and those at out_off.
// Vulkan does not promise that the workgroups of one dispatch run concurrently, so the
// poll gives up after 2^24 tries (a wrong result, never a hang): a measurement, not an
// executor path.
// MODE_NORM and MODE_NORM_ONLY measure an RMSNorm of each link's input folded into the
// matvec (every subgroup forms it alone, in the same order) against a separate dispatch
// of one workgroup that writes it (the executor's way), both ordered by barriers.
// A row's dot product (and the norm's sum) is one subgroupAdd over its 32 lanes: the
// values are true products on 32-wide subgroups (NVIDIA); elsewhere (lavapipe) they are
// partial sums, the same for every ordering, so the byte checks and timings still hold.
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_KHR_memory_scope_semantics : require
#include "common.glsl"

layout(local_size_x = 128) in;

// Weights: link matrices of rows x 2048 f32, row-major, one after another.
layout(set = 0, binding = 0) readonly buffer W { vec4 w4[]; };
// Inputs and outputs of the links (read and written coherently: another workgroup wrote
// them without a barrier in between).
layout(set = 0, binding = 1) coherent buffer Io { float io[]; };
// Completion counts, one per link.
layout(set = 0, binding = 2) coherent buffer Counts { uint counts[]; };
// The RMSNorm weights (2048).
layout(set = 0, binding = 3) readonly buffer Nw { vec4 nw4[]; };

layout(push_constant) uniform Params {
    uint rows;     // output rows (one subgroup of 32 lanes per row, 4 per workgroup)
    uint w_off4;   // vec4 offset of this link's matrix
    uint in_off;   // io offset of the 2048 inputs (MODE_PERSIST: the first link's)
    uint out_off;  // io offset of the outputs (MODE_PERSIST: the first link's)
    uint wait_idx; // count to wait on (MODE_PERSIST: the first link's count)
    uint wait_for; // value it must reach (the previous link's workgroups; MODE_PERSIST: G)
    uint sig_idx;  // count this link adds to (MODE_PERSIST: the links)
    uint mode;     // MODE_* bits
} pc;

#define MODE_WAIT 1u  // wait on counts[wait_idx] (else a barrier orders the links)
#define MODE_EARLY 2u // load the weights before waiting
#define MODE_NORM 4u  // RMSNorm the input (every subgroup alone) before the product
#define MODE_NORM_ONLY 8u // write the RMSNorm of the input instead (one workgroup)
#define MODE_PERSIST 16u  // the whole chain in one dispatch, grid barriers between links
#define MODE_POLL_LOAD 32u // MODE_PERSIST polls by an atomic load
#define MODE_NULL 64u // the link does nothing (what launching its workgroups costs)
#define COLS4 512u    // vec4s per row (2048 columns)

// Shared memory a link declares and never uses (specialization constant 0: floats; 1 by
// default): `vulkan chain`'s footprint orderings alternate links of different footprints,
// which makes the driver change how an SM splits its L1 and shared memory between them.
layout(constant_id = 0) const uint PAD = 1u;
shared float pad[PAD];

void io4_write(uint e, vec4 v) {
    io[e] = v.x;
    io[e + 1u] = v.y;
    io[e + 2u] = v.z;
    io[e + 3u] = v.w;
}

// This invocation's 16 weight chunks of row `row` (clamped to the last) of the matrix at
// vec4 offset w_off4.
void load_weights(uint w_off4, uint row, uint rows, out vec4 wv[16]) {
    uint base = w_off4 + min(row, rows - 1u) * COLS4 + gl_LocalInvocationID.x % 32u;
    FOR16(c, wv[c] = w4[base + 32u * c];)
}

// This invocation's 16 input chunks at io offset in_off.
void load_inputs(uint in_off, out vec4 xv[16]) {
    uint lane = gl_LocalInvocationID.x % 32u;
    FOR16(c, {
        uint e = in_off + 4u * (32u * c + lane);
        xv[c] = vec4(io[e], io[e + 1u], io[e + 2u], io[e + 3u]);
    })
}

// Row `row`'s product (one subgroupAdd over its 32 lanes), stored at out_off + row.
void store_product(vec4 wv[16], vec4 xv[16], uint row, uint rows, uint out_off) {
    precise float s = 0.0;
    FOR16(c, s = s + dot(wv[c], xv[c]);)
    s = subgroupAdd(s);
    if (row < rows && gl_LocalInvocationID.x % 32u == 0u) {
        io[out_off + row] = s * (1.0 / 64.0);
    }
}

// The value of count `at`: by an acquiring atomic load with MODE_POLL_LOAD, else by an
// atomic add of 0 (a loop of plain loads, even `volatile` ones, did not wait on the H200:
// its chains' results differed from the barrier chain's).
uint count_at(uint at) {
    if ((pc.mode & MODE_POLL_LOAD) != 0u) {
        return atomicLoad(counts[at], gl_ScopeDevice, gl_StorageSemanticsBuffer, gl_SemanticsAcquire);
    }
    return atomicAdd(counts[at], 0u);
}

// MODE_PERSIST: workgroup g takes row groups g, g + G, ... of every link, then adds 1 to
// the link's count and waits for all G.
void persist() {
    uint sub = gl_LocalInvocationID.x / 32u;
    uint rows = pc.rows;
    uint groups = (rows + 3u) / 4u;
    uint g0 = gl_WorkGroupID.x;
    uint big = pc.wait_for;
    bool early = (pc.mode & MODE_EARLY) != 0u;
    vec4 wv[16];
    vec4 xv[16];
    bool loaded = false;
    for (uint i = 0u; i < pc.sig_idx; i++) {
        uint in_off = i % 2u == 0u ? pc.in_off : pc.out_off;
        uint out_off = i % 2u == 0u ? pc.out_off : pc.in_off;
        // The link's inputs serve every row group this workgroup takes.
        load_inputs(in_off, xv);
        for (uint vg = g0; vg < groups; vg += big) {
            uint row = vg * 4u + sub;
            if (!loaded) {
                load_weights(i * rows * COLS4, row, rows, wv);
            }
            loaded = false;
            store_product(wv, xv, row, rows, out_off);
        }
        if (early && i + 1u < pc.sig_idx && g0 < groups) {
            // The next link's first rows, in flight during the wait.
            load_weights((i + 1u) * rows * COLS4, g0 * 4u + sub, rows, wv);
            loaded = true;
        }
        memoryBarrierBuffer();
        barrier();
        if (gl_LocalInvocationIndex == 0u) {
            uint at = pc.wait_idx + i;
            atomicAdd(counts[at], 1u);
            for (uint n = 0u; count_at(at) < big && n < (1u << 24); n++) {
            }
        }
        memoryBarrierBuffer();
        barrier();
    }
}

void main() {
    // Keeps `pad` declared: no dispatch has zero workgroups.
    if (gl_NumWorkGroups.x == 0u) {
        pad[gl_LocalInvocationIndex % PAD] = 1.0;
        io[pc.out_off] = pad[(gl_LocalInvocationIndex + 1u) % PAD];
    }
    if ((pc.mode & MODE_NULL) != 0u) {
        return;
    }
    if ((pc.mode & MODE_PERSIST) != 0u) {
        persist();
        return;
    }
    uint lane = gl_LocalInvocationID.x % 32u;
    uint row = gl_WorkGroupID.x * 4u + gl_LocalInvocationID.x / 32u;
    vec4 wv[16];
    if ((pc.mode & MODE_EARLY) != 0u) {
        load_weights(pc.w_off4, row, pc.rows, wv);
    }
    if ((pc.mode & MODE_WAIT) != 0u) {
        if (gl_LocalInvocationIndex == 0u) {
            while (count_at(pc.wait_idx) < pc.wait_for) {
            }
        }
        memoryBarrierBuffer();
        barrier();
    }
    if ((pc.mode & (MODE_EARLY | MODE_NORM_ONLY)) == 0u) {
        load_weights(pc.w_off4, row, pc.rows, wv);
    }
    vec4 xv[16];
    load_inputs(pc.in_off, xv);
    if ((pc.mode & (MODE_NORM | MODE_NORM_ONLY)) != 0u) {
        // An RMSNorm of the input, formed by every subgroup alone in the same order.
        precise float ss = 0.0;
        FOR16(c, ss = ss + dot(xv[c], xv[c]);)
        ss = subgroupAdd(ss);
        float r = inversesqrt(ss * (1.0 / 2048.0) + 1e-6);
        // `precise`: the products must not be fused into the dot product below, so that
        // a link reading them from memory gets the same bytes.
        FOR16(c, {
            precise vec4 y = nw4[32u * c + lane] * (xv[c] * r);
            xv[c] = y;
        })
    }
    if ((pc.mode & MODE_NORM_ONLY) != 0u) {
        // The normed input is the output: subgroup q of the workgroup writes its quarter.
        // (Tested per chunk so that xv is indexed by constants and stays in registers.)
        uint q = gl_LocalInvocationID.x / 32u;
        FOR16(c, if (c / 4u == q) { io4_write(pc.out_off + 4u * (32u * c + lane), xv[c]); })
    } else {
        store_product(wv, xv, row, pc.rows, pc.out_off);
    }
    memoryBarrierBuffer();
    barrier();
    if (gl_LocalInvocationIndex == 0u) {
        atomicAdd(counts[pc.sig_idx], 1u);
    }
}
