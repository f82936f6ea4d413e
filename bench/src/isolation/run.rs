//! The orchestration of `bench isolation`: two mocks, one Edge + Node, the
//! rounds of windows A (no never-readers) and B (K stuck), the cut-offs.

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use iop_engine::clock;

use super::report::{IsolationReport, RoundResult, Rss, SCHEMA};
use super::stuck::NeverReader;
use super::IsolationOptions;
use crate::compare::config::{edge_toml_for, ClusterNames, MockRoute};
use crate::compare::procs::{ChildProc, TempDir};
use crate::compare::run::{check_binary, commit, interrupted, spawn_relay, RelaySpec};
use crate::compare::CompareError;
use crate::load::{self, Live, LoadSpec, LoadSummary, Mode, Target};
use crate::procstat;

/// The model the normal mock serves, and the name clients use at the Edge.
const NORMAL_MODEL: &str = "normal";
/// The model the bulk mock serves, and the name never-readers use.
const BULK_MODEL: &str = "bulk";
/// Bytes of each bulk token (the bulk mock's `--token-bytes`).
const BULK_TOKEN_BYTES: u64 = 4096;
/// Pause between windows.
const SETTLE_MS: u64 = 300;
/// Longest wait for stuck runs to settle, and for cut-offs beyond the
/// configured timeout.
const WAIT_SLACK: Duration = Duration::from_secs(30);

/// Every child and the working directory; dropped in order.
struct Children {
    node: Option<ChildProc>,
    edge: Option<ChildProc>,
    mocks: Vec<ChildProc>,
    tmp: TempDir,
}

impl Children {
    fn check_running(&mut self) -> Result<(), CompareError> {
        for child in self
            .node
            .iter_mut()
            .chain(self.edge.iter_mut())
            .chain(self.mocks.iter_mut())
        {
            child.check_running()?;
        }
        Ok(())
    }

    /// Edge and Node RSS now, KiB.
    fn relay_rss_kib(&self) -> Result<Rss, CompareError> {
        let read = |c: &Option<ChildProc>| match c {
            Some(c) => procstat::read_rss_kib(c.pid()),
            None => Ok(0),
        };
        Ok(Rss {
            edge_kib: read(&self.edge)?,
            node_kib: read(&self.node)?,
        })
    }
}

fn start_mock(
    opts: &IsolationOptions,
    children: &mut Children,
    args: &[String],
    stop: &AtomicBool,
) -> Result<String, CompareError> {
    let mut all = vec!["mock-provider".to_string(), "--port".into(), "0".into()];
    all.extend(args.iter().cloned());
    let name = format!("mock-{}", children.mocks.len() + 1);
    let mock = ChildProc::spawn(
        &name,
        &opts.bench_exe,
        &all,
        children.tmp.path(),
        true,
        stop,
    )?;
    let url = format!("http://{}", mock.ready_value("addr")?);
    children.mocks.push(mock);
    Ok(url)
}

fn window(
    opts: &IsolationOptions,
    target: &Target,
    model: &str,
    stop: &Arc<AtomicBool>,
) -> Result<LoadSummary, CompareError> {
    let spec = LoadSpec {
        target: target.clone(),
        model: model.to_string(),
        mode: Mode::Concurrency {
            streams: opts.normal_streams,
        },
        duration_ms: opts.window_ms,
        tokens: opts.normal_tokens,
        stream: true,
        ramp_ms: (opts.window_ms / 10).min(500),
        drain_ms: 30_000,
        gap_limit_ns: None,
        cores: vec![None],
        max_in_flight: opts.normal_streams,
        api_key: None,
        request_id_prefix: None,
        progress: false,
        stop: Arc::clone(stop),
    };
    Ok(load::run(&spec, &Live::new())?)
}

/// The bulk mock's `stream_bytes_written`.
fn bulk_written(bulk: &Target) -> Result<u64, CompareError> {
    let (status, body) = load::get_blocking(bulk, "/admin/stats")?;
    let stats: serde_json::Value = serde_json::from_slice(&body).map_err(|e| {
        CompareError::Options(format!(
            "the bulk mock's stats are not JSON ({status}): {e}"
        ))
    })?;
    Ok(stats["stream_bytes_written"].as_u64().unwrap_or(0))
}

