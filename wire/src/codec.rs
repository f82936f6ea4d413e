//! Length-delimited frame codec (T1).
//!
//! ## Format
//!
//! Every frame is a 4-byte **big-endian `u32` length** followed by exactly that
//! many bytes of a protobuf-encoded [`Frame`]. The length counts the protobuf
//! bytes only, not the prefix. A length above the decoder's maximum (default
//! [`DEFAULT_MAX_FRAME_BYTES`], 16 MiB) is rejected as soon as the prefix is
//! read, before any byte of the frame is buffered for it.
//!
//! ## Zero copy
//!
//! [`FrameDecoder`] keeps one `BytesMut`; an IO shell may read straight into it
//! ([`FrameDecoder::buffer_mut`]). A complete frame is split off and frozen,
//! and prost decodes it with every `bytes` field as a `Bytes` slice of that
//! buffer — tunnel bodies are never copied by the decoder.
//! [`FrameDecoder::decode_inbound`] goes one step further for a relayed
//! chunk's frame: a [`TunnelChunk`] whose run id and body are slices of the
//! buffer, with no message built or boxed.
//!
//! On the sending side [`BodyFrameHead`] encodes everything of a tunnel `BODY`
//! frame except the body itself, so the writer can send the head and then the
//! provider's `Bytes` as they are.

use std::borrow::Cow;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use bytestring::ByteString;
use prost::Message;

use crate::close::CloseReason;
use crate::limits::{DEFAULT_MAX_FRAME_BYTES, LENGTH_PREFIX_BYTES};
use crate::pb::{self, frame, Frame};

/// A frame could not be decoded. The connection must be closed with
/// [`DecodeError::close_reason`] (T1); the decoder stays failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The length prefix announced more bytes than the configured maximum.
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes")]
    FrameTooLarge {
        /// Announced length.
        len: usize,
        /// Configured maximum.
        max: usize,
    },
    /// The frame bytes are not a valid protobuf `Frame`.
    #[error("frame does not decode: {0}")]
    Malformed(String),
    /// The frame decoded but carries no body (an empty `oneof`).
    #[error("frame carries no message")]
    Empty,
    /// An earlier error already failed this decoder.
    #[error("decoder already failed on an earlier frame")]
    Failed,
}

impl DecodeError {
    /// The reason to send in a `Close` frame before closing (T1).
    pub fn close_reason(&self) -> CloseReason {
        match self {
            DecodeError::FrameTooLarge { .. } => CloseReason::FrameTooLarge,
            _ => CloseReason::DecodeError,
        }
    }
}

/// A frame could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// The encoded frame would exceed the maximum frame size.
    #[error("encoded frame of {len} bytes exceeds the maximum of {max} bytes")]
    FrameTooLarge {
        /// Encoded length.
        len: usize,
        /// Maximum.
        max: usize,
    },
}

