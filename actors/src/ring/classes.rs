//! Slot size classes. A vault whose MoE layers store their experts at different blob
//! strides (llama.cpp's Q4_K_M keeps the down projection of some layers in Q6_K, so those
//! blobs are larger) gets one slot size per stride: a small blob never occupies a slot
//! sized for the largest one, and the same ring bytes hold more experts. Each layer's
//! experts live only in its class's slots.
//!
//! How a ring size is split: a byte budget gives every class the same fraction of its
//! experts (slots × stride summed over the classes stays within the budget), and what
//! rounding leaves goes to the classes furthest behind that fraction; a slot count
//! is split in proportion to the classes' expert counts. Every class needs at least one
//! slot. A vault with one stride has one class, sized exactly as a single-size ring.

use smoe_proto::Manifest;

use super::RingError;

/// How big the ring is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingSize {
    /// A number of slots, split over the size classes in proportion to their experts.
    Slots(usize),
    /// A byte budget, split so each size class holds the same fraction of its experts
    /// (quantised experts are smaller, so the same budget holds more of them).
    Bytes(u64),
}

/// One size class: slots of one stride, serving the MoE layers whose blobs have it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotClass {
    /// Bytes of one slot: the blob stride of the class's layers.
    pub stride: usize,
    /// Decoder layers whose experts live in this class.
    pub layers: Vec<usize>,
    /// Slots of the class.
    pub slots: usize,
}

impl SlotClass {
    /// Experts the class serves (its layers × experts per layer).
    pub fn experts(&self, experts_per_layer: usize) -> usize {
        self.layers.len() * experts_per_layer
    }
}

/// Splits `size` over the size classes of `manifest`'s MoE layers, largest stride first.
pub fn plan_for(manifest: &Manifest, size: RingSize) -> Result<Vec<SlotClass>, RingError> {
    let strides: Vec<(usize, usize)> =
        manifest.experts.layers.iter().map(|l| (l.layer, l.layout.blob_stride as usize)).collect();
    plan(&strides, manifest.model.num_experts, size)
}

