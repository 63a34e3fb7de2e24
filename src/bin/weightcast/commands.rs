//! One small function per command, over the library's API. Every command runs
//! on the one runtime `main` starts; CPU-bound commands simply run on it.

use std::io::Write;
use std::path::{Path, PathBuf};

/// The allocator, counted, so `bench` can report peak heap use.
#[global_allocator]
static ALLOC: peak_alloc::PeakAlloc = peak_alloc::PeakAlloc;

use anyhow::{Context, Result, bail};
use weightcast::bench::{BenchConfig, MemProbe};
use weightcast::codec::{self, DeltaOptions};
use weightcast::demo::{self, DemoConfig};
use weightcast::format::TrlOptions;
use weightcast::generator::GeneratorConfig;
use weightcast::tensors::{Digests, TensorSet};

use crate::cli::{BenchWhat, Command};

/// Runs a command.
pub async fn run(command: Command) -> Result<()> {
    match command {
        Command::Demo {
            dir,
            steps,
            anchor_every,
            encoding,
            json,
        } => {
            demo_command(
                dir,
                DemoConfig {
                    dir: PathBuf::new(),
                    steps,
                    anchor_every,
                    encoding,
                    model: GeneratorConfig::small(7),
                },
                json,
            )
            .await
        }
        Command::Bench { what } => bench(what),
        Command::Diff {
            base,
            new,
            out,
            encoding,
            trl_generation,
            trl_index,
            model_version,
            base_version,
        } => {
            let opts = DeltaOptions {
                encoding,
                model_version,
                base_version,
                trl: TrlOptions {
                    generation: trl_generation,
                    index: trl_index,
                },
                // One diff, asked for in this encoding: written in it.
                compact2_max_density: 1.0,
            };
            diff(&base, &new, &out, &opts)
        }
        Command::Apply { base, delta, out } => apply(&base, &delta, &out),
        Command::Publish {
            checkpoint,
            step,
            quiet,
            ranks,
            opts,
        } => {
            // A missing checkpoint fails before the store is contacted.
            let meta = std::fs::metadata(&checkpoint);
            if let Err(e) = meta {
                return Err(weightcast::Error::io(
                    format!("checkpoint {}", checkpoint.display()),
                    e,
                )
                .into());
            }
            let mut p = opts.open(!quiet, &ranks).await?;
            let opts = weightcast::publisher::PublishOptions { step };
            let cp = weightcast::publisher::Checkpoint::open(&checkpoint, p.checkpoint_options())?;
            // The process exits next: its notifications are waited for.
            emit_json(&p.publish_and_notify(cp, &opts).await?)
        }
        Command::Subscribe {
            store,
            out,
            once,
            poll_interval,
            poll_jitter,
            slots,
            listen,
            notify_key,
            id,
            advertise,
            hooks,
            hook_timeout,
            hook_budget,
            sglang_pause_mode,
            vllm_pause_mode,
            vllm_api_key,
            sglang_api_key,
            max_object_size,
            quiet,
        } => {
            // The parser checked the values (positive seconds, a fraction).
            let seconds = std::time::Duration::from_secs_f64;
            // Hooks, webhooks, the environment and the status name DIR by
            // its absolute path: an engine may run elsewhere.
            let out = std::path::absolute(&out)
                .map_err(|e| weightcast::Error::io(format!("resolving {}", out.display()), e))?;
            let mut cfg = weightcast::subscriber::DaemonConfig::new(&out);
            cfg.slots = slots;
            cfg.poll_interval = std::time::Duration::from_secs_f64(poll_interval);
            cfg.poll_jitter = poll_jitter;
            cfg.id = id;
            cfg.hooks = hooks;
            cfg.hook_policy = weightcast::hooks::HookPolicy {
                timeout: seconds(hook_timeout),
                budget: seconds(hook_budget),
                sglang_pause: sglang_pause_mode,
                vllm_pause: vllm_pause_mode,
                vllm_api_key: vllm_api_key.and_then(weightcast::hooks::ApiKey::new),
                sglang_api_key: sglang_api_key.and_then(weightcast::hooks::ApiKey::new),
                ..Default::default()
            };
            cfg.notify_url = advertise;
            let mut store =
                weightcast::store::Store::open(&store)?.with_max_object_size(max_object_size);
            store.check_contact().await?;
            if !quiet {
                store = store.with_download_progress(std::sync::Arc::new(crate::cli::Bars::new(
                    "downloading",
                )));
            }
            if once {
                subscribe_once(&store, &cfg).await
            } else {
                subscribe_daemon(&store, cfg, listen, notify_key.as_deref()).await
            }
        }
        Command::Publisher {
            listen,
            token,
            checkpoint_root,
            shutdown_grace,
            ranks,
            opts,
        } => {
            let grace = std::time::Duration::from_secs_f64(shutdown_grace);
            // First, so a signal during start-up is honoured once it is up
            // instead of killing the process half-way through opening.
            let stop = shutdown()?;
            let publisher = opts.open(false, &ranks).await?;
            let filters = publisher.checkpoint_options().clone();
            let shared = weightcast::http::publisher::PublisherShared::new(
                publisher,
                &token,
                &checkpoint_root,
                filters,
            )?;
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .map_err(|e| weightcast::Error::io(format!("binding {listen}"), e))?;
            tracing::info!(addr = %listener.local_addr()?, "serving POST /v1/publish");
            weightcast::http::publisher::serve_with_grace(listener, shared.clone(), stop, grace)
                .await?;
            // Notifications of the last versions may still be on their way.
            let mut p = shared.publisher.lock().await;
            let pending = p.notifications_in_flight();
            if pending > 0 {
                let wait = grace.max(std::time::Duration::from_secs(1));
                match tokio::time::timeout(wait, p.notifications_settled()).await {
                    Ok(acknowledged) => tracing::info!(acknowledged, "notifications sent"),
                    Err(_) => tracing::warn!(
                        abandoned = p.notifications_in_flight(),
                        "shutdown: abandoning notifications still being sent; those \
                         subscribers find the version at their next poll"
                    ),
                }
            }
            tracing::info!("stopped");
            Ok(())
        }
        Command::Relay {
            from,
            to,
            from_option,
            to_option,
            once,
            interval,
            notify,
            notify_key,
            listen,
            keep_anchors,
            registration_max_age,
            max_object_size,
        } => {
            let key = notify_key
                .as_deref()
                .map(weightcast::notify::Key::new)
                .transpose()?;
            let cfg = weightcast::relay::RelayConfig {
                notify_urls: notify,
                notify_key: key.clone(),
                retention: keep_anchors
                    .map(|k| crate::cli::retention(k, registration_max_age))
                    .transpose()?,
                interval: std::time::Duration::from_secs_f64(interval),
                ..Default::default()
            };
            let open = |url: &str, options: &[(String, String)]| {
                let o: Vec<(&str, &str)> = options
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                weightcast::store::Store::open_with(url, &o)
            };
            let from = open(&from, &from_option)?.with_max_object_size(max_object_size);
            let to = open(&to, &to_option)?;
            from.check_contact().await?;
            to.check_contact().await?;
            relay(
                weightcast::relay::Relay::new(from, to, cfg),
                once,
                listen,
                key,
            )
            .await
        }
        Command::Status { store } => {
            let store = weightcast::store::Store::open(&store)?;
            store.check_contact().await?;
            emit_json(&weightcast::protocol::fleet(&store).await?)
        }
        Command::Gc {
            store,
            retention,
            dry_run,
        } => {
            let retention = retention.retention()?;
            let store = weightcast::store::Store::open(&store)?;
            store.check_contact().await?;
            let collected =
                weightcast::protocol::collect_garbage(&store, &retention, dry_run).await?;
            emit_json(&collected)
        }
        Command::Inspect { path, full } => inspect(&path, full),
        Command::Verify { state, out } => verify(state.as_deref(), out.as_deref()),
    }
}

