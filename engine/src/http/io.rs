//! Owned-buffer IO shared by the server and client shells: appending reads
//! into a `BytesMut` (server), reads into pooled buffers frozen as `Bytes`
//! (client), gathered writes of `Bytes` parts without copying them, and TCP
//! helpers that set `TCP_NODELAY`.
//!
//! This is the only place in `http` with `unsafe`: the [`IoVecBuf`]
//! implementation that hands the kernel an iovec array pointing into
//! `Bytes` the same value owns.

use std::future::Future;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};

use bytes::{Buf, Bytes, BytesMut};
use monoio::buf::{IoBufMut, IoVecBuf};
use monoio::io::{AsyncReadRent, AsyncWriteRent};
use monoio::net::{TcpListener, TcpStream};

use super::Url;
use crate::pool::BufferPool;

/// Spare capacity guaranteed before each read.
pub(crate) const READ_CHUNK_BYTES: usize = 16 * 1024;

/// Reads once, appending to `buf` (monoio reads fill capacity, so the read
/// goes into `buf[len..capacity]`). Returns the bytes read; 0 is EOF.
///
/// Not cancel-safe: if the future is dropped mid-read the buffer goes with
/// it and `buf` is left empty. Never wrap it in a timeout or `select!`.
pub(crate) async fn fill<S: AsyncReadRent>(
    stream: &mut S,
    buf: &mut BytesMut,
    spare_bytes: usize,
) -> io::Result<usize> {
    buf.reserve(spare_bytes.max(1));
    loop {
        let owned = std::mem::take(buf);
        let len = owned.len();
        let (res, slice) = stream.read(owned.slice_mut(len..)).await;
        *buf = slice.into_inner();
        match res {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// Once this much of a body of known length has arrived, its buffer is
/// reallocated to the whole length at once (see [`fill_toward`]).
const EXACT_GROWTH_AFTER_BYTES: usize = 1024 * 1024;

/// Like [`fill`] for a buffer that will hold at most `total_max_bytes`
/// (a body of known length). Growth doubles with the data (a peer that
/// announces a large body and sends little costs little), but when doubling
/// would pass `total_max_bytes`, or once [`EXACT_GROWTH_AFTER_BYTES`] have
/// arrived, the buffer is reallocated to exactly `total_max_bytes`: it never
/// holds up to twice what it carries, and a large body is copied once while
/// it grows, not at every doubling.
pub(crate) async fn fill_toward<S: AsyncReadRent>(
    stream: &mut S,
    buf: &mut BytesMut,
    spare_bytes: usize,
    total_max_bytes: usize,
) -> io::Result<usize> {
    let spare_bytes = spare_bytes.max(1);
    if buf.capacity() - buf.len() < spare_bytes {
        let doubled = buf.capacity().saturating_mul(2);
        let needed = buf.len() + spare_bytes;
        let exact = doubled.max(needed) >= total_max_bytes || buf.len() >= EXACT_GROWTH_AFTER_BYTES;
        if exact && needed <= total_max_bytes {
            let mut exact = BytesMut::with_capacity(total_max_bytes);
            exact.extend_from_slice(buf);
            *buf = exact;
        }
    }
    fill(stream, buf, spare_bytes).await
}

/// Reads once into a buffer from `pool` and freezes it: the result is
/// `carry` followed by the bytes read, as one `Bytes` over the pooled
/// memory (slices of it share that memory; it returns to the pool when the
/// last slice drops, on any thread). Also returns the bytes read; 0 is EOF.
///
/// `carry` is what the caller has not consumed of its previous read. It is
/// copied to the front of the new buffer so the decoders see contiguous
/// bytes; the body decoders consume framing byte by byte, so `carry` is
/// empty or a few bytes in practice. A `carry` that would leave no room in
/// a pooled buffer goes into a heap buffer instead, with room for one more
/// read (correct, just not pooled).
///
/// When the pool is exhausted, [`BufferPool::acquire`] allocates an
/// overflow buffer, so a read never waits for a buffer to come back.
///
/// With no `carry`, the read waits for the stream to be readable first
/// ([`ReadReadiness`]) and takes its buffer only then: a stream waiting for
/// its provider's next token (20 ms and more apart) holds no buffer, so
/// idle streams cost no read memory. A plain TCP stream then reads what
/// is there at once, into the tail of the buffer this core's reads share
/// ([`BufferPool::read_packed`]): many streams' small pieces in flight
/// hold one buffer between them, not one each.
///
/// Cancelling (dropping the future) loses `carry` and the bytes of the read
/// in flight; under io_uring the pooled buffer stays with the kernel until
/// the cancelled read completes and then returns to the pool.
pub(crate) async fn read_pooled<S: AsyncReadRent + ReadReadiness>(
    stream: &mut S,
    pool: &BufferPool,
    carry: Bytes,
) -> io::Result<(Bytes, usize)> {
    if carry.is_empty() {
        loop {
            match stream.read_ready().await {
                Ok(()) => {}
                // A signal (the Node's SIGTERM drain) interrupted the wait:
                // wait again, as every read here does.
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            match stream.read_packed_now(pool) {
                None => break,
                Some(Ok(read)) => {
                    let read_bytes = read.len();
                    return Ok((read, read_bytes));
                }
                // A readiness the socket no longer has: wait again.
                Some(Err(e))
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) => {}
                Some(Err(e)) => return Err(e),
            }
        }
    }
    // Boxed: a read in flight on the stream (TLS decoding, or after a
    // carry) is far larger than the readiness wait above, and an inline
    // one would size the future of every read for it, a plain TCP
    // stream's packed reads included.
    Box::pin(read_owned(stream, pool, carry)).await
}

/// [`read_pooled`]'s read with a buffer of its own (TLS, or a carry).
async fn read_owned<S: AsyncReadRent>(
    stream: &mut S,
    pool: &BufferPool,
    carry: Bytes,
) -> io::Result<(Bytes, usize)> {
    if carry.len() >= pool.buffer_size_bytes() {
        let mut heap = BytesMut::with_capacity(carry.len() + READ_CHUNK_BYTES);
        heap.extend_from_slice(&carry);
        drop(carry);
        let read_bytes = fill(stream, &mut heap, READ_CHUNK_BYTES).await?;
        return Ok((heap.freeze(), read_bytes));
    }
    let mut buf = pool.acquire();
    buf.extend_from_slice(&carry);
    drop(carry);
    loop {
        let start = buf.len();
        let (res, slice) = stream.read(buf.slice_mut(start..)).await;
        buf = slice.into_inner();
        match res {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
            Ok(read_bytes) => return Ok((buf.freeze(), read_bytes)),
        }
    }
}

/// A stream that can wait until a read would find something (data, end of
/// stream or an error) without lending the read a buffer for the wait.
pub trait ReadReadiness {
    /// Completes when a read would not wait, or at once when the stream
    /// cannot tell (a read then waits with its buffer, as without this).
    fn read_ready(&mut self) -> impl std::future::Future<Output = io::Result<()>>;

    /// After [`read_ready`](Self::read_ready): reads what the stream has
    /// now, without waiting, into `pool`'s shared packing buffer
    /// ([`BufferPool::read_packed`]); `WouldBlock` when it has nothing
    /// after all. `None`: this stream cannot read that way (its bytes come
    /// through a decoder, such as TLS), so the read takes a buffer of its
    /// own.
    fn read_packed_now(&mut self, pool: &BufferPool) -> Option<io::Result<Bytes>> {
        let _ = pool;
        None
    }

    /// After [`read_ready`](Self::read_ready): appends what the stream has
    /// now, at most `max_bytes`, to `buf`, without waiting, growing `buf`
    /// only as the bytes arrive (from [`RECV_FIRST_BYTES`], doubling), so
    /// a small request never takes a full read chunk of memory; the bytes
    /// read, 0 at end of stream, `WouldBlock` when it has nothing after
    /// all. `None`: this stream cannot read that way (TLS), so the read
    /// takes a buffer of its own.
    fn read_now(&mut self, buf: &mut BytesMut, max_bytes: usize) -> Option<io::Result<usize>> {
        let _ = (buf, max_bytes);
        None
    }
}

/// Room [`ReadReadiness::read_now`] first gives a read: a whole API
/// request head and a short body.
pub(crate) const RECV_FIRST_BYTES: usize = 2 * 1024;

impl ReadReadiness for TcpStream {
    async fn read_ready(&mut self) -> io::Result<()> {
        // A poll for input (`POLLIN`, which end of stream and errors also
        // raise); not relaxed, so the epoll driver never reports a
        // readiness the socket does not have.
        self.readable(false).await
    }

    fn read_packed_now(&mut self, pool: &BufferPool) -> Option<io::Result<Bytes>> {
        Some(recv_packed(self.as_raw_fd(), pool))
    }

    fn read_now(&mut self, buf: &mut BytesMut, max_bytes: usize) -> Option<io::Result<usize>> {
        Some(recv_growing(self.as_raw_fd(), buf, max_bytes))
    }
}

/// Non-blocking `recv`s on `fd` appended to `buf` until the socket has no
/// more, `max_bytes` arrived or the stream ended: the room each `recv` gets
/// starts at [`RECV_FIRST_BYTES`] and doubles while a `recv` fills it.
fn recv_growing(fd: RawFd, buf: &mut BytesMut, max_bytes: usize) -> io::Result<usize> {
    if buf.capacity() > 0 {
        return recv_growing_into(fd, buf, max_bytes);
    }
    // A buffer with no room yet (a connection's first request, or the
    // read that finds its end): the first `recv` goes to the stack, and
    // `buf` takes exactly what came. A small request then costs a small
    // allocation (glibc serves it from its per-thread cache; a 2 KiB one
    // went through the shared bins and a consolidation of them), and the
    // end of a connection costs none.
    let mut first = [std::mem::MaybeUninit::<u8>::uninit(); RECV_FIRST_BYTES];
    let want = RECV_FIRST_BYTES.min(max_bytes);
    let read_bytes = recv_now(fd, &mut first[..want])?;
    // SAFETY: the kernel wrote the first `read_bytes` bytes of `first`
    // (`recv_now` returns how many), so they are initialized.
    let read = unsafe { std::slice::from_raw_parts(first.as_ptr().cast::<u8>(), read_bytes) };
    buf.extend_from_slice(read);
    if read_bytes < want {
        return Ok(read_bytes);
    }
    // The room was filled: more may wait.
    match recv_growing_into(fd, buf, max_bytes - read_bytes) {
        Ok(more) => Ok(read_bytes + more),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(read_bytes),
        Err(e) => Err(e),
    }
}

fn recv_growing_into(fd: RawFd, buf: &mut BytesMut, max_bytes: usize) -> io::Result<usize> {
    let mut read_total = 0;
    let mut room = RECV_FIRST_BYTES;
    while read_total < max_bytes {
        let want = room.min(max_bytes - read_total);
        buf.reserve(want);
        let read_bytes = match recv_now(fd, &mut buf.spare_capacity_mut()[..want]) {
            Ok(read_bytes) => read_bytes,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && read_total > 0 => {
                return Ok(read_total)
            }
            Err(e) => return Err(e),
        };
        // SAFETY: the kernel wrote the first `read_bytes` bytes of the
        // spare capacity, which starts at `buf.len()`.
        unsafe { buf.set_len(buf.len() + read_bytes) };
        read_total += read_bytes;
        if read_bytes < want {
            // Drained (or at the end of the stream: the next read says 0).
            return Ok(read_total);
        }
        room = room.saturating_mul(2);
    }
    Ok(read_total)
}

/// One non-blocking `recv` on `fd` into `room`, again when a signal
/// interrupts it: the bytes read (0 at the end of the stream), or
/// `WouldBlock` when none are waiting.
fn recv_now(fd: RawFd, room: &mut [std::mem::MaybeUninit<u8>]) -> io::Result<usize> {
    loop {
        // SAFETY: `room` is valid for writes of `room.len()` bytes for the
        // whole call; `recv` writes at most that many and returns how many.
        let read_bytes =
            unsafe { libc::recv(fd, room.as_mut_ptr().cast(), room.len(), libc::MSG_DONTWAIT) };
        match usize::try_from(read_bytes) {
            Ok(read_bytes) => return Ok(read_bytes),
            Err(_) => {
                let error = io::Error::last_os_error();
                if error.kind() != io::ErrorKind::Interrupted {
                    return Err(error);
                }
            }
        }
    }
}

/// One non-blocking `recv` on `fd` into `pool`'s packing buffer. It never
/// waits, so no read is in flight when it returns (under io_uring too: the
/// kernel writes the tail during the call, not after it).
fn recv_packed(fd: RawFd, pool: &BufferPool) -> io::Result<Bytes> {
    let read = |tail: &mut [std::mem::MaybeUninit<u8>]| recv_now(fd, tail);
    // SAFETY: on `Ok(n)` the kernel wrote the first `n` bytes of the tail,
    // and the closure keeps no pointer into it.
    unsafe { pool.read_packed(read) }
}

impl<C> ReadReadiness for crate::tls::MaybeTls<C> {
    async fn read_ready(&mut self) -> io::Result<()> {
        match self {
            crate::tls::MaybeTls::Plain(tcp) => tcp.readable(false).await,
            // Plaintext may already wait inside rustls, and socket
            // readiness says nothing about whole records: the read waits
            // (with its buffer) as before.
            crate::tls::MaybeTls::Tls(_) => Ok(()),
        }
    }

    fn read_packed_now(&mut self, pool: &BufferPool) -> Option<io::Result<Bytes>> {
        match self {
            crate::tls::MaybeTls::Plain(tcp) => tcp.read_packed_now(pool),
            crate::tls::MaybeTls::Tls(_) => None,
        }
    }

    fn read_now(&mut self, buf: &mut BytesMut, max_bytes: usize) -> Option<io::Result<usize>> {
        match self {
            crate::tls::MaybeTls::Plain(tcp) => tcp.read_now(buf, max_bytes),
            crate::tls::MaybeTls::Tls(_) => None,
        }
    }
}

/// `Bytes` parts written together with `writev`. Owns both the parts and
/// the iovec array that points into them, so a write in flight (or one
/// whose future was dropped under io_uring) never points at freed memory.
///
/// A connection that writes often keeps one and refills it
/// ([`IoParts::refill`]): its two vectors are then allocated once, not per
/// write (a streamed response writes one per chunk).
#[derive(Default)]
pub(crate) struct IoParts {
    parts: Vec<Bytes>,
    iovecs: Vec<libc::iovec>,
}

impl IoParts {
    /// Parts in write order; empty parts are dropped.
    pub(crate) fn new(parts: impl IntoIterator<Item = Bytes>) -> Self {
        let mut io = IoParts::default();
        io.refill(parts);
        io
    }

    /// Replaces the parts with `parts` (empty ones dropped), keeping the
    /// vectors' allocations.
    pub(crate) fn refill(&mut self, parts: impl IntoIterator<Item = Bytes>) {
        self.parts.clear();
        self.iovecs.clear();
        // One pass, each part pushed with its iovec: cheaper than a
        // filtering `extend` and a second pass for the iovecs, and every
        // streamed chunk comes through here.
        for part in parts {
            if !part.is_empty() {
                self.iovecs.push(iovec_of(&part));
                self.parts.push(part);
            }
        }
    }

    /// Drops every part (and with them the references to their bytes),
    /// keeping the vectors' allocations for the next [`IoParts::refill`].
    pub(crate) fn clear(&mut self) {
        self.parts.clear();
        self.iovecs.clear();
    }

    fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Drops the first `written_bytes` bytes (after a partial write).
    fn advance(&mut self, mut written_bytes: usize) {
        // Most writes take everything: drop it all at once rather than part
        // by part from the front.
        if written_bytes >= self.parts.iter().map(Bytes::len).sum::<usize>() {
            self.clear();
            return;
        }
        while written_bytes > 0 {
            let Some(first) = self.parts.first_mut() else {
                break;
            };
            if written_bytes >= first.len() {
                written_bytes -= first.len();
                self.parts.remove(0);
            } else {
                first.advance(written_bytes);
                written_bytes = 0;
            }
        }
        self.rebuild();
    }

    fn rebuild(&mut self) {
        self.iovecs.clear();
        self.iovecs.extend(self.parts.iter().map(iovec_of));
    }
}

/// The iovec of `part`'s bytes (which it keeps alive while in
/// [`IoParts`]).
fn iovec_of(part: &Bytes) -> libc::iovec {
    libc::iovec {
        iov_base: part.as_ptr().cast_mut().cast(),
        iov_len: part.len(),
    }
}

// SAFETY: `iovecs` describes exactly the bytes of `parts`: each entry is
// built in `rebuild` from a live `Bytes` in `parts` (pointer and length).
// `Bytes` data lives on the heap or in static memory, so moving an
// `IoParts` (or the `Bytes` inside it) never moves the bytes, and the bytes
// are immutable and freed only when `parts` is dropped, together with the
// iovecs. The iovec array is a heap `Vec` that is only mutated through
// `&mut self` (`advance`/`rebuild`), which the runtime never calls while it
// owns the value during a write, so the pointer and count stay valid for
// the whole operation.
unsafe impl IoVecBuf for IoParts {
    fn read_iovec_ptr(&self) -> *const libc::iovec {
        self.iovecs.as_ptr()
    }

    fn read_iovec_len(&self) -> usize {
        self.iovecs.len()
    }
}

/// Writes every part, looping over short writes (a TLS stream's `writev`
/// takes only the first part per call), then flushes. `progress` runs after
/// each write that moved bytes and left some to write (a stall deadline is
/// pushed on there).
pub(crate) async fn write_parts<S: AsyncWriteRent>(
    stream: &mut S,
    parts: IoParts,
    progress: impl FnMut(),
) -> io::Result<()> {
    write_parts_back(stream, parts, progress).await.0
}

/// [`write_parts`], handing `parts` back (emptied) for reuse.
// A function returning an `async move` block, not an `async fn`: the block
// keeps its captures once, where an `async fn` keeps its arguments and the
// locals they move into (this future is inside every streamed write).
#[allow(clippy::manual_async_fn)]
pub(crate) fn write_parts_back<'a, S: AsyncWriteRent>(
    stream: &'a mut S,
    mut parts: IoParts,
    mut progress: impl FnMut() + 'a,
) -> impl Future<Output = (io::Result<()>, IoParts)> + 'a {
    async move {
        while !parts.is_empty() {
            let (res, back) = stream.writev(parts).await;
            parts = back;
            match res {
                Ok(0) => {
                    parts.clear();
                    let zero = io::Error::new(io::ErrorKind::WriteZero, "peer accepted no bytes");
                    return (Err(zero), parts);
                }
                Ok(n) => {
                    parts.advance(n);
                    // Only a write that left bytes pushes a stall deadline
                    // on: the caller puts it back once all are written.
                    if !parts.is_empty() {
                        progress();
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    parts.clear();
                    return (Err(e), parts);
                }
            }
        }
        (stream.flush().await, parts)
    }
}

/// Turns on `TCP_NODELAY` (every IOP socket sets it: small SSE chunks must
/// not wait for Nagle).
pub fn set_nodelay(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)
}

/// Accepts one connection and sets `TCP_NODELAY` on it.
pub async fn accept(listener: &TcpListener) -> io::Result<(TcpStream, SocketAddr)> {
    let (stream, peer) = listener.accept().await?;
    set_nodelay(&stream)?;
    Ok((stream, peer))
}

/// Connects to the first address of `addr` that answers and sets
/// `TCP_NODELAY`. Meant for socket addresses: a host *name* here is
/// resolved with a blocking call (use [`connect_host`] for names).
pub async fn connect<A: ToSocketAddrs>(addr: A) -> io::Result<TcpStream> {
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
    connect_addrs(&addrs).await
}

/// Connects to the first of `addrs` that answers and sets `TCP_NODELAY`.
pub async fn connect_addrs(addrs: &[SocketAddr]) -> io::Result<TcpStream> {
    let mut last_error = None;
    for &candidate in addrs {
        match TcpStream::connect_addr(candidate).await {
            Ok(stream) => {
                set_nodelay(&stream)?;
                return Ok(stream);
            }
            Err(e) => last_error = Some(e),
        }
    }
    Err(last_error
        .unwrap_or_else(|| io::Error::new(io::ErrorKind::NotFound, "address resolved to nothing")))
}

/// Connects to `host:port` (a DNS name or an IP literal, IPv6 without
/// brackets): the name is resolved without blocking the core
/// ([`crate::resolve`]), then the addresses are tried in order.
pub async fn connect_host(host: &str, port: u16) -> io::Result<TcpStream> {
    let addrs = crate::resolve::resolve(host, port).await?;
    connect_addrs(&addrs).await
}

/// Connects to a base URL's host and port; see [`connect_host`].
pub async fn connect_url(url: &Url) -> io::Result<TcpStream> {
    connect_host(url.host(), url.port()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_advance_across_boundaries() {
        let mut parts = IoParts::new([
            Bytes::from_static(b"ab"),
            Bytes::new(),
            Bytes::from_static(b"cde"),
            Bytes::from_static(b"f"),
        ]);
        assert_eq!(parts.parts.len(), 3);
        assert_eq!(parts.iovecs.len(), 3);
        parts.advance(3);
        assert_eq!(
            parts.parts,
            vec![Bytes::from_static(b"de"), Bytes::from_static(b"f")]
        );
        assert_eq!(parts.iovecs[0].iov_len, 2);
        assert_eq!(
            parts.iovecs[0].iov_base as usize,
            parts.parts[0].as_ptr() as usize
        );
        parts.advance(3);
        assert!(parts.is_empty());
        assert!(parts.iovecs.is_empty());
    }

    #[test]
    fn refill_replaces_the_parts_and_each_iovec_points_at_its_part() {
        let mut parts = IoParts::new([Bytes::from_static(b"old")]);
        let data = Bytes::from(b"chunk".to_vec());
        parts.refill([
            Bytes::from_static(b"5\r\n"),
            data.clone(),
            Bytes::new(),
            Bytes::from_static(b"\r\n"),
        ]);
        assert_eq!(
            parts.parts,
            vec![
                Bytes::from_static(b"5\r\n"),
                data.clone(),
                Bytes::from_static(b"\r\n")
            ]
        );
        let pointed: Vec<(usize, usize)> = parts
            .iovecs
            .iter()
            .map(|v| (v.iov_base as usize, v.iov_len))
            .collect();
        let expected: Vec<(usize, usize)> = parts
            .parts
            .iter()
            .map(|p| (p.as_ptr() as usize, p.len()))
            .collect();
        assert_eq!(pointed, expected);
        assert_eq!(pointed[1].0, data.as_ptr() as usize, "the data itself");
    }

    #[monoio::test_all]
    async fn read_pooled_puts_the_carry_in_front_of_the_read() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let writer = monoio::spawn(async move {
            let mut stream = connect(addr).await.unwrap();
            write_parts(
                &mut stream,
                IoParts::new([Bytes::from_static(b"world")]),
                || {},
            )
            .await
            .unwrap();
            stream
        });
        let (mut server, _) = accept(&listener).await.unwrap();
        let client = writer.await;
        let pool = BufferPool::new(crate::pool::PoolConfig {
            buffer_size_bytes: 64,
            buffer_count_max: 1,
        })
        .unwrap();

        let (read, read_bytes) = read_pooled(&mut server, &pool, Bytes::from_static(b"hello "))
            .await
            .unwrap();
        assert_eq!(read_bytes, 5);
        assert_eq!(read, Bytes::from_static(b"hello world"));
        // Carry and read share one pooled buffer, carry first.
        assert_eq!(
            pool.locate(read.as_ptr()),
            Some(crate::pool::BufferLocation {
                index: 0,
                offset_bytes: 0
            })
        );
        assert_eq!(pool.in_use(), 1);
        drop(read);
        assert_eq!(pool.in_use(), 0);

        // EOF: nothing read, an empty result holds no buffer.
        drop(client);
        let (read, read_bytes) = read_pooled(&mut server, &pool, Bytes::new()).await.unwrap();
        assert_eq!((read, read_bytes), (Bytes::new(), 0));
        assert_eq!(pool.in_use(), 0);
    }

    #[monoio::test_all]
    async fn reads_from_two_sockets_are_packed_into_one_pooled_buffer() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut clients = Vec::new();
        let mut servers = Vec::new();
        for _ in 0..2 {
            let client = monoio::spawn(async move { connect(addr).await.unwrap() });
            let (server, _) = accept(&listener).await.unwrap();
            clients.push(client.await);
            servers.push(server);
        }
        let pool = BufferPool::new(crate::pool::PoolConfig {
            buffer_size_bytes: 4096,
            buffer_count_max: 4,
        })
        .unwrap();
        let sent: [&'static [u8]; 3] = [
            b"data: {\"a\":1}\n\n",
            b"data: {\"b\":2}\n\n",
            b"data: [DONE]\n\n",
        ];
        let mut pieces = Vec::new();
        for (i, chunk) in sent.iter().enumerate() {
            let (client, server) = (&mut clients[i % 2], &mut servers[i % 2]);
            write_parts(client, IoParts::new([Bytes::from_static(chunk)]), || {})
                .await
                .unwrap();
            let (read, read_bytes) = read_pooled(server, &pool, Bytes::new()).await.unwrap();
            assert_eq!((&read[..], read_bytes), (*chunk, chunk.len()));
            pieces.push(read);
        }
        // The three reads, from two connections, sit back to back in one
        // pooled buffer: the bytes the kernel wrote, not copies.
        let mut offset_bytes = 0;
        for piece in &pieces {
            assert_eq!(
                pool.locate(piece.as_ptr()),
                Some(crate::pool::BufferLocation {
                    index: 0,
                    offset_bytes
                })
            );
            offset_bytes += piece.len();
        }
        assert_eq!(pool.in_use(), 1);
        drop(pieces);
        assert_eq!(pool.in_use(), 0);

        // End of stream: an empty read holds no buffer.
        drop(clients);
        for server in &mut servers {
            let (read, read_bytes) = read_pooled(server, &pool, Bytes::new()).await.unwrap();
            assert_eq!((read, read_bytes), (Bytes::new(), 0));
        }
        assert_eq!((pool.in_use(), pool.stale_returns()), (0, 0));
    }

    #[monoio::test_all]
    async fn read_now_gives_a_small_request_room_of_its_own_size() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let client = monoio::spawn(async move { connect(addr).await.unwrap() });
        let (mut server, _) = accept(&listener).await.unwrap();
        let mut client = client.await;

        // Nothing arrived: it says so without waiting and takes no room.
        let mut buf = BytesMut::new();
        let nothing = server.read_now(&mut buf, 1 << 20).unwrap().unwrap_err();
        assert_eq!(nothing.kind(), io::ErrorKind::WouldBlock);
        assert_eq!(buf.capacity(), 0);

        // A short request is read whole into the first, small room.
        let request: &'static [u8] = b"GET /v1/models HTTP/1.1\r\nhost: a\r\n\r\n";
        write_parts(
            &mut client,
            IoParts::new([Bytes::from_static(request)]),
            || {},
        )
        .await
        .unwrap();
        server.read_ready().await.unwrap();
        assert_eq!(
            server.read_now(&mut buf, 1 << 20).unwrap().unwrap(),
            request.len()
        );
        assert_eq!(&buf[..], request);
        assert!(buf.capacity() < 2 * request.len(), "{}", buf.capacity());

        // A big body: the room doubles while reads fill it, never past
        // `max_bytes`, and every byte lands in order after what was there.
        let body: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
        write_parts(
            &mut client,
            IoParts::new([Bytes::from(body.clone())]),
            || {},
        )
        .await
        .unwrap();
        let mut read_total = 0;
        while read_total < body.len() {
            server.read_ready().await.unwrap();
            match server.read_now(&mut buf, 16 * 1024).unwrap() {
                Ok(read_bytes) => {
                    assert!((1..=16 * 1024).contains(&read_bytes), "{read_bytes}");
                    read_total += read_bytes;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(read_total, body.len());
        assert_eq!(&buf[..request.len()], request);
        assert_eq!(&buf[request.len()..], &body[..]);

        // End of stream reads 0, and takes no room.
        drop(client);
        server.read_ready().await.unwrap();
        assert_eq!(server.read_now(&mut buf, 1 << 20).unwrap().unwrap(), 0);
        let mut empty = BytesMut::new();
        assert_eq!(server.read_now(&mut empty, 1 << 20).unwrap().unwrap(), 0);
        assert_eq!(empty.capacity(), 0);
    }

    #[monoio::test_all]
    async fn read_now_into_no_room_takes_what_fills_the_first_room_and_the_rest() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let client = monoio::spawn(async move { connect(addr).await.unwrap() });
        let (mut server, _) = accept(&listener).await.unwrap();
        let mut client = client.await;

        // More than the first room, all waiting at once: one read takes
        // the stack's room and then the rest, in order.
        let sent: Vec<u8> = (0..3 * RECV_FIRST_BYTES as u32 + 7)
            .map(|i| (i % 253) as u8)
            .collect();
        write_parts(
            &mut client,
            IoParts::new([Bytes::from(sent.clone())]),
            || {},
        )
        .await
        .unwrap();
        let mut buf = BytesMut::new();
        let mut read_total = 0;
        while read_total < sent.len() {
            server.read_ready().await.unwrap();
            match server.read_now(&mut buf, 1 << 20).unwrap() {
                Ok(read_bytes) => read_total += read_bytes,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(&buf[..], &sent[..]);

        // `max_bytes` below the first room bounds the first read.
        write_parts(
            &mut client,
            IoParts::new([Bytes::from_static(b"0123456789")]),
            || {},
        )
        .await
        .unwrap();
        let mut small = BytesMut::new();
        server.read_ready().await.unwrap();
        assert_eq!(server.read_now(&mut small, 4).unwrap().unwrap(), 4);
        assert_eq!(&small[..], b"0123");
        drop(client);
    }

    #[monoio::test_all]
    async fn read_pooled_moves_a_carry_too_big_for_a_buffer_to_the_heap() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let writer = monoio::spawn(async move {
            let mut stream = connect(addr).await.unwrap();
            write_parts(&mut stream, IoParts::new([Bytes::from_static(b"!")]), || {})
                .await
                .unwrap();
            stream
        });
        let (mut server, _) = accept(&listener).await.unwrap();
        let _client = writer.await;
        let pool = BufferPool::new(crate::pool::PoolConfig {
            buffer_size_bytes: 4,
            buffer_count_max: 1,
        })
        .unwrap();

        let (read, read_bytes) = read_pooled(&mut server, &pool, Bytes::from_static(b"hello"))
            .await
            .unwrap();
        assert_eq!(read_bytes, 1);
        assert_eq!(read, Bytes::from_static(b"hello!"));
        assert_eq!(pool.locate(read.as_ptr()), None);
        assert_eq!(pool.allocated(), 0);
    }

    #[monoio::test_all]
    async fn write_parts_gathers_every_part_in_order() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let writer = monoio::spawn(async move {
            let mut stream = connect(addr).await.unwrap();
            assert!(stream.nodelay().unwrap());
            let big = Bytes::from(vec![7u8; 300_000]);
            write_parts(
                &mut stream,
                IoParts::new([
                    Bytes::from_static(b"head:"),
                    big,
                    Bytes::from_static(b":tail"),
                ]),
                || {},
            )
            .await
            .unwrap();
        });
        let (mut server, _) = accept(&listener).await.unwrap();
        assert!(server.nodelay().unwrap());
        let mut buf = BytesMut::new();
        while fill(&mut server, &mut buf, READ_CHUNK_BYTES).await.unwrap() > 0 {}
        writer.await;
        assert_eq!(buf.len(), 5 + 300_000 + 5);
        assert_eq!(&buf[..5], b"head:");
        assert!(buf[5..300_005].iter().all(|&b| b == 7));
        assert_eq!(&buf[300_005..], b":tail");
    }

    #[monoio::test_all(timer_enabled = true)]
    async fn parts_handed_back_are_empty_and_refill_in_place() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let writer = monoio::spawn(async move {
            let mut stream = connect(addr).await.unwrap();
            let data = Bytes::from(b"chunk-one".to_vec());
            let mut progress_calls = 0;
            let (res, mut parts) = write_parts_back(
                &mut stream,
                IoParts::new([Bytes::from_static(b"9\r\n"), data.clone()]),
                || progress_calls += 1,
            )
            .await;
            res.unwrap();
            // Taken in one write: nothing was left to push a deadline on for.
            assert_eq!(progress_calls, 0);
            // Nothing of the written data is held any more.
            assert!(parts.parts.is_empty());
            assert!(data.is_unique());
            let (parts_at, iovecs_at) = (parts.parts.as_ptr(), parts.iovecs.as_ptr());
            parts.refill([
                Bytes::from_static(b"9\r\n"),
                Bytes::new(),
                Bytes::from_static(b"chunk-two"),
            ]);
            // The same allocations, describing exactly the new parts.
            assert_eq!(parts.parts.as_ptr(), parts_at);
            assert_eq!(parts.iovecs.as_ptr(), iovecs_at);
            assert_eq!(parts.iovecs.len(), 2);
            assert_eq!(parts.iovecs[1].iov_len, 9);
            let (res, _) = write_parts_back(&mut stream, parts, || {}).await;
            res.unwrap();
        });
        let (mut server, _) = accept(&listener).await.unwrap();
        let mut buf = BytesMut::new();
        while fill(&mut server, &mut buf, READ_CHUNK_BYTES).await.unwrap() > 0 {}
        writer.await;
        assert_eq!(&buf[..], b"9\r\nchunk-one9\r\nchunk-two");
    }
}
