//! Eviction policies: what a full tier keeps.
//!
//! Policies see blocks as opaque `u64` ids (the index's handles, or a trace's
//! hash ids in replay) with a little metadata. The same code runs inside the
//! daemon and in `kvtier bench replay`.

use kvtier_client::Hints;

pub mod admission;
#[cfg(any(test, feature = "bench"))]
pub mod belady;
pub mod default;
pub mod lru;
#[cfg(any(test, feature = "bench"))]
pub mod replay;
#[cfg(any(test, feature = "bench"))]
pub mod synth;
#[cfg(any(test, feature = "bench"))]
pub mod trace;

pub use admission::G4Admission;
#[cfg(any(test, feature = "bench"))]
pub use belady::Belady;
pub use default::DefaultPolicy;
pub use lru::Lru;

/// What a policy knows about a block when it is inserted.
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockMeta {
    /// The block before it in its chain, if known (prefix awareness).
    pub parent: Option<u64>,
    /// Bytes it occupies.
    pub size_bytes: u64,
    /// Engine hints.
    pub hints: Hints,
}

/// An eviction policy. Not thread-safe by itself: the tier serialises calls.
pub trait EvictionPolicy: Send {
    /// Policy name (`lru`, `default`).
    fn name(&self) -> &'static str;
    /// A block was admitted.
    fn on_insert(&mut self, id: u64, meta: BlockMeta);
    /// A block was read (a hit).
    fn on_access(&mut self, id: u64);
    /// A block left the tier for any reason (evicted, deleted, corrupt).
    fn on_remove(&mut self, id: u64);
    /// Hints changed (pin, unpin, priority).
    fn on_hints(&mut self, id: u64, hints: Hints) {
        let _ = (id, hints);
    }
    /// The next block to evict among those for which `can_evict` is true
    /// (the tier refuses leased and pinned blocks). The policy does not
    /// forget the block until `on_remove`.
    fn victim(&mut self, can_evict: &mut dyn FnMut(u64) -> bool) -> Option<u64>;
    /// Blocks tracked.
    fn len(&self) -> usize;
    /// Whether nothing is tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The daemon's policy for a configured name (`lru`, `default`); `None` for
/// an unknown name or one that exists only in replays (`belady`).
pub fn by_name(name: &str) -> Option<Box<dyn EvictionPolicy>> {
    match name {
        "lru" => Some(Box::new(Lru::leaves_first())),
        "default" => Some(Box::new(DefaultPolicy::new())),
        _ => None,
    }
}
