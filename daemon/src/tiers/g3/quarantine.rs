//! Blocks that failed verification: moved to `quarantine/` (kept for
//! inspection), counted, logged, dropped from the index, announced as
//! `Removed { Corrupt }`. The directory is bounded (`quarantine_max_bytes`,
//! `quarantine_max_files`, oldest deleted first) and its bytes count
//! against capacity ([`G3Store::block_capacity`]).

use super::{G3Event, G3Store, RemoveReason};
use kvtier_client::{BlockKey, NamespaceId};
use std::path::Path;
use std::sync::atomic::Ordering;

pub(super) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl G3Store {
    /// Moves a block that failed verification to `quarantine/`, counts and
    /// logs it, and emits `Removed { Corrupt }`.
    pub(super) fn quarantine(&self, ns: &NamespaceId, key: &BlockKey, id: u64, why: &str) {
        let path = self.block_file_path(ns, key);
        tracing::warn!(%ns, %key, reason = why, "g3: block failed verification; quarantined");
        let name = format!("{}.{}", ns.to_hex(), key.to_hex());
        // Moved aside and forgotten under the name lock (remove.rs): a put
        // of the same key renames into place only before (the file there
        // answers it present) or after both. A slot: its bytes are copied
        // out (held, read after the index lock is dropped); the slot is
        // punched as the entry leaves.
        let forgotten = self.forget_after(ns, key, id, false, || {
            let held = match self.mem.read() {
                Ok(mem) => mem.get(ns, key).and_then(|(_, e)| self.hold_slot(e)),
                Err(_) => None,
            };
            match held {
                Some(h) => self.quarantine_slot_copy(h, &name),
                None => self.quarantine_file(&path, &name),
            }
        });
        if matches!(forgotten, Ok(true)) {
            self.emit(G3Event::Removed {
                ns: *ns,
                key: *key,
                reason: RemoveReason::Corrupt,
            });
        }
    }

    pub(super) fn quarantine_file(&self, path: &Path, name: &str) {
        self.counters.quarantined.fetch_add(1, Ordering::Relaxed);
        let to = self.quarantine_dir.join(format!("{name}.{}", now_ms()));
        if self.fs.rename(path, &to).is_err() {
            let _ = self.fs.remove_file(path, super::seam::Unlink::Housekeeping);
        }
        self.note_removal(path);
        self.trim_quarantine();
    }

    /// Bytes block files may use: capacity less what `quarantine/` holds
    /// and what the directories under `blocks/` are charged (dir_set.rs).
    ///
    /// A shard directory a removal may have emptied goes with the
    /// reclaimer's next pass (remove.rs `remove_empty_dirs`, within a
    /// second), which a write cannot wait for (it holds the write gate):
    /// it is not charged meanwhile, or an eviction would free its block's
    /// bytes but not its directory's, and room would be made twice.
    pub(super) fn block_capacity(&self) -> u64 {
        let going = self
            .maybe_empty
            .lock()
            .map(|e| e.len() as u64 * super::dir_set::DIR_BYTES)
            .unwrap_or(0);
        let dirs = self.counters.dir_bytes.load(Ordering::Relaxed);
        self.cfg
            .capacity_bytes
            .saturating_sub(self.counters.quarantine_bytes.load(Ordering::Relaxed))
            .saturating_sub(dirs.saturating_sub(going))
    }

    /// Deletes the oldest entries of `quarantine/` until both bounds hold,
    /// and records the bytes left (at open and after every quarantine).
    pub(super) fn trim_quarantine(&self) {
        let Ok(rd) = std::fs::read_dir(&self.quarantine_dir) else {
            return;
        };
        let mut all: Vec<(std::time::SystemTime, std::path::PathBuf, u64, bool)> = rd
            .filter_map(|e| {
                let e = e.ok()?;
                let m = e.metadata().ok()?;
                let t = m.modified().unwrap_or(std::time::UNIX_EPOCH);
                Some((t, e.path(), m.len(), m.is_dir()))
            })
            .collect();
        all.sort();
        let mut bytes: u64 = all.iter().map(|a| a.2).sum();
        let mut files = all.len();
        for (_, p, len, dir) in &all {
            if bytes <= self.cfg.quarantine_bound_bytes() && files <= self.cfg.quarantine_max_files
            {
                break;
            }
            let r = if *dir {
                self.fs.remove_dir_all(p)
            } else {
                self.fs.remove_file(p, super::seam::Unlink::Housekeeping)
            };
            match r {
                Ok(()) => {
                    bytes -= len;
                    files -= 1;
                    self.counters
                        .quarantine_trimmed
                        .fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::warn!(path = %p.display(), error = %e, "g3: cannot trim quarantine");
                }
            }
        }
        self.counters
            .quarantine_bytes
            .store(bytes, Ordering::Relaxed);
    }
}
