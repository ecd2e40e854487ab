//! `smoe-pipeline gguf-info`: what a GGUF file holds — its parts, metadata, tensors and
//! their ggml types — and whether smoe-pipeline computes with every type in it (the
//! command fails, naming the tensor, when it does not).

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use smoe_actors::cpu::quant::QuantMatrix;

use crate::cli::GgufInfoArgs;
use crate::convert::gguf::GgufFile;

/// Values of a tensor row printed by `--tensor`.
const SHOW_VALUES: usize = 8;

/// Runs `gguf-info`.
pub fn run(args: &GgufInfoArgs) -> Result<()> {
    let g = GgufFile::open(&args.gguf)?;
    let first = &g.parts()[0];
    println!(
        "{}: GGUF v{}, {} part(s), {} tensors, {} metadata keys",
        args.gguf.display(),
        first.version,
        g.parts().len(),
        g.tensors().len(),
        g.metadata().len()
    );
    for p in g.parts() {
        println!("  {}: alignment {}, data at byte {}", p.path.display(), p.alignment, p.data_start);
    }
    print_model(&g);
    println!("metadata:");
    for (k, v) in g.metadata() {
        println!("  {k} ({}) = {v}", v.type_name());
    }
    println!("tensors (shape outermost first):");
    let mut types = BTreeMap::new();
    for t in g.tensors() {
        println!("  {} {} {:?} {} bytes (part {})", t.name, t.ty, t.shape(), t.size, t.part + 1);
        *types.entry(t.ty.name()).or_insert(0usize) += 1;
    }
    let counts: Vec<String> = types.iter().map(|(ty, n)| format!("{ty} ×{n}")).collect();
    println!("types: {}", counts.join(", "));
    if let Some(name) = &args.tensor {
        print_row(&g, name)?;
    }
    g.check_supported()?;
    println!("every tensor type is supported");
    Ok(())
}

/// The model-level keys a reader looks for first, where present.
fn print_model(g: &GgufFile) {
    let Ok(arch) = g.architecture() else {
        println!("model: no general.architecture");
        return;
    };
    let mut facts = vec![format!("architecture {arch}")];
    if let Ok(name) = g.get_str("general.name") {
        facts.push(format!("name {name:?}"));
    }
    for (key, what) in
        [("block_count", "layers"), ("expert_count", "experts"), ("expert_used_count", "experts/token")]
    {
        if let Ok(n) = g.get_u64(&format!("{arch}.{key}")) {
            facts.push(format!("{n} {what}"));
        }
    }
    if let Ok(base) = g.get_f64(&format!("{arch}.rope.freq_base")) {
        facts.push(format!("rope base {base}"));
    }
    if let Ok(tokens) = g.get_str_array("tokenizer.ggml.tokens") {
        facts.push(format!("{} tokens", tokens.len()));
    }
    println!("model: {}", facts.join(", "));
}

/// The first values of row 0 of tensor `name`, dequantised.
fn print_row(g: &GgufFile, name: &str) -> Result<()> {
    let t = g.tensor(name)?;
    let rows = usize::try_from(t.rows())?;
    let cols = usize::try_from(t.cols())?;
    let m =
        QuantMatrix::new(t.ty, g.tensor_data(name)?, rows, cols).with_context(|| format!("tensor {name}"))?;
    let mut row = vec![0.0f32; cols];
    m.dequantize_row(0, &mut row).with_context(|| format!("tensor {name}"))?;
    let shown: Vec<String> = row.iter().take(SHOW_VALUES).map(|v| format!("{v}")).collect();
    println!(
        "{name} ({}, {} rows × {} cols) row 0: [{}{}]",
        t.ty,
        rows,
        cols,
        shown.join(", "),
        if cols > SHOW_VALUES { ", …" } else { "" }
    );
    Ok(())
}
