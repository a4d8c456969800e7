//! Onboard fall-through: GET, verify, and share one GET among concurrent
//! fetches of the same block (single-flight).
//!
//! Memory: a body is read only after its declared size passed
//! `object_bytes_max` and a reservation of that many bytes from the
//! budget all fetches share (`fetch_buffer_bytes_max`); the payload is
//! hashed (the header's checksum, incrementally) as it streams and the read stops at the
//! first byte past the declared size. A hostile store therefore costs at
//! most one object per fetch and the budget in total.
//!
//! Deleting a shared object needs proof: only a complete object whose own
//! header is valid for this block and whose bytes fail that header's
//! checksum (twice, same ETag, HEAD agreeing) is removed. An object above
//! this node's `object_bytes_max`, a header this node cannot read, or a
//! size that disagrees with the header is refused here (a miss, counted)
//! and kept: another node, with another config or a newer format, may
//! read it fine.
//!
//! The GET runs as its own task, so a caller that gives up at its deadline
//! does not cancel it for the others; the entry leaves the in-flight map
//! when the task ends.

use super::{lock, stats, Inner};
use crate::base::tier::{Block, Lookup, MissReason};
use futures::future::{BoxFuture, FutureExt, Shared};
use kvtier_client::block::HEADER_BYTES;
use kvtier_client::{BlockHeader, BlockKey, NamespaceId};
use object_store::path::Path;
use object_store::{GetOptions, ObjectStoreExt};
use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::OwnedSemaphorePermit;

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
        // The caller's deadline passed with the GET still out: late, not
        // unreachable.
        Err(_) => {
            stats::inc(&inner.stats.fetch_unavailable);
            Lookup::Miss(MissReason::Timeout)
        }
    }
}

/// Body bytes a fetch holds: its share of the fetch budget and the
/// buffered-bytes gauge, both given back on drop.
pub(crate) struct Reservation<'a> {
    inner: &'a Inner,
    _permit: Option<OwnedSemaphorePermit>,
    buffered: u64,
}

impl<'a> Reservation<'a> {
    fn new(inner: &'a Inner, permit: Option<OwnedSemaphorePermit>) -> Self {
        Reservation {
            inner,
            _permit: permit,
            buffered: 0,
        }
    }

    fn add(&mut self, n: u64) {
        self.buffered += n;
        let st = &self.inner.stats;
        let now = st.fetch_buffered_bytes.fetch_add(n, Relaxed) + n;
        st.fetch_buffered_bytes_peak.fetch_max(now, Relaxed);
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let b = self.buffered;
        let _ = self
            .inner
            .stats
            .fetch_buffered_bytes
            .fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(b)));
    }
}

/// Takes `size` bytes of the shared fetch budget, waiting at most
/// `response_timeout_ms` for room; `None` when there was none.
async fn reserve(inner: &Inner, size: u64) -> Option<OwnedSemaphorePermit> {
    let pages = u32::try_from(size.div_ceil(super::BUDGET_PAGE_BYTES)).ok()?;
    let sem = inner.fetch_budget.clone();
    match tokio::time::timeout(inner.response_timeout(), sem.acquire_many_owned(pages)).await {
        Ok(Ok(p)) => Some(p),
        _ => {
            stats::inc(&inner.stats.fetch_budget_refused);
            None
        }
    }
}

/// One capped read's outcome.
enum Capped<'a> {
    /// The whole body, split after `split` bytes.
    Body {
        /// The budget and gauge share these bytes hold.
        held: Reservation<'a>,
        etag: Option<String>,
        size: u64,
        head: Vec<u8>,
        rest: Vec<u8>,
        /// The checksum of the payload (the first `payload_len` bytes of `rest`,
        /// as the header in `head` declares), computed chunk by chunk while
        /// the body streamed in; `None` unless asked for.
        payload_hash: Option<kvtier_client::PayloadSum>,
    },
    /// The object is larger than the caller accepts (nothing buffered).
    TooBig {
        size: u64,
    },
    /// The first `split` bytes failed `head_ok` (the rest was not read).
    BadHead,
    /// The shared fetch budget had no room in time (nothing buffered; says
    /// nothing about the store).
    Busy,
    Absent,
    /// No response, or no next body chunk, within its deadline
    /// (`response_timeout_ms`, `body_idle_timeout_ms`,
    /// `request_timeout_ms`): a hung or slow store. Says nothing about the
    /// object.
    Late,
    /// Refused by the breaker, failed, or a body that ended early or
    /// broke: a miss that says nothing about the object.
    Failed,
}

