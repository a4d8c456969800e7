//! `kvtier bench prefetch`: how much a background prefetch slows the
//! foreground onboards it runs beside.
//!
//! A real S3-compatible server (SeaweedFS) and two `kvtierd` on the same G4
//! bucket. Node A offloads `--prefetch-blocks` blocks (uploaded to G4); node
//! B holds `--foreground-blocks` blocks of its own on G3. Round by round,
//! interleaved: B's foreground onboards of its own blocks alone (the
//! baseline), then the same onboards while B prefetches A's whole chain
//! from G4 (evicted from B's G3 before each round, so every round fetches
//! it again). Both phases read the same blocks in the same requests; the
//! quotient `onboard_gbps_vs_baseline` (higher is better, 1.0: no slowdown)
//! is the cost of prefetch to the requests it must not delay. The report
//! also gives the foreground latencies and how long the prefetch took to
//! bring the chain to G3 (`prefetch_complete_s`, polled by lookups after
//! the foreground phase).

use super::common::{self, compare, median, percentile};
use super::crossnode::{client, config, start_node, Node};
use anyhow::{bail, Context, Result};
use clap::Args;
use kvtier_client::proto::ItemStatus;
use kvtier_client::{BlockKey, Hints, KvLayout, Namespace, OffloadOutcome, Onboarded, Tier};
use kvtier_daemon::testkit::s3::S3Server;
use serde_json::{json, Map, Value};
use std::time::{Duration, Instant};

/// Arguments of `kvtier bench prefetch`.
#[derive(Debug, Args)]
pub struct PrefetchArgs {
    /// Blocks node B prefetches from G4 each round.
    #[arg(long, default_value_t = 64)]
    pub prefetch_blocks: usize,
    /// Blocks node B onboards from its own G3 each phase.
    #[arg(long, default_value_t = 64)]
    pub foreground_blocks: usize,
    /// Block size.
    #[arg(long, default_value = "2MiB", value_parser = common::parse_size)]
    pub block_size: u64,
    /// Blocks per foreground onboard request.
    #[arg(long, default_value_t = 4)]
    pub request_blocks: usize,
    /// Interleaved rounds (medians and ranges reported).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// One JSON document on stdout.
    #[arg(long)]
    pub json: bool,
}

fn chain(n: &Node, ns: &Namespace, seed: u64, blocks: usize, bs: u64) -> Result<Vec<BlockKey>> {
    let c = client(n, bs, 4);
    let h = c.namespace(ns);
    let tokens: Vec<u32> = (0..blocks as u32 * 16)
        .map(|t| t + seed as u32 * 10_000_000)
        .collect();
    let keys = h.hash_chain(&tokens);
    for (i, k) in keys.iter().enumerate() {
        let d = common::noise(seed << 32 | i as u64, bs as usize);
        let o = h.offload_chain(None, std::slice::from_ref(k), &[&d[..]], Hints::default());
        if o.first() != Some(&OffloadOutcome::Stored) {
            bail!("offload: {o:?}");
        }
    }
    Ok(keys)
}