/// Incremental, capped decoder of length-delimited frames. Sans-IO: feed
/// bytes, take frames.
///
/// ```
/// use iop_wire::{codec, pb, FrameDecoder};
/// let frame = pb::Frame { body: Some(pb::frame::Body::Heartbeat(pb::Heartbeat { seq: 7 })) };
/// let mut wire = bytes::BytesMut::new();
/// codec::encode(&frame, &mut wire).unwrap();
/// let mut decoder = FrameDecoder::new();
/// decoder.feed(&wire[..3]);
/// assert_eq!(decoder.decode(), Ok(None)); // incomplete
/// decoder.feed(&wire[3..]);
/// assert_eq!(decoder.decode(), Ok(Some(frame)));
/// ```
#[derive(Debug)]
pub struct FrameDecoder {
    buf: BytesMut,
    max_frame_bytes: usize,
    /// Length of the frame whose prefix was already consumed.
    pending_len: Option<usize>,
    failed: bool,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameDecoder {
    /// A decoder with the default 16 MiB cap.
    pub fn new() -> Self {
        Self::with_max_frame_bytes(DEFAULT_MAX_FRAME_BYTES)
    }

    /// A decoder that rejects frames longer than `max_frame_bytes`.
    pub fn with_max_frame_bytes(max_frame_bytes: usize) -> Self {
        Self {
            buf: BytesMut::new(),
            max_frame_bytes,
            pending_len: None,
            failed: false,
        }
    }

    /// The configured maximum frame size in bytes.
    pub fn max_frame_bytes(&self) -> usize {
        self.max_frame_bytes
    }

    /// Appends bytes received from the peer. Ignored once the decoder has
    /// failed, so a shell that keeps reading cannot grow the buffer.
    pub fn feed(&mut self, bytes: &[u8]) {
        if self.failed {
            return;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// The internal buffer, for shells that read straight into it (append
    /// only; do not remove bytes).
    pub fn buffer_mut(&mut self) -> &mut BytesMut {
        &mut self.buf
    }

    /// Bytes received but not yet returned as frames.
    pub fn buffered_bytes(&self) -> usize {
        self.buf.len()
    }

    /// How many more bytes the decoder needs before it can make progress
    /// (a hint for read sizing); 0 when a frame may already be decodable.
    pub fn bytes_wanted(&self) -> usize {
        match self.pending_len {
            Some(len) => len.saturating_sub(self.buf.len()),
            None => LENGTH_PREFIX_BYTES.saturating_sub(self.buf.len()),
        }
    }

    /// Returns the next complete frame, `Ok(None)` when more bytes are needed,
    /// or a typed error. After an error the decoder returns
    /// [`DecodeError::Failed`] forever; close the connection.
    pub fn decode(&mut self) -> Result<Option<Frame>, DecodeError> {
        Ok(self.decode_inbound()?.map(Inbound::into_frame))
    }

    /// [`Self::decode`], with a relayed chunk's frame (a tunnel `BODY`
    /// frame with no field but `run_id`, `seq`, `kind` and `body`) handed
    /// over as a [`TunnelChunk`]: no frame built, boxed or dropped and no
    /// run id copied, per token. Every other frame comes as a [`Frame`].
    pub fn decode_inbound(&mut self) -> Result<Option<Inbound>, DecodeError> {
        if self.failed {
            return Err(DecodeError::Failed);
        }
        let result = self.decode_inner();
        if result.is_err() {
            self.failed = true;
            self.buf = BytesMut::new();
        }
        result
    }

    fn decode_inner(&mut self) -> Result<Option<Inbound>, DecodeError> {
        let len = match self.pending_len {
            Some(len) => len,
            None => {
                if self.buf.len() < LENGTH_PREFIX_BYTES {
                    return Ok(None);
                }
                let len = self.buf.get_u32() as usize;
                if len > self.max_frame_bytes {
                    return Err(DecodeError::FrameTooLarge {
                        len,
                        max: self.max_frame_bytes,
                    });
                }
                self.pending_len = Some(len);
                len
            }
        };
        if self.buf.len() < len {
            // Only now, with the length validated, make room for the rest.
            self.buf.reserve(len - self.buf.len());
            return Ok(None);
        }
        self.pending_len = None;
        let frame_bytes: Bytes = self.buf.split_to(len).freeze();
        if let Some(plain) = decode_plain_body(&frame_bytes) {
            return Ok(Some(plain));
        }
        let frame =
            Frame::decode(frame_bytes).map_err(|e| DecodeError::Malformed(e.to_string()))?;
        if frame.body.is_none() {
            return Err(DecodeError::Empty);
        }
        Ok(Some(Inbound::Frame(frame)))
    }
}

/// What [`FrameDecoder::decode_inbound`] hands over.
#[derive(Debug, Clone, PartialEq)]
pub enum Inbound {
    /// A frame, decoded as prost decodes it.
    Frame(Frame),
    /// A relayed chunk's frame, kept as the slices it arrived in.
    Chunk(TunnelChunk),
}

impl Inbound {
    /// The frame this is: a chunk as the `ProviderTunnelFrame` prost
    /// decodes from the same bytes.
    pub fn into_frame(self) -> Frame {
        match self {
            Inbound::Frame(frame) => frame,
            Inbound::Chunk(chunk) => Frame {
                body: Some(frame::Body::ProviderTunnelFrame(Box::new(
                    chunk.into_tunnel_frame(),
                ))),
            },
        }
    }
}

/// A tunnel `BODY` frame that carries nothing but its run id, its sequence
/// number and its body: every token a provider streams. Its run id and
/// body are slices of the bytes it arrived in (no copy, no allocation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelChunk {
    run_id: ByteString,
    seq: u64,
    /// The provider's bytes, as they are.
    pub body: Bytes,
}

impl TunnelChunk {
    /// A chunk of run `run_id` (copied), for senders and tests; the
    /// decoder makes its chunks from the bytes it received.
    pub fn new(run_id: &str, seq: u64, body: Bytes) -> Self {
        Self {
            run_id: ByteString::from(run_id),
            seq,
            body,
        }
    }

    /// The tunnel's run id.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The frame's sequence number (U1).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The `ProviderTunnelFrame` prost decodes from the same bytes.
    pub fn into_tunnel_frame(self) -> pb::ProviderTunnelFrame {
        pb::ProviderTunnelFrame {
            run_id: self.run_id().to_owned(),
            seq: self.seq,
            kind: pb::TunnelFrameKind::Body as i32,
            body: self.body,
            ..Default::default()
        }
    }
}

/// A relayed chunk's frame — a `ProviderTunnelFrame` with no field but
/// `run_id`, `seq`, `kind` and `body`, each at most once, as
/// [`BodyFrameHead`] writes them — decoded by hand: what prost would
/// decode, at a fraction of its generic merge's cost. `None` for anything
/// else (another message, another field, a repeated one, bad UTF-8, a
/// malformed varint), which prost then decodes or refuses as usual.
fn decode_plain_body(frame: &Bytes) -> Option<Inbound> {
    let mut at = 0;
    if key_at(frame, &mut at)? != (FRAME_FIELD_TUNNEL_FRAME, WIRE_LEN) {
        return None;
    }
    let inner_len = usize::try_from(varint_at(frame, &mut at)?).ok()?;
    if frame.len().checked_sub(at)? != inner_len {
        return None;
    }
    let mut run_id = None;
    let mut seq = None;
    let mut kind = None;
    let mut body = None;
    while at < frame.len() {
        match key_at(frame, &mut at)? {
            (TUNNEL_FIELD_RUN_ID, WIRE_LEN) if run_id.is_none() => {
                let len = len_delimited_at(frame, &mut at)?.len();
                run_id = Some(at - len..at);
            }
            (TUNNEL_FIELD_SEQ, WIRE_VARINT) if seq.is_none() => {
                seq = Some(varint_at(frame, &mut at)?);
            }
            // prost reads an enum's varint as an `i32`, keeping the low bits.
            (TUNNEL_FIELD_KIND, WIRE_VARINT) if kind.is_none() => {
                kind = Some(varint_at(frame, &mut at)? as i32);
            }
            (TUNNEL_FIELD_BODY, WIRE_LEN) if body.is_none() => {
                let len = len_delimited_at(frame, &mut at)?.len();
                body = Some(frame.slice(at - len..at));
            }
            _ => return None,
        }
    }
    let run_id = match run_id {
        Some(range) => ByteString::try_from(frame.slice(range)).ok()?,
        None => ByteString::new(),
    };
    let seq = seq.unwrap_or_default();
    let body = body.unwrap_or_default();
    let kind = kind.unwrap_or_default();
    if kind == pb::TunnelFrameKind::Body as i32 {
        return Some(Inbound::Chunk(TunnelChunk { run_id, seq, body }));
    }
    let run_id = String::from(&*run_id);
    Some(Inbound::Frame(Frame {
        body: Some(frame::Body::ProviderTunnelFrame(Box::new(
            pb::ProviderTunnelFrame {
                run_id,
                seq,
                kind,
                body,
                ..Default::default()
            },
        ))),
    }))
}

const WIRE_VARINT: u8 = 0;
const WIRE_LEN: u8 = 2;

/// A varint at `buf[*at..]` (at most ten bytes, the tenth at most 1, as
/// prost accepts), advancing `at`. Inlined with a one-byte fast path: a
/// chunk's frame holds ten varints, keys and short lengths of one byte.
#[inline]
fn varint_at(buf: &[u8], at: &mut usize) -> Option<u64> {
    let first = *buf.get(*at)?;
    if first < 0x80 {
        *at += 1;
        return Some(u64::from(first));
    }
    varint_at_long(buf, at)
}

/// [`varint_at`] for a varint of two bytes or more (a chunk's seq past
/// 127, its lengths past 127 bytes).
fn varint_at_long(buf: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for i in 0..10 {
        let byte = *buf.get(*at + i)?;
        if i == 9 && byte > 1 {
            return None;
        }
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            *at += i + 1;
            return Some(value);
        }
    }
    None
}

/// A field key at `buf[*at..]`: its number and wire type.
fn key_at(buf: &[u8], at: &mut usize) -> Option<(u32, u8)> {
    let key = varint_at(buf, at)?;
    let field = u32::try_from(key >> 3).ok()?;
    (field != 0).then_some((field, (key & 7) as u8))
}

/// A length-delimited value at `buf[*at..]`, advancing `at` past it.
fn len_delimited_at<'a>(buf: &'a [u8], at: &mut usize) -> Option<&'a [u8]> {
    let len = usize::try_from(varint_at(buf, at)?).ok()?;
    let end = at.checked_add(len)?;
    let value = buf.get(*at..end)?;
    *at = end;
    Some(value)
}

