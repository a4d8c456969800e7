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
                // SAFETY: `fd` is a fresh dup (checked above), owned by nobody else.
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
        features: 0,
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

// ---- H1: data at rest ------------------------------------------------

const NOBODY: u32 = 65534;

/// Which of `files` uid nobody can read (run through setpriv, one shell).
fn readable_by_nobody(files: &[std::path::PathBuf]) -> Vec<String> {
    let mut script = String::new();
    for f in files {
        script.push_str(&format!(
            "cat '{}' >/dev/null 2>&1 && echo '{}'\n",
            f.display(),
            f.display()
        ));
    }
    let out = std::process::Command::new("setpriv")
        .args([
            &format!("--reuid={NOBODY}"),
            &format!("--regid={NOBODY}"),
            "--clear-groups",
            "--",
            "sh",
            "-c",
            &script,
        ])
        .output()
        .expect("setpriv");
    assert!(
        out.status.success() || out.status.code() == Some(1),
        "{out:?}"
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// Every regular file under `root` (as root sees them).
fn files_under(root: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(root).unwrap() {
        let e = e.unwrap();
        let t = e.file_type().unwrap();
        if t.is_dir() {
            files_under(&e.path(), out);
        } else if t.is_file() {
            out.push(e.path());
        }
    }
}

fn mode_of(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

fn chmod(p: &Path, m: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
}

/// Opens a tree the way a daemon without the umask left it (0755 / 0644).
fn open_up(root: &Path) {
    chmod(root, 0o755);
    for e in std::fs::read_dir(root).unwrap() {
        let e = e.unwrap();
        let t = e.file_type().unwrap();
        if t.is_dir() {
            open_up(&e.path());
        } else if t.is_file() {
            chmod(&e.path(), 0o644);
        }
    }
}

fn offload_some(socket: &Path, round: u32) {
    let ns = kvtier_client::Namespace::new(
        "rest",
        kvtier_client::KvLayout::with_block_bytes(4096).unwrap(),
        "",
        "t",
    )
    .unwrap();
    let c = Client::with_config(ClientConfig::new(socket));
    let h = c.namespace(&ns);
    let keys = h.hash_chain(&(round * 1000..round * 1000 + 64).collect::<Vec<u32>>());
    let data: Vec<Vec<u8>> = (0..keys.len())
        .map(|i| vec![i as u8 ^ 0x5a; 4096])
        .collect();
    let refs: Vec<&[u8]> = data.iter().map(|v| &v[..]).collect();
    let out = h.offload_chain(None, &keys, &refs, kvtier_client::Hints::default());
    assert!(
        out.iter()
            .all(|o| matches!(o, kvtier_client::OffloadOutcome::Stored)),
        "{out:?}"
    );
}

fn wait_files(root: &Path, at_least: usize) -> Vec<std::path::PathBuf> {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let mut f = Vec::new();
        if root.exists() {
            files_under(root, &mut f);
        }
        if f.len() >= at_least || Instant::now() > until {
            return f;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn another_uid_reads_no_block_index_or_g4_object() {
    let g4 = tempfile::tempdir().unwrap();
    chmod(g4.path(), 0o755);
    let store = g4.path().join("store");
    let log = g4.path().join("kvtierd.log");
    let mut d = Daemon::start_logged(
        &["--g4".into(), format!("file://{}", store.display())],
        &log,
    );
    // Only what the daemon creates decides: the test's dirs are open.
    chmod(d.dir.path(), 0o755);
    let g3 = d.dir.path().join("g3");
    offload_some(&d.socket, 1);
    // Its 4 blocks, written through to G4.
    let g4_files = wait_files(&store, 4);
    assert!(g4_files.len() >= 4, "G4 store: {g4_files:?}");
    let mut all = g4_files;
    files_under(&g3, &mut all);
    assert!(
        all.iter().any(|p| p.ends_with("index.redb")),
        "no index in {all:?}"
    );
    let read = readable_by_nobody(&all);
    assert!(read.is_empty(), "uid nobody read: {read:?}");

    // A tree an earlier version left open, with a link to a file outside:
    // tightened at start, the link's target untouched.
    assert!(d.term(Duration::from_secs(30)).is_some());
    open_up(&g3);
    open_up(&store);
    let outside = g4.path().join("outside");
    std::fs::write(&outside, b"not the daemon's").unwrap();
    chmod(&outside, 0o644);
    std::os::unix::fs::symlink(&outside, g3.join("link-out")).unwrap();
    assert!(!readable_by_nobody(&all).is_empty(), "open_up did not open");
    d.restart();
    let read = readable_by_nobody(&all);
    assert!(read.is_empty(), "after restart uid nobody read: {read:?}");
    assert_eq!(mode_of(&outside), 0o644, "a link was followed");
    assert_eq!(mode_of(&g3) & 0o077, 0);
    offload_some(&d.socket, 2);
    let mut all = Vec::new();
    files_under(&g3, &mut all);
    assert!(readable_by_nobody(&all).is_empty());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("readable by the daemon's user only"),
        "{text}"
    );
}

// ---- M1: the socket's directory --------------------------------------

/// Runs kvtierd with its socket at `sock` and `cfg`; returns its exit
/// status and log when it refuses to start (None: it started).
fn start_refused(sock: &Path, cfg: &str) -> Option<(std::process::ExitStatus, String)> {
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = dir.path().join("kvtierd.toml");
    std::fs::write(&cfg_path, cfg).unwrap();
    let mut child = std::process::Command::new(support::kvtierd_bin())
        .arg("--config")
        .arg(&cfg_path)
        .arg("--socket")
        .arg(sock)
        .arg("--g3-dir")
        .arg(dir.path().join("g3"))
        .args(["--g3-capacity", "64MiB", "--metrics-addr", "", "--g4", ""])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    while Instant::now() < until {
        if let Some(st) = child.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return Some((st, err));
        }
        if UnixStream::connect(sock).is_ok() {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("kvtierd neither served nor exited");
}

#[test]
fn a_socket_directory_another_user_controls_is_refused_and_no_link_is_followed() {
    let base = tempfile::tempdir().unwrap();
    chmod(base.path(), 0o755);
    let victim = base.path().join("victim");
    std::fs::write(&victim, b"root's").unwrap();
    chmod(&victim, 0o600);

    // Owned by another user: that user could swap the socket for a link.
    let theirs = base.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    nix::unistd::chown(&theirs, Some(nix::unistd::Uid::from_raw(NOBODY)), None).unwrap();
    let (st, err) = start_refused(&theirs.join("kvtierd.sock"), "").expect("started");
    assert!(!st.success());
    assert!(err.contains("owned by uid 65534"), "{err}");

    // Writable by everyone, not sticky.
    let open = base.path().join("open");
    std::fs::create_dir(&open).unwrap();
    chmod(&open, 0o777);
    let (st, err) = start_refused(&open.join("kvtierd.sock"), "").expect("started");
    assert!(!st.success());
    assert!(err.contains("not sticky"), "{err}");

    // Sticky and world-writable (like /tmp): a link someone placed at the
    // socket path is refused and its target untouched.
    let sticky = base.path().join("sticky");
    std::fs::create_dir(&sticky).unwrap();
    chmod(&sticky, 0o1777);
    std::os::unix::fs::symlink(&victim, sticky.join("kvtierd.sock")).unwrap();
    let cfg = "[server]\nsocket_group = \"nogroup\"\n";
    let (st, _) = start_refused(&sticky.join("kvtierd.sock"), cfg).expect("started");
    assert!(!st.success());
    use std::os::unix::fs::MetadataExt;
    let v = std::fs::metadata(&victim).unwrap();
    assert_eq!((v.mode() & 0o7777, v.gid()), (0o600, 0), "link followed");

    // Without the link it serves, its socket with the configured mode and
    // group from the moment it appears; no private bind dir is left.
    std::fs::remove_file(sticky.join("kvtierd.sock")).unwrap();
    assert!(start_refused(&sticky.join("kvtierd.sock"), cfg).is_none());
    let s = std::fs::symlink_metadata(sticky.join("kvtierd.sock")).unwrap();
    assert_eq!((s.mode() & 0o777, s.gid()), (0o660, NOBODY));
    let names: Vec<_> = std::fs::read_dir(&sticky)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        names
            .iter()
            .all(|n| !n.to_string_lossy().starts_with(".kvtierd-bind")),
        "{names:?}"
    );
}

/// Starts kvtierd with its socket at `sock`; returns it once it serves.
fn serving_at(sock: &Path) -> (std::process::Child, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(support::kvtierd_bin())
        .arg("--socket")
        .arg(sock)
        .arg("--g3-dir")
        .arg(dir.path().join("g3"))
        .args(["--g3-capacity", "64MiB", "--metrics-addr", "", "--g4", ""])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    while UnixStream::connect(sock).is_err() {
        assert!(child.try_wait().unwrap().is_none(), "kvtierd exited");
        assert!(Instant::now() < until, "kvtierd did not serve");
        std::thread::sleep(Duration::from_millis(50));
    }
    (child, dir)
}

/// SIGTERM and the exit status.
fn term(mut child: std::process::Child) -> std::process::ExitStatus {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    child.wait().unwrap()
}

#[test]
fn a_linked_socket_directory_cannot_turn_shutdown_against_another_file() {
    let base = tempfile::tempdir().unwrap();
    chmod(base.path(), 0o755);
    let (a, b) = (base.path().join("a"), base.path().join("b"));
    for d in [&a, &b] {
        std::fs::create_dir(d).unwrap();
        chmod(d, 0o755);
    }
    // Root's file where a re-pointed link would lead shutdown's unlink.
    let victim = b.join("kvtierd.sock");
    std::fs::write(&victim, b"root's").unwrap();

    // A link another user owns (in a sticky directory, as in /tmp) to
    // root's directory: refused, whatever it points at now.
    let sticky = base.path().join("sticky");
    std::fs::create_dir(&sticky).unwrap();
    chmod(&sticky, 0o1777);
    let theirs = sticky.join("run");
    std::os::unix::fs::symlink(&a, &theirs).unwrap();
    std::os::unix::fs::lchown(&theirs, Some(NOBODY), Some(NOBODY)).unwrap();
    let (st, err) = start_refused(&theirs.join("kvtierd.sock"), "").expect("started");
    assert!(!st.success());
    assert!(err.contains("symbolic link owned by uid 65534"), "{err}");

    // Root's own link is followed; re-pointed while the daemon runs, the
    // shutdown still removes the socket it bound, nothing at the new target.
    let ours = base.path().join("link");
    std::os::unix::fs::symlink(&a, &ours).unwrap();
    let (child, _g3) = serving_at(&ours.join("kvtierd.sock"));
    std::fs::remove_file(&ours).unwrap();
    std::os::unix::fs::symlink(&b, &ours).unwrap();
    assert!(term(child).success());
    assert_eq!(
        std::fs::read(&victim).unwrap(),
        b"root's",
        "unlinked through the link"
    );
    assert!(!a.join("kvtierd.sock").exists(), "its own socket left");

    // Its socket replaced by another process's live one: left alone.
    let sock = a.join("kvtierd.sock");
    let (child, _g3) = serving_at(&sock);
    std::fs::rename(&sock, a.join("moved.sock")).unwrap();
    let other = UnixListener::bind(&sock).unwrap();
    assert!(term(child).success());
    assert!(
        UnixStream::connect(&sock).is_ok(),
        "another's live socket removed"
    );
    drop(other);
}

// ---- L5: connections before their hello ------------------------------

/// Runs `f` on a fresh thread whose effective uid and gid are `uid` (raw
/// syscalls change only the calling thread's credentials; glibc's
/// wrappers would change the whole test process). The kernel records the
/// connecting thread's credentials (SO_PEERCRED) at connect.
fn as_euid<T: Send + 'static>(uid: u32, f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        let keep = -1 as libc::c_long;
        // SAFETY: plain syscalls on this thread's credentials.
        unsafe {
            assert_eq!(
                libc::syscall(libc::SYS_setresgid, keep, uid as libc::c_long, keep),
                0
            );
            assert_eq!(
                libc::syscall(libc::SYS_setresuid, keep, uid as libc::c_long, keep),
                0
            );
        }
        f()
    })
    .join()
    .unwrap()
}

/// A daemon whose socket everyone may open, with `cfg` added.
fn open_daemon(cfg: &str) -> (Daemon, tempfile::TempDir) {
    let cdir = tempfile::tempdir().unwrap();
    let path = cdir.path().join("kvtierd.toml");
    std::fs::write(&path, format!("[server]\nsocket_mode = \"0666\"\n{cfg}\n")).unwrap();
    let d = Daemon::start_with(&["--config".into(), path.display().to_string()], &[]);
    chmod(d.dir.path(), 0o755);
    (d, cdir)
}

#[test]
fn a_silent_connection_is_closed_at_the_hello_deadline() {
    let (d, _c) = open_daemon("hello_timeout_ms = 1000\n");
    let s = UnixStream::connect(&d.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let t = Instant::now();
    let mut b = [0u8; 1];
    // Closed (EOF), not left for idle_timeout_ms (600 s).
    let r = nix::sys::socket::recv(s.as_raw_fd(), &mut b, nix::sys::socket::MsgFlags::empty());
    assert_eq!(r, Ok(0), "after {:?}", t.elapsed());
    daemon_serves(&d);
}

#[test]
fn one_uid_cannot_lock_others_out_in_single_tenant_mode() {
    // Long hello deadline: only the per-uid bounds can save the slots.
    let (d, _c) = open_daemon("hello_timeout_ms = 120000\nmax_connections = 1024\n");
    // uid nobody opens more silent connections than the daemon serves.
    let sock = d.socket.clone();
    let silent: Vec<UnixStream> = as_euid(NOBODY, move || {
        (0..1100)
            .filter_map(|_| UnixStream::connect(&sock).ok())
            .collect()
    });
    assert!(silent.len() >= 1024, "{}", silent.len());
    // Root is still served, at once.
    daemon_serves(&d);

    // nobody past its hello on as many connections as it can get: its
    // share (half of max_connections) ends, root is still served.
    drop(silent);
    let sock = d.socket.clone();
    let held: Vec<Client> = as_euid(NOBODY, move || {
        let mut held = Vec::new();
        for _ in 0..1100 {
            let mut cfg = ClientConfig::new(&sock);
            cfg.region_bytes = 0;
            let c = Client::with_config(cfg);
            match c.ensure_connected() {
                Ok(()) => held.push(c),
                Err(_) => break,
            }
        }
        held
    });
    assert!(held.len() < 1024, "nobody held {}", held.len());
    daemon_serves(&d);
}

/// As `uid`, subscribes to events until refused (at most `n`); the
/// subscriptions held.
fn subscribe_all_as(uid: u32, socket: &Path, n: usize) -> Vec<kvtier_client::EventStream> {
    let socket = socket.to_path_buf();
    as_euid(uid, move || {
        let c = Client::with_config(ClientConfig::new(&socket));
        (0..n).map_while(|_| c.subscribe_events().ok()).collect()
    })
}

/// As `uid`, connects until refused (at most `n`); the clients held.
fn connect_all_as(uid: u32, socket: &Path, n: usize) -> Vec<Client> {
    let socket = socket.to_path_buf();
    as_euid(uid, move || {
        (0..n)
            .map_while(|_| {
                let mut cfg = ClientConfig::new(&socket);
                cfg.region_bytes = 0;
                let c = Client::with_config(cfg);
                c.ensure_connected().ok().map(|()| c)
            })
            .collect()
    })
}

/// Issue #42: in single-tenant mode one uid held all 64 event
/// subscriptions and two uids all the connections, locking root's
/// `kvtier events` and `kvtier stats` out. The last few of each are kept
/// for admins.
#[test]
fn other_uids_filling_subscriptions_and_connections_leave_roots_share() {
    let (d, _c) = open_daemon("max_connections = 160\n");
    // One uid holds half of the 64 at most (without tenants too), so a
    // second user still subscribes; together they never take the 4 kept
    // for admins, and a third user gets none of those; root's `kvtier
    // events` subscribes.
    let subs = subscribe_all_as(NOBODY, &d.socket, 80);
    assert_eq!(subs.len(), 32, "nobody held {}", subs.len());
    let more = subscribe_all_as(UID_B, &d.socket, 80);
    assert_eq!(more.len(), 64 - 32 - 4, "a second user held {}", more.len());
    assert!(
        subscribe_all_as(UID_A, &d.socket, 1).is_empty(),
        "another user took a subscription kept for admins"
    );
    let root = Client::with_config(ClientConfig::new(&d.socket));
    let roots_events = root
        .subscribe_events()
        .unwrap_or_else(|e| panic!("root's subscription refused: {e}"));
    drop((subs, more, roots_events));
    // The daemon lets the closed subscriptions' connections go (root's
    // stats connection stays).
    let t = Instant::now();
    while root.stats().unwrap()["connections"].as_u64() != Some(1) {
        assert!(t.elapsed() < Duration::from_secs(20), "subscriptions held");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Two users take every connection they can get (half each); root is
    // still served and still subscribes.
    let a = connect_all_as(NOBODY, &d.socket, 200);
    let b = connect_all_as(UID_A, &d.socket, 200);
    assert_eq!(a.len() + b.len(), 160 - 8 - 1, "{} + {}", a.len(), b.len());
    assert!(
        connect_all_as(UID_B, &d.socket, 1).is_empty(),
        "a third user took a connection kept for admins"
    );
    daemon_serves(&d);
    root.subscribe_events()
        .unwrap_or_else(|e| panic!("root's subscription refused: {e}"));
    drop((a, b));
}

// ---- M2 / L4: the peer and metrics ports ------------------------------

/// Opens `n` TCP connections to `addr` that never send a byte.
fn silent_tcp(addr: &str, n: usize) -> Vec<std::net::TcpStream> {
    (0..n)
        .filter_map(|_| std::net::TcpStream::connect(addr).ok())
        .collect()
}

#[test]
fn silent_connections_do_not_starve_the_metrics_port() {
    let d = Daemon::start();
    let flood = silent_tcp(&d.metrics_addr, 80);
    assert_eq!(flood.len(), 80);
    for _ in 0..5 {
        let (status, body) = d.http_get("/metrics");
        assert!(status.contains("200"), "{status:?}");
        assert!(body.contains("# TYPE kvtier_"), "{body}");
        let (status, _) = d.http_get("/healthz");
        assert!(status.contains("200"), "{status:?}");
    }
    drop(flood);
}

const PEER_SECRET: &[u8] = b"0123456789abcdef-security-tests";

/// A daemon with its peer server on, one block stored; returns the daemon,
/// the peer address, the block's path and its file bytes.
fn peer_daemon() -> (Daemon, tempfile::TempDir, String, String, Vec<u8>) {
    peer_daemon_named("node-a")
}

/// [`peer_daemon`] with node id `node_id`.
fn peer_daemon_named(node_id: &str) -> (Daemon, tempfile::TempDir, String, String, Vec<u8>) {
    let sdir = tempfile::tempdir().unwrap();
    let peer_addr = format!("127.0.0.1:{}", support::free_port());
    let d = Daemon::start_with(
        &support::peer_node_args(
            sdir.path(),
            PEER_SECRET,
            &peer_addr,
            &["--node-id".into(), node_id.into()],
        ),
        &[],
    );
    let ns = peer_test_ns();
    let c = Client::with_config(ClientConfig::new(&d.socket));
    let h = c.namespace(&ns);
    let keys = h.hash_chain(&(0..16).collect::<Vec<u32>>());
    let out = h.offload_chain(
        None,
        &keys,
        &[&[9u8; 4096][..]],
        kvtier_client::Hints::default(),
    );
    assert!(
        matches!(out[0], kvtier_client::OffloadOutcome::Stored),
        "{out:?}"
    );
    let path = kvtier_daemon::tiers::peer::wire::block_url_path(&ns.id(), &keys[0]);
    let file = std::fs::read(
        d.dir
            .path()
            .join("g3")
            .join(kvtier_client::block_path(&ns.id(), &keys[0])),
    )
    .unwrap_or_default();
    (d, sdir, peer_addr, path, file)
}

/// Who the peer server at `addr` says requests must be signed for (its
/// node id and the epoch of its start), from the answer to a request
/// signed for no node.
fn target_of(addr: &str) -> kvtier_daemon::tiers::peer::auth::Target {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let req = signed_request_for(addr, &Default::default(), "/");
    s.write_all(&req).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let head = String::from_utf8_lossy(&out).to_string();
    let line = head
        .lines()
        .find_map(|l| l.strip_prefix("x-kvtier-node: "))
        .unwrap_or_else(|| panic!("no x-kvtier-node in {head}"));
    kvtier_daemon::tiers::peer::auth::Target::parse(line.trim()).unwrap()
}

/// One signed GET of `path` as bytes on the wire, for the node at `addr`.
fn signed_request(addr: &str, path: &str) -> Vec<u8> {
    signed_request_for(addr, &target_of(addr), path)
}

/// One signed GET of `path` to `addr`, signed for `to`.
fn signed_request_for(
    addr: &str,
    to: &kvtier_daemon::tiers::peer::auth::Target,
    path: &str,
) -> Vec<u8> {
    let key = kvtier_daemon::tiers::peer::auth::PeerKey::from_secret(PEER_SECRET).unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: {}\r\nConnection: close\r\n\r\n",
        key.sign("GET", path, "", to, now)
    )
    .into_bytes()
}

/// Sends `req` on a new connection; (status, body). Status 0: the
/// connection was closed without an answer.
fn send_raw(addr: &str, req: &[u8]) -> (u16, Vec<u8>) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    if s.write_all(req).is_err() {
        return (0, Vec::new());
    }
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let Some(end) = out.windows(4).position(|w| w == b"\r\n\r\n") else {
        return (0, Vec::new());
    };
    let head = String::from_utf8_lossy(&out[..end]).to_string();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, out[end + 4..].to_vec())
}

