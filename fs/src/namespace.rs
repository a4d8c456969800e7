//! The namespace trait: the one interface between the FUSE adapter and a
//! block store.
//!
//! The adapter knows nothing of tiers. It asks a [`KvNamespace`] for names,
//! attributes, an open file (or a read callback) and hands it verified,
//! complete block files to import. An implementor writes the nine required
//! methods below; [`crate::MemNamespace`] is the reference implementation.
//!
//! Contract, for every implementation:
//! - Methods may be called from several FUSE threads at once.
//! - `list_blocks` returns a bounded page; the adapter never asks for all
//!   blocks of a namespace at once.
//! - `open` returns bytes that stay consistent for the life of the handle
//!   even if the block is evicted meanwhile: an open `File` of an unlinked
//!   block file keeps its bytes, so returning the G3 file itself is correct.
//! - `import` receives a [`StagedBlock`] that the adapter has already
//!   verified (header, exact length, zero padding, payload checksum, and that
//!   the path's namespace and key match the header). It must be atomic and
//!   create-once: no reader observes a partial block, and an existing key is
//!   refused with [`Error::Exists`].
//! - `remove` evicts the block from this node (what `rm` does).

use crate::error::{Error, Result};
use kvtier_client::block::{ALIGN_BYTES, HEADER_BYTES};
use kvtier_client::{BlockHeader, BlockKey, NamespaceId, Tier};
use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

/// What the mount shows about one block (`stat` and `user.kvtier.*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockStat {
    /// Size of the block file (header + padded payload), what `stat` shows.
    pub size_bytes: u64,
    /// When the block was stored on this node, ms since the Unix epoch:
    /// the file's mtime.
    pub stored_unix_ms: u64,
    /// Where the block lives now (`user.kvtier.tier`).
    pub tier: Tier,
    /// The payload's checksum, from the header (`user.kvtier.checksum`).
    pub payload_sum: kvtier_client::PayloadSum,
    /// Reads served so far (`user.kvtier.hits`).
    pub hits: u64,
    /// Last read, ms since the Unix epoch; 0 = never (`user.kvtier.last_access`).
    pub last_access_unix_ms: u64,
    /// Whether the block is pinned (`user.kvtier.pinned`).
    pub pinned: bool,
    /// Eviction priority hint (`user.kvtier.priority`).
    pub priority: u8,
}

/// A read callback for blocks that have no backing file (fallback path).
pub trait BlockReader: Send + Sync {
    /// Reads up to `buf.len()` bytes at `offset` of the block file; returns
    /// the count, 0 at the end. Must return the same bytes for the whole
    /// life of the handle.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize>;
}

/// An opened block, ready to be read.
pub enum OpenBlock {
    /// A real file holding the block file at `offset_bytes`. With offset 0
    /// the kernel reads it directly (FUSE passthrough); otherwise, or when
    /// passthrough is unavailable, the adapter reads it with `pread`.
    File {
        /// The backing file, opened read-only.
        file: File,
        /// Where the block file starts inside `file`.
        offset_bytes: u64,
        /// Length of the block file.
        len_bytes: u64,
    },
    /// Bytes served by a callback through the daemon.
    Reader {
        /// The callback.
        reader: Arc<dyn BlockReader>,
        /// Length of the block file.
        len_bytes: u64,
    },
}

impl std::fmt::Debug for OpenBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpenBlock::File {
                offset_bytes,
                len_bytes,
                ..
            } => write!(f, "OpenBlock::File(offset {offset_bytes}, len {len_bytes})"),
            OpenBlock::Reader { len_bytes, .. } => write!(f, "OpenBlock::Reader(len {len_bytes})"),
        }
    }
}

