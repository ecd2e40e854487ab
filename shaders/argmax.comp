#version 450
// The greedy choice of a logits row on the device: the index of its largest value, ties
// to the lower index, NaNs never chosen unless the first value is one (then 0), exactly
// as actors/src/sampler.rs's `argmax` picks it. Values are compared by an integer key of
// their bits (order-preserving, +0 and −0 equal), so no driver's float compare or
// denormal handling can change the choice.
// Workgroup b finds the best (key, index) of values b·BLOCK ..< (b + 1)·BLOCK and writes
// it as two words at part_off + 2b of the arena (index NONE: only NaNs); the last
// workgroup to finish (counted at part_off + 2·blocks, which it resets to zero) picks the
// best of the blocks' pairs and writes its index to the host's readback buffer at io_out.
// Any reduction order gives the same pair: (larger key, then lower index) is a total order.
#extension GL_GOOGLE_include_directive : require
#define ACT_COHERENT
#include "common.glsl"

layout(local_size_x = 256) in;

layout(push_constant) uniform Params {
    uint n;         // values in the row
    uint in_off;    // act offset of the row
    uint part_off;  // act offset of the blocks' pairs (2 words each), then the count
    uint blocks;    // ceil(n / BLOCK)
    uint io_out;    // io offset of the chosen index
} pc;

layout(set = 0, binding = 0) buffer Io { float io[]; };
// The arena's words, for the count of finished blocks.
layout(set = 1, binding = 0) coherent buffer ActU { uint act_u[]; };

#define BLOCK 1024u
#define NONE 0xFFFFFFFFu

shared uint keys[WG_SIZE];
shared uint idx[WG_SIZE];
shared bool row_done;  // this workgroup counted the row's last block

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

// The best of the workgroup's running bests, into keys[0], idx[0].
void reduce(uint bk, uint bi) {
    uint tid = gl_LocalInvocationID.x;
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
}

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint bk = 0u, bi = NONE;
    uint base = gl_WorkGroupID.x * BLOCK;
    // Four values an invocation, all requested at once.
    uint v[4];
    FOR4(u, v[u] = base + WG_SIZE * u + tid < pc.n ? floatBitsToUint(act[pc.in_off + base + WG_SIZE * u + tid]) : 0u;)
    FOR4(u, if (base + WG_SIZE * u + tid < pc.n && !is_nan(v[u])) {
        uint k = key_of(v[u]);
        uint i = base + WG_SIZE * u + tid;
        KEEP(k, i)
    })
    reduce(bk, bi);
    // The block's pair, made visible before the block counts itself in: the workgroup
    // that counts the last block reads every pair.
    if (tid == 0u) {
        act[pc.part_off + 2u * gl_WorkGroupID.x] = uintBitsToFloat(keys[0]);
        act[pc.part_off + 2u * gl_WorkGroupID.x + 1u] = uintBitsToFloat(idx[0]);
        memoryBarrierBuffer();
        uint at = pc.part_off + 2u * pc.blocks;
        row_done = atomicAdd(act_u[at], 1u) + 1u == pc.blocks;
        if (row_done) {
            atomicExchange(act_u[at], 0u);
        }
    }
    barrier();
    if (!row_done) {
        return;
    }
    memoryBarrierBuffer();
    bool first_nan = is_nan(floatBitsToUint(act[pc.in_off]));
    bk = 0u;
    bi = NONE;
    for (uint b = tid; b < pc.blocks; b += WG_SIZE) {
        uint k = floatBitsToUint(act[pc.part_off + 2u * b]);
        uint i = floatBitsToUint(act[pc.part_off + 2u * b + 1u]);
        KEEP(k, i)
    }
    reduce(bk, bi);
    if (tid == 0u) {
        io[pc.io_out] = uintBitsToFloat(first_nan || idx[0] == NONE ? 0u : idx[0]);
    }
}
