#![allow(clippy::unwrap_used, clippy::expect_used)]
//! G3: the index and the files agree after any failure. A failed index
//! commit undoes its renames, an orphan file never turns an offload into
//! an AlreadyPresent that lookups contradict, a damaged `index.redb` is
//! rebuilt from the files, and stray files under `blocks/` are set aside,
//! never a refusal to start.

#[path = "g3_support/mod.rs"]
mod common;

use kvtier_daemon::base::tier::{Lookup, PutOutcome};
use kvtier_daemon::testkit::conformance::{block, namespace};
use kvtier_daemon::tiers::g3::engine::EngineKind;
use kvtier_daemon::tiers::g3::{PutItem, PutMeta};

fn read_hits(
    s: &kvtier_daemon::tiers::g3::G3Store,
    ns: &kvtier_client::NamespaceId,
    key: &kvtier_client::BlockKey,
    len: u64,
) -> bool {
    let mut dst = vec![0u8; len as usize];
    matches!(s.read_into(ns, key, &mut dst).unwrap(), Lookup::Hit(_))
}

#[test]
fn failed_index_commit_undoes_its_renames() {
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace(65536, "undo").unwrap();
    let id = ns.id();
    let blocks: Vec<_> = (1..=3).map(|i| block(&ns, i)).collect();
    {
        let s = common::open(dir.path(), EngineKind::Auto);
        // Single put.
        s.fault_fail_index_commits(1);
        let (k0, h0, p0) = &blocks[0];
        assert!(s.put_block(&id, h0, p0, PutMeta::default()).is_err());
        assert!(
            !s.block_file_path(&id, k0).exists(),
            "the rename was not undone"
        );
        assert!(s.stat(&id, k0).is_none());
        // The retry stores it (not AlreadyPresent off an orphan file).
        assert_eq!(
            s.put_block(&id, h0, p0, PutMeta::default()).unwrap(),
            PutOutcome::Stored
        );
        // A batch.
        s.fault_fail_index_commits(1);
        let items: Vec<PutItem<'_>> = blocks[1..]
            .iter()
            .map(|(_, h, p)| PutItem {
                header: h,
                payload: p,
                meta: PutMeta::default(),
            })
            .collect();
        assert!(s.put_blocks(&id, &items).iter().all(|r| r.is_err()));
        for (k, _, _) in &blocks[1..] {
            assert!(!s.block_file_path(&id, k).exists());
        }
        let again = s.put_blocks(&id, &items);
        assert!(
            again.iter().all(|r| matches!(r, Ok(PutOutcome::Stored))),
            "{again:?}"
        );
        assert_eq!(s.stats().renames_undone, 3);
        s.close().unwrap();
    }
    // After a clean restart every acked block is there, and nothing else.
    let s = common::open(dir.path(), EngineKind::Auto);
    for (k, h, _) in &blocks {
        assert!(s.stat(&id, k).is_some());
        assert!(read_hits(&s, &id, k, h.file_len()));
    }
    assert_eq!(s.stats().blocks, 3);
}

#[test]
fn an_orphan_block_file_is_replaced_and_indexed_not_answered_present() {
    let dir = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    let ns = namespace(65536, "orphan").unwrap();
    let id = ns.id();
    let (k, h, p) = block(&ns, 7);
    // A verified file for the key, but no index entry: what a crash
    // between rename and commit (before this fix: a failed commit) leaves.
    let donor = common::open(other.path(), EngineKind::Auto);
    donor.put_block(&id, &h, &p, PutMeta::default()).unwrap();
    let s = common::open(dir.path(), EngineKind::Auto);
    // A first put creates the shard directories; then plant the orphan of
    // another key in them.
    let (k2, h2, p2) = block(&ns, 8);
    donor.put_block(&id, &h2, &p2, PutMeta::default()).unwrap();
    s.put_block(&id, &h, &p, PutMeta::default()).unwrap();
    let to = s.block_file_path(&id, &k2);
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    std::fs::copy(donor.block_file_path(&id, &k2), &to).unwrap();
    assert!(s.stat(&id, &k2).is_none());
    assert_eq!(
        s.put_block(&id, &h2, &p2, PutMeta::default()).unwrap(),
        PutOutcome::Stored,
        "an offload acked off a file that lookups cannot see"
    );
    assert!(s.stat(&id, &k2).is_some());
    assert!(read_hits(&s, &id, &k2, h2.file_len()));
    assert_eq!(s.stats().orphans_replaced, 1);
    assert!(s.stat(&id, &k).is_some());
}

