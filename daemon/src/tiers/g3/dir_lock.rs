//! Exclusive ownership of a G3 directory: `flock(LOCK_EX|LOCK_NB)` on
//! `<root>/kvtierd.lock`, taken by [`super::G3Store::open`] right after the
//! root exists and before anything in it is read, created or moved
//! (recovery, the index, a damaged index set aside, quarantine trimming).
//!
//! The holder writes its pid and a note (kvtierd: its socket) into the file
//! so that a second opener's refusal names it. The lock is the kernel's:
//! a holder killed with -9 releases it with its last fd, so no stale file
//! ever blocks a restart; the file's content only feeds the message.
//! `flock` locks belong to the open file description, so a second open in
//! the same process is refused too.
//!
//! API boundary: only this file knows the lock file's name and format.

use crate::base::error::{Error, Result};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Name of the lock file under the G3 root.
pub const LOCK_FILE: &str = "kvtierd.lock";

/// Bytes of the lock file read for the refusal message at most.
const NOTE_BYTES_MAX: u64 = 4096;

/// A held lock; released when dropped (or when the process dies).
#[derive(Debug)]
pub(crate) struct DirLock {
    _file: File,
}

impl DirLock {
    /// Takes the lock of `root` (which must exist) or fails at once with
    /// [`Error::InUse`] naming the holder. `note` is written beside the
    /// pid for the next opener's message.
    pub(crate) fn take(root: &Path, note: &str) -> Result<DirLock> {
        let path = root.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| Error::io("opening the lock file", &path, e))?;
        // SAFETY: flock on an fd this function owns; no memory is touched.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(Error::io("locking", &path, err));
            }
            return Err(Error::InUse {
                dir: root.to_path_buf(),
                lock_file: path.clone(),
                holder: holder_of(&mut file),
            });
        }
        // Best effort: the lock is held whatever the note says.
        let line = format!("pid {} {}\n", std::process::id(), note.trim());
        let written = file
            .set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(line.as_bytes()));
        if let Err(e) = written {
            tracing::warn!(path = %path.display(), error = %e, "g3: cannot write the lock file's note");
        }
        Ok(DirLock { _file: file })
    }
}

/// What the holder wrote, on one line ("unknown" while it is still
/// starting and has not written it yet).
fn holder_of(file: &mut File) -> String {
    let mut text = String::new();
    let _ = file.rewind();
    let _ = file.take(NOTE_BYTES_MAX).read_to_string(&mut text);
    let text = text.trim();
    if text.is_empty() {
        "unknown (it has not written its pid yet)".into()
    } else {
        text.lines().next().unwrap_or_default().to_string()
    }
}

/// The lock file of a G3 root (for messages and docs).
pub fn lock_file(root: &Path) -> PathBuf {
    root.join(LOCK_FILE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_naming_the_holder_and_freed_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let a = DirLock::take(dir.path(), "socket /run/a.sock").unwrap();
        let e = DirLock::take(dir.path(), "socket /run/b.sock").unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        assert!(msg.contains("socket /run/a.sock"), "{msg}");
        drop(a);
        let _b = DirLock::take(dir.path(), "socket /run/b.sock").unwrap();
    }

    #[test]
    fn a_symlinked_lock_file_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::NamedTempFile::new().unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join(LOCK_FILE)).unwrap();
        assert!(DirLock::take(dir.path(), "x").is_err());
        assert_eq!(std::fs::read(outside.path()).unwrap(), b"");
    }
}
