//! Bad input gets a clear error naming what is wrong, a non-zero exit and no panic:
//! broken checkpoints, corrupted or mismatched vaults, out-of-vocabulary prompts.

mod common;

use std::path::Path;

use common::*;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

/// Rewrites `dir/model.safetensors`, letting `edit` replace, drop or keep each tensor.
fn rewrite_tensors(
    dir: &Path,
    edit: impl Fn(&str, Dtype, &[usize], &[u8]) -> Option<(Dtype, Vec<usize>, Vec<u8>)>,
) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut kept = Vec::new();
    for (name, t) in st.tensors() {
        if let Some((dtype, shape, data)) = edit(&name, t.dtype(), t.shape(), t.data()) {
            kept.push((name, dtype, shape, data));
        }
    }
    let views: Vec<(String, TensorView<'_>)> =
        kept.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

fn convert_err(hf: &Path, out: &Path) -> String {
    run_err(&["convert", "--hf", hf.to_str().unwrap(), "--out", out.to_str().unwrap()])
}

const Q_PROJ: &str = "model.layers.1.self_attn.q_proj.weight";

#[test]
fn missing_config_json() {
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_fixture("moe_all", dir.path());
    std::fs::remove_file(hf.join("config.json")).unwrap();
    let err = convert_err(&hf, &dir.path().join("v"));
    assert!(err.contains("config.json is missing"), "{err}");
}

#[test]
fn garbled_config_json() {
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_fixture("moe_all", dir.path());
    std::fs::write(hf.join("config.json"), "{\"hidden_size\": 64,,").unwrap();
    let err = convert_err(&hf, &dir.path().join("v"));
    assert!(err.contains("config.json is not valid JSON"), "{err}");
}

#[test]
fn wrong_typed_and_missing_config_fields() {
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_fixture("moe_all", dir.path());
    let cfg_path = hf.join("config.json");
    let orig: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let mut cfg = orig.clone();
    cfg["hidden_size"] = serde_json::json!("sixty-four");
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let err = convert_err(&hf, &dir.path().join("v"));
    assert!(err.contains("`hidden_size` must be a non-negative integer"), "{err}");

    let mut cfg = orig.clone();
    cfg.as_object_mut().unwrap().remove("num_experts");
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let err = convert_err(&hf, &dir.path().join("v"));
    assert!(err.contains("num_experts") && err.contains("num_local_experts"), "{err}");

    let mut cfg = orig;
    cfg["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let err = convert_err(&hf, &dir.path().join("v"));
    assert!(err.contains("`architectures`") && err.contains("LlamaForCausalLM"), "{err}");
}

#[test]
fn bad_hybrid_config_fields_are_named() {
    let dir = tempfile::tempdir().unwrap();
    for (fixture, edit, want) in [
        (
            "next_f32",
            r#"{"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]}"#,
            &["`layer_types[1]`", "sliding_attention"][..],
        ),
        (
            "next_f32",
            r#"{"layer_types": ["linear_attention", "full_attention"]}"#,
            &["`layer_types` has 2 entries", "4 layers"],
        ),
        (
            "next_f32",
            r#"{"linear_num_value_heads": 3}"#,
            &["`linear_num_value_heads` (3)", "multiple of `linear_num_key_heads` (2)"],
        ),
        ("next_f32", r#"{"linear_conv_kernel_dim": 0}"#, &["`linear_conv_kernel_dim` must be positive"]),
        ("next_f32", r#"{"attn_output_gate": false}"#, &["`attn_output_gate` is false"]),
        (
            "next_f32",
            r#"{"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}}"#,
            &["`partial_rotary_factor` (0.3)", "7 rotated dims"],
        ),
        (
            "q35_f32",
            r#"{"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5, "mrope_section": [2, 2, 3]}}"#,
            &["`mrope_section` [2, 2, 3]", "6 (12 dims)"],
        ),
    ] {
        let hf = copy_fixture(fixture, dir.path());
        let path = hf.join("config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let patch: serde_json::Value = serde_json::from_str(edit).unwrap();
        for (k, v) in patch.as_object().unwrap() {
            cfg[k] = v.clone();
        }
        std::fs::write(&path, cfg.to_string()).unwrap();
        let err = convert_err(&hf, &dir.path().join("v"));
        assert!(want.iter().all(|w| err.contains(w)), "{edit}: {err}");
        std::fs::remove_dir_all(&hf).unwrap();
    }
}

#[test]
fn missing_and_misshapen_deltanet_tensors_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_fixture("next_f32", dir.path());
    const BA: &str = "model.layers.0.linear_attn.in_proj_ba.weight";
    rewrite_tensors(&hf, |name, d, shape, data| (name != BA).then(|| (d, shape.to_vec(), data.to_vec())));
    let err = convert_err(&hf, &dir.path().join("v"));
    assert!(err.contains(BA) && err.contains("missing"), "{err}");

    let hf = copy_fixture("q35_f32", dir.path());
    const Z: &str = "model.layers.0.linear_attn.in_proj_z.weight";
    rewrite_tensors(&hf, |name, d, shape, data| {
        let mut shape = shape.to_vec();
        if name == Z {
            shape[0] /= 2;
            return Some((d, shape, data[..data.len() / 2].to_vec()));
        }
        Some((d, shape, data.to_vec()))
    });
    let err = convert_err(&hf, &dir.path().join("v"));
    assert!(err.contains(Z) && err.contains("has shape [20, 64]"), "{err}");
}

#[test]
fn missing_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_fixture("moe_all", dir.path());
    rewrite_tensors(&hf, |n, d, s, b| (n != Q_PROJ).then(|| (d, s.to_vec(), b.to_vec())));
    let err = convert_err(&hf, &dir.path().join("v"));
    assert!(err.contains(&format!("tensor `{Q_PROJ}` is missing")), "{err}");
}

#[test]
fn wrong_shape() {
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_fixture("moe_all", dir.path());
    rewrite_tensors(&hf, |n, d, s, b| {
        let mut shape = s.to_vec();
        if n == Q_PROJ {
            shape.swap(0, 1);
            shape[0] /= 2;
            shape[1] *= 2;
        }
        Some((d, shape, b.to_vec()))
    });
    let err = convert_err(&hf, &dir.path().join("v"));
    assert!(err.contains(Q_PROJ) && err.contains("has shape [32, 128]"), "{err}");
}

#[test]
fn unsupported_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_fixture("moe_all", dir.path());
    rewrite_tensors(&hf, |n, d, s, b| {
        Some(if n == Q_PROJ { (Dtype::I32, s.to_vec(), b.to_vec()) } else { (d, s.to_vec(), b.to_vec()) })
    });
    let err = convert_err(&hf, &dir.path().join("v"));
    assert!(err.contains(Q_PROJ) && err.contains("I32") && err.contains("supported dtypes"), "{err}");
}

fn manifest(vault: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(vault.join("manifest.json")).unwrap()).unwrap()
}

fn generate_err(vault: &Path, ids: &str) -> String {
    run_err(&[
        "generate",
        "--vault",
        vault.to_str().unwrap(),
        "--prompt-ids",
        ids,
        "--max-tokens",
        "4",
        "--json",
    ])
}

#[test]
fn truncated_blob_file() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let file = vault.join("experts/layer_001.bin");
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&file).unwrap().set_len(len - 5000).unwrap();
    let err = generate_err(&vault, "1,2,3");
    assert!(err.contains("layer_001.bin") && err.contains("truncated"), "{err}");
}

