//! `bench` — IOP's load harness and mock providers (see the library docs).
//!
//! Subcommands:
//!
//! - `bench mock-provider --port P [--host H] [--ttft-ms N]
//!   [--inter-token-ms N] [--tokens N] [--model-list m1,m2]`: the
//!   OpenAI-compatible mock inference server. After binding it prints one
//!   line, `IOP_READY mock-provider addr=HOST:PORT`, to stdout; it runs until
//!   SIGTERM or SIGINT and then exits 0. Logs go to stderr (`RUST_LOG`).
//!   Fault injection: `--stall-after-tokens N [--stall-ms D]` (D = 0:
//!   forever), `--drop-after-tokens N`, `--fail-status CODE`; `GET /health`
//!   flips with `POST /admin/health {"state":"healthy|unhealthy|hanging"}`.
//!   Modes: `--tool-calls` (native tool calls when `tools` are sent),
//!   `--reject-tools` (400 on `tools`, a text `<tool_call>` to the retry).
//!   Besides OpenAI chat completions it serves Ollama (`/api/chat`,
//!   `/api/tags`, `/api/version`), Anthropic Messages (`/v1/messages`,
//!   `/v1/messages/count_tokens`) and Responses (`/v1/responses`).
//!   `--require-api-key KEY`: 401 (OpenAI shape) for provider requests
//!   without `Authorization: Bearer KEY` or `x-api-key: KEY`.
//!   `--close-after-requests N`: close each connection silently after N
//!   requests (a server closing idle keep-alive connections).
//!   `--token-bytes N`: pad each chat completion content token to N bytes
//!   (body-heavy streams for throughput runs).
//!   `--tls-cert PEM --tls-key PEM`: serve HTTPS (ALPN http/1.1) instead of
//!   plain HTTP; the ready line is the same.
//!   `--prefix-cache-tokens N --prefill-us-per-token U`: model a prefix (KV)
//!   cache of N prompt words, LRU; the first token waits `--ttft-ms` plus U
//!   µs per prompt word not covered by the longest cached prefix;
//!   `/admin/stats` counts `prompt_tokens_seen` and `cached_tokens_hit`.
//! - `bench tls-fixtures --out DIR`: the certificates of the TLS tests (see
//!   `bench::fixtures`), with a manifest of their serials.
//! - `bench isolation [--quick] [--never-readers K] ...`: what clients that
//!   never read cost the other clients of one node connection (added
//!   per-chunk latency with ÷ without, RSS per stuck run, cut-off times,
//!   back-pressure); a table and `bench/results/isolation-*.json`.
//! - `bench wheel --timers N`: the timing-wheel micro-benchmark (ns per
//!   insert, cancel and expire at N timers; run it in release).
//!
//! - `bench load --url URL --model M (--concurrency N | --rate R/s)
//!   [--duration-s D] [--tokens T] [--stream true]`: drive streaming chat
//!   completions at a server; a live progress line on stderr, then a
//!   latency table (TTFT, per-chunk, inter-chunk gap, end to end).
//! - `bench compare [--quick] [--windows N] ...`: start the mock, an Edge
//!   and a Node, and measure relayed against direct side by side; a table
//!   on stdout and a JSON report in `bench/results/`.
//! - `bench cores [--quick] [--layout L]...`: bulk relay throughput with
//!   edge-bin and node-bin on each core layout (default `0` and `0-1`)
//!   against a direct baseline; a table and `bench/results/cores-*.json`.
//! - `bench swarm [--nodes N] [--quick] ...`: one Edge and N simulated
//!   Nodes (own mTLS connection and certificate each) in this process, for
//!   fleet sizes 10, 100, 1000 up to N: Edge RSS per node, cold start and
//!   SIGKILL + restart recovery (jitter on and off), dispatch latency,
//!   heartbeat CPU, and Control's decision costs; a table and
//!   `bench/results/swarm-*.json`.
//!
//! - `bench cache-routing [--quick] [--providers 2,4] [--json PATH]`: the
//!   Edge's routing policies (models `least_loaded`, `session`, `prefix`
//!   and `pinned-i`) over P mock providers with a prefix cache each, on
//!   multi-turn, shared-system-prompt and no-shared-prefix workloads; a
//!   markdown table (TTFT p50/p99, cache hit rate, requests/s, the goal
//!   ratios) and, with `--json`, the numbers.
//! - `bench fairness [--quick] [--capacity 4] [--json PATH]`: one
//!   saturated model shared by key A (a flood, 10× capacity) and key B
//!   (a low rate, then capacity) with the queue in arrival order (one
//!   principal), by weighted fair queueing (1:1) and by priority class
//!   (B interactive, A batch): B's queue wait p50/p99 and each key's share
//!   of the admissions per window from the Edge's access log, and the 1:1
//!   goal (docs/bench-fairness.md).
//! - `bench instructions [--streams 200] [--tokens 64] [--peer URL
//!   --peer-pid PID]`: user-space instructions per relayed token of the
//!   Edge and the Node under callgrind (and of a peer proxy running under
//!   callgrind), against the ≤ 6,000 goal.
//!
//! - `bench bodies [--requests N] [--messages M] [--bursts B]`: the Edge's
//!   memory (RSS before, peak, after) under bursts of N concurrent chat
//!   requests of M tiny messages each; a table and
//!   `bench/results/bodies-*.json`.
//!
//! Exit codes: 0 after a signal-driven shutdown, 1 on bad configuration or a
//! server error, 2 on unparsable arguments (argh).

