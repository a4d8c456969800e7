#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `kvtier bench fs` runs at a tiny size and keeps the `--json` contract.
//! Never asserts a speed. Needs root and /dev/fuse (it mounts).

#[test]
fn bench_fs_tiny_json_contract() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let dev = std::path::Path::new("/dev/fuse").exists();
    if !root || !dev {
        eprintln!("SKIP: bench_fs_tiny_json_contract: needs root and /dev/fuse (root={root}, /dev/fuse={dev})");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["bench", "fs", "--block-size", "64KiB", "--blocks", "4"])
        .args(["--rounds", "1", "--json", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["bench"], "fs");
    assert!(v["cold"].is_boolean());
    assert!(v["daemon"].as_str().unwrap().contains("library"));
    let variants = v["variants"].as_array().unwrap();
    let names: Vec<&str> = variants
        .iter()
        .map(|x| x["variant"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "passthrough_verify_on_open",
            "passthrough_no_verify",
            "fallback"
        ]
    );
    for x in variants {
        for k in ["read_gbps", "read_gbps_baseline", "read_gbps_vs_baseline"] {
            assert!(x[k].as_f64().unwrap() > 0.0, "{k} in {x}");
        }
        assert_eq!(x["bytes_per_pass"], 4 * (65536 + 4096));
        // Only comparison quotients end in _vs_baseline.
        for k in x.as_object().unwrap().keys() {
            if k.ends_with("_vs_baseline") {
                assert_eq!(k, "read_gbps_vs_baseline");
            }
        }
    }
    assert_eq!(variants[2]["passthrough_active"], false);
    assert!(variants[2]["fallback_opens"].as_u64().unwrap() >= 4);
    assert!(!dir.path().join("kvtier-bench-fs").exists());
}
