//! The hybrid family's layers on the device: the DeltaNet kernels (causal conv1d with
//! SiLU, the gated delta rule and its row-wise batched sibling, the gated RMSNorm) and the
//! sigmoid gates (attention output gate, shared expert gate); and a session's conv and
//! recurrent states in device memory with their snapshots, copied as its
//! [`crate::state_book::StateBook`] says on the executor thread before the session's
//! next block.

use std::sync::{Arc, Mutex};

use smoe_proto::HybridConfig;
use vulkano::buffer::{BufferUsage, Subbuffer};
use vulkano::descriptor_set::layout::DescriptorSetLayout;
use vulkano::descriptor_set::DescriptorSet;
use vulkano::device::Device;

use super::backend::VulkanBackend;
use super::buffers::{device_buffer, verr};
use super::context::VulkanContext;
use super::kv::VulkanKvCache;
use super::pipelines::{kernel, Kernel};
use super::record::{set0, Recorder};
use super::VulkanError;
use crate::contract::{ForwardError, Plane};
use crate::model::MixerRefs;
use crate::state_book::StateOp;

/// Widest key head the delta-rule kernels take (`MAX_DK` in `shaders/delta_rule.comp`).
pub const MAX_KEY_DIM: usize = 256;

/// Value columns one delta-rule workgroup covers (`COLS` in `shaders/delta_rule.comp`).
const DELTA_COLS: u32 = 64;

/// Floats each layer's state region is aligned to (256 bytes: any device's storage
/// buffer offset alignment).
const STATE_ALIGN: usize = 64;

/// The kernels of the hybrid layers.
pub struct DeltaKernels {
    /// Causal depthwise conv1d + SiLU, rolling the conv state.
    pub conv1d: Kernel,
    /// One row of the gated delta rule (the decode step).
    pub delta_rule: Kernel,
    /// The block's rows of the gated delta rule in order, each as `delta_rule` runs it.
    pub delta_rule_batched: Kernel,
    /// Per-head RMSNorm times `silu(z)`.
    pub gated_rmsnorm: Kernel,
    /// `dst ⊙= σ(gate)`.
    pub sigmoid_mul: Kernel,
    /// `x += σ(gate) · src`.
    pub gated_add: Kernel,
}

impl DeltaKernels {
    /// Builds the pipelines on `device` with the activation set layout `act`.
    pub(super) fn new(device: &Arc<Device>, act: &Arc<DescriptorSetLayout>) -> Result<Self, VulkanError> {
        let k = |name: &str| kernel(device, act, name, None);
        Ok(DeltaKernels {
            conv1d: k("conv1d")?,
            delta_rule: k("delta_rule")?,
            delta_rule_batched: k("delta_rule_batched")?,
            gated_rmsnorm: k("gated_rmsnorm")?,
            sigmoid_mul: k("sigmoid_mul")?,
            gated_add: k("gated_add")?,
        })
    }
}

/// Push constants of the delta-rule kernels (see `shaders/delta_rule.comp`).
#[derive(Clone, Copy, Debug, Default)]
pub struct DeltaArgs {
    /// Key heads.
    pub k_heads: u32,
    /// Value heads (a multiple of the key heads).
    pub v_heads: u32,
    /// Key head dim (at most [`MAX_KEY_DIM`]).
    pub k_dim: u32,
    /// Value head dim.
    pub v_dim: u32,
    /// Activation offset of row 0's `[q | k | v | z | b | a]`.
    pub lin_off: u32,
    /// Activation elements between rows of the input.
    pub lin_stride: u32,
    /// Activation offset of row 0's output (rows of `v_heads · v_dim`).
    pub core_off: u32,
    /// Offset of the layer's recurrent state in the bound state buffer.
    pub state_off: u32,
    /// Rows.
    pub rows: u32,
}

impl DeltaArgs {
    /// The shape of `hy`'s delta rule, reading and writing the planes of `b`'s arena.
    fn new(b: &VulkanBackend, hy: &HybridConfig, state_off: u32, rows: usize) -> Self {
        let a = b.a;
        DeltaArgs {
            k_heads: hy.linear_num_key_heads as u32,
            v_heads: hy.linear_num_value_heads as u32,
            k_dim: hy.linear_key_head_dim as u32,
            v_dim: hy.linear_value_head_dim as u32,
            lin_off: a.at(Plane::Lin),
            lin_stride: a.width(Plane::Lin),
            core_off: a.at(Plane::Core),
            state_off,
            rows: rows as u32,
        }
    }

