//! The throughput report: the JSON document (every window too) and the
//! human table. Pure: built from measured values, no IO.

use serde::Serialize;

use crate::load::LoadSummary;
use crate::procstat::MachineInfo;
use crate::stats::{median, median_present, ratio};

use super::CoresOptions;

/// Version tag of the JSON document.
pub const SCHEMA: &str = "iop-bench-cores/1";

/// Bytes in the megabyte of the table (decimal, like link speeds).
const BYTES_PER_MB: f64 = 1e6;

/// One side of the measurement: the direct baseline or one core layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CoresArm {
    /// `direct`, or `cores <layout>`.
    pub label: String,
    /// The `--cores` of edge-bin and node-bin; `None` for direct.
    pub cores: Option<String>,
    /// Base URL requests go to.
    pub url: String,
    /// The `model` of its requests.
    pub model: String,
}

impl CoresArm {
    /// The label of a layout arm.
    pub fn layout_label(cores: &str) -> String {
        format!("cores {cores}")
    }
}

/// CPU time used during one window, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CpuWindow {
    /// The arm's Edge (`None` for direct).
    pub edge_us: Option<u64>,
    /// The arm's Node (`None` for direct).
    pub node_us: Option<u64>,
    /// The mock provider.
    pub mock_us: Option<u64>,
    /// This process: the load generator (and the harness's idle threads).
    pub load_us: Option<u64>,
}

/// One measured window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CoresWindow {
    /// Round, from 0.
    pub round: u32,
    /// Index into the report's arms.
    pub arm: usize,
    /// Position of the window in its round, from 0.
    pub position: u32,
    /// What the load generator measured.
    pub summary: LoadSummary,
    /// CPU time the children of this arm used during the window (the
    /// mock's in every arm; Edge and Node only for a layout arm).
    pub cpu: CpuWindow,
}

/// One arm's figures over every round.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ArmResult {
    /// As in [`CoresArm::label`].
    pub label: String,
    /// As in [`CoresArm::cores`].
    pub cores: Option<String>,
    /// Windows measured.
    pub windows: u32,
    /// Median over windows of body bytes received per second.
    pub body_bytes_per_s: f64,
    /// Median over windows of completed requests per second.
    pub requests_per_s: f64,
    /// Body bytes received over every window.
    pub body_bytes: u64,
    /// Requests started over every window.
    pub requests_started: u64,
    /// Requests completed (200, `[DONE]`, no error event).
    pub requests_ok: u64,
    /// Failed requests (connect, status, IO, timeout, error event).
    pub errors: u64,
    /// 200 streams that ended without `[DONE]`.
    pub truncated: u64,
    /// The first failure seen, for diagnosis.
    pub first_error: Option<String>,
    /// Median over rounds of this arm's body bytes/s over the first
    /// layout's in the same round (`None` for direct).
    pub ratio_to_first_layout: Option<f64>,
    /// Median over rounds of this arm's body bytes/s over direct's in the
    /// same round.
    pub ratio_to_direct: Option<f64>,
    /// Median over windows of the Edge's CPU time ÷ window time (cores
    /// busy).
    pub edge_cpu_cores: Option<f64>,
    /// Likewise for the Node.
    pub node_cpu_cores: Option<f64>,
    /// Likewise for the mock provider.
    pub mock_cpu_cores: Option<f64>,
    /// Likewise for the load generator.
    pub load_cpu_cores: Option<f64>,
    /// Median over windows of Edge + Node CPU seconds per GB (1e9 bytes)
    /// of body received.
    pub relay_cpu_s_per_gb: Option<f64>,
}

impl ArmResult {
    /// Requests that did not complete.
    pub fn incomplete(&self) -> u64 {
        self.requests_started.saturating_sub(self.requests_ok)
    }
}

/// CPU time `cpu_us` over a window of `elapsed_s`, in cores busy.
fn cores_busy(cpu_us: Option<u64>, elapsed_s: f64) -> Option<f64> {
    ratio(cpu_us? as f64 / 1e6, elapsed_s)
}

