//! CUDA device buffers for onboard_into and offload.
//!
//! The route: the block moves between the daemon and a pinned host bounce
//! buffer exactly as a host block does (so it is verified by blake3 in
//! host memory the client owns), then one synchronous copy moves it to or
//! from the device, per segment, through kvtier-gds (the crate that holds
//! every CUDA call). Without a CUDA driver the call raises
//! kvtier.DeviceError naming what is missing.

use crate::buffers::{BlockSpans, Place, Span};
use crate::client::Client;
use crate::errors::DeviceError;
use crate::ns::Namespace;
use crate::results::BlockResult;
use kvtier_client::{BlockKey, Hints, NsHandle};
use kvtier_gds::cuda::Gpu;
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};

/// Why device memory cannot be used here, as an exception.
pub(crate) fn device_unavailable(op: &str, dev: i32) -> PyErr {
    let caps = kvtier_gds::Capabilities::probe();
    let d = if dev < 0 {
        "cuda".to_string()
    } else {
        format!("cuda:{dev}")
    };
    DeviceError::new_err(format!(
        "{op}: a {d} device buffer was given, but {} ; pass host memory (numpy, bytearray, a CPU \
         tensor), or run where the NVIDIA driver (libcuda) and a GPU are present",
        caps.describe()
    ))
}

fn ordinal(blocks: &[BlockSpans]) -> u32 {
    blocks
        .iter()
        .find_map(|b| match b.place {
            Place::Cuda(d) if d >= 0 => Some(d as u32),
            _ => None,
        })
        .unwrap_or(0)
}

/// One bounce buffer per process, grown on demand (pinned allocation
/// costs milliseconds; a call must not pay it per block).
static BOUNCE: Mutex<Option<kvtier_gds::cuda::PinnedBuf>> = Mutex::new(None);
/// Opened GPUs by ordinal.
static GPUS: Mutex<Vec<(u32, Arc<Gpu>)>> = Mutex::new(Vec::new());

fn open_gpu(op: &str, blocks: &[BlockSpans]) -> PyResult<Arc<Gpu>> {
    let ord = ordinal(blocks);
    let mut g = GPUS
        .lock()
        .map_err(|_| DeviceError::new_err("GPU table poisoned"))?;
    if let Some((_, gpu)) = g.iter().find(|(o, _)| *o == ord) {
        return Ok(gpu.clone());
    }
    let caps = kvtier_gds::Capabilities::probe();
    if !caps.has_cuda() {
        let dev = blocks
            .iter()
            .find_map(|b| match b.place {
                Place::Cuda(d) => Some(d),
                _ => None,
            })
            .unwrap_or(-1);
        return Err(device_unavailable(op, dev));
    }
    let gpu =
        Gpu::open(ord).map_err(|e| DeviceError::new_err(format!("{op}: opening the GPU: {e}")))?;
    g.push((ord, gpu.clone()));
    Ok(gpu)
}

/// Runs `f` with a pinned bounce buffer of at least `len` bytes.
fn with_bounce<T>(
    gpu: &Arc<Gpu>,
    len: usize,
    f: impl FnOnce(&mut kvtier_gds::cuda::PinnedBuf) -> Result<T, String>,
) -> Result<T, String> {
    let mut g = BOUNCE
        .lock()
        .map_err(|_| "bounce buffer poisoned".to_string())?;
    if g.as_ref().is_none_or(|b| b.len() < len) {
        *g = None;
        *g = Some(kvtier_gds::cuda::PinnedBuf::new(gpu, len).map_err(|e| e.to_string())?);
    }
    let Some(b) = g.as_mut() else {
        return Err("no bounce buffer".into());
    };
    f(b)
}

