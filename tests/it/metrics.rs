//! Both daemons' `/metrics` against what operators were promised: the series,
//! their types and label names are exactly the two tables of
//! docs/operations.md ("Monitoring"), and every family keeps its HELP text
//! (dashboards, alerts and recording rules are written against them).

use std::collections::{BTreeMap, BTreeSet};

use weightcast::http::publisher::PublisherShared;
use weightcast::publisher::Publisher;

use crate::common;

/// One exposed (or documented) series: its sample name, type, label names.
type Series = (String, String, Vec<String>);

/// What a scrape says: the series, and each family's HELP.
struct Scrape {
    series: BTreeSet<Series>,
    help: BTreeMap<String, String>,
}

/// Parses Prometheus text (format 0.0.4): `# HELP`/`# TYPE` lines and the
/// samples under them. Panics on anything it does not understand (a sample
/// before its family's TYPE, a counter sample not named `<family>`...).
fn parse(text: &str) -> Scrape {
    let (mut series, mut help) = (BTreeSet::new(), BTreeMap::new());
    let mut types: BTreeMap<String, String> = BTreeMap::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, h) = rest.split_once(' ').expect("HELP name text");
            assert!(
                help.insert(name.to_string(), h.to_string()).is_none(),
                "HELP of {name} twice"
            );
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, t) = rest.split_once(' ').expect("TYPE name type");
            assert!(
                types.insert(name.to_string(), t.to_string()).is_none(),
                "TYPE of {name} twice"
            );
        } else {
            assert!(!line.starts_with('#'), "unexpected comment: {line}");
            let (head, value) = line.rsplit_once(' ').expect("a sample and its value");
            value
                .parse::<f64>()
                .unwrap_or_else(|e| panic!("value of `{line}`: {e}"));
            let (name, labels) = match head.split_once('{') {
                Some((n, l)) => (n, l.strip_suffix('}').expect("closing brace")),
                None => (head, ""),
            };
            let mut keys: Vec<String> = labels
                .split(',')
                .filter(|l| !l.is_empty())
                .map(|l| l.split_once('=').expect("label=value").0.to_string())
                .collect();
            keys.sort();
            let t = types
                .get(name)
                .unwrap_or_else(|| panic!("sample `{name}` has no TYPE line before it"));
            assert!(help.contains_key(name), "sample `{name}` has no HELP");
            series.insert((name.to_string(), t.clone(), keys));
        }
    }
    Scrape { series, help }
}

/// The series of the tables of docs/operations.md's "Monitoring" section:
/// rows `` | `name{label,…}` | type | meaning | ``.
fn documented() -> BTreeSet<Series> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let start = doc.find("\n## Monitoring").expect("a Monitoring section");
    let section = &doc[start + 1..];
    let section = &section[..section[1..].find("\n## ").map_or(section.len(), |e| e + 1)];
    let mut out = BTreeSet::new();
    for row in section.lines().filter(|l| l.starts_with("| `weightcast_")) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let name = cells[1].trim_matches('`');
        let (name, labels) = match name.split_once('{') {
            Some((n, l)) => (n, l.trim_end_matches('}')),
            None => (name, ""),
        };
        let mut keys: Vec<String> = labels
            .split(',')
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect();
        keys.sort();
        assert!(
            out.insert((name.to_string(), cells[2].to_string(), keys)),
            "{name} documented twice"
        );
    }
    assert!(out.len() > 20, "too few documented series: {out:?}");
    out
}

