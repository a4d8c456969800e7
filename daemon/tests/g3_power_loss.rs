#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Power-loss crash harness: G3 over [`PowerLossFs`] (real files, the real
//! io_uring engine), power lost at a seeded operation, everything not made
//! durable taken back, then recovery and the checks:
//! - every acknowledged block reads back with exactly its bytes (unless a
//!   delete or eviction unlinked it after its put began);
//! - no phantoms: every visible block was put, and reads back exactly;
//! - nothing torn visible: nothing is quarantined, `tmp/` is empty;
//! - the index agrees with the files: every file under `blocks/` is
//!   visible, every visible block has its file, also after a clean
//!   close and reopen (the marker and snapshot path).
//!
//! Scenarios: small blocks (O_DSYNC path) and 1.5 MiB blocks (fdatasync
//! path), both sizes again with the shared syncfs window (sync mode
//! `Group`, opt-in), single and batched puts, concurrent writers with shared keys,
//! eviction (a small capacity), deletes, reads and metadata updates
//! (priority, in-G4 flag; promotions from G4 or peers are puts through the
//! same path), and power lost during the workload, during close and
//! during recovery, some after an earlier clean close.
//!
//! `power_loss_short` runs in `cargo test`; `KVTIER_POWER_LOSS_ITERS=N`
//! sets its iterations (scripts/fault-suite.sh runs 1000+).
//! `mutation_check` removes each durability call in turn
//! ([`SyncSite`]): the load-bearing ones must make the harness fail
//! within `KVTIER_MUTATION_ITERS` iterations, the others must not lose a
//! block in `KVTIER_MUTATION_SAFE_ITERS`.
//!
//! The module `acked` (acked/mod.rs) runs the same crash model under the
//! real client, socket, server and node: what a client was acknowledged
//! must survive.

#[path = "g3_support/mod.rs"]
mod common;
// The deterministic simulation shares this binary (one link less in CI).
#[path = "sim/mod.rs"]
mod sim;
// The same crash model under the real server and node: what a client was
// acknowledged over the socket must survive (acked/mod.rs).
#[path = "acked/mod.rs"]
mod acked;

use kvtier_client::{BlockHeader, BlockKey, Namespace, NamespaceId};
use kvtier_daemon::base::tier::Lookup;
use kvtier_daemon::testkit::conformance::{block, namespace};
use kvtier_daemon::tiers::g3::engine::{IoEngine, PreadEngine, UringEngine};
use kvtier_daemon::tiers::g3::powerloss::PowerLossFs;
use kvtier_daemon::tiers::g3::seam::SyncSite;
use kvtier_daemon::tiers::g3::{G3Store, PutItem, PutMeta, SyncMode};
use kvtier_daemon::tiers::policy::Lru;
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Where power is lost (shared with acked/mod.rs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Workload,
    Close,
    Recovery,
}

