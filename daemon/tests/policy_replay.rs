#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Replay-level checks: LRU is exact, the default policy beats it on the
//! real trace and on a synthetic agent-shaped one.

use kvtier_daemon::tiers::policy::replay::{capacity_for_fraction, replay_dry, PolicyKind};
use kvtier_daemon::tiers::policy::trace::{Request, RequestHints, Trace};
use std::collections::VecDeque;
use std::path::PathBuf;

/// The simplest possible LRU: a list, most recent at the back.
fn naive_lru(trace: &Trace, capacity: usize) -> Vec<u32> {
    let mut list: VecDeque<u64> = VecDeque::new();
    let mut out = Vec::new();
    for r in &trace.requests {
        let mut hit = 0;
        for id in &r.hash_ids {
            if let Some(pos) = list.iter().position(|x| x == id) {
                list.remove(pos);
                list.push_back(*id);
                hit += 1;
            } else {
                break;
            }
        }
        for id in &r.hash_ids[hit..] {
            if list.contains(id) || capacity == 0 {
                continue;
            }
            if list.len() >= capacity {
                list.pop_front();
            }
            list.push_back(*id);
        }
        out.push(hit as u32);
    }
    out
}

/// A deterministic generator (xorshift) so tests need no seeds from outside.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn req(ids: Vec<u64>) -> Request {
    Request {
        timestamp: 0,
        input_length: ids.len() as u64 * 512,
        output_length: 0,
        hash_ids: ids,
        hints: None,
    }
}

/// Conversations that grow turn by turn, sharing one system prompt block.
fn chat_trace(seed: u64, requests: usize) -> Trace {
    let mut rng = Rng(seed);
    let mut next_id = 1u64;
    let mut convs: Vec<Vec<u64>> = Vec::new();
    let mut out = Vec::new();
    for _ in 0..requests {
        if convs.is_empty() || rng.below(3) == 0 {
            convs.push(vec![0]);
        }
        let c = rng.below(convs.len() as u64) as usize;
        let grow = 1 + rng.below(4);
        for _ in 0..grow {
            convs[c].push(next_id);
            next_id += 1;
        }
        out.push(req(convs[c].clone()));
    }
    Trace { requests: out }
}

/// Agent-shaped: a few hot long system-prompt/tool prefixes, each request
/// adds one-shot suffix blocks.
fn agent_trace(seed: u64, requests: usize) -> Trace {
    let mut rng = Rng(seed);
    let prefixes: Vec<Vec<u64>> = (0..24u64)
        .map(|p| {
            (0..(8 + p % 5 * 6))
                .map(|i| 1_000_000 * (p + 1) + i)
                .collect()
        })
        .collect();
    let mut next_id = 1u64;
    let mut out = Vec::new();
    for _ in 0..requests {
        // Zipf-ish popularity: prefix p has weight 1 / (p + 1).
        let total: f64 = (1..=prefixes.len()).map(|k| 1.0 / k as f64).sum();
        let mut x = (rng.below(1 << 20) as f64 / f64::from(1 << 20)) * total;
        let mut p = 0;
        while p + 1 < prefixes.len() && x > 1.0 / (p + 1) as f64 {
            x -= 1.0 / (p + 1) as f64;
            p += 1;
        }
        let mut ids = prefixes[p].clone();
        for _ in 0..(4 + rng.below(40)) {
            ids.push(next_id);
            next_id += 1;
        }
        out.push(req(ids));
    }
    Trace { requests: out }
}

