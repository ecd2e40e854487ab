//! The VRAM tier: device-local copies of experts, a cache level between the host ring
//! and the kernels on devices with their own memory. A kernel reading a ring slot in
//! host-visible memory reads it across the bus (~51 GB/s on an H200); reading a
//! device-local copy runs at memory speed (~4.4 TB/s). While the tier is on, every
//! expert claim the kernels multiply goes through it: a *hit* reads the copy the tier
//! holds, a *fill* copies the claimed ring slot into a tier slot (a GPU copy recorded in
//! the same command stream, ahead of the kernels that read it) and the kernels read the
//! copy. Hits + fills = expert claims on the GPU.
//!
//! Slots come in size classes split exactly as the ring's ([`crate::ring::classes`]):
//! a quantised vault whose layers store their experts at different blob strides gets one
//! class per stride, each a few device-local buffers, and a layer's experts live only in
//! its class. Each class refills the slot its [`Replacement`] ranks first (by recency or
//! by claim frequency, whichever a duel of the two finds better on the recent claims),
//! never one the current batch placed: when every slot of a class is
//! taken by the batch, the caller runs the batch so far and starts a new one (the slots
//! it used may then be refilled: the device orders the refill after the kernels that
//! read them).
//!
//! A class with a slot for every expert of its layers never evicts: each expert has a
//! *home* slot (its layer's rank in the class · experts per layer + expert), and a class
//! buffer holds whole layers where one fits, so a device-routed step of a layer reads
//! one buffer (one gate/up and one down dispatch) however many buffers the class has.
//!
//! A fill is only trusted once the host has waited for the work that copied it: if that
//! work is abandoned (a failed pass), the slots it filled go back to empty. Expert
//! weights are immutable, so a filled slot is never stale and no tier size changes a
//! byte of the result.

use metrics::{Counter, Gauge};
use smoe_proto::metric_names::{
    LABEL_STATE, VRAM_BYTES, VRAM_EVICTIONS, VRAM_FILLS, VRAM_FREQUENCY_EVICTIONS, VRAM_HITS, VRAM_SLOTS,
};
use smoe_proto::stats::VRAM_SLOT_STATES;
use smoe_proto::{ExpertKey, VramSnapshot};
use vulkano::buffer::{BufferUsage, Subbuffer};

use super::buffers::device_buffer;
use super::context::VulkanContext;
use super::replacement::Replacement;
use super::VulkanError;
use crate::engine::VramSize;
use crate::model::Model;
use crate::ring::budget::kv_cache_bytes;
use crate::ring::classes::{plan_for, RingSize};
use crate::ring::RingError;

/// No slot, no expert, or the end of a list.
const NONE: u32 = u32::MAX;
/// Smallest margin the default size leaves free on the device, in bytes.
const MIN_MARGIN: u64 = 512 << 20;
/// Share of the device heap the default size leaves free (1 / this).
const MARGIN_SHARE: u64 = 20;

/// Where a claimed expert's kernels read it, as [`VramTier::place`] decides.
pub enum Placement {
    /// The tier holds the expert: the kernels read this copy.
    Hit(Subbuffer<[u8]>),
    /// The expert was given this slot range: the caller copies the ring slot into it
    /// before the kernels that read it.
    Fill(Subbuffer<[u8]>),
    /// Every slot of the expert's class was placed by the current batch: run the batch
    /// so far, start a new one and place the expert again.
    Full,
}

/// One slot of the tier.
struct Slot {
    /// The expert it holds (layer · experts per layer + expert), or [`NONE`].
    expert: u32,
    /// The batch that last placed it (it cannot be refilled during that batch).
    batch: u64,
    /// Read or written by recorded work the host has not waited for.
    busy: bool,
    /// Filled by recorded work the host has not waited for.
    unconfirmed: bool,
}