impl Phase {
    /// During the workload 1/2, during close 1/4, during the workload and
    /// again during recovery 1/4.
    fn draw(rng: &mut impl Rng) -> Phase {
        match rng.random_range(0..4) {
            0 | 1 => Phase::Workload,
            2 => Phase::Close,
            _ => Phase::Recovery,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Scenario {
    name: &'static str,
    payload_bytes: u64,
    blocks_per_writer: u64,
    batch: usize,
    /// Concurrent writers (through the socket: clients, each on its own
    /// connection).
    writers: u64,
    /// Capacity in blocks (eviction when small).
    capacity_blocks: u64,
    /// Writers also remove blocks on request (a delete; through the
    /// socket an evict).
    deletes: bool,
    /// `Auto`: each block's data flushed alone (O_DSYNC for small files,
    /// fdatasync for large); `Group`: the shared syncfs window.
    sync: SyncMode,
    /// Blocks in slab slots (g3/slots.rs: one shared flush per slab, no
    /// file per block); `false`: a file per block.
    slots: bool,
}

impl Scenario {
    /// The block seeds of writer `w`'s next batch, its `i`-th block on:
    /// one key in five is shared by all writers (the same key from two
    /// writers at once).
    fn next_seeds(&self, rng: &mut impl Rng, epoch: u64, w: u64, i: u64) -> Vec<u64> {
        let base = |writer: u64| epoch * 1_000_000 + writer * 10_000;
        let n = (self.batch as u64).min(self.blocks_per_writer - i);
        (0..n)
            .map(|j| {
                if rng.random_range(0..5) == 0 {
                    base(99) + rng.random_range(0..4)
                } else {
                    base(w) + i + j
                }
            })
            .collect()
    }
}

/// Keys with an acknowledged attempt.
fn acked_keys(attempts: &Mutex<HashMap<BlockKey, Vec<Attempt>>>) -> u64 {
    attempts
        .lock()
        .unwrap()
        .values()
        .filter(|t| t.iter().any(|a| a.acked))
        .count() as u64
}

const SCENARIOS: &[Scenario] = &[
    // Slab slots (g3/slots.rs): concurrent writers share each slab's
    // flush; evictions keep slots for reuse, deletes punch them.
    Scenario {
        name: "slots-small-batch-concurrent-evict",
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
        name: "slots-large-batch-evict",
        payload_bytes: 3 << 19,
        blocks_per_writer: 4,
        batch: 2,
        writers: 2,
        capacity_blocks: 3,
        deletes: true,
        sync: SyncMode::Auto,
        slots: true,
    },
    Scenario {
        name: "small-single",
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
        name: "small-batch-concurrent-evict",
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
        name: "large-single-deletes",
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
        name: "large-batch-evict",
        payload_bytes: 3 << 19,
        blocks_per_writer: 4,
        batch: 2,
        writers: 1,
        capacity_blocks: 3,
        deletes: false,
        sync: SyncMode::Auto,
        slots: false,
    },
    // The opt-in group data flush: one syncfs per window across writers.
    Scenario {
        name: "group-small-batch-concurrent-evict",
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
        name: "group-large-concurrent-evict",
        payload_bytes: 3 << 19,
        blocks_per_writer: 3,
        batch: 2,
        writers: 2,
        capacity_blocks: 4,
        deletes: false,
        sync: SyncMode::Group,
        slots: false,
    },
];

/// One put attempted by the workload (through the socket: one offload).
#[derive(Debug, Clone)]
struct Attempt {
    seed: u64,
    /// Simulator operation count when the put began.
    begun_op: u64,
    /// Acknowledged (through the socket: `Stored` or `AlreadyPresent`).
    acked: bool,
}

struct Run {
    dir: tempfile::TempDir,
    fs: Arc<PowerLossFs>,
    ns: Namespace,
    sc: Scenario,
    attempts: Mutex<HashMap<BlockKey, Vec<Attempt>>>,
}

fn engine() -> Arc<dyn IoEngine> {
    match UringEngine::new(4) {
        Ok(u) => Arc::new(u),
        Err(_) => Arc::new(PreadEngine),
    }
}

impl Run {
    fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    fn open(&self) -> kvtier_daemon::base::error::Result<Arc<G3Store>> {
        self.open_with(self.sc.capacity_blocks)
    }

    /// Opens for the checks: capacity for everything, so that no eviction
    /// races the checks.
    fn open_roomy(&self) -> kvtier_daemon::base::error::Result<Arc<G3Store>> {
        self.open_with(10_000)
    }

    fn open_with(&self, capacity_blocks: u64) -> kvtier_daemon::base::error::Result<Arc<G3Store>> {
        let s = self.open_inner(capacity_blocks)?;
        let rep = s.recovery.lock().unwrap().clone();
        let mut keys: Vec<String> = listed(&s, &self.ns.id())
            .iter()
            .map(|k| k.to_string()[..8].to_string())
            .collect();
        keys.sort();
        self.fs
            .note(&format!("opened: {rep:?}; listed {}", keys.join(" ")));
        Ok(s)
    }

    fn open_inner(&self, capacity_blocks: u64) -> kvtier_daemon::base::error::Result<Arc<G3Store>> {
        let mut cfg = common::cfg(
            &self.root(),
            kvtier_daemon::tiers::g3::engine::EngineKind::Auto,
        );
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
            cfg,
            Box::new(Lru::new()),
            self.fs.engine(engine()),
            self.fs.clone(),
        )?;
        // The scenario runs the flush it names (no silent fallback).
        assert_eq!(store.sync_mode(), self.sc.sync, "{}", self.sc.name);
        Ok(store)
    }

    /// Puts, reads, deletes and hint updates from `writers` threads.
    fn workload(&self, store: &Arc<G3Store>, epoch: u64, seed: u64) {
        std::thread::scope(|sc| {
            for w in 0..self.sc.writers {
                let store = Arc::clone(store);
                sc.spawn(move || self.writer(&store, epoch, w, seed));
            }
        });
    }

    fn writer(&self, store: &G3Store, epoch: u64, w: u64, seed: u64) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (w << 32) ^ epoch);
        let ns_id = self.ns.id();
        let mut i = 0;
        while i < self.sc.blocks_per_writer {
            if self.fs.crashed() {
                return;
            }
            let seeds = self.sc.next_seeds(&mut rng, epoch, w, i);
            let n = seeds.len() as u64;
            let blocks: Vec<(BlockKey, BlockHeader, Vec<u8>)> =
                seeds.iter().map(|s| block(&self.ns, *s)).collect();
            let begun_op = self.fs.ops();
            let items: Vec<PutItem<'_>> = blocks
                .iter()
                .map(|(_, h, p)| PutItem {
                    header: h,
                    payload: p,
                    meta: PutMeta::default(),
                })
                .collect();
            let out = store.put_blocks(&ns_id, &items);
            {
                let mut a = self.attempts.lock().unwrap();
                for ((key, _, _), (s, r)) in blocks.iter().zip(seeds.iter().zip(out)) {
                    self.fs.note(&format!(
                        "put {} {key} (begun at {begun_op}): {:?} at {:?}",
                        self.store_path(store, key).display(),
                        r,
                        store.block_location(&ns_id, key).map(|(_, at)| at)
                    ));
                    a.entry(*key).or_default().push(Attempt {
                        seed: *s,
                        begun_op,
                        acked: r.is_ok(),
                    });
                }
            }
            i += n;
            let (key, _, p) = &blocks[0];
            match rng.random_range(0..6) {
                0 if self.sc.deletes => {
                    let r = store.delete_block(&ns_id, key);
                    self.fs.note(&format!("delete {key}: {r:?}"));
                }
                1 => {
                    let mut buf = vec![0u8; p.len() + 8192];
                    if let Ok(Lookup::Hit(_)) = store.read_into(&ns_id, key, &mut buf) {
                        assert_eq!(
                            &buf[4096..4096 + p.len()],
                            &p[..],
                            "a read returned wrong bytes"
                        );
                    }
                }
                2 => {
                    self.fs.note(&format!("hints {key} begin"));
                    store.set_priority(&ns_id, key, rng.random_range(0..4));
                    store.mark_in_g4(&ns_id, key);
                    self.fs.note(&format!("hints {key} end"));
                }
                _ => {}
            }
        }
    }

