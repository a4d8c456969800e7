//! Daemon operations: `kvtier stats | ls | stat | verify | events | demo`,
//! all against a running `kvtierd` over its socket.

use anyhow::{bail, Context, Result};
use clap::Args;
use kvtier_client::proto::ItemStatus;
use kvtier_client::{
    BlockKey, Client, ClientConfig, HashMode, Hints, KvLayout, Namespace, NamespaceId, Onboarded,
    Tier,
};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where the daemon listens.
#[derive(Debug, Args, Clone)]
pub struct SocketArg {
    /// The daemon's socket (default: $KVTIER_SOCKET, else the daemon's
    /// default under the state directory).
    #[arg(long)]
    pub socket: Option<PathBuf>,
}

impl SocketArg {
    /// The socket named by `--socket` or `$KVTIER_SOCKET`, if any.
    fn explicit(&self) -> Option<PathBuf> {
        self.socket
            .clone()
            .or_else(|| std::env::var_os("KVTIER_SOCKET").map(PathBuf::from))
    }

    fn path(&self) -> PathBuf {
        self.socket
            .clone()
            .or_else(|| std::env::var_os("KVTIER_SOCKET").map(PathBuf::from))
            .unwrap_or_else(|| kvtier_daemon::app::config::default_data_dir().join("kvtierd.sock"))
    }
    pub(crate) fn client(&self) -> Result<Client> {
        let p = self.path();
        let mut c = ClientConfig::new(&p);
        c.region_bytes = 0;
        c.timeout_ms = 10_000;
        let c = Client::with_config(c);
        if let Err(e) = c.ensure_connected() {
            // A refusal is not a daemon that is down: the client's error
            // says what the caller lacks (kvtier_client::access_hint).
            let denied = matches!(&e, kvtier_client::Error::Unavailable { source, .. }
                if source.kind() == std::io::ErrorKind::PermissionDenied);
            let why = if denied {
                format!("cannot connect to kvtierd on {}", p.display())
            } else {
                format!("is kvtierd running on {}?", p.display())
            };
            return Err(anyhow::Error::new(e).context(why));
        }
        Ok(c)
    }
}

/// `--json`: one JSON document instead of text for people.
#[derive(Debug, Args, Clone, Copy)]
pub struct JsonArg {
    /// Print JSON (one document) instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `kvtier stats`.
#[derive(Debug, Args)]
pub struct StatsArgs {
    #[command(flatten)]
    sock: SocketArg,
    #[command(flatten)]
    out: JsonArg,
}

/// `kvtier ls`: a header line, then one line per block: path (as in the
/// mount), tier, payload bytes, block file bytes (what the mount's `stat`
/// shows).
#[derive(Debug, Args)]
pub struct LsArgs {
    #[command(flatten)]
    sock: SocketArg,
    /// Only this namespace (32 hex digits).
    #[arg(long)]
    namespace: Option<String>,
    /// Stop after this many blocks (default: all).
    #[arg(long)]
    limit: Option<u64>,
    #[command(flatten)]
    out: JsonArg,
}

/// `kvtier stat`.
#[derive(Debug, Args)]
pub struct StatArgs {
    #[command(flatten)]
    sock: SocketArg,
    /// `NAMESPACE/KEY` or `KEY` (then every namespace is searched).
    key: String,
    #[command(flatten)]
    out: JsonArg,
}

/// `kvtier verify`.
#[derive(Debug, Args)]
pub struct VerifyArgs {
    #[command(flatten)]
    sock: SocketArg,
    /// Verify every stored block.
    #[arg(long)]
    all: bool,
    /// Only this namespace.
    #[arg(long)]
    namespace: Option<String>,
    /// Only check: a bad block is still quarantined (never served), but
    /// no good copy is fetched from G4 or a peer to replace it.
    #[arg(long)]
    no_repair: bool,
    /// Blocks to verify, as `NAMESPACE/KEY`.
    keys: Vec<String>,
    #[command(flatten)]
    out: JsonArg,
}

/// `kvtier events`.
#[derive(Debug, Args)]
pub struct EventsArgs {
    #[command(flatten)]
    sock: SocketArg,
    /// Exit after this many events (printed ones).
    #[arg(long)]
    count: Option<u64>,
    /// `kvtier` (kvtier's own form, every event) or `dynamo` (NVIDIA
    /// Dynamo 1.6.1's RouterEvent JSON, events of dynamo-mode namespaces
    /// only; a lagged marker goes to stderr: resync the router).
    #[arg(long, default_value = "kvtier", value_parser = ["kvtier", "dynamo"])]
    format: String,
}

/// `kvtier demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    #[command(flatten)]
    sock: SocketArg,
    /// Namespace hash mode: `blake3` or `dynamo` (Dynamo's sequence hashes,
    /// token ids sent along, so `kvtier events --format dynamo` shows what
    /// a Dynamo router learns).
    #[arg(long, default_value = "blake3", value_parser = ["blake3", "dynamo"])]
    mode: String,
}

