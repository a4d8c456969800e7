//! Group commit of the write path's last two steps: the directory fsync
//! that makes a rename durable, and the redb commit of the block's record;
//! and [`FlushWindow`], the group commit of the block data flush before
//! the renames.
//!
//! Writers that renamed their files into place at about the same time
//! share one fsync per touched shard directory and one redb transaction.
//! There is no committer thread: the first writer to arrive while nobody
//! commits becomes the leader, takes everything queued (its own entry
//! included), commits it and hands each participant its result; the
//! others wait. While a leader commits, new arrivals queue up and form the
//! next group, so the group size follows the number of writers in flight.
//!
//! A participant may bring several writes at once (the blocks of one
//! offload request, `G3Store::put_blocks`): they join as one unit and are
//! always committed by the same group.
//!
//! Architecture invariant: a participant returns only after every
//! directory of its writes was fsynced and every record committed by the
//! group that took them (or with that group's error). The queue holds at
//! most one batch per blocked writer, each bounded by the request size, so
//! it is bounded by the writers in flight.

use super::index::Record;
use crate::base::error::Error;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, OnceLock};

/// Why a group failed (every participant gets an error built from it).
#[derive(Debug, Clone)]
pub enum Failure {
    /// A directory fsync failed (the store is poisoned by the leader).
    Dir {
        /// The directory.
        dir: PathBuf,
        /// errno, when the OS gave one.
        errno: Option<i32>,
        /// The message.
        msg: String,
    },
    /// The index commit failed (each participant undoes its renames).
    Index(String),
    /// The index commit met a full filesystem (as [`Failure::Index`]).
    IndexNoSpace,
    /// A lock was poisoned by a panicking thread.
    Lock,
}

impl Failure {
    /// The error a participant reports for each of its writes.
    pub fn to_error(&self, index_path: &std::path::Path) -> Error {
        match self {
            Failure::Dir { dir, errno, msg } => {
                let e = match errno {
                    Some(n) => std::io::Error::from_raw_os_error(*n),
                    None => std::io::Error::other(msg.clone()),
                };
                Error::io("flushing directory", dir, e)
            }
            Failure::Index(d) => Error::Index {
                path: index_path.to_path_buf(),
                detail: d.clone(),
            },
            Failure::IndexNoSpace => Error::NoSpace {
                path: index_path.to_path_buf(),
                op: "committing the index",
            },
            Failure::Lock => super::lock_err("g3 group commit"),
        }
    }
}

type Slot = Arc<OnceLock<std::result::Result<(), Failure>>>;

/// One queued write.
pub struct Pending {
    /// The shard directory the file was renamed into, when its fsync is
    /// due before the ack (`None`: a recycled file, recycle.rs).
    pub dir: Option<PathBuf>,
    /// Index id.
    pub id: u64,
    /// Index record.
    pub rec: Record,
}

#[derive(Default)]
struct State {
    queue: Vec<(Pending, Slot)>,
    busy: bool,
}

/// The group-commit queue.
#[derive(Default)]
pub struct GroupCommit {
    state: Mutex<State>,
    cv: Condvar,
    groups: std::sync::atomic::AtomicU64,
    members: std::sync::atomic::AtomicU64,
}

impl GroupCommit {
    /// Queues the writes `ps` (one participant: they are committed by the
    /// same group) and returns once a group including them committed.
    /// `commit` runs on the leader's thread without the queue lock; it gets
    /// the whole group and returns one result for all of it.
    pub fn join(
        &self,
        ps: Vec<Pending>,
        commit: impl Fn(&[Pending]) -> std::result::Result<(), Failure>,
    ) -> std::result::Result<(), Failure> {
        if ps.is_empty() {
            return Ok(());
        }
        let slot: Slot = Arc::new(OnceLock::new());
        let mut st = self.state.lock().map_err(|_| Failure::Lock)?;
        st.queue.extend(ps.into_iter().map(|p| (p, slot.clone())));
        loop {
            if let Some(r) = slot.get() {
                return r.clone();
            }
            if st.busy {
                st = self.cv.wait(st).map_err(|_| Failure::Lock)?;
                continue;
            }
            st.busy = true;
            let group = std::mem::take(&mut st.queue);
            drop(st);
            let (items, slots): (Vec<Pending>, Vec<Slot>) = group.into_iter().unzip();
            let r = commit(&items);
            self.groups
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.members
                .fetch_add(items.len() as u64, std::sync::atomic::Ordering::Relaxed);
            for s in &slots {
                // A batch has one slot per write: the first set wins, and
                // all of them carry this group's result.
                let _ = s.set(r.clone());
            }
            st = self.state.lock().map_err(|_| Failure::Lock)?;
            st.busy = false;
            self.cv.notify_all();
        }
    }

    /// (groups committed, writes committed in them) since open.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.groups.load(std::sync::atomic::Ordering::Relaxed),
            self.members.load(std::sync::atomic::Ordering::Relaxed),
        )
    }
}

