//! Static checks of the deployment files, which nothing here can run (no
//! Docker engine, no cluster): `docker-compose.yml`, `deploy/Dockerfile`,
//! `.dockerignore`, `deploy/weightcast.env.example` and
//! `deploy/k8s/subscriber-sidecar.yaml`.
//!
//! Commands are checked with the real argument parsers: `weightcast` arguments
//! by running the built binary with them followed by `--help` (clap parses and
//! validates every argument before it, values included, and prints the help
//! only if all of them are valid), the trainer loop's with its own clap
//! definition (`examples/trainer_loop/cli.rs`, compiled in here). Then the
//! pieces must fit together: ports, `--listen` addresses, health checks and
//! probes, notify URLs, volumes, the bucket, the environment variables the
//! store and the binary really read, the shared secrets, the Dockerfile's
//! stages and paths.
//!
//! Every check is also run against deliberately broken copies of the files
//! (`*_catches_*` tests), so that a checker that accepts everything fails.

#[allow(dead_code)]
#[path = "../../examples/trainer_loop/cli.rs"]
mod trainer_cli;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use clap::{CommandFactory, FromArgMatches};
use serde::Deserialize;
use serde_norway::Value;

const COMPOSE: &str = "docker-compose.yml";
const DOCKERFILE: &str = "deploy/Dockerfile";
const DOCKERIGNORE: &str = ".dockerignore";
const ENV_EXAMPLE: &str = "deploy/weightcast.env.example";
const K8S_SIDECAR: &str = "deploy/k8s/subscriber-sidecar.yaml";

// ---------------------------------------------------------------------------
// Reading the files

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

/// One YAML document, merge keys (`<<: *anchor`) applied as Compose does.
fn yaml(text: &str, what: &str) -> Value {
    let mut v: Value =
        serde_norway::from_str(text).unwrap_or_else(|e| panic!("{what} is not YAML: {e}"));
    v.apply_merge()
        .unwrap_or_else(|e| panic!("{what}: merge keys: {e}"));
    v
}

/// Every document of a multi-document YAML file.
fn yaml_docs(text: &str, what: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(text)
        .map(|d| {
            let mut v = Value::deserialize(d).unwrap_or_else(|e| panic!("{what} is not YAML: {e}"));
            v.apply_merge()
                .unwrap_or_else(|e| panic!("{what}: merge keys: {e}"));
            v
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// A scalar as a string (YAML numbers and booleans as written).
fn scalar(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

fn strings(v: Option<&Value>) -> Option<Vec<String>> {
    v?.as_sequence()?.iter().map(scalar).collect()
}

fn keys(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_mapping)
        .map(|m| m.keys().filter_map(scalar).collect())
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------
// What the programs accept

const WEIGHTCAST: &str = env!("CARGO_BIN_EXE_weightcast");

/// What `weightcast SUBCOMMAND --help` says about required flags and the
/// environment variables behind flags.
#[derive(Clone, Debug, Default)]
struct Help {
    /// Flags the usage line lists as required.
    required: Vec<String>,
    /// Flag → environment variable.
    env: BTreeMap<String, String>,
}

fn parse_help(text: &str) -> Help {
    let mut h = Help::default();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let t = line.trim_start();
        if let Some(usage) = t.strip_prefix("Usage:") {
            h.required = usage
                .split_whitespace()
                .filter(|w| w.starts_with("--"))
                .map(str::to_string)
                .collect();
        } else if t.starts_with('-') {
            current = t
                .split([' ', ','])
                .find(|w| w.starts_with("--"))
                .map(|w| w.split('=').next().unwrap_or(w).to_string());
        }
        if let (Some(flag), Some(i)) = (&current, t.find("[env: ")) {
            let name: String = t[i + 6..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            h.env.insert(flag.clone(), name);
        }
    }
    h
}

fn run_weightcast(args: &[&str]) -> std::process::Output {
    Command::new(WEIGHTCAST)
        .args(args)
        .env_clear()
        .output()
        .expect("running the weightcast binary")
}

/// `weightcast SUBCOMMAND --help`, parsed (cached).
fn help(sub: &str) -> Help {
    static CACHE: OnceLock<Mutex<BTreeMap<String, Help>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(h) = cache.lock().unwrap().get(sub) {
        return h.clone();
    }
    let out = run_weightcast(&[sub, "--help"]);
    assert!(out.status.success(), "weightcast {sub} --help failed");
    let h = parse_help(&String::from_utf8_lossy(&out.stdout));
    cache.lock().unwrap().insert(sub.to_string(), h.clone());
    h
}

/// The subcommands the binary has (from `weightcast --help`).
fn subcommands() -> BTreeSet<String> {
    let out = run_weightcast(&["--help"]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    text.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter(|l| !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|c| c != "help")
        .collect()
}

/// Environment variables the binary reads through its flags.
fn weightcast_env() -> BTreeSet<String> {
    subcommands()
        .iter()
        .flat_map(|s| help(s).env.into_values())
        .collect()
}

/// Environment variables the trainer loop reads through its flags.
fn trainer_env() -> BTreeSet<String> {
    trainer_cli::Args::command()
        .get_arguments()
        .filter_map(|a| a.get_env().map(|e| e.to_string_lossy().to_string()))
        .collect()
}

/// Whether `name` is read by weightcast or the trainer loop: their flags'
/// variables, `RUST_LOG`, and the store variables object_store's builders take
/// from the environment (`AWS_*`, `GOOGLE_*`, `AZURE_*` whose lower-cased name
/// is one of their configuration keys; others are silently ignored there).
fn known_env(name: &str) -> bool {
    static FLAGS: OnceLock<BTreeSet<String>> = OnceLock::new();
    let flags = FLAGS.get_or_init(|| {
        let mut s = weightcast_env();
        s.extend(trainer_env());
        s
    });
    let lower = name.to_ascii_lowercase();
    flags.contains(name)
        || name == "RUST_LOG"
        || (name.starts_with("AWS_")
            && lower
                .parse::<object_store::aws::AmazonS3ConfigKey>()
                .is_ok())
        || (name.starts_with("GOOGLE_")
            && lower.parse::<object_store::gcp::GoogleConfigKey>().is_ok())
        || (name.starts_with("AZURE_")
            && lower.parse::<object_store::azure::AzureConfigKey>().is_ok())
}

/// The values of `flag` in `argv` (`--flag V` and `--flag=V`).
fn flag_values(argv: &[String], flag: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = argv.iter();
    while let Some(a) = it.next() {
        if a == flag {
            if let Some(v) = it.next() {
                out.push(v.clone());
            }
        } else if let Some(v) = a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
            out.push(v.to_string());
        }
    }
    out
}

fn flag_value(argv: &[String], flag: &str) -> Option<String> {
    flag_values(argv, flag).into_iter().next()
}

fn has_flag(argv: &[String], flag: &str) -> bool {
    argv.iter()
        .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
}

/// Checks `weightcast ARGV` with the binary's own parser; `env` are the
/// variables the process will have (they can stand in for required flags).
fn check_weightcast_argv(argv: &[String], env: &BTreeSet<String>) -> Result<(), String> {
    let Some(sub) = argv.first() else {
        return Err("no subcommand".into());
    };
    if sub.starts_with('-') || !subcommands().contains(sub) {
        return Err(format!(
            "`{sub}` is not a weightcast subcommand (known: {:?})",
            subcommands()
        ));
    }
    if argv.iter().any(|a| a == "--help" || a == "-h") {
        return Err("--help only prints the help".into());
    }
    let mut args: Vec<&str> = argv.iter().map(String::as_str).collect();
    args.push("--help");
    let out = run_weightcast(&args);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!(
            "weightcast rejects `{}`: {}",
            argv.join(" "),
            err.lines().next().unwrap_or("").trim()
        ));
    }
    let h = help(sub);
    for req in &h.required {
        let by_env = h.env.get(req).is_some_and(|e| env.contains(e));
        if !has_flag(argv, req) && !by_env {
            return Err(format!(
                "`weightcast {sub}` needs {req}{}",
                h.env
                    .get(req)
                    .map(|e| format!(" (or {e} in the environment)"))
                    .unwrap_or_default()
            ));
        }
    }
    Ok(())
}

/// Checks the trainer loop's ARGV with its clap definition; `env` are the
/// variables (with values) the process will have. The test's own environment
/// plays no part.
fn check_trainer_argv(argv: &[String], env: &BTreeMap<String, String>) -> Result<(), String> {
    let cmd = trainer_cli::Args::command();
    let mut full = vec!["trainer_loop".to_string()];
    full.extend(argv.iter().cloned());
    for a in cmd.get_arguments() {
        let (Some(var), Some(long)) = (a.get_env(), a.get_long()) else {
            continue;
        };
        let flag = format!("--{long}");
        if let Some(v) = env.get(&*var.to_string_lossy())
            && !has_flag(argv, &flag)
        {
            full.push(flag);
            full.push(v.clone());
        }
    }
    let cmd = cmd.mut_args(|a| a.env(None::<&'static str>));
    cmd.try_get_matches_from(&full)
        .and_then(|m| trainer_cli::Args::from_arg_matches(&m))
        .map(|_| ())
        .map_err(|e| {
            format!(
                "the trainer loop rejects `{}`: {}",
                argv.join(" "),
                e.to_string().lines().next().unwrap_or("").trim()
            )
        })
}

/// `http://HOST:PORT/PATH` → (host, port, path).
fn http_url(u: &str) -> Option<(String, u16, String)> {
    let rest = u.strip_prefix("http://")?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].to_string()),
        None => (rest, "/".to_string()),
    };
    let (host, port) = hostport.rsplit_once(':')?;
    Some((host.to_string(), port.parse().ok()?, path))
}

fn socket_addr(s: &str) -> Option<std::net::SocketAddr> {
    s.parse().ok()
}

fn is_loopback_host(h: &str) -> bool {
    matches!(h, "127.0.0.1" | "localhost" | "[::1]")
}

// ---------------------------------------------------------------------------
// The Dockerfile

/// One build stage.
#[derive(Debug, Default)]
struct Stage {
    name: Option<String>,
    image: String,
    /// (INSTRUCTION, arguments), continuation lines joined.
    instructions: Vec<(String, String)>,
}

/// What the final image holds.
#[derive(Debug, Default)]
struct Image {
    /// Programs copied into it (absolute paths).
    programs: BTreeSet<String>,
    /// Debian packages installed into it.
    packages: BTreeSet<String>,
    entrypoint: Vec<String>,
    /// USER's uid.
    uid: Option<u32>,
}

fn parse_dockerfile(text: &str) -> Vec<Stage> {
    let mut stages: Vec<Stage> = Vec::new();
    let mut logical = String::new();
    let mut lines = Vec::new();
    for line in text.lines() {
        let t = line.trim();
        if logical.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        if t.starts_with('#') {
            continue; // a comment inside a continued instruction
        }
        if let Some(body) = t.strip_suffix('\\') {
            logical.push_str(body);
            logical.push(' ');
        } else {
            logical.push_str(t);
            lines.push(std::mem::take(&mut logical));
        }
    }
    for l in lines {
        let (instr, args) = l.split_once(char::is_whitespace).unwrap_or((&l, ""));
        let instr = instr.to_ascii_uppercase();
        let args = args.trim().to_string();
        if instr == "FROM" {
            let w: Vec<&str> = args.split_whitespace().collect();
            let name = match w.as_slice() {
                [_, a, n] if a.eq_ignore_ascii_case("as") => Some(n.to_string()),
                _ => None,
            };
            stages.push(Stage {
                name,
                image: w.first().unwrap_or(&"").to_string(),
                instructions: Vec::new(),
            });
        } else if let Some(s) = stages.last_mut() {
            s.instructions.push((instr, args));
        }
    }
    stages
}

/// (flags, sources, destination) of a COPY.
fn copy_parts(args: &str) -> (Vec<String>, Vec<String>, String) {
    let words: Vec<String> = if args.starts_with('[') {
        serde_json::from_str(args).unwrap_or_default()
    } else {
        args.split_whitespace().map(str::to_string).collect()
    };
    let (flags, rest): (Vec<String>, Vec<String>) =
        words.into_iter().partition(|w| w.starts_with("--"));
    let mut rest = rest;
    let dest = rest.pop().unwrap_or_default();
    (flags, rest, dest)
}

fn dockerignore_patterns(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.trim_matches('/').to_string())
        .collect()
}

