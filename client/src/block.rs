//! The block file format: one encoder, one validating decoder.
//!
//! A block file is a 4096-byte header followed by the payload, padded with
//! zeros to a multiple of 4096 so the whole file can be read with O_DIRECT or
//! by GPUDirect Storage. docs/FORMAT.md draws the header byte by byte.
//!
//! The decoder never panics: every length and offset is checked before use.

use crate::checksum::{PayloadSum, SumAlgo, SumHasher, XXH3_128_TAG};
use crate::error::{Error, FormatFault, Result};
use crate::key::{BlockKey, KEY_BYTES_MAX};
use crate::namespace::{Dtype, KvLayout, LayoutKind, Namespace, NamespaceId};

/// Block file magic.
pub const MAGIC: [u8; 8] = *b"KVTIERB\x01";
/// The format version this build writes: 2 (XXH3-128 checksums). It
/// reads 2 and 1 (blake3 checksums, what builds before it wrote).
pub const VERSION: u16 = 2;
/// The oldest format version this build reads.
pub const VERSION_OLDEST: u16 = 1;
/// Header size, and the payload's alignment.
pub const HEADER_BYTES: usize = 4096;
/// Alignment of the payload and of the file length.
pub const ALIGN_BYTES: usize = 4096;
/// Largest payload accepted (1 GiB).
pub const PAYLOAD_BYTES_MAX: u64 = 1 << 30;

const OFF_VERSION: usize = 8;
const OFF_HEADER_LEN: usize = 10;
const OFF_FLAGS: usize = 12;
const OFF_NS: usize = 16;
const OFF_KEY_LEN: usize = 48;
const OFF_KEY: usize = 56;
const OFF_LAYOUT: usize = 120;
const OFF_PAYLOAD_LEN: usize = 144;
const OFF_PAYLOAD_SUM: usize = 152;
const OFF_CREATED: usize = 184;
const OFF_RESERVED: usize = 192;
// The Dynamo routing extension (tag byte at OFF_RESERVED; docs/FORMAT.md).
const OFF_DYN_TAG: usize = OFF_RESERVED;
const OFF_DYN_HAS_PARENT: usize = OFF_RESERVED + 1;
const OFF_DYN_PARENT: usize = OFF_RESERVED + 8;
const OFF_DYN_TOKENS_HASH: usize = OFF_RESERVED + 16;
const OFF_DYN_TOKEN_COUNT: usize = OFF_RESERVED + 24;
const OFF_DYN_TOKENS: usize = OFF_RESERVED + 32;
const DYN_TAG: u8 = 1;
const OFF_HEADER_SUM: usize = HEADER_BYTES - 32;

/// Most token ids a header carries (the room between the routing
/// extension's fixed fields and the header checksum).
pub const DYNAMO_TOKENS_MAX: usize = (OFF_HEADER_SUM - OFF_DYN_TOKENS) / 4;

/// What a Dynamo router needs about a block of a dynamo-mode namespace,
/// kept in the block's header so that events after a restart or from G4
/// carry it too. Token ids are as sensitive as the KV itself: they live
/// where the payload lives and travel only where events do.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DynamoMeta {
    /// The previous block's sequence hash, if any.
    pub parent: Option<u64>,
    /// Dynamo's `tokens_hash` (LocalBlockHash) of this block.
    pub tokens_hash: u64,
    /// The block's token ids (empty when not sent; at most
    /// [`DYNAMO_TOKENS_MAX`]).
    pub token_ids: Vec<u32>,
}

/// The decoded header of a block file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockHeader {
    /// Full namespace digest.
    pub namespace_digest: [u8; 32],
    /// Block key.
    pub key: BlockKey,
    /// Layout of the payload.
    pub layout: KvLayout,
    /// Payload length in bytes (without padding).
    pub payload_len: u64,
    /// The payload's checksum (XXH3-128 in format 2, blake3 in format 1).
    pub payload_sum: PayloadSum,
    /// When the block was first stored, ms since the Unix epoch.
    pub created_unix_ms: u64,
    /// Dynamo routing facts (dynamo-mode namespaces, when the client sent
    /// them); `None` in older blocks.
    pub dynamo: Option<DynamoMeta>,
}

impl BlockHeader {
    /// A header for `payload` in namespace `ns` (computes the checksum).
    pub fn for_payload(
        ns: &Namespace,
        key: BlockKey,
        payload: &[u8],
        created_unix_ms: u64,
    ) -> Self {
        BlockHeader {
            namespace_digest: ns.digest(),
            key,
            layout: ns.layout,
            payload_len: payload.len() as u64,
            payload_sum: PayloadSum::of(payload),
            created_unix_ms,
            dynamo: None,
        }
    }