#![forbid(unsafe_code)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

use argh::FromArgs;

use bench::mock::{self, MockConfig};

/// IOP load harness, mock providers and relay-vs-direct reports.
#[derive(FromArgs, Debug)]
struct Cli {
    #[argh(subcommand)]
    command: Command,
}

/// The subcommands.
#[derive(FromArgs, Debug)]
#[argh(subcommand)]
enum Command {
    MockProvider(MockProviderArgs),
    Wheel(WheelArgs),
    Load(bench::load::cli::LoadArgs),
    Compare(bench::compare::cli::CompareArgs),
    Cores(bench::cores::cli::CoresArgs),
    Isolation(bench::isolation::cli::IsolationArgs),
    Swarm(bench::swarm::cli::SwarmArgs),
    Bodies(bench::bodies::BodiesArgs),
    CacheRouting(bench::cache_routing::cli::CacheRoutingArgs),
    Fairness(bench::fairness::cli::FairnessArgs),
    Instructions(bench::instructions::cli::InstructionsArgs),
    TlsFixtures(TlsFixturesArgs),
}

/// Mint the certificates of the TLS tests into a directory (see
/// `bench::fixtures`); prints the manifest.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "tls-fixtures")]
struct TlsFixturesArgs {
    /// output directory (created if missing)
    #[argh(option)]
    out: PathBuf,
    /// SPIFFE trust domain (default iop.local)
    #[argh(option, default = "String::from(\"iop.local\")")]
    trust_domain: String,
    /// the Edge's identity name (default edge-1)
    #[argh(option, default = "String::from(\"edge-1\")")]
    edge_name: String,
    /// a node id (repeatable; default node-a)
    #[argh(option)]
    node: Vec<String>,
}

fn tls_fixtures(args: TlsFixturesArgs) -> ExitCode {
    let nodes = if args.node.is_empty() {
        vec!["node-a".to_string()]
    } else {
        args.node
    };
    match bench::fixtures::write_tls_fixtures(
        &args.out,
        &args.trust_domain,
        &args.edge_name,
        &nodes,
    ) {
        Ok(serials) => {
            println!("{}", serde_json::json!({ "serials": serials }));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bench tls-fixtures: {e}");
            ExitCode::from(1)
        }
    }
}

/// Run the OpenAI-compatible mock inference server.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "mock-provider")]
struct MockProviderArgs {
    /// TCP port to listen on (0 picks a free port)
    #[argh(option)]
    port: u16,
    /// address to bind (default 127.0.0.1)
    #[argh(option, default = "IpAddr::V4(Ipv4Addr::LOCALHOST)")]
    host: IpAddr,
    /// delay before the first content token, in milliseconds (default 0)
    #[argh(option, default = "0")]
    ttft_ms: u64,
    /// delay between content tokens, in milliseconds (default 0)
    #[argh(option, default = "0")]
    inter_token_ms: u64,
    /// tokens per completion before any max_tokens cap (default 16)
    #[argh(option, default = "16")]
    tokens: u32,
    /// comma-separated model ids served by GET /v1/models (default
    /// "mock-model")
    #[argh(option, default = "String::from(\"mock-model\")")]
    model_list: String,
    /// fault: stall after this many content tokens
    #[argh(option)]
    stall_after_tokens: Option<u32>,
    /// fault: stall length in milliseconds, 0 = forever (default 0)
    #[argh(option, default = "0")]
    stall_ms: u64,
    /// fault: close the connection after this many content tokens
    #[argh(option)]
    drop_after_tokens: Option<u32>,
    /// fault: answer every chat completion with this HTTP status
    #[argh(option)]
    fail_status: Option<u16>,
    /// answer chat requests that carry `tools` with a native tool call
    #[argh(switch)]
    tool_calls: bool,
    /// answer chat completions that carry `tools` with 400, and a retry
    /// that lists them in a `<tools>` system block with a text tool call
    #[argh(switch)]
    reject_tools: bool,
    /// answer provider requests without `Authorization: Bearer KEY` or
    /// `x-api-key: KEY` with 401
    #[argh(option)]
    require_api_key: Option<String>,
    /// close each connection, without notice, after it served this many
    /// requests (a server closing idle keep-alive connections)
    #[argh(option)]
    close_after_requests: Option<u32>,
    /// pad every chat completion content token to this many bytes (`tok{i}`,
    /// dots, a space) for body-heavy streams (default 0: unpadded)
    #[argh(option, default = "0")]
    token_bytes: u32,
    /// model an inference server's prefix (KV) cache of this many prompt
    /// tokens (whitespace-separated words), LRU (default 0: off)
    #[argh(option, default = "0")]
    prefix_cache_tokens: usize,
    /// prefill time per prompt token not covered by the cached prefix, in
    /// microseconds, added before the first token (default 0)
    #[argh(option, default = "0")]
    prefill_us_per_token: u64,
    /// serve HTTPS with this PEM certificate chain (needs --tls-key)
    #[argh(option)]
    tls_cert: Option<PathBuf>,
    /// the PEM private key of --tls-cert
    #[argh(option)]
    tls_key: Option<PathBuf>,
}

