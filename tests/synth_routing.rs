//! The `trained` routing profile keeps its promises, measured by the engine itself
//! (`synth --stats`): on a tiny model with Qwen3's routing geometry (128 experts, top-8),
//! adjacent-token overlap and top-16 coverage sit near their targets, expert load stays
//! within its stated spread, and chunk unions grow with chunk size but stay below the
//! `uniform` profile's — so the generator cannot drift silently.

mod common;

use std::path::Path;

use common::*;
use serde_json::Value;

/// How far a measured overlap or coverage may sit from its target.
const BAND: f64 = 0.10;
/// The stated bound on the spread of expert load (coefficient of variation) on 16
/// random prompts of 256 tokens; see README (`synth`). Every MoE layer of the profile
/// has the same statistics, so two layers are measured.
const LOAD_CV: f64 = 0.30;

fn synth(out: &Path, extra: &[&str]) {
    let mut args = vec![
        "synth",
        "--out",
        out.to_str().unwrap(),
        "--preset",
        "tiny-e128",
        "--layers",
        "2",
        "--seed",
        "7",
    ];
    args.extend_from_slice(extra);
    run_ok(&args);
}

/// The per-layer statistics of `vault` on `prompts` random prompts of 256 tokens.
fn stats(vault: &Path, prompts: usize) -> Vec<Value> {
    let n = prompts.to_string();
    let out =
        run_ok(&["synth", "--stats", "--vault", vault.to_str().unwrap(), "--stats-prompts", &n, "--json"]);
    let v: Value = serde_json::from_str(&out).expect("--json prints one JSON object");
    assert_eq!(v["top_k"], 8);
    assert_eq!(v["tokens"], prompts * 256);
    assert_eq!(v["chunk_sizes"], serde_json::json!([16, 64, 256]));
    v["layers"].as_array().unwrap().clone()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("{v} is not a number"))
}

fn unions(layer: &Value) -> Vec<f64> {
    layer["unions"].as_array().unwrap().iter().map(f).collect()
}

#[test]
fn trained_routing_statistics_stay_in_their_bands() {
    let dir = tempfile::tempdir().unwrap();
    let (trained, uniform, custom) =
        (dir.path().join("t.vault"), dir.path().join("u.vault"), dir.path().join("c.vault"));
    synth(&trained, &["--routing", "trained"]);
    synth(&uniform, &[]);
    synth(&custom, &["--routing", "trained", "--overlap", "0.3", "--coverage", "0.47"]);
    let (t, u, c) = (stats(&trained, 16), stats(&uniform, 8), stats(&custom, 8));
    assert_eq!(t.len(), 2);
    for (lt, (lu, lc)) in t.iter().zip(u.iter().zip(&c)) {
        let layer = &lt["layer"];
        for (stat, target) in [("overlap", 0.46), ("coverage", 0.64)] {
            let got = f(&lt[stat]);
            assert!((got - target).abs() <= BAND, "layer {layer}: {stat} {got:.3}, target {target}");
        }
        for (stat, target) in [("overlap", 0.30), ("coverage", 0.47)] {
            let got = f(&lc[stat]);
            assert!(
                (got - target).abs() <= BAND,
                "layer {layer}, custom targets: {stat} {got:.3}, target {target}"
            );
        }
        let cv = f(&lt["load_cv"]);
        assert!(cv <= LOAD_CV, "layer {layer}: load CV {cv:.3} above {LOAD_CV}");
        assert!(f(&lt["load_min"]) > 0.0, "layer {layer}: an expert is never used");
        let (ut, uu) = (unions(lt), unions(lu));
        assert!(
            ut.windows(2).all(|w| w[0] < w[1]),
            "layer {layer}: unions {ut:?} do not grow with the chunk"
        );
        assert!(
            ut.iter().zip(&uu).all(|(a, b)| a <= b),
            "layer {layer}: unions {ut:?} not below uniform's {uu:?}"
        );
        assert!(
            ut[0] < uu[0] - 10.0 && ut[1] < uu[1] - 10.0,
            "layer {layer}: unions {ut:?} vs uniform {uu:?}"
        );
        assert!(ut[1] > 32.0 && ut[1] < 0.85 * 128.0, "layer {layer}: a 64-token chunk touches {}", ut[1]);
        // Uniform routing has almost no token-to-token locality (8/128 by chance).
        assert!(f(&lu["overlap"]) < 0.2, "layer {layer}: uniform overlap {}", lu["overlap"]);
    }
}

#[test]
fn stats_reject_bad_options() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x");
    let o = out.to_str().unwrap();
    let err = run_err(&["synth", "--out", o, "--preset", "tiny", "--overlap", "0.5"]);
    assert!(err.contains("--routing trained"), "{err}");
    let err = run_err(&["synth", "--out", o, "--preset", "tiny", "--routing", "trained", "--overlap", "1.5"]);
    assert!(err.contains("--overlap") && err.contains("between 0 and 1"), "{err}");
    let err = run_err(&["synth", "--out", o, "--preset", "tiny", "--format", "hf", "--stats"]);
    assert!(err.contains("convert"), "{err}");
    let err = run_err(&["synth", "--stats", "--vault", o]);
    assert!(err.contains(o), "{err}");
    let err = run_err(&["synth", "--vault", o]);
    assert!(err.contains("--stats"), "{err}");
}
