// A CUDA twin of the Vulkan Q4_K m=1 slice kernels (shaders/slice_dot.glsl with
// matmul.comp at TB = 1), for Nsight Compute: ncu cannot see Vulkan dispatches, so what
// bounds the Vulkan kernel (issue, latency, L1, DRAM) is read off this twin, compiled by
// nvcc for the same GPU. Lab tool, not part of the build; on the H200 (`device`):
//   nvcc -O3 -arch=sm_90 -fmad=false -std=c++17 -o q4k_m1 q4k_m1.cu && ./q4k_m1
//   ncu --clock-control none --launch-skip 2000 --launch-count 1 --section ... ./q4k_m1 K
// (K: one of main's kernels, launched 2000 times warm and once more for ncu). Results and
// their reading: bench/results/gpu-q4k-twin-h200-2026-12-03.txt.
//
// slice_m1: the same data layout (ggml block_q4_K, 144 bytes a 256-weight block), work
// split (lane l of a LANES-lane group takes 32-weight slices l, l + LANES, ...; lanes 2i and
// 2i + 1 share the block header's decode through two shuffles), arithmetic per slice (the
// quants as exact floats by masking under an exponent, S = Σ q·x by fma, X = Σ x, term =
// (d·sc)·S − (dmin·m)·X) and tree as the Vulkan kernel; RPT rows per lane group share each
// load of x; its groups' sums come from the f32 inputs (FloatX) or from integer dot
// products on 24-bit limbs of x (LimbX). xreg_m1: slice_m1's bytes with x held in
// registers across rows (the split of the Vulkan input-resident kernel that session 26
// measured and removed, bench/README.md; main checks the bytes). mma_m1: the same sums on
// the tensor cores. main checks each against an f64 reference and times, median of 7 ~30 ms runs after a 300 ms
// warm-up, in µs and GB/s of quantised bytes against 4.8 TB/s: the 8-expert gate/up of
// the 235B shape (1536 × 4096 each, a different eight of 48 each launch, past L2) and a
// 151936 × 4096 LM head.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <vector>

#define CHECK(x)                                                                           \
    do {                                                                                   \
        cudaError_t e_ = (x);                                                              \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));    \
            return 1;                                                                      \
        }                                                                                  \
    } while (0)

constexpr unsigned QK = 256, QB = 144, QS_AT = 16, WG = 128;

// common.glsl's f16_to_f32 (exact for every f16, no f32 subnormal formed).
__device__ __forceinline__ float f16_to_f32(unsigned h) {
    unsigned sign = (h & 0x8000u) << 16, em = h & 0x7FFFu, hi = em << 13;
    float sub = __fmul_rn(__fsub_rn(__uint_as_float(0x4B000000u | em), 8388608.0f), 5.9604644775390625e-8f);
    unsigned special = em == 0x7C00u ? 0x7F800000u : (0x7FC00000u | hi);
    unsigned mag = em < 0x400u ? __float_as_uint(sub) : (em >= 0x7C00u ? special : hi + (112u << 23));
    return __uint_as_float(sign | mag);
}


// quant.glsl's QFLOAT with no bias: q (below 2^23) as an exact float.
__device__ __forceinline__ float qfloat(unsigned q) { return __uint_as_float(0x4B000000u | q) - 8388608.0f; }

// quant.glsl's k4_scale_min: sc | m << 8 of sub-block j from the scale words y, z, w.
__device__ __forceinline__ unsigned k4_scale_min(unsigned y, unsigned z, unsigned w, unsigned j) {
    unsigned bs = 8u * (j & 3u);
    unsigned a = (y >> bs) & 0xFFu, b = (z >> bs) & 0xFFu, c = (w >> bs) & 0xFFu;
    unsigned sc = j < 4u ? a & 63u : (c & 0x0Fu) | ((a >> 6) << 4);
    unsigned m = j < 4u ? b & 63u : (c >> 4) | ((b >> 6) << 4);
    return sc | (m << 8);
}

// slice_dot.glsl's k4_scales at TB = 1: (d·sc, dmin·m) of sub-blocks jl and jl + 1, the
// twin lane (lane ^ 1) forming half of them.
__device__ __forceinline__ float4 k4_scales(uint4 h, unsigned jl, unsigned odd) {
    float mine = f16_to_f32(odd == 0u ? h.x & 0xFFFFu : h.x >> 16);
    float twin = __shfl_xor_sync(0xFFFFFFFFu, mine, 1);
    float d = odd == 0u ? mine : twin, dmin = odd == 0u ? twin : mine;
    unsigned sm = k4_scale_min(h.y, h.z, h.w, jl + odd);
    float ds = __fmul_rn(d, qfloat(sm & 0xFFu)), dm = __fmul_rn(dmin, qfloat(sm >> 8));
    float ods = __shfl_xor_sync(0xFFFFFFFFu, ds, 1), odm = __shfl_xor_sync(0xFFFFFFFFu, dm, 1);
    return odd == 0u ? make_float4(ds, dm, ods, odm) : make_float4(ods, odm, ds, dm);
}

// slice_dot.glsl's byte_float: the value at bit p of n (below m + 1) as an exact float,
// the exponent bits from two23 (0x4B000000) passed at run time, as the shaders' push
// constant is (a constant costs ptxas a second instruction a weight).
__device__ __forceinline__ float byte_float(unsigned n, unsigned p, unsigned m, unsigned two23) {
    return __uint_as_float((n & (m << p)) | (two23 - (p << 23))) - (float)(1u << (23u - p));
}

