//! The orchestration of `bench fairness`: start the mock, the Edge (three
//! models, six client keys, a JSON access log in a file) and the Node;
//! run each arm's latency and share phases (keys A and B on two load
//! threads at once); read the access log back and assemble the report.

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use super::report::{
    arm_report, parse_line, request_id_prefix, Arm, FairnessReport, Key, Phase, RequestLine, SCHEMA,
};
use super::FairnessOptions;
use crate::compare::config::{edge_toml_pool, ClusterNames, PoolModel, PoolProvider};
use crate::compare::procs::{ChildProc, TempDir};
use crate::compare::run::{
    check_binary, commit, interrupted, spawn_relay, wait_for_status_as, RelaySpec,
};
use crate::compare::CompareError;
use crate::load::{self, ApiKey, Live, LoadSpec, LoadSummary, Mode, Target};
use crate::procstat;

/// The model the mock serves.
const MOCK_MODEL: &str = "mock-fair";
/// The key `/status` and `/metrics` are read with (scope admin).
const ADMIN_KEY: &str = "sk-bench-fair-admin-0123456789abcdef";
/// Its principal.
const ADMIN_PRINCIPAL: &str = "bench-admin";
/// A queued request waits this long at most (far beyond any phase).
const QUEUE_TIMEOUT_MS: u64 = 600_000;
/// Longest wait for every model's queue to empty after a phase.
const SETTLE_TIMEOUT_MS: u64 = 30_000;
/// Poll interval of that wait.
const SETTLE_POLL_MS: u64 = 100;
/// The Edge's access-log writer flushes within about 20 ms; wait this
/// long before reading the file.
const ACCESS_LOG_FLUSH_MS: u64 = 500;

/// The secret of `key`'s client key in `arm`.
fn key_secret(arm: Arm, key: Key) -> String {
    format!(
        "sk-bench-fair-{}-{}-0123456789abcdef",
        arm.name(),
        key.name()
    )
}

/// The `[[client_keys]]` tables: two per arm (principal and priority per
/// [`Arm`]), and the admin key.
pub(crate) fn client_keys_toml() -> String {
    let hash = |secret: &str| edge_bin::plane::client_keys::client_key_hash_hex(secret.as_bytes());
    let mut text = String::new();
    for arm in Arm::ALL {
        for key in Key::ALL {
            text.push_str(&format!(
                "\n[[client_keys]]\nprincipal = \"{}\"\nkey_hash = \"{}\"\npriority = \"{}\"\nweight = 1\n",
                arm.principal(key),
                hash(&key_secret(arm, key)),
                arm.priority(key),
            ));
        }
    }
    text.push_str(&format!(
        "\n[[client_keys]]\nprincipal = \"{ADMIN_PRINCIPAL}\"\nkey_hash = \"{}\"\nscopes = [\"admin\"]\n",
        hash(ADMIN_KEY)
    ));
    text
}

/// `edge.toml`: one adapter and provider per arm (capacity `capacity`,
/// all on the one mock), a model per arm over its provider, the access
/// log as JSON lines to `access_log`, and the client keys.
pub(crate) fn fairness_edge_toml(
    names: &ClusterNames,
    mock_url: &str,
    capacity: u32,
    access_log: &Path,
) -> String {
    let providers: Vec<PoolProvider> = Arm::ALL
        .iter()
        .map(|arm| PoolProvider {
            adapter: arm.name().into(),
            provider_id: arm.name().into(),
            base_url: mock_url.into(),
            target: MOCK_MODEL.into(),
            capacity,
        })
        .collect();
    let models: Vec<PoolModel> = Arm::ALL
        .iter()
        .map(|arm| PoolModel {
            name: arm.name().into(),
            providers: vec![arm.name().into()],
            extra: vec![format!("queue_timeout_ms = {QUEUE_TIMEOUT_MS}")],
        })
        .collect();
    // A JSON string is a TOML basic string.
    let path = serde_json::to_string(&access_log.display().to_string()).unwrap_or_default();
    let extra = [format!(
        "access_log = {{ destination = {path}, format = \"json\" }}"
    )];
    edge_toml_pool(names, &providers, &models, &extra) + &client_keys_toml()
}

/// The children. Fields drop in order: the Node, the Edge, the mock.
struct Relay {
    node: ChildProc,
    edge: ChildProc,
    mock: ChildProc,
}

impl Relay {
    fn check_running(&mut self) -> Result<(), CompareError> {
        self.node.check_running()?;
        self.edge.check_running()?;
        self.mock.check_running()
    }
}

