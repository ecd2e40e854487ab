//! Recording kernels into one command buffer: each method binds a kernel, its own
//! descriptor set and the shared activation set, pushes its constants and dispatches.
//! Offsets are in f32 elements of the activation arena.

use std::sync::Arc;

use smoe_proto::DType;
use vulkano::buffer::Subbuffer;
use vulkano::command_buffer::{
    AutoCommandBufferBuilder, CommandBufferUsage, CopyBufferInfo, DispatchIndirectCommand,
    PrimaryAutoCommandBuffer,
};
use vulkano::descriptor_set::{DescriptorSet, WriteDescriptorSet};
use vulkano::pipeline::PipelineBindPoint;

use super::buffers::verr;
use super::context::VulkanContext;
use super::pipelines::{Kernel, Kernels, TypedKernels};
use super::timing::{lock, SharedTimer};
use super::VulkanError;

/// `out += result` instead of `out = result`.
pub const FLAG_ACCUMULATE: u32 = 1;
/// Token j's input row is `route[map_off + j] / map_div`.
pub const FLAG_GATHER: u32 = 2;
/// Token j's output row is `route[map_off + j]`.
pub const FLAG_SCATTER: u32 = 4;
/// One dispatch over `groups` experts, described by the table at `tab_off`.
pub const FLAG_TABLE: u32 = 8;
/// With [`FLAG_TABLE`], in an m=1 kernel of `k` lane groups per workgroup
/// ([`super::pipelines::Kernels::down_combine`]): lane group g takes table entry g, and the
/// workgroup adds the MoE combine of its rows (routing weights at `wt_off`) to the
/// residual at `out_off`, the bytes of the down projection followed by the `accumulate`
/// kernel.
pub const FLAG_COMBINE: u32 = 16;

/// Push constants of the matmul and gate/up kernels (see `shaders/matmul.comp`).
#[derive(Clone, Copy, Debug, Default)]
pub struct MatmulArgs {
    /// Output rows.
    pub rows: u32,
    /// Inputs per row.
    pub cols: u32,
    /// Tokens.
    pub m: u32,
    /// Element offset of row 0 in the (gate) weight binding.
    pub w_off: u32,
    /// Element offset of row 0 in the up weight binding.
    pub w2_off: u32,
    /// Activation offset of token 0's input.
    pub x_off: u32,
    /// Activation elements between inputs.
    pub x_stride: u32,
    /// Activation offset of the output (token 0, row 0).
    pub out_off: u32,
    /// Activation elements between outputs.
    pub out_stride: u32,
    /// Routing-buffer offset of the token map.
    pub map_off: u32,
    /// Divisor applied to gathered indices.
    pub map_div: u32,
    /// `FLAG_*` bits.
    pub flags: u32,
    /// Routing-buffer offset of the expert table (with [`FLAG_TABLE`]): per expert,
    /// (weight element offset added to `w_off` and `w2_off`, first pair, pair count).
    pub tab_off: u32,
    /// Table entries, one workgroup row each (with [`FLAG_TABLE`]; else 1 is used).
    pub groups: u32,
    /// The later members of a stack of matrices that share the input, stored one after
    /// another and multiplied as one (`out_at` in `shaders/matmul.comp`): (first row,
    /// activation offset of that row's output) each; a first row of 0 marks no member.
    pub stack: [(u32, u32); 3],
    /// Routing-buffer offset of the routing weights (with [`FLAG_COMBINE`]).
    pub wt_off: u32,
    /// Tokens one workgroup row of a token-batched product without [`FLAG_TABLE`] takes
    /// (a multiple of `BATCH_TOKENS`; 0: all of them). [`Recorder::matmul`] sets it.
    pub span: u32,
}

impl MatmulArgs {
    /// The push constants (`Params` in `shaders/matmul_io.glsl`): the arguments, then the
    /// bits of 2^23, which the slice kernels' quant decoding reads at run time.
    fn words(&self) -> [u32; 22] {
        let [s1, s2, s3] = self.stack.map(|(row, out)| if row == 0 { (u32::MAX, 0) } else { (row, out) });
        [
            self.rows,
            self.cols,
            self.m,
            self.w_off,
            self.w2_off,
            self.x_off,
            self.x_stride,
            self.out_off,
            self.out_stride,
            self.map_off,
            self.map_div.max(1),
            self.flags,
            self.tab_off,
            s1.0,
            s1.1,
            s2.0,
            s2.1,
            s3.0,
            s3.1,
            self.wt_off,
            self.span,
            0x4B00_0000,
        ]
    }

