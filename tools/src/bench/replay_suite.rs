//! `kvtier bench replay --suite`: the default policy on the held-out
//! traces (daemon/src/tiers/policy/synth.rs, evaluation seeds unless `--seeds
//! tune`) and on a real trace when `--trace` is given, per capacity: LRU
//! (the baseline), default, Belady (the bound), and the share of the
//! LRU-Belady gap the default closes; for traces that carry engine hints
//! (`Request::hints`), the default once without them (the policy alone,
//! `hit_ratio`, `gap_closed`, which the targets are judged on) and once
//! with them (`hit_ratio_hinted`, `gap_closed_hinted`).

use anyhow::{bail, Result};
use kvtier_daemon::tiers::policy::replay::{capacity_for_fraction, replay_dry, PolicyKind};
use kvtier_daemon::tiers::policy::synth::{Shape, EVAL_SEEDS, TUNE_SEEDS};
use kvtier_daemon::tiers::policy::trace::Trace;
use serde_json::{json, Value};

/// Capacities of the suite, as fractions of each trace's distinct blocks.
pub const FRACTIONS: [f64; 3] = [0.05, 0.10, 0.25];

/// Targets of issue #19: never below LRU by more than this.
pub const MAX_LOSS_VS_LRU: f64 = 0.003;
/// ... and at least this share of the LRU-Belady gap at 5% and 10%.
pub const MIN_GAP_CLOSED: f64 = 0.25;

/// Which seeds of the synthetic shapes to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeedSet {
    /// The held-out seeds (reported figures).
    Eval,
    /// The seeds a policy may be tuned on.
    Tune,
}

impl std::str::FromStr for SeedSet {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "eval" => Ok(Self::Eval),
            "tune" => Ok(Self::Tune),
            _ => Err(format!("unknown seed set `{s}` (eval | tune)")),
        }
    }
}

/// One trace of the suite, with its label.
pub struct SuiteTrace {
    /// `shape/seed` or the file name.
    pub name: String,
    /// `eval`, `tune` or `real`.
    pub split: &'static str,
    /// The requests.
    pub trace: Trace,
}

/// The traces of the suite.
pub fn traces(seeds: SeedSet, requests: usize, real: Option<(String, Trace)>) -> Vec<SuiteTrace> {
    let (set, split): (&[u64], _) = match seeds {
        SeedSet::Eval => (&EVAL_SEEDS, "eval"),
        SeedSet::Tune => (&TUNE_SEEDS, "tune"),
    };
    let mut out = Vec::new();
    if let Some((name, trace)) = real {
        out.push(SuiteTrace {
            name,
            split: "real",
            trace,
        });
    }
    for shape in Shape::ALL {
        for &seed in set {
            out.push(SuiteTrace {
                name: format!("{}/{seed}", shape.name()),
                split,
                trace: shape.generate(seed, requests),
            });
        }
    }
    out
}

/// Replays every trace at every capacity; the report as one JSON value.
pub fn run(traces: &[SuiteTrace], fractions: &[f64]) -> Result<Value> {
    if traces.is_empty() {
        bail!("the suite has no traces");
    }
    let mut rows = Vec::new();
    let mut worst_loss = f64::NEG_INFINITY;
    let mut worst_gap_closed = f64::INFINITY;
    let mut misses = Vec::new();
    for t in traces {
        for &f in fractions {
            let cap = capacity_for_fraction(&t.trace, f);
            let lru = replay_dry(&t.trace, PolicyKind::Lru, cap)?.hit_ratio();
            // Without engine hints (the policy alone), and with the hints
            // the trace carries (an engine that sets them), separately.
            let def = replay_dry(&t.trace.without_hints(), PolicyKind::Default, cap)?.hit_ratio();
            let hinted = if t.trace.has_hints() {
                Some(replay_dry(&t.trace, PolicyKind::Default, cap)?.hit_ratio())
            } else {
                None
            };
            let bel = replay_dry(&t.trace, PolicyKind::Belady, cap)?.hit_ratio();
            let gap = bel - lru;
            // A gap under 0.005 is noise: there is nothing to close.
            let closed_by = |hr: f64| (gap > 0.005).then(|| (hr - lru) / gap);
            let closed = closed_by(def);
            let closed_hinted = hinted.and_then(closed_by);
            worst_loss = worst_loss.max(lru - def);
            if let Some(h) = hinted {
                worst_loss = worst_loss.max(lru - h);
            }
            let gated = f <= 0.10 + 1e-9;
            if let (true, Some(c)) = (gated, closed) {
                worst_gap_closed = worst_gap_closed.min(c);
            }
            let meets = lru - def <= MAX_LOSS_VS_LRU
                && (!gated || closed.is_none_or(|c| c >= MIN_GAP_CLOSED));
            if !meets {
                misses.push(format!("{} at {f}", t.name));
            }
            rows.push(json!({
                "trace": t.name,
                "split": t.split,
                "requests": t.trace.requests.len(),
                "capacity_fraction": f,
                "capacity_blocks": cap,
                "ceiling_hit_ratio": t.trace.ceiling_hit_ratio(),
                "hit_ratio": def,
                "hit_ratio_baseline": lru,
                "hit_ratio_vs_baseline": if lru > 0.0 { def / lru } else { 0.0 },
                "hit_ratio_belady": bel,
                "gap_closed": closed,
                "meets_targets": meets,
                "hit_ratio_hinted": hinted,
                "gap_closed_hinted": closed_hinted,
                "meets_targets_hinted": hinted.map(|h| lru - h <= MAX_LOSS_VS_LRU
                    && (!gated || closed_hinted.is_none_or(|c| c >= MIN_GAP_CLOSED))),
            }));
        }
    }
    Ok(json!({
        "policy": "default",
        "baseline_policy": "lru",
        "bound_policy": "belady",
        "fractions": fractions,
        "rows": rows,
        "worst_loss_vs_lru": worst_loss,
        "worst_gap_closed_at_5_10": if worst_gap_closed.is_finite() { json!(worst_gap_closed) } else { Value::Null },
        "targets": {
            "max_loss_vs_lru": MAX_LOSS_VS_LRU,
            "min_gap_closed_at_5_10": MIN_GAP_CLOSED,
        },
        "missed_targets": misses,
    }))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn tiny_suite_has_the_contract() {
        let ts = traces(SeedSet::Tune, 300, None);
        assert_eq!(ts.len(), Shape::ALL.len() * TUNE_SEEDS.len());
        let r = run(&ts[..2], &[0.1]).unwrap();
        let rows = r["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 2);
        for row in rows {
            for k in [
                "hit_ratio",
                "hit_ratio_baseline",
                "hit_ratio_vs_baseline",
                "hit_ratio_belady",
                "gap_closed",
                "ceiling_hit_ratio",
            ] {
                assert!(row.get(k).is_some(), "missing {k} in {row}");
            }
            let (def, bel) = (
                row["hit_ratio"].as_f64().unwrap(),
                row["hit_ratio_belady"].as_f64().unwrap(),
            );
            assert!(bel + 1e-9 >= def, "{row}");
        }
        assert!(r.get("worst_loss_vs_lru").is_some());
        assert!(run(&[], &[0.1]).is_err());
    }
}
