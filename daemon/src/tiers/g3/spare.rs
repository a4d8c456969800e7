//! What eviction must not take now, beyond leases, pins and parents of
//! held blocks (chains.rs):
//!
//! - **A batch's parents**, from its plan until its blocks are published:
//!   `make_room` for a batch used to evict the very block the batch
//!   continues (the only leaf of a full single chain), so the batch's
//!   blocks arrived with their parent gone. Hard: no pass takes them.
//! - **Open tails**: the last block of each recent batch, for
//!   [`TAIL_GRACE`] by default (`g3.open_tail_grace_ms`). It is a leaf only because the rest of its request has
//!   not arrived yet; the background pass evicting it cut the chain under
//!   the next batch. Soft: the background pass never takes one, a pass that
//!   must make room now (`make_room`, a full filesystem) takes one only
//!   when nothing else may go.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long the last block of a batch stays an open tail by default
/// (`g3.open_tail_grace_ms`): longer than the gap between two batches of
/// one request on a loaded node.
pub(crate) const TAIL_GRACE: Duration = Duration::from_secs(10);
/// Most open tails remembered (the oldest is forgotten first).
const TAILS_MAX: usize = 1024;

#[derive(Debug, Default)]
pub(super) struct Spare {
    /// Parent id -> batches in flight that continue it.
    parents: Mutex<HashMap<u64, u32>>,
    tails: Mutex<VecDeque<(u64, Instant)>>,
    /// How long a tail stays open (zero: tails are never kept).
    grace: Duration,
}

/// The ids a pass must spare, copied once per pass.
#[derive(Debug, Default)]
pub(super) struct Spared {
    pub(super) parents: HashSet<u64>,
    pub(super) tails: HashSet<u64>,
}

/// Releases a batch's parents when dropped.
pub(super) struct ParentsGuard<'a> {
    spare: &'a Spare,
    ids: Vec<u64>,
}

impl Drop for ParentsGuard<'_> {
    fn drop(&mut self) {
        if let Ok(mut p) = self.spare.parents.lock() {
            for id in &self.ids {
                if let Some(n) = p.get_mut(id) {
                    *n -= 1;
                    if *n == 0 {
                        p.remove(id);
                    }
                }
            }
        }
    }
}

impl Spare {
    /// Open tails kept for `grace`.
    pub(super) fn with_grace(grace: Duration) -> Self {
        Spare {
            grace,
            ..Spare::default()
        }
    }

    /// Spares `ids` (a batch's parents) until the guard drops.
    pub(super) fn hold_parents(&self, mut ids: Vec<u64>) -> ParentsGuard<'_> {
        ids.sort_unstable();
        ids.dedup();
        if let Ok(mut p) = self.parents.lock() {
            for id in &ids {
                *p.entry(*id).or_default() += 1;
            }
        }
        ParentsGuard { spare: self, ids }
    }

    /// `id` was the last block of a batch: an open tail for a while.
    pub(super) fn open_tail(&self, id: u64) {
        if self.grace.is_zero() {
            return;
        }
        if let Ok(mut t) = self.tails.lock() {
            if t.len() >= TAILS_MAX {
                t.pop_front();
            }
            t.push_back((id, Instant::now()));
        }
    }

    /// The ids to spare now (expired tails are forgotten).
    pub(super) fn now(&self) -> Spared {
        let mut s = Spared::default();
        if let Ok(p) = self.parents.lock() {
            s.parents.extend(p.keys());
        }
        if let Ok(mut t) = self.tails.lock() {
            while t.front().is_some_and(|(_, at)| at.elapsed() >= self.grace) {
                t.pop_front();
            }
            s.tails.extend(t.iter().map(|(id, _)| *id));
        }
        s
    }
}
