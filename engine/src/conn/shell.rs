//! The IO shell: one reader, one writer and one timer task per connection on
//! the current monoio runtime, around a shared [`ConnCore`].

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::time::Instant;

use crate::sync::channel;
use bytes::{Bytes, BytesMut};
use iop_wire::codec::BodyParts;
use iop_wire::{pb, CloseReason, FrameDecoder, Inbound, TunnelChunk};
use monoio::buf::IoBufMut;
use monoio::io::{AsyncReadRent, AsyncWriteRent};

use super::core::{ConnCore, ConnStats, OutFrame, TrySendError};
use super::segments::{write_all_segments, BatchBuilder, IoSegments};
use super::{ConnConfig, SendError};
use crate::clock;
use crate::sync::{Notify, WakeList};

/// Each read offers the socket at least this much free buffer.
const READ_CHUNK_BYTES: usize = 64 * 1024;
/// Below this much free buffer, a fresh chunk is reserved before reading.
const READ_MIN_SPARE_BYTES: usize = 4 * 1024;

/// How a closing connection unblocks its reader: the reader task is never
/// cancelled (a cancelled io_uring read can lose bytes), so the socket is
/// shut down from outside and the pending read returns.
///
/// The action runs at most once, and never after both halves of the stream
/// (and with them the file descriptor) are dropped, so a descriptor number
/// reused by another socket is never shut down by mistake.
pub struct SocketShutdown {
    action: ShutdownAction,
}

enum ShutdownAction {
    Fd(RawFd),
    Custom(Box<dyn FnOnce()>),
}

impl std::fmt::Debug for SocketShutdown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.action {
            ShutdownAction::Fd(fd) => f.debug_tuple("SocketShutdown::Fd").field(fd).finish(),
            ShutdownAction::Custom(_) => f.write_str("SocketShutdown::Custom"),
        }
    }
}

impl SocketShutdown {
    /// `shutdown(fd, SHUT_RDWR)` on `socket`'s descriptor. Take it from the
    /// `TcpStream` *before* wrapping the stream in TLS, and pass that same
    /// stream (split) to [`spawn_conn`].
    pub fn for_socket(socket: &impl AsRawFd) -> Self {
        Self {
            action: ShutdownAction::Fd(socket.as_raw_fd()),
        }
    }

    /// A custom action that makes the stream's pending read return (for
    /// streams without a socket of their own).
    pub fn custom(action: impl FnOnce() + 'static) -> Self {
        Self {
            action: ShutdownAction::Custom(Box::new(action)),
        }
    }

    fn run(self) {
        match self.action {
            ShutdownAction::Fd(fd) => {
                // Safe wrapper over shutdown(2); the caller guarantees the
                // descriptor is still owned by the connection's stream.
                if let Err(err) = nix::sys::socket::shutdown(fd, nix::sys::socket::Shutdown::Both) {
                    // ENOTCONN: the peer already reset the connection.
                    tracing::debug!(fd, error = %err, "socket shutdown");
                }
            }
            ShutdownAction::Custom(action) => action(),
        }
    }
}

/// What the connection delivers to the application.
// `Closed` happens once per connection; boxing `Frame` to shrink the enum
// would cost an allocation per received frame.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum ConnEvent {
    /// A frame from the peer (heartbeats, acks and `Close` are consumed by
    /// the connection). `bytes` fields are slices of the read buffer.
    Frame(pb::Frame),
    /// A relayed chunk's tunnel `BODY` frame, as slices of the read buffer
    /// ([`iop_wire::Inbound::Chunk`]); [`TunnelChunk::into_tunnel_frame`]
    /// is the frame it is.
    Chunk(TunnelChunk),
    /// The connection closed; delivered exactly once, after every frame, and
    /// followed by nothing.
    Closed {
        /// One of the transport's reasons (`peer_closed`, `peer:<reason>`,
        /// `heartbeat_timeout`, `frame_too_large`, `decode_error`,
        /// `io_error`, `tls_alert:<alert>`, `tls_error`,
        /// `control_lane_overflow`, `handle_dropped`, `aborted`) or the
        /// reason given to [`ConnHandle::close`].
        reason: CloseReason,
    },
}

