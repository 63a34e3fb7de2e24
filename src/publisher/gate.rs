//! The commit gate: how a publish in flight is stopped without leaving
//! anything half-written. A publish may be abandoned up to the moment its
//! commit begins (the manifest's create, or TRL's object write): what it
//! uploaded before that is never referenced (garbage for retention) and its
//! state directory is left as it was. From that moment it must run to its
//! end, so that its caller learns whether the version was committed.

use std::sync::atomic::{AtomicU8, Ordering};

use crate::error::{Error, Result};

const OPEN: u8 = 0;
const COMMITTING: u8 = 1;
const STOPPED: u8 = 2;

/// Shared between a [`Publisher`](super::Publisher) and whoever may need to
/// stop it (the daemon's graceful shutdown).
#[derive(Debug, Default)]
pub struct CommitGate(AtomicU8);

impl CommitGate {
    /// Stops every commit that has not begun: returns `true` when none has
    /// (the publish in flight, if any, may be dropped: it commits nothing),
    /// `false` when one is under way (it must be waited for). Once stopped,
    /// a publish fails with [`Error::Unavailable`] before its commit.
    pub fn stop(&self) -> bool {
        match self
            .0
            .compare_exchange(OPEN, STOPPED, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => true,
            Err(state) => state == STOPPED,
        }
    }

    /// Whether [`CommitGate::stop`] was called.
    pub fn is_stopped(&self) -> bool {
        self.0.load(Ordering::Acquire) == STOPPED
    }

    /// A publish starts: the previous one's commit is over.
    pub(crate) fn begin_publish(&self) -> Result<()> {
        match self
            .0
            .compare_exchange(COMMITTING, OPEN, Ordering::AcqRel, Ordering::Acquire)
        {
            Err(STOPPED) => Err(stopped()),
            _ => Ok(()),
        }
    }

    /// The point of no return: from here the publish runs to its end.
    pub(crate) fn begin_commit(&self) -> Result<()> {
        match self
            .0
            .compare_exchange(OPEN, COMMITTING, Ordering::AcqRel, Ordering::Acquire)
        {
            Err(STOPPED) => Err(stopped()),
            _ => Ok(()),
        }
    }
}

fn stopped() -> Error {
    Error::Unavailable(
        "the publisher is shutting down: this version was not committed (nothing of it is \
         visible; publish it again once the publisher is back)"
            .into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_commit_begun_is_waited_for_and_none_begins_after_a_stop() {
        let g = CommitGate::default();
        g.begin_publish().unwrap();
        g.begin_commit().unwrap();
        assert!(!g.stop(), "a commit under way cannot be abandoned");
        assert!(!g.is_stopped());
        g.begin_publish().unwrap();
        assert!(g.stop(), "between commits: stopped");
        assert!(g.stop(), "idempotent");
        let e = g.begin_commit().unwrap_err();
        assert_eq!(e.kind(), crate::error::ErrorKind::Unavailable);
        assert!(e.to_string().contains("not committed"), "{e}");
        assert!(g.begin_publish().is_err());
    }
}
