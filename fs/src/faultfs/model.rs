//! The in-memory tree behind [`super::FaultFs`] and what a power cut keeps.
//!
//! Every inode holds its live state (what the kernel is served) and its
//! durable state: a file's bytes as of its last fsync/fdatasync (plus
//! ranges written with O_DSYNC/O_SYNC, durable when the write returns), a
//! directory's entries as of its last fsync. [`Model::cut`] rebuilds the
//! tree from the root through durable entries only, with each file's
//! durable bytes: the plain POSIX model (no journal ordering), the same one
//! the G3 seam simulator uses.

use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::time::SystemTime;

/// The root directory's inode (FUSE's fixed root).
pub(crate) const ROOT: u64 = 1;
const PAGE_BYTES: usize = 4096;

/// An errno.
pub(crate) type Errno = i32;

#[derive(Debug, Clone)]
pub(crate) enum Body {
    File {
        live: Vec<u8>,
        durable: Vec<u8>,
    },
    Dir {
        live: BTreeMap<OsString, u64>,
        durable: BTreeMap<OsString, u64>,
    },
}

#[derive(Debug, Clone)]
pub(crate) struct Inode {
    pub(crate) body: Body,
    pub(crate) mode: u32,
    pub(crate) mtime: SystemTime,
}

impl Inode {
    fn dir(mode: u32) -> Self {
        Inode {
            body: Body::Dir {
                live: BTreeMap::new(),
                durable: BTreeMap::new(),
            },
            mode,
            mtime: SystemTime::now(),
        }
    }

    fn file(mode: u32) -> Self {
        Inode {
            body: Body::File {
                live: Vec::new(),
                durable: Vec::new(),
            },
            mode,
            mtime: SystemTime::now(),
        }
    }

    pub(crate) fn is_dir(&self) -> bool {
        matches!(self.body, Body::Dir { .. })
    }

    pub(crate) fn size(&self) -> u64 {
        match &self.body {
            Body::File { live, .. } => live.len() as u64,
            Body::Dir { .. } => 0,
        }
    }
}

/// What the filesystem counted (see [`super::FaultFs::counters`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Operations that change state (the crash point's unit).
    pub ops: u64,
    /// WRITE requests.
    pub writes: u64,
    /// WRITE requests that carried O_DSYNC/O_SYNC (durable on return).
    pub dsync_writes: u64,
    /// FSYNC requests (files; fsync and fdatasync alike).
    pub fsyncs: u64,
    /// FSYNCDIR requests.
    pub dir_fsyncs: u64,
    /// Opens (and creates) whose flags carried O_DIRECT.
    pub direct_opens: u64,
    /// Requests refused with EIO because power was lost.
    pub refused_after_cut: u64,
}

/// What one power cut took back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CutReport {
    /// Directory entries (live, not durable) that did not survive.
    pub entries_dropped: u64,
    /// Durable entries the live tree had removed or replaced, back again.
    pub entries_restored: u64,
    /// Files whose unsynced bytes were dropped.
    pub files_dropped: u64,
    /// Files whose unsynced bytes all reached the disk anyway.
    pub files_kept: u64,
    /// Files left torn: new bytes up to a page boundary, old after.
    pub files_torn: u64,
}

#[derive(Debug)]
pub(crate) struct Model {
    pub(crate) inodes: HashMap<u64, Inode>,
    next_ino: u64,
    crash_at: Option<u64>,
    crashed: bool,
    pub(crate) counters: Counters,
    rng: rand::rngs::StdRng,
}

impl Model {
    pub(crate) fn new(seed: u64) -> Self {
        let mut inodes = HashMap::new();
        inodes.insert(ROOT, Inode::dir(0o755));
        Model {
            inodes,
            next_ino: ROOT + 1,
            crash_at: None,
            crashed: false,
            counters: Counters::default(),
            rng: rand::rngs::StdRng::seed_from_u64(seed),
        }
    }

    pub(crate) fn set_crash_at(&mut self, op: Option<u64>) {
        self.crash_at = op;
    }

