//! The read step of one onboard request. G3's slotted blocks of the
//! request are read first, together, on the connection's thread
//! ([`Backend::read_many_for_verifier`]: one batch of ring requests, no
//! thread and no ring per block); the rest (blocks with a file of their
//! own, misses that go to the peers or G4, anything the batch left) at
//! once, up to `onboard_reads_in_flight_max` concurrent [`Backend`] calls
//! (and at most [`READER_THREADS_MAX`] reader threads daemon-wide), so the
//! disk sees every block of the request together instead of one block
//! after another.
//!
//! Only the reads overlap. Leases, limits and the reply stay in request
//! order in the connection ([`super::conn`]), and so do the eviction
//! policy's touches (access_order.rs); a missing block is a miss for that
//! item alone and never touches the others' outcomes. Both paths leave the
//! payload's checksum to the client, which verifies every byte it
//! receives and reports a mismatch (kvtier-client's onboard; the daemon
//! re-verifies the report in its own memory before it quarantines).
//! Helper threads are pooled (crate::base::workers, started once and
//! kept, not per request).

use crate::base::backend::{Backend, ReadFile, ReadTouch};
use crate::base::error::{Error, Result};
use crate::base::tier::Lookup;
use crate::tiers::g3::access_order::{touch_in_turn, AccessOrder};
use kvtier_client::{BlockHeader, BlockKey, NamespaceId, Tier};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Reader threads running for onboards at once, all connections together
/// (each request's connection thread reads too and is not counted). The
/// disk sees at most the G3 ring pool (`io_depth`) anyway; this keeps many
/// connections from starting `onboard_reads_in_flight_max` threads each.
pub(super) const READER_THREADS_MAX: usize = 64;

static READERS: AtomicUsize = AtomicUsize::new(0);

/// Reader threads taken from the shared budget, given back on drop (a
/// panicking read included).
struct Reserved(usize);

impl Reserved {
    /// Up to `want` threads, as many as the budget has left.
    fn take(want: usize) -> Reserved {
        let mut got = 0;
        let _ = READERS.fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
            got = want.min(READER_THREADS_MAX.saturating_sub(now));
            Some(now + got)
        });
        Reserved(got)
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        READERS.fetch_sub(self.0, Ordering::AcqRel);
    }
}

/// One block to read.
pub(super) enum ReadJob<'a> {
    /// Into the client's shared region (`dst`: header, then payload).
    Shm {
        /// The block.
        key: BlockKey,
        /// Where in the region.
        dst: &'a mut [u8],
    },
    /// Opened for the client to read itself (fd passing).
    Fd {
        /// The block.
        key: BlockKey,
    },
}

/// What one read gave: the header, the tier, the header's offset in the
/// passed file, and the file (fd mode only).
pub(super) type Got = Result<Lookup<(BlockHeader, Tier, u64, Option<std::fs::File>)>>;

fn read_one(b: &dyn Backend, ns: &NamespaceId, job: ReadJob<'_>) -> Got {
    match job {
        ReadJob::Shm { key, dst } => b.read_into_for_verifier(ns, &key, dst).map(|l| match l {
            Lookup::Hit((h, t)) => Lookup::Hit((h, t, 0, None)),
            Lookup::Miss(x) => Lookup::Miss(x),
        }),
        ReadJob::Fd { key } => b.open_for_read(ns, &key).map(|l| match l {
            Lookup::Hit(ReadFile {
                file,
                offset,
                header,
                tier,
            }) => Lookup::Hit((header, tier, offset, Some(file))),
            Lookup::Miss(x) => Lookup::Miss(x),
        }),
    }
}

/// A job of [`read_all`]: read by the batch already (its outcome and its
/// policy touch, run in request order), or still to read.
enum Work<'a> {
    Done(Got, ReadTouch),
    Read(ReadJob<'a>),
}

