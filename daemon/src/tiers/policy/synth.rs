//! Seeded synthetic traces of different shapes: the held-out set the
//! default policy is judged on (`kvtier bench replay --suite`).
//!
//! **Tune/eval split.** Policy changes may be tried against
//! [`TUNE_SEEDS`] only; figures are reported on [`EVAL_SEEDS`], which no
//! parameter of the policy was chosen on. The shapes themselves were
//! written before the policy was measured on them (and the policy has no
//! notion of them: it sees ids, parents and hints).
//!
//! Every generator writes requests as sequences of *contents* (a system
//! prompt block, a document block, a turn block); hash ids are interned
//! per (parent id, content), so equal ids mean equal prefixes exactly as
//! in a real engine's chained block hashes.

use super::trace::{Request, RequestHints, Trace};
use std::collections::{BTreeMap, HashMap};

/// Seeds a policy may be tuned on.
pub const TUNE_SEEDS: [u64; 2] = [1, 2];
/// Seeds only evaluated on (never used to choose a policy parameter).
pub const EVAL_SEEDS: [u64; 2] = [1001, 1002];

/// Tokens per synthetic block (as Mooncake's traces: 512).
pub const BLOCK_TOKENS: u64 = 512;

/// The trace shapes of the held-out set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Chat with sessions: a handful of shared system prompts, sessions
    /// that continue after lognormal gaps with a survival that grows with
    /// the turn count, a partial last block the next turn replaces.
    Chat,
    /// Agents: long shared system prompts with tool definitions, loops of
    /// tool calls re-reading the whole history, reasoning tokens written
    /// once and dropped from the next step, sub-agents sharing their own
    /// long prompts.
    Agent,
    /// RAG over a shared pool of documents (Zipf popularity), retrieved in
    /// popularity order after a shared instruction, with a one-shot query.
    Rag,
    /// Chat traffic mixed with batch scans: long one-shot documents behind
    /// one shared instruction, which should not push the chat out.
    BatchScan,
}

impl Shape {
    /// Every shape, in report order.
    pub const ALL: [Shape; 4] = [Shape::Chat, Shape::Agent, Shape::Rag, Shape::BatchScan];

    /// Name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Shape::Chat => "chat",
            Shape::Agent => "agent",
            Shape::Rag => "rag",
            Shape::BatchScan => "batch-scan",
        }
    }

    /// The trace of this shape for `seed`, `requests` long.
    pub fn generate(self, seed: u64, requests: usize) -> Trace {
        match self {
            Shape::Chat => chat(seed, requests),
            Shape::Agent => agent(seed, requests),
            Shape::Rag => rag(seed, requests),
            Shape::BatchScan => batch_scan(seed, requests),
        }
    }
}

