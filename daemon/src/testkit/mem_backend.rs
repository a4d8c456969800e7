//! `MemBackend`: an in-memory store behind the server, the test seam for
//! the server, the metrics and the client (no disk, no G4).
//!
//! It keeps the whole [`Backend`] contract: verified bytes only, a capacity
//! with LRU eviction that skips leased and pinned blocks, bounded leases and
//! pins, and events for every store and removal. Direct reads spill the block
//! to an unlinked file under `spill_dir` (so an fd can be passed).

use crate::base::backend::{Backend, BackendStats, EvictOutcome, LeaseId, ReadFile, TierStats};
use crate::base::error::{Error, Result};
use crate::base::events::EventBus;
use crate::base::tier::{Lookup, MissReason, PutOutcome};
use crate::tiers::policy::{BlockMeta, EvictionPolicy, Lru};
use kvtier_client::block::{encode_block, HEADER_BYTES};
use kvtier_client::events::{KvEventData, StorageTier};
use kvtier_client::proto::{BlockStat, ListEntry};
use kvtier_client::{BlockHeader, BlockKey, Hints, NamespaceId, Tier};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bounds of a [`MemBackend`].
#[derive(Debug, Clone)]
pub struct MemLimits {
    /// Bytes kept before LRU eviction.
    pub capacity_bytes: u64,
    /// Leases held at once.
    pub leases_max: usize,
    /// Longest lease.
    pub lease_ttl_max_ms: u32,
    /// Pins held at once.
    pub pins_max: usize,
    /// Longest pin.
    pub pin_ttl_max_ms: u32,
}

impl Default for MemLimits {
    fn default() -> Self {
        MemLimits {
            capacity_bytes: 1 << 30,
            leases_max: 65536,
            lease_ttl_max_ms: 30_000,
            pins_max: 65536,
            pin_ttl_max_ms: 3_600_000,
        }
    }
}

type Id = (NamespaceId, BlockKey);

struct Entry {
    header: BlockHeader,
    payload: Arc<Vec<u8>>,
    handle: u64,
    leases: u32,
    pinned_until: Option<Instant>,
}

struct Lease {
    id: Id,
    expires: Instant,
}

struct State {
    blocks: BTreeMap<Id, Entry>,
    by_handle: HashMap<u64, Id>,
    next_handle: u64,
    lru: Lru,
    bytes: u64,
    leases: HashMap<LeaseId, Lease>,
    next_lease: LeaseId,
    pins: usize,
    evictions: u64,
}

/// The in-memory backend.
pub struct MemBackend {
    limits: MemLimits,
    spill_dir: PathBuf,
    state: Mutex<State>,
    events: Mutex<Option<EventBus>>,
    spill_seq: AtomicU64,
    quarantined: AtomicU64,
}

impl std::fmt::Debug for MemBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemBackend({:?})", self.limits)
    }
}

fn file_bytes(h: &BlockHeader) -> u64 {
    h.file_len()
}

fn unix_ms(at: Instant) -> u64 {
    let now = Instant::now();
    let sys = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    if at >= now {
        sys + (at - now).as_millis() as u64
    } else {
        sys.saturating_sub((now - at).as_millis() as u64)
    }
}

