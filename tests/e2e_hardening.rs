//! End-to-end: findings of the security review (issue #14) that a local
//! client could exploit, each against a real kvtierd: foreign lease release,
//! the stale-socket cleanup, a trickled frame on the socket, and 10k
//! connections on the metrics port (fds bounded, a trickler cut) followed
//! by fd exhaustion on all three listeners (no spin, no log flood).
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
        features: 0,
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

/// Raises this process's soft (and, as root, hard) RLIMIT_NOFILE to
/// `want`; the soft limit now.
fn raise_nofile(want: u64) -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        if r.rlim_cur < want {
            let raised = libc::rlimit {
                rlim_cur: want,
                rlim_max: r.rlim_max.max(want),
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) != 0 {
                let soft = libc::rlimit {
                    rlim_cur: r.rlim_max,
                    rlim_max: r.rlim_max,
                };
                libc::setrlimit(libc::RLIMIT_NOFILE, &soft);
            }
        }
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
    }
    r.rlim_cur
}

/// Sets another process's soft RLIMIT_NOFILE (the hard one unchanged).
fn set_nofile_of(pid: i32, soft: u64) {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit on a child of ours with valid structs.
    unsafe {
        assert_eq!(
            libc::prlimit(pid, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old),
            0
        );
        let new = libc::rlimit {
            rlim_cur: soft,
            rlim_max: old.rlim_max,
        };
        assert_eq!(
            libc::prlimit(pid, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()),
            0
        );
    }
}

/// A non-blocking TCP connect (it completes, or not, in the background).
fn nb_connect(addr: std::net::SocketAddr) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let std::net::SocketAddr::V4(v4) = addr else {
        return None;
    };
    // SAFETY: plain socket calls on a fresh fd owned by the OwnedFd.
    unsafe {
        let fd = libc::socket(
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        );
        if fd < 0 {
            return None;
        }
        let owned = std::os::fd::OwnedFd::from_raw_fd(fd);
        let sa = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: v4.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*v4.ip()).to_be(),
            },
            sin_zero: [0; 8],
        };
        let r = libc::connect(
            fd,
            &sa as *const libc::sockaddr_in as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        let e = std::io::Error::last_os_error().raw_os_error();
        (r == 0 || e == Some(libc::EINPROGRESS)).then_some(owned)
    }
}

/// Whether the other end closed `fd` (EOF or reset).
fn peer_closed(fd: &std::os::fd::OwnedFd) -> bool {
    use std::os::fd::AsRawFd;
    let mut b = [0u8; 1];
    // SAFETY: recv into a 1-byte buffer.
    let r = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            b.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    let e = std::io::Error::last_os_error().raw_os_error();
    r == 0 || (r < 0 && matches!(e, Some(libc::ECONNRESET) | Some(libc::EPIPE)))
}

/// Connections waiting in the accept queue of the IPv4 listener on
/// `port` (/proc/net/tcp: a LISTEN socket's rx_queue is its accept queue);
/// `None` when no such listener is found.
fn accept_queue_len(port: u16) -> Option<usize> {
    let t = std::fs::read_to_string("/proc/net/tcp").ok()?;
    t.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let local_port = f.get(1)?.rsplit(':').next()?;
        if u16::from_str_radix(local_port, 16).ok()? != port || *f.get(3)? != "0A" {
            return None;
        }
        let rx = f.get(4)?.split(':').nth(1)?;
        usize::from_str_radix(rx, 16).ok()
    })
}

/// User + system CPU time of a process, in clock ticks.
fn cpu_ticks(pid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &s[s.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of stat(5), counted after the command name.
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

fn lines_with(log: &std::path::Path, pat: &str) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(pat))
        .count()
}

/// Trickles an HTTP request head to `addr`, one byte per 200 ms; how long
/// until the server closed the connection (`None`: never, within 15 s).
fn trickle_http(addr: &str) -> Option<Duration> {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: ".repeat(4);
    let t = std::time::Instant::now();
    for b in head.iter().cycle() {
        if t.elapsed() > Duration::from_secs(15) {
            return None;
        }
        if s.write_all(&[*b]).is_err() {
            return Some(t.elapsed());
        }
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let mut buf = [0u8; 512];
        match s.read(&mut buf) {
            Ok(0) => return Some(t.elapsed()),
            Err(e)
                if e.kind() != std::io::ErrorKind::WouldBlock
                    && e.kind() != std::io::ErrorKind::TimedOut =>
            {
                return Some(t.elapsed())
            }
            _ => {}
        }
    }
    None
}

