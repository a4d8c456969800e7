//! /metrics by Prometheus conventions: one real kvtierd (G3, a file:// G4
//! that already holds blocks at start, a FUSE mount when the machine
//! allows it), some traffic of every kind, then its exposition parsed with
//! a real Prometheus text parser (`prometheus-parse`) and every family
//! checked: counters end in `_total`, base units last (`_seconds`,
//! `_bytes`; no ms/us), HELP present, one TYPE per family, no untyped
//! samples, no catch-all `stat`/`what` labels; and the figures the issue
//! named are there and true (G4's count from start, mount activity, pins
//! set with setfattr, every `kvtier stats` figure).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kvtier_client::{block_path, encode_block, BlockHeader, BlockKey, Hints, KvLayout, Namespace};
use prometheus_parse::{LineInfo, SampleType};
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use support::{metric, Daemon};

const BLOCK: usize = 64 << 10;
/// Objects put into G4 before the daemon starts.
const G4_AT_START: usize = 5;

fn ns() -> Namespace {
    Namespace::new(
        "e2e-metrics",
        KvLayout::with_block_bytes(BLOCK as u64).unwrap(),
        "",
        "t",
    )
    .unwrap()
}

fn block(i: u64) -> (BlockKey, Vec<u8>) {
    let payload: Vec<u8> = (0..BLOCK).map(|j| (j as u64 * 7 + i) as u8).collect();
    let h = BlockHeader::for_payload(&ns(), BlockKey::from_u64(0x5000 + i), &payload, 0);
    (h.key, encode_block(&h, &payload))
}

fn mount_ok() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    root && Path::new("/dev/fuse").exists()
}

fn is_mounted(p: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(1) == Some(p.to_str().unwrap()))
}

