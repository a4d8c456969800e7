//! kvtierd: the per-node KV block store daemon.
//!
//! Configuration: embedded default < `--config FILE` < flags. Runs until
//! SIGTERM or SIGINT, then drains requests in flight and flushes. SIGHUP
//! is logged and ignored.

use anyhow::{Context, Result};
use clap::Parser;
use kvtier_daemon::app::config::Config;
use kvtier_daemon::base::backend::Backend;
use kvtier_daemon::base::events::EventBus;
use kvtier_daemon::base::units::parse_size;
use kvtier_daemon::edges::metrics::Metrics;
use kvtier_daemon::edges::server::{Server, ServerLimits, SocketOptions};
use kvtier_daemon::node::{Node, NodeConfig, PeerSetup};
use kvtier_daemon::tiers::g3::G3Config;
use kvtier_daemon::tiers::peer::PeerInfo;
use kvtier_daemon::tiers::policy::G4Admission;
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
    // allow_hyphen_values: `-1GiB` reaches the size parser (which says why
    // it is refused) instead of being read as an unknown flag.
    #[arg(long, value_parser = parse_size, allow_hyphen_values = true)]
    g3_capacity: Option<u64>,
    /// Unix socket path (overrides server.socket).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Prometheus address host:port, "" to disable (overrides metrics.addr).
    #[arg(long)]
    metrics_addr: Option<String>,
    /// G4 store URL: s3://bucket/prefix, file:///path, memory://, or "" to
    /// disable (overrides g4.url).
    #[arg(long)]
    g4: Option<String>,
    /// Enable peers, serving on host:port (overrides peer.bind).
    #[arg(long)]
    peer_listen: Option<String>,
    /// File with the peers' shared secret (overrides peer.secret_file).
    #[arg(long)]
    peer_secret_file: Option<PathBuf>,
    /// Static peers: id=host:port,id=host:port (replaces peer.peers).
    #[arg(long)]
    peers: Option<String>,
    /// Dynamo worker id of this node's events (overrides
    /// events.dynamo_worker_id).
    #[arg(long)]
    dynamo_worker_id: Option<u64>,
    /// This node's id (overrides peer.node_id; default: the hostname).
    #[arg(long)]
    node_id: Option<String>,
    /// Mount the store's filesystem view here (overrides mount.dir); ""
    /// turns the mount off.
    // An OsString parser: clap's PathBuf parser refuses "" as missing.
    #[arg(long, value_parser = clap::builder::ValueParser::os_string())]
    mount: Option<std::ffi::OsString>,
    /// Log format: text (colour only on a terminal) or json (overrides
    /// log.format).
    #[arg(long, value_parser = ["text", "json"])]
    log_format: Option<String>,
    /// Print the annotated default configuration and exit.
    #[arg(long)]
    print_default_config: bool,
    /// Read and validate the configuration (file and flags) and exit: 0 when
    /// valid, 2 with the error otherwise. Starts nothing.
    #[arg(long)]
    check_config: bool,
}

fn main() {
    if let Err(e) = run() {
        eprintln!(
            "kvtierd: {}",
            kvtier_daemon::base::error::cause_chain(e.as_ref())
        );
        std::process::exit(2);
    }
}

