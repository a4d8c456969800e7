//! What the oracle's tests share: the workspace binaries they run.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

/// The workspace's profile dir holding `kvtier` and `kvtierd`
/// (`KVTIER_BIN_DIR`, else `<repo>/target/debug`). The oracle never builds
/// them itself: a `cargo build` from here would use another lock file.
pub fn bin_dir() -> PathBuf {
    match std::env::var_os("KVTIER_BIN_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug"),
    }
}

/// Path of a workspace binary, with an actionable message when missing.
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace` at the repository root first \
         (or set KVTIER_BIN_DIR to the dir holding kvtier and kvtierd)",
        p.display()
    );
    p
}

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

/// A real kvtierd in a temp dir (killed on drop). G4 is the default local
/// `file://` store beside G3 unless the config says otherwise.
pub struct Daemon {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    child: Option<Child>,
    pub args: Vec<String>,
}

impl Daemon {
    pub fn start(args: &[&str]) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("kvtierd.sock");
        let mut d = Daemon {
            dir,
            socket,
            child: None,
            args: args.iter().map(|s| s.to_string()).collect(),
        };
        d.spawn();
        d
    }

    pub fn spawn(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
        let child = Command::new(bin("kvtierd"))
            .arg("--socket")
            .arg(&self.socket)
            .arg("--g3-dir")
            .arg(self.dir.path().join("g3"))
            .args(["--g3-capacity", "256MiB", "--metrics-addr", ""])
            .args(&self.args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        self.child = Some(child);
        wait_for_socket(&self.socket);
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGKILL and start again on the same directories with `args`.
    pub fn restart_with(&mut self, args: &[String]) {
        self.kill9();
        self.args = args.to_vec();
        self.spawn();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
    }
}

pub fn wait_for_socket(p: &Path) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(30) {
        if std::os::unix::net::UnixStream::connect(p).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("kvtierd did not listen on {}", p.display());
}

/// `kvtier events --format dynamo` against a socket: its stdout lines.
pub struct EventsCli {
    child: Child,
    pub lines: Receiver<String>,
}

impl EventsCli {
    pub fn start(socket: &Path) -> EventsCli {
        let mut child = Command::new(bin("kvtier"))
            .args(["events", "--format", "dynamo", "--socket"])
            .arg(socket)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { return };
                if tx.send(l).is_err() {
                    return;
                }
            }
        });
        // The subscription is live once the CLI connected; give it a moment.
        std::thread::sleep(Duration::from_millis(300));
        EventsCli { child, lines: rx }
    }
}

impl Drop for EventsCli {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `n` 4 KiB payloads, distinct per block and per `seed`.
pub fn payloads(n: usize, seed: u8) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| (0..4096).map(|j| (i * 31 + j) as u8 ^ seed).collect())
        .collect()
}

/// Dynamo's overlap score of `worker` in `tree` for a request of `tokens`
/// hashed as Dynamo's router hashes requests.
pub fn dynamo_score(
    tree: Option<&dynamo_kv_router::indexer::RadixTree>,
    worker: u64,
    tokens: &[u32],
    block_tokens: u32,
    salt: &str,
    lora: &str,
) -> u32 {
    use dynamo_kv_router::protocols::{
        compute_block_hash_for_seq, BlockHashOptions, WorkerWithDpRank,
    };
    let Some(tree) = tree else { return 0 };
    let hashes = compute_block_hash_for_seq(
        tokens,
        block_tokens,
        BlockHashOptions {
            cache_namespace: Some(salt),
            lora_name: Some(lora),
            ..Default::default()
        },
    );
    tree.find_matches(hashes, false)
        .scores
        .get(&WorkerWithDpRank::new(worker, 0))
        .copied()
        .unwrap_or(0)
}
