//! The run manager's table: every active normalized run and tunnel of a
//! session, with the trigger that stops it (K1, F5, W10).
//!
//! An entry lives from the request's arrival until its attempt is released
//! — after the terminal *and* the provider call's return (W10) — so a
//! cancelled or stalled attempt whose provider has not returned yet still
//! counts as active. Entries carry a serial so a finished attempt never
//! removes a newer entry that reused its run id.
//!
//! A cancel may arrive before its run: the Edge sends cancels on the
//! connection's control lane, which overtakes a run request still queued on
//! the bulk lane (or still crossing the Edge's cores). A cancel that names
//! no active run is kept (the most recent [`EARLY_CANCELS`]) and stops the
//! run the moment it registers, so the provider is never called for a
//! client that already left (U6). Run ids are unique per Edge connection,
//! so a kept cancel never hits an unrelated run.

use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

use iop_engine::sync::oneshot;

use crate::attempt::flow::{FlowGate, WindowTooSmall};
use crate::attempt::watchdog::{NodeRunIds, StopCause};
use crate::calls::upload::{UploadError, UploadSink, UploadSource};

/// The kind of an active run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunKind {
    /// `RunRequest` → `RunEvent`s.
    Normalized,
    /// `ProviderTunnelRequest` → `ProviderTunnelFrame`s.
    Tunnel,
}

/// A second request with the run id of an active one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("run id `{0}` is already active")]
pub struct DuplicateRun(pub String);

/// Proof of registration; hand it back to [`RunTable::finish`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunTicket {
    run_id: String,
    serial: u64,
}

impl RunTicket {
    /// The Edge's run id.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The Node-owned ids of this run (W5), made into strings when asked.
    pub fn node_ids(&self) -> NodeRunIds {
        NodeRunIds::of_serial(self.serial)
    }
}

#[derive(Debug)]
struct Entry {
    kind: RunKind,
    serial: u64,
    stop: Option<oneshot::Sender<StopCause>>,
    /// The run's flow-control window, credited by the Edge (`None` when
    /// its request granted an unusable window and it is being refused).
    flow: Option<Rc<FlowGate>>,
    /// A tunnel's request body still arriving (`body_follows_bytes`).
    upload: Option<UploadSink>,
}

/// What a registered run takes to its attempt: its ticket, its stop
/// trigger and its flow-control window (an error when the request granted
/// an unusable one: the run is refused with one terminal).
#[derive(Debug)]
pub struct RunStart {
    /// Proof of registration.
    pub ticket: RunTicket,
    /// Fires on cancel (K1) or session end (F5).
    pub stop: oneshot::Receiver<StopCause>,
    /// The run's window.
    pub flow: Result<Rc<FlowGate>, WindowTooSmall>,
    /// A tunnel's request body still to arrive, when it streams.
    pub upload: Option<UploadSource>,
}

/// Cancels of runs not (yet) active that a session remembers.
pub const EARLY_CANCELS: usize = 1024;

/// Active runs of one session.
#[derive(Debug, Default)]
pub struct RunTable {
    /// By run id (ids the Edge made): hashed with foldhash, not SipHash.
    entries: HashMap<String, Entry, foldhash::fast::RandomState>,
    last_serial: u64,
    /// Cancels that named no active run, oldest first.
    early_cancels: VecDeque<(String, StopCause)>,
}

