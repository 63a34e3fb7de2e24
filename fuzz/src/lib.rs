//! Code shared by the weightcast fuzz targets (see `fuzz/README.md`).
//!
//! The apply targets (`apply_compact`, `apply_trl`) run the same harness,
//! [`check_apply`]; they differ only in their seed corpus. The bucket-protocol
//! targets (`manifest`, `latest`, `registration`, `notification`) each have
//! their own `check_*`.

use std::borrow::Cow;
use std::sync::OnceLock;

use weightcast::codec::{ApplyReport, apply_delta, inspect};
use weightcast::dtype::{read_word, word_bytes};
use weightcast::format::Encoding;
use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::protocol::registry::{MAX_REGISTRATION_BYTES, valid_id};
use weightcast::protocol::{
    LATEST_KEY, Latest, MAX_OBJECT_BYTES, Manifest, Registration, fleet, is_safe_file_name,
    read_latest, registrations,
};
use weightcast::store::Store;
use weightcast::tensors::TensorSet;

/// Seed of the generator model every apply seed is made against
/// (`examples/fuzz_seeds.rs` must use the same one).
pub const BASE_SEED: u64 = 1;

/// The fixed base state: `Generator::new(GeneratorConfig::tiny(BASE_SEED)).snapshot()`,
/// built once per process.
pub fn base() -> &'static TensorSet {
    static BASE: OnceLock<TensorSet> = OnceLock::new();
    BASE.get_or_init(|| Generator::new(GeneratorConfig::tiny(BASE_SEED)).snapshot())
}

const HASH_KEY: &[u8] = b"\"weightcast.payload_blake3\":\"";

/// Rewrites the 64 hex digits of `weightcast.payload_blake3` (when the header
/// has that key) to the BLAKE3 of the input's real data section.
///
/// Without this, almost every mutation of a weightcast delta stops at the
/// payload hash check and the decoders behind it are never reached. The
/// rewrite is in place (same length), so offsets stay valid. Inputs without the
/// key, or too short to have a header, are returned unchanged.
pub fn fix_payload_hash(data: &[u8]) -> Cow<'_, [u8]> {
    let Some(len) = data.get(..8) else {
        return Cow::Borrowed(data);
    };
    let n = u64::from_le_bytes(len.try_into().expect("8 bytes"));
    let Some(end) = usize::try_from(n)
        .ok()
        .and_then(|n| n.checked_add(8))
        .filter(|&e| e <= data.len())
    else {
        return Cow::Borrowed(data);
    };
    let header = &data[8..end];
    let Some(at) = header
        .windows(HASH_KEY.len())
        .position(|w| w == HASH_KEY)
        .map(|p| 8 + p + HASH_KEY.len())
    else {
        return Cow::Borrowed(data);
    };
    if at + 64 > end {
        return Cow::Borrowed(data);
    }
    let hex = blake3::hash(&data[end..]).to_hex();
    if &data[at..at + 64] == hex.as_bytes() {
        return Cow::Borrowed(data);
    }
    let mut out = data.to_vec();
    out[at..at + 64].copy_from_slice(hex.as_bytes());
    Cow::Owned(out)
}

/// The apply harness: applies the (hash-fixed) input to a clone of [`base`]
/// and checks the library's invariants.
///
/// - On `Err`: the state is exactly the base (every tensor's bytes and digest,
///   and the file digest) — apply is all-or-nothing.
/// - On `Ok`: the incrementally maintained digests equal a full recomputation;
///   only tensors named in the report changed; no more words changed than the
///   report counts (exactly that many for `compact`, which never lists an
///   unchanged word); for verified deltas the result has the header's digest
///   and the base had its base digest.
pub fn check_apply(data: &[u8]) {
    let base = base();
    let input = fix_payload_hash(data);
    let mut state = base.clone();
    match apply_delta(&mut state, &input) {
        Err(e) => assert_unchanged(base, &state, &e.to_string()),
        Ok(report) => check_applied(base, &state, &input, &report),
    }
}

fn assert_unchanged(base: &TensorSet, state: &TensorSet, err: &str) {
    assert!(
        state.has_digests(),
        "digests invalidated by a failed apply ({err})"
    );
    assert_eq!(state.len(), base.len());
    for (i, (b, s)) in base.tensors().iter().zip(state.tensors()).enumerate() {
        assert!(
            base.data(i) == state.data(i),
            "failed apply ({err}) left tensor `{}` modified",
            b.name
        );
        assert_eq!(
            b.digest, s.digest,
            "failed apply ({err}) changed the digest of tensor `{}`",
            b.name
        );
    }
    assert_eq!(base.digest(), state.digest(), "failed apply ({err})");
}

