//! TRL's format both ways, against the independent Python reference in
//! `tests/trl_reference/trl_ref.py` (numpy and its own safetensors code,
//! written from TRL's format description, not from weightcast's):
//!
//! - (a) TRL v1 and v3 (raw, gap_delta with U16 and U32 gaps) deltas the
//!   reference writes apply exactly with `apply_delta`, and weightcast writes
//!   the same tensors and header keys;
//! - (b) the subscriber's loop (`Subscriber::follow(Log::Trl)`, into memory)
//!   follows the reference's buckets to exactly the last step, and keeps
//!   following, on a local store, moto and Garage;
//! - (c) the reference's reader follows buckets weightcast's writer helpers make;
//! - (d) bad TRL input is refused with a clear error and nothing is served.
//!
//! The reference runs with `WEIGHTCAST_PYTHON` (default
//! `.ci-work/venv/bin/python`, which `./scripts/test.sh` creates with numpy).

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use bytes::Bytes;
use serde_json::Value;
use weightcast::Error;
use weightcast::codec::{DeltaOptions, apply_delta, encode_delta, inspect};
use weightcast::dtype::Dtype;
use weightcast::format::{Encoding, TrlGeneration, TrlIndexEncoding, TrlOptions};
use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::protocol::trl::{self as trl_bucket};
use weightcast::store::Store;
use weightcast::subscriber::trl::{self as trl_follow, TrlLimits};
use weightcast::subscriber::{CaughtUp, Fetcher, Log, MemorySink, Sink, Subscriber, VersionSource};
use weightcast::tensors::{Digests, TensorSet, write_safetensors};

const REFERENCE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/trl_reference/trl_ref.py"
);

fn python() -> PathBuf {
    let p = std::env::var_os("WEIGHTCAST_PYTHON").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci-work/venv/bin/python"),
        PathBuf::from,
    );
    assert!(
        p.is_file(),
        "the TRL reference needs a Python with numpy: `{}` not found. Run the suite with \
         ./scripts/test.sh (it creates .ci-work/venv with numpy), or set WEIGHTCAST_PYTHON to \
         a python that has numpy",
        p.display()
    );
    p
}

