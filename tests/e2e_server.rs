//! End-to-end: a real `kvtierd` process driven by the client library from
//! several processes at once. Workers are this test binary re-run with
//! `KVTIER_E2E_*` variables (see `support::spawn_worker`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kvtier_client::proto::{self, ItemStatus, Request};
use kvtier_client::{
    BlockKey, Client, ClientConfig, Hints, KvEventData, KvLayout, MissCause, Namespace,
    OffloadOutcome, Onboarded,
};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};
use support::{metric, spawn_worker, wait_child, Daemon};

const BLOCK: usize = 64 << 10;

fn ns() -> Namespace {
    Namespace::new(
        "e2e-model",
        KvLayout::with_block_bytes(BLOCK as u64).unwrap(),
        "",
        "t",
    )
    .unwrap()
}

fn payload(worker: u32, i: usize) -> Vec<u8> {
    let mut v = vec![0u8; BLOCK];
    let mut x = (worker as u64) << 32 | i as u64 | 1;
    for c in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    v
}

fn tokens(worker: u32, blocks: usize) -> Vec<u32> {
    (0..blocks as u32 * 16)
        .map(|t| t + worker * 1_000_000)
        .collect()
}

fn cfg(socket: &str, direct: bool) -> ClientConfig {
    let mut c = ClientConfig::new(socket);
    c.region_bytes = 4 << 20;
    c.timeout_ms = 2000;
    c.direct_read = direct;
    c
}

/// Worker body for `round_trip_from_several_processes`.
#[test]
fn worker_round_trip() {
    let Ok(socket) = std::env::var("KVTIER_E2E_SOCKET") else {
        return; // only runs as a child
    };
    let w: u32 = std::env::var("KVTIER_E2E_WORKER").unwrap().parse().unwrap();
    let ns = ns();
    let client = Client::with_config(cfg(&socket, false));
    let h = client.namespace(&ns);
    let keys = h.hash_chain(&tokens(w, 8));
    assert_eq!(keys.len(), 8);
    let data: Vec<Vec<u8>> = (0..8).map(|i| payload(w, i)).collect();
    let refs: Vec<&[u8]> = data.iter().map(|d| &d[..]).collect();
    let out = h.offload_chain(None, &keys, &refs, Hints::default());
    assert!(out.iter().all(|o| *o == OffloadOutcome::Stored), "{out:?}");
    let again = h.offload_chain(None, &keys[..2], &refs[..2], Hints::default());
    assert!(again.iter().all(|o| *o == OffloadOutcome::AlreadyPresent));
    let l = h.lookup(&keys);
    assert_eq!(l.prefix_len(), 8, "{l:?}");
    // Both delivery modes, verified byte for byte.
    for direct in [false, true] {
        let c = Client::with_config(cfg(&socket, direct));
        let h = c.namespace(&ns);
        let mut bufs: Vec<Vec<u8>> = (0..8).map(|_| vec![0u8; BLOCK]).collect();
        let mut rb: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        // Reverse order: onboard does not depend on chain order.
        let rev: Vec<BlockKey> = keys.iter().rev().copied().collect();
        let res = h.onboard_into(&rev, &mut rb);
        for (j, r) in res.iter().enumerate() {
            assert!(r.is_hit(), "direct={direct} {r:?}");
            assert_eq!(bufs[j], data[7 - j], "direct={direct} block {j}");
        }
    }
    println!("WORKER_OK {w}");
}

