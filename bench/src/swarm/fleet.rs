//! What a single-Edge swarm run (`run`) and a cluster run (`cluster`)
//! share: the swarm thread running every simulated node and the probe
//! client, the fleet's certificates, the Edge's announced addresses, and
//! the figures of a phase.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use iop_engine::certs::{DevCa, Validity, DEV_LEAF_VALIDITY_DAYS};
use iop_engine::mailbox::{self, MailboxSender};
use iop_engine::rng::SplitMix64;
use iop_engine::tls::{NodeTlsConnector, Role, TlsMaterial};

use super::client::{run_probes, Probe, ProbeOutcome};
use super::node::{run_node, NodeIdentity, SwarmState};
use super::report::{PhaseFigures, Spread};
use super::topology::{Topology, TRUST_DOMAIN};
use crate::compare::procs::ChildProc;
use crate::compare::run::write_file;
use crate::compare::CompareError;
use crate::stats::LatencyHistogram;

/// Questions to the swarm thread wait at most this long per probe.
const PROBE_WAIT_MS: u64 = 500;

/// Commands for the swarm thread.
pub(super) enum Command {
    /// Start every node (each dials at once).
    Dial,
    /// Send these probes, each to the Edge client listener paired with
    /// it, one at a time, and answer.
    Probe {
        probes: Vec<(SocketAddr, Probe)>,
        reply: mpsc::Sender<Vec<ProbeOutcome>>,
    },
    /// End the thread (its runtime and every connection with it).
    Stop,
}

/// The thread running every simulated node and the probe client.
pub(super) struct SwarmThread {
    commands: MailboxSender<Command>,
    thread: Option<JoinHandle<()>>,
}

impl SwarmThread {
    /// Starts the thread for `nodes`, which dial the node listeners
    /// `edge_nodes` (one per Edge, in Edge order) once told to.
    pub(super) fn start(
        nodes: Vec<NodeIdentity>,
        edge_nodes: Arc<[SocketAddr]>,
        state: Arc<SwarmState>,
        seed: u64,
    ) -> Result<Self, CompareError> {
        let (commands, mut inbox) = mailbox::mailbox::<Command>(16);
        let thread = std::thread::Builder::new()
            .name("swarm".into())
            .spawn(move || {
                let run = iop_engine::rt::block_on(async move {
                    let mut nodes = Some(nodes);
                    let mut seeds = SplitMix64::new(seed);
                    while let Some(command) = inbox.recv().await {
                        match command {
                            Command::Dial => {
                                for node in nodes.take().into_iter().flatten() {
                                    let state = state.clone();
                                    let seed = seeds.next_u64();
                                    let edges = edge_nodes.clone();
                                    monoio::spawn(run_node(node, edges, state, seed));
                                }
                            }
                            Command::Probe { probes, reply } => {
                                let _ = reply.send(run_probes(probes, &state).await);
                            }
                            Command::Stop => break,
                        }
                    }
                });
                if let Err(e) = run {
                    eprintln!("bench swarm: the swarm runtime did not start: {e}");
                }
            })
            .map_err(|source| CompareError::Io {
                what: "start the swarm thread".into(),
                source,
            })?;
        Ok(Self {
            commands,
            thread: Some(thread),
        })
    }

    pub(super) fn send(&self, command: Command) -> Result<(), CompareError> {
        self.commands
            .try_send(command)
            .map_err(|_| CompareError::Swarm("the swarm thread is gone".into()))
    }

    /// Sends `probes` to the Edge whose client listener is `edge`.
    pub(super) fn probe(
        &self,
        edge: SocketAddr,
        probes: Vec<Probe>,
    ) -> Result<Vec<ProbeOutcome>, CompareError> {
        self.probe_each(probes.into_iter().map(|p| (edge, p)).collect())
    }

    /// Sends each probe to the Edge client listener paired with it, in
    /// order; the outcomes are in the same order.
    pub(super) fn probe_each(
        &self,
        probes: Vec<(SocketAddr, Probe)>,
    ) -> Result<Vec<ProbeOutcome>, CompareError> {
        let count = probes.len() as u64;
        let (reply, answer) = mpsc::channel();
        self.send(Command::Probe { probes, reply })?;
        answer
            .recv_timeout(Duration::from_millis(30_000 + count * PROBE_WAIT_MS))
            .map_err(|_| CompareError::Swarm("the probes did not finish".into()))
    }
}

