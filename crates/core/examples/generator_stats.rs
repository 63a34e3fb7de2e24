//! Change statistics of the synthetic generator at several learning rates, for
//! docs/generator.md: density, ulp-step histogram, direction balance, and how
//! often a changed position also changed in the previous step.
//!
//! `cargo run --release --example generator_stats`

use weightcast_core::codec::scan::for_each_change;
use weightcast_core::generator::{Generator, GeneratorConfig, change_stats};
use weightcast_core::tensors::TensorSet;

fn changed_positions(a: &TensorSet, b: &TensorSet) -> Vec<Vec<usize>> {
    (0..a.len())
        .map(|i| {
            let mut v = Vec::new();
            for_each_change(2, a.data(i), b.data(i), |j, _, _| v.push(j));
            v
        })
        .collect()
}

fn main() {
    println!(
        "| lr | density | ±1 ulp | ±2 ulp | more | moved up | also changed in the previous step |"
    );
    println!("|---|---|---|---|---|---|---|");
    for lr in [1e-6f32, 3e-6, 1e-5] {
        let mut cfg = GeneratorConfig::small(3);
        cfg.lr = lr;
        let mut g = Generator::new(cfg);
        let mut prev_set = g.snapshot_without_digests();
        let mut prev_pos: Option<Vec<Vec<usize>>> = None;
        let mut rows = Vec::new();
        for _ in 0..4 {
            g.step();
            let next = g.snapshot_without_digests();
            let stats = change_stats(&prev_set, &next);
            let pos = changed_positions(&prev_set, &next);
            let repeat = prev_pos.as_ref().map(|p| {
                let (mut hit, mut all) = (0usize, 0usize);
                for (now, before) in pos.iter().zip(p) {
                    let before: std::collections::HashSet<_> = before.iter().collect();
                    all += now.len();
                    hit += now.iter().filter(|j| before.contains(j)).count();
                }
                hit as f64 / all.max(1) as f64
            });
            rows.push((stats, repeat));
            prev_pos = Some(pos);
            prev_set = next;
        }
        let (s, r) = rows.last().expect("steps ran").clone();
        println!(
            "| {lr:e} | {:.2}% | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {:.1}% |",
            s.density * 100.0,
            s.ulp1 * 100.0,
            s.ulp2 * 100.0,
            s.ulp_more * 100.0,
            s.up * 100.0,
            r.unwrap_or(0.0) * 100.0
        );
    }
}
