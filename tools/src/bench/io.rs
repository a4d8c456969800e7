//! `kvtier bench io`: end-to-end offload and cold onboard through
//! client -> socket -> daemon -> store, beside a raw O_DIRECT baseline of the
//! same sizes and depth on the same filesystem, interleaved round by round.
//!
//! The JSON names the daemon's backend (`"backend"`): the daemon this bench
//! starts runs the real G3 store with G4 off (`g3`), so the figures are
//! client -> socket -> daemon -> io_uring/O_DIRECT on the disk. With
//! `--socket`, whatever that daemon runs is measured (and named).

use super::common::{self, RawFile};
use anyhow::{bail, Context, Result};
use clap::Args;
use kvtier_client::{BlockKey, Client, ClientConfig, Hints, KvLayout, Namespace, OffloadOutcome};
use serde_json::{json, Map, Value};
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `kvtier bench io`.
#[derive(Debug, Args)]
pub struct IoArgs {
    /// Block size.
    #[arg(long, default_value = "2MiB", value_parser = common::parse_size)]
    block_size: u64,
    /// Blocks per round.
    #[arg(long, default_value_t = 128)]
    blocks: usize,
    /// Blocks per request (and O_DIRECT requests in flight for the baseline).
    #[arg(long, default_value_t = 8)]
    depth: usize,
    /// Concurrent clients (threads, one connection each).
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Interleaved rounds (median reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// A running daemon's socket (default: start one in a temp dir).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Directory for the baseline file (and the daemon started here).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Read with direct-read fds instead of the shared region.
    #[arg(long)]
    direct_read: bool,
    /// One JSON document on stdout.
    #[arg(long)]
    json: bool,
}

fn payload(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let mut x = seed | 1;
    for c in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    v
}

/// Runs the benchmark.
pub fn run(a: IoArgs) -> Result<()> {
    if a.blocks == 0 || a.depth == 0 || a.clients == 0 || a.rounds == 0 {
        bail!("--blocks, --depth, --clients and --rounds must be positive");
    }
    let bs = a.block_size as usize;
    let layout = KvLayout::with_block_bytes(a.block_size)?;
    let base_dir = match &a.dir {
        Some(d) => d.clone(),
        None => std::env::current_dir()?,
    };
    let work = tempfile::Builder::new()
        .prefix("kvtier-bench-io-")
        .tempdir_in(&base_dir)
        .with_context(|| format!("temp dir in {}", base_dir.display()))?;
    let cap = format!(
        "{}",
        (a.blocks as u64 * (a.block_size + 8192)) * 2 + (64 << 20)
    );
    let owned;
    let (socket, daemon_pid) = match &a.socket {
        Some(s) => (s.clone(), None),
        None => {
            // G4 off: the G4 write-through would read every block back from
            // the same disk while the bench measures it against raw I/O.
            owned = crate::ops::OwnedDaemon::start(&["--g3-capacity", &cap, "--g4", ""])?;
            (owned.socket.clone(), Some(owned.pid()))
        }
    };
    // CPU per GB moved: this process (clients) plus the daemon it started
    // (a `--socket` daemon's CPU is not visible: clients only), beside the
    // raw baseline's (this process alone, the daemon idle).
    let gb = (bs * a.blocks) as f64 / 1e9;
    let cpu = || common::cpu_s_with(daemon_pid);
    let slot = 4096 + bs.div_ceil(4096) * 4096;
    let mk = |i: usize| {
        let mut c = ClientConfig::new(&socket);
        c.region_bytes = (slot * a.depth) as u64;
        c.timeout_ms = 60_000;
        c.direct_read = a.direct_read;
        let _ = i;
        Client::with_config(c)
    };
    let clients: Vec<Client> = (0..a.clients).map(mk).collect();
    let backend = clients[0]
        .stats()
        .ok()
        .and_then(|s| s["backend"].as_str().map(String::from))
        .unwrap_or_else(|| "unknown".into());
    let data: Vec<Vec<u8>> = (0..a.depth.min(a.blocks))
        .map(|i| payload(i as u64 + 7, bs))
        .collect();
    let raw = RawFile::create(work.path(), bs, a.blocks)?;

    let (mut off, mut on, mut bw, mut br) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // CPU seconds per GB, per round: offload, onboard, raw write, raw read.
    let (mut c_off, mut c_on, mut c_bw, mut c_br) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut lat_us = Vec::new();
    let mut cold = true;
    for round in 0..a.rounds {
        // A fresh namespace per round: every offload really stores.
        let ns = Namespace::new(
            format!("bench-io-{round}-{}", std::process::id()),
            layout,
            "",
            "",
        )?;
        let keys: Vec<BlockKey> = (0..a.blocks as u64)
            .map(|i| BlockKey::from_u64(i ^ ((round as u64) << 40) | 1 << 63))
            .collect();
        // A: offload.
        let c0 = cpu();
        let t = Instant::now();
        let per = a.blocks.div_ceil(a.clients);
        let failures = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for (ci, c) in clients.iter().enumerate() {
                let (keys, data, ns, failures) = (&keys, &data, &ns, &failures);
                s.spawn(move || {
                    let h = c.namespace(ns);
                    let mine = keys.iter().skip(ci * per).take(per).collect::<Vec<_>>();
                    for chunk in mine.chunks(a.depth) {
                        let blocks: Vec<kvtier_client::OffloadBlock<'_>> = chunk
                            .iter()
                            .enumerate()
                            .map(|(j, k)| kvtier_client::OffloadBlock {
                                key: **k,
                                parent: None,
                                payload: &data[j % data.len()],
                                hints: Hints::default(),
                            })
                            .collect();
                        for o in h.offload(&blocks) {
                            if o != OffloadOutcome::Stored {
                                failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                        }
                    }
                });
            }
        });
        off.push(common::gbps(bs * a.blocks, t.elapsed().as_secs_f64()));
        c_off.push((cpu() - c0) / gb);
        if failures.into_inner() > 0 {
            bail!("offload failed for some blocks (is the daemon's capacity large enough?)");
        }
        cold &= common::drop_page_cache();
        // A: onboard in random order.
        let order = common::shuffled(a.blocks, 42 + round as u64);
        let c0 = cpu();
        let t = Instant::now();
        let misses = std::sync::atomic::AtomicUsize::new(0);
        let lats = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for (ci, c) in clients.iter().enumerate() {
                let (keys, order, ns, misses, lats) = (&keys, &order, &ns, &misses, &lats);
                s.spawn(move || {
                    let h = c.namespace(ns);
                    let mut bufs: Vec<Vec<u8>> = (0..a.depth).map(|_| vec![0u8; bs]).collect();
                    let mine: Vec<BlockKey> = order
                        .iter()
                        .skip(ci * per)
                        .take(per)
                        .map(|&i| keys[i])
                        .collect();
                    let mut my_lat = Vec::new();
                    for chunk in mine.chunks(a.depth) {
                        let mut rb: Vec<&mut [u8]> = bufs
                            .iter_mut()
                            .take(chunk.len())
                            .map(|b| &mut b[..])
                            .collect();
                        let t = Instant::now();
                        let r = h.onboard_into(chunk, &mut rb);
                        my_lat.push(t.elapsed().as_secs_f64() * 1e6 / chunk.len() as f64);
                        misses.fetch_add(
                            r.iter().filter(|x| !x.is_hit()).count(),
                            std::sync::atomic::Ordering::Relaxed,
                        );
                    }
                    if let Ok(mut l) = lats.lock() {
                        l.extend(my_lat);
                    }
                });
            }
        });
        on.push(common::gbps(bs * a.blocks, t.elapsed().as_secs_f64()));
        c_on.push((cpu() - c0) / gb);
        if misses.into_inner() > 0 {
            bail!("onboard missed blocks it had just stored");
        }
        lat_us.extend(lats.into_inner().unwrap_or_default());
        // Free the round's blocks so capacity never evicts mid-run.
        let h = clients[0].namespace(&ns);
        let _ = h.evict(&keys);
        // B: the raw baseline, same sizes and depth.
        let c0 = common::process_cpu_s();
        bw.push(raw.write_all(a.depth * a.clients)?);
        c_bw.push((common::process_cpu_s() - c0) / gb);
        cold &= common::drop_page_cache();
        let c0 = common::process_cpu_s();
        br.push(
            raw.read_order(
                a.depth * a.clients,
                &common::shuffled(a.blocks, 7 + round as u64),
            )?
            .0,
        );
        c_br.push((common::process_cpu_s() - c0) / gb);
    }

    // Lookup round trip of a 64-key chain, interleaved with its floor: the
    // same request and reply frames ping-ponged over a Unix socket pair
    // between two threads of this process (no daemon, no index).
    let ns = Namespace::new("bench-io-lookup", layout, "", "")?;
    let h = clients[0].namespace(&ns);
    let chain = h.hash_chain(&(0..64 * 16).collect::<Vec<u32>>());
    let pong = SocketPingPong::new(&ns, &chain)?;
    let (mut lk, mut lk_base) = (Vec::with_capacity(2000), Vec::with_capacity(2000));
    for _ in 0..2000 {
        let t = Instant::now();
        let r = h.lookup(&chain);
        lk.push(t.elapsed().as_secs_f64() * 1e6);
        if r.miss.is_some() {
            bail!("lookup failed: {:?}", r.miss);
        }
        lk_base.push(pong.round_trip_us()?);
    }

    let mut out = Map::new();
    out.insert("bench".into(), json!("io"));
    out.insert("backend".into(), json!(backend));
    out.insert(
        "note".into(),
        json!(if backend == "mem" {
            "daemon backend is in-memory (MemBackend): measures client/socket/shared-memory path, not the disk"
        } else {
            "end to end through the daemon's store"
        }),
    );
    out.insert("block_bytes".into(), json!(bs));
    out.insert("blocks".into(), json!(a.blocks));
    out.insert("depth".into(), json!(a.depth));
    out.insert("clients".into(), json!(a.clients));
    out.insert("rounds".into(), json!(a.rounds));
    out.insert(
        "onboard_mode".into(),
        json!(if a.direct_read { "direct_fd" } else { "shm" }),
    );
    out.insert("cold_page_cache".into(), json!(cold));
    common::compare(
        &mut out,
        "offload_gbps",
        common::median(&off),
        common::median(&bw),
    );
    common::compare(
        &mut out,
        "onboard_gbps",
        common::median(&on),
        common::median(&br),
    );
    // CPU: seconds per GB (lower is better) and, for the contract's
    // higher-is-better quotient, GB per CPU second.
    for (name, m, b) in [("offload", &c_off, &c_bw), ("onboard", &c_on, &c_br)] {
        let (m, b) = (common::median(m), common::median(b));
        out.insert(format!("{name}_cpu_s_per_gb"), json!(m));
        out.insert(format!("{name}_cpu_s_per_gb_baseline"), json!(b));
        common::compare(
            &mut out,
            &format!("{name}_gb_per_cpu_s"),
            1.0 / m.max(1e-6),
            1.0 / b.max(1e-6),
        );
    }
    out.insert(
        "cpu_measured".into(),
        json!(if daemon_pid.is_some() {
            "clients and the daemon"
        } else {
            "clients only (a --socket daemon)"
        }),
    );
    out.insert("offload_cpu_s_per_gb_rounds".into(), json!(c_off));
    out.insert("onboard_cpu_s_per_gb_rounds".into(), json!(c_on));
    out.insert("baseline_write_cpu_s_per_gb_rounds".into(), json!(c_bw));
    out.insert("baseline_read_cpu_s_per_gb_rounds".into(), json!(c_br));
    out.insert("offload_gbps_rounds".into(), json!(off));
    out.insert("onboard_gbps_rounds".into(), json!(on));
    out.insert("baseline_write_gbps_rounds".into(), json!(bw));
    out.insert("baseline_read_gbps_rounds".into(), json!(br));
    out.insert(
        "onboard_per_block_p50_us".into(),
        json!(common::median(&lat_us)),
    );
    out.insert(
        "onboard_per_block_p99_us".into(),
        json!(common::percentile(&lat_us, 99.0)),
    );
    // Latencies as rates, so the quotient is higher-is-better (BENCH.md).
    for (q, name) in [(50.0, "p50"), (99.0, "p99")] {
        let (m, b) = (common::percentile(&lk, q), common::percentile(&lk_base, q));
        out.insert(format!("lookup64_{name}_us"), json!(m));
        out.insert(format!("lookup64_{name}_us_socket_floor"), json!(b));
        common::compare(
            &mut out,
            &format!("lookup64_{name}_per_s"),
            1e6 / m.max(1e-3),
            1e6 / b.max(1e-3),
        );
    }
    out.insert(
        "lookup64_baseline".into(),
        json!("same request/reply frames over a Unix socket pair, echo thread, no daemon"),
    );
    common::emit(&Value::Object(out), a.json)
}

