//! Malformed, truncated, corrupted and mismatched inputs: every one must fail
//! with an error that names the problem, never panic, and a failed apply must
//! leave the state (bytes and digests) exactly as it was.

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};

use serde_json::{Value, json};
use weightcast::Error;
use weightcast::codec::{
    Delta, DeltaOptions, Target, apply_delta, apply_in_place, encode_anchor, encode_delta,
    read_anchor,
};
use weightcast::digest::Digest;
use weightcast::dtype::{Dtype, byte_len, from_key, key_kind, read_word, to_key, word_bytes};
use weightcast::dtype::{word_mask, write_word};
use weightcast::format::Encoding;
use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::tensors::{TensorSet, write_safetensors};

use crate::roundtrip::{buffers, targets};

type Owned = (String, Dtype, Vec<usize>, Vec<u8>);

const ENCODINGS: [Encoding; 2] = [Encoding::Compact, Encoding::Trl];

// ---------------------------------------------------------------------------
// Fixture: four versions of a small model.

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

fn key_step(dtype: Dtype, old: u64, step: i64) -> u64 {
    let wb = word_bytes(dtype);
    let kind = key_kind(dtype);
    from_key(
        kind,
        wb,
        to_key(kind, wb, old).wrapping_add(step as u64) & word_mask(wb),
    )
}

/// Changes `density` of the words of tensor `name`: ±1 key steps, or random words.
fn touch(items: &mut [Owned], name: &str, density: f64, random: bool, rng: &mut Rng) {
    let t = items.iter_mut().find(|t| t.0 == name).expect("tensor");
    let wb = word_bytes(t.1);
    for i in 0..t.3.len() / wb {
        if rng.chance(density) {
            let old = read_word(&t.3, wb, i);
            let mut new = if random {
                rng.next() & word_mask(wb)
            } else {
                key_step(t.1, old, if rng.chance(0.5) { 1 } else { -1 })
            };
            if new == old {
                new ^= 1;
            }
            write_word(&mut t.3, wb, i, new);
        }
    }
}

/// v0..=v3. v1 → v2 changes `embed` (±1 ulp), `big` (random words), `norm`
/// and `mask`, but not `scale`, `flags` or `empty`.
fn versions() -> Vec<Vec<Owned>> {
    let mut rng = Rng(2024);
    let spec: [(&str, Dtype, Vec<usize>); 7] = [
        ("embed", Dtype::BF16, vec![16, 8]),
        ("norm", Dtype::F32, vec![8]),
        ("scale", Dtype::F64, vec![]),
        ("mask", Dtype::U8, vec![5]),
        ("big", Dtype::BF16, vec![300]),
        ("flags", Dtype::I64, vec![3]),
        ("empty", Dtype::F32, vec![0, 3]),
    ];
    let v0: Vec<Owned> = spec
        .iter()
        .map(|(n, d, s)| {
            let len = byte_len(*d, s).unwrap();
            // Finite, moderate floats so that ±1 steps stay ordinary.
            let bytes = (0..len)
                .map(|i| if i % 2 == 1 { 0x3e } else { rng.next() as u8 })
                .collect();
            (n.to_string(), *d, s.clone(), bytes)
        })
        .collect();
    let mut v1 = v0.clone();
    touch(&mut v1, "embed", 0.3, false, &mut rng);
    touch(&mut v1, "norm", 0.5, true, &mut rng);
    touch(&mut v1, "scale", 1.0, true, &mut rng);
    touch(&mut v1, "big", 0.1, false, &mut rng);
    touch(&mut v1, "flags", 1.0, true, &mut rng);
    let mut v2 = v1.clone();
    touch(&mut v2, "embed", 0.25, false, &mut rng);
    touch(&mut v2, "big", 0.3, true, &mut rng);
    touch(&mut v2, "norm", 0.3, false, &mut rng);
    touch(&mut v2, "mask", 0.5, true, &mut rng);
    let mut v3 = v2.clone();
    touch(&mut v3, "embed", 0.2, false, &mut rng);
    touch(&mut v3, "scale", 1.0, true, &mut rng);
    vec![v0, v1, v2, v3]
}

fn set(items: &[Owned]) -> TensorSet {
    TensorSet::from_tensors(items.to_vec()).unwrap()
}

/// The delta `base → new` (and `new` with its digests).
fn delta(encoding: Encoding, base: &TensorSet, new: &[Owned], version: u64) -> Vec<u8> {
    let mut new = TensorSet::from_tensors_unhashed(new.to_vec()).unwrap();
    let opts = DeltaOptions {
        encoding,
        model_version: version,
        base_version: version - 1,
        // v1's layout, which these cases edit; tests/it/trl.rs covers v3.
        trl: weightcast::format::TrlOptions::V1,
        // The encoding asked for at every density: its decoder is tested.
        compact2_max_density: 1.0,
    };
    encode_delta(base, &mut new, &opts).unwrap().0
}

struct Fixture {
    items: Vec<Vec<Owned>>,
    sets: Vec<TensorSet>,
}

impl Fixture {
    fn new() -> Self {
        let items = versions();
        let sets = items.iter().map(|v| set(v)).collect();
        Fixture { items, sets }
    }

    /// The delta v1 → v2.
    fn d12(&self, encoding: Encoding) -> Vec<u8> {
        delta(encoding, &self.sets[1], &self.items[2], 2)
    }

    /// Indices of the words of `name` that change from v1 to v2.
    fn changed_positions(&self, name: &str) -> Vec<usize> {
        let a = self.items[1].iter().find(|t| t.0 == name).unwrap();
        let b = self.items[2].iter().find(|t| t.0 == name).unwrap();
        let wb = word_bytes(a.1);
        (0..a.3.len() / wb)
            .filter(|&i| read_word(&a.3, wb, i) != read_word(&b.3, wb, i))
            .collect()
    }
}

// ---------------------------------------------------------------------------
// Assertions.

/// Bytes and digests of every tensor plus the file digest.
#[derive(PartialEq)]
struct Snapshot {
    bytes: Vec<Vec<u8>>,
    digests: Vec<Digest>,
    digest: Digest,
}

fn snapshot(s: &TensorSet) -> Snapshot {
    Snapshot {
        bytes: (0..s.len()).map(|i| s.data(i).to_vec()).collect(),
        digests: s.tensors().iter().map(|t| t.digest).collect(),
        digest: s.digest(),
    }
}

/// Asserts that the error message contains every needle. With `SHOW_ERRORS`
/// set, prints each message (`cargo test --test malformed -- --nocapture`).
fn assert_mentions(err: &Error, needles: &[&str]) {
    let msg = err.to_string();
    if std::env::var_os("SHOW_ERRORS").is_some() {
        eprintln!("ERR {msg}");
    }
    for n in needles {
        assert!(msg.contains(n), "error `{msg}` does not mention `{n}`");
    }
}

/// Applies `bytes` to a copy of `state`; asserts an error mentioning every
/// needle, no panic, and an untouched state. Also applies it in place (see
/// [`in_place`]).
#[track_caller]
fn apply_err(state: &TensorSet, bytes: &[u8], needles: &[&str]) -> Error {
    let mut s = state.clone();
    let before = snapshot(&s);
    let err = match catch_unwind(AssertUnwindSafe(|| apply_delta(&mut s, bytes))) {
        Ok(Err(e)) => e,
        Ok(Ok(report)) => panic!("malformed delta was applied: {report:?}"),
        Err(_) => panic!("apply_delta panicked"),
    };
    assert_mentions(&err, needles);
    assert!(
        snapshot(&s) == before,
        "failed apply changed the state ({err})"
    );
    // Whatever in place decides (see `in_place`), it must not panic and a
    // refusal must leave the targets untouched.
    let _ = in_place(state, bytes);
    err
}

/// Applies `bytes` in place to copies of `state`'s tensors: it must not
/// panic, and when it fails every target must be byte-identical to before.
/// Returns the patched bytes when it succeeded. (In place checks only the
/// elements a delta changes, so some deltas `apply_delta` refuses — a wrong
/// file digest, drift elsewhere — are accepted here; the dedicated tests
/// below pin down which.)
#[track_caller]
fn in_place(state: &TensorSet, bytes: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
    let mut bufs = buffers(state);
    let r = catch_unwind(AssertUnwindSafe(|| {
        let mut targets = targets(state, &mut bufs);
        apply_in_place(&mut targets, bytes)
    }));
    match r {
        Ok(Ok(_)) => Ok(bufs),
        Ok(Err(e)) => {
            for (i, b) in bufs.iter().enumerate() {
                assert!(
                    b == state.data(i),
                    "failed in-place apply ({e}) changed `{}`",
                    state.tensors()[i].name
                );
            }
            Err(e)
        }
        Err(_) => panic!("apply_in_place panicked"),
    }
}

/// Reads `bytes` as an anchor; asserts an error mentioning every needle, no panic.
#[track_caller]
fn anchor_err(bytes: &[u8], needles: &[&str]) -> Error {
    let err = match catch_unwind(AssertUnwindSafe(|| read_anchor(bytes.to_vec()))) {
        Ok(Err(e)) => e,
        Ok(Ok(_)) => panic!("malformed anchor was accepted"),
        Err(_) => panic!("read_anchor panicked"),
    };
    assert_mentions(&err, needles);
    err
}

/// Either an error with the state untouched, or success with exactly `expect`;
/// in place likewise (untouched targets, or exactly `expect`'s bytes).
#[track_caller]
fn apply_err_or_exact(state: &TensorSet, bytes: &[u8], expect: &TensorSet) -> bool {
    let mut s = state.clone();
    let before = snapshot(&s);
    let ok = match catch_unwind(AssertUnwindSafe(|| apply_delta(&mut s, bytes))) {
        Ok(Err(e)) => {
            assert!(
                snapshot(&s) == before,
                "failed apply changed the state ({e})"
            );
            false
        }
        Ok(Ok(_)) => {
            assert!(
                snapshot(&s) == snapshot(expect),
                "apply succeeded with a wrong state"
            );
            true
        }
        Err(_) => panic!("apply_delta panicked"),
    };
    if let Ok(bufs) = in_place(state, bytes) {
        for (i, b) in bufs.iter().enumerate() {
            assert!(
                b == expect.data(i),
                "in-place apply succeeded with a wrong `{}`",
                state.tensors()[i].name
            );
        }
    }
    ok
}

// ---------------------------------------------------------------------------
// Rewriting objects.

/// A safetensors object taken apart: metadata and tensors in file order.
struct Parts {
    meta: BTreeMap<String, String>,
    tensors: Vec<Owned>,
}