/// Whether a literal `.dockerignore` pattern leaves `path` out of the context.
fn ignored(path: &str, patterns: &[String]) -> bool {
    let path = path.trim_start_matches("./").trim_end_matches('/');
    patterns.iter().any(|p| {
        !p.contains(['*', '?', '[', '!']) && (path == p || path.starts_with(&format!("{p}/")))
    })
}

/// Names of the `[[bin]]` and `[[example]]` targets of Cargo.toml, and its
/// rust-version.
fn cargo_targets() -> (BTreeSet<String>, BTreeSet<String>, String) {
    let toml = read("Cargo.toml");
    let (mut bins, mut examples, mut msrv) = (BTreeSet::new(), BTreeSet::new(), String::new());
    let mut section = String::new();
    for line in toml.lines() {
        let t = line.trim();
        if t.starts_with('[') {
            section = t.to_string();
        } else if let Some(v) = t
            .strip_prefix("name = ")
            .map(|v| v.trim_matches('"').to_string())
        {
            match section.as_str() {
                "[[bin]]" => {
                    bins.insert(v);
                }
                "[[example]]" => {
                    examples.insert(v);
                }
                _ => {}
            }
        } else if let Some(v) = t.strip_prefix("rust-version = ") {
            msrv = v.trim_matches('"').to_string();
        }
    }
    for e in std::fs::read_dir(root().join("examples"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Some(stem) = e.file_name().to_str().and_then(|n| n.strip_suffix(".rs")) {
            examples.insert(stem.to_string());
        }
    }
    (bins, examples, msrv)
}

fn version_tuple(v: &str) -> Vec<u32> {
    v.split('.').map_while(|p| p.parse().ok()).collect()
}

/// Checks the Dockerfile against the repository; returns what the final image
/// holds for the compose and Kubernetes checks.
fn check_dockerfile(text: &str, dockerignore: &str, problems: &mut Vec<String>) -> Image {
    let mut p = |m: String| problems.push(format!("{DOCKERFILE}: {m}"));
    let stages = parse_dockerfile(text);
    let patterns = dockerignore_patterns(dockerignore);
    if !ignored("target", &patterns) {
        p(format!(
            "{DOCKERIGNORE} does not leave target/ out of the build context"
        ));
    }
    if stages.len() < 2 {
        p("expected a build stage and a runtime stage".into());
    }
    let (bins, examples, msrv) = cargo_targets();
    let mut image = Image::default();
    for (i, stage) in stages.iter().enumerate() {
        let last = i + 1 == stages.len();
        if let Some(v) = stage
            .image
            .strip_prefix("rust:")
            .map(|t| t.split('-').next().unwrap_or(t))
            && version_tuple(v) < version_tuple(&msrv)
        {
            p(format!(
                "{} is older than Cargo.toml's rust-version {msrv}",
                stage.image
            ));
        }
        for (instr, args) in &stage.instructions {
            match instr.as_str() {
                "COPY" | "ADD" => {
                    let (flags, sources, dest) = copy_parts(args);
                    let from = flags
                        .iter()
                        .find_map(|f| f.strip_prefix("--from="))
                        .map(str::to_string);
                    match &from {
                        Some(f) => {
                            let known = stages[..i].iter().enumerate().any(|(j, s)| {
                                s.name.as_deref() == Some(f.as_str()) || j.to_string() == *f
                            });
                            if !known {
                                p(format!("COPY --from={f}: no earlier stage of that name"));
                            }
                        }
                        None => {
                            for s in &sources {
                                if !root().join(s).exists() {
                                    p(format!("COPY {s}: no such path in the repository"));
                                } else if ignored(s, &patterns) {
                                    p(format!(
                                        "COPY {s}: left out of the context by {DOCKERIGNORE}"
                                    ));
                                }
                            }
                        }
                    }
                    if last && from.is_some() {
                        let dest = dest.trim_end_matches('/');
                        if sources.len() == 1 && !dest.is_empty() {
                            image.programs.insert(dest.to_string());
                        }
                    }
                }
                "RUN" => {
                    if args.contains("cargo build") {
                        if !args.contains("--locked") {
                            p("cargo build without --locked".into());
                        }
                        let w: Vec<String> = args.split_whitespace().map(str::to_string).collect();
                        for b in flag_values(&w, "--bin") {
                            if !bins.contains(&b) {
                                p(format!(
                                    "cargo build --bin {b}: no such [[bin]] in Cargo.toml"
                                ));
                            }
                        }
                        for e in flag_values(&w, "--example") {
                            if !examples.contains(&e) {
                                p(format!("cargo build --example {e}: no such example"));
                            }
                        }
                    }
                    if last && let Some(rest) = args.split("apt-get install").nth(1) {
                        let cmd = rest.split("&&").next().unwrap_or("");
                        image.packages.extend(
                            cmd.split_whitespace()
                                .filter(|w| !w.starts_with('-'))
                                .map(str::to_string),
                        );
                    }
                }
                "USER" if last => {
                    let uid = args.split(':').next().unwrap_or("");
                    match uid.parse::<u32>() {
                        Ok(0) => p("USER 0 is root".into()),
                        Ok(n) => image.uid = Some(n),
                        Err(_) => p(format!(
                            "USER {args}: use a numeric uid, so that Kubernetes' runAsNonRoot can check it"
                        )),
                    }
                }
                "ENTRYPOINT" if last => match serde_json::from_str::<Vec<String>>(args) {
                    Ok(e) => image.entrypoint = e,
                    Err(_) => p("ENTRYPOINT must be in exec (JSON) form".into()),
                },
                _ => {}
            }
        }
        if last {
            let small = ["slim", "distroless", "alpine", "busybox", "scratch"];
            if !small.iter().any(|s| stage.image.contains(s)) {
                p(format!(
                    "the runtime stage {} is not a small base image",
                    stage.image
                ));
            }
            if image.uid.is_none() {
                p("the runtime stage runs as root (no non-root USER)".into());
            }
        }
    }
    // The entrypoint's programs are in the image.
    if image.entrypoint.is_empty() {
        p("the runtime stage has no ENTRYPOINT".into());
    }
    let (program, _) = strip_init(&image.entrypoint);
    if let Some(prog) = program.as_deref()
        && !image.programs.contains(prog)
    {
        p(format!(
            "ENTRYPOINT runs {prog}, which the runtime stage does not copy in"
        ));
    }
    if image
        .entrypoint
        .first()
        .is_some_and(|e| e.ends_with("/tini"))
        && !image.packages.contains("tini")
    {
        p("ENTRYPOINT uses tini, which the runtime stage does not install".into());
    }
    image
}

/// Splits `[tini, --, PROGRAM, ARGS...]` (or `[PROGRAM, ARGS...]`).
fn strip_init(argv: &[String]) -> (Option<String>, Vec<String>) {
    let mut rest = argv;
    if rest
        .first()
        .is_some_and(|p| p == "tini" || p.ends_with("/tini"))
    {
        rest = &rest[1..];
        if rest.first().is_some_and(|a| a == "--") {
            rest = &rest[1..];
        }
    }
    match rest.split_first() {
        Some((p, args)) => (Some(p.clone()), args.to_vec()),
        None => (None, Vec::new()),
    }
}

fn dockerfile_image() -> Image {
    let mut problems = Vec::new();
    let image = check_dockerfile(&read(DOCKERFILE), &read(DOCKERIGNORE), &mut problems);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    image
}

// ---------------------------------------------------------------------------
// docker-compose.yml

/// What one compose service does, as far as the checks care.
#[derive(Debug, Default)]
struct Service {
    name: String,
    /// `Some(subcommand)` for weightcast, `Some("trainer")` for the trainer loop.
    program: Option<String>,
    /// Arguments after the program.
    argv: Vec<String>,
    env: BTreeMap<String, String>,
    /// (named volume or None for a bind mount, target).
    mounts: Vec<(Option<String>, String)>,
    /// Container ports of `ports:`.
    ports: Vec<u16>,
    depends: Vec<(String, String)>,
    health: Option<Vec<String>>,
    listen: Option<std::net::SocketAddr>,
    profiles: bool,
}

fn compose_env(svc: &Value) -> BTreeMap<String, String> {
    match svc.get("environment") {
        Some(Value::Mapping(m)) => m
            .iter()
            .filter_map(|(k, v)| Some((scalar(k)?, scalar(v).unwrap_or_default())))
            .collect(),
        Some(Value::Sequence(s)) => s
            .iter()
            .filter_map(scalar)
            .map(|kv| match kv.split_once('=') {
                Some((k, v)) => (k.to_string(), v.to_string()),
                None => (kv, String::new()),
            })
            .collect(),
        _ => BTreeMap::new(),
    }
}

fn compose_mounts(svc: &Value) -> Vec<(Option<String>, String)> {
    let mut out = Vec::new();
    for v in svc
        .get("volumes")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
    {
        let (source, target) = match v {
            Value::String(s) => {
                let mut parts = s.splitn(3, ':');
                let a = parts.next().unwrap_or("").to_string();
                match parts.next() {
                    Some(t) => (Some(a), t.to_string()),
                    None => (None, a), // anonymous volume
                }
            }
            Value::Mapping(_) => (
                v.get("source").and_then(scalar),
                v.get("target").and_then(scalar).unwrap_or_default(),
            ),
            _ => continue,
        };
        let named =
            source.filter(|s| !(s.starts_with('.') || s.starts_with('/') || s.starts_with('~')));
        out.push((named, target));
    }
    out
}

fn compose_ports(svc: &Value, problems: &mut Vec<String>, name: &str) -> Vec<u16> {
    let mut out = Vec::new();
    for v in svc
        .get("ports")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
    {
        let target = match v {
            Value::Mapping(_) => v.get("target").and_then(scalar),
            other => scalar(other).map(|s| {
                let s = s.split('/').next().unwrap_or("").to_string();
                s.rsplit(':').next().unwrap_or("").to_string()
            }),
        };
        match target.as_deref().map(str::parse::<u16>) {
            Some(Ok(p)) => out.push(p),
            _ => problems.push(format!("{COMPOSE}: {name}: cannot read the port {v:?}")),
        }
    }
    out
}

fn compose_depends(svc: &Value) -> Vec<(String, String)> {
    match svc.get("depends_on") {
        Some(Value::Sequence(s)) => s
            .iter()
            .filter_map(scalar)
            .map(|n| (n, "service_started".to_string()))
            .collect(),
        Some(Value::Mapping(m)) => m
            .iter()
            .filter_map(|(k, v)| {
                Some((
                    scalar(k)?,
                    v.get("condition")
                        .and_then(scalar)
                        .unwrap_or_else(|| "service_started".into()),
                ))
            })
            .collect(),
        _ => Vec::new(),
    }
}

fn compose_health(svc: &Value) -> Option<Vec<String>> {
    let t = svc.get("healthcheck")?;
    if t.get("disable").and_then(Value::as_bool) == Some(true) {
        return None;
    }
    let test = match t.get("test")? {
        Value::String(s) => vec!["CMD-SHELL".to_string(), s.clone()],
        v => strings(Some(v))?,
    };
    (test.first().map(String::as_str) != Some("NONE")).then_some(test)
}

/// Compose interpolates `$VAR` and `${VAR}` from the host; `$$` is a literal `$`.
fn unescape_compose(s: &str, ctx: &str, problems: &mut Vec<String>) -> String {
    let mut out = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '$' {
            if chars.peek() == Some(&'$') {
                chars.next();
            } else {
                problems.push(format!(
                    "{COMPOSE}: {ctx}: `{s}` has a `$` that compose interpolates from the host (write `$$`)"
                ));
            }
        }
        out.push(c);
    }
    out
}

