//! The subscriber: follows the bucket, verifies every version, and hands it
//! to a sink — an output directory engines load, or tensors in memory.
//!
//! # Parts
//!
//! | part | module | does |
//! |---|---|---|
//! | version source | [`source`] | learns the newest committed version: a conditional GET of `latest.json` per poll, a `versions/` listing after the held version for certainty, early wake-ups on notifications, jittered intervals |
//! | planner | [`plan`] | from the held version and the target's manifest: replay the versions in between, or start from the anchor (pure [`plan::choose`], manifests read by [`plan::plan`]) |
//! | fetcher | [`fetch`] | reads the store (counting requests); small objects into memory, large ones as concurrent ranged GETs into a file; every object checked against its manifest entry (size, BLAKE3) |
//! | sink | [`sink`], [`dir`] | applies verified objects: [`DirSink`] (an output directory of A/B slots patched in place) or [`MemorySink`] (tensors in memory, the caller's own buffers included) |
//! | daemon | [`daemon`] | the loop: source → plan → fetch → sink → hooks → status and registration; `subscribe --once` is one iteration of it |
//!
//! [`Subscriber`] composes a [`Fetcher`], a [`VersionSource`] and any
//! [`Sink`]: [`Subscriber::catch_up`] is one catch-up. A relay or a Python
//! binding is another composition (another sink, or the fetcher feeding
//! something else), not another loop.
//!
//! # Catching up
//!
//! From the held version `a` to the newest `b`: replay the deltas after `a`
//! (across bridged anchors) when they add up to less than `b`'s anchor plus
//! the deltas after it, otherwise start from that anchor. Every object's size
//! and BLAKE3 are checked against the manifest, every anchor's digests
//! against its header, every delta against the exact base it was made from
//! (digests). A replay that fails verification is repaired by starting again
//! from the anchor; a failure there is an error, and the sink's visible state
//! stays as it was. Objects of the next versions download while the current
//! one is applied (a bounded prefetch, [`PREFETCH_BYTES`]).
//!
//! # The output directory
//!
//! ```text
//! DIR/current -> slots/<a|b|...>       symlink, switched atomically (rename of a new symlink)
//! DIR/slots/<name>/<checkpoint files>  one version per slot, plain safetensors files
//! DIR/.state.json                      per slot: version, dirty flag, per-file layout, digests, BLAKE3s
//! DIR/.journal/<version>...            verified delta and file objects of the last versions
//! ```
//!
//! The slot `current` points to is never written. A version is produced in
//! the oldest other slot, patched in place: marked dirty (state fsynced),
//! brought forward by the journal's objects of the versions it missed
//! (nothing downloaded), the new deltas applied through a shared memory map,
//! files the version no longer lists removed, everything flushed, the slot
//! recorded clean at its version (state fsynced), and only then `current`
//! switched. No version copies the model: anonymous memory follows the
//! changes, and the bytes written are the changed elements (the kernel writes
//! back whole pages). See [`dir`] for the details.
//!
//! **Crash safety.** Every visible name switches by a rename, and data is
//! durable before the name that exposes it: slot files (msync, fsync) before
//! the state records the slot clean, the state before `current` switches. A
//! crash at any point leaves `current` on a complete, recorded version; a slot
//! recorded dirty is never trusted (it is rebuilt from the current slot or an
//! anchor); a crash between the state and the switch is finished at the next
//! start. At start the current slot is verified in full (every tensor digest,
//! every file's BLAKE3) — `--once` does this on every run, so damage to an idle
//! output is found and repaired from the anchor into another slot.
//!
//! **Engines.** With N slots (`--slots N`, default 2), the files of a version
//! stay untouched until N−1 newer versions have been switched in. Hooks run
//! after each switch and before the next update starts, so an engine that
//! reloads within its hook is safe with two slots; one that keeps reading the
//! previous version's files for longer needs more.

pub mod daemon;
pub mod dir;
pub mod fetch;
pub mod lent;
pub mod plan;
pub mod register;
pub mod sink;
pub mod source;
pub mod status;
pub mod step;
pub mod trl;
pub mod update;

pub use daemon::{Daemon, DaemonConfig, catch_up, once, run};
pub use dir::{DirSink, MAX_SLOTS};
pub use fetch::Fetcher;
pub use lent::LentSink;
pub use plan::Plan;
pub use register::{REGISTRATION_REFRESH, Registrar};
pub use sink::{AnchorDest, AnchorObject, MemorySink, Produced, Sink, decode_anchor};
pub use source::{Seen, VersionSource};
pub use step::{CaughtUp, PREFETCH_BYTES, Quarantined, Subscriber};
pub use update::{Log, StepOptions, Update};