#[test]
fn flipped_byte_in_blob_names_layer_expert_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    flipped_byte_in_blob_is_caught(&convert("moe_all", dir.path(), &[]));
}

#[test]
fn flipped_byte_in_a_quantised_blob_is_caught_by_its_checksum() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &["--quant", "q4_0"]);
    assert_eq!(manifest(&vault)["experts"]["layers"][0]["layout"]["down"]["dtype"], "q4_0");
    flipped_byte_in_blob_is_caught(&vault);
}

/// Corrupts one byte of every blob of the first MoE layer of `vault`; the first read
/// must fail with the layer, expert, file and offset named.
fn flipped_byte_in_blob_is_caught(vault: &Path) {
    let m = manifest(vault);
    let layer0 = &m["experts"]["layers"][0];
    let file = vault.join(layer0["file"].as_str().unwrap());
    let mut bytes = std::fs::read(&file).unwrap();
    let offsets: Vec<u64> =
        layer0["blobs"].as_array().unwrap().iter().map(|b| b["offset"].as_u64().unwrap()).collect();
    // Corrupt every expert of layer 0, so whichever is routed first is caught.
    for &o in &offsets {
        bytes[o as usize + 1234] ^= 0x40;
    }
    std::fs::write(&file, bytes).unwrap();
    let err = generate_err(vault, "5,6,7");
    assert!(err.contains("checksum mismatch for layer 0 expert"), "{err}");
    let expert: usize =
        err.split("layer 0 expert ").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap();
    assert!(err.contains(&format!("at offset {}", offsets[expert])), "{err}");
    assert!(err.contains("layer_000.bin"), "{err}");
}