    fn groups(&self, k: &Kernel) -> [u32; 3] {
        if self.flags & FLAG_COMBINE != 0 {
            // The lane groups of a workgroup share its rows, one entry each.
            return [self.rows.div_ceil(k.rows_per_lane_group()), 1, 1];
        }
        let y = match (self.flags & FLAG_TABLE != 0, self.span) {
            (true, _) => self.groups,
            (false, 0) => 1,
            (false, span) => self.m.div_ceil(span),
        };
        [self.rows.div_ceil(k.rows_per_wg()), y, 1]
    }

    /// These arguments for kernel `k` over `m` tokens, batched: without [`FLAG_TABLE`]
    /// the tokens are split over workgroup rows until the dispatch has about
    /// [`SPLIT_WORKGROUPS`] workgroups. A workgroup loops over its tokens a pass at a time
    /// and reloads the weights for each pass, so the split costs no extra loads beyond
    /// cache; without it a narrow product (a router's 128 rows: 16 workgroups) left most
    /// of a GPU idle for a whole prefill chunk.
    fn split_tokens(mut self, k: &Kernel) -> Self {
        if self.flags & (FLAG_TABLE | FLAG_COMBINE) == 0 {
            let batches = self.m.div_ceil(BATCH_TOKENS);
            let splits =
                SPLIT_WORKGROUPS.div_ceil(self.rows.div_ceil(k.rows_per_wg())).clamp(1, batches.max(1));
            self.span = batches.div_ceil(splits) * BATCH_TOKENS;
        }
        self
    }
}

/// The span unit of a token split: a multiple of the tokens every token-batched kernel
/// takes per pass (`TB` in `shaders/matmul.comp`: 4 for float weights, 8 for block
/// formats), so a span is whole passes.
const BATCH_TOKENS: u32 = 8;

/// Workgroups a token-batched dense product is split to (see [`MatmulArgs::split_tokens`]).
/// On the H200 a 511-token prefill of the 3-layer q30 synth took 11,250-11,329 tok/s
/// unsplit, 14,718-14,950 at 512, 15,338-15,515 at 2,048 and 9,458-9,732 at 8,192 (bf16;
/// Q4_K_M 8,799-8,841 unsplit, 10,353-10,419 at 2,048), ids identical
/// (`bench/results/gpu-prefill-token-split-h200-2026-12-04.txt`).
const SPLIT_WORKGROUPS: u32 = 2048;

/// Which matmul-family product a dispatch computes; each has an m=1 kernel and a
/// token-batched sibling with the same summation order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Projection {
    /// `W · x` with dense weights (`matvec` / `matmul`).
    Dense,
    /// The fused gate/up + SiLU front half of an FFN (`gate_up` / `gate_up_batched`).
    GateUp,
    /// The expert down projection (`down`, tuned for its short rows / `matmul`).
    Down,
}

/// Rows from which an m=1 dense product uses the wide matvec (two rows per lane group):
/// an LM head. On the H200 (`bench/results/vulkan-h200-rows-2026-12-01.txt`) two rows took
/// the 151936 × 2048 Q4_K matvec from 176 to 125 us and Q6_K's from 338 to 311, bf16's
/// unchanged (146 / 143); at q_proj's 4096 rows Q6_K was slower with two.
pub const WIDE_ROWS: u32 = 32768;

impl Projection {
    /// The kernel of `t` that computes this product (`batched` or m=1) over `rows` rows.
    pub(super) fn kernel(self, t: &TypedKernels, batched: bool, rows: u32) -> &Kernel {
        match (self, batched) {
            (Projection::Dense, false) if rows >= WIDE_ROWS => &t.matvec_wide,
            (Projection::Dense, false) => &t.matvec,
            (Projection::Down, false) => &t.down,
            (Projection::Dense | Projection::Down, true) => &t.matmul,
            (Projection::GateUp, false) => &t.gate_up,
            (Projection::GateUp, true) => &t.gate_up_batched,
        }
    }
}

