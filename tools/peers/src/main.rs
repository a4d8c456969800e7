//! `kvtier-bench-foyer`: one round of foyer's hybrid cache on the blocks and
//! the disk `kvtier bench peers` gives it; prints one JSON line.
//!
//! A round: insert every block (`--inflight` writers), let the cache settle,
//! drop it without a final flush (a process that stops after its puts were
//! acknowledged), reopen it on the same directory with recovery, drop the
//! page cache, and get every block back (`--inflight` readers). A block whose
//! insert returned but which is not read back with its exact bytes is lost.
//!
//! Two configurations (`--config`):
//! - `default`: foyer's defaults (write on eviction, one flusher, 16 MiB
//!   buffer pool, a submit queue of twice that, buffered device I/O) with a
//!   byte weigher and a 64 MiB memory tier, as foyer's README sets it up.
//! - `durable`: the settings under which foyer keeps every insert: write on
//!   insertion, a submit queue that never overflows, direct I/O, each
//!   insert acknowledged only once its flusher wrote it (`storage().wait()`
//!   after the insert: back-pressure, without which the flush buffers
//!   overflow and drop entries), engine blocks that hold an entry
//!   (`engine_block_bytes`), and an fsync of the device files at the
//!   end of the put phase (timed). foyer has no per-insert fsync: that one
//!   sync at the end is more lenient than kvtier's durable-at-ack.

use anyhow::{bail, Context, Result};
use foyer::{
    BlockEngineConfig, DeviceBuilder, FsDeviceBuilder, HybridCache, HybridCacheBuilder,
    HybridCachePolicy, RecoverMode,
};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

struct Args {
    dir: PathBuf,
    block_bytes: usize,
    blocks: usize,
    inflight: usize,
    seed: u64,
    durable: bool,
}

fn parse() -> Result<Args> {
    let mut a = Args {
        dir: PathBuf::new(),
        block_bytes: 2 << 20,
        blocks: 64,
        inflight: 8,
        seed: 1,
        durable: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().with_context(|| format!("{k} needs a value"))?;
        match k.as_str() {
            "--dir" => a.dir = v.into(),
            "--block-bytes" => a.block_bytes = v.parse()?,
            "--blocks" => a.blocks = v.parse()?,
            "--inflight" => a.inflight = v.parse()?,
            "--seed" => a.seed = v.parse()?,
            "--config" => {
                a.durable = match v.as_str() {
                    "durable" => true,
                    "default" => false,
                    o => bail!("--config {o}: expected durable or default"),
                }
            }
            o => bail!(
                "unknown argument {o} (--dir --block-bytes --blocks --inflight --seed --config)"
            ),
        }
    }
    if a.dir.as_os_str().is_empty() || a.blocks == 0 || a.inflight == 0 {
        bail!("--dir is required; --blocks and --inflight must be positive");
    }
    Ok(a)
}

/// The payloads `kvtier bench peers` gives every system (its
/// `common::noise(seed + i, len)`, repeated here so the crates share no code).
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for c in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    v
}

fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

/// foyer's block engine writes entries into engine blocks (16 MiB by
/// default) and silently drops an entry larger than one: with the default
/// a 16 MiB KV block was acknowledged and never written (every one lost,
/// and a put "faster" than the disk). The durable configuration sizes
/// engine blocks to hold an entry. (Measured at 16 MiB: it still loses
/// 5-11 of 16 acknowledged blocks across a stop, with engine blocks of 32
/// or 64 MiB; `lost_blocks` reports it.)
fn engine_block_bytes(a: &Args) -> usize {
    if a.durable {
        (a.block_bytes + 64 * 1024)
            .next_power_of_two()
            .max(16 << 20)
    } else {
        16 << 20
    }
}

fn device_capacity(a: &Args) -> usize {
    // Room for every block twice over, and at least 16 engine blocks.
    (a.blocks * (a.block_bytes + 64 * 1024) * 2)
        .max(16 * engine_block_bytes(a))
        .max(256 << 20)
}

async fn open(a: &Args, dir: &Path) -> Result<HybridCache<u64, Vec<u8>>> {
    let device = FsDeviceBuilder::new(dir)
        .with_capacity(device_capacity(a))
        .with_direct(a.durable)
        .build()?;
    let mut engine = BlockEngineConfig::new(device);
    if a.durable {
        engine = engine
            .with_block_size(engine_block_bytes(a))
            .with_submit_queue_size_threshold(usize::MAX / 2)
            .with_flushers(2)
            .with_buffer_pool_size((2 * engine_block_bytes(a)).max(64 << 20));
    }
    let policy = if a.durable {
        HybridCachePolicy::WriteOnInsertion
    } else {
        HybridCachePolicy::WriteOnEviction
    };
    let cache = HybridCacheBuilder::new()
        .with_policy(policy)
        .with_flush_on_close(false)
        .memory(64 << 20)
        .with_weighter(|_k: &u64, v: &Vec<u8>| v.len())
        .storage()
        .with_engine_config(engine)
        .with_recover_mode(RecoverMode::Quiet)
        .build()
        .await?;
    Ok(cache)
}

