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
