//! Peers: serve this node's G3 block files to other daemons, and fetch
//! blocks that another node holds.
//!
//! The pieces, each in its own file:
//! - [`source`]: what the server streams from ([`PeerSource`], implemented by
//!   the G3 store; [`DirSource`] serves a plain directory for tests).
//! - [`wire`]: the one URL scheme (`GET /v1/blocks/<ns-hex32>/<key-hex>`) and
//!   its strict parser, plus `Range` parsing.
//! - [`auth`]: the shared-secret request signature (`kvtier-hmac`).
//! - [`config`]: the `[peer]` TOML section and its conversions.
//! - [`server`]: the HTTP/1.1 peer server (bounded, streamed, authenticated).
//! - [`client`]: one verified fetch from one peer, with typed outcomes.
//! - [`discovery`]: heartbeat objects under `nodes/` in the shared object
//!   store, and the static peer list.
//! - [`placement`]: rendezvous hashing that orders peers for a key.
//! - [`set`]: [`PeerSet`], which asks the likely peers in order within a
//!   deadline and returns the first verified hit.
//! - [`holdings`]: the holdings digest (a Bloom filter of the blocks a
//!   node holds) its server publishes and the set fetches, so lookups
//!   answer "on peer X" without a probe per block.
//! - [`bench`]: measurement helpers for `kvtier bench crossnode`.
//!
//! Invariant: bytes received from a peer are returned only after the header,
//! the exact length, the namespace, the key and the payload checksum matched.

pub mod auth;
#[cfg(any(test, feature = "bench"))]
pub mod bench;
pub mod client;
pub mod config;
pub mod discovery;
pub mod holdings;
pub mod placement;
pub mod replay;
pub mod server;
pub mod set;
pub mod source;
pub mod wire;

pub use client::{
    PeerClient, PeerClientConfig, PeerFetch, PeerMetrics, PeerMetricsSnapshot, PeerMiss,
};
pub use config::PeerConfig;
pub use discovery::{Heartbeat, HeartbeatTask};
pub use server::{PeerServer, PeerServerConfig};
pub use set::{PeerAttempt, PeerLookup, PeerSet, PeerSetConfig};
pub use source::{DirSource, PeerSource};

use crate::base::error::{Error, Result};

/// Longest node id accepted, in bytes.
pub const NODE_ID_BYTES_MAX: usize = 64;

/// A peer daemon: its stable node id and its peer-server address.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct PeerInfo {
    /// Stable node id (see [`validate_node_id`]).
    pub id: String,
    /// `host:port` of its peer server.
    pub address: String,
}

impl PeerInfo {
    /// A peer after validating its id and address.
    pub fn new(id: impl Into<String>, address: impl Into<String>) -> Result<Self> {
        let p = PeerInfo {
            id: id.into(),
            address: address.into(),
        };
        validate_node_id(&p.id)?;
        validate_address(&p.address)?;
        Ok(p)
    }
}

/// Checks a node id: 1 to 64 bytes of `[A-Za-z0-9._-]`, not starting with a
/// dot. Node ids become object names (`nodes/<id>.json`), so nothing that
/// could change the path is accepted.
pub fn validate_node_id(id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id.len() <= NODE_ID_BYTES_MAX
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidInput {
            what: "node id",
            reason: format!(
                "{:?}: use 1 to {NODE_ID_BYTES_MAX} characters of A-Z a-z 0-9 . _ -, not starting with a dot",
                id.chars().take(80).collect::<String>()
            ),
        })
    }
}

/// Checks a peer address: `host:port`, at most 255 bytes, printable ASCII
/// without spaces or `/` (it becomes an HTTP `Host` header).
pub fn validate_address(addr: &str) -> Result<()> {
    let printable = addr
        .bytes()
        .all(|b| b.is_ascii_graphic() && b != b'/' && b != b'@');
    let has_port = addr
        .rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p != 0));
    if !addr.is_empty() && addr.len() <= 255 && printable && has_port {
        Ok(())
    } else {
        Err(Error::InvalidInput {
            what: "peer address",
            reason: format!(
                "{:?}: expected host:port, e.g. 10.0.0.7:7401",
                addr.chars().take(80).collect::<String>()
            ),
        })
    }
}

/// Milliseconds since the Unix epoch (0 if the clock is before 1970).
pub fn unix_ms_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids() {
        for ok in ["a", "node-1", "n.2_x", &"x".repeat(64)] {
            validate_node_id(ok).unwrap();
        }
        for bad in ["", ".", "..", "a/b", "a b", "é", &"x".repeat(65), ".hidden"] {
            assert!(validate_node_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn addresses() {
        for ok in ["127.0.0.1:7401", "node-a.internal:80", "[::1]:7401"] {
            validate_address(ok).unwrap();
        }
        for bad in [
            "",
            "host",
            "host:0",
            "host:99999",
            ":80",
            "a b:1",
            "x/y:1",
            "u@h:1",
        ] {
            assert!(validate_address(bad).is_err(), "{bad:?}");
        }
    }
}