    /// The same header with Dynamo routing facts (token ids beyond
    /// [`DYNAMO_TOKENS_MAX`] are dropped: the router then learns the block
    /// from its tokens_hash alone).
    pub fn with_dynamo(mut self, mut meta: DynamoMeta) -> Self {
        if meta.token_ids.len() > DYNAMO_TOKENS_MAX {
            meta.token_ids.clear();
        }
        self.dynamo = Some(meta);
        self
    }

    /// The short namespace id this header belongs to.
    pub fn namespace_id(&self) -> NamespaceId {
        NamespaceId::from_digest(&self.namespace_digest)
    }

    /// Total file length: header plus payload padded to [`ALIGN_BYTES`].
    pub fn file_len(&self) -> u64 {
        HEADER_BYTES as u64 + padded_len(self.payload_len)
    }

    /// Writes the 4096-byte header into `out`.
    pub fn encode_into(&self, out: &mut [u8; HEADER_BYTES]) {
        out.fill(0);
        out[..8].copy_from_slice(&MAGIC);
        // A header re-encoded from a format-1 block (blake3) stays format 1,
        // so its checksums still agree with each other.
        let version = self.format_version();
        out[OFF_VERSION..OFF_VERSION + 2].copy_from_slice(&version.to_le_bytes());
        out[OFF_HEADER_LEN..OFF_HEADER_LEN + 2]
            .copy_from_slice(&(HEADER_BYTES as u16).to_le_bytes());
        out[OFF_NS..OFF_NS + 32].copy_from_slice(&self.namespace_digest);
        let k = self.key.as_bytes();
        out[OFF_KEY_LEN] = k.len() as u8;
        out[OFF_KEY..OFF_KEY + k.len()].copy_from_slice(k);
        let l = &self.layout;
        let mut o = OFF_LAYOUT;
        for v in [l.layers, l.kv_heads, l.head_dim, l.tokens_per_block] {
            out[o..o + 4].copy_from_slice(&v.to_le_bytes());
            o += 4;
        }
        out[o] = l.dtype as u8;
        out[o + 1] = l.kind as u8;
        out[OFF_PAYLOAD_LEN..OFF_PAYLOAD_LEN + 8].copy_from_slice(&self.payload_len.to_le_bytes());
        out[OFF_PAYLOAD_SUM..OFF_PAYLOAD_SUM + 32].copy_from_slice(self.payload_sum.as_bytes());
        out[OFF_CREATED..OFF_CREATED + 8].copy_from_slice(&self.created_unix_ms.to_le_bytes());
        if let Some(d) = &self.dynamo {
            let tokens = if d.token_ids.len() <= DYNAMO_TOKENS_MAX {
                &d.token_ids[..]
            } else {
                &[]
            };
            out[OFF_DYN_TAG] = DYN_TAG;
            out[OFF_DYN_HAS_PARENT] = d.parent.is_some() as u8;
            out[OFF_DYN_PARENT..OFF_DYN_PARENT + 8]
                .copy_from_slice(&d.parent.unwrap_or(0).to_le_bytes());
            out[OFF_DYN_TOKENS_HASH..OFF_DYN_TOKENS_HASH + 8]
                .copy_from_slice(&d.tokens_hash.to_le_bytes());
            out[OFF_DYN_TOKEN_COUNT..OFF_DYN_TOKEN_COUNT + 2]
                .copy_from_slice(&(tokens.len() as u16).to_le_bytes());
            for (i, t) in tokens.iter().enumerate() {
                let o = OFF_DYN_TOKENS + 4 * i;
                out[o..o + 4].copy_from_slice(&t.to_le_bytes());
            }
        }
        seal(out, version);
    }

    /// The block format this header is written in: 2 for an XXH3-128
    /// checksum, 1 for a blake3 one.
    pub fn format_version(&self) -> u16 {
        match self.payload_sum.algo() {
            SumAlgo::Xxh3_128 => VERSION,
            SumAlgo::Blake3 => 1,
        }
    }

    /// The header as a fresh 4096-byte array.
    pub fn encode(&self) -> Box<[u8; HEADER_BYTES]> {
        let mut b = Box::new([0u8; HEADER_BYTES]);
        self.encode_into(&mut b);
        b
    }

