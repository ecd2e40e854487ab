//! The Vulkan backend's VRAM tier on lavapipe (where it is off by default, so the tests
//! turn it on with `--vram-bytes`): logits byte-identical with the tier off, holding
//! every expert, and holding two; its counters add up (hits + fills = expert claims);
//! the fused MoE front (forming the norm before it) changes no byte either, nor device routing of a hybrid model's
//! decode steps; bad sizes are clear errors; `serve` exports its metrics.
#![cfg(feature = "vulkan")]

mod common;
#[path = "serve/daemon.rs"]
mod daemon;
#[path = "serve/http.rs"]
mod http;

use std::path::{Path, PathBuf};

use common::*;
use daemon::Daemon;
use serde_json::Value;

/// A `synth --preset small` vault (`quant` e.g. `q4_k_m`, or none for bf16).
fn synth(dir: &Path, quant: Option<&str>) -> PathBuf {
    let vault = dir.join(format!("{}.vault", quant.unwrap_or("bf16")));
    let mut args = vec!["synth", "--out", vault.to_str().unwrap(), "--preset", "small", "--seed", "7"];
    if let Some(q) = quant {
        args.extend(["--quant", q]);
    }
    run_ok(&args);
    vault
}

/// `vault`'s manifest.
fn manifest(vault: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(vault.join("manifest.json")).unwrap()).unwrap()
}

