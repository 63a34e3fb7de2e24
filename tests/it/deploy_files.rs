//! What only this project can check in its deployment files. Their syntax and
//! schemas are checked by real tools in `deploy/check.sh` (`docker compose
//! config`, `kubernetes-validate`, `hadolint`); here:
//!
//! - every command line that runs `weightcast` (compose `command:`, Kubernetes
//!   `args:`, the Dockerfile's `ENTRYPOINT`) goes through the binary's own
//!   parser (the arguments followed by `--help`), the trainer loop's through
//!   its clap definition (`examples/trainer_loop/cli.rs`, compiled in here),
//!   and every variable set for them is one weightcast, its store or the
//!   trainer loop reads;
//! - the facts that span services and files: ports, `--listen` addresses,
//!   health checks and probes, notify URLs, tokens and keys, the store, pinned
//!   images, what the image holds and the paths its build needs.
//!
//! Compose is read as Compose resolves it: the model `docker compose config
//! --format json` prints (interpolation, merge keys, `$$`), from the binary
//! `DOCKER_COMPOSE` names (scripts/test.sh installs it). Every check also runs
//! on a deliberately broken copy (`*_catches_mistakes`).

#[allow(dead_code)]
#[path = "../../examples/trainer_loop/cli.rs"]
mod trainer_cli;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use clap::{CommandFactory, FromArgMatches};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::docs_flags::{command_paths, help_text, parses};

const COMPOSE: &str = "docker-compose.yml";
const DOCKERFILE: &str = "deploy/Dockerfile";
const ENV_EXAMPLE: &str = "deploy/weightcast.env.example";
const K8S: &str = "deploy/k8s/subscriber-sidecar.yaml";

/// Records a problem: `bad! {problems, "format", args...}` (in braces, which
/// rustfmt leaves alone, so that each message stays on one line).
macro_rules! bad {
    ($problems:expr, $($fmt:tt)*) => { $problems.push(format!($($fmt)*)) };
}

fn read(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(_) | Value::Bool(_) => Some(v.to_string()),
        _ => None,
    }
}

fn items(v: &Value) -> impl Iterator<Item = &Value> {
    v.as_array().into_iter().flatten()
}

fn texts(v: &Value) -> Vec<String> {
    items(v).filter_map(text).collect()
}

/// `name → value` of a mapping (`environment:`, `data:`).
fn pairs(v: &Value) -> BTreeMap<String, String> {
    let map = v.as_object().into_iter().flatten();
    map.map(|(k, v)| (k.clone(), text(v).unwrap_or_default()))
        .collect()
}

fn args(line: &str) -> Vec<String> {
    line.split_whitespace().map(str::to_string).collect()
}

/// The values of `flag` in `argv` (`--flag V` and `--flag=V`).
fn values(argv: &[String], flag: &str) -> Vec<String> {
    let eq = format!("{flag}=");
    let each = argv
        .iter()
        .enumerate()
        .filter_map(|(i, a)| match a.strip_prefix(&eq) {
            Some(v) => Some(v.to_string()),
            None => argv.get(i + 1).filter(|_| a == flag).cloned(),
        });
    each.collect()
}

fn value(argv: &[String], flag: &str) -> Option<String> {
    values(argv, flag).into_iter().next()
}

/// `http://HOST:PORT/PATH` → (host, port, path).
fn http_url(u: &str) -> Option<(String, u64, String)> {
    let rest = u.strip_prefix("http://")?;
    let (hostport, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let (host, port) = hostport.rsplit_once(':')?;
    Some((host.to_string(), port.parse().ok()?, path.to_string()))
}

fn listen_port(argv: &[String]) -> Option<u64> {
    let addr: std::net::SocketAddr = value(argv, "--listen")?.parse().ok()?;
    Some(addr.port().into())
}

/// An image reference pinned to a release: a tag, and not `latest`.
fn pinned(image: &str) -> bool {
    let name = image.split('@').next().unwrap_or(image);
    let tag = name.rsplit_once(':').map_or("", |(_, t)| t);
    !tag.is_empty() && !tag.contains('/') && tag != "latest"
}

// ---------------------------------------------------------------------------
// What the programs accept

/// Per command (`publish`, `bench codec`): the flags its usage line requires,
/// and the variable behind each flag (`[env: X]`), from its `--help`.
type Cli = BTreeMap<String, (Vec<String>, BTreeMap<String, String>)>;

fn cli() -> &'static Cli {
    static CLI: OnceLock<Cli> = OnceLock::new();
    CLI.get_or_init(|| {
        let mut cli = Cli::new();
        for path in command_paths() {
            let (mut required, mut env, mut flag) = (Vec::new(), BTreeMap::new(), None);
            for line in help_text(&path).lines().map(str::trim_start) {
                if let Some(usage) = line.strip_prefix("Usage:") {
                    required = args(usage)
                        .into_iter()
                        .filter(|w| w.starts_with("--"))
                        .collect();
                } else if line.starts_with('-') {
                    flag = line.split([' ', ',']).find(|w| w.starts_with("--"));
                }
                if let (Some(f), Some(i)) = (flag, line.find("[env: ")) {
                    let name = line[i + 6..].split(['=', ']']).next().unwrap_or("");
                    env.insert(f.to_string(), name.to_string());
                }
            }
            cli.insert(path.join(" "), (required, env));
        }
        cli
    })
}

