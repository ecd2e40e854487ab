//! `convert` reads the files that hold the model and only those — the shards
//! `model.safetensors.index.json` names, else `model.safetensors`, else the
//! `model-*.safetensors` shards — and says which; another safetensors file in the
//! directory (`consolidated.safetensors`) is never read, and a shard the index names but
//! the directory lacks is an error naming it.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::*;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// Writes `dir/consolidated.safetensors` holding a `model.embed_tokens.weight` that
/// conflicts with the model's: another shape, and a dtype the converter refuses.
fn write_consolidated(dir: &Path) {
    let garbage = vec![0xa5u8; 7 * 5 * 8];
    let view = TensorView::new(Dtype::I64, vec![7, 5], &garbage).unwrap();
    safetensors::serialize_to_file(
        [("model.embed_tokens.weight", view)],
        None,
        &dir.join("consolidated.safetensors"),
    )
    .unwrap();
}

/// Every file under `dir` (relative path → bytes).
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().display().to_string();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

#[test]
fn only_the_model_files_are_read() {
    let shards = "model-00001-of-00003.safetensors, model-00002-of-00003.safetensors, \
                  model-00003-of-00003.safetensors";
    // (fixture, drop the index, the files the converter must say it read)
    let cases = [
        ("moe_all", false, "model.safetensors"),
        ("bf16_sharded", false, shards),
        ("bf16_sharded", true, shards),
    ];
    for (name, drop_index, read) in cases {
        let dir = tempfile::tempdir().unwrap();
        let pristine = convert(name, dir.path(), &[]);
        let hf = copy_fixture(name, &dir.path().join("copy"));
        if drop_index {
            std::fs::remove_file(hf.join("model.safetensors.index.json")).unwrap();
        }
        write_consolidated(&hf);
        let vault = dir.path().join("with-consolidated.vault");
        let out = run(&["convert", "--hf", hf.to_str().unwrap(), "--out", vault.to_str().unwrap()]);
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name} (index dropped: {drop_index}):\n{log}");
        assert!(log.contains(&format!("reading the checkpoint {}: {read}\n", hf.display())), "{log}");
        assert!(files(&vault) == files(&pristine), "{name}: the vault differs from the plain checkpoint's");
    }
}

#[test]
fn a_shard_the_index_names_must_exist() {
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_fixture("bf16_sharded", dir.path());
    std::fs::remove_file(hf.join("model-00002-of-00003.safetensors")).unwrap();
    let out = dir.path().join("v");
    let err = run_err(&["convert", "--hf", hf.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(
        err.contains("model.safetensors.index.json names the shard")
            && err.contains("model-00002-of-00003.safetensors, which is missing"),
        "{err}"
    );
}

#[test]
fn a_directory_without_model_files_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_fixture("moe_all", dir.path());
    std::fs::rename(hf.join("model.safetensors"), hf.join("consolidated.safetensors")).unwrap();
    let out = dir.path().join("v");
    let err = run_err(&["convert", "--hf", hf.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(
        err.contains("no model.safetensors.index.json, model.safetensors or model-*.safetensors in"),
        "{err}"
    );
}