/// State shared by the tasks and handles of one connection.
struct Shared {
    core: RefCell<ConnCore>,
    /// Work for the writer (a frame to transmit, or the close).
    writer_wake: Notify,
    /// The timer must re-arm (an earlier deadline, or the close).
    timer_wake: Notify,
    /// The deadline the timer task sleeps until (`None`: no deadline).
    timer_armed_at: Cell<Option<Instant>>,
    /// Senders waiting for bulk lane room.
    bulk_room: WakeList,
    /// `None` once used or once the stream is gone.
    shutdown: RefCell<Option<SocketShutdown>>,
    /// Stream halves not yet dropped (reader's and writer's).
    halves_alive: Cell<u8>,
    /// Live [`ConnHandle`]s.
    handles: Cell<usize>,
}

impl Shared {
    /// Why the connection closed, once its reader is done (`aborted` if
    /// the core recorded no reason).
    fn final_close_reason(&self) -> CloseReason {
        let reason = self.core.borrow().close_reason().cloned();
        reason.unwrap_or(CloseReason::Aborted)
    }

    /// Run after every input to the core: wakes the tasks that have work and
    /// shuts the socket down once the core reports the close.
    fn after_change(&self) {
        let (closed_now, has_transmit, is_open, is_closed, timeout) = {
            let mut core = self.core.borrow_mut();
            (
                core.poll_closed(),
                core.has_transmit(),
                core.is_open(),
                core.is_closed(),
                core.poll_timeout(),
            )
        };
        if has_transmit || is_closed {
            self.writer_wake.notify();
        }
        let timer_needs_rearm = match (timeout, self.timer_armed_at.get()) {
            (None, _) => is_closed,
            (Some(_), None) => true,
            (Some(deadline), Some(armed)) => deadline < armed,
        };
        if timer_needs_rearm {
            self.timer_wake.notify();
        }
        if !is_open {
            self.bulk_room.wake_all();
        }
        if let Some(reason) = closed_now {
            tracing::debug!(%reason, "frame connection closed");
            self.shutdown_socket();
        }
    }

    fn shutdown_socket(&self) {
        if self.halves_alive.get() == 0 {
            return;
        }
        let action = self.shutdown.borrow_mut().take();
        if let Some(action) = action {
            action.run();
        }
    }

    fn close(&self, reason: CloseReason) {
        self.core.borrow_mut().close(reason, clock::now());
        self.after_change();
    }
}

/// One half of the stream, owned by a task. Dropping the last half discards
/// the shutdown action before the stream (and its descriptor) goes away.
struct HalfGuard<H> {
    half: H,
    shared: Rc<Shared>,
}

impl<H> Drop for HalfGuard<H> {
    fn drop(&mut self) {
        let alive = self.shared.halves_alive.get().saturating_sub(1);
        self.shared.halves_alive.set(alive);
        if alive == 0 {
            self.shared.shutdown.borrow_mut().take();
        }
        // `self.half` is dropped after this body returns.
    }
}

/// Starts a frame connection over a split stream (a plain `TcpStream` via
/// `monoio::io::Splitable::into_split`, or a [`crate::tls::TlsStream`] via
/// its own `into_split`) on the current monoio runtime, which must have its
/// timer enabled. Frames are queued for [`ConnEvents`].
///
/// Spawns exactly one reader task (never cancelled), one writer task and
/// one heartbeat timer task. `shutdown` must make a pending read on
/// `read_half` return; see [`SocketShutdown`].
pub fn spawn_conn<R, W>(
    read_half: R,
    write_half: W,
    shutdown: SocketShutdown,
    config: ConnConfig,
) -> (ConnHandle, ConnEvents)
where
    R: AsyncReadRent + 'static,
    W: AsyncWriteRent + 'static,
{
    let (handle, rx) = spawn_with(read_half, write_half, shutdown, config, None);
    let events = ConnEvents {
        shared: handle.shared.clone(),
        rx,
        closed_delivered: false,
    };
    (handle, events)
}

