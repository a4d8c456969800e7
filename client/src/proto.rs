//! The kvtierd wire protocol: small, versioned, length-prefixed binary
//! frames over a Unix socket. Bulk bytes never travel here; they go through
//! the per-client shared region ([`crate::shm`]) or a passed file descriptor.
//!
//! ```text
//! frame   = len:u32le  version:u8  op:u8  flags:u16le(=0)  req_id:u32le  body
//!           `len` counts every byte after itself: 8 + body, at most FRAME_BYTES_MAX
//! key     = len:u8 (1..=64)  bytes
//! ns      = 16 bytes (NamespaceId)
//! list    = count:u32le (<= KEYS_MAX)  items
//! string  = len:u32le  utf-8
//! ```
//! Replies carry the request's op with bit 0x80 set (or [`OP_ERROR`]) and
//! the request's `req_id`; events on a subscribed connection use
//! [`OP_EVENT`]. Every decoder checks every length against the bytes present
//! and the protocol limits before allocating, refuses unknown codes and
//! trailing bytes, and never panics (the cargo-fuzz target in `client/fuzz`
//! and a proptest in the e2e suite hold it to that).

use crate::checksum::PayloadSum;
use crate::error::{Error, Result};
use crate::events::KvEvent;
use crate::key::{BlockKey, KEY_BYTES_MAX};
use crate::namespace::NamespaceId;
use crate::types::{Hints, Tier};
use std::io::IoSlice;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Protocol version this build speaks.
pub const PROTOCOL_VERSION: u8 = 1;
/// Largest frame (after the length prefix), in bytes.
pub const FRAME_BYTES_MAX: usize = 1 << 20;
/// Bytes of the fixed frame header after the length prefix.
pub const FRAME_HEADER_BYTES: usize = 8;
/// Most keys (or items, or lease ids) one request or reply may carry.
pub const KEYS_MAX: usize = 4096;
/// Most file descriptors one direct-read reply may carry (the kernel's
/// SCM_MAX_FD is 253).
pub const FDS_MAX: usize = 128;
/// Longest string (error message, stats JSON) in a frame.
pub const STRING_BYTES_MAX: usize = FRAME_BYTES_MAX - 64;
/// Most namespaces one [`Request::LookupMany`] may name (the daemon's work
/// is at most this many in-memory prefix probes of `KEYS_MAX` keys).
pub const LOOKUP_NAMESPACES_MAX: usize = 64;
/// Shared-region offsets and lengths are multiples of this (O_DIRECT).
pub const SHM_ALIGN_BYTES: u64 = 4096;

/// Op: handshake; carries the client's shared-region memfd (SCM_RIGHTS).
pub const OP_HELLO: u8 = 1;
/// Op: longest cached prefix of a chain.
pub const OP_LOOKUP: u8 = 2;
/// Op: store blocks from the shared region.
pub const OP_OFFLOAD: u8 = 3;
/// Op: read blocks into the shared region, or pass their files.
pub const OP_ONBOARD: u8 = 4;
/// Op: release leases.
pub const OP_RELEASE: u8 = 5;
/// Op: pin keys for a while.
pub const OP_PIN: u8 = 6;
/// Op: unpin keys.
pub const OP_UNPIN: u8 = 7;
/// Op: evict keys.
pub const OP_EVICT: u8 = 8;
/// Op: per-key metadata.
pub const OP_STAT: u8 = 9;
/// Op: daemon-wide statistics (JSON).
pub const OP_STATS: u8 = 10;
/// Op: page through stored blocks.
pub const OP_LIST: u8 = 11;
/// Op: turn this connection into a KV event stream.
pub const OP_SUBSCRIBE: u8 = 12;
/// Op: verify blocks on the daemon's side (and repair bad ones).
pub const OP_VERIFY: u8 = 13;
/// Op: the client found a block it read over a passed fd corrupt; the
/// daemon re-verifies its own copy and, only on a real mismatch,
/// quarantines and repairs it (a report alone never removes a block).
pub const OP_REPORT_CORRUPT: u8 = 14;
/// Op: fetch the non-local blocks of a chain into G3 in the background.
/// (16: 15 is free.)
pub const OP_PREFETCH: u8 = 16;
/// Op: longest cached prefix of one chain in each of several namespaces
/// (a tensor-parallel group's ranks hold the same keys, one namespace
/// each): one request where a lookup per namespace took N.
pub const OP_LOOKUP_MANY: u8 = 17;
/// Op: say which engine and model a namespace belongs to, for the
/// operator's view (`kvtier stats`, `kvtier ls`, `/metrics`). Additive:
/// an older daemon answers it with an error, which clients ignore.
/// (18: 17 is batched lookups'.)
pub const OP_DESCRIBE: u8 = 18;
/// Longest engine name a [`Request::Describe`] carries, in bytes.
pub const DESCRIBE_ENGINE_BYTES_MAX: usize = 32;
/// Longest model name a [`Request::Describe`] carries, in bytes (a
/// client cuts a longer one at a character boundary).
pub const DESCRIBE_MODEL_BYTES_MAX: usize = 256;
/// Reply bit.
pub const OP_REPLY: u8 = 0x80;
/// An event on a subscribed connection.
pub const OP_EVENT: u8 = 0xFE;
/// An error reply.
pub const OP_ERROR: u8 = 0xFF;

/// The hello's `pid` word carries the client's pid in its low 24 bits
/// (Linux's `pid_max` is at most 2^22) and, in its top byte, the
/// `FEATURE_*` bits: what the client decodes beyond the first protocol.
/// A daemon before them reads the whole word as the pid, which it only
/// logs; a daemon ignores bits it does not know (a newer client's).
pub const HELLO_PID_MASK: u32 = 0x00FF_FFFF;
/// Feature: the client decodes [`ItemStatus::Timeout`].
pub const FEATURE_TIMEOUT_STATUS: u8 = 1;
/// Feature: the client decodes [`ItemStatus::StoredUnpinned`] (clients
/// from before it fail a whole reply on an unknown code; they announce no
/// feature bit and get `Ok`, what daemons before the code answered).
pub const FEATURE_STORED_UNPINNED_STATUS: u8 = 2;
/// The features this build decodes (what its clients announce).
pub const FEATURES: u8 = FEATURE_TIMEOUT_STATUS | FEATURE_STORED_UNPINNED_STATUS;

/// Per-item outcome codes used in replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ItemStatus {
    /// Done (stored, pinned, evicted, hit).
    Ok = 0,
    /// Offload of a key that exists: nothing written.
    AlreadyPresent = 1,
    /// The daemon does not hold the block.
    Absent = 2,
    /// The block failed verification (quarantined).
    Corrupt = 3,
    /// A tier could not be asked in time.
    Unavailable = 4,
    /// The item was invalid (bad offset, header, checksum, namespace).
    Invalid = 5,
    /// The store is full.
    NoSpace = 6,
    /// A bound (leases, pins) is exhausted.
    LimitReached = 7,
    /// Any other storage failure.
    Failed = 8,
    /// The block failed verification, was quarantined and replaced by a
    /// verified copy from G4 or a peer (`Verify` with repair).
    Repaired = 9,
    /// Offload: stored and durable, but the pin it asked for was refused
    /// (the daemon's pin budget is spent): it is evicted like any other
    /// block. Daemons before this code answered `Ok` and dropped the pin;
    /// sent only to a client whose hello announced
    /// [`FEATURE_STORED_UNPINNED_STATUS`], others get that `Ok`.
    StoredUnpinned = 10,
    /// A tier that may hold the block did not answer within its deadline
    /// (a hung or slow object store). Sent only to a client whose hello
    /// announced [`FEATURE_TIMEOUT_STATUS`]; others get `Unavailable`
    /// ([`Response::for_features`]).
    Timeout = 11,
}

