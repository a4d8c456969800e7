#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `kvtier hash` and `kvtier inspect` through the real binary.

use std::process::Command;

fn kvtier() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
}

#[test]
fn hash_dynamo_matches_python_vectors() {
    let v: serde_json::Value =
        serde_json::from_str(include_str!("../../client/tests/data/dynamo_vectors.json")).unwrap();
    let mut checked = 0;
    for c in v["cases"].as_array().unwrap().iter().take(12) {
        let tokens: Vec<String> = c["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.to_string())
            .collect();
        if tokens.is_empty() {
            continue;
        }
        let out = kvtier()
            .args(["hash", "--mode", "dynamo", "--salt"])
            .arg(c["salt"].as_str().unwrap())
            .arg("--block-tokens")
            .arg(c["block_tokens"].to_string())
            .arg("--tokens")
            .arg(tokens.join(","))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got: Vec<String> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect();
        let want: Vec<String> = c["seq_hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect();
        assert_eq!(got, want);
        checked += 1;
    }
    assert!(checked >= 8);
}

#[test]
fn hash_blake3_prints_one_64_digit_key_per_full_block() {
    let out = kvtier()
        .args(["hash", "--block-tokens", "2", "--tokens", "1,2,3,4,5"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let s = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = s.lines().collect();
    assert_eq!(lines.len(), 2, "trailing partial block must not be hashed");
    assert!(lines
        .iter()
        .all(|l| l.len() == 64 && l.bytes().all(|b| b.is_ascii_hexdigit())));
}

#[test]
fn inspect_accepts_valid_and_rejects_damaged_files() {
    use kvtier_client::{block, BlockKey, KvLayout, Namespace};
    let dir = tempfile::tempdir().unwrap();
    let ns = Namespace::new(
        "m",
        KvLayout::with_block_bytes(8192).unwrap(),
        "",
        b"s".to_vec(),
    )
    .unwrap();
    let payload = vec![7u8; 8192];
    let h = block::BlockHeader::for_payload(&ns, BlockKey::from_digest([1; 32]), &payload, 5);
    let good = block::encode_block(&h, &payload);
    let path = dir.path().join("blk");
    std::fs::write(&path, &good).unwrap();
    let out = kvtier()
        .arg("inspect")
        .arg(&path)
        .arg("--json")
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["payload_len"], 8192);
    assert_eq!(v["key"], BlockKey::from_digest([1; 32]).to_hex());

    let mut bad = good.clone();
    bad[block::HEADER_BYTES + 10] ^= 0xff;
    std::fs::write(&path, &bad).unwrap();
    let out = kvtier().arg("inspect").arg(&path).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("PayloadChecksum"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one-line reason: {err}");
}
