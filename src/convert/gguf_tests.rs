//! Tests of the GGUF reader: files written by gguf-py (tests/fixtures/make_gguf.py)
//! read as gguf-py's own reader reads them, and one test per malformed-file error on
//! small GGUFs written here.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use super::*;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf")
}

/// gguf-py's name of a value type (`GGUFValueType`: `UINT8`, `FLOAT32`, `STRING`, ...).
fn py_type(t: ValueType) -> String {
    let name = t.name();
    let (head, bits) = name.split_at(1);
    match head {
        _ if bits.parse::<u32>().is_err() => name.to_uppercase(),
        "u" => format!("UINT{bits}"),
        "i" => format!("INT{bits}"),
        _ => format!("FLOAT{bits}"),
    }
}

/// The type list and (nested arrays flattened) value gguf-py's `ReaderField` reports.
fn py_view(v: &Value) -> (Vec<String>, Vec<Json>) {
    match v {
        Value::Array(t, items) => {
            let mut types = vec![py_type(ValueType::Array)];
            let mut flat = Vec::new();
            for it in items {
                let (ts, vs) = py_view(it);
                if types.len() == 1 {
                    types.extend(ts);
                }
                flat.extend(vs);
            }
            if items.is_empty() {
                types.push(py_type(*t));
            }
            (types, flat)
        }
        v => {
            let j = match v {
                Value::String(s) => Json::from(s.as_str()),
                Value::Bool(b) => Json::from(*b),
                Value::F32(f) => Json::from(*f as f64),
                Value::F64(f) => Json::from(*f),
                Value::I8(_) | Value::I16(_) | Value::I32(_) | Value::I64(_) => {
                    Json::from(v.as_f64().unwrap() as i64)
                }
                _ => Json::from(v.as_u64().unwrap()),
            };
            (vec![py_type(v.value_type())], vec![j])
        }
    }
}