/// Which tiers an [`Request::Evict`] removes a block from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum EvictTier {
    /// This node's disk only (G4 keeps its copy): the default, and what
    /// frames without a tier byte mean.
    #[default]
    G3 = 0,
    /// The shared object store only.
    G4 = 1,
    /// Everywhere this node can reach: G3 and G4.
    All = 2,
}

impl EvictTier {
    /// From the wire code.
    pub fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            0 => EvictTier::G3,
            1 => EvictTier::G4,
            2 => EvictTier::All,
            _ => return None,
        })
    }

    /// Includes G3.
    pub fn g3(self) -> bool {
        matches!(self, EvictTier::G3 | EvictTier::All)
    }

    /// Includes G4.
    pub fn g4(self) -> bool {
        matches!(self, EvictTier::G4 | EvictTier::All)
    }

    /// `g3`, `g4` or `all`.
    pub fn name(self) -> &'static str {
        match self {
            EvictTier::G3 => "g3",
            EvictTier::G4 => "g4",
            EvictTier::All => "all",
        }
    }
}

impl std::str::FromStr for EvictTier {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "g3" => Ok(EvictTier::G3),
            "g4" => Ok(EvictTier::G4),
            "all" => Ok(EvictTier::All),
            other => Err(proto(format!(
                "evict tier {other:?}: expected g3, g4 or all"
            ))),
        }
    }
}

impl ItemStatus {
    /// From the wire code.
    pub fn from_code(c: u8) -> Option<Self> {
        use ItemStatus::*;
        Some(match c {
            0 => Ok,
            1 => AlreadyPresent,
            2 => Absent,
            3 => Corrupt,
            4 => Unavailable,
            5 => Invalid,
            6 => NoSpace,
            7 => LimitReached,
            8 => Failed,
            9 => Repaired,
            10 => StoredUnpinned,
            11 => Timeout,
            _ => return None,
        })
    }

    /// This status as a client with hello `features` can decode it: a
    /// status newer than what the client announced becomes the older one
    /// it refines (an unknown code fails the client's whole reply, not
    /// just the item).
    pub fn for_features(self, features: u8) -> Self {
        match self {
            ItemStatus::Timeout if features & FEATURE_TIMEOUT_STATUS == 0 => {
                ItemStatus::Unavailable
            }
            ItemStatus::StoredUnpinned if features & FEATURE_STORED_UNPINNED_STATUS == 0 => {
                ItemStatus::Ok
            }
            s => s,
        }
    }
}

/// Error codes of [`Response::Error`].
pub mod code {
    /// The frame could not be decoded.
    pub const MALFORMED: u16 = 1;
    /// The frame exceeds a limit.
    pub const TOO_LARGE: u16 = 2;
    /// The protocol version is not spoken.
    pub const VERSION: u16 = 3;
    /// A request needs the shared region, which was not set up.
    pub const NO_REGION: u16 = 4;
    /// The daemon is out of a bounded resource.
    pub const BUSY: u16 = 5;
    /// The daemon failed.
    pub const INTERNAL: u16 = 6;
    /// The daemon is shutting down.
    pub const SHUTTING_DOWN: u16 = 7;
    /// The caller's uid/gid may not do this (not a tenant, or an admin
    /// operation without admin rights).
    pub const DENIED: u16 = 8;
}

/// How onboarded bytes reach the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum OnboardMode {
    /// The daemon reads header + payload into the shared region.
    Shm = 0,
    /// The daemon passes the block file's fd; the client reads it.
    DirectFd = 1,
}

/// One block of an offload: its 4096-byte header and then its payload lie
/// in the shared region at `shm_offset` (the header names the key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffloadItem {
    /// Offset of the header in the shared region (4096-aligned).
    pub shm_offset: u64,
    /// The previous block of the chain, for events and prefix-aware policy.
    pub parent: Option<BlockKey>,
    /// Engine hints.
    pub hints: Hints,
}

/// One block of an onboard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OnboardItem {
    /// The block.
    pub key: BlockKey,
    /// Where the header goes in the shared region (4096-aligned; payload at
    /// `+4096`). Ignored in direct mode.
    pub shm_offset: u64,
    /// Bytes available there (header + padded payload).
    pub shm_len: u64,
}

/// A request frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// First frame of a connection; the memfd of the shared region rides
    /// along as SCM_RIGHTS when `shm_bytes > 0`.
    Hello {
        /// Bytes of the shared region (0: none, control-only client).
        shm_bytes: u64,
        /// The client's pid, for logs (at most [`HELLO_PID_MASK`]).
        pid: u32,
        /// `FEATURE_*` bits: what the client decodes beyond the first
        /// protocol (the top byte of the pid word on the wire).
        features: u8,
    },
    /// Longest cached prefix of `keys` (a chain, in order).
    Lookup {
        /// Namespace.
        ns: NamespaceId,
        /// The chain.
        keys: Vec<BlockKey>,
    },
    /// Longest cached prefix of the chain `keys` in each of `nss`.
    LookupMany {
        /// Namespaces (1..=LOOKUP_NAMESPACES_MAX).
        nss: Vec<NamespaceId>,
        /// The chain.
        keys: Vec<BlockKey>,
    },
    /// Store blocks from the shared region.
    Offload {
        /// Namespace.
        ns: NamespaceId,
        /// Blocks.
        items: Vec<OffloadItem>,
    },
    /// Read blocks.
    Onboard {
        /// Namespace.
        ns: NamespaceId,
        /// Delivery.
        mode: OnboardMode,
        /// Lease time; 0 = release as soon as the reply is sent.
        lease_ttl_ms: u32,
        /// Blocks.
        items: Vec<OnboardItem>,
    },
    /// Release leases.
    Release {
        /// Lease ids from onboard replies.
        leases: Vec<u64>,
    },
    /// Pin keys for `ttl_ms`.
    Pin {
        /// Namespace.
        ns: NamespaceId,
        /// Pin duration (capped by the daemon).
        ttl_ms: u32,
        /// Keys.
        keys: Vec<BlockKey>,
    },
    /// Unpin keys.
    Unpin {
        /// Namespace.
        ns: NamespaceId,
        /// Keys.
        keys: Vec<BlockKey>,
    },
    /// Evict keys from `tier` (G3 by default). On the wire the tier is a
    /// trailing byte, sent only when not G3, so frames of older clients
    /// (no byte) still decode, as G3.
    Evict {
        /// Namespace.
        ns: NamespaceId,
        /// Keys.
        keys: Vec<BlockKey>,
        /// Which tiers.
        tier: EvictTier,
    },
    /// Verify blocks on the daemon: a G3 copy that fails is quarantined
    /// and, with `repair`, replaced by a verified copy from G4 or a peer.
    /// Reply: `Items` (Ok, Repaired, Corrupt = dropped, Absent).
    Verify {
        /// Namespace.
        ns: NamespaceId,
        /// Keys.
        keys: Vec<BlockKey>,
        /// Re-fetch a good copy of a bad block.
        repair: bool,
    },
    /// Blocks this client read over a passed fd and found corrupt. The
    /// daemon re-verifies each (a report is a hint, never trusted): a
    /// copy that fails is quarantined (lookups stop reporting it) and
    /// replaced by a verified copy from G4 or a peer. Reply: `Items`
    /// (Repaired; Corrupt = confirmed, no good copy anywhere; Ok = the
    /// daemon's copy verifies, nothing done; Absent).
    ReportCorrupt {
        /// Namespace.
        ns: NamespaceId,
        /// Keys.
        keys: Vec<BlockKey>,
    },
    /// Metadata of keys.
    Stat {
        /// Namespace.
        ns: NamespaceId,
        /// Keys.
        keys: Vec<BlockKey>,
    },
    /// Daemon statistics.
    Stats,
    /// Page through stored blocks in (namespace, key) order.
    List {
        /// Only this namespace.
        ns: Option<NamespaceId>,
        /// Start after this entry.
        after: Option<(NamespaceId, BlockKey)>,
        /// Page size (<= KEYS_MAX).
        limit: u32,
    },
    /// Turn the connection into an event stream.
    Subscribe,
    /// "This chain will be needed": the daemon fetches the blocks of `keys`
    /// that are not local (from peers or G4) into G3 in the background,
    /// within `deadline_ms`. Per key: `Ok` queued, `AlreadyPresent` local,
    /// `LimitReached` no room, `Absent` no remote tier. A later prefetch of
    /// the same uid, `stream` (non-zero) and namespace drops the queued keys
    /// it no longer names.
    Prefetch {
        /// Namespace.
        ns: NamespaceId,
        /// How long the blocks are worth fetching (capped by the daemon).
        deadline_ms: u32,
        /// The caller's name for what it prefetches for (a request, a
        /// session); 0: never superseded.
        stream: u64,
        /// The chain (or the part of it the caller expects to miss).
        keys: Vec<BlockKey>,
    },
    /// Which engine and model `ns` belongs to (labels for the operator;
    /// never part of a block's identity). Reply: `Items` with one status:
    /// Ok, or Invalid for a namespace the caller may not use, or
    /// LimitReached when the daemon already keeps its most descriptions.
    Describe {
        /// Namespace.
        ns: NamespaceId,
        /// The engine (`vllm`, `sglang`, `lmcache`, ...), at most
        /// [`DESCRIBE_ENGINE_BYTES_MAX`] bytes of `[a-z0-9._-]`.
        engine: String,
        /// The model, at most [`DESCRIBE_MODEL_BYTES_MAX`] bytes, no
        /// control characters.
        model: String,
    },
}

