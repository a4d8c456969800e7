//! The filesystem seam: every G3 operation that changes what is on disk
//! (create, rename, unlink, mkdir, file and directory syncs, the index
//! file) goes through one [`G3Fs`], so that a crash-simulating
//! implementation (the crash harness's `powerloss::PowerLossFs`) can decide what a
//! power cut keeps. Block data moves through the [`super::engine::IoEngine`]
//! as before; the simulator wraps that too. Production uses [`RealFs`]:
//! the same std::fs and libc calls as before the seam, one dynamic call
//! away (no copies, no extra syscalls), and redb's own file backend.
//!
//! Every sync names its [`SyncSite`], so that the mutation check can
//! remove one durability call at a time and show the harness notices.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// One durability call in G3, by role. `load_bearing` ones are what make
/// an acknowledged block survive a power cut; the others only make a
/// restart faster (the index is a cache of the files) and their loss
/// must never lose a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SyncSite {
    /// fdatasync of a block's temp file (files over one chunk, durable.rs).
    BlockFdatasync,
    /// O_DSYNC on a block's temp file (files of one chunk or less).
    BlockODsync,
    /// The flush window's `syncfs` (sync mode `Group`, group.rs): makes
    /// the data of every block file written before it durable, one call
    /// for all the writers waiting on it.
    BlockGroupSyncfs,
    /// fsync of a shard directory after renames, before the index commit
    /// and the ack (group commit, durable.rs).
    CommitDirFsync,
    /// fsync of the parents of the directories an open creates (root,
    /// `blocks/`, `tmp/`, `quarantine/`).
    OpenDirFsync,
    /// fsync of `blocks/` after creating a namespace directory.
    NsDirFsync,
    /// fsync of a namespace directory after creating a shard directory.
    ShardDirFsync,
    /// fsync of the root after removing the clean marker at open
    /// (recover.rs): a marker that came back would make the next open
    /// trust an index that misses this session's blocks.
    MarkerRemoveDirFsync,
    /// fsync, at close, of the shard directories where files were
    /// unlinked (delete, eviction, quarantine): before the clean marker,
    /// else an unlinked file comes back that the trusted index lacks.
    CloseRemovalsFsync,
    /// fsync of the clean marker's temp file (close).
    MarkerFileSync,
    /// fsync of the root after renaming the clean marker into place.
    MarkerDirFsync,
    /// fsync of the index snapshot's temp file (close).
    SnapshotFileSync,
    /// redb's sync of `index.redb` (durable commits: close, recovery).
    IndexSync,
    /// fsync of the root after moving a damaged index aside.
    IndexRebuildDirFsync,
    /// fsync of shard directories after a failed commit's renames are
    /// undone (a file that comes back is adopted at the next open).
    UndoDirFsync,
    /// fsync of `recycle/` and of the shard directories evicted files
    /// left, before any of them is overwritten by a new block
    /// (recycle.rs): else a power cut could give an inode that now holds
    /// one block its old name, or no name at all.
    RecycleDirFsync,
    /// fsync of `slots/` after creating a slab file (slots.rs), before
    /// any block written into it is acknowledged.
    SlabDirFsync,
    /// fdatasync of a slab after its slots' writes, shared by the writers
    /// of one window (slots.rs), before their blocks are acknowledged.
    SlabFdatasync,
    /// fdatasync of every slab at close (punched slots of deleted blocks
    /// durable before the clean marker).
    SlabCloseSync,
    /// fsync of a slot's bytes copied into `quarantine/`.
    QuarantineCopySync,
}

