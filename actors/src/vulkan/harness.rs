//! Single kernels on caller-supplied data, outside a forward pass: the identity tests
//! (batched kernel vs m=1 kernel, byte for byte) and the per-kernel benchmarks use it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use smoe_proto::DType;
use vulkano::buffer::{BufferUsage, Subbuffer};
use vulkano::command_buffer::CommandBufferUsage;
use vulkano::descriptor_set::WriteDescriptorSet;
use vulkano::sync::GpuFuture;

pub use super::attention::{AttentionArgs, AttentionKernels, AttentionShape};
/// Buffer allocation and staged uploads, for benchmarks that build their own pipelines.
pub use super::buffers::{device_buffer, host_buffer, upload};
use super::buffers::{upload_buffer, upload_f32, verr, DeviceWeight};
use super::context::VulkanContext;
pub use super::delta::{DeltaArgs, DeltaKernels};
pub use super::pipelines::MatmulTuning;
use super::pipelines::{kernel, Kernel, Kernels};
use super::record::set0;
use super::VulkanError;
use crate::tensor::WeightView;

pub use super::device_route::RouteTableArgs;
pub use super::record::{
    weight_unit, MatmulArgs, Projection, Recorder, FLAG_ACCUMULATE, FLAG_COMBINE, FLAG_GATHER, FLAG_SCATTER,
    FLAG_TABLE, WIDE_ROWS,
};
pub use vulkano::descriptor_set::DescriptorSet;

/// A weight matrix on the device, bound whole (it must fit one storage-buffer range).
pub struct TestWeight {
    /// Element type.
    pub dtype: DType,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// In the padded Q6_K layout ([`KernelHarness::padded_weight`]).
    padded: bool,
    bytes: Subbuffer<[u8]>,
    set: Arc<DescriptorSet>,
}

impl TestWeight {
    /// The descriptor set binding this matrix for the matmul kernels.
    pub fn set(&self) -> Arc<DescriptorSet> {
        self.set.clone()
    }

    /// Records its dense product ([`Recorder::dense`], told whether it is padded):
    /// `a` names the rows, columns and offsets.
    pub fn record(&self, r: &mut Recorder, batched: bool, a: MatmulArgs) -> Result<(), VulkanError> {
        r.dense(self.dtype, self.padded, batched, self.set.clone(), a)
    }
}

/// A recorded `route_table` dispatch ([`KernelHarness::record_route_table`]) and the
/// buffers it writes.
pub struct RouteTableRun<R> {
    /// Records the dispatch.
    pub record: R,
    /// The indirect dispatch sizes it writes.
    pub sizes: Subbuffer<[u32]>,
    /// The host's readback buffer it writes.
    pub io: Subbuffer<[f32]>,
}

/// Runs kernels on an activation arena and routing buffer of its own.
pub struct KernelHarness {
    ctx: Arc<VulkanContext>,
    kernels: Arc<Kernels>,
    act: Subbuffer<[f32]>,
    route: Subbuffer<[u32]>,
    act_set: Arc<DescriptorSet>,
    read_bandwidth: Kernel,
}

fn act_set(
    ctx: &VulkanContext,
    kernels: &Kernels,
    act: &Subbuffer<[f32]>,
    route: &Subbuffer<[u32]>,
) -> Result<Arc<DescriptorSet>, VulkanError> {
    DescriptorSet::new(
        ctx.descriptors.clone(),
        kernels.act_layout.clone(),
        [WriteDescriptorSet::buffer(0, act.clone()), WriteDescriptorSet::buffer(1, route.clone())],
        [],
    )
    .map_err(verr("creating the activation set"))
}

impl KernelHarness {
    /// A harness with `act_len` activation floats and `route_len` routing words, and the
    /// backend's default matmul tuning.
    pub fn new(ctx: Arc<VulkanContext>, act_len: usize, route_len: usize) -> Result<Self, VulkanError> {
        Self::with_tuning(ctx, act_len, route_len, MatmulTuning::default())
    }

