//! Group commit of the write path's last two steps: the directory fsync
//! that makes a rename durable, and the redb commit of the block's record.
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
use crate::error::Error;
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