    fn store_path(&self, store: &G3Store, key: &BlockKey) -> PathBuf {
        store.block_file_path(&self.ns.id(), key)
    }

    /// The checks after recovery (see the file doc).
    fn check(&self, store: &G3Store) -> Result<(), String> {
        let ns_id = self.ns.id();
        let attempts = self.attempts.lock().unwrap();
        let visible = listed(store, &ns_id);
        for key in &visible {
            let Some(tries) = attempts.get(key) else {
                return Err(format!("phantom block {key}: never put"));
            };
            let (_, _, p) = block(&self.ns, tries[0].seed);
            let mut buf = vec![0u8; p.len() + 8192];
            match store.read_into(&ns_id, key, &mut buf) {
                Ok(Lookup::Hit(_)) => {}
                other => return Err(format!("visible block {key} does not read: {other:?}")),
            }
            if buf[4096..4096 + p.len()] != p[..] {
                return Err(format!("visible block {key} has wrong bytes"));
            }
        }
        acked_are_visible(
            store,
            &ns_id,
            &attempts,
            &visible,
            &self.fs.removed_blocks(),
        )?;
        common::tree_matches_index(store, &self.root(), &visible)
    }
}

impl Run {
    /// A failed check's message, with the simulator's operation log
    /// written beside the test's target directory.
    fn report(&self, msg: String) -> String {
        let path =
            std::env::temp_dir().join(format!("kvtier-power-loss-{}.log", std::process::id()));
        let _ = std::fs::write(&path, self.fs.log().join("\n"));
        format!("{msg} (operation log: {})", path.display())
    }
}

