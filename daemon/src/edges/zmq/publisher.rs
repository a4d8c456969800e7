//! The publisher: a bridge thread from the event bus, a PUB task and a
//! replay (ROUTER) task on the daemon's runtime.

use super::wire::{self, WireEvent};
use super::{Holdings, Published, ZmqOptions, ZmqStats};
use crate::base::error::{Error, Result};
use crate::base::events::{EventBus, Subscription};
use crate::warn_limited;
use bytes::Bytes;
use kvtier_client::events::StorageTier;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// Batches between the bridge thread and the PUB task (the bus queue in
/// front of it is the one that drops).
const BRIDGE_BATCHES_MAX: usize = 1024;
/// Events per batch of a holdings announcement.
const ANNOUNCE_EVENTS_PER_BATCH: usize = 256;
/// vLLM's end-of-replay sequence number (-1 as a signed big-endian u64).
const END_SEQ: [u8; 8] = [0xff; 8];
/// The most one peer may send in one message, frame headers included:
/// subscribers send subscriptions (a topic), replay clients `["", seq]`,
/// both a READY command with a few properties first. A frame header that
/// announces more is refused before anything is reserved for it and the
/// peer is disconnected (zeromq reserves what a header announces: 73 bytes
/// naming 64 TiB aborted the daemon).
const INBOUND_MESSAGE_BYTES_MAX: usize = 64 << 10;

/// Options of both sockets.
fn socket_options() -> zeromq::SocketOptions {
    let mut o = zeromq::SocketOptions::default();
    o.max_message_size(INBOUND_MESSAGE_BYTES_MAX);
    o
}

static SEND_LOG: crate::base::log_limit::LogLimit = crate::base::log_limit::LogLimit::new(10_000);
static RECV_LOG: crate::base::log_limit::LogLimit = crate::base::log_limit::LogLimit::new(10_000);

/// The pause after `failures` receives in a row failed: 10 ms, doubling,
/// at most 1 s.
fn recv_pause(failures: u32) -> Duration {
    Duration::from_millis(10u64 << failures.saturating_sub(1).min(7)).min(Duration::from_secs(1))
}

/// After a failed receive on the replay socket: logs it (a line per 10 s,
/// the rest counted) and pauses ([`recv_pause`]), so a socket that fails
/// at once every time cannot spin a worker. `false`: stop was asked.
async fn after_recv_failure(
    failures: u32,
    error: &(dyn std::fmt::Display + Sync),
    stop: &mut tokio::sync::watch::Receiver<bool>,
) -> bool {
    warn_limited!(RECV_LOG, failures, error = %error, "events.zmq: replay receive failed");
    tokio::select! {
        _ = tokio::time::sleep(recv_pause(failures)) => true,
        _ = stop.changed() => false,
    }
}

/// The batches kept for replay.
struct Ring {
    max: usize,
    batches: VecDeque<(u64, Bytes)>,
}

impl Ring {
    fn push(&mut self, seq: u64, payload: Bytes) {
        if self.batches.len() == self.max {
            self.batches.pop_front();
        }
        self.batches.push_back((seq, payload));
    }

    /// The kept batches from `start` on, and whether `start` is older than
    /// every kept batch (some are gone).
    fn since(&self, start: u64) -> (Vec<(u64, Bytes)>, bool) {
        let gone = self.batches.front().is_some_and(|(s, _)| start < *s);
        let v = self
            .batches
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        (v, gone)
    }

    /// The newest batch's sequence number.
    fn newest(&self) -> Option<u64> {
        self.batches.back().map(|(s, _)| *s)
    }
}

/// A snapshot's batches, merged into at most `room` (at least one).
fn pack(batches: Vec<Vec<WireEvent>>, room: u64) -> Vec<Vec<WireEvent>> {
    let room = room.max(1);
    if batches.len() as u64 <= room {
        return batches;
    }
    let all: Vec<WireEvent> = batches.into_iter().flatten().collect();
    let per = all.len().div_ceil(room as usize).max(1);
    all.chunks(per).map(<[WireEvent]>::to_vec).collect()
}

