//! The contract between the model definitions and the compute backends, and what a
//! forward pass offers the rest of the engine.
//!
//! A model family's layer loop ([`crate::model::qwen3_moe`]) is written once against
//! [`Backend`]; the CPU reference ([`crate::cpu`]) and Vulkan ([`crate::vulkan`]) implement
//! its operations and never import each other. The MoE step ([`crate::executor::moe`])
//! drives routing, claims and accounting once for every backend; a backend only computes
//! the claimed experts for their rows.
//!
//! Operations read and write *activation planes* ([`Plane`]): `rows × width` f32 arrays
//! each backend allocates once for its largest block of tokens and reuses, so the hot
//! path allocates nothing. Weights are named by their [`TensorRef`] in the vault.
//!
//! Operations may be recorded and run later (a GPU backend records a command buffer);
//! the *sync points* — [`Backend::route_input`], [`Backend::lm_head`] and
//! [`Backend::finish`] — return only once everything recorded before them has run.

use std::sync::Arc;

use smoe_proto::{
    ClaimEvent, ClaimTally, ExpertHandle, GateInput, HybridConfig, ModelConfig, RouteJob, VaultError,
    VramSnapshot,
};

use crate::model::Model;
use crate::profile::{Phase, PhaseProfile, Regime};
use crate::vault::TensorRef;

/// An activation plane: one row per token of the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Plane {
    /// The residual stream (`hidden_size` wide).
    X,
    /// A normalised copy of the residual stream (`hidden_size`).
    Xn,
    /// Queries (`heads · head_dim`).
    Q,
    /// Keys of the block (`kv_heads · head_dim`).
    K,
    /// Values of the block (`kv_heads · head_dim`).
    V,
    /// Attention output before the output projection (`heads · head_dim`).
    Attn,
    /// A dense feed-forward block's (or the shared expert's) gated intermediate.
    Hidden,
    /// The attention output gate (`heads · head_dim`; hybrid models).
    Gate,
    /// A DeltaNet layer's input projection, `[q | k | v | z | b | a]`; the convolution
    /// turns its `q | k | v` channels into the delta rule's inputs in place.
    Lin,
    /// A DeltaNet layer's output before its output projection (`value heads · value dim`).
    Core,
    /// The shared expert's output (`hidden_size`).
    Shared,
    /// The shared expert's gate logit (one per row).
    SharedGate,
}

impl Plane {
    /// Every plane, in declaration order (`p as usize` indexes it).
    pub const ALL: [Plane; 12] = [
        Plane::X,
        Plane::Xn,
        Plane::Q,
        Plane::K,
        Plane::V,
        Plane::Attn,
        Plane::Hidden,
        Plane::Gate,
        Plane::Lin,
        Plane::Core,
        Plane::Shared,
        Plane::SharedGate,
    ];

    /// Floats per row of the plane for model `c` (0 for planes the model never uses).
    pub fn width(self, c: &ModelConfig) -> usize {
        let hy = c.hybrid.as_ref();
        match self {
            Plane::X | Plane::Xn => c.hidden_size,
            Plane::Q | Plane::Attn => c.q_dim(),
            Plane::K | Plane::V => c.kv_dim(),
            Plane::Hidden => c.intermediate_size.max(hy.map_or(0, |h| h.shared_expert_intermediate_size)),
            Plane::Gate => hy.map_or(0, |_| c.q_dim()),
            Plane::Lin => hy.map_or(0, HybridConfig::in_proj_dim),
            Plane::Core => hy.map_or(0, HybridConfig::value_dim),
            Plane::Shared => hy.map_or(0, |_| c.hidden_size),
            Plane::SharedGate => hy.map_or(0, |_| 1),
        }
    }
}

/// Whether an operation overwrites its output plane or adds to it (the residual add).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    /// `out = result`.
    Set,
    /// `out += result` (the result is computed in full first, then added).
    Add,
}

/// When a batch of experts handed to [`Backend::experts`] must run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flush {
    /// More batches of this layer follow: start this one now, overlapping later claims.
    Overlap,
    /// The last batch of the layer: it may wait for the next sync point.
    Last,
    /// Every batch handed over so far must have finished when the call returns (the
    /// caller drops their handles to free ring slots for later claims).
    Wait,
}

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
    /// A block of tokens the pass was not sized for.
    #[error("a block of {rows} tokens (this pass takes 1..={max})")]
    BlockSize {
        /// Tokens in the block.
        rows: usize,
        /// Largest block the pass takes.
        max: usize,
    },
}

