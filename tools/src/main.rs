//! `kvtier`: the command-line tool (hash, inspect, daemon operations, bench).

mod bench;
mod identity;
mod ops;
mod remove;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// kvtier: inspect and operate an LLM KV-cache storage tier.
#[derive(Debug, Parser)]
#[command(name = "kvtier", version, about)]
struct Cli {
    /// On an error, also print where it was raised (a backtrace). Errors
    /// always print their cause chain; RUST_BACKTRACE alone does not add a
    /// backtrace.
    #[arg(long, global = true)]
    backtrace: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Print the block keys of a token sequence, one per full block.
    Hash(identity::HashArgs),
    /// Print a block file's header and verify its payload (exit 1 if invalid).
    Inspect(identity::InspectArgs),
    /// Benchmarks, each measured beside a baseline in the same run.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// Daemon statistics (text; --json for JSON).
    Stats(ops::StatsArgs),
    /// List the blocks on this node's G3 (not those only in G4 or on peers).
    Ls(ops::LsArgs),
    /// One block's metadata.
    Stat(ops::StatArgs),
    /// Verify stored blocks on the daemon and repair bad ones from G4 or a
    /// peer (exit 1 if any was bad).
    Verify(ops::VerifyArgs),
    /// Delete blocks from G3 (default), G4 or both (--tier all).
    Evict(remove::EvictArgs),
    /// Follow the KV event stream (JSON lines).
    Events(ops::EventsArgs),
    /// Offload/lookup/onboard round trip (starts kvtierd if none runs).
    Demo(ops::DemoArgs),
}

fn main() {
    // anyhow captures a backtrace when RUST_BACKTRACE or RUST_LIB_BACKTRACE
    // is set, and `fn main() -> Result` prints it for every error, so a
    // developer machine with RUST_BACKTRACE=1 saw a stack dump for a missing
    // daemon. Capture only when asked with --backtrace.
    let asked = std::env::args_os().any(|a| a == "--backtrace");
    std::env::set_var("RUST_LIB_BACKTRACE", if asked { "1" } else { "0" });
    if let Err(e) = run() {
        if e.chain().any(|c| {
            c.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
        }) {
            // Its reader went away (`kvtier demo | head`), after the
            // demo's cleanup ran: end as a tool in a pipe ends, quietly.
            // SAFETY: restoring the default disposition and raising it.
            unsafe {
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
                libc::raise(libc::SIGPIPE);
            }
            std::process::exit(141);
        }
        eprintln!(
            "kvtier: {}",
            kvtier_daemon::base::error::cause_chain(e.as_ref())
        );
        if asked {
            eprintln!("\n{}", e.backtrace());
        }
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    // A CLI whose output is piped into `head` should end quietly on EPIPE,
    // as other Unix tools do, rather than panic in println!.
    // SAFETY: restoring a default signal disposition at start-up, before any
    // thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Hash(a) => identity::hash(a),
        Cmd::Inspect(a) => identity::inspect(a),
        Cmd::Bench(b) => bench::run(b),
        Cmd::Stats(a) => ops::stats(a),
        Cmd::Ls(a) => ops::ls(a),
        Cmd::Stat(a) => ops::stat(a),
        Cmd::Verify(a) => ops::verify(a),
        Cmd::Evict(a) => remove::evict(a),
        Cmd::Events(a) => ops::events(a),
        Cmd::Demo(a) => ops::demo(a),
    }
}
