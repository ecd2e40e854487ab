// The router's ranking of one token, shared by route.comp (a workgroup a token) and
// matmul.comp's FRONT gate/up (every workgroup of a device-routed decode step's fused
// front ranks the token itself, so no ranking dispatch hands it over): the softmax of the token's gate
// logits, then its `ranks` most probable experts in descending probability (equal
// probabilities to the lower index, as actors/src/router/rank.rs ranks them; NaN
// probabilities unranked, a rank with no expert NONE), and the first k probabilities as
// weights, renormalised (summed in rank order, then divided) when `norm` is set.
//
// The softmax's sum has one order whatever the caller's workgroup size: lane l of the
// first 32 invocations sums experts l, l + 32, ... in order, then common.glsl's fixed tree
// combines the 32 partials (shared memory for strides of at least the subgroup size,
// butterfly shuffles below). The maximum skips NaN logits, as the host's softmax does, so
// its order does not matter. So every caller forms the same probabilities, bit for bit.
//
// The includer defines MAX_E (experts at most, a multiple of 4), MAX_RANKS (ranks at
// most), ACT(i) (float i of its activation arena; RANK_LOGIT(i), where the logits are
// read through another view of it, defaults to it) and, to learn the tier slot of each
// top-k expert, RANK_SLOTS with a `slots` buffer (per expert of every layer: tier buffer
// or NONE, byte offset).

#define NONE 0xFFFFFFFFu
#ifndef RANK_LOGIT
#define RANK_LOGIT(i) ACT(i)
#endif

shared vec4 rank_p4[MAX_E / 4u];   // logits, then probabilities (-1 past the experts)
shared float rank_lanes[32];       // the lane tree's shared strides
shared float rank_bcast;           // the softmax's maximum, then its sum, for all
shared uint rank_order[MAX_RANKS]; // the expert of each rank
shared float rank_wts[MAX_RANKS];  // the top-k weights
#ifdef RANK_SLOTS
shared uvec2 rank_slot[MAX_RANKS]; // the tier slot of each top-k expert
#endif

#define RANK_P(e) rank_p4[(e) >> 2][(e) & 3u]

// common.glsl's fixed tree over the first 32 invocations' values `a` (a sum, or with
// `mx` a maximum): lane 0 gets the result (every lane of its subgroup below strides of the
// subgroup size). Every invocation of the workgroup calls it (`tid` its index).
float rank_lane_tree(float a, bool mx, uint tid) {
    uint s = 16u;
    for (; s >= gl_SubgroupSize; s >>= 1u) {
        if (tid < 32u) {
            rank_lanes[tid] = a;
        }
        barrier();
        if (tid < s) {
            float o = rank_lanes[tid + s];
            precise float t = mx ? max(a, o) : a + o;
            a = t;
        }
        barrier();
    }
    for (; s > 0u; s >>= 1u) {
        float o = subgroupShuffleXor(a, s);
        precise float t = mx ? max(a, o) : a + o;
        a = t;
    }
    return a;
}

// Experts up to which rank_token ranks by counting (above, by sorting).
#define RANK_COUNT_MAX 128u

shared uint rank_idx[MAX_E]; // rank_sort's experts, in sorting order

// Whether expert a goes before expert b in the ranking (after the softmax): probability
// descending, then index ascending; NaN probabilities after every number (and among
// themselves by index), and the sort's padding (index ne and above) after all.
bool rank_before(uint a, uint b, uint ne) {
    if (a >= ne || b >= ne) {
        return a < b;
    }
    float pa = RANK_P(a);
    float pb = RANK_P(b);
    bool na = !(pa >= 0.0);
    bool nb = !(pb >= 0.0);
    if (na || nb) {
        return na && nb ? a < b : nb;
    }
    return pa > pb || (pa == pb && a < b);
}

