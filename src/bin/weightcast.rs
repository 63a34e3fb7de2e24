//! The `weightcast` command line: a thin layer over the library.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use peak_alloc::PeakAlloc;
use weightcast::bench::{BenchConfig, MemProbe};
use weightcast::codec::{self, DeltaOptions};
use weightcast::demo::{self, DemoConfig};
use weightcast::format::{Encoding, TrlGeneration, TrlIndexEncoding, TrlOptions};
use weightcast::generator::GeneratorConfig;
use weightcast::tensors::{Digests, TensorSet};

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

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

#[derive(Parser)]
#[command(
    name = "weightcast",
    version,
    about = "Ship RL policy weights through object storage as anchors plus exact sparse deltas"
)]
struct Cli {
    /// Log format on stderr: text, or json (one JSON object per event, for
    /// log pipelines). Levels from RUST_LOG (default: info for weightcast).
    #[arg(
        long,
        global = true,
        env = "WEIGHTCAST_LOG_FORMAT",
        default_value = "text"
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Publish a few synthetic training steps into a local bucket, replay them in
    /// two replicas and check bit-identity.
    Demo {
        /// Bucket directory (default: a fresh temporary directory).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Training steps.
        #[arg(long, default_value_t = 8)]
        steps: u64,
        /// An anchor every N versions.
        #[arg(long, default_value_t = 5)]
        anchor_every: u64,
        /// Delta encoding: compact or trl.
        #[arg(long, default_value = "compact")]
        encoding: Encoding,
        /// Print the report as one JSON line at the end.
        #[arg(long)]
        json: bool,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchWhat,
    },
    /// Diff two safetensors files into a delta object.
    Diff {
        /// The base checkpoint (or anchor).
        #[arg(long)]
        base: PathBuf,
        /// The new checkpoint.
        #[arg(long)]
        new: PathBuf,
        /// Where to write the delta.
        #[arg(long)]
        out: PathBuf,
        /// compact (default) or trl.
        #[arg(long, default_value = "compact")]
        encoding: Encoding,
        /// With --encoding trl: TRL's layout generation, v1 (.indices/.values,
        /// changed_params) or v3 (.idx/.val).
        #[arg(long, default_value = "v3")]
        trl_generation: TrlGeneration,
        /// With --encoding trl and v3: how indices are coded, gap_delta or raw.
        #[arg(long, default_value = "gap_delta")]
        trl_index: TrlIndexEncoding,
        /// Version the delta produces (TRL's model_version key is one more).
        #[arg(long, default_value_t = 1)]
        model_version: u64,
        /// Version it applies to.
        #[arg(long, default_value_t = 0)]
        base_version: u64,
    },
    /// Apply a delta object to a safetensors file, verifying it.
    Apply {
        /// The base checkpoint.
        #[arg(long)]
        base: PathBuf,
        /// The delta object.
        #[arg(long)]
        delta: PathBuf,
        /// Where to write the result (an anchor-format checkpoint).
        #[arg(long)]
        out: PathBuf,
    },
    /// Publish a checkpoint (a .safetensors file or a Hugging Face directory) as
    /// the next version; prints one JSON line.
    Publish {
        /// The checkpoint.
        #[arg(long)]
        checkpoint: PathBuf,
        /// The trainer's step: must be newer than the last committed
        /// version's; recorded in the manifest.
        #[arg(long)]
        step: Option<u64>,
        /// No upload progress bar (it is drawn only when stderr is a terminal).
        #[arg(long, short)]
        quiet: bool,
        #[command(flatten)]
        opts: PublishOpts,
    },
    /// Publisher daemon: `POST /v1/publish {"checkpoint": PATH}` (bearer token)
    /// publishes PATH as the next version and answers the same JSON as `publish`.
    Publisher {
        /// Address to serve on.
        #[arg(long, default_value = "127.0.0.1:8470")]
        listen: std::net::SocketAddr,
        /// Bearer token clients must present (16+ characters).
        #[arg(long, env = "WEIGHTCAST_API_TOKEN", hide_env_values = true)]
        token: String,
        /// Only checkpoints under this directory may be published.
        #[arg(long)]
        checkpoint_root: PathBuf,
        #[command(flatten)]
        opts: PublishOpts,
    },
    /// Keep DIR at the newest committed version: replay, verify, switch
    /// DIR/current atomically. With --once, catch up, print one JSON line, exit.
    Subscribe {
        /// Store URL (see `publish`).
        #[arg(long, env = "WEIGHTCAST_STORE")]
        store: String,
        /// Output directory; the checkpoint is at DIR/current.
        #[arg(long)]
        out: PathBuf,
        /// Catch up once and exit (non-zero if no verified state was reached).
        #[arg(long)]
        once: bool,
        /// Seconds between polls.
        #[arg(long, default_value_t = 5.0)]
        poll_interval: f64,
        /// Random spread of each poll interval, as a fraction of it (0.1:
        /// ±10%), so that a fleet started together does not poll in lockstep.
        #[arg(long, default_value_t = 0.1)]
        poll_jitter: f64,
        /// Output slots (2 or more): a version's files stay untouched until
        /// this many minus one newer versions were switched in.
        #[arg(long, default_value_t = 2)]
        slots: usize,
        /// Serve /v1/notify, /v1/status, /healthz and /metrics on this address.
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// Shared secret for notifications (16+ characters); without it
        /// /v1/notify refuses everything.
        #[arg(long, env = "WEIGHTCAST_NOTIFY_KEY", hide_env_values = true)]
        notify_key: Option<String>,
        /// Register in the bucket under this id (so publishers find and notify
        /// it, and `weightcast status` lists it).
        #[arg(long)]
        id: Option<String>,
        /// The notify URL to register (default: http://<listen>/v1/notify).
        #[arg(long)]
        advertise: Option<String>,
        /// After each new version (repeatable): sglang:URL, vllm:URL,
        /// webhook:URL or command:CMD.
        #[arg(long = "hook")]
        hooks: Vec<weightcast::hooks::Hook>,
    },
    /// Retention: keep the newest K anchors and every version after the oldest
    /// of them, plus the deltas registered lagging subscribers still replay;
    /// remove older versions and unreferenced objects. Prints JSON.
    Gc {
        /// Store URL (see `publish`).
        #[arg(long, env = "WEIGHTCAST_STORE")]
        store: String,
        #[command(flatten)]
        retention: RetentionOpts,
        /// Report what would be removed without removing it.
        #[arg(long)]
        dry_run: bool,
    },
    /// Fleet view: the newest committed version and every registered
    /// subscriber with its version and lag, as JSON.
    Status {
        /// Store URL (see `publish`).
        #[arg(long, env = "WEIGHTCAST_STORE")]
        store: String,
    },
    /// Print the header of an anchor or delta object as JSON.
    Inspect {
        /// The object.
        path: PathBuf,
    },
}

