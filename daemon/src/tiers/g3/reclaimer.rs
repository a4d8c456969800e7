//! Eviction: the mechanism. The policy (crate::tiers::policy) picks victims; this
//! module asks it only for leaves (chains.rs) that are neither leased nor
//! pinned nor spared (spare.rs), and runs in the background once usage passes the high watermark, down to
//! the low one. It also expires leases and makes the index durable once a
//! second. Capacity on the write path lives here too: `make_room` evicts
//! synchronously before a batch would pass `capacity_bytes`, and
//! `maybe_reclaim` wakes the thread above the high watermark.

use super::index::{FLAG_EPHEMERAL, FLAG_IN_G4};
use super::{lock_err, now_s, G3Store, RemoveReason};
use crate::base::error::{Error, Result};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

/// Wakes or stops the reclaimer thread.
#[derive(Debug, Default)]
pub struct Signal {
    state: Mutex<(bool, bool)>,
    cv: Condvar,
    /// Test seam: the thread skips its eviction passes.
    paused: std::sync::atomic::AtomicBool,
}

impl Signal {
    /// Asks for an eviction pass now.
    pub fn wake(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.0 = true;
        }
        self.cv.notify_all();
    }

    /// Asks the thread to exit.
    pub fn stop(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.1 = true;
        }
        self.cv.notify_all();
    }

    /// Waits for a wake or the tick; `true` when stopped.
    fn wait(&self, tick: Duration) -> bool {
        let Ok(s) = self.state.lock() else {
            return true;
        };
        let Ok((mut s, _)) = self.cv.wait_timeout_while(s, tick, |s| !s.0 && !s.1) else {
            return true;
        };
        s.0 = false;
        s.1
    }
}

/// Starts the background reclaimer; it holds the store weakly and exits
/// when the store is dropped or closed.
pub(super) fn spawn(store: &Arc<G3Store>) -> Option<std::thread::JoinHandle<()>> {
    let weak: Weak<G3Store> = Arc::downgrade(store);
    let signal = Arc::clone(&store.reclaim);
    let r = std::thread::Builder::new()
        .name("g3-reclaimer".into())
        .spawn(move || loop {
            if signal.wait(Duration::from_secs(1)) {
                return;
            }
            let Some(s) = weak.upgrade() else { return };
            if !signal.paused.load(Ordering::Relaxed) {
                s.background_pass();
            }
            // Off the write path: retired files become reusable.
            s.settle_retired();
            s.remove_empty_dirs();
            // The index's reserve is made again once there is room.
            s.disk.reserve.replenish();
            if let Err(e) = s.disk.flush_if_dirty() {
                flush_failed(&e);
            }
        });
    match r {
        Ok(h) => Some(h),
        Err(e) => {
            tracing::error!(error = %e, "g3: cannot start the reclaimer; eviction runs only when full");
            None
        }
    }
}

static FLUSH_WARN: crate::base::log_limit::LogLimit = crate::base::log_limit::LogLimit::new(10_000);

/// Logs a failed index flush: the reclaimer retries every second while
/// the index is broken (a full disk), so one line per 10 s with the
/// failures in between counted (`suppressed`). Whether it logged.
fn flush_failed(e: &Error) -> bool {
    let Some(suppressed) = FLUSH_WARN.allow() else {
        return false;
    };
    tracing::warn!(error = %e, suppressed, "g3: index flush failed");
    true
}

/// How many evictable candidates not yet in G4 a pass looks past, in the
/// policy's order, for one that is (when G4 write-through is on): bounded,
/// so a backlog of uploads costs a short scan, not one of the whole tier.
const PREFER_UPLOADED_SCAN_MAX: u32 = 64;

static BEFORE_UPLOAD_WARN: crate::base::log_limit::LogLimit =
    crate::base::log_limit::LogLimit::new(10_000);
static STUCK_WARN: crate::base::log_limit::LogLimit = crate::base::log_limit::LogLimit::new(10_000);

/// Whether a pass may make room now (the write path, a full filesystem) or
/// can wait (the background pass: it never takes an open tail).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Urgency {
    /// Room is needed for a write waiting now.
    Now,
    /// Down to the low watermark, in the background.
    Background,
}

impl G3Store {
    /// Eviction prefers blocks already uploaded to G4 (set when G4
    /// write-through is on), and counts and logs blocks evicted before
    /// their upload.
    pub fn set_prefer_uploaded(&self, on: bool) {
        self.prefer_uploaded.store(on, Ordering::Relaxed);
    }