/// The variable behind `flag` of `weightcast SUB`.
fn env_of(sub: &str, flag: &str) -> Option<String> {
    cli().get(sub)?.1.get(flag).cloned()
}

fn trainer_env_of(flag: &str) -> Option<String> {
    let cmd = trainer_cli::Args::command();
    let arg = cmd
        .get_arguments()
        .find(|a| a.get_long().is_some_and(|l| flag == format!("--{l}")));
    arg?.get_env().map(|e| e.to_string_lossy().into_owned())
}

/// Whether weightcast, its store (object_store's `AWS_*`, `GOOGLE_*`, `AZURE_*`
/// configuration keys) or the trainer loop reads the variable `name`.
fn known_env(name: &str) -> bool {
    use object_store::{aws::AmazonS3ConfigKey as S3, azure::AzureConfigKey, gcp::GoogleConfigKey};
    let key = name.to_ascii_lowercase();
    let by_flag = cli()
        .values()
        .any(|(_, env)| env.values().any(|v| v == name));
    let trainer = trainer_cli::Args::command()
        .get_arguments()
        .any(|a| a.get_env() == Some(std::ffi::OsStr::new(name)));
    name == "RUST_LOG"
        || by_flag
        || trainer
        || (name.starts_with("AWS_") && key.parse::<S3>().is_ok())
        || (name.starts_with("GOOGLE_") && key.parse::<GoogleConfigKey>().is_ok())
        || (name.starts_with("AZURE_") && key.parse::<AzureConfigKey>().is_ok())
}

fn unknown_env<'a>(
    names: impl IntoIterator<Item = &'a String>,
    ctx: &str,
    problems: &mut Vec<String>,
) {
    for n in names.into_iter().filter(|n| !known_env(n)) {
        bad! {problems, "{ctx}: {n} is read by neither weightcast nor its store"}
    }
}

/// `weightcast ARGV` as the binary parses it; `env` are the variables the
/// process will have (a required flag may come from one).
fn check_weightcast(argv: &[String], env: &BTreeMap<String, String>) -> Result<(), String> {
    let sub = argv.first().ok_or("no subcommand")?;
    if sub.starts_with('-') || argv.iter().any(|a| a == "--help" || a == "-h") {
        return Err(format!("`{}` runs no command", argv.join(" ")));
    }
    parses(argv)?;
    for req in cli().get(sub.as_str()).map(|c| &c.0).into_iter().flatten() {
        let from_env = env_of(sub, req).is_some_and(|e| env.contains_key(&e));
        if values(argv, req).is_empty() && !from_env {
            return Err(format!("`weightcast {sub}` needs {req}"));
        }
    }
    Ok(())
}

/// The trainer loop's ARGV with its clap definition; `env` are the process's
/// variables (the test's own play no part).
fn check_trainer(argv: &[String], env: &BTreeMap<String, String>) -> Result<(), String> {
    let cmd = trainer_cli::Args::command();
    let mut full = [&["trainer_loop".to_string()][..], argv].concat();
    for long in cmd
        .get_arguments()
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
    {
        if let Some(v) = trainer_env_of(&long).and_then(|e| env.get(&e))
            && values(argv, &long).is_empty()
        {
            full.extend([long, v.clone()]);
        }
    }
    let matches = cmd
        .mut_args(|a| a.env(None::<&str>))
        .try_get_matches_from(&full);
    let parsed = matches.and_then(|m| trainer_cli::Args::from_arg_matches(&m));
    let first_line = |e: clap::Error| e.to_string().lines().next().unwrap_or("").to_string();
    parsed.map(|_| ()).map_err(|e| {
        format!(
            "the trainer loop rejects `{}`: {}",
            argv.join(" "),
            first_line(e)
        )
    })
}

// ---------------------------------------------------------------------------
// The Dockerfile: what the build needs exists, what the image holds

#[derive(Debug, Default)]
struct Image {
    /// Where the last stage copies built programs to.
    programs: BTreeSet<String>,
    /// ENTRYPOINT after tini: the program, then its arguments.
    entrypoint: Vec<String>,
    uid: Option<u64>,
}

/// `[tini, --, PROGRAM, ARGS...]` → `[PROGRAM, ARGS...]`.
fn strip_tini(argv: &[String]) -> Vec<String> {
    let skip = match argv {
        [t, dash, ..] if t.ends_with("tini") && dash == "--" => 2,
        [t, ..] if t.ends_with("tini") => 1,
        _ => 0,
    };
    argv[skip..].to_vec()
}

/// Whether Cargo.toml has a `[[kind]]` target `name` (or `examples/NAME.rs`).
fn cargo_target(kind: &str, name: &str) -> bool {
    let line = format!("name = \"{name}\"");
    let section = |s: &str| {
        s.lines()
            .skip(1)
            .take_while(|l| !l.starts_with('['))
            .any(|l| l.trim() == line)
    };
    let example = kind == "example"
        && Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("examples/{name}.rs"))
            .exists();
    read("Cargo.toml")
        .split(&format!("[[{kind}]]"))
        .skip(1)
        .any(section)
        || example
}

