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

/// The matmul modules of `shaders/spv` (every module `shaders.txt` builds from
/// `matmul.comp`: each weight type's m=1, batched, gate/up and embedding kernels): name and
/// instructions, each instruction as its words (the first holds the opcode in its low 16
/// bits).
fn matmul_modules() -> Vec<(String, Vec<Vec<u32>>)> {
    let modules = modules(&["matvec", "matmul", "gate_up", "embed"]);
    let spv = Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders/spv");
    let list = std::fs::read_to_string(spv.with_file_name("shaders.txt")).unwrap();
    let listed = list.lines().filter(|l| l.split_whitespace().nth(1) == Some("matmul.comp")).count();
    assert_eq!(modules.len(), listed);
    assert!(listed >= 32, "f32, bf16, f16 and five block formats, 4 kernels each");
    modules
}

/// The modules of `shaders/spv` whose names start with one of `prefixes`, as
/// [`matmul_modules`] gives them.
fn modules(prefixes: &[&str]) -> Vec<(String, Vec<Vec<u32>>)> {
    let spv = Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders/spv");
    let mut modules = Vec::new();
    for entry in std::fs::read_dir(&spv).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        if !prefixes.iter().any(|k| name.starts_with(k)) {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let words: Vec<u32> =
            bytes.chunks_exact(4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])).collect();
        let mut insts = Vec::new();
        let mut i = 5;
        while i < words.len() {
            let len = ((words[i] >> 16) as usize).max(1);
            insts.push(words[i..(i + len).min(words.len())].to_vec());
            i += len;
        }
        modules.push((name, insts));
    }
    modules
}

/// The opcode of an instruction.
fn op(inst: &[u32]) -> u32 {
    inst[0] & 0xffff
}

/// Every float add, subtract, multiply and divide of the matmul, delta-rule and attention
/// kernels carries NoContraction: without it a driver may fuse or reorder them,
/// differently in the m=1 and batched kernels (seen on NVIDIA when spirv-opt's loop
/// unrolling dropped the decoration from unrolled copies).
#[test]
fn matmul_kernels_keep_no_contraction_on_every_float_op() {
    // The delta rule's step and its batched sibling are an identity pair too, and so are
    // attention's split and fused paths.
    let delta = modules(&["delta_rule"]);
    assert_eq!(delta.len(), 2);
    let attention = modules(&["attention"]);
    assert_eq!(attention.len(), 3);
    for (name, insts) in matmul_modules().into_iter().chain(delta).chain(attention) {
        // OpDecorate (71) id NoContraction (42); OpFAdd, OpFSub, OpFMul, OpFDiv,
        // OpVectorTimesScalar.
        let precise: std::collections::HashSet<u32> =
            insts.iter().filter(|w| op(w) == 71 && w[2] == 42).map(|w| w[1]).collect();
        let float_ops: Vec<u32> =
            insts.iter().filter(|w| [129, 131, 133, 136, 142].contains(&op(w))).map(|w| w[2]).collect();
        let loose = float_ops.iter().filter(|id| !precise.contains(id)).count();
        assert_eq!(loose, 0, "{name}: {loose} of {} float ops lack NoContraction", float_ops.len());
    }
}

/// The matmul kernels index their register arrays (weight chunks, inputs, accumulators)
/// only with constants (`FOR_X` in `shaders/matmul.comp`), so spirv-opt turns them all
/// into SSA values: a `Function`-storage variable left over would be dynamically
/// indexed, which drivers place in (slow) local memory.
#[test]
fn matmul_kernels_keep_no_function_storage_variables() {
    for (name, insts) in matmul_modules() {
        // OpVariable (59) result-type id storage-class, Function = 7.
        let local = insts.iter().filter(|w| op(w) == 59 && w[3] == 7).count();
        assert_eq!(local, 0, "{name}: {local} Function-storage variables");
    }
}
