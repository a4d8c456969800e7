//! The directories G3 made under `blocks/` (a namespace's and its
//! shards'), kept so that a put knows its directory exists without a
//! syscall, and so that each one counts against `g3.capacity` (issue 42:
//! 20,000 namespaces left 226 MiB of directories on a 64 MiB G3). A
//! directory costs the filesystem at least one block: [`DIR_BYTES`] each.

use super::G3Store;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

/// What one directory is charged against capacity: an ext4 (or xfs)
/// directory's first block. Growth past it (about 50 block names per
/// 4 KiB) is under 0.2% of the blocks it names at 4 MiB and up, which is
/// where blocks have files of their own (smaller ones live in slabs).
pub(super) const DIR_BYTES: u64 = 4096;

/// Shard directories `blocks/<ns>/<shard>` known to exist, and per
/// namespace directory how many of its shards are known.
#[derive(Default)]
pub(super) struct DirSet {
    shards: HashSet<PathBuf>,
    per_ns: HashMap<PathBuf, usize>,
}

impl DirSet {
    pub(super) fn contains(&self, shard: &Path) -> bool {
        self.shards.contains(shard)
    }

    /// Records a shard directory (and its namespace directory).
    pub(super) fn insert(&mut self, shard: PathBuf) {
        if let Some(ns) = shard.parent() {
            if !self.shards.contains(&shard) {
                *self.per_ns.entry(ns.to_path_buf()).or_default() += 1;
            }
        }
        self.shards.insert(shard);
    }

    /// Forgets a removed shard directory; its namespace directory with
    /// the last of its shards (removed with it, remove.rs).
    pub(super) fn remove(&mut self, shard: &Path) {
        if !self.shards.remove(shard) {
            return;
        }
        if let Some(ns) = shard.parent() {
            if let Some(n) = self.per_ns.get_mut(ns) {
                *n -= 1;
                if *n == 0 {
                    self.per_ns.remove(ns);
                }
            }
        }
    }

    /// Bytes charged against capacity for the directories known.
    pub(super) fn bytes(&self) -> u64 {
        (self.shards.len() + self.per_ns.len()) as u64 * DIR_BYTES
    }
}

impl G3Store {
    /// Changes the set of known directories and what they are charged
    /// (`counters.dir_bytes`, read by `block_capacity`). `None`: the lock
    /// was poisoned.
    pub(super) fn with_dirs<R>(&self, f: impl FnOnce(&mut DirSet) -> R) -> Option<R> {
        let mut d = self.known_dirs.lock().ok()?;
        let r = f(&mut d);
        self.counters.dir_bytes.store(d.bytes(), Ordering::Relaxed);
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_counts_once_and_goes_with_its_last_shard() {
        let mut d = DirSet::default();
        d.insert("/g3/blocks/a/00".into());
        d.insert("/g3/blocks/a/01".into());
        d.insert("/g3/blocks/a/01".into());
        d.insert("/g3/blocks/b/00".into());
        assert_eq!(d.bytes(), 5 * DIR_BYTES);
        d.remove(Path::new("/g3/blocks/a/00"));
        d.remove(Path::new("/g3/blocks/a/00"));
        assert_eq!(d.bytes(), 4 * DIR_BYTES);
        d.remove(Path::new("/g3/blocks/a/01"));
        assert_eq!(d.bytes(), 2 * DIR_BYTES);
        assert!(d.contains(Path::new("/g3/blocks/b/00")));
    }
}
