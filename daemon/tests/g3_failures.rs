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

fn store_some(root: &std::path::Path, tag: &str) -> Vec<(kvtier_client::BlockKey, u64)> {
    let s = common::open(root, EngineKind::Auto);
    let ns = namespace(65536, tag).unwrap();
    let mut out = Vec::new();
    for i in 1..=4 {
        let (k, h, p) = block(&ns, i);
        s.put_block(&ns.id(), &h, &p, PutMeta::default()).unwrap();
        out.push((k, h.file_len()));
    }
    s.close().unwrap();
    out
}

#[test]
fn a_damaged_index_header_is_rebuilt_from_the_files() {
    use std::io::{Seek, Write};
    for clean in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let ns = namespace(65536, "damaged-index").unwrap();
        let stored = store_some(dir.path(), "damaged-index");
        if !clean {
            std::fs::remove_file(dir.path().join(kvtier_daemon::g3::CLEAN_MARKER)).unwrap();
        }
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join("index.redb"))
            .unwrap();
        f.seek(std::io::SeekFrom::Start(0)).unwrap();
        f.write_all(&[0xa5; 4096]).unwrap();
        f.sync_all().unwrap();
        drop(f);
        let s = common::open(dir.path(), EngineKind::Auto);
        let rep = s.recovery.lock().unwrap().clone();
        assert!(rep.index_rebuilt, "clean={clean} {rep:?}");
        assert_eq!(rep.adopted, 4, "clean={clean} {rep:?}");
        for (k, len) in &stored {
            assert!(read_hits(&s, &ns.id(), k, *len), "clean={clean}");
        }
        let aside = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with("index.redb.damaged.")
            })
            .count();
        assert_eq!(aside, 1, "the damaged index is kept for inspection");
    }
}

#[test]
fn stray_and_unreadable_entries_under_blocks_are_set_aside_not_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace(65536, "stray").unwrap();
    let stored = store_some(dir.path(), "stray");
    std::fs::remove_file(dir.path().join(kvtier_daemon::g3::CLEAN_MARKER)).unwrap();
    let blocks = dir.path().join("blocks");
    let nsd = blocks.join(ns.id().to_hex());
    let shard = std::fs::read_dir(&nsd)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    // A regular file where a shard directory belongs, a junk file and a
    // directory where block files belong, and junk at the top.
    std::fs::write(nsd.join("not-a-shard"), b"junk").unwrap();
    std::fs::write(shard.join("junk.txt"), b"junk").unwrap();
    std::fs::create_dir(shard.join("0".repeat(64))).unwrap();
    std::fs::write(blocks.join("README"), b"junk").unwrap();
    let s = common::open(dir.path(), EngineKind::Auto);
    let rep = s.recovery.lock().unwrap().clone();
    assert_eq!(rep.set_aside, 4, "{rep:?}");
    assert!(!nsd.join("not-a-shard").exists());
    assert!(!shard.join("junk.txt").exists());
    for (k, len) in &stored {
        assert!(read_hits(&s, &ns.id(), k, *len));
    }
    let strays = std::fs::read_dir(dir.path().join("quarantine"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("stray.")
        })
        .count();
    assert_eq!(strays, 4);
}

#[test]
fn quarantine_is_bounded_and_counts_against_capacity() {
    use kvtier_daemon::conformance::Damage;
    let dir = tempfile::tempdir().unwrap();
    let mut c = common::cfg(dir.path(), EngineKind::Auto);
    c.capacity_bytes = 1 << 20;
    c.pinned_budget_bytes = 0;
    c.quarantine_max_bytes = 256 << 10;
    c.quarantine_max_files = 3;
    let s =
        kvtier_daemon::g3::G3Store::open(c, Box::new(kvtier_daemon::policy::Lru::new())).unwrap();
    let ns = namespace(65536, "qbound").unwrap();
    let id = ns.id();
    // Six corrupt blocks read: at most 3 files (and 256 KiB) stay.
    for i in 1..=6 {
        let (k, h, p) = block(&ns, i);
        s.put_block(&id, &h, &p, PutMeta::default()).unwrap();
        common::damage(&s, &id, &k, Damage::Payload);
        assert!(!read_hits(&s, &id, &k, h.file_len()));
    }
    let st = s.stats();
    assert_eq!(st.quarantined, 6);
    let files = std::fs::read_dir(dir.path().join("quarantine"))
        .unwrap()
        .count();
    assert!(files <= 3, "{files} files in quarantine/");
    assert!(
        st.quarantine_bytes <= 256 << 10 && st.quarantine_bytes > 0,
        "{st:?}"
    );
    assert_eq!(st.quarantine_trimmed, 3);
    // Fill the tier: blocks and quarantine together stay within capacity.
    for i in 100..130 {
        let (_, h, p) = block(&ns, i);
        s.put_block(&id, &h, &p, PutMeta::default()).unwrap();
        let st = s.stats();
        assert!(
            st.used_bytes + st.quarantine_bytes <= st.capacity_bytes,
            "{st:?}"
        );
    }
    // The bound and the bytes survive a restart.
    s.close().unwrap();
    drop(s);
    let mut c = common::cfg(dir.path(), EngineKind::Auto);
    c.capacity_bytes = 1 << 20;
    c.quarantine_max_bytes = 128 << 10;
    c.quarantine_max_files = 3;
    let s =
        kvtier_daemon::g3::G3Store::open(c, Box::new(kvtier_daemon::policy::Lru::new())).unwrap();
    assert!(s.stats().quarantine_bytes <= 128 << 10);
    assert!(s.stats().quarantine_bytes > 0);
}
