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
//! The data path reads top to bottom:
//!
//! - [`dtype`]: what the codec needs to know about each safetensors dtype (word
//!   width, the ordered-key bijection used for "ulp steps").
//! - [`digest`]: additive per-element digests, so verifying a delta costs time
//!   proportional to the changed elements, not to the model.
//! - [`tensors`]: [`tensors::TensorSet`], named tensors in one buffer, read from
//!   and written to safetensors.
//! - [`format`](mod@format): the object header — metadata keys, their types, validation.
//! - [`codec`]: diff, encode, decode, apply (`compact` and `trl`; to a
//!   [`tensors::TensorSet`] or verified in place into buffers the caller owns),
//!   anchors (`full`, and `planes`: byte planes + zstd in independent chunks).
//! - [`platform`]: CPU feature detection and dispatch, once for the crate
//!   (`WEIGHTCAST_SIMD=off` selects the portable code everywhere).
//! - [`store`]: the bucket — any object store opened by URL (`hf://` included),
//!   with multipart and streamed uploads, size-bounded and conditional reads,
//!   conditional creates and a probe for stores that ignore conditions.
//! - [`protocol`]: the bucket layout and the commit protocol — objects first,
//!   then a manifest created only if absent, then the `latest.json` hint;
//!   bridged anchors; retention that honours registered lagging subscribers.
//! - [`publisher`]: checkpoints (single file or Hugging Face shards) to
//!   committed anchors and deltas, with a persisted, verified snapshot.
//! - [`subscriber`]: catch up from the bucket (the cheaper of replaying from
//!   local state and starting from the newest anchor) and verify, from small
//!   parts (version source, planner, fetcher, sinks, daemon); the output
//!   directory alternates between slots patched in place behind an atomically
//!   switched `current` symlink, or the tensors stay in memory.
//! - [`notify`]: authenticated notifications (BLAKE3-keyed MAC) and subscriber
//!   registrations in the bucket.
//! - [`hooks`]: engine hand-off after each version (SGLang, vLLM, webhook,
//!   command), with the engine pause measured.
//! - [`server`]: the subscriber's HTTP endpoint (`/v1/notify`, `/v1/status`,
//!   `/healthz`, `/metrics`) and the publisher daemon's (`POST /v1/publish`),
//!   each `run(listener, state, shutdown)` so tests bind port 0.
//! - [`generator`]: a synthetic RL-step generator with realistic statistics, for
//!   tests, benchmarks and the demo.
//! - [`bench`](mod@bench): the codec benchmark behind `weightcast bench codec`.
//! - [`demo`]: the end-to-end demo behind `weightcast demo`.
//!
//! The binary (`src/bin/weightcast/`) is a thin command-line layer over these.
//!
//! ## Example
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

pub mod bench;
pub mod codec;
#[cfg(feature = "store")]
pub mod demo;
pub mod digest;
pub mod dtype;
pub mod error;
pub mod failpoint;
pub mod format;
pub mod generator;
#[cfg(feature = "store")]
pub mod hooks;
#[cfg(feature = "store")]
pub mod http;
#[cfg(feature = "store")]
pub mod notify;
pub mod platform;
#[cfg(feature = "store")]
pub mod protocol;
#[cfg(feature = "store")]
pub mod publisher;
#[cfg(feature = "store")]
pub mod store;
#[cfg(feature = "store")]
pub mod subscriber;
pub mod tensors;

pub use error::{Error, Result};
