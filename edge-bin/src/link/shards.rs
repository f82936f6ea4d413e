//! The Edge across cores: one [`Edge`](crate::link::edge::Edge) per shard, wired
//! by bounded cross-core mailboxes.
//!
//! ```text
//!            inputs (batched)                     actions for conns/requests here
//!  shard k ───────────────────► control shard 0 ─────────────────────────────────► shard k
//!  (client sockets,             (Control: registry,                                 │
//!   node connections)            fencing, queue, leases)                            │
//!     │ StartAttempt{conn, run, reply} ──► shard owning the node connection             │
//!     ◄───────────── body frames, straight into the reply's mailbox ◄───────────────┘
//! ```
//!
//! Every shard accepts client and node connections (`SO_REUSEPORT`
//! listeners, [`bind_reuseport`]); ids it mints carry its index
//! ([`shard_of`]), so any shard can tell where a connection or request
//! lives. Messages between two shards keep their order: each shard queues
//! what it sends per destination in one [`Outbox`] and one flusher task
//! moves it, coalescing consecutive inputs (or actions) into one message so
//! wake-ups stay rare under load. Body frames never pass the control shard:
//! the shard reading a node connection pushes them into the reply's own
//! bounded mailbox, whose receiver is the client request on its shard.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::net::SocketAddr;

use bytes::Bytes;
use iop_engine::mailbox::{self, Mailbox, MailboxSender};
use iop_engine::sync::Notify;
use iop_wire::codec::BodyParts;
use iop_wire::pb;

use crate::control::{Action, ConnId, Control, Input, RequestId};
use crate::link::replies::ReplyEvent;

/// Bits of a connection or request id that hold its shard index.
const SHARD_SHIFT: u32 = 48;

/// Messages each shard's inbox holds before senders wait.
pub const INBOX_MESSAGES: usize = 4096;

/// Messages an inbox hands over per wake-up.
const INBOX_BATCH: usize = 256;

/// The shard index an id minted by [`shard_id`] belongs to.
pub fn shard_of(id: u64) -> usize {
    usize::try_from(id >> SHARD_SHIFT).unwrap_or(usize::MAX)
}

/// Id number `seq` of shard `shard`.
pub fn shard_id(shard: usize, seq: u64) -> u64 {
    ((shard as u64) << SHARD_SHIFT) | (seq & ((1u64 << SHARD_SHIFT) - 1))
}

/// A read of `Control`, run on the control shard.
pub type Query = Box<dyn FnOnce(&Control) + Send>;

/// What starts one attempt on its node: the `ProviderTunnelRequest` or
/// `RunRequest` frame and, for a tunnel, its body in pieces (the client's
/// bytes with `model` spliced in). The frame's own `body` stays empty: the
/// pieces are written after the frame's head as they are
/// ([`iop_wire::codec::RequestFrameHead`]), so a large request body is held
/// once, by the client request, however many attempts it takes.
#[derive(Debug, Clone)]
pub struct NodeRequest {
    /// The request frame.
    pub frame: pb::Frame,
    /// The tunnel body (empty for a `RunRequest`).
    pub body: BodyParts,
}

impl NodeRequest {
    /// A request whose frame is all of it (a `RunRequest`).
    pub fn frame_only(frame: pb::Frame) -> Self {
        Self {
            frame,
            body: BodyParts::default(),
        }
    }

    /// The frame as the node decodes it: a tunnel's body joined into it.
    pub fn joined(self) -> pb::Frame {
        let Self { mut frame, body } = self;
        if let Some(pb::frame::Body::ProviderTunnelRequest(t)) = &mut frame.body {
            if !body.is_empty() {
                t.body = body.to_bytes();
            }
        }
        frame
    }
}

