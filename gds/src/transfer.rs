//! The executor: carries out a [`Plan`] for one block, verifying the
//! payload's checksum on the way.
//!
//! Bounce path (TwoHop, HostRead): `buffers` aligned bounce buffers of
//! `chunk_bytes` each; io_uring keeps one O_DIRECT read in flight per free
//! buffer; chunks are hashed in file order as they complete, then scattered
//! into the destination regions (host copies, or asynchronous host-to-device
//! copies on one CUDA stream per buffer). A buffer is reused only after its
//! stream finished, so disk reads, hashing and PCIe copies overlap.
//!
//! Direct path (GDS): cuFile reads each region straight into HBM, then the
//! bytes that landed are copied back through a bounce buffer and hashed.
//! That costs a device-to-host pass, but it checks what the engine will
//! actually use; `verify_direct = false` skips it and leaves only the
//! filesystem and the header's own checksum between disk and HBM, so it is
//! off by default. Any Direct failure (cuFile error, short read, checksum)
//! falls back to the bounce path, which verifies again; the reason is
//! logged and returned in [`Outcome::fallback`].
//!
//! On any error the destination bytes are untrusted: the caller turns it
//! into a miss and must not hand the memory to the engine as this block.

use crate::caps::Capabilities;
use crate::error::{Error, Result};
use crate::memory::{check_layout, Destination, HostBuf, Piece, Region, Scatter, PAGE_BYTES};
use crate::plan::{plan, Plan, Route, Source};
use kvtier_client::block::PAYLOAD_BYTES_MAX;
use kvtier_client::{KvLayout, PayloadSum, SumHasher};
use std::fs::File;
use std::os::fd::AsRawFd;

/// Largest bounce buffer accepted.
pub const CHUNK_BYTES_MAX: usize = 64 << 20;
/// Most bounce buffers (and reads in flight) accepted.
pub const BUFFERS_MAX: usize = 64;

/// Bounce buffers beyond the reads in flight: the chunks being hashed and
/// copied sit in these, so the disk queue stays `buffers` deep meanwhile.
pub const SPARE_BUFFERS: usize = 2;

/// Most lanes (pipeline threads) accepted.
pub const LANES_MAX: usize = 16;

/// Most blocks in one [`Transfer::onboard_batch`] call.
pub const BATCH_BLOCKS_MAX: usize = 4096;

/// One block of a batch: the block file, where its payload is, its
/// expected checksum, and where it goes (see [`Transfer::onboard`]).
#[derive(Debug)]
pub struct OnboardJob<'a, 'd> {
    /// The open block file.
    pub file: &'a File,
    /// Payload offset in the file (4096-aligned).
    pub payload_offset: u64,
    /// Payload length from the header.
    pub payload_len: u64,
    /// The payload's checksum, from the header.
    pub expected_sum: PayloadSum,
    /// Destination regions.
    pub dst: &'a mut Destination<'d>,
    /// How the payload is cut across the regions.
    pub layout: &'a KvLayout,
}

/// Tuning of the pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferConfig {
    /// Bytes per bounce buffer (a multiple of 4096).
    pub chunk_bytes: usize,
    /// O_DIRECT reads in flight; [`SPARE_BUFFERS`] more bounce buffers
    /// (and streams) are allocated.
    pub buffers: usize,
    /// Use GPUDirect Storage when the capabilities allow.
    pub prefer_direct: bool,
    /// Hash a host copy of the bytes a Direct read put in HBM.
    pub verify_direct: bool,
    /// Parallel bounce pipelines (threads) a batch is split across; each
    /// hashes on its own core.
    pub lanes: usize,
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            chunk_bytes: 1 << 20,
            buffers: 4,
            prefer_direct: true,
            verify_direct: true,
            lanes: 1,
        }
    }
}

