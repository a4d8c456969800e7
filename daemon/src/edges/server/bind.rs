//! Binding the socket without giving anyone a lever on root's chmod/chown.
//!
//! The socket's mode and group used to be set by path after `bind`, so a
//! user who could write the socket's directory could swap a symlink in
//! between and have a root-owned file made `0660 root:kvtier`. Now:
//! - the socket directory is refused when a user other than the daemon's
//!   (or root) owns it, or when group or others may write it and it is not
//!   sticky (in a sticky directory nobody else may rename or delete the
//!   daemon's entries);
//! - the socket is bound inside a fresh private directory (mkdtemp, 0700,
//!   in the socket directory), given its mode and group there (nobody else
//!   can reach that name), and renamed into place: it appears at its path
//!   with its final mode and group, atomically, and no step follows a link.
//! - a link on the way to the socket directory that a user other than
//!   root (or the daemon's) owns is refused: its owner could re-point it
//!   while the daemon runs;
//! - the directory stays open: a stale socket is removed, and the socket
//!   at shutdown, relative to it (never through a path re-pointed since),
//!   and the socket only while it is still the inode bound ([`SocketFile`]).

use crate::base::error::{Error, Result};
use nix::fcntl::{renameat2, AtFlags, OFlag, RenameFlags};
use nix::sys::stat::{fchmodat, fstat, FchmodatFlags, Mode};
use std::ffi::{OsStr, OsString};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

fn refuse(problem: String) -> Error {
    Error::Config {
        key: "server.socket".into(),
        problem,
    }
}

fn errno(op: &'static str, path: &Path, e: nix::errno::Errno) -> Error {
    Error::io(op, path, std::io::Error::from(e))
}

/// Mode of directories the daemon creates for the socket: traversable by
/// the workers (the socket's own mode and group decide who connects).
const SOCKET_DIR_MODE: u32 = 0o755;

/// Creates the missing directories of `dir` (each made 0755 through its own
/// fd: the process umask is 077) and opens `dir`.
fn open_socket_dir(dir: &Path) -> Result<OwnedFd> {
    let mut missing = Vec::new();
    for a in dir.ancestors() {
        if a.as_os_str().is_empty() || std::fs::symlink_metadata(a).is_ok() {
            break;
        }
        missing.push(a.to_path_buf());
    }
    for m in missing.iter().rev() {
        match std::fs::create_dir(m) {
            Ok(()) => {
                let fd = nix::fcntl::open(
                    m.as_path(),
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| errno("opening the socket directory", m, e))?;
                nix::sys::stat::fchmod(&fd, Mode::from_bits_truncate(SOCKET_DIR_MODE))
                    .map_err(|e| errno("setting the socket directory's mode", m, e))?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(Error::io("creating the socket directory", m, e)),
        }
    }
    nix::fcntl::open(
        dir,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| errno("opening the socket directory", dir, e))
}

/// Refuses a socket directory another user could swap entries in.
fn check_socket_dir(dir: &Path, fd: &OwnedFd) -> Result<()> {
    let st = fstat(fd).map_err(|e| errno("stat of the socket directory", dir, e))?;
    let me = nix::unistd::geteuid().as_raw();
    if st.st_uid != me && st.st_uid != 0 {
        return Err(refuse(format!(
            "{} is owned by uid {}, who could replace the socket with a link; \
             use a directory owned by the daemon's user (or root)",
            dir.display(),
            st.st_uid
        )));
    }
    let sticky = st.st_mode & libc::S_ISVTX != 0;
    if st.st_mode & 0o022 != 0 && !sticky {
        return Err(refuse(format!(
            "{} (mode {:o}) may be written by other users and is not sticky; \
             use a directory only the daemon's user can write (e.g. /run/kvtier, 0750)",
            dir.display(),
            st.st_mode & 0o7777
        )));
    }
    Ok(())
}

/// Refuses a symbolic link on the way to `dir` (the directory itself
/// included) owned by a user other than root or the daemon's: that user
/// could re-point it at another directory while the daemon runs.
fn check_links(dir: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let me = nix::unistd::geteuid().as_raw();
    let mut at = PathBuf::new();
    for c in dir.components() {
        at.push(c);
        let Ok(m) = std::fs::symlink_metadata(&at) else {
            continue;
        };
        if m.file_type().is_symlink() && m.uid() != 0 && m.uid() != me {
            return Err(refuse(format!(
                "{} is a symbolic link owned by uid {}, who could re-point it; \
                 use a path whose links root (or the daemon's user) owns",
                at.display(),
                m.uid()
            )));
        }
    }
    Ok(())
}

/// The socket file as bound: removed on [`SocketFile::remove`] or drop,
/// relative to the directory opened at bind, and only while that name is
/// still the inode bound (never a file or another process's socket that
/// replaced it).
pub(super) struct SocketFile {
    dir_fd: OwnedFd,
    name: OsString,
    /// `(st_dev, st_ino)` of the socket bound; `None` once removed.
    bound: Option<(u64, u64)>,
}

impl SocketFile {
    /// Removes the socket file if it is still the one bound.
    pub(super) fn remove(&mut self) {
        let Some(bound) = self.bound.take() else {
            return;
        };
        let now = nix::sys::stat::fstatat(
            &self.dir_fd,
            self.name.as_os_str(),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        );
        match now {
            Ok(st) if (st.st_dev, st.st_ino) == bound => {
                let _ = nix::unistd::unlinkat(
                    &self.dir_fd,
                    self.name.as_os_str(),
                    nix::unistd::UnlinkatFlags::NoRemoveDir,
                );
            }
            Ok(_) => tracing::warn!(
                name = %self.name.to_string_lossy(),
                "the socket path names another file than the socket bound; left alone"
            ),
            Err(_) => {}
        }
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        self.remove();
    }
}

/// A stale socket at `name` (nobody listens) is removed; anything else
/// there refuses the start.
fn clear_stale(dir_fd: &OwnedFd, name: &OsStr, path: &Path) -> Result<()> {
    let Ok(st) = nix::sys::stat::fstatat(dir_fd, name, AtFlags::AT_SYMLINK_NOFOLLOW) else {
        return Ok(());
    };
    if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        // Never delete what is not ours to delete: a config typo
        // pointing at a real file must not destroy it.
        return Err(refuse(format!(
            "{} exists and is not a socket; remove it or choose another path",
            path.display()
        )));
    }
    // Through the directory held open, not the path.
    let via = Path::new("/proc/self/fd")
        .join(dir_fd.as_raw_fd().to_string())
        .join(name);
    if UnixStream::connect(&via).is_ok() {
        return Err(refuse(format!(
            "{} is in use by a running daemon",
            path.display()
        )));
    }
    nix::unistd::unlinkat(dir_fd, name, nix::unistd::UnlinkatFlags::NoRemoveDir)
        .map_err(|e| errno("removing stale socket", path, e))
}

