//! Key names: where every kind of object lives under the bucket prefix.
//!
//! ```text
//! anchors/<version:020>-<writer>/<file>   anchor objects (full safetensors files)
//! deltas/<version:020>-<writer>/<file>    delta objects (a delta version's, and an anchor's bridges)
//! files/<version:020>-<writer>/<file>     non-tensor files (config, tokenizer, index), as is
//! versions/<version:020>.json             commit manifests (create-if-absent, written last)
//! latest.json                             hint: the newest committed version
//! subscribers/<id>.json                   subscriber registrations
//! parts/<version:020>/...                 distributed publish records (see `parts`)
//! _weightcast/probe/<nonce>               the conditional-write probe (deleted at once)
//! ```
//!
//! Versions are zero-padded to 20 digits, so key order is version order in every
//! listing, and `<writer>` (random per publish attempt) keeps two publishers
//! racing for one version from ever writing the same key.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// What kind of version a manifest commits (anchors and deltas live under
/// different prefixes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VersionKind {
    /// Full weights: replaying starts here.
    Anchor,
    /// Changes relative to `base_version`.
    Delta,
}

/// What one object of a version is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ObjectRole {
    /// A full safetensors file (weightcast anchor format), under `anchors/`.
    Anchor,
    /// A delta for the safetensors file `name`, under `deltas/`.
    Delta,
    /// A non-tensor file (config, tokenizer, index), copied as is, under `files/`.
    File,
}

/// Key of the newest-version hint.
pub const LATEST_KEY: &str = "latest.json";
/// Prefix of the commit manifests.
pub const VERSIONS_PREFIX: &str = "versions";
/// Prefix of anchor objects.
pub const ANCHORS_PREFIX: &str = "anchors";
/// Prefix of delta objects (bridges included).
pub const DELTAS_PREFIX: &str = "deltas";
/// Prefix of non-tensor file objects.
pub const FILES_PREFIX: &str = "files";
/// Prefix of subscriber registrations.
pub const SUBSCRIBERS_PREFIX: &str = "subscribers";
/// Where the first release (manifest format `weightcast-manifest/1`) kept
/// every object; recognized only to refuse it with a clear error.
pub const LEGACY_OBJECTS_PREFIX: &str = "objects";
/// Every prefix that holds version objects, in listing order.
pub const OBJECT_PREFIXES: [&str; 3] = [ANCHORS_PREFIX, DELTAS_PREFIX, FILES_PREFIX];

/// Key of the manifest of `version`.
pub fn manifest_key(version: u64) -> String {
    format!("{VERSIONS_PREFIX}/{version:020}.json")
}

/// Parses a manifest key back into its version.
pub fn version_of_manifest_key(key: &str) -> Option<u64> {
    let name = key.strip_prefix(VERSIONS_PREFIX)?.strip_prefix('/')?;
    parse_version(name.strip_suffix(".json")?)
}

fn parse_version(digits: &str) -> Option<u64> {
    (digits.len() == 20 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// The prefix an object of `role` in a version of `kind` lives under.
pub fn role_prefix(role: ObjectRole) -> &'static str {
    match role {
        ObjectRole::Anchor => ANCHORS_PREFIX,
        ObjectRole::Delta => DELTAS_PREFIX,
        ObjectRole::File => FILES_PREFIX,
    }
}

/// The directory (without trailing `/`) of one writer's objects of `role`
/// for `version`: `<role prefix>/<version:020>-<writer>`.
pub fn object_dir(role: ObjectRole, version: u64, writer: &str) -> String {
    format!("{}/{version:020}-{writer}", role_prefix(role))
}

/// The key of object `name` (a checkpoint-relative file name).
pub fn object_key(role: ObjectRole, version: u64, writer: &str, name: &str) -> Result<String> {
    if !is_safe_file_name(name) {
        return Err(Error::BadRequest(format!(
            "file name `{name}` is not a plain relative path"
        )));
    }
    Ok(format!("{}/{name}", object_dir(role, version, writer)))
}

/// What an object key says about itself: its role, version and writer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectKey<'a> {
    /// Anchor, delta or file.
    pub role: ObjectRole,
    /// The version it belongs to.
    pub version: u64,
    /// The writer token.
    pub writer: &'a str,
    /// The file name under the writer's directory.
    pub name: &'a str,
}

