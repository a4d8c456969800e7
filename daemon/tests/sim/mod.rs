//! Deterministic simulation (issue #15, item 6): one seed drives a single
//! thread of random offloads, onboards (with the node's fall-through:
//! G3, then a peer, then G4, then a promotion into G3), deletes, hint
//! updates, capacity evictions and power cuts, against
//! - the real G3 store (index, eviction policy, events, recovery) over the
//!   simulated disk [`PowerLossFs`] (power lost at a seeded operation,
//!   unsynced data and directory entries dropped or torn);
//! - the real G4 store over object_store's `InMemory` behind
//!   [`FlakyStore`], which fails or corrupts GETs at a seeded rate;
//! - a peer modelled as a map of block files that lies, truncates or is
//!   absent at a seeded rate, verified with the block format's own checks
//!   (the peer client's).
//!
//! Single-threaded and seeded: the same seed takes the same path (the
//! background reclaimer never runs: `high_watermark = 1.0`, so every
//! eviction is the synchronous one on the write path, and a reopen after a
//! power cut gets room for every file the cut left). The clock is
//! simulated: `g3::set_sim_clock_s` (per thread) advances one second per
//! step, so access stamps, and the LRU order recovery rebuilds from them,
//! depend on the seed only. G4's own timers (deadlines, breaker, caches)
//! are wall-clock but never decide here: deadlines are generous, the
//! breaker is off, and the sim does not use the existence cache.
//!
//! Invariants, checked after every step:
//! - no wrong byte reaches a client (every hit, from any tier, is compared
//!   with the block's true bytes);
//! - acknowledged means readable until a removed event: a block whose put
//!   was acked and for which no `Removed` event came reads back, across
//!   power cuts and recoveries too;
//! - events agree with the index: the set built from `Stored`/`Removed`
//!   events equals the set of blocks the index lists (within a session;
//!   after a recovery the set restarts from the index);
//! - bounded: blocks + quarantine within capacity, no temp file left
//!   between steps, nothing quarantined (no corruption reaches the disk
//!   here);
//! - G4 keeps what it acked (checked at the end with faults off), except
//!   objects it deleted after two bad reads with one ETag (its documented
//!   rule; counted as `g4_objects_deleted`).
//!
//! `KVTIER_SIM_SEED=<seed>` replays one seed (a failure prints it);
//! `KVTIER_SIM_SEEDS=<n>` sets how many (CI: 20; scripts/fault-suite.sh
//! runs thousands).

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::StreamExt;
use kvtier_client::{decode_block, encode_block, BlockHeader, BlockKey, Hints, Namespace};
use kvtier_daemon::base::tier::{BlockTier, Lookup};
use kvtier_daemon::testkit::conformance::{block, namespace};
use kvtier_daemon::tiers::g3::engine::PreadEngine;
use kvtier_daemon::tiers::g3::powerloss::PowerLossFs;
use kvtier_daemon::tiers::g3::{G3Event, G3Store, PutMeta};
use kvtier_daemon::tiers::g4::{G4Config, G4Store};
use kvtier_daemon::tiers::policy::Lru;
use object_store::memory::InMemory;
use object_store::path::Path as OsPath;
use object_store::{
    CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta,
    ObjectStore, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Keys the workload draws from (more than capacity, so eviction runs).
const KEYS: u64 = 24;
/// G3 capacity in blocks.
const CAPACITY_BLOCKS: u64 = 10;
/// Steps per seed.
const STEPS: u64 = 80;
const PAYLOAD_BYTES: u64 = 8192;

/// Seeded GET faults for the object store: each GET fails (a 503) or
/// returns one flipped payload byte at the given rates. Deletes are
/// counted (G4 deletes an object only after two bad reads with one ETag).
#[derive(Debug)]
pub struct FlakyStore {
    inner: Arc<dyn ObjectStore>,
    rng: Mutex<StdRng>,
    fail_rate: f64,
    corrupt_rate: f64,
    /// Faults injected.
    pub faults: AtomicU64,
    /// Delete calls through this store.
    pub deletes: AtomicU64,
    /// The paths deleted.
    pub deleted: Arc<Mutex<Vec<String>>>,
    on: std::sync::atomic::AtomicBool,
}

impl std::fmt::Display for FlakyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FlakyStore({})", self.inner)
    }
}

