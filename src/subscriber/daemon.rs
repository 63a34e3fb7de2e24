//! The daemon: source → plan → fetch → sink → hooks → status and
//! registration, in a loop that returns on shutdown. `subscribe --once` is
//! one iteration of the same code ([`once`]).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::Result;
use crate::hooks::{self, Hook};
use crate::store::Store;

use super::dir::{DEFAULT_SLOTS, DirSink};
use super::fetch::Fetcher;
use super::register::Registrar;
use super::sink::{Produced, Sink};
use super::source::VersionSource;
use super::status::Shared;
use super::step::{CaughtUp, Subscriber};
use super::update::Log;

/// Daemon settings.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// Output directory.
    pub out: PathBuf,
    /// Output slots (2 or more; see [`super::dir`]).
    pub slots: usize,
    /// Interval between polls when no notification arrives.
    pub poll_interval: Duration,
    /// ± jitter of the poll interval, as a fraction of it.
    pub poll_jitter: f64,
    /// Registration id (registers in the bucket when set).
    pub id: Option<String>,
    /// The URL publishers should POST notifications to.
    pub notify_url: Option<String>,
    /// What runs after each new version (engine reloads, webhooks, commands).
    pub hooks: Vec<Hook>,
    /// Timeouts, retry budget and SGLang pause mode of the hooks.
    pub hook_policy: hooks::HookPolicy,
}

impl DaemonConfig {
    /// Defaults for output directory `out`: two slots, a poll every 5 s ± 10%,
    /// no registration, no hooks.
    pub fn new(out: &Path) -> DaemonConfig {
        DaemonConfig {
            out: out.to_path_buf(),
            slots: DEFAULT_SLOTS,
            poll_interval: Duration::from_secs(5),
            poll_jitter: 0.1,
            id: None,
            notify_url: None,
            hooks: Vec::new(),
            hook_policy: hooks::HookPolicy::default(),
        }
    }
}

/// A subscriber of an output directory with its daemon duties.
#[derive(Debug)]
pub struct Daemon {
    /// The composed subscriber.
    pub sub: Subscriber<DirSink>,
    cfg: DaemonConfig,
    registrar: Registrar,
    /// `current` moved when the output was opened (a switch a crash had
    /// interrupted): the hooks are owed a run.
    switch_owed: bool,
    /// After each switch and its hooks, bring the slot the next update will
    /// write forward at once ([`Sink::prepare`]), so that the next version
    /// costs one apply. The daemon does; a one-shot run does not.
    pub prepare: bool,
    /// Whether no iteration has prepared yet (a daemon started on an
    /// up-to-date output prepares once).
    first_prepare: bool,
    /// Hooks that failed for the version `current` holds: the engine has not
    /// confirmed it, so the previous version's files must stay as they are;
    /// they run again before anything else.
    hooks_owed: Option<hooks::Event>,
}

impl Daemon {
    /// Opens the output directory (verifying the current slot in full).
    /// A relative output directory is taken from the working directory and
    /// named by its absolute path from then on (hooks, their environment,
    /// webhooks and the status name it to processes elsewhere); an invalid
    /// registration id is refused here, before anything runs unregistered.
    pub fn open(store: &Store, cfg: &DaemonConfig) -> Result<Daemon> {
        if let Some(id) = cfg.id.as_deref()
            && !crate::protocol::valid_id(id)
        {
            return Err(crate::Error::Config(format!(
                "subscriber id `{id}` is not usable: use 1 to 128 of A-Z a-z 0-9 . _ - (not \
                 starting with a dot), e.g. the pod or host name"
            )));
        }
        let mut cfg = cfg.clone();
        cfg.out = std::path::absolute(&cfg.out)
            .map_err(|e| crate::Error::io(format!("resolving {}", cfg.out.display()), e))?;
        let cfg = &cfg;
        std::fs::create_dir_all(&cfg.out)
            .map_err(|e| crate::Error::io(format!("creating {}", cfg.out.display()), e))?;
        let sink = DirSink::open(&cfg.out, cfg.slots)?;
        let damaged = sink.found_damaged();
        let switch_owed = sink.finished_switch();
        let source = VersionSource::new(cfg.poll_interval, cfg.poll_jitter);
        let mut sub = Subscriber::new(Fetcher::new(store.clone()), source, sink);
        if damaged {
            sub.note_repair();
        }
        Ok(Daemon {
            sub,
            cfg: cfg.clone(),
            registrar: Registrar::new(cfg.id.clone(), cfg.notify_url.clone()),
            switch_owed,
            prepare: false,
            first_prepare: true,
            hooks_owed: None,
        })
    }

