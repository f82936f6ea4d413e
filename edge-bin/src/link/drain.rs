//! The shutdown drain of a shard: the drain and cut-off flags, the count of
//! client requests in flight, and the lifecycle steps (shutdown, force,
//! exit) the control shard sends every shard, with the workers' reports of
//! their drain.

use crate::link::edge::{Edge, CONTROL_SHARD};
use crate::link::shards::{Lifecycle, ShardMsg};

/// A client request in flight ([`Edge::track_request`]); dropping it ends
/// the count.
#[derive(Debug)]
pub struct InFlightRequest<'a> {
    edge: &'a Edge,
}

impl Drop for InFlightRequest<'_> {
    fn drop(&mut self) {
        let count = &self.edge.in_flight_requests;
        count.set(count.get().saturating_sub(1));
        self.edge.request_finished.notify();
    }
}

impl Edge {
    /// Starts the shutdown drain: from now on `/readyz` answers 503 and new
    /// requests on open connections are refused. Never undone.
    pub fn begin_drain(&self) {
        self.draining.set(true);
        // In a cluster, Control lets go of idle nodes from now on.
        if self.control.is_some() {
            self.apply(crate::control::Input::Drain);
        }
    }

    /// Whether the shutdown drain has begun.
    pub fn is_draining(&self) -> bool {
        self.draining.get()
    }

    /// Ends the drain's grace: every request waiting on its provider stops
    /// waiting ([`Edge::cut_off`] completes) and ends as `aborted`.
    pub fn cut_off_requests(&self) {
        self.cut_off.set(true);
        self.cut_off_waiters.wake_all();
    }

    /// Whether [`Edge::cut_off_requests`] was called.
    pub fn is_cut_off(&self) -> bool {
        self.cut_off.get()
    }

    /// Completes once [`Edge::cut_off_requests`] was called.
    pub async fn cut_off(&self) {
        while !self.cut_off.get() {
            self.cut_off_waiters.wait().await;
        }
    }

    /// Counts a client request as in flight until the guard drops.
    pub fn track_request(&self) -> InFlightRequest<'_> {
        self.in_flight_requests
            .set(self.in_flight_requests.get() + 1);
        InFlightRequest { edge: self }
    }

    /// Client requests being answered now.
    pub fn in_flight_requests(&self) -> usize {
        self.in_flight_requests.get()
    }

    /// Completes once no client request is in flight (at once when none
    /// is). One task waits at a time (the drain).
    pub async fn requests_finished(&self) {
        while self.in_flight_requests.get() > 0 {
            self.request_finished.notified().await;
        }
    }

    /// Takes a lifecycle step here and on every other shard (control
    /// shard, on a process signal).
    pub fn step(&self, step: Lifecycle) {
        self.lifecycle.borrow_mut().push(step);
        self.lifecycle_changed.wake_all();
        self.broadcast(step);
    }

    /// Whether this shard has taken `step`.
    pub fn lifecycle_has(&self, step: Lifecycle) -> bool {
        self.lifecycle.borrow().contains(&step)
    }

    /// Sends a lifecycle step to every other shard (control shard).
    pub fn broadcast(&self, step: Lifecycle) {
        if let Some(outbox) = &self.outbox {
            for to in (0..outbox.shards()).filter(|&to| to != self.shard) {
                outbox.send(to, ShardMsg::Lifecycle(step));
            }
        }
    }

    /// Completes once every message this shard sent so far reached its
    /// inbox.
    pub async fn outbox_flushed(&self) {
        if let Some(outbox) = &self.outbox {
            outbox.flushed().await;
        }
    }

    /// Tells the control shard this worker finished draining.
    pub fn report_drained(&self, in_flight: usize) {
        if let Some(outbox) = &self.outbox {
            outbox.send(CONTROL_SHARD, ShardMsg::Drained { in_flight });
        }
    }

    /// Completes once the control shard sent `step` (worker shards).
    pub async fn lifecycle_reached(&self, step: Lifecycle) {
        while !self.lifecycle_has(step) {
            self.lifecycle_changed.wait().await;
        }
    }

    /// Completes once every worker shard reported its drain (control
    /// shard); returns the requests they cut off.
    pub async fn workers_drained(&self) -> usize {
        let workers = self.shard_count().saturating_sub(1);
        loop {
            let (shards, cut_off) = self.drained.get();
            if shards >= workers {
                return cut_off;
            }
            self.lifecycle_changed.wait().await;
        }
    }
}
