//! Model definitions: the resident part of a model (references to every dense tensor in
//! the vault, resolved and shape-checked once at load, plus the RoPE tables) and each
//! family's layer loop, written once over the backends' operations.

pub mod qwen3_moe;
pub mod qwen3_next;

use std::sync::Arc;

use smoe_proto::{HybridConfig, LayerType, ModelConfig, VaultError, MANIFEST_FILE};

use crate::contract::{Backend, ForwardError, KvState, Plane};
use crate::executor::moe::MoeStep;
use crate::state_book::DEFAULT_STATE_SNAPSHOTS;
use crate::tensor::WeightView;
use crate::vault::{TensorRef, Vault};

/// The feed-forward block of one layer.
pub enum FfnRefs {
    /// Dense SwiGLU MLP with resident weights.
    Dense {
        /// `gate_proj` [intermediate, hidden].
        gate: TensorRef,
        /// `up_proj` [intermediate, hidden].
        up: TensorRef,
        /// `down_proj` [hidden, intermediate].
        down: TensorRef,
    },
    /// Routed experts; only the router gate is resident, with the shared expert if the
    /// model has one.
    Moe {
        /// Router gate [num_experts, hidden].
        router: TensorRef,
        /// The shared expert (hybrid models).
        shared: Option<SharedExpertRefs>,
    },
}

/// A shared expert: a SwiGLU MLP every token runs, scaled by a sigmoid gate.
pub struct SharedExpertRefs {
    /// `gate_proj` [shared_intermediate, hidden].
    pub gate: TensorRef,
    /// `up_proj` [shared_intermediate, hidden].
    pub up: TensorRef,
    /// `down_proj` [hidden, shared_intermediate].
    pub down: TensorRef,
    /// `shared_expert_gate` [1, hidden].
    pub gate_logit: TensorRef,
}

/// Softmax attention of one layer.
pub struct AttentionRefs {
    /// Query projection [heads·head_dim, hidden].
    pub q: TensorRef,
    /// Key projection [kv_heads·head_dim, hidden].
    pub k: TensorRef,
    /// Value projection [kv_heads·head_dim, hidden].
    pub v: TensorRef,
    /// Output projection [hidden, heads·head_dim].
    pub o: TensorRef,
    /// Per-head RMSNorm on queries \[head_dim\].
    pub q_norm: TensorRef,
    /// Per-head RMSNorm on keys \[head_dim\].
    pub k_norm: TensorRef,
    /// Output gate [heads·head_dim, hidden] (hybrid models: the gate half of `q_proj`).
    pub output_gate: Option<TensorRef>,
}

impl AttentionRefs {
    /// The projections of the layer's normalised input, each with the plane it writes:
    /// q, k, v and (hybrid models) the output gate. A backend may store them together
    /// ([`Model::input_groups`]) and project by all of them at once.
    pub fn input_projections(&self) -> Vec<(&TensorRef, Plane)> {
        let mut p = vec![(&self.q, Plane::Q), (&self.k, Plane::K), (&self.v, Plane::V)];
        p.extend(self.output_gate.as_ref().map(|g| (g, Plane::Gate)));
        p
    }
}

/// A gated-DeltaNet linear-attention layer.
pub struct DeltaNetRefs {
    /// Input projection [q | k | v | z | b | a, hidden].
    pub in_proj: TensorRef,
    /// Causal convolution taps [q | k | v channels, kernel], f32.
    pub conv: TensorRef,
    /// Log decay rate per value head, f32.
    pub a_log: TensorRef,
    /// Time-step bias per value head, f32.
    pub dt_bias: TensorRef,
    /// Gated RMSNorm weight \[value_head_dim\], f32.
    pub norm: TensorRef,
    /// Output projection [hidden, value_heads·value_head_dim].
    pub out_proj: TensorRef,
}

/// What mixes tokens in one layer.
pub enum MixerRefs {
    /// Softmax attention over the KV cache.
    Attention(AttentionRefs),
    /// Gated DeltaNet over the conv and recurrent states.
    DeltaNet(DeltaNetRefs),
}

