//! Unit tests that need the crate's test hooks (a forced digest collision,
//! an index written in the old format).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::engine::EngineKind;
use super::index::{test_alias, INDEX_FORMAT};
use super::{G3Config, G3Store};
use crate::base::error::Error;
use crate::base::tier::{BlockTier, Lookup, PutOutcome};
use crate::testkit::conformance::{block, namespace};
use crate::tiers::policy::Lru;
use std::path::Path;
use std::sync::Arc;

fn open(root: &Path) -> crate::base::error::Result<Arc<G3Store>> {
    open_slots(root, super::config::SLOT_FILE_BYTES_DEFAULT)
}

/// With blocks of up to `slot_max` bytes in slots (0: a file per block).
fn open_slots(root: &Path, slot_max: u64) -> crate::base::error::Result<Arc<G3Store>> {
    let mut c = G3Config::new(root, 1 << 30);
    c.engine = EngineKind::Pread;
    c.io_depth = 4;
    c.buffer_pool_bytes = 8 << 20;
    c.slot_file_bytes_max = slot_max;
    G3Store::open(c, Box::new(Lru::new()))
}

#[test]
fn digest_collision_is_a_typed_error_and_never_touches_the_other_block() {
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace(8192, "collide").unwrap();
    let (k0, h0, p0) = block(&ns, 0);
    let (k1, h1, p1) = block(&ns, 1);
    let s = open(dir.path()).unwrap();
    assert_eq!(s.put(&ns.id(), &h0, &p0).unwrap(), PutOutcome::Stored);

    // k1 now digests exactly as k0 (id and check): a full collision.
    test_alias::set(Some((k1, k0)));
    let err = s.put(&ns.id(), &h1, &p1).unwrap_err();
    assert!(
        matches!(err, Error::InvalidInput { .. }) && err.to_string().contains("collides"),
        "{err}"
    );
    assert!(s.stat(&ns.id(), &k1).is_none());
    assert!(matches!(s.get(&ns.id(), &k1).unwrap(), Lookup::Miss(_)));
    assert!(!s.delete_block(&ns.id(), &k1).unwrap());
    let file1 = dir
        .path()
        .join("blocks")
        .join(kvtier_client::block_path(&ns.id(), &k1));
    assert!(!file1.exists(), "a refused write left a file");

    // k0 survived k1's refused put, miss and delete.
    test_alias::set(None);
    assert_eq!(s.get(&ns.id(), &k0).unwrap().hit().unwrap().payload, p0);
    assert_eq!(s.stat(&ns.id(), &k0).unwrap().payload_len, p0.len() as u64);
    assert_eq!(s.lookup_prefix(&ns.id(), &[k0]), 1);
    // Without the collision k1 stores normally.
    assert_eq!(s.put(&ns.id(), &h1, &p1).unwrap(), PutOutcome::Stored);
    assert_eq!(s.lookup_prefix(&ns.id(), &[k0, k1]), 2);
}

#[test]
fn format_1_index_is_rekeyed_and_a_newer_format_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace(8192, "format").unwrap();
    let blocks: Vec<_> = (0..5).map(|i| block(&ns, i)).collect();
    let s = open(dir.path()).unwrap();
    for (_, h, p) in &blocks {
        s.put(&ns.id(), h, p).unwrap();
    }
    s.close().unwrap();
    drop(s);
    let index = dir.path().join("index.redb");
    super::index::write_format_1(&index).unwrap();
    // The image a format-1 build wrote would carry old ids (and the old
    // magic, so it is ignored): without it the clean start reads redb.
    std::fs::remove_file(dir.path().join(super::snapshot::SNAPSHOT_FILE)).unwrap();

    let s = open(dir.path()).unwrap();
    let rep = s.recovery.lock().unwrap().clone();
    assert!(rep.clean_start && !rep.from_snapshot, "{rep:?}");
    assert_eq!(rep.indexed, 5, "{rep:?}");
    let keys: Vec<_> = blocks.iter().map(|(k, _, _)| *k).collect();
    assert_eq!(s.lookup_prefix(&ns.id(), &keys), 5);
    for (k, _, p) in &blocks {
        assert_eq!(&s.get(&ns.id(), k).unwrap().hit().unwrap().payload, p);
        assert!(s.stat(&ns.id(), k).is_some());
    }
    assert_eq!(s.list(&ns.id(), None, 10).len(), 5);
    s.close().unwrap();
    drop(s);
    assert_eq!(super::index::format_of(&index).unwrap(), Some(INDEX_FORMAT));

    // A crash restart after the re-keying walks and keeps everything.
    std::fs::remove_file(dir.path().join(super::recover::CLEAN_MARKER)).unwrap();
    let s = open(dir.path()).unwrap();
    let rep = s.recovery.lock().unwrap().clone();
    assert_eq!(
        (rep.indexed, rep.adopted, rep.dropped),
        (5, 0, 0),
        "{rep:?}"
    );
    s.close().unwrap();
    drop(s);

    super::index::set_format(&index, INDEX_FORMAT + 1).unwrap();
    let err = open(dir.path()).err().unwrap();
    assert!(
        matches!(err, Error::Index { .. }) && err.to_string().contains("newer"),
        "{err}"
    );
}

