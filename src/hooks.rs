//! Engine hand-off: what runs after a subscriber switched `DIR/current` to a new
//! verified version.
//!
//! | hook | what it does |
//! |---|---|
//! | `sglang:URL` | `POST URL/pause_generation {"mode": "abort"}` (or the `--sglang-pause-mode`), `POST URL/update_weights_from_disk {"model_path": DIR/current, "weight_version": "<version>", "flush_cache": <true after abort, false after retract/in_place>}`, `POST URL/continue_generation` |
//! | `vllm:URL` | `GET URL/openapi.json` (does `/pause` have `mode=keep`?), `POST URL/pause?mode=keep` (or `mode=wait&wait_for_inflight_requests=true` where keep is unknown or missing, never abort unless asked), `POST URL/collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR/current}}` (DIR absolute), `POST URL/resume` — vLLM's development endpoints (`VLLM_SERVER_DEV_MODE=1`) |
//! | `webhook:URL` | `POST URL {"version", "dir", "changed_tensors"}` (`dir` absolute; after an anchor `changed_tensors` lists every tensor) |
//! | `command:CMD` | `sh -c CMD` with `WEIGHTCAST_VERSION`, `WEIGHTCAST_DIR`, `WEIGHTCAST_CHANGED` (a file listing changed tensors, one per line) |
//!
//! An engine's answer `{"success": false, ...}` (SGLang's refused update,
//! with any status) is a failure like a 4xx: the engine keeps the version it
//! had, so the new one is not reported as served and the hook is owed again.
//! `--api-key` servers: the bearer token comes from `WEIGHTCAST_VLLM_API_KEY`
//! / `WEIGHTCAST_SGLANG_API_KEY` ([`HookPolicy::vllm_api_key`],
//! [`HookPolicy::sglang_api_key`]).
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
///
/// SGLang's scheduler asserts that the cache flush after a weight update
/// succeeds, and the flush refuses while requests are queued or running: a
/// `retract` pause leaves them in the waiting queue and `in_place` in the
/// running batch, so `flush_cache: true` after either kills the scheduler
/// with requests in flight (SGLang #20296, `flush_cache_after_weight_update`
/// in `srt/managers/scheduler_update_weights_mixin.py`). The hook therefore
/// sends `flush_cache: true` only after `abort` (the default: nothing is left
/// in flight, the radix cache is rebuilt with the new weights) and
/// `flush_cache: false` after `retract`/`in_place` (requests survive; cached
/// prefixes keep KV computed with the old weights until evicted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SglangPause {
    /// Abort and return every request in flight; the update flushes the
    /// cache (`flush_cache: true`).
    #[default]
    Abort,
    /// Retract running requests to the waiting queue; they are recomputed
    /// after `continue_generation`. The update does not flush the cache.
    Retract,
    /// Keep requests and their KV cache in place (computed with the old
    /// weights) and continue with them. The update does not flush the cache.
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

    /// Whether the update may flush SGLang's cache after this pause: only
    /// when nothing is left in flight (see the type).
    fn flush_cache(self) -> bool {
        self == SglangPause::Abort
    }
}

/// vLLM's pause modes (`POST /pause?mode=…`).
///
/// vLLM servers before the `mode` parameter (vLLM PR #32351) ignore it and
/// abort every request in flight, so `mode=keep` is sent only to a server
/// whose OpenAPI schema (`GET /openapi.json`) lists it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VllmPause {
    /// `keep` where the server's schema lists it, else `wait` (never abort).
    #[default]
    Auto,
    /// Freeze requests in flight; they continue after `/resume`. Refused
    /// (not silently aborted) on a server whose schema lacks it; sent as
    /// asked when the schema cannot be read.
    Keep,
    /// Let requests in flight finish before pausing (also understood by
    /// servers before `mode`, as `wait_for_inflight_requests=true`).
    Wait,
    /// Abort requests in flight.
    Abort,
}