// S = Σ q·x of one row slice's group (16 weights, the low (hf 0) or high (hf 1) nibbles of
// the slice's 16 quant bytes q) against its 16 inputs xv, by fma in order.
__device__ __forceinline__ float qdot16(const uint4& q, unsigned hf, const float (&xv)[16], unsigned two23) {
    unsigned w[4] = {q.x, q.y, q.z, q.w};
    float s = 0.0f;
#pragma unroll
    for (int wd = 0; wd < 4; wd++) {
        unsigned n = w[wd], hi = n >> 16, p = 4u * hf;
        s = fmaf(byte_float(n, p, 0xFu, two23), xv[4 * wd], s);
        s = fmaf(byte_float(n, p + 8u, 0xFu, two23), xv[4 * wd + 1], s);
        s = fmaf(byte_float(hi, p, 0xFu, two23), xv[4 * wd + 2], s);
        s = fmaf(byte_float(hi, p + 8u, 0xFu, two23), xv[4 * wd + 3], s);
    }
    return s;
}

// 16 inputs from x into xv.
__device__ __forceinline__ void load16(const float4* x, float (&xv)[16]) {
#pragma unroll
    for (int c = 0; c < 4; c++) {
        float4 v = x[c];
        xv[4 * c] = v.x, xv[4 * c + 1] = v.y, xv[4 * c + 2] = v.z, xv[4 * c + 3] = v.w;
    }
}

// X = Σ x of 16 inputs, in order.
__device__ __forceinline__ float xsum16(const float (&xv)[16]) {
    float xs = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i++) xs = __fadd_rn(xs, xv[i]);
    return xs;
}

// One group of N row slices (q[a]: gate/up and rows) against the same 16 inputs from x
// (byte_float's exponent bits two23): S per slice, and X.
template <int N>
__device__ __forceinline__ void group(const uint4 (&q)[N], unsigned hf, const float4* x, unsigned two23, float (&sdot)[N],
                                      float& xs) {
    float xv[16];
    load16(x, xv);
    xs = xsum16(xv);
#pragma unroll
    for (int a = 0; a < N; a++) sdot[a] = qdot16(q[a], hf, xv, two23);
}

// The inputs as slice_m1's groups read them: the f32 row itself, S = Σ q·x by fma in
// order (the Vulkan kernel's form).
struct FloatX {
    const float* x;
    unsigned two23;  // 0x4B000000 (byte_float)
    // S of each row slice q[a] over group g (16 elements from e), and X = Σ x.
    template <int N>
    __device__ __forceinline__ void operator()(const uint4 (&q)[N], unsigned g, unsigned e, float (&S)[N], float& xs) const {
        group<N>(q, g, reinterpret_cast<const float4*>(x + e), two23, S, xs);
    }
    // xreg_m1's resident form: a slice's two groups of inputs (from e0 and e0 + 32) and X.
    struct Regs {
        float xv[2][16], xs[2];
    };
    __device__ __forceinline__ void load(Regs& r, unsigned e0) const {
#pragma unroll
        for (int g = 0; g < 2; g++) {
            load16(reinterpret_cast<const float4*>(x + e0 + 32u * g), r.xv[g]);
            r.xs[g] = xsum16(r.xv[g]);
        }
    }
    // S of row slice q over group g, as operator() forms it.
    __device__ __forceinline__ float dot(const Regs& r, const uint4& q, unsigned g) const {
        return qdot16(q, g, r.xv[g], two23);
    }
};