    pub(crate) fn crash_now(&mut self) {
        self.crashed = true;
    }

    pub(crate) fn crashed(&self) -> bool {
        self.crashed
    }

    /// Counts one state-changing operation; EIO once power is lost.
    pub(crate) fn op(&mut self) -> Result<(), Errno> {
        if self.crash_at.is_some_and(|k| self.counters.ops >= k) {
            self.crashed = true;
        }
        self.counters.ops += 1;
        self.alive()
    }

    /// EIO once power is lost (reads of a dead disk fail too).
    pub(crate) fn alive(&mut self) -> Result<(), Errno> {
        if self.crashed {
            self.counters.refused_after_cut += 1;
            return Err(libc::EIO);
        }
        Ok(())
    }

    pub(crate) fn get(&self, ino: u64) -> Result<&Inode, Errno> {
        self.inodes.get(&ino).ok_or(libc::ENOENT)
    }

    fn entries(&self, dir: u64) -> Result<&BTreeMap<OsString, u64>, Errno> {
        match &self.get(dir)?.body {
            Body::Dir { live, .. } => Ok(live),
            Body::File { .. } => Err(libc::ENOTDIR),
        }
    }

    fn entries_mut(&mut self, dir: u64) -> Result<&mut BTreeMap<OsString, u64>, Errno> {
        match self.inodes.get_mut(&dir).map(|i| &mut i.body) {
            Some(Body::Dir { live, .. }) => Ok(live),
            Some(Body::File { .. }) => Err(libc::ENOTDIR),
            None => Err(libc::ENOENT),
        }
    }

    pub(crate) fn lookup(&self, parent: u64, name: &OsStr) -> Result<u64, Errno> {
        self.entries(parent)?.get(name).copied().ok_or(libc::ENOENT)
    }

    pub(crate) fn list(&self, dir: u64) -> Result<Vec<(u64, bool, OsString)>, Errno> {
        let e = self.entries(dir)?;
        Ok(e.iter()
            .map(|(n, i)| {
                let d = self.inodes.get(i).is_some_and(Inode::is_dir);
                (*i, d, n.clone())
            })
            .collect())
    }

