//! How a HuggingFace checkpoint's tensors become the vault's: most are copied as they
//! are; the hybrid family's are rearranged into the engine's layout by whole rows (an
//! exact operation: every output row is the same dot product) and its zero-centred norm
//! weights are stored as `1 + w`, the f32 sum transformers forms before it multiplies
//! (see [`smoe_proto::HybridConfig`]).
//!
//! Accepted checkpoint layouts: Qwen3-Next's fused DeltaNet projections
//! (`in_proj_qkvz`, `in_proj_ba`, grouped per key head) and Qwen3.5's split ones
//! (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`); the text model of a
//! vision-language checkpoint under `model.language_model.`; routed experts stored one
//! tensor per expert or fused per layer (`experts.gate_up_proj`, `experts.down_proj`).

use std::ops::Range;

use anyhow::{bail, Result};
use smoe_proto::ModelConfig;

use super::checkpoint::Checkpoint;

/// Where the rows of one vault tensor come from.
#[derive(Debug, PartialEq)]
pub struct Recipe {
    /// Checkpoint tensors and the row ranges taken from each (a tensor viewed as
    /// `[elements / cols, cols]`), in vault row order.
    pub parts: Vec<(String, Vec<Range<usize>>)>,
    /// Whether one is added to every element (zero-centred norm weights).
    pub add_one: bool,
}

impl Recipe {
    /// The whole of checkpoint tensor `source`.
    fn whole(source: String, rows: usize) -> Recipe {
        Recipe { parts: vec![(source, std::iter::once(0..rows).collect())], add_one: false }
    }
}

/// The checkpoint's name for the vault's tensor `name`: the same, or the text model's
/// of a vision-language checkpoint.
fn source_name(ckpt: &Checkpoint, name: &str) -> String {
    match name.strip_prefix("model.") {
        Some(rest) if !ckpt.tensors.contains_key(name) => {
            let vl = format!("model.language_model.{rest}");
            if ckpt.tensors.contains_key(&vl) {
                return vl;
            }
            name.to_string()
        }
        _ => name.to_string(),
    }
}

/// Splits `model.layers.{l}.{rest}` into `(l, rest)`.
fn layer_of(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (l, rest) = rest.split_once('.')?;
    Some((l.parse().ok()?, rest))
}

/// Whether `rest` (a name inside a layer) is a zero-centred RMSNorm weight of the hybrid
/// family (the gated norm of the DeltaNet, `linear_attn.norm`, is not).
fn zero_centred(rest: &str) -> bool {
    matches!(
        rest,
        "input_layernorm.weight"
            | "post_attention_layernorm.weight"
            | "self_attn.q_norm.weight"
            | "self_attn.k_norm.weight"
    )
}

/// The recipe of the vault tensor `name` of shape `shape`, checked against the
/// checkpoint's shapes.
pub fn recipe(cfg: &ModelConfig, ckpt: &Checkpoint, name: &str, shape: &[usize]) -> Result<Recipe> {
    // Rows of `cols` elements (a vector is one row).
    let cols = shape.last().copied().unwrap_or(1);
    let rows = shape[..shape.len().saturating_sub(1)].iter().product();
    let hybrid = cfg.hybrid.as_ref();
    let layer = layer_of(name);
    let mut r = match layer {
        Some((l, rest)) if hybrid.is_some() => hybrid_recipe(cfg, ckpt, l, rest)?,
        Some((l, rest)) => fused_expert(cfg, ckpt, l, rest)?,
        None => None,
    }
    .unwrap_or_else(|| Recipe::whole(source_name(ckpt, name), rows));
    r.add_one = hybrid.is_some()
        && (name == "model.norm.weight" || layer.is_some_and(|(_, rest)| zero_centred(rest)));
    check(ckpt, &r, name, shape, rows, cols)?;
    Ok(r)
}

/// Checks that every part exists with rows of `cols` elements, that every range lies
/// inside its tensor, and that the ranges add up to `rows` rows.
fn check(ckpt: &Checkpoint, r: &Recipe, name: &str, shape: &[usize], rows: usize, cols: usize) -> Result<()> {
    let mut total = 0;
    for (src, ranges) in &r.parts {
        let (info, _) = ckpt.tensor(src)?;
        let elems: usize = info.shape.iter().product();
        let src_cols = info.shape.last().copied().unwrap_or(1);
        // A whole tensor has the vault's shape up to dims of one (the conv weight
        // [C, 1, K] is the vault's [C, K]).
        let whole = r.parts.len() == 1 && ranges.len() == 1 && ranges[0] == (0..rows);
        let squeezed = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        let fits = if whole { squeezed(&info.shape) == squeezed(shape) } else { src_cols == cols };
        if !fits || ranges.iter().any(|rg| rg.end * cols > elems) {
            bail!(
                "tensor `{src}` in {} has shape {:?}, but config.json implies {shape:?} for `{name}`",
                ckpt.shards[info.shard].display(),
                info.shape
            );
        }
        total += ranges.iter().map(|rg| rg.len()).sum::<usize>();
    }
    if total != rows {
        bail!("internal error: the recipe of `{name}` gives {total} rows, not {rows}");
    }
    Ok(())
}

