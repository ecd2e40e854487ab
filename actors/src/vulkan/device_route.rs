//! Decode steps routed on the device. A host-routed MoE step is a sync point: the host
//! waits for the router's logits, ranks the experts and writes the expert tables, once
//! per MoE layer and token. While the VRAM tier holds every expert, a one-token pass
//! instead records each MoE layer without one: the router gate, the ranking
//! (`route.comp` built with `TABLE`), which looks each routed expert up in a device copy
//! of the tier's slot table ([`VramTier::slot_words`]) and writes the expert table and
//! indirect dispatch sizes of each tier buffer, the expert kernels over those buffers,
//! and the combine: one submission per token.
//!
//! The step is speculative. After the pass the host reads each layer's ranking: if an
//! expert was not in the tier (not yet filled), nothing the pass computed counts and it
//! runs again host-routed, which fills the tier; else the tier counts the hits. The
//! ranking is the same kernel's as a host-routed block's (`route`) and the expert
//! kernels are the m=1 ones, so a device-routed step gives the same bytes as a
//! host-routed one. Where one tier buffer holds the layer's experts (the tier's home
//! slots give a layer whole buffers), the down projection adds the combine to the
//! residual itself ([`super::record::FLAG_COMBINE`]: the same bytes, one dependent
//! dispatch fewer per layer), and the gate/up is a direct dispatch over the table's k
//! entries: a step the host keeps has all k experts in that buffer, so the indirect size
//! would be k anyway, and the device need not wait for the ranking's write of it (on an
//! H100 the gate/up took 25.1 µs in situ dispatched indirectly, 22.1 directly).

use std::collections::BTreeMap;
use std::sync::Arc;

use smoe_proto::DType;
use vulkano::buffer::{BufferUsage, Subbuffer};
use vulkano::command_buffer::DispatchIndirectCommand;
use vulkano::descriptor_set::DescriptorSet;

use super::backend::VulkanBackend;
use super::buffers::{device_buffer, upload_buffer, verr};
use super::context::VulkanContext;
use super::pipelines::{Kernel, Kernels};
use super::record::{set0, MatmulArgs, Projection, FLAG_COMBINE};
use super::vram::VramTier;
use super::VulkanError;
use crate::contract::{ForwardError, Plane};
use crate::model::Model;
use crate::vault::TensorRef;

/// Most tier buffers of one size class a device-routed step reads (a class of more
/// buffers, over 64 · 2 GiB, turns device routing off).
pub const MAX_BUFFERS: usize = 64;

/// Routing-buffer words of a device-routed step the expert kernels read: the pair
/// list, the weights and the expert tables.
pub fn fast_route_words(k: usize) -> usize {
    2 * k + 3 * k * MAX_BUFFERS
}

/// The push constants of `route_table` (`shaders/route.comp` with `TABLE`): one token's
/// ranking, looked up in the tier's slot table, written as each tier buffer's routing words
/// and dispatch sizes.
#[derive(Clone, Copy, Debug, Default)]
pub struct RouteTableArgs {
    /// Experts.
    pub ne: u32,
    /// Experts per token.
    pub k: u32,
    /// Experts ranked (k, or k + bets).
    pub ranks: u32,
    /// Whether the top-k weights are renormalised.
    pub norm: bool,
    /// Activation offset of the token's gate logits.
    pub in_off: u32,
    /// Activation offset of the output row (ranks, top-k weights, misses).
    pub out_off: u32,
    /// Activation elements between tokens' output rows.
    pub out_stride: u32,
    /// Slot-table entry of the layer's first expert.
    pub slot_off: u32,
    /// Tier buffers that may hold the layer's experts.
    pub buffers: u32,
    /// Routing-buffer offset of the routing words.
    pub tab_out: u32,
    /// Workgroups (x) of one gate/up dispatch and of one down dispatch.
    pub groups: [u32; 2],
    /// Offset of the output row's copy in the host's readback buffer.
    pub io_out: u32,
}

impl RouteTableArgs {
    /// The push constants, in `route.comp`'s order.
    pub fn words(&self) -> [u32; 13] {
        [
            self.ne,
            self.k,
            self.ranks,
            self.norm as u32,
            self.in_off,
            self.out_off,
            self.out_stride,
            self.slot_off,
            self.buffers,
            self.tab_out,
            self.groups[0],
            self.groups[1],
            self.io_out,
        ]
    }
}

