//! `kvtier bench crossnode`: cross-node onboard through real daemons.
//!
//! Starts a real S3-compatible server (SeaweedFS, as the tests do) and three
//! `kvtierd` on loopback with separate data dirs and ports, all on the same
//! G4 bucket: A and B are peers, C has peers off. A offloads N blocks and
//! the bench waits until A has uploaded them. Then, round by round
//! (interleaved): a raw TCP loopback transfer of A's block files (the
//! baseline, `peer::bench::raw_tcp_transfer`), B onboarding every block
//! (peer fetch from A) and C onboarding every block (G4 only), first in
//! requests of `--request-blocks` blocks (as a worker onboards a prefix),
//! then one block per request (the per-block latency). Every path moves the
//! same N block files, and GB/s counts the same bytes (whole block files,
//! header included) for all of them. B and C evict their copies before each
//! phase so each phase fetches again, and the bench waits (untimed) until
//! the previous phase's background promotions into G3 are done, so phases
//! do not overlap. The page cache is dropped before each phase when running
//! as root.
//!
//! Latency breakdown per block (one block per request; G4-only on C, peer
//! on B): fetch + verify and the background G3 promote come from the
//! node's `kvtier_promote_seconds_total`; client read (the rest of
//! the client-observed latency: request, copy of the verified bytes into
//! shared memory, reply) is what remains. The promote is not on the
//! onboard's path any more (it runs after the answer).
//!
//! `--warm` keeps the page cache warm (A's files read before each phase)
//! instead of dropping it, so both paths move bytes from memory: the
//! transfer stack alone. `transfer_breakdown_us` times each stage of a peer
//! fetch alone against A's real peer server (`peer::bench::breakdown`):
//! file read, checksum, memcpy, TCP connect, one signed round trip, the raw
//! transfer, verified fetches one at a time and 4 in flight, and the
//! connections the pooled client opened.

use super::common;
use anyhow::{bail, Context, Result};
use clap::Args;
use kvtier_client::{
    BlockKey, Client, ClientConfig, Hints, KvLayout, Namespace, OffloadOutcome, Onboarded, Tier,
};
use kvtier_daemon::testkit::s3::{S3Server, ACCESS_KEY_ID};
use serde_json::{json, Map, Value};
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Arguments of `kvtier bench crossnode`.
#[derive(Debug, Args)]
pub struct CrossnodeArgs {
    /// Blocks offloaded on node A.
    #[arg(long, default_value_t = 64)]
    pub blocks: usize,
    /// Block size.
    #[arg(long, default_value = "2MiB", value_parser = common::parse_size)]
    pub block_size: u64,
    /// Interleaved rounds (medians reported).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Blocks per onboard request in the batched phases.
    #[arg(long, default_value_t = 8)]
    pub request_blocks: usize,
    /// Keep the page cache warm instead of dropping it before each phase
    /// (A's block files are read before every phase): both the baseline and
    /// the peer path then move bytes from memory, which measures the
    /// transfer itself rather than A's disk.
    #[arg(long)]
    pub warm: bool,
    /// One JSON document on stdout.
    #[arg(long)]
    pub json: bool,
}

