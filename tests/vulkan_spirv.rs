//! The checked-in SPIR-V (`shaders/spv/`, used where `glslc` is missing) must be what
//! `glslc` makes from the GLSL sources today. Regenerate with `scripts/build_shaders.sh`.

use std::path::Path;
use std::process::Command;

#[test]
fn checked_in_spirv_matches_the_glsl_sources() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let have = Command::new("glslc").arg("--version").output().is_ok_and(|o| o.status.success());
    if !have {
        assert!(std::env::var_os("CI").is_none(), "CI must install glslc to check shaders/spv/");
        eprintln!("skipping: glslc is not installed");
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let list = std::fs::read_to_string(root.join("shaders.txt")).unwrap();
    let mut n = 0;
    for line in list.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let mut parts = line.split_whitespace();
        let (name, src) = (parts.next().unwrap(), parts.next().unwrap());
        let dst = out.path().join(format!("{name}.spv"));
        let st = Command::new("glslc")
            .args(["--target-env=vulkan1.2", "-O"])
            .args(parts)
            .arg(root.join(src))
            .arg("-o")
            .arg(&dst)
            .status()
            .unwrap();
        assert!(st.success(), "glslc failed on {src} ({name})");
        let fresh = std::fs::read(&dst).unwrap();
        let stored = std::fs::read(root.join("spv").join(format!("{name}.spv")))
            .unwrap_or_else(|e| panic!("shaders/spv/{name}.spv: {e}; run scripts/build_shaders.sh"));
        assert!(fresh == stored, "shaders/spv/{name}.spv is stale; run scripts/build_shaders.sh");
        n += 1;
    }
    assert!(n > 0);
}