/// The namespace a mount shows. See the module contract.
pub trait KvNamespace: Send + Sync + 'static {
    /// Every namespace that holds blocks (the mount's top-level directories).
    /// Namespaces are few (one per model/layout/tenant); the list is bounded
    /// by the implementation.
    fn namespaces(&self) -> Result<Vec<NamespaceId>>;

    /// One page of the keys of namespace `ns` whose first byte is `shard`:
    /// at most `limit` keys that follow `after` (or from the start when
    /// `None`) in an order the implementation keeps stable between calls
    /// (ascending `BlockKey` order is the natural one). An empty page means
    /// the end.
    fn list_blocks(
        &self,
        ns: &NamespaceId,
        shard: u8,
        after: Option<&BlockKey>,
        limit: usize,
    ) -> Result<Vec<BlockKey>>;

    /// Attributes of one block, `None` when this node does not hold it.
    fn stat(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Option<BlockStat>>;

    /// Opens a block for reading. A block that lives only in G4 may be
    /// fetched (and verified) first; this call may block while it is.
    fn open(&self, ns: &NamespaceId, key: &BlockKey) -> Result<OpenBlock>;

    /// Stores a verified block file, create-once and atomically.
    fn import(&self, ns: &NamespaceId, block: StagedBlock) -> Result<()>;

    /// Evicts a block from this node (`rm`). [`Error::NotFound`] if absent.
    fn remove(&self, ns: &NamespaceId, key: &BlockKey) -> Result<()>;

    /// Removes a block from the tiers `tier` names (`setfattr -n
    /// user.kvtier.evict -v g3|g4|all`). Default: refused (only `rm`).
    fn evict(
        &self,
        _ns: &NamespaceId,
        _key: &BlockKey,
        _tier: kvtier_client::proto::EvictTier,
    ) -> Result<()> {
        Err(Error::UnsupportedAttribute {
            name: "user.kvtier.evict".into(),
        })
    }

    /// Space figures for `statfs` (`df`); `None`: unknown (all zero).
    fn space(&self) -> Option<Space> {
        None
    }

    /// Pins (`true`) or unpins a block (`setfattr -n user.kvtier.pinned`).
    fn set_pinned(&self, ns: &NamespaceId, key: &BlockKey, pinned: bool) -> Result<()>;

    /// The text of `/.kvtier/stats`: `name value` lines.
    fn stats_text(&self) -> String;

    /// The log behind `/.kvtier/events`.
    fn event_log(&self) -> &EventLog;

    /// Whether `caller` may see and touch namespace `ns` (`None`: the
    /// node-wide files under `/.kvtier`). A namespace it may not is absent
    /// for it (`ENOENT`, as an unknown one); the adapter asks on every
    /// request. Default: everyone may (the mount's permission bits and
    /// `allow_other` are then the only boundary).
    fn may_access(&self, _caller: Caller, _ns: Option<&NamespaceId>) -> bool {
        true
    }

    /// Whether `caller` may delete blocks (`rm`, `user.kvtier.evict`) of
    /// namespaces it may access. Default: yes.
    fn may_remove(&self, _caller: Caller) -> bool {
        true
    }

    /// Whether [`Self::may_access`] tells callers apart. Then the adapter
    /// lets the kernel cache no entries or attributes (they would serve
    /// one user's lookups to another).
    fn checks_callers(&self) -> bool {
        false
    }
}

/// What `df` shows for the mount: the store's capacity, not the disk's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Space {
    /// Bytes the store may hold.
    pub capacity_bytes: u64,
    /// Bytes of block files held now.
    pub used_bytes: u64,
    /// Blocks held now.
    pub blocks: u64,
}

/// The process behind a FUSE request: its uid and gid, from the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    /// User id.
    pub uid: u32,
    /// Group id (the primary, effective one).
    pub gid: u32,
}

/// A complete block file written through the mount, already verified.
///
/// It lives in an unnamed temporary file (`O_TMPFILE`) in the mount's
/// staging directory: it vanishes if nobody keeps it. An implementation
/// either reads it ([`StagedBlock::read_all`], [`StagedBlock::file`]) or,
/// when the staging directory is on its own filesystem, gives it a name
/// with [`StagedBlock::link_into`] and so publishes it without a copy.
#[derive(Debug)]
pub struct StagedBlock {
    header: BlockHeader,
    file: File,
    len_bytes: u64,
}

