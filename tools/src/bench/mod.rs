//! `kvtier bench ...`: every benchmark, each beside its baseline.

pub mod checksum;
pub mod common;
pub mod crossnode;
pub mod fs;
pub mod g3;
pub mod g4;
pub mod gds;
pub mod io;
pub mod peers;
pub mod prefetch;
pub mod replay;
pub mod replay_daemon;
pub mod replay_suite;
pub mod scale;
pub mod tenancy;

use clap::Subcommand;

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCmd {
    /// Replay a Mooncake-format trace through an eviction policy (dry run;
    /// with --block-size also through a real kvtierd).
    Replay(replay::ReplayArgs),
    /// The payload checksum (XXH3-128, and blake3 of old blocks) on one
    /// core beside memcpy of the same bytes.
    Checksum(checksum::ChecksumArgs),
    /// Onboard block files into host, pinned or device memory (kvtier-gds).
    Gds(gds::GdsArgs),
    /// G4 tier put/get vs raw object_store on the same store.
    G4(g4::G4Args),
    /// G3 (local NVMe tier) against raw O_DIRECT I/O; prefix lookup; recovery.
    G3(g3::G3Args),
    /// End-to-end offload/onboard through kvtierd vs raw O_DIRECT.
    Io(io::IoArgs),
    /// Cross-node onboard (peer fetch, G4 only) through three kvtierd vs raw TCP.
    Crossnode(crossnode::CrossnodeArgs),
    /// Cold reads through the FUSE mount vs the G3 files read directly.
    Fs(fs::FsArgs),
    /// Foreground onboards with and without a background prefetch beside
    /// them (two kvtierd on a real S3 server).
    Prefetch(prefetch::PrefetchArgs),
    /// A model of a fleet (64 nodes x 8 GPUs by default) on the Mooncake
    /// trace: G4, discovery, peer and router-event load.
    Scale(scale::ScaleArgs),
    /// Tenant A's lookups of tenant B's prefixes vs misses (timing side
    /// channel; Mann-Whitney and Kolmogorov-Smirnov on latency samples).
    Tenancy(tenancy::TenancyArgs),
    /// kvtier (client -> kvtierd -> G3) beside foyer's hybrid cache and
    /// Mooncake Store on the same blocks and disk: put/get GB/s, p50/p99,
    /// acknowledged blocks lost across a restart.
    Peers(peers::PeersArgs),
}

/// Runs one benchmark.
pub fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::Replay(a) => replay::run(a),
        BenchCmd::Checksum(a) => checksum::run(a),
        BenchCmd::Gds(a) => gds::run(a),
        BenchCmd::G4(a) => g4::run(a),
        BenchCmd::G3(a) => g3::run(a),
        BenchCmd::Io(a) => io::run(a),
        BenchCmd::Crossnode(a) => crossnode::run(a),
        BenchCmd::Fs(a) => fs::run(a),
        BenchCmd::Tenancy(a) => tenancy::run(a),
        BenchCmd::Prefetch(a) => prefetch::run(a),
        BenchCmd::Scale(a) => scale::run(a),
        BenchCmd::Peers(a) => peers::run(a),
    }
}