fn store_some(root: &std::path::Path, tag: &str) -> Vec<(kvtier_client::BlockKey, u64)> {
    let s = common::open(root, EngineKind::Auto);
    let ns = namespace(65536, tag).unwrap();
    let mut out = Vec::new();
    for i in 1..=4 {
        let (k, h, p) = block(&ns, i);
        s.put_block(&ns.id(), &h, &p, PutMeta::default()).unwrap();
        out.push((k, h.file_len()));
    }
    s.close().unwrap();
    out
}

#[test]
fn a_damaged_index_header_is_rebuilt_from_the_files() {
    use std::io::{Seek, Write};
    for clean in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let ns = namespace(65536, "damaged-index").unwrap();
        let stored = store_some(dir.path(), "damaged-index");
        if !clean {
            std::fs::remove_file(dir.path().join(kvtier_daemon::tiers::g3::CLEAN_MARKER)).unwrap();
        }
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join("index.redb"))
            .unwrap();
        f.seek(std::io::SeekFrom::Start(0)).unwrap();
        f.write_all(&[0xa5; 4096]).unwrap();
        f.sync_all().unwrap();
        drop(f);
        let s = common::open(dir.path(), EngineKind::Auto);
        let rep = s.recovery.lock().unwrap().clone();
        assert!(rep.index_rebuilt, "clean={clean} {rep:?}");
        assert_eq!(rep.adopted, 4, "clean={clean} {rep:?}");
        for (k, len) in &stored {
            assert!(read_hits(&s, &ns.id(), k, *len), "clean={clean}");
        }
        let aside = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with("index.redb.damaged.")
            })
            .count();
        assert_eq!(aside, 1, "the damaged index is kept for inspection");
    }
}

/// The pages holding the records damaged, the file's header whole (as a
/// power cut on a disk that lies about flushes may leave it): after an
/// unclean stop the index is set aside and rebuilt from the files, never a
/// start-up that fails. (redb finds this damage when it opens the file;
/// damage it meets only mid-walk, as the power-loss mutation check once
/// made it panic in close's scan, the open's full scan after an unclean
/// stop and `DiskIndex::guarded` turn into the same rebuild.)
#[test]
fn an_index_damaged_past_its_header_is_rebuilt_after_an_unclean_stop() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace(65536, "damaged-pages").unwrap();
    let stored = store_some(dir.path(), "damaged-pages");
    std::fs::remove_file(dir.path().join(kvtier_daemon::tiers::g3::CLEAN_MARKER)).unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join("index.redb"))
        .unwrap();
    // The pages holding the records (found by a key's bytes): their
    // headers overwritten, the file's own header and allocator state left
    // whole, so redb opens it and meets the damage only when it walks.
    let bytes = std::fs::read(dir.path().join("index.redb")).unwrap();
    let key = stored[0].0.as_bytes().to_vec();
    let mut pages = std::collections::BTreeSet::new();
    for at in 0..bytes.len().saturating_sub(key.len()) {
        if bytes[at..at + key.len()] == key[..] {
            pages.insert(at / 4096 * 4096);
        }
    }
    assert!(!pages.is_empty(), "no record found in index.redb");
    for p in pages {
        f.write_all_at(&[0xa5; 16], p as u64).unwrap();
    }
    f.sync_all().unwrap();
    drop(f);
    let s = common::open(dir.path(), EngineKind::Auto);
    let rep = s.recovery.lock().unwrap().clone();
    assert!(rep.index_rebuilt, "{rep:?}");
    for (k, len) in &stored {
        assert!(read_hits(&s, &ns.id(), k, *len));
    }
    s.close().unwrap();
}

