//! Proof 1 of issue #20: kvtier's dynamo mode is Dynamo's identity.
//!
//! The expected values come from dynamo-kv-router 1.6.1's request-side
//! functions (`compute_block_hash_for_seq`, `compute_seq_hash_for_block`),
//! computed here over random inputs; kvtier's client (`Namespace::hash_chain`,
//! `Namespace::dynamo_blocks`) and its CLI (`kvtier hash --mode dynamo`) must
//! agree bit for bit, with and without salt and LoRA name.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, compute_seq_hash_for_block, BlockHashOptions,
};
use kvtier_client::{HashMode, KvLayout, Namespace};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::process::Command;

/// One random case: tokens, salt, LoRA name, block size.
#[derive(Debug, Clone)]
struct Case {
    tokens: Vec<u32>,
    salt: String,
    lora: String,
    block: u32,
}

fn random_string(rng: &mut StdRng) -> String {
    match rng.random_range(0..6) {
        0 => String::new(),
        1 => "tenant-a".into(),
        4 => format!("-x{}", rng.random::<u16>()),
        // Past the old 256-byte namespace bound: Dynamo takes any length.
        5 => "long-salt/".repeat(rng.random_range(26..200)),
        2 => (0..rng.random_range(1..24))
            .map(|_| rng.random_range(b'a'..=b'z') as char)
            .collect(),
        _ => format!("sålt/{}:ünï", rng.random::<u32>()),
    }
}

fn random_case(rng: &mut StdRng) -> Case {
    let block = [1u32, 2, 4, 16, 32, 64, rng.random_range(1..100)][rng.random_range(0..7)];
    let n = rng.random_range(0..(block as usize * 6 + 3));
    let tokens = (0..n)
        .map(|_| {
            if rng.random_bool(0.1) {
                u32::MAX - rng.random_range(0..4)
            } else {
                rng.random_range(0..200_000)
            }
        })
        .collect();
    Case {
        tokens,
        salt: random_string(rng),
        lora: random_string(rng),
        block,
    }
}

/// Dynamo's answer: (sequence hash, tokens hash) per full block. Empty
/// strings are passed as `Some("")` half of the time: Dynamo treats them as
/// absent, and so must kvtier.
fn dynamo(c: &Case, empty_as_some: bool) -> Vec<(u64, u64)> {
    let opt = |s: &str| -> Option<String> {
        if s.is_empty() && !empty_as_some {
            None
        } else {
            Some(s.to_string())
        }
    };
    let (salt, lora) = (opt(&c.salt), opt(&c.lora));
    let locals = compute_block_hash_for_seq(
        &c.tokens,
        c.block,
        BlockHashOptions {
            cache_namespace: salt.as_deref(),
            lora_name: lora.as_deref(),
            ..Default::default()
        },
    );
    let seqs = compute_seq_hash_for_block(&locals);
    seqs.into_iter()
        .zip(locals)
        .map(|(s, l)| (s, l.0))
        .collect()
}

fn kvtier_ns(c: &Case) -> Namespace {
    Namespace::new(
        "oracle-model",
        KvLayout::llama3_8b(c.block),
        c.lora.clone(),
        c.salt.clone().into_bytes(),
    )
    .unwrap()
    .with_hash_mode(HashMode::Dynamo)
    .unwrap()
}

#[test]
fn client_matches_dynamo_on_random_inputs() {
    let mut rng = StdRng::seed_from_u64(0x0d1a_2026);
    let mut blocks_checked = 0usize;
    for i in 0..2000 {
        let c = random_case(&mut rng);
        let want = dynamo(&c, i % 2 == 0);
        let ns = kvtier_ns(&c);
        let chain: Vec<u64> = ns
            .hash_chain(&c.tokens)
            .iter()
            .map(|k| k.as_u64().expect("dynamo keys are 8 bytes"))
            .collect();
        let blocks = ns.dynamo_blocks(&c.tokens).unwrap();
        let got: Vec<(u64, u64)> = blocks
            .iter()
            .map(|b| (b.sequence_hash, b.tokens_hash))
            .collect();
        assert_eq!(got, want, "dynamo_blocks differs from Dynamo for {c:?}");
        let want_seq: Vec<u64> = want.iter().map(|w| w.0).collect();
        assert_eq!(chain, want_seq, "hash_chain differs from Dynamo for {c:?}");
        blocks_checked += want.len();
    }
    // The sample must exercise long chains, not just empty inputs.
    assert!(blocks_checked > 5000, "{blocks_checked} blocks checked");
}

