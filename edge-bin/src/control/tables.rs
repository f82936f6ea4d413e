//! Control's tables, entry by entry: node entries and their owners,
//! provider states and the load order of the candidate indexes, leases,
//! pending requests, models and their lanes, outstanding recovery probes.
//! Plain data; the rooms of `Control` keep them consistent (see
//! `invariants.rs`).

use std::cmp::Ordering;
use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use super::fair::{FairQueue, Share, Tag};
use super::ids::{ConnId, Generation, ProviderKey, RequestId};
use super::outlier::OutlierState;
use super::spec::{ControlModel, ControlNode, ControlProvider, Operation};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OwnerState {
    Pending,
    Ready,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Owner {
    pub(super) conn: ConnId,
    pub(super) generation: Generation,
    pub(super) state: OwnerState,
    /// When its registration was accepted (the generation's start).
    pub(super) registered_at: Option<Instant>,
    /// When it became dispatch-ready.
    pub(super) ready_at: Option<Instant>,
    /// It strips a usage chunk the Edge asked for (`Input::NodeVersion`).
    pub(super) strips_usage_chunk: bool,
    /// It runs embeddings on its Ollama adapters (`Input::NodeVersion`).
    pub(super) runs_embeddings: bool,
    /// It takes streamed tunnel bodies (`Input::NodeVersion`).
    pub(super) accepts_tunnel_body: bool,
    /// It said it is draining (`Input::NodeDraining`): no new dispatch to
    /// it under this generation; what runs there finishes.
    pub(super) draining: bool,
    /// Its connection closed with `Close(drained)` (`Input::Closed`): when
    /// it is fenced, its leases without a response are runs it never
    /// started.
    pub(super) drained: bool,
}

#[derive(Debug)]
pub(super) struct NodeEntry {
    pub(super) spec: ControlNode,
    pub(super) owner: Option<Owner>,
    /// Its providers: a contiguous run of `Control::providers`, which is
    /// in `ProviderKey` (node id first) order.
    pub(super) providers: Range<usize>,
    /// The software version its current owner reported (diagnostic).
    pub(super) version: String,
    /// When its last owner's connection closed, while it has none.
    pub(super) offline_since: Option<Instant>,
    /// In a cluster: the highest etcd revision seen for its owner key (a
    /// claim granted, a put or a delete observed). An owner whose
    /// generation is below it has been superseded or lost (F1, F2).
    pub(super) observed_revision: u64,
    /// Drained by an operator (`Input::SetDrain`): no new dispatch to any
    /// of its providers until undrained; kept across reconnects and
    /// reloads.
    pub(super) drained: bool,
    /// No longer in the configuration (`Input::Reconfigure`): kept only
    /// while its owner runs what it was given, then let go of.
    pub(super) removed: bool,
}

impl NodeEntry {
    pub(super) fn ready_owner(&self) -> Option<Owner> {
        self.owner.filter(|o| o.state == OwnerState::Ready)
    }
}

/// A provider's lease occupancy, ordered by load fraction
/// `in_flight / capacity` (exactly, by cross multiplication), so equal
/// fractions compare equal whatever their terms.
#[derive(Debug, Clone, Copy)]
pub(super) struct Load {
    pub(super) in_flight: u32,
    pub(super) capacity: u32,
}

impl Ord for Load {
    fn cmp(&self, other: &Self) -> Ordering {
        let lhs = u64::from(self.in_flight) * u64::from(other.capacity);
        let rhs = u64::from(other.in_flight) * u64::from(self.capacity);
        lhs.cmp(&rhs)
    }
}

impl PartialOrd for Load {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Load {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Load {}

/// One provider in one model's candidate index: least loaded first, ties
/// to the earlier pool position (the configured order). A position holds
/// one provider, so `(load, position)` is unique within a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Candidate {
    pub(super) load: Load,
    pub(super) position: usize,
    pub(super) provider: usize,
}

/// Where a provider sits in the candidate indexes of its models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Indexed {
    /// The exact occupancy it was filed under (the key to remove it by).
    pub(super) in_flight: u32,
    /// Filed among the candidates for long-context requests too.
    pub(super) long: bool,
}

#[derive(Debug)]
pub(super) struct ProviderState {
    pub(super) key: ProviderKey,
    /// Its key hashed, for `session` routing's rendezvous scores.
    pub(super) key_hash: u64,
    /// Its node (index into `Control::nodes`).
    pub(super) node: usize,
    pub(super) spec: ControlProvider,
    pub(super) in_flight: u32,
    pub(super) long_in_flight: u32,
    /// Highest health observation sequence applied to this binding, and the
    /// generation it belongs to.
    pub(super) last_seq: Option<(Generation, u64)>,
    /// The runtime unavailable overlay, tagged with the generation it
    /// belongs to (H4, H5).
    pub(super) overlay: Option<Generation>,
    /// When the next recovery probe is due, while overlaid or ejected.
    pub(super) next_probe: Option<Instant>,
    /// Passive health.
    pub(super) outlier: OutlierState,
    /// Every lane it is filed in: (lane index, position in the model's
    /// pool).
    pub(super) pools: Vec<(usize, usize)>,
    /// Its entry in those pools' candidate indexes, while it is a
    /// candidate with a free slot.
    pub(super) indexed: Option<Indexed>,
    /// Drained by an operator (`Input::SetDrain`); kept across reloads.
    pub(super) drained: bool,
    /// No longer in the configuration (`Input::Reconfigure`): kept only
    /// while its leases run out, in no pool.
    pub(super) removed: bool,
}

impl ProviderState {
    pub(super) fn reset_health(&mut self) {
        self.overlay = None;
        self.last_seq = None;
    }

    pub(super) fn is_fresh(&self, generation: Generation, seq: u64) -> bool {
        match self.last_seq {
            Some((g, last)) if g == generation => seq > last,
            _ => true,
        }
    }
}

/// An immutable record of one dispatched request's claim on a provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderLease {
    /// The request it serves.
    pub request: RequestId,
    /// The run id the request was dispatched under.
    pub run_id: String,
    /// Provider it occupies.
    pub provider: ProviderKey,
    /// The connection it was dispatched to.
    pub conn: ConnId,
    /// The generation of that connection's ownership.
    pub generation: Generation,
    /// Adapter evidence expected on the terminal (H2).
    pub adapter: Arc<str>,
    /// Target evidence expected on the terminal (H2).
    pub target: Arc<str>,
    /// Whether it holds a long-context slot.
    pub long: bool,
}

