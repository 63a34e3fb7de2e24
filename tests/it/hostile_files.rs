//! What a `file://` bucket can hold that no object store can, and sizes a
//! manifest declares: neither may hang a subscriber, keep it from stopping,
//! or make it allocate what the bucket does not hold (docs/reliability.md,
//! "Hostile bucket").

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::protocol::{ObjectRole, read_manifest};
use weightcast::store::Store;

use crate::common;

const KEY: &str = "hostile-files-notify-key-0123";

/// Publishes `versions` of a small model (seeded, one training step per
/// version) into the bucket directory `work/bucket`; returns its URL.
fn publish(work: &Path, versions: std::ops::Range<u64>) -> String {
    let dir = work.join("bucket");
    std::fs::create_dir_all(&dir).unwrap();
    let url = url::Url::from_directory_path(&dir).unwrap().to_string();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store = Store::open(&url).unwrap();
        let mut p = weightcast::publisher::Publisher::open(
            store,
            common::publisher_config(&work.join("state"), 10, None),
        )
        .await
        .unwrap();
        let mut g = Generator::new(GeneratorConfig::with_elements(5, 1 << 18));
        for v in 0..versions.end {
            if v > 0 {
                g.step();
            }
            if v < versions.start {
                continue;
            }
            let cp = weightcast::publisher::Checkpoint::from_sets(
                [("model.safetensors".to_string(), g.snapshot())].into(),
                Default::default(),
            )
            .unwrap();
            let out = p.publish(cp, &Default::default()).await.unwrap();
            assert_eq!(out.version, v);
        }
    });
    url
}

/// The key of the object of `role` in `version`'s manifest.
fn object_key(url: &str, version: u64, role: ObjectRole) -> String {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = Store::open(url).unwrap();
    let m = rt
        .block_on(read_manifest(&store, version))
        .unwrap()
        .unwrap();
    m.objects
        .iter()
        .find(|o| o.role == role)
        .expect("an object of that role")
        .key
        .clone()
}

fn weightcast() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_weightcast"));
    c.env_remove("WEIGHTCAST_STORE")
        .env_remove("WEIGHTCAST_FAILPOINT")
        .env("RUST_LOG", "weightcast=info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null());
    c
}

/// Waits for `child` at most `within`; kills it and panics after that.
fn wait(child: &mut Child, within: Duration, what: &str) -> (std::process::ExitStatus, Duration) {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return (status, started.elapsed());
        }
        if started.elapsed() > within {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running after {within:?} (killed)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Everything the child wrote on a pipe, read on a thread.
fn drain(pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::BufReader::new(pipe).read_to_string(&mut s);
        s
    })
}

/// `GET path` from `addr` with the notify key: (status code, body).
fn get(addr: &str, path: &str) -> (u16, String) {
    let mut conn = std::net::TcpStream::connect(addr).expect("connecting to the daemon");
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        conn,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\nAuthorization: Bearer {KEY}\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    conn.read_to_string(&mut reply).unwrap();
    let code = reply
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = reply.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (code, body.to_string())
}