/// The replies to a replay from `start` when batches it needs are gone:
/// the snapshot (AllBlocksCleared and the holdings, which stand for every
/// kept batch too) numbered so that it ends at `newest`, the newest batch
/// sent, contiguous and never above it: the consumer's next live batch is
/// then `newest + 1`, as a Dynamo listener's replay check wants (batches
/// in order, none missing; `first > start` only says the older ones are
/// gone). More batches than numbers in `start..=newest` are merged.
fn numbered_snapshot(
    snap: Vec<Vec<WireEvent>>,
    start: u64,
    newest: u64,
) -> Vec<(u64, Vec<WireEvent>)> {
    let packed = pack(snap, newest.saturating_sub(start).saturating_add(1));
    let first = newest.saturating_add(1).saturating_sub(packed.len() as u64);
    packed
        .into_iter()
        .enumerate()
        .map(|(i, b)| (first + i as u64, b))
        .collect()
}

/// A running publisher; stops when dropped.
pub struct ZmqPublisher {
    stats: Arc<ZmqStats>,
    endpoint: String,
    replay_endpoint: Option<String>,
    stop: Arc<AtomicBool>,
    stop_tx: tokio::sync::watch::Sender<bool>,
    bridge: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for ZmqPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ZmqPublisher({})", self.endpoint)
    }
}

fn bind_err(key: &str, ep: &str, e: impl std::fmt::Display) -> Error {
    Error::Config {
        key: key.into(),
        problem: format!("cannot bind {ep}: {e}"),
    }
}

/// `ipc://` socket files get `events.zmq.ipc_mode`.
fn chmod_ipc(ep: &str, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    if let Some(path) = ep.strip_prefix("ipc://") {
        if let Err(e) = std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)) {
            tracing::warn!(path, error = %e, "events.zmq: cannot set the ipc socket's mode");
        }
    }
}

/// A socket file left by a killed run blocks the bind: remove it when it
/// is a socket nobody listens on (never another kind of file, never a live
/// publisher's).
fn clear_stale_ipc(ep: &str) {
    use std::os::unix::fs::FileTypeExt;
    let Some(path) = ep.strip_prefix("ipc://") else {
        return;
    };
    let is_socket = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket());
    if is_socket && std::os::unix::net::UnixStream::connect(path).is_err() {
        let _ = std::fs::remove_file(path);
    }
}

fn now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// `AllBlocksCleared`, then every covered namespace's G3 holdings, in
/// batches.
fn snapshot(
    published: &Published,
    holdings: &Holdings,
    limit: usize,
    stats: &ZmqStats,
) -> Vec<Vec<WireEvent>> {
    stats.resyncs.fetch_add(1, Ordering::Relaxed);
    let mut events = Vec::new();
    let mut left = limit;
    let mut ids: Vec<_> = published.ids().copied().collect();
    ids.sort();
    for ns in ids {
        // One more than allowed tells whether some were left out.
        let headers = holdings(&ns, left.saturating_add(1));
        if headers.len() > left {
            stats
                .announce_truncated
                .fetch_add((headers.len() - left) as u64, Ordering::Relaxed);
        }
        let headers: Vec<_> = headers.into_iter().take(left).collect();
        left -= headers.len();
        let in_g4: Vec<_> = headers
            .iter()
            .filter(|(_, g4)| *g4)
            .map(|(h, _)| h.clone())
            .collect();
        let on_g3 = headers.into_iter().map(|(h, _)| h).collect();
        events.extend(published.holdings(&ns, on_g3, StorageTier::Disk, stats));
        events.extend(published.holdings(&ns, in_g4, StorageTier::External, stats));
    }
    let mut batches = vec![vec![WireEvent::Cleared]];
    batches.extend(
        events
            .chunks(ANNOUNCE_EVENTS_PER_BATCH)
            .map(<[WireEvent]>::to_vec),
    );
    batches
}

