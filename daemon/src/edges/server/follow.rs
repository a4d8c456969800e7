//! The event stream of a subscribed connection (`kvtier events`, a
//! router's follower).
//!
//! A follower that stops reading (stopped, swapped out, behind a full
//! pipe) is never disconnected for it: a frame is sent without the
//! connection's write timeout, for as long as the follower is connected,
//! while the bus keeps dropping and counting what its bounded queue
//! cannot hold. Once it reads again it gets `Lagged { dropped }` (its cue
//! to resynchronise, e.g. from `kvtier ls`) and then the events that
//! follow. The stream ends only when the follower closes it, the daemon
//! shuts down, or the socket fails.

use crate::base::events::Subscription;
use crate::edges::access::Grant;
use kvtier_client::events::{KvEvent, KvEventData, StorageTier};
use kvtier_client::proto::Response;
use kvtier_client::NamespaceId;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// How often a blocked stream looks at shutdown and at the follower.
const WAKE_MS: i32 = 200;

/// Serves `sub` to the follower on `fd` until it leaves or the daemon
/// stops; a tenant sees only the namespaces `grant` allows.
pub(super) fn serve(fd: RawFd, sub: &Subscription, grant: &Grant, shutdown: &AtomicBool) {
    use std::sync::mpsc::RecvTimeoutError;
    let send = |ev: KvEvent| send_patiently(fd, &Response::Event(ev).encode(0, 0), shutdown);
    loop {
        if shutdown.load(Ordering::SeqCst) {
            return;
        }
        match sub.rx.recv_timeout(Duration::from_millis(WAKE_MS as u64)) {
            Ok(ev) => {
                let dropped = sub.take_dropped();
                if dropped > 0 {
                    let lag = KvEvent {
                        event_id: 0,
                        namespace: NamespaceId([0; 16]),
                        storage_tier: StorageTier::Disk,
                        data: KvEventData::Lagged { dropped },
                        dynamo_worker: None,
                    };
                    if !send(lag) {
                        return;
                    }
                }
                if grant.may(&ev.namespace) && !send((*ev).clone()) {
                    return;
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                if peer_gone(fd) {
                    return;
                }
            }
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// Sends all of `frame`, waiting for room as long as the follower is
/// connected and the daemon runs (never half a frame: once begun, a frame
/// is finished or the stream ends). `false`: the stream is over.
fn send_patiently(fd: RawFd, frame: &[u8], shutdown: &AtomicBool) -> bool {
    use nix::errno::Errno;
    use nix::sys::socket::{send, MsgFlags};
    let mut done = 0;
    while done < frame.len() {
        match send(
            fd,
            &frame[done..],
            MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
        ) {
            Ok(n) => done += n,
            Err(Errno::EINTR) => {}
            Err(Errno::EAGAIN) => {
                if shutdown.load(Ordering::SeqCst) || peer_gone(fd) {
                    return false;
                }
                let mut p = libc::pollfd {
                    fd,
                    events: libc::POLLOUT,
                    revents: 0,
                };
                // SAFETY: one valid pollfd for the duration of the call.
                unsafe { libc::poll(&mut p, 1, WAKE_MS) };
            }
            Err(_) => return false,
        }
    }
    true
}

/// Whether the follower closed (it sends nothing, so EOF is the only
/// signal between events).
fn peer_gone(fd: RawFd) -> bool {
    let mut b = [0u8; 1];
    // SAFETY: valid fd, one-byte buffer.
    let n = unsafe {
        libc::recv(
            fd,
            b.as_mut_ptr() as *mut libc::c_void,
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n == 0 {
        return true;
    }
    n < 0
        && !matches!(
            std::io::Error::last_os_error().kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
        )
}
