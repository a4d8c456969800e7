//! End-to-end: real `kvtierd` processes on the real store (G3 on disk, G4
//! on a real SeaweedFS, peers on loopback): persistence across kill -9,
//! cross-node reuse through G4 and through peers, a lying peer, and the
//! peer port's authentication.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kvtier_client::proto::ItemStatus;
use kvtier_client::{
    BlockKey, Client, ClientConfig, Hints, KvLayout, Namespace, OffloadOutcome, Onboarded, Tier,
};
use kvtier_daemon::testkit::s3::{S3Server, ACCESS_KEY_ID};
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};
use support::{free_port, metric, Daemon};

const BLOCK: usize = 64 << 10;

fn ns() -> Namespace {
    Namespace::new(
        "e2e-node",
        KvLayout::with_block_bytes(BLOCK as u64).unwrap(),
        "",
        "t",
    )
    .unwrap()
}

fn payload(seed: u64, i: usize) -> Vec<u8> {
    let mut v = vec![0u8; BLOCK];
    let mut x = seed << 32 | i as u64 | 1;
    for c in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    v
}

fn client(d: &Daemon) -> Client {
    let mut c = ClientConfig::new(&d.socket);
    c.region_bytes = 4 << 20;
    c.timeout_ms = 15_000;
    Client::with_config(c)
}

/// Offloads `n` blocks of chain `seed` through `d`; returns keys and bytes.
fn offload(d: &Daemon, seed: u64, n: usize) -> (Vec<BlockKey>, Vec<Vec<u8>>) {
    let c = client(d);
    let h = c.namespace(&ns());
    let tokens: Vec<u32> = (0..n as u32 * 16)
        .map(|t| t + seed as u32 * 1_000_000)
        .collect();
    let keys = h.hash_chain(&tokens);
    let data: Vec<Vec<u8>> = (0..n).map(|i| payload(seed, i)).collect();
    let refs: Vec<&[u8]> = data.iter().map(|d| &d[..]).collect();
    let out = h.offload_chain(None, &keys, &refs, Hints::default());
    assert!(out.iter().all(|o| *o == OffloadOutcome::Stored), "{out:?}");
    (keys, data)
}

/// Onboards `keys` through `d`, asserts every block is byte-identical and
/// returns the tier each came from.
fn onboard_verified(d: &Daemon, keys: &[BlockKey], data: &[Vec<u8>]) -> Vec<Tier> {
    let c = client(d);
    let h = c.namespace(&ns());
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; BLOCK]).collect();
    let mut rb: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let res = h.onboard_into(keys, &mut rb);
    let mut tiers = Vec::new();
    for (i, r) in res.iter().enumerate() {
        match r {
            Onboarded::Hit { tier, payload_len } => {
                assert_eq!(*payload_len as usize, BLOCK);
                assert!(bufs[i] == data[i], "block {i} differs");
                tiers.push(*tier);
            }
            Onboarded::Miss(m) => panic!("block {i} missed: {m:?}"),
            other => panic!("block {i}: {other:?}"),
        }
    }
    tiers
}

fn lookup(d: &Daemon, keys: &[BlockKey]) -> Vec<Tier> {
    let c = client(d);
    let l = c.namespace(&ns()).lookup(keys);
    assert!(l.miss.is_none(), "{l:?}");
    l.tiers
}