impl FlakyStore {
    fn draw(&self) -> Option<bool> {
        if !self.on.load(SeqCst) {
            return None;
        }
        let mut r = self.rng.lock().unwrap();
        let x: f64 = r.random();
        if x < self.fail_rate {
            Some(false)
        } else if x < self.fail_rate + self.corrupt_rate {
            Some(true)
        } else {
            None
        }
    }
}

#[async_trait::async_trait]
impl ObjectStore for FlakyStore {
    async fn put_opts(
        &self,
        location: &OsPath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &OsPath,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &OsPath,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        let head = options.head;
        let fault = if head { None } else { self.draw() };
        match fault {
            None => self.inner.get_opts(location, options).await,
            Some(false) => {
                self.faults.fetch_add(1, SeqCst);
                Err(object_store::Error::Generic {
                    store: "FlakyStore",
                    source: "injected: 503 Service Unavailable".into(),
                })
            }
            Some(true) => {
                let r = self.inner.get_opts(location, options).await?;
                self.faults.fetch_add(1, SeqCst);
                let (meta, range, attributes, extensions) = (
                    r.meta.clone(),
                    r.range.clone(),
                    r.attributes.clone(),
                    r.extensions.clone(),
                );
                let mut v = r.bytes().await?.to_vec();
                let at = 4096 + 17;
                if v.len() > at {
                    v[at] ^= 0x5a;
                }
                let body = Bytes::from(v);
                Ok(GetResult {
                    payload: GetResultPayload::Stream(
                        futures::stream::once(async move { Ok(body) }).boxed(),
                    ),
                    meta,
                    range,
                    attributes,
                    extensions,
                })
            }
        }
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<OsPath>>,
    ) -> BoxStream<'static, object_store::Result<OsPath>> {
        let seen = Arc::clone(&self.deleted);
        let counted = locations
            .inspect(move |p| {
                if let Ok(p) = p {
                    seen.lock().unwrap().push(p.to_string());
                }
            })
            .boxed();
        self.deletes.fetch_add(1, SeqCst);
        self.inner.delete_stream(counted)
    }

    fn list(
        &self,
        prefix: Option<&OsPath>,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&OsPath>,
    ) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &OsPath,
        to: &OsPath,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

/// What one seed did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SimFigures {
    pub steps: u64,
    pub offloads_acked: u64,
    pub onboards: u64,
    pub hits_g3: u64,
    pub hits_peer: u64,
    pub hits_g4: u64,
    pub misses: u64,
    pub evictions: u64,
    pub deletes: u64,
    pub power_cuts: u64,
    pub faults_injected: u64,
    pub g4_objects_deleted: u64,
    pub acked_checked: u64,
}

impl SimFigures {
    pub fn add(&mut self, o: &SimFigures) {
        self.steps += o.steps;
        self.offloads_acked += o.offloads_acked;
        self.onboards += o.onboards;
        self.hits_g3 += o.hits_g3;
        self.hits_peer += o.hits_peer;
        self.hits_g4 += o.hits_g4;
        self.misses += o.misses;
        self.evictions += o.evictions;
        self.deletes += o.deletes;
        self.power_cuts += o.power_cuts;
        self.faults_injected += o.faults_injected;
        self.g4_objects_deleted += o.g4_objects_deleted;
        self.acked_checked += o.acked_checked;
    }
}

struct Sim {
    dir: tempfile::TempDir,
    fs: Arc<PowerLossFs>,
    ns: Namespace,
    g3: Arc<G3Store>,
    g4: G4Store,
    flaky: Arc<FlakyStore>,
    /// The peer's block files, and how it misbehaves.
    peer: HashMap<BlockKey, Vec<u8>>,
    peer_lie_rate: f64,
    /// The keys, in a fixed order (the draws index into it).
    keys: Vec<BlockKey>,
    /// Truth: each key's header and payload.
    truth: HashMap<BlockKey, (BlockHeader, Vec<u8>)>,
    /// Acked on G3 and no Removed event since.
    acked: BTreeSet<BlockKey>,
    /// Built from G3's events.
    events: Arc<Mutex<Vec<G3Event>>>,
    live: BTreeSet<BlockKey>,
    /// Acked by G4 (put Ok).
    in_g4: BTreeSet<BlockKey>,
    fig: SimFigures,
    /// What happened to each key (printed with a failure).
    history: HashMap<BlockKey, Vec<String>>,
    session: u64,
}

