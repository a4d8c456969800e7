//! LRU over leaves: the baseline every other policy is measured against.
//!
//! Least recently used first, among blocks with no tracked child: a child
//! is worthless without its parent, so a parent never goes before its
//! children (the tier enforces it for every policy, chains.rs; listing only
//! leaves keeps `victim` from scanning past every parent). The daemon's
//! `lru` is [`Lru::leaves_first`]; [`Lru::new`] ignores parent links (exact
//! LRU, the baseline of `kvtier bench replay` and docs/BENCHMARKS.md).

use super::{BlockMeta, EvictionPolicy};
use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone, Copy)]
struct Entry {
    stamp: u64,
    /// When inserted: a child's link names its parent's insertion, so a
    /// parent removed by force and stored again is not miscounted.
    born: u64,
    /// (parent id, parent's `born`).
    parent: Option<(u64, u64)>,
    children: u32,
}

/// Least recently used leaf first. O(log n) per operation.
#[derive(Debug, Default)]
pub struct Lru {
    clock: u64,
    entries: HashMap<u64, Entry>,
    /// Leaves by last touch.
    order: BTreeMap<u64, u64>,
    /// Parent links are tracked (else every block is a leaf).
    leaves_first: bool,
}

impl Lru {
    /// An empty exact LRU (parent links ignored).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty LRU over leaves: the least recently used block with no
    /// tracked child first (the daemon's `lru`).
    pub fn leaves_first() -> Self {
        Self {
            leaves_first: true,
            ..Self::default()
        }
    }

    fn touch(&mut self, id: u64) {
        self.clock += 1;
        let clock = self.clock;
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        let old = std::mem::replace(&mut e.stamp, clock);
        if e.children == 0 {
            self.order.remove(&old);
            self.order.insert(clock, id);
        }
    }
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn on_insert(&mut self, id: u64, meta: BlockMeta) {
        if self.entries.contains_key(&id) {
            self.touch(id);
            return;
        }
        self.clock += 1;
        let parent = meta.parent.filter(|_| self.leaves_first).and_then(|p| {
            let pe = self.entries.get_mut(&p)?;
            if pe.children == 0 {
                self.order.remove(&pe.stamp);
            }
            pe.children += 1;
            Some((p, pe.born))
        });
        self.entries.insert(
            id,
            Entry {
                stamp: self.clock,
                born: self.clock,
                parent,
                children: 0,
            },
        );
        self.order.insert(self.clock, id);
    }
    fn on_access(&mut self, id: u64) {
        self.touch(id);
    }
    fn on_remove(&mut self, id: u64) {
        let Some(e) = self.entries.remove(&id) else {
            return;
        };
        if e.children == 0 {
            self.order.remove(&e.stamp);
        }
        if let Some((p, born)) = e.parent {
            if let Some(pe) = self.entries.get_mut(&p).filter(|pe| pe.born == born) {
                pe.children = pe.children.saturating_sub(1);
                if pe.children == 0 {
                    self.order.insert(pe.stamp, p);
                }
            }
        }
    }
    fn victim(&mut self, can_evict: &mut dyn FnMut(u64) -> bool) -> Option<u64> {
        self.order.values().copied().find(|&id| can_evict(id))
    }
    fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recent_and_skips_refused() {
        let mut l = Lru::new();
        for i in 0..3 {
            l.on_insert(i, BlockMeta::default());
        }
        l.on_access(0);
        assert_eq!(l.victim(&mut |_| true), Some(1));
        assert_eq!(l.victim(&mut |id| id != 1), Some(2));
        l.on_remove(1);
        assert_eq!(l.len(), 2);
    }

    #[test]
    fn parents_wait_for_their_children() {
        let mut l = Lru::leaves_first();
        let meta = |parent| BlockMeta {
            parent,
            ..BlockMeta::default()
        };
        l.on_insert(1, meta(None));
        l.on_insert(2, meta(Some(1)));
        l.on_insert(3, meta(Some(2)));
        // The root is the least recent block, but it has a child.
        assert_eq!(l.victim(&mut |_| true), Some(3));
        l.on_remove(3);
        assert_eq!(l.victim(&mut |_| true), Some(2));
        // A parent removed by force and stored again: its old child's
        // departure does not count against the new one.
        l.on_remove(1);
        l.on_insert(1, meta(None));
        l.on_insert(4, meta(Some(1)));
        l.on_remove(2);
        assert_eq!(l.victim(&mut |id| id != 4), None);
    }
}