fn wait_metric(d: &Daemon, name: &str, labels: &[(&str, &str)], at_least: f64, within: Duration) {
    let t = Instant::now();
    loop {
        let v = metric(&d.scrape(), name, labels);
        if v >= at_least {
            return;
        }
        assert!(
            t.elapsed() < within,
            "{name}{labels:?} = {v}, expected >= {at_least} within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn g4_stat(d: &Daemon, stat: &str) -> f64 {
    // The old `kvtier_g4{stat}` names this suite asserts on, as the
    // families they became (docs/OPERATIONS.md, Monitoring).
    let (name, labels): (&str, &[(&str, &str)]) = match stat {
        "enqueued" => ("kvtier_g4_uploads_enqueued_total", &[]),
        "uploads_stored" => ("kvtier_g4_uploads_total", &[("outcome", "stored")]),
        other => panic!("no mapping for {other}"),
    };
    metric(&d.scrape(), name, labels)
}

/// A config file for a daemon on the shared S3 bucket, with peers.
fn write_config(dir: &Path, s3: &S3Server, peer: Option<(&str, u16, &str, &Path)>) -> String {
    let mut t = format!(
        "[g4]\nurl = \"s3://{}/e2e\"\nendpoint = \"{}\"\nregion = \"us-east-1\"\nallow_http = true\npath_style = true\naccess_key_id = \"{}\"\nsecret_access_key = \"{}\"\n",
        s3.bucket,
        s3.endpoint(),
        ACCESS_KEY_ID,
        s3.secret_access_key
    );
    if let Some((id, port, peers, secret)) = peer {
        t.push_str(&format!(
            "[peer]\nenabled = true\nnode_id = \"{id}\"\nbind = \"127.0.0.1:{port}\"\nsecret_file = \"{}\"\npeers = [{peers}]\ndown_backoff_ms = 100\ncorrupt_quarantine_ms = 100\nper_peer_timeout_ms = 2000\n",
            secret.display()
        ));
    }
    let p = dir.join(format!("kvtierd-{}.toml", peer.map(|p| p.0).unwrap_or("x")));
    std::fs::write(&p, t).unwrap();
    // It holds the G4 secret: owner only, or kvtierd refuses it.
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p.display().to_string()
}

fn s3_or_skip(test: &str) -> Option<S3Server> {
    match S3Server::start("kvtier-e2e").unwrap() {
        Some(s) => Some(s),
        None => {
            eprintln!(
                "SKIP: {test}: .venv/bin/weed not found (run scripts/setup.sh or set KVTIER_WEED)"
            );
            None
        }
    }
}

#[test]
fn persistence_across_kill9() {
    // G3 only: what survives is the local tier's doing.
    let mut d = Daemon::start_with(&["--g4".into(), String::new()], &[]);
    let (keys, data) = offload(&d, 1, 24);
    d.restart(); // SIGKILL, then the same dirs again
    assert_eq!(lookup(&d, &keys), vec![Tier::G3; keys.len()]);
    let tiers = onboard_verified(&d, &keys, &data);
    assert!(tiers.iter().all(|t| *t == Tier::G3), "{tiers:?}");
    let s = d.scrape();
    assert_eq!(
        metric(&s, "kvtier_blocks", &[("tier", "g3")]),
        keys.len() as f64
    );
}

#[test]
fn two_daemons_share_g4_on_s3() {
    let Some(s3) = s3_or_skip("two_daemons_share_g4_on_s3") else {
        return;
    };
    let cfg_dir = tempfile::tempdir().unwrap();
    let conf = write_config(cfg_dir.path(), &s3, None);
    let a = Daemon::start_with(&["--config".into(), conf.clone()], &[]);
    let b = Daemon::start_with(&["--config".into(), conf], &[]);
    let (keys, data) = offload(&a, 2, 6);
    wait_metric(
        &a,
        "kvtier_g4_uploads_total",
        &[("outcome", "stored")],
        6.0,
        Duration::from_secs(30),
    );
    // B never saw these blocks: its lookup finds them in G4...
    assert_eq!(lookup(&b, &keys), vec![Tier::G4; keys.len()]);
    // ...and its onboard fetches, verifies and promotes them.
    let tiers = onboard_verified(&b, &keys, &data);
    assert_eq!(tiers, vec![Tier::G4; keys.len()]);
    assert_eq!(lookup(&b, &keys), vec![Tier::G3; keys.len()]);
    // Promotion into G3 runs in the background after the onboard answered.
    wait_metric(
        &b,
        "kvtier_promotions_total",
        &[("source", "g4")],
        6.0,
        Duration::from_secs(10),
    );
    let s = b.scrape();
    assert_eq!(
        metric(&s, "kvtier_promotions_total", &[("source", "g4")]),
        6.0
    );
    assert_eq!(metric(&s, "kvtier_blocks", &[("tier", "g3")]), 6.0);
    // B does not upload what it fetched from G4.
    assert_eq!(g4_stat(&b, "enqueued"), 0.0);
    // Evicted locally, the block is still one fall-through away.
    let c = client(&b);
    c.namespace(&ns()).evict(&keys[..1]).unwrap();
    assert_eq!(onboard_verified(&b, &keys[..1], &data[..1]), vec![Tier::G4]);
}

/// Polls B's lookup of `keys` until every block is on `tier`.
fn wait_lookup(d: &Daemon, keys: &[BlockKey], tier: Tier, within: Duration) {
    let t = Instant::now();
    loop {
        let l = client(d).namespace(&ns()).lookup(keys);
        if l.tiers.len() == keys.len() && l.tiers.iter().all(|x| *x == tier) {
            return;
        }
        assert!(
            t.elapsed() < within,
            "lookup {:?} (miss {:?}), expected all {tier:?} within {within:?}",
            l.tiers,
            l.miss
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_prefetched_chain_is_on_g3_before_its_request() {
    let Some(s3) = s3_or_skip("a_prefetched_chain_is_on_g3_before_its_request") else {
        return;
    };
    let cfg_dir = tempfile::tempdir().unwrap();
    let conf = write_config(cfg_dir.path(), &s3, None);
    let a = Daemon::start_with(&["--config".into(), conf.clone()], &[]);
    let b = Daemon::start_with(&["--config".into(), conf], &[]);
    let (keys, data) = offload(&a, 6, 8);
    // Uploaded: B, which never saw the chain, finds it in G4.
    wait_lookup(&b, &keys, Tier::G4, Duration::from_secs(30));
    let h_client = client(&b);
    let h = h_client.namespace(&ns());
    // The prefetch answers at once; the fetches run in the background.
    let st = h.prefetch(&keys, 30_000, 1).unwrap();
    assert_eq!(st, vec![ItemStatus::Ok; keys.len()], "{st:?}");
    wait_lookup(&b, &keys, Tier::G3, Duration::from_secs(30));
    // The request that follows reads G3 only, byte-identical.
    assert_eq!(
        onboard_verified(&b, &keys, &data),
        vec![Tier::G3; keys.len()]
    );
    let s = b.scrape();
    let pf = |o: &str| metric(&s, "kvtier_prefetch_blocks_total", &[("outcome", o)]);
    assert_eq!((pf("queued"), pf("fetched")), (8.0, 8.0));
    // Asked again, nothing is left to fetch.
    let again = h.prefetch(&keys, 30_000, 1).unwrap();
    assert_eq!(again, vec![ItemStatus::AlreadyPresent; keys.len()]);
    // A chain nobody wrote: queued, fetched nowhere, never an error; the
    // daemon keeps serving and the chain stays a miss.
    let unknown: Vec<BlockKey> = (0..4)
        .map(|i| BlockKey::from_u64(0xdead_0000 + i))
        .collect();
    assert_eq!(
        h.prefetch(&unknown, 2_000, 2).unwrap(),
        vec![ItemStatus::Ok; 4]
    );
    assert!(h.lookup(&unknown).tiers.is_empty());
    assert_eq!(lookup(&b, &keys), vec![Tier::G3; keys.len()]);
    // A G3-only daemon has nowhere to fetch from: absent, not queued.
    let g3_only = Daemon::start_with(&["--g4".into(), String::new()], &[]);
    let c = client(&g3_only);
    assert_eq!(
        c.namespace(&ns()).prefetch(&keys[..2], 1_000, 0).unwrap(),
        vec![ItemStatus::Absent; 2]
    );
}

#[test]
fn three_daemons_peers_g4_and_a_lying_peer() {
    let Some(s3) = s3_or_skip("three_daemons_peers_g4_and_a_lying_peer") else {
        return;
    };
    let cfg_dir = tempfile::tempdir().unwrap();
    let secret = cfg_dir.path().join("peer.secret");
    std::fs::write(&secret, "e2e-shared-secret-0123456789abcdef\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let ports = [free_port(), free_port(), free_port()];
    let ids = ["node-a", "node-b", "node-c"];
    let start = |i: usize, envs: &[(String, String)]| {
        let peers: Vec<String> = (0..3)
            .filter(|&j| j != i)
            .map(|j| {
                format!(
                    "{{ id = \"{}\", address = \"127.0.0.1:{}\" }}",
                    ids[j], ports[j]
                )
            })
            .collect();
        let conf = write_config(
            cfg_dir.path(),
            &s3,
            Some((ids[i], ports[i], &peers.join(", "), &secret)),
        );
        Daemon::start_with(&["--config".into(), conf], envs)
    };
    let mut a = start(0, &[]);
    let _b = start(1, &[]);
    let c = start(2, &[]);

    // (d) The peer port refuses a request without a signature.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", ports[0])).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET /v1/blocks/{}/{} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        ns().id().to_hex(),
        "00".repeat(32)
    )
    .unwrap();
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    assert!(resp.starts_with("HTTP/1.1 401"), "{resp}");

    // A block stored on A is found on a peer by C and fetched from it.
    let (k1, d1) = offload(&a, 3, 4);
    wait_metric(
        &a,
        "kvtier_g4_uploads_total",
        &[("outcome", "stored")],
        4.0,
        Duration::from_secs(30),
    );
    assert_eq!(lookup(&c, &k1), vec![Tier::Peer; 4]);
    assert_eq!(onboard_verified(&c, &k1, &d1), vec![Tier::Peer; 4]);
    wait_metric(
        &c,
        "kvtier_promotions_total",
        &[("source", "peer")],
        4.0,
        Duration::from_secs(10),
    );
    let s = c.scrape();
    assert!(metric(&s, "kvtier_peer_fetches_total", &[("outcome", "hit")]) >= 4.0);
    assert!(
        metric(&s, "kvtier_peer_bytes_total", &[("direction", "received")]) >= (4 * BLOCK) as f64
    );
    assert_eq!(
        metric(&s, "kvtier_promotions_total", &[("source", "peer")]),
        4.0
    );

    // With A gone, C still gets A's blocks from G4.
    let (k2, d2) = offload(&a, 4, 3);
    wait_metric(
        &a,
        "kvtier_g4_uploads_total",
        &[("outcome", "stored")],
        7.0,
        Duration::from_secs(30),
    );
    a.kill9();
    assert_eq!(lookup(&c, &k2), vec![Tier::G4; 3]);
    assert_eq!(onboard_verified(&c, &k2, &d2), vec![Tier::G4; 3]);

    // A comes back lying (every payload it sends has a flipped byte): C
    // rejects the bytes and falls back to G4.
    a.envs = vec![("KVTIER_TEST_PEER_CORRUPT".into(), "1".into())];
    a.restart();
    let (k3, d3) = offload(&a, 5, 2);
    wait_metric(
        &a,
        "kvtier_g4_uploads_total",
        &[("outcome", "stored")],
        2.0,
        Duration::from_secs(30),
    );
    std::thread::sleep(Duration::from_millis(200)); // past C's down-backoff for A
    let corrupt_before = metric(
        &c.scrape(),
        "kvtier_peer_fetches_total",
        &[("outcome", "corrupt")],
    );
    assert_eq!(onboard_verified(&c, &k3, &d3), vec![Tier::G4; 2]);
    let corrupt_after = metric(
        &c.scrape(),
        "kvtier_peer_fetches_total",
        &[("outcome", "corrupt")],
    );
    assert!(
        corrupt_after > corrupt_before,
        "C never saw A's corrupt bytes"
    );
}

#[test]
fn bench_crossnode_json_contract() {
    if support::find_weed_for_tests().is_none() {
        eprintln!("SKIP: bench_crossnode_json_contract: .venv/bin/weed not found");
        return;
    }
    support::kvtierd_bin();
    let out = std::process::Command::new(support::bin("kvtier-tools", "kvtier"))
        .args([
            "bench",
            "crossnode",
            "--blocks",
            "3",
            "--block-size",
            "64KiB",
            "--rounds",
            "1",
            "--request-blocks",
            "2",
            "--json",
        ])
        .output()
        .unwrap();
    let j: serde_json::Value = support::json_stdout(&out);
    assert_eq!(j["bench"], "crossnode");
    for k in [
        "peer_gbps",
        "g4_gbps",
        "peer_per_block_gbps",
        "g4_per_block_gbps",
    ] {
        assert!(j[k].as_f64().unwrap() > 0.0, "{k}");
        assert!(j[format!("{k}_baseline")].as_f64().unwrap() > 0.0);
        assert!(j[format!("{k}_vs_baseline")].is_number());
    }
    for k in ["g4_get_verify", "g3_promote", "client_read", "total_mean"] {
        assert!(j["g4_breakdown_ms"][k].is_number(), "{k}");
    }
    // Only comparison quotients end in _vs_baseline.
    let vs: Vec<&String> = j
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| k.ends_with("_vs_baseline"))
        .collect();
    assert_eq!(vs.len(), 4, "{vs:?}");
}

#[test]
fn uploads_lost_to_a_crash_are_requeued_at_restart() {
    let Some(mut s3) = s3_or_skip("uploads_lost_to_a_crash_are_requeued_at_restart") else {
        return;
    };
    let cfg_dir = tempfile::tempdir().unwrap();
    let conf = write_config(cfg_dir.path(), &s3, None);
    let mut a = Daemon::start_with(&["--config".into(), conf.clone()], &[]);
    // The object store is down: offloads succeed on G3, uploads cannot.
    s3.kill();
    let (keys, data) = offload(&a, 6, 3);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(g4_stat(&a, "uploads_stored"), 0.0);
    // The daemon dies with its upload jobs; the store comes back.
    a.kill9();
    s3.restart().unwrap();
    a.restart();
    // At start the node re-queues every block not yet marked safe in G4.
    wait_metric(
        &a,
        "kvtier_g4_uploads_total",
        &[("outcome", "stored")],
        3.0,
        Duration::from_secs(30),
    );
    let b = Daemon::start_with(&["--config".into(), conf], &[]);
    assert_eq!(onboard_verified(&b, &keys, &data), vec![Tier::G4; 3]);
}

/// Unmounts (lazily) on drop, after the daemon it guards is killed.
struct Umount(std::path::PathBuf);

impl Drop for Umount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .stderr(std::process::Stdio::null())
            .status();
    }
}

#[test]
fn mount_reads_fall_through_to_g4() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root || !Path::new("/dev/fuse").exists() {
        eprintln!("SKIP: mount_reads_fall_through_to_g4: needs root and /dev/fuse");
        return;
    }
    let mnt_parent = tempfile::tempdir().unwrap();
    let mnt = mnt_parent.path().join("mnt");
    let _umount = Umount(mnt.clone());
    // The embedded default's local file:// G4 beside G3.
    let d = Daemon::start_with(&["--mount".into(), mnt.display().to_string()], &[]);
    let t = Instant::now();
    while !std::fs::read_to_string("/proc/self/mounts")
        .unwrap()
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some(mnt.to_str().unwrap()))
    {
        assert!(t.elapsed() < Duration::from_secs(20), "no mount");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (keys, data) = offload(&d, 7, 2);
    // The chain's leaf: evicting its root would take the leaf along, and
    // leave G3 no block of the namespace (the mount lists a namespace's
    // directory while G3 holds a block of it).
    let g4_file = d
        .dir
        .path()
        .join("g4/blocks")
        .join(kvtier_client::block_path(&ns().id(), &keys[1]));
    let t = Instant::now();
    while !g4_file.exists() {
        assert!(t.elapsed() < Duration::from_secs(20), "not uploaded to G4");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200)); // the in_g4 mark
    client(&d).namespace(&ns()).evict(&keys[1..]).unwrap();
    // Not on G3 any more: a plain read of the mount's file fetches it from
    // G4 (verified), promotes it, and serves the block file.
    let file = std::fs::read(mnt.join(kvtier_client::block_path(&ns().id(), &keys[1]))).unwrap();
    let h = kvtier_client::BlockHeader::decode(&file[..4096]).unwrap();
    assert_eq!(h.key, keys[1]);
    assert!(file[4096..4096 + BLOCK] == data[1][..], "bytes differ");
    assert_eq!(
        metric(&d.scrape(), "kvtier_promotions_total", &[("source", "g4")]),
        1.0
    );
}

#[test]
fn bench_prefetch_json_contract() {
    if support::find_weed_for_tests().is_none() {
        eprintln!("SKIP: bench_prefetch_json_contract: .venv/bin/weed not found");
        return;
    }
    support::kvtierd_bin();
    let out = std::process::Command::new(support::bin("kvtier-tools", "kvtier"))
        .args([
            "bench",
            "prefetch",
            "--prefetch-blocks",
            "4",
            "--foreground-blocks",
            "4",
            "--block-size",
            "64KiB",
            "--rounds",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    let j: serde_json::Value = support::json_stdout(&out);
    assert_eq!(j["bench"], "prefetch");
    assert!(j["onboard_gbps"].as_f64().unwrap() > 0.0);
    assert!(j["onboard_gbps_baseline"].as_f64().unwrap() > 0.0);
    assert!(j["onboard_gbps_vs_baseline"].is_number());
    assert!(j["prefetch_complete_s"].as_f64().unwrap() > 0.0);
    let vs: Vec<&String> = j
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| k.contains("vs_baseline"))
        .collect();
    assert_eq!(
        vs,
        ["onboard_gbps_vs_baseline"],
        "only the quotient of rates"
    );
}