/// Runs the reference; returns the JSON line it prints.
fn reference(args: &[&str]) -> Value {
    let out = Command::new(python())
        .arg(REFERENCE)
        .args(args)
        .output()
        .expect("running the TRL reference");
    assert!(
        out.status.success(),
        "trl_ref.py {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    serde_json::from_str(stdout.lines().last().expect("one JSON line")).unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn load(p: &Path) -> TensorSet {
    TensorSet::read(p, Digests::Compute).unwrap()
}

/// Same tensor names, dtypes, shapes and bytes.
fn assert_same(got: &TensorSet, want: &TensorSet, what: &str) {
    let names =
        |t: &TensorSet| -> Vec<String> { t.tensors().iter().map(|x| x.name.clone()).collect() };
    assert_eq!(names(got), names(want), "{what}: tensor names");
    for (i, (a, b)) in got.tensors().iter().zip(want.tensors()).enumerate() {
        assert_eq!(
            (a.dtype, &a.shape),
            (b.dtype, &b.shape),
            "{what}: {}",
            a.name
        );
        assert!(
            got.data(i) == want.data(i),
            "{what}: tensor {} differs",
            a.name
        );
    }
}

/// The layouts the reference writes: (name, generation, index encoding).
const LAYOUTS: [(&str, &str, &str); 3] = [
    ("v1", "v1", "gap_delta"),
    ("v3-raw", "v3", "raw"),
    ("v3-gap", "v3", "gap_delta"),
];

fn trl_options(generation: &str, encoding: &str) -> TrlOptions {
    TrlOptions {
        generation: generation.parse().unwrap(),
        index: encoding.parse().unwrap(),
    }
}

// ---------------------------------------------------------------------------
// (a) single deltas.

struct RefDelta {
    _dir: tempfile::TempDir,
    base: TensorSet,
    delta: Vec<u8>,
    expected: TensorSet,
    index_dtypes: Vec<String>,
}

fn reference_delta(generation: &str, encoding: &str, seed: u64) -> RefDelta {
    let dir = tempfile::tempdir().unwrap();
    let (b, d, e) = (
        dir.path().join("base.safetensors"),
        dir.path().join("delta.safetensors"),
        dir.path().join("expected.safetensors"),
    );
    let out = reference(&[
        "write-delta",
        "--generation",
        generation,
        "--encoding",
        encoding,
        "--seed",
        &seed.to_string(),
        "--base",
        s(&b),
        "--delta",
        s(&d),
        "--expected",
        s(&e),
    ]);
    RefDelta {
        base: load(&b),
        delta: std::fs::read(&d).unwrap(),
        expected: load(&e),
        index_dtypes: serde_json::from_value(out["index_dtypes"].clone()).unwrap(),
        _dir: dir,
    }
}

#[test]
fn reference_deltas_apply_exactly() {
    for (name, generation, encoding) in LAYOUTS {
        let r = reference_delta(generation, encoding, 11);
        let want_widths: &[&str] = match name {
            "v3-gap" => &["U16", "U32"], // the embedding's rows are > 0xFFFF apart
            _ => &["I32"],
        };
        assert_eq!(r.index_dtypes, want_widths, "{name}");
        let mut state = r.base.clone();
        let report = apply_delta(&mut state, &r.delta).unwrap();
        assert!(!report.verified, "{name}: TRL files carry no digests");
        assert_eq!(report.encoding, Encoding::Trl);
        assert_eq!(report.model_version, Some(2), "{name}: TRL's step");
        assert_same(&state, &r.expected, name);
        // The digests the apply maintained are the expected state's.
        assert_eq!(state.digest(), r.expected.digest(), "{name}");
        // The unchanged parameter is not reported (v3 carries an empty pair for it).
        assert!(
            !report
                .changed_tensors
                .iter()
                .any(|t| t == "model.norm.weight"),
            "{name}: {:?}",
            report.changed_tensors
        );
        let (meta, _) = inspect(&r.delta).unwrap();
        let all = r.base.len().to_string();
        if generation == "v3" {
            assert_eq!(meta["num_changed_params"], all, "v3 counts every parameter");
        } else {
            assert_ne!(meta["num_changed_params"], all);
        }
    }
}

/// weightcast's own TRL deltas of the same step hold the reference's tensors
/// and render TRL's keys as TRL's writer does.
#[test]
fn weightcast_writes_what_the_reference_writes() {
    for (name, generation, encoding) in LAYOUTS {
        let r = reference_delta(generation, encoding, 12);
        let mut new = r.expected.clone();
        let opts = DeltaOptions {
            encoding: Encoding::Trl,
            model_version: 1, // TRL step 2
            base_version: 0,
            trl: trl_options(generation, encoding),
            ..DeltaOptions::default()
        };
        let (ours, _) = encode_delta(&r.base, &mut new, &opts).unwrap();
        let (theirs_meta, _) = inspect(&r.delta).unwrap();
        let (ours_meta, header) = inspect(&ours).unwrap();
        assert!(header.is_some());
        let same: &[&str] = if generation == "v1" {
            // v1's total_elements counts only the parameters in the file (ours: all).
            &[
                "format",
                "version",
                "sparse",
                "model_version",
                "num_changed_params",
                "total_changed_elements",
                "changed_params",
            ]
        } else {
            // v3's num_changed_params counts its empty pairs too (ours: none written).
            &[
                "format",
                "version",
                "sparse",
                "model_version",
                "total_changed_elements",
                "total_elements",
                "sparsity",
                "encoding",
            ]
        };
        for k in same {
            assert_eq!(ours_meta.get(*k), theirs_meta.get(*k), "{name}: key {k}");
        }
        let ours_st = safetensors::SafeTensors::deserialize(&ours).unwrap();
        let theirs = safetensors::SafeTensors::deserialize(&r.delta).unwrap();
        let mut names = ours_st.names();
        names.sort();
        for n in &names {
            let (a, b) = (ours_st.tensor(n).unwrap(), theirs.tensor(n).unwrap());
            assert_eq!(
                (a.dtype(), a.shape(), a.data()),
                (b.dtype(), b.shape(), b.data()),
                "{name}: {n}"
            );
        }
        // Everything the reference wrote that we did not is an empty pair.
        for n in theirs.names() {
            if !names.contains(&n) {
                assert!(theirs.tensor(n).unwrap().data().is_empty(), "{name}: {n}");
            }
        }
        // And our delta applies, verified, to the same state.
        let mut state = r.base.clone();
        assert!(apply_delta(&mut state, &ours).unwrap().verified);
        assert_same(&state, &r.expected, name);
    }
}

// ---------------------------------------------------------------------------
// (b) following reference buckets.

/// Uploads every file under `dir` to `store` under its relative path.
async fn upload(dir: &Path, store: &Store) {
    for sub in ["anchors", "deltas"] {
        let Ok(rd) = std::fs::read_dir(dir.join(sub)) else {
            continue;
        };
        for e in rd {
            let e = e.unwrap();
            let key = format!("{sub}/{}", e.file_name().to_str().unwrap());
            store
                .put(&key, Bytes::from(std::fs::read(e.path()).unwrap()))
                .await
                .unwrap();
        }
    }
}

/// The reference writes `steps` steps into `dir` (a longer run repeats a
/// shorter one's files exactly); returns the expected model at the last step.
fn write_bucket(dir: &Path, generation: &str, encoding: &str, steps: u64) -> TensorSet {
    let e = dir.with_extension(format!("expected-{steps}.safetensors"));
    reference(&[
        "write-bucket",
        s(dir),
        "--generation",
        generation,
        "--encoding",
        encoding,
        "--steps",
        &steps.to_string(),
        "--anchor-every",
        "3",
        "--seed",
        "5",
        "--expected",
        s(&e),
    ]);
    load(&e)
}

/// A follower of a TRL bucket: the subscriber's loop into memory.
fn follower(store: &Store) -> Subscriber<MemorySink> {
    let source = VersionSource::new(std::time::Duration::from_secs(1), 0.0);
    let mut sub = Subscriber::new(Fetcher::new(store.clone()), source, MemorySink::new());
    sub.follow(Log::Trl);
    sub
}

/// The TRL step the follower holds.
fn step(sub: &Subscriber<MemorySink>) -> Option<u64> {
    sub.sink.held().map(|v| v + 1)
}

/// The tensors the follower holds.
fn held(sub: &Subscriber<MemorySink>) -> &TensorSet {
    &sub.sink.tensors()[trl_follow::FILE]
}

/// A catch-up that must have moved the follower.
async fn moved(sub: &mut Subscriber<MemorySink>) -> Option<CaughtUp> {
    let c = sub.catch_up(true).await.unwrap()?;
    (c.previous != Some(c.version) || c.from_anchor).then_some(c)
}

/// Follows a reference bucket on `store` as it grows: 2 steps (anchor 1 and a
/// delta), 5 (anchor 3 loaded over the held step 2), 7 (anchor 6), 8 (a delta
/// only); every time exactly the reference's model at the last step.
async fn follow(store: &Store, generation: &str, encoding: &str) {
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join("bucket");
    assert!(!trl_bucket::is_trl_bucket(store).await.unwrap());
    let mut sub = follower(store);
    assert!(moved(&mut sub).await.is_none());
    // (steps, from_anchor, deltas applied, previous)
    let v1 = generation == "v1";
    let plan: [(u64, bool, u64, Option<u64>); 4] = [
        (2, true, 1, None),
        // v1 writes an empty delta for the step without changes (4); v3 no file.
        (5, true, if v1 { 2 } else { 1 }, Some(2)),
        (7, true, 1, Some(5)),
        (8, false, 1, Some(7)),
    ];
    for (steps, from_anchor, deltas, previous) in plan {
        let expected = write_bucket(&dir, generation, encoding, steps);
        upload(&dir, store).await;
        assert!(trl_bucket::is_trl_bucket(store).await.unwrap());
        let what = format!("{generation}/{encoding} at {} step {steps}", store.url());
        let report = moved(&mut sub)
            .await
            .unwrap_or_else(|| panic!("{what}: nothing new"));
        assert_eq!(report.version + 1, steps, "{what}");
        assert_eq!(report.from_anchor, from_anchor, "{what}");
        assert_eq!(report.deltas_applied, deltas, "{what}");
        assert_eq!(report.previous.map(|v| v + 1), previous, "{what}");
        assert!(
            report.structural_only,
            "{what}: TRL's objects carry no digests"
        );
        assert!(report.quarantined.is_empty(), "{what}");
        assert!(report.downloaded > 0);
        if !from_anchor {
            assert!(!report.changed_tensors.is_empty(), "{what}");
        }
        assert_eq!(step(&sub), Some(steps));
        assert_same(held(&sub), &expected, &what);
        // Nothing newer: nothing done, the replica untouched.
        assert!(moved(&mut sub).await.is_none());
        assert_eq!(step(&sub), Some(steps));
    }
    let l = trl_bucket::listing(store).await.unwrap();
    assert_eq!(l.anchors.keys().copied().collect::<Vec<_>>(), [1, 3, 6]);
    let deltas: Vec<u64> = l.deltas.keys().copied().collect();
    assert_eq!(
        deltas,
        if v1 {
            vec![2, 4, 5, 7, 8]
        } else {
            vec![2, 5, 7, 8]
        }
    );
}

#[tokio::test]
async fn follows_reference_buckets_on_a_local_store() {
    for (generation, encoding) in [("v1", "gap_delta"), ("v3", "gap_delta"), ("v3", "raw")] {
        let (store, _dir) = common::local_store();
        follow(&store, generation, encoding).await;
    }
}

#[tokio::test]
async fn follows_reference_buckets_on_moto() {
    for (bucket, generation) in [("trl-follow-v1", "v1"), ("trl-follow-v3", "v3")] {
        let store = common::moto_store(bucket, "run").await;
        follow(&store, generation, "gap_delta").await;
    }
}

#[tokio::test]
async fn follows_reference_buckets_on_garage() {
    let g = common::garage();
    let o = common::garage_options();
    let opts: Vec<(&str, &str)> = o.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    for generation in ["v1", "v3"] {
        let store =
            Store::open_with(&format!("s3://{}/trl-follow-{generation}", g.bucket), &opts).unwrap();
        follow(&store, generation, "gap_delta").await;
    }
}

// ---------------------------------------------------------------------------
// (c) the reference follows what weightcast writes.

/// Writes `steps` generator steps into `store` with the writer helpers
/// (anchor every 3; step 4 repeats step 3, which v3 writes no file for);
/// returns each step's model.
async fn write_with_helpers(store: &Store, opts: &TrlOptions, steps: u64) -> Vec<TensorSet> {
    let mut g = Generator::new(GeneratorConfig::tiny(9));
    let mut models: Vec<TensorSet> = Vec::new();
    for step in 1..=steps {
        if step != 4 {
            g.step();
        }
        if trl_bucket::is_anchor_step(step, 3) {
            let set = g.snapshot();
            let (key, summary) = trl_bucket::put_anchor(store, &set, step, opts)
                .await
                .unwrap();
            assert_eq!(key, trl_bucket::anchor_key(step));
            assert_eq!(summary.tensors, set.len());
            models.push(set);
        } else {
            let mut new = g.snapshot_without_digests();
            let base = models.last().unwrap();
            let (key, summary) = trl_bucket::put_delta(store, base, &mut new, step, opts)
                .await
                .unwrap();
            let empty = summary.changed == 0;
            assert_eq!(empty, step == 4);
            let skipped = empty && opts.generation == TrlGeneration::V3;
            assert_eq!(key.is_none(), skipped, "step {step}");
            models.push(new);
        }
    }
    models
}

#[tokio::test]
async fn the_reference_follows_buckets_weightcast_writes() {
    for opts in [
        TrlOptions::V1,
        TrlOptions::V3,
        TrlOptions {
            generation: TrlGeneration::V3,
            index: TrlIndexEncoding::Raw,
        },
    ] {
        let (store, dir) = common::local_store();
        let models = write_with_helpers(&store, &opts, 5).await;
        let out = dir.path().with_extension("read.safetensors");
        let report = reference(&["read-bucket", s(dir.path()), "--out", s(&out)]);
        assert_eq!(report["anchor"], 3, "{opts:?}");
        assert_eq!(report["step"], 5, "{opts:?}");
        let what = format!("reference reader on {opts:?}");
        assert_same(&load(&out), models.last().unwrap(), &what);
        // weightcast follows its own TRL bucket with every digest verified.
        let mut sub = follower(&store);
        let r = moved(&mut sub).await.unwrap();
        assert!(!r.structural_only, "{opts:?}");
        assert_eq!(r.version + 1, 5);
        assert_same(held(&sub), models.last().unwrap(), &what);
        // The reference also reads every single delta and anchor.
        for key in trl_bucket::listing(&store).await.unwrap().deltas.keys() {
            let f = dir.path().join(trl_bucket::delta_key(*key));
            let info = reference(&["read-file", s(&f)]);
            assert_eq!(info["metadata"]["model_version"], key.to_string());
        }
    }
}

// ---------------------------------------------------------------------------
// (d) refusals.

type Owned = (String, Dtype, Vec<usize>, Vec<u8>);

/// Rewrites a safetensors file's tensors and metadata.
fn edit(bytes: &[u8], f: impl FnOnce(&mut Vec<Owned>, &mut BTreeMap<String, String>)) -> Vec<u8> {
    let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
    let (mut meta, _) = inspect(bytes).unwrap();
    // In the file's data order, so that an unedited payload keeps its bytes.
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let offsets = header.tensors();
    let mut names = st.names();
    names.sort_by_key(|n| offsets[*n].data_offsets.0);
    let mut tensors: Vec<Owned> = names
        .into_iter()
        .map(|n| {
            let v = st.tensor(n).unwrap();
            (
                n.to_string(),
                v.dtype(),
                v.shape().to_vec(),
                v.data().to_vec(),
            )
        })
        .collect();
    f(&mut tensors, &mut meta);
    let views: Vec<(&str, Dtype, &[usize], &[u8])> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    let mut out = Vec::new();
    write_safetensors(&views, &meta, &mut out).unwrap();
    out
}

fn tensor<'a>(t: &'a mut [Owned], name: &str) -> &'a mut Owned {
    t.iter_mut().find(|x| x.0 == name).unwrap()
}

