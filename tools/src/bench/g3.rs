//! `kvtier bench g3`: the G3 tier against raw O_DIRECT I/O of the same
//! sizes and depth on the same filesystem, interleaved A B A B; plus the
//! in-memory longest-prefix lookup at 1M blocks, index RAM per block, and
//! recovery time.

use super::common::{
    compare, drop_page_cache, emit, gbps, median, parse_size, percentile, shuffled, RawFile,
};
use anyhow::{Context, Result};
use clap::Args;
use kvtier_client::{BlockHeader, BlockKey, KvLayout, Namespace};
use kvtier_daemon::base::tier::Lookup;
use kvtier_daemon::tiers::g3::engine::{AlignedBuf, EngineKind};
use kvtier_daemon::tiers::g3::index::{digest, Entry, MemIndex};
use kvtier_daemon::tiers::g3::{G3Config, G3Store, PutMeta, SyncMode};
use kvtier_daemon::tiers::policy::{BlockMeta, EvictionPolicy, Lru};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Arguments of `kvtier bench g3`.
#[derive(Debug, Args)]
pub struct G3Args {
    /// Directory on the filesystem to measure (a temp dir under it is used).
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// One block size (default: 64KiB, 2MiB and 16MiB).
    #[arg(long, value_parser = parse_size)]
    block_size: Option<u64>,
    /// Blocks per size (default: 512 MiB worth, at least 16).
    #[arg(long)]
    blocks: Option<usize>,
    /// Block operations in flight (threads; the store's io_depth).
    #[arg(long, default_value_t = 16)]
    depth: usize,
    /// Interleaved rounds (A B A B ...).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// io_uring, pread or auto.
    #[arg(long, default_value = "auto")]
    engine: String,
    /// Blocks in the in-memory index for the lookup figure.
    #[arg(long, default_value_t = 1_000_000)]
    lookup_blocks: usize,
    /// Blocks written for the recovery figure (8 KiB files).
    #[arg(long, default_value_t = 20_000)]
    recovery_blocks: usize,
    /// Blocks written then evicted into the recycle pool for the
    /// crash-restart-with-a-full-pool figure (4 KiB payloads).
    #[arg(long, default_value_t = 4096)]
    pool_blocks: usize,
    /// Blocks in the index for the clean-restart figure (index only).
    #[arg(long, default_value_t = 1_000_000)]
    clean_restart_blocks: usize,
    /// Skip the per-size I/O rounds (index figures only).
    #[arg(long)]
    no_io: bool,
    /// Durability of block files: auto (per block, the daemon's
    /// default), group (one syncfs per window), fdatasync or odsync.
    #[arg(long, default_value = "auto")]
    sync: String,
    /// Blocks whose file is at most this long go to slab slots in the
    /// per-size rounds (the daemon's `g3.slot_max`; 0: a file per block).
    /// The recovery and pool figures measure the file store.
    #[arg(long, value_parser = parse_size, default_value = "4MiB")]
    slot_max: u64,
    /// One JSON document on stdout.
    #[arg(long)]
    json: bool,
}

fn engine_kind(s: &str) -> Result<EngineKind> {
    Ok(match s {
        "auto" => EngineKind::Auto,
        "io_uring" | "uring" => EngineKind::Uring,
        "pread" => EngineKind::Pread,
        _ => anyhow::bail!("--engine is auto, io_uring or pread, not {s:?}"),
    })
}

fn open_store(
    root: &Path,
    depth: usize,
    engine: EngineKind,
    sync: SyncMode,
) -> Result<Arc<G3Store>> {
    open_store_slots(root, depth, engine, sync, 0)
}

/// [`open_store`] with blocks of up to `slot_max` bytes in slab slots.
fn open_store_slots(
    root: &Path,
    depth: usize,
    engine: EngineKind,
    sync: SyncMode,
    slot_max: u64,
) -> Result<Arc<G3Store>> {
    let mut c = G3Config::new(root, 1 << 50);
    c.slot_file_bytes_max = slot_max;
    c.sync_mode = sync;
    c.io_depth = depth.clamp(1, 256);
    c.buffer_pool_bytes = (depth as u64 * 4) << 20;
    c.engine = engine;
    Ok(G3Store::open(c, Box::new(Lru::new()))?)
}