    /// [`KernelHarness::new`] with the matmul kernels split as `tuning` says.
    pub fn with_tuning(
        ctx: Arc<VulkanContext>,
        act_len: usize,
        route_len: usize,
        tuning: MatmulTuning,
    ) -> Result<Self, VulkanError> {
        let kernels = Arc::new(Kernels::new(&ctx.device, tuning)?);
        let act = device_buffer::<f32>(&ctx, act_len as u64, BufferUsage::STORAGE_BUFFER)?;
        let route = upload_buffer::<u32>(&ctx, route_len as u64, BufferUsage::STORAGE_BUFFER)?;
        let act_set = act_set(&ctx, &kernels, &act, &route)?;
        let read_bandwidth = kernel(&ctx.device, &kernels.act_layout, "read_bandwidth", None)?;
        Ok(KernelHarness { ctx, kernels, act, route, act_set, read_bandwidth })
    }

    /// A harness sharing this one's kernels and activation arena (so its weights and
    /// sets work with both) whose routing buffer is in host memory instead of where the
    /// executor keeps it: `vulkan kernels` measures what reading routing data across
    /// the bus costs.
    pub fn with_host_route(&self) -> Result<Self, VulkanError> {
        let route = host_buffer::<u32>(&self.ctx, self.route.len(), BufferUsage::STORAGE_BUFFER)?;
        Ok(KernelHarness {
            act_set: act_set(&self.ctx, &self.kernels, &self.act, &route)?,
            route,
            ctx: self.ctx.clone(),
            kernels: self.kernels.clone(),
            act: self.act.clone(),
            read_bandwidth: self.read_bandwidth.clone(),
        })
    }

    /// Uploads `w`: to device-local memory, or (`host_visible`) to host-visible memory
    /// as ring slots are, to measure kernels reading in place.
    pub fn weight(&self, w: &WeightView<'_>, host_visible: bool) -> Result<TestWeight, VulkanError> {
        let (dtype, bytes) = (w.dtype(), w.bytes());
        let buf = if host_visible {
            let padded = (bytes.len() as u64 + 4).next_multiple_of(16);
            let b = host_buffer::<u8>(&self.ctx, padded, BufferUsage::STORAGE_BUFFER)?;
            b.write().map_err(verr("writing weights"))?[..bytes.len()].copy_from_slice(bytes);
            b
        } else {
            self.device_weight(w, false)?
        };
        let set = set0(&self.ctx, &self.kernels.typed(dtype)?.matvec, std::slice::from_ref(&buf))?;
        Ok(TestWeight { dtype, rows: w.rows, cols: w.cols, padded: false, bytes: buf, set })
    }

    /// Uploads `w` (Q6_K) to device-local memory in the padded block layout an LM head
    /// gets (`super::buffers::Q6K_PADDED_BLOCK`); only its m=1 products run.
    pub fn padded_weight(&self, w: &WeightView<'_>) -> Result<TestWeight, VulkanError> {
        let buf = self.device_weight(w, true)?;
        let set = set0(&self.ctx, &self.kernels.typed(w.dtype())?.matvec, std::slice::from_ref(&buf))?;
        Ok(TestWeight { dtype: w.dtype(), rows: w.rows, cols: w.cols, padded: true, bytes: buf, set })
    }

    /// `w` in device-local memory as one bound range.
    fn device_weight(&self, w: &WeightView<'_>, padded: bool) -> Result<Subbuffer<[u8]>, VulkanError> {
        let d = DeviceWeight::upload(&self.ctx, w, padded)?;
        if d.ranges.len() != 1 {
            return Err(VulkanError::Unsupported("test weight larger than one binding".into()));
        }
        Ok(d.ranges[0].bytes.clone())
    }

