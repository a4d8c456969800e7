//! Onboard fall-through: GET, verify, and share one GET among concurrent
//! fetches of the same block (single-flight).
//!
//! The GET runs as its own task, so a caller that gives up at its deadline
//! does not cancel it for the others; the entry leaves the in-flight map
//! when the task ends.

use super::{lock, stats, Inner};
use crate::tier::{Block, Lookup, MissReason};
use futures::future::{BoxFuture, FutureExt, Shared};
use kvtier_client::block::HEADER_BYTES;
use kvtier_client::{BlockHeader, BlockKey, NamespaceId};
use object_store::path::Path;
use object_store::ObjectStoreExt;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

type Fetched = Result<Arc<Block>, MissReason>;
pub(crate) type InflightMap = HashMap<String, Shared<BoxFuture<'static, Fetched>>>;

pub(crate) async fn fetch(
    inner: &Arc<Inner>,
    ns: &NamespaceId,
    key: &BlockKey,
    deadline: Duration,
) -> Lookup<Block> {
    stats::inc(&inner.stats.fetch_requests);
    let loc = inner.path(ns, key);
    let shared = {
        let mut map = lock(&inner.inflight);
        match map.get(loc.as_ref()) {
            Some(f) => f.clone(),
            None if map.len() >= inner.cfg.fetch_inflight_max => {
                drop(map);
                stats::inc(&inner.stats.fetch_unavailable);
                return Lookup::Miss(MissReason::Unavailable);
            }
            None => {
                let (i2, ns2, key2, loc2) = (inner.clone(), *ns, *key, loc.clone());
                // Spawned while the map is locked: the task's own removal
                // (which takes the lock) cannot run before the insert.
                let task = inner.handle.spawn(async move {
                    let r = get_verified(&i2, &ns2, &key2, &loc2).await;
                    lock(&i2.inflight).remove(loc2.as_ref());
                    r
                });
                let f = async move { task.await.unwrap_or(Err(MissReason::Unavailable)) }
                    .boxed()
                    .shared();
                map.insert(loc.to_string(), f.clone());
                f
            }
        }
    };
    match tokio::time::timeout(deadline, shared).await {
        Ok(Ok(b)) => {
            stats::inc(&inner.stats.fetch_hits);
            // The sole waiter takes the block without copying the payload.
            Lookup::Hit(Arc::try_unwrap(b).unwrap_or_else(|a| Block::clone(&a)))
        }
        Ok(Err(r)) => {
            let c = match r {
                MissReason::Absent => &inner.stats.fetch_absent,
                MissReason::Corrupt => &inner.stats.fetch_corrupt,
                _ => &inner.stats.fetch_unavailable,
            };
            stats::inc(c);
            Lookup::Miss(r)
        }
        Err(_) => {
            stats::inc(&inner.stats.fetch_unavailable);
            Lookup::Miss(MissReason::Unavailable)
        }
    }
}

async fn get_verified(inner: &Inner, ns: &NamespaceId, key: &BlockKey, loc: &Path) -> Fetched {
    stats::inc(&inner.stats.fetch_gets);
    let got = tokio::time::timeout(inner.timeout(), async {
        inner.store.get(loc).await?.bytes().await
    })
    .await;
    let bytes = match got {
        Err(_) => return Err(MissReason::Unavailable),
        Ok(Err(object_store::Error::NotFound { .. })) => {
            inner.set_exists(loc, false);
            return Err(MissReason::Absent);
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %inner.err("get", loc, &e), "G4 fetch failed");
            return Err(MissReason::Unavailable);
        }
        Ok(Ok(b)) => b,
    };
    let checked = kvtier_client::decode_block(&bytes).and_then(|(h, p)| {
        if h.namespace_id() != *ns || h.key != *key {
            return Err(kvtier_client::Error::Format {
                fault: kvtier_client::FormatFault::Malformed,
                detail: "block stored under another namespace or key".into(),
            });
        }
        Ok((h, p.len()))
    });
    // The response buffer becomes the payload in place (no second buffer
    // to allocate and fault in): Bytes -> Vec is free when unshared.
    let checked = checked.map(|(header, len)| {
        let mut payload = Vec::from(bytes);
        payload.truncate(HEADER_BYTES + len);
        payload.drain(..HEADER_BYTES);
        Block { header, payload }
    });
    match checked {
        Ok(b) => {
            inner.set_exists(loc, true);
            Ok(Arc::new(b))
        }
        Err(e) => {
            // Create-if-absent means a corrupt object would block every
            // healthy re-upload forever: remove it so the next upload heals.
            tracing::warn!(location = %loc, error = %e, "corrupt G4 object removed");
            let _ = tokio::time::timeout(inner.timeout(), inner.store.delete(loc)).await;
            inner.set_exists(loc, false);
            Err(MissReason::Corrupt)
        }
    }
}

pub(crate) async fn fetch_header(
    inner: &Inner,
    ns: &NamespaceId,
    key: &BlockKey,
    deadline: Duration,
) -> Lookup<BlockHeader> {
    let loc = inner.path(ns, key);
    let got = tokio::time::timeout(
        deadline,
        inner.store.get_range(&loc, 0..HEADER_BYTES as u64),
    )
    .await;
    let bytes = match got {
        Err(_) => return Lookup::Miss(MissReason::Unavailable),
        Ok(Err(object_store::Error::NotFound { .. })) => return Lookup::Miss(MissReason::Absent),
        Ok(Err(_)) => return Lookup::Miss(MissReason::Unavailable),
        Ok(Ok(b)) => b,
    };
    match BlockHeader::decode(&bytes) {
        Ok(h) if h.namespace_id() == *ns && h.key == *key => Lookup::Hit(h),
        _ => Lookup::Miss(MissReason::Corrupt),
    }
}

pub(crate) async fn fetch_range(
    inner: &Inner,
    ns: &NamespaceId,
    key: &BlockKey,
    range: std::ops::Range<u64>,
    deadline: Duration,
) -> Lookup<Vec<u8>> {
    let work = async {
        let h = match fetch_header(inner, ns, key, deadline).await {
            Lookup::Hit(h) => h,
            Lookup::Miss(r) => return Lookup::Miss(r),
        };
        if range.start > range.end || range.end > h.payload_len {
            return Lookup::Miss(MissReason::Absent);
        }
        let off = HEADER_BYTES as u64;
        let loc = inner.path(ns, key);
        match inner
            .store
            .get_range(&loc, off + range.start..off + range.end)
            .await
        {
            Ok(b) if b.len() as u64 == range.end - range.start => Lookup::Hit(b.to_vec()),
            Ok(_) => Lookup::Miss(MissReason::Corrupt),
            Err(object_store::Error::NotFound { .. }) => Lookup::Miss(MissReason::Absent),
            Err(_) => Lookup::Miss(MissReason::Unavailable),
        }
    };
    tokio::time::timeout(deadline, work)
        .await
        .unwrap_or(Lookup::Miss(MissReason::Unavailable))
}
