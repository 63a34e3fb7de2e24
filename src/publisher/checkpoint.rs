//! What a publisher publishes: a checkpoint, read from a directory or a file
//! as trainers write them, or handed over from memory.
//!
//! From disk ([`Checkpoint::open`]): a `.safetensors` file, or a directory
//! walked recursively — every `*.safetensors` file is a tensor file, every
//! other file is copied as is (config, tokenizer, index). Symbolic links are
//! followed (the Hugging Face cache layout is all links into `blobs/`), within
//! an optional root that every target must stay under (the daemon's
//! `--checkpoint-root`). Hidden files (a component starting with `.`) are
//! skipped, and so are the files the exclude globs match: by default the
//! optimizer, scheduler and RNG state trainers save beside the weights
//! ([`DEFAULT_EXCLUDES`]). Tensor files are memory-mapped read-only: nothing
//! is copied into the heap. The trainer must not rewrite a file while it is
//! being published (the daemon answers a publish request only when it is
//! done); a rewrite that is noticed (size, mtime or inode changed) fails the
//! publish.
//!
//! From memory ([`Checkpoint::from_sets`]): named [`TensorSet`]s, e.g. over
//! buffers the caller lends ([`TensorSet::from_external`]), plus file bytes.
//!
//! A single-file checkpoint's identity is its tensors, not its file name: a
//! publisher alone publishes a checkpoint with one safetensors file (and no
//! `*.safetensors.index.json` naming it) as [`SINGLE_FILE_NAME`] in its
//! directory ([`Checkpoint::name_single_file`]), so a trainer that saves
//! `step-1.safetensors`, `step-2.safetensors`, … publishes deltas and every
//! replica keeps one stable file name. A sharded checkpoint's file names are
//! its identity: a version whose set of safetensors names differs from the
//! last one's is an anchor.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::protocol::is_safe_file_name;
use crate::tensors::{Digests, TensorSet};

/// Files skipped by default: optimizer, scheduler and RNG state (large, not
/// needed by an inference engine), DeepSpeed's per-rank optimizer shards.
pub const DEFAULT_EXCLUDES: &[&str] = &[
    "**/optimizer*.pt",
    "**/optimizer*.bin",
    "**/optimizer*.safetensors",
    "**/scheduler*.pt",
    "**/rng_state*.pth",
    "**/global_step*/**",
    "**/*.distcp",
];

/// The name a single-file checkpoint is published under (Hugging Face's
/// name for an unsharded checkpoint), whatever its name on disk.
pub const SINGLE_FILE_NAME: &str = "model.safetensors";

/// Which files of a checkpoint directory are published.
#[derive(Clone, Debug, Default)]
pub struct CheckpointOptions {
    /// Only files matching one of these globs (relative to the checkpoint
    /// root, `**` allowed) are published; empty: every file.
    pub include: Vec<String>,
    /// Files matching one of these are skipped (after `include`). `None`:
    /// [`DEFAULT_EXCLUDES`].
    pub exclude: Option<Vec<String>>,
    /// Every file (after following links) must lie under this directory.
    pub root: Option<PathBuf>,
}

/// A non-tensor file of a checkpoint.
#[derive(Debug)]
pub enum FileSource {
    /// A file on disk (streamed when uploaded; hashed before).
    Path {
        /// Where it is.
        path: PathBuf,
        /// Its size when listed.
        size: u64,
    },
    /// Bytes in memory.
    Bytes(Bytes),
}

/// Identity of a file on disk, to notice a rewrite during a publish.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: Option<std::time::SystemTime>,
    ino: u64,
}

fn stamp(path: &Path) -> Result<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m =
        std::fs::metadata(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    Ok(Stamp {
        len: m.len(),
        modified: m.modified().ok(),
        ino: m.ino(),
    })
}

