//! `bench load`: an open-loop (or closed-loop) load generator for
//! OpenAI-compatible streaming chat completions.
//!
//! ```text
//! run(spec) ─► one std thread per load core, each a monoio runtime
//!                │ client::run_thread: workers (N streams kept busy)
//!                │   or an open-loop scheduler (R requests/s)
//!                ▼
//!              raw HTTP/1.1 (iop_engine::http::ClientConn, TCP_NODELAY)
//!                │ body pieces ─► SseSplitter ─► chunk::StreamTracker
//!                ▼
//!              recorder::Recorder (HdrHistograms, counters) ─► merge ─► LoadSummary
//! ```
//!
//! Modes:
//! - [`Mode::Concurrency`]: N streams kept busy, each issuing its next
//!   request as soon as the previous one ends; latency from the actual send.
//! - [`Mode::Rate`]: open loop: request `n` is due at `start + n / rate`
//!   regardless of completions; latency is measured from the *due* time,
//!   so queueing in the system under test shows up (no coordinated
//!   omission).
//! - [`Mode::OneShot`]: N streams, one request each (the concurrency
//!   ladder of `bench compare`).
//!
//! Figures: TTFT (request start → first content chunk), one-way per-chunk
//! latency (`iop_mock_sent_ns` stamp → arrival), inter-chunk gap, end to
//! end; errors by cause and truncated streams (no `[DONE]`).

pub mod chunk;
pub mod cli;
mod client;
pub mod progress;
pub mod recorder;
pub mod schedule;

use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use iop_engine::clock::monotonic_raw_ns;
use iop_engine::http::{HttpError, Url, UrlError};

pub use progress::{format_us, Live};
pub use recorder::{ErrorCounts, LoadSummary, Recorder};

/// Time between spawning the load threads and the first scheduled start,
/// so every thread's runtime is up before the clock starts.
const START_DELAY_MS: u64 = 20;

/// Why a load run could not run.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The target URL is not a plain `http://host:port[/prefix]`.
    #[error("bad URL {url:?}: {source}")]
    Url {
        /// The URL given.
        url: String,
        /// Why it was refused.
        source: UrlError,
    },
    /// The target is `https://`: the load generator speaks plain HTTP
    /// (measure the relay, not a TLS stack).
    #[error("bad URL {url:?}: the load generator speaks plain http:// only")]
    Https {
        /// The URL given.
        url: String,
    },
    /// The URL's host did not resolve.
    #[error("cannot resolve {authority}: {reason}")]
    Resolve {
        /// `host:port`.
        authority: String,
        /// The resolver's answer.
        reason: String,
    },
    /// A monoio runtime could not be built.
    #[error("cannot start a monoio runtime: {0}")]
    Runtime(std::io::Error),
    /// A load thread could not be pinned to its core.
    #[error("cannot pin a load thread to core {core}: {source}")]
    Pin {
        /// The core.
        core: usize,
        /// The OS error.
        source: std::io::Error,
    },
    /// A load thread panicked.
    #[error("a load thread panicked")]
    ThreadPanicked,
    /// A control-plane request failed.
    #[error("GET {path}: {source}")]
    Get {
        /// The path requested.
        path: String,
        /// The HTTP error.
        source: HttpError,
    },
}

/// Where requests go: the resolved address, the `Host` header and the
/// chat-completions request target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The URL as given.
    pub url: String,
    /// The resolved socket address (resolved once, before the run).
    pub addr: SocketAddr,
    /// The `Host` header value.
    pub authority: String,
    /// `<prefix>/v1/chat/completions`.
    pub path: String,
}

