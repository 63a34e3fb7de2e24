//! `weightcast._native`: the Rust side of the Python package.
//!
//! A thin binding: the format, the store protocol, the codec and every
//! verification are the weightcast library's. This layer moves tensors
//! between Python and the library without copying them (pointers lent by the
//! Python side, see [`Lent`]), runs the library's async code on one shared
//! runtime with the GIL released, and turns [`weightcast::Error`] into the
//! package's exception classes (`weightcast._errors`) by [`ErrorKind`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes};
use rayon::prelude::*;

use weightcast::codec::{
    Delta, InPlaceOptions, InPlaceReport, Positions, Prepared, Target, apply_in_place_all, inspect,
    prepare_in_place_all,
};
use weightcast::digest::{Digest, tensor_digest_of};
use weightcast::dtype::{Dtype, parse_dtype, word_bytes};
use weightcast::error::{Error, ErrorKind};
use weightcast::protocol::{Manifest, ObjectRole};
use weightcast::publisher::{
    AnchorEncoding, AnchorPolicy, Checkpoint, PublishOptions, Publisher, PublisherConfig,
};
use weightcast::store::Store;
use weightcast::subscriber::status::Shared;
use weightcast::subscriber::{DirSink, Fetcher, MemorySink, Seen, Subscriber, VersionSource};
use weightcast::tensors::{ExternalBuffer, TensorSet};

type Result<T> = std::result::Result<T, Error>;

// ---------------------------------------------------------------------------
// Errors

/// The Python exception class for a library error: `BaseMismatch` for a
/// delta that does not apply to the tensors it was given (wrong base), else
/// one class per [`ErrorKind`].
fn class_of(e: &Error) -> &'static str {
    match e {
        Error::WrongBase { .. } | Error::BaseMismatch(_) => "BaseMismatch",
        _ => match e.kind() {
            ErrorKind::NotFound => "NotFound",
            ErrorKind::Precondition => "Conflict",
            ErrorKind::Corrupt => "Corrupt",
            ErrorKind::BadRequest => "BadRequest",
            ErrorKind::Unavailable => "Unavailable",
            ErrorKind::Config => "ConfigError",
            ErrorKind::Io => "IoError",
        },
    }
}

/// A library error as the package's exception (the library's message, which
/// names the object, tensor or setting at fault).
fn to_py(e: Error) -> PyErr {
    Python::attach(|py| {
        let make = || -> PyResult<PyErr> {
            let cls = py.import("weightcast._errors")?.getattr(class_of(&e))?;
            let value = cls.call1((e.to_string(), e.kind().as_str()))?;
            Ok(PyErr::from_value(value))
        };
        make().unwrap_or_else(|err| err)
    })
}

trait OrPy<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> OrPy<T> for Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

// ---------------------------------------------------------------------------
// The runtime

/// One multi-threaded runtime for every object of the process.
fn runtime() -> Result<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    if let Some(rt) = RT.get() {
        return Ok(rt);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("weightcast")
        .build()
        .map_err(|e| Error::io("starting the async runtime", e))?;
    Ok(RT.get_or_init(|| rt))
}

fn block_on<F: std::future::Future>(f: F) -> Result<F::Output> {
    Ok(runtime()?.block_on(f))
}

fn store(url: &str, options: &[(String, String)]) -> Result<Store> {
    let opts: Vec<(&str, &str)> = options
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    Store::open_with(url, &opts)
}

// ---------------------------------------------------------------------------
// Tensors lent by Python

/// A tensor as the Python side describes it (`weightcast._tensors.lend`):
/// name, safetensors dtype, shape, the address of its first byte and its
/// size in bytes (a C-contiguous CPU tensor or array).
type Spec = (String, String, Vec<usize>, usize, usize);

/// The bytes of a tensor that Python lends for the duration of one native
/// call.
///
/// Soundness rests on three facts, each checked or guaranteed here:
/// 1. `[ptr, ptr + len)` is the memory of one live, C-contiguous CPU tensor:
///    the Python side reads both from the tensor itself (`data_ptr()` and
///    `numel() × element_size()` for torch, `__array_interface__` and
///    `nbytes` for numpy) after checking contiguity and the device, and
///    [`Lent::new`] refuses a null pointer or a range that wraps around.
/// 2. The memory outlives every slice made from it: the Python objects are
///    arguments of the native call (the caller's references keep them and
///    their storage alive until it returns), and no [`Lent`] — nor the
///    `TensorSet` or `Target` holding one — escapes the call.
/// 3. No other reference to the memory exists while a slice is used: for
///    writing, [`check_disjoint`] refuses two lent ranges that overlap (two
///    names for one storage), and the documented contract of every call that
///    releases the GIL is that no other thread mutates these tensors during
///    it (as with any extension that releases the GIL over a buffer).
struct Lent {
    ptr: usize,
    len: usize,
    writable: bool,
}

impl Lent {
    fn new(name: &str, ptr: usize, len: usize, writable: bool) -> Result<Lent> {
        if len > 0 && (ptr == 0 || ptr.checked_add(len).is_none() || len > isize::MAX as usize) {
            return Err(Error::BadRequest(format!(
                "tensor `{name}`: invalid memory range ({len} bytes at {ptr:#x})"
            )));
        }
        Ok(Lent { ptr, len, writable })
    }

    fn slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: see the type's documentation: the range is one live
        // tensor's memory for the duration of the call, checked non-null and
        // not wrapping; bytes have no alignment or validity requirement.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    fn slice_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as in `slice`, and exclusive: `check_disjoint` ran over
        // every range lent for writing in this call, `&mut self` makes this
        // the only slice of this `Lent`, and the caller's contract excludes
        // other threads.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
    }
}

impl ExternalBuffer for Lent {
    fn bytes(&self) -> &[u8] {
        self.slice()
    }

    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        if self.writable {
            Some(self.slice_mut())
        } else {
            None
        }
    }
}

/// A lent tensor with its parsed dtype.
struct Lending {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    mem: Lent,
}

fn dtype(name: &str, d: &str) -> Result<Dtype> {
    parse_dtype(d)
        .map_err(|_| Error::BadRequest(format!("tensor `{name}`: unknown safetensors dtype `{d}`")))
}

fn lend(specs: Vec<Spec>, writable: bool) -> Result<Vec<Lending>> {
    specs
        .into_iter()
        .map(|(name, d, shape, ptr, len)| {
            let dtype = dtype(&name, &d)?;
            let mem = Lent::new(&name, ptr, len, writable)?;
            Ok(Lending {
                name,
                dtype,
                shape,
                mem,
            })
        })
        .collect()
}

