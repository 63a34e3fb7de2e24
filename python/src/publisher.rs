//! `NativePublisher`: the library's publisher over one store prefix, with
//! the tensors of each version lent by Python (read in place, the GIL
//! released).

use std::collections::BTreeMap;
use std::sync::Mutex;

use bytes::Bytes;
use pyo3::prelude::*;

use weightcast::codec::compact::PositionSlice;
use weightcast::error::Error;
use weightcast::publisher::{
    AnchorEncoding, AnchorPolicy, ChangedTensor, Changes, ChangesOutcome, Checkpoint,
    PublishOptions, Publisher, PublisherConfig,
};
use weightcast::tensors::TensorSet;

use crate::{Lent, OrPy, Result, Spec, block_on, dtype, json, lend, seconds, store};

/// One tensor's changes as the Python side lends them: name, dtype, shape,
/// the positions (address, count, width in bytes: 4 or 8) and the new words
/// (address, bytes), in host memory.
type ChangeSpec = (
    String,
    String,
    Vec<usize>,
    usize,
    usize,
    usize,
    usize,
    usize,
);

/// One rank of `world` publishing its shards of each step
/// (`weightcast publish --rank R --world W`); `None` for a lone publisher.
fn distributed(
    rank: Option<u32>,
    world: u32,
    timeout: f64,
) -> Result<Option<weightcast::publisher::Distributed>> {
    let Some(rank) = rank.filter(|_| world > 1) else {
        return match (rank, world) {
            (None, 1) => Ok(None),
            _ => Err(Error::Config(format!(
                "rank {rank:?} of world {world}: give both, with world >= 2 and 0 <= rank < \
                 world (or neither, for one publisher)"
            ))),
        };
    };
    Ok(Some(weightcast::publisher::Distributed {
        timeout: seconds("rank_timeout", timeout)?,
        ..weightcast::publisher::Distributed::new(rank, world)?
    }))
}

/// The library's publisher over one store prefix.
#[pyclass(module = "weightcast._native")]
pub(crate) struct NativePublisher {
    inner: Mutex<Publisher>,
}

impl NativePublisher {
    /// The library's publisher, for one call.
    fn publisher(&self) -> Result<std::sync::MutexGuard<'_, Publisher>> {
        self.inner
            .lock()
            .map_err(|_| Error::BadRequest("a previous publish panicked".into()))
    }
}

