//! # weightcast
//!
//! Moves reinforcement-learning policy weights from a trainer to rollout fleets
//! through object storage, shipping only the bytes that changed, bit-identically.
//!
//! A publisher writes *anchors* (full weights) and *deltas* (changed elements
//! only) as self-describing safetensors objects; subscribers replay the latest
//! anchor plus the deltas after it and verify the result.
//!
//! ## Layout
//!
//! The data path reads top to bottom (`docs/architecture.md` follows it with
//! a diagram); no module imports one above it.
//!
//! - Format: [`dtype`] (word widths, the ordered-key bijection behind "ulp
//!   steps"), [`digest`] (additive per-element digests: verifying a delta
//!   costs time proportional to the changes), [`platform`] (CPU feature
//!   detection once, safe wrappers; `WEIGHTCAST_SIMD=off`), [`tensors`]
//!   ([`tensors::TensorSet`]: named tensors over owned, memory-mapped or
//!   caller-lent buffers), [`format`](mod@format) (object metadata).
//! - [`codec`]: diff, encode, decode, apply (`compact` and `trl`; to a
//!   [`tensors::TensorSet`] or verified in place into buffers the caller owns),
//!   anchors (`full`, and `planes`: byte planes + zstd in independent chunks).
//! - [`store`]: the bucket — any object store opened by URL (`hf://`
//!   included), parallel multipart uploads, ranged downloads, conditional
//!   creates and reads, the probe for stores that ignore conditions.
//! - [`protocol`]: the bucket layout (`anchors/`, `deltas/`, `files/`,
//!   `versions/`), manifests, the commit, registrations and the fleet view,
//!   retention, and TRL's own layout; [`notify`]: signed notifications.
//! - [`publisher`]: checkpoints (files or memory) to committed versions, with
//!   a memory-mapped snapshot patched in place, alone or as one of W
//!   trainer ranks committing one version per step together
//!   ([`publisher::dist`]); [`subscriber`]: a version
//!   source, a planner, a fetcher and sinks (A/B output slots patched in
//!   place; memory) composed by [`subscriber::Subscriber`], and the daemon
//!   loop; [`hooks`]: engine hand-off after each version; [`relay`]: mirrors
//!   committed versions from an origin prefix into a regional one (verified
//!   on the way, same commit protocol), for fleets in several regions.
//! - [`http`]: the daemons' HTTP surfaces, each `serve(listener, state,
//!   shutdown)`.
//! - Tools: [`generator`] (synthetic RL steps), [`bench`](mod@bench),
//!   [`demo`] (the end-to-end demo), [`failpoint`] (crash points for tests,
//!   with the cargo feature `failpoints`); [`fsio`]: the local file helpers
//!   the publisher and the subscriber share (atomic writes, directory syncs).
//! - [`error`]: the typed error and what the caller should do about each kind
//!   ([`error::ErrorKind`]: HTTP statuses and exit codes in one place).
//!
//! The binary (`src/bin/weightcast/`) is a thin command-line layer over these.
//!
//! ## Example: one library API for every caller
//!
//! A trainer publishes tensors it holds in memory; a subscriber follows the
//! bucket into memory (the CLI, the daemons and the Python binding are
//! compositions of the same parts).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> weightcast::Result<()> {
//! use std::collections::BTreeMap;
//! use weightcast::generator::{Generator, GeneratorConfig};
//! use weightcast::publisher::{Checkpoint, PublishOptions, Publisher, PublisherConfig};
//! use weightcast::store::Store;
//! use weightcast::subscriber::{Subscriber, fetch::Fetcher, sink::MemorySink, source::VersionSource};
//!
//! let bucket = Store::open("memory://")?;
//! let state = tempfile::tempdir().unwrap();
//! let mut publisher = Publisher::open(bucket.clone(), PublisherConfig::new(state.path())).await?;
//! let mut subscriber = Subscriber::new(
//!     Fetcher::new(bucket.clone()),
//!     VersionSource::new(std::time::Duration::from_secs(5), 0.1),
//!     MemorySink::new(),
//! );
//!
//! let mut trainer = Generator::new(GeneratorConfig::tiny(7));
//! for step in 0..3 {
//!     if step > 0 {
//!         trainer.step();
//!     }
//!     let tensors = BTreeMap::from([("model.safetensors".to_string(), trainer.snapshot())]);
//!     let cp = Checkpoint::from_sets(tensors, BTreeMap::new())?;
//!     let published = publisher.publish(cp, &PublishOptions { step: Some(step) }).await?;
//!
//!     let caught = subscriber.catch_up(true).await?.expect("a version");
//!     assert_eq!(caught.version, published.version);
//!     let replica = &subscriber.sink.tensors()["model.safetensors"];
//!     assert_eq!(replica.digest(), trainer.snapshot().digest());
//! }
//! # Ok(())
//! # }
//! ```
//!
//! TLS: weightcast builds one crypto stack, `ring` (for rustls and the
//! stores' request signing); [`store::Store::open`] installs it as the
//! process's rustls provider. An application that builds its own `reqwest`
//! client before opening a store calls [`store::install_crypto_provider`]
//! first (or installs a provider of its own).
//!
//! The codec alone (no store): a delta between two tensor sets, applied and
//! verified.
//!
//! ```
//! use weightcast::codec::{apply_delta, encode_delta, DeltaOptions};
//! use weightcast::format::Encoding;
//! use weightcast::generator::{Generator, GeneratorConfig};
//!
//! let mut g = Generator::new(GeneratorConfig::tiny(7));
//! let v0 = g.snapshot();
//! g.step();
//! let mut v1 = g.snapshot_without_digests();
//! let opts = DeltaOptions::new(Encoding::Compact, 1, 0);
//! let (delta, summary) = encode_delta(&v0, &mut v1, &opts).unwrap();
//! assert!(summary.changed > 0);
//!
//! let mut replica = v0.clone();
//! let report = apply_delta(&mut replica, &delta).unwrap();
//! assert!(report.verified);
//! assert_eq!(replica.digest(), v1.digest());
//! ```

#![warn(missing_docs)]
// The library has no unsafe code: memory maps and SIMD kernels live in
// `weightcast-core`, each with its proof. (The binary, a crate of its own,
// keeps its one `mallopt` call.)
#![forbid(unsafe_code)]

pub use weightcast_core::{
    bench, codec, digest, dtype, error, format, generator, platform, tensors,
};

#[cfg(feature = "store")]
pub mod demo;
pub mod failpoint;
pub mod fsio;
#[cfg(feature = "store")]
pub mod hooks;
#[cfg(feature = "store")]
pub mod http;
#[cfg(feature = "store")]
pub mod notify;
#[cfg(feature = "store")]
pub mod protocol;
#[cfg(feature = "store")]
pub mod publisher;
#[cfg(feature = "store")]
pub mod relay;
#[cfg(feature = "store")]
pub mod store;
#[cfg(feature = "store")]
pub mod subscriber;

pub use error::{Error, Result};
