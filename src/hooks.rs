//! Engine hand-off: what runs after a subscriber switched `DIR/current` to a new
//! verified version.
//!
//! | hook | what it does |
//! |---|---|
//! | `sglang:URL` | `POST URL/pause_generation`, `POST URL/update_weights_from_disk {"model_path": DIR/current}`, `POST URL/continue_generation` |
//! | `vllm:URL` | `POST URL/pause?mode=keep`, `POST URL/collective_rpc {"method": "reload_weights"}`, `POST URL/resume` — vLLM's development endpoints (`VLLM_SERVER_DEV_MODE=1`), with vLLM serving `--model DIR/current` |
//! | `webhook:URL` | `POST URL {"version", "dir", "changed_tensors"}` |
//! | `command:CMD` | `sh -c CMD` with `WEIGHTCAST_VERSION`, `WEIGHTCAST_DIR`, `WEIGHTCAST_CHANGED` (a file listing changed tensors, one per line) |
//!
//! Downloading, verifying and writing the new version all happen before the
//! hooks run, so an engine's pause covers only its reload; the pause window is
//! measured from the pause request's answer to the resume request's answer.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::{Error, Result};

/// One hook.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hook {
    /// An SGLang server's base URL.
    Sglang(String),
    /// A vLLM OpenAI server's base URL (development endpoints enabled).
    Vllm(String),
    /// A URL that receives the event as JSON.
    Webhook(String),
    /// A shell command.
    Command(String),
}

impl std::str::FromStr for Hook {
    type Err = Error;
    fn from_str(s: &str) -> Result<Hook> {
        let (kind, arg) = s.split_once(':').ok_or_else(|| {
            Error::Config(format!(
                "hook `{s}`: expected KIND:ARG (sglang, vllm, webhook, command)"
            ))
        })?;
        let url = |a: &str| -> Result<String> {
            if a.starts_with("http://") || a.starts_with("https://") {
                Ok(a.trim_end_matches('/').to_string())
            } else {
                Err(Error::Config(format!(
                    "hook `{s}`: `{a}` is not an http(s) URL"
                )))
            }
        };
        match kind {
            "sglang" => Ok(Hook::Sglang(url(arg)?)),
            "vllm" => Ok(Hook::Vllm(url(arg)?)),
            "webhook" => Ok(Hook::Webhook(url(arg)?)),
            "command" if !arg.trim().is_empty() => Ok(Hook::Command(arg.to_string())),
            _ => Err(Error::Config(format!("hook `{s}`: unknown kind `{kind}`"))),
        }
    }
}

/// What the hooks are told.
#[derive(Clone, Debug, Serialize)]
pub struct Event {
    /// The new version.
    pub version: u64,
    /// The directory engines should load (`DIR/current`).
    pub dir: PathBuf,
    /// Tensors that changed since the previous version (empty after an anchor).
    pub changed_tensors: Vec<String>,
}

/// What running the hooks took.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// Longest engine pause among the hooks, seconds.
    pub pause_seconds: f64,
    /// Hooks that failed (their errors are logged).
    pub failed: usize,
}

/// Runs every hook in order; failures are counted and logged, not propagated
/// (the new version is already verified and in place).
pub async fn run(hooks: &[Hook], event: &Event) -> Report {
    let mut report = Report::default();
    if hooks.is_empty() {
        return report;
    }
    let client = match reqwest::Client::builder()
        .timeout(Duration::from_secs(600))
        .connect_timeout(Duration::from_secs(5))
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot build the hook client");
            report.failed = hooks.len();
            return report;
        }
    };
    for hook in hooks {
        match run_one(&client, hook, event).await {
            Ok(pause) => report.pause_seconds = report.pause_seconds.max(pause),
            Err(e) => {
                tracing::error!(?hook, error = %e, version = event.version, "hook failed");
                report.failed += 1;
            }
        }
    }
    report
}

async fn post(client: &reqwest::Client, url: &str, body: Option<serde_json::Value>) -> Result<()> {
    let mut req = client.post(url);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req
        .send()
        .await
        .map_err(|e| Error::Config(format!("POST {url}: {e}")))?;
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        return Err(Error::Config(format!(
            "POST {url}: {status}: {}",
            text.chars().take(500).collect::<String>()
        )));
    }
    Ok(())
}

/// Pauses, reloads, resumes; resumes even when the reload failed. Returns the
/// pause window in seconds.
async fn paused(
    client: &reqwest::Client,
    pause: (&str, Option<serde_json::Value>),
    reload: (&str, Option<serde_json::Value>),
    resume: (&str, Option<serde_json::Value>),
) -> Result<f64> {
    post(client, pause.0, pause.1).await?;
    let started = Instant::now();
    let reloaded = post(client, reload.0, reload.1).await;
    let resumed = post(client, resume.0, resume.1).await;
    let window = started.elapsed().as_secs_f64();
    reloaded?;
    resumed?;
    Ok(window)
}

async fn run_one(client: &reqwest::Client, hook: &Hook, event: &Event) -> Result<f64> {
    let dir = event.dir.to_string_lossy().to_string();
    match hook {
        Hook::Sglang(base) => {
            paused(
                client,
                (
                    &format!("{base}/pause_generation"),
                    Some(serde_json::json!({})),
                ),
                (
                    &format!("{base}/update_weights_from_disk"),
                    Some(serde_json::json!({ "model_path": dir })),
                ),
                (
                    &format!("{base}/continue_generation"),
                    Some(serde_json::json!({})),
                ),
            )
            .await
        }
        Hook::Vllm(base) => {
            paused(
                client,
                (&format!("{base}/pause?mode=keep"), None),
                (
                    &format!("{base}/collective_rpc"),
                    Some(serde_json::json!({ "method": "reload_weights" })),
                ),
                (&format!("{base}/resume"), None),
            )
            .await
        }
        Hook::Webhook(url) => {
            post(
                client,
                url,
                Some(serde_json::to_value(event).expect("event serializes")),
            )
            .await?;
            Ok(0.0)
        }
        Hook::Command(cmd) => {
            let list = changed_list(&event.dir, &event.changed_tensors)?;
            let status = tokio::process::Command::new("sh")
                .arg("-c")
                .arg(cmd)
                .env("WEIGHTCAST_VERSION", event.version.to_string())
                .env("WEIGHTCAST_DIR", &event.dir)
                .env("WEIGHTCAST_CHANGED", &list)
                .status()
                .await
                .map_err(|e| Error::io(format!("running hook `{cmd}`"), e))?;
            let _ = std::fs::remove_file(&list);
            if !status.success() {
                return Err(Error::Config(format!("hook `{cmd}` exited with {status}")));
            }
            Ok(0.0)
        }
    }
}

/// Writes the changed tensor names next to the output (not inside the version).
fn changed_list(dir: &Path, names: &[String]) -> Result<PathBuf> {
    let base = dir.parent().unwrap_or(dir);
    let path = base.join(".changed-tensors");
    std::fs::write(&path, names.join("\n"))
        .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse() {
        assert_eq!(
            "sglang:http://h:30000/".parse::<Hook>().unwrap(),
            Hook::Sglang("http://h:30000".into())
        );
        assert_eq!(
            "vllm:https://v".parse::<Hook>().unwrap(),
            Hook::Vllm("https://v".into())
        );
        assert_eq!(
            "command:echo hi".parse::<Hook>().unwrap(),
            Hook::Command("echo hi".into())
        );
        for bad in ["sglang", "sglang:ftp://x", "nope:http://x", "command: "] {
            assert!(bad.parse::<Hook>().is_err(), "{bad}");
        }
    }
}
