//! Round trips of the delta codec: random tensor sets of every byte-multiple
//! safetensors dtype (plus packed F4 for `compact`), random change densities and
//! bit patterns, version chains, far-apart changes in multi-block tensors,
//! foreign TRL files, and anchors.
//!
//! Every apply is checked byte for byte against the intended state, and every
//! digest against a fresh full pass. Every delta is also applied in place
//! (`apply_in_place`, with and without its buffer of decoded changes) and
//! through the device form (`Delta::changed_positions` + `Delta::resolve`),
//! which must give exactly what `apply_delta` gives.

use std::collections::BTreeMap;

use proptest::prelude::*;
use proptest::test_runner::Config;
use weightcast::Error;
use weightcast::codec::{
    Delta, DeltaOptions, InPlaceOptions, Target, apply_delta, apply_in_place_with, encode_anchor,
    encode_delta, inspect, prepare_in_place_all, read_anchor, tensor_digest_of,
};
use weightcast::dtype::{
    Dtype, from_key, is_packed, key_kind, read_word, to_key, word_bytes, word_mask, write_word,
};
use weightcast::format::Encoding;
use weightcast::format::Kind;
use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::tensors::{TensorSet, write_safetensors};

/// (name, dtype, shape, little-endian bytes), as `TensorSet::from_tensors` takes them.
type Owned = (String, Dtype, Vec<usize>, Vec<u8>);

/// Every safetensors dtype whose elements are whole bytes.
const BYTE_DTYPES: [Dtype; 19] = [
    Dtype::BOOL,
    Dtype::U8,
    Dtype::I8,
    Dtype::F8_E4M3,
    Dtype::F8_E5M2,
    Dtype::F8_E8M0,
    Dtype::F8_E4M3FNUZ,
    Dtype::F8_E5M2FNUZ,
    Dtype::I16,
    Dtype::U16,
    Dtype::F16,
    Dtype::BF16,
    Dtype::I32,
    Dtype::U32,
    Dtype::F32,
    Dtype::I64,
    Dtype::U64,
    Dtype::F64,
    Dtype::C64,
];

/// Tensor names, including ones that collide with payload suffixes of other
/// tensors (`a` / `a.compact` / `a.values` / `a.indices`).
const NAMES: [&str; 8] = [
    "a",
    "a.compact",
    "a.values",
    "a.indices",
    "model.layers.0.mlp.weight",
    "norm",
    "ünï/cödé",
    "z",
];

fn config(cases: u32) -> Config {
    Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    }
}

// ---------------------------------------------------------------------------
// Deterministic randomness for bulk data (proptest drives structure and seeds).

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Bit patterns worth hitting for `dtype`: zeros of both signs, NaNs with
/// payloads (quiet, signalling, negative), infinities, subnormals, extremes.
fn specials(dtype: Dtype) -> Vec<u64> {
    let wb = word_bytes(dtype);
    let mask = word_mask(wb);
    let sign = 1u64 << (wb * 8 - 1);
    let mut v = vec![0, 1, 2, sign, sign | 1, mask, mask - 1, mask >> 1, sign - 1];
    v.extend_from_slice(match dtype {
        Dtype::F32 => &[
            0x7fc0_0000,
            0x7fc0_0001,
            0xffc1_2345,
            0x7f80_0001,
            0xff80_0001,
            0x8000_0000,
            0x7f80_0000,
            0xff80_0000,
            0x0000_0001,
            0x8000_0001,
            0x807f_ffff,
            0x007f_ffff,
            0x0080_0000,
            0x7f7f_ffff,
            0x3f80_0000,
            0xbf80_0000,
        ],
        Dtype::F64 => &[
            0x7ff8_0000_0000_0000,
            0x7ff8_0000_0000_0001,
            0xfff8_dead_beef_0001,
            0x7ff0_0000_0000_0001,
            0x8000_0000_0000_0000,
            0x7ff0_0000_0000_0000,
            0xfff0_0000_0000_0000,
            0x0000_0000_0000_0001,
            0x800f_ffff_ffff_ffff,
            0x7fef_ffff_ffff_ffff,
            0x3ff0_0000_0000_0000,
        ],
        Dtype::F16 => &[
            0x7e00, 0x7e01, 0xfd01, 0x7c01, 0x8000, 0x7c00, 0xfc00, 0x0001, 0x8001, 0x83ff, 0x7bff,
            0x3c00,
        ],
        Dtype::BF16 => &[
            0x7fc0, 0x7fc1, 0xff81, 0x7f81, 0x8000, 0x7f80, 0xff80, 0x0001, 0x8001, 0x807f, 0x7f7f,
            0x3f80, 0xbf80,
        ],
        Dtype::F8_E4M3 => &[0x7f, 0xff, 0x80, 0x01, 0x81, 0x7e, 0x38],
        Dtype::F8_E5M2 => &[0x7c, 0xfc, 0x7d, 0xfe, 0x80, 0x01, 0x83, 0x3c],
        Dtype::F8_E4M3FNUZ | Dtype::F8_E5M2FNUZ => &[0x80, 0x01, 0x81, 0x7f, 0xff],
        Dtype::F8_E8M0 => &[0xff, 0x7f, 0x00, 0xfe],
        Dtype::C64 => &[
            0x7fc0_0001_8000_0000,
            0x8000_0000_8000_0000,
            0x7f80_0000_ff80_0000,
            0x0000_0001_7fc0_0000,
        ],
        _ => &[],
    });
    v.into_iter().map(|w| w & mask).collect()
}

/// Moves `old` by `step` in the dtype's ordered-key space (wrapping): for float
/// dtypes ±1 is one ulp towards ±infinity.
fn key_step(dtype: Dtype, old: u64, step: i64) -> u64 {
    let wb = word_bytes(dtype);
    let kind = key_kind(dtype);
    from_key(
        kind,
        wb,
        to_key(kind, wb, old).wrapping_add(step as u64) & word_mask(wb),
    )
}

/// Relative weights of the kinds of change a changed word gets.
#[derive(Clone, Copy, Debug)]
struct Mix {
    random: u32,
    special: u32,
    ulp: u32,
    big_step: u32,
}