/// `model` as a [`Request::Describe`] carries it: control characters
/// replaced by spaces, cut to [`DESCRIBE_MODEL_BYTES_MAX`] bytes at a
/// character boundary.
pub fn description_model(model: &str) -> String {
    let mut out = String::with_capacity(model.len().min(DESCRIBE_MODEL_BYTES_MAX));
    for c in model.chars() {
        let c = if c.is_control() { ' ' } else { c };
        if out.len() + c.len_utf8() > DESCRIBE_MODEL_BYTES_MAX {
            break;
        }
        out.push(c);
    }
    out
}

/// Whether `engine` and `model` are what a [`Request::Describe`] may
/// carry (the error says why not).
pub fn check_description(engine: &str, model: &str) -> Result<()> {
    if engine.is_empty()
        || engine.len() > DESCRIBE_ENGINE_BYTES_MAX
        || !engine
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
    {
        return Err(proto(format!(
            "engine name {engine:?}: 1..={DESCRIBE_ENGINE_BYTES_MAX} bytes of [a-z0-9._-]"
        )));
    }
    if model.len() > DESCRIBE_MODEL_BYTES_MAX || model.chars().any(char::is_control) {
        return Err(proto(format!(
            "model name of {} bytes: at most {DESCRIBE_MODEL_BYTES_MAX}, no control characters",
            model.len()
        )));
    }
    Ok(())
}

/// Per-item result of an onboard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OnboardResult {
    /// Outcome.
    pub status: ItemStatus,
    /// Tier the bytes came from.
    pub tier: Tier,
    /// Lease id (0: none held).
    pub lease_id: u64,
    /// Payload bytes.
    pub payload_len: u64,
    /// The payload's checksum, from the verified header.
    pub payload_sum: PayloadSum,
    /// Direct mode: index of the fd in this reply's SCM_RIGHTS, else u32::MAX.
    pub fd_index: u32,
    /// Direct mode: offset of the header in that file (payload at +4096).
    pub file_offset: u64,
}

/// Metadata of one stored block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockStat {
    /// Tier.
    pub tier: Tier,
    /// Payload bytes.
    pub payload_len: u64,
    /// The payload's checksum.
    pub payload_sum: PayloadSum,
    /// When it was first stored (ms since epoch).
    pub created_unix_ms: u64,
    /// Pinned until (ms since epoch; 0 = not pinned).
    pub pinned_until_unix_ms: u64,
    /// Leases held on it.
    pub leases: u32,
}

/// One entry of a list page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListEntry {
    /// Namespace.
    pub ns: NamespaceId,
    /// Key.
    pub key: BlockKey,
    /// Metadata.
    pub stat: BlockStat,
}

/// A reply or event frame.
#[derive(Debug, Clone, PartialEq)]
pub enum Response {
    /// Handshake reply with the daemon's limits.
    Hello {
        /// Protocol version.
        version: u8,
        /// Session id (for logs).
        session_id: u64,
        /// Most keys per request.
        keys_max: u32,
        /// Longest lease.
        lease_ttl_max_ms: u32,
    },
    /// Tier of each block of the cached prefix (its length is the prefix).
    Lookup {
        /// Tiers.
        tiers: Vec<Tier>,
    },
    /// Per namespace of a [`Request::LookupMany`], in its order: the tier
    /// of each block of that namespace's cached prefix.
    LookupMany {
        /// Tiers per namespace.
        tiers: Vec<Vec<Tier>>,
    },
    /// Per-item outcomes (offload, pin, unpin, evict, release counts).
    Items {
        /// Outcomes.
        status: Vec<ItemStatus>,
    },
    /// Onboard results.
    Onboard {
        /// Results.
        items: Vec<OnboardResult>,
    },
    /// Stat results.
    Stat {
        /// Per key, `None` when absent.
        entries: Vec<Option<BlockStat>>,
    },
    /// Statistics as a JSON document.
    Stats {
        /// JSON.
        json: String,
    },
    /// A list page.
    List {
        /// Entries.
        entries: Vec<ListEntry>,
        /// Cursor for the next page, if any.
        next: Option<(NamespaceId, BlockKey)>,
    },
    /// Subscription accepted; events follow.
    Subscribed,
    /// A KV event.
    Event(KvEvent),
    /// The request failed.
    Error {
        /// See [`code`].
        code: u16,
        /// For a person.
        message: String,
    },
}

fn proto(reason: impl Into<String>) -> Error {
    Error::Protocol {
        reason: reason.into(),
    }
}

