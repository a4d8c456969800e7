//! G4 configuration and the one place that turns it into an `ObjectStore`.

use crate::base::error::{Error, Result};
use kvtier_client::block::{HEADER_BYTES, PAYLOAD_BYTES_MAX};
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, RetryConfig};
use std::sync::Arc;
use std::time::Duration;

/// Where the S3 client takes its credentials from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum G4Credentials {
    /// `access_key_id`/`secret_access_key` here, else `AWS_ACCESS_KEY_ID`
    /// and `AWS_SECRET_ACCESS_KEY`; with neither, requests go unsigned and
    /// G4 reports itself degraded. Never asks a metadata address.
    #[default]
    Auto,
    /// Static keys only (here or in the environment); none is a config error.
    Static,
    /// The cloud's ambient credentials: web identity token, container
    /// endpoint or instance metadata (169.254.169.254), as the AWS SDKs do.
    Instance,
    /// Unsigned requests (a public bucket, or a local test server).
    Anonymous,
}

/// Configuration of the G4 tier. `Default` works for a local `file://` store.
///
/// Credentials left `None` are read from the standard AWS environment
/// variables (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
/// `AWS_SESSION_TOKEN`, `AWS_REGION`, `AWS_ENDPOINT`, ...). `Debug` never
/// prints them.
#[derive(Clone, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct G4Config {
    /// `s3://bucket/prefix`, `file:///path` or `memory://`.
    pub url: String,
    /// S3 endpoint for non-AWS stores (`http://127.0.0.1:8333`).
    pub endpoint: Option<String>,
    /// S3 region (`us-east-1` when unset and not in the environment).
    pub region: Option<String>,
    /// Allow plain-HTTP endpoints (local MinIO/SeaweedFS).
    pub allow_http: bool,
    /// Path-style requests (`endpoint/bucket/key`), needed by most local stores.
    pub path_style: bool,
    /// Access key id; `None` reads the environment.
    pub access_key_id: Option<String>,
    /// Secret access key; `None` reads the environment.
    pub secret_access_key: Option<String>,
    /// Session token for temporary credentials.
    pub session_token: Option<String>,
    /// Where S3 credentials come from (see [`G4Credentials`]). Only
    /// `instance` lets the client ask a metadata address (169.254.169.254,
    /// the container endpoint) or a web-identity token file.
    pub credentials: G4Credentials,
    /// Instance metadata endpoint used by `credentials = "instance"`
    /// (unset: the cloud's, `http://169.254.169.254`).
    pub metadata_endpoint: Option<String>,
    /// Bytes of blocks G4 may hold before the sweeper deletes oldest first
    /// (a size: `"10TB"` or a byte count; unset: unbounded).
    #[serde(deserialize_with = "crate::base::units::de_size_opt")]
    pub capacity_bytes: Option<u64>,
    /// Age after which the sweeper deletes a block.
    pub ttl_ms: Option<u64>,
    /// How often the background sweeper runs (when capacity or TTL is set).
    pub sweep_interval_ms: u64,
    /// The sweeper never deletes an object younger than this (grace period
    /// for readers that just learned it exists).
    pub sweep_min_age_ms: u64,
    /// Most objects one sweep lists (bounds its memory).
    pub sweep_list_max: usize,
    /// How often this node rewrites its lifecycle view in the bucket
    /// (`lifecycle/<node-id>.json`, valid for three refreshes). The sweeper
    /// deletes only while every live view agrees (`lifecycle.rs`).
    pub lifecycle_refresh_ms: u64,
    /// This node's id in the bucket's lifecycle views (set by kvtierd from
    /// `peer.node_id` or the hostname; unset: a random id per process).
    #[serde(skip)]
    pub node_id: Option<String>,
    /// Upload jobs waiting at most; more are dropped and counted.
    pub upload_queue_max: usize,
    /// Uploads in flight at most.
    pub upload_concurrency: usize,
    /// Attempts after the first before an upload is given up.
    pub upload_retries: u32,
    /// First retry delay; doubles per attempt.
    pub retry_backoff_ms: u64,
    /// Longest retry delay.
    pub retry_backoff_max_ms: u64,
    /// Block files at least this large are uploaded in parts (a size).
    #[serde(deserialize_with = "crate::base::units::de_size")]
    pub multipart_threshold_bytes: u64,
    /// Part size of multipart uploads (S3 needs >= 5 MiB but the last).
    #[serde(deserialize_with = "crate::base::units::de_size")]
    pub multipart_part_bytes: u64,
    /// Deadline of one object-store operation (a whole put or get).
    pub request_timeout_ms: u64,
    /// Deadline of a TCP connect to the store.
    pub connect_timeout_ms: u64,
    /// Deadline from sending a read request (GET, HEAD) to its response
    /// headers: a store that accepts and never answers is a miss this soon.
    pub response_timeout_ms: u64,
    /// Longest pause between two body chunks of a GET (a trickling body is
    /// a miss, not a stall).
    pub body_idle_timeout_ms: u64,
    /// Largest object a fetch accepts: the size is checked from the
    /// response before any body is buffered, and the body is read with this
    /// cap. Default: the largest valid block file (header + 1 GiB payload).
    #[serde(deserialize_with = "crate::base::units::de_size")]
    pub object_bytes_max: u64,
    /// Consecutive failed or late store calls that open the circuit
    /// breaker (calls then fail at once, as misses, without a request).
    pub breaker_failures_max: u32,
    /// How long the breaker stays open before one probe call may try;
    /// doubles after each failed probe, up to `breaker_open_max_ms`.
    pub breaker_open_ms: u64,
    /// Longest open period of the breaker.
    pub breaker_open_max_ms: u64,
    /// Deadline of the start-up check (reachability and credentials).
    pub startup_check_timeout_ms: u64,
    /// Deadline of `BlockTier::get` (fetch with a deadline takes its own).
    pub fetch_deadline_ms: u64,
    /// Distinct blocks being fetched at once at most; more are misses.
    pub fetch_inflight_max: usize,
    /// Body bytes all fetches together may buffer (a size: `"2GiB"` or a
    /// byte count). A fetch reserves its object's declared size before
    /// reading the body and waits at most `response_timeout_ms` for room
    /// (else a miss); at least `object_bytes_max`.
    #[serde(deserialize_with = "crate::base::units::de_size")]
    pub fetch_buffer_bytes_max: u64,
    /// While the breaker is open or the start-up check failed, one cheap
    /// HEAD every this many ms (with jitter; the breaker's own back-off
    /// still applies) tells when the store is back, without waiting for
    /// traffic.
    pub probe_interval_ms: u64,
    /// How often the node re-scans G3 for blocks not yet safe in G4 while
    /// uploads are being lost (given up, dropped) or a backlog remains.
    pub backlog_scan_interval_ms: u64,
    /// First re-scan delay after a scan that found a backlog; doubles (with
    /// jitter) up to `backlog_scan_interval_ms`. The store answering again
    /// triggers a scan at once.
    pub backlog_retry_ms: u64,
    /// Entries of the existence cache at most.
    pub exists_cache_entries: usize,
    /// How long a cached "present" is trusted.
    pub exists_ttl_ms: u64,
    /// How long a cached "absent" is trusted (short: other nodes upload).
    pub exists_negative_ttl_ms: u64,
}