/// A checkpoint to publish.
#[derive(Debug)]
pub struct Checkpoint {
    pub(crate) tensors: BTreeMap<String, TensorSet>,
    pub(crate) files: BTreeMap<String, FileSource>,
    /// Where it was read from (for messages), if from disk.
    pub(crate) origin: Option<PathBuf>,
    /// Tensor file name → the file it was mapped from (resolved), if from
    /// disk: what `--state-mode previous` keeps as the next delta's base.
    pub(crate) tensor_paths: BTreeMap<String, PathBuf>,
    stamps: Vec<(PathBuf, Stamp)>,
}

impl Checkpoint {
    /// Opens a checkpoint on disk (see the module documentation).
    pub fn open(path: &Path, opts: &CheckpointOptions) -> Result<Checkpoint> {
        let filter = Filter::new(opts)?;
        let root = match &opts.root {
            Some(r) => Some(
                r.canonicalize()
                    .map_err(|e| Error::Config(format!("checkpoint root {}: {e}", r.display())))?,
            ),
            None => None,
        };
        let meta = std::fs::metadata(path).map_err(|e| missing_or_bad("checkpoint", path, e))?;
        let mut entries = Vec::new();
        if meta.is_dir() {
            walk(path, "", &filter, &mut entries, 0)?;
        } else {
            let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
                Error::BadRequest(format!("checkpoint {}: not a file name", path.display()))
            })?;
            entries.push((name.to_string(), path.to_path_buf()));
        }
        let mut cp = Checkpoint {
            tensors: BTreeMap::new(),
            files: BTreeMap::new(),
            origin: Some(path.to_path_buf()),
            tensor_paths: BTreeMap::new(),
            stamps: Vec::new(),
        };
        for (name, p) in entries {
            let real = p
                .canonicalize()
                .map_err(|e| missing_or_bad("checkpoint file", &p, e))?;
            if let Some(root) = &root
                && !real.starts_with(root)
            {
                return Err(Error::BadRequest(format!(
                    "checkpoint file {} resolves to {}, outside the checkpoint root {}",
                    p.display(),
                    real.display(),
                    root.display()
                )));
            }
            let st = stamp(&real)?;
            if name.ends_with(".safetensors") {
                let set = TensorSet::map(&real, false, Digests::Skip)
                    .map_err(|e| e.in_input(format!("checkpoint file {}", p.display())))?;
                cp.tensor_paths.insert(name.clone(), real.clone());
                cp.tensors.insert(name, set);
            } else {
                cp.files.insert(
                    name,
                    FileSource::Path {
                        path: real.clone(),
                        size: st.len,
                    },
                );
            }
            cp.stamps.push((real, st));
        }
        if cp.tensors.is_empty() {
            return Err(Error::BadRequest(format!(
                "checkpoint {}: no .safetensors file (after the include/exclude filters)",
                path.display()
            )));
        }
        if cp.tensors.values().all(|s| s.is_empty()) {
            return Err(Error::BadRequest(format!(
                "checkpoint {}: its .safetensors files hold no tensors (a checkpoint saved \
                 before the model was built?)",
                path.display()
            )));
        }
        Ok(cp)
    }

    /// A checkpoint from memory: tensor files by name (each a [`TensorSet`])
    /// and other files' bytes.
    pub fn from_sets(
        tensors: BTreeMap<String, TensorSet>,
        files: BTreeMap<String, Bytes>,
    ) -> Result<Checkpoint> {
        check_names(tensors.keys(), files.keys())?;
        if tensors.is_empty() || tensors.values().all(|s| s.is_empty()) {
            return Err(Error::BadRequest("no tensors to publish".into()));
        }
        Ok(Checkpoint::in_memory(tensors, files))
    }

    fn in_memory(tensors: BTreeMap<String, TensorSet>, files: BTreeMap<String, Bytes>) -> Self {
        Checkpoint {
            tensors,
            files: files
                .into_iter()
                .map(|(k, v)| (k, FileSource::Bytes(v)))
                .collect(),
            origin: None,
            tensor_paths: BTreeMap::new(),
            stamps: Vec::new(),
        }
    }

    /// The file names and non-tensor files of a version whose tensors the
    /// caller hands over as changes ([`super::Publisher::publish_changes`]):
    /// its tensor files hold no tensors here.
    pub(crate) fn for_changes(
        tensor_files: &[String],
        files: BTreeMap<String, Bytes>,
    ) -> Result<Checkpoint> {
        check_names(tensor_files.iter(), files.keys())?;
        let tensors = tensor_files
            .iter()
            .map(|n| Ok((n.clone(), TensorSet::from_tensors(Vec::new())?)))
            .collect::<Result<_>>()?;
        Ok(Checkpoint::in_memory(tensors, files))
    }

    /// Names a single-file checkpoint [`SINGLE_FILE_NAME`] (in the directory
    /// its file is in): one safetensors file, and no index file that names
    /// it. A sharded checkpoint (several files, or an index) keeps its names.
    /// Returns whether it renamed the file.
    pub fn name_single_file(&mut self) -> bool {
        if self.tensors.len() != 1
            || self
                .files
                .keys()
                .any(|f| f.ends_with(".safetensors.index.json"))
        {
            return false;
        }
        let name = self.tensors.keys().next().expect("one file").clone();
        let stable = match name.rsplit_once('/') {
            Some((dir, _)) => format!("{dir}/{SINGLE_FILE_NAME}"),
            None => SINGLE_FILE_NAME.to_string(),
        };
        if name == stable || self.files.contains_key(&stable) {
            return false;
        }
        let set = self.tensors.remove(&name).expect("listed");
        if let Some(p) = self.tensor_paths.remove(&name) {
            self.tensor_paths.insert(stable.clone(), p);
        }
        tracing::debug!(file = %name, published_as = %stable, "a single-file checkpoint");
        self.tensors.insert(stable, set);
        true
    }

    /// The tensor files, by name.
    pub fn tensor_files(&self) -> &BTreeMap<String, TensorSet> {
        &self.tensors
    }

    /// Elements over every tensor file.
    pub fn total_elements(&self) -> u64 {
        self.tensors.values().map(|t| t.total_elements()).sum()
    }

    /// Fails if a file read from disk changed since it was opened.
    pub(crate) fn check_unchanged(&self) -> Result<()> {
        for (p, st) in &self.stamps {
            if stamp(p).ok().as_ref() != Some(st) {
                return Err(Error::Conflict(format!(
                    "checkpoint file {} changed while it was being published; publish it \
                     again once the trainer has finished writing it",
                    p.display()
                )));
            }
        }
        Ok(())
    }

    /// Every tensor file's own path, if all were read from disk (`None`
    /// for a checkpoint from memory).
    pub(crate) fn tensor_paths(&self) -> Option<&BTreeMap<String, PathBuf>> {
        (self.tensor_paths.len() == self.tensors.len() && !self.tensors.is_empty())
            .then_some(&self.tensor_paths)
    }

    /// Where the checkpoint came from, for messages.
    pub(crate) fn describe(&self) -> String {
        self.origin.as_ref().map_or_else(
            || "in-memory checkpoint".into(),
            |p| p.display().to_string(),
        )
    }
}

