//! Smoke test of `bench compare`: the real binary starts the real mock
//! provider, edge-bin and node-bin (from the same target directory), runs
//! the shortest comparison and writes its JSON report. The test checks
//! that the report is complete and consistent — every section present,
//! counts above zero, no error on the direct path, per-round deltas and
//! ratios equal to B − A and B / A of the reported window figures — and
//! never judges the numbers themselves.

mod common;

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

#[test]
fn quick_compare_writes_a_complete_consistent_report() {
    let bins = bin_dir();
    let out_dir = scratch_dir("compare");
    let (stdout, stderr, ok) = run_bench(&[
        "compare",
        "--quick",
        "--windows",
        "2",
        "--window-s",
        "1",
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
    let report = printed_report(&stdout, &out_dir, "compare");

    assert_eq!(report["schema"], "iop-bench-compare/1");
    for section in [
        "created_unix_ms",
        "machine",
        "nofile",
        "commit",
        "options",
        "arms",
        "windows",
        "rounds",
        "summary",
        "cpu",
        "rss",
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
    let arms: Vec<&str> = report["arms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["arm"].as_str().unwrap())
        .collect();
    assert_eq!(arms, ["A", "B"]);

    // Two rounds of one direct and one relayed window each.
    let windows = report["windows"].as_array().unwrap();
    assert_eq!(windows.len(), 4);
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
        if w["arm"] == "A" {
            assert_eq!(
                u64_at(s, "errors_total"),
                0,
                "direct window had errors: {w}"
            );
            assert_eq!(u64_at(s, "truncated"), 0, "direct window truncated: {w}");
        } else {
            // Relayed windows: CPU of both relay processes and a memory
            // sample were taken.
            assert!(w["cpu"]["edge_us"].is_u64(), "{w}");
            assert!(w["cpu"]["node_us"].is_u64(), "{w}");
            assert!(w["rss"]["edge_kib"].as_u64().unwrap() > 0, "{w}");
        }
    }

    // Per-round deltas and ratios are B − A and B / A of the windows.
    let rounds = report["rounds"].as_array().unwrap();
    assert_eq!(rounds.len(), 2);
    let mut deltas: Vec<Vec<f64>> = vec![Vec::new(); 5];
    for (r, round) in rounds.iter().enumerate() {
        assert_eq!(round["round"], r as u64);
        let order: Vec<&str> = round["order"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert_eq!(order, if r == 0 { ["A", "B"] } else { ["B", "A"] });
        let a = &window(r as u64, "A")["headline"];
        let b = &window(r as u64, "B")["headline"];
        for (i, (figure, ratio)) in FIGURES.iter().zip(RATIOS).enumerate() {
            let (av, bv) = (f64_at(a, figure), f64_at(b, figure));
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
    let summary = &report["summary"];
    for (i, figure) in FIGURES.iter().enumerate() {
        let added = f64_at(&summary["relayed_added"], figure);
        assert!(close(added, median(deltas[i].clone())), "{figure}");
    }
    assert_eq!(summary["direct_totals"]["errors"], 0);
    assert_eq!(summary["direct_totals"]["windows"], 2);
    assert_eq!(summary["relayed_totals"]["windows"], 2);

    // CPU per relayed token divides the relayed windows' CPU by their tokens.
    let cpu = &report["cpu"];
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
    let rss = &report["rss"];
    assert!(u64_at(&rss["idle"], "edge_kib") > 0);
    assert!(u64_at(&rss["idle"], "node_kib") > 0);
    assert_eq!(rss["window_samples"].as_array().unwrap().len(), 2);
    assert!(rss["bytes_per_stream"].is_f64());

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
