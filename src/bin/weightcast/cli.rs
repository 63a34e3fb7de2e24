//! The command line's definitions (clap): every command, its flags and
//! their help, and how the publisher flags open a publisher.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use weightcast::format::{Encoding, TrlGeneration, TrlIndexEncoding, TrlOptions};

/// A command line the command refuses after the parser accepted it (a
/// combination of flags): exit code 64, as the parser's own refusals.
#[derive(Debug)]
pub struct Usage(pub String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

#[derive(Parser)]
#[command(
    name = "weightcast",
    version,
    about = "Ship RL policy weights through object storage as anchors plus exact sparse deltas"
)]
pub struct Cli {
    /// Log format on stderr: text, or json (one JSON object per event, for
    /// log pipelines). Levels from RUST_LOG (default: info for weightcast).
    #[arg(
        long,
        global = true,
        env = "WEIGHTCAST_LOG_FORMAT",
        default_value = "text"
    )]
    pub log_format: LogFormat,
    /// Print JSON output indented over several lines (default: one line per
    /// report, for scripts and log pipelines).
    #[arg(long, global = true)]
    pub pretty: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
pub enum Command {
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
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
        anchor_every: u64,
        /// Delta encoding.
        #[arg(long, default_value = "compact", value_parser = delta_encoding())]
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
        /// Delta encoding.
        #[arg(long, default_value = "compact", value_parser = delta_encoding())]
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
        ranks: RankOpts,
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
        /// On SIGTERM/SIGINT: seconds a publish in flight may go on (new
        /// requests are answered 503 meanwhile); after it, a publish that has
        /// not begun its commit is stopped (503, nothing committed) and one
        /// committing is finished.
        #[arg(long, default_value_t = 30.0, value_parser = non_negative_seconds)]
        shutdown_grace: f64,
        #[command(flatten)]
        ranks: RankOpts,
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
        #[arg(long, default_value_t = 5.0, value_parser = positive_seconds)]
        poll_interval: f64,
        /// Random spread of each poll interval, as a fraction of it (0.1:
        /// ±10%), so that a fleet started together does not poll in lockstep.
        #[arg(long, default_value_t = 0.1, value_parser = fraction)]
        poll_jitter: f64,
        /// Output slots (2 to 26): a version's files stay untouched until
        /// this many minus one newer versions were switched in.
        #[arg(long, default_value_t = 2, value_parser = slots)]
        slots: usize,
        /// Serve /v1/notify, /v1/status, /healthz and /metrics on this address.
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// Shared secret for notifications (16+ characters); without it
        /// /v1/notify refuses everything.
        #[arg(long, env = "WEIGHTCAST_NOTIFY_KEY", hide_env_values = true)]
        notify_key: Option<String>,
        /// Register in the bucket under this id, [A-Za-z0-9._-]{1,128} (so
        /// publishers find and notify it, and `weightcast status` lists it).
        #[arg(long, value_parser = subscriber_id)]
        id: Option<String>,
        /// The notify URL to register (default: http://<listen>/v1/notify;
        /// required with --id when --listen is 0.0.0.0 or [::]).
        #[arg(long)]
        advertise: Option<String>,
        /// After each new version (repeatable): sglang:URL, vllm:URL,
        /// webhook:URL or command:CMD.
        #[arg(long = "hook")]
        hooks: Vec<weightcast::hooks::Hook>,
        /// Per-request timeout of the hooks, seconds (a reload of a large
        /// model takes minutes).
        #[arg(long, default_value_t = 600.0, value_parser = positive_seconds)]
        hook_timeout: f64,
        /// Total time one hook may take, retries with backoff included,
        /// seconds; after it the engine has not confirmed the version: the
        /// previous version's files stay untouched and the hooks run again.
        #[arg(long, default_value_t = 1800.0, value_parser = positive_seconds)]
        hook_budget: f64,
        /// SGLang's pause mode for the sglang hook: abort (requests in flight
        /// aborted; the update flushes the cache), retract (requests requeued
        /// and recomputed) or in_place (requests keep their KV cache); after
        /// retract and in_place the update does not flush the cache, which
        /// would crash SGLang's scheduler with requests in flight.
        #[arg(long, default_value = "abort")]
        sglang_pause_mode: weightcast::hooks::SglangPause,
        /// vLLM's pause mode for the vllm hook: auto (keep where the server's
        /// /openapi.json lists it, else wait), keep, wait or abort.
        #[arg(long, default_value = "auto")]
        vllm_pause_mode: weightcast::hooks::VllmPause,
        /// Bearer token for the vllm hook (vLLM started with --api-key);
        /// prefer the environment variable.
        #[arg(long, env = "WEIGHTCAST_VLLM_API_KEY", hide_env_values = true)]
        vllm_api_key: Option<String>,
        /// Bearer token for the sglang hook (SGLang started with --api-key or
        /// --admin-api-key); prefer the environment variable.
        #[arg(long, env = "WEIGHTCAST_SGLANG_API_KEY", hide_env_values = true)]
        sglang_api_key: Option<String>,
        /// The largest object read from the bucket, in memory or into a file
        /// (e.g. 64G, 512M, or bytes): an object a manifest declares larger
        /// is refused before any request, naming it.
        #[arg(long, default_value = "64G", value_parser = byte_size)]
        max_object_size: u64,
        /// No download progress bar (it is drawn only when stderr is a
        /// terminal).
        #[arg(long, short)]
        quiet: bool,
    },
    /// Mirror committed versions from an origin prefix to a regional prefix
    /// (any store kinds), verified on the way, and notify the region's
    /// subscribers. With --once, sync once, print one JSON line, exit.
    Relay {
        /// The origin store URL (see `publish`).
        #[arg(long)]
        from: String,
        /// The destination (regional) store URL; written by this relay only.
        #[arg(long)]
        to: String,
        /// A store option for the origin only, KEY=VALUE (repeatable; the
        /// object_store configuration keys, e.g. aws_endpoint=https://…,
        /// aws_access_key_id=…), over the environment's: two S3 endpoints or
        /// two accounts in one relay.
        #[arg(long = "from-option", value_name = "KEY=VALUE", value_parser = key_value)]
        from_option: Vec<(String, String)>,
        /// A store option for the destination only, KEY=VALUE (repeatable).
        #[arg(long = "to-option", value_name = "KEY=VALUE", value_parser = key_value)]
        to_option: Vec<(String, String)>,
        /// Sync once and exit (non-zero if a version could not be relayed).
        #[arg(long)]
        once: bool,
        /// Seconds between polls of the origin.
        #[arg(long, default_value_t = 5.0, value_parser = positive_seconds)]
        interval: f64,
        /// Subscriber notify URL of the region (repeatable), besides those
        /// registered in the destination.
        #[arg(long = "notify")]
        notify: Vec<String>,
        /// Shared secret for notifications (16+ characters): signs those sent
        /// to the region, and checks those received on --listen.
        #[arg(long, env = "WEIGHTCAST_NOTIFY_KEY", hide_env_values = true)]
        notify_key: Option<String>,
        /// Serve /v1/notify on this address: a notification from the origin's
        /// publisher makes the relay sync at once instead of at the next poll.
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// Retention at the destination after each relayed anchor: keep this
        /// many anchors, plus what the region's registered lagging subscribers
        /// still replay (off when absent; the origin is never touched).
        #[arg(long, value_parser = at_least_one)]
        keep_anchors: Option<usize>,
        /// With --keep-anchors: registrations older than this many seconds pin
        /// nothing (0: ignore registrations).
        #[arg(long, default_value_t = 86400)]
        registration_max_age: u64,
        /// The largest object copied (e.g. 64G, 512M, or bytes): an origin
        /// object its manifest declares larger is refused before any read.
        #[arg(long, default_value = "64G", value_parser = byte_size)]
        max_object_size: u64,
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
    /// Verify local state in full, whatever its stamps say: a publisher's
    /// --state (every snapshot file's digests, the overlay) and/or a
    /// subscriber's --out (every slot recorded clean). What does not verify
    /// stops being trusted: the next version is an anchor, the slot is
    /// rebuilt. Prints one JSON line; non-zero if anything failed.
    Verify {
        /// A publisher's state directory.
        #[arg(long, required_unless_present = "out")]
        state: Option<PathBuf>,
        /// A subscriber's output directory.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Print the header of an anchor or delta object as JSON.
    Inspect {
        /// The object.
        path: PathBuf,
        /// Every header key, the per-tensor table included (default: a
        /// summary).
        #[arg(long)]
        full: bool,
    },
}

/// Retention flags (`gc`, and the publishers' automatic retention).
#[derive(clap::Args)]
pub struct RetentionOpts {
    /// Anchors to keep (with every version after the oldest of them).
    #[arg(long, default_value_t = 2, value_parser = at_least_one)]
    pub keep_anchors: usize,
    /// Keep what a registered subscriber behind the kept anchors needs to
    /// replay, if its registration is at most this many seconds old (0: ignore
    /// registrations).
    #[arg(long, default_value_t = 86400)]
    pub registration_max_age: u64,
}

impl RetentionOpts {
    pub fn retention(&self) -> Result<weightcast::protocol::Retention> {
        retention(self.keep_anchors, self.registration_max_age)
    }
}

pub fn retention(keep_anchors: usize, max_age: u64) -> Result<weightcast::protocol::Retention> {
    if keep_anchors == 0 {
        return Err(Usage("--keep-anchors must be at least 1".into()).into());
    }
    Ok(weightcast::protocol::Retention {
        keep_anchors,
        registration_max_age_s: (max_age > 0).then_some(max_age),
    })
}

/// Distributed publish flags (`publish` and `publisher`).
#[derive(clap::Args)]
pub struct RankOpts {
    /// Distributed publish: this process is trainer rank R (0..WORLD) and
    /// publishes only its own shard files; with --world.
    #[arg(long, default_value_t = 0)]
    pub rank: u32,
    /// Distributed publish: the number of trainer ranks; all WORLD ranks
    /// (each with its own --state) commit one version per step together.
    /// 1 (the default): publish alone.
    #[arg(long, default_value_t = 1)]
    pub world: u32,
    /// With --world 2 or more: seconds to wait for the other ranks (their
    /// intents, then the commit) before giving up on the version.
    #[arg(long, default_value_t = 600)]
    pub rank_timeout: u64,
}

impl RankOpts {
    /// The rank these flags describe (`None`: publishing alone).
    pub fn distributed(&self) -> Result<Option<weightcast::publisher::Distributed>> {
        Ok(match (self.rank, self.world) {
            (0, 1) => None,
            (rank, 1) => {
                return Err(Usage(format!("--rank {rank} needs --world (2 or more ranks)")).into());
            }
            (rank, world) => Some(weightcast::publisher::Distributed {
                timeout: std::time::Duration::from_secs(self.rank_timeout),
                ..weightcast::publisher::Distributed::new(rank, world)?
            }),
        })
    }
}

/// Flags shared by `publish` and `publisher`.
#[derive(clap::Args)]
pub struct PublishOpts {
    /// Store URL (file://, memory://, s3://, gs://, az://, http(s)://,
    /// hf://buckets/NAMESPACE/BUCKET); credentials and endpoints from AWS_*,
    /// GOOGLE_*, AZURE_*, HF_S3_* variables.
    #[arg(long, env = "WEIGHTCAST_STORE")]
    pub store: String,
    /// Publisher state directory (the snapshot of the last committed version).
    #[arg(long, env = "WEIGHTCAST_STATE", default_value = "weightcast-state")]
    pub state: PathBuf,
    /// How the snapshot in --state follows the versions: in-place (each
    /// delta patched into its files: on a disk, every page a version changes
    /// is written back), overlay (the files stay as the last anchor wrote
    /// them, the deltas since are kept beside them and applied in memory:
    /// the disk writes the delta, and the last version takes anonymous
    /// memory the size of the model), previous (no copy of the model: the
    /// checkpoint each version was published from is the next delta's base,
    /// so the trainer must keep each checkpoint, unchanged, until the next
    /// one is published, a directory per step; otherwise the next version is
    /// an anchor), or auto (in-place on tmpfs and ramfs, and on a disk when
    /// the snapshot is more than a quarter of the memory available; overlay
    /// elsewhere).
    #[arg(long, default_value = "auto")]
    pub state_mode: weightcast::publisher::StateMode,
    /// Delta encoding.
    #[arg(long, default_value = "compact", value_parser = delta_encoding())]
    pub encoding: Encoding,
    /// With --encoding compact2: the largest share of changed elements (0
    /// to 1) a file's delta is written in compact2; a denser one is written
    /// in compact, whose encode and apply are faster there (compact2's fall
    /// below 0.8 of compact's above about 12%). 1 keeps compact2 at every
    /// density, for links where bytes cost more than cores.
    #[arg(long, default_value_t = weightcast::codec::COMPACT2_MAX_DENSITY, value_parser = share)]
    pub compact2_max_density: f64,
    /// How anchors are stored: planes (byte planes + zstd, ~1.5x smaller on
    /// bf16) or raw (a loadable safetensors file).
    #[arg(long, default_value = "planes")]
    pub anchor_encoding: weightcast::publisher::AnchorEncoding,
    /// Bucket layout: weightcast (anchors/, deltas/, files/, commit
    /// manifests) or trl (TRL's anchors/step_NNNNNN.safetensors and
    /// deltas/step_NNNNNN.safetensors at the prefix root, TRL-encoded; one
    /// writer; tensors only).
    #[arg(long, default_value = "weightcast")]
    pub layout: weightcast::protocol::Layout,
    /// TRL generation of trl-encoded deltas and of the trl layout: v1
    /// (.indices/.values) or v3 (.idx/.val).
    #[arg(long, default_value = "v3")]
    pub trl_generation: TrlGeneration,
    /// With v3: positions as raw (I32) or gap_delta (U16/U32 gaps).
    #[arg(long, default_value = "gap_delta")]
    pub trl_index: TrlIndexEncoding,
    /// An anchor at least every N versions.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub anchor_every: u64,
    /// Accept a store that ignores conditional writes: you guarantee that
    /// exactly one publisher writes this prefix.
    #[arg(long)]
    pub single_writer: bool,
    /// Subscriber notify URL (repeatable), besides those registered in the bucket.
    #[arg(long = "notify")]
    pub notify: Vec<String>,
    /// Shared secret for notifications (16+ characters); without it none are sent.
    #[arg(long, env = "WEIGHTCAST_NOTIFY_KEY", hide_env_values = true)]
    pub notify_key: Option<String>,
    /// Automatic retention after each anchor: keep this many anchors, plus what
    /// registered lagging subscribers still replay (off when absent).
    #[arg(long, value_parser = at_least_one)]
    pub keep_anchors: Option<usize>,
    /// With --keep-anchors: registrations older than this many seconds pin
    /// nothing (0: ignore registrations).
    #[arg(long, default_value_t = 86400)]
    pub registration_max_age: u64,
    /// Publish only the checkpoint files matching this glob (repeatable;
    /// relative to the checkpoint directory, `**` allowed).
    #[arg(long = "include")]
    pub include: Vec<String>,
    /// Skip the checkpoint files matching this glob (repeatable). Replaces the
    /// default, which skips optimizer, scheduler and RNG state
    /// (optimizer*.pt, scheduler*.pt, rng_state*.pth, global_step*/, *.distcp).
    #[arg(long = "exclude")]
    pub exclude: Vec<String>,
}

/// A progress bar on stderr (drawn only when stderr is a terminal) for the
/// bytes of a version, whose length grows as objects start.
#[derive(Debug)]
pub struct Bars(indicatif::ProgressBar);

impl Bars {
    /// `verb`: what the bar counts ("uploading", "downloading").
    pub fn new(verb: &str) -> Bars {
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(0),
            indicatif::ProgressDrawTarget::stderr(),
        );
        bar.set_style(
            indicatif::ProgressStyle::with_template(&format!(
                "{{spinner}} {verb} {{msg:30!}} {{bytes}}/{{total_bytes}} {{bytes_per_sec}} eta {{eta}}"
            ))
            .expect("valid progress template"),
        );
        Bars(bar)
    }
}

