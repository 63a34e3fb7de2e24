//! TRL payloads: positions given up front, absolute values, one loop for
//! every strategy.

use crate::codec::trl::Indices;
use crate::digest::{ChangeBatch, LANES, TensorSeed};
use crate::dtype::{load, store};
use crate::error::{Error, Result};
use crate::platform::prefetch_l2;

/// How far ahead the TRL loop prefetches each target's line into L2 (the
/// same distance as the `compact` pipeline's).
pub(super) const AHEAD: usize = 256;

/// A TRL payload of one tensor.
#[derive(Clone, Copy)]
pub(super) struct TrlRun<'r> {
    pub(super) name: &'r str,
    pub(super) indices: Indices<'r>,
    pub(super) values: &'r [u8],
    pub(super) seed: TensorSeed,
}

impl TrlRun<'_> {
    /// Calls `f(j, position)` for each position after checking it (strictly
    /// ascending, below `words`); stops at the first bad one.
    pub(super) fn positions(&self, words: usize, mut f: impl FnMut(usize, usize)) -> Result<()> {
        let (mut prev, mut j, mut err) = (-1i64, 0usize, None);
        self.indices.visit(|i| {
            if i <= prev {
                err = Some(Error::tensor(
                    self.name,
                    format!("index {j} ({i}) is not strictly ascending"),
                ));
            } else if i >= words as i64 {
                err = Some(Error::tensor(
                    self.name,
                    format!("index {i} is beyond {words} elements"),
                ));
            } else {
                prev = i;
                f(j, i as usize);
                j += 1;
            }
            err.is_none()
        });
        err.map_or(Ok(()), Err)
    }

    pub(super) fn check_len<const W: usize>(&self) -> Result<usize> {
        let n = self.indices.len();
        if self.values.len() != n * W {
            return Err(Error::tensor(
                self.name,
                format!(
                    "{n} indices but {} value bytes ({W} per value)",
                    self.values.len()
                ),
            ));
        }
        Ok(n)
    }

    /// One pass over the payload against `data`, each target's line
    /// prefetched [`AHEAD`] positions before its turn. `CHECK`: read the old
    /// words and sum the digest change (and log the old words into `undo`);
    /// `WRITE`: write the new words. Returns the changes and the digest
    /// change. On error, what was written is logged (with `undo`).
    pub(super) fn pass<const W: usize, const CHECK: bool, const WRITE: bool>(
        &self,
        data: &mut [u8],
        mut undo: Option<&mut Vec<u8>>,
    ) -> Result<(u64, u64)> {
        let n = self.check_len::<W>()?;
        let mut dig = 0u64;
        let mut batch = ChangeBatch::default();
        let mut fill = 0usize;
        let mut turn = |data: &mut [u8], j: usize, i: usize| {
            let new = load::<W>(self.values, j);
            if CHECK {
                let old = load::<W>(data, i);
                if let Some(u) = undo.as_deref_mut() {
                    u.extend_from_slice(&old.to_le_bytes()[..W]);
                }
                (batch.index[fill], batch.old[fill], batch.new[fill]) = (i as u64, old, new);
                fill += 1;
                if fill == LANES {
                    dig = dig.wrapping_add(self.seed.change_sum(&batch));
                    fill = 0;
                }
            }
            if WRITE {
                store::<W>(data, i, new);
            }
        };
        let mut ring = [0usize; AHEAD];
        let words = data.len() / W;
        let r = self.positions(words, |j, i| {
            prefetch_l2(data, i * W);
            if j >= AHEAD {
                turn(data, j - AHEAD, ring[j % AHEAD]);
            }
            ring[j % AHEAD] = i;
        });
        if r.is_ok() {
            for j in n.saturating_sub(AHEAD)..n {
                turn(data, j, ring[j % AHEAD]);
            }
        }
        if CHECK {
            batch.index[fill..].fill(0);
            batch.old[fill..].fill(0);
            batch.new[fill..].fill(0);
            dig = dig.wrapping_add(self.seed.change_sum(&batch));
        }
        r.map(|()| (n as u64, dig))
    }
}

/// Restores the old words a TRL pass logged.
pub(super) fn trl_undo<const W: usize>(indices: Indices<'_>, data: &mut [u8], undo: &[u8]) {
    let (m, mut j) = (undo.len() / W, 0usize);
    indices.visit(|i| {
        if j < m {
            store::<W>(data, i as usize, load::<W>(undo, j));
            j += 1;
        }
        j < m
    });
}
