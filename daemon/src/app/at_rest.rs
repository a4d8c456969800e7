//! Data at rest readable only by the daemon's user: tenants' KV blocks are
//! their prompts. kvtierd sets a umask of 077 before it creates anything
//! (new G3 directories 0700, block files, `index.redb` and a `file://` G4
//! store's objects 0600), and tightens trees an earlier version left open
//! (0755 directories, 0644 files) at start.
//!
//! The walk is G3's (`g3/walk.rs`): it never follows a symbolic link
//! below its root and crosses no filesystem; every change is an `fchmod`
//! on an fd opened with `O_NOFOLLOW` whose `fstat` was just checked, so a
//! user who can write into the tree cannot swap in a link and have the
//! daemon change a file elsewhere. Links are counted and left alone. The
//! root itself is configuration (`g3.dir`, the `file://` path) and may be
//! a link: it is resolved once.

use crate::base::error::{Error, Result};
use crate::tiers::g3::walk::{self, Entry, Kind, Step};
use nix::fcntl::OFlag;
use nix::sys::stat::{fchmod, fstat, FileStat, Mode, SFlag};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

/// The daemon's umask: nothing it creates is readable by group or others.
pub const PRIVATE_UMASK: u32 = 0o077;

/// Sets [`PRIVATE_UMASK`] for the whole process (call first thing, before
/// any thread or file exists); returns the previous umask.
pub fn set_private_umask() -> u32 {
    nix::sys::stat::umask(Mode::from_bits_truncate(PRIVATE_UMASK)).bits()
}

/// What [`tighten_tree`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tightened {
    /// Directories made 0700 (owner bits kept, group/other cleared).
    pub dirs: u64,
    /// Files made owner-only.
    pub files: u64,
    /// Symbolic links found and left alone (never followed).
    pub links_skipped: u64,
}

impl Tightened {
    /// Whether anything was changed.
    pub fn changed(&self) -> bool {
        self.dirs + self.files > 0
    }
}

fn is(st: &FileStat, kind: SFlag) -> bool {
    SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == kind
}

/// Clears group and other bits of the open `fd` if any are set.
fn restrict(fd: impl AsFd, st: &FileStat) -> std::result::Result<bool, nix::errno::Errno> {
    let mode = st.st_mode & 0o7777;
    if mode & PRIVATE_UMASK == 0 {
        return Ok(false);
    }
    fchmod(fd, Mode::from_bits_truncate(mode & 0o700))?;
    Ok(true)
}

/// Makes every directory under `root` (and `root`) 0700 and every regular
/// file owner-only, without following links below `root`. A missing root
/// is nothing to do.
pub fn tighten_tree(root: &Path) -> Result<Tightened> {
    let root = match std::fs::canonicalize(root) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Tightened::default()),
        Err(e) => return Err(Error::io("resolving a data directory", root, e)),
    };
    let mut t = Tightened::default();
    let dir = walk::open_dir_nofollow(&root)
        .map_err(|e| Error::io("opening a data directory", &root, e))?;
    let st = fstat(&dir).map_err(|e| Error::io("stat of a data directory", &root, e.into()))?;
    if restrict(&dir, &st)
        .map_err(|e| Error::io("restricting a data directory", &root, e.into()))?
    {
        t.dirs += 1;
    }
    let mut failed = None;
    walk::walk(&root, &mut |e| {
        match tighten_entry(e, &mut t) {
            Ok(()) => {}
            Err(err) => {
                failed.get_or_insert(err);
            }
        }
        Step::Descend
    })
    .map_err(|e| Error::io("walking a data directory", &root, e))?;
    match failed {
        Some(e) => Err(e),
        None => Ok(t),
    }
}

fn tighten_entry(e: &Entry<'_>, t: &mut Tightened) -> Result<()> {
    let path = e.path();
    // Gone, or swapped for a link or a mount since the walk looked: not ours.
    let gone = |err: &std::io::Error| {
        matches!(
            err.raw_os_error(),
            Some(libc::ENOENT | libc::ELOOP | libc::ENOTDIR)
        ) || err.kind() == std::io::ErrorKind::Other
    };
    let (flags, files) = match e.kind() {
        Kind::Symlink => {
            t.links_skipped += 1;
            return Ok(());
        }
        Kind::Dir => (OFlag::O_RDONLY | OFlag::O_DIRECTORY, false),
        // NONBLOCK|NOCTTY: harmless even if a fifo or tty was swapped in
        // since the walk looked; the fstat below decides.
        Kind::File => (OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY, true),
        Kind::Unlistable => {
            return Err(Error::io(
                "opening a data directory",
                path,
                std::io::Error::other(e.error().map_or_else(String::new, |x| x.to_string())),
            ))
        }
        Kind::OtherFs | Kind::Other => return Ok(()),
    };
    let fd = match e.open(flags) {
        Ok(fd) => fd,
        Err(err) if gone(&err) => return Ok(()),
        Err(err) => return Err(Error::io("opening in a data directory", path, err)),
    };
    let st = fstat(&fd).map_err(|x| Error::io("stat in a data directory", path, x.into()))?;
    let want = if files {
        SFlag::S_IFREG
    } else {
        SFlag::S_IFDIR
    };
    if is(&st, want)
        && restrict(&fd, &st)
            .map_err(|x| Error::io("restricting in a data directory", path, x.into()))?
    {
        if files {
            t.files += 1;
        } else {
            t.dirs += 1;
        }
    }
    Ok(())
}

/// Tightens each of `roots` and logs what changed (an upgrade from a
/// version without the umask, or files copied in by hand).
pub fn tighten_and_log(roots: &[PathBuf]) -> Result<()> {
    for root in roots {
        let t = tighten_tree(root)?;
        if t.changed() {
            tracing::warn!(
                dir = %root.display(),
                dirs = t.dirs,
                files = t.files,
                "data at rest was readable by other users: made readable by the daemon's user only"
            );
        }
        if t.links_skipped > 0 {
            tracing::info!(
                dir = %root.display(),
                links = t.links_skipped,
                "symbolic links in a data directory left alone (never followed)"
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn open_trees_are_tightened_and_links_never_followed() {
        let base = tempfile::tempdir().unwrap();
        let root = base.path().join("g3");
        let deep = root.join("blocks/ab/cd");
        std::fs::create_dir_all(&deep).unwrap();
        let file = deep.join("block");
        std::fs::write(&file, b"kv").unwrap();
        let outside = base.path().join("outside");
        std::fs::write(&outside, b"not ours").unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        std::os::unix::fs::symlink(base.path(), root.join("blocks/dirlink")).unwrap();
        for p in [&root, &root.join("blocks"), &deep] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755)).unwrap();

        let t = tighten_tree(&root).unwrap();
        assert_eq!(t.files, 1);
        assert_eq!(t.links_skipped, 2);
        assert!(t.dirs >= 3, "{t:?}");
        assert_eq!(mode(&root), 0o700);
        assert_eq!(mode(&deep), 0o700);
        assert_eq!(mode(&file), 0o600);
        // Link targets untouched.
        assert_eq!(mode(&outside), 0o644);
        assert_eq!(mode(base.path()), 0o755);
        // A second pass has nothing to do.
        assert!(!tighten_tree(&root).unwrap().changed());
        assert_eq!(
            tighten_tree(&base.path().join("missing")).unwrap(),
            Tightened::default()
        );
    }
}
