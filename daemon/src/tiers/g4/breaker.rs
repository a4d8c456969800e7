//! The circuit breaker in front of the object store: after
//! `breaker_failures_max` consecutive failed or late calls it opens, and
//! calls fail at once (a miss for reads, a retryable error for uploads)
//! without sending a request. After `breaker_open_ms` one call is let
//! through as a probe (half-open): success closes the breaker, failure
//! opens it again for twice as long, up to `breaker_open_max_ms`.
//!
//! Why: a dead or hung store would otherwise cost every lookup, onboard and
//! mount `stat` its full deadline, and pile requests onto a store that
//! cannot answer them. An answer of any kind (including 404) is a success:
//! the store is there.

use super::lock;
use super::stats::{inc, G4Stats};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Called (outside the breaker's lock) each time the breaker closes again.
pub(crate) type OnClosed = Arc<dyn Fn() + Send + Sync>;

/// What the breaker is doing now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go through.
    Closed,
    /// Calls are refused until the back-off passes.
    Open,
    /// One probe call is in flight; the others are refused.
    HalfOpen,
}

#[derive(Debug)]
struct State {
    state: BreakerState,
    failures: u32,
    open_for: Duration,
    /// When Open ends, or when a HalfOpen probe is presumed lost.
    until: Instant,
}

pub(crate) struct Breaker {
    failures_max: u32,
    open_min: Duration,
    open_max: Duration,
    /// A probe that never reports (its caller dropped it) frees the
    /// half-open slot after this long.
    probe_timeout: Duration,
    s: Mutex<State>,
    /// Told when the store answers again (the node re-queues its backlog).
    on_closed: Mutex<Option<OnClosed>>,
    /// Told when it opens (the node counts its backlog at once).
    on_opened: Mutex<Option<OnClosed>>,
}

impl Breaker {
    pub(crate) fn new(
        failures_max: u32,
        open_min: Duration,
        open_max: Duration,
        probe_timeout: Duration,
    ) -> Self {
        Breaker {
            failures_max: failures_max.max(1),
            open_min,
            open_max: open_max.max(open_min),
            probe_timeout,
            s: Mutex::new(State {
                state: BreakerState::Closed,
                failures: 0,
                open_for: open_min,
                until: Instant::now(),
            }),
            on_closed: Mutex::new(None),
            on_opened: Mutex::new(None),
        }
    }

    /// Calls `hook` whenever the breaker opens after being closed.
    pub(crate) fn set_on_opened(&self, hook: OnClosed) {
        *lock(&self.on_opened) = Some(hook);
    }

    /// Calls `hook` whenever the breaker closes after being open.
    pub(crate) fn set_on_closed(&self, hook: OnClosed) {
        *lock(&self.on_closed) = Some(hook);
    }

    pub(crate) fn state(&self) -> BreakerState {
        lock(&self.s).state
    }

    /// Whether a call may go to the store now. A refusal is counted.
    pub(crate) fn allow(&self, stats: &G4Stats) -> bool {
        let mut s = lock(&self.s);
        let now = Instant::now();
        let ok = match s.state {
            BreakerState::Closed => true,
            BreakerState::Open | BreakerState::HalfOpen if now >= s.until => {
                // This caller is the probe.
                s.state = BreakerState::HalfOpen;
                s.until = now + self.probe_timeout;
                true
            }
            BreakerState::Open | BreakerState::HalfOpen => false,
        };
        drop(s);
        if !ok {
            inc(&stats.breaker_rejected);
        }
        ok
    }

    /// The store answered.
    pub(crate) fn success(&self, stats: &G4Stats) {
        let mut s = lock(&self.s);
        let reopened = s.state != BreakerState::Closed;
        s.state = BreakerState::Closed;
        s.failures = 0;
        s.open_for = self.open_min;
        stats.breaker_open.store(0, Relaxed);
        drop(s);
        if reopened {
            tracing::info!("G4 circuit breaker closed: the store answers again");
            inc(&stats.recoveries);
            let hook = lock(&self.on_closed).clone();
            if let Some(hook) = hook {
                hook();
            }
        }
    }

