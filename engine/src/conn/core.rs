//! [`ConnCore`]: the sans-IO frame-connection state (lanes, heartbeats, close).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use iop_wire::codec::{self, BodyFrameHead, BodyParts, RequestFrameHead};
use iop_wire::pb::{self, frame::Body};
use iop_wire::{CloseReason, DecodeError, TunnelChunk};

use super::{ConnConfig, SendError};

/// Longest close reason kept (longer reasons, e.g. from a peer, are cut).
const REASON_MAX_BYTES: usize = 128;
/// Longest `Close.detail` sent.
const DETAIL_MAX_BYTES: usize = 256;
/// Unanswered heartbeats whose send time is remembered. More can only be
/// outstanding with an interval far below the timeout; the oldest one still
/// drives the deadline and an ack for any later `seq` answers them all.
const TRACKED_HEARTBEATS_MAX: usize = 16;
/// Encoded frames are cut from arena blocks of this size (fewer allocations
/// for the many small control and event frames).
const ENCODE_ARENA_BYTES: usize = 16 * 1024;

/// One encoded frame ready for the writer: `head` (length prefix and protobuf
/// bytes) followed by `body`, which is empty except for tunnel `BODY` frames
/// and tunnel requests, whose body bytes travel as they are, never copied by
/// the encoder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutFrame {
    head: Bytes,
    body: BodyParts,
}

impl OutFrame {
    /// The length prefix and protobuf bytes (for a `BODY` frame, everything
    /// up to the body bytes).
    pub fn head(&self) -> &Bytes {
        &self.head
    }

    /// The body pieces written after `head` (empty for other frames).
    pub fn body(&self) -> &BodyParts {
        &self.body
    }

    /// Bytes this frame occupies on the wire, length prefix included.
    pub fn len_bytes(&self) -> usize {
        self.head.len() + self.body.len()
    }
}

/// A bulk frame was not queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrySendError {
    /// The bulk lane is full; the frame is handed back to retry once the
    /// writer has made room.
    #[error("bulk lane full")]
    Full(OutFrame),
    /// The connection is closing or closed.
    #[error("connection closed")]
    Closed,
}

/// Counters of one connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnStats {
    /// Frames handed to the writer (heartbeats, acks and `Close` included).
    pub frames_sent: u64,
    /// Bytes of those frames, length prefixes included.
    pub bytes_sent: u64,
    /// Frames decoded from the peer (heartbeats and acks included).
    pub frames_received: u64,
    /// Bytes read from the peer.
    pub bytes_received: u64,
    /// Heartbeats this side queued.
    pub heartbeats_sent: u64,
    /// Heartbeat acks received from the peer.
    pub heartbeat_acks_received: u64,
    /// Heartbeat acks this side queued in answer to the peer.
    pub heartbeat_acks_sent: u64,
}

/// Where the connection is in its life (see the module docs' diagram).
#[derive(Debug)]
enum State {
    /// Frames flow both ways.
    Open,
    /// No new frames are accepted; queued frames, then `close_frame`, are
    /// written until `linger_deadline`.
    Closing {
        reason: CloseReason,
        linger_deadline: Instant,
        /// The `Close{reason}` frame, until the writer takes it.
        close_frame: Option<OutFrame>,
        /// The writer took `close_frame`; once it reports the write done the
        /// connection is closed.
        close_frame_taken: bool,
    },
    /// Finished; the shell shuts the socket down.
    Closed { reason: CloseReason },
}

/// A heartbeat this side sent that the peer has not answered yet.
#[derive(Debug, Clone, Copy)]
struct SentHeartbeat {
    seq: u64,
    sent_at: Instant,
}

/// Heartbeat bookkeeping (T4).
#[derive(Debug)]
struct Heartbeats {
    interval: Duration,
    timeout: Duration,
    next_send_at: Instant,
    /// `seq` of the next heartbeat; the first is 1.
    next_seq: u64,
    /// Unanswered heartbeats, oldest first (bounded).
    unanswered: VecDeque<SentHeartbeat>,
}

impl Heartbeats {
    fn deadline(&self) -> Option<Instant> {
        self.unanswered
            .front()
            .map(|sent| sent.sent_at + self.timeout)
    }

    /// Records an ack: it answers every heartbeat up to `seq`. Returns false
    /// for an ack of a heartbeat never sent.
    fn answer(&mut self, seq: u64) -> bool {
        if seq == 0 || seq >= self.next_seq {
            return false;
        }
        while self.unanswered.front().is_some_and(|sent| sent.seq <= seq) {
            self.unanswered.pop_front();
        }
        true
    }
}

/// The sans-IO frame connection (T1, T4): two outbound lanes, heartbeat
/// bookkeeping and the close state machine. It reads no clock and does no
/// IO; the shell ([`super::spawn_conn`]) feeds it received frames and `now`,
/// and writes what [`ConnCore::poll_transmit`] hands out.
///
/// Driving it:
/// - after any input, call [`poll_transmit`](Self::poll_transmit) until it
///   returns `None`, write those frames, then call
///   [`handle_transmitted`](Self::handle_transmitted);
/// - call [`handle_timeout`](Self::handle_timeout) when the instant from
///   [`poll_timeout`](Self::poll_timeout) is reached (ask again after every
///   input: it may move earlier);
/// - after any input, call [`poll_closed`](Self::poll_closed): it reports the
///   close reason once, when the socket must be shut down.
#[derive(Debug)]
pub struct ConnCore {
    config: ConnConfig,
    state: State,
    control: VecDeque<OutFrame>,
    bulk: VecDeque<OutFrame>,
    bulk_bytes: usize,
    heartbeats: Heartbeats,
    encode_arena: BytesMut,
    stats: ConnStats,
    closed_reported: bool,
}

