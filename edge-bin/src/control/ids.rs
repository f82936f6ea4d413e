//! The identities Control and its shells name things by: node
//! connections, their generations, client requests and provider resources.

use std::sync::Arc;

/// Shell-assigned identity of one accepted node connection, unique for the
/// life of the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// Edge-internal connection generation of a node id (R2, R5); never on the
/// wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(pub u64);

/// Shell-assigned identity of one client request, unique and increasing for
/// the life of the process (arrival order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl RequestId {
    /// The run id a dispatch of this request carries on the wire.
    pub fn run_id(self) -> String {
        format!("run-{}", self.0)
    }

    /// The run id of its `attempt`-th attempt (1-based): the first is
    /// [`RequestId::run_id`], a retry `run-<id>.<attempt>`.
    pub fn attempt_run_id(self, attempt: u32) -> String {
        if attempt <= 1 {
            self.run_id()
        } else {
            format!("run-{}.{attempt}", self.0)
        }
    }
}

/// Identity of a provider resource: `(node id, provider id)`. Shared
/// strings: every lease and dispatch of the provider carries its key, and
/// a clone is a reference count, not an allocation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProviderKey {
    /// Owning node.
    pub node_id: Arc<str>,
    /// Provider id, unique per node.
    pub provider_id: Arc<str>,
}

impl std::fmt::Display for ProviderKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.node_id, self.provider_id)
    }
}
