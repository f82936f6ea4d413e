//! A provider call on the session core itself (`--cores` with one core):
//! a task on this core against this core's keep-alive pool, no mailbox hop.

use std::rc::Rc;

use iop_engine::clock;
use iop_engine::metrics::{self, Count, Latency};
use iop_engine::sync::channel;

use super::channel::{AbortSignal, OutputTx, ProviderCall, ProviderSide, OUTPUT_QUEUE};
use super::pool::ProviderPool;
use crate::adapters::Permit;

/// Starts `call` in a task on this core. The task holds `permit` until the
/// call returns or is aborted (W10); dropping the call future on abort
/// closes its provider socket (plain TCP; the runtime cancels the
/// in-flight operation).
pub(super) fn spawn<C: ProviderCall>(
    pool: Rc<ProviderPool>,
    permit: Option<Permit>,
    call: C,
) -> ProviderSide<C::Output> {
    let (tx, rx) = channel::channel(OUTPUT_QUEUE);
    let abort = Rc::new(AbortSignal::default());
    let started_at = clock::now();
    // Boxed: `select!` below takes the call future by value, so an inline
    // one would be stored twice in the task (as captured, and in the
    // select), for the life of the call.
    let work = Box::pin(call.run(pool, OutputTx::local(tx)));
    let task_abort = abort.clone();
    monoio::spawn(async move {
        let _permit = permit;
        monoio::select! {
            biased;
            _ = task_abort.aborted() => metrics::add(Count::NodeProviderCallsAborted, 1),
            _ = work => {},
        }
        // metrics: provider call duration (returned or aborted).
        metrics::record_since(Latency::NodeProviderCallDuration, started_at);
    });
    ProviderSide::local(rx, abort, started_at)
}
