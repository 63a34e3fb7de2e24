//! Reading anchor objects: the one decoder of an anchor, in memory or in a
//! file, raw (`full`) or compressed (`planes`, docs/format.md §5.1).
//!
//! Every anchor a reader loads goes through one function (`load`): a
//! `planes` object is decoded into the raw anchor it stands for (every chunk
//! and digest checked), a raw one has every tensor's digest computed, and
//! both are checked against the anchor's own header. [`read_anchor`] (bytes,
//! plain checkpoints allowed) and [`decode_anchor`] (bytes or a file, a
//! weightcast header required: what a subscriber receives) are its two
//! faces. Also here: [`inspect`] (the header of any object, anchor or delta)
//! and [`materialize_anchor`].

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::codec::header::{entry_matches, metadata_map};
use crate::codec::planes;
use crate::error::{Error, Result};
use crate::format::{Header, Kind, entry_digest, keys};
use crate::tensors::{Digests, TensorSet};

/// An anchor object, downloaded and checked against its manifest entry.
#[derive(Debug)]
pub enum AnchorObject {
    /// In memory.
    Bytes(Vec<u8>),
    /// In a file the caller owns from now on (a subscriber's download, e.g.
    /// where its sink asked for it): [`decode_anchor`] maps it, rewrites a
    /// compressed object into the raw anchor in place, and the caller may
    /// rewrite its header and rename it. Nothing else may write or truncate
    /// it, or create its sibling `<file>.raw`, while it is decoded (the
    /// contract of [`TensorSet::map`]).
    File(PathBuf),
    /// Decoded and checked already (a TRL bucket's anchor, read while a
    /// follower planned: digests computed, TRL's structure checked); a
    /// weightcast header, when it has one, is verified again.
    Tensors(TensorSet),
    /// A `planes` anchor already expanded into the raw anchor at this path
    /// while it downloaded ([`expand_following`]: every chunk and digest
    /// checked against `layout`, the object's size and BLAKE3 matched), in a
    /// file the caller owns as for [`AnchorObject::File`]. The set takes the
    /// layout's digests without another pass.
    Expanded(PathBuf, Box<planes::PlanesLayout>),
}

/// Parses an anchor (or any safetensors checkpoint), computes every digest and,
/// when it carries a weightcast header, verifies them all. Returns the header
/// (`None` for a plain checkpoint, which is loaded unverified).
///
/// A `planes` anchor is decoded (chunks in parallel, each chunk's digest
/// taken while it is in cache) into the tensors of the `full` anchor it
/// stands for; the header returned is its own (`encoding = planes`).
pub fn read_anchor(buf: Vec<u8>) -> Result<(Option<Header>, TensorSet)> {
    load(AnchorObject::Bytes(buf))
}

/// Decodes a weightcast anchor object into a verified tensor set: a
/// compressed object is decoded, every tensor's digest is computed or taken
/// while decoding, and all are checked against the anchor's header, which is
/// returned (the header of the raw anchor the set holds: `encoding = full`).
/// A plain checkpoint without a weightcast header is refused; metadata
/// errors name the anchor (`name`, the tensor file it is for).
///
/// A file is expanded in place when compressed ([`expand_planes`]) and
/// mapped for writing: no copy, the page cache rather than the heap, and the
/// set's writes reach the file.
pub fn decode_anchor(name: &str, object: AnchorObject) -> Result<(Header, TensorSet)> {
    let named = |e| match e {
        Error::Metadata { field, reason } => {
            Error::metadata(field, format!("anchor `{name}`: {reason}"))
        }
        other => other,
    };
    let (header, set) = load(object).map_err(named)?;
    let header =
        match header {
            // Decoded from memory: the set holds the raw anchor, whose header
            // differs from the object's in its encoding.
            Some(h) if planes::is_planes(&h) => Header::from_metadata(set.metadata())
                .map_err(named)?
                .ok_or_else(|| Error::Container("a decoded anchor without its header".into()))?,
            Some(h) => h,
            None => {
                return Err(named(Error::metadata(
                    keys::FORMAT,
                    "missing: not a weightcast anchor",
                )));
            }
        };
    Ok((header, set))
}