// The m=1 slice kernel over NACC matrices sharing x (1: a matvec, 2: SwiGLU gate/up), RPT
// consecutive rows per lane group of LANES lanes (x read once for the RPT rows), the
// groups' S and X formed by `in` (FloatX, LimbX): blockIdx.y = expert e, whose matrices
// start at byte e_off[e] of w (and u).
template <int NACC, unsigned LANES, int RPT, class In>
__global__ void __launch_bounds__(WG) slice_m1(const unsigned char* __restrict__ w, const unsigned char* __restrict__ u,
                                               const unsigned long long* __restrict__ e_off, In in,
                                               float* __restrict__ out, unsigned rows, unsigned cols) {
    constexpr int NA = NACC * RPT;
    unsigned lane = threadIdx.x % LANES;
    unsigned row0 = (blockIdx.x * (WG / LANES) + threadIdx.x / LANES) * RPT;
    unsigned long long eo = e_off[blockIdx.y];
    const unsigned char* mats[NA];
#pragma unroll
    for (int r = 0; r < RPT; r++) {
        unsigned long long rb = eo + (unsigned long long)min(row0 + r, rows - 1u) * (cols / QK * QB);
        mats[r * NACC] = w + rb;
        if (NACC == 2) mats[r * NACC + NACC - 1] = u + rb;
    }
    float acc[NA];
#pragma unroll
    for (int a = 0; a < NA; a++) acc[a] = 0.0f;
    for (unsigned s = lane; s < cols / 32u; s += LANES) {
        unsigned t = s % 8u;
        unsigned boff = (s / 8u) * QB;
        unsigned e0 = (s / 8u) * QK + 64u * (t / 2u) + 16u * (t % 2u);
        unsigned jl = 2u * (t / 2u);
        uint4 q[NA];
        float4 sf[NA];
#pragma unroll
        for (int a = 0; a < NA; a++) {
            q[a] = *reinterpret_cast<const uint4*>(mats[a] + boff + QS_AT + 16u * t);
            sf[a] = k4_scales(*reinterpret_cast<const uint4*>(mats[a] + boff), jl, lane & 1u);
        }
#pragma unroll
        for (unsigned g = 0; g < 2; g++) {
            float sdot[NA], xs;
            in(q, g, e0 + 32u * g, sdot, xs);
#pragma unroll
            for (int a = 0; a < NA; a++) {
                float sc = g == 0 ? sf[a].x : sf[a].z, mn = g == 0 ? sf[a].y : sf[a].w;
                float term = __fsub_rn(__fmul_rn(sc, sdot[a]), __fmul_rn(mn, xs));
                acc[a] = __fadd_rn(acc[a], term);
            }
        }
    }
#pragma unroll
    for (unsigned st = LANES / 2; st > 0; st >>= 1)
#pragma unroll
        for (int a = 0; a < NA; a++) acc[a] = __fadd_rn(acc[a], __shfl_xor_sync(0xFFFFFFFFu, acc[a], st));
#pragma unroll
    for (int r = 0; r < RPT; r++) {
        unsigned row = row0 + r;
        if (lane == 0 && row < rows) {
            float v = acc[r * NACC];
            if (NACC == 2)
                v = __fmul_rn(__fdiv_rn(acc[r * NACC], __fadd_rn(1.0f, __expf(-acc[r * NACC]))), acc[r * NACC + 1]);
            out[blockIdx.y * rows + row] = v;
        }
    }
}

// ---- x held in registers across rows (the same sums as slice_m1<NACC, 32, 1, In>) ----
// slice_m1 reads a row's whole f32 input from L1 for every row (7x the quant bytes). Here a
// workgroup of WG = cols / 32 threads owns one slice each, thread t slice t, for every one
// of RB consecutive rows: its 32 inputs and their two 16-element sums X are loaded once
// into registers, each row costs it 32 quant bytes and the 16-byte block header (the next
// row's loads issued before this row's arithmetic; the inputs as In::Regs holds them: f32
// or limbs). Each thread's two terms a row go to workgroup memory; warp w then plays
// lane l of slice_m1's 32-lane group for rows w,
// w + WG/32, ...: the chain over slices l, l + 32, ... (threads l, l + 32, ...) in slice_m1's
// order, then the same butterfly. Same operations on the same operands: the same bytes.
template <int NACC, int RB, class In>
__global__ void __launch_bounds__(WG) xreg_m1(const unsigned char* __restrict__ w, const unsigned char* __restrict__ u,
                                              const unsigned long long* __restrict__ e_off, In in,
                                              float* __restrict__ out, unsigned rows, unsigned cols) {
    __shared__ float part[RB][NACC][2][WG];
    const unsigned t = threadIdx.x, lane = t % 32u, t8 = t % 8u;
    const unsigned boff = (t / 8u) * QB, e0 = (t / 8u) * QK + 64u * (t8 / 2u) + 16u * (t8 % 2u), jl = 2u * (t8 / 2u);
    typename In::Regs xr;
    in.load(xr, e0);
    const unsigned long long rb = cols / QK * QB, eo = e_off[blockIdx.y];
    const unsigned row0 = blockIdx.x * RB;
    auto at = [&](int a, int r) {
        return (a == 0 ? w : u) + eo + (unsigned long long)min(row0 + (unsigned)r, rows - 1u) * rb + boff;
    };
    uint4 q[2][NACC], h[2][NACC];
#pragma unroll
    for (int a = 0; a < NACC; a++) {
        q[0][a] = *reinterpret_cast<const uint4*>(at(a, 0) + QS_AT + 16u * t8);
        h[0][a] = *reinterpret_cast<const uint4*>(at(a, 0));
    }
#pragma unroll
    for (int r = 0; r < RB; r++) {
        const int cur = r & 1, nxt = cur ^ 1;
        if (r + 1 < RB)
#pragma unroll
            for (int a = 0; a < NACC; a++) {
                q[nxt][a] = *reinterpret_cast<const uint4*>(at(a, r + 1) + QS_AT + 16u * t8);
                h[nxt][a] = *reinterpret_cast<const uint4*>(at(a, r + 1));
            }
#pragma unroll
        for (int a = 0; a < NACC; a++) {
            float4 sf = k4_scales(h[cur][a], jl, lane & 1u);
#pragma unroll
            for (unsigned g = 0; g < 2; g++) {
                float sc = g == 0 ? sf.x : sf.z, mn = g == 0 ? sf.y : sf.w;
                part[r][a][g][t] = __fsub_rn(__fmul_rn(sc, in.dot(xr, q[cur][a], g)), __fmul_rn(mn, xr.xs[g]));
            }
        }
    }
    __syncthreads();
    for (unsigned r = t / 32u; r < RB; r += WG / 32u) {
        float acc[NACC];
#pragma unroll
        for (int a = 0; a < NACC; a++) {
            acc[a] = 0.0f;
#pragma unroll
            for (unsigned k = 0; k < WG / 32u; k++) {
                acc[a] = __fadd_rn(acc[a], part[r][a][0][32u * k + lane]);
                acc[a] = __fadd_rn(acc[a], part[r][a][1][32u * k + lane]);
            }
        }
#pragma unroll
        for (unsigned st = 16; st > 0; st >>= 1)
#pragma unroll
            for (int a = 0; a < NACC; a++) acc[a] = __fadd_rn(acc[a], __shfl_xor_sync(0xFFFFFFFFu, acc[a], st));
        unsigned row = row0 + r;
        if (lane == 0 && row < rows) {
            float v = acc[0];
            if (NACC == 2) v = __fmul_rn(__fdiv_rn(acc[0], __fadd_rn(1.0f, __expf(-acc[0]))), acc[NACC - 1]);
            out[blockIdx.y * rows + row] = v;
        }
    }
}

