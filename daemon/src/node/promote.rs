//! Deferred promotion: a block fetched from a peer or G4 is verified on
//! arrival, served to the caller at once, and written into G3 in the
//! background by a few worker threads.
//!
//! Why this is allowed: a promotion is a cache fill, not an acknowledged
//! write. Nothing was promised durable to anyone (the block's durable copies
//! are the peer's G3 and G4), so the onboard need not wait for an fsync.
//! What still holds: the promotion goes through `G3Store::put_block`, the
//! normal crash-safe path (temporary file, fsync, rename, directory fsync,
//! then index), so a crash leaves either the whole block or nothing, never a
//! torn or phantom block; a crash before the write loses only the fill.
//!
//! Bounds: the staged blocks (queued for promotion, being written, or held
//! for the read that a batched onboard will make) take at most
//! `staged_bytes_max`; at most `queue_max` are waiting for a worker. A block
//! that finds the queue full is not promoted (counted as skipped) and is
//! still served; one that finds no room at all is served from the caller's
//! copy and not kept.

use super::events;
use crate::base::error::Result;
use crate::base::tier::Block;
use crate::tiers::g3::{G3Store, PutMeta};
use kvtier_client::{BlockKey, Hints, NamespaceId, Tier};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A queued promotion waits while the node is fetching (or fetched less
/// than this long ago), so that its G3 write does not compete with the
/// onboards in flight for the disk and the cores...
const QUIET_US: u64 = 5_000;
/// ...but never longer than this, and not at all once the queue is half
/// full (sustained onboards still promote, up to the queue's bound).
const DEFER_MAX: Duration = Duration::from_millis(1_000);

/// Foreground onboard work in flight on the node (remote fetches, and
/// reads into a client's region), for the background work (promotions,
/// prefetches) to yield to.
#[derive(Debug)]
pub(super) struct Activity {
    in_flight: AtomicUsize,
    last_end_us: AtomicU64,
    epoch: Instant,
}

impl Activity {
    pub(super) fn new() -> Arc<Activity> {
        Arc::new(Activity {
            in_flight: AtomicUsize::new(0),
            last_end_us: AtomicU64::new(0),
            epoch: Instant::now(),
        })
    }

    /// Counts a fetch as in flight until the guard drops.
    pub(super) fn fetching(self: &Arc<Self>) -> FetchGuard {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        FetchGuard(self.clone())
    }

    pub(super) fn busy(&self) -> bool {
        let now_us = self.epoch.elapsed().as_micros() as u64;
        self.in_flight.load(Ordering::Relaxed) > 0
            || now_us.saturating_sub(self.last_end_us.load(Ordering::Relaxed)) < QUIET_US
    }
}

/// See [`Activity::fetching`].
pub(super) struct FetchGuard(Arc<Activity>);

impl Drop for FetchGuard {
    fn drop(&mut self) {
        let a = &self.0;
        a.last_end_us
            .store(a.epoch.elapsed().as_micros() as u64, Ordering::Relaxed);
        a.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Threads writing promotions into G3. Two, so that one block's fsync
/// overlaps the next one's write (G3 groups directory fsyncs of writers
/// that rename at about the same time).
const WORKERS: usize = 2;

/// Promotions into G3 from one source, for metrics and benches.
#[derive(Debug, Default)]
pub(super) struct PromoteCounters {
    count: AtomicU64,
    skipped: AtomicU64,
    fetch_us: AtomicU64,
    store_us: AtomicU64,
}

/// Promotions from one source: how many, how many were skipped, and time
/// spent fetching (transfer + verification) and storing into G3.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromoteFigures {
    /// Blocks promoted.
    pub count: u64,
    /// Fetched blocks served but not promoted (queue full, no room, or the
    /// G3 write failed).
    pub skipped: u64,
    /// Total microseconds fetching and verifying.
    pub fetch_us: u64,
    /// Total microseconds writing into G3 (in the background for
    /// deferred promotions).
    pub store_us: u64,
}

impl PromoteCounters {
    fn snapshot(&self) -> PromoteFigures {
        PromoteFigures {
            count: self.count.load(Ordering::Relaxed),
            skipped: self.skipped.load(Ordering::Relaxed),
            fetch_us: self.fetch_us.load(Ordering::Relaxed),
            store_us: self.store_us.load(Ordering::Relaxed),
        }
    }
}

/// Limits of the staging area.
#[derive(Debug, Clone, Copy)]
pub(super) struct StagingLimits {
    /// Bytes of staged payloads at most.
    pub(super) staged_bytes_max: u64,
    /// Promotions waiting for a worker at most (0: never defer, skip).
    pub(super) queue_max: usize,
}

/// What [`Staging::stage`] did with a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Staged {
    /// Queued for a background promotion.
    Queued,
    /// Kept for a later read, not to be promoted (the queue was full).
    Held,
    /// Not kept (no room, or the caller did not ask to hold it) and not
    /// promoted.
    Dropped,
}

struct Entry {
    block: Arc<Block>,
    from: Tier,
    /// Queued or being written (else held only for one read: not to be
    /// promoted, or already promoted before it was read).
    promote: bool,
    writing: bool,
    /// Whether a read already reported `from` (later reads report G3).
    reported: bool,
}

#[derive(Default)]
struct State {
    map: HashMap<(NamespaceId, BlockKey), Entry>,
    bytes: u64,
    /// Keys waiting for a worker, with the time they were queued.
    queue: VecDeque<((NamespaceId, BlockKey), Instant)>,
    writing: usize,
    paused: bool,
    closed: bool,
}

struct Shared {
    state: Mutex<State>,
    /// Signals both "a job arrived" (workers) and "a job finished"
    /// (waiters): few threads, so one condvar with `notify_all` is enough.
    cv: Condvar,
    g3: Arc<G3Store>,
    /// Announces promotions in chain order.
    order: super::disk_order::DiskOrder,
    from_peer: PromoteCounters,
    from_g4: PromoteCounters,
    limits: StagingLimits,
    activity: Arc<Activity>,
}

impl Shared {
    /// How long the first queued promotion should still wait (see
    /// `QUIET_US`), `None` to write it now.
    fn defer(&self, st: &State) -> Option<Duration> {
        let (_, queued) = st.queue.front()?;
        if st.queue.len() * 2 >= self.limits.queue_max
            || queued.elapsed() >= DEFER_MAX
            || !self.activity.busy()
        {
            return None;
        }
        Some(Duration::from_micros(QUIET_US))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn counters(&self, from: Tier) -> &PromoteCounters {
        match from {
            Tier::Peer => &self.from_peer,
            _ => &self.from_g4,
        }
    }

    /// The G3 write of one promotion (any thread).
    fn write(&self, ns: &NamespaceId, block: &Block, from: Tier) -> Result<()> {
        let t = Instant::now();
        // Linked in G3 to its parent when the header names one (Dynamo
        // namespaces) and G3 holds it; otherwise a G3 root (its chain may
        // continue on the tier it came from).
        let parent = block
            .header
            .dynamo
            .as_ref()
            .and_then(|d| d.parent)
            .map(kvtier_client::BlockKey::from_u64)
            .filter(|p| self.g3.lookup_prefix(ns, std::slice::from_ref(p)) == 1);
        let meta = PutMeta {
            parent,
            hints: Hints::default(),
        };
        self.order.begin(ns, &block.header.key);
        let outcome = match self.g3.put_block(ns, &block.header, &block.payload, meta) {
            Ok(o) => o,
            Err(e) => {
                self.order.done(ns, &block.header, false);
                return Err(e);
            }
        };
        let c = self.counters(from);
        // Counted once per block: a second writer of the same block (a lease
        // racing a worker) finds it present.
        if outcome.is_stored() {
            c.count.fetch_add(1, Ordering::Relaxed);
        }
        c.store_us
            .fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
        if from == Tier::G4 {
            // It came from G4: never upload it again.
            self.g3.mark_in_g4(ns, &block.header.key);
        }
        self.order.done(ns, &block.header, outcome.is_stored());
        Ok(())
    }

    fn worker(&self) {
        loop {
            let mut st = self.lock();
            let job = loop {
                if st.closed {
                    return;
                }
                if !st.paused {
                    if let Some(d) = self.defer(&st) {
                        st = match self.cv.wait_timeout(st, d) {
                            Ok((g, _)) => g,
                            Err(p) => p.into_inner().0,
                        };
                        continue;
                    }
                    if let Some((k, _)) = st.queue.pop_front() {
                        // Cancelled (evicted, or promoted by a caller that
                        // needed the G3 copy) while queued: nothing to do.
                        if let Some(e) = st.map.get_mut(&k) {
                            e.writing = true;
                            let job = (k, e.block.clone(), e.from);
                            st.writing += 1;
                            break job;
                        }
                        continue;
                    }
                }
                st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
            };
            drop(st);
            let ((ns, key), block, from) = job;
            if let Err(e) = self.write(&ns, &block, from) {
                self.counters(from).skipped.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%ns, %key, "promotion into G3 failed (the block was served; it stays remote): {e}");
            }
            let mut st = self.lock();
            st.writing -= 1;
            let k = (ns, key);
            // Written before its first read (a batch's later block): kept,
            // as a held block, so that read still reports the tier that
            // delivered it and is served without reading G3 back.
            let keep = st.map.get_mut(&k).is_some_and(|e| {
                e.writing = false;
                e.promote = false;
                !e.reported
            });
            if !keep {
                if let Some(e) = st.map.remove(&k) {
                    st.bytes = st.bytes.saturating_sub(e.block.payload.len() as u64);
                }
            }
            drop(st);
            self.cv.notify_all();
        }
    }
}

/// The staging area and its promotion workers. See the module docs.
pub(super) struct Staging {
    shared: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl Staging {
    /// Starts the workers.
    pub(super) fn start(
        g3: Arc<G3Store>,
        events: events::Slot,
        limits: StagingLimits,
        activity: Arc<Activity>,
    ) -> Result<Staging> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            order: super::disk_order::DiskOrder::new(g3.clone(), events),
            g3,
            from_peer: PromoteCounters::default(),
            from_g4: PromoteCounters::default(),
            limits,
            activity,
        });
        let mut workers = Vec::with_capacity(WORKERS);
        for i in 0..WORKERS {
            let s = shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("kvtier-promote-{i}"))
                .spawn(move || s.worker())
                .map_err(|e| crate::base::error::Error::io("starting a promotion worker", "", e))?;
            workers.push(h);
        }
        Ok(Staging {
            shared,
            workers: Mutex::new(workers),
        })
    }

    /// Counts a fetch's time (transfer + verification) for `from`.
    pub(super) fn count_fetch(&self, from: Tier, fetch_us: u64) {
        self.shared
            .counters(from)
            .fetch_us
            .fetch_add(fetch_us, Ordering::Relaxed);
    }

    /// Figures for one source (`Tier::Peer` or `Tier::G4`).
    pub(super) fn figures(&self, from: Tier) -> PromoteFigures {
        self.shared.counters(from).snapshot()
    }

    /// Takes a verified block fetched from `from`: queues its promotion
    /// when the queue has room, else holds it for one read when `hold`
    /// (a batched onboard's later read), else drops it. `reported`: the
    /// caller serves it now and reports `from` itself.
    pub(super) fn stage(
        &self,
        ns: &NamespaceId,
        block: Arc<Block>,
        from: Tier,
        hold: bool,
        reported: bool,
    ) -> Staged {
        let key = (*ns, block.header.key);
        let len = block.payload.len() as u64;
        let lim = self.shared.limits;
        let mut st = self.shared.lock();
        if st.closed || st.map.contains_key(&key) {
            // Closed: shutting down. Present: another fetch of the same
            // block won the race and is handling it.
            return Staged::Dropped;
        }
        if st.bytes + len > lim.staged_bytes_max {
            // Held blocks are only a shortcut for a read: make room.
            let held: Vec<_> = st
                .map
                .iter()
                .filter(|(_, e)| !e.promote)
                .map(|(k, _)| *k)
                .collect();
            for k in held {
                if st.bytes + len <= lim.staged_bytes_max {
                    break;
                }
                if let Some(e) = st.map.remove(&k) {
                    st.bytes = st.bytes.saturating_sub(e.block.payload.len() as u64);
                }
            }
        }
        let room = st.bytes + len <= lim.staged_bytes_max;
        let queue = room && st.queue.len() < lim.queue_max;
        let outcome = if queue {
            Staged::Queued
        } else if room && hold {
            Staged::Held
        } else {
            Staged::Dropped
        };
        if outcome != Staged::Queued {
            self.shared
                .counters(from)
                .skipped
                .fetch_add(1, Ordering::Relaxed);
        }
        if outcome == Staged::Dropped {
            return outcome;
        }
        st.bytes += len;
        st.map.insert(
            key,
            Entry {
                block,
                from,
                promote: queue,
                writing: false,
                reported,
            },
        );
        if queue {
            st.queue.push_back((key, Instant::now()));
            drop(st);
            self.shared.cv.notify_all();
        }
        outcome
    }

    /// A staged block, the tier that delivered it, and the tier to report
    /// for this read: `from` for the first read, `G3` (it is local) after.
    /// A held block is handed over (it was kept for this read only).
    pub(super) fn get(&self, ns: &NamespaceId, key: &BlockKey) -> Option<(Arc<Block>, Tier, Tier)> {
        let mut st = self.shared.lock();
        let k = (*ns, *key);
        let e = st.map.get_mut(&k)?;
        let (from, tier) = (e.from, if e.reported { Tier::G3 } else { e.from });
        e.reported = true;
        let block = e.block.clone();
        if !e.promote {
            if let Some(e) = st.map.remove(&k) {
                st.bytes = st.bytes.saturating_sub(e.block.payload.len() as u64);
            }
        }
        Some((block, from, tier))
    }

    /// Whether the block is staged (a lookup counts it as local).
    pub(super) fn contains(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        self.shared.lock().map.contains_key(&(*ns, *key))
    }

    /// Takes the block out of staging for a caller that needs it on G3 now
    /// (waiting for a worker already writing it). The caller then writes it
    /// itself with [`Staging::write_now`]; `true` when it was staged.
    fn unstage(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        let k = (*ns, *key);
        let mut st = self.shared.lock();
        loop {
            match st.map.get(&k) {
                None => return false,
                Some(e) if e.writing => {
                    st = self.shared.cv.wait(st).unwrap_or_else(|p| p.into_inner());
                }
                Some(_) => {
                    if let Some(e) = st.map.remove(&k) {
                        st.bytes = st.bytes.saturating_sub(e.block.payload.len() as u64);
                    }
                    st.queue.retain(|(q, _)| *q != k);
                    return true;
                }
            }
        }
    }

    /// Writes a staged (or just fetched) block into G3 on this thread: for
    /// leases, pins, direct reads and the mount, which need the G3 file.
    /// A worker already writing it is waited for (then this is
    /// `AlreadyPresent`, harmless).
    pub(super) fn write_now(&self, ns: &NamespaceId, block: &Block, from: Tier) -> Result<()> {
        self.unstage(ns, &block.header.key);
        self.shared.write(ns, block, from)
    }

    /// Drops a staged block (an `evict` request): `true` when it was staged
    /// and not yet written. One being written is waited for, so that the
    /// caller's G3 delete that follows finds it.
    pub(super) fn cancel(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        self.unstage(ns, key)
    }

    /// Waits until no promotion is queued or being written; `false` on
    /// timeout.
    pub(super) fn wait_idle(&self, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        let mut st = self.shared.lock();
        while (!st.queue.is_empty() && !st.paused) || st.writing > 0 {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = match self.shared.cv.wait_timeout(st, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        st.queue.is_empty()
    }

    /// Holds (or releases) the workers, so that tests can observe a
    /// promotion still pending.
    #[cfg(test)]
    pub(super) fn pause(&self, paused: bool) {
        self.shared.lock().paused = paused;
        self.shared.cv.notify_all();
    }

    /// Stops the workers (queued promotions are dropped: they were cache
    /// fills) and joins them.
    pub(super) fn close(&self) {
        self.shared.lock().closed = true;
        self.shared.cv.notify_all();
        let handles = match self.workers.lock() {
            Ok(mut w) => std::mem::take(&mut *w),
            Err(_) => Vec::new(),
        };
        for h in handles {
            let _ = h.join();
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        self.close();
    }
}
