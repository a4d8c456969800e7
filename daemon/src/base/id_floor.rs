//! Ids that never go backwards across restarts, even when a node starts
//! with its clock behind the last run's: event ids and the ZMQ publisher's
//! sequence numbers start at the clock (microseconds since the Unix epoch)
//! or at the ceiling the last run recorded, whichever is larger. A run
//! records a ceiling [`STEP`] above its first id, and a new one each time
//! its ids reach the recorded one, so a file write per 16M ids.

use crate::base::error::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// How far above the ids handed out a ceiling is recorded.
pub const STEP: u64 = 1 << 24;

/// The recorded ceiling of one id sequence.
#[derive(Debug)]
pub struct IdFloor {
    path: PathBuf,
    ceiling: AtomicU64,
    writing: Mutex<()>,
}

fn clock_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

impl IdFloor {
    /// Reads the ceiling recorded at `path` (none: 0) and returns the first
    /// id of this run with the floor that keeps the rest above it. A
    /// ceiling that cannot be recorded is logged, never fatal (ids then
    /// start at the clock at the next start, as before).
    pub fn open(path: &Path) -> Result<(IdFloor, u64)> {
        let recorded = match std::fs::read_to_string(path) {
            Ok(s) => s.trim().parse::<u64>().map_err(|_| Error::InvalidInput {
                what: "id ceiling file",
                reason: format!("{} does not hold a number", path.display()),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(Error::io("reading", path, e)),
        };
        let first = clock_us().max(recorded);
        let floor = IdFloor {
            path: path.to_path_buf(),
            ceiling: AtomicU64::new(first),
            writing: Mutex::new(()),
        };
        floor.reach(first);
        Ok((floor, first))
    }

    /// Records a new ceiling when `id` reached the recorded one.
    pub fn reach(&self, id: u64) {
        if id < self.ceiling.load(Ordering::Acquire) {
            return;
        }
        let Ok(_w) = self.writing.lock() else { return };
        if id < self.ceiling.load(Ordering::Acquire) {
            return;
        }
        let next = id.saturating_add(STEP);
        match self.record(next) {
            Ok(()) => self.ceiling.store(next, Ordering::Release),
            Err(e) => {
                // Tried again at the next id rather than never.
                tracing::warn!(path = %self.path.display(), error = %e,
                    "cannot record the id ceiling; ids may go back after a restart with the clock behind");
            }
        }
    }

    fn record(&self, ceiling: u64) -> std::io::Result<()> {
        let tmp = self.path.with_extension("tmp");
        {
            let mut f = std::fs::File::create(&tmp)?;
            writeln!(f, "{ceiling}")?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &self.path)?;
        if let Some(d) = self.path.parent() {
            std::fs::File::open(d)?.sync_all()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_start_above_the_last_runs_with_the_clock_behind() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ids");
        let (f, first) = IdFloor::open(&p).unwrap();
        // The last run handed out ids far ahead of this clock (it ran with
        // its clock an hour ahead, or published millions of events).
        let last = first + 3600 * 1_000_000;
        for id in [first + 1, first + STEP, last] {
            f.reach(id);
        }
        drop(f);
        let (_, again) = IdFloor::open(&p).unwrap();
        assert!(again > last, "{again} <= {last}");
    }
}
