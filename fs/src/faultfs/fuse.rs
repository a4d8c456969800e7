//! fuser's `Filesystem` over the [`super::model::Model`]: one request,
//! one model call under the lock, one reply. Attributes and names are
//! never cached by the kernel (TTL 0), so every request sees the model.

use super::model::{Body, Errno, Inode, Model};
use super::Shared;
use fuser::{
    FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, KernelConfig,
    LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use std::ffi::OsStr;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, SystemTime};

const TTL: Duration = Duration::ZERO;

pub(crate) struct Adapter {
    pub(crate) shared: Arc<Shared>,
}

fn err(e: Errno) -> fuser::Errno {
    fuser::Errno::from_i32(e)
}

fn attr(ino: u64, i: &Inode) -> FileAttr {
    let size = i.size();
    FileAttr {
        ino: INodeNo(ino),
        size,
        blocks: size.div_ceil(512),
        atime: i.mtime,
        mtime: i.mtime,
        ctime: i.mtime,
        crtime: i.mtime,
        kind: if i.is_dir() {
            FileType::Directory
        } else {
            FileType::RegularFile
        },
        perm: (i.mode & 0o7777) as u16,
        nlink: if i.is_dir() { 2 } else { 1 },
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

impl Adapter {
    fn model(&self) -> MutexGuard<'_, Model> {
        self.shared.lock()
    }

    fn entry(&self, m: &Model, ino: u64, reply: ReplyEntry) {
        match m.get(ino) {
            Ok(i) => reply.entry(&TTL, &attr(ino, i), Generation(0)),
            Err(e) => reply.error(err(e)),
        }
    }

    fn open_flags(&self, flags: i32) -> FopenFlags {
        if self.shared.direct_io_flag && flags & libc::O_DIRECT != 0 {
            FopenFlags::FOPEN_DIRECT_IO
        } else {
            FopenFlags::empty()
        }
    }
}

impl Filesystem for Adapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Fewer, larger WRITE requests for multi-MiB blocks.
        let _ = config.set_max_write(1 << 20);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let mut m = self.model();
        if let Err(e) = m.alive() {
            return reply.error(err(e));
        }
        match m.lookup(parent.0, name) {
            Ok(ino) => self.entry(&m, ino, reply),
            Err(e) => reply.error(err(e)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let m = self.model();
        match m.get(ino.0) {
            Ok(i) => reply.attr(&TTL, &attr(ino.0, i)),
            Err(e) => reply.error(err(e)),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut m = self.model();
        let r = (|| {
            if let Some(s) = size {
                m.truncate(ino.0, s)?;
            }
            if let Some(md) = mode {
                m.chmod(ino.0, md)?;
            }
            Ok::<_, Errno>(())
        })();
        match r.and_then(|()| m.get(ino.0).map(|i| attr(ino.0, i))) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(err(e)),
        }
    }

    fn mknod(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        if mode & libc::S_IFMT != libc::S_IFREG {
            return reply.error(fuser::Errno::EPERM);
        }
        let mut m = self.model();
        match m.create(parent.0, name, mode & !umask, libc::O_EXCL) {
            Ok(ino) => self.entry(&m, ino, reply),
            Err(e) => reply.error(err(e)),
        }
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let mut m = self.model();
        match m.mkdir(parent.0, name, mode & !umask) {
            Ok(ino) => self.entry(&m, ino, reply),
            Err(e) => reply.error(err(e)),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.model().unlink(parent.0, name) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.model().rmdir(parent.0, name) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        if flags.intersects(RenameFlags::RENAME_EXCHANGE | RenameFlags::RENAME_WHITEOUT) {
            return reply.error(fuser::Errno::EINVAL);
        }
        let noreplace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        match self
            .model()
            .rename(parent.0, name, newparent.0, newname, noreplace)
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let mut m = self.model();
        match m.link(ino.0, newparent.0, newname) {
            Ok(()) => self.entry(&m, ino.0, reply),
            Err(e) => reply.error(err(e)),
        }
    }

    fn open(&self, _req: &Request, _ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        match self.model().opened(flags.0) {
            Ok(()) => reply.opened(FileHandle(0), self.open_flags(flags.0)),
            Err(e) => reply.error(err(e)),
        }
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let mut m = self.model();
        let r = m
            .create(parent.0, name, mode & !umask, flags)
            .and_then(|ino| m.get(ino).map(|i| attr(ino, i)));
        match r {
            Ok(a) => reply.created(
                &TTL,
                &a,
                Generation(0),
                FileHandle(0),
                self.open_flags(flags),
            ),
            Err(e) => reply.error(err(e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        match self.model().read(ino.0, offset, size) {
            Ok(d) => reply.data(&d),
            Err(e) => reply.error(err(e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        // O_SYNC includes the O_DSYNC bit on Linux.
        let dsync = flags.0 & libc::O_DSYNC == libc::O_DSYNC;
        match self.model().write(ino.0, offset, data, dsync) {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(err(e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close(2) is not a durability point.
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.model().fsync(ino.0) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let mut m = self.model();
        if let Err(e) = m.alive() {
            return reply.error(err(e));
        }
        let list = match m.list(ino.0) {
            Ok(l) => l,
            Err(e) => return reply.error(err(e)),
        };
        drop(m);
        let dots = [
            (ino.0, true, OsStr::new(".").to_os_string()),
            (ino.0, true, OsStr::new("..").to_os_string()),
        ];
        for (i, (child, dir, name)) in dots
            .into_iter()
            .chain(list)
            .enumerate()
            .skip(offset as usize)
        {
            let kind = if dir {
                FileType::Directory
            } else {
                FileType::RegularFile
            };
            if reply.add(INodeNo(child), (i + 1) as u64, kind, &name) {
                break;
            }
        }
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.model().fsyncdir(ino.0) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // Memory-backed: report room enough for any test (64 GiB).
        let m = self.model();
        let used: u64 = m
            .inodes
            .values()
            .map(|i| match &i.body {
                Body::File { live, .. } => (live.len() as u64).div_ceil(4096),
                Body::Dir { .. } => 0,
            })
            .sum();
        let total = 16u64 << 20;
        let free = total.saturating_sub(used);
        reply.statfs(total, free, free, 1 << 20, 1 << 20, 4096, 255, 4096);
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        reply.ok();
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _length: u64,
        _mode: i32,
        reply: ReplyEmpty,
    ) {
        reply.error(fuser::Errno::EOPNOTSUPP);
    }
}
