//! The FUSE edge: fuser's `Filesystem` over a [`KvNamespace`].
//!
//! Tree: `/<ns-hex32>/<hh>/<key-hex>` plus `/.kvtier/{stats,events}`.
//! Inode numbers are derived from identity (blake3 of namespace, shard,
//! key), so `readdir` can name an entry without remembering it; only
//! looked-up inodes are kept, and the kernel's `forget` drops them.
//! Every error becomes an errno in [`errno_of`] and nowhere else.

use crate::error::{Error, Result};
use crate::mount::{MountOptions, Shared};
use crate::names::{self, EVENTS_FILE, META_DIR, STATS_FILE};
use crate::namespace::{check_names, read_full_at, Caller, KvNamespace, OpenBlock, StagedBlock};
use fuser::{
    BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, OpenAccMode, OpenFlags, RenameFlags, ReplyAttr,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use kvtier_client::block::HEADER_BYTES;
use kvtier_client::{BlockHeader, BlockKey, NamespaceId};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Keys fetched from the namespace per `readdir` call.
const DIR_PAGE_KEYS: usize = 256;
/// Cookies remembered per open shard directory (a few pages).
const DIR_COOKIES_MAX: usize = 4 * DIR_PAGE_KEYS;
/// Namespaces created with `mkdir` but not yet holding a block.
const PENDING_NAMESPACES_MAX: usize = 1024;
/// Concurrent imports (open create-once handles).
const IMPORTS_MAX: usize = 256;
/// Largest read answered in one call (the kernel asks for at most 1 MiB).
const READ_BYTES_MAX: usize = 4 << 20;

const INO_META: u64 = 2;
const INO_STATS: u64 = 3;
const INO_EVENTS: u64 = 4;

/// The user-visible attributes, in `listxattr` order.
pub(crate) const XATTR_NAMES: [&str; 7] = [
    "user.kvtier.tier",
    "user.kvtier.checksum",
    "user.kvtier.hits",
    "user.kvtier.last_access",
    "user.kvtier.pinned",
    "user.kvtier.priority",
    "user.kvtier.namespace",
];

/// The single mapping from crate errors to errno.
pub(crate) fn errno_of(e: &Error) -> Errno {
    match e {
        Error::NotFound { .. } => Errno::ENOENT,
        Error::Exists { .. } | Error::DirExists { .. } => Errno::EEXIST,
        Error::InvalidName { .. }
        | Error::InvalidBlock { .. }
        | Error::NameMismatch { .. }
        | Error::BadWrite { .. } => Errno::EINVAL,
        Error::Poisoned => Errno::EIO,
        Error::NotPermitted { .. } => Errno::EPERM,
        Error::ReadOnly => Errno::EROFS,
        Error::NoAttribute { .. } => Errno::NO_XATTR,
        Error::UnsupportedAttribute { .. } => Errno::ENOTSUP,
        Error::LimitReached { .. } => Errno::EFBIG,
        Error::Busy { .. } => Errno::EBUSY,
        Error::Io { source, .. } | Error::Mount { source, .. } => source
            .raw_os_error()
            .map(Errno::from_i32)
            .unwrap_or(Errno::EIO),
        Error::Unavailable { .. } | Error::PassthroughUnavailable { .. } => Errno::EIO,
    }
}

/// Logs at a level that fits the error and returns its errno.
fn report(op: &str, e: &Error) -> Errno {
    match e {
        Error::Io { .. } | Error::Unavailable { .. } | Error::Poisoned => {
            tracing::warn!(op, error = %e, "kvtier-fs operation failed")
        }
        _ => tracing::debug!(op, error = %e, "kvtier-fs operation refused"),
    }
    errno_of(e)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Node {
    Root,
    Meta,
    Stats,
    Events,
    Ns(NamespaceId),
    Shard(NamespaceId, u8),
    Block(NamespaceId, BlockKey),
    /// A file being imported, by its import handle. It has its own inode:
    /// the kernel refuses a non-passthrough open of an inode that readers
    /// hold open through passthrough, which the block's inode may be.
    Import(NamespaceId, BlockKey, u64),
}

fn ino_of(node: &Node) -> u64 {
    let mut h = blake3::Hasher::new();
    match node {
        Node::Root => return INodeNo::ROOT.0,
        Node::Meta => return INO_META,
        Node::Stats => return INO_STATS,
        Node::Events => return INO_EVENTS,
        Node::Ns(ns) => {
            h.update(b"n");
            h.update(&ns.0);
        }
        Node::Shard(ns, s) => {
            h.update(b"s");
            h.update(&ns.0);
            h.update(&[*s]);
        }
        Node::Block(ns, k) => {
            h.update(b"b");
            h.update(&ns.0);
            h.update(k.as_bytes());
        }
        Node::Import(ns, k, fh) => {
            h.update(b"i");
            h.update(&ns.0);
            h.update(&fh.to_le_bytes());
            h.update(k.as_bytes());
        }
    }
    let mut b = [0u8; 8];
    b.copy_from_slice(&h.finalize().as_bytes()[..8]);
    // The top bit keeps derived numbers clear of the fixed ones above.
    u64::from_le_bytes(b) | (1 << 63)
}

/// A positioned read of a block file: (offset, buffer) -> bytes read.
type ReadFn<'a> = &'a dyn Fn(u64, &mut [u8]) -> Result<usize>;

enum ReadSrc {
    Passthrough,
    File {
        file: File,
        base: u64,
        len: u64,
    },
    Reader {
        reader: Arc<dyn crate::namespace::BlockReader>,
        len: u64,
    },
}

#[derive(PartialEq, Eq, Clone, Copy)]
enum ImportState {
    Open,
    Refused,
    Committed,
}

struct Import {
    ns: NamespaceId,
    key: BlockKey,
    file: File,
    written: u64,
    header: Option<BlockHeader>,
    state: ImportState,
}

#[derive(Default)]
struct DirState {
    cookies: VecDeque<(u64, BlockKey)>,
    next_cookie: u64,
}

enum Handle {
    Block {
        src: ReadSrc,
        _backing: Option<Arc<BackingId>>,
    },
    Text(Vec<u8>),
    Events,
    Dir(Mutex<DirState>),
    Import(Box<Mutex<Import>>),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section in this module leaves its data consistent
    // before anything that can panic, so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The filesystem served by fuser.
pub(crate) struct KvFs {
    ns: Arc<dyn KvNamespace>,
    opts: MountOptions,
    shared: Arc<Shared>,
    mounted_at: SystemTime,
    inodes: Mutex<HashMap<u64, (Node, u64)>>,
    handles: Mutex<HashMap<u64, Arc<Handle>>>,
    next_fh: AtomicU64,
    backing: Mutex<HashMap<u64, Weak<BackingId>>>,
    pending: Mutex<HashMap<(NamespaceId, BlockKey), u64>>,
    pending_ns: Mutex<BTreeSet<NamespaceId>>,
}

impl KvFs {
    pub(crate) fn new(ns: Arc<dyn KvNamespace>, opts: MountOptions, shared: Arc<Shared>) -> Self {
        KvFs {
            ns,
            opts,
            shared,
            mounted_at: SystemTime::now(),
            inodes: Mutex::new(HashMap::new()),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            backing: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            pending_ns: Mutex::new(BTreeSet::new()),
        }
    }

    fn ttl(&self) -> Duration {
        // The kernel's entry and attribute caches serve every user alike:
        // when callers differ in what they may see, nothing is cached, so
        // every lookup and getattr reaches the check.
        if self.ns.checks_callers() {
            return Duration::ZERO;
        }
        Duration::from_millis(self.opts.attr_ttl_ms)
    }

    fn resolve(&self, ino: INodeNo) -> Result<Node> {
        match ino.0 {
            1 => Ok(Node::Root),
            INO_META => Ok(Node::Meta),
            INO_STATS => Ok(Node::Stats),
            INO_EVENTS => Ok(Node::Events),
            n => lock(&self.inodes)
                .get(&n)
                .map(|(node, _)| *node)
                .ok_or_else(|| Error::NotFound {
                    what: format!("inode {n}"),
                }),
        }
    }

    /// The caller behind a request (its uid and gid, from the kernel).
    fn caller(req: &Request) -> Caller {
        Caller {
            uid: req.uid(),
            gid: req.gid(),
        }
    }

    /// Whether `caller` may see `node` (the namespace's rule, see
    /// [`KvNamespace::may_access`]).
    fn allowed(&self, caller: Caller, node: &Node) -> bool {
        match node {
            Node::Root | Node::Meta => true,
            Node::Stats | Node::Events => self.ns.may_access(caller, None),
            Node::Ns(ns) | Node::Shard(ns, _) | Node::Block(ns, _) | Node::Import(ns, ..) => {
                self.ns.may_access(caller, Some(ns))
            }
        }
    }

    /// [`Self::resolve`] for a request: a node the caller may not see
    /// does not exist for it (`ENOENT`, as an unknown namespace).
    fn resolve_for(&self, req: &Request, ino: INodeNo) -> Result<Node> {
        let node = self.resolve(ino)?;
        if self.allowed(Self::caller(req), &node) {
            Ok(node)
        } else {
            Err(Error::NotFound {
                what: format!("inode {}", ino.0),
            })
        }
    }

    /// Records one kernel lookup reference to `node`.
    fn remember(&self, node: Node) -> Result<u64> {
        let ino = ino_of(&node);
        if ino <= INO_EVENTS {
            return Ok(ino);
        }
        let mut t = lock(&self.inodes);
        let slot = t.entry(ino).or_insert((node, 0));
        if slot.0 != node {
            return Err(Error::Busy {
                what: format!("inode number collision between {:?} and {node:?}", slot.0),
            });
        }
        slot.1 += 1;
        Ok(ino)
    }

    fn alloc_fh(&self, h: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        lock(&self.handles).insert(fh, Arc::new(h));
        fh
    }

    fn handle(&self, fh: FileHandle) -> Result<Arc<Handle>> {
        lock(&self.handles)
            .get(&fh.0)
            .cloned()
            .ok_or_else(|| Error::NotFound {
                what: format!("file handle {}", fh.0),
            })
    }

    fn dir_attr(&self, ino: u64, mtime: SystemTime) -> FileAttr {
        self.attr(ino, FileType::Directory, 0, mtime, self.opts.dir_mode)
    }

    fn attr(&self, ino: u64, kind: FileType, size: u64, mtime: SystemTime, perm: u16) -> FileAttr {
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: mtime,
            mtime,
            ctime: mtime,
            crtime: mtime,
            kind,
            perm,
            nlink: if kind == FileType::Directory { 2 } else { 1 },
            uid: self.opts.uid,
            gid: self.opts.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    fn ns_exists(&self, ns: &NamespaceId) -> Result<bool> {
        if lock(&self.pending_ns).contains(ns) {
            return Ok(true);
        }
        Ok(self.ns.namespaces()?.contains(ns))
    }

    fn stats_bytes(&self) -> Vec<u8> {
        let c = self.shared.counters();
        let mut s = format!(
            "passthrough {}\npassthrough_opens {}\nfallback_opens {}\nfallback_reads {}\n\
             fallback_read_bytes {}\nimports {}\nimports_refused {}\nremoves {}\n",
            if c.passthrough_active {
                "active"
            } else {
                "inactive"
            },
            c.passthrough_opens,
            c.fallback_opens,
            c.fallback_reads,
            c.fallback_read_bytes,
            c.imports,
            c.imports_refused,
            c.removes,
        );
        s.push_str(&self.ns.stats_text());
        s.into_bytes()
    }

    /// Attributes and TTL of a node; `ENOENT` when it no longer exists.
    fn node_attr(&self, node: &Node) -> Result<(FileAttr, Duration)> {
        let ino = ino_of(node);
        let ro = self.opts.file_mode & 0o444;
        Ok(match node {
            Node::Root | Node::Meta | Node::Ns(_) | Node::Shard(..) => {
                (self.dir_attr(ino, self.mounted_at), self.ttl())
            }
            Node::Stats => {
                let size = self.stats_bytes().len() as u64;
                let a = self.attr(ino, FileType::RegularFile, size, SystemTime::now(), ro);
                (a, Duration::ZERO)
            }
            Node::Events => {
                let size = self.ns.event_log().len_bytes();
                let a = self.attr(ino, FileType::RegularFile, size, SystemTime::now(), ro);
                (a, Duration::ZERO)
            }
            Node::Import(ns, key, fh) => {
                let written = match self.handle(FileHandle(*fh)).as_deref() {
                    Ok(Handle::Import(imp)) => {
                        let imp = lock(imp);
                        (imp.state == ImportState::Open).then_some(imp.written)
                    }
                    _ => None,
                };
                match written {
                    Some(w) => (
                        self.attr(ino, FileType::RegularFile, w, SystemTime::now(), 0o600),
                        Duration::ZERO,
                    ),
                    // Committed (or refused): what is stored, if anything.
                    None => {
                        let (mut a, _) = self.node_attr(&Node::Block(*ns, *key))?;
                        a.ino = INodeNo(ino);
                        (a, Duration::ZERO)
                    }
                }
            }
            Node::Block(ns, key) => match self.ns.stat(ns, key)? {
                Some(st) => {
                    let mtime = UNIX_EPOCH + Duration::from_millis(st.stored_unix_ms);
                    let perm = self.opts.file_mode;
                    let a = self.attr(ino, FileType::RegularFile, st.size_bytes, mtime, perm);
                    (a, self.ttl())
                }
                None => return Err(Error::block_not_found(ns, key)),
            },
        })
    }

    fn lookup_node(&self, parent: &Node, name: &OsStr) -> Result<Node> {
        // A name the scheme cannot produce does not exist.
        let absent = |_: Error| Error::NotFound {
            what: format!("{:?}", name),
        };
        let missing = || Error::NotFound {
            what: format!("{:?}", name),
        };
        match parent {
            Node::Root => {
                if name == META_DIR {
                    return Ok(Node::Meta);
                }
                let ns = names::parse_namespace(name).map_err(absent)?;
                if self.ns_exists(&ns)? {
                    Ok(Node::Ns(ns))
                } else {
                    Err(missing())
                }
            }
            Node::Meta => match name.as_bytes() {
                b if b == STATS_FILE.as_bytes() => Ok(Node::Stats),
                b if b == EVENTS_FILE.as_bytes() => Ok(Node::Events),
                _ => Err(missing()),
            },
            Node::Ns(ns) => Ok(Node::Shard(*ns, names::parse_shard(name).map_err(absent)?)),
            Node::Shard(ns, s) => {
                let key = names::parse_block(name, *s).map_err(absent)?;
                match self.ns.stat(ns, &key)? {
                    Some(_) => Ok(Node::Block(*ns, key)),
                    None => Err(missing()),
                }
            }
            Node::Stats | Node::Events | Node::Block(..) | Node::Import(..) => {
                Err(Error::NotFound {
                    what: "a child of a file".into(),
                })
            }
        }
    }

    fn read_only(&self) -> Result<()> {
        if self.opts.read_only {
            Err(Error::ReadOnly)
        } else {
            Ok(())
        }
    }

    fn open_block(&self, ino: u64, ns: &NamespaceId, key: &BlockKey, reply: ReplyOpen) {
        let ob = match self.ns.open(ns, key) {
            Ok(ob) => ob,
            Err(e) => return reply.error(report("open", &e)),
        };
        let src = match ob {
            OpenBlock::File {
                file,
                offset_bytes: 0,
                len_bytes: _,
            } if self.shared.passthrough_active() => {
                let mut cache = lock(&self.backing);
                let cached = cache.get(&ino).and_then(Weak::upgrade);
                let id = match cached {
                    Some(id) => Ok(id),
                    None => reply.open_backing(&file).map(Arc::new),
                };
                match id {
                    Ok(id) => {
                        if cache.len() > 4096 {
                            cache.retain(|_, w| w.strong_count() > 0);
                        }
                        cache.insert(ino, Arc::downgrade(&id));
                        drop(cache);
                        self.shared
                            .passthrough_opens
                            .fetch_add(1, Ordering::Relaxed);
                        let fh = self.alloc_fh(Handle::Block {
                            src: ReadSrc::Passthrough,
                            _backing: Some(Arc::clone(&id)),
                        });
                        return reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &id);
                    }
                    Err(e) => {
                        drop(cache);
                        tracing::warn!(
                            error = %e,
                            "FUSE passthrough refused by the kernel; reads go through the daemon from now on"
                        );
                        self.shared.disable_passthrough();
                        ReadSrc::File {
                            len: file.metadata().map(|m| m.len()).unwrap_or(0),
                            file,
                            base: 0,
                        }
                    }
                }
            }
            OpenBlock::File {
                file,
                offset_bytes,
                len_bytes,
            } => ReadSrc::File {
                file,
                base: offset_bytes,
                len: len_bytes,
            },
            OpenBlock::Reader { reader, len_bytes } => ReadSrc::Reader {
                reader,
                len: len_bytes,
            },
        };
        self.shared.fallback_opens.fetch_add(1, Ordering::Relaxed);
        let fh = self.alloc_fh(Handle::Block {
            src,
            _backing: None,
        });
        // Blocks are immutable: cached pages stay valid across opens.
        reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE);
    }

    fn read_block(&self, src: &ReadSrc, offset: u64, size: usize) -> Result<Vec<u8>> {
        let (len, read): (u64, ReadFn<'_>) = match src {
            ReadSrc::Passthrough => {
                return Err(Error::Unavailable {
                    reason: "read request on a passthrough handle".into(),
                })
            }
            ReadSrc::File { file, base, len } => (*len, &move |off, buf: &mut [u8]| {
                read_full_at(file, buf, base + off)
                    .map_err(|e| Error::io("reading block", "(backing file)", e))
            }),
            ReadSrc::Reader { reader, len } => (*len, &move |off, buf: &mut [u8]| {
                let mut done = 0;
                while done < buf.len() {
                    let n = reader.read_at(off + done as u64, &mut buf[done..])?;
                    if n == 0 {
                        break;
                    }
                    done += n;
                }
                Ok(done)
            }),
        };
        if offset >= len {
            return Ok(Vec::new());
        }
        let n = ((len - offset) as usize).min(size).min(READ_BYTES_MAX);
        let mut buf = vec![0u8; n];
        let got = read(offset, &mut buf)?;
        if got != n {
            return Err(Error::Unavailable {
                reason: format!(
                    "block file ended after {} of {len} bytes",
                    offset + got as u64
                ),
            });
        }
        self.shared.fallback_reads.fetch_add(1, Ordering::Relaxed);
        self.shared
            .fallback_read_bytes
            .fetch_add(n as u64, Ordering::Relaxed);
        Ok(buf)
    }

    fn staging_file(&self) -> Result<File> {
        let dir = &self.opts.staging_dir;
        let tmp = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_TMPFILE)
            .open(dir);
        match tmp {
            Ok(f) => Ok(f),
            Err(_) => {
                // Filesystems without O_TMPFILE: a named file, unlinked at once.
                let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
                let path = dir.join(format!(".kvtier-import-{}-{fh}", std::process::id()));
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&path)
                    .map_err(|e| Error::io("creating staging file", &path, e))?;
                std::fs::remove_file(&path)
                    .map_err(|e| Error::io("unlinking staging file", &path, e))?;
                Ok(f)
            }
        }
    }

    fn start_import(&self, parent: &Node, name: &OsStr) -> Result<(Node, u64)> {
        self.read_only()?;
        let Node::Shard(ns, shard) = parent else {
            return Err(Error::NotPermitted {
                op: "creating a file here",
                reason: "block files live only in /<namespace>/<hh>/",
            });
        };
        let key = names::parse_block(name, *shard)?;
        if self.ns.stat(ns, &key)?.is_some() {
            return Err(Error::Exists { ns: *ns, key });
        }
        let file = self.staging_file()?;
        let mut pending = lock(&self.pending);
        if pending.contains_key(&(*ns, key)) {
            return Err(Error::Busy {
                what: format!("block {key} is being imported by another writer"),
            });
        }
        if pending.len() >= IMPORTS_MAX {
            return Err(Error::Busy {
                what: format!("{IMPORTS_MAX} imports already in progress"),
            });
        }
        let fh = self.alloc_fh(Handle::Import(Box::new(Mutex::new(Import {
            ns: *ns,
            key,
            file,
            written: 0,
            header: None,
            state: ImportState::Open,
        }))));
        pending.insert((*ns, key), fh);
        Ok((Node::Import(*ns, key, fh), fh))
    }

    fn import_write(&self, imp: &mut Import, offset: u64, data: &[u8]) -> Result<()> {
        match imp.state {
            ImportState::Open => {}
            ImportState::Refused => return Err(Error::Poisoned),
            ImportState::Committed => {
                return Err(Error::BadWrite {
                    reason: "the block was already stored; blocks are write-once".into(),
                })
            }
        }
        let r = self.import_write_inner(imp, offset, data);
        if r.is_err() {
            imp.state = ImportState::Refused;
            self.shared.imports_refused.fetch_add(1, Ordering::Relaxed);
            self.end_pending(imp);
        }
        r
    }

    fn import_write_inner(&self, imp: &mut Import, offset: u64, data: &[u8]) -> Result<()> {
        if offset != imp.written {
            return Err(Error::BadWrite {
                reason: format!(
                    "write at offset {offset}, but {} bytes were written so far: \
                     blocks are imported by one sequential write",
                    imp.written
                ),
            });
        }
        let end = imp.written + data.len() as u64;
        if end > self.opts.import_bytes_max {
            return Err(Error::LimitReached {
                what: "imported block file bytes",
                limit: self.opts.import_bytes_max,
            });
        }
        if let Some(h) = &imp.header {
            if end > h.file_len() {
                return Err(Error::BadWrite {
                    reason: format!("{end} bytes written, the header declares {}", h.file_len()),
                });
            }
        }
        imp.file
            .write_all_at(data, offset)
            .map_err(|e| Error::io("staging imported block", &self.opts.staging_dir, e))?;
        imp.written = end;
        if imp.header.is_none() && imp.written >= HEADER_BYTES as u64 {
            let mut h = vec![0u8; HEADER_BYTES];
            read_full_at(&imp.file, &mut h, 0)
                .map_err(|e| Error::io("reading staged header", &self.opts.staging_dir, e))?;
            let header =
                BlockHeader::decode(&h).map_err(|source| Error::InvalidBlock { source })?;
            check_names(&header, &imp.ns, &imp.key)?;
            if imp.written > header.file_len() {
                return Err(Error::BadWrite {
                    reason: format!(
                        "{} bytes written, the header declares {}",
                        imp.written,
                        header.file_len()
                    ),
                });
            }
            imp.header = Some(header);
        }
        Ok(())
    }

    /// Turns a complete, verified staged file into a block (at close).
    fn import_commit(&self, imp: &mut Import) -> Result<()> {
        match imp.state {
            ImportState::Committed => return Ok(()),
            ImportState::Refused => return Err(Error::Poisoned),
            ImportState::Open => {}
        }
        let r = self.import_commit_inner(imp);
        // Close is synchronous but release is not: free the name now so a
        // writer that retries at once is not told it is busy.
        self.end_pending(imp);
        match &r {
            Ok(()) => {
                imp.state = ImportState::Committed;
                self.shared.imports.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                imp.state = ImportState::Refused;
                self.shared.imports_refused.fetch_add(1, Ordering::Relaxed);
            }
        }
        r
    }

    fn import_commit_inner(&self, imp: &mut Import) -> Result<()> {
        let want = imp.header.as_ref().map(|h| h.file_len());
        if want != Some(imp.written) {
            return Err(Error::BadWrite {
                reason: match want {
                    Some(w) => format!("closed after {} of {w} bytes", imp.written),
                    None => format!(
                        "closed after {} bytes, before a whole {HEADER_BYTES}-byte header",
                        imp.written
                    ),
                },
            });
        }
        let file = imp
            .file
            .try_clone()
            .map_err(|e| Error::io("duplicating staged file", &self.opts.staging_dir, e))?;
        let staged = StagedBlock::verify(file, &imp.ns, &imp.key)?;
        self.ns.import(&imp.ns, staged)?;
        lock(&self.pending_ns).remove(&imp.ns);
        Ok(())
    }

    fn xattr_value(&self, node: &Node, name: &OsStr) -> Result<Vec<u8>> {
        let (Node::Block(ns, key) | Node::Import(ns, key, _)) = node else {
            return Err(Error::NoAttribute {
                name: name.to_string_lossy().into_owned(),
            });
        };
        let st = self
            .ns
            .stat(ns, key)?
            .ok_or_else(|| Error::block_not_found(ns, key))?;
        let v = match name.as_bytes() {
            b"user.kvtier.tier" => st.tier.name().to_string(),
            // `<function>:<hex>`, e.g. `xxh3-128:9b0c...` (format 2) or
            // `blake3:...` (a block format 1 wrote).
            b"user.kvtier.checksum" => format!("{:?}", st.payload_sum),
            b"user.kvtier.hits" => st.hits.to_string(),
            b"user.kvtier.last_access" => st.last_access_unix_ms.to_string(),
            b"user.kvtier.pinned" => u8::from(st.pinned).to_string(),
            b"user.kvtier.priority" => st.priority.to_string(),
            b"user.kvtier.namespace" => ns.to_hex(),
            _ => {
                return Err(Error::NoAttribute {
                    name: name.to_string_lossy().into_owned(),
                })
            }
        };
        Ok(v.into_bytes())
    }

    fn set_xattr(&self, node: &Node, name: &OsStr, value: &[u8]) -> Result<()> {
        let name_s = name.to_string_lossy().into_owned();
        if !name.as_bytes().starts_with(b"user.kvtier.") {
            return Err(Error::UnsupportedAttribute { name: name_s });
        }
        self.read_only()?;
        let (Node::Block(ns, key) | Node::Import(ns, key, _)) = node else {
            return Err(Error::NotPermitted {
                op: "setting attributes",
                reason: "only block files carry user.kvtier.* attributes",
            });
        };
        if name.as_bytes() == b"user.kvtier.evict" {
            // An action, not a stored attribute: delete the block from
            // the tiers named now (`rm` deletes from this node's disk only).
            let v = String::from_utf8_lossy(value);
            let tier =
                v.parse::<kvtier_client::proto::EvictTier>()
                    .map_err(|_| Error::InvalidName {
                        name: v.chars().take(40).collect(),
                        reason: "user.kvtier.evict takes g3, g4 or all",
                    })?;
            if lock(&self.pending).contains_key(&(*ns, *key)) {
                return Err(Error::Busy {
                    what: format!("block {key} is being imported"),
                });
            }
            self.ns.evict(ns, key, tier)?;
            self.shared.removes.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        if name.as_bytes() != b"user.kvtier.pinned" {
            if XATTR_NAMES.iter().any(|n| n.as_bytes() == name.as_bytes()) {
                return Err(Error::NotPermitted {
                    op: "setting this attribute",
                    reason: "only user.kvtier.pinned can be set",
                });
            }
            return Err(Error::UnsupportedAttribute { name: name_s });
        }
        let pinned = match value.trim_ascii() {
            b"1" => true,
            b"0" => false,
            _ => {
                return Err(Error::InvalidName {
                    name: String::from_utf8_lossy(value).chars().take(40).collect(),
                    reason: "user.kvtier.pinned takes 1 or 0",
                })
            }
        };
        self.ns.set_pinned(ns, key, pinned)
    }

    fn reply_xattr(size: u32, data: &[u8], reply: ReplyXattr) {
        if size == 0 {
            reply.size(data.len() as u32);
        } else if data.len() > size as usize {
            reply.error(Errno::ERANGE);
        } else {
            reply.data(data);
        }
    }

    fn readdir_entries(
        &self,
        caller: Caller,
        node: &Node,
        fh: FileHandle,
        offset: u64,
        reply: &mut ReplyDirectory,
    ) -> Result<()> {
        let ino = ino_of(node);
        // Cookies 1 and 2 are "." and ".."; entries follow from 3.
        if offset == 0 && reply.add(INodeNo(ino), 1, FileType::Directory, ".") {
            return Ok(());
        }
        if offset <= 1 && reply.add(INodeNo(ino), 2, FileType::Directory, "..") {
            return Ok(());
        }
        let fixed: Vec<(u64, FileType, String)> = match node {
            Node::Root => {
                let mut v = vec![(INO_META, FileType::Directory, META_DIR.to_string())];
                let mut all: BTreeSet<NamespaceId> = self.ns.namespaces()?.into_iter().collect();
                all.extend(lock(&self.pending_ns).iter().copied());
                all.retain(|ns| self.ns.may_access(caller, Some(ns)));
                v.extend(
                    all.into_iter()
                        .map(|ns| (ino_of(&Node::Ns(ns)), FileType::Directory, ns.to_hex())),
                );
                v
            }
            Node::Meta if !self.ns.may_access(caller, None) => Vec::new(),
            Node::Meta => vec![
                (INO_STATS, FileType::RegularFile, STATS_FILE.to_string()),
                (INO_EVENTS, FileType::RegularFile, EVENTS_FILE.to_string()),
            ],
            Node::Ns(ns) => (0..=255u8)
                .map(|s| {
                    (
                        ino_of(&Node::Shard(*ns, s)),
                        FileType::Directory,
                        names::shard_name(s),
                    )
                })
                .collect(),
            Node::Shard(ns, shard) => return self.readdir_shard(ns, *shard, fh, offset, reply),
            _ => {
                return Err(Error::NotPermitted {
                    op: "readdir",
                    reason: "not a directory",
                })
            }
        };
        let skip = offset.saturating_sub(2) as usize;
        for (i, (ino, kind, name)) in fixed.iter().enumerate().skip(skip) {
            if reply.add(INodeNo(*ino), i as u64 + 3, *kind, name) {
                break;
            }
        }
        Ok(())
    }

    fn readdir_shard(
        &self,
        ns: &NamespaceId,
        shard: u8,
        fh: FileHandle,
        offset: u64,
        reply: &mut ReplyDirectory,
    ) -> Result<()> {
        let h = self.handle(fh)?;
        let Handle::Dir(state) = h.as_ref() else {
            return Err(Error::NotFound {
                what: "directory handle".into(),
            });
        };
        let mut st = lock(state);
        let after = if offset <= 2 {
            None
        } else {
            let found = st
                .cookies
                .iter()
                .find(|(c, _)| *c == offset)
                .map(|(_, k)| *k);
            Some(found.ok_or_else(|| Error::BadWrite {
                reason: format!(
                    "directory offset {offset} is no longer valid (seekdir too far back)"
                ),
            })?)
        };
        let page = self
            .ns
            .list_blocks(ns, shard, after.as_ref(), DIR_PAGE_KEYS)?;
        for key in page {
            st.next_cookie = st.next_cookie.max(3);
            let cookie = st.next_cookie;
            st.next_cookie += 1;
            st.cookies.push_back((cookie, key));
            if st.cookies.len() > DIR_COOKIES_MAX {
                st.cookies.pop_front();
            }
            let ino = ino_of(&Node::Block(*ns, key));
            if reply.add(INodeNo(ino), cookie, FileType::RegularFile, key.to_hex()) {
                break;
            }
        }
        Ok(())
    }
}

impl Filesystem for KvFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        use crate::mount::Passthrough;
        if self.opts.passthrough == Passthrough::Off {
            tracing::info!("FUSE passthrough disabled by option; reads go through the daemon");
            return Ok(());
        }
        if !config.capabilities().contains(InitFlags::FUSE_PASSTHROUGH) {
            tracing::warn!("kernel does not offer FUSE passthrough (needs Linux 6.9+)");
            return Ok(());
        }
        let ok = config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
            // 2 lets backing files sit on a stacked filesystem (overlayfs).
            && config.set_max_stack_depth(2).is_ok();
        self.shared.set_negotiated(ok);
        Ok(())
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let r = self.resolve_for(req, parent).and_then(|p| {
            let node = self.lookup_node(&p, name)?;
            if !self.allowed(Self::caller(req), &node) {
                return Err(Error::NotFound {
                    what: format!("{name:?}"),
                });
            }
            let (attr, ttl) = self.node_attr(&node)?;
            self.remember(node)?;
            Ok((attr, ttl))
        });
        match r {
            Ok((attr, ttl)) => reply.entry(&ttl, &attr, Generation(0)),
            Err(e) => reply.error(report("lookup", &e)),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        let mut t = lock(&self.inodes);
        if let Some(slot) = t.get_mut(&ino.0) {
            slot.1 = slot.1.saturating_sub(nlookup);
            if slot.1 == 0 {
                t.remove(&ino.0);
            }
        }
    }

    fn getattr(&self, req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.resolve_for(req, ino).and_then(|n| self.node_attr(&n)) {
            Ok((attr, ttl)) => reply.attr(&ttl, &attr),
            Err(e) => reply.error(report("getattr", &e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let r = self.resolve_for(req, ino).and_then(|node| {
            let (attr, ttl) = self.node_attr(&node)?;
            let pending = match node {
                Node::Import(ns, key, fh) => lock(&self.pending).get(&(ns, key)) == Some(&fh),
                _ => false,
            };
            let nothing = mode.is_none()
                && uid.is_none()
                && gid.is_none()
                && size.is_none()
                && atime.is_none()
                && mtime.is_none();
            if nothing {
                return Ok((attr, ttl));
            }
            if pending {
                // A file being imported: tools set times and mode after
                // copying; those are ignored. Only a no-op truncate passes.
                if size.is_some_and(|s| s != attr.size) {
                    return Err(Error::BadWrite {
                        reason: "an import cannot be truncated or extended".into(),
                    });
                }
                return Ok((attr, ttl));
            }
            self.read_only()?;
            Err(Error::NotPermitted {
                op: "changing attributes",
                reason: "blocks and directories are immutable",
            })
        });
        match r {
            Ok((attr, ttl)) => reply.attr(&ttl, &attr),
            Err(e) => reply.error(report("setattr", &e)),
        }
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.error(report(
            "mknod",
            &Error::NotPermitted {
                op: "mknod",
                reason: "only block files exist here; create them with open(O_CREAT)",
            },
        ));
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let r = self.resolve_for(req, parent).and_then(|p| {
            self.read_only()?;
            let node = match p {
                Node::Root => {
                    if name == META_DIR {
                        return Err(Error::NotPermitted {
                            op: "mkdir",
                            reason: ".kvtier is reserved",
                        });
                    }
                    let ns = names::parse_namespace(name)?;
                    if !self.allowed(Self::caller(req), &Node::Ns(ns)) {
                        return Err(Error::NotPermitted {
                            op: "mkdir",
                            reason: "this namespace is not one of yours",
                        });
                    }
                    if self.ns_exists(&ns)? {
                        return Err(Error::DirExists { path: ns.to_hex() });
                    }
                    let mut p = lock(&self.pending_ns);
                    if p.len() >= PENDING_NAMESPACES_MAX {
                        return Err(Error::Busy {
                            what: format!("{PENDING_NAMESPACES_MAX} empty namespaces already"),
                        });
                    }
                    p.insert(ns);
                    Node::Ns(ns)
                }
                Node::Ns(ns) => {
                    let s = names::parse_shard(name)?;
                    return Err(Error::DirExists {
                        path: format!("{ns}/{}", names::shard_name(s)),
                    });
                }
                _ => {
                    return Err(Error::NotPermitted {
                        op: "mkdir",
                        reason: "directories are only /<namespace> and /<namespace>/<hh>",
                    })
                }
            };
            let (attr, ttl) = self.node_attr(&node)?;
            self.remember(node)?;
            Ok((attr, ttl))
        });
        match r {
            Ok((attr, ttl)) => reply.entry(&ttl, &attr, Generation(0)),
            Err(e) => reply.error(report("mkdir", &e)),
        }
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = self.resolve_for(req, parent).and_then(|p| {
            self.read_only()?;
            if !self.ns.may_remove(Self::caller(req)) {
                return Err(Error::NotPermitted {
                    op: "rm",
                    reason: "deleting blocks is an admin's operation here ([access] admin_uids)",
                });
            }
            match p {
                Node::Shard(ns, s) => {
                    let key = names::parse_block(name, s).map_err(|_| Error::NotFound {
                        what: format!("{name:?}"),
                    })?;
                    if lock(&self.pending).contains_key(&(ns, key)) {
                        return Err(Error::Busy {
                            what: format!("block {key} is being imported"),
                        });
                    }
                    self.ns.remove(&ns, &key)?;
                    self.shared.removes.fetch_add(1, Ordering::Relaxed);
                    Ok(())
                }
                Node::Meta => Err(Error::NotPermitted {
                    op: "unlink",
                    reason: "/.kvtier is read-only",
                }),
                _ => Err(Error::NotFound {
                    what: format!("{name:?}"),
                }),
            }
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(report("unlink", &e)),
        }
    }

    fn rmdir(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        let e = if self.opts.read_only {
            Error::ReadOnly
        } else {
            Error::NotPermitted {
                op: "rmdir",
                reason: "namespace and shard directories are part of the scheme",
            }
        };
        reply.error(report("rmdir", &e));
    }

    fn symlink(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _link_name: &OsStr,
        _target: &std::path::Path,
        reply: ReplyEntry,
    ) {
        reply.error(report(
            "symlink",
            &Error::NotPermitted {
                op: "symlink",
                reason: "a block is named by its content only",
            },
        ));
    }

    fn rename(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _newparent: INodeNo,
        _newname: &OsStr,
        _flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        reply.error(report(
            "rename",
            &Error::NotPermitted {
                op: "rename",
                reason: "a block's name is its key; it cannot change",
            },
        ));
    }

    fn link(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        reply.error(report(
            "link",
            &Error::NotPermitted {
                op: "link",
                reason: "a block has exactly one name",
            },
        ));
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let node = match self.resolve_for(req, ino) {
            Ok(n) => n,
            Err(e) => return reply.error(report("open", &e)),
        };
        let writing = flags.acc_mode() != OpenAccMode::O_RDONLY || flags.0 & libc::O_TRUNC != 0;
        let refuse = |e: Error, reply: ReplyOpen| reply.error(report("open", &e));
        match node {
            Node::Block(ns, key) | Node::Import(ns, key, _) => {
                if writing {
                    let e = match self.read_only() {
                        Err(e) => e,
                        Ok(()) if lock(&self.pending).contains_key(&(ns, key)) => Error::Busy {
                            what: format!("block {key} is being imported"),
                        },
                        Ok(()) => Error::Exists { ns, key },
                    };
                    return refuse(e, reply);
                }
                self.open_block(ino.0, &ns, &key, reply)
            }
            Node::Stats | Node::Events if writing => refuse(
                Error::NotPermitted {
                    op: "writing",
                    reason: "/.kvtier is read-only",
                },
                reply,
            ),
            Node::Stats => {
                let fh = self.alloc_fh(Handle::Text(self.stats_bytes()));
                reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO);
            }
            Node::Events => {
                let fh = self.alloc_fh(Handle::Events);
                reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO);
            }
            _ => refuse(
                Error::NotPermitted {
                    op: "open",
                    reason: "a directory",
                },
                reply,
            ),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let r = self.handle(fh).and_then(|h| match h.as_ref() {
            Handle::Block { src, .. } => self.read_block(src, offset, size as usize),
            Handle::Text(t) => {
                let start = (offset as usize).min(t.len());
                let end = start.saturating_add(size as usize).min(t.len());
                Ok(t[start..end].to_vec())
            }
            Handle::Events => Ok(self.ns.event_log().read_at(offset, size as usize)),
            Handle::Import(_) => Err(Error::BadWrite {
                reason: "a block being imported cannot be read back".into(),
            }),
            Handle::Dir(_) => Err(Error::NotPermitted {
                op: "read",
                reason: "a directory",
            }),
        });
        match r {
            Ok(v) => reply.data(&v),
            Err(e) => reply.error(report("read", &e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let r = self.handle(fh).and_then(|h| match h.as_ref() {
            Handle::Import(imp) => self.import_write(&mut lock(imp), offset, data),
            _ => Err(Error::NotPermitted {
                op: "write",
                reason: "existing blocks are immutable",
            }),
        });
        match r {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(report("write", &e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let r = self.handle(fh).and_then(|h| match h.as_ref() {
            Handle::Import(imp) => self.import_commit(&mut lock(imp)),
            _ => Ok(()),
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(report("close", &e)),
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let h = lock(&self.handles).remove(&fh.0);
        if let Some(h) = h {
            if let Handle::Import(imp) = h.as_ref() {
                let imp = lock(imp);
                if imp.state == ImportState::Open {
                    tracing::debug!(key = %imp.key, "import closed without a flush; discarded");
                }
                let mut pending = lock(&self.pending);
                // The name may already belong to a newer import.
                if pending.get(&(imp.ns, imp.key)) == Some(&fh.0) {
                    pending.remove(&(imp.ns, imp.key));
                }
            }
        }
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // Stored blocks are durable by the namespace's contract; an import
        // becomes durable when it is committed at close.
        reply.ok();
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.resolve_for(req, ino) {
            Ok(_) => {
                let fh = self.alloc_fh(Handle::Dir(Mutex::new(DirState::default())));
                reply.opened(FileHandle(fh), FopenFlags::empty());
            }
            Err(e) => reply.error(report("opendir", &e)),
        }
    }

    fn readdir(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let caller = Self::caller(req);
        let r = self
            .resolve_for(req, ino)
            .and_then(|node| self.readdir_entries(caller, &node, fh, offset, &mut reply));
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(report("readdir", &e)),
        }
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        lock(&self.handles).remove(&fh.0);
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // The store's capacity and use in 4 KiB units (what `df` shows);
        // free inodes: as many as free 4 KiB units (a block file is at
        // least one), so `df -i` does not report the mount full.
        const UNIT: u64 = 4096;
        let s = self.ns.space().unwrap_or_default();
        let blocks = s.capacity_bytes / UNIT;
        let free = s.capacity_bytes.saturating_sub(s.used_bytes) / UNIT;
        let files = s.blocks + free;
        reply.statfs(
            blocks,
            free,
            free,
            files,
            free,
            UNIT as u32,
            255,
            UNIT as u32,
        );
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let removing = name.as_bytes() == b"user.kvtier.evict";
        match self.resolve_for(req, ino).and_then(|n| {
            if removing && !self.ns.may_remove(Self::caller(req)) {
                return Err(Error::NotPermitted {
                    op: "user.kvtier.evict",
                    reason: "deleting blocks is an admin's operation here ([access] admin_uids)",
                });
            }
            self.set_xattr(&n, name, value)
        }) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(report("setxattr", &e)),
        }
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        match self
            .resolve_for(req, ino)
            .and_then(|n| self.xattr_value(&n, name))
        {
            Ok(v) => Self::reply_xattr(size, &v, reply),
            Err(e) => reply.error(report("getxattr", &e)),
        }
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        match self.resolve_for(req, ino) {
            Ok(Node::Block(..) | Node::Import(..)) => {
                let mut v = Vec::new();
                for n in XATTR_NAMES {
                    v.extend_from_slice(n.as_bytes());
                    v.push(0);
                }
                Self::reply_xattr(size, &v, reply)
            }
            Ok(_) => Self::reply_xattr(size, &[], reply),
            Err(e) => reply.error(report("listxattr", &e)),
        }
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = self.resolve_for(req, ino).and_then(|_| {
            if XATTR_NAMES.iter().any(|n| n.as_bytes() == name.as_bytes()) {
                self.read_only()?;
                Err(Error::NotPermitted {
                    op: "removing attributes",
                    reason: "user.kvtier.* attributes always exist",
                })
            } else {
                Err(Error::NoAttribute {
                    name: name.to_string_lossy().into_owned(),
                })
            }
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(report("removexattr", &e)),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let r = self.resolve_for(req, parent).and_then(|p| {
            let (node, fh) = self.start_import(&p, name)?;
            let attr = self.attr(
                ino_of(&node),
                FileType::RegularFile,
                0,
                SystemTime::now(),
                0o600,
            );
            if let Err(e) = self.remember(node) {
                self.abort_import(fh);
                return Err(e);
            }
            Ok((attr, fh))
        });
        match r {
            // TTL 0: nobody else may see the name until the import commits.
            Ok((attr, fh)) => reply.created(
                &Duration::ZERO,
                &attr,
                Generation(0),
                FileHandle(fh),
                FopenFlags::FOPEN_DIRECT_IO,
            ),
            Err(e) => reply.error(report("create", &e)),
        }
    }
}

impl KvFs {
    fn end_pending(&self, imp: &Import) {
        lock(&self.pending).remove(&(imp.ns, imp.key));
    }

    fn abort_import(&self, fh: u64) {
        if let Some(h) = lock(&self.handles).remove(&fh) {
            if let Handle::Import(imp) = h.as_ref() {
                let imp = lock(imp);
                let mut pending = lock(&self.pending);
                if pending.get(&(imp.ns, imp.key)) == Some(&fh) {
                    pending.remove(&(imp.ns, imp.key));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_mapping_is_the_documented_one() {
        let ns = NamespaceId([0; 16]);
        let key = BlockKey::from_u64(1);
        let io = |k| Error::io("x", "/p", std::io::Error::from_raw_os_error(k));
        for (e, want) in [
            (Error::block_not_found(&ns, &key), Errno::ENOENT),
            (Error::Exists { ns, key }, Errno::EEXIST),
            (Error::DirExists { path: "p".into() }, Errno::EEXIST),
            (
                Error::InvalidName {
                    name: "n".into(),
                    reason: "r",
                },
                Errno::EINVAL,
            ),
            (
                Error::NameMismatch {
                    expected: "a".into(),
                    found: "b".into(),
                },
                Errno::EINVAL,
            ),
            (Error::BadWrite { reason: "r".into() }, Errno::EINVAL),
            (Error::Poisoned, Errno::EIO),
            (
                Error::NotPermitted {
                    op: "o",
                    reason: "r",
                },
                Errno::EPERM,
            ),
            (Error::ReadOnly, Errno::EROFS),
            (Error::NoAttribute { name: "n".into() }, Errno::NO_XATTR),
            (
                Error::UnsupportedAttribute { name: "n".into() },
                Errno::ENOTSUP,
            ),
            (
                Error::LimitReached {
                    what: "w",
                    limit: 1,
                },
                Errno::EFBIG,
            ),
            (Error::Busy { what: "w".into() }, Errno::EBUSY),
            (Error::Unavailable { reason: "r".into() }, Errno::EIO),
            (io(libc::ENOSPC), Errno::ENOSPC),
        ] {
            assert_eq!(errno_of(&e), want, "{e}");
        }
    }

    #[test]
    fn inode_numbers_are_stable_and_clear_of_fixed_ones() {
        let ns = NamespaceId([5; 16]);
        let k = BlockKey::from_u64(9);
        let a = ino_of(&Node::Block(ns, k));
        assert_eq!(a, ino_of(&Node::Block(ns, k)));
        assert!(a > INO_EVENTS);
        assert_ne!(a, ino_of(&Node::Import(ns, k, 1)));
        assert_ne!(
            ino_of(&Node::Import(ns, k, 1)),
            ino_of(&Node::Import(ns, k, 2))
        );
        assert_ne!(ino_of(&Node::Ns(ns)), ino_of(&Node::Shard(ns, 0)));
    }
}
