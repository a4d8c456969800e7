//! CUDA device buffers for onboard_into and offload.
//!
//! The route: the block moves between the daemon and a pinned host bounce
//! buffer exactly as a host block does (so it is verified by blake3 in
//! host memory the client owns), then one synchronous copy moves it to or
//! from the device, per segment, through kvtier-gds (the crate that holds
//! every CUDA call). Without a CUDA driver the call raises
//! kvtier.DeviceError naming what is missing.

use crate::buffers::{BlockSpans, Place};
use crate::client::Client;
use crate::errors::DeviceError;
use crate::ns::Namespace;
use crate::results::BlockResult;
use kvtier_client::{BlockKey, Hints, OffloadBlock};
use pyo3::prelude::*;

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

fn open_gpu(op: &str, blocks: &[BlockSpans]) -> PyResult<std::sync::Arc<kvtier_gds::cuda::Gpu>> {
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
    kvtier_gds::cuda::Gpu::open(ordinal(blocks))
        .map_err(|e| DeviceError::new_err(format!("{op}: opening the GPU: {e}")))
}

/// Onboards into device buffers through a pinned bounce buffer.
pub(crate) fn onboard_device(
    py: Python<'_>,
    client: &Client,
    ns: &Namespace,
    keys: &[BlockKey],
    blocks: &[BlockSpans],
) -> PyResult<Vec<BlockResult>> {
    if blocks.iter().any(|b| b.place == Place::Host) {
        return Err(DeviceError::new_err(
            "onboard_into: one call takes either host or device buffers, not both",
        ));
    }
    let gpu = open_gpu("onboard_into", blocks)?;
    let c = client.inner()?;
    let nsr = ns.inner.clone();
    let bb = nsr.layout.block_bytes() as usize;
    let blocks = blocks.to_vec();
    let keys = keys.to_vec();
    let r: Result<Vec<BlockResult>, String> = py.detach(move || {
        let mut out = Vec::with_capacity(keys.len());
        let mut bounce = kvtier_gds::cuda::PinnedBuf::new(&gpu, bb).map_err(|e| e.to_string())?;
        let h = c.namespace(&nsr);
        for (k, b) in keys.iter().zip(&blocks) {
            let res = {
                let mut dst = [bounce.as_mut_slice()];
                h.onboard_into(std::slice::from_ref(k), &mut dst).remove(0)
            };
            if res.is_hit() {
                let mut off = 0;
                for s in &b.spans {
                    // SAFETY: the caller's device span of s.len bytes,
                    // kept alive by the held export for this call.
                    unsafe {
                        kvtier_gds::cuda::copy_htod_raw(
                            &gpu,
                            s.ptr as u64,
                            &bounce.as_slice()[off..off + s.len],
                        )
                    }
                    .map_err(|e| e.to_string())?;
                    off += s.len;
                }
            }
            out.push(BlockResult::onboarded(&res));
        }
        Ok(out)
    });
    r.map_err(|e| DeviceError::new_err(format!("onboard_into: {e}")))
}

/// Offloads from device buffers through a pinned bounce buffer.
pub(crate) fn offload_device(
    py: Python<'_>,
    client: &Client,
    ns: &Namespace,
    keys: &[BlockKey],
    parent: Option<BlockKey>,
    blocks: &[BlockSpans],
    hints: Hints,
) -> PyResult<Vec<BlockResult>> {
    if blocks.iter().any(|b| b.place == Place::Host) {
        return Err(DeviceError::new_err(
            "offload: one call takes either host or device buffers, not both",
        ));
    }
    let gpu = open_gpu("offload", blocks)?;
    let c = client.inner()?;
    let nsr = ns.inner.clone();
    let bb = nsr.layout.block_bytes() as usize;
    let blocks = blocks.to_vec();
    let keys = keys.to_vec();
    let r: Result<Vec<BlockResult>, String> = py.detach(move || {
        let mut out = Vec::with_capacity(keys.len());
        let mut bounce = kvtier_gds::cuda::PinnedBuf::new(&gpu, bb).map_err(|e| e.to_string())?;
        let h = c.namespace(&nsr);
        let mut p = parent;
        for (k, b) in keys.iter().zip(&blocks) {
            let mut off = 0;
            for s in &b.spans {
                // SAFETY: as in onboard_device.
                unsafe {
                    kvtier_gds::cuda::copy_dtoh_raw(
                        &gpu,
                        s.ptr as u64,
                        &mut bounce.as_mut_slice()[off..off + s.len],
                    )
                }
                .map_err(|e| e.to_string())?;
                off += s.len;
            }
            let item = OffloadBlock {
                key: *k,
                parent: p,
                payload: bounce.as_slice(),
                hints,
            };
            out.push(BlockResult::offloaded(&h.offload(&[item]).remove(0)));
            p = Some(*k);
        }
        Ok(out)
    });
    r.map_err(|e| DeviceError::new_err(format!("offload: {e}")))
}