impl weightcast::store::Progress for Bars {
    fn started(&self, key: &str, bytes: u64) {
        self.0.inc_length(bytes);
        self.0
            .set_message(key.rsplit('/').next().unwrap_or(key).to_string());
    }
    fn advanced(&self, bytes: u64) {
        self.0.inc(bytes);
    }
}

impl Drop for Bars {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}

impl PublishOpts {
    /// Opens the store and the publisher these flags describe; `progress` draws
    /// upload progress bars on a terminal; `ranks` make it one rank of a
    /// distributed publish.
    pub async fn open(
        self,
        progress: bool,
        ranks: &RankOpts,
    ) -> Result<weightcast::publisher::Publisher> {
        let distributed = ranks.distributed()?;
        if self.layout == weightcast::protocol::Layout::Trl && self.encoding != Encoding::Trl {
            // TRL's layout holds TRL deltas: --layout trl implies the encoding.
            tracing::debug!("--layout trl: deltas are TRL-encoded");
        }
        let mut store = weightcast::store::Store::open(&self.store)?;
        store.check_contact().await?;
        if progress {
            store = store.with_progress(std::sync::Arc::new(Bars::new("uploading")));
        }
        let cfg = weightcast::publisher::PublisherConfig {
            state_dir: self.state,
            encoding: self.encoding,
            compact2_max_density: self.compact2_max_density,
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
            distributed,
            state_mode: self.state_mode,
        };
        Ok(weightcast::publisher::Publisher::open(store, cfg).await?)
    }
}

