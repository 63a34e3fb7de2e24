//! Round trips, determinism, streaming, malformed input.

use std::collections::BTreeMap;

use crate::dtype::{Dtype, byte_len};
use crate::format::{Encoding, keys};

use super::*;

use crate::codec::{
    encode_anchor, encode_anchor_compressed, inspect, materialize_anchor, read_anchor,
    write_anchor_compressed, write_anchor_planes,
};
use crate::tensors::{TensorSet, safetensors_header_lens};

fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed;
    (0..n)
        .map(|i| {
            x = crate::digest::fmix64(x.wrapping_add(i as u64));
            // Half the bytes low-entropy, so planes both compress and not.
            if i % 3 == 0 { (x & 3) as u8 } else { x as u8 }
        })
        .collect()
}

const SMALL: PlanesOptions = PlanesOptions {
    chunk_words: 64,
    level: LEVEL,
    batch_bytes: 256,
};

fn planes_bytes(set: &TensorSet, opts: PlanesOptions) -> Vec<u8> {
    let f = write_anchor_planes(set, 3, opts, Vec::new()).unwrap();
    let mut out = f.prefix;
    out.extend_from_slice(&f.sink);
    out
}

/// Every dtype, at sizes around the chunk size (and empty, and 0-d).
fn every_dtype_set() -> TensorSet {
    let mut items = Vec::new();
    for (k, dtype) in [
        Dtype::BOOL,
        Dtype::F4,
        Dtype::F6_E2M3,
        Dtype::F6_E3M2,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8_E5M2,
        Dtype::F8_E4M3,
        Dtype::F8_E8M0,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::C64,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ]
    .into_iter()
    .enumerate()
    {
        // Packed dtypes need whole bytes: element counts multiple of 4.
        for (j, elements) in [0usize, 4, 60, 64, 68, 128, 200, 1000]
            .into_iter()
            .enumerate()
        {
            let shape = vec![elements];
            let len = byte_len(dtype, &shape).unwrap();
            items.push((
                format!("{dtype}.{j}"),
                dtype,
                shape,
                noise((k * 10 + j) as u64, len),
            ));
        }
        let scalar = byte_len(dtype, &[]).filter(|&l| l > 0);
        if let Some(len) = scalar {
            items.push((
                format!("{dtype}.scalar"),
                dtype,
                vec![],
                noise(k as u64, len),
            ));
        }
    }
    TensorSet::from_tensors(items).unwrap()
}

fn assert_same(a: &TensorSet, b: &TensorSet) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.tensors().iter().zip(b.tensors()).enumerate() {
        assert_eq!(
            (&x.name, x.dtype, &x.shape, x.digest),
            (&y.name, y.dtype, &y.shape, y.digest)
        );
        assert!(a.data(i) == b.data(i), "tensor {} differs", x.name);
    }
    assert_eq!(a.digest(), b.digest());
}

#[test]
fn every_dtype_round_trips_and_materializes_to_the_raw_anchor() {
    let set = every_dtype_set();
    let (raw, _) = encode_anchor(&set, 3).unwrap();
    for opts in [SMALL, PlanesOptions::default()] {
        let obj = planes_bytes(&set, opts);
        let (h, back) = read_anchor(obj.clone()).unwrap();
        let h = h.unwrap();
        assert_eq!(h.encoding, Encoding::Planes);
        assert_eq!(h.digest, set.digest());
        assert_same(&set, &back);
        // Materialized: exactly the raw anchor's bytes.
        let mut m = Vec::new();
        let n = materialize_anchor(&obj, &mut m).unwrap();
        assert_eq!(n, m.len() as u64);
        assert!(m == raw, "materialized bytes differ from write_anchor's");
        let layout = PlanesLayout::parse(&obj).unwrap();
        assert_eq!(
            layout.raw_prefix().unwrap(),
            crate::codec::anchor_prefix(&set, 3).unwrap()
        );
        // inspect agrees with read_anchor, and planes anchors are not `format=pt`.
        let (meta, ih) = inspect(&obj).unwrap();
        assert_eq!(ih.as_ref(), Some(&h));
        assert!(!meta.contains_key("format"));
    }
    // A raw anchor materializes as itself.
    let mut m = Vec::new();
    materialize_anchor(&raw, &mut m).unwrap();
    assert_eq!(m, raw);
}

