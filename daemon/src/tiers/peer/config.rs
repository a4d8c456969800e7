//! The `[peer]` section of the daemon's TOML config, with working defaults,
//! and the conversion into the server, client and peer-set settings.
//!
//! ```toml
//! [peer]
//! enabled = true
//! node_id = "gpu-node-07"
//! bind = "10.0.0.7:7401"
//! secret_file = "/etc/kvtier/peer.secret"
//! peers = [{ id = "gpu-node-08", address = "10.0.0.8:7401" }]
//! ```

use super::client::PeerClientConfig;
use super::server::PeerServerConfig;
use super::set::PeerSetConfig;
use super::{validate_address, validate_node_id, PeerInfo};
use crate::base::error::{Error, Result};
use std::net::SocketAddr;
use std::path::PathBuf;

/// Settings of the peer subsystem.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PeerConfig {
    /// Serve and fetch peer blocks at all.
    pub enabled: bool,
    /// This node's id; the integrator defaults it to the hostname.
    pub node_id: Option<String>,
    /// Address of the peer server; loopback by default.
    pub bind: SocketAddr,
    /// Address other nodes use to reach this one (heartbeats); defaults to
    /// the bound address.
    pub advertise: Option<String>,
    /// File holding the shared secret (mode 0600 or stricter).
    pub secret_file: Option<PathBuf>,
    /// Static peers.
    pub peers: Vec<PeerInfo>,
    /// Publish and read heartbeats under `nodes/` in G4.
    pub discovery: bool,
    /// Heartbeat refresh period.
    pub heartbeat_period_ms: u64,
    /// Heartbeat lifetime (at least 3 periods advised).
    pub heartbeat_ttl_ms: u64,
    /// Concurrent transfers served.
    pub transfers_max: usize,
    /// Open connections served.
    pub connections_max: usize,
    /// Allowed clock difference for request signatures.
    pub clock_skew_ms: u64,
    /// Time a new connection to the peer server has to send its first
    /// byte.
    pub first_byte_timeout_ms: u64,
    /// Accepted request signatures remembered to refuse replays.
    pub replay_cache_max: usize,
    /// Peers asked per lookup.
    pub fanout_max: usize,
    /// Time given to one peer per lookup.
    pub per_peer_timeout_ms: u64,
    /// TCP connect timeout.
    pub connect_timeout_ms: u64,
    /// Skip time for an unreachable peer.
    pub down_backoff_ms: u64,
    /// Skip time for a peer that sent corrupt bytes.
    pub corrupt_quarantine_ms: u64,
    /// Largest block file accepted from a peer (a size).
    #[serde(deserialize_with = "crate::base::units::de_size")]
    pub block_bytes_max: u64,
    /// Period of fetching each peer's holdings digest; 0 turns digests
    /// off (lookups then probe every block).
    pub holdings_refresh_ms: u64,
    /// Largest holdings digest this node serves and accepts (0: digests
    /// neither served nor fetched); past it a digest's false-positive rate
    /// rises instead. A size.
    #[serde(deserialize_with = "crate::base::units::de_size")]
    pub holdings_bytes_max: u64,
    /// Confirm a block a peer's digest does not list with a header probe.
    pub holdings_probe_negatives: bool,
}

impl Default for PeerConfig {
    fn default() -> Self {
        let s = PeerServerConfig::new(Vec::new());
        let c = PeerClientConfig::new(Vec::new());
        let p = PeerSetConfig::new("");
        PeerConfig {
            enabled: false,
            node_id: None,
            bind: SocketAddr::from(([127, 0, 0, 1], 7401)),
            advertise: None,
            secret_file: None,
            peers: Vec::new(),
            discovery: true,
            heartbeat_period_ms: 10_000,
            heartbeat_ttl_ms: 30_000,
            transfers_max: s.transfers_max,
            connections_max: s.connections_max,
            clock_skew_ms: s.clock_skew_ms,
            first_byte_timeout_ms: s.first_byte_timeout_ms,
            replay_cache_max: s.replay_cache_max,
            fanout_max: p.fanout_max,
            per_peer_timeout_ms: p.per_peer_timeout_ms,
            connect_timeout_ms: c.connect_timeout_ms,
            down_backoff_ms: p.down_backoff_ms,
            corrupt_quarantine_ms: p.corrupt_quarantine_ms,
            block_bytes_max: c.block_bytes_max,
            holdings_refresh_ms: p.holdings_refresh_ms,
            holdings_bytes_max: p.holdings_bytes_max,
            holdings_probe_negatives: p.holdings_probe_negatives,
        }
    }
}

fn cfg_err(key: &str, problem: impl Into<String>) -> Error {
    Error::Config {
        key: format!("peer.{key}"),
        problem: problem.into(),
    }
}

impl PeerConfig {
    /// Checks ids, addresses and timing relations.
    pub fn validate(&self) -> Result<()> {
        if let Some(id) = &self.node_id {
            validate_node_id(id)?;
        }
        if let Some(a) = &self.advertise {
            validate_address(a)?;
        }
        for p in &self.peers {
            PeerInfo::new(p.id.clone(), p.address.clone())?;
        }
        if self.heartbeat_period_ms == 0 || self.heartbeat_ttl_ms <= self.heartbeat_period_ms {
            return Err(cfg_err(
                "heartbeat_ttl_ms",
                "must exceed heartbeat_period_ms (3x is advised)",
            ));
        }
        if self.holdings_refresh_ms != 0 && self.holdings_refresh_ms < 100 {
            return Err(cfg_err(
                "holdings_refresh_ms",
                "must be 0 (no digests) or at least 100",
            ));
        }
        if self.holdings_bytes_max != 0
            && !(super::holdings::DIGEST_BYTES_MIN..=(64 << 20)).contains(&self.holdings_bytes_max)
        {
            return Err(cfg_err(
                "holdings_bytes_max",
                "must be 0 (serve no digest) or 4096 to 67108864 (64 MiB)",
            ));
        }
        if self.enabled && self.secret_file.is_none() {
            return Err(cfg_err(
                "secret_file",
                "required when peers are enabled: a file with at least 16 random bytes, the same on every node",
            ));
        }
        Ok(())
    }

