//! End-to-end: G4 write-through outlives an object-store outage with no
//! restart. A real `kvtierd` starts while SeaweedFS (behind the fault
//! proxy) is down, acknowledges offloads, gives their uploads up; the store
//! comes back; every block reaches the bucket, the backlog gauge returns to
//! 0 and `/healthz` says `ok`, all by themselves (an active probe, the
//! backlog scan). Before: the blocks stayed out of the bucket and
//! `/healthz` said `start-up check failed` until a restart, with one WARN
//! line per upload attempt (52 for 4 blocks).
//!
//! `KVTIER_FAULT_LONG=1` (scripts/fault-suite.sh) runs three outages, the
//! second and third while the daemon is healthy, with more blocks.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kvtier_client::{BlockKey, Client, ClientConfig, Hints, KvLayout, Namespace, OffloadOutcome};
use kvtier_daemon::base::tier::BlockTier;
use kvtier_daemon::testkit::fault_proxy::{Fault, FaultProxy, FaultRule};
use kvtier_daemon::testkit::s3::{S3Server, ACCESS_KEY_ID};
use kvtier_daemon::tiers::g4::G4Store;
use std::path::Path;
use std::time::{Duration, Instant};
use support::{metric, Daemon};

const BLOCK: usize = 16 << 10;
const PREFIX: &str = "outage";

fn ns() -> Namespace {
    Namespace::new(
        "e2e-outage",
        KvLayout::with_block_bytes(BLOCK as u64).unwrap(),
        "",
        "t",
    )
    .unwrap()
}

fn long() -> bool {
    std::env::var("KVTIER_FAULT_LONG").is_ok_and(|v| v == "1")
}

fn write_config(dir: &Path, s3: &S3Server, endpoint: &str) -> String {
    let t = format!(
        "[g4]\nurl = \"s3://{}/{PREFIX}\"\nendpoint = \"{endpoint}\"\nregion = \"us-east-1\"\n\
         allow_http = true\npath_style = true\naccess_key_id = \"{}\"\nsecret_access_key = \"{}\"\n\
         upload_retries = 2\nretry_backoff_ms = 50\nretry_backoff_max_ms = 100\n\
         response_timeout_ms = 500\nconnect_timeout_ms = 500\nrequest_timeout_ms = 3000\n\
         startup_check_timeout_ms = 1000\nbreaker_failures_max = 3\nbreaker_open_ms = 300\n\
         breaker_open_max_ms = 1000\nprobe_interval_ms = 300\nbacklog_retry_ms = 500\n\
         backlog_scan_interval_ms = 3000\n\
         [node]\nlookup_remote_deadline_ms = 5000\n",
        s3.bucket, ACCESS_KEY_ID, s3.secret_access_key
    );
    let p = dir.join("kvtierd.toml");
    std::fs::write(&p, t).unwrap();
    // It holds the G4 secret: owner only, or kvtierd refuses it.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p.display().to_string()
}

/// Offloads `n` blocks of chain `seed`; every one acknowledged.
fn offload(d: &Daemon, seed: u32, n: usize) -> Vec<BlockKey> {
    let mut c = ClientConfig::new(&d.socket);
    c.timeout_ms = 15_000;
    let client = Client::with_config(c);
    let h = client.namespace(&ns());
    let tokens: Vec<u32> = (0..n as u32 * 16).map(|t| t + seed * 1_000_000).collect();
    let keys = h.hash_chain(&tokens);
    let data: Vec<Vec<u8>> = (0..n)
        .map(|i| {
            (0..BLOCK)
                .map(|j| (j as u32 ^ seed ^ (i as u32) << 8) as u8)
                .collect()
        })
        .collect();
    let refs: Vec<&[u8]> = data.iter().map(|d| &d[..]).collect();
    let out = h.offload_chain(None, &keys, &refs, Hints::default());
    assert!(out.iter().all(|o| *o == OffloadOutcome::Stored), "{out:?}");
    keys
}