    /// Decodes and validates a header (magic, version, header checksum,
    /// field ranges, reserved bytes). Does not look at the payload.
    pub fn decode(buf: &[u8]) -> Result<Self> {
        if buf.len() < HEADER_BYTES {
            return Err(Error::format(
                FormatFault::Truncated,
                format!("{} bytes, a header is {HEADER_BYTES}", buf.len()),
            ));
        }
        let h = &buf[..HEADER_BYTES];
        if h[..8] != MAGIC {
            return Err(Error::format(
                FormatFault::BadMagic,
                "not a kvtier block file",
            ));
        }
        let version = u16_at(h, OFF_VERSION);
        if !(VERSION_OLDEST..=VERSION).contains(&version) {
            return Err(Error::format(
                FormatFault::UnknownVersion,
                format!("format version {version}, this build reads {VERSION_OLDEST} to {VERSION}"),
            ));
        }
        if header_sum(h, version)[..] != h[OFF_HEADER_SUM..] {
            return Err(Error::format(
                FormatFault::HeaderChecksum,
                "header checksum mismatch",
            ));
        }
        let malformed = |what: String| Error::format(FormatFault::Malformed, what);
        let header_len = u16_at(h, OFF_HEADER_LEN) as usize;
        if header_len != HEADER_BYTES {
            return Err(malformed(format!("header length {header_len}")));
        }
        if u32_at(h, OFF_FLAGS) != 0 {
            return Err(malformed("unknown flags set".into()));
        }
        let key_len = h[OFF_KEY_LEN] as usize;
        if key_len == 0 || key_len > KEY_BYTES_MAX {
            return Err(malformed(format!("key length {key_len}")));
        }
        let nonzero = |r: std::ops::Range<usize>| h[r].iter().any(|&b| b != 0);
        let (dynamo, reserved_from) = decode_dynamo(h)?;
        if nonzero(OFF_KEY_LEN + 1..OFF_KEY)
            || nonzero(OFF_KEY + key_len..OFF_KEY + KEY_BYTES_MAX)
            || nonzero(OFF_LAYOUT + 18..OFF_PAYLOAD_LEN)
            || nonzero(reserved_from..OFF_HEADER_SUM)
        {
            return Err(malformed("reserved bytes are not zero".into()));
        }
        let key = BlockKey::from_bytes(&h[OFF_KEY..OFF_KEY + key_len])?;
        let dtype = Dtype::from_code(h[OFF_LAYOUT + 16])
            .ok_or_else(|| malformed(format!("dtype code {}", h[OFF_LAYOUT + 16])))?;
        let kind = LayoutKind::from_code(h[OFF_LAYOUT + 17])
            .ok_or_else(|| malformed(format!("layout kind {}", h[OFF_LAYOUT + 17])))?;
        let layout = KvLayout {
            layers: u32_at(h, OFF_LAYOUT),
            kv_heads: u32_at(h, OFF_LAYOUT + 4),
            head_dim: u32_at(h, OFF_LAYOUT + 8),
            tokens_per_block: u32_at(h, OFF_LAYOUT + 12),
            dtype,
            kind,
        };
        let payload_len = u64_at(h, OFF_PAYLOAD_LEN);
        if payload_len > PAYLOAD_BYTES_MAX {
            return Err(Error::format(
                FormatFault::Oversized,
                format!("payload of {payload_len} bytes, limit {PAYLOAD_BYTES_MAX}"),
            ));
        }
        if layout.validate().is_err() || layout.block_bytes() != payload_len {
            return Err(Error::format(
                FormatFault::LayoutMismatch,
                format!(
                    "payload of {payload_len} bytes but the layout describes {}",
                    layout.block_bytes()
                ),
            ));
        }
        let mut namespace_digest = [0u8; 32];
        namespace_digest.copy_from_slice(&h[OFF_NS..OFF_NS + 32]);
        let mut sum = [0u8; 32];
        sum.copy_from_slice(&h[OFF_PAYLOAD_SUM..OFF_PAYLOAD_SUM + 32]);
        let payload_sum = PayloadSum::from_bytes(sum);
        // The checksum's function is the format's: a format-2 header names
        // an XXH3-128 sum, a format-1 header a blake3 one.
        let want = if version == 1 {
            SumAlgo::Blake3
        } else {
            SumAlgo::Xxh3_128
        };
        if payload_sum.algo() != want {
            return Err(malformed(format!(
                "format {version} with a {} payload checksum",
                payload_sum.algo().name()
            )));
        }
        Ok(BlockHeader {
            namespace_digest,
            key,
            layout,
            payload_len,
            payload_sum,
            created_unix_ms: u64_at(h, OFF_CREATED),
            dynamo,
        })
    }