#[test]
fn silent_connections_do_not_starve_signed_peer_requests() {
    let (_d, _s, addr, path, file) = peer_daemon();
    let flood = silent_tcp(&addr, 300);
    assert_eq!(flood.len(), 300);
    for i in 0..6 {
        let (status, body) = send_raw(&addr, &signed_request(&addr, &path));
        assert_eq!(
            status, 200,
            "signed request {i} behind 300 silent connections"
        );
        if !file.is_empty() {
            assert!(body == file, "request {i}: wrong bytes");
        }
    }
    drop(flood);
}

#[test]
fn a_captured_peer_request_replayed_is_refused() {
    let (_d, _s, addr, path, _) = peer_daemon();
    let captured = signed_request(&addr, &path);
    assert_eq!(send_raw(&addr, &captured).0, 200);
    // Well within the ±30 s window.
    std::thread::sleep(Duration::from_secs(1));
    let (status, body) = send_raw(&addr, &captured);
    assert_eq!(status, 401, "replay served ({} bytes)", body.len());
    assert!(String::from_utf8_lossy(&body).contains("replayed"));
    // A fresh signature for the same block is served.
    assert_eq!(send_raw(&addr, &signed_request(&addr, &path)).0, 200);
}

/// Issue #42: a signed peer request named no receiver, so one captured
/// on its way to node A was served by node B, which shares the secret.
/// Requests are signed for one node (and one start of it).
#[test]
fn a_peer_request_signed_for_one_node_is_refused_by_another() {
    let (_a, _sa, addr_a, path, _) = peer_daemon_named("node-a");
    let (_b, _sb, addr_b, path_b, _) = peer_daemon_named("node-b");
    assert_eq!(path, path_b, "both nodes hold the same block");
    let to_a = target_of(&addr_a);
    assert_eq!(to_a.node, "node-a");
    // Captured on its way to A, before A saw it: B refuses it...
    let captured = signed_request_for(&addr_b, &to_a, &path);
    let (status, body) = send_raw(&addr_b, &captured);
    assert_eq!(status, 401, "B served A's request ({} bytes)", body.len());
    assert!(
        String::from_utf8_lossy(&body).contains("another node"),
        "{}",
        String::from_utf8_lossy(&body)
    );
    // ...as does A for a request signed for B; each serves its own.
    let for_b = signed_request_for(&addr_a, &target_of(&addr_b), &path);
    assert_eq!(send_raw(&addr_a, &for_b).0, 401);
    assert_eq!(send_raw(&addr_a, &signed_request(&addr_a, &path)).0, 200);
    assert_eq!(send_raw(&addr_b, &signed_request(&addr_b, &path)).0, 200);
}

