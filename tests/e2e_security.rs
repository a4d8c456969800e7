//! End-to-end: findings of the second security review (issue #29), each
//! against a real kvtierd (or, for the client's side, a hostile fake
//! daemon): passed descriptors never leak.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kvtier_client::proto::{self, Request, Response};
use kvtier_client::{Client, ClientConfig, Error};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};
use support::Daemon;

/// A file whose descriptors are passed around; counting the entries of
/// `/proc/PID/fd` that point at it tells whether a process still holds any,
/// whatever else the process (or the other tests of this binary) opens.
struct Marker {
    path: std::path::PathBuf,
    file: std::fs::File,
}

impl Marker {
    fn new(dir: &Path) -> Marker {
        let path = dir.join("fd-marker");
        std::fs::write(&path, b"m").unwrap();
        let file = std::fs::File::open(&path).unwrap();
        Marker {
            path: path.canonicalize().unwrap(),
            file,
        }
    }

    /// `n` fresh descriptors of the marker.
    fn dups(&self, n: usize) -> Vec<OwnedFd> {
        (0..n)
            .map(|_| {
                // SAFETY: dup of a live fd; the new fd is ours alone.
                let fd = unsafe { libc::dup(self.file.as_raw_fd()) };
                assert!(fd >= 0, "dup: {}", std::io::Error::last_os_error());
                unsafe { OwnedFd::from_raw_fd(fd) }
            })
            .collect()
    }

