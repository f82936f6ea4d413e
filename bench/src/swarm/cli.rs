//! `bench swarm`: arguments, defaults (standard and quick), the run, the
//! tables on stdout and the JSON file.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use argh::FromArgs;

use super::topology::{MAX_CLUSTER_EDGES, MAX_NODES};
use super::SwarmOptions;
use crate::compare::install_stop_handlers;
use crate::load::cli::seconds_to_ms;

/// Fleet sizes measured below `--nodes` without `--ladder`.
pub const DEFAULT_LADDER: [usize; 3] = [10, 100, 1_000];
/// Largest `--providers-per-node`.
pub const MAX_PROVIDERS_PER_NODE: usize = 64;
/// `--nodes` without it.
pub const DEFAULT_NODES: usize = 1_000;
/// `--nodes` without it in a quick `--cluster` run.
pub const QUICK_CLUSTER_NODES: usize = 200;

/// One Edge, up to thousands of Nodes: for each fleet size, N simulated
/// nodes in this process (each its own mTLS connection and certificate)
/// against a real edge-bin. Reports Edge RSS per idle node, the time to
/// all-ready from a cold start and after a SIGKILL + restart (jitter on
/// and off), dispatch latency, the Edge's heartbeat CPU, and Control's
/// decision costs; writes a JSON report. Exits 1 if a fleet did not
/// become ready or a request was not served by the node it was meant for.
/// With --cluster N: N Edges of one cluster over a real etcd, the fleet
/// spread over them; one Edge is killed and the time for its nodes to
/// re-home on the others is measured (swarm-cluster-<ts>.json).
#[derive(FromArgs, Debug, Clone, PartialEq, Default)]
#[argh(subcommand, name = "swarm")]
pub struct SwarmArgs {
    /// largest fleet: nodes the Edge expects and the swarm connects
    /// (default 1000; quick --cluster 200)
    #[argh(option)]
    pub nodes: Option<usize>,
    /// run N Edges (2 to 8) as one cluster over a real etcd instead of one
    /// Edge: the whole fleet comes up spread over them, one Edge is killed
    /// (SIGKILL) and the re-homing of its nodes is measured; needs the etcd
    /// binary (`apt-get install etcd-server`)
    #[argh(option)]
    pub cluster: Option<usize>,
    /// fleet sizes to measure, comma-separated, each at most --nodes
    /// (default: 10,100,1000 below --nodes, then --nodes)
    #[argh(option)]
    pub ladder: Option<String>,
    /// providers per node; model swarm-m<j> pools provider p<j> of every
    /// node (default 4)
    #[argh(option, default = "4")]
    pub providers_per_node: usize,
    /// lease capacity of every provider (default 4)
    #[argh(option, default = "4")]
    pub capacity: u32,
    /// the Edge's --cores (default 0)
    #[argh(option, default = "String::from(\"0\")")]
    pub edge_cores: String,
    /// the nodes' mean reconnect wait in milliseconds (default: node-bin's
    /// 10000; quick 1000)
    #[argh(option)]
    pub reconnect_interval_ms: Option<u64>,
    /// the nodes' reconnect jitter, percent of the interval either side
    /// (default: node-bin's default)
    #[argh(option)]
    pub jitter_percent: Option<u8>,
    /// dispatch-latency requests per fleet size (default 2000; quick 300)
    #[argh(option)]
    pub probes: Option<u32>,
    /// requests to the pinned model of a random node per fleet size
    /// (default 20; quick 5)
    #[argh(option)]
    pub pinned_probes: Option<u32>,
    /// also send one request to node INDEX's pinned model and check that
    /// node served it (repeatable; every fleet size that has the node)
    #[argh(option)]
    pub pin_node: Vec<usize>,
    /// idle window of the heartbeat CPU measurement in seconds (default 5;
    /// quick 2)
    #[argh(option)]
    pub heartbeat_window_s: Option<f64>,
    /// heartbeat interval during that window in milliseconds (test-only
    /// override on both sides; default 1000)
    #[argh(option, default = "1_000")]
    pub heartbeat_interval_ms: u64,
    /// iterations of each in-process Control loop (default 20000; quick
    /// 2000)
    #[argh(option)]
    pub selection_iterations: Option<u32>,
    /// requests queued during Control's pump loop (default 1000; quick 200)
    #[argh(option)]
    pub selection_queued: Option<u32>,
    /// only the in-process Control measurement (no processes, no sockets)
    #[argh(switch)]
    pub selection_only: bool,
    /// seed of the random choices (default: from the clock; printed)
    #[argh(option)]
    pub seed: Option<u64>,
    /// short run: fewer probes, shorter windows
    #[argh(switch)]
    pub quick: bool,
    /// directory holding edge-bin (default: this executable's directory)
    #[argh(option)]
    pub bin_dir: Option<PathBuf>,
    /// directory for the JSON report (default bench/results)
    #[argh(option, default = "PathBuf::from(\"bench/results\")")]
    pub out: PathBuf,
    /// keep the temporary directory (configuration, certificates, logs)
    #[argh(switch)]
    pub keep_temp: bool,
}

