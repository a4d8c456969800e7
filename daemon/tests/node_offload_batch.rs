#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `Backend::offload_batch` on the real node (G3 in a temp dir, no G4):
//! per-item outcomes of one request (a block past a refused one is refused
//! for its parent), `Stored` events in input order with their parents, the
//! chain found by lookup, and the same outcomes as the node's own
//! one-at-a-time offloads and, up to the first refused block, as the
//! one-at-a-time default on `MemBackend` (which reports a bad checksum as
//! a format error where G3 says invalid input: both answer `Invalid`;
//! it keeps no chains, so it stores the blocks past it).
//! And the onboard side through a real server: a request's block reads run
//! together, and a damaged or absent block is a miss in its place.

use kvtier_client::block::HEADER_BYTES;
use kvtier_client::events::{KvEventData, StorageTier};
use kvtier_client::proto::{BlockStat, ListEntry};
use kvtier_client::{
    BlockHeader, BlockKey, Client, ClientConfig, Hints, KvLayout, MissCause, Namespace,
    NamespaceId, Onboarded, Tier,
};
use kvtier_daemon::base::backend::{
    Backend, BackendStats, EvictOutcome, LeaseId, OffloadBlock, ReadFile,
};
use kvtier_daemon::base::events::EventBus;
use kvtier_daemon::base::tier::{Lookup, MissReason, PutOutcome};
use kvtier_daemon::edges::metrics::Metrics;
use kvtier_daemon::edges::server::{Server, ServerLimits, SocketOptions};
use kvtier_daemon::node::{Node, NodeConfig};
use kvtier_daemon::testkit::mem_backend::{MemBackend, MemLimits};
use kvtier_daemon::tiers::g3::G3Config;
use kvtier_daemon::Error;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const BLOCK: u64 = 16 << 10;

fn ns() -> Namespace {
    Namespace::new(
        "node-batch",
        KvLayout::with_block_bytes(BLOCK).unwrap(),
        "",
        "t",
    )
    .unwrap()
}

fn block(i: u64) -> (BlockHeader, Vec<u8>) {
    let payload: Vec<u8> = (0..BLOCK).map(|j| (j * 5 + i * 11) as u8).collect();
    let h = BlockHeader::for_payload(&ns(), BlockKey::from_u64(500 + i), &payload, 1);
    (h, payload)
}

/// A chain of `n` blocks as one request; item 3's payload is damaged (its
/// checksum no longer matches its header).
fn request(blocks: &[(BlockHeader, Vec<u8>)], bad: &[u8]) -> Vec<OffloadBlock<'static>> {
    let leak = |v: &[u8]| -> &'static [u8] { Box::leak(v.to_vec().into_boxed_slice()) };
    blocks
        .iter()
        .enumerate()
        .map(|(i, (h, p))| OffloadBlock {
            header: h.clone(),
            payload: if i == 3 { leak(bad) } else { leak(p) },
            parent: i.checked_sub(1).map(|j| blocks[j].0.key),
            hints: Hints::default(),
        })
        .collect()
}

fn outcomes(r: &[kvtier_daemon::Result<PutOutcome>]) -> Vec<String> {
    r.iter()
        .map(|o| match o {
            Ok(o) => format!("{o:?}"),
            Err(Error::InvalidInput { .. } | Error::Client(_)) => "invalid".into(),
            Err(Error::ParentAbsent { .. }) => "parent absent".into(),
            Err(e) => panic!("{e:?}"),
        })
        .collect()
}

