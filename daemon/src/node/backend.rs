//! The server's view of the node: [`Backend`] over G3 + peers + G4.

use super::fetch::Local;
use super::{Node, Promoted};
use crate::base::backend::{
    Backend, BackendStats, EvictOutcome, LeaseId, OffloadBlock, PrefetchCaller, ReadFile, TierStats,
};
use crate::base::error::{Error, Result};
use crate::base::events::EventBus;
use crate::base::tier::{Lookup, MissReason, PutOutcome};
use crate::tiers::g3::{LeaseId as G3Lease, PutItem, PutMeta};
use crate::tiers::policy::admission::AdmissionEvent;
use kvtier_client::block::HEADER_BYTES;
use kvtier_client::proto::{BlockStat, ListEntry};
use kvtier_client::{BlockHeader, BlockKey, Hints, NamespaceId, Tier};
use std::time::{Duration, Instant};

fn stat_of(info: &crate::tiers::g3::BlockInfo) -> BlockStat {
    BlockStat {
        tier: Tier::G3,
        payload_len: info.payload_len,
        payload_sum: info.payload_sum,
        created_unix_ms: info.created_unix_ms,
        pinned_until_unix_ms: info.pinned_until_unix_ms,
        leases: u32::from(info.leases),
    }
}

impl Node {
    fn sweep_leases(&self) {
        let now = Instant::now();
        if let Ok(mut l) = self.leases.lock() {
            l.retain(|_, until| *until > now);
        }
    }

    fn sweep_pins(&self) {
        let now = Instant::now();
        if let Ok(mut p) = self.pins.lock() {
            p.retain(|_, until| *until > now);
        }
    }

    /// A G3 hit: feeds admission (after-first-reuse uploads on a hit).
    fn on_g3_hit(&self, ns: &NamespaceId, key: &BlockKey) {
        if self.g4.is_none() || self.admission == crate::tiers::policy::G4Admission::All {
            return;
        }
        if let Some(info) = self.g3.stat(ns, key) {
            let hints = Hints {
                priority: info.priority,
                pinned: info.pinned,
                ephemeral: info.ephemeral,
                expected_reuse: 0,
            };
            self.admit(ns, key, AdmissionEvent::Hit, hints, info.in_g4);
        }
    }
}

impl Node {
    /// A verified read from G3; `promoted`: the tier a just-promoted block
    /// came from (reported instead of G3).
    fn read_g3(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        dst: &mut [u8],
        promoted: Option<Tier>,
        reader_verifies: bool,
    ) -> Result<Lookup<(BlockHeader, Tier)>> {
        // A block larger than the caller's buffer is a miss (contract).
        if let Some(info) = self.g3.stat(ns, key) {
            if (dst.len() as u64) < info.file_len {
                return Ok(Lookup::Miss(MissReason::Absent));
            }
        }
        let read = if reader_verifies {
            self.g3.read_into_for_verifier(ns, key, dst)?
        } else {
            self.g3.read_into(ns, key, dst)?
        };
        match read {
            Lookup::Hit(h) => {
                let tier = promoted.unwrap_or(Tier::G3);
                if tier == Tier::G3 {
                    self.on_g3_hit(ns, key);
                }
                Ok(Lookup::Hit((h, tier)))
            }
            Lookup::Miss(r) => Ok(Lookup::Miss(r)),
        }
    }