/// The blob strides of `vault`'s MoE layers, distinct, largest first.
fn strides(vault: &Path) -> Vec<u64> {
    let mut s: Vec<u64> = manifest(vault)["experts"]["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["layout"]["blob_stride"].as_u64().unwrap())
        .collect();
    s.sort_unstable_by(|a, b| b.cmp(a));
    s.dedup();
    s
}

/// The runs' prompt: three chunks of 4 tokens or fewer.
fn prompt() -> Vec<u32> {
    (0..10).map(|i| (i * 37 + 5) % 500).collect()
}

/// A greedy run on Vulkan with `--vram-bytes vram` and `extra` flags (the prompt, then
/// decode): its JSON and logits.
fn run(dir: &Path, vault: &Path, vram: u64, extra: &[&str]) -> (Value, Vec<f32>) {
    let (out, logits, _) = run_logged(dir, vault, vram, extra);
    (out, logits)
}

/// [`run`], also handing back what the run logged.
fn run_logged(dir: &Path, vault: &Path, vram: u64, extra: &[&str]) -> (Value, Vec<f32>, String) {
    let logits = dir.join(format!("{vram}.safetensors"));
    let v = vram.to_string();
    let mut flags =
        vec!["--logits-out", logits.to_str().unwrap(), "--backend", "vulkan", "--chunk-size", "4"];
    flags.extend_from_slice(&["--vram-bytes", &v]);
    flags.extend_from_slice(extra);
    let (out, err) = generate_json_logged(vault, &prompt(), 6, &flags);
    (out, read_f32(&logits, "logits").1, err)
}

/// The token ids of the greedy run of [`run`] without `--logits-out`, as `serve` runs:
/// each step hands back only its greedy choice, made on the device.
fn greedy_ids(vault: &Path, vram: u64) -> Vec<u32> {
    let v = vram.to_string();
    let flags = ["--backend", "vulkan", "--chunk-size", "4", "--vram-bytes", &v];
    id_list(&generate_json_no_logits(vault, &prompt(), 6, &flags)["token_ids"])
}

/// Checks the tier's counters against the claims of `out`'s run: every claim was a hit or
/// a fill, `slots` slots hold experts, and evictions are the fills that found none free.
fn check_counters(out: &Value, slots: u64) {
    let s = &out["stats"];
    let t = &s["vram"];
    let claims: u64 = ["prefill_ring_hits", "prefill_blob_reads", "decode_ring_hits", "decode_blob_reads"]
        .iter()
        .map(|k| s[k].as_u64().unwrap())
        .sum();
    let (hits, fills, evictions) =
        (t["hits"].as_u64().unwrap(), t["fills"].as_u64().unwrap(), t["evictions"].as_u64().unwrap());
    assert_eq!(hits + fills, claims, "hits + fills = expert claims: {t}");
    let held = t["slots"]["filled"].as_u64().unwrap();
    assert_eq!(t["slots"]["in_use"], 0, "nothing in flight after the run: {t}");
    assert_eq!(fills - evictions, held, "every fill without an eviction holds an expert: {t}");
    assert_eq!(held + t["slots"]["empty"].as_u64().unwrap(), slots, "{t}");
}

/// The MoE layers of `vault`.
fn moe_layers(vault: &Path) -> u64 {
    manifest(vault)["experts"]["layers"].as_array().unwrap().len() as u64
}

/// Dispatches of kernels named `name...` in the regime profile `regime`.
fn dispatches(regime: &Value, name: &str) -> u64 {
    let kernels = regime["kernels"].as_array().unwrap();
    let named = |k: &&Value| k["name"].as_str().unwrap().starts_with(name);
    kernels.iter().filter(named).map(|k| k["dispatches"].as_u64().unwrap()).sum()
}

/// Checks that the decode regime's profile `decode` ranked each of the `layers` MoE
/// layers of every device-routed step with kernels named `ranking...`: the step that
/// recorded the kept command buffer and each replay of it.
fn check_rankings(decode: &Value, ranking: &str, layers: u64) {
    let replayed = decode["replayed"].as_u64().unwrap();
    let tables = dispatches(decode, ranking);
    assert!(
        replayed > 0 && tables >= layers * (replayed + 1),
        "{replayed} replayed, {tables} rankings: {decode}"
    );
}

#[test]
fn the_vram_tier_changes_no_byte_at_any_size() {
    let dir = tempfile::tempdir().unwrap();
    for quant in [None, Some("q4_k_m")] {
        let vault = synth(dir.path(), quant);
        let st = strides(&vault);
        let (off, reference) = run(dir.path(), &vault, 0, &[]);
        assert!(off["stats"]["vram"].is_null(), "--vram-bytes 0 turns the tier off");
        // Every expert: 4 layers of 16.
        let all = 64;
        // With the phase profile (which changes no byte): the tier's fills are device time
        // of the expert-upload phase. The fused front is off (lavapipe reports no SM count,
        // so it is off there by default; a GPU would turn it on): `route_table` ranks.
        let (out, logits) = run(dir.path(), &vault, 1 << 30, &["--profile", "--moe-front-groups", "0"]);
        assert_eq!(id_list(&out["token_ids"]), id_list(&off["token_ids"]), "{quant:?}");
        assert!(logits.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "{quant:?}: all");
        check_counters(&out, all);
        assert_eq!(out["stats"]["vram"]["evictions"], 0, "{out}");
        assert!(out["stats"]["vram"]["hits"].as_u64().unwrap() > 0, "{out}");
        // `Phase::ALL` index 9: expert upload, in the prefill regime.
        let upload = &out["stats"]["profile"]["regimes"][0]["phases"][9];
        assert!(upload["device"].as_f64().unwrap() > 0.0, "{upload}");
        // Index 12: with every expert in the tier, decode steps route on the device.
        let routed = &out["stats"]["profile"]["regimes"][1]["phases"][12];
        assert!(routed["calls"].as_u64().unwrap() > 0, "{routed}");
        // Their down projections add the MoE combine themselves (one tier buffer per
        // layer); the logits above are byte-compared with the tier off.
        let decode = &out["stats"]["profile"]["regimes"][1];
        let kernels = decode["kernels"].as_array().unwrap();
        let fused = kernels.iter().filter(|k| k["name"].as_str().unwrap().ends_with("+combine"));
        assert!(fused.map(|k| k["dispatches"].as_u64().unwrap()).sum::<u64>() > 0, "{kernels:?}");
        // Profiled steps replay their kept command buffer too, timestamps and all: the
        // replayed steps' kernels are counted (each ranks its 4 MoE layers, as does the
        // step that recorded the buffer).
        check_rankings(decode, "route_table", 4);
        assert!(kernels.iter().all(|k| k["device"].as_f64().unwrap() > 0.0), "{kernels:?}");
        let norms = dispatches(decode, "rmsnorm");
        // Without the profile, device-routed decode steps after the first replay its kept
        // command buffer: the same bytes.
        let (out, logits) = run(dir.path(), &vault, 1 << 30, &[]);
        assert!(
            logits.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{quant:?}: replayed"
        );
        check_counters(&out, all);
        // Greedy choices only, tier off and on (replayed steps): the same ids.
        for vram in [0, 1 << 30] {
            assert_eq!(
                greedy_ids(&vault, vram),
                id_list(&off["token_ids"]),
                "{quant:?}: greedy, tier {vram}"
            );
        }
        // Device-routed steps that also rank bets (queued as prefetches): the same bytes.
        let (_, logits) = run(dir.path(), &vault, 1 << 30, &["--spec-depth", "3"]);
        assert!(logits.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "{quant:?}: bets");
        // The fused MoE front (router, ranking and gate/up in one dispatch): one workgroup
        // (every barrier met), with bets, and 64 (lavapipe runs a workgroup a thread, so
        // they never all arrive: the front gives up, the pass is computed again
        // host-routed and the front turns off): the same bytes, counters that add up.
        // Each front forms the RMSNorm before it (its dispatch goes).
        let (out, logits) = run(dir.path(), &vault, 1 << 30, &["--profile", "--moe-front-groups", "1"]);
        assert!(logits.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "{quant:?}: front");
        check_counters(&out, all);
        let decode = &out["stats"]["profile"]["regimes"][1];
        check_rankings(decode, "gate_up_front_", 4);
        assert_eq!(dispatches(decode, "rmsnorm") + dispatches(decode, "gate_up_front_"), norms, "{decode}");
        for extra in [&["--moe-front-groups", "1", "--spec-depth", "3"][..], &["--moe-front-groups", "64"]] {
            let (out, logits, err) = run_logged(dir.path(), &vault, 1 << 30, extra);
            assert!(
                logits.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{quant:?}: front, {extra:?}"
            );
            check_counters(&out, all);
            let gave_up = err.contains("did not all run at once");
            assert_eq!(gave_up, extra[1] == "64", "{quant:?}: front, {extra:?}, the give-up: {err}");
        }
        // Two slots: one of each of the two sizes of Q4_K_M, two of bf16's one.
        let two = if st.len() == 1 { 2 * st[0] } else { st.iter().sum() };
        assert!(st.len() <= 2, "{st:?}");
        let (out, logits) = run(dir.path(), &vault, two, &[]);
        assert!(
            logits.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{quant:?}: two slots"
        );
        check_counters(&out, 2);
        assert!(out["stats"]["vram"]["evictions"].as_u64().unwrap() > 0, "{out}");
    }
}

/// The fused MoE front on GGUF vaults, whose routers are f32 (the synth vaults' are
/// bf16), one with Q4_K gate/up and Q6_K down projections: the same bytes as without it,
/// and it ran.
#[test]
fn the_fused_front_reads_f32_routers_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["gguf_f32", "gguf_q4_k_m"] {
        let vault = convert_gguf(name, dir.path());
        let (_, reference) = run(dir.path(), &vault, 1 << 30, &[]);
        let (out, logits) = run(dir.path(), &vault, 1 << 30, &["--profile", "--moe-front-groups", "1"]);
        assert!(logits.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}");
        check_rankings(&out["stats"]["profile"]["regimes"][1], "gate_up_front_", moe_layers(&vault));
    }
}

