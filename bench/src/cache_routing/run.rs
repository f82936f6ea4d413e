//! The orchestration of `bench cache-routing`: per pool size, start the
//! mocks, the Edge and the Node, warm every model up, run each workload's
//! rounds of windows, assemble the report.

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use super::client::{self, Batch};
use super::report::{
    check_goals, summarize_arm, CacheRoutingReport, EdgeRouting, PoolReport, WindowRecord,
    WorkloadReport, SCHEMA,
};
use super::workload::{
    pinned_model, shared_prompt_requests, unique_prompt_requests, Conversation, ConversationShape,
    IndependentRequest, Message, Policy, SharedShape, WindowTag, Workload, MOCK_MODEL,
};
use super::CacheRoutingOptions;
use crate::compare::config::{edge_toml_pool, ClusterNames, PoolModel, PoolProvider};
use crate::compare::procs::{ChildProc, TempDir};
use crate::compare::run::{
    check_binary, commit, interrupted, spawn_relay, wait_for_status, RelaySpec,
};
use crate::compare::CompareError;
use crate::load::{self, Target};
use crate::procstat;

/// Pause between windows so every request of one has left every process
/// before the next starts.
const SETTLE_MS: u64 = 100;
/// Conversation `i` of a multi-turn window starts `i ×` this in, so the
/// first turns do not all arrive in the same instant.
const STAGGER_MS: u64 = 5;

/// One pool's children. Fields drop in order: the Node first, then the
/// Edge, then the mocks.
struct Pool {
    node: ChildProc,
    edge: ChildProc,
    mocks: Vec<ChildProc>,
}

impl Pool {
    fn check_running(&mut self) -> Result<(), CompareError> {
        self.node.check_running()?;
        self.edge.check_running()?;
        for mock in &mut self.mocks {
            mock.check_running()?;
        }
        Ok(())
    }
}

/// The mocks' prefix-cache counters, summed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct CacheCounters {
    prompt_tokens_seen: u64,
    cached_tokens_hit: u64,
}

impl CacheCounters {
    /// Reads and sums `GET /admin/stats` of every mock.
    fn read(mocks: &[Target]) -> Result<Self, CompareError> {
        let mut total = CacheCounters::default();
        for mock in mocks {
            let (status, body) = load::get_blocking(mock, "/admin/stats")?;
            let stats: serde_json::Value = serde_json::from_slice(&body)
                .ok()
                .filter(|_| status == 200)
                .ok_or_else(|| {
                    CompareError::Options(format!(
                        "GET {}/admin/stats answered {status}: {}",
                        mock.url,
                        String::from_utf8_lossy(&body)
                    ))
                })?;
            let count = |key: &str| {
                stats[key].as_u64().ok_or_else(|| {
                    CompareError::Options(format!("{}/admin/stats has no `{key}`", mock.url))
                })
            };
            total.prompt_tokens_seen += count("prompt_tokens_seen")?;
            total.cached_tokens_hit += count("cached_tokens_hit")?;
        }
        Ok(total)
    }

    fn since(self, before: CacheCounters) -> CacheCounters {
        CacheCounters {
            prompt_tokens_seen: self
                .prompt_tokens_seen
                .saturating_sub(before.prompt_tokens_seen),
            cached_tokens_hit: self
                .cached_tokens_hit
                .saturating_sub(before.cached_tokens_hit),
        }
    }
}

/// The Edge's routing counters of `policy`'s model(s), summed (the pinned
/// arm: every `pinned-i`), from a `/status` document.
fn edge_routing_of(status: &serde_json::Value, policy: Policy) -> EdgeRouting {
    let mine = |name: &str| match policy {
        Policy::Pinned => name.starts_with("pinned-"),
        pooled => name == pooled.name(),
    };
    let count = |routing: &serde_json::Value, key: &str| routing[key].as_u64().unwrap_or(0);
    status["models"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["model"].as_str().is_some_and(mine))
        .map(|m| &m["routing"])
        .fold(EdgeRouting::default(), |sum, r| {
            sum.plus(EdgeRouting {
                routed_by_load: count(r, "routed_by_load"),
                routed_by_match: count(r, "routed_by_match"),
                routed_by_session: count(r, "routed_by_session"),
                imbalance_fallbacks: count(r, "imbalance_fallbacks"),
            })
        })
}

