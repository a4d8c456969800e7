//! The active probe: while G4 is degraded (the breaker open, or the
//! start-up check failed), one cheap HEAD every `probe_interval_ms` (with
//! jitter) finds out when the store is back, so `/healthz` and the breaker
//! recover by themselves instead of waiting for the next G4 call (a quiet
//! node may make none for hours, and a failed start-up check was never run
//! again before).
//!
//! The breaker's probe goes through `Breaker::allow`, so its back-off
//! (`breaker_open_ms` doubling to `breaker_open_max_ms`) still spaces the
//! requests; the start-up check is re-run as it ran at start. A config
//! problem (plain http without `allow_http`, no credentials) is not
//! something a probe can fix and is not retried. Nothing here warns: the
//! breaker warns when it opens, and recovery is one info line.

use super::{stats, Inner};
use crate::tiers::g4::BreakerState;
use object_store::ObjectStoreExt;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// `base` +- 20%, from a cheap per-call seed (no shared RNG state).
pub(crate) fn jittered(base: Duration) -> Duration {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos() as u64);
    // splitmix64 step: spreads the nanoseconds over the range.
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let ms = base.as_millis() as u64;
    let spread = ms / 5;
    Duration::from_millis(ms - spread + z % (2 * spread + 1))
}

pub(crate) fn spawn(inner: &Arc<Inner>) {
    let weak: Weak<Inner> = Arc::downgrade(inner);
    let every = Duration::from_millis(inner.cfg.probe_interval_ms);
    inner.handle.spawn(async move {
        loop {
            tokio::time::sleep(jittered(every)).await;
            let Some(inner) = weak.upgrade() else { return };
            probe_once(&inner).await;
        }
    });
}

/// One round: the breaker's probe when it is open and its back-off has
/// passed, then the start-up check when it had failed.
async fn probe_once(inner: &Inner) {
    if inner.breaker.state() != BreakerState::Closed && inner.breaker.allow(&inner.stats) {
        stats::inc(&inner.stats.probes);
        // Answered at all (404 included) = the store is there.
        let probe = inner.blocks_root.clone().join(".kvtier-probe");
        let r = tokio::time::timeout(inner.response_timeout(), inner.store.head(&probe)).await;
        let answered = matches!(r, Ok(Ok(_)) | Ok(Err(object_store::Error::NotFound { .. })));
        // Closing calls the recovered hook (the node re-queues).
        inner.breaker.record(&inner.stats, answered);
    }
    let fixable =
        inner.cfg.endpoint_problem().is_none() && inner.cfg.credentials_problem().is_none();
    if fixable && inner.startup_problem().is_some() {
        stats::inc(&inner.stats.probes);
        let problem = inner.check_store().await;
        if problem.is_none() {
            tracing::info!(url = %inner.cfg.url, "G4 start-up check passes now: G4 healthy");
            inner.set_startup_problem(None);
            inner.notify_recovered();
        } else {
            // The newest reason (e.g. timeout, then access denied).
            inner.set_startup_problem(problem);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_a_fifth() {
        for _ in 0..1000 {
            let d = jittered(Duration::from_millis(1000)).as_millis();
            assert!((800..=1200).contains(&d), "{d}");
        }
        assert_eq!(jittered(Duration::ZERO), Duration::ZERO);
    }
}