impl SyncSite {
    /// Every site, in a fixed order.
    pub const ALL: &'static [SyncSite] = &[
        SyncSite::BlockFdatasync,
        SyncSite::BlockODsync,
        SyncSite::BlockGroupSyncfs,
        SyncSite::CommitDirFsync,
        SyncSite::OpenDirFsync,
        SyncSite::NsDirFsync,
        SyncSite::ShardDirFsync,
        SyncSite::MarkerRemoveDirFsync,
        SyncSite::CloseRemovalsFsync,
        SyncSite::MarkerFileSync,
        SyncSite::MarkerDirFsync,
        SyncSite::SnapshotFileSync,
        SyncSite::IndexSync,
        SyncSite::IndexRebuildDirFsync,
        SyncSite::UndoDirFsync,
        SyncSite::RecycleDirFsync,
        SyncSite::SlabDirFsync,
        SyncSite::SlabFdatasync,
        SyncSite::SlabCloseSync,
        SyncSite::QuarantineCopySync,
    ];

    /// A stable name (docs/RELIABILITY.md lists them).
    pub fn name(self) -> &'static str {
        match self {
            SyncSite::BlockFdatasync => "block.fdatasync",
            SyncSite::BlockODsync => "block.o_dsync",
            SyncSite::BlockGroupSyncfs => "block.group_syncfs",
            SyncSite::CommitDirFsync => "commit.dir_fsync",
            SyncSite::OpenDirFsync => "open.dir_fsync",
            SyncSite::NsDirFsync => "mkdir.ns_dir_fsync",
            SyncSite::ShardDirFsync => "mkdir.shard_dir_fsync",
            SyncSite::MarkerRemoveDirFsync => "marker.remove_dir_fsync",
            SyncSite::CloseRemovalsFsync => "close.removals_dir_fsync",
            SyncSite::MarkerFileSync => "marker.file_sync",
            SyncSite::MarkerDirFsync => "marker.dir_fsync",
            SyncSite::SnapshotFileSync => "snapshot.file_sync",
            SyncSite::IndexSync => "index.sync",
            SyncSite::IndexRebuildDirFsync => "index.rebuild_dir_fsync",
            SyncSite::UndoDirFsync => "undo.dir_fsync",
            SyncSite::RecycleDirFsync => "recycle.dir_fsync",
            SyncSite::SlabDirFsync => "slab.dir_fsync",
            SyncSite::SlabFdatasync => "slab.fdatasync",
            SyncSite::SlabCloseSync => "slab.close_sync",
            SyncSite::QuarantineCopySync => "quarantine.copy_sync",
        }
    }

    /// Whether acknowledged blocks depend on this call (the mutation
    /// check requires the harness to fail without it); the others are
    /// required not to lose a block when removed.
    pub fn load_bearing(self) -> bool {
        matches!(
            self,
            SyncSite::BlockFdatasync
                | SyncSite::BlockODsync
                | SyncSite::BlockGroupSyncfs
                | SyncSite::CommitDirFsync
                | SyncSite::OpenDirFsync
                | SyncSite::NsDirFsync
                | SyncSite::ShardDirFsync
                | SyncSite::MarkerRemoveDirFsync
                | SyncSite::CloseRemovalsFsync
                | SyncSite::RecycleDirFsync
                | SyncSite::SlabDirFsync
                | SyncSite::SlabFdatasync
        )
    }
}

/// Why a file is unlinked (the simulator records block removals, which
/// excuse an acknowledged block's absence after a crash).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unlink {
    /// A block deleted or evicted.
    Block,
    /// A temp file (failed write, recovery, probe).
    Temp,
    /// A failed commit's rename undone.
    Undo,
    /// Marker, snapshot or quarantine housekeeping.
    Housekeeping,
}

