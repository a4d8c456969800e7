//! One lifecycle for a shared bucket: the sweeper deletes only what every
//! node using the bucket agreed to delete.
//!
//! G4 is shared by every node of a cluster, but `[g4] capacity_bytes` and
//! `ttl_ms` are read from each node's own config. Left to itself, one node
//! with a capacity set would delete every other node's objects (oldest
//! first, whoever wrote them). So each node records its lifecycle view in
//! the bucket, `<prefix>/lifecycle/<node-id>.json` (its capacity and TTL,
//! or none), refreshed every `lifecycle_refresh_ms` and valid for three
//! refreshes. Before a sweep deletes anything, the sweeper reads every view
//! that has not expired: if any other node's view differs from its own (a
//! node with no lifecycle set included: it agreed to no deletions), the
//! sweep deletes nothing, counts a conflict and says so in `/healthz`, the
//! log and `kvtier_g4_lifecycle_conflict`. Agreement is a fact about live
//! configs, so it mends by itself once the configs agree or the disagreeing
//! node stops (its view expires).
//!
//! Limits: views count only while their writer's clock and the reader's
//! agree to within the validity (run NTP, as for peer discovery); a node of
//! a kvtier version without views cannot veto; a view that cannot be read
//! (too large, not JSON) counts as a disagreement, never as consent.

use super::Inner;
use crate::base::error::{Error, Result};
use futures::StreamExt;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};
use std::time::{SystemTime, UNIX_EPOCH};

/// Largest view object read (a view is about 200 bytes).
pub const VIEW_BYTES_MAX: u64 = 4096;
/// Most views read per check (nodes sharing one bucket).
pub const VIEWS_MAX: usize = 4096;

/// One node's lifecycle settings as recorded in the bucket.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LifecycleView {
    /// The node that wrote it.
    pub node_id: String,
    /// Its `[g4] capacity_bytes` (`None`: no capacity bound).
    pub capacity_bytes: Option<u64>,
    /// Its `[g4] ttl_ms` (`None`: no age bound).
    pub ttl_ms: Option<u64>,
    /// When the view stops counting, ms since the Unix epoch.
    pub expires_unix_ms: u64,
}

impl LifecycleView {
    fn settings(&self) -> (Option<u64>, Option<u64>) {
        (self.capacity_bytes, self.ttl_ms)
    }
}

/// What the views say about sweeping now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Agreement {
    /// Every live view matches this node's settings.
    Agreed,
    /// Another node disagrees (or its view cannot be read): delete nothing.
    Conflict(String),
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn view_path(inner: &Inner, node_id: &str) -> Path {
    inner.lifecycle_root.clone().join(format!("{node_id}.json"))
}

fn describe(s: (Option<u64>, Option<u64>)) -> String {
    match s {
        (None, None) => "no lifecycle (deletes nothing)".into(),
        (c, t) => format!(
            "capacity_bytes = {}, ttl_ms = {}",
            c.map_or("unset".into(), |v| v.to_string()),
            t.map_or("unset".into(), |v| v.to_string())
        ),
    }
}

/// Writes (or refreshes) this node's view.
pub(crate) async fn publish(inner: &Inner) -> Result<LifecycleView> {
    let node_id = inner.node_id();
    let view = LifecycleView {
        node_id: node_id.clone(),
        capacity_bytes: inner.cfg.capacity_bytes,
        ttl_ms: inner.cfg.ttl_ms,
        expires_unix_ms: now_ms().saturating_add(inner.cfg.lifecycle_refresh_ms.saturating_mul(3)),
    };
    let body = serde_json::to_vec(&view).map_err(|e| Error::ObjectStore {
        op: "encode lifecycle view",
        location: node_id.clone(),
        detail: e.to_string(),
    })?;
    let path = view_path(inner, &node_id);
    inner
        .store
        .put(&path, PutPayload::from(body))
        .await
        .map_err(|e| inner.err("put", &path, &e))?;
    Ok(view)
}

/// Reads every live view and compares it with this node's settings.
pub(crate) async fn check(inner: &Inner) -> Result<Agreement> {
    let mine = (inner.cfg.capacity_bytes, inner.cfg.ttl_ms);
    let me = inner.node_id();
    let views = match read_live(inner).await? {
        Ok(v) => v,
        Err(why) => return Ok(Agreement::Conflict(why)),
    };
    for view in views {
        if view.node_id == me {
            continue;
        }
        if view.settings() != mine {
            return Ok(Agreement::Conflict(format!(
                "node {:?} uses this bucket with {}; this node has {}: G4 deletes nothing \
                 until every node's [g4] capacity_bytes and ttl_ms agree",
                view.node_id,
                describe(view.settings()),
                describe(mine)
            )));
        }
    }
    Ok(Agreement::Agreed)
}

/// Every view that has not expired (this node's included), or why they
/// cannot all be read (which vetoes a sweep).
pub(crate) async fn read_live(
    inner: &Inner,
) -> Result<std::result::Result<Vec<LifecycleView>, String>> {
    let now = now_ms();
    let mut live = Vec::new();
    let mut list = inner.store.list(Some(&inner.lifecycle_root));
    let mut seen = 0usize;
    while let Some(m) = list.next().await {
        let m = m.map_err(|e| inner.err("list", &inner.lifecycle_root, &e))?;
        seen += 1;
        if seen > VIEWS_MAX {
            return Ok(Err(format!(
                "more than {VIEWS_MAX} lifecycle views under {}: not read",
                inner.lifecycle_root
            )));
        }
        if m.size > VIEW_BYTES_MAX {
            return Ok(Err(format!(
                "lifecycle view {} is {} bytes (at most {VIEW_BYTES_MAX}): not read",
                m.location, m.size
            )));
        }
        let bytes = match inner.store.get(&m.location).await {
            Ok(r) => r.bytes().await,
            Err(e) => Err(e),
        };
        let bytes = match bytes {
            Ok(b) => b,
            // Gone between the listing and the read: it no longer counts.
            Err(object_store::Error::NotFound { .. }) => continue,
            Err(e) => return Err(inner.err("get", &m.location, &e)),
        };
        let view: LifecycleView = match serde_json::from_slice(&bytes) {
            Ok(v) => v,
            Err(e) => {
                return Ok(Err(format!(
                    "lifecycle view {} is not readable ({e})",
                    m.location
                )))
            }
        };
        if view.expires_unix_ms >= now {
            live.push(view);
        }
    }
    Ok(Ok(live))
}

/// Publishes this node's view now and every `lifecycle_refresh_ms` until
/// the store is dropped. Every node does, those without a lifecycle too:
/// their view is their veto.
pub(crate) fn spawn_publisher(inner: &std::sync::Arc<Inner>) {
    let weak = std::sync::Arc::downgrade(inner);
    let every = std::time::Duration::from_millis(inner.cfg.lifecycle_refresh_ms.max(100));
    inner.handle.spawn(async move {
        loop {
            let Some(inner) = weak.upgrade() else { return };
            if let Err(e) = publish(&inner).await {
                tracing::debug!(error = %e, "G4 lifecycle view not written (retried)");
            }
            drop(inner);
            tokio::time::sleep(every).await;
        }
    });
}