/// The one anchor decoder: the object's header (`None` for a plain
/// checkpoint) and its tensors, every digest checked against the header.
fn load(object: AnchorObject) -> Result<(Option<Header>, TensorSet)> {
    let set = match object {
        AnchorObject::Bytes(buf) => {
            let (_, header) = inspect(&buf)?;
            if header.as_ref().is_some_and(planes::is_planes) {
                // Every chunk's digest is checked while it is decoded, against
                // the header's; the set takes the digests without a second pass.
                let (layout, raw) = planes::decode_object(&buf)?;
                drop(buf);
                let set = TensorSet::from_safetensors(raw, Digests::Skip)?;
                return with_layout_digests(layout, set);
            }
            TensorSet::from_safetensors(buf, Digests::Compute)?
        }
        AnchorObject::File(p) => match expand(&p)? {
            // As for bytes: the digests were checked while decoding, into a
            // file of the caller's that nothing else writes.
            Some(layout) => {
                return with_layout_digests(layout, TensorSet::map(&p, true, Digests::Skip)?);
            }
            None => TensorSet::map(&p, true, Digests::Compute)?,
        },
        AnchorObject::Expanded(p, layout) => {
            return with_layout_digests(*layout, TensorSet::map(&p, true, Digests::Skip)?);
        }
        AnchorObject::Tensors(set) => set,
    };
    let Some(h) = Header::from_metadata(set.metadata())? else {
        return Ok((None, set));
    };
    verify(&h, &set)?;
    Ok((Some(h), set))
}

/// A set decoded from a `planes` anchor, whose every digest the decode
/// checked against `layout`: the set takes them without a second pass. The
/// set must list the layout's tensors in its order (its header was made from
/// the layout's).
fn with_layout_digests(
    layout: planes::PlanesLayout,
    mut set: TensorSet,
) -> Result<(Option<Header>, TensorSet)> {
    if set.len() != layout.tensors.len()
        || set
            .tensors()
            .iter()
            .zip(&layout.tensors)
            .any(|(a, b)| a.name != b.name)
    {
        return Err(Error::Container(
            "the decoded anchor's tensors differ from its layout's".into(),
        ));
    }
    for (i, t) in layout.tensors.iter().enumerate() {
        set.set_digest(i, t.digest);
    }
    set.mark_digests_valid();
    Ok((Some(layout.header), set))
}

/// Checks a raw anchor's computed digests (and its tensors' names, dtypes
/// and shapes) against its own weightcast header.
fn verify(h: &Header, set: &TensorSet) -> Result<()> {
    if h.kind != Kind::Anchor {
        return Err(Error::metadata(
            keys::KIND,
            "object is a delta, not an anchor",
        ));
    }
    if h.tensor_count != set.len() as u64 {
        return Err(Error::metadata(
            keys::TENSOR_COUNT,
            format!(
                "header says {} tensors, file holds {}",
                h.tensor_count,
                set.len()
            ),
        ));
    }
    if h.tensors.len() != set.len() {
        return Err(Error::metadata(
            keys::TENSORS,
            format!(
                "lists {} tensors, file holds {}",
                h.tensors.len(),
                set.len()
            ),
        ));
    }
    for t in set.tensors() {
        let e = h
            .tensors
            .get(&t.name)
            .ok_or_else(|| Error::tensor(&t.name, "not described in weightcast.tensors"))?;
        if !entry_matches(e, t.dtype, &t.shape) {
            return Err(Error::tensor(
                &t.name,
                format!(
                    "header describes {} {:?} ({} elements), the file holds {} {:?}",
                    e.dtype, e.shape, e.elements, t.dtype, t.shape
                ),
            ));
        }
        let want = entry_digest(&t.name, "digest", &e.digest)?;
        if want != t.digest {
            return Err(Error::Integrity {
                scope: format!("tensor {}", t.name),
                expected: want.to_string(),
                actual: t.digest.to_string(),
            });
        }
    }
    if set.digest() != h.digest {
        return Err(Error::Integrity {
            scope: "file".into(),
            expected: h.digest.to_string(),
            actual: set.digest().to_string(),
        });
    }
    Ok(())
}