/// Reads the Edge's `/status` routing counters of `policy`'s model(s).
fn read_edge_routing(edge: &Target, policy: Policy) -> Result<EdgeRouting, CompareError> {
    let (status, body) = load::get_blocking(edge, "/status")?;
    let doc: serde_json::Value = serde_json::from_slice(&body)
        .ok()
        .filter(|_| status == 200)
        .ok_or_else(|| {
            CompareError::Options(format!("GET {}/status answered {status}", edge.url))
        })?;
    Ok(edge_routing_of(&doc, policy))
}

/// Starts mock `i` of a pool; returns it and its base URL.
fn start_mock(
    opts: &CacheRoutingOptions,
    i: u32,
    dir: &Path,
    stop: &AtomicBool,
) -> Result<(ChildProc, String), CompareError> {
    let args: Vec<String> = ["mock-provider", "--port", "0", "--model-list", MOCK_MODEL]
        .iter()
        .map(|s| s.to_string())
        .chain([
            "--tokens".into(),
            opts.reply_tokens.to_string(),
            "--ttft-ms".into(),
            opts.ttft_ms.to_string(),
            "--inter-token-ms".into(),
            opts.inter_token_ms.to_string(),
            "--prefix-cache-tokens".into(),
            opts.cache_tokens().to_string(),
            "--prefill-us-per-token".into(),
            opts.prefill_us_per_token.to_string(),
        ])
        .collect();
    let mock = ChildProc::spawn(
        &format!("mock-{i}"),
        &opts.bench_exe,
        &args,
        dir,
        true,
        stop,
    )?;
    let url = format!("http://{}", mock.ready_value("addr")?);
    Ok((mock, url))
}

/// The provider id of mock `i` on the node.
fn provider_id(i: u32) -> String {
    format!("p{i}")
}

/// `edge.toml` of a pool: one adapter and provider per mock; the models
/// `least_loaded`, `session` and `prefix` over all of them with their
/// `routing`, and `pinned-i` over provider i alone.
pub(crate) fn pool_edge_toml(names: &ClusterNames, mock_urls: &[String], capacity: u32) -> String {
    let providers: Vec<PoolProvider> = (0u32..)
        .zip(mock_urls)
        .map(|(i, url)| PoolProvider {
            adapter: provider_id(i),
            provider_id: provider_id(i),
            base_url: url.clone(),
            target: MOCK_MODEL.into(),
            capacity,
        })
        .collect();
    let all: Vec<String> = providers.iter().map(|p| p.provider_id.clone()).collect();
    let mut models: Vec<PoolModel> = Policy::ALL
        .iter()
        .filter_map(|policy| {
            policy.routing().map(|routing| PoolModel {
                name: policy.name().into(),
                providers: all.clone(),
                extra: vec![format!("routing = \"{routing}\"")],
            })
        })
        .collect();
    models.extend((0u64..).zip(&providers).map(|(i, p)| PoolModel {
        name: pinned_model(i),
        providers: vec![p.provider_id.clone()],
        extra: Vec::new(),
    }));
    edge_toml_pool(names, &providers, &models, &[])
}

