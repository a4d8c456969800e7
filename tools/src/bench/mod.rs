//! `kvtier bench ...`: every benchmark, each beside its baseline.

pub mod common;
pub mod g3;

use clap::Subcommand;

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCmd {
    /// G3 (local NVMe tier) against raw O_DIRECT I/O; prefix lookup; recovery.
    G3(g3::G3Args),
}

/// Runs one benchmark.
pub fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::G3(a) => g3::run(a),
    }
}
