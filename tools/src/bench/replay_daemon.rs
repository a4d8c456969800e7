//! The real-daemon target of `kvtier bench replay` (`--block-size`): the
//! trace replayed through a `kvtierd` this bench starts, with real block
//! bytes, beside a dry run that decides as kvtierd does with the same
//! policy and capacity (`replay_kvtierd`: the daemon's own policy code,
//! whose `lru` lists leaves only, under G3's chain rules; the top level of
//! the report stays the plain dry run, whose `lru` is exact LRU).
//!
//! Mapping (deterministic, documented in docs/BENCHMARKS.md):
//! - trace id `i` -> `BlockKey::from_u64(i)` in a namespace of its own
//!   (`kvtier-bench-replay`, a one-layer u8 layout of `--block-size`
//!   bytes). Mooncake ids already name whole prefixes (equal ids, equal
//!   prefixes), so no chained hash is needed; the key's hex form is the id,
//!   which makes `kvtier ls` readable. The G3 index digests the key with
//!   blake3, so small consecutive ids spread like real keys do.
//! - payload of `i`: a xorshift64 stream seeded with splitmix64(`i`) (about
//!   a memory copy's speed, so generating it is not the bottleneck; its
//!   time is reported apart as `payload_gen_s`).
//!
//! `lookup` is the client's prefix lookup (G3 only: the daemon runs without
//! G4 and peers), then one onboard call for the hit blocks, whose bytes are
//! compared with the synthetic ones for each id: a mismatch is a hard error
//! (wrong KV). `store` offloads the blocks after the first miss in one call,
//! each with its predecessor as parent, so the daemon's policy sees the
//! same parents, in the same order, as the dry-run policy.
//!
//! Why hits can match the dry run exactly: kvtierd serves one connection's
//! requests in order and each onboard or offload item in order, so the
//! policy sees the same `on_access` / `on_insert` / `victim` sequence; G3
//! evicts synchronously only when the next file would pass capacity, and the
//! bench sets `high_watermark = 1.0` so the background reclaimer (which
//! would evict down to the low watermark, i.e. more than the dry run) never
//! runs; capacity is `capacity_blocks` x one block file's on-disk length
//! (header + padded payload), so "full" means the same number of blocks;
//! shared-region onboards take no lease, so no block is protected from
//! eviction. What remains different: the daemon's policy sees G3's 64-bit
//! index ids (first half of blake3(namespace, key)) instead of trace ids.
//! LRU never looks at ids, so its hits equal the dry run's exactly. The
//! default policy breaks ties of its integer score by id, so a tie can pick
//! another victim (measured: 1267 instead of 1271 hit blocks on the
//! synthetic trace of tests/e2e_replay.rs at 300 requests).
//! The report therefore also has a dry run over the trace with every id
//! replaced by its G3 index id (`hit_blocks_dry_run_g3_ids`), which the
//! daemon must equal exactly whatever the policy (tested).

use super::common::{self, RawFile};
use crate::ops::OwnedDaemon;
use anyhow::{bail, Context, Result};
use kvtier_client::block::{padded_len, HEADER_BYTES};
use kvtier_client::{
    BlockKey, Client, ClientConfig, Hints, KvLayout, Namespace, NsHandle, OffloadBlock,
    OffloadOutcome, Onboarded, Tier,
};
use kvtier_daemon::base::error::Error as DaemonError;
use kvtier_daemon::tiers::g3::G3Store;
use kvtier_daemon::tiers::policy::replay::{
    replay, replay_kvtierd, PolicyKind, ReplayTarget, TtftModel,
};
use kvtier_daemon::tiers::policy::trace::{RequestHints, Trace};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// kvtierd's smallest `g3.capacity`.
pub const G3_CAPACITY_MIN_BYTES: u64 = 1 << 20;
/// Largest shared region the bench registers (bounds one call's bytes).
const REGION_BYTES_MAX: u64 = 256 << 20;
/// Raw baseline file at most this large (its reads are O_DIRECT, so a
/// larger file would not be colder, only slower to write).
const RAW_FILE_BYTES_MAX: u64 = 1 << 30;
/// Baseline reads at most (as many as the dry run's hits, up to this).
const RAW_READS_MAX: usize = 1 << 14;

