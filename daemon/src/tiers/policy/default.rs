//! The default policy: prefix-aware recency, shifted by a reuse probability
//! learned online per block class, with hints.
//!
//! Why this shape (measured on the Mooncake conversation trace and on
//! synthetic chat/agent/conversation shapes, see docs/BENCHMARKS.md):
//! recency is the strongest single signal in KV traffic, so the score stays
//! an LRU timestamp; what LRU lacks is knowing that most blocks (76% on
//! Mooncake) are never used again while some kinds of blocks almost always
//! are. So each block belongs to a *class* of observable features, the
//! policy measures each class's reuse probability `p` as the traffic runs,
//! and a block enters the recency order shifted by `ln(p / p_max)` mean
//! reuse ages: under a reuse time that decays exponentially with the mean
//! observed reuse age, `p * exp(-age / mean)` is the block's chance of
//! another use, and ordering by it is ordering by `last + mean * ln(p)`.
//! Nothing is fitted to a trace: the probabilities and the mean age are
//! measured, and with one class (or equal probabilities) the order is LRU.
//! The mean age is the class's own (shrunk towards the pooled mean, not
//! below it): a class reused late decays slower than the pooled mean says.
//!
//! - **Classes** (all observable through the policy trait): hits so far
//!   (0, 1, 2-3, 4-7, 8+); the chain's *generation* (how many times the
//!   chain has been extended after a pause: a conversation's turn); the
//!   length of the *burst* the block was stored in (blocks stored one after
//!   another, each the parent of the next: one request's new blocks), and
//!   whether the block *ended* its burst (a request's last, partial block,
//!   which the next turn replaces instead of reusing). Bursts are inferred
//!   from parent links, so the trait is unchanged.
//! - **Learning**: every insert or hit starts a "stage" in the block's
//!   class; a stage ends as a reuse when the block is hit, or when it comes
//!   back after eviction while the ghost still remembers it. The ghost is
//!   what makes the estimate honest: without it a class the policy evicts
//!   early would never show its late reuses and would be evicted ever
//!   earlier. Counts decay, so the classes follow the traffic.
//! - **Ghost**: 32-bit fingerprints of departed blocks with their class and
//!   last touch, in two generations of one lifetime (the most blocks ever
//!   tracked) each: 12 bytes a slot instead of an id queue plus a map.
//!   A returning block counts as hit once (it proved a reuse).
//! - **Prefix-aware**: only leaves (blocks with no cached child) are
//!   eviction candidates, so a parent can never go before its children.
//! - **Scale, by set dueling**: the shifts are in units of the mean reuse
//!   age, which is only a proxy for how fast reuse decays at the ages
//!   where eviction happens. Two shadows of this policy (scale 1 and 2)
//!   replay the references of one chain in 16 at that sample's share of
//!   the capacity, and the tier uses the scale whose shadow hits more.
//!   Sampling is by chain (the depth-1 block's fingerprint), so shadows see
//!   whole conversations; they cost about 1/8 of the entries again.
//! - **Hints**: ephemeral blocks form a band evicted before any other; each
//!   priority step adds a lifetime of credit; pinned blocks are never
//!   candidates while pinned, up to a pin budget (pins beyond it are treated
//!   as maximum priority, never as pins).
//!
//! Interleaved requests in the daemon split bursts (a burst ends when a
//! block's parent is not the block stored just before): the classes are
//! then coarser, and the learned probabilities absorb it.

use super::{BlockMeta, EvictionPolicy};
use kvtier_client::Hints;
use std::collections::{BTreeSet, HashMap};

/// Default pin budget: the fraction of tracked blocks that may be pinned.
/// Pins past it would let a misbehaving engine fill the tier with blocks
/// that can never leave.
pub const PIN_BUDGET_FRACTION: f64 = 0.5;