#[test]
fn stray_and_unreadable_entries_under_blocks_are_set_aside_not_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace(65536, "stray").unwrap();
    let stored = store_some(dir.path(), "stray");
    std::fs::remove_file(dir.path().join(kvtier_daemon::tiers::g3::CLEAN_MARKER)).unwrap();
    let blocks = dir.path().join("blocks");
    let nsd = blocks.join(ns.id().to_hex());
    let shard = std::fs::read_dir(&nsd)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    // A regular file where a shard directory belongs, a junk file and a
    // directory where block files belong, and junk at the top.
    std::fs::write(nsd.join("not-a-shard"), b"junk").unwrap();
    std::fs::write(shard.join("junk.txt"), b"junk").unwrap();
    std::fs::create_dir(shard.join("0".repeat(64))).unwrap();
    std::fs::write(blocks.join("README"), b"junk").unwrap();
    let s = common::open(dir.path(), EngineKind::Auto);
    let rep = s.recovery.lock().unwrap().clone();
    assert_eq!(rep.set_aside, 4, "{rep:?}");
    assert!(!nsd.join("not-a-shard").exists());
    assert!(!shard.join("junk.txt").exists());
    for (k, len) in &stored {
        assert!(read_hits(&s, &ns.id(), k, *len));
    }
    let strays = std::fs::read_dir(dir.path().join("quarantine"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("stray.")
        })
        .count();
    assert_eq!(strays, 4);
}

#[test]
fn quarantine_is_bounded_and_counts_against_capacity() {
    use kvtier_daemon::testkit::conformance::Damage;
    let dir = tempfile::tempdir().unwrap();
    let mut c = common::cfg(dir.path(), EngineKind::Auto);
    c.capacity_bytes = 1 << 20;
    c.pinned_budget_bytes = 0;
    c.quarantine_max_bytes = 256 << 10;
    c.quarantine_max_files = 3;
    let s = kvtier_daemon::tiers::g3::G3Store::open(
        c,
        Box::new(kvtier_daemon::tiers::policy::Lru::new()),
    )
    .unwrap();
    let ns = namespace(65536, "qbound").unwrap();
    let id = ns.id();
    // Six corrupt blocks read: at most 3 files (and 256 KiB) stay.
    for i in 1..=6 {
        let (k, h, p) = block(&ns, i);
        s.put_block(&id, &h, &p, PutMeta::default()).unwrap();
        common::damage(&s, &id, &k, Damage::Payload);
        assert!(!read_hits(&s, &id, &k, h.file_len()));
    }
    let st = s.stats();
    assert_eq!(st.quarantined, 6);
    let files = std::fs::read_dir(dir.path().join("quarantine"))
        .unwrap()
        .count();
    assert!(files <= 3, "{files} files in quarantine/");
    assert!(
        st.quarantine_bytes <= 256 << 10 && st.quarantine_bytes > 0,
        "{st:?}"
    );
    assert_eq!(st.quarantine_trimmed, 3);
    // Fill the tier: blocks and quarantine together stay within capacity.
    for i in 100..130 {
        let (_, h, p) = block(&ns, i);
        s.put_block(&id, &h, &p, PutMeta::default()).unwrap();
        let st = s.stats();
        assert!(
            st.used_bytes + st.quarantine_bytes <= st.capacity_bytes,
            "{st:?}"
        );
    }
    // The bound and the bytes survive a restart.
    s.close().unwrap();
    drop(s);
    let mut c = common::cfg(dir.path(), EngineKind::Auto);
    c.capacity_bytes = 1 << 20;
    c.quarantine_max_bytes = 128 << 10;
    c.quarantine_max_files = 3;
    let s = kvtier_daemon::tiers::g3::G3Store::open(
        c,
        Box::new(kvtier_daemon::tiers::policy::Lru::new()),
    )
    .unwrap();
    assert!(s.stats().quarantine_bytes <= 128 << 10);
    assert!(s.stats().quarantine_bytes > 0);
}

// ---------------------------------------------------------------------------
// Hostile clients, deterministically: the client's region (its shared
// memory, played here by a raw allocation the test writes behind the
// store's back, exactly as a client process writes its mapping) changes at
// the one point that matters, through test seams: on the write path
// between the daemon's copy of a chunk and its hash (`G3Fs::payload_copied`),
// on the read path while the daemon verifies (an engine wrapper that
// scribbles the client's region before each piece is verified). The e2e
// version (tests/e2e_hostile_client.rs) races a real client and can pass
// on broken code; these cannot.