impl TransferConfig {
    fn validate(&self) -> Result<()> {
        if self.chunk_bytes == 0
            || !self.chunk_bytes.is_multiple_of(PAGE_BYTES)
            || self.chunk_bytes > CHUNK_BYTES_MAX
        {
            return Err(Error::Config {
                field: "chunk_bytes",
                reason: format!(
                    "{} is not a multiple of {PAGE_BYTES} in 1..={CHUNK_BYTES_MAX}",
                    self.chunk_bytes
                ),
            });
        }
        if self.buffers == 0 || self.buffers > BUFFERS_MAX {
            return Err(Error::Config {
                field: "buffers",
                reason: format!("{} is not in 1..={BUFFERS_MAX}", self.buffers),
            });
        }
        if self.lanes == 0 || self.lanes > LANES_MAX {
            return Err(Error::Config {
                field: "lanes",
                reason: format!("{} is not in 1..={LANES_MAX}", self.lanes),
            });
        }
        Ok(())
    }
}

/// What a successful transfer did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The route the planner chose.
    pub planned: Route,
    /// The route that delivered the bytes.
    pub route: Route,
    /// Payload bytes delivered (and verified).
    pub bytes: u64,
    /// Why the planned route was abandoned, if it was.
    pub fallback: Option<String>,
}

/// Moves verified block bytes into host, pinned or device memory. Owns its
/// lanes (bounce buffers, io_uring, streams); one call at a time per value
/// (`&mut self`); a batch spreads over `lanes` threads.
pub struct Transfer {
    caps: Capabilities,
    cfg: TransferConfig,
    lanes: Vec<Lane>,
    #[cfg(feature = "cuda")]
    gpu: Option<std::sync::Arc<crate::cuda::Gpu>>,
}

/// One bounce pipeline: its ring, buffers and streams. A batch is split
/// across lanes, each on its own thread, so hashing (one core per lane)
/// scales with the lanes.
struct Lane {
    ring: io_uring::IoUring,
    host_bufs: Vec<HostBuf>,
    #[cfg(feature = "cuda")]
    pinned_bufs: Vec<crate::cuda::PinnedBuf>,
    #[cfg(feature = "cuda")]
    streams: Vec<crate::cuda::Stream>,
}

impl Lane {
    fn new(cfg: &TransferConfig) -> Result<Self> {
        let ring = io_uring::IoUring::new((cfg.buffers + SPARE_BUFFERS).next_power_of_two() as u32)
            .map_err(|e| Error::io("io_uring setup", e))?;
        let host_bufs = (0..cfg.buffers + SPARE_BUFFERS)
            .map(|_| HostBuf::new(cfg.chunk_bytes))
            .collect::<Result<Vec<_>>>()?;
        Ok(Lane {
            ring,
            host_bufs,
            #[cfg(feature = "cuda")]
            pinned_bufs: Vec::new(),
            #[cfg(feature = "cuda")]
            streams: Vec::new(),
        })
    }
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("caps", &self.caps)
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    chunk: Option<usize>,
    want: usize,
    filled: usize,
    ready: bool,
    copying: bool,
}

impl Transfer {
    /// A transfer for these capabilities. With CUDA present it opens GPU 0;
    /// if that fails it logs why and runs host-only.
    pub fn new(caps: Capabilities, cfg: TransferConfig) -> Result<Self> {
        Self::on_gpu(caps, cfg, 0)
    }

    /// As [`Self::new`], on GPU `ordinal` (device pointers of that GPU's
    /// primary context, as a `cuda:N` tensor's are).
    pub fn on_gpu(caps: Capabilities, cfg: TransferConfig, ordinal: u32) -> Result<Self> {
        cfg.validate()?;
        #[cfg(not(feature = "cuda"))]
        let _ = ordinal;
        let lanes = (0..cfg.lanes)
            .map(|_| Lane::new(&cfg))
            .collect::<Result<Vec<_>>>()?;
        #[allow(unused_mut)]
        let mut t = Transfer {
            caps,
            cfg,
            lanes,
            #[cfg(feature = "cuda")]
            gpu: None,
        };
        #[cfg(feature = "cuda")]
        if t.caps.has_cuda() {
            match crate::cuda::Gpu::open(ordinal) {
                Ok(g) => t.gpu = Some(g),
                Err(e) => {
                    tracing::warn!(error = %e, ordinal, "CUDA probed present but the GPU did not open; running host-only");
                    t.caps = Capabilities::host_only(format!("GPU {ordinal} did not open: {e}"));
                }
            }
        }
        Ok(t)
    }

