//! Rate-limited warnings for failures that can repeat thousands of times a
//! second (accept on an exhausted fd table): one line per interval, with the
//! count of those suppressed since the last one, instead of a log flood.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// One limiter per call site, usually a `static`.
#[derive(Debug)]
pub struct LogLimit {
    interval_ms: u64,
    last_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl LogLimit {
    /// At most one line per `interval_ms`.
    pub const fn new(interval_ms: u64) -> Self {
        LogLimit {
            interval_ms,
            last_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(suppressed since the last line)` when a line may be written now.
    pub fn allow(&self) -> Option<u64> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let last = self.last_ms.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= self.interval_ms
            && self
                .last_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            Some(self.suppressed.swap(0, Ordering::Relaxed))
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// Warns through `limit`: `warn_limited!(LIMIT, "accept failed: {e}")`.
#[macro_export]
macro_rules! warn_limited {
    ($limit:expr, $($arg:tt)+) => {
        if let Some(suppressed) = $limit.allow() {
            tracing::warn!(suppressed, $($arg)+);
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_and_counts_the_rest() {
        let l = LogLimit::new(60_000);
        assert_eq!(l.allow(), Some(0));
        for _ in 0..1000 {
            assert_eq!(l.allow(), None);
        }
        l.last_ms.store(0, Ordering::Relaxed);
        assert_eq!(l.allow(), Some(1000));
    }
}