/// Per-arm figures from the windows. `arms[0]` is expected to be the
/// direct baseline (`cores: None`); the first arm with `cores` is the
/// layout the others are compared to.
pub fn summarize(arms: &[CoresArm], windows: &[CoresWindow]) -> Vec<ArmResult> {
    let direct = arms.iter().position(|a| a.cores.is_none());
    let first_layout = arms.iter().position(|a| a.cores.is_some());
    let bps_of = |arm: usize, round: u32| {
        windows
            .iter()
            .find(|w| w.arm == arm && w.round == round)
            .map(|w| w.summary.body_bytes_per_s)
    };
    let ratio_to = |base: Option<usize>, mine: &[&CoresWindow]| {
        let base = base?;
        let ratios: Vec<Option<f64>> = mine
            .iter()
            .map(|w| ratio(w.summary.body_bytes_per_s, bps_of(base, w.round)?))
            .collect();
        median_present(&ratios)
    };
    arms.iter()
        .enumerate()
        .map(|(i, arm)| {
            let mine: Vec<&CoresWindow> = windows.iter().filter(|w| w.arm == i).collect();
            let values = |f: &dyn Fn(&CoresWindow) -> f64| -> Vec<f64> {
                mine.iter().map(|w| f(w)).collect()
            };
            let present = |f: &dyn Fn(&CoresWindow) -> Option<f64>| -> Option<f64> {
                median_present(&mine.iter().map(|w| f(w)).collect::<Vec<_>>())
            };
            let sum = |f: &dyn Fn(&LoadSummary) -> u64| -> u64 {
                mine.iter().map(|w| f(&w.summary)).sum()
            };
            ArmResult {
                label: arm.label.clone(),
                cores: arm.cores.clone(),
                windows: u32::try_from(mine.len()).unwrap_or(u32::MAX),
                body_bytes_per_s: median(&values(&|w| w.summary.body_bytes_per_s)).unwrap_or(0.0),
                requests_per_s: median(&values(&|w| w.summary.requests_per_s)).unwrap_or(0.0),
                body_bytes: sum(&|s| s.body_bytes),
                requests_started: sum(&|s| s.requests_started),
                requests_ok: sum(&|s| s.requests_ok),
                errors: sum(&|s| s.errors_total),
                truncated: sum(&|s| s.truncated),
                first_error: mine.iter().find_map(|w| w.summary.first_error.clone()),
                ratio_to_first_layout: arm
                    .cores
                    .as_ref()
                    .and_then(|_| ratio_to(first_layout, &mine)),
                ratio_to_direct: ratio_to(direct, &mine),
                edge_cpu_cores: present(&|w| cores_busy(w.cpu.edge_us, w.summary.elapsed_s)),
                node_cpu_cores: present(&|w| cores_busy(w.cpu.node_us, w.summary.elapsed_s)),
                mock_cpu_cores: present(&|w| cores_busy(w.cpu.mock_us, w.summary.elapsed_s)),
                load_cpu_cores: present(&|w| cores_busy(w.cpu.load_us, w.summary.elapsed_s)),
                relay_cpu_s_per_gb: present(&|w| {
                    let relay_us = w.cpu.edge_us? + w.cpu.node_us?;
                    ratio(relay_us as f64 / 1e6, w.summary.body_bytes as f64 / 1e9)
                }),
            }
        })
        .collect()
}

/// The whole JSON document.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CoresReport {
    /// [`SCHEMA`].
    pub schema: &'static str,
    /// When the run finished, Unix milliseconds.
    pub created_unix_ms: i64,
    /// The machine.
    pub machine: MachineInfo,
    /// `git rev-parse --short HEAD`, when available.
    pub commit: Option<String>,
    /// The options, defaults resolved.
    pub options: CoresOptions,
    /// The arms: direct first, then one per layout.
    pub arms: Vec<CoresArm>,
    /// Every measured window in run order.
    pub windows: Vec<CoresWindow>,
    /// Per-arm figures, in the order of `arms`.
    pub results: Vec<ArmResult>,
    /// Requests that did not complete, over every arm and window.
    pub incomplete_requests: u64,
    /// Caveats worth reading next to the figures.
    pub notes: Vec<String>,
}

impl CoresReport {
    /// The headline: the last layout's throughput over the first
    /// layout's (`0-1` over `0` with the defaults), when there are two.
    pub fn scaling_ratio(&self) -> Option<(&ArmResult, &ArmResult, f64)> {
        let mut layouts = self.results.iter().filter(|r| r.cores.is_some());
        let first = layouts.next()?;
        let last = layouts.next_back()?;
        Some((first, last, last.ratio_to_first_layout?))
    }
}

fn optional(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(|| "-".to_string(), |v| format!("{v:.decimals$}"))
}

fn times(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_string(), |v| format!("{v:.2}x"))
}

