//! Block files the daemon passed by fd for a direct read
//! ([`NsHandle::open_direct`]): the caller reads and verifies them itself.

use super::*;

/// Block files the daemon opened for this client ([`NsHandle::open_direct`]):
/// per key a [`DirectBlock`] or why it missed. Hand it back to
/// [`NsHandle::finish_direct`] when the bytes are read.
#[derive(Debug)]
pub struct DirectBlocks {
    pub(super) files: Vec<std::fs::File>,
    /// Per key, in request order.
    pub items: Vec<std::result::Result<DirectBlock, Miss>>,
    pub(super) leases: Vec<u64>,
    /// Keys whose header failed here (reported by `finish_direct`).
    pub(super) corrupt: Vec<BlockKey>,
}

impl DirectBlocks {
    /// The open block file `b` is in.
    pub fn file(&self, b: &DirectBlock) -> &std::fs::File {
        &self.files[b.file]
    }
}

/// One block of a direct read: its header (checked against the request and
/// the reply, its payload not yet verified) and where its payload is.
#[derive(Debug, Clone)]
pub struct DirectBlock {
    pub(super) file: usize,
    /// Offset of the payload in the file (4096-aligned for G3 files).
    pub payload_offset: u64,
    /// The block's header: `payload_len` and `payload_sum` to verify.
    pub header: BlockHeader,
    /// Where the daemon found it.
    pub tier: Tier,
}

impl DirectBlock {
    /// The hit this block is once its payload is verified.
    pub fn hit(&self) -> Onboarded {
        Onboarded::Hit {
            tier: self.tier,
            payload_len: self.header.payload_len,
        }
    }
}
