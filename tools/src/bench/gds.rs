//! `kvtier bench gds`: onboard N block files from G3 into host, pinned or
//! device memory through kvtier-gds, beside (a) raw O_DIRECT reads of the
//! same files into host memory, interleaved in the same invocation, and
//! (b) on a GPU, pinned host-to-device copy bandwidth (PCIe).
//!
//! Without a GPU, `--dest pinned|device` runs the same pipeline with host
//! memory standing in (`dest_emulated: true` in the report).

use super::common::{self, AlignedBuf};
use anyhow::{Context, Result};
use clap::Args;
use kvtier_client::block::{padded_len, HEADER_BYTES};
use kvtier_client::{encode_block, BlockHeader, BlockKey, KvLayout, Namespace};
use kvtier_gds::{BlockBuf, Capabilities, MemoryKind, OnboardJob, Transfer, TransferConfig};
use serde_json::{json, Map, Value};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Arguments of `kvtier bench gds`.
#[derive(Debug, Clone, Args)]
pub struct GdsArgs {
    /// Block size (payload bytes, a multiple of 32).
    #[arg(long, default_value = "2MiB", value_parser = common::parse_size)]
    pub block_size: u64,
    /// Number of block files.
    #[arg(long, default_value_t = 64)]
    pub blocks: usize,
    /// Destination memory: host, pinned or device.
    #[arg(long, default_value = "host", value_parser = parse_dest)]
    pub dest: MemoryKind,
    /// Directory on the filesystem to measure (a temp dir is made inside).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Rounds of (onboard, raw) pairs, alternating which goes first.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Bounce buffer size.
    #[arg(long, default_value = "1MiB", value_parser = common::parse_size)]
    pub chunk: u64,
    /// Bounce buffers (reads in flight).
    #[arg(long, default_value_t = 4)]
    pub buffers: usize,
    /// Parallel pipelines (threads) a batch is split across; the baseline
    /// gets the same total depth (buffers x lanes).
    #[arg(long, default_value_t = 1)]
    pub lanes: usize,
    /// Blocks per `onboard_batch` call (an engine onboarding a prefix).
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Do not use GPUDirect Storage even when present (forces TwoHop).
    #[arg(long)]
    pub no_gds: bool,
    /// Measurement only: skip hashing the bytes a GDS read put in HBM, to
    /// see what the verification costs. Never how production runs.
    #[arg(long)]
    pub skip_direct_verify: bool,
    /// One JSON document on stdout.
    #[arg(long)]
    pub json: bool,
}

fn parse_dest(s: &str) -> Result<MemoryKind, String> {
    MemoryKind::parse(s).ok_or_else(|| format!("unknown destination {s:?} (host, pinned, device)"))
}

/// Largest run accepted (bytes written to disk).
const TOTAL_BYTES_MAX: u64 = 64 << 30;

/// Runs the benchmark and prints the report.
pub fn run(args: GdsArgs) -> Result<()> {
    let report = measure(&args)?;
    common::emit(&report, args.json)
}

struct Blocks {
    paths: Vec<PathBuf>,
    headers: Vec<BlockHeader>,
    layout: KvLayout,
}

fn write_blocks(dir: &Path, block_bytes: u64, n: usize) -> Result<Blocks> {
    let layout = KvLayout::with_block_bytes(block_bytes)
        .map_err(|e| anyhow::anyhow!("--block-size: {e}"))?;
    let ns = Namespace::new("bench/gds", layout, "", b"bench".to_vec())?;
    let mut payload = vec![0u8; block_bytes as usize];
    let mut paths = Vec::with_capacity(n);
    let mut headers = Vec::with_capacity(n);
    for i in 0..n {
        // Distinct, incompressible-looking payloads (cheap LCG).
        let mut x = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for c in payload.chunks_mut(8) {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let b = x.to_le_bytes();
            c.copy_from_slice(&b[..c.len()]);
        }
        let key = BlockKey::from_digest(*blake3::hash(&(i as u64).to_le_bytes()).as_bytes());
        let h = BlockHeader::for_payload(&ns, key, &payload, 0);
        let path = dir.join(format!("block-{i:06}"));
        let mut f = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        f.write_all(&encode_block(&h, &payload))?;
        f.sync_all()?;
        paths.push(path);
        headers.push(h);
    }
    Ok(Blocks {
        paths,
        headers,
        layout,
    })
}

fn open_direct(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .with_context(|| format!("opening {} with O_DIRECT", path.display()))
}