/// A live lease and the provider index it occupies.
#[derive(Debug)]
pub(super) struct LeaseEntry {
    pub(super) lease: ProviderLease,
    pub(super) provider: usize,
}

#[derive(Debug, Clone)]
pub(super) enum RequestState {
    Queued {
        deadline: Instant,
    },
    Dispatched {
        run_id: String,
        /// The response-wait deadline, until the response starts (U6).
        response_by: Option<Instant>,
        /// A byte of the response reached the client: never retried.
        committed: bool,
        /// A frame of the response arrived (`Input::Responded`).
        responded: bool,
    },
    CancelPending {
        run_id: String,
        settle_at: Instant,
    },
}

#[derive(Debug, Clone)]
pub(super) struct Pending {
    /// Index into `Control::models`.
    pub(super) model: usize,
    /// What it asks for (its lane follows from it after a reload).
    pub(super) operation: Operation,
    /// Index into `Control::lanes`: where it queues. `None` only for a
    /// dispatched request whose model was removed, or no longer serves its
    /// operation, by a reload: it runs to its end, never queued again.
    pub(super) lane: Option<usize>,
    pub(super) long: bool,
    pub(super) state: RequestState,
    /// Dispatches so far (0 while queued); each has its own run id.
    pub(super) attempts: u32,
    /// Of them, dispatches a draining node never started (`Close(drained)`
    /// before any frame of their response): not attempts.
    pub(super) unstarted: u32,
    /// The providers they went to (indexes into `Control::providers`).
    pub(super) tried: Vec<usize>,
    /// Its response-wait deadline, set at its first dispatch: every
    /// attempt must start its response before it (U6).
    pub(super) response_deadline: Option<Instant>,
    /// What its model's routing policy may use.
    pub(super) hint: super::routing::RouteHint,
    /// Who it is charged to in its lane's queue.
    pub(super) share: Share,
    /// Its class and tag once queued: queued again (after a failed
    /// attempt, or a fenced node), it keeps its place.
    pub(super) place: Option<(u8, Tag)>,
}

