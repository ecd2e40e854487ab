//! The VRAM tier's slot replacement replayed on a claim trace (`generate --trace-out`):
//! the share of decode claims that would hit a tier of a given size with the engine's
//! replacement (`smoe_actors::vulkan::replacement`: recency or frequency, picked by a
//! duel), with plain LRU (what the tier did before), with plain LFU (frequency alone),
//! and with the optimum (Belady: evict the expert claimed furthest ahead), in the same
//! run.
//!
//!   `tier_replay TRACE [SHARE ...]`
//!
//! SHARE: tier sizes as fractions of the trace's layers' experts (default 0.25 0.5).
//! Decode claims are those of single-token blocks after the prompt (the trace's first
//! block's tokens). Every layer shares one slot class (a vault with one blob stride), and
//! the claims of one layer step form a batch whose slots cannot be refilled within it, as
//! in the tier.

use std::collections::HashMap;

use smoe_actors::vulkan::replacement::Replacement;
use smoe_proto::ClaimEvent;

/// One layer step: its tokens, first position and the experts it claimed (layer ·
/// experts + expert).
struct Step {
    rows: usize,
    pos: usize,
    experts: Vec<u32>,
}

/// A policy under test: which slot to refill given the slots the batch may not touch.
trait Policy {
    /// A claim of `x` (after the victim for it, if it missed, was chosen).
    fn claim(&mut self, x: u32);
    /// The slot to refill, skipping `placed` ones.
    fn victim(&mut self, placed: &dyn Fn(u32) -> bool, step: usize) -> Option<u32>;
    /// Slot `s` holds `x`, just claimed at step `step`.
    fn hold(&mut self, s: u32, x: u32, step: usize);
}

/// The engine's replacement, and how many of its victims each ranking picked.
struct Engine {
    r: Replacement,
    victims: u64,
    by_frequency: u64,
}

impl Policy for Engine {
    fn claim(&mut self, x: u32) {
        self.r.claim(x);
    }
    fn victim(&mut self, placed: &dyn Fn(u32) -> bool, _: usize) -> Option<u32> {
        self.victims += 1;
        self.by_frequency += self.r.by_frequency() as u64;
        self.r.victim(|s| !placed(s))
    }
    fn hold(&mut self, s: u32, x: u32, _: usize) {
        self.r.hold(s, x);
    }
}

/// Least recently used: per slot the stamp of its last use (0: empty).
struct Lru {
    last: Vec<u64>,
    clock: u64,
}

impl Policy for Lru {
    fn claim(&mut self, _: u32) {
        self.clock += 1;
    }
    fn victim(&mut self, placed: &dyn Fn(u32) -> bool, _: usize) -> Option<u32> {
        (0..self.last.len() as u32).filter(|&s| !placed(s)).min_by_key(|&s| self.last[s as usize])
    }
    fn hold(&mut self, s: u32, _: u32, _: usize) {
        self.last[s as usize] = self.clock;
    }
}

/// Least frequently used: per expert its claim count, per slot its expert and last use;
/// the slot of the least claimed expert goes first, the least recent among equals.
struct Lfu {
    count: HashMap<u32, u64>,
    held: Vec<(u32, u64)>,
    clock: u64,
}

impl Policy for Lfu {
    fn claim(&mut self, x: u32) {
        self.clock += 1;
        *self.count.entry(x).or_default() += 1;
    }
    fn victim(&mut self, placed: &dyn Fn(u32) -> bool, _: usize) -> Option<u32> {
        let key = |s: u32| match self.held[s as usize] {
            (_, 0) => (0, 0),
            (x, last) => (self.count[&x], last),
        };
        (0..self.held.len() as u32).filter(|&s| !placed(s)).min_by_key(|&s| key(s))
    }
    fn hold(&mut self, s: u32, x: u32, _: usize) {
        self.held[s as usize] = (x, self.clock);
    }
}

/// Belady's optimum: evict the expert whose next claim is furthest ahead.
struct Belady {
    /// Per expert, the steps that claim it, ascending.
    uses: HashMap<u32, Vec<usize>>,
    held: Vec<Option<u32>>,
}

impl Policy for Belady {
    fn claim(&mut self, _: u32) {}
    fn victim(&mut self, placed: &dyn Fn(u32) -> bool, step: usize) -> Option<u32> {
        let next = |s: u32| match self.held[s as usize] {
            None => usize::MAX,
            Some(x) => {
                let u = &self.uses[&x];
                u.get(u.partition_point(|&t| t <= step)).copied().unwrap_or(usize::MAX - 1)
            }
        };
        (0..self.held.len() as u32).filter(|&s| !placed(s)).max_by_key(|&s| next(s))
    }
    fn hold(&mut self, s: u32, x: u32, _: usize) {
        self.held[s as usize] = Some(x);
    }
}

