//! Prefetch: "this chain will be needed soon". The blocks of the chain
//! that are neither on G3 nor staged are fetched from peers or G4 in the
//! background and written into G3, so that the request that follows finds
//! them local instead of fetching on its critical path.
//!
//! Never in the way of foreground work:
//! - its own threads (`PARALLEL_MAX`) and its own fetch permits, so an
//!   onboard never waits behind a prefetch for a permit;
//! - a prefetch waits while the node is fetching for an onboard (the same
//!   signal the background promotions yield to), up to its deadline;
//! - bounded: at most `queue_max` blocks wait, at most `per_uid_max` of them
//!   for one uid (the rest of the queue stays free for the others), and a
//!   block that finds no room is answered `LimitReached` at once.
//!
//! Superseded: a new prefetch of the same uid and stream (the caller's name
//! for a request or a session) for the same namespace drops that stream's
//! queued blocks the new chain no longer names (an engine that rescheduled
//! the request no longer needs them).
//! Expired: a block whose deadline passed before a thread got to it is
//! dropped. Neither touches a fetch already under way.
//!
//! What a prefetch is not: an acknowledgement. A prefetched block is a
//! cache fill like a promotion (`put_block`, the crash-safe path); a crash
//! loses only the fill.

use super::fetch::{fetch_remote, Fetched};
use super::promote::Activity;
use super::Node;
use crate::base::backend::PrefetchCaller;
use kvtier_client::proto::ItemStatus;
use kvtier_client::{BlockKey, NamespaceId};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Threads fetching prefetched blocks (and so remote fetches a prefetch has
/// in flight at most).
pub(super) const PARALLEL_MAX: usize = 2;
/// How long a prefetch thread waits between looks at a busy node.
const YIELD_POLL: Duration = Duration::from_millis(2);

/// Bounds of the prefetch queue.
#[derive(Debug, Clone, Copy)]
pub struct PrefetchLimits {
    /// Blocks waiting for a thread at most.
    pub queue_max: usize,
    /// Of those, blocks one uid may have waiting at most.
    pub per_uid_max: usize,
    /// Longest deadline a caller may ask for.
    pub deadline_max_ms: u32,
}

impl Default for PrefetchLimits {
    fn default() -> Self {
        PrefetchLimits {
            queue_max: 4096,
            per_uid_max: 2048,
            deadline_max_ms: 60_000,
        }
    }
}

/// What prefetch has done, for metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefetchFigures {
    /// Blocks asked for.
    pub requested: u64,
    /// Blocks queued.
    pub queued: u64,
    /// Blocks already on G3 or staged when asked for (or when reached).
    pub already_local: u64,
    /// Blocks fetched and written into G3.
    pub fetched: u64,
    /// Blocks no tier delivered (absent, unavailable, or the G3 write
    /// failed).
    pub missed: u64,
    /// Blocks dropped: the deadline passed before a thread reached them.
    pub expired: u64,
    /// Blocks dropped: a newer prefetch of the same stream no longer named
    /// them.
    pub superseded: u64,
    /// Blocks refused: the queue or the uid's share of it was full.
    pub refused: u64,
    /// Blocks waiting now.
    pub waiting: u64,
}

#[derive(Default)]
struct Counters {
    requested: AtomicU64,
    queued: AtomicU64,
    already_local: AtomicU64,
    fetched: AtomicU64,
    missed: AtomicU64,
    expired: AtomicU64,
    superseded: AtomicU64,
    refused: AtomicU64,
}

/// One queued block.
struct Job {
    ns: NamespaceId,
    key: BlockKey,
    deadline: Instant,
    uid: u32,
    stream: u64,
}

/// Where a requested block is, as the node saw it before queueing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ask {
    /// On G3 or staged: nothing to do.
    Local,
    /// Not local; a remote tier may have it.
    Fetch,
    /// Not local, and no remote tier to ask.
    Nowhere,
}

/// What [`Queue::admit`] did.
#[derive(Debug, Default)]
struct Admitted {
    status: Vec<ItemStatus>,
    local: u64,
    nowhere: u64,
    refused: u64,
    superseded: u64,
    added: u64,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// The queued (not started) blocks, for de-duplication.
    queued: HashSet<(NamespaceId, BlockKey)>,
    per_uid: HashMap<u32, usize>,
    stop: bool,
}

impl Queue {
    fn pop(&mut self) -> Option<Job> {
        let j = self.jobs.pop_front()?;
        self.forget(j.ns, j.key, j.uid);
        Some(j)
    }

