//! Engine hand-off: what runs after a subscriber switched `DIR/current` to a new
//! verified version.
//!
//! | hook | what it does |
//! |---|---|
//! | `sglang:URL` | `POST URL/pause_generation {"mode": "retract"}` (or the `--sglang-pause-mode`), `POST URL/update_weights_from_disk {"model_path": DIR/current, "weight_version": "<version>"}`, `POST URL/continue_generation` |
//! | `vllm:URL` | `POST URL/pause?mode=keep`, `POST URL/collective_rpc {"method": "reload_weights"}`, `POST URL/resume` — vLLM's development endpoints (`VLLM_SERVER_DEV_MODE=1`), with vLLM serving `--model DIR/current` |
//! | `webhook:URL` | `POST URL {"version", "dir", "changed_tensors"}` (`dir` absolute; after an anchor `changed_tensors` lists every tensor) |
//! | `command:CMD` | `sh -c CMD` with `WEIGHTCAST_VERSION`, `WEIGHTCAST_DIR`, `WEIGHTCAST_CHANGED` (a file listing changed tensors, one per line) |
//!
//! Downloading, verifying and writing the new version all happen before the
//! hooks run, so an engine's pause covers only its reload; the pause window is
//! measured from the pause request's answer to the resume request's answer.
//!
//! Each hook is retried with backoff (from 0.5 s, doubling, capped at 30 s)
//! within a total budget ([`HookPolicy`]); a 4xx answer is not retried (the
//! configuration is wrong). A failure is reported by kind ([`HookErrorKind`]);
//! the daemon then keeps the engine's previous files untouched and runs the
//! hooks again before anything else, until the engine confirms.

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

impl std::fmt::Display for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Hook::Sglang(u) => write!(f, "sglang:{u}"),
            Hook::Vllm(u) => write!(f, "vllm:{u}"),
            Hook::Webhook(u) => write!(f, "webhook:{u}"),
            Hook::Command(c) => write!(f, "command:{c}"),
        }
    }
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
    /// The directory engines should load (`DIR/current`), absolute (a
    /// relative one is taken from the working directory when the hooks run).
    pub dir: PathBuf,
    /// Tensors that changed since the previous version (after an anchor:
    /// every tensor, since any may have changed).
    pub changed_tensors: Vec<String>,
}

/// SGLang's pause modes (`POST /pause_generation {"mode": …}`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SglangPause {
    /// Abort and return every request in flight.
    Abort,
    /// Retract running requests to the waiting queue; their KV cache is
    /// recomputed — with the new weights — after `continue_generation`.
    #[default]
    Retract,
    /// Keep requests and their KV cache in place (computed with the old
    /// weights) and continue with them.
    InPlace,
}

impl std::str::FromStr for SglangPause {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "abort" => Ok(SglangPause::Abort),
            "retract" => Ok(SglangPause::Retract),
            "in_place" => Ok(SglangPause::InPlace),
            other => Err(Error::Config(format!(
                "SGLang pause mode `{other}`: expected abort, retract or in_place"
            ))),
        }
    }
}

impl SglangPause {
    fn as_str(self) -> &'static str {
        match self {
            SglangPause::Abort => "abort",
            SglangPause::Retract => "retract",
            SglangPause::InPlace => "in_place",
        }
    }
}

/// How hooks are run.
#[derive(Clone, Debug)]
pub struct HookPolicy {
    /// Per-request timeout (a reload of a large model takes minutes).
    pub timeout: Duration,
    /// Total time one hook may take, retries included; after it the hook has
    /// failed.
    pub budget: Duration,
    /// First retry delay (doubled per attempt, capped at 30 s).
    pub backoff: Duration,
    /// The pause mode sent to SGLang.
    pub sglang_pause: SglangPause,
}

impl Default for HookPolicy {
    fn default() -> Self {
        HookPolicy {
            timeout: Duration::from_secs(600),
            budget: Duration::from_secs(1800),
            backoff: Duration::from_millis(500),
            sglang_pause: SglangPause::default(),
        }
    }
}