/// Appends `frame` (length prefix + protobuf) to `dst`, refusing frames over
/// the default maximum.
pub fn encode(frame: &Frame, dst: &mut BytesMut) -> Result<(), EncodeError> {
    encode_with_max(frame, dst, DEFAULT_MAX_FRAME_BYTES)
}

/// Appends `frame` to `dst`, refusing frames longer than `max_frame_bytes`
/// (or than the `u32` length prefix can announce, whichever is smaller).
pub fn encode_with_max(
    frame: &Frame,
    dst: &mut BytesMut,
    max_frame_bytes: usize,
) -> Result<(), EncodeError> {
    let max_frame_bytes = prefix_bounded_max(max_frame_bytes);
    let len = frame.encoded_len();
    if len > max_frame_bytes {
        return Err(EncodeError::FrameTooLarge {
            len,
            max: max_frame_bytes,
        });
    }
    dst.reserve(LENGTH_PREFIX_BYTES + len);
    dst.put_u32(len as u32);
    // The capacity was reserved above, so encoding cannot run out of room.
    frame.encode(dst).map_err(|_| EncodeError::FrameTooLarge {
        len,
        max: max_frame_bytes,
    })
}

/// `max_frame_bytes` bounded by the largest length a `u32` prefix can carry,
/// so a frame is never announced with a truncated length.
fn prefix_bounded_max(max_frame_bytes: usize) -> usize {
    max_frame_bytes.min(u32::MAX as usize)
}