fn is_weightcast_service(svc: &Value) -> bool {
    let dockerfile = svc
        .get("build")
        .and_then(|b| b.get("dockerfile"))
        .and_then(scalar);
    dockerfile.as_deref() == Some(DOCKERFILE)
        || svc
            .get("image")
            .and_then(scalar)
            .is_some_and(|i| i.starts_with("weightcast"))
}

fn check_compose(doc: &Value, image: &Image) -> Vec<String> {
    let mut problems = Vec::new();
    let mut p = |m: String| problems.push(format!("{COMPOSE}: {m}"));
    let Some(services) = doc.get("services").and_then(Value::as_mapping) else {
        return vec![format!("{COMPOSE}: no services")];
    };
    let declared: BTreeSet<String> = keys(doc.get("volumes")).into_iter().collect();

    let mut svcs: Vec<Service> = Vec::new();
    let mut sub_problems = Vec::new();
    for (k, v) in services {
        let name = scalar(k).unwrap_or_default();
        let mut s = Service {
            name: name.clone(),
            env: compose_env(v),
            mounts: compose_mounts(v),
            ports: compose_ports(v, &mut sub_problems, &name),
            depends: compose_depends(v),
            health: compose_health(v),
            profiles: v.get("profiles").is_some(),
            ..Default::default()
        };
        if let Some(img) = v.get("image").and_then(scalar)
            && v.get("build").is_none()
        {
            let tag = img.rsplit_once(':').map(|(_, t)| t).unwrap_or("");
            if tag.is_empty() || tag == "latest" || tag.contains('/') {
                p(format!("{name}: pin the image {img} to a release"));
            }
        }
        if is_weightcast_service(v) {
            let command = match v.get("command") {
                Some(Value::Sequence(_)) => strings(v.get("command")).unwrap_or_default(),
                Some(_) => {
                    p(format!("{name}: write `command` as a list (exec form)"));
                    Vec::new()
                }
                None => Vec::new(),
            };
            let command: Vec<String> = command
                .iter()
                .map(|a| unescape_compose(a, &name, &mut sub_problems))
                .collect();
            let entrypoint = match v.get("entrypoint") {
                Some(e) => strings(Some(e)).unwrap_or_else(|| {
                    p(format!("{name}: write `entrypoint` as a list (exec form)"));
                    Vec::new()
                }),
                None => image.entrypoint.clone(),
            };
            let (program, mut argv) = strip_init(&entrypoint);
            argv.extend(command);
            let program = program.unwrap_or_default();
            if !image.programs.contains(&program) {
                p(format!(
                    "{name}: runs {program}, which the image does not have (it has {:?})",
                    image.programs
                ));
            }
            let env_names: BTreeSet<String> = s.env.keys().cloned().collect();
            for e in &env_names {
                if !known_env(e) {
                    p(format!(
                        "{name}: environment variable {e} is read by neither weightcast nor its store"
                    ));
                }
            }
            match program.rsplit('/').next().unwrap_or("") {
                "weightcast" => {
                    if let Err(e) = check_weightcast_argv(&argv, &env_names) {
                        p(format!("{name}: {e}"));
                    }
                    s.program = argv.first().cloned();
                }
                "weightcast-trainer-loop" => {
                    if let Err(e) = check_trainer_argv(&argv, &s.env) {
                        p(format!("{name}: {e}"));
                    }
                    s.program = Some("trainer".into());
                }
                other => p(format!("{name}: unknown program {other}")),
            }
            if let Some(l) = flag_value(&argv, "--listen") {
                s.listen = socket_addr(&l);
            }
            s.argv = argv;
        }
        svcs.push(s);
    }
    problems.append(&mut sub_problems);
    let mut p = |m: String| problems.push(format!("{COMPOSE}: {m}"));
    let by_name = |n: &str| svcs.iter().find(|s| s.name == n);

    // depends_on, one-shot services, health checks.
    let mut one_shot: BTreeSet<String> = BTreeSet::new();
    for s in &svcs {
        for (d, cond) in &s.depends {
            match by_name(d) {
                None => p(format!("{}: depends on an unknown service {d}", s.name)),
                Some(t) => match cond.as_str() {
                    "service_started" => {}
                    "service_healthy" if t.health.is_none() => p(format!(
                        "{}: waits for {d} to be healthy, which has no health check",
                        s.name
                    )),
                    "service_healthy" => {}
                    "service_completed_successfully" => {
                        one_shot.insert(d.clone());
                    }
                    other => p(format!("{}: unknown depends_on condition {other}", s.name)),
                },
            }
        }
    }
    for s in &svcs {
        if s.health.is_none() && !one_shot.contains(&s.name) && !s.profiles {
            p(format!(
                "{}: a long-running service without a health check",
                s.name
            ));
        }
    }

    // Volumes.
    let mut used = BTreeSet::new();
    for s in &svcs {
        for (named, target) in &s.mounts {
            if let Some(v) = named {
                used.insert(v.clone());
                if !declared.contains(v) {
                    p(format!(
                        "{}: volume {v} is not declared under the top-level volumes",
                        s.name
                    ));
                }
            }
            if !target.starts_with('/') {
                p(format!("{}: mount target {target} is not absolute", s.name));
            }
        }
    }
    for v in declared.difference(&used) {
        p(format!("volume {v} is declared but no service mounts it"));
    }

    // Listening, ports, health checks of the weightcast services.
    for s in svcs.iter().filter(|s| s.program.is_some()) {
        let listen_port = s.listen.map(|a| a.port());
        if let Some(a) = s.listen
            && !a.ip().is_unspecified()
        {
            p(format!(
                "{}: --listen {a} is unreachable from other containers and the host (use 0.0.0.0)",
                s.name
            ));
        }
        for port in &s.ports {
            if Some(*port) != listen_port {
                p(format!(
                    "{}: publishes container port {port}, but it listens on {:?}",
                    s.name, s.listen
                ));
            }
        }
        if let Some(test) = &s.health {
            let words: Vec<&str> = test.iter().flat_map(|t| t.split_whitespace()).collect();
            let tool = words.iter().skip(1).find(|w| ["curl", "wget"].contains(w));
            if let Some(tool) = tool
                && !image.packages.contains(*tool)
                && !image.packages.contains("busybox-static")
            {
                p(format!(
                    "{}: the health check uses {tool}, which the image does not install",
                    s.name
                ));
            }
            let urls: Vec<&str> = words
                .iter()
                .map(|w| w.trim_matches(['"', '\'']))
                .filter(|w| w.starts_with("http://"))
                .collect();
            if let Some(port) = listen_port {
                if urls.is_empty() {
                    p(format!(
                        "{}: the health check does not ask /healthz",
                        s.name
                    ));
                }
                for u in urls {
                    match http_url(u) {
                        Some((h, pt, path))
                            if is_loopback_host(&h) && pt == port && path == "/healthz" => {}
                        _ => p(format!(
                            "{}: health check {u} is not http://127.0.0.1:{port}/healthz",
                            s.name
                        )),
                    }
                }
            }
        }
        // Data directories live on volumes.
        let on_volume = |dir: &str| {
            s.mounts
                .iter()
                .any(|(_, t)| Path::new(dir).starts_with(Path::new(t)))
        };
        for flag in ["--out", "--state", "--checkpoint-root", "--dir"] {
            if let Some(dir) = flag_value(&s.argv, flag)
                && !on_volume(&dir)
            {
                p(format!("{}: {flag} {dir} is not on a volume", s.name));
            }
        }
    }

    // Trainer → publisher.
    for t in svcs
        .iter()
        .filter(|s| s.program.as_deref() == Some("trainer"))
    {
        let url = flag_value(&t.argv, "--publisher").unwrap_or_default();
        let Some((host, port, _)) = http_url(&url) else {
            p(format!(
                "{}: --publisher {url} is not http://SERVICE:PORT",
                t.name
            ));
            continue;
        };
        let Some(publ) = by_name(&host).filter(|s| s.program.as_deref() == Some("publisher"))
        else {
            p(format!(
                "{}: --publisher {url}: {host} is not a publisher service",
                t.name
            ));
            continue;
        };
        if publ.listen.map(|a| a.port()) != Some(port) {
            p(format!(
                "{}: --publisher {url}, but {host} listens on {:?}",
                t.name, publ.listen
            ));
        }
        if !t.depends.iter().any(|(d, _)| *d == host) {
            p(format!("{}: does not depend on {host}", t.name));
        }
        let token = |s: &Service| {
            flag_value(&s.argv, "--token").or_else(|| s.env.get("WEIGHTCAST_API_TOKEN").cloned())
        };
        if token(t).is_none() || token(t) != token(publ) {
            p(format!("{}: its token differs from {host}'s", t.name));
        }
        // The checkpoint directory is the same volume at the same path on both sides.
        let dir = flag_value(&t.argv, "--dir").unwrap_or_default();
        let root_dir = flag_value(&publ.argv, "--checkpoint-root").unwrap_or_default();
        if !Path::new(&dir).starts_with(&root_dir) {
            p(format!(
                "{}: --dir {dir} is not under {host}'s --checkpoint-root {root_dir}",
                t.name
            ));
        }
        let mount_of = |s: &Service, d: &str| {
            s.mounts
                .iter()
                .filter(|(_, tg)| Path::new(d).starts_with(tg))
                .max_by_key(|(_, tg)| tg.len())
                .cloned()
        };
        match (mount_of(t, &dir), mount_of(publ, &dir)) {
            (Some((Some(a), ta)), Some((Some(b), tb))) if a == b && ta == tb => {}
            (a, b) => p(format!(
                "{}: --dir {dir} must be the same named volume at the same path in {host} (trainer: {a:?}, publisher: {b:?})",
                t.name
            )),
        }
    }

    // Subscribers: notify URLs, ids.
    let mut ids = BTreeSet::new();
    for s in svcs
        .iter()
        .filter(|s| s.program.as_deref() == Some("subscribe"))
    {
        if let Some(id) = flag_value(&s.argv, "--id")
            && (!weightcast::protocol::registry::valid_id(&id) || !ids.insert(id.clone()))
        {
            p(format!("{}: --id {id} is invalid or used twice", s.name));
        }
        if let Some(adv) = flag_value(&s.argv, "--advertise") {
            match (http_url(&adv), s.listen) {
                (Some((h, pt, path)), Some(l))
                    if h == s.name && pt == l.port() && path == "/v1/notify" => {}
                _ => p(format!(
                    "{}: --advertise {adv} is not http://{}:<--listen port>/v1/notify",
                    s.name, s.name
                )),
            }
        } else if has_flag(&s.argv, "--id") && s.listen.is_some() {
            p(format!(
                "{}: registers without --advertise, so publishers would notify http://0.0.0.0:...",
                s.name
            ));
        }
    }

    // One store, reachable, created; one notify key.
    let store_of = |s: &Service| {
        flag_value(&s.argv, "--store").or_else(|| s.env.get("WEIGHTCAST_STORE").cloned())
    };
    let stores: BTreeSet<String> = svcs.iter().filter_map(store_of).collect();
    if stores.len() != 1 {
        p(format!(
            "the services should share one store, they use {stores:?}"
        ));
    }
    for s in svcs.iter().filter(|s| store_of(s).is_some()) {
        let store = store_of(s).unwrap_or_default();
        let Some(bucket) = store
            .strip_prefix("s3://")
            .map(|r| r.split('/').next().unwrap_or(""))
        else {
            continue;
        };
        let endpoint = s.env.get("AWS_ENDPOINT").cloned().unwrap_or_default();
        match http_url(&endpoint) {
            Some((host, port, _)) => match by_name(&host) {
                Some(t) if t.ports.contains(&port) => {
                    let creds = [
                        ("AWS_ACCESS_KEY_ID", "MINIO_ROOT_USER"),
                        ("AWS_SECRET_ACCESS_KEY", "MINIO_ROOT_PASSWORD"),
                    ];
                    for (ours, theirs) in creds {
                        if !s.env.contains_key(ours) {
                            p(format!("{}: {ours} is not set", s.name));
                        } else if t.env.contains_key(theirs) && s.env.get(ours) != t.env.get(theirs)
                        {
                            p(format!("{}: {ours} differs from {host}'s {theirs}", s.name));
                        }
                    }
                }
                _ => p(format!(
                    "{}: AWS_ENDPOINT {endpoint} is not a port of a compose service",
                    s.name
                )),
            },
            None => p(format!(
                "{}: AWS_ENDPOINT {endpoint:?} is not http://SERVICE:PORT",
                s.name
            )),
        }
        let makers: Vec<&str> = services
            .iter()
            .filter(|(_, v)| {
                let text = format!("{:?}", v.get("command"));
                text.contains("mc mb") && text.contains(&format!("/{bucket}"))
            })
            .filter_map(|(k, _)| k.as_str())
            .collect();
        if makers.is_empty() {
            p(format!("no service creates the bucket {bucket}"));
        }
        // Directly, or through a service that does.
        let mut waits = BTreeSet::new();
        let mut stack = vec![s.name.clone()];
        while let Some(n) = stack.pop() {
            for (d, cond) in by_name(&n).map(|x| x.depends.clone()).unwrap_or_default() {
                if cond != "service_started" && waits.insert(d.clone()) {
                    stack.push(d);
                }
            }
        }
        if !makers.iter().any(|m| waits.contains(*m)) {
            p(format!(
                "{}: does not wait for the bucket {bucket} to be created",
                s.name
            ));
        }
    }
    let key_of = |s: &Service| {
        flag_value(&s.argv, "--notify-key").or_else(|| s.env.get("WEIGHTCAST_NOTIFY_KEY").cloned())
    };
    let notified: Vec<&Service> = svcs
        .iter()
        .filter(|s| {
            s.program.as_deref() == Some("publisher")
                || (s.program.as_deref() == Some("subscribe") && has_flag(&s.argv, "--id"))
        })
        .collect();
    let keys: BTreeSet<Option<String>> = notified.iter().map(|s| key_of(s)).collect();
    if keys.len() > 1 || keys.iter().any(|k| k.as_ref().is_none_or(|k| k.len() < 16)) {
        p(format!(
            "the publisher and the registered subscribers need one notify key of 16+ characters ({} different)",
            keys.len()
        ));
    }
    let mut seen = BTreeSet::new();
    problems.retain(|p| seen.insert(p.clone()));
    problems
}