    /// Takes a prefetch request into the queue: supersedes the caller's
    /// stream, then per key answers and queues (see `Node::prefetch`).
    fn admit(
        &mut self,
        limits: &PrefetchLimits,
        caller: PrefetchCaller,
        ns: &NamespaceId,
        keys: &[BlockKey],
        ask: &[Ask],
        deadline: Instant,
    ) -> Admitted {
        let mut a = Admitted::default();
        // Superseded: this stream's queued blocks of this namespace the new
        // chain does not name.
        if caller.stream != 0 {
            let wanted: HashSet<BlockKey> = keys.iter().copied().collect();
            let mut dropped = Vec::new();
            self.jobs.retain(|j| {
                let keep = j.stream != caller.stream
                    || j.uid != caller.uid
                    || j.ns != *ns
                    || wanted.contains(&j.key);
                if !keep {
                    dropped.push((j.ns, j.key, j.uid));
                }
                keep
            });
            a.superseded = dropped.len() as u64;
            for (ns, key, uid) in dropped {
                self.forget(ns, key, uid);
            }
        }
        for (k, ask) in keys.iter().zip(ask) {
            let st = match ask {
                Ask::Local => {
                    a.local += 1;
                    ItemStatus::AlreadyPresent
                }
                Ask::Nowhere => {
                    a.nowhere += 1;
                    ItemStatus::Absent
                }
                Ask::Fetch if self.queued.contains(&(*ns, *k)) => {
                    // Already waiting: the later deadline wins.
                    if let Some(j) = self.jobs.iter_mut().find(|j| j.ns == *ns && j.key == *k) {
                        j.deadline = j.deadline.max(deadline);
                    }
                    ItemStatus::Ok
                }
                Ask::Fetch => {
                    let mine = self.per_uid.get(&caller.uid).copied().unwrap_or(0);
                    if self.jobs.len() >= limits.queue_max || mine >= limits.per_uid_max {
                        a.refused += 1;
                        ItemStatus::LimitReached
                    } else {
                        self.queued.insert((*ns, *k));
                        *self.per_uid.entry(caller.uid).or_default() += 1;
                        self.jobs.push_back(Job {
                            ns: *ns,
                            key: *k,
                            deadline,
                            uid: caller.uid,
                            stream: caller.stream,
                        });
                        a.added += 1;
                        ItemStatus::Ok
                    }
                }
            };
            a.status.push(st);
        }
        a
    }

    /// Drops a block that left the queue from the sets beside it.
    fn forget(&mut self, ns: NamespaceId, key: BlockKey, uid: u32) {
        self.queued.remove(&(ns, key));
        if let Some(n) = self.per_uid.get_mut(&uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_uid.remove(&uid);
            }
        }
    }
}

