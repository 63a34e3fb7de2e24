//! Local file helpers shared by the publisher (its state directory) and the
//! subscriber (its output directory): durable, atomic small-file writes,
//! directory syncs, and the [`Error::Io`](crate::Error) that names the file.
//!
//! Both roles keep state on local disk that must survive a crash whole or not
//! at all; these are the only places that decide how. Both also trust their
//! large files between runs by a [`Stamp`] recorded in their state (the way
//! git trusts its index), and report what they write ([`written_bytes`]).

use std::path::Path;

use serde::{Deserialize, Serialize};

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

/// What `stat` says about a file once it was written and synced: any later
/// write (a `write`, a store through a shared map, a truncation) or
/// replacement changes its inode or change time (`ctime`, which no user call
/// can set back), so a file whose stamp still matches the one recorded is the
/// file recorded. Content changed without the kernel's knowledge (a disk
/// returning other bytes) keeps its stamp: the checks in proportion to the
/// changes of each version, and `weightcast verify`, are what see that.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stamp {
    /// Inode number.
    pub ino: u64,
    /// Last modification, nanoseconds since the epoch.
    pub mtime_ns: i64,
    /// Last change of the inode (data or metadata), nanoseconds since the epoch.
    pub ctime_ns: i64,
}

impl Stamp {
    /// The size and stamp of the regular file at `p` (`None`: absent, or
    /// not a regular file; links are not followed).
    pub fn of(p: &Path) -> Option<(u64, Stamp)> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(p).ok()?;
        if !m.is_file() {
            return None;
        }
        let ns = |s: i64, n: i64| s.saturating_mul(1_000_000_000).saturating_add(n);
        Some((
            m.len(),
            Stamp {
                ino: m.ino(),
                mtime_ns: ns(m.mtime(), m.mtime_nsec()),
                ctime_ns: ns(m.ctime(), m.ctime_nsec()),
            },
        ))
    }

    /// Whether this stamp, recorded in the file `record`, can be trusted:
    /// the file's last change is strictly older than the record. A file
    /// changed in the same clock tick as the record was written (file
    /// systems keep coarse times) could change again unseen — "racily
    /// clean", as git calls it — and is verified instead.
    pub fn older_than(&self, record: &Path) -> bool {
        Stamp::of(record).is_some_and(|(_, r)| self.ctime_ns < r.mtime_ns)
    }
}

