//! An fd (`direct_read`) onboard whose blocks the daemon cannot pass as
//! files for a storage failure (a failing G3 disk, or a block fetched from
//! a peer or G4 that a full G3 could not take) asks for exactly those
//! blocks once more through the shared region, where the daemon serves
//! another tier's verified copy: against an in-process fake daemon
//! speaking the real protocol on a real socket. A block the daemon says is
//! absent or corrupt is not asked for again.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/fake_daemon.rs"]
mod fake_daemon;
use fake_daemon::{hello, key_u64, ns, onboard_result, BLOCK};

use kvtier_client::block::HEADER_BYTES;
use kvtier_client::proto::{self, ItemStatus, OnboardMode, Request, Response};
use kvtier_client::{BlockHeader, BlockKey, Client, ClientConfig, MissCause, Onboarded};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;

fn payload(key: u64) -> Vec<u8> {
    (0..BLOCK).map(|i| (key as usize * 17 + i) as u8).collect()
}

/// What the fd path answers for a key (the region path serves every key).
fn fd_status(k: u64) -> ItemStatus {
    match k % 4 {
        0 => ItemStatus::Failed,
        1 => ItemStatus::NoSpace,
        2 => ItemStatus::Absent,
        _ => ItemStatus::Corrupt,
    }
}

/// Serves one connection; the keys of each onboard request, by mode.
fn fake_daemon(l: UnixListener) -> Vec<(bool, Vec<u64>)> {
    let (s, _) = l.accept().unwrap();
    let fd = s.as_raw_fd();
    let mut fds = Vec::new();
    let region = hello(fd, &mut fds).unwrap();
    let mut seen = Vec::new();
    loop {
        let Ok(body) = proto::recv_frame(fd, &mut fds) else {
            return seen;
        };
        let (id, req) = Request::decode(&body).unwrap();
        let Request::Onboard { items, mode, .. } = req else {
            // The corrupt report the client sends for nothing here: the
            // daemon reported Corrupt itself, so the client has no bytes.
            panic!("unexpected request {req:?}");
        };
        let direct = mode == OnboardMode::DirectFd;
        seen.push((direct, items.iter().map(|it| key_u64(&it.key)).collect()));
        let out = items
            .iter()
            .map(|it| {
                let k = key_u64(&it.key);
                let h = BlockHeader::for_payload(&ns(), it.key, &payload(k), 1);
                let status = if direct {
                    fd_status(k)
                } else {
                    let mut hb = [0u8; HEADER_BYTES];
                    h.encode_into(&mut hb);
                    region.write(it.shm_offset, &hb);
                    region.write(it.shm_offset + HEADER_BYTES as u64, &payload(k));
                    ItemStatus::Ok
                };
                onboard_result(status, kvtier_client::Tier::G4, &h)
            })
            .collect();
        let r = Response::Onboard { items: out };
        proto::send_frame(fd, &r.encode(proto::OP_ONBOARD, id), &[]).unwrap();
    }
}

#[test]
fn fd_onboard_storage_misses_are_asked_for_again_through_the_region() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s");
    let l = UnixListener::bind(&sock).unwrap();
    let t = std::thread::spawn(move || fake_daemon(l));
    let mut cfg = ClientConfig::new(&sock);
    cfg.direct_read = true;
    cfg.timeout_ms = 10_000;
    let c = Client::with_config(cfg);
    let n = 12u64;
    let keys: Vec<BlockKey> = (0..n).map(BlockKey::from_u64).collect();
    let mut bufs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; BLOCK]).collect();
    let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = c.namespace(&ns()).onboard_into(&keys, &mut views);
    drop(c);
    let seen = t.join().unwrap();
    for (k, (o, b)) in got.iter().zip(&bufs).enumerate() {
        let k = k as u64;
        match fd_status(k) {
            ItemStatus::Failed | ItemStatus::NoSpace => {
                assert!(matches!(o, Onboarded::Hit { .. }), "block {k}: {o:?}");
                assert!(*b == payload(k), "block {k} landed wrong bytes");
            }
            ItemStatus::Absent => {
                assert!(
                    matches!(o, Onboarded::Miss(m) if m.cause == MissCause::Absent),
                    "block {k}: {o:?}"
                )
            }
            _ => {
                assert!(
                    matches!(o, Onboarded::Miss(m) if m.cause == MissCause::Corrupt),
                    "block {k}: {o:?}"
                )
            }
        }
    }
    let retried: Vec<u64> = (0..n).filter(|k| k % 4 < 2).collect();
    assert_eq!(
        seen,
        vec![(true, (0..n).collect()), (false, retried)],
        "one fd request, then the storage misses once through the region"
    );
}