    /// Test seam: the background thread stops (`true`) or resumes evicting,
    /// so that a test runs [`G3Store::background_pass`] itself, between its
    /// checks (lease expiry and index flushes go on).
    #[doc(hidden)]
    pub fn pause_background_eviction(&self, paused: bool) {
        self.reclaim.paused.store(paused, Ordering::Relaxed);
    }

    /// One pass of the background reclaimer: above the high watermark,
    /// evicts down to the low one (never an open tail). Public for tests
    /// (the chain model test runs it between operations). Returns blocks
    /// evicted.
    #[doc(hidden)]
    pub fn background_pass(&self) -> u64 {
        self.sweep_leases();
        let cap = self.block_capacity() as f64;
        let used = self.mem.read().map(|m| m.used_bytes).unwrap_or(0) as f64;
        if used <= self.cfg.high_watermark * cap {
            return 0;
        }
        // Background evictions keep their files for reuse.
        let n = self.evict_pass(
            (self.cfg.low_watermark * cap) as u64,
            true,
            Urgency::Background,
        );
        tracing::debug!(evicted = n, "g3: eviction pass");
        n
    }

    /// Evicts policy victims until usage is at most `target_bytes` or
    /// nothing more may go, for a write waiting now (see
    /// [`G3Store::evict_pass`]). Returns blocks evicted.
    pub(crate) fn evict_to(&self, target_bytes: u64, retire: bool) -> u64 {
        self.evict_pass(target_bytes, retire, Urgency::Now)
    }