impl StagedBlock {
    /// Verifies `file` as the complete block file for `ns`/`key`: header,
    /// exact length, zero padding, payload checksum, and that the header
    /// names this namespace and key. The only way to build a `StagedBlock`.
    pub fn verify(file: File, ns: &NamespaceId, key: &BlockKey) -> Result<Self> {
        let io = |e| Error::io("verifying staged block", "(staged file)", e);
        let len_bytes = file.metadata().map_err(io)?.len();
        let mut hbuf = vec![0u8; HEADER_BYTES];
        let got = read_full_at(&file, &mut hbuf, 0).map_err(io)?;
        hbuf.truncate(got);
        let header = BlockHeader::decode(&hbuf).map_err(|source| Error::InvalidBlock { source })?;
        check_names(&header, ns, key)?;
        let want = header.file_len();
        if len_bytes != want {
            return Err(Error::BadWrite {
                reason: format!(
                    "the file is {len_bytes} bytes but its header declares {want} \
                     (a partial or oversized write)"
                ),
            });
        }
        let mut hasher = header.payload_hasher();
        let mut buf = vec![0u8; 1 << 20];
        let payload_end = HEADER_BYTES as u64 + header.payload_len;
        let mut off = HEADER_BYTES as u64;
        while off < len_bytes {
            let n = ((len_bytes - off) as usize).min(buf.len());
            let got = read_full_at(&file, &mut buf[..n], off).map_err(io)?;
            if got != n {
                return Err(Error::BadWrite {
                    reason: "the staged file shrank while it was verified".into(),
                });
            }
            let payload_n = payload_end.saturating_sub(off).min(n as u64) as usize;
            hasher.update(&buf[..payload_n]);
            if buf[payload_n..n].iter().any(|&b| b != 0) {
                return Err(Error::InvalidBlock {
                    source: kvtier_client::Error::Format {
                        fault: kvtier_client::FormatFault::Malformed,
                        detail: "padding bytes are not zero".into(),
                    },
                });
            }
            off += n as u64;
        }
        if hasher.finish() != header.payload_sum {
            return Err(Error::InvalidBlock {
                source: kvtier_client::Error::Format {
                    fault: kvtier_client::FormatFault::PayloadChecksum,
                    detail: format!("payload checksum mismatch for block {}", header.key),
                },
            });
        }
        debug_assert_eq!(len_bytes % ALIGN_BYTES as u64, 0);
        Ok(StagedBlock {
            header,
            file,
            len_bytes,
        })
    }

    /// The verified header.
    pub fn header(&self) -> &BlockHeader {
        &self.header
    }

