//! CUDA device buffers for onboard_into and offload, through kvtier-gds's
//! pipeline (gds/src/keyed.rs), the crate that holds every CUDA call.
//!
//! Onboard: the daemon passes the block files (fds, each block leased for
//! the call); they are read with overlapped io_uring reads into pinned
//! bounce buffers, hashed chunk by chunk as they land, and copied on to
//! the device asynchronously (one stream per bounce buffer), straight into
//! each segment; or, where GPUDirect Storage is present, read into HBM by
//! cuFile and verified by a device-to-host pass. A block is a hit only
//! once blake3 of all its bytes matched its header; one that fails is a
//! `corrupt` miss and is reported to the daemon. The result's `route`
//! says which way the bytes went.
//!
//! Offload: the segments are gathered with asynchronous device-to-host
//! copies spread over several streams into pinned staging (one wait per
//! group), then offloaded as host blocks are.
//!
//! Without a CUDA driver the call raises kvtier.DeviceError naming what is
//! missing. With `KVTIER_PY_HOST_VIA_GDS=1`, host buffers take this same
//! path, host memory standing in for HBM (the gds crate's emulated
//! destinations): how CI runs it without a GPU.

use crate::buffers::{BlockSpans, Place};
use crate::client::Client;
use crate::errors::DeviceError;
use crate::ns::Namespace;
use crate::results::BlockResult;
use kvtier_client::{BlockKey, Hints};
use kvtier_gds::keyed::{offload_keys, onboard_keys};
use kvtier_gds::{
    Capabilities, Destination, DeviceSpan, Gather, MemoryKind, SrcRegion, Transfer, TransferConfig,
};
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};

/// The environment variable that sends host buffers through this path.
pub(crate) const HOST_VIA_GDS_ENV: &str = "KVTIER_PY_HOST_VIA_GDS";

/// Whether host buffers take the device path (host-mode tests).
pub(crate) fn host_via_gds() -> bool {
    std::env::var_os(HOST_VIA_GDS_ENV).is_some_and(|v| v == "1")
}

/// Why device memory cannot be used here, as an exception.
pub(crate) fn device_unavailable(op: &str, dev: i32, why: &str) -> PyErr {
    let d = if dev < 0 {
        "cuda".to_string()
    } else {
        format!("cuda:{dev}")
    };
    DeviceError::new_err(format!(
        "{op}: a {d} device buffer was given, but {why} ; pass host memory (numpy, bytearray, a \
         CPU tensor), or run where the NVIDIA driver (libcuda) and a GPU are present"
    ))
}

/// One pipeline: the transfer (io_uring ring, bounce buffers, streams)
/// and the offload gather, kept for the process (pinned allocations cost
/// milliseconds; a call must not pay them per block).
struct Pipe {
    transfer: Transfer,
    gather: Gather,
}

/// Which pipeline a call takes: a GPU by ordinal, or host memory standing
/// in for HBM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Gpu(u32),
    Emulated,
}

/// The pipelines of this process: (pid, target, pipeline).
type Pipes = Vec<(u32, Target, Arc<Mutex<Pipe>>)>;
static PIPES: Mutex<Pipes> = Mutex::new(Vec::new());

fn target(blocks: &[BlockSpans]) -> Target {
    match blocks.iter().find_map(|b| match b.place {
        Place::Cuda(d) => Some(d),
        Place::Host => None,
    }) {
        Some(d) => Target::Gpu(d.max(0) as u32),
        None => Target::Emulated,
    }
}

/// The pipeline for `blocks` (their places checked), made on first use.
fn pipe(op: &str, blocks: &[BlockSpans]) -> PyResult<Arc<Mutex<Pipe>>> {
    check_places(op, blocks)?;
    let tgt = target(blocks);
    let me = std::process::id();
    let mut g = PIPES
        .lock()
        .map_err(|_| DeviceError::new_err("device pipeline table poisoned"))?;
    // A forked child must not touch the parent's ring or CUDA state: left
    // alone (not dropped), as the client's connection is.
    for (_, _, p) in g.extract_if(.., |(pid, _, _)| *pid != me) {
        std::mem::forget(p);
    }
    if let Some((_, _, p)) = g.iter().find(|(_, t, _)| *t == tgt) {
        return Ok(p.clone());
    }
    let cfg = TransferConfig::default();
    let err = |e: kvtier_gds::Error| DeviceError::new_err(format!("{op}: {e}"));
    let transfer = match tgt {
        Target::Emulated => Transfer::host_only(cfg).map_err(err)?,
        Target::Gpu(ord) => {
            let dev = ord as i32;
            let caps = Capabilities::probe();
            if !caps.has_cuda() {
                return Err(device_unavailable(op, dev, &caps.describe()));
            }
            let t = Transfer::on_gpu(caps, cfg, ord).map_err(err)?;
            if t.gpu().is_none() {
                return Err(device_unavailable(op, dev, &t.capabilities().describe()));
            }
            t
        }
    };
    let gather = Gather::new(&transfer);
    let p = Arc::new(Mutex::new(Pipe { transfer, gather }));
    g.push((me, tgt, p.clone()));
    Ok(p)
}

