//! A real S3-compatible server for tests and benchmarks: SeaweedFS
//! (`weed mini`, installed into `.venv/bin/weed` by scripts/setup.sh),
//! bound to 127.0.0.1 on free ports, with access keys so authentication is
//! exercised. Killed on drop; restartable on the same directory and ports.

use crate::tiers::g4::G4Config;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Access key id the test server accepts.
pub const ACCESS_KEY_ID: &str = "kvtier-test-access-key";

/// A running SeaweedFS; the data directory is removed on drop.
pub struct S3Server {
    child: Option<Child>,
    dir: tempfile::TempDir,
    weed: PathBuf,
    ports: [u16; 10],
    /// Address it binds and is reached at (127.0.0.1 unless
    /// [`S3Server::start_on`] chose another, e.g. in a network namespace).
    ip: String,
    /// Bucket created at start.
    pub bucket: String,
    /// Secret key of [`ACCESS_KEY_ID`] (unique per server).
    pub secret_access_key: String,
}

/// Where `weed` is: `$KVTIER_WEED`, else `.venv/bin/weed` in the first
/// ancestor of the current directory (or of this crate) that has one.
pub fn find_weed() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("KVTIER_WEED") {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let starts = [
        std::env::current_dir().ok(),
        Some(PathBuf::from(env!("CARGO_MANIFEST_DIR"))),
    ];
    for start in starts.into_iter().flatten() {
        for dir in start.ancestors() {
            let p = dir.join(".venv/bin/weed");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

impl S3Server {
    /// Starts a server with bucket `bucket` and waits until an
    /// authenticated request succeeds. `Ok(None)`: weed is not installed
    /// (the caller prints a SKIP line).
    pub fn start(bucket: &str) -> std::io::Result<Option<S3Server>> {
        Self::start_on(bucket, "127.0.0.1")
    }

    /// Like [`S3Server::start`], bound to and reached at `ip`. The cluster
    /// test calls it from a thread inside a network namespace, so the
    /// server (a child of that thread) and the readiness probe live there.
    pub fn start_on(bucket: &str, ip: &str) -> std::io::Result<Option<S3Server>> {
        let Some(weed) = find_weed() else {
            return Ok(None);
        };
        let dir = tempfile::Builder::new().prefix("kvtier-s3-").tempdir()?;
        let ports = free_ports()?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let secret = format!("kvtierSecret{}x{nanos}", std::process::id());
        let config = serde_json::json!({
            "identities": [{
                "name": "kvtier",
                "credentials": [{"accessKey": ACCESS_KEY_ID, "secretKey": secret}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]
            }]
        });
        std::fs::create_dir_all(dir.path().join("data"))?;
        std::fs::write(dir.path().join("s3.json"), config.to_string())?;
        let mut s = S3Server {
            child: None,
            dir,
            weed,
            ports,
            ip: ip.to_string(),
            bucket: bucket.to_string(),
            secret_access_key: secret,
        };
        // The ports are free when chosen, not when weed binds them: a
        // listener of a test running beside this one (a peer server, a
        // proxy) can take one in between, and weed exits at once. Fresh
        // ports then, a few times (seen in CI: "weed exited with exit
        // status: 255").
        let mut attempt = 1;
        loop {
            s.spawn()?;
            match s.wait_ready(Duration::from_secs(60)) {
                Ok(()) => return Ok(Some(s)),
                Err(e) if attempt < 4 && s.exited() => {
                    eprintln!("S3 test server did not start ({e}); retrying on other ports");
                    s.kill();
                    // A clean data dir: nothing recorded under the old ports.
                    let data = s.dir.path().join("data");
                    let _ = std::fs::remove_dir_all(&data);
                    std::fs::create_dir_all(&data)?;
                    s.ports = free_ports()?;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether the weed process has exited.
    fn exited(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))))
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        let p = self.ports;
        let d = self.dir.path();
        let arg = |k: &str, v: u16| format!("-{k}={v}");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(d.join("weed.log"))?;
        let child = Command::new(&self.weed)
            .arg("mini")
            .arg(format!("-dir={}", d.join("data").display()))
            .arg(format!("-ip={}", self.ip))
            .arg(format!("-ip.bind={}", self.ip))
            .arg("-admin.ui=false")
            .args(["-webdav=false", "-master.telemetry=false"])
            .args(["-s3.port.iceberg=0", "-s3.port.lance=0"])
            .arg(format!("-bucket={}", self.bucket))
            .arg(format!("-s3.config={}", d.join("s3.json").display()))
            .arg(arg("master.port", p[0]))
            .arg(arg("master.port.grpc", p[1]))
            .arg(arg("volume.port", p[2]))
            .arg(arg("volume.port.grpc", p[3]))
            .arg(arg("filer.port", p[4]))
            .arg(arg("filer.port.grpc", p[5]))
            .arg(arg("s3.port", p[6]))
            .arg(arg("s3.port.grpc", p[7]))
            .arg(arg("admin.port", p[8]))
            .arg(arg("admin.port.grpc", p[9]))
            .current_dir(d)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }

    /// `http://<ip>:<port>` (127.0.0.1 by default).
    pub fn endpoint(&self) -> String {
        format!("http://{}:{}", self.ip, self.ports[6])
    }

    /// The data directory (kept across [`S3Server::restart`]).
    pub fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    /// A G4 config for `s3://<bucket>/<prefix>` on this server, with its
    /// credentials and short timeouts suited to tests.
    pub fn g4_config(&self, prefix: &str) -> G4Config {
        G4Config {
            endpoint: Some(self.endpoint()),
            region: Some("us-east-1".into()),
            allow_http: true,
            path_style: true,
            access_key_id: Some(ACCESS_KEY_ID.into()),
            secret_access_key: Some(self.secret_access_key.clone()),
            request_timeout_ms: 10_000,
            ..G4Config::new(format!("s3://{}/{}", self.bucket, prefix))
        }
    }

    /// Kills the server (SIGKILL: a crash, not a clean stop).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // weed puts Unix sockets named after its ports in /tmp and a killed
        // weed leaves them behind: remove the ones with our ports.
        let Ok(entries) = std::fs::read_dir("/tmp") else {
            return;
        };
        let suffixes: Vec<String> = self.ports.iter().map(|p| format!("-{p}.sock")).collect();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("seaweedfs-") && suffixes.iter().any(|s| name.ends_with(s)) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    /// Starts it again on the same directory and ports, and waits.
    pub fn restart(&mut self) -> std::io::Result<()> {
        self.kill();
        self.spawn()?;
        self.wait_ready(Duration::from_secs(60))
    }

    /// Waits until an authenticated PUT and GET on the bucket succeed.
    pub fn wait_ready(&mut self, timeout: Duration) -> std::io::Result<()> {
        let cfg = self.g4_config("");
        let (store, _) = cfg
            .build_store()
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let t0 = Instant::now();
        loop {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    return Err(std::io::Error::other(format!(
                        "weed exited with {st}; see {}",
                        self.dir.path().join("weed.log").display()
                    )));
                }
            }
            let ok = rt.block_on(async {
                use object_store::ObjectStoreExt;
                let p = object_store::path::Path::from("ready-probe");
                let r = tokio::time::timeout(Duration::from_secs(2), async {
                    store.put(&p, "ok".into()).await?;
                    store.get(&p).await?.bytes().await
                })
                .await;
                matches!(r, Ok(Ok(_)))
            });
            if ok {
                return Ok(());
            }
            if t0.elapsed() > timeout {
                return Err(std::io::Error::other(format!(
                    "S3 server not ready after {timeout:?}; see {}",
                    self.dir.path().join("weed.log").display()
                )));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Ten distinct ports free now on loopback, below the ephemeral range
/// (see [`super::port::free_port`]).
fn free_ports() -> std::io::Result<[u16; 10]> {
    let mut ports = [0u16; 10];
    for p in ports.iter_mut() {
        *p = super::port::free_port()?;
    }
    Ok(ports)
}
