//! `kvtier bench ...`: every benchmark, each beside its baseline.

pub mod common;
pub mod g4;

use clap::Subcommand;

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCmd {
    /// G4 tier put/get vs raw object_store on the same store.
    G4(g4::G4Args),
}

/// Runs one benchmark.
pub fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::G4(a) => g4::run(a),
    }
}