#[test]
fn reads_gguf_py_files_as_gguf_py_does() {
    let dir = fixture_dir();
    let expected: Json =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    for first in ["tiny.gguf", "split-00001-of-00003.gguf"] {
        let g = GgufFile::open(&dir.join(first)).unwrap();
        let names: Vec<String> =
            g.parts().iter().map(|p| p.path.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(names.len(), if first == "tiny.gguf" { 1 } else { 3 });
        // Metadata of the first part, key by key.
        let fields = expected[first]["fields"].as_object().unwrap();
        assert_eq!(g.metadata().len(), fields.len(), "{first}");
        for (key, v) in g.metadata() {
            let (types, values) = py_view(v);
            let want = &fields[key];
            let want_types: Vec<String> =
                want["types"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect();
            assert_eq!(types, want_types, "{first} {key}");
            let want_values = match &want["value"] {
                Json::Array(a) => a.clone(),
                j => vec![j.clone()],
            };
            assert_eq!(values.len(), want_values.len(), "{first} {key}");
            for (a, b) in values.iter().zip(&want_values) {
                match (a.as_f64(), b.as_f64()) {
                    (Some(x), Some(y)) if a.is_f64() || b.is_f64() => assert_eq!(x, y, "{first} {key}"),
                    _ => assert_eq!(a, b, "{first} {key}"),
                }
            }
        }
        // Tensors of every part: dims, type, absolute offset, size.
        for (i, part) in g.parts().iter().enumerate() {
            let want = expected[names[i].as_str()]["tensors"].as_array().unwrap();
            let ours: Vec<&TensorInfo> = g.tensors().iter().filter(|t| t.part == i).collect();
            assert_eq!(ours.len(), want.len(), "{}", names[i]);
            for (t, w) in ours.iter().zip(want) {
                assert_eq!(t.name, w["name"].as_str().unwrap());
                let dims: Vec<u64> =
                    w["dims"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
                assert_eq!(t.dims, dims, "{}", t.name);
                assert_eq!(u64::from(t.ty.id()), w["type"].as_u64().unwrap(), "{}", t.name);
                assert_eq!(part.data_start + t.offset, w["data_offset"].as_u64().unwrap(), "{}", t.name);
                assert_eq!(t.size, w["n_bytes"].as_u64().unwrap(), "{}", t.name);
            }
        }
    }
}

#[test]
fn accessors_and_tensor_bytes() {
    let dir = fixture_dir();
    let g = GgufFile::open(&dir.join("tiny.gguf")).unwrap();
    let s = GgufFile::open(&dir.join("split-00001-of-00003.gguf")).unwrap();
    assert_eq!(g.architecture().unwrap(), "qwen3moe");
    assert_eq!(g.parts()[0].alignment, 64);
    assert_eq!(s.parts()[2].alignment, 32);
    assert_eq!((g.parts()[0].version, g.parts()[0].data_start % 64), (3, 0));
    assert_eq!(g.get_str("general.name").unwrap(), "tiny ✓");
    assert_eq!(g.get_u64("qwen3moe.block_count").unwrap(), 1);
    assert_eq!(g.get_u64("test.u64").unwrap(), 1 << 63);
    assert_eq!(g.get_f64("qwen3moe.rope.freq_base").unwrap(), 1e6);
    assert_eq!(g.get_str_array("tokenizer.ggml.tokens").unwrap(), ["a", "b", "<|im_end|>", "é"]);
    assert_eq!(g.get("test.i8"), Some(&Value::I8(-100)));
    assert_eq!(g.get("test.nested").unwrap().to_string(), "[[1, 2], [3], [4, 5, 6]]");
    assert!(matches!(g.get_u64("test.i32"), Err(GgufError::KeyType { .. })));
    assert!(matches!(g.get_str("test.bool"), Err(GgufError::KeyType { .. })));
    assert!(matches!(g.get_str_array("test.floats"), Err(GgufError::KeyType { .. })));
    let e = g.get_u64("qwen3moe.expert_count").unwrap_err();
    assert!(
        matches!(e, GgufError::MissingKey { .. }) && e.to_string().contains("qwen3moe.expert_count"),
        "{e}"
    );
    assert!(matches!(g.tensor("nope"), Err(GgufError::NoTensor(_))));
    let q = g.tensor("blk.0.ffn_gate_exps.weight").unwrap();
    assert_eq!((q.ty, q.shape(), q.rows(), q.cols()), (GgmlType::Q8_0, vec![2, 3, 64], 6, 64));
    // The same tensors (same seed) in one file at alignment 64 and split over three
    // files at alignment 32: identical bytes.
    for t in g.tensors() {
        assert_eq!(g.tensor_data(&t.name).unwrap(), s.tensor_data(&t.name).unwrap(), "{}", t.name);
        assert_eq!(g.tensor_data(&t.name).unwrap().len() as u64, t.size);
    }
    let norm = g.tensor_data("blk.0.attn_norm.weight").unwrap();
    let q_row0 = &g.tensor_data("blk.0.attn_q.weight").unwrap()[..20];
    assert_eq!(norm, q_row0, "attn_norm is row 0 of attn_q in make_gguf.py");
    g.check_supported().unwrap();
}

// ----------------------------------------------------------------------------------------
// Small GGUFs written here, each broken in one way.

/// Encodes a GGUF string.
fn gstr(s: &[u8]) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s);
    v
}

/// A tensor as written: its info fields, its data, and an offset to write instead of
/// the computed one.
#[derive(Clone)]
struct RawTensor {
    name: String,
    dims: Vec<u64>,
    id: u32,
    data: Vec<u8>,
    offset: Option<u64>,
}

/// A GGUF file under construction: raw metadata pairs and tensors.
#[derive(Clone)]
struct Builder {
    version: u32,
    kv: Vec<(Vec<u8>, u32, Vec<u8>)>,
    tensors: Vec<RawTensor>,
    alignment: u64,
}

impl Builder {
    fn new() -> Builder {
        Builder { version: 3, kv: Vec::new(), tensors: Vec::new(), alignment: 32 }.kv(
            b"general.architecture",
            8,
            gstr(b"qwen3moe"),
        )
    }

    fn kv(mut self, key: &[u8], code: u32, payload: Vec<u8>) -> Builder {
        self.kv.push((key.to_vec(), code, payload));
        self
    }

    fn tensor(mut self, name: &str, dims: &[u64], ty: GgmlType) -> Builder {
        let elems: u64 = dims.iter().product();
        let size = (elems / ty.block_elems() as u64 * ty.block_bytes() as u64) as usize;
        self.tensors.push(RawTensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            id: ty.id(),
            data: vec![0x11; size],
            offset: None,
        });
        self
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(self.version.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend((self.kv.len() as u64).to_le_bytes());
        for (k, code, payload) in &self.kv {
            b.extend(gstr(k));
            b.extend(code.to_le_bytes());
            b.extend(payload);
        }
        // Tensor data aligned, the file ending where the last tensor ends.
        let mut data = Vec::new();
        for t in &self.tensors {
            let offset = (data.len() as u64).next_multiple_of(self.alignment);
            data.resize(offset as usize, 0);
            data.extend(&t.data);
            b.extend(gstr(t.name.as_bytes()));
            b.extend((t.dims.len() as u32).to_le_bytes());
            t.dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
            b.extend(t.id.to_le_bytes());
            b.extend(t.offset.unwrap_or(offset).to_le_bytes());
        }
        b.resize((b.len() as u64).next_multiple_of(self.alignment) as usize, 0);
        b.extend(data);
        b
    }

    fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, self.bytes()).unwrap();
        p
    }
}

