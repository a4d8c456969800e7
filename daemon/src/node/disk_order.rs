//! Disk `Stored` events of promotions in chain order.
//!
//! Promotion workers write fetched blocks into G3 in any order, but a
//! Dynamo router refuses a stored block whose parent it does not know. So a
//! promoted block whose parent (from its header's routing facts) is not
//! announced on G3 yet waits here: while the parent is being promoted
//! (`begin` .. `done`), parked itself, or not on G3 at all (it may be queued
//! for promotion). Bounded like [`super::g4_order`]: at most
//! [`super::g4_order::PARKED_MAX`] wait, none longer than
//! [`super::g4_order::PARKED_MS`].

use super::events::{self, Slot};
use super::g4_order::{PARKED_MAX, PARKED_MS};
use crate::tiers::g3::G3Store;
use kvtier_client::{BlockHeader, BlockKey, NamespaceId};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Key = (NamespaceId, BlockKey);

#[derive(Default)]
struct State {
    /// Promotions between `begin` and `done`.
    writing: HashSet<Key>,
    /// Children by parent, with when they started waiting.
    waiting: HashMap<Key, Vec<(BlockHeader, Instant)>>,
    parked_keys: HashSet<Key>,
}

/// Orders the Disk stored events of promotions (one per node).
pub(super) struct DiskOrder {
    g3: Arc<G3Store>,
    slot: Slot,
    state: Mutex<State>,
}

impl DiskOrder {
    pub(super) fn new(g3: Arc<G3Store>, slot: Slot) -> Self {
        DiskOrder {
            g3,
            slot,
            state: Mutex::new(State::default()),
        }
    }

    /// A promotion of `key` starts writing.
    pub(super) fn begin(&self, ns: &NamespaceId, key: &BlockKey) {
        if let Ok(mut st) = self.state.lock() {
            st.writing.insert((*ns, *key));
        }
    }

    /// The promotion of `header`'s block ended; `stored`: it is new on G3
    /// (announce it, in order), else only its waiting children may go.
    pub(super) fn done(&self, ns: &NamespaceId, header: &BlockHeader, stored: bool) {
        let Ok(mut st) = self.state.lock() else {
            return;
        };
        let me = (*ns, header.key);
        st.writing.remove(&me);
        if !stored {
            if self.g3.stat(ns, &header.key).is_some() {
                self.release(&mut st, me);
            }
            return;
        }
        let parent = header
            .dynamo
            .as_ref()
            .and_then(|d| d.parent)
            .map(|p| (*ns, BlockKey::from_u64(p)));
        let must_wait = parent.is_some_and(|p| {
            st.writing.contains(&p)
                || st.parked_keys.contains(&p)
                || self.g3.stat(&p.0, &p.1).is_none()
        });
        match parent {
            Some(p) if must_wait && st.parked_keys.len() < PARKED_MAX => {
                st.parked_keys.insert(me);
                st.waiting
                    .entry(p)
                    .or_default()
                    .push((header.clone(), Instant::now()));
            }
            _ => {
                events::g3_stored(&self.slot, ns, header, None);
                self.release(&mut st, me);
            }
        }
        self.release_stale(&mut st);
    }

    /// Announces the blocks waiting for `parent`, and theirs.
    fn release(&self, st: &mut State, parent: Key) {
        let mut todo = vec![parent];
        while let Some(p) = todo.pop() {
            for (h, _) in st.waiting.remove(&p).unwrap_or_default() {
                let k = (p.0, h.key);
                st.parked_keys.remove(&k);
                events::g3_stored(&self.slot, &p.0, &h, None);
                todo.push(k);
            }
        }
    }

    fn release_stale(&self, st: &mut State) {
        let limit = Duration::from_millis(PARKED_MS);
        let stale: Vec<Key> = st
            .waiting
            .iter()
            .filter(|(_, kids)| kids.iter().any(|(_, t)| t.elapsed() > limit))
            .map(|(k, _)| *k)
            .collect();
        for p in stale {
            for (h, _) in st.waiting.remove(&p).unwrap_or_default() {
                let k = (p.0, h.key);
                st.parked_keys.remove(&k);
                events::g3_stored(&self.slot, &p.0, &h, None);
                self.release(st, k);
            }
        }
    }
}