fn check_dockerfile(text: &str, problems: &mut Vec<String>) -> Image {
    let ignored = read(".dockerignore");
    let context = |src: &str| {
        Path::new(env!("CARGO_MANIFEST_DIR")).join(src).exists()
            && !ignored.lines().any(|l| l.trim() == src)
    };
    let mut image = Image::default();
    let mut copied: Vec<String> = Vec::new();
    for line in text
        .replace("\\\n", " ")
        .lines()
        .filter(|l| !l.starts_with('#'))
    {
        let (instr, rest) = line.split_once(' ').unwrap_or((line, ""));
        let words = args(rest);
        match instr {
            "FROM" => image = Image::default(),
            "COPY" if rest.starts_with("--from=") => image.programs.extend(words.last().cloned()),
            "COPY" => {
                for src in words.iter().rev().skip(1).filter(|s| !context(s)) {
                    bad! {problems, "{DOCKERFILE}: COPY {src}: not in the build context"}
                }
                copied.extend(words.iter().rev().skip(1).cloned());
            }
            "RUN" => {
                for kind in ["bin", "example"] {
                    for name in values(&words, &format!("--{kind}"))
                        .iter()
                        .filter(|n| !cargo_target(kind, n))
                    {
                        bad! {problems, "{DOCKERFILE}: --{kind} {name}: no such Cargo target"}
                    }
                }
            }
            "USER" => image.uid = rest.split(':').next().and_then(|u| u.parse().ok()),
            "ENTRYPOINT" => {
                image.entrypoint =
                    strip_tini(&serde_json::from_str::<Vec<String>>(rest).unwrap_or_default())
            }
            _ => {}
        }
    }
    // Cargo refuses to load a workspace whose members are missing, so the
    // build stage needs every member's directory, not only `src/`.
    for member in workspace_members() {
        let covered = |c: &String| {
            let c = c.trim_end_matches('/');
            member == c || member.starts_with(&format!("{c}/"))
        };
        if member != "." && !copied.iter().any(covered) {
            bad! {problems, "{DOCKERFILE}: the workspace member `{member}` (Cargo.toml) is not copied in; cargo cannot load the workspace without it"}
        }
    }
    if !image
        .entrypoint
        .first()
        .is_some_and(|p| image.programs.contains(p))
    {
        bad! {problems, "{DOCKERFILE}: ENTRYPOINT {:?} is not copied in", image.entrypoint}
    }
    image
}

/// The `[workspace] members` of Cargo.toml.
fn workspace_members() -> Vec<String> {
    let manifest = read("Cargo.toml");
    let list = manifest
        .lines()
        .find_map(|l| l.trim().strip_prefix("members = "))
        .expect("Cargo.toml has a `members = [...]` line");
    serde_json::from_str(list).expect("`members` is a JSON-compatible list of strings")
}

fn image() -> Image {
    let mut problems = Vec::new();
    let image = check_dockerfile(&read(DOCKERFILE), &mut problems);
    assert!(problems.is_empty(), "{problems:#?}");
    image
}

// ---------------------------------------------------------------------------
// docker-compose.yml, as `docker compose config` resolves it

/// The compose model with every profile on and an empty environment (so each
/// `${VAR:-default}` takes its default).
fn compose_model() -> Value {
    let program = std::env::var("DOCKER_COMPOSE").unwrap_or_else(|_| "docker-compose".into());
    let out = Command::new(&program)
        .args(["--project-directory", ".", "-f", COMPOSE, "--profile", "demo", "config", "--format", "json"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", std::env::temp_dir())
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run Docker Compose `{program}`: {e}. ./scripts/test.sh installs it and sets DOCKER_COMPOSE")
        });
    assert!(
        out.status.success(),
        "docker compose config: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("docker compose config --format json")
}

/// A service built from deploy/Dockerfile: what it runs and with what.
struct Service<'a> {
    name: &'a str,
    def: &'a Value,
    /// The program's file name, then its arguments (`$$` unescaped).
    argv: Vec<String>,
    env: BTreeMap<String, String>,
}

impl Service<'_> {
    fn runs(&self, sub: &str) -> bool {
        self.argv[0] == "weightcast" && self.argv[1] == sub
    }
    /// A flag's value, given or from its variable.
    fn flag(&self, f: &str) -> Option<String> {
        let var = match self.argv[0].as_str() {
            "weightcast" => env_of(&self.argv[1], f),
            _ => trainer_env_of(f),
        };
        value(&self.argv, f).or_else(|| self.env.get(&var?).cloned())
    }
    /// The named volume and mount path `dir` is on.
    fn volume_of(&self, dir: &str) -> Option<(String, String)> {
        let mounts = items(&self.def["volumes"]).filter(|v| v["type"] == "volume");
        let mounts = mounts.filter_map(|v| Some((text(&v["source"])?, text(&v["target"])?)));
        mounts
            .filter(|(_, t)| Path::new(dir).starts_with(t))
            .max_by_key(|(_, t)| t.len())
    }
}