    /// One iteration: catch up, record it in `shared`, run the hooks after a
    /// switch, refresh the registration when due. Returns what the catch-up
    /// did and what the hooks did (`None` when the bucket has no version).
    pub async fn iterate(
        &mut self,
        shared: &Shared,
        thorough: bool,
    ) -> Result<Option<(CaughtUp, hooks::Report)>> {
        let started = Instant::now();
        let written = crate::fsio::written_bytes();
        // An engine that has not confirmed the current version may still read
        // the previous one's files: nothing changes until its hooks succeed.
        if let Some(event) = self.hooks_owed.clone() {
            let report = hooks::run(&self.cfg.hooks, &event, &self.cfg.hook_policy).await;
            self.record_hooks(shared, &report, event.version);
            if report.failed > 0 {
                return Err(crate::Error::Conflict(format!(
                    "the engine has not confirmed version {} ({}); the previous version is \
                     kept and the hooks run again",
                    event.version,
                    report.error().unwrap_or_default()
                )));
            }
            self.hooks_owed = None;
            tracing::info!(version = event.version, "the engine confirmed the version");
        }
        let caught = match self.sub.catch_up(thorough).await {
            // A bucket without weightcast versions may be in TRL's layout,
            // recognized by its keys (a bucket with weightcast versions
            // never pays for this check).
            Ok(None)
                if self.sub.log() == Log::Weightcast
                    && crate::protocol::trl::is_trl_bucket(self.sub.fetcher.store()).await? =>
            {
                tracing::info!(
                    "the bucket is in TRL's layout; following it as a single-file checkpoint"
                );
                self.sub.follow(Log::Trl);
                self.sub.catch_up(thorough).await
            }
            other => other,
        };
        let requests = self.sub.fetcher.requests();
        if let Ok(mut s) = shared.status.lock() {
            s.store_requests = requests;
        }
        let Some(mut c) = caught? else {
            // Registered while the bucket is still empty, so the publisher's
            // first version is pushed here instead of waiting for a poll.
            self.register(
                None,
                self.sub.quarantined().iter().map(|q| q.version).collect(),
            )
            .await;
            return Ok(None);
        };
        let switched =
            c.previous != Some(c.version) || c.from_anchor || std::mem::take(&mut self.switch_owed);
        if let Ok(mut s) = shared.status.lock() {
            let changed = s.version != Some(c.version);
            s.version = Some(c.version);
            let seen = c
                .quarantined
                .first()
                .map_or(c.version, |q| q.version.max(c.version));
            s.newest = Some(s.newest.map_or(seen, |v| v.max(seen)));
            s.quarantined = c.quarantined.clone();
            s.lag = s.newest.map(|n| n.saturating_sub(c.version));
            s.last_error = None;
            s.bytes_downloaded += c.downloaded;
            s.bytes_written += c.written_bytes;
            s.bytes_journal += c.journal_bytes;
            s.repairs += c.repairs;
            s.dir = Some(self.sub.sink.current_dir());
            if changed || switched {
                s.versions_applied += c.deltas_applied.max(1);
                s.last_apply_seconds = started.elapsed().as_secs_f64();
            }
        }
        let mut report = hooks::Report::default();
        if switched {
            tracing::info!(
                version = c.version,
                downloaded = c.downloaded,
                from_anchor = c.from_anchor,
                written_bytes = c.written_bytes,
                journal_bytes = c.journal_bytes,
                cloned_bytes = c.cloned_bytes,
                slot = c.slot.as_deref().unwrap_or(""),
                "caught up"
            );
            let dir = self.sub.sink.current_dir();
            let event = hooks::Event {
                version: c.version,
                dir,
                changed_tensors: c.changed_tensors.clone(),
            };
            report = hooks::run(&self.cfg.hooks, &event, &self.cfg.hook_policy).await;
            self.record_hooks(shared, &report, c.version);
            c.pause_s = report.pause_seconds;
            if report.failed > 0 {
                self.hooks_owed = Some(event);
            }
            tracing::info!(
                version = c.version,
                fetch_s = c.fetch_s,
                prepare_s = c.prepare_s,
                pause_s = c.pause_s,
                apply_s = c.apply_s,
                bytes_downloaded = c.bytes_downloaded,
                bytes_written = c.bytes_written,
                "version accounted"
            );
            if let Ok(mut s) = shared.status.lock() {
                s.account(super::status::VersionAccount::of(&c));
            }
        }
        let quarantined: Vec<u64> = c.quarantined.iter().map(|q| q.version).collect();
        self.register(Some(c.version), quarantined).await;
        if let Ok(mut s) = shared.status.lock() {
            s.store_requests = self.sub.fetcher.requests();
        }
        if self.prepare && self.hooks_owed.is_none() && (switched || self.first_prepare) {
            self.first_prepare = false;
            // The hooks ran: the files of the slot the next update writes
            // may change now.
            let started = Instant::now();
            let p = self.sub.sink.prepare()?;
            tracing::debug!(
                journal_bytes = p.journal_bytes,
                cloned_bytes = p.cloned_bytes,
                seconds = started.elapsed().as_secs_f64(),
                "standby slot brought forward"
            );
            if let Ok(mut s) = shared.status.lock() {
                s.bytes_written += p.written_bytes;
                s.bytes_journal += p.journal_bytes;
            }
        }
        if let Some(d) = written
            .zip(crate::fsio::written_bytes())
            .map(|(a, b)| b.saturating_sub(a))
            && let Ok(mut s) = shared.status.lock()
        {
            s.local_write_bytes += d;
            if switched {
                s.last_local_write_bytes = d;
            }
        }
        Ok(Some((c, report)))
    }

