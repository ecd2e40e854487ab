//! The forward pass over a block of consecutive tokens, one layer at a time.
//!
//! The same code runs a single decode token (m = 1) and a prefill chunk (m > 1): every
//! per-row computation goes through the same kernels in the same order, so a token's
//! result never depends on how many tokens were processed with it. That is what makes
//! layer-major prefill byte-identical to token-serial replay.

use std::sync::Arc;

use rayon::prelude::*;
use smoe_proto::{ClaimInfo, ExpertKey, ExpertSource, VaultError};

use crate::kernels::{dot_f32, matmul, matvec, rmsnorm, rmsnorm_inplace, silu, softmax_inplace};
use crate::model::{FfnRefs, LayerRefs, Model};
use crate::router::{GateInput, RouteJob, Router};
use crate::tensor::WeightView;
use crate::vault::TensorRef;

/// Why a forward pass could not run.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// Reading an expert failed.
    #[error(transparent)]
    Vault(#[from] VaultError),
    /// The session would exceed the context the engine was sized for.
    #[error("context full: {needed} positions needed but the engine holds at most {max}; shorten the prompt or raise max_context")]
    ContextFull {
        /// Positions the request needs.
        needed: usize,
        /// Positions available.
        max: usize,
    },
    /// The compute device failed (GPU backends).
    #[error("{0}")]
    Device(String),
    /// The router stage stopped or could not start.
    #[error("the router stage stopped (see the log); restart the engine")]
    RouterStopped,
    /// A token id is outside the vocabulary.
    #[error("token id {id} is out of the vocabulary (size {vocab})")]
    TokenOutOfVocab {
        /// The offending id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
}

/// Per-session key/value cache: `[position][kv_head][head_dim]` per layer.
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    /// An empty cache able to hold `model.max_context` positions.
    pub fn new(model: &Model) -> Self {
        let n = model.max_context * model.cfg.kv_dim();
        let layers = model.cfg.num_hidden_layers;
        KvCache {
            k: (0..layers).map(|_| vec![0.0; n]).collect(),
            v: (0..layers).map(|_| vec![0.0; n]).collect(),
            len: 0,
        }
    }

    /// Positions filled.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is filled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets positions from `len` on (used to reuse a shared prefix).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// Cumulative expert-claim accounting of one forward pass object.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ClaimTally {
    /// Expert claims made.
    pub claims: u64,
    /// Claims that needed no read.
    pub hits: u64,
    /// Claims that needed a demand read.
    pub misses: u64,
    /// Bytes read on behalf of claims.
    pub bytes: u64,
}

impl ClaimTally {
    /// Counts one claim.
    pub fn add(&mut self, info: ClaimInfo) {
        self.claims += 1;
        self.bytes += info.bytes;
        if info.hit {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
    }

    /// The change from `earlier` to `self`.
    pub fn since(&self, earlier: &ClaimTally) -> ClaimTally {
        ClaimTally {
            claims: self.claims - earlier.claims,
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            bytes: self.bytes - earlier.bytes,
        }
    }
}

/// One expert claim, as recorded by `--trace-out`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ClaimEvent {
    /// Position of the first token of the block that claimed the expert.
    pub pos: usize,
    /// Tokens in that block (1 in token-serial decode).
    pub rows: usize,
    /// Decoder layer.
    pub layer: usize,
    /// Expert index.
    pub expert: usize,
    /// Whether no read was issued on behalf of this claim.
    pub hit: bool,
    /// Bytes read on behalf of this claim.
    pub bytes: u64,
}

impl ClaimEvent {
    /// The event of claiming expert `expert` of `layer` for the block of `rows` tokens
    /// starting at `pos`.
    pub fn new(pos: usize, rows: usize, layer: usize, expert: usize, info: ClaimInfo) -> Self {
        ClaimEvent { pos, rows, layer, expert, hit: info.hit, bytes: info.bytes }
    }
}

/// Buffers sized once for `max_rows` tokens; reused by every call.
struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    o: Vec<f32>,
    scores: Vec<f32>,
    xsub: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    ysub: Vec<f32>,
    yk: Vec<f32>,
    logits: Vec<f32>,
}

/// Runs blocks of tokens through the model, taking experts from an [`ExpertSource`].
pub struct Forward {
    model: Arc<Model>,
    experts: Arc<dyn ExpertSource>,
    max_rows: usize,
    s: Scratch,
    union_sizes: Vec<usize>,
    tally: ClaimTally,
    trace: Option<Vec<ClaimEvent>>,
    spec_depth: usize,
    /// The router stage, started with the pass.
    router: Router,
}

