//! What every benchmark shares: page-cache dropping, medians and
//! percentiles, the `--json` report shape, and the raw O_DIRECT baseline.
//!
//! BENCH.md: every figure beside a baseline from the same invocation,
//! interleaved A B A B; the quotient under a key ending in `_vs_baseline`.
#![allow(dead_code)] // each helper serves some benchmarks, not all

use anyhow::{Context, Result};
use serde_json::{json, Map, Value};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
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
/// read with O_DIRECT pwrite/pread by `depth` threads (each owning its own
/// aligned buffer), so `depth` requests are in flight as in the tier.
pub struct RawFile {
    file: File,
    block_bytes: usize,
    blocks: usize,
}

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
        })
    }

    /// Writes every block (in order, `depth` in flight) and fdatasyncs.
    /// Returns GB/s.
    pub fn write_all(&self, depth: usize) -> Result<f64> {
        let t = Instant::now();
        self.parallel(depth, &(0..self.blocks).collect::<Vec<_>>(), true)?;
        self.file.sync_data()?;
        Ok(gbps(
            self.block_bytes * self.blocks,
            t.elapsed().as_secs_f64(),
        ))
    }

    /// Reads the blocks in the given order with `depth` in flight. Returns
    /// GB/s and per-read latencies in microseconds.
    pub fn read_order(&self, depth: usize, order: &[usize]) -> Result<(f64, Vec<f64>)> {
        let t = Instant::now();
        let lat = self.parallel(depth, order, false)?;
        Ok((
            gbps(self.block_bytes * order.len(), t.elapsed().as_secs_f64()),
            lat,
        ))
    }

    fn parallel(&self, depth: usize, order: &[usize], write: bool) -> Result<Vec<f64>> {
        let depth = depth.clamp(1, 256);
        let next = std::sync::atomic::AtomicUsize::new(0);
        let lat = std::sync::Mutex::new(Vec::with_capacity(order.len()));
        std::thread::scope(|s| -> Result<()> {
            let mut hs = Vec::new();
            for _ in 0..depth {
                hs.push(s.spawn(|| -> Result<()> {
                    let mut buf = AlignedBuf::rounded(self.block_bytes)?;
                    buf.as_mut_slice().fill(0x5a);
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&b) = order.get(i) else { break };
                        let off = (b * self.block_bytes) as u64;
                        let t = Instant::now();
                        if write {
                            self.file.write_all_at(buf.as_slice(), off)?;
                        } else {
                            self.file.read_exact_at(buf.as_mut_slice(), off)?;
                        }
                        mine.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                    if let Ok(mut l) = lat.lock() {
                        l.extend(mine);
                    }
                    Ok(())
                }));
            }
            for h in hs {
                h.join()
                    .map_err(|_| anyhow::anyhow!("baseline thread panicked"))??;
            }
            Ok(())
        })?;
        Ok(lat.into_inner().unwrap_or_default())
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