#[test]
fn node_batch_is_ordered_and_fails_per_item_like_the_default() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::open(NodeConfig::new(G3Config::new(
        dir.path().join("g3"),
        64 << 20,
    )))
    .unwrap();
    let bus = EventBus::new();
    let sub = bus.subscribe().unwrap();
    node.attach_events(bus);
    let id = ns().id();
    let blocks: Vec<_> = (0..10).map(block).collect();
    let mut bad = blocks[3].1.clone();
    bad[9] ^= 0x10;
    // Block 0 is stored beforehand: present in the batch.
    let (h0, p0) = &blocks[0];
    assert_eq!(
        node.offload(&id, h0, p0, None, Hints::default()).unwrap(),
        PutOutcome::Stored
    );
    let first = sub.rx.recv().unwrap();
    assert!(matches!(first.data, KvEventData::Stored { .. }));

    let req = request(&blocks, &bad);
    let got = outcomes(&node.offload_batch(&id, &req));
    // The chain breaks at the damaged block 3: every block after it
    // continues a block G3 does not hold, so none is stored (no lookup
    // could reach it).
    let mut want: Vec<String> = (0..10).map(|_| "parent absent".to_string()).collect();
    want[0] = "AlreadyPresent".into();
    want[1] = "Stored".into();
    want[2] = "Stored".into();
    want[3] = "invalid".into();
    assert_eq!(got, want);

    // Events: one Stored per stored block, in input order, with parents.
    let mut seen = Vec::new();
    while let Ok(ev) = sub.rx.try_recv() {
        assert_eq!(ev.storage_tier, StorageTier::Disk);
        match &ev.data {
            KvEventData::Stored {
                parent_hash,
                blocks,
            } => {
                for b in blocks {
                    seen.push((*parent_hash, b.block_hash));
                }
            }
            other => panic!("{other:?}"),
        }
    }
    let expect: Vec<(Option<BlockKey>, BlockKey)> = (1..3usize)
        .map(|i| (Some(blocks[i - 1].0.key), blocks[i].0.key))
        .collect();
    assert_eq!(seen, expect);
    let chain: Vec<BlockKey> = blocks.iter().map(|b| b.0.key).collect();
    assert_eq!(node.lookup(&id, &chain).unwrap(), vec![Tier::G3; 3]);
    for b in &blocks[4..] {
        assert!(node.stat(&id, &b.0.key).unwrap().is_none());
    }

    // The node one block at a time answers the same.
    let one_dir = tempfile::tempdir().unwrap();
    let one = Node::open(NodeConfig::new(G3Config::new(
        one_dir.path().join("g3"),
        64 << 20,
    )))
    .unwrap();
    one.offload(&id, h0, p0, None, Hints::default()).unwrap();
    let singly: Vec<_> = req
        .iter()
        .map(|b| one.offload(&id, &b.header, b.payload, b.parent, b.hints))
        .collect();
    assert_eq!(outcomes(&singly), want);

    // The default (one at a time) on MemBackend answers the same up to
    // the damaged block.
    let mem = MemBackend::new(MemLimits::default(), dir.path().join("spill"));
    mem.offload(&id, h0, p0, None, Hints::default()).unwrap();
    assert_eq!(outcomes(&mem.offload_batch(&id, &req))[..4], want[..4]);
}

/// The node behind a gate that holds every `read_into` until `want` of
/// them are in flight at once (or a generous bound passed, so a server
/// that reads one block after another fails here instead of hanging).
struct Gate {
    node: Arc<Node>,
    want: usize,
    state: Mutex<(usize, usize)>, // (in flight now, most at once)
    cv: Condvar,
}

impl Gate {
    fn most_at_once(&self) -> usize {
        self.state.lock().unwrap().1
    }
}

