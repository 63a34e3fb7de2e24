//! Issue #28, "a new user's first hour": what a new user hit on the release
//! binary with small models, `file://` and moto buckets, each checked end to
//! end through the binary (an empty environment but what each case sets) or
//! the library: bounded first contact with a store, one error line, one
//! exit-code table, per-step file names, absolute paths, the checkpoint's
//! metadata on deltas, arguments checked by the parser, one-line JSON, and
//! every version's time and bytes accounted.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use weightcast::generator::{Generator, GeneratorConfig};

use crate::common;

/// `weightcast ARGS` with an empty environment but `PATH`, in `cwd` when
/// given.
fn wc(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_weightcast"));
    c.args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default());
    c
}

/// Runs `c`, returning its output and how long it took.
fn timed(mut c: Command) -> (Output, Duration) {
    let started = Instant::now();
    let out = c.output().expect("running weightcast");
    (out, started.elapsed())
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The one `Error:` line of a failed command (asserting there is exactly
/// one).
#[track_caller]
fn error_line(o: &Output) -> String {
    let err = stderr(o);
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("Error:")).collect();
    assert_eq!(lines.len(), 1, "one error line expected:\n{err}");
    lines[0].to_string()
}

/// A loopback port that refuses connections for as long as the guard
/// lives: a socket bound to it that never listens, without `SO_REUSEADDR`,
/// so no server another test starts at the same time (on a port it picked
/// and released, as `common::free_port` does for the object-store servers)
/// can take the port over. A
/// released port could be handed out again; CI once met a server's 404
/// there instead of "Connection refused".
struct DeadPort {
    port: u16,
    _bound: tokio::net::TcpSocket,
}

fn dead_port() -> DeadPort {
    let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
    socket
        .bind("127.0.0.1:0".parse().unwrap())
        .expect("binding an ephemeral loopback port");
    let port = socket.local_addr().expect("a bound port").port();
    DeadPort {
        port,
        _bound: socket,
    }
}

/// A listener on loopback that accepts connections and never answers (a
/// metadata service or an endpoint that hangs); lives as long as the test
/// process.
fn black_hole() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in l.incoming().flatten() {
            held.push(c);
        }
    });
    port
}

/// Writes a safetensors checkpoint file of `g`'s weights with `metadata`.
fn save(g: &Generator, path: &Path, metadata: &[(&str, &str)]) {
    let meta: BTreeMap<String, String> = metadata
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut f = std::fs::File::create(path).unwrap();
    g.snapshot().write_to(&meta, &mut f).unwrap();
}

fn json_line(text: &str) -> serde_json::Value {
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "one JSON line expected: {text}");
    serde_json::from_str(lines[0]).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// The files under `dir` (relative, sorted; directories excluded).
fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in walk(dir) {
        if e.is_file() {
            out.push(e.strip_prefix(dir).unwrap().display().to_string());
        }
    }
    out.sort();
    out
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        out.push(p.clone());
        if p.is_dir() {
            out.extend(walk(&p));
        }
    }
    out
}

// ---- 1. Fast failure ----------------------------------------------------