// ---- The tensor-core alternative (a probe of what cooperative matrices would give) ----
// out[r] = Σ_blocks Σ_sub-blocks (d·sc)·S − (dmin·m)·X with S = Σ q·x over the sub-block,
// computed by mma.sync m16n8k16 (f16 inputs, f32 accumulation): A = the quants (exact in
// f16: 1024 + q or 64 + q from a byte permute under an exponent, minus the bias), B = x
// as three f16 pieces x = x0 + x1 + x2 in columns 0..2 (exact for |x| in f16's normal
// range and pieces above its subnormal floor), so S = D[.,0] + D[.,1] + D[.,2]. A warp
// takes MT tiles of 16 rows; lane (g = lane / 4, t = lane % 4) supplies, of each 16-element
// k-step, elements 8t + 4h + 0..3 of the sub-block (its word h of the 8 quant bytes
// 32j + 8t ..), and decodes its rows' scales of sub-blocks 2t, 2t + 1.
__device__ __forceinline__ unsigned bias_sub(unsigned v, unsigned bias2) {
    __half2 a = *reinterpret_cast<__half2*>(&v), b = *reinterpret_cast<__half2*>(&bias2);
    __half2 r = __hsub2(a, b);
    return *reinterpret_cast<unsigned*>(&r);
}

__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int MT>
__global__ void __launch_bounds__(WG) mma_m1(const unsigned char* __restrict__ w, const __half* __restrict__ xp,
                                             const float* __restrict__ xsub, float* __restrict__ out, unsigned rows,
                                             unsigned cols) {
    unsigned lane = threadIdx.x % 32u, g = lane / 4u, t = lane % 4u;
    unsigned row0 = (blockIdx.x * (WG / 32u) + threadIdx.x / 32u) * 16u * MT;
    unsigned long long rb = cols / QK * QB;
    const unsigned char* rp[MT][2];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) rp[m][hh] = w + (unsigned long long)min(row0 + 16u * m + g + 8u * hh, rows - 1u) * rb;
    float acc[MT][2] = {};
    for (unsigned b = 0; b < cols / QK; b++) {
        float dsc[MT][2][2], dmn[MT][2][2];
        uint2 qw[MT][2][4];
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const unsigned char* blk = rp[m][hh] + (unsigned long long)b * QB;
                uint4 h = *reinterpret_cast<const uint4*>(blk);
#pragma unroll
                for (int j = 0; j < 4; j++) qw[m][hh][j] = *reinterpret_cast<const uint2*>(blk + QS_AT + 32u * j + 8u * t);
                float d = __half2float(__ushort_as_half((unsigned short)(h.x & 0xFFFFu)));
                float dmin = __half2float(__ushort_as_half((unsigned short)(h.x >> 16)));
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    unsigned sm = k4_scale_min(h.y, h.z, h.w, 2u * t + i);
                    dsc[m][hh][i] = __fmul_rn(d, qfloat(sm & 0xFFu));
                    dmn[m][hh][i] = __fmul_rn(dmin, qfloat(sm >> 8));
                }
            }
#pragma unroll
        for (unsigned j = 0; j < 4; j++)