/// The prefix length is known before anything is compressed: it is the same
/// for contents that compress well, not at all, or not at all (every plane
/// raw: the bound itself, nothing padded), and the padded object reads back.
#[test]
fn the_prefix_length_is_reserved_before_the_chunks_exist() {
    let base = every_dtype_set();
    let zeros = TensorSet::from_tensors(
        base.tensors()
            .iter()
            .enumerate()
            .map(|(i, t)| {
                (
                    t.name.clone(),
                    t.dtype,
                    t.shape.clone(),
                    vec![0u8; base.data(i).len()],
                )
            })
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let random = TensorSet::from_tensors(
        base.tensors()
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let mut x = i as u64 + 7;
                let bytes: Vec<u8> = (0..base.data(i).len())
                    .map(|_| {
                        x = crate::digest::fmix64(x.wrapping_add(0x9e37_79b9));
                        x as u8
                    })
                    .collect();
                (t.name.clone(), t.dtype, t.shape.clone(), bytes)
            })
            .collect::<Vec<_>>(),
    )
    .unwrap();
    for opts in [SMALL, PlanesOptions::default()] {
        for set in [&base, &zeros, &random] {
            let reserved = crate::codec::planes_prefix_len(set, 3, &opts).unwrap();
            let f = write_anchor_planes(set, 3, opts, Vec::new()).unwrap();
            assert_eq!(f.prefix.len(), reserved);
            let n = u64::from_le_bytes(f.prefix[..8].try_into().unwrap()) as usize;
            assert_eq!(n + 8, reserved);
            assert!(n.is_multiple_of(8));
            let mut obj = f.prefix;
            obj.extend_from_slice(&f.sink);
            let (_, back) = read_anchor(obj).unwrap();
            assert_same(set, &back);
        }
        // Zeros compress, so their header is padded; random planes are all
        // stored raw at the default chunk size (their header is the bound).
        let f = write_anchor_planes(&zeros, 3, opts, Vec::new()).unwrap();
        assert!(f.prefix.ends_with(b"  "), "zeros: no padding");
    }
    let f = write_anchor_planes(&random, 3, PlanesOptions::default(), Vec::new()).unwrap();
    let json = &f.prefix[8..];
    assert!(
        json.iter().rev().take_while(|&&b| b == b' ').count() < 8,
        "an all-raw header is padded only to a multiple of 8"
    );
}

#[test]
fn generator_weights_compress_and_round_trip() {
    let mut g = crate::generator::Generator::new(crate::generator::GeneratorConfig::tiny(5));
    g.step();
    let set = g.snapshot();
    let (obj, summary) = encode_anchor_compressed(&set, 9).unwrap();
    assert_eq!(summary.bytes, obj.len() as u64);
    let (raw, _) = encode_anchor(&set, 9).unwrap();
    let (h_raw, from_raw) = read_anchor(raw.clone()).unwrap();
    let (h, back) = read_anchor(obj.clone()).unwrap();
    assert_same(&from_raw, &back);
    assert_eq!(h.unwrap().digest, h_raw.unwrap().digest);
    // bf16 weights: the high plane compresses, so the object is smaller.
    assert!(
        (obj.len() as f64) < raw.len() as f64 / 1.2,
        "{} vs {}",
        obj.len(),
        raw.len()
    );
    // The streaming writer through a spill file gives the same bytes.
    let mut streamed = Vec::new();
    let s2 = write_anchor_compressed(&set, 9, &mut streamed).unwrap();
    assert_eq!(streamed, obj);
    assert_eq!(s2.bytes, obj.len() as u64);
}

#[test]
fn parallel_sequential_and_piecewise_writes_give_the_same_bytes() {
    let set = every_dtype_set();
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let four = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    let a = one.install(|| planes_bytes(&set, SMALL));
    let b = four.install(|| planes_bytes(&set, SMALL));
    assert!(a == b, "thread count changed the bytes");
    // Pieces of odd sizes, through the same writer.
    let mut w = PlanesWriter::new(Vec::new(), SMALL).unwrap();
    for (i, t) in set.tensors().iter().enumerate() {
        w.begin_tensor(&t.name, t.dtype, &t.shape).unwrap();
        let mut data = set.data(i);
        let mut step = 1;
        while !data.is_empty() {
            let k = step.min(data.len());
            w.write(&data[..k]).unwrap();
            data = &data[k..];
            step = step * 3 + 1;
        }
        w.end_tensor().unwrap();
    }
    let digests = set
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.digest))
        .collect();
    let f = w.finish(3, &digests).unwrap();
    let mut c = f.prefix;
    c.extend_from_slice(&f.sink);
    assert!(a == c, "piecewise writes changed the bytes");
}

