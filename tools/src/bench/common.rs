//! What every benchmark shares: page-cache dropping, medians and
//! percentiles, the `--json` report shape, and the raw O_DIRECT baseline.
//!
//! BENCH.md: every figure beside a baseline from the same invocation,
//! interleaved A B A B; the quotient under a key ending in `_vs_baseline`.
#![allow(dead_code)] // each helper serves some benchmarks, not all

use anyhow::{Context, Result};
use serde_json::{json, Map, Value};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Instant;

/// Drops the page cache (needs root). Returns whether it worked, which the
/// report states so that a warm read is never passed off as cold.
pub fn drop_page_cache() -> bool {
    // SAFETY: sync(2) has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", b"3\n").is_ok()
}

/// Median of a sample (0 for an empty one).
pub fn median(v: &[f64]) -> f64 {
    percentile(v, 50.0)
}

/// The p-th percentile (nearest rank) of a sample (0 for an empty one).
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

/// `len` bytes of xorshift noise from `seed` (incompressible, distinct per
/// seed), for block payloads.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for c in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    v
}

/// A measured figure beside its baseline: `{name}`, `{name}_baseline`,
/// `{name}_vs_baseline` (measured / baseline, higher is better).
pub fn compare(out: &mut Map<String, Value>, name: &str, measured: f64, baseline: f64) {
    out.insert(name.to_string(), json!(measured));
    out.insert(format!("{name}_baseline"), json!(baseline));
    let q = if baseline > 0.0 {
        measured / baseline
    } else {
        0.0
    };
    out.insert(format!("{name}_vs_baseline"), json!(q));
}

/// Prints a report: one JSON document, or indented text for people.
pub fn emit(report: &Value, as_json: bool) -> Result<()> {
    if as_json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        println!("{}", serde_json::to_string_pretty(report)?);
    }
    Ok(())
}

pub use kvtier_client::AlignedBuf;

/// Raw baseline: one file of `blocks * block_bytes` under `dir`, written and
/// read with O_DIRECT through one io_uring with `depth` requests in flight
/// from registered buffers (`WriteFixed` / `ReadFixed`), one thread: the
/// best raw I/O for the pattern, so no ratio is flattered by a weak
/// baseline. The buffers are allocated, filled with noise and registered
/// once, outside the timed region (the thread-per-request baseline before
/// it allocated and zero-filled `depth` buffers in every call: at 16 MiB
/// and depth 64 a gigabyte of page faults and memset charged to the
/// baseline's CPU per GB, which is why it once cost more CPU than kvtier).
pub struct RawFile {
    file: File,
    block_bytes: usize,
    blocks: usize,
    bufs: std::sync::Mutex<Vec<AlignedBuf>>,
}

/// Most requests the baseline keeps in flight.
const RAW_DEPTH_MAX: usize = 256;

