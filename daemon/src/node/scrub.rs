//! The G3 scrub: a background thread re-reads and verifies every G3 block
//! at a bounded rate, so that a copy corrupted at rest is found without a
//! client reading it. Passed-fd readers (and the mount's passthrough)
//! get the file unverified by the daemon; a verifying client reports a
//! mismatch at once (`ReportCorrupt`), the scrub finds the rest.
//!
//! Each block goes through [`Node::verify_repair`] with repair: a bad copy
//! is quarantined (a `Removed` event; lookups stop reporting it) and
//! re-fetched, verified, from a peer or G4. No hit is counted and no access
//! stamped, so eviction order is untouched.
//!
//! Cost, bounded by two settings ([`ScrubLimits`]): disk reads and one
//! checksum pass at `bytes_per_s` on average (paced per block), and nothing
//! at all during `pause_ms` between passes (the first pass starts
//! `pause_ms` after start-up). A corrupt copy is found within
//! `pause_ms + capacity / bytes_per_s`.

use super::Node;
use crate::base::backend::VerifyOutcome;
use kvtier_client::{BlockKey, NamespaceId};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

/// Keys listed from the index per step.
const PAGE_KEYS: usize = 256;

/// How fast and how often the scrub reads (config `[g3] scrub_bytes_per_s`,
/// `scrub_pause_ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScrubLimits {
    /// Average read rate of a pass, bytes per second (0: no scrub).
    pub bytes_per_s: u64,
    /// Time between the end of a pass and the start of the next, and from
    /// start-up to the first.
    pub pause_ms: u64,
}

impl Default for ScrubLimits {
    /// 16 MiB/s: about 0.5 % of an NVMe's read bandwidth and of one core's
    /// checksum rate; a pass over 1 TiB takes about 18 hours. One hour
    /// between passes.
    fn default() -> Self {
        ScrubLimits {
            bytes_per_s: 16 << 20,
            pause_ms: 3_600_000,
        }
    }
}

/// What the scrub did since start-up.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ScrubFigures {
    /// Passes completed.
    pub passes: u64,
    /// Blocks verified.
    pub blocks: u64,
    /// Bytes read.
    pub bytes: u64,
    /// Copies found corrupt (quarantined).
    pub corrupt: u64,
    /// Of those, replaced by a verified copy from G4 or a peer.
    pub repaired: u64,
}

#[derive(Debug, Default)]
struct Counters {
    passes: AtomicU64,
    blocks: AtomicU64,
    bytes: AtomicU64,
    corrupt: AtomicU64,
    repaired: AtomicU64,
}

/// The scrub thread's handle: stops it on [`Scrubber::stop`] or drop.
#[derive(Debug, Default)]
pub(super) struct Scrubber {
    stop: Arc<(Mutex<bool>, Condvar)>,
    counters: Arc<Counters>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Scrubber {
    /// Starts the thread (none when `limits.bytes_per_s` is 0). It holds
    /// the node weakly.
    pub(super) fn start(&self, node: &Arc<Node>, limits: ScrubLimits) -> std::io::Result<()> {
        if limits.bytes_per_s == 0 {
            return Ok(());
        }
        let (stop, counters, node) = (
            self.stop.clone(),
            self.counters.clone(),
            Arc::downgrade(node),
        );
        let h = std::thread::Builder::new()
            .name("kvtier-g3-scrub".into())
            .spawn(move || run(&node, limits, &stop, &counters))?;
        if let Ok(mut t) = self.thread.lock() {
            *t = Some(h);
        }
        Ok(())
    }

    /// Tells the thread to stop (it finishes the block under way). Does
    /// not wait: the node's `Drop` may run on the scrub thread.
    pub(super) fn close(&self) {
        if let Ok(mut s) = self.stop.0.lock() {
            *s = true;
        }
        self.stop.1.notify_all();
    }

    /// [`Scrubber::close`], then waits for the thread.
    pub(super) fn stop(&self) {
        self.close();
        let h = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(h) = h {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }

    pub(super) fn figures(&self) -> ScrubFigures {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ScrubFigures {
            passes: l(&c.passes),
            blocks: l(&c.blocks),
            bytes: l(&c.bytes),
            corrupt: l(&c.corrupt),
            repaired: l(&c.repaired),
        }
    }
}

/// Waits `d` or until stopped; whether to go on.
fn pause(stop: &(Mutex<bool>, Condvar), d: Duration) -> bool {
    let Ok(g) = stop.0.lock() else {
        return false;
    };
    match stop.1.wait_timeout_while(g, d, |s| !*s) {
        Ok((g, _)) => !*g,
        Err(_) => false,
    }
}

fn run(node: &Weak<Node>, limits: ScrubLimits, stop: &(Mutex<bool>, Condvar), c: &Counters) {
    loop {
        if !pause(stop, Duration::from_millis(limits.pause_ms)) {
            return;
        }
        let Some(namespaces) = node.upgrade().map(|n| n.g3.namespaces()) else {
            return;
        };
        let t = Instant::now();
        let before = c.corrupt.load(Ordering::Relaxed);
        for ns in namespaces {
            let mut after: Option<BlockKey> = None;
            loop {
                let Some(page) = node
                    .upgrade()
                    .map(|n| n.g3.list(&ns, after.as_ref(), PAGE_KEYS))
                else {
                    return;
                };
                let Some(last) = page.last().copied() else {
                    break;
                };
                for key in page {
                    let Some(bytes) = node.upgrade().map(|n| scrub_one(&n, &ns, &key, c)) else {
                        return;
                    };
                    // Paced per block: the average rate stays at the limit.
                    let due = Duration::from_secs_f64(bytes as f64 / limits.bytes_per_s as f64);
                    if !pause(stop, due) {
                        return;
                    }
                }
                after = Some(last);
            }
        }
        c.passes.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            ms = t.elapsed().as_millis() as u64,
            corrupt = c.corrupt.load(Ordering::Relaxed) - before,
            "g3 scrub: pass done"
        );
    }
}

/// Verifies (and repairs) one block; the bytes it read.
fn scrub_one(n: &Node, ns: &NamespaceId, key: &BlockKey, c: &Counters) -> u64 {
    let Some(info) = n.g3.stat(ns, key) else {
        return 0;
    };
    let out = n.verify_repair(ns, key, true);
    c.blocks.fetch_add(1, Ordering::Relaxed);
    c.bytes.fetch_add(info.file_len, Ordering::Relaxed);
    match out {
        Ok(VerifyOutcome::Ok | VerifyOutcome::Absent) => {}
        Ok(VerifyOutcome::Repaired(tier)) => {
            c.corrupt.fetch_add(1, Ordering::Relaxed);
            c.repaired.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%ns, %key, from = tier.name(), "g3 scrub: corrupt copy replaced");
        }
        Ok(VerifyOutcome::Dropped) => {
            c.corrupt.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%ns, %key, "g3 scrub: corrupt copy dropped (no good copy elsewhere)");
        }
        Err(e) => {
            tracing::warn!(%ns, %key, error = %e, "g3 scrub: cannot verify a block");
        }
    }
    info.file_len
}
