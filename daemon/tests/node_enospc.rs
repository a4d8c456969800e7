#![allow(clippy::unwrap_used, clippy::expect_used)]
//! A node whose G3 capacity is above what its filesystem holds (a 6 MiB
//! tmpfs under a 256 MiB capacity): the start warns (health), and an
//! offload that hits ENOSPC evicts and retries instead of failing, one at
//! a time and in batches. Needs root for the tmpfs (skips visibly).

#[path = "g3_support/mod.rs"]
mod common;

use kvtier_client::{BlockHeader, BlockKey, Hints, KvLayout, Namespace};
use kvtier_daemon::base::backend::{Backend, OffloadBlock};
use kvtier_daemon::base::tier::PutOutcome;
use kvtier_daemon::node::{Node, NodeConfig};
use kvtier_daemon::tiers::g3::G3Config;

const BLOCK: u64 = 256 << 10;

fn ns() -> Namespace {
    Namespace::new(
        "enospc",
        KvLayout::with_block_bytes(BLOCK).unwrap(),
        "",
        "t",
    )
    .unwrap()
}

fn block(i: u64) -> (BlockHeader, Vec<u8>) {
    let payload: Vec<u8> = (0..BLOCK).map(|j| (j * 3 + i * 7) as u8).collect();
    let h = BlockHeader::for_payload(&ns(), BlockKey::from_u64(0xe000 + i), &payload, 0);
    (h, payload)
}

#[test]
fn enospc_on_offload_evicts_and_retries_and_the_start_warns() {
    let Some(dir) = common::SmallTmpfs::mount("6m", "enospc_on_offload") else {
        return;
    };
    let mut g3 = G3Config::new(dir.path().join("g3"), 256 << 20);
    g3.high_watermark = 0.99;
    let node = Node::open(NodeConfig::new(g3)).unwrap();
    let health = node.health();
    assert!(
        health.iter().any(|l| l.contains("g3 capacity")),
        "{health:?}"
    );
    let id = ns().id();
    // 64 x 256 KiB = 16 MiB through a 6 MiB filesystem, one at a time.
    for i in 0..64 {
        let (h, p) = block(i);
        let r = node.offload(&id, &h, &p, None, Hints::default());
        assert!(matches!(r, Ok(PutOutcome::Stored)), "offload {i}: {r:?}");
    }
    // And in batches of 8.
    for b in 0..4 {
        let blocks: Vec<(BlockHeader, Vec<u8>)> = (0..8).map(|j| block(100 + b * 8 + j)).collect();
        let items: Vec<OffloadBlock<'_>> = blocks
            .iter()
            .map(|(h, p)| OffloadBlock {
                header: h.clone(),
                payload: p,
                parent: None,
                hints: Hints::default(),
            })
            .collect();
        let out = node.offload_batch(&id, &items);
        let stored = out
            .iter()
            .filter(|r| matches!(r, Ok(PutOutcome::Stored)))
            .count();
        assert!(stored >= 4, "batch {b}: {out:?}");
    }
    let last = block(100 + 31).0.key;
    assert_eq!(
        node.lookup(&id, &[last]).unwrap().len(),
        1,
        "the newest block is there"
    );
}

/// Fills the filesystem of `path` to the last byte (the operator's other
/// files); the file is returned for the operator to delete.
fn fill(path: &std::path::Path) -> std::path::PathBuf {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    for chunk in [1 << 16, 4096, 1] {
        let buf = vec![0xa5u8; chunk];
        while f.write_all(&buf).is_ok() {}
    }
    let _ = f.sync_all();
    path.to_path_buf()
}

fn small(i: u64) -> (BlockHeader, Vec<u8>) {
    let payload: Vec<u8> = (0..SMALL).map(|j| (j * 5 + i * 11) as u8).collect();
    let h = BlockHeader::for_payload(&ns_small(), BlockKey::from_u64(0xf000 + i), &payload, 0);
    (h, payload)
}

const SMALL: u64 = 64 << 10;

fn ns_small() -> Namespace {
    Namespace::new(
        "enospc-index",
        KvLayout::with_block_bytes(SMALL).unwrap(),
        "",
        "t",
    )
    .unwrap()
}

fn full_said(node: &Node) -> bool {
    node.health().iter().any(|l| l.contains("is full"))
}