#[derive(Subcommand)]
pub enum BenchWhat {
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
        /// Delta encodings, comma separated.
        #[arg(long, default_value = "compact,trl", value_delimiter = ',', value_parser = delta_encoding())]
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

/// A delta encoding: `compact`, `compact2` or `trl` (the anchor encodings `full` and
/// `planes` are no delta encodings: the parser lists the possible values).
pub fn delta_encoding() -> impl clap::builder::TypedValueParser<Value = Encoding> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(["compact", "compact2", "trl"])
        .map(|s| s.parse::<Encoding>().expect("a possible value parses"))
}

/// A share from 0 to 1.
fn share(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("`{s}` is not a share from 0 to 1 (e.g. 0.1)")),
    }
}

/// A number of seconds above 0.
fn positive_seconds(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() && v < 1e9 => Ok(v),
        _ => Err(format!(
            "`{s}` is not a number of seconds above 0 (e.g. 5, 0.5)"
        )),
    }
}

/// A number of seconds, 0 or more.
fn non_negative_seconds(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v >= 0.0 && v.is_finite() && v < 1e9 => Ok(v),
        _ => Err(format!(
            "`{s}` is not a number of seconds, 0 or more (e.g. 30)"
        )),
    }
}

/// A fraction between 0 and 1.
fn fraction(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!(
            "`{s}` is not a fraction between 0 and 1 (e.g. 0.1)"
        )),
    }
}

