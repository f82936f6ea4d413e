//! A TLS stream over a monoio socket that tolerates a *cancelled* read,
//! and the "plain TCP or TLS" stream type HTTP shells use.
//!
//! Every TLS connection in IOP is one of these. HTTP connections need a
//! cancelable read: the Edge's client surface watches a waiting client with
//! one ([`crate::http::ServerConn::watch_peer`]), and a monoio-rustls stream
//! must never see a cancelled read (its buffer is gone and the next read
//! panics). The Edge–Node link splits it into a reader and a writer task
//! ([`TlsStream::into_split`], see `split`). [`TlsStream`] drives a rustls
//! connection itself:
//!
//! ```text
//! read(buf) ─► rustls plaintext ready? ──yes──► copy into buf (the caller's
//!                 │ no                            pooled buffer) ─► Ok(n)
//!                 ▼
//!           socket read (cancelable) ─► ciphertext scratch ─► rustls
//!                 │ read_tls + process_new_packets; loop
//!                 └─ cancelled? the bytes that did arrive are already in
//!                    rustls; the read returns the error, the stream stays
//!                    whole
//! write(buf) / writev(parts) ─► rustls (encrypt) ─► ciphertext ─► socket
//! ```
//!
//! Cost per direction, beyond the kernel copy and the cipher itself: one
//! copy of the ciphertext into rustls' record buffer (decryption is in
//! place there) and one copy of the plaintext into the caller's buffer on
//! reads; one copy of the records into the socket buffer on writes. The
//! caller's buffer is still its own (a pooled buffer for provider
//! responses), so body pieces stay slices of pooled memory exactly as over
//! plain TCP. Removing the remaining copy needs rustls' unbuffered API.
//!
//! Dropping a read or write future (instead of cancelling it through its
//! [`CancelHandle`]) never panics, but under io_uring the bytes of the
//! operation in flight may be lost, so the connection is then unusable:
//! drop it.
//!
//! A peer that closes the socket without `close_notify` reads as end of
//! stream, as on plain TCP: HTTP framing (`content-length`, chunked)
//! detects a truncated body; a close-delimited body cannot tell.

use std::io::{self, Read, Write};
use std::ops::{Deref, DerefMut};

use monoio::buf::{IoBuf, IoBufMut, IoVecBuf, IoVecBufMut, RawBuf};
use monoio::io::{
    AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt, CancelHandle, CancelableAsyncReadRent,
    Splitable,
};
use monoio::net::TcpStream;
use monoio::BufResult;
use rustls::{ClientConnection, ConnectionCommon, ServerConnection, SideData};

use super::records::{feed_ciphertext, init_bytes, iovec_parts, Fed, CIPHERTEXT_READ_BYTES};
use super::split::{self, TlsReadHalf, TlsWriteHalf};

/// A TLS connection `C` (a rustls client or server connection whose
/// handshake is complete) over socket `IO`.
pub struct TlsStream<IO, C> {
    io: IO,
    conn: C,
    /// Ciphertext read from the socket; `None` while a read owns it (or
    /// after a dropped read took it: a new one is allocated).
    read_scratch: Option<Vec<u8>>,
    /// How much of `read_scratch` rustls has taken.
    read_consumed: usize,
    /// Ciphertext write scratch, same ownership rule.
    write_scratch: Option<Vec<u8>>,
}

impl<IO, C> std::fmt::Debug for TlsStream<IO, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsStream").finish_non_exhaustive()
    }
}

impl<IO, C> TlsStream<IO, C> {
    /// Wraps `conn`, whose handshake over `io` is complete (bytes it
    /// already read stay buffered in it).
    pub fn new(io: IO, conn: C) -> Self {
        TlsStream {
            io,
            conn,
            read_scratch: None,
            read_consumed: 0,
            write_scratch: None,
        }
    }

    /// The socket.
    pub fn io(&self) -> &IO {
        &self.io
    }

    /// The rustls connection (negotiated ALPN, protocol version, …).
    pub fn conn(&self) -> &C {
        &self.conn
    }
}

