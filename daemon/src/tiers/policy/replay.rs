//! Trace replay: the same policy code the daemon runs, driven by a trace.
//!
//! Semantics (prefix hits): a request hits the leading run of its blocks
//! that is cached, reads those (a policy access each, root first), and
//! stops at the first miss; every block from there on that is not cached is
//! then stored with `parent` = the id before it.
//!
//! API boundary: the replay loop talks to a [`ReplayTarget`]. The dry-run
//! target here ([`PolicyTarget`]) keeps only ids; a target backed by a real
//! daemon (blocks with bytes derived from each id) plugs into the same loop.

use super::admission::{AdmissionEvent, G4Admission};
use super::belady::{Belady, ReplayClock};
use super::trace::{ratio, RequestHints, Trace};
use super::{BlockMeta, DefaultPolicy, EvictionPolicy, Lru};
use crate::base::error::{Error, Result};
use kvtier_client::Hints;
use std::collections::{HashMap, HashSet};
use std::str::FromStr;

/// A cache the replay drives.
pub trait ReplayTarget {
    /// What is being replayed against (for reports).
    fn describe(&self) -> String;
    /// Length of the leading run of `ids` that is cached; those blocks are
    /// read (hits), root first.
    fn lookup(&mut self, ids: &[u64]) -> Result<usize>;
    /// Stores the blocks `ids[from..]` not yet cached; the parent of
    /// `ids[i]` is `ids[i - 1]`.
    fn store(&mut self, ids: &[u64], from: usize) -> Result<()>;
    /// [`ReplayTarget::store`] with the engine hints of the request, if
    /// the trace has them; a target that cannot pass them on ignores them.
    fn store_with_hints(
        &mut self,
        ids: &[u64],
        from: usize,
        hints: Option<RequestHints>,
    ) -> Result<()> {
        let _ = hints;
        self.store(ids, from)
    }
    /// Blocks held now.
    fn len_blocks(&self) -> u64;
    /// Called before request `index` is replayed (offline policies need it).
    fn begin_request(&mut self, index: u64) {
        let _ = index;
    }
    /// Blocks served from a second tier (G4) so far, for the two-tier TTFT
    /// model; 0 for a target without one.
    fn g4_hit_blocks(&self) -> u64 {
        0
    }
}

/// The policies a replay can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// Exact LRU (the baseline).
    Lru,
    /// [`DefaultPolicy`].
    Default,
    /// Offline optimum (replay only).
    Belady,
}

impl PolicyKind {
    /// Name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::Default => "default",
            PolicyKind::Belady => "belady",
        }
    }
}

impl FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "lru" => Ok(Self::Lru),
            "default" => Ok(Self::Default),
            "belady" => Ok(Self::Belady),
            _ => Err(format!("unknown policy `{s}` (lru | default | belady)")),
        }
    }
}

/// The dry-run target: a capacity in blocks and a policy, no bytes.
pub struct PolicyTarget {
    policy: Box<dyn EvictionPolicy>,
    clock: ReplayClock,
    capacity_blocks: u64,
    cached: HashSet<u64>,
    evictions: u64,
    g4: Option<G4Model>,
    /// G3's own rules, when the dry run stands for kvtierd.
    g3: Option<G3Rules>,
}

/// What G3 adds to its policy's choices, for a dry run that must decide as
/// kvtierd does ([`PolicyTarget::kvtierd`]): a block with a cached child
/// is never a victim (g3/chains.rs, whatever the policy), the block a
/// batch continues is never a victim while room is made for the batch
/// (g3/spare.rs), and a block whose parent is not cached is refused (no
/// lookup could reach it). Not modeled: G3's open tails (the last block of
/// a batch for `g3.open_tail_grace_ms` after it, which a write's eviction
/// takes only when no other leaf may go): they follow the wall clock, so a
/// replay through kvtierd that must equal this runs with them off
/// (`open_tail_grace_ms = 0`, tools' replay_daemon).
#[derive(Debug, Default)]
struct G3Rules {
    parent_of: HashMap<u64, u64>,
    children: HashMap<u64, u32>,
    /// The parents of the batch being stored (the block it continues and
    /// its own blocks but the last).
    spared: HashSet<u64>,
}

impl G3Rules {
    fn may_evict(&self, id: u64) -> bool {
        !self.spared.contains(&id) && self.children.get(&id).is_none_or(|&n| n == 0)
    }