/// What the real-daemon replay needs beyond the trace.
#[derive(Debug, Clone)]
pub struct DaemonReplayConfig {
    /// Payload bytes of one block.
    pub block_bytes: u64,
    /// Blocks the daemon's G3 holds (as in the dry run).
    pub capacity_blocks: u64,
    /// The daemon's policy (`lru` or `default`).
    pub policy: PolicyKind,
    /// Directory under which the daemon's data and the raw baseline file
    /// live (must be on the disk, not tmpfs).
    pub base_dir: PathBuf,
    /// The `kvtierd` binary (default: next to this executable, else PATH).
    pub kvtierd: Option<PathBuf>,
}

/// On-disk length of one block file of `block_bytes` payload bytes.
pub fn file_bytes(block_bytes: u64) -> u64 {
    HEADER_BYTES as u64 + padded_len(block_bytes)
}

/// Refuses settings the real-daemon replay cannot honour, with what to do.
pub fn validate(policy: PolicyKind, block_bytes: u64) -> Result<()> {
    if policy == PolicyKind::Belady {
        bail!(
            "--policy belady is an offline optimum (it needs the trace's future) and \
             runs only in the dry run; a real kvtierd runs lru or default. Use --dry-run \
             for belady, or --policy lru|default with --block-size"
        );
    }
    if block_bytes == 0 || !block_bytes.is_multiple_of(32) {
        bail!("--block-size {block_bytes}: must be a positive multiple of 32 bytes (e.g. 64KiB)");
    }
    if block_bytes > kvtier_client::block::PAYLOAD_BYTES_MAX {
        bail!(
            "--block-size {block_bytes}: larger than a block may be ({} bytes)",
            kvtier_client::block::PAYLOAD_BYTES_MAX
        );
    }
    Ok(())
}

/// Refuses a capacity the daemon cannot run the replay with.
pub fn validate_capacity(trace: &Trace, capacity_blocks: u64, block_bytes: u64) -> Result<()> {
    let (longest_i, longest) = trace
        .requests
        .iter()
        .enumerate()
        .map(|(i, r)| (i, r.hash_ids.len() as u64))
        .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))
        .unwrap_or((0, 0));
    if capacity_blocks == 0 || capacity_blocks < longest {
        bail!(
            "capacity of {capacity_blocks} blocks cannot hold one request: request {longest_i} \
             has {longest} blocks, and storing it would evict its own prefix; give \
             --capacity-blocks >= {longest} (or a larger --capacity-fraction)",
            longest = longest.max(1)
        );
    }
    let bytes = capacity_blocks.saturating_mul(file_bytes(block_bytes));
    if bytes < G3_CAPACITY_MIN_BYTES {
        bail!(
            "G3 capacity {capacity_blocks} blocks x {} bytes per block file = {bytes} bytes is \
             below kvtierd's minimum g3.capacity of 1 MiB; give more blocks or a larger \
             --block-size",
            file_bytes(block_bytes)
        );
    }
    Ok(())
}

/// Key of trace id `id` (see the module docs).
pub fn key_of(id: u64) -> BlockKey {
    BlockKey::from_u64(id)
}