// ---------------------------------------------------------------------------
// Kubernetes

fn k8s_container_env(
    c: &Value,
    objects: &BTreeMap<(String, String), BTreeMap<String, String>>,
    ctx: &str,
    problems: &mut Vec<String>,
) -> (BTreeMap<String, String>, BTreeSet<String>) {
    // name → value (placeholders for downward-API fields); explicit names.
    let mut env = BTreeMap::new();
    let mut explicit = BTreeSet::new();
    for src in c
        .get("envFrom")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
    {
        for (field, kind) in [("configMapRef", "ConfigMap"), ("secretRef", "Secret")] {
            if let Some(name) = src.get(field).and_then(|r| r.get("name")).and_then(scalar) {
                match objects.get(&(kind.to_string(), name.clone())) {
                    Some(data) => env.extend(data.clone()),
                    None => {
                        problems.push(format!("{ctx}: envFrom {kind} {name} is not in the file"))
                    }
                }
            }
        }
    }
    for e in c
        .get("env")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
    {
        let Some(name) = e.get("name").and_then(scalar) else {
            continue;
        };
        explicit.insert(name.clone());
        let value = if let Some(v) = e.get("value").and_then(scalar) {
            v
        } else if let Some(vf) = e.get("valueFrom") {
            if let Some(f) = vf
                .get("fieldRef")
                .and_then(|f| f.get("fieldPath"))
                .and_then(scalar)
            {
                match f.as_str() {
                    "status.podIP" => "10.1.2.3".into(),
                    "metadata.name" => "rollout-5d8f7c9b4-x2x7q".into(),
                    _ => "placeholder".into(),
                }
            } else {
                let mut found = None;
                for (field, kind) in [("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")]
                {
                    if let Some(r) = vf.get(field) {
                        let n = r.get("name").and_then(scalar).unwrap_or_default();
                        let k = r.get("key").and_then(scalar).unwrap_or_default();
                        match objects
                            .get(&(kind.to_string(), n.clone()))
                            .and_then(|d| d.get(&k))
                        {
                            Some(v) => found = Some(v.clone()),
                            None => problems.push(format!(
                                "{ctx}: env {name}: {kind} {n} with key {k} is not in the file"
                            )),
                        }
                    }
                }
                found.unwrap_or_default()
            }
        } else {
            String::new()
        };
        env.insert(name, value);
    }
    (env, explicit)
}