/// Bounds-checked little-endian reader over one frame body.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// Reads from `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }
    /// The next `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| proto(format!("truncated: {n} bytes wanted at {}", self.pos)))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    /// One byte.
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.bytes(1)?[0])
    }
    /// u16 LE.
    pub fn u16(&mut self) -> Result<u16> {
        let b = self.bytes(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    /// u32 LE.
    pub fn u32(&mut self) -> Result<u32> {
        let b = self.bytes(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    /// u64 LE.
    pub fn u64(&mut self) -> Result<u64> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.bytes(8)?);
        Ok(u64::from_le_bytes(a))
    }
    /// 32 raw bytes.
    pub fn b32(&mut self) -> Result<[u8; 32]> {
        let mut a = [0u8; 32];
        a.copy_from_slice(self.bytes(32)?);
        Ok(a)
    }
    /// A boolean byte (0 or 1 only).
    pub fn bool(&mut self) -> Result<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(proto(format!("boolean byte {b}"))),
        }
    }
    /// A length-prefixed key.
    pub fn key(&mut self) -> Result<BlockKey> {
        let n = self.u8()? as usize;
        if n == 0 || n > KEY_BYTES_MAX {
            return Err(proto(format!("key length {n}")));
        }
        BlockKey::from_bytes(self.bytes(n)?)
    }
    /// An optional key (flag byte then key).
    pub fn opt_key(&mut self) -> Result<Option<BlockKey>> {
        Ok(if self.bool()? {
            Some(self.key()?)
        } else {
            None
        })
    }
    /// A namespace id.
    pub fn ns(&mut self) -> Result<NamespaceId> {
        let mut a = [0u8; 16];
        a.copy_from_slice(self.bytes(16)?);
        Ok(NamespaceId(a))
    }
    /// A list count, checked against `max` and against the bytes left
    /// (each item at least `min_item_bytes`), so no hostile count allocates.
    pub fn count(&mut self, max: usize, min_item_bytes: usize) -> Result<usize> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(proto(format!("{n} items, at most {max}")));
        }
        if n.saturating_mul(min_item_bytes.max(1)) > self.buf.len() - self.pos {
            return Err(proto(format!("{n} items do not fit in the frame")));
        }
        Ok(n)
    }
    /// A length-prefixed UTF-8 string.
    pub fn string(&mut self) -> Result<String> {
        let n = self.u32()? as usize;
        if n > STRING_BYTES_MAX {
            return Err(proto(format!("string of {n} bytes")));
        }
        String::from_utf8(self.bytes(n)?.to_vec()).map_err(|_| proto("string is not UTF-8"))
    }
    /// A tier code.
    pub fn tier(&mut self) -> Result<Tier> {
        let c = self.u8()?;
        Tier::from_code(c).ok_or_else(|| proto(format!("tier code {c}")))
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Fails unless every byte was consumed.
    pub fn finish(&self) -> Result<()> {
        if self.pos != self.buf.len() {
            return Err(proto(format!(
                "{} trailing bytes",
                self.buf.len() - self.pos
            )));
        }
        Ok(())
    }
}

/// Little-endian frame writer.
pub struct Writer(pub Vec<u8>);

impl Writer {
    /// A frame with its header; the length is patched by [`Writer::finish`].
    pub fn frame(op: u8, req_id: u32) -> Self {
        let mut v = Vec::with_capacity(64);
        v.extend_from_slice(&[0, 0, 0, 0, PROTOCOL_VERSION, op, 0, 0]);
        v.extend_from_slice(&req_id.to_le_bytes());
        Writer(v)
    }
    /// One byte.
    pub fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    /// u16 LE.
    pub fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// u32 LE.
    pub fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// u64 LE.
    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// Raw bytes.
    pub fn raw(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
    /// A length-prefixed key.
    pub fn key(&mut self, k: &BlockKey) {
        self.0.push(k.len() as u8);
        self.0.extend_from_slice(k.as_bytes());
    }
    /// An optional key.
    pub fn opt_key(&mut self, k: &Option<BlockKey>) {
        match k {
            Some(k) => {
                self.u8(1);
                self.key(k);
            }
            None => self.u8(0),
        }
    }
    /// A namespace id.
    pub fn ns(&mut self, n: &NamespaceId) {
        self.0.extend_from_slice(&n.0);
    }
    /// A count.
    pub fn count(&mut self, n: usize) {
        self.u32(n as u32);
    }
    /// A string (truncated to the limit at a char boundary).
    pub fn string(&mut self, s: &str) {
        let mut end = s.len().min(STRING_BYTES_MAX);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u32(end as u32);
        self.0.extend_from_slice(&s.as_bytes()[..end]);
    }
    /// Patches the length prefix and returns the frame bytes.
    pub fn finish(mut self) -> Vec<u8> {
        let len = (self.0.len() - 4) as u32;
        self.0[..4].copy_from_slice(&len.to_le_bytes());
        self.0
    }
}

/// The fixed header of a frame body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Op code.
    pub op: u8,
    /// Request id.
    pub req_id: u32,
}

/// Splits a frame body (everything after the length prefix) into its
/// validated header and the payload.
pub fn split_frame(body: &[u8]) -> Result<(FrameHeader, &[u8])> {
    if body.len() < FRAME_HEADER_BYTES {
        return Err(proto(format!("frame of {} bytes", body.len())));
    }
    if body.len() > FRAME_BYTES_MAX {
        return Err(proto(format!("frame of {} bytes", body.len())));
    }
    if body[0] != PROTOCOL_VERSION {
        return Err(proto(format!(
            "protocol version {}, this build speaks {PROTOCOL_VERSION}",
            body[0]
        )));
    }
    if body[2] != 0 || body[3] != 0 {
        return Err(proto("unknown flags set"));
    }
    let req_id = u32::from_le_bytes([body[4], body[5], body[6], body[7]]);
    Ok((
        FrameHeader {
            op: body[1],
            req_id,
        },
        &body[FRAME_HEADER_BYTES..],
    ))
}

fn write_keys(w: &mut Writer, keys: &[BlockKey]) {
    w.count(keys.len());
    for k in keys {
        w.key(k);
    }
}

fn read_keys(r: &mut Reader<'_>) -> Result<Vec<BlockKey>> {
    let n = r.count(KEYS_MAX, 2)?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(r.key()?);
    }
    Ok(v)
}

fn check_aligned(what: &str, v: u64) -> Result<u64> {
    if !v.is_multiple_of(SHM_ALIGN_BYTES) {
        return Err(proto(format!("{what} {v} is not a multiple of 4096")));
    }
    Ok(v)
}

impl Request {
    /// The op code.
    pub fn op(&self) -> u8 {
        match self {
            Request::Hello { .. } => OP_HELLO,
            Request::Lookup { .. } => OP_LOOKUP,
            Request::LookupMany { .. } => OP_LOOKUP_MANY,
            Request::Offload { .. } => OP_OFFLOAD,
            Request::Onboard { .. } => OP_ONBOARD,
            Request::Release { .. } => OP_RELEASE,
            Request::Pin { .. } => OP_PIN,
            Request::Unpin { .. } => OP_UNPIN,
            Request::Evict { .. } => OP_EVICT,
            Request::Verify { .. } => OP_VERIFY,
            Request::ReportCorrupt { .. } => OP_REPORT_CORRUPT,
            Request::Stat { .. } => OP_STAT,
            Request::Stats => OP_STATS,
            Request::List { .. } => OP_LIST,
            Request::Subscribe => OP_SUBSCRIBE,
            Request::Prefetch { .. } => OP_PREFETCH,
            Request::Describe { .. } => OP_DESCRIBE,
        }
    }

