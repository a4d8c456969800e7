//! The default policy: prefix-aware, frequency-weighted recency with hints.
//!
//! Why this shape (measured on the Mooncake conversation trace, see
//! docs/BENCHMARKS.md): recency is the strongest signal in KV traffic, so the
//! score stays an LRU timestamp, and everything else *shifts* it in units of
//! the cache's own lifetime (the most blocks ever tracked, i.e. how many
//! insertions it takes for a block to age out under plain LRU):
//!
//! - **Prefix-aware**: only leaves (blocks with no cached child) are eviction
//!   candidates, so a parent can never go before its children; since every
//!   request touches its chain root-first, a parent's score is never below
//!   the children's that need it.
//! - **Scan resistant**: a block that has never been hit enters `shift`
//!   lifetimes "older" than now; most blocks of agent/chat traffic are used
//!   once (76% on Mooncake), so they leave before proven blocks do, yet a
//!   block reused soon is still kept (SLRU/S3-FIFO, which admit into a small
//!   fixed queue, lose to LRU on this trace exactly because first reuses
//!   come late).
//! - **Frequency-aware**: a proven block gets `shift * log2(1 + hits)`
//!   lifetimes of credit: the probability of another reuse grows with the
//!   hits seen (0.24 fresh, 0.42 after one hit, 0.9 after six on Mooncake),
//!   but only logarithmically, so an old hot block still ages out. Hit
//!   counts outlive eviction in a ghost (TinyLFU's non-resident frequency),
//!   so a hot prefix flushed by a scan returns with its credit.
//! - **Self-tuning**: `shift` is chosen by miniature simulations of this
//!   very policy on a 1-in-8 sample of ids, one per candidate shift
//!   (0 = leaf-ordered LRU); the policy follows whichever has the most recent
//!   hits, so it falls back to LRU where frequency does not pay.
//! - **Hints**: ephemeral blocks form a band evicted before any other; each
//!   priority step adds a lifetime of credit; pinned blocks are never
//!   candidates while pinned, up to a pin budget (pins beyond it are treated
//!   as maximum priority, never as pins).

use super::{BlockMeta, EvictionPolicy};
use kvtier_client::Hints;
use std::collections::{BTreeSet, HashMap, VecDeque};

/// Default pin budget: the fraction of tracked blocks that may be pinned.
/// Pins past it would let a misbehaving engine fill the tier with blocks
/// that can never leave.
pub const PIN_BUDGET_FRACTION: f64 = 0.5;

/// Shifts the miniature simulations try, in lifetimes. 0 is plain
/// (leaf-ordered) LRU, so the policy falls back to LRU wherever frequency
/// does not pay; the grid is coarse on purpose (no fitting to one trace).
const SHIFT_GRID_LIFETIMES: [f64; 4] = [0.0, 0.25, 0.5, 1.0];
/// One id in this many feeds the miniature simulations (spatial sampling,
/// as in SHARDS / miniature simulations, Waldspurger et al., ATC '17).
const SAMPLE_ONE_IN: u64 = 8;
/// Sampled events between two choices of the shift.
const TUNE_EVERY_EVENTS: u64 = 1024;

/// A scaled-down copy of this policy at one fixed shift, fed the sampled ids.
#[derive(Debug)]
struct MiniSim {
    policy: DefaultPolicy,
    /// Hits, halved at every choice so that old behaviour fades.
    hits: f64,
}

/// Chooses the shift by replaying sampled ids through one miniature cache
/// per candidate shift and following the one with most recent hits.
#[derive(Debug)]
struct Tuner {
    sims: Vec<MiniSim>,
    events: u64,
}

impl Tuner {
    fn new() -> Self {
        Self {
            sims: SHIFT_GRID_LIFETIMES
                .iter()
                .map(|&shift| MiniSim {
                    policy: DefaultPolicy::fixed(shift),
                    hits: 0.0,
                })
                .collect(),
            events: 0,
        }
    }

    fn sampled(id: u64) -> bool {
        // splitmix64 finaliser: trace ids are sequential, real ones hashes.
        let mut z = id.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)).is_multiple_of(SAMPLE_ONE_IN)
    }

    /// Feeds one reference; returns a new shift when it is time to choose.
    fn observe(&mut self, id: u64, tracked: usize) -> Option<f64> {
        if !Self::sampled(id) {
            return None;
        }
        let capacity = (tracked as u64 / SAMPLE_ONE_IN).max(1) as usize;
        for sim in &mut self.sims {
            if sim.policy.entries.contains_key(&id) {
                sim.hits += 1.0;
                sim.policy.on_access(id);
            } else {
                while sim.policy.len() >= capacity {
                    let Some(v) = sim.policy.victim(&mut |_| true) else {
                        break;
                    };
                    sim.policy.on_remove(v);
                }
                sim.policy.on_insert(id, BlockMeta::default());
            }
        }
        self.events += 1;
        if !self.events.is_multiple_of(TUNE_EVERY_EVENTS) {
            return None;
        }
        // Most hits wins; ties go to the smaller shift (closer to LRU).
        let mut best = 0;
        for (i, sim) in self.sims.iter().enumerate() {
            if sim.hits > self.sims[best].hits {
                best = i;
            }
        }
        let shift = SHIFT_GRID_LIFETIMES[best];
        for sim in &mut self.sims {
            sim.hits /= 2.0;
        }
        Some(shift)
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    parent: Option<u64>,
    children: u32,
    hits: u32,
    /// The clock at the last insert or hit.
    last: u64,
    hints: Hints,
    /// Counted against the pin budget (only honoured pins).
    pinned: bool,
    /// The candidate-set key while this block is a candidate leaf.
    key: (u8, i64),
}

