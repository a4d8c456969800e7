//! Chains stay reachable in G3 (issue 27): eviction takes leaves only and
//! never the parent of a batch being written nor a chain's open tail; a
//! block whose parent is absent is refused; a forced removal takes the
//! now-unreachable descendants along; links survive a restart; pins past
//! the budget are answered `StoredUnpinned`; with G4 write-through on,
//! eviction prefers uploaded blocks and counts the others.
//!
//! Then a model-based test (proptest) over random offload / branch /
//! lookup / pin / unpin / evict / background pass / restart sequences
//! against the real store. Cases: `PROPTEST_CASES` (default 16), e.g.
//! `PROPTEST_CASES=2000 cargo test -p kvtier-daemon --test g3_chains model`.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use kvtier_client::{BlockHeader, BlockKey, Hints, Namespace, NamespaceId};
use kvtier_daemon::base::error::Error;
use kvtier_daemon::base::tier::PutOutcome;
use kvtier_daemon::testkit::conformance::{block, namespace};
use kvtier_daemon::tiers::g3::engine::EngineKind;
use kvtier_daemon::tiers::g3::{G3Config, G3Event, G3Store, PutItem, PutMeta, RemoveReason};
use kvtier_daemon::tiers::policy::{DefaultPolicy, EvictionPolicy, Lru};
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Payload bytes of a block (its file is 4 KiB more).
const BLOCK: u64 = 4096;
const FILE: u64 = BLOCK + 4096;

fn cfg(root: &Path, blocks: u64, pinned_blocks: u64) -> G3Config {
    let mut c = G3Config::new(root, blocks * FILE);
    c.engine = EngineKind::Pread;
    c.io_depth = 2;
    c.buffer_pool_bytes = 1 << 20;
    c.pinned_budget_bytes = pinned_blocks * FILE;
    // No recycle pool: capacity is exactly `blocks` files.
    c.recycle_pool_bytes = 0;
    c
}

fn policy(lru: bool) -> Box<dyn EvictionPolicy> {
    if lru {
        Box::new(Lru::leaves_first())
    } else {
        Box::new(DefaultPolicy::new())
    }
}

/// Opens a store whose background thread does not evict: the tests run
/// its pass themselves (`background_pass`), between their checks.
fn open(root: &Path, blocks: u64, pinned: u64, lru: bool) -> Arc<G3Store> {
    let s = G3Store::open(cfg(root, blocks, pinned), policy(lru)).unwrap();
    s.pause_background_eviction(true);
    s
}

struct Blocks {
    ns: Namespace,
    made: HashMap<u64, (BlockKey, BlockHeader, Vec<u8>)>,
}

impl Blocks {
    fn new() -> Self {
        Blocks {
            ns: namespace(BLOCK, "chains").unwrap(),
            made: HashMap::new(),
        }
    }
    fn id(&self) -> NamespaceId {
        self.ns.id()
    }
    fn get(&mut self, seed: u64) -> &(BlockKey, BlockHeader, Vec<u8>) {
        let ns = &self.ns;
        self.made.entry(seed).or_insert_with(|| block(ns, seed))
    }
    fn key(&mut self, seed: u64) -> BlockKey {
        self.get(seed).0
    }
}

/// Offloads `seeds` as one batch, each the child of the one before, the
/// first the child of `parent`.
fn offload(
    s: &G3Store,
    b: &mut Blocks,
    parent: Option<u64>,
    seeds: &[u64],
    hints: Hints,
) -> Vec<Result<PutOutcome, Error>> {
    for &x in seeds.iter().chain(parent.iter()) {
        b.get(x);
    }
    let mut prev = parent.map(|p| b.made[&p].0);
    let items: Vec<PutItem<'_>> = seeds
        .iter()
        .map(|x| {
            let (k, h, p) = &b.made[x];
            let it = PutItem {
                header: h,
                payload: p,
                meta: PutMeta {
                    parent: prev,
                    hints,
                },
            };
            prev = Some(*k);
            it
        })
        .collect();
    s.put_blocks(&b.id(), &items)
}