impl Forward {
    /// A forward pass for blocks of up to `max_rows` tokens. All scratch is allocated here.
    pub fn new(model: Arc<Model>, experts: Arc<dyn ExpertSource>, max_rows: usize) -> Self {
        let c = &model.cfg;
        let m = max_rows.max(1);
        let k = c.num_experts_per_tok.max(1);
        let inter = c.intermediate_size.max(c.moe_intermediate_size);
        let s = Scratch {
            x: vec![0.0; m * c.hidden_size],
            xn: vec![0.0; m * c.hidden_size],
            q: vec![0.0; m * c.q_dim()],
            k: vec![0.0; m * c.kv_dim()],
            v: vec![0.0; m * c.kv_dim()],
            attn: vec![0.0; m * c.q_dim()],
            o: vec![0.0; m * c.hidden_size],
            scores: vec![0.0; c.num_attention_heads * model.max_context],
            xsub: vec![0.0; m * c.hidden_size],
            g: vec![0.0; m * inter],
            u: vec![0.0; m * inter],
            ysub: vec![0.0; m * c.hidden_size],
            yk: vec![0.0; m * k * c.hidden_size],
            logits: vec![0.0; c.vocab_size],
        };
        let union_sizes = vec![0; c.num_hidden_layers];
        let job = RouteJob::new(m, c.hidden_size, c.num_experts, k, c.norm_topk_prob);
        let router = Router::spawn(Arc::clone(&model), Arc::clone(&experts), job);
        Forward {
            model,
            experts,
            max_rows: m,
            s,
            union_sizes,
            tally: ClaimTally::default(),
            trace: None,
            spec_depth: 0,
            router,
        }
    }

    /// The model this pass runs.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Largest block of tokens one call accepts.
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// Starts recording every expert claim (see [`Forward::take_trace`]).
    pub fn enable_trace(&mut self) {
        self.trace.get_or_insert_with(Vec::new);
    }

