//! `kvtier bench ...`: every benchmark, each beside its baseline.

pub mod common;
pub mod io;

use clap::Subcommand;

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCmd {
    /// End-to-end offload/onboard through kvtierd vs raw O_DIRECT.
    Io(io::IoArgs),
}

/// Runs one benchmark.
pub fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::Io(a) => io::run(a),
    }
}