impl MemBackend {
    /// A backend with these limits; direct reads spill under `spill_dir`.
    pub fn new(limits: MemLimits, spill_dir: impl Into<PathBuf>) -> Self {
        MemBackend {
            limits,
            spill_dir: spill_dir.into(),
            state: Mutex::new(State {
                blocks: BTreeMap::new(),
                by_handle: HashMap::new(),
                next_handle: 1,
                lru: Lru::new(),
                bytes: 0,
                leases: HashMap::new(),
                next_lease: 1,
                pins: 0,
                evictions: 0,
            }),
            events: Mutex::new(None),
            spill_seq: AtomicU64::new(0),
            quarantined: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, State>> {
        self.state.lock().map_err(|_| Error::InvalidInput {
            what: "backend state",
            reason: "poisoned by an earlier panic".into(),
        })
    }

    fn publish(&self, ns: NamespaceId, data: KvEventData) {
        if let Ok(g) = self.events.lock() {
            if let Some(bus) = g.as_ref() {
                bus.publish(ns, StorageTier::Disk, data);
            }
        }
    }

    /// Drops expired leases and pins (lazily, on every mutating call).
    fn expire(st: &mut State) {
        let now = Instant::now();
        let dead: Vec<LeaseId> = st
            .leases
            .iter()
            .filter(|(_, l)| l.expires <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in dead {
            if let Some(l) = st.leases.remove(&id) {
                if let Some(e) = st.blocks.get_mut(&l.id) {
                    e.leases = e.leases.saturating_sub(1);
                }
            }
        }
        let mut unpinned = 0;
        for e in st.blocks.values_mut() {
            if e.pinned_until.is_some_and(|t| t <= now) {
                e.pinned_until = None;
                unpinned += 1;
            }
        }
        st.pins = st.pins.saturating_sub(unpinned);
    }

    fn remove(st: &mut State, id: &Id) -> bool {
        match st.blocks.remove(id) {
            Some(e) => {
                st.bytes = st.bytes.saturating_sub(file_bytes(&e.header));
                st.by_handle.remove(&e.handle);
                st.lru.on_remove(e.handle);
                if e.pinned_until.is_some() {
                    st.pins = st.pins.saturating_sub(1);
                }
                true
            }
            None => false,
        }
    }

    /// Evicts LRU blocks that are neither leased nor pinned until `need`
    /// more bytes fit. Returns the evicted ids, or None when it cannot.
    fn make_room(&self, st: &mut State, need: u64) -> Option<Vec<Id>> {
        let mut out = Vec::new();
        while st.bytes + need > self.limits.capacity_bytes {
            let blocks = &st.blocks;
            let by_handle = &st.by_handle;
            let victim = st.lru.victim(&mut |h| {
                by_handle
                    .get(&h)
                    .and_then(|id| blocks.get(id))
                    .is_some_and(|e| e.leases == 0 && e.pinned_until.is_none())
            })?;
            let id = *st.by_handle.get(&victim)?;
            Self::remove(st, &id);
            st.evictions += 1;
            out.push(id);
        }
        Some(out)
    }

    fn hit(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Option<(BlockHeader, Arc<Vec<u8>>)>> {
        let mut st = self.lock()?;
        let id = (*ns, *key);
        let Some(e) = st.blocks.get(&id) else {
            return Ok(None);
        };
        let (h, p, handle) = (e.header.clone(), e.payload.clone(), e.handle);
        st.lru.on_access(handle);
        Ok(Some((h, p)))
    }
}

impl Backend for MemBackend {
    fn name(&self) -> &'static str {
        "mem"
    }

    fn lookup(&self, ns: &NamespaceId, chain: &[BlockKey]) -> Result<Vec<Tier>> {
        let st = self.lock()?;
        Ok(chain
            .iter()
            .take_while(|k| st.blocks.contains_key(&(*ns, **k)))
            .map(|_| Tier::G3)
            .collect())
    }

    fn offload(
        &self,
        ns: &NamespaceId,
        header: &BlockHeader,
        payload: &[u8],
        parent: Option<BlockKey>,
        hints: Hints,
    ) -> Result<PutOutcome> {
        if header.namespace_id() != *ns {
            return Err(Error::InvalidInput {
                what: "block header",
                reason: "namespace differs from the request's".into(),
            });
        }
        let id = (*ns, header.key);
        if self.lock()?.blocks.contains_key(&id) {
            return Ok(PutOutcome::AlreadyPresent);
        }
        // Copy first, then verify the copy: the client may still be writing
        // the shared buffer.
        let copy = payload.to_vec();
        header.verify_payload(&copy)?;
        let size = file_bytes(header);
        if size > self.limits.capacity_bytes {
            return Err(Error::NoSpace {
                path: self.spill_dir.clone(),
                op: "storing a block larger than the capacity",
            });
        }
        let evicted;
        {
            let mut st = self.lock()?;
            if st.blocks.contains_key(&id) {
                return Ok(PutOutcome::AlreadyPresent);
            }
            Self::expire(&mut st);
            evicted = self
                .make_room(&mut st, size)
                .ok_or_else(|| Error::NoSpace {
                    path: self.spill_dir.clone(),
                    op: "storing a block (everything else is leased or pinned)",
                })?;
            let handle = st.next_handle;
            st.next_handle += 1;
            let parent_handle = parent.and_then(|p| st.blocks.get(&(*ns, p)).map(|e| e.handle));
            st.lru.on_insert(
                handle,
                BlockMeta {
                    parent: parent_handle,
                    size_bytes: size,
                    hints,
                },
            );
            st.by_handle.insert(handle, id);
            st.bytes += size;
            st.blocks.insert(
                id,
                Entry {
                    header: header.clone(),
                    payload: Arc::new(copy),
                    handle,
                    leases: 0,
                    pinned_until: None,
                },
            );
        }
        let mut removed: BTreeMap<NamespaceId, Vec<BlockKey>> = BTreeMap::new();
        for (n, k) in evicted {
            removed.entry(n).or_default().push(k);
        }
        for (n, ks) in removed {
            self.publish(n, KvEventData::Removed { block_hashes: ks });
        }
        self.publish(
            *ns,
            KvEventData::Stored {
                parent_hash: parent,
                blocks: vec![crate::base::events::stored_block(header)],
            },
        );
        Ok(PutOutcome::Stored)
    }

    fn read_into(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        dst: &mut [u8],
    ) -> Result<Lookup<(BlockHeader, Tier)>> {
        let Some((h, p)) = self.hit(ns, key)? else {
            return Ok(Lookup::Miss(MissReason::Absent));
        };
        if dst.len() < HEADER_BYTES + p.len() {
            return Err(Error::InvalidInput {
                what: "onboard buffer",
                reason: format!(
                    "{} bytes, the block needs {}",
                    dst.len(),
                    HEADER_BYTES + p.len()
                ),
            });
        }
        if h.verify_payload(&p).is_err() {
            self.quarantined.fetch_add(1, Ordering::Relaxed);
            return Ok(Lookup::Miss(MissReason::Corrupt));
        }
        let mut hb = [0u8; HEADER_BYTES];
        h.encode_into(&mut hb);
        dst[..HEADER_BYTES].copy_from_slice(&hb);
        dst[HEADER_BYTES..HEADER_BYTES + p.len()].copy_from_slice(&p);
        Ok(Lookup::Hit((h, Tier::G3)))
    }

    fn open_for_read(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Lookup<ReadFile>> {
        use std::io::Write;
        let Some((h, p)) = self.hit(ns, key)? else {
            return Ok(Lookup::Miss(MissReason::Absent));
        };
        let seq = self.spill_seq.fetch_add(1, Ordering::Relaxed);
        let path = self
            .spill_dir
            .join(format!(".spill-{}-{seq}", std::process::id()));
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| Error::io("creating a spill file", &path, e))?;
        // Unlinked at once: the fd is all that keeps it, so nothing leaks.
        let _ = std::fs::remove_file(&path);
        f.write_all(&encode_block(&h, &p))
            .map_err(|e| Error::io("writing a spill file", &path, e))?;
        Ok(Lookup::Hit(ReadFile {
            file: f,
            offset: 0,
            header: h,
            tier: Tier::G3,
        }))
    }

    fn lease(&self, ns: &NamespaceId, key: &BlockKey, ttl_ms: u32) -> Result<Lookup<LeaseId>> {
        let mut st = self.lock()?;
        Self::expire(&mut st);
        let id = (*ns, *key);
        if !st.blocks.contains_key(&id) {
            return Ok(Lookup::Miss(MissReason::Absent));
        }
        if st.leases.len() >= self.limits.leases_max {
            return Err(Error::LimitReached {
                what: "leases",
                limit: self.limits.leases_max as u64,
            });
        }
        let ttl = ttl_ms.clamp(1, self.limits.lease_ttl_max_ms.max(1));
        let lid = st.next_lease;
        st.next_lease += 1;
        st.leases.insert(
            lid,
            Lease {
                id,
                expires: Instant::now() + Duration::from_millis(ttl as u64),
            },
        );
        if let Some(e) = st.blocks.get_mut(&id) {
            e.leases += 1;
        }
        Ok(Lookup::Hit(lid))
    }

    fn release(&self, lease: LeaseId) -> bool {
        let Ok(mut st) = self.lock() else {
            return false;
        };
        match st.leases.remove(&lease) {
            Some(l) => {
                if let Some(e) = st.blocks.get_mut(&l.id) {
                    e.leases = e.leases.saturating_sub(1);
                }
                true
            }
            None => false,
        }
    }

    fn pin(&self, ns: &NamespaceId, key: &BlockKey, ttl_ms: u32) -> Result<Lookup<()>> {
        let mut st = self.lock()?;
        Self::expire(&mut st);
        let pins = st.pins;
        let Some(e) = st.blocks.get_mut(&(*ns, *key)) else {
            return Ok(Lookup::Miss(MissReason::Absent));
        };
        let ttl = ttl_ms.clamp(1, self.limits.pin_ttl_max_ms.max(1));
        let fresh = e.pinned_until.is_none();
        if fresh && pins >= self.limits.pins_max {
            return Err(Error::LimitReached {
                what: "pins",
                limit: self.limits.pins_max as u64,
            });
        }
        e.pinned_until = Some(Instant::now() + Duration::from_millis(ttl as u64));
        if fresh {
            st.pins += 1;
        }
        Ok(Lookup::Hit(()))
    }

    fn unpin(&self, ns: &NamespaceId, key: &BlockKey) -> Result<bool> {
        let mut st = self.lock()?;
        let was = st
            .blocks
            .get_mut(&(*ns, *key))
            .and_then(|e| e.pinned_until.take())
            .is_some();
        if was {
            st.pins = st.pins.saturating_sub(1);
        }
        Ok(was)
    }

    fn evict(&self, ns: &NamespaceId, key: &BlockKey) -> Result<EvictOutcome> {
        let out = {
            let mut st = self.lock()?;
            Self::expire(&mut st);
            let id = (*ns, *key);
            match st.blocks.get(&id) {
                None => EvictOutcome::Absent,
                Some(e) if e.leases > 0 || e.pinned_until.is_some() => EvictOutcome::Busy,
                Some(_) => {
                    Self::remove(&mut st, &id);
                    st.evictions += 1;
                    EvictOutcome::Evicted
                }
            }
        };
        if out == EvictOutcome::Evicted {
            self.publish(
                *ns,
                KvEventData::Removed {
                    block_hashes: vec![*key],
                },
            );
        }
        Ok(out)
    }

    fn stat(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Option<BlockStat>> {
        let st = self.lock()?;
        Ok(st.blocks.get(&(*ns, *key)).map(entry_stat))
    }

    fn list(
        &self,
        ns: Option<NamespaceId>,
        after: Option<(NamespaceId, BlockKey)>,
        limit: usize,
    ) -> Result<Vec<ListEntry>> {
        use std::ops::Bound;
        let st = self.lock()?;
        let lower = match after {
            Some(a) => Bound::Excluded(a),
            None => Bound::Unbounded,
        };
        Ok(st
            .blocks
            .range((lower, Bound::Unbounded))
            .filter(|((n, _), _)| ns.is_none_or(|want| *n == want))
            .take(limit)
            .map(|((n, k), e)| ListEntry {
                ns: *n,
                key: *k,
                stat: entry_stat(e),
            })
            .collect())
    }

    fn stats(&self) -> BackendStats {
        let Ok(st) = self.lock() else {
            return BackendStats::default();
        };
        BackendStats {
            tiers: vec![TierStats {
                tier: Tier::G3,
                blocks: st.blocks.len() as u64,
                bytes: st.bytes,
                capacity_bytes: self.limits.capacity_bytes,
                known: true,
            }],
            evictions: st.evictions,
            quarantined: self.quarantined.load(Ordering::Relaxed),
            leases_held: st.leases.len() as u64,
            pins_held: st.pins as u64,
        }
    }

    fn attach_events(&self, bus: EventBus) {
        if let Ok(mut g) = self.events.lock() {
            *g = Some(bus);
        }
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }
}

fn entry_stat(e: &Entry) -> BlockStat {
    BlockStat {
        tier: Tier::G3,
        payload_len: e.header.payload_len,
        payload_sum: e.header.payload_sum,
        created_unix_ms: e.header.created_unix_ms,
        pinned_until_unix_ms: e.pinned_until.map(unix_ms).unwrap_or(0),
        leases: e.leases,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_client::{KvLayout, Namespace};

    fn block(ns: &Namespace, i: u64) -> (BlockHeader, Vec<u8>) {
        let p = vec![i as u8; 4096];
        (
            BlockHeader::for_payload(ns, BlockKey::from_u64(i), &p, 1),
            p,
        )
    }

    #[test]
    fn capacity_evicts_lru_but_not_leased_or_pinned() {
        let ns = Namespace::new("m", KvLayout::with_block_bytes(4096).unwrap(), "", "").unwrap();
        let id = ns.id();
        let dir = std::env::temp_dir();
        let b = MemBackend::new(
            MemLimits {
                capacity_bytes: 3 * 8192,
                ..Default::default()
            },
            dir,
        );
        let bus = EventBus::new();
        let sub = bus.subscribe().unwrap();
        b.attach_events(bus);
        for i in 0..3 {
            let (h, p) = block(&ns, i);
            assert_eq!(
                b.offload(&id, &h, &p, None, Hints::default()).unwrap(),
                PutOutcome::Stored
            );
        }
        let l = b
            .lease(&id, &BlockKey::from_u64(0), 1000)
            .unwrap()
            .hit()
            .unwrap();
        b.pin(&id, &BlockKey::from_u64(1), 1000).unwrap();
        let (h, p) = block(&ns, 3);
        b.offload(&id, &h, &p, None, Hints::default()).unwrap();
        assert!(
            b.stat(&id, &BlockKey::from_u64(2)).unwrap().is_none(),
            "LRU unleased evicted"
        );
        assert!(b.stat(&id, &BlockKey::from_u64(0)).unwrap().is_some());
        assert_eq!(
            b.evict(&id, &BlockKey::from_u64(0)).unwrap(),
            EvictOutcome::Busy
        );
        assert!(b.release(l));
        assert_eq!(
            b.evict(&id, &BlockKey::from_u64(0)).unwrap(),
            EvictOutcome::Evicted
        );
        let evs: Vec<_> = sub.rx.try_iter().collect();
        assert_eq!(evs.len(), 6, "{evs:?}");
        // A wrong checksum is refused.
        let (h, mut p) = block(&ns, 9);
        p[0] ^= 1;
        assert!(b.offload(&id, &h, &p, None, Hints::default()).is_err());
    }
}
