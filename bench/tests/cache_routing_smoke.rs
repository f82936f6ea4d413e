//! Smoke test of `bench cache-routing`: the real binary starts the real
//! mock providers (prefix cache modelled), edge-bin and node-bin (from the
//! same target directory) for two pool sizes, runs the quick measurement
//! and writes its JSON report. The test checks that the report is complete
//! and consistent — every pool, workload and arm present, the windows in
//! ABBA order, every request sent and answered, the mocks' prompt words
//! exactly those of the window's requests, the hits within what the
//! workload allows (and all of it for the pinned conversations, whose
//! caches hold them), every request routed once by its arm's policy (the
//! Edge's `/status` counters), each arm's figures recomputed from its
//! windows, the goals' ratios from the reported figures — and never judges
//! the speed.

mod common;

use common::*;
use serde_json::Value;

const POOLS: [u64; 2] = [2, 3];
const POLICIES: [&str; 4] = ["least_loaded", "session", "prefix", "pinned"];
const WORKLOADS: [&str; 3] = ["multi_turn", "shared_system_prompt", "no_shared_prefix"];

/// The nearest-rank percentile, as the report defines it.
fn percentile(samples: &[u64], q: f64) -> Option<u64> {
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let rank = (q * sorted.len() as f64).ceil() as usize;
    (!sorted.is_empty()).then(|| sorted[rank.clamp(1, sorted.len()) - 1])
}

fn samples(v: &Value, key: &str) -> Vec<u64> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("`{key}` is not a list in {v}"))
        .iter()
        .map(|x| x.as_u64().expect("a count"))
        .collect()
}

/// Prompt words of turn `t` (1-based) of a conversation: the system prompt,
/// t user messages and t − 1 replies.
fn turn_words(o: &Value, t: u64) -> u64 {
    u64_at(o, "system_words") + t * u64_at(o, "user_words") + (t - 1) * u64_at(o, "reply_tokens")
}

#[test]
fn quick_cache_routing_run_writes_a_complete_consistent_report() {
    let bins = bin_dir();
    let out_dir = scratch_dir("cache-routing");
    let json_path = out_dir.join("report.json");
    let (stdout, stderr, ok) = run_bench(&[
        "cache-routing",
        "--quick",
        "--providers",
        "2,3",
        "--json",
        json_path.to_str().expect("utf-8 path"),
        "--bin-dir",
        bins.to_str().expect("utf-8 path"),
    ]);
    assert!(
        ok,
        "bench cache-routing failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stdout.contains(&format!("JSON report: {}\n", json_path.display())),
        "{stdout}"
    );
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).expect("read report"))
            .expect("JSON");
    assert_eq!(report["schema"], "iop-bench-cache-routing/1");
    assert_eq!(u64_at(&report, "failed_requests"), 0);
    let o = &report["options"];
    assert_eq!(o["quick"], true);
    assert_eq!(o["providers"], serde_json::json!(POOLS));
    let rounds = u64_at(o, "rounds");
    let turns = u64_at(o, "turns");
    assert_eq!((rounds, turns), (2, 4));
    let longest = turn_words(o, turns);
    assert_eq!(
        u64_at(o, "cache_conversations"),
        u64_at(o, "conversations_per_provider") + 1
    );

    let pools = report["pools"].as_array().unwrap();
    assert_eq!(pools.len(), POOLS.len());
    for (pool, &p) in pools.iter().zip(&POOLS) {
        assert_eq!(u64_at(pool, "providers"), p);
        let conversations = u64_at(o, "conversations_per_provider") * p;
        assert_eq!(u64_at(pool, "conversations"), conversations);
        assert_eq!(
            u64_at(pool, "cache_tokens_per_provider"),
            u64_at(o, "cache_conversations") * longest
        );
        let workloads = pool["workloads"].as_array().unwrap();
        let names: Vec<&str> = workloads
            .iter()
            .map(|w| w["workload"].as_str().unwrap())
            .collect();
        assert_eq!(names, WORKLOADS);
        for workload in workloads {
            check_workload(o, p, conversations, workload);
        }
        check_goals(pool);
        // One table row per workload and arm, then the goals.
        for w in [
            "multi-turn (turns > 1)",
            "shared system prompt",
            "no shared prefix",
        ] {
            for arm in POLICIES {
                assert!(
                    stdout.contains(&format!("| {w} | {arm} | ")),
                    "{w} {arm}\n{stdout}"
                );
            }
        }
        assert!(
            stdout.contains(&format!("| goal ({p} providers) | ratio | target | |")),
            "{stdout}"
        );
    }
    let _ = std::fs::remove_dir_all(&out_dir);
}

