//! Per-block outcomes as values: a miss is a result with a reason, never an
//! exception.

use kvtier_client::{LookupResult, Miss, MissCause, OffloadOutcome, Onboarded};
use pyo3::prelude::*;

pub(crate) fn cause_name(c: MissCause) -> &'static str {
    c.name()
}

/// The outcome of one block of an offload or onboard. True when it
/// succeeded.
///
/// status: "hit" (onboarded), "stored", "stored_unpinned" (stored, but its
/// pin was refused: the pin budget is spent), "already_present"
/// (offloaded), or "miss" (recompute / not stored). reason (misses only): "absent",
/// "corrupt", "unavailable", "timeout", "refused", "no_space", "storage",
/// "too_large". tier (hits only): "g3", "peer" or "g4". nbytes: payload
/// bytes written (hits). route (onboards into device memory): how the
/// bytes reached it, "two_hop" (pinned bounce buffers, asynchronous
/// copies) or "direct" (GPUDirect Storage); detail then says why a direct
/// read fell back, if it did.
#[pyclass(module = "kvtier", frozen, get_all)]
#[derive(Clone)]
pub(crate) struct BlockResult {
    pub ok: bool,
    pub status: &'static str,
    pub tier: Option<&'static str>,
    pub nbytes: u64,
    pub reason: Option<&'static str>,
    pub detail: String,
    pub route: Option<&'static str>,
}

impl BlockResult {
    pub(crate) fn miss(m: &Miss) -> Self {
        BlockResult {
            ok: false,
            status: "miss",
            tier: None,
            nbytes: 0,
            reason: Some(cause_name(m.cause)),
            detail: m.detail.clone(),
            route: None,
        }
    }
    /// An outcome this binding does not know: never counted as a success.
    fn unknown(detail: String) -> Self {
        BlockResult {
            ok: false,
            status: "miss",
            tier: None,
            nbytes: 0,
            reason: Some("storage"),
            detail,
            route: None,
        }
    }
    pub(crate) fn onboarded(o: &Onboarded) -> Self {
        match o {
            Onboarded::Hit { tier, payload_len } => BlockResult {
                ok: true,
                status: "hit",
                tier: Some(tier.name()),
                nbytes: *payload_len,
                reason: None,
                detail: String::new(),
                route: None,
            },
            Onboarded::Miss(m) => Self::miss(m),
            // An outcome newer than this binding: not a hit, so a miss
            // the engine recomputes.
            other => Self::unknown(format!("{other:?}")),
        }
    }
    /// With the route of a device onboard's hit (and why a direct read
    /// fell back, if it did).
    pub(crate) fn with_outcome(mut self, o: Option<&kvtier_gds::Outcome>) -> Self {
        if let (true, Some(o)) = (self.ok, o) {
            self.route = Some(o.route.name());
            if let Some(f) = &o.fallback {
                self.detail = format!("{} fell back: {f}", o.planned.name());
            }
        }
        self
    }

    pub(crate) fn offloaded(o: &OffloadOutcome) -> Self {
        let ok = |status| BlockResult {
            ok: true,
            status,
            tier: None,
            nbytes: 0,
            reason: None,
            detail: String::new(),
            route: None,
        };
        match o {
            OffloadOutcome::Stored => ok("stored"),
            OffloadOutcome::StoredUnpinned => ok("stored_unpinned"),
            OffloadOutcome::AlreadyPresent => ok("already_present"),
            OffloadOutcome::Failed(m) => Self::miss(m),
            other => Self::unknown(format!("{other:?}")),
        }
    }
}

#[pymethods]
impl BlockResult {
    fn __bool__(&self) -> bool {
        self.ok
    }
    fn __repr__(&self) -> String {
        match (self.tier, self.reason) {
            (Some(t), _) => format!(
                "BlockResult({}, tier={t:?}, nbytes={})",
                self.status, self.nbytes
            ),
            (None, Some(r)) => format!("BlockResult(miss, reason={r:?}, detail={:?})", self.detail),
            _ => format!("BlockResult({})", self.status),
        }
    }
}

/// The result of a lookup: how many leading blocks of the chain are cached
/// (`prefix_len`, also `len()`), the tier of each ("g3", "peer", "g4"), and
/// `reason`/`detail` when the lookup itself missed (daemon unavailable,
/// timeout): then the prefix is empty.
#[pyclass(module = "kvtier", frozen, get_all)]
pub(crate) struct Lookup {
    pub prefix_len: usize,
    pub tiers: Vec<&'static str>,
    pub reason: Option<&'static str>,
    pub detail: String,
}

impl Lookup {
    pub(crate) fn from(r: &LookupResult) -> Self {
        Lookup {
            prefix_len: r.prefix_len(),
            tiers: r.tiers.iter().map(|t| t.name()).collect(),
            reason: r.miss.as_ref().map(|m| cause_name(m.cause)),
            detail: r
                .miss
                .as_ref()
                .map(|m| m.detail.clone())
                .unwrap_or_default(),
        }
    }
}

#[pymethods]
impl Lookup {
    fn __len__(&self) -> usize {
        self.prefix_len
    }
    fn __repr__(&self) -> String {
        match self.reason {
            Some(r) => format!(
                "Lookup(prefix_len=0, reason={r:?}, detail={:?})",
                self.detail
            ),
            None => format!(
                "Lookup(prefix_len={}, tiers={:?})",
                self.prefix_len, self.tiers
            ),
        }
    }
}
