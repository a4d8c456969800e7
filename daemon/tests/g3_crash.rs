#![allow(clippy::unwrap_used, clippy::expect_used)]
//! SIGKILL crash test: a child process (this test binary re-executed with
//! KVTIER_G3_CRASH_CHILD set) writes blocks and prints `BEGIN key` before
//! and `OK key` after each put returns Stored (one block per put, or
//! batches of 8 through `put_blocks`: all BEGIN lines, the batch, then the
//! OK lines). The parent kills it at a
//! random moment, reopens the store and checks: every OK key reads back and
//! verifies, every visible key was at least begun (no phantoms), nothing is
//! quarantined (nothing torn became visible), no temp files remain.
//! A few iterations normally; 200 with KVTIER_LONG_TESTS=1.

#[path = "g3_support/mod.rs"]
mod common;

use kvtier_daemon::base::tier::{BlockTier, Lookup};
use kvtier_daemon::testkit::conformance::{block, namespace};
use kvtier_daemon::tiers::g3::engine::EngineKind;
use kvtier_daemon::tiers::g3::{PutItem, PutMeta};
use rand::{Rng, SeedableRng};
use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};

const ENV: &str = "KVTIER_G3_CRASH_CHILD";

#[test]
fn crash_child() {
    let Ok(spec) = std::env::var(ENV) else { return };
    let mut it = spec.split(':');
    let root = std::path::PathBuf::from(it.next().unwrap());
    let iteration: u64 = it.next().unwrap().parse().unwrap();
    let batch = it.next() == Some("batch");
    let s = common::open(&root, EngineKind::Auto);
    let ns = namespace(8192, "crash").unwrap();
    let out = std::io::stdout();
    let say = |what: &str, key: &kvtier_client::BlockKey| {
        writeln!(out.lock(), "{what} {}", key.to_hex()).unwrap();
        out.lock().flush().unwrap();
    };
    for i in 0.. {
        if batch {
            let blocks: Vec<_> = (0..8)
                .map(|j| block(&ns, iteration * 1_000_000 + i * 8 + j))
                .collect();
            let items: Vec<PutItem<'_>> = blocks
                .iter()
                .enumerate()
                .map(|(j, (_, h, p))| PutItem {
                    header: h,
                    payload: p,
                    meta: PutMeta {
                        parent: j.checked_sub(1).map(|k| blocks[k].0),
                        ..PutMeta::default()
                    },
                })
                .collect();
            for (key, _, _) in &blocks {
                say("BEGIN", key);
            }
            let res = s.put_blocks(&ns.id(), &items);
            for ((key, _, _), r) in blocks.iter().zip(res) {
                r.unwrap();
                say("OK", key);
            }
            continue;
        }
        let seed = iteration * 1_000_000 + i;
        let (key, h, p) = block(&ns, seed);
        say("BEGIN", &key);
        s.put_block(&ns.id(), &h, &p, PutMeta::default()).unwrap();
        say("OK", &key);
    }
}

struct Killer(Child);
impl Drop for Killer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn sigkill_at_random_points_loses_nothing_reported() {
    if std::env::var(ENV).is_ok() {
        return;
    }
    kill_and_check(false);
}

#[test]
fn sigkill_during_batched_puts_loses_nothing_reported() {
    if std::env::var(ENV).is_ok() {
        return;
    }
    kill_and_check(true);
}

fn kill_and_check(batch: bool) {
    let long = std::env::var("KVTIER_LONG_TESTS").is_ok_and(|v| v == "1");
    let iterations = if long { 200 } else { 4 };
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("g3");
    let exe = std::env::current_exe().unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut begun: HashSet<String> = HashSet::new();
    let mut stored: HashSet<String> = HashSet::new();
    let mut checked: HashSet<String> = HashSet::new();
    let ns = namespace(8192, "crash").unwrap();
    for it in 0..iterations {
        let child = Command::new(&exe)
            .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
            .env(
                ENV,
                format!(
                    "{}:{it}:{}",
                    root.display(),
                    if batch { "batch" } else { "single" }
                ),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut child = Killer(child);
        let stdout = child.0.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
                .collect::<Vec<String>>()
        });
        let delay = rng.random_range(30..400);
        std::thread::sleep(std::time::Duration::from_millis(delay));
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.0.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        let _ = child.0.wait();
        for line in reader.join().unwrap() {
            // libtest's "test crash_child ... " has no newline of its own.
            if let Some(i) = line.find("BEGIN ") {
                begun.insert(line[i + 6..].to_string());
            } else if let Some(i) = line.find("OK ") {
                stored.insert(line[i + 3..].to_string());
            }
        }
        let s = common::open(&root, EngineKind::Auto);
        assert_eq!(
            common::temp_files(&root),
            0,
            "iteration {it}: temp files left"
        );
        let visible: Vec<String> = s
            .list(&ns.id(), None, usize::MAX)
            .iter()
            .map(|k| k.to_hex())
            .collect();
        for k in &visible {
            assert!(begun.contains(k), "iteration {it}: phantom block {k}");
        }
        // Full re-read of everything every 10th iteration and at the end;
        // in between, new blocks are read and the rest must be indexed.
        let full = it % 10 == 9 || it + 1 == iterations;
        for k in &stored {
            let key = kvtier_client::BlockKey::from_hex(k).unwrap();
            if !full && checked.contains(k) {
                assert!(
                    s.contains(&ns.id(), &key).unwrap(),
                    "iteration {it}: lost {k}"
                );
                continue;
            }
            match s.get(&ns.id(), &key).unwrap() {
                Lookup::Hit(b) => assert_eq!(b.header.key, key),
                Lookup::Miss(r) => panic!("iteration {it}: reported block {k} missing: {r:?}"),
            }
        }
        checked.extend(stored.iter().cloned());
        if it % 25 == 24 {
            eprintln!(
                "crash test: {} iterations, {} blocks stored",
                it + 1,
                stored.len()
            );
        }
        assert_eq!(
            s.stats().quarantined,
            0,
            "iteration {it}: a torn block was visible"
        );
        assert_eq!(s.recovery.lock().unwrap().quarantined, 0);
        s.close().unwrap();
    }
    eprintln!(
        "crash test: {iterations} kills, {} blocks reported stored, {} begun",
        stored.len(),
        begun.len()
    );
    assert!(long || !stored.is_empty() || iterations < 2);
}