    /// Checks `payload` (exactly `payload_len` bytes) against the checksum.
    pub fn verify_payload(&self, payload: &[u8]) -> Result<()> {
        self.check_len(payload.len())?;
        let mut h = self.payload_sum.hasher();
        h.update(payload);
        self.check_sum(h.finish())
    }

    /// Copies `src` (exactly `payload_len` bytes) into `dst` (as long) and
    /// checks the bytes *in `dst`* against the checksum, a piece at a time:
    /// each piece is hashed right after its copy, while it is still in the
    /// cache, instead of the whole payload being read back from memory.
    pub fn copy_verified(&self, src: &[u8], dst: &mut [u8]) -> Result<()> {
        const PIECE_BYTES: usize = 128 << 10;
        self.check_len(src.len())?;
        self.check_len(dst.len())?;
        let mut h = self.payload_sum.hasher();
        for (s, d) in src.chunks(PIECE_BYTES).zip(dst.chunks_mut(PIECE_BYTES)) {
            d.copy_from_slice(s);
            h.update(d);
        }
        self.check_sum(h.finish())
    }

    fn check_len(&self, len: usize) -> Result<()> {
        if len as u64 != self.payload_len {
            return Err(Error::format(
                FormatFault::Truncated,
                format!("payload of {len} bytes, header says {}", self.payload_len),
            ));
        }
        Ok(())
    }

    /// A fresh incremental hasher of this block's checksum function.
    pub fn payload_hasher(&self) -> SumHasher {
        self.payload_sum.hasher()
    }

    /// Checks a checksum computed over the payload (with
    /// [`Self::payload_hasher`]) against the header's.
    pub fn check_sum(&self, got: PayloadSum) -> Result<()> {
        if got != self.payload_sum {
            return Err(Error::format(
                FormatFault::PayloadChecksum,
                format!("payload checksum mismatch for block {}", self.key),
            ));
        }
        Ok(())
    }
}

/// `len` rounded up to [`ALIGN_BYTES`].
pub fn padded_len(len: u64) -> u64 {
    len.div_ceil(ALIGN_BYTES as u64) * ALIGN_BYTES as u64
}

/// Encodes a whole block file (header, payload, zero padding).
pub fn encode_block(header: &BlockHeader, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; header.file_len() as usize];
    let mut h = [0u8; HEADER_BYTES];
    header.encode_into(&mut h);
    out[..HEADER_BYTES].copy_from_slice(&h);
    out[HEADER_BYTES..HEADER_BYTES + payload.len()].copy_from_slice(payload);
    out
}

/// Decodes and fully validates a whole block file: header, exact length,
/// zero padding and payload checksum. Returns the header and the payload.
pub fn decode_block(file: &[u8]) -> Result<(BlockHeader, &[u8])> {
    let header = BlockHeader::decode(file)?;
    let want = header.file_len();
    let got = file.len() as u64;
    if got < want {
        return Err(Error::format(
            FormatFault::Truncated,
            format!("file of {got} bytes, header needs {want}"),
        ));
    }
    if got > want {
        return Err(Error::format(
            FormatFault::Oversized,
            format!("file of {got} bytes, header declares {want}"),
        ));
    }
    let end = HEADER_BYTES + header.payload_len as usize;
    if file[end..].iter().any(|&b| b != 0) {
        return Err(Error::format(
            FormatFault::Malformed,
            "padding bytes are not zero",
        ));
    }
    let payload = &file[HEADER_BYTES..end];
    header.verify_payload(payload)?;
    Ok((header, payload))
}