/// Parses `<prefix>/<version:020>-<writer>/<name>`; `None` for any other key.
pub fn parse_object_key(key: &str) -> Option<ObjectKey<'_>> {
    let (head, rest) = key.split_once('/')?;
    let role = match head {
        ANCHORS_PREFIX => ObjectRole::Anchor,
        DELTAS_PREFIX => ObjectRole::Delta,
        FILES_PREFIX => ObjectRole::File,
        _ => return None,
    };
    let (dir, name) = rest.split_once('/')?;
    let (digits, writer) = (dir.get(..20)?, dir.get(20..)?.strip_prefix('-')?);
    if writer.is_empty() || name.is_empty() {
        return None;
    }
    Some(ObjectKey {
        role,
        version: parse_version(digits)?,
        writer,
        name,
    })
}

/// Whether the kind of version may hold objects of `role`.
pub fn role_allowed(kind: VersionKind, role: ObjectRole, bridged: bool) -> bool {
    match (kind, role) {
        (VersionKind::Anchor, ObjectRole::Delta) => bridged,
        (VersionKind::Delta, ObjectRole::Anchor) => false,
        _ => true,
    }
}

/// A fresh writer token: 16 hex digits from the clock, the process and a counter.
pub fn writer_token() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let seed = format!(
        "{:?}/{}/{}",
        std::time::SystemTime::now(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    blake3::hash(seed.as_bytes()).to_hex()[..16].to_string()
}

/// Whether `name` is a relative path of plain components (no `..`, no `.`,
/// no absolute path, no empty component, no backslash or NUL): safe to join
/// under an output directory and to use in a key.
pub fn is_safe_file_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 1024
        && !name.starts_with('/')
        && !name.contains('\\')
        && !name.contains('\0')
        && name
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_sort_numerically_and_parse_back() {
        assert!(manifest_key(9) < manifest_key(10));
        assert_eq!(version_of_manifest_key(&manifest_key(123)), Some(123));
        assert_eq!(version_of_manifest_key("versions/12.json"), None);
        assert_eq!(
            version_of_manifest_key("versions/0000000000000000001x.json"),
            None
        );
        let k = object_key(ObjectRole::Delta, 7, "abc", "sub/model.safetensors").unwrap();
        assert_eq!(k, "deltas/00000000000000000007-abc/sub/model.safetensors");
        assert_eq!(
            parse_object_key(&k),
            Some(ObjectKey {
                role: ObjectRole::Delta,
                version: 7,
                writer: "abc",
                name: "sub/model.safetensors"
            })
        );
        assert!(
            object_key(ObjectRole::Anchor, 9, "w", "a").unwrap()
                < object_key(ObjectRole::Anchor, 10, "w", "a").unwrap()
        );
        for bad in [
            "objects/00000000000000000007-abc/x",
            "deltas/7-abc/x",
            "deltas/00000000000000000007abc/x",
            "deltas/00000000000000000007-/x",
            "deltas/00000000000000000007-abc",
            "deltas/00000000000000000007-abc/",
        ] {
            assert_eq!(parse_object_key(bad), None, "{bad}");
        }
        assert!(object_key(ObjectRole::File, 1, "w", "../x").is_err());
    }

    #[test]
    fn file_names() {
        for ok in ["model.safetensors", "sub/dir/tokenizer.json", ".hidden"] {
            assert!(is_safe_file_name(ok), "{ok}");
        }
        for bad in [
            "", "/abs", "a/../b", "..", "a//b", "./a", "a\\b", "a\0b", "a/",
        ] {
            assert!(!is_safe_file_name(bad), "{bad:?}");
        }
    }
}
