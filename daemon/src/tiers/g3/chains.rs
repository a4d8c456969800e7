//! The chain links of the held blocks: which held block is whose parent.
//!
//! Why G3 keeps them itself rather than leave them to the policy: the
//! leaves-first rule (a child is worthless without its parent, so a parent
//! never goes while a child of it is held) must hold for every policy
//! (`lru` too) and every path that removes a block, and a forced removal
//! (delete, `kvtier evict`, corruption) must find the descendants that
//! become unreachable with it. The policy still gets the parent at insert
//! for its own scoring; eviction asks it only for blocks this module calls
//! leaves (reclaimer.rs).
//!
//! Kept inside [`super::index::MemIndex`], under its lock, in step with the
//! map: a link exists only while its child is held. Memory: a parent-map
//! slot (16 bytes) and a (parent, child) key of the ordered set (16 bytes
//! plus B-tree slack) per held block that has a parent; roots cost nothing.

use super::index::IdHasher;
use std::collections::{BTreeSet, HashMap};
use std::hash::BuildHasherDefault;

/// Links between held blocks (ids are the index's digests).
#[derive(Debug, Default)]
pub struct Chains {
    /// Held child -> its parent (held: a child is stored only after its
    /// parent, and removed before it or with it).
    parent_of: HashMap<u64, u64, BuildHasherDefault<IdHasher>>,
    /// (parent, child) for every link: a block's children are a range.
    children: BTreeSet<(u64, u64)>,
}

impl Chains {
    /// Records that held `child` continues held `parent`.
    pub fn link(&mut self, child: u64, parent: u64) {
        if child == parent {
            return;
        }
        if let Some(old) = self.parent_of.insert(child, parent) {
            self.children.remove(&(old, child));
        }
        self.children.insert((parent, child));
    }

    /// Forgets a block that left: its own link. Links of its children stay
    /// until they leave too (the caller removes them with it).
    pub fn unlink(&mut self, id: u64) {
        if let Some(p) = self.parent_of.remove(&id) {
            self.children.remove(&(p, id));
        }
    }

    /// The parent of a held block, if it has one.
    pub fn parent(&self, id: u64) -> Option<u64> {
        self.parent_of.get(&id).copied()
    }

    /// Whether a held block continues in a held child (then it is not an
    /// eviction candidate).
    pub fn has_children(&self, id: u64) -> bool {
        self.children
            .range((id, 0)..=(id, u64::MAX))
            .next()
            .is_some()
    }

    /// Every descendant of `id`, children after their own descendants
    /// (removing them in this order keeps every intermediate state
    /// leaves-first). At most `max` (a bound on one removal's work).
    pub fn descendants(&self, id: u64, max: usize) -> Vec<u64> {
        let mut out = Vec::new();
        let mut stack = vec![id];
        while let Some(p) = stack.pop() {
            for &(_, c) in self.children.range((p, 0)..=(p, u64::MAX)) {
                if out.len() >= max {
                    break;
                }
                out.push(c);
                stack.push(c);
            }
        }
        // Pre-order has every parent before its children: reversed, every
        // child comes before its parent.
        out.reverse();
        out
    }

    /// Links recorded (blocks with a parent).
    pub fn len(&self) -> usize {
        self.parent_of.len()
    }

    /// Whether no link is recorded.
    pub fn is_empty(&self) -> bool {
        self.parent_of.is_empty()
    }

    /// Every (child, parent) link (snapshots, tests).
    pub fn links(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.parent_of.iter().map(|(&c, &p)| (c, p))
    }
}

/// Recovery: links the held blocks of `links` ((child, parent) pairs,
/// from redb records or the snapshot) into `mem`'s chains. Returns the held
/// blocks whose parent is not held (its file was lost or removed while the
/// daemon was down): unreachable, for the caller to remove.
pub fn link_recovered(mem: &mut super::index::MemIndex, links: &[(u64, u64)]) -> Vec<u64> {
    let mut unreachable = Vec::new();
    for &(child, parent) in links {
        if !mem.map.contains_key(&child) {
            continue;
        }
        if mem.map.contains_key(&parent) {
            mem.chains.link(child, parent);
        } else {
            unreachable.push(child);
        }
    }
    unreachable
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descendants_come_children_first_and_unlink_forgets() {
        let mut c = Chains::default();
        // 1 -> 2 -> 3, 2 -> 4.
        c.link(2, 1);
        c.link(3, 2);
        c.link(4, 2);
        assert!(c.has_children(1) && c.has_children(2) && !c.has_children(3));
        let d = c.descendants(1, 100);
        assert_eq!(d.len(), 3);
        let pos = |x| d.iter().position(|&y| y == x).unwrap();
        assert!(pos(3) < pos(2) && pos(4) < pos(2));
        c.unlink(3);
        c.unlink(4);
        assert!(!c.has_children(2));
        assert_eq!(c.parent(2), Some(1));
        assert_eq!(c.descendants(1, 100), vec![2]);
    }
}
