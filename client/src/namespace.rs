//! Namespaces and KV layouts.
//!
//! A namespace binds blocks to one model, layout, adapter and tenant. Its
//! canonical encoding (docs/FORMAT.md) is hashed into a 32-byte digest that
//! enters every default-mode key and every block header, so two namespaces
//! never share a block and a tenant without the salt cannot name another
//! tenant's blocks.

use crate::error::{Error, Result};
use crate::key::{blake3_chain_after, dynamo_blocks_after, BlockKey, DynamoBlock, HashMode};

/// Longest model id, adapter id (Dynamo's LoRA name) or tenant salt
/// (Dynamo's salt) accepted, in bytes. Dynamo bounds neither; 64 KiB takes
/// any salt or adapter name people use (a JSON cache-namespace blob, a path)
/// while a namespace stays a few hundred KiB at most in memory. Names never
/// cross the socket (only the 16-byte id does), so no frame bound applies.
pub const NAME_BYTES_MAX: usize = 64 << 10;

/// Element type of the KV tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Dtype {
    /// IEEE half.
    F16 = 1,
    /// bfloat16.
    Bf16 = 2,
    /// IEEE single.
    F32 = 3,
    /// FP8 E4M3.
    Fp8E4m3 = 4,
    /// FP8 E5M2.
    Fp8E5m2 = 5,
    /// Raw bytes (engine-defined quantisation).
    U8 = 6,
}

impl Dtype {
    /// Bytes per element.
    pub fn size_bytes(self) -> u64 {
        match self {
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::F32 => 4,
            Dtype::Fp8E4m3 | Dtype::Fp8E5m2 | Dtype::U8 => 1,
        }
    }

    /// From the wire/header code.
    pub fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            1 => Dtype::F16,
            2 => Dtype::Bf16,
            3 => Dtype::F32,
            4 => Dtype::Fp8E4m3,
            5 => Dtype::Fp8E5m2,
            6 => Dtype::U8,
            _ => return None,
        })
    }

    /// Parses `f16`, `bf16`, `f32`, `fp8e4m3`, `fp8e5m2`, `u8`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.to_ascii_lowercase().as_str() {
            "f16" | "fp16" | "float16" => Dtype::F16,
            "bf16" | "bfloat16" => Dtype::Bf16,
            "f32" | "fp32" | "float32" => Dtype::F32,
            "fp8e4m3" | "fp8_e4m3" => Dtype::Fp8E4m3,
            "fp8e5m2" | "fp8_e5m2" => Dtype::Fp8E5m2,
            "u8" | "uint8" => Dtype::U8,
            _ => return None,
        })
    }
}

/// How a block's bytes are arranged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum LayoutKind {
    /// All layers in one contiguous run: [layer][k|v][token][head][dim].
    LayerContiguous = 1,
    /// One region per layer, which the engine may place anywhere; the block
    /// file still stores the layers back to back in layer order.
    LayerSeparate = 2,
}

impl LayoutKind {
    /// From the wire/header code.
    pub fn from_code(c: u8) -> Option<Self> {
        match c {
            1 => Some(LayoutKind::LayerContiguous),
            2 => Some(LayoutKind::LayerSeparate),
            _ => None,
        }
    }
}

/// Shape of one KV block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// Transformer layers.
    pub layers: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Dimension of one head.
    pub head_dim: u32,
    /// Element type.
    pub dtype: Dtype,
    /// Tokens in one block.
    pub tokens_per_block: u32,
    /// Arrangement of the bytes.
    pub kind: LayoutKind,
}

impl KvLayout {
    /// Bytes of one block: tokens x layers x 2 (K, V) x heads x dim x dtype.
    /// Saturates rather than overflows on hostile inputs; [`validate`]
    /// refuses such layouts.
    ///
    /// [`validate`]: KvLayout::validate
    pub fn block_bytes(&self) -> u64 {
        [
            self.tokens_per_block as u64,
            self.layers as u64,
            2,
            self.kv_heads as u64,
            self.head_dim as u64,
            self.dtype.size_bytes(),
        ]
        .iter()
        .fold(1u64, |a, &b| a.saturating_mul(b))
    }

    /// Bytes of one layer's K and V for this block (layer-separate regions).
    pub fn layer_bytes(&self) -> u64 {
        if self.layers == 0 {
            0
        } else {
            self.block_bytes() / self.layers as u64
        }
    }