    /// Expert blobs (`bytes`, laid out as a vault's blobs follow each other in a ring)
    /// in device-local or (`host_visible`) host-visible memory, bound whole as the
    /// executor binds a window of ring slots: (the set of the down projection, the set of
    /// the gate/up kernels, both bindings on the same bytes).
    pub fn blobs(
        &self,
        bytes: &[u8],
        host_visible: bool,
    ) -> Result<(Arc<DescriptorSet>, Arc<DescriptorSet>), VulkanError> {
        let padded = (bytes.len() as u64).next_multiple_of(16).max(16);
        let buf = if host_visible {
            let b = host_buffer::<u8>(&self.ctx, padded, BufferUsage::STORAGE_BUFFER)?;
            b.write().map_err(verr("writing blobs"))?[..bytes.len()].copy_from_slice(bytes);
            b
        } else {
            let b = device_buffer::<u8>(&self.ctx, padded, BufferUsage::STORAGE_BUFFER)?;
            upload(&self.ctx, &b, bytes)?;
            b
        };
        // Every type's kernels have the same set layouts: those of f32 serve all.
        let t = self.kernels.typed(DType::F32)?;
        Ok((
            set0(&self.ctx, &t.down, std::slice::from_ref(&buf))?,
            set0(&self.ctx, &t.gate_up, &[buf.clone(), buf])?,
        ))
    }

    /// The set binding `gate` and `up` for the gate/up kernels.
    pub fn pair(&self, gate: &TestWeight, up: &TestWeight) -> Result<Arc<DescriptorSet>, VulkanError> {
        set0(&self.ctx, &self.kernels.typed(gate.dtype)?.gate_up, &[gate.bytes.clone(), up.bytes.clone()])
    }

    /// Writes `data` into the activation arena at `off`.
    pub fn write_act(&self, off: usize, data: &[f32]) -> Result<(), VulkanError> {
        let bytes = self.act.clone().reinterpret::<[u8]>();
        let o = (off * 4) as u64;
        upload(&self.ctx, &bytes.slice(o..o + (data.len() * 4) as u64), bytemuck::cast_slice(data))
    }

    /// Reads `len` activation floats from `off`.
    pub fn read_act(&self, off: usize, len: usize) -> Result<Vec<f32>, VulkanError> {
        self.read_floats(&self.act.clone().slice(off as u64..(off + len) as u64))
    }

    /// Writes the routing buffer from its start.
    pub fn write_route(&self, data: &[u32]) -> Result<(), VulkanError> {
        self.route.write().map_err(verr("writing routing"))?[..data.len()].copy_from_slice(data);
        Ok(())
    }

    /// Records `record` `reps` times into one command buffer, runs it and waits;
    /// returns the time from submission to completion.
    pub fn run(
        &self,
        record: impl FnMut(&mut Recorder) -> Result<(), VulkanError>,
        reps: usize,
    ) -> Result<Duration, VulkanError> {
        Ok(self.run_timed(record, reps, Duration::ZERO, 1)?[0])
    }

    /// Records `record` `reps` times into one command buffer, submits it back to back
    /// (each waited for) until `warm` has passed, then `n` more times; returns those
    /// `n` times from submission to completion. Recording once keeps host work out of
    /// the gaps between submissions, so the GPU stays busy and its clocks up.
    pub fn run_timed(
        &self,
        mut record: impl FnMut(&mut Recorder) -> Result<(), VulkanError>,
        reps: usize,
        warm: Duration,
        n: usize,
    ) -> Result<Vec<Duration>, VulkanError> {
        let usage = if warm.is_zero() && n == 1 {
            CommandBufferUsage::OneTimeSubmit
        } else {
            CommandBufferUsage::MultipleSubmit
        };
        let mut rec = Recorder::new(&self.ctx, self.kernels.clone(), self.act_set.clone(), usage)?;
        for _ in 0..reps.max(1) {
            record(&mut rec)?;
        }
        let cb = rec.cb.build().map_err(verr("finishing a command buffer"))?;
        let submit = || -> Result<Duration, VulkanError> {
            let t = Instant::now();
            vulkano::sync::now(self.ctx.device.clone())
                .then_execute(self.ctx.compute.clone(), cb.clone())
                .map_err(verr("submitting"))?
                .then_signal_fence_and_flush()
                .map_err(verr("submitting"))?
                .wait(None)
                .map_err(verr("waiting"))?;
            Ok(t.elapsed())
        };
        let start = Instant::now();
        while start.elapsed() < warm {
            submit()?;
        }
        (0..n).map(|_| submit()).collect()
    }

