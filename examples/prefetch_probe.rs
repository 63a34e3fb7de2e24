//! The memory side of applying a delta, without the codec: a read-modify-write
//! of a random ~`density` fraction of a buffer's 2-byte words, in ascending
//! order, with no prefetch, with an L1 prefetch (`cpu::prefetch`) or with an
//! L2 prefetch (`cpu::prefetch_l2`) issued some entries ahead, against a
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

use weightcast::codec::cpu::{prefetch, prefetch_l2};

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
    let rmw = |data: &mut [u8], i: u32| {
        let i = 2 * i as usize;
        let w = u16::from_le_bytes([data[i], data[i + 1]]).wrapping_add(1);
        data[i..i + 2].copy_from_slice(&w.to_le_bytes());
    };
    type Variant<'a> = (&'a str, Box<dyn Fn(&mut [u8]) + 'a>);
    let idx = &index;
    let variants: Vec<Variant> = vec![
        (
            "no prefetch",
            Box::new(move |d: &mut [u8]| idx.iter().for_each(|&i| rmw(d, i))),
        ),
        (
            "L1 prefetch, 32 ahead",
            Box::new(move |d: &mut [u8]| {
                for e in 0..n {
                    if let Some(&a) = idx.get(e + 32) {
                        prefetch(d, 2 * a as usize);
                    }
                    rmw(d, idx[e]);
                }
            }),
        ),
        (
            "L2 prefetch, 32 ahead",
            Box::new(move |d: &mut [u8]| {
                for e in 0..n {
                    if let Some(&a) = idx.get(e + 32) {
                        prefetch_l2(d, 2 * a as usize);
                    }
                    rmw(d, idx[e]);
                }
            }),
        ),
        (
            "L2 prefetch, 256 ahead",
            Box::new(move |d: &mut [u8]| {
                for e in 0..n {
                    if let Some(&a) = idx.get(e + 256) {
                        prefetch_l2(d, 2 * a as usize);
                    }
                    rmw(d, idx[e]);
                }
            }),
        ),
    ];
    println!(
        "{n} of {words} words ({:.2}%), one thread, medians of 7",
        100.0 * n as f64 / words as f64
    );
    for (name, f) in &variants {
        let (mut ratios, mut times) = (Vec::new(), Vec::new());
        for _ in 0..7 {
            let t = Instant::now();
            let c = weightcast::codec::scan::count_changed_plain(2, &data, &other);
            std::hint::black_box(c);
            let tc = t.elapsed().as_secs_f64();
            let t = Instant::now();
            f(&mut data);
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