/// The checks both calls share: one call takes host or device buffers,
/// not both (unless host buffers stand in for device ones).
fn check_places(op: &str, blocks: &[BlockSpans]) -> PyResult<()> {
    if !host_via_gds() && blocks.iter().any(|b| b.place == Place::Host) {
        return Err(DeviceError::new_err(format!(
            "{op}: one call takes either host or device buffers, not both"
        )));
    }
    Ok(())
}

fn device_spans(b: &BlockSpans) -> Vec<DeviceSpan> {
    b.spans
        .iter()
        .map(|s| DeviceSpan {
            ptr: s.ptr as u64,
            len: s.len,
        })
        .collect()
}

/// Onboards into device buffers (see the module docs).
pub(crate) fn onboard_device(
    py: Python<'_>,
    client: &Client,
    ns: &Namespace,
    keys: &[BlockKey],
    blocks: &[BlockSpans],
) -> PyResult<Vec<BlockResult>> {
    let op = "onboard_into";
    let p = pipe(op, blocks)?;
    let c = client.inner()?;
    let nsr = ns.inner.clone();
    let r = py.detach(|| {
        let mut dsts: Vec<Destination<'_>> = blocks
            .iter()
            .map(|b| match b.place {
                // SAFETY: the caller's device spans, kept alive by the
                // exports the call holds until it returns; on this GPU
                // (the pipeline was chosen by the blocks' ordinal).
                Place::Cuda(_) => unsafe { Destination::device_raw(device_spans(b)) }.segments(),
                Place::Host => Destination::emulated(
                    MemoryKind::Device,
                    // SAFETY: live, writable host views held for the call,
                    // distinct per buffer (the caller's promise).
                    b.spans.iter().map(|s| unsafe { s.host_mut() }).collect(),
                )
                .segments(),
            })
            .collect();
        let mut g = p
            .lock()
            .map_err(|_| "device pipeline poisoned".to_string())?;
        let pipe = &mut *g;
        Ok::<_, String>(c.within_deadline(|| {
            onboard_keys(&mut pipe.transfer, &c.namespace(&nsr), keys, &mut dsts)
        }))
    });
    let r = r.map_err(|e| DeviceError::new_err(format!("{op}: {e}")))?;
    Ok(r.iter()
        .map(|k| BlockResult::onboarded(&k.result).with_outcome(k.outcome.as_ref()))
        .collect())
}

/// Offloads from device buffers (see the module docs).
pub(crate) fn offload_device(
    py: Python<'_>,
    client: &Client,
    ns: &Namespace,
    keys: &[BlockKey],
    parent: Option<BlockKey>,
    blocks: &[BlockSpans],
    hints: Hints,
) -> PyResult<Vec<BlockResult>> {
    let op = "offload";
    let p = pipe(op, blocks)?;
    let c = client.inner()?;
    let nsr = ns.inner.clone();
    let r = py.detach(|| {
        let srcs: Vec<Vec<SrcRegion<'_>>> = blocks
            .iter()
            .map(|b| match b.place {
                Place::Cuda(_) => device_spans(b).into_iter().map(SrcRegion::Device).collect(),
                // SAFETY: live host views held for the call.
                Place::Host => b
                    .spans
                    .iter()
                    .map(|s| SrcRegion::Host(unsafe { s.host() }))
                    .collect(),
            })
            .collect();
        let mut g = p
            .lock()
            .map_err(|_| "device pipeline poisoned".to_string())?;
        Ok::<_, String>(c.within_deadline(|| {
            offload_keys(
                &mut g.gather,
                &c.namespace(&nsr),
                parent,
                keys,
                &srcs,
                hints,
            )
        }))
    });
    let r = r.map_err(|e| DeviceError::new_err(format!("{op}: {e}")))?;
    Ok(r.iter().map(BlockResult::offloaded).collect())
}
