//! Loopback ports for test and benchmark servers.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// A TCP port on 127.0.0.1 that bound just now and that no other call in
/// this process was given.
///
/// It lies below the kernel's ephemeral range (`ip_local_port_range`), so
/// no outgoing connection (an S3 client, a peer fetch) can take it between
/// this check and the server's own bind: a port from `bind(0)` could, and
/// CI saw `peer.bind ... Address already in use` (a peer port cannot be
/// re-picked on a retry: the other nodes' configs name it).
pub fn free_port() -> std::io::Result<u16> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768)
        .clamp(2048, 65535);
    let floor = 10_000u32.min(low / 2);
    let span = low - floor;
    // Processes running side by side (a Python suite, a second checkout)
    // start at different places.
    let base = std::process::id().wrapping_mul(7919) % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let Ok(port) = u16::try_from(floor + (base.wrapping_add(n)) % span) else {
            continue;
        };
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("no free TCP port on 127.0.0.1 in {floor}..{low} (below the ephemeral range)"),
    ))
}
