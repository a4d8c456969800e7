//! kvtierd's configuration: a TOML file, overridden by flags, over an
//! embedded laptop default.
//!
//! Unknown keys are refused (a typo must not silently fall back to a
//! default), and every value is checked by [`Config::validate`], whose error
//! names the key and the problem. Sizes accept integers or strings like
//! `"4GiB"`. The integrator adds `[g4]`, `[mount]` and `[peers]` sections.

use crate::base::error::{Error, Result};
use crate::base::units::{de_size, de_size_opt};
use crate::edges::mount::MountSection;
use kvtier_client::NamespaceId;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The annotated default, printed by `kvtierd --print-default-config`.
/// The two paths that depend on who runs kvtierd (the socket and g3.dir,
/// under the data directory) are commented out, so that a file printed by
/// one user and run by another (root printing for a service user) does not
/// carry the first one's home directory.
pub const DEFAULT_TOML: &str = r#"# kvtierd configuration. Every key is optional; these are the defaults.
# The data directory is the running user's: $XDG_STATE_HOME/kvtier, else
# ~/.local/state/kvtier, else ./kvtier-data.

[server]
# Unix socket the client library connects to. Unset: kvtierd.sock in the
# data directory; a node service puts it in /run (see deploy/).
# socket = "/run/kvtier/kvtierd.sock"
# Permission bits of the socket (octal string). 0660: owner and group.
socket_mode = "0660"
# Group owning the socket (e.g. the group your inference workers run as).
# socket_group = "kvtier"
# Connections served at once; one more is answered BUSY and closed.
max_connections = 1024
# A connection that sends nothing for this long is closed (the client
# reconnects by itself).
idle_timeout_ms = 600000
# A new connection must send its hello within this long, and one uid may
# have at most this many connections that have not (silent connections
# cannot hold the slots).
hello_timeout_ms = 5000
hellos_per_uid_max = 64
# Deadline for sending one reply to a client.
io_timeout_ms = 5000
# Largest shared region one client may register.
region_bytes_max = "4GiB"
# Leases one connection may hold, and the longest lease.
leases_per_conn_max = 4096
lease_ttl_max_ms = 30000
# Block reads one onboard request runs at once (the disk sees a request's
# blocks together; the G3 ring pool, io_depth, bounds what reaches it).
onboard_reads_in_flight_max = 16
# G3's slotted hits of an onboard request read together on its connection's
# thread, one io_uring batch (false: each on its own reader, as before).
onboard_batch_reads = true
# Pins held at once, and the longest pin.
pins_max = 65536
pin_ttl_max_ms = 3600000

[g3]
# Local NVMe tier: where block files live. Unset: g3 in the data directory.
# dir = "/var/lib/kvtier/g3"
# Bytes kept before eviction.
capacity = "4GiB"
# Eviction policy: "default" (prefix-, frequency- and hint-aware) or "lru".
policy = "default"
# Eviction starts above high_watermark x capacity and stops below low.
high_watermark = 0.95
low_watermark = 0.85
# I/O engine: "auto" (io_uring, falling back to pread), "uring", "pread".
engine = "auto"
# How an offloaded block's data is made durable before its ack:
# "per_block" (O_DSYNC writes up to 1 MiB, else an fdatasync per file;
# concurrent flushes are merged by the kernel) or "group" (opt-in, measured
# no faster here: one syncfs shared by every block written when it begins, across
# requests and clients; a disk without FUA pays one cache flush per window
# instead of one per block; it flushes every dirty page of that filesystem,
# so G3 on a filesystem of its own keeps it short; without O_DIRECT or on
# filesystems whose syncfs is not trusted to reach the disk, e.g. FUSE or
# NFS, G3 uses per_block and logs it).
data_flush = "per_block"
# Blocks that failed verification are kept in quarantine/ for inspection,
# oldest deleted first past either bound; their bytes count against
# capacity. Unset quarantine_max: capacity / 32.
# quarantine_max = "128MiB"
quarantine_max_files = 256
# Evicted block files kept in recycle/ for later offloads of the same size
# to overwrite in place (no new extents, no directory fsync before the
# ack); counted against capacity, at most half of it. "0" turns it off.
# Unset: capacity / 2. recycle_max_files bounds the files (a start after
# a crash reads one header per pooled file).
# recycle_max = "2GiB"
recycle_max_files = 4096
# Evicted files whose retirement is not yet durable still hold their
# block: a start after a crash verifies each in full and puts it back.
# Past this many bytes of them the pool is made durable at once.
recycle_unsettled_max = "256MiB"
# Blocks whose file (4 KiB header + payload, padded to 4 KiB) is at most
# this long live in slots of shared slab files under slots/: one data
# flush per group of writers, no file create, rename or directory fsync
# per block, a read is one positioned read. Larger blocks keep a file of
# their own (the mount hands those to the kernel for passthrough reads).
# "0": every block has its own file. At most "64MiB".
slot_max = "4MiB"
# The last block of each offload batch stays an open tail this long: the
# rest of its request may still come, so the background pass never evicts
# it and a pass that must make room takes it only when nothing else may
# go. 0: no open tails (a replay that must decide as a dry run does).
open_tail_grace_ms = 10000
# Background scrub: every block is re-read and verified at this average
# rate (bytes per second; "0" turns it off), a corrupt copy quarantined and
# replaced from G4 or a peer. A pass starts scrub_pause_ms after the last
# one ended (and after start-up). 16MiB/s is about 0.5% of an NVMe's read
# bandwidth; a pass over 1 TiB takes about 18 hours.
scrub_bytes_per_s = "16MiB"
scrub_pause_ms = 3600000

[g4]
# Shared tier: s3://bucket/prefix, file:///path or memory://. "" disables
# G4. Unset: file://<g3.dir>/../g4, a local G4 beside G3.
# url = "s3://kvtier/prod"
# endpoint = "http://127.0.0.1:8333"   # non-AWS stores
# region = "us-east-1"
# allow_http = true                     # plain-HTTP local servers
# path_style = true                     # MinIO, SeaweedFS
# Credentials: the standard AWS_* environment variables, or
# access_key_id / secret_access_key here (never logged). Without keys,
# requests go unsigned and G4 reports degraded; the cloud's instance
# credentials (metadata address 169.254.169.254) only with:
# credentials = "instance"
# Timeouts (docs/OPERATIONS.md): response_timeout_ms, body_idle_timeout_ms,
# connect_timeout_ms; circuit breaker: breaker_failures_max, breaker_open_ms.
# Which blocks are written through: "all" or "after-first-reuse".
admission = "all"
# Every other G4 setting may be set here too (docs/OPERATIONS.md lists
# them), e.g. capacity_bytes, ttl_ms, upload_queue_max, upload_retries,
# request_timeout_ms, fetch_inflight_max, exists_ttl_ms.

[peer]
# Serve blocks to, and fetch from, other kvtierd nodes (off by default).
enabled = false
# node_id = "gpu-node-07"              # defaults to the hostname
# bind = "127.0.0.1:7401"              # never 0.0.0.0 unless you mean it
# secret_file = "/etc/kvtier/peer.secret"
# peers = [{ id = "gpu-node-08", address = "10.0.0.8:7401" }]
# discovery = true                     # heartbeats under <g4>/nodes/