impl HookPolicy {
    /// The default policy with the settings an embedding gives (seconds;
    /// `None` keeps the default).
    pub fn with(
        timeout: Option<f64>,
        budget: Option<f64>,
        sglang_pause: Option<&str>,
    ) -> Result<HookPolicy> {
        let d = HookPolicy::default();
        let seconds = |what: &str, v: Option<f64>, default: Duration| match v {
            None => Ok(default),
            Some(s) => Duration::try_from_secs_f64(s)
                .map_err(|_| Error::Config(format!("hook {what} {s}: not a duration in seconds"))),
        };
        Ok(HookPolicy {
            timeout: seconds("timeout", timeout, d.timeout)?,
            budget: seconds("budget", budget, d.budget)?,
            sglang_pause: match sglang_pause {
                Some(m) => m.parse()?,
                None => d.sglang_pause,
            },
            ..d
        })
    }
}

/// Why a hook failed — what the operator should look at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HookErrorKind {
    /// The engine did not accept a connection (down, wrong URL): retried.
    Unreachable,
    /// The engine did not answer within the timeout: retried.
    Timeout,
    /// The engine answered 4xx (wrong endpoint, bad request, dev mode off):
    /// not retried — fix the configuration.
    Refused,
    /// The engine answered 5xx (or 429): retried.
    EngineError,
    /// A command hook exited non-zero or could not start: retried.
    CommandFailed,
}

impl HookErrorKind {
    fn retryable(self) -> bool {
        !matches!(self, HookErrorKind::Refused)
    }
}

/// One hook's failure.
#[derive(Clone, Debug, Serialize)]
pub struct HookFailure {
    /// The hook, as configured.
    pub hook: String,
    /// What kind of failure.
    pub kind: HookErrorKind,
    /// The last error's message.
    pub message: String,
    /// Attempts made.
    pub attempts: u32,
}

/// What running the hooks took.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// Longest engine pause among the hooks, seconds.
    pub pause_seconds: f64,
    /// Hooks that failed (their errors are logged and listed).
    pub failed: usize,
    /// The failures.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<HookFailure>,
}