/// Splits `size` over the size classes of MoE layers given as (layer, blob stride), with
/// `per_layer` experts each, largest stride first.
pub fn plan(
    strides: &[(usize, usize)],
    per_layer: usize,
    size: RingSize,
) -> Result<Vec<SlotClass>, RingError> {
    let mut classes: Vec<SlotClass> = Vec::new();
    for &(layer, stride) in strides {
        match classes.iter_mut().find(|c| c.stride == stride) {
            Some(c) => c.layers.push(layer),
            None => classes.push(SlotClass { stride, layers: vec![layer], slots: 0 }),
        }
    }
    classes.sort_by_key(|c| std::cmp::Reverse(c.stride));
    let experts: Vec<usize> = classes.iter().map(|c| c.experts(per_layer)).collect();
    let total: usize = experts.iter().sum();
    match size {
        RingSize::Bytes(budget) => {
            let all_bytes: u128 = classes.iter().zip(&experts).map(|(c, &e)| (c.stride * e) as u128).sum();
            for (c, &e) in classes.iter_mut().zip(&experts) {
                // floor(budget / all_bytes × e): the same fraction of every class.
                let n = (budget as u128 * e as u128).checked_div(all_bytes).unwrap_or(0);
                c.slots = n.min(e as u128) as usize;
            }
            // Rounding down left less than one slot per class: fill it, always giving
            // the next slot to the class holding the smallest fraction of its experts.
            let mut left = budget.saturating_sub(classes.iter().map(|c| (c.slots * c.stride) as u64).sum());
            while let Some(i) = (0..classes.len())
                .filter(|&i| classes[i].slots < experts[i] && classes[i].stride as u64 <= left)
                .min_by(|&a, &b| (classes[a].slots * experts[b]).cmp(&(classes[b].slots * experts[a])))
            {
                classes[i].slots += 1;
                left -= classes[i].stride as u64;
            }
        }
        RingSize::Slots(n) => {
            let n = n.min(total);
            let mut given = 0;
            for (c, &e) in classes.iter_mut().zip(&experts) {
                c.slots = (n * e).checked_div(total).unwrap_or(0);
                given += c.slots;
            }
            // What rounding down left goes to the classes with the largest remainders.
            let mut order: Vec<usize> = (0..classes.len()).collect();
            order.sort_by_key(|&i| std::cmp::Reverse((n * experts[i]).checked_rem(total).unwrap_or(0)));
            for &i in order.iter().take(n - given) {
                classes[i].slots += 1;
            }
        }
    }
    if classes.is_empty() || classes.iter().any(|c| c.slots == 0) {
        let one_each: usize = classes.iter().map(|c| c.stride).sum();
        return Err(RingError::NoSlots { bytes: one_each.max(1), classes: classes.len().max(1) });
    }
    Ok(classes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn one_stride_is_one_class_sized_as_before() {
        let strides = [(0, 3 * MIB), (1, 3 * MIB)];
        let c = plan(&strides, 8, RingSize::Bytes(10 * MIB as u64)).unwrap();
        assert_eq!(c, vec![SlotClass { stride: 3 * MIB, layers: vec![0, 1], slots: 3 }]);
        assert_eq!(plan(&strides, 8, RingSize::Slots(5)).unwrap()[0].slots, 5);
        assert_eq!(plan(&strides, 8, RingSize::Slots(500)).unwrap()[0].slots, 16, "capped at every expert");
    }

    #[test]
    fn a_budget_gives_every_class_the_same_fraction_of_its_experts() {
        // Layers 0 and 3 store larger blobs (Q6_K down), 1 and 2 smaller ones.
        let strides = [(0, 4 * MIB), (1, 3 * MIB), (2, 3 * MIB), (3, 4 * MIB)];
        let c = plan(&strides, 10, RingSize::Bytes(70 * MIB as u64)).unwrap();
        assert_eq!(c[0], SlotClass { stride: 4 * MIB, layers: vec![0, 3], slots: 10 });
        assert_eq!(c[1], SlotClass { stride: 3 * MIB, layers: vec![1, 2], slots: 10 });
        // One slot size for all would hold 70 / 4 = 17 experts; the classes hold 20.
        // 75 MiB: 10.7 of each class rounds down to 10 + 10 (70 MiB); the 5 MiB left take
        // one more slot (4 MiB, the class the earlier tie-break favours), 1 MiB stays.
        let c = plan(&strides, 10, RingSize::Bytes(75 * MIB as u64)).unwrap();
        assert_eq!((c[0].slots, c[1].slots), (11, 10));
        for budget in (7..140).map(|m| (m * MIB) as u64) {
            let c = plan(&strides, 10, RingSize::Bytes(budget)).unwrap();
            let used: u64 = c.iter().map(|c| (c.slots * c.stride) as u64).sum();
            assert!(used <= budget && budget - used < 3 * MIB as u64, "{budget}: {c:?}");
            assert!(c[0].slots.abs_diff(c[1].slots) <= 1, "{budget}: same fraction of equal classes: {c:?}");
        }
    }

    #[test]
    fn slot_counts_split_in_proportion_and_sum_exactly() {
        let strides = [(0, 4 * MIB), (1, 3 * MIB), (2, 3 * MIB)];
        for n in 2..=30 {
            let c = plan(&strides, 10, RingSize::Slots(n)).unwrap();
            assert_eq!(c.iter().map(|c| c.slots).sum::<usize>(), n, "{n} slots");
            assert!(c[1].slots >= c[0].slots, "{n}: twice the experts, at least as many slots");
        }
    }

    #[test]
    fn every_class_needs_a_slot() {
        let strides = [(0, 4 * MIB), (1, 3 * MIB)];
        let err = plan(&strides, 8, RingSize::Slots(1)).unwrap_err();
        assert!(matches!(err, RingError::NoSlots { bytes, classes: 2 } if bytes == 7 * MIB), "{err}");
        assert!(plan(&strides, 8, RingSize::Bytes(5 * MIB as u64)).is_err());
        assert!(plan(&strides, 8, RingSize::Slots(2)).is_ok());
    }
}