    /// A transfer without any GPU: host memory stands in for HBM.
    pub fn host_only(cfg: TransferConfig) -> Result<Self> {
        Self::new(Capabilities::host_only("host-only mode"), cfg)
    }

    /// A transfer that takes `caps` as given, without opening any GPU.
    /// For fallback tests: with CUDA or GDS claimed but no GPU open, a
    /// planned Direct read fails at run time exactly as a broken cuFile
    /// would, and the transfer must fall back to the bounce path.
    #[doc(hidden)]
    pub fn with_assumed_caps(caps: Capabilities, cfg: TransferConfig) -> Result<Self> {
        let mut t = Self::host_only(cfg)?;
        t.caps = caps;
        Ok(t)
    }

    /// The capabilities in force.
    pub fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    /// The configuration.
    pub fn config(&self) -> &TransferConfig {
        &self.cfg
    }

    /// The GPU, when one is open.
    #[cfg(feature = "cuda")]
    pub fn gpu(&self) -> Option<&std::sync::Arc<crate::cuda::Gpu>> {
        self.gpu.as_ref()
    }

    /// The plan this transfer would follow for `source` into `dst`.
    pub fn plan_for(&self, source: Source, dst: &Destination<'_>) -> Plan {
        plan(source, dst.kind(), &self.caps, self.cfg.prefer_direct)
    }