    /// The claims recorded since the last call, in execution order.
    pub fn take_trace(&mut self) -> Vec<ClaimEvent> {
        self.trace.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// For each decoder layer, how many distinct experts the last call's tokens were
    /// routed to (0 for dense layers).
    pub fn last_union_sizes(&self) -> &[usize] {
        &self.union_sizes
    }

    /// Claim accounting since this pass was created.
    pub fn tally(&self) -> ClaimTally {
        self.tally
    }

    /// Sets how many gate ranks beyond top-k a single-token (decode) step queues as
    /// speculative prefetches for the next token (0 disables).
    pub fn set_spec_depth(&mut self, depth: usize) {
        self.spec_depth = depth;
    }

    /// Runs `tokens` (at positions `kv.len()..`) through every layer, appending their
    /// keys and values to `kv`. When `want_logits`, returns the logits of the last token.
    pub fn forward(
        &mut self,
        kv: &mut KvCache,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, ForwardError> {
        let m = tokens.len();
        assert!(m > 0 && m <= self.max_rows, "block of {m} tokens exceeds max_rows {}", self.max_rows);
        let model = Arc::clone(&self.model);
        let cfg = &model.cfg;
        let start = kv.len;
        if start + m > model.max_context {
            return Err(ForwardError::ContextFull { needed: start + m, max: model.max_context });
        }
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(ForwardError::TokenOutOfVocab { id, vocab: cfg.vocab_size });
        }
        let h = cfg.hidden_size;
        let embed = model.w(&model.embed);
        for (t, &tok) in tokens.iter().enumerate() {
            embed.row_to_f32(tok as usize, &mut self.s.x[t * h..(t + 1) * h]);
        }
        self.union_sizes.fill(0);
        for (l, layer) in model.layers.iter().enumerate() {
            self.attention(&model, l, layer, kv, start, m);
            match &layer.ffn {
                FfnRefs::Dense { gate, up, down } => {
                    self.dense_ffn(&model, layer, model.w(gate), model.w(up), model.w(down), m)
                }
                FfnRefs::Moe { router } => self.moe_ffn(&model, l, layer, router, start, m)?,
            }
        }
        kv.len = start + m;
        if !want_logits {
            return Ok(None);
        }
        let last = &self.s.x[(m - 1) * h..m * h];
        rmsnorm(last, model.vec(&model.norm), cfg.rms_norm_eps, &mut self.s.xn[..h]);
        matvec(&model.w(&model.lm_head), &self.s.xn[..h], &mut self.s.logits);
        Ok(Some(&self.s.logits))
    }

    fn attention(
        &mut self,
        model: &Model,
        l: usize,
        layer: &LayerRefs,
        kv: &mut KvCache,
        start: usize,
        m: usize,
    ) {
        let cfg = &model.cfg;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let eps = cfg.rms_norm_eps;
        let s = &mut self.s;
        let norm = model.vec(&layer.input_norm);
        for t in 0..m {
            rmsnorm(&s.x[t * h..(t + 1) * h], norm, eps, &mut s.xn[t * h..(t + 1) * h]);
        }
        let xn = &s.xn[..m * h];
        matmul(&model.w(&layer.q), xn, m, &mut s.q[..m * qd]);
        matmul(&model.w(&layer.k), xn, m, &mut s.k[..m * kvd]);
        matmul(&model.w(&layer.v), xn, m, &mut s.v[..m * kvd]);
        let (qn, kn) = (model.vec(&layer.q_norm), model.vec(&layer.k_norm));
        for t in 0..m {
            let pos = start + t;
            for head in s.q[t * qd..(t + 1) * qd].chunks_exact_mut(hd) {
                rmsnorm_inplace(head, qn, eps);
                model.rope.apply(head, pos);
            }
            for head in s.k[t * kvd..(t + 1) * kvd].chunks_exact_mut(hd) {
                rmsnorm_inplace(head, kn, eps);
                model.rope.apply(head, pos);
            }
            kv.k[l][pos * kvd..(pos + 1) * kvd].copy_from_slice(&s.k[t * kvd..(t + 1) * kvd]);
            kv.v[l][pos * kvd..(pos + 1) * kvd].copy_from_slice(&s.v[t * kvd..(t + 1) * kvd]);
        }
        let group = cfg.num_attention_heads / cfg.num_key_value_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let (kc, vc) = (&kv.k[l], &kv.v[l]);
        let ctx = model.max_context;
        for t in 0..m {
            let n = start + t + 1;
            let q = &s.q[t * qd..(t + 1) * qd];
            let out = &mut s.attn[t * qd..(t + 1) * qd];
            let per_head = |(head, (scores, o)): (usize, (&mut [f32], &mut [f32]))| {
                let g = head / group;
                let qh = &q[head * hd..(head + 1) * hd];
                let sc = &mut scores[..n];
                for (j, v) in sc.iter_mut().enumerate() {
                    *v = dot_f32(qh, &kc[j * kvd + g * hd..j * kvd + (g + 1) * hd]) * scale;
                }
                softmax_inplace(sc);
                o.fill(0.0);
                for (j, &p) in sc.iter().enumerate() {
                    let vj = &vc[j * kvd + g * hd..j * kvd + (g + 1) * hd];
                    for (od, &vd) in o.iter_mut().zip(vj) {
                        *od += p * vd;
                    }
                }
            };
            let chunks = s.scores.chunks_mut(ctx).zip(out.chunks_exact_mut(hd));
            if n * qd < 1 << 14 {
                chunks.enumerate().for_each(per_head);
            } else {
                s.scores.par_chunks_mut(ctx).zip(out.par_chunks_exact_mut(hd)).enumerate().for_each(per_head);
            }
        }
        matmul(&model.w(&layer.o), &s.attn[..m * qd], m, &mut s.o[..m * h]);
        for (x, o) in s.x[..m * h].iter_mut().zip(&s.o[..m * h]) {
            *x += o;
        }
    }

    fn post_norm(&mut self, model: &Model, layer: &LayerRefs, m: usize) {
        let h = model.cfg.hidden_size;
        let norm = model.vec(&layer.post_norm);
        for t in 0..m {
            rmsnorm(
                &self.s.x[t * h..(t + 1) * h],
                norm,
                model.cfg.rms_norm_eps,
                &mut self.s.xn[t * h..(t + 1) * h],
            );
        }
    }

    fn dense_ffn(
        &mut self,
        model: &Model,
        layer: &LayerRefs,
        gate: WeightView<'_>,
        up: WeightView<'_>,
        down: WeightView<'_>,
        m: usize,
    ) {
        self.post_norm(model, layer, m);
        let h = model.cfg.hidden_size;
        let s = &mut self.s;
        swiglu(gate, up, down, &s.xn[..m * h], m, &mut s.g, &mut s.u, &mut s.ysub);
        for (x, y) in s.x[..m * h].iter_mut().zip(&s.ysub[..m * h]) {
            *x += y;
        }
    }

    fn moe_ffn(
        &mut self,
        model: &Model,
        l: usize,
        layer: &LayerRefs,
        gate: &TensorRef,
        start: usize,
        m: usize,
    ) -> Result<(), ForwardError> {
        self.post_norm(model, layer, m);
        let cfg = &model.cfg;
        let (h, k) = (cfg.hidden_size, cfg.num_experts_per_tok);
        // The router computes the gate from the normalised rows: the plane moves to it
        // and back with the job, it is not copied.
        let spec_depth = self.spec_depth;
        let xn = &mut self.s.xn;
        let job = self
            .router
            .route(|job| {
                job.request(l, m, GateInput::Hidden(gate.clone()), spec_depth);
                std::mem::swap(job.hidden_mut(), xn);
            })
            .map_err(|_| ForwardError::RouterStopped)?;
        std::mem::swap(job.hidden_mut(), &mut self.s.xn);
        let s = &mut self.s;
        let layout = *model.vault.expert_layout();
        for (ui, &e) in job.union().iter().enumerate() {
            // The (token, rank) pairs routed to `e`, in token order.
            let pairs = job.pairs_of(ui);
            let n = pairs.len();
            for (j, &i) in pairs.iter().enumerate() {
                let t = i as usize / k;
                s.xsub[j * h..(j + 1) * h].copy_from_slice(&s.xn[t * h..(t + 1) * h]);
            }
            let blob = match self.experts.claim(ExpertKey::new(l, e as usize)) {
                Ok(b) => b,
                Err(err) => {
                    job.withdraw_after(ui, self.experts.as_ref());
                    return Err(err.into());
                }
            };
            self.tally.add(blob.info());
            if let Some(trace) = self.trace.as_mut() {
                trace.push(ClaimEvent::new(start, m, l, e as usize, blob.info()));
            }
            let part = |p: &smoe_proto::PartLayout| {
                let off = p.offset as usize;
                WeightView::from_bytes(
                    layout.dtype,
                    &blob[off..off + p.rows * p.cols * layout.dtype.size()],
                    p.rows,
                    p.cols,
                )
            };
            swiglu(
                part(&layout.gate),
                part(&layout.up),
                part(&layout.down),
                &s.xsub[..n * h],
                n,
                &mut s.g,
                &mut s.u,
                &mut s.ysub,
            );
            drop(blob);
            for (j, &i) in pairs.iter().enumerate() {
                let i = i as usize;
                s.yk[i * h..(i + 1) * h].copy_from_slice(&s.ysub[j * h..(j + 1) * h]);
            }
        }
        // Weighted sum in rank order, then the residual add.
        let topk_w = job.topk_weights();
        for t in 0..m {
            let x = &mut s.x[t * h..(t + 1) * h];
            let acc = &mut s.xsub[..h];
            acc.fill(0.0);
            for r in 0..k {
                let w = topk_w[t * k + r];
                let y = &s.yk[(t * k + r) * h..(t * k + r + 1) * h];
                for (a, &yv) in acc.iter_mut().zip(y) {
                    *a += yv * w;
                }
            }
            for (xv, a) in x.iter_mut().zip(acc.iter()) {
                *xv += a;
            }
        }
        job.place_bets(self.experts.as_ref());
        self.union_sizes[l] = job.union().len();
        if m > 1 {
            metrics::histogram!("smoe_union_size").record(job.union().len() as f64);
        }
        Ok(())
    }
}

/// SwiGLU feed-forward for `m` rows: `down · (silu(gate · x) ⊙ (up · x))` into `y`.
#[allow(clippy::too_many_arguments)]
fn swiglu(
    gate: WeightView<'_>,
    up: WeightView<'_>,
    down: WeightView<'_>,
    x: &[f32],
    m: usize,
    g: &mut [f32],
    u: &mut [f32],
    y: &mut [f32],
) {
    let (inter, h) = (gate.rows, down.rows);
    let (g, u) = (&mut g[..m * inter], &mut u[..m * inter]);
    matmul(&gate, x, m, g);
    matmul(&up, x, m, u);
    for (gv, &uv) in g.iter_mut().zip(u.iter()) {
        *gv = silu(*gv) * uv;
    }
    matmul(&down, g, m, &mut y[..m * h]);
}
