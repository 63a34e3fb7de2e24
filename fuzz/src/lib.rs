//! Code shared by the weightcast fuzz targets (see `fuzz/README.md`).
//!
//! The apply targets (`apply_compact`, `apply_trl`) run the same harness,
//! [`check_apply`]; they differ only in their seed corpus.

use std::borrow::Cow;
use std::sync::OnceLock;

use weightcast::codec::{ApplyReport, apply_delta, inspect};
use weightcast::dtype::{read_word, word_bytes};
use weightcast::format::Encoding;
use weightcast::generator::{Generator, GeneratorConfig};
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