fn mix_strategy() -> impl Strategy<Value = Mix> {
    (0u32..4, 0u32..4, 0u32..6, 0u32..3).prop_map(|(random, special, ulp, big_step)| {
        let mut m = Mix {
            random,
            special,
            ulp,
            big_step,
        };
        if random + special + ulp + big_step == 0 {
            m.ulp = 1;
        }
        m
    })
}

fn mutate_word(dtype: Dtype, old: u64, mix: Mix, rng: &mut Rng) -> u64 {
    let wb = word_bytes(dtype);
    let bits = wb as u32 * 8;
    let mask = word_mask(wb);
    let total = (mix.random + mix.special + mix.ulp + mix.big_step) as u64;
    let mut r = rng.below(total) as u32;
    if r < mix.random {
        return rng.next() & mask;
    }
    r -= mix.random;
    if r < mix.special {
        let s = specials(dtype);
        return s[rng.below(s.len() as u64) as usize];
    }
    r -= mix.special;
    if r < mix.ulp {
        let step = [1i64, -1, 2, -2][rng.below(4) as usize];
        return key_step(dtype, old, step);
    }
    // A large step: random magnitude up to the whole key range, or exactly half of it.
    let mag = if rng.chance(0.2) {
        1u64 << (bits - 1)
    } else {
        (rng.next() & mask) >> rng.below(bits as u64)
    };
    let step = if rng.chance(0.5) {
        mag as i64
    } else {
        (mag as i64).wrapping_neg()
    };
    key_step(dtype, old, step)
}

/// A copy of `data` where each word changes with probability `density`.
fn mutate(dtype: Dtype, data: &[u8], density: f64, mix: Mix, rng: &mut Rng) -> Vec<u8> {
    let wb = word_bytes(dtype);
    let mut out = data.to_vec();
    for i in 0..data.len() / wb {
        if rng.chance(density) {
            let old = read_word(data, wb, i);
            write_word(&mut out, wb, i, mutate_word(dtype, old, mix, rng));
        }
    }
    out
}

fn evolve(items: &[Owned], density: f64, mix: Mix, rng: &mut Rng) -> Vec<Owned> {
    items
        .iter()
        .map(|(n, d, s, b)| (n.clone(), *d, s.clone(), mutate(*d, b, density, mix, rng)))
        .collect()
}

