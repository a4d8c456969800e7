//! Mooncake-format request traces (JSONL), as replayed by `kvtier bench replay`.
//!
//! One JSON object per line: `timestamp` (ms), `input_length` and
//! `output_length` (tokens), `hash_ids` (the request's block chain, root
//! first; equal ids mean equal prefixes).

use crate::base::error::{Error, Result};
use serde::Deserialize;
use std::collections::HashSet;
use std::path::Path;

/// Longest line accepted: a request beyond this is a corrupt trace, not a
/// prompt (1M tokens of 16-token blocks is ~1.2 MB of ids).
pub const LINE_BYTES_MAX: usize = 16 << 20;

/// What an engine can tell about a request's blocks (optional in a trace:
/// Mooncake's traces have none). The replay hands them to the policy with
/// each stored block, as kvtierd does with the hints of a `put`.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct RequestHints {
    /// The last this many blocks of the request are ephemeral (reasoning
    /// tokens dropped from the next prompt, a partial last block the next
    /// turn re-tokenises, a one-shot batch document).
    pub ephemeral_tail_blocks: u32,
    /// Priority of the request's stored blocks (0 = normal).
    pub priority: u8,
    /// Expected reuses of the request's stored blocks (0 = unknown).
    pub expected_reuse: u16,
}

impl RequestHints {
    /// The hints of block `index` of a request of `len` blocks.
    pub fn for_block(&self, index: usize, len: usize) -> kvtier_client::Hints {
        let tail = (self.ephemeral_tail_blocks as usize).min(len);
        kvtier_client::Hints {
            priority: self.priority,
            pinned: false,
            ephemeral: index >= len - tail,
            expected_reuse: self.expected_reuse,
        }
    }
}

/// One request of a trace.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
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
    /// Engine hints for the request's blocks, if the trace carries them.
    #[serde(default)]
    pub hints: Option<RequestHints>,
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

    /// Whether any request carries engine hints.
    pub fn has_hints(&self) -> bool {
        self.requests.iter().any(|r| r.hints.is_some())
    }

    /// The same trace with every engine hint removed (what a policy sees
    /// from an engine that sets none).
    pub fn without_hints(&self) -> Self {
        let mut t = self.clone();
        for r in &mut t.requests {
            r.hints = None;
        }
        t
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
        // Engine hints are optional per request; unknown fields of them are
        // defaults, the tail is clamped to the request's length.
        let h =
            Trace::parse("{\"hash_ids\": [1, 2, 3], \"hints\": {\"ephemeral_tail_blocks\": 9}}")
                .unwrap();
        let hints = h.requests[0].hints.unwrap();
        assert!((0..3).all(|i| hints.for_block(i, 3).ephemeral));
        let h = Trace::parse(
            "{\"hash_ids\": [1, 2], \"hints\": {\"ephemeral_tail_blocks\": 1, \"priority\": 2}}",
        )
        .unwrap();
        let hints = h.requests[0].hints.unwrap();
        assert!(!hints.for_block(0, 2).ephemeral && hints.for_block(1, 2).ephemeral);
        assert_eq!(hints.for_block(0, 2).priority, 2);
        assert!(t.requests[0].hints.is_none() && !t.has_hints());
    }
}
