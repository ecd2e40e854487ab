//! Four forms of the CPU's Q4_K m=1 dot product (AVX2 + FMA), timed on one 768 × 2048
//! matrix in cache (session 34, `bench/README.md`, "CPU block-format products in other
//! forms"): `old` the kernel's form (16 lanes in two accumulators, quants from 8-byte
//! zero-extending loads), `old4` the same with 32 lanes in four accumulators, `win` and
//! `place` 32-byte loads with each byte taken in place (shifted to the top byte, or masked
//! with per-position scales) in a window-permuted lane order. The sums printed agree up to
//! f32 rounding (the orders differ). Standalone:
//! `rustc -C opt-level=3 -o /tmp/q4kf bench/probes/cpu_q4k_forms.rs && /tmp/q4kf`
use std::arch::x86_64::*;
use std::time::Instant;
const COLS: usize = 2048;
const ROWS: usize = 768;
const BB: usize = 144;

/// A little-endian f16 widened exactly (F16C).
#[inline(always)]
unsafe fn f16_le(b: &[u8]) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le_bytes([b[0], b[1]])))))
}

#[inline(always)]
unsafe fn scales(b: &[u8]) -> (__m256, __m256) {
    let w = |i: usize| u32::from_le_bytes([b[4 + 4 * i], b[5 + 4 * i], b[6 + 4 * i], b[7 + 4 * i]]);
    let (w0, w1, w2) = (w(0), w(1), w(2));
    let (k1, k2, k3) = (0x3f3f_3f3fu32, 0x0f0f_0f0fu32, 0x0303_0303u32);
    let sc = (w0 & k1) as u64 | (((w2 & k2) | (((w0 >> 6) & k3) << 4)) as u64) << 32;
    let mn = (w1 & k1) as u64 | ((((w2 >> 4) & k2) | (((w1 >> 6) & k3) << 4)) as u64) << 32;
    let a = _mm256_mul_ps(_mm256_set1_ps(f16_le(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(sc as i64))));
    let m = _mm256_mul_ps(_mm256_set1_ps(f16_le(&b[2..])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mn as i64))));
    (a, m)
}

// (a, b) the kernel's form: 8-byte zero-extending loads, 16 lanes in ACC = 2 accumulators
// (`old`, the engine's), or 32 lanes in ACC = 4 (`old4`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_zext<const ACC: usize>(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mask = _mm256_set1_epi32(0x0F);
    for (k, b) in row.chunks_exact(BB).enumerate() {
        let (a, m) = scales(b);
        let mut av = [0f32; 8]; let mut mv = [0f32; 8];
        _mm256_storeu_ps(av.as_mut_ptr(), a); _mm256_storeu_ps(mv.as_mut_ptr(), m);
        let p = b.as_ptr().add(16);
        let xp = x.as_ptr().add(k * 256);
        for g in 0..4 {
            let v: [__m256i; 4] = [0, 1, 2, 3].map(|c| _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(32 * g + 8 * c) as *const __m128i)));
            for h in 0..2 {
                let sa = _mm256_set1_ps(av[2 * g + h]); let nb = _mm256_set1_ps(-mv[2 * g + h]);
                for c in 0..4 {
                    let n = if h == 0 { _mm256_and_si256(v[c], mask) } else { _mm256_srli_epi32(v[c], 4) };
                    let w = _mm256_fmadd_ps(sa, _mm256_cvtepi32_ps(n), nb);
                    acc[c % ACC] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xp.add(64 * g + 32 * h + 8 * c)), acc[c % ACC]);
                }
            }
        }
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])); let mut o = [0f32; 8]; _mm256_storeu_ps(o.as_mut_ptr(), s); o.iter().sum()
}

