//! Writes the seed corpora of the fuzz targets in `fuzz/` (see `fuzz/README.md`):
//! valid compact and trl deltas against the fuzzers' fixed base (the tiny
//! generator model, seed 1, step 0), foreign TRL files, anchors and plain
//! checkpoints, compact block streams in the `compact_block` input layout,
//! `compact2` block streams with their contexts in the `compact2_block` one, and
//! the bucket-protocol targets' inputs: commit manifests of every kind,
//! `latest.json` hints, subscriber registrations and signed notifications.
//! Every seed is checked to be accepted before it is written.
//!
//! `cargo run --release --example fuzz_seeds [-- OUT_DIR]` (default `fuzz/corpus`)

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use weightcast::codec::compact;
use weightcast::codec::{DeltaOptions, apply_delta, encode_anchor, encode_delta, read_anchor};
use weightcast::dtype::{Dtype, KeyKind, key_kind, read_word, word_bytes, write_word};
use weightcast::format::{Encoding, Header, Kind, TensorEntry};
use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::tensors::{TensorSet, write_safetensors};

/// Must equal `weightcast_fuzz::BASE_SEED` (fuzz/src/lib.rs).
const BASE_SEED: u64 = 1;
/// Must equal `weightcast_fuzz::NOTIFY_SECRET` and `NOW`.
const NOTIFY_SECRET: &str = "weightcast-fuzz-notify-secret";
const NOW: u64 = 1_700_000_000;

type Error = Box<dyn std::error::Error>;