/// The device side of device-routed steps.
pub struct DeviceRoutes {
    /// The tier's slot table as the device reads it ([`VramTier::slot_words`]).
    slots: Subbuffer<[u32]>,
    /// `route_table`'s set 0 (the slot table, `sizes`, the host's readback buffer).
    set: Arc<DescriptorSet>,
    /// The tier version the slot table shows (`None`: never written).
    written: Option<u64>,
    /// Per tier buffer, the gate/up and down dispatch sizes of the current layer.
    sizes: Subbuffer<[DispatchIndirectCommand]>,
    /// (layer, ranks) of each step recorded in the current pass.
    layers: Vec<(usize, usize)>,
    /// Per (expert down-projection weight type, experts per token) met so far, its
    /// combining down kernel ([`Kernels::down_combine`]; `None`: too large a workgroup
    /// for the device).
    combine: BTreeMap<(DType, usize), Option<Kernel>>,
}

impl DeviceRoutes {
    /// The device side for `model` when `tier` holds every expert in buffers one
    /// binding can cover ([`VramTier::holds_all`]); `None` otherwise (steps are then
    /// host-routed). Each step's ranking goes to `io`, which the host reads.
    pub fn new(
        ctx: &Arc<VulkanContext>,
        kernels: &Kernels,
        model: &Model,
        tier: Option<&VramTier>,
        io: &Subbuffer<[f32]>,
    ) -> Result<Option<DeviceRoutes>, VulkanError> {
        let Some(tier) = tier else { return Ok(None) };
        if !tier.holds_all(ctx.info.max_storage_buffer_range, MAX_BUFFERS) {
            tracing::info!("decode steps are host-routed: the VRAM tier cannot hold every expert at once");
            return Ok(None);
        }
        let c = &model.cfg;
        let words = 2 * c.num_hidden_layers * c.num_experts;
        let slots = upload_buffer::<u32>(ctx, words as u64, BufferUsage::STORAGE_BUFFER)?;
        let sizes = device_buffer::<DispatchIndirectCommand>(
            ctx,
            2 * MAX_BUFFERS as u64,
            BufferUsage::INDIRECT_BUFFER | BufferUsage::STORAGE_BUFFER,
        )?;
        let set = set0(
            ctx,
            &kernels.route_table,
            &[slots.clone().into_bytes(), sizes.clone().into_bytes(), io.clone().into_bytes()],
        )?;
        Ok(Some(DeviceRoutes {
            slots,
            set,
            written: None,
            sizes,
            layers: Vec::new(),
            combine: BTreeMap::new(),
        }))
    }
}

impl DeviceRoutes {
    /// The pass was abandoned: the steps recorded in it are forgotten.
    pub fn abandon(&mut self) {
        self.layers.clear();
    }

    /// The combining down kernel for `k` experts whose down projections are `dtype`,
    /// built on first use.
    fn combine_kernel(
        &mut self,
        kernels: &Kernels,
        dtype: DType,
        k: usize,
    ) -> Result<Option<Kernel>, VulkanError> {
        if let Some(kd) = self.combine.get(&(dtype, k)) {
            return Ok(kd.clone());
        }
        let kd = kernels.down_combine(dtype, k)?;
        self.combine.insert((dtype, k), kd.clone());
        Ok(kd)
    }
}