fn held(s: &G3Store, b: &mut Blocks, seeds: &[u64]) -> Vec<bool> {
    let ns = b.id();
    seeds
        .iter()
        .map(|&x| s.stat(&ns, &b.key(x)).is_some())
        .collect()
}

/// How many leading blocks of the chain `seeds` are held, and how many
/// are held in all.
fn prefix_and_count(s: &G3Store, b: &mut Blocks, seeds: &[u64]) -> (usize, usize) {
    let h = held(s, b, seeds);
    (
        h.iter().take_while(|x| **x).count(),
        h.iter().filter(|x| **x).count(),
    )
}

/// The repro of issue 27 at G3 scale: one chain larger than the tier,
/// offloaded in batches, with the background pass running in between.
/// What is held is exactly the chain's head: nothing stranded below a gap.
#[test]
fn a_chain_larger_than_the_tier_keeps_its_head_and_strands_nothing() {
    for lru in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let s = open(dir.path(), 16, 4, lru);
        let mut b = Blocks::new();
        let chain: Vec<u64> = (0..40).collect();
        let mut parent = None;
        for part in chain.chunks(4) {
            let _ = offload(&s, &mut b, parent, part, Hints::default());
            s.background_pass();
            parent = part.last().copied();
        }
        let (prefix, count) = prefix_and_count(&s, &mut b, &chain);
        let keys: Vec<BlockKey> = chain.iter().map(|&x| b.key(x)).collect();
        assert_eq!(s.lookup_prefix(&b.id(), &keys), prefix);
        assert_eq!(
            prefix, count,
            "lru={lru}: {count} held but the lookup prefix is {prefix}"
        );
        assert!(prefix >= 12, "lru={lru}: only {prefix} of a 16-block tier");
    }
}

/// (a) Room made for a batch never takes the block the batch continues: a
/// full tier holding one chain refuses its continuation (the chain's head
/// stays whole) rather than cutting the chain under it.
#[test]
fn room_for_a_batch_never_takes_its_own_parent() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 16, 4, false);
    let mut b = Blocks::new();
    let head: Vec<u64> = (0..16).collect();
    for r in offload(&s, &mut b, None, &head, Hints::default()) {
        assert_eq!(r.unwrap(), PutOutcome::Stored);
    }
    let out = offload(&s, &mut b, Some(15), &[16, 17], Hints::default());
    assert!(
        matches!(out[0], Err(Error::LimitReached { .. })),
        "{:?}",
        out[0]
    );
    assert!(
        matches!(out[1], Err(Error::ParentAbsent { .. })),
        "{:?}",
        out[1]
    );
    assert_eq!(prefix_and_count(&s, &mut b, &head), (16, 16));
}

/// (b) The background pass never takes a chain's open tail: the newest
/// block is a leaf only because the rest of its request has not arrived.
#[test]
fn the_background_pass_spares_the_open_tail() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 16, 4, false);
    let mut b = Blocks::new();
    let chain: Vec<u64> = (0..16).collect();
    let _ = offload(&s, &mut b, None, &chain[..12], Hints::default());
    let _ = offload(&s, &mut b, Some(11), &chain[12..], Hints::default());
    // Above the high watermark (16 of 16), and the only leaf is the tail.
    assert_eq!(s.background_pass(), 0);
    assert_eq!(prefix_and_count(&s, &mut b, &chain), (16, 16));
}

/// (c) A block whose parent is not held is refused: it could never be
/// reached, and stored it took room from reachable blocks.
#[test]
fn a_block_whose_parent_is_absent_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 16, 4, false);
    let mut b = Blocks::new();
    let out = offload(&s, &mut b, Some(100), &[1, 2], Hints::default());
    assert!(
        matches!(out[0], Err(Error::ParentAbsent { .. })),
        "{:?}",
        out[0]
    );
    assert!(
        matches!(out[1], Err(Error::ParentAbsent { .. })),
        "{:?}",
        out[1]
    );
    assert_eq!(held(&s, &mut b, &[1, 2]), vec![false, false]);
    // Its parent first, in the same batch: both stored.
    let out = offload(&s, &mut b, None, &[100, 1], Hints::default());
    assert!(out.iter().all(|r| matches!(r, Ok(PutOutcome::Stored))));
}