/// Onboards every block, `dsts.len()` blocks per batch; GB/s of payload,
/// fallbacks, and the route.
fn onboard_all(
    t: &mut Transfer,
    b: &Blocks,
    dsts: &mut [BlockBuf],
) -> Result<(f64, usize, &'static str)> {
    let mut fallbacks = 0;
    let mut route = "";
    let start = Instant::now();
    let idx: Vec<usize> = (0..b.paths.len()).collect();
    for group in idx.chunks(dsts.len()) {
        let files = group
            .iter()
            .map(|&i| open_direct(&b.paths[i]))
            .collect::<Result<Vec<_>>>()?;
        let mut ds: Vec<_> = dsts.iter_mut().map(|d| d.destination()).collect();
        let mut jobs: Vec<OnboardJob<'_, '_>> = group
            .iter()
            .zip(&files)
            .zip(ds.iter_mut())
            .map(|((&i, f), d)| OnboardJob {
                file: f,
                payload_offset: HEADER_BYTES as u64,
                payload_len: b.headers[i].payload_len,
                expected_sum: b.headers[i].payload_sum,
                dst: d,
                layout: &b.layout,
            })
            .collect();
        for (r, &i) in t.onboard_batch(&mut jobs)?.into_iter().zip(group) {
            let out = r.with_context(|| format!("onboarding {}", b.paths[i].display()))?;
            fallbacks += usize::from(out.fallback.is_some());
            route = out.route.name();
        }
    }
    let bytes = b.headers.iter().map(|h| h.payload_len as usize).sum();
    Ok((
        common::gbps(bytes, start.elapsed().as_secs_f64()),
        fallbacks,
        route,
    ))
}

/// Raw baseline with the same I/O shape: `depth` threads, each with its own
/// aligned buffer, O_DIRECT-pread the same files' padded payloads in pieces
/// of `chunk` bytes (no hashing, no copy).
fn raw_all(b: &Blocks, chunk: usize, depth: usize) -> Result<f64> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let start = Instant::now();
    let files = b
        .paths
        .iter()
        .map(|p| open_direct(p))
        .collect::<Result<Vec<_>>>()?;
    let mut work = Vec::new();
    for (i, h) in b.headers.iter().enumerate() {
        let padded = padded_len(h.payload_len) as usize;
        let mut o = 0;
        while o < padded {
            work.push((i, o, (padded - o).min(chunk)));
            o += chunk;
        }
    }
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| -> Result<()> {
        let hs: Vec<_> = (0..depth.max(1))
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    let mut buf = AlignedBuf::rounded(chunk)?;
                    while let Some(&(i, o, n)) = work.get(next.fetch_add(1, Ordering::Relaxed)) {
                        files[i].read_exact_at(
                            &mut buf.as_mut_slice()[..n],
                            (HEADER_BYTES + o) as u64,
                        )?;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in hs {
            h.join()
                .map_err(|_| anyhow::anyhow!("baseline thread panicked"))??;
        }
        Ok(())
    })?;
    let bytes = b.headers.iter().map(|h| h.payload_len as usize).sum();
    Ok(common::gbps(bytes, start.elapsed().as_secs_f64()))
}

