//! # node-bin — the IOP Node daemon
//!
//! Runs on a GPU host, dials *out* to the Edge over one mutually-authenticated
//! TLS connection, registers, applies the config the Edge pushes, and serves
//! provider tunnels and normalized runs against local inference servers,
//! each attempt watched by the response-stall watchdog.
//!
//! ## Parts, and the way a body travels
//!
//! ```text
//!  supervisor ──► session ──► attempt ──► calls ──► provider socket
//!  (dial, S1–S3)  (frames in)  (watched)   (IO on the core owning the socket)
//!
//!  provider socket ─read─► calls: pooled buffer ─Bytes─► OutputTx ══queue══►
//!     attempt: ProviderSide ─► Watchdog + Emitter ─frame─► Edge connection
//! ```
//!
//! The arrows only point one way, down this table: [`supervisor`] runs
//! sessions, [`session`] starts attempts, an [`attempt`] reads the outputs
//! of its call, [`calls`] know nothing of frames, watchdogs or sessions,
//! and [`adapters`] nothing of calls; each module below them uses only
//! modules further down.
//!
//! | module | owns |
//! |---|---|
//! | [`supervisor`] | dialling and redialling the Edge (S1–S3), the shutdown drain |
//! | [`edges`] | which Edge an attempt reaches: the shuffled addresses of `edge_addr`, the accepted `edge_name`s (T2) |
//! | [`session`] | one Edge session: register → apply config → ready (R2, R3); the run table (K1, F5, W10); tunnel and run admission (W1, P4, C2); commands (K2, H6); refresh (K3) |
//! | [`attempt`] | one watched attempt: the [`attempt::watchdog`] core (W3–W10), the [`attempt::emit`] cores (U1, E1), the session's observation sequence (W7), and the `drive` shell |
//! | [`calls`] | provider IO: the tunnel exchange, the normalized-run exchanges (Ollama NDJSON; OpenAI SSE with E4/E5), the per-core keep-alive pool, the worker cores |
//! | [`adapters`] | adapter instances from the Edge's config (P4 gates, endpoints, profile paths), the provider dial ([`adapters::dial`]) and the exact-target health probe (W4, H6) |
//! | [`credentials`] | the Node half of the credential plane: recipient key, issuer key, origin pins, replay window, the per-tunnel lease decision (C2, C3, C5) |
//! | [`metrics`] | the Node's Prometheus text: the METRICS answer and the optional textfile |
//! | [`config`] | the configuration file (`--config node.toml`) |
//! | [`jitter`] | the spread of each reconnect wait (`reconnect.jitter_percent`) |
//! | [`trace`] | the provider call's span and the `traceparent` the provider gets (`[tracing]`) |
//! | [`timers`] | the per-core timer wheel behind every watchdog deadline |
//! | [`codes`] | failure codes of `ERROR` terminals that are not stalls (W6) |
//!
//! With one core (`--cores 0`, the default) everything runs on that thread
//! and provider calls take no mailbox hop. With more, the first core is the
//! control shard — session, run table, watchdog wheel, emitters, capacity
//! gates, probes — and the others only run provider calls
//! ([`calls::workers`]); a cancel or stall aborts across cores, and the
//! capacity permit, held on the control shard, is released only when the
//! worker reports the call's return (W10).
//!
//! Pure cores (no IO, `now` passed in): [`attempt::watchdog`],
//! [`attempt::emit`], [`session::runs`], [`session::refresh`],
//! [`attempt::observation`], the policy half of [`supervisor`], the
//! classification halves of [`adapters::probe`] and [`session::commands`],
//! and the idle-pool policy of [`calls::pool`].
//!
//! Exit codes: 0 after SIGTERM/SIGINT; 1 for bad configuration, unreadable
//! credentials, a worker core that cannot start, or exhausted reconnect
//! attempts (S3).

#![forbid(unsafe_code)]

pub mod adapters;
pub mod attempt;
pub mod calls;
pub mod codes;
pub mod config;
pub mod credentials;
pub mod edges;
pub mod jitter;
pub mod metrics;
pub mod session;
pub mod supervisor;
pub mod timers;
pub mod trace;
