//! A provider call on the session core itself (`--cores` with one core):
//! run inline by the attempt that awaits its outputs ([`ProviderSide`]),
//! against this core's keep-alive pool; no task of its own, no mailbox hop.

use std::rc::Rc;

use iop_engine::clock;
use iop_engine::sync::channel;

use super::channel::{InlineCall, OutputTx, ProviderCall, ProviderSide};
use super::pool::ProviderPool;
use crate::adapters::Permit;

/// Outputs an inline call hands over at a time: it runs only while its
/// attempt waits for the next one, which takes each as it comes.
const INLINE_OUTPUT_QUEUE: usize = 1;

/// Starts `call` on this core. Its future, boxed into the returned side
/// with `permit`, holds the permit until the call returns or is aborted
/// (W10); an abort drops it, which closes its provider socket (plain TCP;
/// the runtime cancels the in-flight operation).
pub(super) fn spawn<C: ProviderCall>(
    pool: Rc<ProviderPool>,
    permit: Option<Permit>,
    call: C,
) -> ProviderSide<C::Output> {
    let (tx, rx) = channel::channel(INLINE_OUTPUT_QUEUE);
    let started_at = clock::now();
    let call = InlineCall::new(call.run(pool, OutputTx::local(tx)), permit);
    ProviderSide::inline(rx, call, started_at)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use bytes::Bytes;

    use super::*;
    use crate::calls::pool::PoolConfig;
    use crate::calls::scripted::Scripted;

    fn pieces(n: usize) -> Vec<Bytes> {
        (0..n).map(|i| Bytes::from(format!("piece-{i}"))).collect()
    }

    // More outputs than the queue holds: the call runs as the attempt
    // takes them (its sends wait while the queue is full), in order, and
    // the side ends when the call returned.
    #[monoio::test(timer_enabled = true)]
    async fn an_inline_call_runs_as_its_outputs_are_taken() {
        let sent = pieces(3 * INLINE_OUTPUT_QUEUE + 8);
        let call = Scripted::new(sent.clone(), false);
        let dropped = call.dropped.clone();
        let mut side = spawn(ProviderPool::new(PoolConfig::default()), None, call);
        let mut got = Vec::new();
        while let Some(piece) = side.next_output().await {
            got.push(piece);
        }
        assert_eq!(got, sent);
        assert!(
            dropped.load(Ordering::Relaxed),
            "the call's future is gone once it returned"
        );
        assert_eq!(side.next_output().await, None);
    }

    // An abort drops the call at once, not at the attempt's next read: its
    // socket and permit go with it (W10), with the output its send held;
    // the side ends after what was already queued (nothing, the queue
    // holding one).
    #[monoio::test(timer_enabled = true)]
    async fn an_aborted_inline_call_is_dropped_at_once() {
        let call = Scripted::new(pieces(2), true);
        let dropped = call.dropped.clone();
        let mut side = spawn(ProviderPool::new(PoolConfig::default()), None, call);
        assert_eq!(side.next_output().await, Some(Bytes::from("piece-0")));
        assert!(!dropped.load(Ordering::Relaxed));
        side.abort();
        assert!(dropped.load(Ordering::Relaxed), "abort drops the call");
        assert_eq!(side.next_output().await, None);
        side.abort();
    }
}
