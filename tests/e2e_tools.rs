//! End-to-end: the `kvtier` operator commands and `kvtier bench io` against
//! a real `kvtierd`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::process::Command;
use support::Daemon;

fn kvtier() -> std::path::PathBuf {
    support::kvtierd_bin();
    support::bin("kvtier-tools", "kvtier")
}

fn run(args: &[&str], socket: &std::path::Path) -> (bool, String, String) {
    let out = Command::new(kvtier())
        .args(args)
        .env("KVTIER_SOCKET", socket)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn demo_ls_stat_verify_events_stats() {
    let d = Daemon::start();
    let s = &d.socket;
    // Events follower started first, in the background.
    let follower = Command::new(kvtier())
        .args(["events", "--count", "4"])
        .env("KVTIER_SOCKET", s)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    // `verify --all` on an empty node: zero blocks, not a usage error.
    let (ok, v, err) = run(&["verify", "--all"], s);
    assert!(ok && v.contains("verified 0 blocks"), "{v}{err}");
    let (ok, out, err) = run(&["demo"], s);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("round trip OK"), "{out}");
    let (ok, out) = support::wait_child(follower, std::time::Duration::from_secs(20));
    assert!(ok, "{out}");
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4);
    assert!(lines[0]["data"]["stored"]["blocks"][0]["block_hash"].is_string());
    assert_eq!(lines[0]["storage_tier"], "Disk");

    // The demo ends with blocks fetched back from G4, which the daemon
    // serves at once and writes into G3 in the background: the demo waits
    // for that, so `ls` right after it lists them (README runs the two in a
    // row; an empty table there was read as "nothing stored").
    let (ok, ls, ls_err) = run(&["ls"], s);
    assert!(ok, "{ls_err}");
    // It says what it lists (an empty table right after the demo was read
    // as "nothing stored" while the blocks were G4-only).
    assert!(
        ls_err.contains("this node's G3") && ls_err.contains("G4"),
        "{ls_err}"
    );
    // A header naming both sizes, then one line per block: the payload
    // and the block file (what `stat` on the mount shows).
    assert_eq!(ls.lines().count(), 5, "{ls}");
    // Then the engine and model the demo described its namespace with
    // (OP_DESCRIBE): the daemon keeps them, ls shows them.
    assert_eq!(
        ls.lines().next().unwrap(),
        "PATH\tTIER\tPAYLOAD_BYTES\tFILE_BYTES\tENGINE\tMODEL"
    );
    let cols: Vec<&str> = ls.lines().nth(1).unwrap().split('\t').collect();
    assert_eq!(
        cols[1..],
        [
            "g3",
            &(256 << 10).to_string(),
            &((256 << 10) + 4096).to_string(),
            "kvtier-demo",
            "demo/llama-ish",
        ]
    );
    let first = cols[0].to_string();
    let (ok, st, err) = run(&["stat", "--json", &first], s);
    assert!(ok, "{err}");
    let j: serde_json::Value = serde_json::from_str(&st).unwrap();
    assert_eq!(j["payload_len"], 256 << 10);
    assert_eq!(j["path"], first);
    assert_eq!(j["pinned"], false);
    assert!(j["pinned_until_unix_ms"].is_null());
    let (ok, st, _) = run(&["stat", &first], s);
    assert!(
        ok && st.contains("pinned: no") && !st.contains("18446744073709551615"),
        "{st}"
    );
    let (ok, ls_json, _) = run(&["ls", "--json", "--limit", "2"], s);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&ls_json).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 2);
    assert_eq!(v[0]["path"], first);
    let (ok, _, err) = run(&["ls", "--namespace", "nothex"], s);
    assert!(!ok && err.contains("not a namespace id"), "{err}");
    let (ok, help, _) = run(&["ls", "--help"], s);
    assert!(ok && !help.contains("18446744073709551615"), "{help}");
    let (ok, v, err) = run(&["verify", "--all"], s);
    assert!(ok, "{v}{err}");
    assert!(v.contains("verified 4 blocks"), "{v}");
    let (ok, st, _) = run(&["stats", "--json"], s);
    assert!(ok);
    let j: serde_json::Value = serde_json::from_str(&st).unwrap();
    assert_eq!(j["tiers"]["g3"]["blocks"], 4);
    // G4 (file://, no capacity_bytes) is unbounded: null, not a capacity
    // of 0 bytes; the worker id is a string (64-bit ids lose digits as
    // JSON numbers past 2^53).
    assert!(j["tiers"]["g4"].is_object(), "{st}");
    assert!(j["tiers"]["g4"]["capacity_bytes"].is_null(), "{st}");
    assert!(
        j["tiers"]["g3"]["capacity_bytes"].as_u64().unwrap() > 0,
        "{st}"
    );
    let worker = j["events_dynamo_worker_id"].as_str().unwrap();
    assert!(worker.parse::<u64>().is_ok(), "{st}");
    // The namespace with its engine and model, and what the daemon
    // counted for it (the demo's and this test's requests).
    let n = &j["namespaces"][0];
    assert_eq!(n["id"], first.split('/').next().unwrap(), "{j}");
    assert_eq!(
        (&n["engine"], &n["model"]),
        (&"kvtier-demo".into(), &"demo/llama-ish".into())
    );
    assert_eq!(n["offload_blocks"], 4, "{j}");
    assert!(
        n["lookups"].as_u64().unwrap() >= 2 && n["lookup_hit_blocks"].as_u64().unwrap() >= 4,
        "{j}"
    );
    assert!(n["onboard_hit_blocks"].as_u64().unwrap() >= 4, "{j}");
    assert_eq!(n["onboard_bytes"].as_u64().unwrap() % (256 << 10), 0, "{j}");
    let (ok, st, _) = run(&["stats"], s);
    assert!(ok && st.contains("g3: 4 blocks"), "{st}");
    assert!(st.contains("capacity unbounded"), "{st}");
    assert!(
        st.contains(&format!(
            "{} kvtier-demo \"demo/llama-ish\"",
            n["id"].as_str().unwrap()
        )),
        "{st}"
    );
    let (ok, v, _) = run(&["verify", "--all", "--json"], s);
    assert!(ok);
    let j: serde_json::Value = serde_json::from_str(&v).unwrap();
    assert_eq!(j["verified"], 4);
    let (ok, _, err) = run(&["stat", "00ff"], s);
    assert!(!ok && err.contains("not stored"), "{err}");
}