/// Hit-count buckets: 0, 1, 2-3, 4-7, 8+.
const HIT_BUCKETS: usize = 5;
/// Generation buckets: 0, 1, 2, 3+.
const GEN_BUCKETS: usize = 4;
/// Burst-length buckets: 0 = burst still open, then 1, 2-3, 4-7, 8-15, 16+.
const BURST_BUCKETS: usize = 6;
/// Burst length from which the bucket no longer changes: ids past it need
/// not be remembered until the burst ends.
const BURST_SATURATED: u32 = 16;
/// Number of classes (hits x generation x burst end x burst length).
const CLASSES: usize = HIT_BUCKETS * GEN_BUCKETS * 2 * BURST_BUCKETS;
const _: () = assert!(CLASSES <= 256, "classes are stored in a u8");
/// Events between two recomputations of the per-class shifts.
const SHIFT_EVERY_EVENTS: u64 = 1024;
/// Events between two decays of the statistics, and the decay factor: a
/// half-life of about 280k events, long enough for rare classes to gather
/// evidence, short enough to follow a change of traffic.
const DECAY_EVERY_EVENTS: u64 = 4096;
const DECAY: f64 = 0.99;
/// Prior of every class: half a reuse in one stage (p = 0.5, no opinion).
const PRIOR_REUSES: f64 = 0.5;
const PRIOR_STAGES: f64 = 1.0;
/// Weight of the pooled mean reuse age in a class's own mean (in reuses).
const CLASS_AGE_PRIOR_REUSES: f64 = 2.0;
/// The value threshold of the key, in lifetimes of decay at the pooled
/// reuse age (see `Learner::recompute`). Chosen on the tune seeds as the
/// largest value whose double still keeps the default at or above LRU on
/// every tune trace (0.5; 1 gains more there but 2 falls 0.007 below LRU
/// on rag).
const EXPIRY_LIFETIMES: f64 = 0.5;
/// Floor of a class probability inside the logarithm (bounds the shift).
const P_FLOOR: f64 = 1e-4;

fn fingerprint(id: u64) -> u32 {
    // splitmix64 finaliser: trace ids are sequential, real ones hashes.
    let mut z = id.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) as u32
}

fn duel_samples(id: u64) -> bool {
    fingerprint(id).is_multiple_of(DUEL_SAMPLE)
}

fn hit_bucket(hits: u8) -> usize {
    match hits {
        0 => 0,
        1 => 1,
        2..=3 => 2,
        4..=7 => 3,
        _ => 4,
    }
}

fn burst_bucket(len: u32) -> u8 {
    // 1 -> 1, 2-3 -> 2, 4-7 -> 3, 8-15 -> 4, 16+ -> 5.
    (32 - len.leading_zeros()).min(BURST_BUCKETS as u32 - 1) as u8
}

/// Departed blocks: fingerprint -> (last touch, class), in two generations
/// of at most one lifetime of departures each.
#[derive(Debug, Default)]
struct Ghost {
    current: HashMap<u32, (u32, u8)>,
    previous: HashMap<u32, (u32, u8)>,
}

impl Ghost {
    fn remember(&mut self, id: u64, last_touch: u64, class: u8, lifetime: usize) {
        if self.current.len() >= lifetime.max(1) {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current
            .insert(fingerprint(id), (last_touch as u32, class));
    }

    fn take(&mut self, id: u64) -> Option<(u32, u8)> {
        let fp = fingerprint(id);
        self.current
            .remove(&fp)
            .or_else(|| self.previous.remove(&fp))
    }
}

/// Per-class reuse statistics and the shifts derived from them.
#[derive(Debug)]
struct Learner {
    stages: Vec<f64>,
    reuses: Vec<f64>,
    reuse_age_sum: f64,
    reuse_count: f64,
    /// Sum of reuse ages per class (decayed with the counts): a class's
    /// own time scale.
    class_age_sum: Vec<f64>,
    /// `ln(p / p_max) * mean reuse age`, per class (<= 0).
    shift: Vec<f64>,
}

impl Learner {
    fn new() -> Self {
        Self {
            stages: vec![0.0; CLASSES],
            reuses: vec![0.0; CLASSES],
            reuse_age_sum: 0.0,
            reuse_count: 0.0,
            class_age_sum: vec![0.0; CLASSES],
            shift: vec![0.0; CLASSES],
        }
    }

