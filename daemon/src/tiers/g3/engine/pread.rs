//! The plain engine: one pread/pwrite at a time per operation. The fallback
//! where io_uring is refused, and the comparison point for it.

use super::{
    fdatasync, pread_full, pwrite_full, AlignedBuf, FillFn, IoEngine, ReadyFn, CHUNK_BYTES,
};
use std::io;
use std::os::fd::RawFd;

/// pread/pwrite engine (stateless).
#[derive(Debug, Default)]
pub struct PreadEngine;

impl IoEngine for PreadEngine {
    fn name(&self) -> &'static str {
        "pread"
    }

    fn write_file(
        &self,
        fd: RawFd,
        at: u64,
        len: u64,
        bufs: &mut [AlignedBuf],
        fill: FillFn<'_>,
    ) -> io::Result<()> {
        let Some(buf) = bufs.first_mut() else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "no buffer"));
        };
        let chunk = buf.len() as u64;
        let mut off = 0u64;
        while off < len {
            let n = chunk.min(len - off) as usize;
            let b = &mut buf.as_mut_slice()[..n];
            fill(off, b);
            pwrite_full(fd, b, at + off)?;
            off += n as u64;
        }
        Ok(())
    }

    fn read_file(
        &self,
        fd: RawFd,
        at: u64,
        dst: &mut [u8],
        on_ready: ReadyFn<'_>,
    ) -> io::Result<usize> {
        let mut off = 0usize;
        while off < dst.len() {
            let n = CHUNK_BYTES.min(dst.len() - off);
            let got = pread_full(fd, &mut dst[off..off + n], at + off as u64)?;
            on_ready(&dst[off..off + got]);
            off += got;
            if got < n {
                break;
            }
        }
        Ok(off)
    }

    fn sync_data(&self, fd: RawFd) -> io::Result<()> {
        fdatasync(fd)
    }
}
