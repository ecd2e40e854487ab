//! The router stage on a real fixture model: a block's routing does not depend on how
//! many tokens are routed together, the union is in first-use order with each member's
//! pairs in token order, announcements go out in union order and stop at the first
//! refusal, and decode bets are the next gate ranks, placed only when the executor asks
//! (blocks place none).

mod common;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use common::*;
use rand::{Rng, SeedableRng};
use smoe_actors::model::{FfnRefs, Model};
use smoe_actors::router::Router;
use smoe_actors::vault::Vault;
use smoe_proto::{ExpertHandle, ExpertKey, ExpertSource, GateInput, RouteJob, VaultError};

/// What the router asked of the expert source.
#[derive(Default)]
struct Calls {
    announced: Vec<ExpertKey>,
    bets: Vec<ExpertKey>,
}

/// Records the router's announcements and bets; accepts the first `accept` announcements.
struct Recorder {
    calls: Mutex<Calls>,
    accept: usize,
}

impl Recorder {
    fn new(accept: usize) -> Arc<Recorder> {
        Arc::new(Recorder { calls: Mutex::default(), accept })
    }
}

impl ExpertSource for Recorder {
    fn claim(&self, _key: ExpertKey) -> Result<ExpertHandle, VaultError> {
        panic!("the router never claims: claims belong to the executor")
    }
    fn announce(&self, key: ExpertKey) -> bool {
        let mut c = self.calls.lock().unwrap();
        c.announced.push(key);
        c.announced.len() <= self.accept
    }
    fn prefetch(&self, key: ExpertKey) {
        self.calls.lock().unwrap().bets.push(key);
    }
}

fn model() -> (tempfile::TempDir, Arc<Model>) {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let vault = Arc::new(Vault::open(&vault).expect("vault opens"));
    (dir, Arc::new(Model::load(vault, 64).expect("model loads")))
}

/// A router for blocks of up to `rows` tokens of `model`, announcing to `source`.
fn router_for(model: &Arc<Model>, rows: usize, source: &Arc<Recorder>) -> Router {
    let c = &model.cfg;
    let job = RouteJob::new(rows, c.hidden_size, c.num_experts, c.num_experts_per_tok, c.norm_topk_prob);
    Router::spawn(model.clone(), source.clone(), job)
}

/// Routes `rows` tokens of MoE layer `layer` whose normalised hidden rows `fill` writes
/// (the router computes the gate), with `bets` decode bets.
fn route<'r>(
    router: &'r mut Router,
    model: &Model,
    layer: usize,
    rows: usize,
    bets: usize,
    fill: impl FnOnce(&mut [f32]),
) -> &'r mut RouteJob {
    assert!(matches!(model.layers[layer].ffn, FfnRefs::Moe { .. }), "layer {layer} of moe_all is MoE");
    let job = router.job_mut().expect("router runs");
    job.request(layer, rows, bets);
    job.set_input(GateInput::Hidden);
    let plane = job.hidden_mut();
    plane.resize(rows * model.cfg.hidden_size, 0.0);
    fill(plane);
    router.route().unwrap()
}