/// Measure the timing wheel: ns per insert, cancel and expire.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "wheel")]
struct WheelArgs {
    /// number of timers (default 1000000)
    #[argh(option, default = "1_000_000")]
    timers: usize,
}

fn wheel(args: WheelArgs) -> ExitCode {
    let f = iop_engine::wheel::bench_report(args.timers);
    println!(
        "wheel timers={} span_ticks={} insert_ns={:.1} cancel_ns={:.1} expire_ns={:.1}",
        f.timers, f.span_ticks, f.insert_ns, f.cancel_ns, f.expire_ns
    );
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    iop_engine::rt::init_logging();
    let cli: Cli = argh::from_env();
    match cli.command {
        Command::MockProvider(args) => mock_provider(args),
        Command::Wheel(args) => wheel(args),
        Command::Load(args) => bench::load::cli::main(args),
        Command::Compare(args) => bench::compare::cli::main(args),
        Command::Cores(args) => bench::cores::cli::main(args),
        Command::Isolation(args) => bench::isolation::cli::main(args),
        Command::Swarm(args) => bench::swarm::cli::main(args),
        Command::Bodies(args) => bench::bodies::main(args),
        Command::CacheRouting(args) => bench::cache_routing::cli::main(args),
        Command::Fairness(args) => bench::fairness::cli::main(args),
        Command::Instructions(args) => bench::instructions::cli::main(args),
        Command::TlsFixtures(args) => tls_fixtures(args),
    }
}

fn mock_provider(args: MockProviderArgs) -> ExitCode {
    let models: Vec<String> = args
        .model_list
        .split(',')
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .map(str::to_string)
        .collect();
    if models.is_empty() {
        eprintln!("bench mock-provider: --model-list: needs at least one model id");
        return ExitCode::from(1);
    }
    let config = MockConfig {
        ttft_ms: args.ttft_ms,
        inter_token_ms: args.inter_token_ms,
        tokens: args.tokens,
        models,
    };
    if args.fail_status.is_some_and(|s| !(100..=999).contains(&s)) {
        eprintln!("bench mock-provider: --fail-status: must be an HTTP status (100-999)");
        return ExitCode::from(1);
    }
    let faults = mock::MockFaults {
        stall_after_tokens: args.stall_after_tokens,
        stall_ms: args.stall_ms,
        drop_after_tokens: args.drop_after_tokens,
        fail_status: args.fail_status,
    };
    let modes = mock::MockModes {
        tool_calls: args.tool_calls,
        reject_tools: args.reject_tools,
    };
    // An SSE event must stay under the load generator's 1 MiB event cap.
    const MAX_TOKEN_BYTES: u32 = bench::cores::cli::MAX_TOKEN_BYTES;
    if args.token_bytes > MAX_TOKEN_BYTES {
        eprintln!("bench mock-provider: --token-bytes: at most {MAX_TOKEN_BYTES}");
        return ExitCode::from(1);
    }
    let mut provider = mock::MockProvider::with_faults(config, faults)
        .with_modes(modes)
        .with_token_bytes(args.token_bytes)
        .with_prefix_cache(args.prefix_cache_tokens, args.prefill_us_per_token);
    if let Some(key) = args.require_api_key {
        provider = provider.with_required_api_key(mock::auth::ApiKey::new(key));
    }
    match args.close_after_requests {
        Some(0) => {
            eprintln!("bench mock-provider: --close-after-requests: must be at least 1");
            return ExitCode::from(1);
        }
        Some(requests) => provider = provider.with_close_after_requests(requests),
        None => {}
    }
    match (args.tls_cert, args.tls_key) {
        (None, None) => {}
        (Some(cert), Some(key)) => {
            let files = iop_engine::tls::HttpsFiles {
                cert,
                key,
                client_ca: None,
            };
            match iop_engine::tls::HttpsAcceptor::from_files(&files) {
                Ok(tls) => provider = provider.with_tls(tls),
                Err(e) => {
                    eprintln!("bench mock-provider: --tls-cert/--tls-key: {e}");
                    return ExitCode::from(1);
                }
            }
        }
        _ => {
            eprintln!("bench mock-provider: --tls-cert and --tls-key go together");
            return ExitCode::from(1);
        }
    }
    let addr = SocketAddr::new(args.host, args.port);
    match iop_engine::rt::block_on(mock::run_provider(addr, provider)) {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(err)) => {
            eprintln!("bench mock-provider: {err}");
            ExitCode::from(1)
        }
        Err(err) => {
            eprintln!("bench mock-provider: cannot start the runtime: {err}");
            ExitCode::from(1)
        }
    }
}
