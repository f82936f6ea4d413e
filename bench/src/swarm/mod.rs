//! `bench swarm`: one Edge, many Nodes — the fleet-scale figures.
//!
//! ```text
//!   bench (one process)                                  edge-bin (child)
//!   ┌──────────────────────────────────────────┐         ┌──────────────────┐
//!   │ swarm thread (one monoio runtime):        │  mTLS   │                  │
//!   │   N node sessions, one cert each ─────────┼────────►│ node listener    │
//!   │   register → ready → heartbeats,           │  × N    │ Control          │
//!   │   tunnels answered in process             │         │                  │
//!   │   probe client ───────────────────────────┼────────►│ client listener  │
//!   └──────────────────────────────────────────┘  HTTP   └──────────────────┘
//!   orchestrator (main thread): spawns, kills and restarts the Edge,
//!   reads /proc, waits for the swarm, writes the report
//! ```
//!
//! Each simulated node speaks the real protocol over its own mutually
//! authenticated TLS connection with its own certificate from one test CA
//! (minted in process with rcgen), redials under node-bin's own
//! reconnect policy ([`node_bin::supervisor::Supervisor`], jitter
//! included), and answers every tunnel request with a small chat
//! completion naming itself. The Edge configuration listing the N nodes
//! and their providers is generated ([`topology`]). For each fleet size
//! of the ladder the run measures:
//!
//! - Edge RSS per idle node connection;
//! - the time for all N to be dispatch-ready from a cold Edge start (all
//!   nodes dial at once, the worst burst);
//! - the time to recover all N after the Edge is killed (SIGKILL) and
//!   restarted, with the reconnect jitter on and off;
//! - dispatch latency, client request written → `ProviderTunnelRequest`
//!   read by the node, for requests to models pooled over all N nodes;
//! - the Edge's CPU for heartbeats at N idle nodes;
//! - Control's own decision costs at that size, in process
//!   ([`selection`]).
//!
//! With `--cluster N` the run is instead N Edges of one cluster over a
//! real etcd (`cluster`): the fleet (`--nodes`) dials all N, each node in
//! a fresh shuffled order per attempt as node-bin does; once all are
//! ready one Edge is killed (SIGKILL) and the run measures how its nodes
//! re-home on the others (time until all ready again, per-node re-home
//! times), when etcd dropped the dead Edge's lease, and checks on the
//! survivors' `/status` that every node is owned by a live Edge.

pub mod cli;
pub mod client;
mod cluster;
mod fleet;
pub mod node;
pub mod report;
mod run;
pub mod selection;
pub mod topology;

use std::path::PathBuf;

use serde::Serialize;

pub use run::run;

/// Every option of a swarm run, defaults resolved (recorded in the JSON).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SwarmOptions {
    /// Fleet sizes measured, ascending; the last is `--nodes`.
    pub ladder: Vec<usize>,
    /// `--cluster N`: N Edges in one cluster, the fleet (`--nodes`) spread
    /// over them, one killed; `None`: the single Edge.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster_edges: Option<usize>,
    /// Providers per node (= pooled models).
    pub providers_per_node: usize,
    /// Lease capacity of every provider.
    pub capacity: u32,
    /// `--cores` of the Edge.
    pub edge_cores: String,
    /// The swarm nodes' reconnect interval (the mean wait).
    pub reconnect_interval_ms: u64,
    /// Their reconnect jitter (percent of the interval, either side).
    pub jitter_percent: u8,
    /// Dispatch-latency probes per fleet size (to pooled models).
    pub probes: u32,
    /// Requests to the pinned model of a random node per fleet size.
    pub pinned_probes: u32,
    /// Nodes whose pinned model gets one request each (`--pin-node`).
    pub pin_nodes: Vec<usize>,
    /// Idle window of the heartbeat CPU measurement.
    pub heartbeat_window_ms: u64,
    /// Heartbeat interval during that window (test-only override on both
    /// sides).
    pub heartbeat_interval_ms: u64,
    /// Iterations of each in-process Control loop.
    pub selection_iterations: u32,
    /// Requests queued during the pump loop.
    pub selection_queued: u32,
    /// Only the in-process Control measurement: no processes, no sockets.
    pub selection_only: bool,
    /// Seed of the random choices (pinned nodes, probe models, jitter).
    pub seed: u64,
    /// Where edge-bin is.
    pub bin_dir: PathBuf,
    /// Where the JSON report goes.
    pub out_dir: PathBuf,
    /// Keep the temporary directory (configuration, certificates, logs).
    pub keep_temp: bool,
    /// Quick mode (fewer probes, shorter windows).
    pub quick: bool,
}