fn main() -> Result<(), Error> {
    let out = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus"));
    let mut g = Generator::new(GeneratorConfig::tiny(BASE_SEED));
    let v0 = g.snapshot();
    let mut versions = Vec::new();
    for step in 1..=5u64 {
        g.step();
        if matches!(step, 1 | 2 | 5) {
            versions.push((step, g.snapshot_without_digests()));
        }
    }
    let mut seeds = Seeds::new(&out);

    // Deltas v0 -> v1, v2, v5 and hand-made ones, in both encodings.
    let mut targets: Vec<(String, TensorSet)> = versions
        .into_iter()
        .map(|(s, v)| (format!("step{s}"), v))
        .collect();
    targets.push(("few".into(), few_changes(&v0)));
    targets.push(("jumps".into(), jumps(&v0)));
    targets.push(("one-per-tensor".into(), one_per_tensor(&v0)));
    for (name, new) in &targets {
        for (enc, dir) in [
            (Encoding::Compact, "apply_compact"),
            (Encoding::Trl, "apply_trl"),
        ] {
            let mut new = new.clone();
            let opts = DeltaOptions {
                encoding: enc,
                model_version: 1,
                base_version: 0,
                ..Default::default()
            };
            let (bytes, _) = encode_delta(&v0, &mut new, &opts)?;
            check_applies(&v0, &bytes, &new)?;
            seeds.write(dir, &format!("{name}-{enc}"), &bytes)?;
        }
    }

    // TRL's other generations and index codings (the loop above wrote the
    // default, v3 with gap_delta indices).
    for (name, new) in [&targets[0], &targets[3], &targets[4]] {
        for (label, trl) in [
            ("v1", weightcast::format::TrlOptions::V1),
            (
                "v3-raw",
                weightcast::format::TrlOptions {
                    generation: weightcast::format::TrlGeneration::V3,
                    index: weightcast::format::TrlIndexEncoding::Raw,
                },
            ),
        ] {
            let mut new = new.clone();
            let opts = DeltaOptions {
                encoding: Encoding::Trl,
                model_version: 1,
                base_version: 0,
                trl,
                ..DeltaOptions::default()
            };
            let (bytes, _) = encode_delta(&v0, &mut new, &opts)?;
            check_applies(&v0, &bytes, &new)?;
            seeds.write("apply_trl", &format!("{name}-trl-{label}"), &bytes)?;
        }
    }

    // Compact deltas with small blocks (the writer always uses 2^22 words).
    for (name, new) in [&targets[0], &targets[3], &targets[4]] {
        for bw in [1000u64, 4096] {
            let mut new = new.clone();
            new.compute_digests();
            let bytes = multi_block_compact(&v0, &new, bw)?;
            check_applies(&v0, &bytes, &new)?;
            seeds.write("apply_compact", &format!("{name}-blocks{bw}"), &bytes)?;
        }
    }

    // Foreign TRL files (no weightcast keys).
    let v1 = &targets[0].1;
    for (name, wide, listed, subset) in [
        ("foreign-i32", false, true, false),
        ("foreign-i64", true, true, false),
        ("foreign-unlisted", false, false, false),
        ("foreign-subset", false, true, true),
    ] {
        let bytes = foreign_trl(&v0, v1, wide, listed, subset)?;
        let mut state = v0.clone();
        apply_delta(&mut state, &bytes)?;
        seeds.write("apply_trl", name, &bytes)?;
    }
    let few = foreign_trl(&v0, &targets[3].1, false, true, false)?;
    apply_delta(&mut v0.clone(), &few)?;
    seeds.write("apply_trl", "foreign-few", &few)?;

    // Anchors and plain checkpoints.
    let (a0, _) = encode_anchor(&v0, 0)?;
    seeds.write_anchor("anchor-tiny-v0", a0)?;
    let mut plain = Vec::new();
    v0.write_to(&BTreeMap::new(), &mut plain)?;
    seeds.write_anchor("plain-tiny-v0", plain)?;
    let small = small_set()?;
    let (a, _) = encode_anchor(&small, 7)?;
    seeds.write_anchor("anchor-dtypes", a)?;
    let mut plain = Vec::new();
    small.write_to(
        &BTreeMap::from([("format".into(), "pt".into())]),
        &mut plain,
    )?;
    seeds.write_anchor("plain-dtypes", plain)?;
    let one = TensorSet::from_tensors(vec![(
        "w".to_string(),
        Dtype::BF16,
        vec![2, 4],
        (0..16).collect(),
    )])?;
    let (a, _) = encode_anchor(&one, 1)?;
    seeds.write_anchor("anchor-one", a)?;
    // Deltas are valid safetensors too: read_anchor must refuse them.
    let (d, _) = encode_delta(
        &one,
        &mut TensorSet::from_tensors_unhashed(vec![(
            "w".to_string(),
            Dtype::BF16,
            vec![2, 4],
            (1..17).collect(),
        )])?,
        &DeltaOptions {
            encoding: Encoding::Compact,
            model_version: 2,
            base_version: 1,
            ..Default::default()
        },
    )?;
    seeds.write("read_anchor", "delta-one", &d)?;

    // compact_block streams, one per word width and value coding.
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    for (wb, dtype) in [
        (1usize, Dtype::U8),
        (1, Dtype::F8_E4M3),
        (2, Dtype::BF16),
        (4, Dtype::F32),
        (4, Dtype::I32),
        (8, Dtype::F64),
    ] {
        for (len, density, big) in [
            (64u64, 0.2, false),
            (4096, 0.03, false),
            (65536, 0.01, false),
            (300, 0.1, true),
            (1, 1.0, true),
        ] {
            let kind = key_kind(dtype);
            let base: Vec<u8> = (0..len as usize * wb)
                .map(|_| next(&mut rng) as u8)
                .collect();
            let mut new = base.clone();
            for i in 0..len as usize {
                if (next(&mut rng) >> 11) as f64 / (1u64 << 53) as f64 >= density {
                    continue;
                }
                let old = read_word(&base, wb, i);
                let w = if big {
                    next(&mut rng)
                } else {
                    let step = 1 + next(&mut rng) % 4;
                    let key = weightcast::dtype::to_key(kind, wb, old);
                    let key = if next(&mut rng) & 1 == 0 {
                        key.wrapping_add(step)
                    } else {
                        key.wrapping_sub(step)
                    };
                    weightcast::dtype::from_key(kind, wb, key & weightcast::dtype::word_mask(wb))
                } & weightcast::dtype::word_mask(wb);
                write_word(&mut new, wb, i, w);
            }
            let e =
                compact::encode_tensor(kind, wb, weightcast::digest::TensorSeed(0), &base, &new);
            assert_eq!(e.blocks.len(), 1);
            let b = &e.blocks[0];
            let changes = u16::try_from(b.changes)?;
            let mut n = 0u64;
            let block = compact::Block {
                tensor: "seed",
                index: 0,
                entry: b,
                stream: &e.payload,
                wb,
                words: len,
                context: None,
            };
            compact::decode_block(&block, None, |_, _| {
                n += 1;
                Ok(())
            })?;
            assert_eq!(n, b.changes);
            let mut input = vec![
                u8::from(b.values == weightcast::format::ValueCoding::Raw)
                    | ((wb.trailing_zeros() as u8) << 1),
            ];
            input.extend_from_slice(&changes.to_le_bytes());
            input.extend_from_slice(&(len as u32).to_le_bytes()[..3]);
            input.push(b.pos_k);
            input.push(b.val_k);
            input.extend_from_slice(&e.payload);
            let kind_name = if kind == KeyKind::Identity {
                "int"
            } else {
                "float"
            };
            seeds.write(
                "compact_block",
                &format!(
                    "w{wb}-{kind_name}-{dtype}-len{len}-{}-{:?}",
                    if big { "big" } else { "small" },
                    b.values
                ),
                &input,
            )?;
        }
    }
    compact2_seeds(&mut seeds)?;
    protocol_seeds(&mut seeds)?;
    println!("wrote {} seeds under {}", seeds.count, out.display());
    Ok(())
}

