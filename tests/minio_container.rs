//! Publish → subscribe through the library against a real MinIO, started with
//! testcontainers: the same image the `docker compose` playground runs (its tag
//! is read from docker-compose.yml).
//!
//! This needs a Docker daemon. Where none answers (this project's machines and
//! CI have the `docker` CLI but no engine) the round trip prints
//! `SKIPPED ...` on stderr (visible with `--nocapture`) and passes; set
//! `WEIGHTCAST_REQUIRE_DOCKER=1` to make a missing daemon a failure instead.
//! The daemon itself is probed (`GET /_ping` on `DOCKER_HOST` or the default
//! socket must answer `OK`), not the CLI. Once a daemon answers, everything
//! else (pulling the image, starting it, the round trip) must succeed.

#[path = "it/common.rs"]
mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use testcontainers::core::{CmdWaitFor, ExecCommand, IntoContainerPort};
use testcontainers::runners::AsyncRunner;
use testcontainers::{GenericImage, ImageExt};
use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::protocol::VersionKind;
use weightcast::publisher::Publisher;
use weightcast::store::Store;
use weightcast::subscriber::catch_up;
use weightcast::tensors::{Digests, TensorSet};

// ---------------------------------------------------------------------------
// Is there a Docker daemon?

/// Where the Docker daemon would listen.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Endpoint {
    Unix(PathBuf),
    Tcp(String),
}

/// `DOCKER_HOST` (`unix://PATH` or `tcp://HOST:PORT`), else the default socket.
fn docker_endpoint(docker_host: Option<&str>) -> Result<Endpoint, String> {
    match docker_host.map(str::trim).filter(|h| !h.is_empty()) {
        None => Ok(Endpoint::Unix("/var/run/docker.sock".into())),
        Some(h) => {
            if let Some(p) = h.strip_prefix("unix://") {
                Ok(Endpoint::Unix(p.into()))
            } else if let Some(a) = h.strip_prefix("tcp://") {
                Ok(Endpoint::Tcp(a.trim_end_matches('/').to_string()))
            } else {
                Err(format!(
                    "DOCKER_HOST={h}: only unix:// and tcp:// can be probed"
                ))
            }
        }
    }
}