/// `apply_delta` refuses `bytes` with an error containing every needle, and
/// leaves the state exactly as it was.
fn refused(base: &TensorSet, bytes: &[u8], needles: &[&str]) -> Error {
    let mut state = base.clone();
    let e = apply_delta(&mut state, bytes).unwrap_err();
    let msg = e.to_string();
    for n in needles {
        assert!(msg.contains(n), "`{msg}` lacks `{n}`");
    }
    assert_same(&state, base, "state after a refused delta");
    e
}

const Q: &str = "model.layers.0.self_attn.q_proj.weight";

#[test]
fn bad_trl_deltas_are_refused() {
    let raw = reference_delta("v3", "raw", 13);
    let gap = reference_delta("v3", "gap_delta", 13);
    let v1 = reference_delta("v1", "gap_delta", 13);
    let base = &raw.base;
    let idx = format!("{Q}.idx");
    let val = format!("{Q}.val");
    let i32_at = |b: &[u8], k: usize| i32::from_le_bytes(b[4 * k..4 * k + 4].try_into().unwrap());

    // A parameter the state does not have.
    let d = edit(&raw.delta, |t, _| {
        tensor(t, &idx).0 = "model.ghost.weight.idx".into();
        tensor(t, &val).0 = "model.ghost.weight.val".into();
    });
    refused(base, &d, &["model.ghost.weight", "not in the local state"]);
    // Values of another dtype.
    let d = edit(&raw.delta, |t, _| tensor(t, &val).1 = Dtype::F16);
    refused(base, &d, &[Q, "values are F16, the parameter is BF16"]);
    // A 2-D index tensor.
    let d = edit(&raw.delta, |t, _| {
        let x = tensor(t, &idx);
        x.2 = vec![1, x.2[0]];
    });
    refused(base, &d, &[Q, "1-D"]);
    // An index past the end (the last one: found after earlier writes, undone).
    let numel: i32 = 256 * 256;
    let d = edit(&raw.delta, |t, _| {
        let b = &mut tensor(t, &idx).3;
        let n = b.len();
        b[n - 4..].copy_from_slice(&numel.to_le_bytes());
    });
    refused(
        base,
        &d,
        &[Q, &format!("index {numel} is beyond {numel} elements")],
    );
    // Indices out of order.
    let d = edit(&raw.delta, |t, _| {
        let b = &mut tensor(t, &idx).3;
        let (a, c) = (i32_at(b, 0), i32_at(b, 1));
        b[..4].copy_from_slice(&c.to_le_bytes());
        b[4..8].copy_from_slice(&a.to_le_bytes());
    });
    refused(base, &d, &[Q, "not strictly ascending"]);
    // More values than indices.
    let d = edit(&raw.delta, |t, _| {
        let x = tensor(t, &val);
        x.3.extend_from_slice(&[0, 0]);
        x.2 = vec![x.2[0] + 1];
    });
    refused(base, &d, &[Q, "indices but"]);
    // The index coding the header names must match the index dtype.
    let d = edit(&raw.delta, |_, m| {
        m.insert("encoding".into(), "gap_delta".into());
    });
    refused(
        base,
        &d,
        &["gap_delta indices must be U16 or U32, found I32"],
    );
    let d = edit(&gap.delta, |_, m| {
        m.insert("encoding".into(), "raw".into());
    });
    refused(base, &d, &["raw indices must be I32"]);
    // nvCOMP's GPU codec: unsupported, clearly.
    let d = edit(&gap.delta, |_, m| {
        m.insert("encoding".into(), "nvcomp_cascaded".into());
    });
    let e = refused(base, &d, &["nvcomp_cascaded", "nvCOMP on a GPU"]);
    assert!(matches!(e, Error::Unsupported { .. }), "{e:?}");
    let d = edit(&gap.delta, |_, m| {
        m.insert("encoding".into(), "zstd".into());
    });
    refused(base, &d, &["encoding", "unknown TRL index encoding `zstd`"]);
    // Header counts that disagree with the payload.
    for (k, v, needle) in [
        ("num_changed_params", "3", "num_changed_params"),
        ("total_changed_elements", "1", "total_changed_elements"),
        ("total_elements", "12", "total_elements"),
        ("sparsity", "0.5", "sparsity"),
        ("sparsity", "1.5", "not within [0, 1]"),
        ("version", "2", "TRL format version `2`"),
        ("model_version", "two", "model_version"),
    ] {
        let d = edit(&gap.delta, |_, m| {
            m.insert(k.into(), v.into());
        });
        refused(base, &d, &[needle]);
    }
    // v1: a changed_params list that is not the file's pairs; mixed layouts.
    let d = edit(&v1.delta, |_, m| {
        m.insert("changed_params".into(), format!("[\"{Q}\"]"));
    });
    refused(base, &d, &["tensors in the file"]);
    let d = edit(&v1.delta, |t, _| {
        t.push(("x.val".into(), Dtype::BF16, vec![0], vec![]));
    });
    refused(base, &d, &["mixes TRL v1"]);
}

