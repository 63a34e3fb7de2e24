//! The memory side of applying a delta, without the codec: a read-modify-write
//! of a random ~`density` fraction of a buffer's 2-byte words, in ascending
//! order, with no prefetch, with an L1 prefetch (`platform::prefetch`) or with an
//! L2 prefetch (`platform::prefetch_l2`) issued some entries ahead, against a
//! plain compare of two buffers of the same size, in the same run. This is
//! what chose the apply pipeline's prefetch hint and distance.
//!
//! ```sh
//! cargo run --release --example prefetch_probe -- 0.017
//! ```
//!
//! Prints nanoseconds per changed word for each variant (median of 7
//! repetitions, one thread) and its ratio to the compare.

use std::time::Instant;

use weightcast_core::platform::{prefetch, prefetch_l2};

const BYTES: usize = 256 << 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let density: f64 = std::env::args()
        .nth(1)
        .map_or(0.017, |s| s.parse().expect("density"));
    let words = BYTES / 2;
    let mut data = vec![1u8; BYTES];
    let other = vec![1u8; BYTES];
    // Ascending word indices, each word picked with probability `density`.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let threshold = (density * u64::MAX as f64) as u64;
    let index: Vec<u32> = (0..words as u32)
        .filter(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x < threshold
        })
        .collect();
    let n = index.len();
    // Each variant: its name, and the prefetch issued `ahead` words before
    // each read-modify-write (none for the first).
    type Prefetch = fn(&[u8], usize);
    let variants: [(&str, Option<(Prefetch, usize)>); 4] = [
        ("no prefetch", None),
        ("L1 prefetch, 32 ahead", Some((prefetch, 32))),
        ("L2 prefetch, 32 ahead", Some((prefetch_l2, 32))),
        ("L2 prefetch, 256 ahead", Some((prefetch_l2, 256))),
    ];
    let run = |data: &mut [u8], pf: Option<(Prefetch, usize)>| {
        for (e, &i) in index.iter().enumerate() {
            if let Some((pf, ahead)) = pf
                && let Some(&a) = index.get(e + ahead)
            {
                pf(data, 2 * a as usize);
            }
            let i = 2 * i as usize;
            let w = u16::from_le_bytes([data[i], data[i + 1]]).wrapping_add(1);
            data[i..i + 2].copy_from_slice(&w.to_le_bytes());
        }
    };
    println!(
        "{n} of {words} words ({:.2}%), one thread, medians of 7",
        100.0 * n as f64 / words as f64
    );
    for (name, pf) in variants {
        let (mut ratios, mut times) = (Vec::new(), Vec::new());
        for _ in 0..7 {
            let t = Instant::now();
            let c = weightcast_core::codec::scan::count_changed_plain(2, &data, &other);
            std::hint::black_box(c);
            let tc = t.elapsed().as_secs_f64();
            let t = Instant::now();
            run(&mut data, pf);
            let tf = t.elapsed().as_secs_f64();
            ratios.push(tc / tf);
            times.push(tf);
        }
        println!(
            "{name:>24}: {:6.2} ns per word written, {:.2}x the compare",
            median(times) * 1e9 / n as f64,
            median(ratios)
        );
    }
}