fn fill(spec: &[(String, Dtype, Vec<usize>)], rng: &mut Rng) -> Vec<Owned> {
    spec.iter()
        .map(|(n, d, s)| {
            let len = weightcast::dtype::byte_len(*d, s).expect("valid shape");
            (n.clone(), *d, s.clone(), rng.bytes(len))
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Strategies for tensor-set structure.

fn dtype_strategy(packed: bool) -> impl Strategy<Value = Dtype> {
    let mut v = BYTE_DTYPES.to_vec();
    if packed {
        v.push(Dtype::F4);
        v.push(Dtype::F4);
    }
    proptest::sample::select(v)
}

fn shape_strategy() -> BoxedStrategy<Vec<usize>> {
    prop_oneof![
        // 0-d scalar
        2 => Just(Vec::<usize>::new()),
        // empty: some dimension is 0
        1 => (prop::collection::vec(0usize..5, 0..3), 0usize..3).prop_map(|(mut s, at)| {
            let at = at.min(s.len());
            s.insert(at, 0);
            s
        }),
        6 => prop::collection::vec(1usize..7, 1..4),
        2 => (1usize..700).prop_map(|n| vec![n]),
    ]
    .boxed()
}

/// 1 to 5 tensors with random dtypes and shapes; F4 tensors get an even element count.
fn set_spec(packed: bool) -> impl Strategy<Value = Vec<(String, Dtype, Vec<usize>)>> {
    (
        prop::collection::vec((dtype_strategy(packed), shape_strategy()), 1..6),
        Just(NAMES.to_vec()).prop_shuffle(),
    )
        .prop_map(|(ts, names)| {
            ts.into_iter()
                .zip(names)
                .map(|((d, mut s), n)| {
                    if is_packed(d) && s.iter().product::<usize>() % 2 == 1 {
                        match s.last_mut() {
                            Some(last) => *last *= 2,
                            None => s = vec![2],
                        }
                    }
                    (n.to_string(), d, s)
                })
                .collect()
        })
}

fn density_strategy() -> impl Strategy<Value = f64> {
    prop_oneof![
        1 => Just(0.0),
        1 => Just(1.0),
        2 => 0.0..0.05f64,
        4 => 0.0..=1.0f64,
    ]
}

// ---------------------------------------------------------------------------
// Checks.

/// `set` with digests recomputed by a full pass.
fn fresh(set: &TensorSet) -> TensorSet {
    let mut s = set.clone();
    s.compute_digests();
    s
}

/// Same names, dtypes, shapes, bytes and per-tensor digests; the digests of `a`
/// are also checked against a full pass over its bytes.
#[track_caller]
fn assert_same_state(a: &TensorSet, b: &TensorSet) {
    assert_eq!(a.len(), b.len());
    let full = fresh(a);
    for (i, (ta, tb)) in a.tensors().iter().zip(b.tensors()).enumerate() {
        assert_eq!(ta.name, tb.name);
        assert_eq!(ta.dtype, tb.dtype, "{}", ta.name);
        assert_eq!(ta.shape, tb.shape, "{}", ta.name);
        assert!(a.data(i) == b.data(i), "bytes of `{}` differ", ta.name);
        assert_eq!(ta.digest, tb.digest, "digest of `{}`", ta.name);
        assert_eq!(
            ta.digest,
            full.tensors()[i].digest,
            "incremental digest of `{}` differs from a full pass",
            ta.name
        );
    }
    assert_eq!(a.digest(), b.digest());
    assert_eq!(a.digest(), full.digest());
}

/// Changed words per tensor between two item lists (same structure).
fn changed_words(a: &[Owned], b: &[Owned]) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for (x, y) in a.iter().zip(b) {
        let wb = word_bytes(x.1);
        let n = (0..x.3.len() / wb)
            .filter(|&i| read_word(&x.3, wb, i) != read_word(&y.3, wb, i))
            .count() as u64;
        if n > 0 {
            out.insert(x.0.clone(), n);
        }
    }
    out
}

fn opts(encoding: Encoding, model_version: u64) -> DeltaOptions {
    DeltaOptions {
        encoding,
        model_version,
        base_version: model_version - 1,
        // These tests predate TRL v3 and check v1's layout; tests/it/trl.rs covers v3.
        trl: weightcast::format::TrlOptions::V1,
        // The encoding asked for at every density.
        compact2_max_density: 1.0,
    }
}

/// Encodes `base → new_items` with `encoding`, applies it to a copy of `base` and
/// checks everything. Returns the delta and the new set (with its digests), or
/// `None` when TRL correctly refused a packed dtype.
fn delta_round_trip(
    base: &TensorSet,
    base_items: &[Owned],
    new_items: &[Owned],
    encoding: Encoding,
    version: u64,
) -> Option<(Vec<u8>, TensorSet)> {
    let mut new = TensorSet::from_tensors_unhashed(new_items.to_vec()).unwrap();
    let result = encode_delta(base, &mut new, &opts(encoding, version));
    let packed: Vec<&str> = base
        .tensors()
        .iter()
        .filter(|t| is_packed(t.dtype))
        .map(|t| t.name.as_str())
        .collect();
    if encoding == Encoding::Trl && !packed.is_empty() {
        match &result {
            Err(
                e @ Error::Unsupported {
                    encoding: "trl",
                    tensor,
                    ..
                },
            ) => {
                assert!(packed.contains(&tensor.as_str()), "{tensor}");
                let msg = e.to_string();
                assert!(
                    msg.contains("trl") && msg.contains(tensor.as_str()),
                    "{msg}"
                );
                return None;
            }
            other => panic!("trl must refuse packed tensors {packed:?}, got {other:?}"),
        }
    }
    let (bytes, summary) = result.unwrap();
    let expect = changed_words(base_items, new_items);
    let total_changed: u64 = expect.values().sum();
    let total_words: u64 = base.tensors().iter().map(|t| t.words() as u64).sum();
    assert_eq!(summary.changed, total_changed);
    assert_eq!(summary.total, total_words);
    assert_eq!(summary.changed_tensors, expect.len());
    assert_eq!(summary.bytes, bytes.len() as u64);
    assert_eq!(summary.encoding, encoding);
    assert!(new.has_digests());
    assert_eq!(summary.digest, new.digest().to_string());

    // The header describes the delta truthfully.
    let (meta, header) = inspect(&bytes).unwrap();
    let h = header.expect("weightcast header");
    assert_eq!(h.kind, Kind::Delta);
    assert_eq!(h.encoding, encoding);
    assert_eq!(h.base_digest, Some(base.digest()));
    assert_eq!(h.digest, new.digest());
    assert_eq!(h.tensor_count, base.len() as u64);
    assert_eq!(h.total_elements, base.total_elements());
    assert_eq!(h.changed_elements, total_changed);
    assert_eq!(
        h.tensors.keys().cloned().collect::<Vec<_>>(),
        expect.keys().cloned().collect::<Vec<_>>()
    );
    for (name, e) in &h.tensors {
        let i = base.position(name).unwrap();
        let t = &base.tensors()[i];
        assert_eq!(e.changed, expect[name], "{name}");
        assert_eq!(e.dtype, t.dtype.to_string());
        assert_eq!(e.elements, t.elements());
        assert_eq!(e.digest, new.tensors()[i].digest.to_string());
        assert_eq!(e.base_digest, Some(t.digest.to_string()));
        assert_eq!(e.blocks.is_some(), encoding == Encoding::Compact);
    }
    if encoding == Encoding::Trl {
        let names: Vec<String> = serde_json::from_str(&meta["changed_params"]).unwrap();
        assert_eq!(names, expect.keys().cloned().collect::<Vec<_>>());
        assert_eq!(meta["format"], "sparse_weight_patch");
        assert_eq!(meta["sparse"], "True");
        assert_eq!(meta["total_changed_elements"], total_changed.to_string());
    }

    // The encoder's incremental digests of `new` equal a full pass.
    let full = fresh(&new);
    for (t, f) in new.tensors().iter().zip(full.tensors()) {
        assert_eq!(t.digest, f.digest, "encoder digest of `{}`", t.name);
    }

    let mut replica = base.clone();
    let report = apply_delta(&mut replica, &bytes).unwrap();
    assert!(report.verified);
    assert_eq!(report.encoding, encoding);
    assert_eq!(report.changed, total_changed);
    assert_eq!(report.model_version, Some(version));
    assert_eq!(report.base_version, Some(version - 1));
    let mut names = report.changed_tensors.clone();
    names.sort();
    assert_eq!(names, expect.keys().cloned().collect::<Vec<_>>());
    assert_same_state(&replica, &new);
    in_place_round_trip(base, &bytes, &new);
    Some((bytes, new))
}

/// The targets of [`TensorSet`] `set`'s tensors, over `bufs` (their bytes).
pub(crate) fn targets<'a>(set: &'a TensorSet, bufs: &'a mut [Vec<u8>]) -> Vec<Target<'a>> {
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

/// Copies of every tensor's bytes.
pub(crate) fn buffers(set: &TensorSet) -> Vec<Vec<u8>> {
    (0..set.len()).map(|i| set.data(i).to_vec()).collect()
}

/// `bytes` (a delta from `base` to `want`) applied in place to copies of
/// `base`'s tensors, with and without the buffer of decoded changes, and
/// through the device form: every result must be exactly `want`, and the
/// report's digest changes `want`'s minus `base`'s.
#[track_caller]
fn in_place_round_trip(base: &TensorSet, bytes: &[u8], want: &TensorSet) {
    // Every change kept, none (every block decoded twice), and, for small
    // sets, a budget that keeps only some blocks.
    let mut budgets = vec![InPlaceOptions::default().keep_bytes, 0];
    if base.total_bytes() < 1 << 20 {
        budgets.push(37);
    }
    for keep_bytes in budgets {
        let mut bufs = buffers(base);
        let report = apply_in_place_with(
            &mut targets(base, &mut bufs),
            bytes,
            &InPlaceOptions { keep_bytes },
        )
        .unwrap();
        for (i, b) in bufs.iter().enumerate() {
            assert!(
                b == want.data(i),
                "in place (keep {keep_bytes}): `{}` differs",
                base.tensors()[i].name
            );
        }
        if keep_bytes == 0 {
            assert_eq!(report.kept, 0);
        }
        for t in &report.tensors {
            let i = base.position(&t.name).unwrap();
            let (b, w) = (base.tensors()[i].digest, want.tensors()[i].digest);
            assert_eq!((t.base_digest, t.digest), (b, w), "{}", t.name);
            assert_eq!(t.digest_change, w.wrapping_sub(b));
        }
        assert_eq!(
            report.changed,
            report.tensors.iter().map(|t| t.changed).sum::<u64>()
        );
    }
    // Prepared, then committed: the same bytes and reports, and nothing
    // written by the prepare. TRL deltas are refused by name (applied in one
    // call instead).
    let mut bufs = buffers(base);
    match prepare_in_place_all(&mut targets(base, &mut bufs), &[bytes]) {
        Ok(prepared) => {
            assert!(
                bufs.iter().enumerate().all(|(i, b)| b == base.data(i)),
                "prepare wrote"
            );
            let changed = prepared.changed();
            let reports = prepared.commit(&mut targets(base, &mut bufs)).unwrap();
            for (i, b) in bufs.iter().enumerate() {
                assert!(
                    b == want.data(i),
                    "prepared: `{}` differs",
                    base.tensors()[i].name
                );
            }
            assert_eq!(reports.len(), 1);
            assert_eq!(reports[0].changed, changed);
            for t in &reports[0].tensors {
                let i = base.position(&t.name).unwrap();
                assert_eq!(t.digest, want.tensors()[i].digest, "{}", t.name);
            }
        }
        Err(e) => {
            let encoding = Delta::parse(bytes).unwrap().header().encoding;
            assert_eq!(
                encoding,
                Encoding::Trl,
                "prepare refused a {encoding} delta: {e}"
            );
            assert!(matches!(e, Error::Unsupported { .. }), "{e:?}");
        }
    }
    // The device form: positions, old words gathered there, new words back.
    let delta = Delta::parse(bytes).unwrap();
    for name in delta.header().tensors.keys() {
        let i = base.position(name).unwrap();
        let wb = word_bytes(base.tensors()[i].dtype);
        let positions = delta.changed_positions(name).unwrap();
        assert_eq!(positions.len() as u64, delta.header().tensors[name].changed);
        let old: Vec<u8> = (0..positions.len())
            .flat_map(|j| {
                let p = positions.get(j).unwrap() as usize;
                base.data(i)[p * wb..p * wb + wb].to_vec()
            })
            .collect();
        let new = delta.resolve(name, &positions, &old).unwrap();
        let mut patched = base.data(i).to_vec();
        for j in 0..positions.len() {
            let p = positions.get(j).unwrap() as usize;
            patched[p * wb..p * wb + wb].copy_from_slice(&new[j * wb..j * wb + wb]);
        }
        assert!(patched == want.data(i), "resolve: `{name}` differs");
    }
}

// ---------------------------------------------------------------------------
// Property tests.

proptest! {
    #![proptest_config(config(64))]

    /// One delta between random sets, both encodings.
    #[test]
    fn random_sets_round_trip(
        spec in set_spec(true),
        seed in any::<u64>(),
        density in density_strategy(),
        mix in mix_strategy(),
    ) {
        let mut rng = Rng(seed);
        let v0 = fill(&spec, &mut rng);
        let v1 = evolve(&v0, density, mix, &mut rng);
        let base = TensorSet::from_tensors(v0.clone()).unwrap();
        for encoding in [Encoding::Compact, Encoding::Trl] {
            delta_round_trip(&base, &v0, &v1, encoding, 1);
        }
    }

    /// Only small key-order moves (±1/±2 ulp for floats) on float tensors: the
    /// `step` value coding.
    #[test]
    fn ulp_moves_round_trip(
        dtype in proptest::sample::select(vec![
            Dtype::BF16, Dtype::F32, Dtype::F16, Dtype::F64, Dtype::F8_E4M3, Dtype::F8_E5M2,
        ]),
        len in 1usize..3000,
        seed in any::<u64>(),
        density in density_strategy(),
        specials_share in 0u32..2,
    ) {
        let mut rng = Rng(seed);
        let v0 = vec![("w".to_string(), dtype, vec![len], rng.bytes(len * word_bytes(dtype)))];
        let mix = Mix { random: 0, special: specials_share, ulp: 8, big_step: 0 };
        let v1 = evolve(&v0, density, mix, &mut rng);
        let base = TensorSet::from_tensors(v0.clone()).unwrap();
        for encoding in [Encoding::Compact, Encoding::Trl] {
            delta_round_trip(&base, &v0, &v1, encoding, 1);
        }
    }

    /// v0 → v1 → v2 → v3 applied in order to one replica, encodings mixed.
    #[test]
    fn chains_round_trip(
        spec in set_spec(true),
        seed in any::<u64>(),
        steps in prop::collection::vec((density_strategy(), mix_strategy(), any::<bool>()), 3),
    ) {
        let mut rng = Rng(seed);
        let items0 = fill(&spec, &mut rng);
        let has_packed = spec.iter().any(|t| is_packed(t.1));
        let v0 = TensorSet::from_tensors(items0.clone()).unwrap();
        let mut versions = vec![(items0, v0.clone())];
        let mut deltas = Vec::new();
        for (k, (density, mix, trl)) in steps.into_iter().enumerate() {
            let encoding = if trl && !has_packed { Encoding::Trl } else { Encoding::Compact };
            let (prev_items, prev) = versions.last().unwrap();
            let next_items = evolve(prev_items, density, mix, &mut rng);
            let (delta, next) =
                delta_round_trip(prev, prev_items, &next_items, encoding, k as u64 + 1).unwrap();
            deltas.push(delta);
            versions.push((next_items, next));
        }
        // One replica, starting from v0 loaded through an anchor.
        let (anchor, _) = encode_anchor(&v0, 0).unwrap();
        let (header, mut replica) = read_anchor(anchor).unwrap();
        prop_assert!(header.is_some());
        for (k, d) in deltas.iter().enumerate() {
            let report = apply_delta(&mut replica, d).unwrap();
            prop_assert!(report.verified);
            prop_assert_eq!(report.model_version, Some(k as u64 + 1));
            assert_same_state(&replica, &versions[k + 1].1);
        }
        // Replaying an earlier delta on v3 fails without touching the state.
        for (k, d) in deltas.iter().enumerate() {
            if versions[k].1.digest() == versions[3].1.digest() {
                continue;
            }
            let before = replica.clone();
            let err = apply_delta(&mut replica, d).unwrap_err();
            prop_assert!(matches!(err, Error::WrongBase { .. }), "{:?}", err);
            assert_same_state(&replica, &before);
        }
    }

    /// encode_anchor → read_anchor keeps bytes and digests, verified.
    #[test]
    fn anchors_round_trip(spec in set_spec(true), seed in any::<u64>(), version in any::<u64>()) {
        let mut rng = Rng(seed);
        let set = TensorSet::from_tensors(fill(&spec, &mut rng)).unwrap();
        let (bytes, summary) = encode_anchor(&set, version).unwrap();
        prop_assert_eq!(summary.bytes, bytes.len() as u64);
        prop_assert_eq!(summary.tensors, set.len());
        prop_assert_eq!(&summary.digest, &set.digest().to_string());
        let (header, loaded) = read_anchor(bytes).unwrap();
        let header = header.expect("anchors carry a weightcast header");
        prop_assert_eq!(header.model_version, version);
        prop_assert_eq!(header.digest, set.digest());
        prop_assert_eq!(header.tensor_count, set.len() as u64);
        prop_assert_eq!(loaded.metadata().get("format").map(String::as_str), Some("pt"));
        assert_same_state(&loaded, &set);
    }
}

// ---------------------------------------------------------------------------
// Deterministic cases.

/// Changes millions of words apart: gaps beyond 65535 and beyond the 2^22-word
/// block, blocks without any change, changes on both sides of block borders.
#[test]
fn far_apart_changes_in_large_tensors() {
    const BLOCK: usize = 1 << 22;
    let cases: [(Dtype, usize, Vec<usize>); 4] = [
        // One change near each end: the gap spans the whole empty middle block.
        (Dtype::U8, 10_000_000, vec![3, 9_999_000]),
        (
            Dtype::U8,
            10_000_000,
            vec![
                0,
                1,
                65_537,
                65_537 + 65_536 + 5,
                BLOCK - 1,
                BLOCK,
                BLOCK + 70_000,
                2 * BLOCK + 1_000_000,
                9_999_999,
            ],
        ),
        (Dtype::BF16, 5_000_000, vec![2, 4_900_000]),
        (
            Dtype::BF16,
            5_000_000,
            vec![65_536, 200_000, BLOCK - 1, BLOCK, 4_999_999],
        ),
    ];
    for (dtype, n, positions) in cases {
        let wb = word_bytes(dtype);
        let mut rng = Rng(n as u64 ^ positions.len() as u64);
        let base_bytes: Vec<u8> = (0..n * wb)
            .map(|i| (i as u8) ^ ((i >> 9) as u8) ^ 0x3c)
            .collect();
        let mut new_bytes = base_bytes.clone();
        for (j, &p) in positions.iter().enumerate() {
            let old = read_word(&base_bytes, wb, p);
            let new = if j % 2 == 0 {
                key_step(dtype, old, if j % 4 == 0 { 1 } else { -1 })
            } else {
                let mut w = rng.next() & word_mask(wb);
                if w == old {
                    w ^= 1;
                }
                w
            };
            write_word(&mut new_bytes, wb, p, new);
        }
        let v0 = vec![("big".to_string(), dtype, vec![n], base_bytes)];
        let v1 = vec![("big".to_string(), dtype, vec![n], new_bytes)];
        let base = TensorSet::from_tensors(v0.clone()).unwrap();
        for encoding in [Encoding::Compact, Encoding::Trl] {
            let (bytes, _) = delta_round_trip(&base, &v0, &v1, encoding, 7).unwrap();
            if encoding == Encoding::Compact {
                // A handful of changes: the delta stays tiny however far apart they are.
                assert!(bytes.len() < 4096, "{} bytes", bytes.len());
            }
        }
    }
}

/// `step` coding with the largest magnitudes a word allows (half the key range,
/// which is its own negation) next to many ±1 steps, for every word width.
#[test]
fn step_coding_with_extreme_magnitudes() {
    for dtype in [
        Dtype::F8_E4M3,
        Dtype::BF16,
        Dtype::F32,
        Dtype::F64,
        Dtype::U64,
    ] {
        let wb = word_bytes(dtype);
        let bits = wb as u32 * 8;
        let n = 2000usize;
        let mut rng = Rng(bits as u64);
        let base_bytes = rng.bytes(n * wb);
        let mut new_bytes = base_bytes.clone();
        let half = 1i64.wrapping_shl(bits - 1);
        for i in (0..n).step_by(2) {
            let old = read_word(&base_bytes, wb, i);
            let step = match i {
                10 => half,                 // exactly half the key range
                20 => half.wrapping_sub(1), // just below it
                30 => -(half.wrapping_sub(1)),
                40 => (1i64 << (bits.min(63) - 2)) + 12345,
                _ => [1, -1, 2, -2][i / 2 % 4],
            };
            write_word(&mut new_bytes, wb, i, key_step(dtype, old, step));
        }
        let v0 = vec![("w".to_string(), dtype, vec![n], base_bytes)];
        let v1 = vec![("w".to_string(), dtype, vec![n], new_bytes)];
        let base = TensorSet::from_tensors(v0.clone()).unwrap();
        let (bytes, _) = delta_round_trip(&base, &v0, &v1, Encoding::Compact, 1).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let tensors = &meta.metadata().as_ref().unwrap()["weightcast.tensors"];
        assert!(
            tensors.contains("\"values\":\"step\""),
            "{dtype}: expected step coding, header {tensors}"
        );
        delta_round_trip(&base, &v0, &v1, Encoding::Trl, 1).unwrap();
    }
}

/// A replica whose digests were never computed gets them on the first apply.
#[test]
fn apply_to_a_state_without_digests() {
    let mut rng = Rng(12);
    let spec = vec![
        ("a".to_string(), Dtype::BF16, vec![40]),
        ("b".to_string(), Dtype::I32, vec![3]),
    ];
    let v0 = fill(&spec, &mut rng);
    let mix = Mix {
        random: 1,
        special: 1,
        ulp: 1,
        big_step: 1,
    };
    let v1 = evolve(&v0, 0.3, mix, &mut rng);
    let base = TensorSet::from_tensors(v0.clone()).unwrap();
    for encoding in [Encoding::Compact, Encoding::Trl] {
        let (delta, new) = delta_round_trip(&base, &v0, &v1, encoding, 1).unwrap();
        let mut replica = TensorSet::from_tensors_unhashed(v0.clone()).unwrap();
        assert!(!replica.has_digests());
        assert!(apply_delta(&mut replica, &delta).unwrap().verified);
        assert_same_state(&replica, &new);
    }
}

/// A delta between identical versions: no tensor entries, no payload, applies.
#[test]
fn unchanged_version_round_trips() {
    let mut rng = Rng(11);
    let spec = vec![
        ("a".to_string(), Dtype::BF16, vec![4, 4]),
        ("b".to_string(), Dtype::F32, vec![]),
        ("c".to_string(), Dtype::U8, vec![0, 3]),
    ];
    let v0 = fill(&spec, &mut rng);
    let base = TensorSet::from_tensors(v0.clone()).unwrap();
    for encoding in [Encoding::Compact, Encoding::Trl] {
        let (bytes, new) = delta_round_trip(&base, &v0, &v0, encoding, 3).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.len(), 0);
        assert_eq!(new.digest(), base.digest());
    }
}

/// Deltas along the synthetic RL generator's trajectory, replayed on a replica
/// loaded from an anchor file on disk.
#[test]
fn generator_chain_through_anchor_file() {
    let mut g = Generator::new(GeneratorConfig::tiny(5));
    let v0 = g.snapshot();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("anchor-0.safetensors");
    std::fs::write(&path, encode_anchor(&v0, 0).unwrap().0).unwrap();
    let (h, mut replica) = read_anchor(std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(h.unwrap().model_version, 0);
    let mut prev = v0;
    for k in 1..=3u64 {
        g.step();
        let mut next = g.snapshot_without_digests();
        let encoding = if k % 2 == 0 {
            Encoding::Trl
        } else {
            Encoding::Compact
        };
        let (delta, summary) = encode_delta(&prev, &mut next, &opts(encoding, k)).unwrap();
        assert!(summary.changed > 0);
        let report = apply_delta(&mut replica, &delta).unwrap();
        assert!(report.verified);
        assert_same_state(&replica, &next);
        prev = next;
    }
}

/// Generator models (bf16, and the same model as f32 and f16), both
/// encodings: in place, with and without the buffer, and the device form equal
/// `apply_delta` bit for bit; the full-verification helper agrees with the
/// header's digests.
#[test]
fn in_place_equals_apply_delta_on_generator_models() {
    let mut g = Generator::new(GeneratorConfig::tiny(9));
    g.step();
    let v0 = g.snapshot();
    g.step();
    let v1 = g.snapshot_without_digests();
    // The same weights as other float dtypes (f32: bf16 widened; f16: the
    // bf16 bits reinterpreted, any pattern is fine for a bytewise codec).
    let widen = |set: &TensorSet, dtype: Dtype| -> Vec<Owned> {
        set.tensors()
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let data = set.data(i);
                let bytes = match dtype {
                    Dtype::F32 => data
                        .chunks(2)
                        .map(|c| (u16::from_le_bytes([c[0], c[1]]) as u32) << 16)
                        .flat_map(u32::to_le_bytes)
                        .collect(),
                    _ => data.to_vec(),
                };
                (t.name.clone(), dtype, t.shape.clone(), bytes)
            })
            .collect()
    };
    for dtype in [Dtype::BF16, Dtype::F32, Dtype::F16] {
        let (i0, i1) = (widen(&v0, dtype), widen(&v1, dtype));
        let base = TensorSet::from_tensors(i0.clone()).unwrap();
        for encoding in [Encoding::Compact, Encoding::Trl] {
            let (bytes, new) = delta_round_trip(&base, &i0, &i1, encoding, 1).unwrap();
            let (_, h) = inspect(&bytes).unwrap();
            for (name, e) in &h.unwrap().tensors {
                let i = new.position(name).unwrap();
                let t = &new.tensors()[i];
                let d = tensor_digest_of(name, t.dtype, &t.shape, new.data(i)).unwrap();
                assert_eq!(d.to_string(), e.digest, "{name}");
            }
        }
    }
    let t = &v0.tensors()[0];
    assert!(tensor_digest_of(&t.name, t.dtype, &t.shape, &v0.data(0)[1..]).is_err());
}

#[test]
fn trl_refuses_packed_dtypes_compact_takes_them() {
    let v0 = vec![
        (
            "f4".to_string(),
            Dtype::F4,
            vec![3, 2],
            vec![0x12, 0x34, 0x56],
        ),
        ("w".to_string(), Dtype::BF16, vec![2], vec![1, 2, 3, 4]),
    ];
    let mut v1 = v0.clone();
    v1[0].3[1] = 0x35;
    v1[1].3[0] = 9;
    let base = TensorSet::from_tensors(v0.clone()).unwrap();
    let mut new = TensorSet::from_tensors_unhashed(v1.clone()).unwrap();
    let err = encode_delta(&base, &mut new, &opts(Encoding::Trl, 1)).unwrap_err();
    assert!(
        matches!(&err, Error::Unsupported { encoding: "trl", tensor, .. } if tensor == "f4"),
        "{err:?}"
    );
    assert!(err.to_string().contains("f4"), "{err}");
    // Even when the packed tensor itself did not change.
    let mut v2 = v0.clone();
    v2[1].3[0] = 9;
    let mut new = TensorSet::from_tensors_unhashed(v2).unwrap();
    let err = encode_delta(&base, &mut new, &opts(Encoding::Trl, 1)).unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err:?}");
    delta_round_trip(&base, &v0, &v1, Encoding::Compact, 1).unwrap();
}