impl<IO: Splitable, C> TlsStream<IO, C> {
    /// Splits the stream into a read half and a write half for two tasks
    /// that run at once (the frame connection's reader and writer). Unlike
    /// monoio-rustls' split, the read half never writes (see the `split`
    /// module): a TLS failure it reads cannot collide with a write in
    /// flight.
    pub fn into_split(
        self,
    ) -> (
        TlsReadHalf<IO::OwnedRead, C>,
        TlsWriteHalf<IO::OwnedWrite, C>,
    ) {
        let (read_io, write_io) = self.io.into_split();
        let pending = self.read_scratch.unwrap_or_default();
        let consumed = self.read_consumed.min(pending.len());
        split::split(read_io, write_io, self.conn, pending, consumed)
    }
}

impl<IO, C, SD> TlsStream<IO, C>
where
    IO: CancelableAsyncReadRent + AsyncWriteRent,
    C: DerefMut + Deref<Target = ConnectionCommon<SD>>,
    SD: SideData,
{
    /// Writes every TLS record rustls has queued.
    async fn flush_records(&mut self) -> io::Result<()> {
        while self.conn.wants_write() {
            let mut out = self
                .write_scratch
                .take()
                .unwrap_or_else(|| Vec::with_capacity(CIPHERTEXT_READ_BYTES));
            out.clear();
            // `Vec`'s vectored write takes every queued chunk at once.
            self.conn.write_tls(&mut out)?;
            let (res, out) = self.io.write_all(out).await;
            self.write_scratch = Some(out);
            res?;
        }
        Ok(())
    }

    /// Hands rustls the ciphertext in the read scratch that it has not
    /// taken yet (see [`feed_ciphertext`]). On a TLS failure the alert
    /// rustls queued is sent (best effort).
    async fn feed_pending(&mut self) -> io::Result<()> {
        let Some(scratch) = self.read_scratch.as_deref() else {
            return Ok(());
        };
        match feed_ciphertext(&mut self.conn, scratch, &mut self.read_consumed) {
            Fed::Ok => Ok(()),
            Fed::Io(e) => Err(e),
            Fed::Tls(e) => {
                let _ = self.flush_records().await;
                Err(io::Error::new(io::ErrorKind::InvalidData, e))
            }
        }
    }

    /// Whether ciphertext read from the socket still waits for rustls.
    fn has_pending_ciphertext(&self) -> bool {
        self.read_scratch
            .as_ref()
            .is_some_and(|s| self.read_consumed < s.len())
    }

    /// Reads ciphertext from the socket once (cancelable when `cancel` is
    /// given) into the read scratch. At EOF rustls is told, and reports a
    /// missing `close_notify` on the next plaintext read.
    async fn read_socket(&mut self, cancel: Option<&CancelHandle>) -> io::Result<()> {
        let mut scratch = self
            .read_scratch
            .take()
            .unwrap_or_else(|| Vec::with_capacity(CIPHERTEXT_READ_BYTES));
        scratch.clear();
        self.read_consumed = 0;
        let (res, scratch) = match cancel {
            Some(handle) => self.io.cancelable_read(scratch, handle.clone()).await,
            None => self.io.read(scratch).await,
        };
        self.read_scratch = Some(scratch);
        if res? == 0 {
            self.conn.read_tls(&mut io::empty())?;
            if let Err(e) = self.conn.process_new_packets() {
                let _ = self.flush_records().await;
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
        }
        Ok(())
    }

    async fn read_plaintext<T: IoBufMut>(
        &mut self,
        mut buf: T,
        cancel: Option<&CancelHandle>,
    ) -> BufResult<usize, T> {
        let capacity = buf.bytes_total();
        if capacity == 0 {
            return (Ok(0), buf);
        }
        loop {
            // SAFETY: `write_ptr` points at `bytes_total()` writable bytes
            // that `buf` owns and that nothing else aliases while we hold
            // `buf`; rustls writes at most `capacity` bytes into the slice
            // and `set_init` records exactly how many.
            let dst = unsafe { std::slice::from_raw_parts_mut(buf.write_ptr(), capacity) };
            match self.conn.reader().read(dst) {
                Ok(n) => {
                    // SAFETY: rustls initialised the first `n` bytes.
                    unsafe { buf.set_init(n) };
                    return (Ok(n), buf);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                // The peer closed the socket without close_notify: end of
                // stream, as on plain TCP (see the module docs).
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return (Ok(0), buf),
                Err(e) => return (Err(e), buf),
            }
            let step = if self.has_pending_ciphertext() {
                self.feed_pending().await
            } else {
                // Records rustls wants to send in answer (a key update)
                // go out before waiting for more.
                match self.flush_records().await {
                    Ok(()) => match self.read_socket(cancel).await {
                        Ok(()) => self.feed_pending().await,
                        Err(e) => Err(e),
                    },
                    Err(e) => Err(e),
                }
            };
            if let Err(e) = step {
                return (Err(e), buf);
            }
        }
    }

    /// A vectored read fills the first iovec (like monoio's own TLS
    /// streams): plaintext comes out of rustls one copy at a time anyway.
    async fn read_plaintext_vectored<T: IoVecBufMut>(
        &mut self,
        mut buf: T,
        cancel: Option<&CancelHandle>,
    ) -> BufResult<usize, T> {
        // SAFETY: the raw buffer points into `buf`'s first iovec, which
        // `buf` keeps alive (and nothing else touches) until this returns.
        let Some(raw) = (unsafe { RawBuf::new_from_iovec_mut(&mut buf) }) else {
            return (Ok(0), buf);
        };
        let (res, _) = self.read_plaintext(raw, cancel).await;
        if let Ok(n) = res {
            // SAFETY: `n` bytes of the first iovec were written.
            unsafe { buf.set_init(n) };
        }
        (res, buf)
    }

    async fn write_plaintext(&mut self, parts: &[&[u8]]) -> io::Result<usize> {
        // Records of an earlier write that did not go out make room first.
        self.flush_records().await?;
        let mut written_bytes = 0;
        for part in parts {
            let n = self.conn.writer().write(part)?;
            written_bytes += n;
            if n < part.len() {
                break;
            }
        }
        self.flush_records().await?;
        Ok(written_bytes)
    }
}

impl<IO, C, SD> AsyncReadRent for TlsStream<IO, C>
where
    IO: CancelableAsyncReadRent + AsyncWriteRent,
    C: DerefMut + Deref<Target = ConnectionCommon<SD>>,
    SD: SideData,
{
    async fn read<T: IoBufMut>(&mut self, buf: T) -> BufResult<usize, T> {
        self.read_plaintext(buf, None).await
    }

    async fn readv<T: IoVecBufMut>(&mut self, buf: T) -> BufResult<usize, T> {
        self.read_plaintext_vectored(buf, None).await
    }
}

impl<IO, C, SD> CancelableAsyncReadRent for TlsStream<IO, C>
where
    IO: CancelableAsyncReadRent + AsyncWriteRent,
    C: DerefMut + Deref<Target = ConnectionCommon<SD>>,
    SD: SideData,
{
    /// A read whose socket wait ends when `c` is cancelled: ciphertext that
    /// arrived before is kept by rustls (not lost), and the read returns the
    /// cancellation error unless plaintext was already complete.
    async fn cancelable_read<T: IoBufMut>(
        &mut self,
        buf: T,
        c: CancelHandle,
    ) -> BufResult<usize, T> {
        self.read_plaintext(buf, Some(&c)).await
    }

    async fn cancelable_readv<T: IoVecBufMut>(
        &mut self,
        buf: T,
        c: CancelHandle,
    ) -> BufResult<usize, T> {
        self.read_plaintext_vectored(buf, Some(&c)).await
    }
}

impl<IO, C, SD> AsyncWriteRent for TlsStream<IO, C>
where
    IO: CancelableAsyncReadRent + AsyncWriteRent,
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
        self.conn.writer().flush()?;
        self.flush_records().await?;
        self.io.flush().await
    }

    /// Sends `close_notify`, then shuts the socket's write side.
    async fn shutdown(&mut self) -> io::Result<()> {
        self.conn.send_close_notify();
        self.flush_records().await?;
        self.io.shutdown().await
    }
}

