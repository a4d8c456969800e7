//! An in-memory [`KvNamespace`]: the reference implementation behind the
//! unit and mount tests.
//!
//! Blocks live in memory. With a spill directory, each block is also
//! written to `<spill>/<ns>/<hh>/<key>` (the G3 layout) and `open` hands
//! out that file, so FUSE passthrough is exercised exactly as it will be
//! over G3; without one, `open` returns a read callback (the fallback).
//! Eviction unlinks the spilled file; open handles keep their bytes.

use crate::error::{Error, Result};
use crate::namespace::{
    now_unix_ms, BlockReader, BlockStat, EventLog, KvNamespace, OpenBlock, StagedBlock,
};
use kvtier_client::{decode_block, BlockKey, NamespaceId, Tier};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// Events kept by the in-memory namespace's log.
const EVENT_LINES_MAX: usize = 10_000;

#[derive(Debug, Clone)]
struct Entry {
    file: Arc<Vec<u8>>,
    stat: BlockStat,
    spilled: Option<PathBuf>,
}

/// The in-memory namespace.
#[derive(Debug)]
pub struct MemNamespace {
    blocks: Mutex<BTreeMap<(NamespaceId, u8, BlockKey), Entry>>,
    spill_dir: Option<PathBuf>,
    events: EventLog,
}

struct VecReader(Arc<Vec<u8>>);

impl BlockReader for VecReader {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize> {
        let len = self.0.len() as u64;
        if offset >= len {
            return Ok(0);
        }
        let n = ((len - offset) as usize).min(buf.len());
        buf[..n].copy_from_slice(&self.0[offset as usize..offset as usize + n]);
        Ok(n)
    }
}