impl ConnCore {
    /// A connection opened at `now`; the first heartbeat is due one interval
    /// later.
    pub fn new(config: ConnConfig, now: Instant) -> Self {
        let heartbeats = Heartbeats {
            interval: config.heartbeat_interval(),
            timeout: config.heartbeat_timeout(),
            next_send_at: now + config.heartbeat_interval(),
            next_seq: 1,
            unanswered: VecDeque::new(),
        };
        Self {
            config,
            state: State::Open,
            control: VecDeque::new(),
            bulk: VecDeque::new(),
            bulk_bytes: 0,
            heartbeats,
            encode_arena: BytesMut::with_capacity(ENCODE_ARENA_BYTES),
            stats: ConnStats::default(),
            closed_reported: false,
        }
    }

    /// The configuration this connection runs with.
    pub fn config(&self) -> &ConnConfig {
        &self.config
    }

    /// True while frames may still be queued (not closing, not closed).
    pub fn is_open(&self) -> bool {
        matches!(self.state, State::Open)
    }

    /// True once the connection is fully closed (the socket must be shut).
    pub fn is_closed(&self) -> bool {
        matches!(self.state, State::Closed { .. })
    }

    /// The close reason, from the moment the connection starts closing.
    pub fn close_reason(&self) -> Option<&CloseReason> {
        match &self.state {
            State::Open => None,
            State::Closing { reason, .. } | State::Closed { reason } => Some(reason),
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> ConnStats {
        self.stats
    }

    /// Frames waiting on the control lane.
    pub fn control_queued_frames(&self) -> usize {
        self.control.len()
    }

    /// Frames waiting on the bulk lane.
    pub fn bulk_queued_frames(&self) -> usize {
        self.bulk.len()
    }

    /// Encodes `frame` for either lane.
    pub fn encode_frame(&mut self, frame: &pb::Frame) -> Result<OutFrame, SendError> {
        if !self.is_open() {
            return Err(SendError::Closed);
        }
        let head = self.encode_into_arena(frame)?;
        Ok(OutFrame {
            head,
            body: BodyParts::default(),
        })
    }

    /// Encodes a tunnel `BODY` frame: `frame` without its body (any body in
    /// it is ignored) followed by `body`, which is kept as it is, not copied.
    pub fn encode_body_frame(
        &mut self,
        frame: &pb::ProviderTunnelFrame,
        body: Bytes,
    ) -> Result<OutFrame, SendError> {
        let body_len = body.len();
        self.encode_with_body(BodyParts::whole(body), |arena, max_frame_bytes| {
            BodyFrameHead::encode(frame, body_len, arena, max_frame_bytes)
        })
    }

    /// Encodes a relayed chunk's tunnel `BODY` frame — run `run_id`, number
    /// `seq`, `body` kept as it is — with no frame built
    /// ([`BodyFrameHead::encode_chunk`]).
    pub fn encode_chunk(
        &mut self,
        run_id: &str,
        seq: u64,
        body: Bytes,
    ) -> Result<OutFrame, SendError> {
        let body_len = body.len();
        self.encode_with_body(BodyParts::whole(body), |arena, max_frame_bytes| {
            BodyFrameHead::encode_chunk(run_id, seq, body_len, arena, max_frame_bytes)
        })
    }

    /// Encodes a `ProviderTunnelRequest` frame: `request` without its body
    /// (any body in it is ignored) followed by the pieces of `body`, which
    /// are kept as they are, not copied or joined.
    pub fn encode_request_frame(
        &mut self,
        request: &pb::ProviderTunnelRequest,
        body: BodyParts,
    ) -> Result<OutFrame, SendError> {
        let body_len = body.len();
        self.encode_with_body(body, |arena, max_frame_bytes| {
            RequestFrameHead::encode(request, body_len, arena, max_frame_bytes)
        })
    }

    /// A frame whose head `write_head` appends to the arena (under the
    /// frame size cap it is given), followed by `body` as it is.
    fn encode_with_body(
        &mut self,
        body: BodyParts,
        write_head: impl FnOnce(&mut BytesMut, usize) -> Result<(), codec::EncodeError>,
    ) -> Result<OutFrame, SendError> {
        if !self.is_open() {
            return Err(SendError::Closed);
        }
        write_head(&mut self.encode_arena, self.config.max_frame_bytes)?;
        let head = self.encode_arena.split().freeze();
        Ok(OutFrame { head, body })
    }

    /// Queues an encoded frame on the control lane. A full control lane
    /// closes the connection with [`CloseReason::ControlLaneOverflow`] and
    /// returns [`SendError::Closed`].
    pub fn send_control(&mut self, frame: OutFrame, now: Instant) -> Result<(), SendError> {
        if !self.is_open() {
            return Err(SendError::Closed);
        }
        self.push_control(frame, now)
    }

    /// Queues an encoded frame on the bulk lane, or hands it back when the
    /// lane is full (by frames or bytes; one frame always fits an empty lane).
    // The frame comes back by value (a move of its handles, 128 bytes):
    // boxing it would allocate on every full lane.
    #[allow(clippy::result_large_err)]
    pub fn try_send_bulk(&mut self, frame: OutFrame) -> Result<(), TrySendError> {
        if !self.is_open() {
            return Err(TrySendError::Closed);
        }
        if !self.bulk_has_room(frame.len_bytes()) {
            return Err(TrySendError::Full(frame));
        }
        self.bulk_bytes += frame.len_bytes();
        self.bulk.push_back(frame);
        Ok(())
    }

    /// True when a bulk frame of `len_bytes` would be queued now.
    pub fn bulk_has_room(&self, len_bytes: usize) -> bool {
        self.bulk.is_empty()
            || (self.bulk.len() < self.config.bulk_lane_max_frames
                && self.bulk_bytes.saturating_add(len_bytes) <= self.config.bulk_lane_max_bytes)
    }

    /// Takes a frame received from the peer. Heartbeats are answered on the
    /// control lane, acks and `Close` are consumed; any other frame is
    /// returned for the application. Frames arriving once the connection is
    /// closing are dropped.
    pub fn handle_frame(&mut self, frame: pb::Frame, now: Instant) -> Option<pb::Frame> {
        self.stats.frames_received += 1;
        match (&self.state, &frame.body) {
            (State::Closed { .. }, _) => None,
            (State::Closing { .. }, Some(Body::Close(_))) => {
                // The peer is closing too; our own Close need not wait.
                self.finish_close();
                None
            }
            (State::Closing { .. }, _) => None,
            (State::Open, Some(Body::Heartbeat(heartbeat))) => {
                let ack = codec::frame(Body::HeartbeatAck(pb::HeartbeatAck { seq: heartbeat.seq }));
                if let Ok(ack) = self.encode_frame(&ack) {
                    if self.push_control(ack, now).is_ok() {
                        self.stats.heartbeat_acks_sent += 1;
                    }
                }
                None
            }
            (State::Open, Some(Body::HeartbeatAck(ack))) => {
                self.stats.heartbeat_acks_received += 1;
                if !self.heartbeats.answer(ack.seq) {
                    tracing::debug!(seq = ack.seq, "ignoring ack of a heartbeat never sent");
                }
                None
            }
            (State::Open, Some(Body::Close(close))) => {
                let reason =
                    CloseReason::Peer(truncated(&close.reason, REASON_MAX_BYTES).to_owned());
                tracing::debug!(%reason, detail = %truncated(&close.detail, DETAIL_MAX_BYTES), "peer closed the connection");
                self.state = State::Closed { reason };
                self.clear_lanes();
                None
            }
            (State::Open, _) => Some(frame),
        }
    }

    /// Takes a relayed chunk received from the peer: returned for the
    /// application while the connection is open, dropped once it is
    /// closing, as [`Self::handle_frame`] does with any data frame.
    pub fn handle_chunk(&mut self, chunk: TunnelChunk) -> Option<TunnelChunk> {
        self.stats.frames_received += 1;
        matches!(self.state, State::Open).then_some(chunk)
    }

    /// The byte stream from the peer failed to decode (T1): the connection
    /// closes with [`DecodeError::close_reason`], sending `Close` first.
    pub fn handle_decode_error(&mut self, err: &DecodeError, now: Instant) {
        self.close_on_error(err.close_reason(), &err.to_string(), now);
    }

    /// The peer ended the stream.
    pub fn handle_peer_eof(&mut self) {
        self.close_at_once(CloseReason::PeerClosed);
    }

    /// Reading or writing the socket failed. The reason names a TLS
    /// failure ([`super::io_error_reason`]): `tls_alert:access_denied` when
    /// the peer refused our identity.
    pub fn handle_io_error(&mut self, err: &std::io::Error) {
        if self.close_reason().is_none() {
            tracing::debug!(error = %err, "frame connection io error");
        }
        self.close_at_once(super::io_error_reason(err));
    }

    /// Counts bytes read from the peer.
    pub fn record_bytes_received(&mut self, len_bytes: usize) {
        self.stats.bytes_received += len_bytes as u64;
    }

    /// Closes the connection on the application's request: frames already
    /// queued are still written, then `Close{reason}`, within the linger
    /// time. Does nothing once closing.
    pub fn close(&mut self, reason: CloseReason, now: Instant) {
        if !self.is_open() {
            return;
        }
        self.start_closing(reason, "", now);
    }

    /// Processes timers due at `now`: the heartbeat timeout (checked first),
    /// the next heartbeat, and the end of a close's linger time.
    pub fn handle_timeout(&mut self, now: Instant) {
        match &self.state {
            State::Open => {}
            State::Closing {
                linger_deadline, ..
            } => {
                if now >= *linger_deadline {
                    self.finish_close();
                }
                return;
            }
            State::Closed { .. } => return,
        }
        if self
            .heartbeats
            .deadline()
            .is_some_and(|deadline| now >= deadline)
        {
            let detail = format!(
                "no heartbeat answer within {} ms",
                self.heartbeats.timeout.as_millis()
            );
            self.close_on_error(CloseReason::HeartbeatTimeout, &detail, now);
            return;
        }
        if now >= self.heartbeats.next_send_at {
            self.send_heartbeat(now);
            let next = self.heartbeats.next_send_at + self.heartbeats.interval;
            // After a long stall, restart the cadence instead of bursting.
            self.heartbeats.next_send_at = if next > now {
                next
            } else {
                now + self.heartbeats.interval
            };
        }
    }

    /// The next instant [`handle_timeout`](Self::handle_timeout) has work,
    /// `None` once closed.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match &self.state {
            State::Open => Some(match self.heartbeats.deadline() {
                Some(deadline) => deadline.min(self.heartbeats.next_send_at),
                None => self.heartbeats.next_send_at,
            }),
            State::Closing {
                linger_deadline, ..
            } => Some(*linger_deadline),
            State::Closed { .. } => None,
        }
    }