impl Backend for Gate {
    fn name(&self) -> &'static str {
        "gate"
    }
    fn lookup(&self, ns: &NamespaceId, chain: &[BlockKey]) -> kvtier_daemon::Result<Vec<Tier>> {
        self.node.lookup(ns, chain)
    }
    fn offload(
        &self,
        ns: &NamespaceId,
        header: &BlockHeader,
        payload: &[u8],
        parent: Option<BlockKey>,
        hints: Hints,
    ) -> kvtier_daemon::Result<PutOutcome> {
        self.node.offload(ns, header, payload, parent, hints)
    }
    fn read_into(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        dst: &mut [u8],
    ) -> kvtier_daemon::Result<Lookup<(BlockHeader, Tier)>> {
        {
            let mut s = self.state.lock().unwrap();
            s.0 += 1;
            s.1 = s.1.max(s.0);
            self.cv.notify_all();
            let bound = Instant::now() + Duration::from_secs(3);
            while s.1 < self.want && Instant::now() < bound {
                s = self
                    .cv
                    .wait_timeout(s, Duration::from_millis(100))
                    .unwrap()
                    .0;
            }
        }
        let r = self.node.read_into(ns, key, dst);
        self.state.lock().unwrap().0 -= 1;
        r
    }
    fn prepare_onboard(&self, ns: &NamespaceId, keys: &[BlockKey]) -> Vec<Option<MissReason>> {
        self.node.prepare_onboard(ns, keys)
    }
    fn open_for_read(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
    ) -> kvtier_daemon::Result<Lookup<ReadFile>> {
        self.node.open_for_read(ns, key)
    }
    fn lease(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        ttl_ms: u32,
    ) -> kvtier_daemon::Result<Lookup<LeaseId>> {
        self.node.lease(ns, key, ttl_ms)
    }
    fn release(&self, lease: LeaseId) -> bool {
        self.node.release(lease)
    }
    fn pin(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        ttl_ms: u32,
    ) -> kvtier_daemon::Result<Lookup<()>> {
        self.node.pin(ns, key, ttl_ms)
    }
    fn unpin(&self, ns: &NamespaceId, key: &BlockKey) -> kvtier_daemon::Result<bool> {
        self.node.unpin(ns, key)
    }
    fn evict(&self, ns: &NamespaceId, key: &BlockKey) -> kvtier_daemon::Result<EvictOutcome> {
        self.node.evict(ns, key)
    }
    fn stat(&self, ns: &NamespaceId, key: &BlockKey) -> kvtier_daemon::Result<Option<BlockStat>> {
        self.node.stat(ns, key)
    }
    fn list(
        &self,
        ns: Option<NamespaceId>,
        after: Option<(NamespaceId, BlockKey)>,
        limit: usize,
    ) -> kvtier_daemon::Result<Vec<ListEntry>> {
        self.node.list(ns, after, limit)
    }
    fn stats(&self) -> BackendStats {
        self.node.stats()
    }
    fn attach_events(&self, bus: EventBus) {
        self.node.attach_events(bus)
    }
    fn flush(&self) -> kvtier_daemon::Result<()> {
        self.node.flush()
    }
}

/// The payload of block `i` of the onboard test (distinct per block).
fn onboard_payload(i: usize) -> Vec<u8> {
    (0..BLOCK as usize)
        .map(|j| (j * 3 + i * 29 + 1) as u8)
        .collect()
}

/// A node on `dir` holding the onboard tests' blocks 0..8 but 5 (never
/// stored), block `i` with payload `onboard_payload(i)`: the node, the
/// namespace, the 8 keys and the 8 payloads.
fn onboard_node(dir: &std::path::Path) -> (Arc<Node>, Namespace, Vec<BlockKey>, Vec<Vec<u8>>) {
    let node = Node::open(NodeConfig::new(G3Config::new(dir.join("g3"), 64 << 20))).unwrap();
    let ns = ns();
    let id = ns.id();
    let keys: Vec<BlockKey> = (0..8).map(|i| BlockKey::from_u64(9000 + i)).collect();
    let data: Vec<Vec<u8>> = (0..8).map(onboard_payload).collect();
    for i in (0..8).filter(|&i| i != 5) {
        let h = BlockHeader::for_payload(&ns, keys[i], &data[i], 1);
        let stored = node.offload(&id, &h, &data[i], None, Hints::default());
        assert_eq!(stored.unwrap(), PutOutcome::Stored);
    }
    (node, ns, keys, data)
}

/// A server on `sock` over `backend`: its stop trigger and its thread.
fn serve(
    sock: &std::path::Path,
    backend: Arc<dyn Backend>,
    limits: ServerLimits,
) -> (
    kvtier_daemon::edges::server::ShutdownHandle,
    std::thread::JoinHandle<kvtier_daemon::Result<()>>,
) {
    let server = Server::bind(
        &SocketOptions {
            path: sock.to_path_buf(),
            mode: 0o600,
            group: None,
        },
        backend,
        Metrics::new().unwrap(),
        EventBus::new(),
        limits,
    )
    .unwrap();
    let stop = server.shutdown_handle();
    (stop, std::thread::spawn(move || server.run()))
}