use kvtier_daemon::base::tier::MissReason;
use kvtier_daemon::tiers::g3::engine::{
    AlignedBuf, FillFn, IoEngine, PreadEngine, ReadyFn, UringEngine,
};
use kvtier_daemon::tiers::g3::seam::{G3Fs, RealFs, SyncSite, Unlink};
use std::io;
use std::os::fd::RawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A client's region: memory the store sees as `&[u8]` (or `&mut [u8]`)
/// while the "client" (a test seam) rewrites it through a raw pointer.
struct Region {
    mem: Box<[u8]>,
}

impl Region {
    fn new(bytes: &[u8]) -> Self {
        Region {
            mem: bytes.to_vec().into_boxed_slice(),
        }
    }
    fn ptr(&mut self) -> usize {
        self.mem.as_mut_ptr() as usize
    }
}

/// What the client writes into its region, and when.
#[derive(Clone)]
struct Scribble {
    at: usize,
    bytes: Vec<u8>,
}

/// Writes `s` at `ptr` with volatile stores: another process's writes to
/// shared memory, as far as the store's code is concerned.
fn client_writes(ptr: usize, s: &Scribble) {
    for (i, b) in s.bytes.iter().enumerate() {
        // SAFETY: `ptr` is the start of a live test `Region` of at least
        // `s.at + s.bytes.len()` bytes (checked by the callers).
        unsafe { (ptr as *mut u8).add(s.at + i).write_volatile(*b) };
    }
}

/// RealFs plus a one-shot client write in the copy-to-hash window.
#[derive(Debug, Default)]
struct CopyWindowFs {
    armed: Mutex<Option<(usize, Vec<u8>, usize)>>,
    fired: AtomicU64,
}

impl CopyWindowFs {
    fn arm(&self, ptr: usize, s: &Scribble) {
        *self.armed.lock().unwrap() = Some((ptr, s.bytes.clone(), s.at));
    }
}

