//! The KV event bus: tiers publish `Stored` / `Removed`, subscribers (socket
//! connections in `kvtier events` or a router) receive them.
//!
//! Bounded everywhere: at most [`SUBSCRIBERS_MAX`] subscribers, each with a
//! queue of [`QUEUE_DEPTH`] events. A subscriber that falls behind loses
//! events instead of slowing the store down; it is told how many with a
//! `Lagged` event before the next one it receives.
//!
//! Event ids are monotonic across restarts without a persisted mark: each
//! run starts counting at its start time in microseconds since the Unix
//! epoch, above every id of an earlier run unless that run averaged more
//! than a million events a second (or the clock went back).
//!
//! Dynamo: once a worker id is set ([`EventBus::set_dynamo_worker`]), an
//! event of a dynamo-mode namespace (learned from its `Stored` blocks,
//! which carry tokens_hash) is stamped with it, so it renders in Dynamo's
//! `RouterEvent` form too; stored blocks of other namespaces, or sent
//! without tokens_hash, stay in kvtier's own form and are counted.

use kvtier_client::events::{KvEvent, KvEventData, StorageTier, StoredBlock};
use kvtier_client::BlockHeader;
use kvtier_client::NamespaceId;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

/// Most concurrent subscribers.
pub const SUBSCRIBERS_MAX: usize = 64;
/// Events queued per subscriber before it starts losing them.
pub const QUEUE_DEPTH: usize = 4096;
/// Dynamo-mode namespaces remembered (past it, new ones are not stamped).
pub const DYNAMO_NAMESPACES_MAX: usize = 4096;

/// The event form of a stored block, with the routing facts its header
/// carries.
pub fn stored_block(header: &BlockHeader) -> StoredBlock {
    let mut b = StoredBlock::new(header.key, header.payload_len);
    if let Some(d) = &header.dynamo {
        b.tokens_hash = Some(d.tokens_hash);
        b.token_ids = d.token_ids.clone();
    }
    b
}

struct Sub {
    tx: SyncSender<Arc<KvEvent>>,
    dropped: Arc<AtomicU64>,
}

impl Sub {
    /// Whether its [`Subscription`] was dropped (it holds the only other
    /// handle of `dropped`).
    fn is_gone(&self) -> bool {
        Arc::strong_count(&self.dropped) == 1
    }
}

struct Inner {
    next_id: AtomicU64,
    subs: Mutex<Vec<Sub>>,
    published: AtomicU64,
    /// The Dynamo worker id (0: none set).
    dynamo_worker: AtomicU64,
    dynamo_namespaces: Mutex<HashSet<NamespaceId>>,
    /// Stored blocks without routing facts (kvtier's form only).
    dynamo_skipped_blocks: AtomicU64,
    /// Keeps ids above the last run's across restarts (the daemon's).
    floor: std::sync::OnceLock<crate::base::id_floor::IdFloor>,
}

/// A cloneable handle to the bus.
#[derive(Clone)]
pub struct EventBus {
    inner: Arc<Inner>,
}

impl Default for EventBus {
    fn default() -> Self {
        let start_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        EventBus {
            inner: Arc::new(Inner {
                next_id: AtomicU64::new(start_us),
                subs: Mutex::new(Vec::new()),
                published: AtomicU64::new(0),
                dynamo_worker: AtomicU64::new(0),
                dynamo_namespaces: Mutex::new(HashSet::new()),
                dynamo_skipped_blocks: AtomicU64::new(0),
                floor: std::sync::OnceLock::new(),
            }),
        }
    }
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

    /// Announces events of dynamo-mode namespaces as Dynamo worker `id`
    /// (0 turns the stamping off).
    pub fn set_dynamo_worker(&self, id: u64) {
        self.inner.dynamo_worker.store(id, Ordering::Relaxed);
    }

    /// The Dynamo worker id, if set.
    pub fn dynamo_worker(&self) -> Option<u64> {
        Some(self.inner.dynamo_worker.load(Ordering::Relaxed)).filter(|&w| w != 0)
    }

    /// Stored blocks published without Dynamo routing facts.
    pub fn dynamo_skipped_blocks(&self) -> u64 {
        self.inner.dynamo_skipped_blocks.load(Ordering::Relaxed)
    }

    /// Whether `ns` is known as a dynamo-mode namespace.
    pub fn is_dynamo_namespace(&self, ns: &NamespaceId) -> bool {
        self.inner
            .dynamo_namespaces
            .lock()
            .map(|s| s.contains(ns))
            .unwrap_or(false)
    }

    /// The worker id to stamp on an event of `ns` (learning dynamo-mode
    /// namespaces from stored blocks with tokens_hash and Dynamo keys).
    fn stamp(&self, ns: &NamespaceId, data: &KvEventData) -> Option<u64> {
        let worker = self.dynamo_worker();
        let Ok(mut known) = self.inner.dynamo_namespaces.lock() else {
            return None;
        };
        match data {
            KvEventData::Stored { blocks, .. } => {
                let routed = blocks
                    .iter()
                    .all(|b| b.tokens_hash.is_some() && b.block_hash.as_u64().is_some());
                if !routed {
                    self.inner
                        .dynamo_skipped_blocks
                        .fetch_add(blocks.len() as u64, Ordering::Relaxed);
                    return None;
                }
                if !known.contains(ns) && known.len() < DYNAMO_NAMESPACES_MAX {
                    known.insert(*ns);
                }
                worker.filter(|_| known.contains(ns))
            }
            KvEventData::Removed { .. } | KvEventData::Cleared => {
                worker.filter(|_| known.contains(ns))
            }
            KvEventData::Lagged { .. } => None,
        }
    }

