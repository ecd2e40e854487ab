//! Every batched Vulkan kernel against its m=1 sibling, byte for byte, on awkward
//! shapes (odd sizes, tails, misaligned offsets, gathered and scattered rows), and
//! against the CPU reference within rounding.
#![cfg(feature = "vulkan")]

mod vulkan;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use smoe_actors::cpu::kernels;
use smoe_actors::tensor::{WeightData, WeightView};
use smoe_actors::vulkan::harness::{
    KernelHarness, MatmulArgs, MatmulTuning, Projection, FLAG_ACCUMULATE, FLAG_GATHER, FLAG_SCATTER,
    FLAG_TABLE,
};

const SHAPES: &[(usize, usize, usize)] = &[
    (1, 1, 1),
    (3, 17, 5),
    (33, 31, 7),
    (257, 129, 3),
    (67, 64, 9),
    (130, 96, 17),
    (1031, 65, 2),
    (40, 2048, 11),
];

fn rand_vec(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bf16(v: &[f32]) -> Vec<u16> {
    v.iter().map(|x| half::bf16::from_f32(*x).to_bits()).collect()
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
    for &(rows, cols, m) in SHAPES {
        let wf = rand_vec(&mut rng, rows * cols);
        let wb = bf16(&wf);
        // x_off 0 takes the vector path where shapes allow; 3 forces the scalar path.
        for x_off in [0usize, 3] {
            let xs = rand_vec(&mut rng, m * cols);
            h.write_act(x_off, &xs).unwrap();
            let out_b = 300_000;
            let out_1 = 600_000;
            for data in [WeightData::F32(&wf), WeightData::Bf16(&wb)] {
                let view = WeightView { data, rows, cols };
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
        let (gf, uf) = (rand_vec(&mut rng, rows * cols), rand_vec(&mut rng, rows * cols));
        let (gb, ub) = (bf16(&gf), bf16(&uf));
        let xs = rand_vec(&mut rng, m * cols);
        h.write_act(0, &xs).unwrap();
        // Pair indices t·k + r with k = 3, in a scrambled token order: token of pair j is
        // map[j] / 3.
        let k = 3u32;
        let map: Vec<u32> = (0..m as u32).rev().map(|t| t * k + (t % k)).collect();
        h.write_route(&map).unwrap();
        for (g, u) in
            [(WeightData::F32(&gf), WeightData::F32(&uf)), (WeightData::Bf16(&gb), WeightData::Bf16(&ub))]
        {
            let gw = h.weight(&WeightView { data: g, rows, cols }, false).unwrap();
            let uw = h.weight(&WeightView { data: u, rows, cols }, true).unwrap();
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
            let gv = WeightView { data: g, rows, cols };
            let uv = WeightView { data: u, rows, cols };
            for (j, &p) in map.iter().enumerate() {
                let t = (p / k) as usize;
                let x = &xs[t * cols..(t + 1) * cols];
                for r in 0..rows {
                    let want = kernels::silu(kernels::row_dot(&gv, r, x)) * kernels::row_dot(&uv, r, x);
                    let got = single[j * rows + r];
                    assert!(
                        (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                        "gate_up vs CPU: {got} vs {want}"
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
    let wf = rand_vec(&mut rng, rows * cols);
    let w = h.weight(&WeightView { data: WeightData::F32(&wf), rows, cols }, true).unwrap();
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
/// `tab`: expert e at weight offset e·rows·cols with pairs `segs[e]`.
fn write_table(h: &KernelHarness, map: &[u32], tab: usize, rows: usize, cols: usize, segs: &[(u32, u32)]) {
    let mut route = map.to_vec();
    route.resize(tab, 0);
    for (e, &(s, n)) in segs.iter().enumerate() {
        route.extend([(e * rows * cols) as u32, s, n]);
    }
    h.write_route(&route).unwrap();
}

#[test]
fn expert_table_dispatch_is_byte_identical_to_one_dispatch_per_expert() {
    let Some(ctx) = vulkan::context() else { return };
    let h = KernelHarness::new(ctx, 1 << 20, 4096).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    // Experts with 1 (m=1 kernel alone), 5 and 9 pairs, in one table dispatch.
    let segs = [(0u32, 5u32), (5, 1), (6, 9)];
    let pairs = 15usize;
    for &(rows, cols) in &[(37usize, 45usize), (16, 64), (130, 96)] {
        let e = segs.len();
        let (gf, uf) = (rand_vec(&mut rng, e * rows * cols), rand_vec(&mut rng, e * rows * cols));
        let (gb, ub) = (bf16(&gf), bf16(&uf));
        let tokens = 7usize;
        h.write_act(0, &rand_vec(&mut rng, tokens * cols)).unwrap();
        let map: Vec<u32> = (0..pairs as u32).map(|p| (p * 3) % tokens as u32).collect();
        let tab = 1024;
        write_table(&h, &map, tab, rows, cols, &segs);
        for (g, u) in
            [(WeightData::F32(&gf), WeightData::F32(&uf)), (WeightData::Bf16(&gb), WeightData::Bf16(&ub))]
        {
            let gw = h.weight(&WeightView { data: g, rows: e * rows, cols }, false).unwrap();
            let uw = h.weight(&WeightView { data: u, rows: e * rows, cols }, true).unwrap();
            let pair = h.pair(&gw, &uw).unwrap();
            let base = MatmulArgs {
                rows: rows as u32,
                cols: cols as u32,
                x_stride: cols as u32,
                out_stride: rows as u32,
                map_div: 1,
                ..Default::default()
            };
            // gate/up: gathered inputs, outputs by pair; then down-style: inputs by pair,
            // scattered (accumulated) outputs.
            let (t_out, e_out) = (300_000u32, 600_000u32);
            h.run(
                |r| {
                    let a = MatmulArgs {
                        out_off: t_out,
                        flags: FLAG_GATHER | FLAG_TABLE,
                        tab_off: tab as u32,
                        groups: e as u32,
                        ..base
                    };
                    r.matmul(Projection::GateUp, gw.dtype, true, pair.clone(), a)?;
                    for (i, &(s, n)) in segs.iter().enumerate() {
                        let off = (i * rows * cols) as u32;
                        let a = MatmulArgs {
                            m: n,
                            w_off: off,
                            w2_off: off,
                            map_off: s,
                            out_off: e_out + s * rows as u32,
                            flags: FLAG_GATHER,
                            ..base
                        };
                        r.matmul(Projection::GateUp, gw.dtype, n > 1, pair.clone(), a)?;
                    }
                    Ok(())
                },
                1,
            )
            .unwrap();
            let a = h.read_act(t_out as usize, pairs * rows).unwrap();
            let b = h.read_act(e_out as usize, pairs * rows).unwrap();
            assert_eq!(bits(&a), bits(&b), "gate/up {:?} rows {rows} cols {cols}", gw.dtype);
            // Scattered rows are distinct (as the executor's pair rows are).
            let perm: Vec<u32> = (0..pairs as u32).map(|p| (p * 4) % pairs as u32).collect();
            write_table(&h, &perm, tab, rows, cols, &segs);
            let init = rand_vec(&mut rng, pairs * rows);
            h.write_act(t_out as usize, &init).unwrap();
            h.write_act(e_out as usize, &init).unwrap();
            let x_off = 100_000u32;
            h.write_act(x_off as usize, &rand_vec(&mut rng, pairs * cols)).unwrap();
            let down = MatmulArgs { x_off, flags: FLAG_SCATTER | FLAG_ACCUMULATE, ..base };
            h.run(
                |r| {
                    let a = MatmulArgs {
                        out_off: t_out,
                        flags: down.flags | FLAG_TABLE,
                        tab_off: tab as u32,
                        groups: e as u32,
                        ..down
                    };
                    r.matmul(Projection::Down, gw.dtype, true, gw.set(), a)?;
                    for (i, &(s, n)) in segs.iter().enumerate() {
                        let a = MatmulArgs {
                            m: n,
                            w_off: (i * rows * cols) as u32,
                            x_off: x_off + s * cols as u32,
                            map_off: s,
                            out_off: e_out,
                            ..down
                        };
                        r.matmul(Projection::Down, gw.dtype, n > 1, gw.set(), a)?;
                    }
                    Ok(())
                },
                1,
            )
            .unwrap();
            let a = h.read_act(t_out as usize, pairs * rows).unwrap();
            let b = h.read_act(e_out as usize, pairs * rows).unwrap();
            assert_eq!(bits(&a), bits(&b), "down {:?} rows {rows} cols {cols}", gw.dtype);
            write_table(&h, &map, tab, rows, cols, &segs);
        }
    }
}

#[test]
fn rows_and_unroll_of_a_tuning_do_not_change_results() {
    let Some(ctx) = vulkan::context() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    let tunings = [(1, 1, 4), (2, 2, 1), (4, 2, 3), (3, 8, 2), (2, 5, 4)]
        .map(|(rows_m1, unroll, rows_down)| MatmulTuning { lanes: 32, rows_m1, unroll, rows_down });
    let shapes = [(37usize, 45usize, 3usize), (130, 96, 9), (40, 2048, 2)];
    let data: Vec<_> = shapes
        .iter()
        .map(|&(rows, cols, m)| {
            (rand_vec(&mut rng, rows * cols), rand_vec(&mut rng, rows * cols), rand_vec(&mut rng, m * cols))
        })
        .collect();
    let mut first: Option<Vec<Vec<u32>>> = None;
    for t in tunings {
        let h = KernelHarness::with_tuning(ctx.clone(), 1 << 20, 1024, t).unwrap();
        let mut outs = Vec::new();
        for (&(rows, cols, m), (gf, uf, xs)) in shapes.iter().zip(&data) {
            h.write_act(0, xs).unwrap();
            let (gb, ub) = (bf16(gf), bf16(uf));
            for (g, u) in
                [(WeightData::F32(gf), WeightData::F32(uf)), (WeightData::Bf16(&gb), WeightData::Bf16(&ub))]
            {
                let gw = h.weight(&WeightView { data: g, rows, cols }, false).unwrap();
                let uw = h.weight(&WeightView { data: u, rows, cols }, false).unwrap();
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