/// Retention flags (`gc`, and the publishers' automatic retention).
#[derive(clap::Args)]
struct RetentionOpts {
    /// Anchors to keep (with every version after the oldest of them).
    #[arg(long, default_value_t = 2)]
    keep_anchors: usize,
    /// Keep what a registered subscriber behind the kept anchors needs to
    /// replay, if its registration is at most this many seconds old (0: ignore
    /// registrations).
    #[arg(long, default_value_t = 86400)]
    registration_max_age: u64,
}

impl RetentionOpts {
    fn retention(&self) -> Result<weightcast::protocol::Retention> {
        retention(self.keep_anchors, self.registration_max_age)
    }
}

fn retention(keep_anchors: usize, max_age: u64) -> Result<weightcast::protocol::Retention> {
    if keep_anchors == 0 {
        bail!("--keep-anchors must be at least 1");
    }
    Ok(weightcast::protocol::Retention {
        keep_anchors,
        registration_max_age_s: (max_age > 0).then_some(max_age),
    })
}

/// Flags shared by `publish` and `publisher`.
#[derive(clap::Args)]
struct PublishOpts {
    /// Store URL (file://, memory://, s3://, gs://, az://, http(s)://,
    /// hf://buckets/NAMESPACE/BUCKET); credentials and endpoints from AWS_*,
    /// GOOGLE_*, AZURE_*, HF_S3_* variables.
    #[arg(long, env = "WEIGHTCAST_STORE")]
    store: String,
    /// Publisher state directory (the snapshot of the last committed version).
    #[arg(long, env = "WEIGHTCAST_STATE", default_value = "weightcast-state")]
    state: PathBuf,
    /// Delta encoding: compact or trl.
    #[arg(long, default_value = "compact")]
    encoding: Encoding,
    /// How anchors are stored: planes (byte planes + zstd, ~1.5x smaller on
    /// bf16) or raw (a loadable safetensors file).
    #[arg(long, default_value = "planes")]
    anchor_encoding: weightcast::publisher::AnchorEncoding,
    /// Bucket layout: weightcast (anchors/, deltas/, files/, commit
    /// manifests) or trl (TRL's anchors/step_NNNNNN.safetensors and
    /// deltas/step_NNNNNN.safetensors at the prefix root, TRL-encoded; one
    /// writer; tensors only).
    #[arg(long, default_value = "weightcast")]
    layout: weightcast::protocol::Layout,
    /// TRL generation of trl-encoded deltas and of the trl layout: v1
    /// (.indices/.values) or v3 (.idx/.val).
    #[arg(long, default_value = "v3")]
    trl_generation: TrlGeneration,
    /// With v3: positions as raw (I32) or gap_delta (U16/U32 gaps).
    #[arg(long, default_value = "gap_delta")]
    trl_index: TrlIndexEncoding,
    /// An anchor at least every N versions.
    #[arg(long, default_value_t = 10)]
    anchor_every: u64,
    /// Accept a store that ignores conditional writes: you guarantee that
    /// exactly one publisher writes this prefix.
    #[arg(long)]
    single_writer: bool,
    /// Subscriber notify URL (repeatable), besides those registered in the bucket.
    #[arg(long = "notify")]
    notify: Vec<String>,
    /// Shared secret for notifications (16+ characters); without it none are sent.
    #[arg(long, env = "WEIGHTCAST_NOTIFY_KEY", hide_env_values = true)]
    notify_key: Option<String>,
    /// Automatic retention after each anchor: keep this many anchors, plus what
    /// registered lagging subscribers still replay (off when absent).
    #[arg(long)]
    keep_anchors: Option<usize>,
    /// With --keep-anchors: registrations older than this many seconds pin
    /// nothing (0: ignore registrations).
    #[arg(long, default_value_t = 86400)]
    registration_max_age: u64,
    /// Publish only the checkpoint files matching this glob (repeatable;
    /// relative to the checkpoint directory, `**` allowed).
    #[arg(long = "include")]
    include: Vec<String>,
    /// Skip the checkpoint files matching this glob (repeatable). Replaces the
    /// default, which skips optimizer, scheduler and RNG state
    /// (optimizer*.pt, scheduler*.pt, rng_state*.pth, global_step*/, *.distcp).
    #[arg(long = "exclude")]
    exclude: Vec<String>,
}