#[test]
fn encode_refuses_full_encoding_and_structure_changes() {
    let v0 = vec![("w".to_string(), Dtype::BF16, vec![2], vec![1, 2, 3, 4])];
    // Without digests a set can be neither the base of a delta nor an anchor.
    let unhashed = TensorSet::from_tensors_unhashed(v0.clone()).unwrap();
    let mut same = TensorSet::from_tensors(v0.clone()).unwrap();
    let err = encode_delta(&unhashed, &mut same, &opts(Encoding::Compact, 1)).unwrap_err();
    assert!(err.to_string().contains("digests"), "{err}");
    let err = encode_anchor(&unhashed, 1).unwrap_err();
    assert!(err.to_string().contains("digests"), "{err}");

    let base = TensorSet::from_tensors(v0.clone()).unwrap();
    let mut same = TensorSet::from_tensors(v0).unwrap();
    let err = encode_delta(&base, &mut same, &opts(Encoding::Full, 1)).unwrap_err();
    assert!(err.to_string().contains("weightcast.encoding"), "{err}");

    for other in [
        vec![("w".to_string(), Dtype::F16, vec![2], vec![1, 2, 3, 4])],
        vec![("w".to_string(), Dtype::BF16, vec![1, 2], vec![1, 2, 3, 4])],
        vec![("v".to_string(), Dtype::BF16, vec![2], vec![1, 2, 3, 4])],
        vec![
            ("w".to_string(), Dtype::BF16, vec![2], vec![1, 2, 3, 4]),
            ("x".to_string(), Dtype::U8, vec![1], vec![1]),
        ],
    ] {
        let mut new = TensorSet::from_tensors(other).unwrap();
        for encoding in [Encoding::Compact, Encoding::Trl] {
            let err = encode_delta(&base, &mut new, &opts(encoding, 1)).unwrap_err();
            assert!(matches!(err, Error::StructureChanged(_)), "{err:?}");
        }
    }
}

