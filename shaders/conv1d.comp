#version 450
// Causal depthwise convolution and SiLU of a DeltaNet layer over the q | k | v channels
// of the Lin plane, in place, rolling the layer's conv state: invocation = channel; it
// runs the block's rows in order, so a row gets the bytes the single-token step gives it.
// out = silu(Σ_j<hist w[j] · state[j] + w[hist] · x), the sum in tap order (as
// actors/src/cpu/delta.rs's conv1d_step); the state (`[kernel − 1][channel]`, oldest
// input first) then drops its oldest input and takes x.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256) in;

layout(push_constant) uniform Params {
    uint c;          // channels (q | k | v)
    uint kernel;     // taps per channel
    uint lin_off;    // act offset of row 0's channels
    uint lin_stride; // act elements between rows
    uint s_off;      // offset of the layer's conv state in the state buffer
    uint rows;
} pc;

layout(set = 0, binding = 0) readonly buffer Taps { float taps[]; };
layout(set = 0, binding = 1) buffer State { float st[]; };

void main() {
    uint ch = gl_GlobalInvocationID.x;
    if (ch >= pc.c) {
        return;
    }
    uint hist = pc.kernel - 1u;
    uint wb = ch * pc.kernel;
    for (uint t = 0u; t < pc.rows; t++) {
        uint xi = pc.lin_off + t * pc.lin_stride + ch;
        float x = act[xi];
        precise float acc = 0.0;
        for (uint j = 0u; j < hist; j++) {
            acc = acc + taps[wb + j] * st[pc.s_off + j * pc.c + ch];
        }
        acc = acc + taps[wb + hist] * x;
        for (uint j = 1u; j < hist; j++) {
            st[pc.s_off + (j - 1u) * pc.c + ch] = st[pc.s_off + j * pc.c + ch];
        }
        if (hist > 0u) {
            st[pc.s_off + (hist - 1u) * pc.c + ch] = x;
        }
        act[xi] = silu(acc);
    }
}