impl SwarmArgs {
    /// Resolves defaults and checks the values; `exe` is this binary,
    /// `clock_seed` the seed used without `--seed`.
    pub fn resolve(&self, exe: &Path, clock_seed: u64) -> Result<SwarmOptions, String> {
        let quick = self.quick;
        let nodes = self.nodes.unwrap_or(match self.cluster {
            Some(_) if quick => QUICK_CLUSTER_NODES,
            _ => DEFAULT_NODES,
        });
        if nodes == 0 || nodes > MAX_NODES {
            return Err(format!("--nodes must be between 1 and {MAX_NODES}"));
        }
        if let Some(edges) = self.cluster {
            if !(2..=MAX_CLUSTER_EDGES).contains(&edges) {
                return Err(format!(
                    "--cluster must be between 2 and {MAX_CLUSTER_EDGES} Edges"
                ));
            }
            if self.ladder.is_some() || self.selection_only {
                return Err("--cluster measures one fleet (--nodes): drop --ladder and \
                            --selection-only"
                    .into());
            }
        }
        let ladder = match &self.ladder {
            // A cluster run measures the whole fleet only.
            None if self.cluster.is_some() => vec![nodes],
            None => {
                let mut ladder: Vec<usize> = DEFAULT_LADDER
                    .iter()
                    .copied()
                    .filter(|&n| n < nodes)
                    .collect();
                ladder.push(nodes);
                ladder
            }
            Some(text) => {
                let mut ladder = Vec::new();
                for item in text.split(',') {
                    let n = match item.trim().parse::<usize>() {
                        Ok(n) if n > 0 => n,
                        _ => return Err(format!("--ladder: `{item}` is not a node count")),
                    };
                    if n > nodes {
                        return Err(format!("--ladder: {n} is more than --nodes {nodes}"));
                    }
                    ladder.push(n);
                }
                ladder.sort_unstable();
                ladder.dedup();
                ladder
            }
        };
        if !(1..=MAX_PROVIDERS_PER_NODE).contains(&self.providers_per_node) {
            return Err(format!(
                "--providers-per-node must be between 1 and {MAX_PROVIDERS_PER_NODE}"
            ));
        }
        if self.capacity == 0 {
            return Err("--capacity must be at least 1".into());
        }
        let reconnect_interval_ms = self.reconnect_interval_ms.unwrap_or(if quick {
            1_000
        } else {
            iop_wire::checks::DEFAULT_RECONNECT_INTERVAL_SEC * 1_000
        });
        if reconnect_interval_ms == 0 {
            return Err("--reconnect-interval-ms must be at least 1".into());
        }
        let jitter_percent = self
            .jitter_percent
            .unwrap_or(node_bin::supervisor::Jitter::DEFAULT.percent());
        if node_bin::supervisor::Jitter::new(jitter_percent).is_none() {
            return Err("--jitter-percent must be between 0 and 100".into());
        }
        if let Some(&bad) = self.pin_node.iter().find(|&&i| i >= nodes) {
            return Err(format!(
                "--pin-node {bad}: nodes are numbered 0 to {}",
                nodes - 1
            ));
        }
        let heartbeat_window_ms = seconds_to_ms(
            self.heartbeat_window_s
                .unwrap_or(if quick { 2.0 } else { 5.0 }),
            "--heartbeat-window-s",
        )?;
        if heartbeat_window_ms < 100 {
            return Err("--heartbeat-window-s must be at least 0.1".into());
        }
        if self.heartbeat_interval_ms == 0 || self.heartbeat_interval_ms > heartbeat_window_ms {
            return Err(
                "--heartbeat-interval-ms must be at least 1 and at most the heartbeat window"
                    .into(),
            );
        }
        let selection_iterations =
            self.selection_iterations
                .unwrap_or(if quick { 2_000 } else { 20_000 });
        if selection_iterations == 0 {
            return Err("--selection-iterations must be at least 1".into());
        }
        let exe_dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(SwarmOptions {
            ladder,
            cluster_edges: self.cluster,
            providers_per_node: self.providers_per_node,
            capacity: self.capacity,
            edge_cores: self.edge_cores.clone(),
            reconnect_interval_ms,
            jitter_percent,
            probes: self.probes.unwrap_or(if quick { 300 } else { 2_000 }),
            pinned_probes: self.pinned_probes.unwrap_or(if quick { 5 } else { 20 }),
            pin_nodes: self.pin_node.clone(),
            heartbeat_window_ms,
            heartbeat_interval_ms: self.heartbeat_interval_ms,
            selection_iterations,
            selection_queued: self
                .selection_queued
                .unwrap_or(if quick { 200 } else { 1_000 }),
            selection_only: self.selection_only,
            seed: self.seed.unwrap_or(clock_seed),
            bin_dir: self.bin_dir.clone().unwrap_or(exe_dir),
            out_dir: self.out.clone(),
            keep_temp: self.keep_temp,
            quick,
        })
    }
}

