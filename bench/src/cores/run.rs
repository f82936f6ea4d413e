//! The orchestration of `bench cores`: start the mock and one Edge + Node
//! per layout, warm every arm up, run the rounds, assemble the report.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use super::report::{summarize, ArmResult, CoresArm, CoresReport, CoresWindow, CpuWindow, SCHEMA};
use super::CoresOptions;
use crate::compare::config::{edge_toml, ClusterNames};
use crate::compare::procs::{ChildProc, TempDir};
use crate::compare::run::{check_binary, commit, interrupted, spawn_relay, RelaySpec};
use crate::compare::CompareError;
use crate::load::{self, Live, LoadSpec, LoadSummary, Mode, Target};
use crate::procstat::{self, CpuTicks};

/// Pause between windows so closed connections are torn down on every
/// side before the next window starts.
const SETTLE_MS: u64 = 200;
/// Time after the end of a window that streams still running get.
const WINDOW_DRAIN_MS: u64 = 30_000;
/// Longest ramp of stream starts at the beginning of a window.
const MAX_RAMP_MS: u64 = 200;

/// One layout's Edge and Node. Fields drop in order: the Node first.
struct Relay {
    node: ChildProc,
    edge: ChildProc,
}

/// Every child and the working directory. Fields drop in order: the
/// relays, then the mock, last the directory.
struct Children {
    relays: Vec<Relay>,
    mock: Option<ChildProc>,
    tmp: TempDir,
}

impl Children {
    /// The relay of arm `arm` (arm 0 is direct).
    fn relay_of(&self, arm: usize) -> Option<&Relay> {
        arm.checked_sub(1).and_then(|r| self.relays.get(r))
    }

    fn check_running(&mut self) -> Result<(), CompareError> {
        for relay in &mut self.relays {
            relay.node.check_running()?;
            relay.edge.check_running()?;
        }
        if let Some(mock) = &mut self.mock {
            mock.check_running()?;
        }
        Ok(())
    }
}

/// CPU counters of one arm's children at one moment.
#[derive(Debug, Clone, Copy, Default)]
struct CpuSnapshot {
    edge: Option<CpuTicks>,
    node: Option<CpuTicks>,
    mock: Option<CpuTicks>,
    load: Option<CpuTicks>,
}

impl CpuSnapshot {
    fn read(mock: Option<&ChildProc>, relay: Option<&Relay>) -> Self {
        let read = |c: Option<&ChildProc>| c.and_then(|c| procstat::read_cpu(c.pid()).ok());
        CpuSnapshot {
            edge: read(relay.map(|r| &r.edge)),
            node: read(relay.map(|r| &r.node)),
            mock: read(mock),
            load: procstat::read_cpu(std::process::id()).ok(),
        }
    }

    fn until(self, after: CpuSnapshot, ticks_per_s: u64) -> CpuWindow {
        let used = |b: Option<CpuTicks>, a: Option<CpuTicks>| {
            Some(procstat::ticks_to_us(a?.since(b?), ticks_per_s))
        };
        CpuWindow {
            edge_us: used(self.edge, after.edge),
            node_us: used(self.node, after.node),
            mock_us: used(self.mock, after.mock),
            load_us: used(self.load, after.load),
        }
    }
}

/// Starts the bulk mock provider; returns its base URL.
fn start_mock(
    opts: &CoresOptions,
    children: &mut Children,
    stop: &AtomicBool,
) -> Result<String, CompareError> {
    check_binary(&opts.bench_exe)?;
    let args: Vec<String> = vec![
        "mock-provider".into(),
        "--port".into(),
        "0".into(),
        "--tokens".into(),
        opts.tokens.to_string(),
        "--token-bytes".into(),
        opts.token_bytes.to_string(),
        "--inter-token-ms".into(),
        "0".into(),
        "--ttft-ms".into(),
        "0".into(),
        "--model-list".into(),
        opts.mock_model.clone(),
    ];
    let mock = ChildProc::spawn(
        "mock",
        &opts.bench_exe,
        &args,
        children.tmp.path(),
        true,
        stop,
    )?;
    let url = format!("http://{}", mock.ready_value("addr")?);
    children.mock = Some(mock);
    Ok(url)
}

/// Starts an Edge and a Node, both with `--cores cores`, in `dir` against
/// `mock_url` and waits for the Node to connect; returns the Edge's client
/// base URL.
fn start_relay(
    opts: &CoresOptions,
    children: &mut Children,
    dir: &Path,
    cores: &str,
    mock_url: &str,
    stop: &AtomicBool,
) -> Result<String, CompareError> {
    let names = ClusterNames::bench(&opts.edge_model, &opts.mock_model);
    let edge_config = edge_toml(&names, mock_url);
    let spec = RelaySpec {
        names: &names,
        edge_config: &edge_config,
        cores: (cores, cores),
        status_key: None,
    };
    let pair = spawn_relay(&opts.bin_dir, dir, &spec, stop, &mut || {
        children.check_running()
    })?;
    children.relays.push(Relay {
        node: pair.node,
        edge: pair.edge,
    });
    Ok(pair.url)
}

/// The closed-loop load of one window.
fn window_spec(
    opts: &CoresOptions,
    arm: &CoresArm,
    target: &Target,
    duration_ms: u64,
    stop: &Arc<AtomicBool>,
) -> Result<LoadSpec, CompareError> {
    Ok(LoadSpec {
        target: target.clone(),
        model: arm.model.clone(),
        mode: Mode::Concurrency {
            streams: opts.concurrency,
        },
        duration_ms,
        tokens: opts.tokens,
        stream: true,
        ramp_ms: (duration_ms / 10).min(MAX_RAMP_MS),
        drain_ms: WINDOW_DRAIN_MS,
        gap_limit_ns: None,
        cores: crate::load::cli::load_cores(opts.load_cores.as_deref())
            .map_err(CompareError::Options)?,
        max_in_flight: opts.concurrency,
        api_key: None,
        request_id_prefix: None,
        progress: false,
        stop: Arc::clone(stop),
    })
}