fn open_bytes(bytes: &[u8]) -> Result<GgufFile> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    std::fs::write(&p, bytes).unwrap();
    GgufFile::open(&p)
}

/// Opens a broken file, expects an error whose message contains every `parts`.
fn expect_err(bytes: &[u8], parts: &[&str]) -> GgufError {
    let e = open_bytes(bytes).expect_err("a malformed file must be an error");
    let msg = e.to_string();
    for p in parts {
        assert!(msg.contains(p), "{msg:?} should mention {p:?}");
    }
    e
}

fn u32b(v: u32) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

#[test]
fn a_valid_built_file_opens() {
    let b = Builder::new().tensor("w", &[32, 2], GgmlType::Q8_0).tensor("n", &[7], GgmlType::F32);
    let g = open_bytes(&b.bytes()).unwrap();
    assert_eq!(g.tensors().len(), 2);
    assert_eq!(g.tensor_data("w").unwrap(), &[0x11; 68][..]);
    assert_eq!(g.tensor("n").unwrap().offset, 96);
}

#[test]
fn header_errors() {
    let good = Builder::new().tensor("w", &[32], GgmlType::Q8_0).bytes();
    let mut bad = good.clone();
    bad[3] = b'X';
    assert!(matches!(expect_err(&bad, &["not a GGUF file"]), GgufError::Magic { .. }));
    expect_err(b"GG", &["truncated", "magic"]);
    let mut v1 = good.clone();
    v1[4..8].copy_from_slice(&1u32.to_le_bytes());
    expect_err(&v1, &["version 1", "supported: 2 and 3"]);
    let mut be = good.clone();
    be[4..8].copy_from_slice(&3u32.to_be_bytes());
    expect_err(&be, &["big-endian"]);
    let mut v2 = good.clone();
    v2[4..8].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(open_bytes(&v2).unwrap().parts()[0].version, 2);
    for cut in [10, 20, 30, 60] {
        expect_err(&good[..cut], &["truncated", "offset"]);
    }
}