    /// Short name for logs and metrics.
    pub fn op_name(op: u8) -> &'static str {
        match op {
            OP_HELLO => "hello",
            OP_LOOKUP => "lookup",
            OP_LOOKUP_MANY => "lookup_many",
            OP_OFFLOAD => "offload",
            OP_ONBOARD => "onboard",
            OP_RELEASE => "release",
            OP_PIN => "pin",
            OP_UNPIN => "unpin",
            OP_EVICT => "evict",
            OP_STAT => "stat",
            OP_STATS => "stats",
            OP_LIST => "list",
            OP_SUBSCRIBE => "subscribe",
            OP_VERIFY => "verify",
            OP_REPORT_CORRUPT => "report_corrupt",
            OP_PREFETCH => "prefetch",
            OP_DESCRIBE => "describe",
            _ => "unknown",
        }
    }

    /// Encodes a whole frame (with its length prefix).
    pub fn encode(&self, req_id: u32) -> Vec<u8> {
        let mut w = Writer::frame(self.op(), req_id);
        match self {
            Request::Hello {
                shm_bytes,
                pid,
                features,
            } => {
                w.u64(*shm_bytes);
                w.u32((pid & HELLO_PID_MASK) | u32::from(*features) << 24);
            }
            Request::Lookup { ns, keys }
            | Request::Unpin { ns, keys }
            | Request::ReportCorrupt { ns, keys }
            | Request::Stat { ns, keys } => {
                w.ns(ns);
                write_keys(&mut w, keys);
            }
            Request::LookupMany { nss, keys } => {
                w.count(nss.len());
                for ns in nss {
                    w.ns(ns);
                }
                write_keys(&mut w, keys);
            }
            Request::Evict { ns, keys, tier } => {
                w.ns(ns);
                write_keys(&mut w, keys);
                if *tier != EvictTier::G3 {
                    w.u8(*tier as u8);
                }
            }
            Request::Verify { ns, keys, repair } => {
                w.ns(ns);
                write_keys(&mut w, keys);
                w.u8(u8::from(*repair));
            }
            Request::Offload { ns, items } => {
                w.ns(ns);
                w.count(items.len());
                for it in items {
                    w.u64(it.shm_offset);
                    w.opt_key(&it.parent);
                    w.u8(it.hints.priority);
                    w.u8(it.hints.pinned as u8);
                    w.u8(it.hints.ephemeral as u8);
                    w.u16(it.hints.expected_reuse);
                }
            }
            Request::Onboard {
                ns,
                mode,
                lease_ttl_ms,
                items,
            } => {
                w.ns(ns);
                w.u8(*mode as u8);
                w.u32(*lease_ttl_ms);
                w.count(items.len());
                for it in items {
                    w.key(&it.key);
                    w.u64(it.shm_offset);
                    w.u64(it.shm_len);
                }
            }
            Request::Release { leases } => {
                w.count(leases.len());
                for l in leases {
                    w.u64(*l);
                }
            }
            Request::Pin { ns, ttl_ms, keys } => {
                w.ns(ns);
                w.u32(*ttl_ms);
                write_keys(&mut w, keys);
            }
            Request::Prefetch {
                ns,
                deadline_ms,
                stream,
                keys,
            } => {
                w.ns(ns);
                w.u32(*deadline_ms);
                w.u64(*stream);
                write_keys(&mut w, keys);
            }
            Request::Describe { ns, engine, model } => {
                w.ns(ns);
                w.string(engine);
                w.string(model);
            }
            Request::Stats | Request::Subscribe => {}
            Request::List { ns, after, limit } => {
                match ns {
                    Some(n) => {
                        w.u8(1);
                        w.ns(n);
                    }
                    None => w.u8(0),
                }
                match after {
                    Some((n, k)) => {
                        w.u8(1);
                        w.ns(n);
                        w.key(k);
                    }
                    None => w.u8(0),
                }
                w.u32(*limit);
            }
        }
        w.finish()
    }

    /// Decodes and validates a request frame body (after the length prefix).
    pub fn decode(body: &[u8]) -> Result<(u32, Request)> {
        let (h, payload) = split_frame(body)?;
        let mut r = Reader::new(payload);
        let req = match h.op {
            OP_HELLO => {
                let shm_bytes = check_aligned("region size", r.u64()?)?;
                let word = r.u32()?;
                Request::Hello {
                    shm_bytes,
                    pid: word & HELLO_PID_MASK,
                    features: (word >> 24) as u8,
                }
            }
            OP_LOOKUP => Request::Lookup {
                ns: r.ns()?,
                keys: read_keys(&mut r)?,
            },
            OP_LOOKUP_MANY => {
                let n = r.count(LOOKUP_NAMESPACES_MAX, 16)?;
                if n == 0 {
                    return Err(proto("lookup_many of no namespace"));
                }
                let mut nss = Vec::with_capacity(n);
                for _ in 0..n {
                    nss.push(r.ns()?);
                }
                Request::LookupMany {
                    nss,
                    keys: read_keys(&mut r)?,
                }
            }
            OP_UNPIN => Request::Unpin {
                ns: r.ns()?,
                keys: read_keys(&mut r)?,
            },
            OP_EVICT => {
                let ns = r.ns()?;
                let keys = read_keys(&mut r)?;
                let tier = if r.remaining() > 0 {
                    let c = r.u8()?;
                    EvictTier::from_code(c).ok_or_else(|| proto(format!("evict tier {c}")))?
                } else {
                    EvictTier::G3
                };
                Request::Evict { ns, keys, tier }
            }
            OP_VERIFY => Request::Verify {
                ns: r.ns()?,
                keys: read_keys(&mut r)?,
                repair: r.bool()?,
            },
            OP_STAT => Request::Stat {
                ns: r.ns()?,
                keys: read_keys(&mut r)?,
            },
            OP_REPORT_CORRUPT => Request::ReportCorrupt {
                ns: r.ns()?,
                keys: read_keys(&mut r)?,
            },
            OP_OFFLOAD => {
                let ns = r.ns()?;
                let n = r.count(KEYS_MAX, 14)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    let shm_offset = check_aligned("offset", r.u64()?)?;
                    let parent = r.opt_key()?;
                    let priority = r.u8()?;
                    let pinned = r.bool()?;
                    let ephemeral = r.bool()?;
                    let expected_reuse = r.u16()?;
                    items.push(OffloadItem {
                        shm_offset,
                        parent,
                        hints: Hints {
                            priority,
                            pinned,
                            ephemeral,
                            expected_reuse,
                        },
                    });
                }
                Request::Offload { ns, items }
            }
            OP_ONBOARD => {
                let ns = r.ns()?;
                let mode = match r.u8()? {
                    0 => OnboardMode::Shm,
                    1 => OnboardMode::DirectFd,
                    m => return Err(proto(format!("onboard mode {m}"))),
                };
                let lease_ttl_ms = r.u32()?;
                let max = if mode == OnboardMode::DirectFd {
                    FDS_MAX
                } else {
                    KEYS_MAX
                };
                let n = r.count(max, 18)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(OnboardItem {
                        key: r.key()?,
                        shm_offset: check_aligned("offset", r.u64()?)?,
                        shm_len: r.u64()?,
                    });
                }
                Request::Onboard {
                    ns,
                    mode,
                    lease_ttl_ms,
                    items,
                }
            }
            OP_RELEASE => {
                let n = r.count(KEYS_MAX, 8)?;
                let mut leases = Vec::with_capacity(n);
                for _ in 0..n {
                    leases.push(r.u64()?);
                }
                Request::Release { leases }
            }
            OP_PIN => Request::Pin {
                ns: r.ns()?,
                ttl_ms: r.u32()?,
                keys: read_keys(&mut r)?,
            },
            OP_PREFETCH => Request::Prefetch {
                ns: r.ns()?,
                deadline_ms: r.u32()?,
                stream: r.u64()?,
                keys: read_keys(&mut r)?,
            },
            OP_DESCRIBE => {
                let ns = r.ns()?;
                let engine = r.string()?;
                let model = r.string()?;
                check_description(&engine, &model)?;
                Request::Describe { ns, engine, model }
            }
            OP_STATS => Request::Stats,
            OP_SUBSCRIBE => Request::Subscribe,
            OP_LIST => {
                let ns = if r.bool()? { Some(r.ns()?) } else { None };
                let after = if r.bool()? {
                    Some((r.ns()?, r.key()?))
                } else {
                    None
                };
                let limit = r.u32()?;
                if limit == 0 || limit as usize > KEYS_MAX {
                    return Err(proto(format!("list limit {limit}")));
                }
                Request::List { ns, after, limit }
            }
            op => return Err(proto(format!("unknown op {op}"))),
        };
        r.finish()?;
        Ok((h.req_id, req))
    }
}

fn write_stat(w: &mut Writer, s: &BlockStat) {
    w.u8(s.tier.code());
    w.u64(s.payload_len);
    w.raw(s.payload_sum.as_bytes());
    w.u64(s.created_unix_ms);
    w.u64(s.pinned_until_unix_ms);
    w.u32(s.leases);
}