/// The floor of a lookup round trip: a Unix socket pair and an echo thread
/// that reads one lookup request frame and answers one 64-tier reply frame.
struct SocketPingPong {
    stream: std::os::unix::net::UnixStream,
    request: Vec<u8>,
    reply_len: usize,
}

impl SocketPingPong {
    fn new(ns: &Namespace, chain: &[BlockKey]) -> Result<Self> {
        use kvtier_client::proto::{Request, Response, OP_LOOKUP};
        use kvtier_client::Tier;
        use std::io::{Read, Write};
        let request = Request::Lookup {
            ns: ns.id(),
            keys: chain.to_vec(),
        }
        .encode(1);
        let reply = Response::Lookup {
            tiers: vec![Tier::G3; chain.len()],
        }
        .encode(OP_LOOKUP, 1);
        let (stream, mut peer) = std::os::unix::net::UnixStream::pair()?;
        let (req_len, reply_len) = (request.len(), reply.len());
        // Ends when the bench drops its side (read fails).
        std::thread::spawn(move || {
            let mut buf = vec![0u8; req_len];
            while peer.read_exact(&mut buf).is_ok() {
                if peer.write_all(&reply).is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            stream,
            request,
            reply_len,
        })
    }

    fn round_trip_us(&self) -> Result<f64> {
        use std::io::{Read, Write};
        let mut s = &self.stream;
        let mut buf = vec![0u8; self.reply_len];
        let t = Instant::now();
        s.write_all(&self.request)?;
        s.read_exact(&mut buf)?;
        Ok(t.elapsed().as_secs_f64() * 1e6)
    }
}