impl Default for G4Config {
    fn default() -> Self {
        G4Config {
            url: "file:///var/lib/kvtier/g4".into(),
            endpoint: None,
            region: None,
            allow_http: false,
            path_style: false,
            access_key_id: None,
            secret_access_key: None,
            session_token: None,
            credentials: G4Credentials::Auto,
            metadata_endpoint: None,
            capacity_bytes: None,
            ttl_ms: None,
            sweep_interval_ms: 60_000,
            sweep_min_age_ms: 60_000,
            sweep_list_max: 1_000_000,
            lifecycle_refresh_ms: 60_000,
            node_id: None,
            upload_queue_max: 4096,
            upload_concurrency: 8,
            upload_retries: 12,
            retry_backoff_ms: 100,
            retry_backoff_max_ms: 5_000,
            multipart_threshold_bytes: 32 << 20,
            multipart_part_bytes: 8 << 20,
            request_timeout_ms: 30_000,
            connect_timeout_ms: 2_000,
            response_timeout_ms: 2_000,
            body_idle_timeout_ms: 2_000,
            object_bytes_max: HEADER_BYTES as u64 + PAYLOAD_BYTES_MAX,
            breaker_failures_max: 5,
            breaker_open_ms: 1_000,
            breaker_open_max_ms: 30_000,
            startup_check_timeout_ms: 3_000,
            fetch_deadline_ms: 10_000,
            fetch_inflight_max: 256,
            fetch_buffer_bytes_max: 2 << 30,
            probe_interval_ms: 2_000,
            backlog_scan_interval_ms: 60_000,
            backlog_retry_ms: 2_000,
            exists_cache_entries: 1 << 20,
            exists_ttl_ms: 60_000,
            exists_negative_ttl_ms: 1_000,
        }
    }
}