impl std::str::FromStr for VllmPause {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(VllmPause::Auto),
            "keep" => Ok(VllmPause::Keep),
            "wait" => Ok(VllmPause::Wait),
            "abort" => Ok(VllmPause::Abort),
            other => Err(Error::Config(format!(
                "vLLM pause mode `{other}`: expected auto, keep, wait or abort"
            ))),
        }
    }
}

/// The environment variable holding the bearer token for `vllm:` hooks
/// (vLLM started with `--api-key`).
pub const VLLM_API_KEY_ENV: &str = "WEIGHTCAST_VLLM_API_KEY";
/// The environment variable holding the bearer token for `sglang:` hooks
/// (SGLang started with `--api-key` or `--admin-api-key`).
pub const SGLANG_API_KEY_ENV: &str = "WEIGHTCAST_SGLANG_API_KEY";

/// An API key sent as `Authorization: Bearer KEY`; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// The key, `None` when empty.
    pub fn new(key: impl Into<String>) -> Option<ApiKey> {
        let key = key.into();
        (!key.trim().is_empty()).then(|| ApiKey(key.trim().to_string()))
    }

    /// The key in the environment variable `var`, if set and not empty.
    pub fn from_env(var: &str) -> Option<ApiKey> {
        std::env::var(var).ok().and_then(ApiKey::new)
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
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
    /// The pause mode sent to SGLang (and with it `flush_cache`).
    pub sglang_pause: SglangPause,
    /// The pause mode sent to vLLM.
    pub vllm_pause: VllmPause,
    /// Bearer token for `vllm:` hooks (the CLI reads [`VLLM_API_KEY_ENV`]).
    pub vllm_api_key: Option<ApiKey>,
    /// Bearer token for `sglang:` hooks (the CLI reads [`SGLANG_API_KEY_ENV`]).
    pub sglang_api_key: Option<ApiKey>,
}

impl Default for HookPolicy {
    fn default() -> Self {
        HookPolicy {
            timeout: Duration::from_secs(600),
            budget: Duration::from_secs(1800),
            backoff: Duration::from_millis(500),
            sglang_pause: SglangPause::default(),
            vllm_pause: VllmPause::default(),
            vllm_api_key: None,
            sglang_api_key: None,
        }
    }
}

impl HookPolicy {
    /// The default policy with the settings an embedding gives (seconds;
    /// `None` keeps the default), the API keys from [`VLLM_API_KEY_ENV`] and
    /// [`SGLANG_API_KEY_ENV`].
    pub fn with(
        timeout: Option<f64>,
        budget: Option<f64>,
        sglang_pause: Option<&str>,
        vllm_pause: Option<&str>,
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
            vllm_pause: match vllm_pause {
                Some(m) => m.parse()?,
                None => d.vllm_pause,
            },
            vllm_api_key: ApiKey::from_env(VLLM_API_KEY_ENV),
            sglang_api_key: ApiKey::from_env(SGLANG_API_KEY_ENV),
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
    /// The engine answered 4xx (wrong endpoint, bad request, dev mode off,
    /// API key), or refused the update (`{"success": false}`, e.g. SGLang
    /// could not load the files): not retried within this run; the hooks
    /// are owed again before the next version.
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

/// Who a request goes to: the bearer token to send and where it comes from
/// (named in errors).
#[derive(Clone, Copy)]
struct Auth<'a> {
    key: Option<&'a ApiKey>,
    env: &'static str,
}

impl Auth<'_> {
    const NONE: Auth<'static> = Auth { key: None, env: "" };

    fn apply(self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match self.key {
            Some(k) => req.bearer_auth(&k.0),
            None => req,
        }
    }

    /// What to do about a 401/403.
    fn hint(self, status: reqwest::StatusCode) -> String {
        if !matches!(status.as_u16(), 401 | 403) || self.env.is_empty() {
            return String::new();
        }
        match self.key {
            None => format!(
                " (the engine requires an API key: set {} to the key it was started with)",
                self.env
            ),
            Some(_) => format!(" (the key in {} was not accepted)", self.env),
        }
    }
}