    /// Evicts policy victims until usage is at most `target_bytes` or
    /// nothing more may go. A victim is a leaf (no held child, chains.rs),
    /// neither leased nor pinned, nor a batch's parent; an open tail
    /// (spare.rs) only when `urgency` is `Now` and nothing else may go.
    /// With G4 write-through on, a block already in G4 goes before one
    /// that is not among the first [`PREFER_UPLOADED_SCAN_MAX`]
    /// candidates. `retire`: victims' files may go to the recycle pool.
    /// Returns blocks evicted.
    pub(crate) fn evict_pass(&self, target_bytes: u64, retire: bool, urgency: Urgency) -> u64 {
        self.sweep_leases();
        let spared = self.spare.now();
        let mut take_tails = false;
        let mut n = 0;
        loop {
            let now = now_s();
            let prefer = self.prefer_uploaded.load(Ordering::Relaxed);
            let victim = {
                let Ok(mem) = self.mem.read() else { break };
                if mem.used_bytes <= target_bytes {
                    break;
                }
                let Ok(mut pol) = self.policy.lock() else {
                    break;
                };
                let evictable = |id: u64| {
                    mem.map
                        .get(&id)
                        .is_some_and(|e| e.leases == 0 && !e.pinned(now))
                        && !mem.chains.has_children(id)
                        && !spared.parents.contains(&id)
                        && (take_tails || !spared.tails.contains(&id))
                };
                let uploaded = |id: u64| {
                    mem.map
                        .get(&id)
                        .is_some_and(|e| e.flags & (FLAG_IN_G4 | FLAG_EPHEMERAL) != 0)
                };
                let mut pick = None;
                if prefer {
                    let mut passed = 0u32;
                    let first = pol.victim(&mut |id| {
                        if !evictable(id) {
                            return false;
                        }
                        if uploaded(id) {
                            return true;
                        }
                        passed += 1;
                        passed >= PREFER_UPLOADED_SCAN_MAX
                    });
                    pick = first.filter(|&id| uploaded(id));
                }
                pick.or_else(|| pol.victim(&mut |id| evictable(id)))
                    .map(|id| (id, prefer && !uploaded(id)))
            };
            let Some((id, before_upload)) = victim else {
                if urgency == Urgency::Now && !take_tails && !spared.tails.is_empty() {
                    // Nothing else may go: an open tail's chain is cut short
                    // (its next batch is refused) rather than the write.
                    take_tails = true;
                    continue;
                }
                if let Some(suppressed) = STUCK_WARN.allow() {
                    tracing::warn!(
                        target_bytes,
                        suppressed,
                        "g3: over the watermark but no block may go (every leaf is leased, \
                         pinned, a batch's parent or a chain's open tail)"
                    );
                }
                break;
            };
            // `recorded`: false when memory holds an entry that redb lacks.
            let (recorded, removed) = match self.disk.get(id) {
                Ok(Some(rec)) => (
                    true,
                    self.remove_block(&rec.ns, &rec.key, RemoveReason::Evicted, retire),
                ),
                Ok(None) => (false, Ok(false)),
                Err(e) => (true, Err(e)),
            };
            match removed {
                Ok(true) => {
                    n += 1;
                    self.counters.evictions.fetch_add(1, Ordering::Relaxed);
                    if before_upload {
                        self.counters
                            .evicted_before_upload
                            .fetch_add(1, Ordering::Relaxed);
                        if let Some(suppressed) = BEFORE_UPLOAD_WARN.allow() {
                            tracing::warn!(
                                suppressed,
                                "g3: evicted a block before its G4 upload (G4 has no copy; \
                                 kvtier_g3_evicted_before_upload_total counts them)"
                            );
                        }
                    }
                }
                Ok(false) => {
                    // The policy knew a block the index does not: forget it
                    // there so the loop makes progress. Memory's entry goes
                    // too only when redb has no record of it (no name to
                    // remove it by); otherwise another removal took it
                    // first, and an entry there now is a newer put's.
                    let stale = !recorded
                        || self
                            .mem
                            .read()
                            .map(|m| !m.map.contains_key(&id))
                            .unwrap_or(false);
                    if stale {
                        if let Ok(mut p) = self.policy.lock() {
                            p.on_remove(id);
                        }
                    }
                    if !recorded {
                        if let Ok(mut m) = self.mem.write() {
                            m.remove_id(id);
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "g3: eviction failed");
                    break;
                }
            }
        }
        n
    }
}

impl G3Store {
    /// Evicts synchronously when `incoming` bytes would pass capacity, on
    /// top of `reserved` bytes that earlier items of the same batch will
    /// add.
    pub(super) fn make_room(&self, reserved: u64, incoming: u64) -> Result<()> {
        // Quarantined bytes count against capacity.
        let cap = self.block_capacity();
        if incoming > cap {
            return Err(Error::LimitReached {
                what: "g3 capacity_bytes (block larger than the tier)",
                limit: cap,
            });
        }
        let need = reserved.saturating_add(incoming);
        let used_bytes = || -> Result<u64> {
            Ok(self
                .mem
                .read()
                .map_err(|_| lock_err("g3 index"))?
                .used_bytes)
        };
        // Pooled files (recycle.rs) and free slots (slots.rs) are on the
        // disk too: room is made by dropping them first (unlink, punch),
        // then by evicting (unlinking, punching: a victim retired into a
        // pool would free nothing). A few rounds: the background reclaimer
        // may retire victims into a pool meanwhile (its evictions move
        // bytes from blocks to the pool), which is room that dropping
        // gives back.
        let pooled = || self.recycle_bytes() + self.slot_pooled_bytes();
        for _ in 0..3 {
            let used = used_bytes()?;
            let pool = pooled();
            if used + pool + need <= cap {
                return Ok(());
            }
            if pool > 0 {
                let excess = used + pool + need - cap;
                let freed = self.drop_pooled_slots(excess);
                if freed < excess {
                    self.drop_spares(excess - freed);
                }
                if used_bytes()? + pooled() + need <= cap {
                    return Ok(());
                }
            }
            if need <= cap {
                self.evict_to(cap.saturating_sub(need + pooled()), false);
            }
        }
        if used_bytes()? + pooled() + need > cap {
            return Err(Error::LimitReached {
                what: "g3 capacity_bytes (the rest is pinned, leased or taken by this batch)",
                limit: cap,
            });
        }
        Ok(())
    }

    pub(super) fn maybe_reclaim(&self) {
        let used = self.mem.read().map(|m| m.used_bytes).unwrap_or(0);
        if used as f64 > self.cfg.high_watermark * self.block_capacity() as f64 {
            self.reclaim.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reclaimer flushes once a second: while the index is broken, a
    /// minute of failures writes one line, not sixty.
    #[test]
    fn a_broken_index_flush_logs_one_line_per_interval() {
        let e = Error::InvalidInput {
            what: "index",
            reason: "Previous I/O error occurred".into(),
        };
        let logged = (0..60).filter(|_| flush_failed(&e)).count();
        assert_eq!(logged, 1);
    }
}