    fn link(&mut self, id: u64, parent: u64) {
        self.parent_of.insert(id, parent);
        *self.children.entry(parent).or_default() += 1;
    }

    fn unlink(&mut self, id: u64) {
        if let Some(p) = self.parent_of.remove(&id) {
            if let Some(n) = self.children.get_mut(&p) {
                *n -= 1;
                if *n == 0 {
                    self.children.remove(&p);
                }
            }
        }
    }
}

/// A modeled G4 behind a dry-run G3: written per an admission rule, read
/// through on a G3 miss.
#[derive(Debug, Clone, Default)]
pub struct G4Model {
    /// The admission rule.
    pub admission: G4Admission,
    /// Blocks in G4 (unbounded).
    pub blocks: HashSet<u64>,
    /// Blocks written to G4 by this node.
    pub written_blocks: u64,
    /// Blocks this node read from G4 (G3 misses that G4 served).
    pub hit_blocks: u64,
}

impl std::fmt::Debug for PolicyTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyTarget")
            .field("policy", &self.policy.name())
            .field("capacity_blocks", &self.capacity_blocks)
            .field("cached", &self.cached.len())
            .finish()
    }
}

impl PolicyTarget {
    /// A dry-run target with `policy` (Belady needs `trace`).
    pub fn new(kind: PolicyKind, trace: &Trace, capacity_blocks: u64) -> Self {
        let clock = ReplayClock::default();
        let policy: Box<dyn EvictionPolicy> = match kind {
            PolicyKind::Lru => Box::new(Lru::new()),
            PolicyKind::Default => Box::new(DefaultPolicy::new()),
            PolicyKind::Belady => Box::new(Belady::new(trace, clock.clone())),
        };
        Self::with_policy(policy, clock, capacity_blocks)
    }

    /// A dry-run target that decides as kvtierd does with `kind` (`lru`,
    /// `default`): the policy the daemon builds for that name
    /// ([`super::by_name`]: its `lru` lists leaves only, where the dry run's
    /// `lru` is exact LRU, the baseline) under G3's rules ([`G3Rules`]).
    /// `None` for a policy the daemon does not run (`belady`).
    pub fn kvtierd(kind: PolicyKind, capacity_blocks: u64) -> Option<Self> {
        let policy = super::by_name(kind.name())?;
        let mut t = Self::with_policy(policy, ReplayClock::default(), capacity_blocks);
        t.g3 = Some(G3Rules::default());
        Some(t)
    }

    /// A dry-run target over any policy.
    pub fn with_policy(
        policy: Box<dyn EvictionPolicy>,
        clock: ReplayClock,
        capacity_blocks: u64,
    ) -> Self {
        Self {
            policy,
            clock,
            capacity_blocks,
            cached: HashSet::new(),
            evictions: 0,
            g4: None,
            g3: None,
        }
    }

    /// Puts a modeled G4 behind this target.
    pub fn with_g4(mut self, g4: G4Model) -> Self {
        self.g4 = Some(g4);
        self
    }

    /// The modeled G4, if any.
    pub fn g4(&self) -> Option<&G4Model> {
        self.g4.as_ref()
    }

    /// Blocks evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    fn admit(&mut self, id: u64, event: AdmissionEvent) {
        if let Some(g4) = self.g4.as_mut() {
            let in_g4 = g4.blocks.contains(&id);
            if g4.admission.should_write(event, Hints::default(), in_g4) {
                g4.blocks.insert(id);
                g4.written_blocks += 1;
            }
        }
    }

    /// Evicts until `incoming` more blocks fit; false if the policy has
    /// nothing left to give.
    fn make_room(&mut self, incoming: u64) -> bool {
        while self.cached.len() as u64 + incoming > self.capacity_blocks {
            let g3 = &self.g3;
            let Some(v) = self
                .policy
                .victim(&mut |id| g3.as_ref().is_none_or(|r| r.may_evict(id)))
            else {
                return false;
            };
            self.policy.on_remove(v);
            self.cached.remove(&v);
            if let Some(r) = self.g3.as_mut() {
                r.unlink(v);
            }
            self.evictions += 1;
        }
        true
    }

    fn insert(&mut self, id: u64, parent: Option<u64>, hints: Hints) {
        if self.cached.contains(&id) || self.capacity_blocks == 0 {
            return;
        }
        // G3 refuses a block whose parent it does not hold.
        let orphan = parent.is_some_and(|p| !self.cached.contains(&p));
        if (self.g3.is_some() && orphan) || !self.make_room(1) {
            return;
        }
        if let (Some(r), Some(p)) = (self.g3.as_mut(), parent) {
            r.link(id, p);
        }
        self.cached.insert(id);
        self.policy.on_insert(
            id,
            BlockMeta {
                parent,
                hints,
                ..BlockMeta::default()
            },
        );
    }
}

