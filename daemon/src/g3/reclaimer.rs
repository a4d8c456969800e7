//! Eviction: the mechanism. The policy (crate::policy) picks victims; this
//! module asks it only for blocks that are neither leased nor pinned, and
//! runs in the background once usage passes the high watermark, down to
//! the low one. It also expires leases and makes the index durable once a
//! second. Capacity on the write path lives here too: `make_room` evicts
//! synchronously before a batch would pass `capacity_bytes`, and
//! `maybe_reclaim` wakes the thread above the high watermark.

use super::{lock_err, now_s, G3Store, RemoveReason};
use crate::error::{Error, Result};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

/// Wakes or stops the reclaimer thread.
#[derive(Debug, Default)]
pub struct Signal {
    state: Mutex<(bool, bool)>,
    cv: Condvar,
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
            s.sweep_leases();
            let cap = s.block_capacity() as f64;
            let used = s.mem.read().map(|m| m.used_bytes).unwrap_or(0) as f64;
            if used > s.cfg.high_watermark * cap {
                // Background evictions keep their files for reuse.
                let n = s.evict_to((s.cfg.low_watermark * cap) as u64, true);
                tracing::debug!(evicted = n, "g3: eviction pass");
            }
            // Off the write path: retired files become reusable.
            s.settle_retired();
            if let Err(e) = s.disk.flush_if_dirty() {
                tracing::warn!(error = %e, "g3: index flush failed");
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

impl G3Store {
    /// Evicts policy victims (never leased or pinned blocks) until usage is
    /// at most `target_bytes` or nothing more may go. Returns blocks evicted.
    /// `retire`: victims' files may go to the recycle pool.
    pub(crate) fn evict_to(&self, target_bytes: u64, retire: bool) -> u64 {
        self.sweep_leases();
        let mut n = 0;
        loop {
            let now = now_s();
            let victim = {
                let Ok(mem) = self.mem.read() else { break };
                if mem.used_bytes <= target_bytes {
                    break;
                }
                let Ok(mut pol) = self.policy.lock() else {
                    break;
                };
                pol.victim(&mut |id| {
                    mem.map
                        .get(&id)
                        .is_some_and(|e| e.leases == 0 && !e.pinned(now))
                })
            };
            let Some(id) = victim else {
                tracing::warn!(
                    target_bytes,
                    "g3: over the watermark but every block is leased or pinned"
                );
                break;
            };
            let removed = match self.disk.get(id) {
                Ok(Some(rec)) => {
                    self.remove_block(&rec.ns, &rec.key, RemoveReason::Evicted, retire)
                }
                Ok(None) => Ok(false),
                Err(e) => Err(e),
            };
            match removed {
                Ok(true) => {
                    n += 1;
                    self.counters.evictions.fetch_add(1, Ordering::Relaxed);
                }
                Ok(false) => {
                    // The policy knew a block the index does not: forget it
                    // there so the loop makes progress.
                    if let Ok(mut p) = self.policy.lock() {
                        p.on_remove(id);
                    }
                    if let Ok(mut m) = self.mem.write() {
                        m.remove_id(id);
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
        // Pooled files (recycle.rs) are on the disk too: room is made by
        // dropping them first, then by evicting (unlinking: a victim
        // retired into the pool would free nothing). A few rounds: the
        // background reclaimer may retire victims into the pool meanwhile
        // (its evictions move bytes from blocks to the pool), which is
        // room that dropping spares gives back.
        for _ in 0..3 {
            let used = used_bytes()?;
            let pooled = self.recycle_bytes();
            if used + pooled + need <= cap {
                return Ok(());
            }
            if pooled > 0 {
                self.drop_spares(used + pooled + need - cap);
                if used_bytes()? + self.recycle_bytes() + need <= cap {
                    return Ok(());
                }
            }
            if need <= cap {
                self.evict_to(cap.saturating_sub(need + self.recycle_bytes()), false);
            }
        }
        if used_bytes()? + self.recycle_bytes() + need > cap {
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
