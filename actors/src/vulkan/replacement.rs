//! Which slot a VRAM tier size class refills when a claimed expert is not in it.
//!
//! Two rankings of the class's slots are kept: by recency (the least recently claimed
//! expert's slot first) and by frequency (the slot of the expert the class has claimed
//! least often first, the least recent among equals; counts are kept for every expert
//! ever claimed, held or not). A duel picks which one evicts: two *shadow* directories
//! of the class's size — expert ids only, no memory — see the same claims, one run by
//! each ranking, and count the hits each would have had; whichever has hit more over
//! the recent claims (a claim's outcome weighs e^(−age / (`WINDOW` × slots)), its age
//! counted in claims) picks the victim. An empty slot is always taken first.
//!
//! Why both (`bench/README.md`, measured on the engine's claim traces of synthetic
//! vaults): decode routing with token-to-token locality, as trained models route (the
//! synth's `trained` profile), is served by recency and not by frequency alone (30
//! points of hit rate lost at a quarter of the experts), while routing skewed towards
//! some experts without locality is served by frequency (33% of decode claims hit
//! against LRU's 25%). The duel matched the better of the two on both.
//!
//! The rankings decide only which copy is kept: expert weights are immutable and every
//! claim reads its expert's bytes, so no policy changes a byte of the result.

use std::collections::{BTreeSet, HashMap};

/// The duel's memory, in turnovers of the class: the weight of a claim's outcome
/// decays by a factor e every `WINDOW` × slots claims.
const WINDOW: f64 = 4.0;

/// Position of an id in a ranking; the smallest is evicted first.
type Key = (u64, u64);

/// Ids ordered by their keys, smallest first.
#[derive(Default)]
struct Ranking {
    order: BTreeSet<(Key, u32)>,
    key: HashMap<u32, Key>,
}

impl Ranking {
    /// Gives `id` the key `k` (adding it if absent).
    fn set(&mut self, id: u32, k: Key) {
        if let Some(old) = self.key.insert(id, k) {
            self.order.remove(&(old, id));
        }
        self.order.insert((k, id));
    }

    /// Takes `id` out, if present.
    fn remove(&mut self, id: u32) {
        if let Some(old) = self.key.remove(&id) {
            self.order.remove(&(old, id));
        }
    }

    /// The ids, first evicted first.
    fn ascending(&self) -> impl Iterator<Item = u32> + '_ {
        self.order.iter().map(|&(_, id)| id)
    }
}

/// Which ranking a key is formed for.
#[derive(Clone, Copy)]
enum By {
    Recency,
    Frequency,
}

/// A directory of `capacity` expert ids run by one ranking alone: it holds no memory,
/// only says whether each claim would have hit.
struct Shadow {
    by: By,
    capacity: usize,
    held: Ranking,
}

impl Shadow {
    /// Claims `expert` (its claim count and stamp `seen`): whether the directory held
    /// it; it holds it afterwards, in place of its first-ranked id if it was full.
    fn claim(&mut self, expert: u32, seen: (u64, u64)) -> bool {
        let hit = self.held.key.contains_key(&expert);
        if !hit && self.held.key.len() >= self.capacity {
            let first = self.held.ascending().next();
            if let Some(v) = first {
                self.held.remove(v);
            }
        }
        self.held.set(expert, key(self.by, seen));
        hit
    }
}

/// The key of an expert claimed `count` times, last at stamp `last`.
fn key(by: By, (count, last): (u64, u64)) -> Key {
    match by {
        By::Recency => (last, 0),
        By::Frequency => (count, last),
    }
}

/// The replacement state of one size class of the tier.
pub struct Replacement {
    /// Claims so far (the stamp of the latest).
    clock: u64,
    /// Per expert ever claimed: its claim count and the stamp of its latest claim.
    seen: HashMap<u32, (u64, u64)>,
    /// The class's slots by each ranking (empty slots key (0, 0): first).
    recency: Ranking,
    frequency: Ranking,
    shadows: [Shadow; 2],
    /// Recent shadow hits by frequency minus by recency, each weighted by `decay` per
    /// claim since: frequency evicts while it is positive.
    score: f64,
    decay: f64,
}

impl Replacement {
    /// The state of a class whose slots are `slots` (empty).
    pub fn new(slots: impl ExactSizeIterator<Item = u32>) -> Replacement {
        let n = slots.len();
        let mut r = Replacement {
            clock: 0,
            seen: HashMap::new(),
            recency: Ranking::default(),
            frequency: Ranking::default(),
            shadows: [By::Recency, By::Frequency].map(|by| Shadow {
                by,
                capacity: n,
                held: Ranking::default(),
            }),
            score: 0.0,
            decay: 1.0 - 1.0 / (WINDOW * n.max(1) as f64),
        };
        for s in slots {
            r.empty(s);
        }
        r
    }