/// Replaces Kubernetes' `$(VAR)` references with the variables' values.
fn k8s_expand(
    s: &str,
    env: &BTreeMap<String, String>,
    ctx: &str,
    problems: &mut Vec<String>,
) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("$(") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        match after.find(')') {
            Some(j) => {
                let var = &after[..j];
                match env.get(var) {
                    Some(v) => out.push_str(v),
                    None => {
                        problems.push(format!(
                            "{ctx}: $({var}) is not a variable of the container"
                        ));
                        out.push_str(&rest[i..i + 2 + j + 1]);
                    }
                }
                rest = &after[j + 1..];
            }
            None => {
                out.push_str(&rest[i..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// The port number a probe's `port` names.
fn probe_port(c: &Value, probe: &str) -> Option<(u16, String)> {
    let hg = c.get(probe)?.get("httpGet")?;
    let path = hg.get("path").and_then(scalar).unwrap_or_default();
    let port = match hg.get("port")? {
        Value::Number(n) => n.as_u64()? as u16,
        Value::String(name) => c
            .get("ports")?
            .as_sequence()?
            .iter()
            .find(|p| p.get("name").and_then(scalar).as_deref() == Some(name.as_str()))?
            .get("containerPort")?
            .as_u64()? as u16,
        _ => return None,
    };
    Some((port, path))
}

fn container_ports(c: &Value) -> Vec<u16> {
    c.get("ports")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
        .filter_map(|p| p.get("containerPort").and_then(Value::as_u64))
        .map(|p| p as u16)
        .collect()
}

fn mount_for(c: &Value, dir: &str) -> Option<(String, String)> {
    c.get("volumeMounts")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
        .filter_map(|m| {
            Some((
                m.get("name").and_then(scalar)?,
                m.get("mountPath").and_then(scalar)?,
            ))
        })
        .filter(|(_, path)| Path::new(dir).starts_with(path))
        .max_by_key(|(_, path)| path.len())
}

fn check_k8s(docs: &[Value], image: &Image, file: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let mut objects: BTreeMap<(String, String), BTreeMap<String, String>> = BTreeMap::new();
    for d in docs {
        let kind = d.get("kind").and_then(scalar).unwrap_or_default();
        let name = d
            .get("metadata")
            .and_then(|m| m.get("name"))
            .and_then(scalar)
            .unwrap_or_default();
        if kind == "Secret" || kind == "ConfigMap" {
            let mut data = BTreeMap::new();
            for field in ["data", "stringData"] {
                if let Some(m) = d.get(field).and_then(Value::as_mapping) {
                    for (k, v) in m {
                        data.insert(scalar(k).unwrap_or_default(), scalar(v).unwrap_or_default());
                    }
                }
            }
            for k in data.keys() {
                if !known_env(k) {
                    problems.push(format!(
                        "{file}: {kind} {name}: {k} is read by neither weightcast nor its store"
                    ));
                }
            }
            objects.insert((kind, name), data);
        }
    }
    let mut pods = 0;
    for d in docs {
        let kind = d.get("kind").and_then(scalar).unwrap_or_default();
        let spec = match kind.as_str() {
            "Deployment" | "StatefulSet" | "DaemonSet" | "Job" => d
                .get("spec")
                .and_then(|s| s.get("template"))
                .and_then(|t| t.get("spec")),
            "Pod" => d.get("spec"),
            _ => None,
        };
        let Some(spec) = spec else { continue };
        pods += 1;
        if let Some(sel) = d
            .get("spec")
            .and_then(|s| s.get("selector"))
            .and_then(|s| s.get("matchLabels"))
        {
            let labels = d
                .get("spec")
                .and_then(|s| s.get("template"))
                .and_then(|t| t.get("metadata"))
                .and_then(|m| m.get("labels"));
            for (k, v) in sel.as_mapping().into_iter().flatten() {
                if labels.and_then(|l| l.get(k)) != Some(v) {
                    problems.push(format!(
                        "{file}: {kind}: the selector does not match the pod labels"
                    ));
                }
            }
        }
        let volumes: BTreeMap<String, Value> = spec
            .get("volumes")
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
            .filter_map(|v| Some((v.get("name").and_then(scalar)?, v.clone())))
            .collect();
        let init = spec
            .get("initContainers")
            .and_then(Value::as_sequence)
            .cloned()
            .unwrap_or_default();
        let main = spec
            .get("containers")
            .and_then(Value::as_sequence)
            .cloned()
            .unwrap_or_default();
        let all: Vec<(bool, &Value)> = init
            .iter()
            .map(|c| (true, c))
            .chain(main.iter().map(|c| (false, c)))
            .collect();
        let mut outs = BTreeSet::new();
        let mut sidecars = 0;
        for (is_init, c) in &all {
            let cname = c.get("name").and_then(scalar).unwrap_or_default();
            let ctx = format!("{file}: container {cname}");
            for m in c
                .get("volumeMounts")
                .and_then(Value::as_sequence)
                .into_iter()
                .flatten()
            {
                let n = m.get("name").and_then(scalar).unwrap_or_default();
                if !volumes.contains_key(&n) {
                    problems.push(format!("{ctx}: mounts an undeclared volume {n}"));
                }
            }
            let req = c.get("resources").and_then(|r| r.get("requests"));
            if req.and_then(|r| r.get("cpu")).is_none()
                || req.and_then(|r| r.get("memory")).is_none()
            {
                problems.push(format!("{ctx}: no cpu and memory requests"));
            }
            let (env, explicit) = k8s_container_env(c, &objects, &ctx, &mut problems);
            let img = c.get("image").and_then(scalar).unwrap_or_default();
            if !img.contains("weightcast") {
                continue;
            }
            // A weightcast container.
            let sc = c.get("securityContext");
            if sc
                .and_then(|s| s.get("runAsNonRoot"))
                .and_then(Value::as_bool)
                != Some(true)
            {
                problems.push(format!("{ctx}: set securityContext.runAsNonRoot"));
            }
            if let Some(u) = sc.and_then(|s| s.get("runAsUser")).and_then(Value::as_u64)
                && Some(u as u32) != image.uid
            {
                problems.push(format!(
                    "{ctx}: runAsUser {u} is not the image's user {:?}",
                    image.uid
                ));
            }
            if c.get("command").is_some() {
                problems.push(format!("{ctx}: leave `command` to the image's entrypoint"));
            }
            let raw = strings(c.get("args")).unwrap_or_default();
            let referenced: BTreeSet<String> = raw
                .iter()
                .flat_map(|a| {
                    a.split("$(")
                        .skip(1)
                        .filter_map(|r| r.split(')').next())
                        .map(str::to_string)
                        .collect::<Vec<_>>()
                })
                .collect();
            for e in env.keys() {
                if !(known_env(e) || explicit.contains(e) && referenced.contains(e)) {
                    problems.push(format!(
                        "{ctx}: environment variable {e} is read by neither weightcast nor its store"
                    ));
                }
            }
            let argv: Vec<String> = raw
                .iter()
                .map(|a| k8s_expand(a, &env, &ctx, &mut problems))
                .collect();
            let env_names: BTreeSet<String> = env.keys().cloned().collect();
            if let Err(e) = check_weightcast_argv(&argv, &env_names) {
                problems.push(format!("{ctx}: {e}"));
                continue;
            }
            if argv.first().map(String::as_str) != Some("subscribe") {
                continue;
            }
            let out = flag_value(&argv, "--out").unwrap_or_default();
            outs.insert(out.clone());
            let Some((vol, out_mount)) = mount_for(c, &out) else {
                problems.push(format!("{ctx}: --out {out} is not on a volume"));
                continue;
            };
            if volumes.get(&vol).and_then(|v| v.get("emptyDir")).is_none() {
                problems.push(format!(
                    "{ctx}: --out {out} should be on an emptyDir shared with the engine"
                ));
            }
            if *is_init || has_flag(&argv, "--once") {
                if !*is_init {
                    problems.push(format!("{ctx}: a sidecar with --once exits"));
                }
                continue;
            }
            sidecars += 1;
            let listen = flag_value(&argv, "--listen").and_then(|l| socket_addr(&l));
            let Some(listen) = listen else {
                problems.push(format!("{ctx}: the sidecar needs --listen for its probes"));
                continue;
            };
            if !container_ports(c).contains(&listen.port()) {
                problems.push(format!(
                    "{ctx}: containerPort {} is not declared",
                    listen.port()
                ));
            }
            for probe in ["readinessProbe", "livenessProbe"] {
                match probe_port(c, probe) {
                    Some((port, path)) if port == listen.port() && path == "/healthz" => {}
                    other => problems.push(format!(
                        "{ctx}: {probe} should be httpGet /healthz on {} (found {other:?})",
                        listen.port()
                    )),
                }
            }
            if let Some(adv) = flag_value(&argv, "--advertise") {
                match http_url(&adv) {
                    Some((_, pt, path)) if pt == listen.port() && path == "/v1/notify" => {}
                    _ => problems.push(format!(
                        "{ctx}: --advertise {adv} is not <pod>:{}/v1/notify",
                        listen.port()
                    )),
                }
            }
            if let Some(id) = flag_value(&argv, "--id")
                && !weightcast::protocol::registry::valid_id(&id)
            {
                problems.push(format!("{ctx}: --id {id} is not a valid registration id"));
            }
            let hooks = flag_values(&argv, "--hook");
            if hooks.is_empty() {
                problems.push(format!(
                    "{ctx}: no --hook tells the engine about new versions"
                ));
            }
            for hook in hooks {
                let Some((kind, url)) = hook.split_once(':') else {
                    continue;
                };
                if kind != "vllm" && kind != "sglang" {
                    continue;
                }
                let engine = http_url(url).and_then(|(h, port, _)| {
                    is_loopback_host(&h).then_some(())?;
                    main.iter()
                        .find(|e| !std::ptr::eq(*e, *c) && container_ports(e).contains(&port))
                });
                let Some(engine) = engine else {
                    problems.push(format!(
                        "{ctx}: --hook {hook} does not reach a container of the pod on localhost"
                    ));
                    continue;
                };
                let ename = engine.get("name").and_then(scalar).unwrap_or_default();
                match mount_for(engine, &out) {
                    Some((v, path)) if v == vol && path == out_mount => {}
                    _ => problems.push(format!(
                        "{ctx}: {ename} must mount volume {vol} at {out_mount}, where --out is"
                    )),
                }
                let mut words = strings(engine.get("command")).unwrap_or_default();
                words.extend(strings(engine.get("args")).unwrap_or_default());
                let model = format!("{}/current", out.trim_end_matches('/'));
                if !words.contains(&model) {
                    problems.push(format!("{ctx}: {ename} does not serve {model}"));
                }
                if kind == "vllm" {
                    let dev = engine
                        .get("env")
                        .and_then(Value::as_sequence)
                        .into_iter()
                        .flatten()
                        .any(|e| {
                            e.get("name").and_then(scalar).as_deref()
                                == Some("VLLM_SERVER_DEV_MODE")
                                && e.get("value").and_then(scalar).as_deref() == Some("1")
                        });
                    if !dev {
                        problems.push(format!(
                            "{ctx}: {ename} needs VLLM_SERVER_DEV_MODE=1 for the vllm hook's endpoints"
                        ));
                    }
                }
            }
        }
        if sidecars == 0 {
            problems.push(format!("{file}: {kind}: no weightcast subscriber sidecar"));
        }
        if outs.len() > 1 {
            problems.push(format!(
                "{file}: {kind}: the weightcast containers use different --out {outs:?}"
            ));
        }
    }
    if pods == 0 {
        problems.push(format!("{file}: no workload"));
    }
    problems
}

// ---------------------------------------------------------------------------
// The env example

fn check_env_example(text: &str) -> Vec<String> {
    let mut problems = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        match t.split_once('=') {
            Some((k, _)) if known_env(k.trim()) => {}
            Some((k, _)) => problems.push(format!(
                "{ENV_EXAMPLE}:{}: {k} is read by neither weightcast nor its store",
                i + 1
            )),
            None => problems.push(format!("{ENV_EXAMPLE}:{}: not NAME=VALUE", i + 1)),
        }
    }
    problems
}

// ---------------------------------------------------------------------------
// The real files

fn assert_clean(problems: Vec<String>) {
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[test]
fn dockerfile_and_dockerignore() {
    let mut problems = Vec::new();
    let image = check_dockerfile(&read(DOCKERFILE), &read(DOCKERIGNORE), &mut problems);
    assert_clean(problems);
    assert!(
        image.programs.contains("/usr/local/bin/weightcast"),
        "{image:?}"
    );
    assert!(image.packages.contains("ca-certificates"), "{image:?}");
}

#[test]
fn compose_file() {
    let image = dockerfile_image();
    let doc = yaml(&read(COMPOSE), COMPOSE);
    assert_clean(check_compose(&doc, &image));
    // What the issue asks for: MinIO, a publisher driven by a trainer, two subscribers.
    let services = keys(doc.get("services"));
    for s in [
        "minio",
        "create-bucket",
        "publisher",
        "trainer",
        "subscriber-a",
        "subscriber-b",
    ] {
        assert!(services.iter().any(|x| x == s), "no service {s}");
    }
}

#[test]
fn kubernetes_sidecar() {
    let image = dockerfile_image();
    let docs = yaml_docs(&read(K8S_SIDECAR), K8S_SIDECAR);
    assert_clean(check_k8s(&docs, &image, K8S_SIDECAR));
    let kinds: Vec<String> = docs
        .iter()
        .filter_map(|d| d.get("kind").and_then(scalar))
        .collect();
    for k in ["Secret", "Deployment"] {
        assert!(kinds.iter().any(|x| x == k), "no {k} in {K8S_SIDECAR}");
    }
}

#[test]
fn env_example() {
    assert_clean(check_env_example(&read(ENV_EXAMPLE)));
}

// ---------------------------------------------------------------------------
// The checkers catch mistakes

fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

#[test]
fn argument_checks_use_the_real_parsers() {
    let none = BTreeSet::new();
    let ok = args(&[
        "subscribe",
        "--store",
        "s3://b/p",
        "--out",
        "/w",
        "--listen",
        "0.0.0.0:1",
    ]);
    check_weightcast_argv(&ok, &none).unwrap();
    for (bad, why) in [
        (
            vec![
                "subscribe",
                "--store",
                "s3://b",
                "--out",
                "/w",
                "--lisen",
                "0.0.0.0:1",
            ],
            "--lisen",
        ),
        (
            vec![
                "subscribe",
                "--store",
                "s3://b",
                "--out",
                "/w",
                "--listen",
                "nowhere",
            ],
            "nowhere",
        ),
        (
            vec![
                "subscribe",
                "--store",
                "s3://b",
                "--out",
                "/w",
                "--hook",
                "ollama:http://x",
            ],
            "ollama",
        ),
        (vec!["subscribe", "--store", "s3://b"], "--out"),
        (vec!["subscribe", "--out", "/w"], "WEIGHTCAST_STORE"),
        (vec!["subscribbe", "--out", "/w"], "subscribbe"),
        (vec!["--version"], "--version"),
        (vec![], "no subcommand"),
    ] {
        let e = check_weightcast_argv(&args(&bad), &none).unwrap_err();
        assert!(e.contains(why), "{bad:?}: {e}");
    }
    // A required flag may come from its environment variable.
    let env: BTreeSet<String> = ["WEIGHTCAST_STORE".to_string()].into();
    check_weightcast_argv(&args(&["subscribe", "--out", "/w"]), &env).unwrap();

    let token: BTreeMap<String, String> = [(
        "WEIGHTCAST_API_TOKEN".to_string(),
        "0123456789abcdef".to_string(),
    )]
    .into();
    check_trainer_argv(&args(&["--dir", "/c"]), &token).unwrap();
    for (bad, env) in [
        (vec!["--dir", "/c", "--intervall", "3"], token.clone()),
        (vec!["--dir", "/c", "--interval", "-3"], token.clone()),
        (
            vec!["--dir", "/c", "--publisher", "publisher:8470"],
            token.clone(),
        ),
        (vec!["--dir", "/c"], BTreeMap::new()),
    ] {
        assert!(
            check_trainer_argv(&args(&bad), &env).is_err(),
            "{bad:?} {env:?}"
        );
    }
    assert!(
        known_env("AWS_ENDPOINT") && known_env("AWS_ALLOW_HTTP") && known_env("WEIGHTCAST_STORE")
    );
    assert!(!known_env("AWS_ENDPOINT_URI") && !known_env("WEIGHTCAST_STOR") && !known_env("HOME"));
}

/// `docker-compose.yml`, changed by `f`, must draw a problem containing `want`.
fn compose_catches(want: &str, f: impl FnOnce(&mut Value)) {
    let image = dockerfile_image();
    let mut doc = yaml(&read(COMPOSE), COMPOSE);
    f(&mut doc);
    let problems = check_compose(&doc, &image);
    assert!(
        problems.iter().any(|p| p.contains(want)),
        "expected a problem about `{want}`, got {problems:#?}"
    );
}

fn service<'a>(doc: &'a mut Value, name: &str) -> &'a mut Value {
    doc.get_mut("services")
        .and_then(|s| s.get_mut(name))
        .expect("service")
}

fn set_arg(svc: &mut Value, from: &str, to: &str) {
    let cmd = svc
        .get_mut("command")
        .and_then(Value::as_sequence_mut)
        .expect("command");
    let i = cmd
        .iter()
        .position(|a| a.as_str() == Some(from))
        .expect("argument");
    cmd[i] = Value::String(to.into());
}

#[test]
fn compose_checker_catches_mistakes() {
    compose_catches("--lisen", |d| {
        set_arg(service(d, "subscriber-a"), "--listen", "--lisen")
    });
    compose_catches("--intervall", |d| {
        set_arg(service(d, "trainer"), "--interval", "--intervall")
    });
    compose_catches("needs --out", |d| {
        let cmd = service(d, "subscriber-b")
            .get_mut("command")
            .and_then(Value::as_sequence_mut)
            .unwrap();
        let i = cmd
            .iter()
            .position(|a| a.as_str() == Some("--out"))
            .unwrap();
        cmd.drain(i..i + 2);
    });
    compose_catches("health check", |d| {
        let hc = service(d, "subscriber-b").get_mut("healthcheck").unwrap();
        hc["test"][5] = Value::String("http://127.0.0.1:8481/healthz".into());
    });
    compose_catches("publishes container port 8480", |d| {
        service(d, "subscriber-a")["ports"][0] = Value::String("127.0.0.1:8481:8480".into());
    });
    compose_catches("unreachable", |d| {
        set_arg(service(d, "subscriber-a"), "0.0.0.0:8481", "127.0.0.1:8481")
    });
    compose_catches("is not declared", |d| {
        service(d, "publisher")["volumes"][0] =
            Value::String("checkpoint:/var/lib/weightcast/checkpoints".into());
    });
    compose_catches("unknown service", |d| {
        let dep = service(d, "trainer")
            .get_mut("depends_on")
            .and_then(Value::as_mapping_mut)
            .unwrap();
        let v = dep.remove("publisher").unwrap();
        dep.insert(Value::String("publisher-daemon".into()), v);
    });
    compose_catches("AWS_ENDPONT", |d| {
        let env = service(d, "subscriber-a")
            .get_mut("environment")
            .and_then(Value::as_mapping_mut)
            .unwrap();
        let v = env.remove("AWS_ENDPOINT").unwrap();
        env.insert(Value::String("AWS_ENDPONT".into()), v);
    });
    compose_catches("notify key", |d| {
        service(d, "subscriber-b")["environment"]["WEIGHTCAST_NOTIFY_KEY"] =
            Value::String("another-key-of-enough-length".into());
    });
    compose_catches("listens on", |d| {
        set_arg(
            service(d, "trainer"),
            "http://publisher:8470",
            "http://publisher:8471",
        )
    });
    compose_catches("token differs", |d| {
        service(d, "trainer")["environment"]["WEIGHTCAST_API_TOKEN"] =
            Value::String("another-token-of-enough-length".into());
    });
    compose_catches("--advertise", |d| {
        set_arg(
            service(d, "subscriber-a"),
            "http://subscriber-a:8481/v1/notify",
            "http://subscriber-b:8481/v1/notify",
        )
    });
    compose_catches("without a health check", |d| {
        service(d, "subscriber-a")
            .as_mapping_mut()
            .unwrap()
            .remove("healthcheck");
    });
    compose_catches("interpolates", |d| {
        let cmd = service(d, "subscriber-a")
            .get_mut("command")
            .and_then(Value::as_sequence_mut)
            .unwrap();
        let last = cmd.len() - 1;
        cmd[last] = Value::String("command:echo $WEIGHTCAST_VERSION".into());
    });
    compose_catches("share one store", |d| {
        set_arg(
            service(d, "subscriber-b"),
            "s3://weights/policy",
            "s3://weights/other",
        )
    });
    compose_catches("creates the bucket", |d| {
        service(d, "create-bucket")["command"][0] = Value::String(
            "mc alias set local http://minio:9000 minioadmin minioadmin && mc mb local/other"
                .into(),
        );
    });
}

#[test]
fn dockerfile_checker_catches_mistakes() {
    let good = read(DOCKERFILE);
    let ignore = read(DOCKERIGNORE);
    for (from, to, want) in [
        (
            "COPY examples ./examples",
            "COPY exemples ./examples",
            "exemples",
        ),
        ("USER 10001:10001", "USER weightcast", "numeric"),
        ("USER 10001:10001", "USER 0", "root"),
        (
            "--example trainer_loop",
            "--example trainer_lop",
            "trainer_lop",
        ),
        ("COPY --from=build", "COPY --from=builder", "--from=builder"),
        ("FROM debian:bookworm-slim", "FROM debian:bookworm", "small"),
        ("ca-certificates curl tini", "ca-certificates curl", "tini"),
    ] {
        assert!(good.contains(from), "{from}");
        let mut problems = Vec::new();
        check_dockerfile(&good.replacen(from, to, 1), &ignore, &mut problems);
        assert!(
            problems.iter().any(|p| p.contains(want)),
            "{to}: {problems:#?}"
        );
    }
    let mut problems = Vec::new();
    check_dockerfile(&good, &format!("{ignore}\nexamples\n"), &mut problems);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("left out of the context")),
        "{problems:#?}"
    );
    let mut problems = Vec::new();
    check_dockerfile(&good, "", &mut problems);
    assert!(
        problems.iter().any(|p| p.contains("target/")),
        "{problems:#?}"
    );

    // A compose health check with curl needs curl in the image.
    let mut problems = Vec::new();
    let image = check_dockerfile(
        &good.replacen("ca-certificates curl tini", "ca-certificates tini", 1),
        &ignore,
        &mut problems,
    );
    let doc = yaml(&read(COMPOSE), COMPOSE);
    assert!(
        check_compose(&doc, &image)
            .iter()
            .any(|p| p.contains("uses curl"))
    );
}

