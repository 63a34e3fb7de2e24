//! Real object-store servers on loopback for the integration tests.
//!
//! Each server is a child process on a free port, started once per test binary
//! and killed when the binary exits. A missing server binary is a test failure
//! with instructions, never a silent skip: `./scripts/test.sh` installs them.
#![allow(dead_code)]

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// A running server process.
pub struct Server {
    pub port: u16,
    child: Mutex<Child>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(mut c) = self.child.lock() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding an ephemeral loopback port")
        .port()
}

fn wait_for(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{what} did not start listening on 127.0.0.1:{port} within 60 s");
}

fn spawn(program: &str, args: &[String], what: &str, port: u16) -> Server {
    let child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start {what} (`{program}`): {e}. Run the suite with ./scripts/test.sh, \
                 which installs it (pip install 'moto[server]')"
            )
        });
    wait_for(port, what);
    Server {
        port,
        child: Mutex::new(child),
    }
}

/// moto's S3 server (enforces `If-None-Match: *` on PutObject).
pub fn moto() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| {
        let port = free_port();
        let program = std::env::var("MOTO_SERVER").unwrap_or_else(|_| "moto_server".into());
        spawn(
            &program,
            &[
                "-H".into(),
                "127.0.0.1".into(),
                "-p".into(),
                port.to_string(),
            ],
            "moto_server",
            port,
        )
    })
}

/// Creates an S3 bucket on moto (moto accepts unsigned requests).
pub async fn moto_bucket(name: &str) {
    let port = moto().port;
    let r = reqwest::Client::new()
        .put(format!("http://127.0.0.1:{port}/{name}"))
        .send()
        .await
        .expect("moto create-bucket request");
    assert!(
        r.status().is_success(),
        "moto create bucket {name}: {}",
        r.status()
    );
}

/// Store options that point object_store's S3 client at moto.
pub fn moto_options() -> Vec<(String, String)> {
    let port = moto().port;
    vec![
        ("aws_endpoint".into(), format!("http://127.0.0.1:{port}")),
        ("aws_allow_http".into(), "true".into()),
        ("aws_access_key_id".into(), "test".into()),
        ("aws_secret_access_key".into(), "test".into()),
        ("aws_region".into(), "us-east-1".into()),
    ]
}

/// A store on a local directory (kept alive by the returned guard).
pub fn local_store() -> (weightcast::store::Store, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let url = url::Url::from_directory_path(dir.path()).expect("absolute path");
    (
        weightcast::store::Store::open(url.as_str()).expect("local store"),
        dir,
    )
}

/// A store on a fresh moto bucket, under `prefix`.
pub async fn moto_store(bucket: &str, prefix: &str) -> weightcast::store::Store {
    moto_bucket(bucket).await;
    let o = moto_options();
    let opts: Vec<(&str, &str)> = o.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    weightcast::store::Store::open_with(&format!("s3://{bucket}/{prefix}"), &opts)
        .expect("s3 store")
}

/// A compact-encoding publisher configuration for tests.
pub fn publisher_config(
    state_dir: &std::path::Path,
    anchor_every: u64,
    notify_key: Option<weightcast::notify::Key>,
) -> weightcast::publisher::PublisherConfig {
    weightcast::publisher::PublisherConfig {
        state_dir: state_dir.to_path_buf(),
        encoding: weightcast::format::Encoding::Compact,
        anchors: weightcast::publisher::AnchorPolicy {
            every: anchor_every,
            ..Default::default()
        },
        single_writer: false,
        notify_urls: Vec::new(),
        notify_key,
        retention: None,
    }
}
