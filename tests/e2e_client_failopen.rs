//! The client against a hostile or stuck daemon (an in-process fake speaking
//! the real protocol on a real socket): corrupt bytes are a `Corrupt` miss,
//! a silent daemon is a `Timeout` miss within the deadline, never a hang.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvtier_client::block::HEADER_BYTES;
use kvtier_client::proto::{self, ItemStatus, OnboardResult, Request, Response};
use kvtier_client::{
    BlockHeader, BlockKey, Client, ClientConfig, KvLayout, MissCause, Namespace, Onboarded, Tier,
};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::time::{Duration, Instant};

#[path = "support/fake_daemon.rs"]
mod fake_daemon;
use fake_daemon::{hello, ns, BLOCK};

/// Serves one connection: hello, then answers every onboard with a block
/// whose payload is altered after its header was sealed (`corrupt`), or
/// never answers at all (`!corrupt`).
fn fake_daemon(l: UnixListener, corrupt: bool) {
    let (s, _) = l.accept().unwrap();
    let fd = s.as_raw_fd();
    let mut fds = Vec::new();
    let region = hello(fd, &mut fds).unwrap();
    loop {
        let Ok(body) = proto::recv_frame(fd, &mut fds) else {
            return;
        };
        let (id, req) = Request::decode(&body).unwrap();
        if !corrupt {
            std::thread::sleep(Duration::from_secs(3));
            return;
        }
        let Request::Onboard { items, .. } = req else {
            return;
        };
        let mut out = Vec::new();
        for it in items {
            let payload = vec![7u8; BLOCK];
            let h = BlockHeader::for_payload(&ns(), it.key, &payload, 1);
            let mut hb = [0u8; HEADER_BYTES];
            h.encode_into(&mut hb);
            region.write(it.shm_offset, &hb);
            let mut bad = payload.clone();
            bad[100] ^= 0x40; // one flipped bit
            region.write(it.shm_offset + HEADER_BYTES as u64, &bad);
            out.push(OnboardResult {
                status: ItemStatus::Ok,
                tier: Tier::G3,
                lease_id: 0,
                payload_len: h.payload_len,
                payload_sum: h.payload_sum,
                fd_index: u32::MAX,
                file_offset: 0,
            });
        }
        let r = Response::Onboard { items: out };
        proto::send_frame(fd, &r.encode(proto::OP_ONBOARD, id), &[]).unwrap();
    }
}

fn client(sock: &std::path::Path) -> Client {
    let mut c = ClientConfig::new(sock);
    c.region_bytes = 1 << 20;
    c.timeout_ms = 300;
    Client::with_config(c)
}

#[test]
fn corrupt_bytes_from_the_daemon_are_a_corrupt_miss() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s");
    let l = UnixListener::bind(&sock).unwrap();
    let t = std::thread::spawn(move || fake_daemon(l, true));
    let c = client(&sock);
    let mut buf = vec![0u8; BLOCK];
    let r = c
        .namespace(&ns())
        .onboard_into(&[BlockKey::from_u64(1)], &mut [&mut buf[..]]);
    assert!(
        matches!(&r[0], Onboarded::Miss(m) if m.cause == MissCause::Corrupt),
        "{r:?}"
    );
    drop(c);
    t.join().unwrap();
}

#[test]
fn a_silent_daemon_is_a_timeout_miss_within_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s");
    let l = UnixListener::bind(&sock).unwrap();
    let t = std::thread::spawn(move || fake_daemon(l, false));
    let c = client(&sock);
    let keys = [BlockKey::from_u64(1)];
    let start = Instant::now();
    let l = c.namespace(&ns()).lookup(&keys);
    let took = start.elapsed();
    assert_eq!(l.prefix_len(), 0);
    assert_eq!(l.miss.as_ref().unwrap().cause, MissCause::Timeout, "{l:?}");
    assert!(took < Duration::from_millis(1500), "{took:?}");
    // No daemon at all: Unavailable, at once.
    drop(t);
    let c = client(&dir.path().join("nobody"));
    let start = Instant::now();
    let l = c.namespace(&ns()).lookup(&keys);
    assert_eq!(l.miss.unwrap().cause, MissCause::Unavailable);
    assert!(start.elapsed() < Duration::from_millis(500));
}

