//! A routing job: the message the executor hands the router for one MoE layer of one
//! block of tokens, and the plan the router hands back in the same buffers. Plain data:
//! the side effects it leads to (announcing, claiming, withdrawing, betting) belong to
//! the stages, not to the message.
//!
//! A job is sized once for the largest block and moved between the executor and the
//! router thread by pointer: routing a layer neither copies the activation plane nor
//! allocates.

/// Where a job's gate logits come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateInput {
    /// The router computes them from the block's normalised hidden rows
    /// ([`RouteJob::hidden_mut`]) with the layer's gate weight.
    Hidden,
    /// The executor ranked the experts on its device and wrote each token's ranks and
    /// top-k weights ([`RouteJob::ranks_mut`]): the router only forms the union.
    Ranked,
}

/// One layer's routing for a block of tokens: the request (layer, rows, bet depth, and
/// the gate input) and, once routed, the plan (top-k per token, the union in first-use order
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
    /// A job for blocks of up to `max_rows` tokens of a model with `hidden` hidden size,
    /// `experts` experts, top-`k`, and whether the top-k weights are renormalised.
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
            input: GateInput::Hidden,
            hidden: Vec::new(),
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

    /// Sets the request: route `rows` tokens of decoder layer `layer` (the executor then
    /// supplies the input and says which with [`RouteJob::set_input`]). For a single token, `bets` more experts beyond top-k are ranked as speculative
    /// prefetches for the next token (read back by [`RouteJob::bets`]; 0 disables; ignored
    /// for blocks).
    pub fn request(&mut self, layer: usize, rows: usize, bets: usize) {
        assert!(rows > 0 && rows * self.k <= self.topk_e.len(), "routing {rows} rows exceeds the job's size");
        self.layer = layer;
        self.rows = rows;
        self.bets = if rows == 1 { bets.min(self.ranked.len() - self.k) } else { 0 };
    }

    /// Says where the gate logits of the request come from, once the executor has
    /// supplied them.
    pub fn set_input(&mut self, input: GateInput) {
        self.input = input;
    }

    /// Experts ranked per token: top-k, plus the bets of a single token.
    pub fn ranks(&self) -> usize {
        self.k + self.bets
    }

    /// What the executor fills for [`GateInput::Ranked`]: token `t`'s ranked experts
    /// ([`RouteJob::ranks`] of them: top-k, then the bets) and its top-k weights.
    pub fn ranks_mut(&mut self, t: usize) -> (&mut [u16], &mut [f32]) {
        rank_targets(self.k, self.bets, t, &mut self.ranked, &mut self.topk_e, &mut self.topk_w)
    }

    /// The hidden-row plane (`rows × hidden`) the router reads for [`GateInput::Hidden`].
    /// The job holds none of its own: the executor swaps its plane in and back out
    /// instead of copying.
    pub fn hidden_mut(&mut self) -> &mut Vec<f32> {
        &mut self.hidden
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

    /// Whether expert `e` is in the union.
    pub fn in_union(&self, e: u16) -> bool {
        self.in_union.get(e as usize).copied().unwrap_or(false)
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

    /// A single-token step's bets: its gate ranks k+1..k+N (empty for a block), to be
    /// queued as speculative prefetches for the next token once the layer's claims are
    /// done.
    pub fn bets(&self) -> &[u16] {
        &self.ranked[self.k..self.k + self.bets]
    }

    /// Decoder layer of the request.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// Tokens in the request.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Routed experts per token.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Whether the top-k weights are renormalised.
    pub fn norm_topk_prob(&self) -> bool {
        self.norm_topk_prob
    }

    /// Where the gate logits come from.
    pub fn input(&self) -> GateInput {
        self.input
    }

    /// Splits the job into the hidden rows (read) and the logits plane (written) for
    /// the block of tokens `t0..t1`.
    pub fn gate_planes(&mut self, t0: usize, t1: usize) -> (&[f32], &mut [f32]) {
        let (h, ne) = (self.h, self.in_union.len());
        (&self.hidden[t0 * h..t1 * h], &mut self.logits[t0 * ne..t1 * ne])
    }

    /// Forgets the previous plan (the router starts every job with it).
    pub fn begin(&mut self) {
        self.union.clear();
        self.in_union.fill(false);
        self.announced = 0;
    }

    /// What the router's ranking of token `t` fills: its logits (to be overwritten with
    /// probabilities), the ranked experts (top-k, then the bets) and the top-k weights.
    pub fn rank_slots(&mut self, t: usize) -> (&mut [f32], &mut [u16], &mut [f32]) {
        let ne = self.in_union.len();
        let logits = &mut self.logits[t * ne..(t + 1) * ne];
        let (ranked, weights) =
            rank_targets(self.k, self.bets, t, &mut self.ranked, &mut self.topk_e, &mut self.topk_w);
        (logits, ranked, weights)
    }

    /// Adds token `t`'s ranked experts to the union in rank order. `announce` is called
    /// for each expert the moment it first enters the union, while every earlier member
    /// was announced; it says whether the announcement was taken (announcing stops at
    /// the first refusal).
    pub fn admit(&mut self, t: usize, mut announce: impl FnMut(u16) -> bool) {
        let k = self.k;
        if self.bets > 0 {
            self.topk_e[t * k..(t + 1) * k].copy_from_slice(&self.ranked[..k]);
        }
        for &e in &self.topk_e[t * k..(t + 1) * k] {
            if !self.in_union[e as usize] {
                self.in_union[e as usize] = true;
                self.union.push(e);
                if self.announced + 1 == self.union.len() && announce(e) {
                    self.announced += 1;
                }
            }
        }
    }

    /// Groups the (token, rank) pairs by union member (a counting sort: each member's
    /// pairs ascending); the router ends every job with it.
    pub fn finish(&mut self) {
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

/// Token `t`'s ranked experts (the single-token ranking scratch when there are bets,
/// else its row of the top-k) and its top-k weights.
fn rank_targets<'a>(
    k: usize,
    bets: usize,
    t: usize,
    ranked: &'a mut [u16],
    topk_e: &'a mut [u16],
    topk_w: &'a mut [f32],
) -> (&'a mut [u16], &'a mut [f32]) {
    let weights = &mut topk_w[t * k..(t + 1) * k];
    let ranks = if bets > 0 { &mut ranked[..k + bets] } else { &mut topk_e[t * k..(t + 1) * k] };
    (ranks, weights)
}
