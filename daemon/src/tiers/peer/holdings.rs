//! Holdings digests: a compact, versioned Bloom filter of the
//! `(namespace, key)` pairs a node holds on G3, served by its peer server
//! (`GET /v1/holdings`, signed like block requests) and fetched by the
//! other nodes at `peer.holdings_refresh_ms`, so that a lookup can answer
//! "on peer X" from memory instead of a header probe per block.
//!
//! A digest is a hint, like a probe's answer: a false positive (about 1% at
//! 10 bits per block) or a block evicted since the digest was built makes
//! the later fetch a miss (the peer answers 404), never an error and never
//! wrong bytes (fetches verify). Sizes are bounded on both ends
//! (`holdings_bytes_max`): past it the filter keeps its size and its false
//! positive rate rises instead.
//!
//! Encoding (little-endian; see docs/FORMAT.md):
//!
//! | bytes | field |
//! |---|---|
//! | 4 | magic `KVHD` |
//! | 1 | version (1) |
//! | 1 | `k`, hash functions (1 to 16) |
//! | 2 | reserved, zero |
//! | 8 | built at, Unix ms |
//! | 8 | blocks inserted |
//! | 8 | `m`, filter bits (a multiple of 64, at least 64) |
//! | m/8 | the filter |
//! | 32 | blake3 of everything before it |
//!
//! Bit `i` of the filter is bit `i % 8` of byte `i / 8`. A pair's bits:
//! `h = blake3(ns (16 bytes) || key bytes)`, `h1` and `h2` its first two
//! little-endian u64 words (`h2 | 1`), bit `j` (`0 <= j < k`) is
//! `(h1 + j * h2) mod m`.

use kvtier_client::{BlockKey, NamespaceId};

/// Path the peer server answers with its digest.
pub const HOLDINGS_PATH: &str = "/v1/holdings";
/// Magic of the encoding.
pub const MAGIC: &[u8; 4] = b"KVHD";
/// The one version written and read.
pub const VERSION: u8 = 1;
/// Bytes before the filter.
pub const HEAD_BYTES: usize = 32;
/// Bytes after the filter.
pub const TAIL_BYTES: usize = 32;
/// Filter bits per block aimed at (about 1% false positives with k = 7).
pub const BITS_PER_BLOCK: u64 = 10;
/// Smallest digest accepted as a `holdings_bytes_max`.
pub const DIGEST_BYTES_MIN: u64 = 4096;

/// Why bytes are not a digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DigestFault {
    /// Shorter than a header and trailer, or the filter length disagrees.
    Length,
    /// Wrong magic or an unknown version.
    Version,
    /// `k` or `m` out of range, or reserved bytes set.
    Field,
    /// The blake3 trailer does not match.
    Checksum,
}

/// A decoded (or freshly built) digest.
#[derive(Clone, PartialEq, Eq)]
pub struct HoldingsDigest {
    k: u8,
    built_unix_ms: u64,
    blocks: u64,
    bits: Vec<u64>,
}

impl std::fmt::Debug for HoldingsDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HoldingsDigest")
            .field("k", &self.k)
            .field("built_unix_ms", &self.built_unix_ms)
            .field("blocks", &self.blocks)
            .field("filter_bits", &self.filter_bits())
            .finish()
    }
}

fn pair_hash(ns: &NamespaceId, key: &BlockKey) -> (u64, u64) {
    let mut h = blake3::Hasher::new();
    h.update(&ns.0);
    h.update(key.as_bytes());
    let d = h.finalize();
    let b = d.as_bytes();
    let w = |i: usize| {
        let mut x = [0u8; 8];
        x.copy_from_slice(&b[i..i + 8]);
        u64::from_le_bytes(x)
    };
    (w(0), w(8) | 1)
}

impl HoldingsDigest {
    /// An empty filter sized for `blocks_hint` blocks within `bytes_max`
    /// encoded bytes (at least 64 filter bits).
    pub fn with_capacity(blocks_hint: u64, bytes_max: u64, built_unix_ms: u64) -> Self {
        let room_bits = bytes_max
            .saturating_sub((HEAD_BYTES + TAIL_BYTES) as u64)
            .saturating_mul(8);
        // Whole 64-bit words: the aim rounded up, the room rounded down.
        let want = blocks_hint
            .saturating_mul(BITS_PER_BLOCK)
            .max(64)
            .div_ceil(64)
            * 64;
        let m = want.min(room_bits / 64 * 64).max(64);
        // k = m/n ln 2, the optimum, kept within 1 to 16 (7 at 10 bits).
        let k = if blocks_hint == 0 {
            7
        } else {
            ((m as f64 / blocks_hint as f64) * std::f64::consts::LN_2).round() as i64
        };
        HoldingsDigest {
            k: k.clamp(1, 16) as u8,
            built_unix_ms,
            blocks: 0,
            bits: vec![0; (m / 64) as usize],
        }
    }

    fn m(&self) -> u64 {
        self.bits.len() as u64 * 64
    }

    /// Filter size in bits.
    pub fn filter_bits(&self) -> u64 {
        self.m()
    }

    /// Blocks inserted.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// When the holder built it (its clock).
    pub fn built_unix_ms(&self) -> u64 {
        self.built_unix_ms
    }

    /// Encoded size in bytes.
    pub fn encoded_bytes(&self) -> usize {
        HEAD_BYTES + self.bits.len() * 8 + TAIL_BYTES
    }

