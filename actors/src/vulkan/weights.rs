//! The resident weights on the device: every matrix the model projects with, uploaded
//! once and split into bindable row ranges with a descriptor set each; every norm
//! vector with its set; the RoPE tables. Keyed by the tensor's place in the vault, so
//! the backend needs no knowledge of the model's layer structure.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::Arc;

use smoe_proto::DType;

use vulkano::buffer::{BufferUsage, Subbuffer};
use vulkano::descriptor_set::DescriptorSet;

use super::buffers::{device_buffer, upload, upload_f32, DeviceWeight};
use super::context::VulkanContext;
use super::pipelines::Kernels;
use super::record::{set0, MatmulArgs, Recorder};
use super::VulkanError;
use crate::model::Model;
use crate::vault::TensorRef;

/// A resident weight matrix with one descriptor set per bound row range.
pub struct BoundWeight {
    /// The matrix.
    pub w: DeviceWeight,
    /// One set per range of `w`.
    pub sets: Vec<Arc<DescriptorSet>>,
}

/// Matrices that share their input (an attention layer's q, k, v and output gate, or
/// its leading members of one type) stored one after another in one buffer and bound as
/// one range, so that an m=1 projection by all of them is one dispatch; each member is
/// also bound alone (its own rows).
pub struct Stack {
    /// The stacked matrix.
    pub w: BoundWeight,
    /// First row of each member after the first.
    pub splits: Vec<u32>,
}

