//! `kvtier evict KEY... [--namespace NS] [--tier g3|g4|all]`: deletes
//! blocks from this node's disk (G3, the default), the shared object store
//! (G4) or both. A leased or pinned block is refused (exit 1).

use crate::ops::{parse_ns, parse_qualified, JsonArg, SocketArg};
use anyhow::{bail, Result};
use clap::Args;
use kvtier_client::proto::{EvictTier, ItemStatus};
use kvtier_client::{BlockKey, NamespaceId};

/// `kvtier evict`.
#[derive(Debug, Args)]
pub struct EvictArgs {
    #[command(flatten)]
    sock: SocketArg,
    /// Namespace of bare `KEY`s (32 hex digits).
    #[arg(long)]
    namespace: Option<String>,
    /// Where to delete from: `g3` (this node's disk; G4 keeps its copy and
    /// serves the next onboard), `g4` (the shared store only) or `all`.
    #[arg(long, default_value = "g3", value_parser = ["g3", "g4", "all"])]
    tier: String,
    /// Blocks: `KEY` (with --namespace), `NAMESPACE/KEY` or a mount path
    /// tail `NAMESPACE/SHARD/KEY`.
    #[arg(required = true)]
    keys: Vec<String>,
    #[command(flatten)]
    out: JsonArg,
}

/// Evicts the blocks; one line per block (`evicted`, `absent`, `busy`).
pub fn evict(a: EvictArgs) -> Result<()> {
    let tier: EvictTier = a.tier.parse()?;
    let default_ns = a.namespace.as_deref().map(parse_ns).transpose()?;
    let mut targets: Vec<(NamespaceId, BlockKey)> = Vec::new();
    for k in &a.keys {
        match parse_qualified(k)? {
            (Some(n), key) => targets.push((n, key)),
            (None, key) => match default_ns {
                Some(n) => targets.push((n, key)),
                None => bail!("{k}: give NAMESPACE/KEY or --namespace"),
            },
        }
    }
    let c = a.sock.client()?;
    let (mut busy, mut failed) = (0u64, 0u64);
    let mut rows = Vec::new();
    for (ns, key) in targets {
        let st = c
            .evict_ids(ns, &[key], tier)?
            .pop()
            .unwrap_or(ItemStatus::Failed);
        let word = match st {
            ItemStatus::Ok => "evicted",
            ItemStatus::Absent => "absent",
            ItemStatus::LimitReached => {
                busy += 1;
                "busy (leased or pinned; kept everywhere)"
            }
            other => {
                failed += 1;
                match other {
                    ItemStatus::Unavailable => "failed (G4 unreachable)",
                    ItemStatus::Timeout => "failed (G4 did not answer in time)",
                    _ => "failed",
                }
            }
        };
        let path = kvtier_client::block_path(&ns, &key);
        if a.out.json {
            rows.push(serde_json::json!({ "path": path, "tier": tier.name(), "result": word }));
        } else {
            println!("{word}\t{path}\ttier={}", tier.name());
        }
    }
    if a.out.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    }
    if busy + failed > 0 {
        bail!("{busy} blocks busy, {failed} failed");
    }
    Ok(())
}