/// Conversation-shaped, unlike the other two in every parameter the policy
/// could have been fitted to: continuation gaps are Pareto (alpha 1.2,
/// heavy-tailed), every turn continues with the same probability (no
/// "long conversations go on" effect unless `survival_grows`), each
/// request ends with a partial block that the next turn replaces, and a
/// quarter of conversations start with one of 50 shared documents.
fn pareto_conversations(seed: u64, requests: usize, survival_grows: bool) -> Trace {
    let mut rng = Rng(seed);
    let mut next_id = 10u64;
    let docs: Vec<Vec<u64>> = (0..50u64)
        .map(|d| (0..(2 + d % 7)).map(|i| 5_000_000 + d * 100 + i).collect())
        .collect();
    // Continuations due at a step: (chain without its partial block, turns).
    let mut due: std::collections::BTreeMap<u64, Vec<(Vec<u64>, u32)>> = Default::default();
    let mut out = Vec::new();
    let mut step = 0u64;
    while out.len() < requests {
        let mut batch = due.remove(&step).unwrap_or_default();
        if rng.below(100) < 70 {
            let mut chain = vec![0u64];
            if rng.below(4) == 0 {
                // Popularity skewed towards the last documents.
                let d = (rng.below(50 * 50) as f64).sqrt() as usize;
                chain.extend(&docs[49 - d.min(49)]);
            }
            batch.push((chain, 0));
        }
        for (mut chain, turns) in batch {
            for _ in 0..(1 + rng.below(20)) {
                chain.push(next_id);
                next_id += 1;
            }
            let mut ids = chain.clone();
            ids.push(next_id);
            next_id += 1;
            out.push(req(ids));
            let p = if survival_grows {
                1.0 - 0.6 / (1.0 + f64::from(turns) * 0.5)
            } else {
                0.4
            };
            if (rng.below(1000) as f64) < p * 1000.0 {
                let u = (rng.below(1 << 20) as f64 + 1.0) / f64::from(1 << 20);
                let gap = (20.0 / u.powf(1.0 / 1.2)) as u64;
                due.entry(step + 1 + gap)
                    .or_default()
                    .push((chain, turns + 1));
            }
        }
        step += 1;
    }
    out.truncate(requests);
    Trace { requests: out }
}

#[test]
fn lru_replay_matches_naive_lru_exactly() {
    for (seed, cap) in [(1, 0), (2, 5), (3, 40), (4, 200), (5, 10_000)] {
        let t = chat_trace(seed, 400);
        let naive = naive_lru(&t, cap);
        let s = replay_dry(&t, PolicyKind::Lru, cap as u64).unwrap();
        assert_eq!(s.hits_per_request, naive, "seed {seed} capacity {cap}");
        assert_eq!(
            s.hit_blocks,
            naive.iter().map(|&h| u64::from(h)).sum::<u64>()
        );
    }
}

fn check_not_worse(t: &Trace, what: &str) {
    let ceiling = t.ceiling_hit_ratio();
    for f in [0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0] {
        let cap = capacity_for_fraction(t, f);
        let lru = replay_dry(t, PolicyKind::Lru, cap).unwrap().hit_ratio();
        let def = replay_dry(t, PolicyKind::Default, cap).unwrap().hit_ratio();
        let bel = replay_dry(t, PolicyKind::Belady, cap).unwrap().hit_ratio();
        eprintln!("{what} {f}: lru {lru:.4} default {def:.4} belady {bel:.4} ceiling {ceiling:.4}");
        assert!(
            def >= lru - 0.003,
            "{what} at {f}: default {def} < lru {lru}"
        );
        assert!(
            bel + 1e-9 >= def && bel <= ceiling + 1e-9,
            "{what} at {f}: belady {bel}"
        );
    }
}

#[test]
fn default_not_worse_than_lru_on_synthetic_traces() {
    check_not_worse(&chat_trace(7, 3000), "chat");
    check_not_worse(&agent_trace(11, 3000), "agent");
}

#[test]
fn default_not_worse_than_lru_on_pareto_conversations() {
    check_not_worse(&pareto_conversations(3, 6000, false), "pareto");
    check_not_worse(&pareto_conversations(5, 6000, true), "pareto-growing");
}

fn real_trace() -> Option<Trace> {
    // CI keeps shared/ beside the repository; a worktree may sit one deeper.
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let rel = "shared/workloads/mooncake/conversation_trace.jsonl";
    let candidates = [repo.join("..").join(rel), repo.join("../..").join(rel)];
    let Some(p) = candidates.iter().find(|p| p.exists()) else {
        eprintln!(
            "SKIP: Mooncake trace not found at {}",
            candidates[0].display()
        );
        return None;
    };
    Some(Trace::load(p).unwrap())
}

