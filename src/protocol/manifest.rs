//! The commit manifest: one JSON object per version, naming every object of
//! the version with its size and BLAKE3, validated as untrusted input.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

// The layout names keys; the manifest lists them. The dependency is one-way:
// the kinds of versions and objects are the layout's (re-exported here).
pub use super::layout::{ObjectRole, VersionKind};
use super::layout::{is_safe_file_name, parse_object_key, role_allowed};

/// Value of [`Manifest::format`].
pub const MANIFEST_FORMAT: &str = "weightcast-manifest/2";
/// The first release's manifest format (every object under `objects/`).
pub const LEGACY_MANIFEST_FORMAT: &str = "weightcast-manifest/1";
/// Largest manifest a reader accepts (a manifest lists files, not tensors).
pub const MAX_MANIFEST_BYTES: usize = 16 << 20;
/// Largest object or file a manifest may list (1 TiB; checkpoint shards are a
/// few GB). With at most [`MAX_MANIFEST_BYTES`] of entries, a version's
/// total stays far below `u64::MAX`, so readers can add sizes up safely.
pub const MAX_OBJECT_BYTES: u64 = 1 << 40;

/// One object of a version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectEntry {
    /// The checkpoint file this object materializes (e.g. `model-00001-of-00002.safetensors`).
    pub name: String,
    /// What the object is.
    pub role: ObjectRole,
    /// Key relative to the store's prefix.
    pub key: String,
    /// Size in bytes.
    pub size: u64,
    /// BLAKE3 of the object's bytes, 64 hex digits.
    pub blake3: String,
}

/// A non-tensor file of a version (listed whether or not it changed, so that
/// a reader knows the version's complete set of files).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRef {
    /// The checkpoint-relative file name.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// BLAKE3 of the file, 64 hex digits.
    pub blake3: String,
}

/// A commit: everything a reader needs to materialize one version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// [`MANIFEST_FORMAT`].
    pub format: String,
    /// The version committed.
    pub version: u64,
    /// Anchor or delta.
    pub kind: VersionKind,
    /// The version its delta objects apply to (always `version - 1`): present
    /// on every delta, and on an anchor that also carries *bridge* deltas from
    /// the version before it, so that a subscriber behind the anchor can replay
    /// across it instead of downloading it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_version: Option<u64>,
    /// The newest anchor at or before this version.
    pub anchor_version: u64,
    /// The trainer's step this version holds, when the publisher was told.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    /// The writer token of the objects.
    pub writer: String,
    /// The version's objects.
    pub objects: Vec<ObjectEntry>,
    /// Every non-tensor file of the version, changed or not (a file listed
    /// here without a `file` object is unchanged since the version before; a
    /// file a reader holds that is not listed was deleted).
    #[serde(default)]
    pub files: Vec<FileRef>,
}

impl Manifest {
    /// Parses and validates a manifest read from the bucket (untrusted); `key`
    /// names it in errors.
    pub fn parse(bytes: &[u8], key: &str) -> Result<Manifest> {
        let field = format!("manifest {key}");
        if bytes.len() > MAX_MANIFEST_BYTES {
            return Err(Error::metadata(field, "larger than 16 MiB"));
        }
        // The format first, so an old layout gets its own message rather than
        // a complaint about fields.
        #[derive(Deserialize)]
        struct Head {
            format: Option<serde_json::Value>,
        }
        let head: Head =
            serde_json::from_slice(bytes).map_err(|e| Error::metadata(&field, e.to_string()))?;
        if head.format.as_ref().and_then(|f| f.as_str()) == Some(LEGACY_MANIFEST_FORMAT) {
            return Err(Error::metadata(
                field,
                format!(
                    "format `{LEGACY_MANIFEST_FORMAT}` is weightcast's first bucket layout \
                     (objects/<version>-<writer>/); this release reads `{MANIFEST_FORMAT}` \
                     (anchors/, deltas/, files/). Publish into a fresh prefix, or remove \
                     versions/, objects/ and latest.json to start over."
                ),
            ));
        }
        let m: Manifest =
            serde_json::from_slice(bytes).map_err(|e| Error::metadata(&field, e.to_string()))?;
        m.validate()
            .map_err(|e| Error::metadata(&field, e.to_string()))?;
        Ok(m)
    }