    fn reuse(&mut self, class: u8, age: u64) {
        self.reuses[usize::from(class)] += 1.0;
        self.class_age_sum[usize::from(class)] += age as f64;
        self.reuse_age_sum += age as f64;
        self.reuse_count += 1.0;
    }

    fn probability(&self, class: usize) -> f64 {
        (self.reuses[class] + PRIOR_REUSES) / (self.stages[class] + PRIOR_STAGES)
    }

    fn recompute(&mut self, lifetime: f64, scale: f64) {
        let mean_age = if self.reuse_count >= 1.0 {
            self.reuse_age_sum / self.reuse_count
        } else {
            lifetime
        };
        let p_max = (0..CLASSES)
            .map(|c| self.probability(c))
            .fold(P_FLOOR, f64::max);
        for c in 0..CLASSES {
            let p = self.probability(c).max(P_FLOOR);
            // The class's own mean reuse age (a class reused late decays
            // slower than the pooled mean says), shrunk towards the pooled
            // mean by a prior of CLASS_AGE_PRIOR_REUSES reuses at it, and
            // not below it: the expiry term below then never shortens a
            // class's stay, it only lengthens that of classes reused late.
            let own = ((self.class_age_sum[c] + mean_age * CLASS_AGE_PRIOR_REUSES)
                / (self.reuses[c] + CLASS_AGE_PRIOR_REUSES))
                .max(mean_age);
            // The key is the time at which the block's value
            // `p * exp(-age / own)` falls to a threshold `theta`:
            // `last + own * ln(p / theta)`. With one time scale for all
            // classes `theta` only adds a constant; with a class's own
            // scale it does not, and a class reused late keeps its value
            // longer. `ln(p_max / theta)` is set to EXPIRY_LIFETIMES
            // lifetimes at the pooled scale, and the constant part (the
            // same for every class) is dropped.
            let expiry = EXPIRY_LIFETIMES * lifetime / mean_age.max(1.0);
            self.shift[c] = ((p / p_max).ln() + expiry) * own - expiry * mean_age;
            self.shift[c] *= scale;
        }
    }

    fn decay(&mut self) {
        for v in self
            .stages
            .iter_mut()
            .chain(self.reuses.iter_mut())
            .chain(self.class_age_sum.iter_mut())
        {
            *v *= DECAY;
        }
        self.reuse_age_sum *= DECAY;
        self.reuse_count *= DECAY;
    }
}

/// One chain in this many (by the fingerprint of its depth-1 block) feeds
/// the duel's shadows.
const DUEL_SAMPLE: u32 = 16;
/// The shift scales the duel compares: the mean reuse age measured on all
/// reuses is only a proxy for how fast reuse decays at the ages where
/// eviction happens, and that relation depends on the traffic.
const DUEL_SCALES: [f64; 2] = [1.0, 2.0];
/// A challenger must beat the current scale's shadow by this fraction of
/// its hits to take over (hysteresis against sampling noise).
const DUEL_MARGIN: f64 = 0.02;
/// Shadow references between two decisions (and decays) of the duel.
const DUEL_EVERY: u64 = 2048;

/// Set dueling over the shift scale: shadows of this policy, one per
/// candidate scale, replay the references of a sample of chains at the
/// sample's share of the capacity; the tier uses the scale whose shadow
/// hits most. Measured online, so nothing is fitted to a trace.
#[derive(Debug)]
struct Duel {
    shadows: Vec<Shadow>,
    references: u64,
    sampled: u64,
    current: usize,
}

#[derive(Debug)]
struct Shadow {
    policy: DefaultPolicy,
    hits: f64,
}

impl Duel {
    fn new() -> Self {
        let shadows = DUEL_SCALES
            .iter()
            .map(|&scale| Shadow {
                policy: DefaultPolicy {
                    scale,
                    duel: None,
                    ..DefaultPolicy::bare()
                },
                hits: 0.0,
            })
            .collect();
        Self {
            shadows,
            references: 0,
            sampled: 0,
            current: 0,
        }
    }

