//! Promotions crash-tested through the node (issue #15; a module of
//! g3_fuse_power_loss.rs, sharing its test binary and rig): a real `Node`
//! whose G3 lives in `kvtier_fs::faultfs` (the real kernel, io_uring,
//! O_DIRECT, the production seam), whose G4 is the real test S3 server
//! (SeaweedFS) and whose peer is a real node A. Onboards of blocks only G4
//! or only A holds (single reads and batched `prepare_onboard`s) are
//! served from there and staged, and the
//! node's promotion workers `put_block` them into G3 in the background;
//! power is cut at a seeded FUSE operation among those writes. After the
//! survivor is mounted and the node reopened:
//! - every block a lookup answered G3 for before the cut (an acked
//!   promotion) is still G3 and reads back exactly from G3;
//! - no phantoms: every block G3 lists was promoted and reads exactly;
//! - nothing torn visible: nothing quarantined, `tmp/` empty;
//! - G4 still has every object it held (a promotion never touches it).
//!
//! Every read before and after the cut is the exact block or a miss.
//!
//! `KVTIER_NODE_POWER_LOSS_ITERS=N` (default 6; scripts/fault-suite.sh
//! runs more), `KVTIER_NODE_POWER_LOSS_SEED`. Needs root, /dev/fuse and
//! `weed` (else a SKIP line).

use super::faultfs::{self, Rig};
use kvtier_client::{AlignedBuf, BlockHeader, BlockKey, Namespace, Tier};
use kvtier_daemon::base::backend::Backend;
use kvtier_daemon::base::tier::{BlockTier, Lookup};
use kvtier_daemon::node::{Node, NodeConfig, PeerSetup};
use kvtier_daemon::testkit::conformance::{block, namespace};
use kvtier_daemon::testkit::s3::S3Server;
use kvtier_daemon::tiers::g3::G3Config;
use kvtier_daemon::tiers::g4::G4Store;
use kvtier_daemon::tiers::peer::{PeerConfig, PeerInfo};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

/// One namespace's blocks, in G4 or held only by the peer.
struct Set {
    ns: Namespace,
    blocks: Vec<(BlockKey, BlockHeader, Vec<u8>)>,
    in_g4: bool,
}

const SECRET: &[u8] = b"promotion-power-loss-secret-0123";

fn peer_setup(id: &str, peers: Vec<PeerInfo>) -> PeerSetup {
    PeerSetup {
        cfg: PeerConfig {
            enabled: true,
            bind: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            peers,
            discovery: false,
            secret_file: Some("/nonexistent/peer.secret".into()),
            ..Default::default()
        },
        node_id: id.into(),
        secret: SECRET.to_vec(),
        corrupt_responses_for_tests: false,
    }
}

fn env_u64(k: &str) -> Option<u64> {
    std::env::var(k).ok().and_then(|v| v.parse().ok())
}

/// The node under test: G3 in the rig's mount, G4 the test server, peer
/// `a` at `peer`.
fn open_node(rig: &Rig, server: &S3Server, peer: &str) -> Arc<Node> {
    let mut cfg = NodeConfig::new(G3Config::new(rig.mnt().join("g3"), 256 << 20));
    cfg.g4 = Some(server.g4_config("promotion-power-loss"));
    cfg.peer = Some(peer_setup(
        "b",
        vec![PeerInfo::new("a", peer.to_string()).unwrap()],
    ));
    Node::open(cfg).expect("open node")
}

/// Reads `key` through the node: the exact block or a miss, never wrong
/// bytes (`Err`). Returns the tier that served it; `Ok(Err(_))`: the
/// read failed with an error (allowed only while G3's disk is dead).
fn read_raw(node: &Node, set: &Set, i: usize) -> Result<Result<Option<Tier>, String>, String> {
    let (key, _, p) = &set.blocks[i];
    let mut buf = AlignedBuf::rounded(p.len() + 8192).unwrap();
    match node.read_into(&set.ns.id(), key, buf.as_mut_slice()) {
        Ok(Lookup::Hit((h, tier))) => {
            if h.key != *key || buf.as_slice()[4096..4096 + p.len()] != p[..] {
                return Err(format!("WRONG BYTES for {key} from {tier:?}"));
            }
            Ok(Ok(Some(tier)))
        }
        Ok(Lookup::Miss(_)) => Ok(Ok(None)),
        Err(e) => Ok(Err(format!("read of {key} failed (not a miss): {e}"))),
    }
}

/// [`read_raw`] with an error a failure.
fn read(node: &Node, set: &Set, i: usize) -> Result<Option<Tier>, String> {
    read_raw(node, set, i)?
}