    /// `rows` rows of shape `[k_heads, v_heads, k_dim, v_dim]` packed `lin_stride` apart
    /// from activation offset 0, their outputs at `core_off`, the state at offset 0 of its
    /// buffer (kernel tests, benches).
    pub fn packed(shape: [usize; 4], lin_stride: usize, core_off: usize, rows: usize) -> Self {
        let [k_heads, v_heads, k_dim, v_dim] = shape.map(|d| d as u32);
        DeltaArgs {
            k_heads,
            v_heads,
            k_dim,
            v_dim,
            lin_off: 0,
            lin_stride: lin_stride as u32,
            core_off: core_off as u32,
            state_off: 0,
            rows: rows as u32,
        }
    }

    /// Records the delta rule over `self.rows` rows with `set` (A_log, dt_bias, states):
    /// the batched kernel (`batched`, rows in order) or the single-row step.
    pub fn record(
        &self,
        rec: &mut Recorder,
        k: &DeltaKernels,
        set: Arc<DescriptorSet>,
        batched: bool,
    ) -> Result<(), VulkanError> {
        let q_scale = 1.0 / (self.k_dim as f32).sqrt();
        let push = [
            self.k_heads,
            self.v_heads,
            self.k_dim,
            self.v_dim,
            self.lin_off,
            self.lin_stride,
            self.core_off,
            self.state_off,
            self.rows,
            q_scale.to_bits(),
        ];
        let groups = [self.v_heads * self.v_dim.div_ceil(DELTA_COLS), 1, 1];
        let kernel = if batched { &k.delta_rule_batched } else { &k.delta_rule };
        rec.dispatch(kernel, Some(set), push, groups)
    }
}

/// The descriptor set of the delta-rule kernels binding `a_log`, `dt_bias` and `states`.
pub fn delta_set(
    ctx: &VulkanContext,
    k: &DeltaKernels,
    a_log: &Subbuffer<[u8]>,
    dt_bias: &Subbuffer<[u8]>,
    states: &Subbuffer<[f32]>,
) -> Result<Arc<DescriptorSet>, VulkanError> {
    set0(ctx, &k.delta_rule, &[a_log.clone(), dt_bias.clone(), states.clone().reinterpret::<[u8]>()])
}

/// One DeltaNet layer's states in a session's state buffer, and the sets binding them.
pub(crate) struct DeltaLayer {
    /// Set of the conv kernel (taps, the layer's state region).
    conv: Arc<DescriptorSet>,
    /// Set of the delta-rule kernels (A_log, dt_bias, the layer's state region).
    delta: Arc<DescriptorSet>,
    /// Offset of the recurrent state in the region (the conv state is at 0).
    rec_off: u32,
}

/// A session's DeltaNet states on the device: every layer's conv then recurrent state in
/// one buffer (each layer's region 256-byte aligned, so a set binds it alone), and up to
/// `state_snapshots` copies of that buffer, allocated when first used, and where decode
/// steps route on the device one more, allocated with the session, that such a step
/// keeps to start again from. Shared by the clones of a cache.
pub(crate) struct DeltaStates {
    live: Subbuffer<[f32]>,
    slots: Mutex<Vec<Option<Subbuffer<[f32]>>>>,
    kept: Option<Subbuffer<[f32]>>,
    layers: Vec<Option<DeltaLayer>>,
}

impl DeltaStates {
    /// DeltaNet layer `layer`'s states.
    fn layer(&self, layer: usize) -> Result<&DeltaLayer, ForwardError> {
        self.layers.get(layer).and_then(Option::as_ref).ok_or_else(|| {
            ForwardError::Device(format!("layer {layer} has no DeltaNet state (it is not a DeltaNet layer)"))
        })
    }

    /// Bytes of device memory the states take, and each snapshot.
    pub fn bytes(&self) -> u64 {
        self.live.size()
    }

    /// Records a copy of the live states into the kept one (`keep`) or back (`!keep`).
    fn record_kept(&self, rec: &mut Recorder, keep: bool) -> Result<(), VulkanError> {
        let Some(kept) = self.kept.clone() else {
            return Err(VulkanError::Vulkan("this session keeps no copy of its DeltaNet states".into()));
        };
        match keep {
            true => rec.copy(self.live.clone(), kept),
            false => rec.copy(kept, self.live.clone()),
        }
    }

