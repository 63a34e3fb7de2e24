//! The compact codec on real optimizer traces (`scripts/make_traces.py`):
//! bytes per changed element of every step's delta, per trace.
//!
//! ```sh
//! cargo build --release --example trace_codec
//! target/release/examples/trace_codec /work/traces/tune/* [--steps N]
//! ```
//!
//! A trace is the bf16 cast of the initial weights (`step_00000.safetensors`,
//! U16 bit patterns) and, per step, the changed elements (`step_NNNNN.delta.zst`:
//! zstd of a safetensors file with `<name>.gap` U32 gaps and `<name>.val` U16 new
//! words). The states are rebuilt in memory, step by step.

use std::path::{Path, PathBuf};

use weightcast_core::codec::compact::context::TensorContext;
use weightcast_core::codec::compact::{Block, BlockUndo, Ctx, apply_block, encode_tensor, v2};
use weightcast_core::digest::TensorSeed;
use weightcast_core::dtype::{Dtype, KeyKind};

/// One parameter of a trace: name, shape, seed and its current words.
struct Param {
    name: String,
    seed: TensorSeed,
    words: Vec<u8>,
    /// The `compact2` context: the changes of the previous step.
    ctx: Option<TensorContext>,
}

/// One parameter's changes in a step: its index, the flat indices, the new words.
type Changes = (usize, Vec<u64>, Vec<u16>);

/// A trace being replayed.
struct Trace {
    dir: PathBuf,
    params: Vec<Param>,
    step: usize,
}

impl Trace {
    fn open(dir: &Path) -> Trace {
        let bytes = std::fs::read(dir.join("step_00000.safetensors")).expect("step 0");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
        let mut params: Vec<Param> = st
            .tensors()
            .into_iter()
            .map(|(name, v)| Param {
                seed: TensorSeed::new(&name, Dtype::BF16, v.shape()),
                name,
                words: v.data().to_vec(),
                ctx: None,
            })
            .collect();
        params.sort_by(|a, b| a.name.cmp(&b.name));
        Trace {
            dir: dir.to_path_buf(),
            params,
            step: 0,
        }
    }

    /// The next step's changes per parameter (index in `params`, flat
    /// indices, new words), or `None` at the end of the trace.
    fn next_changes(&mut self) -> Option<Vec<Changes>> {
        let path = self
            .dir
            .join(format!("step_{:05}.delta.zst", self.step + 1));
        let z = std::fs::read(path).ok()?;
        let blob = zstd::decode_all(&z[..]).ok()?;
        self.step += 1;
        let mut out = Vec::new();
        if blob.is_empty() {
            return Some(out);
        }
        let st = safetensors::SafeTensors::deserialize(&blob).expect("step safetensors");
        for (p, param) in self.params.iter().enumerate() {
            let Ok(g) = st.tensor(&format!("{}.gap", param.name)) else {
                continue;
            };
            let v = st.tensor(&format!("{}.val", param.name)).expect("values");
            let mut at = 0u64;
            let idx: Vec<u64> = g
                .data()
                .chunks_exact(4)
                .enumerate()
                .map(|(j, c)| {
                    let gap = u32::from_le_bytes(c.try_into().unwrap()) as u64;
                    at += gap + u64::from(j > 0);
                    at
                })
                .collect();
            let val: Vec<u16> = v
                .data()
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes(c.try_into().unwrap()))
                .collect();
            out.push((p, idx, val));
        }
        Some(out)
    }
}

