//! Test support shared by this crate's tests, the facade's end-to-end
//! suites and the benchmarks: a real S3 server ([`s3`]), an object-store
//! wrapper that counts and injects faults ([`FaultStore`]), the tier
//! conformance suite ([`conformance`]) and an in-memory backend
//! ([`mem_backend`]). Compiled only for tests and with the `testkit`
//! feature (the facade's and tools' tests, `kvtier bench`); never in
//! `kvtierd`. Not a public API.

pub mod conformance;
pub mod fault_proxy;
pub mod mem_backend;
pub mod port;
pub mod s3;

use async_trait::async_trait;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

/// Wraps a store: counts GETs and PUTs, and can delay GETs or fail every
/// request (an unreachable store) on demand.
#[derive(Debug)]
pub struct FaultStore {
    inner: Arc<dyn ObjectStore>,
    /// GET requests seen (including ranged).
    pub gets: AtomicU64,
    /// PUT requests seen (single and multipart starts).
    pub puts: AtomicU64,
    /// Delay added before each GET, ms.
    pub get_delay_ms: AtomicU64,
    /// When set, every request fails with a generic (5xx-like) error.
    pub down: AtomicBool,
}

impl FaultStore {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn ObjectStore>) -> Arc<Self> {
        Arc::new(FaultStore {
            inner,
            gets: AtomicU64::new(0),
            puts: AtomicU64::new(0),
            get_delay_ms: AtomicU64::new(0),
            down: AtomicBool::new(false),
        })
    }

    fn check(&self) -> Result<()> {
        if self.down.load(SeqCst) {
            return Err(object_store::Error::Generic {
                store: "FaultStore",
                source: "injected: 503 Service Unavailable".into(),
            });
        }
        Ok(())
    }
}

impl std::fmt::Display for FaultStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FaultStore({})", self.inner)
    }
}

#[async_trait]
impl ObjectStore for FaultStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        self.puts.fetch_add(1, SeqCst);
        self.check()?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.puts.fetch_add(1, SeqCst);
        self.check()?;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        if !options.head {
            self.gets.fetch_add(1, SeqCst);
            let d = self.get_delay_ms.load(SeqCst);
            if d > 0 {
                tokio::time::sleep(Duration::from_millis(d)).await;
            }
        }
        self.check()?;
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.check()?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.check()?;
        self.inner.copy_opts(from, to, options).await
    }
}