    fn has_gpu(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.gpu.is_some()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    fn check(&self, payload_len: u64, dst: &Destination<'_>, layout: &KvLayout) -> Result<()> {
        if payload_len > PAYLOAD_BYTES_MAX {
            return Err(Error::Layout {
                what: "payload length",
                detail: format!("{payload_len} bytes exceeds {PAYLOAD_BYTES_MAX}"),
            });
        }
        if dst.is_segments() {
            let total: usize = dst.region_lens().iter().sum();
            if total as u64 != payload_len {
                return Err(Error::Layout {
                    what: "segments length",
                    detail: format!("segments of {total} bytes for a {payload_len}-byte block"),
                });
            }
        } else {
            check_layout(layout, payload_len, &dst.region_lens())?;
        }
        if dst.has_device_regions() && !self.has_gpu() {
            return Err(Error::NoCuda {
                reason: format!("destination is device memory but {}", self.caps.describe()),
            });
        }
        Ok(())
    }

    /// Onboards one block from a G3 block file into `dst`.
    ///
    /// `file` is the open block file (O_DIRECT for cold reads; the daemon
    /// passes it as an fd), `payload_offset` is where the payload starts
    /// ([`kvtier_client::block::HEADER_BYTES`], 4096-aligned), `payload_len`
    /// and `expected_sum` come from the block header, and `layout` says
    /// how the payload is cut across `dst`'s regions.
    ///
    /// On `Err`, and in particular on an integrity error
    /// ([`Error::is_integrity`]), the destination bytes must not be used.
    pub fn onboard(
        &mut self,
        file: &File,
        payload_offset: u64,
        payload_len: u64,
        expected_sum: &PayloadSum,
        dst: &mut Destination<'_>,
        layout: &KvLayout,
    ) -> Result<Outcome> {
        let mut jobs = [OnboardJob {
            file,
            payload_offset,
            payload_len,
            expected_sum: *expected_sum,
            dst,
            layout,
        }];
        self.onboard_batch(&mut jobs)?.pop().unwrap_or_else(|| {
            Err(Error::Config {
                field: "jobs",
                reason: "empty result".into(),
            })
        })
    }

    /// Onboards several blocks (a prefix, say) in one pipeline, so the
    /// reads of the next block overlap the hashing and copying of the
    /// previous one. Each block gets its own result: a corrupt block is a
    /// miss for that block only, and its destination is untrusted. The
    /// outer `Err` is for failures of the machinery itself (io_uring, CUDA),
    /// after which no destination of the batch is trusted.
    pub fn onboard_batch(
        &mut self,
        jobs: &mut [OnboardJob<'_, '_>],
    ) -> Result<Vec<Result<Outcome>>> {
        if jobs.len() > BATCH_BLOCKS_MAX {
            return Err(Error::Config {
                field: "jobs",
                reason: format!(
                    "{} blocks in one batch, at most {BATCH_BLOCKS_MAX}",
                    jobs.len()
                ),
            });
        }
        let mut results: Vec<Option<Result<Outcome>>> = (0..jobs.len()).map(|_| None).collect();
        let mut planned = vec![Route::HostRead; jobs.len()];
        let mut fallback: Vec<Option<String>> = vec![None; jobs.len()];
        let mut bounce_idx = Vec::with_capacity(jobs.len());
        for (i, j) in jobs.iter_mut().enumerate() {
            if !j.payload_offset.is_multiple_of(PAGE_BYTES as u64) {
                results[i] = Some(Err(Error::Unaligned {
                    what: "payload_offset",
                    value: j.payload_offset,
                    align: PAGE_BYTES as u64,
                }));
                continue;
            }
            if let Err(e) = self.check(j.payload_len, j.dst, j.layout) {
                results[i] = Some(Err(e));
                continue;
            }
            let p = self.plan_for(Source::G3File, j.dst);
            tracing::debug!(route = p.route.name(), reason = p.reason, "onboard plan");
            planned[i] = p.route;
            if p.route == Route::Direct {
                match self.direct(
                    j.file,
                    j.payload_offset,
                    j.payload_len,
                    &j.expected_sum,
                    j.dst,
                ) {
                    Ok(()) => {
                        results[i] = Some(Ok(Outcome {
                            planned: Route::Direct,
                            route: Route::Direct,
                            bytes: j.payload_len,
                            fallback: None,
                        }));
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "GPUDirect read failed; falling back to the bounce path");
                        fallback[i] = Some(e.to_string());
                    }
                }
            }
            bounce_idx.push(i);
        }
        let mut is_bounce = vec![false; jobs.len()];
        for &i in &bounce_idx {
            is_bounce[i] = true;
        }
        let mut refs: Vec<&mut OnboardJob<'_, '_>> = jobs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| is_bounce[*i])
            .map(|(_, j)| j)
            .collect();
        let bounced = self.bounce(&mut refs)?;
        drop(refs);
        for (&i, r) in bounce_idx.iter().zip(bounced) {
            let route = if jobs[i].dst.kind() == crate::MemoryKind::Device {
                Route::TwoHop
            } else {
                Route::HostRead
            };
            results[i] = Some(r.map(|()| Outcome {
                planned: planned[i],
                route,
                bytes: jobs[i].payload_len,
                fallback: fallback[i].take(),
            }));
        }
        Ok(results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(Error::Config {
                        field: "jobs",
                        reason: "block was not processed".into(),
                    })
                })
            })
            .collect())
    }

    /// Copies a block already in host memory into `dst`, after checking
    /// `src` against `expected_sum` (nothing is written on a mismatch).
    pub fn copy_from_host(
        &mut self,
        src: &[u8],
        expected_sum: &PayloadSum,
        dst: &mut Destination<'_>,
        layout: &KvLayout,
    ) -> Result<Outcome> {
        self.check(src.len() as u64, dst, layout)?;
        let mut h = expected_sum.hasher();
        h.update(src);
        verify(&h, expected_sum)?;
        let planned = self.plan_for(Source::HostBuffer, dst);
        let mut scatter = Scatter::new(dst.region_lens());
        let mut pieces = Vec::new();
        scatter.next_pieces(src.len(), &mut pieces);
        for p in &pieces {
            let data = &src[p.src_off..p.src_off + p.len];
            match &mut dst.regions_mut()[p.region] {
                Region::Host(b) => b[p.dst_off..p.dst_off + p.len].copy_from_slice(data),
                Region::Device(_s) => {
                    #[cfg(feature = "cuda")]
                    {
                        let s = *_s;
                        if let Some(g) = &self.gpu {
                            g.bind()?;
                        }
                        crate::cuda::copy_htod(s.ptr + p.dst_off as u64, data)?;
                    }
                }
            }
        }
        Ok(Outcome {
            planned: planned.route,
            route: planned.route,
            bytes: src.len() as u64,
            fallback: None,
        })
    }

    #[cfg(not(feature = "cuda"))]
    fn direct(
        &mut self,
        _file: &File,
        _off: u64,
        _len: u64,
        _expected: &PayloadSum,
        _dst: &mut Destination<'_>,
    ) -> Result<()> {
        Err(Error::NoCuda {
            reason: "built without the `cuda` feature".into(),
        })
    }

    #[cfg(feature = "cuda")]
    fn direct(
        &mut self,
        file: &File,
        off: u64,
        len: u64,
        expected: &PayloadSum,
        dst: &mut Destination<'_>,
    ) -> Result<()> {
        let gpu = self.gpu.clone().ok_or_else(|| Error::NoCuda {
            reason: self.caps.describe(),
        })?;
        let spans = dst
            .regions()
            .iter()
            .map(|r| match r {
                Region::Device(s) => Ok(*s),
                Region::Host(_) => Err(Error::Gds {
                    op: "plan",
                    detail: "GPUDirect Storage needs device memory; the destination is host memory"
                        .into(),
                }),
            })
            .collect::<Result<Vec<_>>>()?;
        gpu.bind()?;
        let gf = crate::cuda::GdsFile::register(file)?;
        let mut file_off = off;
        for s in &spans {
            // SAFETY: spans come from DeviceBufs borrowed by `dst` or from
            // `Destination::device_raw`, whose caller vouched for them.
            let n = unsafe { gf.read(s.ptr, s.len, file_off)? };
            if n < s.len {
                return Err(Error::Truncated {
                    offset: file_off,
                    wanted_bytes: s.len as u64,
                    got_bytes: n as u64,
                });
            }
            file_off += s.len as u64;
        }
        drop(gf);
        if !self.cfg.verify_direct {
            return Ok(());
        }
        let mut h = expected.hasher();
        let buf = self.lanes[0].host_bufs[0].as_mut_slice();
        for s in &spans {
            let mut done = 0;
            while done < s.len {
                let n = (s.len - done).min(buf.len());
                crate::cuda::copy_dtoh(s.ptr + done as u64, &mut buf[..n])?;
                h.update(&buf[..n]);
                done += n;
            }
        }
        debug_assert_eq!(file_off - off, len);
        verify(&h, expected)
    }

    /// The bounce pipeline (TwoHop and HostRead) over `jobs`, split across
    /// the lanes in contiguous runs. One result per job, in order.
    fn bounce(&mut self, jobs: &mut [&mut OnboardJob<'_, '_>]) -> Result<Vec<Result<()>>> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let cfg = self.cfg;
        let ctx = LaneCtx {
            cfg: &cfg,
            caps: &self.caps,
            #[cfg(feature = "cuda")]
            gpu: self.gpu.as_ref(),
        };
        let per = jobs.len().div_ceil(self.lanes.len());
        if per >= jobs.len() {
            return bounce_lane(&mut self.lanes[0], &ctx, jobs);
        }
        let outs = std::thread::scope(|sc| {
            let handles: Vec<_> = self
                .lanes
                .iter_mut()
                .zip(jobs.chunks_mut(per))
                .map(|(lane, part)| {
                    let ctx = &ctx;
                    sc.spawn(move || bounce_lane(lane, ctx, part))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::Config {
                            field: "lanes",
                            reason: "a transfer lane panicked".into(),
                        })
                    })
                })
                .collect::<Vec<_>>()
        });
        let mut all = Vec::with_capacity(jobs.len());
        for o in outs {
            all.extend(o?);
        }
        Ok(all)
    }
}