fn run() -> Result<()> {
    // Before anything is created: blocks, the index and a file:// G4 are
    // tenants' prompts, readable by the daemon's user only (at_rest.rs).
    kvtier_daemon::app::at_rest::set_private_umask();
    let args = Args::parse();
    if args.print_default_config {
        print!("{}", Config::default_toml());
        return Ok(());
    }
    // Flags > KVTIERD_* environment > file > default (config_env.rs).
    let env: Vec<(String, String)> = std::env::vars().collect();
    let (mut cfg, env_report) = Config::load_layered(args.config.as_deref(), &env)?;
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
    // [g4] / [peer] flags.
    if let Some(u) = args.g4 {
        cfg.g4.url = Some(u);
    }
    if let Some(l) = args.peer_listen {
        cfg.peer.enabled = true;
        cfg.peer.bind = l
            .parse()
            .map_err(|_| anyhow::anyhow!("--peer-listen: {l:?} is not host:port"))?;
    }
    if let Some(f) = args.peer_secret_file {
        cfg.peer.secret_file = Some(f);
    }
    if let Some(p) = args.peers {
        cfg.peer.peers = parse_peers(&p)?;
    }
    if let Some(id) = args.node_id {
        cfg.peer.node_id = Some(id);
    }
    if let Some(d) = args.mount {
        cfg.mount.dir = PathBuf::from(d);
    }
    if let Some(f) = args.log_format {
        cfg.log.format = f;
    }
    if let Some(w) = args.dynamo_worker_id {
        cfg.events.dynamo_worker_id = Some(w);
    }
    cfg.validate()?;
    // RUST_LOG overrides log.level: held to the same rule (a bare word
    // such as `loud` is a target name and would silence every line).
    if let Some(p) = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .and_then(|v| kvtier_daemon::app::config::log_level_problem(&v))
    {
        anyhow::bail!("environment: `RUST_LOG` (overrides `log.level`): {p}");
    }
    if args.check_config {
        for w in &env_report.warnings {
            eprintln!("kvtierd: warning: environment: {w}");
        }
        println!("kvtierd: configuration is valid");
        return Ok(());
    }

    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&cfg.log.level))
        .map_err(|e| anyhow::anyhow!("config: `log.level`: {e}"))?;
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if cfg.log.format == "json" {
        fmt.json().init();
    } else {
        // Escape codes only for a person at a terminal, never in a journal
        // or a file.
        use std::io::IsTerminal;
        fmt.with_ansi(std::io::stderr().is_terminal()).init();
    }
    for w in &env_report.warnings {
        tracing::warn!("environment: {w}");
    }
    for (var, key) in &env_report.applied {
        tracing::info!(variable = %var, key = %key, "configuration from the environment");
    }

    // Trees an earlier version (or a person) left readable are tightened,
    // links never followed.
    let mut private = vec![cfg.g3.dir.clone()];
    if let Some(dir) = cfg
        .g4
        .url
        .as_deref()
        .and_then(|u| u.strip_prefix("file://"))
    {
        private.push(PathBuf::from(dir));
    }
    kvtier_daemon::app::at_rest::tighten_and_log(&private)?;
    std::fs::create_dir_all(&cfg.g3.dir)
        .with_context(|| format!("config: `g3.dir`: cannot create {}", cfg.g3.dir.display()))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    // SIGHUP (an operator's reload habit, a closed terminal) before the
    // index opens: its default action would end the daemon at once, with
    // no log line and the socket and mount left stale.
    ignore_sighup(&rt)?;
    let node = Node::open(node_config(&cfg)?)?;
    let backend: Arc<dyn Backend> = node.clone();
    let metrics = Metrics::new().context("registering metrics")?;
    {
        let n = node.clone();
        metrics.set_figures(Arc::new(move || n.figures()));
    }
    let bus = EventBus::new();
    // Event ids and ZMQ sequence numbers never go back across a restart,
    // even with the clock behind the last run's (id_floor.rs).
    let (floor, first) =
        kvtier_daemon::base::id_floor::IdFloor::open(&cfg.g3.dir.join("event-ids"))?;
    bus.keep_ids_above(floor, first);
    let worker_id = cfg.events.worker_id(&node_id_or_hostname(&cfg));
    bus.set_dynamo_worker(worker_id);
    tracing::info!(dynamo_worker_id = worker_id, "events: Dynamo worker id");
    let zmq_bus = bus.clone();
    // Signal handlers before the socket exists: a SIGTERM sent as soon as
    // the socket appears (a supervisor, a test) must stop the daemon
    // cleanly, not kill it with the default action while it is mounting.
    let (mut term, mut int) = {
        use tokio::signal::unix::{signal, SignalKind};
        let _in_rt = rt.enter();
        (
            signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
        )
    };
    // The metrics listener too: when the socket appears, /metrics and
    // /healthz answer (connections wait in the backlog until it serves).
    let metrics_listener = if cfg.metrics.addr.is_empty() {
        None
    } else {
        let addr = cfg.metrics.addr.clone();
        let listener = rt
            .block_on(tokio::net::TcpListener::bind(&addr))
            .with_context(|| format!("config: `metrics.addr`: cannot listen on {addr}"))?;
        tracing::info!(addr = %listener.local_addr().map(|a| a.to_string()).unwrap_or(addr), "metrics on /metrics and /healthz");
        Some(listener)
    };
    let server = Server::bind(
        &SocketOptions {
            path: cfg.server.socket.clone(),
            mode: cfg.socket_mode()?,
            group: cfg.server.socket_group.clone(),
        },
        backend.clone(),
        metrics.clone(),
        bus,
        ServerLimits {
            max_connections: cfg.server.max_connections,
            idle_timeout_ms: cfg.server.idle_timeout_ms,
            hello_timeout_ms: cfg.server.hello_timeout_ms,
            io_timeout_ms: cfg.server.io_timeout_ms,
            region_bytes_max: cfg.server.region_bytes_max,
            leases_per_conn_max: cfg.server.leases_per_conn_max,
            onboard_reads_in_flight_max: cfg.server.onboard_reads_in_flight_max,
            onboard_batch_reads: cfg.server.onboard_batch_reads,
            drain_timeout_ms: 10_000,
            lease_ttl_max_ms: cfg.server.lease_ttl_max_ms,
        },
    )?;
    // From here a failed start (mount point in use, ZMQ or metrics
    // address taken) drops the server, which removes its socket file.
    // ---- [[tenants]] / [access] (docs/OPERATIONS.md, "Security") ----
    let policy = std::sync::Arc::new(kvtier_daemon::edges::access::Policy::from_config(
        &cfg.tenants,
        &cfg.access,
    )?);
    let mut server = server;
    server.set_access(
        policy.clone(),
        kvtier_daemon::app::config::uid_limits(&cfg, kvtier_daemon::base::events::SUBSCRIBERS_MAX),
    )?;
    tracing::info!(policy = ?policy, "access");
    // ---- end [[tenants]] ----
    let stop = server.shutdown_handle();

    // ---- [mount] (docs/FS.md) ----
    // The mount shows the node's G3; a read of a block G3 lacks falls
    // through to peers and G4 (the node's fetch hook), and the mount's
    // event log listens to the node's G3 events.
    // Imports are stored as offloads (event, G4 write-through, metrics);
    // `rm` and `user.kvtier.evict` go through the node's evict.
    let mount_handle = if cfg.mount.enabled() {
        let m_metrics = metrics.clone();
        let on_imported = Arc::new(move |h: &kvtier_client::BlockHeader| {
            m_metrics.offload_bytes.inc_by(h.payload_len);
            m_metrics
                .requests
                .with_label_values(&["mount_import"])
                .inc();
        });
        let hooks = kvtier_daemon::edges::mount::MountHooks {
            fetch: Some(node.fetch_hook()),
            import: Some(node.import_hook(on_imported)),
            evict: Some(node.evict_hook()),
        };
        let m = kvtier_daemon::edges::mount::start_with_hooks(
            &cfg.mount,
            node.g3().clone(),
            hooks,
            policy.clone(),
        )
        .with_context(|| format!("mounting at {}", cfg.mount.dir.display()))?;
        node.add_g3_listener(m.events().sink());
        metrics.set_mount(m.figures_source());
        Some(m)
    } else {
        None
    };
    // ---- end [mount] ----

    let (tx, rx) = tokio::sync::watch::channel(false);
    // ---- [events.zmq] (docs/OPERATIONS.md) ----
    let _zmq = if cfg.events.zmq.enabled() {
        let z = &cfg.events.zmq;
        let mut published = kvtier_daemon::edges::zmq::Published::default();
        for n in &z.namespaces {
            published.insert(
                kvtier_client::NamespaceId::from_hex(&n.id)?,
                kvtier_daemon::edges::zmq::PublishedNs {
                    salt: n.salt.clone(),
                    lora_name: n.lora_name.clone(),
                },
            );
        }
        let opts = kvtier_daemon::edges::zmq::ZmqOptions {
            endpoint: z.endpoint.clone(),
            replay_endpoint: Some(z.replay_endpoint.clone()).filter(|e| !e.is_empty()),
            topic: z.topic.clone(),
            replay_batches_max: z.replay_batches_max,
            announce_blocks_max: z.announce_blocks_max,
            dp_rank: z.dp_rank,
            heartbeat_ms: z.heartbeat_ms,
            ipc_mode: z.ipc_mode_bits()?,
            media: z.media()?,
            published,
            seq_floor: {
                let (f, first) =
                    kvtier_daemon::base::id_floor::IdFloor::open(&cfg.g3.dir.join("zmq-seqs"))?;
                Some((Arc::new(f), first))
            },
        };
        let n = node.clone();
        let holdings: kvtier_daemon::edges::zmq::Holdings =
            Arc::new(move |ns: &kvtier_client::NamespaceId, limit| n.g3_headers(ns, limit));
        let p =
            kvtier_daemon::edges::zmq::ZmqPublisher::start(opts, &zmq_bus, holdings, rt.handle())
                .context("starting the ZMQ event publisher ([events.zmq])")?;
        metrics.set_zmq_stats(p.stats());
        Some(p)
    } else {
        None
    };
    // ---- end [events.zmq] ----
    if let Some(listener) = metrics_listener {
        rt.spawn(kvtier_daemon::edges::metrics::serve(
            listener,
            metrics,
            backend.clone(),
            rx,
        ));
    }
    let stop2 = stop.clone();
    rt.spawn(async move {
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
        backend = backend.name(),
        g4 = %node.g4().map(|g| g.config().url.clone()).unwrap_or_default(),
        peer_addr = %node.peer_addr().map(|a| a.to_string()).unwrap_or_default(),
        "kvtierd ready"
    );
    let r = server.run();
    let _ = tx.send(true);
    if let Some(m) = mount_handle {
        if let Err(e) = m.unmount() {
            tracing::warn!(error = %e, "mount: unmount at shutdown failed");
        }
    }
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    r?;
    Ok(())
}