/// The GET's response (headers, body not read yet), or what the fetch
/// ends with and whether the store answered: absent, or failed (no
/// response in time, an error).
async fn get_response<'a>(
    inner: &'a Inner,
    loc: &Path,
    opts: GetOptions,
) -> Result<object_store::GetResult, (Capped<'a>, bool)> {
    match tokio::time::timeout(inner.response_timeout(), inner.store.get_opts(loc, opts)).await {
        Err(_) => {
            tracing::debug!(location = %loc, "G4 GET: no response in time");
            Err((Capped::Late, false))
        }
        Ok(Err(object_store::Error::NotFound { .. })) => Err((Capped::Absent, true)),
        Ok(Err(e)) => {
            tracing::warn!(error = %inner.err("get", loc, &e), "G4 fetch failed");
            Err((Capped::Failed, false))
        }
        Ok(Ok(r)) => Ok(r),
    }
}

/// GETs `loc` (with `opts`' range) and reads the body only when the
/// response's size is at most `cap` and that many bytes of the fetch
/// budget are free, chunk by chunk with an idle deadline, never past the
/// declared size: memory is bounded by `cap` per fetch and by the budget in
/// total, whatever the store sends. The first `split` bytes land in `head`,
/// the rest in `rest` (so a block's payload needs no move).
async fn get_capped<'a>(
    inner: &'a Inner,
    loc: &Path,
    opts: GetOptions,
    cap: u64,
    split: usize,
    head_ok: &(dyn Fn(&[u8], u64) -> bool + Sync),
    hash_payload: bool,
) -> Capped<'a> {
    use futures::StreamExt;
    if !inner.breaker.allow(&inner.stats) {
        return Capped::Failed;
    }
    stats::inc(&inner.stats.fetch_gets);
    let idle = Duration::from_millis(inner.cfg.body_idle_timeout_ms);
    let work = async {
        let r = match get_response(inner, loc, opts).await {
            Ok(r) => r,
            Err(answered) => return answered,
        };
        let etag = r.meta.e_tag.clone();
        let size = r.range.end.saturating_sub(r.range.start);
        if size > cap {
            // Dropping the stream closes the connection unread.
            return (Capped::TooBig { size }, true);
        }
        let Some(permit) = reserve(inner, size).await else {
            // Other fetches hold the budget: a miss, not a store failure.
            return (Capped::Busy, true);
        };
        let mut held = Reservation::new(inner, Some(permit));
        let split = split.min(size as usize);
        let mut head = Vec::with_capacity(split);
        // Capacity is only reserved: pages are touched as bytes arrive.
        let mut rest = Vec::with_capacity(size as usize - split);
        let mut stream = r.into_stream();
        // Verification overlapped with the transfer: each chunk's payload
        // bytes are hashed as they arrive (while the next ones are on the
        // wire) instead of all of them after the last one.
        let mut hasher: Option<(kvtier_client::SumHasher, usize)> = None;
        loop {
            let chunk = match tokio::time::timeout(idle, stream.next()).await {
                Err(_) => {
                    tracing::debug!(location = %loc, "G4 GET: body stalled");
                    return (Capped::Late, false);
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    tracing::debug!(location = %loc, error = %inner.scrub(&e.to_string()), "G4 GET: body broke");
                    return (Capped::Failed, false);
                }
                Ok(Some(Ok(c))) => c,
            };
            let got = (head.len() + rest.len()) as u64;
            if got + chunk.len() as u64 > size {
                // More than the response declared: a broken or lying server.
                return (Capped::Failed, false);
            }
            let h = (split - head.len()).min(chunk.len());
            head.extend_from_slice(&chunk[..h]);
            if h > 0 && head.len() == split {
                if !head_ok(&head, size) {
                    // A bad header: the rest of the body is not worth reading.
                    return (Capped::BadHead, true);
                }
                if hash_payload {
                    if let Ok(hd) = BlockHeader::decode(&head) {
                        hasher = Some((hd.payload_hasher(), hd.payload_len as usize));
                    }
                }
            }
            let from = rest.len();
            rest.extend_from_slice(&chunk[h..]);
            held.add(chunk.len() as u64);
            if let Some((hs, len)) = hasher.as_mut() {
                let to = rest.len().min(*len);
                if from < to {
                    hs.update(&rest[from..to]);
                }
            }
        }
        if ((head.len() + rest.len()) as u64) < size {
            return (Capped::Failed, false);
        }
        let payload_hash = hasher
            .filter(|(_, len)| *len <= rest.len())
            .map(|(hs, _)| hs.finish());
        (
            Capped::Body {
                held,
                etag,
                size,
                head,
                rest,
                payload_hash,
            },
            true,
        )
    };
    let (out, answered) = match tokio::time::timeout(inner.timeout(), work).await {
        Err(_) => (Capped::Late, false),
        Ok(x) => x,
    };
    inner.breaker.record(&inner.stats, answered);
    if matches!(out, Capped::Failed | Capped::Late) {
        stats::inc(&inner.stats.fetch_body_failures);
    }
    out
}