    /// Checks that every dimension is non-zero and the block is at most
    /// [`crate::block::PAYLOAD_BYTES_MAX`].
    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("layers", self.layers),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("tokens_per_block", self.tokens_per_block),
        ] {
            if v == 0 {
                return Err(Error::InvalidNamespace {
                    field,
                    reason: "must be at least 1".into(),
                });
            }
        }
        let b = self.block_bytes();
        if b > crate::block::PAYLOAD_BYTES_MAX {
            return Err(Error::InvalidNamespace {
                field: "layout",
                reason: format!(
                    "block of {b} bytes exceeds the {} byte limit",
                    crate::block::PAYLOAD_BYTES_MAX
                ),
            });
        }
        Ok(())
    }

    /// Llama-3-8B-like layout (32 layers, 8 KV heads, dim 128, bf16) with
    /// the given tokens per block: 16 tokens = 2 MiB.
    pub fn llama3_8b(tokens_per_block: u32) -> Self {
        KvLayout {
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
            dtype: Dtype::Bf16,
            tokens_per_block,
            kind: LayoutKind::LayerContiguous,
        }
    }

    /// A one-layer u8 layout whose blocks are exactly `bytes` long (which
    /// must be a positive multiple of 32), for tests and benchmarks.
    pub fn with_block_bytes(bytes: u64) -> Result<Self> {
        if bytes == 0 || !bytes.is_multiple_of(32) || bytes / 32 > u32::MAX as u64 {
            return Err(Error::InvalidNamespace {
                field: "block_bytes",
                reason: format!("{bytes} is not a positive multiple of 32"),
            });
        }
        Ok(KvLayout {
            layers: 1,
            kv_heads: 1,
            head_dim: (bytes / 32) as u32,
            dtype: Dtype::U8,
            tokens_per_block: 16,
            kind: LayoutKind::LayerContiguous,
        })
    }
}

/// A KV namespace: model, layout, adapter and tenant.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Namespace {
    /// Model id, e.g. `meta-llama/Llama-3.1-8B-Instruct`.
    pub model: String,
    /// Block layout.
    pub layout: KvLayout,
    /// LoRA / adapter id; empty for the base model.
    pub adapter: String,
    /// Tenant salt: different salts never share blocks. In dynamo mode it
    /// is also Dynamo's salt (`cache_namespace`), so it must be UTF-8.
    pub tenant_salt: Vec<u8>,
    /// How keys are made. Part of the identity unless [`HashMode::Blake3`].
    pub hash_mode: HashMode,
    /// The engine's parallel rank (tensor/pipeline) whose slice of the KV
    /// this namespace holds, when ranks store separate blocks. Part of the
    /// identity when set; never part of the tenant salt.
    pub rank: Option<u32>,
}

/// Domain separator of the namespace encoding.
const NS_DOMAIN: &[u8; 16] = b"kvtier.ns.v1\0\0\0\0";

/// Extension tags appended after the v1 fields (docs/FORMAT.md). A field at
/// its default is not written, so namespaces that predate it keep their
/// identity; tags are written in increasing order.
const EXT_HASH_SCHEME: u8 = 1;
const EXT_RANK: u8 = 2;

impl Namespace {
    /// A namespace after validating its fields.
    pub fn new(
        model: impl Into<String>,
        layout: KvLayout,
        adapter: impl Into<String>,
        tenant_salt: impl Into<Vec<u8>>,
    ) -> Result<Self> {
        let ns = Namespace {
            model: model.into(),
            layout,
            adapter: adapter.into(),
            tenant_salt: tenant_salt.into(),
            hash_mode: HashMode::Blake3,
            rank: None,
        };
        ns.validate()?;
        Ok(ns)
    }

    /// The same namespace with keys made by `mode`; a new identity unless
    /// `mode` is the default. Dynamo mode needs a UTF-8 salt (Dynamo's salt
    /// is a string); the adapter is Dynamo's LoRA name.
    pub fn with_hash_mode(mut self, mode: HashMode) -> Result<Self> {
        self.hash_mode = mode;
        self.validate()?;
        Ok(self)
    }

    /// The same namespace for one parallel rank: a new identity.
    pub fn with_rank(mut self, rank: u32) -> Self {
        self.rank = Some(rank);
        self
    }

    /// Checks field lengths and the layout.
    pub fn validate(&self) -> Result<()> {
        for (field, len) in [
            ("model", self.model.len()),
            ("adapter", self.adapter.len()),
            ("tenant_salt", self.tenant_salt.len()),
        ] {
            if len > NAME_BYTES_MAX {
                return Err(Error::InvalidNamespace {
                    field,
                    reason: format!("{len} bytes, at most {NAME_BYTES_MAX}"),
                });
            }
        }
        if self.hash_mode == HashMode::Dynamo && std::str::from_utf8(&self.tenant_salt).is_err() {
            return Err(Error::InvalidNamespace {
                field: "tenant_salt",
                reason: "dynamo mode uses the salt as Dynamo's string salt: it must be UTF-8"
                    .into(),
            });
        }
        if self.model.is_empty() {
            return Err(Error::InvalidNamespace {
                field: "model",
                reason: "must not be empty".into(),
            });
        }
        self.layout.validate()
    }

