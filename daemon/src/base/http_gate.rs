//! Admission of TCP connections on the peer and metrics ports, before
//! anything is known of the caller. A fixed number of slots would let a
//! flood of silent connections hold them all (300 made every signed peer
//! request fail; 80 starved `/metrics`, the liveness probe's port), so:
//! - a connection must send its first byte within a short deadline
//!   ([`first_byte`]);
//! - until it has earned a slot (a peer request that passed the signature
//!   check; a metrics request being answered) a connection is *pending* and
//!   may be evicted, oldest first, to admit a new one: silent connections
//!   cannot keep out one that speaks;
//! - pending connections from one source address are capped, and when the
//!   cap is reached the address's own oldest pending connection is the one
//!   evicted, so one address floods only itself;
//! - only when every slot is held by a connection that earned it is a new
//!   connection refused.
//!
//! Descriptors stay bounded: an evicted connection's descriptor is closed
//! by its own task a moment later, so the accept loop waits
//! ([`Gate::room`]) while slots plus evictions in progress reach
//! `connections_max` and an eighth.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::oneshot;

/// Bounds of one port.
#[derive(Debug, Clone, Copy)]
pub struct GateLimits {
    /// Connections open at once (pending and served).
    pub connections_max: usize,
    /// Pending connections from one source address.
    pub pending_per_addr_max: usize,
}

struct Pending {
    id: u64,
    addr: IpAddr,
    /// Dropped to evict: the connection's task sees its receiver end.
    evict: oneshot::Sender<()>,
}

#[derive(Default)]
struct Inner {
    next_id: u64,
    pending: VecDeque<Pending>,
    served: HashMap<u64, (IpAddr, oneshot::Sender<()>)>,
    /// Evicted, their tasks not yet gone (their descriptors still open).
    evicting: usize,
    evicted: u64,
    refused: u64,
}

impl Inner {
    fn fds(&self) -> usize {
        self.pending.len() + self.served.len() + self.evicting
    }
}

/// The slots of one port.
pub struct Gate {
    limits: GateLimits,
    inner: Mutex<Inner>,
    /// Woken whenever a connection goes.
    gone: tokio::sync::Notify,
}

/// One admitted connection's slot, given back on drop.
pub struct Ticket {
    gate: Arc<Gate>,
    id: u64,
}

/// Resolves when the connection has been evicted (pending only).
pub type Evicted = oneshot::Receiver<()>;

impl Gate {
    /// A gate with `limits` (each at least 1).
    pub fn new(limits: GateLimits) -> Arc<Gate> {
        Arc::new(Gate {
            limits: GateLimits {
                connections_max: limits.connections_max.max(1),
                pending_per_addr_max: limits.pending_per_addr_max.max(1),
            },
            inner: Mutex::new(Inner::default()),
            gone: tokio::sync::Notify::new(),
        })
    }

    fn fds_max(&self) -> usize {
        self.limits.connections_max + (self.limits.connections_max / 8).max(1)
    }