    /// The store failed or did not answer in time.
    pub(crate) fn failure(&self, stats: &G4Stats) {
        if self.failure_opened(stats) {
            let hook = lock(&self.on_opened).clone();
            if let Some(hook) = hook {
                hook();
            }
        }
    }

    /// [`Breaker::failure`]; whether it opened a closed breaker.
    fn failure_opened(&self, stats: &G4Stats) -> bool {
        let mut s = lock(&self.s);
        let now = Instant::now();
        match s.state {
            BreakerState::Closed => {
                s.failures = s.failures.saturating_add(1);
                if s.failures >= self.failures_max {
                    s.state = BreakerState::Open;
                    s.open_for = self.open_min;
                    s.until = now + s.open_for;
                    inc(&stats.breaker_opened);
                    stats.breaker_open.store(1, Relaxed);
                    tracing::warn!(
                        failures = s.failures,
                        open_ms = s.open_for.as_millis() as u64,
                        "G4 circuit breaker open: the store keeps failing; G4 reads are misses"
                    );
                    return true;
                }
                false
            }
            BreakerState::HalfOpen => {
                s.open_for = (s.open_for * 2).min(self.open_max);
                s.state = BreakerState::Open;
                s.until = now + s.open_for;
                stats.breaker_open.store(1, Relaxed);
                false
            }
            // A call let through before the breaker opened.
            BreakerState::Open => false,
        }
    }

    /// Records an outcome: `true` when the store answered.
    pub(crate) fn record(&self, stats: &G4Stats, answered: bool) {
        if answered {
            self.success(stats)
        } else {
            self.failure(stats)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_n_failures_probes_and_closes() {
        let st = G4Stats::default();
        let b = Breaker::new(
            3,
            Duration::from_millis(30),
            Duration::from_millis(100),
            Duration::from_secs(1),
        );
        for _ in 0..2 {
            assert!(b.allow(&st));
            b.failure(&st);
        }
        assert_eq!(b.state(), BreakerState::Closed);
        b.failure(&st);
        assert_eq!(b.state(), BreakerState::Open);
        assert!(!b.allow(&st));
        assert_eq!(st.breaker_rejected.load(Relaxed), 1);
        std::thread::sleep(Duration::from_millis(40));
        assert!(b.allow(&st), "the probe goes through after the back-off");
        assert!(!b.allow(&st), "one probe at a time");
        b.failure(&st);
        assert_eq!(b.state(), BreakerState::Open);
        // Doubled: still open after the first back-off.
        std::thread::sleep(Duration::from_millis(40));
        assert!(!b.allow(&st));
        std::thread::sleep(Duration::from_millis(30));
        assert!(b.allow(&st));
        b.success(&st);
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(st.breaker_open.load(Relaxed), 0);
        assert_eq!(st.breaker_opened.load(Relaxed), 1);
    }

    /// Issue #42: the backlog gauges read 0 for a minute into an outage;
    /// the node is now told when the breaker opens (once per outage, not
    /// again while it stays open) and counts its backlog at once.
    #[test]
    fn opening_tells_the_node_once() {
        let st = G4Stats::default();
        let b = Breaker::new(
            2,
            Duration::from_millis(20),
            Duration::from_millis(20),
            Duration::from_secs(1),
        );
        let told = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let t = told.clone();
        b.set_on_opened(std::sync::Arc::new(move || {
            t.fetch_add(1, Relaxed);
        }));
        b.failure(&st);
        assert_eq!(told.load(Relaxed), 0);
        b.failure(&st);
        b.failure(&st);
        assert_eq!(told.load(Relaxed), 1);
        std::thread::sleep(Duration::from_millis(30));
        assert!(b.allow(&st));
        b.failure(&st);
        assert_eq!(told.load(Relaxed), 1, "a failed probe is the same outage");
    }

    #[test]
    fn a_success_resets_the_count() {
        let st = G4Stats::default();
        let b = Breaker::new(
            2,
            Duration::from_secs(1),
            Duration::from_secs(1),
            Duration::from_secs(1),
        );
        b.failure(&st);
        b.success(&st);
        b.failure(&st);
        assert_eq!(b.state(), BreakerState::Closed);
    }
}
