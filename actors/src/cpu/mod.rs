//! The CPU backend, the reference: every [`Backend`] operation on host memory with the
//! kernels of [`kernels`]. Activation planes and scratch are sized once for the largest
//! block; per row, a block of m tokens runs the same kernels in the same order as a
//! single token, so layer-major prefill is byte-identical to token-serial replay.

mod attend;
pub mod delta;
pub mod fused;
pub mod kernels;
mod kv;
#[cfg(target_arch = "x86_64")]
mod panels;
pub mod quant;
pub mod quantize;

use std::sync::Arc;

use smoe_proto::{ExpertHandle, GateInput, HybridConfig, PartLayout, RouteJob};

pub use kv::KvCache;

use crate::contract::{Backend, Flush, ForwardError, Plane, Write};
use crate::model::Model;
use crate::tensor::WeightView;
use crate::vault::TensorRef;
use kernels::{matmul, matvec, rmsnorm, rmsnorm_inplace, row_to_f32, silu};

/// Host buffers sized once for `max_rows` tokens; reused by every call.
struct Scratch {
    /// The activation planes, indexed by [`Plane`] position in [`Plane::ALL`].
    planes: [Vec<f32>; 12],
    /// A projection's result before it is added to its output plane.
    sum: Vec<f32>,
    /// The up projection of a SwiGLU block.
    u: Vec<f32>,
    /// One expert's input rows.
    xsub: Vec<f32>,
    /// One expert's output rows.
    ysub: Vec<f32>,
    /// Every (token, rank) pair's expert output.
    yk: Vec<f32>,
    /// The LM head's output.
    logits: Vec<f32>,
    /// One row's normalised DeltaNet queries and keys.
    qk: Vec<f32>,
    /// The delta rule's per-head `Sᵀk` and `β(v − Sᵀk)`.
    mem: Vec<f32>,
}

/// The CPU reference backend.
pub struct CpuBackend {
    model: Arc<Model>,
    s: Scratch,
}

impl CpuBackend {
    /// A backend for blocks of up to `max_rows` tokens of `model`. The activation planes
    /// and scratch are allocated here; the attention's scores and a batched product's
    /// input chunks are per-thread rows sized by their call (`attend`, `panels`).
    pub fn new(model: Arc<Model>, max_rows: usize) -> Self {
        let c = &model.cfg;
        let m = max_rows.max(1);
        let k = c.num_experts_per_tok.max(1);
        let inter = Plane::Hidden.width(c).max(c.moe_intermediate_size);
        let width = |p: Plane| match p {
            Plane::Hidden => inter,
            p => p.width(c),
        };
        let hy = c.hybrid.as_ref();
        let s = Scratch {
            planes: Plane::ALL.map(|p| vec![0.0; m * width(p)]),
            sum: vec![0.0; m * c.hidden_size],
            u: vec![0.0; m * inter],
            xsub: vec![0.0; m * c.hidden_size],
            ysub: vec![0.0; m * c.hidden_size],
            yk: vec![0.0; m * k * c.hidden_size],
            logits: vec![0.0; c.vocab_size],
            qk: vec![0.0; hy.map_or(0, |h| 2 * h.key_dim())],
            mem: vec![0.0; hy.map_or(0, HybridConfig::value_dim)],
        };
        CpuBackend { model, s }
    }

    /// Two distinct planes, the first to read and the second to write.
    fn pair(&mut self, src: Plane, dst: Plane) -> (&[f32], &mut [f32]) {
        let (a, b) = (src as usize, dst as usize);
        assert_ne!(a, b, "an operation reads and writes the same plane");
        let planes = &mut self.s.planes;
        if a < b {
            let (lo, hi) = planes.split_at_mut(b);
            (&lo[a], &mut hi[0])
        } else {
            let (lo, hi) = planes.split_at_mut(a);
            (&hi[0], &mut lo[b])
        }
    }
}

/// `out (=|+=) result` over the first `n` elements, through `sum` when adding.
fn write_out(write: Write, out: &mut [f32], sum: &mut [f32], n: usize, compute: impl FnOnce(&mut [f32])) {
    match write {
        Write::Set => compute(&mut out[..n]),
        Write::Add => {
            compute(&mut sum[..n]);
            for (o, s) in out[..n].iter_mut().zip(&sum[..n]) {
                *o += s;
            }
        }
    }
}

