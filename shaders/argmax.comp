#version 450
// The greedy choice of a logits row on the device: the index of its largest value, ties
// to the lower index, NaNs never chosen unless the first value is one (then 0), exactly
// as actors/src/sampler.rs's `argmax` picks it. Values are compared by an integer key of
// their bits (order-preserving, +0 and −0 equal), so no driver's float compare or
// denormal handling can change the choice.
// - `argmax` (workgroup b): the best (key, index) of values b·BLOCK ..< (b + 1)·BLOCK,
//   written as two words at part_off + 2b of the arena (index NONE: only NaNs).
// - `argmax_final` (FINAL, one workgroup): the best of the blocks' pairs, its index written
//   to the host's readback buffer at io_out (and over the first pair's key).
// Any reduction order gives the same pair: (larger key, then lower index) is a total order.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256) in;

layout(push_constant) uniform Params {
    uint n;         // values in the row
    uint in_off;    // act offset of the row
    uint part_off;  // act offset of the blocks' pairs (2 words each)
    uint blocks;    // ceil(n / BLOCK)
    uint io_out;    // io offset of the chosen index (FINAL)
} pc;

#ifdef FINAL
layout(set = 0, binding = 0) buffer Io { float io[]; };
#endif

#define BLOCK 1024u
#define NONE 0xFFFFFFFFu

shared uint keys[WG_SIZE];
shared uint idx[WG_SIZE];

// Order-preserving key of a non-NaN value's bits (both zeros map to one key).
uint key_of(uint b) {
    if ((b & 0x7FFFFFFFu) == 0u) {
        return 0x80000000u;
    }
    return (b & 0x80000000u) != 0u ? ~b : b | 0x80000000u;
}

bool is_nan(uint b) {
    return (b & 0x7FFFFFFFu) > 0x7F800000u;
}

// Whether (kb, ib) beats (ka, ia); index NONE is no candidate.
bool beats(uint kb, uint ib, uint ka, uint ia) {
    if (ib == NONE) {
        return false;
    }
    return ia == NONE || kb > ka || (kb == ka && ib < ia);
}

// Keeps (k, i) in the running best (bk, bi).
#define KEEP(k, i) if (beats(k, i, bk, bi)) { bk = k; bi = i; }

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint bk = 0u, bi = NONE;
#ifdef FINAL
    bool first_nan = is_nan(floatBitsToUint(act[pc.in_off]));
    for (uint b = tid; b < pc.blocks; b += WG_SIZE) {
        uint k = floatBitsToUint(act[pc.part_off + 2u * b]);
        uint i = floatBitsToUint(act[pc.part_off + 2u * b + 1u]);
        KEEP(k, i)
    }
#else
    uint base = gl_WorkGroupID.x * BLOCK;
    // Four values an invocation, all requested at once.
    uint v[4];
    FOR4(u, v[u] = base + WG_SIZE * u + tid < pc.n ? floatBitsToUint(act[pc.in_off + base + WG_SIZE * u + tid]) : 0u;)
    FOR4(u, if (base + WG_SIZE * u + tid < pc.n && !is_nan(v[u])) {
        uint k = key_of(v[u]);
        uint i = base + WG_SIZE * u + tid;
        KEEP(k, i)
    })
#endif
    keys[tid] = bk;
    idx[tid] = bi;
    barrier();
    for (uint s = WG_SIZE / 2u; s > 0u; s >>= 1u) {
        if (tid < s) {
            uint k = keys[tid + s], i = idx[tid + s];
            bk = keys[tid];
            bi = idx[tid];
            KEEP(k, i)
            keys[tid] = bk;
            idx[tid] = bi;
        }
        barrier();
    }
    if (tid == 0u) {
#ifdef FINAL
        uint choice = first_nan || idx[0] == NONE ? 0u : idx[0];
        io[pc.io_out] = uintBitsToFloat(choice);
        // Also over the first pair (read by now): the arena write vulkano's start-up
        // check needs to see.
        act[pc.part_off] = uintBitsToFloat(choice);
#else
        act[pc.part_off + 2u * gl_WorkGroupID.x] = uintBitsToFloat(keys[0]);
        act[pc.part_off + 2u * gl_WorkGroupID.x + 1u] = uintBitsToFloat(idx[0]);
#endif
    }
}
