//! The forward pass on the device, run on the executor thread: resident weights
//! uploaded once, one activation arena sized for `max_rows` tokens, one command buffer
//! per layer step and one host sync per MoE layer (the router's logits come back, the
//! host routes exactly as the CPU reference does, claims the experts from the ring and
//! records their kernels, reading the ring slots in place or staged copies of them).
//! The experts of one bound buffer window run as one gate/up and one down dispatch over
//! an expert table; staged prefill uploads the union in batches, each batch's upload
//! overlapping the previous batch's kernels.

use std::collections::HashMap;
use std::sync::Arc;

use smoe_proto::{DType, ExpertHandle, ExpertKey, ExpertSource, PartLayout};
use vulkano::buffer::{BufferUsage, Subbuffer};
use vulkano::command_buffer::{
    AutoCommandBufferBuilder, CommandBufferUsage, CopyBufferInfo, PrimaryAutoCommandBuffer,
};
use vulkano::descriptor_set::{DescriptorSet, WriteDescriptorSet};
use vulkano::sync::GpuFuture;

use super::allocator::ArenaRegistry;
use super::buffers::{device_buffer, host_buffer, upload_buffer, upload_f32, verr, DeviceWeight};
use super::context::VulkanContext;
use super::kv::{KvLayer, VulkanKvCache};
use super::pipelines::{Kernels, MatmulTuning};
use super::record::{
    set0, MatmulArgs, Projection, Recorder, FLAG_ACCUMULATE, FLAG_GATHER, FLAG_SCATTER, FLAG_TABLE,
};
use super::{VulkanError, VulkanForwardError};
use crate::forward::{ClaimEvent, ClaimTally, ForwardError};
use crate::model::{FfnRefs, Model};
use crate::router::{GateInput, RouteJob, Router};

/// Offsets (f32 elements) of the regions of the activation arena.
#[derive(Clone, Copy, Debug)]
struct Regions {
    x: u32,
    xn: u32,
    q: u32,
    k: u32,
    v: u32,
    attn: u32,
    router: u32,
    hidden: u32,
    yk: u32,
    logits: u32,
    len: u32,
}

impl Regions {
    fn new(model: &Model, m: usize) -> Result<Regions, VulkanError> {
        let c = &model.cfg;
        let k = c.num_experts_per_tok.max(1);
        let inter = (m * c.intermediate_size).max(m * k * c.moe_intermediate_size);
        let sizes = [
            m * c.hidden_size,
            m * c.hidden_size,
            m * c.q_dim(),
            m * c.kv_dim(),
            m * c.kv_dim(),
            m * c.q_dim(),
            m * c.num_experts,
            inter,
            m * k * c.hidden_size,
            c.vocab_size,
        ];
        let mut off = [0u64; 11];
        for (i, s) in sizes.iter().enumerate() {
            off[i + 1] = (off[i] + *s as u64).next_multiple_of(16);
        }
        if off[10] > u32::MAX as u64 / 2 {
            return Err(VulkanError::Unsupported(format!(
                "activations for {m} rows need {} floats; lower the chunk size",
                off[10]
            )));
        }
        let o = |i: usize| off[i] as u32;
        Ok(Regions {
            x: o(0),
            xn: o(1),
            q: o(2),
            k: o(3),
            v: o(4),
            attn: o(5),
            router: o(6),
            hidden: o(7),
            yk: o(8),
            logits: o(9),
            len: o(10),
        })
    }
}

/// A resident weight matrix with one descriptor set per bound row range.
struct BoundWeight {
    w: DeviceWeight,
    sets: Vec<Arc<DescriptorSet>>,
}

enum LayerFfn {
    Dense { gate_up: Vec<((u32, u32), Arc<DescriptorSet>)>, dtype: DType, inter: usize, down: BoundWeight },
    Moe { router: BoundWeight },
}

struct LayerBufs {
    input_norm: Arc<DescriptorSet>,
    post_norm: Arc<DescriptorSet>,
    q: BoundWeight,
    k: BoundWeight,
    v: BoundWeight,
    o: BoundWeight,
    q_norm: Subbuffer<[u8]>,
    k_norm: Subbuffer<[u8]>,
    ffn: LayerFfn,
}

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