/// Resident tensors of one decoder layer.
pub struct LayerRefs {
    /// RMSNorm before attention.
    pub input_norm: TensorRef,
    /// RMSNorm before the feed-forward block.
    pub post_norm: TensorRef,
    /// The token mixer.
    pub mixer: MixerRefs,
    /// The feed-forward block.
    pub ffn: FfnRefs,
}

/// Precomputed RoPE cos/sin tables, `[position][rotary_dim / 2]` each. RoPE rotates the
/// first `rotary_dim` dims of a head (all of them but for partial RoPE) and leaves the
/// rest as they are.
pub struct RopeTable {
    /// cos(pos · inv_freq\[i\]).
    pub cos: Vec<f32>,
    /// sin(pos · inv_freq\[i\]).
    pub sin: Vec<f32>,
    /// rotary_dim / 2.
    pub half: usize,
}

impl RopeTable {
    /// Tables for positions `0..max_pos` rotating `rotary_dim` dims, computed in f32 as
    /// the reference does.
    pub fn new(theta: f64, rotary_dim: usize, max_pos: usize) -> Self {
        let half = rotary_dim / 2;
        let inv: Vec<f32> =
            (0..half).map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / rotary_dim as f32)).collect();
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for &f in &inv {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        RopeTable { cos, sin, half }
    }

    /// Rotates one head vector in place for position `pos` (rotate-half convention over
    /// its first `2 · half` dims).
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let h = self.half;
        let (c, s) = (&self.cos[pos * h..(pos + 1) * h], &self.sin[pos * h..(pos + 1) * h]);
        for i in 0..h {
            let (a, b) = (x[i], x[i + h]);
            x[i] = a * c[i] - b * s[i];
            x[i + h] = b * c[i] + a * s[i];
        }
    }
}

/// A model's configuration and resident weights, shared by every session.
pub struct Model {
    /// The vault the weights are mapped from.
    pub vault: Arc<Vault>,
    /// The model configuration.
    pub cfg: ModelConfig,
    /// Token embedding [vocab, hidden].
    pub embed: TensorRef,
    /// Final RMSNorm \[hidden\].
    pub norm: TensorRef,
    /// LM head [vocab, hidden] (the embedding when tied).
    pub lm_head: TensorRef,
    /// Per-layer tensors.
    pub layers: Vec<LayerRefs>,
    /// RoPE tables for the supported context.
    pub rope: RopeTable,
    /// Longest sequence (prompt + generated) a session may hold.
    pub max_context: usize,
    /// DeltaNet state snapshots a session's cache keeps for prefix reuse
    /// ([`crate::state_book`]).
    pub state_snapshots: usize,
}

impl Model {
    /// The hybrid (DeltaNet) shape, or the error a DeltaNet operation on a model without
    /// DeltaNet layers gets, on any backend.
    pub fn hybrid(&self) -> Result<&HybridConfig, ForwardError> {
        self.cfg.hybrid.as_ref().ok_or_else(|| {
            ForwardError::Device("a DeltaNet operation on a model without DeltaNet layers".into())
        })
    }

