//! What the daemon counts per client namespace, and which engine and model
//! each namespace belongs to (`OP_DESCRIBE`), for the operator: `kvtier
//! stats` (the `namespaces` list), `kvtier ls` and the `kvtier_client_*`
//! families on `/metrics`.
//!
//! Bounded: at most [`NAMESPACES_MAX`] namespaces are kept, each with a
//! description of at most 32 + 256 bytes (the wire's bounds). A namespace
//! gets its entry when a connector describes it or when a block is first
//! stored in it, never from a lookup or an onboard alone (a caller naming
//! random namespaces cannot push the real ones out); what cannot have an
//! entry, past the bound or never described nor stored to, is counted
//! under `namespace="other"`. So `/metrics` carries at most
//! `NAMESPACES_MAX + 1` label sets per family. Kept in memory: connectors
//! describe their namespaces again when they start.

use kvtier_client::NamespaceId;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntCounterVec, Opts};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Namespaces kept (counted and described) at once.
pub const NAMESPACES_MAX: usize = 256;

/// One namespace's figures (all since the daemon started).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NsCounts {
    /// Lookup requests.
    pub lookups: u64,
    /// Blocks of looked-up chains found (the cached prefixes).
    pub lookup_hit_blocks: u64,
    /// Blocks of looked-up chains past the cached prefix.
    pub lookup_miss_blocks: u64,
    /// Onboarded blocks served.
    pub onboard_hit_blocks: u64,
    /// Onboarded blocks not served (absent, corrupt, unavailable, refused).
    pub onboard_miss_blocks: u64,
    /// Payload bytes onboarded.
    pub onboard_bytes: u64,
    /// Blocks newly stored.
    pub offload_blocks: u64,
    /// Payload bytes newly stored.
    pub offload_bytes: u64,
    /// Blocks a client reported corrupt after its own verification.
    pub reported_corrupt_blocks: u64,
}

impl NsCounts {
    fn add(&mut self, o: &NsCounts) {
        self.lookups += o.lookups;
        self.lookup_hit_blocks += o.lookup_hit_blocks;
        self.lookup_miss_blocks += o.lookup_miss_blocks;
        self.onboard_hit_blocks += o.onboard_hit_blocks;
        self.onboard_miss_blocks += o.onboard_miss_blocks;
        self.onboard_bytes += o.onboard_bytes;
        self.offload_blocks += o.offload_blocks;
        self.offload_bytes += o.offload_bytes;
        self.reported_corrupt_blocks += o.reported_corrupt_blocks;
    }
}

/// Which engine and model a namespace belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Description {
    /// The engine (`vllm`, `sglang`, `lmcache`, ...).
    pub engine: String,
    /// The model (at most 256 bytes).
    pub model: String,
}

/// One namespace's entry.
#[derive(Debug, Clone, Default)]
pub struct NsEntry {
    /// Its description, once a connector gave one.
    pub description: Option<Description>,
    /// Its figures.
    pub counts: NsCounts,
}

/// Why a description was not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DescribeRefused {
    /// [`NAMESPACES_MAX`] namespaces are kept already.
    Full,
}

#[derive(Default)]
struct Inner {
    entries: BTreeMap<NamespaceId, NsEntry>,
    other: NsCounts,
}

/// The per-namespace figures and descriptions of one daemon.
#[derive(Default)]
pub struct ClientStats {
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for ClientStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientStats")
    }
}

impl ClientStats {
    /// Empty.
    pub fn new() -> Self {
        Self::default()
    }

    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        // A panic while holding the lock leaves plain counters behind:
        // keep counting rather than lose the figures.
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    /// Adds `delta` to `ns`'s figures; `create`: give `ns` an entry if it
    /// has none and there is room (a block was stored in it).
    pub fn count(&self, ns: &NamespaceId, create: bool, delta: NsCounts) {
        self.with(|i| {
            let room = i.entries.len() < NAMESPACES_MAX;
            if let Some(e) = i.entries.get_mut(ns) {
                e.counts.add(&delta);
            } else if create && room {
                i.entries.insert(
                    *ns,
                    NsEntry {
                        description: None,
                        counts: delta,
                    },
                );
            } else {
                i.other.add(&delta);
            }
        });
    }