fn fail(seed: u64, step: u64, what: String) -> String {
    format!("seed {seed} step {step}: {what} (replay: KVTIER_SIM_SEED={seed})")
}

impl Sim {
    /// Reopens after a power cut with room for every block file the cut
    /// left (evictions whose unlinks were not yet durable come back), so
    /// that the background reclaimer, which would evict at a wall-clock
    /// moment, never runs: the path stays a function of the seed.
    fn reopen_g3(&self) -> kvtier_daemon::base::error::Result<Arc<G3Store>> {
        let root = self.dir.path().join("root");
        // Blocks in slab slots too (g3/slots.rs): every slot a slab has
        // room for may hold one the cut brought back.
        let held = walk_files(&root.join("blocks")) + slab_slots(&root.join("slots"));
        open_g3(&self.dir, &self.fs, CAPACITY_BLOCKS.max(held))
    }

    fn attach(&mut self) {
        let ev = Arc::clone(&self.events);
        self.g3
            .set_event_sink(Arc::new(move |e| ev.lock().unwrap().push(e)));
    }

    /// Applies pending events to `live` and `acked`.
    fn drain_events(&mut self) {
        let evs: Vec<G3Event> = std::mem::take(&mut *self.events.lock().unwrap());
        for e in evs {
            match e {
                G3Event::Stored { key, .. } => {
                    self.live.insert(key);
                }
                G3Event::Removed { key, reason, .. } => {
                    self.note(&key, format!("s{} removed {reason:?}", self.session));
                    self.live.remove(&key);
                    self.acked.remove(&key);
                    if reason == kvtier_daemon::tiers::g3::RemoveReason::Evicted {
                        self.fig.evictions += 1;
                    }
                }
            }
        }
    }

    fn note(&mut self, key: &BlockKey, what: String) {
        self.history.entry(*key).or_default().push(what);
    }

    fn read_g3(&self, key: &BlockKey) -> Result<Option<Vec<u8>>, String> {
        let mut buf = vec![0u8; (PAYLOAD_BYTES + 8192) as usize];
        match self.g3.read_into(&self.ns.id(), key, &mut buf) {
            Ok(Lookup::Hit(h)) => Ok(Some(buf[4096..4096 + h.payload_len as usize].to_vec())),
            Ok(Lookup::Miss(_)) => Ok(None),
            Err(e) => Err(format!("G3 read error (a miss is the rule): {e}")),
        }
    }

    fn put_g3(&mut self, key: &BlockKey, hints: Hints) -> bool {
        let (h, p) = self.truth[key].clone();
        let r = self.g3.put_block(
            &self.ns.id(),
            &h,
            &p,
            PutMeta {
                parent: None,
                hints,
            },
        );
        let op = self.fs.ops();
        self.note(key, format!("s{} put {r:?} at op {op}", self.session));
        self.drain_events();
        if r.is_ok() {
            self.acked.insert(*key);
            self.fig.offloads_acked += 1;
        }
        r.is_ok()
    }

