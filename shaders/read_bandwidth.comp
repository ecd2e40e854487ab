#version 450
// Memory-read ceiling for the benchmarks (`vulkan kernels`): every invocation streams
// 16-byte words of the bound buffer in a grid-stride loop with four loads in flight and
// folds them with xor, so the kernel does nothing but read. Its rate is what the matmul
// kernels' achieved bandwidth is compared against, besides the card's rated figure.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256) in;

layout(set = 0, binding = 0) readonly buffer Data { uvec4 data[]; };

layout(push_constant) uniform Params {
    uint n;       // 16-byte words to read
    uint out_off; // act offset of one result per invocation
} pc;

void main() {
    uint stride = gl_NumWorkGroups.x * WG_SIZE;
    uint i = gl_GlobalInvocationID.x;
    uvec4 a = uvec4(0u);
    uvec4 b = uvec4(0u);
    uvec4 c = uvec4(0u);
    uvec4 d = uvec4(0u);
    for (; i + 3u * stride < pc.n; i += 4u * stride) {
        a ^= data[i];
        b ^= data[i + stride];
        c ^= data[i + 2u * stride];
        d ^= data[i + 3u * stride];
    }
    for (; i < pc.n; i += stride) {
        a ^= data[i];
    }
    uvec4 s = a ^ b ^ c ^ d;
    act[pc.out_off + gl_GlobalInvocationID.x] = uintBitsToFloat(s.x ^ s.y ^ s.z ^ s.w);
}