/// A forced removal (delete, `kvtier evict`, corruption) takes the
/// descendants along, children first, each with its `Removed` event.
#[test]
fn a_forced_removal_takes_the_unreachable_descendants() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 64, 4, false);
    let mut b = Blocks::new();
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    s.set_event_sink(Arc::new(move |e| sink.lock().unwrap().push(e)));
    // 0 -> 1 -> 2 -> 3 and a branch 1 -> 10 -> 11, all pinned.
    let pin = Hints {
        pinned: true,
        ..Hints::default()
    };
    let _ = offload(&s, &mut b, None, &[0, 1, 2, 3], pin);
    let _ = offload(&s, &mut b, Some(1), &[10, 11], pin);
    events.lock().unwrap().clear();
    assert!(s.evict_block(&b.id(), &b.key(1)).unwrap());
    assert_eq!(
        held(&s, &mut b, &[0, 1, 2, 3, 10, 11]),
        vec![true, false, false, false, false, false]
    );
    let removed: Vec<BlockKey> = events
        .lock()
        .unwrap()
        .iter()
        .filter_map(|e| match e {
            G3Event::Removed { key, reason, .. } => {
                assert_eq!(*reason, RemoveReason::Deleted);
                Some(*key)
            }
            _ => None,
        })
        .collect();
    assert_eq!(removed.len(), 5, "{removed:?}");
    let at = |x: u64, b: &mut Blocks| removed.iter().position(|k| *k == b.key(x)).unwrap();
    assert!(at(3, &mut b) < at(2, &mut b) && at(11, &mut b) < at(10, &mut b));
    let figures: HashMap<_, _> = s.recovery_figures().into_iter().collect();
    assert_eq!(figures["unreachable_removed"], 4);
}

/// Parent links survive a restart, clean (the snapshot) or not (redb):
/// after it, removing the root still takes the whole chain, and eviction
/// still takes the tail first.
#[test]
fn parent_links_survive_a_restart() {
    for clean in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let mut b = Blocks::new();
        let chain: Vec<u64> = (0..8).collect();
        let s = open(dir.path(), 16, 4, false);
        let _ = offload(&s, &mut b, None, &chain, Hints::default());
        if clean {
            s.close().unwrap();
        }
        reopen_after_drop(s);
        let s = open(dir.path(), 16, 4, false);
        assert_eq!(s.recovery.lock().unwrap().clean_start, clean);
        // Touch the root last: plain recency would now take the tail's
        // parent chain from the root.
        let _ = s.lookup_prefix(&b.id(), &[b.key(0)]);
        let other: Vec<u64> = (100..112).collect();
        let _ = offload(&s, &mut b, None, &other, Hints::default());
        let (prefix, count) = prefix_and_count(&s, &mut b, &chain);
        assert_eq!(prefix, count, "clean={clean}");
        assert!(s.evict_block(&b.id(), &b.key(0)).unwrap());
        assert_eq!(
            prefix_and_count(&s, &mut b, &chain),
            (0, 0),
            "clean={clean}"
        );
    }
}

/// Pins past `pinned_budget_bytes` are answered `StoredUnpinned`, never a
/// plain `Stored`; the honoured ones are never evicted.
#[test]
fn pins_past_the_budget_are_answered_stored_unpinned() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 16, 3, false);
    let mut b = Blocks::new();
    let pin = Hints {
        pinned: true,
        ..Hints::default()
    };
    let seeds: Vec<u64> = (0..5).collect();
    let out: Vec<PutOutcome> = seeds
        .iter()
        .map(|&x| offload(&s, &mut b, None, &[x], pin).pop().unwrap().unwrap())
        .collect();
    assert_eq!(
        out,
        [
            PutOutcome::Stored,
            PutOutcome::Stored,
            PutOutcome::Stored,
            PutOutcome::StoredUnpinned,
            PutOutcome::StoredUnpinned
        ]
    );
    // Fill the tier twice over: the three pinned blocks stay.
    for x in 0..32u64 {
        let _ = offload(&s, &mut b, None, &[1000 + x], Hints::default());
    }
    assert_eq!(held(&s, &mut b, &[0, 1, 2]), vec![true; 3]);
}