/// The slots of one blob stride.
struct Class {
    /// Bytes of one slot (the blob stride of the class's layers).
    stride: u64,
    /// Device-local buffers, each holding `per_buffer` slots (the last one may hold fewer).
    buffers: Vec<Subbuffer<[u8]>>,
    per_buffer: u32,
    /// Index of the class's first slot in [`VramTier::slots`].
    first: u32,
    /// Which slot to refill; `None` where every expert has a home slot.
    replacement: Option<Replacement>,
}

/// The Prometheus handles the tier updates (no-ops without a recorder).
struct Published {
    hits: Counter,
    fills: Counter,
    evictions: Counter,
    frequency_evictions: Counter,
    slots: [Gauge; 3],
    /// The counts already added to the counters.
    sent: VramSnapshot,
}

/// The VRAM tier of one Vulkan pass.
pub struct VramTier {
    classes: Vec<Class>,
    /// Per decoder layer, its class (or [`NONE`] for a layer without routed experts).
    layer_class: Vec<u32>,
    experts_per_layer: usize,
    /// Per decoder layer, the home slot of its expert 0 (experts e at home + e), or
    /// [`NONE`] where its class cannot hold every expert of its layers.
    home: Vec<u32>,
    /// Per expert (layer · experts per layer + expert), the slot holding it or [`NONE`].
    slot_of: Vec<u32>,
    slots: Vec<Slot>,
    /// Slots marked busy since the last host wait.
    busy: Vec<u32>,
    /// The current batch (see [`VramTier::begin_batch`]).
    batch: u64,
    /// Changes of `slot_of` so far (see [`VramTier::version`]).
    version: u64,
    stats: VramSnapshot,
    published: Published,
}

/// How a setting is named in errors (the config key and the flag).
const KEY: &str = "`vram_bytes` (--vram-bytes)";

/// The size of the device's largest device-local memory heap (or of its largest heap).
fn device_heap(ctx: &VulkanContext) -> u64 {
    let heaps = &ctx.info.heaps;
    let local = heaps.iter().filter(|h| h.1).map(|h| h.0).max();
    local.or_else(|| heaps.iter().map(|h| h.0).max()).unwrap_or(0)
}

/// What a heap of `heap` bytes can spare for the tier beside `used` bytes, and the
/// margin it keeps free: max([`MIN_MARGIN`], 1/[`MARGIN_SHARE`] of the heap).
fn spare(heap: u64, used: u64) -> (u64, u64) {
    let margin = MIN_MARGIN.max(heap / MARGIN_SHARE);
    (heap.saturating_sub(used.saturating_add(margin)), margin)
}

