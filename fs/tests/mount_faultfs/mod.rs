//! `faultfs` through the real kernel (a module of tests/mount.rs: one test
//! binary less to link): what arrives for O_DIRECT, O_DSYNC,
//! fsync of a file and of a directory, and renameat2(RENAME_NOREPLACE),
//! and what a power cut keeps. Needs root and /dev/fuse (else SKIP).

use kvtier_fs::faultfs::{FaultFs, FaultMount};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

fn rename_noreplace(from: &Path, to: &Path) -> std::io::Result<()> {
    let f = std::ffi::CString::new(from.as_os_str().as_bytes()).unwrap();
    let t = std::ffi::CString::new(to.as_os_str().as_bytes()).unwrap();
    // SAFETY: valid NUL-terminated paths.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[test]
fn kernel_requests_and_the_power_cut() {
    let Some((dir, fs, m)) = mounted(7) else {
        return;
    };
    let mnt = dir.path().join("mnt");
    let d = mnt.join("d");
    std::fs::create_dir(&d).unwrap();
    std::fs::File::open(&mnt).unwrap().sync_all().unwrap();
    assert_eq!(fs.counters().dir_fsyncs, 1);

    // O_DIRECT | O_DSYNC, aligned: accepted without FOPEN_DIRECT_IO, and
    // durable on return.
    let mut buf = kvtier_client::AlignedBuf::new(8192).unwrap();
    buf.as_mut_slice().fill(0xab);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT | libc::O_DSYNC)
        .open(d.join("dsync.tmp"))
        .expect("O_DIRECT open on FUSE");
    f.write_all(buf.as_slice()).unwrap();
    drop(f);
    let c = fs.counters();
    assert!(c.direct_opens >= 1 && c.dsync_writes >= 1, "{c:?}");
    println!("after an O_DIRECT|O_DSYNC write: {c:?}");
    rename_noreplace(&d.join("dsync.tmp"), &d.join("dsync")).unwrap();
    std::fs::write(d.join("other"), b"x").unwrap();
    let e = rename_noreplace(&d.join("other"), &d.join("dsync")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EEXIST));
    std::fs::File::open(&d).unwrap().sync_all().unwrap();

    // Written and fsynced, but its name never made durable: gone.
    let mut g = std::fs::File::create(d.join("late")).unwrap();
    g.write_all(b"late").unwrap();
    g.sync_all().unwrap();
    drop(g);
    // Name durable, bytes not: the file comes back empty (or, seeded,
    // with what write-back kept).
    let before = fs.counters().fsyncs;
    std::fs::File::options()
        .append(true)
        .open(d.join("other"))
        .unwrap()
        .write_all(b"unsynced")
        .unwrap();
    assert_eq!(fs.counters().fsyncs, before);

    fs.crash_now();
    assert_eq!(
        std::fs::create_dir(mnt.join("after"))
            .unwrap_err()
            .raw_os_error(),
        Some(libc::EIO)
    );
    m.unmount().unwrap();
    let cut = fs.power_cycle();
    let _m = fs.mount(&mnt).unwrap();
    assert_eq!(std::fs::read(d.join("dsync")).unwrap(), vec![0xab; 8192]);
    assert!(!d.join("late").exists(), "{cut:?}");
    assert!(!d.join("dsync.tmp").exists());
    let other = std::fs::read(d.join("other")).unwrap();
    assert!(
        other.is_empty() || other == b"xunsynced" || other == [0u8; 9],
        "{other:?}"
    );
}

/// A file whose last reference goes a moment after the unmount starts
/// (as an io_uring ring's teardown drops its files from a kernel
/// workqueue) does not fail the unmount; one held for good fails it with
/// the holder named, and the mount is detached.
#[test]
fn unmount_waits_out_a_moment_busy_and_names_a_holder() {
    let Some((dir, fs, m)) = mounted(3) else {
        return;
    };
    let mnt = dir.path().join("mnt");
    let f = std::fs::File::create(mnt.join("held")).unwrap();
    let closer = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(300));
        drop(f);
    });
    m.unmount()
        .expect("a file closed 300 ms in must not fail the unmount");
    closer.join().unwrap();

    let m = fs.mount(&mnt).unwrap();
    let f = std::fs::File::open(mnt.join("held")).unwrap();
    let e = m.unmount_within(100).unwrap_err();
    assert_eq!(
        e.raw_os_error(),
        None,
        "the message carries the holder: {e}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("still busy after 100 ms") && msg.contains("held"),
        "{msg}"
    );
    drop(f);
    // Detached: the mount point is an empty directory again.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::fs::read_dir(&mnt).unwrap().next().is_some() {
        assert!(std::time::Instant::now() < deadline, "still mounted");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A `FaultFs` of `seed` mounted at `<temp dir>/mnt`; `None` (SKIP
/// printed) without root or /dev/fuse.
fn mounted(seed: u64) -> Option<(tempfile::TempDir, FaultFs, FaultMount)> {
    if !nix_root() || !Path::new("/dev/fuse").exists() {
        eprintln!("SKIP: faultfs needs root and /dev/fuse");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let fs = FaultFs::new(seed);
    let m = fs.mount(&mnt).unwrap();
    Some((dir, fs, m))
}

fn nix_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}
