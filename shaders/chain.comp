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
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#include "common.glsl"

layout(local_size_x = 128) in;

// Weights: link matrices of rows x 2048 f32, row-major, one after another.
layout(set = 0, binding = 0) readonly buffer W { vec4 w4[]; };
// Inputs and outputs of the links (read and written coherently: another workgroup wrote
// them without a barrier in between).
layout(set = 0, binding = 1) coherent buffer Io { float io[]; };
// Completion counts, one per link.
layout(set = 0, binding = 2) coherent buffer Counts { uint counts[]; };

layout(push_constant) uniform Params {
    uint rows;     // output rows (one subgroup of 32 lanes per row, 4 per workgroup)
    uint w_off4;   // vec4 offset of this link's matrix
    uint in_off;   // io offset of the 2048 inputs
    uint out_off;  // io offset of the outputs
    uint wait_idx; // count to wait on
    uint wait_for; // value it must reach (the previous link's workgroups)
    uint sig_idx;  // count this link adds to
    uint mode;     // MODE_* bits
} pc;

#define MODE_WAIT 1u  // wait on counts[wait_idx] (else a barrier orders the links)
#define MODE_EARLY 2u // load the weights before waiting
#define COLS4 512u    // vec4s per row (2048 columns)

void main() {
    uint lane = gl_LocalInvocationID.x % 32u;
    uint row = gl_WorkGroupID.x * 4u + gl_LocalInvocationID.x / 32u;
    bool live = row < pc.rows;
    uint base = pc.w_off4 + min(row, pc.rows - 1u) * COLS4 + lane;
    vec4 wv[16];
    if ((pc.mode & MODE_EARLY) != 0u) {
        FOR16(c, wv[c] = w4[base + 32u * c];)
    }
    if ((pc.mode & MODE_WAIT) != 0u) {
        if (gl_LocalInvocationIndex == 0u) {
            // Polled by an atomic: a loop of plain loads (even `volatile` ones) did not
            // wait on the H200 (its chains' results differed from the barrier chain's).
            while (atomicAdd(counts[pc.wait_idx], 0u) < pc.wait_for) {
            }
        }
        memoryBarrierBuffer();
        barrier();
    }
    if ((pc.mode & MODE_EARLY) == 0u) {
        FOR16(c, wv[c] = w4[base + 32u * c];)
    }
    precise float s = 0.0;
    FOR16(c, {
        uint e = pc.in_off + 4u * (32u * c + lane);
        vec4 x = vec4(io[e], io[e + 1u], io[e + 2u], io[e + 3u]);
        s = s + dot(wv[c], x);
    })
    s = subgroupAdd(s);
    if (live && lane == 0u) {
        io[pc.out_off + row] = s * (1.0 / 64.0);
    }
    memoryBarrierBuffer();
    barrier();
    if (gl_LocalInvocationIndex == 0u) {
        atomicAdd(counts[pc.sig_idx], 1u);
    }
}
