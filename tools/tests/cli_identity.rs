#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `kvtier hash` and `kvtier inspect` through the real binary.

use std::process::Command;

fn kvtier() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
}

/// The CLI contract of dynamo mode. Bit-exactness with Dynamo's own code is
/// proven in tests/dynamo-oracle, which runs this binary too.
#[test]
fn hash_dynamo_cli_contract() {
    let run = |args: &[&str]| kvtier().args(args).output().unwrap();
    let out = run(&[
        "hash",
        "--mode",
        "dynamo",
        "--salt",
        "s",
        "--lora",
        "l",
        "--block-tokens",
        "4",
        "--tokens",
        "1,2,3,4,5,6,7,8,9",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(lines.len(), 2, "one line per full block: {lines:?}");
    for l in &lines {
        assert_eq!(l.len(), 16, "{l}");
        assert!(l.chars().all(|c| c.is_ascii_hexdigit()), "{l}");
    }
    let out = run(&[
        "hash",
        "--mode",
        "dynamo",
        "--salt",
        "s",
        "--lora",
        "l",
        "--block-tokens",
        "4",
        "--tokens",
        "1,2,3,4,5,6,7,8,9",
        "--json",
    ]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["scheme"], "dynamo-kv-hashing/1.6.1");
    let blocks = v["blocks"].as_array().unwrap();
    assert_eq!(blocks.len(), 2);
    assert_eq!(blocks[0]["sequence_hash"].as_str().unwrap(), lines[0]);
    assert!(blocks[1]["tokens_hash"].is_u64());
    assert!(blocks[1]["sequence_hash_u64"].is_u64());
    // An empty LoRA name means none, as in Dynamo.
    let a = run(&[
        "hash",
        "--mode",
        "dynamo",
        "--block-tokens",
        "2",
        "--tokens",
        "1,2",
    ]);
    let b = run(&[
        "hash",
        "--mode",
        "dynamo",
        "--lora",
        "",
        "--salt",
        "",
        "--block-tokens",
        "2",
        "--tokens",
        "1,2",
    ]);
    assert_eq!(a.stdout, b.stdout);
    // --lora belongs to dynamo mode only.
    let out = run(&[
        "hash",
        "--lora",
        "x",
        "--block-tokens",
        "2",
        "--tokens",
        "1,2",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--lora") && err.contains("dynamo"), "{err}");
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
    // --json answers for a damaged file too (it printed nothing), exit 1.
    let out = kvtier()
        .arg("inspect")
        .arg(&path)
        .arg("--json")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {:?}", String::from_utf8_lossy(&out.stdout)));
    assert_eq!(v["valid"], false);
    assert_eq!(v["fault"], "PayloadChecksum");
    assert!(v["error"].as_str().unwrap().contains("checksum"), "{v}");
}