    /// Records `ops` in order into `rec`.
    fn record(&self, ctx: &VulkanContext, rec: &mut Recorder, ops: &[StateOp]) -> Result<(), VulkanError> {
        let mut slots =
            self.slots.lock().map_err(|_| VulkanError::Vulkan("a state lock was poisoned".into()))?;
        for &op in ops {
            match op {
                StateOp::Zero => {
                    rec.cb
                        .fill_buffer(self.live.clone().reinterpret::<[u32]>(), 0)
                        .map_err(verr("recording a state reset"))?;
                }
                StateOp::Save(i) => {
                    if slots[i].is_none() {
                        slots[i] = Some(device_buffer::<f32>(ctx, self.live.len(), BufferUsage::empty())?);
                    }
                    let slot = slots[i].clone().expect("just allocated");
                    rec.copy(self.live.clone(), slot)?;
                }
                StateOp::Load(i) => {
                    let slot = slots[i].clone().ok_or_else(|| {
                        VulkanError::Vulkan(format!("restoring state snapshot {i}, which was never taken"))
                    })?;
                    rec.copy(slot, self.live.clone())?;
                }
            }
        }
        Ok(())
    }
}

impl VulkanBackend {
    /// A new session's DeltaNet states (`None` for a model without DeltaNet layers).
    pub(super) fn new_delta_states(&self) -> Result<Option<Arc<DeltaStates>>, VulkanError> {
        let Some(hy) = self.model.cfg.hybrid.as_ref() else { return Ok(None) };
        let (conv, rec) = (hy.conv_state_len(), hy.recurrent_state_len());
        let region = (conv.next_multiple_of(STATE_ALIGN) + rec).next_multiple_of(STATE_ALIGN);
        let n = self.model.layers.iter().filter(|l| matches!(l.mixer, MixerRefs::DeltaNet(_))).count();
        if n == 0 {
            return Ok(None);
        }
        let live = device_buffer::<f32>(&self.ctx, (n * region) as u64, BufferUsage::STORAGE_BUFFER)?;
        let k = &self.kernels.delta;
        let mut layers = Vec::with_capacity(self.model.layers.len());
        let mut at = 0u64;
        for l in &self.model.layers {
            let MixerRefs::DeltaNet(dn) = &l.mixer else {
                layers.push(None);
                continue;
            };
            let own = live.clone().slice(at..at + region as u64);
            at += region as u64;
            let w = &self.weights;
            let taps = w.vector(&dn.conv)?.0.clone();
            let conv_set = set0(&self.ctx, &k.conv1d, &[taps, own.clone().reinterpret::<[u8]>()])?;
            let delta = delta_set(&self.ctx, k, &w.vector(&dn.a_log)?.0, &w.vector(&dn.dt_bias)?.0, &own)?;
            let rec_off = conv.next_multiple_of(STATE_ALIGN) as u32;
            layers.push(Some(DeltaLayer { conv: conv_set, delta, rec_off }));
        }
        let slots = Mutex::new(vec![None; self.model.state_snapshots]);
        // Allocated now, not at the first device-routed step: a device short of memory
        // says so when the session starts, not in the middle of a stream.
        let kept = match self.routes {
            Some(_) => Some(device_buffer::<f32>(&self.ctx, live.len(), BufferUsage::empty())?),
            None => None,
        };
        Ok(Some(Arc::new(DeltaStates { live, slots, kept, layers })))
    }

    /// [`crate::contract::Backend::keep_states`] (`keep`) and
    /// [`crate::contract::Backend::restore_states`] (`!keep`): one copy of every layer's
    /// states.
    pub(super) fn record_kept_states(&mut self, kv: &VulkanKvCache, keep: bool) -> Result<(), ForwardError> {
        let Some(states) = kv.states.clone() else { return Ok(()) };
        Ok(states.record_kept(self.rec()?, keep)?)
    }

    /// Records the state copies `kv` waits for, ahead of its next block.
    pub(super) fn record_state_ops(&mut self, kv: &VulkanKvCache) -> Result<(), ForwardError> {
        let Some(states) = kv.states.clone() else { return Ok(()) };
        if kv.book.ops().is_empty() {
            return Ok(());
        }
        let ctx = self.ctx.clone();
        Ok(states.record(&ctx, self.rec()?, kv.book.ops())?)
    }