    /// The node's onboard: G3, then the peer, then G4; a fetched block is
    /// verified and promoted into G3.
    fn onboard(&mut self, rng: &mut StdRng, key: &BlockKey) -> Result<(), String> {
        self.fig.onboards += 1;
        let want = self.truth[key].1.clone();
        let was_acked = self.acked.contains(key);
        if let Some(got) = self.read_g3(key)? {
            self.drain_events();
            if got != want {
                return Err(format!("WRONG BYTES from G3 for {key}"));
            }
            self.fig.hits_g3 += 1;
            return Ok(());
        }
        self.drain_events();
        if was_acked && self.acked.contains(key) {
            return Err(format!(
                "acked block {key} missed on G3 with no Removed event"
            ));
        }
        // The peer: lies, truncates or is silent at its rate; verified as
        // the peer client verifies (header for this key, payload hash).
        if let Some(file) = self.peer.get(key) {
            let mut f = file.clone();
            if rng.random_bool(self.peer_lie_rate) {
                self.fig.faults_injected += 1;
                match rng.random_range(0..3) {
                    0 => f[4096 + rng.random_range(0..PAYLOAD_BYTES as usize)] ^= 0x01,
                    1 => f.truncate(rng.random_range(0..f.len())),
                    _ => f.clear(),
                }
            }
            if let Ok((h, payload)) = decode_block(&f) {
                if h.key == *key
                    && h.namespace_id() == self.ns.id()
                    && h.verify_payload(payload).is_ok()
                {
                    if payload != &want[..] {
                        return Err(format!(
                            "WRONG BYTES from the peer passed verification for {key}"
                        ));
                    }
                    self.fig.hits_peer += 1;
                    self.put_g3(key, Hints::default());
                    return Ok(());
                }
            }
        }
        match self.g4.fetch(&self.ns.id(), key, Duration::from_secs(5)) {
            Lookup::Hit(b) => {
                if b.payload != want || b.header.key != *key {
                    return Err(format!("WRONG BYTES from G4 for {key}"));
                }
                self.fig.hits_g4 += 1;
                if self.put_g3(key, Hints::default()) {
                    self.g3.mark_in_g4(&self.ns.id(), key);
                }
            }
            Lookup::Miss(_) => self.fig.misses += 1,
        }
        Ok(())
    }

    fn check(&mut self, seed: u64, step: u64) -> Result<(), String> {
        self.drain_events();
        let id = self.ns.id();
        let listed: BTreeSet<BlockKey> = self
            .truth
            .keys()
            .filter(|k| self.g3.stat(&id, k).is_some())
            .copied()
            .collect();
        if listed != self.live {
            return Err(fail(
                seed,
                step,
                format!(
                    "events disagree with the index: index {} blocks, events {} (only in index: {:?}, only in events: {:?})",
                    listed.len(),
                    self.live.len(),
                    listed.difference(&self.live).collect::<Vec<_>>(),
                    self.live.difference(&listed).collect::<Vec<_>>()
                ),
            ));
        }
        if let Some(k) = self.acked.iter().find(|k| !listed.contains(k)) {
            return Err(fail(
                seed,
                step,
                format!("acked block {k} not in the index, no Removed event"),
            ));
        }
        let st = self.g3.stats();
        if st.used_bytes + st.quarantine_bytes > st.capacity_bytes {
            return Err(fail(seed, step, format!("over capacity: {st:?}")));
        }
        if st.quarantined > 0 {
            return Err(fail(
                seed,
                step,
                format!("a good block was quarantined: {st:?}"),
            ));
        }
        let tmp = std::fs::read_dir(self.dir.path().join("root/tmp"))
            .map(|d| d.count())
            .unwrap_or(0);
        if tmp > 0 {
            return Err(fail(
                seed,
                step,
                format!("{tmp} temp files left between steps"),
            ));
        }
        Ok(())
    }

    /// Power lost during the next few operations, then recovery; every
    /// acked block (no Removed event) must read back exactly.
    fn power_cut(&mut self, rng: &mut StdRng, seed: u64, step: u64) -> Result<(), String> {
        self.fig.power_cuts += 1;
        let now = self.fs.ops();
        self.fs.set_crash_at(Some(now + rng.random_range(0..30)));
        // Work until the lights go out (or a few steps).
        for _ in 0..6 {
            if self.fs.crashed() {
                break;
            }
            let key = self.keys[rng.random_range(0..self.keys.len())];
            self.put_g3(&key, Hints::default());
        }
        self.fs.crash_now();
        self.drain_events();
        let _ = self.g3.close();
        self.fs
            .power_cycle()
            .map_err(|e| fail(seed, step, format!("power cycle: {e}")))?;
        self.g3 = self
            .reopen_g3()
            .map_err(|e| fail(seed, step, format!("recovery failed: {e}")))?;
        self.events.lock().unwrap().clear();
        self.session += 1;
        self.attach();
        // The index after recovery is the new baseline for events.
        let id = self.ns.id();
        self.live = self
            .truth
            .keys()
            .filter(|k| self.g3.stat(&id, k).is_some())
            .copied()
            .collect();
        let acked: Vec<BlockKey> = self.acked.iter().copied().collect();
        for k in acked {
            self.fig.acked_checked += 1;
            match self.read_g3(&k).map_err(|e| fail(seed, step, e))? {
                Some(b) if b == self.truth[&k].1 => {}
                Some(_) => {
                    return Err(fail(
                        seed,
                        step,
                        format!("WRONG BYTES for {k} after recovery"),
                    ))
                }
                None => {
                    return Err(fail(
                        seed,
                        step,
                        format!(
                            "acked block {k} lost by the power cut (history {:?})",
                            self.history.get(&k)
                        ),
                    ))
                }
            }
        }
        self.drain_events();
        Ok(())
    }
}