/// `compact2_block` inputs: real `compact2` blocks (made with
/// `compact::v2::encode_tensor`) for word widths 1, 2, 4, 8, both key kinds
/// and both value codings, each with the context it was made against: a
/// chain a → b → c where c changes many of the words b changed, b's block
/// made without context (no members) and c's against b's changes.
fn compact2_seeds(seeds: &mut Seeds) -> Result<(), Error> {
    use weightcast::codec::compact::TensorContext;
    use weightcast::codec::compact::context::Member;
    use weightcast::dtype::{from_key, to_key, word_mask};
    let mut rng = 0x6a09_e667_f3bc_c909u64;
    for (wb, dtype) in [
        (1usize, Dtype::U8),
        (1, Dtype::F8_E4M3),
        (2, Dtype::BF16),
        (4, Dtype::F32),
        (4, Dtype::I32),
        (8, Dtype::F64),
    ] {
        let kind = key_kind(dtype);
        let mask = word_mask(wb);
        // `trend`: c's steps mostly go the way b's went (and up where b made
        // none), so that few sign bits are set and the sign lists are used.
        for (len, density, again, big, trend) in [
            (64u64, 0.2, 0.5, false, false),
            (4096, 0.03, 0.3, false, false),
            (65536, 0.01, 0.3, false, false),
            (2000, 0.05, 0.9, false, false),
            (3000, 0.05, 0.9, false, true),
            (300, 0.1, 0.5, true, false),
            (1, 1.0, 1.0, false, false),
        ] {
            let unit = |rng: &mut u64| (next(rng) >> 11) as f64 / (1u64 << 53) as f64;
            // `down`: None for a random direction.
            let change = |rng: &mut u64, old: u64, down: Option<bool>| -> u64 {
                if big {
                    return next(rng) & mask;
                }
                // Mostly ±1 ulp, some ±2..±5, a few large jumps.
                let r = next(rng);
                let step = match r % 16 {
                    0 => 1 + (r >> 8) % 1000,
                    1..=3 => 2 + (r >> 8) % 4,
                    _ => 1,
                };
                let key = to_key(kind, wb, old);
                let down = match down {
                    Some(d) if r % 100 >= 97 => !d,
                    Some(d) => d,
                    None => (r >> 40) & 1 == 1,
                };
                let key = if !down {
                    key.wrapping_add(step)
                } else {
                    key.wrapping_sub(step)
                };
                from_key(kind, wb, key & mask)
            };
            let a: Vec<u8> = (0..len as usize * wb)
                .map(|_| next(&mut rng) as u8)
                .collect();
            let mut b = a.clone();
            for i in 0..len as usize {
                if unit(&mut rng) < density {
                    let w = change(&mut rng, read_word(&a, wb, i), None);
                    write_word(&mut b, wb, i, w);
                }
            }
            let mut c = b.clone();
            for i in 0..len as usize {
                let before = read_word(&a, wb, i) != read_word(&b, wb, i);
                let p = if before { again } else { density / 2.0 };
                if unit(&mut rng) < p {
                    let down = trend.then(|| {
                        let (ka, kb) = (
                            to_key(kind, wb, read_word(&a, wb, i)),
                            to_key(kind, wb, read_word(&b, wb, i)),
                        );
                        before && (kb.wrapping_sub(ka) & mask) >> (8 * wb - 1) == 1
                    });
                    let w = change(&mut rng, read_word(&b, wb, i), down);
                    write_word(&mut c, wb, i, w);
                }
            }
            let seed = weightcast::digest::TensorSeed(0);
            let e1 = compact::v2::encode_tensor(kind, wb, seed, (&a, &b), (None, 0));
            let e2 = compact::v2::encode_tensor(kind, wb, seed, (&b, &c), (Some(&e1.next), 0));
            let none = TensorContext::default();
            for (label, e, ctx) in [("noctx", &e1, &none), ("ctx", &e2, &e1.next)] {
                assert_eq!(e.tensor.blocks.len(), 1);
                let entry = &e.tensor.blocks[0];
                let members: &[Member] = ctx.block(0);
                let block = compact::Block {
                    tensor: "seed",
                    index: 0,
                    entry,
                    stream: &e.tensor.payload,
                    wb,
                    words: len,
                    context: Some(members),
                };
                let mut n = 0u64;
                compact::decode_block(&block, None, |_, _| {
                    n += 1;
                    Ok(())
                })?;
                assert_eq!(n, entry.changes);
                let mut input = vec![
                    u8::from(entry.values == weightcast::format::ValueCoding::Raw)
                        | ((wb.trailing_zeros() as u8) << 1)
                        | (u8::from(kind == KeyKind::Identity) << 6),
                ];
                input.extend_from_slice(&u16::try_from(entry.changes)?.to_le_bytes());
                input.extend_from_slice(&(len as u32).to_le_bytes()[..3]);
                input.extend_from_slice(&u16::try_from(members.len())?.to_le_bytes());
                let mut prev = -1i64;
                for &m in members {
                    let i = (m >> 2) as i64;
                    let gap = u16::try_from(i - prev - 1)?;
                    assert!(gap < 1 << 14, "member gap {gap} does not fit the layout");
                    input.extend_from_slice(&((gap << 2) | (m & 3) as u16).to_le_bytes());
                    prev = i;
                }
                input.extend_from_slice(&e.tensor.payload);
                let kind_name = if kind == KeyKind::Identity {
                    "int"
                } else {
                    "float"
                };
                seeds.write(
                    "compact2_block",
                    &format!(
                        "w{wb}-{kind_name}-{dtype}-len{len}-{}-{label}-{:?}",
                        match (big, trend) {
                            (true, _) => "big",
                            (_, true) => "trend",
                            _ => "small",
                        },
                        entry.values
                    ),
                    &input,
                )?;
            }
        }
    }
    Ok(())
}

