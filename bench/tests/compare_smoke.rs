//! Smoke test of `bench compare`: the real binary starts the real mock
//! provider, edge-bin and node-bin (from the same target directory), runs
//! the shortest comparison at two concurrency levels, with a second mock
//! provider standing in for the peer proxy (arm C) whose process is
//! sampled, and writes its JSON report. The test checks that the report is
//! complete and consistent — every section present, counts above zero, no
//! error on the direct path, per-round deltas and ratios equal to B − A and
//! B / A of the reported window figures, the peer's CPU the sum of its
//! windows', each goal's ratio IOP ÷ peer of the figures it names — and
//! never judges the numbers themselves.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use common::*;
use serde_json::Value;

const FIGURES: [&str; 5] = [
    "ttft_p50_us",
    "ttft_p99_us",
    "chunk_latency_p50_us",
    "chunk_latency_p99_us",
    "inter_chunk_gap_p99_us",
];
const RATIOS: [&str; 5] = [
    "ttft_p50",
    "ttft_p99",
    "chunk_latency_p50",
    "chunk_latency_p99",
    "inter_chunk_gap_p99",
];

/// A mock provider serving `mock-model`, the stand-in for a peer proxy;
/// killed when dropped.
struct PeerMock {
    child: Child,
    url: String,
}

