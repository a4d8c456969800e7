#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Block identity: Dynamo compatibility against independent vectors, and the
//! properties of the default blake3 chain.

use kvtier_client::{Dtype, HashMode, KvLayout, LayoutKind, Namespace};

/// Dynamo mode takes the namespace's salt and adapter as Dynamo's salt and
/// LoRA name. The bit-exactness proof against Dynamo's router code lives in
/// tests/dynamo-oracle (a crate with its own lock file); this checks only the
/// wiring between a namespace and the pinned crate.
#[test]
fn dynamo_mode_wires_salt_and_adapter_into_dynamo_crate() {
    let toks: Vec<u32> = (1..=40).collect();
    for (salt, lora) in [("", ""), ("tenant-a", ""), ("", "lora-x"), ("s", "l")] {
        let ns = Namespace::new("m", KvLayout::llama3_8b(4), lora, salt.as_bytes().to_vec())
            .unwrap()
            .with_hash_mode(HashMode::Dynamo)
            .unwrap();
        let want = dynamo_kv_hashing::Request::builder()
            .tokens(toks.clone())
            .salt((!salt.is_empty()).then(|| salt.to_string()))
            .lora_name((!lora.is_empty()).then(|| lora.to_string()))
            .build()
            .unwrap()
            .sequence_hashes(4)
            .unwrap();
        let got: Vec<u64> = ns
            .hash_chain(&toks)
            .iter()
            .map(|k| k.as_u64().unwrap())
            .collect();
        assert_eq!(got, want, "salt {salt:?} lora {lora:?}");
        assert_eq!(got.len(), 10);
        let blocks = ns.dynamo_blocks(&toks).unwrap();
        assert_eq!(blocks.len(), 10);
        // The model and layout (other than block size) do not enter Dynamo keys.
        let other = Namespace::new(
            "other",
            KvLayout::llama3_8b(4),
            lora,
            salt.as_bytes().to_vec(),
        )
        .unwrap()
        .with_hash_mode(HashMode::Dynamo)
        .unwrap();
        assert_eq!(other.hash_chain(&toks), ns.hash_chain(&toks));
        assert_ne!(other.id(), ns.id());
    }
    let blake = Namespace::new("m", KvLayout::llama3_8b(4), "", b"".to_vec()).unwrap();
    assert!(blake.dynamo_blocks(&toks).is_err());
    let opaque = blake.with_hash_mode(HashMode::Opaque).unwrap();
    assert!(opaque.hash_chain(&toks).is_empty());
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
    let keys = ns.hash_chain(&base);
    assert_eq!(keys.len(), 8, "a trailing partial block is never hashed");
    for k in 0..8 {
        let mut changed = base.clone();
        for t in changed.iter_mut().skip(16 * (k + 1)) {
            *t ^= 0xdead_beef;
        }
        let other = ns.hash_chain(&changed);
        assert_eq!(keys[..=k], other[..=k], "first {} keys moved", k + 1);
        if k + 1 < 8 {
            assert_ne!(keys[k + 1], other[k + 1]);
        }
    }
    // Changing one token of block 0 changes every key after it (chaining).
    let mut first = base.clone();
    first[3] += 1;
    let other = ns.hash_chain(&first);
    assert!(keys.iter().zip(&other).all(|(a, b)| a != b));
    assert!(keys.iter().all(|k| k.len() == 32));
}

#[test]
fn salt_model_adapter_or_layout_change_every_key() {
    let base = ns_with("m", KvLayout::llama3_8b(16), "", "t");
    let t = tokens(16 * 6, 7);
    let keys = base.hash_chain(&t);
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
        let other = v.hash_chain(&t);
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
