//! End-to-end (issue #16, the data path): one real `kvtierd --mount` with
//! the embedded default's file:// G4, driven with cp, rm, mv, setfattr,
//! df and the `kvtier` CLI: imports go the offload path (stored events on
//! the socket, G4 write-through, metrics); `kvtier verify` repairs a bad
//! block from G4; `rm` is G3-only and does not bring the name back;
//! `user.kvtier.evict` and `kvtier evict --tier all` delete everywhere;
//! `df` shows G3's capacity; a second daemon on a live mount is refused
//! and leaves no socket behind. Needs root and /dev/fuse (skips visibly).
//!
//! Part of the e2e_mount test binary (`mod mount_ops;` there), so it costs
//! no test binary of its own to build and link.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::skip;
use super::support::{self, kvtierd_bin, metric, Daemon};
use kvtier_client::events::{KvEvent, KvEventData, StorageTier};
use kvtier_client::{
    block_path, encode_block, BlockHeader, BlockKey, Client, ClientConfig, KvLayout, Namespace,
    Onboarded, Tier,
};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BLOCK: usize = 64 << 10;
const FILE_BYTES: u64 = BLOCK as u64 + 4096;

fn ns() -> Namespace {
    Namespace::new(
        "e2e-mount-ops",
        KvLayout::with_block_bytes(BLOCK as u64).unwrap(),
        "",
        "t",
    )
    .unwrap()
}

fn block_file(i: u64) -> (BlockKey, Vec<u8>, Vec<u8>) {
    let payload: Vec<u8> = (0..BLOCK as u64).map(|j| (j * 31 + i * 7) as u8).collect();
    let h = BlockHeader::for_payload(&ns(), BlockKey::from_u64(0x16_000 + i), &payload, 0);
    (h.key, encode_block(&h, &payload), payload)
}

fn kvtier() -> PathBuf {
    support::bin("kvtier-tools", "kvtier")
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
    assert!(ok, "`{cmd}` failed: {out}{err}");
    out
}

/// Unmounts (lazily) on drop, after the daemon it guards is killed.
struct Umount(PathBuf);

impl Drop for Umount {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .stderr(Stdio::null())
            .status();
    }
}