fn check_compose(model: &Value, image: &Image) -> Vec<String> {
    let mut problems = Vec::new();
    let p = &mut problems;
    let services = model["services"].as_object().expect("services");
    let mut ours = Vec::new();
    for (name, def) in services {
        let img = text(&def["image"]).unwrap_or_default();
        if def.get("build").is_none() && !pinned(&img) {
            bad! {p, "{name}: pin the image {img} to a release"}
        }
        if def.pointer("/build/dockerfile").and_then(Value::as_str) != Some(DOCKERFILE) {
            continue;
        }
        let entry = match &def["entrypoint"] {
            Value::Array(_) => strip_tini(&texts(&def["entrypoint"])),
            _ => image.entrypoint.clone(),
        };
        let mut argv: Vec<String> = entry
            .iter()
            .chain(&texts(&def["command"]))
            .map(|a| a.replace("$$", "$"))
            .collect();
        if argv.len() < 2 || !image.programs.contains(&argv[0]) {
            bad! {p, "{name}: runs {argv:?}, not a program of the image with a command"}
            continue;
        }
        argv[0] = argv[0].rsplit('/').next().unwrap_or("").to_string();
        let env = pairs(&def["environment"]);
        unknown_env(env.keys(), name, p);
        let parsed = match argv[0].as_str() {
            "weightcast" => check_weightcast(&argv[1..], &env),
            _ => check_trainer(&argv[1..], &env),
        };
        if let Err(e) = parsed {
            bad! {p, "{name}: {e}"}
        }
        ours.push(Service {
            name,
            def,
            argv,
            env,
        });
    }

    for s in &ours {
        let (name, listen) = (s.name, value(&s.argv, "--listen"));
        let port = listen_port(&s.argv);
        // Published: the port it listens on, on all its interfaces; on the
        // host's loopback unless PLAYGROUND_BIND says otherwise.
        for pt in items(&s.def["ports"]) {
            if pt["target"].as_u64() != port
                || !listen.as_ref().is_some_and(|l| l.starts_with("0.0.0.0:"))
            {
                bad! {p, "{name}: publishes port {}, but listens on {listen:?}", pt["target"]}
            }
            if pt["host_ip"] != "127.0.0.1" {
                bad! {p, "{name}: publishes {} on {}, not 127.0.0.1", pt["target"], pt["host_ip"]}
            }
        }
        if let Some(port) = port {
            let test = texts(&s.def["healthcheck"]["test"]).join(" ");
            if !test.contains(&format!("http://127.0.0.1:{port}/healthz")) {
                bad! {p, "{name}: health check `{test}` is not on http://127.0.0.1:{port}/healthz"}
            }
        }
        let advertise = format!("http://{name}:{}/v1/notify", port.unwrap_or(0));
        if s.runs("subscribe")
            && s.flag("--id").is_some()
            && s.flag("--advertise") != Some(advertise.clone())
        {
            bad! {p, "{name}: --advertise should be {advertise}"}
        }
        // The publisher: reachable from the host, collecting old versions.
        if s.runs("publisher")
            && (s.def["ports"].as_array().is_none_or(Vec::is_empty)
                || s.flag("--keep-anchors").is_none())
        {
            bad! {p, "{name}: publish the port, set --keep-anchors (or the bucket grows)"}
        }
    }
    // The trainer reaches a publisher, with its token, on the same volume.
    let find = |n: &str| ours.iter().find(|s| s.name == n);
    for t in ours
        .iter()
        .filter(|s| s.argv[0] == "weightcast-trainer-loop")
    {
        let url = t.flag("--publisher").unwrap_or_default();
        let target = http_url(&url).and_then(|(h, port, _)| find(&h).map(|s| (s, port)));
        let Some(publ) =
            target.filter(|(s, port)| s.runs("publisher") && listen_port(&s.argv) == Some(*port))
        else {
            bad! {p, "{}: --publisher {url} is not a publisher's --listen port", t.name}
            continue;
        };
        let publ = publ.0;
        if t.flag("--token").is_none() || t.flag("--token") != publ.flag("--token") {
            bad! {p, "{}: its token differs from {}'s", t.name, publ.name}
        }
        let (dir, root) = (
            t.flag("--dir").unwrap_or_default(),
            publ.flag("--checkpoint-root").unwrap_or_default(),
        );
        if !Path::new(&dir).starts_with(&root) || t.volume_of(&dir) != publ.volume_of(&dir) {
            bad! {p, "{}: --dir {dir} is not under {}'s --checkpoint-root {root}", t.name, publ.name}
        }
    }
    // One store and notify key; the bucket's endpoint and keys are MinIO's.
    let stores: BTreeSet<_> = ours
        .iter()
        .filter(|s| s.argv[0] == "weightcast" && !s.runs("demo"))
        .map(|s| s.flag("--store"))
        .collect();
    if stores.len() != 1 || stores.contains(&None) {
        bad! {p, "the weightcast services should share one store, not {stores:?}"}
    }
    let keyed = ours
        .iter()
        .filter(|s| s.runs("publisher") || (s.runs("subscribe") && s.flag("--id").is_some()));
    let keys: BTreeSet<_> = keyed.map(|s| s.flag("--notify-key")).collect();
    if keys.len() != 1 || keys.iter().any(|k| k.as_ref().is_none_or(|k| k.len() < 16)) {
        bad! {p, "publisher, registered subscribers: one notify key, 16+ characters: {keys:?}"}
    }
    for s in ours
        .iter()
        .filter(|s| s.flag("--store").is_some_and(|u| u.starts_with("s3://")))
    {
        let endpoint = s.env.get("AWS_ENDPOINT").cloned().unwrap_or_default();
        let server = http_url(&endpoint).and_then(|(h, port, _)| {
            services
                .get(&h)
                .filter(|d| items(&d["ports"]).any(|p| p["target"] == json!(port)))
        });
        let Some(server) = server else {
            bad! {p, "{}: AWS_ENDPOINT {endpoint} is not a port of a service", s.name}
            continue;
        };
        for (mine, theirs) in [
            ("AWS_ACCESS_KEY_ID", "MINIO_ROOT_USER"),
            ("AWS_SECRET_ACCESS_KEY", "MINIO_ROOT_PASSWORD"),
        ] {
            if s.env.get(mine) != pairs(&server["environment"]).get(theirs) {
                bad! {p, "{}: {mine} is not the bucket server's {theirs}", s.name}
            }
        }
    }
    if !ours.iter().any(|s| s.runs("publisher")) {
        bad! {p, "no publisher service"}
    }
    problems.iter().map(|m| format!("{COMPOSE}: {m}")).collect()
}