pub(super) struct Node {
    child: Child,
    dir: tempfile::TempDir,
    socket: PathBuf,
    metrics: String,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(super) fn free_port() -> Result<u16> {
    Ok(kvtier_daemon::testkit::port::free_port()?)
}

pub(super) fn start_node(config: &str, name: &str) -> Result<Node> {
    let dir = tempfile::Builder::new()
        .prefix(&format!("kvtier-xn-{name}-"))
        .tempdir()?;
    let socket = dir.path().join("kvtierd.sock");
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let conf = dir.path().join("kvtierd.toml");
    std::fs::write(&conf, config)?;
    // It holds the G4 secret: owner only, or kvtierd refuses it.
    std::fs::set_permissions(&conf, std::fs::Permissions::from_mode(0o600))?;
    let exe = std::env::current_exe()?;
    let local = exe.with_file_name("kvtierd");
    let bin = if local.exists() {
        local
    } else {
        PathBuf::from("kvtierd")
    };
    let child = Command::new(&bin)
        .arg("--config")
        .arg(&conf)
        .arg("--socket")
        .arg(&socket)
        .arg("--g3-dir")
        .arg(dir.path().join("g3"))
        .args(["--g3-capacity", "16GiB", "--metrics-addr", &metrics])
        .env("RUST_LOG", "warn")
        // A file per block: the raw baseline sends A's block files (a
        // slotted block has none; peers serve it from a verified copy).
        .env("KVTIERD_G3_SLOT_MAX", "0")
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let n = Node {
        child,
        dir,
        socket,
        metrics,
    };
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(&n.socket).is_err() {
        if t.elapsed() > Duration::from_secs(30) {
            bail!("kvtierd {name} did not start within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(n)
}

/// Sum of a metric's samples whose label set includes every
/// comma-separated part of `label`.
fn scrape(n: &Node, name: &str, label: &str) -> Result<f64> {
    let mut s = std::net::TcpStream::connect(&n.metrics)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )?;
    let mut body = String::new();
    s.read_to_string(&mut body)?;
    let mut sum = 0.0;
    for line in body.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, v)) = line.rsplit_once(' ') else {
            continue;
        };
        let metric = series.split('{').next().unwrap_or("");
        if metric == name && label.split(',').all(|l| series.contains(l)) {
            sum += v.parse::<f64>().unwrap_or(0.0);
        }
    }
    Ok(sum)
}

pub(super) fn client(n: &Node, block_bytes: u64, request_blocks: usize) -> Client {
    let mut c = ClientConfig::new(&n.socket);
    c.region_bytes = (block_bytes + 8192) * request_blocks.max(4) as u64;
    c.timeout_ms = 60_000;
    Client::with_config(c)
}

/// Onboards every key, `per_request` keys per request, checking bytes and
/// tiers; returns (seconds onboarding, seconds per request). Only the
/// requests are timed, not the bench's own byte comparison (the raw
/// baseline checks nothing either; the client still verifies the checksum).
fn onboard_all(
    n: &Node,
    ns: &Namespace,
    keys: &[BlockKey],
    data: &[Vec<u8>],
    want: Tier,
    per_request: usize,
) -> Result<(f64, Vec<f64>)> {
    let c = client(n, data[0].len() as u64, per_request);
    let h = c.namespace(ns);
    let mut bufs: Vec<Vec<u8>> = (0..per_request).map(|_| vec![0u8; data[0].len()]).collect();
    let mut lat = Vec::with_capacity(keys.len().div_ceil(per_request));
    for (ks, ds) in keys.chunks(per_request).zip(data.chunks(per_request)) {
        let mut rb: Vec<&mut [u8]> = bufs.iter_mut().take(ks.len()).map(|b| &mut b[..]).collect();
        let t = Instant::now();
        let r = h.onboard_into(ks, &mut rb);
        lat.push(t.elapsed().as_secs_f64());
        for (i, d) in ds.iter().enumerate() {
            match r.get(i) {
                Some(Onboarded::Hit { tier, .. }) if *tier == want => {}
                other => bail!(
                    "onboard via {want:?} of block {} ({per_request} per request) got {other:?}",
                    i
                ),
            }
            if bufs[i] != *d {
                bail!("onboarded bytes differ");
            }
        }
    }
    Ok((lat.iter().sum(), lat))
}

/// Promotions finished (promoted or skipped) on `n` from `source`.
fn promotions_settled(n: &Node, source: &str) -> Result<f64> {
    let label = format!("source=\"{source}\"");
    Ok(scrape(n, "kvtier_promotions_total", &label)?
        + scrape(n, "kvtier_promotions_skipped_total", &label)?)
}