/// `GET /_ping` must answer 200 with the body `OK`.
fn ping(endpoint: &Endpoint) -> Result<(), String> {
    const REQUEST: &[u8] = b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n";
    let timeout = Duration::from_secs(3);
    let mut answer = Vec::new();
    let exchange = |s: &mut dyn ReadWrite, answer: &mut Vec<u8>| -> std::io::Result<()> {
        s.write_all(REQUEST)?;
        s.take(64 * 1024).read_to_end(answer)?;
        Ok(())
    };
    let result = match endpoint {
        Endpoint::Unix(path) => std::os::unix::net::UnixStream::connect(path).and_then(|mut s| {
            s.set_read_timeout(Some(timeout))?;
            s.set_write_timeout(Some(timeout))?;
            exchange(&mut s, &mut answer)
        }),
        Endpoint::Tcp(addr) => {
            use std::net::ToSocketAddrs;
            addr.to_socket_addrs()
                .and_then(|mut a| a.next().ok_or_else(|| std::io::Error::other("no address")))
                .and_then(|a| std::net::TcpStream::connect_timeout(&a, timeout))
                .and_then(|mut s| {
                    s.set_read_timeout(Some(timeout))?;
                    s.set_write_timeout(Some(timeout))?;
                    exchange(&mut s, &mut answer)
                })
        }
    };
    result.map_err(|e| format!("{endpoint:?}: {e}"))?;
    let text = String::from_utf8_lossy(&answer);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status_ok = head
        .lines()
        .next()
        .is_some_and(|l| l.split_whitespace().nth(1) == Some("200"));
    if status_ok && body.trim() == "OK" {
        Ok(())
    } else {
        Err(format!(
            "{endpoint:?} answered `{}` to GET /_ping",
            head.lines().next().unwrap_or("")
        ))
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// Whether a Docker daemon answers; `Err` says why not.
fn docker_daemon() -> Result<Endpoint, String> {
    let endpoint = docker_endpoint(std::env::var("DOCKER_HOST").ok().as_deref())?;
    ping(&endpoint)?;
    Ok(endpoint)
}

/// Skips (returns false, with a visible message) when no daemon answers,
/// unless WEIGHTCAST_REQUIRE_DOCKER=1 makes that a failure.
fn docker_or_skip(test: &str) -> bool {
    match docker_daemon() {
        Ok(_) => true,
        Err(why) => {
            let required = std::env::var("WEIGHTCAST_REQUIRE_DOCKER").is_ok_and(|v| v == "1");
            assert!(
                !required,
                "{test}: WEIGHTCAST_REQUIRE_DOCKER=1 but no Docker daemon answers: {why}"
            );
            eprintln!(
                "SKIPPED {test}: no Docker daemon answers ({why}); \
                 it runs wherever one does (WEIGHTCAST_REQUIRE_DOCKER=1 makes this a failure)"
            );
            false
        }
    }
}

// ---------------------------------------------------------------------------
// The probe, against stand-in daemons

/// Serves one connection on `listener` with `answer`, after reading the request.
fn serve_once<L>(listener: L, answer: &'static str) -> std::thread::JoinHandle<String>
where
    L: Send + 'static + FnOnce() -> Box<dyn ReadWrite + Send>,
{
    std::thread::spawn(move || {
        let mut s = listener();
        let mut req = Vec::new();
        let mut buf = [0u8; 256];
        while !req.ends_with(b"\r\n\r\n") {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => req.extend_from_slice(&buf[..n]),
            }
        }
        let _ = s.write_all(answer.as_bytes());
        String::from_utf8_lossy(&req).to_string()
    })
}

#[test]
fn docker_probe_asks_the_daemon_not_the_cli() {
    let dir = tempfile::tempdir().unwrap();

    // A daemon that answers OK.
    let sock = dir.path().join("ok.sock");
    let l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let h = serve_once(
        move || Box::new(l.accept().unwrap().0),
        "HTTP/1.1 200 OK\r\nApi-Version: 1.47\r\nContent-Length: 2\r\n\r\nOK",
    );
    ping(&Endpoint::Unix(sock)).unwrap();
    assert!(h.join().unwrap().starts_with("GET /_ping HTTP/1.0\r\n"));

    // Something else on the socket.
    let sock = dir.path().join("bad.sock");
    let l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let h = serve_once(
        move || Box::new(l.accept().unwrap().0),
        "HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\nnope",
    );
    assert!(ping(&Endpoint::Unix(sock)).is_err());
    h.join().unwrap();

    // No socket at all (this machine: the CLI exists, the daemon does not).
    assert!(ping(&Endpoint::Unix(dir.path().join("absent.sock"))).is_err());

    // tcp:// too.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = serve_once(
        move || Box::new(l.accept().unwrap().0),
        "HTTP/1.0 200 OK\r\n\r\nOK\n",
    );
    let endpoint = docker_endpoint(Some(&format!("tcp://{addr}"))).unwrap();
    ping(&endpoint).unwrap();
    h.join().unwrap();

    assert_eq!(
        docker_endpoint(None).unwrap(),
        Endpoint::Unix("/var/run/docker.sock".into())
    );
    assert_eq!(
        docker_endpoint(Some("unix:///run/user/1000/podman/podman.sock")).unwrap(),
        Endpoint::Unix("/run/user/1000/podman/podman.sock".into())
    );
    assert!(docker_endpoint(Some("ssh://me@host")).is_err());
}

// ---------------------------------------------------------------------------
// The round trip

/// The MinIO image tag the compose playground pins.
fn compose_minio_tag() -> String {
    let compose =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docker-compose.yml"))
            .expect("reading docker-compose.yml");
    compose
        .lines()
        .find_map(|l| l.trim().strip_prefix("image: minio/minio:"))
        .map(|t| t.trim().trim_matches('"').to_string())
        .expect("docker-compose.yml pins minio/minio:TAG")
}

#[test]
fn compose_pins_a_minio_release() {
    let tag = compose_minio_tag();
    assert!(tag.starts_with("RELEASE."), "{tag}");
}

/// Writes the generator's weights as a checkpoint directory.
fn write_checkpoint(dir: &Path, g: &Generator) {
    std::fs::create_dir_all(dir).unwrap();
    let mut f = std::fs::File::create(dir.join("model.safetensors")).unwrap();
    g.snapshot().write_to(&BTreeMap::new(), &mut f).unwrap();
    std::fs::write(dir.join("config.json"), "{\"model_type\": \"llama\"}").unwrap();
}

fn assert_same_weights(out: &Path, ckpt: &Path) {
    let got = TensorSet::read(&out.join("current/model.safetensors"), Digests::Compute).unwrap();
    let want = TensorSet::read(&ckpt.join("model.safetensors"), Digests::Compute).unwrap();
    assert_eq!(got.len(), want.len());
    for (i, t) in want.tensors().iter().enumerate() {
        let j = got.position(&t.name).unwrap();
        assert!(got.data(j) == want.data(i), "{} differs", t.name);
    }
    assert_eq!(got.digest(), want.digest());
    assert_eq!(
        std::fs::read(out.join("current/config.json")).unwrap(),
        std::fs::read(ckpt.join("config.json")).unwrap()
    );
}

async fn exec_ok(c: &testcontainers::ContainerAsync<GenericImage>, cmd: &[&str]) {
    let mut r = c
        .exec(ExecCommand::new(cmd.iter().copied()).with_cmd_ready_condition(CmdWaitFor::exit()))
        .await
        .unwrap_or_else(|e| panic!("exec {cmd:?}: {e}"));
    let code = r.exit_code().await.unwrap();
    if code != Some(0) {
        let out = String::from_utf8_lossy(&r.stdout_to_vec().await.unwrap_or_default()).to_string();
        let err = String::from_utf8_lossy(&r.stderr_to_vec().await.unwrap_or_default()).to_string();
        panic!("{cmd:?} exited with {code:?}: {out}{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_subscribe_on_minio_skipped_without_docker() {
    if !docker_or_skip("publish_subscribe_on_minio_skipped_without_docker") {
        return;
    }
    let tag = compose_minio_tag();
    let minio = GenericImage::new("minio/minio", tag.as_str())
        .with_exposed_port(9000.tcp())
        .with_cmd(["server", "/data"])
        .with_env_var("MINIO_ROOT_USER", "minioadmin")
        .with_env_var("MINIO_ROOT_PASSWORD", "minioadmin")
        .with_startup_timeout(Duration::from_secs(300))
        .start()
        .await
        .unwrap_or_else(|e| panic!("starting minio/minio:{tag}: {e}"));
    let host = minio.get_host().await.unwrap();
    let port = minio.get_host_port_ipv4(9000).await.unwrap();
    let endpoint = format!("http://{host}:{port}");

    // Ready when the health endpoint says so.
    let http = {
        weightcast::store::install_crypto_provider();
        reqwest::Client::new()
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let ready = http
            .get(format!("{endpoint}/minio/health/ready"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ready {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "MinIO at {endpoint} not ready in 120 s"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    exec_ok(
        &minio,
        &[
            "mc",
            "alias",
            "set",
            "wc",
            "http://127.0.0.1:9000",
            "minioadmin",
            "minioadmin",
        ],
    )
    .await;
    exec_ok(&minio, &["mc", "mb", "wc/weights"]).await;

    let options = [
        ("aws_endpoint", endpoint.as_str()),
        ("aws_allow_http", "true"),
        ("aws_access_key_id", "minioadmin"),
        ("aws_secret_access_key", "minioadmin"),
        ("aws_region", "us-east-1"),
    ];
    let store = Store::open_with("s3://weights/round-trip", &options).unwrap();
    round_trip(store).await;
}

/// Publishes five versions (anchors every 3) and checks an early and a late
/// subscriber against the checkpoints.
async fn round_trip(store: Store) {
    // Opening the publisher probes that the store enforces conditional creates.
    let work = tempfile::tempdir().unwrap();
    let cfg = common::publisher_config(&work.path().join("pub-state"), 3, None);
    let mut publisher = Publisher::open(store.clone(), cfg).await.unwrap();
    let mut g = Generator::new(GeneratorConfig::tiny(11));
    let early = work.path().join("sub-early");
    let mut checkpoints = Vec::new();
    for v in 0..5u64 {
        if v > 0 {
            g.step();
        }
        let dir = work.path().join(format!("ckpt-{v}"));
        write_checkpoint(&dir, &g);
        let published = publisher
            .publish_path(&dir, &Default::default())
            .await
            .unwrap();
        assert_eq!(published.version, v);
        let anchor = v % 3 == 0;
        assert_eq!(
            published.kind,
            if anchor {
                VersionKind::Anchor
            } else {
                VersionKind::Delta
            },
            "version {v}"
        );
        checkpoints.push(dir);
        if v == 1 {
            let c = catch_up(&store, &early).await.unwrap().unwrap();
            assert_eq!(c.version, 1);
            assert_same_weights(&early, &checkpoints[1]);
        }
    }
    // The early subscriber follows by deltas or the newest anchor; a late one
    // starts at the newest anchor (v3) and replays v4.
    let c = catch_up(&store, &early).await.unwrap().unwrap();
    assert_eq!(c.version, 4);
    assert_same_weights(&early, &checkpoints[4]);
    let late = work.path().join("sub-late");
    let c = catch_up(&store, &late).await.unwrap().unwrap();
    assert_eq!((c.version, c.from_anchor, c.deltas_applied), (4, true, 1));
    assert_same_weights(&late, &checkpoints[4]);
    // Nothing new: nothing downloaded.
    assert_eq!(
        catch_up(&store, &late).await.unwrap().unwrap().downloaded,
        0
    );
}

/// The same round trip on a local directory, so that its assertions run where
/// no Docker daemon does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_on_a_local_store() {
    let (store, _dir) = common::local_store();
    round_trip(store).await;
}