/// `relay`: one sync (`--once`, its report on stdout, then the
/// notifications it started are awaited) or the daemon until a signal.
async fn relay(
    mut relay: weightcast::relay::Relay,
    once: bool,
    listen: Option<std::net::SocketAddr>,
    key: Option<weightcast::notify::Key>,
) -> Result<()> {
    if once {
        let report = relay.sync_once().await?;
        emit_json(&report)?;
        relay.notifications_settled().await;
        return Ok(());
    }
    let stop = shutdown()?;
    let shared = weightcast::subscriber::status::Shared::new(relay.from().url(), key);
    if let Some(addr) = listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| weightcast::Error::io(format!("binding {addr}"), e))?;
        tracing::info!(addr = %listener.local_addr()?, "serving /v1/notify");
        tokio::spawn(weightcast::http::subscriber::serve(
            listener,
            shared.clone(),
            std::future::pending(),
        ));
    }
    let on_sync = |r: &weightcast::Result<weightcast::relay::RelayReport>| match r {
        Ok(rep) => {
            if let Ok(mut s) = shared.status.lock() {
                s.version = rep.destination;
            }
            // What changed the destination: versions relayed, or repaired.
            let changed = !rep.versions.is_empty()
                || !rep.repaired_versions.is_empty()
                || !rep.repaired_objects.is_empty();
            if changed && let Err(e) = emit_json(rep) {
                tracing::warn!(error = %e, "cannot print the relay's report");
            }
        }
        Err(e) => {
            tracing::error!(error = %e, "relay sync failed; retrying at the next poll");
            if let Ok(mut s) = shared.status.lock() {
                s.failures += 1;
                s.last_error = Some(e.to_string());
            }
        }
    };
    relay.run(&shared.wake, on_sync, stop).await;
    Ok(())
}

