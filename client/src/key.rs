//! Block identity: keys and the two sequence-hash schemes.
//!
//! A key names a block and, through chaining, the whole prefix up to and
//! including it. Three kinds exist: the default 256-bit blake3 chain, the
//! 64-bit Dynamo-compatible chain, and opaque engine-supplied keys (1 to 64
//! bytes). All three are stored and compared as their raw bytes; the hex form
//! is the name on disk, in the object store and in the mount.

use crate::error::{Error, Result};
use crate::namespace::Namespace;
use std::fmt;

/// Longest key accepted, in bytes (128 hex digits).
pub const KEY_BYTES_MAX: usize = 64;

/// Domain separator of the default sequence hash (see docs/FORMAT.md).
const SEQ_DOMAIN: &[u8; 16] = b"kvtier.seq.v1\0\0\0";

/// A block key: 1 to 64 raw bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey {
    len: u8,
    bytes: [u8; KEY_BYTES_MAX],
}

impl BlockKey {
    /// A key from raw bytes (1..=64 of them).
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        if b.is_empty() || b.len() > KEY_BYTES_MAX {
            return Err(Error::InvalidKey {
                input: hex_prefix(b),
                reason: "a key is 1 to 64 bytes",
            });
        }
        let mut bytes = [0u8; KEY_BYTES_MAX];
        bytes[..b.len()].copy_from_slice(b);
        Ok(BlockKey {
            len: b.len() as u8,
            bytes,
        })
    }

    /// A key from a 256-bit digest.
    pub fn from_digest(d: [u8; 32]) -> Self {
        let mut bytes = [0u8; KEY_BYTES_MAX];
        bytes[..32].copy_from_slice(&d);
        BlockKey { len: 32, bytes }
    }

    /// A Dynamo sequence hash, stored big-endian so that its hex form is the
    /// usual 16-digit rendering of the u64.
    pub fn from_u64(v: u64) -> Self {
        let mut bytes = [0u8; KEY_BYTES_MAX];
        bytes[..8].copy_from_slice(&v.to_be_bytes());
        BlockKey { len: 8, bytes }
    }

    /// Parses a lowercase or uppercase hex string of 2 to 128 digits.
    /// Anything else (odd length, non-hex, path characters) is refused, which
    /// makes the hex form safe to use as a file name.
    pub fn from_hex(s: &str) -> Result<Self> {
        let raw = s.as_bytes();
        let bad = |reason| Error::InvalidKey {
            input: s.chars().take(140).collect(),
            reason,
        };
        if raw.is_empty() || raw.len() > KEY_BYTES_MAX * 2 {
            return Err(bad("a key is 2 to 128 hex digits"));
        }
        if !raw.len().is_multiple_of(2) {
            return Err(bad("odd number of hex digits"));
        }
        let mut bytes = [0u8; KEY_BYTES_MAX];
        for (i, pair) in raw.chunks_exact(2).enumerate() {
            let hi = hex_val(pair[0]).ok_or_else(|| bad("not a hex digit"))?;
            let lo = hex_val(pair[1]).ok_or_else(|| bad("not a hex digit"))?;
            bytes[i] = hi << 4 | lo;
        }
        Ok(BlockKey {
            len: (raw.len() / 2) as u8,
            bytes,
        })
    }

    /// The raw key bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    /// Length in bytes.
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// Lowercase hex: the block's file and object name.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(self.len() * 2);
        for b in self.as_bytes() {
            s.push(HEX[(b >> 4) as usize] as char);
            s.push(HEX[(b & 15) as usize] as char);
        }
        s
    }

    /// The fan-out directory: the first key byte as two hex digits.
    pub fn shard(&self) -> String {
        let b = self.bytes[0];
        let mut s = String::with_capacity(2);
        s.push(HEX[(b >> 4) as usize] as char);
        s.push(HEX[(b & 15) as usize] as char);
        s
    }

    /// For a Dynamo (8-byte) key, the u64 it encodes.
    pub fn as_u64(&self) -> Option<u64> {
        (self.len == 8).then(|| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&self.bytes[..8]);
            u64::from_be_bytes(b)
        })
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({})", self.to_hex())
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl std::str::FromStr for BlockKey {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        BlockKey::from_hex(s)
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

fn hex_prefix(b: &[u8]) -> String {
    b.iter().take(70).map(|x| format!("{x:02x}")).collect()
}

/// How the keys of a namespace are made. Recorded in the namespace's
/// identity (docs/FORMAT.md) unless it is the default, so a namespace of one
/// scheme never names a block of another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HashMode {
    /// 256-bit blake3 chain bound to the namespace digest (the default).
    #[default]
    Blake3,
    /// NVIDIA Dynamo's 64-bit sequence hashes, computed by Dynamo's own
    /// `dynamo-kv-hashing` crate at the version in [`DYNAMO_SCHEME`].
    Dynamo,
    /// Keys chosen by the engine (e.g. vLLM's block hashes); kvtier computes
    /// none and `hash_chain` returns no keys.
    Opaque,
}

impl HashMode {
    /// `blake3`, `dynamo` or `opaque`.
    pub fn as_str(self) -> &'static str {
        match self {
            HashMode::Blake3 => "blake3",
            HashMode::Dynamo => "dynamo",
            HashMode::Opaque => "opaque",
        }
    }

    /// Parses [`HashMode::as_str`]'s spellings.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "blake3" => HashMode::Blake3,
            "dynamo" => HashMode::Dynamo,
            "opaque" => HashMode::Opaque,
            _ => return None,
        })
    }

    /// The scheme recorded in the namespace encoding; `None` for the default,
    /// whose encoding predates the field and must not change.
    pub fn scheme(self) -> Option<&'static str> {
        match self {
            HashMode::Blake3 => None,
            HashMode::Dynamo => Some(DYNAMO_SCHEME),
            HashMode::Opaque => Some("opaque"),
        }
    }
}

