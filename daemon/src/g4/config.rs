//! G4 configuration and the one place that turns it into an `ObjectStore`.

use crate::error::{Error, Result};
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, RetryConfig};
use std::sync::Arc;
use std::time::Duration;

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
    /// Bytes of blocks G4 may hold before the sweeper deletes oldest first.
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
    /// Block files at least this large are uploaded in parts.
    pub multipart_threshold_bytes: u64,
    /// Part size of multipart uploads (S3 needs >= 5 MiB but the last).
    pub multipart_part_bytes: u64,
    /// Deadline of one object-store operation (a whole put or get).
    pub request_timeout_ms: u64,
    /// Deadline of `BlockTier::get` (fetch with a deadline takes its own).
    pub fetch_deadline_ms: u64,
    /// Distinct blocks being fetched at once at most; more are misses.
    pub fetch_inflight_max: usize,
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
            capacity_bytes: None,
            ttl_ms: None,
            sweep_interval_ms: 60_000,
            sweep_min_age_ms: 60_000,
            sweep_list_max: 1_000_000,
            upload_queue_max: 4096,
            upload_concurrency: 8,
            upload_retries: 12,
            retry_backoff_ms: 100,
            retry_backoff_max_ms: 5_000,
            multipart_threshold_bytes: 32 << 20,
            multipart_part_bytes: 8 << 20,
            request_timeout_ms: 30_000,
            fetch_deadline_ms: 10_000,
            fetch_inflight_max: 256,
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
            .field("capacity_bytes", &self.capacity_bytes)
            .field("ttl_ms", &self.ttl_ms)
            .field("upload_queue_max", &self.upload_queue_max)
            .field("upload_concurrency", &self.upload_concurrency)
            .field("request_timeout_ms", &self.request_timeout_ms)
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
        if self.request_timeout_ms == 0 || self.fetch_deadline_ms == 0 {
            return Err(bad("request_timeout_ms", "timeouts must be above 0"));
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
        let mut b = AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_allow_http(self.allow_http)
            .with_virtual_hosted_style_request(!self.path_style)
            .with_client_options(
                ClientOptions::new()
                    .with_allow_http(self.allow_http)
                    .with_timeout(timeout)
                    .with_connect_timeout(timeout.min(Duration::from_secs(5))),
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
        let s3 = b.build().map_err(|e| Error::Config {
            key: "g4".into(),
            problem: crate::g4::scrub::scrub(&e.to_string(), &self.secrets()),
        })?;
        Ok((Arc::new(s3), Path::from(prefix.trim_matches('/'))))
    }
}
