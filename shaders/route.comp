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
// at `io_out` (layout at the end of `main`): no copy follows it.
#extension GL_GOOGLE_include_directive : require
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
#define NONE 0xFFFFFFFFu
shared float p[MAX_E];
shared float redf[WG_SIZE];
shared uint order[MAX_E];  // the expert of each rank
shared float wts[MAX_E];   // the top-k weights
#ifdef TABLE
shared uint slot_buf[MAX_E];  // per expert: its slot's tier buffer (NONE: none)
shared uint slot_at[MAX_E];   // and byte offset there
#endif

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint t = gl_WorkGroupID.y;
    uint src = pc.in_off + t * pc.ne;
    uint dst = pc.out_off + t * pc.out_stride;
#ifdef TABLE
    // Every expert's tier slot (e = tid + 256u, ne <= 1024) is requested first, so the
    // read of the host-written table overlaps the softmax and the ranking.
    uint sb[4], sa[4];
    FOR4(u, if (tid + WG_SIZE * u < pc.ne) {
        uint at = 2u * (pc.slot_off + tid + WG_SIZE * u);
        sb[u] = slots[at];
        sa[u] = slots[at + 1u];
    })
#endif

    float mx = -1.0 / 0.0;
    for (uint e = tid; e < pc.ne; e += WG_SIZE) {
        mx = max(mx, act[src + e]);
    }
    redf[tid] = mx;
    barrier();
    for (uint s = WG_SIZE / 2u; s > 0u; s >>= 1u) {
        if (tid < s) {
            redf[tid] = max(redf[tid], redf[tid + s]);
        }
        barrier();
    }
    float gmax = redf[0];
    barrier();

    precise float sum = 0.0;
    for (uint e = tid; e < pc.ne; e += WG_SIZE) {
        precise float v = expf_(act[src + e] - gmax);
        p[e] = v;
        sum = sum + v;
    }
    redf[tid] = sum;
    barrier();
    for (uint s = WG_SIZE / 2u; s > 0u; s >>= 1u) {
        if (tid < s) {
            precise float r = redf[tid] + redf[tid + s];
            redf[tid] = r;
        }
        barrier();
    }
    float gsum = redf[0];
    barrier();
    for (uint e = tid; e < pc.ne; e += WG_SIZE) {
        precise float q = p[e] / gsum;
        p[e] = q;
    }
    barrier();

    // Rank r is the expert with r experts before it in (probability descending, index
    // ascending) order, NaN probabilities unranked: each expert counts the experts
    // before it, all at once (one barrier, where taking them one at a time needed a
    // reduction tree per rank), and ranks with no expert stay NONE.
    for (uint r = tid; r < pc.ranks; r += WG_SIZE) {
        order[r] = NONE;
    }
    barrier();
    for (uint e = tid; e < pc.ne; e += WG_SIZE) {
        float pe = p[e];
        if (!(pe >= 0.0)) {
            continue; // NaN
        }
        uint before = 0u;
        for (uint f = 0u; f < pc.ne; f++) {
            float pf = p[f];
            before += (pf > pe || (pf == pe && f < e)) ? 1u : 0u;
        }
        if (before < pc.ranks) {
            order[before] = e;
        }
    }
#ifdef TABLE
    FOR4(u, if (tid + WG_SIZE * u < pc.ne) {
        slot_buf[tid + WG_SIZE * u] = sb[u];
        slot_at[tid + WG_SIZE * u] = sa[u];
    })
#endif
    barrier();
    // The top-k weights (summed in rank order, then divided), then the outputs, written
    // in parallel.
    if (tid == 0u) {
        precise float wsum = 0.0;
        for (uint r = 0u; r < pc.k; r++) {
            uint best = order[r];
            float w = best < pc.ne ? p[best] : -1.0;
            wts[r] = w;
            wsum = wsum + w;
        }
        if (pc.norm != 0u) {
            for (uint r = 0u; r < pc.k; r++) {
                precise float q = wts[r] / wsum;
                wts[r] = q;
            }
        }
    }
    barrier();
    for (uint r = tid; r < pc.ranks; r += WG_SIZE) {
        act[dst + r] = uintBitsToFloat(order[r]);
    }
    for (uint r = tid; r < pc.k; r += WG_SIZE) {
        act[dst + pc.ne + r] = wts[r];
    }
#ifdef TABLE
    // The routing words of a decode step whose experts are read in the tier's buffers,
    // at tab_out of the routing buffer (offsets relative to it):
    //   0 .. k:              the pair list (pair r is token 0's rank r)
    //   k .. 2k:             the routing weights (as above, as float bits)
    //   2k + 3k·b ..:        tier buffer b's expert table, k entries of (byte offset,
    //                        first pair, 1 pair), its experts first (in rank order),
    //                        then (0, first pair, 0 pairs) for each routed expert it
    //                        does not hold
    // buffer b's dispatch sizes at 6b of `sizes` (n = its experts), the count of routed
    // experts the tier does not hold at ne + k of the output row (then the step is void:
    // the caller runs it again host-routed), and the output row's ranks, weights and
    // misses at io_out of `io`. Thread b writes buffer b's table. (The arena's copy of
    // the row stays: it is the arena write vulkano's start-up check needs to see.)
    uint o = pc.tab_out;
    for (uint r = tid; r < pc.k; r += WG_SIZE) {
        route_u[o + r] = r;
        route_u[o + pc.k + r] = floatBitsToUint(wts[r]);
        io[pc.io_out + pc.ne + r] = wts[r];
    }
    for (uint r = tid; r < pc.ranks; r += WG_SIZE) {
        io[pc.io_out + r] = uintBitsToFloat(order[r]);
    }
    for (uint b = tid; b < pc.buffers; b += WG_SIZE) {
        uint n = 0u;
        for (uint r = 0u; r < pc.k; r++) {
            uint e = order[r];
            if (e < pc.ne && slot_buf[e] == b) {
                uint at = o + 2u * pc.k + 3u * (pc.k * b + n);
                route_u[at] = slot_at[e];
                route_u[at + 1u] = r;
                route_u[at + 2u] = 1u;
                n++;
            }
        }
        // Then the routed experts the buffer does not hold, as (0, their pair, no pairs):
        // a combining down projection (matmul.comp's FLAG_COMBINE) reads all k entries of a
        // buffer and gives those ranks no term.
        uint j = n;
        for (uint r = 0u; r < pc.k; r++) {
            uint e = order[r];
            if (e >= pc.ne || slot_buf[e] != b) {
                uint at = o + 2u * pc.k + 3u * (pc.k * b + j);
                route_u[at] = 0u;
                route_u[at + 1u] = r;
                route_u[at + 2u] = 0u;
                j++;
            }
        }
        sizes[6u * b] = pc.gu_groups;
        sizes[6u * b + 1u] = n;
        sizes[6u * b + 2u] = 1u;
        sizes[6u * b + 3u] = pc.down_groups;
        sizes[6u * b + 4u] = n;
        sizes[6u * b + 5u] = 1u;
    }
    if (tid == 0u) {
        uint misses = 0u;
        for (uint r = 0u; r < pc.k; r++) {
            uint e = order[r];
            misses += e >= pc.ne || slot_buf[e] == NONE ? 1u : 0u;
        }
        act[dst + pc.ne + pc.k] = uintBitsToFloat(misses);
        io[pc.io_out + pc.ne + pc.k] = uintBitsToFloat(misses);
    }
#endif
}
