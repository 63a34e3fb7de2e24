//! The codec benchmark behind `weightcast bench codec`.
//!
//! On the synthetic generator it measures, per step and encoding: bytes per
//! changed element, reduction against the full bf16 size, encode and
//! decode+apply throughput as a ratio to a plain compare of the *same two
//! buffers in the same run*, and the extra memory each operation allocates.
//! Ratios, not absolute speeds, are what is comparable across noisy machines.

use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

use crate::codec::scan::count_changed_plain;
use crate::codec::{DeltaOptions, apply_delta, encode_delta};
use crate::dtype::word_bytes;
use crate::error::{Error, Result};
use crate::format::Encoding;
use crate::generator::{ChangeStats, Generator, GeneratorConfig, change_stats};
use crate::tensors::TensorSet;

/// Reads allocation figures (the binary wires a counting global allocator in).
pub trait MemProbe: Sync {
    /// Bytes allocated now.
    fn current(&self) -> u64;
    /// Highest `current` since the last reset.
    fn peak(&self) -> u64;
    /// Starts a new peak measurement.
    fn reset_peak(&self);
}

/// A probe that knows nothing (memory columns read 0).
pub struct NoProbe;

impl MemProbe for NoProbe {
    fn current(&self) -> u64 {
        0
    }
    fn peak(&self) -> u64 {
        0
    }
    fn reset_peak(&self) {}
}

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Approximate model size in elements.
    pub elements: u64,
    /// Measured steps.
    pub steps: u32,
    /// Learning rate of the generator.
    pub lr: f32,
    /// Encodings to measure.
    pub encodings: Vec<Encoding>,
    /// Seed.
    pub seed: u64,
    /// Timed repetitions per operation (the median is reported).
    pub reps: u32,
}

/// One measurement.
#[derive(Clone, Debug, Serialize)]
pub struct BenchRow {
    /// Step number.
    pub step: u32,
    /// Encoding.
    pub encoding: Encoding,
    /// Elements of the model.
    pub elements: u64,
    /// Changed elements.
    pub changed: u64,
    /// Changed / elements.
    pub density: f64,
    /// Delta object size.
    pub delta_bytes: u64,
    /// Delta bytes per changed element.
    pub bytes_per_changed: f64,
    /// Full bf16 size / delta size.
    pub reduction: f64,
    /// Seconds of the plain two-buffer compare.
    pub compare_s: f64,
    /// Seconds of diff + encode.
    pub encode_s: f64,
    /// Seconds of decode + verify + apply.
    pub apply_s: f64,
    /// compare_s / encode_s (≥ 1 means encoding is as fast as the compare).
    pub encode_vs_compare: f64,
    /// compare_s / apply_s.
    pub apply_vs_compare: f64,
    /// The per-repetition ratios the two medians above come from (each
    /// against the mean of the compares timed just before and just after the
    /// operation), in run order: their spread shows how noisy the machine was.
    pub encode_ratios: Vec<f64>,
    /// Per-repetition compare / apply ratios.
    pub apply_ratios: Vec<f64>,
    /// Bytes allocated at peak during encode, beyond what existed before it.
    pub encode_extra_peak: u64,
    /// Bytes allocated at peak during apply, beyond what existed before it.
    pub apply_extra_peak: u64,
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// Elements of the model.
    pub elements: u64,
    /// Full bf16 size in bytes.
    pub model_bytes: u64,
    /// Rayon worker threads.
    pub threads: usize,
    /// Learning rate.
    pub lr: f32,
    /// Change statistics per step.
    pub stats: Vec<ChangeStats>,
    /// Measurements.
    pub rows: Vec<BenchRow>,
    /// The full digest pass over the model (what loading or verifying an
    /// anchor costs), measured in step 1.
    pub digest_pass: Option<DigestPass>,
}

/// Timing of a full digest pass over every tensor of the model.
#[derive(Clone, Debug, Serialize)]
pub struct DigestPass {
    /// Median seconds.
    pub seconds: f64,
    /// Median of the per-repetition compare / pass ratios (each against the
    /// mean of the compares just before and after it). The compare reads two
    /// buffers and the pass one, so 2× would mean both run at memory speed.
    pub vs_compare: f64,
    /// The per-repetition ratios, in run order.
    pub ratios: Vec<f64>,
    /// Whether the AVX-512 pass ran (`false`: the portable table loop).
    pub vector: bool,
}