impl Backend for CpuBackend {
    type Kv = KvCache;

    fn new_kv(&self) -> Result<KvCache, ForwardError> {
        Ok(KvCache::new(&self.model))
    }

    fn embed(&mut self, embed: &TensorRef, tokens: &[u32]) -> Result<(), ForwardError> {
        let h = self.model.cfg.hidden_size;
        let w = self.model.w(embed);
        let x = &mut self.s.planes[Plane::X as usize];
        for (t, &tok) in tokens.iter().enumerate() {
            row_to_f32(&w, tok as usize, &mut x[t * h..(t + 1) * h]);
        }
        Ok(())
    }

    fn rmsnorm(&mut self, w: &TensorRef, src: Plane, dst: Plane, rows: usize) -> Result<(), ForwardError> {
        let model = Arc::clone(&self.model);
        let (h, eps) = (model.cfg.hidden_size, model.cfg.rms_norm_eps);
        let norm = model.vec(w);
        let (x, out) = self.pair(src, dst);
        for t in 0..rows {
            rmsnorm(&x[t * h..(t + 1) * h], norm, eps, &mut out[t * h..(t + 1) * h]);
        }
        Ok(())
    }

    fn project(
        &mut self,
        w: &TensorRef,
        src: Plane,
        dst: Plane,
        rows: usize,
        write: Write,
    ) -> Result<(), ForwardError> {
        let model = Arc::clone(&self.model);
        let w = model.w(w);
        let mut sum = std::mem::take(&mut self.s.sum);
        let (x, out) = self.pair(src, dst);
        write_out(write, out, &mut sum, rows * w.rows, |o| matmul(&w, &x[..rows * w.cols], rows, o));
        self.s.sum = sum;
        Ok(())
    }

    fn qk_norm_rope(
        &mut self,
        layer: usize,
        q_norm: &TensorRef,
        k_norm: &TensorRef,
        kv: &mut KvCache,
        start: usize,
        rows: usize,
    ) -> Result<(), ForwardError> {
        let model = &self.model;
        let cfg = &model.cfg;
        let (hd, qd, kvd, eps) = (cfg.head_dim, cfg.q_dim(), cfg.kv_dim(), cfg.rms_norm_eps);
        let (qn, kn) = (model.vec(q_norm), model.vec(k_norm));
        let [_, _, q, k, v, ..] = &mut self.s.planes;
        kv.book.states_changing();
        for t in 0..rows {
            let pos = start + t;
            for head in q[t * qd..(t + 1) * qd].chunks_exact_mut(hd) {
                rmsnorm_inplace(head, qn, eps);
                model.rope.apply(head, pos);
            }
            for head in k[t * kvd..(t + 1) * kvd].chunks_exact_mut(hd) {
                rmsnorm_inplace(head, kn, eps);
                model.rope.apply(head, pos);
            }
            kv.k[layer][pos * kvd..(pos + 1) * kvd].copy_from_slice(&k[t * kvd..(t + 1) * kvd]);
            kv.v[layer][pos * kvd..(pos + 1) * kvd].copy_from_slice(&v[t * kvd..(t + 1) * kvd]);
        }
        Ok(())
    }

    fn attention(
        &mut self,
        layer: usize,
        kv: &KvCache,
        start: usize,
        rows: usize,
    ) -> Result<(), ForwardError> {
        let cfg = &self.model.cfg;
        let heads = attend::Heads {
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
        };
        let [_, _, q, _, _, attn, ..] = &mut self.s.planes;
        attend::causal(&heads, q, &kv.k[layer], &kv.v[layer], start, rows, attn);
        Ok(())
    }

    fn conv1d(
        &mut self,
        layer: usize,
        w: &TensorRef,
        kv: &mut KvCache,
        rows: usize,
    ) -> Result<(), ForwardError> {
        let model = &self.model;
        let hy = model.hybrid()?;
        let (c, width, taps) = (hy.conv_dim(), Plane::Lin.width(&model.cfg), model.vec(w));
        let state = &mut kv.conv[layer];
        kv.book.states_changing();
        let lin = &mut self.s.planes[Plane::Lin as usize];
        for row in lin.chunks_exact_mut(width).take(rows) {
            delta::conv1d_step(&mut row[..c], taps, state, hy.linear_conv_kernel_dim);
        }
        Ok(())
    }