    /// [`Backend::read_into`] and [`Backend::read_into_for_verifier`]:
    /// `reader_verifies` lets a G3 read skip the payload checksum (the
    /// reader checks it, see `G3Store::read_into_for_verifier`); a block
    /// from a peer or G4 was verified by its fetcher either way.
    fn read_into_as(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        dst: &mut [u8],
        reader_verifies: bool,
    ) -> Result<Lookup<(BlockHeader, Tier)>> {
        // Background work (promotions, prefetches) yields to onboards,
        // G3 hits included: they share the disk and the cores.
        let _busy = self.activity.fetching();
        // A fetched block is served from the bytes the fetcher verified
        // while its promotion into G3 runs in the background.
        let (block, tier) = match self.ensure_available(ns, key, true)? {
            Lookup::Miss(r) => return Ok(Lookup::Miss(r)),
            Lookup::Hit(Local::Staged { block, report, .. }) => (block, report),
            Lookup::Hit(Local::OnG3) => {
                let promoted = self.take_promoted(ns, key);
                match promoted {
                    // Just promoted by a lease: serve the bytes the fetcher
                    // verified instead of reading the fresh G3 copy back.
                    Some(Promoted {
                        tier,
                        block: Some(block),
                    }) => (block, tier),
                    other => {
                        match self.read_g3(ns, key, dst, other.map(|p| p.tier), reader_verifies) {
                            // G3 holds it but cannot give it (a failing disk, a
                            // corrupt copy, now quarantined): another tier's
                            // verified copy rather than a miss or an error.
                            Err(e @ (Error::Io { .. } | Error::NoSpace { .. })) => {
                                tracing::warn!(%ns, %key, error = %e,
                                "g3 read failed; fetching the block from the peers or G4");
                                // Not promoted: the disk that failed would take it.
                                match self.fetch_now(ns, key, false)? {
                                    Lookup::Hit(Local::Staged { block, report, .. }) => {
                                        (block, report)
                                    }
                                    _ => return Err(e),
                                }
                            }
                            Ok(Lookup::Miss(MissReason::Corrupt)) => {
                                match self.fetch_now(ns, key, true)? {
                                    Lookup::Hit(Local::Staged { block, report, .. }) => {
                                        (block, report)
                                    }
                                    _ => return Ok(Lookup::Miss(MissReason::Corrupt)),
                                }
                            }
                            r => return r,
                        }
                    }
                }
            }
        };
        let len = block.payload.len();
        if dst.len() < HEADER_BYTES + len {
            return Ok(Lookup::Miss(MissReason::Absent));
        }
        block
            .header
            .encode_into((&mut dst[..HEADER_BYTES]).try_into().map_err(|_| {
                Error::InvalidInput {
                    what: "read buffer",
                    reason: "shorter than a block header".into(),
                }
            })?);
        dst[HEADER_BYTES..HEADER_BYTES + len].copy_from_slice(&block.payload);
        Ok(Lookup::Hit((block.header.clone(), tier)))
    }
}