fn check_workload(o: &Value, p: u64, conversations: u64, workload: &Value) {
    let name = workload["workload"].as_str().unwrap();
    let rounds = u64_at(o, "rounds");
    let turns = u64_at(o, "turns");
    let planned = match name {
        "multi_turn" => conversations * turns,
        "shared_system_prompt" => u64_at(o, "shared_requests_per_provider") * p,
        _ => u64_at(o, "unique_requests_per_provider") * p,
    };
    assert_eq!(u64_at(workload, "requests_per_window"), planned, "{name}");
    // The prompt words one window's requests carry, and the most of them a
    // cache can have seen before (multi-turn: each earlier turn's prompt).
    let (words, max_hits) = match name {
        "multi_turn" => (
            conversations * (1..=turns).map(|t| turn_words(o, t)).sum::<u64>(),
            conversations * (1..turns).map(|t| turn_words(o, t)).sum::<u64>(),
        ),
        "shared_system_prompt" => {
            let system = u64_at(o, "shared_prompt_words");
            (
                planned * (system + u64_at(o, "question_words")),
                planned * system,
            )
        }
        _ => (planned * u64_at(o, "unique_prompt_words"), 0),
    };

    // ABBA: forward in round 0, reversed in round 1.
    let windows = workload["windows"].as_array().unwrap();
    assert_eq!(windows.len() as u64, rounds * 4, "{name}");
    let order: Vec<(u64, u64, &str)> = windows
        .iter()
        .map(|w| {
            (
                u64_at(w, "round"),
                u64_at(w, "position"),
                w["policy"].as_str().unwrap(),
            )
        })
        .collect();
    let mut expected = Vec::new();
    for round in 0..rounds {
        let mut arms = POLICIES.to_vec();
        if round % 2 == 1 {
            arms.reverse();
        }
        expected.extend((0..).zip(arms).map(|(i, a)| (round, i, a)));
    }
    assert_eq!(order, expected, "{name}");

    for w in windows {
        let what = format!("{name} {w}");
        assert_eq!(u64_at(w, "requests_planned"), planned, "{what}");
        assert_eq!(u64_at(w, "requests_sent"), planned, "{what}");
        assert_eq!(u64_at(w, "requests_ok"), planned, "{what}");
        assert_eq!(u64_at(w, "requests_failed"), 0, "{what}");
        assert_eq!(w["first_error"], Value::Null, "{what}");
        assert!(u64_at(w, "wall_us") > 0, "{what}");
        let (ttft, first) = (samples(w, "ttft_us"), samples(w, "first_turn_ttft_us"));
        if name == "multi_turn" {
            assert_eq!(ttft.len() as u64, conversations * (turns - 1), "{what}");
            assert_eq!(first.len() as u64, conversations, "{what}");
        } else {
            assert_eq!(ttft.len() as u64, planned, "{what}");
            assert!(first.is_empty(), "{what}");
        }
        // The mocks saw exactly this window's prompts.
        assert_eq!(u64_at(w, "prompt_tokens_seen"), words, "{what}");
        let hits = u64_at(w, "cached_tokens_hit");
        assert!(hits <= max_hits, "{what}");
        if name == "multi_turn" && w["policy"] == "pinned" {
            // Each pinned provider's cache holds its conversations: every
            // later turn finds the whole earlier prompt.
            assert_eq!(hits, max_hits, "{what}");
        }
        if name == "no_shared_prefix" {
            assert_eq!(hits, 0, "{what}");
        }
        // The Edge routed every request once, by the arm's policy: the
        // session arm's requests all carry a key, the others none.
        let routed = &w["edge_routing"];
        let (load, matched, session) = (
            u64_at(routed, "routed_by_load"),
            u64_at(routed, "routed_by_match"),
            u64_at(routed, "routed_by_session"),
        );
        assert_eq!(load + matched + session, planned, "{what}");
        match w["policy"].as_str().unwrap() {
            "session" => assert_eq!(session, planned, "{what}"),
            "prefix" => assert_eq!(session, 0, "{what}"),
            _ => assert_eq!(load, planned, "{what}"),
        }
    }

    // Each arm's figures from its windows.
    let arms = workload["arms"].as_array().unwrap();
    let arm_names: Vec<&str> = arms.iter().map(|a| a["policy"].as_str().unwrap()).collect();
    assert_eq!(arm_names, POLICIES, "{name}");
    for arm in arms {
        let mine: Vec<&Value> = windows
            .iter()
            .filter(|w| w["policy"] == arm["policy"])
            .collect();
        let what = format!("{name} {arm}");
        assert_eq!(u64_at(arm, "windows"), rounds, "{what}");
        let sum = |key: &str| mine.iter().map(|w| u64_at(w, key)).sum::<u64>();
        assert_eq!(u64_at(arm, "requests_sent"), sum("requests_sent"), "{what}");
        assert_eq!(u64_at(arm, "requests_ok"), sum("requests_ok"), "{what}");
        assert_eq!(u64_at(arm, "requests_failed"), 0, "{what}");
        let pooled: Vec<u64> = mine.iter().flat_map(|w| samples(w, "ttft_us")).collect();
        assert_eq!(u64_at(arm, "samples"), pooled.len() as u64, "{what}");
        assert_eq!(
            arm["ttft_p50_us"].as_u64(),
            percentile(&pooled, 0.5),
            "{what}"
        );
        assert_eq!(
            arm["ttft_p99_us"].as_u64(),
            percentile(&pooled, 0.99),
            "{what}"
        );
        let firsts: Vec<u64> = mine
            .iter()
            .flat_map(|w| samples(w, "first_turn_ttft_us"))
            .collect();
        assert_eq!(
            arm["first_turn_ttft_p50_us"].as_u64(),
            percentile(&firsts, 0.5),
            "{what}"
        );
        let hit_rate = sum("cached_tokens_hit") as f64 / sum("prompt_tokens_seen") as f64;
        assert!(close(f64_at(arm, "cache_hit_rate"), hit_rate), "{what}");
        let rps = sum("requests_ok") as f64 * 1e6 / sum("wall_us") as f64;
        assert!(close(f64_at(arm, "requests_per_s"), rps), "{what}");
        for key in [
            "routed_by_load",
            "routed_by_match",
            "routed_by_session",
            "imbalance_fallbacks",
        ] {
            let total: u64 = mine.iter().map(|w| u64_at(&w["edge_routing"], key)).sum();
            assert_eq!(u64_at(&arm["edge_routing"], key), total, "{what} {key}");
        }
    }
}