/// Device state of one forward pass (lives on the executor thread).
pub struct Runner {
    ctx: Arc<VulkanContext>,
    kernels: Arc<Kernels>,
    model: Arc<Model>,
    experts: Arc<dyn ExpertSource>,
    arenas: ArenaRegistry,
    max_rows: usize,
    r: Regions,
    act: Subbuffer<[f32]>,
    act_set: Arc<DescriptorSet>,
    route_buf: Subbuffer<[u32]>,
    io: Subbuffer<[f32]>,
    layers: Vec<LayerBufs>,
    final_norm: Arc<DescriptorSet>,
    lm_head: BoundWeight,
    rope_cos: Subbuffer<[u8]>,
    rope_sin: Subbuffer<[u8]>,
    /// Descriptor sets of expert-blob windows: (buffer, window start) → (down set,
    /// gate/up set).
    window_sets: HashMap<(usize, u64), (Arc<DescriptorSet>, Arc<DescriptorSet>)>,
    /// Byte granularity of window starts: a blob at offset o is bound in the window
    /// starting at o rounded down to a multiple of this (half the storage-buffer range,
    /// so the window holds the whole blob).
    window: u64,
    /// Routing-buffer offset of the expert table (entries indexed by union position).
    tab_off: usize,
    /// Work submitted but not waited for (staged batches of the current layer).
    pending: Option<Box<dyn GpuFuture>>,
    /// Union position of `handles[0]`.
    held_from: usize,
    /// Union experts per staged batch.
    stage_batch: usize,
    /// Host-visible copies of blobs that did not come from a Vulkan arena.
    fallback: Option<Subbuffer<[u8]>>,
    /// Two device-local layer slots for staged prefill, when the device has separate
    /// device memory (or a staged path was asked for).
    stage: Option<[Subbuffer<[u8]>; 2]>,
    /// Where expert kernels read blobs (staging only where `stage` exists).
    path: ExpertPath,
    /// For each layer, the union size of the last call (0 for dense layers).
    pub union_sizes: Vec<usize>,
    /// Claim accounting since start.
    pub tally: ClaimTally,
    /// Gate ranks beyond top-k queued as prefetch bets in decode steps.
    pub spec_depth: usize,
    /// Claim trace, when enabled.
    pub trace: Option<Vec<ClaimEvent>>,
    /// The router stage.
    router: Router,
    /// Per-layer lists, sized once and reused (the hot path allocates none).
    scratch: MoeScratch,
    handles: Vec<ExpertHandle>,
    /// Most blobs held at once (the ring's slot count: holding more would wait forever).
    hold_limit: usize,
}

/// The lists one MoE layer step builds, kept between layers so their capacity is reused.
#[derive(Default)]
struct MoeScratch {
    /// (first pair, pair count) of each union member, in union order.
    segs: Vec<(usize, usize)>,
    /// The layer's union, in first-use order.
    union: Vec<u16>,
    /// The bound blob (ring slot or layer-slot range) of each held member of a batch.
    blobs: Vec<Subbuffer<[u8]>>,
    /// (buffer, window start, batch index) of each held member, sorted into windows.
    order: Vec<(usize, u64, usize)>,
}

impl MoeScratch {
    /// Lists with room for a union of `n` experts.
    fn with_capacity(n: usize) -> Self {
        MoeScratch {
            segs: Vec::with_capacity(n),
            union: Vec::with_capacity(n),
            blobs: Vec::with_capacity(n),
            order: Vec::with_capacity(n),
        }
    }
}

fn bind(
    ctx: &VulkanContext,
    kernels: &Kernels,
    model: &Model,
    r: &crate::vault::TensorRef,
) -> Result<BoundWeight, VulkanError> {
    let w = DeviceWeight::upload(ctx, &model.w(r))?;
    let k = &kernels.f32.matvec;
    let sets =
        w.ranges.iter().map(|rg| set0(ctx, k, std::slice::from_ref(&rg.bytes))).collect::<Result<_, _>>()?;
    Ok(BoundWeight { w, sets })
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
    let n = (max_union as u64 * model.vault.expert_layout().blob_stride).max(4);
    let slot = || device_buffer::<u8>(ctx, n, BufferUsage::STORAGE_BUFFER);
    Ok(Some([slot()?, slot()?]))
}

