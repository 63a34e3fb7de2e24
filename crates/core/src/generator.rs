//! A synthetic RL-step generator whose bf16 change statistics look like real
//! post-training: fp32 master weights with LLM-like magnitudes, updated by
//! Adam-like normalized steps at a small learning rate, then cast to bf16.
//!
//! Why this reproduces the real statistics: a bf16 weight changes only when the
//! fp32 master crosses a bf16 rounding boundary, so the probability of a change
//! is about `lr·|u| / ulp(w)` (with `ulp(w) ≈ |w|/128`), and the changed ones
//! mostly move by exactly one ulp. Small-magnitude weights change more often and
//! by more ulps. Nothing is drawn from a "density" knob: density and ulp-step
//! histograms emerge from the magnitudes and the learning rate, as in training.
//!
//! The Adam update is modelled statelessly to keep memory at 4 bytes per element
//! (the fp32 master only): each element has a persistent gradient direction `d`
//! and fresh noise `n` per step, and the normalized update is
//! `u = (d + 0.3·n) / sqrt(d² + 1)`, the stationary form of `m̂/√v̂` for a
//! gradient `d + noise`. Some tensors see gradient only on a subset of rows per
//! step (embeddings: the tokens of the batch). All randomness comes from a
//! counter-based hash, so a step is reproducible and parallel.
//!
//! `docs/generator.md` compares its statistics with the figures in the brief.

use half::bf16;
use rayon::prelude::*;
use serde::Serialize;

use crate::digest::fmix64;
use crate::dtype::{Dtype, KeyKind, to_key};
use crate::tensors::TensorSet;

/// What a tensor is, which sets its magnitudes and how it is updated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Role {
    /// A weight matrix: zero-mean, heavy-tailed, standard deviation `std`.
    Matrix {
        /// Standard deviation of the weights.
        std: f32,
    },
    /// An embedding: like a matrix, but only `active` (fraction) of its rows get
    /// a gradient in a given step.
    Embedding {
        /// Standard deviation of the weights.
        std: f32,
        /// Fraction of rows updated per step.
        active: f32,
    },
    /// A normalization scale: around 1.0.
    Norm,
}

/// One tensor of the synthetic model.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    /// Name, Hugging Face style.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Role.
    pub role: Role,
}

/// The synthetic model and optimizer.
#[derive(Clone, Debug)]
pub struct GeneratorConfig {
    /// Seed of every random draw.
    pub seed: u64,
    /// Tensors.
    pub tensors: Vec<TensorSpec>,
    /// Learning rate (the brief's traces: 1e-6 to 1e-5; 3e-6 is typical).
    pub lr: f32,
    /// Decoupled weight decay (AdamW).
    pub weight_decay: f32,
}

impl GeneratorConfig {
    /// A Llama-shaped model: embedding, `layers` × (attention q/k/v/o, MLP
    /// gate/up/down, two norms), final norm and LM head.
    pub fn llama(seed: u64, vocab: usize, hidden: usize, inter: usize, layers: usize) -> Self {
        let std = (1.0 / hidden as f32).sqrt().max(0.006);
        let mut t = vec![TensorSpec {
            name: "model.embed_tokens.weight".into(),
            shape: vec![vocab, hidden],
            role: Role::Embedding {
                std: 0.02,
                active: 0.15,
            },
        }];
        for l in 0..layers {
            let p = format!("model.layers.{l}");
            let m = |n: &str, shape: Vec<usize>| TensorSpec {
                name: format!("{p}.{n}.weight"),
                shape,
                role: Role::Matrix { std },
            };
            t.push(m("self_attn.q_proj", vec![hidden, hidden]));
            t.push(m("self_attn.k_proj", vec![hidden / 4, hidden]));
            t.push(m("self_attn.v_proj", vec![hidden / 4, hidden]));
            t.push(m("self_attn.o_proj", vec![hidden, hidden]));
            t.push(m("mlp.gate_proj", vec![inter, hidden]));
            t.push(m("mlp.up_proj", vec![inter, hidden]));
            t.push(m("mlp.down_proj", vec![hidden, inter]));
            for n in ["input_layernorm", "post_attention_layernorm"] {
                t.push(TensorSpec {
                    name: format!("{p}.{n}.weight"),
                    shape: vec![hidden],
                    role: Role::Norm,
                });
            }
        }
        t.push(TensorSpec {
            name: "model.norm.weight".into(),
            shape: vec![hidden],
            role: Role::Norm,
        });
        t.push(TensorSpec {
            name: "lm_head.weight".into(),
            shape: vec![vocab, hidden],
            role: Role::Matrix { std },
        });
        GeneratorConfig {
            seed,
            tensors: t,
            lr: 3e-6,
            weight_decay: 0.01,
        }
    }

