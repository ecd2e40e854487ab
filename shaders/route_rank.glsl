// The router's ranking of one token by one workgroup of any size that divides 256
// (route.comp's, and the ranking m=1 gate/up's, matmul.comp with FLAG_RANK): the softmax
// of the token's gate logits, its experts in descending probability (equal probabilities
// to the lower index, as actors/src/router/rank.rs ranks them; NaN probabilities
// unranked), and the top-k weights, renormalised (summed in rank order, then divided)
// when asked. Both reductions run over 256 partials (partial t: experts t, t + 256, ...
// in order) and the fixed tree s = 128, ..., 1 (red[t] = op(red[t], red[t + s])),
// whatever the workgroup's size, so every includer gives the same bytes.
//
// The includer defines RANK_MAX_E (most experts) and RANK_ACT(i) (arena float i).

#define RANK_PARTS 256u
#define NONE 0xFFFFFFFFu

shared float rk_p[RANK_MAX_E];     // per expert: its probability
shared float rk_red[RANK_PARTS];   // the reductions' partials
shared uint rk_order[RANK_MAX_E];  // per rank: its expert (NONE: none)
shared float rk_wts[RANK_MAX_E];   // per rank < k: its weight

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
    for (uint s = RANK_PARTS / 2u; s > 0u; s >>= 1u) {
        for (uint t = tid; t < s; t += wg) {
            rk_red[t] = max(rk_red[t], rk_red[t + s]);
        }
        barrier();
    }
    float gmax = rk_red[0];
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
    for (uint s = RANK_PARTS / 2u; s > 0u; s >>= 1u) {
        for (uint t = tid; t < s; t += wg) {
            precise float r = rk_red[t] + rk_red[t + s];
            rk_red[t] = r;
        }
        barrier();
    }
    float gsum = rk_red[0];
    barrier();
    for (uint e = tid; e < ne; e += wg) {
        precise float q = rk_p[e] / gsum;
        rk_p[e] = q;
    }
}

// The first `ranks` ranks into rk_order: rank r is the expert with r experts before it
// in (probability descending, index ascending) order; each expert counts the experts
// before it, all at once (one barrier, where taking them one at a time needed a
// reduction tree per rank), and ranks with no expert stay NONE. Starts and ends with a
// barrier (so shared writes made before it are visible after it).
void rank_order(uint ne, uint ranks) {
    uint tid = gl_LocalInvocationID.x, wg = gl_WorkGroupSize.x;
    for (uint r = tid; r < ranks; r += wg) {
        rk_order[r] = NONE;
    }
    barrier();
    for (uint e = tid; e < ne; e += wg) {
        float pe = rk_p[e];
        if (!(pe >= 0.0)) {
            continue; // NaN
        }
        uint before = 0u;
        for (uint f = 0u; f < ne; f++) {
            float pf = rk_p[f];
            before += (pf > pe || (pf == pe && f < e)) ? 1u : 0u;
        }
        if (before < ranks) {
            rk_order[before] = e;
        }
    }
    barrier();
}

// The top-k weights into rk_wts (summed in rank order, then divided when `norm`), by
// invocation 0; ends with a barrier.
void rank_weights(uint ne, uint k, bool norm) {
    if (gl_LocalInvocationID.x == 0u) {
        precise float wsum = 0.0;
        for (uint r = 0u; r < k; r++) {
            uint best = rk_order[r];
            float w = best < ne ? rk_p[best] : -1.0;
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