/// [`read_raw`] while power may be lost: an error counts only once the
/// disk is dead (see the report: the node does not fall through to G4
/// when G3's read fails with EIO).
fn read_cut(
    node: &Node,
    set: &Set,
    i: usize,
    rig: &Rig,
    t: &mut Totals,
) -> Result<Option<Tier>, String> {
    match read_raw(node, set, i)? {
        Ok(r) => Ok(r),
        Err(e) if rig.fault.crashed() => {
            t.errors_on_dead_disk += 1;
            if t.first_dead_disk_error.is_empty() {
                t.first_dead_disk_error = e;
            }
            Ok(Some(Tier::G3))
        }
        Err(e) => Err(e),
    }
}

fn in_g3(node: &Node, set: &Set, key: &BlockKey) -> bool {
    node.lookup(&set.ns.id(), &[*key])
        .is_ok_and(|t| t.first() == Some(&Tier::G3))
}

#[derive(Debug, Default)]
struct Totals {
    onboards: u64,
    promoted: u64,
    promoted_from_peer: u64,
    /// Listed after recovery though not acked before the cut (the cut
    /// came between the directory fsync and the index entry): whole.
    durable_unacked: u64,
    acked: u64,
    lost_to_cut: u64,
    entries_dropped: u64,
    cuts_during_promotions: u64,
    /// Reads answered with an error (not a miss) after the cut.
    errors_on_dead_disk: u64,
    first_dead_disk_error: String,
}

fn iteration(
    server: &S3Server,
    peer: &str,
    g4: &G4Store,
    sets: &[Set],
    seed: u64,
    t: &mut Totals,
) -> Result<(), String> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut rig = Rig::new(seed, None);
    let node = open_node(&rig, server, peer);
    let total: usize = sets.iter().map(|s| s.blocks.len()).sum();
    let start = rig.fault.counters().ops;
    // About 8 FUSE operations per promoted block (create, writes, the
    // kernel's fsync, rename, directory fsync, redb pages).
    let cut = start + rng.random_range(0..(total as u64) * 8);
    rig.fault.set_crash_at(Some(cut));
    let mut order: Vec<(usize, usize)> = sets
        .iter()
        .enumerate()
        .flat_map(|(s, set)| (0..set.blocks.len()).map(move |i| (s, i)))
        .collect();
    order.shuffle(&mut rng);
    for chunk in order.chunks(3) {
        let (s0, _) = chunk[0];
        let same: Vec<usize> = chunk
            .iter()
            .filter(|(s, _)| *s == s0)
            .map(|(_, i)| *i)
            .collect();
        if same.len() > 1 && rng.random_bool(0.5) {
            // A batched onboard: fetched together, then read one by one.
            let keys: Vec<BlockKey> = same.iter().map(|i| sets[s0].blocks[*i].0).collect();
            let _ = node.prepare_onboard(&sets[s0].ns.id(), &keys);
        }
        for (s, i) in chunk {
            t.onboards += 1;
            if read_cut(&node, &sets[*s], *i, &rig, t)?.is_none() {
                return Err(format!(
                    "a block G4 holds missed before the cut (seed {seed})"
                ));
            }
        }
    }
    if !node.wait_promotions(Duration::from_secs(20)) {
        return Err("promotions did not finish within 20 s".into());
    }
    let figures = node.figures();
    t.promoted += figures.promoted_from_g4.count + figures.promoted_from_peer.count;
    t.promoted_from_peer += figures.promoted_from_peer.count;
    // Acked: a lookup answers G3 (the promotion's index entry is visible).
    let mut acked: Vec<(usize, usize)> = Vec::new();
    for (s, set) in sets.iter().enumerate() {
        for (i, (key, _, _)) in set.blocks.iter().enumerate() {
            if in_g3(&node, set, key) {
                acked.push((s, i));
            }
        }
    }
    if rig.fault.crashed() {
        t.cuts_during_promotions += 1;
    }
    t.acked += acked.len() as u64;
    t.lost_to_cut += (total - acked.len()) as u64;
    // Reads after the cut: G3 is a dead disk now; the exact block or a miss.
    for (s, i) in order.iter().take(4) {
        read_cut(&node, &sets[*s], *i, &rig, t)?;
    }
    let _ = node.shutdown(Duration::from_secs(2));
    stop(node)?;
    let c = rig.power_cycle();
    t.entries_dropped += c.entries_dropped;
    let node = open_node(&rig, server, peer);
    let fail = |what: String| format!("seed {seed} (cut at FUSE op {cut}): {what}");
    for (s, i) in &acked {
        let set = &sets[*s];
        let key = &set.blocks[*i].0;
        if !in_g3(&node, set, key) {
            return Err(fail(format!(
                "promoted block {key} was acked (lookup said G3) and is gone"
            )));
        }
        match read(&node, set, *i).map_err(&fail)? {
            Some(Tier::G3) => {}
            other => {
                return Err(fail(format!(
                    "acked block {key} served from {other:?}, not G3"
                )))
            }
        }
    }
    let acked: HashSet<BlockKey> = acked.iter().map(|(s, i)| sets[*s].blocks[*i].0).collect();
    for set in sets {
        let listed = node.g3().list(&set.ns.id(), None, 10_000);
        for key in listed {
            let Some(i) = set.blocks.iter().position(|b| b.0 == key) else {
                return Err(fail(format!("phantom block {key} in G3")));
            };
            if read(&node, set, i).map_err(&fail)? != Some(Tier::G3) {
                return Err(fail(format!("G3 lists {key} but does not serve it")));
            }
            // Unacked but durable (the cut came after the directory fsync,
            // before the index entry became visible) is allowed: whole.
            if !acked.contains(&key) {
                t.durable_unacked += 1;
            }
        }
        for (key, _, _) in set.blocks.iter().filter(|_| set.in_g4) {
            if !g4
                .contains(&set.ns.id(), key)
                .map_err(|e| fail(e.to_string()))?
            {
                return Err(fail(format!("G4 lost object {key}")));
            }
        }
    }
    let st = node.g3().stats();
    if st.quarantined > 0 {
        return Err(fail(format!(
            "{} quarantined: torn data visible",
            st.quarantined
        )));
    }
    let tmp = std::fs::read_dir(rig.mnt().join("g3").join("tmp"))
        .map(|d| d.count())
        .unwrap_or(0);
    if tmp > 0 {
        return Err(fail(format!("{tmp} temp files left after recovery")));
    }
    node.shutdown(Duration::from_secs(2))
        .map_err(|e| fail(format!("clean shutdown: {e}")))?;
    stop(node)?;
    Ok(())
}