impl PeerMock {
    fn start() -> PeerMock {
        let mut child = Command::new(env!("CARGO_BIN_EXE_bench"))
            .args([
                "mock-provider",
                "--port",
                "0",
                "--tokens",
                "25",
                "--inter-token-ms",
                "20",
                "--model-list",
                "mock-model",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the peer mock");
        let mut line = String::new();
        let stdout = child.stdout.take().expect("piped stdout");
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the ready line");
        let addr = line
            .split_whitespace()
            .find_map(|f| f.strip_prefix("addr="))
            .unwrap_or_else(|| panic!("no addr= in {line:?}"))
            .to_string();
        PeerMock {
            child,
            url: format!("http://{addr}"),
        }
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }
}

impl Drop for PeerMock {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn goal<'a>(level: &'a Value, id: &str) -> &'a Value {
    level["goals"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["goal"] == id)
        .unwrap_or_else(|| panic!("no goal {id} in {}", level["goals"]))
}

#[test]
fn quick_compare_writes_a_complete_consistent_report() {
    let bins = bin_dir();
    let out_dir = scratch_dir("compare");
    let peer = PeerMock::start();
    let peer_pid = peer.pid();
    let (stdout, stderr, ok) = run_bench(&[
        "compare",
        "--quick",
        "--windows",
        "2",
        "--window-s",
        "1",
        "--concurrency",
        "2,16",
        "--peer",
        &peer.url,
        "--peer-pid",
        &peer_pid,
        "--peer-name",
        "mock2",
        "--bin-dir",
        bins.to_str().expect("utf-8 path"),
        "--out",
        out_dir.to_str().expect("utf-8 path"),
    ]);
    assert!(
        ok,
        "bench compare failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );

    // The table went to stdout, the path of the JSON last.
    assert!(stdout.contains("median of windows"), "{stdout}");
    assert!(stdout.contains("\n== 2 streams ==\n"), "{stdout}");
    assert!(stdout.contains("\n== 16 streams ==\n"), "{stdout}");
    assert!(stdout.contains("IOP ÷ mock2"), "{stdout}");
    assert!(stdout.contains("CPU per mock2 token: "), "{stdout}");
    let report = printed_report(&stdout, &out_dir, "compare");

    assert_eq!(report["schema"], "iop-bench-compare/2");
    for section in [
        "created_unix_ms",
        "machine",
        "nofile",
        "commit",
        "options",
        "arms",
        "peer_name",
        "peer_processes",
        "levels",
        "ladder",
        "notes",
    ] {
        assert!(report.get(section).is_some(), "missing section {section}");
    }
    let machine = &report["machine"];
    assert!(u64_at(machine, "nproc") > 0);
    assert!(!machine["kernel"].as_str().unwrap().is_empty());
    assert!(!machine["cpu_model"].as_str().unwrap().is_empty());
    assert_eq!(report["options"]["windows"], 2);
    assert_eq!(report["options"]["window_ms"], 1000);
    assert_eq!(report["options"]["quick"], true);
    assert_eq!(report["options"]["concurrency"], serde_json::json!([2, 16]));
    assert_eq!(report["peer_name"], "mock2");
    let arms: Vec<&str> = report["arms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["arm"].as_str().unwrap())
        .collect();
    assert_eq!(arms, ["A", "B", "C"]);
    // The peer's process, named by its command line.
    let procs = report["peer_processes"].as_array().unwrap();
    assert_eq!(procs.len(), 1);
    assert_eq!(procs[0]["pid"].to_string(), peer_pid);
    assert!(
        procs[0]["command"]
            .as_str()
            .unwrap()
            .contains("mock-provider"),
        "{}",
        procs[0]
    );

    let levels = report["levels"].as_array().unwrap();
    let streams: Vec<u64> = levels
        .iter()
        .map(|l| l["streams"].as_u64().unwrap())
        .collect();
    assert_eq!(streams, [2, 16]);
    for (index, level) in levels.iter().enumerate() {
        check_level(level, index == levels.len() - 1);
    }

    // The quick ladder: both arms list 64 and 128, and the highest passing
    // level is the last pass before the first failure.
    let ladder = &report["ladder"];
    assert_eq!(ladder["inter_token_ms"], 20);
    assert_eq!(ladder["gap_limit_ms"], 40);
    for arm in ["direct", "relayed"] {
        let levels = ladder[arm]["levels"].as_array().unwrap();
        let streams: Vec<u64> = levels
            .iter()
            .map(|l| l["streams"].as_u64().unwrap())
            .collect();
        assert_eq!(streams, [64, 128], "{arm}");
        let mut highest = Value::Null;
        let mut stopped = false;
        for level in levels {
            let outcome = level["outcome"].as_str().unwrap();
            if stopped {
                assert_eq!(outcome, "skipped", "{arm}: {level}");
                continue;
            }
            match outcome {
                "pass" => {
                    highest = level["streams"].clone();
                    assert_eq!(level["summary"]["requests_ok"], level["streams"]);
                }
                "fail" | "impossible" => {
                    stopped = true;
                    assert!(!level["reasons"].as_array().unwrap().is_empty());
                }
                other => panic!("{arm}: unexpected outcome {other}"),
            }
        }
        assert_eq!(ladder[arm]["highest_passing"], highest, "{arm}");
    }

    let _ = std::fs::remove_dir_all(&out_dir);
}

/// A ratio goal's ratio and verdict: `iop / peer ≤ max_ratio`, or n/a when
/// the peer's figure is `floor` or less.
fn check_ratio(g: &Value, iop: f64, peer: f64, floor: f64) {
    if peer > floor {
        let ratio = f64_at(g, "ratio");
        assert!(close(ratio, iop / peer), "{g}");
        assert_eq!(g["met"], ratio <= f64_at(g, "max_ratio"), "{g}");
        assert!(g["why_not"].is_null(), "{g}");
    } else {
        assert!(g["ratio"].is_null() && g["met"].is_null(), "{g}");
        assert!(g["why_not"].as_str().unwrap().starts_with("n/a"), "{g}");
    }
}

/// One level: its windows, rounds, medians, costs and goals.
fn check_level(level: &Value, highest: bool) {
    // Two rounds of one direct, one relayed and one peer window each.
    let windows = level["windows"].as_array().unwrap();
    assert_eq!(windows.len(), 6);
    let window = |round: u64, arm: &str| -> &Value {
        let found: Vec<&Value> = windows
            .iter()
            .filter(|w| w["round"] == round && w["arm"] == arm)
            .collect();
        assert_eq!(found.len(), 1, "round {round} arm {arm}");
        found[0]
    };
    for w in windows {
        let s = &w["summary"];
        assert!(u64_at(s, "requests_ok") > 0, "{w}");
        assert!(u64_at(s, "content_chunks") > 0, "{w}");
        assert_eq!(u64_at(s, "unstamped_chunks"), 0, "{w}");
        for dist in ["ttft", "chunk_latency", "inter_chunk_gap", "end_to_end"] {
            assert!(u64_at(&s[dist], "count") > 0, "{dist} of {w}");
        }
        // Every stamped chunk has a latency; the headline is the summary's.
        assert_eq!(s["chunk_latency"]["count"], s["content_chunks"]);
        assert_eq!(w["headline"]["ttft_p50_us"], s["ttft"]["p50_us"]);
        assert_eq!(
            w["headline"]["chunk_latency_p99_us"],
            s["chunk_latency"]["p99_us"]
        );
        assert_eq!(
            w["headline"]["inter_chunk_gap_p99_us"],
            s["inter_chunk_gap"]["p99_us"]
        );
        if w["arm"] != "B" {
            assert_eq!(u64_at(s, "errors_total"), 0, "window had errors: {w}");
            assert_eq!(u64_at(s, "truncated"), 0, "window truncated: {w}");
        }
        if w["arm"] == "B" {
            // Relayed windows: CPU of both relay processes and a memory
            // sample were taken.
            assert!(w["cpu"]["edge_us"].is_u64(), "{w}");
            assert!(w["cpu"]["node_us"].is_u64(), "{w}");
            assert!(w["rss"]["edge_kib"].as_u64().unwrap() > 0, "{w}");
        }
        if w["arm"] == "C" {
            // Peer windows: the peer's process was sampled.
            assert!(w["cpu"]["peer_us"].is_u64(), "{w}");
            assert!(u64_at(&w["peer_rss"], "kib") > 0, "{w}");
            assert!(w["peer_not_sampled"].is_null(), "{w}");
        } else {
            assert!(w["cpu"]["peer_us"].is_null(), "{w}");
            assert!(w["peer_rss"].is_null(), "{w}");
        }
    }

    // Per-round deltas and ratios are B − A and B / A of the windows.
    let rounds = level["rounds"].as_array().unwrap();
    assert_eq!(rounds.len(), 2);
    let mut deltas: Vec<Vec<f64>> = vec![Vec::new(); 5];
    let mut peer_deltas: Vec<Vec<f64>> = vec![Vec::new(); 5];
    for (r, round) in rounds.iter().enumerate() {
        assert_eq!(round["round"], r as u64);
        let order: Vec<&str> = round["order"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert_eq!(
            order,
            if r == 0 {
                ["A", "B", "C"]
            } else {
                ["C", "B", "A"]
            }
        );
        let a = &window(r as u64, "A")["headline"];
        let b = &window(r as u64, "B")["headline"];
        let c = &window(r as u64, "C")["headline"];
        for (i, (figure, ratio)) in FIGURES.iter().zip(RATIOS).enumerate() {
            let (av, bv) = (f64_at(a, figure), f64_at(b, figure));
            let c_delta = f64_at(&round["peer_minus_direct"], figure);
            let cv = f64_at(c, figure);
            assert!(close(c_delta, cv - av), "round {r} {figure}: peer");
            peer_deltas[i].push(c_delta);
            let delta = f64_at(&round["relayed_minus_direct"], figure);
            assert!(
                close(delta, bv - av),
                "round {r} {figure}: {delta} != {bv} - {av}"
            );
            deltas[i].push(delta);
            let reported = &round["relayed_over_direct"][ratio];
            if av > 0.0 {
                let q = reported.as_f64().unwrap();
                assert!(close(q, bv / av), "round {r} {ratio}: {q} != {bv} / {av}");
            } else {
                assert!(reported.is_null());
            }
        }
    }
    // The summary's added latency is the median of the round deltas.
    let summary = &level["summary"];
    for (i, figure) in FIGURES.iter().enumerate() {
        let added = f64_at(&summary["relayed_added"], figure);
        assert!(close(added, median(deltas[i].clone())), "{figure}");
        let peer_added = f64_at(&summary["peer_added"], figure);
        assert!(
            close(peer_added, median(peer_deltas[i].clone())),
            "{figure}"
        );
    }
    assert_eq!(summary["direct_totals"]["errors"], 0);
    assert_eq!(summary["direct_totals"]["windows"], 2);
    assert_eq!(summary["relayed_totals"]["windows"], 2);
    assert_eq!(summary["peer_totals"]["windows"], 2);
    // No status other than 200 (no 429 or 503 at either level).
    for arm in ["direct_totals", "relayed_totals", "peer_totals"] {
        assert_eq!(
            summary[arm]["http_status_codes"],
            serde_json::json!({}),
            "{arm}"
        );
    }

    // CPU per relayed token divides the relayed windows' CPU by their tokens.
    let cpu = &level["cpu"];
    let relayed_tokens: u64 = windows
        .iter()
        .filter(|w| w["arm"] == "B")
        .map(|w| u64_at(&w["summary"], "content_chunks"))
        .sum();
    assert_eq!(u64_at(cpu, "tokens_relayed"), relayed_tokens);
    assert!(u64_at(cpu, "clock_ticks_per_s") > 0);
    let edge_us = u64_at(cpu, "edge_cpu_us") as f64;
    let node_us = u64_at(cpu, "node_cpu_us") as f64;
    let per_token = f64_at(cpu, "relay_us_per_token");
    assert!(close(
        per_token,
        (edge_us + node_us) / relayed_tokens as f64
    ));

    // Memory: an idle sample and one per relayed window.
    let rss = &level["rss"];
    assert!(u64_at(&rss["idle"], "edge_kib") > 0);
    assert!(u64_at(&rss["idle"], "node_kib") > 0);
    assert_eq!(rss["window_samples"].as_array().unwrap().len(), 2);
    assert!(rss["bytes_per_stream"].is_f64());
    // The ladder's memory sample joins the highest level only.
    if !highest {
        assert!(rss["ladder_sample"].is_null());
    }

    // The peer's CPU is the sum of its windows', per token it carried.
    let peer = &level["peer"];
    let peer_windows = windows.iter().filter(|w| w["arm"] == "C");
    let peer_tokens: u64 = peer_windows
        .clone()
        .map(|w| u64_at(&w["summary"], "content_chunks"))
        .sum();
    let peer_cpu: u64 = peer_windows.map(|w| u64_at(&w["cpu"], "peer_us")).sum();
    assert_eq!(u64_at(peer, "tokens"), peer_tokens);
    assert_eq!(u64_at(peer, "cpu_us"), peer_cpu);
    assert!(close(
        f64_at(peer, "us_per_token"),
        peer_cpu as f64 / peer_tokens as f64
    ));
    assert!(u64_at(peer, "idle_kib") > 0);
    assert_eq!(peer["window_samples"].as_array().unwrap().len(), 2);
    assert!(peer["bytes_per_stream"].is_f64());
    assert_eq!(peer["not_sampled"], serde_json::json!([]));

    // Goals: the latency ratios at every level, CPU and memory at the
    // highest; each ratio is IOP's figure over the peer's.
    let ids: Vec<&str> = level["goals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["goal"].as_str().unwrap())
        .collect();
    let mut expected = vec![
        "added_ttft_p50",
        "added_ttft_p99",
        "added_chunk_latency_p99",
    ];
    if highest {
        expected.extend(["cpu_per_token", "rss_per_stream"]);
    }
    assert_eq!(ids, expected);
    for (id, figure) in [
        ("added_ttft_p50", "ttft_p50_us"),
        ("added_ttft_p99", "ttft_p99_us"),
        ("added_chunk_latency_p99", "chunk_latency_p99_us"),
    ] {
        let g = goal(level, id);
        let iop = f64_at(&summary["relayed_added"], figure);
        let peer = f64_at(&summary["peer_added"], figure);
        assert_eq!(f64_at(g, "iop"), iop, "{g}");
        assert_eq!(f64_at(g, "peer"), peer, "{g}");
        assert_eq!(f64_at(g, "max_ratio"), 1.5);
        check_ratio(g, iop, peer, 10.0);
    }
    if highest {
        let g = goal(level, "cpu_per_token");
        let iop = f64_at(cpu, "relay_us_per_token");
        assert_eq!(f64_at(g, "iop"), iop, "{g}");
        assert_eq!(f64_at(g, "peer"), f64_at(peer, "us_per_token"), "{g}");
        assert_eq!(f64_at(g, "max_ratio"), 1.2);
        if g["ratio"].is_null() {
            assert!(g["met"].is_null() && g["why_not"].is_string(), "{g}");
        } else {
            check_ratio(g, iop, f64_at(peer, "us_per_token"), 0.0);
        }
        let g = goal(level, "rss_per_stream");
        let bytes = f64_at(rss, "bytes_per_stream");
        assert_eq!(f64_at(g, "iop"), bytes);
        assert_eq!(f64_at(g, "peer"), f64_at(peer, "bytes_per_stream"));
        assert_eq!(f64_at(g, "max_value"), 12288.0);
        assert_eq!(g["met"], bytes <= 12288.0);
    }
}

#[test]
fn a_peer_pid_that_is_gone_is_reported_not_sampled() {
    let bins = bin_dir();
    let out_dir = scratch_dir("compare-gone");
    let peer = PeerMock::start();
    // A process that has exited and been waited for: its PID is gone.
    let mut exited = Command::new("true").spawn().expect("spawn true");
    exited.wait().expect("wait for true");
    let gone = exited.id().to_string();
    let (stdout, stderr, ok) = run_bench(&[
        "compare",
        "--quick",
        "--windows",
        "2",
        "--window-s",
        "0.5",
        "--warmup-s",
        "0.2",
        "--concurrency",
        "2",
        "--ladder",
        "none",
        "--peer",
        &peer.url,
        "--peer-pid",
        &peer.pid(),
        "--peer-pid",
        &gone,
        "--bin-dir",
        bins.to_str().expect("utf-8 path"),
        "--out",
        out_dir.to_str().expect("utf-8 path"),
    ]);
    assert!(
        ok,
        "bench compare failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stdout.contains(&format!("{gone} (not running)")),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!(
            "CPU per peer token: not sampled (idle: PID {gone}: cannot read /proc/{gone}/status"
        )),
        "{stdout}"
    );
    let report = printed_report(&stdout, &out_dir, "compare");
    let procs = report["peer_processes"].as_array().unwrap();
    assert_eq!(procs[1]["pid"].to_string(), gone);
    assert!(procs[1]["command"].is_null());
    let level = &report["levels"][0];
    let peer_cost = &level["peer"];
    assert!(peer_cost["cpu_us"].is_null(), "{peer_cost}");
    assert!(peer_cost["us_per_token"].is_null(), "{peer_cost}");
    assert!(peer_cost["idle_kib"].is_null(), "{peer_cost}");
    assert!(peer_cost["bytes_per_stream"].is_null(), "{peer_cost}");
    let reasons = peer_cost["not_sampled"].as_array().unwrap();
    // The idle sample and each of the two peer windows.
    assert_eq!(reasons.len(), 3, "{peer_cost}");
    for reason in reasons {
        assert!(
            reason.as_str().unwrap().contains(&format!("PID {gone}: ")),
            "{reason}"
        );
    }
    for w in level["windows"].as_array().unwrap() {
        if w["arm"] == "C" {
            assert!(w["cpu"]["peer_us"].is_null(), "{w}");
            assert!(w["peer_not_sampled"].is_string(), "{w}");
        }
    }
    // The only level is the highest: its CPU goal says why it is not judged.
    let cpu = goal(level, "cpu_per_token");
    assert!(cpu["met"].is_null(), "{cpu}");
    assert!(
        cpu["why_not"]
            .as_str()
            .unwrap()
            .starts_with(&format!("peer not sampled: idle: PID {gone}: ")),
        "{cpu}"
    );
    let _ = std::fs::remove_dir_all(&out_dir);
}

#[test]
fn missing_relay_binaries_are_named_with_the_fix() {
    let empty = scratch_dir("nobins");
    let (_, stderr, ok) = run_bench(&[
        "compare",
        "--quick",
        "--windows",
        "2",
        "--window-s",
        "1",
        "--bin-dir",
        empty.to_str().unwrap(),
        "--out",
        empty.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(
        stderr.contains(&format!("{}/edge-bin not found", empty.display())),
        "{stderr}"
    );
    assert!(
        stderr.contains("cargo build --workspace --bins"),
        "{stderr}"
    );
    // No report was written.
    assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0);
    let _ = std::fs::remove_dir_all(&empty);
}