/// A count of 1 or more.
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(v) if v >= 1 => Ok(v),
        _ => Err(format!("`{s}` is not a count of 1 or more")),
    }
}

/// Output slots: 2 to 26.
fn slots(s: &str) -> Result<usize, String> {
    let max = weightcast::subscriber::MAX_SLOTS;
    match s.trim().parse::<usize>() {
        Ok(v) if (2..=max).contains(&v) => Ok(v),
        _ => Err(format!("`{s}` is not a number of slots from 2 to {max}")),
    }
}

/// A registration id: `[A-Za-z0-9._-]{1,128}`, not starting with a dot.
fn subscriber_id(s: &str) -> Result<String, String> {
    if weightcast::protocol::valid_id(s) {
        Ok(s.to_string())
    } else {
        Err(format!(
            "`{s}` is not a subscriber id: use 1 to 128 of A-Z a-z 0-9 . _ - (not starting \
             with a dot), e.g. the pod or host name"
        ))
    }
}

/// Checks across flags the parser cannot check one flag at a time; the error
/// is a usage error, as the parser's.
pub fn validate(cli: &Cli) -> Result<(), clap::Error> {
    use clap::CommandFactory;
    let fail = |kind, msg: String| Err(Cli::command().error(kind, msg));
    match &cli.command {
        Command::Relay {
            from,
            to,
            from_option,
            to_option,
            ..
        } if same_store(from, to) && from_option == to_option => fail(
            clap::error::ErrorKind::ArgumentConflict,
            format!(
                "--from and --to are the same store (`{from}`): a relay copies from an origin \
                 into another prefix (or another endpoint: --to-option aws_endpoint=...)"
            ),
        ),
        Command::Publish { ranks, .. } | Command::Publisher { ranks, .. }
            if ranks.world == 0 || ranks.rank >= ranks.world =>
        {
            fail(
                clap::error::ErrorKind::ValueValidation,
                format!(
                    "--rank {} --world {}: the rank must be below the number of ranks (0..{})",
                    ranks.rank, ranks.world, ranks.world
                ),
            )
        }
        _ => Ok(()),
    }
}

