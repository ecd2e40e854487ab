//! The expert compute over a claimed union: the routing buffer (pair lists, routing
//! weights, the expert table), where kernels read each claimed blob (its copy in the
//! VRAM tier when the tier is on; else the ring slot in place, or a staged copy in a
//! device-local layer slot), and one gate/up plus one down dispatch per bound buffer
//! window of experts. Staged prefill uploads the union in batches, each batch's upload
//! overlapping the previous batch's kernels.

use std::collections::HashMap;
use std::sync::Arc;

use smoe_proto::{DType, ExpertHandle, ExpertLayout, PartLayout, RouteJob};
use vulkano::buffer::{BufferUsage, Subbuffer};
use vulkano::command_buffer::{
    AutoCommandBufferBuilder, CommandBufferUsage, CopyBufferInfo, PrimaryAutoCommandBuffer,
};
use vulkano::descriptor_set::DescriptorSet;

use super::allocator::ArenaRegistry;
use super::backend::VulkanBackend;
use super::buffers::{device_buffer, host_buffer, upload_buffer, verr};
use super::context::VulkanContext;
use super::device_route::fast_route_words;
use super::record::{set0, weight_unit, MatmulArgs, Projection, FLAG_GATHER, FLAG_SCATTER, FLAG_TABLE};
use super::timing::lock;
use super::vram::{Placement, VramTier};
use super::VulkanError;
use crate::contract::Plane;
use crate::model::Model;
use crate::profile::{Phase, Regime};

/// Where expert kernels read the claimed blobs from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ExpertPath {
    /// Kernels read the host-visible ring slots in place (every block).
    ZeroCopy,
    /// Multi-row blocks copy their union into a device-local layer slot (on the
    /// transfer queue where the device has one), in batches whose uploads overlap the
    /// previous batch's kernels; decode reads ring slots in place.
    StagedPrefill,
    /// Every block, decode included, copies its blobs into a layer slot first.
    Staged,
}

/// Most union experts per staged batch: a batch's upload overlaps the previous batch's
/// kernels, and each batch's kernels bind only its own part of the layer slot (so the
/// next upload writes a range nothing in flight reads). A full union is split into at
/// least four batches.
const STAGE_BATCH: usize = 16;

/// The expert path on devices with their own memory.
const DISCRETE_DEFAULT: ExpertPath = ExpertPath::StagedPrefill;

/// The expert side of the backend's state.
pub struct ExpertState {
    /// Pair lists, routing weights and the expert table (3 words per union member).
    pub route_buf: Subbuffer<[u32]>,
    /// Routing-buffer offset of the expert table (entries indexed by union position).
    tab_off: usize,
    /// Routing-buffer offset of a device-routed step's routing words (`device_route`).
    pub fast_off: usize,
    /// Routing-buffer word holding the position of the pass's first token, which the host
    /// writes for each pass and the RoPE and attention kernels read (so a kept recording
    /// serves every position, with no copy in it).
    pub pos_word: usize,
    /// The ring arenas kernels read in place.
    arenas: ArenaRegistry,
    /// Descriptor sets of expert-blob windows: (buffer, window start) → (down set,
    /// gate/up set).
    window_sets: HashMap<(usize, u64), (Arc<DescriptorSet>, Arc<DescriptorSet>)>,
    /// Byte granularity of window starts: a blob at offset o is bound in the window
    /// starting at o rounded down to a multiple of this (half the storage-buffer range,
    /// so the window holds the whole blob).
    window: u64,
    /// Union experts per staged batch.
    stage_batch: usize,
    /// Host-visible copies of blobs that did not come from a Vulkan arena.
    fallback: Option<Subbuffer<[u8]>>,
    /// Two device-local layer slots for staged prefill, when the device has separate
    /// device memory (or a staged path was asked for).
    stage: Option<[Subbuffer<[u8]>; 2]>,
    /// Where expert kernels read blobs (staging only where `stage` exists).
    path: ExpertPath,
    /// The VRAM tier, when it is on: every block's experts are read through it (no
    /// staging).
    pub vram: Option<VramTier>,
    /// (first pair, pair count) of each union member of the current layer.
    segs: Vec<(usize, usize)>,
    /// The bound blob (ring slot or layer-slot range) of each member of a batch.
    blobs: Vec<Subbuffer<[u8]>>,
    /// (buffer, window start, batch index) of each member, sorted into windows.
    order: Vec<(usize, u64, usize)>,
    /// Largest block of tokens (sizes the layer slots).
    max_rows: usize,
}

