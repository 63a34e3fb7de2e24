//! Distributed publish: this publisher is rank R of W trainer ranks, each
//! publishing its own shard files; the W ranks commit exactly one version per
//! step together (docs/format.md §9.1, [`crate::protocol::parts`]).
//!
//! 1. [`agree`]: the rank writes its intent for version V (its step, a random
//!    token, whether it needs an anchor) — or, restarted at the same step,
//!    reuses the one it wrote — and waits for all W intents. The version is
//!    an anchor if any rank needs one; its writer token is a hash of the W
//!    tokens, so every rank derives the same one.
//! 2. The rank uploads its objects under that writer and records the pending
//!    commit in its state (as a single publisher does).
//! 3. [`commit`]: the rank writes its part (its share of the manifest) and,
//!    until the manifest of V exists, whenever all W parts of the writer are
//!    there merges them and creates the manifest (create-if-absent: racing
//!    ranks write the same manifest; one create wins). Only then does the
//!    rank advance its snapshot.
//!
//! Every wait is bounded by [`Distributed::timeout`]; a rank that times out
//! leaves its state at the last version it saw committed (if the version is
//! committed later, the next publish finds the bucket ahead of its snapshot
//! and the version after is an anchor for every rank).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::protocol::parts::{
    INTENT_FORMAT, Intent, PART_FORMAT, Part, check_delta_files, intent_key, merge, part_key,
    read_record, shared_writer, write_record,
};
use crate::protocol::{Commit, Latest, Manifest, read_manifest, write_latest, writer_token};
use crate::store::Store;

/// Which rank of how many a publisher is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Distributed {
    /// This publisher's rank, `0..world`.
    pub rank: u32,
    /// The number of ranks (2 or more).
    pub world: u32,
    /// How long to wait for the other ranks, at each of the two meeting
    /// points (all intents; the commit).
    pub timeout: Duration,
}

/// The default of [`Distributed::timeout`]: 10 minutes.
pub const DEFAULT_RANK_TIMEOUT: Duration = Duration::from_secs(600);

impl Distributed {
    /// Rank `rank` of `world`, the default timeout. `world` must be 2 or
    /// more (one rank publishes alone) and `rank` below it.
    pub fn new(rank: u32, world: u32) -> Result<Distributed> {
        if world < 2 || rank >= world {
            return Err(Error::Config(format!(
                "rank {rank} of world {world}: the world must be 2 or more ranks (a single \
                 publisher needs neither --rank nor --world) and the rank below it"
            )));
        }
        Ok(Distributed {
            rank,
            world,
            timeout: DEFAULT_RANK_TIMEOUT,
        })
    }
}

/// What the W ranks agreed on for a version.
#[derive(Clone, Debug)]
pub struct Agreement {
    /// The writer token of every object of the version.
    pub writer: String,
    /// Why the version is an anchor, when it is (the first rank's reason).
    pub anchor: Option<String>,
    /// Whether this rank resumed the intent of an earlier attempt at the
    /// same step (a restart): objects of that attempt may be named by its
    /// part already ([`staged`]).
    pub resumed: bool,
}

/// Object key → (size, BLAKE3).
type StagedObjects = BTreeMap<String, (u64, String)>;

/// What an earlier attempt of this rank at the same version staged under
/// the agreed writer: the objects its part names (key → size, BLAKE3). Once
/// a part is written, any rank may commit the version from it; a restarted
/// rank (same intent, hence the same writer and the same keys) must then
/// never write other bytes to those keys ([`Staged::check`], before each
/// upload), or the committed manifest would name objects that no longer
/// match it.
#[derive(Clone, Debug, Default)]
pub struct Staged {
    /// The part's key, and its objects.
    part: Option<(String, StagedObjects)>,
    rank: u32,
    version: u64,
}

impl Staged {
    /// Whether an earlier part of this rank names objects of the writer.
    pub fn active(&self) -> bool {
        self.part.is_some()
    }