#[test]
fn manifest_version_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let mut m = manifest(&vault);
    m["format_version"] = serde_json::json!(999);
    std::fs::write(vault.join("manifest.json"), m.to_string()).unwrap();
    let err = generate_err(&vault, "1");
    assert!(err.contains("format version 999 is not supported"), "{err}");
}

#[test]
fn corrupted_resident_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let file = vault.join("resident.bin");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let err = generate_err(&vault, "1");
    assert!(err.contains("checksum mismatch for resident tensor `model.embed_tokens.weight`"), "{err}");
}

#[test]
fn not_a_vault() {
    let dir = tempfile::tempdir().unwrap();
    let err = generate_err(dir.path(), "1");
    assert!(err.contains("manifest.json") && err.contains("smoe-pipeline convert"), "{err}");
}

#[test]
fn prompt_ids_out_of_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let err = generate_err(&vault, "1,2,100000");
    assert!(err.contains("token id 100000 is out of the vocabulary"), "{err}");
    let err = run_err(&["generate", "--vault", vault.to_str().unwrap(), "--prompt-ids", "1,x"]);
    assert!(err.contains("--prompt-ids"), "{err}");
}

#[test]
fn existing_vault_is_not_overwritten_without_force() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let err = convert_err(&fixture("moe_all"), &vault);
    assert!(err.contains("--force"), "{err}");
    convert("moe_all", dir.path(), &["--force"]);
}

/// Runs `generate` on `vault` with `extra` engine flags; returns the run's output.
fn generate_with(vault: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["generate", "--vault", vault.to_str().unwrap(), "--prompt-ids", "1,2,3", "--json"];
    args.extend_from_slice(extra);
    run(&args)
}

#[test]
fn out_of_range_engine_flags_are_errors_naming_flag_and_range() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    for (flags, want) in [
        (
            &["--queue-depth", "100000"][..],
            "`queue_depth` (--queue-depth): must be between 1 and 1024, got 100000",
        ),
        (&["--ring-slots", "0"][..], "`ring_slots` (--ring-slots): must be between 1 and 16777216, got 0"),
        (&["--chunk-size", "0"][..], "`chunk_size` (--chunk-size): must be between 1 and 65536, got 0"),
        (&["--max-context", "1"][..], "`max_context` (--max-context): must be between 2"),
        // One expert blob of moe_all takes 32 KiB.
        (&["--ring-bytes", "16KiB"][..], "one slot takes 32768 bytes: set `ring_bytes` (--ring-bytes)"),
        (&["--ring-bytes", "12 parsecs"][..], "is not a size"),
    ] {
        let mut args = vec!["generate", "--vault", vault.to_str().unwrap(), "--prompt-ids", "1,2,3"];
        args.extend_from_slice(flags);
        let err = run_err(&args);
        assert!(err.contains(want), "{flags:?}: {err}");
    }
}

#[test]
fn verify_refuses_a_ring_of_no_slots_like_generate() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let err = run_err(&["verify", "--vault", vault.to_str().unwrap(), "--ring-slots", "0"]);
    assert!(err.contains("`ring_slots` (--ring-slots): must be between 1 and 16777216, got 0"), "{err}");
}

#[test]
fn ring_bytes_take_units() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    for (size, slots) in [("64KiB", 2), ("96K", 3), ("1G", 24), ("65536", 2)] {
        let out = generate_with(&vault, &["--ring-bytes", size]);
        assert!(out.status.success(), "{size}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["stats"]["ring_slots"], slots, "{size}");
    }
}

/// Entries of `dir` whose name contains `part`.
fn entries_with(dir: &Path, part: &str) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(part))
        .collect()
}

#[test]
fn failed_convert_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_fixture("moe_all", dir.path());
    // A resident tensor of layer 1 is missing: the run fails halfway through the writes.
    rewrite_tensors(&hf, |n, d, s, b| (n != Q_PROJ).then(|| (d, s.to_vec(), b.to_vec())));
    let out = dir.path().join("v");
    convert_err(&hf, &out);
    assert!(!out.exists(), "a failed convert left {}", out.display());
    assert_eq!(entries_with(dir.path(), "partial"), Vec::<String>::new());
    // A vault already there survives a failed --force run untouched.
    let vault = convert("moe_all", dir.path(), &[]);
    let before = std::fs::read(vault.join("manifest.json")).unwrap();
    run_err(&["convert", "--hf", hf.to_str().unwrap(), "--out", vault.to_str().unwrap(), "--force"]);
    assert_eq!(std::fs::read(vault.join("manifest.json")).unwrap(), before);
    generate_json(&vault, &[1, 2], 2, &dir.path().join("l.st"), &[]);
}

