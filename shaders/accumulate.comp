#version 450
// MoE combine for token t (workgroup y): x[t] += the weighted sum of its ranks' expert
// outputs (moe_combine.glsl). A decode step's combine followed by the next layer's input
// norm runs as rmsnorm.comp's ACCUMULATE variant instead.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "moe_combine.glsl"

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
    uint xi = pc.x_off + t * pc.h + d;
    act[xi] = moe_combined(pc.h, pc.k, pc.y_off, pc.w_off, t, d, act[xi]);
}
