//! Belady's offline optimum (evict the block used farthest in the future):
//! the reference bound for `kvtier bench replay`. Replay only: it needs the
//! whole trace in advance.

use super::trace::Trace;
use super::{BlockMeta, EvictionPolicy};
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The replay's position (index of the request being served), shared with
/// [`Belady`] so that it knows "now" without a change to the policy trait.
#[derive(Debug, Clone, Default)]
pub struct ReplayClock(Arc<AtomicU64>);

impl ReplayClock {
    /// Sets the index of the request now being replayed.
    pub fn set(&self, request_index: u64) {
        self.0.store(request_index, Ordering::Relaxed);
    }
    /// The index of the request now being replayed.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

const NEVER: u64 = u64::MAX;

/// Offline optimal eviction over a known trace.
#[derive(Debug)]
pub struct Belady {
    clock: ReplayClock,
    /// Request indices at which each id is used, ascending.
    uses: HashMap<u64, Vec<u64>>,
    /// Tracked ids: (next use as last computed, depth in its chain).
    tracked: HashMap<u64, (u64, u32)>,
    /// Max-heap of (next use, depth, id); entries go stale and are
    /// refreshed lazily (a stale next use is never later than the true one).
    heap: BinaryHeap<(u64, u32, u64)>,
}

impl Belady {
    /// A policy that knows `trace`'s future; the replay must advance `clock`.
    pub fn new(trace: &Trace, clock: ReplayClock) -> Self {
        let mut uses: HashMap<u64, Vec<u64>> = HashMap::new();
        for (i, r) in trace.requests.iter().enumerate() {
            for &id in &r.hash_ids {
                let v = uses.entry(id).or_default();
                if v.last() != Some(&(i as u64)) {
                    v.push(i as u64);
                }
            }
        }
        Self {
            clock,
            uses,
            tracked: HashMap::new(),
            heap: BinaryHeap::new(),
        }
    }

    fn next_use(&self, id: u64) -> u64 {
        let now = self.clock.get();
        self.uses
            .get(&id)
            .and_then(|v| {
                let i = v.partition_point(|&t| t <= now);
                v.get(i).copied()
            })
            .unwrap_or(NEVER)
    }

    fn touch(&mut self, id: u64) {
        let next = self.next_use(id);
        if let Some(t) = self.tracked.get_mut(&id) {
            t.0 = next;
            self.heap.push((next, t.1, id));
        }
    }
}

impl EvictionPolicy for Belady {
    fn name(&self) -> &'static str {
        "belady"
    }
    fn on_insert(&mut self, id: u64, meta: BlockMeta) {
        let depth = meta
            .parent
            .and_then(|p| self.tracked.get(&p))
            .map_or(0, |t| t.1 + 1);
        self.tracked.entry(id).or_insert((0, depth));
        self.touch(id);
    }
    fn on_access(&mut self, id: u64) {
        self.touch(id);
    }
    fn on_remove(&mut self, id: u64) {
        self.tracked.remove(&id);
    }
    fn victim(&mut self, can_evict: &mut dyn FnMut(u64) -> bool) -> Option<u64> {
        let mut refused = Vec::new();
        let mut found = None;
        while let Some((next, depth, id)) = self.heap.pop() {
            match self.tracked.get(&id) {
                Some(&(stored, _)) if stored == next => {}
                _ => continue, // stale duplicate
            }
            let actual = self.next_use(id);
            if actual != next {
                if let Some(t) = self.tracked.get_mut(&id) {
                    t.0 = actual;
                }
                self.heap.push((actual, depth, id));
                continue;
            }
            refused.push((next, depth, id));
            if can_evict(id) {
                found = Some(id);
                break;
            }
        }
        // Keep every examined entry: the policy forgets only on `on_remove`.
        self.heap.extend(refused);
        found
    }
    fn len(&self) -> usize {
        self.tracked.len()
    }
}
