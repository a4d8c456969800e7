//! The peer server's memory of signatures it accepted: a signed request is
//! valid for `clock_skew_ms` either side of its timestamp, so a captured
//! request could be replayed (it returned the whole block 5 s later). Every
//! accepted signature is kept until its timestamp is stale; the same one
//! again is refused. Bounded: only requests that passed the signature
//! check enter (nobody without the secret can fill it), at most
//! `replay_cache_max` of them; when that many are live, new requests get
//! 503 until some go stale, never a forgotten signature. Stale is judged
//! against the latest clock reading the cache has seen, never an earlier
//! one: a signature is forgotten only once a request of its timestamp is
//! refused for good, so a clock set back does not bring a captured request
//! back. The memory does not survive a restart; the server's epoch does
//! that (auth.rs: a request is signed for one start of one node).

use super::auth::Signed;
use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;

/// Why a signature was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Seen before within its window.
    Replayed,
    /// The cache holds `max` live signatures.
    Full,
}

#[derive(Default)]
struct Inner {
    /// The latest clock reading seen (ms): time here never goes back.
    high_ms: u64,
    seen: HashSet<[u8; 32]>,
    /// (stale after, mac), in arrival order: timestamps arrive nearly in
    /// order, so purging from the front frees nearly all that is stale.
    order: VecDeque<(u64, [u8; 32])>,
}

/// Signatures accepted and not yet stale.
pub struct ReplayCache {
    max: usize,
    skew_ms: u64,
    inner: Mutex<Inner>,
}

impl ReplayCache {
    /// A cache of at most `max` signatures for a window of `skew_ms`.
    pub fn new(max: usize, skew_ms: u64) -> Self {
        ReplayCache {
            max: max.max(1),
            skew_ms,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Admits `s` (first use) or refuses it.
    pub fn admit(&self, s: &Signed, now_unix_ms: u64) -> Result<(), Refused> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Inner {
            high_ms,
            seen,
            order,
        } = &mut *g;
        *high_ms = (*high_ms).max(now_unix_ms);
        let now_unix_ms = *high_ms;
        // Stale by the latest clock: its memory may be gone.
        if s.unix_ms.saturating_add(self.skew_ms) < now_unix_ms {
            return Err(Refused::Replayed);
        }
        while order.front().is_some_and(|(stale, _)| *stale < now_unix_ms) {
            if let Some((_, mac)) = order.pop_front() {
                seen.remove(&mac);
            }
        }
        if seen.contains(&s.mac) {
            return Err(Refused::Replayed);
        }
        if seen.len() >= self.max {
            // Out of order stragglers: a full sweep before refusing.
            order.retain(|(stale, mac)| {
                let keep = *stale >= now_unix_ms;
                if !keep {
                    seen.remove(mac);
                }
                keep
            });
            if seen.len() >= self.max {
                return Err(Refused::Full);
            }
        }
        seen.insert(s.mac);
        order.push_back((s.unix_ms.saturating_add(self.skew_ms), s.mac));
        Ok(())
    }

    /// Signatures remembered now.
    pub fn len(&self) -> usize {
        self.inner.lock().map(|g| g.seen.len()).unwrap_or(0)
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(n: u8, unix_ms: u64) -> Signed {
        Signed {
            unix_ms,
            mac: [n; 32],
        }
    }

    #[test]
    fn a_signature_is_accepted_once_within_its_window_and_memory_is_bounded() {
        let c = ReplayCache::new(2, 1000);
        assert_eq!(c.admit(&s(1, 10_000), 10_000), Ok(()));
        assert_eq!(c.admit(&s(1, 10_000), 10_500), Err(Refused::Replayed));
        assert_eq!(c.admit(&s(2, 10_000), 10_500), Ok(()));
        // Two live: the third waits.
        assert_eq!(c.admit(&s(3, 10_600), 10_600), Err(Refused::Full));
        // Once stale (the timestamp check refuses them anyway) they go.
        assert_eq!(c.admit(&s(3, 11_500), 11_500), Ok(()));
        assert_eq!(c.len(), 1);
        // The clock set back does not bring a forgotten signature back.
        let c = ReplayCache::new(2, 1000);
        assert_eq!(c.admit(&s(4, 10_000), 10_000), Ok(()));
        assert_eq!(c.admit(&s(5, 20_000), 20_000), Ok(()));
        assert_eq!(c.len(), 1, "4 went stale");
        assert_eq!(c.admit(&s(4, 10_000), 10_000), Err(Refused::Replayed));
    }
}