/// [`spawn_conn`], with every frame (and, with `ConnConfig::chunks`, every
/// chunk) handed to `handler` by the reader task as it is decoded, in the
/// order received, instead of queued for [`ConnEvents`]: no queue, and no
/// second task woken per frame. The handler cannot wait (it is not async),
/// so nothing it does holds up the reader for long; it gets a [`ConnRef`]
/// to close the connection with. [`ConnClosed`] brings the close, after
/// the handler has had the last frame.
pub fn spawn_conn_handled<R, W, H>(
    read_half: R,
    write_half: W,
    shutdown: SocketShutdown,
    config: ConnConfig,
    handler: H,
) -> (ConnHandle, ConnClosed)
where
    R: AsyncReadRent + 'static,
    W: AsyncWriteRent + 'static,
    H: FnMut(ConnRef<'_>, Inbound) + 'static,
{
    let handler: Box<FrameHandler> = Box::new(handler);
    let (handle, rx) = spawn_with(read_half, write_half, shutdown, config, Some(handler));
    let closed = ConnClosed {
        shared: handle.shared.clone(),
        rx,
    };
    (handle, closed)
}

fn spawn_with<R, W>(
    read_half: R,
    write_half: W,
    shutdown: SocketShutdown,
    config: ConnConfig,
    handler: Option<Box<FrameHandler>>,
) -> (ConnHandle, channel::Receiver<Inbound>)
where
    R: AsyncReadRent + 'static,
    W: AsyncWriteRent + 'static,
{
    // With a handler the queue carries nothing: its sender, dropped when the
    // reader ends, only tells `ConnClosed` the connection closed.
    let queue_frames = if handler.is_some() {
        1
    } else {
        config.event_queue_max_frames.max(1)
    };
    let (tx, rx) = channel::channel(queue_frames);
    let max_frame_bytes = config.max_frame_bytes;
    let chunks = config.chunks;
    let write_batch_max_bytes = config.write_batch_max_bytes;
    let body_copy_max_bytes = config.body_copy_max_bytes;
    let shared = Rc::new(Shared {
        core: RefCell::new(ConnCore::new(config, clock::now())),
        writer_wake: Notify::default(),
        timer_wake: Notify::default(),
        timer_armed_at: Cell::new(None),
        bulk_room: WakeList::default(),
        shutdown: RefCell::new(Some(shutdown)),
        halves_alive: Cell::new(2),
        handles: Cell::new(1),
    });
    let reader = HalfGuard {
        half: read_half,
        shared: shared.clone(),
    };
    let writer = HalfGuard {
        half: write_half,
        shared: shared.clone(),
    };
    let sink = match handler {
        Some(handler) => Sink::Handler { handler, _done: tx },
        None => Sink::Queue(tx),
    };
    monoio::spawn(reader_task(
        shared.clone(),
        reader,
        sink,
        max_frame_bytes,
        chunks,
    ));
    monoio::spawn(writer_task(
        shared.clone(),
        writer,
        write_batch_max_bytes,
        body_copy_max_bytes,
    ));
    monoio::spawn(timer_task(shared.clone()));
    (ConnHandle { shared }, rx)
}

/// A connection as the handler of its frames sees it
/// ([`spawn_conn_handled`]): it can close the connection, and unlike a
/// [`ConnHandle`] it does not keep it open.
#[derive(Clone, Copy)]
pub struct ConnRef<'a> {
    shared: &'a Shared,
}

impl std::fmt::Debug for ConnRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnRef")
            .field("closed", &self.is_closed())
            .finish()
    }
}

impl ConnRef<'_> {
    /// Closes the connection, as [`ConnHandle::close`] does.
    pub fn close(&self, reason: CloseReason) {
        self.shared.close(reason);
    }

    /// True from the moment the connection starts closing.
    pub fn is_closed(&self) -> bool {
        !self.shared.core.borrow().is_open()
    }
}