pub(crate) fn parse_ns(s: &str) -> Result<NamespaceId> {
    NamespaceId::from_hex(s).map_err(|_| {
        anyhow::anyhow!(
            "namespace {s:?} is not a namespace id: expected 32 hex digits (as `kvtier ls` \
             and `kvtier hash` print them)"
        )
    })
}

/// A pin time as people read it: `None` when not pinned, "forever" for a
/// pin without end (G3 reports those as `u64::MAX`).
fn pinned_until(ms: u64) -> Option<String> {
    match ms {
        0 => None,
        u64::MAX => Some("forever".into()),
        t => Some(format!("{t} (unix ms)")),
    }
}

pub(crate) fn parse_qualified(s: &str) -> Result<(Option<NamespaceId>, BlockKey)> {
    // `KEY`, `NS/KEY` or the path form `NS/SHARD/KEY`.
    let parts: Vec<&str> = s.split('/').collect();
    match parts.as_slice() {
        [k] => Ok((None, BlockKey::from_hex(k)?)),
        [ns, k] | [ns, _, k] => Ok((Some(parse_ns(ns)?), BlockKey::from_hex(k)?)),
        _ => bail!("{s:?}: expected KEY, NAMESPACE/KEY or NAMESPACE/SHARD/KEY"),
    }
}

/// Every (namespace, key) stored, optionally in one namespace.
fn all_blocks(
    c: &Client,
    ns: Option<NamespaceId>,
    limit: u64,
) -> Result<Vec<(NamespaceId, BlockKey, kvtier_client::proto::BlockStat)>> {
    let mut out = Vec::new();
    let mut after = None;
    loop {
        let (page, next) = c.list(ns, after, 1024)?;
        for e in page {
            if out.len() as u64 >= limit {
                return Ok(out);
            }
            out.push((e.ns, e.key, e.stat));
        }
        match next {
            Some(n) => after = Some(n),
            None => return Ok(out),
        }
    }
}

/// Prints daemon statistics.
pub fn stats(a: StatsArgs) -> Result<()> {
    let s = a.sock.client()?.stats()?;
    if a.out.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(());
    }
    print!("{}", stats_text(&s));
    Ok(())
}

/// `kvtier stats` for people: one line per tier, then the rest.
fn stats_text(s: &serde_json::Value) -> String {
    let mut out = format!("backend {}\n", s["backend"].as_str().unwrap_or("unknown"));
    let known = |v: &serde_json::Value| match v.as_u64() {
        Some(n) => n.to_string(),
        None => "not yet known".into(),
    };
    if let Some(tiers) = s["tiers"].as_object() {
        for (name, t) in tiers {
            let cap = match t["capacity_bytes"].as_u64() {
                Some(0) | None => "unbounded".to_string(),
                Some(c) => format!("{c} bytes"),
            };
            out += &format!(
                "{name}: {} blocks, {} bytes, capacity {cap}\n",
                known(&t["blocks"]),
                known(&t["bytes"]),
            );
        }
    }
    if let Some(o) = s.as_object() {
        for (k, v) in o {
            if k == "backend" || k == "tiers" || k == "namespaces" {
                continue;
            }
            let v = match v {
                serde_json::Value::Null => "none".to_string(),
                serde_json::Value::String(x) => x.clone(),
                other => other.to_string(),
            };
            out += &format!("{}: {v}\n", k.replace('_', " "));
        }
    }
    if let Some(list) = s["namespaces"].as_array().filter(|l| !l.is_empty()) {
        out += "namespaces (engine, model; lookups, blocks hit/missed at lookup and onboard, bytes onboarded and stored):\n";
        for n in list {
            let c = |k: &str| n[k].as_u64().unwrap_or(0);
            out += &format!(
                "  {} {} {}: lookups {}, lookup blocks {}/{}, onboard blocks {}/{}, onboard {} bytes, stored {} blocks {} bytes, reported corrupt {}\n",
                n["id"].as_str().unwrap_or("?"),
                n["engine"].as_str().unwrap_or("-"),
                n["model"].as_str().map(|m| format!("{m:?}")).unwrap_or_else(|| "-".into()),
                c("lookups"),
                c("lookup_hit_blocks"),
                c("lookup_miss_blocks"),
                c("onboard_hit_blocks"),
                c("onboard_miss_blocks"),
                c("onboard_bytes"),
                c("offload_blocks"),
                c("offload_bytes"),
                c("reported_corrupt_blocks"),
            );
        }
    }
    out
}