/// The Dynamo identity this build's dynamo mode follows, as recorded in a
/// dynamo-mode namespace. A build pinned to another Dynamo version records
/// another string, and so another namespace id: keys of two versions never mix.
pub const DYNAMO_SCHEME: &str = "dynamo-kv-hashing/1.6.1";

/// Default chain: key[i] = blake3(domain || namespace digest || key[i-1] ||
/// tokens of block i as u32 LE), with key[-1] = 32 zero bytes. A trailing
/// partial block is ignored.
pub fn blake3_chain(ns: &Namespace, tokens: &[u32]) -> Vec<BlockKey> {
    blake3_chain_after(ns, [0u8; 32], tokens)
}

/// The default chain continued after the block whose key is `parent` (its
/// 32 raw bytes): the keys [`blake3_chain`] gives the blocks of `tokens`
/// when they follow that block's prefix. `[0; 32]` starts a chain.
pub fn blake3_chain_after(ns: &Namespace, parent: [u8; 32], tokens: &[u32]) -> Vec<BlockKey> {
    let per = ns.layout.tokens_per_block as usize;
    if per == 0 {
        return Vec::new();
    }
    let digest = ns.digest();
    let mut parent = parent;
    let mut out = Vec::with_capacity(tokens.len() / per);
    for block in tokens.chunks_exact(per) {
        let mut h = blake3::Hasher::new();
        h.update(SEQ_DOMAIN);
        h.update(&digest);
        h.update(&parent);
        for t in block {
            h.update(&t.to_le_bytes());
        }
        parent = *h.finalize().as_bytes();
        out.push(BlockKey::from_digest(parent));
    }
    out
}

/// One full block of a Dynamo chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DynamoBlock {
    /// Dynamo's `SequenceHash`: the block's kvtier key (as [`BlockKey::from_u64`]).
    pub sequence_hash: u64,
    /// Dynamo's block hash of this block's tokens alone (the router's
    /// `LocalBlockHash`, `tokens_hash` in its events).
    pub tokens_hash: u64,
}

/// Dynamo's salt hash for `(salt, lora)`; empty strings mean none, as in
/// Dynamo.
pub fn dynamo_salt_hash(salt: &str, lora: &str) -> Result<u64> {
    dynamo_kv_hashing::compute_salt_hash(Some(salt), Some(lora)).map_err(dynamo_err)
}

fn dynamo_err(e: dynamo_kv_hashing::KvHashingError) -> Error {
    Error::InvalidNamespace {
        field: "dynamo",
        reason: e.to_string(),
    }
}

/// Every full block of `tokens` as Dynamo computes it: Dynamo's salt is
/// `salt`, its LoRA name `lora` (empty meaning none). A trailing partial block
/// is ignored.
pub fn dynamo_blocks(
    salt: &str,
    lora: &str,
    block_tokens: u32,
    tokens: &[u32],
) -> Result<Vec<DynamoBlock>> {
    dynamo_blocks_after(salt, lora, block_tokens, None, tokens)
}

/// [`dynamo_blocks`] of `tokens` when they follow the block whose sequence
/// hash is `parent`: what Dynamo gives these blocks when it hashes the
/// whole token list. A block's tokens hash depends on its tokens and the
/// salt only; its sequence hash is Dynamo's chain step
/// (`compute_next_sequence_hash`, the recurrence Dynamo's router and
/// indexer use) from the parent's.
pub fn dynamo_blocks_after(
    salt: &str,
    lora: &str,
    block_tokens: u32,
    parent: Option<u64>,
    tokens: &[u32],
) -> Result<Vec<DynamoBlock>> {
    let mut blocks = dynamo_blocks_fresh(salt, lora, block_tokens, tokens)?;
    if let Some(mut prev) = parent {
        for b in &mut blocks {
            b.sequence_hash = dynamo_tokens::compute_next_sequence_hash(prev, b.tokens_hash);
            prev = b.sequence_hash;
        }
    }
    Ok(blocks)
}

fn dynamo_blocks_fresh(
    salt: &str,
    lora: &str,
    block_tokens: u32,
    tokens: &[u32],
) -> Result<Vec<DynamoBlock>> {
    if block_tokens == 0 {
        return Err(Error::InvalidNamespace {
            field: "tokens_per_block",
            reason: "must be at least 1".into(),
        });
    }
    let req = dynamo_kv_hashing::Request::builder()
        .tokens(tokens.to_vec())
        .salt(Some(salt.to_string()))
        .lora_name(Some(lora.to_string()))
        .build()
        .map_err(dynamo_err)?;
    Ok(req
        .into_blocks(block_tokens)
        .map_err(dynamo_err)?
        .into_iter()
        .map(|b| DynamoBlock {
            sequence_hash: b.sequence_hash(),
            tokens_hash: b.block_hash,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_refusals() {
        let k = BlockKey::from_hex("00ABcd").unwrap();
        assert_eq!(k.to_hex(), "00abcd");
        assert_eq!(k.shard(), "00");
        for bad in ["", "a", "zz", "../x", "ab/cd", "ab\0c", &"a".repeat(130)] {
            assert!(BlockKey::from_hex(bad).is_err(), "{bad:?} accepted");
        }
        assert!(BlockKey::from_hex(&"ab".repeat(64)).is_ok());
    }

    #[test]
    fn u64_keys_render_big_endian() {
        let k = BlockKey::from_u64(0x0123_4567_89ab_cdef);
        assert_eq!(k.to_hex(), "0123456789abcdef");
        assert_eq!(k.as_u64(), Some(0x0123_4567_89ab_cdef));
    }
}