fn sh(cmd: &str) -> String {
    let o = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    assert!(
        o.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn wait_for(d: &Daemon, what: &str, ok: impl Fn(&[support::Sample]) -> bool) {
    let t = Instant::now();
    loop {
        if ok(&d.scrape()) {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "{what} within 20 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The conventions, on every family of one exposition. Returns each
/// family's type.
fn check_conventions(text: &str) -> HashMap<String, SampleType> {
    let mut types: HashMap<String, SampleType> = HashMap::new();
    let mut helps: HashMap<String, String> = HashMap::new();
    for line in text.lines() {
        match LineInfo::parse(line) {
            LineInfo::Doc { metric_name, doc } => {
                helps.insert(metric_name.to_string(), doc.to_string());
            }
            LineInfo::Type {
                metric_name,
                metric_alias,
                sample_type,
            } => {
                // The parser names a histogram family `<name>_bucket`
                // with `<name>` as its alias: the family is the alias.
                let metric_name = metric_alias.unwrap_or(metric_name);
                let again = types.insert(metric_name.clone(), sample_type);
                assert!(again.is_none(), "{metric_name}: two TYPE lines");
            }
            LineInfo::Sample { .. } => {}
            LineInfo::Empty => {}
            LineInfo::Ignored => panic!("line the parser ignores: {line:?}"),
        }
    }
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap();
    assert!(!scrape.samples.is_empty());
    for (name, ty) in &types {
        let help = helps.get(name).map(String::as_str).unwrap_or("");
        assert!(!help.trim().is_empty(), "{name}: no HELP");
        // The process collector's standard families are the only others.
        assert!(
            name.starts_with("kvtier_") || name.starts_with("process_"),
            "{name}: not kvtier_* or process_*"
        );
        match ty {
            SampleType::Counter => assert!(name.ends_with("_total"), "counter {name} lacks _total"),
            SampleType::Gauge => assert!(!name.ends_with("_total"), "gauge {name} ends in _total"),
            SampleType::Histogram => assert!(
                name.ends_with("_seconds") || name.ends_with("_bytes"),
                "histogram {name}: no base unit"
            ),
            other => panic!("{name}: type {other:?}"),
        }
        let words: Vec<&str> = name.split('_').collect();
        for bad in [
            "ms",
            "us",
            "milliseconds",
            "microseconds",
            "millis",
            "kb",
            "mb",
        ] {
            assert!(!words.contains(&bad), "{name}: unit {bad} (use base units)");
        }
        for unit in ["seconds", "bytes"] {
            if let Some(i) = words.iter().position(|w| *w == unit) {
                let tail = &words[i + 1..];
                assert!(
                    tail.is_empty() || tail == ["total"],
                    "{name}: the unit {unit} must come last (before _total)"
                );
            }
        }
    }
    for s in &scrape.samples {
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suf| {
                s.metric
                    .strip_suffix(suf)
                    .filter(|f| types.get(*f) == Some(&SampleType::Histogram))
            })
            .unwrap_or(&s.metric);
        assert!(
            types.contains_key(family),
            "{}: sample without TYPE",
            s.metric
        );
        if let prometheus_parse::Value::Untyped(_) = s.value {
            // _sum/_count of histograms come back untyped; nothing else may.
            assert_ne!(family, s.metric, "{}: untyped", s.metric);
        }
        if let prometheus_parse::Value::Counter(v) = s.value {
            assert!(v.is_finite() && v >= 0.0, "{}: counter {v}", s.metric);
        }
        for label in ["stat", "what"] {
            assert!(
                s.labels.get(label).is_none(),
                "{}: catch-all label {label:?} (one family per meaning)",
                s.metric
            );
        }
    }
    types
}

#[test]
fn metrics_follow_prometheus_conventions_and_show_every_figure() {
    let g4 = tempfile::tempdir().unwrap();
    // G4 already holds blocks when the daemon starts (another node's, or
    // this one's from before a restart): the count is right from start.
    for i in 0..G4_AT_START as u64 {
        let (k, f) = block(100 + i);
        let p = g4.path().join("blocks").join(block_path(&ns().id(), &k));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, f).unwrap();
    }
    let mnt = tempfile::tempdir().unwrap();
    let with_mount = mount_ok();
    if !with_mount {
        eprintln!("NOTE: no root or /dev/fuse: the mount figures are not checked");
    }
    let mut args = vec![
        "--g4".to_string(),
        format!("file://{}", g4.path().display()),
    ];
    if with_mount {
        args.extend(["--mount".to_string(), mnt.path().display().to_string()]);
    }
    let d = Daemon::start_with(&args, &[]);
    wait_for(&d, "G4's listing at start", |m| {
        metric(m, "kvtier_blocks", &[("tier", "g4")]) == G4_AT_START as f64
    });

    // Client traffic: offload, lookup, onboard, a miss, a pin.
    let c = kvtier_client::Client::connect(&d.socket).unwrap();
    let h = c.namespace(&ns());
    let blocks: Vec<(BlockKey, Vec<u8>)> = (0..3).map(block).collect();
    let keys: Vec<BlockKey> = blocks.iter().map(|b| b.0).collect();
    let payloads: Vec<Vec<u8>> = blocks
        .iter()
        .map(|(_, f)| kvtier_client::decode_block(f).unwrap().1.to_vec())
        .collect();
    let refs: Vec<&[u8]> = payloads.iter().map(|p| &p[..]).collect();
    let offs: Vec<kvtier_client::OffloadBlock<'_>> = keys
        .iter()
        .zip(&refs)
        .map(|(k, p)| kvtier_client::OffloadBlock {
            key: *k,
            parent: None,
            payload: p,
            hints: Hints::default(),
        })
        .collect();
    let out = h.offload(&offs);
    assert!(
        out.iter()
            .all(|o| *o == kvtier_client::OffloadOutcome::Stored),
        "{out:?}"
    );
    assert_eq!(h.lookup(&keys).prefix_len(), 3);
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0; BLOCK]).collect();
    let mut rb: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    h.onboard_into(&keys, &mut rb);
    assert_eq!(bufs, payloads);
    let _ = h.lookup(&[BlockKey::from_u64(1)]);
    let pins_from_client = 1;
    let pinned = h.pin(&keys[..1], 60_000).unwrap();
    assert_eq!(pinned, vec![kvtier_client::proto::ItemStatus::Ok]);

    // Mount traffic: an import with cp, a read with cat, a pin with setfattr.
    let mut pins_from_mount = 0;
    if with_mount {
        let t = Instant::now();
        while !is_mounted(mnt.path()) {
            assert!(t.elapsed() < Duration::from_secs(20), "mounted");
            std::thread::sleep(Duration::from_millis(20));
        }
        let (k, f) = block(50);
        let src = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(src.path(), &f).unwrap();
        let dst = mnt.path().join(block_path(&ns().id(), &k));
        sh(&format!(
            "mkdir -p {} && cp {} {}",
            dst.parent().unwrap().display(),
            src.path().display(),
            dst.display()
        ));
        let on_mount = mnt.path().join(block_path(&ns().id(), &keys[1]));
        sh(&format!("cat {} > /dev/null", on_mount.display()));
        sh(&format!(
            "setfattr -n user.kvtier.pinned -v 1 {}",
            on_mount.display()
        ));
        pins_from_mount = 1;
    }
    // Uploads are asynchronous: G4 ends with what it had plus ours.
    let ours = 3 + usize::from(with_mount);
    wait_for(&d, "the uploads", |m| {
        metric(m, "kvtier_g4_uploads_total", &[("outcome", "stored")]) >= 3.0
    });

    let (_, text) = d.http_get("/metrics");
    let types = check_conventions(&text);
    let m = support::parse_exposition(&text);

    // Families the issue named, with their types.
    for (name, ty) in [
        ("kvtier_evictions_total", SampleType::Counter),
        ("kvtier_quarantined_total", SampleType::Counter),
        ("kvtier_promotions_total", SampleType::Counter),
        ("kvtier_promote_seconds_total", SampleType::Counter),
        ("kvtier_g4_uploads_total", SampleType::Counter),
        ("kvtier_g4_fetches_total", SampleType::Counter),
        ("kvtier_g4_upload_lag_seconds", SampleType::Gauge),
        ("kvtier_g4_upload_queue_depth", SampleType::Gauge),
        // The six G4 figures the docs named that were not exported.
        ("kvtier_g4_gets_total", SampleType::Counter),
        ("kvtier_g4_exists_checks_total", SampleType::Counter),
        ("kvtier_g4_sweeps_total", SampleType::Counter),
        ("kvtier_g4_swept_bytes_total", SampleType::Counter),
        // Every figure `kvtier stats` shows.
        ("kvtier_blocks", SampleType::Gauge),
        ("kvtier_bytes", SampleType::Gauge),
        ("kvtier_capacity_bytes", SampleType::Gauge),
        ("kvtier_leases_held", SampleType::Gauge),
        ("kvtier_pins_held", SampleType::Gauge),
        ("kvtier_connections", SampleType::Gauge),
        ("kvtier_queue_depth", SampleType::Gauge),
        ("kvtier_events_published_total", SampleType::Counter),
        (
            "kvtier_events_dynamo_skipped_blocks_total",
            SampleType::Counter,
        ),
        ("kvtier_events_dynamo_worker_info", SampleType::Gauge),
        ("kvtier_backend_info", SampleType::Gauge),
    ] {
        assert_eq!(types.get(name), Some(&ty), "{name} in\n{text}");
    }
    let stats = c.stats().unwrap();
    assert_eq!(
        metric(&m, "kvtier_blocks", &[("tier", "g3")]),
        stats["tiers"]["g3"]["blocks"].as_f64().unwrap()
    );
    assert_eq!(
        metric(&m, "kvtier_events_published_total", &[]),
        stats["events_published"].as_f64().unwrap()
    );
    assert!(metric(&m, "kvtier_queue_depth", &[("queue", "in_flight_requests")]) >= 0.0);
    let backend = stats["backend"].as_str().unwrap();
    assert_eq!(
        metric(&m, "kvtier_backend_info", &[("backend", backend)]),
        1.0
    );
    let g4_blocks = metric(&m, "kvtier_blocks", &[("tier", "g4")]);
    assert!(
        g4_blocks >= (G4_AT_START + 3) as f64 && g4_blocks <= (G4_AT_START + ours) as f64,
        "kvtier_blocks{{tier=\"g4\"}} {g4_blocks}"
    );
    assert_eq!(
        metric(&m, "kvtier_pins_held", &[]),
        f64::from(pins_from_client + pins_from_mount),
        "pins, setfattr's included"
    );
    if with_mount {
        for (name, labels) in [
            ("kvtier_mount_imports_total", &[("outcome", "stored")][..]),
            ("kvtier_mount_opens_total", &[][..]),
        ] {
            assert!(metric(&m, name, labels) >= 1.0, "{name} in\n{text}");
        }
        assert_eq!(
            types.get("kvtier_mount_verify_failures_total"),
            Some(&SampleType::Counter)
        );
    }
}

/// Where promtool is: on PATH, or not installed (scripts/setup.sh installs
/// Debian's `prometheus` package for it).
fn promtool() -> Option<std::path::PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("promtool"))
            .find(|p| p.is_file())
    })
}