impl G3Fs for CopyWindowFs {
    fn create_new(&self, path: &Path, custom_flags: i32) -> io::Result<std::fs::File> {
        RealFs.create_new(path, custom_flags)
    }
    fn write_synced(&self, path: &Path, bytes: &[u8], site: SyncSite) -> io::Result<()> {
        RealFs.write_synced(path, bytes, site)
    }
    fn sync_dir(&self, dir: &Path, site: SyncSite) -> io::Result<()> {
        RealFs.sync_dir(dir, site)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        RealFs.rename(from, to)
    }
    fn rename_noreplace(&self, from: &Path, to: &Path) -> io::Result<()> {
        RealFs.rename_noreplace(from, to)
    }
    fn remove_file(&self, path: &Path, why: Unlink) -> io::Result<()> {
        RealFs.remove_file(path, why)
    }
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        RealFs.create_dir(path)
    }
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        RealFs.create_dir_all(path)
    }
    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        RealFs.remove_dir_all(path)
    }
    fn index_backend(
        &self,
        path: &Path,
    ) -> io::Result<Option<kvtier_daemon::tiers::g3::seam::IndexBackend>> {
        RealFs.index_backend(path)
    }
    fn payload_copied(&self, _file_off: u64) {
        if let Some((ptr, bytes, at)) = self.armed.lock().unwrap().take() {
            client_writes(ptr, &Scribble { at, bytes });
            self.fired.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The real engine plus a client that rewrites its read region before
/// every piece is verified.
struct ScribbleReadEngine {
    inner: Arc<dyn IoEngine>,
    armed: Mutex<Option<(usize, usize)>>,
    fired: AtomicU64,
}

impl IoEngine for ScribbleReadEngine {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn write_file(
        &self,
        fd: RawFd,
        at: u64,
        len: u64,
        bufs: &mut [AlignedBuf],
        fill: FillFn<'_>,
    ) -> io::Result<()> {
        self.inner.write_file(fd, at, len, bufs, fill)
    }
    fn read_file(
        &self,
        fd: RawFd,
        at: u64,
        dst: &mut [u8],
        on_ready: ReadyFn<'_>,
    ) -> io::Result<usize> {
        let target = *self.armed.lock().unwrap();
        let fired = &self.fired;
        let mut scribbling = |piece: &[u8]| {
            if let Some((ptr, len)) = target {
                // The client zeroes its whole region mid-read.
                client_writes(
                    ptr,
                    &Scribble {
                        at: 0,
                        bytes: vec![0u8; len],
                    },
                );
                fired.fetch_add(1, Ordering::Relaxed);
            }
            on_ready(piece)
        };
        self.inner.read_file(fd, at, dst, &mut scribbling)
    }
    fn sync_data(&self, fd: RawFd) -> io::Result<()> {
        self.inner.sync_data(fd)
    }
}

fn real_engine() -> Arc<dyn IoEngine> {
    match UringEngine::new(4) {
        Ok(u) => Arc::new(u),
        Err(_) => Arc::new(PreadEngine),
    }
}

#[test]
fn offload_hashes_the_daemons_copy_not_the_clients_region() {
    let dir = tempfile::tempdir().unwrap();
    let fs = Arc::new(CopyWindowFs::default());
    let s = kvtier_daemon::tiers::g3::G3Store::open_with_fs(
        common::cfg(dir.path(), EngineKind::Auto),
        Box::new(kvtier_daemon::tiers::policy::Lru::new()),
        real_engine(),
        fs.clone(),
    )
    .unwrap();
    let ns = namespace(65536, "copy-window").unwrap();
    let id = ns.id();

    // 1. The region holds other bytes than the header's when the daemon
    //    copies, and the header's bytes by the time it hashes: hashing the
    //    region (the old code) acked a block whose file fails its checksum.
    let (k1, h1, good1) = block(&ns, 1);
    let mut bad = good1.clone();
    bad[17] ^= 0x40;
    let mut region = Region::new(&bad);
    fs.arm(
        region.ptr(),
        &Scribble {
            at: 17,
            bytes: vec![good1[17]],
        },
    );
    // SAFETY: `region` outlives `payload`; only the seam writes to it.
    let payload = unsafe { std::slice::from_raw_parts(region.ptr() as *const u8, bad.len()) };
    let r = s.put_block(&id, &h1, payload, PutMeta::default());
    assert_eq!(fs.fired.load(Ordering::Relaxed), 1, "the seam never fired");
    match r {
        Err(kvtier_daemon::Error::InvalidInput { .. }) => {
            assert!(s.stat(&id, &k1).is_none());
            assert!(!s.block_file_path(&id, &k1).exists());
        }
        Ok(PutOutcome::Stored) => {
            let mut dst = vec![0u8; h1.file_len() as usize];
            let got = s.read_into(&id, &k1, &mut dst).unwrap();
            panic!(
                "acked a block whose file holds the bytes copied, not the bytes hashed: \
                 read back {got:?} (quarantined {})",
                s.stats().quarantined
            );
        }
        other => panic!("unexpected outcome {other:?}"),
    }

    // 2. The region holds the header's bytes when copied and is rewritten
    //    before the hash: the copy is good, so it is stored and reads back.
    let (k2, h2, good2) = block(&ns, 2);
    let mut region2 = Region::new(&good2);
    fs.arm(
        region2.ptr(),
        &Scribble {
            at: 0,
            bytes: vec![0xAA; 4096],
        },
    );
    // SAFETY: as above.
    let payload2 = unsafe { std::slice::from_raw_parts(region2.ptr() as *const u8, good2.len()) };
    let r = s.put_block(&id, &h2, payload2, PutMeta::default());
    assert_eq!(fs.fired.load(Ordering::Relaxed), 2);
    assert_eq!(
        r.unwrap(),
        PutOutcome::Stored,
        "the bytes copied were the header's"
    );
    let mut dst = vec![0u8; h2.file_len() as usize];
    assert!(matches!(
        s.read_into(&id, &k2, &mut dst).unwrap(),
        Lookup::Hit(_)
    ));
    assert_eq!(&dst[4096..4096 + good2.len()], &good2[..]);
    assert_eq!(s.stats().quarantined, 0);
    drop(region);
    drop(region2);
}

#[test]
fn onboard_verifies_in_daemon_memory_a_scribbling_client_quarantines_nothing() {
    scribbling_client_quarantines_nothing(false);
}

/// The region onboard reads straight into the client's memory and checks
/// only the header there: what fails that check (here a zeroed header) is
/// settled by the verifying read in the daemon's own memory, never
/// quarantined on what the client's memory showed.
#[test]
fn a_region_read_checked_in_client_memory_quarantines_nothing_on_what_it_saw_there() {
    scribbling_client_quarantines_nothing(true);
}

fn scribbling_client_quarantines_nothing(for_verifier: bool) {
    let dir = tempfile::tempdir().unwrap();
    let engine = Arc::new(ScribbleReadEngine {
        inner: real_engine(),
        armed: Mutex::new(None),
        fired: AtomicU64::new(0),
    });
    let s = kvtier_daemon::tiers::g3::G3Store::open_with_engine(
        common::cfg(dir.path(), EngineKind::Auto),
        Box::new(kvtier_daemon::tiers::policy::Lru::new()),
        engine.clone(),
    )
    .unwrap();
    // Two chunks, so the client scribbles between verified pieces too.
    let ns = namespace(1 << 20, "read-window").unwrap();
    let id = ns.id();
    let (k, h, good) = block(&ns, 3);
    assert_eq!(
        s.put_block(&id, &h, &good, PutMeta::default()).unwrap(),
        PutOutcome::Stored
    );
    let len = h.file_len() as usize;
    let mut region = Region::new(&vec![0u8; len]);
    *engine.armed.lock().unwrap() = Some((region.ptr(), len));
    // SAFETY: `region` outlives `dst`; the engine's scribbler writes it
    // as the client would.
    let dst = unsafe { std::slice::from_raw_parts_mut(region.ptr() as *mut u8, len) };
    let got = if for_verifier {
        s.read_into_for_verifier(&id, &k, dst).unwrap()
    } else {
        s.read_into(&id, &k, dst).unwrap()
    };
    assert!(engine.fired.load(Ordering::Relaxed) > 0, "never scribbled");
    *engine.armed.lock().unwrap() = None;
    assert_eq!(
        s.stats().quarantined,
        0,
        "a client got a good block quarantined"
    );
    assert!(
        matches!(got, Lookup::Hit(_)),
        "a good block read as {got:?}"
    );
    assert_eq!(&dst[4096..4096 + good.len()], &good[..]);
    // And it still reads for everyone else.
    assert!(read_hits(&s, &id, &k, h.file_len()));
    assert!(!matches!(got, Lookup::Miss(MissReason::Corrupt)));
    drop(region);
}

// --- A removal racing a put or a hint update of the same key -----------

/// A gate one thread opens and others wait at (bounded).
#[derive(Debug, Default)]
struct Gate {
    open: Mutex<bool>,
    cv: std::sync::Condvar,
}

impl Gate {
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.cv.notify_all();
    }
    /// Whether it opened within `ms`.
    fn wait(&self, ms: u64) -> bool {
        let g = self.open.lock().unwrap();
        let (g, _) = self
            .cv
            .wait_timeout_while(g, std::time::Duration::from_millis(ms), |o| !*o)
            .unwrap();
        *g
    }
}

/// RealFs where the thread named `first-put` stops before creating its
/// temp file until the test opens `go`, and files created by the thread
/// named `second-put` are counted.
#[derive(Debug, Default)]
struct RaceFs {
    first_put_waiting: Gate,
    go: Gate,
    second_put_creates: AtomicU64,
}

fn thread_is(name: &str) -> bool {
    std::thread::current().name() == Some(name)
}

impl G3Fs for RaceFs {
    fn create_new(&self, path: &Path, custom_flags: i32) -> io::Result<std::fs::File> {
        if thread_is("first-put") {
            self.first_put_waiting.open();
            assert!(self.go.wait(10_000), "never released");
        }
        if thread_is("second-put") {
            self.second_put_creates.fetch_add(1, Ordering::Relaxed);
        }
        RealFs.create_new(path, custom_flags)
    }
    fn write_synced(&self, path: &Path, bytes: &[u8], site: SyncSite) -> io::Result<()> {
        RealFs.write_synced(path, bytes, site)
    }
    fn sync_dir(&self, dir: &Path, site: SyncSite) -> io::Result<()> {
        RealFs.sync_dir(dir, site)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        RealFs.rename(from, to)
    }
    fn rename_noreplace(&self, from: &Path, to: &Path) -> io::Result<()> {
        RealFs.rename_noreplace(from, to)
    }
    fn remove_file(&self, path: &Path, why: Unlink) -> io::Result<()> {
        RealFs.remove_file(path, why)
    }
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        RealFs.create_dir(path)
    }
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        RealFs.create_dir_all(path)
    }
    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        RealFs.remove_dir_all(path)
    }
    fn index_backend(
        &self,
        path: &Path,
    ) -> io::Result<Option<kvtier_daemon::tiers::g3::seam::IndexBackend>> {
        RealFs.index_backend(path)
    }
}

