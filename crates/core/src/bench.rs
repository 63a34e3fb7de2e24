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
use crate::codec::{Context, DeltaOptions, apply_delta_ctx, encode_delta_ctx};
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
    // `compact2`: the context of `base` (the changes of the step before it),
    // as the publisher and a subscriber hold it; none at the first step (as
    // right after an anchor).
    let mut context: Option<Context> = None;
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
                    // `compact2` itself at every density: what is measured.
                    compact2_max_density: 1.0,
                };
                let ctx = context.as_ref();
                let (encoded, encode_s, peak) =
                    measured(probe, || encode_delta_ctx(&base, &mut new, &opts, ctx));
                let (delta, summary, _) = encoded?;
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
                    measured(probe, || apply_delta_ctx(&mut replica, &delta, ctx));
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
        if cfg.encodings.contains(&Encoding::Compact2) {
            let opts = DeltaOptions {
                compact2_max_density: 1.0,
                ..DeltaOptions::new(Encoding::Compact2, step as u64, step as u64 - 1)
            };
            context = encode_delta_ctx(&base, &mut new, &opts, context.as_ref())?.2;
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

// ---------------------------------------------------------------------------
// Compressed anchors (`weightcast bench anchors`).

/// What `weightcast bench anchors` runs.
#[derive(Clone, Debug)]
pub struct AnchorBenchConfig {
    /// Words per chunk to try.
    pub chunk_words: Vec<u64>,
    /// zstd levels to try.
    pub levels: Vec<i32>,
    /// Timed repetitions per operation (the median is reported).
    pub reps: u32,
}

/// One (chunk size, level) measurement of `planes` anchors.
#[derive(Clone, Debug, Serialize)]
pub struct AnchorBenchRow {
    /// Words per chunk.
    pub chunk_words: u64,
    /// zstd level.
    pub level: i32,
    /// Tensor bytes (the `full` anchor's data section).
    pub raw_bytes: u64,
    /// Compressed chunk bytes (the `planes` anchor's data section).
    pub stored_bytes: u64,
    /// The whole `planes` object.
    pub object_bytes: u64,
    /// raw_bytes / stored_bytes.
    pub ratio: f64,
    /// Planes stored raw / all planes.
    pub raw_planes: f64,
    /// Median seconds of the parallel memcpy of the tensor bytes.
    pub memcpy_s: f64,
    /// Median seconds of the encode (writer into memory).
    pub encode_s: f64,
    /// Median seconds of the decode with every digest checked.
    pub decode_s: f64,
    /// Median seconds of the decode alone (no digests).
    pub decode_only_s: f64,
    /// Tensor bytes per second, encode (GB/s).
    pub encode_gbps: f64,
    /// Tensor bytes per second, decode with every digest checked (GB/s).
    pub decode_gbps: f64,
    /// Tensor bytes per second, decode alone (GB/s).
    pub decode_only_gbps: f64,
    /// Tensor bytes per second, memcpy (GB/s).
    pub memcpy_gbps: f64,
    /// Median of per-repetition memcpy_s / encode_s.
    pub encode_vs_memcpy: f64,
    /// Median of per-repetition memcpy_s / decode_s.
    pub decode_vs_memcpy: f64,
    /// Median of per-repetition memcpy_s / decode_only_s.
    pub decode_only_vs_memcpy: f64,
    /// CPU seconds (all threads) of the median encode, decode alone, decode
    /// with digests and memcpy (Linux; 0 elsewhere). On a machine shared with
    /// other work, `raw_bytes / cpu_s × threads` is the throughput the
    /// threads would reach with the cores to themselves.
    pub cpu_s: CpuSeconds,
}

/// CPU seconds per operation (see [`AnchorBenchRow::cpu_s`]).
#[derive(Clone, Debug, Default, Serialize)]
pub struct CpuSeconds {
    /// Encode.
    pub encode: f64,
    /// Decode alone.
    pub decode_only: f64,
    /// Decode with every digest checked.
    pub decode: f64,
    /// The memcpy.
    pub memcpy: f64,
}

/// CPU time used so far by every thread of this process, in seconds (Linux:
/// the sum of `/proc/self/task/*/schedstat`; 0 elsewhere).
fn cpu_seconds() -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum::<u64>() as f64
        * 1e-9
}