    /// Records the read-bandwidth kernel (`shaders/read_bandwidth.comp`) over every
    /// 16-byte word of `w` with `groups` workgroups, which write one word each from
    /// activation offset `out_off`, for [`KernelHarness::run_timed`].
    pub fn read_all(
        &self,
        w: &TestWeight,
        groups: u32,
        out_off: u32,
    ) -> Result<impl FnMut(&mut Recorder) -> Result<(), VulkanError> + '_, VulkanError> {
        let set = set0(&self.ctx, &self.read_bandwidth, std::slice::from_ref(&w.bytes))?;
        let words = (w.bytes.len() / 16) as u32;
        Ok(move |r: &mut Recorder| {
            r.dispatch(&self.read_bandwidth, Some(set.clone()), [words, out_off], [groups, 1, 1])
        })
    }

    /// A matmul (`batched`) or matvec of `w` with `a` (rows and cols taken from `w`).
    pub fn matmul(
        &self,
        w: &TestWeight,
        a: MatmulArgs,
        batched: bool,
        reps: usize,
    ) -> Result<Duration, VulkanError> {
        let a = MatmulArgs { rows: w.rows as u32, cols: w.cols as u32, ..a };
        self.run(|r| w.record(r, batched, a), reps)
    }

    /// Records the router's ranking (`shaders/route.comp`) of `m` rows of `ne` gate logits
    /// at activation offset 0, for [`KernelHarness::run`]: each row's `ranks` best experts
    /// (as float bits) and top-`k` weights (renormalised with `norm`) at
    /// `out_off + t · (ne + k + 1)`.
    pub fn record_route(
        &self,
        ne: u32,
        k: u32,
        ranks: u32,
        norm: bool,
        m: u32,
        out_off: u32,
    ) -> impl FnMut(&mut Recorder) -> Result<(), VulkanError> + '_ {
        let push = [ne, k, ranks, norm as u32, 0, out_off, ne + k + 1];
        move |r: &mut Recorder| r.dispatch(&self.kernels.route, None, push, [1, m, 1])
    }

    /// The ranking of a device-routed decode step (`shaders/route.comp` with `TABLE`) as
    /// `a` says, over the tier's slot table `slots` (per expert: buffer or `u32::MAX`, byte
    /// offset; `a.slot_off` indexes it); returns the indirect dispatch sizes of the
    /// `a.buffers` buffers and the host's readback buffer (`a.io_out` + the output row).
    pub fn route_table(&self, a: RouteTableArgs, slots: &[u32]) -> Result<(Vec<u32>, Vec<f32>), VulkanError> {
        let run = self.record_route_table(a, slots)?;
        self.run(run.record, 1)?;
        let sizes = run.sizes.read().map_err(verr("reading dispatch sizes"))?.to_vec();
        let io = run.io.read().map_err(verr("reading the ranked row"))?.to_vec();
        Ok((sizes, io))
    }

    /// Records [`KernelHarness::route_table`]'s dispatch, for [`KernelHarness::run_timed`].
    pub fn record_route_table(
        &self,
        a: RouteTableArgs,
        slots: &[u32],
    ) -> Result<RouteTableRun<impl FnMut(&mut Recorder) -> Result<(), VulkanError> + '_>, VulkanError> {
        let table = upload_buffer::<u32>(&self.ctx, slots.len() as u64, BufferUsage::STORAGE_BUFFER)?;
        table.write().map_err(verr("writing the slot table"))?.copy_from_slice(slots);
        let sizes = host_buffer::<u32>(&self.ctx, 6 * a.buffers as u64, BufferUsage::STORAGE_BUFFER)?;
        let io_len = (a.io_out + a.ne + a.k + 1) as u64;
        let io = host_buffer::<f32>(&self.ctx, io_len, BufferUsage::STORAGE_BUFFER)?;
        let bufs = [table.into_bytes(), sizes.clone().into_bytes(), io.clone().into_bytes()];
        let set = set0(&self.ctx, &self.kernels.route_table, &bufs)?;
        let record = move |r: &mut Recorder| {
            r.dispatch(&self.kernels.route_table, Some(set.clone()), a.words(), [1, 1, 1])
        };
        Ok(RouteTableRun { record, sizes, io })
    }

    /// Reads the first `len` words of the routing buffer.
    pub fn read_route(&self, len: usize) -> Result<Vec<u32>, VulkanError> {
        Ok(self.route.read().map_err(verr("reading routing"))?[..len].to_vec())
    }

    /// The greedy choice (`shaders/argmax.comp`) of `values`, written at activation offset
    /// 0 (the blocks' pairs after them; the activations must hold both).
    pub fn argmax(&self, values: &[f32]) -> Result<u32, VulkanError> {
        self.write_act(0, values)?;
        let io = host_buffer::<f32>(&self.ctx, 1, BufferUsage::STORAGE_BUFFER)?;
        let set = set0(&self.ctx, &self.kernels.argmax_final, &[io.clone().into_bytes()])?;
        let n = values.len() as u32;
        self.run(|r| r.argmax(set.clone(), n, 0, n.next_multiple_of(4), 0), 1)?;
        let got = io.read().map_err(verr("reading the greedy choice"))?[0].to_bits();
        Ok(got)
    }

    /// The fused gate/up + SiLU kernel over `gate`/`up` (bound by [`KernelHarness::pair`]).
    pub fn gate_up(
        &self,
        gate: &TestWeight,
        pair: &Arc<DescriptorSet>,
        a: MatmulArgs,
        batched: bool,
        reps: usize,
    ) -> Result<Duration, VulkanError> {
        let a = MatmulArgs { rows: gate.rows as u32, cols: gate.cols as u32, ..a };
        self.run(|r| r.matmul(Projection::GateUp, gate.dtype, batched, pair.clone(), a), reps)
    }

    /// A DeltaNet layer's parameters and a recurrent state of `state` floats on the
    /// device: the set of the delta-rule kernels binding them, and the state buffer.
    pub fn delta_state(
        &self,
        a_log: &[f32],
        dt_bias: &[f32],
        state: &[f32],
    ) -> Result<(Arc<DescriptorSet>, Subbuffer<[f32]>), VulkanError> {
        let st = device_buffer::<f32>(&self.ctx, state.len() as u64, BufferUsage::STORAGE_BUFFER)?;
        upload(&self.ctx, &st.clone().reinterpret::<[u8]>(), bytemuck::cast_slice(state))?;
        let (a, d) = (upload_f32(&self.ctx, a_log)?, upload_f32(&self.ctx, dt_bias)?);
        Ok((super::delta::delta_set(&self.ctx, &self.kernels.delta, &a, &d, &st)?, st))
    }

    /// A key/value cache holding `k` and `v` (`[position][kv_head][head_dim]` each) in
    /// device-local memory, bound as the backend binds a layer's cache for attention.
    pub fn kv_cache(&self, k: &[f32], v: &[f32]) -> Result<Arc<DescriptorSet>, VulkanError> {
        let bufs = [k, v].map(|data| -> Result<Subbuffer<[u8]>, VulkanError> {
            let b =
                device_buffer::<u8>(&self.ctx, (data.len() as u64 * 4).max(16), BufferUsage::STORAGE_BUFFER)?;
            upload(&self.ctx, &b, bytemuck::cast_slice(data))?;
            Ok(b)
        });
        let [k, v] = bufs;
        set0(&self.ctx, &self.kernels.attention.fused, &[k?, v?])
    }

    /// The expert down projection of `dtype` weights bound in `set` with the MoE combine
    /// of `k` experts ([`FLAG_COMBINE`] is added to `a`'s flags; one workgroup of `k`
    /// lane groups per rows of a lane group).
    pub fn down_combine(
        &self,
        dtype: DType,
        k: usize,
        set: &Arc<DescriptorSet>,
        a: MatmulArgs,
    ) -> Result<(), VulkanError> {
        let kd = self.kernels.down_combine(dtype, k)?.ok_or_else(|| {
            VulkanError::Unsupported(format!("a workgroup of {k} lane groups is too large for the device"))
        })?;
        let a = MatmulArgs { flags: a.flags | FLAG_COMBINE, ..a };
        self.run(|r| r.down_combine(&kd, set.clone(), a), 1).map(|_| ())
    }

    /// The MoE combine (`shaders/accumulate.comp`) of one token: `x += Σ_r w[r] · y[r]`
    /// over `k` rows of `h` at activation offset `y_off`, weights at routing-buffer offset
    /// `w_off`, residual at `x_off`.
    pub fn accumulate(&self, h: u32, k: u32, y_off: u32, x_off: u32, w_off: u32) -> Result<(), VulkanError> {
        let push = [h, k, y_off, x_off, w_off];
        self.run(|r| r.dispatch(&self.kernels.accumulate, None, push, [h.div_ceil(256), 1, 1]), 1).map(|_| ())
    }

    /// The attention kernels (for recording attention with [`AttentionArgs::record`]).
    pub fn attention_kernels(&self) -> &AttentionKernels {
        &self.kernels.attention
    }

    /// Writes `a`'s position into the routing buffer's word `a.pos_word`, where the
    /// attention kernels read it.
    pub fn write_position(&self, a: &AttentionArgs) -> Result<(), VulkanError> {
        self.route.write().map_err(verr("writing the position"))?[a.pos_word as usize] = a.start;
        Ok(())
    }

    /// Attention of `a.tokens` rows with the cache `set` ([`KernelHarness::kv_cache`])
    /// by the split path (`split`) or the fused one, `reps` times (the routing buffer's
    /// position word `a.pos_word` is written first).
    pub fn attention(
        &self,
        set: &Arc<DescriptorSet>,
        a: AttentionArgs,
        split: bool,
        reps: usize,
    ) -> Result<Duration, VulkanError> {
        self.write_position(&a)?;
        self.run(|r| a.record(r, &self.kernels.attention, set.clone(), split), reps)
    }

    /// Reads a device buffer of floats back.
    pub fn read_floats(&self, buf: &Subbuffer<[f32]>) -> Result<Vec<f32>, VulkanError> {
        let dst = host_buffer::<f32>(&self.ctx, buf.len(), BufferUsage::empty())?;
        self.run(|r| r.copy(buf.clone(), dst.clone()), 1)?;
        let v = dst.read().map_err(verr("reading a buffer"))?.to_vec();
        Ok(v)
    }

    /// The hybrid layers' kernels (for recording the delta rule with [`DeltaArgs::record`]).
    pub fn delta_kernels(&self) -> &DeltaKernels {
        &self.kernels.delta
    }

    /// The delta rule (`batched`: the block's rows in order; else the one-row step)
    /// with the set of [`KernelHarness::delta_state`], `reps` times.
    pub fn delta_rule(
        &self,
        set: &Arc<DescriptorSet>,
        a: DeltaArgs,
        batched: bool,
        reps: usize,
    ) -> Result<Duration, VulkanError> {
        self.run(|r| a.record(r, self.delta_kernels(), set.clone(), batched), reps)
    }
}