/// Leases the Edge holds for `provider_id` now (`/status` in_flight).
fn in_flight(edge: &Target, provider_id: &str) -> Result<u64, CompareError> {
    let (_, body) = load::get_blocking(edge, "/status")?;
    let status: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|e| CompareError::Options(format!("/status is not JSON: {e}")))?;
    Ok(status["providers"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["provider_id"] == provider_id))
        .and_then(|p| p["in_flight"].as_u64())
        .unwrap_or(0))
}

/// Polls `read` until it returns the same value twice 300 ms apart.
fn settled(
    what: &str,
    stop: &AtomicBool,
    mut read: impl FnMut() -> Result<u64, CompareError>,
) -> Result<u64, CompareError> {
    let deadline = clock::now() + WAIT_SLACK;
    let mut last = read()?;
    while clock::now() < deadline {
        interrupted(stop)?;
        std::thread::sleep(Duration::from_millis(300));
        let now = read()?;
        if now == last {
            return Ok(now);
        }
        last = now;
    }
    Err(CompareError::Options(format!("{what} never settled")))
}

/// Runs the whole measurement. Progress goes to stderr.
pub fn run(
    opts: &IsolationOptions,
    stop: &Arc<AtomicBool>,
) -> Result<IsolationReport, CompareError> {
    check_binary(&opts.bench_exe)?;
    let machine = procstat::machine_info();
    let mut children = Children {
        node: None,
        edge: None,
        mocks: Vec::new(),
        tmp: TempDir::create(opts.keep_temp)?,
    };
    let normal_url = start_mock(
        opts,
        &mut children,
        &[
            "--tokens".into(),
            opts.normal_tokens.to_string(),
            "--inter-token-ms".into(),
            opts.inter_token_ms.to_string(),
            "--model-list".into(),
            NORMAL_MODEL.into(),
        ],
        stop,
    )?;
    let bulk_tokens = opts.bulk_bytes.div_ceil(BULK_TOKEN_BYTES);
    let bulk_url = start_mock(
        opts,
        &mut children,
        &[
            "--tokens".into(),
            bulk_tokens.to_string(),
            "--token-bytes".into(),
            BULK_TOKEN_BYTES.to_string(),
            "--inter-token-ms".into(),
            "0".into(),
            "--model-list".into(),
            BULK_MODEL.into(),
        ],
        stop,
    )?;
    let names = ClusterNames::bench(NORMAL_MODEL, NORMAL_MODEL);
    let routes = [
        MockRoute {
            name: "normal".into(),
            base_url: normal_url.clone(),
            target: NORMAL_MODEL.into(),
            model: NORMAL_MODEL.into(),
        },
        MockRoute {
            name: "bulk".into(),
            base_url: bulk_url.clone(),
            target: BULK_MODEL.into(),
            model: BULK_MODEL.into(),
        },
    ];
    let extra = [
        format!("flow_window_bytes = {}", opts.flow_window_bytes),
        format!(
            "client_write_stall_timeout_ms = {}",
            opts.client_write_stall_timeout_ms
        ),
    ];
    let dir = children.tmp.path().join("relay");
    let edge_config = edge_toml_for(&names, &routes, &extra);
    let spec = RelaySpec {
        names: &names,
        edge_config: &edge_config,
        cores: (&opts.cores.0, &opts.cores.1),
        status_key: None,
    };
    let pair = spawn_relay(&opts.bin_dir, &dir, &spec, stop, &mut || Ok(()))?;
    children.edge = Some(pair.edge);
    children.node = Some(pair.node);
    let edge = Target::parse(&pair.url)?;
    let direct = Target::parse(&normal_url)?;
    let bulk = Target::parse(&bulk_url)?;
    let edge_addr: SocketAddr = pair
        .url
        .trim_start_matches("http://")
        .parse()
        .map_err(|e| CompareError::Options(format!("edge address {}: {e}", pair.url)))?;
    eprintln!(
        "bench isolation: edge {} mocks {normal_url} {bulk_url}",
        pair.url
    );

    // Warm-up, both paths.
    interrupted(stop)?;
    let warm = window(opts, &edge, NORMAL_MODEL, stop)?;
    if warm.requests_ok == 0 {
        return Err(CompareError::ArmBroken {
            arm: "relay".into(),
            first_error: warm.first_error.unwrap_or_else(|| "no response".into()),
        });
    }
    window(opts, &direct, NORMAL_MODEL, stop)?;

    let mut rounds = Vec::new();
    for round in 0..opts.rounds {
        interrupted(stop)?;
        children.check_running()?;
        let a_direct = window(opts, &direct, NORMAL_MODEL, stop)?;
        std::thread::sleep(Duration::from_millis(SETTLE_MS));
        let a_relay = window(opts, &edge, NORMAL_MODEL, stop)?;
        let rss_before_kib = children.relay_rss_kib()?;
        let written_before = bulk_written(&bulk)?;

        let mut stuck = Vec::new();
        for _ in 0..opts.never_readers {
            stuck.push(
                NeverReader::open(edge_addr, BULK_MODEL, bulk_tokens).map_err(|source| {
                    CompareError::Io {
                        what: "open a never-reader".into(),
                        source,
                    }
                })?,
            );
        }
        let k = u64::from(opts.never_readers);
        let dispatched = clock::now() + WAIT_SLACK;
        while in_flight(&edge, "bulk-1")? < k {
            interrupted(stop)?;
            if clock::now() > dispatched {
                return Err(CompareError::Options(
                    "the never-readers' runs were never all dispatched".into(),
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let written_stuck = settled("the bulk mock's writes", stop, || bulk_written(&bulk))?
            .saturating_sub(written_before);
        let rss_stuck_kib = children.relay_rss_kib()?;
        let b_relay = window(opts, &edge, NORMAL_MODEL, stop)?;
        std::thread::sleep(Duration::from_millis(SETTLE_MS));
        let b_direct = window(opts, &direct, NORMAL_MODEL, stop)?;
        let mut still_stuck = 0;
        for reader in &mut stuck {
            if !reader.poll_closed() {
                still_stuck += 1;
            }
        }

        // The cut-offs.
        let cut_deadline =
            clock::now() + Duration::from_millis(opts.client_write_stall_timeout_ms) + WAIT_SLACK;
        loop {
            // Every reader is polled each turn: its close is timed within
            // 20 ms.
            let open = stuck
                .iter_mut()
                .filter_map(|s| (!s.poll_closed()).then_some(()))
                .count();
            if open == 0 || clock::now() >= cut_deadline {
                break;
            }
            interrupted(stop)?;
            std::thread::sleep(Duration::from_millis(20));
        }
        let cut_off_s: Vec<Option<f64>> = stuck
            .iter()
            .map(|s| s.closed_after().map(|d| d.as_secs_f64()))
            .collect();
        let released = clock::now() + WAIT_SLACK;
        let mut leases_left = in_flight(&edge, "bulk-1")?;
        while leases_left > 0 && clock::now() < released {
            std::thread::sleep(Duration::from_millis(50));
            leases_left = in_flight(&edge, "bulk-1")?;
        }
        drop(stuck);
        std::thread::sleep(super::RETURN_WAIT);
        let rss_after_kib = children.relay_rss_kib()?;
        let result = RoundResult::of(
            round,
            [&a_direct, &a_relay, &b_relay, &b_direct],
            (rss_before_kib, rss_stuck_kib, rss_after_kib),
            written_stuck,
            still_stuck,
            cut_off_s,
            leases_left,
        );
        eprintln!("round {}/{}: {}", round + 1, opts.rounds, result.describe());
        rounds.push(result);
    }
    Ok(IsolationReport::new(
        SCHEMA,
        machine,
        commit(),
        opts.clone(),
        rounds,
    ))
}
