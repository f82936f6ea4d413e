//! # iop-engine — the runtime shared by `edge-bin` and `node-bin`
//!
//! Pure cores (no IO, time passed in) sit next to the thin monoio shells that
//! move bytes between sockets and those cores:
//!
//! | module | pure core | shell |
//! |---|---|---|
//! | [`build`] | version, commit, `--version` line | io_uring probe |
//! | [`certs`] | — | dev and test certificates: a throw-away CA and SPIFFE workload certificates (`edge-bin certs`) |
//! | [`clock`] | `Clock` trait, manual clock | the one place the OS clock is read |
//! | [`config`] | config errors (`<file>: <key>: <reason>`, S3), TOML with key paths, name/trust-domain/`host:port` checks | config file and TLS file reads |
//! | [`http`] | HTTP/1.1 heads, chunked codec, SSE splitter (httparse, capped) | server/client helpers over monoio streams |
//! | [`metrics`] | per-core latency histograms and counters, merge, wrk2 and Prometheus text (fixed-bucket histograms, `process_*`, `iop_build_info`) | `SIGUSR1` dump to stderr |
//! | [`keys`] | key file and public-key text formats (C1, C4) | lease key files (0600, refused if group/world-accessible), OS randomness for leases |
//! | [`tls`] | rustls configs, SPIFFE workload identity verifiers (T2), provider and HTTPS-listener configs, reloadable identities | TLS accept/connect; a cancel-safe TLS stream for HTTP, split into reader and writer for the node link |
//! | [`conn`] | frame-connection lanes and heartbeat bookkeeping (T4) | reader/writer tasks over TLS |
//! | [`pool`] | fixed-size buffer slab, generation-checked ids | owned-buffer IO, zero-copy `Bytes` hand-off |
//! | [`sync`] | single-core `Notify` and wake lists | — |
//! | [`mailbox`] | — | bounded cross-core mailboxes, wake only on empty → non-empty |
//! | [`memory`] | — | glibc allocator settings and trimming, so freed buffers go back to the OS |
//! | [`net`] | deadline decisions, per-peer log throttle | per-connection deadlines on one timing wheel per runtime (`shutdown(2)` from outside), accept gate |
//! | [`resolve`] | name cache policy (fresh, stale-while-revalidate, negative) | resolver threads: host names never block a core |
//! | [`rng`] | seeded SplitMix64 (reconnect jitter, harnesses; not for secrets) | OS seed |
//! | [`rt`] | `--cores` list parsing | monoio bootstrap, driver detection |
//! | [`trace`] | W3C `traceparent`, sampling, spans, OTLP encoding | the OTLP/HTTP exporter thread (bounded queue) |
//! | [`wheel`] | hierarchical timing wheel (O(1) insert/cancel, generation-checked handles) | per-core tick task |
//!
//! ```text
//! provider socket ─► Node ─► frame conn (TLS) ─► Edge ─► client socket
//!                          control lane ahead of bulk body frames (T4)
//! ```
//!
//! Unsafe code is confined to the buffer/IO modules (and the two allocator
//! calls in [`memory`]), each block with a `// SAFETY:` note.

pub mod base64;
pub mod build;
pub mod certs;
pub mod clock;
pub mod config;
pub mod conn;
pub mod http;
pub mod keys;
pub mod mailbox;
pub mod memory;
pub mod metrics;
pub mod net;
pub mod pool;
pub mod resolve;
pub mod rng;
pub mod rt;
pub mod sync;
pub mod tls;
pub mod trace;
pub mod wheel;
