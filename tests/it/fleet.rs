//! Fleet scale against a real S3 server (moto) on loopback: hundreds of
//! `weightcast subscribe` daemons (real processes) follow one bucket through
//! a counting proxy, pushed by the publisher's notifications; a third of them
//! is killed (SIGKILL) mid-run and restarted later. It measures and prints,
//! per version, the time until the last subscriber holds it and the store
//! requests each subscriber made for it against the objects it had to fetch
//! (goal: at most those objects + 2), and checks that every subscriber ends
//! bit-identical to the trainer, the restarted ones included.
//!
//! `cargo test --test it -- fleet:: --nocapture` prints the figures (256
//! subscribers; 512 and more versions with `WEIGHTCAST_LONG=1`).

use crate::common;
use crate::faultproxy::FaultProxy;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use weightcast::notify::Key;
use weightcast::protocol::{read_manifest, registrations};
use weightcast::publisher::Publisher;
use weightcast::store::Store;

const SECRET: &str = "fleet-test-notify-secret";
const BUCKET: &str = "fleet";

/// One subscriber daemon.
struct Sub {
    id: String,
    out: PathBuf,
    /// Its HTTP port (bound by the daemon on port 0, learned from its
    /// registration).
    port: u16,
    /// When it was last started (Unix seconds): a registration older than
    /// this is its previous life's.
    started: u64,
    child: Option<Child>,
}

