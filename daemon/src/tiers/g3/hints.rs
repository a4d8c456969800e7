//! Per-block hints and flags changed after the put: pins (within
//! `pinned_budget_bytes`), priority (told to the policy), the in-G4 flag;
//! each written through to the block's redb record.

use super::index::{digest, Record, FLAG_EPHEMERAL, FLAG_IN_G4, PIN_FOREVER};
use super::{now_s, G3Store};
use kvtier_client::{BlockKey, Hints, NamespaceId};

impl G3Store {
    /// Blocks pinned now, by whoever pinned them (a client's `pin`, the
    /// mount's `setfattr user.kvtier.pinned`, an offload hint): what
    /// `kvtier_pins_held` shows.
    pub fn pinned_blocks(&self) -> u64 {
        self.mem
            .read()
            .map(|m| m.pinned_blocks(now_s()))
            .unwrap_or(0)
    }

    /// Pins a present block (never evicted) for `ttl_ms`, or until unpinned
    /// when `None`. `false` when absent or when `pinned_budget_bytes` would
    /// be exceeded.
    pub fn pin(&self, ns: &NamespaceId, key: &BlockKey, ttl_ms: Option<u64>) -> bool {
        let now = now_s();
        let Ok(mut mem) = self.mem.write() else {
            return false;
        };
        let Some((id, e)) = mem.get(ns, key) else {
            return false;
        };
        let (len, already) = (e.file_len(), e.pinned(now));
        if !already && mem.pinned_bytes(now) + len > self.cfg.pinned_budget_bytes {
            return false;
        }
        let until = match ttl_ms {
            None => PIN_FOREVER,
            Some(ms) => now
                .saturating_add((ms.div_ceil(1000)).min(u64::from(u32::MAX - 1)) as u32)
                .min(PIN_FOREVER - 1),
        };
        if let Some(e) = mem.map.get_mut(&id) {
            e.pin_until_s = until;
        }
        drop(mem);
        self.update_record(id, |r| r.pin_until_s = until);
        self.tell_policy(id);
        true
    }

    /// Removes a pin; `false` when absent or not pinned.
    pub fn unpin(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        let Ok(mut mem) = self.mem.write() else {
            return false;
        };
        let (id, check) = digest(ns, key);
        let Some(e) = mem.map.get_mut(&id).filter(|e| e.check == check) else {
            return false;
        };
        let was = e.pinned(now_s());
        e.pin_until_s = 0;
        drop(mem);
        self.update_record(id, |r| r.pin_until_s = 0);
        self.tell_policy(id);
        was
    }

    /// Sets the priority hint (told to the policy); `false` when absent.
    pub fn set_priority(&self, ns: &NamespaceId, key: &BlockKey, p: u8) -> bool {
        let id = {
            let Ok(mut mem) = self.mem.write() else {
                return false;
            };
            let (id, check) = digest(ns, key);
            let Some(e) = mem.map.get_mut(&id).filter(|e| e.check == check) else {
                return false;
            };
            e.priority = p;
            id
        };
        self.tell_policy(id);
        self.update_record(id, |r| r.priority = p);
        true
    }

    /// Tells the policy a block's hints as G3 holds them. Pinned means a
    /// pin without expiry: the policy keeps such a block out of its
    /// candidates until unpinned; a pin with a TTL stays a candidate that
    /// eviction refuses until it expires (G3 owns pins and their budget).
    fn tell_policy(&self, id: u64) {
        let hints = {
            let Ok(mem) = self.mem.read() else {
                return;
            };
            let Some(e) = mem.map.get(&id) else {
                return;
            };
            Hints {
                priority: e.priority,
                pinned: e.pin_until_s == PIN_FOREVER,
                ephemeral: e.flags & FLAG_EPHEMERAL != 0,
                expected_reuse: 0,
            }
        };
        if let Ok(mut pol) = self.policy.lock() {
            pol.on_hints(id, hints);
        }
    }

    /// Records that a copy exists in G4. False only when it was recorded
    /// already (a block no longer here changes nothing, and returns true).
    pub fn mark_in_g4(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        let id = {
            let Ok(mut mem) = self.mem.write() else {
                return true;
            };
            let (id, check) = digest(ns, key);
            let Some(e) = mem.map.get_mut(&id).filter(|e| e.check == check) else {
                return true;
            };
            if e.flags & FLAG_IN_G4 != 0 {
                return false;
            }
            e.flags |= FLAG_IN_G4;
            id
        };
        self.update_record(id, |r| r.flags |= FLAG_IN_G4);
        true
    }

    /// Forgets that G4 holds a copy (the sweeper or an evict deleted it),
    /// so a restart does not announce an External copy that is gone and the
    /// block is eligible for write-through again. False when it was not
    /// marked (or the block is no longer here).
    pub fn clear_in_g4(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        let id = {
            let Ok(mut mem) = self.mem.write() else {
                return false;
            };
            let (id, check) = digest(ns, key);
            let Some(e) = mem.map.get_mut(&id).filter(|e| e.check == check) else {
                return false;
            };
            if e.flags & FLAG_IN_G4 == 0 {
                return false;
            }
            e.flags &= !FLAG_IN_G4;
            id
        };
        self.update_record(id, |r| r.flags &= !FLAG_IN_G4);
        true
    }

    pub(super) fn update_record(&self, id: u64, f: impl Fn(&mut Record)) {
        // In one transaction: a get and a put apart let a removal between
        // them be undone (the record written back with no file and no
        // entry: `list` showed a block no read found; found by the
        // power-loss harness, hints racing an eviction).
        if let Err(e) = self.disk.update(id, f) {
            tracing::warn!(error = %e, "g3: index update failed");
        }
    }
}
