//! Mooncake-format request traces (JSONL), as replayed by `kvtier bench replay`.
//!
//! One JSON object per line: `timestamp` (ms), `input_length` and
//! `output_length` (tokens), `hash_ids` (the request's block chain, root
//! first; equal ids mean equal prefixes).

use crate::error::{Error, Result};
use serde::Deserialize;
use std::collections::HashSet;
use std::path::Path;

/// Longest line accepted: a request beyond this is a corrupt trace, not a
/// prompt (1M tokens of 16-token blocks is ~1.2 MB of ids).
pub const LINE_BYTES_MAX: usize = 16 << 20;

/// One request of a trace.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Request {
    /// Arrival time in milliseconds.
    #[serde(default)]
    pub timestamp: u64,
    /// Prompt tokens.
    #[serde(default)]
    pub input_length: u64,
    /// Generated tokens.
    #[serde(default)]
    pub output_length: u64,
    /// The prompt's block chain, root first.
    pub hash_ids: Vec<u64>,
}

/// A whole trace in memory.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    /// Requests in arrival order.
    pub requests: Vec<Request>,
}

impl Trace {
    /// Parses JSONL text; blank lines are skipped.
    pub fn parse(text: &str) -> Result<Self> {
        let mut requests = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            if line.len() > LINE_BYTES_MAX {
                return Err(Error::LimitReached {
                    what: "trace line bytes",
                    limit: LINE_BYTES_MAX as u64,
                });
            }
            let r: Request = serde_json::from_str(line).map_err(|e| Error::InvalidInput {
                what: "trace line",
                reason: format!(
                    "line {}: {e} (expected Mooncake JSONL with hash_ids)",
                    n + 1
                ),
            })?;
            requests.push(r);
        }
        Ok(Self { requests })
    }

    /// Reads and parses a JSONL file.
    pub fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|e| Error::io("reading trace", path, e))?;
        Self::parse(&text)
    }

    /// Number of distinct block ids.
    pub fn distinct_blocks(&self) -> u64 {
        let set: HashSet<u64> = self
            .requests
            .iter()
            .flat_map(|r| r.hash_ids.iter().copied())
            .collect();
        set.len() as u64
    }

    /// Block requests in total.
    pub fn requested_blocks(&self) -> u64 {
        self.requests.iter().map(|r| r.hash_ids.len() as u64).sum()
    }

    /// The hit ratio with infinite capacity: every block after its first use.
    pub fn ceiling_hit_ratio(&self) -> f64 {
        let mut seen = HashSet::new();
        let mut hits = 0u64;
        for r in &self.requests {
            let lead = r
                .hash_ids
                .iter()
                .take_while(|id| seen.contains(*id))
                .count();
            hits += lead as u64;
            seen.extend(r.hash_ids.iter().copied());
        }
        ratio(hits, self.requested_blocks())
    }
}

/// `num / den`, 0 when `den` is 0.
pub fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_computes_ceiling() {
        let t = Trace::parse(
            "{\"timestamp\": 0, \"input_length\": 3, \"output_length\": 1, \"hash_ids\": [1, 2]}\n\n\
             {\"timestamp\": 5, \"input_length\": 3, \"output_length\": 1, \"hash_ids\": [1, 2, 3]}\n",
        )
        .unwrap();
        assert_eq!(t.requests.len(), 2);
        assert_eq!(t.distinct_blocks(), 3);
        assert_eq!(t.requested_blocks(), 5);
        assert!((t.ceiling_hit_ratio() - 0.4).abs() < 1e-12);
        assert!(Trace::parse("{\"hash_ids\": \"x\"}").is_err());
    }
}
