//! The payload checksum: XXH3-128 for blocks of format 2, blake3 for the
//! blocks format 1 wrote (still read, never written).
//!
//! Why not blake3 any more: a block's name is a hash of its tokens, not of
//! its bytes, and whoever writes the bytes writes the checksum beside them,
//! so a cryptographic checksum protects nothing a fast one does not. What
//! it costs is speed: `kvtier bench checksum` (docs/BENCHMARKS.md) measured
//! blake3 at 6.8-7.2 GB/s on one core here and XXH3-128 at 24-36 on the
//! same bytes; a GPU node reading 50 GB/s from NVMe would spend about 7
//! cores on blake3, about 2 on XXH3-128.
//!
//! A checksum travels as 32 bytes everywhere it is stored or sent (the
//! block header, the G3 index, the wire, the GPU jobs), so the formats
//! around it kept their shape: a blake3 digest fills all 32; an XXH3-128
//! digest fills the first 16 (big-endian) and the fixed tag
//! [`XXH3_128_TAG`] the last 16. A blake3 digest ends in that tag with
//! probability 2^-128, and a block whose checksum is misread only fails
//! its check (a miss), never passes a wrong byte. docs/FORMAT.md.

use std::fmt;

/// The last 16 bytes of a 32-byte checksum that holds an XXH3-128 digest.
pub const XXH3_128_TAG: [u8; 16] = *b"kvtier:xxh3-128\0";

/// Which function a checksum was computed with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SumAlgo {
    /// blake3-256 (block format 1).
    Blake3,
    /// XXH3-128 (block format 2, what this build writes).
    Xxh3_128,
}

impl SumAlgo {
    /// The name operators see (`kvtier stat`, `kvtier inspect`).
    pub fn name(self) -> &'static str {
        match self {
            SumAlgo::Blake3 => "blake3",
            SumAlgo::Xxh3_128 => "xxh3-128",
        }
    }
}

/// A payload checksum in its 32-byte stored form.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PayloadSum([u8; 32]);

impl PayloadSum {
    /// The checksum this build writes (XXH3-128) of `payload`.
    pub fn of(payload: &[u8]) -> Self {
        Self::from_xxh3(twox_hash::XxHash3_128::oneshot(payload))
    }

    /// The blake3 checksum of `payload` (format 1; for tests and tools that
    /// write old-format blocks).
    pub fn blake3_of(payload: &[u8]) -> Self {
        PayloadSum(*blake3::hash(payload).as_bytes())
    }

    fn from_xxh3(d: u128) -> Self {
        let mut b = [0u8; 32];
        b[..16].copy_from_slice(&d.to_be_bytes());
        b[16..].copy_from_slice(&XXH3_128_TAG);
        PayloadSum(b)
    }

    /// A checksum from its stored form.
    pub const fn from_bytes(b: [u8; 32]) -> Self {
        PayloadSum(b)
    }

    /// The stored form.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The function this checksum was computed with.
    pub fn algo(&self) -> SumAlgo {
        if self.0[16..] == XXH3_128_TAG {
            SumAlgo::Xxh3_128
        } else {
            SumAlgo::Blake3
        }
    }

    /// The digest alone (16 bytes for XXH3-128, 32 for blake3).
    pub fn digest(&self) -> &[u8] {
        match self.algo() {
            SumAlgo::Xxh3_128 => &self.0[..16],
            SumAlgo::Blake3 => &self.0[..],
        }
    }

    /// The digest in lower-case hex (32 or 64 characters).
    pub fn to_hex(&self) -> String {
        self.digest().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// An incremental hasher of the same function, for bytes that arrive in
    /// pieces.
    pub fn hasher(&self) -> SumHasher {
        SumHasher::new(self.algo())
    }

    /// Whether `payload` has this checksum.
    pub fn matches(&self, payload: &[u8]) -> bool {
        let got = match self.algo() {
            SumAlgo::Xxh3_128 => Self::of(payload),
            SumAlgo::Blake3 => Self::blake3_of(payload),
        };
        got == *self
    }
}

impl fmt::Debug for PayloadSum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.algo().name(), self.to_hex())
    }
}

/// An incremental checksum of either function. The XXH3 state is kept
/// inline: one is made per block verified (G3 reads, G4 and peer fetches,
/// the mount), and a box would be an allocation per block on those paths;
/// blake3's larger state, for old blocks only, is boxed.
#[derive(Clone)]
#[allow(clippy::large_enum_variant)] // the common variant is the large one, on purpose
pub enum SumHasher {
    /// blake3 (format 1 blocks).
    Blake3(Box<blake3::Hasher>),
    /// XXH3-128 (format 2 blocks).
    Xxh3(twox_hash::XxHash3_128),
}

impl SumHasher {
    /// A fresh hasher of `algo`.
    pub fn new(algo: SumAlgo) -> Self {
        match algo {
            SumAlgo::Blake3 => SumHasher::Blake3(Box::default()),
            SumAlgo::Xxh3_128 => SumHasher::Xxh3(twox_hash::XxHash3_128::new()),
        }
    }

    /// Adds the next bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        match self {
            SumHasher::Blake3(h) => {
                h.update(bytes);
            }
            SumHasher::Xxh3(h) => h.write(bytes),
        }
    }

    /// The checksum of everything added.
    pub fn finish(&self) -> PayloadSum {
        match self {
            SumHasher::Blake3(h) => PayloadSum(*h.finalize().as_bytes()),
            SumHasher::Xxh3(h) => PayloadSum::from_xxh3(h.finish_128()),
        }
    }
}

impl fmt::Debug for SumHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SumHasher::Blake3(_) => f.write_str("SumHasher(blake3)"),
            SumHasher::Xxh3(_) => f.write_str("SumHasher(xxh3-128)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xxh3_128_is_the_reference_digest() {
        // XXH3-128 of the empty input and of "abc" with seed 0, as the
        // reference implementation (xxhsum -H2) prints them.
        assert_eq!(
            PayloadSum::of(b"").to_hex(),
            format!("{:032x}", xxhash_rust::xxh3::xxh3_128(b""))
        );
        assert_eq!(
            PayloadSum::of(b"abc").to_hex(),
            format!("{:032x}", xxhash_rust::xxh3::xxh3_128(b"abc"))
        );
        assert_eq!(PayloadSum::of(b"abc").algo(), SumAlgo::Xxh3_128);
        assert_eq!(PayloadSum::blake3_of(b"abc").algo(), SumAlgo::Blake3);
        assert_eq!(PayloadSum::of(b"abc").as_bytes()[16..], XXH3_128_TAG);
    }

    #[test]
    fn streaming_equals_one_shot_for_both_functions() {
        let data: Vec<u8> = (0..1_000_003u32).map(|i| (i * 31 % 251) as u8).collect();
        for want in [PayloadSum::of(&data), PayloadSum::blake3_of(&data)] {
            let mut h = want.hasher();
            for piece in data.chunks(4093) {
                h.update(piece);
            }
            assert_eq!(h.finish(), want);
            assert!(want.matches(&data));
            let mut bad = data.clone();
            bad[500_000] ^= 1;
            assert!(!want.matches(&bad));
        }
    }
}
