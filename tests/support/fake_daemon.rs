//! The daemon side of a connection's hello, for tests that play kvtierd
//! in process on a real socket (the client against a fake daemon).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use kvtier_client::proto::{self, Request, Response};
use kvtier_client::proto::{ItemStatus, OnboardResult};
use kvtier_client::shm::Region;
use kvtier_client::{BlockHeader, BlockKey, KvLayout, Namespace, Tier};
use std::os::fd::OwnedFd;

/// The block size of the fake daemons' namespace.
pub const BLOCK: usize = 8192;

/// The namespace the fake daemons serve (8 KiB blocks).
pub fn ns() -> Namespace {
    Namespace::new(
        "m",
        KvLayout::with_block_bytes(BLOCK as u64).unwrap(),
        "",
        "",
    )
    .unwrap()
}

/// A key made with `BlockKey::from_u64`, back as its number.
pub fn key_u64(k: &BlockKey) -> u64 {
    u64::from_be_bytes(k.as_bytes()[..8].try_into().unwrap())
}

/// Answers the client's hello on `fd`; the shared region it passed (None
/// when the client went away first).
pub fn hello(fd: i32, fds: &mut Vec<OwnedFd>) -> Option<Region> {
    let body = proto::recv_frame(fd, fds).ok()?;
    let (id, Request::Hello { shm_bytes, .. }) = Request::decode(&body).unwrap() else {
        panic!("no hello")
    };
    let region = Region::adopt(fds.pop().unwrap(), shm_bytes).unwrap();
    let hello = Response::Hello {
        version: 1,
        session_id: 1,
        keys_max: 4096,
        lease_ttl_max_ms: 1000,
    };
    proto::send_frame(fd, &hello.encode(proto::OP_HELLO, id), &[]).unwrap();
    Some(region)
}

/// An shm onboard item's answer for the block of header `h`.
pub fn onboard_result(status: ItemStatus, tier: Tier, h: &BlockHeader) -> OnboardResult {
    OnboardResult {
        status,
        tier,
        lease_id: 0,
        payload_len: h.payload_len,
        payload_sum: h.payload_sum,
        fd_index: u32::MAX,
        file_offset: 0,
    }
}
