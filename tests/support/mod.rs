//! Helpers of the end-to-end suites: find (and build) the binaries, run a
//! real `kvtierd` in a temp dir, scrape its metrics. Children are killed on
//! drop, so a failing test leaves no daemon behind.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The target dir's profile directory (`target/debug`), from the test
/// executable's path (`target/debug/deps/<test>-<hash>`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// Path of a workspace binary, built once per test process (cargo does not
/// build dependencies' binaries for a test; a no-op build costs ~1 s).
pub fn bin(package: &str, name: &str) -> PathBuf {
    static BUILT: OnceLock<std::sync::Mutex<Vec<String>>> = OnceLock::new();
    let built = BUILT.get_or_init(Default::default);
    let mut g = built.lock().unwrap();
    let path = profile_dir().join(name);
    // `cargo test --workspace` (scripts/test.sh) has just built every binary
    // of the packages under test, with the workspace's feature set; a
    // `cargo build -p` here would resolve features differently and rebuild
    // the daemon for minutes. The script says so with this variable.
    let prebuilt = std::env::var_os("KVTIER_TEST_PREBUILT_BINS").is_some() && path.exists();
    if !prebuilt && !g.iter().any(|b| b == name) {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-q", "-p", package, "--bin", name]);
        cmd.current_dir(env!("CARGO_MANIFEST_DIR"));
        if profile_dir().file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let st = cmd.status().expect("running cargo build");
        assert!(st.success(), "cargo build -p {package} --bin {name} failed");
        g.push(name.to_string());
    }
    assert!(path.exists(), "{} missing after build", path.display());
    path
}

/// The kvtierd binary.
pub fn kvtierd_bin() -> PathBuf {
    bin("kvtier-daemon", "kvtierd")
}

/// A free loopback port below the ephemeral range
/// ([`kvtier_daemon::testkit::port::free_port`]).
pub fn free_port() -> u16 {
    kvtier_daemon::testkit::port::free_port().unwrap()
}

/// kvtierd flags for a node with its peer server on `listen`, no G4, and
/// `secret` written to a 0600 file in `dir` (kvtierd refuses a readable
/// one); `extra` goes after them (`--node-id`, `--peers`).
pub fn peer_node_args(dir: &Path, secret: &[u8], listen: &str, extra: &[String]) -> Vec<String> {
    use std::os::unix::fs::PermissionsExt;
    let file = dir.join("peer.secret");
    std::fs::write(&file, secret).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut args = vec![
        "--peer-listen".to_string(),
        listen.to_string(),
        "--peer-secret-file".to_string(),
        file.display().to_string(),
        "--g4".to_string(),
        String::new(),
    ];
    args.extend_from_slice(extra);
    args
}

/// A running kvtierd.
pub struct Daemon {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub metrics_addr: String,
    child: Option<Child>,
    /// Flags added after the defaults (later flags win).
    pub extra_args: Vec<String>,
    /// Environment of the daemon process.
    pub envs: Vec<(String, String)>,
    /// Where the daemon's stderr (its log) goes; `None`: inherited.
    pub log_file: Option<PathBuf>,
}

impl Daemon {
    /// Starts a daemon in a fresh temp dir and waits until it serves.
    pub fn start() -> Daemon {
        Self::start_with(&[], &[])
    }

