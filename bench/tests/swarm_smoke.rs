//! Smoke test of `bench swarm`: the real binary brings up 100 simulated
//! nodes — each its own mutually authenticated TLS connection with its
//! own certificate from one test CA — against a real edge-bin, kills and
//! restarts the Edge twice, and writes its report. The test checks that
//! every node became ready in every phase (the swarm's own count and the
//! Edge's `/status`), that a request for the model pinned to a node
//! chosen at random was served by exactly that node, that every pooled
//! probe was served, and that with the jitter on the redials after the
//! restart spread over the jitter window. It never judges speed.

mod common;

use common::*;
use serde_json::Value;

const NODES: u64 = 100;
const PROVIDERS_PER_NODE: u64 = 2;
const PROBES: u64 = 40;
const RECONNECT_INTERVAL_MS: f64 = 1_000.0;

#[test]
fn a_hundred_node_swarm_becomes_ready_and_serves_a_node_chosen_at_random() {
    let bins = bin_dir();
    let out_dir = scratch_dir("swarm");
    let seed = iop_engine::clock::monotonic_raw_ns();
    let pinned = seed % NODES;
    let pinned_id = format!("n{pinned:05}");
    eprintln!("swarm smoke: node chosen at random: {pinned_id} (seed {seed})");
    let args: Vec<String> = [
        "swarm",
        "--nodes",
        &NODES.to_string(),
        "--quick",
        "--providers-per-node",
        &PROVIDERS_PER_NODE.to_string(),
        "--probes",
        &PROBES.to_string(),
        "--pinned-probes",
        "3",
        "--pin-node",
        &pinned.to_string(),
        "--heartbeat-window-s",
        "1",
        "--selection-iterations",
        "200",
        "--selection-queued",
        "20",
        "--reconnect-interval-ms",
        "1000",
        "--jitter-percent",
        "50",
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
        "bench swarm failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );

    let report = printed_report(&stdout, &out_dir, "swarm");
    assert_eq!(report["schema"], "iop-bench-swarm/1");
    let ladder: Vec<u64> = report["options"]["ladder"]
        .as_array()
        .expect("ladder")
        .iter()
        .map(|v| v.as_u64().expect("size"))
        .collect();
    assert_eq!(ladder, [10, NODES]);
    let steps = report["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), 2);
    let step = &steps[1];
    assert_eq!(u64_at(step, "nodes"), NODES);
    let providers = NODES * PROVIDERS_PER_NODE;
    assert_eq!(u64_at(step, "providers"), providers);

    // Every node ready: in the Edge's view after the cold start, and in
    // every phase every node had a ready session (one dial→ready each).
    assert_eq!(u64_at(step, "status_providers"), providers);
    assert_eq!(u64_at(step, "status_connected_providers"), providers);
    for phase in ["cold", "recovery_jitter", "recovery_no_jitter"] {
        assert_eq!(
            u64_at(&step[phase]["connect_to_ready"], "count"),
            NODES,
            "{phase}: {}",
            step[phase]
        );
        assert!(f64_at(&step[phase], "all_ready_ms") > 0.0, "{phase}");
    }

    // The request for the chosen node's pinned model was served by it.
    let pinned_probes = step["pinned"].as_array().expect("pinned probes");
    let chosen: Vec<&Value> = pinned_probes
        .iter()
        .filter(|p| p["model"] == format!("swarm-{pinned_id}").as_str())
        .collect();
    assert!(
        !chosen.is_empty(),
        "no probe for {pinned_id}: {pinned_probes:?}"
    );
    for p in chosen {
        assert_eq!(p["expect_node"], pinned_id.as_str());
        assert_eq!(p["served_by"], pinned_id.as_str(), "{p}");
        assert!(p["error"].is_null(), "{p}");
    }
    // The other pinned probes (random nodes of the harness's own) too.
    assert_eq!(pinned_probes.len(), 4);
    for p in pinned_probes {
        assert_eq!(p["served_by"], p["expect_node"], "{p}");
    }
    assert_eq!(u64_at(step, "probes_ok"), PROBES);
    assert_eq!(u64_at(step, "probes_failed"), 0);
    assert_eq!(u64_at(&step["dispatch"], "count"), PROBES);

    // With ±50 % jitter the successful redials after the SIGKILL spread
    // over (most of) the 500–1500 ms window; 100 uniform draws span about
    // 980 ms, and a loaded machine can only delay dials, not bunch them.
    let dials = &step["recovery_jitter"]["ready_dials"];
    let spread = f64_at(dials, "max_ms") - f64_at(dials, "min_ms");
    assert!(
        spread >= 0.4 * RECONNECT_INTERVAL_MS,
        "redials after the restart spread over only {spread} ms: {dials}"
    );
    assert!(
        f64_at(dials, "min_ms") >= 0.5 * RECONNECT_INTERVAL_MS - 1.0,
        "{dials}"
    );

    let selection = report["selection"].as_array().expect("selection");
    assert_eq!(selection.len(), 2);
    assert_eq!(u64_at(&selection[1], "nodes"), NODES);
    assert_eq!(u64_at(&selection[1], "providers"), providers);

    // The table names every fleet size.
    assert!(stdout.contains("Control decisions"), "{stdout}");
    assert!(
        stdout.contains(&format!(
            "{NODES} nodes: {PROBES} pooled probes ok (0 failed)"
        )),
        "{stdout}"
    );
    let _ = std::fs::remove_dir_all(&out_dir);
}
