//! External `Stored` events in chain order, each with its parent.
//!
//! Uploads finish in any order, but a Dynamo router refuses a stored block
//! whose parent it does not know (`ParentBlockNotFound`) and would never
//! route to it, and any consumer of kvtier's own form needs the parent to
//! place the block. A block's parent comes from its header's routing facts
//! (dynamo mode) or, for blake3 namespaces, whose headers name none, from
//! the offload that stored it this run ([`G4Order::stored`], kept until
//! the upload; a block re-queued by a restart has no parent to tell). A
//! block whose parent is still on G3 and not yet safe in G4 waits here
//! until the parent is announced. Marking a block safe and announcing it happen under one lock,
//! so "parent marked in G4" always means "parent announced" (this run or an
//! earlier one). Bounded: at most [`PARKED_MAX`] blocks wait, none longer
//! than [`PARKED_MS`] (a parent that is never uploaded, e.g. ephemeral,
//! must not hold its children back for ever).

use super::events::{self, Slot};
use crate::tiers::g3::G3Store;
use kvtier_client::{BlockHeader, BlockKey, NamespaceId};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Blocks waiting for their parent's announcement, at most.
pub const PARKED_MAX: usize = 4096;
/// Longest wait for a parent, in ms.
pub const PARKED_MS: u64 = 5_000;
/// Offloads' parents remembered until their upload, at most (past it the
/// oldest are forgotten: those blocks are announced without a parent).
pub const PARENTS_MAX: usize = 65_536;

struct Parked {
    header: BlockHeader,
    parent: Option<BlockKey>,
    since: Instant,
}

/// Parents given by offloads, oldest first.
#[derive(Default)]
struct Parents {
    of: HashMap<(NamespaceId, BlockKey), BlockKey>,
    order: VecDeque<(NamespaceId, BlockKey)>,
}

#[derive(Default)]
struct State {
    /// Children by (namespace, parent key).
    waiting: HashMap<(NamespaceId, BlockKey), Vec<Parked>>,
    /// The parked blocks themselves: marked in G4 but not announced yet,
    /// so their children must wait too.
    parked_keys: HashSet<(NamespaceId, BlockKey)>,
    parked: usize,
}

/// Orders External stored events (one per node).
pub(super) struct G4Order {
    g3: Arc<G3Store>,
    slot: Slot,
    state: Mutex<State>,
    parents: Mutex<Parents>,
}

impl G4Order {
    pub(super) fn new(g3: Arc<G3Store>, slot: Slot) -> Self {
        G4Order {
            g3,
            slot,
            state: Mutex::new(State::default()),
            parents: Mutex::new(Parents::default()),
        }
    }

    /// An offload stored `key` under `parent` (a block whose header names
    /// no parent): remembered for its External event.
    pub(super) fn stored(&self, ns: &NamespaceId, key: &BlockKey, parent: BlockKey) {
        let Ok(mut p) = self.parents.lock() else {
            return;
        };
        while p.order.len() >= PARENTS_MAX {
            let Some(old) = p.order.pop_front() else {
                break;
            };
            p.of.remove(&old);
        }
        if p.of.insert((*ns, *key), parent).is_none() {
            p.order.push_back((*ns, *key));
        }
    }

    /// The parent an offload gave `key` (forgotten: it is announced now).
    fn take_parent(&self, ns: &NamespaceId, key: &BlockKey) -> Option<BlockKey> {
        self.parents.lock().ok()?.of.remove(&(*ns, *key))
    }

    /// `key` was uploaded: mark it safe in G4 and announce it (and every
    /// child waiting for it), or park it until its parent is announced.
    pub(super) fn uploaded(&self, ns: &NamespaceId, key: &BlockKey) {
        let header = super::uplink::read_header(&self.g3, ns, key);
        let given = self.take_parent(ns, key);
        let Ok(mut st) = self.state.lock() else {
            return;
        };
        // A block uploaded twice (a re-queue at start racing a fresh
        // store) is announced once: by whoever marks it.
        if !self.g3.mark_in_g4(ns, key) {
            return;
        }
        let Some(header) = header else {
            tracing::warn!(%ns, %key, "g4: uploaded block has no readable G3 header; not announced");
            return;
        };
        let parent = header
            .dynamo
            .as_ref()
            .and_then(|d| d.parent)
            .map(BlockKey::from_u64)
            .or(given);
        let must_wait = parent.is_some_and(|p| {
            // Waits for a parent that is parked itself, or on G3 and not
            // yet safe in G4.
            st.parked_keys.contains(&(*ns, p)) || self.g3.stat(ns, &p).is_some_and(|i| !i.in_g4)
        });
        if must_wait && st.parked < PARKED_MAX {
            if let Some(p) = parent {
                st.parked += 1;
                st.parked_keys.insert((*ns, header.key));
                st.waiting.entry((*ns, p)).or_default().push(Parked {
                    header,
                    parent,
                    since: Instant::now(),
                });
            }
        } else {
            self.announce(&mut st, ns, header, parent);
        }
        self.release_stale(&mut st);
    }

    /// Publishes `header`'s block under `parent`, then its waiting
    /// descendants.
    fn announce(
        &self,
        st: &mut State,
        ns: &NamespaceId,
        header: BlockHeader,
        parent: Option<BlockKey>,
    ) {
        let mut todo = vec![(header, parent)];
        while let Some((h, parent)) = todo.pop() {
            events::g4_stored(&self.slot, ns, &h, parent);
            st.parked_keys.remove(&(*ns, h.key));
            if let Some(kids) = st.waiting.remove(&(*ns, h.key)) {
                st.parked -= kids.len();
                todo.extend(kids.into_iter().map(|k| (k.header, k.parent)));
            }
        }
    }

    /// Announces children that waited past [`PARKED_MS`].
    fn release_stale(&self, st: &mut State) {
        let limit = Duration::from_millis(PARKED_MS);
        let stale: Vec<(NamespaceId, BlockKey)> = st
            .waiting
            .iter()
            .filter(|(_, kids)| kids.iter().any(|k| k.since.elapsed() > limit))
            .map(|(k, _)| *k)
            .collect();
        for k in stale {
            if let Some(kids) = st.waiting.remove(&k) {
                st.parked -= kids.len();
                for kid in kids {
                    self.announce(st, &k.0, kid.header, kid.parent);
                }
            }
        }
    }
}