    /// Like [`Daemon::start`] with extra flags and environment.
    pub fn start_with(extra_args: &[String], envs: &[(String, String)]) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("kvtierd.sock");
        let metrics_addr = format!("127.0.0.1:{}", free_port());
        let mut d = Daemon {
            dir,
            socket,
            metrics_addr,
            child: None,
            extra_args: extra_args.to_vec(),
            envs: envs.to_vec(),
            log_file: None,
        };
        d.spawn();
        d
    }

    /// Like [`Daemon::start_with`], its log (stderr) written to `log`.
    pub fn start_logged(extra_args: &[String], log: &Path) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("kvtierd.sock");
        let metrics_addr = format!("127.0.0.1:{}", free_port());
        let mut d = Daemon {
            dir,
            socket,
            metrics_addr,
            child: None,
            extra_args: extra_args.to_vec(),
            envs: Vec::new(),
            log_file: Some(log.to_path_buf()),
        };
        d.spawn();
        d
    }

    fn spawn(&mut self) {
        // The metrics port is picked free, then bound by the daemon: another
        // test's process can take it in between (CI saw `metrics.addr:
        // cannot listen ...: Address already in use` once). A daemon that
        // exits before it serves is started again on a fresh port, twice at
        // most; one that fails for another reason fails all three.
        for attempt in 0..3 {
            let mut child = self.command().spawn().expect("spawning kvtierd");
            let t = Instant::now();
            let within = Duration::from_secs(20);
            while t.elapsed() < within {
                if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                    self.child = Some(child);
                    return;
                }
                if matches!(child.try_wait(), Ok(Some(_))) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let exited = matches!(child.try_wait(), Ok(Some(_)));
            if !exited || attempt == 2 {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "kvtierd did not listen on {} within {within:?}{}",
                    self.socket.display(),
                    if exited {
                        " (it exited; its log is above)"
                    } else {
                        ""
                    }
                );
            }
            self.metrics_addr = format!("127.0.0.1:{}", free_port());
        }
    }

    fn command(&self) -> Command {
        let mut c = Command::new(kvtierd_bin());
        c.arg("--socket")
            .arg(&self.socket)
            .arg("--g3-dir")
            .arg(self.dir.path().join("g3"))
            // 256 MiB unless the test gives its own (the flag may not repeat).
            .args(
                ["--g3-capacity", "256MiB"]
                    .into_iter()
                    .filter(|_| !self.extra_args.iter().any(|a| a == "--g3-capacity")),
            )
            .args(["--metrics-addr", &self.metrics_addr])
            .args(&self.extra_args)
            .envs(self.envs.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(match &self.log_file {
                Some(p) => Stdio::from(
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(p)
                        .unwrap(),
                ),
                None => Stdio::inherit(),
            });
        c
    }

    /// Pid of the daemon.
    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same socket and directory.
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// SIGTERM; returns the exit status (None if it did not exit in time).
    pub fn term(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let t = Instant::now();
        while t.elapsed() < within {
            if let Some(st) = c.try_wait().unwrap() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
        None
    }

    /// GET a path on the metrics endpoint; returns (status line, body).
    pub fn http_get(&self, path: &str) -> (String, String) {
        let mut s = std::net::TcpStream::connect(&self.metrics_addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
        (
            head.lines().next().unwrap_or("").to_string(),
            body.to_string(),
        )
    }

    /// Scrapes /metrics and parses the exposition format.
    pub fn scrape(&self) -> Vec<Sample> {
        let (status, body) = self.http_get("/metrics");
        assert!(status.contains("200"), "{status}");
        parse_exposition(&body)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
        // A daemon killed with a mount leaves it dead ("transport endpoint
        // is not connected"): detach it, or every run leaves one behind.
        let mounts = self.extra_args.windows(2).filter(|w| w[0] == "--mount");
        for w in mounts {
            let _ = std::process::Command::new("fusermount3")
                .args(["-uz", &w[1]])
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

/// Polls until the socket accepts a connection.
pub fn wait_for_socket(p: &Path, within: Duration) {
    let t = Instant::now();
    while t.elapsed() < within {
        if std::os::unix::net::UnixStream::connect(p).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!(
        "kvtierd did not listen on {} within {within:?}",
        p.display()
    );
}

/// One sample of the Prometheus text format.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// Parses the text exposition format (names, labels, values; comments
/// skipped). Panics on a line it cannot parse: the format is the contract.
pub fn parse_exposition(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("sample line");
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("value in {line:?}"));
        let (name, labels) = match series.split_once('{') {
            Some((n, rest)) => {
                let body = rest.strip_suffix('}').expect("closing brace");
                let labels = body
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|kv| {
                        let (k, v) = kv.split_once('=').expect("label k=v");
                        (k.to_string(), v.trim_matches('"').to_string())
                    })
                    .collect();
                (n.to_string(), labels)
            }
            None => (series.to_string(), Vec::new()),
        };
        out.push(Sample {
            name,
            labels,
            value,
        });
    }
    out
}

/// Sum of a metric's samples whose labels include `want`.
pub fn metric(samples: &[Sample], name: &str, want: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            want.iter()
                .all(|(k, v)| s.labels.iter().any(|(a, b)| a == k && b == v))
        })
        .map(|s| s.value)
        .sum()
}

/// Re-runs this test binary as a child process running only `test_name`,
/// with `envs` set (the child test reads them and acts as a worker).
pub fn spawn_worker(test_name: &str, envs: &[(&str, String)]) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", test_name, "--nocapture", "--test-threads", "1"]);
    for (k, v) in envs {
        c.env(k, v);
    }
    c.stdout(Stdio::piped()).stderr(Stdio::inherit());
    c.spawn().unwrap()
}