/// One full read of a block object.
enum Read<'a> {
    Good(Box<Block>, Reservation<'a>),
    /// Proven corrupt: the whole object read, its header valid for this
    /// block and its size, and the bytes failing that header's checksum.
    Corrupt {
        etag: Option<String>,
        size: u64,
        why: String,
    },
    /// Not readable by this node (above its `object_bytes_max`, a header it
    /// cannot use, a size its header does not declare): a miss here, never
    /// a reason to delete a shared object.
    Refused(String),
    Absent,
    /// The store did not answer in time (`Capped::Late`).
    Late,
    Failed,
}

async fn read_block<'a>(
    inner: &'a Inner,
    ns: &NamespaceId,
    key: &BlockKey,
    loc: &Path,
) -> Read<'a> {
    let cap = inner.cfg.object_bytes_max;
    // The header is checked as soon as it arrives: a foreign or malformed
    // header, or one that declares another size than the response, stops
    // the read before the payload is buffered.
    let head_ok = |h: &[u8], size: u64| {
        BlockHeader::decode(h)
            .is_ok_and(|h| h.namespace_id() == *ns && h.key == *key && h.file_len() == size)
    };
    let opts = GetOptions::default();
    let (held, etag, size, head, mut rest, payload_hash) =
        match get_capped(inner, loc, opts, cap, HEADER_BYTES, &head_ok, true).await {
            Capped::Absent => return Read::Absent,
            Capped::Late => return Read::Late,
            Capped::Failed | Capped::Busy => return Read::Failed,
            Capped::TooBig { size, .. } => {
                stats::inc(&inner.stats.fetch_refused_size);
                return Read::Refused(format!(
                    "object of {size} bytes, above this node's g4.object_bytes_max ({cap})"
                ));
            }
            Capped::BadHead => {
                stats::inc(&inner.stats.fetch_refused_size);
                return Read::Refused(
                    "block header this node cannot use (checksum, version, namespace, key, \
                     or a size other than the object's)"
                        .into(),
                );
            }
            Capped::Body {
                held,
                etag,
                size,
                head,
                rest,
                payload_hash,
            } => (held, etag, size, head, rest, payload_hash),
        };
    let bad = |why: String| Read::Corrupt {
        etag: etag.clone(),
        size,
        why,
    };
    // `head_ok` passed, so these hold; checked again rather than trusted.
    let header = match BlockHeader::decode(&head) {
        Ok(h) if h.namespace_id() == *ns && h.key == *key && h.file_len() == size => h,
        _ => return Read::Refused("block header this node cannot use".into()),
    };
    let len = header.payload_len as usize;
    if rest[len..].iter().any(|&b| b != 0) {
        return bad("padding bytes are not zero".into());
    }
    rest.truncate(len);
    match payload_hash {
        // Hashed while streaming, over exactly these bytes.
        Some(h) if h == header.payload_sum => {}
        Some(_) => return bad(format!("payload checksum mismatch for block {key}")),
        None => {
            if let Err(e) = header.verify_payload(&rest) {
                return bad(e.to_string());
            }
        }
    }
    Read::Good(
        Box::new(Block {
            header,
            payload: rest,
        }),
        held,
    )
}

static REFUSED_LOG: crate::base::log_limit::LogLimit =
    crate::base::log_limit::LogLimit::new(60_000);
static CORRUPT_LOG: crate::base::log_limit::LogLimit =
    crate::base::log_limit::LogLimit::new(10_000);

fn refused(loc: &Path, why: &str) -> Fetched {
    crate::warn_limited!(REFUSED_LOG, location = %loc, reason = %why,
        "G4 object refused by this node (kept: other nodes may read it)");
    Err(MissReason::Unavailable)
}

