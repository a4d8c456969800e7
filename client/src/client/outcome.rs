//! What the data-path calls answer: hits, misses and why, offload
//! outcomes, and the lookup's cached prefix.

use super::*;

/// Why a data-path call missed. More variants may come: match with a `_` arm.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissCause {
    /// Not stored.
    Absent,
    /// Stored but failed verification (in the daemon or in this client).
    Corrupt,
    /// The daemon is unreachable or went away.
    Unavailable,
    /// The deadline passed.
    Timeout,
    /// The daemon refused the request (limits, invalid input, protocol).
    Refused,
    /// The store is full.
    NoSpace,
    /// Any other storage failure.
    Storage,
    /// The caller's buffer or the shared region is too small for the block.
    TooLarge,
}

impl MissCause {
    /// The cause's stable name (`absent`, `no_space`, ...), as the Python
    /// package and the tools print it.
    pub fn name(self) -> &'static str {
        match self {
            MissCause::Absent => "absent",
            MissCause::Corrupt => "corrupt",
            MissCause::Unavailable => "unavailable",
            MissCause::Timeout => "timeout",
            MissCause::Refused => "refused",
            MissCause::NoSpace => "no_space",
            MissCause::Storage => "storage",
            MissCause::TooLarge => "too_large",
        }
    }
}

/// A miss, with what caused it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Miss {
    /// The class.
    pub cause: MissCause,
    /// Details for logs.
    pub detail: String,
}

impl Miss {
    pub(crate) fn new(cause: MissCause, detail: impl Into<String>) -> Self {
        Miss {
            cause,
            detail: detail.into(),
        }
    }

    pub(crate) fn from_error(e: &Error) -> Self {
        let cause = match e {
            Error::Timeout { .. } => MissCause::Timeout,
            Error::Unavailable { .. } | Error::Io { .. } => MissCause::Unavailable,
            Error::Format { .. } => MissCause::Corrupt,
            _ => MissCause::Refused,
        };
        Miss::new(cause, e.to_string())
    }

    pub(crate) fn from_status(s: ItemStatus) -> Self {
        let cause = match s {
            ItemStatus::Absent => MissCause::Absent,
            ItemStatus::Corrupt => MissCause::Corrupt,
            ItemStatus::Unavailable => MissCause::Unavailable,
            ItemStatus::Timeout => MissCause::Timeout,
            ItemStatus::NoSpace => MissCause::NoSpace,
            ItemStatus::Invalid | ItemStatus::LimitReached => MissCause::Refused,
            _ => MissCause::Storage,
        };
        Miss::new(cause, format!("daemon: {s:?}"))
    }
}

/// Result of a lookup: the cached prefix and where each block of it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupResult {
    /// Tier of each block of the cached prefix.
    pub tiers: Vec<Tier>,
    /// Set when the lookup itself failed (the prefix is then empty).
    pub miss: Option<Miss>,
}

impl LookupResult {
    /// Number of leading blocks that are cached.
    pub fn prefix_len(&self) -> usize {
        self.tiers.len()
    }
}

/// One block to offload.
#[derive(Debug, Clone, Copy)]
pub struct OffloadBlock<'a> {
    /// Its key.
    pub key: BlockKey,
    /// The previous block of its chain.
    pub parent: Option<BlockKey>,
    /// The bytes (exactly the namespace layout's block size).
    pub payload: &'a [u8],
    /// Hints.
    pub hints: Hints,
}

/// Outcome of offloading one block. More variants may come: match with a `_` arm.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OffloadOutcome {
    /// Stored and durable.
    Stored,
    /// Stored and durable, but its pin hint was refused: the daemon's pin
    /// budget is spent, so the block is evicted like any other. Pin fewer
    /// blocks, unpin others, or give G3 more capacity (the budget is half
    /// of it).
    StoredUnpinned,
    /// Already there; nothing written.
    AlreadyPresent,
    /// Not stored.
    Failed(Miss),
}

impl OffloadOutcome {
    /// The outcome a daemon's per-item status means.
    pub(crate) fn from_status(s: ItemStatus) -> Self {
        match s {
            ItemStatus::Ok => OffloadOutcome::Stored,
            ItemStatus::StoredUnpinned => OffloadOutcome::StoredUnpinned,
            ItemStatus::AlreadyPresent => OffloadOutcome::AlreadyPresent,
            s => OffloadOutcome::Failed(Miss::from_status(s)),
        }
    }

    /// Newly stored by this offload (pinned as asked or not).
    pub fn is_stored(&self) -> bool {
        matches!(
            self,
            OffloadOutcome::Stored | OffloadOutcome::StoredUnpinned
        )
    }
}

/// Outcome of onboarding one block. More variants may come: match with a `_` arm.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Onboarded {
    /// The verified payload is in the caller's buffer.
    Hit {
        /// Where it came from.
        tier: Tier,
        /// Bytes written at the start of the buffer.
        payload_len: u64,
    },
    /// Not served: recompute.
    Miss(Miss),
}

impl Onboarded {
    /// Whether the block was served.
    pub fn is_hit(&self) -> bool {
        matches!(self, Onboarded::Hit { .. })
    }
}