fn headers(ns: &Namespace, payload: &[u8], n: usize, salt: u64) -> Vec<BlockHeader> {
    let proto = BlockHeader::for_payload(ns, BlockKey::from_u64(0), payload, 1);
    (0..n)
        .map(|i| {
            let mut h = proto.clone();
            h.key = BlockKey::from_u64(salt << 40 | i as u64);
            h
        })
        .collect()
}

/// One G3 round: write all, drop cache, read all in random order.
/// One round at one size: `a`'s depth and slot bound.
fn g3_round(
    a: &G3Args,
    root: &Path,
    size: u64,
    n: usize,
    engine: EngineKind,
    sync: SyncMode,
    round: usize,
) -> Result<(f64, f64, Vec<f64>, &'static str, f64)> {
    let depth = a.depth;
    let _ = std::fs::remove_dir_all(root);
    let store = open_store_slots(root, depth, engine, sync, a.slot_max)?;
    let ns = Namespace::new(
        "bench",
        KvLayout::with_block_bytes(size)?,
        "",
        b"g3".to_vec(),
    )?;
    let id = ns.id();
    let payload = payload(size as usize);
    let hs = headers(&ns, &payload, n, round as u64);
    let file_len = hs[0].file_len() as usize;
    let next = AtomicUsize::new(0);
    let t = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let mut js = Vec::new();
        for _ in 0..depth {
            js.push(s.spawn(|| -> Result<()> {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(h) = hs.get(i) else { return Ok(()) };
                    store.put_block(&id, h, &payload, PutMeta::default())?;
                }
            }));
        }
        for j in js {
            j.join().map_err(|_| anyhow::anyhow!("writer panicked"))??;
        }
        Ok(())
    })?;
    let write = gbps(file_len * n, t.elapsed().as_secs_f64());
    let (groups, members) = store.group_commit_counts();
    let per_group = members as f64 / groups.max(1) as f64;
    drop_page_cache();
    let order = shuffled(n, 7 + round as u64);
    let next = AtomicUsize::new(0);
    let lat = std::sync::Mutex::new(Vec::with_capacity(n));
    let t = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let mut js = Vec::new();
        for _ in 0..depth {
            js.push(s.spawn(|| -> Result<()> {
                let mut buf = AlignedBuf::rounded(file_len)?;
                let mut mine = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&b) = order.get(i) else { break };
                    let t = Instant::now();
                    match store.read_into(&id, &hs[b].key, buf.as_mut_slice())? {
                        Lookup::Hit(_) => {}
                        Lookup::Miss(r) => anyhow::bail!("block {b} missed: {r:?}"),
                    }
                    mine.push(t.elapsed().as_secs_f64() * 1e6);
                }
                if let Ok(mut l) = lat.lock() {
                    l.extend(mine);
                }
                Ok(())
            }));
        }
        for j in js {
            j.join().map_err(|_| anyhow::anyhow!("reader panicked"))??;
        }
        Ok(())
    })?;
    let read = gbps(file_len * n, t.elapsed().as_secs_f64());
    let engine_name = store.engine_name();
    store.close()?;
    drop(store);
    let _ = std::fs::remove_dir_all(root);
    Ok((
        write,
        read,
        lat.into_inner().unwrap_or_default(),
        engine_name,
        per_group,
    ))
}