/// Checks that the fused gate/up kernel can read every MoE layer's experts: their gate
/// and up projections are stored in one type (the down projection may have another).
fn check_layouts(model: &Model) -> Result<(), VulkanError> {
    for l in &model.vault.manifest().experts.layers {
        let (g, u) = (l.layout.gate.dtype, l.layout.up.dtype);
        if g != u {
            return Err(VulkanError::Unsupported(format!(
                "layer {} stores its experts' gate projections as {g} and up projections as {u}; \
                 the fused gate/up kernel reads both as one type",
                l.layer
            )));
        }
    }
    Ok(())
}

/// Two layer slots, each holding the largest union of a block of `m` tokens (none for a
/// model without routed experts).
fn layer_slots(
    ctx: &Arc<VulkanContext>,
    model: &Model,
    m: usize,
) -> Result<Option<[Subbuffer<[u8]>; 2]>, VulkanError> {
    let c = &model.cfg;
    if c.num_experts == 0 {
        return Ok(None);
    }
    let max_union = c.num_experts.min(m * c.num_experts_per_tok.max(1));
    let n = (max_union as u64 * model.vault.max_blob_stride()).max(4);
    let slot = || device_buffer::<u8>(ctx, n, BufferUsage::STORAGE_BUFFER);
    Ok(Some([slot()?, slot()?]))
}

impl ExpertState {
    /// The state for blocks of up to `m` tokens of `model`, reading experts through
    /// `vram` when given (then no layer slots are allocated).
    pub fn new(
        ctx: &Arc<VulkanContext>,
        model: &Model,
        m: usize,
        arenas: ArenaRegistry,
        vram: Option<VramTier>,
    ) -> Result<ExpertState, VulkanError> {
        let c = &model.cfg;
        let k = c.num_experts_per_tok.max(1);
        let route_len = 2 * m * k + 3 * c.num_experts.min(m * k);
        let pos_word = route_len + fast_route_words(k);
        let route_buf = upload_buffer::<u32>(ctx, pos_word as u64 + 1, BufferUsage::STORAGE_BUFFER)?;
        check_layouts(model)?;
        let window = ctx.info.max_storage_buffer_range / 2 / 256 * 256;
        let stride = model.vault.max_blob_stride();
        if stride > window {
            return Err(VulkanError::Unsupported(format!(
                "an expert blob of {stride} bytes exceeds half the device's storage-buffer range ({} bytes)",
                ctx.info.max_storage_buffer_range
            )));
        }
        let unified = ctx.info.unified_memory;
        Ok(ExpertState {
            route_buf,
            tab_off: 2 * m * k,
            fast_off: route_len,
            pos_word,
            arenas,
            window_sets: HashMap::new(),
            window,
            stage_batch: c.num_experts.min(m * k).div_ceil(4).clamp(1, STAGE_BATCH),
            fallback: None,
            stage: if unified || vram.is_some() { None } else { layer_slots(ctx, model, m)? },
            path: if unified { ExpertPath::ZeroCopy } else { DISCRETE_DEFAULT },
            segs: Vec::with_capacity(c.num_experts),
            blobs: Vec::with_capacity(c.num_experts),
            order: Vec::with_capacity(c.num_experts),
            max_rows: m,
            vram,
        })
    }

    /// Picks the expert path, allocating the layer slots a staged path needs (none while
    /// the VRAM tier is on: the tier takes the place of staging).
    pub fn set_path(
        &mut self,
        ctx: &Arc<VulkanContext>,
        model: &Model,
        path: ExpertPath,
    ) -> Result<(), VulkanError> {
        if path != ExpertPath::ZeroCopy && self.stage.is_none() && self.vram.is_none() {
            self.stage = layer_slots(ctx, model, self.max_rows)?;
        }
        self.path = path;
        Ok(())
    }

    /// Whether a block of `m` tokens copies its experts into a layer slot.
    fn staged(&self, m: usize) -> bool {
        self.stage.is_some()
            && self.vram.is_none()
            && match self.path {
                ExpertPath::ZeroCopy => false,
                ExpertPath::StagedPrefill => m > 1,
                ExpertPath::Staged => true,
            }
    }

