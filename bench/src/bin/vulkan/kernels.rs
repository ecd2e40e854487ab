//! `vulkan kernels`: per-kernel figures against the card's memory bandwidth.

use std::sync::Arc;
use std::time::Duration;

use smoe_actors::cpu::quantize::encode_rows;
use smoe_actors::tensor::WeightView;
use smoe_actors::vulkan::harness::{
    DescriptorSet, KernelHarness, MatmulArgs, MatmulTuning, Projection, Recorder, TestWeight, FLAG_GATHER,
    FLAG_TABLE,
};
use smoe_actors::vulkan::{VulkanContext, VulkanError};
use smoe_proto::DType;

/// Cheap deterministic pseudo-random weights in [-0.05, 0.05), without end.
pub fn weights(seed: u64) -> impl Iterator<Item = f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    std::iter::repeat_with(move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
    })
}

/// The first `n` of [`weights`]`(seed)`.
pub fn fill(n: usize, seed: u64) -> Vec<f32> {
    weights(seed).take(n).collect()
}

/// Stacked expert weights: gate, up ((n·inter) × hid) and down ((n·hid) × inter)
/// matrices, expert e at byte offset e·(bytes of one expert's matrix) of each, bound once.
struct Stack {
    gate: TestWeight,
    pair: Arc<DescriptorSet>,
    down: TestWeight,
}

/// Rows of [`fill`] weights encoded per type before they repeat: quantising a 151936-row
/// LM head with the reference quantiser would take longer than timing it, and the
/// kernels' memory traffic does not see the repetition.
const TILE_ROWS: usize = 64;

/// A `rows` × `cols` matrix of `dtype` holding [`fill`] weights (seeded by `seed`;
/// quantised for the block formats, rows repeating after [`TILE_ROWS`]), in device-local
/// or (`host`) host-visible memory.
pub fn upload(
    h: &KernelHarness,
    rows: usize,
    cols: usize,
    seed: u64,
    dtype: DType,
    host: bool,
) -> TestWeight {
    let words = encoded(rows, cols, seed, dtype);
    h.weight(&WeightView::from_bytes(dtype, bytemuck::cast_slice(&words), rows, cols), host).expect("upload")
}

/// [`upload`]'s Q6_K matrix in device-local memory in the padded block layout an LM head
/// gets ([`KernelHarness::padded_weight`]).
fn upload_padded(h: &KernelHarness, rows: usize, cols: usize, seed: u64) -> TestWeight {
    let words = encoded(rows, cols, seed, DType::Q6K);
    h.padded_weight(&WeightView::from_bytes(DType::Q6K, bytemuck::cast_slice(&words), rows, cols))
        .expect("upload")
}

/// The bytes of [`upload`]'s matrix, as words (so that an f32 view is aligned).
fn encoded(rows: usize, cols: usize, seed: u64, dtype: DType) -> Vec<u32> {
    let mut bytes = Vec::new();
    encode_rows(&fill(rows.min(TILE_ROWS) * cols, seed), cols, dtype, &mut bytes).expect("whole blocks");
    let len = dtype.matrix_bytes(rows, cols).expect("whole blocks") as usize;
    let mut words = vec![0u32; len.div_ceil(4)];
    let all: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
    for dst in all[..len].chunks_mut(bytes.len()) {
        dst.copy_from_slice(&bytes[..dst.len()]);
    }
    words
}

/// Seconds per round of `record`, timed as `run_timed` submits it: `record` is
/// recorded into one command buffer as often as makes one submission take about 30 ms
/// (so the submission and fence overhead is small); the buffer then runs back to back
/// for at least 300 ms before seven timed submissions, whose median counts. The warm-up
/// matters: the H200's shader clock falls to 345 MHz within a second of idling
/// (nvidia-smi dmon during a run) and one 30 ms submission does not bring it back to
/// 1980 MHz, which made figures taken after host-side set-up several times too slow.
pub fn time(h: &KernelHarness, mut record: impl FnMut(&mut Recorder) -> Result<(), VulkanError>) -> f64 {
    let one = h.run_timed(&mut record, 1, Duration::from_millis(50), 1).expect("run")[0].as_secs_f64();
    let rounds = ((0.03 / one).ceil() as usize).clamp(1, 4000);
    let mut t = h.run_timed(&mut record, rounds, Duration::from_millis(300), 7).expect("run");
    t.sort();
    t[3].as_secs_f64() / rounds as f64
}