#[test]
fn round_trip_from_several_processes() {
    if std::env::var("KVTIER_E2E_SOCKET").is_ok() {
        return;
    }
    // G3 only: this suite checks the server over the local tier (an
    // evicted block must miss, events are Disk); e2e_node covers G4.
    let d = Daemon::start_with(&["--g4".into(), String::new()], &[]);
    let sock = d.socket.display().to_string();
    let admin = Client::with_config(cfg(&sock, false));
    let mut events = admin.subscribe_events().unwrap();
    let workers: Vec<_> = (0..4u32)
        .map(|w| {
            spawn_worker(
                "worker_round_trip",
                &[
                    ("KVTIER_E2E_SOCKET", sock.clone()),
                    ("KVTIER_E2E_WORKER", w.to_string()),
                ],
            )
        })
        .collect();
    for (w, c) in workers.into_iter().enumerate() {
        let (ok, out) = wait_child(c, Duration::from_secs(60));
        assert!(ok && out.contains("WORKER_OK"), "worker {w} failed: {out}");
    }
    // Events: 32 stored blocks, chained (parent of block i is block i-1).
    let mut stored = Vec::new();
    let t = Instant::now();
    while stored.len() < 32 && t.elapsed() < Duration::from_secs(10) {
        if let Some(e) = events.next_timeout(Duration::from_millis(200)).unwrap() {
            if let KvEventData::Stored {
                parent_hash,
                blocks,
            } = e.data
            {
                assert_eq!(e.namespace, ns().id());
                assert_eq!(e.storage_tier.name(), "Disk");
                stored.push((parent_hash, blocks[0].block_hash));
            }
        }
    }
    assert_eq!(stored.len(), 32);
    let ns = ns();
    let h = admin.namespace(&ns);
    let keys = h.hash_chain(&tokens(0, 8));
    assert!(
        stored.contains(&(Some(keys[0]), keys[1])),
        "parent chaining"
    );
    assert!(stored.contains(&(None, keys[0])));

    // Pin protects from evict; unpin then evict removes and emits Removed,
    // for the block and for the rest of its chain (4..8), which no lookup
    // reaches without it: taken along, children first.
    assert_eq!(h.pin(&keys[3..4], 60_000).unwrap(), vec![ItemStatus::Ok]);
    let st = h.stat(&keys[3..4]).unwrap()[0].unwrap();
    assert!(st.pinned_until_unix_ms > 0);
    assert_eq!(st.payload_len, BLOCK as u64);
    assert_eq!(
        h.evict(&keys[3..4]).unwrap(),
        vec![ItemStatus::LimitReached]
    );
    assert_eq!(h.unpin(&keys[3..4]).unwrap(), vec![ItemStatus::Ok]);
    assert_eq!(h.evict(&keys[3..4]).unwrap(), vec![ItemStatus::Ok]);
    assert_eq!(h.lookup(&keys).prefix_len(), 3);
    let mut removed: Vec<BlockKey> = Vec::new();
    let t = Instant::now();
    while !removed.contains(&keys[3]) && t.elapsed() < Duration::from_secs(5) {
        if let Some(e) = events.next_timeout(Duration::from_millis(200)).unwrap() {
            if let KvEventData::Removed { block_hashes } = &e.data {
                let json = e.to_json();
                for (i, k) in block_hashes.iter().enumerate() {
                    assert_eq!(json["data"]["removed"]["block_hashes"][i], k.to_hex());
                }
                removed.extend(block_hashes);
            }
        }
    }
    // The evicted block's own event comes after its descendants'.
    assert_eq!(removed.last(), Some(&keys[3]), "{removed:?}");
    let mut want = keys[3..].to_vec();
    want.sort();
    removed.sort();
    assert_eq!(removed, want);
    for k in &keys[3..] {
        let mut buf = vec![0u8; BLOCK];
        let r = h.onboard_into(std::slice::from_ref(k), &mut [&mut buf[..]]);
        assert!(
            matches!(&r[0], Onboarded::Miss(m) if m.cause == MissCause::Absent),
            "{r:?}"
        );
    }

    // stats, list
    let s = admin.stats().unwrap();
    assert_eq!(s["backend"], "g3");
    assert_eq!(s["tiers"]["g3"]["blocks"], 27);
    let (page, next) = admin.list(Some(ns.id()), None, 10).unwrap();
    assert_eq!(page.len(), 10);
    let (rest, _) = admin.list(Some(ns.id()), next, 100).unwrap();
    assert_eq!(page.len() + rest.len(), 27);

    // Metrics moved.
    let m = d.scrape();
    assert!(metric(&m, "kvtier_requests_total", &[("op", "offload")]) >= 8.0);
    assert!(metric(&m, "kvtier_offload_bytes_total", &[]) >= (32 * BLOCK) as f64);
    assert!(metric(&m, "kvtier_onboard_bytes_total", &[]) >= (64 * BLOCK) as f64);
    assert!(metric(&m, "kvtier_hits_total", &[("tier", "g3")]) >= 64.0);
    assert!(metric(&m, "kvtier_misses_total", &[("reason", "absent")]) >= 1.0);
    assert_eq!(metric(&m, "kvtier_blocks", &[("tier", "g3")]), 27.0);
    assert!(metric(&m, "kvtier_evictions_total", &[]) >= 1.0);
    assert!(metric(&m, "kvtier_op_latency_seconds_count", &[("op", "lookup")]) >= 4.0);
    let (st, body) = d.http_get("/healthz");
    assert!(st.contains("200") && body.contains("ok"));
}