    /// Refuses to write `key` with this size and BLAKE3 if the earlier part
    /// names it with others (the checkpoint changed since that attempt).
    pub fn check(&self, key: &str, size: u64, blake3: &str) -> Result<()> {
        let Some((part_key, objects)) = &self.part else {
            return Ok(());
        };
        match objects.get(key) {
            Some((s, b)) if (*s, b.as_str()) != (size, blake3) => Err(Error::Conflict(format!(
                "rank {}: an earlier attempt of this rank at version {} wrote its part \
                 `{part_key}`, which names `{key}` ({s} bytes, BLAKE3 {b}); this attempt's \
                 `{key}` differs ({size} bytes, BLAKE3 {blake3}): the checkpoint changed since. \
                 The other ranks may commit the version from that part, so its objects are not \
                 rewritten and this content is refused. Restart the rank with the checkpoint it \
                 first published for this step, or move every rank to the next step",
                self.rank, self.version
            ))),
            _ => Ok(()),
        }
    }
}

/// This rank's part of `version` under `writer`, if an earlier attempt
/// wrote it (see [`Staged`]).
pub async fn staged(store: &Store, d: &Distributed, version: u64, writer: &str) -> Result<Staged> {
    let key = part_key(version, d.rank, d.world);
    let part = match read_record::<Part>(store, &key).await? {
        Some(p) if p.manifest.writer == writer => Some((
            key,
            p.manifest
                .objects
                .into_iter()
                .map(|o| (o.key, (o.size, o.blake3)))
                .collect(),
        )),
        _ => None,
    };
    Ok(Staged {
        part,
        rank: d.rank,
        version,
    })
}

/// Polling: the first wait, then half as long again each time, up to the
/// longest. Each poll is one listing of `parts/<version>/` (plus one read of
/// the manifest), and each record is read once it appears.
const POLL_FIRST: Duration = Duration::from_millis(50);
const POLL_MAX: Duration = Duration::from_secs(1);

/// Backs off between polls.
struct Poll(Duration);

impl Poll {
    fn new() -> Poll {
        Poll(POLL_FIRST)
    }

    async fn wait(&mut self) {
        tokio::time::sleep(self.0).await;
        self.0 = (self.0 * 3 / 2).min(POLL_MAX);
    }
}

/// The keys under `parts/<version>/` now.
async fn listed(store: &Store, version: u64) -> Result<std::collections::HashSet<String>> {
    Ok(store
        .list(&crate::protocol::parts::parts_dir(version))
        .await?
        .into_iter()
        .map(|l| l.key)
        .collect())
}

fn timed_out(d: &Distributed, version: u64, waiting_for: &str) -> Error {
    Error::Conflict(format!(
        "rank {} of {}: gave up on version {version} after {:?} waiting for {waiting_for}; \
         nothing was committed by this rank (restart it with the same --step to complete the \
         version, or move every rank to the next step)",
        d.rank, d.world, d.timeout
    ))
}

/// Errors when version `version` was committed meanwhile — by ranks at
/// another step, or another publisher — so this attempt cannot be.
async fn taken(store: &Store, version: u64, writer: Option<&str>) -> Result<()> {
    if let Some(m) = read_manifest(store, version).await?
        && Some(m.writer.as_str()) != writer
    {
        return Err(Error::Conflict(format!(
            "version {version} was committed (step {:?}, writer {}) while this rank was \
             publishing it; every rank must publish the same --step, and only these ranks may \
             write the prefix",
            m.step, m.writer
        )));
    }
    Ok(())
}

