//! `kvtier bench ...`: every benchmark, each beside its baseline.

pub mod common;
pub mod replay;
pub mod gds;

use clap::Subcommand;

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCmd {
    /// Replay a Mooncake-format trace through an eviction policy (dry run).
    Replay(replay::ReplayArgs),
    /// Onboard block files into host, pinned or device memory (kvtier-gds).
    Gds(gds::GdsArgs),
}

/// Runs one benchmark.
pub fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::Replay(a) => replay::run(a),
        BenchCmd::Gds(a) => gds::run(a),
    }
}