/// Upload progress bars on stderr (drawn only when stderr is a terminal): one
/// for the bytes of the version, whose length grows as objects start.
#[derive(Debug)]
struct UploadBars(indicatif::ProgressBar);

impl UploadBars {
    fn new() -> UploadBars {
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(0),
            indicatif::ProgressDrawTarget::stderr(),
        );
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} uploading {msg:30!} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .expect("valid progress template"),
        );
        UploadBars(bar)
    }
}

impl weightcast::store::UploadProgress for UploadBars {
    fn started(&self, key: &str, bytes: u64) {
        self.0.inc_length(bytes);
        self.0
            .set_message(key.rsplit('/').next().unwrap_or(key).to_string());
    }
    fn advanced(&self, bytes: u64) {
        self.0.inc(bytes);
    }
}

impl Drop for UploadBars {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}

impl PublishOpts {
    /// Opens the store and the publisher these flags describe; `progress` draws
    /// upload progress bars on a terminal.
    async fn open(self, progress: bool) -> Result<weightcast::publisher::Publisher> {
        if self.anchor_every == 0 {
            bail!("--anchor-every must be at least 1");
        }
        if self.layout == weightcast::protocol::Layout::Trl && self.encoding != Encoding::Trl {
            // TRL's layout holds TRL deltas: --layout trl implies the encoding.
            tracing::debug!("--layout trl: deltas are TRL-encoded");
        }
        let mut store = weightcast::store::Store::open(&self.store)?;
        if progress {
            store = store.with_progress(std::sync::Arc::new(UploadBars::new()));
        }
        let cfg = weightcast::publisher::PublisherConfig {
            state_dir: self.state,
            encoding: self.encoding,
            anchors: weightcast::publisher::AnchorPolicy {
                every: self.anchor_every,
                ..Default::default()
            },
            single_writer: self.single_writer,
            notify_urls: self.notify,
            notify_key: self
                .notify_key
                .as_deref()
                .map(weightcast::notify::Key::new)
                .transpose()?,
            retention: self
                .keep_anchors
                .map(|k| retention(k, self.registration_max_age))
                .transpose()?,
            checkpoint: weightcast::publisher::CheckpointOptions {
                include: self.include,
                exclude: (!self.exclude.is_empty()).then_some(self.exclude),
                root: None,
            },
            anchor_encoding: self.anchor_encoding,
            layout: self.layout,
            trl: TrlOptions {
                generation: self.trl_generation,
                index: self.trl_index,
            },
        };
        Ok(weightcast::publisher::Publisher::open(store, cfg).await?)
    }
}