/// With G4 write-through on, eviction takes a block already in G4 before
/// an older one that is not, and counts a block evicted before its upload.
#[test]
fn eviction_prefers_uploaded_blocks_and_counts_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 8, 1, true);
    s.set_prefer_uploaded(true);
    let mut b = Blocks::new();
    for x in 0..8u64 {
        let _ = offload(&s, &mut b, None, &[x], Hints::default());
    }
    // 7 is the most recent, but the only one in G4.
    assert!(s.mark_in_g4(&b.id(), &b.key(7)));
    let _ = offload(&s, &mut b, None, &[8], Hints::default());
    let first: Vec<u64> = (0..8).collect();
    let mut want = vec![true; 8];
    want[7] = false;
    assert_eq!(held(&s, &mut b, &first), want);
    let figures: HashMap<_, _> = s.recovery_figures().into_iter().collect();
    assert_eq!(figures["evicted_before_upload"], 0);
    // Nothing uploaded is left: the least recent goes, and is counted.
    let _ = offload(&s, &mut b, None, &[9], Hints::default());
    assert_eq!(held(&s, &mut b, &[0, 1, 2]), vec![false, true, true]);
    let figures: HashMap<_, _> = s.recovery_figures().into_iter().collect();
    assert_eq!(figures["evicted_before_upload"], 1);
}

// ---------------------------------------------------------------------
// The model-based test.

#[derive(Debug, Clone)]
enum Op {
    /// Extends path `path` by `n` new blocks (one batch).
    Extend {
        path: usize,
        n: usize,
        hints: u8,
    },
    /// A new path branching off path `path` after its first `at` blocks.
    Branch {
        path: usize,
        at: usize,
        n: usize,
    },
    /// Offloads path `path` again from its start (present blocks and all).
    Reoffload {
        path: usize,
    },
    Lookup {
        path: usize,
    },
    Pin {
        path: usize,
        at: usize,
    },
    Unpin {
        path: usize,
        at: usize,
    },
    Evict {
        path: usize,
        at: usize,
    },
    Background,
    Restart {
        clean: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..4usize, 1..6usize, 0..8u8).prop_map(|(path, n, hints)| Op::Extend { path, n, hints }),
        2 => (0..4usize, 0..8usize, 1..5usize).prop_map(|(path, at, n)| Op::Branch { path, at, n }),
        1 => (0..4usize).prop_map(|path| Op::Reoffload { path }),
        2 => (0..4usize).prop_map(|path| Op::Lookup { path }),
        2 => (0..4usize, 0..12usize).prop_map(|(path, at)| Op::Pin { path, at }),
        1 => (0..4usize, 0..12usize).prop_map(|(path, at)| Op::Unpin { path, at }),
        1 => (0..4usize, 0..12usize).prop_map(|(path, at)| Op::Evict { path, at }),
        2 => Just(Op::Background),
        1 => any::<bool>().prop_map(|clean| Op::Restart { clean }),
    ]
}

/// The reference model: the chains offloaded (declared parents), and the
/// pins the store acknowledged.
#[derive(Default)]
struct Model {
    /// Paths: seeds from a root.
    paths: Vec<Vec<u64>>,
    parent: HashMap<u64, Option<u64>>,
    next: u64,
    /// Pins acknowledged (an offload answered `Stored` with the pin hint,
    /// or `pin` answered true) and not yet unpinned or removed by force.
    pinned: HashSet<u64>,
}

impl Model {
    fn path(&self, i: usize) -> Option<&Vec<u64>> {
        if self.paths.is_empty() {
            None
        } else {
            self.paths.get(i % self.paths.len())
        }
    }
    fn fresh(&mut self, n: usize) -> Vec<u64> {
        let v = (self.next..self.next + n as u64).collect();
        self.next += n as u64;
        v
    }
    fn descendants_and_self(&self, x: u64) -> Vec<u64> {
        let mut out = vec![x];
        let mut i = 0;
        while i < out.len() {
            let p = out[i];
            out.extend(
                self.parent
                    .iter()
                    .filter(|(_, q)| **q == Some(p))
                    .map(|(c, _)| *c),
            );
            i += 1;
        }
        out
    }
}