/// Runs `jobs`: first (when `batch`) the blocks the backend reads together
/// on this thread ([`Backend::read_many_for_verifier`]: G3's slotted hits,
/// one batch of ring requests), then the rest with at most `in_flight_max` at once
/// (this thread is one of them); one outcome per job, in input order,
/// policy touches in input order too.
pub(super) fn read_all(
    b: &dyn Backend,
    ns: &NamespaceId,
    mut jobs: Vec<ReadJob<'_>>,
    in_flight_max: usize,
    batch: bool,
) -> Vec<Got> {
    let n = jobs.len();
    let batch = {
        let mut at = Vec::new();
        let mut items: Vec<(BlockKey, &mut [u8])> = Vec::new();
        for (i, j) in jobs.iter_mut().enumerate() {
            if let ReadJob::Shm { key, dst } = j {
                at.push(i);
                items.push((*key, &mut **dst));
            }
        }
        let mut got: Vec<Option<(BlockHeader, Tier, ReadTouch)>> = (0..n).map(|_| None).collect();
        // `in_flight_max` 1 reads one block after another (the setting's
        // promise); a lone block has nothing to batch with.
        if batch && items.len() > 1 && in_flight_max > 1 {
            for (i, g) in at.into_iter().zip(b.read_many_for_verifier(ns, &mut items)) {
                got[i] = g;
            }
        }
        got
    };
    let work: Vec<Work<'_>> = jobs
        .into_iter()
        .zip(batch)
        .map(|(j, g)| match g {
            Some((h, t, touch)) => Work::Done(Ok(Lookup::Hit((h, t, 0, None))), touch),
            None => Work::Read(j),
        })
        .collect();
    let left = work.iter().filter(|w| matches!(w, Work::Read(_))).count();
    let run = |w: Work<'_>| match w {
        Work::Done(g, touch) => {
            touch_in_turn(touch);
            g
        }
        Work::Read(j) => read_one(b, ns, j),
    };
    let reserved = Reserved::take(in_flight_max.min(left).saturating_sub(1));
    let extra = reserved.0;
    if extra == 0 {
        return work.into_iter().map(run).collect();
    }
    // Jobs are taken in order, so the earliest unfinished one is always
    // running: waiting for the earlier touches cannot deadlock.
    let order = AccessOrder::new(n);
    let queue = Mutex::new(work.into_iter().enumerate());
    let take = || queue.lock().ok().and_then(|mut q| q.next());
    let results = Mutex::new(Vec::with_capacity(n));
    // Each copy (this thread and pooled helpers, workers.rs) takes jobs
    // until none is left.
    let worker = || {
        let mut done = Vec::new();
        while let Some((i, w)) = take() {
            done.push((i, order.run(i, || run(w))));
        }
        if let Ok(mut r) = results.lock() {
            r.extend(done);
        }
    };
    if crate::base::workers::fan_out(extra, &worker) > 0 {
        tracing::error!("an onboard reader panicked");
    }
    let mut slots: Vec<Option<Got>> = (0..n).map(|_| None).collect();
    for (i, g) in results.into_inner().unwrap_or_default() {
        if let Some(s) = slots.get_mut(i) {
            *s = Some(g);
        }
    }
    drop(reserved);
    // A job a panicked thread took has no outcome: an error for that item.
    slots
        .into_iter()
        .map(|s| {
            s.unwrap_or_else(|| {
                Err(Error::io(
                    "reading",
                    "an onboard block",
                    std::io::Error::other("its reader panicked"),
                ))
            })
        })
        .collect()
}

/// The region ranges of the reads gathered so far, so that an item whose
/// destination overlaps an earlier one's is read after it (as it was when
/// items were read one by one: the later one's bytes win), never at the
/// same time.
#[derive(Debug, Default)]
pub(super) struct Ranges(BTreeMap<u64, u64>);

impl Ranges {
    /// Whether `[at, at + len)` overlaps a range already added.
    pub(super) fn overlaps(&self, at: u64, len: u64) -> bool {
        let end = at.saturating_add(len);
        if let Some((_, e)) = self.0.range(..=at).next_back() {
            if *e > at {
                return true;
            }
        }
        self.0.range(at..end).next().is_some()
    }

    /// Adds `[at, at + len)` (the longest range starting at `at` is kept).
    pub(super) fn add(&mut self, at: u64, len: u64) {
        let end = at.saturating_add(len);
        let e = self.0.entry(at).or_insert(end);
        *e = (*e).max(end);
    }

    /// Forgets every range (the reads were run).
    pub(super) fn clear(&mut self) {
        self.0.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::Ranges;

    #[test]
    fn the_reader_budget_is_shared_and_given_back() {
        use super::{Reserved, READER_THREADS_MAX};
        // Nothing else in this (unit test) binary onboards through a
        // server, so the budget is this test's alone.
        let a = Reserved::take(READER_THREADS_MAX - 2);
        assert_eq!(a.0, READER_THREADS_MAX - 2);
        let b = Reserved::take(16);
        assert_eq!(b.0, 2, "only what is left");
        assert_eq!(Reserved::take(1).0, 0, "none past the budget");
        drop(a);
        let c = Reserved::take(16);
        assert_eq!(c.0, 16, "a dropped reservation was given back");
    }

    #[test]
    fn ranges_find_every_overlap_and_only_those() {
        let mut r = Ranges::default();
        r.add(4096, 4096);
        r.add(16384, 8192);
        assert!(!r.overlaps(0, 4096), "ends where the first starts");
        assert!(!r.overlaps(8192, 8192), "between the two");
        assert!(r.overlaps(0, 4097));
        assert!(r.overlaps(8191, 2));
        assert!(r.overlaps(20000, 1), "inside the second");
        assert!(r.overlaps(0, 1 << 20), "covers both");
        assert!(!r.overlaps(24576, 4096), "after the second");
        r.clear();
        assert!(!r.overlaps(0, 1 << 20));
    }
}
