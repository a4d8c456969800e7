//! The onboard's batch read: the slotted blocks of one request read with
//! one [`IoEngine::read_many`](super::engine::IoEngine::read_many) on the
//! calling thread (the connection's), where the per-block path took a
//! pooled helper thread and a ring per block (a wake-up and an
//! `io_uring_enter` each: the perf profile of small-block onboards put a
//! third of kvtierd's CPU in thread switches, docs/BENCHMARKS.md).
//!
//! Same checks as [`G3Store::read_into_for_verifier`]: straight into the
//! caller's region, header and length checked here, the payload left to
//! the reader. Anything this path does not serve or that does not check
//! out goes back to the caller, which reads it the usual way (and that way
//! decides: the verifying read, quarantine, a vanished file).

use super::engine::ReadReq;
use super::verify::{ReadOutcome, Verifier};
use super::G3Store;
use crate::base::backend::ReadTouch;
use kvtier_client::block::ALIGN_BYTES;
use kvtier_client::{BlockHeader, BlockKey, NamespaceId};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;

impl G3Store {
    /// Reads the slotted blocks among `items` (key, destination: header
    /// then payload, as [`G3Store::read_into_for_verifier`]) at once. One
    /// outcome per item, in order: `Some((header, touch))` for a hit (its
    /// hit counted, its policy touch returned, not run); `None` for an
    /// item left to the caller: absent, a file of its own, an unaligned
    /// destination on an O_DIRECT slab, one `skip` names, or a read or
    /// header that did not check out.
    pub fn read_many_for_verifier(
        &self,
        ns: &NamespaceId,
        items: &mut [(BlockKey, &mut [u8])],
        skip: &dyn Fn(&BlockKey) -> bool,
    ) -> Vec<Option<(BlockHeader, ReadTouch)>> {
        let mut out: Vec<Option<(BlockHeader, ReadTouch)>> = items.iter().map(|_| None).collect();
        // (item, id, file length, its slot held for the read)
        let mut held = Vec::new();
        // Asked before the index lock: `skip` may take the caller's locks.
        let skipped: Vec<bool> = items.iter().map(|(key, _)| skip(key)).collect();
        {
            let Ok(mem) = self.mem.read() else {
                return out;
            };
            for (i, (key, dst)) in items.iter().enumerate() {
                if skipped[i] {
                    continue;
                }
                let Some((id, e)) = mem.get(ns, key) else {
                    continue;
                };
                let len = e.file_len();
                if e.slotted().is_none() || (dst.len() as u64) < len {
                    continue;
                }
                let aligned = (dst.as_ptr() as usize).is_multiple_of(ALIGN_BYTES)
                    && len.is_multiple_of(ALIGN_BYTES as u64);
                if self.direct_ok && !aligned {
                    continue;
                }
                if let Some(h) = self.hold_slot(e) {
                    held.push((i, id, len, h));
                }
            }
        }
        if held.is_empty() {
            return out;
        }
        let got = {
            let mut reqs: Vec<ReadReq<'_>> = Vec::with_capacity(held.len());
            let mut next = held.iter().peekable();
            for (i, (_, dst)) in items.iter_mut().enumerate() {
                let Some((_, _, len, h)) = next.next_if(|(j, ..)| *j == i) else {
                    continue;
                };
                reqs.push(ReadReq {
                    fd: h.slab.file.as_raw_fd(),
                    at: h.slab.offset(h.slot),
                    dst: &mut dst[..*len as usize],
                });
            }
            self.engine.read_many(&mut reqs)
        };
        for ((i, id, len, h), r) in held.into_iter().zip(got) {
            // The bytes are in the caller's region: the slot may go.
            drop(h);
            let Ok(n) = r else { continue };
            let (key, dst) = &items[i];
            let mut v = Verifier::header_only(ns, key, len);
            v.feed(&dst[..n]);
            let ReadOutcome::Ok(header) = v.finish(n as u64) else {
                continue;
            };
            self.counters.batch_reads.fetch_add(1, Ordering::Relaxed);
            out[i] = Some((header, self.count_hit(id)));
        }
        out
    }
}