#[test]
fn bench_io_runs_tiny_and_keeps_the_json_contract() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(kvtier())
        .args([
            "bench",
            "io",
            "--block-size",
            "64KiB",
            "--blocks",
            "8",
            "--depth",
            "2",
            "--clients",
            "2",
            "--rounds",
            "1",
            "--json",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    let j: serde_json::Value = support::json_stdout(&out);
    // The real store (G4 off so write-through does not share the disk).
    assert_eq!(j["backend"], "g3");
    for k in [
        "offload_gbps",
        "onboard_gbps",
        "offload_gb_per_cpu_s",
        "onboard_gb_per_cpu_s",
        "lookup64_p50_per_s",
        "lookup64_p99_per_s",
    ] {
        assert!(j[k].as_f64().unwrap() > 0.0);
        assert!(j[format!("{k}_baseline")].as_f64().unwrap() > 0.0);
        assert!(j[format!("{k}_vs_baseline")].is_number());
    }
    let vs: Vec<&String> = j
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| k.contains("vs_baseline"))
        .collect();
    assert!(vs.iter().all(|k| k.ends_with("_vs_baseline")));
    assert_eq!(vs.len(), 6, "only comparison quotients: {vs:?}");
    // CPU per GB beside the raw baseline's, per round too.
    for k in ["offload_cpu_s_per_gb", "onboard_cpu_s_per_gb"] {
        assert!(j[k].as_f64().unwrap() >= 0.0, "{k}");
        assert!(j[format!("{k}_baseline")].as_f64().unwrap() >= 0.0);
        assert_eq!(j[format!("{k}_rounds")].as_array().unwrap().len(), 1);
    }
    assert!(j["lookup64_p99_us"].as_f64().unwrap() > 0.0);
    assert!(j["lookup64_p99_us_socket_floor"].as_f64().unwrap() > 0.0);
}

