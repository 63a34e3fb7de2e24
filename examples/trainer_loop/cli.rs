//! The trainer loop's flags. Kept in a file of their own so that
//! `tests/it/deploy_files.rs` parses `docker-compose.yml`'s trainer command with
//! this very parser.

use std::path::PathBuf;

use clap::Parser;

/// A stand-in trainer: writes a synthetic checkpoint every few seconds and asks
/// a `weightcast publisher` daemon to publish it.
#[derive(Clone, Debug, Parser)]
#[command(name = "trainer_loop")]
pub struct Args {
    /// Directory the checkpoints are written to (`DIR/step-NNNNNNNN/`); must be
    /// the daemon's `--checkpoint-root`, or under it, at the same path.
    #[arg(long)]
    pub dir: PathBuf,
    /// Base URL of the publisher daemon.
    #[arg(long, default_value = "http://127.0.0.1:8470", value_parser = http_url)]
    pub publisher: String,
    /// Bearer token of the daemon (16+ characters).
    #[arg(long, env = "WEIGHTCAST_API_TOKEN", hide_env_values = true, value_parser = token)]
    pub token: String,
    /// Seconds between checkpoints.
    #[arg(long, default_value_t = 10.0, value_parser = seconds)]
    pub interval: f64,
    /// Checkpoints to write (0: until stopped).
    #[arg(long, default_value_t = 0)]
    pub steps: u64,
    /// Optimizer steps between two checkpoints.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub steps_per_checkpoint: u64,
    /// Model size in elements, rounded up to a Llama shape (18 million at
    /// least; default: the demo's model, about 25 million).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1000..))]
    pub elements: Option<u64>,
    /// Seed of the synthetic model.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Published checkpoints kept on disk (older ones are deleted).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    pub keep: u64,
    /// Seconds to keep retrying a publish the daemon could not answer (down,
    /// starting, 5xx) before skipping that checkpoint.
    #[arg(long, default_value_t = 120.0, value_parser = seconds)]
    pub retry_for: f64,
}

fn http_url(s: &str) -> Result<String, String> {
    let rest = s
        .strip_prefix("http://")
        .or_else(|| s.strip_prefix("https://"))
        .ok_or_else(|| format!("`{s}` is not an http(s) URL"))?;
    if rest.is_empty() || rest.starts_with('/') {
        return Err(format!("`{s}` has no host"));
    }
    Ok(s.trim_end_matches('/').to_string())
}

fn token(s: &str) -> Result<String, String> {
    if s.len() < 16 {
        return Err("the token must be at least 16 characters".into());
    }
    Ok(s.to_string())
}

fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("`{s}` is not a positive number of seconds")),
    }
}