impl ReplayTarget for PolicyTarget {
    fn describe(&self) -> String {
        format!(
            "dry-run, policy {}, {} blocks",
            self.policy.name(),
            self.capacity_blocks
        )
    }
    fn lookup(&mut self, ids: &[u64]) -> Result<usize> {
        let mut n = 0;
        for (i, &id) in ids.iter().enumerate() {
            if self.cached.contains(&id) {
                self.policy.on_access(id);
                self.admit(id, AdmissionEvent::Hit);
            } else if self.g4.as_ref().is_some_and(|g| g.blocks.contains(&id)) {
                // Read through from G4 and promote to G3.
                if let Some(g4) = self.g4.as_mut() {
                    g4.hit_blocks += 1;
                }
                self.insert(id, i.checked_sub(1).map(|p| ids[p]), Hints::default());
            } else {
                break;
            }
            n += 1;
        }
        Ok(n)
    }
    fn store(&mut self, ids: &[u64], from: usize) -> Result<()> {
        self.store_with_hints(ids, from, None)
    }
    fn store_with_hints(
        &mut self,
        ids: &[u64],
        from: usize,
        hints: Option<RequestHints>,
    ) -> Result<()> {
        // kvtierd stores one request's new blocks as one batch: room for
        // all of them first, then the inserts in order (`put_blocks`). So
        // does the replay, so that its hits are the daemon's. A batch that
        // cannot fit at all goes block by block.
        let mut fresh: Vec<u64> = ids[from..]
            .iter()
            .copied()
            .filter(|id| !self.cached.contains(id))
            .collect();
        fresh.sort_unstable();
        fresh.dedup();
        // G3 spares the batch's parents while it makes room for it.
        if let Some(r) = self.g3.as_mut() {
            let last = ids.len().saturating_sub(1);
            r.spared = ids[from.saturating_sub(1)..last.max(from)]
                .iter()
                .copied()
                .collect();
        }
        if (fresh.len() as u64) < self.capacity_blocks {
            self.make_room(fresh.len() as u64);
        }
        for i in from..ids.len() {
            let id = ids[i];
            if self.cached.contains(&id) {
                continue;
            }
            let h = hints.map_or_else(Hints::default, |h| h.for_block(i, ids.len()));
            self.insert(id, i.checked_sub(1).map(|p| ids[p]), h);
            if self.cached.contains(&id) {
                self.admit(id, AdmissionEvent::Stored);
            }
        }
        if let Some(r) = self.g3.as_mut() {
            r.spared.clear();
        }
        Ok(())
    }
    fn len_blocks(&self) -> u64 {
        self.cached.len() as u64
    }
    fn begin_request(&mut self, index: u64) {
        self.clock.set(index);
    }
    fn g4_hit_blocks(&self) -> u64 {
        self.g4.as_ref().map_or(0, |g| g.hit_blocks)
    }
}

/// What a replay measured.
#[derive(Debug, Clone, Default)]
pub struct ReplayStats {
    /// Block requests.
    pub requested_blocks: u64,
    /// Of those, prefix hits.
    pub hit_blocks: u64,
    /// Most blocks held at once (the capacity actually used).
    pub peak_blocks: u64,
    /// Hit blocks of each request, in order (G3 and G4).
    pub hits_per_request: Vec<u32>,
    /// Of each request's hit blocks, those served by G4 (empty without a
    /// G4 behind the target).
    pub g4_hits_per_request: Vec<u32>,
}

impl ReplayStats {
    /// `hit_blocks / requested_blocks`.
    pub fn hit_ratio(&self) -> f64 {
        ratio(self.hit_blocks, self.requested_blocks)
    }
}

