//! `compact2` against `compact`: encode and apply throughput, each as a ratio
//! to a plain compare of the same two buffers timed just before it (as
//! `weightcast bench codec` does), and the sizes.
//!
//! ```sh
//! cargo build --release --example compact2_bench
//! # a real trace (scripts/make_traces.py): steps N-1 → N → N+1
//! target/release/examples/compact2_bench --trace /work/traces/tune/minilm-1e-5 --step 30 --reps 21
//! # the generator (118M elements at 1e8)
//! target/release/examples/compact2_bench --elements 100000000 --lr 1.5e-6 --reps 15
//! ```
//!
//! The context of the measured delta (N → N+1) is the changes of N-1 → N.
//! Applies run forth (N → N+1) and back (N+1 → N, against the forth
//! delta's context) alternately, so the state never needs copying; or, with
//! `WEIGHTCAST_PHASE=applyf`, forth only, on a state restored (untimed)
//! before each (the back delta's entries are all context members, which
//! no training step's are). With a phase, each operation's CPU time is
//! measured (`WEIGHTCAST_CLOCK=wall`: its wall time, for runs on every
//! thread). Ratios
//! are compare time / operation time (above 1: faster than the compare);
//! printed as medians over the repetitions, with the range.
//!
//! A phase may also be a comma-separated list of phases, run in that order
//! each repetition: `apply1f,apply1f,apply2f,apply2f` times each encoding's
//! apply right after one of its own, as a subscriber applies them. (On the
//! development VM a phase's place in the list changed its time: `compact2`
//! right after a `compact` apply was slower than after one of its own, so
//! a list that puts variants in different places measures the order as
//! well as the code.)

#[path = "common/trace.rs"]
mod trace;

use std::path::{Path, PathBuf};
use std::time::Instant;

use weightcast_core::bench::plain_compare;
use weightcast_core::codec::{
    Context, DeltaOptions, apply_delta, apply_delta_ctx, encode_delta, encode_delta_ctx,
};
use weightcast_core::format::Encoding;
use weightcast_core::generator::{Generator, GeneratorConfig};
use weightcast_core::tensors::TensorSet;

/// Three consecutive states of a trace (`step - 1`, `step`, `step + 1`).
fn trace_states(dir: &Path, step: usize) -> [TensorSet; 3] {
    let mut t = trace::Trace::open(dir);
    while t.step + 1 < step {
        t.advance();
    }
    let mut out = vec![t.set()];
    for _ in 0..2 {
        t.advance();
        out.push(t.set());
    }
    out.try_into().unwrap_or_else(|_| panic!("three states"))
}

fn generator_states(elements: u64, lr: f32) -> [TensorSet; 3] {
    let mut cfg = GeneratorConfig::with_elements(7, elements);
    cfg.lr = lr;
    let mut g = Generator::new(cfg);
    g.step();
    let a = g.snapshot();
    g.step();
    let b = g.snapshot();
    g.step();
    [a, b, g.snapshot()]
}