    /// Checks the invariants a reader relies on.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::metadata("manifest", what));
        if self.format != MANIFEST_FORMAT {
            return bad(format!(
                "format `{}` is not `{MANIFEST_FORMAT}`",
                self.format
            ));
        }
        let follows = |b: u64| Some(b) == self.version.checked_sub(1);
        match (self.kind, self.base_version) {
            (VersionKind::Anchor, None) if self.anchor_version == self.version => {}
            (VersionKind::Anchor, Some(b)) if self.anchor_version == self.version && follows(b) => {
            }
            (VersionKind::Delta, Some(b)) if follows(b) && self.anchor_version < self.version => {}
            _ => {
                return bad(format!(
                    "inconsistent version {}, kind {:?}, base {:?}, anchor {}",
                    self.version, self.kind, self.base_version, self.anchor_version
                ));
            }
        }
        let bridged = self.base_version.is_some();
        // Which roles name each file: every checkpoint file is materialized
        // from exactly one source, so a name may appear once — except that an
        // anchor with bridges lists each safetensors file twice, as an anchor
        // and as its bridge delta. Checked over the whole list, whatever its
        // order.
        let mut roles: std::collections::BTreeMap<&str, Vec<ObjectRole>> = Default::default();
        let mut keys = std::collections::HashSet::new();
        for o in &self.objects {
            if !is_safe_file_name(&o.name) {
                return bad(format!(
                    "file name `{}` is not a plain relative path",
                    o.name
                ));
            }
            match parse_object_key(&o.key) {
                Some(k)
                    if k.role == o.role
                        && k.version == self.version
                        && k.writer == self.writer
                        && k.name == o.name => {}
                _ => {
                    return bad(format!(
                        "object `{}` ({:?} `{}`) is not at its place for version {} by writer {}",
                        o.key, o.role, o.name, self.version, self.writer
                    ));
                }
            }
            if !keys.insert(o.key.as_str()) {
                return bad(format!("object `{}` listed twice", o.key));
            }
            if o.blake3.len() != 64 || !o.blake3.bytes().all(|b| b.is_ascii_hexdigit()) {
                return bad(format!("object `{}`: blake3 is not 64 hex digits", o.key));
            }
            if o.size > MAX_OBJECT_BYTES {
                return bad(format!(
                    "object `{}`: size {} is over the 1 TiB limit",
                    o.key, o.size
                ));
            }
            if !role_allowed(self.kind, o.role, bridged) {
                return bad(format!(
                    "{:?} version lists {:?} object `{}`",
                    self.kind, o.role, o.key
                ));
            }
            roles.entry(o.name.as_str()).or_default().push(o.role);
        }
        for (name, mut rs) in roles {
            rs.sort();
            let ok = matches!(rs.as_slice(), [_] | [ObjectRole::Anchor, ObjectRole::Delta]);
            if !ok {
                return bad(format!("file `{name}` listed twice ({rs:?})"));
            }
            if !name.ends_with(".safetensors") && rs != [ObjectRole::File] {
                return bad(format!(
                    "file `{name}` is a {:?} object but not a .safetensors file",
                    rs[0]
                ));
            }
            if bridged && self.kind == VersionKind::Anchor {
                // Bridges must cover every anchor file, and only them, or a
                // replay across the anchor would keep a stale file.
                match rs.as_slice() {
                    [ObjectRole::Anchor] => {
                        return bad(format!("anchor file `{name}` has no bridge delta"));
                    }
                    [ObjectRole::Delta] => {
                        return bad(format!("bridge delta `{name}` has no anchor file"));
                    }
                    _ => {}
                }
            }
        }
        let mut listed = std::collections::BTreeMap::new();
        for f in &self.files {
            if !is_safe_file_name(&f.name) || f.name.ends_with(".safetensors") {
                return bad(format!(
                    "files: `{}` is not a plain relative path of a non-tensor file",
                    f.name
                ));
            }
            if f.blake3.len() != 64 || !f.blake3.bytes().all(|b| b.is_ascii_hexdigit()) {
                return bad(format!("files: `{}`: blake3 is not 64 hex digits", f.name));
            }
            if f.size > MAX_OBJECT_BYTES {
                return bad(format!(
                    "files: `{}`: size {} is over the 1 TiB limit",
                    f.name, f.size
                ));
            }
            if listed.insert(f.name.as_str(), f).is_some() {
                return bad(format!("files: `{}` listed twice", f.name));
            }
        }
        for o in self.objects.iter().filter(|o| o.role == ObjectRole::File) {
            match listed.get(o.name.as_str()) {
                Some(f) if f.size == o.size && f.blake3 == o.blake3 => {}
                _ => {
                    return bad(format!(
                        "file object `{}` does not match its entry in `files`",
                        o.key
                    ));
                }
            }
        }
        Ok(())
    }

    /// Whether a reader at `version - 1` can reach this version by applying
    /// its delta objects (every delta version, and anchors with bridges).
    pub fn replays_from_previous(&self) -> bool {
        self.base_version.is_some()
    }

    /// The objects a reader applies to reach this version from the one before:
    /// delta objects and non-tensor files.
    pub fn replay_objects(&self) -> impl Iterator<Item = &ObjectEntry> {
        self.objects.iter().filter(|o| o.role != ObjectRole::Anchor)
    }

    /// The objects a reader starting at this anchor downloads: anchor objects
    /// and non-tensor files.
    pub fn bootstrap_objects(&self) -> impl Iterator<Item = &ObjectEntry> {
        self.objects.iter().filter(|o| o.role != ObjectRole::Delta)
    }

    /// Bytes of [`Manifest::replay_objects`] (saturating: an unvalidated
    /// manifest may list absurd sizes).
    pub fn replay_bytes(&self) -> u64 {
        self.replay_objects()
            .fold(0, |t, o| t.saturating_add(o.size))
    }

    /// Bytes of [`Manifest::bootstrap_objects`] (saturating).
    pub fn bootstrap_bytes(&self) -> u64 {
        self.bootstrap_objects()
            .fold(0, |t, o| t.saturating_add(o.size))
    }
}

