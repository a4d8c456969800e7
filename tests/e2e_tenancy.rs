//! End-to-end: tenants and local users (issue #14) against a real kvtierd
//! with `[[tenants]]`, driven by real processes of other uids: this test
//! binary re-executed as uid A, B or a stranger (the suite runs as root in
//! CI; without root the tests say so and skip).
//!
//! Tenant A cannot list, look up, read (shared region or passed fd),
//! evict, pin, stat, offload into or subscribe to tenant B's blocks, on the
//! socket or through the mount (with `allow_other`); a stranger is refused;
//! one uid exhausting its connections, leases, pins, subscriptions or
//! in-flight fetches (onboards waiting on a G4 that never answers) leaves
//! another uid served, and gets `LimitReached` at once, never a stall.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kvtier_client::proto::{
    self, code, EvictTier, ItemStatus, OnboardItem, OnboardMode, Request, Response,
};
use kvtier_client::{
    block_path, BlockKey, Client, ClientConfig, Hints, KvLayout, Namespace, OffloadOutcome,
    Onboarded,
};
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::{free_port, kvtierd_bin, wait_for_socket};

const UID_A: u32 = 61001;
const UID_B: u32 = 61002;
const UID_STRANGER: u32 = 61003;
const BLOCK: u64 = 4096;
/// Fetch deadline of the fetch-flood test (its G4 never answers).
const FETCH_DEADLINE_MS: u64 = 3000;

fn ns_of(tenant: &str) -> Namespace {
    Namespace::new(
        "m",
        KvLayout::with_block_bytes(BLOCK).unwrap(),
        "",
        format!("salt-{tenant}"),
    )
    .unwrap()
}