/// Tensor files are plain relative paths named `*.safetensors`; other files
/// are plain relative paths not named so.
fn check_names<'a, 'b>(
    tensors: impl Iterator<Item = &'a String>,
    files: impl Iterator<Item = &'b String>,
) -> Result<()> {
    for name in tensors {
        if !is_safe_file_name(name) {
            return Err(Error::BadRequest(format!(
                "file name `{name}` is not a plain relative path"
            )));
        }
        if !name.ends_with(".safetensors") {
            return Err(Error::BadRequest(format!(
                "tensor file `{name}` must be named *.safetensors"
            )));
        }
    }
    for name in files {
        if !is_safe_file_name(name) {
            return Err(Error::BadRequest(format!(
                "file name `{name}` is not a plain relative path"
            )));
        }
        if name.ends_with(".safetensors") {
            return Err(Error::BadRequest(format!(
                "file `{name}` is named like a tensor file; pass it as tensors"
            )));
        }
    }
    Ok(())
}

/// The error for a checkpoint path that cannot be read: not found (the same
/// exit code and HTTP status as anything named that does not exist), else a
/// bad request naming it.
fn missing_or_bad(what: &str, path: &Path, e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::NotFound {
        Error::NotFound(format!("{what} {}: {e}", path.display()))
    } else {
        Error::BadRequest(format!("{what} {}: {e}", path.display()))
    }
}

