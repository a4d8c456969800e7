//! Onboard and offload by key against kvtierd, through this crate's
//! pipeline: what the Python client's CUDA path calls (and any engine that
//! holds device pointers).
//!
//! Onboard: the daemon opens the block files and passes their fds
//! ([`NsHandle::open_direct`], each block leased meanwhile); the files go
//! to [`Transfer::onboard_batch`] as one batch: overlapped io_uring reads,
//! the payload checksum streamed over the chunks as they land, asynchronous
//! host-to-device copies on one stream per bounce buffer, or GDS straight
//! into HBM where present (then verified by a device-to-host pass unless
//! turned off). Every byte is verified against the header's checksum before
//! the block is a hit; a block that fails is a `Corrupt` miss and is
//! reported to the daemon, which re-verifies, quarantines and repairs it.
//!
//! Offload: [`Gather`] copies each block's regions into one staging buffer
//! (pinned when any region is device memory) with asynchronous
//! device-to-host copies spread over [`GATHER_STREAMS`] streams and one
//! wait per group, then the client offloads the group (it hashes the bytes
//! for the header it writes; the daemon hashes its own copy and refuses a
//! mismatch).

use crate::error::{Error, Result};
use crate::memory::{DeviceSpan, HostBuf};
use crate::transfer::{OnboardJob, Outcome, Transfer, BATCH_BLOCKS_MAX};
use crate::Destination;
use kvtier_client::proto::FDS_MAX;
use kvtier_client::{BlockKey, Hints, Miss, MissCause, NsHandle, OffloadOutcome, Onboarded};

/// CUDA streams a gather spreads its device-to-host copies over.
pub const GATHER_STREAMS: usize = 4;

/// Most bytes one gather stages (larger offloads go in groups of this
/// size; a single larger block is staged alone).
pub const GATHER_BYTES_MAX: usize = 256 << 20;

/// One region of a block to offload, in payload order.
#[derive(Debug, Clone, Copy)]
pub enum SrcRegion<'a> {
    /// Host memory.
    Host(&'a [u8]),
    /// Device memory of the transfer's GPU.
    Device(DeviceSpan),
}

impl SrcRegion<'_> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            SrcRegion::Host(b) => b.len(),
            SrcRegion::Device(s) => s.len,
        }
    }

    /// True for an empty region.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What onboarding one key gave, and how the bytes moved (hits only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyedOnboard {
    /// Hit (verified bytes in the destination) or miss, as the client says it.
    pub result: Onboarded,
    /// The route and fallback of a hit.
    pub outcome: Option<Outcome>,
}

fn miss(cause: MissCause, detail: impl Into<String>) -> Miss {
    Miss {
        cause,
        detail: detail.into(),
    }
}

/// A transfer failure as the miss the caller sees.
fn miss_of(e: &Error) -> Miss {
    let cause = match e {
        _ if e.is_integrity() => MissCause::Corrupt,
        Error::Layout { .. } => MissCause::TooLarge,
        _ => MissCause::Storage,
    };
    miss(cause, e.to_string())
}

