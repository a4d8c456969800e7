//! `kvtier bench replay`: a Mooncake-format trace through the policy code
//! the daemon runs, beside LRU from the same invocation, with a modeled
//! time-to-first-token report. With `--block-size` (and without
//! `--dry-run`) the trace is also replayed through a real kvtierd with real
//! block bytes (`replay_daemon.rs`), beside the dry run as its baseline.

use super::common::{self, emit};
use super::replay_daemon::{self, DaemonReplayConfig};
use super::replay_suite::{self, SeedSet};
use anyhow::{bail, Context, Result};
use clap::Args;
use kvtier_daemon::tiers::policy::admission::G4Admission;
use kvtier_daemon::tiers::policy::replay::{
    capacity_for_fraction, measure_admission, replay_dry, replay_two_tier, PolicyKind, ReplayStats,
    TtftModel, TwoTierTtft,
};
use kvtier_daemon::tiers::policy::trace::Trace;
use serde_json::{json, Map, Value};
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `kvtier bench replay`.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// Trace in Mooncake JSONL format (timestamp, input_length,
    /// output_length, hash_ids). Required unless --suite (where it adds a
    /// real trace to the synthetic ones).
    #[arg(long, required_unless_present = "suite")]
    trace: Option<PathBuf>,
    /// Run the held-out suite instead (synthetic chat, agent, rag and
    /// batch-scan traces, plus --trace if given) at 5%, 10% and 25%
    /// capacity: lru, default, belady and the share of the gap closed.
    #[arg(long)]
    suite: bool,
    /// Seeds of the synthetic traces: eval (held out) or tune.
    #[arg(long, default_value = "eval", requires = "suite")]
    seeds: SeedSet,
    /// Requests per synthetic trace in the suite.
    #[arg(long, default_value_t = 8000, requires = "suite")]
    suite_requests: usize,
    /// Capacity in blocks.
    #[arg(long, conflicts_with = "capacity_fraction")]
    capacity_blocks: Option<u64>,
    /// Capacity as a fraction of the trace's distinct blocks (0..=1).
    #[arg(long)]
    capacity_fraction: Option<f64>,
    /// Policy: lru | default | belady (offline optimum).
    #[arg(long, default_value = "default")]
    policy: PolicyKind,
    /// Replay without I/O only (the default without --block-size).
    #[arg(long)]
    dry_run: bool,
    /// Block size (e.g. 64KiB, 2MiB, or bytes): also replay through a real
    /// kvtierd started here, with real block bytes (G3 only).
    #[arg(long, value_parser = common::parse_size)]
    block_size: Option<u64>,
    /// Replay only the first N requests (capacity fractions then refer to
    /// the distinct blocks of that prefix).
    #[arg(long)]
    max_requests: Option<usize>,
    /// Directory for the real daemon's data and the raw baseline file (on
    /// the disk, not tmpfs; default: the current directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// The kvtierd binary for the real replay (default: next to this
    /// executable, else on PATH).
    #[arg(long)]
    kvtierd: Option<PathBuf>,
    /// Tokens per trace block (Mooncake: 512).
    #[arg(long, default_value_t = 512)]
    block_tokens: u64,
    /// Modeled prefill rate, tokens per second.
    #[arg(long, default_value_t = 8000.0)]
    prefill_tokens_per_s: f64,
    /// Modeled load bandwidth for hit blocks, GB/s.
    #[arg(long, default_value_t = 5.0)]
    load_gbps: f64,
    /// Modeled G4 read bandwidth (two-tier TTFT model), GB/s.
    #[arg(long, default_value_t = 2.0)]
    g4_gbps: f64,
    /// How long before its request a prefetch is issued (two-tier TTFT
    /// model), ms.
    #[arg(long, default_value_t = 500)]
    prefetch_lead_ms: u64,
    /// Modeled bytes per block (default: Llama-3-8B bf16, 512 tokens).
    #[arg(long, default_value_t = 64 << 20)]
    model_block_bytes: u64,
    /// One JSON document on stdout.
    #[arg(long)]
    json: bool,
}

