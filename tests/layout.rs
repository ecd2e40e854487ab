//! The engine's layout rules that the compiler does not check: the CPU and Vulkan
//! backends are peers that never import each other (they share only the contract, the
//! model definitions and the stages), and no stage reaches into a backend's internals.

use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir` (or `dir` itself when it is a file).
fn sources(dir: &Path) -> Vec<PathBuf> {
    if dir.is_file() {
        return vec![dir.to_path_buf()];
    }
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())) {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            out.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out
}

/// The code lines (not comments) of the files under `dir` (a folder or file of the
/// engine crate) that name its module `other`.
fn imports_of(dir: &str, other: &str) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("actors/src").join(dir);
    let files = sources(&root);
    assert!(!files.is_empty(), "no sources under {}", root.display());
    let needles =
        [format!("crate::{other}"), format!("smoe_actors::{other}"), format!("super::super::{other}")];
    let mut hits = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).expect("readable source");
        for (i, line) in text.lines().enumerate() {
            let code = !line.trim_start().starts_with("//");
            if code && needles.iter().any(|n| line.contains(n.as_str())) {
                hits.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
            }
        }
    }
    hits
}

#[test]
fn the_vulkan_backend_does_not_import_the_cpu_backend() {
    let hits = imports_of("vulkan", "cpu");
    assert!(hits.is_empty(), "the Vulkan backend imports the CPU backend:\n{}", hits.join("\n"));
}

#[test]
fn the_cpu_backend_does_not_import_the_vulkan_backend() {
    let hits = imports_of("cpu", "vulkan");
    assert!(hits.is_empty(), "the CPU backend imports the Vulkan backend:\n{}", hits.join("\n"));
}

#[test]
fn model_definitions_and_the_moe_step_use_no_backend() {
    let mut hits = Vec::new();
    for place in ["model", "executor/moe.rs", "executor/pass.rs", "contract.rs"] {
        for backend in ["cpu", "vulkan"] {
            hits.extend(imports_of(place, backend));
        }
    }
    assert!(hits.is_empty(), "a model definition imports a backend:\n{}", hits.join("\n"));
}

#[test]
fn the_scanner_sees_an_import() {
    // The rule above is only as good as the scan: the executor must be seen choosing
    // between the backends.
    assert!(!imports_of("executor", "cpu").is_empty(), "the scan found no import where one exists");
}
