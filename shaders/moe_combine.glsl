// The MoE combine of one element (accumulate.comp, and rmsnorm.comp's ACCUMULATE variant,
// which normalises the combined row for the next layer in the same dispatch): residual
// res + the sum over ranks r (in rank order) of weight[t][r] · y[t][r][d], the sum formed
// first and added to the residual last, as the CPU reference does. y rows are h floats at
// act offset y_off (indexed t · k + r); the weights are k per token at route_f offset
// w_off. The first 16 ranks' outputs and weights are requested at once, then summed in
// rank order; ranks past 16 are read one at a time.
float moe_combined(uint h, uint k, uint y_off, uint w_off, uint t, uint d, float res) {
    float yv[16], wv[16];
#define LOAD if (r < k) {                                                      \
        uint i = t * k + r;                                                    \
        yv[r] = act[y_off + i * h + d];                                        \
        wv[r] = route_f[w_off + i];                                            \
    }
    FOR16(r, LOAD)
#undef LOAD
    precise float a = 0.0;
    FOR16(r, if (r < k) { a = a + yv[r] * wv[r]; })
    for (uint r = 16u; r < k; r++) {
        uint i = t * k + r;
        a = a + act[y_off + i * h + d] * route_f[w_off + i];
    }
    precise float x = res + a;
    return x;
}