/// Deterministic non-constant payload bytes.
pub fn payload(len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn size_report(
    a: &G3Args,
    tmp: &Path,
    size: u64,
    engine: EngineKind,
    sync: SyncMode,
) -> Result<Value> {
    let file_len = (4096 + size.div_ceil(4096) * 4096) as usize;
    let n = a
        .blocks
        .unwrap_or(((512u64 << 20) / file_len as u64).max(16) as usize);
    let (mut w, mut r, mut p50, mut p99) = (vec![], vec![], vec![], vec![]);
    let (mut bw, mut br, mut bp50, mut bp99) = (vec![], vec![], vec![], vec![]);
    let mut engine_name = "";
    let mut per_group = vec![];
    let mut cold = true;
    for round in 0..a.rounds.max(1) {
        eprintln!("g3 bench: {size} B x {n}, round {}/{}", round + 1, a.rounds);
        let (gw, gr, lat, e, g) = g3_round(a, &tmp.join("store"), size, n, engine, sync, round)?;
        engine_name = e;
        per_group.push(g);
        w.push(gw);
        r.push(gr);
        p50.push(percentile(&lat, 50.0));
        p99.push(percentile(&lat, 99.0));
        let raw = RawFile::create(tmp, file_len, n)?;
        bw.push(raw.write_all(a.depth)?);
        cold &= drop_page_cache();
        let (g, lat) = raw.read_order(a.depth, &shuffled(n, 7 + round as u64))?;
        br.push(g);
        bp50.push(percentile(&lat, 50.0));
        bp99.push(percentile(&lat, 99.0));
        drop(raw);
        let _ = std::fs::remove_file(tmp.join("raw-baseline.bin"));
    }
    let mut m = Map::new();
    m.insert("block_bytes".into(), json!(size));
    m.insert("file_bytes".into(), json!(file_len));
    m.insert("blocks".into(), json!(n));
    m.insert("depth".into(), json!(a.depth));
    m.insert("rounds".into(), json!(a.rounds));
    m.insert("engine".into(), json!(engine_name));
    m.insert("sync".into(), json!(format!("{sync:?}")));
    m.insert(
        "slotted".into(),
        json!(a.slot_max > 0 && file_len as u64 <= a.slot_max),
    );
    m.insert("cold_reads".into(), json!(cold));
    m.insert("writes_per_group_commit".into(), json!(median(&per_group)));
    compare(&mut m, "write_gbps", median(&w), median(&bw));
    compare(&mut m, "read_gbps", median(&r), median(&br));
    m.insert("read_p50_us".into(), json!(median(&p50)));
    m.insert("read_p99_us".into(), json!(median(&p99)));
    m.insert("read_p50_us_baseline".into(), json!(median(&bp50)));
    m.insert("read_p99_us_baseline".into(), json!(median(&bp99)));
    m.insert(
        "read_gbps_range".into(),
        json!([
            r.iter().cloned().fold(f64::MAX, f64::min),
            r.iter().cloned().fold(0.0, f64::max)
        ]),
    );
    m.insert(
        "read_gbps_baseline_range".into(),
        json!([
            br.iter().cloned().fold(f64::MAX, f64::min),
            br.iter().cloned().fold(0.0, f64::max)
        ]),
    );
    Ok(Value::Object(m))
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 4096
}

/// Longest-prefix lookup of a 64-block chain with `n` blocks indexed, and
/// the RAM the index (map + LRU policy) takes per block. Baseline: a plain
/// `HashSet<(NamespaceId, BlockKey)>` of the same blocks.
fn lookup_report(n: usize) -> Value {
    let ns = kvtier_client::NamespaceId([5; 16]);
    let rss0 = rss_bytes();
    let mut mem = MemIndex::default();
    let mut lru = Lru::new();
    for i in 0..n {
        let key = BlockKey::from_digest(*blake3::hash(&(i as u64).to_le_bytes()).as_bytes());
        let (id, check) = digest(&ns, &key);
        mem.insert(
            ns,
            id,
            Entry {
                check,
                file_pages: 513,
                hits: AtomicU32::new(0),
                last_access_s: AtomicU32::new(0),
                pin_until_s: 0,
                leases: 0,
                priority: 0,
                flags: 0,
                slot: kvtier_daemon::tiers::g3::index::NO_SLOT,
            },
        );
    }
    let rss1 = rss_bytes();
    for id in mem.map.keys() {
        lru.on_insert(*id, BlockMeta::default());
    }
    let rss2 = rss_bytes();
    let key_of =
        |i: usize| BlockKey::from_digest(*blake3::hash(&(i as u64).to_le_bytes()).as_bytes());
    let base: std::collections::HashSet<(kvtier_client::NamespaceId, BlockKey)> =
        (0..n).map(|i| (ns, key_of(i))).collect();
    let lock = std::sync::RwLock::new(mem);
    // Chains precomputed so that only the probe is timed; interleaved
    // G3 / baseline per chain so that load spikes hit both alike.
    let iters = 100_000usize;
    let warm = 10_000usize;
    let mut rng = 12345u64;
    let starts: Vec<usize> = (0..iters + warm)
        .map(|_| {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (rng >> 33) as usize % n.saturating_sub(64).max(1)
        })
        .collect();
    let (mut lat, mut plat, mut blat) = (Vec::new(), Vec::new(), Vec::new());
    let mut dlat = Vec::new();
    let mut chain: Vec<BlockKey> = Vec::with_capacity(64);
    for (i, &start) in starts.iter().enumerate() {
        chain.clear();
        chain.extend((start..start + 64).map(key_of));
        let digs = kvtier_daemon::tiers::g3::G3Store::chain_digests(&ns, &chain);
        // The name digests alone (what the lookup adds to the probes).
        let t = Instant::now();
        let mut ids = [(0u64, 0u64); 64];
        for (slot, k) in ids.iter_mut().zip(&chain) {
            *slot = digest(&ns, k);
        }
        std::hint::black_box(&ids);
        let d = t.elapsed().as_secs_f64() * 1e6;
        let t = Instant::now();
        let got = lock
            .read()
            .map(|m| m.lookup_prefix(&ns, &chain))
            .unwrap_or(0);
        let a = t.elapsed().as_secs_f64() * 1e6;
        let t = Instant::now();
        let pgot = lock.read().map(|m| m.count_present(&digs)).unwrap_or(0);
        let p = t.elapsed().as_secs_f64() * 1e6;
        let t = Instant::now();
        let bgot = chain
            .iter()
            .take_while(|k| base.contains(&(ns, **k)))
            .count();
        let b = t.elapsed().as_secs_f64() * 1e6;
        assert_eq!(got, bgot.min(64));
        assert_eq!(pgot, got);
        if i >= warm {
            lat.push(a);
            plat.push(p);
            blat.push(b);
            dlat.push(d);
        }
    }
    let mut m = Map::new();
    m.insert("blocks_indexed".into(), json!(n));
    m.insert("chain_len".into(), json!(64));
    m.insert("iterations".into(), json!(iters));
    m.insert("warmup_iterations".into(), json!(warm));
    m.insert(
        "baseline".into(),
        json!("HashSet<(NamespaceId, BlockKey)> (SipHash), same 64 keys, take_while contains"),
    );
    for (q, name) in [(50.0, "p50"), (99.0, "p99"), (99.9, "p999")] {
        let (us, base_us) = (percentile(&lat, q), percentile(&blat, q));
        m.insert(format!("lookup_{name}_us"), json!(us));
        m.insert(format!("lookup_{name}_us_baseline"), json!(base_us));
        // The quotient is of rates, so that higher stays better (BENCH.md).
        compare(
            &mut m,
            &format!("lookup_{name}_per_s"),
            per_second(us),
            per_second(base_us),
        );
        m.insert(
            format!("lookup_precomputed_digests_{name}_us"),
            json!(percentile(&plat, q)),
        );
        m.insert(
            format!("lookup_digests_alone_{name}_us"),
            json!(percentile(&dlat, q)),
        );
    }
    m.insert(
        "index_ram_bytes_per_block".into(),
        json!((rss1.saturating_sub(rss0)) as f64 / n.max(1) as f64),
    );
    m.insert(
        "lru_policy_ram_bytes_per_block".into(),
        json!((rss2.saturating_sub(rss1)) as f64 / n.max(1) as f64),
    );
    Value::Object(m)
}

/// Lookups per second at a latency in microseconds (0 for no latency).
fn per_second(us: f64) -> f64 {
    if us > 0.0 {
        1e6 / us
    } else {
        0.0
    }
}

/// Recovery time of `n` indexed blocks (cold cache), beside a bare walk of
/// the same directory tree (the floor any file-scanning recovery pays).
fn recovery_report(
    tmp: &Path,
    n: usize,
    depth: usize,
    engine: EngineKind,
    sync: SyncMode,
) -> Result<Value> {
    let root = tmp.join("recovery");
    let _ = std::fs::remove_dir_all(&root);
    let store = open_store(&root, depth, engine, sync)?;
    let ns = ns_4k(b"rec")?;
    let payload = payload(4096);
    let hs = headers(&ns, &payload, n, 99);
    put_all(&store, &ns, &hs, &payload, depth)?;
    store.close()?;
    drop(store);
    // Clean restart: the marker is there, the index is trusted.
    let cold = drop_page_cache();
    let t = Instant::now();
    let store = open_store(&root, depth, engine, sync)?;
    let clean_ms = t.elapsed().as_secs_f64() * 1e3;
    let clean_rep = store.recovery.lock().map(|r| r.clone()).unwrap_or_default();
    // Crash restart: no marker (drop without close), full walk.
    drop(store);
    drop_page_cache();
    let t = Instant::now();
    let store = open_store(&root, depth, engine, sync)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let rep = store.recovery.lock().map(|r| r.clone()).unwrap_or_default();
    drop(store);
    drop_page_cache();
    let t = Instant::now();
    let mut files = 0u64;
    for d in std::fs::read_dir(root.join("blocks"))? {
        for s in std::fs::read_dir(d?.path())? {
            files += std::fs::read_dir(s?.path())?.count() as u64;
        }
    }
    let walk_ms = t.elapsed().as_secs_f64() * 1e3;
    let _ = std::fs::remove_dir_all(&root);
    Ok(json!({
        "blocks": n,
        "cold": cold,
        "clean_restart_ms": clean_ms,
        "clean_restart_skipped_walk": clean_rep.clean_start,
        "crash_restart_walked": !rep.clean_start,
        "recovery_ms": ms,
        "recovery_indexed": rep.indexed,
        "recovery_adopted": rep.adopted,
        "walk_ms_floor": walk_ms,
        "walk_files": files,
        "recovery_ms_per_1m_blocks_extrapolated": ms * 1e6 / n.max(1) as f64,
    }))
}

/// A namespace of 4 KiB blocks (the recovery figures' small files).
fn ns_4k(salt: &[u8]) -> Result<Namespace> {
    Ok(Namespace::new(
        "bench",
        KvLayout::with_block_bytes(4096)?,
        "",
        salt.to_vec(),
    )?)
}

/// Puts every block of `hs` (the same payload), `depth` at a time.
fn put_all(
    store: &G3Store,
    ns: &Namespace,
    hs: &[BlockHeader],
    payload: &[u8],
    depth: usize,
) -> Result<()> {
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| -> Result<()> {
        let mut js = Vec::new();
        for _ in 0..depth.max(1) {
            js.push(s.spawn(|| -> Result<()> {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(h) = hs.get(i) else { return Ok(()) };
                    store.put_block(&ns.id(), h, payload, PutMeta::default())?;
                }
            }));
        }
        for j in js {
            j.join().map_err(|_| anyhow::anyhow!("writer panicked"))??;
        }
        Ok(())
    })
}

