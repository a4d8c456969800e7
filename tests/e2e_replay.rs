#![allow(clippy::unwrap_used, clippy::expect_used)]
//! End-to-end: `kvtier bench replay --block-size` replays a trace through a
//! real kvtierd (started by the bench) and its hits equal those of the dry
//! run that decides as kvtierd does (the daemon's policy code under G3's
//! chain rules: `daemon.hit_blocks_dry_run`). The report's top level is the
//! plain dry run, whose `lru` is exact LRU (the baseline): kvtierd's `lru`
//! lists leaves only, so the two differ.

mod support;

use std::process::Command;

/// A small deterministic Mooncake-style trace: a few shared system prompts,
/// conversations whose next turn re-reads the previous prompt, one-shot
/// tails. Ids are dense from 0 as in the Mooncake trace. `hinted`: a new
/// conversation's fresh tail is marked ephemeral, as an engine marks a
/// partial last block (the trace's optional `hints`).
fn synthetic_trace(requests: usize, hinted: bool) -> String {
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let mut rnd = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let mut next_id = 0u64;
    let mut fresh = |k: usize| -> Vec<u64> {
        let v: Vec<u64> = (next_id..next_id + k as u64).collect();
        next_id += k as u64;
        v
    };
    let systems: Vec<Vec<u64>> = (0..4).map(|_| fresh(2)).collect();
    let mut convs: Vec<Vec<u64>> = Vec::new();
    let mut out = String::new();
    for t in 0..requests {
        let mut hints = "";
        let ids = if !convs.is_empty() && rnd(10) < 6 {
            // Next turn of a recent conversation: its prompt plus new blocks.
            let back = (rnd(convs.len().min(12) as u64) as usize).min(convs.len() - 1);
            let ci = convs.len() - 1 - back;
            let mut ids = convs[ci].clone();
            if ids.len() > 12 {
                ids.truncate(3);
            }
            ids.extend(fresh(1 + rnd(3) as usize));
            convs[ci] = ids.clone();
            ids
        } else {
            let mut ids = systems[rnd(systems.len() as u64) as usize].clone();
            ids.extend(fresh(1 + rnd(4) as usize));
            convs.push(ids.clone());
            if hinted {
                hints = r#", "hints": {"ephemeral_tail_blocks": 2}"#;
            }
            ids
        };
        out.push_str(&format!(
            "{{\"timestamp\": {t}, \"input_length\": {}, \"output_length\": 10, \"hash_ids\": {ids:?}{hints}}}\n",
            ids.len() * 512
        ));
    }
    out
}

fn replay(trace: &std::path::Path, dir: &std::path::Path, policy: &str) -> serde_json::Value {
    support::kvtierd_bin();
    let out = Command::new(support::bin("kvtier-tools", "kvtier"))
        .args(["bench", "replay", "--trace"])
        .arg(trace)
        .args(["--block-size", "64KiB", "--capacity-fraction", "0.1"])
        .args(["--policy", policy, "--json", "--dir"])
        .arg(dir)
        .output()
        .unwrap();
    support::json_stdout(&out)
}

/// Only quotients end in `_vs_baseline`; with `siblings`, each has its
/// measured value and baseline beside it (as `common::compare` writes).
fn check_contract(v: &serde_json::Value, path: &str, siblings: bool) {
    if let Some(o) = v.as_object() {
        for (k, x) in o {
            assert!(
                !k.contains("vs_baseline") || k.ends_with("_vs_baseline"),
                "{path}.{k}"
            );
            if let Some(base) = k.strip_suffix("_vs_baseline") {
                assert!(x.is_number(), "{path}.{k}");
                assert!(
                    !siblings
                        || (o.contains_key(base) && o.contains_key(&format!("{base}_baseline"))),
                    "{path}.{k} without its measured value and baseline"
                );
            }
            check_contract(x, &format!("{path}.{k}"), siblings);
        }
    }
}

