//! CPU kernel throughput by weight format: the m=1 matvec (decode) and the token-batched
//! matmul (prefill) of the engine's CPU kernels (`cpu::kernels`, which dispatch block
//! formats to `cpu::quant`), on one matrix stored as bf16, f32, f16 and each ggml block
//! format. Reports GB/s of *stored* weight bytes (what a memory- or disk-bound decode
//! streams), G weights/s (the arithmetic done), and time per product against bf16. All
//! formats are timed round-robin in the same run (median of the rounds), so the ratios
//! hold on a noisy machine.
//!
//! Usage: `cpu_kernels [ROWS COLS] [TOKENS] [ROUNDS]`
//! (default: a Qwen3-30B-A3B expert's gate/up shape, 768 × 2048; 16 tokens; 7 rounds)

use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use smoe_actors::cpu::kernels::{matmul, matvec};
use smoe_actors::cpu::quantize::encode_rows;
use smoe_actors::tensor::WeightView;
use smoe_proto::DType;

/// Time each (format, m) cell runs per round.
const CELL: Duration = Duration::from_millis(150);

/// Seconds per product of `m` tokens, over at least [`CELL`].
fn time(w: &WeightView<'_>, xs: &[f32], m: usize, out: &mut [f32]) -> f64 {
    let (start, mut n) = (Instant::now(), 0u32);
    while start.elapsed() < CELL || n < 3 {
        if m == 1 {
            matvec(w, &xs[..w.cols], &mut out[..w.rows]);
        } else {
            matmul(w, &xs[..m * w.cols], m, &mut out[..m * w.rows]);
        }
        n += 1;
    }
    start.elapsed().as_secs_f64() / n as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("numeric arguments")).collect();
    let (rows, cols) = match args[..] {
        [r, c, ..] => (r, c),
        _ => (768, 2048),
    };
    let tokens = args.get(2).copied().unwrap_or(16);
    let rounds = args.get(3).copied().unwrap_or(7);
    let formats =
        [DType::Bf16, DType::F32, DType::F16, DType::Q8_0, DType::Q6K, DType::Q5K, DType::Q4K, DType::Q4_0];
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let a = (3.0 / cols as f32).sqrt();
    let w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-a..a)).collect();
    let xs: Vec<f32> = (0..tokens * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
    let stored: Vec<Vec<u8>> = formats
        .iter()
        .map(|&d| {
            let mut b = Vec::new();
            encode_rows(&w, cols, d, &mut b).expect("rows of whole blocks");
            b
        })
        .collect();
    let views: Vec<WeightView<'_>> =
        formats.iter().zip(&stored).map(|(&d, b)| WeightView::from_bytes(d, b, rows, cols)).collect();
    let mut out = vec![0.0f32; tokens * rows];
    let ms = [1, tokens];
    // times[format][m index][round]
    let mut times = vec![[Vec::new(), Vec::new()]; formats.len()];
    for _ in 0..rounds {
        for (f, v) in views.iter().enumerate() {
            for (i, &m) in ms.iter().enumerate() {
                times[f][i].push(time(v, &xs, m, &mut out));
            }
        }
    }
    let threads = rayon::current_num_threads();
    println!(
        "{rows} × {cols} weights, {threads} threads, median of {rounds} rounds of {} ms per cell",
        CELL.as_millis()
    );
    println!(
        "{:<6} {:>9} | {:>8} {:>9} {:>8} {:>8} | {:>8} {:>9} {:>8} {:>8}",
        "format",
        "bytes",
        "m=1 µs",
        "GB/s",
        "Gw/s",
        "vs bf16",
        format!("m={tokens} µs"),
        "GB/s",
        "Gw/s",
        "vs bf16"
    );
    let base: Vec<f64> = (0..2).map(|i| median(times[0][i].clone())).collect();
    for (f, &d) in formats.iter().enumerate() {
        let bytes = stored[f].len() as f64;
        let mut line = format!("{:<6} {:>9}", d.name(), stored[f].len());
        for (i, &m) in ms.iter().enumerate() {
            let t = median(times[f][i].clone());
            let per_token = t / m as f64;
            line += &format!(
                " | {:>8.1} {:>9.2} {:>8.2} {:>7.2}×",
                t * 1e6,
                bytes / per_token / 1e9,
                (rows * cols) as f64 / per_token / 1e9,
                base[i] / t
            );
        }
        println!("{line}");
    }
    println!("GB/s: stored weight bytes per second (for m tokens: bytes × m / time); Gw/s: weights");
    println!("multiplied per second; vs bf16: bf16's time over this format's (above 1: faster)");
}
