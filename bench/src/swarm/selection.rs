//! Control's decisions at fleet scale, measured in process: the Edge's
//! sans-IO `Control` built from the swarm's generated configuration
//! ([`Topology::edge_toml`], parsed by edge-bin's own config loader) and
//! driven through the same inputs the shell feeds it — no sockets, so
//! the figures are the decision cost alone, on one core.
//!
//! - registration: `Register` + `Ready` per node (all N, cold);
//! - admission: a `Submit` to a pooled model (N candidates, all idle) that
//!   dispatches at once, and its `Terminal`;
//! - `poll_timeout`: the shell asks it after every input;
//! - pump: with every provider of a pooled model full and `queued`
//!   requests waiting, a `Terminal` frees one lease and the pump admits
//!   the head of the queue; a `Submit` refills the queue;
//! - snapshot: one `/status` projection of every provider;
//! - fence: `Closed` of a ready node.

use edge_bin::control::RouteHint;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use edge_bin::config::EdgeConfig;
use edge_bin::control::control_spec;
use edge_bin::control::{
    Action, AttemptEnd, ConnId, Control, Input, Operation, ProviderLease, RequestId, Terminal,
};
use iop_engine::clock;
use serde::Serialize;

use super::topology::Topology;

/// How much of each decision to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SelectionSpec {
    /// The fleet.
    pub topology: Topology,
    /// Iterations of the admission, `poll_timeout` and pump loops.
    pub iterations: u32,
    /// Requests waiting in the queue during the pump loop.
    pub queued: u32,
}

/// Nanoseconds per decision (means over the loop).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SelectionFigures {
    /// Nodes configured and made ready.
    pub nodes: usize,
    /// Providers in all.
    pub providers: usize,
    /// Candidates of each pooled model.
    pub pool_size: usize,
    /// Requests queued during the pump loop.
    pub queued: u32,
    /// `Register` + `Ready` of one node.
    pub register_ready_ns: f64,
    /// `Submit` that dispatches at once plus its `Terminal`.
    pub admit_ns: f64,
    /// One `poll_timeout` call.
    pub poll_timeout_ns: f64,
    /// `Terminal` that admits the queue head, plus the refilling `Submit`.
    pub pump_ns: f64,
    /// One `snapshots()` call (every provider).
    pub snapshot_ns: f64,
    /// `Closed` of one ready node (it holds no lease).
    pub fence_ns: f64,
}

/// Why the measurement could not run.
#[derive(Debug, thiserror::Error)]
pub enum SelectionError {
    /// The generated configuration did not load (a harness bug).
    #[error("the generated configuration does not load: {0}")]
    Config(String),
    /// `Control` decided something the loop did not expect.
    #[error("unexpected decision: {0}")]
    Unexpected(String),
}

/// The Control of `topology`, every node registered and ready on
/// connection `i + 1`; returns it with the mean ns per node.
fn ready_control(topology: Topology, max_queue: u32) -> Result<(Control, f64), SelectionError> {
    let text = topology.edge_toml("127.0.0.1:0", "127.0.0.1:0", max_queue);
    let cfg = EdgeConfig::parse(&text, "swarm-edge.toml")
        .map_err(|e| SelectionError::Config(e.to_string()))?;
    let mut control = Control::new(control_spec(&cfg));
    let now = clock::now();
    let mut out = Vec::new();
    let started = clock::monotonic_raw_ns();
    for i in 0..topology.nodes {
        let node_id = Topology::node_id(i);
        let conn = ConnId(i as u64 + 1);
        control.handle(
            now,
            Input::Register {
                conn,
                tls_name: node_id.clone(),
                node_id: node_id.clone(),
            },
            &mut out,
        );
        control.handle(now, Input::Ready { conn, node_id }, &mut out);
    }
    let elapsed = clock::monotonic_raw_ns() - started;
    let ready = control.ready_nodes().len();
    if ready != topology.nodes {
        return Err(SelectionError::Unexpected(format!(
            "{ready} of {} nodes ready",
            topology.nodes
        )));
    }
    Ok((control, per(elapsed, topology.nodes as u64)))
}

fn per(elapsed_ns: u64, count: u64) -> f64 {
    elapsed_ns as f64 / count.max(1) as f64
}

/// The lease of the one dispatch in `out`.
fn dispatched(out: &[Action]) -> Result<ProviderLease, SelectionError> {
    let mut leases = out.iter().filter_map(|a| match a {
        Action::Dispatch(d) => Some(d.lease.clone()),
        _ => None,
    });
    match (leases.next(), leases.next()) {
        (Some(lease), None) => Ok(lease),
        _ => Err(SelectionError::Unexpected(format!(
            "expected exactly one dispatch, got {out:?}"
        ))),
    }
}

/// A short request for `model`, its actions in `out` (cleared first).
fn submit(
    control: &mut Control,
    now: Instant,
    request: RequestId,
    model: &str,
    out: &mut Vec<Action>,
) {
    out.clear();
    let model = model.to_string();
    control.handle(
        now,
        Input::Submit {
            request,
            model,
            operation: Operation::ChatCompletions,
            long: false,
            hint: RouteHint::default(),
            share: edge_bin::control::fair::Share::default(),
        },
        out,
    );
}

fn terminal_of(lease: &ProviderLease) -> Input {
    Input::Terminal(Terminal {
        conn: lease.conn,
        run_id: lease.run_id.clone(),
        adapter: lease.adapter.to_string(),
        target: lease.target.to_string(),
        stall: None,
        end: AttemptEnd::Answered,
        committed: true,
    })
}

