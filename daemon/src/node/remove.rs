//! Deletion across tiers (`kvtier evict --tier`, the mount's
//! `user.kvtier.evict`): G3 through the node's evict (leases and pins
//! refuse it, a staged promotion is cancelled), G4 through the object
//! store. Each tier that lost the block announces it: G3's removal is a
//! `Disk` Removed event (from G3's sink), G4's an `External` one.
//!
//! Other nodes' G3 copies are theirs: `all` means everywhere this node
//! reaches (its disk and the shared store).

use super::Node;
use crate::base::backend::{Backend, EvictOutcome};
use crate::base::error::Result;
use kvtier_client::proto::EvictTier;
use kvtier_client::{BlockKey, NamespaceId};

impl Node {
    /// Removes `key` from the tiers `tier` names. `Busy` (a lease or pin
    /// on G3) touches nothing, G4 included; `Evicted` when any tier had it.
    pub(super) fn evict_tiers(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        tier: EvictTier,
    ) -> Result<EvictOutcome> {
        if tier.g3() {
            if let Some(i) = self.g3.stat(ns, key) {
                if i.leases > 0 || i.pinned {
                    return Ok(EvictOutcome::Busy);
                }
            }
        }
        let mut removed = false;
        if tier.g3() {
            match Backend::evict(self, ns, key)? {
                EvictOutcome::Busy => return Ok(EvictOutcome::Busy),
                EvictOutcome::Evicted => removed = true,
                EvictOutcome::Absent => {}
            }
        }
        if tier.g4() {
            if let Some(g4) = &self.g4 {
                let (g4c, n, k) = (g4.clone(), *ns, *key);
                let deleted = self
                    .run_async(async move { g4c.delete_async(&n, &k).await })
                    .unwrap_or(Ok(false))?;
                // The G3 copy (tier g4 only) is no longer safe in G4.
                self.g3.clear_in_g4(ns, key);
                if deleted {
                    super::events::g4_removed(&self.events, ns, vec![*key]);
                    removed = true;
                }
            }
        }
        Ok(if removed {
            EvictOutcome::Evicted
        } else {
            EvictOutcome::Absent
        })
    }
}