/// Writes (or, restarted at the same step, reuses) this rank's intent for
/// `version` and waits for all W intents.
pub async fn agree(
    store: &Store,
    d: &Distributed,
    version: u64,
    step: u64,
    anchor: Option<String>,
) -> Result<Agreement> {
    let key = intent_key(version, d.rank);
    let mut resumed = false;
    let mine = match read_record::<Intent>(store, &key).await? {
        Some(old) if old.step == step && old.world == d.world && old.version == version => {
            if old.anchor.is_none()
                && let Some(why) = &anchor
            {
                return Err(Error::Conflict(format!(
                    "rank {} already announced version {version} (step {step}) as a delta, but \
                     now needs an anchor ({why}); its snapshot changed. Move every rank to the \
                     next step",
                    d.rank
                )));
            }
            tracing::info!(version, step, "resuming this rank's intent");
            resumed = true;
            old
        }
        _ => {
            let i = Intent {
                format: INTENT_FORMAT.into(),
                version,
                rank: d.rank,
                world: d.world,
                step,
                token: writer_token(),
                anchor,
                created_at: crate::protocol::registry::unix_now(),
            };
            write_record(store, &key, &i).await?;
            i
        }
    };
    let deadline = Instant::now() + d.timeout;
    let mut intents: BTreeMap<u32, Intent> = BTreeMap::from([(d.rank, mine)]);
    let mut poll = Poll::new();
    loop {
        let present = listed(store, version).await?;
        for r in 0..d.world {
            let key = intent_key(version, r);
            if intents.contains_key(&r) || !present.contains(&key) {
                continue;
            }
            let Some(i) = read_record::<Intent>(store, &key).await? else {
                continue;
            };
            if i.format != INTENT_FORMAT || i.rank != r || i.version != version {
                return Err(Error::metadata(
                    key,
                    format!("not rank {r}'s intent for version {version}"),
                ));
            }
            if i.world != d.world {
                return Err(Error::Config(format!(
                    "rank {r} publishes version {version} with --world {}, this rank (rank {}) \
                     with --world {}; every rank must pass the same --world",
                    i.world, d.rank, d.world
                )));
            }
            if i.step > step {
                return Err(Error::Conflict(format!(
                    "mismatched steps: rank {r} publishes step {} as version {version}, this rank \
                     (rank {}) step {step}; every rank must publish the same --step",
                    i.step, d.rank
                )));
            }
            if i.step == step {
                intents.insert(r, i);
            }
            // An older step: a stale intent of an abandoned attempt, which
            // that rank overwrites when it gets here.
        }
        if intents.len() == d.world as usize {
            break;
        }
        taken(store, version, None).await?;
        if Instant::now() >= deadline {
            let missing: Vec<u32> = (0..d.world).filter(|r| !intents.contains_key(r)).collect();
            return Err(timed_out(
                d,
                version,
                &format!("the intents of ranks {missing:?} at step {step}"),
            ));
        }
        poll.wait().await;
    }
    let tokens: Vec<String> = intents.values().map(|i| i.token.clone()).collect();
    let anchor = intents.values().find_map(|i| {
        i.anchor
            .as_ref()
            .map(|why| format!("rank {}: {why}", i.rank))
    });
    Ok(Agreement {
        writer: shared_writer(&tokens),
        anchor,
        resumed,
    })
}