impl MemNamespace {
    /// A namespace whose blocks also spill into files under `spill_dir`
    /// (`None`: memory only, reads go through the read callback).
    pub fn new(spill_dir: Option<&Path>) -> Self {
        MemNamespace {
            blocks: Mutex::new(BTreeMap::new()),
            spill_dir: spill_dir.map(Path::to_path_buf),
            events: EventLog::new(EVENT_LINES_MAX),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<(NamespaceId, u8, BlockKey), Entry>> {
        // Every mutation of the map completes under the lock; a panic
        // elsewhere cannot leave it half-updated.
        self.blocks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores a whole block file after full validation; [`Error::Exists`]
    /// if its key is already present.
    pub fn insert_file(&self, file: Vec<u8>) -> Result<()> {
        let (header, _) = decode_block(&file).map_err(|source| Error::InvalidBlock { source })?;
        let ns = header.namespace_id();
        let key = header.key;
        let id = (ns, key.as_bytes()[0], key);
        let mut map = self.lock();
        if map.contains_key(&id) {
            return Err(Error::Exists { ns, key });
        }
        let spilled = match &self.spill_dir {
            Some(dir) => Some(spill(dir, &ns, &key, &file)?),
            None => None,
        };
        let stat = BlockStat {
            size_bytes: file.len() as u64,
            stored_unix_ms: now_unix_ms(),
            tier: Tier::G3,
            payload_sum: header.payload_sum,
            hits: 0,
            last_access_unix_ms: 0,
            pinned: false,
            priority: 0,
        };
        map.insert(
            id,
            Entry {
                file: Arc::new(file),
                stat,
                spilled,
            },
        );
        drop(map);
        self.events.record("stored", &ns, &key, "tier=g3");
        Ok(())
    }

    /// Whether the block is held.
    pub fn contains(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        self.lock().contains_key(&(*ns, key.as_bytes()[0], *key))
    }

    /// The stored block file, if held.
    pub fn get(&self, ns: &NamespaceId, key: &BlockKey) -> Option<Arc<Vec<u8>>> {
        self.lock()
            .get(&(*ns, key.as_bytes()[0], *key))
            .map(|e| Arc::clone(&e.file))
    }

    /// Number of blocks held.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }
}

/// Writes `<dir>/<ns>/<hh>/<key>` atomically (temp name, then rename).
fn spill(dir: &Path, ns: &NamespaceId, key: &BlockKey, bytes: &[u8]) -> Result<PathBuf> {
    let path = dir.join(kvtier_client::block_path(ns, key));
    let parent = path.parent().unwrap_or(dir);
    std::fs::create_dir_all(parent).map_err(|e| Error::io("creating spill dir", parent, e))?;
    let tmp = parent.join(format!(".{}.tmp", key.to_hex()));
    std::fs::write(&tmp, bytes).map_err(|e| Error::io("spilling block", &tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| Error::io("publishing spilled block", &path, e))?;
    Ok(path)
}

impl KvNamespace for MemNamespace {
    fn namespaces(&self) -> Result<Vec<NamespaceId>> {
        let map = self.lock();
        let mut out: Vec<NamespaceId> = Vec::new();
        for (ns, _, _) in map.keys() {
            if out.last() != Some(ns) {
                out.push(*ns);
            }
        }
        Ok(out)
    }

    fn list_blocks(
        &self,
        ns: &NamespaceId,
        shard: u8,
        after: Option<&BlockKey>,
        limit: usize,
    ) -> Result<Vec<BlockKey>> {
        use std::ops::Bound;
        let map = self.lock();
        let lo = match after {
            Some(k) => Bound::Excluded((*ns, shard, *k)),
            None => Bound::Included((*ns, shard, min_key(shard))),
        };
        Ok(map
            .range((lo, Bound::Unbounded))
            .take_while(|((n, s, _), _)| n == ns && *s == shard)
            .take(limit)
            .map(|((_, _, k), _)| *k)
            .collect())
    }

    fn stat(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Option<BlockStat>> {
        Ok(self
            .lock()
            .get(&(*ns, key.as_bytes()[0], *key))
            .map(|e| e.stat.clone()))
    }

    fn open(&self, ns: &NamespaceId, key: &BlockKey) -> Result<OpenBlock> {
        let entry = {
            let mut map = self.lock();
            let e = map
                .get_mut(&(*ns, key.as_bytes()[0], *key))
                .ok_or_else(|| Error::block_not_found(ns, key))?;
            e.stat.hits += 1;
            e.stat.last_access_unix_ms = now_unix_ms();
            e.clone()
        };
        let len_bytes = entry.file.len() as u64;
        match &entry.spilled {
            Some(path) => {
                let file = std::fs::File::open(path)
                    .map_err(|e| Error::io("opening spilled block", path, e))?;
                Ok(OpenBlock::File {
                    file,
                    offset_bytes: 0,
                    len_bytes,
                })
            }
            None => Ok(OpenBlock::Reader {
                reader: Arc::new(VecReader(entry.file)),
                len_bytes,
            }),
        }
    }

    fn import(&self, ns: &NamespaceId, block: StagedBlock) -> Result<()> {
        debug_assert_eq!(block.header().namespace_id(), *ns);
        let bytes = block.read_all()?;
        self.insert_file(bytes)
    }

    fn remove(&self, ns: &NamespaceId, key: &BlockKey) -> Result<()> {
        let entry = self
            .lock()
            .remove(&(*ns, key.as_bytes()[0], *key))
            .ok_or_else(|| Error::block_not_found(ns, key))?;
        if let Some(path) = &entry.spilled {
            std::fs::remove_file(path)
                .map_err(|e| Error::io("unlinking spilled block", path, e))?;
        }
        self.events.record("removed", ns, key, "tier=g3");
        Ok(())
    }

    fn set_pinned(&self, ns: &NamespaceId, key: &BlockKey, pinned: bool) -> Result<()> {
        {
            let mut map = self.lock();
            let e = map
                .get_mut(&(*ns, key.as_bytes()[0], *key))
                .ok_or_else(|| Error::block_not_found(ns, key))?;
            e.stat.pinned = pinned;
        }
        self.events
            .record(if pinned { "pinned" } else { "unpinned" }, ns, key, "");
        Ok(())
    }

    fn stats_text(&self) -> String {
        let map = self.lock();
        let bytes: u64 = map.values().map(|e| e.stat.size_bytes).sum();
        let pinned = map.values().filter(|e| e.stat.pinned).count();
        format!(
            "store memory\nblocks {}\nbytes {}\npinned_blocks {}\nnamespaces {}\n",
            map.len(),
            bytes,
            pinned,
            {
                let mut n = 0;
                let mut last = None;
                for (ns, _, _) in map.keys() {
                    if last != Some(ns) {
                        n += 1;
                        last = Some(ns);
                    }
                }
                n
            }
        )
    }

    fn event_log(&self) -> &EventLog {
        &self.events
    }
}

/// The smallest key in `shard` under `BlockKey`'s order (length first).
fn min_key(shard: u8) -> BlockKey {
    // A one-byte key sorts before every longer key with the same first byte.
    BlockKey::from_bytes(&[shard]).unwrap_or_else(|_| BlockKey::from_u64(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_client::{encode_block, BlockHeader, KvLayout, Namespace};

    pub(crate) fn block(ns: &Namespace, key: BlockKey, fill: u8) -> Vec<u8> {
        let payload: Vec<u8> = (0..ns.layout.block_bytes())
            .map(|i| fill ^ i as u8)
            .collect();
        encode_block(&BlockHeader::for_payload(ns, key, &payload, 1), &payload)
    }

    fn ns() -> Namespace {
        Namespace::new(
            "m",
            KvLayout::with_block_bytes(64).unwrap(),
            "",
            b"t".to_vec(),
        )
        .unwrap()
    }

    #[test]
    fn list_is_paged_per_shard_and_ordered() {
        let m = MemNamespace::new(None);
        let n = ns();
        for i in 0..10u8 {
            m.insert_file(block(&n, BlockKey::from_bytes(&[0xab, i]).unwrap(), i))
                .unwrap();
        }
        m.insert_file(block(&n, BlockKey::from_bytes(&[0xac, 0]).unwrap(), 0))
            .unwrap();
        m.insert_file(block(&n, BlockKey::from_bytes(&[0xab]).unwrap(), 0))
            .unwrap();
        let id = n.id();
        let mut all = Vec::new();
        let mut after = None;
        loop {
            let page = m.list_blocks(&id, 0xab, after.as_ref(), 3).unwrap();
            if page.is_empty() {
                break;
            }
            assert!(page.len() <= 3);
            after = page.last().copied();
            all.extend(page);
        }
        assert_eq!(all.len(), 11);
        assert_eq!(all[0].to_hex(), "ab");
        assert!(all.iter().all(|k| k.as_bytes()[0] == 0xab));
        assert_eq!(m.namespaces().unwrap(), vec![id]);
    }

    #[test]
    fn create_once_and_evict() {
        let dir = tempfile::tempdir().unwrap();
        let m = MemNamespace::new(Some(dir.path()));
        let n = ns();
        let key = BlockKey::from_bytes(&[1, 2, 3]).unwrap();
        let b = block(&n, key, 7);
        m.insert_file(b.clone()).unwrap();
        assert!(matches!(
            m.insert_file(b.clone()),
            Err(Error::Exists { .. })
        ));
        let path = dir.path().join(kvtier_client::block_path(&n.id(), &key));
        assert_eq!(std::fs::read(&path).unwrap(), b);
        let OpenBlock::File { file, .. } = m.open(&n.id(), &key).unwrap() else {
            panic!("spilled block must open as a file")
        };
        m.remove(&n.id(), &key).unwrap();
        assert!(!path.exists());
        let mut buf = vec![0u8; b.len()];
        use std::os::unix::fs::FileExt;
        file.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(buf, b, "an open handle keeps its bytes after eviction");
        assert!(matches!(
            m.remove(&n.id(), &key),
            Err(Error::NotFound { .. })
        ));
        let ev = m.event_log().read_at(0, 4096);
        let ev = String::from_utf8(ev).unwrap();
        assert!(ev.contains(" stored ") && ev.contains(" removed "), "{ev}");
    }
}
