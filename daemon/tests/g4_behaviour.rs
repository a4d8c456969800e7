#![allow(clippy::unwrap_used, clippy::expect_used)]
//! G4 behaviour beyond the tier contract: write-through queue, single-flight
//! fetch, faults, credentials, lifecycle, and a real S3 server killed
//! mid-upload.

use kvtier_client::{encode_block, BlockKey, Hints, NamespaceId};
use kvtier_daemon::base::tier::{BlockTier, Lookup, MissReason, PutOutcome};
use kvtier_daemon::testkit::conformance::{block, namespace};
use kvtier_daemon::testkit::{s3::S3Server, FaultStore};
use kvtier_daemon::tiers::g4::{EnqueueOutcome, G4Config, G4Store, UploadOutcome};
use object_store::memory::InMemory;
use object_store::path::Path;
use std::collections::HashMap;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Files = Arc<Mutex<HashMap<(NamespaceId, BlockKey), Vec<u8>>>>;

/// A fake G3: block files in memory, the uploader's source.
fn g3_with(
    ns: &kvtier_client::Namespace,
    seeds: std::ops::Range<u64>,
    bytes: u64,
) -> (Files, Vec<BlockKey>) {
    let files: Files = Default::default();
    let mut keys = Vec::new();
    let _ = bytes;
    for s in seeds {
        let (k, h, p) = block(ns, s);
        files
            .lock()
            .unwrap()
            .insert((ns.id(), k), encode_block(&h, &p));
        keys.push(k);
    }
    (files, keys)
}

fn source(files: &Files) -> Arc<dyn kvtier_daemon::tiers::g4::BlockSource> {
    let f = files.clone();
    Arc::new(move |ns: &NamespaceId, k: &BlockKey| f.lock().unwrap().get(&(*ns, *k)).cloned())
}

fn fault_g4(cfg: G4Config) -> (G4Store, Arc<FaultStore>) {
    let fs = FaultStore::new(Arc::new(InMemory::new()));
    let g4 = G4Store::with_store(fs.clone(), Path::from("p"), cfg).unwrap();
    (g4, fs)
}

#[test]
fn write_through_uploads_and_reports_safe() {
    let ns = namespace(8192, "wt").unwrap();
    let (files, keys) = g3_with(&ns, 0..20, 8192);
    let (g4, _) = fault_g4(G4Config::new("memory://"));
    let safe: Arc<Mutex<Vec<(BlockKey, UploadOutcome)>>> = Default::default();
    let s2 = safe.clone();
    g4.start_uploader(
        source(&files),
        Some(Arc::new(move |_, k, o| s2.lock().unwrap().push((*k, o)))),
    )
    .unwrap();
    for k in &keys {
        assert_eq!(
            g4.enqueue(&ns.id(), k, Hints::default()),
            EnqueueOutcome::Queued
        );
    }
    let eph = Hints {
        ephemeral: true,
        ..Default::default()
    };
    assert_eq!(
        g4.enqueue(&ns.id(), &keys[0], eph),
        EnqueueOutcome::SkippedEphemeral
    );
    assert!(g4.flush(Duration::from_secs(20)));
    let safe = safe.lock().unwrap();
    assert_eq!(safe.len(), 20);
    assert!(safe.iter().all(|(_, o)| o.is_safe_in_g4()));
    for k in &keys {
        let b = g4.fetch(&ns.id(), k, Duration::from_secs(5)).hit().unwrap();
        assert_eq!(
            encode_block(&b.header, &b.payload),
            files.lock().unwrap()[&(ns.id(), *k)]
        );
    }
    let st = g4.stats();
    assert_eq!(st.uploads_stored, 20);
    assert_eq!(st.uploads_skipped_ephemeral, 1);
    assert_eq!(st.upload_queue_depth, 0);
}

