//! The apply strategies against each other and against the encoder.

use super::*;
use crate::error::Error;
use crate::format::Encoding;
use crate::tensors::TensorSet;

fn targets<'a>(set: &'a TensorSet, bufs: &'a mut [Vec<u8>]) -> Vec<Target<'a>> {
    set.tensors()
        .iter()
        .zip(bufs.iter_mut())
        .map(|(t, b)| Target {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            data: b,
        })
        .collect()
}

/// `set`'s tensors split in two files (even and odd positions).
fn halves(set: &TensorSet) -> [TensorSet; 2] {
    [0, 1].map(|h| {
        TensorSet::from_tensors(
            set.tensors()
                .iter()
                .enumerate()
                .filter(|(i, _)| i % 2 == h)
                .map(|(i, t)| {
                    (
                        t.name.clone(),
                        t.dtype,
                        t.shape.clone(),
                        set.data(i).to_vec(),
                    )
                }),
        )
        .unwrap()
    })
}

#[test]
fn all_deltas_of_a_version_are_verified_before_any_is_written() {
    use crate::codec::{DeltaOptions, encode_delta};
    use crate::generator::{Generator, GeneratorConfig};
    let mut g = Generator::new(GeneratorConfig::tiny(3));
    let v0 = g.snapshot();
    g.step();
    let v1 = g.snapshot();
    let opts = DeltaOptions::new(Encoding::Compact, 1, 0);
    let (b, n) = (halves(&v0), halves(&v1));
    let deltas: Vec<Vec<u8>> = (0..2)
        .map(|h| {
            let mut new = n[h].clone();
            encode_delta(&b[h], &mut new, &opts).unwrap().0
        })
        .collect();
    let refs: Vec<&[u8]> = deltas.iter().map(Vec::as_slice).collect();
    let mut bufs: Vec<Vec<u8>> = (0..v0.len()).map(|i| v0.data(i).to_vec()).collect();
    // A changed element of the second file's first changed tensor moved
    // off its base: the first file must not be written either.
    let second = &n[1];
    let (ti, pos) = (0..second.len())
        .find_map(|i| {
            let name = &second.tensors()[i].name;
            let k = v0.position(name).unwrap();
            (0..v0.data(k).len())
                .find(|&p| v0.data(k)[p] != second.data(i)[p])
                .map(|p| (k, p))
        })
        .expect("the step changed something in the second file");
    bufs[ti][pos] ^= 0x55;
    let before = bufs.clone();
    {
        let mut t = targets(&v0, &mut bufs);
        let err = apply_in_place_all(&mut t, &refs, &InPlaceOptions::default()).unwrap_err();
        assert!(matches!(err, Error::WrongBase { .. }), "{err}");
    }
    assert_eq!(
        bufs, before,
        "nothing written when one delta of the version fails"
    );
    bufs[ti][pos] ^= 0x55;
    {
        let mut t = targets(&v0, &mut bufs);
        let reports = apply_in_place_all(&mut t, &refs, &InPlaceOptions::default()).unwrap();
        assert_eq!(reports.len(), 2);
        assert!(
            reports
                .iter()
                .all(|r| r.model_version == 1 && r.changed > 0)
        );
        // The same delta twice changes each tensor twice: refused.
        let twice = [refs[0], refs[0]];
        let err = apply_in_place_all(&mut t, &twice, &InPlaceOptions::default()).unwrap_err();
        assert!(err.to_string().contains("two delta objects"), "{err}");
    }
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(&b[..], v1.data(i), "tensor {}", v1.tensors()[i].name);
    }
}

/// A publisher's chain of `compact2` deltas (an anchor every `every`
/// versions: the delta after it is made without context), with the
/// contexts the publisher kept.
struct Chain {
    states: Vec<TensorSet>,
    deltas: Vec<Vec<u8>>,
    contexts: Vec<Option<crate::codec::Context>>,
}

fn chain(steps: usize, every: usize, lr: f32) -> Chain {
    use crate::codec::{DeltaOptions, encode_delta_ctx};
    use crate::generator::{Generator, GeneratorConfig};
    let mut cfg = GeneratorConfig::tiny(11);
    cfg.lr = lr;
    let mut g = Generator::new(cfg);
    let mut states = vec![g.snapshot()];
    let (mut deltas, mut contexts) = (vec![Vec::new()], vec![None]);
    for v in 1..=steps {
        g.step();
        let mut new = g.snapshot_without_digests();
        let opts = DeltaOptions::new(Encoding::Compact2, v as u64, v as u64 - 1);
        // After an anchor (version 0, every `every`), no context.
        let ctx = if (v - 1).is_multiple_of(every) {
            None
        } else {
            contexts[v - 1].as_ref()
        };
        let (bytes, _, next) = encode_delta_ctx(&states[v - 1], &mut new, &opts, ctx).unwrap();
        assert!(new.has_digests());
        states.push(new);
        deltas.push(bytes);
        contexts.push(next);
    }
    Chain {
        states,
        deltas,
        contexts,
    }
}

