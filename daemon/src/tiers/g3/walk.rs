//! A directory walk that stays inside the directory it starts in: it
//! follows no symbolic link and crosses no filesystem.
//!
//! Contract of [`walk`] (recovery uses it for `blocks/` and `tmp/`; it is
//! meant for any walk of a data directory, e.g. tightening modes):
//! - The start directory is opened `O_DIRECTORY|O_NOFOLLOW`: a start that
//!   is a symlink is an error (`ELOOP`/`ENOTDIR`), never followed. Its
//!   device (`st_dev`) is the walk's device.
//! - Every entry of a directory is handed to the closure once, in no
//!   particular order, with its parent's fd, name, path and [`Kind`]. The
//!   names of a directory are read before the first of them is handed out,
//!   so the closure may rename or remove entries (its own included).
//! - A [`Kind::Symlink`] is reported and never followed; a directory on
//!   another filesystem (a mount point: `st_dev` differs) is reported as
//!   [`Kind::OtherFs`] and never entered.
//! - The walk descends into a [`Kind::Dir`] only when the closure answers
//!   [`Step::Descend`], by `openat(parent, name, O_DIRECTORY|O_NOFOLLOW)`
//!   and an `fstat` of what was opened that must show the walk's device
//!   (a directory swapped for a link or a mount between the closure's
//!   look and the open is refused). A directory that cannot be opened so
//!   is handed to the closure again as [`Kind::Unlistable`] with the error.
//! - At most [`DEPTH_MAX`] levels are entered; deeper directories are
//!   reported and not entered.
//! - Cost: one `getdents` pass per directory, one `fstatat` per directory
//!   entry (and per entry whose type `getdents` does not give); regular
//!   files are not stat'ed (recovery of a million blocks stays a names
//!   walk). [`Entry::stat`] and [`Entry::open`] are there when a caller
//!   needs more.
//!
//! Acting on an entry without following links: use [`Entry::open`]
//! (`openat` with `O_NOFOLLOW`, device checked) and act on the fd
//! (`fchmod`, `fstat`, reads), or the parent's [`Entry::dir`] with
//! `*at` calls. [`Entry::path`] is for messages and for calls that do not
//! follow the last component (rename, unlink).

use nix::fcntl::{openat, AtFlags, OFlag};
use nix::sys::stat::{fstat, fstatat, FileStat, Mode};
use std::ffi::{CStr, OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, IntoRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Levels below the start directory the walk enters at most.
pub(crate) const DEPTH_MAX: usize = 16;

/// What an entry is (`lstat` semantics: a link is a link).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A regular file.
    File,
    /// A directory on the walk's filesystem.
    Dir,
    /// A symbolic link (never followed).
    Symlink,
    /// A directory on another filesystem (never entered).
    OtherFs,
    /// A directory the walk could not open (see [`Entry::error`]).
    Unlistable,
    /// Anything else (socket, fifo, device).
    Other,
}

/// The closure's answer for an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Enter this directory (ignored for anything but [`Kind::Dir`]).
    Descend,
    /// Do not enter it (or: nothing to enter).
    Skip,
}

/// One directory entry, as handed to the closure.
#[derive(Debug)]
pub(crate) struct Entry<'a> {
    dir: BorrowedFd<'a>,
    name: &'a OsStr,
    path: PathBuf,
    depth: usize,
    kind: Kind,
    dev: u64,
    error: Option<&'a io::Error>,
}

