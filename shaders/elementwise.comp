#version 450
// The hybrid layers' sigmoid gates, element by element.
// SIGMOID_MUL (`sigmoid_mul`): dst[i] ⊙= σ(gate[i]) over n elements (the attention
//   output gate; dst and gate rows are equally wide and contiguous).
// GATED_ADD (`gated_add`): x[t][d] += σ(gate[t]) · src[t][d] (the shared expert's gate;
//   workgroup y = row t).
// σ(v) = 1 / (1 + e^−v), as actors/src/cpu/delta.rs's sigmoid.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256) in;

#ifdef SIGMOID_MUL
layout(push_constant) uniform Params {
    uint n;         // elements
    uint dst_off;
    uint gate_off;
} pc;

void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i >= pc.n) {
        return;
    }
    float g = act[pc.gate_off + i];
    precise float y = act[pc.dst_off + i] * sigmoid(g);
    act[pc.dst_off + i] = y;
}
#else
layout(push_constant) uniform Params {
    uint h;           // row width
    uint src_off;
    uint gate_off;    // act offset of row 0's gate logit
    uint gate_stride; // act elements between gate logits
    uint x_off;
} pc;

void main() {
    uint d = gl_GlobalInvocationID.x;
    uint t = gl_WorkGroupID.y;
    if (d >= pc.h) {
        return;
    }
    float g = act[pc.gate_off + t * pc.gate_stride];
    precise float s = sigmoid(g);
    uint xi = pc.x_off + t * pc.h + d;
    precise float x = act[xi] + s * act[pc.src_off + t * pc.h + d];
    act[xi] = x;
}
#endif
