//! Commands the Edge sends to a Node and waits for (the operator's `/admin`
//! commands, the `/metrics` pulls): the per-shard table of commands waiting
//! for their answer.
//!
//! ```text
//! send ─► pending[command_id] = (conn, reply) ─► NodeCommandRequest ──► node
//!  node ──► NodeCommandResponse ──► nodes.rs ─► on_response ─► reply (only from that conn)
//!  the connection closed before the command went out ─► on_undeliverable ─► Closed
//! ```
//!
//! The table is per shard (the Edge's state is core-local): the command id
//! (`admin-{shard}-{n}`) names the shard that waits, and the shard reading
//! the node's answer forwards it there. Only answers from the connection
//! the command went to count (K2).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::time::Duration;

use iop_engine::sync::oneshot;
use iop_wire::pb;
use iop_wire::pb::frame::Body;

use crate::control::ConnId;
use crate::link::edge::Edge;

/// How long to wait for the node's answer before 504.
pub const COMMAND_WAIT: Duration = Duration::from_secs(15);
/// Most commands waiting at once (a bound on the pending table).
pub const MAX_PENDING: usize = 1024;

struct Pending {
    conn: ConnId,
    reply: oneshot::Sender<pb::NodeCommandResponse>,
}

thread_local! {
    static PENDING: RefCell<HashMap<String, Pending>> = RefCell::new(HashMap::new());
    static NEXT_ID: Cell<u64> = const { Cell::new(0) };
}

/// Whether `command_id` names an admin command (answers go to
/// [`on_response`], not to the control machine).
pub fn is_admin_command(command_id: &str) -> bool {
    command_id.starts_with(COMMAND_ID_PREFIX)
}

/// Prefix of admin command ids: `admin-{shard}-{n}`, naming the shard whose
/// client waits for the answer.
pub const COMMAND_ID_PREFIX: &str = "admin-";

/// The shard waiting for the answer to admin command `command_id` (0 when
/// the id does not name one).
pub fn command_shard(command_id: &str) -> usize {
    command_id
        .strip_prefix(COMMAND_ID_PREFIX)
        .and_then(|rest| rest.split_once('-'))
        .and_then(|(shard, _)| shard.parse().ok())
        .unwrap_or(0)
}

/// Why a command sent with [`send`] has no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CommandFailed {
    /// [`MAX_PENDING`] commands are already waiting.
    #[error("too many commands are waiting for nodes")]
    Busy,
    /// The node connection closed before the command went out or before
    /// its answer came.
    #[error("the node connection closed")]
    Closed,
    /// No answer within the wait.
    #[error("the node did not answer in time")]
    TimedOut,
}

/// Sends `command` (its `command_id` is set here) to the node on `conn_id`
/// and waits up to `wait` for its answer on that connection.
pub async fn send(
    edge: &Edge,
    conn_id: ConnId,
    mut command: pb::NodeCommandRequest,
    wait: Duration,
) -> Result<pb::NodeCommandResponse, CommandFailed> {
    if PENDING.with_borrow(|p| p.len()) >= MAX_PENDING {
        return Err(CommandFailed::Busy);
    }
    let command_id = NEXT_ID.with(|n| {
        let id = n.get() + 1;
        n.set(id);
        format!("{COMMAND_ID_PREFIX}{}-{id}", edge.shard_index())
    });
    let (tx, rx) = oneshot::channel();
    PENDING.with_borrow_mut(|p| {
        p.insert(
            command_id.clone(),
            Pending {
                conn: conn_id,
                reply: tx,
            },
        )
    });
    command.command_id = command_id.clone();
    let frame = pb::Frame {
        body: Some(Body::NodeCommandRequest(command)),
    };
    if !edge.send_control_to(conn_id, frame) {
        PENDING.with_borrow_mut(|p| p.remove(&command_id));
        return Err(CommandFailed::Closed);
    }
    // `Some(None)`: the command could not be sent after all (the
    // connection closed on its shard).
    let answer = monoio::select! {
        r = rx => Some(r.ok()),
        _ = monoio::time::sleep(wait) => None,
    };
    PENDING.with_borrow_mut(|p| p.remove(&command_id));
    match answer {
        Some(Some(resp)) => Ok(resp),
        Some(None) => Err(CommandFailed::Closed),
        None => Err(CommandFailed::TimedOut),
    }
}

/// Admin command `command_id` could not be sent on `conn` (it closed before
/// its shard got the frame): its request answers 502 at once.
pub fn on_undeliverable(conn: ConnId, command_id: &str) {
    PENDING.with_borrow_mut(|p| {
        if p.get(command_id).is_some_and(|entry| entry.conn == conn) {
            // Dropping the reply sender wakes the waiting request.
            p.remove(command_id);
        }
    });
}

/// A `NodeCommandResponse` from connection `conn` (called by the node
/// connection shell). Answers to unknown commands or from another
/// connection are ignored.
pub fn on_response(conn: ConnId, resp: pb::NodeCommandResponse) {
    let pending = PENDING.with_borrow_mut(|p| match p.get(&resp.command_id) {
        Some(entry) if entry.conn == conn => p.remove(&resp.command_id),
        _ => None,
    });
    match pending {
        Some(entry) => {
            let _ = entry.reply.send(resp);
        }
        None => {
            tracing::debug!(command_id = %resp.command_id, "unsolicited command response ignored")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // CONTRACT: K2 — answers are correlated by command id and accepted only
    // from the connection the command went to.
    #[test]
    fn responses_are_correlated_by_id_and_connection() {
        let (tx, mut rx) = oneshot::channel();
        PENDING.with_borrow_mut(|p| {
            p.insert(
                "admin-x".into(),
                Pending {
                    conn: ConnId(7),
                    reply: tx,
                },
            )
        });
        let resp = pb::NodeCommandResponse {
            command_id: "admin-x".into(),
            ok: true,
            ..Default::default()
        };
        on_response(ConnId(8), resp.clone());
        assert!(
            rx.try_recv().is_err(),
            "another connection's answer is ignored"
        );
        on_response(ConnId(7), resp.clone());
        assert_eq!(rx.try_recv(), Ok(resp));
    }

    #[test]
    fn an_undeliverable_command_ends_its_wait() {
        let (tx, mut rx) = oneshot::channel::<pb::NodeCommandResponse>();
        PENDING.with_borrow_mut(|p| {
            p.insert(
                "admin-0-9".into(),
                Pending {
                    conn: ConnId(7),
                    reply: tx,
                },
            )
        });
        on_undeliverable(ConnId(8), "admin-0-9");
        assert!(
            PENDING.with_borrow(|p| p.contains_key("admin-0-9")),
            "another connection"
        );
        on_undeliverable(ConnId(7), "admin-0-9");
        assert!(PENDING.with_borrow(|p| p.is_empty()));
        assert!(
            rx.try_recv().is_err(),
            "the sender is gone: the request answers 502"
        );
        assert_eq!(command_shard("admin-3-17"), 3);
        assert_eq!(command_shard("admin-17"), 0);
    }
}