fn hints_of(bits: u8) -> Hints {
    Hints {
        pinned: bits & 1 != 0,
        ephemeral: bits & 2 != 0,
        priority: if bits & 4 != 0 { 5 } else { 0 },
        expected_reuse: 0,
    }
}

fn check(s: &G3Store, b: &mut Blocks, m: &Model) -> Result<(), TestCaseError> {
    let ns = b.id();
    let seeds: Vec<u64> = m.parent.keys().copied().collect();
    let is_held: HashMap<u64, bool> = seeds
        .iter()
        .map(|&x| (x, s.stat(&ns, &b.key(x)).is_some()))
        .collect();
    // Every held block is reachable from a held root: its parents all held.
    for (&x, &h) in &is_held {
        if !h {
            continue;
        }
        let mut at = x;
        while let Some(Some(p)) = m.parent.get(&at) {
            prop_assert!(is_held[p], "block {x} held but its ancestor {p} is not");
            at = *p;
        }
    }
    // The lookup prefix is the held contiguous prefix.
    for path in &m.paths {
        let keys: Vec<BlockKey> = path.iter().map(|&x| b.key(x)).collect();
        let held_prefix = path.iter().take_while(|x| is_held[x]).count();
        let found = s.lookup_prefix(&ns, &keys);
        prop_assert_eq!(
            found,
            held_prefix,
            "path {:?}: held {:?}, one by one {:?}",
            path,
            path.iter().map(|x| is_held[x]).collect::<Vec<_>>(),
            keys.iter()
                .map(|k| s.lookup_prefix(&ns, std::slice::from_ref(k)))
                .collect::<Vec<_>>()
        );
    }
    // Acknowledged pins are honoured.
    for x in &m.pinned {
        prop_assert!(is_held[x], "pinned block {} was evicted", x);
    }
    Ok(())
}

