//! Clients that never read: a blocking socket with a 4 KiB receive buffer
//! that sends one streamed chat request and then only watches, without
//! reading, for the server to close it.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use iop_engine::clock;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{self, sockopt, AddressFamily, SockFlag, SockType, SockaddrIn};

/// The receive buffer a never-reader asks for (the kernel may round it up).
pub const RECEIVE_BUFFER_BYTES: usize = 4096;

/// One client that never reads.
#[derive(Debug)]
pub struct NeverReader {
    stream: TcpStream,
    opened_at: Instant,
    /// When the server was first seen closing the connection.
    closed_after: Option<Duration>,
}

impl NeverReader {
    /// Connects to `addr` and sends a streamed chat request for `model`
    /// with `max_tokens`; reads nothing, ever.
    pub fn open(addr: SocketAddr, model: &str, max_tokens: u64) -> std::io::Result<Self> {
        let SocketAddr::V4(v4) = addr else {
            return Err(std::io::Error::other("never-readers dial IPv4 only"));
        };
        let fd: OwnedFd = socket::socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        socket::setsockopt(&fd, sockopt::RcvBuf, &RECEIVE_BUFFER_BYTES)?;
        socket::connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrIn::from(v4))?;
        let mut stream = TcpStream::from(fd);
        let body = format!(
            r#"{{"model":"{model}","stream":true,"max_tokens":{max_tokens},"messages":[{{"role":"user","content":"never reads"}}]}}"#
        );
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes())?;
        Ok(Self {
            stream,
            opened_at: clock::now(),
            closed_after: None,
        })
    }

    /// Whether the server closed (or reset) the connection; looks without
    /// reading, and remembers when it first saw it.
    pub fn poll_closed(&mut self) -> bool {
        if self.closed_after.is_some() {
            return true;
        }
        let mut fds = [PollFd::new(
            self.stream.as_fd(),
            // The peer's FIN (RDHUP) or reset (HUP, ERR); data waiting in
            // the buffer (IN) says nothing.
            PollFlags::from_bits_retain(nix::libc::POLLRDHUP)
                | PollFlags::POLLHUP
                | PollFlags::POLLERR,
        )];
        let closed = matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0);
        if closed {
            self.closed_after = Some(self.opened_at.elapsed());
        }
        closed
    }

    /// How long after it connected the server closed it, if it did.
    pub fn closed_after(&self) -> Option<Duration> {
        self.closed_after
    }
}