impl std::fmt::Debug for G4Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let redact = |o: &Option<String>| o.as_ref().map(|_| "<redacted>");
        f.debug_struct("G4Config")
            .field("url", &self.url)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("allow_http", &self.allow_http)
            .field("path_style", &self.path_style)
            .field("access_key_id", &redact(&self.access_key_id))
            .field("secret_access_key", &redact(&self.secret_access_key))
            .field("session_token", &redact(&self.session_token))
            .field("credentials", &self.credentials)
            .field("capacity_bytes", &self.capacity_bytes)
            .field("ttl_ms", &self.ttl_ms)
            .field("upload_queue_max", &self.upload_queue_max)
            .field("upload_concurrency", &self.upload_concurrency)
            .field("request_timeout_ms", &self.request_timeout_ms)
            .field("response_timeout_ms", &self.response_timeout_ms)
            .field("breaker_failures_max", &self.breaker_failures_max)
            .field("object_bytes_max", &self.object_bytes_max)
            .field("fetch_buffer_bytes_max", &self.fetch_buffer_bytes_max)
            .finish_non_exhaustive()
    }
}

impl G4Config {
    /// A config for `url` with every other field at its default.
    pub fn new(url: impl Into<String>) -> Self {
        G4Config {
            url: url.into(),
            ..Default::default()
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |key: &str, problem: &str| Error::Config {
            key: format!("g4.{key}"),
            problem: problem.into(),
        };
        if self.upload_queue_max == 0 {
            return Err(bad("upload_queue_max", "must be at least 1"));
        }
        if self.upload_concurrency == 0 {
            return Err(bad("upload_concurrency", "must be at least 1"));
        }
        if self.multipart_part_bytes < (5 << 20) {
            return Err(bad("multipart_part_bytes", "S3 parts are at least 5 MiB"));
        }
        for (key, v) in [
            ("request_timeout_ms", self.request_timeout_ms),
            ("fetch_deadline_ms", self.fetch_deadline_ms),
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("response_timeout_ms", self.response_timeout_ms),
            ("body_idle_timeout_ms", self.body_idle_timeout_ms),
            ("breaker_open_ms", self.breaker_open_ms),
            ("startup_check_timeout_ms", self.startup_check_timeout_ms),
            ("probe_interval_ms", self.probe_interval_ms),
            ("backlog_scan_interval_ms", self.backlog_scan_interval_ms),
            ("backlog_retry_ms", self.backlog_retry_ms),
        ] {
            if v == 0 {
                return Err(bad(key, "timeouts must be above 0 ms"));
            }
        }
        if self.breaker_open_max_ms < self.breaker_open_ms {
            return Err(bad(
                "breaker_open_max_ms",
                "must be at least breaker_open_ms",
            ));
        }
        if self.breaker_failures_max == 0 {
            return Err(bad("breaker_failures_max", "must be at least 1"));
        }
        if self.object_bytes_max < HEADER_BYTES as u64 {
            return Err(bad(
                "object_bytes_max",
                "must hold at least a block header (4096 bytes)",
            ));
        }
        if self.fetch_buffer_bytes_max < self.object_bytes_max {
            return Err(bad(
                "fetch_buffer_bytes_max",
                "must be at least g4.object_bytes_max (one object must fit)",
            ));
        }
        if self.fetch_buffer_bytes_max / 4096 > u64::from(u32::MAX) {
            return Err(bad("fetch_buffer_bytes_max", "must be below 16TiB"));
        }
        if self.fetch_inflight_max == 0 {
            return Err(bad("fetch_inflight_max", "must be at least 1"));
        }
        if self.exists_cache_entries == 0 {
            return Err(bad("exists_cache_entries", "must be at least 1"));
        }
        Ok(())
    }

    /// The non-empty secrets of this config, to scrub from messages.
    pub(crate) fn secrets(&self) -> Vec<String> {
        let mut v: Vec<String> = [
            &self.access_key_id,
            &self.secret_access_key,
            &self.session_token,
        ]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
        for var in [
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
        ] {
            if let Ok(s) = std::env::var(var) {
                v.push(s);
            }
        }
        // Short strings would scrub ordinary words; real keys are long.
        v.retain(|s| s.len() >= 8);
        v
    }

    /// Whether static S3 keys are configured here or in the environment.
    pub fn static_keys_present(&self) -> bool {
        let env = |k: &str| std::env::var(k).is_ok_and(|v| !v.is_empty());
        (self.access_key_id.is_some() || env("AWS_ACCESS_KEY_ID"))
            && (self.secret_access_key.is_some() || env("AWS_SECRET_ACCESS_KEY"))
    }

    /// Why this config cannot reach its endpoint at all, if it cannot: a
    /// plain `http://` endpoint without `allow_http` (the S3 client refuses
    /// every request with a bare "builder error").
    pub fn endpoint_problem(&self) -> Option<String> {
        let http = self
            .endpoint
            .as_deref()
            .is_some_and(|e| e.trim_start().to_ascii_lowercase().starts_with("http://"));
        (http && !self.allow_http).then(|| {
            "g4.endpoint is a plain http:// URL but g4.allow_http is false, so every request \
             is refused: set g4.allow_http = true (a local or test store) or use https://"
                .to_string()
        })
    }

    /// Why this config cannot authenticate to an S3 store, if it cannot:
    /// `auto` with no static keys sends unsigned requests.
    pub fn credentials_problem(&self) -> Option<String> {
        let s3 = self.url.starts_with("s3://");
        (s3 && self.credentials == G4Credentials::Auto && !self.static_keys_present()).then(|| {
            "no S3 credentials configured: requests go unsigned; set g4.access_key_id and \
             g4.secret_access_key (or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY), or \
             g4.credentials = \"instance\" for the cloud's instance credentials, or \
             \"anonymous\" for a public bucket"
                .to_string()
        })
    }

    /// Builds the object store and the prefix under which kvtier keeps its
    /// objects.
    pub(crate) fn build_store(&self) -> Result<(Arc<dyn ObjectStore>, Path)> {
        self.validate()?;
        let bad_url = |problem: String| Error::Config {
            key: "g4.url".into(),
            problem,
        };
        if self.url == "memory://" || self.url == "memory:///" {
            return Ok((Arc::new(InMemory::new()), Path::default()));
        }
        if let Some(dir) = self.url.strip_prefix("file://") {
            if !dir.starts_with('/') {
                return Err(bad_url(format!(
                    "`{}`: file URLs need an absolute path (file:///path)",
                    self.url
                )));
            }
            std::fs::create_dir_all(dir).map_err(|e| Error::io("creating G4 directory", dir, e))?;
            let fs = LocalFileSystem::new_with_prefix(dir).map_err(|e| Error::ObjectStore {
                op: "open",
                location: dir.into(),
                detail: e.to_string(),
            })?;
            // Removes empty shard directories after deletes.
            let fs = fs.with_automatic_cleanup(true);
            return Ok((Arc::new(fs), Path::default()));
        }
        let Some(rest) = self.url.strip_prefix("s3://") else {
            return Err(bad_url(format!(
                "`{}`: expected s3://bucket/prefix, file:///path or memory://",
                self.url
            )));
        };
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(bad_url("no bucket in s3:// URL".into()));
        }
        let timeout = Duration::from_millis(self.request_timeout_ms);
        // The client options below replace the ones `from_env` read, so
        // `AWS_ALLOW_HTTP` is applied here or it would be lost.
        let allow_http = allow_http(self.allow_http, std::env::var("AWS_ALLOW_HTTP").ok());
        let mut b = AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_allow_http(allow_http)
            .with_virtual_hosted_style_request(!self.path_style)
            .with_client_options(
                ClientOptions::new()
                    .with_allow_http(allow_http)
                    .with_timeout(timeout)
                    .with_connect_timeout(Duration::from_millis(self.connect_timeout_ms)),
            )
            // kvtier retries uploads itself (with its own bounded queue) and
            // onboard has a deadline: keep the client's own retries short.
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(self.retry_backoff_ms.max(1)),
                    max_backoff: Duration::from_millis(self.retry_backoff_max_ms.max(1)),
                    base: 2.0,
                },
                max_retries: 2,
                retry_timeout: timeout,
            });
        if let Some(e) = &self.endpoint {
            b = b.with_endpoint(e);
        }
        if let Some(r) = &self.region {
            b = b.with_region(r);
        }
        if let Some(k) = &self.access_key_id {
            b = b.with_access_key_id(k);
        }
        if let Some(s) = &self.secret_access_key {
            b = b.with_secret_access_key(s);
        }
        if let Some(t) = &self.session_token {
            b = b.with_token(t);
        }
        if let Some(m) = &self.metadata_endpoint {
            b = b.with_metadata_endpoint(m);
        }
        match self.credentials {
            G4Credentials::Instance => {}
            G4Credentials::Anonymous => b = b.with_skip_signature(true),
            G4Credentials::Auto | G4Credentials::Static => {
                // object_store falls back to web identity, the container
                // endpoint and finally instance metadata (169.254.169.254)
                // when it finds no static keys; only `instance` may do that.
                if !self.static_keys_present() {
                    if self.credentials == G4Credentials::Static {
                        return Err(Error::Config {
                            key: "g4.credentials".into(),
                            problem: "\"static\" needs access_key_id and secret_access_key \
                                      (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
                                .into(),
                        });
                    }
                    b = b.with_skip_signature(true);
                }
            }
        }
        let s3 = b.build().map_err(|e| Error::Config {
            key: "g4".into(),
            problem: crate::tiers::g4::scrub::scrub(&e.to_string(), &self.secrets()),
        })?;
        Ok((Arc::new(s3), Path::from(prefix.trim_matches('/'))))
    }
}

/// Plain HTTP is allowed when the file says so or `AWS_ALLOW_HTTP` is
/// `true` (either one: the variable is the standard way for the AWS tools,
/// and `allow_http = false` is also the default, so it cannot veto it).
fn allow_http(from_config: bool, env: Option<String>) -> bool {
    from_config || env.is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
}
