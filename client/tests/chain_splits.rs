#![allow(clippy::unwrap_used, clippy::expect_used)]
//! One definition of a chain: however a token list is split, hashing each
//! part after the last key of the part before (`hash_chain_after`, what
//! `offload_tokens(Some(parent), ..)` does) gives the keys of hashing the
//! whole list. Dynamo mode is judged by Dynamo's own crate hashing the whole
//! list (the request side: `Request::sequence_hashes`), not by kvtier's code.
//!
//! Cases: 256 per property here; `PROPTEST_CASES=20000 cargo test -p
//! kvtier-client --test chain_splits` for a longer run.

use kvtier_client::{BlockKey, HashMode, KvLayout, Namespace};
use proptest::prelude::*;

fn ns(mode: HashMode, block: u32, salt: &str, lora: &str) -> Namespace {
    Namespace::new(
        "m",
        KvLayout::llama3_8b(block),
        lora,
        salt.as_bytes().to_vec(),
    )
    .unwrap()
    .with_hash_mode(mode)
    .unwrap()
}

/// Cuts `tokens` at block boundaries: `cuts` are block counts, in any order.
fn parts(tokens: &[u32], block: usize, cuts: &[usize]) -> Vec<Vec<u32>> {
    let blocks = tokens.len() / block;
    let mut at: Vec<usize> = cuts.iter().map(|c| c % (blocks + 1)).collect();
    at.push(0);
    at.push(blocks);
    at.sort_unstable();
    at.dedup();
    let mut out: Vec<Vec<u32>> = at
        .windows(2)
        .map(|w| tokens[w[0] * block..w[1] * block].to_vec())
        .collect();
    // The trailing partial block rides with the last part: it has no key.
    if let Some(last) = out.last_mut() {
        last.extend_from_slice(&tokens[blocks * block..]);
    }
    out
}

fn split_keys(n: &Namespace, parts: &[Vec<u32>]) -> Vec<BlockKey> {
    let mut keys: Vec<BlockKey> = Vec::new();
    for p in parts {
        let after = keys.last().copied();
        keys.extend(n.hash_chain_after(after, p).unwrap());
    }
    keys
}

/// Dynamo's request for the whole list (the oracle).
fn dynamo_request(tokens: &[u32], salt: &str, lora: &str) -> dynamo_kv_hashing::Request {
    dynamo_kv_hashing::Request::builder()
        .tokens(tokens.to_vec())
        .salt((!salt.is_empty()).then(|| salt.to_string()))
        .lora_name((!lora.is_empty()).then(|| lora.to_string()))
        .build()
        .unwrap()
}

fn salt() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("tenant-a".to_string()),
        Just("-leading-dash".to_string()),
        "[a-zA-Z0-9/:åü-]{1,40}",
        // Longer than the old 256-byte bound: Dynamo takes any salt.
        "[a-z]{300,2000}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn dynamo_parts_have_dynamos_whole_list_keys(
        block in prop_oneof![Just(1u32), Just(4), Just(16), 1u32..40],
        tokens in proptest::collection::vec(any::<u32>(), 0..400),
        cuts in proptest::collection::vec(0usize..64, 0..6),
        salt in salt(),
        lora in prop_oneof![Just(String::new()), "[a-z0-9-]{1,20}"],
    ) {
        let n = ns(HashMode::Dynamo, block, &salt, &lora);
        let want = dynamo_request(&tokens, &salt, &lora)
            .sequence_hashes(block)
            .unwrap();
        let ps = parts(&tokens, block as usize, &cuts);
        let got: Vec<u64> = split_keys(&n, &ps).iter().map(|k| k.as_u64().unwrap()).collect();
        prop_assert_eq!(&got, &want);
        // The tokens hashes (the router's LocalBlockHash) agree too.
        let mut after = None;
        let mut tokens_hashes = Vec::new();
        for p in &ps {
            let bs = n.dynamo_blocks_after(after, p).unwrap();
            if let Some(b) = bs.last() {
                after = Some(BlockKey::from_u64(b.sequence_hash));
            }
            tokens_hashes.extend(bs.iter().map(|b| b.tokens_hash));
        }
        let want_tokens = dynamo_request(&tokens, &salt, &lora)
            .block_hashes(block)
            .unwrap();
        prop_assert_eq!(tokens_hashes, want_tokens);
    }

    #[test]
    fn blake3_parts_have_the_whole_list_keys(
        block in prop_oneof![Just(1u32), Just(16), 1u32..40],
        tokens in proptest::collection::vec(any::<u32>(), 0..400),
        cuts in proptest::collection::vec(0usize..64, 0..6),
        salt in salt(),
    ) {
        let n = ns(HashMode::Blake3, block, &salt, "");
        let want = n.hash_chain(&tokens);
        let got = split_keys(&n, &parts(&tokens, block as usize, &cuts));
        prop_assert_eq!(got, want);
    }
}

#[test]
fn the_issue_repro_continues_dynamos_chain() {
    // Issue 27: salt tenant-a, 16-token blocks, 60000..60063 offloaded as
    // two halves; the second half's keys were a fresh chain's
    // (5d0150872c8ba698, 35e1ea3bf53217ec), Dynamo's are these.
    let n = ns(HashMode::Dynamo, 16, "tenant-a", "");
    let first: Vec<u32> = (60000..60032).collect();
    let second: Vec<u32> = (60032..60064).collect();
    let k1 = n.hash_chain_after(None, &first).unwrap();
    let k2 = n.hash_chain_after(k1.last().copied(), &second).unwrap();
    let hex: Vec<String> = k2.iter().map(|k| k.to_hex()).collect();
    assert_eq!(hex, ["4f8d161111893a7a", "5a60160ec872c245"]);
}

#[test]
fn a_parent_of_the_wrong_mode_is_refused() {
    let toks: Vec<u32> = (0..32).collect();
    let d = ns(HashMode::Dynamo, 16, "", "");
    let b = ns(HashMode::Blake3, 16, "", "");
    let blake_key = b.hash_chain(&toks)[0];
    let dyn_key = d.hash_chain(&toks)[0];
    assert!(d.hash_chain_after(Some(blake_key), &toks).is_err());
    assert!(b.hash_chain_after(Some(dyn_key), &toks).is_err());
    // Opaque namespaces compute no keys, with or without a parent.
    let o = ns(HashMode::Opaque, 16, "", "");
    assert!(o.hash_chain_after(Some(dyn_key), &toks).unwrap().is_empty());
}

#[test]
fn names_beyond_256_bytes_are_taken_and_64_kib_is_the_bound() {
    let long = "s".repeat(4096);
    let n = ns(HashMode::Dynamo, 16, &long, &"l".repeat(1000));
    assert_eq!(n.hash_chain(&(0..32).collect::<Vec<u32>>()).len(), 2);
    let too_long = vec![b'x'; (64 << 10) + 1];
    assert!(Namespace::new("m", KvLayout::llama3_8b(16), "", too_long).is_err());
}