    /// Resolves every resident tensor of `vault` and precomputes RoPE for
    /// `max_context` positions (clamped to the model's trained context); sessions keep
    /// [`DEFAULT_STATE_SNAPSHOTS`] state snapshots.
    pub fn load(vault: Arc<Vault>, max_context: usize) -> Result<Model, VaultError> {
        let cfg = vault.manifest().model.clone();
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let r = Resolver { vault: &vault };
        let embed = r.get("model.embed_tokens.weight", &[v, h])?;
        let lm_head = if cfg.tie_word_embeddings { embed.clone() } else { r.get("lm_head.weight", &[v, h])? };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let mixer = match (cfg.layer_type(l), &cfg.hybrid) {
                (LayerType::LinearAttention, Some(hy)) => MixerRefs::DeltaNet(r.delta_net(&p, h, hy)?),
                _ => MixerRefs::Attention(r.attention(&p, &cfg)?),
            };
            let ffn = if cfg.is_moe_layer(l) {
                let si = cfg.hybrid.as_ref().map_or(0, |hy| hy.shared_expert_intermediate_size);
                let shared = match si {
                    0 => None,
                    si => Some(SharedExpertRefs {
                        gate: r.get(&format!("{p}.mlp.shared_expert.gate_proj.weight"), &[si, h])?,
                        up: r.get(&format!("{p}.mlp.shared_expert.up_proj.weight"), &[si, h])?,
                        down: r.get(&format!("{p}.mlp.shared_expert.down_proj.weight"), &[h, si])?,
                        gate_logit: r.get(&format!("{p}.mlp.shared_expert_gate.weight"), &[1, h])?,
                    }),
                };
                FfnRefs::Moe {
                    router: r.get(&format!("{p}.mlp.gate.weight"), &[cfg.num_experts, h])?,
                    shared,
                }
            } else {
                let i = cfg.intermediate_size;
                FfnRefs::Dense {
                    gate: r.get(&format!("{p}.mlp.gate_proj.weight"), &[i, h])?,
                    up: r.get(&format!("{p}.mlp.up_proj.weight"), &[i, h])?,
                    down: r.get(&format!("{p}.mlp.down_proj.weight"), &[h, i])?,
                }
            };
            layers.push(LayerRefs {
                input_norm: r.f32(&format!("{p}.input_layernorm.weight"), &[h])?,
                post_norm: r.f32(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                mixer,
                ffn,
            });
        }
        let norm = r.f32("model.norm.weight", &[h])?;
        let max_context = max_context.clamp(1, cfg.max_position_embeddings);
        let rope = RopeTable::new(cfg.rope_theta, cfg.rotary_dim(), max_context);
        Ok(Model {
            vault,
            cfg,
            embed,
            norm,
            lm_head,
            layers,
            rope,
            max_context,
            state_snapshots: DEFAULT_STATE_SNAPSHOTS,
        })
    }

    /// Checks a block of `tokens` at positions `start..` before it runs: the one place
    /// that checks block size, context length and token ids.
    pub fn check_block(&self, start: usize, tokens: &[u32], max_rows: usize) -> Result<(), ForwardError> {
        let m = tokens.len();
        if m == 0 || m > max_rows {
            return Err(ForwardError::BlockSize { rows: m, max: max_rows });
        }
        self.check_context(start + m)?;
        self.check_tokens(tokens)
    }

    /// Checks that a session of `needed` positions fits the context.
    pub fn check_context(&self, needed: usize) -> Result<(), ForwardError> {
        match needed > self.max_context {
            true => Err(ForwardError::ContextFull { needed, max: self.max_context }),
            false => Ok(()),
        }
    }