/// What [`spawn_conn_handled`] calls with each frame.
type FrameHandler = dyn FnMut(ConnRef<'_>, Inbound);

/// Where the reader puts what it decoded.
enum Sink {
    /// Queued for [`ConnEvents`].
    Queue(channel::Sender<Inbound>),
    /// Handed to the application's handler at once.
    Handler {
        handler: Box<FrameHandler>,
        /// Never sent on: dropped with the reader, so that [`ConnClosed`]
        /// sees the close.
        _done: channel::Sender<Inbound>,
    },
}

/// Sends frames on a connection and closes it. Cheap to clone; dropping the
/// last handle closes the connection with reason `handle_dropped`.
pub struct ConnHandle {
    shared: Rc<Shared>,
}

/// The future of [`ConnHandle::push_bulk`]: the frame goes on the bulk
/// lane at the first poll, or at the first poll after the writer made room.
///
/// Written out rather than as an `async fn`: that would hold the frame
/// twice (as its argument and as the local it retries with) and the
/// lane's refusal beside them, about 450 bytes where this is under 200,
/// in the future of every stream that awaits a send.
#[derive(Debug)]
#[must_use = "futures do nothing unless polled"]
pub struct PushBulk<'a> {
    handle: &'a ConnHandle,
    /// The frame (or its encoding error) until it is queued or refused.
    pending: Option<Result<OutFrame, SendError>>,
    /// Waiting for the writer to make room on a full lane.
    room: Option<crate::sync::WakeListWait<'a>>,
}

impl Future for PushBulk<'_> {
    type Output = Result<(), SendError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        use std::task::Poll;
        let this = &mut *self;
        loop {
            if let Some(room) = this.room.as_mut() {
                if std::pin::Pin::new(room).poll(cx).is_pending() {
                    return Poll::Pending;
                }
                this.room = None;
            }
            let out = match this.pending.take() {
                Some(Ok(out)) => out,
                Some(Err(e)) => return Poll::Ready(Err(e)),
                // Polled again after it finished: nothing more to do.
                None => return Poll::Ready(Ok(())),
            };
            let shared = &this.handle.shared;
            let result = shared.core.borrow_mut().try_send_bulk(out);
            match result {
                Ok(()) => {
                    shared.after_change();
                    return Poll::Ready(Ok(()));
                }
                Err(TrySendError::Closed) => return Poll::Ready(Err(SendError::Closed)),
                Err(TrySendError::Full(back)) => {
                    this.pending = Some(Ok(back));
                    this.room = Some(shared.bulk_room.wait());
                }
            }
        }
    }
}

impl std::fmt::Debug for ConnHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let core = self.shared.core.borrow();
        f.debug_struct("ConnHandle")
            .field("close_reason", &core.close_reason())
            .field("stats", &core.stats())
            .finish()
    }
}

impl Clone for ConnHandle {
    fn clone(&self) -> Self {
        self.shared.handles.set(self.shared.handles.get() + 1);
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl Drop for ConnHandle {
    fn drop(&mut self) {
        let handles = self.shared.handles.get().saturating_sub(1);
        self.shared.handles.set(handles);
        if handles == 0 {
            self.shared.close(CloseReason::HandleDropped);
        }
    }
}

impl ConnHandle {
    /// Queues `frame` on the control lane (registration, readiness, cancel,
    /// commands): written ahead of every bulk frame. The control lane is
    /// bounded; overflowing it closes the connection.
    pub fn send_control(&self, frame: pb::Frame) -> Result<(), SendError> {
        let result = {
            let mut core = self.shared.core.borrow_mut();
            core.encode_frame(&frame)
                .and_then(|out| core.send_control(out, clock::now()))
        };
        self.shared.after_change();
        result
    }

    /// Queues `frame` on the bulk lane (run events, tunnel frames), waiting
    /// while the lane is full (backpressure).
    ///
    /// This and the other bulk sends encode at the call and return a future
    /// that holds only the encoded bytes: a `pb::Frame` is most of a
    /// kilobyte, and a future that kept it (an `async fn` keeps its
    /// arguments to the end) would carry a copy in every caller's future
    /// that awaits a send, for the life of each stream.
    pub fn send_bulk(&self, frame: pb::Frame) -> impl Future<Output = Result<(), SendError>> + '_ {
        // `frame` is dropped here, before the returned future first runs:
        // only the encoded copy waits for lane room (a large request body
        // is not held twice).
        self.push_bulk(self.encode_bulk(&frame))
    }

    /// Queues a tunnel `BODY` frame on the bulk lane: `frame` without its body
    /// (a body in it is ignored) and `body`, which the writer sends as it is,
    /// without copying it (bodies up to `ConnConfig::body_copy_max_bytes` are
    /// coalesced with other frames instead). Waits while the lane is full.
    pub fn send_body_frame(
        &self,
        frame: pb::ProviderTunnelFrame,
        body: Bytes,
    ) -> impl Future<Output = Result<(), SendError>> + '_ {
        self.push_bulk(self.encode_body_frame(&frame, body))
    }