    /// Keeps event ids above every earlier run's, whatever the clock
    /// says: ids go on from `first` ([`crate::base::id_floor::IdFloor::open`]),
    /// and `floor` records how far they went. Before the first publish.
    pub fn keep_ids_above(&self, floor: crate::base::id_floor::IdFloor, first: u64) {
        self.inner.next_id.fetch_max(first, Ordering::Relaxed);
        let _ = self.inner.floor.set(floor);
    }

    /// Publishes an event to every subscriber without blocking.
    pub fn publish(&self, namespace: NamespaceId, storage_tier: StorageTier, data: KvEventData) {
        let dynamo_worker = self.stamp(&namespace, &data);
        // The id is taken under the lock that orders the sends: two
        // publishers that took ids outside it could send them crossed, and
        // a subscriber (Dynamo's router, vLLM's decoder) sees ids go back.
        // A poisoned list is still a valid list of senders.
        let mut subs = self
            .inner
            .subs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let event_id = self.inner.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(f) = self.inner.floor.get() {
            f.reach(event_id);
        }
        let ev = Arc::new(KvEvent {
            event_id,
            namespace,
            storage_tier,
            data,
            dynamo_worker,
        });
        self.inner.published.fetch_add(1, Ordering::Relaxed);
        subs.retain(|s| match s.tx.try_send(ev.clone()) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                s.dropped.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(TrySendError::Disconnected(_)) => false,
        });
    }

    /// A new subscription, or `None` when [`SUBSCRIBERS_MAX`] are attached.
    pub fn subscribe(&self) -> Option<Subscription> {
        self.subscribe_within(SUBSCRIBERS_MAX)
    }

    /// A new subscription, or `None` when `max` (at most
    /// [`SUBSCRIBERS_MAX`]) are attached: a caller kept off the last slots
    /// leaves them to others.
    pub fn subscribe_within(&self, max: usize) -> Option<Subscription> {
        let mut subs = self.inner.subs.lock().ok()?;
        // Subscribers gone since the last event free their slots now.
        subs.retain(|s| !s.is_gone());
        if subs.len() >= max.min(SUBSCRIBERS_MAX) {
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

    #[test]
    fn a_capped_subscriber_leaves_the_last_slots_and_gone_ones_free_theirs() {
        let bus = EventBus::new();
        let held: Vec<Subscription> = (0..SUBSCRIBERS_MAX - 2)
            .map_while(|_| bus.subscribe_within(SUBSCRIBERS_MAX - 2))
            .collect();
        assert_eq!(held.len(), SUBSCRIBERS_MAX - 2);
        assert!(bus.subscribe_within(SUBSCRIBERS_MAX - 2).is_none());
        let kept = bus.subscribe().unwrap();
        // No event since: a dropped subscription frees its slot at once.
        drop(held);
        assert!(bus.subscribe_within(2).is_some());
        drop(kept);
    }

    #[test]
    fn dynamo_namespaces_are_stamped_others_counted_ids_start_at_the_clock() {
        let bus = EventBus::new();
        bus.set_dynamo_worker(7);
        let s = bus.subscribe().unwrap();
        let (dyn_ns, other) = (NamespaceId([1; 16]), NamespaceId([2; 16]));
        let mut routed = kvtier_client::events::StoredBlock::new(BlockKey::from_u64(3), 1);
        routed.tokens_hash = Some(4);
        let plain = kvtier_client::events::StoredBlock::new(BlockKey::from_u64(5), 1);
        let stored = |b| KvEventData::Stored {
            parent_hash: None,
            blocks: vec![b],
        };
        let removed = KvEventData::Removed {
            block_hashes: vec![BlockKey::from_u64(3)],
        };
        bus.publish(dyn_ns, StorageTier::Disk, stored(routed));
        bus.publish(other, StorageTier::Disk, stored(plain));
        bus.publish(dyn_ns, StorageTier::External, removed.clone());
        bus.publish(other, StorageTier::Disk, removed);
        let got: Vec<_> = s.rx.try_iter().collect();
        let stamps: Vec<_> = got.iter().map(|e| e.dynamo_worker).collect();
        assert_eq!(stamps, [Some(7), None, Some(7), None]);
        assert_eq!(bus.dynamo_skipped_blocks(), 1);
        // Ids: increasing, and above any id of a run that started earlier.
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64;
        assert!(got.windows(2).all(|w| w[1].event_id > w[0].event_id));
        assert!(got[0].event_id <= now_us && got[0].event_id > now_us - 60_000_000);
        std::thread::sleep(std::time::Duration::from_millis(1));
        let later = EventBus::new();
        let s2 = later.subscribe().unwrap();
        later.publish(other, StorageTier::Disk, KvEventData::Cleared);
        assert!(s2.rx.try_recv().unwrap().event_id > got[3].event_id);
    }

    #[test]
    fn concurrent_publishers_reach_a_subscriber_with_increasing_ids() {
        // Ids taken outside the send order reached subscribers crossed (the
        // Dynamo oracle's router met an id below the one before it).
        let bus = EventBus::new();
        let s = bus.subscribe().unwrap();
        let per_thread = QUEUE_DEPTH / 8;
        std::thread::scope(|sc| {
            for t in 0..4u8 {
                let bus = &bus;
                sc.spawn(move || {
                    for _ in 0..per_thread {
                        bus.publish(
                            NamespaceId([t; 16]),
                            StorageTier::Disk,
                            KvEventData::Cleared,
                        );
                    }
                });
            }
        });
        let got: Vec<u64> = s.rx.try_iter().map(|e| e.event_id).collect();
        assert_eq!(got.len(), 4 * per_thread);
        assert!(got.windows(2).all(|w| w[1] > w[0]), "ids went back");
    }
}