fn stats_json(stats: &ReplayStats) -> Value {
    json!({
        "requested_blocks": stats.requested_blocks,
        "hit_blocks": stats.hit_blocks,
        "hit_ratio": stats.hit_ratio(),
        "capacity_used_blocks": stats.peak_blocks,
    })
}

/// Runs the replay and prints its report.
pub fn run(a: ReplayArgs) -> Result<()> {
    let report = report(&a)?;
    emit(&report, a.json)
}

/// Runs the replay; the report as one JSON value.
pub fn report(a: &ReplayArgs) -> Result<Value> {
    if a.suite {
        return suite(a);
    }
    let Some(trace_path) = a.trace.as_ref() else {
        bail!("give --trace FILE (or --suite)");
    };
    let real_block_bytes = a.block_size.filter(|_| !a.dry_run);
    if let Some(bs) = real_block_bytes {
        replay_daemon::validate(a.policy, bs)?;
    }
    let mut trace = Trace::load(trace_path)
        .with_context(|| format!("loading trace {}", trace_path.display()))?;
    let trace_requests = trace.requests.len();
    if let Some(n) = a.max_requests {
        if n == 0 {
            bail!("--max-requests must be at least 1");
        }
        trace.requests.truncate(n);
    }
    let distinct = trace.distinct_blocks();
    let capacity = match (a.capacity_blocks, a.capacity_fraction) {
        (Some(n), _) => n,
        (None, Some(f)) if (0.0..=1.0).contains(&f) => capacity_for_fraction(&trace, f),
        (None, Some(f)) => bail!("--capacity-fraction {f} must lie in 0..=1"),
        (None, None) => bail!("give --capacity-blocks N or --capacity-fraction F"),
    };
    if let Some(bs) = real_block_bytes {
        replay_daemon::validate_capacity(&trace, capacity, bs)?;
    }
    let model = TtftModel {
        prefill_tokens_per_s: a.prefill_tokens_per_s,
        load_bytes_per_s: a.load_gbps * 1e9,
        block_tokens: a.block_tokens,
        block_bytes: a.model_block_bytes,
    };

    let t0 = Instant::now();
    let stats = replay_dry(&trace, a.policy, capacity)?;
    let replay_s = t0.elapsed().as_secs_f64();
    let ttft = model.summarise(&trace, &stats);

    let mut out = Map::new();
    out.insert("trace".into(), json!(trace_path.display().to_string()));
    out.insert("target".into(), json!("dry-run"));
    out.insert("policy".into(), json!(a.policy.name()));
    out.insert("requests".into(), json!(trace.requests.len()));
    out.insert("trace_requests".into(), json!(trace_requests));
    out.insert("distinct_blocks".into(), json!(distinct));
    out.insert("capacity_blocks".into(), json!(capacity));
    out.insert(
        "capacity_fraction".into(),
        json!(capacity as f64 / distinct.max(1) as f64),
    );
    if let Value::Object(m) = stats_json(&stats) {
        out.extend(m);
    }
    out.insert("ceiling_hit_ratio".into(), json!(trace.ceiling_hit_ratio()));
    out.insert("replay_s".into(), json!(replay_s));
    out.insert(
        "ttft_model".into(),
        json!({
            "prefill_tokens_per_s": a.prefill_tokens_per_s,
            "load_gbps": a.load_gbps,
            "block_tokens": a.block_tokens,
            "model_block_bytes": a.model_block_bytes,
        }),
    );
    out.insert("ttft_mean_ms".into(), json!(ttft.mean_ms));
    out.insert("ttft_p90_ms".into(), json!(ttft.p90_ms));
    out.insert("ttft_mean_ms_no_cache".into(), json!(ttft.mean_ms_no_cache));
    out.insert("ttft_p90_ms_no_cache".into(), json!(ttft.p90_ms_no_cache));
    // Quotients are "higher is better": recompute time over kvtier time.
    out.insert(
        "ttft_mean_speedup_vs_baseline".into(),
        json!(speedup(ttft.mean_ms_no_cache, ttft.mean_ms)),
    );
    out.insert(
        "ttft_p90_speedup_vs_baseline".into(),
        json!(speedup(ttft.p90_ms_no_cache, ttft.p90_ms)),
    );

    if a.policy != PolicyKind::Lru {
        let base = replay_dry(&trace, PolicyKind::Lru, capacity)?;
        out.insert("baseline_policy".into(), json!("lru"));
        out.insert("hit_ratio_baseline".into(), json!(base.hit_ratio()));
        out.insert(
            "hit_ratio_vs_baseline".into(),
            json!(if base.hit_ratio() > 0.0 {
                stats.hit_ratio() / base.hit_ratio()
            } else {
                0.0
            }),
        );
        let bt = model.summarise(&trace, &base);
        out.insert("ttft_mean_ms_baseline".into(), json!(bt.mean_ms));
        out.insert("ttft_p90_ms_baseline".into(), json!(bt.p90_ms));
    }

    // Two tiers (G3 at this capacity, G4 holding everything written):
    // TTFT with prefetch beside the same replay without it.
    let two = TwoTierTtft {
        base: model,
        g4_load_bytes_per_s: a.g4_gbps * 1e9,
        prefetch_lead_ms: a.prefetch_lead_ms,
    };
    let tiered = replay_two_tier(&trace, a.policy, capacity)?;
    let ps = two.summarise(&trace, &tiered);
    out.insert(
        "prefetch".into(),
        json!({
            "g4_gbps": a.g4_gbps,
            "prefetch_lead_ms": a.prefetch_lead_ms,
            "hit_ratio_g3_g4": tiered.hit_ratio(),
            "g4_hit_blocks": ps.g4_hit_blocks,
            "prefetched_in_time_blocks": ps.prefetched_in_time_blocks,
            "prefetched_in_time_ratio": ps.in_time_ratio(),
            "ttft_mean_ms": ps.mean_ms,
            "ttft_p90_ms": ps.p90_ms,
            "ttft_mean_ms_baseline": ps.mean_ms_no_prefetch,
            "ttft_p90_ms_baseline": ps.p90_ms_no_prefetch,
            "ttft_mean_speedup_vs_baseline": speedup(ps.mean_ms_no_prefetch, ps.mean_ms),
            "ttft_p90_speedup_vs_baseline": speedup(ps.p90_ms_no_prefetch, ps.p90_ms),
        }),
    );

    if a.policy != PolicyKind::Belady {
        // G4 admission: bytes written vs what a second node gains, each
        // rule beside "write everything" as the baseline.
        let all = measure_admission(&trace, a.policy, capacity, G4Admission::All)?;
        let reuse = measure_admission(&trace, a.policy, capacity, G4Admission::AfterFirstReuse)?;
        out.insert(
            "g4_admission".into(),
            json!({
                "rule": G4Admission::AfterFirstReuse.name(),
                "baseline_rule": G4Admission::All.name(),
                "g4_written_blocks": reuse.g4_written_blocks,
                "g4_written_blocks_baseline": all.g4_written_blocks,
                "node_b_hit_ratio": reuse.node_b_hit_ratio,
                "node_b_hit_ratio_baseline": all.node_b_hit_ratio,
                "node_b_g4_hit_blocks": reuse.node_b_g4_hit_blocks,
                "node_b_g4_hit_blocks_baseline": all.node_b_g4_hit_blocks,
                "node_b_hit_ratio_vs_baseline": if all.node_b_hit_ratio > 0.0 {
                    reuse.node_b_hit_ratio / all.node_b_hit_ratio
                } else { 0.0 },
                // Fewer writes is better: baseline writes over ours.
                "g4_write_savings_vs_baseline": if reuse.g4_written_blocks > 0 {
                    all.g4_written_blocks as f64 / reuse.g4_written_blocks as f64
                } else { 0.0 },
            }),
        );
    }
    if let Some(bs) = real_block_bytes {
        let base_dir = match &a.dir {
            Some(d) => d.clone(),
            None => std::env::current_dir()?,
        };
        let cfg = DaemonReplayConfig {
            block_bytes: bs,
            capacity_blocks: capacity,
            policy: a.policy,
            base_dir,
            kvtierd: a.kvtierd.clone(),
        };
        // The top level stays the dry run; `daemon` is the real run, with
        // a dry run deciding as kvtierd does (same policy, same capacity)
        // as its baseline.
        out.insert("daemon".into(), replay_daemon::run(&trace, &cfg, &model)?);
    }
    Ok(Value::Object(out))
}

