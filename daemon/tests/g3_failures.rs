#![allow(clippy::unwrap_used, clippy::expect_used)]
//! G3: the index and the files agree after any failure. A failed index
//! commit undoes its renames, an orphan file never turns an offload into
//! an AlreadyPresent that lookups contradict, a damaged `index.redb` is
//! rebuilt from the files, and stray files under `blocks/` are set aside,
//! never a refusal to start.

#[path = "g3_support/mod.rs"]
mod common;

use kvtier_daemon::conformance::{block, namespace};
use kvtier_daemon::g3::engine::EngineKind;
use kvtier_daemon::g3::{PutItem, PutMeta};
use kvtier_daemon::tier::{Lookup, PutOutcome};

fn read_hits(
    s: &kvtier_daemon::g3::G3Store,
    ns: &kvtier_client::NamespaceId,
    key: &kvtier_client::BlockKey,
    len: u64,
) -> bool {
    let mut dst = vec![0u8; len as usize];
    matches!(s.read_into(ns, key, &mut dst).unwrap(), Lookup::Hit(_))
}

#[test]
fn failed_index_commit_undoes_its_renames() {
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace(65536, "undo").unwrap();
    let id = ns.id();
    let blocks: Vec<_> = (1..=3).map(|i| block(&ns, i)).collect();
    {
        let s = common::open(dir.path(), EngineKind::Auto);
        // Single put.
        s.fault_fail_index_commits(1);
        let (k0, h0, p0) = &blocks[0];
        assert!(s.put_block(&id, h0, p0, PutMeta::default()).is_err());
        assert!(
            !s.block_file_path(&id, k0).exists(),
            "the rename was not undone"
        );
        assert!(s.stat(&id, k0).is_none());
        // The retry stores it (not AlreadyPresent off an orphan file).
        assert_eq!(
            s.put_block(&id, h0, p0, PutMeta::default()).unwrap(),
            PutOutcome::Stored
        );
        // A batch.
        s.fault_fail_index_commits(1);
        let items: Vec<PutItem<'_>> = blocks[1..]
            .iter()
            .map(|(_, h, p)| PutItem {
                header: h,
                payload: p,
                meta: PutMeta::default(),
            })
            .collect();
        assert!(s.put_blocks(&id, &items).iter().all(|r| r.is_err()));
        for (k, _, _) in &blocks[1..] {
            assert!(!s.block_file_path(&id, k).exists());
        }
        let again = s.put_blocks(&id, &items);
        assert!(
            again.iter().all(|r| matches!(r, Ok(PutOutcome::Stored))),
            "{again:?}"
        );
        assert_eq!(s.stats().renames_undone, 3);
        s.close().unwrap();
    }
    // After a clean restart every acked block is there, and nothing else.
    let s = common::open(dir.path(), EngineKind::Auto);
    for (k, h, _) in &blocks {
        assert!(s.stat(&id, k).is_some());
        assert!(read_hits(&s, &id, k, h.file_len()));
    }
    assert_eq!(s.stats().blocks, 3);
}

#[test]
fn an_orphan_block_file_is_replaced_and_indexed_not_answered_present() {
    let dir = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    let ns = namespace(65536, "orphan").unwrap();
    let id = ns.id();
    let (k, h, p) = block(&ns, 7);
    // A verified file for the key, but no index entry: what a crash
    // between rename and commit (before this fix: a failed commit) leaves.
    let donor = common::open(other.path(), EngineKind::Auto);
    donor.put_block(&id, &h, &p, PutMeta::default()).unwrap();
    let s = common::open(dir.path(), EngineKind::Auto);
    // A first put creates the shard directories; then plant the orphan of
    // another key in them.
    let (k2, h2, p2) = block(&ns, 8);
    donor.put_block(&id, &h2, &p2, PutMeta::default()).unwrap();
    s.put_block(&id, &h, &p, PutMeta::default()).unwrap();
    let to = s.block_file_path(&id, &k2);
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    std::fs::copy(donor.block_file_path(&id, &k2), &to).unwrap();
    assert!(s.stat(&id, &k2).is_none());
    assert_eq!(
        s.put_block(&id, &h2, &p2, PutMeta::default()).unwrap(),
        PutOutcome::Stored,
        "an offload acked off a file that lookups cannot see"
    );
    assert!(s.stat(&id, &k2).is_some());
    assert!(read_hits(&s, &id, &k2, h2.file_len()));
    assert_eq!(s.stats().orphans_replaced, 1);
    assert!(s.stat(&id, &k).is_some());
}
