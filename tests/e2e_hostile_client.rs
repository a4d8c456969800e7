//! End-to-end: a hostile client against a real `kvtierd`. The client speaks
//! the wire protocol itself and keeps rewriting its shared region while
//! the daemon copies out of it (offload) or into it (onboard). The daemon
//! must hash and verify only its own copies: no block it acks may fail its
//! checksum on read-back, and no good block may be quarantined because a
//! client scribbled over the region it was being read into.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kvtier_client::block::HEADER_BYTES;
use kvtier_client::proto::{
    self, ItemStatus, OffloadItem, OnboardItem, OnboardMode, Request, Response,
};
use kvtier_client::shm::Region;
use kvtier_client::{
    BlockHeader, BlockKey, Client, ClientConfig, Hints, KvLayout, Namespace, OffloadOutcome,
};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use support::{metric, Daemon};

/// Over one 1 MiB request, so copies take a while and span chunks.
const BLOCK: usize = 2 << 20;
const SLOT: u64 = (HEADER_BYTES + BLOCK) as u64;
const BLOCKS: usize = 6;

fn ns() -> Namespace {
    Namespace::new(
        "hostile-model",
        KvLayout::with_block_bytes(BLOCK as u64).unwrap(),
        "",
        "h",
    )
    .unwrap()
}

fn payload(round: usize, i: usize) -> Vec<u8> {
    let mut v = vec![0u8; BLOCK];
    let mut x = (round as u64) << 32 | i as u64 | 1;
    for c in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    v
}

/// A raw protocol connection with its shared region.
struct Raw {
    sock: UnixStream,
    region: Arc<Region>,
    next: u32,
}

impl Raw {
    fn connect(socket: &std::path::Path, region_bytes: u64) -> Raw {
        let sock = UnixStream::connect(socket).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let region = Arc::new(Region::create(region_bytes).unwrap());
        // As kvtier-client does before the daemon writes a range: the
        // daemon refuses (Invalid) to fault in pages the client did not
        // populate, so that they are charged to the client's cgroup.
        assert!(region.populate(0, region.len()));
        let mut r = Raw {
            sock,
            region,
            next: 1,
        };
        let hello = Request::Hello {
            shm_bytes: r.region.len() as u64,
            pid: std::process::id(),
            features: 0,
        };
        let fd = r.region.fd().as_raw_fd();
        match r.call(&hello, &[fd]) {
            Response::Hello { .. } => {}
            other => panic!("hello: {other:?}"),
        }
        r
    }

    fn call(&mut self, req: &Request, fds: &[i32]) -> Response {
        let id = self.next;
        self.next += 1;
        proto::send_frame(self.sock.as_raw_fd(), &req.encode(id), fds).unwrap();
        let mut got: Vec<OwnedFd> = Vec::new();
        let body = proto::recv_frame(self.sock.as_raw_fd(), &mut got)
            .unwrap_or_else(|e| panic!("reply: {e:?}"));
        let (rid, resp) = Response::decode(&body, req.op()).unwrap();
        assert_eq!(rid, id);
        resp
    }
}

/// Flips a byte in every 64 KiB of every payload slot of `region`, holds
/// it a moment, and puts it back, until stopped. The region is right most
/// of the time, so a daemon that copies and hashes at two different moments
/// can hash good bytes and write bad ones (or read good bytes and verify
/// bad ones).
/// Returns once the scribbler has made one pass: on 2 busy cores a thread
/// started just before a call could otherwise first run after the reply
/// (a clean-clone run saw a round with no scribble at all).
fn scribbler(
    region: Arc<Region>,
    stop: Arc<AtomicBool>,
    slots: usize,
) -> std::thread::JoinHandle<u64> {
    let running = Arc::new(AtomicBool::new(false));
    let up = Arc::clone(&running);
    let t = std::thread::spawn(move || {
        let mut n = 0u64;
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        // Bad briefly (long enough to be caught by a copy), good for long
        // (long enough for a whole chunk to be hashed in between).
        while !stop.load(Ordering::Relaxed) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut at = Vec::new();
            for s in 0..slots {
                for w in (0..BLOCK).step_by(64 << 10) {
                    // Payload only: a torn header is refused before any copy.
                    at.push(s as u64 * SLOT + (HEADER_BYTES + w) as u64 + x % (64 << 10));
                }
            }
            for &a in &at {
                if let Some(b) = region.slice_mut(a, 1) {
                    // SAFETY: in bounds; volatile because the daemon reads
                    // it from another process.
                    unsafe { std::ptr::write_volatile(&mut b[0], b[0] ^ 0xff) };
                }
            }
            // Timings vary so that some land between a copy and a hash.
            std::thread::sleep(Duration::from_micros(20 + x % 400));
            for &a in &at {
                if let Some(b) = region.slice_mut(a, 1) {
                    // SAFETY: as above.
                    unsafe { std::ptr::write_volatile(&mut b[0], b[0] ^ 0xff) };
                }
            }
            n += 1;
            // Running: one whole scribble done, the next under way.
            up.store(true, Ordering::Release);
            std::thread::sleep(Duration::from_micros(200 + (x >> 20) % 2500));
        }
        n
    });
    while !running.load(Ordering::Acquire) {
        std::thread::yield_now();
    }
    t
}

