// Shared by every compute shader of the Vulkan executor.
//
// Summation order is part of the numerics contract: a dot product of one output element
// is split over LANES threads; lane l accumulates chunks l, l + LANES, ... of CHUNK
// consecutive elements, each chunk added element by element in order; lane 0 then adds
// the tail (cols % CHUNK elements) in order; the LANES partials are combined by a fixed
// shared-memory tree (s = LANES/2, ..., 1: p[l] += p[l + s]). Accumulators are `precise`
// so the compiler may neither fuse multiply-adds nor reorder. The order depends only on
// the shapes, never on the number of tokens in the dispatch, so the batched kernels give
// the same bytes as the m=1 kernels.

#define LANES 64u
#define ROWS_PER_WG 4u
#define WG_SIZE 256u

// Flags of the matmul / gate-up push constants.
#define FLAG_ACCUMULATE 1u   // out += result (residual add) instead of out = result
#define FLAG_GATHER 2u       // x row of token j is route_u[map_off + j] / map_div
#define FLAG_SCATTER 4u      // out row of token j is route_u[map_off + j]

// Activations (one f32 arena, regions addressed by push-constant offsets) and the
// host-written routing data (pair lists as uint, routing weights as float).
// The arena is written, so it has exactly one declaration: vulkano derives the barriers
// between dispatches from each binding's reflected accesses, and an aliased read-only
// declaration of a written binding can hide the write from it. Read-only bindings may
// be aliased (vector and scalar views of weights).
layout(set = 1, binding = 0) buffer Act { float act[]; };
layout(set = 1, binding = 1) readonly buffer RouteU { uint route_u[]; };
layout(set = 1, binding = 1) readonly buffer RouteF { float route_f[]; };

float bf16_lo(uint w) { return uintBitsToFloat(w << 16); }
float bf16_hi(uint w) { return uintBitsToFloat(w & 0xFFFF0000u); }