/// What a lane needs from its transfer.
struct LaneCtx<'t> {
    cfg: &'t TransferConfig,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    caps: &'t Capabilities,
    #[cfg(feature = "cuda")]
    gpu: Option<&'t std::sync::Arc<crate::cuda::Gpu>>,
}

/// Runs the bounce pipeline for `jobs` on one lane.
fn bounce_lane(
    lane: &mut Lane,
    ctx: &LaneCtx<'_>,
    jobs: &mut [&mut OnboardJob<'_, '_>],
) -> Result<Vec<Result<()>>> {
    let mut states = Vec::with_capacity(jobs.len());
    let mut chunks = Vec::new();
    let mut device = false;
    for (si, j) in jobs.iter().enumerate() {
        device |= j.dst.has_device_regions();
        let padded = j.payload_len.div_ceil(PAGE_BYTES as u64) * PAGE_BYTES as u64;
        let mut st = JobState {
            job: si,
            fd: j.file.as_raw_fd(),
            off: j.payload_offset,
            len: j.payload_len,
            hasher: j.expected_sum.hasher(),
            scatter: Scatter::new(j.dst.region_lens()),
            err: None,
        };
        match j.file.metadata() {
            Err(e) => st.err = Some(Error::io("fstat block file", e)),
            Ok(m) if m.len() < j.payload_offset + padded => {
                st.err = Some(Error::Truncated {
                    offset: j.payload_offset,
                    wanted_bytes: padded,
                    got_bytes: m.len().saturating_sub(j.payload_offset),
                })
            }
            Ok(_) => {
                let n = padded.div_ceil(ctx.cfg.chunk_bytes as u64) as usize;
                chunks.extend((0..n).map(|k| (si, k)));
            }
        }
        states.push(st);
    }
    let bufs = lane_ptrs(lane, ctx, device)?;
    let mut inflight = 0usize;
    let mut p = Pump {
        chunk: ctx.cfg.chunk_bytes,
        bufs: &bufs,
        slots: vec![Slot::default(); bufs.len()],
        depth: ctx.cfg.buffers,
        chunks: &chunks,
        states,
        pieces: Vec::new(),
        #[cfg(feature = "cuda")]
        streams: &lane.streams,
    };
    let r = p.run(&mut lane.ring, &mut inflight, jobs);
    // Never return while the kernel or the GPU may still touch a bounce
    // buffer: drain reads, then wait for every copy.
    let drained = drain(&mut lane.ring, &mut inflight);
    #[cfg(feature = "cuda")]
    let synced = if device {
        lane.streams.iter().try_for_each(|s| s.sync())
    } else {
        Ok(())
    };
    #[cfg(not(feature = "cuda"))]
    let synced: Result<()> = Ok(());
    r?;
    drained?;
    synced?;
    Ok(p.states
        .into_iter()
        .map(|st| match st.err {
            Some(e) => Err(e),
            None => verify(&st.hasher, &jobs[st.job].expected_sum),
        })
        .collect())
}