#[test]
fn kubernetes_checker_catches_mistakes() {
    let image = dockerfile_image();
    let good = read(K8S_SIDECAR);
    for (from, to, want) in [
        (
            "- --poll-interval\n",
            "- --poll-intervall\n",
            "--poll-intervall",
        ),
        (
            "vllm:http://127.0.0.1:8000",
            "vllm:http://127.0.0.1:8001",
            "--hook",
        ),
        (
            "http://$(POD_IP):8480/v1/notify",
            "http://$(POD_ADDR):8480/v1/notify",
            "POD_ADDR",
        ),
        (
            "port: weightcast\n            periodSeconds: 10",
            "port: 8481\n            periodSeconds: 10",
            "readinessProbe",
        ),
        (
            "path: /healthz\n              port: weightcast\n            periodSeconds: 20",
            "path: /metrics\n              port: weightcast\n            periodSeconds: 20",
            "livenessProbe",
        ),
        (
            "            - secretRef:\n                name: weightcast\n          ports",
            "            - secretRef:\n                name: weightcast-s3\n          ports",
            "weightcast-s3",
        ),
        (
            "  WEIGHTCAST_STORE: s3://weights/policy",
            "  WEIGHTCAST_STOR: s3://weights/policy",
            "WEIGHTCAST_STOR",
        ),
        (
            "      value: \"1\"",
            "      value: \"0\"",
            "VLLM_SERVER_DEV_MODE",
        ),
        (
            "            - /weights/current",
            "            - /models/policy",
            "does not serve",
        ),
        ("cpu: \"4\"", "gpu: \"4\"", "requests"),
        (
            "runAsUser: 10001\n            runAsGroup: 10001\n            allowPrivilegeEscalation: false\n            readOnlyRootFilesystem: true\n          # 1x",
            "runAsUser: 1000\n            runAsGroup: 10001\n            allowPrivilegeEscalation: false\n            readOnlyRootFilesystem: true\n          # 1x",
            "runAsUser 1000",
        ),
        (
            "            - name: weights\n              mountPath: /weights\n              readOnly: true",
            "            - name: weights\n              mountPath: /model\n              readOnly: true",
            "must mount volume weights",
        ),
    ] {
        assert!(good.contains(from), "{from}");
        let docs = yaml_docs(&good.replacen(from, to, 1), K8S_SIDECAR);
        let problems = check_k8s(&docs, &image, K8S_SIDECAR);
        assert!(
            problems.iter().any(|p| p.contains(want)),
            "{to}: {problems:#?}"
        );
    }
}

#[test]
fn env_example_checker_catches_mistakes() {
    let good = read(ENV_EXAMPLE);
    let bad = good.replacen("AWS_ALLOW_HTTP=", "AWS_ALLOW_INSECURE=", 1);
    assert!(
        check_env_example(&bad)
            .iter()
            .any(|p| p.contains("AWS_ALLOW_INSECURE"))
    );
    assert!(
        check_env_example("WEIGHTCAST_NOTIFYKEY=x\n")
            .iter()
            .any(|p| p.contains("NOTIFYKEY"))
    );
}

#[test]
fn help_parser_reads_required_flags_and_env() {
    let h = help("publisher");
    for f in ["--token", "--checkpoint-root", "--store"] {
        assert!(h.required.iter().any(|r| r == f), "{h:?}");
    }
    assert_eq!(
        h.env.get("--token").map(String::as_str),
        Some("WEIGHTCAST_API_TOKEN")
    );
    assert_eq!(
        h.env.get("--store").map(String::as_str),
        Some("WEIGHTCAST_STORE")
    );
    assert!(weightcast_env().contains("WEIGHTCAST_NOTIFY_KEY"));
    assert!(trainer_env().contains("WEIGHTCAST_API_TOKEN"));
}