impl VramTier {
    /// The tier of `size` for `model` on `ctx`'s device, where the pass already holds
    /// `held` bytes of device memory; `None` when the tier is off (0 bytes, a model
    /// without routed experts, or a default that leaves no room). An explicit size
    /// larger than the device's heap or too small for one slot of every size class is
    /// an error naming the setting.
    pub fn new(
        ctx: &VulkanContext,
        model: &Model,
        size: VramSize,
        held: u64,
    ) -> Result<Option<VramTier>, VulkanError> {
        let manifest = model.vault.manifest();
        if manifest.experts.layers.is_empty() {
            return Ok(None);
        }
        let heap = device_heap(ctx);
        let bytes = match size {
            VramSize::Bytes(0) => return Ok(None),
            VramSize::Bytes(b) if b > heap => {
                return Err(VulkanError::Setting(format!(
                "{KEY}: {b} bytes is more than the device's memory heap ({heap} bytes); lower it, or leave \
                     it out to use what the device can spare"
            )))
            }
            VramSize::Bytes(b) => b,
            VramSize::Auto { .. } if ctx.info.unified_memory => return Ok(None),
            VramSize::Auto { sessions } => {
                // A hybrid session keeps one more copy of its states while its decode steps
                // route on the device (counted as a snapshot).
                let copies = model.state_snapshots + 1;
                let kv = kv_cache_bytes(&model.cfg, model.max_context, copies) * sessions as u64;
                let (spare, margin) = spare(heap, held + kv);
                tracing::info!(
                    "VRAM tier sized from the device: heap {heap} − {held} held by the pass − {kv} of KV for \
                     {sessions} session(s) − margin {margin} = {spare} bytes"
                );
                spare
            }
        };
        let plan = match plan_for(manifest, RingSize::Bytes(bytes)) {
            Ok(p) => p,
            Err(RingError::NoSlots { bytes: least, classes }) if matches!(size, VramSize::Bytes(_)) => {
                return Err(VulkanError::Setting(format!(
                    "{KEY}: {bytes} bytes holds no expert: the tier needs at least {least} bytes (one slot of \
                     each of the vault's {classes} blob sizes); raise it, or set 0 to turn the tier off"
                )))
            }
            Err(e) if matches!(size, VramSize::Bytes(_)) => {
                return Err(VulkanError::Setting(format!("{KEY}: {e}")))
            }
            Err(_) => {
                tracing::info!("VRAM tier off: {bytes} bytes spare hold no slot of every size class");
                return Ok(None);
            }
        };
        let per_layer = model.cfg.num_experts;
        // A buffer is bound whole by the fused decode kernels: at most one binding's range.
        let max_buffer = ctx.info.max_allocation.unwrap_or(u64::MAX).min(ctx.info.max_storage_buffer_range);
        let mut tier = VramTier {
            classes: Vec::with_capacity(plan.len()),
            layer_class: vec![NONE; model.cfg.num_hidden_layers],
            home: vec![NONE; model.cfg.num_hidden_layers],
            experts_per_layer: per_layer,
            slot_of: vec![NONE; model.cfg.num_hidden_layers * per_layer],
            slots: Vec::new(),
            busy: Vec::new(),
            batch: 0,
            version: 0,
            stats: VramSnapshot::default(),
            published: Published {
                hits: metrics::counter!(VRAM_HITS),
                fills: metrics::counter!(VRAM_FILLS),
                evictions: metrics::counter!(VRAM_EVICTIONS),
                frequency_evictions: metrics::counter!(VRAM_FREQUENCY_EVICTIONS),
                slots: VRAM_SLOT_STATES.map(|s| metrics::gauge!(VRAM_SLOTS, LABEL_STATE => s)),
                sent: VramSnapshot::default(),
            },
        };
        for c in &plan {
            let stride = c.stride as u64;
            let homes = c.slots >= c.layers.len() * per_layer;
            let per_buffer = slots_per_buffer(max_buffer, stride, per_layer, homes);
            let mut buffers = Vec::with_capacity(c.slots.div_ceil(per_buffer));
            let mut left = c.slots;
            while left > 0 {
                let n = left.min(per_buffer);
                let buf = device_buffer::<u8>(ctx, n as u64 * stride, BufferUsage::STORAGE_BUFFER).map_err(|e| {
                    VulkanError::Setting(format!(
                        "{KEY}: cannot allocate {bytes} bytes of device memory for the VRAM tier ({e}); lower it"
                    ))
                })?;
                buffers.push(buf);
                left -= n;
            }
            let first = tier.slots.len() as u32;
            let n = c.slots as u32;
            tier.slots.extend((0..n).map(|_| Slot {
                expert: NONE,
                batch: 0,
                busy: false,
                unconfirmed: false,
            }));
            for (rank, &l) in c.layers.iter().enumerate() {
                tier.layer_class[l] = tier.classes.len() as u32;
                if homes {
                    tier.home[l] = first + (rank * per_layer) as u32;
                }
            }
            tier.classes.push(Class {
                stride,
                buffers,
                per_buffer: per_buffer as u32,
                first,
                replacement: (!homes).then(|| Replacement::new(first..first + n)),
            });
        }
        tier.stats.bytes = plan.iter().map(|c| (c.slots * c.stride) as u64).sum();
        tier.stats.slots[0] = tier.slots.len() as u64;
        metrics::gauge!(VRAM_BYTES).set(tier.stats.bytes as f64);
        tier.publish();
        tracing::info!(
            "VRAM tier: {} bytes in {}",
            tier.stats.bytes,
            plan.iter()
                .map(|c| format!("{} slots of {} bytes", c.slots, c.stride))
                .collect::<Vec<_>>()
                .join(" + ")
        );
        Ok(Some(tier))
    }

