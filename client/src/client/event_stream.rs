//! The KV event stream a client subscribes to ([`Client::events`]).

use super::*;

/// A stream of KV events from the daemon.
#[derive(Debug)]
pub struct EventStream {
    pub(super) sock: UnixStream,
    pub(super) socket: PathBuf,
}

impl EventStream {
    /// The next event, or `Ok(None)` when none arrived within `timeout`.
    /// An error means the stream is over (daemon gone); subscribe again.
    pub fn next_timeout(&mut self, timeout: Duration) -> Result<Option<KvEvent>> {
        let io = |e: std::io::Error| Error::Unavailable {
            socket: self.socket.clone(),
            source: e,
        };
        self.sock
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(io)?;
        // Peek first so a timeout never splits a frame.
        let mut b = [0u8; 1];
        // SAFETY: valid fd and a one-byte buffer.
        let n = unsafe {
            libc::recv(
                self.sock.as_raw_fd(),
                b.as_mut_ptr() as *mut libc::c_void,
                1,
                libc::MSG_PEEK,
            )
        };
        let peeked = if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        };
        match peeked {
            Ok(0) => {
                return Err(io(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "daemon closed the event stream",
                )))
            }
            Ok(_) => {}
            // A signal (a stop and continue, SIGSTOP/SIGCONT, makes a recv
            // with a timeout fail with EINTR even without a handler) is no
            // event yet, not the end of the stream.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) =>
            {
                return Ok(None)
            }
            Err(e) => return Err(io(e)),
        }
        self.sock
            .set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(io)?;
        let mut fds = Vec::new();
        let body = proto::recv_frame(self.sock.as_raw_fd(), &mut fds).map_err(|e| match e {
            proto::RecvError::Io(e) => io(e),
            other => Error::Protocol {
                reason: format!("event stream: {other:?}"),
            },
        })?;
        match Response::decode(&body, proto::OP_SUBSCRIBE)?.1 {
            Response::Event(e) => Ok(Some(e)),
            other => Err(unexpected(other)),
        }
    }
}