impl ZmqPublisher {
    /// Binds the sockets on `rt` and starts publishing what `bus` carries
    /// for the covered namespaces, beginning with the start-up
    /// announcement.
    pub fn start(
        opts: ZmqOptions,
        bus: &EventBus,
        holdings: Holdings,
        rt: &tokio::runtime::Handle,
    ) -> Result<Self> {
        // zeromq's sockets spawn their tasks on the current runtime.
        let _rt = rt.enter();
        let mut pub_sock = zeromq::PubSocket::with_options(socket_options());
        clear_stale_ipc(&opts.endpoint);
        let bound = rt
            .block_on(pub_sock.bind(&opts.endpoint))
            .map_err(|e| bind_err("events.zmq.endpoint", &opts.endpoint, e))?;
        let endpoint = bound.to_string();
        chmod_ipc(&endpoint, opts.ipc_mode);
        let mut router = None;
        let mut replay_endpoint = None;
        if let Some(ep) = &opts.replay_endpoint {
            let mut r = zeromq::RouterSocket::with_options(socket_options());
            clear_stale_ipc(ep);
            let b = rt
                .block_on(r.bind(ep))
                .map_err(|e| bind_err("events.zmq.replay_endpoint", ep, e))?;
            replay_endpoint = Some(b.to_string());
            chmod_ipc(&b.to_string(), opts.ipc_mode);
            router = Some(r);
        }
        let sub = bus.subscribe().ok_or(Error::LimitReached {
            what: "event subscribers",
            limit: crate::base::events::SUBSCRIBERS_MAX as u64,
        })?;
        let stats = Arc::new(ZmqStats::default());
        let ring = Arc::new(Mutex::new(Ring {
            max: opts.replay_batches_max.max(1),
            batches: VecDeque::new(),
        }));
        let (tx, rx) = mpsc::channel(BRIDGE_BATCHES_MAX);
        let stop = Arc::new(AtomicBool::new(false));
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let clock = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        let seq0 = clock.max(opts.seq_floor.as_ref().map_or(0, |(_, first)| *first));
        rt.spawn(live(
            pub_sock,
            rx,
            ring.clone(),
            Bytes::from(opts.topic.clone().into_bytes()),
            (seq0, opts.seq_floor.clone().map(|(f, _)| f)),
            (opts.dp_rank, opts.media),
            Some(Duration::from_millis(opts.heartbeat_ms)).filter(|d| !d.is_zero()),
            stats.clone(),
            stop_rx.clone(),
        ));
        if let Some(r) = router {
            rt.spawn(replay(
                r,
                ring,
                opts.clone(),
                holdings.clone(),
                stats.clone(),
                stop_rx,
            ));
        }
        let bridge = {
            let (stats, stop) = (stats.clone(), stop.clone());
            std::thread::Builder::new()
                .name("kvtier-zmq".into())
                .spawn(move || bridge(sub, opts, holdings, stats, tx, stop))
                .map_err(|e| Error::Io {
                    op: "spawning the ZMQ publisher thread",
                    path: Default::default(),
                    source: e,
                })?
        };
        tracing::info!(
            endpoint = %endpoint,
            replay_endpoint = %replay_endpoint.clone().unwrap_or_default(),
            "events: ZMQ publisher bound (vLLM 0.33.0 KVEventBatch: tagged-map events, topic-framed replay)"
        );
        Ok(ZmqPublisher {
            stats,
            endpoint,
            replay_endpoint,
            stop,
            stop_tx,
            bridge: Some(bridge),
        })
    }

    /// The PUB endpoint as bound (the port filled in).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay endpoint as bound.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// Its counters.
    pub fn stats(&self) -> Arc<ZmqStats> {
        self.stats.clone()
    }
}

impl Drop for ZmqPublisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.stop_tx.send(true);
        if let Some(b) = self.bridge.take() {
            let _ = b.join();
        }
    }
}