/// Onboards `keys[i]` into `dsts[i]` through `t`'s pipeline (see the module
/// docs). Never fails as a whole: each key gets its result, and a miss's
/// destination content is unspecified. Run it inside the client's
/// [`kvtier_client::Client::within_deadline`] for one deadline per call.
pub fn onboard_keys(
    t: &mut Transfer,
    h: &NsHandle<'_>,
    keys: &[BlockKey],
    dsts: &mut [Destination<'_>],
) -> Vec<KeyedOnboard> {
    let layout = h.namespace().layout;
    let n = keys.len().min(dsts.len());
    let mut out = Vec::with_capacity(keys.len());
    let per = FDS_MAX.min(BATCH_BLOCKS_MAX);
    let mut i = 0;
    while i < n {
        let end = (i + per).min(n);
        let caps: Vec<usize> = dsts[i..end]
            .iter()
            .map(|d| d.region_lens().iter().sum())
            .collect();
        let d = h.open_direct(&keys[i..end], &caps);
        let mut res: Vec<KeyedOnboard> = d
            .items
            .iter()
            .map(|it| KeyedOnboard {
                result: match it {
                    Err(m) => Onboarded::Miss(m.clone()),
                    Ok(_) => Onboarded::Miss(miss(MissCause::Storage, "not transferred")),
                },
                outcome: None,
            })
            .collect();
        let mut corrupt = Vec::new();
        {
            let mut idx = Vec::new();
            let mut jobs = Vec::new();
            for (j, (it, dst)) in d.items.iter().zip(dsts[i..end].iter_mut()).enumerate() {
                if let Ok(b) = it {
                    jobs.push(OnboardJob {
                        file: d.file(b),
                        payload_offset: b.payload_offset,
                        payload_len: b.header.payload_len,
                        expected_sum: b.header.payload_sum,
                        dst,
                        layout: &layout,
                    });
                    idx.push(j);
                }
            }
            match t.onboard_batch(&mut jobs) {
                Ok(rs) => {
                    for (r, &j) in rs.into_iter().zip(&idx) {
                        let Ok(b) = &d.items[j] else { continue };
                        res[j] = match r {
                            Ok(o) => KeyedOnboard {
                                result: b.hit(),
                                outcome: Some(o),
                            },
                            Err(e) => {
                                if e.is_integrity() {
                                    corrupt.push(keys[i + j]);
                                }
                                KeyedOnboard {
                                    result: Onboarded::Miss(miss_of(&e)),
                                    outcome: None,
                                }
                            }
                        };
                    }
                }
                // The machinery failed (io_uring, CUDA): no destination of
                // the batch is trusted.
                Err(e) => {
                    for &j in &idx {
                        res[j].result = Onboarded::Miss(miss(MissCause::Storage, e.to_string()));
                    }
                }
            }
        }
        h.finish_direct(d, &corrupt);
        out.extend(res);
        i = end;
    }
    for _ in n..keys.len() {
        out.push(KeyedOnboard {
            result: Onboarded::Miss(miss(MissCause::TooLarge, "no buffer given for this key")),
            outcome: None,
        });
    }
    out
}

/// Offloads a chain (block i's parent is block i-1, `parent` for the
/// first) whose block i lies in the regions `srcs[i]`, gathered by `g` in
/// groups of at most [`GATHER_BYTES_MAX`]. Never fails as a whole.
pub fn offload_keys(
    g: &mut Gather,
    h: &NsHandle<'_>,
    parent: Option<BlockKey>,
    keys: &[BlockKey],
    srcs: &[Vec<SrcRegion<'_>>],
    hints: Hints,
) -> Vec<OffloadOutcome> {
    let bb = h.namespace().layout.block_bytes() as usize;
    let per = (GATHER_BYTES_MAX / bb.max(1)).max(1);
    let n = keys.len().min(srcs.len());
    let mut out = Vec::with_capacity(keys.len());
    let mut p = parent;
    for (ks, ss) in keys[..n].chunks(per).zip(srcs[..n].chunks(per)) {
        match g.run(ss, bb) {
            Ok(flat) => {
                let payloads: Vec<&[u8]> = flat.chunks(bb.max(1)).collect();
                out.extend(h.offload_chain(p, ks, &payloads, hints));
            }
            Err(e) => out.extend(ks.iter().map(|_| OffloadOutcome::Failed(miss_of(&e)))),
        }
        p = ks.last().copied();
    }
    for _ in n..keys.len() {
        out.push(OffloadOutcome::Failed(miss(
            MissCause::TooLarge,
            "no buffer given for this key",
        )));
    }
    out
}

/// The staging memory of a [`Gather`].
enum Staging {
    Host(HostBuf),
    #[cfg(feature = "cuda")]
    Pinned(crate::cuda::PinnedBuf),
}

impl Staging {
    fn len(&self) -> usize {
        match self {
            Staging::Host(b) => b.len(),
            #[cfg(feature = "cuda")]
            Staging::Pinned(b) => b.len(),
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Staging::Host(b) => b.as_mut_slice(),
            #[cfg(feature = "cuda")]
            Staging::Pinned(b) => b.as_mut_slice(),
        }
    }
}

/// Gathers blocks from host or device regions into one contiguous staging
/// buffer, grown on demand and kept (pinned allocation costs
/// milliseconds): device regions by asynchronous copies over
/// [`GATHER_STREAMS`] streams, host regions by memcpy meanwhile, one wait
/// for all.
pub struct Gather {
    staging: Option<Staging>,
    #[cfg(feature = "cuda")]
    gpu: Option<std::sync::Arc<crate::cuda::Gpu>>,
    #[cfg(feature = "cuda")]
    streams: Vec<crate::cuda::Stream>,
}

impl std::fmt::Debug for Gather {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gather")
            .field("staging_bytes", &self.staging.as_ref().map(Staging::len))
            .finish_non_exhaustive()
    }
}

impl Gather {
    /// A gather on `t`'s GPU (host memory only when `t` has none).
    #[allow(unused_variables)]
    pub fn new(t: &Transfer) -> Self {
        Gather {
            staging: None,
            #[cfg(feature = "cuda")]
            gpu: t.gpu().cloned(),
            #[cfg(feature = "cuda")]
            streams: Vec::new(),
        }
    }

    /// Gathers `blocks` (block i's regions in payload order, `block_bytes`
    /// in all) into the staging buffer, block i at `i * block_bytes`, and
    /// returns those bytes.
    pub fn run(&mut self, blocks: &[Vec<SrcRegion<'_>>], block_bytes: usize) -> Result<&[u8]> {
        let len = block_bytes
            .checked_mul(blocks.len())
            .filter(|&l| l <= GATHER_BYTES_MAX.max(block_bytes))
            .ok_or_else(|| Error::Config {
                field: "gather",
                reason: format!(
                    "{} blocks of {block_bytes} bytes exceed {GATHER_BYTES_MAX} bytes",
                    blocks.len()
                ),
            })?;
        if let Some((i, total)) = blocks
            .iter()
            .map(|b| b.iter().map(SrcRegion::len).sum::<usize>())
            .enumerate()
            .find(|&(_, t)| t != block_bytes)
        {
            return Err(Error::Layout {
                what: "segments length",
                detail: format!("block {i}: segments of {total} bytes, a block is {block_bytes}"),
            });
        }
        let device = blocks
            .iter()
            .flatten()
            .any(|r| matches!(r, SrcRegion::Device(_)));
        self.stage(len.max(1), device)?;
        let Some(st) = self.staging.as_mut() else {
            return Err(Error::Config {
                field: "gather",
                reason: "no staging buffer".into(),
            });
        };
        let buf = &mut st.as_mut_slice()[..len];
        #[cfg(feature = "cuda")]
        let streams = &self.streams;
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut queued = 0usize;
        let mut r: Result<()> = Ok(());
        'blocks: for (i, regions) in blocks.iter().enumerate() {
            let mut off = i * block_bytes;
            for reg in regions {
                let part = &mut buf[off..off + reg.len()];
                match reg {
                    SrcRegion::Host(b) => part.copy_from_slice(b),
                    #[cfg(feature = "cuda")]
                    SrcRegion::Device(s) => {
                        // SAFETY: `part` is pinned staging memory that is
                        // not touched until every stream is synchronised
                        // below; the span is the caller's, valid for the call.
                        let q = unsafe { streams[queued % streams.len()].dtoh_async(part, s.ptr) };
                        if let Err(e) = q {
                            r = Err(e);
                            break 'blocks;
                        }
                        queued += 1;
                    }
                    #[cfg(not(feature = "cuda"))]
                    SrcRegion::Device(_) => {
                        r = Err(Error::NoCuda {
                            reason: "built without the `cuda` feature".into(),
                        });
                        break 'blocks;
                    }
                }
                off += reg.len();
            }
        }
        // Never hand the bytes out (or return) while a copy may still land.
        #[cfg(feature = "cuda")]
        if queued > 0 {
            for s in streams {
                let synced = s.sync();
                if r.is_ok() {
                    r = synced;
                }
            }
        }
        let _ = queued;
        r?;
        Ok(buf)
    }

    /// Makes the staging buffer at least `len` bytes, pinned when `device`.
    fn stage(&mut self, len: usize, device: bool) -> Result<()> {
        #[cfg(feature = "cuda")]
        if device {
            let gpu = self.gpu.clone().ok_or_else(|| Error::NoCuda {
                reason: "a device region was given but no GPU is open".into(),
            })?;
            gpu.bind()?;
            while self.streams.len() < GATHER_STREAMS {
                self.streams.push(crate::cuda::Stream::new()?);
            }
            if !matches!(&self.staging, Some(Staging::Pinned(b)) if b.len() >= len) {
                self.staging = None;
                self.staging = Some(Staging::Pinned(crate::cuda::PinnedBuf::new(&gpu, len)?));
            }
            return Ok(());
        }
        if device {
            return Err(Error::NoCuda {
                reason: "built without the `cuda` feature".into(),
            });
        }
        if self.staging.as_ref().is_none_or(|s| s.len() < len) {
            self.staging = None;
            self.staging = Some(Staging::Host(HostBuf::new(len)?));
        }
        Ok(())
    }
}
