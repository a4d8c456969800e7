//! Unit tests that need the crate's test hooks (a forced digest collision,
//! an index written in the old format).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::engine::EngineKind;
use super::index::{test_alias, INDEX_FORMAT};
use super::{G3Config, G3Store};
use crate::conformance::{block, namespace};
use crate::error::Error;
use crate::policy::Lru;
use crate::tier::{BlockTier, Lookup, PutOutcome};
use std::path::Path;
use std::sync::Arc;

fn open(root: &Path) -> crate::error::Result<Arc<G3Store>> {
    let mut c = G3Config::new(root, 1 << 30);
    c.engine = EngineKind::Pread;
    c.io_depth = 4;
    c.buffer_pool_bytes = 8 << 20;
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
