//! Free functions of the package: engine hooks, tensor digests and file
//! checksums, the library's, over Python's arguments.

use pyo3::prelude::*;

use weightcast::digest::tensor_digest_of;
use weightcast::error::Error;

use crate::{Lent, OrPy, Result, Spec, block_on, json, lend};

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

/// The BLAKE3 (hex) of each listed stripe of a file: stripe `i` is the
/// bytes `[i * stripe, min((i + 1) * stripe, size))`. Stripes are read and
/// hashed in parallel. The ranks of a node split its hand-off's check this
/// way, each hashing its own stripes, and they vote before anyone commits.
#[pyfunction]
pub(crate) fn file_blake3_stripes(
    py: Python<'_>,
    path: String,
    stripe: usize,
    indices: Vec<usize>,
) -> PyResult<Vec<String>> {
    py.detach(|| -> Result<Vec<String>> { stripe_digests(&path, stripe, &indices) })
        .py()
}

fn stripe_digests(path: &str, stripe: usize, indices: &[usize]) -> Result<Vec<String>> {
    use rayon::prelude::*;
    use std::os::unix::fs::FileExt;

    let io = |e: std::io::Error| Error::BadRequest(format!("reading {path}: {e}"));
    if stripe == 0 {
        return Err(Error::BadRequest(format!("{path}: a stripe of 0 bytes")));
    }
    let file = std::fs::File::open(path).map_err(io)?;
    let size = usize::try_from(file.metadata().map_err(io)?.len())
        .map_err(|_| Error::BadRequest(format!("{path}: larger than this machine addresses")))?;
    let stripes = size.div_ceil(stripe);
    indices
        .par_iter()
        .map(|&i| {
            if i >= stripes {
                return Err(Error::BadRequest(format!(
                    "{path}: stripe {i} of {stripe} bytes is past its end ({size} bytes, {stripes} stripes)"
                )));
            }
            let start = i * stripe;
            let mut buf = vec![0u8; stripe.min(size - start)];
            file.read_exact_at(&mut buf, start as u64).map_err(io)?;
            Ok(blake3::hash(&buf).to_hex().to_string())
        })
        .collect()
}

/// One tensor of [`gather_words`]: `(name, source address, source bytes,
/// positions address, changes, position width, word width, out address)`.
pub(crate) type GatherItem = (String, usize, usize, usize, usize, usize, usize, usize);

/// Gathers words at changed positions from host memory, in parallel: for
/// each item, the source's words at the positions (little-endian integers
/// of the position width, 4 or 8 bytes) go, in order, to `out` (changes ×
/// word width bytes). The node's patch takes its old words from the node's
/// host copy this way. A position past its source is refused, naming the
/// tensor; an output overlapping any other range given is refused.
///
/// The ranges are lent as [`Lent`] documents: the caller's arrays stay
/// alive and unchanged by anyone else for the call.
#[pyfunction]
pub(crate) fn gather_words(py: Python<'_>, items: Vec<GatherItem>) -> PyResult<()> {
    py.detach(|| -> Result<()> { gather_all(&items) }).py()
}

/// Words gathered per parallel task.
const GATHER_CHUNK: usize = 1 << 15;

fn gather_all(items: &[GatherItem]) -> Result<()> {
    use rayon::prelude::*;

    let bad =
        |name: &str, what: String| Error::BadRequest(format!("gather_words: `{name}`: {what}"));
    // (start, end, name, written) of every range
    let mut ranges: Vec<(usize, usize, &str, bool)> = Vec::new();
    for (name, src, src_len, pos, n, pw, wb, out) in items {
        if !matches!(pw, 4 | 8) || !matches!(wb, 1 | 2 | 4 | 8) {
            return Err(bad(
                name,
                format!("position width {pw} and word width {wb} (4 or 8; 1, 2, 4 or 8)"),
            ));
        }
        let (Some(pos_len), Some(out_len)) = (n.checked_mul(*pw), n.checked_mul(*wb)) else {
            return Err(bad(name, format!("{n} changes overflow the address space")));
        };
        for (at, len, written) in [
            (*src, *src_len, false),
            (*pos, pos_len, false),
            (*out, out_len, true),
        ] {
            let end = at
                .checked_add(len)
                .ok_or_else(|| bad(name, format!("a range wraps ({len} bytes at {at:#x})")))?;
            if len > 0 {
                ranges.push((at, end, name.as_str(), written));
            }
        }
    }
    for (i, w) in ranges.iter().enumerate().filter(|(_, r)| r.3) {
        if let Some((_, o)) = ranges
            .iter()
            .enumerate()
            .find(|(j, o)| *j != i && o.0 < w.1 && w.0 < o.1)
        {
            return Err(bad(
                w.2,
                format!(
                    "its output overlaps a range of `{}`: give separate buffers",
                    o.2
                ),
            ));
        }
    }
    for (name, src, src_len, pos, n, pw, wb, out) in items {
        let (pw, wb) = (*pw, *wb);
        let source = Lent::new(name, *src, *src_len, false)?;
        let positions = Lent::new(name, *pos, n * pw, false)?;
        let mut target = Lent::new(name, *out, n * wb, true)?;
        let (s, p) = (source.slice(), positions.slice());
        let words = src_len / wb;
        target
            .slice_mut()
            .par_chunks_mut(GATHER_CHUNK * wb)
            .zip(p.par_chunks(GATHER_CHUNK * pw))
            .try_for_each(|(out, pos)| -> Result<()> {
                for (o, at) in out.chunks_exact_mut(wb).zip(pos.chunks_exact(pw)) {
                    let at = match *at {
                        [a, b, c, d] => u64::from(u32::from_le_bytes([a, b, c, d])),
                        [a, b, c, d, e, f, g, h] => u64::from_le_bytes([a, b, c, d, e, f, g, h]),
                        _ => u64::MAX,
                    };
                    let k = usize::try_from(at)
                        .ok()
                        .filter(|&k| k < words)
                        .ok_or_else(|| {
                            bad(
                                name,
                                format!("changed position {at} is past its {words} words"),
                            )
                        })?;
                    o.copy_from_slice(&s[k * wb..(k + 1) * wb]);
                }
                Ok(())
            })?;
    }
    Ok(())
}