#pragma unroll
            for (unsigned lohi = 0; lohi < 2; lohi++) {
                float c[MT][4] = {};
                const unsigned magic = lohi ? 0x54545454u : 0x64646464u, bias2 = lohi ? 0x54005400u : 0x64006400u;
#pragma unroll
                for (unsigned h = 0; h < 2; h++) {
                    unsigned e = b * QK + 64u * j + 32u * lohi + 8u * t + 4u * h;
                    uint2 bx = g < 3u ? *reinterpret_cast<const uint2*>(xp + (unsigned long long)g * cols + e) : make_uint2(0u, 0u);
#pragma unroll
                    for (int m = 0; m < MT; m++) {
                        unsigned w0 = h ? qw[m][0][j].y : qw[m][0][j].x, w1 = h ? qw[m][1][j].y : qw[m][1][j].x;
                        unsigned mask = lohi ? 0xF0F0F0F0u : 0x0F0F0F0Fu;
                        w0 &= mask, w1 &= mask;
                        unsigned a[4] = {bias_sub(__byte_perm(w0, magic, 0x4140), bias2),
                                         bias_sub(__byte_perm(w1, magic, 0x4140), bias2),
                                         bias_sub(__byte_perm(w0, magic, 0x4342), bias2),
                                         bias_sub(__byte_perm(w1, magic, 0x4342), bias2)};
                        mma16816(c[m], a, bx.x, bx.y);
                    }
                }
                unsigned src = (lane & ~3u) | j;
                float xs = xsub[(b * QK + 64u * j + 32u * lohi) / 32u];
#pragma unroll
                for (int m = 0; m < MT; m++) {
                    float o0 = __shfl_down_sync(0xFFFFFFFFu, c[m][0], 1), o2 = __shfl_down_sync(0xFFFFFFFFu, c[m][2], 1);
                    float s0 = __shfl_sync(0xFFFFFFFFu, dsc[m][0][lohi], src), s1 = __shfl_sync(0xFFFFFFFFu, dsc[m][1][lohi], src);
                    float n0 = __shfl_sync(0xFFFFFFFFu, dmn[m][0][lohi], src), n1 = __shfl_sync(0xFFFFFFFFu, dmn[m][1][lohi], src);
                    float S0 = __fadd_rn(__fadd_rn(c[m][0], c[m][1]), o0), S1 = __fadd_rn(__fadd_rn(c[m][2], c[m][3]), o2);
                    acc[m][0] = __fadd_rn(acc[m][0], __fsub_rn(__fmul_rn(s0, S0), __fmul_rn(n0, xs)));
                    acc[m][1] = __fadd_rn(acc[m][1], __fsub_rn(__fmul_rn(s1, S1), __fmul_rn(n1, xs)));
                }
            }
    }
    if (t == 0)
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                unsigned r = row0 + 16u * m + g + 8u * hh;
                if (r < rows) out[r] = acc[m][hh];
            }
}

// ---- Integer dot products on limbs of x (what the issue's "no quantised activations"
// rules out, measured to see whether any form exact to f32 reaches 60%) ----
// x per 32-element sub-block s as a 24-bit integer xi = round(x·2^(23−e_s)) (max |x| of the
// sub-block below 2^e_s: an error of at most half a unit of the largest input's last bit,
// f32's own rounding there), split into bytes xi = l2·2^16 + l1·2^8 + l0 (l0, l1 unsigned,
// l2 signed), four elements' bytes to a word. S = Σ q·xi by dp4a per limb, in int32 exactly,
// then float(S2)·2^16 + float(S1)·2^8 + float(S0) times 2^(e_s−23); X precomputed per 16.
// S of row slice q over group g from the group's limb words L0, L1, L2 and scale sc.
__device__ __forceinline__ float limb_dot(const uint4& q, unsigned g, const unsigned (&L0)[4], const unsigned (&L1)[4],
                                          const unsigned (&L2)[4], float sc) {
    unsigned qw[4] = {q.x, q.y, q.z, q.w};
    unsigned s0 = 0, s1 = 0;
    int s2 = 0;
#pragma unroll
    for (int wd = 0; wd < 4; wd++) {
        unsigned qb = (qw[wd] >> (4u * g)) & 0x0F0F0F0Fu;
        s0 = __dp4a(qb, L0[wd], s0);
        s1 = __dp4a(qb, L1[wd], s1);
        s2 = __dp4a((int)qb, (int)L2[wd], s2);
    }
    return __fmul_rn(__fadd_rn(__fadd_rn(__fmul_rn((float)s2, 65536.0f), __fmul_rn((float)s1, 256.0f)), (float)s0), sc);
}

struct LimbX {
    const uint4* limbs;   // limb j's words of elements 4k .. 4k + 3 at word j·cols/4 + k
    const float* xsum;    // Σ x of each 16 elements
    const float* xscale;  // 2^(e_s − 23) of each 32-element sub-block
    unsigned cols;
    // The three limbs' words of the 16 elements from e.
    __device__ __forceinline__ void words(unsigned e, unsigned (&L)[3][4]) const {
#pragma unroll
        for (unsigned j = 0; j < 3; j++) {
            uint4 v = limbs[(j * cols + e) / 16];
            L[j][0] = v.x, L[j][1] = v.y, L[j][2] = v.z, L[j][3] = v.w;
        }
    }
    template <int N>
    __device__ __forceinline__ void operator()(const uint4 (&q)[N], unsigned g, unsigned e, float (&S)[N], float& xs) const {
        unsigned L[3][4];
        words(e, L);
        float sc = xscale[e / 32];
        xs = xsum[e / 16];
#pragma unroll
        for (int a = 0; a < N; a++) S[a] = limb_dot(q[a], g, L[0], L[1], L[2], sc);
    }
    // xreg_m1's resident form, as FloatX's.
    struct Regs {
        unsigned l[2][3][4];
        float xs[2], sc[2];
    };
    __device__ __forceinline__ void load(Regs& r, unsigned e0) const {
#pragma unroll
        for (unsigned g = 0; g < 2; g++) {
            unsigned e = e0 + 32u * g;
            words(e, r.l[g]);
            r.xs[g] = xsum[e / 16], r.sc[g] = xscale[e / 32];
        }
    }
    __device__ __forceinline__ float dot(const Regs& r, const uint4& q, unsigned g) const {
        return limb_dot(q, g, r.l[g][0], r.l[g][1], r.l[g][2], r.sc[g]);
    }
};

