//! Our quantiser's error against llama.cpp's on the same weights. For every routed-expert
//! tensor — one decoder layer's `gate_proj`, `up_proj` or `down_proj` over all experts, a
//! GGUF `blk.N.ffn_{gate,up,down}_exps` — the RMSE against the bf16 source of our
//! quantised vault (`convert --hf --quant`) and of llama.cpp's (`llama-quantize`, imported
//! with `convert --gguf`, which keeps its blocks byte for byte). Prints every tensor's
//! ratio ours/llama and, per block format, the mean and largest ratio and the worst
//! tensor. Tensors the two vaults store in different formats are counted and skipped.
//!
//! Usage: `quant_rmse SRC_VAULT LABEL OURS_VAULT LLAMA_VAULT [LABEL OURS_VAULT LLAMA_VAULT]...`

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::process::ExitCode;

use rayon::prelude::*;
use smoe_actors::cpu::quant::dequantize_row;
use smoe_actors::vault::Vault;
use smoe_proto::{DType, ExpertKey, PartLayout};

/// The three matrices of an expert, in blob order.
const PARTS: [&str; 3] = ["gate", "up", "down"];

/// Squared-error sums of one tensor, ours and llama.cpp's, over `n` elements.
#[derive(Default, Clone, Copy)]
struct Sse {
    ours: f64,
    llama: f64,
    /// Largest per-expert ratio of RMSEs ours/llama.
    worst_expert: f64,
    n: u64,
}

impl Sse {
    fn add(self, o: Sse) -> Sse {
        Sse {
            ours: self.ours + o.ours,
            llama: self.llama + o.llama,
            worst_expert: self.worst_expert.max(o.worst_expert),
            n: self.n + o.n,
        }
    }

    fn rmse(sse: f64, n: u64) -> f64 {
        (sse / n.max(1) as f64).sqrt()
    }

    fn ratio(&self) -> f64 {
        (self.ours / self.llama).sqrt()
    }
}

/// One opened vault with its layer files.
struct Opened {
    vault: Vault,
}

impl Opened {
    fn open(dir: &str) -> Result<Opened, String> {
        Ok(Opened { vault: Vault::open(dir).map_err(|e| format!("{dir}: {e}"))? })
    }

    fn part(&self, layer: usize, p: usize) -> Result<PartLayout, String> {
        let l = self.vault.expert_layout(layer).map_err(|e| e.to_string())?;
        Ok([l.gate, l.up, l.down][p])
    }

    /// The dequantised matrix `p` of expert `key`.
    fn matrix(&self, key: ExpertKey, p: usize) -> Result<Vec<f32>, String> {
        let loc = self.vault.blob(key).map_err(|e| e.to_string())?;
        let part = self.part(key.layer as usize, p)?;
        let mut blob = vec![0u8; loc.len as usize];
        File::open(&loc.file)
            .and_then(|f| f.read_exact_at(&mut blob, loc.offset))
            .map_err(|e| format!("{}: {e}", loc.file.display()))?;
        let bytes = part.slice(&blob);
        let row_bytes = part.dtype.row_bytes(part.cols).ok_or("row is not whole blocks")?;
        let mut out = vec![0.0f32; part.rows * part.cols];
        for (row, q) in out.chunks_exact_mut(part.cols).zip(bytes.chunks_exact(row_bytes)) {
            dequantize_row(part.dtype.ggml(), q, row).map_err(|e| e.to_string())?;
        }
        Ok(out)
    }
}

fn sse(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum()
}

/// What one tensor's comparison found.
enum Compared {
    /// Both store it as this type: the error sums.
    Same(DType, Sse),
    /// Ours stores it as the first type, llama.cpp as the second: not compared.
    Differ(DType, DType),
}