    /// The canonical byte encoding (docs/FORMAT.md, "Namespace encoding").
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(64 + self.model.len() + self.adapter.len());
        v.extend_from_slice(NS_DOMAIN);
        put_str(&mut v, self.model.as_bytes());
        v.extend_from_slice(&self.layout.layers.to_le_bytes());
        v.extend_from_slice(&self.layout.kv_heads.to_le_bytes());
        v.extend_from_slice(&self.layout.head_dim.to_le_bytes());
        v.extend_from_slice(&self.layout.tokens_per_block.to_le_bytes());
        v.push(self.layout.dtype as u8);
        v.push(self.layout.kind as u8);
        put_str(&mut v, self.adapter.as_bytes());
        put_str(&mut v, &self.tenant_salt);
        // The v1 fields are self-delimiting, so the extensions after them
        // cannot make two namespaces encode alike.
        if let Some(scheme) = self.hash_mode.scheme() {
            v.push(EXT_HASH_SCHEME);
            put_str(&mut v, scheme.as_bytes());
        }
        if let Some(rank) = self.rank {
            v.push(EXT_RANK);
            put_str(&mut v, &rank.to_le_bytes());
        }
        v
    }

    /// blake3 of the canonical encoding.
    pub fn digest(&self) -> [u8; 32] {
        *blake3::hash(&self.canonical_bytes()).as_bytes()
    }

    /// The namespace's directory / object prefix name: the first 16 bytes
    /// of the digest as 32 lowercase hex digits.
    pub fn id(&self) -> NamespaceId {
        NamespaceId::from_digest(&self.digest())
    }

    /// Keys of every full block of `tokens` in the namespace's hash mode.
    /// Opaque namespaces get none: their keys come from the engine.
    pub fn hash_chain(&self, tokens: &[u32]) -> Vec<BlockKey> {
        self.hash_chain_after(None, tokens).unwrap_or_default()
    }

    /// Keys of every full block of `tokens` when they follow the block
    /// `parent` (None: they start a chain). However a token list is split,
    /// hashing each part after the last key of the part before gives the
    /// keys of hashing the whole list (docs/FORMAT.md, "Sequence hashes",
    /// chains in parts). Refuses a
    /// parent that cannot be a key of this namespace's mode (32 bytes in
    /// blake3 mode, 8 in dynamo mode). Opaque namespaces get no keys.
    pub fn hash_chain_after(
        &self,
        parent: Option<BlockKey>,
        tokens: &[u32],
    ) -> Result<Vec<BlockKey>> {
        match self.hash_mode {
            HashMode::Blake3 => {
                let p = match parent {
                    None => [0u8; 32],
                    Some(k) => <[u8; 32]>::try_from(k.as_bytes())
                        .map_err(|_| parent_len_err(&k, "a blake3-mode key is 32 bytes"))?,
                };
                Ok(blake3_chain_after(self, p, tokens))
            }
            HashMode::Dynamo => Ok(self
                .dynamo_blocks_after(parent, tokens)?
                .into_iter()
                .map(|b| BlockKey::from_u64(b.sequence_hash))
                .collect()),
            HashMode::Opaque => Ok(Vec::new()),
        }
    }

    /// Dynamo's view of every full block of `tokens`: sequence hash (the
    /// key) and tokens hash, from Dynamo's own crate with this namespace's
    /// salt and adapter as Dynamo's salt and LoRA name. Refused outside
    /// dynamo mode.
    pub fn dynamo_blocks(&self, tokens: &[u32]) -> Result<Vec<DynamoBlock>> {
        self.dynamo_blocks_after(None, tokens)
    }

    /// [`Self::dynamo_blocks`] of `tokens` when they follow the block
    /// `parent` (an 8-byte Dynamo key): the blocks Dynamo computes for them
    /// when it hashes the parent's whole prefix and `tokens` as one list.
    pub fn dynamo_blocks_after(
        &self,
        parent: Option<BlockKey>,
        tokens: &[u32],
    ) -> Result<Vec<DynamoBlock>> {
        if self.hash_mode != HashMode::Dynamo {
            return Err(Error::InvalidNamespace {
                field: "hash_mode",
                reason: format!(
                    "Dynamo block hashes need a dynamo-mode namespace, this one is {}",
                    self.hash_mode.as_str()
                ),
            });
        }
        let parent = parent
            .map(|k| {
                k.as_u64()
                    .ok_or_else(|| parent_len_err(&k, "a dynamo-mode key is 8 bytes"))
            })
            .transpose()?;
        let salt = std::str::from_utf8(&self.tenant_salt).map_err(|_| Error::InvalidNamespace {
            field: "tenant_salt",
            reason: "dynamo mode needs a UTF-8 salt".into(),
        })?;
        dynamo_blocks_after(
            salt,
            &self.adapter,
            self.layout.tokens_per_block,
            parent,
            tokens,
        )
    }
}

