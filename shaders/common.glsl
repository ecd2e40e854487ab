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