/// Reads `/status` with the admin key.
fn status(edge: &Target) -> Result<serde_json::Value, CompareError> {
    let (code, body) = load::get_blocking_as(edge, "/status", Some(&ApiKey::new(ADMIN_KEY)))?;
    serde_json::from_slice(&body)
        .ok()
        .filter(|_| code == 200)
        .ok_or_else(|| CompareError::Options(format!("GET {}/status answered {code}", edge.url)))
}

/// Requests queued over every model, from a `/status` document.
fn queued(status: &serde_json::Value) -> u64 {
    status["models"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| m["queued"].as_u64().unwrap_or(0))
        .sum()
}

/// `iop_edge_access_log_dropped_lines_total` from `/metrics`.
fn dropped_lines(edge: &Target) -> Result<u64, CompareError> {
    let (_, body) = load::get_blocking_as(edge, "/metrics", Some(&ApiKey::new(ADMIN_KEY)))?;
    Ok(String::from_utf8_lossy(&body)
        .lines()
        .filter(|l| l.starts_with("iop_edge_access_log_dropped_lines_total"))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum())
}

/// Starts the mock, the Edge and the Node in `dir`; waits for every
/// provider.
fn start(
    opts: &FairnessOptions,
    dir: &Path,
    stop: &AtomicBool,
) -> Result<(Relay, Target), CompareError> {
    std::fs::create_dir_all(dir).map_err(|source| CompareError::Io {
        what: format!("create {}", dir.display()),
        source,
    })?;
    check_binary(&opts.bench_exe)?;
    let args: Vec<String> = [
        "mock-provider".to_string(),
        "--port".into(),
        "0".into(),
        "--model-list".into(),
        MOCK_MODEL.into(),
        "--tokens".into(),
        opts.tokens.to_string(),
        "--ttft-ms".into(),
        opts.ttft_ms.to_string(),
        "--inter-token-ms".into(),
        opts.inter_token_ms.to_string(),
    ]
    .to_vec();
    let mut mock = ChildProc::spawn("mock", &opts.bench_exe, &args, dir, true, stop)?;
    let mock_url = format!("http://{}", mock.ready_value("addr")?);
    let names = ClusterNames::bench(Arm::Fifo.name(), MOCK_MODEL);
    let edge_config = fairness_edge_toml(&names, &mock_url, opts.capacity, &dir.join("access.log"));
    let admin = ApiKey::new(ADMIN_KEY);
    let spec = RelaySpec {
        names: &names,
        edge_config: &edge_config,
        cores: (&opts.edge_cores, &opts.node_cores),
        status_key: Some(&admin),
    };
    let pair = spawn_relay(&opts.bin_dir, dir, &spec, stop, &mut || {
        mock.check_running()
    })?;
    let edge = Target::parse(&pair.url)?;
    let mut relay = Relay {
        node: pair.node,
        edge: pair.edge,
        mock,
    };
    let all_connected = |status: &serde_json::Value| {
        status["providers"].as_array().map_or(0, |ps| {
            ps.iter()
                .filter(|p| p["connected"] == serde_json::Value::Bool(true))
                .count()
        }) == Arm::ALL.len()
    };
    wait_for_status_as(
        &edge,
        Some(&admin),
        stop,
        &mut || relay.check_running(),
        &all_connected,
    )?;
    Ok((relay, edge))
}

/// The load of `key` in `arm`'s `phase`: open loop at its rate, tagged by
/// its request ids; what is still queued `drain` after the phase is cut
/// off.
fn phase_spec(
    opts: &FairnessOptions,
    edge: &Target,
    arm: Arm,
    phase: Phase,
    key: Key,
    stop: &Arc<AtomicBool>,
) -> LoadSpec {
    let factor = match (phase, key) {
        (_, Key::A) => opts.flood_factor,
        (Phase::Latency, Key::B) => opts.latency_b_factor,
        (Phase::Share, Key::B) => opts.share_b_factor,
    };
    LoadSpec {
        target: edge.clone(),
        model: arm.name().into(),
        mode: Mode::Rate {
            per_s: factor * opts.capacity_per_s(),
        },
        duration_ms: match phase {
            Phase::Latency => opts.latency_ms,
            Phase::Share => opts.share_ms,
        },
        tokens: opts.tokens,
        stream: true,
        ramp_ms: 0,
        // Requests admitted just before the end still finish.
        drain_ms: 2 * opts.service_ms() + 500,
        gap_limit_ns: None,
        cores: vec![None],
        max_in_flight: 1_000_000,
        progress: false,
        stop: Arc::clone(stop),
        api_key: Some(ApiKey::new(&key_secret(arm, key))),
        request_id_prefix: Some(request_id_prefix(arm, phase, key)),
    }
}