/// Runs every loop once and returns the figures.
pub fn measure(spec: SelectionSpec) -> Result<SelectionFigures, SelectionError> {
    let topology = spec.topology;
    let (mut control, register_ready_ns) = ready_control(topology, spec.queued.max(1))?;
    let base = clock::now();
    let mut out = Vec::new();
    let mut next_request = 0u64;
    let mut request = || {
        next_request += 1;
        RequestId(next_request)
    };
    let models: Vec<String> = (0..topology.providers_per_node)
        .map(Topology::pooled_model)
        .collect();
    // The clock moves a little per step, as it does in the shell; queue
    // deadlines stay far ahead.
    let at = |i: u32| base + Duration::from_micros(u64::from(i));

    // Admission with every candidate idle.
    let started = clock::monotonic_raw_ns();
    for i in 0..spec.iterations {
        let model = &models[i as usize % models.len()];
        submit(&mut control, at(i), request(), model, &mut out);
        let lease = dispatched(&out)?;
        out.clear();
        control.handle(at(i), terminal_of(&lease), &mut out);
    }
    let admit_ns = per(
        clock::monotonic_raw_ns() - started,
        u64::from(spec.iterations),
    );

    let started = clock::monotonic_raw_ns();
    let mut earliest: Option<Instant> = None;
    for _ in 0..spec.iterations {
        earliest = std::hint::black_box(control.poll_timeout());
    }
    let poll_timeout_ns = per(
        clock::monotonic_raw_ns() - started,
        u64::from(spec.iterations),
    );
    if earliest.is_some() {
        return Err(SelectionError::Unexpected(format!(
            "an idle Control has a timer due at {earliest:?}"
        )));
    }

    // Fill every candidate of the first pooled model, then queue.
    let model = models[0].clone();
    let full = topology.nodes as u64 * u64::from(topology.capacity);
    let mut leases = VecDeque::with_capacity(full as usize);
    let t0 = at(spec.iterations);
    for _ in 0..full {
        submit(&mut control, t0, request(), &model, &mut out);
        leases.push_back(dispatched(&out)?);
    }
    for _ in 0..spec.queued {
        submit(&mut control, t0, request(), &model, &mut out);
        if !out.is_empty() {
            return Err(SelectionError::Unexpected(format!(
                "a submit to a full pool was not queued: {out:?}"
            )));
        }
    }
    let started = clock::monotonic_raw_ns();
    for _ in 0..spec.iterations {
        let Some(done) = leases.pop_front() else {
            break;
        };
        out.clear();
        control.handle(t0, terminal_of(&done), &mut out);
        leases.push_back(dispatched(&out)?);
        submit(&mut control, t0, request(), &model, &mut out);
    }
    let pump_ns = per(
        clock::monotonic_raw_ns() - started,
        u64::from(spec.iterations),
    );

    let snapshots = 20u32;
    let started = clock::monotonic_raw_ns();
    let mut projected = 0;
    for _ in 0..snapshots {
        projected = std::hint::black_box(control.snapshots()).len();
    }
    let snapshot_ns = per(clock::monotonic_raw_ns() - started, u64::from(snapshots));
    if projected != topology.provider_count() {
        return Err(SelectionError::Unexpected(format!(
            "{projected} snapshots for {} providers",
            topology.provider_count()
        )));
    }

    // Fence every node, each with its leases in flight and the queue
    // re-evaluated against the nodes left.
    let started = clock::monotonic_raw_ns();
    for i in 0..topology.nodes {
        out.clear();
        control.handle(
            t0,
            Input::Closed {
                conn: ConnId(i as u64 + 1),
                drained: false,
            },
            &mut out,
        );
    }
    let fence_ns = per(clock::monotonic_raw_ns() - started, topology.nodes as u64);
    if !control.ready_nodes().is_empty() {
        return Err(SelectionError::Unexpected(
            "nodes still ready after every close".into(),
        ));
    }
    Ok(SelectionFigures {
        nodes: topology.nodes,
        providers: topology.provider_count(),
        pool_size: topology.nodes,
        queued: spec.queued,
        register_ready_ns,
        admit_ns,
        poll_timeout_ns,
        pump_ns,
        snapshot_ns,
        fence_ns,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // Every loop runs its decisions with the outcomes `measure` checks:
    // one dispatch per admission, a queued submit on a full pool, one
    // dispatch per freed lease, every provider projected, every node
    // fenced.
    #[test]
    fn a_small_fleet_runs_every_loop() {
        let figures = measure(SelectionSpec {
            topology: Topology {
                nodes: 3,
                providers_per_node: 2,
                capacity: 2,
            },
            iterations: 50,
            queued: 4,
        })
        .unwrap();
        assert_eq!(
            (
                figures.nodes,
                figures.providers,
                figures.pool_size,
                figures.queued
            ),
            (3, 6, 3, 4)
        );
    }

    // The generated configuration loads through edge-bin's own config, and
    // Control fills a pooled model least-loaded first in pool order, then
    // queues.
    #[test]
    fn the_generated_fleet_dispatches_across_its_pool_in_order() {
        let topology = Topology {
            nodes: 3,
            providers_per_node: 2,
            capacity: 1,
        };
        let (mut control, _) = ready_control(topology, 4).unwrap();
        assert_eq!(control.ready_nodes().len(), 3);
        let now = clock::now();
        let mut taken = Vec::new();
        for id in 1..=4 {
            let mut out = Vec::new();
            let model = Topology::pooled_model(1);
            submit(&mut control, now, RequestId(id), &model, &mut out);
            taken.push(dispatched(&out).ok().map(|l| l.provider.to_string()));
        }
        assert_eq!(
            taken,
            [
                Some("n00000/p1".to_string()),
                Some("n00001/p1".to_string()),
                Some("n00002/p1".to_string()),
                None
            ]
        );
        assert!(control.queue_deadline(RequestId(4)).is_some());
        assert!(control.has_model(&Topology::pinned_model(2)));
    }
}