#[test]
fn windowed_decode_equals_whole_decode_in_any_order() {
    let set = every_dtype_set();
    let obj = planes_bytes(&set, SMALL);
    let layout = PlanesLayout::parse(&obj[..prefix_len(&obj).unwrap() as usize]).unwrap();
    let mut whole = vec![0u8; layout.decoded_len() as usize];
    layout.decode_all(&obj, &mut whole).unwrap();
    for max in [1u64, 100, 1000, 1 << 20] {
        let mut windows = layout.windows(max);
        // Windows cover the data section exactly.
        assert_eq!(windows.first().unwrap().start, prefix_len(&obj).unwrap());
        assert_eq!(windows.last().unwrap().end, obj.len() as u64);
        windows.reverse();
        let mut data = vec![0xAAu8; whole.len()];
        let mut dec = PlanesDecoder::new(&layout);
        let mut decoded = 0;
        for w in &windows {
            decoded += dec
                .feed(w.start, &obj[w.start as usize..w.end as usize], &mut data)
                .unwrap();
        }
        assert_eq!(decoded, layout.chunk_count());
        assert!(dec.complete());
        let digests = dec.finish().unwrap();
        assert_eq!(digests.len(), set.len());
        assert!(data == whole, "windows of {max} bytes decode differently");
    }
    // Windows that cut chunks decode only the whole ones; a second pass
    // over overlapping windows completes without decoding twice.
    let mut data = vec![0u8; whole.len()];
    let mut dec = PlanesDecoder::new(&layout);
    let start = prefix_len(&obj).unwrap() as usize;
    let mut n = 0;
    for (a, b) in [(start, start + 777), (start + 777, obj.len())] {
        n += dec.feed(a as u64, &obj[a..b], &mut data).unwrap();
    }
    assert!(n < layout.chunk_count());
    assert!(!dec.complete());
    n += dec.feed(start as u64, &obj[start..], &mut data).unwrap();
    assert_eq!(n, layout.chunk_count());
    dec.finish().unwrap();
    assert!(data == whole);
    // A decoder missing chunks says which.
    let mut dec = PlanesDecoder::new(&layout);
    dec.feed(start as u64, &obj[start..start + 500], &mut data)
        .unwrap();
    let e = dec.finish().unwrap_err().to_string();
    assert!(e.contains("never decoded"), "{e}");
}

#[test]
fn many_small_tensors_keep_the_workers_bounded() {
    let items: Vec<_> = (0..3000)
        .map(|i| (format!("t{i:05}"), Dtype::U8, vec![3], noise(i, 3)))
        .collect();
    let set = TensorSet::from_tensors(items).unwrap();
    let mut w = PlanesWriter::new(Vec::new(), PlanesOptions::default()).unwrap();
    for (i, t) in set.tensors().iter().enumerate() {
        w.tensor(&t.name, t.dtype, &t.shape, set.data(i)).unwrap();
    }
    assert!(w.worker_count() <= PlanesWriter::<Vec<u8>>::max_jobs());
    let digests = set
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.digest))
        .collect();
    let f = w.finish(1, &digests).unwrap();
    let mut obj = f.prefix;
    obj.extend_from_slice(&f.sink);
    let (_, back) = read_anchor(obj).unwrap();
    assert_same(&set, &back);
}

#[test]
fn writer_misuse_is_refused() {
    let mut w = PlanesWriter::new(Vec::new(), SMALL).unwrap();
    assert!(w.write(&[1]).is_err());
    w.begin_tensor("a", Dtype::F32, &[2]).unwrap();
    assert!(w.write(&[0; 9]).is_err());
    w.write(&[0; 4]).unwrap();
    assert!(w.begin_tensor("b", Dtype::U8, &[1]).is_err());
    assert!(w.end_tensor().is_err(), "4 of 8 bytes");
    w.write(&[0; 4]).unwrap();
    w.end_tensor().unwrap();
    assert!(w.begin_tensor("a", Dtype::U8, &[1]).is_err(), "duplicate");
    assert!(w.finish(0, &BTreeMap::new()).is_err(), "digest missing");
    let bad = PlanesOptions {
        chunk_words: 0,
        ..SMALL
    };
    assert!(PlanesWriter::new(Vec::new(), bad).is_err());
}