fn walk_files(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| {
                    if e.path().is_dir() {
                        walk_files(&e.path())
                    } else {
                        1
                    }
                })
                .sum()
        })
        .unwrap_or(0)
}

/// The slots the slab files under `dir` have room for (`<pages>.slab`,
/// slots of `pages` 4 KiB pages).
fn slab_slots(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let pages: u64 = e
                        .file_name()
                        .to_str()?
                        .strip_suffix(".slab")?
                        .parse()
                        .ok()?;
                    Some(e.metadata().ok()?.len() / (pages * 4096).max(1))
                })
                .sum()
        })
        .unwrap_or(0)
}

fn open_g3(
    dir: &tempfile::TempDir,
    fs: &Arc<PowerLossFs>,
    capacity_blocks: u64,
) -> kvtier_daemon::base::error::Result<Arc<G3Store>> {
    let mut cfg = kvtier_daemon::tiers::g3::G3Config::new(dir.path().join("root"), 0);
    let file_len = 4096 + PAYLOAD_BYTES;
    cfg.capacity_bytes = capacity_blocks * file_len;
    cfg.high_watermark = 1.0;
    cfg.low_watermark = 0.9;
    cfg.io_depth = 1;
    cfg.buffer_pool_bytes = 4 << 20;
    cfg.pinned_budget_bytes = 0;
    cfg.engine = kvtier_daemon::tiers::g3::engine::EngineKind::Pread;
    G3Store::open_with_fs(
        cfg,
        Box::new(Lru::new()),
        fs.engine(Arc::new(PreadEngine)),
        fs.clone(),
    )
}

/// One seed; `Err` names the seed, the step and the broken invariant.
pub fn run_seed(seed: u64, handle: &tokio::runtime::Handle) -> Result<SimFigures, String> {
    kvtier_daemon::tiers::g3::set_sim_clock_s(Some(1_700_000_000));
    let r = run_seed_inner(seed, handle);
    kvtier_daemon::tiers::g3::set_sim_clock_s(None);
    r
}