/// The default eviction policy (`default`). O(log n) per operation.
#[derive(Debug)]
pub struct DefaultPolicy {
    clock: u64,
    entries: HashMap<u64, Entry>,
    /// Evictable leaves ordered by (band, score): band 0 is ephemeral.
    candidates: BTreeSet<((u8, i64), u64)>,
    pinned_blocks: u64,
    pin_budget_blocks: Option<u64>,
    /// Lifetimes by which frequency shifts recency (see the module doc).
    shift: f64,
    /// Chooses `shift`; `None` in the miniature copies themselves.
    tuner: Option<Box<Tuner>>,
    /// Most blocks ever tracked: the lifetime unit (the tier's capacity
    /// once it has filled).
    peak_len: usize,
    /// Hit counts of recently removed blocks (TinyLFU keeps frequency
    /// beyond residency for the same reason: a hot block flushed by a scan
    /// must come back as hot, not as a stranger). Bounded by
    /// `GHOST_LIFETIMES * peak_len`.
    ghost_hits: HashMap<u64, u32>,
    ghost_order: VecDeque<u64>,
}

/// The ghost remembers this many lifetimes of departures (TinyLFU's
/// frequency window is of the same order: ten times the cache).
const GHOST_LIFETIMES: usize = 8;

impl Default for DefaultPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl DefaultPolicy {
    /// An empty policy whose pin budget is [`PIN_BUDGET_FRACTION`] of the
    /// blocks tracked.
    pub fn new() -> Self {
        Self {
            clock: 0,
            entries: HashMap::new(),
            candidates: BTreeSet::new(),
            pinned_blocks: 0,
            pin_budget_blocks: None,
            shift: 0.0,
            tuner: Some(Box::new(Tuner::new())),
            peak_len: 0,
            ghost_hits: HashMap::new(),
            ghost_order: VecDeque::new(),
        }
    }

    /// A policy with a fixed shift (in lifetimes) and no tuning: the
    /// miniature simulations, and experiments.
    pub fn fixed(shift_lifetimes: f64) -> Self {
        Self {
            clock: 0,
            entries: HashMap::new(),
            candidates: BTreeSet::new(),
            pinned_blocks: 0,
            pin_budget_blocks: None,
            shift: shift_lifetimes.max(0.0),
            tuner: None,
            peak_len: 0,
            ghost_hits: HashMap::new(),
            ghost_order: VecDeque::new(),
        }
    }

    fn tune(&mut self, id: u64) {
        let tracked = self.entries.len();
        if let Some(shift) = self.tuner.as_mut().and_then(|t| t.observe(id, tracked)) {
            self.shift = shift;
        }
    }

    /// An empty policy that honours at most `pin_budget_blocks` pins at once.
    pub fn with_pin_budget(pin_budget_blocks: u64) -> Self {
        Self {
            pin_budget_blocks: Some(pin_budget_blocks),
            ..Self::new()
        }
    }

    /// The current frequency shift, in lifetimes (0 = leaf-ordered LRU).
    pub fn shift_lifetimes(&self) -> f64 {
        self.shift
    }

    /// Blocks currently pinned (and honoured as pins).
    pub fn pinned_blocks(&self) -> u64 {
        self.pinned_blocks
    }

    fn pin_budget(&self) -> u64 {
        self.pin_budget_blocks
            .unwrap_or(((self.entries.len() as f64) * PIN_BUDGET_FRACTION).ceil() as u64)
    }

    /// The score: recency shifted by frequency and priority, in lifetimes.
    fn key_of(&self, e: &Entry) -> (u8, i64) {
        let lifetime = self.peak_len.max(1) as f64;
        let freq = if e.hits == 0 {
            -self.shift
        } else {
            self.shift * f64::from(e.hits + 1).log2()
        };
        let prio = f64::from(e.hints.priority);
        // A pin refused for budget still counts as the highest priority.
        let prio = if e.hints.pinned && !e.pinned {
            prio.max(f64::from(u8::MAX))
        } else {
            prio
        };
        let score = e.last as f64 + lifetime * (freq + prio);
        (u8::from(!e.hints.ephemeral), score as i64)
    }

    fn is_candidate(e: &Entry) -> bool {
        e.children == 0 && !e.pinned
    }

    /// Recomputes `id`'s key (after a touch or a hint change) and its place
    /// in the candidate set.
    fn refresh(&mut self, id: u64) {
        let Some(e) = self.entries.get(&id).copied() else {
            return;
        };
        self.candidates.remove(&(e.key, id));
        let key = self.key_of(&e);
        if let Some(slot) = self.entries.get_mut(&id) {
            slot.key = key;
        }
        if Self::is_candidate(&e) {
            self.candidates.insert((key, id));
        }
    }

