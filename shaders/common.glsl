// Shared by every compute shader of the Vulkan executor.
//
// Summation order is part of the numerics contract: a dot product of one output element
// is split over LANES threads (matmul.comp's specialization constant); lane l accumulates
// chunks l, l + LANES, ... of CHUNK consecutive elements, each chunk element by element
// in order, each product added by one fma (the same operation in the m=1 and batched
// kernels; one instruction on the H200, where a multiply and an add took two); lane 0
// then adds the tail (cols % CHUNK elements) in order, likewise; the LANES partials are
// combined by a fixed tree (s = LANES/2, ..., 1: p[l] += p[l + s]), formed in shared
// memory for strides of at least the subgroup size and by butterfly shuffles below it,
// which give lane 0 the same sums, so the order does not depend on the subgroup size
// either. Accumulators are `precise` so the compiler may neither contract nor reorder
// anything else. The order depends only on the shapes, never on the number of tokens or
// experts in the dispatch, so the batched kernels give the same bytes as the m=1 kernels.
// The K4 block formats (Q4_K, Q5_K) and Q6_K sum 32-weight slices instead of chunks, in
// the order slice_dot.glsl's header gives; the cross-lane tree is this one.

#define WG_SIZE 256u
// rmsnorm.comp's invocations, whose chains of squares are its summation order
// (matmul.comp's NORM_IN front plays them whatever its own size).
#define NORM_CHAINS 256u

// Hand-unrolled loops. A loop whose body indexes a register array is written
// FOR_X(BODY): the preprocessor pastes BODY once per value of its index x, each copy in
// its own scope where x is a `const uint`, so every array index is a compile-time
// constant and the arrays can live in registers. No loop needs [[unroll]]: spirv-opt's
// unrolled copies lose NoContraction (README.md, "Identity"), while code pasted by the
// preprocessor is ordinary source that glslang decorates. A BODY is an object-like macro
// defined next to its use (it may contain FOR_Y of another index, and no top-level
// comma). The copies run in index order, so each accumulator sees the same sequence of
// adds as a rolled loop would give it.
#define FOR1(x, B) { const uint x = 0u; B }
#define FOR2(x, B) FOR1(x, B) { const uint x = 1u; B }
#define FOR4(x, B) FOR2(x, B) { const uint x = 2u; B } { const uint x = 3u; B }
#define FOR8(x, B) FOR4(x, B) { const uint x = 4u; B } { const uint x = 5u; B } \
                              { const uint x = 6u; B } { const uint x = 7u; B }
#define FOR16(x, B) FOR8(x, B) { const uint x = 8u; B } { const uint x = 9u; B }     \
                               { const uint x = 10u; B } { const uint x = 11u; B }   \
                               { const uint x = 12u; B } { const uint x = 13u; B }   \
                               { const uint x = 14u; B } { const uint x = 15u; B }

// RMSNorm's scale r = 1 / sqrt(mean(x²) + eps) from the sum of squares `ss` of `n`
// elements: rmsnorm.comp's, and matmul.comp's FRONT forming its input's norm itself
// (NORM_IN), whose rows must be the norm kernel's bytes.
float rms_scale(float ss, uint n, float eps) {
    precise float ms = ss / float(n);
    precise float r = 1.0 / sqrt(ms + eps);
    return r;
}

// Flags of the matmul / gate-up push constants.
#define FLAG_ACCUMULATE 1u   // out += result (residual add) instead of out = result
#define FLAG_GATHER 2u       // x row of token j is route_u[map_off + j] / map_div
#define FLAG_SCATTER 4u      // out row of token j is route_u[map_off + j]
#define FLAG_TABLE 8u        // workgroup y is an entry of the expert table at tab_off
#define FLAG_COMBINE 16u     // m=1, with TABLE: lane group g is entry g; the MoE combine
                             // of the rows is added to the residual (matmul.comp)

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
#ifdef ROUTE_WRITE
// The one kernel that writes the routing buffer (a device-routed step's routing words)
// declares it once, writable (see the arena above).
layout(set = 1, binding = 1) buffer RouteU { uint route_u[]; };
#define ROUTE_F(i) uintBitsToFloat(route_u[i])
#else
layout(set = 1, binding = 1) readonly buffer RouteU { uint route_u[]; };
layout(set = 1, binding = 1) readonly buffer RouteF { float route_f[]; };
#define ROUTE_F(i) route_f[i]
#endif

float bf16_lo(uint w) { return uintBitsToFloat(w << 16); }
float bf16_hi(uint w) { return uintBitsToFloat(w & 0xFFFF0000u); }

// IEEE binary16 bits widened exactly to f32 (subnormals normalised, infinities kept, NaNs
// quietened with their payload), as actors/src/cpu/quant.rs's f16_to_f32 and F16C do,
// without the conversion instruction (whose subnormal handling a driver may flush) and
// without ever forming an f32 subnormal (which one may flush): a normal's exponent is
// rebased in integer code, a subnormal's mantissa m becomes the float 2^23 + m minus 2^23
// (exact) times 2^-24 (exact: the product is m·2^-24 >= 2^-24, a normal float).
float f16_to_f32(uint h) {
    uint sign = (h & 0x8000u) << 16;
    uint em = h & 0x7FFFu;
    uint hi = em << 13;
    precise float sub = (uintBitsToFloat(0x4B000000u | em) - 8388608.0) * 5.9604644775390625e-8;
    uint special = em == 0x7C00u ? 0x7F800000u : 0x7FC00000u | hi;
    uint mag = em < 0x400u ? floatBitsToUint(sub) : (em >= 0x7C00u ? special : hi + (112u << 23));
    return uintBitsToFloat(sign | mag);
}