    /// About 70 thousand elements: unit tests and doc examples.
    pub fn tiny(seed: u64) -> Self {
        Self::llama(seed, 256, 64, 128, 2)
    }

    /// About 25 million elements (50 MB of bf16): the demo.
    pub fn small(seed: u64) -> Self {
        Self::llama(seed, 8192, 512, 1408, 6)
    }

    /// A Llama-shaped model with about `elements` elements (hidden size and
    /// layer count scaled together), e.g. `1e9` for the benchmark's 2 GB case.
    pub fn with_elements(seed: u64, elements: u64) -> Self {
        let mut hidden = 256usize;
        loop {
            let c = Self::shaped(seed, hidden);
            if c.elements() >= elements || hidden >= 1 << 16 {
                return c;
            }
            hidden += 128;
        }
    }

    fn shaped(seed: u64, hidden: usize) -> Self {
        let layers = (hidden / 128).max(2);
        let inter = (hidden * 11 / 4).div_ceil(64) * 64;
        Self::llama(seed, 32000, hidden, inter, layers)
    }

    /// Total elements.
    pub fn elements(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| t.shape.iter().product::<usize>() as u64)
            .sum()
    }
}

/// Holds the fp32 master weights and advances them one optimizer step at a time.
pub struct Generator {
    cfg: GeneratorConfig,
    master: Vec<Vec<f32>>,
    step: u64,
}

/// Words per parallel work item.
const CHUNK: usize = 1 << 16;

#[inline]
fn unit_normal(h: u64) -> f32 {
    // Irwin–Hall with four 16-bit uniforms: mean 2, variance 4/12.
    let s = (h & 0xffff) + ((h >> 16) & 0xffff) + ((h >> 32) & 0xffff) + (h >> 48);
    ((s as f32 / 65536.0) - 2.0) * 1.732_050_8
}

#[inline]
fn mix(seed: u64, a: u64, b: u64) -> u64 {
    fmix64(seed ^ fmix64(a.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b))
}

impl Generator {
    /// Initializes the master weights.
    pub fn new(cfg: GeneratorConfig) -> Self {
        let master = cfg
            .tensors
            .par_iter()
            .enumerate()
            .map(|(ti, t)| {
                let n: usize = t.shape.iter().product();
                let key = mix(cfg.seed, ti as u64, 0xabcd);
                let mut v = vec![0f32; n];
                v.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
                    for (j, w) in out.iter_mut().enumerate() {
                        let i = (c * CHUNK + j) as u64;
                        let h1 = mix(key, i, 1);
                        let h2 = mix(key, i, 2);
                        *w = match t.role {
                            Role::Matrix { std } | Role::Embedding { std, .. } => {
                                // Gaussian scale mixture: heavier tails than a Gaussian,
                                // like trained LLM weights.
                                std * unit_normal(h1) * (0.35 * unit_normal(h2)).exp()
                            }
                            Role::Norm => 1.0 + 0.05 * unit_normal(h1),
                        };
                    }
                });
                v
            })
            .collect();
        Generator {
            cfg,
            master,
            step: 0,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &GeneratorConfig {
        &self.cfg
    }

    /// Optimizer steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// One AdamW-like step on the fp32 master weights.
    pub fn step(&mut self) {
        self.step += 1;
        let (seed, t, lr, wd) = (self.cfg.seed, self.step, self.cfg.lr, self.cfg.weight_decay);
        for (ti, (spec, m)) in self.cfg.tensors.iter().zip(&mut self.master).enumerate() {
            let key = mix(seed, ti as u64, 0x5eed);
            let row = spec.shape.last().copied().unwrap_or(1).max(1);
            let active = match spec.role {
                Role::Embedding { active, .. } => active,
                _ => 1.0,
            };
            m.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
                for (j, w) in out.iter_mut().enumerate() {
                    let i = (c * CHUNK + j) as u64;
                    if active < 1.0 {
                        let r = i / row as u64;
                        let pick = mix(key, r, t) >> 40;
                        if (pick as f32) >= active * (1u64 << 24) as f32 {
                            continue;
                        }
                    }
                    let d = 0.3 * unit_normal(mix(key, i, 0));
                    let n = unit_normal(mix(key, i, t + 1));
                    let u = (d + 0.2 * n) / (d * d + 1.0).sqrt();
                    *w -= lr * (u + wd * *w);
                }
            });
        }
    }

    /// The current weights cast to bf16, with digests.
    pub fn snapshot(&self) -> TensorSet {
        let mut s = self.snapshot_without_digests();
        s.compute_digests();
        s
    }

    /// The current weights cast to bf16, digests not computed (the codec derives
    /// them incrementally when this set is the new side of a diff).
    pub fn snapshot_without_digests(&self) -> TensorSet {
        let mut set = TensorSet::zeroed(
            self.cfg
                .tensors
                .iter()
                .map(|s| (s.name.clone(), Dtype::BF16, s.shape.clone())),
        )
        .expect("generator shapes are valid");
        let order: Vec<usize> = self
            .cfg
            .tensors
            .iter()
            .map(|s| set.position(&s.name).expect("just inserted"))
            .collect();
        let mut slices: Vec<Option<&mut [u8]>> = set.all_data_mut().into_iter().map(Some).collect();
        for (m, &i) in self.master.iter().zip(&order) {
            let out = slices[i].take().expect("one slice per tensor");
            out.par_chunks_mut(CHUNK * 2)
                .zip(m.par_chunks(CHUNK))
                .for_each(|(out, src)| {
                    for (o, &v) in out.chunks_exact_mut(2).zip(src) {
                        o.copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
                    }
                });
        }
        set
    }
}

