#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Heartbeat discovery under `nodes/`: against object_store's in-memory
//! store and against a real S3 server (SeaweedFS, `weed mini`).

use kvtier_client::{encode_block, BlockHeader, BlockKey, KvLayout, Namespace};
use kvtier_daemon::tiers::peer::discovery::{self, heartbeat_path, Heartbeat};
use kvtier_daemon::tiers::peer::{
    unix_ms_now, DirSource, HeartbeatTask, PeerClient, PeerClientConfig, PeerLookup, PeerServer,
    PeerServerConfig, PeerSet, PeerSetConfig,
};
use object_store::memory::InMemory;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SECRET: &[u8] = b"discovery-secret-0123456789";

/// The suite, written once, run against every store.
async fn heartbeats_find_live_peers_and_ignore_stale(store: Arc<dyn ObjectStore>) {
    let s = store.as_ref();
    discovery::publish(s, "node-a", "127.0.0.1:7401", 60_000)
        .await
        .unwrap();
    discovery::publish(s, "node-c", "127.0.0.1:7403", 60_000)
        .await
        .unwrap();
    // Stale: expired a minute ago (a node that died without withdrawing).
    let stale = Heartbeat {
        node_id: "node-b".into(),
        address: "127.0.0.1:7402".into(),
        expires_unix_ms: unix_ms_now() - 60_000,
        written_unix_ms: unix_ms_now() - 120_000,
    };
    s.put(
        &heartbeat_path("node-b"),
        PutPayload::from(serde_json::to_vec(&stale).unwrap()),
    )
    .await
    .unwrap();
    // Junk that must be ignored, not fail discovery.
    s.put(
        &"nodes/garbage.json".into(),
        PutPayload::from_static(b"{not json"),
    )
    .await
    .unwrap();
    let liar = Heartbeat {
        node_id: "someone-else".into(),
        address: "127.0.0.1:1".into(),
        expires_unix_ms: u64::MAX,
        written_unix_ms: 0,
    };
    s.put(
        &heartbeat_path("spoof"),
        PutPayload::from(serde_json::to_vec(&liar).unwrap()),
    )
    .await
    .unwrap();
    let bad_addr = Heartbeat {
        node_id: "badaddr".into(),
        address: "no port here".into(),
        expires_unix_ms: u64::MAX,
        written_unix_ms: 0,
    };
    s.put(
        &heartbeat_path("badaddr"),
        PutPayload::from(serde_json::to_vec(&bad_addr).unwrap()),
    )
    .await
    .unwrap();
    s.put(&"nodes/.hidden.json".into(), PutPayload::from_static(b"{}"))
        .await
        .unwrap();
    // Oversized (issue #14: heartbeat bodies are capped): a valid
    // heartbeat padded past HEARTBEAT_BYTES_MAX is skipped, not read.
    let huge = Heartbeat {
        node_id: "node-huge".into(),
        address: "127.0.0.1:7409".into(),
        expires_unix_ms: u64::MAX,
        written_unix_ms: 0,
    };
    let mut body = serde_json::to_vec(&huge).unwrap();
    body.resize(1 << 20, b' ');
    s.put(&heartbeat_path("node-huge"), PutPayload::from(body))
        .await
        .unwrap();

    let seen = discovery::discover(s, "node-c", unix_ms_now())
        .await
        .unwrap();
    let ids: Vec<_> = seen
        .iter()
        .map(|p| (p.id.as_str(), p.address.as_str()))
        .collect();
    assert_eq!(ids, [("node-a", "127.0.0.1:7401")]);
    // As seen by a third node, both live ones; later in time, none.
    let seen = discovery::discover(s, "node-x", unix_ms_now())
        .await
        .unwrap();
    assert_eq!(seen.len(), 2);
    assert!(discovery::discover(s, "node-x", unix_ms_now() + 120_000)
        .await
        .unwrap()
        .is_empty());
    // Withdrawn: gone at once; withdrawing twice is fine.
    discovery::withdraw(s, "node-a").await.unwrap();
    discovery::withdraw(s, "node-a").await.unwrap();
    let seen = discovery::discover(s, "node-x", unix_ms_now())
        .await
        .unwrap();
    assert_eq!(
        seen.iter().map(|p| p.id.as_str()).collect::<Vec<_>>(),
        ["node-c"]
    );
    // Hostile ids are refused before they become object names.
    assert!(discovery::publish(s, "../x", "127.0.0.1:1", 1000)
        .await
        .is_err());
    discovery::withdraw(s, "node-c").await.unwrap();

    // Live: a task refreshes A's heartbeat; C's task discovers A and fetches
    // a block from it through the discovered address.
    let dir = tempfile::tempdir().unwrap();
    let src = Arc::new(DirSource::new(dir.path()));
    let server = PeerServer::start(PeerServerConfig::new(SECRET), src.clone())
        .await
        .unwrap();
    let ns = Namespace::new(
        "m",
        KvLayout::with_block_bytes(100_000).unwrap(),
        "",
        b"t".to_vec(),
    )
    .unwrap();
    let key = BlockKey::from_u64(77);
    let payload = vec![0x5a; 100_000];
    let h = BlockHeader::for_payload(&ns, key, &payload, 1);
    src.write_block(&ns.id(), &key, &encode_block(&h, &payload))
        .unwrap();

    let (period, ttl) = (200, 800);
    let a_task = HeartbeatTask::start(
        store.clone(),
        "node-a".into(),
        server.local_addr().to_string(),
        ttl,
        period,
        None,
    )
    .await
    .unwrap();
    let c_set = Arc::new(
        PeerSet::new(
            PeerSetConfig::new("node-c"),
            PeerClient::new(PeerClientConfig::new(SECRET)).unwrap(),
        )
        .unwrap(),
    );
    let c_task = HeartbeatTask::start(
        store.clone(),
        "node-c".into(),
        "127.0.0.1:7403".into(),
        ttl,
        period,
        Some(c_set.clone()),
    )
    .await
    .unwrap();
    assert_eq!(
        c_set
            .live_peers()
            .iter()
            .map(|p| p.id.as_str())
            .collect::<Vec<_>>(),
        ["node-a"]
    );
    // Still there after several TTL-less-than-lifetime periods: it is refreshed.
    tokio::time::sleep(Duration::from_millis(2 * ttl)).await;
    assert_eq!(c_set.live_peers().len(), 1, "refreshed heartbeat expired");
    match c_set
        .fetch(&ns.id(), &key, Instant::now() + Duration::from_secs(5))
        .await
    {
        PeerLookup::Hit { peer, block, .. } => {
            assert_eq!(peer.id, "node-a");
            assert_eq!(block.payload, payload);
        }
        other => panic!("{other:?}"),
    }
    // A stops refreshing (crash): C drops it once the TTL has passed.
    drop(a_task);
    let t = Instant::now();
    while !c_set.live_peers().is_empty() {
        assert!(
            t.elapsed() < Duration::from_millis(ttl + 10 * period),
            "stale peer kept"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(c_task);
    assert!(HeartbeatTask::start(
        store.clone(),
        "n".into(),
        "127.0.0.1:1".into(),
        100,
        100,
        None
    )
    .await
    .is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_in_memory() {
    heartbeats_find_live_peers_and_ignore_stale(Arc::new(InMemory::new())).await;
}

/// A SeaweedFS `weed mini` on free loopback ports, killed on drop.
struct Seaweed {
    child: Child,
    dir: tempfile::TempDir,
    s3_port: u16,
}

impl Drop for Seaweed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = &self.dir;
    }
}

fn free_ports(n: usize) -> Vec<u16> {
    let ls: Vec<_> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    ls.iter().map(|l| l.local_addr().unwrap().port()).collect()
}

fn weed_binary() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let p = root.join(".venv/bin/weed");
    p.exists().then_some(p)
}

const ACCESS: &str = "kvtier-test";
const SECRET_KEY: &str = "kvtier-test-secret-key";

fn start_seaweed(bin: &Path, bucket: &str) -> Seaweed {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("s3.json");
    std::fs::write(
        &cfg,
        format!(
            r#"{{"identities":[{{"name":"admin","credentials":[{{"accessKey":"{ACCESS}","secretKey":"{SECRET_KEY}"}}],"actions":["Admin","Read","Write","List","Tagging"]}}]}}"#
        ),
    )
    .unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let p = free_ports(10);
    let child = Command::new(bin)
        .arg("mini")
        .arg(format!("-dir={}", data.display()))
        .args([
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-admin.ui=false",
            "-webdav=false",
        ])
        .args(["-s3.port.iceberg=0", "-s3.port.lance=0"])
        .arg(format!("-bucket={bucket}"))
        .arg(format!("-s3.config={}", cfg.display()))
        .arg(format!("-master.port={}", p[0]))
        .arg(format!("-master.port.grpc={}", p[1]))
        .arg(format!("-volume.port={}", p[2]))
        .arg(format!("-volume.port.grpc={}", p[3]))
        .arg(format!("-filer.port={}", p[4]))
        .arg(format!("-filer.port.grpc={}", p[5]))
        .arg(format!("-s3.port={}", p[6]))
        .arg(format!("-s3.port.grpc={}", p[7]))
        .arg(format!("-admin.port={}", p[8]))
        .arg(format!("-admin.port.grpc={}", p[9]))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Seaweed {
        child,
        dir,
        s3_port: p[6],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_on_real_s3() {
    let Some(bin) = weed_binary() else {
        eprintln!("SKIP: .venv/bin/weed not installed; run ./scripts/setup.sh");
        return;
    };
    let bucket = "kvtier-peer";
    let weed = start_seaweed(&bin, bucket);
    let store: Arc<dyn ObjectStore> = Arc::new(
        object_store::aws::AmazonS3Builder::new()
            .with_endpoint(format!("http://127.0.0.1:{}", weed.s3_port))
            .with_allow_http(true)
            .with_virtual_hosted_style_request(false)
            .with_region("us-east-1")
            .with_bucket_name(bucket)
            .with_access_key_id(ACCESS)
            .with_secret_access_key(SECRET_KEY)
            .build()
            .unwrap(),
    );
    // Ready when a put goes through (the bucket is created asynchronously).
    let t = Instant::now();
    loop {
        match store
            .put(&"probe".into(), PutPayload::from_static(b"x"))
            .await
        {
            Ok(_) => break,
            Err(e) => {
                assert!(
                    t.elapsed() < Duration::from_secs(90),
                    "S3 server not ready: {e}"
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
    store.delete(&"probe".into()).await.unwrap();
    heartbeats_find_live_peers_and_ignore_stale(store).await;
    drop(weed);
}
