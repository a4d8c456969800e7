#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The tier conformance suite on every G4 backend: memory, file and a real
//! S3 server (SeaweedFS), with corruption done by rewriting the object.

use kvtier_client::{BlockKey, NamespaceId};
use kvtier_daemon::testkit::conformance::{run_all, Caps, Damage};
use kvtier_daemon::testkit::s3::S3Server;
use kvtier_daemon::tiers::g4::{G4Config, G4Store};
use object_store::{ObjectStoreExt, PutPayload};

/// Damages the stored object by rewriting it through the raw store.
fn damage(g4: &G4Store, ns: &NamespaceId, key: &BlockKey, d: Damage) {
    let store = g4.object_store();
    let loc = g4.object_path(ns, key);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut b = store
            .get(&loc)
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap()
            .to_vec();
        match d {
            Damage::Header => b[100] ^= 0x40,
            Damage::Payload => b[4096 + 7] ^= 0x01,
            Damage::Truncate => b.truncate(b.len() - 4096),
        }
        store.put(&loc, PutPayload::from(b)).await.unwrap();
    });
}

fn run(g4: &G4Store) {
    let corrupt = |ns: &NamespaceId, key: &BlockKey, d: Damage| damage(g4, ns, key, d);
    let caps = Caps {
        corrupt: Some(&corrupt),
        block_bytes: 64 * 1024,
    };
    run_all(g4, &caps).unwrap();
}

#[test]
fn conformance_memory() {
    run(&G4Store::open(G4Config::new("memory://")).unwrap());
}

#[test]
fn conformance_file() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    run(&G4Store::open(G4Config::new(url)).unwrap());
}

#[test]
fn conformance_s3() {
    let Some(server) = S3Server::start("kvtier-conf").unwrap() else {
        eprintln!("SKIP: .venv/bin/weed not installed (run scripts/setup.sh)");
        return;
    };
    run(&G4Store::open(server.g4_config("cluster-a")).unwrap());
}