/// Change statistics between two bf16 tensor sets of the same structure.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ChangeStats {
    /// Elements compared.
    pub elements: u64,
    /// Elements whose bits differ.
    pub changed: u64,
    /// `changed / elements`.
    pub density: f64,
    /// Fraction of changes that moved by exactly one ulp.
    pub ulp1: f64,
    /// Fraction that moved by exactly two ulps.
    pub ulp2: f64,
    /// Fraction that moved by more.
    pub ulp_more: f64,
    /// Fraction of changes that moved up (toward +inf).
    pub up: f64,
    /// Entropy of the changed positions in bytes per changed element, if each
    /// tensor's changes were independent draws at its own density
    /// (`Σ_t n_t·H(p_t) / changed`): the floor for position coding without
    /// temporal or side-information modelling.
    pub position_entropy: f64,
    /// Empirical entropy of the signed ulp steps, bytes per changed element.
    pub value_entropy: f64,
}

fn binary_entropy(p: f64) -> f64 {
    if p <= 0.0 || p >= 1.0 {
        0.0
    } else {
        -(p * p.log2() + (1.0 - p) * (1.0 - p).log2())
    }
}

/// Measures density and the ulp-step histogram from `a` to `b` (bf16 tensors only).
pub fn change_stats(a: &TensorSet, b: &TensorSet) -> ChangeStats {
    let mut s = ChangeStats::default();
    let (mut u1, mut u2, mut up) = (0u64, 0u64, 0u64);
    let mut steps: std::collections::HashMap<i64, u64> = std::collections::HashMap::new();
    let mut position_bits = 0f64;
    for (i, t) in a.tensors().iter().enumerate() {
        if t.dtype != Dtype::BF16 {
            continue;
        }
        let Some(j) = b.position(&t.name) else {
            continue;
        };
        let (x, y) = (a.data(i), b.data(j));
        if x.len() != y.len() {
            continue;
        }
        let words = (x.len() / 2) as u64;
        s.elements += words;
        let before = s.changed;
        crate::codec::scan::for_each_change(2, x, y, |_, o, n| {
            s.changed += 1;
            let (ko, kn) = (
                to_key(KeyKind::SignMagnitude, 2, o) as i64,
                to_key(KeyKind::SignMagnitude, 2, n) as i64,
            );
            match (kn - ko).abs() {
                1 => u1 += 1,
                2 => u2 += 1,
                _ => {}
            }
            up += u64::from(kn > ko);
            *steps.entry(kn - ko).or_default() += 1;
        });
        if words > 0 {
            position_bits +=
                words as f64 * binary_entropy((s.changed - before) as f64 / words as f64);
        }
    }
    let c = s.changed.max(1) as f64;
    s.density = s.changed as f64 / s.elements.max(1) as f64;
    s.ulp1 = u1 as f64 / c;
    s.ulp2 = u2 as f64 / c;
    s.ulp_more = (s.changed - u1 - u2) as f64 / c;
    s.up = up as f64 / c;
    s.position_entropy = position_bits / c / 8.0;
    s.value_entropy = steps
        .values()
        .map(|&n| {
            let p = n as f64 / c;
            -p * p.log2()
        })
        .sum::<f64>()
        / 8.0;
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_look_like_rl_training() {
        let mut g = Generator::new(GeneratorConfig::tiny(1));
        let a = g.snapshot();
        g.step();
        let b = g.snapshot();
        let s = change_stats(&a, &b);
        assert!((0.003..0.05).contains(&s.density), "{s:?}");
        assert!(s.ulp1 > 0.6, "{s:?}");
        // Deterministic: the same seed gives the same bytes.
        let mut h = Generator::new(GeneratorConfig::tiny(1));
        h.step();
        assert_eq!(h.snapshot().digest(), b.digest());
    }

    #[test]
    fn with_elements_reaches_the_target() {
        let c = GeneratorConfig::with_elements(0, 50_000_000);
        assert!(c.elements() >= 50_000_000);
        assert!(c.elements() < 80_000_000, "{}", c.elements());
    }
}