/// The human-readable report.
pub fn render_table(report: &CoresReport) -> String {
    let o = &report.options;
    let mut out = format!(
        "bench cores: bulk relay throughput, {} streams x {} tokens x {} B, {} rounds x {:.1} s, \
         {} CPUs ({})\n",
        o.concurrency,
        o.tokens,
        o.token_bytes,
        o.rounds,
        o.window_ms as f64 / 1000.0,
        report.machine.nproc,
        report.machine.driver,
    );
    let first = report
        .results
        .iter()
        .find_map(|r| r.cores.clone())
        .unwrap_or_default();
    let vs_first = format!("vs {first}");
    out.push_str(&format!(
        "{:<12} {:>10} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11} {:>13} {:>7}\n",
        "arm",
        "body MB/s",
        "req/s",
        vs_first,
        "vs direct",
        "edge CPU",
        "node CPU",
        "mock CPU",
        "load CPU",
        "relay s/GB",
        "ok/started",
        "failed",
    ));
    for r in &report.results {
        out.push_str(&format!(
            "{:<12} {:>10.1} {:>9.1} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11} {:>13} {:>7}\n",
            r.label,
            r.body_bytes_per_s / BYTES_PER_MB,
            r.requests_per_s,
            times(r.ratio_to_first_layout),
            times(r.ratio_to_direct),
            optional(r.edge_cpu_cores, 2),
            optional(r.node_cpu_cores, 2),
            optional(r.mock_cpu_cores, 2),
            optional(r.load_cpu_cores, 2),
            optional(r.relay_cpu_s_per_gb, 2),
            format!("{}/{}", r.requests_ok, r.requests_started),
            r.incomplete(),
        ));
    }
    if let Some((first, last, ratio)) = report.scaling_ratio() {
        out.push_str(&format!(
            "throughput {} / {}: {ratio:.2}x (median of per-round ratios)\n",
            last.label, first.label
        ));
    }
    out.push_str("CPU columns: cores busy (CPU time / window time), load = this process; relay s/GB: Edge + Node CPU seconds per 1e9 body bytes\n");
    for r in report.results.iter().filter(|r| r.incomplete() > 0) {
        out.push_str(&format!(
            "INCOMPLETE {}: {} of {} requests failed ({} errors, {} truncated); first: {}\n",
            r.label,
            r.incomplete(),
            r.requests_started,
            r.errors,
            r.truncated,
            r.first_error.as_deref().unwrap_or("-"),
        ));
    }
    for note in &report.notes {
        out.push_str(&format!("note: {note}\n"));
    }
    out
}

