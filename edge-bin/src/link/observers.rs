//! Observers of `Control` events: the thread that feeds every event to
//! every observer ([`Observer`]).

use std::cell::Cell;

use crate::control::Event;

/// An observer of `Control` events (the droppable fan-out: event bus
/// subscribers, audit sinks). Its failure is logged and never affects
/// correctness or terminal delivery (F4, O2).
///
/// Observers run on a thread of their own (`Edge::observe`), fed through
/// a bounded queue: one that returns an error, panics or blocks costs its
/// own events (a full queue drops new ones, counted), never a lease
/// release, a fence or a client's terminal, which the shard has already
/// carried out by the time an observer sees the event.
pub type Observer = Box<dyn Fn(&Event) -> Result<(), String> + Send>;

/// Events queued for the observer thread at most; more are dropped.
pub const OBSERVER_BACKLOG: usize = 1024;

/// What the observer thread is sent.
pub(super) enum ObserverMsg {
    Add(Observer),
    Event(Event),
}

/// The shard's end of the observer thread.
pub(super) struct Observers {
    pub(super) tx: std::sync::mpsc::SyncSender<ObserverMsg>,
    /// Events dropped because the queue was full.
    pub(super) dropped: Cell<u64>,
}

impl Observers {
    pub(super) fn spawn() -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::sync_channel(OBSERVER_BACKLOG);
        std::thread::Builder::new()
            .name("iop-observers".into())
            .spawn(move || run_observers(rx))?;
        Ok(Self {
            tx,
            dropped: Cell::new(0),
        })
    }
}

/// The observer thread: every event to every observer, in order; an error
/// or a panic is logged and costs that observer that event only.
fn run_observers(rx: std::sync::mpsc::Receiver<ObserverMsg>) {
    let mut observers: Vec<Observer> = Vec::new();
    for msg in rx {
        match msg {
            ObserverMsg::Add(observer) => observers.push(observer),
            ObserverMsg::Event(event) => {
                for observer in &observers {
                    let outcome =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| observer(&event)));
                    match outcome {
                        Ok(Ok(())) => {}
                        Ok(Err(reason)) => {
                            tracing::warn!(%reason, "event observer failed; event dropped for it")
                        }
                        Err(_) => tracing::warn!("event observer panicked; event dropped for it"),
                    }
                }
            }
        }
    }
}