fn parse(bytes: &[u8]) -> Parts {
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
    let meta = header
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    let tensors = header
        .offset_keys()
        .into_iter()
        .map(|n| {
            let v = st.tensor(&n).unwrap();
            (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())
        })
        .collect();
    Parts { meta, tensors }
}

impl Parts {
    fn build(&self) -> Vec<u8> {
        let views: Vec<(&str, Dtype, &[usize], &[u8])> = self
            .tensors
            .iter()
            .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
            .collect();
        let mut out = Vec::new();
        write_safetensors(&views, &self.meta, &mut out).unwrap();
        out
    }

    /// Recomputes `weightcast.payload_blake3` over the data section.
    fn rehash(&mut self) -> &mut Self {
        let mut h = blake3::Hasher::new();
        for t in &self.tensors {
            h.update(&t.3);
        }
        self.meta.insert(
            "weightcast.payload_blake3".into(),
            h.finalize().to_hex().to_string(),
        );
        self
    }

    fn tensor(&mut self, name: &str) -> &mut Owned {
        self.tensors
            .iter_mut()
            .find(|t| t.0 == name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }

    fn entries(&self) -> Value {
        serde_json::from_str(&self.meta["weightcast.tensors"]).unwrap()
    }

    fn set_entries(&mut self, v: &Value) -> &mut Self {
        self.meta.insert(
            "weightcast.tensors".into(),
            serde_json::to_string(v).unwrap(),
        );
        self
    }
}

/// `bytes` with metadata key `k` set to `v` (or removed).
fn with_meta(bytes: &[u8], k: &str, v: Option<&str>) -> Vec<u8> {
    let mut p = parse(bytes);
    match v {
        Some(v) => p.meta.insert(k.into(), v.into()),
        None => p.meta.remove(k),
    };
    p.build()
}

/// `bytes` with its `weightcast.tensors` JSON edited by `f`.
fn with_entries(bytes: &[u8], f: impl FnOnce(&mut Value)) -> Vec<u8> {
    let mut p = parse(bytes);
    let mut v = p.entries();
    f(&mut v);
    p.set_entries(&v).build()
}

/// A safetensors file from a raw JSON header and data section.
fn raw_file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut h = header.as_bytes().to_vec();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    out
}

fn header_len(bytes: &[u8]) -> usize {
    u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize
}

// ---------------------------------------------------------------------------
// Truncation.

#[test]
fn every_prefix_of_a_small_delta_is_rejected() {
    let fx = Fixture::new();
    for encoding in ENCODINGS {
        let d = fx.d12(encoding);
        for k in 0..d.len() {
            apply_err(&fx.sets[1], &d[..k], &["malformed safetensors container"]);
        }
        // The whole file applies.
        let mut s = fx.sets[1].clone();
        apply_delta(&mut s, &d).unwrap();
        assert!(snapshot(&s) == snapshot(&fx.sets[2]));
    }
}

#[test]
fn random_truncations_of_a_larger_delta_are_rejected() {
    let mut g = Generator::new(GeneratorConfig::tiny(9));
    let v0 = g.snapshot();
    g.step();
    let mut v1 = g.snapshot_without_digests();
    let mut rng = Rng(5);
    for encoding in ENCODINGS {
        let opts = DeltaOptions {
            encoding,
            model_version: 1,
            base_version: 0,
            trl: weightcast::format::TrlOptions::V1,
            compact2_max_density: 1.0,
        };
        let (d, _) = encode_delta(&v0, &mut v1, &opts).unwrap();
        let n = header_len(&d);
        let mut cuts = vec![0, 1, 7, 8, 9, 8 + n - 1, 8 + n, 8 + n + 1, d.len() - 1];
        cuts.extend((0..150).map(|_| (rng.next() % d.len() as u64) as usize));
        for k in cuts {
            apply_err(&v0, &d[..k], &["malformed safetensors container"]);
        }
        // Extra bytes at the end are rejected too.
        let mut longer = d.clone();
        longer.push(0);
        apply_err(&v0, &longer, &["malformed safetensors container"]);
    }
}

#[test]
fn every_prefix_of_an_anchor_is_rejected() {
    let fx = Fixture::new();
    let (a, _) = encode_anchor(&fx.sets[1], 1).unwrap();
    for k in 0..a.len() {
        anchor_err(&a[..k], &["malformed safetensors container"]);
    }
    let mut longer = a.clone();
    longer.extend_from_slice(&[0, 0]);
    anchor_err(&longer, &["malformed safetensors container"]);
    assert!(read_anchor(a).unwrap().0.is_some());
}

// ---------------------------------------------------------------------------
// Container-level lies.

#[test]
fn lying_header_length_is_rejected() {
    let fx = Fixture::new();
    let (anchor, _) = encode_anchor(&fx.sets[1], 1).unwrap();
    for (file, is_delta) in [
        (fx.d12(Encoding::Compact), true),
        (fx.d12(Encoding::Trl), true),
        (anchor, false),
    ] {
        let n = header_len(&file) as u64;
        let len = file.len() as u64;
        for lie in [
            u64::MAX,
            u64::MAX / 2,
            1 << 40,
            100_000_001,
            len,
            len - 7,
            n + 1,
            n + 8,
            n - 1,
            n - 8,
            2,
            0,
        ] {
            let mut f = file.clone();
            f[..8].copy_from_slice(&lie.to_le_bytes());
            if is_delta {
                apply_err(&fx.sets[1], &f, &["malformed safetensors container"]);
            } else {
                anchor_err(&f, &["malformed safetensors container"]);
            }
        }
    }
}

#[test]
fn crafted_containers_are_rejected() {
    let fx = Fixture::new();
    let meta = r#""__metadata__":{"format":"pt"}"#;
    let cases: Vec<(String, Vec<u8>, &str)> = vec![
        // Overlapping tensors.
        (
            format!(
                r#"{{{meta},"a":{{"dtype":"U8","shape":[4],"data_offsets":[0,4]}},"b":{{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}}}"#
            ),
            vec![0; 6],
            "invalid offset for tensor `b`",
        ),
        // A hole between tensors.
        (
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}}"#.into(),
            vec![0; 12],
            "invalid offset for tensor `b`",
        ),
        // Hole at the start.
        (
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#.into(),
            vec![0; 6],
            "invalid offset for tensor `a`",
        ),
        // Reversed offsets.
        (
            r#"{"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}"#.into(),
            vec![0; 4],
            "invalid offset for tensor `a`",
        ),
        // Offsets beyond the file.
        (
            r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#.into(),
            vec![0; 8],
            "not fully covered",
        ),
        // Offsets that disagree with dtype and shape.
        (
            r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,12]}}"#.into(),
            vec![0; 12],
            "invalid shape, data type, or offset",
        ),
        // Data the offsets do not cover.
        (
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#.into(),
            vec![0; 9],
            "not fully covered",
        ),
        // Element count overflowing.
        (
            r#"{"a":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,4]}}"#
                .into(),
            vec![0; 4],
            "overflow",
        ),
        // Odd number of packed F4 elements.
        (
            r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#.into(),
            vec![0; 2],
            "byte boundary",
        ),
        // Unknown dtype, not JSON, wrong JSON types.
        (
            r#"{"a":{"dtype":"Q4","shape":[4],"data_offsets":[0,4]}}"#.into(),
            vec![0; 4],
            "invalid JSON in header",
        ),
        ("{\"a\":".into(), vec![], "invalid JSON in header"),
        (
            r#"{"__metadata__":{"format":3}}"#.into(),
            vec![],
            "invalid JSON in header",
        ),
    ];
    for (header, data, needle) in &cases {
        let f = raw_file(header, data);
        apply_err(
            &fx.sets[1],
            &f,
            &["malformed safetensors container", needle],
        );
        anchor_err(&f, &["malformed safetensors container", needle]);
    }
    // Invalid UTF-8 in the header.
    let mut f = raw_file(
        r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
        &[7],
    );
    f[12] = 0xff;
    apply_err(&fx.sets[1], &f, &["invalid UTF-8"]);
    anchor_err(&f, &["invalid UTF-8"]);
    // Too short for a length field, and garbage.
    let mut rng = Rng(77);
    for len in [0usize, 3, 7, 8, 9, 16, 64, 1000] {
        let g: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        apply_err(&fx.sets[1], &g, &["malformed safetensors container"]);
        anchor_err(&g, &["malformed safetensors container"]);
    }
}

// ---------------------------------------------------------------------------
/// A `compact2` delta's context keys: `context_version` must be the delta's
/// base version (format.md §6.3), present with the other two, and only on
/// `compact2` deltas; each lie is refused by the key's name before anything
/// is written.
#[test]
fn context_key_lies_are_rejected() {
    use weightcast::codec::{apply_delta_ctx, encode_delta_ctx};
    let fx = Fixture::new();
    // `compact2` at every density: the fixture's steps are dense.
    let opts = |v: u64| DeltaOptions {
        compact2_max_density: 1.0,
        ..DeltaOptions::new(Encoding::Compact2, v, v - 1)
    };
    let mut s1 = TensorSet::from_tensors_unhashed(fx.items[1].clone()).unwrap();
    let (_, _, ctx) = encode_delta_ctx(&fx.sets[0], &mut s1, &opts(1), None).unwrap();
    let ctx = ctx.expect("a compact2 context");
    let mut s2 = TensorSet::from_tensors_unhashed(fx.items[2].clone()).unwrap();
    let (d, _, _) = encode_delta_ctx(&s1, &mut s2, &opts(2), Some(&ctx)).unwrap();
    // As written, it applies with its context.
    let mut ok = s1.clone();
    apply_delta_ctx(&mut ok, &d, Some(&ctx)).unwrap();
    assert_eq!(ok.digest(), s2.digest());
    let m = |k: &str, v: Option<&str>| with_meta(&d, k, v);
    for (bytes, needles) in [
        (
            m("weightcast.context_version", Some("0")),
            vec!["weightcast.context_version", "base version 1"],
        ),
        (
            m("weightcast.context_version", Some("2")),
            vec!["weightcast.context_version", "base version 1"],
        ),
        (
            m("weightcast.context_version", None),
            vec!["weightcast.context_version", "missing beside"],
        ),
        (
            m("weightcast.context_checksum", None),
            vec!["weightcast.context_checksum", "missing"],
        ),
        (
            m("weightcast.encoding", Some("compact")),
            vec!["weightcast.context_version", "only compact2"],
        ),
    ] {
        let mut s = s1.clone();
        let before = snapshot(&s);
        let err = apply_delta_ctx(&mut s, &bytes, Some(&ctx)).unwrap_err();
        assert_mentions(&err, &needles);
        assert!(snapshot(&s) == before, "{err}: the state was modified");
    }
}

