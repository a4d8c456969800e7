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