    /// Claimed experts per batch for a block of `m` tokens: the staged batch, else the
    /// whole union at once.
    pub fn batch(&self, m: usize) -> usize {
        if self.staged(m) {
            self.stage_batch
        } else {
            usize::MAX
        }
    }

    /// Bytes of a layer slot one staged batch's kernels bind.
    fn stage_window(&self, model: &Model) -> u64 {
        self.stage_batch as u64 * model.vault.max_blob_stride()
    }

    /// Writes the plan's pair lists (token-major indices t·k + r routed to each member,
    /// grouped in union order) and routing weights to the routing buffer, and for a
    /// staged block the whole expert table: union position u's blob lies at
    /// u · (the largest blob stride) in the layer slot, inside the window of its batch
    /// (table offsets are bytes). Runs after a sync point, so no kernel reads the buffer.
    pub fn write_routing(&mut self, model: &Model, job: &RouteJob) -> Result<(), VulkanError> {
        let (m, k) = (job.rows(), job.k());
        self.segs.clear();
        self.segs.extend(job.segments());
        let staged = self.staged(m);
        let (gran, stride) = (self.stage_window(model), model.vault.max_blob_stride());
        let mut rb = self.route_buf.write().map_err(verr("writing routing"))?;
        rb[..m * k].copy_from_slice(job.pairs());
        for (i, &w) in job.topk_weights().iter().enumerate() {
            rb[m * k + i] = w.to_bits();
        }
        if staged {
            for (u, &(s, n)) in self.segs.iter().enumerate() {
                let off = u as u64 * stride;
                let t = self.tab_off + 3 * u;
                rb[t..t + 3].copy_from_slice(&[(off - off / gran * gran) as u32, s as u32, n as u32]);
            }
        }
        Ok(())
    }
}

impl VulkanBackend {
    /// Records the kernels of union members `first..` (their claimed `handles`) into
    /// the recording: through the VRAM tier when it is on; else reading the ring slots
    /// in place, or with staging also recording their upload into the layer slot and
    /// returning it (to run before the recording).
    pub(super) fn record_experts(
        &mut self,
        l: usize,
        m: usize,
        first: usize,
        handles: &[ExpertHandle],
    ) -> Result<Option<Arc<PrimaryAutoCommandBuffer>>, VulkanError> {
        if let Some(mut vram) = self.ex.vram.take() {
            let r = self.record_through_vram(&mut vram, l, m, first, handles);
            self.ex.vram = Some(vram);
            return r.map(|()| None);
        }
        let stride = self.model.vault.max_blob_stride();
        let staged = self.ex.staged(m);
        let mut transfer: Option<AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>> = None;
        let mut blobs = std::mem::take(&mut self.ex.blobs);
        blobs.clear();
        for (i, hnd) in handles.iter().enumerate() {
            let ui = first + i;
            let src = self.blob_buffer(ui, &hnd[..])?;
            let blob = if staged {
                let slot = self.ex.stage.as_ref().expect("staging buffers exist")[l % 2].clone();
                let off = ui as u64 * stride;
                let dst = slot.slice(off..off + src.len());
                let tcb = match transfer.as_mut() {
                    Some(t) => t,
                    None => {
                        let q = self.ctx.transfer.as_ref().unwrap_or(&self.ctx.compute);
                        let t = transfer.insert(
                            AutoCommandBufferBuilder::primary(
                                self.ctx.commands.clone(),
                                q.queue_family_index(),
                                CommandBufferUsage::OneTimeSubmit,
                            )
                            .map_err(verr("recording a staging upload"))?,
                        );
                        if let Some(timer) = &self.timer {
                            lock(timer).mark_upload(t)?;
                        }
                        t
                    }
                };
                tcb.copy_buffer(CopyBufferInfo::buffers(src, dst.clone()))
                    .map_err(verr("recording a staging upload"))?;
                dst
            } else {
                src
            };
            blobs.push(blob);
        }
        self.record_dispatches(l, first, &blobs, staged)?;
        // The recorder holds what it binds; the list keeps only its capacity.
        blobs.clear();
        self.ex.blobs = blobs;
        match transfer {
            Some(mut t) => {
                if let Some(timer) = &self.timer {
                    lock(timer).end_upload(&mut t)?;
                }
                Ok(Some(t.build().map_err(verr("recording a staging upload"))?))
            }
            None => Ok(None),
        }
    }