impl Runner {
    /// Uploads the resident weights of `model` and sizes everything for `max_rows`.
    pub fn new(
        ctx: Arc<VulkanContext>,
        arenas: ArenaRegistry,
        model: Arc<Model>,
        experts: Arc<dyn ExpertSource>,
        max_rows: usize,
        hold_limit: usize,
    ) -> Result<Runner, VulkanError> {
        let c = model.cfg.clone();
        if c.head_dim > 512 {
            return Err(VulkanError::Unsupported(format!("head_dim {} > 512", c.head_dim)));
        }
        let m = max_rows.max(1);
        let kernels = Arc::new(Kernels::new(&ctx.device, MatmulTuning::default())?);
        let r = Regions::new(&model, m)?;
        let act = device_buffer::<f32>(&ctx, r.len as u64, BufferUsage::STORAGE_BUFFER)?;
        let k = c.num_experts_per_tok.max(1);
        // Pair lists, routing weights and the expert table (3 words per union expert).
        let route_len = 2 * m * k + 3 * c.num_experts.min(m * k);
        let route_buf = upload_buffer::<u32>(&ctx, route_len as u64, BufferUsage::STORAGE_BUFFER)?;
        let io_len = m * c.hidden_size + m * c.num_experts + c.vocab_size;
        let io = host_buffer::<f32>(&ctx, io_len as u64, BufferUsage::empty())?;
        let act_set = DescriptorSet::new(
            ctx.descriptors.clone(),
            kernels.act_layout.clone(),
            [WriteDescriptorSet::buffer(0, act.clone()), WriteDescriptorSet::buffer(1, route_buf.clone())],
            [],
        )
        .map_err(verr("creating the activation set"))?;
        let vecset =
            |tr: &crate::vault::TensorRef| -> Result<(Subbuffer<[u8]>, Arc<DescriptorSet>), VulkanError> {
                let b = upload_f32(&ctx, model.vec(tr))?;
                let s = set0(&ctx, &kernels.rmsnorm, std::slice::from_ref(&b))?;
                Ok((b, s))
            };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for lr in &model.layers {
            let ffn = match &lr.ffn {
                FfnRefs::Dense { gate, up, down } => {
                    let g = DeviceWeight::upload(&ctx, &model.w(gate))?;
                    let u = DeviceWeight::upload(&ctx, &model.w(up))?;
                    let sets = g
                        .ranges
                        .iter()
                        .zip(&u.ranges)
                        .map(|(a, b)| {
                            let set = set0(&ctx, &kernels.f32.gate_up, &[a.bytes.clone(), b.bytes.clone()])?;
                            Ok(((a.row0 as u32, a.rows as u32), set))
                        })
                        .collect::<Result<_, VulkanError>>()?;
                    if g.dtype != u.dtype || g.ranges.len() != u.ranges.len() {
                        return Err(VulkanError::Unsupported(
                            "gate and up projections differ in type".into(),
                        ));
                    }
                    LayerFfn::Dense {
                        gate_up: sets,
                        dtype: g.dtype,
                        inter: g.rows,
                        down: bind(&ctx, &kernels, &model, down)?,
                    }
                }
                FfnRefs::Moe { router } => LayerFfn::Moe { router: bind(&ctx, &kernels, &model, router)? },
            };
            layers.push(LayerBufs {
                input_norm: vecset(&lr.input_norm)?.1,
                post_norm: vecset(&lr.post_norm)?.1,
                q: bind(&ctx, &kernels, &model, &lr.q)?,
                k: bind(&ctx, &kernels, &model, &lr.k)?,
                v: bind(&ctx, &kernels, &model, &lr.v)?,
                o: bind(&ctx, &kernels, &model, &lr.o)?,
                q_norm: vecset(&lr.q_norm)?.0,
                k_norm: vecset(&lr.k_norm)?.0,
                ffn,
            });
        }
        let final_norm = vecset(&model.norm)?.1;
        let lm_head = bind(&ctx, &kernels, &model, &model.lm_head)?;
        let rope_cos = upload_f32(&ctx, &model.rope.cos)?;
        let rope_sin = upload_f32(&ctx, &model.rope.sin)?;
        let layout = *model.vault.expert_layout();
        let window = ctx.info.max_storage_buffer_range / 2 / 256 * 256;
        if layout.blob_stride > window {
            return Err(VulkanError::Unsupported(format!(
                "an expert blob of {} bytes exceeds half the device's storage-buffer range ({} bytes)",
                layout.blob_stride, ctx.info.max_storage_buffer_range
            )));
        }
        let stage = if !ctx.info.unified_memory { layer_slots(&ctx, &model, m)? } else { None };
        let job = RouteJob::new(m, 0, c.num_experts, k, c.norm_topk_prob);
        let router = Router::spawn(Arc::clone(&model), Arc::clone(&experts), job);
        Ok(Runner {
            kernels,
            max_rows: m,
            r,
            act,
            act_set,
            route_buf,
            io,
            layers,
            final_norm,
            lm_head,
            rope_cos,
            rope_sin,
            window_sets: HashMap::new(),
            window,
            tab_off: 2 * m * k,
            pending: None,
            held_from: 0,
            stage_batch: c.num_experts.min(m * k).div_ceil(4).clamp(1, STAGE_BATCH),
            fallback: None,
            stage,
            path: if ctx.info.unified_memory { ExpertPath::ZeroCopy } else { DISCRETE_DEFAULT },
            union_sizes: vec![0; c.num_hidden_layers],
            tally: ClaimTally::default(),
            spec_depth: 0,
            trace: None,
            router,
            scratch: MoeScratch::with_capacity(c.num_experts),
            handles: Vec::with_capacity(c.num_experts),
            hold_limit: hold_limit.max(1),
            ctx,
            model,
            experts,
            arenas,
        })
    }

    /// Picks the expert path; a staged path on a device without separate device memory
    /// (where the default reads ring slots in place) allocates the layer slots first.
    pub fn set_path(&mut self, path: ExpertPath) -> Result<(), VulkanError> {
        if path != ExpertPath::ZeroCopy && self.stage.is_none() {
            self.stage = layer_slots(&self.ctx, &self.model, self.max_rows)?;
        }
        self.path = path;
        Ok(())
    }

