//! The per-request replies between a node connection and a waiting client
//! request: what travels on them ([`ReplyEvent`]), the client's receiving
//! end ([`ReplyRx`]), the shard's table entries on either side
//! ([`ClientReply`], [`NodeReply`]), and what became of a node's frame
//! ([`Delivery`]).

use std::cell::Cell;
use std::rc::Rc;

use iop_engine::mailbox::{self, Mailbox, MailboxSender};
use iop_wire::flow::{self, DrainWindow, Overrun, RecvWindow};
use iop_wire::{pb, TunnelChunk};

use crate::control::attempt::AttemptTracker;
use crate::control::{AbortReason, AttemptEnd, ConnId, Dispatch};

/// What the node side delivers to a waiting client request.
// Frames move through the queue by value; boxing them would allocate per frame.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum ReplyEvent {
    /// A tunnel frame from the connection that owns the lease (H1).
    Tunnel(Box<pb::ProviderTunnelFrame>),
    /// A tunnel's body chunk (a `BODY` frame with nothing but its body) from
    /// the connection that owns the lease (H1): every token of a tunnel,
    /// moved as the slices it arrived in, nothing allocated for it.
    Chunk(TunnelChunk),
    /// A normalized run event from the connection that owns the lease (H1).
    Run(Box<pb::RunEvent>),
    /// The lease was released without a terminal: the node's connection was
    /// fenced (F1) or superseded (R2).
    Lost,
    /// The run's buffer at the Edge overflowed: its node speaks no flow
    /// control and sent more than a window the client had not drained. The
    /// run is cut off (the client is too slow for it).
    Overflow,
    /// Control gave up on the run before its terminal and cancelled it
    /// on the node (U6); the client gets the error now.
    Aborted(AbortReason),
    /// The attempt failed before anything reached the client and Control
    /// dispatched the request again (pre-commit failover): the relay sends
    /// this dispatch's run and relays its frames instead.
    Retry(Box<Dispatch>),
    /// The node took enough of a streamed request body for the Edge to
    /// send up to this many charged bytes of it in total (a `FlowCredit`
    /// from the node; `iop_wire::flow::TUNNEL_BODY_WINDOW`).
    UploadCredit(u64),
}

/// The receiving end of a client request's reply: frames arrive here from
/// whichever shard reads the node connection, at most a flow-control
/// window of them (`iop_wire::flow`); [`ReplyRx::drained`] grants the node
/// more as the client's socket takes them.
#[derive(Debug)]
pub struct ReplyRx {
    pub(super) rx: Mailbox<ReplyEvent>,
    /// Set when `Control` released the lease without a terminal.
    pub(super) lost: Rc<Cell<bool>>,
    /// When to credit the node, from what the client took.
    pub(super) drain: DrainWindow,
    /// The run's window (a new attempt starts with a fresh one).
    pub(super) window: u64,
    /// The node connection and run the credit is for.
    pub(super) conn: ConnId,
    pub(super) run_id: String,
    /// An event taken and given back ([`ReplyRx::put_back`]): the next one.
    pub(super) put_back: Option<ReplyEvent>,
}

impl ReplyRx {
    /// The next event. Once the lease is known lost (F1, R2) that is all
    /// the client gets: frames still queued behind the decision — read from
    /// the fenced connection before its shard closed it — are never
    /// relayed.
    pub async fn recv(&mut self) -> Option<ReplyEvent> {
        if self.lost.get() {
            return Some(ReplyEvent::Lost);
        }
        if let Some(event) = self.put_back.take() {
            return Some(event);
        }
        let event = self.rx.recv().await;
        if self.lost.get() {
            return Some(ReplyEvent::Lost);
        }
        event
    }

    /// Gives `event` back: [`ReplyRx::recv`] returns it next (an upload
    /// that met its response's first frame hands it to the relay).
    pub fn put_back(&mut self, event: ReplyEvent) {
        debug_assert!(self.put_back.is_none(), "one event given back at a time");
        self.put_back = Some(event);
    }

    /// The node connection the reply's run is on.
    pub fn conn(&self) -> ConnId {
        self.conn
    }

    /// The run id of the attempt whose frames this reply relays now.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Follows the request's next attempt ([`ReplyEvent::Retry`]): credit
    /// goes to its connection and run, under a fresh window.
    pub fn retarget(&mut self, dispatch: &Dispatch) {
        self.conn = dispatch.lease.conn;
        self.run_id = dispatch.lease.run_id.clone();
        self.drain = DrainWindow::new(self.window);
    }
}

