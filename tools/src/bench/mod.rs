//! `kvtier bench ...`: every benchmark, each beside its baseline.

pub mod common;
pub mod gds;

use clap::Subcommand;

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCmd {
    /// Onboard block files into host, pinned or device memory (kvtier-gds).
    Gds(gds::GdsArgs),
}

/// Runs one benchmark.
pub fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::Gds(a) => gds::run(a),
    }
}