// ---------------------------------------------------------------------------
// TRL files written by other tools.

#[derive(Clone, Copy)]
struct Foreign {
    index_dtype: Dtype,
    changed_params: bool,
    model_version: bool,
    /// Also list one index whose value does not change (TRL writers may).
    noop_index: bool,
    /// Write `.values` before `.indices` in the file.
    values_first: bool,
}

/// A TRL `sparse_weight_patch` file as another tool would write it: only the TRL
/// metadata keys, absolute values, I32 or I64 indices.
fn foreign_trl(base: &[Owned], new: &[Owned], f: Foreign) -> (Vec<u8>, u64) {
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut names = Vec::new();
    let mut count = 0u64;
    for (b, n) in base.iter().zip(new) {
        let wb = word_bytes(b.1);
        let mut idx: Vec<usize> = (0..b.3.len() / wb)
            .filter(|&i| read_word(&b.3, wb, i) != read_word(&n.3, wb, i))
            .collect();
        if idx.is_empty() {
            continue;
        }
        if f.noop_index
            && let Some(extra) = (0..b.3.len() / wb).find(|i| !idx.contains(i))
        {
            idx.push(extra);
            idx.sort();
        }
        count += idx.len() as u64;
        let mut ib = Vec::new();
        let mut vb = Vec::new();
        for &i in &idx {
            match f.index_dtype {
                Dtype::I32 => ib.extend_from_slice(&(i as i32).to_le_bytes()),
                _ => ib.extend_from_slice(&(i as i64).to_le_bytes()),
            }
            vb.extend_from_slice(&n.3[i * wb..(i + 1) * wb]);
        }
        let ind = (
            format!("{}.indices", b.0),
            f.index_dtype,
            vec![idx.len()],
            ib,
        );
        let val = (format!("{}.values", b.0), b.1, vec![idx.len()], vb);
        if f.values_first {
            owned.push(val);
            owned.push(ind);
        } else {
            owned.push(ind);
            owned.push(val);
        }
        names.push(b.0.clone());
    }
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), "sparse_weight_patch".to_string());
    meta.insert("version".to_string(), "1".to_string());
    meta.insert("sparse".to_string(), "True".to_string());
    if f.model_version {
        meta.insert("model_version".to_string(), "42".to_string());
    }
    if f.changed_params {
        meta.insert(
            "changed_params".to_string(),
            serde_json::to_string(&names).unwrap(),
        );
        meta.insert("num_changed_params".to_string(), names.len().to_string());
    }
    meta.insert("total_changed_elements".to_string(), count.to_string());
    let views: Vec<(&str, Dtype, &[usize], &[u8])> = owned
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    let mut out = Vec::new();
    write_safetensors(&views, &meta, &mut out).unwrap();
    (out, count)
}

