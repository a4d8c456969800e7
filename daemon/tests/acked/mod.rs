//! The acknowledgement path under power loss (issue 28; a module of
//! g3_power_loss.rs, sharing its binary). What must survive is what a
//! client was told over the socket: clients offload through the real
//! `kvtier_client` over a real Unix socket to the real `Server` and
//! `Node`, whose G3 is opened over [`PowerLossFs`] (real files, the real
//! io_uring engine; every sync of the store goes through the seam, so a
//! sync mechanism added there is covered as it lands). Power is lost at a
//! seeded filesystem operation (during the offloads, during the server's
//! shutdown, or again during recovery), the server and node are stopped,
//! what was not durable is taken back, and a new node and server are
//! started on the survivor. Checks, through the socket:
//! - every block whose offload was answered `Stored` or `AlreadyPresent`
//!   onboards with exactly its bytes (unless an evict or an eviction
//!   removed it after that offload began);
//! - no phantoms: every block G3 lists was offloaded and onboards
//!   exactly; every onboard before the cut that hit had exactly the bytes;
//! - nothing torn visible (nothing quarantined, `tmp/` empty) and the
//!   index agrees with the files; the same after a clean restart.
//!
//! `acked_offloads_survive_power_loss` runs in `cargo test`
//! (`KVTIER_ACKED_POWER_LOSS_ITERS`, default 12; scripts/fault-suite.sh
//! runs more); replay with `KVTIER_ACKED_POWER_LOSS_SEED`,
//! `KVTIER_ACKED_POWER_LOSS_SCENARIO`, and remove one sync with
//! `KVTIER_ACKED_POWER_LOSS_SKIP=<site>`. `acked_mutation_check` removes
//! each durability call in turn: each load-bearing one must make this
//! harness fail within `KVTIER_ACKED_MUTATION_ITERS` iterations (default
//! 60), each other one must lose nothing in
//! `KVTIER_ACKED_MUTATION_SAFE_ITERS` (default 6).

use super::{
    acked_are_visible, acked_keys, common, engine, listed, Attempt, Iter, Phase, Scenario,
};
use kvtier_client::{
    BlockKey, Client, ClientConfig, Hints, Namespace, OffloadBlock, OffloadOutcome, Onboarded,
};
use kvtier_daemon::base::events::EventBus;
use kvtier_daemon::edges::metrics::Metrics;
use kvtier_daemon::edges::server::{Server, ServerLimits, ShutdownHandle, SocketOptions};
use kvtier_daemon::node::{Node, NodeConfig};
use kvtier_daemon::testkit::conformance::{block, namespace};
use kvtier_daemon::tiers::g3::engine::EngineKind;
use kvtier_daemon::tiers::g3::powerloss::PowerLossFs;
use kvtier_daemon::tiers::g3::seam::SyncSite;
use kvtier_daemon::tiers::g3::{G3Store, SyncMode};
use kvtier_daemon::tiers::policy::Lru;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "socket-slots-small-batch-concurrent-evict",
        payload_bytes: 8192,
        blocks_per_writer: 16,
        batch: 4,
        writers: 3,
        capacity_blocks: 20,
        deletes: true,
        sync: SyncMode::Auto,
        slots: true,
    },
    Scenario {
        name: "socket-small-batch-concurrent-evict",
        payload_bytes: 8192,
        blocks_per_writer: 16,
        batch: 4,
        writers: 3,
        capacity_blocks: 20,
        deletes: true,
        sync: SyncMode::Auto,
        slots: false,
    },
    Scenario {
        name: "socket-large-single-evicts",
        payload_bytes: 3 << 19,
        blocks_per_writer: 3,
        batch: 1,
        writers: 2,
        capacity_blocks: 1000,
        deletes: true,
        sync: SyncMode::Auto,
        slots: false,
    },
    Scenario {
        name: "socket-small-single",
        payload_bytes: 8192,
        blocks_per_writer: 12,
        batch: 1,
        writers: 1,
        capacity_blocks: 1000,
        deletes: false,
        sync: SyncMode::Auto,
        slots: false,
    },
    Scenario {
        name: "socket-large-batch-evict",
        payload_bytes: 3 << 19,
        blocks_per_writer: 4,
        batch: 2,
        writers: 1,
        capacity_blocks: 3,
        deletes: false,
        sync: SyncMode::Auto,
        slots: false,
    },
    // The opt-in group data flush (`g3.data_flush = "group"`): one syncfs
    // per window across the clients' offloads (group.rs `FlushWindow`).
    Scenario {
        name: "socket-group-small-batch-concurrent-evict",
        payload_bytes: 8192,
        blocks_per_writer: 16,
        batch: 4,
        writers: 3,
        capacity_blocks: 20,
        deletes: true,
        sync: SyncMode::Group,
        slots: false,
    },
    Scenario {
        name: "socket-group-large-concurrent-evict",
        payload_bytes: 3 << 19,
        blocks_per_writer: 3,
        batch: 2,
        writers: 2,
        capacity_blocks: 4,
        deletes: true,
        sync: SyncMode::Group,
        slots: false,
    },
];

