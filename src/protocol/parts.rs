//! Distributed publish: the records W trainer ranks leave under
//! `parts/<version:020>/` to agree on one version and commit it together
//! (docs/format.md §9.1).
//!
//! ```text
//! parts/<version:020>/intent-<rank>.json        a rank's intent: its step, its token, anchor needed?
//! parts/<version:020>/rank-<rank>-of-<world>.json  a rank's part: its share of the manifest, tensor names
//! ```
//!
//! Every rank writes its intent, reads all W intents, and from them derives
//! the version's kind (an anchor if any rank needs one) and its writer token
//! (a hash of the W intent tokens, the same for every rank). It uploads its
//! objects under that writer, then writes its part. Whoever sees all W parts
//! of the writer merges them ([`merge`]) into the manifest and creates it
//! (create-if-absent: ranks racing to commit write the same manifest, and
//! the first create wins). Only the manifest makes the version visible.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::store::Store;

use super::manifest::{Manifest, ObjectRole, VersionKind};

/// Prefix of the distributed-publish records.
pub const PARTS_PREFIX: &str = "parts";
/// Value of [`Intent::format`].
pub const INTENT_FORMAT: &str = "weightcast-intent/1";
/// Value of [`Part::format`].
pub const PART_FORMAT: &str = "weightcast-part/1";
/// Largest intent or part record read (a part lists its tensor names).
pub const MAX_PART_BYTES: u64 = 16 << 20;

/// The directory (without trailing `/`) of one version's records.
pub fn parts_dir(version: u64) -> String {
    format!("{PARTS_PREFIX}/{version:020}")
}

/// Key of rank `rank`'s intent for `version`.
pub fn intent_key(version: u64, rank: u32) -> String {
    format!("{}/intent-{rank}.json", parts_dir(version))
}

/// Key of rank `rank`'s part (of `world`) for `version`.
pub fn part_key(version: u64, rank: u32, world: u32) -> String {
    format!("{}/rank-{rank}-of-{world}.json", parts_dir(version))
}

/// The version a key under `parts/` belongs to.
pub fn version_of_parts_key(key: &str) -> Option<u64> {
    let rest = key.strip_prefix(PARTS_PREFIX)?.strip_prefix('/')?;
    let digits = rest.get(..20)?;
    if !digits.bytes().all(|b| b.is_ascii_digit()) || rest.get(20..21) != Some("/") {
        return None;
    }
    digits.parse().ok()
}

/// A rank's intent for a version, written before it uploads anything.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Intent {
    /// [`INTENT_FORMAT`].
    pub format: String,
    /// The version.
    pub version: u64,
    /// The rank.
    pub rank: u32,
    /// The number of ranks.
    pub world: u32,
    /// The trainer step the rank publishes as this version.
    pub step: u64,
    /// A random token of this attempt (16 hex digits).
    pub token: String,
    /// Why this rank needs an anchor, if it does (no trusted snapshot, the
    /// schedule, its delta too large, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub anchor: Option<String>,
    /// When it was written (Unix seconds; retention's grace period).
    pub created_at: u64,
}

/// A rank's part of a version, written after its objects are uploaded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Part {
    /// [`PART_FORMAT`].
    pub format: String,
    /// The rank.
    pub rank: u32,
    /// The number of ranks.
    pub world: u32,
    /// The rank's share of the manifest: its objects and non-tensor files,
    /// with the version's agreed kind, writer and step.
    pub manifest: Manifest,
    /// Safetensors file → the tensor names in it (checked disjoint across ranks).
    pub tensors: BTreeMap<String, Vec<String>>,
    /// When it was written (Unix seconds).
    pub created_at: u64,
}

/// The writer token of a version published by W ranks: a hash of their
/// intent tokens in rank order, the same for every rank.
pub fn shared_writer(tokens: &[String]) -> String {
    let mut h = blake3::Hasher::new();
    h.update(b"weightcast-dist/1");
    for t in tokens {
        h.update(t.as_bytes());
        h.update(b"\n");
    }
    h.finalize().to_hex()[..16].to_string()
}

/// Reads and parses a record (`None` when absent); anything malformed is a
/// metadata error naming the key.
pub async fn read_record<T: serde::de::DeserializeOwned>(
    store: &Store,
    key: &str,
) -> Result<Option<T>> {
    let Some(bytes) = store.get_at_most(key, MAX_PART_BYTES).await? else {
        return Ok(None);
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| Error::metadata(key, e.to_string()))
}

