//! A routing job: what the executor hands the router for one MoE layer of one block of
//! tokens, and the plan the router hands back in the same buffers.
//!
//! A job is sized once for the largest block and moved between the executor and the
//! router thread by pointer: routing a layer neither copies the activation plane nor
//! allocates.

use smoe_proto::{ExpertKey, ExpertSource};

use super::rank::route;
use crate::vault::TensorRef;

/// Where a job's gate logits come from.
#[derive(Clone, Debug)]
pub enum GateInput {
    /// The router computes them from the block's normalised hidden rows
    /// ([`RouteJob::hidden_mut`]) with this layer's gate weight.
    Hidden(TensorRef),
    /// The executor computed them on its device and wrote them to
    /// [`RouteJob::logits_mut`].
    Logits,
}

/// One layer's routing for a block of tokens: the request (layer, rows, gate input,
/// bet depth) and, once routed, the plan (top-k per token, the union in first-use order
/// with each member's tokens, how much of the union was announced).
pub struct RouteJob {
    h: usize,
    k: usize,
    norm_topk_prob: bool,
    layer: usize,
    rows: usize,
    bets: usize,
    input: GateInput,
    hidden: Vec<f32>,
    logits: Vec<f32>,
    topk_e: Vec<u16>,
    topk_w: Vec<f32>,
    ranked: Vec<u16>,
    in_union: Vec<bool>,
    union: Vec<u16>,
    announced: usize,
    /// Per expert: how many (token, rank) pairs chose it, then the fill cursor.
    counts: Vec<u32>,
    /// Per union member: where its pairs start in `pairs` (one more entry at the end).
    seg_start: Vec<u32>,
    pairs: Vec<u32>,
}

impl RouteJob {
    /// A job for blocks of up to `max_rows` tokens of a model with `hidden` hidden size
    /// (0 when the executor always supplies logits), `experts` experts, top-`k`, and
    /// whether the top-k weights are renormalised.
    pub fn new(max_rows: usize, hidden: usize, experts: usize, k: usize, norm_topk_prob: bool) -> Self {
        let m = max_rows.max(1);
        let k = k.clamp(1, experts.max(1));
        RouteJob {
            h: hidden,
            k,
            norm_topk_prob,
            layer: 0,
            rows: 0,
            bets: 0,
            input: GateInput::Logits,
            hidden: vec![0.0; m * hidden],
            logits: vec![0.0; m * experts],
            topk_e: vec![0; m * k],
            topk_w: vec![0.0; m * k],
            ranked: vec![0; experts.max(k)],
            in_union: vec![false; experts],
            union: Vec::with_capacity(experts),
            announced: 0,
            counts: vec![0; experts],
            seg_start: Vec::with_capacity(experts + 1),
            pairs: vec![0; m * k],
        }
    }

    /// Sets the request: route `rows` tokens of decoder layer `layer` from `input`.
    /// For a single token, `bets` more experts beyond top-k are ranked as speculative
    /// prefetches for the next token (see [`RouteJob::place_bets`]; 0 disables; ignored
    /// for blocks).
    pub fn request(&mut self, layer: usize, rows: usize, input: GateInput, bets: usize) {
        assert!(rows > 0 && rows * self.k <= self.topk_e.len(), "routing {rows} rows exceeds the job's size");
        self.layer = layer;
        self.rows = rows;
        self.input = input;
        self.bets = if rows == 1 { bets.min(self.ranked.len() - self.k) } else { 0 };
    }

    /// The hidden-row plane (`rows × hidden`) the router reads for [`GateInput::Hidden`];
    /// the executor may swap its own plane in and out instead of copying.
    pub fn hidden_mut(&mut self) -> &mut Vec<f32> {
        &mut self.hidden
    }

    /// The logits plane (`rows × experts`) for [`GateInput::Logits`].
    pub fn logits_mut(&mut self) -> &mut [f32] {
        &mut self.logits
    }

    /// Experts chosen per token: `rows × k`, token-major, in rank order.
    pub fn topk_experts(&self) -> &[u16] {
        &self.topk_e[..self.rows * self.k]
    }

    /// The matching routing weights (renormalised when the model says so).
    pub fn topk_weights(&self) -> &[f32] {
        &self.topk_w[..self.rows * self.k]
    }

    /// The distinct experts of the block, in the order they first appeared.
    pub fn union(&self) -> &[u16] {
        &self.union
    }