struct Run {
    dir: tempfile::TempDir,
    fs: Arc<PowerLossFs>,
    ns: Namespace,
    sc: Scenario,
    attempts: Mutex<HashMap<BlockKey, Vec<Attempt>>>,
    /// The first wrong answer a client saw before the cut.
    wrong: Mutex<Option<String>>,
}

/// A node and its server, serving G3 over the simulator.
struct Served {
    node: Arc<Node>,
    stop: ShutdownHandle,
    serving: std::thread::JoinHandle<kvtier_daemon::base::error::Result<()>>,
    g3: Weak<G3Store>,
}

fn env_u64(k: &str) -> Option<u64> {
    std::env::var(k).ok().and_then(|v| v.parse().ok())
}

impl Run {
    fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("kvtierd.sock")
    }

    fn client(&self) -> Client {
        let mut cfg = ClientConfig::new(self.socket());
        // A loaded CI machine: a timeout would only make an offload
        // unacknowledged, but a check's read must not miss for it.
        cfg.timeout_ms = 60_000;
        cfg.region_bytes = 8 << 20;
        Client::with_config(cfg)
    }

    /// Opens G3 over the simulator (recovery included), the node around
    /// it and the server on the socket, as kvtierd does.
    fn start(&self, capacity_blocks: u64) -> Result<Served, String> {
        let mut cfg = common::cfg(&self.root(), EngineKind::Auto);
        let file_len = 4096 + self.sc.payload_bytes.div_ceil(4096) * 4096;
        cfg.capacity_bytes = capacity_blocks * file_len;
        cfg.sync_mode = self.sc.sync;
        if self.sc.slots {
            cfg.slot_file_bytes_max = common::cfg_slots(
                &self.root(),
                kvtier_daemon::tiers::g3::engine::EngineKind::Auto,
            )
            .slot_file_bytes_max;
        }
        let store = G3Store::open_with_fs(
            cfg.clone(),
            Box::new(Lru::new()),
            self.fs.engine(engine()),
            self.fs.clone(),
        )
        .map_err(|e| format!("open g3: {e}"))?;
        // The scenario runs the flush it names (no silent fallback).
        if store.sync_mode() != self.sc.sync {
            return Err(format!(
                "g3 runs {:?}, the scenario names {:?}",
                store.sync_mode(),
                self.sc.sync
            ));
        }
        let g3 = Arc::downgrade(&store);
        let node = Node::open_with_g3(NodeConfig::new(cfg), store)
            .map_err(|e| format!("open node: {e}"))?;
        let server = Server::bind(
            &SocketOptions {
                path: self.socket(),
                mode: 0o600,
                group: None,
            },
            node.clone(),
            Metrics::new().map_err(|e| format!("metrics: {e}"))?,
            EventBus::new(),
            ServerLimits::default(),
        )
        .map_err(|e| format!("bind: {e}"))?;
        let stop = server.shutdown_handle();
        let serving = std::thread::spawn(move || server.run());
        Ok(Served {
            node,
            stop,
            serving,
            g3,
        })
    }

    /// Offloads, onboards and evicts from `writers` clients at once.
    fn workload(&self, epoch: u64, seed: u64) {
        std::thread::scope(|sc| {
            for w in 0..self.sc.writers {
                sc.spawn(move || self.writer(epoch, w, seed));
            }
        });
    }

    fn writer(&self, epoch: u64, w: u64, seed: u64) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (w << 32) ^ epoch);
        let client = self.client();
        let h = client.namespace(&self.ns);
        let mut i = 0;
        while i < self.sc.blocks_per_writer {
            if self.fs.crashed() {
                return;
            }
            let seeds = self.sc.next_seeds(&mut rng, epoch, w, i);
            let n = seeds.len() as u64;
            let blocks: Vec<_> = seeds.iter().map(|s| block(&self.ns, *s)).collect();
            let offloads: Vec<OffloadBlock<'_>> = blocks
                .iter()
                .map(|(key, _, p)| OffloadBlock {
                    key: *key,
                    parent: None,
                    payload: p,
                    hints: Hints {
                        priority: rng.random_range(0..3),
                        ..Hints::default()
                    },
                })
                .collect();
            let begun_op = self.fs.ops();
            let out = h.offload(&offloads);
            {
                let mut a = self.attempts.lock().unwrap();
                for ((key, _, _), (s, o)) in blocks.iter().zip(seeds.iter().zip(out)) {
                    a.entry(*key).or_default().push(Attempt {
                        seed: *s,
                        begun_op,
                        acked: matches!(o, OffloadOutcome::Stored | OffloadOutcome::AlreadyPresent),
                    });
                }
            }
            i += n;
            let (key, _, p) = &blocks[0];
            match rng.random_range(0..5) {
                0 if self.sc.deletes => {
                    let _ = h.evict(&[*key]);
                }
                1 => {
                    let mut buf = vec![0u8; p.len()];
                    let got = h.onboard_into(&[*key], &mut [&mut buf[..]]);
                    if let Some(Onboarded::Hit { payload_len, .. }) = got.first() {
                        if buf[..*payload_len as usize] != p[..] {
                            self.wrong
                                .lock()
                                .unwrap()
                                .get_or_insert(format!("an onboard of {key} hit with wrong bytes"));
                        }
                    }
                }
                _ => {}
            }
        }
    }

    /// The checks after recovery (see the module doc), through the socket.
    fn check(&self, served: &Served) -> Result<(), String> {
        if let Some(w) = self.wrong.lock().unwrap().clone() {
            return Err(w);
        }
        let g3 = served.node.g3();
        let ns_id = self.ns.id();
        let attempts = self.attempts.lock().unwrap();
        let visible = listed(g3, &ns_id);
        let client = self.client();
        let h = client.namespace(&self.ns);
        for key in &visible {
            let Some(tries) = attempts.get(key) else {
                return Err(format!("phantom block {key}: never offloaded"));
            };
            let (_, _, p) = block(&self.ns, tries[0].seed);
            let mut buf = vec![0u8; p.len()];
            match h.onboard_into(&[*key], &mut [&mut buf[..]]).pop() {
                Some(Onboarded::Hit { payload_len, .. }) if payload_len as usize == p.len() => {}
                other => return Err(format!("listed block {key} does not onboard: {other:?}")),
            }
            if buf != p {
                return Err(format!("listed block {key} onboards with wrong bytes"));
            }
        }
        acked_are_visible(g3, &ns_id, &attempts, &visible, &self.fs.removed_blocks())?;
        drop(client);
        common::tree_matches_index(g3, &self.root(), &visible)
    }
}