/// Writes a record (overwriting).
pub async fn write_record<T: Serialize>(store: &Store, key: &str, record: &T) -> Result<()> {
    let body = serde_json::to_vec(record).expect("record serializes");
    store.put(key, bytes::Bytes::from(body)).await
}

/// Merges the W parts of a version (one per rank, all of one writer) into
/// its manifest. Refuses parts that disagree (step, kind, anchor, writer),
/// a safetensors file or a tensor name published by two ranks, and a
/// non-tensor file two ranks hold with different contents (identical copies
/// are listed once). An anchor is bridged only when every rank's share is;
/// otherwise the bridges are left out (unreferenced, retention removes them).
pub fn merge(parts: &[Part]) -> Result<Manifest> {
    let Some(first) = parts.first() else {
        return Err(Error::BadRequest("no parts to merge".into()));
    };
    let world = first.world;
    let m0 = &first.manifest;
    let mut ranks: Vec<u32> = parts.iter().map(|p| p.rank).collect();
    ranks.sort_unstable();
    if ranks != (0..world).collect::<Vec<_>>() {
        return Err(Error::BadRequest(format!(
            "version {}: parts of ranks {ranks:?}, expected one of each rank 0..{world}",
            m0.version
        )));
    }
    for p in parts {
        let m = &p.manifest;
        let same = p.world == world
            && m.version == m0.version
            && m.writer == m0.writer
            && m.kind == m0.kind
            && m.anchor_version == m0.anchor_version;
        if !same {
            return Err(Error::Conflict(format!(
                "version {}: rank {} staged {:?} (anchor {}, writer {}, world {}) but rank {} \
                 staged {:?} (anchor {}, writer {}, world {}); restart every rank with the same \
                 --world",
                m0.version,
                first.rank,
                m0.kind,
                m0.anchor_version,
                m0.writer,
                world,
                p.rank,
                m.kind,
                m.anchor_version,
                m.writer,
                p.world
            )));
        }
        if m.step != m0.step {
            return Err(Error::Conflict(format!(
                "version {}: rank {} publishes step {:?} but rank {} step {:?}; every rank must \
                 publish the same --step",
                m0.version, first.rank, m0.step, p.rank, m.step
            )));
        }
    }
    let bridged =
        m0.kind == VersionKind::Anchor && parts.iter().all(|p| p.manifest.base_version.is_some());
    let mut tensor_owner: BTreeMap<&str, (u32, &str)> = BTreeMap::new();
    let mut file_owner: BTreeMap<&str, u32> = BTreeMap::new();
    let mut files: BTreeMap<&str, (u32, &super::manifest::FileRef)> = BTreeMap::new();
    let mut objects = Vec::new();
    let mut keys = std::collections::HashSet::new();
    let mut sorted: Vec<&Part> = parts.iter().collect();
    sorted.sort_by_key(|p| p.rank);
    for p in sorted {
        for (file, names) in &p.tensors {
            if let Some(r) = file_owner.insert(file, p.rank) {
                return Err(Error::BadRequest(format!(
                    "version {}: safetensors file `{file}` is published by rank {r} and rank {}; \
                     each rank must publish only its own shards",
                    m0.version, p.rank
                )));
            }
            for n in names {
                if let Some((r, f)) = tensor_owner.insert(n, (p.rank, file)) {
                    return Err(Error::BadRequest(format!(
                        "version {}: tensor `{n}` is published by rank {r} (in `{f}`) and rank {} \
                         (in `{file}`); tensor names must be disjoint across ranks",
                        m0.version, p.rank
                    )));
                }
            }
        }
        for f in &p.manifest.files {
            match files.get(f.name.as_str()) {
                Some((r, g)) if g.size != f.size || g.blake3 != f.blake3 => {
                    return Err(Error::BadRequest(format!(
                        "version {}: file `{}` differs between rank {r} and rank {}; a \
                         non-tensor file held by several ranks must be identical",
                        m0.version, f.name, p.rank
                    )));
                }
                Some(_) => {}
                None => {
                    files.insert(&f.name, (p.rank, f));
                }
            }
        }
        for o in &p.manifest.objects {
            if o.role == ObjectRole::Delta && m0.kind == VersionKind::Anchor && !bridged {
                continue;
            }
            if o.role != ObjectRole::File && !p.tensors.contains_key(&o.name) {
                return Err(Error::BadRequest(format!(
                    "version {}: rank {} lists object `{}` for `{}` but no tensors for it",
                    m0.version, p.rank, o.key, o.name
                )));
            }
            // Identical non-tensor files of several ranks share a key.
            if keys.insert(o.key.clone()) {
                objects.push(o.clone());
            }
        }
    }
    let manifest = Manifest {
        format: m0.format.clone(),
        version: m0.version,
        kind: m0.kind,
        base_version: match m0.kind {
            VersionKind::Delta => m0.base_version,
            VersionKind::Anchor => bridged.then(|| m0.version.saturating_sub(1)),
        },
        anchor_version: m0.anchor_version,
        step: m0.step,
        writer: m0.writer.clone(),
        objects,
        files: files.into_values().map(|(_, f)| f.clone()).collect(),
    };
    manifest.validate()?;
    Ok(manifest)
}