    /// Waits until a connection may be accepted without the descriptors
    /// of open and evicted-but-not-yet-closed connections passing
    /// `connections_max` and an eighth.
    pub async fn room(&self) {
        loop {
            let gone = self.gone.notified();
            tokio::pin!(gone);
            gone.as_mut().enable();
            if self.lock().fds() < self.fds_max() {
                return;
            }
            gone.await;
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every update is a few statements on plain collections; a panic
        // elsewhere leaves them consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits a connection from `addr`, evicting a pending one if needed;
    /// `None`: every slot is held by a connection that earned it.
    pub fn admit(self: &Arc<Self>, addr: IpAddr) -> Option<(Ticket, Evicted)> {
        let mut g = self.lock();
        let from_addr = g.pending.iter().filter(|p| p.addr == addr).count();
        let victim = if from_addr >= self.limits.pending_per_addr_max {
            g.pending.iter().position(|p| p.addr == addr)
        } else if g.pending.len() + g.served.len() >= self.limits.connections_max {
            if g.pending.is_empty() {
                g.refused += 1;
                return None;
            }
            Some(0)
        } else {
            None
        };
        if let Some(i) = victim {
            // Dropping its sender wakes the evicted connection's task.
            g.pending.remove(i);
            g.evicting += 1;
            g.evicted += 1;
        }
        let id = g.next_id;
        g.next_id += 1;
        let (tx, rx) = oneshot::channel();
        g.pending.push_back(Pending {
            id,
            addr,
            evict: tx,
        });
        Some((
            Ticket {
                gate: self.clone(),
                id,
            },
            rx,
        ))
    }

    /// (evicted, refused) so far.
    pub fn counts(&self) -> (u64, u64) {
        let g = self.lock();
        (g.evicted, g.refused)
    }

    /// Connections open now (pending, served).
    pub fn open(&self) -> (usize, usize) {
        let g = self.lock();
        (g.pending.len(), g.served.len())
    }
}

impl Ticket {
    /// The connection earned its slot: it is no longer evicted for others.
    /// False when it had already been evicted.
    pub fn served(&self) -> bool {
        let mut g = self.gate.lock();
        let Some(i) = g.pending.iter().position(|p| p.id == self.id) else {
            return g.served.contains_key(&self.id);
        };
        let Some(p) = g.pending.remove(i) else {
            return false;
        };
        g.served.insert(self.id, (p.addr, p.evict));
        true
    }

    /// The connection is idle again (between requests): evictable, as the
    /// newest pending one.
    pub fn idle(&self) {
        let mut g = self.gate.lock();
        if let Some((addr, evict)) = g.served.remove(&self.id) {
            g.pending.push_back(Pending {
                id: self.id,
                addr,
                evict,
            });
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        {
            let mut g = self.gate.lock();
            if g.served.remove(&self.id).is_none() {
                let before = g.pending.len();
                g.pending.retain(|p| p.id != self.id);
                if g.pending.len() == before {
                    // It had been evicted: its descriptor goes now.
                    g.evicting = g.evicting.saturating_sub(1);
                }
            }
        }
        self.gate.gone.notify_waiters();
    }
}

/// Waits up to `within` for the first byte of `stream` (without reading
/// it); false when none came (silent, closed, or `evicted` first).
pub async fn first_byte(
    stream: &tokio::net::TcpStream,
    within: Duration,
    evicted: &mut Evicted,
) -> bool {
    let mut b = [0u8; 1];
    tokio::select! {
        r = tokio::time::timeout(within, stream.peek(&mut b)) => matches!(r, Ok(Ok(n)) if n > 0),
        _ = evicted => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, n])
    }

    #[test]
    fn silent_connections_are_evicted_for_new_ones_and_served_ones_stay() {
        let g = Gate::new(GateLimits {
            connections_max: 4,
            pending_per_addr_max: 3,
        });
        let (served, _rx) = g.admit(ip(1)).unwrap();
        assert!(served.served());
        let mut flood = Vec::new();
        for _ in 0..10 {
            flood.push(g.admit(ip(2)).unwrap());
        }
        // ip(2) floods only itself: 3 pending at most, the oldest evicted.
        assert_eq!(g.open(), (3, 1));
        assert!(!flood[0].0.served(), "the oldest of the flood was evicted");
        // A newcomer from elsewhere gets in, evicting the oldest pending.
        let (t, _r) = g.admit(ip(3)).unwrap();
        assert!(t.served());
        assert_eq!(g.open(), (2, 2));
        // All slots earned: the next is refused.
        let more: Vec<_> = (0..2).map(|i| g.admit(ip(10 + i)).unwrap()).collect();
        for (t, _) in &more {
            assert!(t.served());
        }
        assert!(g.admit(ip(9)).is_none());
        drop(more);
        assert!(g.admit(ip(9)).is_some());
        // Idle again: evictable.
        t.idle();
        assert_eq!(g.counts().1, 1);
    }
}
