//! [`G3Store`] as a [`BlockTier`]: the interface every tier implements,
//! over the write, read and removal paths.

use super::engine::AlignedBuf;
use super::{lock_err, G3Store, PutMeta};
use crate::base::error::{Error, Result};
use crate::base::tier::{Block, BlockTier, Lookup, MissReason, PutOutcome};
use kvtier_client::block::HEADER_BYTES;
use kvtier_client::{BlockHeader, BlockKey, NamespaceId};
use std::sync::atomic::Ordering;

impl BlockTier for G3Store {
    fn name(&self) -> &'static str {
        "g3"
    }

    fn put(&self, ns: &NamespaceId, header: &BlockHeader, payload: &[u8]) -> Result<PutOutcome> {
        self.put_block(ns, header, payload, PutMeta::default())
    }

    fn get(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Lookup<Block>> {
        let len = {
            let mem = self.mem.read().map_err(|_| lock_err("g3 index"))?;
            mem.get(ns, key).map(|(_, e)| e.file_len())
        };
        let Some(len) = len else {
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
            return Ok(Lookup::Miss(MissReason::Absent));
        };
        let mut buf = AlignedBuf::rounded(len as usize)
            .map_err(|e| Error::io("allocating", "read buffer", e))?;
        Ok(match self.read_into(ns, key, buf.as_mut_slice())? {
            Lookup::Hit(header) => {
                let end = HEADER_BYTES + header.payload_len as usize;
                let payload = buf.as_slice()[HEADER_BYTES..end].to_vec();
                Lookup::Hit(Block { header, payload })
            }
            Lookup::Miss(r) => Lookup::Miss(r),
        })
    }

    fn contains(&self, ns: &NamespaceId, key: &BlockKey) -> Result<bool> {
        Ok(self
            .mem
            .read()
            .map_err(|_| lock_err("g3 index"))?
            .get(ns, key)
            .is_some())
    }

    fn delete(&self, ns: &NamespaceId, key: &BlockKey) -> Result<bool> {
        self.delete_block(ns, key)
    }
}