    /// Counters and slot states now.
    pub fn snapshot(&self) -> VramSnapshot {
        self.stats
    }

    /// Counts the changes of which expert each slot holds (fills, and fills undone by
    /// [`VramTier::abandon`]): a copy of [`VramTier::slot_words`] stays current while
    /// this is unchanged.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Whether the tier holds every expert of every layer it serves at once, in at
    /// most `max_buffers` buffers per size class of at most `max_binding` bytes each:
    /// what device-routed steps need (a tier that holds a share of the experts would
    /// miss on nearly every step).
    pub fn holds_all(&self, max_binding: u64, max_buffers: usize) -> bool {
        self.classes.iter().enumerate().all(|(ci, c)| {
            let layers = self.layer_class.iter().filter(|&&lc| lc == ci as u32).count();
            let slots = self.slots_of(ci);
            slots as usize >= layers * self.experts_per_layer
                && c.buffers.len() <= max_buffers
                && c.buffers.iter().all(|b| b.size() <= max_binding)
        })
    }

    /// Slots of class `c`.
    fn slots_of(&self, c: usize) -> u32 {
        let next = self.classes.get(c + 1).map_or(self.slots.len() as u32, |n| n.first);
        next - self.classes[c].first
    }

    /// The device-local buffers that may hold decoder layer `layer`'s experts (none for
    /// a layer the tier does not serve): those its home slots span, else its class's.
    pub fn layer_buffers(&self, layer: usize) -> &[Subbuffer<[u8]>] {
        match self.layer_class.get(layer) {
            Some(&c) if c != NONE => &self.classes[c as usize].buffers[self.layer_span(layer)],
            _ => &[],
        }
    }

    /// The indices among its class's buffers of [`Self::layer_buffers`] (a layer the
    /// tier serves).
    fn layer_span(&self, layer: usize) -> std::ops::RangeInclusive<usize> {
        let class = &self.classes[self.layer_class[layer] as usize];
        match self.home[layer] {
            NONE => 0..=class.buffers.len() - 1,
            h => {
                let (first, per) = ((h - class.first) as usize, class.per_buffer as usize);
                first / per..=(first + self.experts_per_layer - 1) / per
            }
        }
    }

    /// Writes the slot table the device reads: for each expert (layer · experts per
    /// layer + expert), two words to `out`: the index among its layer's
    /// [`Self::layer_buffers`] of the buffer holding its filled slot and the slot's byte
    /// offset there, or (`u32::MAX`, 0) for an expert without a confirmed copy.
    pub fn slot_words(&self, out: &mut [u32]) {
        for (flat, w) in out.chunks_exact_mut(2).enumerate().take(self.slot_of.len()) {
            let s = self.slot_of[flat];
            w.copy_from_slice(&match s != NONE && !self.slots[s as usize].unconfirmed {
                true => {
                    let layer = flat / self.experts_per_layer;
                    let class = &self.classes[self.layer_class[layer] as usize];
                    let i = s - class.first;
                    let b = i / class.per_buffer - *self.layer_span(layer).start() as u32;
                    [b, ((i % class.per_buffer) as u64 * class.stride) as u32]
                }
                false => [NONE, 0],
            });
        }
    }

    /// Counts the reads of a device-routed step of decoder layer `layer`, which found
    /// `experts` in the tier: hits, each a claim its class's replacement counts.
    pub fn touch(&mut self, layer: usize, experts: &[u16]) {
        let Some(&c) = self.layer_class.get(layer).filter(|&&c| c != NONE) else { return };
        for &e in experts {
            let flat = (layer * self.experts_per_layer + e as usize) as u32;
            let s = self.slot_of[flat as usize];
            if s != NONE {
                self.stats.hits += 1;
                self.count_claim(c as usize, s, flat);
            }
        }
    }