/// Whether the subscriber uses its context for delta `v` (the publisher
/// made it with one).
fn with_ctx(v: usize, every: usize) -> bool {
    !(v - 1).is_multiple_of(every)
}

#[test]
fn compact2_chains_round_trip_bit_identically_with_the_publishers_contexts() {
    let every = 5;
    let c = chain(12, every, 2e-5);
    let mut state = c.states[0].clone();
    let mut ctx: Option<crate::codec::Context> = None;
    for v in 1..c.deltas.len() {
        let use_ctx = if with_ctx(v, every) {
            ctx.as_ref()
        } else {
            None
        };
        let (r, next) = apply_delta_ctx(&mut state, &c.deltas[v], use_ctx).unwrap();
        assert_eq!(r.encoding, Encoding::Compact2);
        assert!(r.changed > 0);
        for i in 0..state.len() {
            assert!(state.data(i) == c.states[v].data(i), "v{v} tensor {i}");
        }
        assert_eq!(state.digest(), c.states[v].digest());
        // The subscriber's context is the publisher's, member for member.
        let next = next.expect("compact2 deltas make a context");
        assert_eq!(Some(&next), c.contexts[v].as_ref(), "v{v}");
        // And what the delta alone rebuilds.
        let rebuilt = crate::codec::Context::of_delta(&c.deltas[v], use_ctx).unwrap();
        assert_eq!(rebuilt.as_ref(), Some(&next));
        ctx = Some(next);
    }
    // The deltas made with context are smaller than without.
    let plain = {
        use crate::codec::{DeltaOptions, encode_delta};
        let mut new = c.states[3].clone();
        let opts = DeltaOptions::new(Encoding::Compact2, 3, 2);
        encode_delta(&c.states[2], &mut new, &opts).unwrap().0.len()
    };
    assert!(
        c.deltas[3].len() < plain,
        "{} vs {plain}",
        c.deltas[3].len()
    );
}

#[test]
fn a_restart_mid_chain_rebuilds_the_context_from_the_anchor_on() {
    // A subscriber applied up to version 7 (anchor at 5), then restarted
    // with its weights but no context: it rebuilds the context from the
    // deltas after the anchor alone (no weights read), and goes on.
    let every = 5;
    let c = chain(10, every, 2e-5);
    let mut state = c.states[7].clone();
    let mut ctx = None;
    for v in 6..=7 {
        let use_ctx = if with_ctx(v, every) {
            ctx.as_ref()
        } else {
            None
        };
        ctx = crate::codec::Context::of_delta(&c.deltas[v], use_ctx).unwrap();
    }
    for v in 8..=10 {
        let (_, next) = apply_delta_ctx(&mut state, &c.deltas[v], ctx.as_ref()).unwrap();
        assert_eq!(state.digest(), c.states[v].digest());
        for i in 0..state.len() {
            assert!(state.data(i) == c.states[v].data(i));
        }
        ctx = next;
    }
    // Without rebuilding, it refuses (and writes nothing).
    let mut state = c.states[7].clone();
    let err = apply_delta_ctx(&mut state, &c.deltas[8], None).unwrap_err();
    assert!(matches!(err, Error::WrongContext { .. }), "{err}");
    assert!(err.needs_repair());
    assert_eq!(state.digest(), c.states[7].digest());
}

