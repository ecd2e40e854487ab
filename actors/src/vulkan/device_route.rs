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
//!
//! There, where the device can run a dispatch's workgroups all at once, the router, the
//! ranking and the gate/up are one dispatch ([`Kernels::gate_up_front`]): its
//! workgroups, one an SM, form the router's rows, meet at a grid barrier, each ranks the
//! token itself and then takes gate/up rows; the first writes the routing words and the
//! host's copy of the ranking. Each part is the bytes of the kernel it replaces (the
//! router's m=1 matvec, `route_table`'s ranking, the m=1 gate/up), so the step's bytes
//! do not change; three dependent dispatches a layer become one. Vulkan does not promise
//! that the workgroups run at once: one that waits too long at the barrier marks the
//! step, the host voids the pass as it does for a tier miss and runs it again
//! host-routed, and turns the fused front off.

use std::collections::{btree_map, hash_map, BTreeMap, HashMap};
use std::sync::Arc;

use smoe_proto::DType;
use vulkano::buffer::{BufferUsage, Subbuffer};
use vulkano::command_buffer::DispatchIndirectCommand;
use vulkano::descriptor_set::DescriptorSet;

use super::backend::VulkanBackend;
use super::buffers::{device_buffer, upload_buffer, upload_f32, verr, DeviceWeight};
use super::context::VulkanContext;
use super::experts::window;
use super::pipelines::{Kernel, Kernels};
use super::record::{set0, MatmulArgs, Projection, FLAG_COMBINE, FLAG_TABLE};
use super::vram::VramTier;
use super::VulkanError;
use crate::contract::{ForwardError, Plane};
use crate::model::Model;
use crate::vault::TensorRef;

/// Most tier buffers of one size class a device-routed step reads (a class of more
/// buffers, over 64 bindings' range, ~256 GiB on NVIDIA, turns device routing off).
pub const MAX_BUFFERS: usize = 64;

/// Most experts of a layer whose decode steps the fused front ranks (`MAX_E` of
/// `shaders/matmul.comp` with `FRONT`); layers with more use `route_table`.
const FRONT_MAX_E: usize = 512;

/// Most experts the fused front ranks (top-k and bets; `MAX_RANKS` there).
const FRONT_MAX_RANKS: usize = 64;

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

    /// The router's and the ranking's push constants of a fused front
    /// (`shaders/matmul_io.glsl` with `FRONT`), for the layer's one tier buffer.
    pub fn front_words(&self) -> [u32; 8] {
        [self.ne, self.k, self.ranks, self.norm as u32, self.in_off, self.slot_off, self.tab_out, self.io_out]
    }
}

/// An m=1 RMSNorm of the residual ([`Plane::X`]) into [`Plane::Xn`] held back from the
/// recording while the fused front is on ([`DeviceRoutes::folds_norms`]): a front that
/// reads Xn next forms it itself (`NORM_IN` in `shaders/matmul.comp`: the norm kernel's
/// bytes, and its dispatch and hand-off go); any other recording records it first
/// ([`VulkanBackend::rec`]).
pub struct HeldNorm {
    /// The norm's weights.
    pub vector: Subbuffer<[u8]>,
    /// Its set for the norm kernel.
    pub set: Arc<DescriptorSet>,
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
    /// Workgroups of a fused front (0: off).
    front_groups: u32,
    /// Per (expert gate/up weight type, router weight type, inputs of the norm it forms or
    /// 0) met so far, its fused front ([`Kernels::gate_up_front`]; `None`: a router type
    /// it does not read).
    front: BTreeMap<(DType, DType, usize), Option<Kernel>>,
    /// The fused front's set 0 per (tier buffer address, layer, norm weights' address or
    /// 0): the buffer as gate and up weights, the slot table, the host's readback buffer,
    /// the layer's router weight, the grid barrier's words, the norm's weights (the
    /// router's where it forms none: bound, never read).
    front_sets: HashMap<(usize, usize, usize), Arc<DescriptorSet>>,
    /// The host's readback buffer.
    io: Subbuffer<[f32]>,
    /// The grid barrier's two words (device memory, zeroed once: the barrier leaves them
    /// ready for the next dispatch).
    grid: Subbuffer<[u8]>,
}

