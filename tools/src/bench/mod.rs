//! `kvtier bench ...`: every benchmark, each beside its baseline.

pub mod common;

use clap::Subcommand;

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCmd {}

/// Runs one benchmark.
pub fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {}
}
