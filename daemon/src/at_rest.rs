//! Data at rest readable only by the daemon's user: tenants' KV blocks are
//! their prompts. kvtierd sets a umask of 077 before it creates anything
//! (new G3 directories 0700, block files, `index.redb` and a `file://` G4
//! store's objects 0600), and tightens trees an earlier version left open
//! (0755 directories, 0644 files) at start.
//!
//! The walk never follows a symbolic link below its root: every step is
//! relative to an open directory fd (`openat` with `O_NOFOLLOW`), every
//! change is an `fchmod` on an fd whose `fstat` was just checked, so a user
//! who can write into the tree cannot swap in a link and have the daemon
//! change a file elsewhere. Links are counted and left alone. The root
//! itself is configuration (`g3.dir`, the `file://` path) and may be a link.
//! A self-contained module so that G3's recovery walk can later share it.

use crate::error::{Error, Result};
use nix::fcntl::{openat, OFlag};
use nix::sys::stat::{fchmod, fstat, fstatat, FileStat, Mode, SFlag};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// The daemon's umask: nothing it creates is readable by group or others.
pub const PRIVATE_UMASK: u32 = 0o077;
/// Deepest directory nesting walked (G3's tree is 4 deep).
pub const WALK_DEPTH_MAX: usize = 16;

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

fn io(op: &'static str, path: &Path, e: nix::errno::Errno) -> Error {
    Error::io(op, path, std::io::Error::from(e))
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
    let dir = match nix::fcntl::open(
        root,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) {
        Ok(d) => d,
        Err(nix::errno::Errno::ENOENT) => return Ok(Tightened::default()),
        Err(e) => return Err(io("opening a data directory", root, e)),
    };
    let mut t = Tightened::default();
    walk(&dir, root.to_path_buf(), 0, &mut t)?;
    Ok(t)
}

fn walk(dir: &OwnedFd, path: PathBuf, depth: usize, t: &mut Tightened) -> Result<()> {
    let st = fstat(dir).map_err(|e| io("stat of a data directory", &path, e))?;
    if restrict(dir, &st).map_err(|e| io("restricting a data directory", &path, e))? {
        t.dirs += 1;
    }
    if depth >= WALK_DEPTH_MAX {
        return Err(Error::io(
            "walking a data directory",
            &path,
            std::io::Error::other(format!("nested deeper than {WALK_DEPTH_MAX} levels")),
        ));
    }
    // Listing through the fd's /proc link reads the directory this fd holds
    // open (a magic link, not a path lookup), whatever its path is now.
    let list = std::fs::read_dir(format!("/proc/self/fd/{}", dir.as_raw_fd()))
        .map_err(|e| Error::io("listing a data directory", &path, e))?;
    for entry in list {
        let entry = entry.map_err(|e| Error::io("listing a data directory", &path, e))?;
        let name = entry.file_name();
        let child = path.join(&name);
        let st = match fstatat(
            dir,
            name.as_os_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        ) {
            Ok(s) => s,
            Err(nix::errno::Errno::ENOENT) => continue,
            Err(e) => return Err(io("stat in a data directory", &child, e)),
        };
        if is(&st, SFlag::S_IFLNK) {
            t.links_skipped += 1;
        } else if is(&st, SFlag::S_IFDIR) {
            let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
            match openat(dir, name.as_os_str(), flags, Mode::empty()) {
                Ok(sub) => walk(&sub, child, depth + 1, t)?,
                // Swapped for a link or removed since the stat: not ours.
                Err(
                    nix::errno::Errno::ENOENT
                    | nix::errno::Errno::ELOOP
                    | nix::errno::Errno::ENOTDIR,
                ) => {}
                Err(e) => return Err(io("opening a data directory", &child, e)),
            }
        } else if is(&st, SFlag::S_IFREG) && st.st_mode & PRIVATE_UMASK != 0 {
            // NONBLOCK|NOCTTY: harmless even if a fifo or tty was swapped in
            // since the stat; the fstat below decides.
            let flags = OFlag::O_RDONLY
                | OFlag::O_NOFOLLOW
                | OFlag::O_NONBLOCK
                | OFlag::O_NOCTTY
                | OFlag::O_CLOEXEC;
            let f = match openat(dir, name.as_os_str(), flags, Mode::empty()) {
                Ok(f) => f,
                Err(nix::errno::Errno::ENOENT | nix::errno::Errno::ELOOP) => continue,
                Err(e) => return Err(io("opening a data file", &child, e)),
            };
            let st = fstat(&f).map_err(|e| io("stat of a data file", &child, e))?;
            if is(&st, SFlag::S_IFREG)
                && restrict(&f, &st).map_err(|e| io("restricting a data file", &child, e))?
            {
                t.files += 1;
            }
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