/// A start after a crash with a full recycle pool, two ways. `n` blocks
/// are written and evicted into `recycle/` (the pool's file bound, 4096
/// by default, bounds `n` in use), and the store is dropped without a
/// close, so the open reads one header per pooled file:
/// - unsettled: the evictions were not made durable yet (no later write
///   of that size took a spare, and the reclaimer's settle, once a
///   second, had not run), so each pooled file still carries its block's
///   header and is verified in full and put back as a block;
/// - settled: one more put of the same size settled the pool (headers
///   blanked), so the open reads headers only and pools the files.
///
/// The floor beside them is a plain cold read of the same headers.
fn pool_restart_report(
    tmp: &Path,
    n: usize,
    depth: usize,
    engine: EngineKind,
    sync: SyncMode,
) -> Result<Value> {
    let root = tmp.join("pool-restart");
    let _ = std::fs::remove_dir_all(&root);
    let ns = ns_4k(b"pool")?;
    let payload = payload(4096);
    let hs = headers(&ns, &payload, n, 77);
    let crash_open = |store: Arc<G3Store>| -> Result<(Arc<G3Store>, f64, bool)> {
        drop(store);
        let cold = drop_page_cache();
        let t = Instant::now();
        let store = open_store(&root, depth, engine, sync)?;
        Ok((store, t.elapsed().as_secs_f64() * 1e3, cold))
    };
    let evict_all = |store: &G3Store| -> Result<u64> {
        for h in &hs {
            store.evict_block(&ns.id(), &h.key)?;
        }
        Ok(store.recycle_counts().files)
    };
    let store = open_store(&root, depth, engine, sync)?;
    put_all(&store, &ns, &hs, &payload, depth)?;
    let pooled_unsettled = evict_all(&store)?;
    let (store, unsettled_ms, cold) = crash_open(store)?;
    // Fewer than pooled when the reclaimer's once-a-second settle ran
    // before the drop (those are room, not blocks).
    let put_back = store.recovery.lock().map(|r| r.adopted).unwrap_or(0);
    let unsettled_pooled_after = store.recycle_counts().files;
    let pooled_before = evict_all(&store)?;
    let extra = headers(&ns, &payload, 1, 78);
    put_all(&store, &ns, &extra, &payload, 1)?;
    let pooled_settled = store.recycle_counts().files;
    let (store, settled_ms, _) = crash_open(store)?;
    let pooled_after = store.recycle_counts().files;
    let walked = store.recovery.lock().is_ok_and(|r| !r.clean_start);
    drop(store);
    drop_page_cache();
    let t = Instant::now();
    let mut head = vec![0u8; kvtier_client::block::HEADER_BYTES];
    let mut read = 0u64;
    for e in std::fs::read_dir(root.join("recycle"))? {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open(e?.path())?;
        if f.read_exact_at(&mut head, 0).is_ok() {
            read += 1;
        }
    }
    let floor_ms = t.elapsed().as_secs_f64() * 1e3;
    let _ = std::fs::remove_dir_all(&root);
    Ok(json!({
        "blocks_evicted": n,
        "cold": cold,
        "crash_restart_walked": walked,
        "unsettled_pooled_before_crash": pooled_unsettled,
        "unsettled_put_back": put_back,
        "unsettled_pooled_after_open": unsettled_pooled_after,
        "unsettled_crash_restart_ms": unsettled_ms,
        "settled_pooled_before_crash": pooled_settled,
        "settled_pooled_after_open": pooled_after,
        "settled_crash_restart_ms": settled_ms,
        "pooled_before_settling": pooled_before,
        "header_reads": read,
        "header_reads_ms_floor": floor_ms,
    }))
}