fn foreign_fixture() -> (Vec<Owned>, Vec<Owned>) {
    let mut rng = Rng(99);
    let spec = vec![
        ("model.embed".to_string(), Dtype::BF16, vec![8, 16]),
        ("model.norm".to_string(), Dtype::F32, vec![16]),
        ("scale".to_string(), Dtype::F64, vec![]),
        ("steps".to_string(), Dtype::I64, vec![3]),
        ("untouched".to_string(), Dtype::U8, vec![5]),
        ("empty".to_string(), Dtype::F16, vec![0]),
        ("a.values".to_string(), Dtype::I8, vec![4]),
    ];
    let v0 = fill(&spec, &mut rng);
    let mut v1 = v0.clone();
    for t in v1.iter_mut() {
        if t.0 != "untouched" {
            t.3 = mutate(
                t.1,
                &t.3,
                0.3,
                Mix {
                    random: 1,
                    special: 1,
                    ulp: 2,
                    big_step: 0,
                },
                &mut rng,
            );
        }
    }
    // Make sure the 0-d tensor and the I8 one change.
    v1[2].3[7] ^= 0x40;
    v1[6].3[0] ^= 0x01;
    (v0, v1)
}

#[test]
fn foreign_trl_files_apply_unverified_and_exact() {
    let (v0, v1) = foreign_fixture();
    let base = TensorSet::from_tensors(v0.clone()).unwrap();
    let target = TensorSet::from_tensors(v1.clone()).unwrap();
    let expect = changed_words(&v0, &v1);
    for index_dtype in [Dtype::I32, Dtype::I64] {
        for changed_params in [true, false] {
            for (model_version, noop_index, values_first) in [
                (true, false, false),
                (false, true, true),
                (true, true, false),
            ] {
                let f = Foreign {
                    index_dtype,
                    changed_params,
                    model_version,
                    noop_index,
                    values_first,
                };
                let (file, count) = foreign_trl(&v0, &v1, f);
                let mut replica = base.clone();
                let report = apply_delta(&mut replica, &file).unwrap();
                assert!(!report.verified, "foreign files carry no digests");
                assert_eq!(report.encoding, Encoding::Trl);
                assert_eq!(report.base_version, None);
                assert_eq!(
                    report.model_version,
                    if model_version { Some(42) } else { None }
                );
                assert_eq!(report.changed, count);
                let mut names = report.changed_tensors.clone();
                names.sort();
                assert_eq!(names, expect.keys().cloned().collect::<Vec<_>>());
                assert_same_state(&replica, &target);
            }
        }
    }
}

