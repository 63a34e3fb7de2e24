//! docs/walkthrough.md runs as written: its shell blocks (after the build
//! step) against the debug binary, the test venv's Python, free ports and a
//! scratch directory. A subscriber started on an empty bucket is notified of
//! the first version (it registers before anything is published).

use std::process::Command;

#[test]
fn the_walkthrough_runs_as_written() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/walkthrough.md"))
        .unwrap();
    let blocks: Vec<&str> = doc
        .split("```bash\n")
        .skip(1)
        .map(|b| b.split("```").next().unwrap())
        .collect();
    assert!(blocks.len() >= 5, "walkthrough blocks: {}", blocks.len());
    // Block 0 builds and makes a venv: the test has both already; take its
    // exports only.
    let setup: String = blocks[0]
        .lines()
        .filter(|l| l.starts_with("export ") && !l.contains("PATH="))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(setup.contains("WEIGHTCAST_STORE"), "{setup}");
    let [p1, p2] = {
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        [
            a.local_addr().unwrap().port(),
            b.local_addr().unwrap().port(),
        ]
    };
    let python = crate::common::python();
    let body = blocks[1..]
        .join("\n")
        .replace("8470", &p1.to_string())
        .replace("8480", &p2.to_string())
        .replace("\"$WORK/py/bin/python\"", &format!("'{python}'"));
    let script = format!(
        "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n{setup}\n{body}\necho WALKTHROUGH-DONE\n"
    );
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_weightcast"))
        .parent()
        .unwrap()
        .to_path_buf();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("timeout")
        .args(["300", "bash", "-c", &script])
        .env("PATH", path)
        .env_remove("WEIGHTCAST_STORE")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("WALKTHROUGH-DONE"),
        "the walkthrough failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("replica is bit-identical to step 3"),
        "{stdout}"
    );
    // Every version was pushed to the subscriber that registered on the
    // empty bucket (its full status counts the notifications it accepted).
    assert!(stdout.contains("\"notifications\":3"), "{stdout}");
}

/// A daemon that fails to start stops the walkthrough with its error,
/// instead of a wait that never ends: the publisher block run with a token
/// the daemon refuses (under 16 characters).
#[test]
fn a_daemon_that_fails_to_start_stops_the_walkthrough_with_its_error() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/walkthrough.md"))
        .unwrap();
    let blocks: Vec<&str> = doc
        .split("```bash\n")
        .skip(1)
        .map(|b| b.split("```").next().unwrap())
        .collect();
    let setup: String = blocks[0]
        .lines()
        .filter(|l| l.starts_with("export ") && !l.contains("PATH="))
        .collect::<Vec<_>>()
        .join("\n");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let publisher = blocks[1].replace("8470", &port.to_string());
    let script = format!(
        "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n{setup}\n\
         export WEIGHTCAST_API_TOKEN=too-short\n{publisher}\necho WALKTHROUGH-GOES-ON\n"
    );
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_weightcast"))
        .parent()
        .unwrap()
        .to_path_buf();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let started = std::time::Instant::now();
    let out = Command::new("timeout")
        .args(["60", "bash", "-c", &script])
        .env("PATH", path)
        .env_remove("WEIGHTCAST_STORE")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_ne!(
        out.status.code(),
        Some(124),
        "the walkthrough waited forever"
    );
    assert!(
        !out.status.success() && !stdout.contains("WALKTHROUGH-GOES-ON"),
        "{stdout}"
    );
    assert!(
        stdout.contains("Error:") && stdout.contains("16"),
        "the daemon's error is shown: {stdout}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
}