[node]
# How long a lookup may ask peers and G4 about blocks past the local prefix.
lookup_remote_deadline_ms = 200
# How long an onboard may spend fetching one block from peers and G4.
fetch_deadline_ms = 10000
# Fetched blocks are served at once and kept in G3 in the background: bytes
# waiting at most, and promotions queued at most (a full queue serves the
# block without keeping it; 0 never keeps fetched blocks).
staged_bytes_max = "256MiB"
promote_queue_max = 64

[events]
# The NVIDIA Dynamo worker id this node's events carry in Dynamo's form
# (`kvtier events --format dynamo`; docs/OPERATIONS.md). Unset: derived
# stably from the node id (peer.node_id, else the hostname). 0 is refused.
# dynamo_worker_id = 1001

[events.zmq]
# KV events on vLLM's ZMQ wire, for a Dynamo router (docs/OPERATIONS.md).
# Off while endpoint is "". tcp:// must be loopback unless
# allow_non_loopback = true (the events carry token ids); ipc:// paths are
# guarded by file permissions.
endpoint = ""
# ROUTER socket answering replay requests for missed sequence numbers.
replay_endpoint = ""
# Permission bits of ipc:// socket files (owner only by default). With
# [[tenants]], only ipc:// endpoints are accepted.
ipc_mode = "0600"
topic = ""
replay_batches_max = 10000
# Blocks a start-up announces (after AllBlocksCleared) at most.
announce_blocks_max = 1000000
# dp_rank = 0
# An empty batch after this long without one, so a subscriber that
# reconnected across a restart (or lost batches) sees the sequence gap and
# asks the replay socket at once; 0: none.
heartbeat_ms = 1000
# How tiers are named: "vllm" (vLLM 0.33's storage tiers: medium STORAGE,
# locality LOCAL for G3 and REMOTE for G4) or "dynamo" (DISK for G3,
# EXTERNAL for G4: Dynamo 1.6.1 drops REMOTE events, so a Dynamo router
# counts G4 only in this form).
media = "vllm"
# Namespaces published, with the Dynamo salt and LoRA name their workers use:
# [[events.zmq.namespaces]]
# id = "0123456789abcdef0123456789abcdef"
# salt = ""
# lora_name = ""

[metrics]
# Prometheus /metrics and /healthz; "" disables the endpoint.
addr = "127.0.0.1:9477"

[log]
# tracing filter (RUST_LOG syntax); RUST_LOG overrides it.
level = "info"
# "text" (colour only on a terminal) or "json" (one object per line).
format = "text"

[mount]
# FUSE view of the store (docs/FS.md); "" = not mounted. --mount DIR overrides.
dir = ""
# Let users other than the daemon's in (needs root or user_allow_other).
allow_other = false
# Refuse imports (cp), rm and setfattr with EROFS.
read_only = false
# Owner shown for files and directories (default: the daemon's uid/gid).
# uid = 1000
# gid = 1000
# Permission bits of block files and directories (octal strings).
file_mode = "0444"
dir_mode = "0755"
# FUSE passthrough (kernel reads block files directly): auto | off | required.
passthrough = "auto"
# Verify a block's checksum once at open (a buffered read that also warms
# the page cache for the passthrough read). Off: passthrough reads are not
# checksummed by kvtier (the fallback path always verifies).
verify_on_open = true

# Tenants (docs/OPERATIONS.md, "Security"). Without any, whoever can open
# the socket (its mode and group) may use every namespace. With them, a
# uid/gid may use only its tenants' namespaces; others are refused.
# [[tenants]]
# name = "team-a"
# uids = [1001]
# gids = []
# namespaces = ["<32 hex digits from `kvtier hash`>"]
[access]
# Admins: every namespace, list of all, stats. Unset: root and the daemon's uid.
# admin_uids = [0]
admin_gids = []
# Per-uid shares (unset: a quarter of the global bound; onboards 8;
# without tenants, connections and event subscriptions: half of each).
# connections_per_uid_max = 256
# subscribers_per_uid_max = 16
# onboards_per_uid_max = 8
# leases_per_uid_max = 16384
# pins_per_uid_max = 16384
# Bytes of blocks one uid may hold leased (unset with tenants: a quarter of
# g3.capacity), so re-leasing cannot keep the cache from eviction.
# lease_bytes_per_uid_max = "1GiB"
# Namespaces holding blocks one uid (not root) may have offloaded into
# (unset without tenants: 1024): each costs directories on the disk.
# namespaces_per_uid_max = 1024
# Kept for admins (admin_uids / admin_gids, with or without tenants): the
# others together never take the last connections and subscriptions
# (connections unset: 8, at most an eighth of server.max_connections).
# admin_connections_reserved = 8
# admin_subscribers_reserved = 4
# Bytes of blocks one tenant (one uid without tenants) may hold pinned, by
# pin requests and offloads with the pin hint (unset with tenants: an
# eighth of g3.capacity, a quarter of G3's pin budget; without: unbounded).
# pin_bytes_per_tenant_max = "1GiB"
"#;

/// `[server]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSection {
    /// Socket path.
    pub socket: PathBuf,
    /// Octal permission bits.
    pub socket_mode: String,
    /// Owning group.
    pub socket_group: Option<String>,
    /// Connections at once.
    pub max_connections: usize,
    /// Idle close.
    pub idle_timeout_ms: u64,
    /// Deadline for a new connection's hello.
    pub hello_timeout_ms: u64,
    /// Connections of one uid before their hello.
    pub hellos_per_uid_max: usize,
    /// Reply send deadline.
    pub io_timeout_ms: u64,
    /// Largest client region.
    #[serde(deserialize_with = "de_size")]
    pub region_bytes_max: u64,
    /// Leases per connection.
    pub leases_per_conn_max: usize,
    /// Block reads one onboard request runs at once.
    pub onboard_reads_in_flight_max: usize,
    /// G3's slotted hits of a request read as one batch (server/onboard.rs).
    pub onboard_batch_reads: bool,
    /// Longest lease.
    pub lease_ttl_max_ms: u32,
    /// Pins at once.
    pub pins_max: usize,
    /// Longest pin.
    pub pin_ttl_max_ms: u32,
}

/// `[g3]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct G3Section {
    /// Directory of block files.
    pub dir: PathBuf,
    /// Capacity.
    #[serde(deserialize_with = "de_size")]
    pub capacity: u64,
    /// Eviction policy (`default`, `lru`).
    pub policy: String,
    /// Eviction starts above this fraction of capacity.
    pub high_watermark: f64,
    /// Eviction stops below this fraction.
    pub low_watermark: f64,
    /// I/O engine (`auto`, `uring`, `pread`).
    pub engine: String,
    /// Data flush before an offload's ack (`group`, `per_block`).
    pub data_flush: String,
    /// Bytes `quarantine/` may hold (`None`: capacity / 32).
    #[serde(deserialize_with = "de_size_opt")]
    pub quarantine_max: Option<u64>,
    /// Files `quarantine/` may hold.
    pub quarantine_max_files: usize,
    /// Bytes of evicted files `recycle/` may keep (`None`: capacity / 2;
    /// 0: off).
    #[serde(deserialize_with = "de_size_opt")]
    pub recycle_max: Option<u64>,
    /// Files `recycle/` may keep (bounds the headers a start after a
    /// crash reads).
    pub recycle_max_files: usize,
    /// Bytes of pooled files not yet made durable as room (bounds what a
    /// start after a crash verifies in full).
    #[serde(deserialize_with = "de_size")]
    pub recycle_unsettled_max: u64,
    /// Largest block file kept in a slab slot (g3/slots.rs; 0: none).
    #[serde(deserialize_with = "de_size")]
    pub slot_max: u64,
    /// How long the last block of a batch stays an open tail, in ms
    /// (g3/spare.rs; 0: none).
    pub open_tail_grace_ms: u64,
    /// Average read rate of the background scrub, bytes per second (0:
    /// off; node/scrub.rs).
    #[serde(deserialize_with = "de_size")]
    pub scrub_bytes_per_s: u64,
    /// Time between scrub passes (and from start-up to the first).
    pub scrub_pause_ms: u64,
}

