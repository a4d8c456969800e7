//! End-to-end: a real `kvtierd --mount DIR` process, driven with real
//! tools (cp, ls, find, stat, cat | sha256sum, getfattr/setfattr, rm,
//! `kvtier inspect`), a corrupted backing file, kill -9 and SIGTERM.
//! Needs root and /dev/fuse (skips visibly otherwise).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod mount_ops;
mod support;

use kvtier_client::{block_path, encode_block, BlockHeader, BlockKey, KvLayout, Namespace};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::{bin, kvtierd_bin, wait_for_socket};

const BLOCK: usize = 256 << 10;

fn skip(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let dev = Path::new("/dev/fuse").exists();
    if !root || !dev {
        eprintln!("SKIP: {test}: needs root and /dev/fuse (root={root}, /dev/fuse={dev})");
        return true;
    }
    false
}

fn ns() -> Namespace {
    Namespace::new(
        "e2e-mount",
        KvLayout::with_block_bytes(BLOCK as u64).unwrap(),
        "",
        "t",
    )
    .unwrap()
}

fn block_file(i: u64) -> (BlockKey, Vec<u8>) {
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let payload: Vec<u8> = (0..BLOCK)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let h = BlockHeader::for_payload(&ns(), BlockKey::from_u64(0xabc0 + i), &payload, 0);
    (h.key, encode_block(&h, &payload))
}

/// kvtierd with --mount in a temp dir; killed (and unmounted) on drop.
struct MountedDaemon {
    dir: tempfile::TempDir,
    mnt: PathBuf,
    child: Option<Child>,
}

impl MountedDaemon {
    fn start() -> MountedDaemon {
        let dir = tempfile::tempdir().unwrap();
        let mnt = dir.path().join("mnt");
        let mut d = MountedDaemon {
            dir,
            mnt,
            child: None,
        };
        d.spawn();
        d
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("kvtierd.sock")
    }

    fn g3(&self) -> PathBuf {
        self.dir.path().join("g3")
    }

