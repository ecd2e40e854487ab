//! Every parser of untrusted bytes (`smoe_pipeline::parsers`) returns a value or an
//! error, never panics or hangs: a bounded property run over random bytes, random edits
//! of valid inputs and valid inputs with numbers swapped for extreme ones, plus the
//! findings of the fuzz targets (`fuzz/`, `bench/fuzz.sh`) as regression tests.

use std::path::PathBuf;

use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::{json, Value};
use smoe_pipeline::parsers;

fn fixture(rel: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(rel);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// A valid vault manifest (`convert --hf tests/fixtures/moe_all`).
fn manifest_seed() -> Vec<u8> {
    fixture("manifest/moe_all.json")
}

/// A valid GGUF model.
fn gguf_seed() -> Vec<u8> {
    fixture("gguf_q8_0/model.gguf")
}

fn chat_seed() -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": parsers::demo_model_id(),
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3,
        "stop": ["\n", "end"], "stream": true, "stream_options": {"include_usage": true}
    }))
    .unwrap()
}

fn completion_seed() -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": parsers::demo_model_id(), "prompt": "Once upon a time", "max_tokens": 8,
        "repetition_penalty": 1.1, "stop": "x"
    }))
    .unwrap()
}

fn completion_ids_seed() -> Vec<u8> {
    serde_json::to_vec(&json!({"model": parsers::demo_model_id(), "prompt": [1, 2, 3], "max_tokens": 4}))
        .unwrap()
}

/// The repository's example config.
fn config_seed() -> Vec<u8> {
    std::fs::read(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("smoe.toml")).unwrap()
}

fn safetensors_seed() -> Vec<u8> {
    fixture("moe_all/model.safetensors")
}

/// Numbers that find overflows and unchecked counts.
const EXTREMES: &[i128] = &[
    0,
    1,
    -1,
    2,
    63,
    64,
    65535,
    65536,
    1_000_000_000,
    1 << 31,
    u32::MAX as i128,
    1 << 32,
    1 << 62,
    i64::MAX as i128,
    (1 << 63) + 1,
    u64::MAX as i128 - 63,
    u64::MAX as i128,
];

/// A random edit of `bytes`: overwrite, insert, delete or truncate, or an extreme
/// little-endian `u32`/`u64` written over any offset.
#[derive(Clone, Debug)]
enum Edit {
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
    Truncate(usize),
    Number(usize, usize, bool),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Set(i, b)),
        (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..16)).prop_map(|(i, v)| Edit::Insert(i, v)),
        (any::<usize>(), 1..64usize).prop_map(|(i, n)| Edit::Delete(i, n)),
        any::<usize>().prop_map(Edit::Truncate),
        (any::<usize>(), 0..EXTREMES.len(), any::<bool>()).prop_map(|(i, x, wide)| Edit::Number(i, x, wide)),
    ]
}

fn apply(mut b: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    for e in edits {
        let at = |i: usize, len: usize| if len == 0 { 0 } else { i % len };
        match e {
            Edit::Set(i, v) if !b.is_empty() => {
                let i = at(*i, b.len());
                b[i] = *v;
            }
            Edit::Insert(i, v) => {
                let i = at(*i, b.len() + 1);
                b.splice(i..i, v.iter().copied());
            }
            Edit::Delete(i, n) if !b.is_empty() => {
                let i = at(*i, b.len());
                b.drain(i..(i + n).min(b.len()));
            }
            Edit::Truncate(i) => b.truncate(at(*i, b.len() + 1)),
            Edit::Number(i, x, wide) => {
                let v = EXTREMES[*x] as u64;
                let bytes = if *wide { v.to_le_bytes().to_vec() } else { (v as u32).to_le_bytes().to_vec() };
                if b.len() >= bytes.len() {
                    let i = at(*i, b.len() - bytes.len() + 1);
                    b[i..i + bytes.len()].copy_from_slice(&bytes);
                }
            }
            _ => {}
        }
    }
    b
}

fn count_numbers(v: &Value) -> usize {
    match v {
        Value::Number(_) => 1,
        Value::Array(a) => a.iter().map(count_numbers).sum(),
        Value::Object(o) => o.values().map(count_numbers).sum(),
        _ => 0,
    }
}