/// Worker body for `kill9_mid_request_then_restart`: hammers the daemon
/// and checks every call returns within its deadline, then that it
/// reconnects by itself once the daemon is back.
#[test]
fn worker_hammer() {
    let Ok(socket) = std::env::var("KVTIER_E2E_HAMMER") else {
        return;
    };
    let ns = ns();
    let mut c = cfg(&socket, std::env::var("KVTIER_E2E_DIRECT").is_ok());
    c.timeout_ms = 500;
    let client = Client::with_config(c);
    let h = client.namespace(&ns);
    let keys = h.hash_chain(&tokens(99, 4));
    let data: Vec<Vec<u8>> = (0..4).map(|i| payload(99, i)).collect();
    let refs: Vec<&[u8]> = data.iter().map(|d| &d[..]).collect();
    let started = Instant::now();
    let mut misses = 0;
    let mut hit_after_miss = false;
    let mut bufs: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; BLOCK]).collect();
    while started.elapsed() < Duration::from_secs(15) {
        let t = Instant::now();
        h.offload_chain(None, &keys, &refs, Hints::default());
        let mut rb: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let r = h.onboard_into(&keys, &mut rb);
        let l = h.lookup(&keys);
        let took = t.elapsed();
        // Three calls, each bounded by 500 ms plus scheduling slack.
        assert!(took < Duration::from_millis(3000), "calls took {took:?}");
        let all_hit = r.iter().all(|x| x.is_hit()) && l.prefix_len() == 4;
        if all_hit {
            for (b, d) in bufs.iter().zip(&data) {
                assert_eq!(b, d);
            }
            if misses > 0 {
                hit_after_miss = true;
                break;
            }
        } else {
            misses += 1;
        }
    }
    assert!(misses > 0, "never saw the daemon die");
    assert!(hit_after_miss, "did not reconnect after restart");
    println!("HAMMER_OK misses={misses}");
}