impl Backend for Node {
    fn name(&self) -> &'static str {
        match (self.g4.is_some(), self.peers.is_some()) {
            (false, false) => "g3",
            (true, false) => "g3+g4",
            (false, true) => "g3+peers",
            (true, true) => "g3+peers+g4",
        }
    }

    fn lookup(&self, ns: &NamespaceId, chain: &[BlockKey]) -> Result<Vec<Tier>> {
        Ok(self.locate(ns, chain)?.0)
    }

    fn lookup_why(&self, ns: &NamespaceId, chain: &[BlockKey]) -> Result<(Vec<Tier>, MissReason)> {
        self.locate(ns, chain)
    }

    fn offload(
        &self,
        ns: &NamespaceId,
        header: &BlockHeader,
        payload: &[u8],
        parent: Option<BlockKey>,
        hints: Hints,
    ) -> Result<PutOutcome> {
        let item = PutItem {
            header,
            payload,
            meta: PutMeta {
                parent: self.g3_parent(ns, parent, &[]),
                hints,
            },
        };
        let outcome = self
            .put_evicting_on_enospc(ns, &[item])
            .pop()
            .unwrap_or(Ok(PutOutcome::AlreadyPresent))?;
        if outcome.is_stored() {
            super::events::g3_stored(&self.events, ns, header, parent);
            self.note_parent(ns, header, parent, hints);
            self.admit(ns, &header.key, AdmissionEvent::Stored, hints, false);
        }
        Ok(outcome)
    }

    /// One G3 batch: the files are written concurrently and made durable
    /// together; events and admission follow in input order.
    fn offload_batch(
        &self,
        ns: &NamespaceId,
        blocks: &[OffloadBlock<'_>],
    ) -> Vec<Result<PutOutcome>> {
        let items: Vec<PutItem<'_>> = blocks
            .iter()
            .enumerate()
            .map(|(i, b)| PutItem {
                header: &b.header,
                payload: b.payload,
                meta: PutMeta {
                    parent: self.g3_parent(ns, b.parent, &blocks[..i]),
                    hints: b.hints,
                },
            })
            .collect();
        let out = self.put_evicting_on_enospc(ns, &items);
        for (b, r) in blocks.iter().zip(&out) {
            if matches!(r, Ok(o) if o.is_stored()) {
                let key = &b.header.key;
                super::events::g3_stored(&self.events, ns, &b.header, b.parent);
                self.note_parent(ns, &b.header, b.parent, b.hints);
                self.admit(ns, key, AdmissionEvent::Stored, b.hints, false);
            }
        }
        out
    }

    fn read_into(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        dst: &mut [u8],
    ) -> Result<Lookup<(BlockHeader, Tier)>> {
        self.read_into_as(ns, key, dst, false)
    }

    fn read_into_for_verifier(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        dst: &mut [u8],
    ) -> Result<Lookup<(BlockHeader, Tier)>> {
        self.read_into_as(ns, key, dst, true)
    }

    /// G3's slotted hits, read together; a block being staged or just
    /// promoted (served from the fetcher's verified bytes) and every miss
    /// go the usual way (`read_into_as`: a fetch from the peers or G4).
    fn read_many_for_verifier(
        &self,
        ns: &NamespaceId,
        items: &mut [(BlockKey, &mut [u8])],
    ) -> Vec<Option<(BlockHeader, Tier, crate::base::backend::ReadTouch)>> {
        let _busy = self.activity.fetching();
        let pending = |key: &BlockKey| {
            self.staging.contains(ns, key)
                || self
                    .promoted
                    .lock()
                    .map(|g| g.0.contains_key(&(*ns, *key)))
                    .unwrap_or(true)
        };
        let got = self.g3.read_many_for_verifier(ns, items, &pending);
        got.into_iter()
            .zip(items.iter())
            .map(|(g, (key, _))| {
                g.map(|(h, touch)| {
                    self.on_g3_hit(ns, key);
                    (h, Tier::G3, touch)
                })
            })
            .collect()
    }

    fn prepare_onboard(&self, ns: &NamespaceId, keys: &[BlockKey]) -> Vec<Option<MissReason>> {
        self.prepare(ns, keys)
    }

    fn open_for_read(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Lookup<ReadFile>> {
        // A second pass only after a bad header was repaired (from where).
        let mut repaired_from: Option<Tier> = None;
        let mut quarantined = false;
        for repaired in [false, true] {
            let from = match self.ensure_local(ns, key)? {
                Lookup::Hit(t) => t,
                // Nothing to repair a quarantined copy from: it was there,
                // corrupt (the cause the caller reports and counts).
                Lookup::Miss(_) if quarantined => return Ok(Lookup::Miss(MissReason::Corrupt)),
                Lookup::Miss(r) => return Ok(Lookup::Miss(r)),
            };
            let (file, _) = match self.g3.open_for_read(ns, key)? {
                Lookup::Hit(x) => x,
                // A slotted block is verified before its copy is handed
                // out: corrupt, it was quarantined; fetched again (G4, a
                // peer) at once, as for a bad header below.
                Lookup::Miss(MissReason::Corrupt) if !repaired => {
                    quarantined = true;
                    continue;
                }
                Lookup::Miss(r) => return Ok(Lookup::Miss(r)),
            };
            // The header is checked here; the client verifies the payload
            // against it (the direct-read contract).
            let mut head = vec![0u8; HEADER_BYTES];
            let header = std::os::unix::fs::FileExt::read_exact_at(&file, &mut head, 0)
                .ok()
                .and_then(|()| BlockHeader::decode(&head).ok())
                .filter(|h| h.namespace_id() == *ns && h.key == *key);
            let Some(header) = header else {
                // Never answered Corrupt again and again: verified in
                // full (a read error is not corruption), quarantined and
                // repaired from G4 or a peer at once (repair.rs).
                if !repaired {
                    if let crate::base::backend::VerifyOutcome::Repaired(t) =
                        self.verify_repair(ns, key, true)?
                    {
                        repaired_from = Some(t);
                        continue;
                    }
                }
                return Ok(Lookup::Miss(MissReason::Corrupt));
            };
            let tier = match self.take_promoted(ns, key) {
                Some(p) => p.tier,
                None => repaired_from.unwrap_or(from),
            };
            if tier == Tier::G3 {
                self.on_g3_hit(ns, key);
            }
            return Ok(Lookup::Hit(ReadFile {
                file,
                offset: 0,
                header,
                tier,
            }));
        }
        Ok(Lookup::Miss(MissReason::Corrupt))
    }

    fn lease(&self, ns: &NamespaceId, key: &BlockKey, ttl_ms: u32) -> Result<Lookup<LeaseId>> {
        // Leasing is the first step of an onboard: fall through to peers
        // and G4 here, so the lease protects the promoted copy.
        if let Lookup::Miss(r) = self.ensure_local(ns, key)? {
            return Ok(Lookup::Miss(r));
        }
        self.sweep_leases();
        let ttl = u64::from(ttl_ms).min(self.g3.config().lease_ttl_max_ms);
        match self.g3.lease(ns, key, ttl)? {
            // G3 numbers leases from 0; the server's ids are never 0.
            Some(G3Lease(id)) => {
                let lid = id + 1;
                if let Ok(mut l) = self.leases.lock() {
                    l.insert(lid, Instant::now() + Duration::from_millis(ttl));
                }
                Ok(Lookup::Hit(lid))
            }
            None => Ok(Lookup::Miss(MissReason::Absent)),
        }
    }

    fn release(&self, lease: LeaseId) -> bool {
        if lease == 0 {
            return false;
        }
        if let Ok(mut l) = self.leases.lock() {
            l.remove(&lease);
        }
        self.g3.release(G3Lease(lease - 1))
    }

    fn pin(&self, ns: &NamespaceId, key: &BlockKey, ttl_ms: u32) -> Result<Lookup<()>> {
        if let Lookup::Miss(r) = self.ensure_local(ns, key)? {
            return Ok(Lookup::Miss(r));
        }
        self.sweep_pins();
        let ttl = ttl_ms.min(self.pin_ttl_max_ms);
        let full = self
            .pins
            .lock()
            .map(|p| p.len() >= self.pins_max && !p.contains_key(&(*ns, *key)))
            .unwrap_or(false);
        if full {
            return Err(Error::LimitReached {
                what: "pins_max",
                limit: self.pins_max as u64,
            });
        }
        if self.g3.pin(ns, key, Some(u64::from(ttl))) {
            if let Ok(mut p) = self.pins.lock() {
                p.insert(
                    (*ns, *key),
                    Instant::now() + Duration::from_millis(u64::from(ttl)),
                );
            }
            return Ok(Lookup::Hit(()));
        }
        if self.g3.stat(ns, key).is_some() {
            return Err(Error::LimitReached {
                what: "g3 pinned_budget_bytes",
                limit: self.g3.config().pinned_budget_bytes,
            });
        }
        Ok(Lookup::Miss(MissReason::Absent))
    }

    fn unpin(&self, ns: &NamespaceId, key: &BlockKey) -> Result<bool> {
        if let Ok(mut p) = self.pins.lock() {
            p.remove(&(*ns, *key));
        }
        Ok(self.g3.unpin(ns, key))
    }

    fn prefetch(
        &self,
        caller: PrefetchCaller,
        ns: &NamespaceId,
        keys: &[BlockKey],
        deadline_ms: u32,
    ) -> Vec<kvtier_client::proto::ItemStatus> {
        Node::prefetch(self, caller, ns, keys, deadline_ms)
    }

    fn evict(&self, ns: &NamespaceId, key: &BlockKey) -> Result<EvictOutcome> {
        // A staged copy is the node's too: dropped (or, when being written,
        // waited for and then deleted below).
        let was_staged = self.staging.cancel(ns, key);
        let Some(info) = self.g3.stat(ns, key) else {
            return Ok(if was_staged {
                EvictOutcome::Evicted
            } else {
                EvictOutcome::Absent
            });
        };
        if info.leases > 0 || info.pinned {
            return Ok(EvictOutcome::Busy);
        }
        // Removes the local copy only: G4 (shared by every node) keeps its
        // own, so an evicted block can still onboard from there.
        Ok(if self.g3.evict_block(ns, key)? {
            self.evicted_by_request
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            EvictOutcome::Evicted
        } else {
            EvictOutcome::Absent
        })
    }

    fn evict_tier(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        tier: kvtier_client::proto::EvictTier,
    ) -> Result<EvictOutcome> {
        self.evict_tiers(ns, key, tier)
    }

    fn verify(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        repair: bool,
    ) -> Result<crate::base::backend::VerifyOutcome> {
        self.verify_repair(ns, key, repair)
    }

    fn report_corrupt(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
    ) -> Result<crate::base::backend::VerifyOutcome> {
        let out = self.verify_repair(ns, key, true)?;
        if let crate::base::backend::VerifyOutcome::Repaired(tier) = out {
            // The reporting client onboards it again next: that read says
            // where the good copy came from, not G3.
            self.remember_repaired(ns, key, tier);
        }
        Ok(out)
    }

    fn stat(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Option<BlockStat>> {
        if let Some(i) = self.g3.stat(ns, key) {
            return Ok(Some(stat_of(&i)));
        }
        // Not on G3: a block only G4 holds (evicted from G3) is stored too,
        // as lookup and onboard say. Its header, by a ranged GET within
        // the remote lookup deadline; G4 holds no pins nor leases.
        let Some(g4) = self.g4.clone() else {
            return Ok(None);
        };
        let (n, k, deadline) = (*ns, *key, self.lookup_remote_deadline);
        match self.run_async(async move { g4.fetch_header_async(&n, &k, deadline).await }) {
            Some(Lookup::Hit(h)) => Ok(Some(BlockStat {
                tier: Tier::G4,
                payload_len: h.payload_len,
                payload_sum: h.payload_sum,
                created_unix_ms: h.created_unix_ms,
                pinned_until_unix_ms: 0,
                leases: 0,
            })),
            // A copy that fails its header check serves nothing: not stored.
            Some(Lookup::Miss(MissReason::Absent | MissReason::Corrupt)) => Ok(None),
            // Not answered in time: not a "not stored", which would be a
            // guess.
            Some(Lookup::Miss(MissReason::Unavailable | MissReason::Timeout)) | None => {
                Err(Error::Timeout {
                    op: "stat on G4",
                    timeout_ms: deadline.as_millis() as u64,
                })
            }
        }
    }

    fn list(
        &self,
        ns: Option<NamespaceId>,
        after: Option<(NamespaceId, BlockKey)>,
        limit: usize,
    ) -> Result<Vec<ListEntry>> {
        let namespaces = match ns {
            Some(n) => vec![n],
            None => self.g3.namespaces(),
        };
        let mut out = Vec::new();
        for n in namespaces {
            if out.len() >= limit {
                break;
            }
            let start = match &after {
                Some((an, _)) if n < *an => continue,
                Some((an, ak)) if n == *an => Some(*ak),
                _ => None,
            };
            for key in self.g3.list(&n, start.as_ref(), limit - out.len()) {
                if let Some(info) = self.g3.stat(&n, &key) {
                    out.push(ListEntry {
                        ns: n,
                        key,
                        stat: stat_of(&info),
                    });
                }
            }
        }
        Ok(out)
    }

    fn holds_namespace(&self, ns: &NamespaceId) -> bool {
        self.g3.holds_namespace(ns)
    }

    fn health(&self) -> Vec<String> {
        let mut v: Vec<String> = self.capacity_problem.iter().cloned().collect();
        if self.g3.disk_full() {
            v.push(format!(
                "g3: the filesystem under {} is full (the index's reserve is in use): offloads \
                 answer no_space until eviction or the operator frees space",
                self.g3.config().root.display()
            ));
        }
        v.extend(self.g4.as_ref().map(|g| g.health()).unwrap_or_default());
        if let Some(p) = &self.peers {
            for (addr, status) in p.client().refusing_peers() {
                v.push(format!(
                    "peer {addr} refuses our requests (HTTP {status} without a proof of our \
                     secret): its peer.secret differs from ours, or the clocks are more than 30 s apart"
                ));
            }
        }
        v
    }

    fn stats(&self) -> BackendStats {
        let s = self.g3.stats();
        let mut tiers = vec![TierStats {
            tier: Tier::G3,
            blocks: s.blocks,
            bytes: s.used_bytes,
            capacity_bytes: s.capacity_bytes,
            known: true,
        }];
        if let Some(g4) = &self.g4 {
            // From the listing at start and the sweeper's (g4/census.rs),
            // plus this node's uploads since; unknown until the first.
            let c = g4.count();
            tiers.push(TierStats {
                tier: Tier::G4,
                blocks: c.map_or(0, |c| c.blocks),
                bytes: c.map_or(0, |c| c.bytes),
                capacity_bytes: g4.config().capacity_bytes.unwrap_or(0),
                known: c.is_some(),
            });
        }
        self.sweep_leases();
        self.sweep_pins();
        BackendStats {
            tiers,
            evictions: s.evictions
                + self
                    .evicted_by_request
                    .load(std::sync::atomic::Ordering::Relaxed),
            quarantined: s.quarantined,
            leases_held: self.leases.lock().map(|l| l.len() as u64).unwrap_or(0),
            // G3 holds every pin (clients', the mount's setfattr, hints);
            // the node's map only bounds clients' (pins_max).
            pins_held: self
                .g3
                .pinned_blocks()
                .max(self.pins.lock().map(|p| p.len() as u64).unwrap_or(0)),
        }
    }

    fn attach_events(&self, bus: EventBus) {
        if let Ok(mut slot) = self.events.write() {
            *slot = Some(bus);
        }
    }

    fn flush(&self) -> Result<()> {
        self.shutdown(Duration::from_secs(10))
    }
}
