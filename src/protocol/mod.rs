//! The bucket protocol: where objects live, how a version becomes visible,
//! who follows the bucket, and what is kept.
//!
//! ```text
//! <prefix>/
//!   anchors/<version:020>-<writer>/<file>   anchor objects: full safetensors files
//!   deltas/<version:020>-<writer>/<file>    delta objects: changed elements (an anchor's bridges too)
//!   files/<version:020>-<writer>/<file>     non-tensor files (config, tokenizer, index), as is
//!   versions/<version:020>.json             the commit manifest: written last, create-if-absent
//!   latest.json                             hint: the newest committed version (overwritten)
//!   subscribers/<id>.json                   subscriber registrations
//!   parts/<version:020>/...                 distributed publish: each rank's intent and part
//! ```
//!
//! A version exists exactly when `versions/<version>.json` exists. Its objects
//! are uploaded first under keys unique to the writer (`<writer>` is random per
//! publish attempt), so two publishers racing for a version never overwrite
//! each other's objects; the manifest is then created with a conditional
//! create, which exactly one of them wins (delta-rs commits its log the same
//! way). A manifest names every object with its size and BLAKE3, so a reader
//! never sees a partial version and can check every byte it downloads; every
//! anchor and delta object also describes itself in its own safetensors
//! header (kind, version, base version, digests; docs/format.md).
//!
//! `latest.json` lets a subscriber learn the newest version with one small
//! conditional GET per poll. It is only a hint: it is written after the commit
//! (a crash in between leaves it one version behind until the next publish, or
//! until [`repair_latest`]), and readers that need certainty list `versions/`
//! after the version they know ([`versions_after`]).
//!
//! Modules: [`layout`] (key names), [`manifest`] (the commit record and its
//! validation), [`commit`](mod@commit) (writing and reading versions),
//! [`parts`] (W ranks agreeing on one version), [`registry`] (subscriber registrations and the fleet view), [`retention`]
//! (garbage collection), [`trl`] (TRL's own layout, read and written for
//! interoperability: `anchors/step_NNNNNN.safetensors`, no manifests).

pub mod commit;
pub mod layout;
pub mod manifest;
pub mod parts;
pub mod registry;
pub mod retention;
pub mod trl;

pub use commit::{
    Commit, Latest, Staging, commit, newest_version, read_latest, read_manifest, repair_latest,
    versions_after, write_latest,
};
pub use layout::{
    ANCHORS_PREFIX, DELTAS_PREFIX, FILES_PREFIX, LATEST_KEY, SUBSCRIBERS_PREFIX, VERSIONS_PREFIX,
    is_safe_file_name, manifest_key, object_key, version_of_manifest_key, writer_token,
};
pub use manifest::{
    FileRef, MANIFEST_FORMAT, MAX_MANIFEST_BYTES, MAX_OBJECT_BYTES, Manifest, ObjectEntry,
    ObjectRole, VersionKind,
};
pub use registry::{Fleet, FleetMember, Registration, fleet, register, registrations, valid_id};
pub use retention::{Collected, Retention, collect_garbage};

/// Which bucket layout a publisher writes and a subscriber reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// weightcast's own: anchors/, deltas/, files/, commit manifests (above).
    #[default]
    Weightcast,
    /// TRL's: `anchors/step_NNNNNN.safetensors`, `deltas/step_NNNNNN.safetensors`,
    /// nothing else ([`trl`]).
    Trl,
}

impl std::str::FromStr for Layout {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "weightcast" => Ok(Layout::Weightcast),
            "trl" => Ok(Layout::Trl),
            other => Err(crate::Error::Config(format!(
                "bucket layout `{other}`: expected weightcast or trl"
            ))),
        }
    }
}