impl RunTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a run with its flow-control window; the receiver yields
    /// its stop cause. A duplicate of an active run id is refused and the
    /// active run is left alone.
    pub fn register(
        &mut self,
        run_id: &str,
        kind: RunKind,
        flow: Option<Rc<FlowGate>>,
    ) -> Result<(RunTicket, oneshot::Receiver<StopCause>), DuplicateRun> {
        if self.entries.contains_key(run_id) {
            return Err(DuplicateRun(run_id.to_string()));
        }
        self.last_serial += 1;
        let (tx, rx) = oneshot::channel();
        let early = self
            .early_cancels
            .iter()
            .position(|(id, _)| id == run_id)
            .and_then(|i| self.early_cancels.remove(i));
        let stop = match early {
            // Its cancel came first: stopped from the start.
            Some((_, cause)) => {
                let _ = tx.send(cause);
                None
            }
            None => Some(tx),
        };
        self.entries.insert(
            run_id.to_string(),
            Entry {
                kind,
                serial: self.last_serial,
                stop,
                flow,
                upload: None,
            },
        );
        Ok((
            RunTicket {
                run_id: run_id.to_string(),
                serial: self.last_serial,
            },
            rx,
        ))
    }

    /// Credit from the Edge for run `run_id` (absolute `max_offset`).
    /// False when the run is unknown (finished: late credit is harmless)
    /// or the credit did not grow its window.
    pub fn credit(&self, run_id: &str, max_offset: u64) -> bool {
        self.entries
            .get(run_id)
            .and_then(|entry| entry.flow.as_ref())
            .is_some_and(|flow| flow.on_credit(max_offset))
    }

    /// Gives run `run_id` the sink of its streamed request body.
    pub fn attach_upload(&mut self, run_id: &str, sink: UploadSink) {
        if let Some(entry) = self.entries.get_mut(run_id) {
            entry.upload = Some(sink);
        }
    }

    /// The next piece of run `run_id`'s request body. `Ok` when the run is
    /// unknown (finished: a late piece is dropped) or takes no body; an
    /// error when the Edge broke the upload's rules (a protocol error).
    pub fn upload_piece(&mut self, run_id: &str, data: bytes::Bytes) -> Result<(), UploadError> {
        match self.entries.get_mut(run_id).and_then(|e| e.upload.as_mut()) {
            Some(sink) => sink.on_piece(data),
            None => Ok(()),
        }
    }

    /// Stops that run only (K1). False when unknown or already stopped; an
    /// unknown run is stopped when it registers (see the module docs).
    pub fn cancel(&mut self, run_id: &str, cause: StopCause) -> bool {
        let Some(entry) = self.entries.get_mut(run_id) else {
            if !self.early_cancels.iter().any(|(id, _)| id == run_id) {
                if self.early_cancels.len() >= EARLY_CANCELS {
                    self.early_cancels.pop_front();
                }
                self.early_cancels.push_back((run_id.to_string(), cause));
            }
            return false;
        };
        entry.stop.take().is_some_and(|tx| tx.send(cause).is_ok())
    }

    /// Stops every active run (F5); returns how many were signalled.
    pub fn cancel_all(&mut self, cause: StopCause) -> usize {
        self.entries
            .values_mut()
            .filter_map(|e| e.stop.take())
            .map(|tx| tx.send(cause).is_ok())
            .filter(|&sent| sent)
            .count()
    }

    /// Removes the run of `ticket` once its attempt is released.
    pub fn finish(&mut self, ticket: &RunTicket) {
        if self
            .entries
            .get(&ticket.run_id)
            .is_some_and(|e| e.serial == ticket.serial)
        {
            self.entries.remove(&ticket.run_id);
        }
    }

    /// Whether `run_id` is active.
    pub fn contains(&self, run_id: &str) -> bool {
        self.entries.contains_key(run_id)
    }

    /// Active runs of `kind`.
    pub fn count(&self, kind: RunKind) -> usize {
        self.entries.values().filter(|e| e.kind == kind).count()
    }

    /// All active runs.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no run is active.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // CONTRACT: K1 — a cancel reaches only its run; the entry stays until
    // the attempt is released (W10).
    #[test]
    fn cancel_reaches_only_that_run() {
        let mut t = RunTable::new();
        let (a, mut rx_a) = t.register("a", RunKind::Tunnel, None).unwrap();
        let (_b, mut rx_b) = t.register("b", RunKind::Normalized, None).unwrap();
        assert!(t.cancel("a", StopCause::Cancelled));
        assert!(!t.cancel("a", StopCause::Cancelled), "stopped once");
        assert!(!t.cancel("zzz", StopCause::Cancelled));
        assert_eq!(rx_a.try_recv(), Ok(StopCause::Cancelled));
        assert!(rx_b.try_recv().is_err());
        assert!(t.contains("a"));
        assert_eq!(
            (t.count(RunKind::Tunnel), t.count(RunKind::Normalized)),
            (1, 1)
        );
        t.finish(&a);
        assert!(!t.contains("a"));
        assert_eq!(a.node_ids().node_run_id(), "nrun-1");
        assert_eq!(a.node_ids().attempt_id(), "nrun-1-a1");
    }

    // CONTRACT: F5 — the session's end stops every active run.
    #[test]
    fn session_end_stops_every_run() {
        let mut t = RunTable::new();
        let mut receivers: Vec<_> = ["x", "y", "z"]
            .iter()
            .map(|id| t.register(id, RunKind::Tunnel, None).unwrap().1)
            .collect();
        assert_eq!(t.cancel_all(StopCause::SessionEnded), 3);
        for rx in &mut receivers {
            assert_eq!(rx.try_recv(), Ok(StopCause::SessionEnded));
        }
        assert_eq!(t.cancel_all(StopCause::SessionEnded), 0);
        assert_eq!(t.len(), 3, "entries stay until released (W10)");
    }

    // CONTRACT: U6 — a cancel that overtook its run stops the run as soon
    // as it arrives, before any provider call.
    #[test]
    fn a_cancel_that_arrives_first_stops_the_run_on_arrival() {
        let mut t = RunTable::new();
        assert!(!t.cancel("late", StopCause::Cancelled), "not active yet");
        assert!(!t.cancel("late", StopCause::Cancelled), "kept once");
        let (ticket, mut rx) = t.register("late", RunKind::Tunnel, None).unwrap();
        assert_eq!(rx.try_recv(), Ok(StopCause::Cancelled));
        assert!(t.contains("late"), "the entry lives until release (W10)");
        assert!(!t.cancel("late", StopCause::Cancelled), "already stopped");
        t.finish(&ticket);
        // Used up: a later run with another id is not affected, and the
        // kept cancels are bounded.
        let (_other, mut rx_other) = t.register("other", RunKind::Tunnel, None).unwrap();
        assert!(rx_other.try_recv().is_err());
        for i in 0..=EARLY_CANCELS {
            t.cancel(&format!("gone-{i}"), StopCause::Cancelled);
        }
        assert_eq!(t.early_cancels.len(), EARLY_CANCELS);
        let (_first, mut rx_first) = t.register("gone-0", RunKind::Tunnel, None).unwrap();
        assert!(rx_first.try_recv().is_err(), "the oldest was forgotten");
        let (_last, mut rx_last) = t
            .register(&format!("gone-{EARLY_CANCELS}"), RunKind::Tunnel, None)
            .unwrap();
        assert_eq!(rx_last.try_recv(), Ok(StopCause::Cancelled));
    }

    #[test]
    fn duplicates_are_refused_and_stale_finishes_ignored() {
        let mut t = RunTable::new();
        let (first, _rx) = t.register("r", RunKind::Tunnel, None).unwrap();
        assert_eq!(
            t.register("r", RunKind::Tunnel, None).unwrap_err(),
            DuplicateRun("r".into())
        );
        t.finish(&first);
        let (second, _rx2) = t.register("r", RunKind::Tunnel, None).unwrap();
        t.finish(&first);
        assert!(t.contains("r"), "a stale ticket removes nothing");
        t.finish(&second);
        assert!(t.is_empty());
    }
}