fn read_stat(r: &mut Reader<'_>) -> Result<BlockStat> {
    Ok(BlockStat {
        tier: r.tier()?,
        payload_len: r.u64()?,
        payload_sum: PayloadSum::from_bytes(r.b32()?),
        created_unix_ms: r.u64()?,
        pinned_until_unix_ms: r.u64()?,
        leases: r.u32()?,
    })
}

fn read_status(r: &mut Reader<'_>) -> Result<ItemStatus> {
    let c = r.u8()?;
    ItemStatus::from_code(c).ok_or_else(|| proto(format!("status code {c}")))
}

impl Response {
    /// This reply as a client with hello `features` can decode it
    /// ([`ItemStatus::for_features`] on every item): the daemon sends only
    /// statuses the client announced it knows.
    pub fn for_features(mut self, features: u8) -> Self {
        match &mut self {
            Response::Items { status } => {
                for s in status.iter_mut() {
                    *s = s.for_features(features);
                }
            }
            Response::Onboard { items } => {
                for it in items.iter_mut() {
                    it.status = it.status.for_features(features);
                }
            }
            _ => {}
        }
        self
    }

    /// Encodes a reply to request `op` (ignored for events and errors).
    pub fn encode(&self, op: u8, req_id: u32) -> Vec<u8> {
        let frame_op = match self {
            Response::Event(_) => OP_EVENT,
            Response::Error { .. } => OP_ERROR,
            _ => op | OP_REPLY,
        };
        let mut w = Writer::frame(frame_op, req_id);
        match self {
            Response::Hello {
                version,
                session_id,
                keys_max,
                lease_ttl_max_ms,
            } => {
                w.u8(*version);
                w.u64(*session_id);
                w.u32(*keys_max);
                w.u32(*lease_ttl_max_ms);
            }
            Response::Lookup { tiers } => {
                w.count(tiers.len());
                for t in tiers {
                    w.u8(t.code());
                }
            }
            Response::LookupMany { tiers } => {
                w.count(tiers.len());
                for per_ns in tiers {
                    w.count(per_ns.len());
                    for t in per_ns {
                        w.u8(t.code());
                    }
                }
            }
            Response::Items { status } => {
                w.count(status.len());
                for s in status {
                    w.u8(*s as u8);
                }
            }
            Response::Onboard { items } => {
                w.count(items.len());
                for it in items {
                    w.u8(it.status as u8);
                    w.u8(it.tier.code());
                    w.u64(it.lease_id);
                    w.u64(it.payload_len);
                    w.raw(it.payload_sum.as_bytes());
                    w.u32(it.fd_index);
                    w.u64(it.file_offset);
                }
            }
            Response::Stat { entries } => {
                w.count(entries.len());
                for e in entries {
                    match e {
                        Some(s) => {
                            w.u8(1);
                            write_stat(&mut w, s);
                        }
                        None => w.u8(0),
                    }
                }
            }
            Response::Stats { json } => w.string(json),
            Response::List { entries, next } => {
                w.count(entries.len());
                for e in entries {
                    w.ns(&e.ns);
                    w.key(&e.key);
                    write_stat(&mut w, &e.stat);
                }
                match next {
                    Some((n, k)) => {
                        w.u8(1);
                        w.ns(n);
                        w.key(k);
                    }
                    None => w.u8(0),
                }
            }
            Response::Subscribed => {}
            Response::Event(e) => e.encode(&mut w),
            Response::Error { code, message } => {
                w.u16(*code);
                w.string(message);
            }
        }
        w.finish()
    }

    /// Decodes a reply or event frame body; `expect_op` is the request op
    /// this reply must answer (events and errors are accepted regardless).
    pub fn decode(body: &[u8], expect_op: u8) -> Result<(u32, Response)> {
        let (h, payload) = split_frame(body)?;
        let mut r = Reader::new(payload);
        let resp = match h.op {
            OP_EVENT => Response::Event(KvEvent::decode(&mut r)?),
            OP_ERROR => Response::Error {
                code: r.u16()?,
                message: r.string()?,
            },
            op if op == expect_op | OP_REPLY => match expect_op {
                OP_HELLO => Response::Hello {
                    version: r.u8()?,
                    session_id: r.u64()?,
                    keys_max: r.u32()?,
                    lease_ttl_max_ms: r.u32()?,
                },
                OP_LOOKUP => {
                    let n = r.count(KEYS_MAX, 1)?;
                    let mut tiers = Vec::with_capacity(n);
                    for _ in 0..n {
                        tiers.push(r.tier()?);
                    }
                    Response::Lookup { tiers }
                }
                OP_LOOKUP_MANY => {
                    let n = r.count(LOOKUP_NAMESPACES_MAX, 4)?;
                    let mut tiers = Vec::with_capacity(n);
                    for _ in 0..n {
                        let m = r.count(KEYS_MAX, 1)?;
                        let mut per_ns = Vec::with_capacity(m);
                        for _ in 0..m {
                            per_ns.push(r.tier()?);
                        }
                        tiers.push(per_ns);
                    }
                    Response::LookupMany { tiers }
                }
                OP_OFFLOAD | OP_RELEASE | OP_PIN | OP_UNPIN | OP_EVICT | OP_VERIFY
                | OP_REPORT_CORRUPT | OP_PREFETCH | OP_DESCRIBE => {
                    let n = r.count(KEYS_MAX, 1)?;
                    let mut status = Vec::with_capacity(n);
                    for _ in 0..n {
                        status.push(read_status(&mut r)?);
                    }
                    Response::Items { status }
                }
                OP_ONBOARD => {
                    let n = r.count(KEYS_MAX, 62)?;
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(OnboardResult {
                            status: read_status(&mut r)?,
                            tier: r.tier()?,
                            lease_id: r.u64()?,
                            payload_len: r.u64()?,
                            payload_sum: PayloadSum::from_bytes(r.b32()?),
                            fd_index: r.u32()?,
                            file_offset: r.u64()?,
                        });
                    }
                    Response::Onboard { items }
                }
                OP_STAT => {
                    let n = r.count(KEYS_MAX, 1)?;
                    let mut entries = Vec::with_capacity(n);
                    for _ in 0..n {
                        entries.push(if r.bool()? {
                            Some(read_stat(&mut r)?)
                        } else {
                            None
                        });
                    }
                    Response::Stat { entries }
                }
                OP_STATS => Response::Stats { json: r.string()? },
                OP_LIST => {
                    let n = r.count(KEYS_MAX, 80)?;
                    let mut entries = Vec::with_capacity(n);
                    for _ in 0..n {
                        entries.push(ListEntry {
                            ns: r.ns()?,
                            key: r.key()?,
                            stat: read_stat(&mut r)?,
                        });
                    }
                    let next = if r.bool()? {
                        Some((r.ns()?, r.key()?))
                    } else {
                        None
                    };
                    Response::List { entries, next }
                }
                OP_SUBSCRIBE => Response::Subscribed,
                op => return Err(proto(format!("no reply shape for op {op}"))),
            },
            op => {
                return Err(proto(format!(
                    "reply op {op:#x}, expected {:#x}",
                    expect_op | OP_REPLY
                )))
            }
        };
        r.finish()?;
        Ok((h.req_id, resp))
    }
}

/// Why reading a frame failed.
#[derive(Debug)]
pub enum RecvError {
    /// The peer closed the connection cleanly between frames.
    Closed,
    /// The length prefix exceeds [`FRAME_BYTES_MAX`] (or is below the
    /// header): the connection must be closed after an error reply.
    TooLarge(usize),
    /// The socket failed or timed out.
    Io(std::io::Error),
}