fn wait_for(what: &str, within: Duration, mut f: impl FnMut() -> Option<String>) {
    let t = Instant::now();
    loop {
        let Some(why) = f() else { return };
        assert!(t.elapsed() < within, "{what} not within {within:?}: {why}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn in_bucket(direct: &G4Store, keys: &[BlockKey]) -> usize {
    keys.iter()
        .filter(|k| direct.contains(&ns().id(), k).unwrap_or(false))
        .count()
}

/// Uploads of `keys` given up during an outage; the outage ends with
/// `heal`; all of them must reach the bucket and the daemon be healthy.
fn lost_then_recovered(d: &Daemon, direct: &G4Store, keys: &[BlockKey], heal: impl FnOnce()) {
    let given_up_before = metric(
        &d.scrape(),
        "kvtier_g4_uploads_total",
        &[("outcome", "given_up")],
    );
    wait_for("uploads given up", Duration::from_secs(60), || {
        let m = d.scrape();
        let g = metric(&m, "kvtier_g4_uploads_total", &[("outcome", "given_up")]);
        (g < given_up_before + keys.len() as f64).then(|| format!("given_up = {g}"))
    });
    wait_for("backlog counted", Duration::from_secs(60), || {
        let b = metric(&d.scrape(), "kvtier_g4_backlog_blocks", &[]);
        (b < keys.len() as f64).then(|| format!("backlog = {b}"))
    });
    assert_eq!(in_bucket(direct, keys), 0, "uploaded during the outage?");
    heal();
    wait_for("blocks in the bucket", Duration::from_secs(120), || {
        let n = in_bucket(direct, keys);
        (n < keys.len()).then(|| format!("{n} of {} in the bucket", keys.len()))
    });
    wait_for("healthy again", Duration::from_secs(60), || {
        let (_, body) = d.http_get("/healthz");
        let m = d.scrape();
        let backlog = metric(&m, "kvtier_g4_backlog_blocks", &[]);
        (body != "ok\n" || backlog != 0.0).then(|| format!("healthz {body:?}, backlog {backlog}"))
    });
}

#[test]
fn uploads_lost_to_an_outage_reach_g4_without_a_restart() {
    let Some(mut s3) = S3Server::start("kvtier-outage").unwrap() else {
        eprintln!("SKIP: .venv/bin/weed not found (run scripts/setup.sh or set KVTIER_WEED)");
        return;
    };
    let proxy = FaultProxy::start(&s3.endpoint()).unwrap();
    let direct = G4Store::open(s3.g4_config(PREFIX)).unwrap();
    let cfg_dir = tempfile::tempdir().unwrap();
    let conf = write_config(cfg_dir.path(), &s3, &proxy.endpoint());
    let log = cfg_dir.path().join("kvtierd.log");

    // S3 is away before the daemon starts: the start-up check fails.
    s3.kill();
    let d = Daemon::start_logged(&["--config".into(), conf], &log);
    let (_, body) = d.http_get("/healthz");
    assert!(
        body.starts_with("degraded") && body.contains("G4"),
        "{body}"
    );
    // A lookup G4 cannot answer is a miss `unavailable`, not `absent`: the
    // block may well be there (issue 30).
    let miss = |reason: &str| metric(&d.scrape(), "kvtier_misses_total", &[("reason", reason)]);
    let (absent0, unavailable0) = (miss("absent"), miss("unavailable"));
    let mut cc = ClientConfig::new(&d.socket);
    cc.timeout_ms = 15_000;
    let client = Client::with_config(cc);
    let never: Vec<BlockKey> = (0..3u64)
        .map(|i| BlockKey::from_u64(0xdead_0000 + i))
        .collect();
    assert_eq!(client.namespace(&ns()).lookup(&never).prefix_len(), 0);
    assert_eq!(
        miss("unavailable"),
        unavailable0 + 3.0,
        "misses while G4 is down"
    );
    assert_eq!(
        miss("absent"),
        absent0,
        "no miss counted absent while G4 is down"
    );
    let keys = offload(&d, 1, if long() { 24 } else { 4 });
    lost_then_recovered(&d, &direct, &keys, || s3.restart().unwrap());
    // With G4 back, a block nobody stored is absent again.
    let absent1 = miss("absent");
    let gone = [BlockKey::from_u64(0xdead_1000)];
    assert_eq!(client.namespace(&ns()).lookup(&gone).prefix_len(), 0);
    assert_eq!(
        miss("absent"),
        absent1 + 1.0,
        "an absent block while G4 answers"
    );
    let m = d.scrape();
    assert!(metric(&m, "kvtier_g4_recoveries_total", &[]) >= 1.0);
    assert!(metric(&m, "kvtier_g4_backlog_requeued_total", &[]) >= keys.len() as f64);

    if long() {
        // A healthy daemon loses S3 (every request answered 503, then the
        // server stopped), twice.
        for round in 0..2u32 {
            if round == 0 {
                proxy.set(FaultRule::new(Fault::Status(503)));
            } else {
                s3.kill();
            }
            let keys = offload(&d, 10 + round, 16);
            lost_then_recovered(&d, &direct, &keys, || {
                proxy.clear();
                if round == 1 {
                    s3.restart().unwrap();
                }
            });
            eprintln!("PASS g4 outage round {round}");
        }
    }

    // Rate-limited: a handful of WARN lines, not one per attempt.
    let text = std::fs::read_to_string(&log).unwrap();
    let warns = text.lines().filter(|l| l.contains("WARN")).count();
    assert!(warns <= 15, "{warns} WARN lines:\n{text}");
}
