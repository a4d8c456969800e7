#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The tier conformance suite against G3 with each engine, and through the
//! fault wrapper with faults armed but not striking.

#[path = "g3_support/mod.rs"]
mod common;

use kvtier_client::{BlockKey, NamespaceId};
use kvtier_daemon::testkit::conformance::{run_all, Caps, Damage};
use kvtier_daemon::tiers::g3::engine::{EngineKind, IoEngine, PreadEngine, UringEngine};
use kvtier_daemon::tiers::g3::fault::{FaultEngine, FaultPlan};
use kvtier_daemon::tiers::g3::G3Store;
use kvtier_daemon::tiers::policy::Lru;
use std::sync::Arc;

fn suite(store: &G3Store, block_bytes: u64) {
    let hook = |ns: &NamespaceId, key: &BlockKey, d: Damage| common::damage(store, ns, key, d);
    let caps = Caps {
        corrupt: Some(&hook),
        block_bytes,
    };
    run_all(store, &caps).unwrap();
    // Every damaged block went to quarantine.
    assert_eq!(store.stats().quarantined, 3);
}

#[test]
fn conformance_uring() {
    let dir = tempfile::tempdir().unwrap();
    let s = common::open(dir.path(), EngineKind::Uring);
    assert_eq!(s.engine_name(), "io_uring");
    // Odd size: partial last page, several chunks.
    suite(&s, (1 << 20) * 2 + 96);
}

#[test]
fn conformance_pread() {
    let dir = tempfile::tempdir().unwrap();
    let s = common::open(dir.path(), EngineKind::Pread);
    assert_eq!(s.engine_name(), "pread");
    suite(&s, 65536);
}

#[test]
fn conformance_through_fault_wrapper() {
    for inner in [
        Arc::new(PreadEngine) as Arc<dyn IoEngine>,
        Arc::new(UringEngine::new(2).unwrap()) as Arc<dyn IoEngine>,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let plan = FaultPlan {
            fail_after_ops: Some(1_000_000),
            writes: true,
            reads: true,
            syncs: true,
            ..FaultPlan::default()
        };
        let fe = Arc::new(FaultEngine::new(inner, plan));
        let s = G3Store::open_with_engine(
            common::cfg(dir.path(), EngineKind::Auto),
            Box::new(Lru::new()),
            fe.clone(),
        )
        .unwrap();
        suite(&s, 8192);
        assert_eq!(fe.injected(), 0);
    }
}

/// The conformance suite on slotted blocks (g3/slots.rs): every size it
/// writes fits a slot.
#[test]
fn conformance_slots() {
    for engine in [EngineKind::Uring, EngineKind::Pread] {
        let dir = tempfile::tempdir().unwrap();
        let c = common::cfg_slots(dir.path(), engine);
        let s = G3Store::open(c, Box::new(Lru::new())).unwrap();
        suite(&s, 65536 + 32);
        let slotted = s
            .recovery_figures()
            .iter()
            .find(|(k, _)| *k == "slot_writes")
            .map(|(_, v)| *v);
        assert!(slotted > Some(0), "the suite's blocks went to slots");
        assert_eq!(common::block_files(&dir.path().join("blocks")).len(), 0);
    }
}

#[test]
fn conformance_odsync() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = common::cfg(dir.path(), EngineKind::Auto);
    c.sync_mode = kvtier_daemon::tiers::g3::SyncMode::ODsync;
    let s = G3Store::open(c, Box::new(Lru::new())).unwrap();
    suite(&s, 65536 + 32);
}

/// The batch read (`IoEngine::read_many`, the onboard's one-ring path)
/// gives every request exactly what `read_file` gives it, with each
/// engine: many small requests (more than a ring holds at once), one
/// spanning several chunks, one that runs past the end of the file
/// (short), an empty one and one on an invalid fd (its error alone).
#[test]
fn read_many_matches_read_file_with_each_engine() {
    use kvtier_daemon::tiers::g3::engine::ReadReq;
    use std::os::fd::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data");
    let len = (5 << 20) + 123;
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
    std::fs::write(&path, &data).unwrap();
    let f = std::fs::File::open(&path).unwrap();
    let fd = f.as_raw_fd();
    let closed = -1;
    // (fd, at, len)
    let mut plan: Vec<(i32, u64, usize)> = (0..20).map(|i| (fd, i * 65536, 65536)).collect();
    plan.push((fd, 4096, (3 << 20) + 512 * 1024));
    plan.push((fd, len as u64 - 1000, 8192));
    plan.push((fd, 0, 0));
    plan.push((closed, 0, 4096));
    plan.push((fd, 1 << 20, 65536));
    for engine in [
        Arc::new(PreadEngine) as Arc<dyn IoEngine>,
        Arc::new(UringEngine::new(2).unwrap()) as Arc<dyn IoEngine>,
    ] {
        let mut bufs: Vec<Vec<u8>> = plan.iter().map(|&(_, _, n)| vec![0u8; n]).collect();
        let mut reqs: Vec<ReadReq<'_>> = plan
            .iter()
            .zip(bufs.iter_mut())
            .map(|(&(fd, at, _), b)| ReadReq { fd, at, dst: b })
            .collect();
        let got = engine.read_many(&mut reqs);
        drop(reqs);
        assert_eq!(got.len(), plan.len());
        for (i, ((&(rfd, at, n), r), b)) in plan.iter().zip(&got).zip(&bufs).enumerate() {
            if rfd == closed {
                assert!(
                    r.is_err(),
                    "{}: request {i} on an invalid fd: {r:?}",
                    engine.name()
                );
                continue;
            }
            let want = n.min(len - (at as usize).min(len));
            assert_eq!(
                *r.as_ref().unwrap(),
                want,
                "{}: request {i} bytes",
                engine.name()
            );
            assert_eq!(
                &b[..want],
                &data[at as usize..at as usize + want],
                "{}: request {i} bytes differ",
                engine.name()
            );
            let mut one = vec![0u8; n];
            let r1 = engine.read_file(rfd, at, &mut one, &mut |_| {}).unwrap();
            assert_eq!(r1, want, "{}: read_file of request {i}", engine.name());
        }
    }
}