// Median time of one launch of `f` in µs (300 ms warm-up, 7 runs of ~30 ms).
template <class F>
float time_us(F f) {
    cudaEvent_t a, b;
    cudaEventCreate(&a), cudaEventCreate(&b);
    auto run = [&](int n) {
        cudaEventRecord(a);
        for (int i = 0; i < n; i++) f(i);
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        return ms;
    };
    float one = run(10) / 10;
    int n = std::max(1, (int)(30.0f / one));
    for (float t = 0; t < 300.0f;) t += run(n);
    std::vector<float> v;
    for (int i = 0; i < 7; i++) v.push_back(run(n) * 1000.0f / n);
    std::sort(v.begin(), v.end());
    return v[3];
}

// Host f64 reference of row r of a Q4_K matrix (cols wide) times x: ggml's dequantised
// weights, summed in double.
static double reference_row(const std::vector<unsigned char>& m, unsigned r, unsigned cols, const std::vector<float>& x) {
    auto f16 = [](const unsigned char* p) {
        __half_raw h;
        h.x = (unsigned short)(p[0] | p[1] << 8);
        return (double)__half2float(__half(h));
    };
    auto scale_min = [](const unsigned char* q, unsigned j, unsigned& sc, unsigned& mn) {
        if (j < 4) sc = q[j] & 63, mn = q[j + 4] & 63;
        else sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    };
    double s = 0;
    const unsigned char* row = m.data() + (size_t)r * (cols / QK * QB);
    for (unsigned b = 0; b < cols / QK; b++) {
        const unsigned char* blk = row + b * QB;
        double d = f16(blk), dmin = f16(blk + 2);
        for (unsigned i = 0; i < QK; i++) {
            unsigned j = i / 32, l = i % 32, sc, mn;
            scale_min(blk + 4, j, sc, mn);
            unsigned byte = blk[QS_AT + 32 * (j / 2) + l], q = j & 1 ? byte >> 4 : byte & 0xF;
            float wv = (float)((float)d * sc) * q - (float)((float)dmin * mn);
            s += (double)wv * x[b * QK + i];
        }
    }
    return s;
}