/// Issue 28: a second open of a directory in use is refused before it
/// touches anything, and redb's own "already open" is never read as a
/// damaged index (it used to move `index.redb` aside and rebuild).
#[test]
fn a_directory_in_use_is_refused_and_its_index_is_never_set_aside() {
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace(8192, "owner").unwrap();
    let (k0, h0, p0) = block(&ns, 0);
    let s = open(dir.path()).unwrap();
    assert_eq!(s.put(&ns.id(), &h0, &p0).unwrap(), PutOutcome::Stored);
    let err = open(dir.path()).unwrap_err();
    assert!(matches!(err, Error::InUse { .. }), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("pid {}", std::process::id())),
        "{err}"
    );
    // Below the lock: redb's own lock error is an index in use, not damage.
    let Err(e) = super::recover::open_index(&super::seam::RealFs, dir.path()) else {
        panic!("a second redb handle opened the index");
    };
    assert!(e.to_string().contains("already open"), "{e}");
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names.iter().any(|n| n.contains("damaged")),
        "index set aside: {names:?}"
    );
    assert!(s.stat(&ns.id(), &k0).is_some());
    s.close().unwrap();
    drop(s);
    let s = open(dir.path()).unwrap();
    assert!(
        s.stat(&ns.id(), &k0).is_some(),
        "reopened after the holder left"
    );
}