/// A dispatched run to send on a node connection of the receiving shard.
pub struct StartAttempt {
    /// The node connection (owned by the receiving shard).
    pub conn: ConnId,
    /// The request it serves.
    pub request: RequestId,
    /// Its run id (the key node frames carry).
    pub run_id: String,
    /// The `ProviderTunnelRequest` or `RunRequest` and its body.
    pub run: NodeRequest,
    /// Where the run's frames go (the client request's mailbox).
    pub reply: MailboxSender<ReplyEvent>,
    /// Its relay writes only at the end (a non-streaming chat completion
    /// over a normalized run): the commit point (`crate::control::attempt`).
    pub buffered: bool,
    /// The rest of a streamed request body (`body_follows_bytes`): its
    /// pieces go to the node, in order, after the tunnel request.
    pub upload: Option<Mailbox<Bytes>>,
}

impl std::fmt::Debug for StartAttempt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StartAttempt")
            .field("conn", &self.conn)
            .field("request", &self.request)
            .field("run_id", &self.run_id)
            .finish_non_exhaustive()
    }
}

/// Lifecycle steps the control shard hands every worker shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    /// First SIGTERM/SIGINT: close the listeners and drain.
    Shutdown,
    /// Second signal: end the drain now.
    Force,
    /// Every shard drained: stop serving.
    Exit,
}

/// Work one shard hands another.
pub enum ShardMsg {
    /// Inputs for `Control` (control shard only), in arrival order.
    Inputs(Vec<Input>),
    /// `Control`'s decisions about connections and requests of this shard.
    Actions(Vec<Action>),
    /// Send a run on a node connection of this shard.
    StartAttempt(StartAttempt),
    /// The client of a run on a node connection of this shard drained
    /// enough for more credit.
    Credit {
        /// The node connection.
        conn: ConnId,
        /// The run.
        run_id: String,
        /// The new credit (absolute).
        max_offset: u64,
    },
    /// Send a control frame on a node connection of this shard.
    SendControl {
        /// The connection.
        conn: ConnId,
        /// The frame.
        frame: pb::Frame,
    },
    /// An admin command's answer, for the shard whose client asked.
    CommandAnswer {
        /// The connection it arrived on.
        conn: ConnId,
        /// The answer.
        response: pb::NodeCommandResponse,
    },
    /// An admin command could not be sent (its connection is gone), for
    /// the shard whose client asked.
    CommandUndeliverable {
        /// The connection it was for.
        conn: ConnId,
        /// The command.
        command_id: String,
    },
    /// A read of `Control` (control shard only).
    Query(Query),
    /// A lifecycle step (from the control shard).
    Lifecycle(Lifecycle),
    /// A worker shard finished its drain with this many requests cut off
    /// (to the control shard).
    Drained {
        /// Requests still in flight when it stopped waiting.
        in_flight: usize,
    },
}

impl std::fmt::Debug for ShardMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShardMsg::Inputs(v) => write!(f, "Inputs({})", v.len()),
            ShardMsg::Actions(v) => write!(f, "Actions({})", v.len()),
            ShardMsg::StartAttempt(s) => s.fmt(f),
            ShardMsg::Credit { conn, .. } => write!(f, "Credit({conn:?})"),
            ShardMsg::SendControl { conn, .. } => write!(f, "SendControl({conn:?})"),
            ShardMsg::CommandAnswer { conn, .. } => write!(f, "CommandAnswer({conn:?})"),
            ShardMsg::CommandUndeliverable { command_id, .. } => {
                write!(f, "CommandUndeliverable({command_id})")
            }
            ShardMsg::Query(_) => f.write_str("Query"),
            ShardMsg::Lifecycle(l) => write!(f, "Lifecycle({l:?})"),
            ShardMsg::Drained { in_flight } => write!(f, "Drained({in_flight})"),
        }
    }
}

/// One shard's ends of the mesh: its inbox and a sender to every shard
/// (itself included), by index. `Send`, so it can be handed to the shard's
/// thread.
#[derive(Debug)]
pub struct MeshPort {
    /// This shard's index (0 = control).
    pub index: usize,
    /// Senders to every shard's inbox.
    pub peers: Vec<MailboxSender<ShardMsg>>,
    /// This shard's inbox.
    pub inbox: Mailbox<ShardMsg>,
}