fn seed_of(id: u64) -> u64 {
    // splitmix64: distinct, never-zero xorshift seeds for ids 0, 1, 2, ...
    let mut z = id.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) | 1
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Fills `buf` with the synthetic payload of trace id `id`.
pub fn fill_payload(id: u64, buf: &mut [u8]) {
    let mut x = seed_of(id);
    for c in buf.chunks_mut(8) {
        let v = xorshift(&mut x).to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
}

/// Whether `buf` is exactly the synthetic payload of `id` (streamed, no
/// second buffer).
pub fn payload_matches(id: u64, buf: &[u8]) -> bool {
    let mut x = seed_of(id);
    buf.chunks(8).all(|c| {
        let v = xorshift(&mut x).to_le_bytes();
        c == &v[..c.len()]
    })
}

/// A kvtierd started by the bench: G3 only (no G4, no peers, no metrics
/// endpoint) in a temp dir on the disk, its own socket; killed on drop.
pub struct ReplayDaemon {
    daemon: OwnedDaemon,
    /// Its data directory (G3 under `g3/`), removed with the daemon.
    pub data: PathBuf,
}

impl ReplayDaemon {
    /// Starts `bin` with `policy` and `g3_capacity_bytes`, data under
    /// `base`, and waits until it serves.
    pub fn start(
        bin: &Path,
        base: &Path,
        policy: PolicyKind,
        g3_capacity_bytes: u64,
    ) -> Result<Self> {
        let data = tempfile::Builder::new()
            .prefix("kvtier-bench-replay-")
            .tempdir_in(base)
            .with_context(|| format!("temp dir in {}", base.display()))?;
        // Socket paths are limited to 108 bytes; `base` may be deep.
        let sock_dir = tempfile::Builder::new()
            .prefix("kvtier-replay-sock-")
            .tempdir()
            .context("temp dir for the socket")?;
        let socket = sock_dir.path().join("kvtierd.sock");
        let toml = format!(
            "[server]\nsocket = {sock:?}\n\n\
             [g3]\ndir = {g3:?}\ncapacity = {g3_capacity_bytes}\npolicy = {pol:?}\n\
             # Never evict in the background (it would go down to the low\n\
             # watermark, below what the dry run keeps): evict only when full.\n\
             high_watermark = 1.0\nlow_watermark = 0.99\n\
             # No open tails: they hold a batch's last block for a wall-clock\n\
             # time, which the dry run (a replay clock) cannot follow.\n\
             open_tail_grace_ms = 0\n\n\
             [g4]\nurl = \"\"\n\n[metrics]\naddr = \"\"\n",
            sock = socket.display().to_string(),
            g3 = data.path().join("g3").display().to_string(),
            pol = policy.name(),
        );
        let cfg = data.path().join("kvtierd.toml");
        std::fs::write(&cfg, toml).with_context(|| format!("writing {}", cfg.display()))?;
        let data_path = data.path().to_path_buf();
        let daemon = OwnedDaemon::spawn(
            bin,
            &["--config".into(), cfg.into()],
            socket,
            vec![data, sock_dir],
        )?;
        Ok(ReplayDaemon {
            daemon,
            data: data_path,
        })
    }
}

/// The kvtierd binary: `explicit`, else next to this executable, else PATH.
pub fn find_kvtierd(explicit: Option<&Path>) -> PathBuf {
    if let Some(p) = explicit {
        return p.to_path_buf();
    }
    std::env::current_exe()
        .ok()
        .map(|e| e.with_file_name("kvtierd"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("kvtierd"))
}

/// What the real-daemon target measured.
#[derive(Debug, Clone, Default)]
pub struct DaemonMeasures {
    /// Lookup round trip per request, µs.
    pub lookup_us: Vec<f64>,
    /// Onboard call time per request with hits, µs.
    pub onboard_us: Vec<f64>,
    /// The same divided by the request's hit blocks, µs.
    pub onboard_per_block_us: Vec<f64>,
    /// Offload call time per request that stored, µs.
    pub offload_us: Vec<f64>,
    /// The same divided by the blocks sent, µs.
    pub offload_per_block_us: Vec<f64>,
    /// Seconds inside onboard calls.
    pub onboard_s: f64,
    /// Seconds inside offload calls.
    pub offload_s: f64,
    /// Blocks onboarded and compared with their synthetic bytes.
    pub verified_blocks: u64,
    /// Blocks the lookup found that the onboard then missed.
    pub onboard_misses: u64,
    /// Offloads answered `Stored`.
    pub stored_blocks: u64,
    /// Offloads answered `AlreadyPresent`.
    pub already_present_blocks: u64,
    /// Seconds spent generating payloads.
    pub payload_gen_s: f64,
    /// Seconds spent comparing onboarded bytes.
    pub verify_s: f64,
    /// Seconds spent polling the daemon's block count.
    pub stats_s: f64,
}

/// A [`ReplayTarget`] backed by a real kvtierd (see the module docs).
pub struct DaemonTarget<'a> {
    client: &'a Client,
    h: NsHandle<'a>,
    block_bytes: usize,
    batch_blocks: usize,
    bufs: Vec<Vec<u8>>,
    payloads: Vec<Vec<u8>>,
    last_len: std::cell::Cell<u64>,
    stats_s: std::cell::Cell<f64>,
    progress: Option<indicatif::ProgressBar>,
    /// What was measured so far.
    pub m: DaemonMeasures,
}

fn target_err(reason: String) -> DaemonError {
    DaemonError::InvalidInput {
        what: "real-daemon replay",
        reason,
    }
}

impl<'a> DaemonTarget<'a> {
    /// A target over `client` in `ns`, `batch_blocks` blocks per call.
    pub fn new(client: &'a Client, ns: &Namespace, batch_blocks: usize) -> Self {
        let block_bytes = ns.layout.block_bytes() as usize;
        DaemonTarget {
            client,
            h: client.namespace(ns),
            block_bytes,
            batch_blocks: batch_blocks.max(1),
            bufs: Vec::new(),
            payloads: Vec::new(),
            last_len: std::cell::Cell::new(0),
            stats_s: std::cell::Cell::new(0.0),
            progress: None,
            m: DaemonMeasures::default(),
        }
    }

    /// Shows progress on stderr (one tick per request).
    pub fn with_progress(mut self, bar: indicatif::ProgressBar) -> Self {
        self.progress = Some(bar);
        self
    }

    fn ensure(pool: &mut Vec<Vec<u8>>, n: usize, len: usize) {
        while pool.len() < n {
            pool.push(vec![0u8; len]);
        }
    }
}

impl ReplayTarget for DaemonTarget<'_> {
    fn describe(&self) -> String {
        format!("kvtierd at {}", self.client.config().socket.display())
    }

    fn lookup(&mut self, ids: &[u64]) -> kvtier_daemon::base::error::Result<usize> {
        let keys: Vec<BlockKey> = ids.iter().map(|&i| key_of(i)).collect();
        let t = Instant::now();
        let r = self.h.lookup(&keys);
        self.m.lookup_us.push(t.elapsed().as_secs_f64() * 1e6);
        if let Some(m) = r.miss {
            return Err(target_err(format!(
                "lookup failed ({:?}): {}",
                m.cause, m.detail
            )));
        }
        if let Some(t) = r.tiers.iter().find(|t| **t != Tier::G3) {
            return Err(target_err(format!(
                "lookup reported a {t:?} block; this daemon runs G3 only"
            )));
        }
        let n = r.prefix_len();
        if n == 0 {
            return Ok(0);
        }
        let mut hits = n;
        let mut call_s = 0.0;
        for start in (0..n).step_by(self.batch_blocks) {
            let end = (start + self.batch_blocks).min(n);
            Self::ensure(&mut self.bufs, end - start, self.block_bytes);
            let mut rb: Vec<&mut [u8]> = self.bufs[..end - start]
                .iter_mut()
                .map(|b| &mut b[..])
                .collect();
            let t = Instant::now();
            let res = self.h.onboard_into(&keys[start..end], &mut rb);
            call_s += t.elapsed().as_secs_f64();
            let t = Instant::now();
            for (j, o) in res.iter().enumerate() {
                let i = start + j;
                match o {
                    Onboarded::Hit { payload_len, .. } => {
                        let got = &self.bufs[j][..(*payload_len as usize).min(self.block_bytes)];
                        if *payload_len as usize != self.block_bytes
                            || !payload_matches(ids[i], got)
                        {
                            return Err(target_err(format!(
                                "WRONG BYTES: trace block {} ({} bytes onboarded) differs \
                                 from the bytes offloaded for it",
                                ids[i], payload_len
                            )));
                        }
                        self.m.verified_blocks += 1;
                    }
                    // A miss, or an outcome this tool does not know yet.
                    _ => {
                        self.m.onboard_misses += 1;
                        hits = hits.min(i);
                    }
                }
            }
            self.m.verify_s += t.elapsed().as_secs_f64();
        }
        self.m.onboard_s += call_s;
        self.m.onboard_us.push(call_s * 1e6);
        self.m.onboard_per_block_us.push(call_s * 1e6 / n as f64);
        Ok(hits)
    }

    fn store(&mut self, ids: &[u64], from: usize) -> kvtier_daemon::base::error::Result<()> {
        self.store_with_hints(ids, from, None)
    }

    /// The trace's engine hints travel with each block's offload, as an
    /// engine's would, so the daemon's policy sees what the dry run's does.
    fn store_with_hints(
        &mut self,
        ids: &[u64],
        from: usize,
        hints: Option<RequestHints>,
    ) -> kvtier_daemon::base::error::Result<()> {
        if from >= ids.len() {
            return Ok(());
        }
        let mut call_s = 0.0;
        for start in (from..ids.len()).step_by(self.batch_blocks) {
            let end = (start + self.batch_blocks).min(ids.len());
            Self::ensure(&mut self.payloads, end - start, self.block_bytes);
            let t = Instant::now();
            for (j, &id) in ids[start..end].iter().enumerate() {
                fill_payload(id, &mut self.payloads[j]);
            }
            self.m.payload_gen_s += t.elapsed().as_secs_f64();
            let blocks: Vec<OffloadBlock<'_>> = (start..end)
                .map(|i| OffloadBlock {
                    key: key_of(ids[i]),
                    parent: i.checked_sub(1).map(|p| key_of(ids[p])),
                    payload: &self.payloads[i - start],
                    hints: hints.map_or_else(Hints::default, |h| h.for_block(i, ids.len())),
                })
                .collect();
            let t = Instant::now();
            let out = self.h.offload(&blocks);
            call_s += t.elapsed().as_secs_f64();
            for (j, o) in out.iter().enumerate() {
                match o {
                    OffloadOutcome::Stored | OffloadOutcome::StoredUnpinned => {
                        self.m.stored_blocks += 1
                    }
                    OffloadOutcome::AlreadyPresent => self.m.already_present_blocks += 1,
                    OffloadOutcome::Failed(m) => {
                        return Err(target_err(format!(
                            "offload of trace block {} failed ({:?}): {}",
                            ids[start + j],
                            m.cause,
                            m.detail
                        )))
                    }
                    other => {
                        return Err(target_err(format!(
                            "offload of trace block {}: unexpected outcome {other:?}",
                            ids[start + j]
                        )))
                    }
                }
            }
        }
        self.m.offload_s += call_s;
        self.m.offload_us.push(call_s * 1e6);
        self.m
            .offload_per_block_us
            .push(call_s * 1e6 / (ids.len() - from) as f64);
        Ok(())
    }

    fn len_blocks(&self) -> u64 {
        // Asked of the daemon (its evictions are its own business); the
        // round trip is timed apart from the replay's figures.
        let t = Instant::now();
        let n = self
            .client
            .stats()
            .ok()
            .and_then(|s| s["tiers"]["g3"]["blocks"].as_u64())
            .unwrap_or(self.last_len.get());
        self.last_len.set(n);
        self.stats_s
            .set(self.stats_s.get() + t.elapsed().as_secs_f64());
        n
    }

    fn begin_request(&mut self, index: u64) {
        if let Some(b) = &self.progress {
            b.set_position(index);
        }
    }
}