    /// Starts a batch: slots placed from now on stay until the next batch starts.
    pub fn begin_batch(&mut self) {
        self.batch += 1;
    }

    /// Where the kernels read expert `key` (whose claimed blob is `len` bytes: the range
    /// returned has that length): a hit, a slot to fill, or [`Placement::Full`]. `None`
    /// for a layer the tier does not serve.
    pub fn place(&mut self, key: ExpertKey, len: u64) -> Option<Placement> {
        let (layer, e) = (key.layer as usize, key.expert as usize);
        let c = *self.layer_class.get(layer).filter(|&&c| c != NONE)? as usize;
        let flat = layer * self.experts_per_layer + e;
        let s = self.slot_of[flat];
        if s != NONE {
            self.stats.hits += 1;
            self.use_slot(c, s, flat as u32);
            return Some(Placement::Hit(self.range(c, s, len)));
        }
        // The slot the replacement ranks first among those the current batch has not
        // placed, or in a class without one, the expert's home slot (which no other
        // expert uses).
        let v = match &self.classes[c].replacement {
            Some(r) => match r.victim(|s| self.slots[s as usize].batch != self.batch) {
                Some(v) => v,
                None => return Some(Placement::Full),
            },
            None => self.home[layer] + e as u32,
        };
        let old = self.slots[v as usize].expert;
        if old != NONE {
            self.slot_of[old as usize] = NONE;
            self.stats.evictions += 1;
            if self.classes[c].replacement.as_ref().is_some_and(Replacement::by_frequency) {
                self.stats.frequency_evictions += 1;
            }
        } else {
            self.stats.slots[0] -= 1;
            self.stats.slots[1] += 1;
        }
        self.slots[v as usize].expert = flat as u32;
        self.slots[v as usize].unconfirmed = true;
        self.slot_of[flat] = v;
        self.version += 1;
        self.stats.fills += 1;
        self.use_slot(c, v, flat as u32);
        Some(Placement::Fill(self.range(c, v, len)))
    }

    /// Marks slot `s` of class `c` placed by this batch and busy, holding `expert`,
    /// whose claim the replacement counts.
    fn use_slot(&mut self, c: usize, s: u32, expert: u32) {
        let slot = &mut self.slots[s as usize];
        slot.batch = self.batch;
        if !slot.busy {
            slot.busy = true;
            self.busy.push(s);
            self.stats.slots[1] -= 1;
            self.stats.slots[2] += 1;
        }
        self.count_claim(c, s, expert);
    }

    /// Counts a claim of `expert`, held in slot `s` of class `c`, in the class's
    /// replacement (if it has one).
    fn count_claim(&mut self, c: usize, s: u32, expert: u32) {
        if let Some(r) = &mut self.classes[c].replacement {
            r.claim(expert);
            r.hold(s, expert);
        }
    }

    /// The first `len` bytes of slot `s` of class `c`.
    fn range(&self, c: usize, s: u32, len: u64) -> Subbuffer<[u8]> {
        let class = &self.classes[c];
        let i = s - class.first;
        let off = (i % class.per_buffer) as u64 * class.stride;
        class.buffers[(i / class.per_buffer) as usize].clone().slice(off..off + len.min(class.stride))
    }

    /// The host has waited for everything recorded: the fills are in place and no slot
    /// is in use.
    pub fn settle(&mut self) {
        for s in std::mem::take(&mut self.busy) {
            let slot = &mut self.slots[s as usize];
            slot.busy = false;
            slot.unconfirmed = false;
        }
        self.stats.slots[1] += self.stats.slots[2];
        self.stats.slots[2] = 0;
        self.publish();
    }

