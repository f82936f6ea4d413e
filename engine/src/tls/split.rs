//! A [`TlsStream`] split into a read half and a write half that two tasks
//! drive at the same time: the frame connection's reader and writer, at
//! both ends of the Edge–Node link.
//!
//! ```text
//!            ┌──────────── Rc<RefCell<rustls connection>> ────────────┐
//!  reader task: socket read half ─► scratch ─► read_tls/process ─► plaintext
//!  writer task: plaintext ─► writer().write ─► write_tls ─► scratch ─► socket write half
//! ```
//!
//! Each half owns its half of the socket and its own ciphertext scratch;
//! they share only the rustls connection, which is borrowed for synchronous
//! calls and never across an `await`, so neither half can find the other's
//! state taken.
//!
//! Why not monoio-rustls' split (`Splitable` on its stream): both halves
//! share one stream with one write buffer, and its read path, on a TLS
//! failure (a fatal alert from the peer, a record that does not decrypt),
//! flushes through that write buffer. When the writer task has a write in
//! flight it has taken the buffer, and the reader panics
//! (`monoio-io-wrapper` `safe_io.rs`: "buffer ref expected"). That is
//! exactly what happens to a Node whose Edge refuses its identity: under
//! TLS 1.3 the `access_denied` alert arrives after the Node's handshake has
//! finished, while its writer sends `RegisterRequest`.
//!
//! **The read half never writes.** Records rustls queues while reading (the
//! answer to a peer's key update, the alert for a record that does not
//! decrypt) go out with the write half's next write (heartbeats guarantee
//! one within a heartbeat interval). On a read failure the frame connection
//! closes at once, so such an alert is usually not sent; the failure is the
//! peer's, and it sees the connection close.
//!
//! Dropping a read or write future never panics (a dropped scratch is
//! replaced), but the bytes of an operation in flight may be lost: drop the
//! connection then.

use std::cell::RefCell;
use std::io::{self, Read, Write};
use std::ops::{Deref, DerefMut};
use std::rc::Rc;

use monoio::buf::{IoBuf, IoBufMut, IoVecBuf, IoVecBufMut, RawBuf};
use monoio::io::{AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt};
use monoio::BufResult;
use rustls::{ConnectionCommon, SideData};

use super::records::{feed_ciphertext, init_bytes, iovec_parts, Fed, CIPHERTEXT_READ_BYTES};

/// The read half of a split [`super::TlsStream`]: decrypts what the peer
/// sends. See the module docs.
pub struct TlsReadHalf<R, C> {
    io: R,
    conn: Rc<RefCell<C>>,
    /// Ciphertext read from the socket (empty with no capacity after a
    /// dropped read took it: a new one is allocated).
    scratch: Vec<u8>,
    /// How much of `scratch` rustls has taken.
    consumed: usize,
}

/// The write half of a split [`super::TlsStream`]: encrypts and sends.
pub struct TlsWriteHalf<W, C> {
    io: W,
    conn: Rc<RefCell<C>>,
    /// Ciphertext on its way to the socket (same rule as the read scratch).
    scratch: Vec<u8>,
}

impl<R, C> std::fmt::Debug for TlsReadHalf<R, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsReadHalf").finish_non_exhaustive()
    }
}

impl<W, C> std::fmt::Debug for TlsWriteHalf<W, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsWriteHalf").finish_non_exhaustive()
    }
}

/// The two halves over the socket halves `read_io` and `write_io` of one
/// connection `conn`; `pending` is ciphertext already read from the socket
/// that rustls has not taken (from `consumed` on).
pub(super) fn split<R, W, C>(
    read_io: R,
    write_io: W,
    conn: C,
    pending: Vec<u8>,
    consumed: usize,
) -> (TlsReadHalf<R, C>, TlsWriteHalf<W, C>) {
    let conn = Rc::new(RefCell::new(conn));
    (
        TlsReadHalf {
            io: read_io,
            conn: conn.clone(),
            scratch: pending,
            consumed,
        },
        TlsWriteHalf {
            io: write_io,
            conn,
            scratch: Vec::new(),
        },
    )
}

/// What one synchronous step of a read found.
enum ReadStep {
    /// The read is answered (plaintext, end of stream or an error).
    Done(io::Result<usize>),
    /// rustls took more ciphertext; look for plaintext again.
    Fed,
    /// Nothing buffered: read the socket.
    NeedSocket,
}

