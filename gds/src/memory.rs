//! Where block bytes land: memory kinds, page-aligned host buffers, and the
//! destination descriptor (one region, or one region per layer).
//!
//! Layout is kept apart from where the memory is (Dynamo's block manager
//! does the same): a [`Destination`] is a list of regions of one
//! [`MemoryKind`]; [`KvLayout`] says how the payload is cut across them.

use crate::error::{Error, Result};
use kvtier_client::{AlignedBuf, KvLayout, LayoutKind};

/// Alignment of every bounce buffer and of O_DIRECT offsets and lengths.
pub const PAGE_BYTES: usize = kvtier_client::aligned::ALIGN_BYTES;

/// The kind of memory a block is moved into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Ordinary (pageable) host memory.
    Host,
    /// Page-locked host memory registered with CUDA (fast DMA to the GPU).
    Pinned,
    /// GPU memory (HBM).
    Device,
}

impl MemoryKind {
    /// Lowercase name (`host`, `pinned`, `device`).
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Host => "host",
            MemoryKind::Pinned => "pinned",
            MemoryKind::Device => "device",
        }
    }

    /// Parses `host`, `pinned`, `device`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "host" => Some(MemoryKind::Host),
            "pinned" => Some(MemoryKind::Pinned),
            "device" | "hbm" | "gpu" => Some(MemoryKind::Device),
            _ => None,
        }
    }
}

/// A page-aligned, zeroed host buffer (for O_DIRECT and as the stand-in for
/// pinned or device memory on machines without a GPU): the client crate's
/// [`AlignedBuf`] with this crate's error.
pub struct HostBuf(AlignedBuf);

impl HostBuf {
    /// `len` zeroed bytes aligned to [`PAGE_BYTES`] (at least one page is
    /// allocated; `len` itself is kept exact).
    pub fn new(len: usize) -> Result<Self> {
        AlignedBuf::new(len)
            .map(HostBuf)
            .map_err(|e| Error::Config {
                field: "buffer_bytes",
                reason: format!("allocating {len} bytes: {e}"),
            })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.0.as_slice()
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.0.as_mut_slice()
    }
}

impl std::fmt::Debug for HostBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBuf({} bytes)", self.len())
    }
}

/// A span of device memory: a raw CUDA device pointer and a length, as an
/// engine hands it over. It lives in the context of the transfer's GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSpan {
    /// `CUdeviceptr` of the first byte.
    pub ptr: u64,
    /// Length in bytes.
    pub len: usize,
}

/// One contiguous destination region.
#[derive(Debug)]
pub enum Region<'a> {
    /// Host memory (plain or pinned, or host memory standing in for HBM).
    Host(&'a mut [u8]),
    /// GPU memory.
    Device(DeviceSpan),
}

impl Region<'_> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Region::Host(b) => b.len(),
            Region::Device(s) => s.len,
        }
    }

    /// True for an empty region.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where one block goes: the regions the engine owns, all of one kind, in
/// layer order. Layer-contiguous layouts take one region of the whole block;
/// layer-separate layouts take one region per layer.
#[derive(Debug)]
pub struct Destination<'a> {
    kind: MemoryKind,
    regions: Vec<Region<'a>>,
    emulated: bool,
    /// Regions cut wherever the engine's memory is, not by layer.
    segments: bool,
}

impl<'a> Destination<'a> {
    /// One host region.
    pub fn host(buf: &'a mut [u8]) -> Self {
        Self::host_layers(vec![buf])
    }

    /// One host region per layer.
    pub fn host_layers(layers: Vec<&'a mut [u8]>) -> Self {
        Destination {
            kind: MemoryKind::Host,
            regions: layers.into_iter().map(Region::Host).collect(),
            emulated: false,
            segments: false,
        }
    }

    /// Host memory standing in for `kind` (pinned or device) on machines
    /// without a GPU: planned as `kind`, written with host copies. This is
    /// how the whole device path runs in CI.
    pub fn emulated(kind: MemoryKind, layers: Vec<&'a mut [u8]>) -> Self {
        Destination {
            kind,
            regions: layers.into_iter().map(Region::Host).collect(),
            emulated: kind != MemoryKind::Host,
            segments: false,
        }
    }

