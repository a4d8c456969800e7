#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `G3Store::put_blocks`: the blocks of one request written together and
//! made durable together. Order of policy inserts and events along a parent
//! chain, per-item outcomes (invalid, present, repeated, bad checksum),
//! a full filesystem mid-batch, restart after a batch, group commit use.

#[path = "g3_support/mod.rs"]
mod common;

use kvtier_client::{BlockHeader, BlockKey};
use kvtier_daemon::base::tier::{BlockTier, PutOutcome};
use kvtier_daemon::testkit::conformance::{block, namespace};
use kvtier_daemon::tiers::g3::engine::EngineKind;
use kvtier_daemon::tiers::g3::index::digest;
use kvtier_daemon::tiers::g3::{G3Event, G3Store, PutItem, PutMeta};
use kvtier_daemon::tiers::policy::{BlockMeta, EvictionPolicy, Lru};
use kvtier_daemon::Error;
use std::sync::{Arc, Mutex};

type Inserts = Arc<Mutex<Vec<(u64, Option<u64>)>>>;

/// LRU that records every insert (id, parent id) in call order.
struct Recording {
    inner: Lru,
    inserts: Inserts,
}

impl EvictionPolicy for Recording {
    fn name(&self) -> &'static str {
        "recording-lru"
    }
    fn on_insert(&mut self, id: u64, meta: BlockMeta) {
        self.inserts.lock().unwrap().push((id, meta.parent));
        self.inner.on_insert(id, meta);
    }
    fn on_access(&mut self, id: u64) {
        self.inner.on_access(id);
    }
    fn on_remove(&mut self, id: u64) {
        self.inner.on_remove(id);
    }
    fn victim(&mut self, can_evict: &mut dyn FnMut(u64) -> bool) -> Option<u64> {
        self.inner.victim(can_evict)
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
}

type Blocks = Vec<(BlockKey, BlockHeader, Vec<u8>)>;

/// Reopens after a drop. The background reclaimer holds the store for a
/// moment once a second (lease sweep, index flush); if the drop lands in
/// that moment, redb stays locked until the reclaimer lets go.
fn reopen(root: &std::path::Path) -> Arc<G3Store> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match G3Store::open(common::cfg(root, EngineKind::Auto), Box::new(Lru::new())) {
            Ok(s) => return s,
            Err(e)
                if std::time::Instant::now() < deadline
                    && e.to_string().contains("already open") =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => panic!("reopen: {e}"),
        }
    }
}

fn item<'a>(header: &'a BlockHeader, payload: &'a [u8]) -> PutItem<'a> {
    PutItem {
        header,
        payload,
        meta: PutMeta::default(),
    }
}

fn blocks(ns: &kvtier_client::Namespace, seeds: std::ops::Range<u64>) -> Blocks {
    seeds.map(|s| block(ns, s)).collect()
}

/// Items of a chain: each block's parent is the one before it.
fn chain_items(bs: &Blocks) -> Vec<PutItem<'_>> {
    bs.iter()
        .enumerate()
        .map(|(i, (_, h, p))| PutItem {
            header: h,
            payload: p,
            meta: PutMeta {
                parent: i.checked_sub(1).map(|j| bs[j].0),
                ..PutMeta::default()
            },
        })
        .collect()
}

