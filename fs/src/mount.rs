//! Mounting: options, the guard that unmounts on drop, passthrough
//! detection, and cleanup of a stale mount left by a crashed process.

use crate::adapter::KvFs;
use crate::error::{Error, Result};
use crate::namespace::KvNamespace;
use fuser::{BackgroundSession, MountOption, SessionACL};
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Whether reads use FUSE passthrough.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Passthrough {
    /// Use it when the kernel offers it and the process may register
    /// backing files (CAP_SYS_ADMIN); otherwise fall back, with a log line.
    Auto,
    /// Never: every read goes through the daemon (for tests and comparison).
    Off,
    /// Refuse to mount without it.
    Required,
}

/// How the namespace is mounted.
#[derive(Debug, Clone)]
pub struct MountOptions {
    /// Let users other than the mounting one in (`allow_other`; needs root
    /// or `user_allow_other` in /etc/fuse.conf).
    pub allow_other: bool,
    /// Mount read-only: imports, `rm` and `setfattr` fail with EROFS.
    pub read_only: bool,
    /// Owner shown for every file and directory.
    pub uid: u32,
    /// Group shown for every file and directory.
    pub gid: u32,
    /// Permission bits of block files (default 0o444: blocks are immutable).
    pub file_mode: u16,
    /// Permission bits of directories (default 0o755).
    pub dir_mode: u16,
    /// Read path selection.
    pub passthrough: Passthrough,
    /// Where imports are staged before they are verified (unnamed
    /// `O_TMPFILE` files). Put it on the store's filesystem so that
    /// `StagedBlock::link_into` can publish without a copy.
    pub staging_dir: PathBuf,
    /// Largest file accepted by an import.
    pub import_bytes_max: u64,
    /// FUSE request threads.
    pub threads: usize,
    /// How long the kernel may cache names and attributes of blocks.
    pub attr_ttl_ms: u64,
    /// Source name shown in `mount` output.
    pub fsname: String,
}

impl Default for MountOptions {
    fn default() -> Self {
        // SAFETY: geteuid/getegid cannot fail and touch no memory.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        MountOptions {
            allow_other: false,
            read_only: false,
            uid,
            gid,
            file_mode: 0o444,
            dir_mode: 0o755,
            passthrough: Passthrough::Auto,
            staging_dir: std::env::temp_dir(),
            import_bytes_max: kvtier_client::block::HEADER_BYTES as u64
                + kvtier_client::block::PAYLOAD_BYTES_MAX,
            threads: 4,
            attr_ttl_ms: 1000,
            fsname: "kvtier".into(),
        }
    }
}

/// Counters of one mount, shown in `/.kvtier/stats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Whether new opens use passthrough.
    pub passthrough_active: bool,
    /// Opens served by passthrough (the kernel reads the backing file).
    pub passthrough_opens: u64,
    /// Opens served through the daemon.
    pub fallback_opens: u64,
    /// Read requests answered by the daemon.
    pub fallback_reads: u64,
    /// Bytes answered by the daemon.
    pub fallback_read_bytes: u64,
    /// Blocks imported by writing files.
    pub imports: u64,
    /// Imports refused (bad name, partial, corrupt, non-sequential).
    pub imports_refused: u64,
    /// Blocks evicted by `rm`.
    pub removes: u64,
}

/// State shared between the mount guard and the adapter.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    negotiated: AtomicBool,
    active: AtomicBool,
    pub(crate) passthrough_opens: AtomicU64,
    pub(crate) fallback_opens: AtomicU64,
    pub(crate) fallback_reads: AtomicU64,
    pub(crate) fallback_read_bytes: AtomicU64,
    pub(crate) imports: AtomicU64,
    pub(crate) imports_refused: AtomicU64,
    pub(crate) removes: AtomicU64,
}

impl Shared {
    pub(crate) fn set_negotiated(&self, v: bool) {
        self.negotiated.store(v, Ordering::Relaxed);
    }
    pub(crate) fn passthrough_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }
    pub(crate) fn disable_passthrough(&self) {
        self.active.store(false, Ordering::Relaxed);
    }
    pub(crate) fn counters(&self) -> Counters {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counters {
            passthrough_active: self.passthrough_active(),
            passthrough_opens: l(&self.passthrough_opens),
            fallback_opens: l(&self.fallback_opens),
            fallback_reads: l(&self.fallback_reads),
            fallback_read_bytes: l(&self.fallback_read_bytes),
            imports: l(&self.imports),
            imports_refused: l(&self.imports_refused),
            removes: l(&self.removes),
        }
    }
}

/// A mounted namespace. Dropping it unmounts (lazily if files are still
/// open, so a drop never hangs).
#[derive(Debug)]
pub struct MountGuard {
    session: Option<BackgroundSession>,
    mountpoint: PathBuf,
    shared: Arc<Shared>,
}

