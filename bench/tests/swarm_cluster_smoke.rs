//! Smoke test of `bench swarm --cluster 3`: the real binary starts a real
//! etcd and three real edge-bin processes of one cluster, brings up 30
//! simulated nodes that dial all three in a shuffled order, measures
//! forwarding, kills the first Edge and waits for its nodes to re-home.
//! The test checks the report's outcomes, never its speed: the fleet was
//! spread and then entirely on the two survivors, every node of the dead
//! Edge (and only those) moved, etcd dropped the dead Edge's lease, both
//! survivors' `/status` show every node owned by the Edge it is on, every
//! forwarded request was served by its node and counted by its owner, and
//! re-homed nodes serve through their new Edge. Needs the etcd binary
//! (`apt-get install etcd-server`); without it the run fails saying so.

mod common;

use common::*;
use serde_json::Value;

const NODES: u64 = 30;
const PAIRS: u64 = 10;

#[test]
fn the_nodes_of_a_killed_edge_rehome_on_the_others_and_forwarding_serves_every_node() {
    let bins = bin_dir();
    let out_dir = scratch_dir("swarm-cluster");
    let seed = iop_engine::clock::monotonic_raw_ns();
    eprintln!("swarm cluster smoke: seed {seed}");
    let args: Vec<String> = [
        "swarm",
        "--cluster",
        "3",
        "--quick",
        "--nodes",
        &NODES.to_string(),
        "--providers-per-node",
        "1",
        "--probes",
        &(2 * PAIRS).to_string(),
        "--pinned-probes",
        "3",
        "--reconnect-interval-ms",
        "500",
        "--seed",
        &seed.to_string(),
        "--bin-dir",
        &bins.display().to_string(),
        "--out",
        &out_dir.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let (stdout, stderr, ok) = run_bench(&arg_refs);
    assert!(
        ok,
        "bench swarm --cluster failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );

    let report = printed_report(&stdout, &out_dir, "swarm-cluster");
    assert_eq!(report["schema"], "iop-bench-swarm/1");
    assert_eq!(report["options"]["cluster_edges"], 3);
    assert_eq!(report["steps"], Value::Array(Vec::new()));
    assert_eq!(report["selection"], Value::Array(Vec::new()));
    let c = &report["cluster"];
    let context = format!("{c:#}");
    assert_eq!(u64_at(c, "nodes"), NODES, "{context}");

    let edges = c["edges"].as_array().expect("edges");
    let names: Vec<&str> = edges.iter().filter_map(|e| e["name"].as_str()).collect();
    assert_eq!(names, ["edge-a", "edge-b", "edge-c"], "{context}");
    let before: Vec<u64> = edges.iter().map(|e| u64_at(e, "nodes_before")).collect();
    let after: Vec<u64> = edges.iter().map(|e| u64_at(e, "nodes_after")).collect();
    assert_eq!(before.iter().sum::<u64>(), NODES, "{context}");
    assert_eq!(after.iter().sum::<u64>(), NODES, "{context}");
    assert_eq!(c["killed"], "edge-a");
    assert_eq!(after[0], 0, "{context}");
    assert!(after[1] >= before[1] && after[2] >= before[2], "{context}");
    assert_eq!(edges[0]["rehome_cpu_ms"], Value::Null, "{context}");

    let r = &c["rehome"];
    assert_eq!(u64_at(r, "moved"), before[0], "{context}");
    assert_eq!(u64_at(r, "rehomed"), before[0], "{context}");
    assert_eq!(u64_at(r, "disturbed"), 0, "{context}");
    assert!(u64_at(r, "dials") >= before[0], "{context}");
    if before[0] > 0 {
        assert!(f64_at(r, "min_ms") > 0.0, "{context}");
        assert!(f64_at(r, "min_ms") <= f64_at(r, "p50_ms"), "{context}");
        assert!(f64_at(r, "p50_ms") <= f64_at(r, "p99_ms"), "{context}");
        assert_eq!(f64_at(r, "max_ms"), f64_at(r, "all_ready_ms"), "{context}");
    }
    assert!(f64_at(c, "lease_expired_ms") > 0.0, "{context}");

    let ownership = c["ownership"].as_array().expect("ownership");
    let checked: Vec<&str> = ownership
        .iter()
        .filter_map(|o| o["edge"].as_str())
        .collect();
    assert_eq!(checked, ["edge-b", "edge-c"], "{context}");
    for o in ownership {
        assert_eq!(o["live_edges"], serde_json::json!(["edge-b", "edge-c"]));
        assert_eq!(o["lists_killed"], false, "{context}");
        assert_eq!(u64_at(o, "owned"), NODES, "{context}");
        for key in ["by_killed", "by_unlisted", "mismatched", "unowned"] {
            assert_eq!(u64_at(o, key), 0, "{key}: {context}");
        }
    }

    let f = &c["forwarded"];
    assert_eq!(u64_at(f, "pairs"), PAIRS, "{context}");
    assert_eq!(u64_at(f, "pairs_ok"), PAIRS, "{context}");
    assert_eq!(u64_at(f, "peer_requests"), PAIRS, "{context}");
    assert_eq!(
        u64_at(&f["forwarded_dispatch"], "count"),
        PAIRS,
        "{context}"
    );

    let served = c["served_after"].as_array().expect("served_after");
    assert_eq!(served.len() as u64, before[0].min(3), "{context}");
    for p in served {
        assert_eq!(p["served_by"], p["expect_node"], "{context}");
        assert_eq!(p["error"], Value::Null, "{context}");
    }
    let _ = std::fs::remove_dir_all(&out_dir);
}