/// Replays `trace` (requests `range`) against `target`.
pub fn replay_range(
    trace: &Trace,
    range: std::ops::Range<usize>,
    target: &mut dyn ReplayTarget,
) -> Result<ReplayStats> {
    let mut s = ReplayStats::default();
    let reqs = trace
        .requests
        .get(range.clone())
        .ok_or(Error::InvalidInput {
            what: "replay range",
            reason: format!("{range:?} outside {} requests", trace.requests.len()),
        })?;
    s.hits_per_request.reserve(reqs.len());
    for (i, r) in reqs.iter().enumerate() {
        target.begin_request((range.start + i) as u64);
        let ids = &r.hash_ids;
        let g4_before = target.g4_hit_blocks();
        let hit = target.lookup(ids)?;
        let g4_hit = target.g4_hit_blocks() - g4_before;
        target.store_with_hints(ids, hit, r.hints)?;
        s.requested_blocks += ids.len() as u64;
        s.hit_blocks += hit as u64;
        s.hits_per_request
            .push(u32::try_from(hit).unwrap_or(u32::MAX));
        s.g4_hits_per_request
            .push(u32::try_from(g4_hit).unwrap_or(u32::MAX));
        s.peak_blocks = s.peak_blocks.max(target.len_blocks());
    }
    Ok(s)
}

/// Replays the whole trace against `target`.
pub fn replay(trace: &Trace, target: &mut dyn ReplayTarget) -> Result<ReplayStats> {
    replay_range(trace, 0..trace.requests.len(), target)
}

/// Dry-run replay of the whole trace with `kind` at `capacity_blocks`.
pub fn replay_dry(trace: &Trace, kind: PolicyKind, capacity_blocks: u64) -> Result<ReplayStats> {
    let mut t = PolicyTarget::new(kind, trace, capacity_blocks);
    replay(trace, &mut t)
}

/// Dry-run replay of the whole trace deciding as kvtierd with `kind` does
/// ([`PolicyTarget::kvtierd`]): what a replay through a real daemon must
/// equal.
pub fn replay_kvtierd(
    trace: &Trace,
    kind: PolicyKind,
    capacity_blocks: u64,
) -> Result<ReplayStats> {
    let mut t = PolicyTarget::kvtierd(kind, capacity_blocks).ok_or(Error::InvalidInput {
        what: "policy",
        reason: format!("kvtierd does not run `{}`", kind.name()),
    })?;
    replay(trace, &mut t)
}

/// Two-tier dry run: G3 of `capacity_blocks` under `kind`, and a G4
/// behind it that every stored block is written through to (unbounded), so
/// that a G3 miss on a block stored before is a G4 hit (read through and
/// promoted into G3).
pub fn replay_two_tier(
    trace: &Trace,
    kind: PolicyKind,
    capacity_blocks: u64,
) -> Result<ReplayStats> {
    let mut t = PolicyTarget::new(kind, trace, capacity_blocks).with_g4(G4Model {
        admission: G4Admission::All,
        ..G4Model::default()
    });
    replay(trace, &mut t)
}

/// Capacity in blocks for a fraction of the trace's distinct blocks.
pub fn capacity_for_fraction(trace: &Trace, fraction: f64) -> u64 {
    (trace.distinct_blocks() as f64 * fraction.clamp(0.0, 1.0)).floor() as u64
}

/// The G4 admission experiment: node A replays the first half of the trace
/// writing to G4 per `admission`; node B, with its own empty G3 of the same
/// capacity, replays the second half reading through the same G4.
#[derive(Debug, Clone, Copy, Default)]
pub struct AdmissionReport {
    /// Blocks written to G4 by both nodes.
    pub g4_written_blocks: u64,
    /// Node B's hit ratio (G3 and G4 hits).
    pub node_b_hit_ratio: f64,
    /// Node B's blocks served by G4.
    pub node_b_g4_hit_blocks: u64,
}

/// Runs the two-node admission experiment (see [`AdmissionReport`]).
pub fn measure_admission(
    trace: &Trace,
    kind: PolicyKind,
    capacity_blocks: u64,
    admission: G4Admission,
) -> Result<AdmissionReport> {
    let half = trace.requests.len() / 2;
    let mut a = PolicyTarget::new(kind, trace, capacity_blocks).with_g4(G4Model {
        admission,
        ..G4Model::default()
    });
    replay_range(trace, 0..half, &mut a)?;
    let g4 = a.g4.take().unwrap_or_default();
    let written_a = g4.written_blocks;
    let mut b = PolicyTarget::new(kind, trace, capacity_blocks).with_g4(G4Model {
        written_blocks: 0,
        hit_blocks: 0,
        ..g4
    });
    let s = replay_range(trace, half..trace.requests.len(), &mut b)?;
    let g4b = b.g4.unwrap_or_default();
    Ok(AdmissionReport {
        g4_written_blocks: written_a + g4b.written_blocks,
        node_b_hit_ratio: s.hit_ratio(),
        node_b_g4_hit_blocks: g4b.hit_blocks,
    })
}