    /// The recorded work was abandoned: slots it filled may not hold their experts, so
    /// they go back to empty (refilled first).
    pub fn abandon(&mut self) {
        for s in std::mem::take(&mut self.busy) {
            let slot = &mut self.slots[s as usize];
            slot.busy = false;
            self.stats.slots[2] -= 1;
            if !std::mem::take(&mut slot.unconfirmed) {
                self.stats.slots[1] += 1;
                continue;
            }
            let flat = std::mem::replace(&mut slot.expert, NONE);
            self.slot_of[flat as usize] = NONE;
            self.version += 1;
            self.stats.slots[0] += 1;
            let c = self.layer_class[flat as usize / self.experts_per_layer] as usize;
            if let Some(r) = &mut self.classes[c].replacement {
                r.empty(s);
            }
        }
        self.publish();
    }

    /// Sets the slot gauges and adds what was counted since the last call to the
    /// counters.
    pub fn publish(&mut self) {
        let (p, s) = (&mut self.published, &self.stats);
        p.hits.increment(s.hits - p.sent.hits);
        p.fills.increment(s.fills - p.sent.fills);
        p.evictions.increment(s.evictions - p.sent.evictions);
        p.frequency_evictions.increment(s.frequency_evictions - p.sent.frequency_evictions);
        for (g, n) in p.slots.iter().zip(s.slots) {
            g.set(n as f64);
        }
        p.sent = *s;
    }
}

/// Slots of `stride` bytes in each buffer of a size class: as many as `max_buffer` bytes
/// hold (at least one), and where the class is the home of whole layers of `per_layer`
/// experts (`homes`) and one fits, whole layers only, so that one buffer holds a layer's
/// experts (what the decode step's fused kernels need: the down projection with the MoE
/// combine, and the fused front).
fn slots_per_buffer(max_buffer: u64, stride: u64, per_layer: usize, homes: bool) -> usize {
    let per_buffer = (max_buffer / stride).clamp(1, u32::MAX as u64) as usize;
    match homes && per_buffer >= per_layer {
        true => per_buffer - per_buffer % per_layer,
        false => per_buffer,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_that_fits_one_binding_gets_one_buffer() {
        const MIB: u64 = 1 << 20;
        // Qwen3-Next-80B-A3B's bf16 experts (6 MiB, 512 a layer: 3 GiB) on a device
        // binding 4095 MiB: one layer a buffer; 2 GiB buffers would split every layer.
        assert_eq!(slots_per_buffer(4095 * MIB, 6 * MIB, 512, true), 512);
        assert_eq!(slots_per_buffer(2048 * MIB, 6 * MIB, 512, true), 341);
        // Qwen3-30B-A3B's (9 MiB, 128 a layer): three whole layers, not 455 slots.
        assert_eq!(slots_per_buffer(4095 * MIB, 9 * MIB, 128, true), 384);
        // A tier that homes no layer fills its buffers.
        assert_eq!(slots_per_buffer(4095 * MIB, 9 * MIB, 128, false), 455);
        // A blob larger than the limit still gets a slot.
        assert_eq!(slots_per_buffer(MIB, 9 * MIB, 128, true), 1);
    }

    #[test]
    fn the_default_leaves_a_margin_of_5_percent_or_512_mib() {
        const GIB: u64 = 1 << 30;
        // An H200's 141 GiB: 7.05 GiB margin.
        let (spare_h200, margin) = spare(141 * GIB, 10 * GIB);
        assert_eq!(margin, 141 * GIB / 20);
        assert_eq!(spare_h200, 141 * GIB - 10 * GIB - 141 * GIB / 20);
        // An 8 GiB card: the 512 MiB floor.
        assert_eq!(spare(8 * GIB, GIB), (7 * GIB - (512 << 20), 512 << 20));
        // Nothing left: no tier rather than an underflow.
        assert_eq!(spare(4 * GIB, 4 * GIB).0, 0);
        assert_eq!(spare(GIB, u64::MAX).0, 0);
    }
}