fn describe(summary: &LoadSummary) -> String {
    format!(
        "{:.1} MB/s body, {:.1} req/s; {} ok of {}, {} errors, {} truncated",
        summary.body_bytes_per_s / 1e6,
        summary.requests_per_s,
        summary.requests_ok,
        summary.requests_started,
        summary.errors_total,
        summary.truncated,
    )
}

/// The order of the arms in `round`: as listed in even rounds, reversed
/// in odd ones.
pub(crate) fn round_order(arms: usize, round: u32) -> Vec<usize> {
    let mut order: Vec<usize> = (0..arms).collect();
    if round % 2 == 1 {
        order.reverse();
    }
    order
}

/// Runs the whole measurement. Progress goes to stderr; the caller prints
/// and writes the returned report.
pub fn run(opts: &CoresOptions, stop: &Arc<AtomicBool>) -> Result<CoresReport, CompareError> {
    let machine = procstat::machine_info();
    let ticks_per_s = procstat::clock_ticks_per_s()?;
    let mut children = Children {
        relays: Vec::new(),
        mock: None,
        tmp: TempDir::create(opts.keep_temp)?,
    };
    if opts.keep_temp {
        eprintln!(
            "bench cores: working directory {}",
            children.tmp.path().display()
        );
    }
    let mock_url = start_mock(opts, &mut children, stop)?;
    let mut arms = vec![CoresArm {
        label: "direct".into(),
        cores: None,
        url: mock_url.clone(),
        model: opts.mock_model.clone(),
    }];
    for (i, cores) in opts.layouts.iter().enumerate() {
        let dir: PathBuf = children.tmp.path().join(format!("relay-{i}"));
        let url = start_relay(opts, &mut children, &dir, cores, &mock_url, stop)?;
        eprintln!("bench cores: layout {cores}: edge {url}");
        arms.push(CoresArm {
            label: CoresArm::layout_label(cores),
            cores: Some(cores.clone()),
            url,
            model: opts.edge_model.clone(),
        });
    }
    eprintln!("bench cores: mock {mock_url}");
    let targets = arms
        .iter()
        .map(|a| Target::parse(&a.url))
        .collect::<Result<Vec<_>, _>>()?;

    // Warm-up: every arm must complete requests, or its figures are void.
    for (arm, target) in arms.iter().zip(&targets) {
        interrupted(stop)?;
        let mut spec = window_spec(opts, arm, target, opts.warmup_ms, stop)?;
        if opts.warmup_ms == 0 {
            spec.mode = Mode::OneShot { streams: 1 };
        }
        let summary = load::run(&spec, &Live::new())?;
        eprintln!("warm-up {:<12} {}", arm.label, describe(&summary));
        if summary.requests_ok == 0 {
            return Err(CompareError::ArmBroken {
                arm: arm.label.clone(),
                first_error: summary.first_error.unwrap_or_else(|| "no response".into()),
            });
        }
        std::thread::sleep(Duration::from_millis(SETTLE_MS));
    }

    let mut windows = Vec::new();
    for round in 0..opts.rounds {
        for (position, &i) in round_order(arms.len(), round).iter().enumerate() {
            interrupted(stop)?;
            children.check_running()?;
            let (arm, target) = (&arms[i], &targets[i]);
            let spec = window_spec(opts, arm, target, opts.window_ms, stop)?;
            let before = CpuSnapshot::read(children.mock.as_ref(), children.relay_of(i));
            let summary = load::run(&spec, &Live::new())?;
            let after = CpuSnapshot::read(children.mock.as_ref(), children.relay_of(i));
            eprintln!(
                "round {}/{} {:<12} {}",
                round + 1,
                opts.rounds,
                arm.label,
                describe(&summary)
            );
            windows.push(CoresWindow {
                round,
                arm: i,
                position: u32::try_from(position).unwrap_or(u32::MAX),
                summary,
                cpu: before.until(after, ticks_per_s),
            });
            std::thread::sleep(Duration::from_millis(SETTLE_MS));
        }
    }

    let results = summarize(&arms, &windows);
    let mut notes = Vec::new();
    if machine.nproc < 4 {
        notes.push(format!(
            "this machine has {} CPUs shared by the load generator, the mock, the Edge and the \
             Node; only Edge and Node are pinned (by --cores), so every arm includes that \
             contention and a wider layout also competes with the load generator and the mock",
            machine.nproc
        ));
    }
    notes.push(
        "every layout's Edge and Node run during the whole measurement; only one arm carries \
         load at a time"
            .to_string(),
    );
    notes.push(format!(
        "CPU time is read from /proc/<pid>/stat in clock ticks of {} ms",
        1000 / ticks_per_s.max(1)
    ));
    Ok(CoresReport {
        schema: SCHEMA,
        created_unix_ms: iop_engine::clock::unix_ms(),
        machine,
        commit: commit(),
        options: opts.clone(),
        incomplete_requests: results.iter().map(ArmResult::incomplete).sum(),
        arms,
        windows,
        results,
        notes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_alternate_the_order() {
        assert_eq!(round_order(3, 0), vec![0, 1, 2]);
        assert_eq!(round_order(3, 1), vec![2, 1, 0]);
        assert_eq!(round_order(3, 2), vec![0, 1, 2]);
    }
}