impl Target {
    /// Parses `http://host:port[/prefix]` (a trailing `/v1` is accepted and
    /// dropped) and resolves the host.
    pub fn parse(url: &str) -> Result<Self, LoadError> {
        let trimmed = url.trim().trim_end_matches('/');
        let base = trimmed.strip_suffix("/v1").unwrap_or(trimmed);
        let parsed = Url::parse(base).map_err(|source| LoadError::Url {
            url: url.to_string(),
            source,
        })?;
        if parsed.is_tls() {
            return Err(LoadError::Https {
                url: url.to_string(),
            });
        }
        let authority = parsed.authority();
        let resolve_error = |reason: String| LoadError::Resolve {
            authority: format!("{}:{}", parsed.host(), parsed.port()),
            reason,
        };
        let addr = (parsed.host(), parsed.port())
            .to_socket_addrs()
            .map_err(|e| resolve_error(e.to_string()))?
            .next()
            .ok_or_else(|| resolve_error("no address".into()))?;
        Ok(Target {
            url: url.to_string(),
            addr,
            authority,
            path: parsed.join("/v1/chat/completions"),
        })
    }

    /// `path` on the same server, under the URL's prefix.
    pub fn path_of(&self, path: &str) -> String {
        match self.path.strip_suffix("/v1/chat/completions") {
            Some(prefix) => format!("{prefix}{path}"),
            None => path.to_string(),
        }
    }
}

/// How requests are issued.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    /// N streams kept busy back to back.
    Concurrency {
        /// Concurrent streams.
        streams: u64,
    },
    /// Open loop at a fixed arrival rate.
    Rate {
        /// Requests started per second.
        per_s: f64,
    },
    /// N streams, one request each.
    OneShot {
        /// Streams.
        streams: u64,
    },
}

/// A load run.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// Where requests go.
    pub target: Target,
    /// The `model` of every request.
    pub model: String,
    /// How requests are issued.
    pub mode: Mode,
    /// No request starts after this long.
    pub duration_ms: u64,
    /// `max_tokens` of every request.
    pub tokens: u32,
    /// Whether requests ask for a stream.
    pub stream: bool,
    /// Closed-loop streams start spread evenly over this long.
    pub ramp_ms: u64,
    /// After `duration_ms`, requests in flight get this long to finish;
    /// then they are cut off and counted as timeouts.
    pub drain_ms: u64,
    /// Streams whose largest inter-chunk gap exceeds this are counted.
    pub gap_limit_ns: Option<u64>,
    /// One load thread per entry, pinned to that core when `Some`.
    pub cores: Vec<Option<usize>>,
    /// Open loop: most requests in flight per thread; a due request beyond
    /// it is not sent and counts as an overload error.
    pub max_in_flight: u64,
    /// Print the live progress line on stderr.
    pub progress: bool,
    /// Stop issuing requests when set (SIGINT); requests in flight finish.
    pub stop: Arc<AtomicBool>,
    /// Sent as `Authorization: Bearer <key>` with every request (an Edge
    /// with `[[client_keys]]`).
    pub api_key: Option<ApiKey>,
    /// When set, every request carries `x-request-id: <prefix>-<n>` (n
    /// counting from 0 per load thread), so the Edge's access log tells
    /// this run's requests apart from others'.
    pub request_id_prefix: Option<String>,
}

/// A client API key; its `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey {
    authorization: String,
}

impl ApiKey {
    /// The key `key`.
    pub fn new(key: &str) -> Self {
        Self {
            authorization: format!("Bearer {key}"),
        }
    }

