//! Daemon-side verification with repair (`kvtier verify`, a client's
//! corruption report, the background scrub): the G3 copy is re-read and
//! verified by `G3Store::scrub_block`; one that fails is quarantined by
//! that read (a `Disk` Removed event; lookups stop reporting it at once)
//! and, with repair, fetched again from a peer or G4 (verified on arrival,
//! written into G3), so the next onboard is a G3 hit on good bytes.

use super::Node;
use crate::base::backend::VerifyOutcome;
use crate::base::error::Result;
use crate::base::tier::{Lookup, MissReason};
use kvtier_client::{BlockKey, NamespaceId};

impl Node {
    pub(super) fn verify_repair(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        repair: bool,
    ) -> Result<VerifyOutcome> {
        // Verified in G3's own buffer; not a hit, no access stamp.
        match self.g3.scrub_block(ns, key)? {
            Lookup::Hit(_) => return Ok(VerifyOutcome::Ok),
            Lookup::Miss(MissReason::Corrupt) => {}
            Lookup::Miss(_) => return Ok(VerifyOutcome::Absent),
        }
        tracing::warn!(%ns, %key, repair, "verify: G3 copy failed verification; quarantined");
        // Quarantined: G3 no longer holds it, so G4 / peers are asked.
        if !repair || !self.remote() {
            return Ok(VerifyOutcome::Dropped);
        }
        Ok(match self.ensure_local(ns, key)? {
            Lookup::Hit(tier) => {
                // No client read follows this promotion: the next onboard
                // is an ordinary G3 hit, not reported as from `tier`.
                self.take_promoted(ns, key);
                tracing::info!(%ns, %key, from = tier.name(), "verify: repaired from a verified copy");
                VerifyOutcome::Repaired(tier)
            }
            Lookup::Miss(_) => VerifyOutcome::Dropped,
        })
    }
}