/// Engine and model per namespace, as connectors described them
/// (`kvtier stats`' `namespaces`); empty when the caller may not read the
/// daemon-wide stats (a tenant) or the daemon predates descriptions.
fn descriptions(c: &Client) -> std::collections::HashMap<String, (String, String)> {
    let Ok(s) = c.stats() else {
        return Default::default();
    };
    s["namespaces"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| {
            Some((
                n["id"].as_str()?.to_string(),
                (
                    n["engine"].as_str()?.to_string(),
                    n["model"].as_str()?.to_string(),
                ),
            ))
        })
        .collect()
}

/// Lists stored blocks.
pub fn ls(a: LsArgs) -> Result<()> {
    let c = a.sock.client()?;
    let ns = a.namespace.as_deref().map(parse_ns).transpose()?;
    let blocks = all_blocks(&c, ns, a.limit.unwrap_or(u64::MAX))?;
    let described = descriptions(&c);
    let desc = |n: &NamespaceId| described.get(&n.to_hex());
    // Both sizes, named: the payload (what the engine stored) and the
    // block file (header + padded payload: what `stat` on the mount and
    // `du` show).
    let file_bytes = |st: &kvtier_client::proto::BlockStat| {
        kvtier_client::block::HEADER_BYTES as u64
            + st.payload_len
                .next_multiple_of(kvtier_client::block::ALIGN_BYTES as u64)
    };
    if a.out.json {
        let v: Vec<serde_json::Value> = blocks
            .iter()
            .map(|(n, k, st)| {
                serde_json::json!({
                    "path": kvtier_client::block_path(n, k),
                    "namespace": n.to_hex(),
                    "key": k.to_hex(),
                    "tier": st.tier.name(),
                    "payload_len": st.payload_len,
                    "file_bytes": file_bytes(st),
                    "engine": desc(n).map(|d| d.0.as_str()),
                    "model": desc(n).map(|d| d.1.as_str()),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    // Said on stderr, so the table stays plain TSV: right after a G4
    // fall-through (kvtier demo) the blocks are G4-only while they are
    // promoted, and an empty table read as "nothing stored".
    eprintln!(
        "kvtier ls: blocks on this node's G3 ({}); blocks only in G4 or on peers are not listed (kvtier stats counts G4)",
        blocks.len()
    );
    // Engine and model last: scripts that cut the first four columns
    // keep working.
    println!("PATH\tTIER\tPAYLOAD_BYTES\tFILE_BYTES\tENGINE\tMODEL");
    for (n, k, st) in blocks {
        let file_bytes = file_bytes(&st);
        let (engine, model) = desc(&n).map_or(("-", "-"), |d| (d.0.as_str(), d.1.as_str()));
        println!(
            "{n}/{}/{k}\t{}\t{}\t{file_bytes}\t{engine}\t{model}",
            k.shard(),
            st.tier.name(),
            st.payload_len
        );
    }
    Ok(())
}

/// Shows one block's metadata.
pub fn stat(a: StatArgs) -> Result<()> {
    let c = a.sock.client()?;
    let (ns, key) = parse_qualified(&a.key)?;
    let candidates: Vec<NamespaceId> = match ns {
        Some(n) => vec![n],
        None => {
            let mut v: Vec<NamespaceId> = all_blocks(&c, None, u64::MAX)?
                .into_iter()
                .filter(|(_, k, _)| *k == key)
                .map(|(n, _, _)| n)
                .collect();
            v.dedup();
            v
        }
    };
    let mut found = false;
    for n in candidates {
        if let Some(s) = c.stat_ids(n, &[key])?.pop().flatten() {
            found = true;
            let pinned = s.pinned_until_unix_ms != 0;
            let j = serde_json::json!({
                "namespace": n.to_hex(),
                "key": key.to_hex(),
                "path": kvtier_client::block_path(&n, &key),
                "tier": s.tier.name(),
                "payload_len": s.payload_len,
                "checksum_algo": s.payload_sum.algo().name(),
                "checksum": s.payload_sum.to_hex(),
                "created_unix_ms": s.created_unix_ms,
                "pinned": pinned,
                // null: not pinned, or pinned without end (see "pinned").
                "pinned_until_unix_ms": (pinned && s.pinned_until_unix_ms != u64::MAX)
                    .then_some(s.pinned_until_unix_ms),
                "leases": s.leases,
            });
            if a.out.json {
                println!("{}", serde_json::to_string_pretty(&j)?);
            } else {
                println!("path: {}", kvtier_client::block_path(&n, &key));
                println!("tier: {}", s.tier.name());
                println!(
                    "payload: {} bytes, checksum {:?}",
                    s.payload_len, s.payload_sum
                );
                println!("created: {} (unix ms)", s.created_unix_ms);
                println!(
                    "pinned: {}",
                    pinned_until(s.pinned_until_unix_ms)
                        .map_or("no".into(), |p| format!("until {p}"))
                );
                println!("leases: {}", s.leases);
            }
        }
    }
    if !found {
        bail!("block {} not stored", a.key);
    }
    Ok(())
}

/// Verifies blocks on the daemon, repairing by default: a G3 copy that
/// fails is quarantined and replaced by a verified copy from G4 or a peer.
/// One line per block (`ok`, `repaired`, `dropped`, `absent`); exits
/// non-zero when any block was bad (repaired or dropped).
pub fn verify(a: VerifyArgs) -> Result<()> {
    let c = a.sock.client()?;
    let mut targets: Vec<(NamespaceId, BlockKey)> = Vec::new();
    if a.all || a.namespace.is_some() {
        let ns = a.namespace.as_deref().map(parse_ns).transpose()?;
        targets.extend(
            all_blocks(&c, ns, u64::MAX)?
                .into_iter()
                .map(|(n, k, _)| (n, k)),
        );
    }
    for k in &a.keys {
        match parse_qualified(k)? {
            (Some(n), key) => targets.push((n, key)),
            (None, _) => bail!("{k}: give NAMESPACE/KEY"),
        }
    }
    // `--all` on an empty node is a clean "0 blocks", not a usage error.
    if !a.all && a.namespace.is_none() && a.keys.is_empty() {
        bail!("nothing to verify: pass --all, --namespace or NAMESPACE/KEY");
    }
    let repair = !a.no_repair;
    let (mut ok, mut repaired, mut dropped, mut absent) = (0u64, 0u64, 0u64, 0u64);
    let mut rows: Vec<serde_json::Value> = Vec::new();
    let mut i = 0;
    while i < targets.len() {
        let ns = targets[i].0;
        let mut j = i;
        while j < targets.len() && targets[j].0 == ns && j - i < 128 {
            j += 1;
        }
        let keys: Vec<BlockKey> = targets[i..j].iter().map(|t| t.1).collect();
        for (k, st) in keys.iter().zip(c.verify_on_daemon(ns, &keys, repair)?) {
            let word = match st {
                ItemStatus::Ok => {
                    ok += 1;
                    "ok"
                }
                ItemStatus::Repaired => {
                    repaired += 1;
                    "repaired"
                }
                ItemStatus::Corrupt => {
                    dropped += 1;
                    "dropped"
                }
                ItemStatus::Absent => {
                    absent += 1;
                    "absent"
                }
                other => bail!("verify {ns}/{k}: daemon answered {other:?}"),
            };
            let path = kvtier_client::block_path(&ns, k);
            if a.out.json {
                rows.push(serde_json::json!({ "path": path, "result": word }));
            } else {
                println!("{word}\t{path}");
            }
        }
        i = j;
    }
    let total = ok + repaired + dropped + absent;
    if a.out.json {
        let j = serde_json::json!({
            "verified": total,
            "ok": ok,
            "repaired": repaired,
            "dropped": dropped,
            "absent": absent,
            "blocks": rows,
        });
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!(
            "verified {total} blocks: {ok} ok, {repaired} repaired, {dropped} dropped, {absent} absent"
        );
    }
    if repaired + dropped > 0 {
        bail!(
            "{} blocks failed verification ({repaired} repaired from a good copy, {dropped} \
             dropped: quarantined under the G3 directory's quarantine/)",
            repaired + dropped
        );
    }
    Ok(())
}

/// Follows the event stream, one JSON object per line.
pub fn events(a: EventsArgs) -> Result<()> {
    let c = a.sock.client()?;
    let mut s = c.subscribe_events()?;
    let mut n = 0u64;
    let dynamo = a.format == "dynamo";
    while a.count.is_none_or(|max| n < max) {
        let Some(e) = s.next_timeout(Duration::from_secs(1))? else {
            continue;
        };
        if !dynamo {
            println!("{}", e.to_json());
            n += 1;
        } else if let Some(j) = e.to_dynamo_json() {
            println!("{j}");
            n += 1;
        } else if let kvtier_client::KvEventData::Lagged { dropped } = e.data {
            eprintln!("lagged: {dropped} events lost; resync the router (kvtier ls)");
        }
    }
    Ok(())
}

/// A daemon this process started; SIGTERM on drop (then SIGKILL after 5 s).
pub struct OwnedDaemon {
    child: Child,
    /// Its socket.
    pub socket: PathBuf,
    /// Directories that live as long as the daemon (its data, its socket).
    _dirs: Vec<tempfile::TempDir>,
}

impl OwnedDaemon {
    /// The daemon's process id (its CPU time is read from /proc by the
    /// benches).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Starts `kvtierd` (found next to this executable, else on PATH) in a
    /// temporary directory with the given extra arguments.
    pub fn start(extra: &[&str]) -> Result<OwnedDaemon> {
        let dir = tempfile::Builder::new().prefix("kvtier-").tempdir()?;
        let socket = dir.path().join("kvtierd.sock");
        let exe = std::env::current_exe()?;
        let local = exe.with_file_name("kvtierd");
        let bin = if local.exists() {
            local
        } else {
            PathBuf::from("kvtierd")
        };
        let mut args: Vec<std::ffi::OsString> = vec![
            "--socket".into(),
            socket.clone().into(),
            "--g3-dir".into(),
            dir.path().join("g3").into(),
            "--metrics-addr".into(),
            "".into(),
        ];
        args.extend(extra.iter().map(Into::into));
        Self::spawn(&bin, &args, socket, vec![dir])
    }

    /// Starts `bin` with `args`, keeps `dirs` alive with it, and waits
    /// (20 s at most) until it listens on `socket`.
    pub fn spawn(
        bin: &Path,
        args: &[std::ffi::OsString],
        socket: PathBuf,
        dirs: Vec<tempfile::TempDir>,
    ) -> Result<OwnedDaemon> {
        use std::os::unix::process::CommandExt as _;
        let mut cmd = Command::new(bin);
        cmd.args(args).env("RUST_LOG", "warn").stdout(Stdio::null());
        // A daemon this process started ends with it, however it ends:
        // `kvtier demo | head` dies of SIGPIPE without running Drop, and
        // left its kvtierd running.
        // SAFETY: prctl is async-signal-safe; nothing else runs between
        // fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut d = OwnedDaemon {
            child,
            socket,
            _dirs: dirs,
        };
        let t = Instant::now();
        while std::os::unix::net::UnixStream::connect(&d.socket).is_err() {
            if let Ok(Some(st)) = d.child.try_wait() {
                bail!(
                    "{} exited at start ({st}); see its stderr above",
                    bin.display()
                );
            }
            if t.elapsed() > Duration::from_secs(20) {
                bail!("{} did not listen within 20 s", bin.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(d)
    }

    /// Kills it with SIGKILL and reaps it: a daemon that stops right after
    /// its acknowledgements, with no chance to flush anything.
    pub fn kill_hard(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for OwnedDaemon {
    fn drop(&mut self) {
        let pid = nix_pid(self.child.id());
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn nix_pid(id: u32) -> libc::pid_t {
    id as libc::pid_t
}

/// `println!` for the demo: a closed stdout (`kvtier demo | head`) ends it
/// with a BrokenPipe error instead of a SIGPIPE death, so its own daemon
/// and temporary directory are cleaned up (Drop) before the process goes
/// (main.rs then ends it by SIGPIPE, as other tools in a pipe end).
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($t)*)?
    }};
}

/// Shows an offload / lookup / onboard round trip. A socket named with
/// `--socket` or `$KVTIER_SOCKET` must have a daemon (else an error: the
/// user meant that one); with none named, the default socket's daemon is
/// used when it runs, else the demo says so and starts one of its own in
/// a temporary directory (with a file:// G4 beside it).
pub fn demo(a: DemoArgs) -> Result<()> {
    // A write to a closed pipe is an error here (say!), not a death: the
    // daemon and directory this demo may start are removed on the way out.
    // SAFETY: changing a signal disposition; no handler runs.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let _owned;
    let (socket, g4_dir): (PathBuf, Option<PathBuf>) = match a.sock.explicit() {
        Some(p) => {
            if std::os::unix::net::UnixStream::connect(&p).is_err() {
                bail!(
                    "no kvtierd answers on {} (named by --socket or $KVTIER_SOCKET); start it, \
                     or run `kvtier demo` without naming a socket to let it start its own",
                    p.display()
                );
            }
            say!("using the kvtierd running on {}", p.display());
            // Its G4 is its own business; the test daemons and the
            // embedded default keep a file:// one beside the socket.
            let beside = p.parent().map(|d| d.join("g4"));
            (p, beside)
        }
        None => {
            let path = a.sock.path();
            if std::os::unix::net::UnixStream::connect(&path).is_ok() {
                say!("using the kvtierd running on {}", path.display());
                let beside = path.parent().map(|d| d.join("g4"));
                (path, beside)
            } else {
                say!(
                    "no kvtierd on {}: starting one of its own for this demo (temporary directory, stopped at the end)",
                    path.display()
                );
                let d = OwnedDaemon::start(&["--g3-capacity", "256MiB"])?;
                say!("started kvtierd on {}", d.socket.display());
                let s = d.socket.clone();
                // OwnedDaemon puts G3 at <dir>/g3: the default G4 is <dir>/g4.
                let g4 = s.parent().map(|d| d.join("g4"));
                _owned = d;
                (s, g4)
            }
        }
    };
    let mode = HashMode::parse(&a.mode).unwrap_or_default();
    round_trip(&socket, mode)?;
    g4_fall_through(&socket, g4_dir.as_deref(), mode)
}

fn demo_namespace(mode: HashMode) -> Result<Namespace> {
    Ok(Namespace::new(
        "demo/llama-ish",
        KvLayout::with_block_bytes(256 << 10)?,
        "",
        "demo-tenant",
    )?
    .with_hash_mode(mode)?)
}

fn files_under(dir: &Path) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                files_under(&p)
            } else {
                1
            }
        })
        .sum()
}

fn g4_fall_through(socket: &Path, g4_dir: Option<&Path>, mode: HashMode) -> Result<()> {
    let ns = demo_namespace(mode)?;
    let client = Client::connect(socket)?;
    let h = client.namespace(&ns);
    // What `kvtier stats` and `kvtier ls` then show beside the namespace
    // id (an older daemon refuses the request: the demo goes on).
    let _ = h.describe("kvtier-demo");
    let tokens: Vec<u32> = (0..64).collect();
    let keys = h.hash_chain(&tokens);
    let Some(g4_dir) = g4_dir.filter(|d| d.is_dir()) else {
        say!(
            "G4 fall-through: skipped (no local file:// G4 at {}; this daemon's G4 is elsewhere or off)",
            g4_dir.map_or("-".into(), |d| d.display().to_string())
        );
        return Ok(());
    };
    // Uploads are asynchronous: wait until every block is in G4.
    let t = Instant::now();
    while files_under(&g4_dir.join("blocks")) < keys.len() {
        if t.elapsed() > Duration::from_secs(20) {
            bail!(
                "blocks did not reach G4 (file://{}) within 20 s: is it this daemon's G4? \
                 (see `g4 =` in its start-up log line)",
                g4_dir.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    say!(
        "G4: {} blocks written through to file://{} in {:?}",
        keys.len(),
        g4_dir.display(),
        t.elapsed()
    );
    h.evict(&keys)?;
    let l = h.lookup(&keys);
    say!(
        "evicted from G3; lookup now: cached prefix {} of {} ({:?})",
        l.prefix_len(),
        keys.len(),
        l.tiers.first()
    );
    let payloads: Vec<Vec<u8>> = (0..keys.len())
        .map(|i| (0..256 << 10).map(|j| (i * 31 + j) as u8).collect())
        .collect();
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; 256 << 10]).collect();
    let mut rb: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let t = Instant::now();
    let got = h.onboard_into(&keys, &mut rb);
    let from_g4 = got
        .iter()
        .filter(|g| matches!(g, Onboarded::Hit { tier: Tier::G4, .. }))
        .count();
    let misses = got
        .iter()
        .filter(|g| !matches!(g, Onboarded::Hit { .. }))
        .count();
    let same = bufs.iter().zip(&payloads).all(|(a, b)| a == b);
    if misses > 0 {
        say!(
            "onboard after eviction: {from_g4} of {} blocks from G4, {misses} misses (the blocks were not served; nothing to compare) in {:?}",
            keys.len(),
            t.elapsed()
        );
    } else {
        say!(
            "onboard after eviction: {from_g4} of {} blocks from G4 (verified, promoted to G3) in {:?}; bytes identical: {same}",
            keys.len(),
            t.elapsed()
        );
    }
    let again = h.lookup(&keys);
    say!(
        "lookup after the fall-through: cached prefix {} of {} ({:?})",
        again.prefix_len(),
        keys.len(),
        again.tiers.first()
    );
    if from_g4 != keys.len() || !same || l.tiers.iter().any(|t| *t != Tier::G4) {
        bail!("G4 fall-through failed");
    }
    // The promotion into G3 runs in the background (lookup already counts a
    // staged block as local): wait until the files are G3's, so `kvtier ls`
    // and `kvtier verify --all` run right after the demo see them.
    let t = Instant::now();
    loop {
        let (page, _) = client.list(Some(ns.id()), None, 1024)?;
        let on_g3 = keys
            .iter()
            .filter(|k| page.iter().any(|e| e.key == **k))
            .count();
        if on_g3 == keys.len() {
            say!(
                "promoted to G3: {on_g3} of {} blocks in {:?}",
                keys.len(),
                t.elapsed()
            );
            break;
        }
        if t.elapsed() > Duration::from_secs(20) {
            bail!(
                "the promotion into G3 did not finish within 20 s ({on_g3} of {} blocks)",
                keys.len()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    say!("G4 fall-through OK");
    Ok(())
}

fn round_trip(socket: &Path, mode: HashMode) -> Result<()> {
    let ns = demo_namespace(mode)?;
    let client = Client::connect(socket)?;
    let h = client.namespace(&ns);
    let tokens: Vec<u32> = (0..64).collect();
    let keys = h.hash_chain(&tokens);
    say!(
        "namespace {} ({} mode): {} tokens -> {} blocks of 256 KiB",
        ns.id(),
        ns.hash_mode.as_str(),
        tokens.len(),
        keys.len()
    );
    let before = h.lookup(&keys);
    say!(
        "lookup before offload: cached prefix {} of {}",
        before.prefix_len(),
        keys.len()
    );
    let payloads: Vec<Vec<u8>> = (0..keys.len())
        .map(|i| (0..256 << 10).map(|j| (i * 31 + j) as u8).collect())
        .collect();
    let refs: Vec<&[u8]> = payloads.iter().map(|p| &p[..]).collect();
    let t = Instant::now();
    // The tokens go along: in dynamo mode each header carries the block's
    // Dynamo routing facts (tokens_hash, token ids, parent).
    let (_, out) = h.offload_tokens(None, &tokens, &refs, Hints::default());
    let stored = out.iter().filter(|o| o.is_stored()).count();
    say!("offload: {stored} stored in {:?}", t.elapsed());
    let after = h.lookup(&keys);
    say!(
        "lookup after offload: cached prefix {} of {} ({:?})",
        after.prefix_len(),
        keys.len(),
        after.tiers.first()
    );
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; 256 << 10]).collect();
    let mut rb: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let t = Instant::now();
    let got = h.onboard_into(&keys, &mut rb);
    let hits = got
        .iter()
        .filter(|g| matches!(g, Onboarded::Hit { .. }))
        .count();
    let same = bufs.iter().zip(&payloads).all(|(a, b)| a == b);
    if hits < keys.len() {
        say!(
            "onboard: {hits} of {} blocks served, {} misses (nothing to compare) in {:?}",
            keys.len(),
            keys.len() - hits,
            t.elapsed()
        );
    } else {
        say!(
            "onboard: {hits} of {} blocks verified (checksum) in {:?}; bytes identical: {same}",
            keys.len(),
            t.elapsed()
        );
    }
    if hits != keys.len() || !same || after.prefix_len() != keys.len() {
        bail!("round trip failed");
    }
    say!("round trip OK");
    Ok(())
}
