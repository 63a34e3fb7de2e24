//! The apply path: a delta's jobs (one per changed tensor, built by
//! `codec::parse`) run against the words they change, for three callers:
//!
//! - [`apply_delta`](super::apply_delta) on a [`TensorSet`]: one pass that
//!   writes as it decodes and keeps what it needs to undo (step-coded blocks
//!   nothing, raw-coded blocks and TRL payloads the overwritten words), then
//!   compares every digest with the publisher's and undoes everything on a
//!   mismatch;
//! - [`apply_in_place`] on buffers the caller owns (an engine's tensors, a
//!   memory-mapped file): **verify first, then write**. Pass 1 decodes every
//!   changed tensor against the current bytes without writing and checks that
//!   the sum of the digest changes equals `digest − base_digest` from the
//!   header (so every element the delta changes holds exactly its base
//!   value); only when every tensor passes does pass 2 write, from what pass 1
//!   kept where that fitted a bounded buffer, by decoding again elsewhere;
//! - [`Delta`]: the same decoders for tensors that live elsewhere (a GPU):
//!   [`Delta::changed_positions`], then [`Delta::resolve`] given the old words
//!   the caller gathered at those positions.
//!
//! All three share the block decoders and the resolution of a change (old
//! word in, new word and digest change out) of `codec::compact`, and one TRL
//! loop here.
//!
//! The files follow the strategies: `one_pass` (with undo), `in_place`
//! (verify, then write; or prepare, then commit), `elsewhere` (positions
//! out, words in), over what they share (`work`: a job's words, the tally
//! and the checks; `trl`: the one TRL loop).

mod elsewhere;
mod in_place;
mod one_pass;
mod trl;
mod work;

pub use elsewhere::{Changes, Delta, Positions};
pub use in_place::{
    InPlaceOptions, InPlaceReport, Prepared, Target, TensorChange, apply_in_place,
    apply_in_place_all, apply_in_place_all_ctx, apply_in_place_with, prepare_in_place_all,
    prepare_in_place_all_ctx,
};
pub use one_pass::{ApplyReport, apply_delta, apply_delta_ctx, carried_metadata};

#[cfg(test)]
mod tests;
