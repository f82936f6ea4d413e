//! A provider call for unit tests: sends the pieces it was given, then
//! returns or waits to be aborted, and records where it ran and when its
//! future was dropped.

use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::ThreadId;

use bytes::Bytes;

use super::pool::ProviderPool;
use super::{OutputTx, ProviderCall};

/// Sends `pieces`, then returns, or waits to be aborted when `hold`.
pub(crate) struct Scripted {
    pieces: Vec<Bytes>,
    hold: bool,
    /// The thread the call ran on, once it started.
    pub(crate) ran_on: Arc<OnceLock<ThreadId>>,
    /// Set when the call's future is dropped, however it ends.
    pub(crate) dropped: Arc<AtomicBool>,
}

impl Scripted {
    pub(crate) fn new(pieces: Vec<Bytes>, hold: bool) -> Self {
        Self {
            pieces,
            hold,
            ran_on: Arc::new(OnceLock::new()),
            dropped: Arc::new(AtomicBool::new(false)),
        }
    }
}

/// Sets its flag when dropped.
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

impl ProviderCall for Scripted {
    type Output = Bytes;

    async fn run(self, _pool: Rc<ProviderPool>, out: OutputTx<Bytes>) {
        let _flag = DropFlag(self.dropped);
        let _ = self.ran_on.set(std::thread::current().id());
        for piece in self.pieces {
            if !out.send(piece).await {
                return;
            }
        }
        if self.hold {
            std::future::pending::<()>().await;
        }
    }

    fn not_started(message: String) -> Bytes {
        Bytes::from(message)
    }
}