/// `[g4]`: every key of [`G4Config`](crate::tiers::g4::G4Config) (one source for
/// names and defaults: sweeper, retries, timeouts, caches), plus how `url`
/// is read here and the admission rule. `Debug` redacts the credentials
/// (through `G4Config`'s), so a logged config never carries them.
#[derive(Clone, Debug)]
pub struct G4Section {
    /// Store URL; `None`: `file://<g3.dir>/../g4`; `""`: G4 off.
    pub url: Option<String>,
    /// The rest of the tier's settings (its own `url` is replaced by the
    /// one above).
    pub store: crate::tiers::g4::G4Config,
    /// `all` or `after-first-reuse`.
    pub admission: String,
}

impl Default for G4Section {
    fn default() -> Self {
        G4Section {
            url: None,
            store: crate::tiers::g4::G4Config::default(),
            admission: "all".into(),
        }
    }
}

// serde's `flatten` cannot be combined with `deny_unknown_fields`, so the
// two keys of this section's own are taken out of the table by hand and the
// rest goes to `G4Config`, whose `deny_unknown_fields` refuses typos.
impl<'de> Deserialize<'de> for G4Section {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let mut table = toml::Table::deserialize(d)?;
        let mut text = |key: &str| match table.remove(key) {
            None => Ok(None),
            Some(toml::Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(D::Error::custom(format!(
                "`g4.{key}` must be a string, not a {}",
                v.type_str()
            ))),
        };
        let url = text("url")?;
        let admission = text("admission")?.unwrap_or_else(|| "all".into());
        let store = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| {
                // toml ends a field's message with "in `key`": name the key first
                // (`g4.key: ...`), which also lets the file's error find its line.
                let msg = e.to_string();
                let msg = msg.trim();
                match msg.rsplit_once("\nin `") {
                    Some((m, key)) => {
                        D::Error::custom(format!("g4.{}: {}", key.trim_end_matches('`'), m.trim()))
                    }
                    None => D::Error::custom(format!("[g4]: {msg}")),
                }
            })?;
        Ok(G4Section {
            url,
            store,
            admission,
        })
    }
}

impl G4Section {
    /// The G4 config, or `None` when G4 is off. `g3_dir` places the
    /// default local G4 beside G3.
    pub fn to_g4_config(&self, g3_dir: &Path) -> Option<crate::tiers::g4::G4Config> {
        let url = match &self.url {
            Some(u) if u.is_empty() => return None,
            Some(u) => u.clone(),
            None => {
                let base = g3_dir.parent().unwrap_or(g3_dir);
                let abs = std::path::absolute(base.join("g4")).unwrap_or(base.join("g4"));
                format!("file://{}", abs.display())
            }
        };
        Some(crate::tiers::g4::G4Config {
            url,
            ..self.store.clone()
        })
    }
}

/// `[node]`: how a node reaches past its own G3 (peers, then G4).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeSection {
    /// Time a lookup may spend asking peers and G4 about blocks past the
    /// local prefix.
    pub lookup_remote_deadline_ms: u64,
    /// Time an onboard may spend fetching one block from peers and G4.
    pub fetch_deadline_ms: u64,
    /// Bytes of fetched blocks held in memory at most while they wait for
    /// their background promotion into G3.
    #[serde(deserialize_with = "de_size")]
    pub staged_bytes_max: u64,
    /// Promotions waiting at most; a fetched block that finds the queue
    /// full is served but not kept in G3 (0: never keep fetched blocks).
    pub promote_queue_max: usize,
}

impl Default for NodeSection {
    fn default() -> Self {
        let n = crate::node::NodeConfig::new(crate::tiers::g3::G3Config::new(PathBuf::new(), 0));
        NodeSection {
            lookup_remote_deadline_ms: n.lookup_remote_deadline_ms,
            fetch_deadline_ms: n.fetch_deadline_ms,
            staged_bytes_max: n.staged_bytes_max,
            promote_queue_max: n.promote_queue_max,
        }
    }
}

/// `[events]`: the KV event stream's Dynamo identity.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventsSection {
    /// Dynamo worker id; `None`: derived from the node id.
    pub dynamo_worker_id: Option<u64>,
    /// `[events.zmq]`: the ZMQ publisher Dynamo's router listens to.
    pub zmq: ZmqSection,
}

/// `[events.zmq]`: KV events on vLLM's ZMQ wire for a Dynamo router
/// (docs/OPERATIONS.md). Off while `endpoint` is empty.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ZmqSection {
    /// PUB endpoint (`tcp://127.0.0.1:5557`, `ipc:///run/kvtier/kv.sock`);
    /// empty: no publisher.
    pub endpoint: String,
    /// ROUTER endpoint answering replay requests for missed sequence
    /// numbers; empty: none.
    pub replay_endpoint: String,
    /// Topic frame of every message.
    pub topic: String,
    /// Batches kept for replay.
    pub replay_batches_max: usize,
    /// Blocks a start-up (or a replay older than the kept batches)
    /// announces at most.
    pub announce_blocks_max: usize,
    /// `data_parallel_rank` of every batch (unset: nil, the listener's own).
    pub dp_rank: Option<u32>,
    /// An empty batch after this long without a batch (0: none): a
    /// subscriber that missed batches, or reconnected across a restart,
    /// sees the gap without waiting for the next store.
    pub heartbeat_ms: u64,
    /// Allow a TCP endpoint on an address other than loopback (the events
    /// carry token ids, as sensitive as the KV itself).
    pub allow_non_loopback: bool,
    /// Permission bits of `ipc://` socket files (octal string; default
    /// owner only: give the router's user access, e.g. `0660` with a
    /// setgid directory of its group).
    pub ipc_mode: String,
    /// How tiers are named on the wire: `"vllm"` (STORAGE with locality
    /// LOCAL for G3 and REMOTE for G4, as vLLM 0.33's own storage tiers
    /// publish) or `"dynamo"` (DISK / EXTERNAL, no locality: Dynamo 1.6.1
    /// drops REMOTE events, so its router counts G4 only in this form).
    pub media: String,
    /// The namespaces published, with the Dynamo salt and LoRA name their
    /// workers hash with (other namespaces never appear on this stream).
    pub namespaces: Vec<ZmqNamespace>,
}

impl Default for ZmqSection {
    fn default() -> Self {
        ZmqSection {
            endpoint: String::new(),
            replay_endpoint: String::new(),
            topic: String::new(),
            replay_batches_max: 10_000,
            announce_blocks_max: 1_000_000,
            dp_rank: None,
            heartbeat_ms: 1000,
            allow_non_loopback: false,
            ipc_mode: "0600".into(),
            media: "vllm".into(),
            namespaces: Vec::new(),
        }
    }
}

