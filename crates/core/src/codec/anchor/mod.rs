//! Anchor objects (full weights): written raw (`full`) or compressed
//! (`planes`, docs/format.md §5.1), and read back by the one anchor decoder
//! (`read`: in memory or in a file, every digest checked against the
//! anchor's header).

mod read;
mod write;

pub use read::{
    AnchorObject, decode_anchor, expand_following, expand_planes, inspect, materialize_anchor,
    read_anchor,
};
pub use write::{
    anchor_prefix, encode_anchor, encode_anchor_compressed, planes_prefix_len, write_anchor,
    write_anchor_compressed, write_anchor_planes,
};
