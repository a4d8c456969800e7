//! Block file verification: [`Verifier`] checks header, length, padding and
//! payload checksum piece by piece as the engine completes reads (the read
//! path and recovery use it); `verify_all` re-checks every block.

use super::engine::{AlignedBuf, CHUNK_BYTES};
use super::G3Store;
use crate::base::error::{Error, Result};
use crate::base::tier::{Lookup, MissReason};
use kvtier_client::block::HEADER_BYTES;
use kvtier_client::{BlockHeader, BlockKey, NamespaceId, SumAlgo, SumHasher};
use std::sync::atomic::Ordering;

/// Result of [`G3Store::verify_all`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// Blocks checked.
    pub checked: u64,
    /// Blocks that verified.
    pub ok: u64,
    /// Blocks quarantined.
    pub corrupt: u64,
    /// Blocks whose file vanished (dropped from the index).
    pub vanished: u64,
}

/// How a read went, before it is turned into a `Lookup`.
pub(super) enum ReadOutcome {
    Ok(BlockHeader),
    Vanished,
    Corrupt(String),
}

/// Checks a block file piece by piece as the engine completes it: header
/// first, then payload checksum and zero padding.
pub(super) struct Verifier<'a> {
    ns: &'a NamespaceId,
    key: &'a BlockKey,
    file_len: u64,
    pos: u64,
    head: Vec<u8>,
    header: Option<BlockHeader>,
    /// Replaced by the header's own function once the header is read.
    hasher: SumHasher,
    /// False: the header and length only (the reader checks the payload
    /// itself, see [`Verifier::header_only`]).
    payload: bool,
    fault: Option<String>,
}

impl<'a> Verifier<'a> {
    pub(super) fn new(ns: &'a NamespaceId, key: &'a BlockKey, file_len: u64) -> Self {
        Verifier {
            ns,
            key,
            file_len,
            pos: 0,
            head: Vec::new(),
            header: None,
            hasher: SumHasher::new(SumAlgo::Xxh3_128),
            payload: true,
            fault: None,
        }
    }

    /// Checks the header (names this block, describes a file of this
    /// length) and the length read, not the payload's checksum nor the
    /// padding: for a reader that verifies the payload bytes it receives
    /// against the header's checksum itself (a client onboarding into its
    /// shared region), so each byte is hashed once, on the side that
    /// uses it.
    pub(super) fn header_only(ns: &'a NamespaceId, key: &'a BlockKey, file_len: u64) -> Self {
        Verifier {
            payload: false,
            ..Verifier::new(ns, key, file_len)
        }
    }

    pub(super) fn feed(&mut self, piece: &[u8]) {
        let start = self.pos;
        self.pos += piece.len() as u64;
        if self.fault.is_some() {
            return;
        }
        let mut p = piece;
        let mut off = start;
        if self.header.is_none() {
            let need = HEADER_BYTES - self.head.len();
            let n = need.min(p.len());
            self.head.extend_from_slice(&p[..n]);
            p = &p[n..];
            off += n as u64;
            if self.head.len() < HEADER_BYTES {
                return;
            }
            match BlockHeader::decode(&self.head) {
                Ok(h) => {
                    if h.key != *self.key || h.namespace_id() != *self.ns {
                        self.fault = Some("header names another block".into());
                    } else if h.file_len() != self.file_len {
                        self.fault = Some(format!(
                            "header describes a {}-byte file, index says {}",
                            h.file_len(),
                            self.file_len
                        ));
                    }
                    self.hasher = h.payload_hasher();
                    self.header = Some(h);
                }
                Err(e) => self.fault = Some(e.to_string()),
            }
            if self.fault.is_some() {
                return;
            }
        }
        let Some(h) = &self.header else { return };
        if !self.payload {
            return;
        }
        let pend = HEADER_BYTES as u64 + h.payload_len;
        let end = off + p.len() as u64;
        let a = off.max(HEADER_BYTES as u64);
        let b = end.min(pend);
        if a < b {
            self.hasher
                .update(&p[(a - off) as usize..(b - off) as usize]);
        }
        let pad_from = off.max(pend);
        if pad_from < end && p[(pad_from - off) as usize..].iter().any(|&x| x != 0) {
            self.fault = Some("padding bytes are not zero".into());
        }
    }

    pub(super) fn finish(self, got: u64) -> ReadOutcome {
        if let Some(f) = self.fault {
            return ReadOutcome::Corrupt(f);
        }
        if got != self.file_len || self.pos != self.file_len {
            return ReadOutcome::Corrupt(format!("read {got} bytes of {}", self.file_len));
        }
        match self.header {
            Some(h) if !self.payload => ReadOutcome::Ok(h),
            Some(h) if self.hasher.finish() == h.payload_sum => ReadOutcome::Ok(h),
            Some(_) => ReadOutcome::Corrupt("payload checksum mismatch".into()),
            None => ReadOutcome::Corrupt("no header".into()),
        }
    }
}

impl G3Store {
    /// Re-reads and re-checksums every block; failures are quarantined.
    pub fn verify_all(&self) -> Result<VerifyReport> {
        let mut names = Vec::new();
        self.disk
            .for_each(|_, r| names.push((r.ns, r.key, r.file_len())))?;
        let mut rep = VerifyReport::default();
        let mut buf = AlignedBuf::rounded(CHUNK_BYTES)
            .map_err(|e| Error::io("allocating", "verify buffer", e))?;
        for (ns, key, len) in names {
            if (buf.len() as u64) < len {
                buf = AlignedBuf::rounded(len as usize)
                    .map_err(|e| Error::io("allocating", "verify buffer", e))?;
            }
            rep.checked += 1;
            let q0 = self.counters.quarantined.load(Ordering::Relaxed);
            match self.read_into(&ns, &key, buf.as_mut_slice())? {
                Lookup::Hit(_) => rep.ok += 1,
                Lookup::Miss(MissReason::Corrupt) => rep.corrupt += 1,
                Lookup::Miss(_) => {
                    if self.counters.quarantined.load(Ordering::Relaxed) == q0 {
                        rep.vanished += 1;
                    }
                }
            }
        }
        Ok(rep)
    }
}
