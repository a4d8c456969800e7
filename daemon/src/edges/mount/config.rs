//! `[mount]`: the FUSE view's section of the config file, beside the mount
//! it configures.

use crate::base::error::{Error, Result};
use serde::Deserialize;
use std::path::PathBuf;

fn bad(key: &str, problem: impl Into<String>) -> Error {
    Error::Config {
        key: key.into(),
        problem: problem.into(),
    }
}

/// FUSE passthrough selection of `[mount]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PassthroughMode {
    /// Use it when the kernel and privileges allow; else fall back.
    Auto,
    /// Never (every read through the daemon).
    Off,
    /// Refuse to start without it.
    Required,
}

/// `[mount]`: the FUSE view of the store.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MountSection {
    /// Mount point; empty = no mount.
    pub dir: PathBuf,
    /// `allow_other`.
    pub allow_other: bool,
    /// Read-only mount.
    pub read_only: bool,
    /// Owner shown (default: the daemon's uid).
    pub uid: Option<u32>,
    /// Group shown (default: the daemon's gid).
    pub gid: Option<u32>,
    /// Octal permission bits of block files.
    pub file_mode: String,
    /// Octal permission bits of directories.
    pub dir_mode: String,
    /// Passthrough selection.
    pub passthrough: PassthroughMode,
    /// Verify each block once at open.
    pub verify_on_open: bool,
}

impl Default for MountSection {
    fn default() -> Self {
        MountSection {
            dir: PathBuf::new(),
            allow_other: false,
            read_only: false,
            uid: None,
            gid: None,
            file_mode: "0444".into(),
            dir_mode: "0755".into(),
            passthrough: PassthroughMode::Auto,
            verify_on_open: true,
        }
    }
}

fn octal_bits(key: &str, v: &str) -> Result<u16> {
    let m = u16::from_str_radix(v.trim_start_matches("0o"), 8)
        .map_err(|_| bad(key, format!("{v:?} is not an octal mode like \"0444\"")))?;
    if m > 0o777 {
        return Err(bad(key, "must be at most 0777"));
    }
    Ok(m)
}

impl MountSection {
    /// Whether a mount is configured.
    pub fn enabled(&self) -> bool {
        !self.dir.as_os_str().is_empty()
    }

    /// `file_mode` as bits.
    pub fn file_mode_bits(&self) -> Result<u16> {
        octal_bits("mount.file_mode", &self.file_mode)
    }

    /// `dir_mode` as bits.
    pub fn dir_mode_bits(&self) -> Result<u16> {
        octal_bits("mount.dir_mode", &self.dir_mode)
    }

    /// Checks every value.
    pub fn validate(&self) -> Result<()> {
        self.file_mode_bits()?;
        self.dir_mode_bits()?;
        Ok(())
    }
}