/// `FUSE_DEV_IOC_BACKING_CLOSE` = `_IOW(229, 2, u32)`.
const FUSE_DEV_IOC_BACKING_CLOSE: libc::c_ulong = 0x4004_e502;

/// Mounts `ns` at `mountpoint` (an existing directory). A stale mount left
/// there by a crashed process is cleaned first. Passthrough is negotiated
/// with the kernel and then probed by registering one backing file, which
/// is what needs CAP_SYS_ADMIN; the outcome is logged and visible in
/// [`MountGuard::counters`].
pub fn mount(
    ns: Arc<dyn KvNamespace>,
    mountpoint: &Path,
    opts: &MountOptions,
) -> Result<MountGuard> {
    clean_stale_mount(mountpoint)?;
    if let (Ok(m), Ok(s)) = (mountpoint.canonicalize(), opts.staging_dir.canonicalize()) {
        // Staging inside the mount would call back into this filesystem.
        if s.starts_with(&m) {
            return Err(Error::Mount {
                op: "checking the staging directory",
                path: mountpoint.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "the staging directory must not be inside the mount",
                ),
            });
        }
    }
    let shared = Arc::new(Shared::default());
    let fs = KvFs::new(ns, opts.clone(), Arc::clone(&shared));
    let mut cfg = fuser::Config::default();
    cfg.mount_options = vec![
        MountOption::FSName(opts.fsname.clone()),
        MountOption::Subtype("kvtier".into()),
        MountOption::DefaultPermissions,
        MountOption::NoAtime,
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::NoExec,
        if opts.read_only {
            MountOption::RO
        } else {
            MountOption::RW
        },
    ];
    cfg.acl = if opts.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    cfg.n_threads = Some(opts.threads.clamp(1, 64));
    let mount_err = |op, source| Error::Mount {
        op,
        path: mountpoint.to_path_buf(),
        source,
    };
    let session =
        fuser::Session::new(fs, mountpoint, &cfg).map_err(|e| mount_err("mounting", e))?;
    let active = match opts.passthrough {
        Passthrough::Off => false,
        _ if !shared.negotiated.load(Ordering::Relaxed) => {
            tracing::warn!(mountpoint = %mountpoint.display(),
                "FUSE passthrough unavailable (kernel did not negotiate it); reads go through the daemon");
            false
        }
        _ => match probe_backing(&session, &opts.staging_dir) {
            Ok(()) => {
                tracing::info!(mountpoint = %mountpoint.display(),
                    "FUSE passthrough active: the kernel reads block files directly");
                true
            }
            Err(e) => {
                tracing::warn!(mountpoint = %mountpoint.display(), error = %e,
                    "FUSE passthrough unavailable (registering a backing file failed; needs CAP_SYS_ADMIN); reads go through the daemon");
                false
            }
        },
    };
    if opts.passthrough == Passthrough::Required && !active {
        drop(session);
        return Err(Error::PassthroughUnavailable {
            reason: "the kernel did not negotiate it or refused a backing file (see the log)"
                .into(),
        });
    }
    shared.active.store(active, Ordering::Relaxed);
    let session = session.spawn().map_err(|e| mount_err("starting", e))?;
    Ok(MountGuard {
        session: Some(session),
        mountpoint: mountpoint.to_path_buf(),
        shared,
    })
}

/// Registers and releases one backing file: the cheapest complete proof
/// that passthrough opens will work.
fn probe_backing(dev: &impl AsFd, staging_dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_TMPFILE)
        .mode(0o600)
        .open(staging_dir)?;
    let id = fuser::BackingId::create_raw(dev, &f)?;
    // SAFETY: a plain ioctl on the session's /dev/fuse fd with a pointer to
    // a live u32, as the FUSE ABI defines it.
    let rc = unsafe {
        libc::ioctl(
            dev.as_fd().as_raw_fd(),
            FUSE_DEV_IOC_BACKING_CLOSE as _,
            &id as *const u32,
        )
    };
    if rc != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "closing the probe backing id failed");
    }
    Ok(())
}

impl MountGuard {
    /// Where it is mounted.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Whether reads currently use passthrough.
    pub fn passthrough_active(&self) -> bool {
        self.shared.passthrough_active()
    }

    /// A snapshot of the mount's counters.
    pub fn counters(&self) -> Counters {
        self.shared.counters()
    }

    /// Reads the counters later, after the guard itself has moved (the
    /// daemon's /metrics keeps one).
    pub fn counters_source(&self) -> impl Fn() -> Counters + Send + Sync + 'static {
        let shared = Arc::clone(&self.shared);
        move || shared.counters()
    }

    /// Unmounts now and reports how it went.
    pub fn unmount(mut self) -> Result<()> {
        self.unmount_inner()
    }

    fn unmount_inner(&mut self) -> Result<()> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        match session.umount_and_join() {
            Ok(()) => Ok(()),
            Err(e) => {
                // Busy (open files): detach now; the session thread ends
                // when the last file is closed.
                tracing::warn!(mountpoint = %self.mountpoint.display(), error = %e,
                    "unmount failed; detaching lazily");
                detach(&self.mountpoint).map_err(|source| Error::Mount {
                    op: "detaching",
                    path: self.mountpoint.clone(),
                    source,
                })
            }
        }
    }
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        if let Err(e) = self.unmount_inner() {
            tracing::warn!(error = %e, "unmount on drop failed");
        }
    }
}