    /// Queues a `ProviderTunnelRequest` on the bulk lane: `request` without
    /// its body (a body in it is ignored) and the pieces of `body`, which
    /// the writer sends as they are, never joined or copied into the frame
    /// (a large request body is held once: by its owner). Waits while the
    /// lane is full.
    pub fn send_tunnel_request(
        &self,
        request: &pb::ProviderTunnelRequest,
        body: BodyParts,
    ) -> impl Future<Output = Result<(), SendError>> + '_ {
        let encoded = self
            .shared
            .core
            .borrow_mut()
            .encode_request_frame(request, body);
        self.push_bulk(encoded)
    }

    /// [`send_bulk`](Self::send_bulk)'s first half: `frame` encoded for the
    /// bulk lane, to hand to [`push_bulk`](Self::push_bulk).
    pub fn encode_bulk(&self, frame: &pb::Frame) -> Result<OutFrame, SendError> {
        self.shared.core.borrow_mut().encode_frame(frame)
    }

    /// A relayed chunk's `BODY` frame (run `run_id`, number `seq`) encoded
    /// for the bulk lane, to hand to [`push_bulk`](Self::push_bulk): the
    /// bytes [`encode_body_frame`](Self::encode_body_frame) makes of that
    /// frame, with no frame built. `body` is kept as it is, not copied.
    pub fn encode_chunk(&self, run_id: &str, seq: u64, body: Bytes) -> Result<OutFrame, SendError> {
        self.shared
            .core
            .borrow_mut()
            .encode_chunk(run_id, seq, body)
    }

    /// [`send_body_frame`](Self::send_body_frame)'s first half.
    pub fn encode_body_frame(
        &self,
        frame: &pb::ProviderTunnelFrame,
        body: Bytes,
    ) -> Result<OutFrame, SendError> {
        self.shared.core.borrow_mut().encode_body_frame(frame, body)
    }

    /// Queues a frame encoded by [`encode_bulk`](Self::encode_bulk) or
    /// [`encode_body_frame`](Self::encode_body_frame) on the bulk lane,
    /// waiting while it is full; an encoding error is returned as it is.
    pub fn push_bulk(&self, encoded: Result<OutFrame, SendError>) -> PushBulk<'_> {
        PushBulk {
            handle: self,
            pending: Some(encoded),
            room: None,
        }
    }

    /// Closes the connection: frames already queued and then `Close{reason}`
    /// are written (best effort, bounded by `ConnConfig::close_linger`), then
    /// the socket is shut down. Does nothing once closing.
    pub fn close(&self, reason: CloseReason) {
        self.shared.close(reason);
    }

    /// True from the moment the connection starts closing (sends fail).
    pub fn is_closed(&self) -> bool {
        !self.shared.core.borrow().is_open()
    }

    /// The close reason, once closing.
    pub fn close_reason(&self) -> Option<CloseReason> {
        self.shared.core.borrow().close_reason().cloned()
    }

    /// Counters so far.
    pub fn stats(&self) -> ConnStats {
        self.shared.core.borrow().stats()
    }
}

/// The frames received on a connection, then its close.
pub struct ConnEvents {
    shared: Rc<Shared>,
    rx: channel::Receiver<Inbound>,
    closed_delivered: bool,
}