/// Reads one frame body (after its length prefix) from a blocking socket,
/// collecting any file descriptors that arrive with it (at most
/// [`FDS_MAX`]; extra ones are closed by being dropped). A message with
/// more descriptors than one receive holds is refused (`Io` with
/// `InvalidData`), its descriptors closed; the connection must be closed.
pub fn recv_frame(fd: RawFd, fds: &mut Vec<OwnedFd>) -> std::result::Result<Vec<u8>, RecvError> {
    recv_frame_timed(fd, fds, None)
}

/// Sets a socket's receive timeout (SO_RCVTIMEO).
pub fn set_recv_timeout(fd: RawFd, t: std::time::Duration) -> std::io::Result<()> {
    let tv = libc::timeval {
        tv_sec: t.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_usec: t.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: valid fd, a timeval of the right size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const libc::timeval as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Like [`recv_frame`], but once the first byte of a frame arrived the
/// whole rest of it must arrive within `body_timeout`: one deadline for the
/// frame, not a timeout per receive, so a client that trickles a byte at a
/// time cannot hold a connection past it. The socket is left with a
/// receive timeout of at most `body_timeout` afterwards.
pub fn recv_frame_timed(
    fd: RawFd,
    fds: &mut Vec<OwnedFd>,
    body_timeout: Option<std::time::Duration>,
) -> std::result::Result<Vec<u8>, RecvError> {
    let mut len = [0u8; 4];
    let got = recv_exact(fd, &mut len[..1], fds, true, None)?;
    if got == 0 {
        return Err(RecvError::Closed);
    }
    let deadline = body_timeout.map(|t| std::time::Instant::now() + t);
    recv_exact(fd, &mut len[1..], fds, false, deadline)?;
    let n = u32::from_le_bytes(len) as usize;
    if !(FRAME_HEADER_BYTES..=FRAME_BYTES_MAX).contains(&n) {
        return Err(RecvError::TooLarge(n));
    }
    let mut body = vec![0u8; n];
    recv_exact(fd, &mut body, fds, false, deadline)?;
    Ok(body)
}

fn recv_exact(
    fd: RawFd,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    eof_ok_at_start: bool,
    deadline: Option<std::time::Instant>,
) -> std::result::Result<usize, RecvError> {
    let mut done = 0;
    while done < buf.len() {
        if let Some(d) = deadline {
            let left = d.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(RecvError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "frame not received within its deadline",
                )));
            }
            // SO_RCVTIMEO of 0 means "no timeout": never set less than 1 ms.
            set_recv_timeout(fd, left.max(std::time::Duration::from_millis(1)))
                .map_err(RecvError::Io)?;
        }
        let n = match recv_some(fd, &mut buf[done..], fds) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                let e = if e.kind() == std::io::ErrorKind::WouldBlock {
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "receive timed out")
                } else {
                    e
                };
                return Err(RecvError::Io(e));
            }
        };
        if n == 0 {
            if done == 0 && eof_ok_at_start {
                return Ok(0);
            }
            return Err(RecvError::Io(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "connection closed inside a frame",
            )));
        }
        done += n;
    }
    Ok(done)
}

/// Bytes of control buffer for [`FDS_MAX`] descriptors in one message.
fn cmsg_space_bytes() -> usize {
    // SAFETY: pure arithmetic on a constant.
    unsafe { libc::CMSG_SPACE((FDS_MAX * std::mem::size_of::<RawFd>()) as libc::c_uint) as usize }
}

/// One `recvmsg` into `buf`. Every descriptor the kernel installed is
/// owned at once: kept in `fds` (up to [`FDS_MAX`] per frame) or closed.
/// A truncated control message (`MSG_CTRUNC`: more descriptors than the
/// buffer holds; the kernel installs those that fit and drops the rest) is
/// refused with `InvalidData` after the installed ones are closed, so a
/// hostile peer cannot leak descriptors into this process (nix's
/// `cmsgs()` refuses to walk a truncated buffer, which left them open).
fn recv_some(fd: RawFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> std::io::Result<usize> {
    // u64s: cmsghdr alignment. 128 fds need 528 bytes.
    let mut control = [0u64; 80];
    let space = cmsg_space_bytes().min(std::mem::size_of_val(&control));
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is valid; the fields set below point at
    // live buffers of the stated lengths.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: fd is the caller's socket; msg describes valid buffers.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut got = Vec::new();
    // SAFETY: walking the control buffer the kernel filled, with the
    // kernel's own length fields, through libc's bounds-checked macros.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let bytes = ((*c).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    // The kernel just installed this fd for us; nothing
                    // else owns it.
                    got.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        drop(got);
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("more than {FDS_MAX} file descriptors in one message (control data truncated); frame refused"),
        ));
    }
    for f in got {
        if fds.len() < FDS_MAX {
            fds.push(f);
        }
    }
    Ok(n as usize)
}