/// Uploads a reference bucket (5 steps, v3 gap_delta) and returns the directory.
async fn reference_bucket(store: &Store) -> (tempfile::TempDir, TensorSet) {
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join("bucket");
    let expected = write_bucket(&dir, "v3", "gap_delta", 5);
    upload(&dir, store).await;
    (work, expected)
}

#[tokio::test]
async fn bad_objects_in_a_bucket_are_refused_and_nothing_is_served() {
    // A corrupt delta after the anchor: the error names it, the replica stays
    // at the anchor.
    let (store, _d) = common::local_store();
    let (_w, _) = reference_bucket(&store).await;
    let key = trl_bucket::delta_key(5);
    let good = store.get(&key).await.unwrap().unwrap();
    let bad = edit(&good, |t, _| {
        let b = &mut tensor(t, &format!("{Q}.idx")).3;
        b[..2].copy_from_slice(&u16::MAX.to_le_bytes());
        b[2..4].copy_from_slice(&u16::MAX.to_le_bytes());
    });
    store.put(&key, Bytes::from(bad)).await.unwrap();
    let anchor3 = {
        let b = store
            .get(&trl_bucket::anchor_key(3))
            .await
            .unwrap()
            .unwrap();
        TensorSet::from_safetensors(b.to_vec(), Digests::Compute).unwrap()
    };
    // The newest version it can verify is served: the anchor; the bad step
    // is quarantined with the reason.
    let mut sub = follower(&store);
    let c = moved(&mut sub).await.unwrap();
    assert_eq!(c.version + 1, 3, "{c:?}");
    let e = &c.quarantined[0].error;
    assert!(e.contains(&key), "{e}");
    assert!(e.contains(Q), "{e}");
    assert_eq!(step(&sub), Some(3));
    assert_same(held(&sub), &anchor3, "after a refused delta");
    // Restoring the object lets the follower go on (the quarantined step
    // asked for at once; the loop alone retries it after its backoff).
    store.put(&key, good).await.unwrap();
    let report = sub.catch_up_to(4).await.unwrap();
    assert_eq!((report.version + 1, report.from_anchor), (5, false));

    // A delta whose header names another step than its key.
    let (store, _d) = common::local_store();
    let (_w, _) = reference_bucket(&store).await;
    let moved_delta = store.get(&key).await.unwrap().unwrap();
    store.delete(&key).await.unwrap();
    store
        .put(&trl_bucket::delta_key(4), moved_delta)
        .await
        .unwrap();
    let mut sub = follower(&store);
    let c = moved(&mut sub).await.unwrap();
    let msg = &c.quarantined[0].error;
    assert!(
        msg.contains("says step 5") && msg.contains("step_000004"),
        "{msg}"
    );
    assert_eq!(step(&sub), Some(3));

    // An anchor over the size limit: refused before it is read, nothing held.
    let (store, _d) = common::local_store();
    let (_w, _) = reference_bucket(&store).await;
    let mut sub = follower(&store);
    sub.trl_limits = TrlLimits {
        max_anchor_bytes: 1000,
    };
    let e = sub.catch_up(true).await.unwrap_err();
    assert!(matches!(e, Error::TooLarge { .. }), "{e:?}");
    let q = sub.quarantined();
    assert!(
        q.iter().any(|q| q.error.contains("anchors/step_000003")),
        "{q:?}"
    );
    assert!(sub.sink.held().is_none());

    // A delta under anchors/ (sparse="True"), and an incomplete anchor (TRL
    // #5417's periodic anchors) over a held state.
    let (store, _d) = common::local_store();
    let (_w, _) = reference_bucket(&store).await;
    let mut sub = follower(&store);
    moved(&mut sub).await.unwrap();
    let a3 = store
        .get(&trl_bucket::anchor_key(3))
        .await
        .unwrap()
        .unwrap();
    let partial = edit(&a3, |t, m| {
        t.retain(|x| x.0 != Q);
        let total: usize = t.iter().map(|x| x.3.len() / 2).sum();
        m.insert("num_changed_params".into(), t.len().to_string());
        m.insert("total_changed_elements".into(), total.to_string());
        m.insert("total_elements".into(), total.to_string());
        m.insert("model_version".into(), "6".into());
    });
    store
        .put(&trl_bucket::anchor_key(6), Bytes::from(partial))
        .await
        .unwrap();
    let c = sub.catch_up(true).await.unwrap().unwrap();
    assert!(c.quarantined[0].error.contains("incomplete"), "{c:?}");
    assert_eq!(step(&sub), Some(5));
    let as_anchor = edit(&good_delta(&store).await, |_, m| {
        m.insert("model_version".into(), "9".into());
    });
    store
        .put(&trl_bucket::anchor_key(9), Bytes::from(as_anchor))
        .await
        .unwrap();
    let mut fresh = follower(&store);
    let c = fresh.catch_up(true).await.unwrap().unwrap();
    assert!(c.quarantined[0].error.contains("sparse"), "{c:?}");
    assert_ne!(step(&fresh), Some(9));
}