/// Issue #42: a disk filled by other files (to the last byte) under G3's
/// index. Offloads are stored (G3 evicts its own blocks) or answered
/// `NoSpace`, never an index error; health says the disk is full; once
/// the operator frees space the node serves again with no restart; a
/// restart finds every block stored; the node starts on a full disk.
#[test]
fn a_full_disk_under_the_index_is_a_state_the_node_recovers_from() {
    let Some(dir) = common::SmallTmpfs::mount("8m", "full_disk_index") else {
        return;
    };
    full_disk_recovers(dir.path());
}

/// The same on a 16 MiB ext4 on a loop device (as found: 4/4 on ext4),
/// where blocks are written with O_DIRECT into slab slots and the index
/// file sits beside them.
#[test]
fn a_full_loop_mounted_ext4_under_the_index_is_a_state_the_node_recovers_from() {
    let Some(dir) = common::SmallExt4::mount(16, "full_ext4_index") else {
        return;
    };
    full_disk_recovers(dir.path());
}

fn full_disk_recovers(dir: &std::path::Path) {
    let cfg = || {
        let mut g3 = G3Config::new(dir.join("g3"), 256 << 20);
        g3.high_watermark = 0.99;
        NodeConfig::new(g3)
    };
    let id = ns_small().id();
    let node = Node::open(cfg()).unwrap();
    for i in 0..16 {
        let (h, p) = small(i);
        assert!(matches!(
            node.offload(&id, &h, &p, None, Hints::default()),
            Ok(PutOutcome::Stored)
        ));
    }
    let filler = fill(&dir.join("filler"));
    assert!(full_said(&node), "{:?}", node.health());
    // Writes of the index alone (pins) meet the full disk: redb failed
    // every later operation ("Previous I/O error occurred").
    for round in 0..50 {
        for i in 0..16 {
            let key = small(i).0.key;
            node.g3().pin(&id, &key, Some(60_000 + round));
            node.g3().unpin(&id, &key);
        }
    }
    // redb writes them at the next durable commit (the reclaimer's, every
    // second).
    let reopens = || -> u64 {
        let f: std::collections::HashMap<_, _> = node.g3().recovery_figures().into_iter().collect();
        f["index_reopens"]
    };
    let t = std::time::Instant::now();
    while reopens() == 0 && t.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(reopens() >= 1, "the index never met the full disk");
    let mut stored = 0;
    for i in 100..300 {
        let (h, p) = small(i);
        match node.offload(&id, &h, &p, None, Hints::default()) {
            Ok(PutOutcome::Stored) => stored += 1,
            Err(kvtier_daemon::Error::NoSpace { .. }) => {}
            r => panic!("offload {i}: {r:?}"),
        }
    }
    assert!(stored > 0);

    // The operator frees space: offloads are stored again, no restart.
    std::fs::remove_file(&filler).unwrap();
    for i in 1000..1016 {
        let (h, p) = small(i);
        let r = node.offload(&id, &h, &p, None, Hints::default());
        assert!(matches!(r, Ok(PutOutcome::Stored)), "offload {i}: {r:?}");
    }
    let t = std::time::Instant::now();
    while full_said(&node) && t.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(!full_said(&node), "{:?}", node.health());
    drop(node);

    // A restart finds them all.
    let node = reopen(cfg);
    let keys: Vec<BlockKey> = (1000..1016).map(|i| small(i).0.key).collect();
    assert_eq!(node.lookup(&id, &keys).unwrap().len(), 16);

    // It starts on a full disk and makes room for an offload.
    let filler = fill(&dir.join("filler"));
    drop(node);
    let node = reopen(cfg);
    let (h, p) = small(5000);
    let r = node.offload(&id, &h, &p, None, Hints::default());
    assert!(matches!(r, Ok(PutOutcome::Stored)), "{r:?}");
    drop(filler);
}

/// Opens the node again once the dropped one's background threads have
/// let go of the data directory (its owner lock): a restart in one
/// process, where the old node's last reference may outlive `drop` by a
/// moment. Any other error fails.
fn reopen(cfg: impl Fn() -> NodeConfig) -> std::sync::Arc<Node> {
    let t = std::time::Instant::now();
    loop {
        match Node::open(cfg()) {
            Err(kvtier_daemon::Error::InUse { .. })
                if t.elapsed() < std::time::Duration::from_secs(10) =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            r => return r.unwrap(),
        }
    }
}
