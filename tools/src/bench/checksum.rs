//! `kvtier bench checksum`: the payload checksum on one core beside the
//! physical limit, memcpy of the same bytes (each byte read once from
//! memory). Reports XXH3-128 (what blocks of format 2 carry), blake3 (what
//! format 1 carried) and the client's copy-and-verify pass, per block size,
//! as GB/s and CPU seconds per GB. Rounds interleave every function
//! (A B C A B C ...) and report medians.

use super::common::{compare, emit, gbps, median, noise, parse_size};
use anyhow::Result;
use clap::Args;
use kvtier_client::{BlockHeader, BlockKey, KvLayout, Namespace, PayloadSum};
use serde_json::{json, Map, Value};
use std::hint::black_box;
use std::time::Instant;

/// Arguments of `kvtier bench checksum`.
#[derive(Debug, Args)]
pub struct ChecksumArgs {
    /// Block sizes (comma-separated, e.g. 64KiB,2MiB).
    #[arg(long, value_delimiter = ',', value_parser = parse_size,
          default_value = "64KiB,256KiB,2MiB,16MiB")]
    pub sizes: Vec<u64>,
    /// Bytes hashed per function per round (the blocks are reused).
    #[arg(long, value_parser = parse_size, default_value = "512MiB")]
    pub bytes_per_round: u64,
    /// Rounds (medians reported).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// One JSON document on stdout.
    #[arg(long)]
    pub json: bool,
}

/// GB/s of `f` run over `block` until `total` bytes are done.
fn rate(block: &[u8], total: u64, mut f: impl FnMut(&[u8])) -> f64 {
    let n = (total / block.len() as u64).max(1);
    let t = Instant::now();
    for _ in 0..n {
        f(black_box(block));
    }
    gbps(n as usize * block.len(), t.elapsed().as_secs_f64())
}

/// Runs the benchmark.
pub fn run(a: ChecksumArgs) -> Result<()> {
    let mut sizes = Vec::new();
    for &size in &a.sizes {
        let len = size as usize;
        let src = noise(size, len);
        let mut dst = vec![0u8; len];
        let layout = KvLayout::with_block_bytes(size)?;
        let ns = Namespace::new("bench/checksum", layout, "", Vec::new())?;
        let header = BlockHeader::for_payload(&ns, BlockKey::from_digest([7; 32]), &src, 0);
        let (mut memcpy, mut xxh3, mut blake3, mut verify) = (vec![], vec![], vec![], vec![]);
        for _ in 0..a.rounds.max(1) {
            memcpy.push(rate(&src, a.bytes_per_round, |b| {
                dst.copy_from_slice(b);
                black_box(&dst);
            }));
            xxh3.push(rate(&src, a.bytes_per_round, |b| {
                black_box(PayloadSum::of(b));
            }));
            blake3.push(rate(&src, a.bytes_per_round, |b| {
                black_box(PayloadSum::blake3_of(b));
            }));
            let mut failed = false;
            verify.push(rate(&src, a.bytes_per_round, |b| {
                failed |= header.copy_verified(b, &mut dst).is_err();
            }));
            anyhow::ensure!(!failed, "copy_verified refused its own block");
        }
        let (m, x, b, v) = (
            median(&memcpy),
            median(&xxh3),
            median(&blake3),
            median(&verify),
        );
        let mut o = Map::new();
        o.insert("block_bytes".into(), json!(size));
        // The baseline is memcpy: reading every byte once from memory, the
        // floor a checksum at memory speed runs at.
        compare(&mut o, "xxh3_128_gbps", x, m);
        compare(&mut o, "blake3_gbps", b, m);
        // Copy and verify (the client's onboard from the shared region)
        // against a plain copy.
        compare(&mut o, "copy_verify_gbps", v, m);
        let cpu = |g: f64| if g > 0.0 { 1.0 / g } else { 0.0 };
        o.insert("xxh3_128_cpu_s_per_gb".into(), json!(cpu(x)));
        o.insert("blake3_cpu_s_per_gb".into(), json!(cpu(b)));
        o.insert("memcpy_cpu_s_per_gb".into(), json!(cpu(m)));
        o.insert("rounds".into(), json!(a.rounds.max(1)));
        sizes.push(Value::Object(o));
    }
    let report = json!({
        "bench": "checksum",
        "threads": 1,
        "sizes": sizes,
    });
    emit(&report, a.json)
}