/// Runs A's and B's load of one phase at once.
fn run_phase(
    opts: &FairnessOptions,
    edge: &Target,
    arm: Arm,
    phase: Phase,
    stop: &Arc<AtomicBool>,
) -> Result<(LoadSummary, LoadSummary), CompareError> {
    let spec_a = phase_spec(opts, edge, arm, phase, Key::A, stop);
    let spec_b = phase_spec(opts, edge, arm, phase, Key::B, stop);
    let (a, b) = std::thread::scope(|scope| {
        let a = scope.spawn(|| load::run(&spec_a, &Live::new()));
        let b = scope.spawn(|| load::run(&spec_b, &Live::new()));
        (a.join(), b.join())
    });
    let joined = |r: std::thread::Result<Result<LoadSummary, load::LoadError>>| match r {
        Ok(summary) => Ok(summary?),
        Err(_) => Err(CompareError::Options("a load thread panicked".into())),
    };
    Ok((joined(a)?, joined(b)?))
}

/// Waits until no model has a request queued (the cut-off requests have
/// left), then one service time for those running.
fn settle(
    opts: &FairnessOptions,
    edge: &Target,
    relay: &mut Relay,
    stop: &AtomicBool,
) -> Result<(), CompareError> {
    let mut waited = 0;
    loop {
        interrupted(stop)?;
        relay.check_running()?;
        let left = queued(&status(edge)?);
        if left == 0 {
            break;
        }
        if waited >= SETTLE_TIMEOUT_MS {
            return Err(CompareError::Options(format!(
                "{left} requests still queued {SETTLE_TIMEOUT_MS} ms after a phase"
            )));
        }
        std::thread::sleep(Duration::from_millis(SETTLE_POLL_MS));
        waited += SETTLE_POLL_MS;
    }
    std::thread::sleep(Duration::from_millis(opts.service_ms()));
    Ok(())
}

/// One request per model, so every lane and connection is warm.
fn warm_up(
    opts: &FairnessOptions,
    edge: &Target,
    stop: &Arc<AtomicBool>,
) -> Result<(), CompareError> {
    for arm in Arm::ALL {
        let spec = LoadSpec {
            mode: Mode::OneShot { streams: 1 },
            duration_ms: 10_000,
            request_id_prefix: None,
            ..phase_spec(opts, edge, arm, Phase::Latency, Key::B, stop)
        };
        let summary = load::run(&spec, &Live::new())?;
        if summary.requests_ok != 1 {
            return Err(CompareError::Options(format!(
                "the warm-up request to model {} failed: {}",
                arm.name(),
                summary.first_error.unwrap_or_default()
            )));
        }
    }
    Ok(())
}

fn describe(arm: Arm, phase: Phase, a: &LoadSummary, b: &LoadSummary) -> String {
    format!(
        "{} {}: A {} sent, {} complete; B {} sent, {} complete, client TTFT p50 {}",
        arm.name(),
        phase.name(),
        a.requests_started,
        a.requests_ok,
        b.requests_started,
        b.requests_ok,
        if b.requests_ok > 0 {
            load::format_us(b.ttft.p50_us)
        } else {
            "-".into()
        }
    )
}

