//! `weightcast._native`: the Rust side of the Python package.
//!
//! A thin binding: the format, the store protocol, the codec and every
//! verification are the weightcast library's. This layer moves tensors
//! between Python and the library without copying them (pointers lent by the
//! Python side, see [`Lent`]), runs the library's async code on one shared
//! runtime with the GIL released, and turns [`weightcast::Error`] into the
//! package's exception classes (`weightcast._errors`) by [`ErrorKind`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes};
use rayon::prelude::*;

use weightcast::codec::Positions;
use weightcast::dtype::{Dtype, parse_dtype};
use weightcast::error::{Error, ErrorKind};
use weightcast::store::Store;
use weightcast::subscriber::lent::{LentTensor, Resolved};
use weightcast::subscriber::status::Shared;
use weightcast::subscriber::{
    Fetcher, LentSink, Registrar, StepOptions, Subscriber, VersionSource,
};
use weightcast::tensors::ExternalBuffer;

mod publisher;
mod tools;

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
pub(crate) struct Lent {
    ptr: usize,
    len: usize,
    writable: bool,
}

impl Lent {
    pub(crate) fn new(name: &str, ptr: usize, len: usize, writable: bool) -> Result<Lent> {
        if len > 0 && (ptr == 0 || ptr.checked_add(len).is_none() || len > isize::MAX as usize) {
            return Err(Error::BadRequest(format!(
                "tensor `{name}`: invalid memory range ({len} bytes at {ptr:#x})"
            )));
        }
        Ok(Lent { ptr, len, writable })
    }

    pub(crate) fn slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: see the type's documentation: the range is one live
        // tensor's memory for the duration of the call, checked non-null and
        // not wrapping; bytes have no alignment or validity requirement.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    /// The range as integers of type `T` (`u32` or `u64`: changed
    /// positions), refused unless aligned and a whole number of them.
    fn ints<T: PlainInt>(&self, name: &str) -> Result<&[T]> {
        let bytes = self.slice();
        // SAFETY: `T` is `u32` or `u64` (the sealed `PlainInt`), for which
        // every bit pattern is a valid value, so reinterpreting initialized
        // bytes is sound; `align_to` itself puts only correctly aligned,
        // whole values in the middle part, and the prefix and suffix are
        // required to be empty below, so the result covers exactly the lent
        // range. The range's lifetime is `slice`'s.
        let (pre, mid, post) = unsafe { bytes.align_to::<T>() };
        if !pre.is_empty() || !post.is_empty() {
            return Err(Error::BadRequest(format!(
                "tensor `{name}`: changed positions must be {}-byte aligned whole integers \
                 ({} bytes at {:#x})",
                std::mem::size_of::<T>(),
                self.len,
                self.ptr
            )));
        }
        Ok(mid)
    }

