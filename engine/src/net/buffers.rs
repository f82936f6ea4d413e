//! Kernel socket buffer sizes, for connections whose peer may stop reading
//! and whose backlog should stay small (a status page stream): with a small
//! send buffer a stalled peer fills it in a few writes, and the write-stall
//! deadline cuts it off instead of the kernel holding megabytes for it.
//! And [`answer_and_shut_now`], for a connection turned away at accept.

use std::os::fd::{AsRawFd, BorrowedFd};

/// Asks the kernel for a send buffer of `bytes` on `socket` (`SO_SNDBUF`;
/// Linux doubles the value for its bookkeeping and applies a floor). This
/// also turns off the buffer's autotuning for the socket.
pub fn set_send_buffer_bytes(socket: &impl AsRawFd, bytes: usize) -> std::io::Result<()> {
    // SAFETY: the descriptor belongs to `socket`, which is borrowed for the
    // whole call, so it stays open while the borrowed fd is used.
    let fd = unsafe { BorrowedFd::borrow_raw(socket.as_raw_fd()) };
    nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::SndBuf, &bytes)
        .map_err(std::io::Error::from)
}

/// Writes `answer` to `socket` without waiting (what the send buffer takes
/// now; a short answer on a fresh connection fits whole), then shuts its
/// sending side: for turning a connection away at accept, before anything
/// of it is read. The caller then drops the socket.
pub fn answer_and_shut_now(socket: &impl AsRawFd, answer: &[u8]) {
    use nix::sys::socket::{send, shutdown, MsgFlags, Shutdown};
    let fd = socket.as_raw_fd();
    if !answer.is_empty() {
        let _ = send(fd, answer, MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL);
    }
    let _ = shutdown(fd, Shutdown::Write);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_send_buffer_is_set() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let socket = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        set_send_buffer_bytes(&socket, 8 * 1024).unwrap();
        let size =
            nix::sys::socket::getsockopt(&socket, nix::sys::socket::sockopt::SndBuf).unwrap();
        // Linux doubles the request for its bookkeeping.
        assert_eq!(size, 16 * 1024);
    }
}
