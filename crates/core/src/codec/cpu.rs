//! The cache hints the codec's scatter loops use, re-exported from
//! [`crate::platform`] (where CPU detection and dispatch live) so that
//! `codec::cpu::prefetch_l2` keeps working; new code should name
//! `crate::platform` directly.

pub use crate::platform::{prefetch, prefetch_l2};
