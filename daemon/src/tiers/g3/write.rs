//! The offload (write) path: `put_block` / `put_blocks` validate and plan a
//! batch, make room, run the file writes ([`super::durable`]) up to
//! `io_depth` at once, join the group commit, and only then publish the
//! blocks to the in-memory index, the policy and the event stream, in
//! input order. Also the write gate's two refusals: closed and poisoned.

use super::durable::Placed;
use super::group;
use super::index::{digest, Entry, Record, FLAG_EPHEMERAL, NO_SLOT, PIN_FOREVER};
use super::slots::Slab;
use super::{lock_err, now_s, G3Event, G3Store};
use crate::base::error::{Error, Result};
use crate::base::tier::PutOutcome;
use crate::tiers::policy::BlockMeta;
use kvtier_client::{BlockHeader, BlockKey, Hints, NamespaceId, Tier};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

/// What a put knows beyond the header.
#[derive(Debug, Clone, Copy, Default)]
pub struct PutMeta {
    /// The block before this one in its chain.
    pub parent: Option<BlockKey>,
    /// Engine hints (pinned, priority, ephemeral).
    pub hints: Hints,
}

/// One block of a [`G3Store::put_blocks`] batch.
#[derive(Debug, Clone, Copy)]
pub struct PutItem<'a> {
    /// The block's header (its namespace must be the batch's).
    pub header: &'a BlockHeader,
    /// The payload (any slice, shared memory too).
    pub payload: &'a [u8],
    /// Parent and hints.
    pub meta: PutMeta,
}

fn collision(key: &BlockKey) -> Error {
    Error::InvalidInput {
        what: "block key",
        reason: format!(
            "the index digest of {key} collides with another stored block; use another key"
        ),
    }
}

/// How a written block was published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Published {
    /// As asked.
    Stored,
    /// Its pin was refused for the budget.
    Unpinned,
    /// Its parent (or an earlier block of its chain in this batch) was
    /// removed by force meanwhile: unreachable.
    Cut(BlockKey),
}

/// Each item's outcome while a batch runs (`None`: not decided yet).
type Outcomes = Vec<Option<Result<PutOutcome>>>;

/// Where a job's block goes.
enum Place {
    /// A file of its own: a recycled one, or a fresh one (`None`).
    File(Option<PathBuf>),
    /// A slot of the slab of its file length (slots.rs): the slab, its
    /// file pages and the slot.
    Slot(std::sync::Arc<Slab>, u32, u32),
}

/// What step 1 of a batch decided for one item.
enum Planned {
    /// Write it: its index id, check digest and where.
    Write(u64, u64, Place),
    /// Already stored.
    Present,
    /// The same key as the item at this position.
    Repeat(usize),
}

/// An item of a batch that must be written.
struct BatchJob {
    /// Its position in the batch.
    at: usize,
    id: u64,
    check: u64,
    /// A recycled file taken for it (recycle.rs); `None`: a fresh file.
    spare: std::sync::Mutex<Option<PathBuf>>,
    /// Its slot, when it goes to one (slots.rs): slab, file pages, slot.
    slot: Option<(std::sync::Arc<Slab>, u32, u32)>,
}

impl BatchJob {
    /// The slot the job's record names.
    fn slot_no(&self) -> Option<u32> {
        self.slot.as_ref().map(|s| s.2)
    }
}

/// The index record of a freshly written block. A pin hint is recorded
/// as a pin in the group commit, so an acknowledged pin survives a crash;
/// `publish` clears it again when the budget refuses it.
fn record_of(ns: &NamespaceId, it: &PutItem<'_>, now: u32) -> Record {
    Record {
        ns: *ns,
        key: it.header.key,
        payload_len: it.header.payload_len,
        payload_sum: it.header.payload_sum,
        created_unix_ms: it.header.created_unix_ms,
        hits: 0,
        last_access_s: now,
        pin_until_s: if it.meta.hints.pinned { PIN_FOREVER } else { 0 },
        priority: it.meta.hints.priority,
        flags: if it.meta.hints.ephemeral {
            FLAG_EPHEMERAL
        } else {
            0
        },
        parent: it.meta.parent.map(|p| digest(ns, &p).0),
        slot: None,
    }
}

