#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `Backend::offload_batch` on the real node (G3 in a temp dir, no G4):
//! per-item outcomes of one request, `Stored` events in input order with
//! their parents, the chain found by lookup, and the same outcomes as the
//! one-at-a-time default on `MemBackend` (which reports a bad checksum as
//! a format error where G3 says invalid input: both answer `Invalid`).

use kvtier_client::events::{KvEventData, StorageTier};
use kvtier_client::{BlockHeader, BlockKey, Hints, KvLayout, Namespace, Tier};
use kvtier_daemon::events::EventBus;
use kvtier_daemon::g3::G3Config;
use kvtier_daemon::node::{Node, NodeConfig};
use kvtier_daemon::server::{Backend, MemBackend, MemLimits, OffloadBlock};
use kvtier_daemon::tier::PutOutcome;
use kvtier_daemon::Error;

const BLOCK: u64 = 16 << 10;

fn ns() -> Namespace {
    Namespace::new(
        "node-batch",
        KvLayout::with_block_bytes(BLOCK).unwrap(),
        "",
        "t",
    )
    .unwrap()
}

fn block(i: u64) -> (BlockHeader, Vec<u8>) {
    let payload: Vec<u8> = (0..BLOCK).map(|j| (j * 5 + i * 11) as u8).collect();
    let h = BlockHeader::for_payload(&ns(), BlockKey::from_u64(500 + i), &payload, 1);
    (h, payload)
}

/// A chain of `n` blocks as one request; item 3's payload is damaged (its
/// checksum no longer matches its header).
fn request(blocks: &[(BlockHeader, Vec<u8>)], bad: &[u8]) -> Vec<OffloadBlock<'static>> {
    let leak = |v: &[u8]| -> &'static [u8] { Box::leak(v.to_vec().into_boxed_slice()) };
    blocks
        .iter()
        .enumerate()
        .map(|(i, (h, p))| OffloadBlock {
            header: h.clone(),
            payload: if i == 3 { leak(bad) } else { leak(p) },
            parent: i.checked_sub(1).map(|j| blocks[j].0.key),
            hints: Hints::default(),
        })
        .collect()
}

fn outcomes(r: &[kvtier_daemon::Result<PutOutcome>]) -> Vec<String> {
    r.iter()
        .map(|o| match o {
            Ok(o) => format!("{o:?}"),
            Err(Error::InvalidInput { .. } | Error::Client(_)) => "invalid".into(),
            Err(e) => panic!("{e:?}"),
        })
        .collect()
}

#[test]
fn node_batch_is_ordered_and_fails_per_item_like_the_default() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::open(NodeConfig::new(G3Config::new(
        dir.path().join("g3"),
        64 << 20,
    )))
    .unwrap();
    let bus = EventBus::new();
    let sub = bus.subscribe().unwrap();
    node.attach_events(bus);
    let id = ns().id();
    let blocks: Vec<_> = (0..10).map(block).collect();
    let mut bad = blocks[3].1.clone();
    bad[9] ^= 0x10;
    // Block 5 is stored beforehand: present in the batch.
    let (h5, p5) = &blocks[5];
    assert_eq!(
        node.offload(&id, h5, p5, Some(blocks[4].0.key), Hints::default())
            .unwrap(),
        PutOutcome::Stored
    );
    let first = sub.rx.recv().unwrap();
    assert!(matches!(first.data, KvEventData::Stored { .. }));

    let req = request(&blocks, &bad);
    let got = outcomes(&node.offload_batch(&id, &req));
    let mut want: Vec<String> = (0..10).map(|_| "Stored".to_string()).collect();
    want[3] = "invalid".into();
    want[5] = "AlreadyPresent".into();
    assert_eq!(got, want);

    // Events: one Stored per stored block, in input order, with parents.
    let mut seen = Vec::new();
    while let Ok(ev) = sub.rx.try_recv() {
        assert_eq!(ev.storage_tier, StorageTier::Disk);
        match &ev.data {
            KvEventData::Stored {
                parent_hash,
                blocks,
            } => {
                for b in blocks {
                    seen.push((*parent_hash, b.block_hash));
                }
            }
            other => panic!("{other:?}"),
        }
    }
    let expect: Vec<(Option<BlockKey>, BlockKey)> = (0..10usize)
        .filter(|&i| i != 3 && i != 5)
        .map(|i| (i.checked_sub(1).map(|j| blocks[j].0.key), blocks[i].0.key))
        .collect();
    assert_eq!(seen, expect);
    // The chain breaks at the damaged block 3.
    let chain: Vec<BlockKey> = blocks.iter().map(|b| b.0.key).collect();
    assert_eq!(node.lookup(&id, &chain).unwrap(), vec![Tier::G3; 3]);

    // The default (one at a time) on MemBackend answers the same.
    let mem = MemBackend::new(MemLimits::default(), dir.path().join("spill"));
    mem.offload(&id, h5, p5, None, Hints::default()).unwrap();
    assert_eq!(outcomes(&mem.offload_batch(&id, &req)), want);
}
