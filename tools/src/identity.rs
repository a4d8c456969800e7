//! `kvtier hash` and `kvtier inspect`.

use anyhow::{bail, Context, Result};
use kvtier_client::{block, BlockKey, HashMode, KvLayout, Namespace, DYNAMO_SCHEME};
use std::path::PathBuf;

/// Arguments of `kvtier hash`.
#[derive(Debug, clap::Args)]
pub struct HashArgs {
    /// `blake3` (default, 256-bit, bound to the namespace) or `dynamo`
    /// (NVIDIA Dynamo's 64-bit sequence hashes, from Dynamo's own
    /// dynamo-kv-hashing crate at the pinned version).
    #[arg(long, default_value = "blake3", value_parser = ["blake3", "dynamo"])]
    mode: String,
    /// Tenant salt (Dynamo's salt in dynamo mode; empty means none). May
    /// start with `-` (`--salt -x`).
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    salt: String,
    /// Dynamo's LoRA name (dynamo mode only; empty means none). In a
    /// namespace it is the adapter id. May start with `-`.
    #[arg(long, allow_hyphen_values = true)]
    lora: Option<String>,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_tokens: u32,
    /// Comma-separated token ids; empty (`--tokens ""`) is zero blocks, as
    /// in Dynamo.
    #[arg(long, required = true, value_parser = parse_tokens)]
    tokens: Tokens,
    /// Key of the block before the first token (hex): the chain continues
    /// after it, as when the parent's prefix and these tokens are hashed as
    /// one list.
    #[arg(long, value_parser = parse_key)]
    parent: Option<BlockKey>,
    /// Model id (blake3 mode: part of the namespace).
    #[arg(long, default_value = "default")]
    model: String,
    /// Print JSON instead of one key per line (dynamo mode adds each block's
    /// tokens_hash, the router's LocalBlockHash).
    #[arg(long)]
    json: bool,
}

/// `--tokens`: comma-separated u32s, possibly none.
#[derive(Debug, Clone)]
struct Tokens(Vec<u32>);

fn parse_tokens(s: &str) -> std::result::Result<Tokens, String> {
    if s.trim().is_empty() {
        return Ok(Tokens(Vec::new()));
    }
    s.split(',')
        .map(|t| {
            t.trim()
                .parse::<u32>()
                .map_err(|e| format!("token {t:?}: {e} (token ids are 0..=4294967295)"))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map(Tokens)
}

fn parse_key(s: &str) -> std::result::Result<BlockKey, String> {
    BlockKey::from_hex(s).map_err(|e| e.to_string())
}

/// Prints one lowercase hex key per full block.
pub fn hash(a: HashArgs) -> Result<()> {
    let tokens = a.tokens.0;
    if a.block_tokens == 0 {
        bail!("--block-tokens must be at least 1");
    }
    let mode = HashMode::parse(&a.mode).unwrap_or_default();
    if a.lora.is_some() && mode != HashMode::Dynamo {
        bail!("--lora is Dynamo's LoRA name and only applies with --mode dynamo");
    }
    let ns = Namespace::new(
        a.model,
        KvLayout::llama3_8b(a.block_tokens),
        a.lora.unwrap_or_default(),
        a.salt.into_bytes(),
    )?
    .with_hash_mode(mode)?;
    if mode == HashMode::Dynamo {
        let blocks = ns.dynamo_blocks_after(a.parent, &tokens)?;
        if a.json {
            let list: Vec<_> = blocks
                .iter()
                .map(|b| {
                    serde_json::json!({
                        "sequence_hash": format!("{:016x}", b.sequence_hash),
                        "sequence_hash_u64": b.sequence_hash,
                        "tokens_hash": b.tokens_hash,
                    })
                })
                .collect();
            println!(
                "{}",
                serde_json::json!({ "mode": a.mode, "scheme": DYNAMO_SCHEME, "blocks": list })
            );
        } else {
            for b in blocks {
                println!("{:016x}", b.sequence_hash);
            }
        }
        return Ok(());
    }
    let keys: Vec<String> = ns
        .hash_chain_after(a.parent, &tokens)?
        .iter()
        .map(|k| k.to_hex())
        .collect();
    if a.json {
        println!("{}", serde_json::json!({ "mode": a.mode, "keys": keys }));
    } else {
        for k in keys {
            println!("{k}");
        }
    }
    Ok(())
}

/// Arguments of `kvtier inspect`.
#[derive(Debug, clap::Args)]
pub struct InspectArgs {
    /// A block file (on G3, in the mount, or anywhere).
    file: PathBuf,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Prints the header and verifies the payload.
pub fn inspect(a: InspectArgs) -> Result<()> {
    let bytes = std::fs::read(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
    let h = match block::decode_block(&bytes) {
        Ok((h, _)) => h,
        Err(e) => {
            // --json answers for an invalid block too (it printed nothing),
            // so a script reads one document either way; exit 1 as before.
            if a.json {
                let fault = match &e {
                    kvtier_client::Error::Format { fault, .. } => Some(format!("{fault:?}")),
                    _ => None,
                };
                println!(
                    "{}",
                    serde_json::json!({
                        "file": a.file.display().to_string(),
                        "valid": false,
                        "fault": fault,
                        "error": e.to_string(),
                    })
                );
            } else {
                eprintln!("{}: INVALID: {e}", a.file.display());
            }
            std::process::exit(1);
        }
    };
    let v = serde_json::json!({
        "file": a.file.display().to_string(),
        "valid": true,
        "namespace": h.namespace_id().to_hex(),
        "namespace_digest": hex::encode(h.namespace_digest),
        "key": h.key.to_hex(),
        "layout": {
            "layers": h.layout.layers, "kv_heads": h.layout.kv_heads,
            "head_dim": h.layout.head_dim, "tokens_per_block": h.layout.tokens_per_block,
            "dtype": format!("{:?}", h.layout.dtype), "kind": format!("{:?}", h.layout.kind),
        },
        "payload_len": h.payload_len,
        "checksum_algo": h.payload_sum.algo().name(),
        "checksum": h.payload_sum.to_hex(),
        "format_version": h.format_version(),
        "created_unix_ms": h.created_unix_ms,
    });
    if a.json {
        println!("{v}");
    } else {
        println!("{}: valid kvtier block", a.file.display());
        println!("  namespace      {}", h.namespace_id());
        println!("  key            {}", h.key);
        println!("  layout         {:?}", h.layout);
        println!("  payload_len    {}", h.payload_len);
        println!("  format         {}", h.format_version());
        println!("  checksum       {:?}", h.payload_sum);
        println!("  created_ms     {}", h.created_unix_ms);
    }
    Ok(())
}