// The first `ranks` experts of rank_before's order into rank_order (NONE for a NaN one):
// a bitonic sort of the experts, padded to a power of two, in shared memory (MAX_E, a
// power of two, at most). Every invocation calls it; rank_order is visible on return.
void rank_sort(uint ne, uint ranks, uint tid, uint nw) {
    uint n2 = 1u;
    while (n2 < ne) {
        n2 <<= 1u;
    }
    for (uint i = tid; i < n2; i += nw) {
        rank_idx[i] = i;
    }
    barrier();
    for (uint size = 2u; size <= n2; size <<= 1u) {
        for (uint stride = size >> 1u; stride > 0u; stride >>= 1u) {
            for (uint t = tid; t < n2 / 2u; t += nw) {
                // Comparator t joins lo and hi; blocks of `size` alternate direction
                // until the last, which puts the order's first experts first.
                uint lo = 2u * stride * (t / stride) + t % stride;
                uint hi = lo + stride;
                uint a = rank_idx[lo];
                uint b = rank_idx[hi];
                bool first = (lo & size) == 0u;
                if (first ? rank_before(b, a, ne) : rank_before(a, b, ne)) {
                    rank_idx[lo] = b;
                    rank_idx[hi] = a;
                }
            }
            barrier();
        }
    }
    for (uint r = tid; r < ranks; r += nw) {
        uint e = rank_idx[r];
        rank_order[r] = e < ne && RANK_P(e) >= 0.0 ? e : NONE;
    }
    barrier();
}

// Ranks the `ne` logits at ACT(src ..) into rank_order (ranks of them) and, with
// `weights`, rank_wts (k); with RANK_SLOTS the top-k experts' slots (from `slot_off` of
// `slots`) go to rank_slot. Every invocation of the workgroup calls it (invocation `tid`
// of `nw`); the results are visible to all on return.
void rank_token(uint src, uint ne, uint k, uint ranks, bool norm, bool weights, uint slot_off, uint tid, uint nw) {
    for (uint e = tid; e < (ne + 3u) / 4u * 4u; e += nw) {
        RANK_P(e) = e < ne ? RANK_LOGIT(src + e) : -1.0;
    }
    for (uint r = tid; r < ranks; r += nw) {
        rank_order[r] = NONE;
    }
    barrier();
    float mx = -1.0 / 0.0;
    for (uint e = tid; tid < 32u && e < ne; e += 32u) {
        float x = RANK_P(e);
        mx = x > mx ? x : mx;
    }
    mx = rank_lane_tree(mx, true, tid);
    if (tid == 0u) {
        rank_bcast = mx;
    }
    barrier();
    float gmax = rank_bcast;
    // Every invocation forms exponentials; the 32 lanes then sum them in their order.
    for (uint e = tid; e < ne; e += nw) {
        precise float x = expf_(RANK_P(e) - gmax);
        RANK_P(e) = x;
    }
    barrier();
    precise float sum = 0.0;
    for (uint e = tid; tid < 32u && e < ne; e += 32u) {
        sum = sum + RANK_P(e);
    }
    sum = rank_lane_tree(sum, false, tid);
    barrier();
    if (tid == 0u) {
        rank_bcast = sum;
    }
    barrier();
    for (uint e = tid; e < ne; e += nw) {
        precise float q = RANK_P(e) / rank_bcast;
        RANK_P(e) = q;
    }
    barrier();
    // Rank r is the expert with r experts before it in (probability descending, index
    // ascending) order, NaN probabilities unranked (rank_before). Up to RANK_COUNT_MAX
    // experts, each counts the experts before it, all at once, four at a time (the -1
    // past the experts never counts); more are sorted (rank_sort), whose count would take
    // ne² / nw steps. Both give every expert the same rank.
    if (ne > RANK_COUNT_MAX) {
        rank_sort(ne, ranks, tid, nw);
#ifdef RANK_SLOTS
        for (uint r = tid; r < k; r += nw) {
            uint e = rank_order[r];
            if (e < ne) {
                rank_slot[r] = uvec2(slots[2u * (slot_off + e)], slots[2u * (slot_off + e) + 1u]);
            }
        }
#endif
    } else {
        for (uint e = tid; e < ne; e += nw) {
#ifdef RANK_SLOTS
            // Requested before the count, which hides the read.
            uvec2 slot = uvec2(slots[2u * (slot_off + e)], slots[2u * (slot_off + e) + 1u]);
#endif
            float pe = RANK_P(e);
            if (!(pe >= 0.0)) {
                continue; // NaN
            }
            uint before = 0u;
            for (uint f = 0u; f < (ne + 3u) / 4u; f++) {
                vec4 pf = rank_p4[f];
                FOR4(c, before += (pf[c] > pe || (pf[c] == pe && 4u * f + c < e)) ? 1u : 0u;)
            }
            if (before < ranks) {
                rank_order[before] = e;
            }
#ifdef RANK_SLOTS
            if (before < k) {
                rank_slot[before] = slot;
            }
#endif
        }
    }
    barrier();
    if (weights && tid == 0u) {
        precise float wsum = 0.0;
        for (uint r = 0u; r < k; r++) {
            uint best = rank_order[r];
            float w = best < ne ? RANK_P(best) : -1.0;
            rank_wts[r] = w;
            wsum = wsum + w;
        }
        if (norm) {
            for (uint r = 0u; r < k; r++) {
                precise float q = rank_wts[r] / wsum;
                rank_wts[r] = q;
            }
        }
    }
    barrier();
}

