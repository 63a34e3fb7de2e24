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

/// One tensor of [`gather_words`] and [`scatter_words`]: `(name, tensor
/// address, tensor bytes, positions address, changes, position width, word
/// width, words address)`.
pub(crate) type WordsItem = (String, usize, usize, usize, usize, usize, usize, usize);

/// Gathers words at changed positions from host memory, in parallel: for
/// each item, the tensor's words at the positions (little-endian integers
/// of the position width, 4 or 8 bytes) go, in order, to the words address
/// (changes × word width bytes). The node's patch takes its old words from
/// the node's host copy this way. A position past its tensor is refused,
/// naming it; an output overlapping any other range given is refused.
///
/// The ranges are lent as [`Lent`] documents: the caller's arrays stay
/// alive and unchanged by anyone else for the call.
#[pyfunction]
pub(crate) fn gather_words(py: Python<'_>, items: Vec<WordsItem>) -> PyResult<()> {
    py.detach(|| -> Result<()> { gather_all(&items) }).py()
}

/// The converse of [`gather_words`]: the words at the words address go to
/// the tensor at the positions, in parallel. The positions of each item
/// must ascend (a delta's do); the node writes a committed patch into its
/// host copy this way. A position past its tensor, or out of order, is an
/// error naming the tensor; the words of other positions may have been
/// written by then.
#[pyfunction]
pub(crate) fn scatter_words(py: Python<'_>, items: Vec<WordsItem>) -> PyResult<()> {
    py.detach(|| -> Result<()> { scatter_all(&items) }).py()
}

/// Words gathered or scattered per parallel task.
const WORDS_CHUNK: usize = 1 << 15;
/// How many positions ahead `gather_words` prefetches (as the apply does:
/// `weightcast::platform::prefetch_l2`).
const GATHER_AHEAD: usize = 256;

fn bad(what: &str, name: &str, why: String) -> Error {
    Error::BadRequest(format!("{what}: `{name}`: {why}"))
}

/// Checks the items' widths and ranges; the written ranges (the tensors
/// when `tensor_written`, else the words) overlap no other range given.
fn check_items(what: &str, items: &[WordsItem], tensor_written: bool) -> Result<()> {
    // (start, end, name, written) of every range
    let mut ranges: Vec<(usize, usize, &str, bool)> = Vec::new();
    for (name, tensor, tensor_len, pos, n, pw, wb, words) in items {
        if !matches!(pw, 4 | 8) || !matches!(wb, 1 | 2 | 4 | 8) {
            return Err(bad(
                what,
                name,
                format!("position width {pw} and word width {wb} (4 or 8; 1, 2, 4 or 8)"),
            ));
        }
        let (Some(pos_len), Some(words_len)) = (n.checked_mul(*pw), n.checked_mul(*wb)) else {
            return Err(bad(
                what,
                name,
                format!("{n} changes overflow the address space"),
            ));
        };
        for (at, len, written) in [
            (*tensor, *tensor_len, tensor_written),
            (*pos, pos_len, false),
            (*words, words_len, !tensor_written),
        ] {
            let end = at.checked_add(len).ok_or_else(|| {
                bad(
                    what,
                    name,
                    format!("a range wraps ({len} bytes at {at:#x})"),
                )
            })?;
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
                what,
                w.2,
                format!(
                    "its output overlaps a range of `{}`: give separate buffers",
                    o.2
                ),
            ));
        }
    }
    Ok(())
}

/// A little-endian position of 4 or 8 bytes (`u64::MAX` for anything else).
fn position(at: &[u8]) -> u64 {
    match *at {
        [a, b, c, d] => u64::from(u32::from_le_bytes([a, b, c, d])),
        [a, b, c, d, e, f, g, h] => u64::from_le_bytes([a, b, c, d, e, f, g, h]),
        _ => u64::MAX,
    }
}