    /// True when [`poll_transmit`](Self::poll_transmit) has a frame.
    pub fn has_transmit(&self) -> bool {
        match &self.state {
            State::Open => !self.control.is_empty() || !self.bulk.is_empty(),
            State::Closing { close_frame, .. } => {
                !self.control.is_empty() || !self.bulk.is_empty() || close_frame.is_some()
            }
            State::Closed { .. } => false,
        }
    }

    /// The next frame to write: the control lane always first, so no bulk
    /// backlog delays a heartbeat ack (T4); when closing, the `Close` frame
    /// comes last.
    pub fn poll_transmit(&mut self) -> Option<OutFrame> {
        let frame = match &mut self.state {
            State::Closed { .. } => return None,
            State::Open => self
                .control
                .pop_front()
                .or_else(|| pop_bulk(&mut self.bulk, &mut self.bulk_bytes)),
            State::Closing {
                close_frame,
                close_frame_taken,
                ..
            } => {
                let next = self
                    .control
                    .pop_front()
                    .or_else(|| pop_bulk(&mut self.bulk, &mut self.bulk_bytes));
                match next {
                    Some(frame) => Some(frame),
                    None => {
                        let close = close_frame.take();
                        *close_frame_taken |= close.is_some();
                        close
                    }
                }
            }
        }?;
        self.stats.frames_sent += 1;
        self.stats.bytes_sent += frame.len_bytes() as u64;
        Some(frame)
    }