#[derive(Subcommand)]
enum BenchWhat {
    /// Codec throughput and size on the synthetic generator.
    Codec {
        /// Model size in elements (1e9 = 2 GB of bf16).
        #[arg(long, default_value_t = 100_000_000)]
        elements: u64,
        /// Measured steps.
        #[arg(long, default_value_t = 3)]
        steps: u32,
        /// Generator learning rate.
        #[arg(long, default_value_t = 3e-6)]
        lr: f32,
        /// Encodings, comma separated.
        #[arg(long, default_value = "compact,trl", value_delimiter = ',')]
        encodings: Vec<Encoding>,
        /// Worker threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        /// Write the report as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Seed.
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Timed repetitions per operation (the median is reported).
        #[arg(long, default_value_t = 3)]
        reps: u32,
    },
    /// Compressed (`planes`) anchors: size and encode/decode speed against a
    /// memcpy of the same bytes, on a checkpoint or the synthetic generator.
    Anchors {
        /// A .safetensors checkpoint (default: the synthetic generator).
        #[arg(long)]
        input: Option<PathBuf>,
        /// Generator model size in elements (without --input).
        #[arg(long, default_value_t = 100_000_000)]
        elements: u64,
        /// Words per chunk, comma separated (each is measured).
        #[arg(long, default_value = "1048576", value_delimiter = ',')]
        chunk_words: Vec<u64>,
        /// zstd levels, comma separated (each is measured).
        #[arg(long, default_value = "1", value_delimiter = ',')]
        levels: Vec<i32>,
        /// Worker threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        /// Timed repetitions per operation (the median is reported).
        #[arg(long, default_value_t = 5)]
        reps: u32,
        /// Write the rows as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

/// Installs the SIGINT (Ctrl-C) and SIGTERM (what compose and Kubernetes
/// send) handlers now, and returns a future that resolves on either. Installing
/// them before the daemon binds its port matters: a signal that arrives between
/// the bind and the future's first poll would otherwise take the default
/// action and kill the process uncleanly.
fn shutdown() -> Result<impl std::future::Future<Output = ()>> {
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

/// Prints one line on stdout. A closed stdout (the reader went away, EPIPE)
/// is not an error: the work the line reports is done (a commit stands), and
/// a panic or a failure exit would misreport it.
fn emit(line: impl std::fmt::Display) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    match writeln!(stdout, "{line}").and_then(|()| stdout.flush()) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        Err(e) => tracing::warn!(error = %e, "cannot write to stdout"),
    }
}

/// The exit code for a failure: the library's error kind decides (see
/// `weightcast::error::ErrorKind::exit_code`), 1 for anything else.
fn exit_code(e: &anyhow::Error) -> i32 {
    e.chain()
        .find_map(|c| c.downcast_ref::<weightcast::Error>())
        .map_or(1, |w| w.kind().exit_code())
}

fn main() {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("weightcast=info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().init(),
    }
    if let Err(e) = run(cli) {
        eprintln!("Error: {e:#}");
        std::process::exit(exit_code(&e));
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Demo {
            dir,
            steps,
            anchor_every,
            encoding,
            json,
        } => {
            if anchor_every == 0 {
                bail!("--anchor-every must be at least 1");
            }
            let tmp;
            let dir = match dir {
                Some(d) => d,
                None => {
                    tmp = tempfile::tempdir().context("creating a temporary bucket directory")?;
                    tmp.path().to_path_buf()
                }
            };
            let cfg = DemoConfig {
                dir,
                steps,
                anchor_every,
                encoding,
                model: GeneratorConfig::small(7),
            };
            // With --json, stdout carries the JSON report alone.
            let report = demo::run(&cfg, |line| {
                if json {
                    eprintln!("{line}");
                } else {
                    emit(line)
                }
            })?;
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
                emit(serde_json::to_string(&report)?);
            } else {
                emit(summary);
                emit(verdict);
            }
            if !report.bit_identical {
                bail!("a replica diverged from the trainer");
            }
        }
        Command::Bench {
            what:
                BenchWhat::Codec {
                    elements,
                    steps,
                    lr,
                    encodings,
                    threads,
                    json,
                    seed,
                    reps,
                },
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
            if let Some(p) = json {
                std::fs::write(&p, serde_json::to_vec_pretty(&report)?)
                    .with_context(|| format!("writing {}", p.display()))?;
            }
        }
        Command::Bench {
            what:
                BenchWhat::Anchors {
                    input,
                    elements,
                    chunk_words,
                    levels,
                    threads,
                    reps,
                    json,
                },
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
            if let Some(p) = json {
                std::fs::write(&p, serde_json::to_vec_pretty(&rows)?)
                    .with_context(|| format!("writing {}", p.display()))?;
            }
        }
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
            let base_set = TensorSet::read(&base, Digests::Compute)?;
            let mut new_set = TensorSet::read(&new, Digests::Skip)?;
            let opts = DeltaOptions {
                encoding,
                model_version,
                base_version,
                trl: TrlOptions {
                    generation: trl_generation,
                    index: trl_index,
                },
            };
            let (bytes, summary) = codec::encode_delta(&base_set, &mut new_set, &opts)?;
            std::fs::write(&out, bytes).with_context(|| format!("writing {}", out.display()))?;
            emit(serde_json::to_string(&summary)?);
        }
        Command::Apply { base, delta, out } => {
            let mut set = TensorSet::read(&base, Digests::Compute)?;
            let bytes =
                std::fs::read(&delta).with_context(|| format!("reading {}", delta.display()))?;
            let report = codec::apply_delta(&mut set, &bytes)?;
            let version = report.model_version.unwrap_or(0);
            let mut f = std::io::BufWriter::new(
                std::fs::File::create(&out)
                    .with_context(|| format!("creating {}", out.display()))?,
            );
            codec::write_anchor(&set, version, &mut f)?;
            f.flush()?;
            emit(serde_json::to_string(&report)?);
        }
        Command::Publish {
            checkpoint,
            step,
            quiet,
            opts,
        } => {
            let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            let published = rt.block_on(async {
                let mut p = opts.open(!quiet).await?;
                let opts = weightcast::publisher::PublishOptions { step };
                anyhow::Ok(p.publish_path(&checkpoint, &opts).await?)
            })?;
            emit(serde_json::to_string(&published)?);
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
        } => {
            if !(poll_interval > 0.0 && poll_interval.is_finite()) {
                bail!("--poll-interval must be a positive number of seconds");
            }
            if !(0.0..=1.0).contains(&poll_jitter) {
                bail!("--poll-jitter must be a fraction between 0 and 1");
            }
            let key = notify_key
                .as_deref()
                .map(weightcast::notify::Key::new)
                .transpose()?;
            let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            rt.block_on(async {
                // The daemon takes over SIGTERM/SIGINT first thing (see
                // `shutdown`); a one-shot run keeps the default action.
                let stops = if once {
                    None
                } else {
                    Some((shutdown()?, shutdown()?))
                };
                let store = weightcast::store::Store::open(&store)?;
                std::fs::create_dir_all(&out)
                    .with_context(|| format!("creating {}", out.display()))?;
                let mut cfg = weightcast::subscriber::DaemonConfig::new(&out);
                cfg.slots = slots;
                cfg.poll_interval = std::time::Duration::from_secs_f64(poll_interval);
                cfg.poll_jitter = poll_jitter;
                cfg.id = id;
                cfg.hooks = hooks;
                cfg.notify_url = advertise.clone();
                if once {
                    // One iteration of the daemon: verify (and repair) the
                    // output, catch up, run the hooks, register.
                    return match weightcast::subscriber::once(&store, &cfg).await? {
                        Some((c, report)) => {
                            if report.failed > 0 {
                                bail!(
                                    "{} hook(s) failed after switching to version {}",
                                    report.failed,
                                    c.version
                                );
                            }
                            emit(serde_json::to_string(&c)?);
                            Ok(())
                        }
                        None => bail!("the bucket has no committed version yet"),
                    };
                }
                let shared = weightcast::subscriber::status::Shared::new(store.url(), key);
                let mut notify_url = advertise;
                let (stop, stop_server) = stops.expect("installed for the daemon");
                if let Some(addr) = listen {
                    let listener = tokio::net::TcpListener::bind(addr)
                        .await
                        .with_context(|| format!("binding {addr}"))?;
                    let bound = listener.local_addr()?;
                    notify_url.get_or_insert_with(|| format!("http://{bound}/v1/notify"));
                    tracing::info!(%bound, "serving /v1/notify, /v1/status, /healthz, /metrics");
                    let s = shared.clone();
                    tokio::spawn(async move {
                        if let Err(e) =
                            weightcast::http::subscriber::serve(listener, s, stop_server).await
                        {
                            tracing::error!(error = %e, "HTTP server stopped");
                        }
                    });
                }
                cfg.notify_url = notify_url;
                // Stopping mid-catch-up is safe: the output switches versions
                // atomically and a restart continues from the verified state.
                weightcast::subscriber::run(&store, &cfg, &shared, stop).await?;
                tracing::info!("stopping");
                anyhow::Ok(())
            })?;
        }
        Command::Publisher {
            listen,
            token,
            checkpoint_root,
            opts,
        } => {
            let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            rt.block_on(async {
                // First, so a signal during start-up is honoured once it is up
                // instead of killing the process half-way through opening.
                let stop = shutdown()?;
                let publisher = opts.open(false).await?;
                let filters = publisher.checkpoint_options().clone();
                let shared = weightcast::http::publisher::PublisherShared::new(
                    publisher,
                    &token,
                    &checkpoint_root,
                    filters,
                )?;
                let listener = tokio::net::TcpListener::bind(listen)
                    .await
                    .with_context(|| format!("binding {listen}"))?;
                tracing::info!(addr = %listener.local_addr()?, "serving POST /v1/publish");
                weightcast::http::publisher::serve(listener, shared, stop).await?;
                anyhow::Ok(())
            })?;
        }
        Command::Status { store } => {
            let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            let view = rt.block_on(async {
                let store = weightcast::store::Store::open(&store)?;
                weightcast::protocol::fleet(&store).await
            })?;
            emit(serde_json::to_string_pretty(&view)?);
        }
        Command::Gc {
            store,
            retention,
            dry_run,
        } => {
            let retention = retention.retention()?;
            let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            let collected = rt.block_on(async {
                let store = weightcast::store::Store::open(&store)?;
                weightcast::protocol::collect_garbage(&store, &retention, dry_run).await
            })?;
            emit(serde_json::to_string(&collected)?);
        }
        Command::Inspect { path } => {
            let bytes =
                std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
            let (meta, header) = codec::inspect(&bytes)?;
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
            emit(serde_json::to_string_pretty(&meta)?);
        }
    }
    Ok(())
}