    /// Replays one reference in every shadow; `Some(scale)` when the duel
    /// changes its choice.
    fn reference(&mut self, id: u64, meta: BlockMeta, capacity: usize) -> Option<f64> {
        for s in &mut self.shadows {
            let p = &mut s.policy;
            if p.entries.contains_key(&id) {
                s.hits += 1.0;
                p.on_access(id);
                continue;
            }
            let parent = meta.parent.filter(|q| p.entries.contains_key(q));
            p.on_insert(id, BlockMeta { parent, ..meta });
            while p.len() > capacity {
                let Some(v) = p.victim(&mut |_| true) else {
                    break;
                };
                p.on_remove(v);
            }
        }
        if self.sampled.is_multiple_of(DUEL_EVERY) {
            self.decide()
        } else {
            None
        }
    }

    /// Picks the shadow with the most (decayed) hits, with hysteresis.
    fn decide(&mut self) -> Option<f64> {
        let cur = self.shadows[self.current].hits;
        let (best, best_hits) = self
            .shadows
            .iter()
            .enumerate()
            .map(|(i, s)| (i, s.hits))
            .fold((self.current, cur), |a, b| if b.1 > a.1 { b } else { a });
        for s in &mut self.shadows {
            s.hits *= DECAY;
        }
        if best != self.current && best_hits > cur * (1.0 + DUEL_MARGIN) {
            self.current = best;
            return Some(self.shadows[best].policy.scale);
        }
        None
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    parent: Option<u64>,
    /// The clock at the last insert or hit.
    last: u64,
    /// Score in the candidate set (band from `hints.ephemeral`).
    key: i64,
    /// `born` of the parent when linked: a parent removed and stored
    /// again is another block, whose child count this one is not part of.
    parent_born: u32,
    /// The clock at insertion (truncated), naming this incarnation.
    born: u32,
    children: u32,
    hints: Hints,
    hits: u8,
    /// Generation bucket (see the module doc).
    gen: u8,
    /// Burst-length bucket, 0 while the burst is open.
    burst: u8,
    class: u8,
    /// [`TAIL`], [`PINNED`], [`SAMPLED`]: one byte keeps the entry at 56.
    flags: u8,
}

/// Ended its burst.
const TAIL: u8 = 1;
/// Counted against the pin budget (only honoured pins).
const PINNED: u8 = 2;
/// Its chain feeds the duel: decided by the fingerprint of the chain's
/// depth-1 block, so whole conversations are sampled together.
const SAMPLED: u8 = 4;

impl Entry {
    fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }

    fn set(&mut self, flag: u8, on: bool) {
        if on {
            self.flags |= flag;
        } else {
            self.flags &= !flag;
        }
    }

    fn class(&self) -> u8 {
        let c = ((hit_bucket(self.hits) * GEN_BUCKETS + usize::from(self.gen)) * 2
            + usize::from(self.has(TAIL)))
            * BURST_BUCKETS
            + usize::from(self.burst);
        c as u8
    }

    fn band(&self) -> u8 {
        u8::from(!self.hints.ephemeral)
    }
}

/// The default eviction policy (`default`). O(log n) per operation (plus
/// O(number of classes) every [`SHIFT_EVERY_EVENTS`]).
#[derive(Debug)]
pub struct DefaultPolicy {
    clock: u64,
    entries: HashMap<u64, Entry>,
    /// Evictable leaves ordered by (band, score): band 0 is ephemeral.
    candidates: BTreeSet<((u8, i64), u64)>,
    pinned_blocks: u64,
    pin_budget_blocks: Option<u64>,
    /// Most blocks ever tracked: the lifetime unit (the tier's capacity
    /// once it has filled).
    peak_len: usize,
    learner: Learner,
    ghost: Ghost,
    /// The last block stored, while its burst is open.
    open_tail: Option<u64>,
    /// Blocks of the open burst (up to [`BURST_SATURATED`]).
    burst_ids: Vec<u64>,
    burst_len: u32,
    /// Multiplier of the mean reuse age in the class shifts (see [`Duel`]).
    scale: f64,
    duel: Option<Box<Duel>>,
}

impl Default for DefaultPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl DefaultPolicy {
    /// An empty policy whose pin budget is [`PIN_BUDGET_FRACTION`] of the
    /// blocks tracked.
    pub fn new() -> Self {
        let duel = Box::new(Duel::new());
        Self {
            scale: duel.shadows[0].policy.scale,
            duel: Some(duel),
            ..Self::bare()
        }
    }