    /// Records a hook run for `version`: served only when every hook
    /// succeeded (an engine that refused it still serves the previous one).
    fn record_hooks(&self, shared: &Shared, report: &hooks::Report, version: u64) {
        // No hooks configured: nothing ran, nothing to count.
        if self.cfg.hooks.is_empty() {
            return;
        }
        if let Ok(mut s) = shared.status.lock() {
            s.last_pause_seconds = report.pause_seconds;
            s.hook_failures += report.failed as u64;
            s.hook_runs += 1;
            s.last_hook_error = report.error();
            if report.failed == 0 {
                s.served_version = Some(version);
            }
        }
    }

    /// Rewrites the registration when the version changed or it is due.
    async fn register(&mut self, version: Option<u64>, quarantined: Vec<u64>) {
        self.registrar
            .refresh(&self.sub.fetcher, version, &quarantined)
            .await;
    }
}

/// Runs the subscriber until `shutdown` completes: after each catch-up it
/// waits for a notification or the (jittered) poll interval, whichever comes
/// first (bursts of notifications coalesce). Updates the shared status and,
/// with an id, the bucket registration. Stopping mid-update is safe: the
/// slot being written stays marked dirty and is rebuilt later; `current` is
/// untouched. Errors only when the output directory cannot be opened.
pub async fn run(
    store: &Store,
    cfg: &DaemonConfig,
    shared: &Shared,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let mut d = Daemon::open(store, cfg)?;
    d.prepare = true;
    tokio::pin!(shutdown);
    let mut thorough = true;
    loop {
        let done = tokio::select! {
            _ = &mut shutdown => None,
            r = d.iterate(shared, thorough) => Some(r),
        };
        match done {
            None => {
                tracing::warn!(
                    "stopping mid-iteration: the update or hook in progress is abandoned; the \
                     next start continues from the verified version"
                );
                d.sub.sink.abort();
                return Ok(());
            }
            Some(Err(e)) => {
                tracing::error!(error = %e, "catch-up failed; keeping the current version");
                if let Ok(mut s) = shared.status.lock() {
                    s.failures += 1;
                    s.last_error = Some(e.to_string());
                }
            }
            Some(Ok(_)) => {}
        }
        thorough = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            woken = d.sub.source.wait(&shared.wake) => woken,
        };
    }
}

/// One iteration of the daemon (`subscribe --once`): opens the output
/// directory (verifying the current slot, and repairing it if damaged),
/// catches up, runs the hooks after a switch, registers when configured.
/// `None` when the bucket has no version yet.
///
/// Then the daemon's idle work, where a one-shot run may do it: the slot the
/// next run writes is brought forward to the new version
/// ([`Sink::prepare`]: the journal's objects, or a copy of the current slot)
/// when hooks ran and confirmed the version (the engine reads the new slot
/// now), or when that slot holds no file at all (after a first bootstrap:
/// nothing can read it). Without hooks an engine may still read the
/// previous version's slot after this process exits, so it is left to the
/// next run; with more than two slots (`--slots`) nothing is, since the
/// others hold older versions on purpose. `standby` reports what it cost; `local_write_bytes` what the
/// whole run wrote.
pub async fn once(store: &Store, cfg: &DaemonConfig) -> Result<Option<(CaughtUp, hooks::Report)>> {
    let written = crate::fsio::written_bytes();
    let shared = Shared::new(store.url(), None);
    let mut d = Daemon::open(store, cfg)?;
    let Some((mut c, report)) = d.iterate(&shared, true).await? else {
        return Ok(None);
    };
    let confirmed = !cfg.hooks.is_empty() && report.failed == 0;
    // With more than two slots the others keep older versions for engines
    // that still read them, and the next version goes into an empty slot
    // first anyway: nothing is brought forward.
    if cfg.slots == 2 && (confirmed || d.sub.sink.standby_is_empty()) {
        let started = Instant::now();
        let p = d.sub.sink.prepare()?;
        tracing::debug!(
            journal_bytes = p.journal_bytes,
            cloned_bytes = p.cloned_bytes,
            seconds = started.elapsed().as_secs_f64(),
            "standby slot brought forward"
        );
        if p != Produced::default() {
            c.standby = Some(p);
        }
    }
    c.local_write_bytes = written
        .zip(crate::fsio::written_bytes())
        .map(|(a, b)| b.saturating_sub(a));
    Ok(Some((c, report)))
}

/// Catches the output directory `out` up to the newest committed version of
/// `store`: one iteration of the daemon with default settings (two slots, no
/// hooks), the current slot verified first. Returns `None` when the bucket
/// has no version yet.
pub async fn catch_up(store: &Store, out: &Path) -> Result<Option<CaughtUp>> {
    Ok(once(store, &DaemonConfig::new(out)).await?.map(|(c, _)| c))
}