/// Logs each SIGHUP and goes on: kvtierd reloads nothing (every setting
/// is read at start), so a restart applies a changed config.
fn ignore_sighup(rt: &tokio::runtime::Runtime) -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = {
        let _in_rt = rt.enter();
        signal(SignalKind::hangup()).context("installing the SIGHUP handler")?
    };
    rt.spawn(async move {
        while hup.recv().await.is_some() {
            tracing::warn!(
                "SIGHUP: ignored; kvtierd reloads no setting (restart it to apply a changed config)"
            );
        }
    });
    Ok(())
}

/// `id=host:port,id=host:port`.
fn parse_peers(s: &str) -> Result<Vec<PeerInfo>> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (id, addr) = p
                .trim()
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("--peers: {p:?} is not id=host:port"))?;
            PeerInfo::new(id, addr).map_err(|e| anyhow::anyhow!("--peers: {e}"))
        })
        .collect()
}

/// `peer.node_id`, else the hostname (when a valid node id), else
/// `kvtier-node`.
fn node_id_or_hostname(cfg: &Config) -> String {
    match &cfg.peer.node_id {
        Some(id) => id.clone(),
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .ok()
            .filter(|h| kvtier_daemon::tiers::peer::validate_node_id(h).is_ok())
            .unwrap_or_else(|| "kvtier-node".into()),
    }
}