fn check_applied(base: &TensorSet, state: &TensorSet, input: &[u8], report: &ApplyReport) {
    assert!(state.has_digests());
    let mut fresh = state.clone();
    fresh.compute_digests();
    let mut differing = 0u64;
    for (i, (t, f)) in state.tensors().iter().zip(fresh.tensors()).enumerate() {
        assert_eq!(
            t.digest, f.digest,
            "incremental digest of `{}` differs from a full recomputation",
            t.name
        );
        let wb = word_bytes(t.dtype);
        let (old, new) = (base.data(i), state.data(i));
        let d = (0..old.len() / wb)
            .filter(|&j| read_word(old, wb, j) != read_word(new, wb, j))
            .count() as u64;
        if d > 0 {
            assert!(
                report.changed_tensors.contains(&t.name),
                "tensor `{}` changed but is not in the report",
                t.name
            );
        }
        differing += d;
    }
    assert!(
        differing <= report.changed,
        "{differing} words changed, report says {}",
        report.changed
    );
    if report.encoding == Encoding::Compact {
        assert_eq!(
            differing, report.changed,
            "compact lists only changed words"
        );
    }
    if report.verified {
        let (_, h) = inspect(input).expect("applied, so the header parses");
        let h = h.expect("verified, so it has a weightcast header");
        assert_eq!(
            state.digest(),
            h.digest,
            "verified apply, wrong result digest"
        );
        assert_eq!(Some(base.digest()), h.base_digest);
    }
}

// ---------------------------------------------------------------------------
// Bucket-protocol and notification parsers: everything a bucket writer or a
// network peer hands a reader besides tensor objects.

/// The secret notifications are signed with (seeds use it too).
pub const NOTIFY_SECRET: &str = "weightcast-fuzz-notify-secret";
/// The receiver's clock for notifications (seeds carry timestamps near it).
pub const NOW: u64 = 1_700_000_000;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime")
    })
}

fn memory_store() -> Store {
    Store::open("memory://").expect("an in-memory store")
}

/// `Manifest::parse`: no panic; an error names the manifest and is of kind
/// `Corrupt`; an accepted manifest validates, lists only safe names and
/// bounded sizes, and survives a serialize/parse round trip unchanged.
pub fn check_manifest(data: &[u8]) {
    const KEY: &str = "versions/00000000000000000007.json";
    match Manifest::parse(data, KEY) {
        Err(e) => {
            assert!(
                e.to_string().contains(KEY),
                "error does not name the key: {e}"
            );
            assert_eq!(e.kind(), weightcast::error::ErrorKind::Corrupt, "{e}");
        }
        Ok(m) => {
            m.validate().expect("a parsed manifest validates");
            for o in &m.objects {
                assert!(is_safe_file_name(&o.name), "unsafe name {:?}", o.name);
                assert!(o.size <= MAX_OBJECT_BYTES);
            }
            for f in &m.files {
                assert!(is_safe_file_name(&f.name), "unsafe file {:?}", f.name);
            }
            let _ = (m.replay_bytes(), m.bootstrap_bytes());
            let again = serde_json::to_vec(&m).expect("serializes");
            let back = Manifest::parse(&again, KEY).expect("a written manifest parses");
            assert_eq!(back, m, "round trip");
        }
    }
}

/// `read_latest` on the input as `latest.json`: no panic; accepted only when
/// at most 4 KiB and exactly what `Latest` deserializes; an error is of kind
/// `Corrupt` and names the key; a read with the returned ETag sees no change.
pub fn check_latest(data: &[u8]) {
    runtime().block_on(async {
        let store = memory_store();
        store
            .put(LATEST_KEY, bytes::Bytes::copy_from_slice(data))
            .await
            .expect("memory put");
        match read_latest(&store, None).await {
            Ok(Some((l, etag))) => {
                assert!(data.len() <= 4096, "{} bytes accepted", data.len());
                let want: Latest = serde_json::from_slice(data).expect("accepted, so it parses");
                assert_eq!(l, want);
                if let Some(e) = etag {
                    assert!(
                        read_latest(&store, Some(&e))
                            .await
                            .expect("re-read")
                            .is_none()
                    );
                }
            }
            Ok(None) => panic!("an existing latest.json read as absent"),
            Err(e) => {
                assert_eq!(e.kind(), weightcast::error::ErrorKind::Corrupt, "{e}");
                assert!(e.to_string().contains(LATEST_KEY), "{e}");
            }
        }
    });
}