/// The mailboxes of `count` shards, one port per shard.
pub fn mesh(count: usize) -> Vec<MeshPort> {
    let (senders, inboxes): (Vec<_>, Vec<_>) = (0..count.max(1))
        .map(|_| mailbox::mailbox(INBOX_MESSAGES))
        .unzip();
    inboxes
        .into_iter()
        .enumerate()
        .map(|(index, inbox)| MeshPort {
            index,
            peers: senders.clone(),
            inbox,
        })
        .collect()
}

/// What one shard sends to the others, per destination and in order.
#[derive(Debug)]
pub struct Outbox {
    peers: Vec<MailboxSender<ShardMsg>>,
    queues: RefCell<Vec<VecDeque<ShardMsg>>>,
    wake: Notify,
    /// The flusher holds a message it is handing to an inbox.
    sending: Cell<bool>,
}

impl Outbox {
    /// An outbox over `peers` (index = shard).
    pub fn new(peers: Vec<MailboxSender<ShardMsg>>) -> Self {
        let queues = peers.iter().map(|_| VecDeque::new()).collect();
        Self {
            peers,
            queues: RefCell::new(queues),
            wake: Notify::default(),
            sending: Cell::new(false),
        }
    }

    /// How many shards there are.
    pub fn shards(&self) -> usize {
        self.peers.len()
    }

    /// Queues `input` for shard `to`, joining a batch still waiting.
    pub fn input(&self, to: usize, input: Input) {
        self.with_queue(to, |q| match q.back_mut() {
            Some(ShardMsg::Inputs(batch)) => batch.push(input),
            _ => q.push_back(ShardMsg::Inputs(vec![input])),
        });
    }

    /// Queues `action` for shard `to`, joining a batch still waiting.
    pub fn action(&self, to: usize, action: Action) {
        self.with_queue(to, |q| match q.back_mut() {
            Some(ShardMsg::Actions(batch)) => batch.push(action),
            _ => q.push_back(ShardMsg::Actions(vec![action])),
        });
    }

    /// Queues `msg` for shard `to`.
    pub fn send(&self, to: usize, msg: ShardMsg) {
        self.with_queue(to, |q| q.push_back(msg));
    }

    /// Whether every queued message reached its inbox.
    pub fn is_flushed(&self) -> bool {
        !self.sending.get() && self.queues.borrow().iter().all(VecDeque::is_empty)
    }

