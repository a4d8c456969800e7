//! An owned one-block buffer of any memory kind, for benchmarks, tools and
//! tests: device or pinned memory when a GPU is open, host memory standing
//! in for them otherwise.

use crate::error::Result;
use crate::memory::{Destination, HostBuf, MemoryKind};
use crate::transfer::Transfer;

/// An owned buffer of one memory kind.
#[derive(Debug)]
pub struct BlockBuf {
    kind: MemoryKind,
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    Host(HostBuf),
    #[cfg(feature = "cuda")]
    Pinned(crate::cuda::PinnedBuf),
    #[cfg(feature = "cuda")]
    Device(crate::cuda::DeviceBuf),
}

impl BlockBuf {
    /// `bytes` of `kind` memory on the transfer's GPU, or host memory
    /// standing in for pinned/device memory when no GPU is open.
    pub fn new(kind: MemoryKind, bytes: usize, t: &Transfer) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if let Some(g) = t.gpu() {
            let inner = match kind {
                MemoryKind::Host => Inner::Host(HostBuf::new(bytes)?),
                MemoryKind::Pinned => Inner::Pinned(crate::cuda::PinnedBuf::new(g, bytes)?),
                MemoryKind::Device => Inner::Device(crate::cuda::DeviceBuf::new(g, bytes)?),
            };
            return Ok(BlockBuf { kind, inner });
        }
        let _ = t;
        Ok(BlockBuf {
            kind,
            inner: Inner::Host(HostBuf::new(bytes)?),
        })
    }

    /// True when host memory stands in for pinned or device memory.
    pub fn is_emulated(&self) -> bool {
        matches!(self.inner, Inner::Host(_)) && self.kind != MemoryKind::Host
    }

    /// The memory kind.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// The whole buffer as a one-region destination.
    pub fn destination(&mut self) -> Destination<'_> {
        let kind = self.kind;
        match &mut self.inner {
            Inner::Host(b) => Destination::emulated(kind, vec![b.as_mut_slice()]),
            #[cfg(feature = "cuda")]
            Inner::Pinned(b) => Destination::pinned(vec![b]),
            #[cfg(feature = "cuda")]
            Inner::Device(b) => Destination::device(vec![b]),
        }
    }
}

impl Transfer {
    /// Pinned host-to-device copy bandwidth in GB/s (`reps` copies of
    /// `bytes`), or `None` without a GPU: the PCIe baseline of
    /// `kvtier bench gds`.
    pub fn h2d_pinned_gbps(&self, bytes: usize, reps: usize) -> Result<Option<f64>> {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gpu() {
            return crate::cuda::h2d_pinned_gbps(g, bytes, reps).map(Some);
        }
        let _ = (bytes, reps);
        Ok(None)
    }
}