#[cfg(test)]
mod tests {
    use super::super::layout::object_key;
    use super::*;

    fn entry(role: ObjectRole, version: u64, writer: &str, name: &str) -> ObjectEntry {
        ObjectEntry {
            name: name.into(),
            role,
            key: object_key(role, version, writer, name).unwrap(),
            size: 1,
            blake3: "0".repeat(64),
        }
    }

    fn manifest(version: u64, writer: &str) -> Manifest {
        let role = if version == 0 {
            ObjectRole::Anchor
        } else {
            ObjectRole::Delta
        };
        Manifest {
            format: MANIFEST_FORMAT.into(),
            version,
            kind: if version == 0 {
                VersionKind::Anchor
            } else {
                VersionKind::Delta
            },
            base_version: version.checked_sub(1),
            anchor_version: 0,
            step: None,
            writer: writer.into(),
            objects: vec![entry(role, version, writer, "model.safetensors")],
            files: Vec::new(),
        }
    }

    fn err(m: &Manifest) -> String {
        m.validate().unwrap_err().to_string()
    }

    #[test]
    fn manifests_are_validated() {
        let good = manifest(3, "w");
        let bytes = serde_json::to_vec(&good).unwrap();
        assert_eq!(Manifest::parse(&bytes, "versions/3").unwrap(), good);
        let mut m = good.clone();
        m.objects[0].name = "../../etc/passwd".into();
        assert!(err(&m).contains("plain relative path"));
        let mut m = good.clone();
        m.objects[0].key = object_key(ObjectRole::Delta, 3, "other", "model.safetensors").unwrap();
        assert!(err(&m).contains("not at its place"));
        let mut m = good.clone();
        m.objects[0].key = object_key(ObjectRole::Anchor, 3, "w", "model.safetensors").unwrap();
        assert!(
            err(&m).contains("not at its place"),
            "role and prefix agree"
        );
        let mut m = good.clone();
        m.base_version = Some(1);
        assert!(m.validate().is_err());
        let mut m = good.clone();
        m.objects.push(m.objects[0].clone());
        assert!(err(&m).contains("twice"));
        let mut m = good.clone();
        m.objects[0].size = u64::MAX;
        assert!(err(&m).contains("1 TiB"));
        assert_eq!(m.replay_bytes(), u64::MAX, "sums saturate");
        assert!(Manifest::parse(b"{\"format\": 1}", "k").is_err());
        assert!(Manifest::parse(&vec![b' '; MAX_MANIFEST_BYTES + 1], "k").is_err());
        // The key is named in parse errors.
        assert!(
            Manifest::parse(b"{", "versions/00000000000000000003.json")
                .unwrap_err()
                .to_string()
                .contains("versions/00000000000000000003.json")
        );
    }