    /// Records union members `first..` through the VRAM tier: a member the tier holds is
    /// read there; any other is copied from its ring slot into a tier slot (recorded
    /// ahead of the kernels) and read there. When every slot of a member's class is taken
    /// by the members placed so far, their kernels are recorded first and the rest of
    /// the members form a new batch.
    fn record_through_vram(
        &mut self,
        vram: &mut VramTier,
        l: usize,
        m: usize,
        first: usize,
        handles: &[ExpertHandle],
    ) -> Result<(), VulkanError> {
        let regime = Regime::of(m);
        let mut blobs = std::mem::take(&mut self.ex.blobs);
        blobs.clear();
        // Union position of the current batch's first member.
        let mut batch_first = first;
        vram.begin_batch();
        for (i, hnd) in handles.iter().enumerate() {
            let ui = first + i;
            let len = hnd.len().max(4) as u64;
            let blob = loop {
                match vram.place(hnd.key(), len) {
                    Some(Placement::Hit(b)) => break b,
                    Some(Placement::Fill(dst)) => {
                        let src = self.blob_buffer(ui, &hnd[..])?;
                        self.mark(regime, Phase::ExpertUpload)?;
                        self.rec()?.copy(src, dst.clone())?;
                        break dst;
                    }
                    Some(Placement::Full) if !blobs.is_empty() => {
                        self.mark(regime, Phase::Experts)?;
                        self.record_dispatches(l, batch_first, &blobs, false)?;
                        blobs.clear();
                        batch_first = ui;
                        vram.begin_batch();
                    }
                    Some(Placement::Full) => {
                        return Err(VulkanError::Vulkan(format!(
                            "placing layer {l}'s experts: a VRAM tier size class without slots"
                        )))
                    }
                    // A layer the tier does not serve: its kernels read the ring slot.
                    None => break self.blob_buffer(ui, &hnd[..])?,
                }
            };
            blobs.push(blob);
        }
        if !blobs.is_empty() {
            self.mark(regime, Phase::Experts)?;
            self.record_dispatches(l, batch_first, &blobs, false)?;
        }
        blobs.clear();
        self.ex.blobs = blobs;
        vram.publish();
        Ok(())
    }

    /// Records one gate/up and one down dispatch per bound window over `blobs` (union
    /// members `first..`, where kernels read each), over the table entries of its
    /// experts (grouped by window; staged windows follow union order, and their table is
    /// already written).
    fn record_dispatches(
        &mut self,
        l: usize,
        first: usize,
        blobs: &[Subbuffer<[u8]>],
        staged: bool,
    ) -> Result<(), VulkanError> {
        let model = self.model.clone();
        let layout = *model.vault.expert_layout(l).map_err(|e| VulkanError::Unsupported(e.to_string()))?;
        let gran = if staged { self.ex.stage_window(&model) } else { self.ex.window };
        let mut order = std::mem::take(&mut self.ex.order);
        order.clear();
        order.extend(
            blobs
                .iter()
                .enumerate()
                .map(|(i, b)| (Arc::as_ptr(b.buffer()) as usize, b.offset() / gran * gran, i)),
        );
        order.sort_unstable();
        if !staged {
            let mut rb = self.ex.route_buf.write().map_err(verr("writing the expert table"))?;
            for (pos, &(_, start, i)) in order.iter().enumerate() {
                let (s, n) = self.ex.segs[first + i];
                let t = self.ex.tab_off + 3 * (first + pos);
                rb[t..t + 3].copy_from_slice(&[(blobs[i].offset() - start) as u32, s as u32, n as u32]);
            }
        }
        let (g0, d0) = self.expert_args(&layout);
        let mut i = 0;
        while i < order.len() {
            let (buf, start, i0) = order[i];
            let j = i + order[i..].iter().take_while(|o| (o.0, o.1) == (buf, start)).count();
            let len = if staged { gran } else { self.ctx.info.max_storage_buffer_range };
            let (down, gu) = self.window_sets(&blobs[i0], start, len)?;
            // Results do not depend on the kernel (identity), so any multi-token expert
            // picks the batched one for the whole group.
            let batched = order[i..j].iter().any(|o| self.ex.segs[first + o.2].1 > 1);
            let tab = MatmulArgs {
                tab_off: (self.ex.tab_off + 3 * (first + i)) as u32,
                groups: (j - i) as u32,
                ..g0
            };
            let rec = self.rec()?;
            rec.matmul(Projection::GateUp, layout.gate.dtype, batched, gu, tab)?;
            let tab = MatmulArgs { tab_off: tab.tab_off, groups: tab.groups, ..d0 };
            rec.matmul(Projection::Down, layout.down.dtype, batched, down, tab)?;
            i = j;
        }
        self.ex.order = order;
        Ok(())
    }

