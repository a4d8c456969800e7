//! `kvtier bench g4`: put and get blocks through the G4 tier (encode,
//! create-if-absent put; GET, verify) beside raw `object_store` put/get of
//! the same bytes against the same store, interleaved A B A B, medians.
//!
//! With no `--g4` it starts the local SeaweedFS the tests use and stops it
//! after. Reads are served by the store's server (its own cache): the local
//! page cache is not involved on the client side.

use super::common::{compare, emit, median};
use anyhow::{Context, Result};
use kvtier_daemon::testkit::conformance::{block, namespace};
use kvtier_daemon::testkit::s3::S3Server;
use kvtier_daemon::tiers::g4::{G4Config, G4Store};
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};
use serde_json::{json, Map, Value};
use std::time::{Duration, Instant};

/// Options of `kvtier bench g4`.
#[derive(Debug, clap::Args)]
pub struct G4Args {
    /// G4 URL (s3://bucket/prefix, file:///path); credentials and endpoint
    /// from the AWS environment variables. Default: a local SeaweedFS.
    #[arg(long)]
    pub g4: Option<String>,
    /// Blocks per size (each put and read once through each path).
    #[arg(long, default_value_t = 8)]
    pub blocks: usize,
    /// One JSON document on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Runs the benchmark and prints its report.
pub fn run(a: G4Args) -> Result<()> {
    let report = measure(&a)?;
    emit(&report, a.json)
}

/// Runs the benchmark and returns its report.
pub fn measure(a: &G4Args) -> Result<Value> {
    let mut server = None;
    let cfg = match &a.g4 {
        Some(url) => G4Config::new(url.clone()),
        None => {
            let s = S3Server::start("kvtier-bench")
                .context("starting the local S3 server")?
                .context("no .venv/bin/weed: run scripts/setup.sh or pass --g4")?;
            let c = s.g4_config("bench");
            server = Some(s);
            c
        }
    };
    let g4 = G4Store::open(cfg.clone()).context("opening G4")?;
    let raw = g4.object_store();
    let h = g4.handle().clone();
    let mut report = Map::new();
    report.insert(
        "store".into(),
        json!(if server.is_some() {
            "seaweedfs (local, started by the bench)".to_string()
        } else {
            cfg.url.clone()
        }),
    );
    report.insert("blocks".into(), json!(a.blocks));
    let run_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    for (label, size) in [("2mib", 2u64 << 20), ("16mib", 16u64 << 20)] {
        let ns = namespace(size, &format!("bench-{run_id}-{label}")).map_err(anyhow::Error::msg)?;
        let id = ns.id();
        let mut put_t = Vec::new();
        let mut put_b = Vec::new();
        let mut get_t = Vec::new();
        let mut get_b = Vec::new();
        let mut blocks = Vec::new();
        for i in 0..a.blocks as u64 {
            let (k, hd, p) = block(&ns, i);
            let file = kvtier_client::encode_block(&hd, &p);
            let raw_path = Path::from(format!("bench-raw/{run_id}/{label}/{i}"));
            // A B B A, as the gets: neither path always puts first (the
            // second PUT of a pair met a warmer server: 2 MiB tier puts
            // measured 0.52-0.76x with the tier always first).
            for tier_turn in [i % 2 == 0, i % 2 != 0] {
                let t = Instant::now();
                if tier_turn {
                    h.block_on(g4.put_async(&id, &hd, &p))?;
                    put_t.push(t.elapsed().as_secs_f64());
                } else {
                    let payload = PutPayload::from(file.clone());
                    let t = Instant::now();
                    h.block_on(raw.put(&raw_path, payload))?;
                    put_b.push(t.elapsed().as_secs_f64());
                }
            }
            blocks.push((k, raw_path, file.len()));
        }
        for (i, (k, raw_path, len)) in blocks.iter().enumerate() {
            // A B B A: neither path always goes first.
            for tier_turn in [i % 2 == 0, i % 2 != 0] {
                let t = Instant::now();
                if tier_turn {
                    let got = h.block_on(g4.fetch_async(&id, k, Duration::from_secs(60)));
                    get_t.push(t.elapsed().as_secs_f64());
                    anyhow::ensure!(got.hit().is_some(), "G4 read of {k} missed");
                } else {
                    let b = h.block_on(async { raw.get(raw_path).await?.bytes().await })?;
                    get_b.push(t.elapsed().as_secs_f64());
                    anyhow::ensure!(b.len() == *len, "raw read short");
                }
            }
        }
        let gbps = |s: &[f64]| size as f64 / median(s) / 1e9;
        let mut m = Map::new();
        compare(&mut m, "put_gbps", gbps(&put_t), gbps(&put_b));
        compare(&mut m, "get_gbps", gbps(&get_t), gbps(&get_b));
        m.insert("put_ms_median".into(), json!(median(&put_t) * 1e3));
        m.insert("get_ms_median".into(), json!(median(&get_t) * 1e3));
        report.insert(label.into(), Value::Object(m));
        // Leave the store as found.
        for (k, raw_path, _) in &blocks {
            let _ = h.block_on(g4.delete_async(&id, k));
            let _ = h.block_on(raw.delete(raw_path));
        }
    }
    drop(g4);
    drop(server);
    Ok(Value::Object(report))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs at a tiny size and checks the `--json` contract, never a speed.
    #[test]
    fn bench_g4_runs_and_keeps_the_json_contract() -> Result<()> {
        if kvtier_daemon::testkit::s3::find_weed().is_none() {
            eprintln!("SKIP: .venv/bin/weed not installed (run scripts/setup.sh)");
            return Ok(());
        }
        let r = measure(&G4Args {
            g4: None,
            blocks: 1,
            json: true,
        })?;
        for size in ["2mib", "16mib"] {
            for m in ["put_gbps", "get_gbps"] {
                let q = &r[size][format!("{m}_vs_baseline")];
                assert!(q.as_f64().is_some_and(|v| v > 0.0), "{size}.{m}: {r}");
                assert!(r[size][m].is_f64() && r[size][format!("{m}_baseline")].is_f64());
            }
            let obj = r[size].as_object().context("size object")?;
            let quotients = obj.keys().filter(|k| k.ends_with("_vs_baseline")).count();
            assert_eq!(quotients, 2, "only quotients end in _vs_baseline: {r}");
        }
        Ok(())
    }
}
