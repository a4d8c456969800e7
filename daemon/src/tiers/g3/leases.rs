//! Leases: short, bounded protection from eviction (`leases_max`,
//! `lease_ttl_max_ms`), expired by the reclaimer's sweep.

use super::index::digest;
use super::{lock_err, G3Store};
use crate::base::error::{Error, Result};
use kvtier_client::{BlockKey, NamespaceId};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A lease: protects a block from eviction until released or expired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseId(pub u64);

pub(super) struct Leases {
    pub(super) live: HashMap<u64, (u64, Instant)>,
}

impl G3Store {
    /// Protects a present block from eviction for `ttl_ms` (cut to
    /// `lease_ttl_max_ms`). `Ok(None)` when absent; [`Error::LimitReached`]
    /// at `leases_max` live leases. Expired leases stop protecting.
    pub fn lease(&self, ns: &NamespaceId, key: &BlockKey, ttl_ms: u64) -> Result<Option<LeaseId>> {
        self.sweep_leases();
        let mut leases = self.leases.lock().map_err(|_| lock_err("g3 leases"))?;
        if leases.live.len() >= self.cfg.leases_max {
            return Err(Error::LimitReached {
                what: "g3 leases_max",
                limit: self.cfg.leases_max as u64,
            });
        }
        let mut mem = self.mem.write().map_err(|_| lock_err("g3 index"))?;
        let (id, check) = digest(ns, key);
        let Some(e) = mem.map.get_mut(&id).filter(|e| e.check == check) else {
            return Ok(None);
        };
        if e.leases == u16::MAX {
            return Err(Error::LimitReached {
                what: "g3 leases per block",
                limit: u64::from(u16::MAX),
            });
        }
        e.leases += 1;
        let lid = self.counters.seq.fetch_add(1, Ordering::Relaxed);
        let ttl = Duration::from_millis(ttl_ms.min(self.cfg.lease_ttl_max_ms));
        leases.live.insert(lid, (id, Instant::now() + ttl));
        Ok(Some(LeaseId(lid)))
    }

    /// Ends a lease; `false` when unknown or already expired.
    pub fn release(&self, lease: LeaseId) -> bool {
        let Ok(mut leases) = self.leases.lock() else {
            return false;
        };
        let Some((id, _)) = leases.live.remove(&lease.0) else {
            return false;
        };
        if let Ok(mut mem) = self.mem.write() {
            if let Some(e) = mem.map.get_mut(&id) {
                e.leases = e.leases.saturating_sub(1);
            }
        }
        true
    }

    /// Drops expired leases (they no longer protect their blocks).
    pub(crate) fn sweep_leases(&self) {
        let now = Instant::now();
        let Ok(mut leases) = self.leases.lock() else {
            return;
        };
        let expired: Vec<u64> = leases
            .live
            .iter()
            .filter(|(_, (_, t))| *t <= now)
            .map(|(l, _)| *l)
            .collect();
        if expired.is_empty() {
            return;
        }
        if let Ok(mut mem) = self.mem.write() {
            for l in expired {
                if let Some((id, _)) = leases.live.remove(&l) {
                    if let Some(e) = mem.map.get_mut(&id) {
                        e.leases = e.leases.saturating_sub(1);
                    }
                }
            }
        }
    }
}
