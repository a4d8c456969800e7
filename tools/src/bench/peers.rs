//! `kvtier bench peers`: kvtier beside the systems a user would pick
//! instead, on the same blocks, the same disk and in the same invocation,
//! interleaved round by round (the order rotates every round).
//!
//! - `kvtier`: client -> socket -> a real `kvtierd` (G3 only) on `--dir`.
//!   After the puts were acknowledged the daemon is killed with SIGKILL and
//!   restarted on the same directory; the gets run against the restarted
//!   daemon with the page cache dropped.
//! - `foyer_durable`, `foyer_default`: foyer's hybrid cache in process, run
//!   by `kvtier-bench-foyer` (tools/peers: a crate of its own, so foyer never
//!   enters kvtier's dependency tree); the same put / restart / cold get.
//! - `mooncake`: Mooncake Store with SSD offload, run by
//!   tools/peers/mooncake_peer.py where its wheel is installed.
//!
//! A peer that is not installed is reported under `skipped` with the reason,
//! never as a figure. Per system: put and get GB/s, p50/p99 latency (the
//! latency of the request a block rode in), and `lost_blocks`: blocks whose
//! put was acknowledged but which were not read back with their exact bytes.
//! Comparisons (BENCH.md, higher is better): `{m}` (kvtier),
//! `{m}_{peer}_baseline` and `{m}_vs_{peer}_baseline`; latencies enter them
//! as rates (`get_p50_per_s` = 1e6 / p50 in µs).

use super::common::{self, median, noise, percentile};
use crate::ops::OwnedDaemon;
use anyhow::{bail, Context, Result};
use clap::Args;
use kvtier_client::{BlockKey, Client, ClientConfig, Hints, KvLayout, Namespace, OffloadOutcome};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Arguments of `kvtier bench peers`.
#[derive(Debug, Args)]
pub struct PeersArgs {
    /// Directory on the disk to measure (every system works in a temp dir
    /// under it).
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
    /// Block (value) size.
    #[arg(long, default_value = "2MiB", value_parser = common::parse_size)]
    pub block_size: u64,
    /// Blocks per round (each put once and read once by every system).
    #[arg(long, default_value_t = 128)]
    pub blocks: usize,
    /// kvtier clients (threads, one connection each).
    #[arg(long, default_value_t = 2)]
    pub clients: usize,
    /// Blocks per kvtier request; clients x depth is every system's number
    /// of blocks in flight.
    #[arg(long, default_value_t = 4)]
    pub depth: usize,
    /// Interleaved rounds (medians reported).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// The foyer peer's binary (default: $KVTIER_BENCH_FOYER_BIN, beside
    /// this executable, or tools/peers/target/{release,debug}).
    #[arg(long)]
    pub foyer_bin: Option<PathBuf>,
    /// A Python with the `mooncake-transfer-engine-non-cuda` wheel (default:
    /// $KVTIER_BENCH_MOONCAKE_PYTHON or target/peers-venv/bin/python).
    #[arg(long)]
    pub mooncake_python: Option<PathBuf>,
    /// Systems to leave out (comma separated: foyer, mooncake).
    #[arg(long, value_delimiter = ',')]
    pub skip: Vec<String>,
    /// One JSON document on stdout.
    #[arg(long)]
    pub json: bool,
}

/// One system's measurements of one round.
#[derive(Debug, Clone, Default)]
struct Round {
    put_gbps: f64,
    get_gbps: f64,
    put_p50_us: f64,
    put_p99_us: f64,
    get_p50_us: f64,
    get_p99_us: f64,
    acknowledged: u64,
    lost_blocks: u64,
    cold: bool,
}

impl Round {
    fn from_json(v: &Value) -> Result<Round> {
        let f = |k: &str| {
            v[k].as_f64()
                .with_context(|| format!("peer report lacks {k}: {v}"))
        };
        Ok(Round {
            put_gbps: f("put_gbps")?,
            get_gbps: f("get_gbps")?,
            put_p50_us: f("put_p50_us")?,
            put_p99_us: f("put_p99_us")?,
            get_p50_us: f("get_p50_us")?,
            get_p99_us: f("get_p99_us")?,
            acknowledged: f("acknowledged")? as u64,
            lost_blocks: f("lost_blocks")? as u64,
            cold: v["cold_page_cache"].as_bool().unwrap_or(false),
        })
    }
}

/// A system under test: how to run one round of it.
enum System {
    Kvtier,
    Child {
        name: &'static str,
        program: PathBuf,
        args: Vec<String>,
        /// The child reads the round's payloads from its stdin.
        stdin_payloads: bool,
    },
}

