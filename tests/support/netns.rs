//! Network namespaces for the cluster test: a private L2 network (a
//! bridge in its own "hub" namespace, one veth pair per node) that has no
//! link to the root namespace and no route out, so every packet of the
//! test stays inside namespaces it created.
//!
//! Names are `kvtc-<pid>-<n>-<role>`: parallel runs (and parallel tests of
//! one run) never collide, and a run that was killed is recognised by its
//! dead pid and cleaned up by the next one ([`Net::new`]). Everything is
//! removed on drop: processes in the namespaces first (SIGKILL), then the
//! namespaces (their veths and the bridge go with them).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// Prefix of every namespace this module creates.
pub const PREFIX: &str = "kvtc-";
/// The private subnet (a /24; the same in every run, since each run's
/// network is its own).
pub const SUBNET: &str = "10.77.0";

static NEXT: AtomicU32 = AtomicU32::new(0);

/// Runs `ip ARGS`; `Err` with its stderr when it fails.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn ip_ok(args: &[&str]) {
    ip(args).unwrap_or_else(|e| panic!("{e}"));
}

/// Pids of the processes in namespace `ns`.
fn pids_in(ns: &str) -> Vec<i32> {
    let out = Command::new("ip")
        .args(["netns", "pids", ns])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    out.split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Kills what runs in `ns` and deletes it.
fn destroy(ns: &str) {
    for pid in pids_in(ns) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let _ = ip(&["netns", "del", ns]);
}

/// Why namespaces cannot be used here (`None`: they can).
pub fn unavailable() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not root (network namespaces need CAP_NET_ADMIN)".into());
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Some("`ip` (iproute2) is not installed; scripts/setup.sh installs it".into());
    }
    None
}

/// Deletes namespaces of earlier runs whose process is gone.
pub fn clean_leftovers() {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    for line in out.lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let pid: Option<i32> = rest.split('-').next().and_then(|p| p.parse().ok());
        let alive = pid.is_some_and(|p| std::path::Path::new(&format!("/proc/{p}")).exists());
        if !alive {
            eprintln!("netns: removing leftover namespace {name}");
            destroy(name);
        }
    }
}

/// One private network: the hub namespace with the bridge, and the
/// namespaces attached to it.
pub struct Net {
    base: String,
    hub: String,
    /// Attached namespaces: (role, namespace name).
    members: Vec<(String, String)>,
}

impl Net {
    /// A new network, after cleaning up leftovers of dead runs. `Err`: why
    /// it cannot be built here (the caller skips loudly).
    pub fn new() -> Result<Net, String> {
        if let Some(why) = unavailable() {
            return Err(why);
        }
        clean_leftovers();
        let base = format!(
            "{PREFIX}{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        );
        let hub = format!("{base}-hub");
        let net = Net {
            base,
            hub: hub.clone(),
            members: Vec::new(),
        };
        ip(&["netns", "add", &hub])?;
        ip(&["-n", &hub, "link", "set", "lo", "up"])?;
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        Ok(net)
    }

    /// Adds namespace `role` with address `10.77.0.<host>` on the bridge;
    /// returns its name. `Err` when the kernel refuses a step (no veth or
    /// bridge support): the first call's error is a reason to skip.
    pub fn add(&mut self, role: &str, host: u8) -> Result<String, String> {
        let ns = format!("{}-{role}", self.base);
        let port = format!("p-{role}");
        ip(&["netns", "add", &ns])?;
        self.members.push((role.to_string(), ns.clone()));
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        ip(&[
            "-n", &self.hub, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns",
            &ns,
        ])?;
        ip(&["-n", &self.hub, "link", "set", &port, "master", "br0"])?;
        ip(&["-n", &self.hub, "link", "set", &port, "up"])?;
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{SUBNET}.{host}/24"),
            "dev",
            "eth0",
        ])?;
        ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        Ok(ns)
    }

    /// The namespace of `role`.
    pub fn ns(&self, role: &str) -> &str {
        &self
            .members
            .iter()
            .find(|(r, _)| r == role)
            .unwrap_or_else(|| panic!("no namespace {role}"))
            .1
    }

    /// Cuts (`up = false`) or restores `role`'s port on the bridge: a
    /// partition of that node from every other.
    pub fn set_link(&self, role: &str, up: bool) {
        let port = format!("p-{role}");
        ip_ok(&[
            "-n",
            &self.hub,
            "link",
            "set",
            &port,
            if up { "up" } else { "down" },
        ]);
    }

    /// Limits what `role` sends to `rate` (tc tbf syntax, e.g. "40mbit"),
    /// or lifts the limit (`None`). `Err` when tc or tbf is unavailable.
    pub fn limit_egress(&self, role: &str, rate: Option<&str>) -> Result<(), String> {
        let ns = self.ns(role).to_string();
        let mut args = vec!["netns", "exec", &ns, "tc", "qdisc"];
        match rate {
            Some(r) => {
                args.extend(["replace", "dev", "eth0", "root", "tbf", "rate", r]);
                args.extend(["burst", "32kb", "latency", "400ms"]);
            }
            None => args.extend(["del", "dev", "eth0", "root"]),
        }
        ip(&args)
    }

    /// Removes `role`'s namespace now (a node leaving the network): its
    /// processes are killed, its veth disappears.
    pub fn remove(&mut self, role: &str) {
        if let Some(i) = self.members.iter().position(|(r, _)| r == role) {
            let (_, ns) = self.members.remove(i);
            destroy(&ns);
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for (_, ns) in self.members.drain(..) {
            destroy(&ns);
        }
        destroy(&self.hub);
    }
}

