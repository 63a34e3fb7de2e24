//! A stand-in trainer for the benchmarks that drive the `weightcast` binary
//! (`scripts/bench_regions.py`): the synthetic generator's bf16 model
//! written as a Hugging Face sharded checkpoint directory —
//! `model-0000i-of-0000N.safetensors`, `model.safetensors.index.json` and a
//! small `config.json` — and rewritten in place, one optimizer step at a time.
//!
//! ```sh
//! cargo build --release -p weightcast-core --example bench_model
//! target/release/examples/bench_model --elements 1000000000 --shards 4 \
//!     --lr 1.5e-6 --out /tmp/wc-model
//! ```
//!
//! Protocol (a long-lived process driven over its standard streams): it
//! writes step 0 and prints one JSON line, then for every line read on stdin
//! (`next`) takes one generator step, rewrites the files and prints the next
//! line; it exits at the end of its input. Each line is
//! `{"step": S, "changed": C, "elements": E, "bytes": B, "seconds": T}`:
//! `changed` is the number of bf16 elements whose bytes differ from the files
//! it replaced (all of them at step 0), `bytes` the tensor bytes written,
//! `seconds` the step plus the writing. Each file is written to a hidden
//! temporary name in `--out` and renamed over the old one; the index and
//! `config.json` are written once, at step 0 (their content never changes).
//! A line other than `next` is refused (exit 2), naming it.
//!
//! Memory: the generator's fp32 master weights (4 bytes per element) and one
//! bf16 snapshot (2 bytes per element); the files being replaced are mapped,
//! read-only, to count the changed elements.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Parser;
use rayon::prelude::*;
use weightcast_core::dtype::Dtype;
use weightcast_core::generator::{Generator, GeneratorConfig};
use weightcast_core::tensors::{Digests, TensorSet, write_safetensors};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Parser)]
#[command(
    about = "Writes the synthetic model as a sharded checkpoint, one step per `next` on stdin"
)]
struct Args {
    /// Model size in bf16 elements (the generator's Llama shape at least this big).
    #[arg(long, default_value_t = 1_000_000_000)]
    elements: u64,
    /// Number of safetensors shard files.
    #[arg(long, default_value_t = 4)]
    shards: usize,
    /// Generator learning rate (1.5e-6: about 1.5% of the elements change per
    /// step at 1e9 elements).
    #[arg(long, default_value_t = 1.5e-6)]
    lr: f32,
    /// Generator seed.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// The checkpoint directory (created; its shard files are replaced).
    #[arg(long)]
    out: PathBuf,
}

/// The shard files' names, Hugging Face style.
fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
}

/// Splits the tensors (in the model's order) into `n` contiguous, non-empty
/// groups of about equal bytes: a tensor goes to the shard its middle byte
/// falls in, never skipping a shard, and leaving at least one tensor for each
/// shard after it (`n` must not exceed the number of tensors).
fn plan_shards(sizes: &[u64], n: usize) -> Vec<usize> {
    let total = sizes.iter().sum::<u64>().max(1) as u128;
    let mut before = 0u128;
    let mut prev = 0usize;
    sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            let middle = before + s as u128 / 2;
            before += s as u128;
            let proportional = (middle * n as u128 / total) as usize;
            let left = sizes.len() - i;
            let shard = proportional
                .min(prev + usize::from(i > 0))
                .max(n.saturating_sub(left))
                .min(n - 1);
            prev = shard;
            shard
        })
        .collect()
}

/// Elements (bf16 words) whose bytes differ between `a` and `b` (the
/// library's SIMD compare: this crate's own code builds at opt-level 0).
fn changed_words(a: &[u8], b: &[u8]) -> u64 {
    a.par_chunks(1 << 20)
        .zip(b.par_chunks(1 << 20))
        .map(|(x, y)| weightcast_core::codec::scan::count_changed_plain(2, x, y))
        .sum()
}

struct Writer {
    out: PathBuf,
    /// The model's tensor names in order, with their shard.
    order: Vec<(String, usize)>,
    shards: usize,
}

impl Writer {
    fn new(out: &Path, cfg: &GeneratorConfig, shards: usize) -> Result<Writer> {
        if shards == 0 || shards > 99_999 {
            return Err(format!("--shards {shards}: expected 1 to 99999").into());
        }
        if shards > cfg.tensors.len() {
            return Err(format!(
                "--shards {shards}: the model has only {} tensors",
                cfg.tensors.len()
            )
            .into());
        }
        std::fs::create_dir_all(out)
            .map_err(|e| format!("creating the checkpoint directory {}: {e}", out.display()))?;
        let sizes: Vec<u64> = cfg
            .tensors
            .iter()
            .map(|t| t.shape.iter().product::<usize>() as u64 * 2)
            .collect();
        let plan = plan_shards(&sizes, shards);
        let order = cfg
            .tensors
            .iter()
            .zip(plan)
            .map(|(t, s)| (t.name.clone(), s))
            .collect();
        Ok(Writer {
            out: out.to_path_buf(),
            order,
            shards,
        })
    }