struct Seeds {
    dir: PathBuf,
    count: usize,
}

impl Seeds {
    fn new(dir: &Path) -> Self {
        Seeds {
            dir: dir.to_path_buf(),
            count: 0,
        }
    }

    fn write(&mut self, target: &str, name: &str, bytes: &[u8]) -> Result<(), Error> {
        let d = self.dir.join(target);
        std::fs::create_dir_all(&d)?;
        std::fs::write(d.join(format!("seed-{name}")), bytes)?;
        self.count += 1;
        Ok(())
    }

    fn write_anchor(&mut self, name: &str, bytes: Vec<u8>) -> Result<(), Error> {
        read_anchor(bytes.clone())?;
        self.write("read_anchor", name, &bytes)
    }
}

fn next(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

fn check_applies(base: &TensorSet, delta: &[u8], want: &TensorSet) -> Result<(), Error> {
    let mut s = base.clone();
    let r = apply_delta(&mut s, delta)?;
    assert!(r.verified);
    assert_eq!(s.digest(), want.digest());
    Ok(())
}

/// `v0` with a few one- and two-ulp changes in two tensors.
fn few_changes(v0: &TensorSet) -> TensorSet {
    let mut s = v0.clone();
    for (name, idx, step) in [
        ("model.norm.weight", 0usize, 1i16),
        ("model.norm.weight", 5, -2),
        ("model.norm.weight", 63, 1),
        ("model.layers.0.mlp.up_proj.weight", 1000, 1),
        ("model.layers.0.mlp.up_proj.weight", 1001, -1),
    ] {
        let i = s.position(name).expect("tiny model tensor");
        let d = s.data_mut(i);
        let w = read_word(d, 2, idx) as u16;
        write_word(d, 2, idx, w.wrapping_add_signed(step) as u64);
    }
    s
}

/// `v0` with sign flips (huge key steps, so the block codes raw values).
fn jumps(v0: &TensorSet) -> TensorSet {
    let mut s = v0.clone();
    let i = s.position("lm_head.weight").expect("tiny model tensor");
    let d = s.data_mut(i);
    for idx in [3usize, 700, 701, 9000, 16383] {
        let w = read_word(d, 2, idx);
        write_word(d, 2, idx, w ^ 0x8000);
    }
    s
}

/// `v0` with the last element of every tensor moved one ulp.
fn one_per_tensor(v0: &TensorSet) -> TensorSet {
    let mut s = v0.clone();
    for i in 0..s.len() {
        let d = s.data_mut(i);
        let last = d.len() / 2 - 1;
        let w = read_word(d, 2, last);
        write_word(d, 2, last, w ^ 1);
    }
    s
}

/// A compact delta from `base` to `new` with `bw` words per block, assembled by
/// hand: each block is one `encode_tensor` call on that block's words.
fn multi_block_compact(base: &TensorSet, new: &TensorSet, bw: u64) -> Result<Vec<u8>, Error> {
    let mut tensors = BTreeMap::new();
    let mut payload: Vec<(String, Vec<u8>)> = Vec::new();
    let (mut changed, mut total) = (0u64, 0u64);
    for (i, t) in base.tensors().iter().enumerate() {
        let wb = word_bytes(t.dtype);
        let words = t.words() as u64;
        total += words;
        let (old, nw) = (base.data(i), new.data(i));
        if old == nw {
            continue;
        }
        let mut blocks = Vec::new();
        let mut bytes = Vec::new();
        let mut n = 0;
        for (o, w) in old
            .chunks(bw as usize * wb)
            .zip(nw.chunks(bw as usize * wb))
        {
            let e = compact::encode_tensor(key_kind(t.dtype), wb, t.seed, o, w);
            n += e.changed;
            blocks.extend(e.blocks);
            bytes.extend(e.payload);
        }
        changed += n;
        tensors.insert(
            t.name.clone(),
            TensorEntry {
                dtype: t.dtype.to_string(),
                shape: t.shape.iter().map(|&d| d as u64).collect(),
                elements: t.elements(),
                changed: n,
                density: n as f64 / words as f64,
                digest: new.tensors()[i].digest.to_string(),
                base_digest: Some(t.digest.to_string()),
                block_words: Some(bw),
                blocks: Some(blocks),
            },
        );
        payload.push((format!("{}{}", t.name, compact::SUFFIX), bytes));
    }
    payload.sort();
    let mut hasher = blake3::Hasher::new();
    for (_, p) in &payload {
        hasher.update(p);
    }
    let header = Header {
        kind: Kind::Delta,
        encoding: Encoding::Compact,
        model_version: 1,
        base_version: Some(0),
        base_digest: Some(base.digest()),
        digest: new.digest(),
        tensor_count: base.len() as u64,
        total_elements: base.total_elements(),
        changed_elements: changed,
        density: changed as f64 / total as f64,
        payload_blake3: Some(hasher.finalize().to_hex().to_string()),
        tensors,
        context: None,
    };
    let shapes: Vec<[usize; 1]> = payload.iter().map(|(_, p)| [p.len()]).collect();
    let views: Vec<(&str, Dtype, &[usize], &[u8])> = payload
        .iter()
        .zip(&shapes)
        .map(|((n, p), s)| (n.as_str(), Dtype::U8, &s[..], p.as_slice()))
        .collect();
    let mut out = Vec::new();
    write_safetensors(&views, &header.to_metadata(), &mut out)?;
    Ok(out)
}

/// A TRL `sparse_weight_patch` file as another tool would write it: no
/// weightcast keys, I32 (or I64) indices, `changed_params` optional.
fn foreign_trl(
    base: &TensorSet,
    new: &TensorSet,
    wide: bool,
    listed: bool,
    subset: bool,
) -> Result<Vec<u8>, Error> {
    let mut names = Vec::new();
    let mut parts: Vec<(String, Dtype, usize, Vec<u8>)> = Vec::new();
    for (i, t) in base.tensors().iter().enumerate() {
        let wb = word_bytes(t.dtype);
        let (old, nw) = (base.data(i), new.data(i));
        let mut idx = Vec::new();
        let mut val = Vec::new();
        let mut n = 0;
        for j in 0..old.len() / wb {
            let w = read_word(nw, wb, j);
            if read_word(old, wb, j) != w {
                if wide {
                    idx.extend_from_slice(&(j as i64).to_le_bytes());
                } else {
                    idx.extend_from_slice(&(j as i32).to_le_bytes());
                }
                val.extend_from_slice(&w.to_le_bytes()[..wb]);
                n += 1;
            }
        }
        if n == 0 || (subset && names.len() == 2) {
            continue;
        }
        names.push(t.name.clone());
        let it = if wide { Dtype::I64 } else { Dtype::I32 };
        parts.push((format!("{}.indices", t.name), it, n, idx));
        parts.push((format!("{}.values", t.name), t.dtype, n, val));
    }
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), "sparse_weight_patch".to_string());
    meta.insert("version".into(), "1".into());
    meta.insert("sparse".into(), "True".into());
    meta.insert("model_version".into(), "1".into());
    if listed {
        meta.insert("changed_params".into(), serde_json::to_string(&names)?);
    }
    let shapes: Vec<[usize; 1]> = parts.iter().map(|p| [p.2]).collect();
    let views: Vec<(&str, Dtype, &[usize], &[u8])> = parts
        .iter()
        .zip(&shapes)
        .map(|(p, s)| (p.0.as_str(), p.1, &s[..], p.3.as_slice()))
        .collect();
    let mut out = Vec::new();
    write_safetensors(&views, &meta, &mut out)?;
    Ok(out)
}