/// Refuses tensors whose memory overlaps (two names for one storage, or
/// views of each other): writing one would change the other behind the
/// verification's back.
fn check_disjoint(lent: &[Lending]) -> Result<()> {
    let mut ranges: Vec<(usize, usize, &str)> = lent
        .iter()
        .filter(|l| l.mem.len > 0)
        .map(|l| (l.mem.ptr, l.mem.ptr + l.mem.len, l.name.as_str()))
        .collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(Error::BadRequest(format!(
                "tensors `{}` and `{}` share memory (tied or views of one storage); pass only \
                 one of them",
                w[0].2, w[1].2
            )));
        }
    }
    Ok(())
}

fn targets(lent: &mut [Lending]) -> Vec<Target<'_>> {
    lent.iter_mut()
        .map(|l| Target {
            name: &l.name,
            dtype: l.dtype,
            shape: &l.shape,
            data: l.mem.slice_mut(),
        })
        .collect()
}

fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

// ---------------------------------------------------------------------------
// Publisher

/// One rank of `world` publishing its shards of each step
/// (`weightcast publish --rank R --world W`); `None` for a lone publisher.
fn distributed(
    rank: Option<u32>,
    world: u32,
    rank_timeout: f64,
) -> Result<Option<weightcast::publisher::Distributed>> {
    match (rank, world) {
        (None, 1) => Ok(None),
        (Some(rank), world) if world >= 2 && rank < world => {
            if !(rank_timeout > 0.0 && rank_timeout.is_finite()) {
                return Err(Error::Config(
                    "rank_timeout must be a positive number of seconds".into(),
                ));
            }
            Ok(Some(weightcast::publisher::Distributed {
                rank,
                world,
                timeout: std::time::Duration::from_secs_f64(rank_timeout),
            }))
        }
        (rank, world) => Err(Error::Config(format!(
            "rank {rank:?} of world {world}: give both, with world >= 2 and 0 <= rank < world \
             (or neither, for one publisher)"
        ))),
    }
}

/// The library's publisher over one store prefix.
#[pyclass(module = "weightcast._native")]
struct NativePublisher {
    inner: Mutex<Publisher>,
}