    /// [`crate::contract::Backend::conv1d`]: one dispatch, invocation per channel, rows
    /// in order.
    pub(super) fn record_conv1d(
        &mut self,
        layer: usize,
        kv: &VulkanKvCache,
        rows: usize,
    ) -> Result<(), ForwardError> {
        let hy = self.model.hybrid()?;
        let (c, kernel) = (hy.conv_dim() as u32, hy.linear_conv_kernel_dim as u32);
        let set = states(kv)?.layer(layer)?.conv.clone();
        let a = self.a;
        let push = [c, kernel, a.at(Plane::Lin), a.width(Plane::Lin), 0, rows as u32];
        let k = self.kernels.delta.conv1d.clone();
        Ok(self.rec()?.dispatch(&k, Some(set), push, [c.div_ceil(256), 1, 1])?)
    }

    /// [`crate::contract::Backend::delta_rule`]: the step for one row, its batched
    /// sibling for more.
    pub(super) fn record_delta_rule(
        &mut self,
        layer: usize,
        kv: &VulkanKvCache,
        rows: usize,
    ) -> Result<(), ForwardError> {
        let hy = self.model.hybrid()?;
        let st = states(kv)?.layer(layer)?;
        let args = DeltaArgs::new(self, hy, st.rec_off, rows);
        let (set, kernels) = (st.delta.clone(), self.kernels.clone());
        Ok(args.record(self.rec()?, &kernels.delta, set, rows > 1)?)
    }

    /// [`crate::contract::Backend::gated_rmsnorm`]: workgroup per (value head, row).
    pub(super) fn record_gated_rmsnorm(
        &mut self,
        w: &crate::vault::TensorRef,
        rows: usize,
    ) -> Result<(), ForwardError> {
        let hy = self.model.hybrid()?;
        let set = self.weights.vector(w)?.1.clone();
        let (a, eps) = (self.a, self.model.cfg.rms_norm_eps);
        let (core, stride) = (a.at(Plane::Core), a.width(Plane::Core));
        let z_off = a.at(Plane::Lin) + hy.conv_dim() as u32;
        let push = [
            hy.linear_value_head_dim as u32,
            core,
            stride,
            core,
            stride,
            eps.to_bits(),
            z_off,
            a.width(Plane::Lin),
        ];
        let k = self.kernels.delta.gated_rmsnorm.clone();
        let groups = [hy.linear_num_value_heads as u32, rows as u32, 1];
        Ok(self.rec()?.dispatch(&k, Some(set), push, groups)?)
    }

    /// [`crate::contract::Backend::sigmoid_mul`] over the first `rows` rows.
    pub(super) fn record_sigmoid_mul(
        &mut self,
        dst: Plane,
        gate: Plane,
        rows: usize,
    ) -> Result<(), ForwardError> {
        let a = self.a;
        if a.width(dst) != a.width(gate) {
            return Err(ForwardError::Device(format!("sigmoid_mul of {dst:?} by {gate:?}: widths differ")));
        }
        let n = rows as u32 * a.width(dst);
        let k = self.kernels.delta.sigmoid_mul.clone();
        Ok(self.rec()?.dispatch(&k, None, [n, a.at(dst), a.at(gate)], [n.div_ceil(256), 1, 1])?)
    }

    /// [`crate::contract::Backend::gated_add`]: workgroup row per token.
    pub(super) fn record_gated_add(
        &mut self,
        src: Plane,
        gate: Plane,
        rows: usize,
    ) -> Result<(), ForwardError> {
        let a = self.a;
        let h = a.width(Plane::X);
        let push = [h, a.at(src), a.at(gate), a.width(gate), a.at(Plane::X)];
        let k = self.kernels.delta.gated_add.clone();
        Ok(self.rec()?.dispatch(&k, None, push, [h.div_ceil(256), rows as u32, 1])?)
    }
}

/// The DeltaNet states of `kv`.
fn states(kv: &VulkanKvCache) -> Result<&DeltaStates, ForwardError> {
    kv.states.as_deref().ok_or_else(|| ForwardError::Device("this cache holds no DeltaNet states".into()))
}