impl<R, C, SD> TlsReadHalf<R, C>
where
    R: AsyncReadRent,
    C: DerefMut + Deref<Target = ConnectionCommon<SD>>,
    SD: SideData,
{
    /// Plaintext into `dst` if rustls has some, else feeds it buffered
    /// ciphertext; the connection is borrowed only for this call.
    fn step(&mut self, dst: &mut [u8]) -> ReadStep {
        let mut conn = self.conn.borrow_mut();
        match conn.reader().read(dst) {
            Ok(n) => return ReadStep::Done(Ok(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            // The peer closed the socket without close_notify: end of
            // stream, as on plain TCP (see `stream`'s module docs).
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return ReadStep::Done(Ok(0)),
            Err(e) => return ReadStep::Done(Err(e)),
        }
        if self.consumed >= self.scratch.len() {
            return ReadStep::NeedSocket;
        }
        match feed_ciphertext(&mut conn, &self.scratch, &mut self.consumed) {
            Fed::Ok => ReadStep::Fed,
            Fed::Io(e) => ReadStep::Done(Err(e)),
            Fed::Tls(e) => ReadStep::Done(Err(io::Error::new(io::ErrorKind::InvalidData, e))),
        }
    }

    /// Reads ciphertext from the socket once. At end of stream rustls is
    /// told, and reports a missing `close_notify` on the next step.
    async fn read_socket(&mut self) -> io::Result<()> {
        let mut scratch = std::mem::take(&mut self.scratch);
        if scratch.capacity() == 0 {
            scratch.reserve(CIPHERTEXT_READ_BYTES);
        }
        scratch.clear();
        self.consumed = 0;
        let (res, scratch) = self.io.read(scratch).await;
        self.scratch = scratch;
        if res? == 0 {
            let mut conn = self.conn.borrow_mut();
            conn.read_tls(&mut io::empty())?;
            conn.process_new_packets()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        }
        Ok(())
    }
}

impl<R, C, SD> AsyncReadRent for TlsReadHalf<R, C>
where
    R: AsyncReadRent,
    C: DerefMut + Deref<Target = ConnectionCommon<SD>>,
    SD: SideData,
{
    async fn read<T: IoBufMut>(&mut self, mut buf: T) -> BufResult<usize, T> {
        let capacity = buf.bytes_total();
        if capacity == 0 {
            return (Ok(0), buf);
        }
        loop {
            // SAFETY: `write_ptr` points at `bytes_total()` writable bytes
            // that `buf` owns and that nothing else aliases while we hold
            // `buf`; the slice does not outlive this iteration.
            let dst = unsafe { std::slice::from_raw_parts_mut(buf.write_ptr(), capacity) };
            match self.step(dst) {
                ReadStep::Done(Ok(n)) => {
                    // SAFETY: rustls initialised the first `n` bytes.
                    unsafe { buf.set_init(n) };
                    return (Ok(n), buf);
                }
                ReadStep::Done(Err(e)) => return (Err(e), buf),
                ReadStep::Fed => {}
                ReadStep::NeedSocket => {
                    if let Err(e) = self.read_socket().await {
                        return (Err(e), buf);
                    }
                }
            }
        }
    }

    /// Fills the first iovec (plaintext comes out of rustls one copy at a
    /// time anyway).
    async fn readv<T: IoVecBufMut>(&mut self, mut buf: T) -> BufResult<usize, T> {
        // SAFETY: the raw buffer points into `buf`'s first iovec, which
        // `buf` keeps alive (and nothing else touches) until this returns.
        let Some(raw) = (unsafe { RawBuf::new_from_iovec_mut(&mut buf) }) else {
            return (Ok(0), buf);
        };
        let (res, _) = self.read(raw).await;
        if let Ok(n) = res {
            // SAFETY: `n` bytes of the first iovec were written.
            unsafe { buf.set_init(n) };
        }
        (res, buf)
    }
}

impl<W, C, SD> TlsWriteHalf<W, C>
where
    W: AsyncWriteRent,
    C: DerefMut + Deref<Target = ConnectionCommon<SD>>,
    SD: SideData,
{
    /// Writes every TLS record rustls has queued, the read half's included.
    async fn flush_records(&mut self) -> io::Result<()> {
        loop {
            let mut out = std::mem::take(&mut self.scratch);
            out.clear();
            {
                let mut conn = self.conn.borrow_mut();
                if !conn.wants_write() {
                    self.scratch = out;
                    return Ok(());
                }
                // `Vec`'s vectored write takes every queued chunk at once.
                conn.write_tls(&mut out)?;
            }
            let (res, out) = self.io.write_all(out).await;
            self.scratch = out;
            res?;
        }
    }

    async fn write_plaintext(&mut self, parts: &[&[u8]]) -> io::Result<usize> {
        // Records of an earlier write that did not go out make room first.
        self.flush_records().await?;
        let mut written_bytes = 0;
        {
            let mut conn = self.conn.borrow_mut();
            for part in parts {
                let n = conn.writer().write(part)?;
                written_bytes += n;
                if n < part.len() {
                    break;
                }
            }
        }
        self.flush_records().await?;
        Ok(written_bytes)
    }
}

impl<W, C, SD> AsyncWriteRent for TlsWriteHalf<W, C>
where
    W: AsyncWriteRent,
    C: DerefMut + Deref<Target = ConnectionCommon<SD>>,
    SD: SideData,
{
    async fn write<T: IoBuf>(&mut self, buf: T) -> BufResult<usize, T> {
        let res = self.write_plaintext(&[init_bytes(&buf)]).await;
        (res, buf)
    }

    /// A real gathered write: every part goes into TLS records of one
    /// socket write (as far as rustls' buffer limit allows).
    async fn writev<T: IoVecBuf>(&mut self, buf: T) -> BufResult<usize, T> {
        let res = self.write_plaintext(&iovec_parts(&buf)).await;
        (res, buf)
    }

    async fn flush(&mut self) -> io::Result<()> {
        self.conn.borrow_mut().writer().flush()?;
        self.flush_records().await?;
        self.io.flush().await
    }

    /// Sends `close_notify`, then shuts the socket's write side.
    async fn shutdown(&mut self) -> io::Result<()> {
        self.conn.borrow_mut().send_close_notify();
        self.flush_records().await?;
        self.io.shutdown().await
    }
}