#[test]
fn default_beats_lru_on_mooncake_trace() {
    let Some(t) = real_trace() else { return };
    let fractions: Vec<f64> = match std::env::var("KVTIER_REPLAY_ALL") {
        Ok(_) => vec![0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0],
        Err(_) => vec![0.01, 0.05, 0.1, 0.25],
    };
    let ceiling = t.ceiling_hit_ratio();
    assert!((ceiling - 0.366).abs() < 0.001, "ceiling {ceiling}");
    for f in fractions {
        let cap = capacity_for_fraction(&t, f);
        let lru = replay_dry(&t, PolicyKind::Lru, cap).unwrap().hit_ratio();
        let def = replay_dry(&t, PolicyKind::Default, cap)
            .unwrap()
            .hit_ratio();
        eprintln!(
            "mooncake {f}: lru {lru:.4} default {def:.4} (+{:.4})",
            def - lru
        );
        // Issue #19's floor: never below LRU by more than 0.003 (a step of
        // this session measured -0.0002 at 25%; now +0.0005).
        assert!(def >= lru - 0.003, "at {f}: default {def} < lru {lru}");
        // Issue targets: +0.02 at 5% and at 10% (measured +0.0249 and
        // +0.0203, docs/BENCHMARKS.md).
        if f == 0.05 || f == 0.1 {
            assert!(
                def >= lru + 0.02,
                "at {f}: default {def} not +0.02 over lru {lru}"
            );
        }
    }
}

#[test]
fn default_not_worse_than_lru_on_held_out_shapes() {
    // The held-out suite's shapes on their evaluation seeds (policy/synth.rs),
    // small: the full suite is `kvtier bench replay --suite`.
    use kvtier_daemon::tiers::policy::synth::{Shape, EVAL_SEEDS};
    for shape in Shape::ALL {
        let hinted = shape.generate(EVAL_SEEDS[0], 2000);
        // With the engine hints the shape carries, and without them.
        let mut variants = vec![(hinted.without_hints(), "no hints")];
        if hinted.has_hints() {
            variants.push((hinted, "hints"));
        }
        for (t, how) in variants {
            for f in [0.05, 0.1, 0.25] {
                let cap = capacity_for_fraction(&t, f);
                let lru = replay_dry(&t, PolicyKind::Lru, cap).unwrap().hit_ratio();
                let def = replay_dry(&t, PolicyKind::Default, cap)
                    .unwrap()
                    .hit_ratio();
                eprintln!("{} {f} {how}: lru {lru:.4} default {def:.4}", shape.name());
                assert!(
                    def >= lru - 0.003,
                    "{} at {f} ({how}): default {def} < lru {lru}",
                    shape.name()
                );
            }
        }
    }
}

#[test]
fn replay_hands_trace_hints_to_the_policy() {
    // Four blocks fit. Request 2 marks its last block ephemeral; request 3
    // hits 3 and stores 9, so one of the leaves 2 and 4 must go: by recency
    // it is 2 (older), by the hint it is 4. Request 4 re-reads [1, 2].
    let ephemeral_last = Some(RequestHints {
        ephemeral_tail_blocks: 1,
        ..RequestHints::default()
    });
    let trace = Trace {
        requests: vec![
            req(vec![1, 2]),
            Request {
                hints: ephemeral_last,
                ..req(vec![3, 4])
            },
            req(vec![3, 9]),
            req(vec![1, 2]),
        ],
    };
    assert!(trace.has_hints() && !trace.without_hints().has_hints());
    let hinted = replay_dry(&trace, PolicyKind::Default, 4).unwrap();
    let plain = replay_dry(&trace.without_hints(), PolicyKind::Default, 4).unwrap();
    assert_eq!(
        hinted.hits_per_request,
        vec![0, 0, 1, 2],
        "hint not honoured"
    );
    assert_eq!(
        plain.hits_per_request,
        vec![0, 0, 1, 1],
        "recency order changed"
    );
    // LRU has no notion of hints: the same hits either way.
    let lru = replay_dry(&trace, PolicyKind::Lru, 4).unwrap();
    let lru_plain = replay_dry(&trace.without_hints(), PolicyKind::Lru, 4).unwrap();
    assert_eq!(lru.hits_per_request, lru_plain.hits_per_request);
}
