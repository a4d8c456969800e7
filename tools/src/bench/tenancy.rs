//! `kvtier bench tenancy`: is a lookup of another tenant's prefixes
//! distinguishable, by its latency, from a miss?
//!
//! Phase 1 (a single-tenant kvtierd): tenant B's and tenant A's chains are
//! stored. Phase 2 (the same store, restarted with `[[tenants]]`: this
//! process's uid is tenant A, and no admin): interleaved rounds of
//!   - `denied`: a lookup of one of B's stored chains (A may not use B's
//!     namespace);
//!   - `unknown`: a lookup of a chain in a namespace nobody ever stored
//!     (the baseline: a true miss);
//!   - `hit`: a lookup of one of A's own stored chains (the control: a
//!     difference the statistic must detect, so the bench has power).
//!
//! The statistics: Mann-Whitney U (two-sided, normal approximation, as z
//! and p) and the two-sample Kolmogorov-Smirnov D with its asymptotic p,
//! for denied vs unknown (want: no detectable difference) and hit vs
//! unknown (want: detected).

use super::common::{emit, median, percentile};
use anyhow::{bail, Context, Result};
use clap::Args;
use kvtier_client::{Client, ClientConfig, Hints, KvLayout, Namespace, OffloadOutcome};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Arguments of `kvtier bench tenancy`.
#[derive(Debug, Args)]
pub struct TenancyArgs {
    /// Chains stored per tenant (and lookups per kind).
    #[arg(long, default_value_t = 2000)]
    pub chains: usize,
    /// Blocks per chain.
    #[arg(long, default_value_t = 8)]
    pub chain_blocks: usize,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

const BLOCK_BYTES: u64 = 4096;
const TOKENS_PER_BLOCK: u32 = 16;

fn ns(tenant: &str) -> Result<Namespace> {
    Ok(Namespace::new(
        "bench-model",
        KvLayout::with_block_bytes(BLOCK_BYTES)?,
        "",
        format!("salt-{tenant}"),
    )?)
}

fn chain_tokens(tenant: u32, i: usize, blocks: usize) -> Vec<u32> {
    let base = tenant * 100_000_000 + (i as u32) * 1000;
    (base..base + TOKENS_PER_BLOCK * blocks as u32).collect()
}

struct Daemon {
    child: Child,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(dir: &Path, config: &str) -> Result<Daemon> {
    let conf = dir.join("kvtierd.toml");
    std::fs::write(&conf, config)?;
    let socket = dir.join("kvtierd.sock");
    let exe = std::env::current_exe()?;
    let local = exe.with_file_name("kvtierd");
    let bin = if local.exists() {
        local
    } else {
        PathBuf::from("kvtierd")
    };
    let child = Command::new(&bin)
        .arg("--config")
        .arg(&conf)
        .arg("--socket")
        .arg(&socket)
        .arg("--g3-dir")
        .arg(dir.join("g3"))
        .args(["--g3-capacity", "4GiB", "--metrics-addr", "", "--g4", ""])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let d = Daemon { child };
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        if t.elapsed() > Duration::from_secs(30) {
            bail!("kvtierd did not start within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(d)
}

/// Mann-Whitney U, two-sided: (z, p) by the normal approximation with the
/// tie correction.
pub fn mann_whitney(a: &[f64], b: &[f64]) -> (f64, f64) {
    let (n1, n2) = (a.len() as f64, b.len() as f64);
    let mut all: Vec<(f64, usize)> = a
        .iter()
        .map(|&x| (x, 0))
        .chain(b.iter().map(|&x| (x, 1)))
        .collect();
    all.sort_by(|x, y| x.0.total_cmp(&y.0));
    let n = all.len();
    let mut ranks = vec![0.0; n];
    let mut tie_term = 0.0;
    let mut i = 0;
    while i < n {
        let mut j = i;
        while j + 1 < n && all[j + 1].0 == all[i].0 {
            j += 1;
        }
        let r = (i + j) as f64 / 2.0 + 1.0;
        for rk in ranks.iter_mut().take(j + 1).skip(i) {
            *rk = r;
        }
        let t = (j - i + 1) as f64;
        tie_term += t * t * t - t;
        i = j + 1;
    }
    let r1: f64 = all
        .iter()
        .zip(&ranks)
        .filter(|((_, g), _)| *g == 0)
        .map(|(_, r)| r)
        .sum();
    let u1 = r1 - n1 * (n1 + 1.0) / 2.0;
    let mu = n1 * n2 / 2.0;
    let nt = n1 + n2;
    let sigma = (n1 * n2 / 12.0 * ((nt + 1.0) - tie_term / (nt * (nt - 1.0)))).sqrt();
    if sigma == 0.0 {
        return (0.0, 1.0);
    }
    let z = (u1 - mu) / sigma;
    (z, erfc(z.abs() / std::f64::consts::SQRT_2))
}

/// Two-sample Kolmogorov-Smirnov: (D, asymptotic p).
pub fn ks(a: &[f64], b: &[f64]) -> (f64, f64) {
    let mut x = a.to_vec();
    let mut y = b.to_vec();
    x.sort_by(f64::total_cmp);
    y.sort_by(f64::total_cmp);
    let (mut i, mut j, mut d) = (0usize, 0usize, 0.0f64);
    while i < x.len() && j < y.len() {
        let v = x[i].min(y[j]);
        while i < x.len() && x[i] <= v {
            i += 1;
        }
        while j < y.len() && y[j] <= v {
            j += 1;
        }
        d = d.max((i as f64 / x.len() as f64 - j as f64 / y.len() as f64).abs());
    }
    let ne = (x.len() * y.len()) as f64 / (x.len() + y.len()) as f64;
    let lambda = (ne.sqrt() + 0.12 + 0.11 / ne.sqrt()) * d;
    // Q_KS(lambda) = 2 sum (-1)^(k-1) exp(-2 k^2 lambda^2); the series does
    // not converge near 0, where Q is 1 (Q(0.3) = 1 - 1e-9).
    if lambda < 0.3 {
        return (d, 1.0);
    }
    let mut p = 0.0;
    for k in 1..=100 {
        let k = k as f64;
        let term = 2.0 * (-1f64).powf(k - 1.0) * (-2.0 * k * k * lambda * lambda).exp();
        p += term;
        if term.abs() < 1e-12 {
            break;
        }
    }
    (d, p.clamp(0.0, 1.0))
}

/// erfc by Numerical Recipes' Chebyshev fit (relative error < 1.2e-7).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t
        * (-z * z - 1.26551223
            + t * (1.00002368
                + t * (0.37409196
                    + t * (0.09678418
                        + t * (-0.18628806
                            + t * (0.27886807
                                + t * (-1.13520398
                                    + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
            .exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

fn summary(v: &[f64]) -> Value {
    json!({
        "n": v.len(),
        "median_us": median(v),
        "p90_us": percentile(v, 90.0),
        "p99_us": percentile(v, 99.0),
    })
}

fn compare(a: &[f64], b: &[f64]) -> Value {
    let (z, p) = mann_whitney(a, b);
    let (d, pk) = ks(a, b);
    json!({"mann_whitney_z": z, "mann_whitney_p": p, "ks_d": d, "ks_p": pk})
}

/// Runs the bench.
pub fn run(a: TenancyArgs) -> Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("kvtier-tenancy-")
        .tempdir()?;
    let (na, nb, nu) = (ns("a")?, ns("b")?, ns("nobody")?);
    let sock = dir.path().join("kvtierd.sock");
    {
        let _d = start(dir.path(), "")?;
        let c = Client::with_config(ClientConfig::new(&sock));
        let payload = vec![0x42u8; BLOCK_BYTES as usize];
        for (t, n) in [(1u32, &na), (2, &nb)] {
            let h = c.namespace(n);
            for i in 0..a.chains {
                let keys = h.hash_chain(&chain_tokens(t, i, a.chain_blocks));
                let p: Vec<&[u8]> = keys.iter().map(|_| &payload[..]).collect();
                let out = h.offload_chain(None, &keys, &p, Hints::default());
                if !out.iter().all(|o| matches!(o, OffloadOutcome::Stored)) {
                    bail!("seeding failed: {out:?}");
                }
            }
        }
    }
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let cfg = format!(
        "[[tenants]]\nname = \"a\"\nuids = [{me}]\nnamespaces = [\"{}\"]\n\n\
         [[tenants]]\nname = \"b\"\nuids = [4294967290]\nnamespaces = [\"{}\"]\n\n\
         [access]\nadmin_uids = []\n",
        na.id().to_hex(),
        nb.id().to_hex()
    );
    let _d = start(dir.path(), &cfg)?;
    let c = Client::with_config(ClientConfig::new(&sock));
    let (ha, hb, hu) = (c.namespace(&na), c.namespace(&nb), c.namespace(&nu));
    let chains = |t: u32, h: &kvtier_client::NsHandle<'_>| -> Vec<Vec<kvtier_client::BlockKey>> {
        (0..a.chains)
            .map(|i| h.hash_chain(&chain_tokens(t, i, a.chain_blocks)))
            .collect()
    };
    let (ca, cb, cu) = (chains(1, &ha), chains(2, &hb), chains(3, &hu));
    // Warm up: the connection, the index's pages.
    for i in 0..a.chains.min(200) {
        ha.lookup(&ca[i]);
        hb.lookup(&cb[i]);
        hu.lookup(&cu[i]);
    }
    let (mut denied, mut unknown, mut hit) = (Vec::new(), Vec::new(), Vec::new());
    let time = |f: &dyn Fn() -> usize, out: &mut Vec<f64>| -> usize {
        let t = Instant::now();
        let n = f();
        out.push(t.elapsed().as_secs_f64() * 1e6);
        n
    };
    for i in 0..a.chains {
        // Rotate the order so no kind always runs first.
        for k in 0..3 {
            match (i + k) % 3 {
                0 => {
                    let n = time(&|| hb.lookup(&cb[i]).prefix_len(), &mut denied);
                    if n != 0 {
                        bail!("tenant A saw {n} blocks of B's chain {i}");
                    }
                }
                1 => {
                    time(&|| hu.lookup(&cu[i]).prefix_len(), &mut unknown);
                }
                _ => {
                    let n = time(&|| ha.lookup(&ca[i]).prefix_len(), &mut hit);
                    if n != a.chain_blocks {
                        bail!("A's own chain {i}: {n} of {} blocks", a.chain_blocks);
                    }
                }
            }
        }
    }
    let mut out = Map::new();
    out.insert("bench".into(), json!("tenancy"));
    out.insert("chains".into(), json!(a.chains));
    out.insert("chain_blocks".into(), json!(a.chain_blocks));
    out.insert("denied_b_prefixes".into(), summary(&denied));
    out.insert("unknown_namespace_misses".into(), summary(&unknown));
    out.insert("own_hits".into(), summary(&hit));
    out.insert("denied_vs_unknown".into(), compare(&denied, &unknown));
    out.insert("hit_vs_unknown_control".into(), compare(&hit, &unknown));
    emit(&Value::Object(out), a.json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_statistics_tell_same_from_shifted() {
        let a: Vec<f64> = (0..500).map(|i| (i % 50) as f64).collect();
        let b: Vec<f64> = (0..500).map(|i| ((i * 7) % 50) as f64).collect();
        let c: Vec<f64> = a.iter().map(|x| x + 10.0).collect();
        assert!(mann_whitney(&a, &b).1 > 0.5);
        assert!(ks(&a, &b).1 > 0.5);
        assert!(mann_whitney(&a, &c).1 < 1e-6);
        assert!(ks(&a, &c).1 < 1e-6);
    }
}
