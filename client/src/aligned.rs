//! Page-aligned heap buffers: what O_DIRECT reads and writes need, and what
//! the GPU crate uses as host memory. The one place this workspace
//! allocates aligned memory by hand.

use std::alloc::Layout;
use std::io;
use std::ptr::NonNull;

/// Alignment of every buffer (the page and O_DIRECT sector size).
pub const ALIGN_BYTES: usize = 4096;

/// A zeroed, [`ALIGN_BYTES`]-aligned heap buffer. The allocation is rounded
/// up to whole pages (at least one); [`len`](Self::len) is what was asked
/// for, or the rounded size with [`AlignedBuf::rounded`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is uniquely owned heap memory.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` zeroed bytes, aligned.
    pub fn new(len: usize) -> io::Result<Self> {
        let layout = Self::layout(len)?;
        // SAFETY: the layout has a non-zero size (at least one page).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("allocating {} aligned bytes failed", layout.size()),
            )
        })?;
        Ok(Self { ptr, len })
    }

    /// `len` rounded up to whole pages (at least one), zeroed, aligned: the
    /// shape O_DIRECT transfers need.
    pub fn rounded(len: usize) -> io::Result<Self> {
        Self::new(len.div_ceil(ALIGN_BYTES).max(1) * ALIGN_BYTES)
    }

    fn layout(len: usize) -> io::Result<Layout> {
        let cap = len.div_ceil(ALIGN_BYTES).max(1) * ALIGN_BYTES;
        Layout::from_size_align(cap, ALIGN_BYTES)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{len} bytes: {e}")))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: valid for `len` bytes (the allocation is at least that)
        // for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above; &mut self makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Ok(layout) = Self::layout(self.len) {
            // SAFETY: allocated with this layout in `new`.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_sized() {
        let mut b = AlignedBuf::new(5000).unwrap();
        assert_eq!(b.len(), 5000);
        assert_eq!(b.as_slice().as_ptr() as usize % ALIGN_BYTES, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[4999] = 7;
        assert_eq!(b.as_slice()[4999], 7);
        let r = AlignedBuf::rounded(5000).unwrap();
        assert_eq!(r.len(), 8192);
        assert_eq!(AlignedBuf::rounded(0).unwrap().len(), ALIGN_BYTES);
        let z = AlignedBuf::new(0).unwrap();
        assert!(z.is_empty());
    }
}