    #[test]
    fn the_old_layout_gets_its_own_message() {
        let mut v = serde_json::to_value(manifest(3, "w")).unwrap();
        v["format"] = LEGACY_MANIFEST_FORMAT.into();
        v["objects"][0]["key"] = "objects/00000000000000000003-w/model.safetensors".into();
        let e = Manifest::parse(&serde_json::to_vec(&v).unwrap(), "versions/x")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("first bucket layout") && e.contains("anchors/"),
            "{e}"
        );
    }

    /// A `file` object named like a tensor file is refused whether it comes
    /// before or after the tensor file's delta (issue D3: the check used to
    /// depend on the order).
    #[test]
    fn a_file_object_cannot_shadow_a_tensor_file_in_either_order() {
        let delta = entry(ObjectRole::Delta, 3, "w", "model.safetensors");
        let file = entry(ObjectRole::File, 3, "w", "model.safetensors");
        for objects in [
            vec![file.clone(), delta.clone()],
            vec![delta.clone(), file.clone()],
        ] {
            let mut m = manifest(3, "w");
            m.objects = objects;
            assert!(err(&m).contains("twice"), "{}", err(&m));
        }
        // Alone, a file object must not pose as a tensor file either.
        let mut m = manifest(3, "w");
        m.objects = vec![entry(ObjectRole::Delta, 3, "w", "config.json")];
        assert!(err(&m).contains("not a .safetensors"), "{}", err(&m));
    }

    #[test]
    fn bridges_cover_exactly_the_anchor_files() {
        let mut anchor = manifest(4, "w");
        anchor.kind = VersionKind::Anchor;
        anchor.anchor_version = 4;
        anchor.base_version = None;
        anchor.objects = vec![entry(ObjectRole::Anchor, 4, "w", "model.safetensors")];
        anchor.validate().unwrap();
        let mut bridged = anchor.clone();
        bridged.base_version = Some(3);
        assert!(err(&bridged).contains("no bridge"));
        let bridge = entry(ObjectRole::Delta, 4, "w", "model.safetensors");
        bridged.objects.push(bridge.clone());
        bridged.validate().unwrap();
        assert!(bridged.replays_from_previous() && !anchor.replays_from_previous());
        assert_eq!(bridged.replay_objects().count(), 1);
        assert_eq!(bridged.bootstrap_objects().count(), 1);
        let mut m = bridged.clone();
        m.base_version = Some(2);
        assert!(m.validate().is_err());
        let mut m = anchor.clone();
        m.objects.push(bridge.clone());
        assert!(err(&m).contains("Delta object"));
        let mut m = bridged.clone();
        m.objects.retain(|o| o.role == ObjectRole::Delta);
        assert!(err(&m).contains("no anchor file"));
        let mut m = bridged.clone();
        m.objects
            .push(entry(ObjectRole::File, 4, "w", "model.safetensors"));
        assert!(err(&m).contains("twice"));
    }
}