/// Two puts of one key at once (both planned while it was absent): the
/// one that claimed it first writes it, the other writes nothing and is
/// answered present once the first published it; nothing is taken for an
/// orphan. Before, both wrote: the second renamed its file into place
/// while the first was still writing, the first then took that in-flight
/// file for an orphan and replaced it, and the second published its entry
/// after an eviction had removed the file: a block listed with no file
/// (found by the power-loss harness).
#[test]
fn a_second_put_of_a_key_being_written_joins_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("g3");
    let fs = Arc::new(RaceFs::default());
    let store = kvtier_daemon::tiers::g3::G3Store::open_with_fs(
        common::cfg(&root, EngineKind::Auto),
        Box::new(kvtier_daemon::tiers::policy::Lru::new()),
        real_engine(),
        fs.clone(),
    )
    .unwrap();
    let ns = namespace(65536, "race").unwrap();
    let id = ns.id();
    let (key, h, p) = block(&ns, 7);
    let put = || {
        store.put_blocks(
            &id,
            &[PutItem {
                header: &h,
                payload: &p,
                meta: PutMeta::default(),
            }],
        )
    };
    let (first, second) = std::thread::scope(|sc| {
        let first = std::thread::Builder::new()
            .name("first-put".into())
            .spawn_scoped(sc, put)
            .unwrap();
        // The first put claimed the key and waits before its write.
        assert!(fs.first_put_waiting.wait(10_000));
        let second = std::thread::Builder::new()
            .name("second-put".into())
            .spawn_scoped(sc, put)
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        fs.go.open();
        (first.join().unwrap(), second.join().unwrap())
    });
    assert!(
        matches!(first[0], Ok(PutOutcome::Stored)),
        "first: {first:?}"
    );
    assert!(
        matches!(second[0], Ok(PutOutcome::AlreadyPresent)),
        "second: {second:?}"
    );
    assert_eq!(
        fs.second_put_creates.load(Ordering::Relaxed),
        0,
        "the second put wrote a file of its own"
    );
    assert_eq!(store.stats().orphans_replaced, 0);
    assert!(read_hits(&store, &id, &key, h.file_len()));
    let visible: std::collections::HashSet<_> = store.list(&id, None, 100).into_iter().collect();
    common::tree_matches_index(&store, &root, &visible).unwrap();
    // Removed, the name and the entry go together.
    assert!(store.delete_block(&id, &key).unwrap());
    assert!(store.list(&id, None, 100).is_empty());
    common::tree_matches_index(&store, &root, &Default::default()).unwrap();
}