impl Report {
    /// A line for status and errors: the failures, or `None`.
    pub fn error(&self) -> Option<String> {
        (!self.failures.is_empty()).then(|| {
            self.failures
                .iter()
                .map(|f| {
                    format!(
                        "{} ({:?} after {} attempts): {}",
                        f.hook, f.kind, f.attempts, f.message
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        })
    }
}

/// A failed step of a hook.
#[derive(Debug)]
struct StepError {
    kind: HookErrorKind,
    message: String,
}

/// Runs every hook in order, each retried with backoff within its budget;
/// failures are reported, not propagated (the new version is already verified
/// and in place — the caller decides what an unconfirmed engine means).
pub async fn run(hooks: &[Hook], event: &Event, policy: &HookPolicy) -> Report {
    let mut report = Report::default();
    if hooks.is_empty() {
        return report;
    }
    // The directory leaves the process (a request body, the environment):
    // named by its absolute path, so an engine in another working directory
    // loads the right files.
    let absolute = Event {
        dir: std::path::absolute(&event.dir).unwrap_or_else(|_| event.dir.clone()),
        ..event.clone()
    };
    let event = &absolute;
    crate::store::install_crypto_provider();
    let client = match reqwest::Client::builder()
        .timeout(policy.timeout)
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
        let started = Instant::now();
        let mut attempts = 0u32;
        let mut delay = policy.backoff;
        loop {
            attempts += 1;
            match run_one(&client, hook, event, policy).await {
                Ok(pause) => {
                    report.pause_seconds = report.pause_seconds.max(pause);
                    if attempts > 1 {
                        tracing::info!(
                            ?hook,
                            attempts,
                            version = event.version,
                            "hook succeeded after retries"
                        );
                    }
                    break;
                }
                Err(e) => {
                    let out_of_time = started.elapsed() + delay > policy.budget;
                    if !e.kind.retryable() || out_of_time {
                        tracing::error!(?hook, kind = ?e.kind, attempts, error = %e.message, version = event.version, "hook failed");
                        report.failed += 1;
                        report.failures.push(HookFailure {
                            hook: hook.to_string(),
                            kind: e.kind,
                            message: e.message,
                            attempts,
                        });
                        break;
                    }
                    tracing::warn!(?hook, kind = ?e.kind, attempts, error = %e.message, retry_in = ?delay, "hook failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(30));
                }
            }
        }
    }
    report
}

async fn post(
    client: &reqwest::Client,
    url: &str,
    body: Option<serde_json::Value>,
) -> std::result::Result<(), StepError> {
    let mut req = client.post(url);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.map_err(|e| StepError {
        kind: if e.is_timeout() {
            HookErrorKind::Timeout
        } else {
            HookErrorKind::Unreachable
        },
        message: format!("POST {url}: {e}"),
    })?;
    let status = resp.status();
    if status.is_success() {
        return Ok(());
    }
    let text = resp.text().await.unwrap_or_default();
    let kind = if status.is_client_error() && status.as_u16() != 429 && status.as_u16() != 408 {
        HookErrorKind::Refused
    } else {
        HookErrorKind::EngineError
    };
    Err(StepError {
        kind,
        message: format!(
            "POST {url}: {status}: {}",
            text.chars().take(500).collect::<String>()
        ),
    })
}

/// Pauses, reloads, resumes; resumes even when the reload failed. Returns the
/// pause window in seconds.
async fn paused(
    client: &reqwest::Client,
    pause: (&str, Option<serde_json::Value>),
    reload: (&str, Option<serde_json::Value>),
    resume: (&str, Option<serde_json::Value>),
) -> std::result::Result<f64, StepError> {
    post(client, pause.0, pause.1).await?;
    let started = Instant::now();
    let reloaded = post(client, reload.0, reload.1).await;
    let resumed = post(client, resume.0, resume.1).await;
    let window = started.elapsed().as_secs_f64();
    reloaded?;
    resumed?;
    Ok(window)
}

async fn run_one(
    client: &reqwest::Client,
    hook: &Hook,
    event: &Event,
    policy: &HookPolicy,
) -> std::result::Result<f64, StepError> {
    let dir = event.dir.to_string_lossy().to_string();
    match hook {
        Hook::Sglang(base) => {
            paused(
                client,
                (
                    &format!("{base}/pause_generation"),
                    Some(serde_json::json!({ "mode": policy.sglang_pause.as_str() })),
                ),
                (
                    &format!("{base}/update_weights_from_disk"),
                    Some(serde_json::json!({
                        "model_path": dir,
                        "weight_version": event.version.to_string(),
                    })),
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
            let failed = |message: String| StepError {
                kind: HookErrorKind::CommandFailed,
                message,
            };
            let list = changed_list(&event.dir, &event.changed_tensors)
                .map_err(|e| failed(e.to_string()))?;
            let run = tokio::process::Command::new("sh")
                .arg("-c")
                .arg(cmd)
                .env("WEIGHTCAST_VERSION", event.version.to_string())
                .env("WEIGHTCAST_DIR", &event.dir)
                .env("WEIGHTCAST_CHANGED", &list)
                .kill_on_drop(true)
                .status();
            let status = tokio::time::timeout(policy.timeout, run).await;
            let _ = std::fs::remove_file(&list);
            match status {
                Err(_) => Err(StepError {
                    kind: HookErrorKind::Timeout,
                    message: format!("hook `{cmd}` ran longer than {:?}", policy.timeout),
                }),
                Ok(Err(e)) => Err(failed(format!("running hook `{cmd}`: {e}"))),
                Ok(Ok(s)) if !s.success() => Err(failed(format!("hook `{cmd}` exited with {s}"))),
                Ok(Ok(_)) => Ok(0.0),
            }
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