/// `[[events.zmq.namespaces]]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ZmqNamespace {
    /// kvtier namespace id (32 hex digits; `kvtier ls` shows them).
    pub id: String,
    /// Dynamo's cache salt ("" none): the namespace's tenant salt.
    #[serde(default)]
    pub salt: String,
    /// Dynamo's LoRA name ("" none): the namespace's adapter.
    #[serde(default)]
    pub lora_name: String,
}

impl ZmqSection {
    /// Whether a publisher runs.
    pub fn enabled(&self) -> bool {
        !self.endpoint.is_empty()
    }

    /// `ipc_mode` as bits.
    pub fn ipc_mode_bits(&self) -> Result<u32> {
        u32::from_str_radix(self.ipc_mode.trim_start_matches("0o"), 8)
            .ok()
            .filter(|m| *m <= 0o777)
            .ok_or_else(|| bad("events.zmq.ipc_mode", "not an octal mode like \"0660\""))
    }

    /// `media` as the wire's form.
    pub fn media(&self) -> Result<crate::edges::zmq::wire::Media> {
        crate::edges::zmq::wire::Media::parse(&self.media).ok_or_else(|| {
            bad(
                "events.zmq.media",
                format!(
                    "{:?} is not a medium form: \"vllm\" (STORAGE + LOCAL/REMOTE) or \"dynamo\" (DISK/EXTERNAL)",
                    self.media
                ),
            )
        })
    }

    fn validate(&self) -> Result<()> {
        if !self.enabled() {
            return Ok(());
        }
        self.ipc_mode_bits()?;
        self.media()?;
        check_zmq_endpoint(
            "events.zmq.endpoint",
            &self.endpoint,
            self.allow_non_loopback,
        )?;
        if !self.replay_endpoint.is_empty() {
            check_zmq_endpoint(
                "events.zmq.replay_endpoint",
                &self.replay_endpoint,
                self.allow_non_loopback,
            )?;
        }
        if self.replay_batches_max == 0 || self.replay_batches_max > 1_000_000 {
            return Err(bad(
                "events.zmq.replay_batches_max",
                "must be between 1 and 1000000",
            ));
        }
        if self.heartbeat_ms > 3_600_000 {
            return Err(bad(
                "events.zmq.heartbeat_ms",
                "must be at most 3600000 (0: no heartbeat)",
            ));
        }
        if self.namespaces.is_empty() {
            return Err(bad(
                "events.zmq.namespaces",
                "name at least one namespace to publish ([[events.zmq.namespaces]] with id, salt, lora_name)",
            ));
        }
        for n in &self.namespaces {
            NamespaceId::from_hex(&n.id).map_err(|_| {
                bad(
                    "events.zmq.namespaces.id",
                    format!(
                        "{:?} is not a namespace id (32 hex digits, as `kvtier ls` prints)",
                        n.id
                    ),
                )
            })?;
        }
        Ok(())
    }
}

/// `tcp://host:port` (loopback unless allowed) or `ipc://path`.
fn check_zmq_endpoint(key: &str, ep: &str, allow_non_loopback: bool) -> Result<()> {
    if let Some(path) = ep.strip_prefix("ipc://") {
        if path.is_empty() {
            return Err(bad(key, "ipc:// needs a path"));
        }
        return Ok(());
    }
    let Some(addr) = ep.strip_prefix("tcp://") else {
        return Err(bad(
            key,
            format!("{ep:?}: use tcp://HOST:PORT or ipc://PATH"),
        ));
    };
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(bad(key, format!("{ep:?}: missing :PORT")));
    };
    port.parse::<u16>()
        .map_err(|_| bad(key, format!("{ep:?}: {port:?} is not a port")))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ip: std::net::IpAddr = host.parse().map_err(|_| {
        bad(
            key,
            format!("{ep:?}: the host must be an IP address (a name could resolve anywhere)"),
        )
    })?;
    if !ip.is_loopback() && !allow_non_loopback {
        return Err(bad(
            key,
            format!(
                "{ep:?} is not loopback; events carry token ids, so set events.zmq.allow_non_loopback = true to publish beyond this host"
            ),
        ));
    }
    Ok(())
}

impl EventsSection {
    /// The worker id to announce: the configured one, else a stable hash
    /// of `node_id` (never 0, which means "none").
    pub fn worker_id(&self, node_id: &str) -> u64 {
        self.dynamo_worker_id.unwrap_or_else(|| {
            let h = xxhash_rust::xxh3::xxh3_64(format!("kvtier-node:{node_id}").as_bytes());
            // Dynamo's Python side reads ids as signed 64-bit too: keep
            // them positive.
            (h & (i64::MAX as u64)).max(1)
        })
    }
}

/// `[metrics]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsSection {
    /// Listen address; empty disables.
    pub addr: String,
}

/// `[log]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogSection {
    /// tracing filter.
    pub level: String,
    /// `text` or `json`.
    pub format: String,
}

/// The whole configuration.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `[server]`.
    pub server: ServerSection,
    /// `[g3]`.
    pub g3: G3Section,
    /// `[g4]`.
    pub g4: G4Section,
    /// `[node]`.
    pub node: NodeSection,
    /// `[peer]`.
    pub peer: crate::tiers::peer::PeerConfig,
    /// `[events]`.
    pub events: EventsSection,
    /// `[metrics]`.
    pub metrics: MetricsSection,
    /// `[log]`.
    pub log: LogSection,
    /// `[mount]`.
    pub mount: MountSection,
    /// `[[tenants]]`: who may use which namespaces (none: single-tenant).
    pub tenants: Vec<crate::edges::access::TenantConfig>,
    /// `[access]`: admins and per-uid limits.
    pub access: crate::edges::access::AccessSection,
}

/// The default data directory: `$XDG_STATE_HOME/kvtier`, else
/// `~/.local/state/kvtier`, else `./kvtier-data`.
pub fn default_data_dir() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_STATE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(x).join("kvtier");
    }
    if let Some(h) = std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(h).join(".local/state/kvtier");
    }
    PathBuf::from("./kvtier-data")
}

impl Default for ServerSection {
    fn default() -> Self {
        ServerSection {
            socket: default_data_dir().join("kvtierd.sock"),
            socket_mode: "0660".into(),
            socket_group: None,
            max_connections: 1024,
            idle_timeout_ms: 600_000,
            hello_timeout_ms: 5_000,
            hellos_per_uid_max: 64,
            io_timeout_ms: 5_000,
            region_bytes_max: 4 << 30,
            leases_per_conn_max: 4096,
            onboard_reads_in_flight_max: crate::edges::server::ONBOARD_READS_IN_FLIGHT_DEFAULT,
            onboard_batch_reads: true,
            lease_ttl_max_ms: 30_000,
            pins_max: 65536,
            pin_ttl_max_ms: 3_600_000,
        }
    }
}

impl Default for G3Section {
    fn default() -> Self {
        G3Section {
            dir: default_data_dir().join("g3"),
            capacity: 4 << 30,
            policy: "default".into(),
            high_watermark: 0.95,
            low_watermark: 0.85,
            engine: "auto".into(),
            data_flush: "per_block".into(),
            quarantine_max: None,
            quarantine_max_files: 256,
            recycle_max: None,
            recycle_max_files: 4096,
            recycle_unsettled_max: 256 << 20,
            slot_max: 4 << 20,
            open_tail_grace_ms: 10_000,
            scrub_bytes_per_s: 16 << 20,
            scrub_pause_ms: 3_600_000,
        }
    }
}