    /// Adds a block.
    pub fn insert(&mut self, ns: &NamespaceId, key: &BlockKey) {
        let (h1, h2) = pair_hash(ns, key);
        let m = self.m();
        for j in 0..u64::from(self.k) {
            let i = h1.wrapping_add(j.wrapping_mul(h2)) % m;
            self.bits[(i / 64) as usize] |= 1 << (i % 64);
        }
        self.blocks += 1;
    }

    /// Whether the block may be held (`false`: it was not, when built).
    pub fn may_hold(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        let (h1, h2) = pair_hash(ns, key);
        let m = self.m();
        (0..u64::from(self.k)).all(|j| {
            let i = h1.wrapping_add(j.wrapping_mul(h2)) % m;
            self.bits[(i / 64) as usize] & (1 << (i % 64)) != 0
        })
    }

    /// The wire and storage form (module docs).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_bytes());
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.push(self.k);
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&self.built_unix_ms.to_le_bytes());
        out.extend_from_slice(&self.blocks.to_le_bytes());
        out.extend_from_slice(&self.m().to_le_bytes());
        // Bit i is bit i % 8 of byte i / 8: the words' little-endian bytes.
        for w in &self.bits {
            out.extend_from_slice(&w.to_le_bytes());
        }
        let sum = blake3::hash(&out);
        out.extend_from_slice(sum.as_bytes());
        out
    }

    /// Parses and checks an encoded digest (length, version, fields,
    /// checksum) of at most `bytes_max` bytes.
    pub fn decode(b: &[u8], bytes_max: u64) -> Result<Self, DigestFault> {
        if b.len() < HEAD_BYTES + 8 + TAIL_BYTES || b.len() as u64 > bytes_max.max(4096) {
            return Err(DigestFault::Length);
        }
        if &b[..4] != MAGIC || b[4] != VERSION {
            return Err(DigestFault::Version);
        }
        let (body, sum) = b.split_at(b.len() - TAIL_BYTES);
        if blake3::hash(body).as_bytes() != sum {
            return Err(DigestFault::Checksum);
        }
        let u = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        let k = b[5];
        let m = u(24);
        if !(1..=16).contains(&k) || b[6] != 0 || b[7] != 0 || m == 0 || m % 64 != 0 {
            return Err(DigestFault::Field);
        }
        let filter = &body[HEAD_BYTES..];
        if filter.len() as u64 * 8 != m {
            return Err(DigestFault::Length);
        }
        let bits = filter
            .chunks_exact(8)
            .map(|c| {
                let mut x = [0u8; 8];
                x.copy_from_slice(c);
                u64::from_le_bytes(x)
            })
            .collect();
        Ok(HoldingsDigest {
            k,
            built_unix_ms: u(8),
            blocks: u(16),
            bits,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns() -> NamespaceId {
        NamespaceId([7; 16])
    }

    #[test]
    fn holds_what_was_inserted_and_rarely_more() {
        let mut d = HoldingsDigest::with_capacity(10_000, 1 << 20, 5);
        for i in 0..10_000u64 {
            d.insert(&ns(), &BlockKey::from_u64(i));
        }
        for i in 0..10_000u64 {
            assert!(d.may_hold(&ns(), &BlockKey::from_u64(i)));
        }
        let fp = (10_000..110_000u64)
            .filter(|&i| d.may_hold(&ns(), &BlockKey::from_u64(i)))
            .count();
        // 10 bits per block, k = 7: about 0.8%.
        assert!(fp < 2_000, "{fp} false positives in 100000");
        // Another namespace, same keys: a different pair.
        let other = NamespaceId([8; 16]);
        let fp2 = (0..10_000u64)
            .filter(|&i| d.may_hold(&other, &BlockKey::from_u64(i)))
            .count();
        assert!(fp2 < 300, "{fp2}");
        let back = HoldingsDigest::decode(&d.encode(), 1 << 20).unwrap();
        assert_eq!(back, d);
        assert_eq!(back.blocks(), 10_000);
        assert_eq!(back.built_unix_ms(), 5);
    }

    #[test]
    fn size_is_bounded_and_lies_are_refused() {
        let d = HoldingsDigest::with_capacity(10_000_000, 8192, 1);
        assert!(d.encoded_bytes() <= 8192, "{}", d.encoded_bytes());
        let empty = HoldingsDigest::with_capacity(0, 1 << 20, 1);
        assert!(!empty.may_hold(&ns(), &BlockKey::from_u64(1)));
        let mut e = empty.encode();
        assert_eq!(HoldingsDigest::decode(&e, 1 << 20).unwrap(), empty);
        // Over the caller's bound.
        let big = HoldingsDigest::with_capacity(100_000, 1 << 20, 1).encode();
        assert_eq!(HoldingsDigest::decode(&big, 8192), Err(DigestFault::Length));
        // A flipped bit anywhere fails the checksum (or the header checks).
        for at in [0, 4, 5, 9, 40, e.len() - 1] {
            let mut f = e.clone();
            f[at] ^= 1;
            assert!(HoldingsDigest::decode(&f, 1 << 20).is_err(), "flip at {at}");
        }
        e.truncate(e.len() - 1);
        assert!(HoldingsDigest::decode(&e, 1 << 20).is_err());
        assert!(HoldingsDigest::decode(b"KVHD", 1 << 20).is_err());
    }
}