/// Polls `n`'s lookup of `keys` until all are on `tier`; the seconds it took.
fn wait_tier(
    n: &Node,
    ns: &Namespace,
    keys: &[BlockKey],
    tier: Tier,
    within: Duration,
) -> Result<f64> {
    let c = client(n, 4096, 1);
    let h = c.namespace(ns);
    let t = Instant::now();
    loop {
        let l = h.lookup(keys);
        if l.tiers.len() == keys.len() && l.tiers.iter().all(|x| *x == tier) {
            return Ok(t.elapsed().as_secs_f64());
        }
        if t.elapsed() > within {
            bail!(
                "{} of {} blocks on {tier:?} after {within:?}",
                l.tiers.iter().filter(|x| **x == tier).count(),
                keys.len()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Onboards `keys` from `n`, `per` per request; the latency of each
/// request. Every block must come from G3.
fn onboard(n: &Node, ns: &Namespace, keys: &[BlockKey], bs: u64, per: usize) -> Result<Vec<f64>> {
    let c = client(n, bs, per);
    let h = c.namespace(ns);
    let mut bufs: Vec<Vec<u8>> = (0..per).map(|_| vec![0u8; bs as usize]).collect();
    let mut lat = Vec::new();
    for ks in keys.chunks(per) {
        let mut rb: Vec<&mut [u8]> = bufs.iter_mut().take(ks.len()).map(|b| &mut b[..]).collect();
        let t = Instant::now();
        let r = h.onboard_into(ks, &mut rb);
        lat.push(t.elapsed().as_secs_f64());
        if let Some(bad) = r
            .iter()
            .find(|o| !matches!(o, Onboarded::Hit { tier: Tier::G3, .. }))
        {
            bail!("foreground onboard got {bad:?}");
        }
    }
    Ok(lat)
}

/// Runs the benchmark.
pub fn run(a: PrefetchArgs) -> Result<()> {
    if a.prefetch_blocks == 0 || a.foreground_blocks == 0 || a.rounds == 0 {
        bail!("--prefetch-blocks, --foreground-blocks and --rounds must be positive");
    }
    if a.request_blocks == 0 || a.request_blocks > 64 {
        bail!("--request-blocks is 1 to 64");
    }
    let bs = a.block_size;
    let Some(s3) = S3Server::start("kvtier-bench").context("starting SeaweedFS")? else {
        bail!("needs SeaweedFS: run scripts/setup.sh (or set KVTIER_WEED to a weed binary)");
    };
    let na = start_node(&config(&s3, None), "a")?;
    let nb = start_node(&config(&s3, None), "b")?;
    let ns = Namespace::new(
        "bench/prefetch",
        KvLayout::with_block_bytes(bs)?,
        "",
        "bench",
    )?;
    let remote = chain(&na, &ns, 1, a.prefetch_blocks, bs)?;
    let local = chain(&nb, &ns, 2, a.foreground_blocks, bs)?;
    // Uploaded: B, which never held A's chain, finds it in G4.
    wait_tier(&nb, &ns, &remote, Tier::G4, Duration::from_secs(300))?;
    let cb = client(&nb, bs, 4);
    let hb = cb.namespace(&ns);
    let (mut alone, mut beside) = (Vec::new(), Vec::new());
    let (mut alone_gbps, mut beside_gbps, mut complete_s) = (Vec::new(), Vec::new(), Vec::new());
    let fg_bytes = (a.foreground_blocks as u64 * bs) as f64;
    for round in 0..a.rounds {
        // B's copy of A's chain from the last round goes, so this round
        // fetches it again; the foreground blocks stay.
        hb.evict(&remote)?;
        wait_tier(&nb, &ns, &remote, Tier::G4, Duration::from_secs(60))?;
        let l = onboard(&nb, &ns, &local, bs, a.request_blocks)?;
        alone_gbps.push(fg_bytes / l.iter().sum::<f64>() / 1e9);
        alone.extend(l);
        let t = Instant::now();
        let st = hb.prefetch(&remote, 120_000, round as u64 + 1)?;
        if let Some(s) = st.iter().find(|s| **s != ItemStatus::Ok) {
            bail!("prefetch answered {s:?}");
        }
        let l = onboard(&nb, &ns, &local, bs, a.request_blocks)?;
        beside_gbps.push(fg_bytes / l.iter().sum::<f64>() / 1e9);
        beside.extend(l);
        wait_tier(&nb, &ns, &remote, Tier::G3, Duration::from_secs(300))?;
        complete_s.push(t.elapsed().as_secs_f64());
    }
    let mut m = Map::new();
    m.insert("bench".into(), json!("prefetch"));
    m.insert("block_bytes".into(), json!(bs));
    m.insert("prefetch_blocks".into(), json!(a.prefetch_blocks));
    m.insert("foreground_blocks".into(), json!(a.foreground_blocks));
    m.insert("request_blocks".into(), json!(a.request_blocks));
    m.insert("rounds".into(), json!(a.rounds));
    m.insert(
        "baseline".into(),
        json!("the same foreground onboards (G3 hits on node B) with no prefetch running, interleaved by round"),
    );
    compare(
        &mut m,
        "onboard_gbps",
        median(&beside_gbps),
        median(&alone_gbps),
    );
    m.insert(
        "onboard_gbps_range".into(),
        json!([min(&beside_gbps), max(&beside_gbps)]),
    );
    m.insert(
        "onboard_gbps_baseline_range".into(),
        json!([min(&alone_gbps), max(&alone_gbps)]),
    );
    for (q, name) in [(50.0, "p50"), (99.0, "p99")] {
        m.insert(
            format!("onboard_{name}_ms"),
            json!(percentile(&beside, q) * 1e3),
        );
        m.insert(
            format!("onboard_{name}_ms_baseline"),
            json!(percentile(&alone, q) * 1e3),
        );
    }
    m.insert("prefetch_complete_s".into(), json!(median(&complete_s)));
    m.insert(
        "prefetch_complete_s_range".into(),
        json!([min(&complete_s), max(&complete_s)]),
    );
    m.insert(
        "prefetch_gbps".into(),
        json!((a.prefetch_blocks as u64 * bs) as f64 / median(&complete_s) / 1e9),
    );
    drop(na);
    common::emit(&Value::Object(m), a.json)
}

fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NEG_INFINITY, f64::max)
}