#[pymethods]
impl NativePublisher {
    #[new]
    #[pyo3(signature = (store_url, state_dir, encoding, anchor_every, anchor_encoding, single_writer, keep_anchors, notify_urls, notify_key, store_options, rank=None, world=1, rank_timeout=600.0))]
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
    ) -> PyResult<NativePublisher> {
        let open = || -> Result<Publisher> {
            let encoding = encoding.parse().map_err(|_| {
                Error::Config(format!(
                    "encoding `{encoding}`: expected compact or trl (the delta encodings)"
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
                let set = TensorSet::from_external(lent.into_iter().map(|l| {
                    (
                        l.name,
                        l.dtype,
                        l.shape,
                        Box::new(l.mem) as Box<dyn ExternalBuffer>,
                    )
                }))
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
            let mut p = self
                .inner
                .lock()
                .map_err(|_| Error::BadRequest("a previous publish panicked".into()))?;
            let out = block_on(p.publish(cp, &PublishOptions { step }))??;
            Ok(json(&out))
        };
        py.detach(run).py()
    }

    /// Waits for the notifications of the versions published so far
    /// (`publish` returns at the commit and notifies in the background);
    /// returns how many subscribers acknowledged them.
    fn notifications_settled(&self, py: Python<'_>) -> PyResult<usize> {
        py.detach(|| -> Result<usize> {
            let mut p = self
                .inner
                .lock()
                .map_err(|_| Error::BadRequest("a previous publish panicked".into()))?;
            block_on(p.notifications_settled())
        })
        .py()
    }
}

// ---------------------------------------------------------------------------
// Subscriber

/// What an engine's tensors are known to hold: per tensor its dtype, shape
/// and digest (from the anchor applied, moved by each delta applied).
#[derive(Clone, Default)]
struct Held {
    version: Option<u64>,
    /// The newest version seen in the bucket.
    newest: Option<u64>,
    /// The next poll must return an anchor (an apply failed verification,
    /// or the caller asked).
    needs_anchor: bool,
    /// The tensor files of the held version (from its anchor), to check that
    /// each delta version covers every one.
    tensor_files: Option<BTreeSet<String>>,
    digests: BTreeMap<String, (Dtype, Vec<usize>, Digest)>,
}

struct SubState {
    fetcher: Fetcher,
    source: VersionSource,
    held: Held,
    /// Push: the notify endpoint's state (its wake-up and status) when the
    /// subscriber listens, and its registration in the bucket.
    push: Option<Push>,
}

/// A listening subscriber: the library's subscriber endpoint
/// (`weightcast::http::subscriber`, as `weightcast subscribe --listen`
/// serves it) on the shared runtime, and the registration that makes the
/// publisher notify it.
struct Push {
    shared: Arc<Shared>,
    /// Registration id and notify URL; `None` id: not registered.
    id: Option<String>,
    notify_url: String,
    /// The version last registered, and when.
    registered: Option<(Option<u64>, std::time::Instant)>,
    /// Dropping it stops the server.
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Push {
    /// Starts the endpoint on `listen`.
    fn start(
        store_url: &str,
        listen: &str,
        key: Option<&str>,
        advertise: Option<String>,
        id: Option<String>,
    ) -> Result<Push> {
        let addr: std::net::SocketAddr = listen.parse().map_err(|e| {
            Error::Config(format!(
                "listen `{listen}`: {e}; expected HOST:PORT, e.g. 0.0.0.0:8471"
            ))
        })?;
        if let Some(id) = &id
            && !weightcast::protocol::registry::valid_id(id)
        {
            return Err(Error::Config(format!(
                "id `{id}` must be [A-Za-z0-9._-]{{1,128}}"
            )));
        }
        let key = key.map(weightcast::notify::Key::new).transpose()?;
        if key.is_none() {
            return Err(Error::Config(
                "listen needs notify_key (the publisher's secret): every unsigned \
                 notification is refused"
                    .into(),
            ));
        }
        let shared = Shared::new(store_url, key);
        let rt = runtime()?;
        let listener = rt
            .block_on(tokio::net::TcpListener::bind(addr))
            .map_err(|e| Error::io(format!("binding {addr}"), e))?;
        let bound = listener
            .local_addr()
            .map_err(|e| Error::io(format!("binding {addr}"), e))?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let s = shared.clone();
        rt.spawn(async move {
            let shutdown = async move {
                let _ = stopped.await;
            };
            if let Err(e) = weightcast::http::subscriber::serve(listener, s, shutdown).await {
                tracing::error!(error = %e, "notify endpoint stopped");
            }
        });
        tracing::info!(%bound, "serving /v1/notify, /v1/status, /healthz, /metrics");
        let notify_url = match advertise {
            Some(url) => url,
            None if id.is_some() => weightcast::notify::default_notify_url(bound)?,
            None => format!("http://{bound}/v1/notify"),
        };
        Ok(Push {
            shared,
            id,
            notify_url,
            registered: None,
            _stop: stop,
        })
    }

    /// The registration, when the held version changed since the last one
    /// or the last is older than the library's refresh interval.
    fn due(&self, version: Option<u64>) -> Option<weightcast::protocol::Registration> {
        let id = self.id.clone()?;
        let due = self.registered.is_none_or(|(v, at)| {
            v != version || at.elapsed() >= weightcast::subscriber::REGISTRATION_REFRESH
        });
        due.then(|| weightcast::protocol::Registration {
            id,
            notify_url: Some(self.notify_url.clone()),
            version,
            quarantined: Vec::new(),
            updated_at: weightcast::notify::unix_now(),
        })
    }
}

/// The library's fetcher and version source, and the version the caller's
/// tensors hold; [`NativeUpdate`]s apply one step each.
#[pyclass(module = "weightcast._native")]
struct NativeSubscriber {
    state: Arc<Mutex<SubState>>,
}

fn lock(state: &Mutex<SubState>) -> Result<std::sync::MutexGuard<'_, SubState>> {
    state
        .lock()
        .map_err(|_| Error::BadRequest("a previous call on this subscriber panicked".into()))
}

#[pymethods]
impl NativeSubscriber {
    #[new]
    #[pyo3(signature = (store_url, version, poll_interval, store_options, listen=None, notify_key=None, advertise=None, id=None))]
    #[allow(clippy::too_many_arguments)] // the Python keyword arguments, one each
    fn new(
        py: Python<'_>,
        store_url: String,
        version: Option<u64>,
        poll_interval: f64,
        store_options: Vec<(String, String)>,
        listen: Option<String>,
        notify_key: Option<String>,
        advertise: Option<String>,
        id: Option<String>,
    ) -> PyResult<NativeSubscriber> {
        let store = store(&store_url, &store_options).py()?;
        let push = match listen {
            Some(listen) => Some(
                py.detach(|| {
                    Push::start(store.url(), &listen, notify_key.as_deref(), advertise, id)
                })
                .py()?,
            ),
            None if id.is_some() || advertise.is_some() => {
                return Err(to_py(Error::Config(
                    "id and advertise register a notify endpoint: they need listen".into(),
                )));
            }
            None => None,
        };
        let interval = Duration::try_from_secs_f64(poll_interval).map_err(|_| {
            to_py(Error::Config(format!(
                "poll_interval {poll_interval}: not a duration"
            )))
        })?;
        Ok(NativeSubscriber {
            state: Arc::new(Mutex::new(SubState {
                fetcher: Fetcher::new(store),
                source: VersionSource::new(interval, 0.1),
                held: Held {
                    version,
                    ..Held::default()
                },
                push,
            })),
        })
    }

    /// The notify URL this subscriber registers (`None` when it does not
    /// listen).
    #[getter]
    fn notify_url(&self, py: Python<'_>) -> PyResult<Option<String>> {
        py.detach(|| lock(&self.state).map(|s| s.push.as_ref().map(|p| p.notify_url.clone())))
            .py()
    }

    /// Notifications accepted so far (0 when not listening).
    #[getter]
    fn notifications(&self, py: Python<'_>) -> PyResult<u64> {
        py.detach(|| {
            let st = lock(&self.state)?;
            Ok(st
                .push
                .as_ref()
                .map_or(0, |p| p.shared.status.lock().map_or(0, |s| s.notifications)))
        })
        .py()
    }

    /// Waits up to `seconds` for a notification (GIL released); true when
    /// one arrived (one that arrived since the last wait counts at once),
    /// false when the time ran out or the subscriber does not listen.
    fn wait_notified(&self, py: Python<'_>, seconds: f64) -> PyResult<bool> {
        let d = Duration::try_from_secs_f64(seconds.max(0.0)).map_err(|_| {
            to_py(Error::BadRequest(format!(
                "wait of {seconds} s: not a duration"
            )))
        })?;
        let shared = py
            .detach(|| lock(&self.state).map(|s| s.push.as_ref().map(|p| p.shared.clone())))
            .py()?;
        py.detach(|| {
            block_on(async {
                match shared {
                    Some(sh) => tokio::select! {
                        _ = tokio::time::sleep(d) => false,
                        _ = sh.wake.notified() => true,
                    },
                    None => {
                        tokio::time::sleep(d).await;
                        false
                    }
                }
            })
        })
        .py()
    }

    /// The version the caller's tensors hold (advanced by a successful apply).
    #[getter]
    fn version(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        py.detach(|| lock(&self.state).map(|s| s.held.version)).py()
    }

    /// The newest version seen in the bucket.
    #[getter]
    fn newest(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        py.detach(|| lock(&self.state).map(|s| s.held.newest)).py()
    }

    /// The next wait of the poll loop, seconds (the interval with jitter).
    fn next_wait(&self, py: Python<'_>) -> PyResult<f64> {
        py.detach(|| lock(&self.state).map(|mut s| s.source.next_wait().as_secs_f64()))
            .py()
    }

    /// Store requests made so far.
    #[getter]
    fn requests(&self, py: Python<'_>) -> PyResult<u64> {
        py.detach(|| lock(&self.state).map(|s| s.fetcher.requests()))
            .py()
    }

    /// The next update, downloaded and checked against its manifest (sizes,
    /// BLAKE3; an anchor update also decoded and verified): the next delta
    /// version after the held one, or an anchor of the newest version when
    /// nothing is held, replaying is dearer, `anchor` asks for one or an
    /// apply failed verification. `None` when nothing is new.
    #[pyo3(signature = (thorough=false, anchor=false))]
    fn poll(&self, py: Python<'_>, thorough: bool, anchor: bool) -> PyResult<Option<NativeUpdate>> {
        let state = self.state.clone();
        py.detach(|| block_on(poll(state, thorough, anchor))?).py()
    }

    /// Checks every tensor given against the digest recorded for the held
    /// version (a full pass over each); returns `{"version", "checked",
    /// "unknown"}` as JSON, or raises `Corrupt` naming the first tensor that
    /// differs.
    fn verify(&self, py: Python<'_>, tensors: Vec<Spec>) -> PyResult<String> {
        let state = self.state.clone();
        py.detach(move || -> Result<String> {
            let lent = lend(tensors, false)?;
            let st = lock(&state)?;
            let version = st.held.version;
            if st.held.digests.is_empty() {
                return Err(Error::NotFound(format!(
                    "no digests are recorded for version {version:?}: they come with an update \
                     applied through this subscriber (an anchor records every tensor)"
                )));
            }
            let mut checked = Vec::new();
            let mut unknown = Vec::new();
            let results: Vec<Option<Result<()>>> = lent
                .par_iter()
                .map(|l| {
                    let (dtype, shape, want) = st.held.digests.get(&l.name)?;
                    Some((|| {
                        if (*dtype, shape) != (l.dtype, &l.shape) {
                            return Err(Error::BaseMismatch(format!(
                                "tensor `{}` is {} {:?}, version {version:?} has {} {:?}",
                                l.name, l.dtype, l.shape, dtype, shape
                            )));
                        }
                        let got = tensor_digest_of(&l.name, l.dtype, &l.shape, l.mem.slice())?;
                        if got != *want {
                            return Err(Error::Integrity {
                                scope: format!("tensor {} of version {version:?}", l.name),
                                expected: want.to_string(),
                                actual: got.to_string(),
                            });
                        }
                        Ok(())
                    })())
                })
                .collect();
            for (l, r) in lent.iter().zip(results) {
                match r {
                    Some(r) => {
                        r?;
                        checked.push(l.name.clone());
                    }
                    None => unknown.push(l.name.clone()),
                }
            }
            let given: BTreeSet<&str> = lent.iter().map(|l| l.name.as_str()).collect();
            let missing: Vec<&String> = st
                .held
                .digests
                .keys()
                .filter(|n| !given.contains(n.as_str()))
                .collect();
            Ok(serde_json::json!({
                "version": version,
                "checked": checked.len(),
                "unknown": unknown,
                "not_given": missing,
            })
            .to_string())
        })
        .py()
    }
}

async fn poll(
    state: Arc<Mutex<SubState>>,
    thorough: bool,
    anchor: bool,
) -> Result<Option<NativeUpdate>> {
    // Work on copies; the state is locked only to read and to record.
    let (fetcher, mut source, held, registration) = {
        let st = lock(&state)?;
        let reg = st.push.as_ref().and_then(|p| p.due(st.held.version));
        (st.fetcher.clone(), st.source.clone(), st.held.clone(), reg)
    };
    if let Some(reg) = registration {
        fetcher.count(1);
        match weightcast::protocol::register(fetcher.store(), &reg).await {
            Ok(()) => {
                if let Some(p) = lock(&state)?.push.as_mut() {
                    p.registered = Some((reg.version, std::time::Instant::now()));
                }
            }
            Err(e) => tracing::warn!(error = %e, "registration failed"),
        }
    }
    let version = held.version;
    let want_anchor = anchor || held.needs_anchor;
    // One step at a time: a newer version seen before is still the target
    // (the hint's ETag does not change between the steps).
    let known = held.newest.filter(|&n| version.is_none_or(|h| n > h));
    let seen = match known {
        Some(n) if !thorough => Seen::Newest(n),
        _ => source.check(&fetcher, version, thorough).await?,
    };
    lock(&state)?.source = source;
    let target = match seen {
        Seen::Empty => return Ok(None),
        Seen::Same if !want_anchor => return Ok(None),
        Seen::Same => version.expect("a held version when nothing is new"),
        Seen::Newest(t) => t,
    };
    {
        let mut st = lock(&state)?;
        st.held.newest = Some(st.held.newest.map_or(target, |n| n.max(target)));
    }
    if version == Some(target) && !want_anchor {
        return Ok(None);
    }
    let replay = if want_anchor {
        None
    } else {
        match weightcast::subscriber::plan::plan(&fetcher, version, target).await? {
            (weightcast::subscriber::Plan::Replay(vs), mut chain) => {
                let v = vs[0];
                Some(chain.remove(&v).expect("the plan's manifests are read"))
            }
            _ => None,
        }
    };
    let (body, version, base) = match replay {
        Some(m) => {
            let (v, base) = (m.version, m.base_version);
            (delta_step(&fetcher, &held, m).await?, v, base)
        }
        None => {
            let mut sub = Subscriber::new(
                fetcher.clone(),
                VersionSource::new(Duration::from_secs(1), 0.0),
                MemorySink::new(),
            );
            sub.catch_up_to(target).await?;
            let (_, tensors, files) = sub.sink.into_parts();
            tracing::info!(
                version = target,
                files = tensors.len(),
                "anchor update ready"
            );
            (Body::Anchor { tensors, files }, target, None)
        }
    };
    Ok(Some(NativeUpdate {
        state,
        version,
        base,
        body,
        staged: Mutex::new(None),
    }))
}

/// Downloads the delta and file objects of version `m` (verified against the
/// manifest by the fetcher) and checks that it covers every tensor file held.
async fn delta_step(f: &Fetcher, held: &Held, m: Manifest) -> Result<Body> {
    if m.base_version != held.version {
        return Err(Error::metadata(
            "manifest",
            format!(
                "version {} applies to version {:?}, the tensors hold {:?}",
                m.version, m.base_version, held.version
            ),
        ));
    }
    let mut deltas = Vec::new();
    let mut files = Vec::new();
    for o in m.replay_objects() {
        let body = f.bytes(o).await?;
        match o.role {
            ObjectRole::Delta => deltas.push((o.name.clone(), body)),
            _ => files.push((o.name.clone(), body)),
        }
    }
    if let Some(expected) = &held.tensor_files {
        let got: BTreeSet<String> = deltas.iter().map(|d| d.0.clone()).collect();
        if &got != expected {
            return Err(Error::metadata(
                "manifest",
                format!(
                    "version {} has deltas for {got:?}, the held version's tensor files are \
                     {expected:?}",
                    m.version
                ),
            ));
        }
    }
    tracing::info!(
        version = m.version,
        bytes = deltas.iter().map(|d| d.1.len()).sum::<usize>(),
        "delta update ready"
    );
    Ok(Body::Delta { deltas, files })
}

enum Body {
    Delta {
        /// (tensor file, verified delta object)
        deltas: Vec<(String, Bytes)>,
        /// (file, verified body) of the non-tensor files that changed
        files: Vec<(String, Bytes)>,
    },
    Anchor {
        tensors: BTreeMap<String, TensorSet>,
        files: BTreeMap<String, Vec<u8>>,
    },
}

/// One update: a delta version after the held one, or a verified anchor.
#[pyclass(module = "weightcast._native")]
struct NativeUpdate {
    state: Arc<Mutex<SubState>>,
    version: u64,
    base: Option<u64>,
    body: Body,
    /// What `prepare_buffers` decoded, until `commit_prepared` writes it.
    staged: Mutex<Option<Staged>>,
}

/// A prepared delta and the tensors it was prepared on: their memory
/// (pointer, length; the commit must be given the same) and structure.
struct Staged {
    prepared: Prepared,
    memory: HashMap<String, (usize, usize)>,
    info: HashMap<String, (Dtype, Vec<usize>)>,
}

/// Each lent tensor's dtype and shape, by name.
fn structure(lent: &[Lending]) -> HashMap<String, (Dtype, Vec<usize>)> {
    lent.iter()
        .map(|l| (l.name.clone(), (l.dtype, l.shape.clone())))
        .collect()
}

impl NativeUpdate {
    fn staged(&self) -> std::sync::MutexGuard<'_, Option<Staged>> {
        self.staged.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a delta applied to lent tensors (`reports`, the tensors'
    /// structure `info`) and returns the JSON report.
    fn applied(
        &self,
        st: &mut SubState,
        reports: &[InPlaceReport],
        info: &HashMap<String, (Dtype, Vec<usize>)>,
        started: std::time::Instant,
        prepared: bool,
    ) -> String {
        let changes: Vec<_> = reports
            .iter()
            .flat_map(|r| &r.tensors)
            .map(|t| {
                let (d, s) = info[&t.name].clone();
                (t.name.clone(), d, s, t.digest)
            })
            .collect();
        self.advance(st, &changes);
        let changed: u64 = reports.iter().map(|r| r.changed).sum();
        let seconds = started.elapsed().as_secs_f64();
        tracing::info!(
            version = self.version,
            changed,
            seconds,
            prepared,
            "delta applied in place"
        );
        serde_json::json!({
            "version": self.version,
            "kind": "delta",
            "changed": changed,
            "changed_tensors": reports
                .iter()
                .flat_map(|r| &r.tensors)
                .filter(|t| t.changed > 0)
                .map(|t| &t.name)
                .collect::<Vec<_>>(),
            "kept": reports.iter().map(|r| r.kept).sum::<u64>(),
            "seconds": seconds,
            "prepared": prepared,
        })
        .to_string()
    }

    /// Every (file, tensor index) of an anchor, by tensor name.
    fn anchor_index(&self) -> Result<HashMap<&str, (&TensorSet, usize)>> {
        let Body::Anchor { tensors, .. } = &self.body else {
            return Ok(HashMap::new());
        };
        let mut out = HashMap::new();
        for (file, set) in tensors {
            for (i, t) in set.tensors().iter().enumerate() {
                if out.insert(t.name.as_str(), (set, i)).is_some() {
                    return Err(Error::tensor(
                        &t.name,
                        format!("appears in two tensor files (`{file}` and another)"),
                    ));
                }
            }
        }
        Ok(out)
    }

    /// The held version must still be this update's base.
    fn check_base(&self, held: &Held) -> Result<()> {
        if self.base.is_some() && held.version != self.base {
            return Err(Error::Conflict(format!(
                "this update takes version {:?} to {}, but the tensors now hold version {:?}; \
                 poll again",
                self.base, self.version, held.version
            )));
        }
        Ok(())
    }

    /// Records a delta apply: the held version and the changed tensors' digests.
    fn advance(&self, st: &mut SubState, changes: &[(String, Dtype, Vec<usize>, Digest)]) {
        self.advance_held(&mut st.held, changes);
        report_held(st);
    }

    fn advance_held(&self, held: &mut Held, changes: &[(String, Dtype, Vec<usize>, Digest)]) {
        if let Some(known) = held.version.filter(|_| !held.digests.is_empty()) {
            debug_assert_eq!(Some(known), self.base);
        }
        for (name, dtype, shape, digest) in changes {
            held.digests
                .insert(name.clone(), (*dtype, shape.clone(), *digest));
        }
        held.version = Some(self.version);
        held.needs_anchor = false;
    }
}

/// Records a version the caller's tensors now hold in the notify
/// endpoint's status (`/v1/status`, `/metrics`), when listening.
fn report_held(st: &SubState) {
    if let Some(p) = &st.push
        && let Ok(mut s) = p.shared.status.lock()
    {
        s.version = st.held.version;
        s.newest = st.held.newest;
        s.lag = s.newest.zip(s.version).map(|(n, v)| n.saturating_sub(v));
        s.versions_applied += 1;
    }
}

/// The held digests of the lent tensors, in the order a [`TensorSet`] sorts
/// them (by name), when the single-pass apply can run: one tensor file whose
/// every tensor is lent (and nothing else), each with a recorded digest (an
/// anchor applied through this subscriber). `None`: use the two-pass apply.
fn single_pass_digests(
    held: &Held,
    deltas: &[(String, Bytes)],
    lent: &[Lending],
) -> Option<Vec<Digest>> {
    let [(file, _)] = deltas else { return None };
    let files = held.tensor_files.as_ref()?;
    if files.len() != 1 || !files.contains(file) || lent.len() != held.digests.len() {
        return None;
    }
    let mut names: Vec<&Lending> = lent.iter().collect();
    names.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    names
        .iter()
        .map(|l| {
            let (dtype, shape, d) = held.digests.get(&l.name)?;
            ((*dtype, shape) == (l.dtype, &l.shape)).then_some(*d)
        })
        .collect()
}

/// Marks the held state for an anchor when `r` failed verification (the
/// tensors, or the bucket's data, cannot be trusted to replay onto).
fn repair_on_failure<T>(held: &mut Held, r: Result<T>) -> Result<T> {
    if let Err(e) = &r
        && e.kind() == ErrorKind::Corrupt
    {
        held.needs_anchor = true;
        tracing::warn!(error = %e, "apply refused; the next poll returns an anchor update");
    }
    r
}

/// [`repair_on_failure`] on the subscriber's state.
fn repair_shared<T>(state: &Mutex<SubState>, r: Result<T>) -> Result<T> {
    match state.lock() {
        Ok(mut st) => repair_on_failure(&mut st.held, r),
        Err(_) => r,
    }
}

#[pymethods]
impl NativeUpdate {
    #[getter]
    fn version(&self) -> u64 {
        self.version
    }

    #[getter]
    fn kind(&self) -> &'static str {
        match self.body {
            Body::Delta { .. } => "delta",
            Body::Anchor { .. } => "anchor",
        }
    }

    #[getter]
    fn base_version(&self) -> Option<u64> {
        self.base
    }

    /// Bytes downloaded for this update's objects (anchor updates: the
    /// decoded tensors' size).
    #[getter]
    fn nbytes(&self) -> u64 {
        match &self.body {
            Body::Delta { deltas, files, .. } => {
                deltas.iter().chain(files).map(|d| d.1.len() as u64).sum()
            }
            Body::Anchor { tensors, .. } => tensors.values().map(|s| s.total_bytes()).sum(),
        }
    }

    /// (name, dtype, shape) of every tensor the update writes: the changed
    /// tensors of a delta, every tensor of an anchor.
    fn tensors(&self) -> PyResult<Vec<(String, String, Vec<usize>)>> {
        match &self.body {
            Body::Delta { deltas, .. } => {
                let mut out = Vec::new();
                for (file, d) in deltas {
                    let (_, h) = inspect(d).py()?;
                    let h = h.ok_or_else(|| {
                        to_py(Error::metadata(
                            "weightcast.format",
                            format!("the delta for `{file}` is not a weightcast delta"),
                        ))
                    })?;
                    for (name, e) in h.tensors {
                        out.push((name, e.dtype, e.shape.iter().map(|&d| d as usize).collect()));
                    }
                }
                Ok(out)
            }
            Body::Anchor { tensors, .. } => Ok(tensors
                .values()
                .flat_map(|s| s.tensors())
                .map(|t| (t.name.clone(), t.dtype.to_string(), t.shape.clone()))
                .collect()),
        }
    }

    /// The non-tensor files of the version: every one for an anchor, the
    /// changed ones for a delta.
    fn files<'py>(&self, py: Python<'py>) -> Vec<(String, Bound<'py, PyBytes>)> {
        match &self.body {
            Body::Delta { files, .. } => files
                .iter()
                .map(|(n, b)| (n.clone(), PyBytes::new(py, b)))
                .collect(),
            Body::Anchor { files, .. } => files
                .iter()
                .map(|(n, b)| (n.clone(), PyBytes::new(py, b)))
                .collect(),
        }
    }

    /// A copy of an anchor tensor's bytes.
    fn tensor_bytes<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyByteArray>> {
        let index = self.anchor_index().py()?;
        let (set, i) = index.get(name).ok_or_else(|| {
            to_py(Error::NotFound(format!(
                "tensor `{name}` is not in this {} update",
                self.kind()
            )))
        })?;
        Ok(PyByteArray::new(py, set.data(*i)))
    }

    /// Applies the update to CPU tensors in place (with the GIL released):
    /// a delta through the library's verify-then-write apply (nothing is
    /// written unless every changed element holds its base value), an
    /// anchor by copying every tensor (all present with the right dtype and
    /// shape, checked first). Returns a JSON report.
    #[pyo3(signature = (tensors, single_pass=false))]
    fn apply_buffers(
        &self,
        py: Python<'_>,
        tensors: Vec<Spec>,
        single_pass: bool,
    ) -> PyResult<String> {
        py.detach(|| -> Result<String> {
            let mut lent = lend(tensors, true)?;
            check_disjoint(&lent)?;
            let mut st = lock(&self.state)?;
            self.check_base(&st.held)?;
            let started = std::time::Instant::now();
            if single_pass
                && let Body::Delta { deltas, .. } = &self.body
                && let Some(held) = single_pass_digests(&st.held, deltas, &lent)
            {
                let (file, object) = &deltas[0];
                let set = TensorSet::from_external(lent.into_iter().map(|l| {
                    (
                        l.name,
                        l.dtype,
                        l.shape,
                        Box::new(l.mem) as Box<dyn ExternalBuffer>,
                    )
                }));
                let mut set = set.map_err(|e| e.in_input(format!("tensor file `{file}`")))?;
                set.assume_digests(&held)?;
                // The payload is BLAKE3-checked first, so a tensor whose
                // digest does not come out is the local base's fault.
                let r = weightcast::codec::apply_delta(&mut set, object).map_err(|e| match e {
                    Error::Integrity {
                        scope,
                        expected,
                        actual,
                    } => Error::BaseMismatch(format!(
                        "{scope}: the delta's result has digest {actual}, the publisher's is \
                         {expected}: an element it changes did not hold its base value \
                         (every word written was put back)"
                    )),
                    e => e,
                });
                let report = repair_on_failure(&mut st.held, r)?;
                let changes: Vec<_> = set
                    .tensors()
                    .iter()
                    .filter(|t| report.changed_tensors.contains(&t.name))
                    .map(|t| (t.name.clone(), t.dtype, t.shape.clone(), t.digest))
                    .collect();
                self.advance(&mut st, &changes);
                let seconds = started.elapsed().as_secs_f64();
                tracing::info!(
                    version = self.version,
                    changed = report.changed,
                    seconds,
                    "delta applied in place (single pass)"
                );
                return Ok(serde_json::json!({
                    "version": self.version,
                    "kind": "delta",
                    "changed": report.changed,
                    "changed_tensors": report.changed_tensors,
                    "seconds": seconds,
                    "single_pass": true,
                })
                .to_string());
            }
            match &self.body {
                Body::Delta { deltas, .. } => {
                    let objects: Vec<&[u8]> = deltas.iter().map(|d| &d.1[..]).collect();
                    let info = structure(&lent);
                    let r = apply_in_place_all(
                        &mut targets(&mut lent),
                        &objects,
                        &InPlaceOptions::default(),
                    );
                    let reports = repair_on_failure(&mut st.held, r)?;
                    Ok(self.applied(&mut st, &reports, &info, started, false))
                }
                Body::Anchor { tensors, .. } => {
                    let index = self.anchor_index()?;
                    let by_name: HashMap<&str, usize> = lent
                        .iter()
                        .enumerate()
                        .map(|(i, l)| (l.name.as_str(), i))
                        .collect();
                    // Every tensor present with its structure, before any write.
                    let mut pairs = Vec::with_capacity(index.len());
                    for (name, (set, i)) in &index {
                        let t = &set.tensors()[*i];
                        let k = *by_name.get(name).ok_or_else(|| {
                            Error::BadRequest(format!(
                                "tensor `{name}` of version {} is not among the tensors given",
                                self.version
                            ))
                        })?;
                        let l = &lent[k];
                        if (l.dtype, &l.shape) != (t.dtype, &t.shape) {
                            return Err(Error::BaseMismatch(format!(
                                "tensor `{name}` is {} {:?}, version {} has {} {:?}",
                                l.dtype, l.shape, self.version, t.dtype, t.shape
                            )));
                        }
                        pairs.push((k, *set, *i));
                    }
                    pairs.sort_unstable_by_key(|p| p.0);
                    let mut slots: Vec<Option<&mut [u8]>> =
                        lent.iter_mut().map(|l| Some(l.mem.slice_mut())).collect();
                    let jobs: Vec<(&mut [u8], &[u8])> = pairs
                        .iter()
                        .map(|(k, set, i)| (slots[*k].take().expect("distinct"), set.data(*i)))
                        .collect();
                    jobs.into_par_iter()
                        .for_each(|(dst, src)| dst.copy_from_slice(src));
                    let changes: Vec<_> = index
                        .values()
                        .map(|(set, i)| {
                            let t = &set.tensors()[*i];
                            (t.name.clone(), t.dtype, t.shape.clone(), t.digest)
                        })
                        .collect();
                    st.held.digests.clear();
                    st.held.tensor_files = Some(tensors.keys().cloned().collect());
                    self.advance(&mut st, &changes);
                    let seconds = started.elapsed().as_secs_f64();
                    tracing::info!(
                        version = self.version,
                        tensors = changes.len(),
                        seconds,
                        "anchor copied in place"
                    );
                    Ok(serde_json::json!({
                        "version": self.version,
                        "kind": "anchor",
                        "changed": changes.len(),
                        "changed_tensors": changes.iter().map(|c| &c.0).collect::<Vec<_>>(),
                        "seconds": seconds,
                    })
                    .to_string())
                }
            }
        })
        .py()
    }

    /// The first half of a delta's apply to lent CPU tensors: verifies every
    /// changed element's base and decodes every change, writing nothing (the
    /// engine still serves from these tensors). `commit_prepared` writes
    /// them. False, with nothing held, for what cannot be held decoded (an
    /// anchor, a TRL-encoded delta): apply those with `apply_buffers`.
    fn prepare_buffers(&self, py: Python<'_>, tensors: Vec<Spec>) -> PyResult<bool> {
        py.detach(|| -> Result<bool> {
            let Body::Delta { deltas, .. } = &self.body else {
                return Ok(false);
            };
            let mut lent = lend(tensors, true)?;
            check_disjoint(&lent)?;
            let mut st = lock(&self.state)?;
            self.check_base(&st.held)?;
            let objects: Vec<&[u8]> = deltas.iter().map(|d| &d.1[..]).collect();
            let prepared = match prepare_in_place_all(&mut targets(&mut lent), &objects) {
                Err(Error::Unsupported { reason, .. }) => {
                    tracing::debug!(%reason, "update not prepared; it applies in one call");
                    return Ok(false);
                }
                r => repair_on_failure(&mut st.held, r)?,
            };
            let memory = lent
                .iter()
                .map(|l| (l.name.clone(), (l.mem.ptr, l.mem.len)))
                .collect();
            tracing::debug!(
                version = self.version,
                changed = prepared.changed(),
                held_bytes = prepared.held_bytes(),
                "delta prepared"
            );
            *self.staged() = Some(Staged {
                prepared,
                memory,
                info: structure(&lent),
            });
            Ok(true)
        })
        .py()
    }

    /// The second half: writes what `prepare_buffers` decoded into the same
    /// tensors (the same memory, checked), nothing else: one scatter of the
    /// changed words. Returns the report `apply_buffers` returns.
    fn commit_prepared(&self, py: Python<'_>, tensors: Vec<Spec>) -> PyResult<String> {
        py.detach(|| -> Result<String> {
            // The same lock order as `prepare_buffers`: the state, then the
            // staged changes.
            let mut st = lock(&self.state)?;
            let mut slot = self.staged();
            let not_prepared = || {
                Error::BadRequest(format!(
                    "version {} was not prepared (prepare returned false, or it was committed \
                     already)",
                    self.version
                ))
            };
            let mut lent = lend(tensors, true)?;
            check_disjoint(&lent)?;
            {
                // Checked before the prepared changes are taken: a refused
                // commit can be retried with the right tensors.
                let staged = slot.as_ref().ok_or_else(not_prepared)?;
                for name in staged.prepared.tensor_names() {
                    let now = lent
                        .iter()
                        .find(|l| l.name == name)
                        .map(|l| (l.mem.ptr, l.mem.len));
                    if now != staged.memory.get(name).copied() {
                        return Err(Error::BadRequest(format!(
                            "tensor `{name}` is not the memory version {} was prepared on: \
                             commit the tensors given to prepare",
                            self.version
                        )));
                    }
                }
            }
            self.check_base(&st.held)?;
            let staged = slot.take().ok_or_else(not_prepared)?;
            let started = std::time::Instant::now();
            let reports = staged.prepared.commit(&mut targets(&mut lent))?;
            Ok(self.applied(&mut st, &reports, &staged.info, started, true))
        })
        .py()
    }

    /// The device path of a delta, verification half: for every changed
    /// tensor, `gather(name, positions, position_width, word_width)` returns
    /// the old words at `positions` (little-endian, `word_width` bytes each),
    /// gathered wherever the tensor lives; the library checks them against
    /// the delta's base (its additive digests) and returns, only when every
    /// tensor passed, `[(name, positions, position_width, new_words,
    /// word_width)]` to scatter. Nothing is written here.
    fn resolve_all<'py>(
        &self,
        py: Python<'py>,
        gather: Bound<'py, PyAny>,
    ) -> PyResult<Vec<Resolved<'py>>> {
        let Body::Delta { deltas, .. } = &self.body else {
            return Err(to_py(Error::BadRequest(
                "an anchor update has no positions; copy its tensors".into(),
            )));
        };
        py.detach(|| self.check_base(&lock(&self.state)?.held))
            .py()?;
        let mut out = Vec::new();
        for (_, object) in deltas {
            let delta = py
                .detach(|| repair_shared(&self.state, Delta::parse(object)))
                .py()?;
            let names: Vec<(String, Dtype)> = delta
                .header()
                .tensors
                .iter()
                .map(|(n, e)| Ok((n.clone(), dtype(n, &e.dtype)?)))
                .collect::<Result<_>>()
                .py()?;
            for (name, dt) in names {
                let wb = word_bytes(dt);
                let positions = py
                    .detach(|| repair_shared(&self.state, delta.changed_positions(&name)))
                    .py()?;
                let (pos_bytes, pw) = positions_bytes(&positions);
                let old = gather.call1((name.as_str(), PyBytes::new(py, &pos_bytes), pw, wb))?;
                let old: Vec<u8> = old.extract()?;
                let new = py
                    .detach(|| repair_shared(&self.state, delta.resolve(&name, &positions, &old)))
                    .py()?;
                out.push((
                    name,
                    PyBytes::new(py, &pos_bytes),
                    pw,
                    PyBytes::new(py, &new),
                    wb,
                ));
            }
        }
        Ok(out)
    }

    /// The device path, after the caller wrote the tensors itself (a
    /// delta's `resolve_all` scattered, an anchor's tensors copied): records
    /// the new version and its digests.
    fn commit_resolved(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| -> Result<()> {
            let mut changes = Vec::new();
            match &self.body {
                Body::Delta { deltas, .. } => {
                    for (file, d) in deltas {
                        let (_, h) = inspect(d)?;
                        let h = h.ok_or_else(|| {
                            Error::metadata(
                                "weightcast.format",
                                format!("the delta for `{file}` is not a weightcast delta"),
                            )
                        })?;
                        for (name, e) in h.tensors {
                            let dt = dtype(&name, &e.dtype)?;
                            let digest = Digest::parse(&e.digest).ok_or_else(|| {
                                Error::metadata(format!("tensors.{name}.digest"), "not a digest")
                            })?;
                            let shape = e.shape.iter().map(|&d| d as usize).collect();
                            changes.push((name, dt, shape, digest));
                        }
                    }
                }
                Body::Anchor { tensors, .. } => {
                    changes = tensors
                        .values()
                        .flat_map(|s| s.tensors())
                        .map(|t| (t.name.clone(), t.dtype, t.shape.clone(), t.digest))
                        .collect();
                }
            }
            let mut st = lock(&self.state)?;
            self.check_base(&st.held)?;
            if let Body::Anchor { tensors, .. } = &self.body {
                st.held.digests.clear();
                st.held.tensor_files = Some(tensors.keys().cloned().collect());
            }
            self.advance(&mut st, &changes);
            Ok(())
        })
        .py()
    }

    /// Materializes the version in an output directory exactly as
    /// `weightcast subscribe --out DIR` does (slots, `DIR/current`), through
    /// the library's directory sink: replayed onto what the directory holds
    /// when that is cheaper, else from the anchor. Returns the catch-up
    /// report as JSON.
    #[pyo3(signature = (dir, slots=2))]
    fn save_to(&self, py: Python<'_>, dir: String, slots: usize) -> PyResult<String> {
        let fetcher = py
            .detach(|| lock(&self.state).map(|s| s.fetcher.clone()))
            .py()?;
        let version = self.version;
        py.detach(move || -> Result<String> {
            let dir = std::path::PathBuf::from(dir);
            std::fs::create_dir_all(&dir)
                .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
            let sink = DirSink::open(&dir, slots)?;
            let mut sub = Subscriber::new(
                fetcher,
                VersionSource::new(Duration::from_secs(1), 0.0),
                sink,
            );
            let c = block_on(sub.catch_up_to(version))??;
            Ok(json(&c))
        })
        .py()
    }
}