    /// Reads the shared secret (trailing whitespace trimmed). Refuses a
    /// file that group or others can read.
    pub fn read_secret(&self) -> Result<Vec<u8>> {
        use std::os::unix::fs::PermissionsExt;
        let path = self
            .secret_file
            .as_ref()
            .ok_or_else(|| cfg_err("secret_file", "not set"))?;
        let meta = std::fs::metadata(path).map_err(|e| Error::io("reading", path, e))?;
        if meta.permissions().mode() & 0o077 != 0 {
            return Err(cfg_err(
                "secret_file",
                format!(
                    "{} is readable by group or others; chmod 600 it",
                    path.display()
                ),
            ));
        }
        let mut s = std::fs::read(path).map_err(|e| Error::io("reading", path, e))?;
        while s.last().is_some_and(|b| b.is_ascii_whitespace()) {
            s.pop();
        }
        super::auth::PeerKey::from_secret(&s)?;
        Ok(s)
    }

    /// Server settings.
    pub fn server_config(&self, secret: Vec<u8>) -> PeerServerConfig {
        let mut s = PeerServerConfig::new(secret);
        s.bind = self.bind;
        s.transfers_max = self.transfers_max;
        s.connections_max = self.connections_max;
        s.clock_skew_ms = self.clock_skew_ms;
        s.first_byte_timeout_ms = self.first_byte_timeout_ms;
        s.replay_cache_max = self.replay_cache_max;
        s.holdings_bytes_max = self.holdings_bytes_max;
        // Peers refresh at this period: half of it keeps one build per
        // period when several peers ask.
        s.holdings_cache_ms = self.holdings_refresh_ms / 2;
        s
    }

    /// Client settings.
    pub fn client_config(&self, secret: Vec<u8>) -> PeerClientConfig {
        let mut c = PeerClientConfig::new(secret);
        c.connect_timeout_ms = self.connect_timeout_ms;
        c.block_bytes_max = self.block_bytes_max;
        c
    }

    /// Peer-set settings for node `self_id`.
    pub fn set_config(&self, self_id: &str) -> PeerSetConfig {
        let mut p = PeerSetConfig::new(self_id);
        p.static_peers = self.peers.clone();
        p.fanout_max = self.fanout_max;
        p.per_peer_timeout_ms = self.per_peer_timeout_ms;
        p.down_backoff_ms = self.down_backoff_ms;
        p.corrupt_quarantine_ms = self.corrupt_quarantine_ms;
        p.holdings_refresh_ms = self.holdings_refresh_ms;
        p.holdings_bytes_max = self.holdings_bytes_max;
        p.holdings_probe_negatives = self.holdings_probe_negatives;
        p
    }

    /// The address to publish in heartbeats, given where the server bound.
    pub fn advertised_address(&self, bound: SocketAddr) -> String {
        self.advertise.clone().unwrap_or_else(|| bound.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn defaults_are_safe_and_toml_parses() {
        let d = PeerConfig::default();
        assert!(d.bind.ip().is_loopback());
        assert!(!d.enabled);
        d.validate().unwrap();
        let c: PeerConfig = toml::from_str(
            r#"
            enabled = true
            node_id = "gpu-07"
            bind = "10.0.0.7:7401"
            secret_file = "/etc/kvtier/peer.secret"
            peers = [{ id = "gpu-08", address = "10.0.0.8:7401" }]
            fanout_max = 2
            "#,
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(c.set_config("gpu-07").static_peers[0].id, "gpu-08");
        assert_eq!(
            c.server_config(vec![1; 16]).bind.to_string(),
            "10.0.0.7:7401"
        );
        assert!(toml::from_str::<PeerConfig>("typo_key = 1").is_err());
        let no_secret: PeerConfig = toml::from_str("enabled = true").unwrap();
        assert!(no_secret.validate().is_err());
        let bad_peer: PeerConfig =
            toml::from_str(r#"peers = [{ id = "../x", address = "h:1" }]"#).unwrap();
        assert!(bad_peer.validate().is_err());
        // Holdings digests: on by default, bounded, and the server caches a
        // build for half the refresh period.
        assert_eq!(d.holdings_refresh_ms, 2_000);
        assert_eq!(d.server_config(vec![1; 16]).holdings_cache_ms, 1_000);
        for (t, ok) in [
            ("holdings_refresh_ms = 0", true),
            ("holdings_refresh_ms = 50", false),
            ("holdings_bytes_max = 0", true),
            ("holdings_bytes_max = 100", false),
            ("holdings_bytes_max = 134217728", false),
            ("holdings_probe_negatives = false", true),
        ] {
            let c: PeerConfig = toml::from_str(t).unwrap();
            assert_eq!(c.validate().is_ok(), ok, "{t}");
        }
    }

    #[test]
    fn secret_file_must_be_private_and_long_enough() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "0123456789abcdef0123\n").unwrap();
        let cfg = PeerConfig {
            secret_file: Some(path.clone()),
            ..PeerConfig::default()
        };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(cfg.read_secret().is_err());
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(cfg.read_secret().unwrap(), b"0123456789abcdef0123");
        std::fs::write(&path, "short\n").unwrap();
        assert!(cfg.read_secret().is_err());
    }
}
