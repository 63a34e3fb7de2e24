//! The end-to-end demo behind `weightcast demo`: a few training steps of the
//! synthetic model published as anchors and deltas into a local bucket
//! directory, replayed by two replicas (one from the start, one joining late
//! from the newest anchor), with bit-identity checked at every version.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::codec::{DeltaOptions, apply_delta, encode_anchor, encode_delta, read_anchor};
use crate::error::{Error, Result};
use crate::format::Encoding;
use crate::generator::{Generator, GeneratorConfig};
use crate::tensors::TensorSet;

/// Demo settings.
#[derive(Clone, Debug)]
pub struct DemoConfig {
    /// Where the bucket directory goes.
    pub dir: PathBuf,
    /// Training steps (versions after the first anchor).
    pub steps: u64,
    /// An anchor every this many versions.
    pub anchor_every: u64,
    /// Delta encoding.
    pub encoding: Encoding,
    /// Model configuration.
    pub model: GeneratorConfig,
}

/// One published version.
#[derive(Clone, Debug, Serialize)]
pub struct DemoStep {
    /// Version number.
    pub version: u64,
    /// `anchor` or `delta`.
    pub kind: &'static str,
    /// Bytes written to the bucket.
    pub bytes: u64,
    /// Changed elements.
    pub changed: u64,
    /// Full size / bytes.
    pub reduction: f64,
    /// Seconds to encode.
    pub encode_s: f64,
    /// Seconds for a replica to apply and verify.
    pub apply_s: f64,
}

/// The demo's outcome.
#[derive(Clone, Debug, Serialize)]
pub struct DemoReport {
    /// Elements of the model.
    pub elements: u64,
    /// Full bf16 size.
    pub full_bytes: u64,
    /// Per version.
    pub steps: Vec<DemoStep>,
    /// Whether both replicas matched the trainer at every version.
    pub bit_identical: bool,
}

fn object_path(dir: &Path, kind: &str, version: u64) -> PathBuf {
    dir.join(kind).join(format!("{version:012}.safetensors"))
}

fn write_object(path: &Path, bytes: &[u8]) -> Result<()> {
    let parent = path.parent().expect("object paths have a parent");
    std::fs::create_dir_all(parent)
        .map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(format!("renaming {}", path.display()), e))
}

fn read_object(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))
}

fn same_bytes(a: &TensorSet, b: &TensorSet) -> bool {
    a.len() == b.len() && (0..a.len()).all(|i| a.data(i) == b.data(i))
}

/// Runs the demo; `progress` receives one human-readable line per event.
pub fn run(cfg: &DemoConfig, mut progress: impl FnMut(&str)) -> Result<DemoReport> {
    let mut trainer = Generator::new(cfg.model.clone());
    let elements = trainer.config().elements();
    let full = elements * 2;
    progress(&format!(
        "model: {} tensors, {elements} bf16 elements ({:.1} MB); bucket: {}",
        cfg.model.tensors.len(),
        full as f64 / 1e6,
        cfg.dir.display()
    ));
    let mut published = trainer.snapshot();
    let (bytes, _) = encode_anchor(&published, 0)?;
    write_object(&object_path(&cfg.dir, "anchors", 0), &bytes)?;
    let mut early = read_anchor(read_object(&object_path(&cfg.dir, "anchors", 0))?)?.1;
    let mut report = DemoReport {
        elements,
        full_bytes: full,
        steps: vec![DemoStep {
            version: 0,
            kind: "anchor",
            bytes: bytes.len() as u64,
            changed: elements,
            reduction: full as f64 / bytes.len() as f64,
            encode_s: 0.0,
            apply_s: 0.0,
        }],
        bit_identical: true,
    };
    progress(&format!("v0  anchor {:>12} bytes", bytes.len()));
    let mut last_anchor = 0;
    for v in 1..=cfg.steps {
        trainer.step();
        let mut next = trainer.snapshot_without_digests();
        let t = Instant::now();
        let step = if v % cfg.anchor_every == 0 {
            next.compute_digests();
            let (bytes, _) = encode_anchor(&next, v)?;
            let encode_s = t.elapsed().as_secs_f64();
            write_object(&object_path(&cfg.dir, "anchors", v), &bytes)?;
            last_anchor = v;
            let t = Instant::now();
            early = read_anchor(read_object(&object_path(&cfg.dir, "anchors", v))?)?.1;
            DemoStep {
                version: v,
                kind: "anchor",
                bytes: bytes.len() as u64,
                changed: elements,
                reduction: full as f64 / bytes.len() as f64,
                encode_s,
                apply_s: t.elapsed().as_secs_f64(),
            }
        } else {
            let opts = DeltaOptions {
                encoding: cfg.encoding,
                model_version: v,
                base_version: v - 1,
                trl: Default::default(),
            };
            let (bytes, summary) = encode_delta(&published, &mut next, &opts)?;
            let encode_s = t.elapsed().as_secs_f64();
            write_object(&object_path(&cfg.dir, "deltas", v), &bytes)?;
            let t = Instant::now();
            apply_delta(
                &mut early,
                &read_object(&object_path(&cfg.dir, "deltas", v))?,
            )?;
            DemoStep {
                version: v,
                kind: "delta",
                bytes: bytes.len() as u64,
                changed: summary.changed,
                reduction: full as f64 / bytes.len() as f64,
                encode_s,
                apply_s: t.elapsed().as_secs_f64(),
            }
        };
        let ok = same_bytes(&early, &next) && early.digest() == next.digest();
        report.bit_identical &= ok;
        progress(&format!(
            "v{v:<3} {:<6} {:>12} bytes  {:>8} changed ({:.2}%)  {:>7.1}x smaller  encode {:>6.1} ms  replica apply+verify {:>6.1} ms  {}",
            step.kind,
            step.bytes,
            step.changed,
            step.changed as f64 * 100.0 / elements as f64,
            step.reduction,
            step.encode_s * 1e3,
            step.apply_s * 1e3,
            if ok { "bit-identical" } else { "MISMATCH" }
        ));
        report.steps.push(step);
        published = next;
    }
    // A late joiner: newest anchor, then every delta after it.
    let t = Instant::now();
    let mut late = read_anchor(read_object(&object_path(&cfg.dir, "anchors", last_anchor))?)?.1;
    for v in last_anchor + 1..=cfg.steps {
        apply_delta(
            &mut late,
            &read_object(&object_path(&cfg.dir, "deltas", v))?,
        )?;
    }
    let ok = same_bytes(&late, &published);
    report.bit_identical &= ok;
    progress(&format!(
        "late joiner: anchor v{last_anchor} + {} deltas in {:.1} ms: {}",
        cfg.steps - last_anchor,
        t.elapsed().as_secs_f64() * 1e3,
        if ok { "bit-identical" } else { "MISMATCH" }
    ));
    Ok(report)
}