/// A matmul dispatch's name in the profile: its kernel and weight shape (rows × cols),
/// which tells the projections of one kernel apart.
fn shape_label(k: &Kernel, a: &MatmulArgs) -> String {
    format!("{} {}x{}", k.module, a.rows, a.cols)
}

/// A command buffer being recorded.
pub struct Recorder {
    /// The builder.
    pub cb: AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>,
    /// Commands are discarded: a kept recording of the same pass runs instead
    /// (`super::replay`).
    pub discard: bool,
    /// While profiling: the backend's timer, which stamps the end of every command.
    pub timer: Option<SharedTimer>,
    kernels: Arc<Kernels>,
    act_set: Arc<DescriptorSet>,
}

/// Values per block of the greedy choice's first kernel (`BLOCK` in `shaders/argmax.comp`).
pub const ARGMAX_BLOCK: u32 = 1024;

/// Arena floats the greedy choice of a row of `n` values needs for its blocks' pairs.
pub fn argmax_floats(n: usize) -> usize {
    2 * n.div_ceil(ARGMAX_BLOCK as usize)
}

/// Makes a descriptor set for `kernel`'s set 0 from buffers bound at 0, 1, ...
pub fn set0(
    ctx: &VulkanContext,
    kernel: &Kernel,
    buffers: &[Subbuffer<[u8]>],
) -> Result<Arc<DescriptorSet>, VulkanError> {
    DescriptorSet::new(
        ctx.descriptors.clone(),
        kernel.set0(),
        buffers.iter().enumerate().map(|(i, b)| WriteDescriptorSet::buffer(i as u32, b.clone())),
        [],
    )
    .map_err(verr("creating a descriptor set"))
}

/// Bytes per unit of the matmul kernels' weight offsets (`w_off`, `w2_off`) for weights
/// of `dtype`: the element size of the float types, one byte for the block formats (whose
/// rows are runs of blocks). The expert table's offsets are bytes for every type.
pub fn weight_unit(dtype: DType) -> u64 {
    if dtype.is_block() {
        1
    } else {
        dtype.row_bytes(1).expect("a float type stores single elements") as u64
    }
}

impl Recorder {
    /// Starts a command buffer on the compute queue, submitted once or (`usage`
    /// `MultipleSubmit`) again and again.
    pub fn new(
        ctx: &VulkanContext,
        kernels: Arc<Kernels>,
        act_set: Arc<DescriptorSet>,
        usage: CommandBufferUsage,
    ) -> Result<Self, VulkanError> {
        let cb =
            AutoCommandBufferBuilder::primary(ctx.commands.clone(), ctx.compute.queue_family_index(), usage)
                .map_err(verr("starting a command buffer"))?;
        Ok(Recorder { cb, kernels, act_set, discard: false, timer: None })
    }

    /// The command buffer a timestamp goes into: none while the commands are discarded.
    pub fn stampable(&mut self) -> Option<&mut AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>> {
        (!self.discard).then_some(&mut self.cb)
    }

    /// Records one dispatch of `kernel`.
    pub fn dispatch<const N: usize>(
        &mut self,
        kernel: &Kernel,
        set: Option<Arc<DescriptorSet>>,
        push: [u32; N],
        groups: [u32; 3],
    ) -> Result<(), VulkanError> {
        self.dispatch_as(kernel, set, push, groups, || kernel.module.clone())
    }

    /// [`Self::dispatch`], the profile naming it `label()`.
    fn dispatch_as<const N: usize>(
        &mut self,
        kernel: &Kernel,
        set: Option<Arc<DescriptorSet>>,
        push: [u32; N],
        groups: [u32; 3],
        label: impl FnOnce() -> String,
    ) -> Result<(), VulkanError> {
        if self.discard {
            return Ok(());
        }
        self.bind(kernel, set, push)?;
        // SAFETY: every index a kernel forms is bounded by the push constants, which the
        // callers derive from the sizes the buffers were allocated with.
        unsafe { self.cb.dispatch(groups) }.map_err(verr("recording a dispatch"))?;
        self.stamp(label)
    }

    /// While profiling, stamps the end of the command just recorded as kernel `label()`'s.
    fn stamp(&mut self, label: impl FnOnce() -> String) -> Result<(), VulkanError> {
        match &self.timer {
            Some(t) => lock(t).kernel(&label(), &mut self.cb),
            None => Ok(()),
        }
    }

