//! kvtierd: the per-node KV block store daemon.
//!
//! Configuration: embedded default < `--config FILE` < flags. Runs until
//! SIGTERM or SIGINT, then drains requests in flight and flushes.

use anyhow::{Context, Result};
use clap::Parser;
use kvtier_daemon::config::{parse_size, Config};
use kvtier_daemon::events::EventBus;
use kvtier_daemon::metrics::Metrics;
use kvtier_daemon::server::{Backend, MemBackend, MemLimits, Server, ServerLimits, SocketOptions};
use std::path::PathBuf;
use std::sync::Arc;

/// kvtierd: stores LLM KV-cache blocks for the inference workers of this node.
#[derive(Debug, Parser)]
#[command(name = "kvtierd", version, about)]
struct Args {
    /// TOML configuration file (see --print-default-config).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Directory of the local NVMe tier (overrides g3.dir).
    #[arg(long)]
    g3_dir: Option<PathBuf>,
    /// Capacity of the local tier, e.g. 100GiB (overrides g3.capacity).
    #[arg(long, value_parser = parse_size)]
    g3_capacity: Option<u64>,
    /// Unix socket path (overrides server.socket).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Prometheus address host:port, "" to disable (overrides metrics.addr).
    #[arg(long)]
    metrics_addr: Option<String>,
    /// Mount the store's filesystem view here (overrides mount.dir).
    #[arg(long)]
    mount: Option<PathBuf>,
    /// Print the annotated default configuration and exit.
    #[arg(long)]
    print_default_config: bool,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("kvtierd: {e:#}");
        std::process::exit(2);
    }
}

fn run() -> Result<()> {
    let args = Args::parse();
    if args.print_default_config {
        print!("{}", Config::default_toml());
        return Ok(());
    }
    let mut cfg = match &args.config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    if let Some(d) = args.g3_dir {
        cfg.g3.dir = d;
    }
    if let Some(c) = args.g3_capacity {
        cfg.g3.capacity = c;
    }
    if let Some(s) = args.socket {
        cfg.server.socket = s;
    }
    if let Some(m) = args.metrics_addr {
        cfg.metrics.addr = m;
    }
    if let Some(d) = args.mount {
        cfg.mount.dir = d;
    }
    cfg.validate()?;

    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&cfg.log.level))
        .map_err(|e| anyhow::anyhow!("config: `log.level`: {e}"))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();

    std::fs::create_dir_all(&cfg.g3.dir)
        .with_context(|| format!("config: `g3.dir`: cannot create {}", cfg.g3.dir.display()))?;
    // The real G3 + G4 store plugs in here (Backend over g3::, g4::, peers).
    tracing::warn!("backend: in-memory (blocks do not survive a restart until G3 is wired in)");
    let backend: Arc<dyn Backend> = Arc::new(MemBackend::new(
        MemLimits {
            capacity_bytes: cfg.g3.capacity,
            leases_max: cfg.server.leases_per_conn_max.saturating_mul(64),
            lease_ttl_max_ms: cfg.server.lease_ttl_max_ms,
            pins_max: cfg.server.pins_max,
            pin_ttl_max_ms: cfg.server.pin_ttl_max_ms,
        },
        &cfg.g3.dir,
    ));
    let metrics = Metrics::new().context("registering metrics")?;
    let server = Server::bind(
        &SocketOptions {
            path: cfg.server.socket.clone(),
            mode: cfg.socket_mode()?,
            group: cfg.server.socket_group.clone(),
        },
        backend.clone(),
        metrics.clone(),
        EventBus::new(),
        ServerLimits {
            max_connections: cfg.server.max_connections,
            idle_timeout_ms: cfg.server.idle_timeout_ms,
            io_timeout_ms: cfg.server.io_timeout_ms,
            region_bytes_max: cfg.server.region_bytes_max,
            leases_per_conn_max: cfg.server.leases_per_conn_max,
            drain_timeout_ms: 10_000,
            lease_ttl_max_ms: cfg.server.lease_ttl_max_ms,
        },
    )?;
    let stop = server.shutdown_handle();

    // ---- [mount] (docs/FS.md) ----
    // The mount shows a G3Store. While the server's backend is MemBackend
    // (its blocks live in memory, not in G3), the mount opens its own G3
    // over `g3.dir`: blocks enter it by `cp` into the mount. Once the
    // server runs over a Node, pass the Node's Arc<G3Store>, a fetch hook
    // over its G4/peers, and feed `mount.events()` from the Node's G3
    // event sink instead of setting the sink here.
    let mount_handle = if cfg.mount.enabled() {
        let g3 = kvtier_daemon::g3::G3Store::open(
            kvtier_daemon::g3::G3Config::new(&cfg.g3.dir, cfg.g3.capacity),
            Box::new(kvtier_daemon::policy::lru::Lru::new()),
        )
        .context("opening G3 for the mount")?;
        let m = kvtier_daemon::mount::start(&cfg.mount, g3.clone(), None)
            .with_context(|| format!("mounting at {}", cfg.mount.dir.display()))?;
        g3.set_event_sink(m.events().sink());
        Some((m, g3))
    } else {
        None
    };
    // ---- end [mount] ----

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let (tx, rx) = tokio::sync::watch::channel(false);
    if !cfg.metrics.addr.is_empty() {
        let addr = cfg.metrics.addr.clone();
        let listener = rt
            .block_on(tokio::net::TcpListener::bind(&addr))
            .with_context(|| format!("config: `metrics.addr`: cannot listen on {addr}"))?;
        tracing::info!(addr = %listener.local_addr().map(|a| a.to_string()).unwrap_or(addr), "metrics on /metrics and /healthz");
        rt.spawn(kvtier_daemon::metrics::serve(
            listener,
            metrics,
            backend.clone(),
            rx,
        ));
    }
    let stop2 = stop.clone();
    rt.spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            return;
        };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM"),
            _ = int.recv() => tracing::info!("SIGINT"),
        }
        stop2.trigger();
    });
    tracing::info!(
        socket = %cfg.server.socket.display(),
        g3_dir = %cfg.g3.dir.display(),
        capacity_bytes = cfg.g3.capacity,
        "kvtierd ready"
    );
    let r = server.run();
    let _ = tx.send(true);
    if let Some((m, g3)) = mount_handle {
        if let Err(e) = m.unmount() {
            tracing::warn!(error = %e, "mount: unmount at shutdown failed");
        }
        if let Err(e) = g3.close() {
            tracing::warn!(error = %e, "mount: closing G3 failed");
        }
    }
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    r?;
    Ok(())
}