/// Sends one whole frame, with `fds` as SCM_RIGHTS on its first bytes.
pub fn send_frame(fd: RawFd, frame: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let mut done = 0;
    while done < frame.len() {
        let iov = [IoSlice::new(&frame[done..])];
        let cm;
        let cmsgs: &[ControlMessage<'_>] = if done == 0 && !fds.is_empty() {
            cm = [ControlMessage::ScmRights(fds)];
            &cm
        } else {
            &[]
        };
        match sendmsg::<()>(fd, &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(n) => done += n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                let e = std::io::Error::from(e);
                if e.kind() == std::io::ErrorKind::WouldBlock {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "send timed out",
                    ));
                }
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Raw fd of anything that has one (helper for callers holding streams).
pub fn raw(s: &impl AsRawFd) -> RawFd {
    s.as_raw_fd()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u8) -> BlockKey {
        BlockKey::from_bytes(&[i; 32]).unwrap()
    }

    #[test]
    fn requests_round_trip() {
        let ns = NamespaceId([7; 16]);
        let reqs = vec![
            Request::Hello {
                shm_bytes: 1 << 20,
                pid: 42,
                features: FEATURES,
            },
            Request::Lookup {
                ns,
                keys: vec![k(1), k(2)],
            },
            Request::LookupMany {
                nss: vec![ns, NamespaceId([8; 16])],
                keys: vec![k(1), k(2)],
            },
            Request::Offload {
                ns,
                items: vec![OffloadItem {
                    shm_offset: 8192,
                    parent: Some(k(3)),
                    hints: Hints {
                        priority: 3,
                        pinned: true,
                        ephemeral: false,
                        expected_reuse: 9,
                    },
                }],
            },
            Request::Onboard {
                ns,
                mode: OnboardMode::DirectFd,
                lease_ttl_ms: 500,
                items: vec![OnboardItem {
                    key: k(4),
                    shm_offset: 0,
                    shm_len: 8192,
                }],
            },
            Request::Release {
                leases: vec![1, 2, 3],
            },
            Request::Pin {
                ns,
                ttl_ms: 10,
                keys: vec![k(5)],
            },
            Request::Prefetch {
                ns,
                deadline_ms: 250,
                stream: 7,
                keys: vec![k(5), k(6)],
            },
            Request::Describe {
                ns,
                engine: "vllm".into(),
                model: "meta-llama/Llama-3.1-8B · tp=8".into(),
            },
            Request::Stats,
            Request::List {
                ns: Some(ns),
                after: Some((ns, k(6))),
                limit: 10,
            },
            Request::Subscribe,
            Request::Evict {
                ns,
                keys: vec![k(7)],
                tier: EvictTier::All,
            },
            Request::Evict {
                ns,
                keys: vec![k(7)],
                tier: EvictTier::G3,
            },
            Request::Verify {
                ns,
                keys: vec![k(8), k(9)],
                repair: true,
            },
            Request::ReportCorrupt {
                ns,
                keys: vec![k(10)],
            },
        ];
        for r in reqs {
            let f = r.encode(9);
            let (id, back) = Request::decode(&f[4..]).unwrap();
            assert_eq!(id, 9);
            assert_eq!(back, r);
        }
    }

    #[test]
    fn descriptions_out_of_bounds_are_refused_by_the_decoder() {
        let ns = NamespaceId([5; 16]);
        let long_model = "m".repeat(DESCRIBE_MODEL_BYTES_MAX + 1);
        for (engine, model) in [
            ("", "m"),
            ("VLLM", "m"),
            ("v llm", "m"),
            ("e".repeat(DESCRIBE_ENGINE_BYTES_MAX + 1).as_str(), "m"),
            ("vllm", long_model.as_str()),
            ("vllm", "a\nb"),
        ] {
            let f = Request::Describe {
                ns,
                engine: engine.into(),
                model: model.into(),
            }
            .encode(1);
            assert!(Request::decode(&f[4..]).is_err(), "{engine:?} {model:?}");
        }
        let ok = Request::Describe {
            ns,
            engine: "sglang".into(),
            model: "m".repeat(DESCRIBE_MODEL_BYTES_MAX),
        };
        assert!(Request::decode(&ok.encode(1)[4..]).is_ok());
    }

    #[test]
    fn evict_frames_of_older_clients_decode_as_g3_and_bad_tiers_are_refused() {
        // An older client's evict: namespace and keys, no tier byte.
        let ns = NamespaceId([5; 16]);
        let mut w = Writer::frame(OP_EVICT, 3);
        w.ns(&ns);
        write_keys(&mut w, &[k(1)]);
        let f = w.finish();
        let (_, r) = Request::decode(&f[4..]).unwrap();
        assert_eq!(
            r,
            Request::Evict {
                ns,
                keys: vec![k(1)],
                tier: EvictTier::G3
            }
        );
        let mut w = Writer::frame(OP_EVICT, 3);
        w.ns(&ns);
        write_keys(&mut w, &[k(1)]);
        w.u8(7);
        let f = w.finish();
        assert!(Request::decode(&f[4..]).is_err());
        assert_eq!("all".parse::<EvictTier>().unwrap(), EvictTier::All);
        assert!("g5".parse::<EvictTier>().is_err());
        assert_eq!(ItemStatus::from_code(9), Some(ItemStatus::Repaired));
        assert_eq!(ItemStatus::from_code(10), Some(ItemStatus::StoredUnpinned));
        assert_eq!(ItemStatus::from_code(11), Some(ItemStatus::Timeout));
        assert_eq!(ItemStatus::from_code(12), None);
    }

    /// The features ride in the pid word's top byte: a hello without them
    /// (an older client's) decodes as features 0, its pid unchanged; and a
    /// reply to such a client carries no status it cannot decode.
    #[test]
    fn hello_features_and_the_statuses_a_client_gets() {
        let mut w = Writer::frame(OP_HELLO, 1);
        w.u64(0);
        w.u32(4_194_303);
        let f = w.finish();
        let (_, old) = Request::decode(&f[4..]).unwrap();
        assert_eq!(
            old,
            Request::Hello {
                shm_bytes: 0,
                pid: 4_194_303,
                features: 0
            }
        );
        let new = Request::Hello {
            shm_bytes: 0,
            pid: 4_194_303,
            features: FEATURES,
        }
        .encode(1);
        assert_eq!(&new[20..24], &(4_194_303u32 | 3 << 24).to_le_bytes());
        let items = |st: ItemStatus| Response::Items {
            status: vec![ItemStatus::Ok, st],
        };
        assert_eq!(
            items(ItemStatus::Timeout).for_features(0),
            items(ItemStatus::Unavailable)
        );
        assert_eq!(
            items(ItemStatus::Timeout).for_features(FEATURES),
            items(ItemStatus::Timeout)
        );
        // A client from before StoredUnpinned (code 10) fails the whole
        // reply on it: such clients announce no feature and get the `Ok`
        // that daemons before the code answered.
        assert_eq!(
            items(ItemStatus::StoredUnpinned).for_features(0),
            items(ItemStatus::Ok)
        );
        assert_eq!(
            items(ItemStatus::StoredUnpinned).for_features(FEATURE_TIMEOUT_STATUS),
            items(ItemStatus::Ok)
        );
        assert_eq!(
            items(ItemStatus::StoredUnpinned).for_features(FEATURES),
            items(ItemStatus::StoredUnpinned)
        );
        let onboard = Response::Onboard {
            items: vec![OnboardResult {
                status: ItemStatus::Timeout,
                tier: Tier::G3,
                lease_id: 0,
                payload_len: 0,
                payload_sum: PayloadSum::from_bytes([0; 32]),
                fd_index: u32::MAX,
                file_offset: 0,
            }],
        };
        let Response::Onboard { items } = onboard.for_features(0) else {
            unreachable!()
        };
        assert_eq!(items[0].status, ItemStatus::Unavailable);
    }

    #[test]
    fn hostile_counts_and_trailing_bytes_are_refused() {
        let mut w = Writer::frame(OP_LOOKUP, 1);
        w.ns(&NamespaceId([0; 16]));
        w.u32(u32::MAX);
        let f = w.finish();
        assert!(Request::decode(&f[4..]).is_err());
        let mut f = Request::Stats.encode(1);
        f.push(0);
        assert!(Request::decode(&f[4..]).is_err());
        let mut f = Request::Stats.encode(1);
        f[4] = 2; // version
        assert!(Request::decode(&f[4..]).is_err());
    }

    proptest::proptest! {
        #[test]
        fn decoders_never_panic(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512), op in 0u8..19) {
            let mut framed = vec![PROTOCOL_VERSION, op, 0, 0, 1, 0, 0, 0];
            framed.extend_from_slice(&body);
            let _ = Request::decode(&framed);
            let _ = Request::decode(&body);
            for o in 1..=12u8 {
                let _ = Response::decode(&body, o);
                let _ = Response::decode(&framed, o);
            }
        }
    }

    #[test]
    fn replies_round_trip() {
        let r = Response::Onboard {
            items: vec![OnboardResult {
                status: ItemStatus::Ok,
                tier: Tier::G3,
                lease_id: 5,
                payload_len: 100,
                payload_sum: PayloadSum::from_bytes([1; 32]),
                fd_index: 0,
                file_offset: 0,
            }],
        };
        let f = r.encode(OP_ONBOARD, 3);
        assert_eq!(Response::decode(&f[4..], OP_ONBOARD).unwrap(), (3, r));
        let e = Response::Error {
            code: code::MALFORMED,
            message: "x".into(),
        };
        let f = e.encode(OP_LOOKUP, 4);
        assert_eq!(Response::decode(&f[4..], OP_LOOKUP).unwrap(), (4, e));
        let m = Response::LookupMany {
            tiers: vec![vec![Tier::G3, Tier::G4], vec![], vec![Tier::Peer]],
        };
        let f = m.encode(OP_LOOKUP_MANY, 5);
        assert_eq!(Response::decode(&f[4..], OP_LOOKUP_MANY).unwrap(), (5, m));
    }

    #[test]
    fn lookup_many_of_no_namespace_or_too_many_is_refused() {
        let none = Request::LookupMany {
            nss: vec![],
            keys: vec![k(1)],
        }
        .encode(1);
        assert!(Request::decode(&none[4..]).is_err());
        let many = Request::LookupMany {
            nss: vec![NamespaceId([1; 16]); LOOKUP_NAMESPACES_MAX + 1],
            keys: vec![k(1)],
        }
        .encode(1);
        assert!(Request::decode(&many[4..]).is_err());
    }
}
