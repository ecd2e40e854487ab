//! A forward pass on one backend: the model definition run over that backend's
//! operations, with the MoE step's state, for blocks of up to `max_rows` tokens.

use std::sync::Arc;
use std::time::Instant;

use smoe_proto::{ClaimEvent, ClaimTally, ExpertSource};

use super::moe::MoeStep;
use super::profile::Profiled;
use crate::contract::{Backend, ForwardError, ForwardPass, KvState};
use crate::engine::Engine;
use crate::model::{self, Model};
use crate::profile::{PhaseProfile, Regime};

/// The model definition over backend `B`.
pub struct Pass<B: Backend> {
    backend: B,
    moe: MoeStep,
    model: Arc<Model>,
    max_rows: usize,
    /// The phase profile, while profiling.
    profile: Option<PhaseProfile>,
}

impl<B: Backend> Pass<B> {
    /// A pass over `backend` (sized for `max_rows` tokens) taking experts from
    /// `experts`, which hands out at most `hold_limits[layer]` blobs of a layer at once.
    pub fn new(
        backend: B,
        model: Arc<Model>,
        experts: Arc<dyn ExpertSource>,
        max_rows: usize,
        hold_limits: Vec<usize>,
    ) -> Self {
        let max_rows = max_rows.max(1);
        let moe = MoeStep::new(&model, experts, max_rows, hold_limits);
        Pass { backend, moe, model, max_rows, profile: None }
    }

    /// A pass over `backend` (sized for `max_rows` tokens) on `engine`'s model and ring,
    /// holding at most the ring's per-layer slots at once and reading ahead as the
    /// engine says.
    pub fn for_engine(backend: B, engine: &Engine, max_rows: usize) -> Self {
        let (model, ring) = (engine.model.clone(), engine.ring.clone());
        let mut pass = Pass::new(backend, model, ring, max_rows, engine.ring.layer_slots());
        pass.moe.set_lookahead(engine.lookahead);
        pass
    }

    /// A new, empty cache for one session on this pass's backend.
    pub fn new_kv(&self) -> Result<B::Kv, ForwardError> {
        self.backend.new_kv()
    }

    /// The backend, for backend-specific settings.
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// The MoE step's state (accounting, trace, bets).
    pub fn moe(&self) -> &MoeStep {
        &self.moe
    }

    /// The MoE step's state, to change its settings.
    pub fn moe_mut(&mut self) -> &mut MoeStep {
        &mut self.moe
    }

    /// Runs `tokens` at positions `kv.len()..` after checking them against the model
    /// and this pass's size; returns the last token's logits when asked.
    pub fn run(
        &mut self,
        kv: &mut B::Kv,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, ForwardError> {
        self.model.check_block(kv.len(), tokens, self.max_rows)?;
        let Some(profile) = self.profile.as_mut() else {
            return model::forward(&mut self.backend, &mut self.moe, &self.model, kv, tokens, want_logits);
        };
        let t = Instant::now();
        let mut timed = Profiled::new(&mut self.backend, profile, tokens.len());
        let run = model::forward(&mut timed, &mut self.moe, &self.model, kv, tokens, want_logits)
            .map(|l| l.is_some());
        self.backend.take_device_times(profile);
        let r = profile.regime_mut(Regime::of(tokens.len()));
        r.wall += t.elapsed();
        r.blocks += 1;
        r.tokens += tokens.len() as u64;
        Ok(run?.then(|| self.backend.last_logits()))
    }

    /// Starts (clearing it) or stops the phase profile, with device timing where the
    /// backend has it.
    pub fn set_profiling(&mut self, on: bool) -> Result<(), ForwardError> {
        let device_timed = self.backend.set_device_timing(on)?;
        self.profile = on.then(|| PhaseProfile { device_timed, ..Default::default() });
        Ok(())
    }

    /// The phase profile since profiling started (`None` when it is off).
    pub fn profile(&self) -> Option<PhaseProfile> {
        self.profile.clone()
    }
}

impl<B: Backend + Send> ForwardPass for Pass<B> {
    type Kv = B::Kv;
    fn model(&self) -> &Arc<Model> {
        &self.model
    }
    fn max_rows(&self) -> usize {
        self.max_rows
    }
    fn new_kv(&self) -> Result<B::Kv, ForwardError> {
        Pass::new_kv(self)
    }
    fn forward(
        &mut self,
        kv: &mut B::Kv,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, ForwardError> {
        self.run(kv, tokens, want_logits)
    }
    fn last_union_sizes(&self) -> &[usize] {
        self.moe.union_sizes()
    }
    fn tally(&self) -> ClaimTally {
        self.moe.tally()
    }
    fn set_spec_depth(&mut self, depth: usize) {
        self.moe.set_spec_depth(depth)
    }
    fn enable_trace(&mut self) {
        self.moe.enable_trace()
    }
    fn take_trace(&mut self) -> Vec<ClaimEvent> {
        self.moe.take_trace()
    }
    fn set_profiling(&mut self, on: bool) -> Result<(), ForwardError> {
        Pass::set_profiling(self, on)
    }
    fn profile(&mut self) -> Option<PhaseProfile> {
        Pass::profile(self)
    }
}