impl std::fmt::Debug for ConnEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnEvents")
            .field("closed_delivered", &self.closed_delivered)
            .finish()
    }
}

impl ConnEvents {
    /// The next event: frames in the order received, then exactly one
    /// [`ConnEvent::Closed`], then `None` forever. Consume events promptly:
    /// while `ConnConfig::event_queue_max_frames` frames wait here the reader
    /// stops reading, and heartbeats from the peer wait with them.
    pub async fn recv(&mut self) -> Option<ConnEvent> {
        if self.closed_delivered {
            return None;
        }
        match self.rx.recv().await {
            Some(Inbound::Frame(frame)) => Some(ConnEvent::Frame(frame)),
            Some(Inbound::Chunk(chunk)) => Some(ConnEvent::Chunk(chunk)),
            None => {
                // The reader is done: every received frame was delivered.
                self.closed_delivered = true;
                Some(ConnEvent::Closed {
                    reason: self.shared.final_close_reason(),
                })
            }
        }
    }
}

/// The close of a connection whose frames go to a handler
/// ([`spawn_conn_handled`]).
pub struct ConnClosed {
    shared: Rc<Shared>,
    rx: channel::Receiver<Inbound>,
}

impl std::fmt::Debug for ConnClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnClosed").finish_non_exhaustive()
    }
}

impl ConnClosed {
    /// Waits until the reader is done (the handler has had every frame)
    /// and returns why the connection closed, one of the reasons
    /// [`ConnEvent::Closed`] carries.
    pub async fn wait(mut self) -> CloseReason {
        // Nothing is ever sent: `None` is the reader dropping its sender.
        while self.rx.recv().await.is_some() {}
        self.shared.final_close_reason()
    }
}

/// Reads, decodes and dispatches frames until the stream ends. Never
/// cancelled; a close ends it by shutting the socket down.
async fn reader_task<R: AsyncReadRent>(
    shared: Rc<Shared>,
    mut reader: HalfGuard<R>,
    mut sink: Sink,
    max_frame_bytes: usize,
    chunks: bool,
) {
    let mut decoder = FrameDecoder::with_max_frame_bytes(max_frame_bytes);
    let mut decoding = true;
    loop {
        while decoding {
            let decoded = if chunks {
                decoder.decode_inbound()
            } else {
                decoder.decode().map(|frame| frame.map(Inbound::Frame))
            };
            match decoded {
                Ok(Some(inbound)) => {
                    let deliver = match inbound {
                        Inbound::Frame(frame) => shared
                            .core
                            .borrow_mut()
                            .handle_frame(frame, clock::now())
                            .map(Inbound::Frame),
                        Inbound::Chunk(chunk) => shared
                            .core
                            .borrow_mut()
                            .handle_chunk(chunk)
                            .map(Inbound::Chunk),
                    };
                    shared.after_change();
                    match (deliver, &mut sink) {
                        (None, _) => {}
                        // An error means the application dropped its
                        // `ConnEvents`: the frame is discarded.
                        (Some(inbound), Sink::Queue(tx)) => {
                            let _ = tx.send(inbound).await;
                        }
                        (Some(inbound), Sink::Handler { handler, .. }) => {
                            handler(ConnRef { shared: &shared }, inbound);
                        }
                    }
                }
                Ok(None) => break,
                Err(err) => {
                    tracing::debug!(error = %err, "frame decode failed");
                    decoding = false;
                    shared
                        .core
                        .borrow_mut()
                        .handle_decode_error(&err, clock::now());
                    shared.after_change();
                }
            }
        }

        // Read straight into the decoder's buffer: decoded `bytes` fields
        // are then slices of it (zero copy).
        let wanted_bytes = if decoding { decoder.bytes_wanted() } else { 0 };
        let mut buf = std::mem::take(decoder.buffer_mut());
        if !decoding {
            buf.clear(); // keep draining until the stream ends, but discard
        }
        reserve_read_room(&mut buf, wanted_bytes);
        let len = buf.len();
        let (result, slice) = reader.half.read(buf.slice_mut(len..)).await;
        *decoder.buffer_mut() = slice.into_inner();
        match result {
            Ok(0) => {
                shared.core.borrow_mut().handle_peer_eof();
                shared.after_change();
                break;
            }
            Ok(n) => shared.core.borrow_mut().record_bytes_received(n),
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
            Err(err) => {
                shared.core.borrow_mut().handle_io_error(&err);
                shared.after_change();
                break;
            }
        }
    }
    // Dropping the sink's sender lets `ConnEvents` deliver `Closed` (or
    // `ConnClosed` return).
}