/// The HELP text of every family, as the daemons exposed it before the
/// exposition moved to `prometheus-client` (names as in the HELP line).
const HELP: &[(&str, &str)] = &[
    (
        "weightcast_version",
        "Verified version in the output (-1: none).",
    ),
    (
        "weightcast_newest_version",
        "Newest committed version seen (-1: none).",
    ),
    (
        "weightcast_lag_versions",
        "Committed versions not yet applied.",
    ),
    ("weightcast_versions_applied_total", "Versions applied."),
    (
        "weightcast_bytes_downloaded_total",
        "Bytes downloaded from the store.",
    ),
    (
        "weightcast_output_written_bytes_total",
        "Bytes written into the output slots.",
    ),
    (
        "weightcast_journal_applied_bytes_total",
        "Bytes of journal objects applied to bring slots forward.",
    ),
    (
        "weightcast_local_written_bytes_total",
        "Bytes written to local storage by the catch-ups (/proc/self/io write_bytes).",
    ),
    (
        "weightcast_last_version_local_written_bytes",
        "Bytes written to local storage for the last version (its standby slot included).",
    ),
    (
        "weightcast_publisher_local_written_bytes_total",
        "Bytes written to local storage by the publishes (/proc/self/io write_bytes).",
    ),
    (
        "weightcast_publisher_last_local_written_bytes",
        "Bytes written to local storage by the last publish.",
    ),
    (
        "weightcast_store_requests_total",
        "Requests made to the store.",
    ),
    (
        "weightcast_repairs_total",
        "Re-bootstraps after a failed replay or damaged output.",
    ),
    ("weightcast_failures_total", "Catch-ups that failed."),
    ("weightcast_notifications_total", "Accepted notifications."),
    (
        "weightcast_notifications_refused_total",
        "Refused notifications.",
    ),
    (
        "weightcast_apply_seconds",
        "Duration of the last catch-up that changed the version.",
    ),
    (
        "weightcast_engine_pause_seconds",
        "Engine pause window of the last version (pause answered to resume answered).",
    ),
    (
        "weightcast_version_seconds",
        "Where the last version's time went, by phase: fetch (waiting on the store), prepare \
         (decode, verify, write off the serving path), pause (the engine's), apply (commit and \
         switch).",
    ),
    (
        "weightcast_version_bytes",
        "The last version's bytes, by kind: downloaded from the store, written locally.",
    ),
    ("weightcast_hook_runs_total", "Hook runs."),
    ("weightcast_hook_failures_total", "Hooks that failed."),
    (
        "weightcast_quarantined_versions",
        "Versions that could not be verified and are skipped (retried with backoff).",
    ),
    (
        "weightcast_ranks",
        "Ranks of a tensor-parallel engine this node subscriber follows for (0: not one).",
    ),
    (
        "weightcast_ranks_inconsistent",
        "1 when the engine's ranks hold different versions (an error), else 0.",
    ),
    (
        "weightcast_healthy",
        "1 when healthy, 0 when /healthz answers 503.",
    ),
    (
        "weightcast_publisher_version",
        "The last committed version (-1: none yet).",
    ),
    (
        "weightcast_publisher_step",
        "The trainer step of the last version (-1: unknown).",
    ),
    (
        "weightcast_publisher_versions_total",
        "Versions committed, by kind (unchanged: identical content, nothing written).",
    ),
    (
        "weightcast_publisher_bytes_total",
        "Bytes written to the bucket.",
    ),
    (
        "weightcast_publisher_changed_elements_total",
        "Changed elements published.",
    ),
    (
        "weightcast_publisher_publish_seconds",
        "Duration of the last successful publish.",
    ),
    (
        "weightcast_publisher_errors_total",
        "Failed publishes, by error kind.",
    ),
    (
        "weightcast_publisher_healthy",
        "1 when healthy, 0 when /healthz answers 503.",
    ),
];

async fn get(url: String) -> (String, String) {
    weightcast::store::install_crypto_provider();
    let r = reqwest::get(url).await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let ct = r.headers()["content-type"].to_str().unwrap().to_string();
    (ct, r.text().await.unwrap())
}

#[tokio::test]
async fn both_daemons_expose_the_documented_series_with_their_help() {
    // The publisher daemon, before any publish.
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let publisher = Publisher::open(
        store.clone(),
        common::publisher_config(&work.path().join("state"), 10, None),
    )
    .await
    .unwrap();
    let shared = PublisherShared::new(
        publisher,
        "metrics-token-0123456789",
        work.path(),
        Default::default(),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let publisher_url = format!("http://{}/metrics", listener.local_addr().unwrap());
    tokio::spawn(weightcast::http::publisher::serve(
        listener,
        shared,
        std::future::pending(),
    ));
    // The subscriber's surface (the relay serves the same one).
    let sub = weightcast::subscriber::status::Shared::new(store.url(), None);
    if let Ok(mut s) = sub.status.lock() {
        s.version = Some(3);
        s.versions_applied = 4;
        s.last_apply_seconds = 0.25;
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let subscriber_url = format!("http://{}/metrics", listener.local_addr().unwrap());
    tokio::spawn(weightcast::http::subscriber::serve(
        listener,
        sub,
        std::future::pending(),
    ));

    let mut exposed = BTreeSet::new();
    let mut help = BTreeMap::new();
    for url in [publisher_url, subscriber_url] {
        let (content_type, text) = get(url).await;
        assert_eq!(content_type, "text/plain; version=0.0.4; charset=utf-8");
        let scrape = parse(&text);
        assert!(!scrape.series.is_empty(), "{text}");
        exposed.extend(scrape.series);
        help.extend(scrape.help);
        if text.contains("weightcast_version ") {
            assert!(text.contains("\nweightcast_version 3\n"), "{text}");
            assert!(
                text.contains("\nweightcast_versions_applied_total 4\n"),
                "{text}"
            );
            assert!(text.contains("\nweightcast_apply_seconds 0.25\n"), "{text}");
            assert!(text.contains("\nweightcast_newest_version -1\n"), "{text}");
        } else {
            assert!(
                text.contains("\nweightcast_publisher_version -1\n"),
                "{text}"
            );
            assert!(
                text.contains("\nweightcast_publisher_versions_total{kind=\"anchor\"} 0\n"),
                "{text}"
            );
            assert!(
                text.contains("\nweightcast_publisher_errors_total{kind=\"unavailable\"} 0\n"),
                "{text}"
            );
        }
    }
    let documented = documented();
    let missing: Vec<_> = documented.difference(&exposed).collect();
    let undocumented: Vec<_> = exposed.difference(&documented).collect();
    assert!(
        missing.is_empty() && undocumented.is_empty(),
        "docs/operations.md (Monitoring) and /metrics disagree:\n documented, not exposed: \
         {missing:?}\n exposed, not documented: {undocumented:?}"
    );
    let expected: BTreeMap<String, String> = HELP
        .iter()
        .map(|(n, h)| (n.to_string(), h.to_string()))
        .collect();
    assert_eq!(help, expected, "HELP texts changed");
}
