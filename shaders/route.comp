#version 450
// The router's ranking on the device, one token per workgroup (workgroup y = token):
// the softmax of the token's gate logits, then its `ranks` most probable experts in
// descending probability (equal probabilities to the lower index, as
// actors/src/router/rank.rs ranks them), the first k with their probabilities as
// weights, renormalised (summed in rank order, then divided) when `norm` is set.
// A row's result depends only on its logits, never on the rows dispatched with it, so a
// token ranks the same in a decode step and in a prefill block.
//
// Output, token t at `out_off + t * out_stride` of the arena: the ranked experts'
// indices (as float bits) at 0 .. ranks, the top-k weights at `ne .. ne + k`.
// NaN logits are not ranked (a row of them ranks no expert: index NONE).
//
// With TABLE (`route_table`, one token: a decode step whose experts the VRAM tier may
// hold, actors/src/vulkan/device_route.rs) it also writes, from the tier's slot of each
// expert (`slots`, written by the host), the routing words with which the expert kernels
// read the tier's buffers directly, into the routing buffer at `tab_out`, their indirect
// dispatch sizes into `sizes`, and its output row into the host's readback buffer `io`
// at `io_out` (rank.glsl's `rank_tables` gives the layouts): no copy follows it.
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#include "common.glsl"

layout(local_size_x = 256) in;

layout(push_constant) uniform Params {
    uint ne;          // experts
    uint k;           // experts per token
    uint ranks;       // experts ranked (k, or k + bets)
    uint norm;        // renormalise the top-k weights
    uint in_off;      // act offset of token 0's logits (rows ne apart)
    uint out_off;     // act offset of token 0's output
    uint out_stride;  // act elements between tokens' outputs
#ifdef TABLE
    uint slot_off;    // slots offset of this layer's first expert
    uint buffers;     // tier buffers that may hold the layer's experts
    uint tab_out;     // routing-buffer offset of the routing words
    uint gu_groups;   // workgroups (x) of one gate/up dispatch
    uint down_groups; // workgroups (x) of one down dispatch
    uint io_out;      // io offset of the output row's copy
#endif
} pc;

#ifdef TABLE
// Per expert of every layer: (tier buffer of its slot or NONE, byte offset in it).
layout(set = 0, binding = 0) readonly buffer Slots { uint slots[]; };
// Per tier buffer, the indirect dispatch sizes: gate/up (x, n, 1), then down (x, n, 1).
layout(set = 0, binding = 1) buffer Sizes { uint sizes[]; };
// The host's readback buffer.
layout(set = 0, binding = 2) buffer Io { float io[]; };
#endif

#define MAX_E 1024u
#define MAX_RANKS MAX_E
#define ACT(i) act[i]
#ifdef TABLE
#define RANK_SLOTS
#define RANK_SIZES
#endif
#include "rank.glsl"

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint t = gl_WorkGroupID.y;
    uint src = pc.in_off + t * pc.ne;
    uint dst = pc.out_off + t * pc.out_stride;
#ifdef TABLE
    uint slot_off = pc.slot_off;
#else
    uint slot_off = 0u;
#endif
    rank_token(src, pc.ne, pc.k, pc.ranks, pc.norm != 0u, true, slot_off, tid, WG_SIZE);
    for (uint r = tid; r < pc.ranks; r += WG_SIZE) {
        act[dst + r] = uintBitsToFloat(rank_order[r]);
    }
    for (uint r = tid; r < pc.k; r += WG_SIZE) {
        act[dst + pc.ne + r] = rank_wts[r];
    }
#ifdef TABLE
    // (The arena's copy of the row stays: it is the arena write vulkano's start-up check
    // needs to see.)
    uint misses = rank_tables(pc.tab_out, pc.io_out, pc.ne, pc.k, pc.ranks, pc.buffers, tid, WG_SIZE);
    if (tid == 0u) {
        act[dst + pc.ne + pc.k] = uintBitsToFloat(misses);
    }
#endif
}