/// A client-side TLS stream over TCP (the Node's provider connections).
pub type ClientTls = TlsStream<TcpStream, ClientConnection>;
/// A server-side TLS stream over TCP (the Edge's HTTPS client listener,
/// the HTTPS mock provider).
pub type ServerTls = TlsStream<TcpStream, ServerConnection>;

/// A TCP connection that is either plain or wrapped in TLS: one type for
/// the HTTP shells (`ClientConn`, `ServerConn`), the provider pool and the
/// probes, whatever the URL scheme or listener says.
#[derive(Debug)]
pub enum MaybeTls<C> {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP (boxed: the TLS state is large).
    Tls(Box<TlsStream<TcpStream, C>>),
}

/// A provider connection: plain TCP for `http://`, TLS for `https://`.
pub type UpstreamStream = MaybeTls<ClientConnection>;
/// An accepted client connection: plain TCP, or TLS when the listener
/// has a certificate.
pub type ListenerStream = MaybeTls<ServerConnection>;

/// The TCP socket underneath.
impl<C> std::os::fd::AsRawFd for MaybeTls<C> {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.tcp().as_raw_fd()
    }
}

impl<C> MaybeTls<C> {
    /// The TCP socket underneath (socket options, shutdown from outside).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            MaybeTls::Plain(tcp) => tcp,
            MaybeTls::Tls(tls) => tls.io(),
        }
    }

    /// Whether the connection is TLS.
    pub fn is_tls(&self) -> bool {
        matches!(self, MaybeTls::Tls(_))
    }
}