    fn apply_hints(&mut self, id: u64, hints: Hints) {
        let budget = self.pin_budget();
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        let want_pin = hints.pinned;
        if want_pin && !e.pinned && self.pinned_blocks < budget {
            e.pinned = true;
            self.pinned_blocks += 1;
        } else if !want_pin && e.pinned {
            e.pinned = false;
            self.pinned_blocks -= 1;
        }
        e.hints = hints;
    }
}

impl EvictionPolicy for DefaultPolicy {
    fn name(&self) -> &'static str {
        "default"
    }

    fn on_insert(&mut self, id: u64, meta: BlockMeta) {
        if self.entries.contains_key(&id) {
            self.on_hints(id, meta.hints);
            self.on_access(id);
            return;
        }
        self.tune(id);
        self.clock += 1;
        let parent = meta.parent.filter(|p| self.entries.contains_key(p));
        // A returning block is a re-reference: its old hits plus this one.
        let hits = self
            .ghost_hits
            .remove(&id)
            .map_or(0, |h| h.saturating_add(1));
        let entry = Entry {
            parent,
            children: 0,
            hits,
            last: self.clock,
            hints: Hints::default(),
            pinned: false,
            key: (0, 0),
        };
        self.entries.insert(id, entry);
        self.peak_len = self.peak_len.max(self.entries.len());
        if let Some(p) = parent {
            if let Some(pe) = self.entries.get_mut(&p) {
                pe.children += 1;
                let (key, was_leaf) = (pe.key, pe.children == 1);
                if was_leaf {
                    self.candidates.remove(&(key, p));
                }
            }
        }
        self.apply_hints(id, meta.hints);
        self.refresh(id);
    }

    fn on_access(&mut self, id: u64) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.hits = e.hits.saturating_add(1);
            self.clock += 1;
            e.last = self.clock;
            self.refresh(id);
            self.tune(id);
        }
    }

    fn on_remove(&mut self, id: u64) {
        let Some(e) = self.entries.remove(&id) else {
            return;
        };
        self.candidates.remove(&(e.key, id));
        if e.pinned {
            self.pinned_blocks -= 1;
        }
        // Every departure is remembered, hits or not: a block that returns
        // within the ghost's reach has proved a reuse the tier missed.
        if self.ghost_hits.insert(id, e.hits).is_none() {
            self.ghost_order.push_back(id);
            while self.ghost_order.len() > self.peak_len.max(1) * GHOST_LIFETIMES {
                if let Some(old) = self.ghost_order.pop_front() {
                    self.ghost_hits.remove(&old);
                }
            }
        }
        // Children that outlive their parent (a forced delete) become roots.
        // Rare, so a scan is acceptable and keeps the entry small.
        if e.children > 0 {
            for c in self.entries.values_mut() {
                if c.parent == Some(id) {
                    c.parent = None;
                }
            }
        }
        if let Some(p) = e.parent {
            if let Some(pe) = self.entries.get_mut(&p) {
                pe.children = pe.children.saturating_sub(1);
                // Back to a leaf: it competes with the score of its last
                // touch, not a fresh one.
                if pe.children == 0 && !pe.pinned {
                    self.candidates.insert((pe.key, p));
                }
            }
        }
    }

    fn on_hints(&mut self, id: u64, hints: Hints) {
        self.apply_hints(id, hints);
        self.refresh(id);
    }

    fn victim(&mut self, can_evict: &mut dyn FnMut(u64) -> bool) -> Option<u64> {
        self.candidates
            .iter()
            .map(|&(_, id)| id)
            .find(|&id| can_evict(id))
    }

    fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(parent: Option<u64>) -> BlockMeta {
        BlockMeta {
            parent,
            ..BlockMeta::default()
        }
    }

    #[test]
    fn leaves_go_before_their_parents() {
        let mut p = DefaultPolicy::new();
        p.on_insert(1, meta(None));
        p.on_insert(2, meta(Some(1)));
        p.on_insert(3, meta(Some(2)));
        // Root-first touching makes the root the least recent block.
        for id in [1, 2, 3] {
            p.on_access(id);
        }
        assert_eq!(p.victim(&mut |_| true), Some(3));
        p.on_remove(3);
        assert_eq!(p.victim(&mut |_| true), Some(2));
    }

    #[test]
    fn over_budget_pins_are_not_honoured() {
        let mut p = DefaultPolicy::with_pin_budget(1);
        let pin = BlockMeta {
            hints: Hints {
                pinned: true,
                ..Hints::default()
            },
            ..BlockMeta::default()
        };
        p.on_insert(1, pin);
        p.on_insert(2, pin);
        assert_eq!(p.pinned_blocks(), 1);
        assert_eq!(p.victim(&mut |_| true), Some(2));
        p.on_hints(1, Hints::default());
        assert_eq!(p.pinned_blocks(), 0);
        assert_eq!(p.victim(&mut |_| true), Some(1));
    }
}