/// Issue 28: a start-up walk follows no symlink. Links under `blocks/`
/// (a namespace, a shard and a block name pointing outside the data
/// directory) are set aside inside it as links; what they point at is
/// never read, moved or deleted (the old walk moved the outside file into
/// quarantine, where trimming deletes it).
#[test]
fn recovery_follows_no_symlink_out_of_the_data_directory() {
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let ns = namespace(8192, "links").unwrap();
    let (k0, h0, p0) = block(&ns, 0);
    let (k1, _, _) = block(&ns, 1);
    let s = open_slots(dir.path(), 0).unwrap();
    assert_eq!(s.put(&ns.id(), &h0, &p0).unwrap(), PutOutcome::Stored);
    s.close().unwrap();
    drop(s);
    // Outside: trees a followed link would walk into.
    let o = outside.path();
    for sub in ["ns/ab", "shard"] {
        std::fs::create_dir_all(o.join(sub)).unwrap();
    }
    let victims = [
        o.join("ns/ab").join(k1.to_hex()),
        o.join("shard").join(k1.to_hex()),
        o.join("file"),
    ];
    for v in &victims {
        std::fs::write(v, b"not yours").unwrap();
    }
    let blocks = dir.path().join("blocks");
    let other_ns = namespace(8192, "other").unwrap().id().to_hex();
    let own_ns = blocks.join(ns.id().to_hex());
    std::os::unix::fs::symlink(o.join("ns"), blocks.join(&other_ns)).unwrap();
    std::os::unix::fs::symlink(o.join("shard"), own_ns.join("zz")).unwrap();
    let f0 = s_path(dir.path(), &ns, &k0);
    std::os::unix::fs::symlink(o.join("file"), f0.with_file_name(k1.to_hex())).unwrap();
    // Force the walk (no clean-start trust).
    std::fs::remove_file(dir.path().join(super::CLEAN_MARKER)).unwrap();

    let s = open(dir.path()).unwrap();
    for v in &victims {
        assert_eq!(
            std::fs::read(v).unwrap(),
            b"not yours",
            "{} touched",
            v.display()
        );
    }
    assert_eq!(s.recovery.lock().unwrap().set_aside, 3);
    let links = std::fs::read_dir(dir.path().join("quarantine"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_type().unwrap().is_symlink())
        .count();
    assert_eq!(
        links, 3,
        "the links are set aside as links, inside the data dir"
    );
    assert!(s.stat(&ns.id(), &k0).is_some(), "the real block stays");
    assert!(s.stat(&ns.id(), &k1).is_none());
    s.close().unwrap();
    drop(s);
    // Trimming the quarantine to nothing deletes the links, not targets.
    let mut c = G3Config::new(dir.path(), 1 << 30);
    c.engine = EngineKind::Pread;
    c.buffer_pool_bytes = 8 << 20;
    c.quarantine_max_files = 1;
    drop(G3Store::open(c, Box::new(Lru::new())).unwrap());
    for v in &victims {
        assert_eq!(
            std::fs::read(v).unwrap(),
            b"not yours",
            "{} touched",
            v.display()
        );
    }
}

/// A fixed directory (`blocks/`, `tmp/`, `quarantine/`, `recycle/`) that
/// is a link out of the data directory is refused at open, before
/// anything behind it is touched.
#[test]
fn a_fixed_directory_that_is_a_link_is_refused() {
    for fixed in ["blocks", "tmp", "quarantine", "recycle", "slots"] {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("x"), b"keep").unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join(fixed)).unwrap();
        let e = open(dir.path()).unwrap_err();
        assert!(e.to_string().contains("symlink"), "{fixed}: {e}");
        assert_eq!(std::fs::read(outside.path().join("x")).unwrap(), b"keep");
    }
}

fn s_path(
    root: &Path,
    ns: &kvtier_client::Namespace,
    key: &kvtier_client::BlockKey,
) -> std::path::PathBuf {
    root.join("blocks")
        .join(kvtier_client::block_path(&ns.id(), key))
}

/// Reads a block through `read_into`: its payload on a hit.
fn read_payload(
    s: &G3Store,
    ns: &kvtier_client::Namespace,
    k: &kvtier_client::BlockKey,
) -> Option<Vec<u8>> {
    let info = s.stat(&ns.id(), k)?;
    let mut buf = kvtier_client::AlignedBuf::rounded(info.file_len as usize).unwrap();
    match s.read_into(&ns.id(), k, buf.as_mut_slice()).unwrap() {
        Lookup::Hit(h) => Some(buf.as_slice()[4096..4096 + h.payload_len as usize].to_vec()),
        Lookup::Miss(_) => None,
    }
}

