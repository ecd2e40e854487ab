// The router's gate logits in matmul.comp's FRONT gate/up: rows 0 .. ne - 1 of the
// router's weight (set 0, binding 4; f32, bf16 or f16 by the specialization constant
// ROUTER_T) times the input at x_off, written to the arena at `logits`. Each row follows
// the order of matmul.comp's m=1 matvec of that type: lane l of the row's LANES takes
// chunks l, l + LANES, ... of ROUTER_CHUNK elements, one fma each in element order, then
// the fixed tree of common.glsl (shared strides of at least the subgroup size, butterfly
// shuffles below). So the logits are that kernel's bytes, whichever workgroup forms a
// row. The host sends only rows whose length is a multiple of ROUTER_CHUNK (no tail).
// Included after matmul.comp's `red`, `pc` and arena views.

layout(constant_id = 4) const uint ROUTER_T = 0u; // 0: f32, 1: bf16, 2: f16
layout(set = 0, binding = 4) readonly buffer Rw4 { uvec4 rw4[]; };

#define ROUTER_CHUNK (ROUTER_T == 0u ? 4u : 8u)

// Element pair word `u` of a 16-bit router row as two floats.
vec2 router_pair(uint u) {
    return ROUTER_T == 1u ? vec2(bf16_lo(u), bf16_hi(u)) : vec2(f16_to_f32(u & 0xFFFFu), f16_to_f32(u >> 16));
}

// Lane `lane`'s partial of router row `row` (`cols` inputs at x_off).
float router_partial(uint row, uint lane) {
    precise float acc = 0.0;
    uint nch = pc.cols / ROUTER_CHUNK;
    for (uint c = lane; c < nch; c += LANES) {
        uvec4 q = rw4[row * nch + c];
        uint e = pc.x_off + c * ROUTER_CHUNK;
        if (ROUTER_T == 0u) {
            acc = fma(uintBitsToFloat(q.x), XIN(e), acc);
            acc = fma(uintBitsToFloat(q.y), XIN(e + 1u), acc);
            acc = fma(uintBitsToFloat(q.z), XIN(e + 2u), acc);
            acc = fma(uintBitsToFloat(q.w), XIN(e + 3u), acc);
        } else {
            FOR4(j, {
                vec2 wp = router_pair(q[j]);
                acc = fma(wp.x, XIN(e + 2u * j), acc);
                acc = fma(wp.y, XIN(e + 2u * j + 1u), acc);
            })
        }
    }
    return acc;
}

// The router's rows of workgroup `g` of `nwg`: lane group q of the grid (g's lane groups
// in order) takes rows q, q + the grid's lane groups, ...; every invocation calls it.
void router_rows(uint g, uint nwg) {
    uint f = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;
    uint lane = f % LANES;
    uint lgs = WG_SIZE / LANES;
    uint stride = nwg * lgs;
    uint rounds = (pc.ne + stride - 1u) / stride;
    for (uint k = 0u; k < rounds; k++) {
        uint want = k * stride + g * lgs + f / LANES;
        precise float acc = router_partial(min(want, pc.ne - 1u), lane);
        uint s = LANES / 2u;
        if (gl_SubgroupSize < LANES) {
            red[f] = acc;
            barrier();
            for (uint h = LANES / 2u; h >= gl_SubgroupSize; h >>= 1u) {
                if (lane < h) {
                    precise float t = red[f] + red[f + h];
                    red[f] = t;
                }
                barrier();
            }
            acc = red[f];
            barrier();
            s = gl_SubgroupSize / 2u;
        }
        for (; s > 0u; s >>= 1u) {
            acc = acc + subgroupShuffleXor(acc, s);
        }
        if (lane == 0u && want < pc.ne) {
            act_c[pc.logits + want] = acc;
        }
    }
}