    /// Length of the whole block file.
    pub fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    /// The staged file (read it with `read_at`; its position is unspecified).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The whole block file in memory.
    pub fn read_all(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len_bytes as usize];
        let got = read_full_at(&self.file, &mut v, 0)
            .map_err(|e| Error::io("reading staged block", "(staged file)", e))?;
        if got as u64 != self.len_bytes {
            return Err(Error::BadWrite {
                reason: "the staged file shrank after verification".into(),
            });
        }
        Ok(v)
    }

    /// Gives the unnamed staged file the name `dest` (which must not exist,
    /// and must be on the staging directory's filesystem, else `EXDEV`):
    /// an atomic, copy-free publish.
    pub fn link_into(&self, dest: &std::path::Path) -> Result<()> {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::io::AsRawFd;
        let src = format!("/proc/self/fd/{}\0", self.file.as_raw_fd());
        let mut dst = dest.as_os_str().as_bytes().to_vec();
        dst.push(0);
        // SAFETY: both paths are NUL-terminated buffers that outlive the call.
        let rc = unsafe {
            libc::linkat(
                libc::AT_FDCWD,
                src.as_ptr().cast(),
                libc::AT_FDCWD,
                dst.as_ptr().cast(),
                libc::AT_SYMLINK_FOLLOW,
            )
        };
        if rc != 0 {
            return Err(Error::io(
                "linking staged block",
                dest,
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }
}

/// Checks that a header belongs at `ns`/`key`.
pub(crate) fn check_names(header: &BlockHeader, ns: &NamespaceId, key: &BlockKey) -> Result<()> {
    if header.namespace_id() != *ns || header.key != *key {
        return Err(Error::NameMismatch {
            expected: format!("{ns}/{key}"),
            found: format!("{}/{}", header.namespace_id(), header.key),
        });
    }
    Ok(())
}

/// `pread` until `buf` is full or the file ends; returns the count.
pub(crate) fn read_full_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// A bounded, append-only log of text lines, addressed by byte offset:
/// what `/.kvtier/events` shows. Offsets only grow, so a reader that
/// remembers its position (`tail -f`) sees each new line once. When more
/// than `capacity_lines` lines were pushed, the oldest are dropped; a
/// reader that fell that far behind reads newlines in their place.
#[derive(Debug)]
pub struct EventLog {
    inner: Mutex<EventRing>,
    capacity_lines: usize,
}

#[derive(Debug, Default)]
struct EventRing {
    /// Byte offset of the first retained line.
    start: u64,
    /// Byte offset just past the last line.
    end: u64,
    lines: VecDeque<Vec<u8>>,
}

/// Longest event line kept, in bytes; longer lines are cut.
pub const EVENT_LINE_BYTES_MAX: usize = 1024;

impl EventLog {
    /// An empty log that keeps at most `capacity_lines` lines (at least 1).
    pub fn new(capacity_lines: usize) -> Self {
        EventLog {
            inner: Mutex::new(EventRing::default()),
            capacity_lines: capacity_lines.max(1),
        }
    }

    /// Appends one line (a newline is added; embedded newlines become spaces).
    pub fn push(&self, line: &str) {
        let mut v: Vec<u8> = line
            .bytes()
            .take(EVENT_LINE_BYTES_MAX - 1)
            .map(|b| if b == b'\n' { b' ' } else { b })
            .collect();
        v.push(b'\n');
        let mut r = self.lock();
        r.end += v.len() as u64;
        r.lines.push_back(v);
        while r.lines.len() > self.capacity_lines {
            if let Some(old) = r.lines.pop_front() {
                r.start += old.len() as u64;
            }
        }
    }

    /// Appends the standard event line:
    /// `<unix_ms> <kind> <ns>/<hh>/<key> [detail]`.
    pub fn record(&self, kind: &str, ns: &NamespaceId, key: &BlockKey, detail: &str) {
        let ms = now_unix_ms();
        let path = kvtier_client::block_path(ns, key);
        if detail.is_empty() {
            self.push(&format!("{ms} {kind} {path}"));
        } else {
            self.push(&format!("{ms} {kind} {path} {detail}"));
        }
    }

    /// Total bytes ever appended: the file's size.
    pub fn len_bytes(&self) -> u64 {
        self.lock().end
    }

    /// Up to `max_bytes` bytes starting at byte `offset`.
    pub fn read_at(&self, offset: u64, max_bytes: usize) -> Vec<u8> {
        let r = self.lock();
        let mut out = Vec::new();
        if offset >= r.end {
            return out;
        }
        let mut pos = offset;
        if pos < r.start {
            let gap = ((r.start - pos) as usize).min(max_bytes);
            out.resize(gap, b'\n');
            pos += gap as u64;
        }
        let mut line_start = r.start;
        for line in &r.lines {
            if out.len() >= max_bytes {
                break;
            }
            let line_end = line_start + line.len() as u64;
            if line_end > pos {
                let from = (pos - line_start) as usize;
                let take = (line.len() - from).min(max_bytes - out.len());
                out.extend_from_slice(&line[from..from + take]);
                pos += take as u64;
            }
            line_start = line_end;
        }
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, EventRing> {
        // A panic while holding this lock leaves the ring consistent (every
        // mutation completes before the guard drops), so poisoning is moot.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Now, ms since the Unix epoch.
pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_client::{encode_block, KvLayout, Namespace};
    use std::io::Write;

    fn staged(bytes: &[u8]) -> File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(bytes).unwrap();
        f
    }

    #[test]
    fn staged_block_verification_refuses_every_bad_file() {
        let ns = Namespace::new(
            "m",
            KvLayout::with_block_bytes(8192).unwrap(),
            "",
            b"s".to_vec(),
        )
        .unwrap();
        let key = BlockKey::from_digest([7; 32]);
        let payload: Vec<u8> = (0..8192u32).map(|i| (i * 31) as u8).collect();
        let good = encode_block(&BlockHeader::for_payload(&ns, key, &payload, 5), &payload);
        let id = ns.id();
        let ok = StagedBlock::verify(staged(&good), &id, &key).unwrap();
        assert_eq!(ok.read_all().unwrap(), good);
        assert_eq!(ok.len_bytes(), good.len() as u64);

        let other = BlockKey::from_digest([8; 32]);
        assert!(matches!(
            StagedBlock::verify(staged(&good), &id, &other),
            Err(Error::NameMismatch { .. })
        ));
        let other_ns = NamespaceId([1; 16]);
        assert!(matches!(
            StagedBlock::verify(staged(&good), &other_ns, &key),
            Err(Error::NameMismatch { .. })
        ));
        assert!(matches!(
            StagedBlock::verify(staged(&good[..good.len() - 4096]), &id, &key),
            Err(Error::BadWrite { .. })
        ));
        assert!(matches!(
            StagedBlock::verify(staged(&good[..100]), &id, &key),
            Err(Error::InvalidBlock { .. })
        ));
        let mut bad = good.clone();
        bad[HEADER_BYTES + 10] ^= 1;
        assert!(matches!(
            StagedBlock::verify(staged(&bad), &id, &key),
            Err(Error::InvalidBlock { .. })
        ));
        let mut longer = good.clone();
        longer.extend_from_slice(&[0; 4096]);
        assert!(matches!(
            StagedBlock::verify(staged(&longer), &id, &key),
            Err(Error::BadWrite { .. })
        ));
        // Non-zero padding (payload not a multiple of 4096).
        let ns2 = Namespace::new(
            "m",
            KvLayout::with_block_bytes(96).unwrap(),
            "",
            b"s".to_vec(),
        )
        .unwrap();
        let p2 = vec![3u8; 96];
        let mut padded = encode_block(&BlockHeader::for_payload(&ns2, key, &p2, 5), &p2);
        let last = padded.len() - 1;
        padded[last] = 1;
        assert!(matches!(
            StagedBlock::verify(staged(&padded), &ns2.id(), &key),
            Err(Error::InvalidBlock { .. })
        ));
    }

    #[test]
    fn event_log_offsets_are_stable_and_bounded() {
        let log = EventLog::new(2);
        log.push("one");
        log.push("two");
        assert_eq!(log.read_at(0, 100), b"one\ntwo\n");
        assert_eq!(log.read_at(4, 100), b"two\n");
        assert_eq!(log.read_at(5, 2), b"wo");
        log.push("three");
        assert_eq!(log.len_bytes(), 14);
        // "one\n" was dropped: a reader at 0 gets newlines in its place.
        assert_eq!(log.read_at(0, 100), b"\n\n\n\ntwo\nthree\n");
        assert_eq!(log.read_at(14, 100), b"");
        log.push("a\nb");
        assert_eq!(log.read_at(14, 100), b"a b\n");
    }
}