// `dir` and `stat` are for walks that act on entries with `*at` calls or
// compare modes (tightening a tree's modes); recovery needs neither.
#[allow(dead_code)]
impl Entry<'_> {
    /// The parent directory (opened without following links).
    pub(crate) fn dir(&self) -> BorrowedFd<'_> {
        self.dir
    }

    /// The entry's name in its parent.
    pub(crate) fn name(&self) -> &OsStr {
        self.name
    }

    /// The entry's path (start directory joined with the names below it).
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// 1 for the start directory's own entries.
    pub(crate) fn depth(&self) -> usize {
        self.depth
    }

    /// What it is.
    pub(crate) fn kind(&self) -> Kind {
        self.kind
    }

    /// Why a [`Kind::Unlistable`] directory could not be entered.
    pub(crate) fn error(&self) -> Option<&io::Error> {
        self.error
    }

    /// `fstatat(parent, name, AT_SYMLINK_NOFOLLOW)`.
    pub(crate) fn stat(&self) -> io::Result<FileStat> {
        fstatat(self.dir, self.name, AtFlags::AT_SYMLINK_NOFOLLOW).map_err(io::Error::from)
    }

    /// Opens the entry (`flags` plus `O_NOFOLLOW|O_CLOEXEC`) and checks
    /// that what was opened is on the walk's filesystem: a link or a
    /// mount swapped in since the walk looked is refused.
    pub(crate) fn open(&self, flags: OFlag) -> io::Result<OwnedFd> {
        let fd = openat(
            self.dir,
            self.name,
            flags | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(io::Error::from)?;
        let st = fstat(&fd).map_err(io::Error::from)?;
        if st.st_dev != self.dev {
            return Err(io::Error::other(format!(
                "{} is on another filesystem",
                self.path.display()
            )));
        }
        Ok(fd)
    }

    /// [`Entry::open`] read-only, as a `File`.
    pub(crate) fn open_file(&self) -> io::Result<File> {
        self.open(OFlag::O_RDONLY).map(File::from)
    }
}

/// Walks `start` (see the module doc); `f` sees every entry and says
/// whether to enter a directory. Fails only if `start` itself cannot be
/// opened as a directory without following a link.
pub(crate) fn walk(start: &Path, f: &mut dyn FnMut(&Entry<'_>) -> Step) -> io::Result<()> {
    let fd = open_dir_nofollow(start)?;
    let dev = fstat(&fd).map_err(io::Error::from)?.st_dev;
    walk_dir(fd, start, 1, dev, f);
    Ok(())
}

/// Opens `path` as a directory without following a link in its last
/// component.
pub(crate) fn open_dir_nofollow(path: &Path) -> io::Result<OwnedFd> {
    nix::fcntl::open(
        path,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| {
        io::Error::new(
            io::Error::from(e).kind(),
            format!(
                "{} is not a directory of its own (a symlink is not followed): {e}",
                path.display()
            ),
        )
    })
}

/// Checks that `path` is a real directory (not a link) on filesystem
/// `dev`: the fixed directories of a data directory must be, else a walk
/// or a trim of them would act outside it.
pub(crate) fn check_own_dir(path: &Path, dev: u64) -> io::Result<()> {
    let fd = open_dir_nofollow(path)?;
    let st = fstat(&fd).map_err(io::Error::from)?;
    if st.st_dev != dev {
        return Err(io::Error::other(format!(
            "{} is on another filesystem than the data directory",
            path.display()
        )));
    }
    Ok(())
}

fn walk_dir(
    fd: OwnedFd,
    path: &Path,
    depth: usize,
    dev: u64,
    f: &mut dyn FnMut(&Entry<'_>) -> Step,
) {
    let names = match list(&fd) {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "walk: cannot list a directory");
            return;
        }
    };
    for (name, dtype) in names {
        let kind = kind_of(fd.as_fd(), &name, dtype, dev);
        let mut e = Entry {
            dir: fd.as_fd(),
            name: &name,
            path: path.join(&name),
            depth,
            kind,
            dev,
            error: None,
        };
        if f(&e) != Step::Descend || kind != Kind::Dir {
            continue;
        }
        if depth >= DEPTH_MAX {
            tracing::warn!(path = %e.path.display(), "walk: deeper than {DEPTH_MAX} levels; not entered");
            continue;
        }
        match e.open(OFlag::O_RDONLY | OFlag::O_DIRECTORY) {
            Ok(sub) => {
                let sub_path = e.path.clone();
                walk_dir(sub, &sub_path, depth + 1, dev, f);
            }
            Err(err) => {
                e.kind = Kind::Unlistable;
                e.error = Some(&err);
                f(&e);
            }
        }
    }
}