#[test]
fn full_queue_drops_with_a_counter() {
    let ns = namespace(4096, "qfull").unwrap();
    let (files, keys) = g3_with(&ns, 0..10, 4096);
    let cfg = G4Config {
        upload_queue_max: 3,
        ..G4Config::new("memory://")
    };
    let (g4, _) = fault_g4(cfg);
    // Uploader not started yet: nothing drains the queue.
    let outs: Vec<_> = keys
        .iter()
        .map(|k| g4.enqueue(&ns.id(), k, Hints::default()))
        .collect();
    assert_eq!(
        outs.iter()
            .filter(|o| **o == EnqueueOutcome::Queued)
            .count(),
        3
    );
    assert_eq!(
        outs.iter()
            .filter(|o| **o == EnqueueOutcome::DroppedQueueFull)
            .count(),
        7
    );
    assert_eq!(g4.stats().uploads_dropped_queue_full, 7);
    assert_eq!(g4.stats().upload_queue_depth, 3);
    g4.start_uploader(source(&files), None).unwrap();
    assert!(g4.flush(Duration::from_secs(20)));
    assert_eq!(g4.stats().uploads_stored, 3);
}

#[test]
fn concurrent_fetches_share_one_get() {
    let ns = namespace(64 * 1024, "sf").unwrap();
    let (g4, fs) = fault_g4(G4Config::new("memory://"));
    let (k, h, p) = block(&ns, 1);
    assert_eq!(g4.put(&ns.id(), &h, &p).unwrap(), PutOutcome::Stored);
    fs.get_delay_ms.store(300, SeqCst);
    let before = fs.gets.load(SeqCst);
    let g4 = Arc::new(g4);
    let ts: Vec<_> = (0..16)
        .map(|_| {
            let (g4, id, k) = (g4.clone(), ns.id(), k);
            std::thread::spawn(move || {
                g4.fetch(&id, &k, Duration::from_secs(10))
                    .hit()
                    .unwrap()
                    .payload
            })
        })
        .collect();
    for t in ts {
        assert_eq!(t.join().unwrap(), p);
    }
    assert_eq!(
        fs.gets.load(SeqCst) - before,
        1,
        "16 concurrent fetches, one GET"
    );
    assert_eq!(g4.stats().fetch_requests, 16);
}

#[test]
fn down_or_slow_store_is_a_miss_within_the_deadline_and_uploads_retry() {
    let ns = namespace(4096, "down").unwrap();
    let cfg = G4Config {
        retry_backoff_ms: 20,
        retry_backoff_max_ms: 100,
        upload_retries: 50,
        ..G4Config::new("memory://")
    };
    let (g4, fs) = fault_g4(cfg);
    let (k, h, p) = block(&ns, 3);
    g4.put(&ns.id(), &h, &p).unwrap();
    fs.get_delay_ms.store(5_000, SeqCst);
    let t0 = Instant::now();
    // Late, not unreachable: the caller's deadline passed first.
    assert!(matches!(
        g4.fetch(&ns.id(), &k, Duration::from_millis(200)),
        Lookup::Miss(MissReason::Timeout)
    ));
    assert!(t0.elapsed() < Duration::from_secs(2));
    fs.get_delay_ms.store(0, SeqCst);
    fs.down.store(true, SeqCst);
    let (k2, _, _) = block(&ns, 4);
    assert!(matches!(
        g4.fetch(&ns.id(), &k2, Duration::from_secs(2)),
        Lookup::Miss(MissReason::Unavailable)
    ));
    // Uploads while down retry, then land once the store is back.
    let (files, keys) = g3_with(&ns, 10..15, 4096);
    g4.start_uploader(source(&files), None).unwrap();
    for k in &keys {
        g4.enqueue(&ns.id(), k, Hints::default());
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(g4.stats().upload_attempt_failures > 0);
    fs.down.store(false, SeqCst);
    assert!(g4.flush(Duration::from_secs(20)));
    assert_eq!(g4.stats().uploads_stored, 5);
    assert_eq!(g4.stats().uploads_given_up, 0);
}

#[test]
fn corrupt_object_is_not_served_and_is_healed_by_reupload() {
    let ns = namespace(8192, "heal").unwrap();
    let (g4, _) = fault_g4(G4Config::new("memory://"));
    let (k, h, p) = block(&ns, 5);
    g4.put(&ns.id(), &h, &p).unwrap();
    let store = g4.object_store();
    let loc = g4.object_path(&ns.id(), &k);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        use object_store::ObjectStoreExt;
        let mut b = store
            .get(&loc)
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap()
            .to_vec();
        b[4096 + 100] ^= 1;
        store.put(&loc, b.into()).await.unwrap();
    });
    assert!(matches!(
        g4.fetch(&ns.id(), &k, Duration::from_secs(5)),
        Lookup::Miss(MissReason::Corrupt)
    ));
    assert_eq!(g4.stats().fetch_corrupt, 1);
    assert_eq!(
        g4.put(&ns.id(), &h, &p).unwrap(),
        PutOutcome::Stored,
        "corrupt object was removed"
    );
    assert_eq!(
        g4.fetch(&ns.id(), &k, Duration::from_secs(5))
            .hit()
            .unwrap()
            .payload,
        p
    );
}