    pub(crate) fn slice_mut(&mut self) -> &mut [u8] {
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

/// Integers whose every bit pattern is a value (what [`Lent::ints`] may
/// reinterpret bytes as).
trait PlainInt: Copy + sealed::Sealed {}
impl PlainInt for u32 {}
impl PlainInt for u64 {}
mod sealed {
    pub trait Sealed {}
    impl Sealed for u32 {}
    impl Sealed for u64 {}
}

pub(crate) fn dtype(name: &str, d: &str) -> Result<Dtype> {
    parse_dtype(d)
        .map_err(|_| Error::BadRequest(format!("tensor `{name}`: unknown safetensors dtype `{d}`")))
}

/// The library's lent tensors over the memory Python describes.
fn lend(specs: Vec<Spec>, writable: bool) -> Result<Vec<LentTensor>> {
    specs
        .into_iter()
        .map(|(name, d, shape, ptr, len)| {
            let dtype = dtype(&name, &d)?;
            let buf = Box::new(Lent::new(&name, ptr, len, writable)?);
            Ok(LentTensor {
                name,
                dtype,
                shape,
                buf,
            })
        })
        .collect()
}

fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

// ---------------------------------------------------------------------------
// Subscriber: the library's loop over a `LentSink` (the caller's tensors)

struct SubState {
    sub: Subscriber<LentSink>,
    registrar: Registrar,
    /// The notify endpoint's state when the subscriber listens.
    shared: Option<Arc<Shared>>,
    /// Counts polls: an update is valid while it is the last one staged.
    generation: u64,
    /// Dropping it stops the notify endpoint.
    _endpoint: Option<weightcast::http::subscriber::Endpoint>,
}

/// The library's subscriber loop over the caller's tensors;
/// [`NativeUpdate`]s commit what its polls staged.
#[pyclass(module = "weightcast._native")]
struct NativeSubscriber {
    state: Arc<Mutex<SubState>>,
}

fn lock<T>(state: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>> {
    state
        .lock()
        .map_err(|_| Error::BadRequest("a previous call on this subscriber panicked".into()))
}

fn seconds(what: &str, s: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(s.max(0.0))
        .map_err(|_| Error::Config(format!("{what} {s}: not a duration in seconds")))
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
        py.detach(|| -> Result<NativeSubscriber> {
            let store = store(&store_url, &store_options)?;
            if let Some(id) = &id
                && !weightcast::protocol::registry::valid_id(id)
            {
                return Err(Error::Config(format!(
                    "id `{id}` must be [A-Za-z0-9._-]{{1,128}}"
                )));
            }
            let endpoint = match listen {
                Some(l) => {
                    let key = notify_key.as_deref().map(weightcast::notify::Key::new);
                    Some(block_on(weightcast::http::subscriber::spawn(
                        store.url(),
                        &l,
                        key.transpose()?,
                    ))??)
                }
                None if id.is_some() || advertise.is_some() => {
                    return Err(Error::Config(
                        "id and advertise register a notify endpoint: they need listen".into(),
                    ));
                }
                None => None,
            };
            let url = match (&endpoint, advertise) {
                (None, _) => None,
                (Some(_), Some(a)) => Some(a),
                (Some(e), None) if id.is_some() => {
                    Some(weightcast::notify::default_notify_url(e.bound)?)
                }
                (Some(e), None) => Some(format!("http://{}/v1/notify", e.bound)),
            };
            let interval = seconds("poll_interval", poll_interval)?;
            let sub = Subscriber::new(
                Fetcher::new(store),
                VersionSource::new(interval, 0.1),
                LentSink::new(version),
            );
            Ok(NativeSubscriber {
                state: Arc::new(Mutex::new(SubState {
                    sub,
                    registrar: Registrar::new(id, url),
                    shared: endpoint.as_ref().map(|e| e.shared.clone()),
                    generation: 0,
                    _endpoint: endpoint,
                })),
            })
        })
        .py()
    }

    /// The notify URL this subscriber registers (`None` when it does not listen).
    #[getter]
    fn notify_url(&self, py: Python<'_>) -> PyResult<Option<String>> {
        py.detach(|| lock(&self.state).map(|s| s.registrar.notify_url().map(String::from)))
            .py()
    }

    /// Notifications accepted so far (0 when not listening).
    #[getter]
    fn notifications(&self, py: Python<'_>) -> PyResult<u64> {
        let shared = py
            .detach(|| lock(&self.state).map(|s| s.shared.clone()))
            .py()?;
        Ok(shared.map_or(0, |sh| sh.status.lock().map_or(0, |s| s.notifications)))
    }

    /// Waits up to `seconds` for a notification (GIL released); true when
    /// one arrived (one that arrived since the last wait counts at once).
    fn wait_notified(&self, py: Python<'_>, seconds: f64) -> PyResult<bool> {
        let d = self::seconds("wait", seconds).py()?;
        let shared = py
            .detach(|| lock(&self.state).map(|s| s.shared.clone()))
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

    /// The version the caller's tensors hold (advanced by a successful commit).
    #[getter]
    fn version(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        use weightcast::subscriber::Sink;
        py.detach(|| lock(&self.state).map(|s| s.sub.sink.held()))
            .py()
    }

    /// The newest version seen in the bucket.
    #[getter]
    fn newest(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        py.detach(|| lock(&self.state).map(|s| s.sub.newest())).py()
    }

    /// The next wait of the poll loop, seconds (the interval with jitter).
    fn next_wait(&self, py: Python<'_>) -> PyResult<f64> {
        py.detach(|| lock(&self.state).map(|mut s| s.sub.source.next_wait().as_secs_f64()))
            .py()
    }

    /// Store requests made so far.
    #[getter]
    fn requests(&self, py: Python<'_>) -> PyResult<u64> {
        py.detach(|| lock(&self.state).map(|s| s.sub.fetcher.requests()))
            .py()
    }

    /// The next update, staged (downloaded and checked against its
    /// manifest; an anchor also decoded and verified): the library's
    /// `next_update` + `stage`. `None` when nothing is new.
    #[pyo3(signature = (thorough=false, anchor=false))]
    fn poll(&self, py: Python<'_>, thorough: bool, anchor: bool) -> PyResult<Option<NativeUpdate>> {
        let state = self.state.clone();
        py.detach(move || -> Result<Option<NativeUpdate>> {
            use weightcast::subscriber::Sink;
            let mut guard = lock(&state)?;
            let st = &mut *guard;
            let held = st.sub.sink.held();
            let q: Vec<u64> = st.sub.quarantined().iter().map(|q| q.version).collect();
            let staged = block_on(async {
                st.registrar.refresh(&st.sub.fetcher, held, &q).await;
                st.sub.next_staged(&StepOptions { thorough, anchor }).await
            })?;
            report_status(st);
            let Some(u) = staged? else { return Ok(None) };
            st.generation += 1;
            Ok(Some(NativeUpdate {
                state: state.clone(),
                generation: st.generation,
                version: u.version,
                kind: u.kind,
                base: u.base,
                nbytes: u.nbytes,
                tensors: (u.writes.into_iter())
                    .map(|(n, d, s)| (n, d.to_string(), s))
                    .collect(),
                files: u.files,
                device: Mutex::new(None),
            }))
        })
        .py()
    }

    /// Records the version each rank of a tensor-parallel engine holds in
    /// the endpoint's status and metrics (different versions are an error
    /// there); nothing when not listening.
    fn report_ranks(&self, py: Python<'_>, versions: Vec<Option<u64>>) -> PyResult<()> {
        py.detach(|| {
            let st = lock(&self.state)?;
            if let Some(sh) = &st.shared
                && let Ok(mut s) = sh.status.lock()
            {
                s.record_ranks(versions);
            }
            Ok(())
        })
        .py()
    }

    /// Checks every tensor given against the digest recorded for the held
    /// version (a full pass over each); returns `{"version", "checked",
    /// "unknown", "not_given"}` as JSON, or raises `Corrupt` naming the first
    /// tensor that differs.
    fn verify(&self, py: Python<'_>, tensors: Vec<Spec>) -> PyResult<String> {
        py.detach(|| -> Result<String> {
            let lent = lend(tensors, false)?;
            Ok(json(&lock(&self.state)?.sub.verify(&lent)?))
        })
        .py()
    }
}

/// Records the held version in the notify endpoint's status, when listening.
fn report_status(st: &SubState) {
    if let Some(sh) = &st.shared {
        st.sub.report_to(sh);
    }
}

/// One staged update: a delta version after the held one, or an anchor.
#[pyclass(module = "weightcast._native")]
struct NativeUpdate {
    state: Arc<Mutex<SubState>>,
    generation: u64,
    #[pyo3(get)]
    version: u64,
    #[pyo3(get)]
    kind: &'static str,
    #[pyo3(get, name = "base_version")]
    base: Option<u64>,
    /// Bytes downloaded for a delta; the decoded tensors' size for an anchor.
    #[pyo3(get)]
    nbytes: u64,
    /// (name, dtype, shape) of every tensor the update writes.
    tensors: Vec<(String, String, Vec<usize>)>,
    files: Vec<(String, Bytes)>,
    /// A delta's changes decoded by `device_changes`.
    device: Mutex<Option<Vec<weightcast::codec::Changes>>>,
}

impl NativeUpdate {
    /// The subscriber's state, with this update still the one staged.
    fn staged(&self) -> Result<std::sync::MutexGuard<'_, SubState>> {
        let st = lock(&self.state)?;
        if st.generation != self.generation || st.sub.staged() != Some(self.version) {
            return Err(Error::BadRequest(format!(
                "version {} is not staged any more (it was committed, or a later poll replaced \
                 it; prepare it again after a refused commit): poll again",
                self.version
            )));
        }
        Ok(st)
    }

    fn report(st: &SubState) -> String {
        report_status(st);
        let r = st.sub.sink.last_report();
        serde_json::to_string(&r).unwrap_or_default()
    }
}

#[pymethods]
impl NativeUpdate {
    fn tensors(&self) -> Vec<(String, String, Vec<usize>)> {
        self.tensors.clone()
    }

    /// The non-tensor files: every one for an anchor, the changed ones for a delta.
    fn files<'py>(&self, py: Python<'py>) -> Vec<(String, Bound<'py, PyBytes>)> {
        self.files
            .iter()
            .map(|(n, b)| (n.clone(), PyBytes::new(py, b)))
            .collect()
    }

    /// A copy of an anchor tensor's bytes.
    fn tensor_bytes<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyByteArray>> {
        let bytes = py
            .detach(|| Ok(self.staged()?.sub.sink.staged_tensor(name)?.to_vec()))
            .py()?;
        Ok(PyByteArray::new(py, &bytes))
    }

    /// Where the staged anchor's tensor `name` is: (address, bytes). Valid
    /// while this update is staged (until it is committed or replaced); the
    /// package reads it in place to copy it onto device tensors.
    fn tensor_address(&self, py: Python<'_>, name: &str) -> PyResult<(usize, usize)> {
        py.detach(|| {
            let st = self.staged()?;
            let b = st.sub.sink.staged_tensor(name)?;
            Ok((b.as_ptr() as usize, b.len()))
        })
        .py()
    }

    /// Commits the update into CPU tensors in place (GIL released): a delta
    /// verified then written (nothing is written unless every changed
    /// element holds its base value), an anchor copied (every tensor present
    /// with its dtype and shape, checked first). Returns a JSON report.
    #[pyo3(signature = (tensors, single_pass=false))]
    fn apply_buffers(
        &self,
        py: Python<'_>,
        tensors: Vec<Spec>,
        single_pass: bool,
    ) -> PyResult<String> {
        py.detach(|| -> Result<String> {
            let lent = lend(tensors, true)?;
            let mut st = self.staged()?;
            st.sub.commit_into(lent, single_pass).1?;
            Ok(Self::report(&st))
        })
        .py()
    }

    /// The first half of a delta's commit: verifies and decodes, writing
    /// nothing. False for what cannot be held decoded (an anchor, a TRL
    /// delta): `commit_prepared` then applies it whole.
    fn prepare_buffers(&self, py: Python<'_>, tensors: Vec<Spec>) -> PyResult<bool> {
        py.detach(|| -> Result<bool> {
            let mut lent = lend(tensors, true)?;
            self.staged()?.sub.prepare(&mut lent)
        })
        .py()
    }

    /// The second half: writes what `prepare_buffers` decoded into the same
    /// tensors (checked), one scatter of the changed words.
    fn commit_prepared(&self, py: Python<'_>, tensors: Vec<Spec>) -> PyResult<String> {
        py.detach(|| -> Result<String> {
            let lent = lend(tensors, true)?;
            let mut st = self.staged()?;
            st.sub.commit_into(lent, false).1?;
            Ok(Self::report(&st))
        })
        .py()
    }

    /// The device path, verification half: `gather(name, positions,
    /// position_width, word_width)` returns the old words wherever the
    /// tensor lives; the library checks them against the delta's base and
    /// returns, only when every tensor passed, `[(name, positions,
    /// position_width, new_words, word_width)]` to scatter.
    fn resolve_all<'py>(
        &self,
        py: Python<'py>,
        gather: Bound<'py, PyAny>,
    ) -> PyResult<Vec<PyResolved<'py>>> {
        let gather = gather.unbind();
        let resolved = py
            .detach(|| -> Result<Vec<Resolved>> {
                let mut st = self.staged()?;
                let mut call = |name: &str, p: &Positions, wb: usize| -> Result<Vec<u8>> {
                    let (bytes, pw) = positions_bytes(p);
                    Python::attach(|py| {
                        let old = gather.call1(py, (name, PyBytes::new(py, &bytes), pw, wb))?;
                        old.extract::<Vec<u8>>(py)
                    })
                    .map_err(|e| Error::BadRequest(format!("gathering `{name}`: {e}")))
                };
                st.sub.resolve(&mut call)
            })
            .py()?;
        Ok(resolved
            .into_iter()
            .map(|r| {
                let (pos, pw) = positions_bytes(&r.positions);
                (
                    r.name,
                    PyBytes::new(py, &pos),
                    pw,
                    PyBytes::new(py, &r.new_words),
                    r.word_bytes,
                )
            })
            .collect())
    }

    /// The device path in batches, first half: decodes every changed
    /// tensor's changes (in parallel) and keeps them for `device_positions`
    /// and `device_resolve`. Returns `([(name, changes, position_width,
    /// word_width, position_offset, word_offset)], position_bytes,
    /// word_bytes)`: each tensor's positions and words lie at its offsets
    /// (multiples of 8) in buffers of those sizes.
    fn device_changes(&self, py: Python<'_>) -> PyResult<DevicePlan> {
        py.detach(|| -> Result<DevicePlan> {
            let changes = self.staged()?.sub.changes()?;
            let (mut plan, mut at_pos, mut at_word) = (Vec::new(), 0usize, 0usize);
            for c in &changes {
                let pw = position_width(&c.positions);
                plan.push((c.name.clone(), c.len(), pw, c.word_bytes(), at_pos, at_word));
                at_pos += (c.len() * pw).next_multiple_of(8);
                at_word += c.new_bytes().next_multiple_of(8);
            }
            *lock(&self.device)? = Some(changes);
            Ok((plan, at_pos, at_word))
        })
        .py()
    }

    /// Writes every tensor's positions (little-endian) at its offset into
    /// the `nbytes` at `address` (`position_bytes` of `device_changes`).
    fn device_positions(&self, py: Python<'_>, address: usize, nbytes: usize) -> PyResult<()> {
        py.detach(|| -> Result<()> {
            let held = lock(&self.device)?;
            let changes = held.as_ref().ok_or_else(no_device_changes)?;
            let mut out = Lent::new("positions", address, nbytes, true)?;
            let mut rest = out.slice_mut();
            let mut pieces = Vec::with_capacity(changes.len());
            for c in changes {
                let len = c.len() * position_width(&c.positions);
                let pad = len.next_multiple_of(8);
                if rest.len() < pad {
                    return Err(Error::BadRequest(format!(
                        "the positions buffer holds {nbytes} bytes; device_changes asked for more"
                    )));
                }
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(pad);
                pieces.push((&c.positions, &mut head[..len]));
                rest = tail;
            }
            pieces.into_par_iter().for_each(|(p, out)| match p {
                Positions::U32(v) => le_into(v, out, |i| i.to_le_bytes()),
                Positions::U64(v) => le_into(v, out, |i| i.to_le_bytes()),
            });
            Ok(())
        })
        .py()
    }

    /// The device path in batches, second half: `old` (address, bytes) holds
    /// every tensor's old words at its word offset; checks them all against
    /// the delta's base and, only when every tensor passed, leaves the new
    /// words at the same offsets in `new` (which must not overlap `old`).
    /// Uses up what `device_changes` decoded.
    fn device_resolve(
        &self,
        py: Python<'_>,
        old: (usize, usize),
        new: (usize, usize),
    ) -> PyResult<()> {
        py.detach(|| -> Result<()> {
            if old.1 > 0 && new.1 > 0 && old.0 < new.0 + new.1 && new.0 < old.0 + old.1 {
                return Err(Error::BadRequest(
                    "the old and new word buffers overlap: give two buffers".into(),
                ));
            }
            let mut st = self.staged()?;
            let mut held = lock(&self.device)?;
            let changes = held.as_ref().ok_or_else(no_device_changes)?;
            let old_buf = Lent::new("old words", old.0, old.1, false)?;
            let mut new_buf = Lent::new("new words", new.0, new.1, true)?;
            let (mut o, mut w) = (old_buf.slice(), new_buf.slice_mut());
            let (mut olds, mut news) = (Vec::new(), Vec::new());
            for c in changes {
                let (len, pad) = (c.new_bytes(), c.new_bytes().next_multiple_of(8));
                if o.len() < pad || w.len() < pad {
                    return Err(Error::BadRequest(format!(
                        "the word buffers hold {} and {} bytes; device_changes asked for more",
                        old.1, new.1
                    )));
                }
                let (oh, ot) = o.split_at(pad);
                let (wh, wt) = std::mem::take(&mut w).split_at_mut(pad);
                olds.push(&oh[..len]);
                news.push(&mut wh[..len]);
                (o, w) = (ot, wt);
            }
            let r = st.sub.resolve_changes(changes, &olds, &mut news);
            // Used up: the new words are all the commit needs (the decoded
            // changes are freed here, not in the pause).
            *held = None;
            r
        })
        .py()
    }

    /// The device path, after the caller wrote the tensors itself (a
    /// delta's `resolve_all` scattered, an anchor's tensors copied): records
    /// the version. `memory`: (name, address, bytes) of the tensors written.
    #[pyo3(signature = (memory=None))]
    fn commit_resolved(
        &self,
        py: Python<'_>,
        memory: Option<Vec<(String, usize, usize)>>,
    ) -> PyResult<()> {
        py.detach(|| -> Result<()> {
            let mut st = self.staged()?;
            let memory = memory
                .unwrap_or_default()
                .into_iter()
                .map(|(n, at, len)| (n, (at, len)))
                .collect::<BTreeMap<_, _>>();
            st.sub.commit_written(memory)?;
            report_status(&st);
            Ok(())
        })
        .py()
    }

    /// Materializes the version in an output directory exactly as
    /// `weightcast subscribe --out DIR` does, through the library's
    /// directory sink. Returns the catch-up report as JSON.
    #[pyo3(signature = (dir, slots=2))]
    fn save_to(&self, py: Python<'_>, dir: String, slots: usize) -> PyResult<String> {
        py.detach(|| {
            let st = lock(&self.state)?;
            let c = block_on(
                st.sub
                    .save_to(std::path::Path::new(&dir), slots, self.version),
            )??;
            Ok(json(&c))
        })
        .py()
    }
}