impl Stack {
    /// Uploads the leading members of `group` that share the first one's type and
    /// column count (a Q4_K_M file's q and k where its v is Q6_K) stacked, or `None`
    /// where they cannot be: fewer than two, more than four, a member whose rows do not
    /// start at a bindable offset, or more rows than one bound range holds. The members
    /// after them are not part of the stack.
    fn upload(
        ctx: &Arc<VulkanContext>,
        kernels: &Kernels,
        model: &Model,
        group: &[&TensorRef],
    ) -> Result<Option<(Stack, Vec<BoundWeight>)>, VulkanError> {
        let mut views: Vec<_> = group.iter().map(|r| model.w(r)).collect();
        let Some((dtype, cols)) = views.first().map(|v| (v.dtype(), v.cols)) else { return Ok(None) };
        let lead = views.iter().take_while(|v| v.dtype() == dtype && v.cols == cols).count();
        views.truncate(lead);
        if !(2..=4).contains(&views.len()) {
            return Ok(None);
        }
        let align =
            ctx.device.physical_device().properties().min_storage_buffer_offset_alignment.as_devicesize();
        let mut offsets = Vec::with_capacity(views.len());
        let mut total = 0u64;
        for v in &views {
            offsets.push(total);
            total += v.bytes().len() as u64;
        }
        if !offsets.iter().all(|o| o.is_multiple_of(align.max(4))) {
            return Ok(None);
        }
        let buf = device_buffer::<u8>(ctx, (total + 4).next_multiple_of(16), BufferUsage::STORAGE_BUFFER)?;
        let rows: usize = views.iter().map(|v| v.rows).sum();
        let w = DeviceWeight::from_buffer(ctx, dtype, rows, cols, buf.clone(), false)?;
        if w.ranges.len() != 1 {
            return Ok(None);
        }
        for (v, &o) in views.iter().zip(&offsets) {
            upload(ctx, &buf.clone().slice(o..o + v.bytes().len() as u64), v.bytes())?;
        }
        let bind = |w: DeviceWeight| BoundWeight::bind(ctx, kernels, w);
        let ends = offsets.iter().skip(1).copied().chain([buf.len()]);
        let alone = views
            .iter()
            .zip(offsets.iter().zip(ends))
            .map(|(v, (&a, b))| {
                bind(DeviceWeight::from_buffer(ctx, dtype, v.rows, cols, buf.clone().slice(a..b), false)?)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let splits = views.iter().scan(0, |row, v| {
            *row += v.rows as u32;
            Some(*row)
        });
        let splits = splits.take(views.len() - 1).collect();
        Ok(Some((Stack { w: bind(w)?, splits }, alone)))
    }
}

/// A dense SwiGLU block's gate and up matrices bound together, per row range.
pub struct GateUp {
    /// ((first row, rows), set binding both ranges) per range.
    pub ranges: Vec<((u32, u32), Arc<DescriptorSet>)>,
}

/// Every resident tensor of a model on the device.
pub struct DeviceModel {
    mats: HashMap<usize, BoundWeight>,
    /// Stacks by their first member.
    stacks: HashMap<usize, Stack>,
    vecs: HashMap<usize, (Subbuffer<[u8]>, Arc<DescriptorSet>)>,
    gate_up: HashMap<(usize, usize), GateUp>,
    /// cos(pos · inv_freq) per position.
    pub rope_cos: Subbuffer<[u8]>,
    /// sin(pos · inv_freq) per position.
    pub rope_sin: Subbuffer<[u8]>,
}

impl DeviceModel {
    /// Uploads every resident matrix and vector of `model`, and the embedding table when
    /// its rows are looked up on the device ([`device_embeds`]).
    pub fn upload(ctx: &Arc<VulkanContext>, kernels: &Kernels, model: &Model) -> Result<Self, VulkanError> {
        let mut mats = HashMap::new();
        let mut stacks = HashMap::new();
        for group in model.input_groups() {
            if group.iter().any(|r| mats.contains_key(&r.key())) {
                continue;
            }
            // Members outside the stack (the `zip` stops at its last) are bound alone below.
            if let Some((stack, alone)) = Stack::upload(ctx, kernels, model, &group)? {
                mats.extend(group.iter().map(|r| r.key()).zip(alone));
                stacks.insert(group[0].key(), stack);
            }
        }
        let embed = device_embeds(model.w(&model.embed).dtype()).then_some(&model.embed);
        for r in model.matrices().chain(embed) {
            let Entry::Vacant(slot) = mats.entry(r.key()) else { continue };
            // A Q6_K LM head (a Q4_K_M or Q5_K_M file's) is only ever multiplied one row
            // at a time: its blocks are padded for the m=1 kernel's vector loads, unless
            // it is also the embedding table, which the lookup reads as stored.
            let w = model.w(r);
            let padded =
                r.key() == model.lm_head.key() && w.dtype() == DType::Q6K && r.key() != model.embed.key();
            slot.insert(BoundWeight::bind(ctx, kernels, DeviceWeight::upload(ctx, &w, padded)?)?);
        }
        let mut vecs = HashMap::new();
        for r in model.vectors() {
            if let Entry::Vacant(slot) = vecs.entry(r.key()) {
                let b = upload_f32(ctx, model.vec(r))?;
                let s = set0(ctx, &kernels.rmsnorm, std::slice::from_ref(&b))?;
                slot.insert((b, s));
            }
        }
        Ok(DeviceModel {
            mats,
            stacks,
            vecs,
            gate_up: HashMap::new(),
            rope_cos: upload_f32(ctx, &model.rope.cos)?,
            rope_sin: upload_f32(ctx, &model.rope.sin)?,
        })
    }

    /// Bytes of device memory the resident tensors take (a stack's buffer once).
    pub fn bytes(&self) -> u64 {
        let bufs = self.mats.values().filter_map(|m| m.w.ranges.first()).map(|r| r.bytes.buffer());
        let bufs: HashMap<_, u64> = bufs.map(|b| (Arc::as_ptr(b), b.size())).collect();
        let vecs = self.vecs.values().map(|v| v.0.buffer().size());
        bufs.values().copied().chain(vecs).sum::<u64>() + self.rope_cos.size() + self.rope_sin.size()
    }

    /// The stack whose first member is `first`, if its group was stacked.
    pub fn stack(&self, first: &TensorRef) -> Option<&Stack> {
        self.stacks.get(&first.key())
    }

    /// The device copy of matrix `r`.
    pub fn matrix(&self, r: &TensorRef) -> Result<&BoundWeight, VulkanError> {
        self.mats.get(&r.key()).ok_or_else(|| missing(r))
    }

    /// The buffer and RMSNorm set of vector `r`.
    pub fn vector(&self, r: &TensorRef) -> Result<&(Subbuffer<[u8]>, Arc<DescriptorSet>), VulkanError> {
        self.vecs.get(&r.key()).ok_or_else(|| missing(r))
    }

    /// `gate` and `up` bound together for the fused SwiGLU kernel (made on first use).
    pub fn gate_up(
        &mut self,
        ctx: &VulkanContext,
        kernels: &Kernels,
        gate: &TensorRef,
        up: &TensorRef,
    ) -> Result<&GateUp, VulkanError> {
        let key = (gate.key(), up.key());
        if !self.gate_up.contains_key(&key) {
            let (g, u) = (&self.matrix(gate)?.w, &self.matrix(up)?.w);
            if g.dtype != u.dtype || g.ranges.len() != u.ranges.len() {
                return Err(VulkanError::Unsupported("gate and up projections differ in type".into()));
            }
            let ranges = g
                .ranges
                .iter()
                .zip(&u.ranges)
                .map(|(a, b)| {
                    let set =
                        set0(ctx, &kernels.typed(DType::F32)?.gate_up, &[a.bytes.clone(), b.bytes.clone()])?;
                    Ok(((a.row0 as u32, a.rows as u32), set))
                })
                .collect::<Result<_, VulkanError>>()?;
            self.gate_up.insert(key, GateUp { ranges });
        }
        Ok(&self.gate_up[&key])
    }
}

/// Whether embedding rows of `dtype` are looked up on the device (`Recorder::embed`):
/// every type but f32 and bf16, whose rows the host widens and copies in.
pub fn device_embeds(dtype: DType) -> bool {
    !matches!(dtype, DType::F32 | DType::Bf16)
}

impl BoundWeight {
    /// `w` with a descriptor set for each of its ranges.
    fn bind(
        ctx: &Arc<VulkanContext>,
        kernels: &Kernels,
        w: DeviceWeight,
    ) -> Result<BoundWeight, VulkanError> {
        let k = &kernels.typed(DType::F32)?.matvec;
        let sets = w
            .ranges
            .iter()
            .map(|rg| set0(ctx, k, std::slice::from_ref(&rg.bytes)))
            .collect::<Result<_, _>>()?;
        Ok(BoundWeight { w, sets })
    }

    /// Records this matrix's product over every bound row range (`a.rows`, `a.cols` and
    /// the output offset are set per range).
    pub fn record(&self, rec: &mut Recorder, mut a: MatmulArgs, batched: bool) -> Result<(), VulkanError> {
        let base = a.out_off;
        for (rg, set) in self.w.ranges.iter().zip(&self.sets) {
            a.rows = rg.rows as u32;
            a.cols = self.w.cols as u32;
            a.out_off = base + rg.row0 as u32;
            rec.dense(self.w.dtype, self.w.padded, batched, set.clone(), a)?;
        }
        Ok(())
    }

    /// Records the embedding lookup of `a.m` tokens (ids at `a.map_off` of the routing
    /// buffer) into `a.out_off`, one dispatch per bound row range.
    pub fn embed(&self, rec: &mut Recorder, mut a: MatmulArgs) -> Result<(), VulkanError> {
        for (rg, set) in self.w.ranges.iter().zip(&self.sets) {
            a.rows = rg.rows as u32;
            a.cols = self.w.cols as u32;
            a.x_off = rg.row0 as u32;
            rec.embed(self.w.dtype, set.clone(), a)?;
        }
        Ok(())
    }
}

fn missing(r: &TensorRef) -> VulkanError {
    VulkanError::Unsupported(format!("a tensor at resident offset {} was not uploaded", r.key()))
}
