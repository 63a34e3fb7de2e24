//! Instruction-count harness for the compact codec: one encode and one apply
//! of a generator step, all on the calling thread so that callgrind can count
//! each phase by itself.
//!
//! ```sh
//! cargo build --release --example codec_instr
//! valgrind --tool=callgrind --collect-atstart=no --toggle-collect='codec_instr::encode_phase' \
//!     target/release/examples/codec_instr 20000000 1.5e-6
//! ```
//!
//! (`apply_phase` and `compare_phase` likewise.) Divide the reported
//! instruction count by the printed number of changed elements. Valgrind
//! hides AVX-512, so this counts the AVX2/portable paths.
//!
//! With a third argument it times instead (one thread, medians of that many
//! repetitions, each ratio taken against a compare run just before it): the
//! in-cache cost per change of the compare, the scan and the encoder on a
//! 256 KiB slice, the scan alone against the compare, and encode and apply
//! against the compare:
//!
//! ```sh
//! target/release/examples/codec_instr 100000000 1.5e-6 15
//! WEIGHTCAST_PHASE=encode perf record -e cpu-clock target/release/examples/codec_instr 100000000 1.5e-6 60
//! ```
//!
//! The timed run also measures `codec::apply_in_place` (verify, then write)
//! on the same delta, with its default buffer for decoded changes and with
//! none (every block decoded twice), and a full digest pass over the model,
//! each against the compare run just before it.

use weightcast_core::bench::plain_compare;
use weightcast_core::codec::{
    DeltaOptions, InPlaceOptions, Target, apply_delta, apply_in_place_with, encode_delta,
};
use weightcast_core::format::Encoding;
use weightcast_core::generator::{Generator, GeneratorConfig};
use weightcast_core::tensors::TensorSet;

#[inline(never)]
fn compare_phase(a: &TensorSet, b: &TensorSet) -> u64 {
    plain_compare(a, b)
}

#[inline(never)]
fn encode_phase(a: &TensorSet, b: &mut TensorSet) -> Vec<u8> {
    let opts = DeltaOptions {
        encoding: Encoding::Compact,
        model_version: 2,
        base_version: 1,
        ..Default::default()
    };
    encode_delta(a, b, &opts).expect("encode").0
}

#[inline(never)]
fn apply_phase(a: &mut TensorSet, delta: &[u8]) {
    apply_delta(a, delta).expect("apply");
}

/// `apply_in_place` into the tensors of `a` (its digests are not updated).
#[inline(never)]
fn in_place_phase(a: &mut TensorSet, delta: &[u8], opts: &InPlaceOptions) -> u64 {
    let info: Vec<_> = a.tensors().to_vec();
    let mut targets: Vec<Target> = info
        .iter()
        .zip(a.all_data_mut())
        .map(|(t, data)| Target {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            data,
        })
        .collect();
    apply_in_place_with(&mut targets, delta, opts)
        .expect("apply in place")
        .kept
}

