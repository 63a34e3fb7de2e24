//! A stand-in trainer for the `docker compose` playground and for trying the
//! publisher daemon by hand: every `--interval` seconds it advances the
//! synthetic RL-step generator, writes the weights as a Hugging Face style
//! checkpoint directory (`DIR/step-NNNNNNNN/model.safetensors` and
//! `config.json`, written aside and renamed into place), and asks a
//! `weightcast publisher` daemon to publish it:
//!
//! ```text
//! POST {publisher}/v1/publish
//! Authorization: Bearer {token}
//! {"checkpoint": "DIR/step-NNNNNNNN"}
//! ```
//!
//! Each answer is printed as one JSON line. Published checkpoints beyond the
//! newest `--keep` are deleted; `DIR/last-published.json` holds the newest
//! answer (the compose health check looks at its age).
//!
//! ```sh
//! weightcast publisher --store file:///tmp/bucket --state /tmp/pub-state \
//!     --checkpoint-root /tmp/ckpts --token 0123456789abcdef &
//! cargo run --release --example trainer_loop -- --dir /tmp/ckpts \
//!     --token 0123456789abcdef --interval 5 --steps 4 --elements 1000000
//! ```

mod cli;

use std::collections::{BTreeMap, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use weightcast::generator::{Generator, GeneratorConfig};

/// Name of the checkpoint directory of `step`.
fn step_dir(step: u64) -> String {
    format!("step-{step:08}")
}

/// Whether `name` is one of ours (a checkpoint or one being written).
fn ours(name: &str) -> bool {
    let stem = name
        .strip_prefix(".step-")
        .and_then(|s| s.strip_suffix(".tmp"))
        .or_else(|| name.strip_prefix("step-"));
    stem.is_some_and(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
}

/// Writes the generator's weights as `dir/step-NNNNNNNN/`, complete or not at all.
fn write_checkpoint(dir: &Path, step: u64, g: &Generator) -> Result<PathBuf> {
    let name = step_dir(step);
    let tmp = dir.join(format!(".{name}.tmp"));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let file = tmp.join("model.safetensors");
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(&file).with_context(|| format!("creating {}", file.display()))?,
    );
    g.snapshot_without_digests()
        .write_to(&BTreeMap::new(), &mut f)
        .with_context(|| format!("writing {}", file.display()))?;
    f.into_inner()
        .map_err(|e| e.into_error())
        .and_then(|f| f.sync_all())
        .with_context(|| format!("writing {}", file.display()))?;
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "bfloat16",
        "weightcast_synthetic": true,
    });
    std::fs::write(tmp.join("config.json"), format!("{config:#}\n"))
        .context("writing config.json")?;
    let done = dir.join(&name);
    let _ = std::fs::remove_dir_all(&done);
    std::fs::rename(&tmp, &done).with_context(|| format!("renaming to {}", done.display()))?;
    Ok(done)
}

/// How one publish request ended.
enum Outcome {
    /// The daemon's answer.
    Published(serde_json::Value),
    /// The daemon refused this checkpoint (400, 422): the next one may do.
    Refused(String),
}

/// Asks the daemon to publish `checkpoint`, retrying what may pass later
/// (connection errors, 5xx, 429) for `retry_for`. A refused token is fatal.
async fn publish(
    client: &reqwest::Client,
    args: &cli::Args,
    checkpoint: &Path,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) -> Result<Option<Outcome>> {
    let url = format!("{}/v1/publish", args.publisher);
    let deadline = Instant::now() + Duration::from_secs_f64(args.retry_for);
    let mut backoff = Duration::from_millis(500);
    loop {
        let sent = client
            .post(&url)
            .bearer_auth(&args.token)
            .json(&serde_json::json!({ "checkpoint": checkpoint }))
            .send()
            .await;
        let retry = match sent {
            Ok(resp) => {
                let status = resp.status();
                let body = resp.text().await.unwrap_or_default();
                if status.is_success() {
                    let v = serde_json::from_str(&body)
                        .with_context(|| format!("the daemon's answer is not JSON: {body}"))?;
                    return Ok(Some(Outcome::Published(v)));
                }
                if status == reqwest::StatusCode::UNAUTHORIZED
                    || status == reqwest::StatusCode::FORBIDDEN
                {
                    bail!(
                        "{url} refused the request ({status}): {}; check --token and that --dir is under the daemon's --checkpoint-root at the same path",
                        body.trim()
                    );
                }
                if status.is_client_error() && status != reqwest::StatusCode::TOO_MANY_REQUESTS {
                    return Ok(Some(Outcome::Refused(format!("{status}: {}", body.trim()))));
                }
                format!("{status}: {}", body.trim())
            }
            Err(e) => e.to_string(),
        };
        if Instant::now() + backoff > deadline {
            return Ok(Some(Outcome::Refused(format!(
                "gave up after {:.0} s: {retry}",
                args.retry_for
            ))));
        }
        tracing::warn!(error = %retry, "publish not answered; retrying in {backoff:?}");
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return Ok(None),
        }
        backoff = (backoff * 2).min(Duration::from_secs(10));
    }
}

