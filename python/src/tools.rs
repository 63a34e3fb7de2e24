//! Free functions of the package: engine hooks, tensor digests and file
//! checksums, the library's, over Python's arguments.

use pyo3::prelude::*;

use weightcast::digest::tensor_digest_of;
use weightcast::error::Error;

use crate::{OrPy, Result, Spec, block_on, json, lend};

/// Runs engine hooks (`sglang:URL`, `vllm:URL`, `webhook:URL`,
/// `command:CMD`) for a version in `dir`, as `weightcast subscribe` does
/// after a switch, under the library's hook policy (`timeout` per request and
/// `budget` per hook, seconds; `sglang_pause` and `vllm_pause` the modes
/// sent to the engines; API keys from `WEIGHTCAST_VLLM_API_KEY` and
/// `WEIGHTCAST_SGLANG_API_KEY`); returns the library's report
/// (`pause_seconds`, `failed`, `failures`) as JSON.
#[pyfunction]
#[pyo3(signature = (hooks, version, dir, changed_tensors, timeout=None, budget=None, sglang_pause=None, vllm_pause=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_hooks(
    py: Python<'_>,
    hooks: Vec<String>,
    version: u64,
    dir: String,
    changed_tensors: Vec<String>,
    timeout: Option<f64>,
    budget: Option<f64>,
    sglang_pause: Option<String>,
    vllm_pause: Option<String>,
) -> PyResult<String> {
    py.detach(|| -> Result<String> {
        let hooks = hooks
            .iter()
            .map(|h| h.parse())
            .collect::<Result<Vec<weightcast::hooks::Hook>>>()?;
        let policy = weightcast::hooks::HookPolicy::with(
            timeout,
            budget,
            sglang_pause.as_deref(),
            vllm_pause.as_deref(),
        )?;
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
pub(crate) fn tensor_digest(py: Python<'_>, tensor: Spec) -> PyResult<String> {
    py.detach(|| -> Result<String> {
        let lent = lend(vec![tensor], false)?;
        let l = &lent[0];
        Ok(tensor_digest_of(&l.name, l.dtype, &l.shape, l.buf.bytes())?.to_string())
    })
    .py()
}

/// The BLAKE3 of a file's bytes (hex), read through a memory map and hashed
/// on every core: the checksum of the node's hand-off to its ranks.
#[pyfunction]
pub(crate) fn file_blake3(py: Python<'_>, path: String) -> PyResult<String> {
    py.detach(|| -> Result<String> {
        let mut h = blake3::Hasher::new();
        h.update_mmap_rayon(&path)
            .map_err(|e| Error::BadRequest(format!("reading {path}: {e}")))?;
        Ok(h.finalize().to_hex().to_string())
    })
    .py()
}