/// Drops a store and waits until it is gone: its reclaimer thread holds it
/// for the length of a pass (and may be the one that drops it), and a
/// second open of the directory while the first is alive would find its
/// index locked (and rebuild it, without links or pins).
fn reopen_after_drop(s: Arc<G3Store>) {
    let index = s.config().root.join("index.redb");
    drop(s);
    let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while kvtier_daemon::tiers::g3::index::DiskIndex::open(&index).is_err() {
        assert!(
            std::time::Instant::now() < until,
            "the store was never dropped"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

fn run(ops: Vec<Op>, lru: bool) -> Result<(), TestCaseError> {
    const BLOCKS: u64 = 24;
    const PINS: u64 = 4;
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), BLOCKS, PINS, lru);
    let mut b = Blocks::new();
    let mut m = Model::default();
    for (step, op) in ops.into_iter().enumerate() {
        let what = format!("step {step}: {op:?}");
        match op {
            Op::Extend { path, n, hints } => {
                let h = hints_of(hints);
                let (idx, parent) = match m.path(path) {
                    Some(p) => (Some(path % m.paths.len()), p.last().copied()),
                    None => (None, None),
                };
                let new = m.fresh(n);
                let mut prev = parent;
                for &x in &new {
                    m.parent.insert(x, prev);
                    prev = Some(x);
                }
                let out = offload(&s, &mut b, parent, &new, h);
                for (x, r) in new.iter().zip(&out) {
                    if h.pinned && matches!(r, Ok(PutOutcome::Stored)) {
                        m.pinned.insert(*x);
                    }
                    if !h.pinned {
                        prop_assert!(!matches!(r, Ok(PutOutcome::StoredUnpinned)));
                    }
                }
                match idx {
                    Some(i) => m.paths[i].extend(new),
                    None => m.paths.push(new),
                }
            }
            Op::Branch { path, at, n } => {
                let base: Vec<u64> = match m.path(path) {
                    Some(p) => p[..at.min(p.len())].to_vec(),
                    None => Vec::new(),
                };
                let new = m.fresh(n);
                let mut prev = base.last().copied();
                for &x in &new {
                    m.parent.insert(x, prev);
                    prev = Some(x);
                }
                let _ = offload(&s, &mut b, base.last().copied(), &new, Hints::default());
                m.paths.push(base.into_iter().chain(new).collect());
            }
            Op::Reoffload { path } => {
                if let Some(p) = m.path(path).cloned() {
                    let _ = offload(&s, &mut b, None, &p, Hints::default());
                }
            }
            Op::Lookup { path } => {
                if let Some(p) = m.path(path) {
                    let keys: Vec<BlockKey> = p.iter().map(|&x| b.key(x)).collect();
                    let _ = s.lookup_prefix(&b.id(), &keys);
                }
            }
            Op::Pin { path, at } => {
                if let Some(&x) = m.path(path).and_then(|p| p.get(at % p.len().max(1))) {
                    let k = b.key(x);
                    if s.pin(&b.id(), &k, None) {
                        m.pinned.insert(x);
                    }
                }
            }
            Op::Unpin { path, at } => {
                if let Some(&x) = m.path(path).and_then(|p| p.get(at % p.len().max(1))) {
                    let k = b.key(x);
                    s.unpin(&b.id(), &k);
                    m.pinned.remove(&x);
                }
            }
            Op::Evict { path, at } => {
                if let Some(&x) = m.path(path).and_then(|p| p.get(at % p.len().max(1))) {
                    let k = b.key(x);
                    if s.evict_block(&b.id(), &k).unwrap() {
                        for d in m.descendants_and_self(x) {
                            m.pinned.remove(&d);
                        }
                    }
                }
            }
            Op::Background => {
                s.background_pass();
            }
            Op::Restart { clean } => {
                if clean {
                    s.close().unwrap();
                }
                reopen_after_drop(s);
                s = open(dir.path(), BLOCKS, PINS, lru);
                prop_assert!(!s.recovery.lock().unwrap().index_rebuilt);
            }
        }
        check(&s, &mut b, &m).map_err(|e| TestCaseError::fail(format!("after {what}: {e}")))?;
    }
    Ok(())
}

/// Found by the model test: links lost to an index rebuilt behind a live
/// store (fixed in the test: `reopen_after_drop`).
#[test]
fn model_regression_unclean_restart_then_forced_removal() {
    let ops = vec![
        Op::Branch {
            path: 1,
            at: 6,
            n: 2,
        },
        Op::Extend {
            path: 1,
            n: 5,
            hints: 3,
        },
        Op::Extend {
            path: 3,
            n: 5,
            hints: 6,
        },
        Op::Extend {
            path: 2,
            n: 5,
            hints: 6,
        },
        Op::Branch {
            path: 1,
            at: 2,
            n: 3,
        },
        Op::Extend {
            path: 2,
            n: 4,
            hints: 2,
        },
        Op::Restart { clean: false },
        Op::Evict { path: 3, at: 3 },
        Op::Background,
        Op::Extend {
            path: 1,
            n: 4,
            hints: 6,
        },
        Op::Extend {
            path: 1,
            n: 2,
            hints: 4,
        },
    ];
    for lru in [false, true] {
        run(ops.clone(), lru).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(16),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn model_chains_stay_reachable_and_pins_are_honoured(
        ops in proptest::collection::vec(op(), 1..40),
        lru in any::<bool>(),
    ) {
        run(ops, lru)?;
    }
}

/// Found by the model test: a pin given as an offload hint was in memory
/// only until a clean close, so a crash dropped it silently.
#[test]
fn an_offload_pin_survives_an_unclean_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = Blocks::new();
    let s = open(dir.path(), 16, 4, false);
    let pin = Hints {
        pinned: true,
        ..Hints::default()
    };
    let out = offload(&s, &mut b, None, &[0, 1, 2, 3, 4], pin);
    assert!(matches!(out[3], Ok(PutOutcome::Stored)));
    assert!(matches!(out[4], Ok(PutOutcome::StoredUnpinned)));
    reopen_after_drop(s);
    let s = open(dir.path(), 16, 4, false);
    assert!(!s.recovery.lock().unwrap().clean_start);
    assert_eq!(s.pinned_blocks(), 4);
    for x in 100..140u64 {
        let _ = offload(&s, &mut b, None, &[x], Hints::default());
    }
    assert_eq!(
        held(&s, &mut b, &[0, 1, 2, 3, 4]),
        vec![true, true, true, true, false]
    );
}