// Top-level metadata lies.

#[test]
fn top_level_metadata_lies_are_rejected() {
    let fx = Fixture::new();
    let s1 = &fx.sets[1];
    for encoding in ENCODINGS {
        let d = fx.d12(encoding);
        let m = |k: &str, v: Option<&str>| with_meta(&d, k, v);
        let cases: Vec<(Vec<u8>, Vec<&str>)> = vec![
            (
                m("weightcast.base_digest", None),
                vec!["weightcast.base_digest", "missing"],
            ),
            (
                m("weightcast.base_digest", Some("xyz")),
                vec!["weightcast.base_digest", "16 hex"],
            ),
            (
                m("weightcast.base_digest", Some("0123456789abcdeg")),
                vec!["weightcast.base_digest", "16 hex"],
            ),
            (
                m("weightcast.base_digest", Some("+123456789abcdef")),
                vec!["weightcast.base_digest", "16 hex"],
            ),
            (
                m("weightcast.base_digest", Some("0123456789abcdef")),
                vec!["wrong base for file"],
            ),
            (
                m("weightcast.digest", Some("zz")),
                vec!["weightcast.digest", "16 hex"],
            ),
            (
                m("weightcast.digest", None),
                vec!["weightcast.digest", "missing"],
            ),
            // A wrong target digest is only found after every tensor was written.
            (
                m("weightcast.digest", Some("0123456789abcdef")),
                vec!["integrity check failed for file"],
            ),
            (
                m("weightcast.tensor_count", Some("6")),
                vec!["tensor count"],
            ),
            (
                m("weightcast.tensor_count", Some("many")),
                vec!["weightcast.tensor_count"],
            ),
            (
                m("weightcast.density", Some("1.5")),
                vec!["weightcast.density"],
            ),
            (
                m("weightcast.density", Some("NaN")),
                vec!["weightcast.density"],
            ),
            (m("weightcast.density", None), vec!["weightcast.density"]),
            (
                m("weightcast.tensors", Some("not json")),
                vec!["weightcast.tensors"],
            ),
            (
                m("weightcast.tensors", Some("[]")),
                vec!["weightcast.tensors"],
            ),
            (m("weightcast.tensors", None), vec!["weightcast.tensors"]),
            (
                m("weightcast.payload_blake3", None),
                vec!["weightcast.payload_blake3", "missing"],
            ),
            (
                m("weightcast.payload_blake3", Some("abc")),
                vec!["weightcast.payload_blake3", "64 hex"],
            ),
            (
                m("weightcast.payload_blake3", Some(&"0".repeat(64))),
                vec!["integrity check failed for payload"],
            ),
            (
                m("weightcast.format_version", Some("2")),
                vec!["weightcast.format_version", "not supported"],
            ),
            (
                m("weightcast.format_version", None),
                vec!["weightcast.format_version", "missing"],
            ),
            (
                m("weightcast.format", Some("weightcast2")),
                vec!["weightcast.format"],
            ),
            (
                m("weightcast.kind", Some("snapshot")),
                vec!["weightcast.kind"],
            ),
            (
                m("weightcast.kind", Some("anchor")),
                vec!["weightcast.encoding"],
            ),
            (
                m("weightcast.encoding", Some("zstd")),
                vec!["weightcast.encoding"],
            ),
            (
                m("weightcast.encoding", Some("full")),
                vec!["weightcast.encoding"],
            ),
            (
                m("weightcast.model_version", Some("-1")),
                vec!["weightcast.model_version"],
            ),
            (
                m("weightcast.base_version", None),
                vec!["weightcast.base_version", "missing"],
            ),
            (
                m("weightcast.changed_elements", Some("lots")),
                vec!["weightcast.changed_elements"],
            ),
        ];
        for (f, needles) in &cases {
            apply_err(s1, f, needles);
        }
        // The other delta encoding's name: compact payloads read as trl or vice versa.
        let other = if encoding == Encoding::Compact {
            "trl"
        } else {
            "compact"
        };
        apply_err(s1, &m("weightcast.encoding", Some(other)), &["missing"]);
    }
}

// ---------------------------------------------------------------------------
// Per-tensor metadata lies (compact).

#[test]
fn compact_entry_lies_are_rejected() {
    let fx = Fixture::new();
    let s1 = &fx.sets[1];
    let d = fx.d12(Encoding::Compact);
    let e = |f: &dyn Fn(&mut Value)| with_entries(&d, f);
    let words = 128u64;
    let cases: Vec<(Vec<u8>, Vec<&str>)> = vec![
        (
            e(&|v| {
                let c = v["embed"]["changed"].as_u64().unwrap();
                v["embed"]["changed"] = json!(c + 1);
            }),
            vec!["embed", "changes, payload holds"],
        ),
        (
            e(&|v| v["embed"]["changed"] = json!(u64::MAX)),
            vec!["embed", "changes, payload holds"],
        ),
        (
            e(&|v| v["embed"]["changed"] = json!(0)),
            vec!["embed", "changes, payload holds"],
        ),
        (
            e(&|v| {
                let c = v["embed"]["blocks"][0]["changes"].as_u64().unwrap();
                v["embed"]["blocks"][0]["changes"] = json!(c + 1);
            }),
            vec!["embed", "block 0"],
        ),
        (
            e(&|v| {
                let c = v["embed"]["blocks"][0]["changes"].as_u64().unwrap();
                v["embed"]["blocks"][0]["changes"] = json!(c - 1);
            }),
            vec!["embed", "block 0"],
        ),
        (
            e(&|v| v["embed"]["blocks"][0]["changes"] = json!(u64::MAX)),
            vec!["embed", "block 0", "more changes than words"],
        ),
        (
            e(&|v| v["embed"]["blocks"][0]["changes"] = json!(words)),
            vec!["embed", "block 0"],
        ),
        (
            e(&|v| {
                let b = v["embed"]["blocks"][0]["bytes"].as_u64().unwrap();
                v["embed"]["blocks"][0]["bytes"] = json!(b + 1);
            }),
            vec!["embed", "claims more bytes than the payload holds"],
        ),
        (
            e(&|v| v["embed"]["blocks"][0]["bytes"] = json!(u64::MAX)),
            vec!["embed", "claims more bytes than the payload holds"],
        ),
        (
            e(&|v| {
                let b = v["embed"]["blocks"][0]["bytes"].as_u64().unwrap();
                v["embed"]["blocks"][0]["bytes"] = json!(b - 1);
            }),
            vec!["embed", "payload has"],
        ),
        (
            e(&|v| v["embed"]["block_words"] = json!(0)),
            vec!["tensors.embed.block_words", "at least 1"],
        ),
        (
            e(&|v| {
                let b = v["embed"]["blocks"][0].clone();
                v["embed"]["blocks"].as_array_mut().unwrap().push(b);
            }),
            vec!["tensors.embed.blocks", "2 blocks listed"],
        ),
        (
            e(&|v| v["embed"]["blocks"] = json!([])),
            vec!["tensors.embed.blocks", "0 blocks listed"],
        ),
        (
            e(&|v| v["embed"]["block_words"] = json!(1)),
            vec!["tensors.embed.blocks", "blocks listed"],
        ),
        // Two blocks of 64 words: the same stream now describes the first half.
        (
            e(&|v| {
                v["embed"]["block_words"] = json!(64);
                v["embed"]["blocks"].as_array_mut().unwrap().push(json!(
                    {"changes": 0, "pos_k": 0, "values": "raw", "val_k": 0, "bytes": 0}
                ));
            }),
            vec!["embed"],
        ),
        (
            e(&|v| v["embed"]["blocks"][0]["pos_k"] = json!(200)),
            vec!["embed", "coding parameter out of range"],
        ),
        (
            e(&|v| v["embed"]["blocks"][0]["pos_k"] = json!(41)),
            vec!["embed", "coding parameter out of range"],
        ),
        (
            e(&|v| v["embed"]["blocks"][0]["val_k"] = json!(33)),
            vec!["embed", "coding parameter out of range"],
        ),
        (
            e(&|v| v["embed"]["blocks"][0]["pos_k"] = json!(300)),
            vec!["weightcast.tensors"],
        ),
        (
            e(&|v| v["embed"]["blocks"][0]["pos_k"] = json!(-1)),
            vec!["weightcast.tensors"],
        ),
        (
            e(&|v| v["embed"]["blocks"][0]["values"] = json!("zigzag")),
            vec!["weightcast.tensors"],
        ),
        (
            e(&|v| v["embed"]["blocks"][0]["extra"] = json!(1)),
            vec!["weightcast.tensors", "extra"],
        ),
        (
            e(&|v| {
                v["embed"]["blocks"][0]
                    .as_object_mut()
                    .unwrap()
                    .remove("bytes");
            }),
            vec!["weightcast.tensors", "bytes"],
        ),
        // Step-coded stream read as raw and the other way round.
        (
            e(&|v| v["embed"]["blocks"][0]["values"] = json!("raw")),
            vec!["embed"],
        ),
        (
            e(&|v| v["big"]["blocks"][0]["values"] = json!("step")),
            vec!["big"],
        ),
        (
            e(&|v| {
                let k = v["embed"]["blocks"][0]["pos_k"].as_u64().unwrap();
                v["embed"]["blocks"][0]["pos_k"] = json!(k + 1);
            }),
            vec!["embed"],
        ),
        (
            e(&|v| {
                let k = v["embed"]["blocks"][0]["val_k"].as_u64().unwrap();
                v["embed"]["blocks"][0]["val_k"] = json!(k + 1);
            }),
            vec!["embed"],
        ),
        (
            e(&|v| {
                v["embed"].as_object_mut().unwrap().remove("blocks");
            }),
            vec!["tensors.embed.blocks", "missing"],
        ),
        (
            e(&|v| {
                v["embed"].as_object_mut().unwrap().remove("block_words");
            }),
            vec!["tensors.embed.block_words", "missing"],
        ),
        (
            e(&|v| v["embed"]["block_words"] = json!(-5)),
            vec!["weightcast.tensors"],
        ),
    ];
    for (f, needles) in &cases {
        apply_err(s1, f, needles);
    }
}

// ---------------------------------------------------------------------------
// Per-tensor metadata lies (both encodings).