/// Stops the server (its shutdown flushes the node, which closes G3) and
/// waits until nothing holds the store any more: a store that outlived its
/// node could write into the survivor after the power cycle. `Ok(false)`
/// when the close failed (power was lost).
fn stop(served: Served) -> Result<bool, String> {
    served.stop.trigger();
    let closed = served
        .serving
        .join()
        .map_err(|_| "the server thread panicked".to_string())?
        .is_ok();
    drop(served.node);
    let deadline = Instant::now() + Duration::from_secs(60);
    while served.g3.upgrade().is_some() {
        if Instant::now() > deadline {
            return Err("the G3 store outlived its node and server by 60 s".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(closed)
}

impl Iter {
    /// Counts what a session did to G3 (evictions, recycled writes).
    fn ran(&mut self, s: &Served) {
        self.evictions += s.node.g3().stats().evictions;
        self.recycled_writes += s.node.g3().recycle_counts().recycled_writes;
    }
}

/// One iteration: `seed` picks the crash point and phase.
fn iteration(sc: Scenario, seed: u64, skip: Option<SyncSite>) -> Result<Iter, String> {
    let dir = tempfile::tempdir().unwrap();
    let fs = PowerLossFs::new(dir.path().join("grave"), seed).unwrap();
    fs.set_skip(skip);
    let run = Run {
        dir,
        fs,
        ns: namespace(sc.payload_bytes, "acked-power-loss").unwrap(),
        sc,
        attempts: Mutex::new(HashMap::new()),
        wrong: Mutex::new(None),
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let phase = Phase::draw(&mut rng);
    let mut it = Iter::default();
    let err = |what: &str, e: String| format!("{} seed {seed}: {what}: {e}", sc.name);
    let mut epoch = 0;
    // Half the iterations start with a session that stops cleanly, so
    // that the cut lands in one that began from the clean marker.
    if rng.random_bool(0.5) {
        let s = run.start(sc.capacity_blocks).map_err(|e| err("start", e))?;
        run.workload(epoch, seed);
        it.ran(&s);
        if !stop(s).map_err(|e| err("clean stop", e))? {
            return Err(err("clean stop", "closing G3 failed".into()));
        }
        epoch += 1;
    }
    let s = run.start(sc.capacity_blocks).map_err(|e| err("start", e))?;
    let blocks = sc.writers * sc.blocks_per_writer;
    let ops_per_block = 12;
    let start = run.fs.ops();
    let s = match phase {
        Phase::Workload | Phase::Recovery => {
            run.fs
                .set_crash_at(Some(start + rng.random_range(0..blocks * ops_per_block)));
            run.workload(epoch, seed);
            it.ran(&s);
            run.fs.crash_now();
            s
        }
        Phase::Close => {
            run.workload(epoch, seed);
            it.ran(&s);
            let now = run.fs.ops();
            run.fs
                .set_crash_at(Some(now + rng.random_range(0..20 + blocks)));
            s
        }
    };
    if !stop(s).map_err(|e| err("stop", e))? {
        it.crashed_in_close += u64::from(phase == Phase::Close);
    }
    run.fs.crash_now();
    let cycle = |it: &mut Iter| -> Result<(), String> {
        let c = run
            .fs
            .power_cycle()
            .map_err(|e| err("power cycle", e.to_string()))?;
        it.entries_undone += c.entries_undone;
        it.files_dropped += c.files_dropped;
        it.files_torn += c.files_torn;
        Ok(())
    };
    cycle(&mut it)?;
    if phase == Phase::Recovery {
        // Power lost again while recovering.
        let now = run.fs.ops();
        run.fs.set_crash_at(Some(now + rng.random_range(0..40)));
        match run.start(sc.capacity_blocks) {
            Ok(s) => {
                run.fs.crash_now();
                stop(s).map_err(|e| err("stop in recovery", e))?;
            }
            Err(_) => it.crashed_in_recovery += 1,
        }
        cycle(&mut it)?;
    }
    // The checks, with room for everything (no eviction races them).
    let s = run
        .start(10_000)
        .map_err(|e| err("restart after power loss", e))?;
    let checked = run.check(&s);
    let stopped = stop(s).map_err(|e| err("stop after the checks", e))?;
    checked.map_err(|e| format!("{} seed {seed} {phase:?}: {e}", sc.name))?;
    if !stopped {
        return Err(err("stop after the checks", "closing G3 failed".into()));
    }
    // The clean path: restart from the marker, same answers.
    let s = run.start(10_000).map_err(|e| err("clean restart", e))?;
    let checked = run.check(&s);
    stop(s).map_err(|e| err("stop after the clean restart", e))?;
    checked.map_err(|e| format!("{} seed {seed} {phase:?} (clean restart): {e}", sc.name))?;
    it.acked = acked_keys(&run.attempts);
    Ok(it)
}

fn scenario_for(i: u64) -> Scenario {
    match std::env::var("KVTIER_ACKED_POWER_LOSS_SCENARIO") {
        Ok(name) => *SCENARIOS
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("KVTIER_ACKED_POWER_LOSS_SCENARIO={name}: no such scenario")),
        Err(_) => SCENARIOS[(i as usize) % SCENARIOS.len()],
    }
}

#[test]
fn acked_offloads_survive_power_loss() {
    let n = env_u64("KVTIER_ACKED_POWER_LOSS_ITERS").unwrap_or(12);
    let seed0 = env_u64("KVTIER_ACKED_POWER_LOSS_SEED").unwrap_or(0xac0);
    let skip = std::env::var("KVTIER_ACKED_POWER_LOSS_SKIP")
        .ok()
        .map(|name| {
            SyncSite::ALL
                .iter()
                .copied()
                .find(|s| s.name() == name)
                .unwrap_or_else(|| panic!("KVTIER_ACKED_POWER_LOSS_SKIP={name}: no such sync site"))
        });
    let t = Instant::now();
    let mut total = Iter::default();
    for i in 0..n {
        let seed = seed0 + i;
        let sc = scenario_for(i);
        match iteration(sc, seed, skip) {
            Ok(it) => total.add(&it),
            Err(e) => panic!(
                "iteration {i} (replay: KVTIER_ACKED_POWER_LOSS_SEED={seed} \
                 KVTIER_ACKED_POWER_LOSS_ITERS=1 KVTIER_ACKED_POWER_LOSS_SCENARIO={}): {e}",
                sc.name
            ),
        }
    }
    println!(
        "acked power loss: {n} iterations (seeds {seed0}..{}) in {:?}, acked blocks checked {}, \
         entries undone {}, files dropped {}, torn {}, evictions {}, recycled writes {}, crashes \
         inside close {}, inside recovery {}, blocks lost 0",
        seed0 + n,
        t.elapsed(),
        total.acked,
        total.entries_undone,
        total.files_dropped,
        total.files_torn,
        total.evictions,
        total.recycled_writes,
        total.crashed_in_close,
        total.crashed_in_recovery
    );
    // The run exercised what it claims (a one-seed replay proves less).
    if n >= 12 {
        assert!(total.acked > 0 && total.evictions > 0, "{total:?}");
        assert!(
            total.files_dropped + total.entries_undone > 0,
            "no cut took anything back: {total:?}"
        );
    }
    if n >= 40 {
        assert!(
            total.crashed_in_close > 0
                && total.crashed_in_recovery > 0
                && total.recycled_writes > 0,
            "{total:?}"
        );
    }
}

/// Each load-bearing durability call removed makes this harness fail;
/// each other one removed loses no acknowledged block.
#[test]
fn acked_mutation_check() {
    let budget = env_u64("KVTIER_ACKED_MUTATION_ITERS").unwrap_or(60);
    let safe = env_u64("KVTIER_ACKED_MUTATION_SAFE_ITERS").unwrap_or(6);
    let mut report = Vec::new();
    for &site in SyncSite::ALL {
        let tries = if site.load_bearing() { budget } else { safe };
        let caught = (0..tries).find_map(|i| {
            iteration(
                SCENARIOS[(i as usize) % SCENARIOS.len()],
                0xacb0 + i,
                Some(site),
            )
            .err()
            .map(|e| (i, e))
        });
        match (site.load_bearing(), caught) {
            (true, Some((i, e))) => report.push(format!(
                "acked {}: caught at iteration {i}: {e}",
                site.name()
            )),
            (true, None) => panic!(
                "acked: removing {} was not noticed in {tries} iterations",
                site.name()
            ),
            (false, None) => report.push(format!(
                "acked {}: not load-bearing, {tries} iterations, nothing lost",
                site.name()
            )),
            (false, Some((i, e))) => panic!(
                "acked: removing {} (documented as not needed for acked blocks) lost data at \
                 iteration {i}: {e}",
                site.name()
            ),
        }
    }
    for r in report {
        println!("{r}");
    }
}