impl ReplyEvent {
    /// The run a node's frame belongs to; `None` for the Edge's own notices.
    pub fn run_id(&self) -> Option<&str> {
        match self {
            ReplyEvent::Tunnel(tf) => Some(&tf.run_id),
            ReplyEvent::Chunk(chunk) => Some(chunk.run_id()),
            ReplyEvent::Run(ev) => Some(&ev.run_id),
            ReplyEvent::Lost
            | ReplyEvent::Overflow
            | ReplyEvent::Aborted(_)
            | ReplyEvent::Retry(_)
            | ReplyEvent::UploadCredit(_) => None,
        }
    }

    /// Its flow-control charge (`iop_wire::flow`).
    pub fn charge(&self) -> u64 {
        match self {
            ReplyEvent::Tunnel(tf) => flow::charge_of_tunnel_frame(tf),
            ReplyEvent::Chunk(chunk) => {
                flow::tunnel_frame_charge(pb::TunnelFrameKind::Body, chunk.body.len())
            }
            ReplyEvent::Run(ev) => flow::charge_of_run_event(ev),
            ReplyEvent::Lost
            | ReplyEvent::Overflow
            | ReplyEvent::Aborted(_)
            | ReplyEvent::Retry(_)
            | ReplyEvent::UploadCredit(_) => 0,
        }
    }
}

/// This shard's handle on a dispatched client request's reply.
pub(super) struct ClientReply {
    pub(super) tx: MailboxSender<ReplyEvent>,
    pub(super) lost: Rc<Cell<bool>>,
}

/// A dispatched run on a node connection of this shard: where its frames
/// go.
pub(super) struct NodeReply {
    /// The connection the run was dispatched to; frames from any other
    /// connection are not for this reply (H1).
    pub(super) conn: ConnId,
    /// The client request's mailbox (on any shard). Never awaited: the
    /// window bounds what it holds, so a push always fits.
    pub(super) tx: MailboxSender<ReplyEvent>,
    /// What the node may still send: charged bytes received against the
    /// credit granted so far.
    pub(super) window: RecvWindow,
    /// A frame of it was delivered already (its response started, U6).
    pub(super) responded: bool,
    /// Its commit point and how it ends (`crate::control::attempt`).
    pub(super) tracker: AttemptTracker,
}

/// What happened to a frame from a node (`Edge::deliver`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    /// Queued for its client (or dropped: the client has left).
    Delivered {
        /// The run's first frame (its response started, U6).
        first: bool,
        /// This frame commits the attempt (`crate::control::attempt`).
        commits: bool,
        /// For a terminal: how the attempt ended, and whether it had
        /// committed.
        end: Option<(AttemptEnd, bool)>,
        /// The run's id, for the run's first frame, the frame that commits
        /// it and its terminal (the frames that tell Control something);
        /// `None` otherwise.
        run_id: Option<String>,
    },
    /// No live reply on this connection (late, stale, or never dispatched
    /// here: H1, F2).
    NoReply,
    /// The run went beyond its window on a node without flow control: the
    /// run was cut off (its client gets [`ReplyEvent::Overflow`]).
    CutOff,
    /// A node that speaks flow control sent beyond its credit: a protocol
    /// error; close the connection.
    Overrun(Overrun),
}

/// A frame about to wait in a reply behind others (its client is behind):
/// its body is copied out of the connection's read buffer, so a stuck
/// client holds its window's bytes and no more. Decoded bodies are slices
/// of the read buffer they arrived in (64 KiB chunks shared by every run of
/// the connection); left as they are, a few frames of a client that does
/// not read would pin whole chunks full of other runs' bytes. A frame its
/// client takes at once (an empty reply) keeps the zero-copy slice.
pub(super) fn compacted(event: ReplyEvent, reply: &MailboxSender<ReplyEvent>) -> ReplyEvent {
    match event {
        ReplyEvent::Tunnel(mut tf) if !tf.body.is_empty() && !reply.is_empty() => {
            tf.body = bytes::Bytes::copy_from_slice(&tf.body);
            ReplyEvent::Tunnel(tf)
        }
        ReplyEvent::Chunk(mut chunk) if !chunk.body.is_empty() && !reply.is_empty() => {
            chunk.body = bytes::Bytes::copy_from_slice(&chunk.body);
            ReplyEvent::Chunk(chunk)
        }
        other => other,
    }
}

/// Puts a notice (`Lost`, `Overflow`, `Aborted`) on a reply even when the
/// reply is full: then it waits behind the queued frames.
pub(super) fn push_notice(tx: MailboxSender<ReplyEvent>, notice: ReplyEvent) {
    if let Err(mailbox::TrySendError::Full(notice)) = tx.try_send(notice) {
        monoio::spawn(async move {
            let _ = tx.send(notice).await;
        });
    }
}