fn fsync_dir_files(dir: &Path) -> Result<()> {
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_file() {
            std::fs::File::open(&p)?.sync_all()?;
        }
    }
    std::fs::File::open(dir)?.sync_all()?;
    Ok(())
}

fn drop_page_cache() -> bool {
    std::fs::write("/proc/sys/vm/drop_caches", b"3\n").is_ok()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let a = Arc::new(parse()?);
    let dir = a.dir.join(if a.durable {
        "foyer-durable"
    } else {
        "foyer-default"
    });
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let payloads: Arc<Vec<Vec<u8>>> = Arc::new(
        (0..a.blocks)
            .map(|i| noise(a.seed + i as u64, a.block_bytes))
            .collect(),
    );

    // Put: `inflight` writers, each inserting its share in order.
    let cache = open(&a, &dir).await?;
    let t = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..a.inflight {
        let (cache, payloads, a) = (cache.clone(), payloads.clone(), a.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            for i in (w..a.blocks).step_by(a.inflight) {
                let t = Instant::now();
                cache.insert(i as u64, payloads[i].clone());
                if a.durable {
                    // The ack of a durable put: the entry is written. A wait
                    // queues behind this writer's insert in every flusher
                    // and returns once the batch holding it is on the
                    // device; without it foyer's flush buffers overflow
                    // under a burst and drop inserts (measured: 0-31 of 128 per round
                    // lost with the submit queue unbounded).
                    cache.storage().wait().await;
                } else {
                    tokio::task::yield_now().await;
                }
                lat.push(t.elapsed().as_secs_f64() * 1e6);
            }
            lat
        }));
    }
    let mut put_lat = Vec::new();
    for t in tasks {
        put_lat.extend(t.await?);
    }
    let acked_s = t.elapsed().as_secs_f64();
    // Settle: the flushers drain what they accepted.
    cache.storage().wait().await;
    if a.durable {
        fsync_dir_files(&dir)?;
    }
    let put_s = t.elapsed().as_secs_f64();
    let bytes = (a.blocks * a.block_bytes) as f64;
    drop(cache);

    // Reopen (recovery), cold, and read every block back.
    let cache = open(&a, &dir).await?;
    let cold = drop_page_cache();
    let t = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..a.inflight {
        let (cache, payloads, a) = (cache.clone(), payloads.clone(), a.clone());
        tasks.push(tokio::spawn(async move {
            let (mut lat, mut lost, mut got_bytes) = (Vec::new(), 0usize, 0usize);
            for i in (w..a.blocks).step_by(a.inflight) {
                let t = Instant::now();
                let got = cache.get(&(i as u64)).await;
                let us = t.elapsed().as_secs_f64() * 1e6;
                match got {
                    Ok(Some(e)) if *e.value() == payloads[i] => {
                        lat.push(us);
                        got_bytes += e.value().len();
                    }
                    _ => lost += 1,
                }
            }
            (lat, lost, got_bytes)
        }));
    }
    let (mut get_lat, mut lost, mut got_bytes) = (Vec::new(), 0usize, 0usize);
    for t in tasks {
        let (l, n, b) = t.await?;
        get_lat.extend(l);
        lost += n;
        got_bytes += b;
    }
    let get_s = t.elapsed().as_secs_f64();
    cache.close().await?;
    drop(cache);
    let _ = std::fs::remove_dir_all(&dir);
    let gbps = |b: f64, s: f64| if s > 0.0 { b / s / 1e9 } else { 0.0 };
    println!(
        "{}",
        json!({
            "system": if a.durable { "foyer_durable" } else { "foyer_default" },
            "foyer_version": "0.22.6",
            "blocks": a.blocks,
            "block_bytes": a.block_bytes,
            "inflight": a.inflight,
            "acknowledged": a.blocks,
            "stored": a.blocks - lost,
            "lost_blocks": lost,
            "put_gbps": gbps(bytes, put_s),
            "put_ack_gbps": gbps(bytes, acked_s),
            "put_p50_us": percentile(&put_lat, 50.0),
            "put_p99_us": percentile(&put_lat, 99.0),
            // Read rate over the bytes actually served (lost blocks are
            // misses, which cost little and must not inflate the rate).
            "get_gbps": gbps(got_bytes as f64, get_s),
            "get_p50_us": percentile(&get_lat, 50.0),
            "get_p99_us": percentile(&get_lat, 99.0),
            "cold_page_cache": cold,
        })
    );
    Ok(())
}