/// Modeled time to first token: prefill of the missed tokens vs loading
/// the hit blocks.
#[derive(Debug, Clone, Copy)]
pub struct TtftModel {
    /// Prefill throughput, tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Load bandwidth for hit blocks, bytes per second.
    pub load_bytes_per_s: f64,
    /// Tokens per block (Mooncake traces: 512).
    pub block_tokens: u64,
    /// Bytes per block.
    pub block_bytes: u64,
}

/// Mean and p90 TTFT with and without the cache.
#[derive(Debug, Clone, Copy, Default)]
pub struct TtftSummary {
    /// Mean TTFT with kvtier, ms.
    pub mean_ms: f64,
    /// p90 TTFT with kvtier, ms.
    pub p90_ms: f64,
    /// Mean TTFT recomputing everything, ms.
    pub mean_ms_no_cache: f64,
    /// p90 TTFT recomputing everything, ms.
    pub p90_ms_no_cache: f64,
}

impl TtftModel {
    /// TTFT of one request (ms) with `hit_blocks` loaded. A load slower than
    /// recompute falls back to recompute, as the client does.
    pub fn ttft_ms(&self, input_tokens: u64, hit_blocks: u64) -> f64 {
        let prefill = |tokens: u64| tokens as f64 / self.prefill_tokens_per_s.max(1e-9);
        let hit_tokens = (hit_blocks * self.block_tokens).min(input_tokens);
        let load = (hit_blocks * self.block_bytes) as f64 / self.load_bytes_per_s.max(1e-9);
        let with = prefill(input_tokens - hit_tokens) + load;
        1e3 * with.min(prefill(input_tokens))
    }

    /// Summarises a replay of `trace`.
    pub fn summarise(&self, trace: &Trace, stats: &ReplayStats) -> TtftSummary {
        let mut with = Vec::with_capacity(stats.hits_per_request.len());
        let mut without = Vec::with_capacity(stats.hits_per_request.len());
        for (r, &h) in trace.requests.iter().zip(&stats.hits_per_request) {
            with.push(self.ttft_ms(r.input_length, u64::from(h)));
            without.push(self.ttft_ms(r.input_length, 0));
        }
        TtftSummary {
            mean_ms: mean(&with),
            p90_ms: p90(&mut with),
            mean_ms_no_cache: mean(&without),
            p90_ms_no_cache: p90(&mut without),
        }
    }
}

/// The two-tier TTFT model: a G3 hit loads at the G3 rate
/// ([`TtftModel::load_bytes_per_s`]), a G4 hit at the G4 rate; with
/// prefetch, the G4 blocks of each request are fetched into G3 from
/// `prefetch_lead_ms` before its arrival, one request after another at the
/// G4 rate (a single bandwidth-bound queue), and those that arrived by the
/// request's arrival cost a G3 load. Stated simplifications: prefetch does
/// not change what the policy keeps (the same replay feeds both), and
/// foreground G4 loads do not queue behind prefetches.
#[derive(Debug, Clone, Copy)]
pub struct TwoTierTtft {
    /// Prefill rate, G3 rate, block geometry.
    pub base: TtftModel,
    /// G4 read bandwidth (prefetch and foreground), bytes per second.
    pub g4_load_bytes_per_s: f64,
    /// How long before a request its prefetch hint arrives, ms.
    pub prefetch_lead_ms: u64,
}

/// Mean and p90 TTFT of the two-tier model, with and without prefetch.
#[derive(Debug, Clone, Copy, Default)]
pub struct TwoTierSummary {
    /// Mean TTFT with prefetch, ms.
    pub mean_ms: f64,
    /// p90 TTFT with prefetch, ms.
    pub p90_ms: f64,
    /// Mean TTFT without prefetch (G4 blocks on the critical path), ms.
    pub mean_ms_no_prefetch: f64,
    /// p90 TTFT without prefetch, ms.
    pub p90_ms_no_prefetch: f64,
    /// G4 hit blocks in all.
    pub g4_hit_blocks: u64,
    /// Of those, blocks whose prefetch arrived in time.
    pub prefetched_in_time_blocks: u64,
}

