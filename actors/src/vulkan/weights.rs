//! The resident weights on the device: every matrix the model projects with, uploaded
//! once and split into bindable row ranges with a descriptor set each; every norm
//! vector with its set; the RoPE tables. Keyed by the tensor's place in the vault, so
//! the backend needs no knowledge of the model's layer structure.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::Arc;

use smoe_proto::DType;

use vulkano::buffer::Subbuffer;
use vulkano::descriptor_set::DescriptorSet;

use super::buffers::{upload_f32, DeviceWeight};
use super::context::VulkanContext;
use super::pipelines::Kernels;
use super::record::{set0, MatmulArgs, Projection, Recorder};
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

/// A dense SwiGLU block's gate and up matrices bound together, per row range.
pub struct GateUp {
    /// ((first row, rows), set binding both ranges) per range.
    pub ranges: Vec<((u32, u32), Arc<DescriptorSet>)>,
}

/// Every resident tensor of a model on the device.
pub struct DeviceModel {
    mats: HashMap<usize, BoundWeight>,
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
        let embed = device_embeds(model.w(&model.embed).dtype()).then_some(&model.embed);
        for r in model.matrices().chain(embed) {
            let Entry::Vacant(slot) = mats.entry(r.key()) else { continue };
            let w = DeviceWeight::upload(ctx, &model.w(r))?;
            let k = &kernels.typed(DType::F32)?.matvec;
            let sets = w
                .ranges
                .iter()
                .map(|rg| set0(ctx, k, std::slice::from_ref(&rg.bytes)))
                .collect::<Result<_, _>>()?;
            slot.insert(BoundWeight { w, sets });
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
            vecs,
            gate_up: HashMap::new(),
            rope_cos: upload_f32(ctx, &model.rope.cos)?,
            rope_sin: upload_f32(ctx, &model.rope.sin)?,
        })
    }

    /// Bytes of device memory the resident tensors take.
    pub fn bytes(&self) -> u64 {
        let mats = self.mats.values().filter_map(|m| m.w.ranges.first()).map(|r| r.bytes.buffer().size());
        let vecs = self.vecs.values().map(|v| v.0.buffer().size());
        mats.chain(vecs).sum::<u64>() + self.rope_cos.size() + self.rope_sin.size()
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
    /// Records this matrix's product over every bound row range (`a.rows`, `a.cols` and
    /// the output offset are set per range).
    pub fn record(&self, rec: &mut Recorder, mut a: MatmulArgs, batched: bool) -> Result<(), VulkanError> {
        let base = a.out_off;
        for (rg, set) in self.w.ranges.iter().zip(&self.sets) {
            a.rows = rg.rows as u32;
            a.cols = self.w.cols as u32;
            a.out_off = base + rg.row0 as u32;
            rec.matmul(Projection::Dense, self.w.dtype, batched, set.clone(), a)?;
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