    /// A policy without a duel (the duel's shadows are these).
    fn bare() -> Self {
        Self {
            clock: 0,
            entries: HashMap::new(),
            candidates: BTreeSet::new(),
            pinned_blocks: 0,
            pin_budget_blocks: None,
            peak_len: 0,
            learner: Learner::new(),
            ghost: Ghost::default(),
            open_tail: None,
            burst_ids: Vec::with_capacity(BURST_SATURATED as usize),
            burst_len: 0,
            scale: 1.0,
            duel: None,
        }
    }

    /// An empty policy that honours at most `pin_budget_blocks` pins at once.
    pub fn with_pin_budget(pin_budget_blocks: u64) -> Self {
        Self {
            pin_budget_blocks: Some(pin_budget_blocks),
            ..Self::new()
        }
    }

    /// Blocks currently pinned (and honoured as pins).
    pub fn pinned_blocks(&self) -> u64 {
        self.pinned_blocks
    }

    /// The learned reuse probability of each class that has seen at least
    /// `min_stages` stages, as (class index, stages, probability): for
    /// diagnostics and tests.
    pub fn class_probabilities(&self, min_stages: f64) -> Vec<(usize, f64, f64)> {
        (0..CLASSES)
            .filter(|&c| self.learner.stages[c] >= min_stages)
            .map(|c| (c, self.learner.stages[c], self.learner.probability(c)))
            .collect()
    }

    fn pin_budget(&self) -> u64 {
        self.pin_budget_blocks
            .unwrap_or(((self.entries.len() as f64) * PIN_BUDGET_FRACTION).ceil() as u64)
    }

    fn lifetime(&self) -> f64 {
        self.peak_len.max(1) as f64
    }

    /// Advances the clock by one event; recomputes and decays on schedule.
    fn tick(&mut self) {
        self.clock += 1;
        if self.clock.is_multiple_of(SHIFT_EVERY_EVENTS) {
            let lifetime = self.lifetime();
            self.learner.recompute(lifetime, self.scale);
        }
        if self.clock.is_multiple_of(DECAY_EVERY_EVENTS) {
            self.learner.decay();
        }
    }

    /// The score: recency shifted by class and priority.
    fn score(&self, e: &Entry) -> i64 {
        let prio = f64::from(e.hints.priority);
        // A pin refused for budget still counts as the highest priority.
        let prio = if e.hints.pinned && !e.has(PINNED) {
            prio.max(f64::from(u8::MAX))
        } else {
            prio
        };
        let shift = self.learner.shift[usize::from(e.class)];
        (e.last as f64 + shift + self.lifetime() * prio) as i64
    }

    fn is_candidate(e: &Entry) -> bool {
        e.children == 0 && !e.has(PINNED)
    }

    fn unlist(&mut self, id: u64) {
        if let Some(e) = self.entries.get(&id) {
            self.candidates.remove(&((e.band(), e.key), id));
        }
    }

    /// Recomputes `id`'s class (moving its open stage along) and key, and
    /// its place in the candidate set.
    fn refresh(&mut self, id: u64) {
        self.unlist(id);
        let Some(mut e) = self.entries.get(&id).copied() else {
            return;
        };
        let class = e.class();
        if class != e.class {
            let old = &mut self.learner.stages[usize::from(e.class)];
            *old = (*old - 1.0).max(0.0);
            self.learner.stages[usize::from(class)] += 1.0;
            e.class = class;
        }
        e.key = self.score(&e);
        if Self::is_candidate(&e) {
            self.candidates.insert(((e.band(), e.key), id));
        }
        self.entries.insert(id, e);
    }