/// Every key `store` lists in `ns`.
fn listed(store: &G3Store, ns: &NamespaceId) -> HashSet<BlockKey> {
    let mut visible = HashSet::new();
    let mut after = None;
    loop {
        let page = store.list(ns, after.as_ref(), 1000);
        if page.is_empty() {
            return visible;
        }
        after = page.last().copied();
        visible.extend(page);
    }
}

/// Every key with an acknowledged attempt is `visible`, unless its file
/// was removed on purpose (a delete, an eviction: `removed` holds the
/// simulator's operation number and the path) after that attempt began.
fn acked_are_visible(
    store: &G3Store,
    ns: &NamespaceId,
    attempts: &HashMap<BlockKey, Vec<Attempt>>,
    visible: &HashSet<BlockKey>,
    removed: &[(u64, PathBuf)],
) -> Result<(), String> {
    for (key, tries) in attempts {
        let Some(first_ack) = tries.iter().filter(|t| t.acked).map(|t| t.begun_op).min() else {
            continue;
        };
        if visible.contains(key) {
            continue;
        }
        let path = store.block_file_path(ns, key);
        if !removed.iter().any(|(op, p)| *p == path && *op > first_ack) {
            return Err(format!(
                "acknowledged block {key} lost (its put began at op {first_ack})"
            ));
        }
    }
    Ok(())
}

/// Stops a store after power was lost: close (joins the reclaimer; fails
/// on the dead disk) and drop.
fn stop(store: Arc<G3Store>) {
    let _ = store.close();
    drop(store);
}

/// What one iteration did.
#[derive(Debug, Default, Clone, Copy)]
struct Iter {
    acked: u64,
    entries_undone: u64,
    files_dropped: u64,
    files_torn: u64,
    /// Blocks evicted by the sessions that lost power or closed cleanly
    /// before it (proves the eviction path runs under the crash).
    evictions: u64,
    /// Puts that overwrote a recycled file (g3/recycle.rs: evictions
    /// keep files for reuse, so the pool runs under the crash too).
    recycled_writes: u64,
    /// Iterations whose close failed because power was lost inside it.
    crashed_in_close: u64,
    /// Iterations whose recovery (reopen) failed because power was lost
    /// inside it.
    crashed_in_recovery: u64,
}

impl Iter {
    fn add(&mut self, o: &Iter) {
        self.acked += o.acked;
        self.entries_undone += o.entries_undone;
        self.files_dropped += o.files_dropped;
        self.files_torn += o.files_torn;
        self.evictions += o.evictions;
        self.recycled_writes += o.recycled_writes;
        self.crashed_in_close += o.crashed_in_close;
        self.crashed_in_recovery += o.crashed_in_recovery;
    }
}

