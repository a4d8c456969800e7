//! The shared-memory pool: block buffers an engine allocates from kvtier,
//! inside the client's sealed shared region, so that offload and onboard of
//! blocks there send only offsets: the client copies no payload bytes and
//! none cross the socket.
//!
//! Layout: the region is `[staging | pool]`. The staging part (the
//! configured `region_bytes`) serves the ordinary copy-in/copy-out calls;
//! the pool follows it. A block in the pool sits in a slot of
//! [`Pool::slot_bytes`]: a 4096-byte header page, then the payload (the
//! block file's own layout), so the daemon reads and writes it exactly as it
//! does a staged block. The region outlives connections: every reconnect
//! hands the daemon the same memfd, so pool offsets stay valid.
//!
//! Integrity is unchanged: the client hashes the payload where it lies for
//! the header it writes; the daemon hashes its own copy while storing it and
//! refuses a mismatch; an onboarded payload is verified in the pool, where
//! the engine will read it.

use super::{missed, now_ms, poisoned, slot_bytes, unexpected, Client, Miss, MissCause, NsHandle};
use super::{Landing, OffloadOutcome, Onboarded};
use crate::block::{BlockHeader, HEADER_BYTES};
use crate::error::{Error, Result};
use crate::key::BlockKey;
use crate::proto::{OffloadItem, Request, Response, KEYS_MAX};
use crate::shm::Region;
use crate::types::Hints;
use std::sync::Arc;

/// A pool of block slots in a client's shared region (see the module docs).
#[derive(Debug, Clone)]
pub struct Pool {
    region: Arc<Region>,
    base: u64,
    len: u64,
}

/// One block of a pool offload.
#[derive(Debug, Clone, Copy)]
pub struct PoolBlock {
    /// Its key.
    pub key: BlockKey,
    /// The previous block of its chain.
    pub parent: Option<BlockKey>,
    /// Offset of its slot in the pool (a multiple of 4096; the payload
    /// starts 4096 bytes later).
    pub slot_offset: u64,
    /// Hints.
    pub hints: Hints,
}

impl Pool {
    /// Bytes of one slot for blocks of `block_bytes`: a header page and the
    /// payload padded to 4096.
    pub fn slot_bytes(block_bytes: u64) -> u64 {
        slot_bytes(block_bytes)
    }

    /// Pool bytes.
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> u64 {
        self.len
    }

    /// The pool's bytes, `[off, off + len)` of the pool. The daemon writes
    /// onboarded slots and reads offloaded ones; the engine coordinates by
    /// not touching a slot while a call on it runs.
    #[allow(clippy::mut_from_ref)]
    pub fn slice_mut(&self, off: u64, len: usize) -> Option<&mut [u8]> {
        if off.checked_add(len as u64)? > self.len {
            return None;
        }
        self.region.slice_mut(self.base + off, len)
    }

    /// Start of the pool in this process (for engines that register it,
    /// e.g. with cudaHostRegister).
    pub fn as_ptr(&self) -> *mut u8 {
        self.region
            .slice_mut(self.base, 0)
            .map(|s| s.as_mut_ptr())
            .unwrap_or(std::ptr::null_mut())
    }

    /// Refuses a region other than the pool's own (a pool of another
    /// client, or of this one before a re-made region).
    pub(super) fn check_region(&self, r: &Region) -> Result<()> {
        if std::ptr::eq(Arc::as_ptr(&self.region), r as *const Region) {
            Ok(())
        } else {
            Err(Error::Protocol {
                reason: "the pool is not this client's".into(),
            })
        }
    }

    fn payload_range(&self, slot_offset: u64, block_bytes: u64) -> Option<u64> {
        if !slot_offset.is_multiple_of(4096)
            || slot_offset.checked_add(slot_bytes(block_bytes))? > self.len
        {
            return None;
        }
        Some(self.base + slot_offset)
    }
}

impl Client {
    /// Allocates the pool: this client's region becomes `[staging | pool]`
    /// with `pool_bytes` (rounded up to 4096) of pool, and the connection
    /// is re-made with it now, so that a daemon refusing the size (its
    /// `server.region_bytes_max`, counted per client) is reported here.
    /// One pool per client.
    pub fn alloc_pool(&self, pool_bytes: u64) -> Result<Pool> {
        let invalid = |reason: String| Error::Pool { reason };
        if pool_bytes == 0 {
            return Err(invalid("a pool needs at least one byte".into()));
        }
        let mut g = self.persistent_region.lock().map_err(|_| poisoned())?;
        if g.is_some() {
            return Err(invalid("this client already has a pool".into()));
        }
        let base = self.cfg.region_bytes.div_ceil(4096) * 4096;
        let len = pool_bytes.div_ceil(4096) * 4096;
        let total = base
            .checked_add(len)
            .ok_or_else(|| invalid(format!("{pool_bytes} bytes do not fit in memory")))?;
        let region = Arc::new(Region::create(total).map_err(|e| {
            invalid(format!(
                "the client's region (region_bytes {base} + the pool {len}) cannot be \
                 created: {e}"
            ))
        })?);
        *g = Some(region.clone());
        drop(g);
        // Reconnect with the new region now.
        if let Ok(mut c) = self.conn.lock() {
            *c = None;
        }
        if let Ok(mut lf) = self.last_failure.lock() {
            *lf = None;
        }
        if let Err(e) = self.ensure_connected() {
            if let Ok(mut g) = self.persistent_region.lock() {
                *g = None;
            }
            return Err(e);
        }
        Ok(Pool { region, base, len })
    }
}