/// Runs `f` on a fresh thread that has entered namespace `ns`: sockets it
/// creates (and processes it spawns) belong to that namespace and stay
/// there after the thread ends. The test process itself stays where it was.
pub fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        // SAFETY: setns on a valid namespace fd affects only this thread.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .unwrap()
}

/// A TCP connection to `addr` made from inside namespace `ns`.
pub fn connect(ns: &str, addr: &str) -> std::io::Result<std::net::TcpStream> {
    let addr = addr.to_string();
    in_netns(ns, move || std::net::TcpStream::connect(addr))
}

/// What a [`DelayProxy`] does to the chunks it forwards.
#[derive(Debug, Clone, Copy)]
pub struct Link {
    /// Delay before every chunk, ms.
    pub delay_ms: u64,
    /// Every this many chunks (0: never), a stall as for a lost segment.
    pub stall_every: u64,
    /// Length of that stall, ms.
    pub stall_ms: u64,
}

/// A userspace TCP proxy inside a namespace that delays every chunk it
/// forwards (this kernel has no `tc netem`): latency between namespaces.
/// Stops accepting on drop; connections in flight end when either side
/// closes.
pub struct DelayProxy {
    /// `host:port` it listens on.
    pub addr: String,
    /// Bytes forwarded upstream-to-client so far (proof traffic used it).
    pub bytes_down: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl DelayProxy {
    /// Listens on `listen` in `ns` and forwards to `upstream`, sleeping
    /// `delay_ms` before each chunk in either direction, and
    /// `link.stall_ms` more before every `link.stall_every`-th chunk (what
    /// a lost segment costs TCP: a retransmission timeout; a userspace
    /// proxy cannot drop segments of a TCP stream, only delay them).
    pub fn start(ns: &str, listen: &str, upstream: &str, link: Link) -> DelayProxy {
        use std::sync::atomic::{AtomicBool, AtomicU64};
        use std::sync::Arc;
        let listener = {
            let l = listen.to_string();
            in_netns(ns, move || std::net::TcpListener::bind(l)).unwrap()
        };
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let bytes_down = Arc::new(AtomicU64::new(0));
        let (stop2, down2, up) = (stop.clone(), bytes_down.clone(), upstream.to_string());
        let nsname = ns.to_string();
        // The accept thread runs in the namespace, so its upstream
        // connections are made there too.
        std::thread::spawn(move || {
            in_netns(&nsname, move || {
                while !stop2.load(Ordering::SeqCst) {
                    let (client, _) = match listener.accept() {
                        Ok(c) => c,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(std::time::Duration::from_millis(10));
                            continue;
                        }
                        Err(_) => return,
                    };
                    let _ = client.set_nonblocking(false);
                    let Ok(server) = std::net::TcpStream::connect(&up) else {
                        continue;
                    };
                    let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                    let counter = down2.clone();
                    std::thread::spawn(move || pump(client, server, link, None));
                    std::thread::spawn(move || pump(s2, c2, link, Some(counter)));
                }
            })
        });
        DelayProxy {
            addr: listen.to_string(),
            bytes_down,
            stop,
        }
    }
}

fn pump(
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    link: Link,
    counter: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
) {
    use std::io::{Read, Write};
    let mut buf = vec![0u8; 64 << 10];
    let mut chunks = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        chunks += 1;
        let mut ms = link.delay_ms;
        if link.stall_every > 0 && chunks.is_multiple_of(link.stall_every) {
            ms += link.stall_ms;
        }
        std::thread::sleep(std::time::Duration::from_millis(ms));
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
        if let Some(c) = &counter {
            c.fetch_add(n as u64, Ordering::SeqCst);
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
    let _ = from.shutdown(std::net::Shutdown::Read);
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}
