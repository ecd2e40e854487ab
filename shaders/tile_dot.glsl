// The dot products of matmul.comp's token-batched float kernels (TILED: f32, bf16, f16
// weights) through workgroup memory, included by it after the weight types. The
// summation order is common.glsl's, unchanged: lane l of a lane group still takes chunks
// l, l + LANES, ... of its rows in order and adds each product by one fma, so these
// kernels give the bytes of the m=1 kernels (and of the batched kernels before them).
// What changes is where the operands come from. A workgroup's lane groups split its rows
// and a pass's tokens: lane group g takes rows (g / TG)·RPT .. + RPT − 1 of the
// workgroup's and tokens (g % TG)·TB .. + TB − 1 of the pass's TG·TB. For every tile of
// TC consecutive chunks of the rows (in order), the whole workgroup first copies the
// tile's weights of all its rows (widened to f32) and the pass's inputs into workgroup
// memory, then each lane multiplies its chunks of the tile from there. So each weight is
// read from device memory once per pass of TG·TB tokens instead of once per TB, and each
// input once per workgroup instead of once per lane group.
//
// Workgroup memory `sm4`, in vec4 (NH per chunk): row-matrix m (row m / NACC of the
// workgroup, gate (0) or up (1) weights by m % NACC) at WS_AT(m, h, c), token t of the
// pass at XS_AT(t, h, c), where c is the chunk within the tile and h its vec4; a lane's
// vec4 loads of consecutive chunks are consecutive, so they meet no bank conflicts. The
// cross-lane tree reuses the same memory as `red` (RED) after the tiles.

#define TC 32u     // chunks per tile
#define MAX_RM 24u // row-matrices (rows × NACC) per workgroup
#define MAX_PT 16u // tokens per pass (TG · TB)
#define NH (CHUNK / 4u)
#if defined(BF16) || defined(F16) // CHUNK 8: two vec4 a chunk
#define FOR_H(B) FOR2(h, B)
#else
#define FOR_H(B) FOR1(h, B)
#endif
shared vec4 sm4[(MAX_RM + MAX_PT) * NH * TC];
shared uint xrow_s[MAX_PT]; // act offset of each token's input row in this pass
#define WS_AT(m, h, c) ((((m) * NH) + (h)) * TC + (c))
#define XS_AT(t, h, c) WS_AT(MAX_RM + (t), (h), (c))
#define RED(i) sm4[(i) >> 2][(i) & 3u]
// Row-matrices of the workgroup.
#define RM ((WG_SIZE / LANES / TG) * RPT * NACC)

// Each token's input row of the pass starting at t0 (the last token again past n).
#define TILE_ROWS                                                                         \
    if (f < TG * TB) {                                                                    \
        xrow_s[f] = pc.x_off + x_row(p0 + min(t0 + f, n - 1u)) * pc.x_stride;            \
    }

// The tile of chunks ct .. ct + TC − 1 (the last chunk again past nch) into sm4: weights,
// then inputs, spread over the workgroup's invocations in order of address.
#define TILE_STAGE                                                                        \
    for (uint it = f; it < RM * TC; it += WG_SIZE) {                                      \
        uint m = it / TC;                                                                 \
        uint cc = min(ct + it % TC, nch - 1u);                                            \
        uint row = min(rowb_wg + m / NACC, pc.rows - 1u) * ROW_UNITS;                     \
        WVEC wq1;                                                                         \
        if (m % NACC == 0u) {                                                             \
            wq1 = wvec ? w4[(wo + row) / CHUNK + cc] : LOAD_W(wo + row, cc * CHUNK);      \
        } else {                                                                          \
            GU(wq1 = wvec ? u4[(uo + row) / CHUNK + cc] : LOAD_U(uo + row, cc * CHUNK);)  \
        }                                                                                 \
        float wv1[CHUNK];                                                                 \
        unpack(wq1, wv1);                                                                 \
        FOR_H(sm4[WS_AT(m, h, it % TC)] = vec4(wv1[4u * h], wv1[4u * h + 1u], wv1[4u * h + 2u], wv1[4u * h + 3u]);) \
    }                                                                                     \
    for (uint it = f; it < TG * TB * TC * NH; it += WG_SIZE) {                            \
        uint t = it / (TC * NH);                                                          \
        uint c = (it / NH) % TC;                                                          \
        uint hh = it % NH;                                                                \
        uint xo = xrow_s[t] + min(ct + c, nch - 1u) * CHUNK + 4u * hh;                    \
        sm4[XS_AT(t, hh, c)] = XV ? act4[xo >> 2] : vec4(ACT(xo), ACT(xo + 1u), ACT(xo + 2u), ACT(xo + 3u)); \
    }

// The tiles in order; in each, this lane's chunks (l, l + LANES, ... counted from chunk
// 0 of the row), each: its rows' weights, then every token's inputs and products.
#define MATMUL_DOT                                                                        \
    TILE_ROWS                                                                             \
    for (uint ct = 0u; ct < nch; ct += TC) {                                              \
        barrier();                                                                        \
        TILE_STAGE                                                                        \
        barrier();                                                                        \
        for (uint c = (lane + LANES - ct % LANES) % LANES; c < TC && ct + c < nch; c += LANES) { \
            float wv[MAX_RPT][CHUNK];                                                     \
            GU(float uv[MAX_RPT][CHUNK];)                                                 \
            FOR_R(TILE_WEIGHTS)                                                           \
            FOR_I(TILE_TOKEN)                                                             \
        }                                                                                 \
    }
#define TILE_WEIGHTS                                                                      \
    if (r < RPT) {                                                                        \
        uint m = (rg * RPT + r) * NACC;                                                   \
        FOR_H(TILE_W4)                                                                    \
    }
#define TILE_W4                                                                           \
    {                                                                                     \
        vec4 w4v = sm4[WS_AT(m, h, c)];                                                   \
        FOR4(j, wv[r][4u * h + j] = w4v[j];)                                              \
        GU(vec4 u4v = sm4[WS_AT(m + 1u, h, c)]; FOR4(j, uv[r][4u * h + j] = u4v[j];))     \
    }
#define TILE_TOKEN                                                                        \
    {                                                                                     \
        vec4 xq[NH];                                                                      \
        FOR_H(xq[h] = sm4[XS_AT(tok0 + i, h, c)];)                                        \
        FOR_R(ROW)                                                                        \
    }
