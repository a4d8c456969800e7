//! Discovery through the shared object store (G4): each daemon keeps a small
//! heartbeat object `nodes/<node-id>.json` with its peer address and an
//! expiry; readers list `nodes/`, drop expired entries and themselves.
//!
//! No coordination service is involved: the object store already is the
//! shared, durable meeting point. A node that dies simply stops refreshing
//! and falls out after its TTL. Clocks must agree to within a fraction of
//! the TTL (run NTP). Pass a `PrefixStore` to share a bucket with other data.

use super::{unix_ms_now, validate_address, validate_node_id, PeerInfo};
use crate::base::error::{Error, Result};
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use std::sync::Arc;
use std::time::Duration;

/// Object prefix of heartbeats.
pub const NODES_PREFIX: &str = "nodes";
/// Most heartbeats read per discovery round.
pub const NODES_MAX: usize = 1024;
/// Largest heartbeat object read.
pub const HEARTBEAT_BYTES_MAX: u64 = 4096;

/// The heartbeat object's content.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Heartbeat {
    /// Node id (also the object name).
    pub node_id: String,
    /// Peer-server address, `host:port`.
    pub address: String,
    /// When this heartbeat stops counting, ms since the Unix epoch.
    pub expires_unix_ms: u64,
    /// When it was written, ms since the Unix epoch.
    pub written_unix_ms: u64,
}

/// Object path of a node's heartbeat.
pub fn heartbeat_path(node_id: &str) -> Path {
    Path::from(format!("{NODES_PREFIX}/{node_id}.json"))
}

fn os_err(op: &'static str, location: &Path, e: object_store::Error) -> Error {
    Error::ObjectStore {
        op,
        location: location.to_string(),
        detail: e.to_string(),
    }
}

/// Writes (or refreshes) this node's heartbeat, valid for `ttl_ms`.
pub async fn publish(
    store: &dyn ObjectStore,
    node_id: &str,
    address: &str,
    ttl_ms: u64,
) -> Result<Heartbeat> {
    validate_node_id(node_id)?;
    validate_address(address)?;
    let now = unix_ms_now();
    let hb = Heartbeat {
        node_id: node_id.to_string(),
        address: address.to_string(),
        expires_unix_ms: now.saturating_add(ttl_ms),
        written_unix_ms: now,
    };
    let body = serde_json::to_vec(&hb).map_err(|e| Error::InvalidInput {
        what: "heartbeat",
        reason: e.to_string(),
    })?;
    let path = heartbeat_path(node_id);
    store
        .put(&path, PutPayload::from(body))
        .await
        .map_err(|e| os_err("put", &path, e))?;
    Ok(hb)
}

/// Removes this node's heartbeat (graceful shutdown).
pub async fn withdraw(store: &dyn ObjectStore, node_id: &str) -> Result<()> {
    validate_node_id(node_id)?;
    let path = heartbeat_path(node_id);
    match store.delete(&path).await {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(os_err("delete", &path, e)),
    }
}

/// Live peers other than `self_id`, as of `now_unix_ms`, sorted by id.
/// Malformed, oversized or expired heartbeats are skipped, not errors.
pub async fn discover(
    store: &dyn ObjectStore,
    self_id: &str,
    now_unix_ms: u64,
) -> Result<Vec<PeerInfo>> {
    let prefix = Path::from(NODES_PREFIX);
    let mut metas = Vec::new();
    let mut listing = store.list(Some(&prefix));
    while let Some(m) = listing
        .try_next()
        .await
        .map_err(|e| os_err("list", &prefix, e))?
    {
        if metas.len() >= NODES_MAX {
            tracing::warn!(
                "more than {NODES_MAX} heartbeats under {NODES_PREFIX}/; ignoring the rest"
            );
            break;
        }
        metas.push(m);
    }
    let mut peers = Vec::new();
    for m in metas {
        let Some(id) = m
            .location
            .filename()
            .and_then(|f| f.strip_suffix(".json"))
            .map(str::to_string)
        else {
            continue;
        };
        if id == self_id || validate_node_id(&id).is_err() || m.size > HEARTBEAT_BYTES_MAX {
            continue;
        }
        let bytes = match store.get(&m.location).await {
            // Streamed with a cap: the object may have been replaced by a
            // larger one since the listing sized it.
            Ok(r) => match capped_body(r, HEARTBEAT_BYTES_MAX as usize).await {
                Some(b) => b,
                None => continue,
            },
            // Deleted between list and get: the node withdrew.
            Err(object_store::Error::NotFound { .. }) => continue,
            Err(e) => return Err(os_err("get", &m.location, e)),
        };
        let Ok(hb) = serde_json::from_slice::<Heartbeat>(&bytes) else {
            tracing::debug!("ignoring malformed heartbeat {}", m.location);
            continue;
        };
        if hb.node_id != id || hb.expires_unix_ms <= now_unix_ms {
            continue;
        }
        if let Ok(p) = PeerInfo::new(hb.node_id, hb.address) {
            peers.push(p);
        }
    }
    peers.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(peers)
}

/// A background task that refreshes this node's heartbeat every
/// `period_ms` and, when given a [`super::PeerSet`], refreshes its
/// discovered peers too. Stops (without withdrawing) when dropped.
pub struct HeartbeatTask {
    handle: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for HeartbeatTask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HeartbeatTask")
    }
}

impl HeartbeatTask {
    /// Publishes once (so errors in the configuration surface now), then
    /// spawns the refresher. `ttl_ms` should be at least 3 periods so one
    /// lost refresh does not drop the node.
    pub async fn start(
        store: Arc<dyn ObjectStore>,
        node_id: String,
        address: String,
        ttl_ms: u64,
        period_ms: u64,
        peers: Option<Arc<super::PeerSet>>,
    ) -> Result<HeartbeatTask> {
        if period_ms == 0 || ttl_ms <= period_ms {
            return Err(Error::Config {
                key: "peer.heartbeat_ttl_ms".into(),
                problem: format!(
                    "ttl {ttl_ms} ms must exceed the period {period_ms} ms (3x is advised)"
                ),
            });
        }
        publish(store.as_ref(), &node_id, &address, ttl_ms).await?;
        if let Some(set) = &peers {
            set.set_discovered(discover(store.as_ref(), &node_id, unix_ms_now()).await?);
        }
        let handle = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(period_ms));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                if let Err(e) = publish(store.as_ref(), &node_id, &address, ttl_ms).await {
                    tracing::warn!("heartbeat refresh failed: {e}");
                }
                if let Some(set) = &peers {
                    match discover(store.as_ref(), &node_id, unix_ms_now()).await {
                        Ok(p) => set.set_discovered(p),
                        Err(e) => tracing::warn!("peer discovery failed: {e}"),
                    }
                }
            }
        });
        Ok(HeartbeatTask { handle })
    }
}

impl Drop for HeartbeatTask {
    fn drop(&mut self) {
        self.handle.abort();
    }
}

/// The body of `r`, or `None` when it fails or exceeds `max` bytes (read no
/// further than that).
async fn capped_body(r: object_store::GetResult, max: usize) -> Option<Vec<u8>> {
    use futures::StreamExt;
    let mut out = Vec::new();
    let mut stream = r.into_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.ok()?;
        if out.len() + chunk.len() > max {
            return None;
        }
        out.extend_from_slice(&chunk);
    }
    Some(out)
}
