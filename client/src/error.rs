//! The crate's one error type.

use std::path::PathBuf;

/// Why a block file (or a buffer claiming to be one) was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FormatFault {
    /// Fewer bytes than the header or the declared payload needs.
    Truncated,
    /// More bytes than the header declares, or a payload above the limit.
    Oversized,
    /// The first eight bytes are not the block magic.
    BadMagic,
    /// A format version this build does not read.
    UnknownVersion,
    /// The header checksum does not match the header bytes.
    HeaderChecksum,
    /// The payload's blake3 does not match the header.
    PayloadChecksum,
    /// A reserved or padding byte is not zero, or a field is out of range.
    Malformed,
    /// The payload length disagrees with the layout.
    LayoutMismatch,
}

/// Errors of the kvtier client crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A block file failed validation.
    #[error("invalid block ({fault:?}): {detail}")]
    Format {
        /// The class of fault.
        fault: FormatFault,
        /// What exactly was wrong, for a person.
        detail: String,
    },
    /// A key string or byte string is not a valid block key.
    #[error("invalid block key {input:?}: {reason}")]
    InvalidKey {
        /// The offending input (truncated for display).
        input: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// A namespace or layout field is out of range.
    #[error("invalid namespace field `{field}`: {reason}")]
    InvalidNamespace {
        /// The field name.
        field: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// A shared-memory pool was refused (its size, a second pool, a
    /// region past the client's or the daemon's limit).
    #[error("{reason}")]
    Pool {
        /// Why.
        reason: String,
    },
    /// A wire frame was malformed or too large.
    #[error("protocol error: {reason}")]
    Protocol {
        /// Why the frame was refused.
        reason: String,
    },
    /// The daemon answered with an error.
    #[error("daemon refused the request ({code}): {message}")]
    Remote {
        /// Numeric error code from the wire.
        code: u16,
        /// Message from the daemon.
        message: String,
    },
    /// The call ran past its deadline.
    #[error("deadline of {timeout_ms} ms exceeded during {op}")]
    Timeout {
        /// Operation that timed out.
        op: &'static str,
        /// The deadline that passed.
        timeout_ms: u64,
    },
    /// The daemon could not be reached.
    #[error("daemon at {socket} unavailable: {source}")]
    Unavailable {
        /// Socket path.
        socket: PathBuf,
        /// Underlying cause.
        #[source]
        source: std::io::Error,
    },
    /// An I/O error with the path it happened on.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The path (may be empty for sockets).
        path: PathBuf,
        /// Underlying cause.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub(crate) fn format(fault: FormatFault, detail: impl Into<String>) -> Self {
        Error::Format {
            fault,
            detail: detail.into(),
        }
    }

    /// The format fault, if this is a format error.
    pub fn format_fault(&self) -> Option<FormatFault> {
        match self {
            Error::Format { fault, .. } => Some(*fault),
            _ => None,
        }
    }
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