fn lat(out: &mut Map<String, Value>, name: &str, v: &[f64]) {
    out.insert(format!("{name}_p50_us"), json!(common::median(v)));
    out.insert(format!("{name}_p99_us"), json!(common::percentile(v, 99.0)));
}

/// Replays `trace` through a fresh kvtierd and returns the `daemon` part of
/// the report: hits beside the dry run that decides as kvtierd does
/// (`replay_kvtierd`, same policy and capacity: the baseline), throughput, latencies, and onboard/offload GB/s
/// beside raw O_DIRECT I/O of the same block size in the same directory.
pub fn run(trace: &Trace, cfg: &DaemonReplayConfig, model: &TtftModel) -> Result<Value> {
    validate(cfg.policy, cfg.block_bytes)?;
    validate_capacity(trace, cfg.capacity_blocks, cfg.block_bytes)?;
    let dry = &replay_kvtierd(trace, cfg.policy, cfg.capacity_blocks)?;
    if is_tmpfs(&cfg.base_dir) {
        bail!(
            "{} is on tmpfs: the real-daemon replay measures the disk; give --dir on the disk",
            cfg.base_dir.display()
        );
    }
    let bs = cfg.block_bytes as usize;
    let file_len = file_bytes(cfg.block_bytes);
    let g3_capacity = cfg.capacity_blocks * file_len;
    let bin = find_kvtierd(cfg.kvtierd.as_deref());
    let daemon = ReplayDaemon::start(&bin, &cfg.base_dir, cfg.policy, g3_capacity)?;

    // One request's blocks per call, up to what the region holds.
    let longest = trace
        .requests
        .iter()
        .map(|r| r.hash_ids.len())
        .max()
        .unwrap_or(1)
        .max(1);
    let slot = file_len;
    let batch_blocks = longest
        .min((REGION_BYTES_MAX / slot).max(1) as usize)
        .min(kvtier_client::proto::KEYS_MAX);
    let mut cc = ClientConfig::new(&daemon.daemon.socket);
    cc.region_bytes = slot * batch_blocks as u64;
    cc.timeout_ms = 120_000;
    let client = Client::with_config(cc);
    client
        .ensure_connected()
        .with_context(|| format!("connecting to {}", daemon.daemon.socket.display()))?;
    let layout = KvLayout::with_block_bytes(cfg.block_bytes)?;
    let ns = Namespace::new("kvtier-bench-replay", layout, "", "")?;

    // The raw baseline: a file in the same directory, half its reads before
    // the replay and half after (the disk drifts; this brackets the run).
    let raw_blocks =
        cfg.capacity_blocks
            .min((RAW_FILE_BYTES_MAX / padded_len(cfg.block_bytes)).max(1)) as usize;
    let raw = RawFile::create(daemon.data.as_path(), bs, raw_blocks)?;
    let raw_path = daemon.data.as_path().join("raw-baseline.bin");
    // Writes: all of this file now (reads need it), a second file after.
    let mut raw_write_us = durable_writes(&raw_path, bs, raw_blocks)?;
    let raw_reads = (dry.hit_blocks as usize)
        .min(RAW_READS_MAX)
        .max(raw_blocks.min(64));
    let order: Vec<usize> = common::shuffled(raw_blocks, 11)
        .into_iter()
        .cycle()
        .take(raw_reads)
        .collect();
    let (first, second) = order.split_at(raw_reads / 2);
    let t = Instant::now();
    raw.read_order(1, first)?;
    let mut raw_read_s = t.elapsed().as_secs_f64();

    let bar = if trace.requests.len() >= 200 {
        indicatif::ProgressBar::new(trace.requests.len() as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut target = DaemonTarget::new(&client, &ns, batch_blocks).with_progress(bar.clone());
    let t = Instant::now();
    let stats = replay(trace, &mut target)?;
    let stats_s = target.stats_s.get();
    let wall_s = t.elapsed().as_secs_f64() - stats_s;
    bar.finish_and_clear();
    target.m.stats_s = stats_s;
    let m = target.m.clone();

    let second_file = daemon.data.as_path().join("raw-baseline-2.bin");
    raw_write_us.extend(durable_writes(&second_file, bs, raw_blocks)?);
    let _ = std::fs::remove_file(&second_file);
    let t = Instant::now();
    raw.read_order(1, second)?;
    raw_read_s += t.elapsed().as_secs_f64();
    let raw_write_gbps = common::gbps(
        padded_len(cfg.block_bytes) as usize * raw_write_us.len(),
        raw_write_us.iter().sum::<f64>() / 1e6,
    );
    let raw_read_gbps = common::gbps(padded_len(cfg.block_bytes) as usize * raw_reads, raw_read_s);
    let daemon_stats = client.stats().unwrap_or(Value::Null);
    // The dry run over the ids the daemon's policy sees (see module docs).
    let nsid = ns.id();
    let mut as_g3 = trace.clone();
    for r in &mut as_g3.requests {
        let keys: Vec<BlockKey> = r.hash_ids.iter().map(|&i| key_of(i)).collect();
        r.hash_ids = G3Store::chain_digests(&nsid, &keys)
            .into_iter()
            .map(|(id, _)| id)
            .collect();
    }
    let dry_g3 = replay_kvtierd(&as_g3, cfg.policy, cfg.capacity_blocks)?;

    let mut out = Map::new();
    out.insert("target".into(), json!("kvtierd"));
    out.insert("backend".into(), daemon_stats["backend"].clone());
    out.insert("policy".into(), json!(cfg.policy.name()));
    out.insert("block_bytes".into(), json!(cfg.block_bytes));
    out.insert("block_file_bytes".into(), json!(file_len));
    out.insert("g3_capacity_bytes".into(), json!(g3_capacity));
    out.insert("capacity_blocks".into(), json!(cfg.capacity_blocks));
    out.insert(
        "data_dir".into(),
        json!(daemon.data.as_path().display().to_string()),
    );
    out.insert("requested_blocks".into(), json!(stats.requested_blocks));
    out.insert("hit_blocks".into(), json!(stats.hit_blocks));
    out.insert("hit_blocks_dry_run".into(), json!(dry.hit_blocks));
    out.insert(
        "hit_blocks_diff".into(),
        json!(stats.hit_blocks as i64 - dry.hit_blocks as i64),
    );
    let differing = stats
        .hits_per_request
        .iter()
        .zip(&dry.hits_per_request)
        .filter(|(a, b)| a != b)
        .count();
    out.insert("requests_with_other_hits".into(), json!(differing));
    out.insert("hit_blocks_dry_run_g3_ids".into(), json!(dry_g3.hit_blocks));
    out.insert(
        "requests_with_other_hits_g3_ids".into(),
        json!(stats
            .hits_per_request
            .iter()
            .zip(&dry_g3.hits_per_request)
            .filter(|(a, b)| a != b)
            .count()),
    );
    // The dry run of the same policy and capacity is the hit-ratio baseline.
    common::compare(&mut out, "hit_ratio", stats.hit_ratio(), dry.hit_ratio());
    out.insert(
        "hit_ratio_diff".into(),
        json!(stats.hit_ratio() - dry.hit_ratio()),
    );
    out.insert("capacity_used_blocks".into(), json!(stats.peak_blocks));
    out.insert(
        "capacity_used_blocks_dry_run".into(),
        json!(dry.peak_blocks),
    );
    out.insert("evictions".into(), daemon_stats["evictions"].clone());
    out.insert("verified_blocks".into(), json!(m.verified_blocks));
    out.insert("onboard_misses".into(), json!(m.onboard_misses));
    out.insert("stored_blocks".into(), json!(m.stored_blocks));
    out.insert(
        "already_present_blocks".into(),
        json!(m.already_present_blocks),
    );
    let n = trace.requests.len() as f64;
    out.insert("replay_s".into(), json!(wall_s));
    out.insert("requests_per_s".into(), json!(n / wall_s.max(1e-9)));
    out.insert(
        "blocks_per_s".into(),
        json!(stats.requested_blocks as f64 / wall_s.max(1e-9)),
    );
    out.insert("payload_gen_s".into(), json!(m.payload_gen_s));
    out.insert("verify_s".into(), json!(m.verify_s));
    out.insert("stats_poll_s".into(), json!(m.stats_s));
    out.insert("onboard_s".into(), json!(m.onboard_s));
    out.insert("offload_s".into(), json!(m.offload_s));
    let onboard_gbps = common::gbps(bs * m.verified_blocks as usize, m.onboard_s);
    let offload_gbps = common::gbps(
        bs * (m.stored_blocks + m.already_present_blocks) as usize,
        m.offload_s,
    );
    common::compare(&mut out, "onboard_gbps", onboard_gbps, raw_read_gbps);
    common::compare(&mut out, "offload_gbps", offload_gbps, raw_write_gbps);
    out.insert(
        "baseline".into(),
        json!({
            "what": "raw I/O of the same block size at depth 1 (the daemon serves one \
                     connection's items in order) on one file in the daemon's data directory: \
                     O_DIRECT preads for onboard; for offload, O_DIRECT|O_DSYNC pwrites, one \
                     durable write per block as an offload is durable per block (without the \
                     file create, rename, directory fsync and index commit G3 adds); writes of \
                     one file before the replay and of a second after, half the reads before \
                     and half after",
            "file_blocks": raw_blocks,
            "reads": raw_reads,
            "writes": raw_write_us.len(),
            "write_per_block_p50_us": common::median(&raw_write_us),
            "write_per_block_p99_us": common::percentile(&raw_write_us, 99.0),
            // G3 reads O_DIRECT into the page-aligned shared region, the
            // baseline preads O_DIRECT: the page cache serves neither, so no
            // drop (and no system-wide sync) is needed.
            "o_direct": true,
        }),
    );
    lat(&mut out, "lookup", &m.lookup_us);
    lat(&mut out, "onboard_request", &m.onboard_us);
    lat(&mut out, "onboard_per_block", &m.onboard_per_block_us);
    lat(&mut out, "offload_request", &m.offload_us);
    lat(&mut out, "offload_per_block", &m.offload_per_block_us);
    // TTFT with the daemon's hits and its measured load bandwidth.
    let measured = TtftModel {
        load_bytes_per_s: onboard_gbps * 1e9,
        ..*model
    };
    let tt = measured.summarise(trace, &stats);
    out.insert("ttft_mean_ms_measured_load".into(), json!(tt.mean_ms));
    out.insert("ttft_p90_ms_measured_load".into(), json!(tt.p90_ms));
    drop(client);
    drop(daemon);
    Ok(Value::Object(out))
}

/// Writes blocks `0..n` of `path` (created if absent) one at a time with
/// O_DIRECT|O_DSYNC: each durable when its pwrite returns. Per-block µs.
fn durable_writes(path: &Path, block_bytes: usize, n: usize) -> Result<Vec<f64>> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_DIRECT | libc::O_DSYNC)
        .open(path)
        .with_context(|| format!("opening {} with O_DIRECT|O_DSYNC", path.display()))?;
    let len = padded_len(block_bytes as u64) as usize;
    let mut buf = common::AlignedBuf::rounded(len)?;
    fill_payload(u64::MAX, buf.as_mut_slice());
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        f.write_all_at(buf.as_slice(), (i * len) as u64)
            .with_context(|| format!("writing {}", path.display()))?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(lat)
}

fn is_tmpfs(p: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs writes into the zeroed struct; the path is NUL-terminated.
    unsafe {
        let mut s: libc::statfs = std::mem::zeroed();
        libc::statfs(c.as_ptr(), &mut s) == 0 && s.f_type == libc::TMPFS_MAGIC
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn payloads_are_deterministic_and_distinct() {
        let mut a = vec![0u8; 4100];
        let mut b = vec![0u8; 4100];
        fill_payload(7, &mut a);
        fill_payload(7, &mut b);
        assert_eq!(a, b);
        assert!(payload_matches(7, &a));
        fill_payload(8, &mut b);
        assert_ne!(a, b);
        assert!(!payload_matches(8, &a));
        a[4099] ^= 1;
        assert!(!payload_matches(7, &a));
        assert_eq!(key_of(5), key_of(5));
        assert_ne!(key_of(5), key_of(6));
    }

    #[test]
    fn file_bytes_is_header_plus_padded_payload() {
        assert_eq!(file_bytes(64 << 10), 4096 + (64 << 10));
        assert_eq!(file_bytes(4000), 8192);
    }
}