/// Replaces the `pick`-th number of `v` (in document order) with `n`; false when `v`
/// has fewer.
fn replace_number(v: &mut Value, pick: &mut usize, n: &Value) -> bool {
    match v {
        Value::Number(_) if *pick == 0 => {
            *v = n.clone();
            true
        }
        Value::Number(_) => {
            *pick -= 1;
            false
        }
        Value::Array(a) => a.iter_mut().any(|x| replace_number(x, pick, n)),
        Value::Object(o) => o.values_mut().any(|x| replace_number(x, pick, n)),
        _ => false,
    }
}

/// `v` with its `pick`-th number (wrapping) replaced by the extreme number `extreme`.
fn swap_number(mut v: Value, pick: usize, extreme: usize) -> Value {
    let x = EXTREMES[extreme];
    let n = if x < 0 { json!(x as i64) } else { json!(x as u64) };
    let mut pick = pick % count_numbers(&v).max(1);
    replace_number(&mut v, &mut pick, &n);
    v
}

fn json_swap(seed: &[u8], pick: usize, extreme: usize) -> Vec<u8> {
    serde_json::to_vec(&swap_number(serde_json::from_slice(seed).unwrap(), pick, extreme)).unwrap()
}

/// Runs `parse`: it must return (a panic fails the property).
fn returns(parse: impl Fn(&[u8]) -> anyhow::Result<()>, bytes: &[u8]) {
    let _ = parse(bytes);
}

fn request_both(bytes: &[u8]) -> anyhow::Result<()> {
    parsers::request_body(bytes, true).and(parsers::request_body(bytes, false))
}

type Parser = fn(&[u8]) -> anyhow::Result<()>;

/// Every parser with its valid seeds.
fn parsers_and_seeds() -> Vec<(&'static str, Parser, Vec<Vec<u8>>)> {
    vec![
        ("manifest", parsers::manifest as Parser, vec![manifest_seed()]),
        ("config", parsers::config_toml, vec![config_seed()]),
        ("request", request_both, vec![chat_seed(), completion_seed(), completion_ids_seed()]),
        ("safetensors", parsers::safetensors, vec![safetensors_seed()]),
        ("gguf", parsers::gguf, vec![gguf_seed()]),
    ]
}

#[test]
fn valid_seeds_parse() {
    parsers::manifest(&manifest_seed()).unwrap();
    parsers::config_toml(&config_seed()).unwrap();
    parsers::request_body(&chat_seed(), true).unwrap();
    parsers::request_body(&completion_seed(), false).unwrap();
    parsers::request_body(&completion_ids_seed(), false).unwrap();
    parsers::safetensors(&safetensors_seed()).unwrap();
    parsers::gguf(&gguf_seed()).unwrap();
    // The endpoints refuse each other's bodies.
    assert!(parsers::request_body(&chat_seed(), false).is_err());
    assert!(parsers::request_body(&completion_seed(), true).is_err());
}