#[test]
fn an_unreachable_or_unauthenticated_store_fails_within_15_s_naming_the_cause() {
    // A dead AWS_ENDPOINT: retried, each retry one line at the default log
    // level, then an error naming the endpoint and its address.
    let dead_guard = dead_port();
    let dead = dead_guard.port;
    let endpoint = format!("http://127.0.0.1:{dead}");
    let s3 = |c: &mut Command| {
        c.env("AWS_ENDPOINT", &endpoint)
            .env("AWS_ALLOW_HTTP", "true")
            .env("AWS_REGION", "us-east-1");
    };
    let mut status = wc(&["status", "--store", "s3://weights/policy"]);
    s3(&mut status);
    status
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test");
    // No credentials, on a host whose metadata service does not answer.
    let hole = black_hole();
    let mut uncredentialed = wc(&["status", "--store", "s3://weights/policy"]);
    uncredentialed
        .env("AWS_ENDPOINT", format!("http://127.0.0.1:{}", black_hole()))
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_METADATA_ENDPOINT", format!("http://127.0.0.1:{hole}"));
    // The publisher contacts the store first too.
    let ckpt = tempfile::tempdir().unwrap();
    save(
        &Generator::new(GeneratorConfig::tiny(1)),
        &ckpt.path().join("model.safetensors"),
        &[],
    );
    let state = ckpt.path().join("state");
    let mut publish = wc(&[
        "publish",
        "--quiet",
        "--store",
        "s3://weights/policy",
        "--checkpoint",
        ckpt.path().to_str().unwrap(),
        "--state",
        state.to_str().unwrap(),
    ]);
    s3(&mut publish);
    publish
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test");
    // All three at once: each takes its 15 s.
    let runs: Vec<_> = [status, uncredentialed, publish]
        .into_iter()
        .map(|c| std::thread::spawn(move || timed(c)))
        .collect();
    let mut runs = runs.into_iter().map(|t| t.join().unwrap());
    for (what, (out, took)) in [
        ("status", runs.next().unwrap()),
        ("no credentials", runs.next().unwrap()),
        ("publish", runs.next().unwrap()),
    ] {
        assert!(
            took < Duration::from_secs(25),
            "{what}: {took:?}\n{}",
            stderr(&out)
        );
        let line = error_line(&out);
        if what == "no credentials" {
            assert_eq!(out.status.code(), Some(78), "{what}: {line}");
            assert!(
                line.contains("no credentials")
                    && line.contains("AWS_ACCESS_KEY_ID")
                    && line.contains(&format!("127.0.0.1:{hole}")),
                "{line}"
            );
        } else {
            assert_eq!(out.status.code(), Some(69), "{what}: {line}");
            assert!(
                line.contains(&format!("127.0.0.1:{dead}"))
                    && line.contains("Connection refused")
                    && line.contains("AWS_ENDPOINT"),
                "{what}: {line}"
            );
            // Each retry is one line at the default log level.
            let err = stderr(&out);
            let retries: Vec<&str> = err.lines().filter(|l| l.contains("retry")).collect();
            assert!(retries.len() >= 3, "{what}: retries not logged:\n{err}");
            assert!(
                retries
                    .iter()
                    .all(|l| l.contains("INFO") && l.contains("backing off")),
                "{err}"
            );
        }
    }
}