    fn delta_rule(
        &mut self,
        layer: usize,
        a_log: &TensorRef,
        dt_bias: &TensorRef,
        kv: &mut KvCache,
        rows: usize,
    ) -> Result<(), ForwardError> {
        let model = &self.model;
        let hy = model.hybrid()?;
        let (kd, vd, nv) = (hy.key_dim(), hy.value_dim(), hy.linear_num_value_heads);
        let sh = delta::DeltaShape {
            k_heads: hy.linear_num_key_heads,
            v_heads: nv,
            k_dim: hy.linear_key_head_dim,
            v_dim: hy.linear_value_head_dim,
        };
        let (width, (a_log, dt_bias)) =
            (Plane::Lin.width(&model.cfg), (model.vec(a_log), model.vec(dt_bias)));
        let q_scale = 1.0 / (sh.k_dim as f32).sqrt();
        let state = &mut kv.rec[layer];
        kv.book.states_changing();
        let s = &mut self.s;
        let [.., lin, core, _, _] = &mut s.planes;
        for (row, out) in lin.chunks_exact(width).zip(core.chunks_exact_mut(vd)).take(rows) {
            s.qk.copy_from_slice(&row[..2 * kd]);
            for (i, head) in s.qk.chunks_exact_mut(sh.k_dim).enumerate() {
                delta::l2norm_inplace(head, if i < sh.k_heads { q_scale } else { 1.0 });
            }
            let (v, gates) = (&row[2 * kd..2 * kd + vd], &row[2 * kd + 2 * vd..]);
            let (b, a) = (&gates[..nv], &gates[nv..2 * nv]);
            let x = delta::DeltaRow { qk: &s.qk, v, b, a, a_log, dt_bias };
            delta::delta_row(sh, &x, state, &mut s.mem, out);
        }
        Ok(())
    }

    fn gated_rmsnorm(&mut self, w: &TensorRef, rows: usize) -> Result<(), ForwardError> {
        let model = &self.model;
        let hy = model.hybrid()?;
        let (c, vd, width) = (hy.conv_dim(), hy.value_dim(), Plane::Lin.width(&model.cfg));
        let (w, eps) = (model.vec(w), model.cfg.rms_norm_eps);
        let [.., lin, core, _, _] = &mut self.s.planes;
        for (x, row) in core.chunks_exact_mut(vd).zip(lin.chunks_exact(width)).take(rows) {
            delta::gated_rmsnorm_row(x, &row[c..c + vd], w, eps);
        }
        Ok(())
    }

    fn sigmoid_mul(&mut self, dst: Plane, gate: Plane, rows: usize) -> Result<(), ForwardError> {
        let n = rows * dst.width(&self.model.cfg);
        let (g, x) = self.pair(gate, dst);
        for (xv, &gv) in x[..n].iter_mut().zip(&g[..n]) {
            *xv *= delta::sigmoid(gv);
        }
        Ok(())
    }

    fn gated_add(&mut self, src: Plane, gate: Plane, rows: usize) -> Result<(), ForwardError> {
        let h = self.model.cfg.hidden_size;
        assert!(src != Plane::X && gate != Plane::X, "gated_add reads planes other than X");
        // X is plane 0; the others follow it.
        let (x, rest) = self.s.planes.split_first_mut().expect("planes");
        let (y, g) = (&rest[src as usize - 1], &rest[gate as usize - 1]);
        for ((xr, yr), &gv) in x.chunks_exact_mut(h).zip(y.chunks_exact(h)).zip(g).take(rows) {
            let sg = delta::sigmoid(gv);
            for (xv, &yv) in xr.iter_mut().zip(yr) {
                *xv += sg * yv;
            }
        }
        Ok(())
    }

    fn swiglu(
        &mut self,
        gate: &TensorRef,
        up: &TensorRef,
        src: Plane,
        rows: usize,
    ) -> Result<(), ForwardError> {
        let model = Arc::clone(&self.model);
        let mut u = std::mem::take(&mut self.s.u);
        let (x, g) = self.pair(src, Plane::Hidden);
        gated(&model.w(gate), &model.w(up), &x[..rows * model.cfg.hidden_size], rows, g, &mut u);
        self.s.u = u;
        Ok(())
    }