/// Starts a pool of `providers` mocks, the Edge and the Node in `dir`.
fn start_pool(
    opts: &CacheRoutingOptions,
    providers: u32,
    dir: &Path,
    stop: &AtomicBool,
) -> Result<(Pool, Target, Vec<Target>), CompareError> {
    std::fs::create_dir_all(dir).map_err(|source| CompareError::Io {
        what: format!("create {}", dir.display()),
        source,
    })?;
    check_binary(&opts.bench_exe)?;
    let mut mocks = Vec::new();
    let mut urls = Vec::new();
    for i in 0..providers {
        let (mock, url) = start_mock(opts, i, dir, stop)?;
        mocks.push(mock);
        urls.push(url);
    }
    let names = ClusterNames::bench(Policy::LeastLoaded.name(), MOCK_MODEL);
    let edge_config = pool_edge_toml(&names, &urls, opts.capacity);
    let spec = RelaySpec {
        names: &names,
        edge_config: &edge_config,
        cores: (&opts.edge_cores, &opts.node_cores),
        status_key: None,
    };
    let pair = spawn_relay(&opts.bin_dir, dir, &spec, stop, &mut || {
        mocks.iter_mut().try_for_each(ChildProc::check_running)
    })?;
    let edge = Target::parse(&pair.url)?;
    let mut pool = Pool {
        node: pair.node,
        edge: pair.edge,
        mocks,
    };
    // Every provider of the pool connected.
    let all_connected = |status: &serde_json::Value| {
        status["providers"].as_array().map_or(0, |ps| {
            ps.iter()
                .filter(|p| p["connected"] == serde_json::Value::Bool(true))
                .count()
        }) >= providers as usize
    };
    wait_for_status(&edge, stop, &mut || pool.check_running(), &all_connected)?;
    let mock_targets = urls
        .iter()
        .map(|u| Target::parse(u))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((pool, edge, mock_targets))
}

/// One request to every model the arms use, so each is known to answer
/// before anything is measured.
fn warm_up(edge: &Target, providers: u32, stop: &Arc<AtomicBool>) -> Result<(), CompareError> {
    let mut models: Vec<String> = Policy::ALL
        .iter()
        .filter(|p| p.routing().is_some())
        .map(|p| p.name().to_string())
        .collect();
    models.extend((0..u64::from(providers)).map(pinned_model));
    for model in models {
        let messages = [Message {
            role: "user",
            content: format!("[warm-up.p{providers}.{model}] hello"),
        }];
        let request = IndependentRequest {
            body: super::workload::chat_body(&model, &messages, 1, None),
            model: model.clone(),
        };
        let batch = client::run_independent(edge, vec![request], 1, stop).map_err(|source| {
            CompareError::Io {
                what: "start a client runtime".into(),
                source,
            }
        })?;
        interrupted(stop)?;
        if let Some(error) = batch.records.iter().find_map(|r| r.error.clone()) {
            return Err(CompareError::ArmBroken {
                arm: model,
                first_error: error,
            });
        }
    }
    Ok(())
}

/// The order of the arms in `round`: forward in even rounds, reversed in
/// odd ones (ABBA), so no arm always runs first or last.
pub(crate) fn round_order(round: u32) -> Vec<Policy> {
    let mut order = Policy::ALL.to_vec();
    if round % 2 == 1 {
        order.reverse();
    }
    order
}

/// Requests in flight at most in a window of `workload` on `providers`.
fn concurrency_of(opts: &CacheRoutingOptions, workload: Workload, providers: u32) -> u32 {
    let slots = opts.capacity * providers;
    match workload {
        Workload::MultiTurn => opts.conversations_per_provider * providers,
        Workload::SharedSystemPrompt => opts.capacity.div_ceil(2) * providers,
        Workload::NoSharedPrefix => opts.unique_concurrency_per_slot * slots,
    }
}

/// Requests a window of `workload` on `providers` means to send.
fn planned_of(opts: &CacheRoutingOptions, workload: Workload, providers: u32) -> u64 {
    let per_provider = match workload {
        Workload::MultiTurn => opts.conversations_per_provider * opts.turns,
        Workload::SharedSystemPrompt => opts.shared_requests_per_provider,
        Workload::NoSharedPrefix => opts.unique_requests_per_provider,
    };
    u64::from(per_provider) * u64::from(providers)
}