/// The lane's bounce buffers: pinned (allocated on first use, with one
/// stream each) when any destination is device memory, else host.
#[allow(unused_variables)]
fn lane_ptrs(lane: &mut Lane, ctx: &LaneCtx<'_>, device: bool) -> Result<Vec<(*mut u8, usize)>> {
    #[cfg(feature = "cuda")]
    if device {
        let gpu = ctx.gpu.ok_or_else(|| Error::NoCuda {
            reason: ctx.caps.describe(),
        })?;
        // Each lane runs on its own thread: bind the context here.
        gpu.bind()?;
        let n = ctx.cfg.buffers + SPARE_BUFFERS;
        while lane.pinned_bufs.len() < n {
            lane.pinned_bufs
                .push(crate::cuda::PinnedBuf::new(gpu, ctx.cfg.chunk_bytes)?);
        }
        while lane.streams.len() < n {
            lane.streams.push(crate::cuda::Stream::new()?);
        }
        return Ok(lane
            .pinned_bufs
            .iter_mut()
            .map(|b| (b.as_mut_slice().as_mut_ptr(), b.len()))
            .collect());
    }
    Ok(lane
        .host_bufs
        .iter_mut()
        .map(|b| (b.as_mut_slice().as_mut_ptr(), b.len()))
        .collect())
}

fn verify(h: &SumHasher, expected: &PayloadSum) -> Result<()> {
    let got = h.finish();
    if got != *expected {
        return Err(Error::Checksum {
            expected: format!("{expected:?}"),
            actual: format!("{got:?}"),
        });
    }
    Ok(())
}