/// A small set with one tensor of each interesting dtype and shape.
fn small_set() -> Result<TensorSet, Error> {
    let b = |n: usize| (0..n).map(|i| (i * 37 + 11) as u8).collect::<Vec<u8>>();
    Ok(TensorSet::from_tensors(vec![
        ("bf16".to_string(), Dtype::BF16, vec![2, 3], b(12)),
        ("f32".into(), Dtype::F32, vec![3], b(12)),
        ("f64.scalar".into(), Dtype::F64, vec![], b(8)),
        ("i64".into(), Dtype::I64, vec![2], b(16)),
        ("u8".into(), Dtype::U8, vec![5], b(5)),
        ("bool".into(), Dtype::BOOL, vec![2], vec![0, 1]),
        ("f8".into(), Dtype::F8_E4M3, vec![4], b(4)),
        ("f4".into(), Dtype::F4, vec![4], b(2)),
        ("empty".into(), Dtype::F16, vec![0, 3], vec![]),
    ])?)
}

/// Seeds of the bucket-protocol targets: manifests of an anchor with shards
/// and files, a delta, and an anchor with bridges; hints; registrations;
/// notifications (signed with the harness's key, in its input layout).
fn protocol_seeds(seeds: &mut Seeds) -> Result<(), Error> {
    use weightcast::protocol::{
        Latest, Manifest, ObjectEntry, ObjectRole, Registration, Staging, VersionKind,
    };
    let hash = |s: &str| blake3::hash(s.as_bytes()).to_hex().to_string();
    let record = |st: &mut Staging, role: ObjectRole, name: &str, size: u64| {
        let key = st.key(role, name).expect("a safe name");
        st.record(ObjectEntry {
            name: name.into(),
            role,
            key,
            size,
            blake3: hash(name),
        });
    };
    let shards = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    let files = |st: &mut Staging, changed: bool| {
        st.list_file("config.json", 7, hash("config.json"));
        st.list_file(
            "tokenizer/tokenizer.json",
            11,
            hash("tokenizer/tokenizer.json"),
        );
        if changed {
            let key = st
                .key(ObjectRole::File, "config.json")
                .expect("a safe name");
            st.record(ObjectEntry {
                name: "config.json".into(),
                role: ObjectRole::File,
                key,
                size: 7,
                blake3: hash("config.json"),
            });
        }
    };
    let mut manifests: Vec<(&str, Manifest)> = Vec::new();
    let mut st = Staging::new(0);
    for s in shards {
        record(&mut st, ObjectRole::Anchor, s, 1 << 30);
    }
    files(&mut st, true);
    manifests.push((
        "anchor",
        st.manifest(VersionKind::Anchor, None, 0, Some(100)),
    ));
    let mut st = Staging::new(1);
    for s in shards {
        record(&mut st, ObjectRole::Delta, s, 1 << 20);
    }
    files(&mut st, false);
    manifests.push((
        "delta",
        st.manifest(VersionKind::Delta, Some(0), 0, Some(101)),
    ));
    let mut st = Staging::new(3);
    for s in shards {
        record(&mut st, ObjectRole::Anchor, s, 1 << 30);
        record(&mut st, ObjectRole::Delta, s, 1 << 20);
    }
    files(&mut st, true);
    manifests.push((
        "bridged-anchor",
        st.manifest(VersionKind::Anchor, Some(2), 3, None),
    ));
    let mut st = Staging::new(7);
    record(&mut st, ObjectRole::Delta, "model.safetensors", 5);
    manifests.push((
        "minimal-delta",
        st.manifest(VersionKind::Delta, Some(6), 5, None),
    ));
    for (name, m) in &manifests {
        for (style, bytes) in [
            ("pretty", serde_json::to_vec_pretty(m)?),
            ("compact", serde_json::to_vec(m)?),
        ] {
            Manifest::parse(&bytes, name)?;
            seeds.write("manifest", &format!("{name}-{style}"), &bytes)?;
        }
    }

    for (name, l) in [
        (
            "first",
            Latest {
                version: 0,
                anchor_version: 0,
            },
        ),
        (
            "later",
            Latest {
                version: 12,
                anchor_version: 10,
            },
        ),
    ] {
        seeds.write("latest", name, &serde_json::to_vec(&l)?)?;
    }
    seeds.write(
        "latest",
        "spaced",
        b"{ \"version\" : 4 , \"anchor_version\" : 3 }",
    )?;

    for (name, r) in [
        (
            "listening",
            Registration {
                id: "rollout-7.eu_west".into(),
                notify_url: Some("http://10.0.0.7:8480/v1/notify".into()),
                version: Some(41),
                quarantined: vec![42],
                updated_at: NOW,
            },
        ),
        (
            "polling",
            Registration {
                id: "r1".into(),
                notify_url: None,
                version: None,
                quarantined: Vec::new(),
                updated_at: 0,
            },
        ),
    ] {
        seeds.write("registration", name, &serde_json::to_vec(&r)?)?;
    }

    let key = weightcast::notify::Key::new(NOTIFY_SECRET)?;
    let body = serde_json::to_vec(&weightcast::notify::Notification {
        store: "s3://weights/run".into(),
        version: 5,
        anchor_version: 3,
    })?;
    for (name, ts, signed_by_harness) in [
        ("harness-signed", NOW, true),
        ("signed", NOW - 100, false),
        ("stale", NOW - 301, false),
    ] {
        let ts = ts.to_string();
        let sig = if signed_by_harness {
            String::new()
        } else {
            key.sign(ts.parse()?, &body)
        };
        let mut input = vec![u8::from(signed_by_harness), ts.len() as u8];
        input.extend_from_slice(ts.as_bytes());
        input.push(sig.len() as u8);
        input.extend_from_slice(sig.as_bytes());
        input.extend_from_slice(&body);
        seeds.write("notification", name, &input)?;
    }
    Ok(())
}