/// Whether two store URLs name the same store and prefix (case of the
/// scheme and host, trailing slashes and `.`/`..` segments aside).
pub fn same_store(a: &str, b: &str) -> bool {
    fn norm(u: &str) -> String {
        match url::Url::parse(u.trim()) {
            Ok(p) => {
                let path = match p.scheme() {
                    "file" => p
                        .to_file_path()
                        .map(|f| std::fs::canonicalize(&f).unwrap_or(f).display().to_string())
                        .unwrap_or_else(|_| p.path().to_string()),
                    _ => p.path().to_string(),
                };
                format!(
                    "{}://{}{}/{}",
                    p.scheme().to_ascii_lowercase(),
                    p.host_str().unwrap_or("").to_ascii_lowercase(),
                    p.port().map(|n| format!(":{n}")).unwrap_or_default(),
                    path.trim_matches('/')
                )
            }
            Err(_) => u.trim().trim_end_matches('/').to_string(),
        }
    }
    norm(a) == norm(b)
}

/// A `KEY=VALUE` store option.
fn key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
        _ => Err(format!(
            "`{s}` is not KEY=VALUE (e.g. aws_endpoint=http://127.0.0.1:9000)"
        )),
    }
}

/// A size in bytes: a number, optionally with a binary suffix `K`, `M`, `G`
/// or `T` (KiB, MiB, GiB, TiB; `KiB`… and `KB`… read the same).
pub fn byte_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(digits);
    let shift = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        _ => return Err(format!("`{s}` is not a size (e.g. 64G, 512M, 1073741824)")),
    };
    n.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("`{s}` is not a size above 0 (e.g. 64G, 512M, 1073741824)"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_parse_with_binary_suffixes() {
        use super::byte_size;
        assert_eq!(byte_size("1024"), Ok(1024));
        assert_eq!(byte_size("64G"), Ok(64 << 30));
        assert_eq!(byte_size("512MiB"), Ok(512 << 20));
        assert_eq!(byte_size("2t"), Ok(2 << 40));
        for bad in ["", "0", "G", "1.5G", "12X", "99999999999T"] {
            assert!(byte_size(bad).is_err(), "{bad}");
        }
    }
}