/// `--suite`: the held-out traces (plus --trace), see `replay_suite`.
fn suite(a: &ReplayArgs) -> Result<Value> {
    if a.suite_requests == 0 {
        bail!("--suite-requests must be at least 1");
    }
    let real = match &a.trace {
        Some(p) => {
            let mut t = Trace::load(p).with_context(|| format!("loading trace {}", p.display()))?;
            if let Some(n) = a.max_requests {
                t.requests.truncate(n);
            }
            let name = p.file_name().map_or_else(
                || p.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
            Some((name, t))
        }
        None => None,
    };
    let traces = replay_suite::traces(a.seeds, a.suite_requests, real);
    let t0 = Instant::now();
    let mut r = replay_suite::run(&traces, &replay_suite::FRACTIONS)?;
    if let Value::Object(m) = &mut r {
        m.insert("suite_requests".into(), json!(a.suite_requests));
        m.insert("replay_s".into(), json!(t0.elapsed().as_secs_f64()));
    }
    Ok(r)
}

fn speedup(no_cache: f64, with: f64) -> f64 {
    if with > 0.0 {
        no_cache / with
    } else {
        0.0
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        a: ReplayArgs,
    }

    fn args(extra: &[&str], trace: &std::path::Path) -> ReplayArgs {
        let mut v = vec!["x", "--trace", trace.to_str().unwrap()];
        v.extend_from_slice(extra);
        Cli::try_parse_from(v).unwrap().a
    }

    #[test]
    fn tiny_replay_report_has_the_contract() {
        let dir = tempfile::tempdir().unwrap();
        let trace = dir.path().join("t.jsonl");
        let mut text = String::new();
        for i in 0..50u64 {
            text.push_str(&format!(
                "{{\"timestamp\": {i}, \"input_length\": 2048, \"output_length\": 10, \"hash_ids\": [0, 1, {}, {}]}}\n",
                100 + i % 7,
                1000 + i
            ));
        }
        std::fs::write(&trace, text).unwrap();
        let r = report(&args(
            &["--capacity-fraction", "0.5", "--policy", "default"],
            &trace,
        ))
        .unwrap();
        for k in [
            "hit_ratio",
            "ceiling_hit_ratio",
            "capacity_blocks",
            "capacity_used_blocks",
            "hit_ratio_baseline",
            "hit_ratio_vs_baseline",
            "ttft_mean_ms",
            "ttft_p90_ms",
            "ttft_mean_ms_no_cache",
            "ttft_mean_speedup_vs_baseline",
            "g4_admission",
            "prefetch",
        ] {
            assert!(r.get(k).is_some(), "missing {k} in {r}");
        }
        assert!(r["hit_ratio"].as_f64().unwrap() <= r["ceiling_hit_ratio"].as_f64().unwrap());
        let p = &r["prefetch"];
        for k in [
            "ttft_mean_ms",
            "ttft_mean_ms_baseline",
            "ttft_mean_speedup_vs_baseline",
            "ttft_p90_speedup_vs_baseline",
        ] {
            assert!(p.get(k).is_some(), "missing prefetch.{k} in {p}");
        }
        assert!(
            p["ttft_mean_ms"].as_f64().unwrap() <= p["ttft_mean_ms_baseline"].as_f64().unwrap()
        );
        // Only quotients end in _vs_baseline.
        let lru = report(&args(
            &["--capacity-blocks", "10", "--policy", "lru"],
            &trace,
        ))
        .unwrap();
        assert!(lru.get("hit_ratio_vs_baseline").is_none());
        // --dry-run wins over --block-size: no daemon, same report.
        let dry = report(&args(
            &[
                "--capacity-blocks",
                "10",
                "--block-size",
                "4096",
                "--dry-run",
            ],
            &trace,
        ))
        .unwrap();
        assert!(dry.get("daemon").is_none());
        assert_eq!(dry["hit_blocks"], lru["hit_blocks"]);
    }

    #[test]
    fn suite_runs_without_a_trace() {
        let a = Cli::try_parse_from(["x", "--suite", "--seeds", "tune", "--suite-requests", "150"])
            .unwrap()
            .a;
        let r = report(&a).unwrap();
        let rows = r["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 8 * replay_suite::FRACTIONS.len());
        assert!(rows.iter().all(|row| row["split"] == "tune"));
        assert!(Cli::try_parse_from(["x"]).is_err(), "--trace or --suite");
    }

    #[test]
    fn block_size_units_and_max_requests() {
        let dir = tempfile::tempdir().unwrap();
        let trace = dir.path().join("t.jsonl");
        let mut text = String::new();
        for i in 0..20u64 {
            text.push_str(&format!("{{\"hash_ids\": [0, {}, {}]}}\n", 10 + i, 100 + i));
        }
        std::fs::write(&trace, text).unwrap();
        for (arg, bytes) in [("64KiB", 64u64 << 10), ("2MiB", 2 << 20), ("4096", 4096)] {
            let a = args(&["--capacity-blocks", "10", "--block-size", arg], &trace);
            assert_eq!(a.block_size, Some(bytes), "{arg}");
        }
        let bad = Cli::try_parse_from([
            "x",
            "--trace",
            trace.to_str().unwrap(),
            "--block-size",
            "2XB",
        ]);
        assert!(bad.is_err());
        // The capacity fraction refers to the replayed prefix.
        let r = report(&args(
            &[
                "--capacity-fraction",
                "0.5",
                "--max-requests",
                "5",
                "--policy",
                "lru",
            ],
            &trace,
        ))
        .unwrap();
        assert_eq!(r["requests"], 5);
        assert_eq!(r["trace_requests"], 20);
        assert_eq!(r["distinct_blocks"], 11);
        assert_eq!(r["capacity_blocks"], 5);
        assert_eq!(r["requested_blocks"], 15);
    }

    #[test]
    fn real_daemon_replay_refuses_what_it_cannot_run() {
        let dir = tempfile::tempdir().unwrap();
        let trace = dir.path().join("t.jsonl");
        std::fs::write(&trace, "{\"hash_ids\": [1, 2, 3, 4, 5, 6, 7, 8]}\n").unwrap();
        let err = |extra: &[&str]| report(&args(extra, &trace)).unwrap_err().to_string();
        let e = err(&[
            "--capacity-blocks",
            "100",
            "--block-size",
            "64KiB",
            "--policy",
            "belady",
        ]);
        assert!(e.contains("belady") && e.contains("offline"), "{e}");
        let e = err(&[
            "--capacity-blocks",
            "100",
            "--block-size",
            "0",
            "--policy",
            "lru",
        ]);
        assert!(e.contains("--block-size 0"), "{e}");
        let e = err(&[
            "--capacity-blocks",
            "100",
            "--block-size",
            "100",
            "--policy",
            "lru",
        ]);
        assert!(e.contains("multiple of 32"), "{e}");
        let e = err(&[
            "--capacity-blocks",
            "4",
            "--block-size",
            "64KiB",
            "--policy",
            "lru",
        ]);
        assert!(
            e.contains("cannot hold one request") && e.contains(">= 8"),
            "{e}"
        );
        let e = err(&[
            "--capacity-blocks",
            "10",
            "--block-size",
            "4KiB",
            "--policy",
            "lru",
        ]);
        assert!(e.contains("1 MiB"), "{e}");
        let e = err(&["--capacity-blocks", "10", "--max-requests", "0"]);
        assert!(e.contains("--max-requests"), "{e}");
        // The same settings replay fine as a dry run.
        assert!(report(&args(
            &[
                "--capacity-blocks",
                "4",
                "--block-size",
                "0",
                "--policy",
                "belady",
                "--dry-run"
            ],
            &trace,
        ))
        .is_ok());
    }
}
