//! # weightcast-core
//!
//! The format and codec of [weightcast](https://docs.rs/weightcast): everything
//! that runs per element, and nothing that talks to a network. The
//! `weightcast` crate re-exports every module under the same path
//! (`weightcast::codec`, `weightcast::tensors`, …); use it, not this crate,
//! unless you need the codec without the store layer's dependencies.
//!
//! - [`dtype`]: word widths, the ordered-key bijection behind "ulp steps".
//! - [`digest`]: additive per-element digests (verifying a delta costs time
//!   proportional to the changes).
//! - [`platform`]: CPU feature detection once, safe wrappers;
//!   `WEIGHTCAST_SIMD=off`.
//! - [`tensors`]: [`tensors::TensorSet`], named tensors over owned,
//!   memory-mapped or caller-lent buffers.
//! - [`format`](mod@format): object metadata.
//! - [`codec`]: diff, encode, decode, apply (`compact` and `trl`), anchors
//!   (`full`, and `planes`: byte planes + zstd in independent chunks). A
//!   facade over one file per idea: `encode`, `parse`, `apply/`,
//!   `anchor/`, `header`, and the encodings `compact/`, `trl`, `planes/`.
//! - [`generator`]: synthetic RL steps; [`bench`](mod@bench): the codec
//!   benchmark.
//! - [`error`]: the typed error, classified by what the caller should do.
//!
//! It is a crate of its own so that it builds at opt-level 3 while the
//! orchestration above it builds at 1, and in parallel with the network
//! stack (docs/benchmarks.md, "Build time").

#![warn(missing_docs)]

pub mod bench;
pub mod codec;
pub mod digest;
pub mod dtype;
pub mod error;
pub mod format;
pub mod generator;
pub mod platform;
pub mod tensors;

pub use error::{Error, Result};