/// Waits (untimed by the bench) until `n` has settled `want` promotions
/// from `source`; returns the seconds waited.
fn settle(n: &Node, source: &str, want: f64) -> Result<f64> {
    let t = Instant::now();
    while promotions_settled(n, source)? < want {
        if t.elapsed() > Duration::from_secs(120) {
            bail!("promotions from {source} did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Fetch and store microseconds so far on `n` from `source`.
fn promote_us(n: &Node, source: &str) -> Result<(f64, f64)> {
    let label = |stage: &str| format!("source=\"{source}\",stage=\"{stage}\"");
    Ok((
        scrape(n, "kvtier_promote_seconds_total", &label("fetch"))? * 1e6,
        scrape(n, "kvtier_promote_seconds_total", &label("store"))? * 1e6,
    ))
}

pub(super) fn config(s3: &S3Server, peer: Option<(&str, u16, &str, &Path)>) -> String {
    let mut t = format!(
        "[g4]\nurl = \"s3://{}/bench\"\nendpoint = \"{}\"\nregion = \"us-east-1\"\nallow_http = true\npath_style = true\naccess_key_id = \"{ACCESS_KEY_ID}\"\nsecret_access_key = \"{}\"\n",
        s3.bucket,
        s3.endpoint(),
        s3.secret_access_key
    );
    if let Some((id, port, peer, secret)) = peer {
        t.push_str(&format!(
            "[peer]\nenabled = true\nnode_id = \"{id}\"\nbind = \"127.0.0.1:{port}\"\nsecret_file = \"{}\"\npeers = [{peer}]\ndiscovery = false\n",
            secret.display()
        ));
    }
    t
}

/// Runs the benchmark.
pub fn run(a: CrossnodeArgs) -> Result<()> {
    if a.blocks == 0 || a.rounds == 0 || a.request_blocks == 0 {
        bail!("--blocks, --rounds and --request-blocks must be positive");
    }
    if a.request_blocks > 64 {
        bail!("--request-blocks is at most 64 (the client's keys per request)");
    }
    let bs = a.block_size as usize;
    let Some(s3) = S3Server::start("kvtier-bench").context("starting SeaweedFS")? else {
        bail!("needs SeaweedFS: run scripts/setup.sh (or set KVTIER_WEED to a weed binary)");
    };
    let secret_dir = tempfile::tempdir()?;
    let secret = secret_dir.path().join("peer.secret");
    std::fs::write(&secret, "bench-secret-0123456789abcdef0123\n")?;
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600))?;
    let (pa, pb) = (free_port()?, free_port()?);
    let na = start_node(
        &config(
            &s3,
            Some((
                "node-a",
                pa,
                &format!("{{ id = \"node-b\", address = \"127.0.0.1:{pb}\" }}"),
                &secret,
            )),
        ),
        "a",
    )?;
    let nb = start_node(
        &config(
            &s3,
            Some((
                "node-b",
                pb,
                &format!("{{ id = \"node-a\", address = \"127.0.0.1:{pa}\" }}"),
                &secret,
            )),
        ),
        "b",
    )?;
    let nc = start_node(&config(&s3, None), "c")?;

    let ns = Namespace::new(
        "bench/crossnode",
        KvLayout::with_block_bytes(a.block_size)?,
        "",
        "bench",
    )?;
    let data: Vec<Vec<u8>> = (0..a.blocks)
        .map(|i| common::noise(i as u64 + 1, bs))
        .collect();
    let tokens: Vec<u32> = (0..a.blocks as u32 * 16).collect();
    let ca = client(&na, a.block_size, 4);
    let ha = ca.namespace(&ns);
    let keys = ha.hash_chain(&tokens);
    for (k, d) in keys.iter().zip(&data) {
        let o = ha.offload_chain(None, std::slice::from_ref(k), &[&d[..]], Hints::default());
        if o.first() != Some(&OffloadOutcome::Stored) {
            bail!("offload on A: {o:?}");
        }
    }
    let t = Instant::now();
    while scrape(&na, "kvtier_g4_uploads_total", "outcome=\"stored\"")? < a.blocks as f64 {
        if t.elapsed() > Duration::from_secs(120) {
            bail!("A did not upload its blocks to G4 within 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let upload_s = t.elapsed().as_secs_f64();
    let files: Vec<PathBuf> = keys
        .iter()
        .map(|k| {
            na.dir
                .path()
                .join("g3/blocks")
                .join(kvtier_client::block_path(&ns.id(), k))
        })
        .collect();
    // The same bytes for every path: the raw baseline sends whole block
    // files (header included), so GB/s counts them for the onboards too.
    let total = files
        .iter()
        .map(|f| std::fs::metadata(f).map(|m| m.len()))
        .sum::<std::io::Result<u64>>()? as f64;
    // Before each phase: cold (page cache dropped, A reads its disk) or
    // warm (A's files read into the page cache, B's and C's copies evicted
    // by the bench anyway).
    let prep = || -> Result<bool> {
        if a.warm {
            for f in &files {
                std::hint::black_box(std::fs::read(f)?);
            }
            Ok(false)
        } else {
            Ok(common::drop_page_cache())
        }
    };
    let cold = prep()?;
    let (mut raw, mut peer, mut g4) = (Vec::new(), Vec::new(), Vec::new());
    let (mut peer1, mut g41) = (Vec::new(), Vec::new());
    let (mut peer_req_lat, mut g4_req_lat) = (Vec::new(), Vec::new());
    let (mut peer_lat, mut g4_lat) = (Vec::new(), Vec::new());
    // Per-block figures of the one-block phases (counter deltas).
    let (mut peer_fetch_us, mut peer_store_us, mut g4_fetch_us, mut g4_store_us) =
        (0.0, 0.0, 0.0, 0.0);
    let (mut settled_b, mut settled_c, mut drain_s) = (0.0, 0.0, Vec::new());
    let n = a.blocks as f64;
    // Each phase must fetch again: nothing of the previous one may stay.
    let evict = |node: &Node| -> Result<()> {
        let h = client(node, a.block_size, 4);
        let h = h.namespace(&ns);
        let st = h.evict(&keys)?;
        // Copies on this node's G3 (stat also finds the shared G4's).
        let left = h
            .stat(&keys)?
            .iter()
            .filter(|s| s.as_ref().is_some_and(|s| s.tier == Tier::G3))
            .count();
        if left > 0 {
            bail!("{left} blocks still on the node after evict: {st:?}");
        }
        Ok(())
    };
    for _ in 0..a.rounds {
        prep()?;
        let r = kvtier_daemon::tiers::peer::bench::raw_tcp_transfer(&files, 1 << 20)?;
        raw.push(r.bytes as f64 / r.seconds / 1e9);

        evict(&nb)?;
        prep()?;
        let (s, l) = onboard_all(&nb, &ns, &keys, &data, Tier::Peer, a.request_blocks)?;
        peer.push(total / s / 1e9);
        peer_req_lat.extend(l);
        settled_b += n;
        drain_s.push(settle(&nb, "peer", settled_b)?);

        evict(&nc)?;
        prep()?;
        let (s, l) = onboard_all(&nc, &ns, &keys, &data, Tier::G4, a.request_blocks)?;
        g4.push(total / s / 1e9);
        g4_req_lat.extend(l);
        settled_c += n;
        settle(&nc, "g4", settled_c)?;

        evict(&nb)?;
        prep()?;
        let (f0, s0) = promote_us(&nb, "peer")?;
        let (s, l) = onboard_all(&nb, &ns, &keys, &data, Tier::Peer, 1)?;
        peer1.push(total / s / 1e9);
        peer_lat.extend(l);
        settled_b += n;
        settle(&nb, "peer", settled_b)?;
        let (f1, s1) = promote_us(&nb, "peer")?;
        peer_fetch_us += f1 - f0;
        peer_store_us += s1 - s0;

        evict(&nc)?;
        prep()?;
        let (f0, s0) = promote_us(&nc, "g4")?;
        let (s, l) = onboard_all(&nc, &ns, &keys, &data, Tier::G4, 1)?;
        g41.push(total / s / 1e9);
        g4_lat.extend(l);
        settled_c += n;
        settle(&nc, "g4", settled_c)?;
        let (f1, s1) = promote_us(&nc, "g4")?;
        g4_fetch_us += f1 - f0;
        g4_store_us += s1 - s0;
    }
    // Stage by stage, against A's peer server directly (same secret), warm.
    let breakdown = {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let pc = kvtier_daemon::tiers::peer::PeerClient::new(
            kvtier_daemon::tiers::peer::PeerClientConfig::new(
                std::fs::read_to_string(&secret)?.trim().as_bytes().to_vec(),
            ),
        )?;
        for f in &files {
            std::hint::black_box(std::fs::read(f)?);
        }
        let ids: Vec<_> = keys.iter().map(|k| (ns.id(), *k)).collect();
        rt.block_on(kvtier_daemon::tiers::peer::bench::breakdown(
            &pc,
            &format!("127.0.0.1:{pa}"),
            &ids,
            &files,
            4,
        ))?
    };
    let per_block = (a.blocks * a.rounds) as f64;
    let (fetch_ms, store_ms) = (g4_fetch_us / per_block / 1e3, g4_store_us / per_block / 1e3);
    let g4_mean_ms = g4_lat.iter().sum::<f64>() / g4_lat.len().max(1) as f64 * 1e3;
    let (peer_fetch_ms, peer_store_ms) = (
        peer_fetch_us / per_block / 1e3,
        peer_store_us / per_block / 1e3,
    );
    let peer_mean_ms = peer_lat.iter().sum::<f64>() / peer_lat.len().max(1) as f64 * 1e3;
    let skipped = |node: &Node, source: &str| {
        scrape(
            node,
            "kvtier_promotions_skipped_total",
            &format!("source=\"{source}\""),
        )
    };
    let ms = |v: &[f64], p: f64| common::percentile(v, p) * 1e3;

    let mut out = Map::new();
    out.insert("bench".into(), json!("crossnode"));
    out.insert("blocks".into(), json!(a.blocks));
    out.insert("block_bytes".into(), json!(bs));
    out.insert("bytes_per_path".into(), json!(total));
    out.insert("request_blocks".into(), json!(a.request_blocks));
    out.insert("rounds".into(), json!(a.rounds));
    out.insert("cold".into(), json!(cold));
    out.insert("warm".into(), json!(a.warm));
    out.insert(
        "transfer_breakdown_us".into(),
        serde_json::to_value(breakdown)?,
    );
    out.insert(
        "g4_server".into(),
        json!("seaweedfs (weed mini) on 127.0.0.1"),
    );
    out.insert("upload_wait_s".into(), json!(upload_s));
    out.insert("raw_tcp_gbps".into(), json!(common::median(&raw)));
    out.insert("raw_tcp_gbps_rounds".into(), json!(raw));
    let raw_m = common::median(&raw);
    common::compare(&mut out, "peer_gbps", common::median(&peer), raw_m);
    common::compare(&mut out, "g4_gbps", common::median(&g4), raw_m);
    common::compare(
        &mut out,
        "peer_per_block_gbps",
        common::median(&peer1),
        raw_m,
    );
    common::compare(&mut out, "g4_per_block_gbps", common::median(&g41), raw_m);
    out.insert("peer_gbps_rounds".into(), json!(peer));
    out.insert("g4_gbps_rounds".into(), json!(g4));
    out.insert("peer_per_block_gbps_rounds".into(), json!(peer1));
    out.insert("g4_per_block_gbps_rounds".into(), json!(g41));
    out.insert("peer_request_ms_p50".into(), json!(ms(&peer_req_lat, 50.0)));
    out.insert("g4_request_ms_p50".into(), json!(ms(&g4_req_lat, 50.0)));
    out.insert("peer_latency_ms_p50".into(), json!(ms(&peer_lat, 50.0)));
    out.insert("peer_latency_ms_p99".into(), json!(ms(&peer_lat, 99.0)));
    out.insert("g4_latency_ms_p50".into(), json!(ms(&g4_lat, 50.0)));
    out.insert("g4_latency_ms_p99".into(), json!(ms(&g4_lat, 99.0)));
    out.insert(
        "peer_promote_drain_ms_p50".into(),
        json!(common::median(&drain_s) * 1e3),
    );
    out.insert(
        "promotions_skipped".into(),
        json!({ "peer": skipped(&nb, "peer")?, "g4": skipped(&nc, "g4")? }),
    );
    out.insert(
        "g4_breakdown_ms".into(),
        json!({
            "g4_get_verify": fetch_ms,
            "g3_promote": store_ms,
            "g3_promote_on_path": false,
            "client_read": (g4_mean_ms - fetch_ms).max(0.0),
            "total_mean": g4_mean_ms,
        }),
    );
    out.insert(
        "peer_breakdown_ms".into(),
        json!({
            "peer_fetch_verify": peer_fetch_ms,
            "g3_promote": peer_store_ms,
            "g3_promote_on_path": false,
            "client_read": (peer_mean_ms - peer_fetch_ms).max(0.0),
            "total_mean": peer_mean_ms,
        }),
    );
    drop((na, nb, nc));
    drop(s3);
    common::emit(&Value::Object(out), a.json)
}
