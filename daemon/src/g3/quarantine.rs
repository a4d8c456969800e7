//! Blocks that failed verification: moved to `quarantine/` (kept for
//! inspection), counted, logged, dropped from the index, announced as
//! `Removed { Corrupt }`.

use super::{G3Event, G3Store, RemoveReason};
use kvtier_client::{BlockKey, NamespaceId};
use std::path::Path;
use std::sync::atomic::Ordering;

fn now_ms() -> u64 {
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
        self.quarantine_file(&path, &format!("{}.{}", ns.to_hex(), key.to_hex()));
        if matches!(self.forget(ns, key, id), Ok(true)) {
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
        if std::fs::rename(path, &to).is_err() {
            let _ = std::fs::remove_file(path);
        }
    }
}