/// One onboard request of 8 blocks through a real server and client over
/// its socket, on the real node (G3): the request's reads are in flight
/// together (the gate sees 6 at once: one by one it would see 1), and the
/// outcomes are per item and in place: block 2's file is damaged (a miss,
/// quarantined, the others served with their exact bytes), block 5 was
/// never stored (a miss known before any read).
#[test]
fn an_onboard_request_reads_its_blocks_together_and_misses_stay_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let (node, ns, keys, data) = onboard_node(dir.path());
    // Damage block 2's payload on disk.
    damage_file_of(&dir.path().join("g3"), &data[2], HEADER_BYTES + 100);

    let gate = Arc::new(Gate {
        node,
        want: 6,
        state: Mutex::new((0, 0)),
        cv: Condvar::new(),
    });
    let sock = dir.path().join("kvtierd.sock");
    let (stop, serving) = serve(&sock, gate.clone(), ServerLimits::default());

    let mut cfg = ClientConfig::new(&sock);
    // Longer than the gate's bound times the reads, so a server reading
    // one by one fails on the assertions below, not on a client timeout.
    cfg.timeout_ms = 60_000;
    let client = Client::with_config(cfg);
    let h = client.namespace(&ns);
    let mut bufs: Vec<Vec<u8>> = (0..8).map(|_| vec![0u8; BLOCK as usize]).collect();
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = h.onboard_into(&keys, &mut dst);
    stop.trigger();
    serving.join().unwrap().unwrap();

    let hits: Vec<bool> = got.iter().map(|o| o.is_hit()).collect();
    let mut want = vec![true; 8];
    want[2] = false;
    want[5] = false;
    assert_eq!(hits, want, "{got:?}");
    assert!(
        matches!(&got[2], Onboarded::Miss(m) if m.cause == MissCause::Corrupt),
        "{:?}",
        got[2]
    );
    for i in (0..8).filter(|&i| want[i]) {
        assert!(bufs[i] == data[i], "block {i}: wrong bytes");
    }
    // 7 reads (block 5 is known absent before reading), 6 of them at once.
    assert!(
        gate.most_at_once() >= 6,
        "the request's reads ran one by one ({} at most at once)",
        gate.most_at_once()
    );
}

/// The same request with the node served directly: G3's slotted hits are
/// read as one batch on the connection's thread (g3/read_batch.rs), and
/// the outcomes and bytes are those of the per-block path
/// (`server.onboard_batch_reads = false`): the damaged block 2 is left to
/// the usual read (a miss, quarantined), block 5 is absent.
#[test]
fn an_onboard_request_batch_reads_slotted_hits_with_the_per_block_outcomes() {
    for batch in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let (node, ns, keys, data) = onboard_node(dir.path());
        // Its header: the batch's own check refuses it.
        damage_file_of(&dir.path().join("g3"), &data[2], 100);
        let sock = dir.path().join("kvtierd.sock");
        let (stop, serving) = serve(
            &sock,
            node.clone(),
            ServerLimits {
                onboard_batch_reads: batch,
                ..ServerLimits::default()
            },
        );
        let client = Client::with_config(ClientConfig::new(&sock));
        let h = client.namespace(&ns);
        let mut bufs: Vec<Vec<u8>> = (0..8).map(|_| vec![0u8; BLOCK as usize]).collect();
        let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let got = h.onboard_into(&keys, &mut dst);
        stop.trigger();
        serving.join().unwrap().unwrap();
        let hits: Vec<bool> = got.iter().map(|o| o.is_hit()).collect();
        let mut want = vec![true; 8];
        want[2] = false;
        want[5] = false;
        assert_eq!(hits, want, "batch {batch}: {got:?}");
        assert!(
            matches!(&got[2], Onboarded::Miss(m) if m.cause == MissCause::Corrupt),
            "batch {batch}: {:?}",
            got[2]
        );
        for i in (0..8).filter(|&i| want[i]) {
            assert!(bufs[i] == data[i], "batch {batch}: block {i}: wrong bytes");
        }
        let batched = node
            .g3()
            .recovery_figures()
            .into_iter()
            .find(|(k, _)| *k == "batch_reads")
            .map(|(_, v)| v);
        assert_eq!(batched, Some(if batch { 6 } else { 0 }), "batch {batch}");
        assert_eq!(node.g3().stats().quarantined, 1, "batch {batch}");
    }
}