/// The fused MoE front at Qwen3-Next's routing geometry (512 experts, top-10), which its
/// workgroups rank by sorting rather than counting: the same bytes as the tier off and as
/// `route_table`, and it ran.
#[test]
fn the_fused_front_ranks_512_experts_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let vault = dir.path().join("e512.vault");
    run_ok(&[
        "synth",
        "--out",
        vault.to_str().unwrap(),
        "--preset",
        "tiny-e512",
        "--layers",
        "2",
        "--seed",
        "5",
    ]);
    let (_, reference) = run(dir.path(), &vault, 0, &[]);
    for front in ["0", "1"] {
        let (out, logits) = run(dir.path(), &vault, 1 << 30, &["--profile", "--moe-front-groups", front]);
        assert!(logits.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "front {front}");
        let ranking = if front == "0" { "route_table" } else { "gate_up_front_" };
        check_rankings(&out["stats"]["profile"]["regimes"][1], ranking, 2);
    }
}

/// A hybrid model (DeltaNet states updated in place) routes its decode steps on the device
/// too: a void step's states go back to the copy kept before it, so the step that runs
/// again host-routed starts from them, and later steps replay the kept command buffer
/// (the state copy included). The same bytes as with the tier off, with and without the
/// fused front (one workgroup), and every path ran.
#[test]
fn hybrid_decode_routes_on_the_device_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let vault = dir.path().join("hybrid.vault");
    run_ok(&["synth", "--out", vault.to_str().unwrap(), "--preset", "tiny-hybrid", "--seed", "3"]);
    let (_, reference) = run(dir.path(), &vault, 0, &[]);
    let mut norms = 0;
    for front in ["0", "1"] {
        let (out, logits) = run(dir.path(), &vault, 1 << 30, &["--profile", "--moe-front-groups", front]);
        assert_eq!(logits.len(), reference.len(), "front {front}");
        assert!(logits.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "front {front}");
        // `Phase::ALL` index 12: device-routed MoE steps; 6: the host-routed router gate, which
        // decode runs only when a device-routed step was void (an expert not in the tier yet).
        let decode = &out["stats"]["profile"]["regimes"][1];
        let phases = &decode["phases"];
        assert!(phases[12]["calls"].as_u64().unwrap() > 0, "front {front}: {phases}");
        assert!(phases[6]["calls"].as_u64().unwrap() > 0, "front {front}: no void step ran again: {phases}");
        let ranking = if front == "0" { "route_table" } else { "gate_up_front_" };
        check_rankings(decode, ranking, moe_layers(&vault));
        // Each front forms the RMSNorm before it; the shared expert after it reads the
        // normed row the front stored.
        match front {
            "0" => norms = dispatches(decode, "rmsnorm"),
            _ => assert_eq!(dispatches(decode, "rmsnorm") + dispatches(decode, ranking), norms, "{decode}"),
        }
    }
}