#[test]
fn kill9_mid_request_then_restart() {
    if std::env::var("KVTIER_E2E_SOCKET").is_ok() || std::env::var("KVTIER_E2E_HAMMER").is_ok() {
        return;
    }
    let mut d = Daemon::start();
    let sock = d.socket.display().to_string();
    let workers: Vec<_> = (0..3)
        .map(|i| {
            let mut env = vec![("KVTIER_E2E_HAMMER", sock.clone())];
            if i == 2 {
                env.push(("KVTIER_E2E_DIRECT", "1".into()));
            }
            spawn_worker("worker_hammer", &env)
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    d.kill9();
    std::thread::sleep(Duration::from_millis(1000));
    d.restart();
    for (i, c) in workers.into_iter().enumerate() {
        let (ok, out) = wait_child(c, Duration::from_secs(40));
        assert!(ok && out.contains("HAMMER_OK"), "worker {i}: {out}");
    }
}

fn read_reply(s: &mut UnixStream) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let n = u32::from_le_bytes(len) as usize;
    assert!(n <= proto::FRAME_BYTES_MAX);
    let mut b = vec![0u8; n];
    s.read_exact(&mut b).ok()?;
    Some(b)
}

/// Sends raw bytes on a fresh connection; returns the error code of the
/// reply, if any, and checks the daemon closes or answers in time.
fn poke(sock: &std::path::Path, bytes: &[u8]) -> Option<u16> {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let b = read_reply(&mut s)?;
    match proto::Response::decode(&b, proto::OP_HELLO) {
        Ok((_, proto::Response::Error { code, .. })) => Some(code),
        _ => None,
    }
}

#[test]
fn malformed_and_oversized_frames_never_crash_the_daemon() {
    if std::env::var("KVTIER_E2E_SOCKET").is_ok() || std::env::var("KVTIER_E2E_HAMMER").is_ok() {
        return;
    }
    use proptest::prelude::*;
    let d = Daemon::start();
    let sock = d.socket.clone();

    // Oversized: refused with TOO_LARGE before any body is read.
    let big = ((proto::FRAME_BYTES_MAX + 1) as u32).to_le_bytes();
    assert_eq!(poke(&sock, &big), Some(proto::code::TOO_LARGE));
    // Wrong version, unknown op, request before hello, a region without fd.
    let mut f = Request::Stats.encode(1);
    f[4] = 9;
    assert_eq!(poke(&sock, &f), Some(proto::code::VERSION));
    assert_eq!(
        poke(&sock, &Request::Stats.encode(1)),
        Some(proto::code::MALFORMED)
    );
    let hello = Request::Hello {
        shm_bytes: 1 << 20,
        pid: 1,
        features: 0,
    }
    .encode(1);
    assert_eq!(poke(&sock, &hello), Some(proto::code::NO_REGION));

    // Fuzz: random frames and mutated valid ones, after a valid hello.
    let valid: Vec<Vec<u8>> = vec![
        Request::Lookup {
            ns: ns().id(),
            keys: vec![BlockKey::from_u64(1); 3],
        }
        .encode(2),
        Request::Offload {
            ns: ns().id(),
            items: vec![],
        }
        .encode(2),
        Request::List {
            ns: None,
            after: None,
            limit: 5,
        }
        .encode(2),
    ];
    let hello0 = Request::Hello {
        shm_bytes: 0,
        pid: 1,
        features: 0,
    }
    .encode(1);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 150,
        ..ProptestConfig::default()
    });
    runner
        .run(
            &(
                0usize..3,
                proptest::collection::vec((any::<u16>(), any::<u8>()), 0..8),
                proptest::collection::vec(any::<u8>(), 0..64),
                any::<bool>(),
            ),
            |(which, flips, junk, raw)| {
                let mut frame = if raw {
                    let mut f = ((junk.len() as u32).saturating_add(8))
                        .to_le_bytes()
                        .to_vec();
                    f.extend_from_slice(&[1, junk.first().copied().unwrap_or(2), 0, 0, 0, 0, 0, 0]);
                    f.extend_from_slice(&junk);
                    f
                } else {
                    valid[which].clone()
                };
                for (pos, x) in flips {
                    let n = frame.len();
                    frame[4 + pos as usize % (n - 4)] ^= x;
                }
                let mut all = hello0.clone();
                all.extend_from_slice(&frame);
                let mut s = UnixStream::connect(&sock).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let _ = s.write_all(&all);
                let _ = s.shutdown(std::net::Shutdown::Write);
                // Hello reply, then a reply or an error or a close: never a hang.
                let mut sink = Vec::new();
                let r = s.read_to_end(&mut sink);
                prop_assert!(r.is_ok(), "daemon hung: {r:?}");
                Ok(())
            },
        )
        .unwrap();

    // Still serving real clients.
    let c = Client::connect(&sock).unwrap();
    assert!(c.stats().is_ok());
    let m = d.scrape();
    assert!(metric(&m, "kvtier_errors_total", &[("kind", "malformed")]) >= 1.0);
    assert!(metric(&m, "kvtier_errors_total", &[("kind", "too_large")]) >= 1.0);
}