/// Bus -> batches, on its own thread (the bus and the G3 scan block).
fn bridge(
    sub: Subscription,
    opts: ZmqOptions,
    holdings: Holdings,
    stats: Arc<ZmqStats>,
    tx: mpsc::Sender<Vec<WireEvent>>,
    stop: Arc<AtomicBool>,
) {
    let send_all =
        |batches: Vec<Vec<WireEvent>>| batches.into_iter().all(|b| tx.blocking_send(b).is_ok());
    let resync = || snapshot(&opts.published, &holdings, opts.announce_blocks_max, &stats);
    if !send_all(resync()) {
        return;
    }
    while !stop.load(Ordering::Relaxed) {
        let ev = match sub.rx.recv_timeout(Duration::from_millis(100)) {
            Ok(ev) => Some(ev),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
        };
        let dropped = sub.take_dropped();
        if dropped > 0 {
            // What is queued is older than what was lost: drop it too and
            // start over from the present.
            let queued = sub.rx.try_iter().count() as u64 + u64::from(ev.is_some());
            stats
                .lagged_events
                .fetch_add(dropped + queued, Ordering::Relaxed);
            tracing::warn!(
                lost = dropped,
                "events.zmq: fell behind the event bus; announcing AllBlocksCleared and the holdings again"
            );
            if !send_all(resync()) {
                return;
            }
            continue;
        }
        let Some(ev) = ev else { continue };
        if let Some(w) = opts.published.convert(&ev, &stats) {
            if tx.blocking_send(vec![w]).is_err() {
                return;
            }
        }
    }
}

fn count_stored(evs: &[WireEvent], stats: &ZmqStats) {
    let n: usize = evs
        .iter()
        .map(|e| match e {
            WireEvent::Stored { blocks, .. } => blocks.len(),
            _ => 0,
        })
        .sum();
    stats.blocks_stored.fetch_add(n as u64, Ordering::Relaxed);
}