/// Runs kvtierd until its socket appears, then SIGTERMs it; returns stderr.
fn kvtierd_stderr(extra: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let child = Command::new(support::kvtierd_bin())
        .arg("--socket")
        .arg(&socket)
        .arg("--g3-dir")
        .arg(dir.path().join("g3"))
        .args(["--g3-capacity", "64MiB", "--metrics-addr", "", "--g4", ""])
        .args(extra)
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    support::wait_for_socket(&socket, std::time::Duration::from_secs(20));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "kvtierd exit {:?}", out.status);
    String::from_utf8(out.stderr).unwrap()
}

#[test]
fn kvtierd_logs_are_json_on_request_and_never_coloured_off_a_terminal() {
    let json = kvtierd_stderr(&["--log-format", "json"]);
    let lines: Vec<&str> = json.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(
        lines.len() >= 2,
        "expected start-up and shutdown lines: {json}"
    );
    for l in &lines {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(v["level"].is_string() && v["fields"].is_object(), "{l}");
    }
    let text = kvtierd_stderr(&[]);
    assert!(!text.trim().is_empty());
    assert!(!text.contains('\x1b'), "ANSI escapes in a pipe: {text:?}");
}

#[test]
fn kvtierd_check_config_validates_without_starting() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(
        &good,
        "[g3]\ncapacity = \"1.5GiB\"\n[log]\nformat = \"json\"\n",
    )
    .unwrap();
    let out = Command::new(support::kvtierd_bin())
        .args(["--check-config", "--config"])
        .arg(&good)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[log]\n\nformat = \"xml\"\n").unwrap();
    let out = Command::new(support::kvtierd_bin())
        .args(["--check-config", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("log.format") && err.contains("xml"), "{err}");

    // A G4 secret in a file others can read is refused, as a peer secret
    // file is (issue #42); owner-only it is accepted.
    use std::os::unix::fs::PermissionsExt;
    let secret = dir.path().join("secret.toml");
    std::fs::write(&secret, "[g4]\nsecret_access_key = \"very-secret\"\n").unwrap();
    let check = |mode: u32| {
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(mode)).unwrap();
        Command::new(support::kvtierd_bin())
            .args(["--check-config", "--config"])
            .arg(&secret)
            .output()
            .unwrap()
    };
    let out = check(0o644);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("g4.secret_access_key") && err.contains("chmod 600"),
        "{err}"
    );
    let out = check(0o600);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `KVTIERD_*` variables reach kvtierd's configuration: a bad value is an
/// error naming the variable, an unknown one a warning (exit 0).
#[test]
fn kvtierd_environment_overrides_are_checked() {
    let run = |envs: &[(&str, &str)]| {
        let mut c = Command::new(support::kvtierd_bin());
        c.arg("--check-config");
        for (k, v) in envs {
            c.env(k, v);
        }
        c.output().unwrap()
    };
    let out = run(&[
        ("KVTIERD_G3_CAPACITY", "1.5TiB"),
        ("KVTIERD_G4_URL", "memory://"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&[("KVTIERD_G3_CAPACITY", "lots")]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("KVTIERD_G3_CAPACITY") && err.contains("g3.capacity"),
        "{err}"
    );
    // RUST_LOG overrides log.level and is held to the same rule: a bare
    // word is a target name that would silence every line (issue #42).
    let out = run(&[("RUST_LOG", "loud")]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("RUST_LOG") && err.contains("loud"), "{err}");
    let out = run(&[("RUST_LOG", "kvtier_daemon=debug,warn")]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&[("KVTIERD_G3_CAPACTY", "1GiB")]);
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("warning") && err.contains("KVTIERD_G3_CAPACTY"),
        "{err}"
    );
}

/// `kvtier demo` given a socket (here `$KVTIER_SOCKET`) with no daemon says
/// so and exits non-zero instead of quietly starting a daemon of its own.
#[test]
fn demo_with_a_dead_named_socket_fails_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let dead = dir.path().join("nobody.sock");
    let (ok, out, err) = run(&["demo"], &dead);
    assert!(!ok, "{out}");
    assert!(
        err.contains("no kvtierd answers on") && err.contains("nobody.sock"),
        "{err}"
    );
    assert!(!out.contains("started kvtierd"), "{out}");
}