/// Completes on SIGINT or SIGTERM (`docker stop`, Kubernetes).
async fn stop_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    // RUST_LOG's `target=level` directives; info when unset.
    let filter: tracing_subscriber::filter::Targets = std::env::var("RUST_LOG")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            s.parse()
                .with_context(|| format!("RUST_LOG={s:?} is not a log filter"))
        })
        .transpose()?
        .unwrap_or_else(|| "info".parse().expect("a bare level parses"));
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .finish()
        .with(filter)
        .init();
    let args = cli::Args::parse();

    let (stop_tx, mut stop) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        stop_signal().await;
        let _ = stop_tx.send(true);
    });

    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let dir = args
        .dir
        .canonicalize()
        .with_context(|| format!("resolving {}", args.dir.display()))?;
    // Checkpoints of an earlier run are not ours to publish any more.
    for e in std::fs::read_dir(&dir)?.flatten() {
        if e.file_name().to_str().is_some_and(ours) {
            std::fs::remove_dir_all(e.path())
                .with_context(|| format!("removing {}", e.path().display()))?;
        }
    }

    let model = match args.elements {
        Some(n) => GeneratorConfig::with_elements(args.seed, n),
        None => GeneratorConfig::small(args.seed),
    };
    tracing::info!(
        elements = model.elements(),
        dir = %dir.display(),
        publisher = %args.publisher,
        "trainer loop starting"
    );
    let mut g = tokio::task::block_in_place(|| Generator::new(model));
    let client = {
        weightcast::store::install_crypto_provider();
        reqwest::Client::builder()
    }
    .connect_timeout(Duration::from_secs(5))
    .timeout(Duration::from_secs(1800))
    .build()?;

    let mut kept: VecDeque<PathBuf> = VecDeque::new();
    let mut step = 0u64;
    loop {
        let tick = Instant::now();
        if step > 0 {
            tokio::task::block_in_place(|| {
                for _ in 0..args.steps_per_checkpoint {
                    g.step();
                }
            });
        }
        let ckpt = tokio::task::block_in_place(|| write_checkpoint(&dir, step, &g))?;
        let Some(outcome) = publish(&client, &args, &ckpt, &mut stop).await? else {
            break;
        };
        match outcome {
            Outcome::Published(answer) => {
                let line = serde_json::json!({
                    "step": step,
                    "checkpoint": ckpt,
                    "published": answer,
                    "seconds": tick.elapsed().as_secs_f64(),
                });
                let mut out = std::io::stdout().lock();
                writeln!(out, "{line}")?;
                out.flush()?;
                let last = dir.join("last-published.json");
                let tmp = dir.join(".last-published.json.tmp");
                std::fs::write(&tmp, format!("{line}\n"))?;
                std::fs::rename(&tmp, &last)?;
            }
            Outcome::Refused(why) => {
                tracing::error!(step, checkpoint = %ckpt.display(), error = %why, "not published");
            }
        }
        kept.push_back(ckpt);
        while kept.len() as u64 > args.keep {
            if let Some(old) = kept.pop_front() {
                let _ = std::fs::remove_dir_all(&old);
            }
        }
        step += 1;
        if args.steps > 0 && step >= args.steps {
            break;
        }
        let wait = Duration::from_secs_f64(args.interval).saturating_sub(tick.elapsed());
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => break,
        }
    }
    tracing::info!(checkpoints = step, "trainer loop stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn our_names() {
        for n in ["step-00000001", ".step-00000002.tmp"] {
            assert!(super::ours(n), "{n}");
        }
        for n in [
            "step-",
            "last-published.json",
            "step-1a",
            ".step-1",
            "model",
        ] {
            assert!(!super::ours(n), "{n}");
        }
    }
}