#[pymethods]
impl NativePublisher {
    #[new]
    #[pyo3(signature = (store_url, state_dir, encoding, anchor_every, anchor_encoding, single_writer, keep_anchors, notify_urls, notify_key, store_options, rank=None, world=1, rank_timeout=600.0, compact2_max_density=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        store_url: String,
        state_dir: String,
        encoding: String,
        anchor_every: u64,
        anchor_encoding: String,
        single_writer: bool,
        keep_anchors: Option<usize>,
        notify_urls: Vec<String>,
        notify_key: Option<String>,
        store_options: Vec<(String, String)>,
        rank: Option<u32>,
        world: u32,
        rank_timeout: f64,
        compact2_max_density: Option<f64>,
    ) -> PyResult<NativePublisher> {
        let open = || -> Result<Publisher> {
            let encoding = encoding.parse().map_err(|_| {
                Error::Config(format!(
                    "encoding `{encoding}`: expected compact, compact2 or trl (the delta encodings)"
                ))
            })?;
            if anchor_every == 0 {
                return Err(Error::Config("anchor_every must be at least 1".into()));
            }
            let anchor_encoding: AnchorEncoding = anchor_encoding.parse()?;
            let retention = match keep_anchors {
                Some(0) => return Err(Error::Config("keep_anchors must be at least 1".into())),
                Some(k) => Some(weightcast::protocol::Retention {
                    keep_anchors: k,
                    ..Default::default()
                }),
                None => None,
            };
            let cfg = PublisherConfig {
                state_dir: state_dir.into(),
                encoding,
                // One default, the library's.
                compact2_max_density: compact2_max_density
                    .unwrap_or(weightcast::codec::COMPACT2_MAX_DENSITY),
                anchors: AnchorPolicy {
                    every: anchor_every,
                    ..Default::default()
                },
                single_writer,
                notify_urls,
                notify_key: notify_key
                    .as_deref()
                    .map(weightcast::notify::Key::new)
                    .transpose()?,
                retention,
                checkpoint: Default::default(),
                anchor_encoding,
                layout: Default::default(),
                trl: Default::default(),
                distributed: distributed(rank, world, rank_timeout)?,
                state_mode: Default::default(),
            };
            let store = store(&store_url, &store_options)?;
            block_on(Publisher::open(store, cfg))?
        };
        let publisher = py.detach(open).py()?;
        Ok(NativePublisher {
            inner: Mutex::new(publisher),
        })
    }

    /// The last committed version this publisher knows of.
    #[getter]
    fn version(&self) -> Option<u64> {
        self.inner.lock().ok().and_then(|p| p.version())
    }

    /// Publishes tensor files (file name → lent tensors) and other files as
    /// the next version; returns the library's `Published` as JSON. The
    /// tensors are read in place, with the GIL released.
    #[pyo3(signature = (tensor_files, files, step))]
    fn publish(
        &self,
        py: Python<'_>,
        tensor_files: Vec<(String, Vec<Spec>)>,
        files: Vec<(String, Vec<u8>)>,
        step: Option<u64>,
    ) -> PyResult<String> {
        let run = || -> Result<String> {
            let mut sets = BTreeMap::new();
            for (file, specs) in tensor_files {
                let lent = lend(specs, false)?;
                let set = TensorSet::from_external(
                    lent.into_iter().map(|l| (l.name, l.dtype, l.shape, l.buf)),
                )
                .map_err(|e| e.in_input(format!("tensor file `{file}`")))?;
                if sets.insert(file.clone(), set).is_some() {
                    return Err(Error::BadRequest(format!(
                        "tensor file `{file}` given twice"
                    )));
                }
            }
            let files = files
                .into_iter()
                .map(|(n, b)| (n, Bytes::from(b)))
                .collect();
            let cp = Checkpoint::from_sets(sets, files)?;
            let mut p = self.publisher()?;
            let out = block_on(p.publish(cp, &PublishOptions { step }))??;
            Ok(json(&out))
        };
        py.detach(run).py()
    }

    /// Publishes the next version from changes (tensor file → every tensor's
    /// changed positions and new words, lent in host memory) found against
    /// the last version this publisher committed. Returns the `Published`
    /// JSON, or `{"needs_full": reason}` when nothing was written and the
    /// full tensors must be published instead.
    #[pyo3(signature = (tensor_files, files, step))]
    fn publish_changes(
        &self,
        py: Python<'_>,
        tensor_files: Vec<(String, Vec<ChangeSpec>)>,
        files: Vec<(String, Vec<u8>)>,
        step: Option<u64>,
    ) -> PyResult<String> {
        let run = || -> Result<String> {
            let mut lent = Vec::new();
            for (file, specs) in tensor_files {
                let mut tensors = Vec::with_capacity(specs.len());
                for (name, d, shape, pos_ptr, count, width, new_ptr, new_len) in specs {
                    let dtype = dtype(&name, &d)?;
                    let pos_len = count.checked_mul(width).ok_or_else(|| {
                        Error::BadRequest(format!("tensor `{name}`: {count} positions overflow"))
                    })?;
                    let pos = Lent::new(&name, pos_ptr, pos_len, false)?;
                    let new = Lent::new(&name, new_ptr, new_len, false)?;
                    tensors.push((name, dtype, shape, width, pos, new));
                }
                lent.push((file, tensors));
            }
            let mut changes = Changes {
                files: files
                    .into_iter()
                    .map(|(n, b)| (n, Bytes::from(b)))
                    .collect(),
                ..Default::default()
            };
            for (file, tensors) in &lent {
                let mut list = Vec::with_capacity(tensors.len());
                for (name, dtype, shape, width, pos, new) in tensors {
                    let positions = match width {
                        4 => PositionSlice::U32(pos.ints::<u32>(name)?),
                        8 => PositionSlice::U64(pos.ints::<u64>(name)?),
                        w => {
                            return Err(Error::BadRequest(format!(
                                "tensor `{name}`: positions of {w} bytes (4 or 8 expected)"
                            )));
                        }
                    };
                    list.push(ChangedTensor {
                        name: name.clone(),
                        dtype: *dtype,
                        shape: shape.clone(),
                        positions,
                        new: new.slice(),
                    });
                }
                if changes.tensor_files.insert(file.clone(), list).is_some() {
                    return Err(Error::BadRequest(format!(
                        "tensor file `{file}` given twice"
                    )));
                }
            }
            let mut p = self.publisher()?;
            match block_on(p.publish_changes(changes, &PublishOptions { step }))?? {
                ChangesOutcome::Published(out) => Ok(json(&out)),
                ChangesOutcome::NeedsFull(why) => Ok(json(&BTreeMap::from([("needs_full", why)]))),
            }
        };
        py.detach(run).py()
    }

    /// Waits for the notifications of the versions published so far
    /// (`publish` returns at the commit and notifies in the background);
    /// returns how many subscribers acknowledged them.
    fn notifications_settled(&self, py: Python<'_>) -> PyResult<usize> {
        py.detach(|| -> Result<usize> {
            let mut p = self.publisher()?;
            block_on(p.notifications_settled())
        })
        .py()
    }
}