fn gather_all(items: &[WordsItem]) -> Result<()> {
    use rayon::prelude::*;

    check_items("gather_words", items, false)?;
    for (name, src, src_len, pos, n, pw, wb, out) in items {
        let (pw, wb) = (*pw, *wb);
        let source = Lent::new(name, *src, *src_len, false)?;
        let positions = Lent::new(name, *pos, n * pw, false)?;
        let mut target = Lent::new(name, *out, n * wb, true)?;
        let (s, p) = (source.slice(), positions.slice());
        let words = src_len / wb;
        target
            .slice_mut()
            .par_chunks_mut(WORDS_CHUNK * wb)
            .zip(p.par_chunks(WORDS_CHUNK * pw))
            .try_for_each(|(out, pos)| -> Result<()> {
                // The source's words at the positions GATHER_AHEAD further on
                // are asked for in advance (into L2): sparse positions over a
                // large host copy otherwise miss the cache one by one.
                let ahead = pos
                    .chunks_exact(pw)
                    .skip(GATHER_AHEAD)
                    .map(Some)
                    .chain(std::iter::repeat(None));
                for ((o, at), next) in out
                    .chunks_exact_mut(wb)
                    .zip(pos.chunks_exact(pw))
                    .zip(ahead)
                {
                    if let Some(n) = next {
                        let n = usize::try_from(position(n)).unwrap_or(usize::MAX);
                        weightcast::platform::prefetch_l2(s, n.saturating_mul(wb));
                    }
                    let at = position(at);
                    let k = usize::try_from(at)
                        .ok()
                        .filter(|&k| k < words)
                        .ok_or_else(|| {
                            let why = format!("changed position {at} is past its {words} words");
                            bad("gather_words", name, why)
                        })?;
                    o.copy_from_slice(&s[k * wb..(k + 1) * wb]);
                }
                Ok(())
            })?;
    }
    Ok(())
}

fn scatter_all(items: &[WordsItem]) -> Result<()> {
    use rayon::prelude::*;

    check_items("scatter_words", items, true)?;
    for (name, dst, dst_len, pos, n, pw, wb, src) in items {
        let (pw, wb) = (*pw, *wb);
        let mut target = Lent::new(name, *dst, *dst_len, true)?;
        let positions = Lent::new(name, *pos, n * pw, false)?;
        let source = Lent::new(name, *src, n * wb, false)?;
        let (s, p) = (source.slice(), positions.slice());
        let words = dst_len / wb;
        let out_of_order = |at: u64| {
            let why = format!(
                "changed position {at} is out of order or past its {words} words (positions must ascend)"
            );
            bad("scatter_words", name, why)
        };
        // Each stretch of positions owns the tensor's words from its first
        // position to its last: ascending positions make those disjoint, so
        // the stretches write in parallel, each into its own slice.
        let mut jobs = Vec::new();
        let (mut rest, mut base) = (target.slice_mut(), 0usize);
        for (pos, new) in p.chunks(WORDS_CHUNK * pw).zip(s.chunks(WORDS_CHUNK * wb)) {
            let (first, last) = (position(&pos[..pw]), position(&pos[pos.len() - pw..]));
            let (f, l) = match (usize::try_from(first), usize::try_from(last)) {
                (Ok(f), Ok(l)) if f >= base && f <= l && l < words => (f, l),
                _ => return Err(out_of_order(if first < base as u64 { first } else { last })),
            };
            let (_, tail) = std::mem::take(&mut rest).split_at_mut((f - base) * wb);
            let (mine, tail) = tail.split_at_mut((l - f + 1) * wb);
            jobs.push((pos, new, mine, f, l));
            (rest, base) = (tail, l + 1);
        }
        jobs.into_par_iter()
            .try_for_each(|(pos, new, mine, f, l)| -> Result<()> {
                for (at, w) in pos.chunks_exact(pw).zip(new.chunks_exact(wb)) {
                    let at = position(at);
                    let k = usize::try_from(at)
                        .ok()
                        .filter(|&k| k >= f && k <= l)
                        .ok_or_else(|| out_of_order(at))?;
                    mine[(k - f) * wb..(k - f + 1) * wb].copy_from_slice(w);
                }
                Ok(())
            })?;
    }
    Ok(())
}