/// One tensor resolved for the device path: (name, positions,
/// position width, new words, word width).
type Resolved<'py> = (
    String,
    Bound<'py, PyBytes>,
    usize,
    Bound<'py, PyBytes>,
    usize,
);

fn positions_bytes(p: &Positions) -> (Vec<u8>, usize) {
    match p {
        Positions::U32(v) => (v.iter().flat_map(|i| i.to_le_bytes()).collect(), 4),
        Positions::U64(v) => (v.iter().flat_map(|i| i.to_le_bytes()).collect(), 8),
    }
}

/// Runs engine hooks (`sglang:URL`, `vllm:URL`, `webhook:URL`,
/// `command:CMD`) for a version in `dir`, as `weightcast subscribe` does
/// after a switch, under the library's hook policy (`timeout` per request and
/// `budget` per hook, seconds; `sglang_pause` the mode sent to SGLang);
/// returns the library's report (`pause_seconds`, `failed`, `failures`) as
/// JSON.
#[pyfunction]
#[pyo3(signature = (hooks, version, dir, changed_tensors, timeout=None, budget=None, sglang_pause=None))]
#[allow(clippy::too_many_arguments)]
fn run_hooks(
    py: Python<'_>,
    hooks: Vec<String>,
    version: u64,
    dir: String,
    changed_tensors: Vec<String>,
    timeout: Option<f64>,
    budget: Option<f64>,
    sglang_pause: Option<String>,
) -> PyResult<String> {
    py.detach(|| -> Result<String> {
        let hooks = hooks
            .iter()
            .map(|h| h.parse())
            .collect::<Result<Vec<weightcast::hooks::Hook>>>()?;
        let seconds = |what: &str, v: Option<f64>, default: Duration| match v {
            None => Ok(default),
            Some(s) => Duration::try_from_secs_f64(s)
                .map_err(|_| Error::Config(format!("hook {what} {s}: not a duration in seconds"))),
        };
        let d = weightcast::hooks::HookPolicy::default();
        let policy = weightcast::hooks::HookPolicy {
            timeout: seconds("timeout", timeout, d.timeout)?,
            budget: seconds("budget", budget, d.budget)?,
            sglang_pause: match sglang_pause {
                Some(m) => m.parse()?,
                None => d.sglang_pause,
            },
            ..d
        };
        let event = weightcast::hooks::Event {
            version,
            dir: dir.into(),
            changed_tensors,
        };
        let report = block_on(weightcast::hooks::run(&hooks, &event, &policy))?;
        Ok(json(&report))
    })
    .py()
}

/// The full digest of one tensor (a pass over it), as the library computes
/// it for headers: for checks outside a subscriber.
#[pyfunction]
fn tensor_digest(py: Python<'_>, tensor: Spec) -> PyResult<String> {
    py.detach(|| -> Result<String> {
        let lent = lend(vec![tensor], false)?;
        let l = &lent[0];
        Ok(tensor_digest_of(&l.name, l.dtype, &l.shape, l.mem.slice())?.to_string())
    })
    .py()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let _ = pyo3_log::try_init();
    m.add_class::<NativePublisher>()?;
    m.add_class::<NativeSubscriber>()?;
    m.add_class::<NativeUpdate>()?;
    m.add_function(wrap_pyfunction!(run_hooks, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_digest, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