#[test]
fn three_hundred_connections_and_graceful_sigterm() {
    if std::env::var("KVTIER_E2E_SOCKET").is_ok() || std::env::var("KVTIER_E2E_HAMMER").is_ok() {
        return;
    }
    let mut d = Daemon::start();
    let ns = ns();
    let mut clients = Vec::new();
    for _ in 0..300 {
        let mut c = ClientConfig::new(&d.socket);
        c.region_bytes = 64 << 10;
        c.timeout_ms = 5000;
        let c = Client::with_config(c);
        c.ensure_connected().unwrap();
        clients.push(c);
    }
    // A stuck client (connected, silent) does not stall anyone.
    let _silent = UnixStream::connect(&d.socket).unwrap();
    let keys = ns.hash_chain(&tokens(5, 2));
    let t = Instant::now();
    for c in &clients {
        let l = c.namespace(&ns).lookup(&keys);
        assert!(l.miss.is_none(), "{l:?}");
    }
    eprintln!("300 lookups over 300 live connections: {:?}", t.elapsed());
    let s = clients[0].stats().unwrap();
    assert!(s["connections"].as_u64().unwrap() >= 300, "{s}");
    let st = d.term(Duration::from_secs(15)).expect("exit on SIGTERM");
    assert!(st.success(), "{st:?}");
    assert!(!d.socket.exists(), "socket removed on shutdown");
    // Fail open once it is gone: a miss with a reason, fast.
    let t = Instant::now();
    let l = clients[1].namespace(&ns).lookup(&keys);
    assert!(l.miss.is_some());
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn config_errors_and_default_config() {
    if std::env::var("KVTIER_E2E_SOCKET").is_ok() || std::env::var("KVTIER_E2E_HAMMER").is_ok() {
        return;
    }
    let bin = support::kvtierd_bin();
    let out = std::process::Command::new(&bin)
        .arg("--print-default-config")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("[server]") && text.contains("capacity"));
    // The printed file is the same whoever prints it: no home directory or
    // state directory of the invoking user baked in (issue 30).
    for (home, state) in [("/home/alice-e2e", ""), ("/root", "/var/state-e2e")] {
        let out = std::process::Command::new(&bin)
            .arg("--print-default-config")
            .env("HOME", home)
            .env("XDG_STATE_HOME", state)
            .output()
            .unwrap();
        let mine = String::from_utf8(out.stdout).unwrap();
        assert_eq!(mine, text, "HOME={home} XDG_STATE_HOME={state}");
        assert!(
            !mine.contains(home) && (state.is_empty() || !mine.contains(state)),
            "{home} or {state} in the default config"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.toml");
    std::fs::write(&p, "[g3]\ncapacity = \"lots\"\n").unwrap();
    let out = std::process::Command::new(&bin)
        .arg("--config")
        .arg(&p)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("lots"), "{err}");
    std::fs::write(&p, "[metrics]\naddr = \"nowhere\"\n").unwrap();
    let out = std::process::Command::new(&bin)
        .arg("--config")
        .arg(&p)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("metrics.addr"), "{err}");
    assert_eq!(err.lines().count(), 1, "one clear line: {err}");
}

/// One `lookup_many` request answers a chain's cached prefix in each of
/// several namespaces (a tensor-parallel group's ranks), each as its own
/// lookup would: one frame, counted once.
#[test]
fn lookup_many_answers_each_namespace_in_one_request() {
    if std::env::var("KVTIER_E2E_SOCKET").is_ok() || std::env::var("KVTIER_E2E_HAMMER").is_ok() {
        return;
    }
    let d = Daemon::start();
    let client = Client::with_config(cfg(&d.socket.display().to_string(), false));
    let layout = KvLayout::with_block_bytes(BLOCK as u64).unwrap();
    let nss: Vec<Namespace> = (0..3)
        .map(|r| Namespace::new(format!("e2e-rank-{r}"), layout, "", "t").unwrap())
        .collect();
    let keys = client.namespace(&nss[0]).hash_chain(&tokens(7, 6));
    let data: Vec<Vec<u8>> = (0..6).map(|i| payload(7, i)).collect();
    let refs: Vec<&[u8]> = data.iter().map(|d| &d[..]).collect();
    // Rank 0 holds the whole chain, rank 1 its first two blocks, rank 2 none.
    for (ns, n) in [(&nss[0], 6), (&nss[1], 2)] {
        let out =
            client
                .namespace(ns)
                .offload_chain(None, &keys[..n], &refs[..n], Hints::default());
        assert!(out.iter().all(|o| *o == OffloadOutcome::Stored), "{out:?}");
    }
    let before = metric(
        &d.scrape(),
        "kvtier_requests_total",
        &[("op", "lookup_many")],
    );
    let ids: Vec<_> = nss.iter().map(|n| n.id()).collect();
    let got = client.lookup_many(&ids, &keys);
    let prefixes: Vec<usize> = got.iter().map(|l| l.prefix_len()).collect();
    assert_eq!(prefixes, vec![6, 2, 0], "{got:?}");
    for (ns, l) in nss.iter().zip(&got) {
        assert_eq!(l.tiers, client.namespace(ns).lookup(&keys).tiers);
    }
    let after = metric(
        &d.scrape(),
        "kvtier_requests_total",
        &[("op", "lookup_many")],
    );
    assert_eq!(after - before, 1.0);
    // Out of range: a miss in each, nothing sent.
    assert!(client.lookup_many(&[], &keys).is_empty());
    let many = vec![ids[0]; proto::LOOKUP_NAMESPACES_MAX + 1];
    assert!(client
        .lookup_many(&many, &keys)
        .iter()
        .all(|l| l.prefix_len() == 0 && l.miss.is_some()));
}