/// Whether JSON output is indented (`--pretty`); one line per report
/// otherwise.
pub static PRETTY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Prints a report as JSON on stdout: one line, or indented with `--pretty`.
pub fn emit_json(value: &impl serde::Serialize) -> Result<()> {
    let text = if PRETTY.load(std::sync::atomic::Ordering::Relaxed) {
        serde_json::to_string_pretty(value)?
    } else {
        serde_json::to_string(value)?
    };
    emit(text);
    Ok(())
}

/// Prints one line on stdout. A closed stdout (the reader went away, EPIPE)
/// is not an error: the work the line reports is done (a commit stands), and
/// a panic or a failure exit would misreport it.
pub fn emit(line: impl std::fmt::Display) {
    let mut stdout = std::io::stdout().lock();
    match writeln!(stdout, "{line}").and_then(|()| stdout.flush()) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        Err(e) => tracing::warn!(error = %e, "cannot write to stdout"),
    }
}

/// Installs the SIGINT (Ctrl-C) and SIGTERM (what compose and Kubernetes
/// send) handlers now, and returns a future that resolves on either. Installing
/// them before the daemon binds its port matters: a signal that arrives between
/// the bind and the future's first poll would otherwise take the default
/// action and kill the process uncleanly.
fn shutdown() -> Result<impl std::future::Future<Output = ()> + Send + 'static> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

async fn demo_command(dir: Option<PathBuf>, mut cfg: DemoConfig, json: bool) -> Result<()> {
    let tmp;
    cfg.dir = match dir {
        Some(d) => d,
        None => {
            tmp = tempfile::tempdir().context("creating a temporary bucket directory")?;
            tmp.path().to_path_buf()
        }
    };
    // With --json, stdout carries the JSON report alone.
    let report = demo::run(&cfg, |line| {
        if json {
            eprintln!("{line}");
        } else {
            emit(line)
        }
    })
    .await?;
    let deltas: Vec<_> = report.steps.iter().filter(|s| s.kind == "delta").collect();
    let delta_bytes: u64 = deltas.iter().map(|s| s.bytes).sum();
    let changed: u64 = deltas.iter().map(|s| s.changed).sum();
    let summary = format!(
        "deltas: {:.3} bytes per changed element, {:.0}x smaller than full weights on average",
        delta_bytes as f64 / changed.max(1) as f64,
        (report.full_bytes * deltas.len() as u64) as f64 / delta_bytes.max(1) as f64
    );
    let verdict = if report.bit_identical {
        "verdict: OK, every replica is bit-identical to the trainer at every version"
    } else {
        "verdict: FAILED, a replica diverged from the trainer"
    };
    if json {
        eprintln!("{summary}\n{verdict}");
        emit_json(&report)?;
    } else {
        emit(summary);
        emit(verdict);
    }
    if !report.bit_identical {
        bail!("a replica diverged from the trainer");
    }
    Ok(())
}

/// Peak heap use, from the counting allocator.
struct AllocProbe;

impl MemProbe for AllocProbe {
    fn current(&self) -> u64 {
        ALLOC.current_usage() as u64
    }
    fn peak(&self) -> u64 {
        ALLOC.peak_usage() as u64
    }
    fn reset_peak(&self) {
        ALLOC.reset_peak_usage();
    }
}