impl RawFile {
    /// Creates (truncates) the baseline file.
    pub fn create(dir: &Path, block_bytes: usize, blocks: usize) -> Result<Self> {
        let path = dir.join("raw-baseline.bin");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .with_context(|| format!("opening {} with O_DIRECT", path.display()))?;
        Ok(RawFile {
            file,
            block_bytes: block_bytes.div_ceil(4096) * 4096,
            blocks,
            bufs: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Writes every block (in order, `depth` in flight) and fdatasyncs.
    /// Returns GB/s.
    pub fn write_all(&self, depth: usize) -> Result<f64> {
        let order: Vec<usize> = (0..self.blocks).collect();
        let (secs, _) = self.uring(depth, &order, true, true)?;
        Ok(gbps(self.block_bytes * self.blocks, secs))
    }

    /// Reads the blocks in the given order with `depth` in flight. Returns
    /// GB/s and per-read latencies in microseconds.
    pub fn read_order(&self, depth: usize, order: &[usize]) -> Result<(f64, Vec<f64>)> {
        let (secs, lat) = self.uring(depth, order, false, false)?;
        Ok((gbps(self.block_bytes * order.len(), secs), lat))
    }

    /// Runs `order` through one ring, `depth` in flight; with `sync`, one
    /// fdatasync after the last write (inside the timed region). Returns
    /// the seconds taken and each request's latency in microseconds.
    fn uring(
        &self,
        depth: usize,
        order: &[usize],
        write: bool,
        sync: bool,
    ) -> Result<(f64, Vec<f64>)> {
        use io_uring::{opcode, types, IoUring};
        let depth = depth.clamp(1, RAW_DEPTH_MAX).min(order.len().max(1));
        let mut bufs = self
            .bufs
            .lock()
            .map_err(|_| anyhow::anyhow!("baseline buffers poisoned"))?;
        while bufs.len() < depth {
            let mut b = AlignedBuf::rounded(self.block_bytes)?;
            b.as_mut_slice()
                .copy_from_slice(&noise(bufs.len() as u64 + 1, self.block_bytes));
            bufs.push(b);
        }
        let mut ring = IoUring::new(depth.next_power_of_two() as u32)
            .context("io_uring for the raw baseline")?;
        let iovecs: Vec<libc::iovec> = bufs[..depth]
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_slice().as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        // SAFETY: the buffers outlive the ring: `bufs` (the guard) is held
        // until this function returns, after `ring` is dropped (declared
        // later, dropped first), and nothing else touches them meanwhile.
        unsafe { ring.submitter().register_buffers(&iovecs) }
            .context("registering the baseline's buffers")?;
        let fd = types::Fd(self.file.as_raw_fd());
        let len = self.block_bytes as u32;
        let mut free: Vec<usize> = (0..depth).collect();
        let mut started = vec![Instant::now(); depth];
        let mut lat = Vec::with_capacity(order.len());
        let (mut next, mut inflight) = (0, 0usize);
        let t = Instant::now();
        loop {
            while next < order.len() {
                let Some(slot) = free.pop() else { break };
                let off = (order[next] * self.block_bytes) as u64;
                let ptr = iovecs[slot].iov_base.cast::<u8>();
                let sqe = if write {
                    opcode::WriteFixed::new(fd, ptr, len, slot as u16)
                        .offset(off)
                        .build()
                } else {
                    opcode::ReadFixed::new(fd, ptr, len, slot as u16)
                        .offset(off)
                        .build()
                }
                .user_data(slot as u64);
                started[slot] = Instant::now();
                // SAFETY: the entry points into registered buffer `slot`,
                // which no other request uses until its completion is
                // reaped below; the ring has room for `depth` entries.
                unsafe { ring.submission().push(&sqe) }
                    .map_err(|_| anyhow::anyhow!("baseline submission queue full"))?;
                next += 1;
                inflight += 1;
            }
            if inflight == 0 {
                break;
            }
            ring.submit_and_wait(1)
                .context("io_uring wait (raw baseline)")?;
            for cqe in ring.completion() {
                let slot = cqe.user_data() as usize;
                let res = cqe.result();
                if res < 0 {
                    return Err(std::io::Error::from_raw_os_error(-res)).context(if write {
                        "raw baseline write"
                    } else {
                        "raw baseline read"
                    });
                }
                anyhow::ensure!(
                    res as u32 == len,
                    "raw baseline: short {} ({res} of {len} bytes)",
                    if write { "write" } else { "read" }
                );
                lat.push(started[slot].elapsed().as_secs_f64() * 1e6);
                free.push(slot);
                inflight -= 1;
            }
        }
        if sync {
            self.file.sync_data()?;
        }
        Ok((t.elapsed().as_secs_f64(), lat))
    }
}

/// CPU seconds (user + system, every thread) this process used so far.
pub fn process_cpu_s() -> f64 {
    // SAFETY: timespec is plain old data; all zeroes is a valid value.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: clock_gettime writes one timespec into `ts`.
    if unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) } != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// CPU seconds (user + system) another process used so far, from
/// /proc/PID/stat (clock-tick resolution: 10 ms); `None` when unreadable.
pub fn pid_cpu_s(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces), which ends
    // at the last ')': state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| ticks / hz as f64)
}

/// CPU seconds of this process plus `other` (a daemon it drives), so far.
pub fn cpu_s_with(other: Option<u32>) -> f64 {
    process_cpu_s() + other.and_then(pid_cpu_s).unwrap_or(0.0)
}

/// Bytes over seconds, in GB/s (10^9).
pub fn gbps(bytes: usize, secs: f64) -> f64 {
    if secs <= 0.0 {
        0.0
    } else {
        bytes as f64 / secs / 1e9
    }
}

/// Sizes on the command line read as in the daemon's config.
pub use kvtier_daemon::base::units::parse_size;

/// A seeded Fisher-Yates permutation of 0..n, for random read order.
pub fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    use rand::{seq::SliceRandom, SeedableRng};
    let mut v: Vec<usize> = (0..n).collect();
    v.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_percentiles() {
        assert_eq!(parse_size("2MiB").unwrap(), 2 << 20);
        assert_eq!(parse_size("64KiB").unwrap(), 64 << 10);
        assert!(parse_size("2XB").is_err());
        let v = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(median(&v), 3.0);
        assert_eq!(percentile(&v, 99.0), 5.0);
    }
}
