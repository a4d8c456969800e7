//! Per-uid shares of the server's bounded resources, so that one local user
//! cannot lock the others out: each uid may hold at most a share of the
//! connections, event subscriptions, leases, pins and in-flight onboards
//! (fetches), and what it cannot take stays free for everyone else.

use kvtier_client::{BlockKey, NamespaceId};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Per-uid bounds; `None`: unbounded per uid (only the global bounds hold).
#[derive(Debug, Clone, Default)]
pub struct UidLimits {
    /// Connections one uid holds at once.
    pub connections_per_uid_max: Option<usize>,
    /// Event subscriptions one uid holds at once.
    pub subscribers_per_uid_max: Option<usize>,
    /// Onboard requests (each up to 4096 fetches) one uid has in flight.
    pub onboards_per_uid_max: Option<usize>,
    /// Leases one uid holds over all its connections.
    pub leases_per_uid_max: Option<usize>,
    /// Live pins one uid has made.
    pub pins_per_uid_max: Option<usize>,
    /// Bytes of blocks (header + payload) one account (a tenant, or a uid
    /// without tenants) holds pinned, by pin requests and by offloads with
    /// the pin hint.
    pub pin_bytes_per_tenant_max: Option<u64>,
    /// The backend's longest pin (a pin counts against its uid this long
    /// at most).
    pub pin_ttl_max_ms: u32,
    /// Connections of one uid that have not completed their hello.
    pub hellos_per_uid_max: Option<usize>,
    /// Bytes of blocks one uid holds leased.
    pub lease_bytes_per_uid_max: Option<u64>,
    /// Namespaces holding blocks that one uid (not root) has offloaded
    /// into.
    pub namespaces_per_uid_max: Option<usize>,
    /// Connections only admins may take (of `max_connections`).
    pub admin_connections_reserved: usize,
    /// Event subscriptions only admins may take (of the bus's slots).
    pub admin_subscribers_reserved: usize,
}

/// A counted resource.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Res {
    Conn = 0,
    Sub = 1,
    Onboard = 2,
    Lease = 3,
    Hello = 4,
}

const RES_COUNT: usize = 5;

#[derive(Default)]
struct Use {
    held: [usize; RES_COUNT],
    lease_bytes: u64,
    /// Live pins: until when (`None`: until unpinned, an offload's pin
    /// hint) and the bytes charged.
    pins: HashMap<(NamespaceId, BlockKey), (Option<Instant>, u64)>,
    pin_bytes: u64,
    namespaces: std::collections::HashSet<NamespaceId>,
}

impl Use {
    fn is_empty(&self) -> bool {
        self.held == [0; RES_COUNT]
            && self.lease_bytes == 0
            && self.pins.is_empty()
            && self.namespaces.is_empty()
    }
}

pub(crate) struct Quotas {
    limits: UidLimits,
    used: Mutex<HashMap<u32, Use>>,
}