impl<C> From<TcpStream> for MaybeTls<C> {
    fn from(tcp: TcpStream) -> Self {
        MaybeTls::Plain(tcp)
    }
}

impl<C> From<TlsStream<TcpStream, C>> for MaybeTls<C> {
    fn from(tls: TlsStream<TcpStream, C>) -> Self {
        MaybeTls::Tls(Box::new(tls))
    }
}

impl<C, SD> AsyncReadRent for MaybeTls<C>
where
    C: DerefMut + Deref<Target = ConnectionCommon<SD>>,
    SD: SideData,
{
    async fn read<T: IoBufMut>(&mut self, buf: T) -> BufResult<usize, T> {
        match self {
            MaybeTls::Plain(tcp) => tcp.read(buf).await,
            MaybeTls::Tls(tls) => tls.read(buf).await,
        }
    }

    async fn readv<T: IoVecBufMut>(&mut self, buf: T) -> BufResult<usize, T> {
        match self {
            MaybeTls::Plain(tcp) => tcp.readv(buf).await,
            MaybeTls::Tls(tls) => tls.readv(buf).await,
        }
    }
}

impl<C, SD> CancelableAsyncReadRent for MaybeTls<C>
where
    C: DerefMut + Deref<Target = ConnectionCommon<SD>>,
    SD: SideData,
{
    async fn cancelable_read<T: IoBufMut>(
        &mut self,
        buf: T,
        c: CancelHandle,
    ) -> BufResult<usize, T> {
        match self {
            MaybeTls::Plain(tcp) => tcp.cancelable_read(buf, c).await,
            MaybeTls::Tls(tls) => tls.cancelable_read(buf, c).await,
        }
    }

    async fn cancelable_readv<T: IoVecBufMut>(
        &mut self,
        buf: T,
        c: CancelHandle,
    ) -> BufResult<usize, T> {
        match self {
            MaybeTls::Plain(tcp) => tcp.cancelable_readv(buf, c).await,
            MaybeTls::Tls(tls) => tls.cancelable_readv(buf, c).await,
        }
    }
}

impl<C, SD> AsyncWriteRent for MaybeTls<C>
where
    C: DerefMut + Deref<Target = ConnectionCommon<SD>>,
    SD: SideData,
{
    async fn write<T: IoBuf>(&mut self, buf: T) -> BufResult<usize, T> {
        match self {
            MaybeTls::Plain(tcp) => tcp.write(buf).await,
            MaybeTls::Tls(tls) => tls.write(buf).await,
        }
    }

    async fn writev<T: IoVecBuf>(&mut self, buf: T) -> BufResult<usize, T> {
        match self {
            MaybeTls::Plain(tcp) => tcp.writev(buf).await,
            MaybeTls::Tls(tls) => tls.writev(buf).await,
        }
    }

    async fn flush(&mut self) -> io::Result<()> {
        match self {
            MaybeTls::Plain(tcp) => tcp.flush().await,
            MaybeTls::Tls(tls) => tls.flush().await,
        }
    }

    async fn shutdown(&mut self) -> io::Result<()> {
        match self {
            MaybeTls::Plain(tcp) => tcp.shutdown().await,
            MaybeTls::Tls(tls) => tls.shutdown().await,
        }
    }
}
