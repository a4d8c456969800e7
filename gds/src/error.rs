//! The crate's one error type.

/// Errors of kvtier-gds. An integrity error ([`Error::is_integrity`]) means
/// the destination bytes must not be used: the caller turns it into a miss.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The payload's checksum does not match the block header: the
    /// destination now holds untrusted bytes and must be treated as a miss.
    #[error("payload checksum mismatch (expected {expected}, read {actual}): destination bytes are untrusted, treat the block as a miss")]
    Checksum {
        /// Expected digest, hex.
        expected: String,
        /// Digest of the bytes that arrived, hex.
        actual: String,
    },
    /// The file ended before the payload did.
    #[error(
        "block file truncated: wanted {wanted_bytes} bytes at offset {offset}, got {got_bytes}"
    )]
    Truncated {
        /// File offset of the read.
        offset: u64,
        /// Bytes asked for.
        wanted_bytes: u64,
        /// Bytes delivered before end of file.
        got_bytes: u64,
    },
    /// The destination regions do not match the KV layout.
    #[error("destination does not fit the layout: {what} ({detail})")]
    Layout {
        /// What disagrees.
        what: &'static str,
        /// The numbers, for a person.
        detail: String,
    },
    /// An offset, length or buffer is not aligned as O_DIRECT/GDS needs.
    #[error("{what} = {value} is not a multiple of {align}")]
    Unaligned {
        /// Which value.
        what: &'static str,
        /// Its value.
        value: u64,
        /// The alignment required.
        align: u64,
    },
    /// A configuration value is out of range.
    #[error("invalid transfer config `{field}`: {reason}")]
    Config {
        /// The field.
        field: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// An I/O error reading the block file or setting up io_uring.
    #[error("I/O error during {op}: {source}")]
    Io {
        /// The operation.
        op: &'static str,
        /// Underlying cause.
        #[source]
        source: std::io::Error,
    },
    /// Device memory was asked for but this process has no usable CUDA.
    #[error("no CUDA device usable: {reason}")]
    NoCuda {
        /// Why (library absent, no device, feature off).
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA call {op} failed: {detail}")]
    Cuda {
        /// The driver call.
        op: &'static str,
        /// The driver's error.
        detail: String,
    },
    /// A GPUDirect Storage (cuFile) call failed; the transfer falls back to
    /// the bounce path.
    #[error("GPUDirect Storage {op} failed: {detail}")]
    Gds {
        /// The cuFile call.
        op: &'static str,
        /// The error.
        detail: String,
    },
}

impl Error {
    /// True when the bytes that arrived are wrong (checksum or truncation):
    /// a miss, and the destination is untrusted.
    pub fn is_integrity(&self) -> bool {
        matches!(self, Error::Checksum { .. } | Error::Truncated { .. })
    }

    pub(crate) fn io(op: &'static str, source: std::io::Error) -> Self {
        Error::Io { op, source }
    }
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