impl Quotas {
    pub(crate) fn new(limits: UidLimits) -> Quotas {
        Quotas {
            limits,
            used: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u32, Use>> {
        // Counters stay consistent under a panic elsewhere (each update is
        // one statement), so a poisoned lock is still usable.
        self.used.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The bounds.
    pub(crate) fn limits(&self) -> &UidLimits {
        &self.limits
    }

    fn max(&self, r: Res) -> Option<usize> {
        match r {
            Res::Conn => self.limits.connections_per_uid_max,
            Res::Sub => self.limits.subscribers_per_uid_max,
            Res::Onboard => self.limits.onboards_per_uid_max,
            Res::Lease => self.limits.leases_per_uid_max,
            Res::Hello => self.limits.hellos_per_uid_max,
        }
    }

    /// The bound for `r`, for error messages.
    pub(crate) fn limit_of(&self, r: Res) -> usize {
        self.max(r).unwrap_or(usize::MAX)
    }

    /// Takes one `r` for `uid`; false when the uid's share is used up.
    pub(crate) fn take(&self, uid: u32, r: Res) -> bool {
        let mut m = self.lock();
        let u = m.entry(uid).or_default();
        if self.max(r).is_some_and(|max| u.held[r as usize] >= max) {
            return false;
        }
        u.held[r as usize] += 1;
        true
    }

    /// Gives back `n` of `r`.
    pub(crate) fn give(&self, uid: u32, r: Res, n: usize) {
        let mut m = self.lock();
        if let Some(u) = m.get_mut(&uid) {
            u.held[r as usize] = u.held[r as usize].saturating_sub(n);
            if u.is_empty() {
                m.remove(&uid);
            }
        }
    }

    /// Whether leased bytes are bounded per uid (then the caller sizes
    /// each lease).
    pub(crate) fn lease_bytes_bounded(&self) -> Option<u64> {
        self.limits.lease_bytes_per_uid_max
    }

    /// Takes `n` leased bytes for `uid`; false past its share.
    pub(crate) fn take_lease_bytes(&self, uid: u32, n: u64) -> bool {
        let Some(max) = self.limits.lease_bytes_per_uid_max else {
            return true;
        };
        let mut m = self.lock();
        let u = m.entry(uid).or_default();
        if u.lease_bytes.saturating_add(n) > max {
            return false;
        }
        u.lease_bytes += n;
        true
    }

    /// Gives back `n` leased bytes.
    pub(crate) fn give_lease_bytes(&self, uid: u32, n: u64) {
        let mut m = self.lock();
        if let Some(u) = m.get_mut(&uid) {
            u.lease_bytes = u.lease_bytes.saturating_sub(n);
            if u.is_empty() {
                m.remove(&uid);
            }
        }
    }

    /// Whether `uid` may pin `key` of `bytes` for `ttl_ms` (`None`: until
    /// unpinned) now, within its count and bytes (a refresh of its own
    /// live pin always may); records it on `true`. `still_pinned` tells,
    /// when the share looks spent, whether a pin without a deadline still
    /// holds (an admin may have evicted or unpinned the block).
    pub(crate) fn pin(
        &self,
        uid: u32,
        ns: &NamespaceId,
        key: &BlockKey,
        ttl_ms: Option<u32>,
        bytes: u64,
        still_pinned: impl Fn(&NamespaceId, &BlockKey) -> bool,
    ) -> bool {
        let (count_max, bytes_max) = (
            self.limits.pins_per_uid_max,
            self.limits.pin_bytes_per_tenant_max,
        );
        if count_max.is_none() && bytes_max.is_none() {
            return true;
        }
        let now = Instant::now();
        let until = ttl_ms
            .map(|ms| now + Duration::from_millis(u64::from(ms.min(self.limits.pin_ttl_max_ms))));
        let fits = |u: &Use| {
            count_max.is_none_or(|m| u.pins.len() < m)
                && bytes_max.is_none_or(|m| u.pin_bytes.saturating_add(bytes) <= m)
        };
        let mut m = self.lock();
        let u = m.entry(uid).or_default();
        if let Some((_, old)) = u.pins.remove(&(*ns, *key)) {
            u.pin_bytes = u.pin_bytes.saturating_sub(old);
        } else if !fits(u) {
            let mut freed = 0u64;
            u.pins.retain(|(n, k), (t, b)| {
                let keep = match t {
                    Some(t) => *t > now,
                    None => still_pinned(n, k),
                };
                if !keep {
                    freed += *b;
                }
                keep
            });
            u.pin_bytes = u.pin_bytes.saturating_sub(freed);
            if !fits(u) {
                return false;
            }
        }
        u.pins.insert((*ns, *key), (until, bytes));
        u.pin_bytes = u.pin_bytes.saturating_add(bytes);
        true
    }

    /// Whether pins are bounded per account in bytes (then the caller
    /// sizes each pin, offloads with the pin hint included).
    pub(crate) fn pin_bytes_bounded(&self) -> bool {
        self.limits.pin_bytes_per_tenant_max.is_some()
    }

    /// Whether `uid` may offload into `ns`: one it offloaded into before,
    /// or a new one while it has fewer than its share that still hold
    /// blocks (`held`); records it on `true`. Root is not bounded.
    pub(crate) fn namespace(
        &self,
        uid: u32,
        ns: &NamespaceId,
        held: impl Fn(&NamespaceId) -> bool,
    ) -> bool {
        let Some(max) = self.limits.namespaces_per_uid_max.filter(|_| uid != 0) else {
            return true;
        };
        let mut m = self.lock();
        let u = m.entry(uid).or_default();
        if u.namespaces.contains(ns) {
            return true;
        }
        if u.namespaces.len() >= max {
            u.namespaces.retain(|n| held(n));
            if u.namespaces.len() >= max {
                return false;
            }
        }
        u.namespaces.insert(*ns);
        true
    }

    /// Forgets a pin (unpinned, or the pin failed).
    pub(crate) fn unpin(&self, uid: u32, ns: &NamespaceId, key: &BlockKey) {
        if let Some(u) = self.lock().get_mut(&uid) {
            if let Some((_, b)) = u.pins.remove(&(*ns, *key)) {
                u.pin_bytes = u.pin_bytes.saturating_sub(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn one_uid_exhausting_its_share_leaves_others_served() {
        let q = Quotas::new(UidLimits {
            connections_per_uid_max: Some(2),
            pins_per_uid_max: Some(1),
            pin_ttl_max_ms: 60_000,
            ..Default::default()
        });
        assert!(q.take(1, Res::Conn) && q.take(1, Res::Conn));
        assert!(!q.take(1, Res::Conn));
        assert!(q.take(2, Res::Conn));
        q.give(1, Res::Conn, 1);
        assert!(q.take(1, Res::Conn));
        // Unbounded resources always succeed.
        assert!((0..100).all(|_| q.take(1, Res::Lease)));
        let (ns, k) = (
            NamespaceId([1; 16]),
            BlockKey::from_bytes(&[1; 32]).unwrap(),
        );
        let k2 = BlockKey::from_bytes(&[2; 32]).unwrap();
        assert!(q.pin(1, &ns, &k, Some(1000), 1, |_, _| true));
        assert!(
            q.pin(1, &ns, &k, Some(1000), 1, |_, _| true),
            "a refresh of its own pin"
        );
        assert!(!q.pin(1, &ns, &k2, Some(1000), 1, |_, _| true));
        assert!(q.pin(2, &ns, &k2, Some(1000), 1, |_, _| true));
        q.unpin(1, &ns, &k);
        assert!(q.pin(1, &ns, &k2, Some(1000), 1, |_, _| true));
    }

    #[test]
    fn pinned_bytes_are_bounded_per_account_and_given_back() {
        let q = Quotas::new(UidLimits {
            pin_bytes_per_tenant_max: Some(100),
            pin_ttl_max_ms: 60_000,
            ..Default::default()
        });
        let ns = NamespaceId([1; 16]);
        let k = |i: u8| BlockKey::from_bytes(&[i; 32]).unwrap();
        let yes = |_: &NamespaceId, _: &BlockKey| true;
        assert!(q.pin(1, &ns, &k(1), Some(1000), 60, yes));
        assert!(!q.pin(1, &ns, &k(2), Some(1000), 60, yes), "past 100 bytes");
        assert!(q.pin(1, &ns, &k(1), Some(1000), 60, yes), "a refresh");
        assert!(q.pin(2, &ns, &k(2), Some(1000), 60, yes), "another account");
        q.unpin(1, &ns, &k(1));
        // A pin until unpinned (an offload's hint) counts until it is gone.
        assert!(q.pin(1, &ns, &k(3), None, 60, yes));
        assert!(!q.pin(1, &ns, &k(4), None, 60, yes));
        assert!(q.pin(1, &ns, &k(4), None, 60, |_, key| *key != k(3)));
    }

    #[test]
    fn expired_pins_stop_counting() {
        let q = Quotas::new(UidLimits {
            pins_per_uid_max: Some(1),
            pin_ttl_max_ms: 60_000,
            ..Default::default()
        });
        let ns = NamespaceId([1; 16]);
        let (k, k2) = (
            BlockKey::from_bytes(&[1; 32]).unwrap(),
            BlockKey::from_bytes(&[2; 32]).unwrap(),
        );
        assert!(q.pin(1, &ns, &k, Some(1), 1, |_, _| true));
        std::thread::sleep(Duration::from_millis(5));
        assert!(q.pin(1, &ns, &k2, Some(1000), 1, |_, _| true));
    }
}
