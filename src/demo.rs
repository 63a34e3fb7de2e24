//! The end-to-end demo behind `weightcast demo`: the whole product on an
//! embedded default. A synthetic Llama-shaped model takes a few RL-like
//! training steps; a [`Publisher`] commits each step from memory (no
//! checkpoint file) into a `file://` bucket as anchors and deltas; two
//! subscribers catch up into their own output directories — one follows every
//! version, one joins late from the newest anchor — and every replica is
//! checked bit for bit against the trainer.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::format::Encoding;
use crate::generator::{Generator, GeneratorConfig};
use crate::publisher::{AnchorPolicy, Checkpoint, PublishOptions, Publisher, PublisherConfig};
use crate::store::Store;
use crate::tensors::{Digests, TensorSet};

/// Demo settings.
#[derive(Clone, Debug)]
pub struct DemoConfig {
    /// Where the bucket, the publisher's state and the replicas go.
    pub dir: PathBuf,
    /// Training steps (versions after the first anchor).
    pub steps: u64,
    /// An anchor every this many versions.
    pub anchor_every: u64,
    /// Delta encoding.
    pub encoding: Encoding,
    /// Model configuration.
    pub model: GeneratorConfig,
}

/// One published version.
#[derive(Clone, Debug, Serialize)]
pub struct DemoStep {
    /// Version number.
    pub version: u64,
    /// `anchor` or `delta`.
    pub kind: &'static str,
    /// Bytes written to the bucket.
    pub bytes: u64,
    /// Changed elements.
    pub changed: u64,
    /// Full size / bytes.
    pub reduction: f64,
    /// Seconds to publish (diff, encode, upload, commit).
    pub publish_s: f64,
    /// Seconds for the following subscriber to catch up and verify.
    pub catch_up_s: f64,
    /// Bytes that subscriber downloaded.
    pub downloaded: u64,
}

/// The demo's outcome.
#[derive(Clone, Debug, Serialize)]
pub struct DemoReport {
    /// Elements of the model.
    pub elements: u64,
    /// Full bf16 size.
    pub full_bytes: u64,
    /// Per version.
    pub steps: Vec<DemoStep>,
    /// Whether both replicas matched the trainer at every version.
    pub bit_identical: bool,
}

/// Whether the replica in `out` holds exactly `truth`'s tensors.
fn replica_matches(out: &Path, truth: &TensorSet) -> Result<bool> {
    let got = TensorSet::read(&out.join("current").join(FILE), Digests::Skip)?;
    Ok(got.len() == truth.len()
        && truth.tensors().iter().enumerate().all(|(i, t)| {
            got.position(&t.name)
                .is_some_and(|j| got.data(j) == truth.data(i))
        }))
}

const FILE: &str = "model.safetensors";

/// Runs the demo; `progress` receives one human-readable line per event.
pub async fn run(cfg: &DemoConfig, mut progress: impl FnMut(&str)) -> Result<DemoReport> {
    let bucket = cfg.dir.join("bucket");
    std::fs::create_dir_all(&bucket)
        .map_err(|e| Error::io(format!("creating {}", bucket.display()), e))?;
    let url = url::Url::from_directory_path(
        bucket
            .canonicalize()
            .map_err(|e| Error::io(format!("resolving {}", bucket.display()), e))?,
    )
    .map_err(|()| Error::Config(format!("{}: not an absolute path", bucket.display())))?;
    let store = Store::open(url.as_str())?;
    let mut publisher = Publisher::open(
        store.clone(),
        PublisherConfig {
            state_dir: cfg.dir.join("publisher-state"),
            encoding: cfg.encoding,
            compact2_max_density: crate::codec::COMPACT2_MAX_DENSITY,
            anchors: AnchorPolicy {
                every: cfg.anchor_every,
                ..Default::default()
            },
            single_writer: false,
            notify_urls: Vec::new(),
            notify_key: None,
            retention: None,
            checkpoint: Default::default(),
            anchor_encoding: Default::default(),
            layout: Default::default(),
            trl: Default::default(),
            distributed: None,
            state_mode: Default::default(),
        },
    )
    .await?;
    let mut trainer = Generator::new(cfg.model.clone());
    let elements = trainer.config().elements();
    let full = elements * 2;
    progress(&format!(
        "model: {} tensors, {elements} bf16 elements ({:.1} MB); bucket: {url}",
        cfg.model.tensors.len(),
        full as f64 / 1e6,
    ));
    let follower = cfg.dir.join("replica-following");
    let config = br#"{"model_type": "llama", "demo": true}"#;
    let mut report = DemoReport {
        elements,
        full_bytes: full,
        steps: Vec::new(),
        bit_identical: true,
    };
    let mut truth = trainer.snapshot();
    for v in 0..=cfg.steps {
        if v > 0 {
            trainer.step();
            truth = trainer.snapshot();
        }
        // The trainer hands its tensors over in memory.
        let cp = Checkpoint::from_sets(
            BTreeMap::from([(FILE.to_string(), trainer.snapshot_without_digests())]),
            BTreeMap::from([("config.json".to_string(), bytes::Bytes::from_static(config))]),
        )?;
        let t = Instant::now();
        let out = publisher
            .publish(cp, &PublishOptions { step: Some(v) })
            .await?;
        let publish_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let caught = crate::subscriber::catch_up(&store, &follower)
            .await?
            .ok_or_else(|| Error::NotFound("the bucket has no version".into()))?;
        let catch_up_s = t.elapsed().as_secs_f64();
        let ok = caught.version == out.version && replica_matches(&follower, &truth)?;
        report.bit_identical &= ok;
        let kind = match out.kind {
            crate::protocol::VersionKind::Anchor => "anchor",
            crate::protocol::VersionKind::Delta => "delta",
        };
        let step = DemoStep {
            version: out.version,
            kind,
            bytes: out.bytes,
            changed: out.changed,
            reduction: full as f64 / out.bytes.max(1) as f64,
            publish_s,
            catch_up_s,
            downloaded: caught.downloaded,
        };
        progress(&format!(
            "v{:<3} {:<6} {:>12} bytes  {:>8} changed ({:.2}%)  {:>7.1}x smaller  publish {:>6.1} ms  replica catch-up+verify {:>6.1} ms  {}",
            step.version,
            step.kind,
            step.bytes,
            step.changed,
            step.changed as f64 * 100.0 / elements as f64,
            step.reduction,
            step.publish_s * 1e3,
            step.catch_up_s * 1e3,
            if ok { "bit-identical" } else { "MISMATCH" }
        ));
        report.steps.push(step);
    }
    // A late joiner: a fresh subscriber starts from the newest anchor.
    let late = cfg.dir.join("replica-late");
    let t = Instant::now();
    let caught = crate::subscriber::catch_up(&store, &late)
        .await?
        .ok_or_else(|| Error::NotFound("the bucket has no version".into()))?;
    let ok = replica_matches(&late, &truth)?;
    report.bit_identical &= ok;
    progress(&format!(
        "late joiner: version {} ({} bytes downloaded, {} deltas replayed after the anchor) in {:.1} ms: {}",
        caught.version,
        caught.downloaded,
        caught.deltas_applied,
        t.elapsed().as_secs_f64() * 1e3,
        if ok { "bit-identical" } else { "MISMATCH" }
    ));
    Ok(report)
}
