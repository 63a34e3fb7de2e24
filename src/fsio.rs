//! Local file helpers shared by the publisher (its state directory) and the
//! subscriber (its output directory): durable, atomic small-file writes,
//! directory syncs, and the [`Error::Io`](crate::Error) that names the file.
//!
//! Both roles keep state on local disk that must survive a crash whole or not
//! at all; these are the only places that decide how.

use std::path::Path;

use crate::error::{Error, Result};

/// A local I/O error naming what was being done and the path:
/// `io_err("writing", p, e)` reads "writing /path: " and the cause.
pub fn io_err(what: &str, p: &Path, e: std::io::Error) -> Error {
    Error::io(format!("{what} {}", p.display()), e)
}

/// Writes `bytes` to `path` durably and atomically: a temporary file beside
/// it (`path` with the extension `tmp`), written and fsynced, renamed over
/// `path`, then the directory fsynced. A crash leaves the old content or the
/// new one, never a mix.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::File::create(&tmp)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        })
        .map_err(|e| io_err("writing", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io_err("renaming", &tmp, e))?;
    sync_dir(dir)
}

/// Flushes a directory's entries (creations, renames) to stable storage.
pub fn sync_dir(p: &Path) -> Result<()> {
    std::fs::File::open(p)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err("syncing directory", p, e))
}

/// Flushes a file written earlier (by another handle) to stable storage.
pub fn sync_file(p: &Path) -> Result<()> {
    std::fs::File::open(p)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err("syncing", p, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_atomic_replaces_whole_and_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.json");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two, longer").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two, longer");
        assert!(!p.with_extension("tmp").exists(), "no temporary left");
        let missing = dir.path().join("no/such/dir/state.json");
        let e = write_atomic(&missing, b"x").unwrap_err();
        assert!(matches!(e, Error::Io { .. }), "{e:?}");
        assert!(e.to_string().contains("no/such/dir/state.tmp"), "{e}");
        let e = sync_dir(&dir.path().join("absent")).unwrap_err();
        assert!(e.to_string().contains("syncing directory"), "{e}");
    }
}
