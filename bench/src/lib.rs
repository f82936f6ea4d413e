//! # bench — IOP's load harness and mock providers
//!
//! The `bench` binary's subcommands live here as library modules so tests
//! (and other crates' tests) can use them in-process:
//!
//! - [`mock`]: `bench mock-provider`, a mock inference server (OpenAI chat
//!   completions with tool-call modes, Responses, Anthropic Messages, Ollama
//!   native) with deterministic content, configurable pacing and fault
//!   injection, used by the demo, the end-to-end tests and the load harness.
//! - [`load`]: `bench load`, the load generator (raw HTTP/1.1 over monoio,
//!   SSE parsed as it arrives, HdrHistograms of TTFT, per-chunk latency,
//!   inter-chunk gap and end to end).
//! - [`compare`]: `bench compare`, relay-vs-direct measured side by side
//!   (latency deltas and ratios, CPU per relayed token, memory per stream,
//!   a concurrency ladder), with a JSON report.
//! - [`cores`]: `bench cores`, bulk relay throughput (body bytes/s) per
//!   `--cores` layout of edge-bin and node-bin against a direct baseline,
//!   with the ratios between layouts, and a JSON report.
//! - [`cache_routing`]: `bench cache-routing`, the Edge's per-model routing
//!   policies (least_loaded, session, prefix, against pinned models) on
//!   workloads whose speed depends on a mock's prefix cache: TTFT, cache
//!   hit rate, throughput and the goal ratios.
//! - [`fairness`]: `bench fairness`, one saturated model shared by a
//!   flooding key and a light one, with the queue in arrival order, by
//!   weighted fair queueing and by priority class: the light key's queue
//!   wait and each key's share of the admissions over time.
//! - [`instructions`]: `bench instructions`, user-space instructions per
//!   relayed token of the Edge and the Node (and of a peer proxy) counted
//!   by callgrind.
//! - [`fixtures`]: `bench tls-fixtures`, the certificates of the TLS tests
//!   (SPIFFE identities and their rotations, HTTPS server certificates that
//!   are good, for the wrong host, expired, or from an unknown CA).
//! - [`swarm`]: `bench swarm`, one Edge and up to thousands of simulated
//!   Nodes in one process (RSS per node, cold start and restart recovery,
//!   dispatch latency, heartbeat CPU, Control's decision costs).
//! - [`bodies`]: `bench bodies`, the Edge's memory (RSS before, peak and
//!   after) under bursts of large many-message request bodies.
//! - [`isolation`]: `bench isolation`, what clients that never read cost
//!   everyone else on the same node connection.
//! - [`stats`] (histograms, medians) and [`procstat`] (`/proc` readers):
//!   the pure pieces both use.
//!
//! ```text
//! client ──HTTP/1.1──► mock::server (monoio shell, iop_engine::http)
//!                         │ method, path, body
//!                         ▼
//!                      mock::openai::MockProvider (pure: Reply / StreamPlan)
//! ```

#![forbid(unsafe_code)]

pub mod bodies;
pub mod cache_routing;
pub mod compare;
pub mod cores;
pub mod fairness;
pub mod fixtures;
pub mod instructions;
pub mod isolation;
pub mod load;
pub mod mock;
pub mod procstat;
pub mod stats;
pub mod swarm;