#[test]
fn a_directory_without_a_valid_manifest_is_not_a_vault() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("moe_all.vault");
    // What an interrupted run leaves: a torn manifest and partial data files.
    std::fs::create_dir_all(out.join("experts")).unwrap();
    std::fs::write(out.join("manifest.json"), "{\"format_vers").unwrap();
    std::fs::write(out.join("resident.bin"), [0u8; 100]).unwrap();
    std::fs::write(out.join("experts/layer_000.bin"), [0u8; 100]).unwrap();
    // And a staging directory of a run that was killed (no such process).
    std::fs::create_dir(dir.path().join(".moe_all.vault.partial-999999999")).unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    generate_json(&vault, &[1, 2], 2, &dir.path().join("l.st"), &[]);
    assert_eq!(entries_with(dir.path(), "partial"), Vec::<String>::new());
    // A directory holding anything else is never overwritten, not even with --force.
    let other = dir.path().join("notes");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("todo.txt"), "keep me").unwrap();
    let hf = fixture("moe_all");
    for force in [&[][..], &["--force"][..]] {
        let mut args = vec!["convert", "--hf", hf.to_str().unwrap(), "--out", other.to_str().unwrap()];
        args.extend_from_slice(force);
        let err = run_err(&args);
        assert!(err.contains("is not a vault but holds `todo.txt`"), "{err}");
    }
    assert_eq!(std::fs::read_to_string(other.join("todo.txt")).unwrap(), "keep me");
}

/// Runs the binary with `args`, killing it after `secs`; `None` if it had to be killed.
fn run_within(args: &[&str], secs: u64) -> Option<std::process::Output> {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_smoe-pipeline"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Some(child.wait_with_output().unwrap())
}

/// `generate` on `vault` fails within 20 s (no hang) with an error containing `want`.
fn fails_fast_with(vault: &Path, want: &[&str]) {
    generate_fails_fast(vault, &["--prompt-ids", "1,2"], want);
}

/// `generate` on `vault` with the prompt arguments `prompt` exits within 20 s with an
/// error that says every `want`.
fn generate_fails_fast(vault: &Path, prompt: &[&str], want: &[&str]) {
    let mut args = vec!["generate", "--vault", vault.to_str().unwrap(), "--max-tokens", "2"];
    args.extend(prompt);
    let out = run_within(&args, 20).unwrap_or_else(|| panic!("generate hung on {}", vault.display()));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    for w in want {
        assert!(err.contains(w), "wanted {w:?} in: {err}");
    }
}

fn mkfifo(path: &Path) {
    std::fs::remove_file(path).unwrap();
    let ok = std::process::Command::new("mkfifo").arg(path).status().unwrap().success();
    assert!(ok, "mkfifo {}", path.display());
}

#[test]
fn fifos_devices_and_paths_outside_the_vault_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let pristine = manifest(&vault);
    let with = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut m = pristine.clone();
        edit(&mut m);
        std::fs::write(vault.join("manifest.json"), m.to_string()).unwrap();
    };
    for (name, edit, want) in [
        (
            "resident ..",
            &(|m: &mut serde_json::Value| m["resident"]["file"] = "../../etc/passwd".into())
                as &dyn Fn(&mut serde_json::Value),
            "not a plain relative path",
        ),
        (
            "resident /dev/zero",
            &|m: &mut serde_json::Value| m["resident"]["file"] = "/dev/zero".into(),
            "not a plain relative path",
        ),
        (
            "layer /dev/zero",
            &|m: &mut serde_json::Value| m["experts"]["layers"][1]["file"] = "/dev/zero".into(),
            "\"/dev/zero\"",
        ),
    ] {
        with(edit);
        println!("{name}");
        fails_fast_with(&vault, &[want, "manifest.json"]);
    }
    with(&|_| {});
    // A link inside the vault that leads out of it.
    let layer = vault.join("experts/layer_002.bin");
    let saved = std::fs::read(&layer).unwrap();
    std::fs::remove_file(&layer).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &layer).unwrap();
    fails_fast_with(&vault, &["leads outside the vault directory"]);
    std::fs::remove_file(&layer).unwrap();
    std::fs::write(&layer, saved).unwrap();
    // FIFOs where the manifest and the resident file belong: an error, not a hang.
    let resident = vault.join("resident.bin");
    let saved = std::fs::read(&resident).unwrap();
    std::fs::write(&resident, b"x").unwrap();
    mkfifo(&resident);
    fails_fast_with(&vault, &["resident.bin", "is a FIFO"]);
    std::fs::remove_file(&resident).unwrap();
    std::fs::write(&resident, saved).unwrap();
    mkfifo(&vault.join("manifest.json"));
    fails_fast_with(&vault, &["manifest.json", "is a FIFO"]);
}