/// Damages one byte of the block whose payload is `payload`, at `at` from
/// the block's start (the header is its first 4096 bytes): a block file,
/// or a slot of a slab (g3/slots.rs), found at any 4096-byte boundary.
fn damage_file_of(root: &std::path::Path, payload: &[u8], at: usize) {
    let mut damaged = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(mut b) = std::fs::read(&p) {
                let mut o = 0;
                while o + HEADER_BYTES + payload.len() <= b.len() {
                    if b[o + HEADER_BYTES..o + HEADER_BYTES + payload.len()] == payload[..] {
                        b[o + at] ^= 0x40;
                        std::fs::write(&p, &b).unwrap();
                        damaged += 1;
                        break;
                    }
                    o += 4096;
                }
            }
        }
    }
    assert_eq!(damaged, 1, "the block's file not found under {root:?}");
}

/// With leases, the reads gathered so far run before an item whose lease
/// the connection's limit refuses: a failed read gives its lease back
/// first, as when items were read one by one. 4 direct-fd items, at most
/// 3 leases per connection, the first block's header damaged (its lease is
/// taken, its open fails): the other 3 are all served and leased.
#[test]
fn a_failed_reads_lease_is_given_back_before_a_later_item_is_refused_for_the_limit() {
    use kvtier_client::proto::{ItemStatus, OnboardItem, OnboardMode, Request, Response};
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let node = Node::open(NodeConfig::new(G3Config::new(
        dir.path().join("g3"),
        64 << 20,
    )))
    .unwrap();
    let ns = ns();
    let id = ns.id();
    let keys: Vec<BlockKey> = (0..4).map(|i| BlockKey::from_u64(9100 + i)).collect();
    let data: Vec<Vec<u8>> = (0..4).map(|i| onboard_payload(40 + i)).collect();
    for i in 0..4 {
        let h = BlockHeader::for_payload(&ns, keys[i], &data[i], 1);
        let stored = node.offload(&id, &h, &data[i], None, Hints::default());
        assert_eq!(stored.unwrap(), PutOutcome::Stored);
    }
    damage_file_of(&dir.path().join("g3"), &data[0], 40);

    let sock = dir.path().join("kvtierd.sock");
    let server = Server::bind(
        &SocketOptions {
            path: sock.clone(),
            mode: 0o600,
            group: None,
        },
        node,
        Metrics::new().unwrap(),
        EventBus::new(),
        ServerLimits {
            leases_per_conn_max: 3,
            ..ServerLimits::default()
        },
    )
    .unwrap();
    let stop = server.shutdown_handle();
    let serving = std::thread::spawn(move || server.run());

    let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    // Passed fds are dropped by a plain read; only the reply matters.
    let mut call = |req: &Request, id: u32| -> Response {
        s.write_all(&req.encode(id)).unwrap();
        let mut len = [0u8; 4];
        s.read_exact(&mut len).unwrap();
        let mut b = vec![0u8; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut b).unwrap();
        Response::decode(&b, req.op()).unwrap().1
    };
    let hello = Request::Hello {
        shm_bytes: 0,
        pid: std::process::id(),
        features: 0,
    };
    assert!(matches!(call(&hello, 1), Response::Hello { .. }));
    let onboard = Request::Onboard {
        ns: id,
        mode: OnboardMode::DirectFd,
        lease_ttl_ms: 30_000,
        items: keys
            .iter()
            .map(|k| OnboardItem {
                key: *k,
                shm_offset: 0,
                shm_len: 0,
            })
            .collect(),
    };
    let Response::Onboard { items } = call(&onboard, 2) else {
        panic!("onboard reply")
    };
    stop.trigger();
    let status: Vec<ItemStatus> = items.iter().map(|r| r.status).collect();
    assert_eq!(
        status,
        vec![
            ItemStatus::Corrupt,
            ItemStatus::Ok,
            ItemStatus::Ok,
            ItemStatus::Ok
        ]
    );
    assert_eq!(items[0].lease_id, 0, "the failed item keeps no lease");
    assert!(items[1..].iter().all(|r| r.lease_id != 0));
    // fd indexes follow the request order of the served items.
    let fds: Vec<u32> = items[1..].iter().map(|r| r.fd_index).collect();
    assert_eq!(fds, vec![0, 1, 2]);
    drop(s);
    serving.join().unwrap().unwrap();
}