impl G3Store {
    /// Stores a block. `payload` may be any slice (shared memory too); it is
    /// copied through aligned pool buffers and the checksum of that copy
    /// (the bytes written) is checked against `header`. Durable (file, its directory entry) and
    /// indexed before `Ok(Stored)`; a present key is `Ok(AlreadyPresent)`
    /// with nothing written. Errors: [`Error::NoSpace`] when the filesystem
    /// is full (reads continue), [`Error::PreviousIo`] after an earlier
    /// flush failure, [`Error::LimitReached`] when capacity is held by
    /// pinned or leased blocks, [`Error::InvalidInput`] for a header that
    /// does not match `ns` or `payload`. A batch of one
    /// ([`G3Store::put_blocks`]).
    pub fn put_block(
        &self,
        ns: &NamespaceId,
        header: &BlockHeader,
        payload: &[u8],
        meta: PutMeta,
    ) -> Result<PutOutcome> {
        let item = PutItem {
            header,
            payload,
            meta,
        };
        self.put_blocks(ns, &[item])
            .pop()
            .unwrap_or_else(|| Err(lock_err("g3 put")))
    }

    /// Stores the blocks of one request: one outcome per item, in input
    /// order, each with [`G3Store::put_block`]'s meaning. The files are
    /// written with up to `io_depth` in flight, then made durable together
    /// (one fsync per distinct shard directory, one index commit, shared
    /// with concurrent writers by the group commit), and only then indexed,
    /// handed to the eviction policy and announced, in input order (a
    /// chain's parent before its child).
    ///
    /// Items fail alone: an invalid or present item does not affect the
    /// others. When the filesystem fills up, the items whose write did not
    /// complete get [`Error::NoSpace`] (no new write starts after the first
    /// one) and the ones written are still stored. A failed directory fsync
    /// or index commit fails every item that was waiting for it: none of
    /// them is reported stored, and their renames are undone so that the
    /// files and the index agree.
    pub fn put_blocks(&self, ns: &NamespaceId, items: &[PutItem<'_>]) -> Vec<Result<PutOutcome>> {
        let mut out: Outcomes = items.iter().map(|_| None).collect();
        // Held for the whole batch: `close` takes it exclusively so that no
        // write completes after the clean marker is written.
        let Ok(_gate) = self.write_gate.read() else {
            return items
                .iter()
                .map(|_| Err(lock_err("g3 write gate")))
                .collect();
        };
        // The blocks this batch continues stay until it is published: room
        // made for the batch must not cut its own chain (spare.rs).
        let _parents = self.spare.hold_parents(
            items
                .iter()
                .filter_map(|it| it.meta.parent.map(|p| digest(ns, &p).0))
                .collect(),
        );
        let (jobs, repeats) = self.plan_batch(ns, items, &mut out);
        // Claim the ids this batch writes. Only a put that claims an id no
        // other put holds writes it (so a name in blocks/ without an index
        // entry, found by that put, is an orphan); the others join it:
        // they write nothing and take its outcome once it is published
        // (`await_writer`). Before, a second writer renamed its own file
        // too, and the first took that in-flight file for an orphan and
        // replaced it: the second published an entry after an eviction
        // had removed the file (found by the power-loss harness).
        let sole: Vec<bool> = {
            let mut w = self
                .writing
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            jobs.iter()
                .map(|j| {
                    let n = w.entry(j.id).or_insert(0);
                    *n += 1;
                    *n == 1
                })
                .collect()
        };
        let claimed: Vec<u64> = jobs.iter().map(|j| j.id).collect();
        let mut writes = Vec::with_capacity(jobs.len());
        let mut joined = Vec::new();
        for (job, mine) in jobs.into_iter().zip(&sole) {
            if *mine {
                writes.push(job);
            } else {
                joined.push(job);
            }
        }
        let jobs = writes;
        for job in &joined {
            if let Some(s) = job.spare.lock().ok().and_then(|mut s| s.take()) {
                self.drop_taken_spare(&s);
            }
            if let Some((_, pages, slot)) = &job.slot {
                self.slots.untake(*pages, *slot);
            }
        }
        let mut written = self.write_batch(ns, items, &jobs);
        self.flush_slabs(&jobs, &mut written);
        let now = now_s();
        let renamed = self.commit_batch(ns, items, &jobs, written, now, &mut out);
        if !renamed.is_empty() {
            self.publish_batch(ns, items, &renamed, now, &mut out);
        }
        {
            let mut w = self
                .writing
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for id in claimed {
                if let std::collections::hash_map::Entry::Occupied(mut e) = w.entry(id) {
                    *e.get_mut() -= 1;
                    if *e.get() == 0 {
                        e.remove();
                    }
                }
            }
        }
        // After this batch's own claims are gone: two batches that joined
        // each other's writes never wait for each other.
        for job in &joined {
            out[job.at] = Some(self.await_writer(job.id));
        }
        for (at, first) in repeats {
            out[at] = Some(match &out[first] {
                Some(Ok(_)) => Ok(PutOutcome::AlreadyPresent),
                _ => Err(Error::InvalidInput {
                    what: "block key",
                    reason: format!(
                        "{} repeats an earlier item of this batch, which was not stored",
                        items[at].header.key
                    ),
                }),
            });
        }
        out.into_iter()
            .map(|o| o.unwrap_or_else(|| Err(lock_err("g3 put"))))
            .collect()
    }

    /// Step 1 of a batch, in input order: validate, skip present keys and
    /// repeats, and make room for everything this batch will add. Returns
    /// the jobs to write and the repeats `(at, first)`; the other items'
    /// outcomes go into `out`.
    fn plan_batch(
        &self,
        ns: &NamespaceId,
        items: &[PutItem<'_>],
        out: &mut Outcomes,
    ) -> (Vec<BatchJob>, Vec<(usize, usize)>) {
        let mut jobs: Vec<BatchJob> = Vec::new();
        let mut first_of: HashMap<u64, usize> = HashMap::new();
        let mut repeats: Vec<(usize, usize)> = Vec::new();
        let mut reserved_bytes = 0u64;
        for (at, it) in items.iter().enumerate() {
            let planned = self.plan_put(ns, it).and_then(|p| {
                let Some((id, check)) = p else {
                    return Ok(Planned::Present);
                };
                // A block whose parent is neither held nor written earlier
                // in this batch could never be reached: refused, so it
                // takes no room from reachable blocks.
                if let Some(parent) = it.meta.parent {
                    let pid = digest(ns, &parent).0;
                    if !first_of.contains_key(&pid)
                        && !crate::base::tier::BlockTier::contains(self, ns, &parent)?
                    {
                        return Err(Error::ParentAbsent {
                            key: Box::new(it.header.key),
                            parent: Box::new(parent),
                        });
                    }
                }
                if let Some(&first) = first_of.get(&id) {
                    if items[first].header.key != it.header.key {
                        return Err(collision(&it.header.key));
                    }
                    return Ok(Planned::Repeat(first));
                }
                let file_len = it.header.file_len();
                if let Some(pages) = self.slab_for(file_len)? {
                    if let Some((slab, slot, _pooled)) = self.slots.take(pages) {
                        // A free slot's bytes leave the pool as it is taken
                        // (like a recycled file), so room is made for it
                        // exactly as for a fresh file.
                        if let Err(e) = self.make_room(reserved_bytes, file_len) {
                            self.slots.untake(pages, slot);
                            return Err(e);
                        }
                        reserved_bytes += file_len;
                        return Ok(Planned::Write(id, check, Place::Slot(slab, pages, slot)));
                    }
                }
                // A pooled file of this size first: its bytes leave the
                // pool's share of capacity, so the room is already there.
                let spare = self.take_spare(file_len);
                if let Err(e) = self.make_room(reserved_bytes, file_len) {
                    if let Some(s) = spare {
                        self.drop_taken_spare(&s);
                    }
                    return Err(e);
                }
                reserved_bytes += file_len;
                Ok(Planned::Write(id, check, Place::File(spare)))
            });
            match planned {
                Ok(Planned::Write(id, check, place)) => {
                    first_of.insert(id, at);
                    let (spare, slot) = match place {
                        Place::File(spare) => (spare, None),
                        Place::Slot(slab, pages, slot) => (None, Some((slab, pages, slot))),
                    };
                    jobs.push(BatchJob {
                        at,
                        id,
                        check,
                        spare: std::sync::Mutex::new(spare),
                        slot,
                    });
                }
                Ok(Planned::Present) => out[at] = Some(Ok(PutOutcome::AlreadyPresent)),
                Ok(Planned::Repeat(first)) => repeats.push((at, first)),
                Err(e) => out[at] = Some(Err(e)),
            }
        }
        (jobs, repeats)
    }

    /// Step 2: write each job's file and rename it into place, up to
    /// `io_depth` files at once. One result per job that a writer took,
    /// sorted by job.
    fn write_batch(
        &self,
        ns: &NamespaceId,
        items: &[PutItem<'_>],
        jobs: &[BatchJob],
    ) -> Vec<(usize, Result<Option<Placed>>)> {
        let full = AtomicBool::new(false);
        let next = AtomicUsize::new(0);
        // Each copy of `write_some` (this thread and pooled helpers,
        // workers.rs) takes jobs until none is left.
        let results: std::sync::Mutex<Vec<(usize, Result<Option<Placed>>)>> =
            std::sync::Mutex::new(Vec::with_capacity(jobs.len()));
        let write_some = || {
            let mut done: Vec<(usize, Result<Option<Placed>>)> = Vec::new();
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(k) else { break };
                let it = &items[job.at];
                let spare = job.spare.lock().ok().and_then(|mut s| s.take());
                let r = if full.load(Ordering::Acquire) {
                    if let Some(s) = &spare {
                        self.drop_taken_spare(s);
                    }
                    if let Some((_, pages, slot)) = &job.slot {
                        self.slots.untake(*pages, *slot);
                    }
                    // Starting more writes on a full filesystem only churns
                    // it; the caller retries after eviction or cleanup.
                    Err(Error::NoSpace {
                        path: self.tmp_dir.clone(),
                        op: "writing (an earlier block of this batch hit a full filesystem)",
                    })
                } else {
                    match self.check_writable() {
                        Ok(()) => match &job.slot {
                            Some((slab, pages, slot)) => {
                                self.write_slotted(it, slab, *pages, *slot)
                            }
                            None => self.write_durable(ns, it.header, it.payload, spare),
                        },
                        Err(e) => {
                            if let Some(s) = &spare {
                                self.drop_taken_spare(s);
                            }
                            if let Some((_, pages, slot)) = &job.slot {
                                self.slots.untake(*pages, *slot);
                            }
                            Err(e)
                        }
                    }
                };
                if let Err(e) = &r {
                    if matches!(e, Error::NoSpace { .. }) {
                        full.store(true, Ordering::Release);
                    }
                    self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                }
                done.push((k, r));
            }
            if let Ok(mut r) = results.lock() {
                r.extend(done);
            }
        };
        let workers = self.cfg.io_depth.min(jobs.len());
        if crate::base::workers::fan_out(workers.saturating_sub(1), &write_some) > 0 {
            tracing::error!("g3: a batch writer panicked");
        }
        // A poisoned lock: no outcome for any job (each reported as an
        // error below, never as stored).
        let mut written = results.into_inner().unwrap_or_default();
        written.sort_unstable_by_key(|(k, _)| *k);
        written
    }

    /// Step 3: make the renames and records durable together (the group
    /// commit). Returns the jobs now durable, in job order; every other
    /// job's outcome goes into `out`.
    fn commit_batch<'j>(
        &self,
        ns: &NamespaceId,
        items: &[PutItem<'_>],
        jobs: &'j [BatchJob],
        written: Vec<(usize, Result<Option<Placed>>)>,
        now: u32,
        out: &mut Outcomes,
    ) -> Vec<&'j BatchJob> {
        let mut pending = Vec::new();
        let mut renamed: Vec<&BatchJob> = Vec::new();
        for (k, r) in written {
            let Some(job) = jobs.get(k) else { continue };
            let it = &items[job.at];
            match r {
                Ok(Some(placed)) => {
                    let dir = if placed.recycled || job.slot.is_some() {
                        // A recycled file's rename is made durable by the
                        // next settle or at close (or put back from
                        // recycle/ after a power cut): not before the ack
                        // (noted by write_durable). A slot has no directory
                        // entry: its slab's flush made it durable.
                        None
                    } else {
                        Some(placed.dir)
                    };
                    pending.push(group::Pending {
                        dir,
                        id: job.id,
                        rec: Record {
                            slot: job.slot_no(),
                            ..record_of(ns, it, now)
                        },
                    });
                    renamed.push(job);
                }
                // A slotted job gave its slot back already (write_slotted).
                Ok(None) => out[job.at] = Some(Ok(PutOutcome::AlreadyPresent)),
                Err(e) => out[job.at] = Some(Err(e)),
            }
        }
        // A job a panicked writer thread took has no outcome: never stored.
        let mut taken = vec![false; items.len()];
        for job in &renamed {
            taken[job.at] = true;
        }
        for job in jobs {
            if out[job.at].is_none() && !taken[job.at] {
                out[job.at] = Some(Err(lock_err("g3 batch writer")));
            }
        }
        // A failed directory fsync or index commit fails the writes, and
        // their renames are undone: a file in blocks/ without its record
        // would answer AlreadyPresent to the next offload while lookups say
        // absent, and stay invisible after a clean restart.
        if let Err(f) = self.group.join(pending, |g| self.commit_group(g)) {
            let index_path = self.cfg.root.join("index.redb");
            for job in &renamed {
                self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                out[job.at] = Some(Err(f.to_error(&index_path)));
            }
            self.undo_renames(ns, items, &renamed);
            renamed.clear();
        }
        renamed
    }

    /// Step 4: the durable blocks become visible, in input order: index,
    /// policy, events. A block whose chain was cut meanwhile goes again.
    fn publish_batch(
        &self,
        ns: &NamespaceId,
        items: &[PutItem<'_>],
        renamed: &[&BatchJob],
        now: u32,
        out: &mut Outcomes,
    ) {
        let mut cut: Vec<u64> = Vec::new();
        let published = self.publish(ns, items, renamed, now);
        for (k, job) in renamed.iter().enumerate() {
            let Ok(p) = &published else {
                out[job.at] = Some(Err(lock_err("g3 index")));
                continue;
            };
            let it = &items[job.at];
            out[job.at] = Some(match p.get(k) {
                Some(Published::Unpinned) => Ok(PutOutcome::StoredUnpinned),
                Some(Published::Cut(parent)) => {
                    cut.push(job.id);
                    Err(Error::ParentAbsent {
                        key: Box::new(it.header.key),
                        parent: Box::new(*parent),
                    })
                }
                _ => Ok(PutOutcome::Stored),
            });
            if matches!(p.get(k), Some(Published::Cut(_))) {
                continue;
            }
            self.emit(G3Event::Stored {
                ns: *ns,
                key: it.header.key,
                parent: it.meta.parent,
                file_len: it.header.file_len(),
            });
        }
        if let Some(last) = renamed.last() {
            self.spare.open_tail(last.id);
        }
        // Refused pins leave the records the commit wrote pinned.
        if let Ok(p) = &published {
            for (job, st) in renamed.iter().zip(p) {
                if *st == Published::Unpinned {
                    self.update_record(job.id, |r| r.pin_until_s = 0);
                }
            }
        }
        self.maybe_reclaim();
        // A parent that failed earlier in this batch, or was deleted by
        // force while its child was being written (only a forced removal
        // can take a spared parent): the child would be unreachable, so it
        // goes now (never announced as stored).
        self.take_back(&cut);
    }

    /// Checks one item of a batch against `ns` and the index: its (id,
    /// check) digest when it must be written, `None` when it is present.
    fn plan_put(&self, ns: &NamespaceId, it: &PutItem<'_>) -> Result<Option<(u64, u64)>> {
        let header = it.header;
        if header.namespace_id() != *ns {
            return Err(Error::InvalidInput {
                what: "block header",
                reason: format!(
                    "header is for namespace {}, not {ns}",
                    header.namespace_id()
                ),
            });
        }
        if it.payload.len() as u64 != header.payload_len {
            return Err(Error::InvalidInput {
                what: "payload",
                reason: format!(
                    "{} bytes, header says {}",
                    it.payload.len(),
                    header.payload_len
                ),
            });
        }
        self.check_writable()?;
        let key = header.key;
        let (id, check) = digest(ns, &key);
        let found = {
            let mem = self.mem.read().map_err(|_| lock_err("g3 index"))?;
            mem.map.get(&id).map(|e| e.check == check)
        };
        match found {
            None => Ok(Some((id, check))),
            // The digest is not collision resistant: dedup only on the
            // record's full name (an entry without a record, which a
            // failed index commit can leave, keeps the old answer).
            Some(true) => match self.disk.get(id)? {
                Some(r) if r.ns != *ns || r.key != key => Err(collision(&key)),
                _ => Ok(None),
            },
            Some(false) => Err(collision(&key)),
        }
    }

    /// Makes a committed batch visible, in input order: the in-memory
    /// index, the chain links and the eviction policy (a parent before its
    /// child, so both keep the link). Per job: whether its pin was refused
    /// for the budget, or its parent went meanwhile.
    fn publish(
        &self,
        ns: &NamespaceId,
        items: &[PutItem<'_>],
        jobs: &[&BatchJob],
        now: u32,
    ) -> Result<Vec<Published>> {
        let mut mem = self.mem.write().map_err(|_| lock_err("g3 index"))?;
        let mut pol = self.policy.lock().map_err(|_| lock_err("g3 policy"))?;
        let mut out = Vec::with_capacity(jobs.len());
        let mut cut_ids: Vec<u64> = Vec::new();
        for job in jobs {
            let it = &items[job.at];
            let file_len = it.header.file_len();
            let mut pin_until_s = 0;
            let mut state = Published::Stored;
            if it.meta.hints.pinned {
                if mem.pinned_bytes(now) + file_len <= self.cfg.pinned_budget_bytes {
                    pin_until_s = PIN_FOREVER;
                } else {
                    state = Published::Unpinned;
                }
            }
            let rec = record_of(ns, it, now);
            mem.insert(
                *ns,
                job.id,
                Entry {
                    check: job.check,
                    file_pages: (file_len / 4096) as u32,
                    hits: AtomicU32::new(0),
                    last_access_s: AtomicU32::new(rec.last_access_s),
                    pin_until_s,
                    leases: 0,
                    priority: rec.priority,
                    flags: rec.flags,
                    slot: job.slot_no().unwrap_or(NO_SLOT),
                },
            );
            let parent = match it.meta.parent {
                Some(p) if mem.get(ns, &p).is_some() => {
                    let pid = digest(ns, &p).0;
                    mem.chains.link(job.id, pid);
                    if cut_ids.contains(&pid) {
                        state = Published::Cut(p);
                        cut_ids.push(job.id);
                    }
                    Some(pid)
                }
                Some(p) => {
                    state = Published::Cut(p);
                    cut_ids.push(job.id);
                    None
                }
                None => None,
            };
            pol.on_insert(
                job.id,
                BlockMeta {
                    parent,
                    size_bytes: file_len,
                    // The policy sees the pin G3 holds (a refused one is
                    // none): G3 owns pins and their budget.
                    hints: Hints {
                        pinned: pin_until_s == PIN_FOREVER,
                        ..it.meta.hints
                    },
                },
            );
            out.push(state);
        }
        Ok(out)
    }

    /// Removes the files a failed group commit renamed into place (and
    /// makes the removals durable). A file that cannot be removed poisons
    /// the store: it would be a block on disk the index does not know.
    fn undo_renames(&self, ns: &NamespaceId, items: &[PutItem<'_>], jobs: &[&BatchJob]) {
        let mut dirs: Vec<PathBuf> = Vec::new();
        for job in jobs {
            if let Some((slab, pages, slot)) = &job.slot {
                // Punched: a block the index does not know must not come
                // back at a crash start's scan either.
                let s = super::slots::Settle {
                    slab: std::sync::Arc::clone(slab),
                    pages: *pages,
                    slot: *slot,
                    how: super::slots::Release::Punch,
                };
                self.settle_slot(&s);
                self.counters.renames_undone.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let path = self.block_file_path(ns, &items[job.at].header.key);
            match self.fs.remove_file(&path, super::seam::Unlink::Undo) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    self.poison(format!(
                        "cannot undo the rename of {} after a failed commit: {e}",
                        path.display()
                    ));
                    continue;
                }
            }
            self.counters.renames_undone.fetch_add(1, Ordering::Relaxed);
            if let Some(d) = path.parent() {
                dirs.push(d.to_path_buf());
            }
        }
        dirs.sort_unstable();
        dirs.dedup();
        for d in dirs {
            if let Err(e) = self.fs.sync_dir(&d, super::seam::SyncSite::UndoDirFsync) {
                self.poison(format!(
                    "fsync of directory {} after an undo: {e}",
                    d.display()
                ));
            }
        }
    }

    /// Step 2b: one flush per slab the batch wrote into (shared with the
    /// slab's other writers of the moment, slot_io.rs `flush_slab`), not
    /// one per block: a slotted job counts as written only once it is
    /// durable. A failed flush fails the slab's jobs (their slots given
    /// back) and poisons the store.
    fn flush_slabs(&self, jobs: &[BatchJob], written: &mut [(usize, Result<Option<Placed>>)]) {
        let mut slabs: Vec<&std::sync::Arc<Slab>> = Vec::new();
        for (k, r) in written.iter() {
            if let (Some((slab, _, _)), Ok(Some(_))) =
                (jobs.get(*k).and_then(|j| j.slot.as_ref()), r)
            {
                if !slabs.iter().any(|s| std::sync::Arc::ptr_eq(s, slab)) {
                    slabs.push(slab);
                }
            }
        }
        for slab in slabs {
            let Err(e) = self.flush_slab(slab) else {
                continue;
            };
            for (k, r) in written.iter_mut() {
                let Some(job) = jobs.get(*k) else { continue };
                let Some((s, pages, slot)) = job.slot.as_ref() else {
                    continue;
                };
                if std::sync::Arc::ptr_eq(s, slab) && matches!(r, Ok(Some(_))) {
                    self.slots.untake(*pages, *slot);
                    *r = Err(match &e {
                        Error::NoSpace { path, op } => Error::NoSpace {
                            path: path.clone(),
                            op,
                        },
                        other => Error::PreviousIo {
                            tier: Tier::G3,
                            cause: other.to_string(),
                        },
                    });
                }
            }
        }
    }

    /// Step 2 for a slotted job: the block written into its slot (made
    /// durable by `flush_slabs`).
    fn write_slotted(
        &self,
        it: &PutItem<'_>,
        slab: &Slab,
        pages: u32,
        slot: u32,
    ) -> Result<Option<super::durable::Placed>> {
        if let Err(e) = self.write_slot(it.header, it.payload, slab, slot) {
            self.slots.untake(pages, slot);
            return Err(e);
        }
        self.counters.slot_writes.fetch_add(1, Ordering::Relaxed);
        Ok(Some(super::durable::Placed {
            dir: self.slots.dir.clone(),
            recycled: false,
        }))
    }

    fn check_writable(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::InvalidInput {
                what: "g3 store",
                reason: "closed".into(),
            });
        }
        if let Some(cause) = self.poisoned.lock().map_err(|_| lock_err("g3"))?.clone() {
            return Err(Error::PreviousIo {
                tier: Tier::G3,
                cause,
            });
        }
        Ok(())
    }

    pub(super) fn poison(&self, cause: String) {
        tracing::error!(%cause, "g3: refusing writes until restart");
        if let Ok(mut p) = self.poisoned.lock() {
            p.get_or_insert(cause);
        }
    }
}