/// Parallel copy of every tensor of `set` into `dst` (the baseline).
fn memcpy_set(set: &TensorSet, dst: &mut [u8]) {
    let mut rest = dst;
    let mut parts = Vec::with_capacity(set.len());
    for i in 0..set.len() {
        let (mine, tail) = rest.split_at_mut(set.data(i).len());
        parts.push((i, mine));
        rest = tail;
    }
    parts.into_par_iter().for_each(|(i, d)| {
        d.par_chunks_mut(1 << 21)
            .zip(set.data(i).par_chunks(1 << 21))
            .for_each(|(d, s)| d.copy_from_slice(s))
    });
}

/// Measures `planes` anchors of `set`: size, and encode and decode time
/// against a parallel memcpy of the same bytes timed around each operation.
/// Every decode is checked bit-identical to `set`.
pub fn run_anchors(
    set: &TensorSet,
    cfg: &AnchorBenchConfig,
    mut progress: impl FnMut(&str),
) -> Result<Vec<AnchorBenchRow>> {
    use crate::codec::planes::{PlanesLayout, PlanesOptions};
    use crate::codec::write_anchor_planes;
    let raw_bytes = set.total_bytes();
    let threads = rayon::current_num_threads();
    let mut copy = vec![0u8; raw_bytes as usize];
    let mut sink: Vec<u8> = Vec::with_capacity(raw_bytes as usize + (1 << 20));
    let mut decoded = vec![0u8; raw_bytes as usize];
    let cpu = std::cell::RefCell::new(Vec::<f64>::new());
    let time = |f: &mut dyn FnMut()| {
        let c = cpu_seconds();
        let t = Instant::now();
        f();
        let s = t.elapsed().as_secs_f64();
        cpu.borrow_mut().push(cpu_seconds() - c);
        s
    };
    // CPU seconds of the last `k`-th timed operation.
    let last_cpu = |k: usize| {
        let c = cpu.borrow();
        c[c.len() - k]
    };
    let mut rows = Vec::new();
    for &chunk_words in &cfg.chunk_words {
        for &level in &cfg.levels {
            let opts = PlanesOptions {
                chunk_words,
                level,
                ..PlanesOptions::default()
            };
            let (mut enc, mut dec, mut copies) = (Vec::new(), Vec::new(), Vec::new());
            let (mut enc_r, mut dec_r) = (Vec::new(), Vec::new());
            let (mut only, mut only_r) = (Vec::new(), Vec::new());
            let mut cpus: Vec<[f64; 4]> = Vec::new();
            let mut before = time(&mut || memcpy_set(set, &mut copy));
            let mut object = Vec::new();
            for _ in 0..cfg.reps.max(1) {
                sink.clear();
                let mut fin = None;
                let e = time(&mut || {
                    fin = Some(write_anchor_planes(set, 1, opts, &mut sink).map(|f| f.prefix))
                });
                let prefix = fin.expect("ran")?;
                let mid = time(&mut || memcpy_set(set, &mut copy));
                object.clear();
                object.extend_from_slice(&prefix);
                object.extend_from_slice(&sink);
                let layout = PlanesLayout::parse(&object)?;
                let mut r = Ok(());
                let d = time(&mut || r = layout.decode_all(&object, &mut decoded));
                r?;
                let after = time(&mut || memcpy_set(set, &mut copy));
                if decoded != copy {
                    return Err(Error::metadata("bench", "decoded anchor differs"));
                }
                decoded.fill(0);
                let mut r = Ok(());
                let o = time(&mut || r = layout.decode_all_as(&object, &mut decoded, false));
                r?;
                let after2 = time(&mut || memcpy_set(set, &mut copy));
                if decoded != copy {
                    return Err(Error::metadata("bench", "decoded anchor differs"));
                }
                only.push(o);
                only_r.push((after + after2) / 2.0 / o);
                // encode, mid, decode, after, decode alone, after2
                cpus.push([last_cpu(6), last_cpu(2), last_cpu(4), last_cpu(1)]);
                enc.push(e);
                dec.push(d);
                copies.extend([before, mid, after]);
                enc_r.push((before + mid) / 2.0 / e);
                dec_r.push((mid + after) / 2.0 / d);
                copies.push(after2);
                before = after2;
            }
            let layout = PlanesLayout::parse(&object)?;
            let (mut planes, mut raw) = (0usize, 0usize);
            for t in &layout.tensors {
                for c in &t.chunks {
                    let words = (c.decoded.end - c.decoded.start) / c.planes.len() as u64;
                    planes += c.planes.len();
                    raw += c.planes.iter().filter(|&&l| l == words).count();
                }
            }
            let stored_bytes = layout.object_len - prefix_len_of(&object);
            let (encode_s, decode_s, memcpy_s) = (median(enc), median(dec), median(copies));
            let decode_only_s = median(only);
            let col = |i: usize| median(cpus.iter().map(|c| c[i]).collect());
            let cpu_s = CpuSeconds {
                encode: col(0),
                decode_only: col(1),
                decode: col(2),
                memcpy: col(3),
            };
            let gb = raw_bytes as f64 * 1e-9;
            let row = AnchorBenchRow {
                chunk_words,
                level,
                raw_bytes,
                stored_bytes,
                object_bytes: object.len() as u64,
                ratio: raw_bytes as f64 / stored_bytes.max(1) as f64,
                raw_planes: raw as f64 / planes.max(1) as f64,
                memcpy_s,
                encode_s,
                decode_s,
                decode_only_s,
                encode_gbps: gb / encode_s,
                decode_gbps: gb / decode_s,
                decode_only_gbps: gb / decode_only_s,
                memcpy_gbps: gb / memcpy_s,
                encode_vs_memcpy: median(enc_r),
                decode_vs_memcpy: median(dec_r),
                decode_only_vs_memcpy: median(only_r),
                cpu_s,
            };
            progress(&format!(
                "chunk {chunk_words:>8} words, level {level:>2}: {:.4}x smaller ({} -> {} B, {:.0}% planes raw)  encode {:.2} GB/s ({:.3}x memcpy)  decode {:.2} GB/s ({:.3}x memcpy)  decode+verify {:.2} GB/s ({:.3}x memcpy)  memcpy {:.2} GB/s\n    CPU time: encode {:.3}s, decode {:.3}s, decode+verify {:.3}s, memcpy {:.3}s: with the cores to themselves {threads} threads would encode {:.2} GB/s, decode {:.2} GB/s, decode+verify {:.2} GB/s, memcpy {:.2} GB/s",
                row.ratio,
                raw_bytes,
                stored_bytes,
                row.raw_planes * 100.0,
                row.encode_gbps,
                row.encode_vs_memcpy,
                row.decode_only_gbps,
                row.decode_only_vs_memcpy,
                row.decode_gbps,
                row.decode_vs_memcpy,
                row.memcpy_gbps,
                row.cpu_s.encode,
                row.cpu_s.decode_only,
                row.cpu_s.decode,
                row.cpu_s.memcpy,
                gb * threads as f64 / row.cpu_s.encode,
                gb * threads as f64 / row.cpu_s.decode_only,
                gb * threads as f64 / row.cpu_s.decode,
                gb * threads as f64 / row.cpu_s.memcpy,
            ));
            rows.push(row);
        }
    }
    Ok(rows)
}

fn prefix_len_of(object: &[u8]) -> u64 {
    crate::codec::planes::prefix_len(object).unwrap_or(0)
}