impl System {
    fn name(&self) -> &'static str {
        match self {
            System::Kvtier => "kvtier",
            System::Child { name, .. } => name,
        }
    }
}

fn kvtierd_bin() -> PathBuf {
    let local = std::env::current_exe()
        .ok()
        .map(|e| e.with_file_name("kvtierd"));
    match local {
        Some(p) if p.exists() => p,
        _ => PathBuf::from("kvtierd"),
    }
}

fn start_daemon(dir: &Path, capacity_bytes: u64) -> Result<OwnedDaemon> {
    let socket = dir.join("kvtierd.sock");
    let args: Vec<std::ffi::OsString> = vec![
        "--socket".into(),
        socket.clone().into(),
        "--g3-dir".into(),
        dir.join("g3").into(),
        "--metrics-addr".into(),
        "".into(),
        "--g3-capacity".into(),
        capacity_bytes.to_string().into(),
        // G4 off: kvtier is measured on the disk the peers use, alone.
        "--g4".into(),
        "".into(),
    ];
    OwnedDaemon::spawn(&kvtierd_bin(), &args, socket, Vec::new())
}

/// One kvtier round: offload every block, SIGKILL the daemon, restart it,
/// drop the page cache, onboard every block in random order.
fn kvtier_round(a: &PeersArgs, work: &Path, seed: u64, payloads: &[Vec<u8>]) -> Result<Round> {
    let bs = a.block_size as usize;
    let dir = work.join("kvtier");
    std::fs::create_dir_all(&dir)?;
    let cap = (a.blocks as u64 * (a.block_size + 8192)) * 2 + (64 << 20);
    let layout = KvLayout::with_block_bytes(a.block_size)?;
    let ns = Namespace::new(format!("bench-peers-{seed}"), layout, "", "")?;
    let keys: Vec<BlockKey> = (0..a.blocks as u64)
        .map(|i| BlockKey::from_u64(seed << 32 | i | 1 << 63))
        .collect();
    let slot = 4096 + bs.div_ceil(4096) * 4096;
    let clients = |socket: &Path| -> Vec<Client> {
        (0..a.clients)
            .map(|_| {
                let mut c = ClientConfig::new(socket);
                c.region_bytes = (slot * a.depth) as u64;
                c.timeout_ms = 120_000;
                Client::with_config(c)
            })
            .collect()
    };
    let per = a.blocks.div_ceil(a.clients);

    let mut daemon = start_daemon(&dir, cap)?;
    let cs = clients(&daemon.socket);
    let acked = std::sync::atomic::AtomicU64::new(0);
    let put_lat = std::sync::Mutex::new(Vec::new());
    let t = Instant::now();
    std::thread::scope(|s| {
        for (ci, c) in cs.iter().enumerate() {
            let (keys, ns, acked, put_lat) = (&keys, &ns, &acked, &put_lat);
            s.spawn(move || {
                let h = c.namespace(ns);
                let lo = (ci * per).min(keys.len());
                let hi = (lo + per).min(keys.len());
                let mut lat = Vec::new();
                for start in (lo..hi).step_by(a.depth) {
                    let end = (start + a.depth).min(hi);
                    let blocks: Vec<kvtier_client::OffloadBlock<'_>> = (start..end)
                        .map(|j| kvtier_client::OffloadBlock {
                            key: keys[j],
                            parent: None,
                            payload: &payloads[j],
                            hints: Hints::default(),
                        })
                        .collect();
                    let t = Instant::now();
                    let out = h.offload(&blocks);
                    let us = t.elapsed().as_secs_f64() * 1e6;
                    let ok = out.iter().filter(|o| **o == OffloadOutcome::Stored).count();
                    acked.fetch_add(ok as u64, std::sync::atomic::Ordering::Relaxed);
                    lat.extend(std::iter::repeat_n(us, blocks.len()));
                }
                if let Ok(mut l) = put_lat.lock() {
                    l.extend(lat);
                }
            });
        }
    });
    let put_s = t.elapsed().as_secs_f64();
    let acked = acked.into_inner();
    drop(cs);
    // A process that stops right after its acks: nothing gets to flush.
    daemon.kill_hard();
    drop(daemon);
    let daemon = start_daemon(&dir, cap)?;
    let cs = clients(&daemon.socket);
    let cold = common::drop_page_cache();
    let order = common::shuffled(a.blocks, seed);
    let lost = std::sync::atomic::AtomicU64::new(0);
    let got_bytes = std::sync::atomic::AtomicUsize::new(0);
    let get_lat = std::sync::Mutex::new(Vec::new());
    let t = Instant::now();
    std::thread::scope(|s| {
        for (ci, c) in cs.iter().enumerate() {
            let (keys, ns, order, lost, got_bytes, get_lat) =
                (&keys, &ns, &order, &lost, &got_bytes, &get_lat);
            s.spawn(move || {
                let h = c.namespace(ns);
                let mine: Vec<usize> = order.iter().skip(ci * per).take(per).copied().collect();
                let mut bufs: Vec<Vec<u8>> = (0..a.depth).map(|_| vec![0u8; bs]).collect();
                let mut lat = Vec::new();
                for chunk in mine.chunks(a.depth) {
                    let ks: Vec<BlockKey> = chunk.iter().map(|&i| keys[i]).collect();
                    let mut rb: Vec<&mut [u8]> = bufs
                        .iter_mut()
                        .take(chunk.len())
                        .map(|b| &mut b[..])
                        .collect();
                    let t = Instant::now();
                    let r = h.onboard_into(&ks, &mut rb);
                    let us = t.elapsed().as_secs_f64() * 1e6;
                    for (j, &i) in chunk.iter().enumerate() {
                        let good = r.get(j).is_some_and(|x| x.is_hit()) && rb[j] == payloads[i];
                        if good {
                            lat.push(us);
                            got_bytes.fetch_add(bs, std::sync::atomic::Ordering::Relaxed);
                        } else {
                            lost.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
                if let Ok(mut l) = get_lat.lock() {
                    l.extend(lat);
                }
            });
        }
    });
    let get_s = t.elapsed().as_secs_f64();
    drop(cs);
    drop(daemon);
    let _ = std::fs::remove_dir_all(&dir);
    let put_lat = put_lat.into_inner().unwrap_or_default();
    let get_lat = get_lat.into_inner().unwrap_or_default();
    // Blocks never acknowledged are no loss; acknowledged ones not read back
    // are (with every put acknowledged, that is every miss).
    let not_acked = a.blocks as u64 - acked;
    Ok(Round {
        put_gbps: common::gbps(bs * acked as usize, put_s),
        get_gbps: common::gbps(got_bytes.into_inner(), get_s),
        put_p50_us: percentile(&put_lat, 50.0),
        put_p99_us: percentile(&put_lat, 99.0),
        get_p50_us: percentile(&get_lat, 50.0),
        get_p99_us: percentile(&get_lat, 99.0),
        acknowledged: acked,
        lost_blocks: lost.into_inner().saturating_sub(not_acked),
        cold,
    })
}

fn child_round(
    a: &PeersArgs,
    work: &Path,
    seed: u64,
    program: &Path,
    args: &[String],
    stdin_payloads: Option<&[Vec<u8>]>,
) -> Result<Round> {
    // Its log (Mooncake's is long) goes to a file, shown when it fails.
    let log_path = work.join(format!("peer-{seed}.stderr"));
    let log = std::fs::File::create(&log_path)?;
    let mut child = Command::new(program)
        .args(args)
        .args([
            "--dir".into(),
            work.display().to_string(),
            "--block-bytes".into(),
            a.block_size.to_string(),
            "--blocks".into(),
            a.blocks.to_string(),
            "--inflight".into(),
            (a.clients * a.depth).to_string(),
            "--seed".into(),
            seed.to_string(),
        ])
        .stdin(if stdin_payloads.is_some() {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stdout(std::process::Stdio::piped())
        .stderr(log)
        .spawn()
        .with_context(|| format!("running {}", program.display()))?;
    if let (Some(p), Some(mut stdin)) = (stdin_payloads, child.stdin.take()) {
        use std::io::Write;
        for b in p {
            stdin
                .write_all(b)
                .with_context(|| format!("feeding {}", program.display()))?;
        }
    }
    let out = child.wait_with_output()?;
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    let _ = std::fs::remove_file(&log_path);
    if !out.status.success() {
        let tail: String = log
            .lines()
            .rev()
            .take(20)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        bail!("{} failed ({}): {tail}", program.display(), out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .with_context(|| format!("{} printed no JSON: {text}", program.display()))?;
    Round::from_json(&serde_json::from_str(line)?)
}

fn find_foyer(a: &PeersArgs) -> std::result::Result<PathBuf, String> {
    if let Some(p) = &a.foyer_bin {
        return if p.exists() {
            Ok(p.clone())
        } else {
            Err(format!("--foyer-bin {} does not exist", p.display()))
        };
    }
    let mut cands: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("KVTIER_BENCH_FOYER_BIN") {
        cands.push(p.into());
    }
    if let Ok(e) = std::env::current_exe() {
        cands.push(e.with_file_name("kvtier-bench-foyer"));
    }
    let peers = Path::new(env!("CARGO_MANIFEST_DIR")).join("peers/target");
    cands.push(peers.join("release/kvtier-bench-foyer"));
    cands.push(peers.join("debug/kvtier-bench-foyer"));
    cands.into_iter().find(|p| p.exists()).ok_or_else(|| {
        "kvtier-bench-foyer is not built: cargo build --release --manifest-path \
         tools/peers/Cargo.toml (or pass --foyer-bin)"
            .to_string()
    })
}

fn find_mooncake(a: &PeersArgs) -> std::result::Result<(PathBuf, PathBuf), String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("peers/mooncake_peer.py");
    if !script.exists() {
        return Err(format!("{} is missing", script.display()));
    }
    let python = a
        .mooncake_python
        .clone()
        .or_else(|| std::env::var_os("KVTIER_BENCH_MOONCAKE_PYTHON").map(PathBuf::from))
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/peers-venv/bin/python")
        });
    if !python.exists() {
        return Err(format!(
            "no Python with Mooncake at {} (python3 -m venv target/peers-venv && \
             target/peers-venv/bin/pip install mooncake-transfer-engine-non-cuda)",
            python.display()
        ));
    }
    // The wheel must import and its native store must load.
    let probe = Command::new(&python)
        .args(["-c", "from mooncake.store import MooncakeDistributedStore"])
        .output()
        .map_err(|e| format!("running {}: {e}", python.display()))?;
    if !probe.status.success() {
        return Err(format!(
            "mooncake.store does not import with {}: {}",
            python.display(),
            String::from_utf8_lossy(&probe.stderr).trim()
        ));
    }
    Ok((python, script))
}

/// Runs the benchmark and returns its report.
pub fn measure(a: &PeersArgs) -> Result<Value> {
    if a.blocks == 0 || a.clients == 0 || a.depth == 0 || a.rounds == 0 {
        bail!("--blocks, --clients, --depth and --rounds must be positive");
    }
    std::fs::create_dir_all(&a.dir).with_context(|| format!("creating {}", a.dir.display()))?;
    let work = tempfile::Builder::new()
        .prefix("kvtier-bench-peers-")
        .tempdir_in(&a.dir)
        .with_context(|| format!("temp dir in {}", a.dir.display()))?;
    let mut systems = vec![System::Kvtier];
    let mut skipped = Map::new();
    if a.skip.iter().any(|s| s == "foyer") {
        skipped.insert("foyer".into(), json!("left out by --skip"));
    } else {
        match find_foyer(a) {
            Ok(bin) => {
                for (name, cfg) in [("foyer_durable", "durable"), ("foyer_default", "default")] {
                    systems.push(System::Child {
                        name,
                        program: bin.clone(),
                        args: vec!["--config".into(), cfg.into()],
                        stdin_payloads: false,
                    });
                }
            }
            Err(why) => {
                skipped.insert("foyer".into(), json!(why));
            }
        }
    }
    if a.skip.iter().any(|s| s == "mooncake") {
        skipped.insert("mooncake".into(), json!("left out by --skip"));
    } else {
        match find_mooncake(a) {
            Ok((python, script)) => systems.push(System::Child {
                name: "mooncake",
                program: python,
                args: vec![script.display().to_string()],
                stdin_payloads: true,
            }),
            Err(why) => {
                skipped.insert("mooncake".into(), json!(why));
            }
        }
    }

    let bs = a.block_size as usize;
    let mut rounds: Vec<Vec<Round>> = vec![Vec::new(); systems.len()];
    let mut failed = Map::new();
    for r in 0..a.rounds {
        let seed = 1000 * (r as u64 + 1);
        let payloads: Vec<Vec<u8>> = (0..a.blocks).map(|i| noise(seed + i as u64, bs)).collect();
        // Rotate who goes first so no system always meets a fresh disk.
        for k in 0..systems.len() {
            let i = (k + r) % systems.len();
            let sys = &systems[i];
            if failed.contains_key(sys.name()) {
                continue;
            }
            eprintln!("peers bench: round {} {}", r + 1, sys.name());
            let res = match sys {
                System::Kvtier => kvtier_round(a, work.path(), seed, &payloads),
                System::Child {
                    program,
                    args,
                    stdin_payloads,
                    ..
                } => child_round(
                    a,
                    work.path(),
                    seed,
                    program,
                    args,
                    stdin_payloads.then_some(&payloads[..]),
                ),
            };
            match res {
                Ok(x) => rounds[i].push(x),
                // kvtier failing is the bench failing; a peer failing is
                // that peer's result, reported.
                Err(e) if i > 0 => {
                    failed.insert(sys.name().into(), json!(format!("{e:#}")));
                }
                Err(e) => return Err(e),
            }
        }
    }
    drop(work);

    let mut out = Map::new();
    out.insert("bench".into(), json!("peers"));
    out.insert("dir".into(), json!(a.dir.display().to_string()));
    out.insert("block_bytes".into(), json!(a.block_size));
    out.insert("blocks".into(), json!(a.blocks));
    out.insert("clients".into(), json!(a.clients));
    out.insert("depth".into(), json!(a.depth));
    out.insert("inflight_blocks".into(), json!(a.clients * a.depth));
    out.insert("rounds".into(), json!(a.rounds));
    out.insert(
        "method".into(),
        json!("per round and system: put every block, stop the process without a flush (SIGKILL for kvtierd; foyer's cache dropped with flush_on_close off after its flushers drained), restart on the same directory, drop the page cache, get every block; lost_blocks = acknowledged puts not read back with their exact bytes"),
    );
    let mut per = Map::new();
    let mut med: Vec<Option<Round>> = Vec::new();
    let mut cold = true;
    for (i, sys) in systems.iter().enumerate() {
        let rs = &rounds[i];
        if rs.is_empty() {
            med.push(None);
            continue;
        }
        let col = |f: fn(&Round) -> f64| rs.iter().map(f).collect::<Vec<f64>>();
        let m = Round {
            put_gbps: median(&col(|x| x.put_gbps)),
            get_gbps: median(&col(|x| x.get_gbps)),
            put_p50_us: median(&col(|x| x.put_p50_us)),
            put_p99_us: median(&col(|x| x.put_p99_us)),
            get_p50_us: median(&col(|x| x.get_p50_us)),
            get_p99_us: median(&col(|x| x.get_p99_us)),
            acknowledged: rs.iter().map(|x| x.acknowledged).sum(),
            lost_blocks: rs.iter().map(|x| x.lost_blocks).sum(),
            cold: rs.iter().all(|x| x.cold),
        };
        cold &= m.cold;
        per.insert(
            sys.name().into(),
            json!({
                "put_gbps": m.put_gbps,
                "get_gbps": m.get_gbps,
                "put_p50_us": m.put_p50_us,
                "put_p99_us": m.put_p99_us,
                "get_p50_us": m.get_p50_us,
                "get_p99_us": m.get_p99_us,
                "acknowledged": m.acknowledged,
                "lost_blocks": m.lost_blocks,
                "put_gbps_rounds": col(|x| x.put_gbps),
                "get_gbps_rounds": col(|x| x.get_gbps),
                "get_p50_us_rounds": col(|x| x.get_p50_us),
                "lost_blocks_rounds": rs.iter().map(|x| x.lost_blocks).collect::<Vec<_>>(),
            }),
        );
        med.push(Some(m));
    }
    out.insert("cold_page_cache".into(), json!(cold));
    out.insert("systems".into(), Value::Object(per));
    out.insert("skipped".into(), Value::Object(skipped));
    out.insert("failed".into(), Value::Object(failed));
    if let Some(Some(k)) = med.first() {
        let rate = |us: f64| 1e6 / us.max(1e-3);
        out.insert("put_gbps".into(), json!(k.put_gbps));
        out.insert("get_gbps".into(), json!(k.get_gbps));
        out.insert("get_p50_per_s".into(), json!(rate(k.get_p50_us)));
        out.insert("put_p50_per_s".into(), json!(rate(k.put_p50_us)));
        out.insert("lost_blocks".into(), json!(k.lost_blocks));
        for (i, sys) in systems.iter().enumerate().skip(1) {
            let Some(Some(p)) = med.get(i) else { continue };
            let peer = sys.name();
            for (name, m, b) in [
                ("put_gbps", k.put_gbps, p.put_gbps),
                ("get_gbps", k.get_gbps, p.get_gbps),
                ("get_p50_per_s", rate(k.get_p50_us), rate(p.get_p50_us)),
                ("put_p50_per_s", rate(k.put_p50_us), rate(p.put_p50_us)),
            ] {
                out.insert(format!("{name}_{peer}_baseline"), json!(b));
                let q = if b > 0.0 { m / b } else { 0.0 };
                out.insert(format!("{name}_vs_{peer}_baseline"), json!(q));
            }
        }
    }
    Ok(Value::Object(out))
}

/// Runs the benchmark and prints its report.
pub fn run(a: PeersArgs) -> Result<()> {
    let report = measure(&a)?;
    common::emit(&report, a.json)
}