    /// Ends the open burst unless `continued_by` (the parent of the block
    /// being stored) is its last block: the burst's blocks learn its length
    /// and the last one that it ended the burst.
    fn close_burst(&mut self, continued_by: Option<u64>) {
        let Some(tail) = self.open_tail else {
            return;
        };
        if continued_by == Some(tail) {
            return;
        }
        self.open_tail = None;
        let bucket = burst_bucket(self.burst_len);
        let ids = std::mem::take(&mut self.burst_ids);
        for &id in &ids {
            if let Some(e) = self.entries.get_mut(&id) {
                e.burst = bucket;
                if id == tail {
                    e.set(TAIL, true);
                }
            }
            self.refresh(id);
        }
        if let Some(e) = self.entries.get_mut(&tail) {
            e.burst = bucket;
            e.set(TAIL, true);
        }
        self.refresh(tail);
        self.burst_ids = ids;
        self.burst_ids.clear();
        self.burst_len = 0;
    }

    /// Feeds a reference of a sampled chain to the duel's shadows, and
    /// adopts the best shadow's scale.
    fn referenced(&mut self, id: u64, sampled: bool, meta: BlockMeta) {
        let Some(duel) = self.duel.as_mut() else {
            return;
        };
        duel.references += 1;
        if !sampled {
            return;
        }
        duel.sampled += 1;
        let share = duel.sampled as f64 / duel.references as f64;
        let capacity = ((self.peak_len as f64) * share).ceil().max(1.0) as usize;
        if let Some(scale) = duel.reference(id, meta, capacity) {
            self.scale = scale;
        }
    }