/// splitmix64: small, seedable, and stable across versions of any crate.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` (each shape salts it, so shapes differ).
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0xA24B_AED4_963E_E407) ^ 0x5851_F42D_4C95_7F2D)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (0 for `n == 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }
    /// Lognormal with median `median` and log-sd `sigma`.
    pub fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        // Box-Muller.
        let u1 = self.unit().max(1e-12);
        let u2 = self.unit();
        let n = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        median * (sigma * n).exp()
    }
    /// Zipf-like rank in `0..n` with exponent `s` (by inversion of the
    /// continuous approximation; rank 0 is the most popular).
    pub fn zipf(&mut self, n: u64, s: f64) -> u64 {
        let n_f = n as f64;
        let u = self.unit();
        let r = if (s - 1.0).abs() < 1e-9 {
            n_f.powf(u)
        } else {
            let a = 1.0 - s;
            ((n_f.powf(a) - 1.0) * u + 1.0).powf(1.0 / a)
        };
        ((r - 1.0).floor() as u64).min(n - 1)
    }
}

/// Content ids: what a block holds. The interner turns a sequence of them
/// into chained hash ids.
type Content = u64;

/// Content namespaces, so that generators never collide by accident.
const SYSTEM: Content = 1 << 40;
const DOC: Content = 2 << 40;
const TOOL: Content = 3 << 40;

/// Chained ids: the id of a block is fixed by its parent's id and content.
#[derive(Debug, Default)]
struct Interner {
    ids: HashMap<(u64, Content), u64>,
    fresh: u64,
}

impl Interner {
    fn chain(&mut self, contents: &[Content]) -> Vec<u64> {
        let mut parent = 0u64;
        contents
            .iter()
            .map(|&c| {
                let next = self.fresh + 1;
                let id = *self.ids.entry((parent, c)).or_insert(next);
                if id == next {
                    self.fresh = next;
                }
                parent = id;
                id
            })
            .collect()
    }
}

/// Unique contents (a user's turn, a query, reasoning): never equal to
/// any other.
#[derive(Debug, Default)]
struct Unique(std::cell::Cell<u64>);

impl Unique {
    fn take(&self, n: u64) -> Vec<Content> {
        (0..n)
            .map(|_| {
                self.0.set(self.0.get() + 1);
                self.0.get()
            })
            .collect()
    }
}

/// Builds the trace: requests arrive in `(time_ms, seq)` order.
#[derive(Debug, Default)]
struct Builder {
    interner: Interner,
    out: Vec<Request>,
}

impl Builder {
    fn push(&mut self, time_ms: u64, contents: &[Content], output_tokens: u64) {
        self.push_hinted(time_ms, contents, output_tokens, None);
    }

    /// A request with the hints an engine would set on it.
    fn push_hinted(
        &mut self,
        time_ms: u64,
        contents: &[Content],
        output_tokens: u64,
        hints: Option<RequestHints>,
    ) {
        let hash_ids = self.interner.chain(contents);
        self.out.push(Request {
            timestamp: time_ms,
            input_length: hash_ids.len() as u64 * BLOCK_TOKENS,
            output_length: output_tokens,
            hash_ids,
            hints,
        });
    }
}

/// The engine knows these blocks are ephemeral: a partial last block (an
/// engine knows a block is not full), reasoning it drops from the next
/// prompt, a batch job's one-shot documents. Nothing else is hinted: what
/// only the generator knows (whether a session continues, a document's
/// future popularity) is not.
fn ephemeral_tail(blocks: usize) -> Option<RequestHints> {
    Some(RequestHints {
        ephemeral_tail_blocks: blocks as u32,
        ..RequestHints::default()
    })
}

/// An event queue of continuations: due time -> states.
type Due<T> = BTreeMap<(u64, u64), T>;

fn schedule<T>(due: &mut Due<T>, seq: &mut u64, at_ms: u64, state: T) {
    *seq += 1;
    due.insert((at_ms, *seq), state);
}

/// Runs an arrival process: new work every `arrival_ms` on average, and
/// continuations when due, until `requests` requests are out.
fn run<T>(
    rng: &mut Rng,
    requests: usize,
    arrival_ms: f64,
    b: &mut Builder,
    mut start: impl FnMut(&mut Rng) -> T,
    mut step: impl FnMut(&mut Rng, &mut Builder, u64, T) -> Option<(u64, T)>,
) {
    let mut due: Due<T> = BTreeMap::new();
    let mut seq = 0u64;
    let mut next_arrival = 0.0f64;
    while b.out.len() < requests {
        let arrival = next_arrival as u64;
        let take_due = due.first_key_value().is_some_and(|(k, _)| k.0 <= arrival);
        let (now, state) = if take_due {
            match due.pop_first() {
                Some(((t, _), s)) => (t, s),
                None => break,
            }
        } else {
            next_arrival += -arrival_ms * (1.0 - rng.unit()).ln();
            (arrival, start(rng))
        };
        if let Some((after_ms, s)) = step(rng, b, now, state) {
            schedule(&mut due, &mut seq, now + after_ms.max(1), s);
        }
    }
    b.out.truncate(requests);
}

/// See [`Shape::Chat`].
pub fn chat(seed: u64, requests: usize) -> Trace {
    let mut rng = Rng::new(seed ^ 0xC4A7);
    let prompts: Vec<Vec<Content>> = (0..6u64)
        .map(|p| (0..rng.range(1, 6)).map(|i| SYSTEM + p * 64 + i).collect())
        .collect();
    let uniq = Unique::default();
    let mut b = Builder::default();
    // State: the conversation so far (without the partial block) and turns.
    run(
        &mut rng,
        requests,
        400.0,
        &mut b,
        |rng| {
            let p = rng.zipf(prompts.len() as u64, 1.0) as usize;
            (prompts[p].clone(), 0u32)
        },
        |rng, b, now, (mut conv, turns)| {
            conv.extend(uniq.take(rng.range(1, 3)));
            let mut req = conv.clone();
            // The partial last block: the next turn re-tokenises it.
            req.extend(uniq.take(1));
            b.push_hinted(now, &req, rng.range(50, 600), ephemeral_tail(1));
            // The answer becomes part of the next turn's prompt.
            conv.extend(uniq.take(rng.range(0, 2)));
            let survive = 0.85 - 0.45 / (1.0 + f64::from(turns));
            (rng.chance(survive) && conv.len() < 400).then(|| {
                let gap = rng.lognormal(30_000.0, 1.2) as u64;
                (gap, (conv, turns + 1))
            })
        },
    );
    Trace { requests: b.out }
}

/// See [`Shape::Agent`].
pub fn agent(seed: u64, requests: usize) -> Trace {
    let mut rng = Rng::new(seed ^ 0xA6E7);
    // Agent kinds: a long system prompt plus tool definitions (8-40 blocks).
    let kinds: Vec<Vec<Content>> = (0..10u64)
        .map(|k| (0..rng.range(8, 40)).map(|i| TOOL + k * 256 + i).collect())
        .collect();
    let sub_kinds: Vec<Vec<Content>> = (0..4u64)
        .map(|k| {
            (0..rng.range(6, 20))
                .map(|i| TOOL + (64 + k) * 256 + i)
                .collect()
        })
        .collect();
    let uniq = Unique::default();
    let mut b = Builder::default();
    // State: the history, steps left, whether a sub-agent.
    run(
        &mut rng,
        requests,
        900.0,
        &mut b,
        |rng| {
            let k = rng.zipf(kinds.len() as u64, 0.9) as usize;
            let mut h = kinds[k].clone();
            h.extend(uniq.take(rng.range(1, 3)));
            (h, rng.range(2, 14) as u32, false)
        },
        |rng, b, now, (mut hist, left, sub)| {
            let mut req = hist.clone();
            // Reasoning: written once, dropped from the next step's prompt.
            let reasoning = uniq.take(rng.range(0, 3));
            req.extend(&reasoning);
            b.push_hinted(
                now,
                &req,
                rng.range(100, 2000),
                ephemeral_tail(reasoning.len()),
            );
            if !sub && rng.chance(0.15) {
                // A sub-agent: its own long prompt, a task from the parent;
                // it runs to completion on its own schedule.
                let k = rng.zipf(sub_kinds.len() as u64, 0.8) as usize;
                let mut sh = sub_kinds[k].clone();
                sh.extend(uniq.take(rng.range(1, 2)));
                let n = rng.range(1, 5);
                let t = now + rng.range(200, 2000);
                for i in 0..n {
                    let mut r = sh.clone();
                    r.extend(uniq.take(rng.range(1, 2)));
                    b.push(t + i * 1500, &r, rng.range(100, 800));
                    sh.extend(uniq.take(1));
                }
            }
            // The tool call and its result join the history.
            hist.extend(uniq.take(rng.range(1, 6)));
            (left > 1 && hist.len() < 300).then(|| {
                let gap = rng.lognormal(4_000.0, 1.0) as u64;
                (gap, (hist, left - 1, sub))
            })
        },
    );
    b.out.sort_by_key(|r| r.timestamp);
    Trace { requests: b.out }
}

/// See [`Shape::Rag`].
pub fn rag(seed: u64, requests: usize) -> Trace {
    let mut rng = Rng::new(seed ^ 0x2A6);
    let pool = 3000u64;
    let doc_blocks: Vec<u64> = (0..pool).map(|_| rng.range(1, 4)).collect();
    let instructions: Vec<Vec<Content>> = (0..3u64)
        .map(|p| {
            (0..rng.range(1, 3))
                .map(|i| SYSTEM + 4096 + p * 64 + i)
                .collect()
        })
        .collect();
    let uniq = Unique::default();
    let mut b = Builder::default();
    run(
        &mut rng,
        requests,
        300.0,
        &mut b,
        |rng| {
            let ins = rng.zipf(instructions.len() as u64, 1.0) as usize;
            let mut docs: Vec<u64> = (0..rng.range(2, 5)).map(|_| rng.zipf(pool, 1.1)).collect();
            // Retrieval order: by score, which tracks popularity.
            docs.sort_unstable();
            docs.dedup();
            let mut req = instructions[ins].clone();
            for d in docs {
                req.extend((0..doc_blocks[d as usize]).map(|i| DOC + d * 16 + i));
            }
            (req, rng.chance(0.2))
        },
        |rng, b, now, (mut req, follow_up)| {
            req.extend(uniq.take(1));
            b.push(now, &req, rng.range(50, 400));
            // A follow-up question on the same retrieval, now and then.
            follow_up.then(|| (rng.lognormal(20_000.0, 1.0) as u64, (req, false)))
        },
    );
    Trace { requests: b.out }
}

/// See [`Shape::BatchScan`].
pub fn batch_scan(seed: u64, requests: usize) -> Trace {
    let chat_share = 0.7;
    let mut rng = Rng::new(seed ^ 0xB5CA);
    let chat_trace = chat(seed.wrapping_add(0x5CA9), requests);
    let instruction: Vec<Content> = (0..2).map(|i| SYSTEM + 8192 + i).collect();
    let uniq = Unique::default();
    // Chat ids and scan ids must not collide: scans intern separately
    // and are offset past every chat id.
    let offset = chat_trace
        .requests
        .iter()
        .flat_map(|r| r.hash_ids.iter().copied())
        .max()
        .unwrap_or(0)
        + 1;
    let mut scans = Interner::default();
    let mut out = Vec::with_capacity(requests);
    let mut chat_iter = chat_trace.requests.into_iter();
    let mut now = 0u64;
    while out.len() < requests {
        if rng.chance(chat_share) {
            let Some(r) = chat_iter.next() else { break };
            now = now.max(r.timestamp);
            out.push(r);
        } else {
            // A scan job: one-shot long documents behind one instruction.
            let mut c = instruction.clone();
            let docs = uniq.take(rng.range(8, 60));
            c.extend(&docs);
            let hash_ids: Vec<u64> = scans.chain(&c).into_iter().map(|id| id + offset).collect();
            out.push(Request {
                timestamp: now,
                input_length: hash_ids.len() as u64 * BLOCK_TOKENS,
                output_length: rng.range(20, 200),
                hash_ids,
                hints: ephemeral_tail(docs.len()),
            });
        }
    }
    Trace { requests: out }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn deterministic_per_seed_and_different_across_seeds() {
        for shape in Shape::ALL {
            let a = shape.generate(7, 600);
            let b = shape.generate(7, 600);
            let c = shape.generate(8, 600);
            assert_eq!(a.requests.len(), 600, "{}", shape.name());
            assert_eq!(a.requests, b.requests, "{} not deterministic", shape.name());
            assert_ne!(a.requests, c.requests, "{} ignores its seed", shape.name());
            assert!(
                a.requests
                    .windows(2)
                    .all(|w| w[0].timestamp <= w[1].timestamp),
                "{} out of time order",
                shape.name()
            );
            let ceiling = a.ceiling_hit_ratio();
            assert!(
                ceiling > 0.05 && ceiling < 0.95,
                "{} ceiling {ceiling}",
                shape.name()
            );
        }
    }

    #[test]
    fn tune_and_eval_seeds_are_disjoint() {
        for s in TUNE_SEEDS {
            assert!(!EVAL_SEEDS.contains(&s));
        }
    }

    #[test]
    fn ids_are_chained_prefixes() {
        // Equal ids at a position imply equal ids before it.
        for shape in Shape::ALL {
            let t = shape.generate(3, 800);
            let mut parent_of: HashMap<u64, u64> = HashMap::new();
            for r in &t.requests {
                let mut parent = u64::MAX;
                for &id in &r.hash_ids {
                    let p = *parent_of.entry(id).or_insert(parent);
                    assert_eq!(p, parent, "{}: id {id} under two parents", shape.name());
                    parent = id;
                }
            }
        }
    }

    #[test]
    fn shapes_have_their_signature() {
        // Agents: long shared prefixes (most requests start with >= 8
        // blocks seen before).
        let t = agent(5, 1500);
        let mut seen = HashSet::new();
        let mut long_shared = 0;
        for r in &t.requests {
            let lead = r.hash_ids.iter().take_while(|i| seen.contains(*i)).count();
            long_shared += usize::from(lead >= 8);
            seen.extend(r.hash_ids.iter().copied());
        }
        assert!(long_shared * 2 > t.requests.len(), "agent {long_shared}");
        // Batch scans: the scan blocks past the instruction are one-shot.
        let t = batch_scan(5, 1500);
        let mut uses: HashMap<u64, u32> = HashMap::new();
        for r in &t.requests {
            for &id in &r.hash_ids {
                *uses.entry(id).or_default() += 1;
            }
        }
        let once = uses.values().filter(|&&n| n == 1).count();
        assert!(
            once * 2 > uses.len(),
            "batch-scan: {once} of {} once",
            uses.len()
        );
    }
}