#[test]
fn tensor_entry_lies_are_rejected() {
    let fx = Fixture::new();
    let s1 = &fx.sets[1];
    let scale_digest = s1.tensors()[s1.position("scale").unwrap()]
        .digest
        .to_string();
    for encoding in ENCODINGS {
        let d = fx.d12(encoding);
        let e = |f: &dyn Fn(&mut Value)| with_entries(&d, f);
        let cases: Vec<(Vec<u8>, Vec<&str>)> = vec![
            (
                e(&|v| v["embed"]["dtype"] = json!("F16")),
                vec!["embed", "delta is for F16", "local tensor is BF16"],
            ),
            (
                e(&|v| v["embed"]["dtype"] = json!("Q4")),
                vec!["embed", "Q4"],
            ),
            (
                e(&|v| v["embed"]["shape"] = json!([8, 16])),
                vec!["embed", "[8, 16]"],
            ),
            (
                e(&|v| v["embed"]["shape"] = json!([128])),
                vec!["embed", "[128]"],
            ),
            (
                e(&|v| v["embed"]["shape"] = json!([16, 8, 1])),
                vec!["embed"],
            ),
            (
                e(&|v| v["embed"]["digest"] = json!("zz")),
                vec!["tensors.embed.digest", "16 hex"],
            ),
            (
                e(&|v| v["embed"]["base_digest"] = json!("00112233445566778")),
                vec!["tensors.embed.base_digest", "16 hex"],
            ),
            (
                e(&|v| {
                    v["embed"].as_object_mut().unwrap().remove("base_digest");
                }),
                vec!["tensors.embed.base_digest"],
            ),
            (
                e(&|v| v["embed"]["base_digest"] = json!("0011223344556677")),
                vec!["wrong base for tensor embed"],
            ),
            // Found only after writing: exercises the undo.
            (
                e(&|v| v["embed"]["digest"] = json!("0011223344556677")),
                vec!["integrity check failed for tensor embed"],
            ),
            (
                e(&|v| v["big"]["digest"] = json!("0011223344556677")),
                vec!["integrity check failed for tensor big"],
            ),
            (
                e(&|v| v["embed"]["changed"] = json!(3)),
                vec!["embed", "header says 3 changes"],
            ),
            (
                e(&|v| {
                    v.as_object_mut().unwrap().remove("norm");
                }),
                vec!["header describes"],
            ),
            (
                e(&|v| {
                    v["mask"]["dtype"] = json!("F32");
                }),
                vec!["mask", "delta is for F32"],
            ),
            // An entry for a tensor that did not change and has no payload.
            (
                e(&|v| {
                    let mut x = v["embed"].clone();
                    x["dtype"] = json!("F64");
                    x["shape"] = json!([]);
                    x["elements"] = json!(1);
                    x["base_digest"] = json!(scale_digest);
                    v["scale"] = x;
                }),
                vec!["scale", "missing"],
            ),
        ];
        for (f, needles) in &cases {
            apply_err(s1, f, needles);
        }
    }
}

/// An entry for the local empty tensor claiming a change, with an empty payload.
#[test]
fn changes_claimed_for_an_empty_tensor_are_rejected() {
    let fx = Fixture::new();
    let s1 = &fx.sets[1];
    let empty = &s1.tensors()[s1.position("empty").unwrap()];
    for encoding in ENCODINGS {
        let mut p = parse(&fx.d12(encoding));
        let mut v = p.entries();
        v["empty"] = json!({
            "dtype": "F32", "shape": [0, 3], "elements": 0, "changed": 1, "density": 1.0,
            "digest": "0000000000000000", "base_digest": empty.digest.to_string(),
            "block_words": 4194304, "blocks": [],
        });
        if encoding == Encoding::Trl {
            v["empty"].as_object_mut().unwrap().remove("blocks");
            v["empty"].as_object_mut().unwrap().remove("block_words");
            p.tensors
                .push(("empty.indices".into(), Dtype::I32, vec![1], vec![0; 4]));
            p.tensors
                .push(("empty.values".into(), Dtype::F32, vec![1], vec![0; 4]));
        } else {
            p.tensors
                .push(("empty.compact".into(), Dtype::U8, vec![0], vec![]));
        }
        p.set_entries(&v).rehash();
        apply_err(s1, &p.build(), &["empty"]);
    }
}

// ---------------------------------------------------------------------------
// Payload tensor lies.

#[test]
fn payload_tensor_lies_are_rejected() {
    let fx = Fixture::new();
    let s1 = &fx.sets[1];

    // compact
    let d = fx.d12(Encoding::Compact);
    let mut p = parse(&d);
    p.tensor("embed.compact").1 = Dtype::I8;
    apply_err(s1, &p.build(), &["embed", "1-D U8"]);
    let mut p = parse(&d);
    let t = p.tensor("embed.compact");
    t.2 = vec![1, t.3.len()];
    apply_err(s1, &p.build(), &["embed", "1-D U8"]);
    let mut p = parse(&d);
    p.tensor("embed.compact").0 = "embed.compressed".into();
    apply_err(s1, &p.build(), &["embed", "`embed.compact` missing"]);
    let mut p = parse(&d);
    p.tensors.retain(|t| t.0 != "big.compact");
    apply_err(s1, &p.rehash().build(), &["big", "`big.compact` missing"]);
    let mut p = parse(&d);
    p.tensors
        .push(("zzz.extra".into(), Dtype::U8, vec![2], vec![1, 2]));
    apply_err(
        s1,
        &p.rehash().build(),
        &["tensors in the delta", "header describes"],
    );
    // One more payload byte than the blocks describe.
    let mut p = parse(&d);
    let t = p.tensor("embed.compact");
    t.3.push(0);
    t.2 = vec![t.3.len()];
    apply_err(s1, &p.rehash().build(), &["embed", "payload has"]);

    // trl
    let d = fx.d12(Encoding::Trl);
    let mut p = parse(&d);
    p.tensor("embed.values").1 = Dtype::F16;
    apply_err(
        s1,
        &p.build(),
        &["embed", "values are F16, the parameter is BF16"],
    );
    let mut p = parse(&d);
    p.tensor("embed.indices").1 = Dtype::U32;
    apply_err(s1, &p.build(), &["embed", "I32 or I64"]);
    let mut p = parse(&d);
    p.tensor("embed.indices").1 = Dtype::F32;
    apply_err(s1, &p.build(), &["embed", "I32 or I64"]);
    let mut p = parse(&d);
    let t = p.tensor("embed.indices");
    t.2 = vec![1, t.2[0]];
    apply_err(s1, &p.build(), &["embed", "1-D"]);
    let mut p = parse(&d);
    p.tensors.retain(|t| t.0 != "embed.values");
    apply_err(
        s1,
        &p.rehash().build(),
        &["embed", "`embed.values` missing"],
    );
    let mut p = parse(&d);
    p.tensors.retain(|t| t.0 != "norm.indices");
    apply_err(s1, &p.rehash().build(), &["norm", "`norm.indices` missing"]);
    let mut p = parse(&d);
    p.tensors
        .push(("zzz.values".into(), Dtype::U8, vec![1], vec![1]));
    apply_err(
        s1,
        &p.rehash().build(),
        &["tensors in the delta", "header describes"],
    );
    // Indices that lie, found while writing (later indices of a tensor).
    let idx_case = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut p = parse(&d);
        f(&mut p.tensor("embed.indices").3);
        p.rehash().build()
    };
    let n = fx.changed_positions("embed").len();
    let last = (n - 1) * 4;
    let cases: Vec<(Vec<u8>, Vec<&str>)> = vec![
        (
            idx_case(&|b| b[last..].copy_from_slice(&128i32.to_le_bytes())),
            vec!["embed", "index 128 is beyond 128 elements"],
        ),
        (
            idx_case(&|b| b[last..].copy_from_slice(&i32::MAX.to_le_bytes())),
            vec!["embed", "beyond"],
        ),
        (
            idx_case(&|b| b[..4].copy_from_slice(&(-1i32).to_le_bytes())),
            vec!["embed", "not strictly ascending"],
        ),
        (
            idx_case(&|b| {
                let prev: [u8; 4] = b[last - 4..last].try_into().unwrap();
                b[last..].copy_from_slice(&prev);
            }),
            vec!["embed", "not strictly ascending"],
        ),
        (
            idx_case(&|b| {
                let x: [u8; 4] = b[last - 4..last].try_into().unwrap();
                let y: [u8; 4] = b[last..].try_into().unwrap();
                b[last - 4..last].copy_from_slice(&y);
                b[last..].copy_from_slice(&x);
            }),
            vec!["embed", "not strictly ascending"],
        ),
    ];
    for (f, needles) in &cases {
        apply_err(s1, f, needles);
    }
    // One value fewer than indices.
    let mut p = parse(&d);
    let t = p.tensor("embed.values");
    t.3.truncate(t.3.len() - 2);
    t.2 = vec![t.2[0] - 1];
    apply_err(s1, &p.rehash().build(), &["embed", "value bytes"]);
}

// ---------------------------------------------------------------------------
// Corrupted payload bits.

/// Every single-bit flip of the data section: without a matching
/// `payload_blake3` it is rejected up front; with a recomputed one the decoder
/// checks or the digests reject it.
#[test]
fn every_payload_bit_flip_is_rejected() {
    let fx = Fixture::new();
    let s1 = &fx.sets[1];
    for encoding in ENCODINGS {
        let d = fx.d12(encoding);
        let start = 8 + header_len(&d);
        let p = parse(&d);
        let total: usize = p.tensors.iter().map(|t| t.3.len()).sum();
        assert_eq!(start + total, d.len());
        for byte in start..d.len() {
            for bit in 0..8 {
                // Without rehash.
                let mut f = d.clone();
                f[byte] ^= 1 << bit;
                if (byte - start).is_multiple_of(7) {
                    let err = apply_err(s1, &f, &["integrity check failed for payload"]);
                    assert!(matches!(err, Error::Integrity { .. }));
                }
                // With rehash: deeper checks.
                let mut q = parse(&f);
                let f = q.rehash().build();
                let err = apply_err(s1, &f, &[]);
                assert!(
                    matches!(err, Error::Integrity { .. } | Error::Tensor { .. }),
                    "{encoding} flip at {byte}.{bit}: {err:?}"
                );
            }
        }
    }
}

/// Random bit flips anywhere in the object (header included, payload hash not
/// recomputed): an error with the state untouched, or, where the flip hit
/// something informational, exactly the intended state.
#[test]
fn random_bit_flips_anywhere_never_yield_a_wrong_state() {
    let fx = Fixture::new();
    let mut rng = Rng(31);
    for encoding in ENCODINGS {
        let d = fx.d12(encoding);
        let n = header_len(&d);
        let mut accepted = 0;
        for k in 0..3000 {
            let mut f = d.clone();
            // Two thirds in the header (where the interesting structure is).
            let at = if k % 3 == 2 {
                (rng.next() % d.len() as u64) as usize
            } else {
                8 + (rng.next() % n as u64) as usize
            };
            f[at] ^= 1 << (rng.next() % 8);
            if apply_err_or_exact(&fx.sets[1], &f, &fx.sets[2]) {
                accepted += 1;
            }
        }
        assert!(accepted < 3000 / 2, "{accepted} flips accepted");
    }
}

