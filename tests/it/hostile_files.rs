//! What a `file://` bucket can hold that no object store can, and sizes a
//! manifest declares: neither may hang a subscriber, keep it from stopping,
//! or make it allocate what the bucket does not hold (docs/reliability.md,
//! "Hostile bucket").

use std::io::{BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::protocol::{ObjectRole, read_manifest};
use weightcast::store::Store;

use crate::common;

const KEY: &str = "hostile-files-notify-key-0123";

/// A bucket directory with versions 0 (an anchor) and, with `delta`, 1 (a
/// delta), of a small model; returns the bucket's URL.
fn bucket(work: &Path, delta: bool) -> String {
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
        let mut g = Generator::new(GeneratorConfig::with_elements(5, 1 << 20));
        for v in 0..if delta { 2 } else { 1 } {
            if v > 0 {
                g.step();
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
    let url = bucket(work.path(), false);
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
    let (tx, rx) = std::sync::mpsc::channel();
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let keep = log.clone();
    let stderr = daemon.stderr.take().unwrap();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if let Some(at) = line.find("127.0.0.1:")
                && let Some(tx) = tx.take()
            {
                let port: String = line[at + 10..]
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .collect();
                let _ = tx.send(format!("127.0.0.1:{port}"));
            }
            keep.lock().unwrap().push_str(&format!("{line}\n"));
        }
    });
    let addr = match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(a) => a,
        Err(e) => {
            let _ = daemon.kill();
            panic!("the daemon never logged its address: {e}");
        }
    };
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
                log.lock().unwrap()
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
    assert!(exit.success(), "{exit}: {}", log.lock().unwrap());
    assert!(took < Duration::from_secs(5), "stopped after {took:?}");
}