/// `promtool check metrics` (Prometheus's own linter) and the conventions
/// above on an exposition with every feature on: peers, the ZMQ publisher,
/// tenants, the mount, a file:// G4. Families that only exist with a
/// feature (`kvtier_peer_*`, `kvtier_events_zmq_*`, per-tenant figures) are
/// judged too; the test above runs without them.
#[test]
fn promtool_accepts_the_exposition_with_every_feature_on() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("peer.secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef").unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mnt = tempfile::tempdir().unwrap();
    let with_mount = mount_ok();
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let ns_id = ns().id().to_string();
    let mut toml = format!(
        "[g4]\nurl = \"file://{g4}\"\n\
         [peer]\nenabled = true\nnode_id = \"metrics-node\"\nbind = \"127.0.0.1:{peer_port}\"\n\
         secret_file = \"{secret}\"\ndiscovery = true\n\
         [events.zmq]\nendpoint = \"ipc://{dir}/events.ipc\"\nreplay_endpoint = \"ipc://{dir}/replay.ipc\"\n\
         [[events.zmq.namespaces]]\nid = \"{ns_id}\"\n\
         [[tenants]]\nname = \"metrics\"\nuids = [{uid}]\nnamespaces = [\"{ns_id}\"]\n",
        g4 = dir.path().join("g4").display(),
        peer_port = support::free_port(),
        secret = secret.display(),
        dir = dir.path().display(),
    );
    if with_mount {
        toml.push_str(&format!("[mount]\ndir = \"{}\"\n", mnt.path().display()));
    }
    let cfg = dir.path().join("kvtierd.toml");
    std::fs::write(&cfg, toml).unwrap();
    let d = Daemon::start_with(&["--config".to_string(), cfg.display().to_string()], &[]);

    // Traffic that makes the feature families carry samples.
    let c = kvtier_client::Client::connect(&d.socket).unwrap();
    let h = c.namespace(&ns());
    // The per-namespace kvtier_client_* families, labelled with the
    // engine and model a connector describes (a model with spaces and
    // quotes: escaped in the exposition).
    assert_eq!(
        c.describe(ns().id(), "vllm", "org/m \"7b\" · tp=8")
            .unwrap(),
        kvtier_client::proto::ItemStatus::Ok
    );
    let (k, f) = block(7);
    let payload = kvtier_client::decode_block(&f).unwrap().1.to_vec();
    let out = h.offload(&[kvtier_client::OffloadBlock {
        key: k,
        parent: None,
        payload: &payload,
        hints: Hints::default(),
    }]);
    assert_eq!(out, vec![kvtier_client::OffloadOutcome::Stored]);
    assert_eq!(h.lookup(&[k]).prefix_len(), 1);
    wait_for(&d, "the peer and ZMQ families", |m| {
        m.iter().any(|s| s.name.starts_with("kvtier_peer_"))
            && m.iter().any(|s| s.name.starts_with("kvtier_events_zmq"))
    });
    let (_, text) = d.http_get("/metrics");
    let described = format!(
        "kvtier_client_offload_blocks_total{{engine=\"vllm\",model=\"org/m \\\"7b\\\" · tp=8\",namespace=\"{ns_id}\"}} 1"
    );
    assert!(text.contains(&described), "{described} not in\n{text}");

    let (_, text) = d.http_get("/metrics");
    check_conventions(&text);
    let Some(promtool) = promtool() else {
        panic!("promtool not found: scripts/setup.sh installs it (Debian package prometheus)");
    };
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(
        o.status.success(),
        "promtool check metrics refused the exposition:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}
