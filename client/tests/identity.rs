#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Block identity: Dynamo compatibility against independent vectors, and the
//! properties of the default blake3 chain.

use kvtier_client::key::{dynamo_chain, dynamo_salt_hash};
use kvtier_client::{Dtype, HashMode, KvLayout, LayoutKind, Namespace};

#[derive(serde::Deserialize)]
struct Vectors {
    cases: Vec<Case>,
}
#[derive(serde::Deserialize)]
struct Case {
    salt: String,
    block_tokens: usize,
    tokens: Vec<u32>,
    salt_hash: String,
    seq_hashes: Vec<String>,
}

/// Vectors computed by Python's `xxhash` (data/gen_dynamo_vectors.py), an
/// implementation independent of the one under test.
#[test]
fn dynamo_mode_matches_python_xxhash_vectors() {
    let v: Vectors =
        serde_json::from_str(include_str!("data/dynamo_vectors.json")).expect("vectors parse");
    assert!(v.cases.len() >= 30);
    for (i, c) in v.cases.iter().enumerate() {
        assert_eq!(
            format!("{:016x}", dynamo_salt_hash(c.salt.as_bytes())),
            c.salt_hash,
            "case {i} salt hash"
        );
        let got: Vec<String> = dynamo_chain(c.salt.as_bytes(), c.block_tokens, &c.tokens)
            .iter()
            .map(|h| format!("{h:016x}"))
            .collect();
        assert_eq!(got, c.seq_hashes, "case {i}");
        // Through the namespace API too: keys render as the u64 in hex.
        let layout = KvLayout {
            tokens_per_block: c.block_tokens as u32,
            ..KvLayout::llama3_8b(16)
        };
        let ns = Namespace::new("m", layout, "", c.salt.as_bytes().to_vec()).unwrap();
        let keys: Vec<String> = ns
            .hash_chain(HashMode::Dynamo, &c.tokens)
            .iter()
            .map(|k| k.to_hex())
            .collect();
        assert_eq!(keys, c.seq_hashes, "case {i} via Namespace");
    }
}

fn ns_with(model: &str, layout: KvLayout, adapter: &str, salt: &str) -> Namespace {
    Namespace::new(model, layout, adapter, salt.as_bytes().to_vec()).unwrap()
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed))
        .collect()
}

#[test]
fn default_chain_prefix_keys_do_not_depend_on_later_tokens() {
    let ns = ns_with("m", KvLayout::llama3_8b(16), "", "t");
    let base = tokens(16 * 8 + 5, 1);
    let keys = ns.hash_chain(HashMode::Blake3, &base);
    assert_eq!(keys.len(), 8, "a trailing partial block is never hashed");
    for k in 0..8 {
        let mut changed = base.clone();
        for t in changed.iter_mut().skip(16 * (k + 1)) {
            *t ^= 0xdead_beef;
        }
        let other = ns.hash_chain(HashMode::Blake3, &changed);
        assert_eq!(keys[..=k], other[..=k], "first {} keys moved", k + 1);
        if k + 1 < 8 {
            assert_ne!(keys[k + 1], other[k + 1]);
        }
    }
    // Changing one token of block 0 changes every key after it (chaining).
    let mut first = base.clone();
    first[3] += 1;
    let other = ns.hash_chain(HashMode::Blake3, &first);
    assert!(keys.iter().zip(&other).all(|(a, b)| a != b));
    assert!(keys.iter().all(|k| k.len() == 32));
}

#[test]
fn salt_model_adapter_or_layout_change_every_key() {
    let base = ns_with("m", KvLayout::llama3_8b(16), "", "t");
    let t = tokens(16 * 6, 7);
    let keys = base.hash_chain(HashMode::Blake3, &t);
    let mut variants = vec![
        ns_with("m", KvLayout::llama3_8b(16), "", "u"),
        ns_with("m2", KvLayout::llama3_8b(16), "", "t"),
        ns_with("m", KvLayout::llama3_8b(16), "lora-1", "t"),
    ];
    let l = KvLayout::llama3_8b(16);
    for changed in [
        KvLayout { layers: 31, ..l },
        KvLayout { kv_heads: 4, ..l },
        KvLayout { head_dim: 64, ..l },
        KvLayout {
            dtype: Dtype::F16,
            ..l
        },
        KvLayout {
            kind: LayoutKind::LayerSeparate,
            ..l
        },
    ] {
        variants.push(ns_with("m", changed, "", "t"));
    }
    for v in &variants {
        assert_ne!(v.digest(), base.digest());
        let other = v.hash_chain(HashMode::Blake3, &t);
        for (a, b) in keys.iter().zip(&other) {
            assert_ne!(a, b, "{v:?} shares a key with the base namespace");
        }
    }
}

#[test]
fn canonical_encoding_is_unambiguous() {
    // Length prefixes keep ("ab","c") and ("a","bc") apart.
    let a = ns_with("ab", KvLayout::llama3_8b(16), "c", "");
    let b = ns_with("a", KvLayout::llama3_8b(16), "bc", "");
    assert_ne!(a.canonical_bytes(), b.canonical_bytes());
}