    /// Binds `kernel`, its set 0 (`set`) and the activation set, and pushes `push`.
    fn bind<const N: usize>(
        &mut self,
        kernel: &Kernel,
        set: Option<Arc<DescriptorSet>>,
        push: [u32; N],
    ) -> Result<(), VulkanError> {
        let e = verr("recording a dispatch");
        self.cb.bind_pipeline_compute(kernel.pipeline.clone()).map_err(&e)?;
        let (first, sets) = match set {
            Some(s) => (0, vec![s, self.act_set.clone()]),
            None => (1, vec![self.act_set.clone()]),
        };
        self.cb
            .bind_descriptor_sets(PipelineBindPoint::Compute, kernel.layout.clone(), first, sets)
            .map_err(&e)?;
        self.cb.push_constants(kernel.layout.clone(), 0, push).map_err(&e)?;
        Ok(())
    }

    /// One `p` product with the m=1 kernel over the experts of a [`FLAG_TABLE`] table
    /// in weights bound in `set`, its workgroup counts read on the device from `sizes`
    /// (written by an earlier kernel: a device-routed step's table sizes).
    pub fn matmul_indirect(
        &mut self,
        p: Projection,
        dtype: DType,
        set: Arc<DescriptorSet>,
        a: MatmulArgs,
        sizes: Subbuffer<[DispatchIndirectCommand]>,
    ) -> Result<(), VulkanError> {
        if self.discard {
            return Ok(());
        }
        let k = p.kernel(self.kernels.typed(dtype)?, false, a.rows).clone();
        self.bind(&k, Some(set), a.words())?;
        // SAFETY: as `dispatch`; the table entries and sizes come from `route.comp`, which
        // writes at most k entries per buffer and counts of at most k.
        unsafe { self.cb.dispatch_indirect(sizes) }.map_err(verr("recording an indirect dispatch"))?;
        self.stamp(|| shape_label(&k, &a))
    }

    /// One `p` product over `a.rows` rows of the weights bound in `set`: the token-batched
    /// kernel (`batched`) or the m=1 one, which give the same bytes.
    pub fn matmul(
        &mut self,
        p: Projection,
        dtype: DType,
        batched: bool,
        set: Arc<DescriptorSet>,
        a: MatmulArgs,
    ) -> Result<(), VulkanError> {
        let k = p.kernel(self.kernels.typed(dtype)?, batched, a.rows).clone();
        let a = if batched { a.split_tokens(&k) } else { a };
        self.dispatch_as(&k, Some(set), a.words(), a.groups(&k), || shape_label(&k, &a))
    }

    /// A dense product of a `dtype` matrix bound in `set`: [`Self::matmul`], or for a
    /// matrix in its padded block layout (`padded`; `super::buffers::Q6K_PADDED_BLOCK`)
    /// the m=1 product by the padded kernel, the same bytes. Padded matrices have no
    /// batched products.
    pub fn dense(
        &mut self,
        dtype: DType,
        padded: bool,
        batched: bool,
        set: Arc<DescriptorSet>,
        a: MatmulArgs,
    ) -> Result<(), VulkanError> {
        if !padded {
            return self.matmul(Projection::Dense, dtype, batched, set, a);
        }
        let kernels = match (&self.kernels.typed(dtype)?.padded, batched) {
            (Some(k), false) => k,
            (Some(_), true) => {
                return Err(VulkanError::Unsupported(format!(
                    "a batched product of a {dtype} matrix in the padded layout (only LM heads are padded)"
                )))
            }
            (None, _) => return Err(VulkanError::Unsupported(format!("a padded layout of {dtype} weights"))),
        };
        let k = kernels[usize::from(a.rows >= WIDE_ROWS)].clone();
        self.dispatch_as(&k, Some(set), a.words(), a.groups(&k), || shape_label(&k, &a))
    }

    /// The down projection of a decode step's experts combined into the residual in one
    /// dispatch: `kernel` is [`super::pipelines::Kernels::down_combine`]'s for the
    /// experts' `k` and weight type, `a` carries [`FLAG_COMBINE`] and [`FLAG_TABLE`].
    pub fn down_combine(
        &mut self,
        kernel: &Kernel,
        set: Arc<DescriptorSet>,
        a: MatmulArgs,
    ) -> Result<(), VulkanError> {
        self.dispatch_as(kernel, Some(set), a.words(), a.groups(kernel), || {
            format!("{} +combine", shape_label(kernel, &a))
        })
    }