/// The error sums of matrix `p` of layer `layer` over all experts.
fn tensor(src: &Opened, ours: &Opened, llama: &Opened, layer: usize, p: usize) -> Result<Compared, String> {
    let (to, tl) = (ours.part(layer, p)?.dtype, llama.part(layer, p)?.dtype);
    if to != tl {
        return Ok(Compared::Differ(to, tl));
    }
    let experts = src.vault.manifest().model.num_experts;
    let sums = (0..experts)
        .into_par_iter()
        .map(|e| {
            let key = ExpertKey::new(layer, e);
            let x = src.matrix(key, p)?;
            let (o, l) = (sse(&x, &ours.matrix(key, p)?), sse(&x, &llama.matrix(key, p)?));
            Ok(Sse { ours: o, llama: l, worst_expert: (o / l).sqrt(), n: x.len() as u64 })
        })
        .collect::<Result<Vec<Sse>, String>>()?;
    Ok(Compared::Same(to, sums.into_iter().fold(Sse::default(), Sse::add)))
}

fn run(args: &[String]) -> Result<(), String> {
    let sets = args.get(1..).unwrap_or_default().chunks_exact(3);
    if sets.len() == 0 || !sets.remainder().is_empty() {
        return Err("usage: quant_rmse SRC_VAULT LABEL OURS_VAULT LLAMA_VAULT [LABEL OURS LLAMA]...".into());
    }
    let src = Opened::open(&args[0])?;
    let layers = src.vault.manifest().model.num_hidden_layers;
    println!("source: {}", args[0]);
    println!("ratio = RMSE(ours) / RMSE(llama.cpp) against the bf16 source, per tensor (all experts of one layer's matrix)");
    let mut failed = false;
    for set in sets {
        let (label, ours, llama) = (&set[0], Opened::open(&set[1])?, Opened::open(&set[2])?);
        println!("\n== {label}: ours {} vs llama.cpp {}", set[1], set[2]);
        println!(
            "{:<12} {:<6} {:>12} {:>12} {:>8} {:>13}",
            "tensor", "type", "rmse_ours", "rmse_llama", "ratio", "worst_expert"
        );
        let mut per_type: BTreeMap<String, Vec<(String, Sse)>> = BTreeMap::new();
        let mut differ = Vec::new();
        for layer in 0..layers {
            if src.vault.expert_layout(layer).is_err() {
                continue;
            }
            for (p, name) in PARTS.iter().enumerate() {
                let t = format!("blk.{layer}.{name}");
                match tensor(&src, &ours, &llama, layer, p)? {
                    Compared::Same(ty, s) => {
                        println!(
                            "{t:<12} {:<6} {:>12.4e} {:>12.4e} {:>8.4} {:>13.4}",
                            ty.to_string(),
                            Sse::rmse(s.ours, s.n),
                            Sse::rmse(s.llama, s.n),
                            s.ratio(),
                            s.worst_expert
                        );
                        per_type.entry(ty.to_string()).or_default().push((t, s));
                    }
                    Compared::Differ(to, tl) => differ.push(format!("{t} (ours {to}, llama {tl})")),
                }
            }
        }
        println!("-- {label} summary (goal: every tensor's ratio <= 1.02)");
        println!(
            "{:<6} {:>7} {:>10} {:>10} {:>13}  worst tensor",
            "type", "tensors", "mean", "max", "worst_expert"
        );
        for (ty, ts) in &per_type {
            let mean = ts.iter().map(|(_, s)| s.ratio()).sum::<f64>() / ts.len() as f64;
            let (worst, ws) =
                ts.iter().max_by(|a, b| a.1.ratio().total_cmp(&b.1.ratio())).expect("non-empty");
            let we = ts.iter().map(|(_, s)| s.worst_expert).fold(0.0, f64::max);
            println!("{ty:<6} {:>7} {mean:>10.4} {:>10.4} {we:>13.4}  {worst}", ts.len(), ws.ratio());
            failed |= ws.ratio() > 1.02;
        }
        if !differ.is_empty() {
            println!("stored in different formats, not compared: {}", differ.join(", "));
        }
    }
    println!(
        "\n{}",
        if failed { "FAIL: some tensor's ratio is above 1.02" } else { "PASS: every tensor's ratio <= 1.02" }
    );
    if failed {
        return Err("ratio above 1.02".into());
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("quant_rmse: {e}");
            ExitCode::FAILURE
        }
    }
}