fn main() {
    let mut dirs = Vec::new();
    let mut max_steps = usize::MAX;
    let mut anchor_every = 10usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--steps" => max_steps = args.next().expect("--steps N").parse().expect("N"),
            "--anchor-every" => {
                anchor_every = args.next().expect("--anchor-every N").parse().expect("N")
            }
            _ => dirs.push(PathBuf::from(a)),
        }
    }
    println!(
        "trace\tstep\tsince_anchor\tdensity\tchanged\tcompact\tcompact2\tB/ch_compact\tB/ch_compact2\tratio"
    );
    for dir in &dirs {
        let mut tr = Trace::open(dir);
        let total: usize = tr.params.iter().map(|p| p.words.len() / 2).sum();
        // Totals over the deltas written with context, and over all.
        let (mut ctx_v1, mut ctx_v2, mut ctx_n) = (0u64, 0u64, 0u64);
        let (mut all_v1, mut all_v2, mut all_n) = (0u64, 0u64, 0u64);
        while tr.step < max_steps {
            let Some(changes) = tr.next_changes() else {
                break;
            };
            let since = (tr.step - 1) % anchor_every;
            if since == 0 {
                for p in &mut tr.params {
                    p.ctx = None;
                }
            }
            let (mut b1, mut b2, mut changed) = (0u64, 0u64, 0u64);
            let mut touched = vec![false; tr.params.len()];
            for (p, idx, val) in changes {
                touched[p] = true;
                let param = &mut tr.params[p];
                let mut new = param.words.clone();
                for (&i, &v) in idx.iter().zip(&val) {
                    new[2 * i as usize..2 * i as usize + 2].copy_from_slice(&v.to_le_bytes());
                }
                let e = encode_tensor(KeyKind::SignMagnitude, 2, param.seed, &param.words, &new);
                assert_eq!(e.changed, idx.len() as u64, "{}", param.name);
                let e2 = v2::encode_tensor(
                    KeyKind::SignMagnitude,
                    2,
                    param.seed,
                    (&param.words, &new),
                    (param.ctx.as_ref(), 0),
                );
                // Bit-identical round trip of every block, with the context.
                check(&param.words, &new, &e2, param.ctx.as_ref(), param.seed);
                b1 += e.payload.len() as u64;
                b2 += e2.tensor.payload.len() as u64;
                changed += e.changed;
                param.words = new;
                param.ctx = Some(e2.next);
            }
            // Tensors this step left alone have an empty context next.
            for (p, t) in touched.iter().enumerate() {
                if !t {
                    tr.params[p].ctx = Some(TensorContext::default());
                }
            }
            (all_v1, all_v2, all_n) = (all_v1 + b1, all_v2 + b2, all_n + changed);
            if since > 0 {
                (ctx_v1, ctx_v2, ctx_n) = (ctx_v1 + b1, ctx_v2 + b2, ctx_n + changed);
            }
            println!(
                "{}\t{}\t{since}\t{:.4}\t{changed}\t{b1}\t{b2}\t{:.4}\t{:.4}\t{:.3}",
                dir.file_name().unwrap().to_string_lossy(),
                tr.step,
                changed as f64 / total as f64,
                b1 as f64 / changed.max(1) as f64,
                b2 as f64 / changed.max(1) as f64,
                b1 as f64 / b2.max(1) as f64,
            );
        }
        eprintln!(
            "{}: {} steps, density {:.4}; with context: compact {:.4} B/changed, compact2 {:.4} ({:.3}x); all: {:.4}, {:.4} ({:.3}x)",
            dir.display(),
            tr.step,
            all_n as f64 / tr.step.max(1) as f64 / total as f64,
            ctx_v1 as f64 / ctx_n.max(1) as f64,
            ctx_v2 as f64 / ctx_n.max(1) as f64,
            ctx_v1 as f64 / ctx_v2.max(1) as f64,
            all_v1 as f64 / all_n.max(1) as f64,
            all_v2 as f64 / all_n.max(1) as f64,
            all_v1 as f64 / all_v2.max(1) as f64,
        );
    }
}

/// Applies every block of `e` to a copy of `base` (with the context) and
/// checks the result is `new`, bit for bit, and the digest change.
fn check(base: &[u8], new: &[u8], e: &v2::Encoded2, ctx: Option<&TensorContext>, seed: TensorSeed) {
    let bw = weightcast_core::codec::compact::BLOCK_WORDS as usize;
    let mut out = base.to_vec();
    let mut at = 0usize;
    let mut dig = 0u64;
    for (b, (entry, blk)) in e
        .tensor
        .blocks
        .iter()
        .zip(out.chunks_mut(bw * 2))
        .enumerate()
    {
        let stream = &e.tensor.payload[at..at + entry.bytes as usize];
        at += entry.bytes as usize;
        let block = Block {
            tensor: "t",
            index: b,
            entry,
            stream,
            wb: 2,
            words: (blk.len() / 2) as u64,
            context: Some(ctx.map_or(&[][..], |c| c.block(b))),
        };
        let c = Ctx {
            kind: KeyKind::SignMagnitude,
            seed,
            first: (b * bw) as u64,
        };
        dig = dig
            .wrapping_add(apply_block(&block, c, blk, &mut BlockUndo::default()).expect("apply"));
    }
    assert!(out == new, "round trip differs");
    assert_eq!(dig, e.tensor.digest_change);
}
