//! Compressed anchors: the `planes` encoding (docs/format.md §5.1).
//!
//! Each tensor's words are cut into independent **chunks** of `chunk_words`
//! words (the last one shorter). Within a chunk, byte `p` of every word forms
//! **plane** `p` (`p = 0` the least significant byte); each plane is stored as
//! one zstd frame, or raw when zstd does not make it smaller (the low byte of
//! bf16, mostly mantissa, is close to random; the high byte, sign and
//! exponent, compresses well). Packed and one-byte dtypes have a single plane:
//! their bytes as they are.
//!
//! The object stays a safetensors file: one `U8` tensor `<name>.planes` per
//! source tensor holding its chunks back to back, the usual anchor metadata
//! (`weightcast.tensors` with the digests of the *decoded* tensors) with
//! `weightcast.encoding = planes`, and the chunk table under
//! `weightcast.planes`. A reader needs only the header to locate and decode
//! any chunk, so chunks decode in parallel, from ranged reads, straight into
//! the destination.
//!
//! Writing is streaming: a [`PlanesWriter`] takes tensors in any order, in
//! pieces of any size, compresses whole chunks in parallel batches and writes
//! them to a sink (a spill file), with memory bounded by the batch size. The
//! header depends on the compressed sizes, so it is known only at
//! [`PlanesWriter::finish`]: **the object is the returned prefix followed by
//! everything written to the sink.**
//!
//! Reading: [`PlanesLayout::parse`] needs only the object's first
//! [`prefix_len`] bytes; [`PlanesDecoder`] decodes the chunks that lie inside
//! any window of object bytes (a ranged GET) into the materialized anchor's
//! data section and checks every digest at the end; [`materialize`] writes the
//! plain (`full`) anchor an object stands for, with bounded memory.
//!
//! The files follow those seams: `layout` (the chunk table and what a header
//! says: where every chunk is and where it decodes to), `kernels` (plane
//! split and join, one worker's zstd state), `write` (the streaming writer)
//! and `read` (decoding: whole objects, windows, materializing).

mod kernels;
mod layout;
mod read;
mod write;

pub use layout::{
    MAX_CHUNK_WORDS, MAX_FRAME_RATIO, MAX_HEADER, PlanesChunk, PlanesLayout, PlanesTable,
    PlanesTensor, SUFFIX, is_planes, prefix_len,
};
pub(crate) use read::decode_object;
pub use read::{PlanesDecoder, decode_object_if_planes, materialize};
pub use write::{CHUNK_WORDS, Finished, LEVEL, PlanesOptions, PlanesWriter, reserved_prefix_len};

#[cfg(test)]
mod tests;
