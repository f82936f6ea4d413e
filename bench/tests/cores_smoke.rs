//! Smoke test of `bench cores`: the real binary starts the real bulk mock,
//! one edge-bin + node-bin per layout (from the same target directory),
//! runs the shortest measurement and writes its JSON report. The test
//! checks that the report is complete and consistent — one window per arm
//! and round, every stream complete, at least the padded content's bytes
//! received per stream, the ratios equal to the medians of the per-round
//! ratios of the reported windows — and never judges the speed itself.

mod common;

use common::*;
use serde_json::Value;

const TOKENS: u64 = 8;
const TOKEN_BYTES: u64 = 1024;

/// The layouts this machine can run: its first allowed CPU, and the first
/// two when there are two.
fn layouts() -> Vec<String> {
    let cpus: Vec<usize> = iop_engine::rt::allowed_cpus()
        .map(|set| set.into_iter().take(2).collect())
        .unwrap_or_else(|_| vec![0]);
    let mut layouts = vec![cpus[0].to_string()];
    if let [a, b] = cpus[..] {
        layouts.push(format!("{a},{b}"));
    }
    layouts
}

#[test]
fn quick_cores_run_writes_a_complete_consistent_report() {
    let bins = bin_dir();
    let out_dir = scratch_dir("cores");
    let layouts = layouts();
    let mut args: Vec<String> = [
        "cores",
        "--rounds",
        "2",
        "--window-s",
        "0.4",
        "--warmup-s",
        "0",
        "--concurrency",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(["--tokens".into(), TOKENS.to_string()]);
    args.extend(["--token-bytes".into(), TOKEN_BYTES.to_string()]);
    args.extend(["--bin-dir".into(), bins.display().to_string()]);
    args.extend(["--out".into(), out_dir.display().to_string()]);
    for layout in &layouts {
        args.extend(["--layout".into(), layout.clone()]);
    }
    let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let (stdout, stderr, ok) = run_bench(&arg_refs);
    assert!(
        ok,
        "bench cores failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );

    let report = printed_report(&stdout, &out_dir, "cores");
    assert_eq!(report["schema"], "iop-bench-cores/1");
    assert_eq!(u64_at(&report, "incomplete_requests"), 0);

    let labels: Vec<String> = report["arms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["label"].as_str().unwrap().to_string())
        .collect();
    let mut expected = vec!["direct".to_string()];
    expected.extend(layouts.iter().map(|l| format!("cores {l}")));
    assert_eq!(labels, expected);

    // One window per arm and round; the order reversed in round 1.
    let windows = report["windows"].as_array().unwrap();
    assert_eq!(windows.len(), 2 * labels.len());
    let order: Vec<u64> = windows.iter().map(|w| u64_at(w, "arm")).collect();
    let forward: Vec<u64> = (0..labels.len() as u64).collect();
    let mut backward = forward.clone();
    backward.reverse();
    assert_eq!(order, [forward, backward].concat());
    for w in windows {
        let s = &w["summary"];
        let ok = u64_at(s, "requests_ok");
        assert!(ok > 0, "{w}");
        assert_eq!(u64_at(s, "requests_started"), ok, "{w}");
        assert_eq!(u64_at(s, "content_chunks"), ok * TOKENS, "{w}");
        // Each complete stream carries its padded tokens plus the chunk
        // envelopes: at least TOKENS × TOKEN_BYTES body bytes.
        assert!(u64_at(s, "body_bytes") >= ok * TOKENS * TOKEN_BYTES, "{w}");
    }

    // The ratios are medians of the per-round ratios of the windows.
    let bps = |arm: usize, round: u64| -> f64 {
        let w = windows
            .iter()
            .find(|w| u64_at(w, "arm") == arm as u64 && u64_at(w, "round") == round)
            .expect("window");
        f64_at(&w["summary"], "body_bytes_per_s")
    };
    let results = report["results"].as_array().unwrap();
    assert_eq!(results.len(), labels.len());
    assert_eq!(results[0]["ratio_to_first_layout"], Value::Null);
    for (arm, r) in results.iter().enumerate() {
        assert_eq!(r["label"].as_str(), Some(labels[arm].as_str()));
        assert_eq!(u64_at(r, "windows"), 2);
        let to_direct = median(
            (0..2)
                .map(|round| bps(arm, round) / bps(0, round))
                .collect(),
        );
        assert!(
            (f64_at(r, "ratio_to_direct") - to_direct).abs() < 1e-9,
            "{r}"
        );
        if arm > 0 {
            let to_first = median(
                (0..2)
                    .map(|round| bps(arm, round) / bps(1, round))
                    .collect(),
            );
            assert!(
                (f64_at(r, "ratio_to_first_layout") - to_first).abs() < 1e-9,
                "{r}"
            );
            assert!(r["edge_cpu_cores"].is_number(), "{r}");
        }
    }
    assert!(stdout.contains("body MB/s"), "{stdout}");
    if layouts.len() == 2 {
        assert!(
            stdout.contains(&format!(
                "throughput cores {} / cores {}: ",
                layouts[1], layouts[0]
            )),
            "{stdout}"
        );
    }
    let _ = std::fs::remove_dir_all(&out_dir);
}