/// This process's CPU seconds: the sum of its threads' run times
/// (Linux `/proc/self/task/*/schedstat`, nanoseconds; 0 elsewhere).
fn process_cpu_secs() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    let ns: u64 = tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    ns as f64 * 1e-9
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut trace, mut step, mut elements, mut lr, mut reps) =
        (None, 30usize, 100_000_000u64, 1.5e-6f32, 15usize);
    while let Some(a) = args.next() {
        let mut val = || args.next().expect("a value");
        match a.as_str() {
            "--trace" => trace = Some(PathBuf::from(val())),
            "--step" => step = val().parse().expect("step"),
            "--elements" => elements = val().parse().expect("elements"),
            "--lr" => lr = val().parse().expect("lr"),
            "--reps" => reps = val().parse().expect("reps"),
            other => panic!("unknown argument {other}"),
        }
    }
    let [s0, s1, s2] = match &trace {
        Some(d) => trace_states(d, step),
        None => generator_states(elements, lr),
    };
    // `compact2` itself at every density (not `compact` above
    // `DeltaOptions::compact2_max_density`): the encoding is what is measured.
    let opts = |e, v: u64| DeltaOptions {
        compact2_max_density: 1.0,
        ..DeltaOptions::new(e, v, v - 1)
    };
    // The context of s1 (the changes s0 → s1), as the publisher keeps it.
    let (_, _, ctx1) =
        encode_delta_ctx(&s0, &mut s1.clone(), &opts(Encoding::Compact2, 1), None).unwrap();
    let ctx1: Context = ctx1.unwrap();
    // The measured deltas, forth and back.
    let (v1_fwd, _) = encode_delta(&s1, &mut s2.clone(), &opts(Encoding::Compact, 2)).unwrap();
    let (v1_back, _) = encode_delta(&s2, &mut s1.clone(), &opts(Encoding::Compact, 3)).unwrap();
    let (v2_fwd, _, ctx2) = encode_delta_ctx(
        &s1,
        &mut s2.clone(),
        &opts(Encoding::Compact2, 2),
        Some(&ctx1),
    )
    .unwrap();
    let ctx2 = ctx2.unwrap();
    let (v2_back, _, _) = encode_delta_ctx(
        &s2,
        &mut s1.clone(),
        &opts(Encoding::Compact2, 3),
        Some(&ctx2),
    )
    .unwrap();
    let changed = plain_compare(&s1, &s2);
    let total = s1.total_elements();
    println!(
        "elements {total}, changed {changed} ({:.3}%), context {} members ({} bytes)",
        100.0 * changed as f64 / total as f64,
        ctx1.len(),
        ctx1.bytes()
    );
    println!(
        "delta bytes: compact {} ({:.4} B/changed), compact2 {} ({:.4} B/changed): {:.3}x smaller",
        v1_fwd.len(),
        v1_fwd.len() as f64 / changed as f64,
        v2_fwd.len(),
        v2_fwd.len() as f64 / changed as f64,
        v1_fwd.len() as f64 / v2_fwd.len() as f64
    );
    let mut state = s1.clone();
    let mut s2w = s2.clone();
    // Without context (every change in class 0), for the phase `apply2n`.
    let (v2n_fwd, _, _) =
        encode_delta_ctx(&s1, &mut s2.clone(), &opts(Encoding::Compact2, 2), None).unwrap();
    let (v2n_back, _, _) =
        encode_delta_ctx(&s2, &mut s1.clone(), &opts(Encoding::Compact2, 3), None).unwrap();
    println!(
        "delta bytes: compact2 without context {} ({:.4} B/changed)",
        v2n_fwd.len(),
        v2n_fwd.len() as f64 / changed as f64
    );
    // WEIGHTCAST_PHASE=encode1|encode2|apply1|apply2|apply2n: only that, `reps`
    // times (for perf); `encode` or `apply`: both encodings alternately, each
    // repetition's CPU time (RAYON_NUM_THREADS=1: one thread's work).
    if let Ok(phase) = std::env::var("WEIGHTCAST_PHASE") {
        let mut run = |name: &str, state: &mut TensorSet| match name {
            "encode1" => drop(encode_delta(&s1, &mut s2w, &opts(Encoding::Compact, 2)).unwrap()),
            "encode2" => drop(
                encode_delta_ctx(&s1, &mut s2w, &opts(Encoding::Compact2, 2), Some(&ctx1)).unwrap(),
            ),
            // compact2 as the publisher asks for it: `compact` above
            // `DeltaOptions::compact2_max_density` (the default).
            "encode2g" => drop(
                encode_delta_ctx(
                    &s1,
                    &mut s2w,
                    &DeltaOptions::new(Encoding::Compact2, 2, 1),
                    Some(&ctx1),
                )
                .unwrap(),
            ),
            "encode2n" => {
                drop(encode_delta_ctx(&s1, &mut s2w, &opts(Encoding::Compact2, 2), None).unwrap())
            }
            "encode2s" => {
                // compact2 through the staged encoder (the mask encoder off).
                weightcast_core::codec::compact::set_mask_encoder(false);
                drop(
                    encode_delta_ctx(&s1, &mut s2w, &opts(Encoding::Compact2, 2), Some(&ctx1))
                        .unwrap(),
                );
                weightcast_core::codec::compact::set_mask_encoder(true);
            }
            "scan" => {
                let mut n = 0;
                for (i, _) in s1.tensors().iter().enumerate() {
                    n += weightcast_core::codec::compact::vector::scan_only(s1.data(i), s2.data(i));
                }
                std::hint::black_box(n);
            }
            "stage2" => {
                // The staging of compact2's encoder alone (no parameter
                // choice, no writing).
                let mut n = 0;
                for (i, t) in s1.tensors().iter().enumerate() {
                    n += weightcast_core::codec::compact::v2::stage_only(
                        weightcast_core::dtype::key_kind(t.dtype),
                        t.dtype.bitsize() / 8,
                        t.seed,
                        (s1.data(i), s2.data(i)),
                        ctx1.tensors.get(&t.name),
                    );
                }
                std::hint::black_box(n);
            }
            "apply2n" => {
                apply_delta_ctx(state, &v2n_fwd, None).unwrap();
                apply_delta_ctx(state, &v2n_back, None).unwrap();
            }
            "apply1" => {
                apply_delta(state, &v1_fwd).unwrap();
                apply_delta(state, &v1_back).unwrap();
            }
            // Forth only, on a state restored (untimed) before each.
            "apply1f" => drop(apply_delta(state, &v1_fwd).unwrap()),
            "apply2f" => drop(apply_delta_ctx(state, &v2_fwd, Some(&ctx1)).unwrap()),
            _ => {
                apply_delta_ctx(state, &v2_fwd, Some(&ctx1)).unwrap();
                apply_delta_ctx(state, &v2_back, Some(&ctx2)).unwrap();
            }
        };
        let names: Vec<String> = match phase.as_str() {
            "encode" => vec!["encode1".into(), "encode2".into()],
            // and compact2 as the publisher writes it by default
            "encodeg" => vec!["encode1".into(), "encode2g".into(), "encode2".into()],
            // and compact2 without context
            "encoden" => vec!["encode1".into(), "encode2".into(), "encode2n".into()],
            // and compact2's staged encoder
            "encode3" => vec!["encode1".into(), "encode2".into(), "encode2s".into()],
            "encode4" => vec![
                "encode1".into(),
                "encode2".into(),
                "encode2s".into(),
                "scan".into(),
            ],
            // compact's whole encoder against compact2's staging alone
            "stage" => vec!["encode1".into(), "stage2".into()],
            // and compact2 without context (every change in class 0)
            "apply" => vec!["apply1".into(), "apply2".into(), "apply2n".into()],
            // forth only: the back delta is every change of the forth one
            // undone, so all its entries are context members (class 0
            // empty), which no training step does
            "applyf" => vec!["apply1f".into(), "apply2f".into()],
            _ => phase.split(',').map(String::from).collect(),
        };
        // `WEIGHTCAST_CLOCK=wall`: wall time instead (with every thread
        // at work, the throughput a user sees; noisier on a shared host).
        let wall = std::env::var("WEIGHTCAST_CLOCK").is_ok_and(|v| v == "wall");
        let mut cpu = vec![Vec::with_capacity(reps); names.len()];
        for _ in 0..reps {
            for (n, c) in names.iter().zip(&mut cpu) {
                if matches!(n.as_str(), "apply1f" | "apply2f") {
                    state = s1.clone();
                }
                let (cpu0, t0) = (process_cpu_secs(), Instant::now());
                run(n, &mut state);
                c.push(if wall {
                    t0.elapsed().as_secs_f64()
                } else {
                    process_cpu_secs() - cpu0
                });
            }
        }
        // CPU time, not wall time: on a shared machine the steadier figure;
        // the least of the repetitions is the least disturbed. (An apply
        // repetition applies twice: forth and back.)
        // And the median of each repetition's own ratio: the two phases run
        // back to back, so a slow stretch of a shared machine slows both.
        // (Only for two different phases: in a list that repeats a phase,
        // the first two slots may be the same one.)
        let paired = (cpu.len() >= 2 && names[0] != names[1]).then(|| {
            let r: Vec<f64> = cpu[0].iter().zip(&cpu[1]).map(|(a, b)| a / b).collect();
            median(r).0
        });
        // The least per phase, over every slot it has in the list.
        let mut least: Vec<(&str, f64)> = Vec::new();
        for (n, c) in names.iter().zip(cpu) {
            if c.is_empty() {
                continue;
            }
            let (m, lo, _) = median(c);
            match least.iter_mut().find(|(name, _)| name == n) {
                Some((_, l)) => *l = l.min(lo),
                None => least.push((n, lo)),
            }
            println!(
                "phase {n}: {} per repetition {:.3} ms (median {:.3} ms)",
                if wall { "wall time" } else { "CPU" },
                lo * 1e3,
                m * 1e3
            );
        }
        // `compact`'s phase (…1…) before `compact2`'s (…2…), whatever the
        // list's order.
        least.truncate(2);
        least.sort_by(|a, b| a.0.cmp(b.0));
        let least: Vec<f64> = least.into_iter().map(|(_, l)| l).collect();
        if let [one, two, ..] = least[..] {
            let clock = if wall { "time" } else { "CPU" };
            println!(
                "compact2 / compact throughput (least {clock}): {:.3}",
                one / two
            );
        }
        if let Some(p) = paired {
            println!("compact2 / compact throughput (median of paired repetitions): {p:.3}");
        }
        return;
    }
    let (mut e1, mut e2, mut a1, mut a2) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let time = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        t.elapsed().as_secs_f64()
    };
    let mut compare_secs = Vec::new();
    // Each operation's own times (for the best-of-reps ratios).
    let mut secs: [Vec<f64>; 4] = Default::default();
    for _ in 0..reps {
        let mut cmp = || {
            let c = time(&mut || {
                std::hint::black_box(plain_compare(&s1, &s2));
            });
            compare_secs.push(c);
            c
        };
        let c = cmp();
        let t =
            time(&mut || drop(encode_delta(&s1, &mut s2w, &opts(Encoding::Compact, 2)).unwrap()));
        secs[0].push(t);
        e1.push(c / t);
        let c = cmp();
        let t = time(&mut || {
            drop(
                encode_delta_ctx(&s1, &mut s2w, &opts(Encoding::Compact2, 2), Some(&ctx1)).unwrap(),
            )
        });
        secs[1].push(t);
        e2.push(c / t);
        let c = cmp();
        let t = time(&mut || drop(apply_delta(&mut state, &v1_fwd).unwrap()));
        secs[2].push(t);
        a1.push(c / t);
        drop(apply_delta(&mut state, &v1_back).unwrap());
        let c = cmp();
        let t = time(&mut || drop(apply_delta_ctx(&mut state, &v2_fwd, Some(&ctx1)).unwrap()));
        secs[3].push(t);
        a2.push(c / t);
        drop(apply_delta_ctx(&mut state, &v2_back, Some(&ctx2)).unwrap());
    }
    assert_eq!(state.digest(), s1.digest());
    let show = |name: &str, v: &[f64]| {
        let (m, lo, hi) = median(v.to_vec());
        println!("{name:<16} {m:.3}x the compare ({lo:.3}–{hi:.3})");
        m
    };
    let (cm, ..) = median(compare_secs.clone());
    println!("compare          {:.2} ms (median)", cm * 1e3);
    let (x1, x2) = (show("encode compact", &e1), show("encode compact2", &e2));
    let (y1, y2) = (show("apply compact", &a1), show("apply compact2", &a2));
    // Per-repetition ratios of compact2 to compact (same repetition).
    let per = |a: &[f64], b: &[f64]| median(a.iter().zip(b).map(|(x, y)| y / x).collect());
    let (pe, pel, peh) = per(&e1, &e2);
    let (pa, pal, pah) = per(&a1, &a2);
    println!(
        "compact2 / compact throughput: encode {:.3} (medians' ratio {:.3}; per rep {pel:.3}–{peh:.3}), apply {:.3} (medians' ratio {:.3}; per rep {pal:.3}–{pah:.3})",
        pe,
        x2 / x1,
        pa,
        y2 / y1
    );
    // The best (least disturbed) time of each operation over the
    // repetitions: on a shared machine, the steadier ratio.
    let best = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    println!(
        "best of {reps}: compare {:.2} ms; encode compact {:.2} ms, compact2 {:.2} ms ({:.3}); apply compact {:.2} ms, compact2 {:.2} ms ({:.3})",
        best(&compare_secs) * 1e3,
        best(&secs[0]) * 1e3,
        best(&secs[1]) * 1e3,
        best(&secs[0]) / best(&secs[1]),
        best(&secs[2]) * 1e3,
        best(&secs[3]) * 1e3,
        best(&secs[2]) / best(&secs[3]),
    );
}