// --- malformed objects -------------------------------------------------

/// The metadata and the stored tensors (in data order) of an object.
type Parts = (BTreeMap<String, String>, Vec<(String, Vec<u8>)>);

fn parts(obj: &[u8]) -> Parts {
    let st = safetensors::SafeTensors::deserialize(obj).unwrap();
    let (_, m) = safetensors::SafeTensors::read_metadata(obj).unwrap();
    let meta = m
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    let tensors = m
        .offset_keys()
        .into_iter()
        .map(|k| {
            let d = st.tensor(&k).unwrap().data().to_vec();
            (k, d)
        })
        .collect();
    (meta, tensors)
}

fn build(meta: &BTreeMap<String, String>, tensors: &[(String, Vec<u8>)]) -> Vec<u8> {
    let shapes: Vec<[usize; 1]> = tensors.iter().map(|t| [t.1.len()]).collect();
    let lens: Vec<(&str, Dtype, &[usize], usize)> = tensors
        .iter()
        .zip(&shapes)
        .map(|(t, s)| (t.0.as_str(), Dtype::U8, s.as_slice(), t.1.len()))
        .collect();
    let head = safetensors_header_lens(&lens, meta).unwrap();
    let mut out = (head.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&head);
    for t in tensors {
        out.extend_from_slice(&t.1);
    }
    out
}

fn table_of(meta: &BTreeMap<String, String>) -> PlanesTable {
    serde_json::from_str(&meta[keys::PLANES]).unwrap()
}

fn with_table(obj: &[u8], edit: impl FnOnce(&mut PlanesTable)) -> Vec<u8> {
    let (mut meta, tensors) = parts(obj);
    let mut t = table_of(&meta);
    edit(&mut t);
    meta.insert(keys::PLANES.into(), serde_json::to_string(&t).unwrap());
    build(&meta, &tensors)
}

/// Both readers refuse `obj`, with an error containing `want`; no panic.
fn refused(obj: &[u8], want: &str) {
    for (what, r) in [
        ("read_anchor", read_anchor(obj.to_vec()).map(|_| ())),
        ("materialize", materialize(obj, &mut Vec::new()).map(|_| ())),
    ] {
        let e = r.expect_err(what).to_string();
        assert!(e.contains(want), "{what}: `{e}` lacks `{want}`");
    }
}

fn bf16_object() -> Vec<u8> {
    // Two tensors; `w` has 3 chunks of 64 words + 1 word, high planes
    // compress, low planes do not.
    let w: Vec<u8> = noise(1, 2 * 193)
        .chunks(2)
        .flat_map(|c| [c[0], 0x3c | (c[1] & 1)])
        .collect();
    let set = TensorSet::from_tensors(vec![
        ("w".to_string(), Dtype::BF16, vec![193], w),
        ("b".to_string(), Dtype::F32, vec![3], noise(2, 12)),
    ])
    .unwrap();
    planes_bytes(&set, SMALL)
}