    /// The `authorization` header value.
    pub fn authorization(&self) -> &str {
        &self.authorization
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// Runs `spec` to its end and returns the merged figures. `live` is
/// updated as the run goes (give a fresh one per run).
pub fn run(spec: &LoadSpec, live: &Arc<Live>) -> Result<LoadSummary, LoadError> {
    let spec = Arc::new(spec.clone());
    let cores: Vec<Option<usize>> = if spec.cores.is_empty() {
        vec![None]
    } else {
        spec.cores.clone()
    };
    let threads = cores.len();
    let streams = match spec.mode {
        Mode::Concurrency { streams } | Mode::OneShot { streams } => streams,
        Mode::Rate { .. } => 0,
    };
    let shares = schedule::split_evenly(streams, threads);
    let start_ns = monotonic_raw_ns() + START_DELAY_MS * 1_000_000;
    let deadline_ns = start_ns + spec.duration_ms.saturating_mul(1_000_000);
    let hard_deadline_ns = deadline_ns + spec.drain_ms.saturating_mul(1_000_000);

    let results = std::thread::scope(|scope| {
        let mut first_stream = 0;
        let handles: Vec<_> = cores
            .iter()
            .zip(&shares)
            .enumerate()
            .map(|(k, (core, &share))| {
                let plan = client::ThreadPlan {
                    thread: k as u64,
                    threads: threads as u64,
                    streams: share,
                    first_stream,
                    total_streams: streams,
                    start_ns,
                    deadline_ns,
                    hard_deadline_ns,
                };
                first_stream += share;
                let (spec, live, core) = (Arc::clone(&spec), Arc::clone(live), *core);
                scope.spawn(move || -> Result<client::ThreadResult, LoadError> {
                    if let Some(core) = core {
                        iop_engine::rt::pin_current_thread(core)
                            .map_err(|source| LoadError::Pin { core, source })?;
                    }
                    iop_engine::rt::block_on(client::run_thread(spec, live, plan))
                        .map_err(LoadError::Runtime)
                })
            })
            .collect();
        if spec.progress {
            show_progress(&handles, live, start_ns);
        }
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| LoadError::ThreadPanicked)?)
            .collect::<Result<Vec<_>, LoadError>>()
    });
    live.finished.store(true, Ordering::Relaxed);
    let results = results?;
    let mut merged = Recorder::new(spec.gap_limit_ns);
    let mut end_ns = start_ns;
    for result in &results {
        merged.merge(&result.recorder);
        end_ns = end_ns.max(result.last_end_ns);
    }
    Ok(merged.summary(end_ns.saturating_sub(start_ns)))
}

/// Rewrites the progress line on stderr once a second until every thread
/// has finished, then ends it with a newline.
fn show_progress<T>(handles: &[std::thread::ScopedJoinHandle<'_, T>], live: &Live, start_ns: u64) {
    let mut next_print_ns = start_ns + 1_000_000_000;
    let mut stderr = std::io::stderr();
    while !handles.iter().all(|h| h.is_finished()) {
        std::thread::sleep(Duration::from_millis(50));
        let now = monotonic_raw_ns();
        if now >= next_print_ns {
            let _ = write!(
                stderr,
                "\r{}",
                live.progress_line(now.saturating_sub(start_ns))
            );
            let _ = stderr.flush();
            next_print_ns += 1_000_000_000;
        }
    }
    let now = monotonic_raw_ns();
    let _ = writeln!(
        stderr,
        "\r{}",
        live.progress_line(now.saturating_sub(start_ns))
    );
}

/// `GET path` on `target`'s server (a fresh connection, `Connection:
/// close`), on a runtime of its own; the status and body.
pub fn get_blocking(target: &Target, path: &str) -> Result<(u16, Bytes), LoadError> {
    get_blocking_as(target, path, None)
}

/// [`get_blocking`] with `Authorization: Bearer <key>` when `key` is given
/// (an Edge with `[[client_keys]]` answers `/status` only to a key).
pub fn get_blocking_as(
    target: &Target,
    path: &str,
    key: Option<&ApiKey>,
) -> Result<(u16, Bytes), LoadError> {
    let full = target.path_of(path);
    iop_engine::rt::block_on(client::get(target, &full, key))
        .map_err(LoadError::Runtime)?
        .map_err(|source| LoadError::Get { path: full, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_with_or_without_v1() {
        let t = Target::parse("http://127.0.0.1:8080").unwrap();
        assert_eq!(t.addr, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(t.authority, "127.0.0.1:8080");
        assert_eq!(t.path, "/v1/chat/completions");
        assert_eq!(t.path_of("/status"), "/status");
        let t = Target::parse("http://127.0.0.1:9/api/v1/").unwrap();
        assert_eq!(t.path, "/api/v1/chat/completions");
        assert_eq!(t.path_of("/status"), "/api/status");
        assert!(matches!(
            Target::parse("https://127.0.0.1:1"),
            Err(LoadError::Https { .. })
        ));
    }

    #[test]
    fn request_body_is_exact() {
        assert_eq!(
            client::request_body("m", 7, true),
            Bytes::from_static(
                br#"{"model":"m","messages":[{"role":"user","content":"iop bench"}],"stream":true,"max_tokens":7}"#
            )
        );
    }
}
