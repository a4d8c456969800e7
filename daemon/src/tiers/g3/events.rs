//! The KV event stream ([`G3Event`]) for routers and the G4 write-through:
//! one sink, called synchronously on the thread that caused the event.

use super::G3Store;
use kvtier_client::{BlockKey, NamespaceId};
use std::sync::Arc;

/// Why a block left the tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoveReason {
    /// Evicted for capacity.
    Evicted,
    /// Deleted on request.
    Deleted,
    /// Failed verification or its file vanished.
    Corrupt,
}

/// A KV event for routers and the G4 write-through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum G3Event {
    /// A block became durable and visible.
    Stored {
        /// Namespace.
        ns: NamespaceId,
        /// Key.
        key: BlockKey,
        /// Parent from the put.
        parent: Option<BlockKey>,
        /// File length.
        file_len: u64,
    },
    /// A block left the tier.
    Removed {
        /// Namespace.
        ns: NamespaceId,
        /// Key.
        key: BlockKey,
        /// Why.
        reason: RemoveReason,
    },
}

/// Receives events, synchronously, on the thread that caused them.
pub type EventSink = Arc<dyn Fn(G3Event) + Send + Sync>;

impl G3Store {
    /// Sets the receiver of [`G3Event`]s (replacing any earlier one).
    pub fn set_event_sink(&self, sink: EventSink) {
        if let Ok(mut s) = self.sink.write() {
            *s = Some(sink);
        }
    }

    pub(super) fn emit(&self, ev: G3Event) {
        let sink = self.sink.read().ok().and_then(|s| s.clone());
        if let Some(s) = sink {
            s(ev);
        }
    }
}
