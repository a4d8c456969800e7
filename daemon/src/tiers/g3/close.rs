//! Shutdown: `close` waits for writes in flight, stops the reclaimer,
//! makes the index durable, writes the snapshot and the clean marker
//! (what lets the next open skip the walk, see [`super::recover`]); `Drop`
//! without `close` only flushes the index.

use super::index::{self, Record};
use super::{lock_err, snapshot, G3Store};
use crate::base::error::{Error, Result};
use std::sync::atomic::Ordering;

impl G3Store {
    /// Stops the reclaimer, writes hits and last access to the index, makes
    /// it durable and writes the clean-shutdown marker (the next open then
    /// loads the index without walking the files, see [`recover`]). Writes
    /// are refused afterwards; reads still work.
    pub fn close(&self) -> Result<()> {
        self.closed.store(true, Ordering::Release);
        // Waits for writes in flight (they passed the closed check).
        drop(
            self.write_gate
                .write()
                .map_err(|_| lock_err("g3 write gate"))?,
        );
        self.reclaim.stop();
        let handle = self.reclaimer.lock().ok().and_then(|mut h| h.take());
        if let Some(h) = handle {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        let mut recs = Vec::new();
        let mut names = Vec::new();
        {
            let mem = self.mem.read().map_err(|_| lock_err("g3 index"))?;
            self.disk.for_each(|id, mut r| {
                if let Some(e) = mem.map.get(&id) {
                    index::merge_stats(&mut r, e);
                    names.push((r.ns, id));
                    recs.push((id, r));
                }
            })?;
        }
        for batch in recs.chunks(10_000) {
            let refs: Vec<(u64, &Record)> = batch.iter().map(|(i, r)| (*i, r)).collect();
            self.disk.put(&refs)?;
        }
        self.disk.flush()?;
        self.sync_removals()?;
        self.sync_slabs()?;
        {
            // The in-memory image the next clean open loads instead of
            // iterating redb (snapshot.rs); made visible by the marker's
            // directory fsync below.
            let mem = self.mem.read().map_err(|_| lock_err("g3 index"))?;
            let generation = self.disk.generation()?;
            snapshot::write(self.fs.as_ref(), &self.cfg.root, generation, &names, &mem)
                .map_err(|e| Error::io("writing index snapshot", &self.cfg.root, e))?;
        }
        // Only now is the index a complete, durable account of the files:
        // the next open may trust it instead of walking (recover.rs).
        self.write_clean_marker()
    }
}

impl Drop for G3Store {
    fn drop(&mut self) {
        self.reclaim.stop();
        if !self.closed.load(Ordering::Acquire) {
            let _ = self.disk.flush();
        }
    }
}