/// The baseline: count differing words of every tensor, with the same
/// parallelism the codec gets.
pub fn plain_compare(a: &TensorSet, b: &TensorSet) -> u64 {
    (0..a.len())
        .into_par_iter()
        .map(|i| {
            let wb = word_bytes(a.tensors()[i].dtype);
            let chunk = (1usize << 22) * wb;
            a.data(i)
                .par_chunks(chunk)
                .zip(b.data(i).par_chunks(chunk))
                .map(|(x, y)| count_changed_plain(wb, x, y))
                .sum::<u64>()
        })
        .sum()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn measured<T>(probe: &dyn MemProbe, f: impl FnOnce() -> T) -> (T, f64, u64) {
    let before = probe.current();
    probe.reset_peak();
    let t = Instant::now();
    let out = f();
    let secs = t.elapsed().as_secs_f64();
    (out, secs, probe.peak().saturating_sub(before))
}

/// Runs the benchmark; `progress` receives one line per measurement.
pub fn run(
    cfg: &BenchConfig,
    probe: &dyn MemProbe,
    mut progress: impl FnMut(&str),
) -> Result<BenchReport> {
    let mut gcfg = GeneratorConfig::with_elements(cfg.seed, cfg.elements);
    gcfg.lr = cfg.lr;
    let mut g = Generator::new(gcfg);
    let elements = g.config().elements();
    let mut report = BenchReport {
        elements,
        model_bytes: elements * 2,
        threads: rayon::current_num_threads(),
        lr: cfg.lr,
        stats: Vec::new(),
        rows: Vec::new(),
        digest_pass: None,
    };
    progress(&format!(
        "model: {elements} bf16 elements ({:.2} GB), {} threads",
        elements as f64 * 2e-9,
        report.threads
    ));
    let mut base = g.snapshot();
    for step in 1..=cfg.steps {
        g.step();
        let mut new = g.snapshot_without_digests();
        let stats = change_stats(&base, &new);
        report.stats.push(stats.clone());
        let reps = cfg.reps.max(1);
        // Interleave: every encode and every apply is timed between two
        // compares, and its ratio taken against their mean, so slow drifts of
        // the machine hit both sides alike; the median of the per-repetition
        // ratios is reported.
        struct Acc {
            encode: Vec<f64>,
            apply: Vec<f64>,
            encode_ratio: Vec<f64>,
            apply_ratio: Vec<f64>,
            encode_peak: u64,
            apply_peak: u64,
            summary: Option<crate::codec::DeltaSummary>,
        }
        let mut accs: Vec<Acc> = cfg
            .encodings
            .iter()
            .map(|_| Acc {
                encode: Vec::new(),
                apply: Vec::new(),
                encode_ratio: Vec::new(),
                apply_ratio: Vec::new(),
                encode_peak: 0,
                apply_peak: 0,
                summary: None,
            })
            .collect();
        let mut compare_times = Vec::new();
        for _ in 0..reps {
            let (changed_plain, mut compare_before, _) =
                measured(probe, || plain_compare(&base, &new));
            compare_times.push(compare_before);
            for (acc, &encoding) in accs.iter_mut().zip(&cfg.encodings) {
                let opts = DeltaOptions {
                    encoding,
                    model_version: step as u64,
                    base_version: step as u64 - 1,
                    // v1: the layout docs/benchmarks.md's `trl` rows measure.
                    trl: crate::format::TrlOptions::V1,
                };
                let (encoded, encode_s, peak) =
                    measured(probe, || encode_delta(&base, &mut new, &opts));
                let (delta, summary) = encoded?;
                if summary.changed != changed_plain {
                    return Err(Error::metadata(
                        "bench",
                        format!(
                            "codec found {} changes, compare {changed_plain}",
                            summary.changed
                        ),
                    ));
                }
                acc.encode_peak = acc.encode_peak.max(peak);
                let mut replica = base.clone();
                let (_, compare_mid, _) = measured(probe, || plain_compare(&base, &new));
                let (applied, apply_s, peak) =
                    measured(probe, || apply_delta(&mut replica, &delta));
                applied?;
                acc.apply_peak = acc.apply_peak.max(peak);
                for i in 0..new.len() {
                    if replica.data(i) != new.data(i) {
                        return Err(Error::tensor(
                            &new.tensors()[i].name,
                            "bench replica differs after apply",
                        ));
                    }
                }
                let (_, compare_after, _) = measured(probe, || plain_compare(&base, &new));
                compare_times.extend([compare_mid, compare_after]);
                acc.encode.push(encode_s);
                acc.apply.push(apply_s);
                // Each operation against the mean of the compares just before
                // and just after it: drifts of the machine's speed cancel.
                acc.encode_ratio
                    .push((compare_before + compare_mid) / 2.0 / encode_s);
                acc.apply_ratio
                    .push((compare_mid + compare_after) / 2.0 / apply_s);
                acc.summary = Some(summary);
                compare_before = compare_after;
            }
        }
        if step == 1 {
            let pass = digest_pass(&base, &new, reps);
            progress(&format!(
                "full digest pass: {:.3}s, {:.2}x compare ({}), {}",
                pass.seconds,
                pass.vs_compare,
                range(&pass.ratios),
                if pass.vector { "AVX-512" } else { "portable" }
            ));
            report.digest_pass = Some(pass);
        }
        let compare_s = median(compare_times);
        for (acc, &encoding) in accs.into_iter().zip(&cfg.encodings) {
            let summary = acc.summary.expect("at least one repetition");
            let (encode_s, apply_s) = (median(acc.encode), median(acc.apply));
            let (encode_extra_peak, apply_extra_peak) = (acc.encode_peak, acc.apply_peak);
            let row = BenchRow {
                step,
                encoding,
                elements,
                changed: summary.changed,
                density: summary.changed as f64 / elements as f64,
                delta_bytes: summary.bytes,
                bytes_per_changed: summary.bytes as f64 / summary.changed.max(1) as f64,
                reduction: (elements * 2) as f64 / summary.bytes as f64,
                compare_s,
                encode_s,
                apply_s,
                encode_vs_compare: median(acc.encode_ratio.clone()),
                apply_vs_compare: median(acc.apply_ratio.clone()),
                encode_ratios: acc.encode_ratio,
                apply_ratios: acc.apply_ratio,
                encode_extra_peak,
                apply_extra_peak,
            };
            progress(&format!(
                "step {step} {encoding:>7}: density {:.3}%  {:.3} B/changed  {:.0}x smaller  encode {:.2}x compare ({})  apply {:.2}x compare ({})  (compare {:.3}s, encode {:.3}s, apply {:.3}s)  extra peak encode {} MB, apply {} MB",
                row.density * 100.0,
                row.bytes_per_changed,
                row.reduction,
                row.encode_vs_compare,
                range(&row.encode_ratios),
                row.apply_vs_compare,
                range(&row.apply_ratios),
                compare_s,
                encode_s,
                apply_s,
                encode_extra_peak >> 20,
                apply_extra_peak >> 20,
            ));
            report.rows.push(row);
        }
        base = new;
    }
    Ok(report)
}

/// `lo–hi` of a list of ratios.
fn range(v: &[f64]) -> String {
    let (lo, hi) = v
        .iter()
        .fold((f64::INFINITY, 0f64), |(l, h), &x| (l.min(x), h.max(x)));
    format!("{lo:.2}–{hi:.2}")
}

/// Times a full digest pass over `new`, each repetition between two compares
/// of `base` and `new`.
fn digest_pass(base: &TensorSet, new: &TensorSet, reps: u32) -> DigestPass {
    let time = |f: &dyn Fn() -> u64| measured(&NoProbe, f).1;
    let mut before = time(&|| plain_compare(base, new));
    let mut seconds = Vec::new();
    let mut ratios = Vec::new();
    for _ in 0..reps {
        let s = time(&|| new.full_digests().len() as u64);
        let after = time(&|| plain_compare(base, new));
        seconds.push(s);
        ratios.push((before + after) / 2.0 / s);
        before = after;
    }
    DigestPass {
        seconds: median(seconds),
        vs_compare: median(ratios.clone()),
        ratios,
        vector: crate::digest::full_pass_vector(),
    }
}