#[test]
fn a_fifo_for_the_tokenizer_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    mkfifo(&vault.join("tokenizer.json"));
    generate_fails_fast(&vault, &["--prompt", "hello"], &["tokenizer.json", "is a FIFO"]);
}

/// Flips one byte of `file` at `offset`.
fn flip(file: &Path, offset: usize) {
    let mut bytes = std::fs::read(file).unwrap();
    bytes[offset] ^= 0x10;
    std::fs::write(file, bytes).unwrap();
}

#[test]
fn opening_a_vault_leaves_resident_checksums_to_the_background() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let v = smoe_actors::vault::Vault::open(&vault).unwrap();
    v.resident_check().wait().unwrap();
    assert!(matches!(v.resident_check().status(), Some(Ok(()))));
    drop(v);
    flip(&vault.join("resident.bin"), 100);
    // The open succeeds (structure only); the background check finds the fault.
    let v = smoe_actors::vault::Vault::open(&vault).expect("open checks structure only");
    let err = v.resident_check().wait().unwrap_err().to_string();
    assert!(err.contains("checksum mismatch for resident tensor `model.embed_tokens.weight`"), "{err}");
}

#[test]
fn check_reads_everything_and_names_every_fault() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let v = vault.to_str().unwrap();
    let out = run_ok(&["check", "--vault", v]);
    assert!(out.contains("ok — 30 resident tensors and 24 expert blobs"), "{out}");
    let m = manifest(&vault);
    let blob = m["experts"]["layers"][1]["blobs"][3]["offset"].as_u64().unwrap();
    flip(&vault.join("experts/layer_001.bin"), blob as usize + 77);
    let q =
        m["resident"]["tensors"].as_array().unwrap().iter().find(|t| t["name"] == Q_PROJ).unwrap().clone();
    flip(&vault.join("resident.bin"), q["offset"].as_u64().unwrap() as usize + 5);
    let err = run_err(&["check", "--vault", v]);
    assert!(err.contains(&format!("checksum mismatch for resident tensor `{Q_PROJ}`")), "{err}");
    assert!(
        err.contains(&format!("layer 1 expert 3 in {v}/experts/layer_001.bin at offset {blob}")),
        "{err}"
    );
    assert!(err.contains("1 of 30 resident tensors and 1 of 24 expert blobs do not match"), "{err}");
}

/// `generate` on `vault` with `RUST_LOG=info`, under an address-space limit if given.
fn generate_logged(vault: &Path, address_space: Option<u64>) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_smoe-pipeline"));
    cmd.args([
        "generate",
        "--vault",
        vault.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--max-tokens",
        "2",
        "--json",
    ]);
    cmd.env("RUST_LOG", "smoe_pipeline=info");
    if let Some(limit) = address_space {
        // SAFETY: only setrlimit (async-signal-safe) runs between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                let r = libc::rlimit { rlim_cur: limit, rlim_max: limit };
                if libc::setrlimit(libc::RLIMIT_AS, &r) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    }
    cmd.output().unwrap()
}

#[test]
fn the_default_ring_follows_the_memory_available() {
    let dir = tempfile::tempdir().unwrap();
    let vault = convert("moe_all", dir.path(), &[]);
    let out = generate_logged(&vault, None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("ring sized from the memory available: "), "{err}");
    assert!(
        err.contains("resident tensors") && err.contains("KV cache") && err.contains("24 of 24 slots"),
        "{err}"
    );
    // Under a 300 MiB address-space limit not even the margin fits: a clear refusal.
    let out = generate_logged(&vault, Some(300 << 20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("not enough memory for the expert ring") && err.contains("RLIMIT_AS"), "{err}");
    assert!(err.contains("`ring_slots` (--ring-slots)"), "{err}");
}