// (c, d) windows: 32-byte loads, each byte position a vector in slot order (x windowed):
// bytes shifted to the top (`win`, PLACED false: every scale times 2^-24) or masked in place
// (`place`: the scale times 2^-8p for position p).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_window<const PLACED: bool>(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    let m4 = _mm256_set1_epi8(0x0F);
    let top = _mm256_set1_epi32(0xFF00_0000u32 as i32);
    let masks = [_mm256_set1_epi32(0xFF), _mm256_set1_epi32(0xFF00), _mm256_set1_epi32(0xFF_0000), top];
    let place = if PLACED { [1.0, 1.0 / 256.0, 1.0 / 65536.0, 1.0 / 16_777_216.0] } else { [1.0 / 16_777_216.0; 4] };
    for (k, b) in row.chunks_exact(BB).enumerate() {
        let (a, m) = scales(b);
        let mut av = [[0f32; 8]; 4]; let mut mv = [0f32; 8];
        for p in 0..4 { _mm256_storeu_ps(av[p].as_mut_ptr(), _mm256_mul_ps(a, _mm256_set1_ps(place[p]))); }
        _mm256_storeu_ps(mv.as_mut_ptr(), m);
        let p = b.as_ptr().add(16);
        let xp = x.as_ptr().add(k * 256);
        for g in 0..4 {
            let v = _mm256_loadu_si256(p.add(32 * g) as *const __m256i);
            let ns = [_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)];
            for h in 0..2 {
                let n = ns[h];
                let j = 2 * g + h;
                let sb = _mm256_broadcast_ss(&mv[j]);
                let q = if PLACED {
                    [_mm256_and_si256(n, masks[0]), _mm256_and_si256(n, masks[1]), _mm256_and_si256(n, masks[2]), _mm256_and_si256(n, masks[3])]
                } else {
                    [
                        _mm256_slli_epi32::<24>(n),
                        _mm256_and_si256(_mm256_slli_epi32::<16>(n), top),
                        _mm256_and_si256(_mm256_slli_epi32::<8>(n), top),
                        _mm256_and_si256(n, top),
                    ]
                };
                for pp in 0..4 {
                    let w = _mm256_fmsub_ps(_mm256_broadcast_ss(&av[pp][j]), _mm256_cvtepi32_ps(q[pp]), sb);
                    acc[pp] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xp.add(32 * j + 8 * pp)), acc[pp]);
                }
            }
        }
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])); let mut o = [0f32; 8]; _mm256_storeu_ps(o.as_mut_ptr(), s); o.iter().sum()
}

fn main() {
    let mut data = vec![0u8; ROWS * COLS / 256 * BB];
    let mut s = 12345u32;
    for v in data.iter_mut() { s = s.wrapping_mul(1664525).wrapping_add(1013904223); *v = (s >> 24) as u8; }
    for blk in data.chunks_exact_mut(BB) { blk[0..2].copy_from_slice(&0x2c00u16.to_le_bytes()); blk[2..4].copy_from_slice(&0x2800u16.to_le_bytes()); }
    let x: Vec<f32> = (0..COLS).map(|i| ((i * 7) % 13) as f32 * 0.1 - 0.6).collect();
    // The window forms take x with each 32-element window in slot order 8(i % 4) + i / 4.
    let mut xw = x.clone();
    for (o, c) in xw.chunks_exact_mut(32).zip(x.chunks_exact(32)) {
        for (i, &v) in c.iter().enumerate() {
            o[8 * (i % 4) + i / 4] = v;
        }
    }
    let rb = COLS / 256 * BB;
    let fs: [(&str, unsafe fn(&[u8], &[f32]) -> f32); 4] = [("old", dot_zext::<2>), ("old4", dot_zext::<4>), ("win", dot_window::<false>), ("place", dot_window::<true>)];
    for _round in 0..3 {
        for (name, f) in fs {
            let t = Instant::now(); let mut acc = 0.0;
            let xin = if name == "win" || name == "place" { &xw } else { &x };
            for _ in 0..50 { for r in 0..ROWS { acc += unsafe { f(&data[r * rb..(r + 1) * rb], xin) }; } }
            let dt = t.elapsed().as_secs_f64();
            let w = 50.0 * (ROWS * COLS) as f64;
            print!("{name}: {:.2} cyc/8w ({:.1} Gw/s) {acc:.1} | ", 8.0 * 3.17e9 * dt / w, w / dt / 1e9);
        }
        println!();
    }
}