/// Runs the whole measurement. Progress goes to stderr; the caller prints
/// and writes the returned report.
pub fn run(opts: &FairnessOptions, stop: &Arc<AtomicBool>) -> Result<FairnessReport, CompareError> {
    procstat::raise_nofile_limit()?;
    let machine = procstat::machine_info();
    let tmp = TempDir::create(opts.keep_temp)?;
    if opts.keep_temp {
        eprintln!("bench fairness: working directory {}", tmp.path().display());
    }
    let dir = tmp.path().join("relay");
    let (mut relay, edge) = start(opts, &dir, stop)?;
    eprintln!(
        "bench fairness: edge {}; capacity {} per model, {:.1} requests/s",
        edge.url,
        opts.capacity,
        opts.capacity_per_s()
    );
    warm_up(opts, &edge, stop)?;
    let mut latency_clients = Vec::new();
    for arm in Arm::ALL {
        for phase in Phase::ALL {
            interrupted(stop)?;
            relay.check_running()?;
            let (a, b) = run_phase(opts, &edge, arm, phase, stop)?;
            interrupted(stop)?;
            eprintln!("bench fairness: {}", describe(arm, phase, &a, &b));
            if phase == Phase::Latency {
                latency_clients.push((arm, a, b));
            }
            settle(opts, &edge, &mut relay, stop)?;
        }
    }
    std::thread::sleep(Duration::from_millis(ACCESS_LOG_FLUSH_MS));
    let access_log_dropped_lines = dropped_lines(&edge)?;
    relay.check_running()?;
    drop(relay);
    let path = dir.join("access.log");
    let text = std::fs::read_to_string(&path).map_err(|source| CompareError::Io {
        what: format!("read {}", path.display()),
        source,
    })?;
    let lines: Vec<RequestLine> = text.lines().filter_map(parse_line).collect();
    let arms = latency_clients
        .iter()
        .map(|(arm, a, b)| arm_report(*arm, &lines, (a, b), opts))
        .collect();
    let mut notes = vec![
        "fifo: both keys are one principal, whose requests run in arrival order: the queue \
         without fair queueing"
            .to_string(),
        format!(
            "queue wait = the Edge's TTFT (access log) − the mock's TTFT ({} ms); a request cut \
             off at a phase's end while queued counts with the time it waited, as a lower bound \
             (≥)",
            opts.ttft_ms
        ),
        "admission = first body byte (access log) − the mock's TTFT; a window counts when each \
         key had a request queued (read, not yet admitted nor cut off) at every moment of it"
            .to_string(),
        "A's flood is cut off at each phase's end: its requests still queued then never ran"
            .to_string(),
    ];
    if machine.nproc < 4 {
        notes.push(format!(
            "this machine has {} CPUs shared by the client, the mock, the Edge and the Node",
            machine.nproc
        ));
    }
    Ok(FairnessReport {
        schema: SCHEMA,
        created_unix_ms: iop_engine::clock::unix_ms(),
        machine,
        commit: commit(),
        debug_build: opts.bin_dir.file_name().is_some_and(|n| n == "debug"),
        options: opts.clone(),
        capacity_per_s: opts.capacity_per_s(),
        arms,
        access_log_dropped_lines,
        notes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_give_each_arm_its_principals_and_classes() {
        let text = client_keys_toml();
        let tables: Vec<&str> = text.split("[[client_keys]]\n").skip(1).collect();
        assert_eq!(tables.len(), 7);
        let field = |table: &str, name: &str| -> String {
            table
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{name} = ")))
                .unwrap_or("")
                .to_string()
        };
        let summary: Vec<(String, String)> = tables[..6]
            .iter()
            .map(|t| (field(t, "principal"), field(t, "priority")))
            .collect();
        let pair = |p: &str, c: &str| (format!("\"{p}\""), format!("\"{c}\""));
        assert_eq!(
            summary,
            [
                pair("fifo", "standard"),
                pair("fifo", "standard"),
                pair("wfq-a", "standard"),
                pair("wfq-b", "standard"),
                pair("priority-a", "batch"),
                pair("priority-b", "interactive"),
            ]
        );
        let hash_of = |secret: &str| {
            format!(
                "\"{}\"",
                edge_bin::plane::client_keys::client_key_hash_hex(secret.as_bytes())
            )
        };
        assert_eq!(
            field(tables[3], "key_hash"),
            hash_of(&key_secret(Arm::Wfq, Key::B))
        );
        assert_eq!(field(tables[6], "scopes"), "[\"admin\"]");
        assert_eq!(field(tables[6], "key_hash"), hash_of(ADMIN_KEY));
    }

    #[test]
    fn the_edge_config_has_a_model_and_provider_per_arm() {
        let names = ClusterNames::bench("fifo", MOCK_MODEL);
        let text = fairness_edge_toml(
            &names,
            "http://127.0.0.1:9",
            4,
            Path::new("/tmp/x/access.log"),
        );
        assert!(text
            .contains("access_log = { destination = \"/tmp/x/access.log\", format = \"json\" }\n"));
        for arm in Arm::ALL {
            assert!(text.contains(&format!(
                "\n[[models]]\nname = \"{0}\"\nproviders = [\"node-bench/{0}\"]\nmax_queue = 1000000\nqueue_timeout_ms = 600000\n",
                arm.name()
            )));
        }
        assert_eq!(text.matches("capacity = 4\n").count(), 3);
        assert!(text.ends_with(&client_keys_toml()));
    }

    #[test]
    fn queued_sums_every_model() {
        let status = serde_json::json!({"models": [
            {"model": "fifo", "queued": 3}, {"model": "wfq", "queued": 0},
            {"model": "priority"}
        ]});
        assert_eq!(queued(&status), 3);
        assert_eq!(queued(&serde_json::json!({})), 0);
    }
}