/// Binds `path` with `mode` and `gid` (see the module docs), replacing a
/// stale socket and refusing anything else at `path`.
pub(super) fn bind_private(
    path: &Path,
    mode: u32,
    gid: Option<u32>,
) -> Result<(UnixListener, SocketFile)> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| refuse(format!("{} names no file", path.display())))?;
    check_links(dir)?;
    let dir_fd = open_socket_dir(dir)?;
    check_socket_dir(dir, &dir_fd)?;
    clear_stale(&dir_fd, name, path)?;
    let private = nix::unistd::mkdtemp(&dir.join(".kvtierd-bind.XXXXXX"))
        .map_err(|e| errno("creating a private bind directory", dir, e))?;
    let done = bind_in(&private, &dir_fd, name.as_bytes(), mode, gid, path);
    // The private directory is empty after a successful rename; on failure
    // its socket goes first.
    let _ = std::fs::remove_file(private.join("s"));
    let _ = std::fs::remove_dir(&private);
    let (listener, bound) = done?;
    Ok((
        listener,
        SocketFile {
            dir_fd,
            name: name.to_os_string(),
            bound: Some(bound),
        },
    ))
}

fn bind_in(
    private: &Path,
    dir_fd: &OwnedFd,
    name: &[u8],
    mode: u32,
    gid: Option<u32>,
    path: &Path,
) -> Result<(UnixListener, (u64, u64))> {
    let priv_fd = nix::fcntl::open(
        private,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| errno("opening the private bind directory", private, e))?;
    let listener = UnixListener::bind(private.join("s"))
        .map_err(|e| Error::io("binding the socket", path, e))?;
    // Within a 0700 directory of ours: nothing can be swapped in; a socket
    // is never a link, and chown does not follow one either way.
    fchmodat(
        &priv_fd,
        "s",
        Mode::from_bits_truncate(mode),
        FchmodatFlags::FollowSymlink,
    )
    .map_err(|e| errno("setting socket permissions", path, e))?;
    if let Some(g) = gid {
        nix::unistd::fchownat(
            &priv_fd,
            "s",
            None,
            Some(nix::unistd::Gid::from_raw(g)),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| errno("changing the socket's group", path, e))?;
    }
    let st = nix::sys::stat::fstatat(&priv_fd, "s", AtFlags::AT_SYMLINK_NOFOLLOW)
        .map_err(|e| errno("stat of the socket", path, e))?;
    // NOREPLACE: whatever appeared at the path since it was checked (in a
    // sticky directory, someone else's file) is left alone.
    renameat2(
        &priv_fd,
        "s",
        dir_fd,
        std::ffi::OsStr::from_bytes(name),
        RenameFlags::RENAME_NOREPLACE,
    )
    .map_err(|e| errno("moving the socket into place", path, e))?;
    Ok((listener, (st.st_dev, st.st_ino)))
}
