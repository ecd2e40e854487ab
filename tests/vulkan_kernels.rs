//! Every batched Vulkan kernel against its m=1 sibling, byte for byte, for every weight
//! type (f32, bf16, f16 and the ggml block formats) on awkward shapes (odd sizes, tails,
//! misaligned offsets, blocks on odd half-words, gathered and scattered rows); each
//! dequantised weight bitwise the CPU's; and the products against the CPU reference
//! within rounding.
#![cfg(feature = "vulkan")]

mod vulkan;

use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use smoe_actors::cpu::kernels;
use smoe_actors::cpu::quantize::encode_rows;
use smoe_actors::tensor::WeightView;
use smoe_actors::vulkan::harness::{
    weight_unit, AttentionArgs, AttentionShape, DeltaArgs, KernelHarness, MatmulArgs, MatmulTuning,
    Projection, RouteTableArgs, FLAG_ACCUMULATE, FLAG_GATHER, FLAG_SCATTER, FLAG_TABLE, WIDE_ROWS,
};
use smoe_proto::DType;

const SHAPES: &[(usize, usize, usize)] = &[
    (1, 1, 1),
    (3, 17, 5),
    (33, 31, 7),
    (257, 129, 3),
    (67, 64, 9),
    (130, 96, 17),
    (1031, 65, 2),
    (40, 2048, 11),
    // Enough rows that a batched dispatch splits its tokens into spans of two batches of
    // eight, the last one short (`MatmulArgs::split_tokens`).
    (4099, 64, 40),
    // Whole blocks of every format; Q8_0, Q4_0 and Q6_K rows of an odd number of blocks
    // start on odd half-words.
    (19, 256, 6),
    (65, 800, 3),
    (33, 1280, 9),
];

fn rand_vec(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A random f16 scale of either sign: mostly between `top` / 4 and `top` in magnitude,
/// one in eight subnormal.
fn f16_scale(rng: &mut ChaCha8Rng, top: f32) -> [u8; 2] {
    let v = if rng.random_range(0..8) == 0 {
        (2.0f32).powi(rng.random_range(-24..-14))
    } else {
        top * rng.random_range(0.25f32..1.0)
    };
    let v = if rng.random() { v } else { -v };
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// A `rows × cols` weight matrix stored as `dtype`: random values in [-1, 1) for the
/// float types (f16 with subnormals too), random blocks for the block formats (every
/// quant and sub-block scale bit pattern, f16 scales from [`f16_scale`]). Kept in words
/// so that f32 views are aligned.
struct Mat {
    dtype: DType,
    rows: usize,
    cols: usize,
    words: Vec<u32>,
}

impl Mat {
    fn random(rng: &mut ChaCha8Rng, dtype: DType, rows: usize, cols: usize) -> Mat {
        let n = rows * cols;
        let mut bytes: Vec<u8> = match dtype {
            DType::F32 | DType::Bf16 | DType::F16 => {
                let mut b = Vec::new();
                encode_rows(&rand_vec(rng, n), cols, dtype, &mut b).unwrap();
                if dtype == DType::F16 {
                    // One element in 17 a subnormal.
                    for e in b.chunks_exact_mut(2).step_by(17) {
                        let bits = rng.random_range(1u16..0x400) | if rng.random() { 0x8000 } else { 0 };
                        e.copy_from_slice(&bits.to_le_bytes());
                    }
                }
                b
            }
            _ => {
                let len = dtype.matrix_bytes(rows, cols).expect("whole blocks") as usize;
                let mut b = vec![0u8; len];
                rng.fill_bytes(&mut b);
                // The f16 scales of each block: d (Q8_0, Q4_0), d and dmin (Q4_K, Q5_K),
                // d at the end (Q6_K); sized so that weights stay below about 1/2 (the
                // largest quant times sub-block scale: 127, 8, 63·15, 63·31, 128·32).
                let (at, top): (&[usize], f32) = match dtype {
                    DType::Q8_0 => (&[0], 127.0),
                    DType::Q4_0 => (&[0], 8.0),
                    DType::Q4K => (&[0, 2], 945.0),
                    DType::Q5K => (&[0, 2], 1953.0),
                    DType::Q6K => (&[208], 4096.0),
                    _ => unreachable!("a block format"),
                };
                let block = dtype.row_bytes(dtype.block_elems()).unwrap();
                for blk in b.chunks_exact_mut(block) {
                    for &o in at {
                        blk[o..o + 2].copy_from_slice(&f16_scale(rng, 0.5 / top));
                    }
                }
                b
            }
        };
        bytes.resize(bytes.len().next_multiple_of(4), 0);
        let words = bytes.chunks_exact(4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])).collect();
        Mat { dtype, rows, cols, words }
    }

    /// The matrix as the engine views it.
    fn view(&self) -> WeightView<'_> {
        WeightView::from_bytes(self.dtype, bytemuck::cast_slice(&self.words), self.rows, self.cols)
    }

    /// Row `r` dequantised (widened) on the CPU, bitwise as ggml does.
    fn row_f32(&self, r: usize) -> Vec<f32> {
        let mut out = vec![0.0; self.cols];
        kernels::row_to_f32(&self.view(), r, &mut out);
        out
    }
}

/// The weight types whose rows can have `cols` elements (block formats need whole blocks).
fn dtypes(cols: usize) -> impl Iterator<Item = DType> {
    DType::ALL.into_iter().filter(move |d| d.row_bytes(cols).is_some())
}

/// Largest |a - b| relative to max(1, |b|).
fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0, f32::max)
}

#[test]
fn batched_matmul_is_byte_identical_to_matvec() {
    let Some(ctx) = vulkan::context() else { return };
    let h = KernelHarness::new(ctx, 1 << 20, 1024).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    // The last shape is an LM head's: its m=1 product takes the wide matvec.
    let wide = (WIDE_ROWS as usize + 3, 256, 2);
    for &(rows, cols, m) in SHAPES.iter().chain([&wide]) {
        let mats: Vec<Mat> = dtypes(cols).map(|d| Mat::random(&mut rng, d, rows, cols)).collect();
        // x_off 0 takes the vector path where shapes allow; 3 forces the scalar path.
        for x_off in [0usize, 3] {
            let xs = rand_vec(&mut rng, m * cols);
            h.write_act(x_off, &xs).unwrap();
            let out_b = 300_000;
            let out_1 = 600_000;
            for mat in &mats {
                let view = mat.view();
                let w = h.weight(&view, false).unwrap();
                let a = MatmulArgs {
                    m: m as u32,
                    x_off: x_off as u32,
                    x_stride: cols as u32,
                    out_off: out_b,
                    out_stride: rows as u32,
                    ..Default::default()
                };
                h.matmul(&w, a, true, 1).unwrap();
                for t in 0..m {
                    let a = MatmulArgs {
                        m: 1,
                        x_off: (x_off + t * cols) as u32,
                        x_stride: cols as u32,
                        out_off: out_1 + (t * rows) as u32,
                        out_stride: rows as u32,
                        ..Default::default()
                    };
                    h.matmul(&w, a, false, 1).unwrap();
                }
                let batched = h.read_act(out_b as usize, m * rows).unwrap();
                let single = h.read_act(out_1 as usize, m * rows).unwrap();
                assert_eq!(
                    bits(&batched),
                    bits(&single),
                    "{:?} rows {rows} cols {cols} m {m} x_off {x_off}",
                    w.dtype
                );
                let mut cpu = vec![0.0; m * rows];
                kernels::matmul(&view, &xs, m, &mut cpu);
                let d = max_rel(&single, &cpu);
                assert!(d < 1e-4, "matvec vs CPU: {d} ({:?} rows {rows} cols {cols})", w.dtype);
            }
        }
    }
}