/// A routed expert's matrix from a layer's fused expert tensors, when the checkpoint has
/// those rather than one tensor per expert.
fn fused_expert(cfg: &ModelConfig, ckpt: &Checkpoint, l: usize, rest: &str) -> Result<Option<Recipe>> {
    let p = format!("model.layers.{l}.mlp.experts");
    let Some(rest) = rest.strip_prefix("mlp.experts.") else { return Ok(None) };
    let Some((e, part)) = rest.split_once('.') else { return Ok(None) };
    let Ok(e) = e.parse::<usize>() else { return Ok(None) };
    if ckpt.tensors.contains_key(&source_name(ckpt, &format!("{p}.{e}.{part}"))) {
        return Ok(None);
    }
    let (h, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
    let (tensor, range) = match part {
        "gate_proj.weight" => ("gate_up_proj", e * 2 * i..e * 2 * i + i),
        "up_proj.weight" => ("gate_up_proj", e * 2 * i + i..(e + 1) * 2 * i),
        "down_proj.weight" => ("down_proj", e * h..(e + 1) * h),
        _ => return Ok(None),
    };
    let src = source_name(ckpt, &format!("{p}.{tensor}"));
    if !ckpt.tensors.contains_key(&src) {
        return Ok(None);
    }
    Ok(Some(Recipe { parts: vec![(src, vec![range])], add_one: false }))
}

/// The hybrid family's rearranged tensors of layer `l`.
fn hybrid_recipe(cfg: &ModelConfig, ckpt: &Checkpoint, l: usize, rest: &str) -> Result<Option<Recipe>> {
    let Some(hy) = cfg.hybrid.as_ref() else { return Ok(None) };
    let p = format!("model.layers.{l}");
    let src = |n: &str| source_name(ckpt, &format!("{p}.{n}"));
    let hd = cfg.head_dim;
    // `q_proj` holds, per head, the query and then its output gate.
    let q_half = |second: bool| {
        let off = if second { hd } else { 0 };
        let ranges = (0..cfg.num_attention_heads).map(|i| 2 * i * hd + off..2 * i * hd + off + hd).collect();
        Recipe { parts: vec![(src("self_attn.q_proj.weight"), ranges)], add_one: false }
    };
    Ok(Some(match rest {
        "self_attn.q_proj.weight" => q_half(false),
        "self_attn.output_gate.weight" => q_half(true),
        "linear_attn.in_proj.weight" => {
            let fused = src("linear_attn.in_proj_qkvz.weight");
            if ckpt.tensors.contains_key(&fused) {
                in_proj_from_fused(hy, fused, src("linear_attn.in_proj_ba.weight"))
            } else {
                let whole = |n: &str, rows: usize| (src(n), std::iter::once(0..rows).collect());
                let nv = hy.linear_num_value_heads;
                Recipe {
                    parts: vec![
                        whole("linear_attn.in_proj_qkv.weight", hy.conv_dim()),
                        whole("linear_attn.in_proj_z.weight", hy.value_dim()),
                        whole("linear_attn.in_proj_b.weight", nv),
                        whole("linear_attn.in_proj_a.weight", nv),
                    ],
                    add_one: false,
                }
            }
        }
        _ => return fused_expert(cfg, ckpt, l, rest),
    }))
}

/// The vault's `in_proj` rows `[q | k | v | z | b | a]` from Qwen3-Next's fused
/// projections, which group them per key head: `in_proj_qkvz` as `[q_g | k_g | v_g |
/// z_g]` and `in_proj_ba` as `[b_g | a_g]` for each key head `g` (transformers'
/// `fix_query_key_value_ordering`).
fn in_proj_from_fused(hy: &smoe_proto::HybridConfig, qkvz: String, ba: String) -> Recipe {
    let (nk, hk, hv) = (hy.linear_num_key_heads, hy.linear_key_head_dim, hy.linear_value_head_dim);
    let r = hy.linear_num_value_heads / nk;
    let group = 2 * hk + 2 * r * hv;
    let of_groups = |off: usize, len: usize, stride: usize| -> Vec<Range<usize>> {
        (0..nk).map(|g| g * stride + off..g * stride + off + len).collect()
    };
    let mut qkvz_rows = of_groups(0, hk, group);
    qkvz_rows.extend(of_groups(hk, hk, group));
    qkvz_rows.extend(of_groups(2 * hk, r * hv, group));
    qkvz_rows.extend(of_groups(2 * hk + r * hv, r * hv, group));
    let mut ba_rows = of_groups(0, r, 2 * r);
    ba_rows.extend(of_groups(r, r, 2 * r));
    Recipe { parts: vec![(qkvz, qkvz_rows), (ba, ba_rows)], add_one: false }
}