    /// Records `ns`'s engine and model (a later description replaces it).
    pub fn describe(&self, ns: &NamespaceId, d: Description) -> Result<(), DescribeRefused> {
        self.with(|i| {
            if let Some(e) = i.entries.get_mut(ns) {
                e.description = Some(d);
                return Ok(());
            }
            if i.entries.len() >= NAMESPACES_MAX {
                return Err(DescribeRefused::Full);
            }
            i.entries.insert(
                *ns,
                NsEntry {
                    description: Some(d),
                    counts: NsCounts::default(),
                },
            );
            Ok(())
        })
    }

    /// Every kept namespace in id order, and the figures counted under
    /// `other`.
    pub fn snapshot(&self) -> (Vec<(NamespaceId, NsEntry)>, NsCounts) {
        self.with(|i| {
            (
                i.entries.iter().map(|(k, v)| (*k, v.clone())).collect(),
                i.other,
            )
        })
    }

    /// The `namespaces` list of the stats JSON.
    pub fn json(&self) -> serde_json::Value {
        let (entries, other) = self.snapshot();
        let row = |id: String, d: Option<&Description>, c: &NsCounts| {
            serde_json::json!({
                "id": id,
                "engine": d.map(|d| d.engine.as_str()),
                "model": d.map(|d| d.model.as_str()),
                "lookups": c.lookups,
                "lookup_hit_blocks": c.lookup_hit_blocks,
                "lookup_miss_blocks": c.lookup_miss_blocks,
                "onboard_hit_blocks": c.onboard_hit_blocks,
                "onboard_miss_blocks": c.onboard_miss_blocks,
                "onboard_bytes": c.onboard_bytes,
                "offload_blocks": c.offload_blocks,
                "offload_bytes": c.offload_bytes,
                "reported_corrupt_blocks": c.reported_corrupt_blocks,
            })
        };
        let mut v: Vec<serde_json::Value> = entries
            .iter()
            .map(|(id, e)| row(id.to_hex(), e.description.as_ref(), &e.counts))
            .collect();
        if other != NsCounts::default() {
            v.push(row("other".into(), None, &other));
        }
        serde_json::Value::Array(v)
    }
}

/// (family, help, extra label and its value, the figure)
type Family = (
    &'static str,
    &'static str,
    Option<(&'static str, &'static str)>,
    fn(&NsCounts) -> u64,
);

const FAMILIES: &[Family] = &[
    (
        "kvtier_client_lookups_total",
        "Lookup requests, by namespace (with its engine and model when described)",
        None,
        |c| c.lookups,
    ),
    (
        "kvtier_client_lookup_blocks_total",
        "Blocks of looked-up chains, by namespace and result (hit: in the cached prefix, miss: past it)",
        Some(("result", "hit")),
        |c| c.lookup_hit_blocks,
    ),
    (
        "kvtier_client_lookup_blocks_total",
        "",
        Some(("result", "miss")),
        |c| c.lookup_miss_blocks,
    ),
    (
        "kvtier_client_onboard_blocks_total",
        "Onboarded blocks, by namespace and result (hit: served, miss: absent, corrupt, unavailable or refused)",
        Some(("result", "hit")),
        |c| c.onboard_hit_blocks,
    ),
    (
        "kvtier_client_onboard_blocks_total",
        "",
        Some(("result", "miss")),
        |c| c.onboard_miss_blocks,
    ),
    (
        "kvtier_client_onboard_bytes_total",
        "Payload bytes onboarded, by namespace",
        None,
        |c| c.onboard_bytes,
    ),
    (
        "kvtier_client_offload_blocks_total",
        "Blocks newly stored, by namespace",
        None,
        |c| c.offload_blocks,
    ),
    (
        "kvtier_client_offload_bytes_total",
        "Payload bytes newly stored, by namespace",
        None,
        |c| c.offload_bytes,
    ),
    (
        "kvtier_client_reported_corrupt_blocks_total",
        "Blocks a client reported corrupt after its own verification, by namespace",
        None,
        |c| c.reported_corrupt_blocks,
    ),
];

/// The `kvtier_client_*` families, built afresh at each scrape from
/// [`ClientStats`] (so a namespace described again does not leave its old
/// labels behind).
pub struct ClientCollector {
    stats: std::sync::Arc<ClientStats>,
    descs: Vec<Desc>,
}

fn family_vec(name: &str) -> prometheus::Result<IntCounterVec> {
    let (help, extra) = FAMILIES
        .iter()
        .find(|f| f.0 == name && !f.1.is_empty())
        .map(|f| (f.1, f.2))
        .unwrap_or(("", None));
    let mut labels = vec!["namespace", "engine", "model"];
    if let Some((l, _)) = extra {
        labels.push(l);
    }
    IntCounterVec::new(Opts::new(name, help), &labels)
}