#[test]
fn counts_that_cannot_fit_are_errors_not_allocations() {
    let good = Builder::new().bytes();
    let mut kv = good.clone();
    kv[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    expect_err(&kv, &["metadata count", "cannot fit"]);
    let mut tc = good.clone();
    tc[8..16].copy_from_slice(&(u64::MAX / 3).to_le_bytes());
    expect_err(&tc, &["tensor count", "cannot fit"]);
    let mut arr = u32b(4);
    arr.extend((u64::MAX / 2).to_le_bytes());
    expect_err(&Builder::new().kv(b"a", 9, arr).bytes(), &["value of a", "cannot fit"]);
    let mut huge_str = u64::MAX.to_le_bytes().to_vec();
    huge_str.extend(b"x");
    expect_err(&Builder::new().kv(b"s", 8, huge_str).bytes(), &["truncated", "value of s"]);
}

#[test]
fn metadata_errors() {
    expect_err(&Builder::new().kv(b"k", 13, vec![0; 8]).bytes(), &["unknown value type 13"]);
    expect_err(&Builder::new().kv(b"k", 7, vec![2]).bytes(), &["bool byte 2"]);
    expect_err(&Builder::new().kv(b"k\xff", 4, u32b(1)).bytes(), &["metadata key", "not UTF-8"]);
    expect_err(&Builder::new().kv(b"k", 4, u32b(1)).kv(b"k", 4, u32b(2)).bytes(), &["duplicate key k"]);
    let mut arr = u32b(14);
    arr.extend(1u64.to_le_bytes());
    expect_err(&Builder::new().kv(b"k", 9, arr).bytes(), &["unknown array element type 14"]);
    // Arrays nested nine deep.
    let mut nested = u32b(4);
    nested.extend(0u64.to_le_bytes());
    for _ in 0..8 {
        let mut outer = u32b(9);
        outer.extend(1u64.to_le_bytes());
        outer.extend(nested);
        nested = outer;
    }
    expect_err(&Builder::new().kv(b"k", 9, nested.clone()).bytes(), &["nested deeper than 8"]);
    let shallower = nested[12..].to_vec();
    assert!(open_bytes(&Builder::new().kv(b"k", 9, shallower).bytes()).is_ok());
    for (code, payload) in [(4, u32b(0)), (4, u32b(48)), (10, 64u64.to_le_bytes().to_vec())] {
        expect_err(&Builder::new().kv(b"general.alignment", code, payload).bytes(), &["power of two"]);
    }
}

#[test]
fn tensor_info_errors() {
    let one = |dims: &[u64], ty: GgmlType| Builder::new().tensor("blk.0.w", dims, ty);
    let mut five = one(&[32], GgmlType::F32);
    five.tensors[0].dims = vec![1; 5];
    expect_err(&five.bytes(), &["blk.0.w", "5 dimensions"]);
    let mut overflow = one(&[256], GgmlType::Q4K);
    overflow.tensors[0].dims = vec![256, u64::MAX, 2];
    expect_err(&overflow.bytes(), &["blk.0.w", "overflow"]);
    let mut partial = one(&[256], GgmlType::Q4K);
    partial.tensors[0].dims = vec![100];
    expect_err(&partial.bytes(), &["blk.0.w", "whole blocks of 256"]);
    let mut unknown = one(&[32], GgmlType::F32);
    unknown.tensors[0].id = 4;
    let e = expect_err(&unknown.bytes(), &["blk.0.w", "unknown ggml type id 4"]);
    assert!(matches!(e, GgufError::UnknownType { id: 4, .. }));
    let mut misaligned = one(&[32], GgmlType::F32);
    misaligned.tensors[0].offset = Some(8);
    expect_err(&misaligned.bytes(), &["blk.0.w", "not a multiple of 32"]);
    let mut name = one(&[32], GgmlType::F32);
    name.tensors[0].name = "w".repeat(10);
    let mut bytes = name.bytes();
    let at = bytes.windows(10).position(|w| w == b"wwwwwwwwww").unwrap();
    bytes[at] = 0xC0;
    expect_err(&bytes, &["tensor name", "not UTF-8"]);
}

#[test]
fn tensor_data_past_the_end_is_an_error() {
    let b = Builder::new().tensor("a", &[32], GgmlType::F32).tensor(
        "blk.1.ffn_up_exps.weight",
        &[256, 4],
        GgmlType::Q6K,
    );
    let bytes = b.bytes();
    let e = expect_err(&bytes[..bytes.len() - 1], &["blk.1.ffn_up_exps.weight", "840 bytes", "truncated"]);
    assert!(matches!(e, GgufError::TensorOutOfBounds { .. }));
    let mut far = Builder::new().tensor("a", &[32], GgmlType::F32);
    far.tensors[0].offset = Some(u64::MAX - 31);
    expect_err(&far.bytes(), &["tensor a", "runs past the end"]);
}

#[test]
fn unsupported_types_name_the_tensor_its_type_and_the_supported_list() {
    let b = Builder::new().tensor("ok", &[256], GgmlType::Q4K).tensor(
        "blk.3.attn_v.weight",
        &[256, 2],
        GgmlType::Q3K,
    );
    let g = open_bytes(&b.bytes()).unwrap();
    let e = g.check_supported().unwrap_err();
    let msg = e.to_string();
    for want in ["blk.3.attn_v.weight", "q3_K", "f32, f16, bf16, q8_0, q4_0, q4_K, q5_K, q6_K"] {
        assert!(msg.contains(want), "{msg}");
    }
}

/// Part `no` of a set of `count`: split keys as gguf-py writes them (u16, u16, i32).
fn part(no: u16, count: u16, total: i32) -> Builder {
    Builder::new()
        .kv(b"split.no", 2, no.to_le_bytes().to_vec())
        .kv(b"split.count", 2, count.to_le_bytes().to_vec())
        .kv(b"split.tensors.count", 5, total.to_le_bytes().to_vec())
}

#[test]
fn split_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let first = part(0, 2, 3).tensor("a", &[32], GgmlType::F32).write(d, "m-00001-of-00002.gguf");
    part(1, 2, 3)
        .tensor("b", &[64], GgmlType::Q8_0)
        .tensor("c", &[4], GgmlType::F16)
        .write(d, "m-00002-of-00002.gguf");
    let g = GgufFile::open(&first).unwrap();
    assert_eq!(
        g.tensors().iter().map(|t| (t.name.as_str(), t.part)).collect::<Vec<_>>(),
        [("a", 0), ("b", 1), ("c", 1)]
    );
    assert_eq!(g.tensor_data("b").unwrap().len(), 68);
    assert_eq!(g.get_u64("split.count").unwrap(), 2);

    let e = GgufFile::open(&d.join("m-00002-of-00002.gguf")).unwrap_err();
    assert!(
        e.to_string().contains("part 2 of a 2-part") && e.to_string().contains("m-00001-of-00002.gguf"),
        "{e}"
    );

    part(1, 2, 4)
        .tensor("b", &[64], GgmlType::Q8_0)
        .tensor("c", &[4], GgmlType::F16)
        .write(d, "m-00002-of-00002.gguf");
    let e = GgufFile::open(&first).unwrap_err();
    assert!(e.to_string().contains("m-00002-of-00002.gguf: split.tensors.count says 4 tensors"), "{e}");

    part(1, 2, 3)
        .tensor("a", &[64], GgmlType::Q8_0)
        .tensor("c", &[4], GgmlType::F16)
        .write(d, "m-00002-of-00002.gguf");
    let e = GgufFile::open(&first).unwrap_err();
    assert!(e.to_string().contains("tensor a is also in") && e.to_string().contains("m-00001"), "{e}");

    part(0, 2, 3).tensor("b", &[64], GgmlType::Q8_0).write(d, "m-00002-of-00002.gguf");
    let e = GgufFile::open(&first).unwrap_err();
    assert!(e.to_string().contains("split.no is 0, expected 1"), "{e}");

    part(1, 3, 3).tensor("b", &[64], GgmlType::Q8_0).write(d, "m-00002-of-00002.gguf");
    let e = GgufFile::open(&first).unwrap_err();
    assert!(e.to_string().contains("split.count says 3 parts, the file names say 2"), "{e}");

    std::fs::remove_file(d.join("m-00002-of-00002.gguf")).unwrap();
    let e = GgufFile::open(&first).unwrap_err();
    assert!(matches!(e, GgufError::Io { .. }) && e.to_string().contains("m-00002-of-00002.gguf"), "{e}");

    // A file that claims to be split but is not named like a part.
    let lone = part(0, 2, 1).tensor("a", &[32], GgmlType::F32).write(d, "lone.gguf");
    let e = GgufFile::open(&lone).unwrap_err();
    assert!(e.to_string().contains("split.count says 2 parts, the file names say 1"), "{e}");
}