// ---------------------------------------------------------------------------
// Wrong base.

#[test]
fn deltas_applied_to_the_wrong_base_are_rejected() {
    let fx = Fixture::new();
    for encoding in ENCODINGS {
        let d12 = fx.d12(encoding);
        let d23 = delta(encoding, &fx.sets[2], &fx.items[3], 3);
        let d01 = delta(encoding, &fx.sets[0], &fx.items[1], 1);
        for (state, d) in [
            (&fx.sets[0], &d12),
            (&fx.sets[1], &d23),
            (&fx.sets[3], &d12),
            (&fx.sets[2], &d12),
            (&fx.sets[2], &d01),
        ] {
            let err = apply_err(state, d, &["wrong base for file"]);
            assert!(matches!(err, Error::WrongBase { .. }));
        }

        // v1 with one flipped element (honest digests), at a changed position and not.
        let embed = fx.sets[1].position("embed").unwrap();
        let changed = fx.changed_positions("embed");
        let unchanged = (0..128).find(|i| !changed.contains(i)).unwrap();
        for pos in [changed[0], unchanged] {
            let mut v1x = fx.sets[1].clone();
            v1x.data_mut(embed)[pos * 2] ^= 0x01;
            v1x.compute_digests();
            let err = apply_err(&v1x, &d12, &["wrong base for file"]);
            assert!(matches!(err, Error::WrongBase { .. }));

            // The same state with the delta's base digests forged to match it.
            let forged = with_meta(
                &d12,
                "weightcast.base_digest",
                Some(&v1x.digest().to_string()),
            );
            let forged = with_entries(&forged, |v| {
                v["embed"]["base_digest"] = json!(v1x.tensors()[embed].digest.to_string());
            });
            if pos == unchanged {
                let err = apply_err(&v1x, &forged, &["integrity check failed", "embed"]);
                assert!(matches!(err, Error::Integrity { .. }));
            } else {
                // compact steps depend on the old word: rejected. trl values are
                // absolute: the result is exactly v2, which is fine too.
                let ok = apply_err_or_exact(&v1x, &forged, &fx.sets[2]);
                assert_eq!(ok, encoding == Encoding::Trl, "{encoding}");
            }

            // Forged file digest only: the tensor's own base digest still catches it.
            let err = apply_err(
                &v1x,
                &with_meta(
                    &d12,
                    "weightcast.base_digest",
                    Some(&v1x.digest().to_string()),
                ),
                &["wrong base for tensor embed"],
            );
            assert!(matches!(err, Error::WrongBase { .. }));
        }

        // Local drift: bytes at a changed position differ from the publisher's base
        // while the stored digests still say v1 (a flipped bit in memory).
        for (name, pos) in [
            ("embed", fx.changed_positions("embed")[1]),
            ("big", *fx.changed_positions("big").last().unwrap()),
            ("mask", fx.changed_positions("mask")[0]),
        ] {
            let mut drifted = fx.sets[1].clone();
            let i = drifted.position(name).unwrap();
            let wb = word_bytes(drifted.tensors()[i].dtype);
            drifted.data_mut(i)[pos * wb] ^= 0x04;
            let err = apply_err(&drifted, &d12, &[name]);
            assert!(
                matches!(err, Error::Integrity { .. } | Error::Tensor { .. }),
                "{err:?}"
            );
        }
    }
}

/// A delta applied twice: the second apply is against v2 and fails.
#[test]
fn applying_a_delta_twice_fails_the_second_time() {
    let fx = Fixture::new();
    for encoding in ENCODINGS {
        let d = fx.d12(encoding);
        let mut s = fx.sets[1].clone();
        apply_delta(&mut s, &d).unwrap();
        apply_err(&s, &d, &["wrong base for file"]);
    }
}

// ---------------------------------------------------------------------------
// Wrong objects.

#[test]
fn deltas_for_unknown_tensors_are_rejected() {
    let fx = Fixture::new();
    for encoding in ENCODINGS {
        // Rename `norm` to `ghost` everywhere in the delta: same payload bytes.
        let mut p = parse(&fx.d12(encoding));
        let mut v = p.entries();
        let e = v.as_object_mut().unwrap().remove("norm").unwrap();
        v["ghost"] = e;
        for t in p.tensors.iter_mut() {
            if let Some(rest) = t.0.strip_prefix("norm.") {
                t.0 = format!("ghost.{rest}");
            }
        }
        p.set_entries(&v);
        apply_err(
            &fx.sets[1],
            &p.build(),
            &["ghost", "not in the local state"],
        );
    }
    // A different model altogether.
    let other = set(&[("x".to_string(), Dtype::BF16, vec![2], vec![1, 2, 3, 4])]);
    for encoding in ENCODINGS {
        apply_err(&other, &fx.d12(encoding), &["wrong base"]);
    }
}

#[test]
fn anchors_and_deltas_are_not_interchangeable() {
    let fx = Fixture::new();
    let (anchor, _) = encode_anchor(&fx.sets[2], 2).unwrap();
    apply_err(&fx.sets[1], &anchor, &["weightcast.kind", "not a delta"]);
    for encoding in ENCODINGS {
        anchor_err(&fx.d12(encoding), &["weightcast.kind", "delta"]);
        anchor_err(
            &with_meta(&fx.d12(encoding), "weightcast.format_version", Some("2")),
            &["weightcast.format_version"],
        );
    }
    anchor_err(
        &with_meta(&anchor, "weightcast.format_version", Some("2")),
        &["weightcast.format_version", "not supported"],
    );
    // A plain checkpoint is not a delta.
    let mut plain = Vec::new();
    write_safetensors(
        &[("a", Dtype::U8, &[1], &[1])],
        &BTreeMap::new(),
        &mut plain,
    )
    .unwrap();
    apply_err(&fx.sets[1], &plain, &["weightcast.format", "neither"]);
    // Nor is a TRL full checkpoint.
    let meta: BTreeMap<String, String> = [("format", "sparse_weight_patch"), ("sparse", "False")]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let mut full = Vec::new();
    write_safetensors(
        &[("mask", Dtype::U8, &[5], &[1, 2, 3, 4, 5])],
        &meta,
        &mut full,
    )
    .unwrap();
    apply_err(&fx.sets[1], &full, &["neither"]);
}

#[test]
fn anchor_lies_are_rejected() {
    let fx = Fixture::new();
    let (a, _) = encode_anchor(&fx.sets[1], 1).unwrap();
    let e = |f: &dyn Fn(&mut Value)| with_entries(&a, f);
    let cases: Vec<(Vec<u8>, Vec<&str>)> = vec![
        (
            with_meta(&a, "weightcast.tensor_count", Some("3")),
            vec!["weightcast.tensor_count"],
        ),
        (
            with_meta(&a, "weightcast.digest", Some("0123456789abcdef")),
            vec!["integrity check failed for file"],
        ),
        (
            with_meta(&a, "weightcast.digest", Some("nothex")),
            vec!["weightcast.digest"],
        ),
        (
            with_meta(&a, "weightcast.kind", Some("delta")),
            vec!["weightcast.encoding"],
        ),
        (
            with_meta(&a, "weightcast.tensors", None),
            vec!["weightcast.tensors"],
        ),
        (
            e(&|v| v["embed"]["digest"] = json!("0123456789abcdef")),
            vec!["integrity check failed for tensor embed"],
        ),
        (
            e(&|v| v["embed"]["digest"] = json!("xx")),
            vec!["tensors.embed.digest"],
        ),
        (
            e(&|v| {
                v.as_object_mut().unwrap().remove("embed");
            }),
            vec!["weightcast.tensors", "lists 6 tensors"],
        ),
        (
            e(&|v| {
                let x = v.as_object_mut().unwrap().remove("embed").unwrap();
                v["embedding"] = x;
            }),
            vec!["embed", "not described"],
        ),
    ];
    for (f, needles) in &cases {
        anchor_err(f, needles);
    }
    // Corrupted tensor bytes.
    let start = 8 + header_len(&a);
    for at in [start, start + 100, a.len() - 1] {
        let mut f = a.clone();
        f[at] ^= 0x20;
        let err = anchor_err(&f, &["integrity check failed for tensor"]);
        assert!(matches!(err, Error::Integrity { .. }));
    }
}

// ---------------------------------------------------------------------------
// Foreign TRL files.

fn foreign(tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)], changed: Option<&str>) -> Vec<u8> {
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), "sparse_weight_patch".to_string());
    meta.insert("version".to_string(), "1".to_string());
    meta.insert("sparse".to_string(), "True".to_string());
    if let Some(c) = changed {
        meta.insert("changed_params".to_string(), c.to_string());
    }
    let views: Vec<(&str, Dtype, &[usize], &[u8])> = tensors
        .iter()
        .map(|(n, d, s, b)| (*n, *d, s.as_slice(), b.as_slice()))
        .collect();
    let mut out = Vec::new();
    write_safetensors(&views, &meta, &mut out).unwrap();
    out
}