fn family_names() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = FAMILIES.iter().map(|f| f.0).collect();
    names.dedup();
    names
}

impl ClientCollector {
    /// A collector of `stats`.
    pub fn new(stats: std::sync::Arc<ClientStats>) -> prometheus::Result<Self> {
        let mut descs = Vec::new();
        for n in family_names() {
            descs.extend(family_vec(n)?.desc().into_iter().cloned());
        }
        Ok(ClientCollector { stats, descs })
    }
}

impl Collector for ClientCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let (entries, other) = self.stats.snapshot();
        let mut rows: Vec<(String, &str, &str, &NsCounts)> = entries
            .iter()
            .map(|(id, e)| {
                let (engine, model) = match &e.description {
                    Some(d) => (d.engine.as_str(), d.model.as_str()),
                    None => ("", ""),
                };
                (id.to_hex(), engine, model, &e.counts)
            })
            .collect();
        rows.push(("other".into(), "", "", &other));
        let mut out = Vec::new();
        for name in family_names() {
            let Ok(v) = family_vec(name) else { continue };
            for f in FAMILIES.iter().filter(|f| f.0 == name) {
                for (id, engine, model, c) in &rows {
                    let mut labels = vec![id.as_str(), engine, model];
                    if let Some((_, val)) = f.2 {
                        labels.push(val);
                    }
                    v.with_label_values(&labels).inc_by(f.3(c));
                }
            }
            out.extend(v.collect());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ns(i: u32) -> NamespaceId {
        let mut b = [0u8; 16];
        b[..4].copy_from_slice(&i.to_le_bytes());
        NamespaceId(b)
    }

    fn d(engine: &str) -> Description {
        Description {
            engine: engine.into(),
            model: "m".into(),
        }
    }

    #[test]
    fn lookups_alone_never_create_entries_and_the_bound_holds() {
        let s = ClientStats::new();
        let one = NsCounts {
            lookups: 1,
            ..Default::default()
        };
        for i in 0..10 {
            s.count(&ns(i), false, one);
        }
        let (e, other) = s.snapshot();
        assert!(e.is_empty());
        assert_eq!(other.lookups, 10);
        for i in 0..(NAMESPACES_MAX as u32 + 5) {
            s.count(&ns(i), true, one);
        }
        let (e, other) = s.snapshot();
        assert_eq!(e.len(), NAMESPACES_MAX);
        assert_eq!(other.lookups, 15);
        assert_eq!(
            s.describe(&ns(NAMESPACES_MAX as u32 + 1), d("vllm")),
            Err(DescribeRefused::Full)
        );
        // A kept namespace may be described (again) when full.
        assert_eq!(s.describe(&ns(0), d("vllm")), Ok(()));
        assert_eq!(s.describe(&ns(0), d("sglang")), Ok(()));
        let (e, _) = s.snapshot();
        assert_eq!(e[0].1.description.as_ref().unwrap().engine, "sglang");
    }

    #[test]
    fn the_collector_renders_one_label_set_per_namespace_and_other() {
        let s = std::sync::Arc::new(ClientStats::new());
        s.describe(&ns(1), d("lmcache")).unwrap();
        s.count(
            &ns(1),
            false,
            NsCounts {
                lookups: 2,
                lookup_hit_blocks: 3,
                ..Default::default()
            },
        );
        let c = ClientCollector::new(s.clone()).unwrap();
        let r = prometheus::Registry::new();
        r.register(Box::new(c)).unwrap();
        let fams = r.gather();
        let lookups = fams
            .iter()
            .find(|f| f.name() == "kvtier_client_lookups_total")
            .unwrap();
        assert_eq!(lookups.get_metric().len(), 2);
        let blocks = fams
            .iter()
            .find(|f| f.name() == "kvtier_client_lookup_blocks_total")
            .unwrap();
        assert_eq!(blocks.get_metric().len(), 4);
        s.describe(&ns(1), d("vllm")).unwrap();
        let fams = r.gather();
        let lookups = fams
            .iter()
            .find(|f| f.name() == "kvtier_client_lookups_total")
            .unwrap();
        assert_eq!(lookups.get_metric().len(), 2, "the old labels are gone");
    }
}