/// The node's configuration from the daemon's.
fn node_config(cfg: &Config) -> Result<NodeConfig> {
    let mut g3 = G3Config::new(cfg.g3.dir.clone(), cfg.g3.capacity);
    g3.high_watermark = cfg.g3.high_watermark;
    g3.low_watermark = cfg.g3.low_watermark;
    g3.engine = cfg.g3_engine()?;
    g3.sync_mode = cfg.g3_sync_mode()?;
    if let Some(q) = cfg.g3.quarantine_max {
        g3.quarantine_max_bytes = q;
    }
    g3.quarantine_max_files = cfg.g3.quarantine_max_files;
    if let Some(r) = cfg.g3.recycle_max {
        g3.recycle_pool_bytes = r;
    }
    g3.recycle_pool_files_max = cfg.g3.recycle_max_files;
    g3.recycle_unsettled_bytes_max = cfg.g3.recycle_unsettled_max;
    g3.slot_file_bytes_max = cfg.g3.slot_max;
    g3.open_tail_grace = std::time::Duration::from_millis(cfg.g3.open_tail_grace_ms);
    g3.lease_ttl_max_ms = u64::from(cfg.server.lease_ttl_max_ms);
    g3.leases_max = cfg.server.leases_per_conn_max.saturating_mul(64);
    // Named by a second kvtierd refused this directory (dir_lock.rs).
    g3.owner_note = format!("socket {}", cfg.server.socket.display());
    let mut n = NodeConfig::new(g3);
    n.scrub = kvtier_daemon::node::ScrubLimits {
        bytes_per_s: cfg.g3.scrub_bytes_per_s,
        pause_ms: cfg.g3.scrub_pause_ms,
    };
    n.policy = cfg.g3.policy.clone();
    n.g4 = cfg.g4.to_g4_config(&cfg.g3.dir).map(|mut g| {
        // The bucket's lifecycle views are named by node (one per node).
        g.node_id = Some(node_id_or_hostname(cfg));
        g
    });
    n.admission = cfg
        .g4
        .admission
        .parse::<G4Admission>()
        .map_err(|e| anyhow::anyhow!("config: `g4.admission`: {e}"))?;
    n.lookup_remote_deadline_ms = cfg.node.lookup_remote_deadline_ms;
    n.fetch_deadline_ms = cfg.node.fetch_deadline_ms;
    n.staged_bytes_max = cfg.node.staged_bytes_max;
    n.promote_queue_max = cfg.node.promote_queue_max;
    n.pins_max = cfg.server.pins_max;
    n.pin_ttl_max_ms = cfg.server.pin_ttl_max_ms;
    if cfg.peer.enabled {
        let node_id = node_id_or_hostname(cfg);
        let secret = cfg.peer.read_secret()?;
        n.peer = Some(PeerSetup {
            cfg: cfg.peer.clone(),
            node_id,
            secret,
            // Test hook for the end-to-end suites (a lying peer).
            corrupt_responses_for_tests: std::env::var("KVTIER_TEST_PEER_CORRUPT")
                .is_ok_and(|v| v == "1"),
        });
    }
    Ok(n)
}