fn run_seed_inner(seed: u64, handle: &tokio::runtime::Handle) -> Result<SimFigures, String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let fs = PowerLossFs::new(dir.path().join("grave"), seed).unwrap();
    // `KVTIER_SIM_SKIP=<sync site>` removes one durability call (to show
    // the simulation notices, as the power-loss mutation check does).
    fs.set_skip(std::env::var("KVTIER_SIM_SKIP").ok().and_then(|n| {
        kvtier_daemon::tiers::g3::seam::SyncSite::ALL
            .iter()
            .copied()
            .find(|s| s.name() == n)
    }));
    let ns = namespace(PAYLOAD_BYTES, "sim").unwrap();
    let g3 =
        open_g3(&dir, &fs, CAPACITY_BLOCKS).map_err(|e| fail(seed, 0, format!("open: {e}")))?;
    let flaky = Arc::new(FlakyStore {
        inner: Arc::new(InMemory::new()),
        rng: Mutex::new(StdRng::seed_from_u64(seed ^ 0x9e37)),
        fail_rate: rng.random_range(0.0..0.3),
        corrupt_rate: rng.random_range(0.0..0.2),
        faults: AtomicU64::new(0),
        deletes: AtomicU64::new(0),
        deleted: Arc::new(Mutex::new(Vec::new())),
        on: std::sync::atomic::AtomicBool::new(true),
    });
    let g4cfg = G4Config {
        retry_backoff_ms: 1,
        retry_backoff_max_ms: 2,
        // The breaker would make later reads skip G4 for a wall-clock
        // while: off, so the path depends on the seed only.
        breaker_failures_max: 1_000_000,
        ..G4Config::new("memory://")
    };
    let g4 = G4Store::with_handle(flaky.clone(), OsPath::default(), g4cfg, handle.clone())
        .map_err(|e| fail(seed, 0, format!("g4: {e}")))?;
    let truth: HashMap<BlockKey, (BlockHeader, Vec<u8>)> = (0..KEYS)
        .map(|i| {
            let (k, h, p) = block(&ns, seed.wrapping_mul(1000) + i);
            (k, (h, p))
        })
        .collect();
    let mut keys: Vec<BlockKey> = truth.keys().copied().collect();
    keys.sort();
    let mut sim = Sim {
        keys: keys.clone(),
        dir,
        fs,
        ns,
        g3,
        g4,
        flaky,
        peer: HashMap::new(),
        peer_lie_rate: rng.random_range(0.0..0.5),
        truth,
        acked: BTreeSet::new(),
        events: Arc::new(Mutex::new(Vec::new())),
        live: BTreeSet::new(),
        in_g4: BTreeSet::new(),
        fig: SimFigures::default(),
        history: HashMap::new(),
        session: 0,
    };
    sim.attach();
    for step in 0..STEPS {
        // Simulated time: one second per step.
        kvtier_daemon::tiers::g3::set_sim_clock_s(Some(1_700_000_000 + step as u32));
        sim.fig.steps += 1;
        let key = keys[rng.random_range(0..keys.len())];
        let id = sim.ns.id();
        match rng.random_range(0..100) {
            // Offload; write-through to G4 for some, the peer holds some.
            0..=34 => {
                let hints = Hints {
                    priority: rng.random_range(0..3),
                    ..Hints::default()
                };
                if sim.put_g3(&key, hints) && rng.random_bool(0.5) {
                    let (h, p) = sim.truth[&key].clone();
                    if sim.g4.put(&id, &h, &p).is_ok() {
                        sim.in_g4.insert(key);
                        sim.g3.mark_in_g4(&id, &key);
                    }
                }
                if rng.random_bool(0.3) {
                    let (h, p) = &sim.truth[&key];
                    sim.peer.insert(key, encode_block(h, p));
                }
            }
            35..=74 => sim
                .onboard(&mut rng, &key)
                .map_err(|e| fail(seed, step, e))?,
            75..=84 => {
                sim.fig.deletes += 1;
                let r = sim.g3.delete_block(&id, &key);
                let s = sim.session;
                sim.note(&key, format!("s{s} delete {r:?}"));
            }
            85..=94 => {
                sim.g3.set_priority(&id, &key, rng.random_range(0..4));
            }
            _ => sim.power_cut(&mut rng, seed, step)?,
        }
        sim.check(seed, step)?;
    }
    // G4 kept what it acked, unless it deleted an object after two bad
    // reads with one ETag (the documented rule; counted).
    sim.flaky.on.store(false, SeqCst);
    let id = sim.ns.id();
    let deleted_paths = sim.flaky.deleted.lock().unwrap().clone();
    let deleted = deleted_paths.len() as u64;
    for k in sim.in_g4.clone() {
        let was_deleted = deleted_paths.contains(&sim.g4.object_path(&id, &k).to_string());
        match sim.g4.fetch(&id, &k, Duration::from_secs(5)) {
            Lookup::Hit(b) if b.payload == sim.truth[&k].1 => {}
            Lookup::Hit(_) => {
                return Err(fail(seed, STEPS, format!("WRONG BYTES from G4 for {k}")))
            }
            Lookup::Miss(_) if was_deleted => {}
            Lookup::Miss(m) => {
                return Err(fail(
                    seed,
                    STEPS,
                    format!("G4 lost acked {k} ({m:?}) with no delete"),
                ))
            }
        }
    }
    sim.fig.faults_injected += sim.flaky.faults.load(SeqCst);
    sim.fig.g4_objects_deleted = deleted;
    let _ = sim.g3.close();
    Ok(sim.fig)
}