    /// A KV cache for this model on the device.
    pub fn new_kv(&self) -> Result<VulkanKvCache, VulkanError> {
        let c = &self.model.cfg;
        let n = (self.model.max_context * c.kv_dim()) as u64;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for lb in &self.layers {
            let k = device_buffer::<f32>(&self.ctx, n, BufferUsage::STORAGE_BUFFER)?;
            let v = device_buffer::<f32>(&self.ctx, n, BufferUsage::STORAGE_BUFFER)?;
            let (kb, vb) = (k.clone().reinterpret::<[u8]>(), v.clone().reinterpret::<[u8]>());
            let rope = set0(
                &self.ctx,
                &self.kernels.qk_rope,
                &[
                    lb.q_norm.clone(),
                    lb.k_norm.clone(),
                    self.rope_cos.clone(),
                    self.rope_sin.clone(),
                    kb.clone(),
                    vb.clone(),
                ],
            )?;
            let attn = set0(&self.ctx, &self.kernels.attention, &[kb, vb])?;
            layers.push(KvLayer { rope, attn, _k: k, _v: v });
        }
        Ok(VulkanKvCache::new(Arc::new(layers)))
    }

    fn recorder(&self) -> Result<Recorder, VulkanError> {
        Recorder::new(
            &self.ctx,
            self.kernels.clone(),
            self.act_set.clone(),
            CommandBufferUsage::OneTimeSubmit,
        )
    }

    /// Submits `rec` after the work still in flight and, where given, after `transfer`
    /// (a staging upload, on the transfer queue where the device has one: it waits for
    /// nothing else, so it overlaps the work in flight, and `rec` waits for it through a
    /// semaphore). With `wait` the host waits for everything; otherwise the submission
    /// stays in flight and the next one is ordered after it by a semaphore.
    fn submit(
        &mut self,
        rec: Recorder,
        transfer: Option<Arc<PrimaryAutoCommandBuffer>>,
        wait: bool,
    ) -> Result<(), VulkanError> {
        let cb = rec.cb.build().map_err(verr("finishing a command buffer"))?;
        let e = verr("running a layer step");
        let now = || vulkano::sync::now(self.ctx.device.clone()).boxed();
        let start = self.pending.take().unwrap_or_else(now);
        let start = match (transfer, &self.ctx.transfer) {
            (Some(t), Some(q)) => {
                let upload = now()
                    .then_execute(q.clone(), t)
                    .map_err(&e)?
                    .then_signal_semaphore_and_flush()
                    .map_err(verr("submitting a staging upload"))?;
                start.join(upload).boxed()
            }
            (Some(t), None) => start.then_execute(self.ctx.compute.clone(), t).map_err(&e)?.boxed(),
            (None, _) => start,
        };
        let run = start.then_execute(self.ctx.compute.clone(), cb).map_err(&e)?;
        if wait {
            run.then_signal_fence_and_flush()
                .map_err(verr("submitting a layer step"))?
                .wait(None)
                .map_err(verr("waiting for a layer step"))?;
        } else {
            let f = run.then_signal_semaphore_and_flush().map_err(verr("submitting a layer step"))?;
            self.pending = Some(f.boxed());
        }
        Ok(())
    }

    /// Records one weight matrix product over every bound row range.
    fn project(
        &self,
        rec: &mut Recorder,
        w: &BoundWeight,
        mut a: MatmulArgs,
        batched: bool,
    ) -> Result<(), VulkanError> {
        let base = a.out_off;
        for (rg, set) in w.w.ranges.iter().zip(&w.sets) {
            a.rows = rg.rows as u32;
            a.cols = w.w.cols as u32;
            a.out_off = base + rg.row0 as u32;
            rec.matmul(Projection::Dense, w.w.dtype, batched, set.clone(), a)?;
        }
        Ok(())
    }

    fn attention(
        &self,
        rec: &mut Recorder,
        l: usize,
        kv: &KvLayer,
        start: usize,
        m: usize,
    ) -> Result<(), VulkanError> {
        let c = &self.model.cfg;
        let (h, qd, kvd) = (c.hidden_size as u32, c.q_dim() as u32, c.kv_dim() as u32);
        let r = self.r;
        let lb = &self.layers[l];
        let mu = m as u32;
        let batched = m > 1;
        rec.rmsnorm(lb.input_norm.clone(), h, mu, r.x, h, r.xn, h, c.rms_norm_eps)?;
        let a = MatmulArgs { m: mu, x_off: r.xn, x_stride: h, ..Default::default() };
        self.project(rec, &lb.q, MatmulArgs { out_off: r.q, out_stride: qd, ..a }, batched)?;
        self.project(rec, &lb.k, MatmulArgs { out_off: r.k, out_stride: kvd, ..a }, batched)?;
        self.project(rec, &lb.v, MatmulArgs { out_off: r.v, out_stride: kvd, ..a }, batched)?;
        let (nh, nkv, hd) = (c.num_attention_heads as u32, c.num_key_value_heads as u32, c.head_dim as u32);
        let k = self.kernels.qk_rope.clone();
        rec.dispatch(
            &k,
            Some(kv.rope.clone()),
            [hd, nh, nkv, r.q, r.k, r.v, start as u32, c.rms_norm_eps.to_bits()],
            [nh + nkv, mu, 1],
        )?;
        let k = self.kernels.attention.clone();
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        rec.dispatch(
            &k,
            Some(kv.attn.clone()),
            [hd, nh, nkv, r.q, r.attn, start as u32, scale.to_bits()],
            [nh, mu, 1],
        )?;
        let a = MatmulArgs {
            m: mu,
            x_off: r.attn,
            x_stride: qd,
            out_off: r.x,
            out_stride: h,
            flags: FLAG_ACCUMULATE,
            ..Default::default()
        };
        self.project(rec, &lb.o, a, batched)
    }