/// Convenience: a frame carrying `body`.
pub fn frame(body: frame::Body) -> Frame {
    Frame { body: Some(body) }
}

/// The message name of a frame body, for logs and errors.
pub fn body_name(body: &frame::Body) -> &'static str {
    use frame::Body;
    match body {
        Body::RegisterRequest(_) => "RegisterRequest",
        Body::RegisterResponse(_) => "RegisterResponse",
        Body::NodeReadyRequest(_) => "NodeReadyRequest",
        Body::NodeReadyResponse(_) => "NodeReadyResponse",
        Body::Heartbeat(_) => "Heartbeat",
        Body::HeartbeatAck(_) => "HeartbeatAck",
        Body::RunRequest(_) => "RunRequest",
        Body::RunEvent(_) => "RunEvent",
        Body::ProviderTunnelRequest(_) => "ProviderTunnelRequest",
        Body::ProviderTunnelFrame(_) => "ProviderTunnelFrame",
        Body::CancelRequest(_) => "CancelRequest",
        Body::NodeCommandRequest(_) => "NodeCommandRequest",
        Body::NodeCommandResponse(_) => "NodeCommandResponse",
        Body::NodeConfigRefreshRequest(_) => "NodeConfigRefreshRequest",
        Body::NodeConfigRefreshResponse(_) => "NodeConfigRefreshResponse",
        Body::Close(_) => "Close",
        Body::FlowCredit(_) => "FlowCredit",
        Body::NodeDraining(_) => "NodeDraining",
        Body::ProviderTunnelBody(_) => "ProviderTunnelBody",
    }
}