/// A per-session cache: keys and values of the attention layers, and for hybrid models
/// the conv and recurrent states of the DeltaNet layers.
pub trait KvState: Send {
    /// Positions held.
    fn len(&self) -> usize;
    /// Whether no position is held.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Cuts the cache back to at most `len` positions and returns how many it holds
    /// then. Keys and values cut anywhere; a recurrent state cannot be cut back, so a
    /// cache holding one returns to the longest state it kept at or below `len` (or to
    /// nothing).
    fn truncate(&mut self, len: usize) -> usize;
    /// Positions [`KvState::truncate`]`(len)` would keep.
    fn reusable(&self, len: usize) -> usize {
        self.len().min(len)
    }
    /// Keeps the states at the current length as a point a later [`KvState::truncate`]
    /// can return to (called at the end of each prefill chunk). A cache keeps at most
    /// `state_snapshots` of them, the newest, at least
    /// [`crate::state_book::SNAPSHOT_SPACING`] positions apart
    /// ([`crate::state_book::StateBook`]); a cache that can be cut anywhere keeps none.
    fn snapshot(&mut self) {}
    /// Records that `n` more positions were filled by a forward pass.
    fn advance(&mut self, n: usize);
}

/// The operations a compute backend implements. Every batched operation (rows > 1) must
/// give each row exactly the bytes the single-row operation gives it (DESIGN.md §4).
pub trait Backend {
    /// The backend's per-session cache.
    type Kv: KvState;
    /// A new, empty cache for one session.
    fn new_kv(&self) -> Result<Self::Kv, ForwardError>;
    /// Writes the embedding rows of `tokens` to [`Plane::X`].
    fn embed(&mut self, embed: &TensorRef, tokens: &[u32]) -> Result<(), ForwardError>;
    /// RMSNorm of the first `rows` rows of `src` with weight `w` into `dst`.
    fn rmsnorm(&mut self, w: &TensorRef, src: Plane, dst: Plane, rows: usize) -> Result<(), ForwardError>;
    /// `dst (=|+=) W · src` for the first `rows` rows.
    fn project(
        &mut self,
        w: &TensorRef,
        src: Plane,
        dst: Plane,
        rows: usize,
        write: Write,
    ) -> Result<(), ForwardError>;
    /// `dst = W · src` for each (W, dst) of `group` and the first `rows` rows: projections
    /// of one input ([`crate::model::AttentionRefs::input_projections`]), which a backend
    /// may compute as one product; each plane gets [`Backend::project`]'s bytes.
    fn project_group(
        &mut self,
        group: &[(&TensorRef, Plane)],
        src: Plane,
        rows: usize,
    ) -> Result<(), ForwardError> {
        project_each(self, group, src, rows)
    }
    /// Per-head RMSNorm (`q_norm`, `k_norm`) and RoPE on [`Plane::Q`] and [`Plane::K`]
    /// for positions `start..start + rows`, and appends the block's keys and values to
    /// decoder layer `layer`'s cache.
    fn qk_norm_rope(
        &mut self,
        layer: usize,
        q_norm: &TensorRef,
        k_norm: &TensorRef,
        kv: &mut Self::Kv,
        start: usize,
        rows: usize,
    ) -> Result<(), ForwardError>;
    /// Causal attention of [`Plane::Q`] over layer `layer`'s cached positions
    /// `0..=start + t` for each row `t`, into [`Plane::Attn`].
    fn attention(
        &mut self,
        layer: usize,
        kv: &Self::Kv,
        start: usize,
        rows: usize,
    ) -> Result<(), ForwardError>;
    /// Causal depthwise convolution with taps `w` (`[channels, kernel]`) and SiLU over the
    /// `q | k | v` channels of [`Plane::Lin`], in place, row by row in order, rolling
    /// DeltaNet layer `layer`'s conv state in `kv`.
    fn conv1d(
        &mut self,
        layer: usize,
        w: &TensorRef,
        kv: &mut Self::Kv,
        rows: usize,
    ) -> Result<(), ForwardError>;
    /// The gated delta rule of DeltaNet layer `layer`, row by row in order, in the
    /// single-token step's own order: per value head, L2-normed query and key (the
    /// query scaled by `1/√key_dim`), `β = σ(b)`, `g = −exp(a_log)·softplus(a + dt_bias)`,
    /// the state decayed by `exp(g)`, corrected by `β·(v − Sᵀk)` along `k`, and read with
    /// the query into [`Plane::Core`].
    fn delta_rule(
        &mut self,
        layer: usize,
        a_log: &TensorRef,
        dt_bias: &TensorRef,
        kv: &mut Self::Kv,
        rows: usize,
    ) -> Result<(), ForwardError>;
    /// RMSNorm of each value head of [`Plane::Core`] with weight `w`, times `silu(z)` (the
    /// `z` channels of [`Plane::Lin`]), in place.
    fn gated_rmsnorm(&mut self, w: &TensorRef, rows: usize) -> Result<(), ForwardError>;
    /// `dst ⊙= σ(gate)` element by element (the attention output gate).
    fn sigmoid_mul(&mut self, dst: Plane, gate: Plane, rows: usize) -> Result<(), ForwardError>;
    /// `X += σ(gate[t][0]) · src[t]` for each row `t` (the shared expert's gate).
    fn gated_add(&mut self, src: Plane, gate: Plane, rows: usize) -> Result<(), ForwardError>;
    /// `silu(gate · src) ⊙ (up · src)` into [`Plane::Hidden`].
    fn swiglu(
        &mut self,
        gate: &TensorRef,
        up: &TensorRef,
        src: Plane,
        rows: usize,
    ) -> Result<(), ForwardError>;
    /// Supplies the router's input for the MoE layer whose gate weight is `gate`:
    /// either the normalised rows of [`Plane::Xn`] moved into `job`'s hidden plane
    /// (the router computes the gate), or the gate logits computed here into `job`'s
    /// logits plane. A sync point: blobs handed to earlier [`Backend::experts`] calls are
    /// no longer read when it returns. Says which of the two it did.
    fn route_input(
        &mut self,
        gate: &TensorRef,
        rows: usize,
        job: &mut RouteJob,
    ) -> Result<GateInput, ForwardError>;
    /// Takes back what [`Backend::route_input`] moved into `job`, once `job` holds the
    /// plan, and prepares the layer's expert compute from it.
    fn route_output(&mut self, job: &mut RouteJob) -> Result<(), ForwardError>;
    /// How many claimed experts to hand to [`Backend::experts`] at once for a block of
    /// `rows` tokens (1: each as soon as it is claimed).
    fn expert_batch(&self, rows: usize) -> usize;
    /// Computes union members `first..first + blobs.len()` of `plan` (decoder layer
    /// `layer`) for the rows routed to them, from [`Plane::Xn`] into the per-pair expert
    /// outputs. Returns whether the blobs are no longer read (their handles may go).
    fn experts(
        &mut self,
        layer: usize,
        plan: &RouteJob,
        first: usize,
        blobs: &[ExpertHandle],
        flush: Flush,
    ) -> Result<bool, ForwardError>;
    /// Adds each row's expert outputs, weighted in rank order, to [`Plane::X`].
    fn combine(&mut self, plan: &RouteJob, rows: usize) -> Result<(), ForwardError>;
    /// Final RMSNorm of row `row` of [`Plane::X`] and the LM head into the logits
    /// ([`Backend::last_logits`]); a sync point.
    fn lm_head(&mut self, norm: &TensorRef, lm_head: &TensorRef, row: usize) -> Result<(), ForwardError>;
    /// The logits of the last [`Backend::lm_head`].
    fn last_logits(&self) -> &[f32];
    /// Runs everything recorded; a sync point.
    fn finish(&mut self) -> Result<(), ForwardError>;
    /// After a failure: discards what was recorded and waits for the work in flight, so
    /// every blob handed to [`Backend::experts`] may be released.
    fn abandon(&mut self);
    /// Called before every pass over `rows` tokens on `kv`'s session: its MoE steps are
    /// device-routed when `device_bets` is given (each ranking that many bets beyond
    /// top-k), and it ends with the LM head when `logits`. A backend may replay its
    /// recording of an identical earlier pass.
    fn begin_pass(
        &mut self,
        _kv: &Self::Kv,
        _rows: usize,
        _device_bets: Option<usize>,
        _logits: bool,
    ) -> Result<(), ForwardError> {
        Ok(())
    }
    /// Whether a one-token pass may run its MoE steps with [`Backend::route_on_device`]
    /// (the default: no).
    fn routes_on_device(&mut self) -> bool {
        false
    }
    /// Records the MoE step of decoder layer `layer` (router gate `gate`) for one token
    /// with no sync point: the gate, the ranking (top-k and `bets` more ranks) on the
    /// device, and the routed experts read where the device already holds them.
    /// Speculative: [`Backend::device_routes`] says after the pass whether it held.
    fn route_on_device(&mut self, layer: usize, _gate: &TensorRef, _bets: usize) -> Result<(), ForwardError> {
        Err(ForwardError::Device(format!("layer {layer}: this backend cannot route on its device")))
    }
    /// Before a device-routed pass over a cache with recurrent states (updated in place,
    /// so a void pass cannot simply run again): records a copy of `kv`'s states that
    /// [`Backend::restore_states`] puts back. The default keeps none (an error).
    fn keep_states(&mut self, _kv: &Self::Kv) -> Result<(), ForwardError> {
        Err(ForwardError::Device("this backend keeps no copy of recurrent states".into()))
    }
    /// After a void device-routed pass: records the copy of [`Backend::keep_states`] back
    /// into `kv`'s states, ahead of the pass that runs again.
    fn restore_states(&mut self, _kv: &Self::Kv) -> Result<(), ForwardError> {
        Err(ForwardError::Device("this backend keeps no copy of recurrent states".into()))
    }
    /// After the sync point ending a pass recorded with [`Backend::route_on_device`]:
    /// writes each such layer's ranked experts (top-k, then the bets) to `ranks[layer]`
    /// and says whether every routed expert was on the device. If one was not, nothing
    /// the pass computed is valid and it must run again host-routed; if all were, the
    /// backend has counted the reads.
    fn device_routes(&mut self, _ranks: &mut [Vec<u16>]) -> Result<bool, ForwardError> {
        Ok(false)
    }
    /// Profiling: the operations that follow belong to `phase` of a block in `regime`.
    /// A backend that times the device marks it there; the default does nothing.
    fn phase(&mut self, _regime: Regime, _phase: Phase) -> Result<(), ForwardError> {
        Ok(())
    }
    /// Turns device timing on or off; says whether this backend times the device.
    fn set_device_timing(&mut self, _on: bool) -> Result<bool, ForwardError> {
        Ok(false)
    }
    /// Adds the device times and host waits measured since the last call to `into`
    /// (everything recorded has run: called after a sync point).
    fn take_device_times(&mut self, _into: &mut PhaseProfile) {}
}

