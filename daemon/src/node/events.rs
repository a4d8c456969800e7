//! G3 and G4 happenings as KV events (Dynamo's `RouterEvent` shape): G3
//! stores and removals are `storage_tier: Disk`, G4 uploads and deletions
//! `External`. A block's Dynamo routing facts (tokens_hash, token ids,
//! parent) come from its header, so a promotion, an upload or a start-up
//! announces them as the first store did.

use crate::base::events::{stored_block, EventBus};
use crate::tiers::g3::{EventSink, G3Event};
use kvtier_client::events::{KvEventData, StorageTier};
use kvtier_client::{BlockHeader, BlockKey, NamespaceId};
use std::sync::{Arc, RwLock};

/// The bus slot, filled by `attach_events`.
pub(super) type Slot = Arc<RwLock<Option<EventBus>>>;

/// Other receivers of raw G3 events (the mount's event log).
pub(super) type Listeners = Arc<RwLock<Vec<EventSink>>>;

/// A G3 event sink publishing on whatever bus the slot holds, and handing
/// every event to the listeners.
pub(super) fn g3_sink(slot: Slot, listeners: Listeners) -> EventSink {
    Arc::new(move |ev: G3Event| {
        if let Ok(l) = listeners.read() {
            for f in l.iter() {
                f(ev.clone());
            }
        }
        let Ok(g) = slot.read() else { return };
        let Some(bus) = g.as_ref() else { return };
        // Stores are published by the node itself (it knows the payload
        // length and the parent); G3 alone knows about its evictions.
        if let G3Event::Removed { ns, key, .. } = ev {
            bus.publish(
                ns,
                StorageTier::Disk,
                KvEventData::Removed {
                    block_hashes: vec![key],
                },
            );
        }
    })
}

/// The parent to announce: the one given, else the header's.
fn parent_of(header: &BlockHeader, parent: Option<BlockKey>) -> Option<BlockKey> {
    parent.or_else(|| {
        header
            .dynamo
            .as_ref()
            .and_then(|d| d.parent)
            .map(BlockKey::from_u64)
    })
}

/// A block became visible on this node's disk (offload or promotion).
pub(super) fn g3_stored(
    slot: &Slot,
    ns: &NamespaceId,
    header: &BlockHeader,
    parent: Option<BlockKey>,
) {
    let Ok(g) = slot.read() else { return };
    if let Some(bus) = g.as_ref() {
        bus.publish(
            *ns,
            StorageTier::Disk,
            KvEventData::Stored {
                parent_hash: parent_of(header, parent),
                blocks: vec![stored_block(header)],
            },
        );
    }
}

/// A block became safe in G4 (uploaded by this node, or found there),
/// under `parent` (else its header's).
pub(super) fn g4_stored(
    slot: &Slot,
    ns: &NamespaceId,
    header: &BlockHeader,
    parent: Option<BlockKey>,
) {
    let Ok(g) = slot.read() else { return };
    if let Some(bus) = g.as_ref() {
        bus.publish(
            *ns,
            StorageTier::External,
            KvEventData::Stored {
                parent_hash: parent_of(header, parent),
                blocks: vec![stored_block(header)],
            },
        );
    }
}

/// Blocks left G4 (the sweeper's TTL or capacity deletions).
pub(super) fn g4_removed(slot: &Slot, ns: &NamespaceId, keys: Vec<BlockKey>) {
    let Ok(g) = slot.read() else { return };
    if let Some(bus) = g.as_ref() {
        bus.publish(
            *ns,
            StorageTier::External,
            KvEventData::Removed { block_hashes: keys },
        );
    }
}
