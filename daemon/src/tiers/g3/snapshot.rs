//! A compact image of the in-memory index, written at a clean close beside
//! the clean marker and loaded at the next open instead of iterating redb
//! (1M redb records are ~650 MB and take seconds to walk; their image is
//! 52 MB read in one pass).
//!
//! Format: `MAGIC` (8 bytes), generation (u64 LE), count (u64 LE), then
//! `count` entries of `ENTRY_BYTES` (namespace, id, check, file pages,
//! hits, last access, pin, priority, flags, slot), then the chain links (chains.rs): a
//! count (u64 LE) and that many (child id, parent id) pairs of u64 LE,
//! then the blake3 of everything before.
//! A snapshot is used only when its generation matches the index's and its
//! checksum verifies; anything else falls back to redb.

use super::index::{Entry, MemIndex};
use kvtier_client::NamespaceId;
use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};

/// File name under the store's root.
pub const SNAPSHOT_FILE: &str = "index.snap";
// 2: ids are xxh3 digests (index format 2); 3: chain links follow the
// entries; 4: each entry ends with its slot (slots.rs). An older image is
// ignored (redb is read instead).
const MAGIC: &[u8; 8] = b"KVG3SNP4";
const ENTRY_BYTES: usize = 16 + 8 + 8 + 4 * 4 + 2 + 4;

/// Writes the image of `mem` for `generation` durably (the caller fsyncs
/// the directory after renaming the marker).
/// `blocks` names every block (namespace, id) to write; their entries come
/// from `mem`.
pub fn write(
    fs: &dyn super::seam::G3Fs,
    root: &Path,
    generation: u64,
    blocks: &[(NamespaceId, u64)],
    mem: &MemIndex,
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(24 + blocks.len() * ENTRY_BYTES + 32);
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&generation.to_le_bytes());
    let count_at = buf.len();
    buf.extend_from_slice(&0u64.to_le_bytes());
    let mut count = 0u64;
    for (ns, id) in blocks {
        let Some(e) = mem.map.get(id) else { continue };
        buf.extend_from_slice(&ns.0);
        buf.extend_from_slice(&id.to_le_bytes());
        buf.extend_from_slice(&e.check.to_le_bytes());
        buf.extend_from_slice(&e.file_pages.to_le_bytes());
        buf.extend_from_slice(&e.hits.load(Ordering::Relaxed).to_le_bytes());
        buf.extend_from_slice(&e.last_access_s.load(Ordering::Relaxed).to_le_bytes());
        buf.extend_from_slice(&e.pin_until_s.to_le_bytes());
        buf.push(e.priority);
        buf.push(e.flags);
        buf.extend_from_slice(&e.slot.to_le_bytes());
        count += 1;
    }
    buf[count_at..count_at + 8].copy_from_slice(&count.to_le_bytes());
    let links: Vec<(u64, u64)> = mem.chains.links().collect();
    buf.extend_from_slice(&(links.len() as u64).to_le_bytes());
    for (child, parent) in links {
        buf.extend_from_slice(&child.to_le_bytes());
        buf.extend_from_slice(&parent.to_le_bytes());
    }
    let sum = blake3::hash(&buf);
    buf.extend_from_slice(sum.as_bytes());
    let tmp = root.join(format!("{SNAPSHOT_FILE}.tmp"));
    fs.write_synced(&tmp, &buf, super::seam::SyncSite::SnapshotFileSync)?;
    fs.rename(&tmp, &root.join(SNAPSHOT_FILE))
}

/// One loaded entry: namespace, id, entry.
pub type Loaded = (NamespaceId, u64, Entry);

/// A loaded image: its entries and its (child, parent) links.
pub type Image = (Vec<Loaded>, Vec<(u64, u64)>);

/// Loads the image written for `generation`, or `None` when it is absent,
/// for another generation, or does not verify.
pub fn load(root: &Path, generation: u64) -> Option<Image> {
    let mut f = std::fs::File::open(root.join(SNAPSHOT_FILE)).ok()?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf).ok()?;
    if buf.len() < 24 + 32 || &buf[..8] != MAGIC {
        return None;
    }
    let (body, sum) = buf.split_at(buf.len() - 32);
    if blake3::hash(body).as_bytes() != sum {
        return None;
    }
    let u64_at = |b: &[u8], o: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[o..o + 8]);
        u64::from_le_bytes(a)
    };
    let u32_at = |b: &[u8], o: usize| {
        let mut a = [0u8; 4];
        a.copy_from_slice(&b[o..o + 4]);
        u32::from_le_bytes(a)
    };
    if u64_at(body, 8) != generation {
        return None;
    }
    let count = u64_at(body, 16) as usize;
    let entries_len = count.checked_mul(ENTRY_BYTES)?;
    let entries = body.get(24..24usize.checked_add(entries_len)?)?;
    let rest = &body[24 + entries_len..];
    let link_count = usize::try_from(u64_at(rest.get(..8)?, 0)).ok()?;
    let pairs = &rest[8..];
    if pairs.len() != link_count.checked_mul(16)? {
        return None;
    }
    let links = pairs
        .chunks_exact(16)
        .map(|c| (u64_at(c, 0), u64_at(c, 8)))
        .collect();
    let mut out = Vec::with_capacity(count);
    for c in entries.chunks_exact(ENTRY_BYTES) {
        let mut ns = [0u8; 16];
        ns.copy_from_slice(&c[..16]);
        out.push((
            NamespaceId(ns),
            u64_at(c, 16),
            Entry {
                check: u64_at(c, 24),
                file_pages: u32_at(c, 32),
                hits: AtomicU32::new(u32_at(c, 36)),
                last_access_s: AtomicU32::new(u32_at(c, 40)),
                pin_until_s: u32_at(c, 44),
                leases: 0,
                priority: c[48],
                flags: c[49],
                slot: u32_at(c, 50),
            },
        ));
    }
    Some((out, links))
}
