// The router's ranking of one token by one workgroup of any size that divides 256
// (route.comp's, and the ranking m=1 gate/up's, matmul.comp with FLAG_RANK): the softmax
// of the token's gate logits, its experts in descending probability (equal probabilities
// to the lower index, as actors/src/router/rank.rs ranks them; NaN probabilities
// unranked), and the top-k weights, renormalised (summed in rank order, then divided)
// when asked. Both reductions run over 256 partials (partial t: experts t, t + 256, ...
// in order) and the fixed tree s = 128, ..., 1 (red[t] = op(red[t], red[t + s])), its
// strides of at least the subgroup size through shared memory and the smaller ones by
// butterfly shuffles (which give lane 0 the same sums, as in matmul.comp), whatever the
// workgroup's size, so every includer gives the same bytes.
//
// The includer enables GL_KHR_shader_subgroup_basic and _shuffle and defines RANK_MAX_E
// (most experts) and RANK_ACT(i) (arena float i).

#define RANK_PARTS 256u
#define NONE 0xFFFFFFFFu

shared float rk_p[RANK_MAX_E];     // per expert: its probability (then -1 once ranked)
shared float rk_red[RANK_PARTS];   // the reductions' partials
shared uint rk_order[RANK_MAX_E];  // per rank: its expert (NONE: none)
shared float rk_top[RANK_MAX_E];   // per rank: its expert's probability (-1: none)
shared float rk_wts[RANK_MAX_E];   // per rank < k: its weight

// The tree's shared strides over rk_red (s = 128 down to the subgroup size; ends with a
// barrier), then every subgroup's butterfly over partials 0 .. subgroup size: the
// reduction's result, in every invocation.
#define RANK_TREE(OP)                                                                   \
    for (uint s = RANK_PARTS / 2u; s >= gl_SubgroupSize; s >>= 1u) {                    \
        for (uint t = gl_LocalInvocationID.x; t < s; t += gl_WorkGroupSize.x) {          \
            float a = rk_red[t], b = rk_red[t + s];                                     \
            OP;                                                                         \
            rk_red[t] = r;                                                              \
        }                                                                               \
        barrier();                                                                      \
    }                                                                                   \
    float v = rk_red[gl_SubgroupInvocationID % RANK_PARTS];                             \
    for (uint s = min(gl_SubgroupSize, RANK_PARTS) / 2u; s > 0u; s >>= 1u) {            \
        float a = v, b = subgroupShuffleXor(v, s);                                      \
        OP;                                                                             \
        v = r;                                                                          \
    }                                                                                   \
    v = subgroupShuffle(v, 0u);

// The probabilities of the ne logits at arena offset src into rk_p.
void rank_probs(uint src, uint ne) {
    uint tid = gl_LocalInvocationID.x, wg = gl_WorkGroupSize.x;
    for (uint t = tid; t < RANK_PARTS; t += wg) {
        float mx = -1.0 / 0.0;
        for (uint e = t; e < ne; e += RANK_PARTS) {
            mx = max(mx, RANK_ACT(src + e));
        }
        rk_red[t] = mx;
    }
    barrier();
    float gmax;
    {
        RANK_TREE(float r = max(a, b))
        gmax = v;
    }
    barrier();
    for (uint t = tid; t < RANK_PARTS; t += wg) {
        precise float sum = 0.0;
        for (uint e = t; e < ne; e += RANK_PARTS) {
            precise float v = expf_(RANK_ACT(src + e) - gmax);
            rk_p[e] = v;
            sum = sum + v;
        }
        rk_red[t] = sum;
    }
    barrier();
    float gsum;
    {
        RANK_TREE(precise float r = a + b)
        gsum = v;
    }
    for (uint e = tid; e < ne; e += wg) {
        precise float q = rk_p[e] / gsum;
        rk_p[e] = q;
    }
}

// The first `ranks` ranks into rk_order and their probabilities into rk_top: rank r is
// the expert with r experts before it in (probability descending, index ascending)
// order; NaN probabilities are never ranked, and ranks with no expert stay NONE. The
// workgroup's first subgroup takes them one at a time, each the best expert not yet
// ranked (its lanes scan experts lane, lane + subgroup size, ...; a butterfly of
// shuffles picks the best of the lanes', the same in every lane), while the others wait.
// Starts and ends with a barrier (so shared writes made before it are visible after it).
void rank_order(uint ne, uint ranks) {
    barrier();
    if (gl_SubgroupID == 0u) {
        uint lane = gl_SubgroupInvocationID, sg = gl_SubgroupSize;
        for (uint r = 0u; r < ranks; r++) {
            float bp = -1.0;
            uint be = NONE;
            for (uint e = lane; e < ne; e += sg) {
                float p = rk_p[e];
                if (p >= 0.0 && (p > bp || (p == bp && e < be))) {
                    bp = p;
                    be = e;
                }
            }
            for (uint s = sg / 2u; s > 0u; s >>= 1u) {
                float op = subgroupShuffleXor(bp, s);
                uint oe = subgroupShuffleXor(be, s);
                if (op > bp || (op == bp && oe < be)) {
                    bp = op;
                    be = oe;
                }
            }
            if (lane == 0u) {
                rk_order[r] = be;
                rk_top[r] = bp;
            }
            if (be != NONE && be % sg == lane) {
                rk_p[be] = -1.0;
            }
        }
    }
    barrier();
}

// The top-k weights into rk_wts (summed in rank order, then divided when `norm`), by
// invocation 0; ends with a barrier.
void rank_weights(uint k, bool norm) {
    if (gl_LocalInvocationID.x == 0u) {
        precise float wsum = 0.0;
        for (uint r = 0u; r < k; r++) {
            float w = rk_top[r];
            rk_wts[r] = w;
            wsum = wsum + w;
        }
        if (norm) {
            for (uint r = 0u; r < k; r++) {
                precise float q = rk_wts[r] / wsum;
                rk_wts[r] = q;
            }
        }
    }
    barrier();
}
