//! Subscriber catch-up benchmark: a synthetic bf16 model (the generator) is
//! published version by version into a `file://` bucket — an anchor, then
//! deltas, written with the codec and committed with the protocol, in this
//! process — and subscriber daemons (`weightcast subscribe`, one per output
//! directory) are woken by a signed notification after each version, one
//! after the other. For each version and daemon it reports the catch-up time
//! the daemon measured (`last_apply_seconds` of `/v1/status`), the peak
//! anonymous memory of the daemon process during it (RssAnon sampled every
//! millisecond), how long the daemon then took to bring its standby slot
//! forward (its idle work, waited for so that it does not overlap the next
//! measurement), and the time of `cat` of the anchor object (the model's
//! bytes, from the page cache) in the same run, as the baseline. At the end,
//! one idle `subscribe --once` per output times the start-up verification of
//! the current slot. `BENCH_LOG=weightcast=debug` shows the daemons' phase
//! timings (apply, flush) on stderr.
//!
//! ```sh
//! cargo build --release --bin weightcast --example bench_catchup
//! target/release/examples/bench_catchup --elements 1000000000 \
//!     --bucket /tmp/wc-bench-bucket --out /dev/shm/wc-bench-out
//! ```
//!
//! Versions 0 (a bootstrap), 1 (the second slot built by a copy of the
//! first) and 2.. (one behind: the old slot brought forward from the journal
//! and patched in place) are the three kinds of catch-up. Memory: the
//! generator's fp32 master weights (4× the elements in bytes) and two bf16
//! snapshots (2× each) in this process; the bucket holds one anchor.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::Parser;
use weightcast::codec::{DeltaOptions, encode_delta, write_anchor};
use weightcast::format::Encoding;
use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::protocol::{
    Latest, ObjectEntry, ObjectRole, Staging, VersionKind, commit, write_latest,
};
use weightcast::store::Store;

const KEY: &str = "bench-catchup-notify-key";

#[derive(Parser)]
struct Args {
    /// Model size in bf16 elements.
    #[arg(long, default_value_t = 1_000_000_000)]
    elements: u64,
    /// Versions to publish (the first is an anchor).
    #[arg(long, default_value_t = 4)]
    versions: u64,
    /// The bucket directory (emptied first).
    #[arg(long)]
    bucket: PathBuf,
    /// Subscriber output directories (repeatable; one daemon each).
    #[arg(long = "out", required = true)]
    outs: Vec<PathBuf>,
    /// The weightcast binary (default: next to this example's directory).
    #[arg(long)]
    bin: Option<PathBuf>,
    /// Generator seed.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Generator learning rate (1.5e-6: about 1.5% of the elements change per
    /// step at 1e9 elements).
    #[arg(long, default_value_t = 1.5e-6)]
    lr: f32,
}

