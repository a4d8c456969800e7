//! The crate's one error type.
//!
//! Every failure in kvtier-fs, from a namespace implementation or from the
//! adapter itself, is one of these variants. The FUSE edge turns them into
//! errno values in exactly one place (`adapter::errno_of`), so the mapping
//! is reviewed once and tested through the real mount.

use kvtier_client::{BlockKey, NamespaceId};
use std::path::PathBuf;

/// Errors of kvtier-fs.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The namespace or block does not exist (errno ENOENT).
    #[error("{what} not found")]
    NotFound {
        /// What was looked for, e.g. `block <ns>/<hh>/<key>`.
        what: String,
    },
    /// A create-once write targeted a block that already exists (EEXIST).
    #[error("block {key} already exists in namespace {ns}: blocks are write-once")]
    Exists {
        /// Namespace.
        ns: NamespaceId,
        /// Key.
        key: BlockKey,
    },
    /// mkdir of a directory that the scheme already provides (EEXIST).
    #[error("directory {path} already exists")]
    DirExists {
        /// The directory, relative to the mount.
        path: String,
    },
    /// A path component is not a name the scheme allows (EINVAL on create,
    /// ENOENT on lookup).
    #[error("invalid name {name:?}: {reason}")]
    InvalidName {
        /// The offending name, truncated and escaped for display.
        name: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// Imported bytes are not a valid block file (EINVAL).
    #[error("imported file is not a valid block: {source}")]
    InvalidBlock {
        /// The format check that failed.
        #[source]
        source: kvtier_client::Error,
    },
    /// The imported block's header names another key or namespace than the
    /// path it was written to (EINVAL).
    #[error("file name says {expected} but the block header says {found}")]
    NameMismatch {
        /// `<ns>/<key>` taken from the path.
        expected: String,
        /// `<ns>/<key>` taken from the header.
        found: String,
    },
    /// A write did not continue exactly where the previous one ended, or a
    /// file was closed before all of its bytes arrived (EINVAL).
    #[error("import refused: {reason}")]
    BadWrite {
        /// What was wrong with the write sequence.
        reason: String,
    },
    /// The import was already refused; every further write or flush on that
    /// handle fails (EIO).
    #[error("import was already refused on this handle; nothing was stored")]
    Poisoned,
    /// The operation is not part of a write-once, content-named namespace:
    /// rename, link, symlink, mkdir outside the scheme, chmod (EPERM).
    #[error("{op} is not supported: {reason}")]
    NotPermitted {
        /// The refused operation.
        op: &'static str,
        /// Why, for a person.
        reason: &'static str,
    },
    /// The mount is read-only (EROFS).
    #[error("the mount is read-only")]
    ReadOnly,
    /// An attribute the namespace does not define (ENODATA).
    #[error("no attribute {name:?}")]
    NoAttribute {
        /// The attribute name.
        name: String,
    },
    /// An attribute outside `user.kvtier.*` (ENOTSUP).
    #[error("attribute {name:?} is not supported: only user.kvtier.* exists here")]
    UnsupportedAttribute {
        /// The attribute name.
        name: String,
    },
    /// A bounded resource is exhausted (EFBIG for file sizes, EBUSY otherwise).
    #[error("limit reached: {what} (limit {limit})")]
    LimitReached {
        /// What is exhausted.
        what: &'static str,
        /// The limit.
        limit: u64,
    },
    /// The object is in use in a way that conflicts (EBUSY).
    #[error("busy: {what}")]
    Busy {
        /// What is busy.
        what: String,
    },
    /// The namespace's backing store failed or could not be reached (EIO).
    #[error("store unavailable: {reason}")]
    Unavailable {
        /// Why.
        reason: String,
    },
    /// An I/O error with the operation and path it happened on (its own
    /// errno when it has one, else EIO).
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
    /// Mounting or unmounting failed.
    #[error("mount at {path} failed while {op}: {source}")]
    Mount {
        /// What was being done.
        op: &'static str,
        /// Mount point.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// FUSE passthrough was required by the options but is unavailable.
    #[error("FUSE passthrough required but unavailable: {reason}")]
    PassthroughUnavailable {
        /// Why (kernel lacks it, no CAP_SYS_ADMIN, ...).
        reason: String,
    },
}

impl Error {
    /// An I/O error with context.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }

    /// A `NotFound` for a block.
    pub fn block_not_found(ns: &NamespaceId, key: &BlockKey) -> Self {
        Error::NotFound {
            what: format!("block {}", kvtier_client::block_path(ns, key)),
        }
    }
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