#[test]
fn batched_gate_up_with_gather_is_byte_identical_to_m1() {
    let Some(ctx) = vulkan::context() else { return };
    let h = KernelHarness::new(ctx, 1 << 20, 4096).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    for &(rows, cols, m) in SHAPES {
        let xs = rand_vec(&mut rng, m * cols);
        h.write_act(0, &xs).unwrap();
        // Pair indices t·k + r with k = 3, in a scrambled token order: token of pair j is
        // map[j] / 3.
        let k = 3u32;
        let map: Vec<u32> = (0..m as u32).rev().map(|t| t * k + (t % k)).collect();
        h.write_route(&map).unwrap();
        for dtype in dtypes(cols) {
            let (g, u) = (Mat::random(&mut rng, dtype, rows, cols), Mat::random(&mut rng, dtype, rows, cols));
            let gw = h.weight(&g.view(), false).unwrap();
            let uw = h.weight(&u.view(), true).unwrap();
            let pair = h.pair(&gw, &uw).unwrap();
            let base = MatmulArgs {
                x_off: 0,
                x_stride: cols as u32,
                out_stride: rows as u32,
                map_div: k,
                flags: FLAG_GATHER,
                ..Default::default()
            };
            h.gate_up(&gw, &pair, MatmulArgs { m: m as u32, out_off: 300_000, ..base }, true, 1).unwrap();
            for j in 0..m {
                let a = MatmulArgs { m: 1, map_off: j as u32, out_off: 600_000 + (j * rows) as u32, ..base };
                h.gate_up(&gw, &pair, a, false, 1).unwrap();
            }
            let batched = h.read_act(300_000, m * rows).unwrap();
            let single = h.read_act(600_000, m * rows).unwrap();
            assert_eq!(bits(&batched), bits(&single), "{:?} rows {rows} cols {cols} m {m}", gw.dtype);
            // CPU: silu(g·x) * (u·x) for the gathered rows.
            let (gv, uv) = (g.view(), u.view());
            for (j, &p) in map.iter().enumerate() {
                let t = (p / k) as usize;
                let x = &xs[t * cols..(t + 1) * cols];
                for r in 0..rows {
                    let want = kernels::silu(kernels::row_dot(&gv, r, x)) * kernels::row_dot(&uv, r, x);
                    let got = single[j * rows + r];
                    assert!(
                        (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                        "gate_up vs CPU: {got} vs {want} ({dtype} rows {rows} cols {cols})"
                    );
                }
            }
        }
    }
}

#[test]
fn batched_scatter_and_accumulate_are_byte_identical_to_m1() {
    let Some(ctx) = vulkan::context() else { return };
    let h = KernelHarness::new(ctx, 1 << 20, 1024).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let (rows, cols, m) = (77usize, 45usize, 13usize);
    let w = h.weight(&Mat::random(&mut rng, DType::F32, rows, cols).view(), true).unwrap();
    let xs = rand_vec(&mut rng, m * cols);
    let init = rand_vec(&mut rng, m * rows);
    h.write_act(0, &xs).unwrap();
    let map: Vec<u32> = (0..m as u32).map(|j| (j * 5) % m as u32).collect();
    h.write_route(&map).unwrap();
    for (out, batched) in [(300_000u32, true), (600_000, false)] {
        h.write_act(out as usize, &init).unwrap();
        let a = MatmulArgs {
            x_off: 0,
            x_stride: cols as u32,
            out_off: out,
            out_stride: rows as u32,
            flags: FLAG_SCATTER | FLAG_ACCUMULATE,
            ..Default::default()
        };
        if batched {
            h.matmul(&w, MatmulArgs { m: m as u32, ..a }, true, 1).unwrap();
        } else {
            for j in 0..m as u32 {
                let a = MatmulArgs { m: 1, x_off: j * cols as u32, map_off: j, ..a };
                h.matmul(&w, a, false, 1).unwrap();
            }
        }
    }
    let b = h.read_act(300_000, m * rows).unwrap();
    let s = h.read_act(600_000, m * rows).unwrap();
    assert_eq!(bits(&b), bits(&s));
}

/// Writes `pairs` token indices (pair p → token `map[p]`), then the expert table at
/// `tab`: expert e at byte offset e·stride with pairs `segs[e]`.
fn write_table(h: &KernelHarness, map: &[u32], tab: usize, stride: u64, segs: &[(u32, u32)]) {
    let mut route = map.to_vec();
    route.resize(tab, 0);
    for (e, &(s, n)) in segs.iter().enumerate() {
        route.extend([(e as u64 * stride) as u32, s, n]);
    }
    h.write_route(&route).unwrap();
}

/// Expert blobs laid out as a vault's: per expert `gate` and `up` (`inter × hidden`, of
/// type `gu`) and `down` (`hidden × inter`, of type `dn`), each part at a 64-byte aligned
/// offset, experts `stride` bytes apart.
struct Blobs {
    words: Vec<u32>,
    /// Byte offsets of the gate, up and down parts in a blob.
    parts: [u64; 3],
    stride: u64,
}

impl Blobs {
    fn random(rng: &mut ChaCha8Rng, n: usize, [gu, dn]: [DType; 2], inter: usize, hidden: usize) -> Blobs {
        let shapes = [(gu, inter, hidden), (gu, inter, hidden), (dn, hidden, inter)];
        let mut parts = [0u64; 3];
        let mut end = 0;
        for (p, &(d, r, c)) in parts.iter_mut().zip(&shapes) {
            *p = end;
            end = (end + d.matrix_bytes(r, c).unwrap()).next_multiple_of(64);
        }
        let stride = end;
        let mut words = vec![0u32; n * stride as usize / 4];
        for e in 0..n {
            for (&p, &(d, r, c)) in parts.iter().zip(&shapes) {
                let m = Mat::random(rng, d, r, c);
                let at = (e as u64 * stride + p) as usize / 4;
                words[at..at + m.words.len()].copy_from_slice(&m.words);
            }
        }
        Blobs { words, parts, stride }
    }
}

#[test]
fn expert_table_dispatch_is_byte_identical_to_one_dispatch_per_expert() {
    let Some(ctx) = vulkan::context() else { return };
    let h = KernelHarness::new(ctx, 1 << 20, 4096).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    // Experts with 1 (m=1 kernel alone), 5 and 9 pairs, in one table dispatch.
    let segs = [(0u32, 5u32), (5, 1), (6, 9)];
    let (e, pairs, tokens, tab) = (segs.len(), 15usize, 7usize, 1024usize);
    for &(inter, hidden) in &[(37usize, 45usize), (32, 96), (256, 512)] {
        // Every type for all three parts, and mixes of gate/up and down types (a Q4_K_M
        // file keeps some layers' down projections in Q6_K).
        let same = DType::ALL.map(|d| [d, d]);
        let mixed = [
            [DType::Q4K, DType::Q6K],
            [DType::Q5K, DType::Q8_0],
            [DType::Bf16, DType::Q4_0],
            [DType::Q6K, DType::F16],
        ];
        let kinds = same
            .iter()
            .chain(&mixed)
            .filter(|[g, d]| g.row_bytes(hidden).is_some() && d.row_bytes(inter).is_some());
        for &[gu, dn] in kinds {
            let b = Blobs::random(&mut rng, e, [gu, dn], inter, hidden);
            let (down_set, pair) = h.blobs(bytemuck::cast_slice(&b.words), false).unwrap();
            let (ug, ud) = (weight_unit(gu), weight_unit(dn));
            let at = |i: usize, part: usize, unit: u64| ((i as u64 * b.stride + b.parts[part]) / unit) as u32;
            h.write_act(0, &rand_vec(&mut rng, tokens * hidden)).unwrap();
            let map: Vec<u32> = (0..pairs as u32).map(|p| (p * 3) % tokens as u32).collect();
            write_table(&h, &map, tab, b.stride, &segs);
            // gate/up: gathered inputs, outputs by pair; then the down projection: inputs by
            // pair, scattered (accumulated) outputs.
            let gate_up = MatmulArgs {
                rows: inter as u32,
                cols: hidden as u32,
                x_stride: hidden as u32,
                out_stride: inter as u32,
                map_div: 1,
                flags: FLAG_GATHER,
                ..Default::default()
            };
            let (t_out, e_out) = (300_000u32, 600_000u32);
            h.run(
                |r| {
                    let a = MatmulArgs {
                        w_off: at(0, 0, ug),
                        w2_off: at(0, 1, ug),
                        out_off: t_out,
                        flags: FLAG_GATHER | FLAG_TABLE,
                        tab_off: tab as u32,
                        groups: e as u32,
                        ..gate_up
                    };
                    r.matmul(Projection::GateUp, gu, true, pair.clone(), a)?;
                    for (i, &(s, n)) in segs.iter().enumerate() {
                        let a = MatmulArgs {
                            m: n,
                            w_off: at(i, 0, ug),
                            w2_off: at(i, 1, ug),
                            map_off: s,
                            out_off: e_out + s * inter as u32,
                            ..gate_up
                        };
                        r.matmul(Projection::GateUp, gu, n > 1, pair.clone(), a)?;
                    }
                    Ok(())
                },
                1,
            )
            .unwrap();
            let x = h.read_act(t_out as usize, pairs * inter).unwrap();
            let y = h.read_act(e_out as usize, pairs * inter).unwrap();
            assert_eq!(bits(&x), bits(&y), "gate/up {gu}/{dn} inter {inter} hidden {hidden}");
            // Scattered rows are distinct (as the executor's pair rows are).
            let perm: Vec<u32> = (0..pairs as u32).map(|p| (p * 4) % pairs as u32).collect();
            write_table(&h, &perm, tab, b.stride, &segs);
            let init = rand_vec(&mut rng, pairs * hidden);
            h.write_act(t_out as usize, &init).unwrap();
            h.write_act(e_out as usize, &init).unwrap();
            let x_off = 100_000u32;
            h.write_act(x_off as usize, &rand_vec(&mut rng, pairs * inter)).unwrap();
            let down = MatmulArgs {
                rows: hidden as u32,
                cols: inter as u32,
                x_off,
                x_stride: inter as u32,
                out_stride: hidden as u32,
                flags: FLAG_SCATTER | FLAG_ACCUMULATE,
                ..Default::default()
            };
            h.run(
                |r| {
                    let a = MatmulArgs {
                        w_off: at(0, 2, ud),
                        out_off: t_out,
                        flags: down.flags | FLAG_TABLE,
                        tab_off: tab as u32,
                        groups: e as u32,
                        ..down
                    };
                    r.matmul(Projection::Down, dn, true, down_set.clone(), a)?;
                    for (i, &(s, n)) in segs.iter().enumerate() {
                        let a = MatmulArgs {
                            m: n,
                            w_off: at(i, 2, ud),
                            x_off: x_off + s * inter as u32,
                            map_off: s,
                            out_off: e_out,
                            ..down
                        };
                        r.matmul(Projection::Down, dn, n > 1, down_set.clone(), a)?;
                    }
                    Ok(())
                },
                1,
            )
            .unwrap();
            let x = h.read_act(t_out as usize, pairs * hidden).unwrap();
            let y = h.read_act(e_out as usize, pairs * hidden).unwrap();
            assert_eq!(bits(&x), bits(&y), "down {gu}/{dn} inter {inter} hidden {hidden}");
        }
    }
}

#[test]
fn the_combining_down_projection_is_the_down_projection_then_the_combine() {
    // A decode step's k experts in one table (entry g: lane group g; its pair is its rank),
    // down projection and MoE combine in one dispatch: the bytes of the table's down
    // projection into per-rank rows followed by `accumulate`. Entries with no pairs (routed
    // experts the buffer does not hold: a step the host voids) give their ranks no term,
    // also after a run that left NaN in the kernel's workgroup memory.
    let Some(ctx) = vulkan::context() else { return };
    let h = KernelHarness::new(ctx, 1 << 20, 4096).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(16);
    let (k, inter, hidden, tab) = (8usize, 256usize, 512usize, 1024usize);
    let (x_off, y_off, res_off, ref_off) = (0u32, 100_000u32, 300_000u32, 400_000u32);
    for dt in [DType::F32, DType::Bf16, DType::Q8_0, DType::Q4K, DType::Q6K] {
        let b = Blobs::random(&mut rng, k, [dt, dt], inter, hidden);
        let (down_set, _) = h.blobs(bytemuck::cast_slice(&b.words), false).unwrap();
        let weights = rand_vec(&mut rng, k);
        // Rank r's expert in slot (3r + 1) % k; the table lists the held ranks in rank
        // order, then the others with no pairs.
        let write = |held: &[bool]| {
            let mut route: Vec<u32> = (0..k as u32).collect();
            route.extend(weights.iter().map(|w| w.to_bits()));
            route.resize(tab, 0);
            let slot = |r: usize| ((3 * r + 1) % k) as u64 * b.stride;
            for r in (0..k).filter(|&r| held[r]) {
                route.extend([slot(r) as u32, r as u32, 1]);
            }
            for r in (0..k).filter(|&r| !held[r]) {
                route.extend([0, r as u32, 0]);
            }
            h.write_route(&route).unwrap();
            held.iter().filter(|&&x| x).count() as u32
        };
        let down = MatmulArgs {
            rows: hidden as u32,
            cols: inter as u32,
            w_off: (b.parts[2] / weight_unit(dt)) as u32,
            x_off,
            x_stride: inter as u32,
            out_stride: hidden as u32,
            flags: FLAG_SCATTER | FLAG_TABLE,
            tab_off: tab as u32,
            wt_off: k as u32,
            ..Default::default()
        };
        // NaN inputs first, every expert held.
        write(&[true; 8]);
        h.write_act(x_off as usize, &vec![f32::NAN; k * inter]).unwrap();
        h.down_combine(dt, k, &down_set, MatmulArgs { out_off: res_off, ..down }).unwrap();
        for held in [[true; 8], [true, false, true, true, false, true, true, false]] {
            let n = write(&held);
            h.write_act(x_off as usize, &rand_vec(&mut rng, k * inter)).unwrap();
            let res = rand_vec(&mut rng, hidden);
            h.write_act(res_off as usize, &res).unwrap();
            h.write_act(ref_off as usize, &res).unwrap();
            h.down_combine(dt, k, &down_set, MatmulArgs { out_off: res_off, ..down }).unwrap();
            // The reference: the held experts' rows (the others 0), then the combine.
            h.write_act(y_off as usize, &vec![0.0; k * hidden]).unwrap();
            let a = MatmulArgs { out_off: y_off, groups: n, ..down };
            h.run(|r| r.matmul(Projection::Down, dt, false, down_set.clone(), a), 1).unwrap();
            h.accumulate(hidden as u32, k as u32, y_off, ref_off, k as u32).unwrap();
            let got = h.read_act(res_off as usize, hidden).unwrap();
            let want = h.read_act(ref_off as usize, hidden).unwrap();
            let differ = bits(&got).iter().zip(bits(&want)).position(|(a, b)| *a != b);
            assert_eq!(
                differ, None,
                "{dt}, held {held:?}: first differing row (got, want: {got:?} {want:?})"
            );
        }
    }
}

#[test]
fn the_ranking_kernel_writes_each_tier_buffers_table() {
    // A device-routed decode step's ranking (`route_table`) over several tier buffers:
    // `route`'s ranks and weights, in the arena and the host's readback buffer; per
    // buffer, the table of the routed experts it holds (in rank order, then the others
    // with no pairs) and its indirect dispatch sizes; the count of routed experts no
    // buffer holds.
    let Some(ctx) = vulkan::context() else { return };
    let h = KernelHarness::new(ctx, 1 << 16, 4096).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(18);
    let (k, ranks, buffers, groups) = (8usize, 10usize, 3usize, [5u32, 9u32]);
    let (row_off, ref_row, tab) = (2048u32, 4096u32, 16usize);
    for ne in [40usize, 128, 300] {
        // Expert e: in buffer e % 4 at byte offset 64e, in none for e % 4 = 3.
        let slot = |e: usize| if e % 4 == 3 { [u32::MAX, 0] } else { [(e % 4) as u32, 64 * e as u32] };
        let slots: Vec<u32> = (0..ne).flat_map(slot).collect();
        // Random logits, many ties, and a row whose two best experts no buffer holds.
        let mut lacking = rand_vec(&mut rng, ne);
        (lacking[3], lacking[7]) = (9.0, 8.0);
        let rows =
            [rand_vec(&mut rng, ne), (0..ne).map(|_| rng.random_range(0..3) as f32).collect(), lacking];
        for (i, logits) in rows.iter().enumerate() {
            let what = format!("{ne} experts, row {i}");
            h.write_act(0, logits).unwrap();
            h.run(h.record_route(ne as u32, k as u32, ranks as u32, true, 1, ref_row), 1).unwrap();
            let want = h.read_act(ref_row as usize, ne + k + 1).unwrap();
            h.write_route(&vec![0u32; tab + 2 * k + 3 * k * buffers]).unwrap();
            let a = RouteTableArgs {
                ne: ne as u32,
                k: k as u32,
                ranks: ranks as u32,
                norm: true,
                out_off: row_off,
                buffers: buffers as u32,
                tab_out: tab as u32,
                groups,
                ..Default::default()
            };
            let (sizes, io) = h.route_table(a, &slots).unwrap();
            let row = h.read_act(row_off as usize, ne + k + 1).unwrap();
            let ids: Vec<usize> = want[..k].iter().map(|v| v.to_bits() as usize).collect();
            let misses = ids.iter().filter(|&&e| e % 4 == 3).count() as u32;
            assert!(i < 2 || misses >= 2, "{what}: the row routes experts no buffer holds");
            for got in [&row, &io] {
                assert_eq!(bits(&got[..ranks]), bits(&want[..ranks]), "{what}: ranks");
                assert_eq!(bits(&got[ne..ne + k]), bits(&want[ne..ne + k]), "{what}: weights");
                assert_eq!(got[ne + k].to_bits(), misses, "{what}: misses");
            }
            let words = h.read_route(tab + 2 * k + 3 * k * buffers).unwrap();
            assert_eq!(words[tab..tab + k], (0..k as u32).collect::<Vec<_>>(), "{what}: pair list");
            assert_eq!(words[tab + k..tab + 2 * k], bits(&want[ne..ne + k]), "{what}: routing weights");
            for b in 0..buffers {
                let mine: Vec<usize> = (0..k).filter(|&r| ids[r] % 4 == b).collect();
                let mut table: Vec<u32> = mine.iter().flat_map(|&r| [slot(ids[r])[1], r as u32, 1]).collect();
                table.extend((0..k).filter(|&r| ids[r] % 4 != b).flat_map(|r| [0, r as u32, 0]));
                let at = tab + 2 * k + 3 * k * b;
                assert_eq!(words[at..at + 3 * k], table, "{what}: buffer {b}'s table");
                let n = mine.len() as u32;
                assert_eq!(
                    sizes[6 * b..6 * b + 6],
                    [groups[0], n, 1, groups[1], n, 1],
                    "{what}: buffer {b}'s sizes"
                );
            }
        }
    }
}

#[test]
fn rows_and_unroll_of_a_tuning_do_not_change_results() {
    let Some(ctx) = vulkan::context() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    let tunings = [(1, 1, 4, 1), (2, 2, 1, 2), (4, 2, 3, 3), (3, 8, 2, 4), (2, 5, 4, 1)].map(
        |(rows_m1, unroll, rows_down, rows_batched)| MatmulTuning {
            lanes: 32,
            rows_m1,
            unroll,
            unroll_dense: 9 - unroll,
            rows_down,
            rows_wide: rows_m1,
            rows_batched,
            rows_batched_blocks: 5 - rows_batched,
        },
    );
    // The last shape's rows take the wide matvec (an LM head; rows_wide): its m=1 dense
    // product alone.
    let shapes = [(37usize, 45usize, 3usize), (130, 96, 9), (40, 2048, 2), (WIDE_ROWS as usize, 256, 2)];
    // One type of each family of loads and dequantisation.
    let types = [DType::F32, DType::Bf16, DType::F16, DType::Q8_0, DType::Q4K, DType::Q6K];
    let data: Vec<_> = shapes
        .iter()
        .map(|&(rows, cols, m)| {
            let mats: Vec<_> = types
                .iter()
                .filter(|d| d.row_bytes(cols).is_some())
                .map(|&d| (Mat::random(&mut rng, d, rows, cols), Mat::random(&mut rng, d, rows, cols)))
                .collect();
            (mats, rand_vec(&mut rng, m * cols))
        })
        .collect();
    let mut first: Option<Vec<Vec<u32>>> = None;
    for t in tunings {
        let h = KernelHarness::with_tuning(ctx.clone(), 1 << 20, 1024, t).unwrap();
        let mut outs = Vec::new();
        for (&(rows, cols, m), (mats, xs)) in shapes.iter().zip(&data) {
            h.write_act(0, xs).unwrap();
            let wide = rows >= WIDE_ROWS as usize;
            for (g, u) in mats {
                let gw = h.weight(&g.view(), false).unwrap();
                let uw = h.weight(&u.view(), false).unwrap();
                let pair = h.pair(&gw, &uw).unwrap();
                for batched in [false, true] {
                    let a = MatmulArgs {
                        m: if batched { m as u32 } else { 1 },
                        x_stride: cols as u32,
                        out_off: 300_000,
                        out_stride: rows as u32,
                        ..Default::default()
                    };
                    let n = a.m as usize * rows;
                    h.matmul(&gw, a, batched, 1).unwrap();
                    let dense = bits(&h.read_act(300_000, n).unwrap());
                    if wide {
                        outs.push(dense);
                        break;
                    }
                    // The down projection's own m=1 pipeline (rows_down) gives the matvec's bytes.
                    let da = MatmulArgs { rows: rows as u32, cols: cols as u32, ..a };
                    h.run(|r| r.matmul(Projection::Down, gw.dtype, batched, gw.set(), da), 1).unwrap();
                    let down = bits(&h.read_act(300_000, n).unwrap());
                    assert!(
                        dense == down,
                        "tuning {t:?}: down projection differs from matvec ({rows}x{cols})"
                    );
                    outs.push(dense);
                    h.gate_up(&gw, &pair, a, batched, 1).unwrap();
                    outs.push(bits(&h.read_act(300_000, n).unwrap()));
                }
            }
        }
        match &first {
            None => first = Some(outs),
            Some(f) => assert!(f == &outs, "tuning {t:?} changed results"),
        }
    }
}

#[test]
fn each_dequantised_weight_is_bitwise_the_cpus() {
    let Some(ctx) = vulkan::context() else { return };
    let h = KernelHarness::new(ctx, 1 << 20, 1024).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(16);
    // Token t's input is the unit vector e_t, so out[t][r] = 1·W[r][t] plus exact zeros:
    // the kernel's own dequantised weight, whatever the summation order.
    for &(rows, cols) in &[(5usize, 256usize), (3, 512), (9, 96)] {
        let mut eye = vec![0.0f32; cols * cols];
        (0..cols).for_each(|t| eye[t * cols + t] = 1.0);
        h.write_act(0, &eye).unwrap();
        let out = cols * cols;
        for dtype in dtypes(cols) {
            let mat = Mat::random(&mut rng, dtype, rows, cols);
            let w = h.weight(&mat.view(), false).unwrap();
            let a = MatmulArgs {
                m: cols as u32,
                x_stride: cols as u32,
                out_off: out as u32,
                out_stride: rows as u32,
                ..Default::default()
            };
            h.matmul(&w, a, true, 1).unwrap();
            let got = h.read_act(out, cols * rows).unwrap();
            for r in 0..rows {
                for (t, &want) in mat.row_f32(r).iter().enumerate() {
                    let g = got[t * rows + r];
                    // A −0.0 weight comes out as +0.0 (0 + −0 = +0); every other is exact.
                    assert!(
                        g.to_bits() == want.to_bits() || (g == 0.0 && want == 0.0),
                        "{dtype} rows {rows} cols {cols}: W[{r}][{t}] = {g:e} on the GPU, {want:e} on the CPU"
                    );
                }
            }
        }
    }
}

/// The embedding lookup's arguments: `m` tokens' rows of a `vocab × cols` table bound
/// whole, written one after another from activation offset 0.
fn lookup_args(vocab: usize, cols: usize, m: usize) -> MatmulArgs {
    MatmulArgs {
        rows: vocab as u32,
        cols: cols as u32,
        m: m as u32,
        out_stride: cols as u32,
        ..Default::default()
    }
}

#[test]
fn device_embedding_rows_are_bitwise_the_cpus() {
    let Some(ctx) = vulkan::context() else { return };
    let h = KernelHarness::new(ctx, 1 << 20, 1024).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let (out, sentinel) = (100_000usize, -7.5f32);
    // (vocab, hidden): whole blocks of every format, and f16 rows with a tail.
    for &(vocab, cols) in &[(13usize, 256usize), (11, 96), (7, 100)] {
        // The host widens f32 and bf16 rows; every other type is looked up on the device.
        for dtype in dtypes(cols).filter(|d| !matches!(d, DType::F32 | DType::Bf16)) {
            let mat = Mat::random(&mut rng, dtype, vocab, cols);
            let w = h.weight(&mat.view(), false).unwrap();
            let ids: Vec<u32> = [5, 0, vocab - 1, 4, 5, 2, 6].map(|i| i as u32 % vocab as u32).to_vec();
            let m = ids.len();
            h.write_route(&ids).unwrap();
            let whole = lookup_args(vocab, cols, m);
            // The whole table bound, then rows 4..7 as a range of a larger table is bound
            // (binding at row 4): only tokens with ids there are written.
            let unit = weight_unit(dtype);
            let ranged = MatmulArgs {
                rows: 3,
                x_off: 4,
                w_off: (4 * dtype.row_bytes(cols).unwrap() as u64 / unit) as u32,
                ..whole
            };
            for (a, lo, hi) in [(whole, 0, vocab as u32), (ranged, 4, 7)] {
                h.write_act(out, &vec![sentinel; m * cols]).unwrap();
                h.run(|r| r.embed(dtype, w.set(), MatmulArgs { out_off: out as u32, ..a }), 1).unwrap();
                let got = h.read_act(out, m * cols).unwrap();
                for (t, &id) in ids.iter().enumerate() {
                    let row = &got[t * cols..(t + 1) * cols];
                    let want =
                        if (lo..hi).contains(&id) { mat.row_f32(id as usize) } else { vec![sentinel; cols] };
                    assert_eq!(
                        bits(row),
                        bits(&want),
                        "{dtype} vocab {vocab} cols {cols} token {t} (id {id}), rows {lo}..{hi}"
                    );
                }
            }
        }
    }
}

/// Every one of the 65,536 f16 bit patterns widened on the device (`f16_to_f32` in
/// `shaders/common.glsl`, which every f16 weight and every block format's scales go
/// through) is bitwise the CPU's: zeros, subnormals, normals, infinities and NaNs
/// (quietened, payload kept), read back through the f16 embedding lookup, which stores
/// the widened values as they are.
#[test]
fn every_f16_bit_pattern_widens_bitwise_as_the_cpu() {
    let Some(ctx) = vulkan::context() else { return };
    let h = KernelHarness::new(ctx, 1 << 17, 1024).unwrap();
    let (rows, cols) = (256usize, 256usize);
    let words: Vec<u32> = (0..1u32 << 15).map(|i| (2 * i) | (2 * i + 1) << 16).collect();
    let mat = Mat { dtype: DType::F16, rows, cols, words };
    let w = h.weight(&mat.view(), false).unwrap();
    let ids: Vec<u32> = (0..rows as u32).collect();
    h.write_route(&ids).unwrap();
    h.run(|r| r.embed(DType::F16, w.set(), lookup_args(rows, cols, rows)), 1).unwrap();
    let got = bits(&h.read_act(0, rows * cols).unwrap());
    for r in 0..rows {
        for (c, want) in bits(&mat.row_f32(r)).into_iter().enumerate() {
            let i = r * cols + c;
            assert_eq!(
                got[i], want,
                "f16 bits {i:#06x}: {:#010x} on the device, {want:#010x} on the CPU",
                got[i]
            );
        }
    }
}

/// The batched delta rule against its one-row step, byte for byte (outputs and the state
/// after the block), on shapes with grouped value heads, a key dim that is not a
/// multiple of the lanes, value columns over one workgroup tile, and a decay whose
/// softplus takes both branches; and against the CPU's `delta_row` within rounding.
#[test]
fn batched_delta_rule_matches_its_step() {
    use smoe_actors::cpu::delta::{delta_row, DeltaRow, DeltaShape};
    let Some(ctx) = vulkan::context() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    for (nk, nv, dk, dv, m) in [(1, 1, 1, 1, 1), (2, 4, 12, 10, 7), (1, 3, 33, 70, 5), (2, 2, 128, 128, 3)] {
        let sh = DeltaShape { k_heads: nk, v_heads: nv, k_dim: dk, v_dim: dv };
        let (kd, vd) = (nk * dk, nv * dv);
        let width = 2 * kd + 2 * vd + 2 * nv + 3;
        let lin = rand_vec(&mut rng, m * width);
        let a_log = rand_vec(&mut rng, nv);
        let mut dt_bias = rand_vec(&mut rng, nv);
        dt_bias[0] = 25.0;
        let state0: Vec<f32> = rand_vec(&mut rng, nv * dk * dv);
        let h = KernelHarness::new(ctx.clone(), m * width + m * vd + 64, 16).unwrap();
        h.write_act(0, &lin).unwrap();
        let core = m * width + 5;
        let args = DeltaArgs::packed([nk, nv, dk, dv], width, core, m);
        let (set, st) = h.delta_state(&a_log, &dt_bias, &state0).unwrap();
        h.delta_rule(&set, args, true, 1).unwrap();
        let (batched, batched_state) = (h.read_act(core, m * vd).unwrap(), h.read_floats(&st).unwrap());
        let (set, st) = h.delta_state(&a_log, &dt_bias, &state0).unwrap();
        for t in 0..m {
            let row =
                DeltaArgs { lin_off: (t * width) as u32, core_off: (core + t * vd) as u32, rows: 1, ..args };
            h.delta_rule(&set, row, false, 1).unwrap();
        }
        let (step, step_state) = (h.read_act(core, m * vd).unwrap(), h.read_floats(&st).unwrap());
        let shape = (nk, nv, dk, dv, m);
        assert_eq!(bits(&batched), bits(&step), "{shape:?}: outputs");
        assert_eq!(bits(&batched_state), bits(&step_state), "{shape:?}: state");
        // The CPU reference.
        let (mut state, mut mem, mut out) = (state0.clone(), vec![0.0; vd], vec![0.0; m * vd]);
        let scale = 1.0 / (dk as f32).sqrt();
        for (row, o) in lin.chunks_exact(width).zip(out.chunks_exact_mut(vd)) {
            let mut qk = row[..2 * kd].to_vec();
            for (i, head) in qk.chunks_exact_mut(dk).enumerate() {
                smoe_actors::cpu::delta::l2norm_inplace(head, if i < nk { scale } else { 1.0 });
            }
            let gates = &row[2 * kd + 2 * vd..];
            let x = DeltaRow {
                qk: &qk,
                v: &row[2 * kd..2 * kd + vd],
                b: &gates[..nv],
                a: &gates[nv..2 * nv],
                a_log: &a_log,
                dt_bias: &dt_bias,
            };
            delta_row(sh, &x, &mut state, &mut mem, o);
        }
        let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        let (d_out, d_state) = (diff(&batched, &out), diff(&batched_state, &state));
        assert!(d_out <= 1e-5 && d_state <= 1e-5, "{shape:?}: |Vulkan - CPU| out {d_out}, state {d_state}");
    }
}

/// One attention case for the kernel tests: random queries of `m` tokens at positions
/// `start ..`, a random cache through the last of them, NaN beyond (a masked position
/// read would poison the rows).
struct AttnCase {
    shape: AttentionShape,
    start: usize,
    m: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl AttnCase {
    fn new(rng: &mut ChaCha8Rng, shape: AttentionShape, start: usize, m: usize, capacity: usize) -> Self {
        let (qd, kvd) = (shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim);
        // Queries scaled per head so that some softmaxes are flat and some peaked.
        let mut q = rand_vec(rng, m * qd);
        for (i, head) in q.chunks_exact_mut(shape.head_dim).enumerate() {
            let gain = [0.5, 2.0, 6.0][i % 3];
            head.iter_mut().for_each(|x| *x *= gain);
        }
        let live = (start + m) * kvd;
        let cache = |rng: &mut ChaCha8Rng| {
            let mut c = rand_vec(rng, live);
            c.resize(capacity * kvd, f32::NAN);
            c
        };
        let (k, v) = (cache(rng), cache(rng));
        AttnCase { shape, start, m, q, k, v }
    }

    /// Straightforward f64 softmax attention of every row.
    fn reference(&self) -> Vec<f32> {
        let AttentionShape { heads, kv_heads, head_dim: hd } = self.shape;
        let (qd, kvd, group) = (heads * hd, kv_heads * hd, heads / kv_heads);
        let scale = 1.0 / (hd as f64).sqrt();
        let mut out = vec![0.0f32; self.m * qd];
        for t in 0..self.m {
            let n = self.start + t + 1;
            for h in 0..heads {
                let q = &self.q[t * qd + h * hd..][..hd];
                let base = (h / group) * hd;
                let s: Vec<f64> = (0..n)
                    .map(|j| {
                        let k = &self.k[j * kvd + base..][..hd];
                        q.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale
                    })
                    .collect();
                let mx = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
                let sum: f64 = p.iter().sum();
                for d in 0..hd {
                    let o: f64 = (0..n).map(|j| p[j] * self.v[j * kvd + base + d] as f64).sum();
                    out[t * qd + h * hd + d] = (o / sum) as f32;
                }
            }
        }
        out
    }
}

/// Attention's m=1 path (the decode step: one workgroup per chunk, partials merged in
/// chunk order) and its batched path (a block's rows in one fused dispatch) give every
/// row the same bytes, whichever path a block of either size takes, across contexts of
/// many chunks whose rows end inside a chunk; and match a straightforward f64 reference
/// within 1e-5.
#[test]
fn batched_attention_is_byte_identical_to_m1() {
    let Some(ctx) = vulkan::context() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let shape = |heads, kv_heads, head_dim| AttentionShape { heads, kv_heads, head_dim };
    // (shape, start, tokens): GQA groups of 1, 2, 4, 8 and 16 query heads (the split
    // kernel is specialised to each: 1 to 4 score rows, 1 or 2 PV rows per invocation);
    // head dims 4 to 256; blocks from position 0 and deep into the cache; 300 and 267
    // positions are not whole chunks; more rows than one tile; over 8 chunks (the decode
    // merge loads 8 at a time).
    let cases = [
        (shape(64, 4, 128), 70, 3),
        (shape(2, 2, 4), 0, 9),
        (shape(4, 2, 32), 1100, 5),
        (shape(8, 2, 24), 0, 150),
        (shape(4, 1, 128), 230, 37),
        (shape(16, 2, 256), 250, 50),
        (shape(32, 4, 128), 190, 11),
    ];
    for (sh, start, m) in cases {
        let capacity = start + m + 70;
        let c = AttnCase::new(&mut rng, sh, start, m, capacity);
        let qd = sh.heads * sh.head_dim;
        let out = (m * qd).next_multiple_of(4);
        let part = out + m * qd;
        let part_floats = m * sh.heads * AttentionShape::partial_chunks(capacity) * (sh.head_dim + 4);
        let h = KernelHarness::new(ctx.clone(), part + part_floats, 16).unwrap();
        h.write_act(0, &c.q).unwrap();
        let set = h.kv_cache(&c.k, &c.v).unwrap();
        let block = AttentionArgs {
            shape: sh,
            q_off: 0,
            out_off: out as u32,
            start: start as u32,
            pos_word: 0,
            tokens: m as u32,
            part_off: part as u32,
            part_chunks: AttentionShape::partial_chunks(capacity) as u32,
        };
        let run = |args: AttentionArgs, split: bool| {
            h.write_act(out, &vec![f32::NAN; m * qd]).unwrap();
            h.attention(&set, args, split, 1).unwrap();
            h.read_act(out, m * qd).unwrap()
        };
        let fused = run(block, false);
        let want = c.reference();
        let d = want.iter().zip(&fused).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(d <= 1e-5, "{sh:?} start {start} m {m}: max |Vulkan - f64 reference| {d}");
        assert_eq!(bits(&run(block, true)), bits(&fused), "{sh:?} start {start} m {m}: split block");
        // Token by token, as decode steps run them, by either path.
        for split in [true, false] {
            h.write_act(out, &vec![f32::NAN; m * qd]).unwrap();
            for t in 0..m {
                let row = AttentionArgs {
                    q_off: (t * qd) as u32,
                    out_off: (out + t * qd) as u32,
                    start: (start + t) as u32,
                    tokens: 1,
                    ..block
                };
                h.attention(&set, row, split, 1).unwrap();
            }
            let serial = h.read_act(out, m * qd).unwrap();
            assert_eq!(bits(&serial), bits(&fused), "{sh:?} start {start} m {m}: m=1 split={split}");
        }
        eprintln!("attention {sh:?} start {start} m {m}: max |Vulkan - f64| {d:e}");
    }
}

/// The activations' `exp` (`expf_` in `shaders/common.glsl`, behind every sigmoid, SiLU,
/// softplus and decay) does not depend on the driver's: the GPU's σ(x) = 1 / (1 + e^−x)
/// over [−30, 30] is bitwise the CPU backend's for 99.3% of arguments on lavapipe, and
/// elsewhere off by the one ulp `expf_` and libm's `expf` may differ by (up to 3 ulp of
/// σ where 1 + e^−x is e^−x: the reciprocal of the top of a binade lands at the bottom of
/// the next). lavapipe's own `exp` (exp2 of x·log₂e) put σ up to 9 ulp off the exact
/// value at x = −20 (the CPU's: 1.2).
#[test]
fn gpu_sigmoid_agrees_with_the_cpus() {
    use smoe_actors::cpu::delta::sigmoid;
    let Some(ctx) = vulkan::context() else { return };
    let n = 1 << 18;
    let h = KernelHarness::new(ctx, 2 * n, 16).unwrap();
    let g: Vec<f32> = (0..n).map(|i| -30.0 + 60.0 * i as f32 / n as f32).collect();
    h.write_act(0, &vec![1.0; n]).unwrap();
    h.write_act(n, &g).unwrap();
    let k = h.delta_kernels().sigmoid_mul.clone();
    let groups = [(n as u32).div_ceil(256), 1, 1];
    h.run(|r| r.dispatch(&k, None, [n as u32, 0, n as u32], groups), 1).unwrap();
    let gpu = h.read_act(0, n).unwrap();
    let (mut equal, mut worst) = (0, 0u32);
    for (&x, &y) in g.iter().zip(&gpu) {
        let ulps = sigmoid(x).to_bits().abs_diff(y.to_bits());
        equal += usize::from(ulps == 0);
        worst = worst.max(ulps);
    }
    let share = equal as f64 / n as f64;
    eprintln!("sigmoid on the GPU: {:.2}% bitwise the CPU's, worst {worst} ulp", 100.0 * share);
    assert!(worst <= 3 && share >= 0.98, "GPU sigmoid: worst {worst} ulp, {share} bitwise equal");
}

/// The greedy choice on the device (`shaders/argmax.comp`) is the sampler's `argmax` on
/// rows of many ties, both zeros, infinities, subnormals and NaNs, with the maximum in
/// the first, a middle and the last block, rows of one value and a first value of NaN.
#[test]
fn device_greedy_choice_is_the_samplers_argmax() {
    use smoe_actors::sampler::argmax;
    let Some(ctx) = vulkan::context() else { return };
    let n = 5000; // four blocks of 1024 and a partial one
    let h = KernelHarness::new(ctx, 2 * n + 64, 16).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let specials = [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e-45, -1e-45, 1e-39, 3.0];
    let mut rows: Vec<Vec<f32>> = Vec::new();
    for _ in 0..40 {
        // Few distinct values (ties everywhere), some special.
        let row: Vec<f32> = (0..n)
            .map(|_| match rng.random_range(0..10) {
                0 => specials[rng.random_range(0..specials.len())],
                r => r as f32 * 0.5 - 3.0,
            })
            .collect();
        rows.push(row);
    }
    for at in [0, 1, 1023, 1024, 2500, n - 1] {
        let mut row = rand_vec(&mut rng, n);
        row[at] = 100.0;
        rows.push(row);
    }
    let mut row = rand_vec(&mut rng, n);
    row[0] = f32::NAN;
    rows.push(row);
    rows.push(vec![f32::NAN; n]);
    rows.push(vec![-0.0; n]);
    rows.push(vec![f32::NEG_INFINITY; n]);
    let mut zeros = vec![-1.0; n];
    (zeros[7], zeros[3000]) = (-0.0, 0.0);
    rows.push(zeros);
    let mut tiny = vec![0.0; n];
    tiny[4000] = 1e-45;
    rows.push(tiny);
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(h.argmax(row).unwrap() as usize, argmax(row), "row {i}");
    }
}

#[test]
fn device_ranking_is_the_hosts() {
    // `route.comp` against actors/src/router/rank.rs on rows of random logits, rows of
    // many ties (which go to the lower index), a row of equal logits and one whose
    // experts are mostly -inf (probability 0, tied): the same experts in the same order,
    // the same weights within rounding; a row of NaN logits ranks no expert. 128 experts
    // are ranked by counting, more by sorting (a power of two and not).
    let Some(ctx) = vulkan::context() else { return };
    let h = KernelHarness::new(ctx, 1 << 16, 16).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for (ne, k, ranks) in [(128usize, 8usize, 12usize), (512, 10, 14), (300, 8, 8)] {
        let mut rows: Vec<Vec<f32>> = (0..3).map(|_| rand_vec(&mut rng, ne)).collect();
        rows.extend((0..3).map(|_| (0..ne).map(|_| rng.random_range(0..3) as f32).collect()));
        rows.push(vec![0.25; ne]);
        rows.push((0..ne).map(|e| if e % 7 == 3 { 1.0 } else { f32::NEG_INFINITY }).collect());
        rows.push(vec![f32::NAN; ne]);
        let m = rows.len();
        h.write_act(0, &rows.concat()).unwrap();
        let (out, stride) = (m * ne, ne + k + 1);
        for norm in [false, true] {
            h.run(h.record_route(ne as u32, k as u32, ranks as u32, norm, m as u32, out as u32), 1).unwrap();
            let got = h.read_act(out, m * stride).unwrap();
            for (t, row) in rows.iter().enumerate() {
                let g = &got[t * stride..(t + 1) * stride];
                let ids: Vec<u32> = g[..ranks].iter().map(|v| v.to_bits()).collect();
                if row[0].is_nan() {
                    assert!(ids.iter().all(|&e| e == u32::MAX), "{ne} experts, row {t}: {ids:?}");
                    continue;
                }
                let (mut logits, mut ex, mut w) = (row.clone(), vec![0u16; ranks], vec![0f32; k]);
                smoe_actors::router::rank::route(&mut logits, k, norm, &mut ex, &mut w);
                let want: Vec<u32> = ex.iter().map(|&e| e as u32).collect();
                assert_eq!(ids, want, "{ne} experts, row {t}, norm {norm}");
                let rel = max_rel(&g[ne..ne + k], &w);
                assert!(rel < 1e-5, "{ne} experts, row {t}, norm {norm}: weights {rel}");
            }
        }
    }
}

/// A Q6_K LM head uploaded in the padded block layout (224-byte blocks, read by whole
/// vectors: `matvec_q6_k_padded`) gives the m=1 product the same bytes as the matrix as
/// stored, through the narrow kernel and the wide one (from `WIDE_ROWS` rows), for rows
/// of an odd number of blocks (whose stored blocks start on odd half-words) and of many.
#[test]
fn padded_q6k_matvec_is_byte_identical_to_stored() {
    let Some(ctx) = vulkan::context() else { return };
    let h = KernelHarness::new(ctx, 1 << 16, 16).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(38);
    for (rows, cols) in [(19, 256), (65, 1280), (33, 2048), (WIDE_ROWS as usize + 5, 256)] {
        let m = Mat::random(&mut rng, DType::Q6K, rows, cols);
        let stored = h.weight(&m.view(), false).unwrap();
        let padded = h.padded_weight(&m.view()).unwrap();
        h.write_act(0, &rand_vec(&mut rng, cols)).unwrap();
        let a = MatmulArgs {
            x_stride: cols as u32,
            out_off: cols as u32,
            out_stride: rows as u32,
            m: 1,
            ..Default::default()
        };
        let run = |w| {
            h.write_act(cols, &vec![f32::NAN; rows]).unwrap();
            h.matmul(w, a, false, 1).unwrap();
            h.read_act(cols, rows).unwrap()
        };
        let (want, got) = (run(&stored), run(&padded));
        assert!(want.iter().all(|v| v.is_finite()), "{rows} x {cols}: stored product not finite");
        assert_eq!(bits(&got), bits(&want), "{rows} x {cols}: padded Q6_K matvec");
        assert!(h.matmul(&padded, a, true, 1).is_err(), "a batched product of a padded matrix is refused");
    }
}