/// Size and BLAKE3 of a non-tensor file, streamed (a large file is never
/// read into memory whole).
pub(crate) fn hash_file(src: &FileSource) -> Result<(u64, String)> {
    match src {
        FileSource::Bytes(b) => Ok((
            b.len() as u64,
            crate::digest::blake3_of(b).to_hex().to_string(),
        )),
        FileSource::Path { path, .. } => {
            let io = |e| Error::io(format!("reading {}", path.display()), e);
            let file = std::fs::File::open(path).map_err(io)?;
            let size = file.metadata().map_err(io)?.len();
            let mut h = blake3::Hasher::new();
            h.update_reader(file).map_err(io)?;
            Ok((size, h.finalize().to_hex().to_string()))
        }
    }
}

struct Filter {
    include: Option<Vec<glob::Pattern>>,
    exclude: Vec<glob::Pattern>,
}

/// `*`, `?` and `[...]` stay within one path component; `**` spans any
/// number of them, including none (so `**/x` also matches `x` at the root).
const GLOB_OPTIONS: glob::MatchOptions = glob::MatchOptions {
    case_sensitive: true,
    require_literal_separator: true,
    require_literal_leading_dot: false,
};

fn globs(patterns: &[impl AsRef<str>], what: &str) -> Result<Vec<glob::Pattern>> {
    patterns
        .iter()
        .map(|p| {
            let p = p.as_ref();
            glob::Pattern::new(p).map_err(|e| {
                Error::Config(format!(
                    "{what} glob `{p}`: {} at character {} (globs take `*`, `?`, `[...]` and `**` as a whole path component)",
                    e.msg, e.pos
                ))
            })
        })
        .collect()
}

fn any_match(globs: &[glob::Pattern], rel: &str) -> bool {
    globs.iter().any(|g| g.matches_with(rel, GLOB_OPTIONS))
}

impl Filter {
    fn new(opts: &CheckpointOptions) -> Result<Filter> {
        let include = (!opts.include.is_empty())
            .then(|| globs(&opts.include, "include"))
            .transpose()?;
        let exclude = match &opts.exclude {
            Some(e) => globs(e, "exclude")?,
            None => globs(DEFAULT_EXCLUDES, "exclude")?,
        };
        Ok(Filter { include, exclude })
    }

    fn wants(&self, rel: &str) -> bool {
        self.include.as_ref().is_none_or(|i| any_match(i, rel)) && !any_match(&self.exclude, rel)
    }

    /// Whether a directory may hold wanted files (an excluded directory
    /// pattern like `global_step*/**` prunes it).
    fn enters(&self, rel: &str) -> bool {
        !any_match(&self.exclude, &format!("{rel}/x"))
    }
}

/// Directory depth beyond which a walk refuses (a link cycle, or a mistake).
const MAX_DEPTH: usize = 16;

