//! The ownership claims and releases Control asks of etcd
//! ([`Action::ClaimOwnership`], [`Action::ReleaseOwnership`]), queued on
//! the control shard for the cluster shell (`crate::cluster`) to carry
//! out in order. Here, below the cluster room, so the link carries out
//! Control's actions without knowing etcd.

use std::cell::RefCell;
use std::collections::VecDeque;

use iop_engine::sync::Notify;

use crate::control::ConnId;

/// One thing to do in etcd for Control.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OwnershipOp {
    /// Write `node_id`'s owner key for `conn` on this Edge's lease.
    Claim {
        /// The registering connection.
        conn: ConnId,
        /// The node id.
        node_id: String,
    },
    /// Delete `node_id`'s owner key if its `mod_revision` is `revision`.
    Release {
        /// The node id.
        node_id: String,
        /// The generation that ended.
        revision: u64,
    },
}

/// The queue of [`OwnershipOp`]s: Control's actions push, the cluster
/// shell pops in order.
#[derive(Debug, Default)]
pub struct OwnershipQueue {
    ops: RefCell<VecDeque<OwnershipOp>>,
    wake: Notify,
}

impl OwnershipQueue {
    /// Queues `op` and wakes the shell.
    pub fn push(&self, op: OwnershipOp) {
        self.ops.borrow_mut().push_back(op);
        self.wake.notify();
    }

    /// Takes every queued op, oldest first (empty when there is none).
    pub fn take(&self) -> Vec<OwnershipOp> {
        self.ops.borrow_mut().drain(..).collect()
    }

    /// Waits until an op may have been queued.
    pub async fn changed(&self) {
        self.wake.notified().await;
    }
}