#[allow(clippy::too_many_arguments)]
async fn live(
    mut sock: zeromq::PubSocket,
    mut rx: mpsc::Receiver<Vec<WireEvent>>,
    ring: Arc<Mutex<Ring>>,
    topic: Bytes,
    (seq0, floor): (u64, Option<Arc<crate::base::id_floor::IdFloor>>),
    (dp_rank, media): (Option<u32>, wire::Media),
    heartbeat: Option<Duration>,
    stats: Arc<ZmqStats>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut seq = seq0;
    loop {
        // Idle for `heartbeat`: an empty batch, so a subscriber that missed
        // batches (one that reconnected across a restart missed the
        // start-up's) sees the gap now and asks for a replay.
        let evs = tokio::select! {
            b = rx.recv() => match b { Some(b) => b, None => return },
            _ = stop.changed() => return,
            _ = idle(heartbeat) => {
                stats.heartbeats.fetch_add(1, Ordering::Relaxed);
                Vec::new()
            }
        };
        count_stored(&evs, &stats);
        let payload = Bytes::from(wire::batch(now_s(), &evs, dp_rank, media));
        // Kept before it is sent: a subscriber that misses it can ask.
        if let Ok(mut r) = ring.lock() {
            r.push(seq, payload.clone());
        }
        let frames = vec![
            topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        seq += 1;
        if let Some(f) = &floor {
            f.reach(seq);
        }
        let Ok(msg) = ZmqMessage::try_from(frames) else {
            continue;
        };
        // PUB never waits for a slow subscriber: it drops for it.
        if let Err(e) = sock.send(msg).await {
            stats.send_errors.fetch_add(1, Ordering::Relaxed);
            warn_limited!(SEND_LOG, error = %e, "events.zmq: PUB send failed");
        }
        stats.batches.fetch_add(1, Ordering::Relaxed);
    }
}

async fn idle(d: Option<Duration>) {
    match d {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
    }
}

/// `[identity, "", start]` (a DEALER's request) or `[identity, start]`.
fn replay_start(m: &ZmqMessage) -> Option<(Bytes, u64)> {
    let id = m.get(0)?.clone();
    let last = m.get(m.len().checked_sub(1)?)?;
    let start: [u8; 8] = last.as_ref().try_into().ok()?;
    (m.len() == 2 || m.len() == 3).then_some((id, u64::from_be_bytes(start)))
}

async fn replay(
    mut sock: zeromq::RouterSocket,
    ring: Arc<Mutex<Ring>>,
    opts: ZmqOptions,
    holdings: Holdings,
    stats: Arc<ZmqStats>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let topic = Bytes::from(opts.topic.clone().into_bytes());
    let mut failures = 0u32;
    loop {
        let m = tokio::select! {
            m = sock.recv() => m,
            _ = stop.changed() => return,
        };
        let m = match m {
            Ok(m) => {
                failures = 0;
                m
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                if !after_recv_failure(failures, &e, &mut stop).await {
                    return;
                }
                continue;
            }
        };
        let Some((id, start)) = replay_start(&m) else {
            continue;
        };
        stats.replays.fetch_add(1, Ordering::Relaxed);
        let (kept, newest) = match ring.lock() {
            Ok(r) => {
                let (kept, gone) = r.since(start);
                (kept, r.newest().filter(|_| gone))
            }
            Err(_) => continue,
        };
        let replies: Vec<(u64, Bytes)> = match newest {
            // Batches the consumer needs are gone: the present instead.
            Some(newest) => {
                stats.replay_snapshots.fetch_add(1, Ordering::Relaxed);
                let (p, h, lim, st) = (
                    opts.published.clone(),
                    holdings.clone(),
                    opts.announce_blocks_max,
                    stats.clone(),
                );
                let snap = tokio::task::spawn_blocking(move || snapshot(&p, &h, lim, &st))
                    .await
                    .unwrap_or_default();
                numbered_snapshot(snap, start, newest)
                    .into_iter()
                    .map(|(seq, b)| {
                        (
                            seq,
                            Bytes::from(wire::batch(now_s(), &b, opts.dp_rank, opts.media)),
                        )
                    })
                    .collect()
            }
            None => kept,
        };
        // vLLM 0.33.0's framing: `[identity, "", topic, seq, payload]`,
        // then `[identity, "", "", END_SEQ, ""]`.
        let empty = Bytes::new();
        for (seq, payload) in replies {
            let frames = vec![
                id.clone(),
                empty.clone(),
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            let Ok(msg) = ZmqMessage::try_from(frames) else {
                continue;
            };
            if sock.send(msg).await.is_err() {
                stats.send_errors.fetch_add(1, Ordering::Relaxed);
                break;
            }
        }
        let end = vec![
            id,
            empty.clone(),
            empty.clone(),
            Bytes::from_static(&END_SEQ),
            empty,
        ];
        if let Ok(msg) = ZmqMessage::try_from(end) {
            let _ = sock.send(msg).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::edges::zmq::PublishedNs;

    /// A replay socket whose every receive fails at once (the loop's
    /// shape: receive, and on failure `after_recv_failure`) is asked a
    /// handful of times a second, not spun on; stop still ends it.
    #[tokio::test]
    async fn a_receive_failing_every_time_does_not_spin_the_replay_loop() {
        let (tx, mut stop) = tokio::sync::watch::channel(false);
        let mut failures = 0u32;
        let mut tries = 0u32;
        let t = std::time::Instant::now();
        while t.elapsed() < Duration::from_millis(300) {
            let m: std::result::Result<(), &str> = Err("socket broken");
            tries += 1;
            if let Err(e) = m {
                failures += 1;
                assert!(after_recv_failure(failures, &e, &mut stop).await);
            }
        }
        assert!(tries <= 8, "{tries} receives in 300 ms");
        assert_eq!(recv_pause(100), Duration::from_secs(1));
        tx.send(true).unwrap();
        assert!(
            !after_recv_failure(100, &"x", &mut stop).await,
            "stop ends the pause"
        );
    }
    use kvtier_client::events::KvEventData;
    use kvtier_client::{BlockKey, NamespaceId};

    /// A publisher that falls behind never slows the bus (publish is
    /// try_send); it counts what it lost and starts over with
    /// AllBlocksCleared and the holdings.
    #[test]
    fn falling_behind_the_bus_resyncs_and_counts() {
        let bus = EventBus::new();
        let sub = bus.subscribe().unwrap();
        let ns = NamespaceId([7; 16]);
        let mut published = Published::default();
        published.insert(
            ns,
            PublishedNs {
                salt: String::new(),
                lora_name: String::new(),
            },
        );
        let t = std::time::Instant::now();
        for i in 0..crate::base::events::QUEUE_DEPTH as u64 + 10 {
            bus.publish(
                ns,
                StorageTier::Disk,
                KvEventData::Removed {
                    block_hashes: vec![BlockKey::from_u64(i + 1)],
                },
            );
        }
        // Nobody read: the bus did not wait for its subscriber.
        assert!(t.elapsed() < Duration::from_secs(5));
        let opts = ZmqOptions {
            endpoint: String::new(),
            replay_endpoint: None,
            topic: String::new(),
            replay_batches_max: 16,
            announce_blocks_max: 100,
            dp_rank: None,
            heartbeat_ms: 0,
            ipc_mode: 0o600,
            media: super::wire::Media::Vllm,
            published,
            seq_floor: None,
        };
        let holdings: Holdings = Arc::new(|_: &NamespaceId, _| Vec::new());
        let stats = Arc::new(ZmqStats::default());
        let (tx, mut rx) = mpsc::channel(BRIDGE_BATCHES_MAX);
        let stop = Arc::new(AtomicBool::new(false));
        let th = {
            let (stats, stop) = (stats.clone(), stop.clone());
            std::thread::spawn(move || bridge(sub, opts, holdings, stats, tx, stop))
        };
        let mut got = Vec::new();
        let t = std::time::Instant::now();
        while got.len() < 2 && t.elapsed() < Duration::from_secs(10) {
            match rx.try_recv() {
                Ok(b) => got.push(b),
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        stop.store(true, Ordering::Relaxed);
        drop(rx);
        let _ = th.join();
        // Start-up clear, then the resync's clear (nothing queued survived).
        assert_eq!(
            got,
            vec![vec![WireEvent::Cleared], vec![WireEvent::Cleared]]
        );
        assert_eq!(stats.resyncs.load(Ordering::Relaxed), 2);
        assert_eq!(
            stats.lagged_events.load(Ordering::Relaxed),
            crate::base::events::QUEUE_DEPTH as u64 + 10
        );
    }

    /// A replay older than the kept batches gets the snapshot numbered
    /// contiguously up to the newest batch sent (Dynamo's replay check:
    /// in order, none missing, ending where the live stream goes on),
    /// merged when the numbers asked for are fewer than its batches.
    #[test]
    fn snapshot_replies_are_contiguous_and_end_at_the_newest_batch() {
        let removed = |h| WireEvent::Removed {
            hashes: vec![h],
            tier: StorageTier::Disk,
        };
        let snap = || {
            vec![
                vec![WireEvent::Cleared],
                vec![removed(1), removed(2)],
                vec![removed(3)],
            ]
        };
        let seqs = |v: &[(u64, Vec<WireEvent>)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
        let all =
            |v: Vec<(u64, Vec<WireEvent>)>| v.into_iter().flat_map(|x| x.1).collect::<Vec<_>>();
        let flat: Vec<WireEvent> = snap().into_iter().flatten().collect();
        let r = numbered_snapshot(snap(), 0, 1_000);
        assert_eq!(seqs(&r), [998, 999, 1_000]);
        assert_eq!(all(r), flat);
        let r = numbered_snapshot(snap(), 999, 1_000);
        assert_eq!(seqs(&r), [999, 1_000]);
        assert_eq!(all(r), flat);
        let r = numbered_snapshot(snap(), 1_000, 1_000);
        assert_eq!(seqs(&r), [1_000]);
        assert_eq!(all(r), flat);
    }

    #[test]
    fn ring_keeps_the_newest_and_says_when_some_are_gone() {
        let mut r = Ring {
            max: 3,
            batches: VecDeque::new(),
        };
        for s in 10..15 {
            r.push(s, Bytes::from(vec![s as u8]));
        }
        let (v, gone) = r.since(13);
        assert_eq!(v.iter().map(|x| x.0).collect::<Vec<_>>(), [13, 14]);
        assert!(!gone);
        let (v, gone) = r.since(0);
        assert_eq!(v.iter().map(|x| x.0).collect::<Vec<_>>(), [12, 13, 14]);
        assert!(gone);
    }
}