/// The routing extension of a checksummed header, and where the zero
/// reserved bytes start after it.
fn decode_dynamo(h: &[u8]) -> Result<(Option<DynamoMeta>, usize)> {
    let malformed = |what: String| Error::format(FormatFault::Malformed, what);
    match h[OFF_DYN_TAG] {
        0 => Ok((None, OFF_RESERVED)),
        DYN_TAG => {
            let has_parent = h[OFF_DYN_HAS_PARENT];
            if has_parent > 1
                || h[OFF_DYN_HAS_PARENT + 1..OFF_DYN_PARENT]
                    .iter()
                    .any(|&b| b != 0)
            {
                return Err(malformed("dynamo extension: bad parent flag".into()));
            }
            let parent = u64_at(h, OFF_DYN_PARENT);
            if has_parent == 0 && parent != 0 {
                return Err(malformed("dynamo extension: parent without flag".into()));
            }
            let n = u16_at(h, OFF_DYN_TOKEN_COUNT) as usize;
            if n > DYNAMO_TOKENS_MAX
                || h[OFF_DYN_TOKEN_COUNT + 2..OFF_DYN_TOKENS]
                    .iter()
                    .any(|&b| b != 0)
            {
                return Err(malformed(format!("dynamo extension: {n} token ids")));
            }
            let token_ids = (0..n).map(|i| u32_at(h, OFF_DYN_TOKENS + 4 * i)).collect();
            let meta = DynamoMeta {
                parent: (has_parent == 1).then_some(parent),
                tokens_hash: u64_at(h, OFF_DYN_TOKENS_HASH),
                token_ids,
            };
            Ok((Some(meta), OFF_DYN_TOKENS + 4 * n))
        }
        t => Err(malformed(format!("header extension tag {t}"))),
    }
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(a)
}

/// Re-seals the header checksum of a buffer that starts with a header. For
/// fuzzing and corruption tests: it lets mutated headers reach the checks
/// behind the checksum.
#[doc(hidden)]
pub fn reseal_header(buf: &mut [u8]) {
    if buf.len() >= HEADER_BYTES {
        let version = u16_at(buf, OFF_VERSION);
        seal(&mut buf[..HEADER_BYTES], version);
    }
}

/// The header checksum of `h` (at least [`HEADER_BYTES`]) in its stored
/// form: blake3 in format 1, XXH3-128 followed by [`XXH3_128_TAG`] from 2.
fn header_sum(h: &[u8], version: u16) -> [u8; 32] {
    let body = &h[..OFF_HEADER_SUM];
    if version == 1 {
        *blake3::hash(body).as_bytes()
    } else {
        let mut out = [0u8; 32];
        out[..16].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(body).to_be_bytes());
        out[16..].copy_from_slice(&XXH3_128_TAG);
        out
    }
}

