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
    for encoding in [Encoding::Compact, Encoding::Trl] {
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