/// A daemon that is gone is tried again on the next call, so one that
/// comes back is reached at once, inside the reconnect back-off (the vLLM,
/// SGLang and LMCache dead-daemon tests missed their first calls after a
/// fast restart). A daemon that is there but silent still backs off: no
/// call waits out its deadline again within the back-off.
#[test]
fn a_restarted_daemon_is_reached_at_once_and_a_hung_one_backs_off() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s");
    let mut cfg = ClientConfig::new(&sock);
    cfg.region_bytes = 1 << 20;
    cfg.timeout_ms = 300;
    cfg.reconnect_backoff_ms = 600_000;
    let c = Client::with_config(cfg);
    let key = [BlockKey::from_u64(1)];
    // Nothing at the path, then a socket file whose daemon is gone.
    let e = c.ensure_connected().unwrap_err().to_string();
    assert!(!e.contains("backoff"), "{e}");
    drop(UnixListener::bind(&sock).unwrap());
    let e = c.ensure_connected().unwrap_err().to_string();
    assert!(!e.contains("backoff"), "a gone daemon is tried again: {e}");
    // The daemon comes back: reached by the next call.
    std::fs::remove_file(&sock).unwrap();
    let l = UnixListener::bind(&sock).unwrap();
    let t = std::thread::spawn(move || fake_daemon(l, true));
    let mut buf = vec![0u8; BLOCK];
    let r = c.namespace(&ns()).onboard_into(&key, &mut [&mut buf[..]]);
    // The fake daemon answers with a corrupt block: reaching it is the point.
    assert!(
        matches!(&r[0], Onboarded::Miss(m) if m.cause == MissCause::Corrupt),
        "the restarted daemon was not reached: {r:?}"
    );
    drop(c);
    t.join().unwrap();

    // A silent daemon: the call times out, and the next one backs off
    // instead of waiting out another deadline.
    let sock2 = dir.path().join("s2");
    let l = UnixListener::bind(&sock2).unwrap();
    let t = std::thread::spawn(move || fake_daemon(l, false));
    let mut cfg = ClientConfig::new(&sock2);
    cfg.region_bytes = 1 << 20;
    cfg.timeout_ms = 300;
    cfg.reconnect_backoff_ms = 600_000;
    let c = Client::with_config(cfg);
    let r = c.namespace(&ns()).onboard_into(&key, &mut [&mut buf[..]]);
    assert!(
        matches!(&r[0], Onboarded::Miss(m) if m.cause == MissCause::Timeout),
        "{r:?}"
    );
    let e = c.ensure_connected().unwrap_err().to_string();
    assert!(e.contains("reconnect backoff"), "{e}");
    drop(c);
    t.join().unwrap();
}

/// A daemon older than `LookupMany` (op 17): it answers what its decoder
/// says of an unknown op, `MALFORMED`, and closes the connection; a
/// `Lookup` it answers with `n_ns_a` blocks on G3 for namespace A and
/// none for any other. Counts the `LookupMany` requests it refused.
fn older_daemon(
    l: UnixListener,
    a: kvtier_client::NamespaceId,
    refused: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    for s in l.incoming() {
        let Ok(s) = s else { return };
        let fd = s.as_raw_fd();
        let mut fds = Vec::new();
        let Some(_region) = hello(fd, &mut fds) else {
            continue;
        };
        while let Ok(body) = proto::recv_frame(fd, &mut fds) {
            match Request::decode(&body).unwrap() {
                (id, Request::Lookup { ns, keys }) => {
                    let n = if ns == a { keys.len().min(3) } else { 0 };
                    let r = Response::Lookup {
                        tiers: vec![Tier::G3; n],
                    };
                    proto::send_frame(fd, &r.encode(proto::OP_LOOKUP, id), &[]).unwrap();
                }
                (id, Request::LookupMany { .. }) => {
                    refused.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let r = Response::Error {
                        code: proto::code::MALFORMED,
                        message: "protocol error: unknown op 17".into(),
                    };
                    let _ = proto::send_frame(fd, &r.encode(proto::OP_LOOKUP_MANY, id), &[]);
                    break;
                }
                _ => break,
            }
        }
    }
}

/// A client newer than its daemon (a rolling upgrade): `lookup_many` gets
/// the same answers one namespace at a time, and asks the old daemon for
/// the op it refused only once.
#[test]
fn lookup_many_against_an_older_daemon_asks_one_namespace_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s");
    let l = UnixListener::bind(&sock).unwrap();
    let a = ns().id();
    let b = Namespace::new(
        "other",
        KvLayout::with_block_bytes(BLOCK as u64).unwrap(),
        "",
        "",
    )
    .unwrap()
    .id();
    let refused = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let r2 = refused.clone();
    std::thread::spawn(move || older_daemon(l, a, r2));
    let c = client(&sock);
    let keys: Vec<BlockKey> = (1..=5).map(BlockKey::from_u64).collect();
    for _ in 0..3 {
        let r = c.lookup_many(&[a, b], &keys);
        assert_eq!(r.len(), 2);
        assert!(r[0].miss.is_none() && r[1].miss.is_none(), "{r:?}");
        assert_eq!(r[0].tiers, vec![Tier::G3; 3], "{r:?}");
        assert_eq!(r[1].prefix_len(), 0, "{r:?}");
    }
    assert_eq!(refused.load(std::sync::atomic::Ordering::SeqCst), 1);
}