/// Prints one figure: `bytes` moved in `secs`.
pub fn report(what: &str, secs: f64, bytes: f64) {
    println!(
        "{what}: {:.1} us, {:.0} GB/s ({:.1}% of 4.8 TB/s)",
        secs * 1e6,
        bytes / secs / 1e9,
        bytes / secs / 4.8e12 * 100.0
    );
}

/// The tunings `vulkan kernels` compares (the backend's default first); the others take
/// one row per lane group in the batched kernels.
pub const TUNINGS: &[MatmulTuning] = &[MatmulTuning::DEFAULT, m1(1, 1, 1, 1), m1(2, 2, 2, 2), m1(2, 1, 1, 4)];

/// A tuning of the m=1 kernels: rows, unroll, dense unroll and down rows (32 lanes, 2 rows
/// in the wide matvec, 1 in the batched kernels).
const fn m1(rows_m1: u32, unroll: u32, unroll_dense: u32, rows_down: u32) -> MatmulTuning {
    MatmulTuning {
        lanes: 32,
        rows_m1,
        unroll,
        unroll_dense,
        rows_down,
        rows_wide: 2,
        rows_batched: 1,
        rows_batched_blocks: 1,
    }
}

/// How the command line writes a tuning.
pub const TUNING_SYNTAX: &str =
    "LANES,ROWS,UNROLL[,ROWS_DOWN[,UNROLL_DENSE[,ROWS_WIDE[,ROWS_BATCHED[,ROWS_BATCHED_BLOCKS]]]]]";

/// The read ceilings: the read-bandwidth kernel over 512 MiB of device-local memory
/// and 256 MiB of host-visible memory (where ring slots live), at a few grid sizes
/// (less where the device cannot bind that much at once); and the time a dispatch
/// that reads next to nothing takes in a chain.
fn read_ceilings(h: &KernelHarness, max_range: u64) {
    for (host, mib) in [(false, 512usize), (true, 256)] {
        let mib = mib.min((max_range >> 20) as usize / 2);
        let cols = 4096;
        let w = upload(h, (mib << 20) / 4 / cols, cols, 7, DType::F32, host);
        let bytes = (mib << 20) as f64;
        let place = if host { "host-visible" } else { "device-local" };
        for groups in [1056u32, 4224, 16896] {
            let secs = time(h, h.read_all(&w, groups, 0).expect("read"));
            report(&format!("read ceiling {place} {mib} MiB, {groups} workgroups"), secs, bytes);
        }
    }
    // The dispatch floor: a chain of dispatches that read 16 bytes each, with the
    // barrier every kernel of a layer step waits on in between.
    let w = upload(h, 1, 4, 7, DType::F32, false);
    let mut one = h.read_all(&w, 1, 0).expect("read");
    let secs = time(h, |r| (0..16).try_for_each(|_| one(r))) / 16.0;
    println!("dispatch floor (16-byte read, chained): {:.1} us", secs * 1e6);
    // What a switch of kernel costs in a chain (a decode step switches at every dispatch):
    // 16-row matvecs chained with themselves, bf16 or f32 weights, against the two
    // alternating (two pipelines).
    let cols = 2048;
    let ws = [DType::Bf16, DType::F32].map(|d| upload(h, 16, cols, 11, d, false));
    let a = MatmulArgs {
        rows: 16,
        cols: cols as u32,
        m: 1,
        x_stride: cols as u32,
        out_off: cols as u32,
        out_stride: 16,
        ..Default::default()
    };
    for (label, pick) in [("bf16 only", [0, 0]), ("f32 only", [1, 1]), ("bf16 and f32 alternating", [0, 1])] {
        let secs =
            time(h, |r| (0..8).try_for_each(|_| pick.iter().try_for_each(|&i| ws[i].record(r, false, a))))
                / 16.0;
        println!("dispatch floor (16x{cols} matvec, chained, {label}): {:.1} us", secs * 1e6);
    }
}