/// Runs `bench swarm`.
pub fn main(args: SwarmArgs) -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            eprintln!("bench swarm: cannot find this executable: {e}");
            return ExitCode::from(1);
        }
    };
    let clock_seed = iop_engine::clock::monotonic_raw_ns();
    let options = match args.resolve(&exe, clock_seed) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("bench swarm: {e}");
            return ExitCode::from(1);
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    install_stop_handlers(&stop);
    let report = match super::run(&options, &stop) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("bench swarm: {e}");
            return ExitCode::from(1);
        }
    };
    print!("{}", super::report::render(&report));
    let kind = if options.cluster_edges.is_some() {
        "swarm-cluster"
    } else {
        "swarm"
    };
    let path = options
        .out_dir
        .join(format!("{kind}-{}.json", report.created_unix_ms / 1000));
    let written = std::fs::create_dir_all(&options.out_dir).and_then(|()| {
        let text = serde_json::to_string_pretty(&report).map_err(std::io::Error::other)?;
        std::fs::write(&path, text + "\n")
    });
    if let Err(e) = written {
        eprintln!("bench swarm: cannot write {}: {e}", path.display());
        return ExitCode::from(1);
    }
    println!("JSON report: {}", path.display());
    let problems = report.problems();
    if !problems.is_empty() {
        for p in &problems {
            eprintln!("bench swarm: {p}");
        }
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> SwarmArgs {
        SwarmArgs {
            providers_per_node: 4,
            capacity: 4,
            edge_cores: "0".into(),
            heartbeat_interval_ms: 1_000,
            out: "bench/results".into(),
            ..Default::default()
        }
    }

    fn resolve(args: SwarmArgs) -> Result<SwarmOptions, String> {
        args.resolve(Path::new("/t/release/bench"), 7)
    }

    #[test]
    fn standard_and_quick_defaults() {
        let o = resolve(base()).unwrap();
        assert_eq!(o.ladder, vec![10, 100, 1_000]);
        assert_eq!((o.probes, o.pinned_probes), (2_000, 20));
        assert_eq!(
            (o.heartbeat_window_ms, o.heartbeat_interval_ms),
            (5_000, 1_000)
        );
        assert_eq!(
            (o.selection_iterations, o.selection_queued),
            (20_000, 1_000)
        );
        assert_eq!(o.jitter_percent, 50);
        assert_eq!(o.reconnect_interval_ms, 10_000);
        assert_eq!(o.seed, 7);
        assert_eq!(o.bin_dir, PathBuf::from("/t/release"));
        assert_eq!(o.cluster_edges, None);
        let o = resolve(SwarmArgs {
            quick: true,
            nodes: Some(100),
            seed: Some(3),
            ..base()
        })
        .unwrap();
        assert_eq!(o.ladder, vec![10, 100]);
        assert_eq!(
            (o.probes, o.pinned_probes, o.heartbeat_window_ms),
            (300, 5, 2_000)
        );
        assert_eq!(o.seed, 3);
        let o = resolve(SwarmArgs {
            nodes: Some(5_000),
            ..base()
        })
        .unwrap();
        assert_eq!(o.ladder, vec![10, 100, 1_000, 5_000]);
        let o = resolve(SwarmArgs {
            nodes: Some(100),
            ladder: Some("100, 7,100".into()),
            ..base()
        })
        .unwrap();
        assert_eq!(o.ladder, vec![7, 100]);
    }

    #[test]
    fn a_cluster_run_measures_one_fleet_of_1000_or_200_quick() {
        let o = resolve(SwarmArgs {
            cluster: Some(3),
            ..base()
        })
        .unwrap();
        assert_eq!((o.cluster_edges, o.ladder.clone()), (Some(3), vec![1_000]));
        assert_eq!(o.reconnect_interval_ms, 10_000);
        let o = resolve(SwarmArgs {
            cluster: Some(2),
            quick: true,
            ..base()
        })
        .unwrap();
        assert_eq!((o.cluster_edges, o.ladder.clone()), (Some(2), vec![200]));
        assert_eq!(o.reconnect_interval_ms, 1_000);
        let o = resolve(SwarmArgs {
            cluster: Some(8),
            quick: true,
            nodes: Some(50),
            ..base()
        })
        .unwrap();
        assert_eq!((o.cluster_edges, o.ladder), (Some(8), vec![50]));
    }

    #[test]
    fn bad_options_are_refused() {
        let refuse = |a: SwarmArgs| resolve(a).unwrap_err();
        assert_eq!(
            refuse(SwarmArgs {
                nodes: Some(0),
                ..base()
            }),
            "--nodes must be between 1 and 99999"
        );
        for edges in [0, 1, 9] {
            assert_eq!(
                refuse(SwarmArgs {
                    cluster: Some(edges),
                    ..base()
                }),
                "--cluster must be between 2 and 8 Edges"
            );
        }
        assert_eq!(
            refuse(SwarmArgs {
                cluster: Some(3),
                ladder: Some("10".into()),
                ..base()
            }),
            "--cluster measures one fleet (--nodes): drop --ladder and --selection-only"
        );
        assert_eq!(
            refuse(SwarmArgs {
                nodes: Some(10),
                ladder: Some("5,20".into()),
                ..base()
            }),
            "--ladder: 20 is more than --nodes 10"
        );
        assert_eq!(
            refuse(SwarmArgs {
                ladder: Some("10,x".into()),
                ..base()
            }),
            "--ladder: `x` is not a node count"
        );
        assert_eq!(
            refuse(SwarmArgs {
                jitter_percent: Some(101),
                ..base()
            }),
            "--jitter-percent must be between 0 and 100"
        );
        assert_eq!(
            refuse(SwarmArgs {
                nodes: Some(10),
                pin_node: vec![3, 10],
                ..base()
            }),
            "--pin-node 10: nodes are numbered 0 to 9"
        );
        assert_eq!(
            refuse(SwarmArgs {
                providers_per_node: 0,
                ..base()
            }),
            "--providers-per-node must be between 1 and 64"
        );
        assert_eq!(
            refuse(SwarmArgs {
                heartbeat_interval_ms: 9_000,
                ..base()
            }),
            "--heartbeat-interval-ms must be at least 1 and at most the heartbeat window"
        );
    }
}