    /// Checks that every id is in the vocabulary.
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<(), ForwardError> {
        let vocab = self.cfg.vocab_size;
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(&id) => Err(ForwardError::TokenOutOfVocab { id, vocab }),
            None => Ok(()),
        }
    }

    /// Every resident weight matrix the layers project with (for backends that upload
    /// them), each once.
    pub fn matrices(&self) -> impl Iterator<Item = &TensorRef> {
        let per_layer = self.layers.iter().flat_map(|l| {
            let mut m: Vec<&TensorRef> = match &l.mixer {
                MixerRefs::Attention(a) => {
                    [&a.q, &a.k, &a.v, &a.o].into_iter().chain(&a.output_gate).collect()
                }
                MixerRefs::DeltaNet(d) => vec![&d.in_proj, &d.out_proj],
            };
            match &l.ffn {
                FfnRefs::Dense { gate, up, down } => m.extend([gate, up, down]),
                FfnRefs::Moe { router, shared } => {
                    m.push(router);
                    if let Some(s) = shared {
                        m.extend([&s.gate, &s.up, &s.down, &s.gate_logit]);
                    }
                }
            }
            m
        });
        per_layer.chain(std::iter::once(&self.lm_head))
    }

    /// The matrices each attention layer projects its input by together
    /// ([`AttentionRefs::input_projections`]), in that order.
    pub fn input_groups(&self) -> impl Iterator<Item = Vec<&TensorRef>> {
        self.layers.iter().filter_map(|l| match &l.mixer {
            MixerRefs::Attention(a) => Some(a.input_projections().into_iter().map(|(w, _)| w).collect()),
            MixerRefs::DeltaNet(_) => None,
        })
    }

    /// Every resident f32 vector (the norm weights and the DeltaNet parameters), each
    /// once.
    pub fn vectors(&self) -> impl Iterator<Item = &TensorRef> {
        let per_layer = self.layers.iter().flat_map(|l| {
            let mixer: Vec<&TensorRef> = match &l.mixer {
                MixerRefs::Attention(a) => vec![&a.q_norm, &a.k_norm],
                MixerRefs::DeltaNet(d) => vec![&d.conv, &d.a_log, &d.dt_bias, &d.norm],
            };
            [&l.input_norm, &l.post_norm].into_iter().chain(mixer)
        });
        per_layer.chain(std::iter::once(&self.norm))
    }

    /// A view of a resident tensor.
    pub fn w(&self, r: &TensorRef) -> WeightView<'_> {
        self.vault.view(r)
    }

    /// A resident 1-D f32 vector (norm weights; checked at load).
    pub fn vec(&self, r: &TensorRef) -> &[f32] {
        self.vault.view(r).as_f32().unwrap_or(&[])
    }
}

/// Resolves a model's tensors in its vault, checking shapes (and that vectors are f32).
struct Resolver<'a> {
    vault: &'a Vault,
}

impl Resolver<'_> {
    /// Tensor `name` of `shape`.
    fn get(&self, name: &str, shape: &[usize]) -> Result<TensorRef, VaultError> {
        self.vault.resolve(name, shape)
    }

    /// Tensor `name` of `shape`, which must be stored as f32 (norms, DeltaNet
    /// parameters).
    fn f32(&self, name: &str, shape: &[usize]) -> Result<TensorRef, VaultError> {
        let r = self.vault.resolve(name, shape)?;
        if self.vault.view(&r).as_f32().is_none() {
            return Err(VaultError::Manifest {
                file: self.vault.dir().join(MANIFEST_FILE),
                reason: format!("tensor `{name}` must be stored as f32"),
            });
        }
        Ok(r)
    }

    /// The softmax attention of the layer named `p`.
    fn attention(&self, p: &str, cfg: &ModelConfig) -> Result<AttentionRefs, VaultError> {
        let (h, q, kv, hd) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let output_gate = match cfg.hybrid {
            Some(_) => Some(self.get(&format!("{p}.self_attn.output_gate.weight"), &[q, h])?),
            None => None,
        };
        Ok(AttentionRefs {
            q: self.get(&format!("{p}.self_attn.q_proj.weight"), &[q, h])?,
            k: self.get(&format!("{p}.self_attn.k_proj.weight"), &[kv, h])?,
            v: self.get(&format!("{p}.self_attn.v_proj.weight"), &[kv, h])?,
            o: self.get(&format!("{p}.self_attn.o_proj.weight"), &[h, q])?,
            q_norm: self.f32(&format!("{p}.self_attn.q_norm.weight"), &[hd])?,
            k_norm: self.f32(&format!("{p}.self_attn.k_norm.weight"), &[hd])?,
            output_gate,
        })
    }

    /// The gated DeltaNet of the layer named `p`.
    fn delta_net(&self, p: &str, h: usize, hy: &HybridConfig) -> Result<DeltaNetRefs, VaultError> {
        let nv = hy.linear_num_value_heads;
        Ok(DeltaNetRefs {
            in_proj: self.get(&format!("{p}.linear_attn.in_proj.weight"), &[hy.in_proj_dim(), h])?,
            conv: self.f32(
                &format!("{p}.linear_attn.conv1d.weight"),
                &[hy.conv_dim(), hy.linear_conv_kernel_dim],
            )?,
            a_log: self.f32(&format!("{p}.linear_attn.A_log"), &[nv])?,
            dt_bias: self.f32(&format!("{p}.linear_attn.dt_bias"), &[nv])?,
            norm: self.f32(&format!("{p}.linear_attn.norm.weight"), &[hy.linear_value_head_dim])?,
            out_proj: self.get(&format!("{p}.linear_attn.out_proj.weight"), &[h, hy.value_dim()])?,
        })
    }
}

