//! `compact2` against `compact` along whole real traces (issue 29): each step
//! encoded both ways as a publisher would (an anchor at the first step and
//! every `--anchor-every` steps; `compact2` coded against the previous
//! delta's context, none right after an anchor), each `compact2` delta
//! applied by a subscriber that keeps its own context (bit-identical, or it
//! stops). One JSON line per step, then a summary per density band.
//!
//! ```sh
//! cargo run --release -p weightcast-core --example trace_sizes -- /work/traces/tune/minilm-2e-6 [--anchor-every 50] [--steps 100]
//! ```

#[path = "common/trace.rs"]
mod trace;

use std::path::PathBuf;

use weightcast_core::codec::{DeltaOptions, apply_delta_ctx, encode_delta, encode_delta_ctx};
use weightcast_core::format::Encoding;

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().expect("a trace directory"));
    let (mut every, mut steps) = (50usize, usize::MAX);
    while let Some(a) = args.next() {
        let v: usize = args.next().expect("a value").parse().expect("a number");
        match a.as_str() {
            "--anchor-every" => every = v.max(1),
            "--steps" => steps = v,
            other => panic!("unknown argument {other}"),
        }
    }
    let mut t = trace::Trace::open(&dir);
    let mut base = t.set();
    base.compute_digests();
    let mut replica = base.clone();
    let (mut pub_ctx, mut sub_ctx) = (None, None);
    let (mut sum1, mut sum2, mut sum_changed) = (0u64, 0u64, 0u64);
    let (mut pay1, mut pay2) = (0u64, 0u64);
    while t.has_next() && t.step < steps {
        t.advance();
        let v = t.step as u64;
        // `compact2` at every density: the encoding's sizes are measured.
        let opts = |e| DeltaOptions {
            compact2_max_density: 1.0,
            ..DeltaOptions::new(e, v, v - 1)
        };
        let mut new = t.set();
        let (d1, s1) = encode_delta(&base, &mut new, &opts(Encoding::Compact)).unwrap();
        let after_anchor = (t.step - 1).is_multiple_of(every);
        let ctx = if after_anchor { None } else { pub_ctx.as_ref() };
        let (d2, _, next) =
            encode_delta_ctx(&base, &mut new, &opts(Encoding::Compact2), ctx).unwrap();
        let sub = if after_anchor { None } else { sub_ctx.as_ref() };
        let (_, sub_next) = apply_delta_ctx(&mut replica, &d2, sub).unwrap();
        assert_eq!(
            replica.digest(),
            new.digest(),
            "step {v}: not bit-identical"
        );
        for i in 0..new.len() {
            assert!(
                replica.data(i) == new.data(i),
                "step {v}: tensor {i} differs"
            );
        }
        let with_context = ctx.is_some();
        pub_ctx = next;
        sub_ctx = sub_next;
        base = new;
        let changed = s1.changed.max(1);
        // Payload: the object less its safetensors header (per-tensor
        // digests and block tables, a fixed cost that a small model's few
        // changes do not amortize).
        let payload =
            |d: &[u8]| d.len() as u64 - 8 - u64::from_le_bytes(d[..8].try_into().unwrap());
        let (p1, p2) = (payload(&d1), payload(&d2));
        println!(
            "{{\"step\":{v},\"density\":{:.6},\"changed\":{},\"compact\":{},\"compact2\":{},\"compact_payload\":{p1},\"compact2_payload\":{p2},\"with_context\":{},\"ratio\":{:.4},\"payload_ratio\":{:.4}}}",
            s1.changed as f64 / s1.total.max(1) as f64,
            s1.changed,
            d1.len(),
            d2.len(),
            with_context,
            d1.len() as f64 / d2.len() as f64,
            p1 as f64 / p2 as f64
        );
        if with_context {
            sum1 += d1.len() as u64;
            sum2 += d2.len() as u64;
            pay1 += p1;
            pay2 += p2;
            sum_changed += changed;
        }
    }
    let per = |b: u64| b as f64 / sum_changed.max(1) as f64;
    eprintln!(
        "{}: steps with context: objects compact {:.4} B/changed, compact2 {:.4}: {:.3}x smaller; \
         payloads {:.4} and {:.4}: {:.3}x",
        dir.display(),
        per(sum1),
        per(sum2),
        sum1 as f64 / sum2.max(1) as f64,
        per(pay1),
        per(pay2),
        pay1 as f64 / pay2.max(1) as f64
    );
}
