//! A fault-injecting engine wrapper (redb's fuzzer backend and
//! raft-engine's failpoints are the model): fail after N operations or with
//! a seeded probability, optionally leaving a torn (half-written) file, so
//! that error and crash paths run deterministically in tests.

use super::engine::{AlignedBuf, FillFn, IoEngine, ReadyFn};
use rand::{Rng, SeedableRng};
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// When and where faults strike.
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    /// Every targeted operation from this 0-based count on fails.
    pub fail_after_ops: Option<u64>,
    /// Each targeted operation fails with this probability (seeded).
    pub fail_probability: f64,
    /// Seed of the probability draws.
    pub seed: u64,
    /// A failing write first writes half the file (a torn write).
    pub torn_writes: bool,
    /// Writes are targeted.
    pub writes: bool,
    /// Reads are targeted.
    pub reads: bool,
    /// fdatasync and the group flush's syncfs are targeted.
    pub syncs: bool,
}

/// Wraps any engine; counts targeted operations and injects EIO.
pub struct FaultEngine {
    inner: Arc<dyn IoEngine>,
    plan: FaultPlan,
    ops: AtomicU64,
    injected: AtomicU64,
    rng: Mutex<rand::rngs::StdRng>,
}

impl FaultEngine {
    /// A wrapper around `inner` following `plan`.
    pub fn new(inner: Arc<dyn IoEngine>, plan: FaultPlan) -> Self {
        let rng = Mutex::new(rand::rngs::StdRng::seed_from_u64(plan.seed));
        FaultEngine {
            inner,
            plan,
            ops: AtomicU64::new(0),
            injected: AtomicU64::new(0),
            rng,
        }
    }

    /// Faults injected so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    fn strike(&self) -> bool {
        let n = self.ops.fetch_add(1, Ordering::Relaxed);
        let hit = self.plan.fail_after_ops.is_some_and(|k| n >= k)
            || (self.plan.fail_probability > 0.0
                && self
                    .rng
                    .lock()
                    .map(|mut r| r.random::<f64>() < self.plan.fail_probability)
                    .unwrap_or(false));
        if hit {
            self.injected.fetch_add(1, Ordering::Relaxed);
        }
        hit
    }
}

fn eio() -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

impl IoEngine for FaultEngine {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn write_file(
        &self,
        fd: RawFd,
        at: u64,
        len: u64,
        bufs: &mut [AlignedBuf],
        fill: FillFn<'_>,
    ) -> io::Result<()> {
        if self.plan.writes && self.strike() {
            if self.plan.torn_writes {
                let half = (len / 2).div_ceil(4096) * 4096;
                self.inner.write_file(fd, at, half.min(len), bufs, fill)?;
            }
            return Err(eio());
        }
        self.inner.write_file(fd, at, len, bufs, fill)
    }

    fn read_file(
        &self,
        fd: RawFd,
        at: u64,
        dst: &mut [u8],
        on_ready: ReadyFn<'_>,
    ) -> io::Result<usize> {
        if self.plan.reads && self.strike() {
            return Err(eio());
        }
        self.inner.read_file(fd, at, dst, on_ready)
    }

    fn sync_data(&self, fd: RawFd) -> io::Result<()> {
        if self.plan.syncs && self.strike() {
            return Err(eio());
        }
        self.inner.sync_data(fd)
    }

    fn sync_fs(&self, fd: RawFd) -> io::Result<()> {
        if self.plan.syncs && self.strike() {
            return Err(eio());
        }
        self.inner.sync_fs(fd)
    }
}

impl super::G3Store {
    /// Test seam: the next `n` index commits of the write path fail, as a
    /// full or failing index disk would make them.
    #[doc(hidden)]
    pub fn fault_fail_index_commits(&self, n: u64) {
        self.disk.fail_puts.store(n, Ordering::Release);
    }
}