    /// Page-locked host memory the caller allocated through CUDA, one
    /// region per layer (or one for the whole block).
    #[cfg(feature = "cuda")]
    pub fn pinned(layers: Vec<&'a mut crate::cuda::PinnedBuf>) -> Self {
        Destination {
            kind: MemoryKind::Pinned,
            regions: layers
                .into_iter()
                .map(|b| Region::Host(b.as_mut_slice()))
                .collect(),
            emulated: false,
            segments: false,
        }
    }

    /// Device buffers allocated through this crate, one per layer (or one
    /// for the whole block). The borrow keeps them alive for the transfer.
    #[cfg(feature = "cuda")]
    pub fn device(layers: Vec<&'a mut crate::cuda::DeviceBuf>) -> Self {
        Destination {
            kind: MemoryKind::Device,
            regions: layers
                .into_iter()
                .map(|b| Region::Device(b.span()))
                .collect(),
            emulated: false,
            segments: false,
        }
    }

    /// Device memory the engine owns as cudarc slices (one per layer, or
    /// one for the block), on GPU 0. Waits for work already queued on each
    /// slice's stream; the transfer's own copies are complete when it
    /// returns.
    #[cfg(feature = "cuda")]
    pub fn from_cudarc(layers: Vec<&'a mut cudarc::driver::CudaSlice<u8>>) -> Result<Self> {
        let spans = layers
            .into_iter()
            .map(crate::cuda::cudarc_span)
            .collect::<Result<Vec<_>>>()?;
        Ok(Destination {
            kind: MemoryKind::Device,
            regions: spans.into_iter().map(Region::Device).collect(),
            emulated: false,
            segments: false,
        })
    }

    /// Device memory the engine owns, as raw pointers.
    ///
    /// # Safety
    /// Every span must be device memory allocated in the primary context of
    /// the transfer's GPU, valid for `len` bytes, not freed or used by
    /// anything else until the transfer returns.
    pub unsafe fn device_raw(spans: Vec<DeviceSpan>) -> Self {
        Destination {
            kind: MemoryKind::Device,
            regions: spans.into_iter().map(Region::Device).collect(),
            emulated: false,
            segments: false,
        }
    }

    /// The same regions taken as the block's bytes in payload order, cut
    /// wherever the caller's memory is (a Python list of segments, say)
    /// rather than one per layer: only their total is checked against the
    /// payload, not the namespace layout's layer size.
    pub fn segments(mut self) -> Self {
        self.segments = true;
        self
    }

    /// Whether [`Self::segments`] was called.
    pub fn is_segments(&self) -> bool {
        self.segments
    }

    /// The memory kind the planner sees.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// True when host memory stands in for pinned or device memory.
    pub fn is_emulated(&self) -> bool {
        self.emulated
    }

    /// The regions, in layer order.
    pub fn regions(&self) -> &[Region<'a>] {
        &self.regions
    }

    pub(crate) fn regions_mut(&mut self) -> &mut [Region<'a>] {
        &mut self.regions
    }

    /// Region lengths, in order.
    pub fn region_lens(&self) -> Vec<usize> {
        self.regions.iter().map(Region::len).collect()
    }

    /// True when any region is device memory.
    pub fn has_device_regions(&self) -> bool {
        self.regions.iter().any(|r| matches!(r, Region::Device(_)))
    }
}

/// Checks that `region_lens` can hold exactly one block of `layout` whose
/// payload is `payload_len` bytes: one region of the whole block for
/// layer-contiguous layouts, one region of `layer_bytes` per layer for
/// layer-separate ones.
pub fn check_layout(layout: &KvLayout, payload_len: u64, region_lens: &[usize]) -> Result<()> {
    let bad = |what, detail: String| Err(Error::Layout { what, detail });
    if layout.block_bytes() != payload_len {
        return bad(
            "payload length",
            format!(
                "payload of {payload_len} bytes, layout block is {}",
                layout.block_bytes()
            ),
        );
    }
    match layout.kind {
        LayoutKind::LayerContiguous => {
            if region_lens.len() != 1 {
                return bad(
                    "region count",
                    format!(
                        "layer-contiguous block needs 1 region, got {}",
                        region_lens.len()
                    ),
                );
            }
            if region_lens[0] as u64 != payload_len {
                return bad(
                    "region length",
                    format!(
                        "region of {} bytes for a {payload_len}-byte block",
                        region_lens[0]
                    ),
                );
            }
        }
        LayoutKind::LayerSeparate => {
            if region_lens.len() as u64 != layout.layers as u64 {
                return bad(
                    "region count",
                    format!(
                        "{} layers need {} regions, got {}",
                        layout.layers,
                        layout.layers,
                        region_lens.len()
                    ),
                );
            }
            let lb = layout.layer_bytes();
            if let Some((i, l)) = region_lens
                .iter()
                .enumerate()
                .find(|(_, &l)| l as u64 != lb)
            {
                return bad(
                    "layer region length",
                    format!("layer {i} region is {l} bytes, a layer is {lb}"),
                );
            }
        }
    }
    Ok(())
}