struct Shared {
    limits: PrefetchLimits,
    queue: Mutex<Queue>,
    ready: Condvar,
    counters: Counters,
    /// Prefetch fetches' own permits (not the onboards').
    permits: Arc<tokio::sync::Semaphore>,
    /// Prefetch fetches in flight; kept apart from the node's foreground
    /// `Activity` so that prefetches never make each other (or the
    /// promotions) wait as if an onboard were running.
    own_activity: Arc<Activity>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // Every update keeps the queue consistent between statements.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The prefetch queue and its threads.
pub(super) struct Prefetcher {
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Prefetcher {
    pub(super) fn new(limits: PrefetchLimits) -> Prefetcher {
        Prefetcher {
            shared: Arc::new(Shared {
                limits,
                queue: Mutex::new(Queue::default()),
                ready: Condvar::new(),
                counters: Counters::default(),
                permits: Arc::new(tokio::sync::Semaphore::new(PARALLEL_MAX)),
                own_activity: Activity::new(),
            }),
            threads: Mutex::new(Vec::new()),
        }
    }

    /// Starts the threads; they hold the node weakly, so the node can go
    /// away while they wait.
    pub(super) fn start(&self, node: &Arc<Node>) -> std::io::Result<()> {
        let mut threads = self.threads.lock().unwrap_or_else(|p| p.into_inner());
        for i in 0..PARALLEL_MAX {
            let (shared, node) = (self.shared.clone(), Arc::downgrade(node));
            threads.push(
                std::thread::Builder::new()
                    .name(format!("kvtier-prefetch-{i}"))
                    .spawn(move || worker(&shared, &node))?,
            );
        }
        Ok(())
    }

    /// Tells the threads to stop (they finish the fetch under way); queued
    /// blocks are dropped. Does not wait: the node's `Drop` may run on a
    /// prefetch thread.
    pub(super) fn close(&self) {
        {
            let mut q = self.shared.lock();
            q.stop = true;
            q.jobs.clear();
            q.queued.clear();
            q.per_uid.clear();
        }
        self.shared.ready.notify_all();
    }

    /// [`Prefetcher::close`], then waits for the threads.
    pub(super) fn stop(&self) {
        self.close();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }

    pub(super) fn figures(&self) -> PrefetchFigures {
        let c = &self.shared.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PrefetchFigures {
            requested: l(&c.requested),
            queued: l(&c.queued),
            already_local: l(&c.already_local),
            fetched: l(&c.fetched),
            missed: l(&c.missed),
            expired: l(&c.expired),
            superseded: l(&c.superseded),
            refused: l(&c.refused),
            waiting: self.shared.lock().jobs.len() as u64,
        }
    }
}

impl Node {
    /// Queues the blocks of `keys` that are not local for a background
    /// fetch into G3 within `deadline_ms` (capped). Per key: `Ok` queued
    /// (or already queued), `AlreadyPresent` local now, `LimitReached` no
    /// room in the queue or the caller's share, `Absent` when the node has
    /// no remote tier to fetch from.
    pub fn prefetch(
        &self,
        caller: PrefetchCaller,
        ns: &NamespaceId,
        keys: &[BlockKey],
        deadline_ms: u32,
    ) -> Vec<ItemStatus> {
        let sh = &self.prefetcher.shared;
        let c = &sh.counters;
        c.requested.fetch_add(keys.len() as u64, Ordering::Relaxed);
        let deadline = Instant::now()
            + Duration::from_millis(deadline_ms.min(sh.limits.deadline_max_ms) as u64);
        let remote = self.remote();
        let ask: Vec<Ask> = keys
            .iter()
            .map(|k| {
                if self.on_g3(ns, k) || self.staging.contains(ns, k) {
                    Ask::Local
                } else if remote {
                    Ask::Fetch
                } else {
                    Ask::Nowhere
                }
            })
            .collect();
        let a = sh
            .lock()
            .admit(&sh.limits, caller, ns, keys, &ask, deadline);
        c.already_local.fetch_add(a.local, Ordering::Relaxed);
        c.missed.fetch_add(a.nowhere, Ordering::Relaxed);
        c.refused.fetch_add(a.refused, Ordering::Relaxed);
        c.superseded.fetch_add(a.superseded, Ordering::Relaxed);
        c.queued.fetch_add(a.added, Ordering::Relaxed);
        for _ in 0..a.added.min(PARALLEL_MAX as u64) {
            sh.ready.notify_one();
        }
        a.status
    }

    /// What prefetch has done so far.
    pub fn prefetch_figures(&self) -> PrefetchFigures {
        self.prefetcher.figures()
    }