/// Runs `policy`'s window of `workload` in `round`.
fn run_window(
    opts: &CacheRoutingOptions,
    edge: &Target,
    workload: Workload,
    providers: u32,
    policy: Policy,
    round: u32,
    stop: &Arc<AtomicBool>,
) -> std::io::Result<Batch> {
    let tag = WindowTag::new(workload, providers, policy, round);
    let concurrency = concurrency_of(opts, workload, providers);
    match workload {
        Workload::MultiTurn => {
            let shape = ConversationShape {
                turns: opts.turns,
                system_words: opts.system_words,
                user_words: opts.user_words,
                reply_tokens: opts.reply_tokens,
                think_ms_max: opts.think_ms_max,
            };
            let conversations = (0..concurrency)
                .map(|i| Conversation::new(&tag, i, policy, providers, shape))
                .collect();
            client::run_conversations(edge, conversations, STAGGER_MS, stop)
        }
        Workload::SharedSystemPrompt => {
            let shape = SharedShape {
                prompts: opts.shared_prompts_per_provider * providers,
                prompt_words: opts.shared_prompt_words,
                question_words: opts.question_words,
                requests: opts.shared_requests_per_provider * providers,
                reply_tokens: opts.reply_tokens,
            };
            let requests = shared_prompt_requests(&tag, policy, providers, shape);
            client::run_independent(edge, requests, concurrency, stop)
        }
        Workload::NoSharedPrefix => {
            let requests = unique_prompt_requests(
                &tag,
                policy,
                providers,
                opts.unique_requests_per_provider * providers,
                opts.unique_prompt_words,
                opts.reply_tokens,
            );
            client::run_independent(edge, requests, concurrency, stop)
        }
    }
}

/// The record of a window from its batch and the mocks' counters.
fn window_record(
    workload: Workload,
    round: u32,
    position: u32,
    policy: Policy,
    planned: u64,
    batch: &Batch,
    cache: CacheCounters,
) -> WindowRecord {
    let ok = |r: &&client::RequestRecord| r.error.is_none();
    let measured = |r: &&client::RequestRecord| workload != Workload::MultiTurn || r.turn > 0;
    let failed = batch.records.iter().filter(|r| r.error.is_some()).count() as u64;
    WindowRecord {
        round,
        position,
        policy,
        requests_planned: planned,
        requests_sent: batch.records.len() as u64,
        requests_ok: batch.records.len() as u64 - failed,
        requests_failed: failed,
        first_error: batch.records.iter().find_map(|r| r.error.clone()),
        wall_us: batch.wall_us,
        prompt_tokens_seen: cache.prompt_tokens_seen,
        cached_tokens_hit: cache.cached_tokens_hit,
        edge_routing: EdgeRouting::default(),
        ttft_us: batch
            .records
            .iter()
            .filter(ok)
            .filter(measured)
            .filter_map(|r| r.ttft_us)
            .collect(),
        first_turn_ttft_us: batch
            .records
            .iter()
            .filter(ok)
            .filter(|r| workload == Workload::MultiTurn && r.turn == 0)
            .filter_map(|r| r.ttft_us)
            .collect(),
    }
}

fn describe(w: &WindowRecord) -> String {
    let p50 = super::report::percentile(&w.ttft_us, 0.5);
    format!(
        "{} ok of {}, {} failed; TTFT p50 {}; cache hit {}; {:.1} req/s{}",
        w.requests_ok,
        w.requests_sent,
        w.requests_failed,
        p50.map_or_else(|| "-".into(), |us| load::format_us(us as f64)),
        if w.prompt_tokens_seen > 0 {
            format!(
                "{:.1} %",
                w.cached_tokens_hit as f64 * 100.0 / w.prompt_tokens_seen as f64
            )
        } else {
            "-".into()
        },
        if w.wall_us > 0 {
            w.requests_ok as f64 * 1e6 / w.wall_us as f64
        } else {
            0.0
        },
        w.first_error
            .as_ref()
            .map_or_else(String::new, |e| format!(" (first error: {e})")),
    )
}