    fn dense_ffn(&self, rec: &mut Recorder, l: usize, m: usize) -> Result<(), VulkanError> {
        let c = &self.model.cfg;
        let h = c.hidden_size as u32;
        let r = self.r;
        let lb = &self.layers[l];
        let LayerFfn::Dense { gate_up, dtype, inter, down } = &lb.ffn else { return Ok(()) };
        let mu = m as u32;
        rec.rmsnorm(lb.post_norm.clone(), h, mu, r.x, h, r.xn, h, c.rms_norm_eps)?;
        let inter = *inter as u32;
        for ((row0, rows), set) in gate_up {
            let a = MatmulArgs {
                rows: *rows,
                cols: h,
                m: mu,
                x_off: r.xn,
                x_stride: h,
                out_off: r.hidden + row0,
                out_stride: inter,
                ..Default::default()
            };
            rec.matmul(Projection::GateUp, *dtype, m > 1, set.clone(), a)?;
        }
        let a = MatmulArgs {
            m: mu,
            x_off: r.hidden,
            x_stride: inter,
            out_off: r.x,
            out_stride: h,
            flags: FLAG_ACCUMULATE,
            ..Default::default()
        };
        self.project(rec, down, a, m > 1)
    }

    /// Descriptor sets (down, gate/up) binding the window of `blob`'s buffer that starts
    /// at `start` and spans `len` bytes (or to the buffer's end). A buffer's windows all
    /// have one length (the storage-buffer range for ring slots, [`Runner::stage_window`]
    /// for layer slots), so (buffer, start) names one.
    fn window_sets(
        &mut self,
        blob: &Subbuffer<[u8]>,
        start: u64,
        len: u64,
    ) -> Result<(Arc<DescriptorSet>, Arc<DescriptorSet>), VulkanError> {
        let key = (Arc::as_ptr(blob.buffer()) as usize, start);
        if let Some(s) = self.window_sets.get(&key) {
            return Ok(s.clone());
        }
        let whole = Subbuffer::from(blob.buffer().clone());
        let end = (start + len).min(whole.len()) / 4 * 4;
        let win = whole.slice(start..end);
        let t = super::record::typed(&self.kernels, self.model.vault.expert_layout().dtype);
        let down = set0(&self.ctx, &t.down, std::slice::from_ref(&win))?;
        let gu = set0(&self.ctx, &t.gate_up, &[win.clone(), win])?;
        self.window_sets.insert(key, (down.clone(), gu.clone()));
        Ok((down, gu))
    }

    /// The buffer range holding a claimed blob: the ring slot itself when it lies in a
    /// Vulkan arena, else a host-visible copy.
    fn blob_buffer(&mut self, ui: usize, bytes: &[u8]) -> Result<Subbuffer<[u8]>, VulkanError> {
        if let Some(b) = self.arenas.locate(bytes) {
            return Ok(b);
        }
        let stride = self.model.vault.expert_layout().blob_stride;
        let need = stride * self.model.cfg.num_experts.max(1) as u64;
        if self.fallback.as_ref().is_none_or(|f| f.len() < need) {
            self.fallback = Some(host_buffer::<u8>(&self.ctx, need, BufferUsage::STORAGE_BUFFER)?);
        }
        let fb = self.fallback.as_ref().expect("just allocated").clone();
        let off = ui as u64 * stride;
        let dst = fb.slice(off..off + bytes.len().max(4) as u64);
        dst.write().map_err(verr("writing a blob copy"))?[..bytes.len()].copy_from_slice(bytes);
        Ok(dst)
    }