async fn good_delta(store: &Store) -> Vec<u8> {
    store
        .get(&trl_bucket::delta_key(5))
        .await
        .unwrap()
        .unwrap()
        .to_vec()
}

/// weightcast-written TRL objects are checked with their digests: a delta
/// whose payload was altered (and its BLAKE3 fixed) fails verification.
#[tokio::test]
async fn weightcast_trl_buckets_verify_digests() {
    let (store, _d) = common::local_store();
    write_with_helpers(&store, &TrlOptions::V3, 3).await;
    let key = trl_bucket::delta_key(2);
    let d = store.get(&key).await.unwrap().unwrap();
    // Point the delta at another parameter's base digest: a wrong base.
    let (meta, h) = inspect(&d).unwrap();
    let h = h.unwrap();
    let first = h.tensors.keys().next().unwrap().clone();
    let mut entries: Value = serde_json::from_str(&meta["weightcast.tensors"]).unwrap();
    entries[&first]["base_digest"] = Value::from("0123456789abcdef");
    let bad = edit(&d, |_, m| {
        m.insert("weightcast.tensors".into(), entries.to_string());
    });
    // Only the delta, without the anchor at 3: bootstrap from 1, apply 2.
    store.delete(&trl_bucket::anchor_key(3)).await.unwrap();
    store.put(&key, Bytes::from(bad)).await.unwrap();
    let mut sub = follower(&store);
    let c = moved(&mut sub).await.unwrap();
    let e = &c.quarantined[0].error;
    assert!(e.contains("wrong base"), "{e}");
    assert!(e.contains("step_000002"), "{e}");
    assert_eq!(step(&sub), Some(1));
}