/// Drops the node and waits until its G3 store is gone (background
/// threads of the node's runtime hold it a moment longer), so that no
/// file in the mount is open when it is unmounted.
fn stop(node: Arc<Node>) -> Result<(), String> {
    let g3 = Arc::downgrade(node.g3());
    drop(node);
    let t = std::time::Instant::now();
    while g3.strong_count() > 0 {
        if t.elapsed() > Duration::from_secs(10) {
            return Err(
                "the node's G3 store was still alive 10 s after the node was dropped".into(),
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

#[test]
fn promotions_through_the_node_survive_power_loss() {
    if !faultfs::can_mount("promotions_through_the_node_survive_power_loss") {
        return;
    }
    let Some(server) = S3Server::start("kvtier-promote-crash").unwrap() else {
        eprintln!("SKIP promotions_through_the_node_...: weed (SeaweedFS) not installed (scripts/setup.sh)");
        return;
    };
    let g4 = G4Store::open(server.g4_config("promotion-power-loss")).unwrap();
    // Small blocks (O_DSYNC path) and multi-MiB ones (fdatasync path).
    // The peer: a node holding blocks nobody else has.
    let da = tempfile::tempdir().unwrap();
    let mut ca = NodeConfig::new(G3Config::new(da.path().join("g3"), 64 << 20));
    ca.peer = Some(peer_setup("a", vec![]));
    let a = Node::open(ca).unwrap();
    let peer = a.peer_addr().unwrap().to_string();
    // Small blocks (O_DSYNC path) and multi-MiB ones (fdatasync path) in
    // G4; small ones only on the peer.
    let mk = |bytes: u64, salt: &str, n: u64, in_g4: bool| {
        let ns = namespace(bytes, salt).unwrap();
        let blocks: Vec<_> = (0..n).map(|i| block(&ns, 0x9000 + i)).collect();
        for (_, h, p) in &blocks {
            if in_g4 {
                g4.put(&ns.id(), h, p).unwrap();
            } else {
                a.offload(&ns.id(), h, p, None, kvtier_client::Hints::default())
                    .unwrap();
            }
        }
        Set { ns, blocks, in_g4 }
    };
    let sets = [
        mk(64 << 10, "promote-small", 8, true),
        mk(5 << 19, "promote-large", 3, true),
        mk(64 << 10, "promote-peer", 4, false),
    ];
    let n = env_u64("KVTIER_NODE_POWER_LOSS_ITERS").unwrap_or(6);
    let seed0 = env_u64("KVTIER_NODE_POWER_LOSS_SEED").unwrap_or(0x9a0e);
    let t0 = std::time::Instant::now();
    let mut t = Totals::default();
    for k in 0..n {
        let seed = seed0 + k;
        if let Err(e) = iteration(&server, &peer, &g4, &sets, seed, &mut t) {
            panic!("iteration {k} (replay: KVTIER_NODE_POWER_LOSS_SEED={seed} KVTIER_NODE_POWER_LOSS_ITERS=1): {e}");
        }
    }
    println!(
        "node promotion power loss: {n} iterations (seeds {seed0}..{}) in {:?}: {t:?}, blocks lost 0",
        seed0 + n,
        t0.elapsed()
    );
    println!("node promotion power loss: {n} passed, 0 failed");
    // The cut really landed among promotions, some acked and some not.
    if n >= 6 {
        assert!(
            t.cuts_during_promotions > 0
                && t.acked > 0
                && t.lost_to_cut > 0
                && t.promoted_from_peer > 0,
            "{t:?}"
        );
    }
    drop(a);
}
