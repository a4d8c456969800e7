//! What the peer server streams from.
//!
//! The G3 store implements [`PeerSource`]; the server never builds a path
//! itself, so a hostile URL cannot reach the filesystem except through a
//! parsed `(NamespaceId, BlockKey)` pair.

use crate::base::error::{Error, Result};
use kvtier_client::{block_path, BlockKey, NamespaceId};
use std::fs::File;
use std::path::PathBuf;

/// A store whose block files the peer server may send to other nodes.
///
/// Contract: `open_block` returns the complete block file (4096-byte header,
/// payload, zero padding; the `kvtier_client::block` format) and its length,
/// or `None` when the block is not held. The file must stay readable while
/// the server streams it (an unlinked-but-open file is fine: blocks are
/// immutable). The server does not verify the payload before sending: the
/// receiver does. A store that knows a block is corrupt should return `None`.
pub trait PeerSource: Send + Sync + 'static {
    /// Opens the block file, or `None` when absent.
    fn open_block(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Option<(File, u64)>>;

    /// A digest of every block held, at most `bytes_max` encoded bytes, or
    /// `None` when this source does not publish one (peers then probe).
    /// Called off the async workers; may take a while on a large store.
    fn holdings(&self, bytes_max: u64) -> Result<Option<super::holdings::HoldingsDigest>> {
        let _ = bytes_max;
        Ok(None)
    }
}

/// A [`PeerSource`] over a directory laid out as `<root>/<block_path>`; for
/// tests and benchmarks.
#[derive(Debug, Clone)]
pub struct DirSource {
    root: PathBuf,
}

impl DirSource {
    /// Serves block files under `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        DirSource { root: root.into() }
    }

    /// Where the block file for `(ns, key)` lives.
    pub fn path_of(&self, ns: &NamespaceId, key: &BlockKey) -> PathBuf {
        self.root.join(block_path(ns, key))
    }

    /// Writes a whole block file (test helper; not atomic).
    pub fn write_block(&self, ns: &NamespaceId, key: &BlockKey, file: &[u8]) -> Result<PathBuf> {
        let path = self.path_of(ns, key);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| Error::io("creating", dir, e))?;
        }
        std::fs::write(&path, file).map_err(|e| Error::io("writing", &path, e))?;
        Ok(path)
    }
}

impl PeerSource for DirSource {
    fn open_block(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Option<(File, u64)>> {
        let path = self.path_of(ns, key);
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io("opening", &path, e)),
        };
        let meta = file.metadata().map_err(|e| Error::io("stat", &path, e))?;
        if !meta.is_file() {
            return Ok(None);
        }
        Ok(Some((file, meta.len())))
    }
}