/// The whole measurement on a pool of `providers`.
fn run_pool(
    opts: &CacheRoutingOptions,
    providers: u32,
    dir: &Path,
    stop: &Arc<AtomicBool>,
) -> Result<PoolReport, CompareError> {
    let (mut pool, edge, mocks) = start_pool(opts, providers, dir, stop)?;
    eprintln!(
        "bench cache-routing: {providers} providers: edge {}, mocks {}",
        edge.url,
        mocks
            .iter()
            .map(|m| m.url.as_str())
            .collect::<Vec<_>>()
            .join(" ")
    );
    warm_up(&edge, providers, stop)?;
    let mut workloads = Vec::new();
    for workload in Workload::ALL {
        let planned = planned_of(opts, workload, providers);
        let mut windows = Vec::new();
        for round in 0..opts.rounds {
            for (position, policy) in (0u32..).zip(round_order(round)) {
                interrupted(stop)?;
                pool.check_running()?;
                let before = CacheCounters::read(&mocks)?;
                let routing_before = read_edge_routing(&edge, policy)?;
                let batch = run_window(opts, &edge, workload, providers, policy, round, stop)
                    .map_err(|source| CompareError::Io {
                        what: "start a client runtime".into(),
                        source,
                    })?;
                interrupted(stop)?;
                let cache = CacheCounters::read(&mocks)?.since(before);
                let routing = routing_before.until(read_edge_routing(&edge, policy)?);
                let mut record =
                    window_record(workload, round, position, policy, planned, &batch, cache);
                record.edge_routing = routing;
                eprintln!(
                    "p{providers} {} round {}/{} {:<12} {}",
                    workload.name(),
                    round + 1,
                    opts.rounds,
                    policy.name(),
                    describe(&record)
                );
                windows.push(record);
                std::thread::sleep(Duration::from_millis(SETTLE_MS));
            }
        }
        let arms = Policy::ALL
            .iter()
            .map(|&policy| summarize_arm(policy, &windows))
            .collect();
        workloads.push(WorkloadReport {
            workload,
            concurrency: concurrency_of(opts, workload, providers),
            requests_per_window: planned,
            windows,
            arms,
        });
    }
    pool.check_running()?;
    drop(pool);
    let goals = check_goals(&workloads);
    Ok(PoolReport {
        providers,
        conversations: opts.conversations_per_provider * providers,
        shared_prompts: opts.shared_prompts_per_provider * providers,
        cache_tokens_per_provider: opts.cache_tokens(),
        workloads,
        goals,
    })
}

