//! The G4 write-through: which G3 blocks go up, how the uploader reads
//! them, and what happens once they are safe.
//!
//! - Admission ([`G4Admission`]): `all` (the default) queues every
//!   non-ephemeral block once it is durable on G3; `after-first-reuse`
//!   queues it on its first G3 hit (or at store time when the engine hinted
//!   reuse or a pin). Ephemeral blocks are never uploaded.
//! - The uploader reads the block file from G3 at upload time through
//!   `G3Store::read_into`, which verifies header, length, padding and
//!   checksum (the uploader verifies again before the bytes leave).
//! - A block safe in G4 is marked in the G3 index (`mark_in_g4`) and an
//!   `External` Stored event is published.
//! - Eviction does not wait for uploads: G3 must keep accepting writes when
//!   the object store is slow or down. A block evicted before its upload is
//!   skipped by the uploader (`SourceMissing`) and is lost to G4; a job lost
//!   to an outage, a full queue or a restart is re-queued for every block
//!   still on G3 and not marked: at start, when G4 recovers, and while a
//!   backlog remains (see `backlog`).

use super::events::{self, Slot};
use super::Node;
use crate::base::error::Result;
use crate::tiers::g3::G3Store;
use crate::tiers::g4::{EnqueueOutcome, G4Store, UploadOutcome};
use crate::tiers::policy::admission::AdmissionEvent;
use kvtier_client::{BlockHeader, BlockKey, Hints, NamespaceId};
use std::sync::atomic::Ordering;
use std::sync::Arc;

static GAVE_UP_LOG: crate::base::log_limit::LogLimit =
    crate::base::log_limit::LogLimit::new(10_000);

/// Starts G4's upload workers over `g3`; the orderer of their External
/// events is returned (offloads tell it their parents).
pub(super) fn start(
    g3: &Arc<G3Store>,
    g4: &Arc<G4Store>,
    slot: Slot,
) -> Result<Arc<super::g4_order::G4Order>> {
    // The sweeper's TTL and capacity deletions are `Removed` in External,
    // and G3 forgets its `in_g4` mark for them: a restart must not
    // announce a G4 copy that is gone (and the block may be written
    // through again).
    let removed_slot = slot.clone();
    let marks = g3.clone();
    g4.set_on_deleted(Arc::new(move |ns: NamespaceId, keys: Vec<BlockKey>| {
        // Index writes: off the async workers the sweeper runs on.
        let (marks, cleared) = (marks.clone(), keys.clone());
        let clear = move || {
            for k in &cleared {
                marks.clear_in_g4(&ns, k);
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) => drop(h.spawn_blocking(clear)),
            Err(_) => clear(),
        }
        events::g4_removed(&removed_slot, &ns, keys)
    }));
    let src = g3.clone();
    let source = move |ns: &NamespaceId, key: &BlockKey| -> Option<Vec<u8>> {
        let info = src.stat(ns, key)?;
        let mut buf = vec![0u8; info.file_len as usize];
        match src.read_into(ns, key, &mut buf) {
            Ok(crate::base::tier::Lookup::Hit(_)) => Some(buf),
            _ => None,
        }
    };
    let order = Arc::new(super::g4_order::G4Order::new(g3.clone(), slot));
    let ordered = order.clone();
    let on_uploaded = Arc::new(
        move |ns: &NamespaceId, key: &BlockKey, outcome: UploadOutcome| {
            if !outcome.is_safe_in_g4() {
                if outcome == UploadOutcome::GaveUp {
                    crate::warn_limited!(GAVE_UP_LOG, %ns, %key,
                        "g4: upload given up; re-queued when G4 answers again \
                         (kvtier_g4_backlog_blocks counts those waiting)");
                }
                return;
            }
            let (order, ns, key) = (order.clone(), *ns, *key);
            // A redb write and a header read: off the G4 runtime's async
            // workers. The header holds the routing facts (parent,
            // tokens_hash, token ids) the External event carries; events
            // go out in chain order (g4_order).
            tokio::task::spawn_blocking(move || order.uploaded(&ns, &key));
        },
    );
    g4.start_uploader(Arc::new(source), Some(on_uploaded))?;
    Ok(ordered)
}

/// A G3 block's header, checksum-verified (a buffered 4 KiB read; the
/// block may have been evicted meanwhile: then `None`).
pub(super) fn read_header(g3: &G3Store, ns: &NamespaceId, key: &BlockKey) -> Option<BlockHeader> {
    g3.read_header(ns, key)
}

impl Node {
    /// Queues a block for upload when admission says so.
    /// An offload stored `header`'s block under `parent`: when its header
    /// names no parent (blake3 namespaces), the External event of its
    /// upload gets this one (ephemeral blocks are never uploaded).
    pub(super) fn note_parent(
        &self,
        ns: &NamespaceId,
        header: &BlockHeader,
        parent: Option<BlockKey>,
        hints: Hints,
    ) {
        let (Some(order), Some(parent)) = (&self.g4_order, parent) else {
            return;
        };
        if !hints.ephemeral && header.dynamo.as_ref().and_then(|d| d.parent).is_none() {
            order.stored(ns, &header.key, parent);
        }
    }

    pub(super) fn admit(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        event: AdmissionEvent,
        hints: Hints,
        in_g4: bool,
    ) {
        let Some(g4) = &self.g4 else { return };
        if !self.admission.should_write(event, hints, in_g4) {
            return;
        }
        match g4.enqueue(ns, key, hints) {
            EnqueueOutcome::Queued => {
                self.g4_enqueued.fetch_add(1, Ordering::Relaxed);
            }
            EnqueueOutcome::DroppedQueueFull => {
                tracing::debug!(%ns, %key, "g4: upload queue full; re-queued by the backlog scan")
            }
            _ => {}
        }
    }
}