/// Group commit of the block data flush (sync mode `Group`): writers whose
/// files are written join the window and share one flush (`syncfs`).
///
/// Same leader scheme as [`GroupCommit`], without a queue: a flush covers
/// every write that completed before it began, so a writer that joins
/// while a flush is in flight waits for the next one (the one in flight
/// may have started before its write completed). The first waiter to find
/// no flush running leads the next one; everyone who joined before it
/// began shares its result.
///
/// Architecture invariant: `join` returns `Ok` only after a flush that
/// began after the call succeeded. Once a flush failed every later join
/// fails too (the store is poisoned by then; a later syncfs success would
/// not prove the lost writes durable).
#[derive(Default)]
pub struct FlushWindow {
    state: Mutex<WindowState>,
    cv: Condvar,
    joined: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct WindowState {
    /// Flushes begun since open (the number of the one in flight, if any).
    started: u64,
    /// The last flush that ended.
    done: u64,
    busy: bool,
    /// The first failed flush and its error (kind, errno, message).
    failed: Option<(u64, Option<i32>, String)>,
}

impl FlushWindow {
    /// Waits until a flush that began after this call ended, running it
    /// (`flush`) when no other writer does; its result.
    pub fn join(&self, flush: impl FnOnce() -> std::io::Result<()>) -> std::io::Result<()> {
        let lock_err = || std::io::Error::other("g3 flush window: lock poisoned");
        self.joined
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut st = self.state.lock().map_err(|_| lock_err())?;
        // The first flush that begins from now on covers this write.
        let need = st.started + 1;
        let mut flush = Some(flush);
        loop {
            if st.done >= need {
                return match &st.failed {
                    Some((at, errno, msg)) if *at <= st.done => Err(match errno {
                        Some(n) => std::io::Error::from_raw_os_error(*n),
                        None => std::io::Error::other(msg.clone()),
                    }),
                    _ => Ok(()),
                };
            }
            if st.busy {
                st = self.cv.wait(st).map_err(|_| lock_err())?;
                continue;
            }
            // Lead: the one flush this caller may run (a leader's own
            // flush always covers it, so the loop ends above next time).
            let Some(f) = flush.take() else {
                return Err(lock_err());
            };
            st.busy = true;
            st.started += 1;
            let me = st.started;
            drop(st);
            // Ends the flush as failed if `f` unwinds, so that the writers
            // waiting on it get an error rather than wait forever.
            let mut ending = EndFlush {
                w: self,
                me,
                failed: Some((None, "the group data flush panicked".into())),
            };
            let r = f();
            ending.failed = r.as_ref().err().map(|e| (e.raw_os_error(), e.to_string()));
            drop(ending);
            st = self.state.lock().map_err(|_| lock_err())?;
        }
    }

    /// (flushes run, writes that joined) since open.
    pub fn counts(&self) -> (u64, u64) {
        let flushes = self.state.lock().map(|s| s.done).unwrap_or(0);
        (
            flushes,
            self.joined.load(std::sync::atomic::Ordering::Relaxed),
        )
    }
}

/// Records the end of flush `me` (its failure, if any) and wakes the
/// writers waiting on it; on drop, so an unwinding flush ends too.
struct EndFlush<'a> {
    w: &'a FlushWindow,
    me: u64,
    failed: Option<(Option<i32>, String)>,
}

impl Drop for EndFlush<'_> {
    fn drop(&mut self) {
        // A poisoned lock still holds the state: the flush must end.
        let mut st = match self.w.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        st.busy = false;
        st.done = self.me;
        if let Some((errno, msg)) = self.failed.take() {
            st.failed.get_or_insert((self.me, errno, msg));
        }
        self.w.cv.notify_all();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::FlushWindow;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    /// A joiner is never covered by a flush that began before it joined,
    /// and concurrent joiners share flushes.
    #[test]
    fn a_flush_covers_only_writes_done_before_it_began() {
        let w = Arc::new(FlushWindow::default());
        // The count of writes "completed" and, per flush, how many
        // writes had completed when it began.
        let written = Arc::new(AtomicU64::new(0));
        let covered = Arc::new(AtomicU64::new(0));
        let hs: Vec<_> = (0..8)
            .map(|_| {
                let (w, written, covered) = (w.clone(), written.clone(), covered.clone());
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        let mine = written.fetch_add(1, Ordering::SeqCst) + 1;
                        w.join(|| {
                            let n = written.load(Ordering::SeqCst);
                            std::thread::sleep(std::time::Duration::from_micros(200));
                            covered.fetch_max(n, Ordering::SeqCst);
                            Ok(())
                        })
                        .unwrap();
                        // Some flush that began after our write counted it.
                        assert!(covered.load(Ordering::SeqCst) >= mine);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        let (flushes, joined) = w.counts();
        assert_eq!(joined, 400);
        assert!((1..=400).contains(&flushes), "{flushes}");
    }

    /// A flush that panics ends as failed: its waiters get an error, and
    /// so does every later join (none waits forever).
    #[test]
    fn a_panicking_flush_fails_its_waiters() {
        let w = Arc::new(FlushWindow::default());
        let w2 = w.clone();
        let h = std::thread::spawn(move || {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                w2.join(|| panic!("flush panics on purpose"))
            }));
        });
        h.join().unwrap();
        assert!(w.join(|| Ok(())).is_err());
    }

    /// A failed flush fails its joiners and every later one.
    #[test]
    fn a_failed_flush_fails_every_later_join() {
        let w = FlushWindow::default();
        assert!(w.join(|| Ok(())).is_ok());
        let e = w.join(|| Err(std::io::Error::from_raw_os_error(libc::EIO)));
        assert_eq!(e.unwrap_err().raw_os_error(), Some(libc::EIO));
        let e = w.join(|| Ok(()));
        assert_eq!(e.unwrap_err().raw_os_error(), Some(libc::EIO));
    }
}