    /// True when the writer holds the `Close` frame (it should end the stream
    /// after writing it).
    pub fn close_frame_in_flight(&self) -> bool {
        matches!(
            self.state,
            State::Closing {
                close_frame_taken: true,
                ..
            }
        )
    }

    /// The writer finished writing every frame taken so far. After the
    /// `Close` frame this completes the close.
    pub fn handle_transmitted(&mut self) {
        if self.close_frame_in_flight() {
            self.finish_close();
        }
    }

    /// Returns the close reason exactly once, when the connection has become
    /// closed: the shell then shuts the socket down.
    pub fn poll_closed(&mut self) -> Option<CloseReason> {
        match &self.state {
            State::Closed { reason } if !self.closed_reported => {
                self.closed_reported = true;
                Some(reason.clone())
            }
            _ => None,
        }
    }

    fn send_heartbeat(&mut self, now: Instant) {
        let seq = self.heartbeats.next_seq;
        let heartbeat = codec::frame(Body::Heartbeat(pb::Heartbeat { seq }));
        let Ok(frame) = self.encode_frame(&heartbeat) else {
            return;
        };
        if self.push_control(frame, now).is_err() {
            return;
        }
        self.heartbeats.next_seq += 1;
        self.stats.heartbeats_sent += 1;
        if self.heartbeats.unanswered.len() < TRACKED_HEARTBEATS_MAX {
            self.heartbeats
                .unanswered
                .push_back(SentHeartbeat { seq, sent_at: now });
        }
    }

    fn push_control(&mut self, frame: OutFrame, now: Instant) -> Result<(), SendError> {
        if self.control.len() >= self.config.control_lane_max_frames {
            self.close_on_error(
                CloseReason::ControlLaneOverflow,
                "control lane full: the connection cannot keep up",
                now,
            );
            return Err(SendError::Closed);
        }
        self.control.push_back(frame);
        Ok(())
    }

    /// A protocol failure: queued frames are dropped and only `Close` is sent.
    fn close_on_error(&mut self, reason: CloseReason, detail: &str, now: Instant) {
        if !self.is_open() {
            return;
        }
        self.clear_lanes();
        self.start_closing(reason, detail, now);
    }

    fn start_closing(&mut self, reason: CloseReason, detail: &str, now: Instant) {
        let close = codec::frame(Body::Close(pb::Close {
            reason: truncated(&reason.as_str(), REASON_MAX_BYTES).to_owned(),
            detail: truncated(detail, DETAIL_MAX_BYTES).to_owned(),
        }));
        // The Close frame is small (both strings are capped), so encoding it
        // cannot exceed any sane maximum; if it somehow does, close without it.
        let close_frame = self.encode_into_arena(&close).ok().map(|head| OutFrame {
            head,
            body: BodyParts::default(),
        });
        tracing::debug!(%reason, "frame connection closing");
        self.state = State::Closing {
            reason,
            linger_deadline: now + self.config.close_linger,
            close_frame_taken: false,
            close_frame,
        };
        if !self.has_transmit() {
            self.finish_close();
        }
    }

    /// Closed without a Close frame of our own (the peer is gone or closing),
    /// keeping a reason recorded earlier.
    fn close_at_once(&mut self, reason: CloseReason) {
        if self.is_open() {
            self.state = State::Closed { reason };
            self.clear_lanes();
        } else {
            self.finish_close();
        }
    }

    fn finish_close(&mut self) {
        match std::mem::replace(&mut self.state, State::Open) {
            State::Closing { reason, .. } => {
                self.state = State::Closed { reason };
                self.clear_lanes();
            }
            state @ (State::Open | State::Closed { .. }) => self.state = state,
        }
    }

    fn clear_lanes(&mut self) {
        self.control.clear();
        self.bulk.clear();
        self.bulk_bytes = 0;
    }