    fn route_input(
        &mut self,
        _gate: &TensorRef,
        _rows: usize,
        job: &mut RouteJob,
    ) -> Result<GateInput, ForwardError> {
        std::mem::swap(job.hidden_mut(), &mut self.s.planes[Plane::Xn as usize]);
        Ok(GateInput::Hidden)
    }

    fn route_output(&mut self, job: &mut RouteJob) -> Result<(), ForwardError> {
        std::mem::swap(job.hidden_mut(), &mut self.s.planes[Plane::Xn as usize]);
        Ok(())
    }

    fn expert_batch(&self, _rows: usize) -> usize {
        1
    }

    fn experts(
        &mut self,
        layer: usize,
        plan: &RouteJob,
        first: usize,
        blobs: &[ExpertHandle],
        _flush: Flush,
    ) -> Result<bool, ForwardError> {
        let layout = *self.model.vault.expert_layout(layer)?;
        let (h, k) = (self.model.cfg.hidden_size, plan.k());
        let s = &mut self.s;
        for (i, blob) in blobs.iter().enumerate() {
            // The (token, rank) pairs routed to this member, in token order.
            let pairs = plan.pairs_of(first + i);
            let n = pairs.len();
            let xn = &s.planes[Plane::Xn as usize];
            for (j, &p) in pairs.iter().enumerate() {
                let t = p as usize / k;
                s.xsub[j * h..(j + 1) * h].copy_from_slice(&xn[t * h..(t + 1) * h]);
            }
            let part = |p: &PartLayout| WeightView::from_bytes(p.dtype, p.slice(blob), p.rows, p.cols);
            let (gate, up, down) = (part(&layout.gate), part(&layout.up), part(&layout.down));
            let g = &mut s.planes[Plane::Hidden as usize];
            gated(&gate, &up, &s.xsub[..n * h], n, g, &mut s.u);
            matmul(&down, &g[..n * gate.rows], n, &mut s.ysub[..n * h]);
            for (j, &p) in pairs.iter().enumerate() {
                let p = p as usize;
                s.yk[p * h..(p + 1) * h].copy_from_slice(&s.ysub[j * h..(j + 1) * h]);
            }
        }
        Ok(true)
    }

    fn combine(&mut self, plan: &RouteJob, rows: usize) -> Result<(), ForwardError> {
        let (h, k) = (self.model.cfg.hidden_size, plan.k());
        let topk_w = plan.topk_weights();
        let s = &mut self.s;
        let x = &mut s.planes[Plane::X as usize];
        let acc = &mut s.sum[..h];
        for t in 0..rows {
            acc.fill(0.0);
            for r in 0..k {
                let w = topk_w[t * k + r];
                let y = &s.yk[(t * k + r) * h..(t * k + r + 1) * h];
                for (a, &yv) in acc.iter_mut().zip(y) {
                    *a += yv * w;
                }
            }
            for (xv, a) in x[t * h..(t + 1) * h].iter_mut().zip(acc.iter()) {
                *xv += a;
            }
        }
        Ok(())
    }

    fn lm_head(&mut self, norm: &TensorRef, lm_head: &TensorRef, row: usize) -> Result<(), ForwardError> {
        let model = &self.model;
        let (h, eps) = (model.cfg.hidden_size, model.cfg.rms_norm_eps);
        let [x, xn, ..] = &mut self.s.planes;
        rmsnorm(&x[row * h..(row + 1) * h], model.vec(norm), eps, &mut xn[..h]);
        matvec(&model.w(lm_head), &xn[..h], &mut self.s.logits);
        Ok(())
    }

    fn last_logits(&self) -> &[f32] {
        &self.s.logits
    }

    fn finish(&mut self) -> Result<(), ForwardError> {
        Ok(())
    }

    fn abandon(&mut self) {}
}

/// `g = silu(gate · x) ⊙ (up · x)` for `m` rows (`u` is scratch).
fn gated(gate: &WeightView<'_>, up: &WeightView<'_>, x: &[f32], m: usize, g: &mut [f32], u: &mut [f32]) {
    let inter = gate.rows;
    let (g, u) = (&mut g[..m * inter], &mut u[..m * inter]);
    matmul(gate, x, m, g);
    matmul(up, x, m, u);
    for (gv, &uv) in g.iter_mut().zip(u.iter()) {
        *gv = silu(*gv) * uv;
    }
}
