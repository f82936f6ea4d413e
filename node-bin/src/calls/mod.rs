//! Provider calls: everything that runs on the core owning a provider
//! socket — the HTTP exchange of a tunnel ([`tunnel`]) or of a normalized
//! run ([`run`]: [`ollama`], [`openai`], sharing [`normalize`]), the
//! keep-alive pool ([`pool`]), and the worker cores they run on
//! ([`workers`]). A call produces [`output`]s into its [`channel`]; it
//! knows nothing of frames, the watchdog or the session.
//!
//! ```text
//!  CallSite::spawn(permit, call)
//!    ├─ Here: inline in the attempt's task on this core (local), this core's pool
//!    └─ Workers: a job to the least-loaded worker core, its pool
//!         provider socket ─read─► pooled buffer ─Bytes─► OutputTx ══► ProviderSide (the attempt)
//! ```

pub mod channel;
mod local;
pub mod normalize;
pub mod ollama;
pub mod openai;
pub mod output;
pub mod pool;
pub mod run;
#[cfg(test)]
pub(crate) mod scripted;
pub mod tunnel;
pub mod upload;
pub mod usage;
pub mod workers;

use std::rc::Rc;

pub use self::channel::{OutputTx, ProviderCall, ProviderSide, Stamped, OUTPUT_QUEUE};
pub use self::output::{RunOutput, TunnelOutput};
use self::pool::ProviderPool;
use self::workers::Workers;
use crate::adapters::Permit;

/// Where this node's provider calls run.
#[derive(Debug, Clone)]
pub enum CallSite {
    /// On the session core, inline in the attempt's own task, against its
    /// keep-alive pool (one core: no task of its own, no mailbox hop).
    Here(Rc<ProviderPool>),
    /// On the worker cores (`--cores` of two or more), each against its
    /// own pool; outputs come back over a bounded cross-core mailbox.
    Workers(Rc<Workers>),
}

impl CallSite {
    /// Starts the provider call of an attempt. On this core the task holds
    /// `permit` until the call returns or is aborted; on a worker core the
    /// returned side holds it here until the worker reports the call's
    /// return (W10).
    pub fn spawn<C: ProviderCall>(
        &self,
        permit: Option<Permit>,
        call: C,
    ) -> ProviderSide<C::Output> {
        match self {
            CallSite::Here(pool) => local::spawn(pool.clone(), permit, call),
            CallSite::Workers(workers) => workers.dispatch(permit, call),
        }
    }

    /// The session core's pool, when calls run here.
    pub fn pool(&self) -> Option<&Rc<ProviderPool>> {
        match self {
            CallSite::Here(pool) => Some(pool),
            CallSite::Workers(_) => None,
        }
    }

    /// The worker cores, when calls run there.
    pub fn workers(&self) -> Option<&Rc<Workers>> {
        match self {
            CallSite::Here(_) => None,
            CallSite::Workers(workers) => Some(workers),
        }
    }
}