impl NsHandle<'_> {
    /// Offloads blocks that lie in `pool` (each at its slot's payload):
    /// the client writes each slot's header page and sends offsets; no
    /// payload byte is copied or sent. Never fails as a whole.
    pub fn offload_pool(&self, pool: &Pool, blocks: &[PoolBlock]) -> Vec<OffloadOutcome> {
        let bb = self.ns.layout.block_bytes();
        let mut out = Vec::with_capacity(blocks.len());
        for batch in blocks.chunks(KEYS_MAX) {
            let mut bad = vec![None; batch.len()];
            let r = self.client.call(
                |region| {
                    let region = region.ok_or_else(poisoned)?;
                    pool.check_region(region)?;
                    let created = now_ms();
                    let mut items = Vec::with_capacity(batch.len());
                    for (j, b) in batch.iter().enumerate() {
                        let Some(at) = pool.payload_range(b.slot_offset, bb) else {
                            bad[j] = Some(Miss::new(MissCause::TooLarge, "slot outside the pool"));
                            continue;
                        };
                        let Some(payload) = region.slice(at + HEADER_BYTES as u64, bb as usize)
                        else {
                            bad[j] =
                                Some(Miss::new(MissCause::TooLarge, "slot outside the region"));
                            continue;
                        };
                        // A slot never written still needs its pages to be
                        // this process's before the daemon reads it.
                        region.populate(at, HEADER_BYTES + bb as usize);
                        let h = BlockHeader::for_payload(&self.ns, b.key, payload, created);
                        let mut hb = [0u8; HEADER_BYTES];
                        h.encode_into(&mut hb);
                        region.write(at, &hb);
                        items.push(OffloadItem {
                            shm_offset: at,
                            parent: b.parent,
                            hints: b.hints,
                        });
                    }
                    Ok(Request::Offload { ns: self.id, items })
                },
                |_, r, _| match r {
                    Response::Items { status } => Ok(status),
                    other => Err(unexpected(other)),
                },
            );
            match r {
                Ok(status) => {
                    let mut st = status.into_iter();
                    for b in bad {
                        out.push(match b {
                            Some(m) => OffloadOutcome::Failed(m),
                            None => match st.next() {
                                Some(s) => OffloadOutcome::from_status(s),
                                None => OffloadOutcome::Failed(Miss::new(
                                    MissCause::Refused,
                                    "offload reply length",
                                )),
                            },
                        });
                    }
                }
                Err(e) => {
                    let m = Miss::from_error(&e);
                    out.extend(batch.iter().map(|_| OffloadOutcome::Failed(m.clone())));
                }
            }
        }
        out
    }

    /// Onboards `keys[i]` into the pool slot at `slot_offsets[i]`: the
    /// daemon writes the block there and the client verifies the payload in
    /// place. Never fails as a whole.
    pub fn onboard_pool(
        &self,
        pool: &Pool,
        keys: &[BlockKey],
        slot_offsets: &[u64],
    ) -> Vec<Onboarded> {
        let bb = self.ns.layout.block_bytes();
        let slot = slot_bytes(bb);
        let n = keys.len().min(slot_offsets.len());
        let mut out = Vec::with_capacity(keys.len());
        for (ks, offs) in keys[..n]
            .chunks(KEYS_MAX)
            .zip(slot_offsets[..n].chunks(KEYS_MAX))
        {
            // Slots outside the pool are misses here; the rest go in one
            // request, in order.
            let at: Vec<Option<u64>> = offs.iter().map(|&o| pool.payload_range(o, bb)).collect();
            let (good, good_at): (Vec<BlockKey>, Vec<u64>) = ks
                .iter()
                .zip(&at)
                .filter_map(|(k, a)| a.map(|a| (*k, a)))
                .unzip();
            let got = if good.is_empty() {
                Vec::new()
            } else {
                self.onboard_shm_at(&good, &good_at, slot, Landing::Pool(pool))
                    .unwrap_or_else(|e| missed(&e, good.len()))
            };
            let mut got = got.into_iter();
            for a in &at {
                out.push(match a {
                    // One result per good slot (onboard_shm_at's promise).
                    Some(_) => got.next().unwrap_or_else(|| {
                        Onboarded::Miss(Miss::new(MissCause::Refused, "onboard reply length"))
                    }),
                    None => {
                        Onboarded::Miss(Miss::new(MissCause::TooLarge, "slot outside the pool"))
                    }
                });
            }
        }
        for _ in n..keys.len() {
            out.push(Onboarded::Miss(Miss::new(
                MissCause::TooLarge,
                "no slot given for this key",
            )));
        }
        out
    }
}