fn drain(ring: &mut io_uring::IoUring, inflight: &mut usize) -> Result<()> {
    while *inflight > 0 {
        ring.submit_and_wait(1)
            .map_err(|e| Error::io("io_uring wait (drain)", e))?;
        let n = ring.completion().count();
        *inflight = inflight.saturating_sub(n);
    }
    Ok(())
}

/// One block in flight through the bounce pipeline.
struct JobState {
    job: usize,
    fd: i32,
    off: u64,
    len: u64,
    hasher: SumHasher,
    scatter: Scatter,
    /// Set on the first failure; later chunks of this job are skipped.
    err: Option<Error>,
}

/// State of one bounce pipeline run over a batch.
struct Pump<'b> {
    chunk: usize,
    /// Most reads in flight.
    depth: usize,
    bufs: &'b [(*mut u8, usize)],
    slots: Vec<Slot>,
    /// Global chunk order: (job state, chunk within that job).
    chunks: &'b [(usize, usize)],
    states: Vec<JobState>,
    pieces: Vec<Piece>,
    #[cfg(feature = "cuda")]
    streams: &'b [crate::cuda::Stream],
}

impl Pump<'_> {
    fn run(
        &mut self,
        ring: &mut io_uring::IoUring,
        inflight: &mut usize,
        jobs: &mut [&mut OnboardJob<'_, '_>],
    ) -> Result<()> {
        let nchunks = self.chunks.len();
        let mut next_submit = 0usize;
        let mut next_process = 0usize;
        let mut cqes: Vec<(u64, i32)> = Vec::with_capacity(self.slots.len());
        while next_process < nchunks {
            // Refill first, so the disk queue is `depth` deep while the
            // CPU hashes and copies.
            let mut pushed = false;
            for s in 0..self.slots.len() {
                if next_submit >= nchunks || *inflight >= self.depth {
                    break;
                }
                if self.slots[s].chunk.is_some() {
                    continue;
                }
                if self.slots[s].copying {
                    #[cfg(feature = "cuda")]
                    self.streams[s].sync()?;
                    self.slots[s].copying = false;
                }
                let (si, k) = self.chunks[next_submit];
                let st = &self.states[si];
                let padded = st.len.div_ceil(PAGE_BYTES as u64) * PAGE_BYTES as u64;
                let start = k as u64 * self.chunk as u64;
                let want = (padded - start).min(self.chunk as u64) as usize;
                self.slots[s] = Slot {
                    chunk: Some(next_submit),
                    want,
                    filled: 0,
                    ready: false,
                    copying: false,
                };
                if st.err.is_some() {
                    // The job already failed: skip its remaining reads.
                    self.slots[s].ready = true;
                } else {
                    self.push_read(ring, s)?;
                    *inflight += 1;
                    pushed = true;
                }
                next_submit += 1;
            }
            if pushed {
                ring.submit().map_err(|e| Error::io("io_uring submit", e))?;
            }
            // Consume completed chunks strictly in order (each job's hash is
            // sequential).
            if let Some(s) = self
                .slots
                .iter()
                .position(|sl| sl.chunk == Some(next_process) && sl.ready)
            {
                self.process(s, next_process, jobs)?;
                self.slots[s].chunk = None;
                next_process += 1;
                self.reap(ring, inflight, false, &mut cqes)?;
                continue;
            }
            if *inflight == 0 {
                continue;
            }
            self.reap(ring, inflight, true, &mut cqes)?;
        }
        Ok(())
    }

    /// Handles completions; with `wait`, blocks for at least one.
    fn reap(
        &mut self,
        ring: &mut io_uring::IoUring,
        inflight: &mut usize,
        wait: bool,
        cqes: &mut Vec<(u64, i32)>,
    ) -> Result<()> {
        if wait {
            ring.submit_and_wait(1)
                .map_err(|e| Error::io("io_uring submit", e))?;
        }
        cqes.clear();
        cqes.extend(ring.completion().map(|c| (c.user_data(), c.result())));
        let mut resubmitted = false;
        for &(ud, res) in cqes.iter() {
            *inflight = inflight.saturating_sub(1);
            let s = ud as usize;
            let Some(g) = self.slots.get(s).and_then(|sl| sl.chunk) else {
                continue;
            };
            let (si, _) = self.chunks[g];
            let at = self.file_off(s);
            let left = self.slots[s].want - self.slots[s].filled;
            let failed = if res < 0 {
                Some(Error::io(
                    "O_DIRECT read of block file",
                    std::io::Error::from_raw_os_error(-res),
                ))
            } else if res == 0 || (res as usize) < left && !(res as usize).is_multiple_of(512) {
                Some(Error::Truncated {
                    offset: at,
                    wanted_bytes: left as u64,
                    got_bytes: res as u64,
                })
            } else {
                None
            };
            if let Some(e) = failed {
                self.states[si].err.get_or_insert(e);
                self.slots[s].ready = true;
                continue;
            }
            self.slots[s].filled += res as usize;
            if self.slots[s].filled >= self.slots[s].want {
                self.slots[s].ready = true;
            } else {
                self.push_read(ring, s)?;
                *inflight += 1;
                resubmitted = true;
            }
        }
        if resubmitted {
            ring.submit().map_err(|e| Error::io("io_uring submit", e))?;
        }
        Ok(())
    }

    /// File offset of the next byte slot `s` reads.
    fn file_off(&self, s: usize) -> u64 {
        let sl = self.slots[s];
        let (si, k) = self.chunks[sl.chunk.unwrap_or_default()];
        self.states[si].off + k as u64 * self.chunk as u64 + sl.filled as u64
    }

    fn push_read(&self, ring: &mut io_uring::IoUring, s: usize) -> Result<()> {
        use io_uring::{opcode, types};
        let sl = self.slots[s];
        let (si, _) = self.chunks[sl.chunk.unwrap_or_default()];
        let (ptr, cap) = self.bufs[s];
        let n = sl.want - sl.filled;
        debug_assert!(sl.want <= cap);
        // SAFETY: `filled < want <= cap`, so the range lies in buffer `s`,
        // which outlives the read (bounce() drains the ring before return).
        let e = opcode::Read::new(
            types::Fd(self.states[si].fd),
            unsafe { ptr.add(sl.filled) },
            n as u32,
        )
        .offset(self.file_off(s))
        .build()
        .user_data(s as u64);
        // SAFETY: the entry's buffer stays valid until its completion.
        unsafe { ring.submission().push(&e) }.map_err(|_| {
            Error::io(
                "io_uring push",
                std::io::Error::other("submission queue full"),
            )
        })
    }

    fn process(&mut self, s: usize, g: usize, jobs: &mut [&mut OnboardJob<'_, '_>]) -> Result<()> {
        let (si, k) = self.chunks[g];
        let st = &mut self.states[si];
        if st.err.is_some() {
            return Ok(());
        }
        let start = k as u64 * self.chunk as u64;
        let valid = (st.len.saturating_sub(start)).min(self.chunk as u64) as usize;
        let (ptr, _) = self.bufs[s];
        // SAFETY: the read into buffer `s` completed; `valid <= want`.
        let data = unsafe { std::slice::from_raw_parts(ptr as *const u8, valid) };
        st.hasher.update(data);
        st.scatter.next_pieces(valid, &mut self.pieces);
        let dst = &mut *jobs[st.job].dst;
        for p in &self.pieces {
            let src = &data[p.src_off..p.src_off + p.len];
            match &mut dst.regions_mut()[p.region] {
                Region::Host(b) => b[p.dst_off..p.dst_off + p.len].copy_from_slice(src),
                Region::Device(_span) => {
                    #[cfg(feature = "cuda")]
                    {
                        // SAFETY: `src` is pinned bounce memory that is not
                        // reused until this stream is synchronised; the
                        // span was checked against the layout.
                        unsafe { self.streams[s].htod_async(_span.ptr + p.dst_off as u64, src)? };
                        self.slots[s].copying = true;
                    }
                }
            }
        }
        Ok(())
    }
}