/// A cursor that cuts the payload stream across the destination regions:
/// the block file stores layers back to back, so payload byte `p` lands in
/// the region whose running total first exceeds `p`.
#[derive(Debug, Clone)]
pub struct Scatter {
    lens: Vec<usize>,
    region: usize,
    offset: usize,
}

/// One piece of a scatter: `len` bytes of the chunk starting at `src_off`
/// go to region `region` at `dst_off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Destination region index.
    pub region: usize,
    /// Offset inside that region.
    pub dst_off: usize,
    /// Offset inside the source chunk.
    pub src_off: usize,
    /// Bytes.
    pub len: usize,
}

impl Scatter {
    /// A cursor at payload byte 0.
    pub fn new(region_lens: Vec<usize>) -> Self {
        Scatter {
            lens: region_lens,
            region: 0,
            offset: 0,
        }
    }

    /// The pieces of the next `n` payload bytes. Bytes past the last region
    /// are dropped (the caller checked the layout, so there are none).
    pub fn next_pieces(&mut self, n: usize, out: &mut Vec<Piece>) {
        out.clear();
        let mut src_off = 0;
        while src_off < n && self.region < self.lens.len() {
            let room = self.lens[self.region] - self.offset;
            let len = room.min(n - src_off);
            if len > 0 {
                out.push(Piece {
                    region: self.region,
                    dst_off: self.offset,
                    src_off,
                    len,
                });
            }
            src_off += len;
            self.offset += len;
            if self.offset == self.lens[self.region] {
                self.region += 1;
                self.offset = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_client::Dtype;

    fn sep(layers: u32) -> KvLayout {
        KvLayout {
            layers,
            kv_heads: 1,
            head_dim: 64,
            dtype: Dtype::U8,
            tokens_per_block: 16,
            kind: LayoutKind::LayerSeparate,
        }
    }

    #[test]
    fn layout_checks() {
        let l = sep(4);
        let lb = l.layer_bytes() as usize;
        let total = l.block_bytes();
        assert!(check_layout(&l, total, &[lb; 4]).is_ok());
        assert!(check_layout(&l, total, &[lb; 3]).is_err());
        assert!(check_layout(&l, total, &[lb, lb, lb, lb + 1]).is_err());
        assert!(check_layout(&l, total + 32, &[lb; 4]).is_err());
        let c = KvLayout::with_block_bytes(8192).unwrap();
        assert!(check_layout(&c, 8192, &[8192]).is_ok());
        assert!(check_layout(&c, 8192, &[4096, 4096]).is_err());
        assert!(check_layout(&c, 8192, &[8191]).is_err());
    }

    #[test]
    fn scatter_crosses_regions() {
        let mut s = Scatter::new(vec![3, 5, 2]);
        let mut p = Vec::new();
        s.next_pieces(4, &mut p);
        assert_eq!(
            p,
            vec![
                Piece {
                    region: 0,
                    dst_off: 0,
                    src_off: 0,
                    len: 3
                },
                Piece {
                    region: 1,
                    dst_off: 0,
                    src_off: 3,
                    len: 1
                }
            ]
        );
        s.next_pieces(6, &mut p);
        assert_eq!(
            p,
            vec![
                Piece {
                    region: 1,
                    dst_off: 1,
                    src_off: 0,
                    len: 4
                },
                Piece {
                    region: 2,
                    dst_off: 0,
                    src_off: 4,
                    len: 2
                }
            ]
        );
        s.next_pieces(1, &mut p);
        assert!(p.is_empty());
    }

    #[test]
    fn host_buf_is_aligned() {
        let mut b = HostBuf::new(5000).unwrap();
        assert_eq!(b.as_slice().as_ptr() as usize % PAGE_BYTES, 0);
        assert_eq!(b.len(), 5000);
        b.as_mut_slice()[4999] = 1;
        assert!(b.as_slice()[..4999].iter().all(|&x| x == 0));
    }
}