/// Issue #42: the memory of accepted signatures did not survive a
/// restart, so a captured request replayed after one was served again.
/// The node's epoch (recorded in g3.dir, larger at every start whatever
/// the clock says) is signed: the request of the run before names an
/// epoch that is gone.
#[test]
fn a_captured_peer_request_replayed_after_a_restart_is_refused() {
    let (mut d, _s, addr, path, _) = peer_daemon();
    let captured = signed_request(&addr, &path);
    assert_eq!(send_raw(&addr, &captured).0, 200);
    d.restart();
    let t = Instant::now();
    let (status, body) = loop {
        match std::net::TcpStream::connect(&addr) {
            Ok(_) => break send_raw(&addr, &captured),
            Err(e) => assert!(t.elapsed() < Duration::from_secs(20), "{e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status, 401, "replay served ({} bytes)", body.len());
    assert_eq!(send_raw(&addr, &signed_request(&addr, &path)).0, 200);
}

// ---- M3: leases cannot hold the cache against eviction ----------------

const UID_A: u32 = 61101;
const UID_B: u32 = 61102;
const BIG: u64 = 2 << 20;

fn tenant_ns(t: &str) -> kvtier_client::Namespace {
    kvtier_client::Namespace::new(
        "lease",
        kvtier_client::KvLayout::with_block_bytes(BIG).unwrap(),
        "",
        t,
    )
    .unwrap()
}

/// Offloads `n` blocks of tenant `t` as `uid`; the outcomes.
fn offload_as(uid: u32, socket: &Path, t: &'static str, n: usize) -> Vec<String> {
    let socket = socket.to_path_buf();
    as_euid(uid, move || {
        let mut cfg = ClientConfig::new(&socket);
        cfg.timeout_ms = 120_000;
        let c = Client::with_config(cfg);
        c.ensure_connected().unwrap();
        let ns = tenant_ns(t);
        let h = c.namespace(&ns);
        let keys = h.hash_chain(&(0..n as u32 * 16).collect::<Vec<u32>>());
        let data: Vec<Vec<u8>> = (0..n).map(|i| vec![i as u8 + 1; BIG as usize]).collect();
        let refs: Vec<&[u8]> = data.iter().map(|v| &v[..]).collect();
        h.offload_chain(None, &keys, &refs, kvtier_client::Hints::default())
            .iter()
            .map(|o| format!("{o:?}"))
            .collect()
    })
}

/// As `uid`, leases every block of tenant `t` (direct onboard, 30 s, never
/// released) on a connection kept open; the items' statuses.
fn hold_leases_as(uid: u32, socket: &Path, t: &'static str, n: usize) -> (UnixStream, Vec<String>) {
    let socket = socket.to_path_buf();
    as_euid(uid, move || {
        let s = UnixStream::connect(&socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        proto::send_frame(s.as_raw_fd(), &hello(1), &[]).unwrap();
        assert!(matches!(
            reply(&s, proto::OP_HELLO),
            Some(Response::Hello { .. })
        ));
        let ns = tenant_ns(t);
        let keys = ns.hash_chain(&(0..n as u32 * 16).collect::<Vec<u32>>());
        let req = Request::Onboard {
            ns: ns.id(),
            mode: proto::OnboardMode::DirectFd,
            lease_ttl_ms: 30_000,
            items: keys
                .iter()
                .map(|k| proto::OnboardItem {
                    key: *k,
                    shm_offset: 0,
                    shm_len: 0,
                })
                .collect(),
        };
        proto::send_frame(s.as_raw_fd(), &req.encode(2), &[]).unwrap();
        let Some(Response::Onboard { items }) = reply(&s, proto::OP_ONBOARD) else {
            panic!("onboard reply")
        };
        let st = items.iter().map(|i| format!("{:?}", i.status)).collect();
        (s, st)
    })
}

/// A kvtierd of 64 MiB (support's Daemon fixes 256 MiB by flag), its
/// socket open to every uid; killed on drop.
struct Small {
    dir: tempfile::TempDir,
    child: std::process::Child,
    socket: std::path::PathBuf,
}

impl Small {
    fn start(cfg: &str) -> Small {
        let dir = tempfile::tempdir().unwrap();
        chmod(dir.path(), 0o755);
        let cfg_path = dir.path().join("kvtierd.toml");
        std::fs::write(
            &cfg_path,
            format!("[server]\nsocket_mode = \"0666\"\n\n[g3]\ncapacity = \"64MiB\"\n\n{cfg}"),
        )
        .unwrap();
        let socket = dir.path().join("kvtierd.sock");
        let child = std::process::Command::new(support::kvtierd_bin())
            .arg("--config")
            .arg(&cfg_path)
            .arg("--socket")
            .arg(&socket)
            .arg("--g3-dir")
            .arg(dir.path().join("g3"))
            .args(["--metrics-addr", "", "--g4", ""])
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        support::wait_for_socket(&socket, Duration::from_secs(20));
        Small { dir, child, socket }
    }
}

impl Drop for Small {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = &self.dir;
    }
}

#[test]
fn one_tenant_re_leasing_its_blocks_cannot_make_anothers_offloads_fail() {
    let d = Small::start(&format!(
        "[[tenants]]\nname = \"a\"\nuids = [{UID_A}]\nnamespaces = [\"{}\"]\n\n\
         [[tenants]]\nname = \"b\"\nuids = [{UID_B}]\nnamespaces = [\"{}\"]\n",
        tenant_ns("a").id().to_hex(),
        tenant_ns("b").id().to_hex(),
    ));
    // A fills 58 of 64 MiB and leases all of it, again and again.
    let a = offload_as(UID_A, &d.socket, "a", 29);
    assert!(a.iter().all(|o| o == "Stored"), "{a:?}");
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(hold_leases_as(UID_A, &d.socket, "a", 29));
    }
    // B's offloads evict A's unleased blocks and succeed.
    let b = offload_as(UID_B, &d.socket, "b", 20);
    assert!(b.iter().all(|o| o == "Stored"), "{b:?}");
    // A holds at most its share (a quarter of 64 MiB) leased.
    let leased: Vec<usize> = held
        .iter()
        .map(|(_, st)| st.iter().filter(|s| *s == "Ok").count())
        .collect();
    assert!(
        (1..8).contains(&leased.iter().sum::<usize>()),
        "A leased {leased:?} blocks of 2 MiB"
    );
    drop(held);
}

/// Tenant A's second uid.
const UID_A2: u32 = 61103;

/// A small daemon with tenant "a" (uids `UID_A`, `UID_A2`) and tenant "b"
/// (`UID_B`), each with its own namespace.
fn two_tenants() -> Small {
    Small::start(&format!(
        "[[tenants]]\nname = \"a\"\nuids = [{UID_A}, {UID_A2}]\nnamespaces = [\"{}\"]\n\n\
         [[tenants]]\nname = \"b\"\nuids = [{UID_B}]\nnamespaces = [\"{}\"]\n",
        tenant_ns("a").id().to_hex(),
        tenant_ns("b").id().to_hex(),
    ))
}

/// Issue #42: shares were per uid, so a tenant with two uids held two
/// (and starved another tenant's offloads: 24 of 30 `LimitReached`).
#[test]
fn a_tenant_with_two_uids_holds_one_share() {
    let d = two_tenants();
    let a = offload_as(UID_A, &d.socket, "a", 29);
    assert!(a.iter().all(|o| o == "Stored"), "{a:?}");
    // Each of A's uids leases all of A's blocks.
    let held: Vec<_> = [UID_A, UID_A2]
        .into_iter()
        .map(|uid| hold_leases_as(uid, &d.socket, "a", 29))
        .collect();
    let b = offload_as(UID_B, &d.socket, "b", 20);
    assert!(b.iter().all(|o| o == "Stored"), "{b:?}");
    // Both uids together hold the tenant's one share (a quarter of 64 MiB).
    let leased: usize = held
        .iter()
        .map(|(_, st)| st.iter().filter(|s| *s == "Ok").count())
        .sum();
    assert!(
        (1..8).contains(&leased),
        "tenant A leased {leased} blocks of 2 MiB"
    );
    drop(held);
}

/// As `uid`, pins blocks `from..n` of tenant `t` for a minute; the
/// items' statuses.
fn pin_as(uid: u32, socket: &Path, t: &'static str, from: usize, n: usize) -> Vec<String> {
    let socket = socket.to_path_buf();
    as_euid(uid, move || {
        let s = UnixStream::connect(&socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        proto::send_frame(s.as_raw_fd(), &hello(1), &[]).unwrap();
        assert!(matches!(
            reply(&s, proto::OP_HELLO),
            Some(Response::Hello { .. })
        ));
        let ns = tenant_ns(t);
        let req = Request::Pin {
            ns: ns.id(),
            ttl_ms: 60_000,
            keys: ns.hash_chain(&(0..n as u32 * 16).collect::<Vec<u32>>())[from..].to_vec(),
        };
        proto::send_frame(s.as_raw_fd(), &req.encode(2), &[]).unwrap();
        let Some(Response::Items { status }) = reply(&s, proto::OP_PIN) else {
            panic!("pin reply")
        };
        status.iter().map(|s| format!("{s:?}")).collect()
    })
}

/// Issue #42: pins were bounded per uid in count and node-wide in bytes,
/// so one tenant (two uids) pinned half of G3 and another tenant could
/// pin nothing. Pinned bytes are now the tenant's share.
#[test]
fn a_tenant_with_two_uids_pins_within_its_share_of_bytes() {
    let d = two_tenants();
    let a = offload_as(UID_A, &d.socket, "a", 20);
    assert!(a.iter().all(|o| o == "Stored"), "{a:?}");
    let b = offload_as(UID_B, &d.socket, "b", 8);
    assert!(b.iter().all(|o| o == "Stored"), "{b:?}");
    // A's first uid pins all of A's blocks, its second uid those the
    // first could not: together they hold the tenant's one share (an
    // eighth of 64 MiB: 3 blocks of 2 MiB).
    let pinned_a: usize = [(UID_A, 0), (UID_A2, 3)]
        .into_iter()
        .map(|(uid, from)| {
            let st = pin_as(uid, &d.socket, "a", from, 20);
            assert!(
                st.iter().all(|s| s == "Ok" || s == "LimitReached"),
                "{st:?}"
            );
            st.iter().filter(|s| *s == "Ok").count()
        })
        .sum();
    assert_eq!(pinned_a, 3, "tenant A pinned {pinned_a} blocks of 2 MiB");
    // Nor does an offload's pin hint go past it: stored, unpinned.
    let socket = d.socket.clone();
    let hinted = as_euid(UID_A2, move || {
        let c = Client::with_config(ClientConfig::new(&socket));
        let h = c.namespace(&tenant_ns("a"));
        let keys = h.hash_chain(&(7_000_000..7_000_016).collect::<Vec<u32>>());
        let hints = kvtier_client::Hints {
            pinned: true,
            ..Default::default()
        };
        let p = vec![7u8; BIG as usize];
        format!("{:?}", h.offload_chain(None, &keys, &[&p[..]], hints))
    });
    assert_eq!(hinted, "[StoredUnpinned]");
    // B still pins its own share.
    let st = pin_as(UID_B, &d.socket, "b", 0, 8);
    assert_eq!(
        st.iter().filter(|s| *s == "Ok").count(),
        3,
        "B's pins: {st:?}"
    );
}

// ---- issue #42: hostile ZMTP frames on the ZMQ endpoints -------------

const ZMQ_NS: &str = "0123456789abcdef0123456789abcdef";

/// A ZMTP 3.0 greeting, NULL mechanism, as a client.
fn zmtp_greeting() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A READY command naming `socket_type`.
fn zmtp_ready(socket_type: &str) -> Vec<u8> {
    let mut body = b"\x05READY\x0bSocket-Type".to_vec();
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    let mut f = vec![0x04, body.len() as u8];
    f.extend(body);
    f
}

/// What a hostile peer sends to an endpoint whose peers are `socket_type`:
/// 73 bytes whose command header announces 64 TiB (the one that aborted
/// the daemon), a message frame announcing as much after a proper
/// handshake, and a multipart message of small frames that together pass
/// the bound.
fn hostile_zmtp(socket_type: &str) -> Vec<(&'static str, Vec<u8>)> {
    let huge = (1u64 << 46).to_be_bytes();
    let mut command = zmtp_greeting();
    command.push(0x06);
    command.extend_from_slice(&huge);
    let mut message = zmtp_greeting();
    message.extend(zmtp_ready(socket_type));
    message.push(0x02);
    message.extend_from_slice(&huge);
    let mut parts = zmtp_greeting();
    parts.extend(zmtp_ready(socket_type));
    for _ in 0..300 {
        parts.extend_from_slice(&[0x01, 0xff]);
        parts.extend_from_slice(&[b'x'; 255]);
    }
    vec![
        ("long command", command),
        ("long message frame", message),
        ("endless multipart message", parts),
    ]
}

/// Sends `bytes` to a `tcp://` or `ipc://` endpoint and says whether the
/// daemon closed the connection within 10 s (it never half-closes first).
fn daemon_hangs_up(ep: &str, bytes: &[u8]) -> bool {
    use std::io::{Read, Write};
    // The publisher binds after the daemon's socket appears.
    let t = Instant::now();
    let mut s: Box<dyn ReadWrite> = loop {
        let c: std::io::Result<Box<dyn ReadWrite>> = match ep.strip_prefix("ipc://") {
            Some(p) => UnixStream::connect(p).map(|s| Box::new(s) as _),
            None => std::net::TcpStream::connect(ep.trim_start_matches("tcp://"))
                .map(|s| Box::new(s) as _),
        };
        match c {
            Ok(s) => break s,
            Err(e) => assert!(t.elapsed() < Duration::from_secs(20), "{ep}: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    s.timeout(Duration::from_secs(10));
    // The daemon may hang up before it has read everything.
    let _ = s.write_all(bytes);
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

trait ReadWrite: std::io::Read + std::io::Write {
    fn timeout(&self, d: Duration);
}
impl ReadWrite for UnixStream {
    fn timeout(&self, d: Duration) {
        self.set_read_timeout(Some(d)).unwrap();
    }
}
impl ReadWrite for std::net::TcpStream {
    fn timeout(&self, d: Duration) {
        self.set_read_timeout(Some(d)).unwrap();
    }
}

/// A real subscriber gets a (heartbeat) batch and a real replay client
/// its end-of-replay answer.
fn zmq_endpoints_serve(pub_ep: &str, replay_ep: &str) {
    use zeromq::{Socket, SocketRecv, SocketSend};
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut sub = zeromq::SubSocket::new();
        sub.connect(pub_ep).await.unwrap();
        sub.subscribe("").await.unwrap();
        let m = tokio::time::timeout(Duration::from_secs(10), sub.recv())
            .await
            .expect("no batch on the PUB endpoint")
            .unwrap();
        assert_eq!(m.len(), 3, "{m:?}");
        let mut dealer = zeromq::DealerSocket::new();
        dealer.connect(replay_ep).await.unwrap();
        let mut ask = zeromq::ZmqMessage::from(Vec::<u8>::new());
        ask.push_back(u64::MAX.to_be_bytes().to_vec().into());
        dealer.send(ask).await.unwrap();
        let m = tokio::time::timeout(Duration::from_secs(10), dealer.recv())
            .await
            .expect("no answer on the replay endpoint")
            .unwrap();
        assert_eq!(m.get(2).map(|f| f.to_vec()), Some(vec![0xff; 8]), "{m:?}");
    });
}

#[test]
fn hostile_zmtp_frames_on_each_zmq_endpoint_leave_the_daemon_serving() {
    let ipc = tempfile::tempdir().unwrap();
    chmod(ipc.path(), 0o755);
    let ipc_ep = |name: &str| format!("ipc://{}", ipc.path().join(name).display());
    let tcp_ep = || format!("tcp://127.0.0.1:{}", support::free_port());
    // Each endpoint kind on each transport: PUB on TCP with replay on
    // ipc (0666, any local user: the worst group setup), and the reverse.
    for (pub_ep, replay_ep) in [
        (tcp_ep(), ipc_ep("replay.ipc")),
        (ipc_ep("pub.ipc"), tcp_ep()),
    ] {
        let (mut d, _c) = open_daemon(&format!(
            "[events.zmq]\nendpoint = \"{pub_ep}\"\nreplay_endpoint = \"{replay_ep}\"\n\
             ipc_mode = \"0666\"\nheartbeat_ms = 200\n\
             [[events.zmq.namespaces]]\nid = \"{ZMQ_NS}\"\n"
        ));
        for (ep, peer) in [(&pub_ep, "SUB"), (&replay_ep, "DEALER")] {
            for (what, bytes) in hostile_zmtp(peer) {
                let ep2 = ep.clone();
                let hung_up = as_euid(NOBODY, move || daemon_hangs_up(&ep2, &bytes));
                assert!(hung_up, "{ep}: {what}: the daemon kept the connection");
                daemon_serves(&d);
            }
        }
        zmq_endpoints_serve(&pub_ep, &replay_ep);
        let st = d.term(Duration::from_secs(20)).expect("no exit on SIGTERM");
        assert!(st.success(), "{st:?}");
    }
}

// ---- issue #42: signals an operator sends ----------------------------

#[test]
fn sighup_is_logged_and_the_daemon_keeps_serving() {
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("kvtierd.log");
    let mut d = Daemon::start_logged(&[], &log);
    let pid = nix::unistd::Pid::from_raw(d.pid());
    for _ in 0..2 {
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        daemon_serves(&d);
    }
    let t = Instant::now();
    let said = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .matches("SIGHUP: ignored")
            .count()
    };
    while said() < 2 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(said(), 2, "{}", std::fs::read_to_string(&log).unwrap());
    let st = d.term(Duration::from_secs(20)).expect("no exit on SIGTERM");
    assert!(st.success(), "{st:?}");
}

// ---- issue #42: corrupt reports the daemon's copy contradicts --------

#[test]
fn corrupt_reports_the_daemons_copy_contradicts_cannot_flood_the_log() {
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("kvtierd.log");
    let d = Daemon::start_logged(&[], &log);
    let c = Client::with_config(ClientConfig::new(&d.socket));
    // A decoy namespace: every key absent.
    let decoy = kvtier_client::NamespaceId([0x42; 16]);
    let keys: Vec<kvtier_client::BlockKey> = (1..=proto::KEYS_MAX as u64)
        .map(kvtier_client::BlockKey::from_u64)
        .collect();
    let t = Instant::now();
    for _ in 0..5 {
        c.report_corrupt(decoy, &keys).unwrap();
    }
    let secs = t.elapsed().as_secs();
    daemon_serves(&d);
    let lines = std::fs::read_to_string(&log)
        .unwrap()
        .matches("reported a corrupt block")
        .count() as u64;
    assert!(
        (1..=secs + 2).contains(&lines),
        "{lines} lines for {} reports in {secs} s",
        5 * keys.len()
    );
}

// ---- issue #42: namespaces per uid -----------------------------------

#[test]
fn one_uid_holds_blocks_in_a_bounded_number_of_namespaces() {
    let (d, _c) = open_daemon("[access]\nnamespaces_per_uid_max = 3\n");
    // Each namespace costs directories on the disk: nobody's fourth and
    // fifth are refused, its first three still take blocks.
    let mut got = Vec::new();
    for t in ["ns1", "ns2", "ns3", "ns4", "ns5", "ns1"] {
        got.extend(offload_as(NOBODY, &d.socket, t, 1));
    }
    assert!(
        got[..3].iter().all(|o| o == "Stored")
            && got[3..5].iter().all(|o| o.contains("Limit"))
            && got[5] == "AlreadyPresent",
        "{got:?}"
    );
    // Root is not bounded.
    assert_eq!(offload_as(0, &d.socket, "ns6", 1), ["Stored"]);
    daemon_serves(&d);
}

// ---- issue #42: /healthz when peers refuse us ------------------------

#[test]
fn healthz_is_degraded_while_a_peer_refuses_our_secret() {
    let (b, _s, b_addr, _path, _) = peer_daemon();
    let sdir = tempfile::tempdir().unwrap();
    let a = Daemon::start_with(
        &support::peer_node_args(
            sdir.path(),
            b"not-the-secret-node-b-has-0123456",
            &format!("127.0.0.1:{}", support::free_port()),
            &["--peers".into(), format!("b={b_addr}")],
        ),
        &[],
    );
    // A asks B for the block B holds: B refuses A's signature.
    let ns = peer_test_ns();
    let c = Client::with_config(ClientConfig::new(&a.socket));
    let h = c.namespace(&ns);
    let keys = h.hash_chain(&(0..16).collect::<Vec<u32>>());
    let t = Instant::now();
    let mut body = String::new();
    while t.elapsed() < Duration::from_secs(20) {
        let _ = h.lookup(&keys);
        body = a.http_get("/healthz").1;
        if body.contains("refuses our requests") {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        body.starts_with("degraded") && body.contains(&b_addr) && body.contains("peer.secret"),
        "{body}"
    );
    daemon_serves(&b);
}

// ---- issue #42: hostile lengths on the HTTP ports --------------------

/// Sends `req` to `addr` and waits (up to 2 s) for the daemon's first
/// answer or its close.
fn send_hostile_http(addr: &str, req: &[u8]) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let _ = s.write_all(req);
    let _ = s.read(&mut [0u8; 4096]);
}

/// The daemon's resident memory, KiB.
fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn hostile_lengths_on_the_peer_and_metrics_ports_leave_the_daemon_serving() {
    let (d, _s, peer_addr, path, _) = peer_daemon();
    let before = rss_kib(d.pid());
    let mut rng = 0x42u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for addr in [d.metrics_addr.clone(), peer_addr.clone()] {
        for case in 0..12 {
            let len = match case % 3 {
                0 => u64::MAX - (next() % 1024),
                1 => 1 << (30 + next() % 34),
                _ => next(),
            };
            let req = match case % 4 {
                // A body announced, never sent.
                0 => format!("POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len}\r\n\r\nab"),
                // A chunk announced, never sent.
                1 => format!(
                    "POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n{len:x}\r\nab"
                ),
                // A header line longer than any buffer.
                2 => format!(
                    "GET {path} HTTP/1.1\r\nHost: x\r\nX-Pad: {}\r\n\r\n",
                    "a".repeat(1 << 20)
                ),
                // A range whose bounds overflow.
                _ => format!("GET {path} HTTP/1.1\r\nHost: x\r\nRange: bytes={len}-{}\r\n\r\n", len / 2),
            };
            let addr2 = addr.clone();
            as_euid(NOBODY, move || send_hostile_http(&addr2, req.as_bytes()));
        }
        let (status, _) = d.http_get("/healthz");
        assert!(status.contains("200"), "{status}");
        daemon_serves(&d);
    }
    // Nothing announced was allocated (the daemon's own growth aside).
    let after = rss_kib(d.pid());
    assert!(after < before + 256 * 1024, "RSS {before} -> {after} KiB");
    assert_eq!(
        send_raw(&peer_addr, &signed_request(&peer_addr, &path)).0,
        200
    );
}

/// The namespace the two-node peer tests store and fetch in.
fn peer_test_ns() -> kvtier_client::Namespace {
    kvtier_client::Namespace::new(
        "peer",
        kvtier_client::KvLayout::with_block_bytes(4096).unwrap(),
        "",
        "t",
    )
    .unwrap()
}