/// The docs name only commands and flags that exist: every `kvtier ...`
/// and `kvtierd ...` command line in README.md and docs/OPERATIONS.md
/// (inline code and fenced blocks) is checked against the tools' own
/// `--help` (subcommand exists, each `--flag` is one of its flags). Cheap:
/// one `--help` per subcommand, no daemon.
#[test]
fn docs_name_only_commands_and_flags_that_exist() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut lines: Vec<String> = Vec::new();
    for doc in ["README.md", "docs/OPERATIONS.md"] {
        let text = std::fs::read_to_string(root.join(doc)).unwrap();
        let mut fenced = false;
        for l in text.lines() {
            if l.trim_start().starts_with("```") {
                fenced = !fenced;
                continue;
            }
            // Whole lines in fenced blocks, inline code spans elsewhere.
            let spans: Vec<&str> = if fenced {
                vec![l.trim()]
            } else {
                l.split('`').skip(1).step_by(2).collect()
            };
            for s in spans {
                let s = s
                    .trim()
                    .trim_start_matches("$ ")
                    .trim_start_matches("./target/debug/");
                if s.starts_with("kvtier ") || s.starts_with("kvtierd ") {
                    // One command: up to a pipe, a `;`, `&&` or a comment.
                    let cmd = s.split(['|', ';', '#', ')']).next().unwrap();
                    let cmd = cmd.split("&&").next().unwrap();
                    lines.push(cmd.trim().to_string());
                }
            }
        }
    }
    assert!(lines.len() > 10, "{lines:?}");
    let mut helps: std::collections::HashMap<Vec<String>, String> = Default::default();
    let mut checked = 0;
    for cmd in &lines {
        let mut words = cmd.split_whitespace();
        let bin = words.next().unwrap();
        let rest: Vec<&str> = words.collect();
        let mut sub: Vec<String> = Vec::new();
        if bin == "kvtier" {
            let is_word = |w: &str| {
                w.chars().all(|c| c.is_ascii_lowercase() || c == '-') && !w.starts_with('-')
            };
            let Some(s) = rest.first().copied().filter(|w| is_word(w)) else {
                continue;
            };
            sub.push(s.to_string());
            if s == "bench" {
                if let Some(s2) = rest.get(1).copied().filter(|w| is_word(w)) {
                    sub.push(s2.to_string());
                }
            }
        }
        let key: Vec<String> = std::iter::once(bin.to_string())
            .chain(sub.clone())
            .collect();
        let help = helps.entry(key.clone()).or_insert_with(|| {
            let exe = if bin == "kvtier" {
                kvtier()
            } else {
                support::kvtierd_bin()
            };
            let out = Command::new(exe).args(&sub).arg("--help").output().unwrap();
            assert!(
                out.status.success(),
                "{key:?} --help failed (docs: {cmd:?})"
            );
            String::from_utf8_lossy(&out.stdout).into_owned()
        });
        for flag in rest.iter().filter(|w| w.starts_with("--")) {
            let flag = flag.split(['=', ']', ',']).next().unwrap();
            if flag.len() <= 2 {
                continue;
            }
            assert!(
                help.contains(&format!("{flag} "))
                    || help.contains(&format!("{flag}\n"))
                    || help.contains(&format!("{flag} <")),
                "docs use {flag} in {cmd:?}, which {key:?} does not take"
            );
            checked += 1;
        }
    }
    assert!(checked > 5, "{lines:?}");
}

