//! Diff, encode, decode and apply: turning two
//! [`TensorSet`](crate::tensors::TensorSet)s into a delta
//! object and a delta object back into exact bytes, plus anchors.
//!
//! Applies are all-or-nothing per object. [`apply_delta`] patches a
//! [`TensorSet`](crate::tensors::TensorSet) in one pass and undoes every word it wrote if anything fails
//! to decode or verify; [`apply_in_place`] patches buffers the caller owns,
//! verifying every tensor before writing any; [`Delta`] serves tensors that
//! live elsewhere (positions out, old words in, new words out). All of them
//! run the same decoders (see `apply/`).
//!
//! This module is a facade: each item lives in the file of its idea —
//! `encode` (deltas out), `parse` (deltas in: checks and jobs), `apply`
//! (the strategies), `anchor` (anchor objects, both ways), `header` (what
//! every object's header is made of), and the encodings `compact`, `trl`
//! and `planes` over `scan` and `bits`.

pub mod anchor;
mod apply;
pub mod bits;
pub mod compact;
mod encode;
mod header;
mod parse;
pub mod planes;
pub mod scan;
pub mod trl;

pub use crate::digest::tensor_digest_of;
pub use anchor::{
    AnchorObject, anchor_prefix, decode_anchor, encode_anchor, encode_anchor_compressed,
    expand_following, inspect, materialize_anchor, planes_prefix_len, read_anchor, write_anchor,
    write_anchor_compressed, write_anchor_planes,
};
pub use apply::{
    ApplyReport, Changes, Delta, InPlaceOptions, InPlaceReport, Positions, Prepared, Target,
    TensorChange, apply_delta, apply_delta_ctx, apply_in_place, apply_in_place_all,
    apply_in_place_all_ctx, apply_in_place_with, carried_metadata, prepare_in_place_all,
    prepare_in_place_all_ctx,
};
pub use compact::vector;
pub use compact::{Context, ContextId, TensorContext};
pub use encode::{
    COMPACT2_MAX_DENSITY, DeltaOptions, DeltaSummary, TensorChanges, encode_delta,
    encode_delta_changes, encode_delta_ctx, sampled_density,
};
pub use header::{AnchorSummary, keep_trainer_metadata};

/// The cache hints the codec's scatter loops use, under their old path
/// (`codec::cpu::prefetch_l2`): re-exported from [`crate::platform`], where
/// CPU detection and dispatch live and where the codec itself takes them.
pub mod cpu {
    pub use crate::platform::{prefetch, prefetch_l2};
}