fn walk(
    dir: &Path,
    rel: &str,
    filter: &Filter,
    out: &mut Vec<(String, PathBuf)>,
    depth: usize,
) -> Result<()> {
    if depth > MAX_DEPTH {
        return Err(Error::BadRequest(format!(
            "checkpoint directory {} is nested more than {MAX_DEPTH} levels deep (a link cycle?)",
            dir.display()
        )));
    }
    let io = |e| Error::io(format!("listing {}", dir.display()), e);
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(io)?
        .collect::<std::io::Result<_>>()
        .map_err(io)?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let Some(name) = e.file_name().to_str().map(str::to_string) else {
            tracing::warn!(path = %e.path().display(), "skipping a file whose name is not UTF-8");
            continue;
        };
        if name.starts_with('.') {
            continue;
        }
        let rel = if rel.is_empty() {
            name.clone()
        } else {
            format!("{rel}/{name}")
        };
        // `metadata` follows links: a link to a file is a file.
        let meta = std::fs::metadata(e.path()).map_err(|err| {
            Error::BadRequest(format!("checkpoint file {}: {err}", e.path().display()))
        })?;
        if meta.is_dir() {
            if filter.enters(&rel) {
                walk(&e.path(), &rel, filter, out, depth + 1)?;
            }
        } else if meta.is_file() && filter.wants(&rel) {
            if !is_safe_file_name(&rel) {
                return Err(Error::BadRequest(format!(
                    "checkpoint file name `{rel}` is not a plain relative path"
                )));
            }
            out.push((rel, e.path()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;

    fn write_tensors(p: &Path) {
        let set = TensorSet::from_tensors(vec![("w".to_string(), Dtype::U8, vec![2], vec![1, 2])])
            .unwrap();
        let mut f = std::fs::File::create(p).unwrap();
        set.write_to(&BTreeMap::new(), &mut f).unwrap();
    }

    fn names(cp: &Checkpoint) -> Vec<String> {
        cp.tensors.keys().chain(cp.files.keys()).cloned().collect()
    }

    #[test]
    fn directories_are_walked_with_links_subdirectories_and_filters() {
        let d = tempfile::tempdir().unwrap();
        let blobs = d.path().join("blobs");
        let snap = d.path().join("snapshot");
        std::fs::create_dir_all(&blobs).unwrap();
        std::fs::create_dir_all(snap.join("tokenizer")).unwrap();
        std::fs::create_dir_all(snap.join("global_step7")).unwrap();
        write_tensors(&blobs.join("abc"));
        std::os::unix::fs::symlink("../blobs/abc", snap.join("model.safetensors")).unwrap();
        std::fs::write(snap.join("config.json"), b"{}").unwrap();
        std::fs::write(snap.join("tokenizer/vocab.json"), b"[]").unwrap();
        std::fs::write(snap.join("optimizer.pt"), b"big").unwrap();
        std::fs::write(snap.join("rng_state_0.pth"), b"rng").unwrap();
        std::fs::write(snap.join("global_step7/zero.pt"), b"z").unwrap();
        std::fs::write(snap.join(".hidden"), b"h").unwrap();

        let cp = Checkpoint::open(&snap, &CheckpointOptions::default()).unwrap();
        assert_eq!(
            names(&cp),
            ["model.safetensors", "config.json", "tokenizer/vocab.json"]
        );

        // Excludes replaced: the optimizer comes along.
        let opts = CheckpointOptions {
            exclude: Some(vec!["**/rng_state*".into(), "**/global_step*/**".into()]),
            ..Default::default()
        };
        let cp = Checkpoint::open(&snap, &opts).unwrap();
        assert!(cp.files.contains_key("optimizer.pt"));
        assert!(!cp.files.contains_key("rng_state_0.pth"));

        // Includes narrow it down.
        let opts = CheckpointOptions {
            include: vec!["*.safetensors".into(), "*.json".into()],
            ..Default::default()
        };
        assert_eq!(
            names(&Checkpoint::open(&snap, &opts).unwrap()),
            ["model.safetensors", "config.json"]
        );

        // A root the link leaves is refused, naming the file.
        let opts = CheckpointOptions {
            root: Some(snap.clone()),
            ..Default::default()
        };
        let e = Checkpoint::open(&snap, &opts).unwrap_err().to_string();
        assert!(e.contains("outside the checkpoint root"), "{e}");
        let opts = CheckpointOptions {
            root: Some(d.path().to_path_buf()),
            ..Default::default()
        };
        Checkpoint::open(&snap, &opts).unwrap();
    }

    #[test]
    fn globs_keep_to_path_components_and_double_star_spans_them() {
        let g = globs(
            &[
                "**/optimizer*.pt",
                "*.json",
                "global_step*/**",
                "a/[bc]?.bin",
            ],
            "x",
        )
        .unwrap();
        for yes in [
            "optimizer.pt",
            "sub/dir/optimizer_0.pt",
            "config.json",
            "global_step7/zero.pt",
            "global_step7/deep/er.pt",
            "a/bx.bin",
        ] {
            assert!(any_match(&g, yes), "{yes} should match");
        }
        for no in [
            "tokenizer/vocab.json",
            "optimizer.bin",
            "xglobal_step7/a",
            "a/dx.bin",
            "a/b/x.bin",
        ] {
            assert!(!any_match(&g, no), "{no} should not match");
        }
        let e = globs(&["a[".to_string()], "exclude")
            .unwrap_err()
            .to_string();
        assert!(e.contains("exclude glob `a[`"), "{e}");
    }

    #[test]
    fn bad_checkpoints_are_bad_requests_naming_the_file() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("model.safetensors"), b"not safetensors").unwrap();
        let e = Checkpoint::open(d.path(), &CheckpointOptions::default()).unwrap_err();
        assert_eq!(e.kind(), crate::error::ErrorKind::BadRequest, "{e}");
        assert!(e.to_string().contains("model.safetensors"), "{e}");
        let empty = tempfile::tempdir().unwrap();
        std::fs::write(empty.path().join("config.json"), b"{}").unwrap();
        let e = Checkpoint::open(empty.path(), &CheckpointOptions::default()).unwrap_err();
        assert!(e.to_string().contains("no .safetensors"), "{e}");
        let bad = CheckpointOptions {
            exclude: Some(vec!["a[".into()]),
            ..Default::default()
        };
        assert!(Checkpoint::open(d.path(), &bad).is_err());
    }

    #[test]
    fn a_single_file_is_named_by_its_tensors_and_shards_keep_their_names() {
        let d = tempfile::tempdir().unwrap();
        write_tensors(&d.path().join("step-7.safetensors"));
        let mut cp =
            Checkpoint::open(&d.path().join("step-7.safetensors"), &Default::default()).unwrap();
        assert!(cp.name_single_file());
        assert_eq!(names(&cp), [SINGLE_FILE_NAME]);
        // In a directory, with a config beside it.
        std::fs::write(d.path().join("config.json"), b"{}").unwrap();
        let mut cp = Checkpoint::open(d.path(), &Default::default()).unwrap();
        assert!(cp.name_single_file());
        assert_eq!(names(&cp), [SINGLE_FILE_NAME, "config.json"]);
        // An index names its shards: kept, and so are several files.
        std::fs::write(d.path().join("model.safetensors.index.json"), b"{}").unwrap();
        let mut cp = Checkpoint::open(d.path(), &Default::default()).unwrap();
        assert!(!cp.name_single_file());
        std::fs::remove_file(d.path().join("model.safetensors.index.json")).unwrap();
        write_tensors(&d.path().join("step-8.safetensors"));
        let mut cp = Checkpoint::open(d.path(), &Default::default()).unwrap();
        assert!(!cp.name_single_file());
        assert_eq!(cp.tensors.len(), 2);
    }

    #[test]
    fn a_rewritten_file_is_noticed() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("model.safetensors");
        write_tensors(&p);
        let cp = Checkpoint::open(&p, &CheckpointOptions::default()).unwrap();
        cp.check_unchanged().unwrap();
        // The trainer writes the next step into the same path.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let tmp = d.path().join("next");
        write_tensors(&tmp);
        std::fs::rename(&tmp, &p).unwrap();
        let e = cp.check_unchanged().unwrap_err();
        assert_eq!(e.kind(), crate::error::ErrorKind::Precondition);
    }
}