// The transcendental functions of the activations. GLSL lets a driver's exp be off by
// 3 + 2·|x| ulp and its log by 3 ulp, and they are: lavapipe's exp (exp2 of x·log₂e)
// is up to 9 ulp off at x = −20, which the DeltaNet states and the per-head RMSNorm
// amplified into 1.9e-4 of logit disagreement with the CPU backend. These use only
// `precise` adds, multiplies and divides (correctly rounded on lavapipe) and exact bit
// operations, so they give the same bytes on every driver that rounds those, and match
// the CPU backend's libm (`expf` is correctly rounded, `log1pf` fdlibm's) in nearly all
// arguments.

// e^x within about 0.6 ulp for every x. Cody–Waite reduction x = k·ln2 + r, |r| ≤ ln2/2
// (k·LN2_HI is exact, so r = rh + rl is known to far below an ulp); e^r = 1 + r + r²·q(r)
// with q the Taylor series to r⁶ (truncation below 1e-9); 1 + rh is kept as a two-float
// pair, so only the last addition rounds at the result's scale; then 2^k by exponent bits.
float expf_(float x) {
    if (x > 88.8) {
        return uintBitsToFloat(0x7F800000u);
    }
    if (!(x > -104.0)) {
        return x != x ? x : 0.0;
    }
    precise float kf = floor(x * 1.44269502 + 0.5);
    precise float rh = x - kf * 0.693145751953125;
    precise float rl = kf * -1.42860677e-6;
    precise float r = rh + rl;
    precise float q = 2.48015876e-5;
    q = q * r + 1.98412701e-4;
    q = q * r + 1.38888892e-3;
    q = q * r + 8.33333377e-3;
    q = q * r + 4.16666679e-2;
    q = q * r + 1.66666672e-1;
    q = q * r + 0.5;
    precise float hi = 1.0 + rh;
    precise float lo = ((1.0 - hi) + rh) + (rl + (r * r) * q);
    precise float e = hi + lo;
    // 2^k (k in −150..128) in exact steps.
    int k = int(kf);
    if (k > 127) {
        precise float y = (e * 2.0) * uintBitsToFloat(uint(k + 126) << 23);
        return y;
    }
    if (k < -126) {
        precise float y = (e * uintBitsToFloat(uint(k + 191) << 23)) * 5.42101086e-20;
        return y;
    }
    precise float y = e * uintBitsToFloat(uint(k + 127) << 23);
    return y;
}

// ln(1 + x) for x > −1 within 1 ulp: fdlibm's log1pf (as glibc's) in f32 operations.
// 1 + x = 2^k·u with √½ ≤ u < √2 and c the rounding error of 1 + x relative to it (for
// −0.2929 ≤ x < 0.4142, k = 0 and f = x exactly); ln u = f − f²/2 + s·(f²/2 + R(s²)),
// s = f / (2 + f).
float log1pf_(float x) {
    precise float f = x;
    precise float c = 0.0;
    int k = 0;
    if (!(x >= -uintBitsToFloat(0x3E95F619u) && x < uintBitsToFloat(0x3ED413D0u))) {
        precise float u = 1.0 + x;
        uint hu = floatBitsToUint(u);
        k = int(hu >> 23) - 127;
        precise float d = k > 0 ? 1.0 - (u - x) : x - (u - 1.0);
        c = d / u;
        hu &= 0x007FFFFFu;
        if (hu < 0x3504F4u) {
            u = uintBitsToFloat(hu | 0x3F800000u);
        } else {
            k += 1;
            u = uintBitsToFloat(hu | 0x3F000000u);
        }
        f = u - 1.0;
    }
    precise float hfsq = 0.5 * f * f;
    precise float s = f / (2.0 + f);
    precise float z = s * s;
    precise float r = 1.4798198640e-01;
    r = r * z + 1.5313838422e-01;
    r = r * z + 1.8183572590e-01;
    r = r * z + 2.2222198546e-01;
    r = r * z + 2.8571429849e-01;
    r = r * z + 4.0000000596e-01;
    r = r * z + 6.6666668653e-01;
    r = r * z;
    if (k == 0) {
        precise float y = f - (hfsq - s * (hfsq + r));
        return y;
    }
    precise float kf = float(k);
    precise float y = kf * 6.9313812256e-01 - ((hfsq - (s * (hfsq + r) + (kf * 9.0580006145e-06 + c))) - f);
    return y;
}

// The halves of x (Veltkamp's split: x = hi + lo exactly, each half 12 significant bits).
vec2 split12(float x) {
    precise float c = 4097.0 * x;
    precise float hi = c - (c - x);
    precise float lo = x - hi;
    return vec2(hi, lo);
}

// a / b for 1 <= b < 2^100, rounded as the CPU's division is: Vulkan lets OpFDiv be 2.5
// ulp off (NVIDIA's is), so its quotient q is corrected once by the residual a − q·b,
// formed exactly with Dekker's product (GLSL's fma may round twice); larger b keeps the
// plain quotient.
float div_rn(float a, float b) {
    precise float q = a / b;
    if (!(b < 1.0e30)) {
        return q;
    }
    vec2 qs = split12(q);
    vec2 bs = split12(b);
    precise float p = q * b;
    precise float err = ((qs.x * bs.x - p) + qs.x * bs.y + qs.y * bs.x) + qs.y * bs.y;
    precise float e = (a - p) - err;
    precise float y = q + e / b;
    return y;
}

// σ(x) = 1 / (1 + e^−x) and SiLU x·σ(x) = x / (1 + e^−x), as actors/src/cpu writes them.
float sigmoid(float x) {
    precise float d = 1.0 + expf_(-x);
    return div_rn(1.0, d);
}

float silu(float x) {
    precise float d = 1.0 + expf_(-x);
    return div_rn(x, d);
}