    /// How many descriptors of process `pid` point at the marker.
    fn held_by(&self, pid: &str) -> usize {
        let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            return 0;
        };
        rd.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|l| *l == self.path)
            .count()
    }

    /// Waits (generously) until `pid` holds at most `n` marker descriptors;
    /// returns what it holds then.
    fn settle(&self, pid: &str, n: usize) -> usize {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let h = self.held_by(pid);
            if h <= n || Instant::now() > until {
                return h;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Sends `frame` with `groups[i]` of `fds` attached to its i-th byte, one
/// `sendmsg` per group (Linux passes at most 253 per call); the rest of the
/// frame follows in one more call.
fn send_spread(sock: &UnixStream, frame: &[u8], fds: &[OwnedFd], groups: &[usize]) {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    assert!(groups.len() < frame.len());
    let mut at = 0;
    for (i, &g) in groups.iter().enumerate() {
        let iov = [std::io::IoSlice::new(&frame[i..i + 1])];
        let cm = [ControlMessage::ScmRights(&raw[at..at + g])];
        // After the first, the daemon may have refused and closed already.
        match sendmsg::<()>(sock.as_raw_fd(), &iov, &cm, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(n) => assert_eq!(n, 1),
            Err(e) if i > 0 => {
                assert!(
                    matches!(e, nix::errno::Errno::EPIPE | nix::errno::Errno::ECONNRESET),
                    "{e}"
                );
                return;
            }
            Err(e) => panic!("sendmsg: {e}"),
        }
        at += g;
    }
    let iov = [std::io::IoSlice::new(&frame[groups.len()..])];
    // The daemon may already have refused and closed: that is fine.
    let _ = sendmsg::<()>(sock.as_raw_fd(), &iov, &[], MsgFlags::MSG_NOSIGNAL, None);
}

/// Reads one reply (or nothing, if the peer closed first).
fn reply(sock: &UnixStream, op: u8) -> Option<Response> {
    let mut fds = Vec::new();
    let body = proto::recv_frame(sock.as_raw_fd(), &mut fds).ok()?;
    Some(Response::decode(&body, op).unwrap().1)
}

fn hello(id: u32) -> Vec<u8> {
    Request::Hello {
        shm_bytes: 0,
        pid: std::process::id(),
    }
    .encode(id)
}

fn daemon_serves(d: &Daemon) {
    let c = Client::with_config(ClientConfig::new(&d.socket));
    c.stats()
        .unwrap_or_else(|e| panic!("daemon stopped serving: {e}"));
}

#[test]
fn hostile_frames_with_too_many_fds_leak_no_descriptor_in_the_daemon() {
    let d = Daemon::start();
    let m = Marker::new(d.dir.path());
    let pid = d.pid().to_string();
    daemon_serves(&d);

    // 129 fds on a hello (one over the per-frame bound, one sendmsg):
    // refused with a clear error, every one closed. Ten of them would
    // have left 1280 descriptors open before the fix.
    for _ in 0..10 {
        let s = UnixStream::connect(&d.socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        send_spread(&s, &hello(1), &m.dups(129), &[129]);
        match reply(&s, proto::OP_HELLO) {
            Some(Response::Error { code, message }) => {
                assert_eq!(code, proto::code::MALFORMED, "{message}");
                assert!(message.contains("file descriptors"), "{message}");
            }
            other => panic!("129 fds: {other:?}"),
        }
    }
    assert_eq!(m.settle(&pid, 0), 0, "daemon kept passed fds");

    // 1000 fds spread over four sendmsg calls of one frame.
    let s = UnixStream::connect(&d.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    send_spread(&s, &hello(1), &m.dups(1000), &[250, 250, 250, 250]);
    assert!(matches!(
        reply(&s, proto::OP_HELLO),
        Some(Response::Error { .. }) | None
    ));
    drop(s);
    assert_eq!(m.settle(&pid, 0), 0, "daemon kept passed fds (1000)");

    // Fds on frames that carry none by protocol: a hello without a region,
    // then a stats request. Refused, closed.
    let s = UnixStream::connect(&d.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    send_spread(&s, &hello(1), &m.dups(5), &[5]);
    assert!(matches!(
        reply(&s, proto::OP_HELLO),
        Some(Response::Hello { .. })
    ));
    let stats = Request::Stats.encode(2);
    send_spread(&s, &stats, &m.dups(7), &[7]);
    match reply(&s, proto::OP_STATS) {
        Some(Response::Error { code, .. }) => assert_eq!(code, proto::code::MALFORMED),
        other => panic!("stats with fds: {other:?}"),
    }
    drop(s);
    assert_eq!(m.settle(&pid, 0), 0, "daemon kept unexpected fds");
    daemon_serves(&d);
}

/// A fake daemon that answers one hello with `n` marker fds on the reply.
fn hostile_daemon(l: UnixListener, fds: Vec<OwnedFd>, groups: Vec<usize>) {
    let (s, _) = l.accept().unwrap();
    let mut got = Vec::new();
    let body = proto::recv_frame(s.as_raw_fd(), &mut got).unwrap();
    let (id, _) = Request::decode(&body).unwrap();
    let hello = Response::Hello {
        version: proto::PROTOCOL_VERSION,
        session_id: 1,
        keys_max: 4096,
        lease_ttl_max_ms: 1000,
    };
    send_spread(&s, &hello.encode(proto::OP_HELLO, id), &fds, &groups);
    // Our own copies go now; only the client's can remain.
    drop(fds);
    // Hold the connection until the client is done with it.
    let mut b = [0u8; 1];
    let _ = nix::sys::socket::recv(s.as_raw_fd(), &mut b, nix::sys::socket::MsgFlags::empty());
}

#[test]
fn a_hostile_daemon_cannot_leak_descriptors_into_a_client() {
    let dir = tempfile::tempdir().unwrap();
    let m = Marker::new(dir.path());
    // The marker's own descriptor.
    let base = m.held_by("self");
    for (groups, refused) in [
        (vec![129], true),
        (vec![250, 250, 250, 250], true),
        (vec![3], false),
    ] {
        let sock = dir.path().join("fake.sock");
        let _ = std::fs::remove_file(&sock);
        let l = UnixListener::bind(&sock).unwrap();
        let fds = m.dups(groups.iter().sum());
        let g = groups.clone();
        let t = std::thread::spawn(move || hostile_daemon(l, fds, g));
        let mut cfg = ClientConfig::new(&sock);
        cfg.region_bytes = 0;
        let c = Client::with_config(cfg);
        let r = c.stats();
        if refused {
            match &r {
                Err(Error::Protocol { reason }) => {
                    assert!(reason.contains("file descriptors"), "{reason}")
                }
                other => panic!("{groups:?}: {other:?}"),
            }
        }
        drop(c);
        t.join().unwrap();
        assert_eq!(m.settle("self", base), base, "{groups:?}: client kept fds");
    }
}