/// Waits for a child with a deadline; kills it on timeout. Returns success
/// and its stdout.
pub fn wait_child(mut c: Child, within: Duration) -> (bool, String) {
    let t = Instant::now();
    loop {
        if let Some(st) = c.try_wait().unwrap() {
            let mut out = String::new();
            if let Some(mut so) = c.stdout.take() {
                let _ = so.read_to_string(&mut out);
            }
            return (st.success(), out);
        }
        if t.elapsed() > within {
            let _ = c.kill();
            let _ = c.wait();
            return (false, "timed out".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `weed` for the S3 suites (`KVTIER_WEED`, else `.venv/bin/weed` above
/// the workspace), as `kvtier_daemon::testkit::s3` finds it.
pub fn find_weed_for_tests() -> Option<PathBuf> {
    kvtier_daemon::testkit::s3::find_weed()
}

/// The JSON document a `kvtier ... --json` run printed; panics with its
/// stderr when it failed.
pub fn json_stdout(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Where a block's bytes are in a G3 directory: its file under `blocks/`
/// (offset 0), or the slot of a slab under `slots/<pages>.slab` whose
/// header names it (the daemon's g3/slots.rs), at the slot's offset.
/// `None`: neither holds it.
pub fn g3_block_at(
    g3_dir: &Path,
    ns: &kvtier_client::NamespaceId,
    key: &kvtier_client::BlockKey,
) -> Option<(PathBuf, u64)> {
    use std::os::unix::fs::FileExt;
    let file = g3_dir
        .join("blocks")
        .join(kvtier_client::block_path(ns, key));
    if file.exists() {
        return Some((file, 0));
    }
    for e in std::fs::read_dir(g3_dir.join("slots")).ok()?.flatten() {
        let p = e.path();
        let Some(pages) = p
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".slab"))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        let slot_bytes = pages * 4096;
        let Ok(f) = std::fs::File::open(&p) else {
            continue;
        };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let mut head = vec![0u8; 4096];
        let mut at = 0;
        while at + slot_bytes <= len {
            if f.read_exact_at(&mut head, at).is_ok() {
                if let Ok(h) = kvtier_client::BlockHeader::decode(&head) {
                    if h.key == *key && h.namespace_id() == *ns {
                        return Some((p, at));
                    }
                }
            }
            at += slot_bytes;
        }
    }
    None
}

/// Flips the byte at `off` from the start of a G3 block (4096: the first
/// payload byte), behind the daemon's back, wherever the block lives
/// ([`g3_block_at`]).
pub fn flip_g3_byte(
    g3_dir: &Path,
    ns: &kvtier_client::NamespaceId,
    key: &kvtier_client::BlockKey,
    off: u64,
) {
    use std::os::unix::fs::FileExt;
    let (p, at) = g3_block_at(g3_dir, ns, key).expect("the block is on G3");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at + off).unwrap();
    f.write_all_at(&[!b[0]], at + off).unwrap();
    f.sync_all().unwrap();
}
