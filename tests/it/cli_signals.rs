//! The long-running commands stop cleanly on SIGTERM and SIGINT (what compose,
//! Kubernetes and Ctrl-C send), with exit status 0.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status()
        .expect("running kill")
        .success();
    assert!(ok, "kill -{sig} {pid}");
}

/// Starts `args` listening on port 0, learns the port it bound from its log
/// (a port picked by the test and released before the daemon binds it could
/// be taken meanwhile by another test's daemon, whose answer would then be
/// mistaken for this one's), checks it serves `/healthz`, sends `sig`, and
/// expects a clean exit within 10 s.
fn stops_on(args: &[&str], sig: &str) {
    let dir = tempfile::tempdir().unwrap();
    let store = url::Url::from_directory_path(dir.path().join("bucket")).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_weightcast"));
    for a in args {
        cmd.arg(
            a.replace("{store}", store.as_str())
                .replace("{listen}", "127.0.0.1:0")
                .replace("{dir}", dir.path().to_str().unwrap()),
        );
    }
    let mut child = cmd
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr =
        crate::common::bound_address(&mut child, &format!("{args:?}"), Duration::from_secs(30))
            .addr;
    let mut conn = std::net::TcpStream::connect(addr).expect("connecting to the daemon");
    write!(conn, "GET /healthz HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut reply = String::new();
    conn.read_to_string(&mut reply).unwrap();
    assert_eq!(
        reply.split_whitespace().nth(1),
        Some("200"),
        "{args:?} /healthz: {reply}"
    );
    signal(child.id(), sig);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "{args:?} after SIG{sig}: {status}");
            return;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{args:?} still running 10 s after SIG{sig}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

const SUBSCRIBE: &[&str] = &[
    "subscribe",
    "--store",
    "{store}",
    "--out",
    "{dir}/out",
    "--listen",
    "{listen}",
    "--poll-interval",
    "0.2",
];

const PUBLISHER: &[&str] = &[
    "publisher",
    "--store",
    "{store}",
    "--state",
    "{dir}/state",
    "--listen",
    "{listen}",
    "--token",
    "0123456789abcdef0123",
    "--checkpoint-root",
    "{dir}",
];

#[test]
fn subscriber_daemon_stops_on_sigterm_and_sigint() {
    stops_on(SUBSCRIBE, "TERM");
    stops_on(SUBSCRIBE, "INT");
}

#[test]
fn publisher_daemon_stops_on_sigterm() {
    stops_on(PUBLISHER, "TERM");
}
