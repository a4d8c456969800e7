//! The daemon crate's one error type.
//!
//! Variants carry structured context so that a person can act on the
//! message. Object-store errors are rendered without credentials.

use kvtier_client::{BlockKey, NamespaceId, Tier};
use std::path::PathBuf;

/// Errors of kvtier-daemon.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The filesystem under a tier is full.
    #[error("no space left on {path} while {op}")]
    NoSpace {
        /// Where.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
    },
    /// An I/O error.
    #[error("I/O error while {op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// Where.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// A previous durable-write failure (fsync) made the tier read-only
    /// until restart: it refuses writes rather than pretend.
    #[error("{tier:?} refuses writes until restart: an earlier flush failed ({cause})")]
    PreviousIo {
        /// Which tier.
        tier: Tier,
        /// The first failure.
        cause: String,
    },
    /// A block failed verification.
    #[error("block {key} in namespace {ns} on {tier:?} is corrupt: {detail}")]
    Corrupt {
        /// Namespace.
        ns: NamespaceId,
        /// Key.
        key: BlockKey,
        /// Tier.
        tier: Tier,
        /// What failed.
        detail: String,
    },
    /// A bounded resource is exhausted.
    #[error("limit reached: {what} (limit {limit})")]
    LimitReached {
        /// What is exhausted.
        what: &'static str,
        /// The limit.
        limit: u64,
    },
    /// A block continues a parent this tier does not hold: stored, it
    /// could never be reached by a lookup of its chain (the wire's
    /// `Absent`).
    #[error("block {key} continues {parent}, which is not stored here (store the chain from its first missing block)")]
    ParentAbsent {
        /// The block refused (boxed: two inline keys would make every
        /// `Result` of this crate carry 130 bytes of error).
        key: Box<BlockKey>,
        /// Its parent.
        parent: Box<BlockKey>,
    },
    /// The request is invalid.
    #[error("invalid {what}: {reason}")]
    InvalidInput {
        /// What was invalid.
        what: &'static str,
        /// Why.
        reason: String,
    },
    /// The configuration is invalid.
    #[error("config: `{key}`: {problem}")]
    Config {
        /// The config key.
        key: String,
        /// What is wrong with it.
        problem: String,
    },
    /// The index store failed.
    #[error("index at {path}: {detail}")]
    Index {
        /// Index file.
        path: PathBuf,
        /// What failed.
        detail: String,
    },
    /// The object store (G4) failed.
    #[error("object store {op} {location}: {detail}")]
    ObjectStore {
        /// Operation (put, get, head, delete, list).
        op: &'static str,
        /// Object path.
        location: String,
        /// What failed (never contains credentials).
        detail: String,
    },
    /// A peer daemon failed or lied.
    #[error("peer {peer}: {detail}")]
    Peer {
        /// Peer address.
        peer: String,
        /// What failed.
        detail: String,
    },
    /// A deadline passed.
    #[error("deadline of {timeout_ms} ms exceeded during {op}")]
    Timeout {
        /// Operation.
        op: &'static str,
        /// Deadline.
        timeout_ms: u64,
    },
    /// Another process holds the data directory (its lock file is
    /// locked): two daemons on one directory would corrupt each other's
    /// index, so the second one stops at once.
    #[error(
        "{dir} is in use by another kvtierd ({holder}; lock {lock_file}): \
         stop that one first, or give this one its own directory"
    )]
    InUse {
        /// The data directory.
        dir: PathBuf,
        /// Its lock file.
        lock_file: PathBuf,
        /// What the holder wrote there: `pid <pid> socket <path>`.
        holder: String,
    },
    /// An error from the client crate (format, keys, protocol).
    #[error(transparent)]
    Client(#[from] kvtier_client::Error),
    /// Mounting or serving the filesystem view failed (kvtier-fs).
    #[error("mount: {0}")]
    Mount(Box<kvtier_fs::Error>),
}

impl Error {
    /// An I/O error, classified: ENOSPC and EDQUOT become [`Error::NoSpace`].
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        match source.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => Error::NoSpace { path, op },
            _ => Error::Io { op, path, source },
        }
    }
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error and its causes, `: `-separated, each said once: an error whose
/// message already ends with its cause's (`I/O error while ...: Address in
/// use`, which also names the cause as its `source`) does not repeat it.
/// What kvtierd and kvtier print for a failure.
pub fn cause_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = String::new();
    let mut next = Some(e);
    while let Some(cause) = next {
        let text = cause.to_string();
        if !out.ends_with(&text) {
            if !out.is_empty() {
                out += ": ";
            }
            out += &text;
        }
        next = cause.source();
    }
    out
}