#[test]
fn split_names_are_recognised_only_in_full() {
    let n = |s: &str| split_names(Path::new(s)).map(|(k, v)| (k, v.len()));
    assert_eq!(n("/x/m-00002-of-00003.gguf"), Some((2, 3)));
    assert_eq!(n("m-00001-of-00001.gguf"), Some((1, 1)));
    for no in
        ["m.gguf", "m-1-of-3.gguf", "m-00004-of-00003.gguf", "m-00000-of-00003.gguf", "m-00001-of-00003.bin"]
    {
        assert_eq!(n(no), None, "{no}");
    }
    let (_, names) = split_names(Path::new("/d/a-b-00001-of-00002.gguf")).unwrap();
    assert_eq!(names[1], Path::new("/d/a-b-00002-of-00002.gguf"));
}

/// The GGUF model fixtures (tests/fixtures/gguf_fixtures.py: f32, bf16, Q8_0, Q4_0 and
/// the K-quant files, Q4_K_M's mix included): metadata, tensor types and every tensor
/// dequantised by the CPU kernels, against the fingerprints of gguf-py's dequantisation
/// in each golden.json (first 8 values bitwise, float64 sums).
#[test]
fn model_fixtures_read_and_dequantise_as_gguf_py() {
    use smoe_actors::cpu::quant::QuantMatrix;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("model.gguf").is_file())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 8, "GGUF model fixtures: {dirs:?}");
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let golden: Json =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
        let g = GgufFile::open(&dir.join("model.gguf")).unwrap();
        g.check_supported().unwrap();
        for (key, want) in golden["metadata"].as_object().unwrap() {
            let v = g.get(key).unwrap_or_else(|| panic!("{name}: no {key}"));
            match (v, want) {
                (Value::Array(_, items), Json::String(s)) => {
                    assert_eq!(*s, format!("[{} entries]", items.len()))
                }
                (Value::String(a), Json::String(b)) => assert_eq!(a, b, "{name} {key}"),
                (Value::Bool(a), Json::Bool(b)) => assert_eq!(a, b, "{name} {key}"),
                (v, Json::Number(n)) => assert_eq!(v.as_f64(), n.as_f64(), "{name} {key}"),
                (v, w) => panic!("{name} {key}: {v} vs {w}"),
            }
        }
        let types = golden["tensor_types"].as_object().unwrap();
        assert_eq!(g.tensors().len(), types.len(), "{name}");
        for t in g.tensors() {
            assert_eq!(t.ty.name().to_uppercase(), types[&t.name].as_str().unwrap().to_uppercase(), "{name}");
            let (rows, cols) = (t.rows() as usize, t.cols() as usize);
            let m = QuantMatrix::new(t.ty, g.tensor_data(&t.name).unwrap(), rows, cols).unwrap();
            let mut row = vec![0.0f32; cols];
            let (mut sum, mut abs_sum, mut first) = (0.0f64, 0.0f64, Vec::new());
            for r in 0..rows {
                m.dequantize_row(r, &mut row).unwrap();
                for &v in &row {
                    sum += f64::from(v);
                    abs_sum += f64::from(v).abs();
                    if first.len() < 8 {
                        first.push(v.to_bits());
                    }
                }
            }
            let want = &golden["dequantised"][&t.name];
            // The golden holds f32 values as f64 text; serde_json's default parse may be an
            // ulp off in f64, never enough to change the f32.
            let want_first: Vec<u32> = want["first"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| (v.as_f64().unwrap() as f32).to_bits())
                .collect();
            assert_eq!(first, want_first, "{name} {}", t.name);
            for (ours, key) in [(sum, "sum"), (abs_sum, "abs_sum")] {
                let w = want[key].as_f64().unwrap();
                // numpy sums pairwise, this loop in order: equal to f64 rounding.
                assert!(
                    (ours - w).abs() <= 1e-9 * abs_sum.max(1.0),
                    "{name} {} {key}: {ours} vs {w}",
                    t.name
                );
            }
        }
    }
}