fn wait_mounted(mnt: &Path) {
    let t = Instant::now();
    while !std::fs::read_to_string("/proc/self/mounts")
        .unwrap()
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some(mnt.to_str().unwrap()))
    {
        assert!(t.elapsed() < Duration::from_secs(20), "no mount");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn client(d: &Daemon) -> Client {
    let mut c = ClientConfig::new(&d.socket);
    c.region_bytes = 1 << 20;
    c.timeout_ms = 15_000;
    Client::with_config(c)
}

fn has(evs: &[KvEvent], tier: StorageTier, stored: bool, key: &BlockKey) -> bool {
    evs.iter().any(|e| {
        e.storage_tier == tier
            && match &e.data {
                KvEventData::Stored { blocks, .. } if stored => {
                    blocks.iter().any(|b| b.block_hash == *key)
                }
                KvEventData::Removed { block_hashes } if !stored => block_hashes.contains(key),
                _ => false,
            }
    })
}

/// Cheap by design: one daemon, every assertion against it.
#[test]
fn mount_imports_rm_mv_evict_verify_and_df_on_one_daemon() {
    if skip("mount_imports_rm_mv_evict_verify_and_df_on_one_daemon") {
        return;
    }
    let top = tempfile::tempdir().unwrap();
    let mnt = top.path().join("mnt");
    let _umount = Umount(mnt.clone());
    let d = Daemon::start_with(&["--mount".into(), mnt.display().to_string()], &[]);
    wait_mounted(&mnt);
    let id = ns().id();
    let at = |k: &BlockKey| mnt.join(block_path(&id, k));
    let g3_dir = d.dir.path().join("g3");
    // Whether G3's disk holds the block (its file or its slab slot).
    let on_g3 = |k: &BlockKey| support::g3_block_at(&g3_dir, &id, k).is_some();
    let g4 = |k: &BlockKey| d.dir.path().join("g4/blocks").join(block_path(&id, k));
    let sub_client = client(&d);
    let mut sub = sub_client.subscribe_events().unwrap();
    let mut evs: Vec<KvEvent> = Vec::new();
    let mut wait_event = |what: &str, evs: &mut Vec<KvEvent>, f: &dyn Fn(&[KvEvent]) -> bool| {
        let t = Instant::now();
        while !f(evs) {
            assert!(t.elapsed() < Duration::from_secs(20), "{what}: {evs:?}");
            evs.extend(sub.next_timeout(Duration::from_millis(100)).unwrap());
        }
    };

    // 1. `cp` into the mount: the offload path.
    let blocks: Vec<_> = (0..4).map(block_file).collect();
    for (i, (key, file, _)) in blocks.iter().take(3).enumerate() {
        let src = top.path().join(format!("b{i}"));
        std::fs::write(&src, file).unwrap();
        let dst = at(key);
        ok(&format!(
            "mkdir -p {} && cp {} {}",
            dst.parent().unwrap().display(),
            src.display(),
            dst.display()
        ));
    }
    for (key, file, _) in blocks.iter().take(3) {
        wait_event("stored on disk, announced", &mut evs, &|e| {
            has(e, StorageTier::Disk, true, key)
        });
        // Written through to G4 without a restart, and announced there.
        wait_event("uploaded to G4, announced", &mut evs, &|e| {
            has(e, StorageTier::External, true, key)
        });
        assert_eq!(&std::fs::read(g4(key)).unwrap(), file);
    }
    let m = d.scrape();
    assert_eq!(
        metric(&m, "kvtier_requests_total", &[("op", "mount_import")]),
        3.0
    );
    assert_eq!(
        metric(&m, "kvtier_offload_bytes_total", &[]),
        3.0 * BLOCK as f64
    );

    // 6. df: G3's capacity (256 MiB) and use (3 block files).
    let df = ok(&format!("stat -f -c '%b %f %S' {}", mnt.display()));
    let v: Vec<u64> = df.split_whitespace().map(|x| x.parse().unwrap()).collect();
    assert_eq!(v[0] * v[2], 256 << 20, "{df}");
    assert_eq!((v[0] - v[1]) * v[2], 3 * FILE_BYTES, "{df}");
    let df_h = ok(&format!("df -B1 --output=size {}", mnt.display()));
    assert!(df_h.contains(&(256u64 << 20).to_string()), "{df_h}");

    // 3. verify repairs a bad G3 copy from G4 (exit 1: something was bad).
    let (k0, _, p0) = &blocks[0];
    support::flip_g3_byte(&g3_dir, &id, k0, 4096 + 11);
    let v = Command::new(kvtier())
        .args(["verify", "--all"])
        .env("KVTIER_SOCKET", &d.socket)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&v.stdout);
    assert!(!v.status.success(), "{out}");
    assert!(
        out.contains(&format!("repaired\t{}", block_path(&id, k0))),
        "{out}"
    );
    assert!(
        out.contains(&format!("ok\t{}", block_path(&id, &blocks[1].0))),
        "{out}"
    );
    assert!(out.contains("2 ok, 1 repaired, 0 dropped"), "{out}");
    // The next onboard is a G3 hit on the good bytes.
    let c = client(&d);
    let h = c.namespace(&ns());
    let mut buf = vec![0u8; BLOCK];
    let r = h.onboard_into(&[*k0], &mut [&mut buf[..]]);
    assert!(
        matches!(r[0], Onboarded::Hit { tier: Tier::G3, .. }),
        "{r:?}"
    );
    assert!(buf == *p0, "repaired bytes differ");
    let (vok, vout, _) = bash(&format!(
        "KVTIER_SOCKET={} {} verify --all",
        d.socket.display(),
        kvtier().display()
    ));
    assert!(vok, "clean after the repair: {vout}");

    // 4. rm: G3 only; the name does not come back from G4.
    let (k1, _, _) = &blocks[1];
    ok(&format!("rm {}", at(k1).display()));
    assert!(!on_g3(k1) && g4(k1).exists());
    let (found, _, _) = bash(&format!("stat {}", at(k1).display()));
    assert!(!found, "rm'd name fetched back from G4");
    assert_eq!(h.lookup(&[*k1]).tiers, vec![Tier::G4]);
    wait_event("rm announced on disk", &mut evs, &|e| {
        has(e, StorageTier::Disk, false, k1)
    });

    // setfattr user.kvtier.evict all: gone everywhere, both announced.
    let (k2, _, _) = &blocks[2];
    ok(&format!(
        "setfattr -n user.kvtier.evict -v all {}",
        at(k2).display()
    ));
    assert!(!on_g3(k2) && !g4(k2).exists());
    assert!(h.lookup(&[*k2]).tiers.is_empty());
    wait_event("evict all announced in both tiers", &mut evs, &|e| {
        has(e, StorageTier::Disk, false, k2) && has(e, StorageTier::External, false, k2)
    });
    let (bad, _, err) = bash(&format!(
        "setfattr -n user.kvtier.evict -v g5 {}",
        at(k0).display()
    ));
    assert!(!bad && err.contains("Invalid argument"), "{err}");

    // mv out of the mount: copy + unlink; the name is gone from the
    // mount, the bytes are at the destination.
    let (k3, f3, _) = &blocks[3];
    let src = top.path().join("b3");
    std::fs::write(&src, f3).unwrap();
    ok(&format!("cp {} {}", src.display(), at(k3).display()));
    let out_file = top.path().join("moved");
    ok(&format!("mv {} {}", at(k3).display(), out_file.display()));
    assert_eq!(&std::fs::read(&out_file).unwrap(), f3);
    assert!(!at(k3).exists() && !on_g3(k3));

    // kvtier evict --tier all: G3 and G4, then absent.
    let path0 = block_path(&id, k0);
    let e1 = ok(&format!(
        "KVTIER_SOCKET={} {} evict --tier all {path0}",
        d.socket.display(),
        kvtier().display()
    ));
    assert!(e1.starts_with("evicted\t"), "{e1}");
    assert!(!on_g3(k0) && !g4(k0).exists());
    let e2 = ok(&format!(
        "KVTIER_SOCKET={} {} evict --tier all {path0}",
        d.socket.display(),
        kvtier().display()
    ));
    assert!(e2.starts_with("absent\t"), "{e2}");
    wait_event("kvtier evict announced in both tiers", &mut evs, &|e| {
        has(e, StorageTier::Disk, false, k0) && has(e, StorageTier::External, false, k0)
    });
}

