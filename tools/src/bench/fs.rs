//! `kvtier bench fs`: cold reads of N block files through the FUSE mount vs
//! the same files read directly from the G3 directory, dd-like (1-4 MiB
//! buffered `read` calls), interleaved A B A B with the page cache dropped
//! before every pass. Variants: passthrough with verify-on-open on and off,
//! and the non-passthrough fallback; each against its own interleaved
//! baseline.
//!
//! The store and the mount run in this process through the library
//! (`G3Store` + `kvtier_daemon::edges::mount::start`), the same code `kvtierd
//! --mount` runs; the JSON says so under `daemon`.

use super::common::{compare, drop_page_cache, emit, gbps, median, parse_size};
use anyhow::{Context, Result};
use clap::Args;
use kvtier_client::{block_path, BlockHeader, BlockKey, KvLayout, Namespace};
use kvtier_daemon::edges::mount::{MountSection, PassthroughMode};
use kvtier_daemon::tiers::g3::{G3Config, G3Store, PutMeta};
use kvtier_daemon::tiers::policy::Lru;
use serde_json::{json, Map, Value};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Arguments of `kvtier bench fs`.
#[derive(Debug, Args)]
pub struct FsArgs {
    /// Directory on the filesystem to measure (a temp dir under it is used).
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// Payload bytes per block.
    #[arg(long, value_parser = parse_size, default_value = "2MiB")]
    block_size: u64,
    /// Blocks (files) read per pass.
    #[arg(long, default_value_t = 128)]
    blocks: usize,
    /// Bytes per `read` call (1-4 MiB is dd-like).
    #[arg(long, value_parser = parse_size, default_value = "1MiB")]
    read_size: u64,
    /// Interleaved rounds (A B A B ...) per variant.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Run only these variants (comma separated: passthrough_verify_on_open,
    /// passthrough_no_verify, fallback); default all.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// One JSON document on stdout.
    #[arg(long)]
    json: bool,
}

/// Reads every file with `read_size` buffered reads; returns the seconds.
fn read_all(paths: &[PathBuf], buf: &mut [u8]) -> Result<(f64, usize)> {
    let t = Instant::now();
    let mut bytes = 0usize;
    for p in paths {
        let mut f = std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?;
        loop {
            let n = f
                .read(buf)
                .with_context(|| format!("reading {}", p.display()))?;
            if n == 0 {
                break;
            }
            bytes += n;
        }
    }
    Ok((t.elapsed().as_secs_f64(), bytes))
}

struct Variant {
    name: &'static str,
    passthrough: PassthroughMode,
    verify_on_open: bool,
}

fn run_variant(
    a: &FsArgs,
    g3: &Arc<G3Store>,
    mnt: &Path,
    rels: &[String],
    v: &Variant,
    cold: &mut bool,
) -> Result<Value> {
    let section = MountSection {
        dir: mnt.to_path_buf(),
        passthrough: v.passthrough,
        verify_on_open: v.verify_on_open,
        ..MountSection::default()
    };
    let handle = kvtier_daemon::edges::mount::start(&section, g3.clone(), None)
        .with_context(|| format!("mounting at {}", mnt.display()))?;
    let passthrough_active = handle.passthrough_active();
    let through: Vec<PathBuf> = rels.iter().map(|r| mnt.join(r)).collect();
    let direct: Vec<PathBuf> = rels
        .iter()
        .map(|r| g3.config().root.join("blocks").join(r))
        .collect();
    let mut buf = vec![0u8; a.read_size.clamp(4096, 64 << 20) as usize];
    let (mut m, mut b) = (Vec::new(), Vec::new());
    let mut bytes = 0;
    for _ in 0..a.rounds.max(1) {
        *cold &= drop_page_cache();
        let (s, n) = read_all(&through, &mut buf)?;
        m.push(gbps(n, s));
        bytes = n;
        *cold &= drop_page_cache();
        let (s, n) = read_all(&direct, &mut buf)?;
        b.push(gbps(n, s));
    }
    let counters = handle.counters();
    handle.unmount()?;
    let mut out = Map::new();
    out.insert("variant".into(), json!(v.name));
    out.insert("passthrough_active".into(), json!(passthrough_active));
    out.insert("verify_on_open".into(), json!(v.verify_on_open));
    out.insert(
        "passthrough_opens".into(),
        json!(counters.passthrough_opens),
    );
    out.insert("fallback_opens".into(), json!(counters.fallback_opens));
    // The FUSE read requests the daemon answered, and their mean size
    // (what the mount's readahead and max_pages make of a dd-like read).
    out.insert("fallback_reads".into(), json!(counters.fallback_reads));
    out.insert(
        "fallback_read_bytes_mean".into(),
        json!(counters.fallback_read_bytes / counters.fallback_reads.max(1)),
    );
    out.insert("bytes_per_pass".into(), json!(bytes));
    out.insert("read_gbps_rounds".into(), json!(m));
    out.insert("read_gbps_baseline_rounds".into(), json!(b));
    compare(&mut out, "read_gbps", median(&m), median(&b));
    Ok(Value::Object(out))
}