fn main() {
    let mut args = std::env::args().skip(1);
    let elements: u64 = args
        .next()
        .map_or(20_000_000, |s| s.parse().expect("elements"));
    let lr: f32 = args.next().map_or(1.5e-6, |s| s.parse().expect("lr"));
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .use_current_thread()
        .build_global()
        .expect("pool");
    let mut cfg = GeneratorConfig::with_elements(7, elements);
    cfg.lr = lr;
    let mut g = Generator::new(cfg);
    g.step();
    let base = g.snapshot();
    g.step();
    let mut new = g.snapshot_without_digests();
    let changed = compare_phase(&base, &new);
    let delta = encode_phase(&base, &mut new);
    let mut replica = base.clone();
    apply_phase(&mut replica, &delta);
    for i in 0..new.len() {
        assert!(replica.data(i) == new.data(i), "replica differs");
    }
    // Optional third argument: time each phase that many times (one thread)
    // and print the medians, for profiling under `perf record`.
    let reps: usize = args.next().map_or(0, |s| s.parse().expect("reps"));
    if reps > 0 {
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let scan_only = |a: &TensorSet, b: &TensorSet| -> u64 {
            let mut n = 0u64;
            for i in 0..a.len() {
                weightcast_core::codec::scan::for_each_change_piece(
                    2,
                    a.data(i),
                    b.data(i),
                    |_, c, _, _| n += c.len() as u64,
                );
            }
            n
        };
        // WEIGHTCAST_PHASE=encode (or apply) runs only that phase, for perf.
        let only = std::env::var("WEIGHTCAST_PHASE").unwrap_or_default();
        if !only.is_empty() {
            for _ in 0..reps {
                match only.as_str() {
                    "encode" => drop(std::hint::black_box(encode_phase(&base, &mut new))),
                    "apply" => apply_phase(&mut base.clone(), &delta),
                    _ => drop(std::hint::black_box(compare_phase(&base, &new))),
                }
            }
            return;
        }
        {
            // In-cache costs: the same work on a 256 KiB slice, repeated.
            use weightcast_core::codec::compact::encode_tensor;
            use weightcast_core::digest::TensorSeed;
            use weightcast_core::dtype::KeyKind;
            // The slice whose density is nearest the model's 1%.
            let (a, b) = (0..base.len())
                .filter(|&i| base.data(i).len() >= 1 << 18)
                .map(|i| (&base.data(i)[..1 << 18], &new.data(i)[..1 << 18]))
                .min_by_key(|(a, b)| {
                    weightcast_core::codec::scan::count_changed_plain(2, a, b).abs_diff(1340)
                })
                .unwrap();
            let n = weightcast_core::codec::scan::count_changed_plain(2, a, b);
            let r = 2000;
            let t = std::time::Instant::now();
            for _ in 0..r {
                std::hint::black_box(weightcast_core::codec::scan::count_changed_plain(2, a, b));
            }
            let tc = t.elapsed().as_secs_f64() / r as f64;
            let t = std::time::Instant::now();
            for _ in 0..r {
                let mut m = 0u64;
                weightcast_core::codec::scan::for_each_change_piece(2, a, b, |_, c, _, _| {
                    m += c.len() as u64
                });
                std::hint::black_box(m);
            }
            let ts = t.elapsed().as_secs_f64() / r as f64;
            let t = std::time::Instant::now();
            for _ in 0..r {
                std::hint::black_box(encode_tensor(
                    KeyKind::SignMagnitude,
                    2,
                    TensorSeed(1),
                    a,
                    b,
                ));
            }
            let te = t.elapsed().as_secs_f64() / r as f64;
            // Apply: the slice's delta forth and back, alternately.
            use weightcast_core::codec::compact::{Block, BlockUndo, Ctx, apply_block};
            let fwd = encode_tensor(KeyKind::SignMagnitude, 2, TensorSeed(1), a, b);
            let back = encode_tensor(KeyKind::SignMagnitude, 2, TensorSeed(1), b, a);
            let mut buf = a.to_vec();
            let mut undo = BlockUndo::default();
            let ctx = Ctx {
                kind: KeyKind::SignMagnitude,
                seed: TensorSeed(1),
                first: 0,
            };
            let t = std::time::Instant::now();
            for _ in 0..r / 2 {
                for d in [&fwd, &back] {
                    let block = Block {
                        tensor: "t",
                        index: 0,
                        entry: &d.blocks[0],
                        stream: &d.payload,
                        wb: 2,
                        words: (buf.len() / 2) as u64,
                        context: None,
                    };
                    apply_block(&block, ctx, &mut buf, &mut undo).expect("apply");
                }
            }
            let ta = t.elapsed().as_secs_f64() / (r / 2 * 2) as f64;
            assert!(buf == a, "forth and back");
            println!(
                "in cache, {n} changes in 128 Ki words: compare {:.2} ns/change, scan {:.2}, encode {:.2}, apply {:.2}",
                tc * 1e9 / n as f64,
                ts * 1e9 / n as f64,
                te * 1e9 / n as f64,
                ta * 1e9 / n as f64
            );
        }
        let mut ts = Vec::new();
        for _ in 0..reps {
            let t = std::time::Instant::now();
            std::hint::black_box(compare_phase(&base, &new));
            let c = t.elapsed().as_secs_f64();
            let t = std::time::Instant::now();
            std::hint::black_box(scan_only(&base, &new));
            ts.push(c / t.elapsed().as_secs_f64());
        }
        println!("scan alone: {:.2}x of the compare", median(ts));
        let (mut tc, mut te, mut ta) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..reps {
            let t = std::time::Instant::now();
            std::hint::black_box(compare_phase(&base, &new));
            tc.push(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            std::hint::black_box(encode_phase(&base, &mut new));
            te.push(t.elapsed().as_secs_f64());
            let mut replica = base.clone();
            let t = std::time::Instant::now();
            apply_phase(&mut replica, &delta);
            ta.push(t.elapsed().as_secs_f64());
        }
        // Ratios per repetition (the compare ran just before), then medians:
        // robust against the machine's slow drifts.
        let er = median(tc.iter().zip(&te).map(|(c, e)| c / e).collect());
        let ar = median(tc.iter().zip(&ta).map(|(c, a)| c / a).collect());
        let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
        let (cm, em, am) = (min(&tc), min(&te), min(&ta));
        let (c, e, a) = (median(tc), median(te), median(ta));
        println!(
            "compare {c:.4}s  encode {e:.4}s ({er:.2}x)  apply {a:.4}s ({ar:.2}x)  \
             fastest runs: encode {:.2}x, apply {:.2}x",
            cm / em,
            cm / am
        );
        // Verify-then-write into caller-owned buffers, with and without the
        // buffer of decoded changes, and a full digest pass; each ratio
        // against the compare just before, and against apply_delta.
        let none = InPlaceOptions { keep_bytes: 0 };
        let (mut ratios, mut kept): ([Vec<f64>; 4], u64) = (Default::default(), 0);
        for _ in 0..reps {
            for (k, ratio) in ratios.iter_mut().enumerate() {
                let mut replica = base.clone();
                let t = std::time::Instant::now();
                std::hint::black_box(compare_phase(&base, &new));
                let c = t.elapsed().as_secs_f64();
                let t = std::time::Instant::now();
                match k {
                    0 => apply_phase(&mut replica, &delta),
                    1 => kept = in_place_phase(&mut replica, &delta, &InPlaceOptions::default()),
                    2 => drop(in_place_phase(&mut replica, &delta, &none)),
                    _ => drop(std::hint::black_box(base.full_digests())),
                }
                ratio.push(c / t.elapsed().as_secs_f64());
                if k < 3 {
                    assert!((0..new.len()).all(|i| replica.data(i) == new.data(i)));
                }
            }
        }
        let [ad, ip, ip0, full] = ratios.map(median);
        println!(
            "apply_delta {ad:.2}x compare; apply_in_place (verify, then write) {ip:.2}x \
             ({kept} changes kept), decoding twice {ip0:.2}x; full digest pass {full:.2}x; \
             in place / apply_delta time {:.2}",
            ad / ip
        );
    }
    println!(
        "elements {} changed {changed} density {:.4}% delta {} bytes ({:.4} B/changed)",
        g.config().elements(),
        changed as f64 * 100.0 / g.config().elements() as f64,
        delta.len(),
        delta.len() as f64 / changed as f64
    );
}