/// The filesystem operations G3 makes (see the module doc).
pub trait G3Fs: Send + Sync + std::fmt::Debug {
    /// Creates a new file for writing (`O_CREAT|O_EXCL|O_WRONLY` plus
    /// `custom_flags`: O_DIRECT, O_DSYNC, O_CLOEXEC).
    fn create_new(&self, path: &Path, custom_flags: i32) -> io::Result<File>;
    /// Creates or truncates `path`, writes `bytes` and fsyncs the file.
    fn write_synced(&self, path: &Path, bytes: &[u8], site: SyncSite) -> io::Result<()>;
    /// fsync of a directory (makes its entries durable).
    fn sync_dir(&self, dir: &Path, site: SyncSite) -> io::Result<()>;
    /// rename(2), replacing `to`.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// rename that fails with EEXIST rather than replace `to`.
    fn rename_noreplace(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// unlink(2).
    fn remove_file(&self, path: &Path, why: Unlink) -> io::Result<()>;
    /// mkdir(2).
    fn create_dir(&self, path: &Path) -> io::Result<()>;
    /// mkdir -p (the store's fixed directories at open).
    fn create_dir_all(&self, path: &Path) -> io::Result<()>;
    /// rm -r (quarantine trimming of set-aside directories).
    fn remove_dir_all(&self, path: &Path) -> io::Result<()>;
    /// rmdir(2): an empty shard or namespace directory (remove.rs).
    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_dir(path)
    }
    /// The storage behind `index.redb`: `None` lets redb open the file
    /// itself (production).
    fn index_backend(&self, path: &Path) -> io::Result<Option<IndexBackend>>;
    /// Opens an existing file for writing in place (`O_WRONLY` plus
    /// `custom_flags`, no create, no truncate): a recycled block file.
    fn open_existing(&self, path: &Path, custom_flags: i32) -> io::Result<File> {
        OpenOptions::new()
            .write(true)
            .custom_flags(custom_flags)
            .open(path)
    }
    /// Moves an evicted block file into the recycle pool: a rename that,
    /// for the block, is a removal (the simulator records it as one).
    fn retire(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.rename(from, to)
    }
    /// Test seam, not a filesystem operation: called by the write path
    /// after it copied the payload bytes of the chunk at `file_off` into
    /// its own buffer and before it hashes them, so that a test can play a
    /// client that rewrites its shared memory exactly in that window
    /// (tests/g3_failures.rs). Production does nothing here.
    fn payload_copied(&self, _file_off: u64) {}
    /// Whether `open` takes the directory's owner lock (dir_lock.rs).
    /// The crash simulator says no: a store it "crashed" stays alive in
    /// the test process, where a dead daemon's lock would be gone.
    fn owner_lock(&self) -> bool {
        true
    }
    /// Whether the group data flush (sync mode `Group`: one `syncfs` for
    /// every writer waiting) makes block data durable on the filesystem
    /// holding `dir`, given whether block files are written with O_DIRECT
    /// (`direct`). Production: only O_DIRECT writes (their I/O errors come
    /// back on the write itself; a buffered write's later writeback error
    /// could be sampled by another file's open and missed by the leader's
    /// syncfs) on a filesystem whose syncfs flushes the device
    /// (fsops.rs `syncfs_flushes`). The crash simulator says yes: its model
    /// defines what a syncfs makes durable (powerloss.rs).
    fn syncfs_durable(&self, dir: &Path, direct: bool) -> bool {
        direct && super::fsops::syncfs_flushes(dir)
    }
    /// Opens an existing slab file read-write (slots.rs).
    fn open_slab(&self, path: &Path, direct: bool) -> io::Result<File> {
        super::slots::open_slab(path, direct)
    }
    /// fdatasync of a slab file (slots.rs) after its slots' writes.
    fn sync_slab(&self, file: &File, _site: SyncSite) -> io::Result<()> {
        super::engine::fdatasync(std::os::fd::AsRawFd::as_raw_fd(file))
    }
    /// Frees `len` bytes at `off` of a slab file (a deleted block's slot,
    /// or room for another length): the range reads as zeros after.
    fn punch(&self, file: &File, off: u64, len: u64) -> io::Result<()> {
        super::fsops::punch_hole(file, off, len)
    }
    /// The block that `path` names left its slot (slots.rs): for the crash
    /// simulator a removal, like the unlink of its file. No-op here.
    fn slot_released(&self, _path: &Path) {}
}

/// Production: std::fs and libc directly.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealFs;

impl G3Fs for RealFs {
    fn create_new(&self, path: &Path, custom_flags: i32) -> io::Result<File> {
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(custom_flags)
            .open(path)
    }

    fn write_synced(&self, path: &Path, bytes: &[u8], _site: SyncSite) -> io::Result<()> {
        let mut f = File::create(path)?;
        f.write_all(bytes)?;
        f.sync_all()
    }

    fn sync_dir(&self, dir: &Path, _site: SyncSite) -> io::Result<()> {
        super::fsops::fsync_dir(dir)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn rename_noreplace(&self, from: &Path, to: &Path) -> io::Result<()> {
        super::fsops::rename_noreplace(from, to)
    }

    fn remove_file(&self, path: &Path, _why: Unlink) -> io::Result<()> {
        std::fs::remove_file(path)
    }

    fn create_dir(&self, path: &Path) -> io::Result<()> {
        std::fs::create_dir(path)
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        std::fs::create_dir_all(path)
    }

    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_dir_all(path)
    }

    fn index_backend(&self, _path: &Path) -> io::Result<Option<IndexBackend>> {
        Ok(None)
    }
}

/// Storage for `index.redb` other than the file redb opens itself: the
/// crash harness's simulated file. A box, so that the seam names no test
/// type (the harness is compiled only for tests).
pub struct IndexBackend(pub Box<dyn redb::StorageBackend>);

impl std::fmt::Debug for IndexBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl redb::StorageBackend for IndexBackend {
    fn len(&self) -> io::Result<u64> {
        self.0.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        self.0.read(offset, out)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.0.write(offset, data)
    }

    fn close(&self) -> io::Result<()> {
        self.0.close()
    }
}