// ---------------------------------------------------------------------------
// The Kubernetes example

fn yaml_docs(text: &str) -> Vec<Value> {
    let docs =
        serde_norway::Deserializer::from_str(text).map(|d| Value::deserialize(d).expect("YAML"));
    docs.filter(|v| !v.is_null()).collect()
}

/// A container's environment: the file's ConfigMaps and Secrets it takes
/// (`envFrom`), then `env` (downward-API fields get sample values).
fn container_env(
    c: &Value,
    docs: &[Value],
    ctx: &str,
    problems: &mut Vec<String>,
) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for (kind, name) in items(&c["envFrom"]).flat_map(|s| {
        [
            ("ConfigMap", &s["configMapRef"]["name"]),
            ("Secret", &s["secretRef"]["name"]),
        ]
    }) {
        match docs
            .iter()
            .find(|d| d["kind"] == kind && &d["metadata"]["name"] == name)
        {
            _ if name.is_null() => {}
            Some(o) => env.extend(
                [pairs(&o["data"]), pairs(&o["stringData"])]
                    .into_iter()
                    .flatten(),
            ),
            None => bad! {problems, "{ctx}: envFrom {kind} {name} is not in the file"},
        }
    }
    for e in items(&c["env"]) {
        let sample = match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            Some("status.podIP") => "10.1.2.3",
            _ => "rollout-5d8f7c9b4-x2x7q",
        };
        env.insert(
            text(&e["name"]).unwrap_or_default(),
            text(&e["value"]).unwrap_or(sample.into()),
        );
    }
    env
}

fn container_ports(c: &Value) -> Vec<u64> {
    items(&c["ports"])
        .filter_map(|p| p["containerPort"].as_u64())
        .collect()
}

/// A probe's `httpGet` port (by number or by name) and path.
fn probe(c: &Value, which: &str) -> Option<(u64, String)> {
    let get = &c[which]["httpGet"];
    let port = match &get["port"] {
        Value::String(n) => {
            items(&c["ports"]).find(|p| p["name"] == n.as_str())?["containerPort"].as_u64()
        }
        n => n.as_u64(),
    };
    Some((port?, text(&get["path"])?))
}

/// The volume and mount path `dir` is on in container `c`.
fn mount_of(c: &Value, dir: &str) -> Option<(String, String)> {
    let mounts =
        items(&c["volumeMounts"]).filter_map(|m| Some((text(&m["name"])?, text(&m["mountPath"])?)));
    mounts
        .filter(|(_, path)| Path::new(dir).starts_with(path))
        .max_by_key(|(_, path)| path.len())
}

/// `$(VAR)` references replaced with the variables' values.
fn expand(
    arg: &str,
    env: &BTreeMap<String, String>,
    ctx: &str,
    problems: &mut Vec<String>,
) -> String {
    let mut parts = arg.split("$(");
    let mut out = parts.next().unwrap_or("").to_string();
    for part in parts {
        let (var, rest) = part.split_once(')').unwrap_or((part, ""));
        match env.get(var) {
            Some(v) => out.push_str(v),
            None => bad! {problems, "{ctx}: $({var}) is not a variable of the container"},
        }
        out.push_str(rest);
    }
    out
}