#[test]
fn existence_cache_avoids_heads() {
    let ns = namespace(4096, "exists").unwrap();
    let (g4, _) = fault_g4(G4Config::new("memory://"));
    let (k, h, p) = block(&ns, 6);
    assert_eq!(g4.contains_cached(&ns.id(), &k), None);
    g4.put(&ns.id(), &h, &p).unwrap();
    assert_eq!(g4.contains_cached(&ns.id(), &k), Some(true));
    for _ in 0..10 {
        assert!(g4.contains(&ns.id(), &k).unwrap());
    }
    assert_eq!(g4.stats().exists_heads, 0);
    assert_eq!(g4.stats().exists_cache_hits, 10);
}

#[test]
fn sweeper_enforces_capacity_and_ttl_but_not_on_young_objects() {
    let ns = namespace(4096, "sweep").unwrap();
    let file_len = 8192u64;
    let cfg = G4Config {
        capacity_bytes: Some(3 * file_len),
        sweep_min_age_ms: 0,
        sweep_interval_ms: 3_600_000,
        ..G4Config::new("memory://")
    };
    let (g4, _) = fault_g4(cfg);
    let mut keys = Vec::new();
    for s in 0..6 {
        let (k, h, p) = block(&ns, s);
        g4.put(&ns.id(), &h, &p).unwrap();
        keys.push(k);
        std::thread::sleep(Duration::from_millis(5));
    }
    let rep = g4.sweep_once().unwrap();
    assert_eq!((rep.listed, rep.deleted), (6, 3));
    // What the node reports as G4's size: the survivors of the last sweep.
    assert_eq!(g4.stats().sweep_last_total_blocks, 3);
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(
            g4.fetch(&ns.id(), k, Duration::from_secs(5))
                .hit()
                .is_some(),
            i >= 3,
            "oldest first"
        );
    }
    // Grace period: nothing younger than min age is deleted, even over capacity.
    let cfg = G4Config {
        capacity_bytes: Some(0),
        sweep_min_age_ms: 60_000,
        ..G4Config::new("memory://")
    };
    let (g4b, _) = fault_g4(cfg);
    let (_, h, p) = block(&ns, 1);
    g4b.put(&ns.id(), &h, &p).unwrap();
    assert_eq!(g4b.sweep_once().unwrap().deleted, 0);
    // TTL.
    let cfg = G4Config {
        ttl_ms: Some(50),
        sweep_min_age_ms: 0,
        ..G4Config::new("memory://")
    };
    let (g4c, _) = fault_g4(cfg);
    g4c.put(&ns.id(), &h, &p).unwrap();
    assert_eq!(g4c.sweep_once().unwrap().deleted, 0);
    std::thread::sleep(Duration::from_millis(120));
    assert_eq!(g4c.sweep_once().unwrap().deleted, 1);
}