    /// Writes `config.json` and the index (once; they never change).
    fn write_static(&self, cfg: &GeneratorConfig, set: &TensorSet) -> Result<()> {
        let weight_map: serde_json::Map<String, serde_json::Value> = self
            .order
            .iter()
            .map(|(name, s)| (name.clone(), shard_name(*s, self.shards).into()))
            .collect();
        let index = serde_json::json!({
            "metadata": {"total_size": set.total_bytes()},
            "weight_map": weight_map,
        });
        let hidden = cfg
            .tensors
            .iter()
            .find(|t| t.name == "model.norm.weight")
            .map_or(0, |t| t.shape[0]);
        let layers = cfg
            .tensors
            .iter()
            .filter(|t| t.name.ends_with(".input_layernorm.weight"))
            .count();
        let config = serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "torch_dtype": "bfloat16",
            "weightcast_generator": {"seed": cfg.seed, "lr": cfg.lr, "elements": cfg.elements()},
        });
        for (name, value) in [
            ("model.safetensors.index.json", index),
            ("config.json", config),
        ] {
            let text = serde_json::to_string_pretty(&value)? + "\n";
            replace(&self.out.join(name), |f| {
                f.write_all(text.as_bytes())?;
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Rewrites every shard with `set`; returns the elements that differ from
    /// the shard files replaced (every element when there were none).
    fn write_shards(&self, set: &TensorSet) -> Result<u64> {
        let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let mut changed = 0u64;
        for s in 0..self.shards {
            let views: Vec<(&str, Dtype, &[usize], &[u8])> = self
                .order
                .iter()
                .filter(|(_, shard)| *shard == s)
                .map(|(name, _)| {
                    let i = set
                        .position(name)
                        .ok_or_else(|| format!("tensor `{name}` missing from the snapshot"))?;
                    let t = &set.tensors()[i];
                    Ok((name.as_str(), t.dtype, t.shape.as_slice(), set.data(i)))
                })
                .collect::<Result<_>>()?;
            let path = self.out.join(shard_name(s, self.shards));
            changed += match path.exists() {
                true => {
                    // This process's own file, replaced only by the rename below.
                    let old = TensorSet::map(&path, false, Digests::Skip)
                        .map_err(|e| format!("reading the previous {}: {e}", path.display()))?;
                    views
                        .iter()
                        .map(|(name, _, _, data)| {
                            let i = old.position(name).ok_or_else(|| {
                                format!("tensor `{name}` missing from {}", path.display())
                            })?;
                            Ok(changed_words(old.data(i), data))
                        })
                        .sum::<Result<u64>>()?
                }
                false => views.iter().map(|v| v.3.len() as u64 / 2).sum(),
            };
            replace(&path, |f| {
                write_safetensors(&views, &metadata, f)?;
                Ok(())
            })?;
        }
        Ok(changed)
    }
}

/// Writes `path` through a hidden temporary file in the same directory,
/// renamed over it.
fn replace(
    path: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> Result<()>,
) -> Result<()> {
    let dir = path.parent().ok_or("a file path has a directory")?;
    let name = path
        .file_name()
        .ok_or("a file path has a name")?
        .to_string_lossy();
    let tmp = dir.join(format!(".{name}.tmp"));
    let io = |what: &str, p: &Path, e: std::io::Error| format!("{what} {}: {e}", p.display());
    let file = std::fs::File::create(&tmp).map_err(|e| io("creating", &tmp, e))?;
    let mut w = std::io::BufWriter::with_capacity(8 << 20, file);
    write(&mut w).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    w.flush().map_err(|e| io("writing", &tmp, e))?;
    drop(w);
    std::fs::rename(&tmp, path).map_err(|e| io("renaming into place", path, e))?;
    Ok(())
}

fn report(step: u64, changed: u64, set: &TensorSet, started: Instant) -> Result<()> {
    let line = serde_json::json!({
        "step": step,
        "changed": changed,
        "elements": set.total_elements(),
        "bytes": set.total_bytes(),
        "seconds": started.elapsed().as_secs_f64(),
    });
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()?;
    Ok(())
}

fn run(args: Args) -> Result<()> {
    let started = Instant::now();
    let mut cfg = GeneratorConfig::with_elements(args.seed, args.elements);
    cfg.lr = args.lr;
    let writer = Writer::new(&args.out, &cfg, args.shards)?;
    let mut g = Generator::new(cfg.clone());
    let set = g.snapshot_without_digests();
    writer.write_static(&cfg, &set)?;
    let changed = writer.write_shards(&set)?;
    report(0, changed, &set, started)?;
    drop(set);
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| format!("reading stdin: {e}"))?;
        match line.trim() {
            "next" => {}
            "" => continue,
            other => {
                return Err(format!("unexpected input line `{other}` (expected `next`)").into());
            }
        }
        let started = Instant::now();
        g.step();
        let set = g.snapshot_without_digests();
        let changed = writer.write_shards(&set)?;
        report(g.steps(), changed, &set, started)?;
    }
    Ok(())
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("bench_model: {e}");
        std::process::exit(2);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_split_by_bytes() {
        assert_eq!(plan_shards(&[10, 10, 10, 10], 2), vec![0, 0, 1, 1]);
        assert_eq!(plan_shards(&[100, 1, 1, 1], 2), vec![0, 1, 1, 1]);
        assert_eq!(plan_shards(&[1, 1, 100], 3), vec![0, 1, 2]);
        assert_eq!(plan_shards(&[1, 100, 1, 1], 3), vec![0, 1, 2, 2]);
        assert_eq!(plan_shards(&[5], 1), vec![0]);
        // No shard is empty, none is skipped.
        let sizes: Vec<u64> = (0..50).map(|i| (i * 7919 % 13 + 1) as u64).collect();
        for n in 1..=50 {
            let plan = plan_shards(&sizes, n);
            assert_eq!(plan[0], 0);
            assert_eq!(*plan.last().unwrap(), n - 1);
            assert!(plan.windows(2).all(|w| w[1] == w[0] || w[1] == w[0] + 1));
        }
    }

    #[test]
    fn changed_words_counts_elements() {
        assert_eq!(changed_words(&[1, 2, 3, 4], &[1, 2, 3, 5]), 1);
        assert_eq!(changed_words(&[1, 2, 3, 4], &[0, 0, 0, 0]), 2);
    }
}