fn check_k8s(docs: &[Value], image: &Image) -> Vec<String> {
    let mut problems = Vec::new();
    let p = &mut problems;
    for d in docs
        .iter()
        .filter(|d| d["kind"] == "ConfigMap" || d["kind"] == "Secret")
    {
        let ctx = format!("{} {}", d["kind"], d["metadata"]["name"]);
        unknown_env(
            pairs(&d["data"])
                .keys()
                .chain(pairs(&d["stringData"]).keys()),
            &ctx,
            p,
        );
    }
    let version = format!("/weightcast:{}", env!("CARGO_PKG_VERSION"));
    let mut sidecars = 0;
    for spec in docs.iter().filter_map(|d| d.pointer("/spec/template/spec")) {
        let init: Vec<&Value> = items(&spec["initContainers"]).collect();
        let main: Vec<&Value> = items(&spec["containers"]).collect();
        for (i, c) in init.iter().chain(&main).enumerate() {
            let ctx = format!("container {}", c["name"]);
            let img = text(&c["image"]).unwrap_or_default();
            if !pinned(&img) {
                bad! {p, "{ctx}: pin the image {img} to a release"}
            }
            if !img.contains("/weightcast:") {
                continue;
            }
            // A weightcast container: the image at the crate's version, its
            // ENTRYPOINT and user.
            if !img.ends_with(&version)
                || !c["command"].is_null()
                || c["securityContext"]["runAsUser"].as_u64() != image.uid
            {
                bad! {p, "{ctx}: run {version} by its ENTRYPOINT as runAsUser {:?}", image.uid}
            }
            let env = container_env(c, docs, &ctx, p);
            let raw = texts(&c["args"]).join(" ");
            unknown_env(
                env.keys().filter(|e| !raw.contains(&format!("$({e})"))),
                &ctx,
                p,
            );
            let argv: Vec<String> = texts(&c["args"])
                .iter()
                .map(|a| expand(a, &env, &ctx, p))
                .collect();
            if let Err(e) = check_weightcast(&argv, &env) {
                bad! {p, "{ctx}: {e}"}
                continue;
            }
            if i < init.len() || argv.contains(&"--once".to_string()) {
                continue;
            }
            // The sidecar: probes on --listen, its notify URL, the engine.
            sidecars += 1;
            let Some(port) = listen_port(&argv).filter(|port| container_ports(c).contains(port))
            else {
                bad! {p, "{ctx}: --listen on a declared containerPort, for the probes"}
                continue;
            };
            for which in ["readinessProbe", "livenessProbe"] {
                if probe(c, which) != Some((port, "/healthz".into())) {
                    bad! {p, "{ctx}: {which} should be httpGet /healthz on {port}"}
                }
            }
            let advertise = value(&argv, "--advertise").and_then(|u| http_url(&u));
            if advertise.is_some_and(|(_, p, path)| p != port || path != "/v1/notify") {
                bad! {p, "{ctx}: --advertise is not http://<pod>:{port}/v1/notify"}
            }
            let out = value(&argv, "--out").unwrap_or_default();
            let engines: Vec<(String, u64)> = values(&argv, "--hook")
                .iter()
                .filter_map(|h| h.split_once(':'))
                .filter(|(kind, _)| ["vllm", "sglang"].contains(kind))
                .filter_map(|(kind, url)| {
                    http_url(url)
                        .filter(|u| u.0 == "127.0.0.1")
                        .map(|u| (kind.to_string(), u.1))
                })
                .collect();
            if engines.is_empty() {
                bad! {p, "{ctx}: no vllm:/sglang: --hook on 127.0.0.1 tells the engine"}
            }
            for (kind, port) in engines {
                let Some(engine) = main
                    .iter()
                    .find(|e| e["name"] != c["name"] && container_ports(e).contains(&port))
                else {
                    bad! {p, "{ctx}: the {kind} hook's port {port} is no container's of the pod"}
                    continue;
                };
                let name = &engine["name"];
                if mount_of(engine, &out) != mount_of(c, &out) {
                    bad! {p, "{ctx}: {name} must mount the volume of --out {out} at the same path"}
                }
                if ![texts(&engine["command"]), texts(&engine["args"])]
                    .concat()
                    .contains(&format!("{out}/current"))
                {
                    bad! {p, "{ctx}: {name} does not serve {out}/current"}
                }
                let dev = items(&engine["env"])
                    .any(|e| e["name"] == "VLLM_SERVER_DEV_MODE" && e["value"] == "1");
                if kind == "vllm" && !dev {
                    bad! {p, "{ctx}: {name} needs VLLM_SERVER_DEV_MODE=1 for the vllm hook"}
                }
            }
        }
    }
    if sidecars == 0 {
        bad! {p, "no weightcast subscriber sidecar"}
    }
    problems.iter().map(|m| format!("{K8S}: {m}")).collect()
}

fn check_env_example(text: &str) -> Vec<String> {
    let lines = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'));
    let names: Vec<String> = lines
        .map(|l| l.split_once('=').map_or(l, |(k, _)| k).to_string())
        .collect();
    let mut problems = Vec::new();
    unknown_env(&names, ENV_EXAMPLE, &mut problems);
    problems
}

// ---------------------------------------------------------------------------
// The real files, then broken copies