/// `kvtier events` as an operator runs it, its stdout lines collected by a
/// thread (so the test never blocks on a stopped follower).
struct Follower {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Follower {
    fn start(socket: &std::path::Path) -> Follower {
        let mut child = Command::new(kvtier())
            .args(["events"])
            .env("KVTIER_SOCKET", socket)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for l in std::io::BufReader::new(out).lines() {
                let Ok(l) = l else { return };
                if tx.send(l).is_err() {
                    return;
                }
            }
        });
        Follower {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig).unwrap();
    }

    /// Returns once the follower's subscription is live: `kvtier events`
    /// subscribes some time after it starts, and a store before that is
    /// never sent to it (live events, no replay), so one first store can be
    /// missed for good on a loaded box. Stores a fresh block until one
    /// shows (ids from `base`).
    fn subscribed(&mut self, socket: &std::path::Path, base: u32) {
        let t = std::time::Instant::now();
        for i in 0.. {
            let k = offload_tiny(socket, base + i, 1);
            if self.try_wait_for(&k[0], std::time::Duration::from_secs(3)) {
                return;
            }
            assert!(
                t.elapsed() < std::time::Duration::from_secs(120),
                "`kvtier events` saw none of {i} stores within 120 s"
            );
        }
    }

    /// Like [`Follower::wait_for`] within `within`; false when not seen.
    fn try_wait_for(&mut self, key: &kvtier_client::BlockKey, within: std::time::Duration) -> bool {
        let hex = key.to_hex();
        let t = std::time::Instant::now();
        while !self.seen.iter().any(|l| l.contains(&hex)) {
            if t.elapsed() >= within {
                return false;
            }
            if let Ok(l) = self
                .lines
                .recv_timeout(std::time::Duration::from_millis(200))
            {
                self.seen.push(l);
            }
        }
        true
    }

    /// Waits (generously: a loaded 2-core box) for a line naming `key`,
    /// failing if the follower exits first.
    fn wait_for(&mut self, key: &kvtier_client::BlockKey, what: &str) {
        let hex = key.to_hex();
        let t = std::time::Instant::now();
        while !self.seen.iter().any(|l| l.contains(&hex)) {
            match self
                .lines
                .recv_timeout(std::time::Duration::from_millis(200))
            {
                Ok(l) => self.seen.push(l),
                Err(_) => {
                    if let Some(st) = self.child.try_wait().unwrap() {
                        let mut err = String::new();
                        use std::io::Read;
                        let _ = self.child.stderr.take().unwrap().read_to_string(&mut err);
                        panic!("`kvtier events` exited ({st}) before {what}: {err}");
                    }
                    assert!(
                        t.elapsed() < std::time::Duration::from_secs(120),
                        "no event for {what} within 120 s"
                    );
                }
            }
        }
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tiny_ns() -> kvtier_client::Namespace {
    kvtier_client::Namespace::new(
        "e2e-events",
        kvtier_client::KvLayout::with_block_bytes(4096).unwrap(),
        "",
        "t",
    )
    .unwrap()
}

/// Offloads `n` chained 4 KiB blocks (in batches) from token `first` on;
/// returns their keys.
fn offload_tiny(socket: &std::path::Path, first: u32, n: usize) -> Vec<kvtier_client::BlockKey> {
    // A generous deadline per call: the stall test's flood runs on a
    // loaded box.
    let mut cfg = kvtier_client::ClientConfig::new(socket);
    cfg.timeout_ms = 60_000;
    let c = kvtier_client::Client::with_config(cfg);
    let ns = tiny_ns();
    let h = c.namespace(&ns);
    let tokens: Vec<u32> = (first..first + n as u32 * 16).collect();
    let keys = h.hash_chain(&tokens);
    let data = vec![7u8; 4096];
    let mut parent = None;
    for part in keys.chunks(256) {
        let refs: Vec<&[u8]> = part.iter().map(|_| &data[..]).collect();
        let out = h.offload_chain(parent, part, &refs, kvtier_client::Hints::default());
        assert!(
            out.iter()
                .all(|o| *o == kvtier_client::OffloadOutcome::Stored),
            "{out:?}"
        );
        parent = part.last().copied();
    }
    keys
}

/// A follower stopped and continued (SIGSTOP/SIGCONT, as a shell's ^Z and
/// `fg` do) goes on following: its recv with a timeout fails with EINTR
/// on the continue, which is no error. Several cycles, each while the
/// follower waits in that recv (it is idle and caught up).
#[test]
fn kvtier_events_survives_stop_and_continue() {
    use nix::sys::signal::Signal;
    let d = Daemon::start();
    let mut f = Follower::start(&d.socket);
    // Subscribed and caught up once a first store shows.
    f.subscribed(&d.socket, 900_000_000);
    for i in 0..3u32 {
        std::thread::sleep(std::time::Duration::from_millis(300));
        f.signal(Signal::SIGSTOP);
        std::thread::sleep(std::time::Duration::from_millis(300));
        f.signal(Signal::SIGCONT);
        let k = offload_tiny(&d.socket, 1_000_000 * (i + 1), 1);
        f.wait_for(&k[0], "a store after SIGSTOP/SIGCONT");
    }
}

/// A follower that stops reading for many times the daemon's write
/// timeout, while thousands of events go by, is not disconnected: once it
/// reads again it is told it lagged and then gets the events that follow.
#[test]
fn a_stalled_events_follower_gets_lagged_and_is_never_dropped() {
    use nix::sys::signal::Signal;
    // A short write timeout: the old server dropped a follower whose
    // socket stayed full that long.
    let d = Daemon::start_with(
        &[],
        &[("KVTIERD_SERVER_IO_TIMEOUT_MS".into(), "300".into())],
    );
    let mut f = Follower::start(&d.socket);
    f.subscribed(&d.socket, 900_000_000);
    f.signal(Signal::SIGSTOP);
    // More than the bus queues for one subscriber (4096) plus what its
    // socket holds: the socket fills, the daemon waits on it, the bus
    // drops the rest.
    let flood = kvtier_daemon::base::events::QUEUE_DEPTH + 1024;
    offload_tiny(&d.socket, 10_000_000, flood);
    // Stalled for 10x the write timeout with the socket full.
    std::thread::sleep(std::time::Duration::from_secs(3));
    f.signal(Signal::SIGCONT);
    // The events that follow reach it: a store made while the bus still
    // drops (the follower draining its socket) is lost by design, and
    // counted in the lag; stores are repeated until one arrives.
    f.subscribed(&d.socket, 20_000_000);
    assert!(
        f.seen.iter().any(|l| l.contains("\"lagged\"")),
        "no lag notice among {} lines",
        f.seen.len()
    );
    assert!(f.child.try_wait().unwrap().is_none(), "the follower exited");
}

/// `kvtier demo | head -1`: the demo's stdout closes after its first line.
/// The kvtierd it started must end with it, not stay running in the
/// background (issue 30), and the temporary directory it made must go too
/// (issue 43: it died of SIGPIPE without running Drop and left it).
#[test]
fn a_demo_killed_by_sigpipe_takes_its_own_daemon_with_it() {
    let home = tempfile::tempdir().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // Marks the daemons this demo starts (they inherit the environment).
    let mark = format!("KVTIER_TEST_MARK={}", std::process::id());
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("{} demo | head -1", kvtier().display()))
        .env_remove("KVTIER_SOCKET")
        .env("HOME", home.path())
        .env("XDG_RUNTIME_DIR", home.path())
        .env("XDG_STATE_HOME", home.path())
        .env("KVTIER_TEST_MARK", std::process::id().to_string())
        .env("TMPDIR", tmp.path())
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("starting one of its own"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    // The shell waited for both ends of the pipe: the demo has exited.
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "the demo left {left:?} in TMPDIR");
    assert!(
        String::from_utf8_lossy(&out.stderr).is_empty(),
        "a closed pipe is no error to report: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let marked = || -> Vec<String> {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
            .filter(|e| {
                std::fs::read(e.path().join("environ"))
                    .map(|env| env.split(|&b| b == 0).any(|v| v == mark.as_bytes()))
                    .unwrap_or(false)
            })
            .filter(|e| {
                std::fs::read_to_string(e.path().join("comm"))
                    .map(|c| c.trim() == "kvtierd")
                    .unwrap_or(false)
            })
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    };
    let t = std::time::Instant::now();
    while !marked().is_empty() && t.elapsed() < std::time::Duration::from_secs(30) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let left = marked();
    for pid in &left {
        let _ = Command::new("kill").args(["-9", pid]).status();
    }
    assert!(
        left.is_empty(),
        "the demo's kvtierd outlived it: pids {left:?}"
    );
}