/// Writes this rank's part (`share`: its objects and files under the agreed
/// writer; `tensors`: file → tensor names) and waits until the version is
/// committed, committing it itself when it sees all W parts first.
pub async fn commit(
    store: &Store,
    d: &Distributed,
    share: &Manifest,
    tensors: BTreeMap<String, Vec<String>>,
) -> Result<()> {
    let version = share.version;
    let part = Part {
        format: PART_FORMAT.into(),
        rank: d.rank,
        world: d.world,
        manifest: share.clone(),
        tensors,
        created_at: crate::protocol::registry::unix_now(),
    };
    write_record(store, &part_key(version, d.rank, d.world), &part).await?;
    crate::failpoint::hit("publisher.after_part");
    let deadline = Instant::now() + d.timeout;
    let mut parts: BTreeMap<u32, Part> = BTreeMap::from([(d.rank, part)]);
    let mut poll = Poll::new();
    loop {
        if let Some(m) = read_manifest(store, version).await? {
            if m.writer == share.writer {
                return holds_share(&m, share, d);
            }
            taken(store, version, Some(&share.writer)).await?;
        }
        let present = listed(store, version).await?;
        for r in 0..d.world {
            let key = part_key(version, r, d.world);
            if parts.contains_key(&r) || !present.contains(&key) {
                continue;
            }
            match read_record::<Part>(store, &key).await? {
                // A part of an earlier attempt (another writer) does not count.
                Some(p) if p.manifest.writer == share.writer => {
                    if p.format != PART_FORMAT || p.rank != r || p.world != d.world {
                        return Err(Error::metadata(key, format!("not rank {r}'s part")));
                    }
                    parts.insert(r, p);
                }
                _ => {}
            }
        }
        if parts.len() == d.world as usize {
            let all: Vec<Part> = parts.values().cloned().collect();
            let merged = merge(&all);
            // A delta must hold exactly its base's safetensors files (the
            // ranks' own checks cannot see a rank that left).
            let base = match &merged {
                Ok(m) if m.kind == crate::protocol::VersionKind::Delta => {
                    read_manifest(store, version.saturating_sub(1)).await?
                }
                _ => None,
            };
            let manifest =
                match merged.and_then(|m| check_delta_files(&m, base.as_ref()).map(|()| m)) {
                    Ok(m) => m,
                    Err(e) => {
                        // This attempt can never commit: withdraw the intent, so
                        // that a rerun at the same step starts a new attempt (a
                        // new writer, in which these parts do not count). The
                        // parts stay, so that every rank sees the same error.
                        if let Err(d_err) = store.delete(&intent_key(version, d.rank)).await {
                            tracing::warn!(error = %d_err, "cannot withdraw this rank's intent");
                        }
                        return Err(e);
                    }
                };
            match crate::protocol::commit(store, &manifest).await? {
                Commit::Committed => {
                    holds_share(&manifest, share, d)?;
                    crate::failpoint::hit("publisher.after_commit");
                    write_latest(
                        store,
                        &Latest {
                            version,
                            anchor_version: manifest.anchor_version,
                        },
                    )
                    .await?;
                    return Ok(());
                }
                Commit::VersionTaken => taken(store, version, Some(&share.writer)).await?,
            }
        }
        if Instant::now() >= deadline {
            let missing: Vec<u32> = (0..d.world).filter(|r| !parts.contains_key(r)).collect();
            return Err(timed_out(
                d,
                version,
                &format!("the parts of ranks {missing:?}"),
            ));
        }
        poll.wait().await;
    }
}

/// Checks that the committed manifest holds exactly this rank's share. It
/// may not when an earlier attempt at the same step (same intents, so the
/// same writer) left this rank's part with other contents and the version
/// was committed from it: the snapshot must then not advance with this
/// attempt's deltas.
fn holds_share(m: &Manifest, share: &Manifest, d: &Distributed) -> Result<()> {
    let unbridged = m.kind == crate::protocol::VersionKind::Anchor && m.base_version.is_none();
    let objects_ok = share.objects.iter().all(|o| {
        (unbridged && o.role == crate::protocol::ObjectRole::Delta)
            || m.objects
                .iter()
                .any(|c| c.key == o.key && c.blake3 == o.blake3)
    });
    let files_ok = share.files.iter().all(|f| {
        m.files
            .iter()
            .any(|c| c.name == f.name && c.blake3 == f.blake3)
    });
    if objects_ok && files_ok {
        return Ok(());
    }
    Err(Error::Conflict(format!(
        "version {} was committed from an earlier attempt of rank {} at the same step, with \
         other contents than this attempt's; the version stands, and this rank's next version \
         is an anchor",
        m.version, d.rank
    )))
}

/// After the version is committed, rank 0 removes the records of this and
/// earlier versions (none of them can commit any more); failures only log.
pub async fn clean_up(store: &Store, d: &Distributed, version: u64) {
    if d.rank != 0 {
        return;
    }
    let listed = match store.list(crate::protocol::parts::PARTS_PREFIX).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "cannot list parts/ to clean up");
            return;
        }
    };
    for l in listed {
        if crate::protocol::parts::version_of_parts_key(&l.key).is_some_and(|v| v <= version)
            && let Err(e) = store.delete(&l.key).await
        {
            tracing::warn!(key = l.key, error = %e, "cannot remove a part record");
        }
    }
}