impl DeviceRoutes {
    /// The device side for `model` when `tier` holds every expert in buffers one
    /// binding can cover ([`VramTier::holds_all`]); `None` otherwise (steps are then
    /// host-routed). Each step's ranking goes to `io`, which the host reads. A fused
    /// front runs `front_groups` workgroups (0: none).
    pub fn new(
        ctx: &Arc<VulkanContext>,
        kernels: &Kernels,
        model: &Model,
        tier: Option<&VramTier>,
        io: &Subbuffer<[f32]>,
        front_groups: u32,
    ) -> Result<Option<DeviceRoutes>, VulkanError> {
        let Some(tier) = tier else { return Ok(None) };
        if !tier.holds_all(ctx.info.max_storage_buffer_range, MAX_BUFFERS) {
            tracing::info!("decode steps are host-routed: the VRAM tier cannot hold every expert at once");
            return Ok(None);
        }
        let c = &model.cfg;
        let front = match front_groups {
            0 => "the fused MoE front off".to_string(),
            n => format!("the fused MoE front with {n} workgroups (`moe_front_groups`; 0 turns it off)"),
        };
        let states = match c.hybrid {
            Some(_) => "; each session keeps a second copy of its DeltaNet states to start a void step again",
            None => "",
        };
        tracing::info!("decode steps route on the device, {front}{states}");
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
            front_groups,
            front: BTreeMap::new(),
            front_sets: HashMap::new(),
            io: io.clone(),
            grid: upload_f32(ctx, &[0.0, 0.0])?,
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

    /// Whether m=1 norms of the residual are held for a fused front to form
    /// ([`HeldNorm`]): while the front is on.
    pub fn folds_norms(&self) -> bool {
        self.front_groups > 0
    }

    /// The fused front of layer `l` for gate/up weights of `dtype` in tier buffer `buf`
    /// and the router weight `router` (bound whole), forming the RMSNorm of its input with
    /// weights `norm` where given, and its set, built on first use; `None` where the front
    /// cannot read this router.
    fn front_kernel(
        &mut self,
        ctx: &VulkanContext,
        kernels: &Kernels,
        (l, dtype, buf): (usize, DType, &Subbuffer<[u8]>),
        router: &DeviceWeight,
        norm: Option<&Subbuffer<[u8]>>,
    ) -> Result<Option<(Kernel, Arc<DescriptorSet>)>, VulkanError> {
        let [range] = &router.ranges[..] else { return Ok(None) };
        if router.padded || !router.cols.is_multiple_of(8) {
            return Ok(None);
        }
        let inputs = if norm.is_some() { router.cols } else { 0 };
        let kernel = match self.front.entry((dtype, router.dtype, inputs)) {
            btree_map::Entry::Occupied(e) => e.get().clone(),
            btree_map::Entry::Vacant(e) => {
                // The front is a faster form of kernels that exist: one the device cannot
                // build leaves the step to them.
                let k = kernels.gate_up_front(dtype, router.dtype, inputs).unwrap_or_else(|err| {
                    tracing::warn!("the fused MoE front is off for {} experts: {err}", dtype.name());
                    None
                });
                e.insert(k).clone()
            }
        };
        let Some(kernel) = kernel else { return Ok(None) };
        let address = |b: &Subbuffer<[u8]>| Arc::as_ptr(b.buffer()) as usize;
        let set = match self.front_sets.entry((address(buf), l, norm.map_or(0, address))) {
            hash_map::Entry::Occupied(e) => e.get().clone(),
            hash_map::Entry::Vacant(e) => {
                let win = window(buf, 0, ctx.info.max_storage_buffer_range);
                let bufs = [
                    win.clone(),
                    win,
                    self.slots.clone().into_bytes(),
                    self.io.clone().into_bytes(),
                    range.bytes.clone(),
                    self.grid.clone(),
                    norm.unwrap_or(&range.bytes).clone(),
                ];
                e.insert(set0(ctx, &kernel, &bufs)?).clone()
            }
        };
        Ok(Some((kernel, set)))
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
        // One buffer holds the layer's experts: its down projection can combine them, and
        // where the ranking fits, the router, the ranking and the gate/up are one dispatch.
        let fused = if nb == 1 { routes.combine_kernel(&kernels, layout.down.dtype, k)? } else { None };
        let router = &self.weights.matrix(gate)?.w;
        // A norm held for this step (of the residual the router reads) the front forms.
        let held = self
            .held_norm
            .as_ref()
            .map(|h| &h.vector)
            .filter(|_| router.cols == self.a.width(Plane::X) as usize);
        let folds = held.is_some();
        let front = match fused {
            Some(_)
                if routes.front_groups > 0
                    && ne <= FRONT_MAX_E
                    && ranks <= FRONT_MAX_RANKS
                    && router.rows == ne =>
            {
                routes.front_kernel(&self.ctx, &kernels, (l, layout.gate.dtype, &buffers[0]), router, held)?
            }
            _ => None,
        };
        let norm = if front.is_some() && folds { self.held_norm.take() } else { None };
        let front_groups = routes.front_groups;
        let (g0, d0) = self.expert_args(&layout);
        let groups = |p: Projection, dtype, a: &MatmulArgs| -> Result<u32, VulkanError> {
            Ok(a.rows.div_ceil(p.kernel(kernels.typed(dtype)?, false, a.rows).rows_per_wg()))
        };
        let (gu_groups, down_groups) = (
            groups(Projection::GateUp, layout.gate.dtype, &g0)?,
            groups(Projection::Down, layout.down.dtype, &d0)?,
        );
        if front.is_none() {
            self.record_gate(gate, 1)?;
        }
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
        if front.is_none() {
            self.rec()?.dispatch(&kernels.route_table, Some(set), args.words(), [1, 1, 1])?;
        }
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
                    let g = MatmulArgs { groups: k as u32, ..g };
                    match &front {
                        // Rank y's expert in workgroup row y, every input the token's.
                        Some((fk, fset)) => {
                            // Forming the norm, it reads the residual and stores the row.
                            let x_off = if norm.is_some() { a.at(Plane::X) } else { g.x_off };
                            let g = MatmulArgs { flags: FLAG_TABLE, x_stride: 0, x_off, ..g };
                            let normed = norm.as_ref().map(|_| (a.at(Plane::Xn), c.rms_norm_eps));
                            rec.gate_up_front(fk, fset.clone(), g, args.front_words(), normed, front_groups)?
                        }
                        None => rec.matmul(Projection::GateUp, layout.gate.dtype, false, gu, g)?,
                    }
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
    /// tier counts the hits; else the pass is void). A fused front that gave up at its
    /// grid barrier voids the pass too, and turns the fused front off.
    pub(super) fn read_device_routes(&mut self, ranks: &mut [Vec<u16>]) -> Result<bool, ForwardError> {
        let ne = self.model.cfg.num_experts;
        let k = self.model.cfg.experts_per_token();
        let Some(routes) = self.routes.as_mut() else { return Ok(false) };
        let layers = std::mem::take(&mut routes.layers);
        let row = self.a.routed_stride as usize;
        let at = |l: usize| self.io_routed + l * row;
        let io = self.io.read().map_err(verr("reading the device routing"))?;
        if layers.iter().any(|&(l, _)| io[at(l) + ne + k + 1].to_bits() != 0) {
            drop(io);
            let mut io = self.io.write().map_err(verr("clearing the fused front's marks"))?;
            for &(l, _) in &layers {
                io[at(l) + ne + k + 1] = 0.0;
            }
            tracing::warn!(
                "the fused MoE front's {} workgroups did not all run at once on this device: \
                 it is off from now on (set `moe_front_groups` lower, or 0)",
                routes.front_groups
            );
            routes.front_groups = 0;
            routes.front_sets.clear();
            self.replays.forget();
            return Ok(false);
        }
        let mut held = true;
        for &(l, n) in &layers {
            let r = &io[at(l)..at(l) + row];
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