    /// Completes once every message queued so far reached its inbox (the
    /// flusher must be running).
    pub async fn flushed(&self) {
        while !self.is_flushed() {
            monoio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    fn with_queue(&self, to: usize, f: impl FnOnce(&mut VecDeque<ShardMsg>)) {
        let mut queues = self.queues.borrow_mut();
        if let Some(q) = queues.get_mut(to) {
            f(q);
            self.wake.notify();
        } else {
            tracing::error!(to, "message for a shard that does not exist dropped");
        }
    }

    fn next(&self) -> Option<(usize, ShardMsg)> {
        let mut queues = self.queues.borrow_mut();
        queues
            .iter_mut()
            .enumerate()
            .find_map(|(to, q)| q.pop_front().map(|m| (to, m)))
    }

    /// Moves queued messages into the destination inboxes, forever (spawn
    /// once per shard). Waits while an inbox is full: backpressure.
    pub async fn run(&self) {
        loop {
            self.wake.notified().await;
            while let Some((to, msg)) = self.next() {
                self.sending.set(true);
                if self.peers[to].send(msg).await.is_err() {
                    tracing::debug!(to, "shard inbox closed; message dropped");
                }
                self.sending.set(false);
            }
        }
    }
}

/// Receives a shard's inbox in batches and hands each message to `on`,
/// forever (spawn once per shard).
pub async fn run_inbox(mut inbox: Mailbox<ShardMsg>, on: impl Fn(ShardMsg)) {
    let mut batch = Vec::with_capacity(INBOX_BATCH);
    while inbox.recv_batch(&mut batch, INBOX_BATCH).await > 0 {
        for msg in batch.drain(..) {
            on(msg);
        }
    }
}

/// Binds `count` listening sockets on `addr` with `SO_REUSEPORT`, one per
/// shard: the kernel spreads incoming connections over them. With port 0
/// the first picks the port and the others join it. Errors name `key`.
pub fn bind_reuseport(
    addr: SocketAddr,
    count: usize,
    key: &str,
) -> std::io::Result<Vec<std::net::TcpListener>> {
    use socket2::{Domain, Protocol, Socket, Type};
    let context =
        |e: std::io::Error| std::io::Error::new(e.kind(), format!("bind {key} {addr}: {e}"));
    let mut listeners = Vec::with_capacity(count);
    let mut bound = addr;
    for _ in 0..count.max(1) {
        let socket = Socket::new(
            Domain::for_address(bound),
            Type::STREAM,
            Some(Protocol::TCP),
        )
        .map_err(context)?;
        socket.set_reuse_address(true).map_err(context)?;
        socket.set_reuse_port(true).map_err(context)?;
        socket.set_nonblocking(true).map_err(context)?;
        socket.bind(&bound.into()).map_err(context)?;
        socket.listen(1024).map_err(context)?;
        let listener: std::net::TcpListener = socket.into();
        bound = listener.local_addr().map_err(context)?;
        listeners.push(listener);
    }
    Ok(listeners)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_carry_their_shard() {
        assert_eq!(shard_of(shard_id(0, 7)), 0);
        assert_eq!(shard_id(0, 7), 7, "shard 0 ids are plain sequence numbers");
        assert_eq!(shard_of(shard_id(3, 7)), 3);
        assert_eq!(shard_id(3, 7) & 0xffff, 7);
        assert_ne!(shard_id(1, 7), shard_id(2, 7));
    }

    #[test]
    fn reuseport_listeners_share_one_port() {
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap_or_else(|e| panic!("{e}"));
        let listeners =
            bind_reuseport(addr, 3, "edge.client_listen").unwrap_or_else(|e| panic!("{e}"));
        let ports: Vec<u16> = listeners
            .iter()
            .map(|l| l.local_addr().map(|a| a.port()).unwrap_or(0))
            .collect();
        assert_eq!(ports.len(), 3);
        assert_ne!(ports[0], 0);
        assert!(ports.iter().all(|&p| p == ports[0]), "{ports:?}");
    }

    #[monoio::test_all(timer_enabled = true)]
    async fn outbox_keeps_order_and_coalesces_batches() {
        let mut ports = mesh(2);
        let second = ports.pop().unwrap_or_else(|| panic!("two ports"));
        let first = ports.pop().unwrap_or_else(|| panic!("two ports"));
        let outbox = std::rc::Rc::new(Outbox::new(first.peers.clone()));
        outbox.input(
            1,
            Input::Cancel {
                request: RequestId(1),
                reason: crate::control::CancelReason::ClientDisconnect,
            },
        );
        outbox.input(
            1,
            Input::Cancel {
                request: RequestId(2),
                reason: crate::control::CancelReason::ClientDisconnect,
            },
        );
        outbox.send(1, ShardMsg::Lifecycle(Lifecycle::Shutdown));
        outbox.input(
            1,
            Input::Cancel {
                request: RequestId(3),
                reason: crate::control::CancelReason::ClientDisconnect,
            },
        );
        let runner = outbox.clone();
        let flusher = monoio::spawn(async move { runner.run().await });
        let mut inbox = second.inbox;
        let mut got = Vec::new();
        while got.len() < 3 {
            let mut batch = Vec::new();
            inbox.recv_batch(&mut batch, 16).await;
            got.extend(batch);
        }
        let shape: Vec<String> = got.iter().map(|m| format!("{m:?}")).collect();
        assert_eq!(shape, ["Inputs(2)", "Lifecycle(Shutdown)", "Inputs(1)"]);
        outbox.flushed().await;
        assert!(outbox.is_flushed());
        outbox.send(1, ShardMsg::Lifecycle(Lifecycle::Exit));
        assert!(!outbox.is_flushed(), "queued, not yet handed over");
        outbox.flushed().await;
        assert_eq!(inbox.len(), 1);
        drop(flusher);
    }
}
