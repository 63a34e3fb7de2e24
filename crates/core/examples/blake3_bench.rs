//! `digest::blake3_of` (rayon from 128 KiB where rayon has more than one
//! thread) against `blake3::hash` on one thread, on a delta payload's size
//! and an anchor's: the least of `--reps` repetitions of each, alternating.
//!
//! ```sh
//! cargo build --release -p weightcast-core --example blake3_bench
//! target/release/examples/blake3_bench 3200000 256000000
//! ```

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("sizes in bytes"))
        .collect();
    let sizes = if args.is_empty() {
        vec![3_200_000, 256_000_000]
    } else {
        args
    };
    for n in sizes {
        let data: Vec<u8> = (0..n)
            .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)
            .collect();
        let reps = (2_000_000_000 / n.max(1)).clamp(3, 200);
        let (mut one, mut all) = (f64::MAX, f64::MAX);
        for _ in 0..reps {
            let t = std::time::Instant::now();
            let a = std::hint::black_box(blake3::hash(&data));
            one = one.min(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            let b = std::hint::black_box(weightcast_core::digest::blake3_of(&data));
            all = all.min(t.elapsed().as_secs_f64());
            assert_eq!(a, b);
        }
        println!(
            "{n} bytes, {} rayon threads: blake3::hash {:.3} ms, blake3_of {:.3} ms ({:.2}x)",
            rayon::current_num_threads(),
            one * 1e3,
            all * 1e3,
            one / all
        );
    }
}