// ---- one error line, exit codes ----------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_bucket_is_one_short_line_and_the_same_exit_code_everywhere() {
    // A bucket-name typo against moto (the bucket `weights` exists).
    common::moto_bucket("weights").await;
    let port = common::moto().port;
    let work = tempfile::tempdir().unwrap();
    save(
        &Generator::new(GeneratorConfig::tiny(2)),
        &work.path().join("ckpt/model.safetensors"),
        &[],
    );
    let store = "s3://wieghts/policy";
    let ckpt = work.path().join("ckpt");
    let state = work.path().join("state");
    let out = work.path().join("out");
    let dest = format!("file://{}/regional", work.path().display());
    let cases: Vec<Vec<&str>> = vec![
        vec!["status", "--store", store],
        vec!["gc", "--store", store],
        vec![
            "subscribe",
            "--once",
            "-q",
            "--store",
            store,
            "--out",
            out.to_str().unwrap(),
        ],
        vec![
            "publish",
            "-q",
            "--store",
            store,
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "--state",
            state.to_str().unwrap(),
        ],
        vec!["relay", "--once", "--from", store, "--to", &dest],
    ];
    for args in cases {
        let mut c = wc(&args);
        c.env("AWS_ENDPOINT", format!("http://127.0.0.1:{port}"))
            .env("AWS_ALLOW_HTTP", "true")
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_REGION", "us-east-1");
        let (o, _) = timed(c);
        let line = error_line(&o);
        assert_eq!(o.status.code(), Some(78), "{args:?}: {line}");
        assert!(
            line.matches("NoSuchBucket").count() == 1 && !line.contains("<?xml"),
            "{args:?}: the XML body quoted once, shortened: {line}"
        );
        assert!(
            line.contains("wieghts") && line.contains("create it"),
            "{line}"
        );
        assert!(line.len() < 700, "{args:?}: {} bytes: {line}", line.len());
        assert!(stderr(&o).len() < 1500, "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn one_exit_code_table_in_readme_and_help_and_one_code_per_condition() {
    use weightcast::error::EXIT_CODES;
    // README's table is the library's, row for row.
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = &readme[readme.find("## Exit codes").expect("an exit-code section")..];
    let rows: Vec<(i32, String)> = section
        .lines()
        .skip_while(|l| !l.starts_with("| code"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            (
                cells[1].trim_matches('`').parse().unwrap(),
                cells[2].trim_matches('`').to_string(),
            )
        })
        .collect();
    let table: Vec<(i32, String)> = EXIT_CODES
        .iter()
        .map(|(c, n, _)| (*c, n.to_string()))
        .collect();
    assert_eq!(rows, table, "README's exit codes differ from the binary's");
    // Every command's --help ends with it.
    for path in [vec![], vec!["publish"], vec!["subscribe"], vec!["inspect"]] {
        let help = stdout(
            &wc(&[path.clone(), vec!["--help"]].concat())
                .output()
                .unwrap(),
        );
        for (code, name, _) in EXIT_CODES {
            assert!(
                help.lines()
                    .any(|l| l.trim_start().starts_with(&format!("{code} ")) && l.contains(name)),
                "`weightcast {path:?} --help` lacks exit code {code}:\n{help}"
            );
        }
    }

    // The same condition, the same code, from every command.
    let work = tempfile::tempdir().unwrap();
    let missing = work.path().join("missing.safetensors");
    let m = missing.to_str().unwrap();
    let bucket = format!("file://{}/bucket", work.path().display());
    let out = work.path().join("out");
    let state = work.path().join("state");
    let code = |args: &[&str]| {
        let o = wc(args).output().unwrap();
        (o.status.code(), stderr(&o))
    };
    // A missing file: 66.
    for args in [
        vec![
            "publish",
            "--store",
            &bucket,
            "--checkpoint",
            m,
            "--state",
            state.to_str().unwrap(),
        ],
        vec!["inspect", m],
        vec!["diff", "--base", m, "--new", m, "--out", m],
        vec!["apply", "--base", m, "--delta", m, "--out", m],
    ] {
        let (c, err) = code(&args);
        assert_eq!(c, Some(66), "{args:?}: {err}");
    }
    // No version in the bucket: 66 too.
    let (c, err) = code(&[
        "subscribe",
        "--once",
        "--store",
        &bucket,
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(c, Some(66), "{err}");
    // A command line the parser refuses: 64.
    for args in [
        vec!["publish", "--bogus"],
        vec![
            "subscribe",
            "--store",
            &bucket,
            "--out",
            "o",
            "--slots",
            "1",
        ],
        vec![
            "subscribe",
            "--store",
            &bucket,
            "--out",
            "o",
            "--id",
            "no spaces",
        ],
        vec!["gc", "--store", &bucket, "--keep-anchors", "0"],
    ] {
        let (c, err) = code(&args);
        assert_eq!(c, Some(64), "{args:?}: {err}");
    }
    // A store URL that is no URL: configuration, 78, with the fix.
    let (c, err) = code(&["status", "--store", work.path().to_str().unwrap()]);
    assert_eq!(c, Some(78), "{err}");
    assert!(
        err.contains(&format!("file://{}", work.path().display())),
        "{err}"
    );
    let (c, err) = code(&["status", "--store", "s3://"]);
    assert_eq!(c, Some(78), "{err}");
    assert!(err.contains("s3://BUCKET/PREFIX"), "{err}");
    // A refused notification is no configuration error.
    let key = weightcast::notify::Key::new("notify-secret-0123456789").unwrap();
    let e = key.verify(None, None, b"{}", 0).unwrap_err();
    assert_eq!(e.kind(), weightcast::error::ErrorKind::BadRequest);
    assert!(!e.to_string().contains("configuration"), "{e}");
}

// ---- 5. arguments -------------------------------------------------------

#[tokio::test]
async fn arguments_are_checked_by_the_parser() {
    let work = tempfile::tempdir().unwrap();
    let bucket = format!("file://{}/bucket", work.path().display());
    for encoding in ["full", "planes"] {
        for args in [
            vec![
                "publish",
                "--store",
                &bucket,
                "--checkpoint",
                "x",
                "--encoding",
                encoding,
            ],
            vec![
                "diff",
                "--base",
                "a",
                "--new",
                "b",
                "--out",
                "c",
                "--encoding",
                encoding,
            ],
            vec!["demo", "--encoding", encoding],
        ] {
            let o = wc(&args).output().unwrap();
            assert_eq!(o.status.code(), Some(64), "{args:?}");
            let err = stderr(&o);
            assert!(
                err.contains("[possible values: compact, compact2, trl]"),
                "{args:?}: {err}"
            );
        }
    }
    let help = stdout(&wc(&["publish", "--help"]).output().unwrap());
    assert!(
        help.contains("[possible values: compact, compact2, trl]"),
        "{help}"
    );
    // A relay's two ends may not be the same store.
    let same = [
        (bucket.clone(), format!("{bucket}/")),
        (
            "s3://weights/policy".to_string(),
            "S3://weights/policy/".to_string(),
        ),
    ];
    for (from, to) in same {
        let o = wc(&["relay", "--once", "--from", &from, "--to", &to])
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(64), "{from} {to}");
        assert!(stderr(&o).contains("the same store"), "{}", stderr(&o));
    }
    // The library refuses an anchor encoding for deltas, naming the two.
    let cfg = weightcast::publisher::PublisherConfig {
        encoding: weightcast::format::Encoding::Planes,
        ..weightcast::publisher::PublisherConfig::new(work.path().join("state"))
    };
    let e = match weightcast::publisher::Publisher::open(
        weightcast::store::Store::open("memory://").unwrap(),
        cfg,
    )
    .await
    {
        Ok(_) => panic!("a planes delta encoding was accepted"),
        Err(e) => e,
    };
    assert_eq!(e.kind(), weightcast::error::ErrorKind::Config, "{e}");
    assert!(e.to_string().contains("compact, compact2 or trl"), "{e}");
}

// ---- 2, 4, 6, 8: per-step names, metadata, reports ---------------------

#[test]
fn per_step_file_names_publish_deltas_into_one_stable_replica_file() {
    let work = tempfile::tempdir().unwrap();
    let bucket = format!("file://{}/bucket", work.path().display());
    let state = work.path().join("state");
    let out = work.path().join("replica");
    let mut g = Generator::new(GeneratorConfig::tiny(3));
    let mut kinds = Vec::new();
    for step in 1..=3u64 {
        if step > 1 {
            g.step();
        }
        let file = work
            .path()
            .join(format!("checkpoints/step-{step}.safetensors"));
        save(&g, &file, &[("step", &step.to_string())]);
        let o = wc(&[
            "publish",
            "-q",
            "--store",
            &bucket,
            "--state",
            state.to_str().unwrap(),
            "--checkpoint",
            file.to_str().unwrap(),
        ])
        .output()
        .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        let p = json_line(&stdout(&o));
        kinds.push(p["kind"].as_str().unwrap().to_string());
        // Egress and fan-out, on every publish.
        let bytes = p["bytes"].as_u64().unwrap();
        assert!(p["egress_bytes"].as_u64().unwrap() > bytes, "{p}");
        assert_eq!(p["fanout_bytes"].as_u64(), Some(bytes), "{p}");
        assert_eq!(p["fanout_subscribers"].as_u64(), Some(0), "{p}");

        let o = wc(&[
            "subscribe",
            "--once",
            "-q",
            "--store",
            &bucket,
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        let c = json_line(&stdout(&o));
        assert_eq!(c["version"].as_u64(), Some(step - 1), "{c}");
        // The replica's one file keeps its name.
        assert_eq!(
            files_under(&out.join("current")),
            ["model.safetensors"],
            "step {step}"
        );
        // ... and its metadata is the version's, deltas included.
        let held = weightcast::tensors::TensorSet::read(
            &out.join("current/model.safetensors"),
            weightcast::tensors::Digests::Compute,
        )
        .unwrap();
        assert_eq!(
            held.metadata().get("step").map(String::as_str),
            Some(step.to_string().as_str()),
            "version {}",
            step - 1
        );
        assert_eq!(held.digest(), g.snapshot().digest());
        // The report accounts for the version's time and bytes.
        for f in ["fetch_s", "prepare_s", "pause_s", "apply_s"] {
            assert!(c[f].as_f64().is_some_and(|s| s >= 0.0), "{f}: {c}");
        }
        assert_eq!(c["bytes_downloaded"], c["downloaded"], "{c}");
        assert_eq!(c["bytes_written"], c["written_bytes"], "{c}");
        assert!(c["bytes_downloaded"].as_u64().unwrap() > 0, "{c}");
        // After an anchor every tensor is listed as changed.
        let changed = c["changed_tensors"].as_array().cloned().unwrap_or_default();
        if step == 1 {
            assert_eq!(changed.len(), g.snapshot().len(), "{c}");
        } else {
            assert!(!changed.is_empty(), "{c}");
        }
    }
    assert_eq!(kinds, ["anchor", "delta", "delta"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deltas_carry_the_checkpoints_metadata_into_every_replica() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let mut publisher = weightcast::publisher::Publisher::open(
        store.clone(),
        common::publisher_config(&work.path().join("state"), 10, None),
    )
    .await
    .unwrap();
    let mut g = Generator::new(GeneratorConfig::tiny(4));
    let follower = work.path().join("follower");
    let step_of = |dir: &Path| {
        weightcast::tensors::TensorSet::read(
            &dir.join("current/model.safetensors"),
            weightcast::tensors::Digests::Skip,
        )
        .unwrap()
        .metadata()
        .get("step")
        .cloned()
    };
    for step in 1..=4u64 {
        if step > 1 {
            g.step();
        }
        let path = work
            .path()
            .join(format!("ckpt/step-{step}/model.safetensors"));
        save(&g, &path, &[("step", &step.to_string()), ("format", "pt")]);
        publisher
            .publish_path(path.parent().unwrap(), &Default::default())
            .await
            .unwrap();
        // A follower applies each delta (alternating slots, each brought
        // forward from the journal); a newcomer replays from the anchor.
        weightcast::subscriber::catch_up(&store, &follower)
            .await
            .unwrap();
        assert_eq!(step_of(&follower), Some(step.to_string()), "follower");
        let newcomer = work.path().join(format!("newcomer-{step}"));
        weightcast::subscriber::catch_up(&store, &newcomer)
            .await
            .unwrap();
        assert_eq!(step_of(&newcomer), Some(step.to_string()), "newcomer");
    }
}

// ---- 3. absolute paths; status and metrics accounting ------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relative_out_reaches_hooks_environment_webhooks_and_status_as_absolute() {
    let work = tempfile::tempdir().unwrap();
    let bucket = format!("file://{}/bucket", work.path().display());
    let g = Generator::new(GeneratorConfig::tiny(5));
    save(&g, &work.path().join("ckpt/model.safetensors"), &[]);
    let o = wc(&[
        "publish",
        "-q",
        "--store",
        &bucket,
        "--state",
        "state",
        "--checkpoint",
        "ckpt",
    ])
    .current_dir(work.path())
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let (engine, engine_log) = crate::hooks::recorder().await;
    let (hook, hook_log) = crate::hooks::recorder().await;
    let want = work.path().join("rel/out/current");
    let o = tokio::task::spawn_blocking({
        let (bucket, work) = (bucket.clone(), work.path().to_path_buf());
        move || {
            wc(&[
                "subscribe",
                "--once",
                "-q",
                "--store",
                &bucket,
                "--out",
                "rel/out",
                "--hook",
                &format!("sglang:{engine}"),
                "--hook",
                &format!("webhook:{hook}/weights"),
                "--hook",
                "command:printf %s \"$WEIGHTCAST_DIR\" > dir-seen",
            ])
            .current_dir(&work)
            .output()
            .unwrap()
        }
    })
    .await
    .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let sglang = engine_log.lock().unwrap().clone();
    let reload = sglang
        .iter()
        .find(|(p, _)| p.contains("update_weights_from_disk"))
        .expect("a reload");
    let body: serde_json::Value = serde_json::from_str(&reload.1).unwrap();
    assert_eq!(body["model_path"].as_str(), Some(want.to_str().unwrap()));
    let webhook: serde_json::Value = serde_json::from_str(&hook_log.lock().unwrap()[0].1).unwrap();
    assert_eq!(webhook["dir"].as_str(), Some(want.to_str().unwrap()));
    let seen = std::fs::read_to_string(work.path().join("dir-seen")).unwrap();
    assert_eq!(seen, want.to_str().unwrap());

    // The daemon's status names it absolute too, and accounts the version.
    let key = "notify-secret-0123456789";
    let mut daemon = wc(&[
        "subscribe",
        "-q",
        "--store",
        &bucket,
        "--out",
        "rel/daemon",
        "--listen",
        "127.0.0.1:0",
        "--notify-key",
        key,
    ])
    .current_dir(work.path())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let logged = common::bound_address(
        &mut daemon,
        "the subscriber daemon",
        Duration::from_secs(60),
    );
    let port = logged.addr.port();
    weightcast::store::install_crypto_provider();
    let client = common::http_client();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        let r = client
            .get(format!("http://127.0.0.1:{port}/v1/status"))
            .bearer_auth(key)
            .send()
            .await;
        if let Ok(r) = r {
            let v: serde_json::Value = r.json().await.unwrap();
            if v["status"]["version"].as_u64() == Some(0) {
                break v;
            }
        }
        if Instant::now() > deadline || daemon.try_wait().unwrap().is_some() {
            let _ = daemon.kill();
            let _ = daemon.wait();
            panic!("the daemon did not reach version 0:\n{}", logged.text());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let metrics = client
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let _ = daemon.kill();
    let _ = daemon.wait();
    let s = &status["status"];
    assert_eq!(
        s["dir"].as_str(),
        Some(work.path().join("rel/daemon/current").to_str().unwrap()),
        "{s}"
    );
    for f in ["fetch_s", "prepare_s", "pause_s", "apply_s"] {
        assert!(s[f].as_f64().is_some(), "{f}: {s}");
        assert!(s["last_version"][f].as_f64().is_some(), "{f}: {s}");
    }
    assert!(
        s["last_version"]["bytes_downloaded"].as_u64().unwrap() > 0,
        "{s}"
    );
    assert!(
        s["last_version"]["bytes_written"].as_u64().unwrap() > 0,
        "{s}"
    );
    // No hooks configured: no hook runs counted.
    assert_eq!(s["hook_runs"].as_u64(), Some(0), "{s}");
    for phase in ["fetch", "prepare", "pause", "apply"] {
        assert!(
            metrics.contains(&format!("weightcast_version_seconds{{phase=\"{phase}\"}}")),
            "{metrics}"
        );
    }
    assert!(
        metrics.contains("weightcast_version_bytes{kind=\"downloaded\"}"),
        "{metrics}"
    );
}

// ---- 6. smaller problems -----------------------------------------------

/// `RUST_LOG=weightcast=debug` shows the debug events (the fmt subscriber's
/// own INFO cap hid them), and the default filter does not.
#[test]
fn rust_log_debug_shows_debug_events() {
    let work = tempfile::tempdir().unwrap();
    let g = Generator::new(GeneratorConfig::tiny(6));
    save(&g, &work.path().join("ckpt/model.safetensors"), &[]);
    let publish = |state: &str, log: Option<&str>| {
        let mut c = wc(&["publish", "-q", "--store"]);
        c.arg(format!(
            "file://{}",
            work.path().join(state).join("b").display()
        ))
        .arg("--state")
        .arg(work.path().join(state).join("s"))
        .arg("--checkpoint")
        .arg(work.path().join("ckpt"));
        if let Some(l) = log {
            c.env("RUST_LOG", l);
        }
        let (o, _) = timed(c);
        assert!(o.status.success(), "{}", stderr(&o));
        stderr(&o)
    };
    let debug = publish("one", Some("weightcast=debug"));
    assert!(
        debug.contains("DEBUG") && debug.contains("anchor: snapshot file written"),
        "no debug events under RUST_LOG=weightcast=debug:\n{debug}"
    );
    let default = publish("two", None);
    assert!(
        !default.contains("DEBUG"),
        "debug events by default:\n{default}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smaller_problems_of_the_first_hour() {
    // An invalid id refuses to start (the library too), instead of running
    // unregistered.
    let work = tempfile::tempdir().unwrap();
    let store = weightcast::store::Store::open("memory://").unwrap();
    let cfg = weightcast::subscriber::DaemonConfig {
        id: Some("node 1".into()),
        ..weightcast::subscriber::DaemonConfig::new(&work.path().join("out"))
    };
    let e = weightcast::subscriber::Daemon::open(&store, &cfg).unwrap_err();
    assert_eq!(e.kind(), weightcast::error::ErrorKind::Config, "{e}");

    // gc leaves no empty directories in a file:// bucket.
    let bucket_dir = work.path().join("bucket");
    let bucket = format!("file://{}", bucket_dir.display());
    let state = work.path().join("state");
    let mut g = Generator::new(GeneratorConfig::tiny(6));
    for step in 0..4 {
        if step > 0 {
            g.step();
        }
        save(&g, &work.path().join("ckpt/model.safetensors"), &[]);
        let o = wc(&[
            "publish",
            "-q",
            "--anchor-every",
            "1",
            "--store",
            &bucket,
            "--state",
            state.to_str().unwrap(),
            "--checkpoint",
            work.path().join("ckpt").to_str().unwrap(),
        ])
        .output()
        .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let o = wc(&["gc", "--store", &bucket, "--keep-anchors", "1"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let collected = json_line(&stdout(&o));
    assert!(collected["objects"].as_u64().unwrap() > 0, "{collected}");
    let empty: Vec<PathBuf> = walk(&bucket_dir)
        .into_iter()
        .filter(|d| d.is_dir() && std::fs::read_dir(d).unwrap().next().is_none())
        .collect();
    assert!(empty.is_empty(), "gc left empty directories: {empty:?}");

    // `status` and `inspect` print one line; --pretty asks for more.
    let o = wc(&["status", "--store", &bucket]).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    json_line(&stdout(&o));
    let anchor = walk(&bucket_dir.join("anchors"))
        .into_iter()
        .find(|p| p.is_file())
        .unwrap();
    for args in [vec!["inspect"], vec!["inspect", "--full"]] {
        let o = wc(&[args, vec![anchor.to_str().unwrap()]].concat())
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        json_line(&stdout(&o));
    }
    let o = wc(&["--pretty", "status", "--store", &bucket])
        .output()
        .unwrap();
    assert!(stdout(&o).lines().count() > 3, "{}", stdout(&o));
}

// ---- 7. the docs a new user needs --------------------------------------

fn doc(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The text of a markdown section, from its heading to the next one of the
/// same level or above.
fn section<'a>(text: &'a str, heading: &str) -> &'a str {
    let start = text
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("no section `{heading}`"))
        + 1;
    let level = heading.split(' ').next().unwrap();
    let rest = &text[start + heading.len()..];
    let end = rest
        .match_indices("\n#")
        .find(|(i, _)| {
            let h = rest[i + 1..].split(' ').next().unwrap();
            h.chars().all(|c| c == '#') && h.len() <= level.len()
        })
        .map_or(rest.len(), |(i, _)| i);
    &text[start..start + heading.len() + end]
}

#[test]
fn the_docs_a_new_user_needs_are_there() {
    // README: the two commands first, then an install section.
    let readme = doc("README.md");
    let first_block = readme.split("```sh\n").nth(1).unwrap();
    assert!(
        first_block.starts_with("cargo run --release -- demo")
            && first_block.contains("./scripts/test.sh"),
        "{first_block}"
    );
    let install = section(&readme, "## Install");
    for cmd in [
        "cargo install --path .",
        "pip install ./python",
        "docker build -f deploy/Dockerfile",
    ] {
        assert!(
            install.contains(cmd),
            "README's install section lacks `{cmd}`"
        );
    }
    // docs/stores.md: each store, its bucket and its minimal permissions,
    // the registrations under subscribers/ included; its policies parse.
    let stores = doc("docs/stores.md");
    for (heading, needs) in [
        (
            "## AWS S3",
            &["create-bucket", "s3:ListBucket", "policy/subscribers/*"][..],
        ),
        (
            "## MinIO, without Docker",
            &["minio server", "mc mb", "mc admin policy"][..],
        ),
        (
            "## Google Cloud Storage",
            &[
                "buckets create",
                "storage.objects.list",
                "policy/subscribers/",
            ][..],
        ),
        (
            "## Azure Blob Storage",
            &[
                "container create",
                "Storage Blob Data Reader",
                "policy/subscribers/",
            ][..],
        ),
    ] {
        let s = section(&stores, heading);
        for n in needs {
            assert!(s.contains(n), "docs/stores.md {heading} lacks `{n}`");
        }
    }
    for block in stores.split("```json\n").skip(1) {
        let json = block.split("```").next().unwrap();
        serde_json::from_str::<serde_json::Value>(json)
            .unwrap_or_else(|e| panic!("a policy in docs/stores.md is not JSON ({e}):\n{json}"));
    }
    // The Kubernetes example's comments and sizes agree with operations.md:
    // no "upcoming" layout, the sidecar's memory as documented.
    let k8s = doc("deploy/k8s/subscriber-sidecar.yaml");
    assert!(!k8s.to_lowercase().contains("upcoming"), "stale comment");
    let ops = doc("docs/operations.md");
    let kube = section(&ops, "## Kubernetes: the subscriber as a sidecar");
    assert!(kube.contains("1Gi of memory"), "{kube}");
    let limits: Vec<&str> = k8s
        .split("- name: ")
        .filter(|c| c.starts_with("weightcast"))
        .filter_map(|c| c.split("memory: ").nth(1))
        .map(|m| m.lines().next().unwrap().trim())
        .collect();
    assert_eq!(limits, ["1Gi", "1Gi"], "the weightcast containers' memory");
    assert!(!kube.contains("17Gi"), "{kube}");
    // Integrations: which to pick, and the dev-mode warning.
    let integrations = doc("docs/integrations.md");
    let pick = section(&integrations, "## Which integration");
    assert!(pick.contains("| your engine | pick |"), "{pick}");
    assert!(
        pick.contains("VLLM_SERVER_DEV_MODE=1` exposes `/collective_rpc`"),
        "{pick}"
    );
    assert!(
        k8s.contains("/collective_rpc runs any method"),
        "k8s warning"
    );
}