impl Sub {
    fn start(&mut self, proxy: u16, log: &Path) {
        let log = std::fs::File::create(log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_weightcast"))
            .args(["subscribe", "-q", "--store"])
            .arg(format!("s3://{BUCKET}/run"))
            .arg("--out")
            .arg(&self.out)
            .args(["--listen", "127.0.0.1:0"])
            .args(["--id", &self.id, "--notify-key", SECRET])
            // Push first: polls are the fallback, a minute apart.
            .args(["--poll-interval", "60"])
            .env_remove("WEIGHTCAST_STORE")
            .env_remove("WEIGHTCAST_FAILPOINT")
            .env("RUST_LOG", "weightcast=warn")
            .env("AWS_ENDPOINT", format!("http://127.0.0.1:{proxy}"))
            .env("AWS_ALLOW_HTTP", "true")
            // The proxy counts requests by this key id.
            .env("AWS_ACCESS_KEY_ID", &self.id)
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_REGION", "us-east-1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starting weightcast subscribe");
        self.child = Some(child);
        self.started = weightcast::notify::unix_now();
    }

    /// SIGKILL, as a crash or a preempted node.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }
}

impl Drop for Sub {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The version a subscriber's `/v1/status` reports (None: none yet, or down).
async fn held(client: &reqwest::Client, port: u16) -> Option<u64> {
    let r = client
        .get(format!("http://127.0.0.1:{port}/v1/status"))
        .send()
        .await
        .ok()?;
    r.json::<serde_json::Value>().await.ok()?["version"].as_u64()
}

/// Waits until every subscriber in `subs` holds `v`; returns, for each, when
/// it was first seen holding it (seconds after `since`).
async fn wait_all(
    client: &reqwest::Client,
    subs: &[&Sub],
    v: u64,
    since: Instant,
    limit: Duration,
) -> Vec<f64> {
    let mut at: Vec<Option<f64>> = vec![None; subs.len()];
    let deadline = Instant::now() + limit;
    while at.iter().any(Option::is_none) {
        for (i, s) in subs.iter().enumerate() {
            if at[i].is_none() && held(client, s.port).await == Some(v) {
                at[i] = Some(since.elapsed().as_secs_f64());
            }
        }
        let missing: Vec<&str> = subs
            .iter()
            .zip(&at)
            .filter(|(_, a)| a.is_none())
            .map(|(s, _)| s.id.as_str())
            .collect();
        assert!(
            Instant::now() < deadline,
            "{} subscribers do not hold v{v} after {limit:?}: {:?} (logs in their work dir)",
            missing.len(),
            &missing[..missing.len().min(8)]
        );
        if !missing.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    at.into_iter().map(Option::unwrap).collect()
}

/// Waits until every running subscriber registered since it was last started
/// (it registers at start, with the port it bound), and records its port.
async fn learn_ports(store: &Store, subs: &mut [Sub], work: &Path, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let regs = registrations(store).await.unwrap();
        let port_of = |id: &str, since: u64| -> Option<u16> {
            let r = regs.iter().find(|r| r.id == id && r.updated_at >= since)?;
            let url = url::Url::parse(r.notify_url.as_deref()?).ok()?;
            url.port()
        };
        let mut missing = Vec::new();
        for s in subs.iter_mut().filter(|s| s.child.is_some()) {
            match port_of(&s.id, s.started) {
                Some(p) => s.port = p,
                None => missing.push(s.id.clone()),
            }
        }
        if missing.is_empty() {
            return;
        }
        if Instant::now() >= deadline {
            let logs: Vec<String> = missing
                .iter()
                .take(3)
                .map(|id| {
                    let log = std::fs::read_dir(work)
                        .unwrap()
                        .filter_map(|e| e.ok())
                        .filter(|e| e.file_name().to_string_lossy().starts_with(id.as_str()))
                        .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
                        .collect::<Vec<_>>()
                        .join("");
                    format!("{id}: {log}")
                })
                .collect();
            panic!(
                "{} subscribers did not register within {limit:?}, e.g.\n{}",
                missing.len(),
                logs.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Requests each client made so far.
fn requests_by_client(proxy: &FaultProxy) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for s in proxy.seen() {
        *m.entry(s.client.unwrap_or_default()).or_insert(0) += 1;
    }
    m
}

/// Objects a subscriber holding `from` must fetch to reach `to`: the manifest
/// and the objects of every version after `from` (one delta chain).
async fn objects_needed(store: &Store, from: u64, to: u64) -> usize {
    let mut n = 0;
    for v in from + 1..=to {
        let m = read_manifest(store, v).await.unwrap().unwrap();
        n += 1 + m.objects.len();
    }
    n
}

fn quantile(xs: &[f64], q: f64) -> f64 {
    let mut s = xs.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    s[((s.len() - 1) as f64 * q).round() as usize]
}

#[test]
fn hundreds_of_subscribers_follow_by_push_and_a_killed_third_catches_up() {
    let n: usize = common::scaled(256, 512);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        common::moto_bucket(BUCKET).await;
        let proxy: Arc<FaultProxy> = FaultProxy::start(common::moto().port).await;
        let mut o = common::moto_options();
        o[0].1 = format!("http://127.0.0.1:{}", proxy.port);
        o[2].1 = "publisher".into();
        let opts: Vec<(&str, &str)> = o.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let store = Store::open_with(&format!("s3://{BUCKET}/run"), &opts).unwrap();
        let work = tempfile::tempdir().unwrap();
        let mut publisher = Publisher::open(
            store.clone(),
            common::publisher_config(
                &work.path().join("pub"),
                100,
                Some(Key::new(SECRET).unwrap()),
            ),
        )
        .await
        .unwrap();
        let mut trainer = common::Trainer::new(11);
        let client = {
            weightcast::store::install_crypto_provider();
            reqwest::Client::builder()
                .timeout(Duration::from_secs(2))
                .build()
                .unwrap()
        };

        // The fleet starts on an empty bucket and registers.
        let started = Instant::now();
        let mut subs: Vec<Sub> = (0..n)
            .map(|i| Sub {
                id: format!("sub-{i:04}"),
                out: work.path().join(format!("sub-{i:04}")),
                port: 0,
                started: 0,
                child: None,
            })
            .collect();
        for s in &mut subs {
            let log = work.path().join(format!("{}.log", s.id));
            s.start(proxy.port, &log);
        }
        learn_ports(&store, &mut subs, work.path(), Duration::from_secs(180)).await;
        println!(
            "fleet: {n} subscriber processes started and registered in {:.1} s",
            started.elapsed().as_secs_f64()
        );

        let killed: Vec<usize> = (0..n).filter(|i| i % 3 == 0).collect();
        let versions = common::scaled(6u64, 12);
        let (kill_after, restart_after) = (2u64, versions - 2);
        let mut held_by: Vec<u64> = vec![u64::MAX; n];
        let mut lines = Vec::new();
        let mut per_version_requests = Vec::new();
        for v in 0..versions {
            if v > 0 {
                trainer.step();
            }
            let up: Vec<usize> = (0..n).filter(|&i| subs[i].child.is_some()).collect();
            let before = requests_by_client(&proxy);
            let first_seen = proxy.seen().len();
            let t = Instant::now();
            let p = publisher.publish(trainer.checkpoint(), &Default::default()).await.unwrap();
            let publish_s = t.elapsed().as_secs_f64();
            assert_eq!(p.version, v);
            let live: Vec<&Sub> = up.iter().map(|&i| &subs[i]).collect();
            let at = wait_all(&client, &live, v, t, Duration::from_secs(120)).await;
            let notified = publisher.notifications_settled().await;
            // Let the last registration writes land before counting.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let after = requests_by_client(&proxy);
            let mut ratio = Vec::new();
            let mut reqs = Vec::new();
            for &i in &up {
                let id = &subs[i].id;
                let made = after.get(id).copied().unwrap_or(0) - before.get(id).copied().unwrap_or(0);
                let need = if v == 0 || held_by[i] == u64::MAX {
                    // A bootstrap: the version's manifest and objects.
                    1 + read_manifest(&store, v).await.unwrap().unwrap().objects.len()
                } else {
                    objects_needed(&store, held_by[i], v).await
                };
                // A request the store failed (a 5xx from moto under load)
                // and its retry are the store's fault, not waste.
                let failed = proxy.seen()[first_seen..]
                    .iter()
                    .filter(|s| {
                        s.client.as_deref() == Some(id.as_str())
                            && s.status.is_some_and(|c| c >= 500)
                    })
                    .count();
                if made > need + 2 + failed {
                    let list: Vec<String> = proxy.seen()[first_seen..]
                        .iter()
                        .filter(|s| s.client.as_deref() == Some(id.as_str()))
                        .map(|s| format!("{} {} -> {:?}", s.method, s.path, s.status))
                        .collect();
                    panic!(
                        "{id} made {made} store requests for v{v}, which needs {need} objects: over the goal of objects + 2:\n{}",
                        list.join("\n")
                    );
                }
                reqs.push(made as f64);
                ratio.push(made as f64 - need as f64);
                held_by[i] = v;
            }
            let pub_reqs = after.get("publisher").copied().unwrap_or(0)
                - before.get("publisher").copied().unwrap_or(0);
            let line = format!(
                "v{v} {:6}: {} live, publish {publish_s:.2} s, {} notified, last holds it after {:.2} s (median {:.2} s); store requests per subscriber: mean {:.2}, max {} (objects needed + {:.0} at most); publisher requests {pub_reqs}",
                format!("{:?}", p.kind).to_lowercase(),
                up.len(),
                notified,
                quantile(&at, 1.0),
                quantile(&at, 0.5),
                reqs.iter().sum::<f64>() / reqs.len() as f64,
                quantile(&reqs, 1.0),
                quantile(&ratio, 1.0),
            );
            println!("fleet: {line}");
            lines.push(line);
            per_version_requests.push(reqs);

            if v == kill_after {
                for &i in &killed {
                    subs[i].kill();
                }
                println!("fleet: killed {} subscribers (SIGKILL)", killed.len());
            }
            if v == restart_after {
                // Their previous registrations are from an earlier second.
                tokio::time::sleep(Duration::from_millis(1100)).await;
                let before = requests_by_client(&proxy);
                let t = Instant::now();
                for &i in &killed {
                    let log = work.path().join(format!("{}.restart.log", subs[i].id));
                    subs[i].start(proxy.port, &log);
                }
                learn_ports(&store, &mut subs, work.path(), Duration::from_secs(120)).await;
                let back: Vec<&Sub> = killed.iter().map(|&i| &subs[i]).collect();
                let at = wait_all(&client, &back, v, t, Duration::from_secs(120)).await;
                tokio::time::sleep(Duration::from_millis(300)).await;
                let after = requests_by_client(&proxy);
                let need = objects_needed(&store, kill_after, v).await;
                let made: Vec<f64> = killed
                    .iter()
                    .map(|&i| {
                        let id = &subs[i].id;
                        (after.get(id).copied().unwrap_or(0) - before.get(id).copied().unwrap_or(0))
                            as f64
                    })
                    .collect();
                println!(
                    "fleet: restarted {} subscribers {} versions behind: all hold v{v} after {:.2} s (median {:.2} s); store requests each: mean {:.2}, max {} for {need} objects",
                    killed.len(),
                    v - kill_after,
                    quantile(&at, 1.0),
                    quantile(&at, 0.5),
                    made.iter().sum::<f64>() / made.len() as f64,
                    quantile(&made, 1.0),
                );
                for &i in &killed {
                    held_by[i] = v;
                }
            }
        }
        // Every subscriber, restarted or not, holds the last version exactly.
        let (w, c) = (trainer.weights(), trainer.config());
        for s in &subs {
            common::assert_replica(&s.out, &w, &c, &s.id);
        }
        println!(
            "fleet: all {n} subscribers bit-identical at v{}; {} store requests in all",
            versions - 1,
            proxy.seen().len()
        );
        // The baseline: how long the same server, through the same proxy,
        // takes to answer as many small reads as one version costs the fleet
        // (5 per subscriber), 64 at once.
        let t = Instant::now();
        let reads = 5 * n;
        {
            use futures::StreamExt;
            let key = weightcast::protocol::LATEST_KEY;
            let got: Vec<bool> = futures::stream::iter(0..reads)
                .map(|_| {
                    let store = store.clone();
                    async move { store.get_at_most(key, 1 << 20).await.is_ok() }
                })
                .buffer_unordered(64)
                .collect()
                .await;
            assert!(got.iter().all(|&ok| ok));
        }
        println!(
            "fleet: baseline: the server answers {reads} reads of latest.json in {:.2} s",
            t.elapsed().as_secs_f64()
        );
    });
}