/// [`write_atomic`], then, while the written file's modification time is not
/// later than `newer_than_ns` (the newest change time of the files whose
/// stamps it records: a coarse clock may not have moved on since), waits a
/// millisecond and writes it again, at most 100 times; so that
/// [`Stamp::older_than`] holds for each stamp recorded in it.
pub fn write_atomic_after(path: &Path, bytes: &[u8], newer_than_ns: i64) -> Result<()> {
    for _ in 0..100 {
        write_atomic(path, bytes)?;
        if Stamp::of(path).is_none_or(|(_, s)| s.mtime_ns > newer_than_ns) {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    // Still not later (a clock set back): the stamps are verified next time.
    Ok(())
}

/// Bytes this process has caused to be written to storage so far
/// (`write_bytes` of `/proc/self/io`: pages it dirtied in files on a disk,
/// through `write` or a shared map; nothing on tmpfs), or `None` where the
/// kernel does not say.
pub fn written_bytes() -> Option<u64> {
    let io = std::fs::read_to_string("/proc/self/io").ok()?;
    io.lines()
        .find_map(|l| l.strip_prefix("write_bytes:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Memory this process could still take, in bytes: the kernel's
/// `MemAvailable`, or less where the cgroup it runs in (a container's
/// `memory.max`) leaves less; `None` where neither says.
pub fn memory_available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let cgroup = |f: &str| std::fs::read_to_string(format!("/sys/fs/cgroup/{f}")).ok();
    available_of(
        meminfo.as_deref(),
        cgroup("memory.max").as_deref(),
        cgroup("memory.current").as_deref(),
    )
}

/// [`memory_available`] from the texts of `/proc/meminfo`, `memory.max` and
/// `memory.current`.
fn available_of(meminfo: Option<&str>, max: Option<&str>, current: Option<&str>) -> Option<u64> {
    let host = meminfo.and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().strip_suffix("kB"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(|kb| kb.saturating_mul(1024))
    });
    // `max` (no limit) or unreadable: no cgroup bound.
    let limit = max
        .and_then(|m| m.trim().parse::<u64>().ok())
        .map(|max| max.saturating_sub(current.and_then(|c| c.trim().parse().ok()).unwrap_or(0)));
    match (host, limit) {
        (Some(h), Some(l)) => Some(h.min(l)),
        (h, l) => h.or(l),
    }
}

/// Bytes of the regular files under `dir` (recursively; 0 where it cannot
/// be read).
pub fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// Whether `dir` is on a file system kept in memory (tmpfs, ramfs), where
/// rewriting a file in place costs no disk writes.
pub fn in_memory(dir: &Path) -> bool {
    const TMPFS: u64 = 0x0102_1994;
    const RAMFS: u64 = 0x8584_58f6;
    rustix::fs::statfs(dir).is_ok_and(|s| matches!(s.f_type as u64, TMPFS | RAMFS))
}

/// Whether files on `dir`'s file system may share blocks with other files:
/// file systems with reflinks (XFS, Btrfs, bcachefs, OCFS2, ZFS), where a
/// copy may be a clone (`reflink_or_copy`, and on some of them any
/// `copy_file_range`), so that writing a block of one file allocates a new
/// block for it.
///
/// `WEIGHTCAST_ROOM_CHECK=always` treats every file system so (one with
/// clones this list misses), `never` none (the operator vouches for the
/// free space).
pub fn shares_blocks(dir: &Path) -> bool {
    match std::env::var("WEIGHTCAST_ROOM_CHECK").as_deref() {
        Ok("always") => true,
        Ok("never") => false,
        _ => rustix::fs::statfs(dir).is_ok_and(|s| shares_blocks_of(s.f_type as u64)),
    }
}

/// [`shares_blocks`] by the file system's magic number (`statfs`'s
/// `f_type`).
fn shares_blocks_of(f_type: u64) -> bool {
    const XFS: u64 = 0x5846_5342;
    const BTRFS: u64 = 0x9123_683e;
    const BCACHEFS: u64 = 0xca45_1a4e;
    const OCFS2: u64 = 0x7461_636f;
    const ZFS: u64 = 0x2fc1_2fc1;
    matches!(f_type, XFS | BTRFS | BCACHEFS | OCFS2 | ZFS)
}

/// Checks, before `file` (`bytes` long) is rewritten in place through a
/// writable mapping, that its file system has `bytes` free. Where the file
/// shares its blocks with another (a reflinked copy, see
/// [`shares_blocks`]), each block written first gets a new one; on a full
/// file system that allocation fails inside a page fault, which the kernel
/// reports as SIGBUS: the process dies instead of getting an error. At the
/// usual densities a delta writes to nearly every page of the file, so the
/// whole file is what it may need.
pub fn room_to_rewrite(file: &Path, bytes: u64) -> Result<()> {
    let s = rustix::fs::statvfs(file)
        .map_err(|e| io_err("checking the free space for", file, e.into()))?;
    let free = s.f_bavail.saturating_mul(s.f_frsize);
    if free >= bytes {
        return Ok(());
    }
    Err(Error::io(
        format!("rewriting {} in place", file.display()),
        std::io::Error::new(
            std::io::ErrorKind::StorageFull,
            format!(
                "it may share its {bytes} bytes with another file (reflinks on this file \
                 system), and writing a shared block needs a new one, but only {free} bytes \
                 are free; free at least {} bytes, or keep the output on a file system \
                 without reflinks",
                bytes - free
            ),
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_systems_with_reflinks_are_known_by_their_magic() {
        assert!(shares_blocks_of(0x5846_5342), "XFS");
        assert!(shares_blocks_of(0x9123_683e), "Btrfs");
        assert!(!shares_blocks_of(0xef53), "ext4");
        assert!(!shares_blocks_of(0x0102_1994), "tmpfs");
    }

    #[test]
    fn too_little_free_space_to_rewrite_a_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.safetensors");
        std::fs::write(&p, [0u8; 16]).unwrap();
        room_to_rewrite(&p, 16).unwrap();
        // More than any disk holds.
        let e = room_to_rewrite(&p, u64::MAX / 4).unwrap_err().to_string();
        assert!(e.contains("model.safetensors"), "{e}");
        assert!(e.contains("bytes are free"), "{e}");
        let e = room_to_rewrite(&dir.path().join("missing"), 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing"), "{e}");
    }

    #[test]
    fn memory_available_is_the_host_s_or_the_cgroup_s_whichever_is_less() {
        let meminfo =
            "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        let host = 20_000_000u64 * 1024;
        assert_eq!(available_of(Some(meminfo), None, None), Some(host));
        assert_eq!(
            available_of(Some(meminfo), Some("max\n"), Some("5\n")),
            Some(host)
        );
        // A container limited to 8 GiB with 3 GiB in use: 5 GiB left.
        let (max, cur) = ((8u64 << 30).to_string(), (3u64 << 30).to_string());
        assert_eq!(
            available_of(Some(meminfo), Some(&max), Some(&cur)),
            Some(5 << 30)
        );
        // Over its limit already: nothing left.
        assert_eq!(available_of(Some(meminfo), Some("10"), Some("20")), Some(0));
        assert_eq!(available_of(None, Some(&max), None), Some(8 << 30));
        assert_eq!(available_of(Some("garbage"), Some("max"), None), None);
        assert_eq!(available_of(None, None, None), None);
        // And this machine's answer, whatever it is, is read without error.
        let _ = memory_available();
    }

    #[test]
    fn dir_bytes_sums_regular_files_at_every_depth() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a"), vec![0u8; 10]).unwrap();
        std::fs::create_dir_all(dir.path().join("sub/deeper")).unwrap();
        std::fs::write(dir.path().join("sub/b"), vec![0u8; 5]).unwrap();
        std::fs::write(dir.path().join("sub/deeper/c"), vec![0u8; 7]).unwrap();
        assert_eq!(dir_bytes(dir.path()), 22);
        assert_eq!(dir_bytes(&dir.path().join("missing")), 0);
    }

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

    #[test]
    fn stamps_change_with_any_write_and_records_are_newer_than_them() {
        let dir = tempfile::tempdir().unwrap();
        let (f, record) = (dir.path().join("data"), dir.path().join("record"));
        std::fs::write(&f, b"abcd").unwrap();
        let (size, st) = Stamp::of(&f).unwrap();
        assert_eq!(size, 4);
        write_atomic_after(&record, b"{}", st.ctime_ns).unwrap();
        assert!(st.older_than(&record));
        // Same size, mtime set back: the change time still moves.
        let mtime = std::fs::metadata(&f).unwrap().modified().unwrap();
        std::fs::write(&f, b"abce").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&f)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        let (size2, st2) = Stamp::of(&f).unwrap();
        assert_eq!((size2, st2.mtime_ns, st2.ino), (4, st.mtime_ns, st.ino));
        assert_ne!(st2, st);
        assert!(!st2.older_than(&record), "changed after the record");
        assert!(Stamp::of(dir.path()).is_none(), "a directory has no stamp");
        assert!(written_bytes().is_some(), "Linux reports /proc/self/io");
    }
}