#[test]
fn s3_wrong_credentials_typed_error_without_secret() {
    let Some(server) = S3Server::start("kvtier-creds").unwrap() else {
        eprintln!("SKIP: .venv/bin/weed not installed (run scripts/setup.sh)");
        return;
    };
    let wrong = "WrongSecretValue-Do-Not-Leak-123";
    let cfg = G4Config {
        secret_access_key: Some(wrong.into()),
        retry_backoff_ms: 10,
        ..server.g4_config("c")
    };
    let g4 = G4Store::open(cfg).unwrap();
    let ns = namespace(4096, "creds").unwrap();
    let (k, h, p) = block(&ns, 1);
    let e = g4.put(&ns.id(), &h, &p).unwrap_err();
    let msg = format!("{e} {e:?}");
    assert!(
        matches!(e, kvtier_daemon::Error::ObjectStore { .. }),
        "{msg}"
    );
    assert!(!msg.contains(wrong), "secret leaked: {msg}");
    assert!(!msg.contains(&server.secret_access_key));
    assert!(matches!(
        g4.fetch(&ns.id(), &k, Duration::from_secs(5)),
        Lookup::Miss(MissReason::Unavailable)
    ));
    assert!(!format!("{:?}", g4.config()).contains(wrong));
    // The right secret works against the same server.
    let ok = G4Store::open(server.g4_config("c")).unwrap();
    assert_eq!(ok.put(&ns.id(), &h, &p).unwrap(), PutOutcome::Stored);
}

#[test]
fn s3_killed_mid_upload_loses_nothing_and_multipart_works() {
    let Some(mut server) = S3Server::start("kvtier-kill").unwrap() else {
        eprintln!("SKIP: .venv/bin/weed not installed (run scripts/setup.sh)");
        return;
    };
    let ns = namespace(1 << 20, "kill").unwrap();
    let (files, keys) = g3_with(&ns, 0..24, 1 << 20);
    let cfg = G4Config {
        upload_concurrency: 2,
        upload_retries: 60,
        retry_backoff_ms: 100,
        retry_backoff_max_ms: 500,
        request_timeout_ms: 3_000,
        // Its lifecycle view (no capacity) expires soon after it is
        // dropped, so the sweep at the end is agreed.
        lifecycle_refresh_ms: 100,
        ..server.g4_config("cluster")
    };
    let g4 = G4Store::open(cfg).unwrap();
    let safe: Arc<Mutex<Vec<BlockKey>>> = Default::default();
    let s2 = safe.clone();
    g4.start_uploader(
        source(&files),
        Some(Arc::new(move |_, k, o| {
            if o.is_safe_in_g4() {
                s2.lock().unwrap().push(*k)
            }
        })),
    )
    .unwrap();
    for k in &keys {
        assert_eq!(
            g4.enqueue(&ns.id(), k, Hints::default()),
            EnqueueOutcome::Queued
        );
    }
    // Crash the server while uploads are in flight, then bring it back.
    while g4.stats().uploads_stored < 2 {
        std::thread::sleep(Duration::from_millis(5));
    }
    server.kill();
    std::thread::sleep(Duration::from_millis(800));
    server.restart().unwrap();
    assert!(
        g4.flush(Duration::from_secs(90)),
        "uploads did not resume: {:?}",
        g4.stats()
    );
    let st = g4.stats();
    assert_eq!(st.uploads_given_up, 0, "{st:?}");
    assert!(
        st.upload_attempt_failures > 0,
        "the kill hit no upload: {st:?}"
    );
    assert_eq!(safe.lock().unwrap().len(), keys.len());
    // Another node (a fresh store, separate caches) reads every block back.
    // Another node, with the lifecycle of the sweep at the end (the bucket
    // is swept only by agreement); its own sweeper never runs here.
    let other = G4Store::open(G4Config {
        capacity_bytes: Some(0),
        sweep_interval_ms: 3_600_000,
        ..server.g4_config("cluster")
    })
    .unwrap();
    for k in &keys {
        let b = other
            .fetch(&ns.id(), k, Duration::from_secs(10))
            .hit()
            .unwrap_or_else(|| panic!("{k} lost"));
        assert_eq!(
            encode_block(&b.header, &b.payload),
            files.lock().unwrap()[&(ns.id(), *k)]
        );
    }
    // Multipart above the threshold, on the real server.
    let big_ns = namespace(12 << 20, "multipart").unwrap();
    let (bk, bh, bp) = block(&big_ns, 1);
    let cfg = G4Config {
        multipart_threshold_bytes: 6 << 20,
        multipart_part_bytes: 5 << 20,
        lifecycle_refresh_ms: 100,
        ..server.g4_config("cluster")
    };
    let mp = G4Store::open(cfg).unwrap();
    assert_eq!(mp.put(&big_ns.id(), &bh, &bp).unwrap(), PutOutcome::Stored);
    assert_eq!(
        mp.put(&big_ns.id(), &bh, &bp).unwrap(),
        PutOutcome::AlreadyPresent
    );
    assert_eq!(
        other
            .fetch(&big_ns.id(), &bk, Duration::from_secs(10))
            .hit()
            .unwrap()
            .payload,
        bp
    );
    // Ranged read of the header only.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let hdr = rt
        .block_on(other.fetch_header_async(&big_ns.id(), &bk, Duration::from_secs(5)))
        .hit()
        .unwrap();
    assert_eq!(hdr, bh);
    // The sweeper's listing and batched delete on the real server, once
    // the nodes without a lifecycle have stopped and their views expired.
    drop((g4, mp));
    std::thread::sleep(Duration::from_millis(400));
    let cfg = G4Config {
        capacity_bytes: Some(0),
        sweep_min_age_ms: 0,
        ..server.g4_config("cluster")
    };
    let rep = G4Store::open(cfg).unwrap().sweep_once().unwrap();
    assert_eq!(rep.listed, keys.len() as u64 + 1, "{rep:?}");
    assert_eq!(rep.deleted, rep.listed, "{rep:?}");
    assert!(matches!(
        other.fetch(&ns.id(), &keys[0], Duration::from_secs(10)),
        Lookup::Miss(MissReason::Absent)
    ));
}