impl Drop for SwarmThread {
    fn drop(&mut self) {
        let _ = self.commands.try_send(Command::Stop);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Mints the CA, one certificate per Edge (written under `dir/certs/`
/// as `<file>.pem` and `<file>-key.pem`, `edges` giving (name, file)) and
/// one certificate per node (kept in memory, one connector per Edge).
pub(super) fn mint_fleet(
    dir: &Path,
    nodes: usize,
    edges: &[(String, String)],
) -> Result<Vec<NodeIdentity>, CompareError> {
    let fail = |what: &str, e: &dyn std::fmt::Display| CompareError::Swarm(format!("{what}: {e}"));
    let validity = Validity::days_from_now(DEV_LEAF_VALIDITY_DAYS);
    let ca = DevCa::new(TRUST_DOMAIN).map_err(|e| fail("mint the CA", &e))?;
    let certs = dir.join("certs");
    std::fs::create_dir_all(&certs).map_err(|source| CompareError::Io {
        what: format!("create {}", certs.display()),
        source,
    })?;
    let ca_pem = ca.cert_pem();
    write_file(&certs.join("ca.pem"), &ca_pem)?;
    for (name, file) in edges {
        let edge = ca
            .issue(Role::Edge, name, validity)
            .map_err(|e| fail("mint an Edge certificate", &e))?;
        write_file(&certs.join(format!("{file}.pem")), &edge.cert_pem)?;
        write_file(&certs.join(format!("{file}-key.pem")), &edge.key_pem)?;
    }
    (0..nodes)
        .map(|index| {
            let id = Topology::node_id(index);
            let issued = ca
                .issue(Role::Node, &id, validity)
                .map_err(|e| fail("mint a node certificate", &e))?;
            let material = TlsMaterial::from_pem(
                ca_pem.as_bytes(),
                issued.cert_pem.as_bytes(),
                issued.key_pem.as_bytes(),
            )
            .map_err(|e| fail("load a node certificate", &e))?;
            let connectors = edges
                .iter()
                .map(|(name, _)| {
                    NodeTlsConnector::new(&material, TRUST_DOMAIN, name)
                        .map_err(|e| fail("build a node connector", &e))
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(NodeIdentity {
                index,
                id,
                connectors,
            })
        })
        .collect()
}

/// The address edge-bin announced as `key` in its `IOP_READY` line.
pub(super) fn parse_addr(proc: &ChildProc, key: &str) -> Result<SocketAddr, CompareError> {
    let text = proc.ready_value(key)?;
    text.parse().map_err(|_| {
        CompareError::Swarm(format!("edge-bin announced {key}={text}, not an address"))
    })
}

/// The figures of a phase that began at `origin_ns` with the Edge
/// listening at `listening_ns`, using `cpu` on the arrival of the `nodes`.
pub(super) fn phase_figures(
    nodes: usize,
    state: &SwarmState,
    origin_ns: u64,
    listening_ns: u64,
    cpu: Cpu,
) -> PhaseFigures {
    let times: Vec<_> = (0..nodes).filter_map(|i| state.ready_times(i)).collect();
    let mut connect = LatencyHistogram::new();
    let mut dials = Vec::with_capacity(times.len());
    let mut last_ready_ns = origin_ns;
    for t in &times {
        connect.record_ns(t.ready_ns.saturating_sub(t.dialled_ns));
        dials.push(t.dialled_ns.saturating_sub(origin_ns));
        last_ready_ns = last_ready_ns.max(t.ready_ns);
    }
    let counters = state.take_counters();
    PhaseFigures {
        all_ready_ms: ms_between(origin_ns, last_ready_ns),
        edge_listening_ms: ms_between(origin_ns, listening_ns),
        ready_dials: Spread::of(&dials),
        connect_to_ready: connect.summary(),
        edge_cpu_ms: cpu.edge_ns as f64 / 1e6,
        edge_cpu_per_node_us: cpu.edge_ns as f64 / 1e3 / nodes.max(1) as f64,
        harness_cpu_ms: cpu.harness_ns as f64 / 1e6,
        attempts: counters.attempts,
        failed_attempts: counters.failed,
    }
}

/// CPU used in a phase by the Edge (all Edges of a cluster) and by this
/// process (the swarm, the orchestrator).
#[derive(Debug, Clone, Copy)]
pub(super) struct Cpu {
    pub(super) edge_ns: u64,
    pub(super) harness_ns: u64,
}

pub(super) fn ms_between(from_ns: u64, to_ns: u64) -> f64 {
    to_ns.saturating_sub(from_ns) as f64 / 1e6
}