    /// One queued block: wait for a quiet node, fetch, write into G3.
    fn prefetch_one(&self, sh: &Shared, job: Job) {
        let c = &sh.counters;
        if self.on_g3(&job.ns, &job.key) || self.staging.contains(&job.ns, &job.key) {
            c.already_local.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // Onboards first: wait while one is fetching.
        while self.activity.busy() {
            if Instant::now() >= job.deadline {
                c.expired.fetch_add(1, Ordering::Relaxed);
                return;
            }
            std::thread::sleep(YIELD_POLL);
        }
        let deadline = job.deadline.min(Instant::now() + self.fetch_deadline);
        let fut = fetch_remote(
            self.peers.clone(),
            self.g4.clone(),
            sh.permits.clone(),
            sh.own_activity.clone(),
            job.ns,
            job.key,
            deadline,
        );
        match self.run_async(fut) {
            Some(Fetched::Hit {
                block,
                from,
                fetch_us,
            }) => {
                self.staging.count_fetch(from, fetch_us);
                match self.staging.write_now(&job.ns, &block, from) {
                    Ok(()) => {
                        c.fetched.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        tracing::debug!(ns = %job.ns, key = %job.key, error = %e, "prefetch: G3 write failed");
                        c.missed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Some(Fetched::Miss(_)) | None => {
                c.missed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

fn worker(sh: &Shared, node: &Weak<Node>) {
    loop {
        let job = {
            let mut q = sh.lock();
            loop {
                if q.stop {
                    return;
                }
                match q.pop() {
                    Some(j) if Instant::now() >= j.deadline => {
                        sh.counters.expired.fetch_add(1, Ordering::Relaxed);
                    }
                    Some(j) => break j,
                    None => {
                        q = sh.ready.wait(q).unwrap_or_else(|p| p.into_inner());
                    }
                }
            }
        };
        let Some(node) = node.upgrade() else {
            return;
        };
        node.prefetch_one(sh, job);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn ns(i: u8) -> NamespaceId {
        NamespaceId::from_digest(&[i; 32])
    }

    fn keys(r: std::ops::Range<u64>) -> Vec<BlockKey> {
        r.map(BlockKey::from_u64).collect()
    }

    fn limits(queue_max: usize, per_uid_max: usize) -> PrefetchLimits {
        PrefetchLimits {
            queue_max,
            per_uid_max,
            deadline_max_ms: 1_000,
        }
    }

    fn caller(uid: u32, stream: u64) -> PrefetchCaller {
        PrefetchCaller { uid, stream }
    }

    fn admit(q: &mut Queue, l: &PrefetchLimits, c: PrefetchCaller, k: &[BlockKey]) -> Admitted {
        let far = Instant::now() + Duration::from_secs(60);
        q.admit(l, c, &ns(1), k, &vec![Ask::Fetch; k.len()], far)
    }

    #[test]
    fn local_and_unreachable_blocks_are_answered_not_queued() {
        let mut q = Queue::default();
        let k = keys(0..3);
        let a = q.admit(
            &limits(8, 8),
            caller(1, 0),
            &ns(1),
            &k,
            &[Ask::Local, Ask::Nowhere, Ask::Fetch],
            Instant::now() + Duration::from_secs(1),
        );
        use ItemStatus::*;
        assert_eq!(a.status, vec![AlreadyPresent, Absent, Ok]);
        assert_eq!((a.local, a.nowhere, a.added), (1, 1, 1));
        assert_eq!(q.jobs.len(), 1);
    }

    #[test]
    fn the_queue_and_each_uids_share_are_bounded() {
        let l = limits(6, 4);
        let mut q = Queue::default();
        let a = admit(&mut q, &l, caller(1, 0), &keys(0..6));
        assert_eq!(a.added, 4, "uid 1 holds its share and no more");
        assert_eq!(a.refused, 2);
        assert_eq!(a.status[4], ItemStatus::LimitReached);
        // Another uid still finds room, up to the queue's bound.
        let b = admit(&mut q, &l, caller(2, 0), &keys(10..14));
        assert_eq!((b.added, b.refused), (2, 2));
        assert_eq!(q.jobs.len(), 6);
        // A block that leaves the queue frees its uid's share.
        let j = q.pop().unwrap();
        assert_eq!(j.uid, 1);
        assert_eq!(q.per_uid[&1], 3);
        assert_eq!(admit(&mut q, &l, caller(1, 0), &keys(20..22)).added, 1);
    }

    #[test]
    fn a_block_asked_for_twice_is_queued_once_with_the_later_deadline() {
        let l = limits(8, 8);
        let mut q = Queue::default();
        let k = keys(0..1);
        let soon = Instant::now() + Duration::from_millis(10);
        let later = Instant::now() + Duration::from_secs(30);
        q.admit(&l, caller(1, 0), &ns(1), &k, &[Ask::Fetch], soon);
        let a = q.admit(&l, caller(2, 0), &ns(1), &k, &[Ask::Fetch], later);
        assert_eq!(a.status, vec![ItemStatus::Ok]);
        assert_eq!(a.added, 0);
        assert_eq!(q.jobs.len(), 1);
        assert_eq!(q.jobs[0].deadline, later);
    }

    #[test]
    fn a_newer_prefetch_of_the_same_stream_supersedes_what_it_no_longer_names() {
        let l = limits(64, 64);
        let mut q = Queue::default();
        admit(&mut q, &l, caller(1, 7), &keys(0..8));
        // Other streams, uids and namespaces are left alone.
        admit(&mut q, &l, caller(1, 8), &keys(100..102));
        admit(&mut q, &l, caller(2, 7), &keys(200..202));
        let far = Instant::now() + Duration::from_secs(60);
        q.admit(
            &l,
            caller(1, 7),
            &ns(2),
            &keys(300..301),
            &[Ask::Fetch],
            far,
        );
        // The chain changed after block 3: 4..8 are dropped, 0..4 kept.
        let a = admit(&mut q, &l, caller(1, 7), &keys(0..4));
        assert_eq!(a.superseded, 4);
        assert_eq!(a.added, 0);
        let left: HashSet<BlockKey> = q.jobs.iter().map(|j| j.key).collect();
        let has = |k: u64| left.contains(&BlockKey::from_u64(k));
        assert!((0..4).all(has));
        assert!(!(4..8).any(has), "4..8 are superseded");
        assert!(
            [100, 101, 200, 201, 300].into_iter().all(has),
            "others' are kept"
        );
        assert_eq!(q.queued.len(), q.jobs.len());
        assert_eq!(q.per_uid[&1], 4 + 2 + 1);
        // Stream 0 never supersedes.
        let b = admit(&mut q, &l, caller(1, 0), &keys(0..1));
        assert_eq!(b.superseded, 0);
    }
}