/// `umount2(path, MNT_DETACH)`.
fn detach(path: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn statfs(path: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: statfs is plain old data; all zeroes is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` is a writable statfs that
    // outlives the call.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A filesystem mounted at a path (`/proc/self/mountinfo`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountedFs {
    /// Type, e.g. `fuse.kvtier`, `ext4`.
    pub fstype: String,
    /// Source, e.g. `kvtier`, `/dev/nvme0n1`.
    pub source: String,
}

impl MountedFs {
    /// A FUSE filesystem (`fuse`, `fuse.NAME`, `fuseblk`).
    pub fn is_fuse(&self) -> bool {
        self.fstype.starts_with("fuse")
    }
}

impl std::fmt::Display for MountedFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} filesystem from {:?}", self.fstype, self.source)
    }
}

/// What is mounted at `path` now, from `/proc/self/mountinfo`: the
/// top-most mount whose mount point is `path`, `None` when nothing is.
/// For refusing to mount over a live mount (another daemon's): call after
/// [`clean_stale_mount`].
pub fn mounted_at(path: &Path) -> Result<Option<MountedFs>> {
    let want = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let info = match std::fs::read_to_string("/proc/self/mountinfo") {
        Ok(t) => t,
        Err(e) => return Err(Error::io("reading /proc/self/mountinfo", path, e)),
    };
    Ok(mountinfo_entry(&info, &want))
}

/// The last (top-most) entry of mountinfo text `info` mounted at `want`.
fn mountinfo_entry(info: &str, want: &Path) -> Option<MountedFs> {
    let mut found = None;
    for line in info.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let Some(point) = left.split(' ').nth(4) else {
            continue;
        };
        if Path::new(&unescape_mountinfo(point)) != want {
            continue;
        }
        let mut r = right.split(' ');
        found = Some(MountedFs {
            fstype: r.next().unwrap_or("?").to_string(),
            source: r.next().unwrap_or("?").to_string(),
        });
    }
    found
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Detects a FUSE mount whose server died (`stat` fails with ENOTCONN) and
/// detaches it: `umount2(MNT_DETACH)` as root, else `fusermount3 -uz`.
/// Returns whether something was cleaned.
pub fn clean_stale_mount(path: &Path) -> Result<bool> {
    // statfs, not stat: the kernel answers `stat` of a dead mount's root
    // from its attribute cache for up to the attribute TTL, but always
    // sends STATFS, which a dead connection fails with ENOTCONN.
    match statfs(path) {
        Ok(_) => Ok(false),
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            tracing::warn!(path = %path.display(), "stale FUSE mount (server gone); cleaning it");
            let first = match detach(path) {
                Ok(()) => return Ok(true),
                Err(e) => e,
            };
            let status = std::process::Command::new("fusermount3")
                .arg("-u")
                .arg("-z")
                .arg(path)
                .stdin(std::process::Stdio::null())
                .status();
            match status {
                Ok(s) if s.success() => Ok(true),
                _ => Err(Error::Mount {
                    op: "cleaning a stale mount",
                    path: path.to_path_buf(),
                    source: first,
                }),
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io("checking for a stale mount", path, e)),
    }
}

#[cfg(test)]
mod mountinfo_tests {
    use super::*;

    #[test]
    fn the_top_most_mount_at_a_path_is_named_with_escapes_undone() {
        let info = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
90 22 0:50 / /tmp/a\\040b rw,nosuid,nodev,relatime shared:60 - fuse.kvtier kvtier rw,user_id=0
91 90 0:51 / /tmp/a\\040b rw - tmpfs none rw
";
        let top = mountinfo_entry(info, Path::new("/tmp/a b")).unwrap();
        assert_eq!(top.to_string(), "tmpfs filesystem from \"none\"");
        assert!(!top.is_fuse());
        let lines: Vec<&str> = info.lines().take(2).collect();
        let fuse = mountinfo_entry(&lines.join("\n"), Path::new("/tmp/a b")).unwrap();
        assert!(fuse.is_fuse() && fuse.source == "kvtier", "{fuse:?}");
        assert_eq!(mountinfo_entry(info, Path::new("/tmp/a")), None);
        assert_eq!(
            mountinfo_entry(info, Path::new("/")).unwrap().fstype,
            "ext4"
        );
        assert_eq!(unescape_mountinfo("x\\134y\\04"), "x\\y\\04");
    }
}