/// A body in up to three pieces sent one after another (the client's bytes
/// before a spliced value, the value, the bytes after it), never joined into
/// one buffer on the way to the wire: a frame head from [`RequestFrameHead`]
/// or [`BodyFrameHead`] followed by the pieces is the whole frame.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BodyParts([Bytes; 3]);

impl BodyParts {
    /// `body` in one piece.
    pub fn whole(body: Bytes) -> Self {
        Self([body, Bytes::new(), Bytes::new()])
    }

    /// `prefix ‖ value ‖ suffix`.
    pub fn spliced(prefix: Bytes, value: Bytes, suffix: Bytes) -> Self {
        Self([prefix, value, suffix])
    }

    /// The pieces in order (some may be empty).
    pub fn parts(&self) -> &[Bytes] {
        &self.0
    }

    /// Bytes in all pieces.
    pub fn len(&self) -> usize {
        self.0.iter().map(Bytes::len).sum()
    }

    /// True when there is no byte.
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(Bytes::is_empty)
    }

    /// The body as one buffer: the piece itself when there is one, else a
    /// joined copy (for tests and callers that need contiguous bytes).
    pub fn to_bytes(&self) -> Bytes {
        let mut pieces = self.0.iter().filter(|p| !p.is_empty());
        match (pieces.next(), pieces.next()) {
            (None, _) => Bytes::new(),
            (Some(one), None) => one.clone(),
            _ => {
                let mut joined = BytesMut::with_capacity(self.len());
                for part in &self.0 {
                    joined.extend_from_slice(part);
                }
                joined.freeze()
            }
        }
    }
}

/// Protobuf field number of `Frame.provider_tunnel_request`.
const FRAME_FIELD_TUNNEL_REQUEST: u32 = 9;
/// Protobuf field number of `ProviderTunnelRequest.body`.
const REQUEST_FIELD_BODY: u32 = 7;
/// Protobuf field number of `Frame.provider_tunnel_frame`.
const FRAME_FIELD_TUNNEL_FRAME: u32 = 10;
/// Protobuf field numbers of `ProviderTunnelFrame`'s `run_id`, `seq`,
/// `kind` and `body`.
const TUNNEL_FIELD_RUN_ID: u32 = 1;
const TUNNEL_FIELD_SEQ: u32 = 2;
const TUNNEL_FIELD_KIND: u32 = 3;
const TUNNEL_FIELD_BODY: u32 = 6;

/// The encoded head of a tunnel `BODY` frame: the length prefix, the envelope
/// and every field of `frame` except its body, ending with the body field's
/// key and length. Writing `head` followed by the body bytes produces exactly
/// the frame [`encode`] would produce for `frame` with that body (up to field
/// order, which protobuf ignores), without copying the body.
#[derive(Debug)]
pub struct BodyFrameHead;

impl BodyFrameHead {
    /// Appends the head of `tunnel_frame` carrying a body of `body_len` bytes
    /// to `dst`. `tunnel_frame.body` must be empty (it is ignored).
    pub fn encode(
        tunnel_frame: &pb::ProviderTunnelFrame,
        body_len: usize,
        dst: &mut BytesMut,
        max_frame_bytes: usize,
    ) -> Result<(), EncodeError> {
        if is_plain_body(tunnel_frame) {
            return encode_plain_head(
                &tunnel_frame.run_id,
                tunnel_frame.seq,
                tunnel_frame.kind,
                body_len,
                dst,
                max_frame_bytes,
            );
        }
        let trailing = TrailingBody {
            frame_field: FRAME_FIELD_TUNNEL_FRAME,
            body_field: TUNNEL_FIELD_BODY,
            body_len,
        };
        let fields = if tunnel_frame.body.is_empty() {
            Cow::Borrowed(tunnel_frame)
        } else {
            // Cheap: every other field of a BODY frame is small, and `Bytes`
            // clones are reference counts.
            Cow::Owned(pb::ProviderTunnelFrame {
                body: Bytes::new(),
                ..tunnel_frame.clone()
            })
        };
        trailing.encode_head(&*fields, dst, max_frame_bytes)
    }