/// Replaces the file at `path` with a symbolic link to a new FIFO.
fn fifo_in_place_of(path: &Path, work: &Path) -> PathBuf {
    let fifo = work.join("fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success(), "mkfifo {}", fifo.display());
    std::fs::remove_file(path).unwrap();
    std::os::unix::fs::symlink(&fifo, path).unwrap();
    fifo
}

#[test]
fn a_fifo_in_a_file_bucket_is_refused_promptly_and_sigterm_is_honoured() {
    let work = tempfile::tempdir().unwrap();
    let url = publish(work.path(), 0..1);
    let key = object_key(&url, 0, ObjectRole::Anchor);
    fifo_in_place_of(&work.path().join("bucket").join(&key), work.path());

    // One catch-up: refused at once, the object named, a failure exit.
    let out = work.path().join("once");
    let mut once = weightcast()
        .args(["subscribe", "--quiet", "--once", "--store", &url, "--out"])
        .arg(&out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = drain(once.stderr.take().unwrap());
    let (status, took) = wait(&mut once, Duration::from_secs(30), "subscribe --once");
    let stderr = stderr.join().unwrap();
    assert!(!status.success(), "subscribe --once succeeded: {stderr}");
    assert!(took < Duration::from_secs(10), "took {took:?}: {stderr}");
    assert!(
        stderr.contains(&key) && stderr.contains("not a regular file"),
        "{stderr}"
    );
    assert!(!out.join("current").exists(), "nothing was switched in");

    // The daemon keeps serving, says what is wrong, and stops on SIGTERM.
    let mut daemon = weightcast()
        .args(["subscribe", "--quiet", "--store", &url, "--out"])
        .arg(work.path().join("daemon"))
        .args(["--listen", "127.0.0.1:0", "--poll-interval", "0.3"])
        .args(["--notify-key", KEY])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let daemon_log =
        crate::common::bound_address(&mut daemon, "the daemon", Duration::from_secs(30));
    let addr = daemon_log.addr.to_string();
    let started = Instant::now();
    let status = loop {
        let (code, body) = get(&addr, "/v1/status");
        assert_eq!(code, 200, "{body}");
        if body.contains("not a regular file") && body.contains(&key) {
            break body;
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = daemon.kill();
            panic!(
                "/v1/status never reported the FIFO: {body}\n{}",
                daemon_log.text()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let (code, why) = get(&addr, "/healthz");
    assert_eq!(
        code, 503,
        "/healthz with a failing catch-up: {why} ({status})"
    );
    let ok = Command::new("kill")
        .args(["-TERM", &daemon.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -TERM");
    let (exit, took) = wait(
        &mut daemon,
        Duration::from_secs(15),
        "the daemon after SIGTERM",
    );
    assert!(exit.success(), "{exit}: {}", daemon_log.text());
    assert!(took < Duration::from_secs(5), "stopped after {took:?}");
}

/// Peak resident memory of a running process (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Where `DIR/current` points and the BLAKE3 of its model file.
fn replica(out: &Path) -> (PathBuf, String) {
    let current = out.join("current");
    let target = std::fs::read_link(&current).unwrap();
    let bytes = std::fs::read(current.join("model.safetensors")).unwrap();
    (target, blake3::hash(&bytes).to_hex().to_string())
}

/// The size a forged manifest declares for a small delta.
const FORGED: u64 = 10 << 30;

#[test]
fn a_forged_declared_size_allocates_nothing_and_leaves_the_replica_unchanged() {
    let work = tempfile::tempdir().unwrap();
    let url = publish(work.path(), 0..1);
    let out = work.path().join("out");
    let once = || {
        weightcast()
            .args(["subscribe", "--quiet", "--once", "--store", &url, "--out"])
            .arg(&out)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut first = once();
    let (status, _) = wait(&mut first, Duration::from_secs(60), "the first subscribe");
    assert!(status.success(), "the follower reaches version 0");
    let before = replica(&out);

    // Version 1 is a real delta of a few MB; its manifest is rewritten to
    // declare 10 GiB for it (the bucket's writer can).
    publish(work.path(), 1..2);
    let key = object_key(&url, 1, ObjectRole::Delta);
    let manifest = work
        .path()
        .join("bucket/versions/00000000000000000001.json");
    let mut m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    for o in m["objects"].as_array_mut().unwrap() {
        if o["key"] == key.as_str() {
            o["size"] = FORGED.into();
        }
    }
    std::fs::write(&manifest, serde_json::to_vec(&m).unwrap()).unwrap();

    let mut child = once();
    let (stdout, stderr) = (
        drain(child.stdout.take().unwrap()),
        drain(child.stderr.take().unwrap()),
    );
    let started = Instant::now();
    let mut peak = 0;
    let status = loop {
        if let Some(p) = peak_rss(child.id()) {
            peak = peak.max(p);
        }
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("subscribe --once still running after 120 s (peak RSS {peak} bytes)");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let (stdout, stderr) = (stdout.join().unwrap(), stderr.join().unwrap());
    assert!(
        peak < 1 << 30,
        "peak RSS {peak} bytes for a delta declared at {FORGED} bytes\n{stderr}"
    );
    // The version is refused, naming the object: a failure exit, or (a
    // follower holding a verified version) the version quarantined.
    assert!(
        stderr.contains(&key) || stdout.contains(&key),
        "the refusal does not name {key}:\n{stdout}\n{stderr}"
    );
    if status.success() {
        let line: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(line["version"], 0, "{line}");
        assert_eq!(line["quarantined"][0]["version"], 1, "{line}");
    }
    assert_eq!(replica(&out), before, "the replica changed");
    eprintln!("peak RSS {peak} bytes for a delta declared at {FORGED} bytes ({status})");
}