impl Pending {
    pub(super) fn new(
        model: usize,
        operation: Operation,
        lane: usize,
        long: bool,
        state: RequestState,
        hint: super::routing::RouteHint,
        share: Share,
    ) -> Self {
        Self {
            model,
            operation,
            lane: Some(lane),
            long,
            state,
            attempts: 0,
            unstarted: 0,
            tried: Vec::new(),
            response_deadline: None,
            hint,
            share,
            place: None,
        }
    }

    /// Attempts that counted: dispatches a provider may have seen
    /// (`max_attempts` bounds them).
    pub(super) fn counted_attempts(&self) -> u32 {
        self.attempts - self.unstarted
    }
}

/// One served model: its spec and its lanes.
#[derive(Debug)]
pub(super) struct ModelState {
    pub(super) spec: ControlModel,
    /// Its lanes (indexes into `Control::lanes`).
    pub(super) lanes: Vec<usize>,
    /// The lane of each operation ([`Operation::ALL`] order); `None` when
    /// no provider of the pool serves it.
    pub(super) lane_of: [Option<usize>; Operation::ALL.len()],
    /// No longer in the configuration (`Input::Reconfigure`): kept, with
    /// an empty pool, only while requests it admitted run out.
    pub(super) removed: bool,
    /// Its routing policy's state.
    pub(super) router: super::routing::Router,
}

/// The candidates and queues of the operations of one model that share
/// one candidate set: a provider is filed in a lane exactly when it serves
/// every operation of the lane. A model whose providers all serve the same
/// operations has one lane; one mixing an Ollama-native provider with
/// OpenAI-compatible ones has two (chat, over all of them; the others,
/// over the OpenAI-compatible ones).
#[derive(Debug)]
pub(super) struct LaneState {
    /// Its model (index into `Control::models`).
    pub(super) model: usize,
    /// Live providers of the lane with a free slot (X6, H4).
    pub(super) free: BTreeSet<Candidate>,
    /// Those of them with a free long-context slot too.
    pub(super) free_long: BTreeSet<Candidate>,
    /// Requests waiting for a slot, in the order they run
    /// ([`super::fair`]).
    pub(super) queued: FairQueue,
    /// Long-context requests waiting for a long slot.
    pub(super) queued_long: FairQueue,
    /// Every provider of the lane (indexes into `Control::providers`), in
    /// pool order.
    pub(super) members: Vec<usize>,
    /// Its operation is embeddings and some members are normalized-run
    /// providers: those are candidates only while their Node's owner runs
    /// embeddings ([`super::Operation::needs_embedding_runs`]).
    pub(super) needs_embedding_runs: bool,
}

impl LaneState {
    pub(super) fn candidates(&self, long: bool) -> &BTreeSet<Candidate> {
        if long {
            &self.free_long
        } else {
            &self.free
        }
    }

    pub(super) fn queue(&mut self, long: bool) -> &mut FairQueue {
        if long {
            &mut self.queued_long
        } else {
            &mut self.queued
        }
    }

    pub(super) fn queued_count(&self) -> usize {
        self.queued.len() + self.queued_long.len()
    }
}

#[derive(Debug, Clone)]
pub(super) struct CommandRecord {
    pub(super) node_id: String,
    pub(super) provider: ProviderKey,
    pub(super) conn: ConnId,
    pub(super) generation: Generation,
}
