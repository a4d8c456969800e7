//! Fixtures shared by the host-pipeline and GPU tests: block files on a
//! real filesystem, O_DIRECT opens, and the guard-region constants.
#![allow(dead_code)]

use kvtier_client::{encode_block, BlockHeader, BlockKey, KvLayout, Namespace};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Bytes of canary before, between and after destination regions.
pub const GUARD_BYTES: usize = 4096;
/// The guard regions' fill: any other byte there means an overrun.
pub const CANARY: u8 = 0xA5;

/// A deterministic payload, different per seed.
pub fn payload(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[3] ^ seed)
        .collect()
}

/// Writes a block file; returns its path, the header and the payload.
pub fn write_block(dir: &Path, layout: KvLayout, seed: u8) -> (PathBuf, BlockHeader, Vec<u8>) {
    let ns = Namespace::new("m", layout, "", b"t".to_vec()).unwrap();
    let p = payload(layout.block_bytes() as usize, seed);
    let h = BlockHeader::for_payload(&ns, BlockKey::from_digest([seed; 32]), &p, 1);
    let path = dir.join(format!("block-{seed}"));
    std::fs::write(&path, encode_block(&h, &p)).unwrap();
    (path, h, p)
}

/// Opens with O_DIRECT where the filesystem allows it (as the daemon does).
pub fn open_direct(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .or_else(|_| File::open(path))
        .unwrap()
}

/// A temp dir on a real filesystem (O_DIRECT and GDS need one):
/// `KVTIER_TEST_TMPDIR` when set (device-check.sh runs prebuilt binaries
/// on another machine), else cargo's target tmp dir.
pub fn tmp() -> tempfile::TempDir {
    let base = std::env::var_os("KVTIER_TEST_TMPDIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_TARGET_TMPDIR").into());
    std::fs::create_dir_all(&base).unwrap();
    tempfile::tempdir_in(base).unwrap()
}