    /// Runs `tokens` at positions `start..` through every layer.
    pub fn forward(
        &mut self,
        kv: &[KvLayer],
        start: usize,
        tokens: &[u32],
        logits: &mut Vec<f32>,
        want_logits: bool,
    ) -> Result<bool, VulkanForwardError> {
        let model = self.model.clone();
        let c = &model.cfg;
        let m = tokens.len();
        if m == 0 || m > self.max_rows {
            return Err(VulkanError::Unsupported(format!(
                "a block of {m} tokens (this pass takes 1..={})",
                self.max_rows
            ))
            .into());
        }
        if start + m > model.max_context {
            return Err(ForwardError::ContextFull { needed: start + m, max: model.max_context }.into());
        }
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(ForwardError::TokenOutOfVocab { id, vocab: c.vocab_size }.into());
        }
        let h = c.hidden_size;
        {
            let mut io = self.io.write().map_err(verr("writing embeddings"))?;
            let embed = model.w(&model.embed);
            for (t, &tok) in tokens.iter().enumerate() {
                embed.row_to_f32(tok as usize, &mut io[t * h..(t + 1) * h]);
            }
        }
        if kv.len() != c.num_hidden_layers {
            return Err(VulkanError::Unsupported("a KV cache made for another model".into()).into());
        }
        self.union_sizes.fill(0);
        let mut rec = self.recorder()?;
        // A staging upload recorded for the current layer step, run before it.
        let mut transfer = None;
        let x0 = self.r.x as u64;
        rec.copy(self.io.clone().slice(0..(m * h) as u64), self.act.clone().slice(x0..x0 + (m * h) as u64))?;
        for (l, kvl) in kv.iter().enumerate().take(c.num_hidden_layers) {
            self.attention(&mut rec, l, kvl, start, m)?;
            match &self.layers[l].ffn {
                LayerFfn::Dense { .. } => self.dense_ffn(&mut rec, l, m)?,
                LayerFfn::Moe { .. } => {
                    self.router(&mut rec, l, m)?;
                    self.submit(rec, transfer.take(), true)?;
                    (rec, transfer) = self.moe_experts(l, start, m)?;
                }
            }
        }
        if want_logits {
            let r = self.r;
            let hu = h as u32;
            let last = r.x + ((m - 1) * h) as u32;
            rec.rmsnorm(self.final_norm.clone(), hu, 1, last, hu, r.xn, hu, c.rms_norm_eps)?;
            let a = MatmulArgs {
                m: 1,
                x_off: r.xn,
                x_stride: hu,
                out_off: r.logits,
                out_stride: 0,
                ..Default::default()
            };
            self.project(&mut rec, &self.lm_head, a, false)?;
            let (lo, v) = (r.logits as u64, c.vocab_size as u64);
            let io0 = (m * h + m * c.num_experts) as u64;
            rec.copy(self.act.clone().slice(lo..lo + v), self.io.clone().slice(io0..io0 + v))?;
        }
        self.submit(rec, transfer.take(), true)?;
        self.handles.clear();
        if want_logits {
            let io = self.io.read().map_err(verr("reading logits"))?;
            let io0 = m * h + m * c.num_experts;
            logits.clear();
            logits.extend_from_slice(&io[io0..io0 + c.vocab_size]);
        }
        Ok(want_logits)
    }

    fn router(&self, rec: &mut Recorder, l: usize, m: usize) -> Result<(), VulkanError> {
        let c = &self.model.cfg;
        let (h, ne) = (c.hidden_size as u32, c.num_experts as u32);
        let r = self.r;
        let lb = &self.layers[l];
        let LayerFfn::Moe { router } = &lb.ffn else { return Ok(()) };
        let mu = m as u32;
        rec.rmsnorm(lb.post_norm.clone(), h, mu, r.x, h, r.xn, h, c.rms_norm_eps)?;
        let a = MatmulArgs {
            m: mu,
            x_off: r.xn,
            x_stride: h,
            out_off: r.router,
            out_stride: ne,
            ..Default::default()
        };
        self.project(rec, router, a, m > 1)?;
        let n = (m * c.num_experts) as u64;
        let io0 = (m * c.hidden_size) as u64;
        rec.copy(
            self.act.clone().slice(r.router as u64..r.router as u64 + n),
            self.io.clone().slice(io0..io0 + n),
        )
    }

    /// Routes the block on the host (exactly the CPU reference's routing), claims the
    /// union from the expert source and records the expert kernels and the combine;
    /// returns the recorder for the rest of the layer step.
    #[allow(clippy::type_complexity)]
    fn moe_experts(
        &mut self,
        l: usize,
        start: usize,
        m: usize,
    ) -> Result<(Recorder, Option<Arc<PrimaryAutoCommandBuffer>>), VulkanForwardError> {
        let mut sc = std::mem::take(&mut self.scratch);
        let out = self.moe_experts_in(&mut sc, l, start, m);
        self.scratch = sc;
        out
    }

    /// [`Runner::moe_experts`] with its lists in `sc`.
    #[allow(clippy::type_complexity)]
    fn moe_experts_in(
        &mut self,
        sc: &mut MoeScratch,
        l: usize,
        start: usize,
        m: usize,
    ) -> Result<(Recorder, Option<Arc<PrimaryAutoCommandBuffer>>), VulkanForwardError> {
        let model = self.model.clone();
        let c = &model.cfg;
        let (h, ne, k) = (c.hidden_size, c.num_experts, c.num_experts_per_tok);
        // The router ranks the device-computed gate logits and announces the union.
        let job = {
            let io = self.io.read().map_err(verr("reading router logits"))?;
            let spec_depth = self.spec_depth;
            self.router
                .route(|job| {
                    job.request(l, m, GateInput::Logits, spec_depth);
                    job.logits_mut()[..m * ne].copy_from_slice(&io[m * h..m * h + m * ne]);
                })
                .map_err(|_| ForwardError::RouterStopped)?
        };
        // Pair lists (token-major indices t·k + r routed to each expert, grouped in union
        // order, as the job holds them) and the routing weights.
        sc.segs.clear();
        sc.segs.extend(job.segments());
        {
            let mut rb = self.route_buf.write().map_err(verr("writing routing"))?;
            rb[..m * k].copy_from_slice(job.pairs());
            for (i, &w) in job.topk_weights().iter().enumerate() {
                rb[m * k + i] = w.to_bits();
            }
        }
        let announced = job.announced();
        sc.union.clear();
        sc.union.extend_from_slice(job.union());
        self.handles.clear();
        self.held_from = 0;
        let staged = self.staged(m);
        if staged {
            self.write_stage_table(&sc.segs)?;
        }
        // Expert work is recorded in batches of at most `hold_limit` held blobs: when the
        // ring could not take another claim while all our handles are alive, the batch
        // so far is run and its handles dropped first.
        let mut batch = 0usize;
        let mut rec = self.recorder()?;
        for ui in 0..sc.union.len() {
            let e = sc.union[ui];
            if ui >= announced && self.handles.len() >= self.hold_limit {
                let transfer = self.record_experts(&mut rec, l, m, batch, sc)?;
                self.submit(rec, transfer, true)?;
                self.handles.clear();
                self.held_from = ui;
                rec = self.recorder()?;
                batch = ui;
            } else if staged && ui > batch && ui % self.stage_batch == 0 {
                // Staged: this batch's upload and kernels go now, overlapping the next
                // batch's claims and upload.
                let transfer = self.record_experts(&mut rec, l, m, batch, sc)?;
                self.submit(rec, transfer, false)?;
                rec = self.recorder()?;
                batch = ui;
            }
            match self.experts.claim(ExpertKey::new(l, e as usize)) {
                Ok(b) => {
                    self.tally.add(b.info());
                    if let Some(trace) = self.trace.as_mut() {
                        trace.push(ClaimEvent::new(start, m, l, e as usize, b.info()));
                    }
                    self.handles.push(b);
                }
                Err(err) => {
                    if let Some(job) = self.router.job() {
                        job.withdraw_after(ui, self.experts.as_ref());
                    }
                    // Dropping the staged batches in flight waits for them, so no upload
                    // still reads a slot whose handle goes now.
                    self.pending = None;
                    self.handles.clear();
                    return Err(ForwardError::Vault(err).into());
                }
            }
        }
        let transfer = self.record_experts(&mut rec, l, m, batch, sc)?;
        let r = self.r;
        let (hu, ku) = (h as u32, k as u32);
        let kacc = self.kernels.accumulate.clone();
        rec.dispatch(&kacc, None, [hu, ku, r.yk, r.x, (m * k) as u32], [hu.div_ceil(256), m as u32, 1])?;
        if let Some(job) = self.router.job() {
            job.place_bets(self.experts.as_ref());
        }
        self.union_sizes[l] = sc.union.len();
        if m > 1 {
            metrics::histogram!("smoe_union_size").record(sc.union.len() as f64);
        }
        Ok((rec, transfer))
    }
}

