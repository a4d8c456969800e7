//! Starting the peer subsystem: the server that streams this node's G3
//! block files, the peer set that fetches from others, and heartbeats in G4.

use crate::base::error::{Error, Result};
use crate::base::tier::Lookup;
use crate::tiers::g3::G3Store;
use crate::tiers::peer::holdings::HoldingsDigest;
use crate::tiers::peer::{HeartbeatTask, PeerClient, PeerConfig, PeerServer, PeerSet, PeerSource};
use kvtier_client::{BlockKey, NamespaceId};
use object_store::path::Path;
use object_store::ObjectStore;
use std::fs::File;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::runtime::Handle;

/// The peer settings a node starts with.
#[derive(Clone)]
pub struct PeerSetup {
    /// The `[peer]` section.
    pub cfg: PeerConfig,
    /// This node's id.
    pub node_id: String,
    /// The shared secret (read from `cfg.secret_file`).
    pub secret: Vec<u8>,
    /// Test hook: the server flips a payload byte of every response
    /// (`KVTIER_TEST_PEER_CORRUPT=1` in kvtierd). Never set in production.
    pub corrupt_responses_for_tests: bool,
}

impl std::fmt::Debug for PeerSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerSetup")
            .field("cfg", &self.cfg)
            .field("node_id", &self.node_id)
            .field("secret", &"<redacted>")
            .finish()
    }
}

/// G3 as what the peer server streams: the block file as on disk. The
/// receiver verifies; G3 drops corrupt blocks it learns about.
struct G3Source {
    g3: Arc<G3Store>,
    /// The last digest, the G3 counters it was built at, and when.
    digest: Mutex<Option<(DigestBasis, Instant, HoldingsDigest)>>,
}

/// What a digest was built from: G3's block and byte counts, evictions and
/// quarantines, and the size bound. Unchanged counters mean (almost
/// always) unchanged holdings, so the index walk is skipped; a delete and a
/// store of the same size in between is caught by `DIGEST_REBUILD_MAX`.
type DigestBasis = (u64, u64, u64, u64, u64);

/// Longest a digest is reused while G3's counters stay the same.
const DIGEST_REBUILD_MAX: Duration = Duration::from_secs(30);

impl PeerSource for G3Source {
    fn open_block(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Option<(File, u64)>> {
        Ok(match self.g3.open_for_read(ns, key)? {
            Lookup::Hit((file, info)) => Some((file, info.file_len)),
            Lookup::Miss(_) => None,
        })
    }

    fn holdings(&self, bytes_max: u64) -> Result<Option<HoldingsDigest>> {
        let st = self.g3.stats();
        let basis = (
            st.blocks,
            st.used_bytes,
            st.evictions,
            st.quarantined,
            bytes_max,
        );
        let mut cached = self.digest.lock().map_err(|_| Error::Peer {
            peer: "self".into(),
            detail: "holdings digest lock poisoned".into(),
        })?;
        if let Some((b, at, d)) = cached.as_ref() {
            if *b == basis && at.elapsed() < DIGEST_REBUILD_MAX {
                return Ok(Some(d.clone()));
            }
        }
        // Sized from the block count now; blocks stored while the walk runs
        // are in the next digest (a peer's probe or fetch finds them).
        let mut d =
            HoldingsDigest::with_capacity(st.blocks, bytes_max, crate::tiers::peer::unix_ms_now());
        for ns in self.g3.namespaces() {
            let mut after: Option<BlockKey> = None;
            loop {
                let page = self.g3.list(&ns, after.as_ref(), 4096);
                for k in &page {
                    d.insert(&ns, k);
                }
                match page.last() {
                    Some(k) if page.len() == 4096 => after = Some(*k),
                    _ => break,
                }
            }
        }
        *cached = Some((basis, Instant::now(), d.clone()));
        Ok(Some(d))
    }
}

pub(super) struct Started {
    pub(super) set: Arc<PeerSet>,
    pub(super) server: PeerServer,
    pub(super) heartbeat: Option<HeartbeatTask>,
}

/// Starts the server, the set, and (when `discovery` and G4 are on) the
/// heartbeat task publishing under `<g4 prefix>/nodes/`.
pub(super) fn start(
    handle: &Handle,
    g3: &Arc<G3Store>,
    p: &PeerSetup,
    g4: Option<(Arc<dyn ObjectStore>, Path)>,
) -> Result<Started> {
    p.cfg.validate()?;
    let mut scfg = p.cfg.server_config(p.secret.clone());
    scfg.corrupt_responses_for_tests = p.corrupt_responses_for_tests;
    // Requests are signed for this node and this start: the epoch is
    // larger at every start, whatever the clock says (a ceiling recorded
    // in g3.dir), so a request captured before a restart is refused after.
    scfg.node_id = p.node_id.clone();
    let (_, epoch) = crate::base::id_floor::IdFloor::open(&g3.config().root.join("peer-epoch"))?;
    scfg.epoch = Some(epoch);
    if p.corrupt_responses_for_tests {
        tracing::warn!("peer: TEST HOOK ON: every response is corrupted on purpose");
    }
    let source: Arc<dyn PeerSource> = Arc::new(G3Source {
        g3: g3.clone(),
        digest: Mutex::new(None),
    });
    let server = super::run_on(handle, PeerServer::start(scfg, source))
        .ok_or_else(|| runtime_gone("starting the peer server"))??;
    let bound = server.local_addr();
    let client = PeerClient::new(p.cfg.client_config(p.secret.clone()))?;
    let set = Arc::new(PeerSet::new(p.cfg.set_config(&p.node_id), client)?);
    let address = p.cfg.advertised_address(bound);
    tracing::info!(node_id = %p.node_id, %address, static_peers = p.cfg.peers.len(), "peer server listening");
    if p.cfg.holdings_refresh_ms > 0 && p.cfg.holdings_bytes_max > 0 {
        // Holds the set weakly: the loop ends when the node drops it.
        let weak = Arc::downgrade(&set);
        let period = std::time::Duration::from_millis(p.cfg.holdings_refresh_ms);
        handle.spawn(async move {
            while let Some(set) = weak.upgrade() {
                set.refresh_holdings().await;
                drop(set);
                tokio::time::sleep(period).await;
            }
        });
    }
    let mut heartbeat = None;
    if p.cfg.discovery {
        if let Some((store, prefix)) = g4 {
            let scoped: Arc<dyn ObjectStore> =
                Arc::new(object_store::prefix::PrefixStore::new(store, prefix));
            let fut = HeartbeatTask::start(
                scoped,
                p.node_id.clone(),
                address,
                p.cfg.heartbeat_ttl_ms,
                p.cfg.heartbeat_period_ms,
                Some(set.clone()),
            );
            match super::run_on(handle, fut) {
                Some(Ok(h)) => heartbeat = Some(h),
                // Discovery is an addition to static peers: a store that
                // refuses heartbeats must not keep the node from serving.
                Some(Err(e)) => tracing::warn!("peer discovery off: {e}"),
                None => return Err(runtime_gone("starting heartbeats")),
            }
        }
    }
    Ok(Started {
        set,
        server,
        heartbeat,
    })
}

fn runtime_gone(op: &'static str) -> Error {
    Error::io(op, "", std::io::Error::other("the node runtime shut down"))
}