    /// Encodes into the arena and cuts the frame off. The arena was created
    /// with [`ENCODE_ARENA_BYTES`] of capacity, so when it runs out `BytesMut`
    /// allocates a new block of at least that size (or reclaims the old one
    /// once every frame cut from it is gone).
    fn encode_into_arena(&mut self, frame: &pb::Frame) -> Result<Bytes, SendError> {
        codec::encode_with_max(frame, &mut self.encode_arena, self.config.max_frame_bytes)?;
        if self.encode_arena.capacity() > 4 * ENCODE_ARENA_BYTES {
            // A large frame takes the arena's allocation with it (freed once
            // written) instead of leaving the arena pinning it afterwards.
            return Ok(std::mem::replace(
                &mut self.encode_arena,
                BytesMut::with_capacity(ENCODE_ARENA_BYTES),
            )
            .freeze());
        }
        Ok(self.encode_arena.split().freeze())
    }
}

/// Frames of room the bulk lane keeps once it has drained: a burst (every
/// stream's first frames at once) grows it to as many as the lane admits,
/// and without this the lane would keep that room (128 bytes a frame) for
/// the life of the connection.
const BULK_KEPT_FRAMES: usize = 64;

/// A drained bulk lane with more room than this gives it back (down to
/// [`BULK_KEPT_FRAMES`]); under a steady load the lane stays well below.
const BULK_SHRINK_ABOVE_FRAMES: usize = 4 * BULK_KEPT_FRAMES;

fn pop_bulk(bulk: &mut VecDeque<OutFrame>, bulk_bytes: &mut usize) -> Option<OutFrame> {
    let frame = bulk.pop_front()?;
    *bulk_bytes -= frame.len_bytes();
    if bulk.is_empty() && bulk.capacity() > BULK_SHRINK_ABOVE_FRAMES {
        bulk.shrink_to(BULK_KEPT_FRAMES);
    }
    Some(frame)
}

