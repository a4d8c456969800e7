//! The KV event bus: tiers publish `Stored` / `Removed`, subscribers (socket
//! connections in `kvtier events` or a router) receive them.
//!
//! Bounded everywhere: at most [`SUBSCRIBERS_MAX`] subscribers, each with a
//! queue of [`QUEUE_DEPTH`] events. A subscriber that falls behind loses
//! events instead of slowing the store down; it is told how many with a
//! `Lagged` event before the next one it receives.

use kvtier_client::events::{KvEvent, KvEventData, StorageTier};
use kvtier_client::NamespaceId;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

/// Most concurrent subscribers.
pub const SUBSCRIBERS_MAX: usize = 64;
/// Events queued per subscriber before it starts losing them.
pub const QUEUE_DEPTH: usize = 4096;

struct Sub {
    tx: SyncSender<Arc<KvEvent>>,
    dropped: Arc<AtomicU64>,
}

#[derive(Default)]
struct Inner {
    next_id: AtomicU64,
    subs: Mutex<Vec<Sub>>,
    published: AtomicU64,
}

/// A cloneable handle to the bus.
#[derive(Clone, Default)]
pub struct EventBus {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EventBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EventBus({} subscribers)", self.subscribers())
    }
}

/// One subscriber's end.
#[derive(Debug)]
pub struct Subscription {
    /// Events, in publication order.
    pub rx: Receiver<Arc<KvEvent>>,
    /// Events lost since the last `take_dropped`.
    dropped: Arc<AtomicU64>,
}

impl Subscription {
    /// How many events were lost since the last call (and resets it).
    pub fn take_dropped(&self) -> u64 {
        self.dropped.swap(0, Ordering::Relaxed)
    }
}

impl EventBus {
    /// A bus with no subscribers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Publishes an event to every subscriber without blocking.
    pub fn publish(&self, namespace: NamespaceId, storage_tier: StorageTier, data: KvEventData) {
        let ev = Arc::new(KvEvent {
            event_id: self.inner.next_id.fetch_add(1, Ordering::Relaxed) + 1,
            namespace,
            storage_tier,
            data,
        });
        self.inner.published.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut subs) = self.inner.subs.lock() {
            subs.retain(|s| match s.tx.try_send(ev.clone()) {
                Ok(()) => true,
                Err(TrySendError::Full(_)) => {
                    s.dropped.fetch_add(1, Ordering::Relaxed);
                    true
                }
                Err(TrySendError::Disconnected(_)) => false,
            });
        }
    }

    /// A new subscription, or `None` when [`SUBSCRIBERS_MAX`] are attached.
    pub fn subscribe(&self) -> Option<Subscription> {
        let mut subs = self.inner.subs.lock().ok()?;
        if subs.len() >= SUBSCRIBERS_MAX {
            return None;
        }
        let (tx, rx) = sync_channel(QUEUE_DEPTH);
        let dropped = Arc::new(AtomicU64::new(0));
        subs.push(Sub {
            tx,
            dropped: dropped.clone(),
        });
        Some(Subscription { rx, dropped })
    }

    /// Subscribers attached now.
    pub fn subscribers(&self) -> usize {
        self.inner.subs.lock().map(|s| s.len()).unwrap_or(0)
    }

    /// Events published since start.
    pub fn published(&self) -> u64 {
        self.inner.published.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_client::BlockKey;

    #[test]
    fn slow_subscriber_loses_events_and_is_told() {
        let bus = EventBus::new();
        let s = bus.subscribe().unwrap();
        for _ in 0..QUEUE_DEPTH + 5 {
            bus.publish(
                NamespaceId([0; 16]),
                StorageTier::Disk,
                KvEventData::Removed {
                    block_hashes: vec![BlockKey::from_u64(1)],
                },
            );
        }
        assert_eq!(s.take_dropped(), 5);
        assert_eq!(s.rx.try_iter().count(), QUEUE_DEPTH);
        drop(s);
        bus.publish(
            NamespaceId([0; 16]),
            StorageTier::Disk,
            KvEventData::Lagged { dropped: 0 },
        );
        assert_eq!(bus.subscribers(), 0);
    }
}