fn assert_clean(problems: Vec<String>) {
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

fn expect(problems: Vec<String>, want: &str) {
    let found = problems.iter().any(|p| p.contains(want));
    assert!(
        found,
        "expected a problem about `{want}`, got {problems:#?}"
    );
}

#[test]
fn dockerfile() {
    let image = image();
    assert!(
        image
            .programs
            .contains("/usr/local/bin/weightcast-trainer-loop"),
        "{image:?}"
    );
    assert_eq!(image.entrypoint, ["/usr/local/bin/weightcast"]);
    assert!(image.uid.is_some_and(|u| u != 0), "{image:?}");
}

#[test]
fn compose_file() {
    let model = compose_model();
    assert_clean(check_compose(&model, &image()));
    for s in [
        "minio",
        "create-bucket",
        "publisher",
        "trainer",
        "subscriber-a",
        "subscriber-b",
        "demo",
    ] {
        assert!(model["services"].get(s).is_some(), "no service {s}");
    }
}

#[test]
fn kubernetes_example() {
    assert_clean(check_k8s(&yaml_docs(&read(K8S)), &image()));
}

#[test]
fn env_example() {
    assert_clean(check_env_example(&read(ENV_EXAMPLE)));
}

#[test]
fn argument_checks_use_the_real_parsers() {
    let none = BTreeMap::new();
    check_weightcast(
        &args("subscribe --store s3://b --out /w --listen 0.0.0.0:1"),
        &none,
    )
    .unwrap();
    let store = [("WEIGHTCAST_STORE".to_string(), String::new())].into();
    check_weightcast(&args("subscribe --out /w"), &store).unwrap();
    for (bad, why) in [
        (
            "subscribe --store s3://b --out /w --lisen 0.0.0.0:1",
            "--lisen",
        ),
        (
            "subscribe --store s3://b --out /w --listen nowhere",
            "nowhere",
        ),
        (
            "subscribe --store s3://b --out /w --hook ollama:http://x",
            "ollama",
        ),
        ("subscribe --store s3://b", "needs --out"),
        ("subscribe --out /w", "needs --store"),
        ("subscribbe --out /w", "subscribbe"),
        ("--version", "runs no command"),
        ("", "no subcommand"),
    ] {
        let e = check_weightcast(&args(bad), &none).unwrap_err();
        assert!(e.contains(why), "{bad}: {e}");
    }
    let token = [(
        "WEIGHTCAST_API_TOKEN".to_string(),
        "0123456789abcdef".to_string(),
    )]
    .into();
    check_trainer(&args("--dir /c"), &token).unwrap();
    for (bad, env) in [
        ("--dir /c --intervall 3", &token),
        ("--dir /c --interval -3", &token),
        ("--dir /c --publisher publisher:8470", &token),
        ("--dir /c", &none),
    ] {
        assert!(check_trainer(&args(bad), env).is_err(), "{bad} {env:?}");
    }
    assert!(
        known_env("AWS_ENDPOINT")
            && known_env("WEIGHTCAST_STORE")
            && known_env("WEIGHTCAST_API_TOKEN")
    );
    assert!(!known_env("AWS_ENDPOINT_URI") && !known_env("WEIGHTCAST_STOR") && !known_env("HOME"));
    let required = &cli()["publisher"].0;
    assert!(
        ["--token", "--checkpoint-root", "--store"]
            .iter()
            .all(|f| required.contains(&f.to_string()))
    );
    assert_eq!(
        env_of("publisher", "--token").as_deref(),
        Some("WEIGHTCAST_API_TOKEN")
    );
}

#[test]
fn dockerfile_checker_catches_mistakes() {
    let good = read(DOCKERFILE);
    for (from, to, want) in [
        (
            "COPY examples ./examples",
            "COPY exemples ./examples",
            "COPY exemples",
        ),
        ("COPY src ./src", "COPY tests ./tests", "COPY tests"),
        ("COPY crates ./crates\n", "", "`crates/core`"),
        ("COPY python ./python\n", "", "`python`"),
        (
            "--example trainer_loop",
            "--example trainer_lop",
            "trainer_lop",
        ),
        ("--bin weightcast", "--bin weightcast-cli", "weightcast-cli"),
        (
            "COPY --from=build /out/weightcast /usr/local/bin/weightcast\n",
            "",
            "ENTRYPOINT",
        ),
    ] {
        assert!(good.contains(from), "{from}");
        let mut problems = Vec::new();
        check_dockerfile(&good.replacen(from, to, 1), &mut problems);
        expect(problems, want);
    }
}

/// The compose model with one change in `service`: with `at` a JSON pointer,
/// the value there set to `new` (JSON); else the argument `at` replaced with
/// `new` (removed, with its value, when `new` is empty).
fn broken(model: &Value, service: &str, at: &str, new: &str) -> Value {
    let mut model = model.clone();
    let svc = &mut model["services"][service];
    if let Some((parent, key)) = at.strip_prefix('/').map(|_| at.rsplit_once('/').unwrap()) {
        let (slot, new) = (
            svc.pointer_mut(parent).expect(at),
            serde_json::from_str(new).unwrap(),
        );
        match slot {
            Value::Array(a) => a[key.parse::<usize>().unwrap()] = new,
            _ => slot[key] = new,
        }
    } else {
        let cmd = svc["command"].as_array_mut().expect("command");
        let i = cmd.iter().position(|a| a == at).expect(at);
        match new {
            "" => drop(cmd.drain(i..i + 2)),
            _ => cmd[i] = new.into(),
        }
    }
    model
}

/// Rows of a table of broken copies: `|`-separated cells, `\n` for a newline.
fn rows(table: &str) -> impl Iterator<Item = Vec<String>> + '_ {
    let lines = table.lines().filter(|l| !l.trim().is_empty());
    lines.map(|l| {
        l.split('|')
            .map(|c| c.trim().replace("\\n", "\n"))
            .collect()
    })
}