    /// How many leading union members were announced to the expert source (announcing
    /// stops at the first refusal, so claims in union order never wait on a slot that
    /// a later announcement pins).
    pub fn announced(&self) -> usize {
        self.announced
    }

    /// All token-major pair indices `t·k + r`, grouped by union member in union order
    /// (see [`RouteJob::segments`]).
    pub fn pairs(&self) -> &[u32] {
        &self.pairs[..self.rows * self.k]
    }

    /// For each union member, where its pairs start in [`RouteJob::pairs`] and how many
    /// there are.
    pub fn segments(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.seg_start.windows(2).map(|w| (w[0] as usize, (w[1] - w[0]) as usize))
    }

    /// The token-major pair indices `t·k + r` routed to union member `ui`, ascending.
    pub fn pairs_of(&self, ui: usize) -> &[u32] {
        &self.pairs[self.seg_start[ui] as usize..self.seg_start[ui + 1] as usize]
    }

    /// Tells `experts` that announced union members after `ui` will not be claimed
    /// (used when claiming member `ui` failed).
    pub fn withdraw_after(&self, ui: usize, experts: &dyn ExpertSource) {
        for &e in self.union.iter().take(self.announced).skip(ui + 1) {
            experts.withdraw(ExpertKey::new(self.layer, e as usize));
        }
    }

    /// Tokens in the request.
    pub(super) fn rows(&self) -> usize {
        self.rows
    }

    /// Queues a decode step's bets — the token's gate ranks k+1..k+N (none for a block) —
    /// as speculative prefetches for the next token. The executor calls this once it has
    /// claimed the layer's experts, so bets never share the disk with this layer's demand
    /// reads.
    pub fn place_bets(&self, experts: &dyn ExpertSource) {
        for &e in &self.ranked[self.k..self.k + self.bets] {
            experts.prefetch(ExpertKey::new(self.layer, e as usize));
        }
    }

    /// What the router computes from this job's request.
    pub(super) fn input(&self) -> &GateInput {
        &self.input
    }

    /// Splits the job into the hidden rows (read) and the logits plane (written) for
    /// the block of tokens `t0..t1`.
    pub(super) fn gate_planes(&mut self, t0: usize, t1: usize) -> (&[f32], &mut [f32]) {
        let (h, ne) = (self.h, self.in_union.len());
        (&self.hidden[t0 * h..t1 * h], &mut self.logits[t0 * ne..t1 * ne])
    }

    /// Forgets the previous plan.
    pub(super) fn begin(&mut self) {
        self.union.clear();
        self.in_union.fill(false);
        self.announced = 0;
    }

    /// Routes token `t` from its logits (overwritten with probabilities) and announces
    /// each expert the moment it first enters the union.
    pub(super) fn route_token(&mut self, t: usize, experts: &dyn ExpertSource) {
        let (k, ne) = (self.k, self.in_union.len());
        let logits = &mut self.logits[t * ne..(t + 1) * ne];
        let weights = &mut self.topk_w[t * k..(t + 1) * k];
        if self.bets > 0 {
            route(logits, k, self.norm_topk_prob, &mut self.ranked[..k + self.bets], weights);
            self.topk_e[t * k..(t + 1) * k].copy_from_slice(&self.ranked[..k]);
        } else {
            route(logits, k, self.norm_topk_prob, &mut self.topk_e[t * k..(t + 1) * k], weights);
        }
        for &e in &self.topk_e[t * k..(t + 1) * k] {
            if !self.in_union[e as usize] {
                self.in_union[e as usize] = true;
                self.union.push(e);
                if self.announced + 1 == self.union.len()
                    && experts.announce(ExpertKey::new(self.layer, e as usize))
                {
                    self.announced += 1;
                }
            }
        }
    }

    /// Groups the (token, rank) pairs by union member (a counting sort: each member's
    /// pairs ascending).
    pub(super) fn finish(&mut self) {
        let n = self.rows * self.k;
        for &e in &self.union {
            self.counts[e as usize] = 0;
        }
        for &e in &self.topk_e[..n] {
            self.counts[e as usize] += 1;
        }
        self.seg_start.clear();
        let mut off = 0u32;
        for &e in &self.union {
            self.seg_start.push(off);
            let c = self.counts[e as usize];
            self.counts[e as usize] = off;
            off += c;
        }
        self.seg_start.push(off);
        for (i, &e) in self.topk_e[..n].iter().enumerate() {
            let cur = &mut self.counts[e as usize];
            self.pairs[*cur as usize] = i as u32;
            *cur += 1;
        }
    }
}