/// Measures and returns the report.
pub fn measure(args: &GdsArgs) -> Result<Value> {
    anyhow::ensure!(args.blocks > 0, "--blocks must be at least 1");
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    anyhow::ensure!(
        (1..=64).contains(&args.buffers),
        "--buffers must be in 1..=64"
    );
    let total = args.block_size.saturating_mul(args.blocks as u64);
    anyhow::ensure!(
        total <= TOTAL_BYTES_MAX,
        "{total} bytes of blocks exceeds the {TOTAL_BYTES_MAX}-byte limit"
    );
    let mut caps = Capabilities::probe();
    if args.no_gds {
        caps = caps.without_gds("--no-gds");
    }
    let cfg = TransferConfig {
        chunk_bytes: args.chunk as usize,
        buffers: args.buffers,
        verify_direct: !args.skip_direct_verify,
        lanes: args.lanes,
        ..TransferConfig::default()
    };
    let mut t = Transfer::new(caps, cfg)?;
    let parent = match &args.dir {
        Some(d) => d.clone(),
        None => std::env::current_dir()?,
    };
    let tmp = tempfile::Builder::new()
        .prefix(".kvtier-bench-gds-")
        .tempdir_in(&parent)
        .with_context(|| format!("making a temp dir in {}", parent.display()))?;
    let blocks = write_blocks(tmp.path(), args.block_size, args.blocks)?;
    let batch = args.batch.clamp(1, 256).min(args.blocks);
    let mut dsts = (0..batch)
        .map(|_| BlockBuf::new(args.dest, args.block_size as usize, &t))
        .collect::<Result<Vec<_>, _>>()?;
    let emulated = dsts[0].is_emulated();

    // What verification costs on this machine right now: one core's
    // payload checksum (XXH3-128) rate, in-process (context for onboard).
    let hash_gbps = {
        let buf = vec![0x5au8; (64 << 20).min(total as usize).max(1 << 20)];
        let start = Instant::now();
        let _ = std::hint::black_box(kvtier_client::PayloadSum::of(&buf));
        common::gbps(buf.len(), start.elapsed().as_secs_f64())
    };
    let bar = indicatif::ProgressBar::new(args.rounds as u64 * 2);
    let mut onboard = Vec::new();
    let mut raw = Vec::new();
    let mut h2d = Vec::new();
    let mut dropped = true;
    let mut fallbacks = 0;
    let mut route = "";
    for r in 0..args.rounds {
        for phase in 0..2 {
            dropped &= common::drop_page_cache();
            if (r + phase) % 2 == 0 {
                let (g, fb, rt) = onboard_all(&mut t, &blocks, &mut dsts)?;
                onboard.push(g);
                fallbacks += fb;
                route = rt;
            } else {
                raw.push(raw_all(
                    &blocks,
                    args.chunk as usize,
                    args.buffers * args.lanes,
                )?);
            }
            bar.inc(1);
        }
        if let Some(g) = t.h2d_pinned_gbps(args.block_size as usize, args.blocks)? {
            h2d.push(g);
        }
    }
    bar.finish_and_clear();

    let mut out = Map::new();
    out.insert("bench".into(), json!("gds"));
    out.insert("dest".into(), json!(args.dest.name()));
    out.insert("dest_emulated".into(), json!(emulated));
    out.insert("capabilities".into(), json!(t.capabilities().describe()));
    out.insert("route".into(), json!(route));
    out.insert("fallbacks".into(), json!(fallbacks));
    out.insert("block_bytes".into(), json!(args.block_size));
    out.insert("blocks".into(), json!(args.blocks));
    out.insert("rounds".into(), json!(args.rounds));
    out.insert("chunk_bytes".into(), json!(args.chunk));
    out.insert("buffers".into(), json!(args.buffers));
    out.insert("batch_blocks".into(), json!(batch));
    out.insert("lanes".into(), json!(args.lanes));
    out.insert("direct_verified".into(), json!(!args.skip_direct_verify));
    out.insert("dir".into(), json!(parent.display().to_string()));
    out.insert("page_cache_dropped".into(), json!(dropped));
    out.insert("checksum_one_core_gbps".into(), json!(hash_gbps));
    out.insert(
        "baseline".into(),
        json!("raw O_DIRECT pread of the same block files into host memory, same chunk size and total depth (buffers x lanes threads), interleaved"),
    );
    let (mo, mr) = (common::median(&onboard), common::median(&raw));
    common::compare(&mut out, "onboard_gbps", mo, mr);
    out.insert("onboard_gbps_samples".into(), json!(onboard));
    out.insert("onboard_gbps_baseline_samples".into(), json!(raw));
    if !h2d.is_empty() {
        let mh = common::median(&h2d);
        out.insert("h2d_pinned_gbps".into(), json!(mh));
        out.insert("h2d_pinned_gbps_samples".into(), json!(h2d));
        if args.dest == MemoryKind::Device {
            out.insert(
                "device_baseline".into(),
                json!("min(raw O_DIRECT read, pinned H2D copy)"),
            );
            common::compare(&mut out, "device_onboard_gbps", mo, mr.min(mh));
        }
    }
    drop(tmp);
    Ok(Value::Object(out))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn tiny_run_has_the_json_contract() {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        for dest in [MemoryKind::Host, MemoryKind::Device] {
            let args = GdsArgs {
                block_size: 64 << 10,
                blocks: 3,
                dest,
                dir: Some(dir.path().to_path_buf()),
                rounds: 2,
                chunk: 16 << 10,
                buffers: 2,
                batch: 2,
                lanes: 2,
                no_gds: false,
                skip_direct_verify: false,
                json: true,
            };
            let v = measure(&args).unwrap();
            let o = v.as_object().unwrap();
            for (k, val) in o {
                if let Some(name) = k.strip_suffix("_vs_baseline") {
                    assert!(val.is_number(), "{k}");
                    assert!(o[name].is_number(), "{name} missing");
                    assert!(o[&format!("{name}_baseline")].is_number());
                }
            }
            assert!(o["onboard_gbps"].as_f64().unwrap() > 0.0);
            assert!(o.contains_key("onboard_gbps_vs_baseline"));
            assert!(o["page_cache_dropped"].is_boolean());
            assert_eq!(o["onboard_gbps_samples"].as_array().unwrap().len(), 2);
        }
        // The temp dir inside --dir is gone.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