    /// A device-routed decode step's fused front (router, ranking and gate/up in one
    /// dispatch of `groups` workgroups, all resident at once): `kernel` is
    /// [`super::pipelines::Kernels::gate_up_front`]'s, `a` the gate/up's arguments over
    /// `a.groups` experts, `front` the router's and ranking's push constants
    /// (`super::device_route::RouteTableArgs::front_words`), `norm` for a front that
    /// forms its input's RMSNorm (`a.x_off` the residual's): where it stores the normed
    /// row, and the norm's epsilon.
    pub fn gate_up_front(
        &mut self,
        kernel: &Kernel,
        set: Arc<DescriptorSet>,
        a: MatmulArgs,
        front: [u32; 8],
        norm: Option<(u32, f32)>,
        groups: u32,
    ) -> Result<(), VulkanError> {
        let mut push = [0; 32];
        push[..22].copy_from_slice(&a.words());
        push[22..30].copy_from_slice(&front);
        if let Some((out, eps)) = norm {
            push[30..].copy_from_slice(&[out, eps.to_bits()]);
        }
        self.dispatch_as(kernel, Some(set), push, [groups, 1, 1], || shape_label(kernel, &a))
    }

    /// The embedding lookup of `a.m` tokens from a table of `dtype` bound in `set`
    /// (`shaders/matmul.comp` with `EMBED`): the tokens whose ids (at `a.map_off` of the
    /// routing buffer) fall in the bound rows `a.x_off .. a.x_off + a.rows` get their row
    /// (`a.cols` elements) at `a.out_off + t · a.out_stride`.
    pub fn embed(&mut self, dtype: DType, set: Arc<DescriptorSet>, a: MatmulArgs) -> Result<(), VulkanError> {
        let k = self.kernels.typed(dtype)?.embed.clone().ok_or_else(|| {
            VulkanError::Unsupported(format!("no embedding kernel for {dtype} rows (the host widens them)"))
        })?;
        // One invocation per chunk of 8 elements, and one for a float type's tail.
        let groups = [(a.cols / 8 + 1).div_ceil(256), a.m, 1];
        self.dispatch(&k, Some(set), a.words(), groups)
    }

    /// RMSNorm of `m` rows of `n` elements.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm(
        &mut self,
        set: Arc<DescriptorSet>,
        n: u32,
        m: u32,
        in_off: u32,
        in_stride: u32,
        out_off: u32,
        out_stride: u32,
        eps: f32,
    ) -> Result<(), VulkanError> {
        let k = self.kernels.rmsnorm.clone();
        self.dispatch(&k, Some(set), [n, in_off, in_stride, out_off, out_stride, eps.to_bits()], [1, m, 1])
    }

    /// The greedy choice of the `n` values at arena offset `in_off`
    /// (`shaders/argmax.comp`): each block of [`ARGMAX_BLOCK`] values' best pair goes to
    /// `part_off` ([`argmax_floats`]), the chosen index to word `io_out` of the readback
    /// buffer bound in `io_set`.
    pub fn argmax(
        &mut self,
        io_set: Arc<DescriptorSet>,
        n: u32,
        in_off: u32,
        part_off: u32,
        io_out: u32,
    ) -> Result<(), VulkanError> {
        let blocks = n.div_ceil(ARGMAX_BLOCK);
        let push = [n, in_off, part_off, blocks, io_out];
        let k = self.kernels.argmax.clone();
        self.dispatch(&k, None, push, [blocks, 1, 1])?;
        let k = self.kernels.argmax_final.clone();
        self.dispatch(&k, Some(io_set), push, [1, 1, 1])
    }

    /// Copies `src` to `dst`.
    pub fn copy<T: vulkano::buffer::BufferContents + ?Sized>(
        &mut self,
        src: Subbuffer<T>,
        dst: Subbuffer<T>,
    ) -> Result<(), VulkanError> {
        if !self.discard {
            self.cb.copy_buffer(CopyBufferInfo::buffers(src, dst)).map_err(verr("recording a copy"))?;
            self.stamp(|| "copy".into())?;
        }
        Ok(())
    }
}