/// Runs the whole measurement, one pool size after the other. Progress
/// goes to stderr; the caller prints and writes the returned report.
pub fn run(
    opts: &CacheRoutingOptions,
    stop: &Arc<AtomicBool>,
) -> Result<CacheRoutingReport, CompareError> {
    procstat::raise_nofile_limit()?;
    let machine = procstat::machine_info();
    let tmp = TempDir::create(opts.keep_temp)?;
    if opts.keep_temp {
        eprintln!(
            "bench cache-routing: working directory {}",
            tmp.path().display()
        );
    }
    let mut pools = Vec::new();
    for &providers in &opts.providers {
        let dir = tmp.path().join(format!("p{providers}"));
        pools.push(run_pool(opts, providers, &dir, stop)?);
    }
    let failed_requests = pools
        .iter()
        .flat_map(|p| &p.workloads)
        .flat_map(|w| &w.windows)
        .map(|w| w.requests_failed)
        .sum();
    let mut notes = vec![
        format!(
            "each mock's prefix cache holds {} tokens: {} conversations at their longest ({} words); \
             with C = {} × P conversations a provider that sees all of them cannot keep them",
            opts.cache_tokens(),
            opts.cache_conversations,
            opts.conversation_tokens_max(),
            opts.conversations_per_provider
        ),
        "TTFT is measured from writing the request to the first content chunk, so it includes \
         any wait in the Edge's queue (capacity per provider)"
            .to_string(),
        "every text is unique per pool, workload, arm and round: no window is warmed by another"
            .to_string(),
    ];
    if machine.nproc < 4 {
        notes.push(format!(
            "this machine has {} CPUs shared by the client, the mocks, the Edge and the Node",
            machine.nproc
        ));
    }
    Ok(CacheRoutingReport {
        schema: SCHEMA,
        created_unix_ms: iop_engine::clock::unix_ms(),
        machine,
        commit: commit(),
        options: opts.clone(),
        pools,
        failed_requests,
        notes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_alternate_the_order() {
        use Policy::*;
        assert_eq!(round_order(0), [LeastLoaded, Session, Prefix, Pinned]);
        assert_eq!(round_order(1), [Pinned, Prefix, Session, LeastLoaded]);
        assert_eq!(round_order(2), round_order(0));
    }

    #[test]
    fn the_pool_config_routes_each_model() {
        let names = ClusterNames::bench("least_loaded", MOCK_MODEL);
        let urls = [
            "http://127.0.0.1:1".to_string(),
            "http://127.0.0.1:2".to_string(),
        ];
        let text = pool_edge_toml(&names, &urls, 2);
        let models = text.split_once("\n[[models]]").map(|(_, m)| m).unwrap();
        assert_eq!(
            models,
            r#"
name = "least_loaded"
providers = ["node-bench/p0", "node-bench/p1"]
max_queue = 1000000
routing = "least_loaded"

[[models]]
name = "session"
providers = ["node-bench/p0", "node-bench/p1"]
max_queue = 1000000
routing = "session"

[[models]]
name = "prefix"
providers = ["node-bench/p0", "node-bench/p1"]
max_queue = 1000000
routing = "prefix"

[[models]]
name = "pinned-0"
providers = ["node-bench/p0"]
max_queue = 1000000

[[models]]
name = "pinned-1"
providers = ["node-bench/p1"]
max_queue = 1000000
"#
        );
        assert_eq!(text.matches("capacity = 2\n").count(), 2);
        assert!(text.contains("base_url = \"http://127.0.0.1:2\""));
    }

    #[test]
    fn routing_counters_are_summed_per_arm() {
        let status = serde_json::json!({"models": [
            {"model": "prefix", "routing": {"policy": "prefix", "routed_by_load": 3,
                "routed_by_match": 5, "routed_by_session": 0, "imbalance_fallbacks": 1}},
            {"model": "pinned-0", "routing": {"routed_by_load": 2}},
            {"model": "pinned-1", "routing": {"routed_by_load": 4, "routed_by_match": 0}},
            {"model": "session", "routing": {"routed_by_session": 7}},
        ]});
        assert_eq!(
            edge_routing_of(&status, Policy::Prefix),
            EdgeRouting {
                routed_by_load: 3,
                routed_by_match: 5,
                routed_by_session: 0,
                imbalance_fallbacks: 1
            }
        );
        assert_eq!(edge_routing_of(&status, Policy::Pinned).routed_by_load, 6);
        assert_eq!(
            edge_routing_of(&status, Policy::Session).routed_by_session,
            7
        );
        assert_eq!(
            edge_routing_of(&status, Policy::LeastLoaded),
            EdgeRouting::default()
        );
        let before = EdgeRouting {
            routed_by_load: 1,
            ..Default::default()
        };
        assert_eq!(
            before
                .until(edge_routing_of(&status, Policy::Prefix))
                .routed_by_load,
            2
        );
    }

    #[test]
    fn window_records_count_and_split_the_samples() {
        let rec = |index, turn, ttft: Option<u64>, error: Option<&str>| client::RequestRecord {
            index,
            turn,
            ttft_us: ttft,
            error: error.map(str::to_string),
        };
        let batch = Batch {
            records: vec![
                rec(0, 0, Some(50), None),
                rec(0, 1, Some(5), None),
                rec(1, 0, Some(60), None),
                rec(1, 1, None, Some("HTTP 503: x")),
            ],
            wall_us: 1000,
        };
        let cache = CacheCounters {
            prompt_tokens_seen: 10,
            cached_tokens_hit: 4,
        };
        let w = window_record(Workload::MultiTurn, 1, 2, Policy::Session, 6, &batch, cache);
        assert_eq!(
            (
                w.requests_planned,
                w.requests_sent,
                w.requests_ok,
                w.requests_failed
            ),
            (6, 4, 3, 1)
        );
        assert_eq!(w.ttft_us, [5]);
        assert_eq!(w.first_turn_ttft_us, [50, 60]);
        assert_eq!(w.first_error.as_deref(), Some("HTTP 503: x"));
        assert_eq!(
            (w.prompt_tokens_seen, w.cached_tokens_hit, w.wall_us),
            (10, 4, 1000)
        );
        let w = window_record(
            Workload::NoSharedPrefix,
            0,
            0,
            Policy::Prefix,
            4,
            &batch,
            cache,
        );
        assert_eq!(w.ttft_us, [50, 5, 60]);
        assert!(w.first_turn_ttft_us.is_empty());
    }
}