fn send_error(method: &str, url: &str, e: reqwest::Error) -> StepError {
    StepError {
        kind: if e.is_timeout() {
            HookErrorKind::Timeout
        } else {
            HookErrorKind::Unreachable
        },
        message: format!("{method} {url}: {e}"),
    }
}

fn status_error(
    method: &str,
    url: &str,
    status: reqwest::StatusCode,
    text: &str,
    auth: Auth<'_>,
) -> StepError {
    let kind = if status.is_client_error() && status.as_u16() != 429 && status.as_u16() != 408 {
        HookErrorKind::Refused
    } else {
        HookErrorKind::EngineError
    };
    StepError {
        kind,
        message: format!(
            "{method} {url}: {status}: {}{}",
            text.chars().take(500).collect::<String>(),
            auth.hint(status)
        ),
    }
}

/// An answer `{"success": false, "message": …}`: the engine refused (SGLang
/// answers a failed weight update so, with 400 or, behind some proxies, 200).
fn refusal(text: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    if v.get("success")? != &serde_json::Value::Bool(false) {
        return None;
    }
    Some(match v.get("message") {
        Some(serde_json::Value::String(m)) => m.clone(),
        Some(m) => m.to_string(),
        None => text.chars().take(500).collect(),
    })
}

async fn post(
    client: &reqwest::Client,
    url: &str,
    body: Option<serde_json::Value>,
    auth: Auth<'_>,
) -> std::result::Result<(), StepError> {
    let mut req = auth.apply(client.post(url));
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.map_err(|e| send_error("POST", url, e))?;
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    if let Some(message) = refusal(&text) {
        return Err(StepError {
            kind: HookErrorKind::Refused,
            message: format!("POST {url}: {status}: the engine refused: {message}"),
        });
    }
    if status.is_success() {
        return Ok(());
    }
    Err(status_error("POST", url, status, &text, auth))
}

/// Pauses, reloads, resumes; resumes even when the reload failed. Returns the
/// pause window in seconds.
async fn paused(
    client: &reqwest::Client,
    auth: Auth<'_>,
    pause: (&str, Option<serde_json::Value>),
    reload: (&str, Option<serde_json::Value>),
    resume: (&str, Option<serde_json::Value>),
) -> std::result::Result<f64, StepError> {
    post(client, pause.0, pause.1, auth).await?;
    let started = Instant::now();
    let reloaded = post(client, reload.0, reload.1, auth).await;
    let resumed = post(client, resume.0, resume.1, auth).await;
    let window = started.elapsed().as_secs_f64();
    reloaded?;
    resumed?;
    Ok(window)
}

/// What a vLLM server's OpenAPI schema says about `POST /pause`.
#[derive(Debug, PartialEq, Eq)]
enum PauseSchema {
    /// A `mode` query parameter that admits `keep`.
    Keep,
    /// `/pause` without `mode=keep` (a server from before vLLM PR #32351:
    /// an unknown `mode` is ignored and requests are aborted).
    NoKeep,
    /// No `/pause`: the development endpoints are off.
    NoPause,
}

fn pause_schema(openapi: &serde_json::Value) -> PauseSchema {
    let Some(op) = openapi.pointer("/paths/~1pause/post") else {
        return PauseSchema::NoPause;
    };
    let mode = op
        .get("parameters")
        .and_then(|p| p.as_array())
        .and_then(|ps| ps.iter().find(|p| p["name"] == "mode"));
    match mode {
        Some(p) if admits(openapi, &p["schema"], "keep", 0) => PauseSchema::Keep,
        _ => PauseSchema::NoKeep,
    }
}