#[test]
fn a_block_routes_exactly_as_its_tokens_one_by_one() {
    let (_dir, model) = model();
    let c = model.cfg.clone();
    let (h, k, m, layer) = (c.hidden_size, c.num_experts_per_tok, 37, 1);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let rows: Vec<f32> = (0..m * h).map(|_| rng.random_range(-2.0f32..2.0)).collect();

    let source = Recorder::new(usize::MAX);
    let mut router = router_for(&model, m, &source);
    let block = route(&mut router, &model, layer, m, 4, |p| p.copy_from_slice(&rows));

    // The same tokens routed one at a time give bitwise the same experts and weights.
    let mut singles = router_for(&model, 1, &source);
    for t in 0..m {
        let single =
            route(&mut singles, &model, layer, 1, 0, |p| p.copy_from_slice(&rows[t * h..(t + 1) * h]));
        assert_eq!(single.topk_experts(), &block.topk_experts()[t * k..(t + 1) * k], "token {t}");
        let bits = |w: &[f32]| w.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(single.topk_weights()), bits(&block.topk_weights()[t * k..(t + 1) * k]), "token {t}");
    }

    // The union is the experts in first-use order; each member's pairs in token order.
    let mut seen = HashSet::new();
    let first_use: Vec<u16> = block.topk_experts().iter().copied().filter(|e| seen.insert(*e)).collect();
    assert_eq!(block.union(), &first_use[..]);
    let mut all_pairs = 0;
    for (ui, &e) in block.union().iter().enumerate() {
        let want: Vec<u32> = (0..m * k).filter(|&i| block.topk_experts()[i] == e).map(|i| i as u32).collect();
        assert_eq!(block.pairs_of(ui), &want[..], "expert {e}");
        all_pairs += want.len();
    }
    assert_eq!(all_pairs, m * k);

    // Every union member was announced once, in union order, and a block places no bets.
    let calls = source.calls.lock().unwrap();
    let block_announced = &calls.announced[..block.union().len()];
    let want: Vec<ExpertKey> = block.union().iter().map(|&e| ExpertKey::new(layer, e as usize)).collect();
    assert_eq!(block_announced, &want[..]);
    assert_eq!(block.announced(), block.union().len());
    assert!(block.bets().is_empty(), "a block has bets: {:?}", block.bets());
    assert!(calls.bets.is_empty(), "routing placed bets: {:?}", calls.bets);
}

#[test]
fn announcing_stops_at_the_first_refusal_and_decode_bets_are_the_next_ranks() {
    let (_dir, model) = model();
    let c = model.cfg.clone();
    let (h, k, ne, m, layer) = (c.hidden_size, c.num_experts_per_tok, c.num_experts, 16, 0);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);

    let source = Recorder::new(2);
    let mut router = router_for(&model, m, &source);
    let job = route(&mut router, &model, layer, m, 0, |p| {
        p.iter_mut().for_each(|x| *x = rng.random_range(-2.0f32..2.0))
    });
    assert!(job.union().len() > 3, "the block should touch several experts");
    assert_eq!(job.announced(), 2);
    // The refused third announcement is the last one made.
    assert_eq!(source.calls.lock().unwrap().announced.len(), 3);

    // A decode step with depth 3: top-k is unchanged by betting; the bets are the next
    // three ranks of the same gate logits, none of them routed.
    let source = Recorder::new(usize::MAX);
    let x: Vec<f32> = (0..h).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    let mut routers: Vec<Router> = (0..3).map(|_| router_for(&model, 1, &source)).collect();
    let mut jobs = routers
        .iter_mut()
        .zip([0, 3, ne])
        .map(|(router, bets)| route(router, &model, layer, 1, bets, |p| p.copy_from_slice(&x)));
    let (plain, deep, wide) = (jobs.next().unwrap(), jobs.next().unwrap(), jobs.next().unwrap());
    assert_eq!(plain.topk_experts(), deep.topk_experts());
    // Bets wait for the executor: routing alone queues none.
    assert!(source.calls.lock().unwrap().bets.is_empty(), "routing placed bets before the claims");
    let bets: Vec<ExpertKey> = [&plain, &deep, &wide]
        .iter()
        .flat_map(|job| job.bets().iter().map(|&e| ExpertKey::new(layer, e as usize)))
        .collect();
    assert_eq!(bets.len(), 3 + (ne - k), "depth is capped at the experts beyond top-k");
    let ranks: Vec<u16> = bets[3..].iter().map(|key| key.expert).collect();
    assert_eq!(
        &bets[..3],
        &ranks[..3].iter().map(|&e| ExpertKey::new(layer, e as usize)).collect::<Vec<_>>()[..]
    );
    let routed: HashSet<u16> = wide.topk_experts().iter().copied().collect();
    assert!(ranks.iter().all(|e| !routed.contains(e)), "a bet repeats a routed expert");
    assert_eq!(
        routed.len() + ranks.iter().collect::<HashSet<_>>().len(),
        ne,
        "ranks cover every expert once"
    );
}