#[test]
fn a_wrong_context_is_refused_before_anything_is_decoded() {
    let every = 10;
    let c = chain(4, every, 2e-5);
    let mut state = c.states[2].clone();
    let right = c.contexts[2].clone().unwrap();
    // Another version's context.
    let other = c.contexts[1].clone().unwrap();
    let e = apply_delta_ctx(&mut state, &c.deltas[3], Some(&other)).unwrap_err();
    assert!(matches!(e, Error::WrongContext { .. }), "{e}");
    // The right id but other members (a checksum that differs).
    let mut tampered = right.clone();
    let t = tampered
        .tensors
        .values_mut()
        .find(|t| !t.is_empty())
        .unwrap();
    let b = t.blocks.iter_mut().find(|b| !b.is_empty()).unwrap();
    b.pop();
    tampered.id.checksum = tampered.recompute_checksum();
    let e = apply_delta_ctx(&mut state, &c.deltas[3], Some(&tampered)).unwrap_err();
    assert!(matches!(e, Error::WrongContext { .. }), "{e}");
    // Members changed under an unchanged id: the decode or the digests refuse.
    let mut lying = right.clone();
    lying.tensors.values_mut().for_each(|t| {
        for b in &mut t.blocks {
            b.iter_mut().for_each(|m| *m ^= 1);
        }
    });
    assert!(apply_delta_ctx(&mut state, &c.deltas[3], Some(&lying)).is_err());
    assert_eq!(state.digest(), c.states[2].digest());
    // Every strategy refuses a missing context the same way.
    let mut bufs: Vec<Vec<u8>> = (0..state.len()).map(|i| state.data(i).to_vec()).collect();
    let e = apply_in_place(&mut targets(&state, &mut bufs), &c.deltas[3]).unwrap_err();
    assert!(matches!(e, Error::WrongContext { .. }), "{e}");
    assert!(matches!(
        Delta::parse(&c.deltas[3]).err(),
        Some(Error::WrongContext { .. })
    ));
    // The right one applies.
    apply_delta_ctx(&mut state, &c.deltas[3], Some(&right)).unwrap();
    assert_eq!(state.digest(), c.states[3].digest());
}

#[test]
fn compact2_through_every_strategy() {
    let every = 10;
    let c = chain(3, every, 2e-5);
    let ctx = c.contexts[2].as_ref();
    let base = &c.states[2];
    let want = &c.states[3];
    let delta = &c.deltas[3];
    // Verify, then write.
    let mut bufs: Vec<Vec<u8>> = (0..base.len()).map(|i| base.data(i).to_vec()).collect();
    for keep in [0usize, 256 << 20] {
        let mut b2 = bufs.clone();
        let (_, next) = apply_in_place_all_ctx(
            &mut targets(base, &mut b2),
            &[delta],
            &[ctx],
            &InPlaceOptions { keep_bytes: keep },
        )
        .unwrap();
        assert_eq!(next[0].as_ref(), c.contexts[3].as_ref());
        for (i, b) in b2.iter().enumerate() {
            assert!(b[..] == want.data(i)[..], "keep {keep}");
        }
    }
    // Prepare, then commit.
    let prepared =
        prepare_in_place_all_ctx(&mut targets(base, &mut bufs), &[delta], &[ctx]).unwrap();
    let (_, next) = prepared.commit_ctx(&mut targets(base, &mut bufs)).unwrap();
    assert_eq!(next[0].as_ref(), c.contexts[3].as_ref());
    for (i, b) in bufs.iter().enumerate() {
        assert!(b[..] == want.data(i)[..]);
    }
    // Positions out, words in.
    let d = Delta::parse_ctx(delta, ctx).unwrap();
    for (i, t) in base.tensors().iter().enumerate() {
        let Ok(pos) = d.changed_positions(&t.name) else {
            continue;
        };
        let wb = crate::dtype::word_bytes(t.dtype);
        let old: Vec<u8> = (0..pos.len())
            .flat_map(|j| {
                let p = pos.get(j).unwrap() as usize;
                base.data(i)[p * wb..p * wb + wb].to_vec()
            })
            .collect();
        let new = d.resolve(&t.name, &pos, &old).unwrap();
        for j in 0..pos.len() {
            let p = pos.get(j).unwrap() as usize;
            assert_eq!(new[j * wb..j * wb + wb], want.data(i)[p * wb..p * wb + wb]);
        }
    }
}