/// `registrations` and `fleet` with the input as one registration beside a
/// good one: never an error (an unreadable registration is skipped), the good
/// one always listed, the input listed exactly when it is small enough, parses
/// and has a valid id; every listed id is valid.
pub fn check_registration(data: &[u8]) {
    runtime().block_on(async {
        let store = memory_store();
        let good = Registration {
            id: "good".into(),
            notify_url: Some("http://127.0.0.1:8480/v1/notify".into()),
            version: Some(3),
            quarantined: Vec::new(),
            updated_at: NOW,
        };
        store
            .put(
                "subscribers/good.json",
                serde_json::to_vec(&good).expect("serializes").into(),
            )
            .await
            .expect("memory put");
        store
            .put("subscribers/fuzz.json", bytes::Bytes::copy_from_slice(data))
            .await
            .expect("memory put");
        let regs = registrations(&store).await.expect("never an error");
        let input = (data.len() as u64 <= MAX_REGISTRATION_BYTES)
            .then(|| serde_json::from_slice::<Registration>(data).ok())
            .flatten()
            .filter(|r| valid_id(&r.id));
        assert_eq!(regs.len(), 1 + usize::from(input.is_some()));
        assert!(regs.contains(&good));
        if let Some(r) = input {
            assert!(regs.contains(&r));
        }
        assert!(regs.iter().all(|r| valid_id(&r.id)));
        let f = fleet(&store).await.expect("fleet");
        assert_eq!(f.subscribers.len(), regs.len());
    });
}

/// Input layout: byte 0 flags (bit 0: replace the signature by a correct one
/// for the input's timestamp and body), byte 1 the timestamp header's length
/// (mod 32), the timestamp header, one byte the signature header's length
/// (mod 128), the signature header, the rest the body. Header bytes that are
/// not UTF-8 count as absent headers (as the server treats them).
///
/// `Key::verify` never panics and accepts exactly a timestamp within five
/// minutes of [`NOW`] with the keyed hash of that timestamp and the body
/// (hex in either case); an accepted body that parses as a `Notification`
/// round-trips.
pub fn check_notification(data: &[u8]) {
    use weightcast::notify::{Key, MAX_SKEW, Notification};
    static KEY: OnceLock<Key> = OnceLock::new();
    let key = KEY.get_or_init(|| Key::new(NOTIFY_SECRET).expect("a long enough secret"));
    let mut rest = data;
    let mut take = |n: usize| {
        let n = n.min(rest.len());
        let (head, tail) = rest.split_at(n);
        rest = tail;
        head
    };
    let flags = take(1).first().copied().unwrap_or(0);
    let ts_len = take(1).first().copied().unwrap_or(0) as usize % 32;
    let ts = std::str::from_utf8(take(ts_len)).ok();
    let sig_len = take(1).first().copied().unwrap_or(0) as usize % 128;
    let sig_bytes = take(sig_len).to_vec();
    let body = rest;
    let parsed_ts = ts.and_then(|t| t.parse::<u64>().ok());
    let signed;
    let sig = match (flags & 1, parsed_ts) {
        (1, Some(t)) => {
            signed = key.sign(t, body);
            Some(signed.as_str())
        }
        _ => std::str::from_utf8(&sig_bytes).ok(),
    };
    let accepted = key.verify(ts, sig, body, NOW).is_ok();
    let expected = match (parsed_ts, sig.and_then(|s| s.strip_prefix("v1="))) {
        (Some(t), Some(hex)) => {
            t.abs_diff(NOW) <= MAX_SKEW.as_secs()
                && key.sign(t, body)[3..].eq_ignore_ascii_case(hex)
        }
        _ => false,
    };
    assert_eq!(accepted, expected, "ts {ts:?} sig {sig:?}");
    if accepted && let Ok(n) = serde_json::from_slice::<Notification>(body) {
        let again = serde_json::to_vec(&n).expect("serializes");
        assert_eq!(serde_json::from_slice::<Notification>(&again).ok(), Some(n));
    }
}