/// kvtierd's flags read values as people type them (issue 30): `--mount ""`
/// turns the mount off (clap's path parser read "" as missing), and a
/// negative `--g3-capacity` gets the size parser's reason, not clap's
/// "unexpected argument".
#[test]
fn kvtierd_flags_take_an_empty_mount_and_explain_a_negative_size() {
    let out = Command::new(support::kvtierd_bin())
        .args(["--check-config", "--mount", ""])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(support::kvtierd_bin())
        .args(["--check-config", "--g3-capacity", "-1GiB"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("-1GiB") && !err.contains("unexpected argument"),
        "{err}"
    );
}

/// Starts kvtierd with `file` as its config, `env` and `flags`, until its
/// socket answers `kvtier stats --json`; SIGTERMs it and returns the stats
/// and kvtierd's stderr. RUST_LOG and KVTIERD_* of the test's own
/// environment are removed first.
fn kvtierd_layered(
    file: &str,
    env: &[(&str, &str)],
    flags: &[&str],
) -> (serde_json::Value, String) {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let conf = dir.path().join("kvtierd.toml");
    std::fs::write(&conf, file).unwrap();
    let mut c = Command::new(support::kvtierd_bin());
    c.arg("--config")
        .arg(&conf)
        .arg("--socket")
        .arg(&socket)
        .arg("--g3-dir")
        .arg(dir.path().join("g3"))
        .args(["--metrics-addr", "", "--g4", ""])
        .args(flags)
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("KVTIERD_")) {
        c.env_remove(k);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    let child = c.spawn().unwrap();
    support::wait_for_socket(&socket, std::time::Duration::from_secs(30));
    let (ok, out, err) = run(&["stats", "--json"], &socket);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let done = child.wait_with_output().unwrap();
    let stderr = String::from_utf8(done.stderr).unwrap();
    assert!(ok, "stats: {err}\nkvtierd: {stderr}");
    (serde_json::from_str(&out).unwrap(), stderr)
}

/// The precedence docs/OPERATIONS.md states, on a running daemon: a flag
/// over a `KVTIERD_*` variable over the file over the default, and for the
/// log filter `RUST_LOG` over `KVTIERD_LOG_LEVEL` over `[log] level`.
#[test]
fn kvtierd_precedence_flag_env_file_and_rust_log() {
    let cap = |s: &serde_json::Value| s["tiers"]["g3"]["capacity_bytes"].as_u64().unwrap();
    let file = "[g3]\ncapacity = \"96MiB\"\n[log]\nlevel = \"error\"\n";
    let env = [("KVTIERD_G3_CAPACITY", "80MiB")];
    let (s, _) = kvtierd_layered(file, &[], &[]);
    assert_eq!(cap(&s), 96 << 20, "the file over the default");
    let (s, _) = kvtierd_layered(file, &env, &[]);
    assert_eq!(cap(&s), 80 << 20, "the environment over the file");
    let (s, _) = kvtierd_layered(file, &env, &["--g3-capacity", "72MiB"]);
    assert_eq!(cap(&s), 72 << 20, "a flag over the environment");
    // kvtierd logs INFO lines at start-up: seen only where info is on.
    let info = |stderr: &str| stderr.lines().any(|l| l.contains(" INFO "));
    let (_, log) = kvtierd_layered(file, &[], &[]);
    assert!(!info(&log), "[log] level = error logs no INFO: {log}");
    let (_, log) = kvtierd_layered(file, &[("KVTIERD_LOG_LEVEL", "info")], &[]);
    assert!(info(&log), "KVTIERD_LOG_LEVEL over the file: {log}");
    let (_, log) = kvtierd_layered(
        file,
        &[("KVTIERD_LOG_LEVEL", "info"), ("RUST_LOG", "warn")],
        &[],
    );
    assert!(!info(&log), "RUST_LOG over KVTIERD_LOG_LEVEL: {log}");
}

/// A peer address already in use stops kvtierd with one line that names
/// the key (`peer.bind`) and says the cause once (issue 30: it was printed
/// twice, without the key).
#[test]
fn kvtierd_peer_bind_error_names_the_key_once() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let secret = dir.path().join("peer.secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = Command::new(support::kvtierd_bin())
        .arg("--socket")
        .arg(dir.path().join("s.sock"))
        .arg("--g3-dir")
        .arg(dir.path().join("g3"))
        .args(["--g3-capacity", "64MiB", "--metrics-addr", "", "--g4", ""])
        .args(["--peer-listen", &addr, "--peer-secret-file"])
        .arg(&secret)
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err.lines().last().unwrap_or("");
    assert!(
        last.contains("config: `peer.bind`") && last.contains(&addr),
        "{err}"
    );
    assert_eq!(
        last.matches("in use").count(),
        1,
        "the cause said once: {err}"
    );
}