/// Decode hits and claims of `policy` over `steps` with `slots` slots.
fn replay(steps: &[Step], prompt: usize, slots: u32, policy: &mut dyn Policy) -> (u64, u64) {
    let mut slot_of: HashMap<u32, u32> = HashMap::new();
    let mut holds: Vec<Option<u32>> = vec![None; slots as usize];
    let mut batch = vec![usize::MAX; slots as usize];
    let (mut hits, mut claims) = (0, 0);
    for (i, step) in steps.iter().enumerate() {
        let decode = step.rows == 1 && step.pos >= prompt;
        // A batch id per part of the step (a new part when every slot is placed).
        let mut part = i * 1024;
        for &x in &step.experts {
            claims += decode as u64;
            let s = match slot_of.get(&x) {
                Some(&s) => {
                    hits += decode as u64;
                    s
                }
                None => {
                    let s = match policy.victim(&|s| batch[s as usize] == part, i) {
                        Some(s) => s,
                        None => {
                            part += 1;
                            policy.victim(&|_| false, i).expect("a tier with slots")
                        }
                    };
                    if let Some(old) = holds[s as usize].replace(x) {
                        slot_of.remove(&old);
                    }
                    slot_of.insert(x, s);
                    s
                }
            };
            batch[s as usize] = part;
            policy.claim(x);
            policy.hold(s, x, i);
        }
    }
    (hits, claims)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(path) = args.first() else {
        eprintln!("usage: tier_replay TRACE [SHARE ...]  (TRACE from `generate --trace-out`)");
        std::process::exit(2);
    };
    let shares: Vec<f64> = match args[1..].iter().map(|a| a.parse()).collect::<Result<Vec<f64>, _>>() {
        Ok(v) if v.is_empty() => vec![0.25, 0.5],
        Ok(v) if v.iter().all(|&s| s > 0.0 && s <= 1.0) => v,
        _ => {
            eprintln!("tier_replay: each SHARE is a fraction in (0, 1]");
            std::process::exit(2);
        }
    };
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| {
        eprintln!("tier_replay: cannot read {path}: {e}");
        std::process::exit(1);
    });
    let events: Vec<ClaimEvent> = text
        .lines()
        .enumerate()
        .map(|(n, l)| {
            serde_json::from_str(l).unwrap_or_else(|e| {
                eprintln!("tier_replay: {path} line {}: not a claim event ({e})", n + 1);
                std::process::exit(1);
            })
        })
        .collect();
    let Some(first) = events.first() else {
        eprintln!("tier_replay: {path} holds no claims");
        std::process::exit(1);
    };
    let prompt = first.pos + first.rows;
    let experts = events.iter().map(|e| e.expert).max().unwrap_or(0) + 1;
    let mut steps: Vec<Step> = Vec::new();
    for e in &events {
        let x = (e.layer * experts + e.expert) as u32;
        match steps.last_mut() {
            Some(s)
                if s.pos == e.pos
                    && s.rows == e.rows
                    && s.experts.last().map(|&l| l as usize / experts) == Some(e.layer) =>
            {
                s.experts.push(x)
            }
            _ => steps.push(Step { rows: e.rows, pos: e.pos, experts: vec![x] }),
        }
    }
    let layers = events.iter().map(|e| e.layer).collect::<std::collections::BTreeSet<_>>().len();
    let total = layers * experts;
    let mut uses: HashMap<u32, Vec<usize>> = HashMap::new();
    for (i, s) in steps.iter().enumerate() {
        for &x in &s.experts {
            uses.entry(x).or_default().push(i);
        }
    }
    println!(
        "{path}: {} claims, first block {prompt} tokens, {layers} layers × {experts} experts",
        events.len()
    );
    println!(
        "| tier (share of {total} experts) | LRU | LFU | engine (recency/frequency duel) | victims picked by frequency \
         | optimum (Belady) |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    for share in shares {
        let slots = ((total as f64 * share).round() as u32).max(1);
        let rate = |(h, c): (u64, u64)| 100.0 * h as f64 / c.max(1) as f64;
        let lru = replay(&steps, prompt, slots, &mut Lru { last: vec![0; slots as usize], clock: 0 });
        let lfu = replay(
            &steps,
            prompt,
            slots,
            &mut Lfu { count: HashMap::new(), held: vec![(0, 0); slots as usize], clock: 0 },
        );
        let mut engine = Engine { r: Replacement::new(0..slots), victims: 0, by_frequency: 0 };
        let ours = replay(&steps, prompt, slots, &mut engine);
        let opt = replay(
            &steps,
            prompt,
            slots,
            &mut Belady { uses: uses.clone(), held: vec![None; slots as usize] },
        );
        println!(
            "| {slots} ({:.0}%) | {:.1}% | {:.1}% | {:.1}% | {:.0}% of {} | {:.1}% |",
            share * 100.0,
            rate(lru),
            rate(lfu),
            rate(ours),
            100.0 * engine.by_frequency as f64 / engine.victims.max(1) as f64,
            engine.victims,
            rate(opt)
        );
    }
}