/// Runs the benchmark.
pub fn run(a: FsArgs) -> Result<()> {
    std::fs::create_dir_all(&a.dir).with_context(|| format!("creating {}", a.dir.display()))?;
    let tmp = tempfile::Builder::new()
        .prefix("kvtier-bench-fs")
        .tempdir_in(&a.dir)
        .with_context(|| format!("temp dir in {}", a.dir.display()))?;
    let root = tmp.path().join("g3");
    let file_bytes = a.block_size.div_ceil(4096) * 4096 + 4096;
    let mut cfg = G3Config::new(&root, (file_bytes * a.blocks as u64 * 2).max(64 << 20));
    // A file per block: the baseline reads the block files the mount's
    // passthrough hands the kernel (a slotted block has no file).
    cfg.slot_file_bytes_max = 0;
    cfg.pinned_budget_bytes = 0;
    let g3 = G3Store::open(cfg, Box::new(Lru::new()))?;
    let ns = Namespace::new(
        "bench-fs",
        KvLayout::with_block_bytes(a.block_size).map_err(|e| anyhow::anyhow!("{e}"))?,
        "",
        "bench",
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let payload: Vec<u8> = (0..a.block_size as usize)
        .map(|i| (i as u64).wrapping_mul(0x9e37_79b9) as u8 ^ (i >> 12) as u8)
        .collect();
    let proto = BlockHeader::for_payload(&ns, BlockKey::from_u64(0), &payload, 0);
    let mut rels = Vec::with_capacity(a.blocks);
    eprintln!(
        "fs bench: storing {} blocks of {} bytes",
        a.blocks, a.block_size
    );
    for i in 0..a.blocks {
        let mut h = proto.clone();
        h.key = BlockKey::from_u64(0x5eed_0000 + i as u64);
        g3.put_block(&ns.id(), &h, &payload, PutMeta::default())?;
        rels.push(block_path(&ns.id(), &h.key));
    }
    let mnt = tmp.path().join("mnt");
    let variants = [
        Variant {
            name: "passthrough_verify_on_open",
            passthrough: PassthroughMode::Auto,
            verify_on_open: true,
        },
        Variant {
            name: "passthrough_no_verify",
            passthrough: PassthroughMode::Auto,
            verify_on_open: false,
        },
        Variant {
            name: "fallback",
            passthrough: PassthroughMode::Off,
            verify_on_open: true,
        },
    ];
    let mut cold = true;
    let mut results = Vec::new();
    for v in variants
        .iter()
        .filter(|v| a.only.is_empty() || a.only.iter().any(|o| o == v.name))
    {
        eprintln!("fs bench: {} ({} rounds)", v.name, a.rounds);
        results.push(run_variant(&a, &g3, &mnt, &rels, v, &mut cold)?);
    }
    g3.close()?;
    let report = json!({
        "bench": "fs",
        "daemon": "library: G3Store + kvtier_daemon::edges::mount::start in this process (the code kvtierd --mount runs)",
        "dir": a.dir.display().to_string(),
        "block_size_bytes": a.block_size,
        "file_bytes": file_bytes,
        "blocks": a.blocks,
        "read_size_bytes": a.read_size,
        "rounds": a.rounds,
        "cold": cold,
        "baseline": "the same block files read directly from the G3 directory with the same buffered read size, page cache dropped, interleaved with the mount pass",
        "note": "the fallback verifies every block at open whatever verify_on_open says (bytes are served from the verified copy)",
        "variants": results,
    });
    emit(&report, a.json)
}