int main(int argc, char** argv) {
    const unsigned hid = 4096, inter = 1536, pool = 48, k = 8, lm_rows = 151936, gu_rows = 2 * k * inter;
    const unsigned long long emat = (unsigned long long)inter * (hid / QK) * QB;  // one expert's gate
    const unsigned long long lm = (unsigned long long)lm_rows * (hid / QK) * QB;
    // Random quants; every block's d and dmin a small positive f16, its scales random.
    auto fill = [](std::vector<unsigned char>& b, unsigned seed) {
        unsigned s = seed * 2654435761u | 1u;
        for (auto& c : b) s ^= s << 13, s ^= s >> 17, s ^= s << 5, c = (unsigned char)s;
        for (size_t o = 0; o + QB <= b.size(); o += QB) b[o + 1] = 0x1C, b[o + 3] = 0x1C;  // d, dmin ~ 2^-8
    };
    std::vector<unsigned char> hg(emat * pool), hu(emat * pool), hl(lm);
    fill(hg, 1), fill(hu, 2), fill(hl, 3);
    std::vector<float> hx(hid);
    for (unsigned i = 0; i < hid; i++) hx[i] = ((i * 7919u) % 2001u) / 1000.0f - 1.0f;
    // x as three f16 pieces (x = x0 + x1 + x2) and its 32-element sums, for the mma probe.
    std::vector<__half> hp(3 * hid);
    std::vector<float> hxs(hid / 32, 0.0f);
    for (unsigned i = 0; i < hid; i++) {
        __half a = __float2half_rn(hx[i]);
        float r = hx[i] - __half2float(a);
        __half b = __float2half_rn(r);
        hp[i] = a, hp[hid + i] = b, hp[2 * hid + i] = __float2half_rn(r - __half2float(b));
        hxs[i / 32] += hx[i];
    }
    // x as 24-bit integers per 32-element sub-block, in three byte limbs (LimbX).
    std::vector<unsigned> hlimb(3 * hid / 4, 0u);
    std::vector<float> hsum16(hid / 16, 0.0f), hscale(hid / 32);
    for (unsigned sb = 0; sb < hid / 32; sb++) {
        float mx = 0;
        for (unsigned i = 0; i < 32; i++) mx = std::max(mx, std::abs(hx[32 * sb + i]));
        int e;
        std::frexp(mx, &e);
        if (std::lrint(std::ldexp((double)mx, 23 - e)) >= (1 << 23)) e++;
        hscale[sb] = std::ldexp(1.0f, e - 23);
        for (unsigned i = 0; i < 32; i++) {
            unsigned el = 32 * sb + i;
            int xi = (int)std::lrint(std::ldexp((double)hx[el], 23 - e));
            for (unsigned j = 0; j < 3; j++) hlimb[(j * hid + el) / 4] |= ((unsigned)(xi >> (8 * j)) & 0xFFu) << (8 * (el % 4));
        }
    }
    for (unsigned i = 0; i < hid; i++) hsum16[i / 16] = hsum16[i / 16] + hx[i];
    unsigned char *g, *u, *l;
    float *x, *out, *xs, *sum16, *scale;
    uint4* limb;
    __half* xp;
    unsigned long long* offs;
    CHECK(cudaMalloc(&g, hg.size()));
    CHECK(cudaMalloc(&u, hu.size()));
    CHECK(cudaMalloc(&l, hl.size()));
    CHECK(cudaMalloc(&x, hid * 4));
    CHECK(cudaMalloc(&xs, hid / 32 * 4));
    CHECK(cudaMalloc(&xp, 3 * hid * 2));
    CHECK(cudaMalloc(&out, (size_t)lm_rows * 4));
    CHECK(cudaMalloc(&offs, pool * 8));
    CHECK(cudaMemcpy(g, hg.data(), hg.size(), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(u, hu.data(), hu.size(), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(l, hl.data(), hl.size(), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(x, hx.data(), hid * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(xs, hxs.data(), hid / 32 * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(xp, hp.data(), 3 * hid * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&limb, 3 * hid));
    CHECK(cudaMalloc(&sum16, hid / 16 * 4));
    CHECK(cudaMalloc(&scale, hid / 32 * 4));
    CHECK(cudaMemcpy(limb, hlimb.data(), 3 * hid, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(sum16, hsum16.data(), hid / 16 * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(scale, hscale.data(), hid / 32 * 4, cudaMemcpyHostToDevice));
    const LimbX limbs{limb, sum16, scale, hid};
    std::vector<unsigned long long> ho(pool);
    for (unsigned e = 0; e < pool; e++) ho[e] = e * emat;
    CHECK(cudaMemcpy(offs, ho.data(), pool * 8, cudaMemcpyHostToDevice));
    unsigned long long zero = 0, *zoff;
    CHECK(cudaMalloc(&zoff, 8));
    CHECK(cudaMemcpy(zoff, &zero, 8, cudaMemcpyHostToDevice));
    // argv[1]: a kernel (below) for the ncu run: 2000 warm-up launches, then one of it.
    int pick = argc > 1 ? atoi(argv[1]) : -1;
    auto report = [&](const char* what, auto launch, double bytes) {
        if (pick >= 0) {
            for (int i = 0; i < 2000; i++) launch(i);
            launch(0);
            cudaDeviceSynchronize();
            return;
        }
        float us = time_us(launch);
        printf("%-52s %8.1f us %6.0f GB/s (%.1f%% of 4.8 TB/s)\n", what, us, bytes / us / 1e3, bytes / us / 1e3 / 48.0);
    };
    double bg = 2.0 * k * emat, bm = (double)lm, bgu = (double)gu_rows * (hid / QK) * QB;
    auto slice = [&](auto lanes, auto rpt) {
        constexpr unsigned L = decltype(lanes)::value;
        constexpr int R = decltype(rpt)::value;
        constexpr unsigned per = WG / L * R;  // rows per workgroup
        char name[96];
        snprintf(name, sizeof name, "slice %u lanes %d rows: gate/up 8x1536x4096", L, R);
        // Eight of the pool's 48 experts a launch, a different eight each time (past L2).
        report(name, [&](int i) {
            slice_m1<2, L, R><<<dim3((inter + per - 1) / per, k), WG>>>(g, u, offs + (i % 6) * k, FloatX{x, 0x4B000000u}, out, inter, hid);
        }, bg);
        snprintf(name, sizeof name, "slice %u lanes %d rows: matvec 151936x4096", L, R);
        report(name, [&](int) {
            slice_m1<1, L, R><<<dim3((lm_rows + per - 1) / per, 1), WG>>>(l, l, zoff, FloatX{x, 0x4B000000u}, out, lm_rows, hid);
        }, bm);
    };
    auto mma = [&](auto mt) {
        constexpr int MT = decltype(mt)::value;
        constexpr unsigned per = WG / 32 * 16 * MT;
        char name[96];
        snprintf(name, sizeof name, "mma %d tiles: matvec 24576x4096 (gate/up bytes)", MT);
        report(name, [&](int i) {
            // The pool's gate matrices hold 48 x 1536 rows; a different 24576 a launch.
            mma_m1<MT><<<(gu_rows + per - 1) / per, WG>>>(g + (i % 3) * 16 * emat, xp, xs, out, gu_rows, hid);
        }, bgu);
        snprintf(name, sizeof name, "mma %d tiles: matvec 151936x4096", MT);
        report(name, [&](int) { mma_m1<MT><<<(lm_rows + per - 1) / per, WG>>>(l, xp, xs, out, lm_rows, hid); }, bm);
    };
    auto idot = [&](auto rpt) {
        constexpr int R = decltype(rpt)::value;
        constexpr unsigned per = WG / 32 * R;
        char name[96];
        snprintf(name, sizeof name, "idot %d rows: gate/up 8x1536x4096", R);
        report(name, [&](int i) {
            slice_m1<2, 32, R><<<dim3((inter + per - 1) / per, k), WG>>>(g, u, offs + (i % 6) * k, limbs, out, inter, hid);
        }, bg);
        snprintf(name, sizeof name, "idot %d rows: matvec 151936x4096", R);
        report(name, [&](int) {
            slice_m1<1, 32, R><<<dim3((lm_rows + per - 1) / per, 1), WG>>>(l, l, zoff, limbs, out, lm_rows, hid);
        }, bm);
    };
    auto xr = [&](auto rb, auto in, const char* form) {
        constexpr int RB = decltype(rb)::value;
        char name[96];
        snprintf(name, sizeof name, "xreg %s %d rows: gate/up 8x1536x4096", form, RB);
        report(name, [&](int i) {
            xreg_m1<2, RB><<<dim3((inter + RB - 1) / RB, k), WG>>>(g, u, offs + (i % 6) * k, in, out, inter, hid);
        }, bg);
        snprintf(name, sizeof name, "xreg %s %d rows: matvec 151936x4096", form, RB);
        report(name, [&](int) {
            xreg_m1<1, RB><<<dim3((lm_rows + RB - 1) / RB, 1), WG>>>(l, l, zoff, in, out, lm_rows, hid);
        }, bm);
    };
    using U = unsigned;
    using I = int;
    if (pick < 0) {
        // Correctness: both kernels against the f64 reference on the LM-head matrix.
        std::vector<float> o(lm_rows);
        auto check = [&](const char* what) {
            CHECK(cudaMemcpy(o.data(), out, lm_rows * 4, cudaMemcpyDeviceToHost));
            double worst = 0, scale = 0;
            for (unsigned r = 0; r < lm_rows; r += 997) {
                double ref = reference_row(hl, r, hid, hx);
                worst = std::max(worst, std::abs(o[r] - ref)), scale = std::max(scale, std::abs(ref));
            }
            printf("%s: max |out - f64 reference| %.3g (largest |reference| %.3g)\n", what, worst, scale);
            return 0;
        };
        slice_m1<1, 32, 1><<<lm_rows / 4, WG>>>(l, l, zoff, FloatX{x, 0x4B000000u}, out, lm_rows, hid);
        check("slice");
        mma_m1<1><<<(lm_rows + 63) / 64, WG>>>(l, xp, xs, out, lm_rows, hid);
        check("mma 1 tile");
        mma_m1<2><<<(lm_rows + 127) / 128, WG>>>(l, xp, xs, out, lm_rows, hid);
        check("mma 2 tiles");
        slice_m1<1, 32, 1><<<lm_rows / 4, WG>>>(l, l, zoff, limbs, out, lm_rows, hid);
        check("idot");
        // xreg_m1 against slice_m1, byte for byte: the LM-head matvec and a gate/up.
        auto same = [&](const char* what, size_t n, auto ref, auto run) {
            std::vector<float> a(n), b(n);
            ref();
            CHECK(cudaMemcpy(a.data(), out, n * 4, cudaMemcpyDeviceToHost));
            CHECK(cudaMemset(out, 0xFF, n * 4));
            run();
            CHECK(cudaMemcpy(b.data(), out, n * 4, cudaMemcpyDeviceToHost));
            size_t diff = 0;
            for (size_t i = 0; i < n; i++) diff += memcmp(&a[i], &b[i], 4) != 0;
            printf("%s: %zu of %zu outputs differ in bytes from slice_m1\n", what, diff, n);
            return 0;
        };
        auto both = [&](const char* form, auto in) {
            char what[64];
            snprintf(what, sizeof what, "xreg %s 16 rows matvec", form);
            same(what, lm_rows, [&] { slice_m1<1, 32, 1><<<lm_rows / 4, WG>>>(l, l, zoff, in, out, lm_rows, hid); },
                 [&] { xreg_m1<1, 16><<<dim3(lm_rows / 16, 1), WG>>>(l, l, zoff, in, out, lm_rows, hid); });
            snprintf(what, sizeof what, "xreg %s 16 rows gate/up", form);
            same(what, (size_t)k * inter,
                 [&] { slice_m1<2, 32, 1><<<dim3(inter / 4, k), WG>>>(g, u, offs, in, out, inter, hid); },
                 [&] { xreg_m1<2, 16><<<dim3(inter / 16, k), WG>>>(g, u, offs, in, out, inter, hid); });
            snprintf(what, sizeof what, "xreg %s 8 rows gate/up", form);
            same(what, (size_t)k * inter,
                 [&] { slice_m1<2, 32, 1><<<dim3(inter / 4, k), WG>>>(g, u, offs, in, out, inter, hid); },
                 [&] { xreg_m1<2, 8><<<dim3(inter / 8, k), WG>>>(g, u, offs, in, out, inter, hid); });
        };
        both("f32", FloatX{x, 0x4B000000u});
        both("limbs", limbs);
    }
    if (pick < 0 || pick == 0) slice(std::integral_constant<U, 32>(), std::integral_constant<I, 1>());
    if (pick < 0 || pick == 1) slice(std::integral_constant<U, 32>(), std::integral_constant<I, 2>());
    if (pick < 0 || pick == 2) mma(std::integral_constant<I, 1>());
    if (pick < 0 || pick == 3) mma(std::integral_constant<I, 2>());
    if (pick < 0 || pick == 4) idot(std::integral_constant<I, 1>());
    if (pick < 0 || pick == 5) idot(std::integral_constant<I, 2>());
    if (pick < 0 || pick == 6) xr(std::integral_constant<I, 8>(), FloatX{x, 0x4B000000u}, "f32");
    if (pick < 0 || pick == 7) xr(std::integral_constant<I, 16>(), FloatX{x, 0x4B000000u}, "f32");
    if (pick < 0 || pick == 8) xr(std::integral_constant<I, 16>(), limbs, "limbs");
    CHECK(cudaGetLastError());
    return 0;
}