#[test]
fn distinct_fetches_in_flight_are_bounded() {
    let ns = namespace(4096, "inflight").unwrap();
    let cfg = G4Config {
        fetch_inflight_max: 1,
        ..G4Config::new("memory://")
    };
    let (g4, fs) = fault_g4(cfg);
    let (k1, h1, p1) = block(&ns, 1);
    let (k2, h2, p2) = block(&ns, 2);
    g4.put(&ns.id(), &h1, &p1).unwrap();
    g4.put(&ns.id(), &h2, &p2).unwrap();
    fs.get_delay_ms.store(500, SeqCst);
    let g4 = Arc::new(g4);
    let (g, id) = (g4.clone(), ns.id());
    let t = std::thread::spawn(move || g.fetch(&id, &k1, Duration::from_secs(10)).hit().is_some());
    std::thread::sleep(Duration::from_millis(100));
    let t0 = Instant::now();
    assert!(matches!(
        g4.fetch(&ns.id(), &k2, Duration::from_secs(10)),
        Lookup::Miss(MissReason::Unavailable)
    ));
    assert!(t0.elapsed() < Duration::from_millis(400), "refused at once");
    assert!(t.join().unwrap());
    fs.get_delay_ms.store(0, SeqCst);
    assert_eq!(
        g4.fetch(&ns.id(), &k2, Duration::from_secs(10))
            .hit()
            .unwrap()
            .payload,
        p2
    );
}