/// Reads and verifies a block. A verification failure is never acted on
/// after one read (a flaky network, proxy or disk behind the store can
/// corrupt one response): the object is read again, and it is deleted
/// (so a healthy re-upload can replace it: puts are create-if-absent)
/// only when the second read proves it corrupt too with the same ETag,
/// i.e. the same stored object is bad twice. A changed ETag, a missing
/// ETag, a second read that fails in transport, or an object this node
/// refuses (size limit, header) keeps the object.
async fn get_verified(inner: &Inner, ns: &NamespaceId, key: &BlockKey, loc: &Path) -> Fetched {
    let first = match read_block(inner, ns, key, loc).await {
        Read::Good(b, _held) => return found(inner, loc, *b),
        Read::Absent => return absent(inner, loc),
        Read::Late => return Err(MissReason::Timeout),
        Read::Failed => return Err(MissReason::Unavailable),
        Read::Refused(why) => return refused(loc, &why),
        Read::Corrupt { etag, size, why } => (etag, size, why),
    };
    stats::inc(&inner.stats.fetch_rereads);
    crate::warn_limited!(CORRUPT_LOG, location = %loc, error = %first.2,
        "G4 object failed verification; reading it again");
    match read_block(inner, ns, key, loc).await {
        Read::Good(b, _held) => found(inner, loc, *b),
        Read::Absent => absent(inner, loc),
        Read::Late => Err(MissReason::Timeout),
        Read::Failed => Err(MissReason::Unavailable),
        Read::Refused(why) => refused(loc, &why),
        Read::Corrupt { etag, size, why } => {
            // The same stored object (ETag and size) twice, and a HEAD (no
            // body to mangle) that still names it: the object is bad.
            let same = etag.is_some() && etag == first.0 && size == first.1;
            if same && head_agrees(inner, loc, etag.as_deref(), size).await {
                tracing::warn!(location = %loc, error = %why, etag = ?etag,
                    "corrupt G4 object (same ETag bad twice) removed");
                stats::inc(&inner.stats.fetch_corrupt_deleted);
                if let Ok(Ok(())) =
                    tokio::time::timeout(inner.timeout(), inner.store.delete(loc)).await
                {
                    inner.count_deleted(1, size);
                }
                inner.set_exists(loc, false);
            } else {
                // Say which proof was missing: the log was "different
                // ETags" also when the ETags matched and the HEAD disagreed.
                let kept_because = if !same {
                    "the two reads saw different objects (ETag or size)"
                } else {
                    "a HEAD did not confirm the object read"
                };
                tracing::warn!(location = %loc, error = %why, first_etag = ?first.0, etag = ?etag,
                    kept_because, "G4 object failed verification twice; kept: corruption not proven");
            }
            Err(MissReason::Corrupt)
        }
    }
}

async fn head_agrees(inner: &Inner, loc: &Path, etag: Option<&str>, size: u64) -> bool {
    if !inner.breaker.allow(&inner.stats) {
        return false;
    }
    let r = tokio::time::timeout(inner.response_timeout(), inner.store.head(loc)).await;
    inner.breaker.record(&inner.stats, matches!(r, Ok(Ok(_))));
    matches!(r, Ok(Ok(m)) if m.e_tag.as_deref() == etag && m.size == size)
}

fn found(inner: &Inner, loc: &Path, b: Block) -> Fetched {
    inner.set_exists(loc, true);
    Ok(Arc::new(b))
}

fn absent(inner: &Inner, loc: &Path) -> Fetched {
    inner.set_exists(loc, false);
    Err(MissReason::Absent)
}

pub(crate) async fn fetch_header(
    inner: &Inner,
    ns: &NamespaceId,
    key: &BlockKey,
    deadline: Duration,
) -> Lookup<BlockHeader> {
    let loc = inner.path(ns, key);
    let opts = GetOptions::default().with_range(Some(0..HEADER_BYTES as u64));
    let got = tokio::time::timeout(
        deadline,
        get_capped(
            inner,
            &loc,
            opts,
            HEADER_BYTES as u64,
            0,
            &|_, _| true,
            false,
        ),
    )
    .await;
    let bytes = match got {
        Err(_) | Ok(Capped::Late) => return Lookup::Miss(MissReason::Timeout),
        Ok(Capped::Failed | Capped::Busy) => return Lookup::Miss(MissReason::Unavailable),
        Ok(Capped::Absent) => return Lookup::Miss(MissReason::Absent),
        Ok(Capped::TooBig { .. } | Capped::BadHead) => return Lookup::Miss(MissReason::Corrupt),
        Ok(Capped::Body { rest, .. }) => rest,
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
        let want = range.end - range.start;
        let opts = GetOptions::default().with_range(Some(off + range.start..off + range.end));
        match get_capped(inner, &loc, opts, want, 0, &|_, _| true, false).await {
            Capped::Body { rest, .. } if rest.len() as u64 == want => Lookup::Hit(rest),
            Capped::Body { .. } | Capped::TooBig { .. } | Capped::BadHead => {
                Lookup::Miss(MissReason::Corrupt)
            }
            Capped::Absent => Lookup::Miss(MissReason::Absent),
            Capped::Late => Lookup::Miss(MissReason::Timeout),
            Capped::Failed | Capped::Busy => Lookup::Miss(MissReason::Unavailable),
        }
    };
    tokio::time::timeout(deadline, work)
        .await
        .unwrap_or(Lookup::Miss(MissReason::Timeout))
}