fn parent_len_err(k: &BlockKey, reason: &'static str) -> Error {
    Error::InvalidKey {
        input: k.to_hex(),
        reason,
    }
}

fn put_str(v: &mut Vec<u8>, s: &[u8]) {
    v.extend_from_slice(&(s.len() as u32).to_le_bytes());
    v.extend_from_slice(s);
}

/// A namespace's short id: 16 bytes, shown as 32 hex digits. Directory name
/// on G3, object prefix on G4, top-level directory in the mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NamespaceId(pub [u8; 16]);

impl NamespaceId {
    /// From a full namespace digest.
    pub fn from_digest(d: &[u8; 32]) -> Self {
        let mut b = [0u8; 16];
        b.copy_from_slice(&d[..16]);
        NamespaceId(b)
    }

    /// Parses exactly 32 hex digits; refuses anything else.
    pub fn from_hex(s: &str) -> Result<Self> {
        let k = BlockKey::from_hex(s)?;
        if k.len() != 16 {
            return Err(Error::InvalidKey {
                input: s.chars().take(70).collect(),
                reason: "a namespace id is exactly 32 hex digits",
            });
        }
        let mut b = [0u8; 16];
        b.copy_from_slice(k.as_bytes());
        Ok(NamespaceId(b))
    }

    /// 32 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        BlockKey::from_bytes(&self.0)
            .map(|k| k.to_hex())
            .unwrap_or_default()
    }
}

impl std::fmt::Display for NamespaceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// The one naming scheme used on G3, G4 and in the mount:
/// `<namespace-id>/<shard>/<key-hex>`.
pub fn block_path(ns: &NamespaceId, key: &BlockKey) -> String {
    format!("{}/{}/{}", ns.to_hex(), key.shard(), key.to_hex())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns() -> Namespace {
        Namespace::new("m", KvLayout::llama3_8b(4), "", b"t".to_vec()).unwrap()
    }

    #[test]
    fn block_bytes_matches_the_primer() {
        assert_eq!(KvLayout::llama3_8b(16).block_bytes(), 2 << 20);
        assert_eq!(
            KvLayout::with_block_bytes(65536).unwrap().block_bytes(),
            65536
        );
    }

    #[test]
    fn hostile_layout_saturates_and_is_refused() {
        let mut l = KvLayout::llama3_8b(16);
        l.layers = u32::MAX;
        l.head_dim = u32::MAX;
        l.kv_heads = u32::MAX;
        assert_eq!(l.block_bytes(), u64::MAX);
        assert!(l.validate().is_err());
    }

    /// The v1 encoding is frozen: a default namespace's id must never move,
    /// or every stored block would become unreachable.
    #[test]
    fn default_namespace_identity_is_frozen() {
        let n = Namespace::new("m", KvLayout::llama3_8b(16), "a", b"t".to_vec()).unwrap();
        assert_eq!(n.id().to_hex(), V1_ID);
        let d = n.clone().with_hash_mode(HashMode::Dynamo).unwrap();
        let o = n.clone().with_hash_mode(HashMode::Opaque).unwrap();
        let r = n.clone().with_rank(0);
        let ids = [n.id(), d.id(), o.id(), r.id(), d.clone().with_rank(0).id()];
        for (i, a) in ids.iter().enumerate() {
            for b in &ids[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(
            n.with_hash_mode(HashMode::Blake3).unwrap().id().to_hex(),
            V1_ID
        );
    }
    /// Computed by the v1 encoder before the extension fields existed.
    const V1_ID: &str = "50b82e751a3d293418cafa00f464c653";

    #[test]
    fn dynamo_mode_needs_a_utf8_salt() {
        let n = Namespace::new("m", KvLayout::llama3_8b(16), "", vec![0xff]).unwrap();
        assert!(n.with_hash_mode(HashMode::Dynamo).is_err());
    }

    #[test]
    fn namespace_id_parse() {
        let id = ns().id();
        assert_eq!(NamespaceId::from_hex(&id.to_hex()).unwrap(), id);
        assert!(NamespaceId::from_hex("abcd").is_err());
        assert!(NamespaceId::from_hex("..").is_err());
    }
}