#[test]
fn batch_inserts_policy_and_events_in_input_order_along_the_chain() {
    let dir = tempfile::tempdir().unwrap();
    let inserts: Inserts = Arc::default();
    let policy = Recording {
        inner: Lru::new(),
        inserts: inserts.clone(),
    };
    let mut c = common::cfg(dir.path(), EngineKind::Auto);
    c.io_depth = 8;
    let s = G3Store::open(c, Box::new(policy)).unwrap();
    let events = Arc::new(Mutex::new(Vec::new()));
    let ev = events.clone();
    s.set_event_sink(Arc::new(move |e| ev.lock().unwrap().push(e)));
    let ns = namespace(64 << 10, "order").unwrap();
    let id = ns.id();
    // Enough blocks that the concurrent writes finish out of order.
    let bs = blocks(&ns, 0..24);
    let (g0, m0) = s.group_commit_counts();
    let out = s.put_blocks(&id, &chain_items(&bs));
    assert_eq!(out.len(), bs.len());
    for (i, r) in out.iter().enumerate() {
        assert_eq!(*r.as_ref().unwrap(), PutOutcome::Stored, "item {i}");
    }
    // One participant: the whole batch committed by one group.
    let (g1, m1) = s.group_commit_counts();
    assert_eq!((g1 - g0, m1 - m0), (1, bs.len() as u64));

    let want: Vec<(u64, Option<u64>)> = bs
        .iter()
        .enumerate()
        .map(|(i, (k, _, _))| {
            (
                digest(&id, k).0,
                i.checked_sub(1).map(|j| digest(&id, &bs[j].0).0),
            )
        })
        .collect();
    assert_eq!(
        *inserts.lock().unwrap(),
        want,
        "policy inserts in input order"
    );
    let stored: Vec<(BlockKey, Option<BlockKey>)> = events
        .lock()
        .unwrap()
        .iter()
        .map(|e| match e {
            G3Event::Stored { key, parent, .. } => (*key, *parent),
            other => panic!("{other:?}"),
        })
        .collect();
    let want_ev: Vec<(BlockKey, Option<BlockKey>)> = bs
        .iter()
        .enumerate()
        .map(|(i, (k, _, _))| (*k, i.checked_sub(1).map(|j| bs[j].0)))
        .collect();
    assert_eq!(stored, want_ev, "Stored events in input order");
    let chain: Vec<BlockKey> = bs.iter().map(|b| b.0).collect();
    assert_eq!(s.lookup_prefix(&id, &chain), chain.len());
    for (k, _, p) in &bs {
        assert_eq!(&s.get(&id, k).unwrap().hit().unwrap().payload, p);
    }
    assert_eq!(common::temp_files(dir.path()), 0);
}

#[test]
fn batch_items_fail_alone() {
    let dir = tempfile::tempdir().unwrap();
    let s = common::open(dir.path(), EngineKind::Auto);
    let ns = namespace(8192, "partial").unwrap();
    let other = namespace(8192, "partial-other").unwrap();
    let id = ns.id();
    let bs = blocks(&ns, 0..6);
    // Block 1 is stored before the batch.
    assert_eq!(s.put(&id, &bs[1].1, &bs[1].2).unwrap(), PutOutcome::Stored);
    let short = &bs[2].2[..100];
    let mut flipped = bs[3].2.clone();
    flipped[77] ^= 1;
    let (_, foreign_h, foreign_p) = block(&other, 9);
    let items = vec![
        item(&bs[0].1, &bs[0].2),     // 0 stored
        item(&bs[1].1, &bs[1].2),     // 1 present
        item(&bs[2].1, short),        // 2 wrong length
        item(&bs[3].1, &flipped),     // 3 checksum mismatch
        item(&foreign_h, &foreign_p), // 4 other namespace
        item(&bs[4].1, &bs[4].2),     // 5 stored
        item(&bs[4].1, &bs[4].2),     // 6 repeat of 5
        item(&bs[5].1, &bs[5].2),     // 7 stored
    ];
    let out = s.put_blocks(&id, &items);
    let ok = |i: usize| *out[i].as_ref().unwrap();
    assert_eq!(ok(0), PutOutcome::Stored);
    assert_eq!(ok(1), PutOutcome::AlreadyPresent);
    for i in [2, 3, 4] {
        assert!(
            matches!(out[i], Err(Error::InvalidInput { .. })),
            "item {i}: {:?}",
            out[i]
        );
    }
    assert_eq!(ok(5), PutOutcome::Stored);
    assert_eq!(ok(6), PutOutcome::AlreadyPresent);
    assert_eq!(ok(7), PutOutcome::Stored);
    for i in [0, 1, 4, 5] {
        assert!(s.get(&id, &bs[i].0).unwrap().hit().is_some(), "block {i}");
    }
    for i in [2, 3] {
        assert!(!s.contains(&id, &bs[i].0).unwrap(), "block {i}");
        assert!(!s.block_file_path(&id, &bs[i].0).exists());
    }
    assert_eq!(common::temp_files(dir.path()), 0);
    assert_eq!(s.stats().blocks, 4);
    // Not poisoned by the invalid items.
    let (_, h, p) = block(&ns, 100);
    assert_eq!(s.put(&id, &h, &p).unwrap(), PutOutcome::Stored);
}