/// Issue 41: small blocks live in one slab per file length, no file of
/// their own; they read back exactly, across a clean restart (the index
/// trusted) and a crash start (every slot's header read, the blocks
/// adopted again); an evicted block's slot is reused in place and a
/// deleted block's slot is punched (it never comes back).
#[test]
fn slotted_blocks_survive_restarts_and_slots_are_reused() {
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace(8192, "slots").unwrap();
    let blocks: Vec<_> = (0..6).map(|i| block(&ns, i)).collect();
    let s = open(dir.path()).unwrap();
    for (_, h, p) in &blocks {
        assert_eq!(s.put(&ns.id(), h, p).unwrap(), PutOutcome::Stored);
    }
    let pages = (blocks[0].1.file_len() / 4096) as u32;
    let slab = dir.path().join("slots").join(format!("{pages}.slab"));
    assert_eq!(
        std::fs::metadata(&slab).unwrap().len(),
        6 * blocks[0].1.file_len()
    );
    assert!(
        !s_path(dir.path(), &ns, &blocks[0].0).exists(),
        "no block file"
    );
    for (k, _, p) in &blocks {
        assert!(s.stat(&ns.id(), k).unwrap().slotted);
        assert_eq!(read_payload(&s, &ns, k).as_ref(), Some(p));
    }
    // An eviction keeps the slot's bytes for the next write of that size.
    assert!(s.evict_block(&ns.id(), &blocks[0].0).unwrap());
    assert_eq!(s.slot_pooled_bytes(), blocks[0].1.file_len());
    let (k6, h6, p6) = block(&ns, 6);
    assert_eq!(s.put(&ns.id(), &h6, &p6).unwrap(), PutOutcome::Stored);
    assert_eq!(s.slot_pooled_bytes(), 0, "the free slot was reused");
    assert_eq!(
        std::fs::metadata(&slab).unwrap().len(),
        6 * blocks[0].1.file_len(),
        "the slab did not grow"
    );
    // A deletion punches the slot: the block is gone after a crash start.
    assert!(s.delete_block(&ns.id(), &blocks[1].0).unwrap());
    s.close().unwrap();
    drop(s);
    let s = open(dir.path()).unwrap();
    assert!(s.recovery.lock().unwrap().clean_start);
    assert_eq!(read_payload(&s, &ns, &k6), Some(p6.clone()));
    for (k, _, p) in &blocks[2..] {
        assert_eq!(read_payload(&s, &ns, k).as_ref(), Some(p));
    }
    drop(s);
    // A crash start: the index is not trusted; the slots are read.
    let _ = std::fs::remove_file(dir.path().join(super::CLEAN_MARKER));
    std::fs::remove_file(dir.path().join("index.redb")).unwrap();
    let s = open(dir.path()).unwrap();
    assert!(!s.recovery.lock().unwrap().clean_start);
    assert_eq!(read_payload(&s, &ns, &k6), Some(p6));
    for (k, _, p) in &blocks[2..] {
        assert_eq!(read_payload(&s, &ns, k).as_ref(), Some(p));
    }
    assert!(
        s.stat(&ns.id(), &blocks[1].0).is_none(),
        "a deleted block came back"
    );
    assert!(
        s.stat(&ns.id(), &blocks[0].0).is_none(),
        "its slot holds block 6"
    );
    assert_eq!(s.stats().blocks, 5);
}

/// A slot whose bytes rot reads as a miss (never wrong bytes), its bytes
/// go to quarantine/ and the slot is punched; the other blocks of the
/// slab are untouched. A block larger than `slot_file_bytes_max` keeps
/// its own file; a passed fd of a slotted block is a private copy.
#[test]
fn a_corrupt_slot_is_a_miss_and_large_blocks_keep_their_files() {
    use std::io::Read;
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace(8192, "rot").unwrap();
    let s = open_slots(dir.path(), 16384).unwrap();
    let (k0, h0, p0) = block(&ns, 0);
    let (k1, h1, p1) = block(&ns, 1);
    s.put(&ns.id(), &h0, &p0).unwrap();
    s.put(&ns.id(), &h1, &p1).unwrap();
    let big_ns = namespace(65536, "big").unwrap();
    let (kb, hb, pb) = block(&big_ns, 0);
    s.put(&big_ns.id(), &hb, &pb).unwrap();
    assert!(!s.stat(&big_ns.id(), &kb).unwrap().slotted);
    assert!(s_path(dir.path(), &big_ns, &kb).exists());
    let (mut f, _) = match s.open_for_read(&ns.id(), &k1).unwrap() {
        Lookup::Hit(x) => x,
        Lookup::Miss(r) => panic!("{r:?}"),
    };
    let mut copy = Vec::new();
    f.read_to_end(&mut copy).unwrap();
    assert_eq!(copy.len() as u64, h1.file_len(), "only this block");
    assert_eq!(&copy[4096..4096 + p1.len()], &p1[..]);
    let slab = std::fs::OpenOptions::new()
        .write(true)
        .open(
            dir.path()
                .join("slots")
                .join(format!("{}.slab", h0.file_len() / 4096)),
        )
        .unwrap();
    slab.write_all_at(b"rot", 5000).unwrap();
    assert_eq!(read_payload(&s, &ns, &k0), None);
    assert!(s.stat(&ns.id(), &k0).is_none());
    assert_eq!(s.stats().quarantined, 1);
    assert_eq!(read_payload(&s, &ns, &k1), Some(p1));
    assert_eq!(read_payload(&s, &big_ns, &kb), Some(pb));
}
