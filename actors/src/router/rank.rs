//! Exact routing: the router gate's logits for one token become softmax
//! probabilities, the top-k experts are chosen in a defined order, and their weights
//! are renormalised when the model asks for it.

use crate::cpu::kernels::softmax_inplace;

/// Ranks experts from router `logits` (overwritten with the softmax probabilities):
/// fills all of `experts` (at least `k` long) in descending probability, equal
/// probabilities broken by the lower expert index. The first `k` are the routed
/// experts, whose weights go to `weights` (renormalised when `norm_topk_prob`); any
/// further ranks are candidates for speculative prefetch.
pub fn route(logits: &mut [f32], k: usize, norm_topk_prob: bool, experts: &mut [u16], weights: &mut [f32]) {
    softmax_inplace(logits);
    // Selection by repeated scans keeps the order defined without allocating; k is small.
    for slot in 0..experts.len() {
        let mut best: Option<usize> = None;
        for (e, &p) in logits.iter().enumerate() {
            if experts[..slot].contains(&(e as u16)) {
                continue;
            }
            match best {
                Some(b) if logits[b] >= p => {}
                _ => best = Some(e),
            }
        }
        let b = best.expect("k <= number of experts");
        experts[slot] = b as u16;
        if slot < k {
            weights[slot] = logits[b];
        }
    }
    if norm_topk_prob {
        let sum: f32 = weights[..k].iter().sum();
        for w in weights[..k].iter_mut() {
            *w /= sum;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_break_to_lower_index_and_order_is_descending() {
        let mut logits = vec![1.0, 3.0, 3.0, 0.5, 2.0];
        let mut ex = [0u16; 3];
        let mut w = [0f32; 3];
        route(&mut logits, 3, true, &mut ex, &mut w);
        assert_eq!(ex, [1, 2, 4]);
        assert_eq!(w[0], w[1]);
        assert!(w[1] > w[2]);
        assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }
}