const FLOOD_CONNECTIONS: usize = 10_000;

#[test]
fn ten_thousand_metrics_connections_keep_fds_bounded_and_fd_exhaustion_does_not_flood_the_log() {
    let have = raise_nofile(FLOOD_CONNECTIONS as u64 + 4096);
    if have < FLOOD_CONNECTIONS as u64 + 1024 {
        eprintln!(
            "SKIP ten_thousand_metrics_connections: RLIMIT_NOFILE is {have} here and cannot be \
             raised (needs root or a hard limit above {})",
            FLOOD_CONNECTIONS + 1024
        );
        return;
    }
    // kvtierd with its peer listener on, its log in a file.
    let cfg_dir = tempfile::tempdir().unwrap();
    let secret = cfg_dir.path().join("peer.secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let peer_addr = format!("127.0.0.1:{}", support::free_port());
    let cfg = cfg_dir.path().join("kvtierd.toml");
    std::fs::write(
        &cfg,
        format!(
            "[peer]\nenabled = true\nnode_id = \"n1\"\nbind = \"{peer_addr}\"\n\
             secret_file = \"{}\"\ndiscovery = false\n",
            secret.display()
        ),
    )
    .unwrap();
    let log = cfg_dir.path().join("kvtierd.log");
    let d = support::Daemon::start_logged(
        &[
            "--config".into(),
            cfg.display().to_string(),
            "--g4".into(),
            "".into(),
        ],
        &log,
    );
    let pid = d.pid();
    let before = fd_count(pid);
    let bound = before + kvtier_daemon::edges::metrics::METRICS_CONNECTIONS_MAX + 16;

    // A trickler on the metrics port, cut at its header deadline (5 s)
    // while the flood runs.
    let maddr = d.metrics_addr.clone();
    let trickler = std::thread::spawn(move || trickle_http(&maddr));
    std::thread::sleep(Duration::from_millis(100));

    // 1. The flood: 10k connections held open by this process, in batches
    // below the listen backlog (so that each one reaches the daemon's
    // accept, none is lost to a full backlog). The daemon closes every one
    // past its cap at once, and its fd table never grows past the cap.
    let metrics: std::net::SocketAddr = d.metrics_addr.parse().unwrap();
    let cap = kvtier_daemon::edges::metrics::METRICS_CONNECTIONS_MAX;
    let mut held = Vec::with_capacity(FLOOD_CONNECTIONS);
    let mut open: Vec<usize> = Vec::new();
    let mut max_fds = before;
    while held.len() < FLOOD_CONNECTIONS {
        // A quarter of tokio's listen backlog (1024): a batch that arrives
        // while the last one still waits in it would overflow it, and
        // with syncookies an overflowed connection is ESTABLISHED here
        // and unknown to the daemon for good.
        for _ in 0..250 {
            open.push(held.len());
            held.push(nb_connect(metrics).expect("connect"));
        }
        // Until only those it serves (at most the cap, open until their
        // header deadline) are left, or the daemon has accepted all of the
        // batch (its listener's accept queue is empty) and nothing changed
        // for 100 ms since. Not a bare "no change for 100 ms": a daemon
        // starved of CPU that long had not caught up, the next batch
        // overflowed the backlog, and CI saw 7% of them lost so.
        let (mut last, mut still) = (usize::MAX, std::time::Instant::now());
        let batch = std::time::Instant::now();
        loop {
            open.retain(|&i| !peer_closed(&held[i]));
            max_fds = max_fds.max(fd_count(pid));
            if open.len() <= cap {
                break;
            }
            if open.len() != last {
                (last, still) = (open.len(), std::time::Instant::now());
            } else if still.elapsed() > Duration::from_millis(100)
                && accept_queue_len(metrics.port()) == Some(0)
            {
                break;
            }
            assert!(
                batch.elapsed() < Duration::from_secs(30),
                "kvtierd did not drain its metrics accept queue in 30 s"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    assert!(
        max_fds <= bound,
        "kvtierd's fds {before} -> {max_fds} under {FLOOD_CONNECTIONS} connections"
    );
    // The ones it serves are silent: cut at the header deadline, and the
    // daemon is back to its fds before the flood.
    let t = std::time::Instant::now();
    while fd_count(pid) > before + 2 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "kvtierd holds {} fds (before: {before}) past the header deadline",
            fd_count(pid)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    open.retain(|&i| !peer_closed(&held[i]));
    eprintln!(
        "{FLOOD_CONNECTIONS} metrics connections: kvtierd fds {before} -> at most {max_fds}; \
         {} closed by it",
        FLOOD_CONNECTIONS - open.len()
    );
    assert!(
        open.len() < FLOOD_CONNECTIONS / 20,
        "only {} of {FLOOD_CONNECTIONS} connections reached the daemon",
        FLOOD_CONNECTIONS - open.len()
    );
    drop(held);
    let cut = trickler.join().unwrap();
    assert!(
        cut.is_some_and(|t| t < Duration::from_secs(8)),
        "a trickling metrics client was cut only after {cut:?}"
    );

    // 2. Out of fds: with its fd limit just above what it holds, every
    // accept (metrics, peer, the socket) fails with EMFILE. The listeners
    // back off (no spin) and warn at most once a second each.
    let lines_before = lines_with(&log, "accept failed");
    let cpu_before = cpu_ticks(pid);
    set_nofile_of(pid, fd_count(pid) as u64 + 2);
    let t = std::time::Instant::now();
    let peer: std::net::SocketAddr = peer_addr.parse().unwrap();
    let mut pending = Vec::new();
    let mut unix = Vec::new();
    while t.elapsed() < Duration::from_secs(1) {
        pending.extend(nb_connect(metrics));
        pending.extend(nb_connect(peer));
        if let Ok(s) = UnixStream::connect(&d.socket) {
            unix.push(s);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let wall = t.elapsed();
    let cpu = cpu_ticks(pid) - cpu_before;
    let lines = lines_with(&log, "accept failed") - lines_before;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let cpu_s = cpu as f64 / hz;
    assert!(
        cpu_s < wall.as_secs_f64() * 0.5,
        "kvtierd spun on EMFILE: {cpu_s:.2} s of CPU in {wall:?}"
    );
    // Three listeners, one line a second each, plus the edges.
    let lines_max = 3 * (wall.as_secs() as usize + 2);
    assert!(
        lines > 0 && lines <= lines_max,
        "{lines} accept warnings in {wall:?} (at most {lines_max})"
    );
    eprintln!(
        "EMFILE for {wall:?}: {lines} warnings, {cpu_s:.2} s CPU, {} connections waiting",
        pending.len() + unix.len()
    );

    // 3. fds back: served again.
    set_nofile_of(pid, have);
    drop(pending);
    drop(unix);
    let mut ok = false;
    for _ in 0..50 {
        let (status, body) = d.http_get("/metrics");
        if status.contains("200") && body.contains("kvtier_") {
            ok = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(ok, "metrics not served after the flood");
    let client = Client::with_config(ClientConfig::new(&d.socket));
    assert!(client.stats().is_ok(), "the socket not served after EMFILE");
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

// ---- shared-memory pages and memory cgroups ------------------------------

/// A child memory cgroup of this process's own (v2 if it has the memory
/// controller, else v1's memory hierarchy), removed on drop.
struct Memcg {
    dir: std::path::PathBuf,
}

impl Memcg {
    fn create(name: &str) -> Result<Memcg, String> {
        let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| e.to_string())?;
        let v2_root = std::path::Path::new("/sys/fs/cgroup");
        let v2_memory = std::fs::read_to_string(v2_root.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|x| x == "memory"));
        let parent = if v2_memory {
            // Children of the root (exempt from "no processes in inner
            // cgroups"); the memory controller enabled for them if it is
            // not yet (fails in a cgroup namespace whose root holds
            // processes: then skip).
            let sub =
                std::fs::read_to_string(v2_root.join("cgroup.subtree_control")).unwrap_or_default();
            if !sub.split_whitespace().any(|c| c == "memory") {
                std::fs::write(v2_root.join("cgroup.subtree_control"), "+memory")
                    .map_err(|e| format!("enabling memory in /sys/fs/cgroup: {e}"))?;
            }
            v2_root.to_path_buf()
        } else {
            let rel = own
                .lines()
                .find_map(|l| {
                    let (_, rest) = l.split_once(':')?;
                    let (ctl, path) = rest.split_once(':')?;
                    ctl.split(',').any(|c| c == "memory").then_some(path)
                })
                .ok_or("no memory cgroup (v1 or v2) for this process")?;
            std::path::Path::new("/sys/fs/cgroup/memory").join(rel.trim_start_matches('/'))
        };
        let dir = parent.join(name);
        std::fs::create_dir(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let cg = Memcg { dir };
        cg.shmem_bytes().ok_or("no shmem in memory.stat")?;
        Ok(cg)
    }

    fn add(&self, pid: i32) -> std::io::Result<()> {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string())
    }

    /// Shared-memory bytes charged to this cgroup (memory.stat `shmem`).
    fn shmem_bytes(&self) -> Option<u64> {
        std::fs::read_to_string(self.dir.join("memory.stat"))
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("shmem ")?.trim().parse().ok())
    }
}

impl Drop for Memcg {
    fn drop(&mut self) {
        // Its processes have exited by now (or go back to the parent).
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

const SHM_BLOCK: u64 = 1 << 20;
const SHM_BLOCKS: usize = 32;

fn shm_ns() -> Namespace {
    Namespace::new(
        "m",
        KvLayout::with_block_bytes(SHM_BLOCK).unwrap(),
        "",
        "shm",
    )
    .unwrap()
}

/// Not a test of its own: the client of the cgroup test, in its own
/// cgroup, onboarding through a fresh shared region.
#[test]
fn shm_cgroup_worker() {
    let Ok(dir) = std::env::var("KVTIER_SHM_WORKER_DIR") else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    let sock = std::env::var("KVTIER_SHM_WORKER_SOCK").unwrap();
    std::fs::write(
        std::env::var("KVTIER_SHM_WORKER_CGROUP").unwrap(),
        std::process::id().to_string(),
    )
    .unwrap();
    let c = Client::with_config(ClientConfig {
        region_bytes: 2 * SHM_BLOCK * SHM_BLOCKS as u64,
        ..ClientConfig::new(&sock)
    });
    let ns = shm_ns();
    let h = c.namespace(&ns);
    let keys = h.hash_chain(&(0..(16 * SHM_BLOCKS) as u32).collect::<Vec<u32>>());
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; SHM_BLOCK as usize]).collect();
    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|v| &mut v[..]).collect();
    let got = h.onboard_into(&keys, &mut refs);
    assert!(got.iter().all(|o| o.is_hit()), "{got:?}");
    // Keep the region (and its pages) until the test has measured.
    std::fs::write(dir.join("onboarded"), b"").unwrap();
    let t = std::time::Instant::now();
    while !dir.join("measured").exists() && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn shared_region_pages_are_charged_to_the_client_not_the_daemon() {
    let tag = std::process::id();
    let (cg_d, cg_c) = match (
        Memcg::create(&format!("kvtier-test-daemon-{tag}")),
        Memcg::create(&format!("kvtier-test-client-{tag}")),
    ) {
        (Ok(d), Ok(c)) => (d, c),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("SKIP shared_region_pages_are_charged_to_the_client: {e}");
            return;
        }
    };
    let d = Daemon::start_with(&["--g4".into(), "".into()], &[]);
    // Seeded by this process (whose own region pages are its own). 512 MiB
    // of durable writes: setup, not what is measured, so a deadline a slow
    // disk meets (the default 2 s was missed in a clean-clone run).
    {
        let mut cfg = ClientConfig::new(&d.socket);
        cfg.timeout_ms = 300_000;
        let c = Client::with_config(cfg);
        let ns = shm_ns();
        let h = c.namespace(&ns);
        let keys = h.hash_chain(&(0..(16 * SHM_BLOCKS) as u32).collect::<Vec<u32>>());
        let payload = vec![0x42u8; SHM_BLOCK as usize];
        let p: Vec<&[u8]> = keys.iter().map(|_| &payload[..]).collect();
        let out = h.offload_chain(None, &keys, &p, Hints::default());
        assert!(
            out.iter().all(|o| matches!(o, OffloadOutcome::Stored)),
            "{out:?}"
        );
    }
    if let Err(e) = cg_d.add(d.pid()) {
        eprintln!("SKIP shared_region_pages_are_charged_to_the_client: moving kvtierd: {e}");
        return;
    }
    let sig = tempfile::tempdir().unwrap();
    let (d0, c0) = (cg_d.shmem_bytes().unwrap(), cg_c.shmem_bytes().unwrap());
    let w = support::spawn_worker(
        "shm_cgroup_worker",
        &[
            ("KVTIER_SHM_WORKER_DIR", sig.path().display().to_string()),
            ("KVTIER_SHM_WORKER_SOCK", d.socket.display().to_string()),
            (
                "KVTIER_SHM_WORKER_CGROUP",
                cg_c.dir.join("cgroup.procs").display().to_string(),
            ),
        ],
    );
    let t = std::time::Instant::now();
    while !sig.path().join("onboarded").exists() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the worker never onboarded"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let (d1, c1) = (cg_d.shmem_bytes().unwrap(), cg_c.shmem_bytes().unwrap());
    std::fs::write(sig.path().join("measured"), b"").unwrap();
    let (ok, out) = support::wait_child(w, Duration::from_secs(30));
    assert!(ok, "worker failed: {out}");
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let (daemon, client) = (d1.saturating_sub(d0), c1.saturating_sub(c0));
    eprintln!(
        "{SHM_BLOCKS} x {} MiB onboarded through a fresh region: shmem charged to the daemon's \
         cgroup {:.1} MiB, to the client's {:.1} MiB",
        SHM_BLOCK >> 20,
        mib(daemon),
        mib(client)
    );
    let onboarded = SHM_BLOCK * SHM_BLOCKS as u64;
    assert!(
        daemon < onboarded / 8,
        "the daemon's cgroup was charged {:.1} MiB of a client's region",
        mib(daemon)
    );
    assert!(
        client >= onboarded,
        "the client's cgroup got {:.1} MiB",
        mib(client)
    );
}

#[test]
fn the_daemon_does_not_fault_in_region_pages_the_client_did_not_populate() {
    use kvtier_client::shm::Region;
    use std::os::fd::AsRawFd;
    let d = Daemon::start_with(&["--g4".into(), "".into()], &[]);
    let ns = shm_ns();
    let c = Client::with_config(ClientConfig::new(&d.socket));
    let h = c.namespace(&ns);
    let keys = h.hash_chain(&(0..16u32).collect::<Vec<u32>>());
    let payload = vec![0x42u8; SHM_BLOCK as usize];
    let out = h.offload_chain(None, &keys, &[&payload[..]], Hints::default());
    assert!(matches!(out[0], OffloadOutcome::Stored), "{out:?}");
    // A raw client whose region is never populated.
    let region = Region::create(4 * SHM_BLOCK).unwrap();
    let mut s = UnixStream::connect(&d.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let hello = Request::Hello {
        shm_bytes: region.len() as u64,
        pid: std::process::id(),
        features: 0,
    };
    proto::send_frame(s.as_raw_fd(), &hello.encode(1), &[region.fd().as_raw_fd()]).unwrap();
    assert!(matches!(
        Response::decode(&read_frame(&mut s), proto::OP_HELLO)
            .unwrap()
            .1,
        Response::Hello { .. }
    ));
    let slot = 2 * SHM_BLOCK;
    let onboard = Request::Onboard {
        ns: ns.id(),
        mode: OnboardMode::Shm,
        lease_ttl_ms: 0,
        items: vec![OnboardItem {
            key: keys[0],
            shm_offset: 0,
            shm_len: slot,
        }],
    };
    let Response::Onboard { items } = call(&mut s, &onboard, 2) else {
        panic!("onboard reply")
    };
    assert_eq!(items[0].status, ItemStatus::Invalid, "wrote into holes");
    assert!(
        !region.populated(0, slot as usize),
        "the daemon faulted pages in"
    );
    // Populated by the client: served.
    assert!(region.populate(0, slot as usize));
    let Response::Onboard { items } = call(&mut s, &onboard, 3) else {
        panic!("onboard reply")
    };
    assert_eq!(items[0].status, ItemStatus::Ok);
}