/// Sizes rayon's global pool (`--threads`; default: all cores).
fn set_threads(threads: Option<usize>) -> Result<()> {
    if let Some(t) = threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
            .context("configuring worker threads")?;
    }
    Ok(())
}

fn write_json(path: Option<PathBuf>, value: &impl serde::Serialize) -> Result<()> {
    if let Some(p) = path {
        std::fs::write(&p, serde_json::to_vec_pretty(value)?)
            .map_err(|e| weightcast::Error::io(format!("writing {}", p.display()), e))?;
    }
    Ok(())
}

fn bench(what: BenchWhat) -> Result<()> {
    match what {
        BenchWhat::Codec {
            elements,
            steps,
            lr,
            encodings,
            threads,
            json,
            seed,
            reps,
        } => {
            set_threads(threads)?;
            let cfg = BenchConfig {
                elements,
                steps,
                lr,
                encodings,
                seed,
                reps,
            };
            let report = weightcast::bench::run(&cfg, &AllocProbe, |l| emit(l))?;
            write_json(json, &report)
        }
        BenchWhat::Anchors {
            input,
            elements,
            chunk_words,
            levels,
            threads,
            reps,
            json,
        } => {
            set_threads(threads)?;
            let set = match &input {
                Some(p) => TensorSet::read(p, Digests::Compute)?,
                None => weightcast::generator::Generator::new(GeneratorConfig::with_elements(
                    42, elements,
                ))
                .snapshot(),
            };
            emit(format!(
                "{}: {} tensors, {} bytes, {} threads",
                input
                    .as_ref()
                    .map_or("generator".to_string(), |p| p.display().to_string()),
                set.len(),
                set.total_bytes(),
                rayon::current_num_threads()
            ));
            let cfg = weightcast::bench::AnchorBenchConfig {
                chunk_words,
                levels,
                reps,
            };
            let rows = weightcast::bench::run_anchors(&set, &cfg, |l| emit(l))?;
            write_json(json, &rows)
        }
    }
}

fn diff(base: &Path, new: &Path, out: &Path, opts: &DeltaOptions) -> Result<()> {
    let base_set = TensorSet::read(base, Digests::Compute)?;
    let mut new_set = TensorSet::read(new, Digests::Skip)?;
    let (bytes, summary) = codec::encode_delta(&base_set, &mut new_set, opts)?;
    std::fs::write(out, bytes)
        .map_err(|e| weightcast::Error::io(format!("writing {}", out.display()), e))?;
    emit_json(&summary)
}

fn apply(base: &Path, delta: &Path, out: &Path) -> Result<()> {
    let mut set = TensorSet::read(base, Digests::Compute)?;
    let bytes = std::fs::read(delta)
        .map_err(|e| weightcast::Error::io(format!("reading {}", delta.display()), e))?;
    let report = codec::apply_delta(&mut set, &bytes)?;
    let version = report.model_version.unwrap_or(0);
    let io = |e| weightcast::Error::io(format!("writing {}", out.display()), e);
    let mut f = std::io::BufWriter::new(std::fs::File::create(out).map_err(io)?);
    codec::write_anchor(&set, version, &mut f)?;
    f.flush().map_err(io)?;
    emit_json(&report)
}

/// One iteration of the daemon: verify (and repair) the output, catch up,
/// run the hooks, register.
async fn subscribe_once(
    store: &weightcast::store::Store,
    cfg: &weightcast::subscriber::DaemonConfig,
) -> Result<()> {
    match weightcast::subscriber::once(store, cfg).await? {
        Some((c, report)) => {
            if report.failed > 0 {
                // The engine (a peer) did not confirm: EX_UNAVAILABLE.
                return Err(weightcast::Error::Unavailable(format!(
                    "{} hook(s) failed after switching to version {}: {}",
                    report.failed,
                    c.version,
                    report.error().unwrap_or_default()
                ))
                .into());
            }
            emit_json(&c)
        }
        None => Err(weightcast::Error::NotFound(format!(
            "the bucket `{}` has no committed version yet (publish one first)",
            store.url()
        ))
        .into()),
    }
}

