//! The aligned write buffers every write copies through: allocated once at
//! open (`buffer_pool_bytes`), taken and given back per write.

use super::engine::{AlignedBuf, CHUNK_BYTES};
use crate::error::{Error, Result};
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
