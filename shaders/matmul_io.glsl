// The matmul kernels' push constants and where a product's rows go (matmul.comp): an
// expert-table entry, token p's input row, its output row, a row's place in a stack of
// matrices that share the input, and the store of a result.

layout(push_constant) uniform Params {
    uint rows;       // output rows of this dispatch
    uint cols;       // inputs per row
    uint m;          // tokens (without FLAG_TABLE)
    uint w_off;      // offset of row 0 in the weight binding (gate), in weight units
    uint w2_off;     // offset of row 0 of the up weights (GATE_UP only), in weight units
    uint x_off;      // act offset of token 0's input
    uint x_stride;   // act elements between tokens' inputs
    uint out_off;    // act offset of (token 0, row 0) of the output
    uint out_stride; // act elements between tokens' outputs
    uint map_off;    // route_u offset of the token map (GATHER / SCATTER)
    uint map_div;    // divisor applied to gathered indices
    uint flags;
    uint tab_off;    // route_u offset of the expert table (FLAG_TABLE)
    // A stack of up to four matrices with one input (an attention's q, k, v and output
    // gate, stored one after another): the rows from split1 on belong to the second,
    // whose row split1 is written at out2_off, and so on; ~0u splits for one matrix.
    uint split1;
    uint out2_off;
    uint split2;
    uint out3_off;
    uint split3;
    uint out4_off;
    uint wt_off;     // route_f offset of the routing weights (FLAG_COMBINE)
    // Tokens each workgroup row takes (a token-batched product without FLAG_TABLE; a
    // multiple of TB): workgroup y takes tokens y·span .. y·span + span − 1; 0: all.
    uint span;
    // 0x4B000000, the bits of 2^23 (the exponent slice_dot.glsl's byte_float masks quants
    // under), passed at run time: as a constant, ptxas (sm_90) masks and merges it in two
    // instructions a weight, from a register in one (the CUDA twin's
    // register-resident Q4_K gate/up, bench/probes/q4k_m1.cu: 15% fewer instructions).
    uint two23;
#ifdef FRONT
    // The router and ranking of a FRONT gate/up (matmul.comp): route.comp's TABLE push
    // constants for one tier buffer; the router's rows are `ne`, its inputs `cols` at x_off.
    uint ne;         // experts
    uint k;          // experts per token
    uint ranks;      // experts ranked (k, or k + bets)
    uint norm;       // renormalise the top-k weights
    uint logits;     // act offset of the token's gate logits
    uint slot_off;   // slots offset of this layer's first expert
    uint tab_out;    // routing-buffer offset of the routing words
    uint io_out;     // io offset of the ranking's copy for the host
    // NORM_IN (matmul.comp): the act offset where workgroup 0 stores the normed input
    // row, and the norm's epsilon.
    uint norm_out;
    float eps;
#endif
} pc;

// Expert-table entry j (FLAG_TABLE: route_u[tab_off + 3j ..]): its weight byte offset,
// first pair and pair count; without the flag (0, 0, m).
uvec3 table_entry(uint j) {
    if ((pc.flags & FLAG_TABLE) == 0u) {
        return uvec3(0u, 0u, pc.m);
    }
    uint te = pc.tab_off + 3u * j;
    return uvec3(route_u[te], route_u[te + 1u], route_u[te + 2u]);
}

uint x_row(uint p) {
    return (pc.flags & FLAG_GATHER) != 0u ? route_u[pc.map_off + p] / pc.map_div : p;
}

uint out_row(uint p) {
    return (pc.flags & FLAG_SCATTER) != 0u ? route_u[pc.map_off + p] : p;
}

// Act offset of row `row` of token 0's output (its stack member's).
uint out_at(uint row) {
    if (row < pc.split1) {
        return pc.out_off + row;
    }
    if (row < pc.split2) {
        return pc.out2_off + (row - pc.split1);
    }
    if (row < pc.split3) {
        return pc.out3_off + (row - pc.split2);
    }
    return pc.out4_off + (row - pc.split3);
}

// Stores result val at act offset o, or adds it there (FLAG_ACCUMULATE: a residual add).
void store_out(uint o, float val) {
    if ((pc.flags & FLAG_ACCUMULATE) != 0u) {
        precise float sum = ACT(o) + val;
        ACT(o) = sum;
    } else {
        ACT(o) = val;
    }
}