/// A weightcast TRL delta stripped of every `weightcast.*` key is a valid
/// foreign TRL file.
#[test]
fn weightcast_trl_without_weightcast_keys_is_a_foreign_file() {
    let (v0, v1) = foreign_fixture();
    let base = TensorSet::from_tensors(v0).unwrap();
    let mut new = TensorSet::from_tensors_unhashed(v1).unwrap();
    let (delta, _) = encode_delta(&base, &mut new, &opts(Encoding::Trl, 5)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&delta).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&delta).unwrap();
    let meta: BTreeMap<String, String> = header
        .metadata()
        .clone()
        .unwrap()
        .into_iter()
        .filter(|(k, _)| !k.starts_with("weightcast."))
        .collect();
    assert_eq!(meta["format"], "sparse_weight_patch");
    let names = header.offset_keys();
    let tensors: Vec<_> = names.iter().map(|n| (n, st.tensor(n).unwrap())).collect();
    let views: Vec<(&str, Dtype, &[usize], &[u8])> = tensors
        .iter()
        .map(|(n, v)| (n.as_str(), v.dtype(), v.shape(), v.data()))
        .collect();
    let mut file = Vec::new();
    write_safetensors(&views, &meta, &mut file).unwrap();
    let mut replica = base.clone();
    let report = apply_delta(&mut replica, &file).unwrap();
    assert!(!report.verified);
    // A foreign file reports TRL's model_version: its step, weightcast's version + 1.
    assert_eq!(report.model_version, Some(6));
    assert_same_state(&replica, &new);
}

