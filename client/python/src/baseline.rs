//! The Rust client's side of `python -m kvtier.bench`: the very calls the
//! bench makes from Python (offload or onboard_into, `depth` blocks per
//! request, in the order given), made by kvtier-client in one Rust loop
//! over the same buffers, the same client and the same daemon, without the
//! GIL and without Python between requests. The quotient of the two is
//! what the Python layer costs, and nothing else: no other process, no
//! other blocks, no other region.

use crate::buffers::{all_blocks, Held, Place};
use crate::client::Client;
use crate::errors::BufferError;
use crate::ns::{keys_from, Namespace};
use kvtier_client::{Hints, OffloadBlock};
use pyo3::prelude::*;
use std::time::Instant;

/// _rust_client_round(client, ns, op, keys, bufs, depth, chain=True) -> (seconds, failed)
///
/// Benchmark support (not API): runs op ("offload" or "onboard") for
/// keys[i] / bufs[i] in requests of `depth` blocks through the Rust client
/// under `client`; returns the wall time of the requests and how many
/// blocks were not stored (offload) or missed (onboard). chain=False
/// offloads every block without a parent (as `kvtier bench io` does).
#[pyfunction]
#[pyo3(signature = (client, ns, op, keys, bufs, depth, chain=true))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn _rust_client_round(
    py: Python<'_>,
    client: &Client,
    ns: &Namespace,
    op: &str,
    keys: &Bound<'_, PyAny>,
    bufs: &Bound<'_, PyAny>,
    depth: usize,
    chain: bool,
) -> PyResult<(f64, usize)> {
    let onboard = match op {
        "offload" => false,
        "onboard" => true,
        other => {
            return Err(BufferError::new_err(format!(
                "op {other:?} is not \"offload\" or \"onboard\""
            )))
        }
    };
    let keys = keys_from(keys)?;
    let bb = ns.inner.layout.block_bytes() as usize;
    let mut held = Held::default();
    let blocks = all_blocks(bufs, onboard, bb, keys.len(), &mut held)?;
    if blocks
        .iter()
        .any(|b| b.place != Place::Host || b.spans.len() != 1)
    {
        return Err(BufferError::new_err(
            "the Rust baseline takes contiguous host buffers only",
        ));
    }
    let c = client.inner()?;
    let nsr = ns.inner.clone();
    let depth = depth.max(1);
    let out = py.detach(|| {
        let h = c.namespace(&nsr);
        let t = Instant::now();
        let mut failed = 0;
        for (ks, bs) in keys.chunks(depth).zip(blocks.chunks(depth)) {
            if onboard {
                let mut dsts: Vec<&mut [u8]> = bs
                    .iter()
                    // SAFETY: live, writable, contiguous host views held
                    // above until this call returns; distinct buffers are
                    // the caller's promise.
                    .filter_map(|b| unsafe { b.contiguous_mut() })
                    .collect();
                failed += h
                    .onboard_into(ks, &mut dsts)
                    .iter()
                    .filter(|r| !r.is_hit())
                    .count();
            } else {
                let payloads: Vec<&[u8]> = bs
                    .iter()
                    // SAFETY: as above (read only).
                    .filter_map(|b| unsafe { b.contiguous() })
                    .collect();
                let out = if chain {
                    h.offload_chain(None, ks, &payloads, Hints::default())
                } else {
                    let items: Vec<OffloadBlock<'_>> = ks
                        .iter()
                        .zip(&payloads)
                        .map(|(k, p)| OffloadBlock {
                            key: *k,
                            parent: None,
                            payload: p,
                            hints: Hints::default(),
                        })
                        .collect();
                    h.offload(&items)
                };
                failed += out.iter().filter(|o| !o.is_stored()).count();
            }
        }
        (t.elapsed().as_secs_f64(), failed)
    });
    drop(held);
    Ok(out)
}