#[test]
fn empty_salt_and_lora_mean_none_as_in_dynamo() {
    let tokens: Vec<u32> = (1..=8).collect();
    let none = compute_seq_hash_for_block(&compute_block_hash_for_seq(
        &tokens,
        4,
        BlockHashOptions::default(),
    ));
    let c = Case {
        tokens,
        salt: String::new(),
        lora: String::new(),
        block: 4,
    };
    assert_eq!(
        dynamo(&c, true).iter().map(|w| w.0).collect::<Vec<_>>(),
        none
    );
    let got: Vec<u64> = kvtier_ns(&c)
        .hash_chain(&c.tokens)
        .iter()
        .map(|k| k.as_u64().unwrap())
        .collect();
    assert_eq!(got, none);
}

fn cli(c: &Case) -> serde_json::Value {
    let csv: Vec<String> = c.tokens.iter().map(|t| t.to_string()).collect();
    let out = Command::new(common::bin("kvtier"))
        .args(["hash", "--mode", "dynamo", "--json"])
        // Separate values, as people type them: a salt such as `-x` and
        // an empty token list must be taken (issue 27).
        .arg("--salt")
        .arg(&c.salt)
        .arg("--lora")
        .arg(&c.lora)
        .arg(format!("--block-tokens={}", c.block))
        .arg("--tokens")
        .arg(csv.join(","))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kvtier hash failed for {c:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn cli_matches_dynamo_on_random_inputs() {
    let mut rng = StdRng::seed_from_u64(0xc11_2026);
    let mut blocks_checked = 0usize;
    // Each case is a process start: fewer than the client test, same spread.
    for _ in 0..120 {
        let c = random_case(&mut rng);
        let want = dynamo(&c, false);
        let j = cli(&c);
        assert_eq!(j["mode"], "dynamo");
        let blocks = j["blocks"].as_array().unwrap();
        assert_eq!(blocks.len(), want.len(), "{c:?}");
        for (b, (seq, tok)) in blocks.iter().zip(&want) {
            assert_eq!(b["sequence_hash"], format!("{seq:016x}"), "{c:?}");
            assert_eq!(b["sequence_hash_u64"].as_u64(), Some(*seq), "{c:?}");
            assert_eq!(b["tokens_hash"].as_u64(), Some(*tok), "{c:?}");
        }
        blocks_checked += want.len();
    }
    assert!(blocks_checked > 200, "{blocks_checked} blocks checked");
    // The plain form: one 16-hex-digit sequence hash per full block.
    let c = Case {
        tokens: (1..=8).collect(),
        salt: "s".into(),
        lora: "adapter".into(),
        block: 4,
    };
    let out = Command::new(common::bin("kvtier"))
        .args(["hash", "--mode", "dynamo", "--salt=s", "--lora=adapter"])
        .args(["--block-tokens=4", "--tokens=1,2,3,4,5,6,7,8"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let lines: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    let want: Vec<String> = dynamo(&c, false)
        .iter()
        .map(|w| format!("{:016x}", w.0))
        .collect();
    assert_eq!(lines, want);
}

/// `kvtier hash` takes what Dynamo takes: no tokens (zero blocks), a salt
/// and LoRA name starting with `-`, and `--parent` continues a chain
/// exactly as Dynamo hashes the whole list (issue 27).
#[test]
fn cli_takes_empty_tokens_dash_salts_and_a_parent() {
    let empty = Case {
        tokens: Vec::new(),
        salt: "-x".into(),
        lora: "--lora-ish".into(),
        block: 16,
    };
    let j = cli(&empty);
    assert_eq!(j["blocks"].as_array().unwrap().len(), 0);

    let c = Case {
        tokens: (60_000..60_064).collect(),
        salt: "-tenant".into(),
        lora: String::new(),
        block: 16,
    };
    let want = dynamo(&c, false);
    let first: Vec<String> = c.tokens[..32].iter().map(|t| t.to_string()).collect();
    let second: Vec<String> = c.tokens[32..].iter().map(|t| t.to_string()).collect();
    let run = |tokens: &[String], parent: Option<u64>| -> Vec<String> {
        let mut cmd = Command::new(common::bin("kvtier"));
        cmd.args(["hash", "--mode", "dynamo", "--salt", "-tenant"])
            .args(["--block-tokens", "16", "--tokens"])
            .arg(tokens.join(","));
        if let Some(p) = parent {
            cmd.arg("--parent").arg(format!("{p:016x}"));
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    };
    let mut got = run(&first, None);
    got.extend(run(&second, Some(want[1].0)));
    let want_hex: Vec<String> = want.iter().map(|w| format!("{:016x}", w.0)).collect();
    assert_eq!(got, want_hex);
}
