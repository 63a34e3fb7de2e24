//! Crash points for fault-injection tests: with the cargo feature
//! `failpoints`, `WEIGHTCAST_FAILPOINT=<name>` in the environment makes the
//! process abort (as a `kill -9` would stop it: no unwinding, no flushing)
//! when it reaches the point of that name; unset, a point costs one cached
//! lookup. Without the feature (the default: release binaries, the Python
//! binding) [`hit`] is an empty function and the process reads no such
//! variable. The reliability suite (`scripts/test.sh` builds it with
//! `--features failpoints`) drives the real binary through every point and
//! checks that a restart recovers.
//!
//! Points: `publisher.mid_upload` (the first object of a version uploaded,
//! the rest not), `publisher.after_part` (a distributed rank's part written,
//! the version's commit not yet seen), `publisher.before_commit` (objects
//! and journal written, manifest not), `publisher.after_commit` (manifest
//! created, snapshot not yet updated), `publisher.after_latest` (hint
//! written, snapshot not updated), `publisher.before_record` (the snapshot
//! brought to the committed version — patched in place, the delta moved into
//! the overlay, or the anchor's files swapped in — `state.json` not yet
//! updated); `relay.before_commit` (a version's
//! objects copied, its manifest not);
//! `subscriber.after_begin` (a slot marked dirty, nothing written),
//! `subscriber.after_anchor` (an anchor file moved into the slot),
//! `subscriber.mid_apply` (a delta journaled and applied to the slot, the
//! update unfinished), `subscriber.before_switch` (the slot flushed and
//! recorded clean, `current` not switched), `subscriber.after_switch`
//! (`current` switched, the journal not pruned).

/// Aborts the process if `WEIGHTCAST_FAILPOINT` names `point`.
#[cfg(feature = "failpoints")]
pub fn hit(point: &str) {
    use std::sync::OnceLock;
    static ARMED: OnceLock<Option<String>> = OnceLock::new();
    let armed = ARMED.get_or_init(|| std::env::var("WEIGHTCAST_FAILPOINT").ok());
    if armed.as_deref() == Some(point) {
        eprintln!("weightcast: failpoint `{point}` reached; aborting");
        std::process::abort();
    }
}

/// Does nothing: this build has no crash points (enable the cargo feature
/// `failpoints`).
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn hit(_point: &str) {}