    fn spawn(&mut self) {
        let _ = std::fs::remove_file(self.socket());
        let child = Command::new(kvtierd_bin())
            .arg("--socket")
            .arg(self.socket())
            .arg("--g3-dir")
            .arg(self.g3())
            .arg("--mount")
            .arg(&self.mnt)
            .args(["--g3-capacity", "256MiB", "--metrics-addr", ""])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning kvtierd");
        self.child = Some(child);
        wait_for_socket(&self.socket(), Duration::from_secs(20));
        // The socket is bound before the mount starts; wait for both.
        let t = Instant::now();
        while !is_fuse_mount(&self.mnt) || stale(&self.mnt) {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "kvtierd did not mount {}",
                self.mnt.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn sigterm(&mut self) -> bool {
        let Some(mut c) = self.child.take() else {
            return false;
        };
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(s)) = c.try_wait() {
                return s.success();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = c.kill();
        let _ = c.wait();
        false
    }

    fn path(&self, key: &BlockKey) -> PathBuf {
        self.mnt.join(block_path(&ns().id(), key))
    }
}

impl Drop for MountedDaemon {
    fn drop(&mut self) {
        self.kill9();
        if is_fuse_mount(&self.mnt) || stale(&self.mnt) {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
    }
}

/// A mount whose server is gone. statfs always reaches the server (stat
/// of the root may be answered from the kernel's attribute cache).
fn stale(p: &Path) -> bool {
    nix::sys::statfs::statfs(p).err() == Some(nix::errno::Errno::ENOTCONN)
}

fn is_fuse_mount(p: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let want = p.display().to_string();
    mounts
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some(want.as_str()) && l.contains("fuse"))
}

fn bash(cmd: &str) -> (bool, String, String) {
    let o = Command::new("bash")
        .arg("-c")
        .arg(format!("set -o pipefail; {cmd}"))
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn ok(cmd: &str) -> String {
    let (ok, out, err) = bash(cmd);
    assert!(ok, "`{cmd}` failed: {err}");
    out
}

fn sha256(bytes: &[u8], dir: &Path) -> String {
    let f = dir.join("sha-input");
    std::fs::write(&f, bytes).unwrap();
    ok(&format!("sha256sum < {}", f.display()))
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

#[test]
fn shell_tools_on_a_kvtierd_mount() {
    if skip("shell_tools_on_a_kvtierd_mount") {
        return;
    }
    let d = MountedDaemon::start();
    let staging = tempfile::tempdir().unwrap();
    let ns_dir = d.mnt.join(ns().id().to_hex());
    ok(&format!("mkdir -p {}", ns_dir.display()));
    let mut files = Vec::new();
    for i in 0..3u64 {
        let (key, bytes) = block_file(i);
        let src = staging.path().join(format!("b{i}"));
        std::fs::write(&src, &bytes).unwrap();
        let dst = d.path(&key);
        ok(&format!(
            "mkdir -p {} && cp {} {}",
            dst.parent().unwrap().display(),
            src.display(),
            dst.display()
        ));
        files.push((key, bytes));
    }
    // The imports are G3 block files now.
    for (key, bytes) in &files {
        let (p, at) = support::g3_block_at(&d.g3(), &ns().id(), key).expect("on G3");
        let mut got = vec![0u8; bytes.len()];
        std::os::unix::fs::FileExt::read_exact_at(&std::fs::File::open(p).unwrap(), &mut got, at)
            .unwrap();
        assert_eq!(&got, bytes);
    }
    // ls / find / stat.
    let (k0, f0) = &files[0];
    let p0 = d.path(k0);
    let ls = ok(&format!(
        "ls {}",
        ns_dir.join(&block_path(&ns().id(), k0)[33..35]).display()
    ));
    assert!(ls.contains(&k0.to_hex()), "{ls}");
    let found = ok(&format!("find {} -type f | sort", ns_dir.display()));
    assert_eq!(found.lines().count(), 3, "{found}");
    let size = ok(&format!("stat -c %s {}", p0.display()));
    assert_eq!(size.trim(), f0.len().to_string());
    // cat | sha256sum equals the stored bytes.
    for (key, bytes) in &files {
        let got = ok(&format!("cat {} | sha256sum", d.path(key).display()));
        assert_eq!(
            got.split_whitespace().next().unwrap(),
            sha256(bytes, staging.path())
        );
    }
    // getfattr / setfattr.
    let attrs = ok(&format!("getfattr -d {}", p0.display()));
    for a in [
        "user.kvtier.tier=\"g3\"",
        "user.kvtier.checksum=",
        "user.kvtier.hits=",
        "user.kvtier.last_access=",
        "user.kvtier.pinned=\"0\"",
        "user.kvtier.priority=",
        "user.kvtier.namespace=",
    ] {
        assert!(attrs.contains(a), "{a} missing: {attrs}");
    }
    ok(&format!(
        "setfattr -n user.kvtier.pinned -v 1 {}",
        p0.display()
    ));
    let pinned = ok(&format!(
        "getfattr --only-values -n user.kvtier.pinned {}",
        p0.display()
    ));
    assert_eq!(pinned.trim(), "1");
    // kvtier inspect on a mounted file.
    let kvtier = bin("kvtier-tools", "kvtier");
    let out = ok(&format!(
        "{} inspect --json {}",
        kvtier.display(),
        p0.display()
    ));
    assert!(out.contains(&k0.to_hex()), "{out}");
    // rm of a pinned block: EBUSY, kept (a pin protects from every
    // eviction); unpinned, rm evicts: gone from the mount and from G3,
    // event emitted.
    let (removed, _, err) = bash(&format!("rm {}", p0.display()));
    assert!(!removed && err.contains("busy"), "{err}");
    assert!(p0.exists());
    ok(&format!(
        "setfattr -n user.kvtier.pinned -v 0 {}",
        p0.display()
    ));
    ok(&format!("rm {}", p0.display()));
    assert!(!p0.exists());
    assert!(support::g3_block_at(&d.g3(), &ns().id(), k0).is_none());
    let ev = std::fs::read_to_string(d.mnt.join(".kvtier/events")).unwrap();
    assert!(
        ev.contains(&format!(
            "removed {} reason=deleted",
            block_path(&ns().id(), k0)
        )),
        "{ev}"
    );
    assert!(
        ev.contains(&format!("stored {}", block_path(&ns().id(), &files[1].0))),
        "{ev}"
    );
    // A flipped byte in the G3 file: EIO at open, quarantined.
    let (k1, _) = &files[1];
    support::flip_g3_byte(&d.g3(), &ns().id(), k1, 4096 + 7);
    let e = std::fs::File::open(d.path(k1)).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert!(
        support::g3_block_at(&d.g3(), &ns().id(), k1).is_none(),
        "out of G3 (its file moved, its slot punched)"
    );
    let q: Vec<_> = std::fs::read_dir(d.g3().join("quarantine"))
        .unwrap()
        .collect();
    assert_eq!(q.len(), 1);
    let stats = std::fs::read_to_string(d.mnt.join(".kvtier/stats")).unwrap();
    assert!(stats.contains("verify_failures 1"), "{stats}");
}

#[test]
fn kill9_leaves_a_stale_mount_that_the_next_start_cleans_and_sigterm_unmounts() {
    if skip("kill9_leaves_a_stale_mount_that_the_next_start_cleans_and_sigterm_unmounts") {
        return;
    }
    let mut d = MountedDaemon::start();
    let staging = tempfile::tempdir().unwrap();
    let (key, bytes) = block_file(7);
    let src = staging.path().join("b");
    std::fs::write(&src, &bytes).unwrap();
    let dst = d.path(&key);
    ok(&format!(
        "mkdir -p {} && cp {} {}",
        dst.parent().unwrap().display(),
        src.display(),
        dst.display()
    ));
    d.kill9();
    assert!(
        stale(&d.mnt),
        "kill -9 leaves the mount with no server (ENOTCONN)"
    );
    assert!(is_fuse_mount(&d.mnt));
    d.spawn();
    assert!(!stale(&d.mnt));
    // The block survived in G3 and is served again.
    assert_eq!(std::fs::read(d.path(&key)).unwrap(), bytes);
    assert!(d.sigterm(), "clean exit on SIGTERM");
    assert!(!is_fuse_mount(&d.mnt), "SIGTERM unmounts");
    assert!(!stale(&d.mnt));
}
