//! Compiles the GLSL compute shaders in `shaders/` to SPIR-V with `glslc` when it is
//! installed, else takes the checked-in copies in `shaders/spv/`, and writes the table
//! the Vulkan backend embeds (`$OUT_DIR/spirv_table.rs`).

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    // Read at run time, not baked in with env!(): one compiled build script may serve
    // several checkouts of the workspace (worktrees sharing a target directory), and each
    // must compile its own shaders.
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let root = Path::new(&manifest_dir).join("../shaders");
    println!("cargo:rerun-if-changed={}", root.display());
    println!("cargo:rerun-if-env-changed=GLSLC");
    if std::env::var_os("CARGO_FEATURE_VULKAN").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let list = std::fs::read_to_string(root.join("shaders.txt")).expect("shaders/shaders.txt is readable");
    let glslc = std::env::var("GLSLC").unwrap_or_else(|_| "glslc".into());
    let have_glslc = Command::new(&glslc).arg("--version").output().is_ok_and(|o| o.status.success());
    let mut table =
        String::from("/// SPIR-V of every kernel: (name, bytes).\npub static SPIRV: &[(&str, &[u8])] = &[\n");
    for line in list.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let mut parts = line.split_whitespace();
        let name = parts.next().expect("name");
        let src = parts.next().expect("source");
        let defines: Vec<&str> = parts.collect();
        let dst = out.join(format!("{name}.spv"));
        if have_glslc {
            let status = Command::new(&glslc)
                .args(["--target-env=vulkan1.2", "-O"])
                .args(&defines)
                .arg(root.join(src))
                .arg("-o")
                .arg(&dst)
                .status()
                .expect("glslc runs");
            assert!(status.success(), "glslc failed on shaders/{src} ({name})");
        } else {
            std::fs::copy(root.join("spv").join(format!("{name}.spv")), &dst)
                .expect("checked-in SPIR-V exists (shaders/spv/)");
        }
        table.push_str(&format!("    ({name:?}, include_bytes!({:?})),\n", dst.display().to_string()));
    }
    table.push_str("];\n");
    std::fs::write(out.join("spirv_table.rs"), table).expect("OUT_DIR is writable");
}