/// Peak RssAnon (bytes) of a process, sampled every millisecond.
struct Sampler {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

fn rss_anon(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("RssAnon:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

impl Sampler {
    fn start(pid: u32) -> Sampler {
        let peak = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Some(v) = rss_anon(pid) {
                    p.fetch_max(v, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        Sampler { peak, stop }
    }

    fn take(&self) -> u64 {
        self.peak.swap(0, Ordering::Relaxed)
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

struct Daemon {
    out: PathBuf,
    child: Child,
    base: String,
    sampler: Sampler,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // Our own child: stopped if still running (an error path).
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

async fn status(base: &str) -> Result<serde_json::Value> {
    Ok(reqwest::get(format!("{base}/v1/status"))
        .await?
        .json()
        .await?)
}

fn time_cat(p: &Path) -> Result<f64> {
    let run = || -> Result<f64> {
        let t = Instant::now();
        let ok = Command::new("cat")
            .arg(p)
            .stdout(Stdio::null())
            .status()?
            .success();
        if !ok {
            bail!("cat {} failed", p.display());
        }
        Ok(t.elapsed().as_secs_f64())
    };
    run()?; // into the page cache
    Ok(run()?.min(run()?))
}

/// Publishes version `v`: the anchor of `set` (v0, written straight into the
/// bucket directory) or the delta from `prev`. Returns (kind, bytes, changed
/// elements).
async fn publish(
    store: &Store,
    bucket: &Path,
    v: u64,
    prev: Option<&weightcast::tensors::TensorSet>,
    set: &mut weightcast::tensors::TensorSet,
) -> Result<(&'static str, u64, u64)> {
    const NAME: &str = "model.safetensors";
    let mut staging = Staging::new(v);
    let config = Bytes::from(format!(
        "{{\"model_type\": \"llama\", \"v\": {}}}",
        v.min(1)
    ));
    let (kind, bytes, changed) = match prev {
        None => {
            let key = staging.key(ObjectRole::Anchor, NAME)?;
            let path = bucket.join(&key);
            std::fs::create_dir_all(path.parent().context("object path")?)?;
            let mut f = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(&path)?);
            write_anchor(set, v, &mut f)?;
            f.into_inner()?.sync_all()?;
            let mut h = blake3::Hasher::new();
            h.update_mmap_rayon(&path)?;
            let size = std::fs::metadata(&path)?.len();
            staging.record(ObjectEntry {
                name: NAME.into(),
                role: ObjectRole::Anchor,
                key,
                size,
                blake3: h.finalize().to_hex().to_string(),
            });
            staging
                .upload(store, "config.json", ObjectRole::File, config.clone())
                .await?;
            ("anchor", size, set.total_elements())
        }
        Some(prev) => {
            let opts = DeltaOptions::new(Encoding::Compact, v, v - 1);
            let (delta, summary) = encode_delta(prev, set, &opts)?;
            let size = delta.len() as u64;
            staging
                .upload(store, NAME, ObjectRole::Delta, Bytes::from(delta))
                .await?;
            if v == 1 {
                staging
                    .upload(store, "config.json", ObjectRole::File, config.clone())
                    .await?;
            }
            ("delta", size, summary.changed)
        }
    };
    staging.list_file(
        "config.json",
        config.len() as u64,
        blake3::hash(&config).to_hex().to_string(),
    );
    let (k, base) = if v == 0 {
        (VersionKind::Anchor, None)
    } else {
        (VersionKind::Delta, Some(v - 1))
    };
    let m = staging.manifest(k, base, 0, None);
    commit(store, &m).await?;
    write_latest(
        store,
        &Latest {
            version: v,
            anchor_version: 0,
        },
    )
    .await?;
    Ok((kind, bytes, changed))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let bin = match args.bin {
        Some(b) => b,
        None => std::env::current_exe()?
            .parent()
            .and_then(Path::parent)
            .context("locating the weightcast binary")?
            .join("weightcast"),
    };
    let _ = std::fs::remove_dir_all(&args.bucket);
    std::fs::create_dir_all(&args.bucket)?;
    let bucket = std::fs::canonicalize(&args.bucket)?;
    let url = url::Url::from_directory_path(&bucket)
        .map_err(|()| anyhow::anyhow!("bucket path"))?
        .to_string();
    let store = Store::open(&url)?;
    let rt = tokio::runtime::Runtime::new()?;
    let mut daemons = Vec::new();
    for out in &args.outs {
        let _ = std::fs::remove_dir_all(out);
        let port = free_port()?;
        let child = Command::new(&bin)
            .args(["subscribe", "--store", &url, "--out"])
            .arg(out)
            .args(["--poll-interval", "3600", "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .args(["--notify-key", KEY])
            .env(
                "RUST_LOG",
                std::env::var("BENCH_LOG").unwrap_or_else(|_| "weightcast=warn".into()),
            )
            .stdin(Stdio::null())
            .spawn()
            .context("starting a subscriber")?;
        let base = format!("http://127.0.0.1:{port}");
        let sampler = Sampler::start(child.id());
        daemons.push(Daemon {
            out: out.clone(),
            child,
            base,
            sampler,
        });
    }
    // Up (listening) before the first version.
    for d in &daemons {
        let deadline = Instant::now() + Duration::from_secs(60);
        while rt.block_on(status(&d.base)).is_err() {
            if Instant::now() > deadline {
                bail!("subscriber for {} did not start", d.out.display());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    let mut model = GeneratorConfig::with_elements(args.seed, args.elements);
    model.lr = args.lr;
    let mut g = Generator::new(model);
    let mut prev: Option<weightcast::tensors::TensorSet> = None;
    let key = weightcast::notify::Key::new(KEY)?;
    let mut rows = Vec::new();
    for v in 0..args.versions {
        if v > 0 {
            g.step();
        }
        let mut set = if v == 0 {
            g.snapshot()
        } else {
            g.snapshot_without_digests()
        };
        let (kind, bytes, changed) =
            rt.block_on(publish(&store, &bucket, v, prev.as_ref(), &mut set))?;
        prev = Some(set);
        let anchor = std::fs::read_dir(bucket.join("anchors"))?
            .next()
            .context("the anchor")??
            .path()
            .join("model.safetensors");
        let size = std::fs::metadata(&anchor)?.len();
        let cat = time_cat(&anchor)?;
        for d in &mut daemons {
            d.sampler.take();
            let before = rt.block_on(status(&d.base))?;
            let n = weightcast::notify::Notification {
                store: url.clone(),
                version: v,
                anchor_version: 0,
            };
            let sent = rt.block_on(weightcast::notify::send(
                &[format!("{}/v1/notify", d.base)],
                &key,
                &n,
            ));
            if !sent.iter().all(|s| s.ok) {
                bail!("notification to {} refused", d.base);
            }
            let deadline = Instant::now() + Duration::from_secs(600);
            let s = loop {
                let s = rt.block_on(status(&d.base))?;
                if s["version"].as_u64() == Some(v) {
                    break s;
                }
                if Instant::now() > deadline || d.child.try_wait()?.is_some() {
                    bail!("{} did not reach v{v}: {s}", d.out.display());
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            // Then the standby slot brought forward (the daemon's idle work
            // after a switch), so that nothing else runs during the next
            // measurement.
            let standby_ready = || -> Option<bool> {
                let state: serde_json::Value =
                    serde_json::from_slice(&std::fs::read(d.out.join(".state.json")).ok()?).ok()?;
                let slots = state["slots"].as_object()?;
                Some(slots.values().all(|x| {
                    x["version"].as_u64() == Some(v) && x["dirty"].as_bool() == Some(false)
                }))
            };
            let prepared = Instant::now();
            while standby_ready() != Some(true) {
                if Instant::now() > deadline || d.child.try_wait()?.is_some() {
                    bail!("{}: the standby slot did not reach v{v}", d.out.display());
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let standby_s = prepared.elapsed().as_secs_f64();
            let apply = s["last_apply_seconds"].as_f64().unwrap_or(f64::NAN);
            let diff = |k: &str| s[k].as_u64().unwrap_or(0) - before[k].as_u64().unwrap_or(0);
            let row = serde_json::json!({
                "version": v,
                "kind": kind,
                "changed": changed,
                "out": d.out,
                "model_bytes": size,
                "object_bytes": bytes,
                "catch_up_s": apply,
                "cat_s": cat,
                "ratio": apply / cat,
                "standby_s": standby_s,
                "peak_rss_anon_mib": d.sampler.take() as f64 / (1 << 20) as f64,
                "downloaded": diff("bytes_downloaded"),
                "written": diff("bytes_written"),
                "journal": diff("bytes_journal"),
                "requests": diff("store_requests"),
            });
            println!("{row}");
            rows.push(row);
        }
    }
    for d in &mut daemons {
        // SIGTERM: the daemon stops at once.
        Command::new("kill")
            .args(["-TERM", &d.child.id().to_string()])
            .status()?;
        d.child.wait()?;
        let t = Instant::now();
        let out = Command::new(&bin)
            .args(["subscribe", "--once", "--store", &url, "--out"])
            .arg(&d.out)
            .output()?;
        if !out.status.success() {
            bail!("idle --once: {}", String::from_utf8_lossy(&out.stderr));
        }
        println!(
            "{}",
            serde_json::json!({
                "idle_once_s": t.elapsed().as_secs_f64(),
                "out": d.out,
                "result": serde_json::from_slice::<serde_json::Value>(&out.stdout)?,
            })
        );
    }
    Ok(())
}