/// A model's expert shape, as `vulkan kernels` measures it.
pub struct Shape {
    /// The name that picks it on the command line.
    pub name: &'static str,
    /// Hidden size (the gate/up input, the down output).
    pub hidden: usize,
    /// Expert intermediate size.
    pub inter: usize,
}

/// The shapes `vulkan kernels` knows; the first is the default.
pub const SHAPES: &[Shape] = &[
    Shape { name: "qwen3-30b-a3b", hidden: 2048, inter: 768 },
    Shape { name: "qwen3-235b-a22b", hidden: 4096, inter: 1536 },
];

/// The weight types `vulkan kernels` measures unless others are named: the float types
/// of bf16/f32 vaults and the two formats of a Q4_K_M vault's experts.
pub const TYPES: &[DType] = &[DType::Bf16, DType::F32, DType::Q4K, DType::Q6K];

/// `vulkan kernels [DEVICE] [TYPE ...] [TUNING ...] [SHAPE]`: prints every figure for
/// each of `tunings` and weight `types` (see the program's documentation).
pub fn kernels(device: usize, tunings: &[MatmulTuning], types: &[DType], shape: &Shape) {
    let ctx = VulkanContext::new(device).expect("device");
    println!(
        "device: {} ({}, Vulkan {}, subgroup {:?})",
        ctx.info.name, ctx.info.driver, ctx.info.api_version, ctx.info.subgroup_size
    );
    // The model's hidden and expert intermediate sizes, 8 experts per token; 48 experts
    // (6 groups of 8) so the L2 does not hold the weights.
    let Shape { hidden: hid, inter, .. } = *shape;
    println!("shape: {} (hidden {hid}, expert intermediate {inter})", shape.name);
    let (k, n_exp, tokens) = (8usize, 48usize, 64usize);
    for (ti, &tuning) in tunings.iter().enumerate() {
        println!("== tuning {tuning:?}");
        let h = KernelHarness::with_tuning(ctx.clone(), 32 << 20, 1 << 16, tuning).expect("harness");
        if ti == 0 {
            read_ceilings(&h, ctx.info.max_storage_buffer_range);
        }
        // The first tuning also runs the m=1 expert FFN with the routing data in host
        // memory, against the executor's placement, and reads weights in place from
        // host-visible memory as ring slots are.
        let host_route = (ti == 0).then(|| h.with_host_route().expect("harness"));
        let xs = fill(tokens * hid, 99);
        h.write_act(0, &xs).expect("x");
        let (x_off, hid_off) = (0u32, (tokens * hid) as u32);
        let y_off = hid_off + (n_exp * tokens * inter) as u32;
        for &dtype in types {
            let name = dtype.name();
            // Bytes of a matrix: what a kernel reading it moves (quantised bytes for the
            // block formats).
            let mbytes = |rows: usize, cols: usize| dtype.matrix_bytes(rows, cols).expect("whole blocks");
            for host in [false, true] {
                if host && ti != 0 {
                    continue;
                }
                let place = if host { "host-visible (ring slot, zero-copy)" } else { "device-local" };
                let st = {
                    let gate = upload(&h, n_exp * inter, hid, 1, dtype, host);
                    let up = upload(&h, n_exp * inter, hid, 2, dtype, host);
                    let down = upload(&h, n_exp * hid, inter, 3, dtype, host);
                    let pair = h.pair(&gate, &up).expect("pair");
                    Stack { gate, pair, down }
                };
                // One expert's matrix has as many bytes as gate, up or down.
                let expert = mbytes(inter, hid);
                let bytes = (3 * expert) as f64;
                let runs: Vec<(&KernelHarness, usize, &str)> = [(&h, 1, ""), (&h, tokens, "")]
                    .into_iter()
                    .chain(host_route.iter().filter(|_| !host).map(|hr| (hr, 1, ", routing in host memory")))
                    .collect();
                for (hh, m, route_place) in runs {
                    // Table: expert e at byte offset e·expert holds pairs e·m .. e·m + m - 1
                    // (token = pair % m).
                    let tab = 1 << 14;
                    let mut route: Vec<u32> = (0..(n_exp * m) as u32).map(|p| p % m as u32).collect();
                    route.resize(tab, 0);
                    for e in 0..n_exp {
                        route.extend([(e as u64 * expert) as u32, (e * m) as u32, m as u32]);
                    }
                    hh.write_route(&route).expect("route");
                    let gu = MatmulArgs {
                        rows: inter as u32,
                        cols: hid as u32,
                        x_off,
                        x_stride: hid as u32,
                        out_off: hid_off,
                        out_stride: inter as u32,
                        map_div: 1,
                        flags: FLAG_GATHER | FLAG_TABLE,
                        groups: k as u32,
                        ..Default::default()
                    };
                    let dn = MatmulArgs {
                        rows: hid as u32,
                        cols: inter as u32,
                        x_off: hid_off,
                        x_stride: inter as u32,
                        out_off: y_off,
                        out_stride: hid as u32,
                        flags: FLAG_TABLE,
                        groups: k as u32,
                        ..Default::default()
                    };
                    // The pair as the executor records it, then (m=1, first placement) each
                    // half alone: the gate/up (2/3 of the bytes) and the down projection.
                    let halves = m == 1 && route_place.is_empty() && !host;
                    let parts: &[(bool, bool, &str, f64)] = if halves {
                        &[
                            (true, true, "", 1.0),
                            (true, false, " (gate/up alone)", 2.0 / 3.0),
                            (false, true, " (down alone)", 1.0 / 3.0),
                        ]
                    } else {
                        &[(true, true, "", 1.0)]
                    };
                    for &(with_gu, with_dn, part, share) in parts {
                        let halves = [
                            (with_gu, Projection::GateUp, st.pair.clone(), gu),
                            (with_dn, Projection::Down, st.down.set(), dn),
                        ];
                        let secs = time(hh, |r| {
                            for g in 0..n_exp / k {
                                let tab_off = (tab + 3 * k * g) as u32;
                                for (on, p, set, args) in &halves {
                                    if *on {
                                        let a = MatmulArgs { tab_off, ..*args };
                                        r.matmul(*p, st.gate.dtype, m > 1, set.clone(), a)?;
                                    }
                                }
                            }
                            Ok(())
                        }) / (n_exp / k) as f64;
                        if m == 1 {
                            report(
                                &format!(
                                    "expert FFN m=1 {name} {place}{route_place}, {k} experts fused{part}"
                                ),
                                secs,
                                share * k as f64 * bytes,
                            );
                            continue;
                        }
                        let flops = 2.0 * (k * m) as f64 * 3.0 * (hid * inter) as f64;
                        println!(
                            "expert FFN m={m} {name} {place}, {k} experts fused: {:.1} us, {:.0} GFLOP/s",
                            secs * 1e6,
                            flops / secs / 1e9
                        );
                    }
                }
            }
            // Dense m=1 matvec at the q_proj shape (4096 x 2048), the LM head (151936 x
            // 2048), and 16 x 2048, whose time is the floor of any dispatch in a chain
            // (barrier, launch, one round of loads, reduction).
            // A Q6_K LM head also in the padded layout the executor uploads it in.
            let padded_head = (dtype == DType::Q6K).then_some((151936, 1, true));
            for (rows, n, padded) in [(4096usize, 16usize, false), (151936, 1, false)]
                .into_iter()
                .chain(padded_head)
                .chain([(16, 16, false)])
            {
                let ws: Vec<TestWeight> = (0..n)
                    .map(|i| match padded {
                        true => upload_padded(&h, rows, hid, 1000 + i as u64),
                        false => upload(&h, rows, hid, 1000 + i as u64, dtype, false),
                    })
                    .collect();
                let a = MatmulArgs {
                    rows: rows as u32,
                    cols: hid as u32,
                    m: 1,
                    x_off,
                    x_stride: hid as u32,
                    out_off: y_off,
                    out_stride: rows as u32,
                    ..Default::default()
                };
                let secs = time(&h, |r| {
                    for w in &ws {
                        w.record(r, false, a)?;
                    }
                    Ok(())
                }) / n as f64;
                let layout = if padded { " padded" } else { "" };
                report(
                    &format!("dense matvec m=1 {name}{layout} {rows}x{hid}"),
                    secs,
                    mbytes(rows, hid) as f64,
                );
            }
        }
    }
}
