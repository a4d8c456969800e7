#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Each hint and each structural promise of the default policy, under
//! pressure from a tier that evicts whatever the policy names.

use kvtier_client::Hints;
use kvtier_daemon::tiers::policy::replay::{replay, PolicyKind, PolicyTarget};
use kvtier_daemon::tiers::policy::trace::{Request, Trace};
use kvtier_daemon::tiers::policy::{BlockMeta, DefaultPolicy, EvictionPolicy};
use std::collections::{HashMap, HashSet};

/// A tier of `capacity` blocks that evicts the policy's victims and checks
/// the prefix invariant on every eviction.
struct Tier {
    policy: DefaultPolicy,
    capacity: usize,
    held: HashSet<u64>,
    parent: HashMap<u64, u64>,
    evicted: Vec<u64>,
}

impl Tier {
    fn new(policy: DefaultPolicy, capacity: usize) -> Self {
        Self {
            policy,
            capacity,
            held: HashSet::new(),
            parent: HashMap::new(),
            evicted: Vec::new(),
        }
    }
    fn put(&mut self, id: u64, parent: Option<u64>, hints: Hints) {
        while self.held.len() >= self.capacity {
            let v = self.policy.victim(&mut |_| true).expect("a victim");
            let has_child = self
                .parent
                .iter()
                .any(|(c, p)| *p == v && self.held.contains(c));
            assert!(!has_child, "evicted {v} before its cached children");
            self.policy.on_remove(v);
            self.held.remove(&v);
            self.evicted.push(v);
        }
        if let Some(p) = parent {
            self.parent.insert(id, p);
        }
        self.held.insert(id);
        self.policy.on_insert(
            id,
            BlockMeta {
                parent,
                size_bytes: 1,
                hints,
            },
        );
    }
}

fn pinned() -> Hints {
    Hints {
        pinned: true,
        ..Hints::default()
    }
}

#[test]
fn pinned_blocks_survive_pressure() {
    let mut t = Tier::new(DefaultPolicy::with_pin_budget(10), 50);
    for id in 0..10 {
        t.put(id, id.checked_sub(1), pinned());
    }
    for id in 100..5_000 {
        t.put(id, None, Hints::default());
    }
    for id in 0..10 {
        assert!(t.held.contains(&id), "pinned block {id} was evicted");
    }
    // Unpinned, they age out like anything else.
    for id in 0..10 {
        t.policy.on_hints(id, Hints::default());
    }
    for id in 5_000..5_200 {
        t.put(id, None, Hints::default());
    }
    assert!((0..10).all(|id| !t.held.contains(&id)));
}

#[test]
fn ephemeral_blocks_go_first() {
    let mut t = Tier::new(DefaultPolicy::new(), 20);
    for id in 0..10 {
        t.put(id, None, Hints::default());
    }
    let eph = Hints {
        ephemeral: true,
        ..Hints::default()
    };
    // Newer than every normal block, yet evicted before any of them.
    for id in 10..20 {
        t.put(id, None, eph);
    }
    for id in 20..30 {
        t.put(id, None, Hints::default());
    }
    let first: HashSet<u64> = t.evicted.iter().copied().collect();
    assert_eq!(first, (10..20).collect::<HashSet<u64>>());
}

#[test]
fn priority_raises_value() {
    let mut t = Tier::new(DefaultPolicy::new(), 20);
    for id in 100..120 {
        t.put(id, None, Hints::default());
    }
    t.put(
        0,
        None,
        Hints {
            priority: 2,
            ..Hints::default()
        },
    );
    for id in 1..40 {
        t.put(id, None, Hints::default());
    }
    assert!(
        t.held.contains(&0),
        "a priority-2 block lost to one-shot blocks"
    );
}

#[test]
fn parents_are_never_evicted_before_cached_children() {
    // Chains that branch, touched root first (as requests do), under heavy
    // pressure; `Tier::put` asserts the invariant on every eviction.
    let mut t = Tier::new(DefaultPolicy::new(), 64);
    let mut next = 1_000u64;
    for round in 0..400u64 {
        let root = round % 7;
        if !t.held.contains(&root) {
            t.put(root, None, Hints::default());
        } else {
            t.policy.on_access(root);
        }
        let mut parent = root;
        for _ in 0..(3 + round % 9) {
            t.put(next, Some(parent), Hints::default());
            parent = next;
            next += 1;
        }
    }
    assert!(t.evicted.len() > 1_000);
}

/// A hot 32-block prefix used once per 1.5 cache lifetimes of one-shot
/// blocks: LRU always loses it, the default policy keeps it.
#[test]
fn one_shot_flood_does_not_evict_hot_prefix() {
    let capacity = 400u64;
    let prefix: Vec<u64> = (0..32).map(|i| 1_000_000 + i).collect();
    let mut next = 1u64;
    let mut requests = Vec::new();
    let mut prefix_requests = Vec::new();
    for round in 0..60 {
        let mut ids = prefix.clone();
        ids.push(next);
        next += 1;
        prefix_requests.push((round >= 20, requests.len()));
        requests.push(ids);
        // 1.5 lifetimes of one-shot blocks, in requests of 10.
        for _ in 0..(capacity * 3 / 2 / 10) {
            requests.push((0..10).map(|i| next + i).collect());
            next += 10;
        }
    }
    let trace = Trace {
        requests: requests
            .into_iter()
            .map(|hash_ids| Request {
                timestamp: 0,
                input_length: 0,
                output_length: 0,
                hash_ids,
                hints: None,
            })
            .collect(),
    };
    let run = |kind| {
        let mut target = PolicyTarget::new(kind, &trace, capacity);
        let s = replay(&trace, &mut target).unwrap();
        let later: Vec<u32> = prefix_requests
            .iter()
            .filter(|(late, _)| *late)
            .map(|&(_, i)| s.hits_per_request[i])
            .collect();
        later.iter().filter(|&&h| h == 32).count() as f64 / later.len() as f64
    };
    let lru = run(PolicyKind::Lru);
    let def = run(PolicyKind::Default);
    eprintln!("hot prefix fully hit: lru {lru:.2} default {def:.2}");
    assert_eq!(lru, 0.0, "the scan is meant to flush LRU");
    assert!(
        def >= 0.9,
        "default kept the hot prefix in only {def:.2} of requests"
    );
}