impl VulkanBackend {
    /// Records decoder layer `l`'s MoE step for one token routed on the device (see
    /// the module): the gate (router weight `gate`), the ranking of top-k and `bets`
    /// more experts, the routing words and dispatch sizes, the expert kernels over each
    /// tier buffer of the layer, and the combine.
    pub(super) fn record_device_route(
        &mut self,
        l: usize,
        gate: &TensorRef,
        bets: usize,
    ) -> Result<(), ForwardError> {
        let model = self.model.clone();
        let c = &model.cfg;
        let (ne, k) = (c.num_experts, c.experts_per_token());
        let ranks = k + bets.min(ne - k);
        let layout = *model.vault.expert_layout(l).map_err(|e| ForwardError::Device(e.to_string()))?;
        let (Some(routes), Some(tier)) = (self.routes.as_mut(), self.ex.vram.as_ref()) else {
            return Err(ForwardError::Device("device routing is off".into()));
        };
        if routes.layers.is_empty() && routes.written != Some(tier.version()) {
            // No work is in flight at a pass's start: the slot table may be rewritten.
            let mut w = routes.slots.write().map_err(verr("writing the VRAM slot table"))?;
            tier.slot_words(&mut w);
            routes.written = Some(tier.version());
        }
        routes.layers.push((l, ranks));
        if self.replays.replaying() {
            // A kept recording runs instead: only the host's side of the step is needed.
            return Ok(());
        }
        let buffers: Vec<Subbuffer<[u8]>> = tier.layer_buffers(l).to_vec();
        let (nb, set, sizes) = (buffers.len(), routes.set.clone(), routes.sizes.clone());
        let kernels = self.kernels.clone();
        // One buffer holds the layer's experts: its down projection can combine them.
        let fused = if nb == 1 { routes.combine_kernel(&kernels, layout.down.dtype, k)? } else { None };
        let (g0, d0) = self.expert_args(&layout);
        let groups = |p: Projection, dtype, a: &MatmulArgs| -> Result<u32, VulkanError> {
            Ok(a.rows.div_ceil(p.kernel(kernels.typed(dtype)?, false, a.rows).rows_per_wg()))
        };
        let (gu_groups, down_groups) = (
            groups(Projection::GateUp, layout.gate.dtype, &g0)?,
            groups(Projection::Down, layout.down.dtype, &d0)?,
        );
        self.record_gate(gate, 1)?;
        let a = self.a;
        let out = a.routed + l as u32 * a.routed_stride;
        let fast_off = self.ex.fast_off;
        let io_at = self.io_routed + l * a.routed_stride as usize;
        let args = RouteTableArgs {
            ne: ne as u32,
            k: k as u32,
            ranks: ranks as u32,
            norm: c.norm_topk_prob,
            in_off: a.router,
            out_off: out,
            out_stride: a.routed_stride,
            slot_off: (l * ne) as u32,
            buffers: nb as u32,
            tab_out: fast_off as u32,
            groups: [gu_groups, down_groups],
            io_out: io_at as u32,
        };
        self.rec()?.dispatch(&kernels.route_table, Some(set), args.words(), [1, 1, 1])?;
        for (b, buf) in buffers.iter().enumerate() {
            let (down, gu) = self.window_sets(buf, 0, self.ctx.info.max_storage_buffer_range)?;
            let tab_off = (fast_off + 2 * k + 3 * k * b) as u32;
            let (g, d) = (
                MatmulArgs { map_off: fast_off as u32, tab_off, ..g0 },
                MatmulArgs { map_off: fast_off as u32, tab_off, ..d0 },
            );
            let rec = self.rec()?;
            match &fused {
                Some(kd) => {
                    // Entries of experts a void step lacks have no pairs: no work.
                    rec.matmul(
                        Projection::GateUp,
                        layout.gate.dtype,
                        false,
                        gu,
                        MatmulArgs { groups: k as u32, ..g },
                    )?;
                    let flags = d.flags | FLAG_COMBINE;
                    let (out_off, wt_off) = (a.at(Plane::X), (fast_off + k) as u32);
                    rec.down_combine(kd, down, MatmulArgs { flags, out_off, wt_off, ..d })?
                }
                None => {
                    let at = 2 * b as u64;
                    let sizes = |i: u64| sizes.clone().slice(at + i..at + i + 1);
                    rec.matmul_indirect(Projection::GateUp, layout.gate.dtype, gu, g, sizes(0))?;
                    rec.matmul_indirect(Projection::Down, layout.down.dtype, down, d, sizes(1))?;
                }
            }
        }
        if fused.is_none() {
            self.record_combine(1, (fast_off + k) as u32)?;
        }
        Ok(())
    }

    /// After the sync point ending a pass of device-routed steps: each step's ranking
    /// into `ranks[layer]`, and whether every routed expert was in the tier (then the
    /// tier counts the hits; else the pass is void).
    pub(super) fn read_device_routes(&mut self, ranks: &mut [Vec<u16>]) -> Result<bool, ForwardError> {
        let ne = self.model.cfg.num_experts;
        let k = self.model.cfg.experts_per_token();
        let Some(routes) = self.routes.as_mut() else { return Ok(false) };
        let layers = std::mem::take(&mut routes.layers);
        let io = self.io.read().map_err(verr("reading the device routing"))?;
        let row = self.a.routed_stride as usize;
        let mut held = true;
        for &(l, n) in &layers {
            let r = &io[self.io_routed + l * row..self.io_routed + (l + 1) * row];
            held &= r[ne + k].to_bits() == 0;
            let ids = &mut ranks[l];
            ids.clear();
            for &e in &r[..n] {
                let e = e.to_bits();
                if e as usize >= ne {
                    return Err(ForwardError::Device(format!(
                        "layer {l}: the router ranked no expert (its gate logits are not numbers)"
                    )));
                }
                ids.push(e as u16);
            }
        }
        drop(io);
        if held {
            if let Some(tier) = self.ex.vram.as_mut() {
                for &(l, _) in &layers {
                    tier.touch(l, &ranks[l][..k]);
                }
                tier.publish();
            }
        }
        Ok(held)
    }
}