impl TwoTierSummary {
    /// Share of G4 hit blocks whose prefetch arrived in time.
    pub fn in_time_ratio(&self) -> f64 {
        ratio(self.prefetched_in_time_blocks, self.g4_hit_blocks)
    }
}

impl TwoTierTtft {
    fn g4_block_s(&self) -> f64 {
        self.base.block_bytes as f64 / self.g4_load_bytes_per_s.max(1e-9)
    }

    /// TTFT of one request (ms): `g3` blocks at the G3 rate then `g4` at
    /// the G4 rate, the rest prefilled; recompute if that is faster.
    pub fn ttft_ms(&self, input_tokens: u64, g3_blocks: u64, g4_blocks: u64) -> f64 {
        let m = &self.base;
        let prefill = |tokens: u64| tokens as f64 / m.prefill_tokens_per_s.max(1e-9);
        let hit = g3_blocks + g4_blocks;
        let hit_tokens = (hit * m.block_tokens).min(input_tokens);
        let load = (g3_blocks * m.block_bytes) as f64 / m.load_bytes_per_s.max(1e-9)
            + g4_blocks as f64 * self.g4_block_s();
        1e3 * (prefill(input_tokens - hit_tokens) + load).min(prefill(input_tokens))
    }

    /// Summarises a two-tier replay (`stats` from [`replay_two_tier`]).
    pub fn summarise(&self, trace: &Trace, stats: &ReplayStats) -> TwoTierSummary {
        let n = stats.hits_per_request.len();
        let mut with = Vec::with_capacity(n);
        let mut without = Vec::with_capacity(n);
        let mut out = TwoTierSummary::default();
        let block_ms = 1e3 * self.g4_block_s();
        // The prefetch queue is free from this time on (ms).
        let mut free_at = 0.0f64;
        let g4s = stats
            .g4_hits_per_request
            .iter()
            .copied()
            .chain(std::iter::repeat(0));
        for ((r, &h), g4) in trace.requests.iter().zip(&stats.hits_per_request).zip(g4s) {
            let (h, g4) = (u64::from(h), u64::from(g4).min(u64::from(h)));
            without.push(self.ttft_ms(r.input_length, h - g4, g4));
            let arrival = r.timestamp as f64;
            let start = free_at.max(arrival - self.prefetch_lead_ms as f64);
            let fetched = if g4 == 0 || block_ms <= 0.0 {
                0
            } else {
                (((arrival - start) / block_ms).floor().max(0.0) as u64).min(g4)
            };
            // The G4 pipe carries all of them, the late ones for the
            // foreground: the next prefetch waits behind them either way.
            free_at = start + g4 as f64 * block_ms;
            out.g4_hit_blocks += g4;
            out.prefetched_in_time_blocks += fetched;
            with.push(self.ttft_ms(r.input_length, h - g4 + fetched, g4 - fetched));
        }
        out.mean_ms = mean(&with);
        out.p90_ms = p90(&mut with);
        out.mean_ms_no_prefetch = mean(&without);
        out.p90_ms_no_prefetch = p90(&mut without);
        out
    }
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn p90(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = (0.9 * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_hits_stop_at_first_miss() {
        let t = Trace::parse(
            "{\"hash_ids\": [1, 2, 3]}\n{\"hash_ids\": [1, 9, 3]}\n{\"hash_ids\": [1, 2, 3]}",
        )
        .unwrap();
        let s = replay_dry(&t, PolicyKind::Lru, 100).unwrap();
        assert_eq!(s.hits_per_request, vec![0, 1, 3]);
        assert_eq!(s.requested_blocks, 9);
        assert_eq!(s.peak_blocks, 4);
    }

    #[test]
    fn two_tier_replay_counts_g4_hits() {
        // Capacity 2: the chain [1, 2, 3] cannot stay in G3, but G4 holds
        // what was written, so the repeat is a full hit, partly from G4.
        let t = Trace::parse(
            "{\"hash_ids\": [1, 2, 3]}\n{\"hash_ids\": [7, 8]}\n{\"hash_ids\": [1, 2, 3]}",
        )
        .unwrap();
        let s = replay_two_tier(&t, PolicyKind::Lru, 2).unwrap();
        assert_eq!(s.hits_per_request, vec![0, 0, 3]);
        assert_eq!(s.g4_hits_per_request, vec![0, 0, 3]);
        let g3_only = replay_dry(&t, PolicyKind::Lru, 2).unwrap();
        assert_eq!(g3_only.hits_per_request, vec![0, 0, 0]);
    }

    #[test]
    fn prefetch_turns_g4_loads_into_g3_loads_when_in_time() {
        let base = TtftModel {
            prefill_tokens_per_s: 1000.0,
            load_bytes_per_s: 1000.0,
            block_tokens: 10,
            block_bytes: 1,
        };
        // G4: 10 ms a block. Two requests 100 ms apart, 100 tokens each,
        // 5 blocks from G4.
        let m = TwoTierTtft {
            base,
            g4_load_bytes_per_s: 100.0,
            prefetch_lead_ms: 30,
        };
        assert!(
            (m.ttft_ms(100, 0, 5) - 100.0).abs() < 1e-9,
            "capped at recompute"
        );
        assert!((m.ttft_ms(100, 5, 0) - 55.0).abs() < 1e-9);
        assert!((m.ttft_ms(100, 2, 3) - 82.0).abs() < 1e-9);
        let t = Trace::parse(
            "{\"timestamp\": 1000, \"input_length\": 100, \"hash_ids\": [1, 2, 3, 4, 5]}\n\
             {\"timestamp\": 1100, \"input_length\": 100, \"hash_ids\": [1, 2, 3, 4, 5]}",
        )
        .unwrap();
        let stats = ReplayStats {
            hits_per_request: vec![5, 5],
            g4_hits_per_request: vec![5, 5],
            ..ReplayStats::default()
        };
        // A 30 ms lead brings 3 of 5 blocks in time: 2 G4 + 3 G3 loads.
        let s = m.summarise(&t, &stats);
        assert_eq!((s.g4_hit_blocks, s.prefetched_in_time_blocks), (10, 6));
        assert!((s.mean_ms_no_prefetch - 100.0).abs() < 1e-9);
        assert!((s.mean_ms - 73.0).abs() < 1e-9, "{s:?}");
        // A long lead: all in time.
        let long = TwoTierTtft {
            prefetch_lead_ms: 100,
            ..m
        };
        let s = long.summarise(&t, &stats);
        assert_eq!(s.prefetched_in_time_blocks, 10);
        assert!((s.mean_ms - 55.0).abs() < 1e-9, "{s:?}");
        // No lead: nothing arrives in time.
        let none = TwoTierTtft {
            prefetch_lead_ms: 0,
            ..m
        };
        let s = none.summarise(&t, &stats);
        assert_eq!(s.prefetched_in_time_blocks, 0);
        assert!((s.mean_ms - s.mean_ms_no_prefetch).abs() < 1e-9);
        // Requests 10 ms apart share the G4 queue: the second one's
        // prefetch waits for the first one's 50 ms of transfers.
        let close = Trace::parse(
            "{\"timestamp\": 1000, \"input_length\": 100, \"hash_ids\": [1, 2, 3, 4, 5]}\n\
             {\"timestamp\": 1010, \"input_length\": 100, \"hash_ids\": [1, 2, 3, 4, 5]}",
        )
        .unwrap();
        let s = long.summarise(&close, &stats);
        // First: 5 in time (900..950); second: queue free at 950, 6 slots
        // by 1010, all 5 in time.
        assert_eq!(s.prefetched_in_time_blocks, 10);
        let tight = TwoTierTtft {
            prefetch_lead_ms: 60,
            ..m
        };
        // First: 940..990, 5 in time; second: from 990, 2 by 1010.
        let s = tight.summarise(&close, &stats);
        assert_eq!(s.prefetched_in_time_blocks, 7);
    }

    #[test]
    fn ttft_model_falls_back_to_recompute() {
        let m = TtftModel {
            prefill_tokens_per_s: 1000.0,
            load_bytes_per_s: 1000.0,
            block_tokens: 10,
            block_bytes: 1,
        };
        assert!((m.ttft_ms(100, 0) - 100.0).abs() < 1e-9);
        assert!((m.ttft_ms(100, 5) - 55.0).abs() < 1e-9);
        let slow = TtftModel {
            load_bytes_per_s: 0.001,
            ..m
        };
        assert!((slow.ttft_ms(100, 5) - 100.0).abs() < 1e-9);
    }
}
