//! The Edge's per-process shared state on its (single, for now) shard: the
//! [`Control`] machine plus the shell-side tables that connect it to sockets.
//!
//! `Control` decides; this module only remembers which live connection handle
//! and which waiting client stand behind the ids `Control` speaks in.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use iop_engine::conn::ConnHandle;
use iop_wire::pb;
use local_sync::mpsc::bounded;

use crate::control::{ConnId, Control, Lease};
use crate::openai::ModelEntry;

/// What the node side delivers to a waiting client request.
// Frames move through the queue by value; boxing them would allocate per frame.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum RouteEvent {
    /// A tunnel frame from the connection that owns the lease (H1).
    Tunnel(pb::ProviderTunnelFrame),
    /// The lease was released without a terminal: the node's connection was
    /// fenced (F1) or superseded (R2).
    Lost(String),
}

/// A client request waiting for frames of its run.
pub struct Route {
    /// The connection the run was dispatched to; frames from any other
    /// connection are not for this route (H1).
    pub conn: ConnId,
    /// Where its frames go.
    pub tx: bounded::Tx<RouteEvent>,
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Route")
            .field("conn", &self.conn)
            .finish_non_exhaustive()
    }
}

/// Frames buffered per waiting client before the node connection's reader
/// waits for the client to catch up.
pub const ROUTE_QUEUE_FRAMES: usize = 256;

/// Static settings the shells need.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Largest client request body (413 above).
    pub max_request_body_bytes: usize,
    /// Models for `GET /v1/models`, in config order.
    pub models: Vec<ModelEntry>,
    /// Process start, Unix seconds (the `created` of listed models).
    pub started_unix_sec: i64,
}

/// The shard's state.
#[derive(Debug)]
pub struct Edge {
    /// The authoritative state machine.
    pub control: RefCell<Control>,
    /// Live node connections by id.
    pub conns: RefCell<HashMap<ConnId, ConnHandle>>,
    /// Waiting client requests by run id.
    pub routes: RefCell<HashMap<String, Route>>,
    /// Static settings.
    pub settings: Settings,
    next_conn: Cell<u64>,
}

impl Edge {
    /// A fresh shard state.
    pub fn new(control: Control, settings: Settings) -> Self {
        Self {
            control: RefCell::new(control),
            conns: RefCell::new(HashMap::new()),
            routes: RefCell::new(HashMap::new()),
            settings,
            next_conn: Cell::new(0),
        }
    }

    /// A new connection id.
    pub fn next_conn_id(&self) -> ConnId {
        let id = self.next_conn.get() + 1;
        self.next_conn.set(id);
        ConnId(id)
    }

    /// Tells the clients of `released` leases that their run is lost.
    pub fn fail_routes(&self, released: &[Lease], reason: &str) {
        for lease in released {
            let route = self.routes.borrow_mut().remove(&lease.run_id);
            if let Some(route) = route {
                // Bounded queue: if it is full the client is far behind and
                // will see the channel close instead.
                let tx = route.tx;
                let reason = reason.to_string();
                monoio::spawn(async move {
                    let _ = tx.send(RouteEvent::Lost(reason)).await;
                });
            }
        }
    }
}
