#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `kvtier bench g3` runs at a tiny size and keeps the `--json` contract.
//! Never asserts a speed.

#[test]
fn bench_g3_tiny_json_contract() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "bench",
            "g3",
            "--block-size",
            "64KiB",
            "--blocks",
            "8",
            "--depth",
            "2",
        ])
        .args([
            "--rounds",
            "1",
            "--lookup-blocks",
            "1000",
            "--recovery-blocks",
            "20",
            "--pool-blocks",
            "16",
            // The 1 M default fills redb for a minute in a debug build.
            "--clean-restart-blocks",
            "1000",
            "--json",
        ])
        .arg("--dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let size = &v["sizes"][0];
    for k in ["write_gbps", "read_gbps"] {
        assert!(size[k].is_number());
        assert!(size[format!("{k}_baseline")].is_number());
        assert!(size[format!("{k}_vs_baseline")].is_number());
    }
    assert!(v["lookup"]["lookup_p99_us"].is_number());
    assert!(v["recovery"]["recovery_ms"].is_number());
    let pool = &v["pool_restart"];
    assert_eq!(pool["unsettled_pooled_before_crash"], 16, "{pool}");
    // Each pooled file is put back or, settled by the reclaimer first,
    // kept as room.
    assert_eq!(
        pool["unsettled_put_back"].as_u64().unwrap()
            + pool["unsettled_pooled_after_open"].as_u64().unwrap(),
        16,
        "{pool}"
    );
    // One of the 16 settled files took the extra put.
    assert_eq!(pool["settled_pooled_before_crash"], 15, "{pool}");
    assert_eq!(pool["settled_pooled_after_open"], 15, "{pool}");
    assert_eq!(pool["crash_restart_walked"], true, "{pool}");
    assert!(pool["settled_crash_restart_ms"].is_number());
    fn check(v: &serde_json::Value, path: &str) {
        if let Some(o) = v.as_object() {
            for (k, x) in o {
                if k.ends_with("_vs_baseline") {
                    let base = k.trim_end_matches("_vs_baseline");
                    assert!(
                        o.contains_key(base) && o.contains_key(&format!("{base}_baseline")),
                        "{path}.{k}"
                    );
                }
                check(x, &format!("{path}.{k}"));
            }
        } else if let Some(a) = v.as_array() {
            for x in a {
                check(x, path);
            }
        }
    }
    check(&v, "");
}