/// Turns a compressed (`planes`, docs/format.md §5.1) anchor object in a
/// file into the raw anchor it stands for, in place: decoded (every chunk and
/// digest checked) into a new file `<path>.raw` through a writable map — page
/// cache, not the heap — then renamed over the object. A raw anchor is left
/// as it is. The file is the caller's, as for [`AnchorObject::File`].
pub fn expand_planes(path: &Path) -> Result<()> {
    expand(path).map(|_| ())
}

/// [`expand_planes`], returning the layout of a `planes` anchor it decoded
/// (whose digests the decode checked), `None` for a raw one.
fn expand(path: &Path) -> Result<Option<planes::PlanesLayout>> {
    let io = |what: &str, e| Error::io(format!("{what} {}", path.display()), e);
    let file = std::fs::File::open(path).map_err(|e| io("opening", e))?;
    // SAFETY: a map is sound while no one else changes or truncates the
    // file. The file is one the caller owns ([`AnchorObject::File`], the
    // documented contract of this function: e.g. a subscriber's own
    // download in its `.tmp` directory), which nothing else writes while
    // it is mapped; the map is dropped before the rename below.
    let object = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io("mapping", e))?;
    let (_, header) = inspect(&object)?;
    if !header.as_ref().is_some_and(planes::is_planes) {
        return Ok(None);
    }
    let layout = planes::PlanesLayout::parse(&object[..planes::prefix_len(&object)? as usize])?;
    let prefix = layout.raw_prefix()?;
    let total = prefix.len() as u64 + layout.decoded_len();
    let tmp = path.with_extension("raw");
    let r = expand_into(&object, &layout, (&tmp, total), prefix);
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r?;
    drop(object);
    std::fs::rename(&tmp, path).map_err(|e| io("renaming", e))?;
    Ok(Some(layout))
}

/// [`expand`]'s decode of `object` into the new file `tmp` of `total` bytes.
fn expand_into(
    object: &[u8],
    layout: &planes::PlanesLayout,
    (tmp, total): (&Path, u64),
    prefix: Vec<u8>,
) -> Result<()> {
    let io = |what: &str, e| Error::io(format!("{what} {}", tmp.display()), e);
    let out = create_for_map(tmp, total)?;
    {
        // SAFETY: `tmp` was just created (truncated) and sized by this
        // function beside the caller's own file, where nothing else writes
        // (the contract above names it); no one else knows it until the
        // rename below, after the map is dropped. Its length is `total`, so
        // every slice below is in bounds of the map.
        let mut map = unsafe { memmap2::MmapMut::map_mut(&out) }.map_err(|e| io("mapping", e))?;
        map[..prefix.len()].copy_from_slice(&prefix);
        layout.decode_all(object, &mut map[prefix.len()..])?;
        map.flush().map_err(|e| io("writing", e))?;
    }
    Ok(())
}

/// Creates `path` (truncated), `len` bytes long, to be written through a
/// writable map, with its blocks allocated first where the file system
/// allocates on request (`fallocate`). A store through a map to a page the
/// file system cannot back — a full disk, a full tmpfs — raises SIGBUS,
/// which kills the process; allocated first, the same shortage is an error
/// naming the file. A file system that cannot allocate ahead (some network
/// and FUSE ones) gets the file sized only, as before.
pub(crate) fn create_for_map(path: &Path, len: u64) -> Result<std::fs::File> {
    let io = |what: String, e| Error::io(format!("{what} {}", path.display()), e);
    let out = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(|e| io("creating".into(), e))?;
    out.set_len(len).map_err(|e| io("sizing".into(), e))?;
    allocate(&out, len).map_err(|e| io(format!("allocating {len} bytes for"), e))?;
    Ok(out)
}