#[test]
fn a_second_daemon_on_a_live_mount_is_refused_and_leaves_no_socket() {
    if skip("a_second_daemon_on_a_live_mount_is_refused_and_leaves_no_socket") {
        return;
    }
    let top = tempfile::tempdir().unwrap();
    let mnt = top.path().join("mnt");
    let _umount = Umount(mnt.clone());
    let d = Daemon::start_with(&["--mount".into(), mnt.display().to_string()], &[]);
    wait_mounted(&mnt);
    let (key, file, _) = block_file(9);
    let src = top.path().join("b");
    std::fs::write(&src, &file).unwrap();
    let dst = mnt.join(block_path(&ns().id(), &key));
    ok(&format!(
        "mkdir -p {} && cp {} {}",
        dst.parent().unwrap().display(),
        src.display(),
        dst.display()
    ));
    let other = tempfile::tempdir().unwrap();
    let sock2 = other.path().join("kvtierd.sock");
    let mut c = Command::new(kvtierd_bin())
        .arg("--socket")
        .arg(&sock2)
        .arg("--g3-dir")
        .arg(other.path().join("g3"))
        .arg("--mount")
        .arg(&mnt)
        .args(["--g3-capacity", "64MiB", "--metrics-addr", ""])
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(s) = c.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(20) {
            let _ = c.kill();
            let _ = c.wait();
            panic!("the second daemon mounted over the first one's mount");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut c.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(
        err.contains(&mnt.display().to_string()) && err.contains("in use") && err.contains("fuse"),
        "{err}"
    );
    assert!(!sock2.exists(), "a failed start left its socket behind");
    // The first daemon keeps serving its mount.
    assert_eq!(std::fs::read(&dst).unwrap(), file);
    let stats = std::fs::read_to_string(mnt.join(".kvtier/stats")).unwrap();
    assert!(stats.contains("blocks 1"), "{stats}");
    drop(d);
}