#[test]
fn real_daemon_replay_matches_the_dry_run_and_verifies_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.jsonl");
    std::fs::write(&trace, synthetic_trace(150, false)).unwrap();

    let t = std::time::Instant::now();
    let j = replay(&trace, dir.path(), "lru");
    eprintln!("lru replay took {:?}", t.elapsed());
    check_contract(&j, "", false);
    let d = &j["daemon"];
    check_contract(d, "daemon", true);
    eprintln!("lru: {d}");
    assert_eq!(d["target"], "kvtierd");
    assert_eq!(d["backend"], "g3", "G3 only: no G4, no peers");
    // Exactly the kvtierd dry run's hits, request by request: same policy
    // code, same event order, eviction only when full (see
    // replay_daemon.rs).
    assert!(j["hit_blocks"].as_u64().unwrap() > 0);
    assert_eq!(d["hit_blocks"], d["hit_blocks_dry_run"], "{d}");
    assert_eq!(d["requests_with_other_hits"], 0, "{d}");
    assert_eq!(d["hit_blocks_dry_run_g3_ids"], d["hit_blocks"]);
    assert_eq!(d["requests_with_other_hits_g3_ids"], 0);
    assert_eq!(d["hit_ratio_diff"].as_f64().unwrap(), 0.0);
    assert_eq!(
        d["capacity_used_blocks"], d["capacity_used_blocks_dry_run"],
        "{d}"
    );
    assert_eq!(d["capacity_used_blocks"], j["capacity_blocks"]);
    // The capacity was under pressure, so eviction order mattered.
    assert!(d["evictions"].as_u64().unwrap() > 0, "{d}");
    // Every onboarded block was compared with the bytes offloaded for it.
    assert_eq!(d["verified_blocks"], d["hit_blocks"]);
    assert_eq!(d["onboard_misses"], 0);
    // What the daemon did not hit, it stored (its own hits: the
    // top-level simulation's lru is not kvtierd's leaves-first one).
    assert_eq!(
        d["stored_blocks"].as_u64().unwrap(),
        j["requested_blocks"].as_u64().unwrap()
            - d["hit_blocks"].as_u64().unwrap()
            - d["already_present_blocks"].as_u64().unwrap()
    );
    for k in [
        "hit_ratio_baseline",
        "hit_ratio_vs_baseline",
        "onboard_gbps",
        "onboard_gbps_baseline",
        "onboard_gbps_vs_baseline",
        "offload_gbps",
        "offload_gbps_vs_baseline",
        "requests_per_s",
        "blocks_per_s",
        "lookup_p99_us",
        "onboard_request_p50_us",
        "onboard_request_p99_us",
        "onboard_per_block_p50_us",
        "offload_request_p50_us",
        "offload_request_p99_us",
        "ttft_mean_ms_measured_load",
    ] {
        assert!(d[k].is_number(), "missing {k} in {d}");
    }
    assert!(d["onboard_gbps"].as_f64().unwrap() > 0.0);
    // The daemon's data dir is gone with the daemon.
    let data = d["data_dir"].as_str().unwrap();
    assert!(!std::path::Path::new(data).exists(), "{data} left behind");

    // The default policy breaks score ties by block id, and the daemon's
    // policy sees G3 index ids instead of trace ids: its hits may differ
    // from the dry run over trace ids (by a few blocks), but
    // must equal, request by request, the dry run over the same G3 ids.
    let j = replay(&trace, dir.path(), "default");
    let d = &j["daemon"];
    assert_eq!(d["policy"], "default");
    assert_eq!(d["hit_blocks"], d["hit_blocks_dry_run_g3_ids"], "{d}");
    assert_eq!(d["requests_with_other_hits_g3_ids"], 0, "{d}");
    assert_eq!(d["verified_blocks"], d["hit_blocks"]);
    assert_eq!(d["onboard_misses"], 0);
    eprintln!(
        "default: daemon {} hit blocks, dry run {}",
        d["hit_blocks"], j["hit_blocks"]
    );
    let plain_dry_hits = j["hit_blocks"].clone();

    // A trace with engine hints: each block's hints travel with its
    // offload, so the daemon's policy decides as the hinted dry run does.
    let hinted = dir.path().join("hinted.jsonl");
    std::fs::write(&hinted, synthetic_trace(150, true)).unwrap();
    let j = replay(&hinted, dir.path(), "default");
    let d = &j["daemon"];
    // The hints change what the policy keeps on this trace (else this
    // check could not tell hints sent from hints dropped).
    assert_ne!(j["hit_blocks"], plain_dry_hits, "{j}");
    assert_eq!(d["hit_blocks"], d["hit_blocks_dry_run_g3_ids"], "{d}");
    assert_eq!(d["requests_with_other_hits_g3_ids"], 0, "{d}");
    assert_eq!(d["verified_blocks"], d["hit_blocks"]);
}