fn seal(h: &mut [u8], version: u16) {
    let sum = header_sum(h, version);
    h[OFF_HEADER_SUM..HEADER_BYTES].copy_from_slice(&sum);
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample(len: u64) -> (BlockHeader, Vec<u8>) {
        let layout = KvLayout::with_block_bytes(len).unwrap();
        let ns = Namespace::new("m", layout, "", b"s".to_vec()).unwrap();
        let payload: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        let key = BlockKey::from_digest([9; 32]);
        (BlockHeader::for_payload(&ns, key, &payload, 42), payload)
    }

    #[test]
    fn round_trip() {
        let (h, p) = sample(4096 + 64);
        let f = encode_block(&h, &p);
        assert_eq!(f.len() % ALIGN_BYTES, 0);
        let (h2, p2) = decode_block(&f).unwrap();
        assert_eq!(h, h2);
        assert_eq!(p, p2);
    }

    fn fault(f: &[u8]) -> FormatFault {
        decode_block(f).unwrap_err().format_fault().unwrap()
    }

    #[test]
    fn dynamo_extension_round_trips_and_old_headers_have_none() {
        let (h, p) = sample(4096);
        assert_eq!(decode_block(&encode_block(&h, &p)).unwrap().0.dynamo, None);
        let meta = DynamoMeta {
            parent: Some(u64::MAX),
            tokens_hash: 0x1234_5678_9abc_def0,
            token_ids: (0..DYNAMO_TOKENS_MAX as u32)
                .map(|t| t * 3 + u32::MAX / 2)
                .collect(),
        };
        let h2 = h.clone().with_dynamo(meta.clone());
        let f = encode_block(&h2, &p);
        assert_eq!(decode_block(&f).unwrap().0.dynamo, Some(meta));
        let root = DynamoMeta {
            parent: None,
            tokens_hash: 5,
            token_ids: vec![],
        };
        let f = encode_block(&h.clone().with_dynamo(root.clone()), &p);
        assert_eq!(decode_block(&f).unwrap().0.dynamo, Some(root));
        // Too many token ids: the header keeps the tokens_hash only.
        let many = DynamoMeta {
            parent: None,
            tokens_hash: 9,
            token_ids: vec![1; DYNAMO_TOKENS_MAX + 1],
        };
        let f = encode_block(&h.clone().with_dynamo(many), &p);
        let got = decode_block(&f).unwrap().0.dynamo.unwrap();
        assert!(got.token_ids.is_empty());
        assert_eq!(got.tokens_hash, 9);
        // A token count past the room, an unknown tag, stray bytes after
        // the token ids: typed as malformed.
        let good = encode_block(
            &h.clone().with_dynamo(DynamoMeta {
                parent: Some(1),
                tokens_hash: 2,
                token_ids: vec![7, 8],
            }),
            &p,
        );
        for (off, v) in [
            (OFF_DYN_TOKEN_COUNT + 1, 0xffu8),
            (OFF_DYN_TAG, 2),
            (OFF_DYN_TOKENS + 8, 1),
            (OFF_DYN_HAS_PARENT, 2),
        ] {
            let mut m = good.clone();
            m[off] = v;
            reseal_header(&mut m);
            assert_eq!(fault(&m), FormatFault::Malformed, "offset {off}");
        }
    }

    #[test]
    fn every_corruption_class_is_typed() {
        let (h, p) = sample(8192);
        let good = encode_block(&h, &p);
        assert_eq!(fault(&good[..100]), FormatFault::Truncated);
        assert_eq!(fault(&good[..good.len() - 1]), FormatFault::Truncated);
        let mut big = good.clone();
        big.extend_from_slice(&[0; 4096]);
        assert_eq!(fault(&big), FormatFault::Oversized);
        let mut m = good.clone();
        m[0] ^= 1;
        assert_eq!(fault(&m), FormatFault::BadMagic);
        let mut m = good.clone();
        m[OFF_VERSION] = 9;
        reseal_header(&mut m);
        assert_eq!(fault(&m), FormatFault::UnknownVersion);
        let mut m = good.clone();
        m[OFF_PAYLOAD_SUM] ^= 1;
        assert_eq!(fault(&m), FormatFault::HeaderChecksum);
        let mut m = good.clone();
        m[HEADER_BYTES + 5] ^= 1;
        assert_eq!(fault(&m), FormatFault::PayloadChecksum);
        let mut m = good.clone();
        m[OFF_RESERVED + 3] = 1;
        reseal_header(&mut m);
        assert_eq!(fault(&m), FormatFault::Malformed);
        let mut m = good.clone();
        m[OFF_PAYLOAD_LEN..OFF_PAYLOAD_LEN + 8]
            .copy_from_slice(&(PAYLOAD_BYTES_MAX + 1).to_le_bytes());
        reseal_header(&mut m);
        assert_eq!(fault(&m), FormatFault::Oversized);
        let mut m = good.clone();
        m[OFF_PAYLOAD_LEN..OFF_PAYLOAD_LEN + 8].copy_from_slice(&4096u64.to_le_bytes());
        reseal_header(&mut m);
        assert_eq!(fault(&m), FormatFault::LayoutMismatch);
    }

    #[test]
    fn format_1_blocks_stay_readable_and_formats_never_mix() {
        let (h, p) = sample(8192);
        assert_eq!(h.format_version(), VERSION);
        assert_eq!(h.payload_sum.algo(), SumAlgo::Xxh3_128);
        // A block as format 1 wrote it: blake3 payload and header sums.
        let old = BlockHeader {
            payload_sum: PayloadSum::blake3_of(&p),
            ..h.clone()
        };
        let f = encode_block(&old, &p);
        assert_eq!(u16_at(&f, OFF_VERSION), 1);
        assert_eq!(
            &f[OFF_HEADER_SUM..HEADER_BYTES],
            blake3::hash(&f[..OFF_HEADER_SUM]).as_bytes()
        );
        let (h1, p1) = decode_block(&f).unwrap();
        assert_eq!((&h1, p1), (&old, &p[..]));
        let mut m = f.clone();
        m[HEADER_BYTES + 7] ^= 1;
        assert_eq!(fault(&m), FormatFault::PayloadChecksum);
        // A format-2 header that names a blake3 sum, a format-1 header that
        // names an XXH3 one: malformed, never checked with the wrong function.
        let mut m = f.clone();
        m[OFF_VERSION] = 2;
        reseal_header(&mut m);
        assert_eq!(fault(&m), FormatFault::Malformed);
        let mut m = encode_block(&h, &p);
        m[OFF_VERSION] = 1;
        reseal_header(&mut m);
        assert_eq!(fault(&m), FormatFault::Malformed);
        // A format-2 header sealed with format 1's header checksum.
        let mut m = encode_block(&h, &p);
        let sum = blake3::hash(&m[..OFF_HEADER_SUM]);
        m[OFF_HEADER_SUM..HEADER_BYTES].copy_from_slice(sum.as_bytes());
        assert_eq!(fault(&m), FormatFault::HeaderChecksum);
    }
}