#[test]
fn malformed_chunk_tables_are_refused() {
    let obj = bf16_object();
    read_anchor(obj.clone()).unwrap();
    let t = table_of(&parts(&obj).0);
    let w = &t.tensors["w"];
    assert!(
        w[0][0] == 64 && w[0][1] < 64,
        "fixture: raw low, framed high: {w:?}"
    );

    refused(&with_table(&obj, |t| t.chunk_words = 0), "chunk_words");
    refused(
        &with_table(&obj, |t| t.chunk_words = MAX_CHUNK_WORDS + 1),
        "chunk_words",
    );
    refused(&with_table(&obj, |t| t.chunk_words = 128), "chunks listed");
    refused(
        &with_table(&obj, |t| {
            t.tensors.get_mut("w").unwrap().pop();
        }),
        "chunks listed",
    );
    refused(
        &with_table(&obj, |t| t.tensors.get_mut("w").unwrap()[1].push(1)),
        "planes listed",
    );
    refused(
        &with_table(&obj, |t| t.tensors.get_mut("w").unwrap()[1][1] = 0),
        "impossible",
    );
    refused(
        &with_table(&obj, |t| t.tensors.get_mut("w").unwrap()[1][1] = 65),
        "impossible",
    );
    // Lengths that do not add up to the stored bytes.
    refused(
        &with_table(&obj, |t| {
            let c = &mut t.tensors.get_mut("w").unwrap()[1];
            c[1] -= 1;
        }),
        "covers",
    );
    refused(
        &with_table(&obj, |t| {
            let c = &mut t.tensors.get_mut("w").unwrap()[0];
            c[1] += 1;
        }),
        "runs past",
    );
    // Shifting one byte between two frames keeps the sum: the frames break.
    let shifted = with_table(&obj, |t| {
        let w = t.tensors.get_mut("w").unwrap();
        w[0][1] += 1;
        w[1][1] -= 1;
    });
    refused(&shifted, "zstd frame");
    refused(
        &with_table(&obj, |t| {
            t.tensors.remove("w");
        }),
        "chunk lists",
    );
    let (mut meta, tensors) = parts(&obj);
    meta.remove(keys::PLANES);
    refused(&build(&meta, &tensors), keys::PLANES);
    meta.insert(keys::PLANES.into(), "[1,2]".into());
    refused(&build(&meta, &tensors), keys::PLANES);
    // The stored tensor renamed, or not U8.
    let (meta, mut tensors) = parts(&obj);
    tensors[0].0.push('x');
    refused(&build(&meta, &tensors), "missing");
    // Truncated object.
    refused(&obj[..obj.len() - 1], "");
    assert!(PlanesLayout::parse(&obj[..20]).is_err());
    assert!(prefix_len(&u64::MAX.to_le_bytes()).is_err());
}

#[test]
fn corrupt_frames_and_planes_are_refused() {
    let obj = bf16_object();
    let layout = PlanesLayout::parse(&obj).unwrap();
    let w = layout.tensors.iter().find(|t| t.name == "w").unwrap();
    let c0 = &w.chunks[0];
    // A byte of the raw low plane: decodes, but the digest differs.
    let mut bad = obj.clone();
    bad[c0.stored.start as usize + 5] ^= 1;
    refused(&bad, "integrity check failed for tensor w");
    // Every byte of the high plane's frame flipped in turn: always refused.
    let frame = c0.stored.start + c0.planes[0]..c0.stored.start + c0.planes[0] + c0.planes[1];
    for i in frame.clone() {
        let mut bad = obj.clone();
        bad[i as usize] ^= 0x40;
        assert!(
            read_anchor(bad.clone()).is_err(),
            "byte {i} flipped was accepted"
        );
        assert!(materialize(&bad, &mut Vec::new()).is_err());
    }
    // A valid frame of the wrong length, and two frames in one plane.
    let mut z = zstd::bulk::Compressor::new(1).unwrap();
    let short = z.compress(&[0x3c; 10]).unwrap();
    let long = z.compress(&[0x3c; 1000]).unwrap();
    for (frame_bytes, want) in [
        (short.clone(), "decodes to 10 bytes"),
        (long, "corrupt zstd frame"),
        ([short.clone(), short].concat(), "zstd frame"),
    ] {
        let (meta, mut tensors) = parts(&obj);
        let i = tensors.iter().position(|t| t.0 == "w.planes").unwrap();
        let old = &tensors[i].1;
        let n0 = c0.planes[0] as usize;
        let n1 = c0.planes[1] as usize;
        let mut data = old[..n0].to_vec();
        data.extend_from_slice(&frame_bytes);
        data.extend_from_slice(&old[n0 + n1..]);
        tensors[i].1 = data;
        let mut meta = meta;
        let mut t = table_of(&meta);
        t.tensors.get_mut("w").unwrap()[0][1] = frame_bytes.len() as u64;
        meta.insert(keys::PLANES.into(), serde_json::to_string(&t).unwrap());
        refused(&build(&meta, &tensors), want);
    }
    // A digest in the header that does not match the data.
    let (mut meta, tensors) = parts(&obj);
    let mut entries: serde_json::Value = serde_json::from_str(&meta[keys::TENSORS]).unwrap();
    entries["b"]["digest"] = "0000000000000001".into();
    meta.insert(keys::TENSORS.into(), entries.to_string());
    refused(
        &build(&meta, &tensors),
        "integrity check failed for tensor b",
    );
}