/// Clean restart with `n` blocks indexed, without writing `n` files: an
/// empty store is closed cleanly, `n` records are added to its redb index
/// directly, and the open that trusts the marker is timed (it reads only
/// the index, so the files' absence does not change what is measured).
fn clean_restart_report(tmp: &Path, n: usize, depth: usize, engine: EngineKind) -> Result<Value> {
    use kvtier_daemon::tiers::g3::index::{DiskIndex, Record};
    let root = tmp.join("clean-restart");
    let _ = std::fs::remove_dir_all(&root);
    let store = open_store(&root, depth, engine, SyncMode::Auto)?;
    store.close()?;
    drop(store);
    let ns = kvtier_client::NamespaceId([7; 16]);
    let t = Instant::now();
    {
        let disk = DiskIndex::open(&root.join("index.redb"))?;
        let recs: Vec<(u64, Record)> = (0..n)
            .map(|i| {
                let key =
                    BlockKey::from_digest(*blake3::hash(&(i as u64).to_le_bytes()).as_bytes());
                let rec = Record {
                    ns,
                    key,
                    payload_len: 4096,
                    payload_sum: kvtier_client::PayloadSum::from_bytes([0; 32]),
                    created_unix_ms: 0,
                    hits: 0,
                    last_access_s: i as u32,
                    pin_until_s: 0,
                    priority: 0,
                    flags: 0,
                    parent: None,
                    slot: None,
                };
                (digest(&ns, &key).0, rec)
            })
            .collect();
        for batch in recs.chunks(50_000) {
            let refs: Vec<(u64, &Record)> = batch.iter().map(|(i, r)| (*i, r)).collect();
            disk.put(&refs)?;
        }
        disk.flush()?;
    }
    let fill_s = t.elapsed().as_secs_f64();
    // The snapshot written by the empty store's close is for 0 blocks:
    // without it the clean open loads the records from redb.
    std::fs::remove_file(root.join(kvtier_daemon::tiers::g3::SNAPSHOT_FILE))?;
    drop_page_cache();
    let t = Instant::now();
    let store = open_store(&root, depth, engine, SyncMode::Auto)?;
    let redb_ms = t.elapsed().as_secs_f64() * 1e3;
    let redb_rep = store.recovery.lock().map(|r| r.clone()).unwrap_or_default();
    let t = Instant::now();
    store.close()?;
    let close_ms = t.elapsed().as_secs_f64() * 1e3;
    drop(store);
    // The redb open alone (repair check, table opens), cold.
    drop_page_cache();
    let t = Instant::now();
    drop(DiskIndex::open(&root.join("index.redb"))?);
    let redb_open_ms = t.elapsed().as_secs_f64() * 1e3;
    // Now with the snapshot that close wrote.
    let cold = drop_page_cache();
    let t = Instant::now();
    let store = open_store(&root, depth, engine, SyncMode::Auto)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let rep = store.recovery.lock().map(|r| r.clone()).unwrap_or_default();
    let present = store.stats();
    drop(store);
    let index_bytes = std::fs::metadata(root.join("index.redb"))
        .map(|m| m.len())
        .unwrap_or(0);
    let _ = std::fs::remove_dir_all(&root);
    Ok(json!({
        "blocks_indexed": n,
        "cold": cold,
        "skipped_walk": rep.clean_start,
        "from_snapshot": rep.from_snapshot,
        "clean_restart_ms": ms,
        "clean_restart_from_redb_ms": redb_ms,
        "clean_restart_from_redb_skipped_walk": redb_rep.clean_start && !redb_rep.from_snapshot,
        "close_ms": close_ms,
        "redb_open_alone_ms": redb_open_ms,
        "recovery_elapsed_ms": rep.elapsed_ms,
        "indexed_after_open": rep.indexed,
        "index_file_bytes": index_bytes,
        "index_fill_s": fill_s,
        "blocks_after_open": present.blocks,
    }))
}

