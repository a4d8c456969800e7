//! An onboard larger than the shared region, against an in-process fake
//! daemon speaking the real protocol on a real socket: the client keeps two
//! requests in flight (the daemon can read the next part while the client
//! checks this one), the two never share region bytes, every block lands
//! where it belongs, and a block the client's check refuses is reported and
//! onboarded again in the same call.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvtier_client::block::HEADER_BYTES;
use kvtier_client::proto::{self, ItemStatus, Request, Response};
use kvtier_client::{BlockHeader, BlockKey, Client, ClientConfig, Onboarded};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;

#[path = "support/fake_daemon.rs"]
mod fake_daemon;
use fake_daemon::{hello, key_u64, ns, onboard_result, BLOCK};

const BLOCKS: u64 = 200;
/// The key whose first serving is corrupt (in the third request).
const BAD: u64 = 130;

fn payload(key: u64) -> Vec<u8> {
    (0..BLOCK).map(|i| (key as usize * 31 + i) as u8).collect()
}

/// What the fake saw.
#[derive(Debug, Default)]
struct Seen {
    onboards: usize,
    /// Onboard requests whose successor had arrived before their reply
    /// was sent.
    overlapped: usize,
    /// Region ranges of two requests in flight that overlapped.
    shared_ranges: usize,
    reported: Vec<u64>,
}

/// Whether a frame is readable on `fd` within `ms`.
fn readable(fd: i32, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut p, 1, ms) > 0 }
}

fn ranges(req: &Request) -> Vec<(u64, u64)> {
    match req {
        Request::Onboard { items, .. } => items
            .iter()
            .map(|it| (it.shm_offset, it.shm_offset + it.shm_len))
            .collect(),
        _ => Vec::new(),
    }
}

/// Serves one connection: hello, then every onboard with good blocks
/// (block `BAD` corrupt the first time), holding each reply until the
/// next request arrived or 2 s passed.
fn fake_daemon(l: UnixListener) -> Seen {
    let (s, _) = l.accept().unwrap();
    let fd = s.as_raw_fd();
    let mut fds = Vec::new();
    let region = hello(fd, &mut fds).unwrap();
    let mut seen = Seen::default();
    let mut served_bad = false;
    let mut queued: Option<(u32, Request)> = None;
    loop {
        let (id, req) = match queued.take() {
            Some(r) => r,
            None => {
                let Ok(body) = proto::recv_frame(fd, &mut fds) else {
                    return seen;
                };
                Request::decode(&body).unwrap()
            }
        };
        match req {
            Request::Onboard { ref items, .. } => {
                seen.onboards += 1;
                for it in items {
                    let k = key_u64(&it.key);
                    let good = payload(k);
                    let h = BlockHeader::for_payload(&ns(), it.key, &good, 1);
                    let mut hb = [0u8; HEADER_BYTES];
                    h.encode_into(&mut hb);
                    region.write(it.shm_offset, &hb);
                    let mut p = good.clone();
                    if k == BAD && !served_bad {
                        served_bad = true;
                        p[7] ^= 1;
                    }
                    region.write(it.shm_offset + HEADER_BYTES as u64, &p);
                }
                let out = items
                    .iter()
                    .map(|it| {
                        let k = key_u64(&it.key);
                        let h = BlockHeader::for_payload(&ns(), it.key, &payload(k), 1);
                        onboard_result(ItemStatus::Ok, kvtier_client::Tier::G3, &h)
                    })
                    .collect();
                // Hold the reply until the next request is here (a client
                // that waits for it never sends one: 2 s, then on).
                if readable(fd, 2000) {
                    if let Ok(body) = proto::recv_frame(fd, &mut fds) {
                        let next = Request::decode(&body).unwrap();
                        if matches!(next.1, Request::Onboard { .. }) {
                            seen.overlapped += 1;
                            let a = ranges(&req);
                            let b = ranges(&next.1);
                            seen.shared_ranges += a
                                .iter()
                                .filter(|x| b.iter().any(|y| x.0 < y.1 && y.0 < x.1))
                                .count();
                        }
                        queued = Some(next);
                    }
                }
                let r = Response::Onboard { items: out };
                proto::send_frame(fd, &r.encode(proto::OP_ONBOARD, id), &[]).unwrap();
            }
            Request::ReportCorrupt { keys, .. } => {
                seen.reported.extend(keys.iter().map(key_u64));
                let r = Response::Items {
                    status: keys.iter().map(|_| ItemStatus::Repaired).collect(),
                };
                proto::send_frame(fd, &r.encode(proto::OP_REPORT_CORRUPT, id), &[]).unwrap();
            }
            other => panic!("unexpected request {other:?}"),
        }
    }
}

#[test]
fn an_onboard_larger_than_the_region_keeps_two_requests_in_flight_in_separate_halves() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s");
    let l = UnixListener::bind(&sock).unwrap();
    let t = std::thread::spawn(move || fake_daemon(l));
    let mut cfg = ClientConfig::new(&sock);
    // 85 slots of 12 KiB: 200 blocks are five requests of 42 or fewer.
    cfg.region_bytes = 1 << 20;
    cfg.timeout_ms = 10_000;
    let c = Client::with_config(cfg);
    let keys: Vec<BlockKey> = (0..BLOCKS).map(BlockKey::from_u64).collect();
    let mut bufs: Vec<Vec<u8>> = (0..BLOCKS).map(|_| vec![0u8; BLOCK]).collect();
    let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = c.namespace(&ns()).onboard_into(&keys, &mut views);
    drop(c);
    let seen = t.join().unwrap();
    for (k, (o, b)) in got.iter().zip(&bufs).enumerate() {
        assert!(matches!(o, Onboarded::Hit { .. }), "block {k}: {o:?}");
        assert!(*b == payload(k as u64), "block {k} landed wrong bytes");
    }
    assert_eq!(seen.reported, vec![BAD], "{seen:?}");
    // Five requests of the pipeline, then the refused block once more.
    assert_eq!(seen.onboards, 6, "{seen:?}");
    // Every pipelined request but the last had its successor in flight.
    assert_eq!(seen.overlapped, 4, "{seen:?}");
    assert_eq!(seen.shared_ranges, 0, "{seen:?}");
}