fn tokens(tenant: &str) -> Vec<u32> {
    let base = if tenant == "a" { 0 } else { 1_000_000 };
    (base..base + 16 * 4).collect()
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

fn skip_unless_root(test: &str) -> bool {
    if is_root() {
        return false;
    }
    eprintln!("SKIP {test}: needs root to run clients as other uids (setuid); CI runs as root");
    true
}

// ---- the daemon ------------------------------------------------------

struct Tenancy {
    dir: tempfile::TempDir,
    child: std::process::Child,
    mnt: Option<PathBuf>,
}

impl Tenancy {
    fn start(access: &str, mount: bool) -> Tenancy {
        Self::start_with(access, "", mount)
    }

    /// Like [`Tenancy::start`] with more config; a `[g4]` there replaces
    /// the default of no G4.
    fn start_with(access: &str, extra_cfg: &str, mount: bool) -> Tenancy {
        let dir = tempfile::tempdir().unwrap();
        // Other uids must reach the socket (and the mount) inside.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        // Where workers of other uids and the test signal each other.
        let sig = dir.path().join("sig");
        std::fs::create_dir(&sig).unwrap();
        std::fs::set_permissions(&sig, std::fs::Permissions::from_mode(0o777)).unwrap();
        let cfg = format!(
            "[server]\nsocket_mode = \"0666\"\n\n\
             [[tenants]]\nname = \"a\"\nuids = [{UID_A}]\nnamespaces = [\"{}\"]\n\n\
             [[tenants]]\nname = \"b\"\nuids = [{UID_B}]\nnamespaces = [\"{}\"]\n\n\
             [access]\n{access}\n\n[mount]\nallow_other = true\n\n{extra_cfg}\n",
            ns_of("a").id().to_hex(),
            ns_of("b").id().to_hex(),
        );
        let cfg_path = dir.path().join("kvtierd.toml");
        std::fs::write(&cfg_path, cfg).unwrap();
        let sock = dir.path().join("kvtierd.sock");
        let mnt = mount.then(|| dir.path().join("mnt"));
        let mut cmd = Command::new(kvtierd_bin());
        cmd.arg("--config")
            .arg(&cfg_path)
            .arg("--socket")
            .arg(&sock)
            .arg("--g3-dir")
            .arg(dir.path().join("g3"))
            .args([
                "--g3-capacity",
                "256MiB",
                "--metrics-addr",
                &format!("127.0.0.1:{}", free_port()),
            ]);
        if !extra_cfg.contains("[g4]") {
            cmd.args(["--g4", ""]);
        }
        if let Some(m) = &mnt {
            cmd.arg("--mount").arg(m);
        }
        let child = cmd
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning kvtierd");
        wait_for_socket(&sock, Duration::from_secs(20));
        if let Some(m) = &mnt {
            let t = Instant::now();
            while !is_fuse_mount(m) {
                assert!(t.elapsed() < Duration::from_secs(20), "no mount at {m:?}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let t = Tenancy { dir, child, mnt };
        t.seed();
        t
    }

    fn sock(&self) -> PathBuf {
        self.dir.path().join("kvtierd.sock")
    }

    /// Root (an admin by default) stores 4 blocks for each tenant.
    fn seed(&self) {
        let c = Client::with_config(ClientConfig::new(self.sock()));
        for t in ["a", "b"] {
            let ns = ns_of(t);
            let h = c.namespace(&ns);
            let keys = h.hash_chain(&tokens(t));
            assert_eq!(keys.len(), 4);
            let payload = vec![t.as_bytes()[0]; BLOCK as usize];
            let p: Vec<&[u8]> = keys.iter().map(|_| &payload[..]).collect();
            let out = h.offload_chain(None, &keys, &p, Hints::default());
            assert!(
                out.iter().all(|o| matches!(o, OffloadOutcome::Stored)),
                "{out:?}"
            );
        }
    }

    /// Runs `role` as `uid` in a child process; panics with its output
    /// when it fails.
    fn run_as(&self, uid: u32, role: &str, extra: &[(&str, String)]) {
        let (ok, out) = self.spawn_as(uid, role, extra).finish();
        assert!(ok, "worker {role} as uid {uid} failed:\n{out}");
    }

    fn spawn_as(&self, uid: u32, role: &str, extra: &[(&str, String)]) -> Worker {
        let mut c = Command::new(worker_exe());
        c.args([
            "--exact",
            "tenancy_worker",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("KVTIER_TENANCY_ROLE", role)
        .env("KVTIER_TENANCY_DIR", self.dir.path())
        .uid(uid)
        .gid(uid)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        for (k, v) in extra {
            c.env(k, v);
        }
        Worker {
            child: c.spawn().unwrap(),
        }
    }

    fn keys(&self, t: &str) -> Vec<BlockKey> {
        ns_of(t).hash_chain(&tokens(t))
    }
}

impl Drop for Tenancy {
    fn drop(&mut self) {
        // A test may have killed it already.
        if !matches!(self.child.try_wait(), Ok(Some(_))) {
            // SAFETY: kill(2) on our own, unreaped child.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(10) {
                if let Ok(Some(_)) = self.child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if let Some(m) = &self.mnt {
            let _ = Command::new("fusermount3").arg("-uz").arg(m).status();
        }
    }
}

struct Worker {
    child: std::process::Child,
}

impl Worker {
    /// Waits for `p`; panics with the worker's output when it exits first.
    fn wait_file(&mut self, p: &Path) {
        let t = Instant::now();
        while !p.exists() {
            if self.child.try_wait().unwrap().is_some() {
                let w = Worker {
                    child: std::mem::replace(
                        &mut self.child,
                        Command::new("true").spawn().unwrap(),
                    ),
                };
                let (_, out) = w.finish();
                panic!("worker exited before {p:?}:\n{out}");
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "{p:?} never appeared"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn finish(mut self) -> (bool, String) {
        let t = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                let mut out = String::new();
                let _ = self.child.stdout.take().unwrap().read_to_string(&mut out);
                let _ = self.child.stderr.take().unwrap().read_to_string(&mut out);
                return (st.success(), out);
            }
            if t.elapsed() > Duration::from_secs(60) {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return (false, "timed out".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn is_fuse_mount(p: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let want = p.display().to_string();
    mounts
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some(want.as_str()) && l.contains("fuse"))
}

/// This test binary where other uids may execute it (the build tree may
/// sit under a private home directory).
fn worker_exe() -> PathBuf {
    static EXE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    EXE.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kvtier-tenancy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let dst = dir.join("worker");
        let src = std::env::current_exe().unwrap();
        if std::fs::hard_link(&src, &dst).is_err() {
            std::fs::copy(&src, &dst).unwrap();
        }
        std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o755)).unwrap();
        dst
    })
    .clone()
}

fn wait_file(p: &Path, within: Duration) {
    let t = Instant::now();
    while !p.exists() {
        assert!(t.elapsed() < within, "{p:?} never appeared");
        std::thread::sleep(Duration::from_millis(10));
    }
}

// ---- raw protocol helpers (worker side) --------------------------------

fn read_frame(s: &mut UnixStream) -> Vec<u8> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut b = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut b).unwrap();
    b
}

/// Connects and says hello; the reply (Hello, or the refusal).
fn hello(sock: &Path) -> (UnixStream, Response) {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let h = Request::Hello {
        shm_bytes: 0,
        pid: std::process::id(),
        features: 0,
    };
    // A refused connection may be closed before the hello is read (EPIPE);
    // the refusal frame is readable all the same.
    let _ = s.write_all(&h.encode(1));
    let b = read_frame(&mut s);
    let r = Response::decode(&b, proto::OP_HELLO).unwrap().1;
    (s, r)
}

fn conn(sock: &Path) -> UnixStream {
    let (s, r) = hello(sock);
    assert!(matches!(r, Response::Hello { .. }), "{r:?}");
    s
}

/// One call; fds passed with the reply are counted and closed.
fn call(s: &mut UnixStream, req: &Request) -> (Response, usize) {
    use std::os::fd::AsRawFd;
    s.write_all(&req.encode(7)).unwrap();
    let mut fds = Vec::new();
    let body = proto::recv_frame(s.as_raw_fd(), &mut fds).unwrap();
    (Response::decode(&body, req.op()).unwrap().1, fds.len())
}

fn onboard_req(ns: &Namespace, keys: &[BlockKey], ttl: u32) -> Request {
    Request::Onboard {
        ns: ns.id(),
        mode: OnboardMode::DirectFd,
        lease_ttl_ms: ttl,
        items: keys
            .iter()
            .map(|k| OnboardItem {
                key: *k,
                shm_offset: 0,
                shm_len: 0,
            })
            .collect(),
    }
}

fn statuses(r: Response) -> Vec<ItemStatus> {
    match r {
        Response::Items { status } => status,
        Response::Onboard { items } => items.iter().map(|i| i.status).collect(),
        other => panic!("not an item reply: {other:?}"),
    }
}

// ---- the worker: runs as another uid ------------------------------------

/// Not a test of its own: the body the tests below run as other uids.
#[test]
fn tenancy_worker() {
    let Ok(role) = std::env::var("KVTIER_TENANCY_ROLE") else {
        return;
    };
    let dir = PathBuf::from(std::env::var("KVTIER_TENANCY_DIR").unwrap());
    let sock = dir.join("kvtierd.sock");
    let (a, b) = (ns_of("a"), ns_of("b"));
    let (ka, kb) = (a.hash_chain(&tokens("a")), b.hash_chain(&tokens("b")));
    match role.as_str() {
        "stranger" => {
            let (_s, r) = hello(&sock);
            let Response::Error { code: c, message } = r else {
                panic!("a stranger was served: {r:?}")
            };
            assert_eq!(c, code::DENIED, "{message}");
            assert!(message.contains("[[tenants]]"), "{message}");
            // The client library reports the refusal, not a broken pipe.
            let c = Client::with_config(ClientConfig::new(&sock));
            let e = c.list(None, None, 10).unwrap_err().to_string();
            assert!(e.contains("not a tenant"), "{e}");
        }
        "a-socket" => a_socket(&sock, &a, &b, &ka, &kb),
        "a-subscribe" => {
            let c = Client::with_config(ClientConfig::new(&sock));
            let mut ev = c.subscribe_events().unwrap();
            std::fs::write(dir.join("sig/a-subscribed"), b"").unwrap();
            // Root now stores one block in B's namespace, then one in A's.
            let t = Instant::now();
            loop {
                assert!(
                    t.elapsed() < Duration::from_secs(20),
                    "A's event never came"
                );
                let Some(e) = ev.next_timeout(Duration::from_millis(500)).unwrap() else {
                    continue;
                };
                assert_ne!(e.namespace, b.id(), "A received B's event {e:?}");
                if e.namespace == a.id() {
                    break;
                }
            }
        }
        "a-mount" => a_mount(&dir.join("mnt"), &a, &b, &ka, &kb),
        "hog-conns" => {
            // connections_per_uid_max = 3: the 4th is refused BUSY.
            let held: Vec<UnixStream> = (0..3).map(|_| conn(&sock)).collect();
            let (_s, r) = hello(&sock);
            assert!(
                matches!(
                    r,
                    Response::Error {
                        code: code::BUSY,
                        ..
                    }
                ),
                "{r:?}"
            );
            std::fs::write(dir.join("sig/hog-full"), b"").unwrap();
            wait_file(&dir.join("sig/other-done"), Duration::from_secs(30));
            drop(held);
        }
        "hog-leases-pins-subs" => {
            // leases_per_uid_max = 3 over two connections (2 per conn).
            let mut c1 = conn(&sock);
            let mut c2 = conn(&sock);
            let st = statuses(call(&mut c1, &onboard_req(&a, &ka[..2], 30_000)).0);
            assert_eq!(st, vec![ItemStatus::Ok; 2]);
            let st = statuses(call(&mut c2, &onboard_req(&a, &ka[2..4], 30_000)).0);
            assert_eq!(
                st,
                vec![ItemStatus::Ok, ItemStatus::LimitReached],
                "uid lease share"
            );
            // pins_per_uid_max = 2.
            let pin = Request::Pin {
                ns: a.id(),
                ttl_ms: 60_000,
                keys: ka.clone(),
            };
            let st = statuses(call(&mut c1, &pin).0);
            assert_eq!(&st[..2], &[ItemStatus::Ok; 2]);
            assert_eq!(&st[2..], &[ItemStatus::LimitReached; 2], "uid pin share");
            // subscribers_per_uid_max = 1 (a third connection).
            let c = Client::with_config(ClientConfig::new(&sock));
            let _ev = c.subscribe_events().unwrap();
            assert!(c.subscribe_events().is_err(), "a second subscription");
            std::fs::write(dir.join("sig/hog-full"), b"").unwrap();
            wait_file(&dir.join("sig/other-done"), Duration::from_secs(30));
        }
        "b-served" => {
            let mut s = conn(&sock);
            let st = statuses(call(&mut s, &onboard_req(&b, &kb[..2], 30_000)).0);
            assert_eq!(st, vec![ItemStatus::Ok; 2], "B's leases");
            let pin = Request::Pin {
                ns: b.id(),
                ttl_ms: 60_000,
                keys: kb[..2].to_vec(),
            };
            assert_eq!(statuses(call(&mut s, &pin).0), vec![ItemStatus::Ok; 2]);
            let c = Client::with_config(ClientConfig::new(&sock));
            let _ev = c.subscribe_events().unwrap();
            let (r, _) = call(
                &mut s,
                &Request::Lookup {
                    ns: b.id(),
                    keys: kb.clone(),
                },
            );
            assert!(
                matches!(r, Response::Lookup { ref tiers } if tiers.len() == 4),
                "{r:?}"
            );
        }
        "flood-fetches" => {
            // onboards_per_uid_max = 2: two onboards of absent keys, each
            // waiting on a G4 that never answers, hold A's whole share...
            let deadline = Duration::from_millis(FETCH_DEADLINE_MS);
            let flood: Vec<_> = (0..2u64)
                .map(|t| {
                    let (sock, a) = (sock.clone(), a.clone());
                    std::thread::spawn(move || {
                        let mut s = conn(&sock);
                        let absent: Vec<BlockKey> = (0..64)
                            .map(|i| BlockKey::from_u64(0xf100d + t * 1000 + i))
                            .collect();
                        loop {
                            let t0 = Instant::now();
                            let st = statuses(call(&mut s, &onboard_req(&a, &absent, 0)).0);
                            // Refused while the probe below held a slot:
                            // again, until this flood is in.
                            if st.iter().any(|s| *s != ItemStatus::LimitReached) {
                                return (st, t0.elapsed());
                            }
                            std::thread::sleep(Duration::from_millis(5));
                        }
                    })
                })
                .collect();
            // ...so a third gets LimitReached at once (a G3 hit of A's own
            // block: served, not refused, until both floods are in flight).
            let mut s = conn(&sock);
            let t = Instant::now();
            loop {
                assert!(t.elapsed() < deadline, "the floods never held A's share");
                let t0 = Instant::now();
                let st = statuses(call(&mut s, &onboard_req(&a, &ka[..1], 0)).0);
                if st == vec![ItemStatus::LimitReached] {
                    assert!(
                        t0.elapsed() < deadline / 4,
                        "refused only after {:?}",
                        t0.elapsed()
                    );
                    break;
                }
                assert_eq!(st, vec![ItemStatus::Ok]);
                std::thread::sleep(Duration::from_millis(10));
            }
            std::fs::write(dir.join("sig/hog-full"), b"").unwrap();
            for f in flood {
                let (st, took) = f.join().unwrap();
                // Typed misses by the fetch deadline, never a stall.
                assert!(
                    st.iter()
                        .all(|s| matches!(s, ItemStatus::Unavailable | ItemStatus::Absent)),
                    "{st:?}"
                );
                assert!(
                    took < deadline + Duration::from_secs(5),
                    "a flood took {took:?}"
                );
            }
            std::fs::write(dir.join("sig/flood-done"), b"").unwrap();
        }
        "b-prompt" => {
            // While A's floods hold the node's fetches, B's G3 blocks are
            // served: the flood has not ended when B is done.
            let mut s = conn(&sock);
            let st = statuses(call(&mut s, &onboard_req(&b, &kb, 30_000)).0);
            assert_eq!(st, vec![ItemStatus::Ok; 4], "B's onboard");
            let c = Client::with_config(ClientConfig::new(&sock));
            let h = c.namespace(&b);
            let mut bufs: Vec<Vec<u8>> = kb.iter().map(|_| vec![0u8; 2 * BLOCK as usize]).collect();
            let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|v| &mut v[..]).collect();
            let got = h.onboard_into(&kb, &mut refs);
            assert!(
                got.iter().all(|o| matches!(o, Onboarded::Hit { .. })),
                "{got:?}"
            );
            assert!(
                !dir.join("sig/flood-done").exists(),
                "B was served only after A's flood ended"
            );
        }
        r => panic!("unknown role {r}"),
    }
}

fn a_socket(sock: &Path, a: &Namespace, b: &Namespace, ka: &[BlockKey], kb: &[BlockKey]) {
    let mut s = conn(sock);
    // Lookup: B's chain is a miss exactly like an unknown namespace's; A's
    // own hits.
    let (r, _) = call(
        &mut s,
        &Request::Lookup {
            ns: b.id(),
            keys: kb.to_vec(),
        },
    );
    assert_eq!(r, Response::Lookup { tiers: vec![] });
    let (r, _) = call(
        &mut s,
        &Request::Lookup {
            ns: a.id(),
            keys: ka.to_vec(),
        },
    );
    assert!(
        matches!(r, Response::Lookup { ref tiers } if tiers.len() == 4),
        "{r:?}"
    );
    // List without a namespace: only A's blocks; of B's namespace: nothing.
    let (r, _) = call(
        &mut s,
        &Request::List {
            ns: None,
            after: None,
            limit: 100,
        },
    );
    let Response::List { entries, .. } = r else {
        panic!("{r:?}")
    };
    assert_eq!(entries.len(), 4, "{entries:?}");
    assert!(entries.iter().all(|e| e.ns == a.id()));
    // Paging walks A's namespace to its end through the cursor.
    let (r, _) = call(
        &mut s,
        &Request::List {
            ns: None,
            after: None,
            limit: 3,
        },
    );
    let Response::List {
        next: Some(cur), ..
    } = r
    else {
        panic!("{r:?}")
    };
    let (r, _) = call(
        &mut s,
        &Request::List {
            ns: None,
            after: Some(cur),
            limit: 3,
        },
    );
    let Response::List { entries, next } = r else {
        panic!("{r:?}")
    };
    assert_eq!((entries.len(), next), (1, None));
    let (r, _) = call(
        &mut s,
        &Request::List {
            ns: Some(b.id()),
            after: None,
            limit: 100,
        },
    );
    assert!(matches!(r, Response::List { ref entries, next: None } if entries.is_empty()));
    // Read by passed fd: absent, no fd passed.
    let (r, nfds) = call(&mut s, &onboard_req(b, kb, 30_000));
    assert_eq!(statuses(r), vec![ItemStatus::Absent; 4]);
    assert_eq!(nfds, 0, "an fd of B's block was passed to A");
    // Stat, pin, unpin: all absent; evict is an admin's (denied).
    let (r, _) = call(
        &mut s,
        &Request::Stat {
            ns: b.id(),
            keys: kb.to_vec(),
        },
    );
    assert_eq!(
        r,
        Response::Stat {
            entries: vec![None; 4]
        }
    );
    let pin = Request::Pin {
        ns: b.id(),
        ttl_ms: 1000,
        keys: kb.to_vec(),
    };
    assert_eq!(statuses(call(&mut s, &pin).0), vec![ItemStatus::Absent; 4]);
    // (An error reply ends the connection: a fresh one per refusal.)
    for tier in [EvictTier::G3, EvictTier::All] {
        let ev = Request::Evict {
            ns: b.id(),
            keys: kb.to_vec(),
            tier,
        };
        let (r, _) = call(&mut conn(sock), &ev);
        assert!(
            matches!(r, Response::Error { code: code::DENIED, ref message } if message.contains("admin")),
            "{r:?}"
        );
    }
    // Not even its own namespace: deleting is the operator's.
    let own = Request::Evict {
        ns: a.id(),
        keys: ka[..1].to_vec(),
        tier: EvictTier::G3,
    };
    assert!(
        matches!(
            call(&mut conn(sock), &own).0,
            Response::Error {
                code: code::DENIED,
                ..
            }
        ),
        "a tenant evicted its own block"
    );
    // Daemon-wide stats are an admin's.
    let (r, _) = call(&mut conn(sock), &Request::Stats);
    assert!(
        matches!(
            r,
            Response::Error {
                code: code::DENIED,
                ..
            }
        ),
        "{r:?}"
    );

    // Through the client with a shared region, and by fd: misses, even
    // with B's salt in hand.
    for direct in [false, true] {
        let c = Client::with_config(ClientConfig {
            direct_read: direct,
            ..ClientConfig::new(sock)
        });
        let h = c.namespace(b);
        let mut bufs: Vec<Vec<u8>> = kb.iter().map(|_| vec![0u8; 2 * BLOCK as usize]).collect();
        let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|v| &mut v[..]).collect();
        let got = h.onboard_into(kb, &mut refs);
        assert!(
            got.iter().all(|o| matches!(o, Onboarded::Miss(_))),
            "{got:?}"
        );
        assert!(
            bufs.iter().all(|v| v.iter().all(|&x| x == 0)),
            "B's bytes reached A"
        );
        // Offload into B's namespace is refused.
        let p = vec![9u8; BLOCK as usize];
        let fresh = b.hash_chain(&(7_000_000..7_000_016).collect::<Vec<u32>>());
        let out = h.offload_chain(None, &fresh, &[&p[..]], Hints::default());
        assert!(matches!(out[0], OffloadOutcome::Failed(_)), "{out:?}");
    }
}

fn a_mount(mnt: &Path, a: &Namespace, b: &Namespace, ka: &[BlockKey], kb: &[BlockKey]) {
    let names: Vec<String> = std::fs::read_dir(mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.contains(&a.id().to_hex()), "{names:?}");
    assert!(
        !names.contains(&b.id().to_hex()),
        "A sees B's namespace: {names:?}"
    );
    // A's own block reads back.
    let own = std::fs::read(mnt.join(block_path(&a.id(), &ka[0]))).unwrap();
    assert_eq!(own.len() as u64, 2 * BLOCK);
    // B's: not there, by every path.
    let pb = mnt.join(block_path(&b.id(), &kb[0]));
    let nf = |e: std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
    assert!(
        std::fs::read(&pb).map_err(nf).err() == Some(true),
        "read B's block"
    );
    assert!(
        std::fs::metadata(&pb).map_err(nf).err() == Some(true),
        "stat B's block"
    );
    assert!(
        std::fs::remove_file(&pb).map_err(nf).err() == Some(true),
        "rm B's block"
    );
    assert!(
        std::fs::read_dir(mnt.join(b.id().to_hex()))
            .map_err(nf)
            .err()
            == Some(true),
        "ls B's namespace"
    );
    let stats = mnt.join(".kvtier/stats");
    assert!(
        std::fs::read(stats).map_err(nf).err() == Some(true),
        "node-wide stats"
    );
    // Deleting is an admin's, even of A's own blocks: refused, kept
    // (EACCES from the directory modes first; EPERM from the daemon when
    // dir_mode lets others write).
    let pa = mnt.join(block_path(&a.id(), &ka[0]));
    let e = std::fs::remove_file(&pa).unwrap_err();
    assert!(
        matches!(e.raw_os_error(), Some(libc::EPERM | libc::EACCES)),
        "{e}"
    );
    assert!(pa.exists(), "A's rm removed its block");
}

// ---- the tests --------------------------------------------------------

#[test]
fn tenant_a_cannot_reach_tenant_b_on_the_socket_and_a_stranger_is_refused() {
    if skip_unless_root("tenant_a_cannot_reach_tenant_b_on_the_socket") {
        return;
    }
    let d = Tenancy::start("", false);
    d.run_as(UID_STRANGER, "stranger", &[]);
    d.run_as(UID_A, "a-socket", &[]);
    // B's blocks are all still there, unpinned, as root sees them.
    let c = Client::with_config(ClientConfig::new(d.sock()));
    let st = c.stat_ids(ns_of("b").id(), &d.keys("b")).unwrap();
    assert!(
        st.iter()
            .all(|s| matches!(s, Some(s) if s.pinned_until_unix_ms == 0)),
        "{st:?}"
    );
    let (list, _) = c.list(Some(ns_of("b").id()), None, 100).unwrap();
    assert_eq!(list.len(), 4, "B's namespace lost blocks to A");
}

#[test]
fn a_subscriber_sees_only_its_namespaces_events() {
    if skip_unless_root("a_subscriber_sees_only_its_namespaces_events") {
        return;
    }
    let d = Tenancy::start("", false);
    let w = d.spawn_as(UID_A, "a-subscribe", &[]);
    wait_file(
        &d.dir.path().join("sig/a-subscribed"),
        Duration::from_secs(30),
    );
    let c = Client::with_config(ClientConfig::new(d.sock()));
    for t in ["b", "a"] {
        let ns = ns_of(t);
        let h = c.namespace(&ns);
        let keys = h.hash_chain(&(9_000_000..9_000_016).collect::<Vec<u32>>());
        let p = vec![3u8; BLOCK as usize];
        let out = h.offload_chain(None, &keys, &[&p[..]], Hints::default());
        assert!(matches!(out[0], OffloadOutcome::Stored), "{out:?}");
    }
    let (ok, out) = w.finish();
    assert!(ok, "subscriber worker failed:\n{out}");
}

#[test]
fn the_mount_shows_a_uid_only_its_namespaces() {
    if skip_unless_root("the_mount_shows_a_uid_only_its_namespaces") {
        return;
    }
    if !Path::new("/dev/fuse").exists() {
        eprintln!("SKIP the_mount_shows_a_uid_only_its_namespaces: no /dev/fuse");
        return;
    }
    let d = Tenancy::start("", true);
    d.run_as(UID_A, "a-mount", &[]);
    // Root (an admin) still sees both, and B's block survived A's rm.
    let mnt = d.mnt.clone().unwrap();
    assert!(mnt
        .join(block_path(&ns_of("b").id(), &d.keys("b")[0]))
        .exists());
}

#[test]
fn a_uid_at_its_connection_share_leaves_another_uid_connecting() {
    if skip_unless_root("a_uid_at_its_connection_share_leaves_another_uid_connecting") {
        return;
    }
    let d = Tenancy::start("connections_per_uid_max = 3", false);
    let hog = d.spawn_as(UID_A, "hog-conns", &[]);
    wait_file(&d.dir.path().join("sig/hog-full"), Duration::from_secs(30));
    let other = d.spawn_as(UID_B, "b-served", &[]).finish();
    std::fs::write(d.dir.path().join("sig/other-done"), b"").unwrap();
    let (ok, out) = hog.finish();
    assert!(ok, "hog failed:\n{out}");
    assert!(other.0, "B was locked out by A's connections:\n{}", other.1);
}

#[test]
fn a_uid_exhausting_leases_pins_and_subscriptions_leaves_another_served() {
    if skip_unless_root("a_uid_exhausting_leases_pins_and_subscriptions_leaves_another_served") {
        return;
    }
    let d = Tenancy::start(
        "leases_per_uid_max = 3\npins_per_uid_max = 2\nsubscribers_per_uid_max = 1",
        false,
    );
    let hog = d.spawn_as(UID_A, "hog-leases-pins-subs", &[]);
    wait_file(&d.dir.path().join("sig/hog-full"), Duration::from_secs(30));
    let other = d.spawn_as(UID_B, "b-served", &[]).finish();
    std::fs::write(d.dir.path().join("sig/other-done"), b"").unwrap();
    let (ok, out) = hog.finish();
    assert!(ok, "hog failed:\n{out}");
    assert!(other.0, "B was starved by A:\n{}", other.1);
}

#[test]
fn a_uid_exhausting_its_fetches_gets_limit_reached_and_leaves_another_served() {
    if skip_unless_root("a_uid_exhausting_its_fetches_leaves_another_served") {
        return;
    }
    // G4 accepts connections and never answers: every fetch of an absent
    // key waits the whole fetch deadline (the breaker never opens).
    let silent = kvtier_daemon::testkit::fault_proxy::SilentEndpoint::start().unwrap();
    let g4 = format!(
        "[g4]\nurl = \"s3://b/p\"\nendpoint = \"{}\"\nallow_http = true\npath_style = true\n\
         region = \"us-east-1\"\ncredentials = \"anonymous\"\n\
         response_timeout_ms = {FETCH_DEADLINE_MS}\nstartup_check_timeout_ms = 300\n\
         breaker_failures_max = 1000000\n\n[node]\nfetch_deadline_ms = {FETCH_DEADLINE_MS}\n",
        silent.endpoint()
    );
    let d = Tenancy::start_with("onboards_per_uid_max = 2", &g4, false);
    let mut hog = d.spawn_as(UID_A, "flood-fetches", &[]);
    hog.wait_file(&d.dir.path().join("sig/hog-full"));
    let other = d.spawn_as(UID_B, "b-prompt", &[]).finish();
    let (ok, out) = hog.finish();
    assert!(ok, "flooder failed:\n{out}");
    assert!(other.0, "B was starved by A's fetches:\n{}", other.1);
    assert!(
        silent.accepted.load(std::sync::atomic::Ordering::SeqCst) > 0,
        "no fetch reached G4"
    );
    // Not a graceful stop: its G4 flush would wait 10 s for a G4 that
    // never answers.
    let mut d = d;
    d.child.kill().unwrap();
    d.child.wait().unwrap();
}