/// The names in a directory (without `.` and `..`) and their `d_type`
/// as `getdents` gives them (`DT_UNKNOWN` on filesystems that do not).
fn list(fd: &OwnedFd) -> io::Result<Vec<(OsString, u8)>> {
    let raw = fd.try_clone()?.into_raw_fd();
    // SAFETY: `raw` is a fresh duplicate that fdopendir takes over (closed
    // by closedir below, or here if fdopendir fails).
    let dir = unsafe { libc::fdopendir(raw) };
    if dir.is_null() {
        let e = io::Error::last_os_error();
        // SAFETY: fdopendir failed, so `raw` is still ours to close.
        unsafe { libc::close(raw) };
        return Err(e);
    }
    let mut out = Vec::new();
    let mut failed = None;
    loop {
        // SAFETY: errno is thread-local; cleared to tell the end from an error.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: `dir` is a valid DIR* until closedir.
        let ent = unsafe { libc::readdir(dir) };
        if ent.is_null() {
            let e = io::Error::last_os_error();
            if e.raw_os_error().is_some_and(|c| c != 0) {
                failed = Some(e);
            }
            break;
        }
        // SAFETY: readdir returned a valid entry with a NUL-terminated name,
        // valid until the next readdir; it is copied out at once.
        let (name, dtype) = unsafe {
            (
                CStr::from_ptr((*ent).d_name.as_ptr()).to_bytes(),
                (*ent).d_type,
            )
        };
        if name == b"." || name == b".." {
            continue;
        }
        out.push((OsStr::from_bytes(name).to_os_string(), dtype));
    }
    // SAFETY: `dir` is valid and closed once.
    unsafe { libc::closedir(dir) };
    match failed {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

fn kind_of(dir: BorrowedFd<'_>, name: &OsStr, dtype: u8, dev: u64) -> Kind {
    match dtype {
        libc::DT_REG => return Kind::File,
        libc::DT_LNK => return Kind::Symlink,
        libc::DT_DIR | libc::DT_UNKNOWN => {}
        _ => return Kind::Other,
    }
    let Ok(st) = fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) else {
        // Gone since it was listed, or unreadable: nothing to enter.
        return Kind::Other;
    };
    match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => Kind::File,
        libc::S_IFLNK => Kind::Symlink,
        libc::S_IFDIR if st.st_dev != dev => Kind::OtherFs,
        libc::S_IFDIR => Kind::Dir,
        _ => Kind::Other,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn links_are_reported_never_followed() {
        let d = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"x").unwrap();
        std::fs::create_dir_all(d.path().join("a/b")).unwrap();
        std::fs::write(d.path().join("a/b/f"), b"y").unwrap();
        std::os::unix::fs::symlink(outside.path(), d.path().join("a/link")).unwrap();
        let mut seen = BTreeMap::new();
        walk(d.path(), &mut |e| {
            let rel = e.path().strip_prefix(d.path()).unwrap().to_path_buf();
            seen.insert(rel, (e.kind(), e.depth()));
            Step::Descend
        })
        .unwrap();
        let want: BTreeMap<PathBuf, (Kind, usize)> = [
            ("a", (Kind::Dir, 1)),
            ("a/b", (Kind::Dir, 2)),
            ("a/b/f", (Kind::File, 3)),
            ("a/link", (Kind::Symlink, 2)),
        ]
        .into_iter()
        .map(|(p, k)| (PathBuf::from(p), k))
        .collect();
        assert_eq!(seen, want);
    }

    #[test]
    fn a_start_that_is_a_link_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let link = d.path().join("blocks");
        std::os::unix::fs::symlink(outside.path(), &link).unwrap();
        assert!(walk(&link, &mut |_| Step::Descend).is_err());
        assert!(check_own_dir(&link, 0).is_err());
    }

    #[test]
    fn the_closure_may_remove_what_it_is_shown() {
        let d = tempfile::tempdir().unwrap();
        for i in 0..50 {
            std::fs::write(d.path().join(format!("f{i}")), b"").unwrap();
        }
        let mut n = 0;
        walk(d.path(), &mut |e| {
            std::fs::remove_file(e.path()).unwrap();
            n += 1;
            Step::Skip
        })
        .unwrap();
        assert_eq!(n, 50);
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    }
}
