//! Helpers shared by the integration tests: fixture paths, running the binary,
//! converting fixtures into temporary vaults.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use smoe_actors::contract::ForwardError;
use smoe_actors::contract::ForwardPass;
use smoe_actors::generation::{generate, GenerateRequest};
use smoe_proto::{FinishReason, GenerateStats};

/// Names of the golden fixtures made by `tests/fixtures/make_fixtures.py`.
pub const FIXTURES: &[&str] = &["moe_all", "dense0_gqa", "bf16_sharded"];

/// Names of the hybrid-family golden fixtures (Qwen3-Next, Qwen3.5-MoE) made by
/// `tests/fixtures/hybrid_fixtures.py`.
pub const HYBRID_FIXTURES: &[&str] = &["next_f32", "next_bf16", "q35_f32", "q35_vl_bf16"];

/// Path of a fixture checkpoint directory.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// Copies fixture `name` into `dir` and returns the copy's path.
pub fn copy_fixture(name: &str, dir: &Path) -> PathBuf {
    let dst = dir.join(name);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
    dst
}

/// Runs the `smoe-pipeline` binary with `args`.
pub fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smoe-pipeline"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("the binary runs")
}

/// Runs the binary and asserts success; returns stdout.
pub fn run_ok(args: &[&str]) -> String {
    let out = run(args);
    assert!(out.status.success(), "smoe-pipeline {args:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

/// Runs the binary expecting a clean failure (exit 1, an `error:` line, no panic);
/// returns stderr.
pub fn run_err(args: &[&str]) -> String {
    let out = run(args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    let code = out.status.code();
    assert!(
        code == Some(1) || code == Some(2),
        "expected exit 1 (or 2 for usage) for {args:?}, got {code:?}, stderr:\n{err}"
    );
    assert!(!err.contains("panicked"), "panic for {args:?}:\n{err}");
    assert!(err.contains("error:"), "no error line for {args:?}:\n{err}");
    err
}

/// Converts fixture `name` into a vault inside `dir`; returns the vault path.
pub fn convert(name: &str, dir: &Path, extra: &[&str]) -> PathBuf {
    let out = dir.join(format!("{name}.vault"));
    let hf = fixture(name);
    let mut args = vec!["convert", "--hf", hf.to_str().unwrap(), "--out", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    run_ok(&args);
    out
}

/// Converts the GGUF fixture `name` (`tests/fixtures/<name>/model.gguf`) into a vault
/// inside `dir`; returns the vault path.
pub fn convert_gguf(name: &str, dir: &Path) -> PathBuf {
    let out = dir.join(format!("{name}.vault"));
    let gguf = fixture(name).join("model.gguf");
    run_ok(&["convert", "--gguf", gguf.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    out
}

/// A copy of the GGUF file `bytes` whose 2-D tensor `name` has ggml type id `to` in
/// its info (name, `u32` dimension count, two `u64` dims, then the type id), asserting
/// it had `from`. The data is left as it was.
pub fn retype_gguf_tensor(bytes: &[u8], name: &str, from: u32, to: u32) -> Vec<u8> {
    let mut b = bytes.to_vec();
    let n = name.as_bytes();
    let at = b.windows(n.len()).position(|w| w == n).unwrap() + n.len() + 4 + 16;
    assert_eq!(b[at..at + 4], from.to_le_bytes(), "type id of {name}");
    b[at..at + 4].copy_from_slice(&to.to_le_bytes());
    b
}

/// Largest |logit − transformers' logit| the golden tests accept.
pub const GOLDEN_TOLERANCE: f32 = 1e-4;

/// Runs every golden case of fixture `name` on `vault` (files into `dir`): greedy ids
/// equal to transformers', logits within [`GOLDEN_TOLERANCE`], stats consistent.
pub fn check_golden(name: &str, vault: &Path, dir: &Path) {
    let golden = fixture(name).join("golden_logits.safetensors");
    for (i, (prompt, greedy)) in golden_cases(name).iter().enumerate() {
        let lpath = dir.join(format!("logits{i}.safetensors"));
        let out = generate_json(vault, prompt, greedy.len(), &lpath, &[]);
        assert_eq!(
            &id_list(&out["token_ids"]),
            greedy,
            "{name} case {i}: greedy ids differ from transformers"
        );
        assert_eq!(id_list(&out["prompt_ids"]), *prompt);
        let (shape, ours) = read_f32(&lpath, "logits");
        let (gshape, theirs) = read_f32(&golden, &format!("case{i}"));
        assert_eq!(shape, gshape, "{name} case {i}: logits shape");
        let max = ours.iter().zip(&theirs).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(max <= GOLDEN_TOLERANCE, "{name} case {i}: max |logit diff| {max} > {GOLDEN_TOLERANCE}");
        let stats = &out["stats"];
        assert_eq!(stats["prefill_tokens"].as_u64().unwrap() as usize, prompt.len());
        assert_eq!(stats["decode_tokens"].as_u64().unwrap() as usize, greedy.len() - 1);
        assert!(stats["blob_reads"].as_u64().unwrap() > 0);
    }
}

/// The golden cases of a fixture: (prompt ids, greedy ids).
pub fn golden_cases(name: &str) -> Vec<(Vec<u32>, Vec<u32>)> {
    let g: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("golden.json")).unwrap()).unwrap();
    g["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let ids = |k: &str| c[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            (ids("prompt_ids"), ids("greedy_ids"))
        })
        .collect()
}

/// Reads the f32 tensor `name` of a safetensors file.
pub fn read_f32(path: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    let data = t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    (t.shape().to_vec(), data)
}

/// Comma-separated ids.
pub fn ids_arg(ids: &[u32]) -> String {
    ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

/// Runs `generate --json` on `vault` with `prompt` for `n` tokens (EOS ignored),
/// writing logits to `logits`; returns the parsed JSON.
pub fn generate_json(vault: &Path, prompt: &[u32], n: usize, logits: &Path, extra: &[&str]) -> Value {
    let mut flags = vec!["--logits-out", logits.to_str().unwrap()];
    flags.extend_from_slice(extra);
    generate_json_no_logits(vault, prompt, n, &flags)
}

/// [`generate_json`] keeping no logits (as `serve` runs: a greedy step then hands back
/// only its greedy choice), unless `extra` asks for them.
pub fn generate_json_no_logits(vault: &Path, prompt: &[u32], n: usize, extra: &[&str]) -> Value {
    generate_json_logged(vault, prompt, n, extra).0
}

/// [`generate_json_no_logits`], also handing back what the run logged (its stderr).
pub fn generate_json_logged(vault: &Path, prompt: &[u32], n: usize, extra: &[&str]) -> (Value, String) {
    let p = ids_arg(prompt);
    let n = n.to_string();
    let mut args = vec![
        "generate",
        "--vault",
        vault.to_str().unwrap(),
        "--prompt-ids",
        &p,
        "--max-tokens",
        &n,
        "--ignore-eos",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = run(&args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "smoe-pipeline {args:?} failed:\n{err}");
    (serde_json::from_slice(&out.stdout).expect("generate --json prints JSON"), err)
}

/// Token ids of a JSON array field.
pub fn id_list(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Runs `req` on `fwd` from `kv` to its end (never cancelled); returns why it stopped,
/// its stats and the generated ids.
pub fn generate_ids<P: ForwardPass>(
    fwd: &mut P,
    kv: &mut P::Kv,
    req: &GenerateRequest,
) -> Result<(FinishReason, GenerateStats, Vec<u32>), ForwardError> {
    let mut ids = Vec::new();
    let (reason, stats) = generate(
        fwd,
        kv,
        req,
        || false,
        |id, _| {
            ids.push(id);
            true
        },
    )?;
    Ok((reason, stats, ids))
}