    /// Appends the head of a relayed chunk's `BODY` frame — run `run_id`,
    /// number `seq`, a body of `body_len` bytes — to `dst`: the bytes
    /// [`Self::encode`] writes for that frame, with no frame to build.
    pub fn encode_chunk(
        run_id: &str,
        seq: u64,
        body_len: usize,
        dst: &mut BytesMut,
        max_frame_bytes: usize,
    ) -> Result<(), EncodeError> {
        encode_plain_head(
            run_id,
            seq,
            pb::TunnelFrameKind::Body as i32,
            body_len,
            dst,
            max_frame_bytes,
        )
    }
}

/// The head of a tunnel frame with no field but `run_id`, `seq`, `kind`
/// and a body of `body_len` bytes: its three small fields written by hand,
/// the same bytes prost writes, at a fraction of the cost of its generic
/// length pass and encoder.
fn encode_plain_head(
    run_id: &str,
    seq: u64,
    kind: i32,
    body_len: usize,
    dst: &mut BytesMut,
    max_frame_bytes: usize,
) -> Result<(), EncodeError> {
    let trailing = TrailingBody {
        frame_field: FRAME_FIELD_TUNNEL_FRAME,
        body_field: TUNNEL_FIELD_BODY,
        body_len,
    };
    let run_id = run_id.as_bytes();
    let kind = i64::from(kind) as u64;
    let varint_field = |value: u64| {
        if value == 0 {
            0
        } else {
            1 + prost::encoding::encoded_len_varint(value)
        }
    };
    let run_id_len = if run_id.is_empty() {
        0
    } else {
        1 + prost::encoding::encoded_len_varint(run_id.len() as u64) + run_id.len()
    };
    let fields_len = run_id_len + varint_field(seq) + varint_field(kind);
    trailing.encode_head_with(fields_len, dst, max_frame_bytes, |dst| {
        use prost::encoding::{encode_key, encode_varint, WireType};
        if !run_id.is_empty() {
            encode_key(TUNNEL_FIELD_RUN_ID, WireType::LengthDelimited, dst);
            encode_varint(run_id.len() as u64, dst);
            dst.put_slice(run_id);
        }
        if seq != 0 {
            encode_key(TUNNEL_FIELD_SEQ, WireType::Varint, dst);
            encode_varint(seq, dst);
        }
        if kind != 0 {
            encode_key(TUNNEL_FIELD_KIND, WireType::Varint, dst);
            encode_varint(kind, dst);
        }
    })
}

/// Whether `frame` has no field set but `run_id`, `seq`, `kind` and its
/// body, as every relayed chunk: its head is then written by hand. Every
/// field is named, so a field added to the message must be looked at here.
fn is_plain_body(frame: &pb::ProviderTunnelFrame) -> bool {
    let pb::ProviderTunnelFrame {
        run_id: _,
        seq: _,
        kind: _,
        body: _,
        status,
        headers,
        usage,
        error,
        failure_code,
        adapter,
        target,
        metadata,
        failure,
    } = frame;
    *status == 0
        && headers.is_empty()
        && usage.is_none()
        && error.is_empty()
        && failure_code.is_empty()
        && adapter.is_empty()
        && target.is_empty()
        && metadata.is_empty()
        && failure.is_none()
}

/// The encoded head of a `ProviderTunnelRequest` frame whose body follows
/// as separate segments (the client's bytes with `model` spliced in, never
/// copied into the frame): like [`BodyFrameHead`], the head followed by
/// `body_len` body bytes is the frame [`encode`] would produce.
#[derive(Debug)]
pub struct RequestFrameHead;

