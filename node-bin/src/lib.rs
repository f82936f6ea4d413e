//! # node-bin — the IOP Node daemon
//!
//! Runs on a GPU host, dials *out* to the Edge over one mutually-authenticated
//! TLS connection, registers, applies the config the Edge pushes, and serves
//! provider tunnels against local inference servers, each watched by the
//! response-stall watchdog, and normalized runs through its Ollama and
//! OpenAI-compatible adapters ([`normalized`], [`ollama`], [`openai_run`]).
//!
//! ```text
//! control shard (first --cores core)
//! supervisor (dial, redial: S1–S3; pure Supervisor policy)
//!   └─ session (register → apply config → ready: R2, R3; F5 on disconnect;
//!      │        owns the observation sequence, W7)
//!      ├─ run manager: RunTable (K1 cancel one, F5 cancel all, W10 entry
//!      │    kept until the provider call returns)
//!      ├─ tunnel per request: W1 check, capacity gate (P4), credential lease
//!      │    (C2, [`credentials`]), provider call ([`tunnel::TunnelCall`])
//!      ├─ normalized run per request: W1 check, capacity gate (P4), provider
//!      │    call by adapter ([`normalized::RunCall`]: Ollama NDJSON; OpenAI
//!      │    SSE with E4/E5)
//!      │    └─ driver: Watchdog core (W3–W10) + TunnelEmitter/RunEmitter
//!      │         ├─ timers: one hierarchical wheel per core (engine::wheel)
//!      │         ├─ probe: bounded fail-closed exact-target health probe
//!      │         └─ spawn_provider ─┬─ one core: a task on this core, this
//!      │                            │    core's provider_pool
//!      │                            └─ ≥ 2 cores: workers ──Job──► worker core
//!      ├─ commands (K2, H6): CAPABILITIES, TRANSPORT_STATUS,
//!      │    PROVIDER_STATUS, OLLAMA_QUERY
//!      └─ refresh (K3): APPLIED / RESTART_REQUIRED / FAILED
//!
//! worker cores (every other --cores core; [`workers`])
//!   job inbox ─► provider call task: HTTP exchange (+ stream parser of a
//!   │            normalized run) on this core's provider_pool
//!   │            (per-core keep-alive pool: LIFO per host:port, bounded,
//!   │            idle timeout, one stale retry; sweeper on this core's wheel)
//!   └─ outputs (bounded mailbox; body `Bytes` moved, never copied) ─► driver
//! ```
//!
//! With one core (`--cores 0`, the default) everything runs on that thread
//! and provider calls take no mailbox hop. With more, the first core is the
//! control shard — session, run manager, watchdog wheel, emitters, capacity
//! gates, probes — and the others only run provider calls; a cancel or stall
//! aborts across cores, and the capacity permit, held on the control shard,
//! is released only when the worker reports the call's return (W10).
//!
//! Pure cores (no IO, `now` passed in): [`watchdog`], [`emit`], [`runs`],
//! [`refresh`], [`observation`], the policy half of [`supervisor`] and the
//! classification half of [`probe`] and [`commands`], and the idle-pool
//! policy of [`provider_pool`]. Shells: [`session`], [`tunnel`], [`driver`],
//! [`timers`], [`workers`].
//!
//! Exit codes: 0 after SIGTERM/SIGINT; 1 for bad configuration, unreadable
//! credentials, a worker core that cannot start, or exhausted reconnect
//! attempts (S3).

pub mod adapters;
pub mod commands;
pub mod config;
pub mod credentials;
pub mod driver;
pub mod emit;
pub mod normalized;
pub mod observation;
pub mod ollama;
pub mod openai_run;
pub mod probe;
pub mod provider_pool;
pub mod refresh;
pub mod runs;
pub mod session;
pub mod supervisor;
pub mod timers;
pub mod tunnel;
pub mod watchdog;
pub mod workers;