async fn subscribe_daemon(
    store: &weightcast::store::Store,
    mut cfg: weightcast::subscriber::DaemonConfig,
    listen: Option<std::net::SocketAddr>,
    notify_key: Option<&str>,
) -> Result<()> {
    // The daemon takes over SIGTERM/SIGINT first thing (see `shutdown`).
    let (stop, stop_server) = (shutdown()?, shutdown()?);
    let key = notify_key.map(weightcast::notify::Key::new).transpose()?;
    let shared = weightcast::subscriber::status::Shared::new(store.url(), key);
    if let Some(addr) = listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| weightcast::Error::io(format!("binding {addr}"), e))?;
        let bound = listener.local_addr()?;
        if cfg.id.is_some() && cfg.notify_url.is_none() {
            cfg.notify_url = Some(weightcast::notify::default_notify_url(bound)?);
        }
        tracing::info!(%bound, "serving /v1/notify, /v1/status, /healthz, /metrics");
        let s = shared.clone();
        tokio::spawn(async move {
            if let Err(e) = weightcast::http::subscriber::serve(listener, s, stop_server).await {
                tracing::error!(error = %e, "HTTP server stopped");
            }
        });
    }
    // Stopping mid-catch-up is safe: the output switches versions atomically
    // and a restart continues from the verified state.
    weightcast::subscriber::run(store, &cfg, &shared, stop).await?;
    tracing::info!("stopping");
    Ok(())
}

/// `verify`: the publisher's state and/or the subscriber's output, in full.
fn verify(state: Option<&Path>, out: Option<&Path>) -> Result<()> {
    let mut report = serde_json::Map::new();
    let mut ok = true;
    if let Some(dir) = state {
        let v = weightcast::publisher::state::Snapshot::verify(dir)?;
        ok &= v.ok;
        report.insert("state".into(), serde_json::to_value(&v)?);
    }
    if let Some(dir) = out {
        let slots = weightcast::subscriber::DirSink::verify(dir)?;
        ok &= slots.iter().all(|s| s.ok);
        report.insert("out".into(), serde_json::to_value(&slots)?);
    }
    report.insert("ok".into(), ok.into());
    emit(serde_json::to_string(&report)?);
    if !ok {
        bail!("local state does not verify (see the report); it is no longer trusted");
    }
    Ok(())
}

/// The header of an anchor or delta object: a summary, or every key (`full`).
fn inspect(path: &Path, full: bool) -> Result<()> {
    let bytes = std::fs::read(path)
        .map_err(|e| weightcast::Error::io(format!("reading {}", path.display()), e))?;
    let (meta, header) = codec::inspect(&bytes)?;
    if !full {
        let mut out = serde_json::Map::new();
        out.insert("bytes".into(), bytes.len().into());
        match &header {
            Some(h) => {
                let summary = serde_json::json!({
                    "kind": h.kind,
                    "encoding": h.encoding.to_string(),
                    "model_version": h.model_version,
                    "base_version": h.base_version,
                    "tensors": h.tensor_count,
                    "tensors_changed": h.tensors.len(),
                    "total_elements": h.total_elements,
                    "changed_elements": h.changed_elements,
                    "density": h.density,
                    "digest": h.digest.to_string(),
                    "base_digest": h.base_digest.map(|d| d.to_string()),
                });
                if let serde_json::Value::Object(m) = summary {
                    out.extend(m);
                }
            }
            None => {
                out.insert(
                    "note".into(),
                    "no weightcast header: a plain safetensors file".into(),
                );
            }
        }
        let other: serde_json::Map<String, serde_json::Value> = meta
            .iter()
            .filter(|(k, _)| !k.starts_with("weightcast."))
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect();
        if !other.is_empty() {
            out.insert("metadata".into(), other.into());
        }
        return emit_json(&out);
    }
    let tensors = header
        .as_ref()
        .map(|_| serde_json::from_str::<serde_json::Value>(&meta["weightcast.tensors"]))
        .transpose()?;
    let mut meta: serde_json::Map<String, serde_json::Value> = meta
        .into_iter()
        .map(|(k, v)| (k, serde_json::Value::String(v)))
        .collect();
    if let Some(t) = tensors {
        meta.insert("weightcast.tensors".into(), t);
    }
    if let Some(serde_json::Value::String(p)) = meta.get("weightcast.planes") {
        let table: serde_json::Value = serde_json::from_str(p)?;
        meta.insert("weightcast.planes".into(), table);
    }
    emit_json(&meta)
}