impl RequestFrameHead {
    /// Appends the head of `request` carrying a body of `body_len` bytes to
    /// `dst`. `request.body` must be empty (it is ignored).
    pub fn encode(
        request: &pb::ProviderTunnelRequest,
        body_len: usize,
        dst: &mut BytesMut,
        max_frame_bytes: usize,
    ) -> Result<(), EncodeError> {
        let fields = if request.body.is_empty() {
            Cow::Borrowed(request)
        } else {
            Cow::Owned(pb::ProviderTunnelRequest {
                body: Bytes::new(),
                ..request.clone()
            })
        };
        TrailingBody {
            frame_field: FRAME_FIELD_TUNNEL_REQUEST,
            body_field: REQUEST_FIELD_BODY,
            body_len,
        }
        .encode_head(&*fields, dst, max_frame_bytes)
    }
}

/// Where a frame's trailing `bytes` field sits and how long it is.
struct TrailingBody {
    /// The `Frame` oneof field holding the message.
    frame_field: u32,
    /// The message's `bytes` field the body goes in.
    body_field: u32,
    body_len: usize,
}

impl TrailingBody {
    /// Appends the length prefix, the envelope, `fields` (a message whose
    /// body field is empty) and the body field's key and length to `dst`.
    fn encode_head<M: Message>(
        &self,
        fields: &M,
        dst: &mut BytesMut,
        max_frame_bytes: usize,
    ) -> Result<(), EncodeError> {
        // `encode_raw` cannot fail; the room is reserved.
        self.encode_head_with(fields.encoded_len(), dst, max_frame_bytes, |dst| {
            fields.encode_raw(dst)
        })
    }

    /// [`Self::encode_head`] with the fields written by `write_fields`,
    /// which writes exactly `fields_len` bytes.
    fn encode_head_with(
        &self,
        fields_len: usize,
        dst: &mut BytesMut,
        max_frame_bytes: usize,
        write_fields: impl FnOnce(&mut &mut [u8]),
    ) -> Result<(), EncodeError> {
        let max_frame_bytes = prefix_bounded_max(max_frame_bytes);
        let body_len = self.body_len;
        let body_field_len = if body_len == 0 {
            0
        } else {
            prost::encoding::key_len(self.body_field)
                + prost::encoding::encoded_len_varint(body_len as u64)
                + body_len
        };
        let inner_len = fields_len + body_field_len;
        let frame_len = prost::encoding::key_len(self.frame_field)
            + prost::encoding::encoded_len_varint(inner_len as u64)
            + inner_len;
        if frame_len > max_frame_bytes {
            return Err(EncodeError::FrameTooLarge {
                len: frame_len,
                max: max_frame_bytes,
            });
        }
        // The head is written into a buffer on the stack (a chunk's is some
        // 30 bytes), then appended at once: byte by byte into `dst`, every
        // write checked its capacity.
        let head_len = LENGTH_PREFIX_BYTES + frame_len - body_len;
        let mut stack = [0u8; 128];
        let mut heap = Vec::new();
        let head: &mut [u8] = if head_len <= stack.len() {
            &mut stack[..head_len]
        } else {
            heap.resize(head_len, 0);
            &mut heap
        };
        {
            let mut w: &mut [u8] = &mut *head;
            w.put_u32(frame_len as u32);
            prost::encoding::encode_key(
                self.frame_field,
                prost::encoding::WireType::LengthDelimited,
                &mut w,
            );
            prost::encoding::encode_varint(inner_len as u64, &mut w);
            write_fields(&mut w);
            if body_len > 0 {
                prost::encoding::encode_key(
                    self.body_field,
                    prost::encoding::WireType::LengthDelimited,
                    &mut w,
                );
                prost::encoding::encode_varint(body_len as u64, &mut w);
            }
            // The lengths above are exact: nothing of the head is left.
            debug_assert!(w.is_empty());
        }
        dst.extend_from_slice(head);
        Ok(())
    }
}
