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
    // The first 16 ranks' outputs and weights (and the residual) are requested at once,
    // then summed in rank order; ranks past 16 are read one at a time.
    uint xi = pc.x_off + t * pc.h + d;
    float res = act[xi];
    float yv[16], wv[16];
#define LOAD if (r < pc.k) {                                                   \
        uint i = t * pc.k + r;                                                 \
        yv[r] = act[pc.y_off + i * pc.h + d];                                  \
        wv[r] = route_f[pc.w_off + i];                                         \
    }
    FOR16(r, LOAD)
    precise float a = 0.0;
    FOR16(r, if (r < pc.k) { a = a + yv[r] * wv[r]; })
    for (uint r = 16u; r < pc.k; r++) {
        uint i = t * pc.k + r;
        a = a + act[pc.y_off + i * pc.h + d] * route_f[pc.w_off + i];
    }
    precise float x = res + a;
    act[xi] = x;
}