#[test]
fn bad_vram_sizes_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let vault = synth(dir.path(), None);
    let v = vault.to_str().unwrap();
    let stride = strides(&vault)[0];
    let base = ["generate", "--vault", v, "--prompt-ids", "1,2", "--max-tokens", "1", "--backend", "vulkan"];
    let err = run_err(&[&base[..], &["--vram-bytes", "100T"]].concat());
    assert!(err.contains("`vram_bytes` (--vram-bytes)") && err.contains("memory heap"), "{err}");
    let err = run_err(&[&base[..], &["--vram-bytes", "1000"]].concat());
    assert!(
        err.contains("`vram_bytes` (--vram-bytes)") && err.contains(&format!("at least {stride} bytes")),
        "{err}"
    );
    let err = run_err(&[&base[..], &["--vram-bytes", "12 parsecs"]].concat());
    assert!(err.contains("--vram-bytes"), "{err}");
}

#[test]
fn serve_exports_the_vram_metrics() {
    let dir = tempfile::tempdir().unwrap();
    // A fixture with a tokenizer (serve needs one).
    let vault = convert("moe_all", dir.path(), &[]);
    let two = (2 * strides(&vault)[0]).to_string();
    let d = Daemon::start(
        &["--vault", vault.to_str().unwrap(), "--backend", "vulkan", "--vram-bytes", &two],
        &[],
    );
    let body = r#"{"model":"moe_all.vault","prompt":[1,2,3,4,5],"max_tokens":4,"ignore_eos":true}"#;
    let r = http::post(&d.url, "/v1/completions", body);
    assert_eq!(r.status, 200, "{}", r.body);
    let m = http::get(&d.url, "/metrics").body;
    let value = |name: &str| -> f64 {
        let line =
            m.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{name}:\n{m}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let (hits, fills, evictions) =
        (value("smoe_vram_hits_total"), value("smoe_vram_fills_total"), value("smoe_vram_evictions_total"));
    assert!(fills > 0.0 && evictions > 0.0, "{m}");
    assert!(value("smoe_vram_frequency_evictions_total") <= evictions, "{m}");
    assert_eq!(value(r#"smoe_vram_slots{state="filled"}"#), 2.0, "{m}");
    assert_eq!(value(r#"smoe_vram_slots{state="empty"}"#) + value(r#"smoe_vram_slots{state="in_use"}"#), 0.0);
    assert_eq!(fills - evictions, 2.0, "{m}");
    assert_eq!(value("smoe_vram_bytes"), 2.0 * strides(&vault)[0] as f64, "{m}");
    // Every claim went through the tier.
    assert_eq!(hits + fills, value("smoe_ring_hits_total") + value("smoe_ring_misses_total"), "{m}");
}
