//! What the oracle's tests share: the workspace binaries they run.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

/// The workspace's profile dir holding `kvtier` and `kvtierd`
/// (`KVTIER_BIN_DIR`, else `<repo>/target/debug`). The oracle never builds
/// them itself: a `cargo build` from here would use another lock file.
pub fn bin_dir() -> PathBuf {
    match std::env::var_os("KVTIER_BIN_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug"),
    }
}

/// Path of a workspace binary, with an actionable message when missing.
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace` at the repository root first \
         (or set KVTIER_BIN_DIR to the dir holding kvtier and kvtierd)",
        p.display()
    );
    p
}
