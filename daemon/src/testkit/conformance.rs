//! The tier conformance suite: written once over `&dyn BlockTier`, run
//! against every backend (G3 with each I/O engine, G4 on memory, file and a
//! real S3 server). Backend differences are flags in [`Caps`], not copies.
//!
//! Checks return `Err(description)` instead of panicking so that this module
//! can live in the library (integration tests of several crates call it).

use crate::base::tier::{BlockTier, Lookup, MissReason, PutOutcome};
use kvtier_client::{BlockHeader, BlockKey, KvLayout, Namespace, NamespaceId};

/// Which part of a stored block a corruption hook should damage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Damage {
    /// Flip a byte inside the 4096-byte header.
    Header,
    /// Flip a byte inside the payload.
    Payload,
    /// Cut the stored block short.
    Truncate,
}

/// A backend's hook that damages a stored block behind the tier's back.
pub type CorruptFn<'a> = &'a dyn Fn(&NamespaceId, &BlockKey, Damage);

/// What a backend can do beyond the trait contract.
pub struct Caps<'a> {
    /// Damages a stored block in place (on disk, in the bucket).
    pub corrupt: Option<CorruptFn<'a>>,
    /// Payload size used by the suite (a multiple of 32).
    pub block_bytes: u64,
}

/// A namespace whose blocks are `block_bytes` long, distinguished by `salt`.
pub fn namespace(block_bytes: u64, salt: &str) -> Result<Namespace, String> {
    let layout = KvLayout::with_block_bytes(block_bytes).map_err(|e| e.to_string())?;
    Namespace::new("conformance-model", layout, "", salt.as_bytes().to_vec())
        .map_err(|e| e.to_string())
}

/// A deterministic payload derived from `seed`.
pub fn payload(len: u64, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A block (key from a one-block chain over `seed`) ready to put.
pub fn block(ns: &Namespace, seed: u64) -> (BlockKey, BlockHeader, Vec<u8>) {
    let tokens: Vec<u32> = (0..ns.layout.tokens_per_block)
        .map(|i| (seed as u32).wrapping_mul(31).wrapping_add(i))
        .collect();
    let key = ns.hash_chain(&tokens)[0];
    let p = payload(ns.layout.block_bytes(), seed);
    let h = BlockHeader::for_payload(ns, key, &p, 1_700_000_000_000 + seed);
    (key, h, p)
}

fn err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// Runs every check; the first failure is returned.
pub fn run_all(tier: &dyn BlockTier, caps: &Caps<'_>) -> Result<(), String> {
    put_get_round_trip(tier, caps)?;
    put_is_create_once(tier, caps)?;
    absent_is_a_miss(tier, caps)?;
    delete_removes(tier, caps)?;
    namespaces_are_isolated(tier, caps)?;
    if caps.corrupt.is_some() {
        for d in [Damage::Header, Damage::Payload, Damage::Truncate] {
            corruption_is_a_miss(tier, caps, d)?;
        }
    }
    Ok(())
}

/// A stored block reads back byte-identical with its header.
pub fn put_get_round_trip(tier: &dyn BlockTier, caps: &Caps<'_>) -> Result<(), String> {
    let ns = namespace(caps.block_bytes, "round-trip")?;
    let id = ns.id();
    for seed in 0..4 {
        let (key, h, p) = block(&ns, seed);
        let out = tier.put(&id, &h, &p).map_err(err("put"))?;
        if out != PutOutcome::Stored {
            return Err(format!("first put of {key} returned {out:?}"));
        }
        if !tier.contains(&id, &key).map_err(err("contains"))? {
            return Err(format!("{key} not contained after put"));
        }
        match tier.get(&id, &key).map_err(err("get"))? {
            Lookup::Hit(b) if b.payload == p && b.header == h => {}
            Lookup::Hit(_) => return Err(format!("{key} read back different bytes")),
            Lookup::Miss(r) => return Err(format!("{key} missed after put: {r:?}")),
        }
    }
    Ok(())
}

/// A second put of the same key writes nothing and reports it.
pub fn put_is_create_once(tier: &dyn BlockTier, caps: &Caps<'_>) -> Result<(), String> {
    let ns = namespace(caps.block_bytes, "create-once")?;
    let (key, h, p) = block(&ns, 77);
    tier.put(&ns.id(), &h, &p).map_err(err("put"))?;
    let again = tier.put(&ns.id(), &h, &p).map_err(err("second put"))?;
    if again != PutOutcome::AlreadyPresent {
        return Err(format!("second put of {key} returned {again:?}"));
    }
    Ok(())
}

/// A key never stored is a miss, not an error.
pub fn absent_is_a_miss(tier: &dyn BlockTier, caps: &Caps<'_>) -> Result<(), String> {
    let ns = namespace(caps.block_bytes, "absent")?;
    let (key, _, _) = block(&ns, 4242);
    match tier.get(&ns.id(), &key).map_err(err("get"))? {
        Lookup::Miss(MissReason::Absent) => {}
        other => return Err(format!("absent key gave {other:?}")),
    }
    if tier.contains(&ns.id(), &key).map_err(err("contains"))? {
        return Err("absent key reported as contained".into());
    }
    Ok(())
}

/// Delete makes a block absent; deleting again reports false.
pub fn delete_removes(tier: &dyn BlockTier, caps: &Caps<'_>) -> Result<(), String> {
    let ns = namespace(caps.block_bytes, "delete")?;
    let (key, h, p) = block(&ns, 5);
    tier.put(&ns.id(), &h, &p).map_err(err("put"))?;
    if !tier.delete(&ns.id(), &key).map_err(err("delete"))? {
        return Err("delete of a stored block returned false".into());
    }
    if tier
        .get(&ns.id(), &key)
        .map_err(err("get"))?
        .hit()
        .is_some()
    {
        return Err("deleted block still served".into());
    }
    if tier.delete(&ns.id(), &key).map_err(err("delete again"))? {
        return Err("second delete returned true".into());
    }
    Ok(())
}

/// The same key in another namespace is another block.
pub fn namespaces_are_isolated(tier: &dyn BlockTier, caps: &Caps<'_>) -> Result<(), String> {
    let a = namespace(caps.block_bytes, "tenant-a")?;
    let b = namespace(caps.block_bytes, "tenant-b")?;
    let (key, h, p) = block(&a, 9);
    tier.put(&a.id(), &h, &p).map_err(err("put"))?;
    if tier.contains(&b.id(), &key).map_err(err("contains"))? {
        return Err("a block leaked into another namespace".into());
    }
    Ok(())
}

/// A block damaged behind the tier's back is a miss, never wrong bytes.
pub fn corruption_is_a_miss(
    tier: &dyn BlockTier,
    caps: &Caps<'_>,
    damage: Damage,
) -> Result<(), String> {
    let Some(corrupt) = caps.corrupt else {
        return Ok(());
    };
    let ns = namespace(caps.block_bytes, &format!("corrupt-{damage:?}"))?;
    let (key, h, p) = block(&ns, 11);
    tier.put(&ns.id(), &h, &p).map_err(err("put"))?;
    corrupt(&ns.id(), &key, damage);
    match tier.get(&ns.id(), &key).map_err(err("get after damage"))? {
        Lookup::Miss(_) => Ok(()),
        Lookup::Hit(b) if b.payload == p => Err(format!(
            "{damage:?} damage went unnoticed (bytes happened to match?)"
        )),
        Lookup::Hit(_) => Err(format!("{damage:?} damage served wrong bytes")),
    }
}