fn i32s(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn i64s(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn malformed_foreign_trl_files_are_rejected() {
    let fx = Fixture::new();
    let s1 = &fx.sets[1];
    // A valid two-parameter patch to start from: mask (U8 [5]) and big (BF16 [300]).
    let good_mask_i = i32s(&[0, 2, 4]);
    let good_mask_v = vec![9u8, 8, 7];
    let big_i = i32s(&[1, 100, 299]);
    let big_v = vec![1u8, 2, 3, 4, 5, 6];
    let names = Some(r#"["big","mask"]"#);
    let ok = foreign(
        &[
            ("big.indices", Dtype::I32, vec![3], big_i.clone()),
            ("big.values", Dtype::BF16, vec![3], big_v.clone()),
            ("mask.indices", Dtype::I32, vec![3], good_mask_i.clone()),
            ("mask.values", Dtype::U8, vec![3], good_mask_v.clone()),
        ],
        names,
    );
    let mut s = s1.clone();
    let r = apply_delta(&mut s, &ok).unwrap();
    assert!(!r.verified);

    let with_mask = |ind: (Dtype, Vec<usize>, Vec<u8>), val: (Dtype, Vec<usize>, Vec<u8>)| {
        foreign(
            &[
                ("big.indices", Dtype::I32, vec![3], big_i.clone()),
                ("big.values", Dtype::BF16, vec![3], big_v.clone()),
                ("mask.indices", ind.0, ind.1, ind.2),
                ("mask.values", val.0, val.1, val.2),
            ],
            names,
        )
    };
    let mv = (Dtype::U8, vec![3], good_mask_v.clone());
    let cases: Vec<(Vec<u8>, Vec<&str>)> = vec![
        (
            with_mask((Dtype::I32, vec![3], i32s(&[0, 4, 2])), mv.clone()),
            vec!["mask", "not strictly ascending"],
        ),
        (
            with_mask((Dtype::I32, vec![3], i32s(&[0, 2, 2])), mv.clone()),
            vec!["mask", "not strictly ascending"],
        ),
        (
            with_mask((Dtype::I32, vec![3], i32s(&[0, 2, 5])), mv.clone()),
            vec!["mask", "index 5 is beyond 5 elements"],
        ),
        (
            with_mask((Dtype::I32, vec![3], i32s(&[-3, 0, 1])), mv.clone()),
            vec!["mask", "not strictly ascending"],
        ),
        (
            with_mask((Dtype::I64, vec![3], i64s(&[0, 1, 1 << 32])), mv.clone()),
            vec!["mask", "beyond"],
        ),
        (
            with_mask((Dtype::I64, vec![3], i64s(&[0, 1, i64::MIN])), mv.clone()),
            vec!["mask", "not strictly ascending"],
        ),
        (
            with_mask((Dtype::U32, vec![3], i32s(&[0, 1, 2])), mv.clone()),
            vec!["mask", "I32 or I64"],
        ),
        (
            with_mask((Dtype::F32, vec![3], i32s(&[0, 1, 2])), mv.clone()),
            vec!["mask", "I32 or I64"],
        ),
        (
            with_mask(
                (Dtype::I32, vec![3], good_mask_i.clone()),
                (Dtype::I8, vec![3], good_mask_v.clone()),
            ),
            vec!["mask", "values are I8, the parameter is U8"],
        ),
        (
            with_mask(
                (Dtype::I32, vec![3], good_mask_i.clone()),
                (Dtype::U8, vec![2], vec![9, 8]),
            ),
            vec!["mask", "3 indices but 2 value bytes"],
        ),
        (
            with_mask(
                (Dtype::I32, vec![3], good_mask_i.clone()),
                (Dtype::U8, vec![1, 3], good_mask_v.clone()),
            ),
            vec!["mask", "1-D"],
        ),
        (
            foreign(
                &[
                    ("big.indices", Dtype::I32, vec![3], big_i.clone()),
                    ("big.values", Dtype::BF16, vec![3], big_v.clone()),
                    ("mask.indices", Dtype::I32, vec![3], good_mask_i.clone()),
                ],
                names,
            ),
            vec!["mask", "`mask.values` missing"],
        ),
        (
            foreign(
                &[
                    ("big.indices", Dtype::I32, vec![3], big_i.clone()),
                    ("big.values", Dtype::BF16, vec![3], big_v.clone()),
                    ("mask.indices", Dtype::I32, vec![3], good_mask_i.clone()),
                    ("mask.values", Dtype::U8, vec![3], good_mask_v.clone()),
                    ("stray", Dtype::U8, vec![1], vec![0]),
                ],
                names,
            ),
            vec!["5 tensors in the file, 4 expected"],
        ),
        // Without changed_params: mask.indices without mask.values.
        (
            foreign(
                &[
                    ("big.indices", Dtype::I32, vec![3], big_i.clone()),
                    ("big.values", Dtype::BF16, vec![3], big_v.clone()),
                    ("mask.indices", Dtype::I32, vec![3], good_mask_i.clone()),
                ],
                None,
            ),
            vec!["3 tensors in the file, 2 expected"],
        ),
        (
            foreign(
                &[
                    ("ghost.indices", Dtype::I32, vec![1], i32s(&[0])),
                    ("ghost.values", Dtype::U8, vec![1], vec![1]),
                ],
                Some(r#"["ghost"]"#),
            ),
            vec!["ghost", "not in the local state"],
        ),
        (
            foreign(
                &[
                    ("ghost.indices", Dtype::I32, vec![1], i32s(&[0])),
                    ("ghost.values", Dtype::U8, vec![1], vec![1]),
                ],
                None,
            ),
            vec!["ghost", "not in the local state"],
        ),
        (
            foreign(&[], Some("big, mask")),
            vec!["changed_params", "not a JSON list"],
        ),
        (
            foreign(&[], Some(r#"{"big": 1}"#)),
            vec!["changed_params", "not a JSON list"],
        ),
        (
            foreign(
                &[
                    ("mask.indices", Dtype::I32, vec![3], good_mask_i.clone()),
                    ("mask.values", Dtype::U8, vec![3], good_mask_v.clone()),
                ],
                Some(r#"["mask","mask"]"#),
            ),
            vec!["changed_params", "`mask` listed twice"],
        ),
        (
            foreign(
                &[
                    ("big.indices", Dtype::I32, vec![3], big_i.clone()),
                    ("big.values", Dtype::BF16, vec![3], big_v.clone()),
                ],
                Some(r#"["big","mask"]"#),
            ),
            vec!["mask", "`mask.indices` missing"],
        ),
    ];
    for (f, needles) in &cases {
        apply_err(s1, f, needles);
    }

    // Packed dtypes cannot be patched by TRL files.
    let packed = set(&[("p".to_string(), Dtype::F4, vec![4], vec![0x12, 0x34])]);
    let f = foreign(
        &[
            ("p.indices", Dtype::I32, vec![1], i32s(&[0])),
            ("p.values", Dtype::F4, vec![2], vec![0x55]),
        ],
        Some(r#"["p"]"#),
    );
    let err = apply_err(&packed, &f, &["trl", "`p`"]);
    assert!(matches!(err, Error::Unsupported { .. }), "{err:?}");
}

// ---------------------------------------------------------------------------
// Hand-crafted compact bit streams.

/// A one-tensor compact delta for `name`, built by hand from `blocks` and the
/// payload, with the digests of `target` (the state it claims to produce).
fn craft_compact(
    state: &TensorSet,
    target: &TensorSet,
    name: &str,
    block_words: u64,
    blocks: Value,
    payload: Vec<u8>,
) -> Vec<u8> {
    let i = state.position(name).unwrap();
    let t = &state.tensors()[i];
    let changed: u64 = blocks
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["changes"].as_u64().unwrap())
        .sum();
    let mut entries = serde_json::Map::new();
    entries.insert(
        name.to_string(),
        json!({
            "dtype": t.dtype.to_string(), "shape": t.shape, "elements": t.elements(),
            "changed": changed, "density": 0.5,
            "digest": target.tensors()[i].digest.to_string(),
            "base_digest": t.digest.to_string(),
            "block_words": block_words, "blocks": blocks,
        }),
    );
    let kv = |k: &str, v: String| (k.to_string(), v);
    let meta: BTreeMap<String, String> = [
        kv("weightcast.format", "weightcast".into()),
        kv("weightcast.format_version", "1".into()),
        kv("weightcast.kind", "delta".into()),
        kv("weightcast.encoding", "compact".into()),
        kv("weightcast.model_version", "1".into()),
        kv("weightcast.base_version", "0".into()),
        kv("weightcast.base_digest", state.digest().to_string()),
        kv("weightcast.digest", target.digest().to_string()),
        kv("weightcast.tensor_count", state.len().to_string()),
        kv(
            "weightcast.total_elements",
            state.total_elements().to_string(),
        ),
        kv("weightcast.changed_elements", changed.to_string()),
        kv("weightcast.density", "0.1".into()),
    ]
    .into_iter()
    .collect();
    let mut p = Parts {
        meta,
        tensors: vec![(
            format!("{name}.compact"),
            Dtype::U8,
            vec![payload.len()],
            payload,
        )],
    };
    p.set_entries(&Value::Object(entries)).rehash();
    p.build()
}

fn block(changes: u64, pos_k: u8, values: &str, val_k: u8, bytes: &[u8]) -> Value {
    json!({"changes": changes, "pos_k": pos_k, "values": values, "val_k": val_k, "bytes": bytes.len()})
}

/// Streams written with the crate's own bit writer, following docs/format.md §6.1.
fn stream(f: impl FnOnce(&mut weightcast::codec::bits::BitWriter)) -> Vec<u8> {
    let mut w = weightcast::codec::bits::BitWriter::default();
    f(&mut w);
    w.finish()
}

#[test]
fn hand_crafted_compact_streams() {
    // u: U8 [16] = 0, 3, 6, ...; w: BF16 [8], never touched.
    let base_items: Vec<Owned> = vec![
        (
            "u".into(),
            Dtype::U8,
            vec![16],
            (0..16u8).map(|i| i * 3).collect(),
        ),
        ("w".into(), Dtype::BF16, vec![8], vec![0x3f; 16]),
    ];
    let state = set(&base_items);
    let target = |changes: &[(usize, u8)]| {
        let mut items = base_items.clone();
        for &(i, v) in changes {
            items[0].3[i] = v;
        }
        set(&items)
    };
    let ok = |d: &[u8], expect: &TensorSet| {
        let mut s = state.clone();
        let r = apply_delta(&mut s, d).unwrap_or_else(|e| panic!("{e}"));
        assert!(r.verified);
        assert!(snapshot(&s) == snapshot(expect));
    };

    // Valid: two raw entries in one block.
    let t1 = target(&[(3, 200), (4, 201)]);
    let s1 = stream(|w| {
        w.put_unary(3);
        w.put(200, 8);
        w.put_unary(0);
        w.put(201, 8);
    });
    ok(
        &craft_compact(
            &state,
            &t1,
            "u",
            16,
            json!([block(2, 0, "raw", 0, &s1)]),
            s1.clone(),
        ),
        &t1,
    );

    // Valid: blocks of 8 words, a step block then a raw block; and pos_k = 40.
    let t2 = target(&[(5, 15 + 3), (15, 77)]);
    let b0 = stream(|w| {
        w.put_unary(2); // gap 5 = 2 << 1 | 1
        w.put(1, 1);
        w.put_unary(1); // step +3: y = 3, nb = 2
        w.put(1, 1);
        w.put(0, 1);
    });
    for pos_k in [0u8, 40] {
        let b1 = stream(|w| {
            if pos_k == 0 {
                w.put_unary(7);
            } else {
                w.put_unary(0);
                w.put(7, 40);
            }
            w.put(77, 8);
        });
        let payload = [b0.clone(), b1.clone()].concat();
        let blocks = json!([block(1, 1, "step", 0, &b0), block(1, pos_k, "raw", 0, &b1)]);
        ok(&craft_compact(&state, &t2, "u", 8, blocks, payload), &t2);
    }

    // Valid: blocks that do not divide the tensor (5 + 5 + 5 + 1 words), and one
    // block of u64::MAX words.
    let t4 = target(&[(12, 1), (15, 2)]);
    let b2 = stream(|w| {
        w.put_unary(2); // index 10 + 2
        w.put(1, 8);
    });
    let b3 = stream(|w| {
        w.put_unary(0); // index 15 + 0
        w.put(2, 8);
    });
    let blocks = json!([
        block(0, 0, "raw", 0, &[]),
        block(0, 0, "raw", 0, &[]),
        block(1, 0, "raw", 0, &b2),
        block(1, 0, "raw", 0, &b3),
    ]);
    ok(
        &craft_compact(&state, &t4, "u", 5, blocks, [b2, b3].concat()),
        &t4,
    );
    let one = stream(|w| {
        w.put_unary(12);
        w.put(1, 8);
        w.put_unary(2);
        w.put(2, 8);
    });
    ok(
        &craft_compact(
            &state,
            &t4,
            "u",
            u64::MAX,
            json!([block(2, 0, "raw", 0, &one)]),
            one.clone(),
        ),
        &t4,
    );

    // A step of exactly half the word (its own negation), with either sign bit.
    let t3 = target(&[(2, 6 ^ 0x80)]);
    for sign in [0, 1] {
        let s = stream(|w| {
            w.put_unary(2);
            w.put_unary(7); // y = 128, nb = 8
            w.put(0, 7);
            w.put(sign, 1);
        });
        ok(
            &craft_compact(
                &state,
                &t3,
                "u",
                16,
                json!([block(1, 0, "step", 0, &s)]),
                s.clone(),
            ),
            &t3,
        );
    }

    // Invalid streams: (target claimed, block_words, blocks, payload, needles).
    let raw_same = stream(|w| {
        w.put_unary(3);
        w.put(9, 8); // u[3] is already 9
    });
    let beyond = stream(|w| {
        w.put_unary(1); // gap 16 with pos_k 4: index 16 of 16
        w.put(0, 4);
        w.put(1, 8);
    });
    let huge_step = stream(|w| {
        w.put_unary(0);
        w.put_unary(32); // z = 32 with val_k = 32: 64 bits
        w.put(0, 64);
        w.put(0, 1);
    });
    let over_half = stream(|w| {
        w.put_unary(0);
        w.put_unary(8); // y = 256: m = 256 > 128
        w.put(0, 8);
        w.put(0, 1);
    });
    let one_raw = stream(|w| {
        w.put_unary(0);
        w.put(1, 8);
    });
    let mut dirty_padding = one_raw.clone();
    *dirty_padding.last_mut().unwrap() |= 0x80;
    let extra_byte = [one_raw.clone(), vec![0]].concat();
    let zeros = vec![0u8; 64];
    let valid_b1 = stream(|w| {
        w.put_unary(7);
        w.put(77, 8);
    });
    let t_any = target(&[(0, 1)]);
    type Case<'a> = (u64, Value, Vec<u8>, Vec<&'a str>);
    let cases: Vec<Case> = vec![
        (
            16,
            json!([block(1, 0, "raw", 0, &raw_same)]),
            raw_same.clone(),
            vec!["`u`", "lists element 3 as changed but it is not"],
        ),
        (
            16,
            json!([block(1, 4, "raw", 0, &beyond)]),
            beyond.clone(),
            vec!["`u`", "position beyond the block"],
        ),
        (
            16,
            json!([block(1, 0, "step", 32, &huge_step)]),
            huge_step.clone(),
            vec!["`u`", "step too large"],
        ),
        (
            16,
            json!([block(1, 0, "step", 0, &over_half)]),
            over_half.clone(),
            vec!["`u`", "step larger than the word"],
        ),
        (
            16,
            json!([block(1, 0, "raw", 0, &dirty_padding)]),
            dirty_padding.clone(),
            vec!["`u`", "trailing bytes"],
        ),
        (
            16,
            json!([block(1, 0, "raw", 0, &extra_byte)]),
            extra_byte.clone(),
            vec!["`u`", "trailing bytes"],
        ),
        (
            16,
            json!([block(1, 0, "raw", 0, &zeros)]),
            zeros.clone(),
            vec!["`u`", "truncated or invalid position"],
        ),
        (
            16,
            json!([block(2, 0, "raw", 0, &one_raw)]),
            one_raw.clone(),
            vec!["`u`", "block 0"],
        ),
        // The second block is fine and written; the first fails: all undone.
        (
            8,
            json!([
                block(1, 0, "raw", 0, &raw_same),
                block(1, 0, "raw", 0, &valid_b1)
            ]),
            [raw_same.clone(), valid_b1.clone()].concat(),
            vec!["`u`", "block 0"],
        ),
        // The first block is fine and written; the second is truncated.
        (
            8,
            json!([
                block(1, 0, "raw", 0, &one_raw),
                block(2, 0, "raw", 0, &valid_b1)
            ]),
            [one_raw.clone(), valid_b1.clone()].concat(),
            vec!["`u`", "block 1"],
        ),
        // A valid stream whose result is not the claimed target.
        (
            16,
            json!([block(2, 0, "raw", 0, &s1)]),
            s1.clone(),
            vec!["integrity check failed for tensor u"],
        ),
    ];
    for (bw, blocks, payload, needles) in cases {
        let d = craft_compact(&state, &t_any, "u", bw, blocks, payload);
        apply_err(&state, &d, &needles);
    }
}

// ---------------------------------------------------------------------------
// Findings (see the ignore reasons).

#[test]
fn anchor_tensor_count_lie_names_the_claimed_count() {
    let fx = Fixture::new();
    let (a, _) = encode_anchor(&fx.sets[1], 1).unwrap();
    anchor_err(
        &with_meta(&a, "weightcast.tensor_count", Some("3")),
        &["weightcast.tensor_count", "3"],
    );
}

#[test]
fn tensor_count_mismatch_is_not_called_a_digest() {
    let fx = Fixture::new();
    let other = set(&[("x".to_string(), Dtype::BF16, vec![2], vec![1, 2, 3, 4])]);
    let err = apply_err(&other, &fx.d12(Encoding::Compact), &["tensor count"]);
    assert!(!err.to_string().contains("digest 7"), "{err}");
}

#[test]
fn upper_case_payload_blake3_is_accepted() {
    let fx = Fixture::new();
    for encoding in ENCODINGS {
        let d = fx.d12(encoding);
        let h = parse(&d).meta["weightcast.payload_blake3"].to_uppercase();
        let d = with_meta(&d, "weightcast.payload_blake3", Some(&h));
        let mut s = fx.sets[1].clone();
        apply_delta(&mut s, &d).unwrap();
        assert!(snapshot(&s) == snapshot(&fx.sets[2]));
    }
}

// ---------------------------------------------------------------------------
// In place: verify first, then write.

/// `state`'s bytes with word `pos` of tensor `name` xor-ed with `bit`.
fn flipped(state: &TensorSet, name: &str, pos: usize, bit: u8) -> Vec<Vec<u8>> {
    let mut bufs = buffers(state);
    let i = state.position(name).unwrap();
    let wb = word_bytes(state.tensors()[i].dtype);
    bufs[i][pos * wb] ^= bit;
    bufs
}

/// A target modified at one element the delta changes is refused, naming the
/// tensor, and nothing is written anywhere: not even the tensors verified
/// before it (`norm` comes last of the four changed tensors). Both encodings
/// (TRL values are absolute, yet the old word still enters the digest check).
#[test]
fn in_place_refuses_a_modified_changed_element_and_writes_nothing() {
    let fx = Fixture::new();
    for encoding in ENCODINGS {
        let d = fx.d12(encoding);
        for name in ["norm", "embed", "big", "mask"] {
            for k in [0, fx.changed_positions(name).len() - 1] {
                let pos = fx.changed_positions(name)[k];
                let mut bufs = flipped(&fx.sets[1], name, pos, 0x10);
                let before = bufs.clone();
                let err = apply_in_place(&mut targets(&fx.sets[1], &mut bufs), &d).unwrap_err();
                assert!(matches!(err, Error::WrongBase { .. }), "{err:?}");
                assert_mentions(&err, &[name, "at the positions the delta changes"]);
                assert!(bufs == before, "{encoding} {name}: a refused apply wrote");
            }
        }
    }
}

/// The prepared apply refuses a modified changed element exactly as the
/// one-call apply does, writing nothing; a commit given other targets than
/// the prepare (one missing, one resized, one of another dtype) fails before
/// writing anything.
#[test]
fn prepare_refuses_a_modified_base_and_commit_other_targets() {
    let fx = Fixture::new();
    let d = fx.d12(Encoding::Compact);
    let name = "embed";
    let pos = fx.changed_positions(name)[0];
    let mut bufs = flipped(&fx.sets[1], name, pos, 0x10);
    let before = bufs.clone();
    let err = weightcast::codec::prepare_in_place_all(&mut targets(&fx.sets[1], &mut bufs), &[&d])
        .err()
        .expect("a modified base is refused");
    assert!(matches!(err, Error::WrongBase { .. }), "{err:?}");
    assert_mentions(&err, &[name]);
    assert!(bufs == before);

    let prepare = |bufs: &mut Vec<Vec<u8>>| {
        weightcast::codec::prepare_in_place_all(&mut targets(&fx.sets[1], bufs), &[&d]).unwrap()
    };
    let e = fx.sets[1].position(name).unwrap();
    // One missing.
    let mut bufs = buffers(&fx.sets[1]);
    let prepared = prepare(&mut bufs);
    let mut ts = targets(&fx.sets[1], &mut bufs);
    ts.remove(e);
    let err = prepared.commit(&mut ts).expect_err("a missing target");
    assert_mentions(&err, &[name, "not among the targets"]);
    assert!(
        bufs.iter()
            .enumerate()
            .all(|(i, b)| b == fx.sets[1].data(i))
    );
    // One resized.
    let mut bufs = buffers(&fx.sets[1]);
    let prepared = prepare(&mut bufs);
    bufs[e].pop();
    let err = prepared
        .commit(&mut targets(&fx.sets[1], &mut bufs))
        .expect_err("a resized target");
    assert_mentions(&err, &[name, "when prepared"]);
    // Another dtype.
    let mut bufs = buffers(&fx.sets[1]);
    let prepared = prepare(&mut bufs);
    let mut ts = targets(&fx.sets[1], &mut bufs);
    ts[e].dtype = if ts[e].dtype == Dtype::F16 {
        Dtype::BF16
    } else {
        Dtype::F16
    };
    let err = prepared.commit(&mut ts).expect_err("another dtype");
    assert_mentions(&err, &[name, "when prepared"]);
    assert!(
        bufs.iter()
            .enumerate()
            .all(|(i, b)| b == fx.sets[1].data(i))
    );
}

/// Only the elements a delta changes are checked: a target modified elsewhere
/// is accepted and keeps its modification (the full check is
/// `tensor_digest_of`, a pass over the tensor, which does see it).
#[test]
fn in_place_accepts_a_modified_unchanged_element() {
    let fx = Fixture::new();
    let changed = fx.changed_positions("embed");
    let pos = (0..128).find(|i| !changed.contains(i)).unwrap();
    let e = fx.sets[1].position("embed").unwrap();
    for encoding in ENCODINGS {
        let d = fx.d12(encoding);
        let mut bufs = flipped(&fx.sets[1], "embed", pos, 0x01);
        let report = apply_in_place(&mut targets(&fx.sets[1], &mut bufs), &d).unwrap();
        let mut want = fx.sets[2].data(e).to_vec();
        want[pos * 2] ^= 0x01;
        assert!(bufs[e] == want, "{encoding}");
        for (i, b) in bufs.iter().enumerate().filter(|(i, _)| *i != e) {
            assert!(b == fx.sets[2].data(i));
        }
        let entry = &report.tensors.iter().find(|t| t.name == "embed").unwrap();
        let t = &fx.sets[2].tensors()[e];
        assert_eq!(entry.digest, t.digest);
        let full = weightcast::codec::tensor_digest_of("embed", t.dtype, &t.shape, &bufs[e]);
        assert_ne!(full.unwrap(), entry.digest, "the full check sees the drift");
    }
}

/// Targets that do not match the delta: a clear error naming the tensor, and
/// nothing written. Targets the delta does not name are untouched on success.
#[test]
fn in_place_refuses_targets_that_do_not_match() {
    let fx = Fixture::new();
    let s1 = &fx.sets[1];
    for encoding in ENCODINGS {
        let d = fx.d12(encoding);
        let attempt = |edit: &dyn Fn(&mut Vec<Target>), needles: &[&str]| {
            let mut bufs = buffers(s1);
            let before = bufs.clone();
            let mut t = targets(s1, &mut bufs);
            edit(&mut t);
            let err = apply_in_place(&mut t, &d).unwrap_err();
            assert_mentions(&err, needles);
            drop(t);
            assert!(bufs == before, "{encoding}: {err}");
        };
        const OTHER_SHAPE: [usize; 3] = [16, 4, 2];
        attempt(
            &|t| t[1].dtype = Dtype::F16,
            &["embed", "delta is for BF16"],
        );
        attempt(&|t| t[1].shape = &OTHER_SHAPE, &["embed", "[16, 8]"]);
        attempt(
            &|t| {
                t.remove(0);
            },
            &["big", "not in the local state"],
        );
        attempt(
            &|t| {
                let n = t[0].data.len();
                let data = std::mem::take(&mut t[0].data);
                t[0].data = &mut data[..n - 2];
            },
            &["big", "holds 598 bytes", "needs 600"],
        );
        attempt(&|t| t[2].name = "embed", &["embed", "given twice"]);
        // Tensors outside the delta stay as they are; a target set without
        // them is fine too.
        let mut bufs = buffers(s1);
        let mut extra = vec![7u8; 10];
        let mut t = targets(s1, &mut bufs);
        t.retain(|t| ["big", "embed", "mask", "norm"].contains(&t.name));
        t.push(Target {
            name: "unrelated",
            dtype: Dtype::U8,
            shape: &[10],
            data: &mut extra,
        });
        let report = apply_in_place(&mut t, &d).unwrap();
        assert_eq!(report.changed_tensors, ["big", "embed", "mask", "norm"]);
        assert_eq!(extra, vec![7u8; 10]);
        for (i, b) in bufs.iter().enumerate() {
            assert!(b == fx.sets[2].data(i), "{}", s1.tensors()[i].name);
        }
    }
}

/// What in place refuses that only the object can tell: not a weightcast
/// delta, a header whose file digests disagree with its tensors', a corrupt
/// payload. A tensor-count lie (the targets need not be a whole file) passes.
#[test]
fn in_place_refuses_what_the_object_gets_wrong() {
    let fx = Fixture::new();
    let s1 = &fx.sets[1];
    let refused = |bytes: &[u8], needles: &[&str]| {
        let err = in_place(s1, bytes).expect_err("refused");
        assert_mentions(&err, needles);
    };
    let (anchor, _) = encode_anchor(&fx.sets[2], 2).unwrap();
    refused(&anchor, &["weightcast.kind", "not a delta"]);
    let trl = fx.d12(Encoding::Trl);
    let mut foreign_trl = parse(&trl);
    foreign_trl
        .meta
        .retain(|k, _| !k.starts_with("weightcast."));
    refused(
        &foreign_trl.build(),
        &["not a weightcast delta", "apply_delta"],
    );
    for encoding in ENCODINGS {
        let d = fx.d12(encoding);
        let wrong = Digest(fx.sets[2].digest().0 ^ 1).to_string();
        refused(
            &with_meta(&d, "weightcast.digest", Some(&wrong)),
            &["weightcast.digest", "add up"],
        );
        let mut f = d.clone();
        *f.last_mut().unwrap() ^= 1;
        refused(&f, &["integrity check failed for payload"]);
        let lie = with_meta(&d, "weightcast.tensor_count", Some("3"));
        let bufs = in_place(s1, &lie).unwrap();
        assert!((0..s1.len()).all(|i| bufs[i] == fx.sets[2].data(i)));
    }
}

/// The device form's errors: an unknown tensor, positions or old values that
/// are not what the delta needs, an old value that is not the base's.
#[test]
fn resolve_checks_positions_and_old_values() {
    let fx = Fixture::new();
    let s1 = &fx.sets[1];
    for encoding in ENCODINGS {
        let d = fx.d12(encoding);
        let delta = Delta::parse(&d).unwrap();
        assert_mentions(
            &delta.changed_positions("scale").unwrap_err(),
            &["scale", "not changed by this delta"],
        );
        let e = s1.position("embed").unwrap();
        let positions = delta.changed_positions("embed").unwrap();
        let old: Vec<u8> = (0..positions.len())
            .flat_map(|j| {
                let p = positions.get(j).unwrap() as usize;
                s1.data(e)[2 * p..2 * p + 2].to_vec()
            })
            .collect();
        assert!(delta.resolve("embed", &positions, &old).is_ok());
        assert_mentions(
            &delta.resolve("embed", &positions, &old[2..]).unwrap_err(),
            &["embed", "bytes of old values"],
        );
        let mut fewer = positions.clone();
        if let weightcast::codec::Positions::U32(v) = &mut fewer {
            v.pop();
        }
        assert_mentions(
            &delta
                .resolve("embed", &fewer, &old[..old.len() - 2])
                .unwrap_err(),
            &["embed", "positions differ"],
        );
        let mut moved = positions.clone();
        if let weightcast::codec::Positions::U32(v) = &mut moved {
            v[0] += 1;
        }
        assert_mentions(
            &delta.resolve("embed", &moved, &old).unwrap_err(),
            &["positions differ", "entry 0"],
        );
        let mut drifted = old.clone();
        drifted[0] ^= 4;
        let err = delta.resolve("embed", &positions, &drifted).unwrap_err();
        assert!(matches!(err, Error::WrongBase { .. }), "{err:?}");
    }
}

// ---------------------------------------------------------------------------
// Compressed (`planes`) anchors: accepted exactly when intact, refused with a
// named reason otherwise, and read to the same state as the raw anchor.

fn planes_anchor(set: &TensorSet, version: u64) -> Vec<u8> {
    weightcast::codec::encode_anchor_compressed(set, version)
        .unwrap()
        .0
}

#[test]
fn planes_anchor_reads_as_the_raw_anchor() {
    let fx = Fixture::new();
    for (v, s) in fx.sets.iter().enumerate() {
        let raw = encode_anchor(s, v as u64).unwrap().0;
        let packed = planes_anchor(s, v as u64);
        let (hr, a) = read_anchor(raw.clone()).unwrap();
        let (hp, b) = read_anchor(packed.clone()).unwrap();
        assert_eq!(hp.as_ref().unwrap().encoding, Encoding::Planes);
        assert_eq!(hr.unwrap().digest, hp.unwrap().digest);
        assert!(snapshot(&a) == snapshot(&b));
        let mut m = Vec::new();
        weightcast::codec::materialize_anchor(&packed, &mut m).unwrap();
        assert!(
            m == raw,
            "materialized planes anchor differs from the raw anchor"
        );
    }
}

#[test]
fn planes_anchor_with_a_bad_table_or_payload_is_refused() {
    let fx = Fixture::new();
    let a = planes_anchor(&fx.sets[1], 1);
    let table: Value = serde_json::from_str(&parse(&a).meta["weightcast.planes"]).unwrap();

    // Missing table, not JSON, a chunk size beyond the limit.
    anchor_err(
        &with_meta(&a, "weightcast.planes", None),
        &["weightcast.planes", "missing"],
    );
    anchor_err(
        &with_meta(&a, "weightcast.planes", Some("{")),
        &["weightcast.planes"],
    );
    let mut t = table.clone();
    t["chunk_words"] = json!(1u64 << 40);
    anchor_err(
        &with_meta(&a, "weightcast.planes", Some(&t.to_string())),
        &["chunk_words"],
    );
    // A plane claiming more bytes than its chunk has words.
    let mut t = table.clone();
    let (name, chunks) = t["tensors"]
        .as_object_mut()
        .unwrap()
        .iter_mut()
        .find(|(_, c)| !c.as_array().unwrap().is_empty())
        .unwrap();
    let name = name.clone();
    chunks[0][0] = json!(u64::MAX);
    anchor_err(
        &with_meta(&a, "weightcast.planes", Some(&t.to_string())),
        &["weightcast.planes", &name, "impossible"],
    );
    // Encoding `planes` on a delta, `full` with a table: not a planes anchor.
    let raw = encode_anchor(&fx.sets[1], 1).unwrap().0;
    assert!(
        read_anchor(with_meta(
            &raw,
            "weightcast.planes",
            Some(&table.to_string())
        ))
        .is_ok()
    );
    anchor_err(
        &with_meta(&a, "weightcast.kind", Some("delta")),
        &["weightcast.encoding"],
    );
    // Every data byte flipped in turn: refused (never a panic, never a wrong state).
    let start = a.len() - parse(&a).tensors.iter().map(|t| t.3.len()).sum::<usize>();
    for i in (start..a.len()).step_by(7) {
        let mut bad = a.clone();
        bad[i] ^= 0x10;
        anchor_err(&bad, &[]);
    }
    // Truncated.
    anchor_err(&a[..a.len() - 1], &[]);
}