    fn apply_hints(&mut self, id: u64, hints: Hints) {
        let budget = self.pin_budget();
        self.unlist(id);
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        let want_pin = hints.pinned;
        if want_pin && !e.has(PINNED) && self.pinned_blocks < budget {
            e.set(PINNED, true);
            self.pinned_blocks += 1;
        } else if !want_pin && e.has(PINNED) {
            e.set(PINNED, false);
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
        let parent = meta.parent.filter(|p| self.entries.contains_key(p));
        let same_burst = parent.is_some() && parent == self.open_tail;
        self.close_burst(parent);
        self.tick();
        // A returning block is a reuse the tier missed: its class learns
        // it, and it comes back as hit once.
        let hits = match self.ghost.take(id) {
            Some((touched, class)) => {
                let age = u64::from((self.clock as u32).wrapping_sub(touched));
                self.learner.reuse(class, age);
                1
            }
            None => 0,
        };
        let (gen, parent_born, sampled) =
            parent
                .and_then(|p| self.entries.get(&p))
                .map_or((0, 0, duel_samples(id)), |pe| {
                    let gen = if same_burst { pe.gen } else { pe.gen + 1 };
                    // A root's children start chains; deeper blocks inherit.
                    let sampled = if pe.parent.is_none() {
                        duel_samples(id)
                    } else {
                        pe.has(SAMPLED)
                    };
                    (gen.min(GEN_BUCKETS as u8 - 1), pe.born, sampled)
                });
        self.burst_len = self.burst_len.saturating_add(1);
        let burst = if self.burst_len > BURST_SATURATED {
            burst_bucket(self.burst_len)
        } else {
            self.burst_ids.push(id);
            0
        };
        let mut entry = Entry {
            parent,
            last: self.clock,
            key: 0,
            parent_born,
            born: self.clock as u32,
            children: 0,
            hints: Hints::default(),
            hits,
            gen,
            burst,
            class: 0,
            flags: if sampled { SAMPLED } else { 0 },
        };
        entry.class = entry.class();
        self.learner.stages[usize::from(entry.class)] += 1.0;
        self.entries.insert(id, entry);
        self.peak_len = self.peak_len.max(self.entries.len());
        if let Some(p) = parent {
            self.unlist(p);
            if let Some(pe) = self.entries.get_mut(&p) {
                pe.children += 1;
            }
        }
        self.open_tail = Some(id);
        self.apply_hints(id, meta.hints);
        self.refresh(id);
        self.referenced(id, sampled, BlockMeta { parent, ..meta });
    }

    fn on_access(&mut self, id: u64) {
        if !self.entries.contains_key(&id) {
            return;
        }
        // A lookup starts a new request: whatever was being stored ended.
        self.close_burst(None);
        self.tick();
        let clock = self.clock;
        if let Some(e) = self.entries.get_mut(&id) {
            self.learner.reuse(e.class, clock - e.last);
            e.hits = e.hits.saturating_add(1);
            e.last = clock;
            // A new stage: the old class's was counted at the last touch.
            let class = e.class();
            e.class = class;
            self.learner.stages[usize::from(class)] += 1.0;
        }
        self.refresh(id);
        if let Some(e) = self.entries.get(&id).copied() {
            let meta = BlockMeta {
                parent: e.parent,
                size_bytes: 0,
                hints: e.hints,
            };
            self.referenced(id, e.has(SAMPLED), meta);
        }
    }

    fn on_remove(&mut self, id: u64) {
        self.unlist(id);
        let Some(e) = self.entries.remove(&id) else {
            return;
        };
        if e.has(PINNED) {
            self.pinned_blocks -= 1;
        }
        if self.open_tail == Some(id) {
            self.close_burst(None);
        }
        let lifetime = self.peak_len;
        self.ghost.remember(id, e.last, e.class, lifetime);
        // Children that outlive their parent (a forced delete) keep a stale
        // link; `parent_born` tells them apart from a re-stored parent, so
        // nothing needs scanning here.
        if let Some(p) = e.parent {
            let is_leaf_again = match self.entries.get_mut(&p) {
                Some(pe) if pe.born == e.parent_born => {
                    pe.children = pe.children.saturating_sub(1);
                    pe.children == 0
                }
                _ => false,
            };
            if is_leaf_again {
                // Back to a leaf: it competes with the score of its last
                // touch, not a fresh one.
                self.refresh(p);
            }
        }
    }

    fn on_hints(&mut self, id: u64, hints: Hints) {
        self.apply_hints(id, hints);
        self.refresh(id);
    }

    fn victim(&mut self, can_evict: &mut dyn FnMut(u64) -> bool) -> Option<u64> {
        // The block just stored is spared while its burst may continue:
        // evicting it would orphan the rest of the request.
        let open = self.open_tail;
        let mut spared = None;
        for &(_, id) in &self.candidates {
            if Some(id) == open {
                spared = Some(id);
                continue;
            }
            if can_evict(id) {
                return Some(id);
            }
        }
        spared.filter(|&id| can_evict(id))
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
    fn duel_switches_scale_only_on_a_clear_win() {
        let mut d = Duel::new();
        d.shadows[0].hits = 100.0;
        d.shadows[1].hits = 101.0;
        assert_eq!(d.decide(), None, "within the margin");
        d.shadows[0].hits = 100.0;
        d.shadows[1].hits = 200.0;
        assert_eq!(d.decide(), Some(DUEL_SCALES[1]));
        assert_eq!(d.decide(), None, "already chosen");
        d.shadows[0].hits = 300.0;
        assert_eq!(d.decide(), Some(DUEL_SCALES[0]));
    }

    #[test]
    fn duel_shadows_are_bounded_by_their_sample_share() {
        // A full tier of 2000 blocks under a stream of one-shot chains off
        // one shared root: the shadows see about one chain in 16 and hold
        // at most their share of the capacity.
        let cap = 2000;
        let mut p = DefaultPolicy::new();
        let mut next = 1u64;
        p.on_insert(0, meta(None));
        for _ in 0..4000 {
            p.on_access(0);
            let mut parent = Some(0);
            for _ in 0..5 {
                p.on_insert(next, meta(parent));
                parent = Some(next);
                next += 1;
                while p.len() > cap {
                    let v = p.victim(&mut |_| true).unwrap();
                    p.on_remove(v);
                }
            }
        }
        let duel = p.duel.as_ref().unwrap();
        let share = duel.sampled as f64 / duel.references as f64;
        assert!(share > 0.02 && share < 0.15, "share {share}");
        for s in &duel.shadows {
            assert!(!s.policy.is_empty(), "a shadow saw nothing");
            assert!(
                s.policy.len() as f64 <= (cap as f64 * share).ceil() + 1.0,
                "shadow holds {} of {cap} at share {share}",
                s.policy.len()
            );
        }
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

    #[test]
    fn removing_a_parent_leaves_children_consistent() {
        let mut p = DefaultPolicy::new();
        p.on_insert(1, meta(None));
        p.on_insert(2, meta(Some(1)));
        // A forced delete of the parent, then the same id stored again.
        p.on_remove(1);
        p.on_insert(1, meta(None));
        p.on_insert(3, meta(Some(1)));
        // The orphan's departure must not touch the new parent's count.
        p.on_remove(2);
        assert_eq!(p.entries.get(&1).map(|e| e.children), Some(1));
        p.on_remove(3);
        assert_eq!(p.entries.get(&1).map(|e| e.children), Some(0));
        assert_eq!(p.victim(&mut |_| true), Some(1));
    }

    #[test]
    fn learns_that_burst_ends_are_not_reused() {
        // Each turn re-reads the previous turn but its last block, then
        // stores four new blocks: ends of bursts are never reused, the
        // rest always (no evictions: the tier is large).
        let mut p = DefaultPolicy::new();
        let mut next = 1u64;
        let mut prev: Vec<u64> = Vec::new();
        for _ in 0..3000 {
            let keep = prev.len().saturating_sub(1);
            for &id in &prev[..keep] {
                p.on_access(id);
            }
            let mut parent = prev[..keep].last().copied();
            let mut ids = prev[..keep].to_vec();
            for _ in 0..4 {
                p.on_insert(next, meta(parent));
                parent = Some(next);
                ids.push(next);
                next += 1;
            }
            // Conversations restart now and then, to bound chain depth.
            prev = if ids.len() > 40 { Vec::new() } else { ids };
        }
        let classes = p.class_probabilities(100.0);
        let is_tail = |c: usize| (c / BURST_BUCKETS) % 2 == 1;
        assert!(classes.iter().any(|&(c, _, _)| is_tail(c)));
        for (c, stages, prob) in classes {
            eprintln!("class {c}: {stages:.0} stages, p {prob:.3}");
            if is_tail(c) {
                assert!(prob < 0.05, "tail class {c} learned p {prob}");
            } else if c < BURST_BUCKETS * 2 * GEN_BUCKETS {
                // Never hit yet, not a burst end: reused unless the
                // conversation restarts (one turn in ten).
                assert!(prob > 0.8, "reused class {c} learned p {prob}");
            }
        }
    }

    #[test]
    fn per_block_state_stays_small() {
        // The memory budget (docs/internals/policy.md): an entry, a map slot,
        // a candidate-set key and at most two ghost slots per tracked block.
        let entry = std::mem::size_of::<(u64, Entry)>();
        let ghost_slot = std::mem::size_of::<(u32, (u32, u8))>();
        eprintln!("entry slot {entry} B, ghost slot {ghost_slot} B");
        assert!(entry <= 64, "entry slot {entry} B");
        assert!(ghost_slot <= 12, "ghost slot {ghost_slot} B");
    }

    #[test]
    fn burst_end_learns_the_tail_and_length() {
        let mut p = DefaultPolicy::new();
        p.on_insert(1, meta(None));
        p.on_insert(2, meta(Some(1)));
        p.on_insert(3, meta(Some(2)));
        // A new request: its lookup closes the first burst.
        p.on_access(1);
        let e = |id| p.entries.get(&id).copied().unwrap();
        assert!(e(3).has(TAIL) && !e(2).has(TAIL));
        assert_eq!(e(2).burst, burst_bucket(3));
        // Storing after a hit: the next generation of the chain.
        p.on_insert(4, meta(Some(2)));
        assert_eq!(p.entries.get(&4).map(|e| e.gen), Some(1));
    }
}