// ---------------------------------------------------------------------------
// Plain checkpoints.

#[test]
fn plain_safetensors_load_without_header() {
    let mut rng = Rng(3);
    let spec = vec![
        ("a".to_string(), Dtype::BF16, vec![3, 5]),
        ("b".to_string(), Dtype::F32, vec![]),
        ("c".to_string(), Dtype::F4, vec![4]),
        ("d".to_string(), Dtype::I64, vec![0]),
    ];
    let items = fill(&spec, &mut rng);
    let set = TensorSet::from_tensors(items.clone()).unwrap();
    let views: Vec<(&str, Dtype, &[usize], &[u8])> = items
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    let metas: [&[(&str, &str)]; 3] = [
        &[],
        &[("format", "pt")],
        // A TRL full checkpoint ("sparse=False") is an unverified anchor too.
        &[("format", "sparse_weight_patch"), ("sparse", "False")],
    ];
    for m in metas {
        let meta: BTreeMap<String, String> = m
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut file = Vec::new();
        write_safetensors(&views, &meta, &mut file).unwrap();
        let (header, loaded) = read_anchor(file).unwrap();
        assert!(header.is_none());
        assert_same_state(&loaded, &set);

        // And a delta applies on top of such an unverified load.
        let mut v1 = items.clone();
        v1[0].3[3] ^= 0x10;
        let mut loaded = loaded;
        let mut new = TensorSet::from_tensors_unhashed(v1).unwrap();
        let (delta, _) = encode_delta(&set, &mut new, &opts(Encoding::Compact, 1)).unwrap();
        assert!(apply_delta(&mut loaded, &delta).unwrap().verified);
        assert_same_state(&loaded, &new);
    }
}

/// A checkpoint laid out the way Python `safetensors.torch.save_file` lays it
/// out (tensors ordered by dtype alignment, then name), where an empty tensor
/// shares its offset with a non-empty one that sorts before it by name.
#[test]
fn apply_to_checkpoint_with_empty_tensor_sharing_an_offset() {
    // File order: "b" (F32, empty, offsets [0, 0]) then "a" (BF16, offsets [0, 4]).
    let a = vec![1u8, 2, 3, 4];
    let views: Vec<(&str, Dtype, &[usize], &[u8])> =
        vec![("b", Dtype::F32, &[0], &[]), ("a", Dtype::BF16, &[2], &a)];
    let mut file = Vec::new();
    write_safetensors(&views, &BTreeMap::new(), &mut file).unwrap();
    let (header, mut loaded) = read_anchor(file).unwrap();
    assert!(header.is_none());
    let base = loaded.clone();
    let mut new = TensorSet::from_tensors_unhashed(vec![
        ("a".to_string(), Dtype::BF16, vec![2], vec![1, 2, 3, 5]),
        ("b".to_string(), Dtype::F32, vec![0], vec![]),
    ])
    .unwrap();
    let (delta, _) = encode_delta(&base, &mut new, &opts(Encoding::Compact, 1)).unwrap();
    let report = apply_delta(&mut loaded, &delta).unwrap();
    assert!(report.verified);
    assert_same_state(&loaded, &new);
}