/// Runs the benchmark.
pub fn run(a: G3Args) -> Result<()> {
    let engine = engine_kind(&a.engine)?;
    let sync = match a.sync.as_str() {
        "group" => SyncMode::Group,
        "auto" => SyncMode::Auto,
        "fdatasync" => SyncMode::Fdatasync,
        "odsync" | "o_dsync" => SyncMode::ODsync,
        s => anyhow::bail!("--sync is group, auto, fdatasync or odsync, not {s:?}"),
    };
    std::fs::create_dir_all(&a.dir).with_context(|| format!("creating {}", a.dir.display()))?;
    let tmp = tempfile::Builder::new()
        .prefix("kvtier-bench-g3")
        .tempdir_in(&a.dir)
        .with_context(|| format!("temp dir in {}", a.dir.display()))?;
    let sizes = match a.block_size {
        Some(s) => vec![s],
        None => vec![64 << 10, 2 << 20, 16 << 20],
    };
    let mut per_size = Vec::new();
    for s in sizes.into_iter().filter(|_| !a.no_io) {
        per_size.push(size_report(&a, tmp.path(), s, engine, sync)?);
    }
    eprintln!("g3 bench: lookup with {} blocks indexed", a.lookup_blocks);
    let lookup = lookup_report(a.lookup_blocks);
    eprintln!("g3 bench: recovery of {} blocks", a.recovery_blocks);
    let recovery = recovery_report(tmp.path(), a.recovery_blocks, a.depth, engine, sync)?;
    eprintln!(
        "g3 bench: crash restart with {} blocks evicted into the recycle pool",
        a.pool_blocks
    );
    let pool_restart = pool_restart_report(tmp.path(), a.pool_blocks, a.depth, engine, sync)?;
    eprintln!(
        "g3 bench: clean restart with {} blocks indexed",
        a.clean_restart_blocks
    );
    let clean = clean_restart_report(tmp.path(), a.clean_restart_blocks, a.depth, engine)?;
    let report = json!({
        "bench": "g3",
        "dir": a.dir.display().to_string(),
        "baseline": "raw O_DIRECT pwrite/pread of one file, same sizes and depth, same filesystem, interleaved",
        "sizes": per_size,
        "lookup": lookup,
        "recovery": recovery,
        "pool_restart": pool_restart,
        "clean_restart": clean,
    });
    emit(&report, a.json)
}