/// Runs `tokens` (at positions `kv.len()..`) through every layer of `model`'s family,
/// extending `kv`; returns the last token's logits when `want_logits`. On failure the
/// backend's recorded work is abandoned and `kv` keeps its length, or (a cache with
/// recurrent state the pass changed) falls back as [`KvState::truncate`] says.
pub fn forward<'b, B: Backend>(
    b: &'b mut B,
    moe: &mut MoeStep,
    model: &Model,
    kv: &mut B::Kv,
    tokens: &[u32],
    want_logits: bool,
) -> Result<Option<&'b [f32]>, ForwardError> {
    let (start, m) = (kv.len(), tokens.len());
    // A device-routed step is speculative: a void one runs again from the same cache.
    let route = if moe.may_route_on_device(b, m) { Route::Device } else { Route::Host };
    let mut run = pass(b, moe, model, kv, tokens, want_logits, route);
    if route == Route::Device && run.is_ok() {
        run = match moe.settle_device(b) {
            Ok(true) => Ok(()),
            // A routed expert was not on the device: the pass runs again host-routed,
            // rewriting the same positions of the cache (and the states it started from).
            Ok(false) => pass(b, moe, model, kv, tokens, want_logits, Route::Again),
            Err(e) => Err(e),
        };
    }
    if run.is_err() {
        b.abandon();
        // A failed pass may have moved recurrent states past `start`: the cache goes
        // back to a state it can trust.
        kv.truncate(start);
    }
    moe.end_pass();
    run?;
    debug_assert_eq!(kv.len(), start);
    kv.advance(m);
    Ok(want_logits.then(|| b.last_logits()))
}

/// How a pass's MoE steps route.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Route {
    /// On the host.
    Host,
    /// On the device, speculatively. Recurrent states are updated in place, so the pass
    /// first records a copy of them ([`Backend::keep_states`]).
    Device,
    /// On the host after a void device-routed pass, from the states it kept
    /// ([`Backend::restore_states`]).
    Again,
}

/// Every layer of the model for `tokens` at positions `kv.len()..`, then the LM head
/// (`want_logits`) or the end of the block, its MoE steps routed as `route` says. The
/// state copies come after the backend's `begin_pass`, in the pass's own recording (a
/// backend that replays a kept recording of a device-routed pass replays its copy too).
fn pass<B: Backend>(
    b: &mut B,
    moe: &mut MoeStep,
    model: &Model,
    kv: &mut B::Kv,
    tokens: &[u32],
    want_logits: bool,
    route: Route,
) -> Result<(), ForwardError> {
    let (start, m) = (kv.len(), tokens.len());
    let on_device = route == Route::Device;
    moe.begin_pass(on_device);
    b.begin_pass(kv, m, on_device.then(|| moe.spec_depth()), want_logits)?;
    match (route, model.cfg.hybrid.is_some()) {
        (Route::Device, true) => b.keep_states(kv)?,
        (Route::Again, true) => b.restore_states(kv)?,
        _ => {}
    }
    match model.cfg.hybrid {
        None => qwen3_moe::layers(b, moe, model, kv, tokens, start),
        Some(_) => qwen3_next::layers(b, moe, model, kv, tokens, start),
    }?;
    match want_logits {
        true => b.lm_head(&model.norm, &model.lm_head, m - 1),
        false => b.finish(),
    }
}
