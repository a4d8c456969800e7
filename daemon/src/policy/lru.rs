//! Exact LRU: the baseline every other policy is measured against.

use super::{BlockMeta, EvictionPolicy};
use std::collections::{BTreeMap, HashMap};

/// Least recently used first. O(log n) per operation.
#[derive(Debug, Default)]
pub struct Lru {
    clock: u64,
    stamp: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
}

impl Lru {
    /// An empty LRU.
    pub fn new() -> Self {
        Self::default()
    }

    fn touch(&mut self, id: u64) {
        self.clock += 1;
        if let Some(old) = self.stamp.insert(id, self.clock) {
            self.order.remove(&old);
        }
        self.order.insert(self.clock, id);
    }
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn on_insert(&mut self, id: u64, _meta: BlockMeta) {
        self.touch(id);
    }
    fn on_access(&mut self, id: u64) {
        if self.stamp.contains_key(&id) {
            self.touch(id);
        }
    }
    fn on_remove(&mut self, id: u64) {
        if let Some(s) = self.stamp.remove(&id) {
            self.order.remove(&s);
        }
    }
    fn victim(&mut self, can_evict: &mut dyn FnMut(u64) -> bool) -> Option<u64> {
        self.order.values().copied().find(|&id| can_evict(id))
    }
    fn len(&self) -> usize {
        self.stamp.len()
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
}