/// Whether a JSON schema (following `$ref`s into the document) lists `value`
/// (as an `enum` member or a `const`).
fn admits(root: &serde_json::Value, schema: &serde_json::Value, value: &str, depth: u32) -> bool {
    use serde_json::Value;
    if depth > 8 {
        return false;
    }
    match schema {
        Value::Object(m) => {
            let by_ref = m
                .get("$ref")
                .and_then(|r| r.as_str())
                .and_then(|r| r.strip_prefix('#'))
                .and_then(|p| root.pointer(p));
            if by_ref.is_some_and(|target| admits(root, target, value, depth + 1)) {
                return true;
            }
            if m.get("const").and_then(|c| c.as_str()) == Some(value) {
                return true;
            }
            let listed = m.get("enum").and_then(|e| e.as_array());
            if listed.is_some_and(|e| e.iter().any(|x| x.as_str() == Some(value))) {
                return true;
            }
            ["anyOf", "oneOf", "allOf"].iter().any(|k| {
                m.get(*k)
                    .and_then(|a| a.as_array())
                    .is_some_and(|a| a.iter().any(|s| admits(root, s, value, depth + 1)))
            })
        }
        _ => false,
    }
}

/// The `/pause` URL for `wanted` on the vLLM server at `base`: `mode=keep`
/// only where the server's schema lists it (or it is asked for and the
/// schema cannot be read), `wait` otherwise — never a silent abort.
async fn vllm_pause_url(
    client: &reqwest::Client,
    base: &str,
    wanted: VllmPause,
    auth: Auth<'_>,
) -> std::result::Result<String, StepError> {
    // `wait_for_inflight_requests=true` is what a server before `mode`
    // understands; newer ones take it as `mode=wait` too.
    let wait = format!("{base}/pause?mode=wait&wait_for_inflight_requests=true");
    match wanted {
        VllmPause::Abort => return Ok(format!("{base}/pause?mode=abort")),
        VllmPause::Wait => return Ok(wait),
        VllmPause::Auto | VllmPause::Keep => {}
    }
    let keep = format!("{base}/pause?mode=keep");
    let url = format!("{base}/openapi.json");
    let resp = auth
        .apply(client.get(&url))
        .send()
        .await
        .map_err(|e| send_error("GET", &url, e))?;
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    if matches!(status.as_u16(), 401 | 403) {
        return Err(status_error("GET", &url, status, &text, auth));
    }
    let unknown = |why: String| {
        if wanted == VllmPause::Keep {
            tracing::warn!(
                url,
                why,
                "cannot check that vLLM has /pause?mode=keep; sending it as configured"
            );
            Ok(keep.clone())
        } else {
            tracing::warn!(
                url,
                why,
                "cannot tell whether vLLM has /pause?mode=keep (a server without it aborts requests \
                 in flight): pausing with mode=wait; set the vLLM pause mode to keep to send it anyway"
            );
            Ok(wait.clone())
        }
    };
    if !status.is_success() {
        return unknown(format!(
            "{status} (a server started with --disable-fastapi-docs has no schema)"
        ));
    }
    let Ok(schema) = serde_json::from_str::<serde_json::Value>(&text) else {
        return unknown("the answer is not JSON".into());
    };
    match pause_schema(&schema) {
        PauseSchema::Keep => Ok(keep),
        PauseSchema::NoPause => Err(StepError {
            kind: HookErrorKind::Refused,
            message: format!(
                "vLLM at {base} has no POST /pause (its {url} lists none): start it with \
                 VLLM_SERVER_DEV_MODE=1, which enables /pause, /collective_rpc and /resume"
            ),
        }),
        PauseSchema::NoKeep if wanted == VllmPause::Keep => Err(StepError {
            kind: HookErrorKind::Refused,
            message: format!(
                "vLLM at {base} has no /pause?mode=keep (its {url} lists no keep mode; such a \
                 server ignores `mode` and aborts requests in flight): set the vLLM pause mode to \
                 auto or wait, or upgrade vLLM"
            ),
        }),
        PauseSchema::NoKeep => {
            tracing::info!(
                base,
                "this vLLM has no /pause?mode=keep: pausing with mode=wait"
            );
            Ok(wait)
        }
    }
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
            let auth = Auth {
                key: policy.sglang_api_key.as_ref(),
                env: SGLANG_API_KEY_ENV,
            };
            paused(
                client,
                auth,
                (
                    &format!("{base}/pause_generation"),
                    Some(serde_json::json!({ "mode": policy.sglang_pause.as_str() })),
                ),
                (
                    &format!("{base}/update_weights_from_disk"),
                    Some(serde_json::json!({
                        "model_path": dir,
                        "weight_version": event.version.to_string(),
                        "flush_cache": policy.sglang_pause.flush_cache(),
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
            let auth = Auth {
                key: policy.vllm_api_key.as_ref(),
                env: VLLM_API_KEY_ENV,
            };
            let pause = vllm_pause_url(client, base, policy.vllm_pause, auth).await?;
            paused(
                client,
                auth,
                (&pause, None),
                (
                    &format!("{base}/collective_rpc"),
                    Some(serde_json::json!({
                        "method": "reload_weights",
                        "kwargs": { "weights_path": dir },
                    })),
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
                Auth::NONE,
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
    #[test]
    fn vllm_pause_schema() {
        let param = |schema: serde_json::Value| {
            serde_json::json!({ "paths": { "/pause": { "post": { "parameters": [
                { "name": "wait_for_inflight_requests", "in": "query", "schema": { "type": "boolean" } },
                { "name": "mode", "in": "query", "schema": schema },
            ] } } } })
        };
        // FastAPI inlines a Literal as an enum; a named one is a $ref.
        let inline =
            param(serde_json::json!({ "enum": ["abort", "wait", "keep"], "type": "string" }));
        assert_eq!(pause_schema(&inline), PauseSchema::Keep);
        let mut by_ref = param(serde_json::json!({ "$ref": "#/components/schemas/PauseMode" }));
        by_ref["components"] = serde_json::json!({ "schemas": { "PauseMode": {
            "anyOf": [{ "const": "abort" }, { "const": "wait" }, { "const": "keep" }] } } });
        assert_eq!(pause_schema(&by_ref), PauseSchema::Keep);
        let no_keep = param(serde_json::json!({ "enum": ["abort", "wait"] }));
        assert_eq!(pause_schema(&no_keep), PauseSchema::NoKeep);
        // vLLM PR #28037's /pause: no `mode` at all.
        let old = serde_json::json!({ "paths": { "/pause": { "post": { "parameters": [
            { "name": "wait_for_inflight_requests", "in": "query", "schema": { "type": "boolean" } },
            { "name": "clear_cache", "in": "query", "schema": { "type": "boolean" } },
        ] } } } });
        assert_eq!(pause_schema(&old), PauseSchema::NoKeep);
        let dev_off = serde_json::json!({ "paths": { "/v1/completions": {} } });
        assert_eq!(pause_schema(&dev_off), PauseSchema::NoPause);
    }

    #[test]
    fn refusals_and_keys() {
        assert_eq!(
            refusal(r#"{"success": false, "message": "Failed to load"}"#).as_deref(),
            Some("Failed to load")
        );
        assert_eq!(refusal(r#"{"success": true, "message": "ok"}"#), None);
        assert_eq!(refusal(r#"{"status": "paused"}"#), None);
        assert_eq!(refusal("Internal Server Error"), None);
        let key = ApiKey::new(" s3cret ").unwrap();
        assert!(!format!("{key:?}").contains("s3cret"));
        assert!(ApiKey::new("  ").is_none());
        assert_eq!("keep".parse::<VllmPause>().unwrap(), VllmPause::Keep);
        assert!("nope".parse::<VllmPause>().is_err());
        assert!(SglangPause::Abort.flush_cache());
        assert!(!SglangPause::Retract.flush_cache() && !SglangPause::InPlace.flush_cache());
        assert_eq!(SglangPause::default(), SglangPause::Abort);
    }
}
