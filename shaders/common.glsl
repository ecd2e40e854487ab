// Shared by every compute shader of the Vulkan executor.
//
// Summation order is part of the numerics contract: a dot product of one output element
// is split over LANES threads (matmul.comp's specialization constant); lane l accumulates
// chunks l, l + LANES, ... of CHUNK consecutive elements, each chunk added element by
// element in order; lane 0 then adds the tail (cols % CHUNK elements) in order; the LANES
// partials are combined by a fixed tree (s = LANES/2, ..., 1: p[l] += p[l + s]), formed
// in shared memory for strides of at least the subgroup size and by butterfly shuffles
// below it, which give lane 0 the same sums, so the order does not depend on the
// subgroup size either. Accumulators are `precise` so the compiler may neither fuse
// multiply-adds nor reorder. The order depends only on the shapes, never on the number
// of tokens or experts in the dispatch, so the batched kernels give the same bytes as
// the m=1 kernels.

#define WG_SIZE 256u

// Flags of the matmul / gate-up push constants.
#define FLAG_ACCUMULATE 1u   // out += result (residual add) instead of out = result
#define FLAG_GATHER 2u       // x row of token j is route_u[map_off + j] / map_div
#define FLAG_SCATTER 4u      // out row of token j is route_u[map_off + j]
#define FLAG_TABLE 8u        // workgroup y is an entry of the expert table at tab_off

// Activations (one f32 arena, regions addressed by push-constant offsets) and the
// host-written routing data (pair lists as uint, routing weights as float).
// The arena is written, so it has exactly one declaration: vulkano derives the barriers
// between dispatches from each binding's reflected accesses, and an aliased read-only
// declaration of a written binding can hide the write from it. Read-only bindings may
// be aliased (vector and scalar views of weights).
// A kernel that reads the arena four floats at a time defines ACT_VEC4 and sees it as
// vec4 elements instead (act4[i >> 2][i & 3] is float i).
#ifdef ACT_VEC4
layout(set = 1, binding = 0) buffer Act { vec4 act4[]; };
#else
layout(set = 1, binding = 0) buffer Act { float act[]; };
#endif
layout(set = 1, binding = 1) readonly buffer RouteU { uint route_u[]; };
layout(set = 1, binding = 1) readonly buffer RouteF { float route_f[]; };

float bf16_lo(uint w) { return uintBitsToFloat(w << 16); }
float bf16_hi(uint w) { return uintBitsToFloat(w & 0xFFFF0000u); }

// IEEE binary16 bits widened exactly to f32 with integer operations only (subnormals
// normalised, infinities kept, NaNs quietened with their payload), as
// actors/src/cpu/quant.rs's f16_to_f32 and F16C do.
float f16_to_f32(uint h) {
    uint sign = (h & 0x8000u) << 16;
    uint e = (h >> 10) & 0x1Fu;
    uint man = h & 0x3FFu;
    uint mag;
    if (e == 0u) {
        // man * 2^-24: exponent from the top set bit, which the shift drops.
        int s = findMSB(man);
        mag = man == 0u ? 0u : (uint(s + 103) << 23) | ((man << uint(23 - s)) & 0x7FFFFFu);
    } else if (e == 0x1Fu) {
        mag = man == 0u ? 0x7F800000u : (0x7FC00000u | (man << 13));
    } else {
        mag = ((e + 112u) << 23) | (man << 13);
    }
    return uintBitsToFloat(sign | mag);
}
