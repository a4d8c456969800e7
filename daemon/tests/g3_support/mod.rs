//! Helpers shared by the g3_* suites (included with `#[path]`).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]
#![allow(dead_code)]

use kvtier_client::{BlockKey, NamespaceId};
use kvtier_daemon::testkit::conformance::Damage;
use kvtier_daemon::tiers::g3::engine::EngineKind;
use kvtier_daemon::tiers::g3::{G3Config, G3Store};
use kvtier_daemon::tiers::policy::Lru;
use std::io::{Read, Seek, SeekFrom, Write};
use std::sync::Arc;

/// A store with a file per block (these suites test the file store; the
/// slot store has its own cases: `cfg_slots`).
pub fn cfg(root: &std::path::Path, engine: EngineKind) -> G3Config {
    let mut c = cfg_slots(root, engine);
    c.slot_file_bytes_max = 0;
    c
}

/// A store with blocks of up to the default `slot_file_bytes_max` in
/// slab slots (g3/slots.rs).
pub fn cfg_slots(root: &std::path::Path, engine: EngineKind) -> G3Config {
    let mut c = G3Config::new(root, 1 << 30);
    c.engine = engine;
    c.io_depth = 4;
    c.buffer_pool_bytes = 8 << 20;
    c
}

pub fn open(root: &std::path::Path, engine: EngineKind) -> Arc<G3Store> {
    G3Store::open(cfg(root, engine), Box::new(Lru::new())).expect("open g3")
}

/// Damages the block's bytes behind the store's back (its file, or its
/// slot in a slab: a truncation is then its last page zeroed).
pub fn damage(store: &G3Store, ns: &NamespaceId, key: &BlockKey, d: Damage) {
    let (p, at) = store.block_location(ns, key).expect("a held block");
    let len = store.stat(ns, key).expect("a held block").file_len;
    let slotted = p.extension().is_some_and(|e| e == "slab");
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .expect("open block file");
    match d {
        Damage::Header => flip(&mut f, at + 100),
        Damage::Payload => flip(&mut f, at + 4096 + 17),
        Damage::Truncate if slotted => {
            f.seek(SeekFrom::Start(at + len - 4096)).unwrap();
            f.write_all(&[0u8; 4096]).unwrap();
            f.sync_all().unwrap();
        }
        Damage::Truncate => {
            let len = f.metadata().unwrap().len();
            f.set_len(len - 4096).unwrap();
        }
    }
}

fn flip(f: &mut std::fs::File, at: u64) {
    let mut b = [0u8; 1];
    f.seek(SeekFrom::Start(at)).unwrap();
    f.read_exact(&mut b).unwrap();
    b[0] ^= 0x40;
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(&b).unwrap();
    f.sync_all().unwrap();
}

/// Files left in `root/tmp`.
pub fn temp_files(root: &std::path::Path) -> usize {
    std::fs::read_dir(root.join("tmp"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// After a power cut and recovery (the power-loss harnesses): nothing
/// quarantined (no torn data became visible), every file under
/// `blocks/` is a visible block and each visible block has one file, and
/// no temp file is left.
pub fn tree_matches_index(
    store: &G3Store,
    root: &std::path::Path,
    visible: &std::collections::HashSet<BlockKey>,
) -> Result<(), String> {
    let st = store.stats();
    if st.quarantined > 0 {
        return Err(format!(
            "{} block(s) quarantined: torn data became visible",
            st.quarantined
        ));
    }
    let files = block_files(&root.join("blocks"));
    // Slotted blocks have no file (g3/slots.rs): each takes a slot.
    let slots_used = store
        .recovery_figures()
        .iter()
        .find(|(k, _)| *k == "slots_used")
        .map_or(0, |(_, v)| *v) as usize;
    for f in &files {
        let key = f
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| BlockKey::from_hex(n).ok());
        if !key.is_some_and(|k| visible.contains(&k)) {
            return Err(format!("file {} is not in the index", f.display()));
        }
    }
    if files.len() + slots_used != visible.len() {
        return Err(format!(
            "{} files under blocks/ and {slots_used} slots used, {} blocks visible",
            files.len(),
            visible.len()
        ));
    }
    let tmp = temp_files(root);
    if tmp > 0 {
        return Err(format!("{tmp} temp files left after recovery"));
    }
    Ok(())
}

/// Every file under `dir`, recursively.
pub fn block_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(block_files(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// A tmpfs of `size` (e.g. `"6m"`) mounted on a temp dir, unmounted on
/// drop: a disk that fills up. Needs root.
pub struct SmallTmpfs {
    pub dir: tempfile::TempDir,
}

impl SmallTmpfs {
    /// `None` (after a visible SKIP line) when not root.
    pub fn mount(size: &str, test: &str) -> Option<Self> {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIP: {test}: mounting a small tmpfs needs root");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            dir.path(),
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some(format!("size={size}").as_str()),
        )
        .unwrap();
        Some(SmallTmpfs { dir })
    }

    pub fn path(&self) -> &std::path::Path {
        self.dir.path()
    }
}

impl Drop for SmallTmpfs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(self.dir.path(), nix::mount::MntFlags::MNT_DETACH);
    }
}

/// A small ext4 filesystem on a loop device (an image file, `mkfs.ext4 -m
/// 0`: no blocks reserved for root, so filling it fills it), unmounted on
/// drop: the filesystem the full-disk findings were made on, with
/// O_DIRECT, delayed allocation and a journal, which tmpfs has not.
pub struct SmallExt4 {
    pub dir: tempfile::TempDir,
    _image: tempfile::TempDir,
}

impl SmallExt4 {
    /// `None` (after a visible SKIP line) when not root or no loop device
    /// can be set up here.
    pub fn mount(size_mib: u64, test: &str) -> Option<Self> {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIP: {test}: a loop-mounted ext4 needs root");
            return None;
        }
        let image = tempfile::tempdir().unwrap();
        let img = image.path().join("fs.img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(size_mib << 20)
            .unwrap();
        let mkfs = std::process::Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0"])
            .arg(&img)
            .status();
        if !mkfs.is_ok_and(|s| s.success()) {
            eprintln!("SKIP: {test}: mkfs.ext4 failed or is missing (e2fsprogs)");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-o", "loop"])
            .arg(&img)
            .arg(dir.path())
            .status();
        if !mounted.is_ok_and(|s| s.success()) {
            eprintln!("SKIP: {test}: no loop device here (mount -o loop failed)");
            return None;
        }
        let fs = SmallExt4 { dir, _image: image };
        let kind = nix::sys::statfs::statfs(fs.path())
            .unwrap()
            .filesystem_type();
        assert_eq!(kind, nix::sys::statfs::EXT4_SUPER_MAGIC, "{test}: not ext4");
        Some(fs)
    }

    pub fn path(&self) -> &std::path::Path {
        self.dir.path()
    }
}

impl Drop for SmallExt4 {
    fn drop(&mut self) {
        // The loop device goes with the last unmount (mount -o loop sets
        // it to clear itself).
        let _ = nix::mount::umount2(self.dir.path(), nix::mount::MntFlags::MNT_DETACH);
    }
}

/// What the directories under `blocks/` for these keys of one namespace
/// are charged against capacity (g3/dir_set.rs: 4 KiB for the namespace
/// and per shard directory): tests that size capacity in blocks add it.
pub fn dir_bytes(keys: impl IntoIterator<Item = BlockKey>) -> u64 {
    let shards: std::collections::HashSet<String> = keys.into_iter().map(|k| k.shard()).collect();
    (shards.len() as u64 + u64::from(!shards.is_empty())) * 4096
}