/// The shape both device calls share: one call takes host or device
/// buffers, not both; the GPU is opened; `f` gets the client's namespace
/// handle, the block size and the pinned bounce buffer for the whole
/// batch (block i at i * block_bytes), without the GIL.
fn through_bounce(
    py: Python<'_>,
    client: &Client,
    ns: &Namespace,
    op: &str,
    blocks: &[BlockSpans],
    f: impl FnOnce(&Gpu, &NsHandle<'_>, usize, &mut [u8]) -> Result<Vec<BlockResult>, String> + Send,
) -> PyResult<Vec<BlockResult>> {
    if blocks.iter().any(|b| b.place == Place::Host) {
        return Err(DeviceError::new_err(format!(
            "{op}: one call takes either host or device buffers, not both"
        )));
    }
    let gpu = open_gpu(op, blocks)?;
    let c = client.inner()?;
    let nsr = ns.inner.clone();
    let bb = nsr.layout.block_bytes() as usize;
    let len = bb * blocks.len();
    let r = py.detach(|| {
        c.within_deadline(|| {
            with_bounce(&gpu, len.max(1), |bounce| {
                f(
                    &gpu,
                    &c.namespace(&nsr),
                    bb,
                    &mut bounce.as_mut_slice()[..len],
                )
            })
        })
    });
    r.map_err(|e| DeviceError::new_err(format!("{op}: {e}")))
}

/// Runs one CUDA copy `mv` per segment of each block `pick` selects,
/// paired with its bytes in the bounce buffer `host` (blocks of `bb`).
fn each_device_segment(
    blocks: &[BlockSpans],
    bb: usize,
    host: &mut [u8],
    pick: impl Fn(usize) -> bool,
    mut mv: impl FnMut(Span, &mut [u8]) -> kvtier_gds::Result<()>,
) -> Result<(), String> {
    for (i, (b, flat)) in blocks.iter().zip(host.chunks_mut(bb.max(1))).enumerate() {
        if pick(i) {
            b.each_segment(flat, &mut mv).map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// Onboards into device buffers through a pinned bounce buffer: one
/// onboard of the whole batch into it, then one copy per segment.
pub(crate) fn onboard_device(
    py: Python<'_>,
    client: &Client,
    ns: &Namespace,
    keys: &[BlockKey],
    blocks: &[BlockSpans],
) -> PyResult<Vec<BlockResult>> {
    through_bounce(
        py,
        client,
        ns,
        "onboard_into",
        blocks,
        |gpu, h, bb, host| {
            let res = {
                let mut dsts: Vec<&mut [u8]> = host.chunks_mut(bb.max(1)).collect();
                h.onboard_into(keys, &mut dsts)
            };
            each_device_segment(
                blocks,
                bb,
                host,
                |i| res[i].is_hit(),
                // SAFETY: the caller's device span of s.len bytes, kept alive by
                // the held export for this call.
                |s, part| unsafe { kvtier_gds::cuda::copy_htod_raw(gpu, s.ptr as u64, part) },
            )?;
            Ok(res.iter().map(BlockResult::onboarded).collect())
        },
    )
}

/// Offloads from device buffers through a pinned bounce buffer: one copy
/// per segment into it, then one offload of the whole batch.
pub(crate) fn offload_device(
    py: Python<'_>,
    client: &Client,
    ns: &Namespace,
    keys: &[BlockKey],
    parent: Option<BlockKey>,
    blocks: &[BlockSpans],
    hints: Hints,
) -> PyResult<Vec<BlockResult>> {
    through_bounce(py, client, ns, "offload", blocks, |gpu, h, bb, host| {
        each_device_segment(
            blocks,
            bb,
            host,
            |_| true,
            // SAFETY: as in onboard_device.
            |s, part| unsafe { kvtier_gds::cuda::copy_dtoh_raw(gpu, s.ptr as u64, part) },
        )?;
        let payloads: Vec<&[u8]> = host.chunks(bb.max(1)).collect();
        Ok(h.offload_chain(parent, keys, &payloads, hints)
            .iter()
            .map(BlockResult::offloaded)
            .collect())
    })
}