/// `kvtier_blocks{tier="g4"}` (the census) follows this node's deletions:
/// it said 8 while the bucket held 6 after `kvtier evict --tier g4` of two
/// blocks (fails without the deleted-since-listing term). Sweeper
/// deletions keep it true too.
#[test]
fn g4_count_follows_evicts_and_sweeps() {
    let ns = namespace(8192, "census").unwrap();
    let (files, keys) = g3_with(&ns, 0..8, 8192);
    let file_len = files.lock().unwrap().values().next().unwrap().len() as u64;
    let cfg = G4Config {
        capacity_bytes: Some(4 * file_len),
        sweep_min_age_ms: 0,
        sweep_interval_ms: 3_600_000,
        ..G4Config::new("memory://")
    };
    let (g4, _) = fault_g4(cfg);
    let t = Instant::now();
    while g4.count().is_none() {
        assert!(t.elapsed() < Duration::from_secs(20), "no listing at start");
        std::thread::sleep(Duration::from_millis(10));
    }
    g4.start_uploader(source(&files), None).unwrap();
    for k in &keys {
        assert_eq!(
            g4.enqueue(&ns.id(), k, Hints::default()),
            EnqueueOutcome::Queued
        );
    }
    assert!(g4.flush(Duration::from_secs(20)));
    let c = g4.count().unwrap();
    assert_eq!((c.blocks, c.bytes), (8, 8 * file_len));
    // `kvtier evict --tier g4` of two blocks.
    for k in &keys[..2] {
        assert!(g4.delete(&ns.id(), k).unwrap());
    }
    assert!(!g4.delete(&ns.id(), &keys[0]).unwrap(), "already gone");
    let c = g4.count().unwrap();
    assert_eq!((c.blocks, c.bytes), (6, 6 * file_len), "after evicts");
    // A sweep to capacity (4 blocks) deletes 2 more; the count is the
    // bucket's, before and after the next listing.
    let rep = g4.sweep_once().unwrap();
    assert_eq!((rep.listed, rep.deleted), (6, 2));
    let c = g4.count().unwrap();
    assert_eq!((c.blocks, c.bytes), (4, 4 * file_len), "after a sweep");
    let rep = g4.sweep_once().unwrap();
    assert_eq!((rep.listed, rep.deleted), (4, 0));
    assert_eq!(g4.count().unwrap().blocks, 4);
    assert_eq!(g4.stats().deleted_blocks, 4);
}

/// Issue 42: two nodes share one bucket (a real S3 server); only node A
/// sets a capacity. A's sweep must not delete B's blocks (B agreed to no
/// deletions), says why in /healthz and its metrics, and sweeps again
/// once B's config agrees.
#[test]
fn one_nodes_lifecycle_never_deletes_another_nodes_blocks() {
    let Some(server) = S3Server::start("kvtier-lifecycle").unwrap() else {
        eprintln!("SKIP: .venv/bin/weed not installed (run scripts/setup.sh)");
        return;
    };
    let ns = namespace(4096, "lifecycle").unwrap();
    let node = |id: &str, capacity: Option<u64>| {
        G4Store::open(G4Config {
            capacity_bytes: capacity,
            sweep_min_age_ms: 0,
            sweep_interval_ms: 3_600_000,
            lifecycle_refresh_ms: 60_000,
            node_id: Some(id.into()),
            ..server.g4_config("cluster")
        })
        .unwrap()
    };
    let b = node("node-b", None);
    let mut keys = Vec::new();
    for s in 0..8 {
        let (k, h, p) = block(&ns, s);
        b.put(&ns.id(), &h, &p).unwrap();
        keys.push(k);
    }
    let a = node("node-a", Some(8192));
    // Both views are in the bucket (each node writes its own at open).
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.lifecycle_views().map_or(0, |v| v.len()) < 2 {
        assert!(Instant::now() < deadline, "lifecycle views not written");
        std::thread::sleep(Duration::from_millis(50));
    }
    let rep = a.sweep_once().unwrap();
    assert_eq!(rep.deleted, 0, "node A deleted node B's blocks: {rep:?}");
    assert_eq!(rep.refused, 7, "{rep:?}");
    for k in &keys {
        assert!(
            b.fetch(&ns.id(), k, Duration::from_secs(5)).hit().is_some(),
            "node B lost {k:?} to node A's lifecycle"
        );
    }
    let health = a.health().join("\n");
    assert!(
        health.contains("lifecycle not agreed") && health.contains("node-b"),
        "{health}"
    );
    assert_eq!(a.stats().lifecycle_conflict, 1);
    assert_eq!(a.stats().lifecycle_conflicts, 1);
    // B restarts with the same lifecycle: agreed, A sweeps to capacity.
    drop(b);
    let b = node("node-b", Some(8192));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rep = a.sweep_once().unwrap();
        if rep.deleted > 0 {
            assert_eq!((rep.deleted, rep.refused), (7, 0), "{rep:?}");
            break;
        }
        assert!(Instant::now() < deadline, "never agreed: {rep:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(a.health().is_empty(), "{:?}", a.health());
    assert_eq!(a.stats().lifecycle_conflict, 0);
    drop(b);
}