/// A hint update (priority, the in-G4 flag) racing the removal of its
/// block never writes the removed record back: such a record has no file
/// and no entry, yet `list` (which reads redb) named it, and a reopen from
/// the clean snapshot kept it listed (found by the power-loss harness).
/// A stress test: the hints loop runs while each block is deleted.
#[test]
fn hints_racing_removals_never_write_a_removed_record_back() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("g3");
    let store = common::open(&root, EngineKind::Auto);
    let ns = namespace(4096, "hints-race").unwrap();
    let id = ns.id();
    for round in 0..300u64 {
        let (key, h, p) = block(&ns, round);
        let r = store.put_blocks(
            &id,
            &[PutItem {
                header: &h,
                payload: &p,
                meta: PutMeta::default(),
            }],
        );
        assert!(r[0].is_ok(), "{r:?}");
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                while !done.load(Ordering::Acquire) {
                    store.set_priority(&id, &key, 2);
                    store.mark_in_g4(&id, &key);
                    store.clear_in_g4(&id, &key);
                }
            });
            std::thread::sleep(std::time::Duration::from_micros(200 + round % 7 * 100));
            assert!(store.delete_block(&id, &key).unwrap());
            done.store(true, Ordering::Release);
        });
        let listed = store.list(&id, None, 10);
        assert!(
            listed.is_empty(),
            "round {round}: deleted block(s) still listed: {listed:?}"
        );
    }
}