fn check_goals(pool: &Value) {
    let arm = |workload: &str, policy: &str| -> Value {
        pool["workloads"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["workload"] == workload)
            .and_then(|w| {
                w["arms"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|a| a["policy"] == policy)
            })
            .cloned()
            .unwrap_or_else(|| panic!("no {workload} {policy}"))
    };
    let p50 = |policy: &str| u64_at(&arm("multi_turn", policy), "ttft_p50_us") as f64;
    let rps = |policy: &str| f64_at(&arm("no_shared_prefix", policy), "requests_per_s");
    let expected = [
        (
            "prefix_ttft_p50_over_pinned",
            p50("prefix") / p50("pinned"),
            1.2,
            true,
        ),
        (
            "session_ttft_p50_over_pinned",
            p50("session") / p50("pinned"),
            1.2,
            true,
        ),
        (
            "no_shared_throughput_prefix_over_least_loaded",
            rps("prefix") / rps("least_loaded"),
            0.95,
            false,
        ),
    ];
    let goals = pool["goals"].as_array().unwrap();
    assert_eq!(goals.len(), expected.len());
    for (goal, (name, value, limit, at_most)) in goals.iter().zip(expected) {
        assert_eq!(goal["name"], name);
        assert!(close(f64_at(goal, "value"), value), "{goal} vs {value}");
        assert!(close(f64_at(goal, "limit"), limit), "{goal}");
        assert_eq!(goal["at_most"], at_most, "{goal}");
        let met = if at_most {
            value <= limit
        } else {
            value >= limit
        };
        assert_eq!(goal["met"], met, "{goal}");
    }
}