/// One iteration: `seed` picks the scenario's crash point and phase.
fn iteration(sc: Scenario, seed: u64, skip: Option<SyncSite>) -> Result<Iter, String> {
    let dir = tempfile::tempdir().unwrap();
    let fs = PowerLossFs::new(dir.path().join("grave"), seed).unwrap();
    fs.set_skip(skip);
    let ns = namespace(sc.payload_bytes, "power-loss").unwrap();
    let run = Run {
        dir,
        fs,
        ns,
        sc,
        attempts: Mutex::new(HashMap::new()),
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let phase = Phase::draw(&mut rng);
    let mut it = Iter::default();
    let err = |what: &str, e: &dyn std::fmt::Display| format!("{}: {what}: {e}", sc.name);
    // Half the iterations start with a cleanly closed session, so that the
    // crash lands in a session that began from the clean marker.
    let mut epoch = 0;
    if rng.random_bool(0.5) {
        let s = run.open().map_err(|e| err("open", &e))?;
        run.workload(&s, epoch, seed);
        it.evictions += s.stats().evictions;
        it.recycled_writes += s.recycle_counts().recycled_writes;
        s.close().map_err(|e| err("clean close", &e))?;
        drop(s);
        epoch += 1;
    }
    let s = run.open().map_err(|e| err("open", &e))?;
    let blocks = sc.writers * sc.blocks_per_writer;
    let ops_per_block = 12;
    let start = run.fs.ops();
    match phase {
        Phase::Workload | Phase::Recovery => {
            run.fs
                .set_crash_at(Some(start + rng.random_range(0..blocks * ops_per_block)));
            run.workload(&s, epoch, seed);
        }
        Phase::Close => {
            run.workload(&s, epoch, seed);
            let now = run.fs.ops();
            run.fs
                .set_crash_at(Some(now + rng.random_range(0..20 + blocks)));
            if s.close().is_err() {
                it.crashed_in_close += 1;
            }
        }
    }
    it.evictions += s.stats().evictions;
    it.recycled_writes += s.recycle_counts().recycled_writes;
    run.fs.crash_now();
    stop(s);
    let cycle = |it: &mut Iter| -> Result<(), String> {
        let c = run.fs.power_cycle().map_err(|e| err("power cycle", &e))?;
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
        match run.open() {
            Ok(s) => {
                run.fs.crash_now();
                stop(s);
            }
            Err(_) => it.crashed_in_recovery += 1,
        }
        cycle(&mut it)?;
    }
    let s = run
        .open_roomy()
        .map_err(|e| err("reopen after power loss", &e))?;
    run.check(&s)
        .map_err(|e| run.report(format!("{} seed {seed} {phase:?}: {e}", sc.name)))?;
    // The clean path: close, reopen from the marker, same answers.
    s.close().map_err(|e| err("close after recovery", &e))?;
    drop(s);
    let s = run.open_roomy().map_err(|e| err("clean reopen", &e))?;
    run.check(&s).map_err(|e| {
        run.report(format!(
            "{} seed {seed} {phase:?} (clean reopen): {e}",
            sc.name
        ))
    })?;
    it.acked = acked_keys(&run.attempts);
    Ok(it)
}

fn iterations_from_env(default: u64) -> u64 {
    std::env::var("KVTIER_POWER_LOSS_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn power_loss_short() {
    let n = iterations_from_env(40);
    let seed0: u64 = std::env::var("KVTIER_POWER_LOSS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed);
    let mut total = Iter::default();
    for i in 0..n {
        let seed = seed0 + i;
        let sc = match std::env::var("KVTIER_POWER_LOSS_SCENARIO") {
            Ok(name) => *SCENARIOS
                .iter()
                .find(|s| s.name == name)
                .expect("scenario name"),
            Err(_) => SCENARIOS[(i as usize) % SCENARIOS.len()],
        };
        let skip = std::env::var("KVTIER_POWER_LOSS_SKIP")
            .ok()
            .and_then(|n| SyncSite::ALL.iter().copied().find(|s| s.name() == n));
        match iteration(sc, seed, skip) {
            Ok(it) => total.add(&it),
            Err(e) => panic!("iteration {i} (replay: KVTIER_POWER_LOSS_SEED={seed} KVTIER_POWER_LOSS_ITERS=1 KVTIER_POWER_LOSS_SCENARIO={}): {e}", sc.name),
        }
    }
    println!(
        "power loss: {n} iterations (seeds {seed0}..{}), acked blocks checked {}, entries undone {}, files dropped {}, torn {}, evictions {}, recycled writes {}, crashes inside close {}, inside recovery {}, blocks lost 0",
        seed0 + n,
        total.acked,
        total.entries_undone,
        total.files_dropped,
        total.files_torn,
        total.evictions,
        total.recycled_writes,
        total.crashed_in_close,
        total.crashed_in_recovery
    );
    // The harness really exercises what it claims (issue #15 item 1):
    // eviction under the crash, power lost inside close and inside
    // recovery. A replay of one seed proves less, so only full runs check.
    if n >= 40 {
        assert!(total.evictions > 0, "no eviction ran: {total:?}");
        assert!(
            total.recycled_writes > 0,
            "no put overwrote a recycled file: {total:?}"
        );
        assert!(
            total.crashed_in_close > 0,
            "no crash landed inside close: {total:?}"
        );
        assert!(
            total.crashed_in_recovery > 0,
            "no crash landed inside recovery: {total:?}"
        );
    }
}

/// Each load-bearing durability call removed makes the harness fail
/// (within a bounded number of seeds); each other one removed loses
/// nothing.
#[test]
fn mutation_check() {
    let budget: u64 = std::env::var("KVTIER_MUTATION_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        // A load-bearing site is usually caught within 20 iterations; the
        // search stops there, so a generous cap costs time only in the
        // rare run whose interleavings hide it longer (once 120 were not
        // enough on a machine at load 7).
        .unwrap_or(480);
    // The others run every iteration (nothing may be caught), so their
    // budget is what proves them safe to lose: its own knob (it was
    // budget / 60, 8 in CI, 20 in the fault suite).
    let safe: u64 = std::env::var("KVTIER_MUTATION_SAFE_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    // Where the seeds start (another base explores other crash points).
    let seed0: u64 = std::env::var("KVTIER_MUTATION_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0xbad0);
    let mut report = Vec::new();
    for &site in SyncSite::ALL {
        let mut caught = None;
        let tries = if site.load_bearing() { budget } else { safe };
        for i in 0..tries {
            let sc = SCENARIOS[(i as usize) % SCENARIOS.len()];
            if let Err(e) = iteration(sc, seed0 + i, Some(site)) {
                caught = Some((i, e));
                break;
            }
        }
        match (site.load_bearing(), caught) {
            (true, Some((i, e))) => report.push(format!("{}: caught at iteration {i}: {e}", site.name())),
            (true, None) => panic!("removing {} was not noticed in {tries} iterations", site.name()),
            (false, None) => report.push(format!("{}: not load-bearing, {tries} iterations, nothing lost", site.name())),
            (false, Some((i, e))) => panic!("removing {} (documented as not needed for acked blocks) lost data at iteration {i}: {e}", site.name()),
        }
    }
    for r in report {
        println!("{r}");
    }
}

/// Holds the first group commit's directory fsync until the test says so
/// (or 2 s pass): a deterministic window between a put's rename and its
/// commit.
#[derive(Debug)]
struct GateFs {
    first: std::sync::atomic::AtomicBool,
    open: Arc<(Mutex<bool>, std::sync::Condvar)>,
}

impl kvtier_daemon::tiers::g3::seam::G3Fs for GateFs {
    fn create_new(&self, p: &Path, flags: i32) -> std::io::Result<std::fs::File> {
        kvtier_daemon::tiers::g3::seam::RealFs.create_new(p, flags)
    }
    fn write_synced(&self, p: &Path, b: &[u8], s: SyncSite) -> std::io::Result<()> {
        kvtier_daemon::tiers::g3::seam::RealFs.write_synced(p, b, s)
    }
    fn sync_dir(&self, d: &Path, s: SyncSite) -> std::io::Result<()> {
        if s == SyncSite::CommitDirFsync
            && self.first.swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            let (m, cv) = &*self.open;
            let g = m.lock().unwrap();
            let _ = cv
                .wait_timeout_while(g, std::time::Duration::from_secs(2), |open| !*open)
                .unwrap();
        }
        kvtier_daemon::tiers::g3::seam::RealFs.sync_dir(d, s)
    }
    fn rename(&self, a: &Path, b: &Path) -> std::io::Result<()> {
        kvtier_daemon::tiers::g3::seam::RealFs.rename(a, b)
    }
    fn rename_noreplace(&self, a: &Path, b: &Path) -> std::io::Result<()> {
        kvtier_daemon::tiers::g3::seam::RealFs.rename_noreplace(a, b)
    }
    fn remove_file(
        &self,
        p: &Path,
        w: kvtier_daemon::tiers::g3::seam::Unlink,
    ) -> std::io::Result<()> {
        kvtier_daemon::tiers::g3::seam::RealFs.remove_file(p, w)
    }
    fn create_dir(&self, p: &Path) -> std::io::Result<()> {
        kvtier_daemon::tiers::g3::seam::RealFs.create_dir(p)
    }
    fn create_dir_all(&self, p: &Path) -> std::io::Result<()> {
        kvtier_daemon::tiers::g3::seam::RealFs.create_dir_all(p)
    }
    fn remove_dir_all(&self, p: &Path) -> std::io::Result<()> {
        kvtier_daemon::tiers::g3::seam::RealFs.remove_dir_all(p)
    }
    fn index_backend(
        &self,
        p: &Path,
    ) -> std::io::Result<Option<kvtier_daemon::tiers::g3::seam::IndexBackend>> {
        kvtier_daemon::tiers::g3::seam::RealFs.index_backend(p)
    }
}

/// Two puts of one key; the first renames its file, then its commit
/// fails. The second, which found the name taken while the first was
/// committing, must not be acked for a block lookups cannot see (it used
/// to answer AlreadyPresent at once).
#[test]
fn same_key_put_is_not_acked_for_a_block_whose_commit_failed() {
    let dir = tempfile::tempdir().unwrap();
    let open = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
    let fs = Arc::new(GateFs {
        first: std::sync::atomic::AtomicBool::new(true),
        open: Arc::clone(&open),
    });
    let cfg = common::cfg(
        dir.path(),
        kvtier_daemon::tiers::g3::engine::EngineKind::Pread,
    );
    let s = G3Store::open_with_fs(cfg, Box::new(Lru::new()), Arc::new(PreadEngine), fs).unwrap();
    s.fault_fail_index_commits(1);
    let ns = namespace(8192, "same-key").unwrap();
    let (key, h, p) = block(&ns, 7);
    let ns = ns.id();
    let first = {
        let (s, h, p) = (Arc::clone(&s), h.clone(), p.clone());
        std::thread::spawn(move || s.put_block(&ns, &h, &p, PutMeta::default()))
    };
    // The first put is now held between its rename and its commit.
    std::thread::sleep(std::time::Duration::from_millis(200));
    let second = s.put_block(&ns, &h, &p, PutMeta::default());
    *open.0.lock().unwrap() = true;
    open.1.notify_all();
    let first = first.join().unwrap();
    assert!(
        first.is_err(),
        "the first put's commit was made to fail: {first:?}"
    );
    if let Ok(outcome) = &second {
        assert!(
            s.stat(&ns, &key).is_some(),
            "second put acked {outcome:?} for a block lookups cannot see"
        );
        let mut buf = vec![0u8; 8192 + 4096];
        assert!(matches!(
            s.read_into(&ns, &key, &mut buf),
            Ok(Lookup::Hit(_))
        ));
    }
}

/// The deterministic simulation (tests/sim/mod.rs): `KVTIER_SIM_SEEDS`
/// seeds (20 in CI) from `KVTIER_SIM_SEED0`, or the one seed in
/// `KVTIER_SIM_SEED`. Prints `sim: N passed, N failed` and the figures.
#[test]
fn simulation_short() {
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    let (seed0, n) = match env("KVTIER_SIM_SEED") {
        Some(s) => (s, 1),
        None => (
            env("KVTIER_SIM_SEED0").unwrap_or(0x51u64 << 8),
            env("KVTIER_SIM_SEEDS").unwrap_or(20),
        ),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // Replayable: one seed run twice takes the same path.
    let once = sim::run_seed(seed0, rt.handle());
    let again = sim::run_seed(seed0, rt.handle());
    assert_eq!(once, again, "seed {seed0} did not replay identically");
    let mut total = sim::SimFigures::default();
    let mut failed = Vec::new();
    let t = std::time::Instant::now();
    for seed in seed0..seed0 + n {
        match sim::run_seed(seed, rt.handle()) {
            Ok(f) => total.add(&f),
            Err(e) => {
                eprintln!("sim FAILED: {e}");
                failed.push(e);
            }
        }
    }
    println!(
        "sim: seeds {seed0}..{} in {:?}: {total:?}, blocks lost 0 unless failed below",
        seed0 + n,
        t.elapsed()
    );
    println!(
        "sim: {} passed, {} failed",
        n - failed.len() as u64,
        failed.len()
    );
    assert!(failed.is_empty(), "{failed:#?}");
    if n >= 20 {
        // The run exercised what it claims.
        assert!(
            total.evictions > 0 && total.power_cuts > 0 && total.hits_g4 > 0,
            "{total:?}"
        );
        assert!(
            total.faults_injected > 0 && total.hits_peer > 0,
            "{total:?}"
        );
    }
}