#ifdef RANK_SLOTS
// After rank_token, the routing words of a decode step whose experts are read in the
// VRAM tier's buffers, at `o` of the routing buffer (offsets relative to it):
//   0 .. k:              the pair list (pair r is token 0's rank r)
//   k .. 2k:             the routing weights (rank_wts, as float bits)
//   2k + 3k·b ..:        tier buffer b's expert table, k entries of (byte offset, first
//                        pair, 1 pair), its experts first (in rank order), then (0, first
//                        pair, 0 pairs) for each routed expert it does not hold
// with RANK_SIZES each buffer b's indirect dispatch sizes at 6b of `sizes` (gate/up,
// then down: (pc.gu_groups or pc.down_groups, its experts, 1)), and in the host's readback
// buffer `io` the ranks at `io_out`, the weights at io_out + ne and the count of routed
// experts the tier does not hold at io_out + ne + k (then the step is void: the caller
// runs it again host-routed). Invocation b writes buffer b's table. Returns the count of misses (in invocation
// 0). Needs the routing buffer writable (ROUTE_WRITE).
uint rank_tables(uint o, uint io_out, uint ne, uint k, uint ranks, uint buffers, uint tid, uint nw) {
    for (uint r = tid; r < k; r += nw) {
        route_u[o + r] = r;
        route_u[o + k + r] = floatBitsToUint(rank_wts[r]);
        io[io_out + ne + r] = rank_wts[r];
    }
    for (uint r = tid; r < ranks; r += nw) {
        io[io_out + r] = uintBitsToFloat(rank_order[r]);
    }
    for (uint b = tid; b < buffers; b += nw) {
        uint n = 0u;
        for (uint r = 0u; r < k; r++) {
            if (rank_order[r] < ne && rank_slot[r].x == b) {
                uint at = o + 2u * k + 3u * (k * b + n);
                route_u[at] = rank_slot[r].y;
                route_u[at + 1u] = r;
                route_u[at + 2u] = 1u;
                n++;
            }
        }
        // Then the routed experts the buffer does not hold, as (0, their pair, no pairs):
        // a combining down projection (matmul.comp's FLAG_COMBINE) reads all k entries of a
        // buffer and gives those ranks no term.
        uint j = n;
        for (uint r = 0u; r < k; r++) {
            if (rank_order[r] >= ne || rank_slot[r].x != b) {
                uint at = o + 2u * k + 3u * (k * b + j);
                route_u[at] = 0u;
                route_u[at + 1u] = r;
                route_u[at + 2u] = 0u;
                j++;
            }
        }
#ifdef RANK_SIZES
        sizes[6u * b] = pc.gu_groups;
        sizes[6u * b + 1u] = n;
        sizes[6u * b + 2u] = 1u;
        sizes[6u * b + 3u] = pc.down_groups;
        sizes[6u * b + 4u] = n;
        sizes[6u * b + 5u] = 1u;
#endif
    }
    uint misses = 0u;
    if (tid == 0u) {
        for (uint r = 0u; r < k; r++) {
            misses += rank_order[r] >= ne || rank_slot[r].x == NONE ? 1u : 0u;
        }
        io[io_out + ne + k] = uintBitsToFloat(misses);
    }
    return misses;
}
#endif
