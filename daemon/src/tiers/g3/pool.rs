//! The aligned write buffers every write copies through: allocated once at
//! open (`buffer_pool_bytes`), taken and given back per write.

use super::engine::{AlignedBuf, CHUNK_BYTES};
use crate::base::error::{Error, Result};
use std::sync::{Condvar, Mutex};

/// Aligned write buffers allocated once at open.
pub(super) struct BufferPool {
    free: Mutex<Vec<AlignedBuf>>,
    freed: Condvar,
}

impl BufferPool {
    pub(super) fn new(total_bytes: u64) -> Result<Self> {
        let n = (total_bytes / CHUNK_BYTES as u64).max(1) as usize;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(
                AlignedBuf::rounded(CHUNK_BYTES)
                    .map_err(|e| Error::io("allocating", "buffer pool", e))?,
            );
        }
        Ok(BufferPool {
            free: Mutex::new(v),
            freed: Condvar::new(),
        })
    }

    /// Takes 1..=n buffers, waiting while none is free.
    pub(super) fn take(&self, n: usize) -> Vec<AlignedBuf> {
        let Ok(mut free) = self.free.lock() else {
            return Vec::new();
        };
        while free.is_empty() {
            free = match self.freed.wait(free) {
                Ok(f) => f,
                Err(_) => return Vec::new(),
            };
        }
        let k = n.min(free.len());
        let at = free.len() - k;
        free.split_off(at)
    }

    pub(super) fn give(&self, bufs: Vec<AlignedBuf>) {
        if let Ok(mut f) = self.free.lock() {
            f.extend(bufs);
        }
        self.freed.notify_all();
    }
}

/// Largest bounce buffer kept for reuse; bigger blocks get a one-off one.
const BOUNCE_KEEP_MAX_BYTES: usize = 64 << 20;

/// Aligned buffers the read path reads and verifies into before copying to
/// the caller's memory (which may be a client's shared memory that the
/// client can change while we verify). Up to `keep_max` are kept for
/// reuse; they grow to the largest block read.
pub(super) struct BouncePool {
    free: Mutex<Vec<AlignedBuf>>,
    keep_max: usize,
}

impl BouncePool {
    pub(super) fn new(keep_max: usize) -> Self {
        BouncePool {
            free: Mutex::new(Vec::new()),
            keep_max: keep_max.max(1),
        }
    }

    /// A buffer of at least `len` bytes (4096-aligned).
    pub(super) fn take(&self, len: usize) -> std::io::Result<AlignedBuf> {
        if let Ok(mut free) = self.free.lock() {
            if let Some(i) = free.iter().position(|b| b.len() >= len) {
                return Ok(free.swap_remove(i));
            }
            // None fits: drop the biggest too-small one rather than keep
            // buffers nobody can use.
            if let Some((i, _)) = free.iter().enumerate().max_by_key(|(_, b)| b.len()) {
                free.swap_remove(i);
            }
        }
        AlignedBuf::rounded(len.max(1))
    }

    pub(super) fn give(&self, buf: AlignedBuf) {
        if buf.len() > BOUNCE_KEEP_MAX_BYTES {
            return;
        }
        if let Ok(mut free) = self.free.lock() {
            if free.len() < self.keep_max {
                free.push(buf);
            }
        }
    }
}