/// `text` cut to at most `max_bytes`, on a character boundary.
fn truncated(text: &str, max_bytes: usize) -> &str {
    if text.len() <= max_bytes {
        return text;
    }
    let mut end = max_bytes;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use iop_wire::FrameDecoder;

    use super::*;
    use crate::clock::{Clock, ManualClock};

    const SECOND: Duration = Duration::from_secs(1);
    const MILLI: Duration = Duration::from_millis(1);

    fn core_at(clock: &ManualClock) -> ConnCore {
        ConnCore::new(ConnConfig::default(), clock.now())
    }

    fn decode(out: &OutFrame) -> pb::Frame {
        let mut decoder = FrameDecoder::new();
        decoder.feed(out.head());
        for piece in out.body().parts() {
            decoder.feed(piece);
        }
        match decoder.decode() {
            Ok(Some(frame)) => frame,
            other => panic!("transmitted bytes are not one frame: {other:?}"),
        }
    }

    fn next_body(core: &mut ConnCore) -> Option<Body> {
        core.poll_transmit().and_then(|out| decode(&out).body)
    }

    fn heartbeat(seq: u64) -> pb::Frame {
        codec::frame(Body::Heartbeat(pb::Heartbeat { seq }))
    }

    fn ack(seq: u64) -> pb::Frame {
        codec::frame(Body::HeartbeatAck(pb::HeartbeatAck { seq }))
    }

    fn run_event(seq: u64) -> pb::Frame {
        codec::frame(Body::RunEvent(Box::new(pb::RunEvent {
            run_id: "run-1".to_owned(),
            seq,
            delta: "tok".to_owned(),
            ..Default::default()
        })))
    }

    fn close_body(reason: &str, detail: &str) -> Option<Body> {
        Some(Body::Close(pb::Close {
            reason: reason.to_owned(),
            detail: detail.to_owned(),
        }))
    }

    fn queue_bulk(core: &mut ConnCore, frame: &pb::Frame) {
        let out = core.encode_frame(frame).unwrap();
        core.try_send_bulk(out).unwrap();
    }

    #[test]
    fn heartbeat_is_sent_exactly_at_the_interval() {
        // CONTRACT: T4
        let clock = ManualClock::new(0);
        let start = clock.now();
        let mut core = core_at(&clock);
        assert_eq!(core.poll_timeout(), Some(start + 30 * SECOND));

        clock.advance(30 * SECOND - MILLI);
        core.handle_timeout(clock.now());
        assert_eq!(core.poll_transmit(), None);

        clock.advance(MILLI);
        core.handle_timeout(clock.now());
        assert_eq!(
            next_body(&mut core),
            Some(Body::Heartbeat(pb::Heartbeat { seq: 1 }))
        );
        assert_eq!(core.poll_transmit(), None);
        // Unanswered: the timeout (30 + 45) is later than the next heartbeat.
        assert_eq!(core.poll_timeout(), Some(start + 60 * SECOND));

        clock.advance(30 * SECOND);
        core.handle_timeout(clock.now());
        assert_eq!(
            next_body(&mut core),
            Some(Body::Heartbeat(pb::Heartbeat { seq: 2 }))
        );
        assert_eq!(core.poll_timeout(), Some(start + 75 * SECOND));
        assert_eq!(core.stats().heartbeats_sent, 2);
    }

    #[test]
    fn heartbeat_timeout_fires_at_45_s_not_before() {
        // CONTRACT: T4
        let clock = ManualClock::new(0);
        let mut core = core_at(&clock);
        clock.advance(30 * SECOND);
        core.handle_timeout(clock.now()); // heartbeat 1 sent at 30 s
        clock.advance(30 * SECOND);
        core.handle_timeout(clock.now()); // heartbeat 2 sent at 60 s
        while core.poll_transmit().is_some() {}

        clock.advance(15 * SECOND - MILLI); // 74.999 s: 44.999 s after heartbeat 1
        core.handle_timeout(clock.now());
        assert!(core.is_open());
        assert_eq!(core.close_reason(), None);

        clock.advance(MILLI); // 75 s: 45 s after heartbeat 1
        core.handle_timeout(clock.now());
        assert!(!core.is_open());
        assert_eq!(core.close_reason(), Some(&CloseReason::HeartbeatTimeout));
        assert_eq!(
            next_body(&mut core),
            close_body("heartbeat_timeout", "no heartbeat answer within 45000 ms")
        );
        assert_eq!(core.poll_transmit(), None);
        assert_eq!(core.poll_closed(), None);
        core.handle_transmitted();
        assert_eq!(core.poll_closed(), Some(CloseReason::HeartbeatTimeout));
        assert_eq!(core.poll_closed(), None);
        assert_eq!(core.poll_timeout(), None);
    }

    #[test]
    fn ack_resets_the_heartbeat_timeout() {
        // CONTRACT: T4
        let clock = ManualClock::new(0);
        let start = clock.now();
        let mut core = core_at(&clock);
        clock.advance(30 * SECOND);
        core.handle_timeout(clock.now());
        assert_eq!(
            next_body(&mut core),
            Some(Body::Heartbeat(pb::Heartbeat { seq: 1 }))
        );

        clock.advance(SECOND);
        assert_eq!(core.handle_frame(ack(1), clock.now()), None);
        assert_eq!(core.stats().heartbeat_acks_received, 1);
        assert_eq!(core.poll_timeout(), Some(start + 60 * SECOND));

        // 75 s would have been the deadline of heartbeat 1.
        clock.advance(44 * SECOND);
        core.handle_timeout(clock.now()); // sends heartbeat 2 (due at 60 s)
        assert!(core.is_open());
        assert_eq!(
            next_body(&mut core),
            Some(Body::Heartbeat(pb::Heartbeat { seq: 2 }))
        );
        // The cadence stays anchored (60 s, 90 s); heartbeat 2 counts from
        // when it was sent (75 s, deadline 120 s).
        assert_eq!(core.poll_timeout(), Some(start + 90 * SECOND));
    }

    #[test]
    fn ack_answers_every_earlier_heartbeat() {
        let clock = ManualClock::new(0);
        let start = clock.now();
        let mut core = core_at(&clock);
        for _ in 0..2 {
            clock.advance(30 * SECOND);
            core.handle_timeout(clock.now());
        }
        assert_eq!(core.poll_timeout(), Some(start + 75 * SECOND));
        // An ack of a heartbeat never sent changes nothing.
        core.handle_frame(ack(9), clock.now());
        assert_eq!(core.poll_timeout(), Some(start + 75 * SECOND));
        // Ack of heartbeat 1 only: heartbeat 2 (sent at 60 s) now drives it.
        core.handle_frame(ack(1), clock.now());
        assert_eq!(core.poll_timeout(), Some(start + 90 * SECOND));
        core.handle_frame(ack(2), clock.now());
        assert_eq!(core.poll_timeout(), Some(start + 90 * SECOND));
        clock.advance(45 * SECOND);
        core.handle_timeout(clock.now());
        assert!(core.is_open());
    }

    #[test]
    fn received_heartbeat_is_answered_on_the_control_lane() {
        // CONTRACT: T4
        let clock = ManualClock::new(0);
        let mut core = core_at(&clock);
        assert_eq!(core.handle_frame(heartbeat(42), clock.now()), None);
        assert_eq!(core.control_queued_frames(), 1);
        assert_eq!(core.bulk_queued_frames(), 0);
        assert_eq!(
            next_body(&mut core),
            Some(Body::HeartbeatAck(pb::HeartbeatAck { seq: 42 }))
        );
        assert_eq!(core.stats().heartbeat_acks_sent, 1);
    }

    #[test]
    fn bulk_backlog_of_1000_frames_does_not_delay_the_heartbeat_ack() {
        // CONTRACT: T4
        let clock = ManualClock::new(0);
        let mut core = core_at(&clock);
        for seq in 1..=1000 {
            queue_bulk(&mut core, &run_event(seq));
        }
        assert_eq!(next_body(&mut core), run_event(1).body);
        assert_eq!(core.handle_frame(heartbeat(7), clock.now()), None);
        // The ack is the very next frame, ahead of 999 queued bulk frames.
        assert_eq!(
            next_body(&mut core),
            Some(Body::HeartbeatAck(pb::HeartbeatAck { seq: 7 }))
        );
        for seq in 2..=1000 {
            assert_eq!(next_body(&mut core), run_event(seq).body);
        }
        assert_eq!(core.poll_transmit(), None);
    }

    #[test]
    fn a_drained_bulk_lane_gives_back_the_room_a_burst_took() {
        let clock = ManualClock::new(0);
        let mut core = core_at(&clock);
        for seq in 1..=1000 {
            queue_bulk(&mut core, &run_event(seq));
        }
        assert!(core.bulk.capacity() >= 1000);
        for seq in 1..=999 {
            assert_eq!(next_body(&mut core), run_event(seq).body);
        }
        // Not drained yet: the room stays while frames wait.
        assert!(core.bulk.capacity() >= 1000);
        assert_eq!(next_body(&mut core), run_event(1000).body);
        assert!(
            core.bulk.capacity() <= BULK_SHRINK_ABOVE_FRAMES,
            "capacity {} after draining",
            core.bulk.capacity()
        );
        // A steady trickle below the threshold keeps its room.
        for seq in 1..=BULK_SHRINK_ABOVE_FRAMES as u64 {
            queue_bulk(&mut core, &run_event(seq));
        }
        let room = core.bulk.capacity();
        while core.poll_transmit().is_some() {}
        assert_eq!(core.bulk.capacity(), room);
    }

    #[test]
    fn application_frames_are_delivered_and_heartbeats_consumed() {
        let clock = ManualClock::new(0);
        let mut core = core_at(&clock);
        assert_eq!(
            core.handle_frame(run_event(3), clock.now()),
            Some(run_event(3))
        );
        assert_eq!(core.handle_frame(heartbeat(1), clock.now()), None);
        assert_eq!(core.handle_frame(ack(0), clock.now()), None);
        assert_eq!(core.stats().frames_received, 3);
    }

    #[test]
    fn bulk_lane_is_bounded_by_frames_and_bytes() {
        let clock = ManualClock::new(0);
        let config = ConnConfig {
            bulk_lane_max_frames: 2,
            bulk_lane_max_bytes: 1000,
            ..ConnConfig::default()
        };
        let mut core = ConnCore::new(config, clock.now());
        queue_bulk(&mut core, &run_event(1));
        queue_bulk(&mut core, &run_event(2));
        let third = core.encode_frame(&run_event(3)).unwrap();
        assert_eq!(
            core.try_send_bulk(third.clone()),
            Err(TrySendError::Full(third.clone()))
        );
        assert!(core.poll_transmit().is_some());
        assert_eq!(core.try_send_bulk(third), Ok(()));

        // Bytes: a big frame always fits an empty lane, but nothing after it.
        while core.poll_transmit().is_some() {}
        let big = core
            .encode_body_frame(
                &pb::ProviderTunnelFrame::default(),
                Bytes::from(vec![7u8; 4000]),
            )
            .unwrap();
        assert_eq!(core.try_send_bulk(big), Ok(()));
        let small = core.encode_frame(&run_event(4)).unwrap();
        assert_eq!(
            core.try_send_bulk(small.clone()),
            Err(TrySendError::Full(small))
        );
    }

    #[test]
    fn control_lane_overflow_closes_the_connection() {
        let clock = ManualClock::new(0);
        let config = ConnConfig {
            control_lane_max_frames: 2,
            ..ConnConfig::default()
        };
        let mut core = ConnCore::new(config, clock.now());
        queue_bulk(&mut core, &run_event(1));
        core.handle_frame(heartbeat(1), clock.now());
        core.handle_frame(heartbeat(2), clock.now());
        assert!(core.is_open());
        core.handle_frame(heartbeat(3), clock.now());
        assert_eq!(core.close_reason(), Some(&CloseReason::ControlLaneOverflow));
        // Queued frames are dropped; only the Close frame goes out.
        assert_eq!(
            next_body(&mut core),
            close_body(
                "control_lane_overflow",
                "control lane full: the connection cannot keep up"
            )
        );
        assert_eq!(core.poll_transmit(), None);
        let out = core.encode_frame(&heartbeat(1));
        assert_eq!(out, Err(SendError::Closed));
    }

    #[test]
    fn decode_error_queues_close_with_the_reason_then_closes() {
        // CONTRACT: T1
        let clock = ManualClock::new(0);
        let mut core = core_at(&clock);
        queue_bulk(&mut core, &run_event(1));
        let err = DecodeError::FrameTooLarge {
            len: 20_000_000,
            max: 16 * 1024 * 1024,
        };
        core.handle_decode_error(&err, clock.now());
        assert!(!core.is_open());
        assert_eq!(
            next_body(&mut core),
            close_body(
                "frame_too_large",
                "frame of 20000000 bytes exceeds the maximum of 16777216 bytes"
            )
        );
        assert_eq!(core.poll_transmit(), None);
        assert!(core.close_frame_in_flight());
        core.handle_transmitted();
        assert!(core.is_closed());
        assert_eq!(core.poll_closed(), Some(CloseReason::FrameTooLarge));

        let mut core = core_at(&clock);
        core.handle_decode_error(&DecodeError::Empty, clock.now());
        assert_eq!(core.close_reason(), Some(&CloseReason::DecodeError));
    }

    #[test]
    fn local_close_writes_queued_frames_then_close() {
        let clock = ManualClock::new(0);
        let start = clock.now();
        let mut core = core_at(&clock);
        queue_bulk(&mut core, &run_event(1));
        core.handle_frame(heartbeat(5), clock.now());
        core.close(CloseReason::Shutdown, clock.now());
        assert_eq!(core.encode_frame(&run_event(2)), Err(SendError::Closed));
        assert_eq!(core.poll_timeout(), Some(start + SECOND));
        assert_eq!(
            next_body(&mut core),
            Some(Body::HeartbeatAck(pb::HeartbeatAck { seq: 5 }))
        );
        assert_eq!(next_body(&mut core), run_event(1).body);
        assert_eq!(next_body(&mut core), close_body("shutdown", ""));
        assert_eq!(core.poll_transmit(), None);
        core.handle_transmitted();
        assert_eq!(core.poll_closed(), Some(CloseReason::Shutdown));
    }

    #[test]
    fn close_linger_bounds_the_wait_for_the_close_frame() {
        let clock = ManualClock::new(0);
        let mut core = core_at(&clock);
        core.close(CloseReason::Shutdown, clock.now());
        clock.advance(SECOND - MILLI);
        core.handle_timeout(clock.now());
        assert!(!core.is_closed());
        clock.advance(MILLI);
        core.handle_timeout(clock.now());
        assert!(core.is_closed());
        assert_eq!(core.poll_closed(), Some(CloseReason::Shutdown));
        assert_eq!(core.poll_transmit(), None);
    }

    #[test]
    fn peer_close_and_eof_close_without_sending_close() {
        let clock = ManualClock::new(0);
        let mut core = core_at(&clock);
        queue_bulk(&mut core, &run_event(1));
        let close = codec::frame(Body::Close(pb::Close {
            reason: "superseded".to_owned(),
            detail: String::new(),
        }));
        assert_eq!(core.handle_frame(close, clock.now()), None);
        assert!(core.is_closed());
        assert_eq!(core.poll_transmit(), None);
        assert_eq!(
            core.poll_closed(),
            Some(CloseReason::Peer("superseded".to_owned()))
        );

        let mut core = core_at(&clock);
        core.handle_peer_eof();
        assert_eq!(core.poll_closed(), Some(CloseReason::PeerClosed));

        let mut core = core_at(&clock);
        core.handle_io_error(&std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(
            core.poll_closed(),
            Some(CloseReason::IoError(std::io::ErrorKind::ConnectionReset))
        );

        // A TLS failure is named: the peer's fatal alert (a Node refused by
        // its Edge reads `tls_alert:access_denied`), or our own TLS error.
        let tls_failure =
            |e: rustls::Error| std::io::Error::new(std::io::ErrorKind::InvalidData, e);
        let mut core = core_at(&clock);
        core.handle_io_error(&tls_failure(rustls::Error::AlertReceived(
            rustls::AlertDescription::AccessDenied,
        )));
        assert_eq!(
            core.poll_closed(),
            Some(CloseReason::TlsAlert("access_denied".to_owned()))
        );
        let mut core = core_at(&clock);
        core.handle_io_error(&tls_failure(rustls::Error::DecryptError));
        assert_eq!(core.poll_closed(), Some(CloseReason::TlsError));
    }

    #[test]
    fn first_close_reason_wins() {
        let clock = ManualClock::new(0);
        let mut core = core_at(&clock);
        core.close(CloseReason::Shutdown, clock.now());
        core.handle_decode_error(&DecodeError::Empty, clock.now());
        core.handle_peer_eof();
        assert_eq!(core.poll_closed(), Some(CloseReason::Shutdown));
        assert_eq!(core.poll_closed(), None);
    }

    #[test]
    fn peer_reason_is_capped() {
        let clock = ManualClock::new(0);
        let mut core = core_at(&clock);
        let close = codec::frame(Body::Close(pb::Close {
            reason: "é".repeat(100),
            detail: String::new(),
        }));
        core.handle_frame(close, clock.now());
        assert_eq!(core.poll_closed(), Some(CloseReason::Peer("é".repeat(64))));
    }

    #[test]
    fn oversized_frames_are_refused_at_send() {
        let clock = ManualClock::new(0);
        let config = ConnConfig {
            max_frame_bytes: 64,
            ..ConnConfig::default()
        };
        let mut core = ConnCore::new(config, clock.now());
        let frame = codec::frame(Body::RunEvent(Box::new(pb::RunEvent {
            delta: "x".repeat(100),
            ..Default::default()
        })));
        assert_eq!(
            core.encode_frame(&frame),
            Err(SendError::FrameTooLarge { len: 104, max: 64 })
        );
        let body = Bytes::from(vec![0u8; 100]);
        assert!(matches!(
            core.encode_body_frame(&pb::ProviderTunnelFrame::default(), body),
            Err(SendError::FrameTooLarge { .. })
        ));
    }

    #[test]
    fn body_frame_head_plus_body_decodes_to_the_frame() {
        let clock = ManualClock::new(0);
        let mut core = core_at(&clock);
        let head = pb::ProviderTunnelFrame {
            run_id: "run-9".to_owned(),
            seq: 3,
            kind: pb::TunnelFrameKind::Body as i32,
            ..Default::default()
        };
        let body = Bytes::from_static(b"data: {\"x\":1}\n\n");
        let out = core.encode_body_frame(&head, body.clone()).unwrap();
        // The body is carried as-is: same bytes, same memory.
        assert_eq!(out.body().parts()[0].as_ptr(), body.as_ptr());
        let expected = pb::ProviderTunnelFrame { body, ..head };
        assert_eq!(
            decode(&out).body,
            Some(Body::ProviderTunnelFrame(Box::new(expected)))
        );
    }

    #[test]
    fn request_frame_head_plus_pieces_decodes_to_the_request() {
        let clock = ManualClock::new(0);
        let mut core = core_at(&clock);
        let request = pb::ProviderTunnelRequest {
            run_id: "run-4".to_owned(),
            path: "/v1/chat/completions".to_owned(),
            ..Default::default()
        };
        let client = Bytes::from_static(b"{\"model\":\"gpt\",\"messages\":[]}");
        let body = BodyParts::spliced(
            client.slice(..9),
            Bytes::from_static(b"\"served/target\""),
            client.slice(14..),
        );
        let out = core.encode_request_frame(&request, body.clone()).unwrap();
        // The pieces are carried as they are: the client's memory, no join.
        assert_eq!(out.body().parts()[0].as_ptr(), client.as_ptr());
        assert_eq!(out.body().parts()[2].as_ptr(), client[14..].as_ptr());
        assert_eq!(out.len_bytes(), out.head().len() + body.len());
        let expected = pb::ProviderTunnelRequest {
            body: Bytes::from_static(b"{\"model\":\"served/target\",\"messages\":[]}"),
            ..request
        };
        assert_eq!(
            decode(&out).body,
            Some(Body::ProviderTunnelRequest(Box::new(expected)))
        );
    }
}