#[test]
fn compose_checker_catches_mistakes() {
    let (model, image) = (compose_model(), image());
    // problem | service | argument, or JSON pointer | new argument, or JSON
    let table = r#"
        --lisen | subscriber-a | --listen | --lisen
        --intervall | trainer | --interval | --intervall
        needs --out | subscriber-b | --out |
        not a program of the image | demo | /entrypoint | ["/usr/bin/weightcast"]
        AWS_ENDPONT | subscriber-a | /environment/AWS_ENDPONT | "http://minio:9000"
        pin the image | minio | /image | "minio/minio:latest"
        publishes port 8480 | subscriber-a | /ports/0/target | 8480
        not 127.0.0.1 | publisher | /ports/0/host_ip | "0.0.0.0"
        listens on | subscriber-a | 0.0.0.0:8481 | 127.0.0.1:8481
        health check | subscriber-b | /healthcheck/test/5 | "http://[::1]:8482/healthz"
        publish the port | publisher | /ports | []
        --keep-anchors | publisher | --keep-anchors |
        publisher's --listen | trainer | http://publisher:8470 | http://publisher:8471
        token differs | trainer | /environment/WEIGHTCAST_API_TOKEN | "0123456789abcdefX"
        not under | trainer | /volumes/0/source | "checkpoints-2"
        --advertise | subscriber-a | http://subscriber-a:8481/v1/notify | http://a:8481/v1/notify
        notify key | subscriber-b | /environment/WEIGHTCAST_NOTIFY_KEY | "0123456789abcdefX"
        share one store | subscriber-b | s3://weights/policy | s3://weights/other
        AWS_ENDPOINT http://minio:9002 | publisher | /environment/AWS_ENDPOINT | "http://minio:9002"
        MINIO_ROOT_PASSWORD | subscriber-a | /environment/AWS_SECRET_ACCESS_KEY | "minio"
    "#;
    for row in rows(table) {
        let new = row.get(3).map_or("", String::as_str);
        expect(
            check_compose(&broken(&model, &row[1], &row[2], new), &image),
            &row[0],
        );
    }
}

#[test]
fn kubernetes_checker_catches_mistakes() {
    let (good, image) = (read(K8S), image());
    // problem | text | its replacement (the first occurrence)
    let table = r#"
        --poll-intervall | - --poll-interval\n | - --poll-intervall\n
        port 8001 | vllm:http://127.0.0.1:8000 | vllm:http://127.0.0.1:8001
        POD_ADDR | http://$(POD_IP):8480/v1/notify | http://$(POD_ADDR):8480/v1/notify
        --advertise | http://$(POD_IP):8480/v1/notify | http://$(POD_IP):8481/v1/notify
        readinessProbe | port: weightcast\n            periodSeconds: 10 | port: 8481\n            periodSeconds: 10
        livenessProbe | path: /healthz\n              port: weightcast\n            periodSeconds: 20 | path: /metrics\n              port: weightcast\n            periodSeconds: 20
        declared containerPort | containerPort: 8480 | containerPort: 8490
        WEIGHTCAST_STOR | WEIGHTCAST_STORE: s3://weights/policy | WEIGHTCAST_STOR: s3://weights/policy
        weightcast-s3 | name: weightcast\n          ports | name: weightcast-s3\n          ports
        VLLM_SERVER_DEV_MODE | value: "1" | value: "0"
        does not serve | - /weights/current | - /models/policy
        must mount | mountPath: /weights\n              readOnly: true | mountPath: /model\n              readOnly: true
        pin the image | vllm/vllm-openai:v0.19.0 | vllm/vllm-openai:latest
        ENTRYPOINT | image: registry.example.com/weightcast:0.1.0 | image: registry.example.com/weightcast:0.0.9
        runAsUser | runAsUser: 10001 | runAsUser: 1000
    "#;
    for row in rows(table) {
        assert!(good.contains(&row[1]), "{}", row[1]);
        let docs = yaml_docs(&good.replacen(&row[1], &row[2], 1));
        expect(check_k8s(&docs, &image), &row[0]);
    }
}

#[test]
fn env_example_checker_catches_mistakes() {
    let bad = read(ENV_EXAMPLE).replacen("AWS_ALLOW_HTTP=", "AWS_ALLOW_INSECURE=", 1);
    expect(check_env_example(&bad), "AWS_ALLOW_INSECURE");
    expect(check_env_example("WEIGHTCAST_NOTIFYKEY=x\n"), "NOTIFYKEY");
}
