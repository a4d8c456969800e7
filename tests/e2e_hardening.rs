//! End-to-end: findings of the security review (issue #14) that a local
//! client could exploit, each against a real kvtierd: foreign lease release,
//! the stale-socket cleanup, and a connection flood on the metrics port.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kvtier_client::proto::{self, ItemStatus, OnboardItem, OnboardMode, Request, Response};
use kvtier_client::{Client, ClientConfig, Hints, KvLayout, Namespace, OffloadOutcome};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;
use support::Daemon;

fn read_frame(s: &mut UnixStream) -> Vec<u8> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut b = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut b).unwrap();
    b
}

/// A raw control connection (no shared region), past its hello.
fn raw_conn(sock: &std::path::Path) -> UnixStream {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let hello = Request::Hello {
        shm_bytes: 0,
        pid: std::process::id(),
    };
    s.write_all(&hello.encode(1)).unwrap();
    let b = read_frame(&mut s);
    assert!(matches!(
        Response::decode(&b, proto::OP_HELLO).unwrap().1,
        Response::Hello { .. }
    ));
    s
}

fn call(s: &mut UnixStream, req: &Request, id: u32) -> Response {
    let op = req.op();
    s.write_all(&req.encode(id)).unwrap();
    // Passed fds (direct onboard) are dropped by a plain read; only the
    // reply matters here.
    Response::decode(&read_frame(s), op).unwrap().1
}

#[test]
fn a_connection_cannot_release_another_connections_lease() {
    let d = Daemon::start();
    let ns = Namespace::new("m", KvLayout::with_block_bytes(4096).unwrap(), "", "t").unwrap();
    let client = Client::with_config(ClientConfig::new(&d.socket));
    let h = client.namespace(&ns);
    let keys = h.hash_chain(&(0..16).collect::<Vec<u32>>());
    let out = h.offload_chain(None, &keys, &[&vec![7u8; 4096][..]], Hints::default());
    assert!(matches!(out[0], OffloadOutcome::Stored), "{out:?}");

    // A holds a lease on the block (direct onboard, long TTL).
    let mut a = raw_conn(&d.socket);
    let onboard = Request::Onboard {
        ns: ns.id(),
        mode: OnboardMode::DirectFd,
        lease_ttl_ms: 30_000,
        items: vec![OnboardItem {
            key: keys[0],
            shm_offset: 0,
            shm_len: 0,
        }],
    };
    let Response::Onboard { items } = call(&mut a, &onboard, 2) else {
        panic!("onboard reply")
    };
    assert_eq!(items[0].status, ItemStatus::Ok);
    let lease = items[0].lease_id;
    assert_ne!(lease, 0);

    // B guesses every id around it (ids are sequential): all refused.
    let mut b = raw_conn(&d.socket);
    let guesses: Vec<u64> = (lease.saturating_sub(32)..lease + 32).collect();
    let Response::Items { status } = call(&mut b, &Request::Release { leases: guesses }, 3) else {
        panic!("release reply")
    };
    assert!(
        status.iter().all(|s| *s == ItemStatus::Absent),
        "{status:?}"
    );
    // A's lease is still held: evicting the block is refused while leased.
    let ev = h.evict(&keys[..1]).unwrap();
    assert_ne!(ev[0], ItemStatus::Ok, "evicted under a live lease");
    // A releases its own.
    let Response::Items { status } = call(
        &mut a,
        &Request::Release {
            leases: vec![lease],
        },
        4,
    ) else {
        panic!("release reply")
    };
    assert_eq!(status, vec![ItemStatus::Ok]);
    assert_eq!(h.evict(&keys[..1]).unwrap()[0], ItemStatus::Ok);
}

#[test]
fn a_file_at_the_socket_path_is_never_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvtierd.sock");
    std::fs::write(&path, b"precious").unwrap();
    let out = std::process::Command::new(support::kvtierd_bin())
        .arg("--socket")
        .arg(&path)
        .arg("--g3-dir")
        .arg(dir.path().join("g3"))
        .args(["--metrics-addr", "", "--g4", ""])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is not a socket"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"precious");
}

fn fd_count(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

#[test]
fn a_metrics_connection_flood_keeps_fds_bounded() {
    let d = Daemon::start();
    let before = fd_count(d.pid());
    let mut held = Vec::new();
    for _ in 0..600 {
        if let Ok(s) = std::net::TcpStream::connect(&d.metrics_addr) {
            held.push(s);
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let during = fd_count(d.pid());
    assert!(
        during <= before + kvtier_daemon::metrics::METRICS_CONNECTIONS_MAX + 16,
        "fds {before} -> {during} with {} connections held",
        held.len()
    );
    drop(held);
    // Served again once the flood is gone.
    let mut ok = false;
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        let (status, body) = d.http_get("/metrics");
        if status.contains("200") && body.contains("kvtier_") {
            ok = true;
            break;
        }
    }
    assert!(ok, "metrics not served after the flood");
}

#[test]
fn a_trickled_frame_is_cut_at_the_frame_deadline() {
    let cfg = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(cfg.path(), "[server]\nio_timeout_ms = 500\n").unwrap();
    let d = Daemon::start_with(&["--config".into(), cfg.path().display().to_string()], &[]);
    let mut s = raw_conn(&d.socket);
    // A valid-looking 64-byte frame, one byte every 100 ms: each receive
    // comes well inside the per-receive timeout, the whole frame does not.
    let frame = Request::Release {
        leases: (1..=6).collect(),
    }
    .encode(9);
    let start = std::time::Instant::now();
    let mut cut = false;
    for b in frame.iter().cycle().take(80) {
        if s.write_all(&[*b]).is_err() {
            cut = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        // The daemon closes the connection: a read sees EOF (or an error
        // frame followed by EOF).
        s.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 256];
        let r = s.read(&mut buf);
        s.set_nonblocking(false).unwrap();
        if matches!(r, Ok(0)) {
            cut = true;
            break;
        }
    }
    let took = start.elapsed();
    assert!(cut, "a trickling client kept its connection for {took:?}");
    assert!(took < Duration::from_secs(6), "cut only after {took:?}");
    // The daemon keeps serving others.
    let client = Client::with_config(ClientConfig::new(&d.socket));
    assert!(client.stats().is_ok());
}
