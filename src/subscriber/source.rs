//! The version source: learns the newest committed version cheaply.
//!
//! A poll is one conditional GET of `latest.json` (`If-None-Match` with the
//! ETag seen last: no body when nothing changed). `latest.json` is only a
//! hint — a publisher that crashed between its commit and the hint leaves it
//! behind — so the certain answer comes from a listing of `versions/` that
//! starts after the held version ([`Fetcher::versions_after`]: one request
//! however long the history). The listing is made when the hint moved, on a
//! *thorough* check (the first one, after a notification, every
//! [`THOROUGH_EVERY`] polls, and whenever nothing is held), and never
//! otherwise. A thorough check that finds nothing after the held version also
//! reads the held version's manifest: a version that vanished (a reset
//! bucket) sends the subscriber back to the bucket's newest.
//!
//! Between polls the source waits the poll interval with ± jitter (so a fleet
//! started together does not poll in lockstep), or less when a notification
//! wakes it.

use std::time::Duration;

use tokio::sync::Notify;

use crate::error::Result;

use super::fetch::Fetcher;

/// Every this many polls, a poll lists `versions/` even when the hint did
/// not move (a hint left behind by a publisher crash is caught within this
/// many intervals).
pub const THOROUGH_EVERY: u64 = 12;

/// What a check found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// The bucket holds no version.
    Empty,
    /// Nothing newer than the held version (which is still committed).
    Same,
    /// The newest committed version (possibly older than the held one, when
    /// the held version vanished from the bucket).
    Newest(u64),
}

/// Polls the bucket for new versions.
#[derive(Clone, Debug)]
pub struct VersionSource {
    /// Interval between polls.
    pub interval: Duration,
    /// Jitter as a fraction of the interval: each wait is
    /// `interval × (1 ± jitter)`, uniformly (0 for none).
    pub jitter: f64,
    etag: Option<String>,
    polls: u64,
    rng: u64,
}

impl VersionSource {
    /// A source polling every `interval` with ± `jitter` (a fraction, clamped to [0, 1]).
    pub fn new(interval: Duration, jitter: f64) -> VersionSource {
        let seed = blake3::hash(
            format!("{:?}/{}", std::time::SystemTime::now(), std::process::id()).as_bytes(),
        );
        let mut rng = u64::from_le_bytes(seed.as_bytes()[..8].try_into().expect("8 bytes"));
        rng |= 1;
        VersionSource {
            interval,
            jitter: if jitter.is_finite() {
                jitter.clamp(0.0, 1.0)
            } else {
                0.0
            },
            etag: None,
            polls: 0,
            rng,
        }
    }

    /// Finds the newest committed version relative to `held`. With
    /// `thorough` false this may answer [`Seen::Same`] from the hint alone.
    pub async fn check(&mut self, f: &Fetcher, held: Option<u64>, thorough: bool) -> Result<Seen> {
        let due = self.polls.is_multiple_of(THOROUGH_EVERY);
        self.polls += 1;
        let mut thorough = thorough || due || held.is_none();
        if !thorough {
            match f.latest(self.etag.as_deref()).await? {
                None => return Ok(Seen::Same),
                Some((hint, etag)) => {
                    self.etag = etag;
                    match held {
                        Some(h) if hint.version == h => return Ok(Seen::Same),
                        // Behind the held version: a reset bucket, or a stale hint.
                        Some(h) if hint.version < h => thorough = true,
                        _ => {}
                    }
                }
            }
        }
        let after = f.versions_after(held).await?;
        if let Some(&newest) = after.last() {
            return Ok(Seen::Newest(newest));
        }
        let Some(h) = held else {
            return Ok(Seen::Empty);
        };
        if thorough && f.manifest(h).await?.is_none() {
            tracing::warn!(
                version = h,
                "the held version is no longer in the bucket; following the bucket's newest"
            );
            return Ok(match f.versions_after(None).await?.last() {
                Some(&v) => Seen::Newest(v),
                None => Seen::Empty,
            });
        }
        Ok(Seen::Same)
    }

    /// The next wait: the interval with jitter applied.
    pub fn next_wait(&mut self) -> Duration {
        // xorshift64*: enough to spread a fleet's polls.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let r = self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d);
        let u = (r >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
        self.interval.mul_f64(1.0 + self.jitter * (2.0 * u - 1.0))
    }

    /// Waits for the next poll: [`VersionSource::next_wait`], or until `wake`
    /// is notified. Returns true when a notification woke it (the next check
    /// should be thorough).
    pub async fn wait(&mut self, wake: &Notify) -> bool {
        let d = self.next_wait();
        tokio::select! {
            _ = tokio::time::sleep(d) => false,
            _ = wake.notified() => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_its_fraction_and_spreads() {
        let mut s = VersionSource::new(Duration::from_secs(10), 0.2);
        let waits: Vec<f64> = (0..2000).map(|_| s.next_wait().as_secs_f64()).collect();
        assert!(waits.iter().all(|w| (8.0..=12.0).contains(w)), "{waits:?}");
        let below = waits.iter().filter(|&&w| w < 9.0).count();
        let above = waits.iter().filter(|&&w| w > 11.0).count();
        assert!(below > 300 && above > 300, "{below} {above}");
        let mut none = VersionSource::new(Duration::from_secs(3), 0.0);
        assert_eq!(none.next_wait(), Duration::from_secs(3));
        assert_eq!(VersionSource::new(Duration::ZERO, f64::NAN).jitter, 0.0);
    }
}