/// Allocates the first `len` bytes of `file` (see [`create_for_map`]).
#[cfg(target_os = "linux")]
fn allocate(file: &std::fs::File, len: u64) -> std::io::Result<()> {
    use rustix::fs::{FallocateFlags, fallocate};
    use rustix::io::Errno;
    if len == 0 {
        return Ok(());
    }
    match fallocate(file, FallocateFlags::empty(), 0, len) {
        Err(e) if e == Errno::OPNOTSUPP || e == Errno::NOSYS => Ok(()),
        r => r.map_err(std::io::Error::from),
    }
}

#[cfg(not(target_os = "linux"))]
fn allocate(_: &std::fs::File, _: u64) -> std::io::Result<()> {
    Ok(())
}

/// [`expand_planes`] while the object is still arriving: the caller writes
/// the object's `size` bytes into the file at `path` (at their offsets, in
/// any order) and sends on `upto`, as it grows, how many of the first bytes
/// are in the file; it drops the sender when the download ends. The chunks
/// are decoded as their bytes arrive (in parallel), those whose bytes
/// straddled what had arrived once everything is in, so that little of the
/// decode is left after the last byte.
///
/// Returns the layout, with the raw anchor written to `<path>.raw` (every
/// chunk and digest checked) for the caller to rename over the object once
/// it has checked the object's size and hash; `None`, with nothing left
/// behind, when the object is not a `planes` anchor, when its header does not
/// parse or does not describe `size` bytes, or when the download ended
/// before `size` bytes: the caller then decodes the object as any other
/// ([`AnchorObject::File`], which reports what is wrong with it). A chunk or
/// digest that does not check is an error; `<path>.raw` is removed then too.
/// The bytes read are only ever those announced on `upto`, which must be in
/// the file and no longer written.
pub fn expand_following(
    path: &Path,
    size: u64,
    upto: std::sync::mpsc::Receiver<u64>,
) -> Result<Option<planes::PlanesLayout>> {
    let tmp = path.with_extension("raw");
    let r = follow(path, size, &upto, &tmp);
    if !matches!(r, Ok(Some(_))) {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

fn follow(
    path: &Path,
    size: u64,
    upto: &std::sync::mpsc::Receiver<u64>,
    tmp: &Path,
) -> Result<Option<planes::PlanesLayout>> {
    use std::os::unix::fs::FileExt;
    let io = |what: &str, p: &Path, e| Error::io(format!("{what} {}", p.display()), e);
    let mut have = 0u64;
    // Waits until `need` bytes are in; false if the download ended first.
    let wait = |have: &mut u64, need: u64| -> bool {
        while *have < need {
            match upto.recv() {
                Ok(n) => *have = (*have).max(n.min(size)),
                Err(_) => return false,
            }
        }
        true
    };
    if size < 8 || !wait(&mut have, 8) {
        return Ok(None);
    }
    // Opened once bytes are announced (the caller may create it after
    // starting this).
    let file = std::fs::File::open(path).map_err(|e| io("opening", path, e))?;
    let mut first = [0u8; 8];
    file.read_exact_at(&mut first, 0)
        .map_err(|e| io("reading", path, e))?;
    // A header the usual path would refuse is left to it.
    let Ok(plen) = planes::prefix_len(&first) else {
        return Ok(None);
    };
    if plen > size || !wait(&mut have, plen) {
        return Ok(None);
    }
    let mut prefix = vec![0u8; plen as usize];
    file.read_exact_at(&mut prefix, 0)
        .map_err(|e| io("reading", path, e))?;
    // Not a `planes` anchor (or not one that parses): the usual path's.
    let Ok(layout) = planes::PlanesLayout::parse(&prefix) else {
        return Ok(None);
    };
    if layout.object_len != size {
        return Ok(None);
    }
    let raw_prefix = layout.raw_prefix()?;
    let total = raw_prefix.len() as u64 + layout.decoded_len();
    let out = create_for_map(tmp, total)?;
    // SAFETY: `tmp` was just created (truncated) and sized by this function
    // beside the caller's own file, where nothing else writes (the contract
    // of `AnchorObject::File`, which names `<file>.raw`); no one else knows
    // it until the caller renames it, after this map is dropped. Its length
    // is `total`, so every slice below is in bounds of the map.
    let mut map = unsafe { memmap2::MmapMut::map_mut(&out) }.map_err(|e| io("mapping", tmp, e))?;
    map[..raw_prefix.len()].copy_from_slice(&raw_prefix);
    let data = &mut map[raw_prefix.len()..];
    let mut decoder = planes::PlanesDecoder::new(&layout);
    let mut fed = 0u64;
    // Maps the object's first `n` bytes.
    let head = |n: u64| {
        // A file shorter than announced would fault on access: refused.
        let len = file.metadata().map_err(|e| io("reading", path, e))?.len();
        if len < n {
            return Err(Error::Container(format!(
                "{} holds {len} bytes where {n} were announced",
                path.display()
            )));
        }
        // SAFETY: the caller writes each byte of the object once and has
        // announced that the first `n` are in the file (checked above to be
        // at least that long) and written: nothing changes them while they
        // are mapped, and nothing truncates the file (the caller's own
        // download, the contract above). The map covers those bytes only.
        unsafe { memmap2::MmapOptions::new().len(n as usize).map(&file) }
            .map_err(|e| io("mapping", path, e))
    };
    while let Ok(n) = upto.recv() {
        have = have.max(n.min(size));
        while let Ok(n) = upto.try_recv() {
            have = have.max(n.min(size));
        }
        // Decode what arrived, in steps of at least 1/16 of the object (or
        // everything, once it is all in).
        if have == size || have - fed >= (size / 16).max(1) {
            decoder.feed(0, &head(have)?, data)?;
            fed = have;
        }
    }
    if have < size {
        return Ok(None);
    }
    if fed < size {
        // Everything was announced before the loop began (while the prefix
        // was awaited): decoded now, in one step.
        decoder.feed(0, &head(size)?, data)?;
    }
    decoder.finish()?;
    map.flush().map_err(|e| io("writing", tmp, e))?;
    drop(map);
    Ok(Some(layout))
}

/// Writes the plain (`full`) anchor that an anchor object stands for into
/// `w`: a `planes` anchor decoded (bounded memory, every digest checked), a
/// `full` anchor or plain checkpoint copied as is. Returns the bytes written.
pub fn materialize_anchor(object: &[u8], w: &mut impl Write) -> Result<u64> {
    let (_, header) = inspect(object)?;
    if header.as_ref().is_some_and(planes::is_planes) {
        return planes::materialize(object, w);
    }
    w.write_all(object)
        .map_err(|e| Error::io("writing the materialized anchor", e))?;
    Ok(object.len() as u64)
}

/// Reads just the header of an anchor or delta object. For a `planes` anchor
/// it also validates the chunk table (see [`planes::PlanesLayout::parse`]).
pub fn inspect(bytes: &[u8]) -> Result<(BTreeMap<String, String>, Option<Header>)> {
    let (_, map) = metadata_map(bytes)?;
    let h = Header::from_metadata(&map)?;
    if h.as_ref().is_some_and(planes::is_planes) {
        planes::PlanesLayout::parse(bytes)?;
    }
    Ok((map, h))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{encode_anchor, encode_anchor_compressed};
    use crate::format::Encoding;
    use crate::generator::{Generator, GeneratorConfig};

    fn anchors() -> (TensorSet, Vec<u8>, Vec<u8>) {
        let set = Generator::new(GeneratorConfig::tiny(11)).snapshot();
        let (raw, _) = encode_anchor(&set, 4).unwrap();
        let (packed, _) = encode_anchor_compressed(&set, 4).unwrap();
        (set, raw, packed)
    }

    fn same(a: &TensorSet, b: &TensorSet) {
        assert_eq!(a.len(), b.len());
        for i in 0..a.len() {
            assert_eq!(a.tensors()[i].name, b.tensors()[i].name);
            assert_eq!(a.data(i), b.data(i));
            assert_eq!(a.tensors()[i].digest, b.tensors()[i].digest);
        }
        assert_eq!(a.digest(), b.digest());
    }

    /// Memory and file, raw and compressed: the same verified tensors and
    /// the raw anchor's header; a compressed file becomes the raw anchor.
    #[test]
    fn decodes_every_form_alike() {
        let (set, raw, packed) = anchors();
        let dir = tempfile::tempdir().unwrap();
        for (i, obj) in [&raw, &packed].into_iter().enumerate() {
            let (h, mem) = decode_anchor("m", AnchorObject::Bytes(obj.clone())).unwrap();
            assert_eq!(h.encoding, Encoding::Full);
            same(&set, &mem);

            let path = dir.path().join(format!("{i}.download"));
            std::fs::write(&path, obj).unwrap();
            let (hf, mapped) = decode_anchor("m", AnchorObject::File(path.clone())).unwrap();
            assert_eq!(hf, h);
            same(&set, &mapped);
            drop(mapped);
            // Expanded in place: the file is now the raw anchor, byte for byte,
            // and no `.raw` file is left beside it.
            assert_eq!(std::fs::read(&path).unwrap(), raw);
            assert!(!path.with_extension("raw").exists());
        }
        let (h, _) = read_anchor(packed).unwrap();
        assert_eq!(h.unwrap().encoding, Encoding::Planes);
    }

    /// A `planes` object expanded while it arrives (parts written out of
    /// order, the contiguous prefix announced as it grows): the raw anchor,
    /// byte for byte, whose layout's digests the set takes; a download cut
    /// short or a raw anchor gives `None`, a flipped byte an error, and
    /// neither leaves a `.raw` file.
    #[test]
    fn expands_while_the_object_arrives() {
        use std::os::unix::fs::FileExt;
        // Three tensors, one of them 3.5 chunks of 2^20 words.
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut noise = |n: usize| -> Vec<u8> {
            (0..n)
                .flat_map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (0x3C00u16 | (x as u16 & 0x80FF)).to_le_bytes()
                })
                .collect()
        };
        let set = TensorSet::from_tensors(vec![
            (
                "a".into(),
                crate::dtype::Dtype::BF16,
                vec![7 << 19],
                noise(7 << 19),
            ),
            (
                "b".into(),
                crate::dtype::Dtype::BF16,
                vec![1000],
                noise(1000),
            ),
            (
                "c".into(),
                crate::dtype::Dtype::BF16,
                vec![300_001],
                noise(300_001),
            ),
        ])
        .unwrap();
        let (raw, _) = encode_anchor(&set, 9).unwrap();
        let (packed, _) = encode_anchor_compressed(&set, 9).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("o.download");
        let tmp = path.with_extension("raw");
        // Parts of 64 KiB, each pair swapped; those ending past `cut` never
        // arrive.
        let follow = |obj: &[u8], cut: usize| {
            let file = std::fs::File::create(&path).unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            let (p, size) = (path.clone(), obj.len() as u64);
            let h = std::thread::spawn(move || expand_following(&p, size, rx));
            let part = 64 << 10;
            let n = obj.len().div_ceil(part);
            let mut order: Vec<usize> = (0..n).collect();
            for k in (0..n.saturating_sub(1)).step_by(2) {
                order.swap(k, k + 1);
            }
            let (mut done, mut next) = (vec![false; n], 0);
            for i in order {
                let r = i * part..((i + 1) * part).min(obj.len());
                if r.end > cut {
                    continue;
                }
                file.write_all_at(&obj[r.clone()], r.start as u64).unwrap();
                done[i] = true;
                while next < n && done[next] {
                    next += 1;
                }
                let _ = tx.send((next * part).min(obj.len()) as u64);
            }
            drop(tx);
            h.join().unwrap()
        };
        let layout = follow(&packed, packed.len())
            .unwrap()
            .expect("a planes anchor");
        assert!(layout.chunk_count() >= 5);
        assert!(std::fs::read(&tmp).unwrap() == raw, "not the raw anchor");
        std::fs::rename(&tmp, &path).unwrap();
        let (h, got) =
            decode_anchor("m", AnchorObject::Expanded(path.clone(), Box::new(layout))).unwrap();
        assert_eq!(h.encoding, Encoding::Full);
        same(&set, &got);
        drop(got);

        // Everything announced at once, before the decode begins: the same.
        std::fs::write(&path, &packed).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        tx.send(packed.len() as u64).unwrap();
        drop(tx);
        let layout = expand_following(&path, packed.len() as u64, rx).unwrap();
        assert!(layout.is_some());
        assert!(std::fs::read(&tmp).unwrap() == raw, "not the raw anchor");
        std::fs::remove_file(&tmp).unwrap();
        // Announced, but the file is shorter: refused, not a fault.
        std::fs::write(&path, &packed[..packed.len() / 2]).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        tx.send(packed.len() as u64).unwrap();
        drop(tx);
        assert!(expand_following(&path, packed.len() as u64, rx).is_err());
        assert!(!tmp.exists());

        assert!(follow(&packed, packed.len() / 2).unwrap().is_none());
        assert!(!tmp.exists());
        assert!(follow(&raw, raw.len()).unwrap().is_none());
        assert!(!tmp.exists());
        let mut bad = packed.clone();
        let at = bad.len() - 100;
        bad[at] ^= 1;
        assert!(follow(&bad, bad.len()).is_err());
        assert!(!tmp.exists());
    }

    /// The map is writable: writes through the set reach the file.
    #[test]
    fn a_file_is_mapped_for_writing() {
        let (_, _, packed) = anchors();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.download");
        std::fs::write(&path, &packed).unwrap();
        let (_, mut set) = decode_anchor("a", AnchorObject::File(path.clone())).unwrap();
        let at = std::fs::metadata(&path).unwrap().len() - set.total_bytes();
        let before = set.data(0)[0];
        set.data_mut(0)[0] = !before;
        drop(set);
        assert_eq!(std::fs::read(&path).unwrap()[at as usize], !before);
    }

    /// A flipped byte is found in every form; a plain checkpoint is read by
    /// `read_anchor` and refused by `decode_anchor`, naming the anchor.
    #[test]
    fn refuses_what_its_header_does_not_describe() {
        let (set, raw, packed) = anchors();
        let dir = tempfile::tempdir().unwrap();
        for obj in [&raw, &packed] {
            let mut bad = obj.clone();
            let last = bad.len() - 1;
            bad[last] ^= 1;
            assert!(read_anchor(bad.clone()).is_err());
            assert!(decode_anchor("x", AnchorObject::Bytes(bad.clone())).is_err());
            let path = dir.path().join("bad.download");
            std::fs::write(&path, &bad).unwrap();
            assert!(decode_anchor("x", AnchorObject::File(path)).is_err());
        }
        // A compressed file whose data decodes but whose digest does not
        // match (a byte of a raw-stored plane): refused by the digests,
        // which are checked once, while the file is expanded.
        let layout = planes::PlanesLayout::parse(&packed).unwrap();
        let (t, c) = layout
            .tensors
            .iter()
            .find_map(|t| {
                let wb = crate::dtype::word_bytes(t.dtype) as u64;
                t.chunks.iter().find_map(|c| {
                    let words = (c.decoded.end - c.decoded.start) / wb;
                    let p = c.planes.iter().position(|&n| n == words)?;
                    let at = c.stored.start + c.planes[..p].iter().sum::<u64>();
                    Some((t.name.clone(), at))
                })
            })
            .expect("a chunk with a raw plane");
        let mut bad = packed.clone();
        bad[c as usize] ^= 1;
        let path = dir.path().join("low.download");
        std::fs::write(&path, &bad).unwrap();
        let err = decode_anchor("x", AnchorObject::File(path))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("integrity check failed for tensor {t}")),
            "{err}"
        );
        let mut plain = Vec::new();
        let views: Vec<_> = set
            .tensors()
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.as_str(), t.dtype, t.shape.as_slice(), set.data(i)))
            .collect();
        crate::tensors::write_safetensors(&views, &Default::default(), &mut plain).unwrap();
        assert!(read_anchor(plain.clone()).unwrap().0.is_none());
        let err = decode_anchor("model.safetensors", AnchorObject::Bytes(plain)).unwrap_err();
        assert!(
            err.to_string()
                .contains("anchor `model.safetensors`: missing"),
            "{err}"
        );
    }

    /// A decode into a file system without room for the raw anchor fails
    /// with an error naming `<file>.raw`, and leaves nothing behind; the
    /// object stays as it was. Before, the writable map's first page the
    /// file system could not back raised SIGBUS and killed the process.
    /// Both decodes: of a whole file, and following a download. The body
    /// runs in a child process, in a user and mount namespace of its own
    /// (`unshare -rm`, util-linux), over a 3 MiB tmpfs.
    #[test]
    fn a_full_file_system_is_an_error() {
        const NAME: &str = "codec::anchor::read::tests::a_full_file_system_is_an_error";
        const SCRIPT: &str = r#"mount -t tmpfs -o size=3m tmpfs "$1" && exec "$2" --exact "$3" --nocapture --test-threads 1"#;
        if let Some(dir) = std::env::var_os("WEIGHTCAST_TEST_FULL_FS") {
            return full_file_system(Path::new(&dir));
        }
        let dir = tempfile::tempdir().unwrap();
        let out = std::process::Command::new("unshare")
            .args(["-rm", "sh", "-c", SCRIPT, "sh"])
            .arg(dir.path())
            .arg(std::env::current_exe().unwrap())
            .arg(NAME)
            .env("WEIGHTCAST_TEST_FULL_FS", dir.path())
            .output()
            .expect("unshare (util-linux) runs");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "the child: {}\n{text}", out.status);
        assert!(text.contains("1 passed"), "the child ran the test:\n{text}");
    }

    fn full_file_system(dir: &Path) {
        // 3.2 MB of bf16, whose object (about 2.1 MB) fits the file system
        // and whose raw anchor does not.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let words: Vec<u8> = (0..1_600_000)
            .flat_map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (0x3C00u16 | (x as u16 & 0x80FF)).to_le_bytes()
            })
            .collect();
        let set = TensorSet::from_tensors(vec![(
            "w".into(),
            crate::dtype::Dtype::BF16,
            vec![1_600_000],
            words,
        )])
        .unwrap();
        let (packed, _) = encode_anchor_compressed(&set, 4).unwrap();
        let sizes = (packed.len(), set.total_bytes());
        assert!(sizes.0 < 3 << 20 && sizes.1 > 3 << 20, "{sizes:?}");
        let path = dir.join("a.download");
        std::fs::write(&path, &packed).unwrap();
        let raw = path.with_extension("raw");
        let no_room = |e: &Error| {
            let m = e.to_string();
            m.contains(&raw.display().to_string()) && m.contains("No space left")
        };
        let e = decode_anchor("a", AnchorObject::File(path.clone())).unwrap_err();
        assert!(no_room(&e), "{e}");
        assert!(!raw.exists());
        assert_eq!(std::fs::read(&path).unwrap(), packed);

        let (tx, rx) = std::sync::mpsc::channel();
        tx.send(packed.len() as u64).unwrap();
        drop(tx);
        let e = expand_following(&path, packed.len() as u64, rx).unwrap_err();
        assert!(no_room(&e), "{e}");
        assert!(!raw.exists());
    }
}