/// One tensor resolved for the device path: (name, positions, position
/// width, new words, word width).
type PyResolved<'py> = (
    String,
    Bound<'py, PyBytes>,
    usize,
    Bound<'py, PyBytes>,
    usize,
);

/// What `device_changes` returns.
type DevicePlan = (
    Vec<(String, usize, usize, usize, usize, usize)>,
    usize,
    usize,
);

fn position_width(p: &Positions) -> usize {
    match p {
        Positions::U32(_) => 4,
        Positions::U64(_) => 8,
    }
}

/// `v` as little-endian bytes into `out` (exactly `N` bytes per value).
fn le_into<T: Copy, const N: usize>(v: &[T], out: &mut [u8], le: impl Fn(T) -> [u8; N]) {
    for (o, &x) in out.chunks_exact_mut(N).zip(v) {
        o.copy_from_slice(&le(x));
    }
}

fn no_device_changes() -> Error {
    Error::BadRequest("call device_changes first".into())
}

fn positions_bytes(p: &Positions) -> (Vec<u8>, usize) {
    let pw = position_width(p);
    let mut out = vec![0u8; p.len() * pw];
    match p {
        Positions::U32(v) => le_into(v, &mut out, |i| i.to_le_bytes()),
        Positions::U64(v) => le_into(v, &mut out, |i| i.to_le_bytes()),
    }
    (out, pw)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let _ = pyo3_log::try_init();
    m.add_class::<publisher::NativePublisher>()?;
    m.add_class::<NativeSubscriber>()?;
    m.add_class::<NativeUpdate>()?;
    m.add_function(wrap_pyfunction!(tools::run_hooks, m)?)?;
    m.add_function(wrap_pyfunction!(tools::tensor_digest, m)?)?;
    m.add_function(wrap_pyfunction!(tools::file_blake3, m)?)?;
    m.add_function(wrap_pyfunction!(tools::file_blake3_stripes, m)?)?;
    m.add_function(wrap_pyfunction!(tools::gather_words, m)?)?;
    m.add_function(wrap_pyfunction!(tools::scatter_words, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
