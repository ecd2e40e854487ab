//! Lookahead for layer-major prefill: while a block's MoE layer computes, the next MoE
//! layer cannot be routed yet (its input does not exist), so the disk would idle between
//! the two layers' reads. Once a block's layer is routed and its whole union announced,
//! this reads up to `depth` experts of the next MoE layer into slots no claim needs
//! (speculative reads, queued behind every demand read). When that layer is routed, the
//! reads it chose are claimed like any retained expert and the others are withdrawn
//! (dropped unread when they have not started).
//!
//! Which experts: those the next layer routed the most (token, rank) pairs to on this
//! pass so far (its earlier blocks and steps), ties and unseen experts in id order. With
//! no history that is the whole layer in id order, which for a prefill block of hundreds
//! of tokens (whose union is nearly every expert of the layer) is nearly all right; after
//! it, the most frequent experts are the ones the next block most likely unions again.
//!
//! Single-token steps do not look ahead (their unions are top-k, which a frequency
//! cannot predict; decode has `spec_depth` bets for that), nor does a layer whose union
//! did not fit in the ring (no slot is idle).

use std::sync::Arc;

use smoe_proto::{ExpertKey, ExpertSource, Lookahead as Outcome, RouteJob};

use crate::model::Model;

/// The lookahead state of one MoE step.
pub struct Lookahead {
    /// Experts read ahead per layer (0: off).
    depth: usize,
    n_experts: usize,
    /// Per decoder layer, the next MoE layer (`None` after the last one).
    next_moe: Vec<Option<usize>>,
    /// Per (layer, expert), the (token, rank) pairs routed to it so far.
    freq: Vec<u64>,
    /// Scratch: experts in prediction order.
    order: Vec<u16>,
    /// The layer the reads in `pending` were issued for, until it is routed.
    pending_layer: usize,
    pending: Vec<u16>,
}

impl Lookahead {
    /// Off, for `model`'s layers.
    pub fn new(model: &Arc<Model>) -> Self {
        let c = &model.cfg;
        let layers = c.num_hidden_layers;
        let next_moe = (0..layers).map(|l| (l + 1..layers).find(|&n| c.is_moe_layer(n))).collect();
        Lookahead {
            depth: 0,
            n_experts: c.num_experts,
            next_moe,
            freq: vec![0; layers * c.num_experts],
            order: Vec::with_capacity(c.num_experts),
            pending_layer: 0,
            pending: Vec::with_capacity(c.num_experts),
        }
    }

    /// Sets the experts read ahead per layer (0 turns lookahead off).
    pub fn set_depth(&mut self, depth: usize) {
        self.depth = depth;
    }

    /// Called once `job` (a block of `m` tokens) is routed and announced: counts its
    /// routing, withdraws the reads made ahead for its layer that it did not choose,
    /// then reads ahead for the next MoE layer.
    pub fn routed(&mut self, experts: &dyn ExpertSource, job: &RouteJob, m: usize) {
        let l = job.layer();
        let freq = &mut self.freq[l * self.n_experts..(l + 1) * self.n_experts];
        for &e in job.topk_experts() {
            freq[e as usize] += 1;
        }
        if self.pending_layer == l {
            for &e in self.pending.iter().filter(|&&e| !job.in_union(e)) {
                experts.withdraw_lookahead(ExpertKey::new(l, e as usize));
            }
            self.pending.clear();
        } else {
            self.withdraw(experts);
        }
        let Some(next) = self.next_moe[l] else { return };
        if self.depth == 0 || m < 2 || job.announced() < job.union().len() {
            return;
        }
        let freq = &self.freq[next * self.n_experts..(next + 1) * self.n_experts];
        self.order.clear();
        self.order.extend(0..self.n_experts as u16);
        self.order.sort_unstable_by(|&a, &b| freq[b as usize].cmp(&freq[a as usize]).then(a.cmp(&b)));
        self.pending_layer = next;
        for &e in &self.order {
            if self.pending.len() == self.depth {
                break;
            }
            match experts.lookahead(ExpertKey::new(next, e as usize)) {
                Outcome::Queued => self.pending.push(e),
                Outcome::Resident => {}
                Outcome::Refused => break,
            }
        }
    }

    /// Withdraws every read made ahead for a layer not routed yet (the pass ended or
    /// failed before it).
    pub fn withdraw(&mut self, experts: &dyn ExpertSource) {
        for &e in &self.pending {
            experts.withdraw_lookahead(ExpertKey::new(self.pending_layer, e as usize));
        }
        self.pending.clear();
    }
}