impl Runner {
    /// Whether a block of `m` tokens copies its experts into a layer slot.
    fn staged(&self, m: usize) -> bool {
        self.stage.is_some()
            && match self.path {
                ExpertPath::ZeroCopy => false,
                ExpertPath::StagedPrefill => m > 1,
                ExpertPath::Staged => true,
            }
    }

    /// Bytes of a layer slot one staged batch's kernels bind.
    fn stage_window(&self) -> u64 {
        self.stage_batch as u64 * self.model.vault.expert_layout().blob_stride
    }

    /// Writes the expert table of a staged layer before its first batch runs (the
    /// routing buffer cannot be written while batches read it): union position u's blob
    /// lies at u · blob_stride in the layer slot, inside the window of its batch.
    fn write_stage_table(&mut self, segs: &[(usize, usize)]) -> Result<(), VulkanError> {
        let layout = *self.model.vault.expert_layout();
        let (gran, ds) = (self.stage_window(), layout.dtype.size() as u64);
        let mut rb = self.route_buf.write().map_err(verr("writing the expert table"))?;
        for (u, &(s, n)) in segs.iter().enumerate() {
            let off = u as u64 * layout.blob_stride;
            let t = self.tab_off + 3 * u;
            rb[t..t + 3].copy_from_slice(&[((off - off / gran * gran) / ds) as u32, s as u32, n as u32]);
        }
        Ok(())
    }