fn good_client(socket: &std::path::Path, direct: bool) -> Client {
    let mut c = ClientConfig::new(socket);
    c.region_bytes = BLOCKS as u64 * SLOT;
    c.timeout_ms = 30_000;
    c.direct_read = direct;
    Client::with_config(c)
}

fn quarantined(d: &Daemon) -> f64 {
    metric(&d.scrape(), "kvtier_quarantined_total", &[])
}

/// Offload while the client rewrites the payloads: whatever the daemon
/// acks must read back intact (its checksum is that of the bytes written).
#[test]
fn client_rewriting_its_region_mid_offload_never_gets_a_corrupt_block_acked() {
    let d = Daemon::start();
    let ns = ns();
    let id = ns.id();
    let mut raw = Raw::connect(&d.socket, BLOCKS as u64 * SLOT);
    let mut acked: Vec<BlockKey> = Vec::new();
    let mut refused = 0usize;
    for round in 0..16 {
        let tokens: Vec<u32> = (0..(BLOCKS as u32 * 16))
            .map(|t| t + round * 100_000)
            .collect();
        let keys = ns.hash_chain(&tokens);
        let mut items = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            let p = payload(round as usize, i);
            let h = BlockHeader::for_payload(&ns, *k, &p, 1);
            let off = i as u64 * SLOT;
            assert!(raw.region.write(off, &h.encode()[..]));
            assert!(raw.region.write(off + HEADER_BYTES as u64, &p));
            items.push(OffloadItem {
                shm_offset: off,
                parent: None,
                hints: Hints::default(),
            });
        }
        let stop = Arc::new(AtomicBool::new(false));
        let t = scribbler(Arc::clone(&raw.region), Arc::clone(&stop), BLOCKS);
        let resp = raw.call(&Request::Offload { ns: id, items }, &[]);
        stop.store(true, Ordering::Relaxed);
        assert!(t.join().unwrap() > 0);
        let Response::Items { status } = resp else {
            panic!("offload reply {resp:?}")
        };
        for (k, s) in keys.iter().zip(status) {
            match s {
                ItemStatus::Ok => acked.push(*k),
                _ => refused += 1,
            }
        }
    }
    // The scribbler changes bytes while they are copied, so most blocks are
    // refused; the point is what was acked.
    eprintln!("acked {} refused {refused}", acked.len());
    for direct in [false, true] {
        let c = good_client(&d.socket, direct);
        let h = c.namespace(&ns);
        for k in &acked {
            let mut buf = vec![0u8; BLOCK];
            let r = h.onboard_into(&[*k], &mut [&mut buf[..]]);
            assert!(
                r[0].is_hit(),
                "acked block {k} reads as {:?} (direct={direct})",
                r[0]
            );
        }
    }
    assert_eq!(quarantined(&d), 0.0, "an acked block failed verification");
}

/// Onboard into a region the client keeps rewriting: every block stays
/// good (no quarantine), and a well-behaved client still reads them all.
#[test]
fn client_rewriting_its_region_mid_onboard_never_gets_a_good_block_quarantined() {
    let d = Daemon::start();
    let ns = ns();
    let id = ns.id();
    let good = good_client(&d.socket, false);
    let h = good.namespace(&ns);
    let tokens: Vec<u32> = (0..(BLOCKS as u32 * 16)).collect();
    let keys = h.hash_chain(&tokens);
    let data: Vec<Vec<u8>> = (0..BLOCKS).map(|i| payload(99, i)).collect();
    let refs: Vec<&[u8]> = data.iter().map(|v| &v[..]).collect();
    let out = h.offload_chain(None, &keys, &refs, Hints::default());
    assert!(out.iter().all(|o| *o == OffloadOutcome::Stored), "{out:?}");

    let mut raw = Raw::connect(&d.socket, BLOCKS as u64 * SLOT);
    let stop = Arc::new(AtomicBool::new(false));
    let t = scribbler(Arc::clone(&raw.region), Arc::clone(&stop), BLOCKS);
    for _ in 0..20 {
        let items = keys
            .iter()
            .enumerate()
            .map(|(i, k)| OnboardItem {
                key: *k,
                shm_offset: i as u64 * SLOT,
                shm_len: SLOT,
            })
            .collect();
        let resp = raw.call(
            &Request::Onboard {
                ns: id,
                mode: OnboardMode::Shm,
                lease_ttl_ms: 0,
                items,
            },
            &[],
        );
        let Response::Onboard { items } = resp else {
            panic!("onboard reply {resp:?}")
        };
        for it in items {
            assert_eq!(
                it.status,
                ItemStatus::Ok,
                "a good block missed while the client scribbled"
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    assert!(t.join().unwrap() > 0);
    assert_eq!(quarantined(&d), 0.0, "a good block was quarantined");
    for (k, want) in keys.iter().zip(&data) {
        let mut buf = vec![0u8; BLOCK];
        let r = h.onboard_into(&[*k], &mut [&mut buf[..]]);
        assert!(r[0].is_hit(), "{:?}", r[0]);
        assert_eq!(&buf, want);
    }
}