impl Default for MetricsSection {
    fn default() -> Self {
        MetricsSection {
            addr: "127.0.0.1:9477".into(),
        }
    }
}

impl Default for LogSection {
    fn default() -> Self {
        LogSection {
            level: "info".into(),
            format: "text".into(),
        }
    }
}

/// Sections read by hand (`[g4]`) report the span of their whole table; for
/// an unknown key or a bad value (`g4.key: ...`), the line that spells the
/// key is the one a person must fix.
fn unknown_key_line(text: &str, msg: &str, from_line: usize) -> Option<usize> {
    let key = match msg.split("unknown field `").nth(1) {
        Some(rest) => rest.split('`').next()?,
        None => msg.strip_prefix("g4.")?.split(':').next()?,
    };
    text.lines()
        .enumerate()
        .skip(from_line.saturating_sub(1))
        .find(|(_, l)| {
            l.trim_start()
                .strip_prefix(key)
                .is_some_and(|r| r.trim_start().starts_with('='))
        })
        .map(|(i, _)| i + 1)
}

/// Why `log.level` would not log what its writer meant, if it would not.
/// The filter syntax (RUST_LOG's) reads a bare word as a target name, so
/// `level = "loud"` is a valid filter that enables only a target called
/// `loud`: the daemon then logs nothing at all. Each comma-separated
/// directive must be a level or `target=level`.
pub fn log_level_problem(level: &str) -> Option<String> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    let is_level = |w: &str| LEVELS.contains(&w.trim().to_ascii_lowercase().as_str());
    if level.trim().is_empty() {
        return Some("empty: use one of off, error, warn, info, debug, trace".into());
    }
    for d in level.split(',') {
        let ok = match d.rsplit_once('=') {
            Some((target, lvl)) => !target.trim().is_empty() && is_level(lvl),
            None => is_level(d),
        };
        if !ok {
            return Some(format!(
                "{d:?} in {level:?} is not a level (off, error, warn, info, debug, trace) \
                 or a target=level directive"
            ));
        }
    }
    None
}

/// Why `g4.url` cannot name a store, if it cannot (start-up would refuse
/// it; `--check-config` must too).
pub fn g4_url_problem(url: &str) -> Option<String> {
    if url.is_empty() || url == "memory://" || url == "memory:///" {
        return None;
    }
    if let Some(dir) = url.strip_prefix("file://") {
        return (!dir.starts_with('/'))
            .then(|| format!("`{url}`: file URLs need an absolute path (file:///path)"));
    }
    if let Some(rest) = url.strip_prefix("s3://") {
        return rest
            .split('/')
            .next()
            .is_none_or(str::is_empty)
            .then(|| format!("`{url}`: no bucket (s3://bucket/prefix)"));
    }
    Some(format!(
        "`{url}`: not a store URL; use s3://bucket/prefix (any S3-compatible store: \
         set g4.endpoint for a non-AWS one), file:///path or memory://, or \"\" to turn G4 off"
    ))
}

/// The server's per-uid shares from the config. Single-tenant: only what
/// `[access]` sets (one uid may be every worker). With tenants, unset
/// shares default to a quarter of each global bound, so three quarters
/// stay for everyone else.
pub fn uid_limits(cfg: &Config, subscribers_max: usize) -> crate::edges::server::UidLimits {
    let a = &cfg.access;
    let multi = !cfg.tenants.is_empty();
    let quarter = |n: usize| multi.then_some((n / 4).max(1));
    crate::edges::server::UidLimits {
        // Without tenants too: one local user cannot take every slot.
        connections_per_uid_max: a.connections_per_uid_max.or(Some(
            quarter(cfg.server.max_connections).unwrap_or((cfg.server.max_connections / 2).max(1)),
        )),
        // Without tenants too: one local user cannot take every
        // subscription a router's relay or another user needs.
        subscribers_per_uid_max: a.subscribers_per_uid_max.or(Some(
            quarter(subscribers_max).unwrap_or((subscribers_max / 2).max(1)),
        )),
        onboards_per_uid_max: a.onboards_per_uid_max.or(multi.then_some(8)),
        leases_per_uid_max: a
            .leases_per_uid_max
            .or(multi.then_some(cfg.server.leases_per_conn_max.saturating_mul(4))),
        pins_per_uid_max: a.pins_per_uid_max.or(quarter(cfg.server.pins_max)),
        // A quarter of G3's pin budget (half of its capacity).
        pin_bytes_per_tenant_max: a
            .pin_bytes_per_tenant_max
            .or(multi.then_some((cfg.g3.capacity / 8).max(1))),
        pin_ttl_max_ms: cfg.server.pin_ttl_max_ms,
        hellos_per_uid_max: Some(cfg.server.hellos_per_uid_max),
        lease_bytes_per_uid_max: a
            .lease_bytes_per_uid_max
            .or(multi.then_some((cfg.g3.capacity / 4).max(1))),
        namespaces_per_uid_max: a
            .namespaces_per_uid_max
            .or((!multi).then_some(crate::edges::access::NAMESPACES_PER_UID_MAX)),
        admin_connections_reserved: admin_connections_reserved(cfg),
        admin_subscribers_reserved: a
            .admin_subscribers_reserved
            .unwrap_or(crate::edges::access::ADMIN_SUBSCRIBERS_RESERVED),
    }
}

/// `[access] admin_connections_reserved`; unset: 8, at most an eighth of
/// `server.max_connections` (none kept below 8 connections).
fn admin_connections_reserved(cfg: &Config) -> usize {
    cfg.access.admin_connections_reserved.unwrap_or(
        crate::edges::access::ADMIN_CONNECTIONS_RESERVED.min(cfg.server.max_connections / 8),
    )
}

fn bad(key: &str, problem: impl Into<String>) -> Error {
    Error::Config {
        key: key.into(),
        problem: problem.into(),
    }
}

impl Config {
    /// The annotated default (the same text for every user).
    pub fn default_toml() -> String {
        DEFAULT_TOML.to_string()
    }

    /// Parses TOML text (then call [`Config::validate`]).
    pub fn from_toml(text: &str) -> Result<Config> {
        Self::from_toml_named(text, "<config text>")
    }

    /// Parses TOML text read from `origin` (a file name), naming it and the
    /// line in errors.
    pub fn from_toml_named(text: &str, origin: &str) -> Result<Config> {
        toml::from_str(text).map_err(|e| {
            let msg = e.message().to_string();
            let at = e
                .span()
                .map(|s| {
                    let start = s.start.min(text.len());
                    // Lines are 1-based: one more than the newlines before the span.
                    let line = text.as_bytes()[..start]
                        .iter()
                        .filter(|&&b| b == b'\n')
                        .count()
                        + 1;
                    format!(":{}", unknown_key_line(text, &msg, line).unwrap_or(line))
                })
                .unwrap_or_default();
            bad(&format!("{origin}{at}"), msg)
        })
    }