/// Issue 12, done-when: a bucket written by `weightcast publish --layout trl`
/// (the real binary, a two-shard checkpoint, anchor every 3, five steps, one
/// of them without changes) is followed to exactly the last step by the
/// Python reference's reader, for both generations — and by weightcast's own
/// TRL follower with every digest verified.
#[tokio::test]
async fn the_reference_follows_what_publish_layout_trl_writes() {
    for generation in ["v1", "v3"] {
        let (store, dir) = common::local_store();
        let work = tempfile::tempdir().unwrap();
        let state = work.path().join("state");
        let mut g = Generator::new(GeneratorConfig::tiny(21));
        let mut last = None;
        for step in 1..=5u64 {
            if step != 4 {
                g.step();
            }
            let set = g.snapshot();
            // Two shard files, as a sharded trainer writes them.
            let ckpt = work.path().join(format!("ckpt-{step}"));
            std::fs::create_dir_all(&ckpt).unwrap();
            let names: Vec<String> = set.tensors().iter().map(|t| t.name.clone()).collect();
            let (a, b) = names.split_at(names.len() / 2);
            for (i, part) in [a, b].iter().enumerate() {
                let items = part.iter().map(|n| {
                    let j = set.position(n).unwrap();
                    let t = &set.tensors()[j];
                    (n.clone(), t.dtype, t.shape.clone(), set.data(j).to_vec())
                });
                let shard = TensorSet::from_tensors(items).unwrap();
                let f = ckpt.join(format!("model-0000{}-of-00002.safetensors", i + 1));
                shard
                    .write_to(&BTreeMap::new(), &mut std::fs::File::create(f).unwrap())
                    .unwrap();
            }
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_weightcast"))
                .args([
                    "publish",
                    "--quiet",
                    "--layout",
                    "trl",
                    "--trl-generation",
                    generation,
                    "--anchor-every",
                    "3",
                    "--store",
                    store.url(),
                    "--state",
                    s(&state),
                    "--checkpoint",
                    s(&ckpt),
                ])
                .env_remove("WEIGHTCAST_STORE")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let report: Value = serde_json::from_slice(&out.stdout).unwrap();
            let want = if trl_bucket::is_anchor_step(step, 3) {
                "anchor"
            } else {
                "delta"
            };
            assert_eq!(report["kind"], want, "{generation} step {step}: {report}");
            last = Some(set);
        }
        let keys: Vec<String> = store
            .list("")
            .await
            .unwrap()
            .into_iter()
            .map(|l| l.key)
            .collect();
        assert!(
            keys.iter()
                .all(|k| k.starts_with("anchors/step_") || k.starts_with("deltas/step_")),
            "only TRL's keys: {keys:?}"
        );
        assert!(keys.contains(&"anchors/step_000003.safetensors".to_string()));
        let out = dir.path().with_extension("read.safetensors");
        let report = reference(&["read-bucket", s(dir.path()), "--out", s(&out)]);
        assert_eq!(report["step"], 5, "{generation}");
        assert_same(&load(&out), last.as_ref().unwrap(), generation);
        let mut sub = follower(&store);
        let r = moved(&mut sub).await.unwrap();
        assert!(!r.structural_only && r.version + 1 == 5, "{generation}");
        assert_same(held(&sub), last.as_ref().unwrap(), generation);
    }
}