    /// Records the kernels of the held blobs (union indices `first..`, in `self.handles`)
    /// into `rec`; with staging, also records their upload into the layer slot and
    /// returns it (to run before `rec`).
    fn record_experts(
        &mut self,
        rec: &mut Recorder,
        l: usize,
        m: usize,
        first: usize,
        sc: &mut MoeScratch,
    ) -> Result<Option<Arc<PrimaryAutoCommandBuffer>>, VulkanError> {
        let MoeScratch { segs, blobs, order, .. } = sc;
        let model = self.model.clone();
        let c = &model.cfg;
        let layout = *model.vault.expert_layout();
        let staged = self.staged(m);
        let mut transfer: Option<AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>> = None;
        let handles = std::mem::take(&mut self.handles);
        blobs.clear();
        for (i, hnd) in handles[first - self.held_from..].iter().enumerate() {
            let ui = first + i;
            let src = self.blob_buffer(ui, &hnd[..])?;
            let blob = if staged {
                let slot = self.stage.as_ref().expect("staging buffers exist")[l % 2].clone();
                let off = ui as u64 * layout.blob_stride;
                let dst = slot.slice(off..off + src.len());
                let tcb = match transfer.as_mut() {
                    Some(t) => t,
                    None => {
                        let q = self.ctx.transfer.as_ref().unwrap_or(&self.ctx.compute);
                        transfer.insert(
                            AutoCommandBufferBuilder::primary(
                                self.ctx.commands.clone(),
                                q.queue_family_index(),
                                CommandBufferUsage::OneTimeSubmit,
                            )
                            .map_err(verr("recording a staging upload"))?,
                        )
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
        self.handles = handles;
        // One gate/up and one down dispatch per bound window, over the table entries of
        // its experts (union positions first.., grouped by window; staged windows follow
        // union order, and their table is already written).
        let gran = if staged { self.stage_window() } else { self.window };
        order.clear();
        order.extend(
            blobs
                .iter()
                .enumerate()
                .map(|(i, b)| (Arc::as_ptr(b.buffer()) as usize, b.offset() / gran * gran, i)),
        );
        order.sort_unstable();
        let ds = layout.dtype.size() as u64;
        if !staged {
            let mut rb = self.route_buf.write().map_err(verr("writing the expert table"))?;
            for (pos, &(_, start, i)) in order.iter().enumerate() {
                let (s, n) = segs[first + i];
                let t = self.tab_off + 3 * (first + pos);
                rb[t..t + 3].copy_from_slice(&[
                    ((blobs[i].offset() - start) / ds) as u32,
                    s as u32,
                    n as u32,
                ]);
            }
        }
        let r = self.r;
        let (hu, ku) = (c.hidden_size as u32, c.num_experts_per_tok as u32);
        let inter = c.moe_intermediate_size as u32;
        let off = |p: &PartLayout| (p.offset / ds) as u32;
        let mut a = 0;
        while a < order.len() {
            let (buf, start, i0) = order[a];
            let b = a + order[a..].iter().take_while(|o| (o.0, o.1) == (buf, start)).count();
            let len = if staged { gran } else { self.ctx.info.max_storage_buffer_range };
            let (down, gu) = self.window_sets(&blobs[i0], start, len)?;
            // Results do not depend on the kernel (identity), so any multi-token expert
            // picks the batched one for the whole group.
            let batched = order[a..b].iter().any(|o| segs[first + o.2].1 > 1);
            let g = MatmulArgs {
                rows: inter,
                cols: hu,
                w_off: off(&layout.gate),
                w2_off: off(&layout.up),
                x_off: r.xn,
                x_stride: hu,
                out_off: r.hidden,
                out_stride: inter,
                map_div: ku,
                flags: FLAG_GATHER | FLAG_TABLE,
                tab_off: (self.tab_off + 3 * (first + a)) as u32,
                groups: (b - a) as u32,
                ..Default::default()
            };
            rec.matmul(Projection::GateUp, layout.dtype, batched, gu, g)?;
            let d = MatmulArgs {
                rows: hu,
                cols: inter,
                w_off: off(&layout.down),
                x_off: r.hidden,
                x_stride: inter,
                out_off: r.yk,
                out_stride: hu,
                flags: FLAG_SCATTER | FLAG_TABLE,
                ..g
            };
            rec.matmul(Projection::Down, layout.dtype, batched, down, d)?;
            a = b;
        }
        // The recorder holds what it binds; the list keeps only its capacity.
        blobs.clear();
        match transfer {
            Some(t) => Ok(Some(t.build().map_err(verr("recording a staging upload"))?)),
            None => Ok(None),
        }
    }
}