/// Makes room in `buf` for the next read. The rest of a frame the decoder
/// already made room for (`wanted_bytes`) is read into that room: growing
/// the buffer then would double a frame-sized allocation, and the spare
/// tail left after the frame would keep all of it, the frame's bytes
/// included, alive long after the frame was handled. An empty buffer gets
/// a fresh chunk rather than reclaiming the allocation it shared with the
/// frames already handed out, which may be a large frame's.
fn reserve_read_room(buf: &mut BytesMut, wanted_bytes: usize) {
    let spare_bytes = buf.capacity() - buf.len();
    if spare_bytes >= READ_MIN_SPARE_BYTES || (0 < wanted_bytes && wanted_bytes <= spare_bytes) {
        return;
    }
    if buf.is_empty() {
        *buf = BytesMut::with_capacity(READ_CHUNK_BYTES);
    } else {
        buf.reserve(READ_CHUNK_BYTES);
    }
}

/// Drains the lanes: gathers every queued frame (control first) into one
/// vectored write, until the connection is closed.
async fn writer_task<W: AsyncWriteRent>(
    shared: Rc<Shared>,
    mut writer: HalfGuard<W>,
    write_batch_max_bytes: usize,
    body_copy_max_bytes: usize,
) {
    let mut batch = BatchBuilder::new(body_copy_max_bytes);
    loop {
        loop {
            {
                let core = shared.core.borrow();
                if core.is_closed() {
                    return;
                }
                if core.has_transmit() {
                    break;
                }
            }
            shared.writer_wake.notified().await;
        }
        let close_frame_in_flight = {
            let mut core = shared.core.borrow_mut();
            while batch.has_room(write_batch_max_bytes) {
                let Some(frame) = core.poll_transmit() else {
                    break;
                };
                batch.push(frame);
            }
            core.close_frame_in_flight()
        };
        if shared.bulk_room.has_waiters() {
            shared.bulk_room.wake_all();
        }
        let segments = IoSegments::new(batch.take());
        let (result, segments) = write_all_segments(&mut writer.half, segments).await;
        batch.recycle(segments.into_segments());
        let result = match result {
            Ok(()) => writer.half.flush().await,
            Err(err) => Err(err),
        };
        if let Err(err) = result {
            shared.core.borrow_mut().handle_io_error(&err);
            shared.after_change();
            return;
        }
        if close_frame_in_flight {
            // End our direction cleanly (TLS close_notify, then FIN) before
            // the socket is shut down; bounded by the close linger.
            let _ = writer.half.shutdown().await;
        }
        shared.core.borrow_mut().handle_transmitted();
        shared.after_change();
    }
}

/// Sleeps until the core's next deadline (heartbeat, heartbeat timeout,
/// close linger) and hands it the time; re-arms when told of an earlier one.
async fn timer_task(shared: Rc<Shared>) {
    loop {
        let deadline = {
            let core = shared.core.borrow();
            if core.is_closed() {
                return;
            }
            core.poll_timeout()
        };
        shared.timer_armed_at.set(deadline);
        let Some(deadline) = deadline else {
            shared.timer_wake.notified().await;
            continue;
        };
        let sleep = monoio::time::sleep_until(monoio::time::Instant::from_std(deadline));
        monoio::select! {
            _ = sleep => {}
            _ = shared.timer_wake.notified() => continue,
        }
        shared.core.borrow_mut().handle_timeout(clock::now());
        shared.after_change();
    }
}