#[test]
fn a_delta_carries_the_new_versions_metadata_to_the_applied_state() {
    use crate::codec::{DeltaOptions, encode_delta, inspect};
    use crate::format::keys;
    use crate::generator::{Generator, GeneratorConfig};
    use std::collections::BTreeMap;
    let meta = |step: &str| {
        BTreeMap::from([
            // The output is always `format=pt`, as an anchor's.
            ("format".to_string(), "np".to_string()),
            ("step".to_string(), step.to_string()),
            ("weightcast.kind".to_string(), "anchor".to_string()),
        ])
    };
    let mut g = Generator::new(GeneratorConfig::tiny(4));
    let mut base = g.snapshot();
    base.set_metadata(meta("1"));
    g.step();
    for encoding in [Encoding::Compact, Encoding::Compact2, Encoding::Trl] {
        let mut new = g.snapshot_without_digests();
        new.set_metadata(meta("2"));
        let opts = DeltaOptions::new(encoding, 2, 1);
        let (delta, _) = encode_delta(&base, &mut new, &opts).unwrap();
        let (header_meta, _) = inspect(&delta).unwrap();
        assert_eq!(
            header_meta[keys::METADATA],
            r#"{"format":"pt","step":"2"}"#,
            "{encoding:?}: weightcast's own keys stay out"
        );
        let mut state = base.clone();
        apply_delta(&mut state, &delta).unwrap();
        assert_eq!(state.digest(), g.snapshot().digest());
        let want: BTreeMap<String, String> = [("format", "pt"), ("step", "2")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(state.metadata(), &want, "{encoding:?}");
    }
    // Metadata that is not a JSON object of strings refuses the delta, and
    // nothing is written.
    assert!(carried_metadata(r#"{"step": 2}"#).is_err());
    assert!(carried_metadata("[]").is_err());
}

/// The device form in batches: changes decoded in parallel parts (two
/// compact blocks; TRL stretches of `TRL_PART` entries) come back in order,
/// resolve to the new words, and refuse a wrong base, a wrong length, and a
/// raw word that does not change.
#[test]
fn changes_span_blocks_and_stretches_and_resolve_in_parts() {
    use crate::codec::{DeltaOptions, encode_delta};
    use crate::dtype::Dtype;
    let words = (crate::codec::compact::BLOCK_WORDS + (1 << 20)) as usize;
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let v0: Vec<u8> = (0..words)
        .flat_map(|_| ((next() as u16 & 0x3fff) | 0x3c00).to_le_bytes())
        .collect();
    let mut v1 = v0.clone();
    let changed: Vec<usize> = (0..words).filter(|i| i % 37 == 5).collect();
    for &i in &changed {
        let w = u16::from_le_bytes([v1[2 * i], v1[2 * i + 1]]);
        // Mostly one ulp; now and then a far jump (raw-coded where cheaper).
        let n = if i % 7 == 0 { w ^ 0x00f0 } else { w + 1 };
        v1[2 * i..2 * i + 2].copy_from_slice(&n.to_le_bytes());
    }
    let set = |d: &[u8]| {
        TensorSet::from_tensors([("w".to_string(), Dtype::BF16, vec![words], d.to_vec())]).unwrap()
    };
    let base = set(&v0);
    for encoding in [Encoding::Compact, Encoding::Trl] {
        let mut new = set(&v1);
        let (bytes, _) = encode_delta(&base, &mut new, &DeltaOptions::new(encoding, 1, 0)).unwrap();
        let d = Delta::parse(&bytes).unwrap();
        let c = d.changes("w").unwrap();
        assert_eq!(c.len(), changed.len(), "{encoding:?}");
        assert_eq!(c.held_bytes(), c.len() * 6, "u32 positions and bf16 words");
        assert!(c.digests().is_some());
        let pos: Vec<usize> = (0..c.len())
            .map(|j| c.positions.get(j).unwrap() as usize)
            .collect();
        assert_eq!(
            pos, changed,
            "{encoding:?}: positions in order across parts"
        );
        let old: Vec<u8> = pos
            .iter()
            .flat_map(|&p| [v0[2 * p], v0[2 * p + 1]])
            .collect();
        let mut out = vec![0u8; c.new_bytes()];
        c.resolve(&old, &mut out).unwrap();
        let want: Vec<u8> = pos
            .iter()
            .flat_map(|&p| [v1[2 * p], v1[2 * p + 1]])
            .collect();
        assert!(out == want, "{encoding:?}: new words");
        // The wrapper agrees.
        assert!(d.resolve("w", &c.positions, &old).unwrap() == want);
        // A wrong base in the last part: refused.
        let mut drift = old.clone();
        let at = drift.len() - 2;
        drift[at] ^= 1;
        let e = c.resolve(&drift, &mut out).unwrap_err();
        assert!(matches!(e, Error::WrongBase { .. }), "{encoding:?}: {e}");
        // Lengths that do not fit.
        assert!(c.resolve(&old[2..], &mut out).is_err());
        let mut short = vec![0u8; c.new_bytes() - 2];
        assert!(c.resolve(&old, &mut short).is_err());
        // A raw-coded word said to change that holds its new value already.
        if encoding == Encoding::Compact {
            let mut same = old.clone();
            let j = (0..pos.len()).find(|&j| pos[j].is_multiple_of(7)).unwrap();
            same[2 * j..2 * j + 2].copy_from_slice(&want[2 * j..2 * j + 2]);
            assert!(c.resolve(&same, &mut out).is_err());
        }
    }
}