/// Issue 12, done-when: `weightcast subscribe --once` (the real binary, no
/// flag) recognizes a TRL bucket written by the Python reference — v1, and v3
/// with `gap_delta` — follows it to exactly the last step as
/// `DIR/current/model.safetensors`, and keeps following as steps appear (an
/// anchor in between included).
#[tokio::test]
async fn subscribe_once_follows_reference_trl_buckets() {
    for (generation, encoding) in [("v1", "raw"), ("v3", "gap_delta")] {
        let (store, _bucket) = common::local_store();
        let work = tempfile::tempdir().unwrap();
        let dir = work.path().join("written");
        let out = work.path().join("out");
        for steps in [5u64, 8] {
            let expected = write_bucket(&dir, generation, encoding, steps);
            upload(&dir, &store).await;
            let run = std::process::Command::new(env!("CARGO_BIN_EXE_weightcast"))
                .args([
                    "subscribe",
                    "--once",
                    "--store",
                    store.url(),
                    "--out",
                    s(&out),
                ])
                .env_remove("WEIGHTCAST_STORE")
                .output()
                .unwrap();
            assert!(
                run.status.success(),
                "{generation}: {}",
                String::from_utf8_lossy(&run.stderr)
            );
            let line: Value = serde_json::from_slice(&run.stdout).unwrap();
            // TRL's step = weightcast version + 1.
            assert_eq!(line["version"], steps - 1, "{generation}: {line}");
            let got = load(&out.join("current/model.safetensors"));
            assert_same(&got, &expected, &format!("{generation} at step {steps}"));
        }
    }
}