/// [`Backend::project_group`] as one [`Backend::project`] per member (the default, and a
/// backend's fallback where it cannot fuse the group).
pub fn project_each<B: Backend + ?Sized>(
    b: &mut B,
    group: &[(&TensorRef, Plane)],
    src: Plane,
    rows: usize,
) -> Result<(), ForwardError> {
    group.iter().try_for_each(|&(w, dst)| b.project(w, src, dst, rows, Write::Set))
}

/// What every backend's forward pass offers the generation loop and the scheduler: run
/// a block of tokens through all layers against a cache of its own kind, and report
/// the routing and claim accounting of what it ran.
pub trait ForwardPass: Send {
    /// The cache this pass runs against.
    type Kv: KvState;
    /// The model being run.
    fn model(&self) -> &Arc<Model>;
    /// Largest block of tokens one call accepts (the prefill chunk size).
    fn max_rows(&self) -> usize;
    /// A new, empty cache for one session.
    fn new_kv(&self) -> Result<Self::Kv, ForwardError>;
    /// Runs `tokens` at positions `kv.len()..`; returns the last token's logits when asked.
    fn forward(
        &mut self,
        kv: &mut Self::Kv,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, ForwardError>;
    /// Runs `tokens` like [`ForwardPass::forward`] and returns only the last token's
    /// greedy choice, [`crate::sampler::argmax`] of its logits, which a backend may find
    /// without handing the logits over (the Vulkan executor chooses on the device).
    fn forward_greedy(&mut self, kv: &mut Self::Kv, tokens: &[u32]) -> Result<u32, ForwardError> {
        let logits = self.forward(kv, tokens, true)?.unwrap_or(&[]);
        Ok(crate::sampler::argmax(logits) as u32)
    }
    /// Union size per decoder layer in the last call (0 for dense layers).
    fn last_union_sizes(&self) -> &[usize];
    /// Claim accounting since creation.
    fn tally(&self) -> ClaimTally;
    /// The VRAM tier's counters and slot states, where the backend has a tier and it is
    /// on.
    fn vram(&self) -> Option<VramSnapshot> {
        None
    }
    /// Speculative prefetch depth for single-token steps.
    fn set_spec_depth(&mut self, depth: usize);
    /// Starts recording expert claims.
    fn enable_trace(&mut self);
    /// The claims recorded since the last call.
    fn take_trace(&mut self) -> Vec<ClaimEvent>;
    /// Starts (or stops) the phase profile ([`crate::profile`]); starting clears it.
    fn set_profiling(&mut self, on: bool) -> Result<(), ForwardError>;
    /// The phase profile since profiling started (`None` when it is off).
    fn profile(&mut self) -> Option<PhaseProfile>;
}