    fn add(&mut self, parent: u64, name: &OsStr, inode: Inode) -> Result<u64, Errno> {
        if self.entries(parent)?.contains_key(name) {
            return Err(libc::EEXIST);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        self.inodes.insert(ino, inode);
        self.entries_mut(parent)?.insert(name.to_os_string(), ino);
        self.touch(parent);
        Ok(ino)
    }

    fn touch(&mut self, ino: u64) {
        if let Some(i) = self.inodes.get_mut(&ino) {
            i.mtime = SystemTime::now();
        }
    }

    pub(crate) fn mkdir(&mut self, parent: u64, name: &OsStr, mode: u32) -> Result<u64, Errno> {
        self.op()?;
        self.add(parent, name, Inode::dir(mode & 0o7777))
    }

    /// open(O_CREAT): a new file, or (without O_EXCL) the existing one,
    /// truncated under O_TRUNC.
    pub(crate) fn create(
        &mut self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        flags: i32,
    ) -> Result<u64, Errno> {
        self.op()?;
        if flags & libc::O_DIRECT != 0 {
            self.counters.direct_opens += 1;
        }
        match self.lookup(parent, name) {
            Ok(_) if flags & libc::O_EXCL != 0 => Err(libc::EEXIST),
            Ok(ino) => {
                if self.get(ino)?.is_dir() {
                    return Err(libc::EISDIR);
                }
                if flags & libc::O_TRUNC != 0 {
                    self.truncate_live(ino, 0)?;
                }
                Ok(ino)
            }
            Err(_) => self.add(parent, name, Inode::file(mode & 0o7777)),
        }
    }

    pub(crate) fn opened(&mut self, flags: i32) -> Result<(), Errno> {
        self.alive()?;
        if flags & libc::O_DIRECT != 0 {
            self.counters.direct_opens += 1;
        }
        Ok(())
    }

    pub(crate) fn read(&mut self, ino: u64, off: u64, size: u32) -> Result<Vec<u8>, Errno> {
        self.alive()?;
        match &self.get(ino)?.body {
            Body::File { live, .. } => {
                let s = (off as usize).min(live.len());
                let e = (s + size as usize).min(live.len());
                Ok(live[s..e].to_vec())
            }
            Body::Dir { .. } => Err(libc::EISDIR),
        }
    }

    /// A write; `dsync`: O_DSYNC/O_SYNC, so the range (and the size that
    /// covers it) is durable when the write returns.
    pub(crate) fn write(
        &mut self,
        ino: u64,
        off: u64,
        data: &[u8],
        dsync: bool,
    ) -> Result<(), Errno> {
        self.op()?;
        self.counters.writes += 1;
        if dsync {
            self.counters.dsync_writes += 1;
        }
        let Some(Inode {
            body: Body::File { live, durable },
            mtime,
            ..
        }) = self.inodes.get_mut(&ino)
        else {
            return Err(libc::EISDIR);
        };
        let (s, e) = (off as usize, off as usize + data.len());
        let put = |v: &mut Vec<u8>| {
            if v.len() < e {
                v.resize(e, 0);
            }
            v[s..e].copy_from_slice(data);
        };
        put(live);
        if dsync {
            put(durable);
        }
        *mtime = SystemTime::now();
        Ok(())
    }

    fn truncate_live(&mut self, ino: u64, size: u64) -> Result<(), Errno> {
        match self.inodes.get_mut(&ino).map(|i| &mut i.body) {
            Some(Body::File { live, .. }) => {
                live.resize(size as usize, 0);
                self.touch(ino);
                Ok(())
            }
            Some(Body::Dir { .. }) => Err(libc::EISDIR),
            None => Err(libc::ENOENT),
        }
    }

    pub(crate) fn truncate(&mut self, ino: u64, size: u64) -> Result<(), Errno> {
        self.op()?;
        self.truncate_live(ino, size)
    }

    pub(crate) fn chmod(&mut self, ino: u64, mode: u32) -> Result<(), Errno> {
        self.op()?;
        let i = self.inodes.get_mut(&ino).ok_or(libc::ENOENT)?;
        i.mode = mode & 0o7777;
        Ok(())
    }

    /// fsync/fdatasync of a file: its bytes are durable (its name is not:
    /// that takes an fsync of the directory).
    pub(crate) fn fsync(&mut self, ino: u64) -> Result<(), Errno> {
        self.op()?;
        self.counters.fsyncs += 1;
        match self.inodes.get_mut(&ino).map(|i| &mut i.body) {
            Some(Body::File { live, durable }) => {
                durable.clone_from(live);
                Ok(())
            }
            Some(Body::Dir { live, durable }) => {
                durable.clone_from(live);
                Ok(())
            }
            None => Err(libc::ENOENT),
        }
    }

    /// fsync of a directory: its entries are durable.
    pub(crate) fn fsyncdir(&mut self, ino: u64) -> Result<(), Errno> {
        self.op()?;
        self.counters.dir_fsyncs += 1;
        match self.inodes.get_mut(&ino).map(|i| &mut i.body) {
            Some(Body::Dir { live, durable }) => {
                durable.clone_from(live);
                Ok(())
            }
            Some(Body::File { .. }) => Err(libc::ENOTDIR),
            None => Err(libc::ENOENT),
        }
    }

    pub(crate) fn unlink(&mut self, parent: u64, name: &OsStr) -> Result<(), Errno> {
        self.op()?;
        let ino = self.lookup(parent, name)?;
        if self.get(ino)?.is_dir() {
            return Err(libc::EISDIR);
        }
        // The inode stays: an open file keeps working, and a durable
        // entry elsewhere may still name it.
        self.entries_mut(parent)?.remove(name);
        self.touch(parent);
        Ok(())
    }

    pub(crate) fn rmdir(&mut self, parent: u64, name: &OsStr) -> Result<(), Errno> {
        self.op()?;
        let ino = self.lookup(parent, name)?;
        if !self.entries(ino)?.is_empty() {
            return Err(libc::ENOTEMPTY);
        }
        self.entries_mut(parent)?.remove(name);
        self.touch(parent);
        Ok(())
    }

    pub(crate) fn rename(
        &mut self,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        noreplace: bool,
    ) -> Result<(), Errno> {
        self.op()?;
        let ino = self.lookup(parent, name)?;
        let src_dir = self.get(ino)?.is_dir();
        if let Ok(old) = self.lookup(newparent, newname) {
            if noreplace {
                return Err(libc::EEXIST);
            }
            if old == ino {
                return Ok(());
            }
            match (src_dir, self.get(old)?.is_dir()) {
                (true, true) if !self.entries(old)?.is_empty() => return Err(libc::ENOTEMPTY),
                (false, true) => return Err(libc::EISDIR),
                (true, false) => return Err(libc::ENOTDIR),
                _ => {}
            }
        }
        if src_dir && self.is_within(newparent, ino) {
            return Err(libc::EINVAL);
        }
        self.entries_mut(parent)?.remove(name);
        self.entries_mut(newparent)?
            .insert(newname.to_os_string(), ino);
        self.touch(parent);
        self.touch(newparent);
        Ok(())
    }

    /// Whether `dir` is `ancestor` or below it (a directory renamed into
    /// itself).
    fn is_within(&self, dir: u64, ancestor: u64) -> bool {
        if dir == ancestor {
            return true;
        }
        let mut stack = vec![ancestor];
        let mut seen = HashSet::new();
        while let Some(d) = stack.pop() {
            if !seen.insert(d) {
                continue;
            }
            if let Ok(e) = self.entries(d) {
                for c in e.values() {
                    if *c == dir {
                        return true;
                    }
                    stack.push(*c);
                }
            }
        }
        false
    }

    pub(crate) fn link(&mut self, ino: u64, newparent: u64, newname: &OsStr) -> Result<(), Errno> {
        self.op()?;
        if self.get(ino)?.is_dir() {
            return Err(libc::EPERM);
        }
        if self.entries(newparent)?.contains_key(newname) {
            return Err(libc::EEXIST);
        }
        self.entries_mut(newparent)?
            .insert(newname.to_os_string(), ino);
        Ok(())
    }

    /// Power comes back: the tree as the durable state has it (see the
    /// module doc). Unsynced file bytes are dropped (70 %), kept whole
    /// (15 %) or torn at a page boundary (15 %), seeded, as a real disk's
    /// write-back may have done. Clears the crash.
    pub(crate) fn cut(&mut self) -> CutReport {
        let mut rep = CutReport::default();
        let mut next: HashMap<u64, Inode> = HashMap::new();
        let mut stack = vec![ROOT];
        let mut seen = HashSet::new();
        while let Some(ino) = stack.pop() {
            if !seen.insert(ino) {
                continue;
            }
            let Some(old) = self.inodes.get(&ino) else {
                continue;
            };
            let body = match &old.body {
                Body::Dir { live, durable } => {
                    rep.entries_dropped += live
                        .iter()
                        .filter(|(n, i)| durable.get(*n) != Some(*i))
                        .count() as u64;
                    rep.entries_restored += durable
                        .iter()
                        .filter(|(n, i)| live.get(*n) != Some(*i))
                        .count() as u64;
                    let kept: BTreeMap<OsString, u64> = durable
                        .iter()
                        .filter(|(_, i)| self.inodes.contains_key(i))
                        .map(|(n, i)| (n.clone(), *i))
                        .collect();
                    stack.extend(kept.values().copied());
                    Body::Dir {
                        live: kept.clone(),
                        durable: kept,
                    }
                }
                Body::File { live, durable } => {
                    let bytes = if live == durable {
                        durable.clone()
                    } else {
                        let draw = self.rng.random_range(0..100u32);
                        if draw < 70 {
                            rep.files_dropped += 1;
                            durable.clone()
                        } else if draw < 85 {
                            rep.files_kept += 1;
                            live.clone()
                        } else {
                            rep.files_torn += 1;
                            let pages = live.len().max(durable.len()).div_ceil(PAGE_BYTES);
                            let cut = self.rng.random_range(0..=pages) * PAGE_BYTES;
                            let len = if self.rng.random_bool(0.5) {
                                live.len()
                            } else {
                                durable.len()
                            };
                            (0..len)
                                .map(|i| {
                                    let src = if i < cut { live } else { durable };
                                    src.get(i).copied().unwrap_or(0)
                                })
                                .collect()
                        }
                    };
                    Body::File {
                        live: bytes.clone(),
                        durable: bytes,
                    }
                }
            };
            next.insert(
                ino,
                Inode {
                    body,
                    mode: old.mode,
                    mtime: old.mtime,
                },
            );
        }
        self.inodes = next;
        self.crashed = false;
        self.crash_at = None;
        rep
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn name(s: &str) -> &OsStr {
        OsStr::new(s)
    }

    #[test]
    fn unsynced_entries_and_bytes_are_taken_back() {
        let mut m = Model::new(1);
        let d = m.mkdir(ROOT, name("d"), 0o755).unwrap();
        m.fsyncdir(ROOT).unwrap();
        let a = m.create(d, name("a"), 0o644, libc::O_EXCL).unwrap();
        m.write(a, 0, b"durable", false).unwrap();
        m.fsync(a).unwrap();
        m.fsyncdir(d).unwrap();
        let c = m.create(d, name("c"), 0o644, libc::O_EXCL).unwrap();
        m.write(c, 0, b"dsync", true).unwrap();
        m.rename(d, name("c"), d, name("c2"), true).unwrap();
        m.fsyncdir(d).unwrap();
        m.unlink(d, name("a")).unwrap();
        // Bytes synced, name never: gone.
        let b = m.create(d, name("b"), 0o644, libc::O_EXCL).unwrap();
        m.write(b, 0, b"lost name", false).unwrap();
        m.fsync(b).unwrap();
        m.crash_now();
        assert_eq!(m.write(c, 0, b"x", false), Err(libc::EIO));
        let r = m.cut();
        assert_eq!(r.entries_restored, 1, "{r:?}");
        let d = m.lookup(ROOT, name("d")).unwrap();
        let a = m.lookup(d, name("a")).unwrap();
        assert_eq!(m.read(a, 0, 100).unwrap(), b"durable");
        assert_eq!(m.lookup(d, name("b")), Err(libc::ENOENT));
        let c = m.lookup(d, name("c2")).unwrap();
        assert_eq!(m.read(c, 0, 100).unwrap(), b"dsync");
    }

    #[test]
    fn a_directory_entry_needs_its_own_directory_fsync() {
        let mut m = Model::new(2);
        m.mkdir(ROOT, name("d"), 0o755).unwrap();
        let d = m.lookup(ROOT, name("d")).unwrap();
        let f = m.create(d, name("f"), 0o644, 0).unwrap();
        m.fsync(f).unwrap();
        m.fsyncdir(d).unwrap();
        m.cut();
        assert_eq!(m.lookup(ROOT, name("d")), Err(libc::ENOENT));
    }

    #[test]
    fn the_crash_point_counts_operations() {
        let mut m = Model::new(3);
        m.set_crash_at(Some(2));
        m.mkdir(ROOT, name("a"), 0o755).unwrap();
        m.fsyncdir(ROOT).unwrap();
        assert_eq!(m.mkdir(ROOT, name("b"), 0o755), Err(libc::EIO));
        assert!(m.crashed());
        m.cut();
        assert!(m.lookup(ROOT, name("a")).is_ok());
        assert!(m.mkdir(ROOT, name("c"), 0o755).is_ok());
    }
}
