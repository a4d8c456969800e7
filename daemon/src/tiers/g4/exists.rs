//! A bounded, expiring cache of "does G4 hold this object?", so that a
//! lookup does not cost a HEAD per block per request. Correctness never
//! depends on it: a stale "present" becomes a miss when the GET finds
//! nothing, a stale "absent" only delays reuse until it expires.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// The cache. Eviction is first-in first-out over distinct keys (each key is
/// queued once, when first inserted), which bounds memory exactly.
pub(crate) struct ExistsCache {
    map: HashMap<String, (bool, Instant)>,
    order: VecDeque<String>,
    entries_max: usize,
    present_ttl: Duration,
    absent_ttl: Duration,
}

impl ExistsCache {
    pub(crate) fn new(entries_max: usize, present_ttl: Duration, absent_ttl: Duration) -> Self {
        ExistsCache {
            map: HashMap::new(),
            order: VecDeque::new(),
            entries_max: entries_max.max(1),
            present_ttl,
            absent_ttl,
        }
    }

    /// The cached answer, if still fresh.
    pub(crate) fn get(&self, loc: &str) -> Option<bool> {
        let (present, at) = self.map.get(loc)?;
        let ttl = if *present {
            self.present_ttl
        } else {
            self.absent_ttl
        };
        (at.elapsed() < ttl).then_some(*present)
    }

    /// Records what G4 said (or what this node just did) about `loc`.
    pub(crate) fn set(&mut self, loc: &str, present: bool) {
        if let Some(e) = self.map.get_mut(loc) {
            *e = (present, Instant::now());
            return;
        }
        while self.map.len() >= self.entries_max {
            match self.order.pop_front() {
                Some(old) => {
                    self.map.remove(&old);
                }
                None => break,
            }
        }
        self.map.insert(loc.to_string(), (present, Instant::now()));
        self.order.push_back(loc.to_string());
    }

    /// Entries held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_and_expiring() {
        let mut c = ExistsCache::new(2, Duration::from_millis(50), Duration::from_millis(0));
        c.set("a", true);
        c.set("b", true);
        c.set("c", true);
        assert_eq!(c.len(), 2);
        assert_eq!(c.get("a"), None, "oldest evicted");
        assert_eq!(c.get("c"), Some(true));
        c.set("c", false);
        assert_eq!(
            c.get("c"),
            None,
            "absent answers with ttl 0 are never trusted"
        );
        c.set("b", true);
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(c.get("b"), None, "expired");
        assert_eq!(c.len(), 2);
    }
}