/// How [`check_delta_files`] words its refusal (a rank recognizes it: it
/// stops trusting its snapshot, so that the rerun is an anchor).
pub const FILE_SET_CHANGED: &str = "the set of safetensors files changed";

/// The safetensors files version `m` holds: its `anchor` objects, or a
/// delta's `delta` objects (a delta has one for every file, changed or not).
pub fn tensor_files(m: &Manifest) -> std::collections::BTreeSet<&str> {
    let role = match m.kind {
        VersionKind::Anchor => ObjectRole::Anchor,
        VersionKind::Delta => ObjectRole::Delta,
    };
    m.objects
        .iter()
        .filter(|o| o.role == role)
        .map(|o| o.name.as_str())
        .collect()
}

/// Refuses a merged delta whose safetensors files are not exactly those of
/// its base version (`base`: its manifest, `None` when it is missing). A
/// reader replays a delta only with a delta object for every file it holds,
/// so a version whose file set changed — a rank left or joined, a shard
/// moved — must be an anchor.
pub fn check_delta_files(m: &Manifest, base: Option<&Manifest>) -> Result<()> {
    if m.kind != VersionKind::Delta {
        return Ok(());
    }
    let b = m.version.saturating_sub(1);
    let Some(base) = base else {
        return Err(Error::Conflict(format!(
            "{FILE_SET_CHANGED}: version {} would be a delta on version {b}, which is not \
             committed; the version must be an anchor. Rerun the step on every rank (each \
             writes an anchor)",
            m.version
        )));
    };
    let (now, before) = (tensor_files(m), tensor_files(base));
    if now == before {
        return Ok(());
    }
    let gone: Vec<&str> = before.difference(&now).copied().collect();
    let new: Vec<&str> = now.difference(&before).copied().collect();
    Err(Error::Conflict(format!(
        "{FILE_SET_CHANGED}: version {} would be a delta without {gone:?} and with new \
         {new:?} relative to version {b}; a reader replays a delta only with one for every \
         file it holds, so the version must be an anchor (did a rank leave or join?). Rerun \
         the step on every rank (each writes an anchor)",
        m.version
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{FileRef, ObjectEntry, object_key};

    fn part(rank: u32, files: &[(&str, &[&str])], bridged: bool) -> Part {
        let writer = "0123456789abcdef".to_string();
        let mut objects = Vec::new();
        let mut tensors = BTreeMap::new();
        for (f, names) in files {
            let mut roles = vec![ObjectRole::Anchor];
            if bridged {
                roles.push(ObjectRole::Delta);
            }
            for role in roles {
                objects.push(ObjectEntry {
                    name: f.to_string(),
                    role,
                    key: object_key(role, 5, &writer, f).unwrap(),
                    size: 1,
                    blake3: "a".repeat(64),
                });
            }
            tensors.insert(f.to_string(), names.iter().map(|s| s.to_string()).collect());
        }
        objects.push(ObjectEntry {
            name: "config.json".into(),
            role: ObjectRole::File,
            key: object_key(ObjectRole::File, 5, &writer, "config.json").unwrap(),
            size: 2,
            blake3: "b".repeat(64),
        });
        Part {
            format: PART_FORMAT.into(),
            rank,
            world: 2,
            manifest: Manifest {
                format: crate::protocol::MANIFEST_FORMAT.into(),
                version: 5,
                kind: VersionKind::Anchor,
                base_version: bridged.then_some(4),
                anchor_version: 5,
                step: Some(50),
                writer,
                objects,
                files: vec![FileRef {
                    name: "config.json".into(),
                    size: 2,
                    blake3: "b".repeat(64),
                }],
            },
            tensors,
            created_at: 0,
        }
    }

    #[test]
    fn merges_disjoint_parts_and_refuses_overlaps() {
        let a = part(0, &[("a.safetensors", &["x", "y"])], true);
        let b = part(1, &[("b.safetensors", &["z"])], true);
        let m = merge(&[b.clone(), a.clone()]).unwrap();
        assert_eq!(m.objects.len(), 5, "{m:?}");
        assert_eq!(m.base_version, Some(4));
        assert_eq!(m.files.len(), 1);

        // One rank without bridges: the anchor is unbridged.
        let nb = part(1, &[("b.safetensors", &["z"])], false);
        let m = merge(&[a.clone(), nb]).unwrap();
        assert_eq!(m.base_version, None);
        assert!(m.objects.iter().all(|o| o.role != ObjectRole::Delta));

        let dup = part(1, &[("b.safetensors", &["y"])], true);
        let e = merge(&[a.clone(), dup]).unwrap_err().to_string();
        assert!(
            e.contains("tensor `y`") && e.contains("rank 0") && e.contains("rank 1"),
            "{e}"
        );

        let mut step = b.clone();
        step.manifest.step = Some(51);
        let e = merge(&[a.clone(), step]).unwrap_err().to_string();
        assert!(e.contains("step"), "{e}");

        let mut cfg = b.clone();
        cfg.manifest.files[0].blake3 = "c".repeat(64);
        let e = merge(&[a.clone(), cfg]).unwrap_err().to_string();
        assert!(e.contains("config.json"), "{e}");

        let e = merge(&[a.clone(), a]).unwrap_err().to_string();
        assert!(e.contains("expected one of each rank"), "{e}");
    }

    /// A manifest of `version` holding one object of `role` per file.
    fn holding(version: u64, kind: VersionKind, files: &[&str]) -> Manifest {
        let writer = "0123456789abcdef".to_string();
        let role = match kind {
            VersionKind::Anchor => ObjectRole::Anchor,
            VersionKind::Delta => ObjectRole::Delta,
        };
        Manifest {
            format: crate::protocol::MANIFEST_FORMAT.into(),
            version,
            kind,
            base_version: (kind == VersionKind::Delta).then(|| version - 1),
            anchor_version: if kind == VersionKind::Delta {
                0
            } else {
                version
            },
            step: None,
            objects: files
                .iter()
                .map(|f| ObjectEntry {
                    name: f.to_string(),
                    role,
                    key: object_key(role, version, &writer, f).unwrap(),
                    size: 1,
                    blake3: "a".repeat(64),
                })
                .collect(),
            writer,
            files: Vec::new(),
        }
    }

    #[test]
    fn a_delta_must_hold_its_bases_files() {
        let (a, b) = ("a.safetensors", "b.safetensors");
        let base = holding(5, VersionKind::Anchor, &[a, b]);
        check_delta_files(&holding(6, VersionKind::Delta, &[a, b]), Some(&base)).unwrap();
        // A rank's shard gone, or a new one: refused, naming it.
        for files in [&[a][..], &[a, b, "c.safetensors"]] {
            let e =
                check_delta_files(&holding(6, VersionKind::Delta, files), Some(&base)).unwrap_err();
            assert_eq!(e.kind(), crate::error::ErrorKind::Precondition);
            let e = e.to_string();
            assert!(e.starts_with(FILE_SET_CHANGED), "{e}");
            assert!(
                e.contains("b.safetensors") || e.contains("c.safetensors"),
                "{e}"
            );
        }
        // No base: refused. An anchor may change its files.
        assert!(check_delta_files(&holding(6, VersionKind::Delta, &[a]), None).is_err());
        check_delta_files(&holding(6, VersionKind::Anchor, &[a]), Some(&base)).unwrap();
    }

    #[test]
    fn keys_parse_back() {
        assert_eq!(version_of_parts_key(&intent_key(7, 3)), Some(7));
        assert_eq!(version_of_parts_key(&part_key(12, 0, 4)), Some(12));
        assert_eq!(version_of_parts_key("parts/7/intent-0.json"), None);
        assert_eq!(shared_writer(&["a".into(), "b".into()]).len(), 16);
        assert_ne!(
            shared_writer(&["a".into(), "b".into()]),
            shared_writer(&["b".into(), "a".into()])
        );
    }
}
