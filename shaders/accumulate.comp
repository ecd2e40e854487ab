#version 450
// MoE combine for token t (workgroup y): x[t] += sum over ranks r (in rank order) of
// weight[t][r] * y[t][r], the sum formed first and added to the residual last, as the
// CPU reference does.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256) in;

layout(push_constant) uniform Params {
    uint h;       // hidden size
    uint k;       // experts per token
    uint y_off;   // act offset of y[0][0] (rows of h, indexed t * k + r)
    uint x_off;   // act offset of x[0]
    uint w_off;   // route_f offset of weight[0][0]
} pc;

void main() {
    uint d = gl_GlobalInvocationID.x;
    uint t = gl_WorkGroupID.y;
    if (d >= pc.h) {
        return;
    }
    precise float a = 0.0;
    for (uint r = 0u; r < pc.k; r++) {
        uint i = t * pc.k + r;
        a = a + act[pc.y_off + i * pc.h + d] * route_f[pc.w_off + i];
    }
    uint xi = pc.x_off + t * pc.h + d;
    precise float x = act[xi] + a;
    act[xi] = x;
}