    /// Counts a claim of `expert` (a hit, or a fill after its [`Replacement::victim`];
    /// then [`Replacement::hold`] its slot) and plays it in both shadows.
    pub fn claim(&mut self, expert: u32) {
        self.clock += 1;
        let seen = self.seen.entry(expert).or_insert((0, 0));
        *seen = (seen.0 + 1, self.clock);
        let seen = *seen;
        let [lru, lfu] = self.shadows.each_mut().map(|s| s.claim(expert, seen) as i8 as f64);
        self.score = self.score * self.decay + (lfu - lru);
    }

    /// Whether the frequency ranking picks victims now.
    pub fn by_frequency(&self) -> bool {
        self.score > 0.0
    }

    /// The slot to refill: the first by the ranking the duel picks among those
    /// `eligible` accepts (empty slots come first in both), or `None` if it accepts none.
    pub fn victim(&self, eligible: impl Fn(u32) -> bool) -> Option<u32> {
        let ranking = if self.by_frequency() { &self.frequency } else { &self.recency };
        ranking.ascending().find(|&s| eligible(s))
    }

    /// Slot `slot` holds `expert`, which was just claimed.
    pub fn hold(&mut self, slot: u32, expert: u32) {
        let seen = self.seen.get(&expert).copied().unwrap_or_default();
        self.recency.set(slot, key(By::Recency, seen));
        self.frequency.set(slot, key(By::Frequency, seen));
    }

    /// Slot `slot` holds nothing: it is refilled first.
    pub fn empty(&mut self, slot: u32) {
        self.recency.set(slot, (0, 0));
        self.frequency.set(slot, (0, 0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// Hits of a tier of `slots` slots run by `Replacement` over `claims`, and of a
    /// plain LRU of the same size.
    fn hits(slots: u32, claims: &[u32]) -> (usize, usize) {
        let mut r = Replacement::new(0..slots);
        let mut held: HashMap<u32, u32> = HashMap::new(); // expert -> slot
        let mut lru: VecDeque<u32> = VecDeque::new();
        let (mut dueled, mut plain) = (0, 0);
        for &x in claims {
            let s = match held.get(&x) {
                Some(&s) => {
                    dueled += 1;
                    s
                }
                None => {
                    let s = r.victim(|_| true).unwrap();
                    held.retain(|_, &mut h| h != s);
                    held.insert(x, s);
                    s
                }
            };
            r.claim(x);
            r.hold(s, x);
            match lru.iter().position(|&y| y == x) {
                Some(i) => {
                    plain += 1;
                    lru.remove(i);
                }
                None if lru.len() == slots as usize => {
                    lru.pop_back();
                }
                None => {}
            }
            lru.push_front(x);
        }
        (dueled, plain)
    }

    /// A deterministic generator (SplitMix64) for the claim streams.
    fn rng(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed;
        move || {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
    }

    #[test]
    fn skewed_claims_without_locality_are_served_by_frequency() {
        // 128 experts, the first 32 drawn 3 times as often as the rest (a busiest
        // quarter taking half the claims), independently; a quarter-sized tier.
        let mut next = rng(7);
        let claims: Vec<u32> = (0..20_000)
            .map(|_| {
                let d = (next() % 192) as u32;
                if d < 96 {
                    d / 3
                } else {
                    32 + (d - 96)
                }
            })
            .collect();
        let (dueled, plain) = hits(32, &claims);
        // LRU hits about its share of the experts weighted by their draws (~27%); a
        // tier holding the busiest quarter hits ~50%.
        assert!(dueled * 10 > plain * 15, "duel {dueled} hits, LRU {plain}");
    }

    #[test]
    fn claims_with_locality_are_served_by_recency() {
        // A working set of 24 experts drifting through 128 (one replaced every 8
        // claims), drawn uniformly within it: recency holds the set, and old counts
        // point at experts that have left it.
        let mut next = rng(11);
        let mut set: Vec<u32> = (0..24).collect();
        let mut fresh = 24u32;
        let claims: Vec<u32> = (0..20_000)
            .map(|i| {
                if i % 8 == 0 {
                    let j = (next() % 24) as usize;
                    set[j] = fresh % 128;
                    fresh += 1;
                }
                set[(next() % 24) as usize]
            })
            .collect();
        let (dueled, plain) = hits(32, &claims);
        assert!(dueled * 100 >= plain * 98, "duel {dueled} hits, LRU {plain}");
        assert!(plain * 10 > claims.len() * 7, "the stream has locality: LRU hits {plain}");
    }

    #[test]
    fn victims_skip_ineligible_slots_and_empty_slots_come_first() {
        let mut r = Replacement::new(0..3);
        for (s, x) in [(0, 10), (1, 11), (2, 12)] {
            r.claim(x);
            r.hold(s, x);
        }
        assert_eq!(r.victim(|_| true), Some(0));
        assert_eq!(r.victim(|s| s != 0), Some(1));
        assert_eq!(r.victim(|_| false), None);
        r.empty(2);
        assert_eq!(r.victim(|_| true), Some(2));
    }
}
