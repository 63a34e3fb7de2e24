//! Crash points for fault-injection tests: `WEIGHTCAST_FAILPOINT=<name>` in
//! the environment makes the process abort (as a `kill -9` would stop it: no
//! unwinding, no flushing) when it reaches the point of that name. Unset, a
//! point costs one cached lookup. The reliability suite drives the real
//! binary through every point and checks that a restart recovers.
//!
//! Points: `publisher.before_commit` (objects and journal written, manifest
//! not), `publisher.after_commit` (manifest created, snapshot not yet
//! updated), `publisher.after_latest` (hint written, snapshot not updated);
//! `subscriber.after_begin` (a slot marked dirty, nothing written),
//! `subscriber.after_anchor` (an anchor file moved into the slot),
//! `subscriber.mid_apply` (a delta journaled and applied to the slot, the
//! update unfinished), `subscriber.before_switch` (the slot flushed and
//! recorded clean, `current` not switched), `subscriber.after_switch`
//! (`current` switched, the journal not pruned).

use std::sync::OnceLock;

/// Aborts the process if `WEIGHTCAST_FAILPOINT` names `point`.
pub fn hit(point: &str) {
    static ARMED: OnceLock<Option<String>> = OnceLock::new();
    let armed = ARMED.get_or_init(|| std::env::var("WEIGHTCAST_FAILPOINT").ok());
    if armed.as_deref() == Some(point) {
        eprintln!("weightcast: failpoint `{point}` reached; aborting");
        std::process::abort();
    }
}