    /// The gate/up and down arguments of expert kernels over experts stored as
    /// `layout` says, reading their table entries from [`FLAG_TABLE`] (the table's
    /// offset and size, and the pair list's offset, are the caller's).
    pub(super) fn expert_args(&self, layout: &ExpertLayout) -> (MatmulArgs, MatmulArgs) {
        let (a, c) = (self.a, &self.model.cfg);
        let (hu, ku) = (c.hidden_size as u32, c.num_experts_per_tok as u32);
        let inter = c.moe_intermediate_size as u32;
        // Part offsets in the units of each part's type (table offsets are bytes).
        let off = |p: &PartLayout| (p.offset / weight_unit(p.dtype)) as u32;
        let g = MatmulArgs {
            rows: inter,
            cols: hu,
            w_off: off(&layout.gate),
            w2_off: off(&layout.up),
            x_off: a.at(Plane::Xn),
            x_stride: hu,
            out_off: a.at(Plane::Hidden),
            out_stride: inter,
            map_div: ku,
            flags: FLAG_GATHER | FLAG_TABLE,
            ..Default::default()
        };
        let d = MatmulArgs {
            rows: hu,
            cols: inter,
            w_off: off(&layout.down),
            x_off: a.at(Plane::Hidden),
            x_stride: inter,
            out_off: a.yk,
            out_stride: hu,
            flags: FLAG_SCATTER | FLAG_TABLE,
            ..g
        };
        (g, d)
    }

    /// Descriptor sets (down, gate/up) binding the window of `blob`'s buffer that starts
    /// at `start` and spans `len` bytes (or to the buffer's end). A buffer's windows all
    /// have one length (the storage-buffer range for ring slots, the stage window for
    /// layer slots), so (buffer, start) names one.
    pub(super) fn window_sets(
        &mut self,
        blob: &Subbuffer<[u8]>,
        start: u64,
        len: u64,
    ) -> Result<(Arc<DescriptorSet>, Arc<DescriptorSet>), VulkanError> {
        let key = (Arc::as_ptr(blob.buffer()) as usize, start);
        if let Some(s) = self.ex.window_sets.get(&key) {
            return Ok(s.clone());
        }
        let win = window(blob, start, len);
        // Every type's kernels have the same set layouts: those of f32 serve all layers.
        let t = self.kernels.typed(DType::F32)?;
        let down = set0(&self.ctx, &t.down, std::slice::from_ref(&win))?;
        let gu = set0(&self.ctx, &t.gate_up, &[win.clone(), win])?;
        self.ex.window_sets.insert(key, (down.clone(), gu.clone()));
        Ok((down, gu))
    }

    /// The buffer range holding a claimed blob: the ring slot itself when it lies in a
    /// Vulkan arena, else a host-visible copy.
    fn blob_buffer(&mut self, ui: usize, bytes: &[u8]) -> Result<Subbuffer<[u8]>, VulkanError> {
        if let Some(b) = self.ex.arenas.locate(bytes) {
            return Ok(b);
        }
        let stride = self.model.vault.max_blob_stride();
        let need = stride * self.model.cfg.num_experts.max(1) as u64;
        if self.ex.fallback.as_ref().is_none_or(|f| f.len() < need) {
            self.ex.fallback = Some(host_buffer::<u8>(&self.ctx, need, BufferUsage::STORAGE_BUFFER)?);
        }
        let fb = self.ex.fallback.as_ref().expect("just allocated").clone();
        let off = ui as u64 * stride;
        let dst = fb.slice(off..off + bytes.len().max(4) as u64);
        dst.write().map_err(verr("writing a blob copy"))?[..bytes.len()].copy_from_slice(bytes);
        Ok(dst)
    }
}

/// The window of `len` bytes from `start` of the buffer holding `blob` (cut at the
/// buffer's end, to whole words): what expert kernels bind to read the blobs in it.
pub(super) fn window(blob: &Subbuffer<[u8]>, start: u64, len: u64) -> Subbuffer<[u8]> {
    let whole = Subbuffer::from(blob.buffer().clone());
    let end = (start + len).min(whole.len()) / 4 * 4;
    whole.slice(start..end)
}