    /// Reads and parses a file.
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| bad("--config", format!("cannot read {}: {e}", path.display())))?;
        Self::from_toml_named(&text, &path.display().to_string())
    }

    /// The socket permission bits.
    pub fn socket_mode(&self) -> Result<u32> {
        let m = u32::from_str_radix(self.server.socket_mode.trim_start_matches("0o"), 8)
            .map_err(|_| bad("server.socket_mode", "not an octal mode like \"0660\""))?;
        if m > 0o777 {
            return Err(bad("server.socket_mode", "must be at most 0777"));
        }
        Ok(m)
    }

    /// How G3 makes block data durable (`g3.data_flush`).
    pub fn g3_sync_mode(&self) -> Result<crate::tiers::g3::SyncMode> {
        match self.g3.data_flush.as_str() {
            "group" => Ok(crate::tiers::g3::SyncMode::Group),
            "per_block" => Ok(crate::tiers::g3::SyncMode::Auto),
            e => Err(bad(
                "g3.data_flush",
                format!("{e:?} is not a data flush (group | per_block)"),
            )),
        }
    }

    /// The G3 I/O engine.
    pub fn g3_engine(&self) -> Result<crate::tiers::g3::G3EngineKind> {
        use crate::tiers::g3::G3EngineKind as K;
        match self.g3.engine.as_str() {
            "auto" => Ok(K::Auto),
            "uring" | "io_uring" => Ok(K::Uring),
            "pread" => Ok(K::Pread),
            e => Err(bad(
                "g3.engine",
                format!("{e:?} is not an engine (auto | uring | pread)"),
            )),
        }
    }

    /// Checks every value.
    pub fn validate(&self) -> Result<()> {
        if self.events.dynamo_worker_id == Some(0) {
            return Err(bad(
                "events.dynamo_worker_id",
                "0 means no worker; pick another id or leave it unset",
            ));
        }
        self.events.zmq.validate()?;
        if !self.tenants.is_empty()
            && self.events.zmq.enabled()
            && [&self.events.zmq.endpoint, &self.events.zmq.replay_endpoint]
                .iter()
                .any(|e| !e.is_empty() && !e.starts_with("ipc://"))
        {
            // Any local user can connect to a loopback TCP port; only an
            // ipc:// socket file's permissions keep tenants' events apart.
            return Err(bad(
                "events.zmq.endpoint",
                "with [[tenants]] configured, publish on an ipc:// endpoint (guarded by server.socket_mode): any local user could read every tenant's token ids from a TCP port",
            ));
        }
        let s = &self.server;
        if s.socket.as_os_str().is_empty() {
            return Err(bad("server.socket", "must not be empty"));
        }
        if s.socket.as_os_str().len() > 100 {
            return Err(bad(
                "server.socket",
                "longer than 100 bytes (Unix socket paths are limited to 108)",
            ));
        }
        self.socket_mode()?;
        if let Some(g) = &s.socket_group {
            crate::edges::server::socket_gid(g)?;
        }
        log_level_problem(&self.log.level).map_or(Ok(()), |p| Err(bad("log.level", p)))?;
        if let Some(u) = self.g4.url.as_deref() {
            g4_url_problem(u).map_or(Ok(()), |p| Err(bad("g4.url", p)))?;
        }
        if !matches!(self.log.format.as_str(), "text" | "json") {
            return Err(bad(
                "log.format",
                format!("{:?}: use \"text\" or \"json\"", self.log.format),
            ));
        }
        if !(1..=65536).contains(&s.max_connections) {
            return Err(bad("server.max_connections", "must be 1..=65536"));
        }
        if s.idle_timeout_ms == 0 || s.io_timeout_ms == 0 {
            return Err(bad("server.io_timeout_ms", "timeouts must be positive"));
        }
        if s.hello_timeout_ms == 0 {
            return Err(bad("server.hello_timeout_ms", "must be positive"));
        }
        if s.hellos_per_uid_max == 0 {
            return Err(bad("server.hellos_per_uid_max", "must be at least 1"));
        }
        if s.region_bytes_max < 1 << 20 || s.region_bytes_max > kvtier_client::shm::REGION_BYTES_MAX
        {
            return Err(bad(
                "server.region_bytes_max",
                "must be between 1MiB and 16GiB",
            ));
        }
        if s.leases_per_conn_max == 0 || s.lease_ttl_max_ms == 0 {
            return Err(bad(
                "server.lease_ttl_max_ms",
                "lease bounds must be positive",
            ));
        }
        let reads_max = crate::edges::server::ONBOARD_READS_IN_FLIGHT_MAX;
        if s.onboard_reads_in_flight_max == 0 || s.onboard_reads_in_flight_max > reads_max {
            return Err(bad(
                "server.onboard_reads_in_flight_max",
                format!(
                    "{} is not in 1..={reads_max} (1 reads a request's blocks one after another)",
                    s.onboard_reads_in_flight_max
                ),
            ));
        }
        if s.pins_max == 0 || s.pin_ttl_max_ms == 0 {
            return Err(bad("server.pins_max", "pin bounds must be positive"));
        }
        if admin_connections_reserved(self) >= s.max_connections {
            return Err(bad(
                "access.admin_connections_reserved",
                format!(
                    "must be below server.max_connections ({}): the others need one",
                    s.max_connections
                ),
            ));
        }
        let subs = crate::base::events::SUBSCRIBERS_MAX;
        if self.access.admin_subscribers_reserved.unwrap_or(0) >= subs {
            return Err(bad(
                "access.admin_subscribers_reserved",
                format!("must be below the {subs} event subscriptions"),
            ));
        }
        if self.g3.dir.as_os_str().is_empty() {
            return Err(bad("g3.dir", "must not be empty"));
        }
        if self.g3.capacity < 1 << 20 {
            return Err(bad("g3.capacity", "must be at least 1MiB"));
        }
        if crate::tiers::policy::by_name(&self.g3.policy).is_none() {
            return Err(bad(
                "g3.policy",
                format!("{:?} is not a policy (default | lru)", self.g3.policy),
            ));
        }
        if !(0.0 < self.g3.low_watermark
            && self.g3.low_watermark < self.g3.high_watermark
            && self.g3.high_watermark <= 1.0)
        {
            return Err(bad(
                "g3.high_watermark",
                "need 0 < low_watermark < high_watermark <= 1",
            ));
        }
        self.g3_engine()?;
        self.g3_sync_mode()?;
        self.g4
            .admission
            .parse::<crate::tiers::policy::G4Admission>()
            .map_err(|e| bad("g4.admission", e))?;
        if self.peer.enabled {
            self.peer.validate()?;
        }
        if !self.metrics.addr.is_empty()
            && self.metrics.addr.parse::<std::net::SocketAddr>().is_err()
        {
            return Err(bad(
                "metrics.addr",
                format!(
                    "{:?} is not host:port (e.g. 127.0.0.1:9477)",
                    self.metrics.addr
                ),
            ));
        }
        self.mount.validate()?;
        crate::edges::access::Policy::from_config(&self.tenants, &self.access)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn g4_section_debug_redacts_credentials() {
        let g = Config::from_toml(
            "[g4]\naccess_key_id = \"AKIDSECRETVALUE\"\n\
             secret_access_key = \"very-secret-key\"\nsession_token = \"token-value\"\n",
        )
        .unwrap()
        .g4;
        let d = format!("{g:?}");
        for secret in ["AKIDSECRETVALUE", "very-secret-key", "token-value"] {
            assert!(!d.contains(secret), "{secret} leaked into {d}");
        }
        assert!(d.contains("<redacted>"));
    }

    use super::*;

    #[test]
    fn zmq_endpoints_stay_on_this_host_unless_allowed() {
        let ns = "[[events.zmq.namespaces]]\nid = \"0123456789abcdef0123456789abcdef\"\n";
        let check = |zmq: &str| {
            Config::from_toml(&format!("[events.zmq]\n{zmq}\n{ns}"))
                .and_then(|c| c.validate())
                .map_err(|e| e.to_string())
        };
        check("endpoint = \"tcp://127.0.0.1:5557\"").unwrap();
        check("endpoint = \"ipc:///run/kvtier/kv.ipc\"").unwrap();
        let e = check("endpoint = \"tcp://0.0.0.0:5557\"").unwrap_err();
        assert!(e.contains("allow_non_loopback"), "{e}");
        check("endpoint = \"tcp://0.0.0.0:5557\"\nallow_non_loopback = true").unwrap();
        check("endpoint = \"tcp://127.0.0.1:5557\"\nmedia = \"dynamo\"").unwrap();
        let e = check("endpoint = \"tcp://127.0.0.1:5557\"\nmedia = \"DISK\"").unwrap_err();
        assert!(
            e.contains("events.zmq.media") && e.contains("\"dynamo\""),
            "{e}"
        );
        let e = check("endpoint = \"tcp://router.example:5557\"").unwrap_err();
        assert!(e.contains("IP address"), "{e}");
        let e = Config::from_toml("[events.zmq]\nendpoint = \"tcp://127.0.0.1:1\"\n")
            .unwrap()
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least one namespace"), "{e}");
        let e = check("endpoint = \"tcp://127.0.0.1:1\"\n[[events.zmq.namespaces]]\nid = \"xyz\"")
            .unwrap_err();
        assert!(e.contains("32 hex digits"), "{e}");
    }

    #[test]
    fn default_parses_and_validates() {
        let c = Config::from_toml(&Config::default_toml()).unwrap();
        c.validate().unwrap();
        assert_eq!(c.g3.capacity, 4 << 30);
        assert_eq!(c.socket_mode().unwrap(), 0o660);
        // The annotated file says what the code defaults to.
        let d = NodeSection::default();
        assert_eq!(
            (c.node.staged_bytes_max, c.node.promote_queue_max),
            (d.staged_bytes_max, d.promote_queue_max)
        );
        assert_eq!(
            (c.node.lookup_remote_deadline_ms, c.node.fetch_deadline_ms),
            (d.lookup_remote_deadline_ms, d.fetch_deadline_ms)
        );
    }

    #[test]
    fn g4_and_peer_sections() {
        let c = Config::from_toml("[g3]\ndir = \"/d/g3\"\n").unwrap();
        let g4 = c.g4.to_g4_config(&c.g3.dir).unwrap();
        assert_eq!(g4.url, "file:///d/g4");
        let c = Config::from_toml("[g4]\nurl = \"\"\n").unwrap();
        assert!(c.g4.to_g4_config(&c.g3.dir).is_none());
        let c = Config::from_toml("[g4]\nurl = \"s3://b/p\"\npath_style = true\n").unwrap();
        let g4 = c.g4.to_g4_config(&c.g3.dir).unwrap();
        assert!(g4.path_style && g4.url == "s3://b/p");
        // Every G4Config key is a [g4] key; typos are refused by name.
        let c = Config::from_toml("[g4]\nupload_retries = 9\nsweep_interval_ms = 5\n").unwrap();
        let g4 = c.g4.to_g4_config(&c.g3.dir).unwrap();
        assert_eq!((g4.upload_retries, g4.sweep_interval_ms), (9, 5));
        // The fetch byte budget is a size with units.
        let c = Config::from_toml("[g4]\nfetch_buffer_bytes_max = \"3GiB\"\n").unwrap();
        let g4 = c.g4.to_g4_config(&c.g3.dir).unwrap();
        assert_eq!(g4.fetch_buffer_bytes_max, 3 << 30);
        let e = Config::from_toml("[g4]\nupload_retires = 9\n").unwrap_err();
        assert!(e.to_string().contains("upload_retires"), "{e}");
        let e = Config::from_toml("[g4]\nurl = 5\n").unwrap_err();
        assert!(e.to_string().contains("g4.url"), "{e}");
        let c = Config::from_toml("[node]\nstaged_bytes_max = \"64MiB\"\npromote_queue_max = 0\n")
            .unwrap();
        assert_eq!(
            (c.node.staged_bytes_max, c.node.promote_queue_max),
            (64 << 20, 0)
        );
        assert_eq!(Config::default().node.fetch_deadline_ms, 10_000);
        for (text, key) in [
            ("[g4]\nadmission = \"sometimes\"\n", "g4.admission"),
            ("[g3]\npolicy = \"belady\"\n", "g3.policy"),
            ("[g3]\nengine = \"spdk\"\n", "g3.engine"),
            ("[g3]\ndata_flush = \"never\"\n", "g3.data_flush"),
            ("[g3]\nlow_watermark = 0.99\n", "g3.high_watermark"),
            ("[peer]\nenabled = true\n", "peer.secret_file"),
        ] {
            let e = Config::from_toml(text).unwrap().validate().unwrap_err();
            assert!(e.to_string().contains(key), "{text}: {e}");
        }
    }

    #[test]
    fn errors_name_the_key() {
        let e = Config::from_toml("[g3]\ncapacity = \"12XB\"\n").unwrap_err();
        assert!(e.to_string().contains("12XB"), "{e}");
        let e = Config::from_toml("[server]\nsokcet = \"x\"\n").unwrap_err();
        assert!(e.to_string().contains("sokcet"), "{e}");
        let e = Config::from_toml("[mount]\npassthrough = \"sometimes\"\n").unwrap_err();
        assert!(e.to_string().contains("sometimes"), "{e}");
        let c = Config::from_toml("[mount]\nfile_mode = \"999\"\n").unwrap();
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("mount.file_mode"));
        let c = Config::from_toml("[metrics]\naddr = \"nope\"\n").unwrap();
        let e = c.validate().unwrap_err();
        assert!(e.to_string().contains("metrics.addr"), "{e}");
        let c = Config::from_toml("[server]\nonboard_reads_in_flight_max = 0\n").unwrap();
        let e = c.validate().unwrap_err();
        assert!(
            e.to_string().contains("server.onboard_reads_in_flight_max"),
            "{e}"
        );
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        use crate::base::units::parse_size;
        let ok = [
            ("4096", 4096u64),
            ("64KiB", 64 << 10),
            ("1.5TiB", 3 << 39),
            ("1TB", 1_000_000_000_000),
            ("10GB", 10_000_000_000),
            ("10GiB", 10 << 30),
            ("2.5 MB", 2_500_000),
            ("4G", 4 << 30),
            ("0", 0),
            (".5KiB", 512),
        ];
        for (s, want) in ok {
            assert_eq!(parse_size(s), Ok(want), "{s}");
        }
        for (s, needle) in [
            ("-1GiB", "negative"),
            ("1.3B", "whole number"),
            ("12XB", "unknown unit"),
            ("1..2GB", "not a size"),
            ("GiB", "not a size"),
            ("99999999999PiB", "overflows"),
        ] {
            let e = parse_size(s).unwrap_err();
            assert!(e.contains(needle), "{s}: {e}");
        }
        let e = Config::from_toml("[g3]\ncapacity = -5\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("negative"), "{e}");
        let e = Config::from_toml("[g3]\ncapacity = 1.5\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("whole number"), "{e}");
        let c = Config::from_toml("[g3]\ncapacity = \"1.5TiB\"\n").unwrap();
        assert_eq!(c.g3.capacity, 3 << 39);
        assert_eq!(c.g3.recycle_max, None);
        let c = Config::from_toml("[g3]\nrecycle_max = \"0\"\n").unwrap();
        assert_eq!(c.g3.recycle_max, Some(0));
    }

    #[test]
    fn config_errors_name_the_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kvtierd.toml");
        std::fs::write(&path, "# a comment\n[g4]\nurll = \"s3://b/p\"\n").unwrap();
        let e = Config::load(&path).unwrap_err().to_string();
        assert!(e.contains(&format!("{}:3", path.display())), "{e}");
        assert!(e.contains("urll"), "{e}");
        std::fs::write(&path, "[server]\n\n\nsokcet = \"x\"\n").unwrap();
        let e = Config::load(&path).unwrap_err().to_string();
        assert!(e.contains("kvtierd.toml:4"), "{e}");
        // A bad value in the hand-read [g4] names its key and its line, not
        // the section header's (issue 30).
        std::fs::write(
            &path,
            "[g4]\nurl = \"memory://\"\n\nupload_retries = \"x\"\n",
        )
        .unwrap();
        let e = Config::load(&path).unwrap_err().to_string();
        assert!(e.contains("kvtierd.toml:4"), "{e}");
        assert!(e.contains("g4.upload_retries"), "{e}");
        assert!(!e.contains('\n'), "one line: {e:?}");
        std::fs::write(&path, "[g4]\n\nmultipart_part_bytes = \"lots\"\n").unwrap();
        let e = Config::load(&path).unwrap_err().to_string();
        assert!(e.contains("kvtierd.toml:3"), "{e}");
        assert!(e.contains("is not a size"), "{e}");
    }

    /// Every size key of every section reads sizes as people write them,
    /// in the file and in its `KVTIERD_*` variable (issue 30: `[g4]`'s and
    /// `[peer]`'s took only byte counts).
    #[test]
    fn every_size_key_takes_units_in_the_file_and_the_environment() {
        let keys = [
            ("server", "region_bytes_max", "8MiB", 8u64 << 20),
            ("g3", "capacity", "2GiB", 2 << 30),
            ("g3", "quarantine_max", "1MiB", 1 << 20),
            ("g3", "recycle_max", "1MiB", 1 << 20),
            ("g3", "recycle_unsettled_max", "1MiB", 1 << 20),
            ("g3", "slot_max", "1MiB", 1 << 20),
            ("g3", "scrub_bytes_per_s", "1MB", 1_000_000),
            ("g4", "capacity_bytes", "10TB", 10_000_000_000_000),
            ("g4", "multipart_threshold_bytes", "32MiB", 32 << 20),
            ("g4", "multipart_part_bytes", "16MiB", 16 << 20),
            ("g4", "object_bytes_max", "2GiB", 2 << 30),
            ("g4", "fetch_buffer_bytes_max", "4GiB", 4 << 30),
            ("node", "staged_bytes_max", "64MiB", 64 << 20),
            ("peer", "block_bytes_max", "2GiB", 2 << 30),
            ("peer", "holdings_bytes_max", "1MiB", 1 << 20),
            ("access", "lease_bytes_per_uid_max", "1GiB", 1 << 30),
            ("access", "pin_bytes_per_tenant_max", "2GiB", 2 << 30),
        ];
        let read = |c: &Config, section: &str, key: &str| -> Option<u64> {
            let g4 = c.g4.to_g4_config(&c.g3.dir);
            let g4 = g4.as_ref();
            Some(match (section, key) {
                ("server", _) => c.server.region_bytes_max,
                ("g3", "capacity") => c.g3.capacity,
                ("g3", "quarantine_max") => c.g3.quarantine_max?,
                ("g3", "recycle_max") => c.g3.recycle_max?,
                ("g3", "recycle_unsettled_max") => c.g3.recycle_unsettled_max,
                ("g3", "slot_max") => c.g3.slot_max,
                ("g3", _) => c.g3.scrub_bytes_per_s,
                ("g4", "capacity_bytes") => g4?.capacity_bytes?,
                ("g4", "multipart_threshold_bytes") => g4?.multipart_threshold_bytes,
                ("g4", "multipart_part_bytes") => g4?.multipart_part_bytes,
                ("g4", "object_bytes_max") => g4?.object_bytes_max,
                ("g4", _) => g4?.fetch_buffer_bytes_max,
                ("node", _) => c.node.staged_bytes_max,
                ("peer", "block_bytes_max") => c.peer.block_bytes_max,
                ("peer", _) => c.peer.holdings_bytes_max,
                ("access", "lease_bytes_per_uid_max") => c.access.lease_bytes_per_uid_max?,
                _ => c.access.pin_bytes_per_tenant_max?,
            })
        };
        for (section, key, text, want) in keys {
            let c = Config::from_toml(&format!("[{section}]\n{key} = \"{text}\"\n"))
                .unwrap_or_else(|e| panic!("{section}.{key} = {text:?} in the file: {e}"));
            assert_eq!(read(&c, section, key), Some(want), "{section}.{key} (file)");
            let var = format!("KVTIERD_{}_{}", section.to_uppercase(), key.to_uppercase());
            let (c, _) = Config::load_layered(None, &[(var.clone(), text.to_string())])
                .unwrap_or_else(|e| panic!("{var}={text}: {e}"));
            assert_eq!(read(&c, section, key), Some(want), "{var}");
        }
    }

    /// `--check-config` (which runs `validate`) refuses what start-up would
    /// refuse or what would silently log nothing (issue 30).
    #[test]
    fn check_config_refuses_what_start_up_cannot_use() {
        for (text, key, needle) in [
            ("[log]\nlevel = \"loud\"\n", "log.level", "loud"),
            (
                "[log]\nlevel = \"kvtier=loud\"\n",
                "log.level",
                "kvtier=loud",
            ),
            ("[log]\nlevel = \"\"\n", "log.level", "empty"),
            ("[g4]\nurl = \"http://x\"\n", "g4.url", "http://x"),
            ("[g4]\nurl = \"s3://\"\n", "g4.url", "no bucket"),
            ("[g4]\nurl = \"file://rel\"\n", "g4.url", "absolute"),
            (
                "[server]\nsocket_group = \"no-such-group-kvtier\"\n",
                "server.socket_group",
                "no-such-group-kvtier",
            ),
        ] {
            let e = Config::from_toml(text)
                .unwrap()
                .validate()
                .unwrap_err()
                .to_string();
            assert!(e.contains(key) && e.contains(needle), "{text}: {e}");
        }
        for text in [
            "[log]\nlevel = \"info\"\n",
            "[log]\nlevel = \"warn,kvtier_daemon=debug\"\n",
            "[log]\nlevel = \"OFF\"\n",
            "[g4]\nurl = \"\"\n",
            "[g4]\nurl = \"s3://bucket/prefix\"\n",
            "[g4]\nurl = \"memory://\"\n",
            "[server]\nsocket_group = \"4242\"\n",
            "[server]\nsocket_group = \"root\"\n",
        ] {
            Config::from_toml(text)
                .unwrap()
                .validate()
                .unwrap_or_else(|e| panic!("{text}: {e}"));
        }
        assert_eq!(crate::edges::server::socket_gid("4242").unwrap(), 4242);
    }
}