impl crate::compare::Report for CoresReport {
    fn created_unix_ms(&self) -> i64 {
        self.created_unix_ms
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn arm(cores: Option<&str>) -> CoresArm {
        CoresArm {
            label: cores.map_or_else(|| "direct".to_string(), CoresArm::layout_label),
            cores: cores.map(str::to_string),
            url: "http://127.0.0.1:1".into(),
            model: "m".into(),
        }
    }

    fn window(round: u32, arm: usize, mb_per_s: f64, relay_cpu_us: Option<u64>) -> CoresWindow {
        CoresWindow {
            round,
            arm,
            position: 0,
            summary: LoadSummary {
                elapsed_s: 2.0,
                requests_started: 10,
                requests_ok: 10,
                requests_per_s: 5.0,
                body_bytes: (mb_per_s * 2e6) as u64,
                body_bytes_per_s: mb_per_s * 1e6,
                ..LoadSummary::default()
            },
            cpu: CpuWindow {
                edge_us: relay_cpu_us,
                node_us: relay_cpu_us,
                mock_us: Some(1_000_000),
                load_us: Some(300_000),
            },
        }
    }

    fn arms() -> Vec<CoresArm> {
        vec![arm(None), arm(Some("0")), arm(Some("0-1"))]
    }

    /// Round 0: direct 100, `0` 40, `0-1` 60 MB/s; round 1 (everything
    /// 10% slower): 90, 36, 54.
    fn windows() -> Vec<CoresWindow> {
        vec![
            window(0, 0, 100.0, None),
            window(0, 1, 40.0, Some(500_000)),
            window(0, 2, 60.0, Some(800_000)),
            window(1, 2, 54.0, Some(800_000)),
            window(1, 1, 36.0, Some(500_000)),
            window(1, 0, 90.0, None),
        ]
    }

    #[test]
    fn ratios_are_medians_of_per_round_ratios() {
        let r = summarize(&arms(), &windows());
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].label, "direct");
        assert_eq!(r[0].ratio_to_first_layout, None);
        assert_eq!(r[0].ratio_to_direct, Some(1.0));
        assert_eq!(r[0].body_bytes_per_s, 95e6);
        assert_eq!(r[0].edge_cpu_cores, None);
        assert_eq!(r[0].mock_cpu_cores, Some(0.5));
        assert_eq!(r[0].load_cpu_cores, Some(0.15));
        assert_eq!(r[1].label, "cores 0");
        assert_eq!(r[1].ratio_to_first_layout, Some(1.0));
        assert_eq!(r[1].ratio_to_direct, Some(0.4));
        assert_eq!(r[2].ratio_to_first_layout, Some(1.5));
        assert_eq!(r[2].ratio_to_direct, Some(0.6));
        assert_eq!(r[2].edge_cpu_cores, Some(0.4));
        assert_eq!(r[2].body_bytes, 228_000_000);
        assert_eq!(r[2].requests_ok, 20);
        assert_eq!(r[2].incomplete(), 0);
        // 1.6 CPU seconds per 120 MB in round 0, per 108 MB in round 1.
        let per_gb = r[2].relay_cpu_s_per_gb.unwrap();
        assert!((per_gb - (1.6 / 0.12 + 1.6 / 0.108) / 2.0).abs() < 1e-9);
    }

    #[test]
    fn failures_are_counted_and_shown() {
        let mut w = windows();
        w[2].summary.requests_started = 12;
        w[2].summary.errors_total = 1;
        w[2].summary.truncated = 1;
        w[2].summary.first_error = Some("stream ended without [DONE]".into());
        let results = summarize(&arms(), &w);
        assert_eq!(results[2].incomplete(), 2);
        let report = report_of(results, w);
        let table = render_table(&report);
        assert!(table.contains(
            "INCOMPLETE cores 0-1: 2 of 22 requests failed (1 errors, 1 truncated); \
             first: stream ended without [DONE]\n"
        ));
    }

    fn report_of(results: Vec<ArmResult>, windows: Vec<CoresWindow>) -> CoresReport {
        CoresReport {
            schema: SCHEMA,
            created_unix_ms: 0,
            machine: MachineInfo {
                nproc: 2,
                kernel: "6.1".into(),
                cpu_model: "cpu".into(),
                driver: "io_uring".into(),
                local_ports: None,
            },
            commit: None,
            options: CoresOptions {
                quick: true,
                layouts: vec!["0".into(), "0-1".into()],
                rounds: 2,
                window_ms: 2_000,
                warmup_ms: 500,
                concurrency: 32,
                tokens: 256,
                token_bytes: 4096,
                load_cores: None,
                bin_dir: PathBuf::from("/b"),
                bench_exe: PathBuf::from("/b/bench"),
                out_dir: PathBuf::from("out"),
                mock_model: "mock-model".into(),
                edge_model: "bench-model".into(),
                keep_temp: false,
            },
            incomplete_requests: results.iter().map(ArmResult::incomplete).sum(),
            arms: arms(),
            windows,
            results,
            notes: vec!["shared CPUs".into()],
        }
    }

    #[test]
    fn table_is_exact() {
        let report = report_of(summarize(&arms(), &windows()), windows());
        assert_eq!(
            report
                .scaling_ratio()
                .map(|(a, b, r)| (a.label.as_str(), b.label.as_str(), r)),
            Some(("cores 0", "cores 0-1", 1.5))
        );
        let expected = "\
bench cores: bulk relay throughput, 32 streams x 256 tokens x 4096 B, 2 rounds x 2.0 s, 2 CPUs (io_uring)
arm           body MB/s     req/s     vs 0 vs direct  edge CPU  node CPU  mock CPU  load CPU  relay s/GB    ok/started  failed
direct             95.0       5.0        -     1.00x         -         -      0.50      0.15           -         20/20       0
cores 0            38.0       5.0    1.00x     0.40x      0.25      0.25      0.50      0.15       13.19         20/20       0
cores 0-1          57.0       5.0    1.50x     0.60x      0.40      0.40      0.50      0.15       14.07         20/20       0
throughput cores 0-1 / cores 0: 1.50x (median of per-round ratios)
CPU columns: cores busy (CPU time / window time), load = this process; relay s/GB: Edge + Node CPU seconds per 1e9 body bytes
note: shared CPUs
";
        assert_eq!(render_table(&report), expected);
    }
}