#[test]
fn blocks_of_a_batch_survive_restart() {
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace(64 << 10, "restart").unwrap();
    let id = ns.id();
    let bs = blocks(&ns, 0..12);
    let chain: Vec<BlockKey> = bs.iter().map(|b| b.0).collect();
    {
        let s = common::open(dir.path(), EngineKind::Auto);
        assert!(s
            .put_blocks(&id, &chain_items(&bs))
            .iter()
            .all(|r| matches!(r, Ok(PutOutcome::Stored))));
        // No clean close: the restart walks the files against the index.
        drop(s);
    }
    let s = reopen(dir.path());
    assert_eq!(s.lookup_prefix(&id, &chain), chain.len());
    for (k, _, p) in &bs {
        assert_eq!(&s.get(&id, k).unwrap().hit().unwrap().payload, p);
    }
    assert_eq!(s.verify_all().unwrap().ok, bs.len() as u64);
    assert_eq!(s.recovery.lock().unwrap().quarantined, 0);
    // A second batch of the same blocks writes nothing.
    let out = s.put_blocks(&id, &chain_items(&bs));
    assert!(out
        .iter()
        .all(|r| matches!(r, Ok(PutOutcome::AlreadyPresent))));
    s.close().unwrap();
    drop(s);
    let s = reopen(dir.path());
    assert_eq!(s.lookup_prefix(&id, &chain), chain.len());
}

#[test]
fn full_filesystem_mid_batch_stores_what_was_written() {
    let Some(dir) = common::SmallTmpfs::mount("6m", "full_filesystem_mid_batch") else {
        return;
    };
    let ns = namespace(256 << 10, "full-batch").unwrap();
    let id = ns.id();
    let bs = blocks(&ns, 0..40);
    let out = {
        let s = common::open(dir.path(), EngineKind::Auto);
        let out = s.put_blocks(&id, &chain_items(&bs));
        let stored: Vec<usize> = (0..bs.len())
            .filter(|&i| matches!(out[i], Ok(PutOutcome::Stored)))
            .collect();
        assert!(stored.len() >= 2, "stored {stored:?}");
        // A chain: the blocks before the first failure are stored, every
        // block after it is out of space or refused for its parent (a
        // block past a missing one could never be reached; the write
        // threads may have written it, it is taken back).
        let first_failed = stored.len();
        assert_eq!(stored, (0..first_failed).collect::<Vec<_>>(), "{out:?}");
        for (i, r) in out.iter().enumerate() {
            match r {
                Ok(PutOutcome::Stored) => {
                    let b = s
                        .get(&id, &bs[i].0)
                        .unwrap()
                        .hit()
                        .expect("read after ENOSPC");
                    assert_eq!(b.payload, bs[i].2);
                }
                Err(Error::NoSpace { .. }) => assert!(!s.contains(&id, &bs[i].0).unwrap()),
                Err(Error::ParentAbsent { parent, .. }) => {
                    assert!(i > first_failed, "item {i} refused for its parent");
                    assert_eq!(**parent, bs[i - 1].0);
                    assert!(!s.contains(&id, &bs[i].0).unwrap());
                }
                other => panic!("item {i}: {other:?}"),
            }
        }
        assert!(matches!(out[first_failed], Err(Error::NoSpace { .. })));
        assert_eq!(common::temp_files(dir.path()), 0);
        assert!(s.stats().read_only.is_none(), "ENOSPC does not poison");
        // After space is freed, a batch stores again. Deleting block 1
        // takes its descendants along (no lookup reaches them without it):
        // only block 0 stays.
        s.delete(&id, &bs[1].0).unwrap();
        for &i in &stored[1..] {
            assert!(
                !s.contains(&id, &bs[i].0).unwrap(),
                "block {i} outlived its parent"
            );
        }
        assert!(s.contains(&id, &bs[0].0).unwrap());
        let (_, h, p) = block(&ns, 1000);
        let again = s.put_blocks(
            &id,
            &[PutItem {
                header: &h,
                payload: &p,
                meta: PutMeta::default(),
            }],
        );
        assert!(matches!(again[0], Ok(PutOutcome::Stored)), "{:?}", again[0]);
        out
    };
    // Restart: block 0 is there, and nothing deleted or failed.
    let s = reopen(dir.path());
    for (i, b) in bs.iter().enumerate().take(out.len()) {
        let present = s.contains(&id, &b.0).unwrap();
        assert_eq!(present, i == 0, "block {i}");
    }
    assert_eq!(s.recovery.lock().unwrap().quarantined, 0);
}