proptest! {
    #![proptest_config(Config { cases: 256, failure_persistence: None, ..Config::default() })]

    #[test]
    fn random_bytes_never_panic(which in 0..5usize, bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let (_, parse, _) = parsers_and_seeds()[which];
        returns(parse, &bytes);
    }

    #[test]
    fn edited_seeds_never_panic(which in 0..5usize, seed in any::<usize>(), edits in proptest::collection::vec(edit(), 1..6)) {
        let (_, parse, seeds) = &parsers_and_seeds()[which];
        let bytes = apply(seeds[seed % seeds.len()].clone(), &edits);
        returns(*parse, &bytes);
    }

    #[test]
    fn extreme_numbers_in_json_never_panic(which in 0..4usize, pick in any::<usize>(), extreme in 0..EXTREMES.len()) {
        let (parse, seed): (Parser, Vec<u8>) = match which {
            0 => (parsers::manifest, manifest_seed()),
            1 => (request_both, chat_seed()),
            2 => (request_both, completion_seed()),
            _ => (request_both, completion_ids_seed()),
        };
        returns(parse, &json_swap(&seed, pick, extreme));
    }

    #[test]
    fn extreme_numbers_in_toml_never_panic(line in any::<usize>(), extreme in 0..EXTREMES.len()) {
        // Each `key = number` line of the example config gets an extreme number.
        let text = String::from_utf8(config_seed()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let numeric: Vec<usize> = (0..lines.len())
            .filter(|&i| lines[i].split_once('=').is_some_and(|(_, v)| v.trim().parse::<f64>().is_ok()))
            .collect();
        prop_assume!(!numeric.is_empty());
        let i = numeric[line % numeric.len()];
        let key = lines[i].split_once('=').unwrap().0.trim().trim_start_matches('#').trim();
        let mut out: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
        out[i] = format!("{key} = {}", EXTREMES[extreme]);
        returns(parsers::config_toml, out.join("\n").as_bytes());
    }
}

// Findings of the fuzz targets and the property run, each an error now.

/// `manifest.json` with `edit` applied to its JSON.
fn manifest_with(edit: impl FnOnce(&mut Value)) -> Vec<u8> {
    let mut v: Value = serde_json::from_slice(&manifest_seed()).unwrap();
    edit(&mut v);
    serde_json::to_vec(&v).unwrap()
}

fn manifest_err(edit: impl FnOnce(&mut Value)) -> String {
    format!("{:#}", parsers::manifest(&manifest_with(edit)).expect_err("a broken manifest must be an error"))
}

#[test]
fn a_blob_offset_near_2_pow_64_is_an_error() {
    let e = manifest_err(|v| v["experts"]["layers"][0]["blobs"][1]["offset"] = json!(u64::MAX - 4095));
    assert!(e.contains("misaligned or past the end"), "{e}");
}

#[test]
fn an_expert_layout_whose_size_overflows_is_an_error() {
    let e = manifest_err(|v| {
        v["model"]["hidden_size"] = json!(1u64 << 40);
        v["model"]["moe_intermediate_size"] = json!(1u64 << 40);
    });
    assert!(e.contains("expert layout") || e.contains("KV cache"), "{e}");
    let e = manifest_err(|v| v["model"]["moe_intermediate_size"] = json!(1u64 << 58));
    assert!(e.contains("expert layout"), "{e}");
}

#[test]
fn a_layer_count_past_the_limit_is_an_error_not_a_hang() {
    for experts in [0, 8] {
        let e = manifest_err(|v| {
            v["model"]["num_hidden_layers"] = json!(1_000_000_000_000_000u64);
            v["model"]["num_experts"] = json!(experts);
        });
        assert!(e.contains("num_hidden_layers"), "{e}");
    }
}

#[test]
fn a_long_mlp_only_layers_list_is_not_quadratic() {
    let e = manifest_with(|v| {
        v["model"]["num_hidden_layers"] = json!(65535);
        v["model"]["mlp_only_layers"] = json!((0..200_000u64).map(|i| i + 70_000).collect::<Vec<_>>());
    });
    let t = std::time::Instant::now();
    assert!(parsers::manifest(&e).is_err());
    assert!(t.elapsed().as_secs() < 5, "took {:?}", t.elapsed());
}

#[test]
fn a_resident_tensor_whose_shape_overflows_is_an_error() {
    let e = manifest_err(|v| v["resident"]["tensors"][0]["shape"] = json!([1u64 << 40, 1u64 << 40, 64]));
    assert!(e.contains("does not fit its shape"), "{e}");
}

#[test]
fn a_kv_cache_that_overflows_is_an_error() {
    let e = manifest_err(|v| v["model"]["max_position_embeddings"] = json!(u64::MAX));
    assert!(e.contains("KV cache"), "{e}");
}

/// The GGUF seed with the `u32` value of metadata key `key` set to `value`.
fn gguf_with_u32(key: &str, value: u32) -> Vec<u8> {
    let mut b = gguf_seed();
    let at = b.windows(key.len()).position(|w| w == key.as_bytes()).expect("key present") + key.len();
    assert_eq!(b[at..at + 4], 4u32.to_le_bytes(), "{key} is a u32");
    b[at + 4..at + 8].copy_from_slice(&value.to_le_bytes());
    b
}

#[test]
fn a_gguf_block_count_of_a_billion_is_an_error_not_a_hang() {
    let t = std::time::Instant::now();
    let e = parsers::gguf(&gguf_with_u32("qwen3moe.block_count", 1_000_000_000)).unwrap_err();
    assert!(format!("{e:#}").contains("block_count"), "{e:#}");
    assert!(t.elapsed().as_secs() < 5, "took {:?}", t.elapsed());
}

#[test]
fn a_tensor_named_twice_in_one_gguf_is_an_error() {
    let mut b = gguf_seed();
    let (first, second) = (b"blk.0.attn_q.weight", b"blk.1.attn_q.weight");
    let at = b.windows(second.len()).position(|w| w == second).expect("tensor present");
    b[at..at + first.len()].copy_from_slice(first);
    let e = format!("{:#}", parsers::gguf(&b).unwrap_err());
    assert!(e.contains("appears twice"), "{e}");
}
