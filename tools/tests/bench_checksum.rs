#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `kvtier bench checksum` runs at a tiny size and keeps the `--json`
//! contract. Never asserts a speed.

#[test]
fn bench_checksum_tiny_json_contract() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["bench", "checksum", "--sizes", "64KiB,1MiB"])
        .args(["--bytes-per-round", "4MiB", "--rounds", "2", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["sizes"].as_array().unwrap().len(), 2, "{v}");
    for size in v["sizes"].as_array().unwrap() {
        for k in ["xxh3_128_gbps", "blake3_gbps", "copy_verify_gbps"] {
            assert!(size[k].as_f64().unwrap() > 0.0, "{k}: {size}");
            assert!(size[format!("{k}_baseline")].as_f64().unwrap() > 0.0);
            assert!(size[format!("{k}_vs_baseline")].is_number());
        }
        assert!(size["xxh3_128_cpu_s_per_gb"].as_f64().unwrap() > 0.0);
    }
}
