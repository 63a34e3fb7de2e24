//! `read_anchor` and `inspect` on untrusted bytes.
//!
//! Beyond "no panic", checks that the two agree (an object `read_anchor`
//! accepts has a header `inspect` parses to the same value), that an accepted
//! anchor's state has the header's digest, and that an accepted object writes
//! back (`encode_anchor`) into an anchor that reads back to the same tensors.

#![no_main]

use libfuzzer_sys::fuzz_target;
use weightcast::codec::{encode_anchor, inspect, read_anchor};

fuzz_target!(|data: &[u8]| {
    let inspected = inspect(data);
    let Ok((header, set)) = read_anchor(data.to_vec()) else {
        return;
    };
    let (_, h) = inspected.expect("read_anchor accepted an object inspect rejects");
    assert_eq!(h, header, "inspect and read_anchor disagree on the header");
    assert!(set.has_digests());
    if let Some(h) = &header {
        assert_eq!(set.digest(), h.digest);
    }

    let version = header.as_ref().map_or(0, |h| h.model_version);
    let (bytes, summary) =
        encode_anchor(&set, version).expect("an accepted object must write back as an anchor");
    assert_eq!(summary.bytes, bytes.len() as u64);
    let (h2, back) = read_anchor(bytes).expect("a written anchor must read back");
    let h2 = h2.expect("written anchors carry a header");
    assert_eq!(h2.model_version, version);
    assert_eq!(back.digest(), set.digest());
    assert_eq!(back.len(), set.len());
    for (i, (a, b)) in set.tensors().iter().zip(back.tensors()).enumerate() {
        assert_eq!(
            (&a.name, a.dtype, &a.shape, a.digest),
            (&b.name, b.dtype, &b.shape, b.digest)
        );
        assert!(
            set.data(i) == back.data(i),
            "tensor `{}` bytes differ",
            a.name
        );
    }
});
