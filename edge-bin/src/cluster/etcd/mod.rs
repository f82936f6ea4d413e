//! A small etcd v3 client for the Edge: the JSON gateway (`/v3/...`) over
//! plain HTTP/1.1 on monoio, with no second runtime and no `protoc`.
//!
//! ```text
//! EtcdClient::lease_grant / put_with_lease / … ──► codec (request JSON)
//!      │  endpoints tried in turn, starting with the one that last worked;
//!      │  each attempt bounded by `call_timeout`
//!      ▼
//! iop_engine::http::ClientConn (POST, content-length) ──► etcd member
//!      │  response read to its end, capped at `max_response_bytes`
//!      ▼
//! codec (typed answer or CodecError)
//!
//! watch_prefix ──► one long-lived response: chunked body, one JSON message
//!                  per line; Watch::next parses one line at a time
//! ```
//!
//! The sans-IO half is [`codec`]; this module only moves bytes. An
//! attempt that fails to connect, fails on the socket, times out, or is
//! answered "unavailable" (no leader, request timed out: gRPC code 14) is
//! retried on the next endpoint; any other answer, error or not, is final.
//! Every request carries `Grpc-Metadata-Hasleader: true`, so a member cut
//! off from its cluster answers "no leader" (and ends a watch) instead of
//! serving stale data or going silent.
//!
//! Retrying on another endpoint after a failure *after* the request was
//! written may apply a write twice: an unconditional put then lands at a
//! later revision (which is the one returned), a conditional delete
//! answers `false` the second time, a grant grants a second lease that
//! expires unused. Callers treat answers accordingly.

pub mod codec;

use std::cell::{Cell, RefCell};
use std::fmt;
use std::io;
use std::time::Duration;

use bytes::Bytes;
use iop_engine::http::{connect_host, ClientConn, HttpError, Limits, NdjsonSplitter};
use monoio::net::TcpStream;

pub use codec::{
    CodecError, EventKind, Kv, LeaseGrant, LeaseId, RangeAnswer, WatchEvent, WatchMessage,
};

use codec::EtcdRequest;

/// Idle connections kept for reuse, across endpoints.
const MAX_IDLE_CONNECTIONS: usize = 4;

/// Header that makes etcd refuse (code 14, "no leader") instead of serving
/// from a member that has lost its leader.
const REQUIRE_LEADER: (&str, &str) = ("grpc-metadata-hasleader", "true");

/// Where and how to reach etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// Client endpoints of the cluster's members, `host:port` each
    /// (`[v6]:port` for IPv6).
    pub endpoints: Vec<String>,
    /// Longest one attempt on one endpoint may take (connect, request,
    /// whole answer). A call fails within `endpoints × call_timeout`.
    pub call_timeout: Duration,
    /// Longest response body (or watch message) accepted; at most
    /// [`codec::MAX_RESPONSE_BYTES`].
    pub max_response_bytes: usize,
}

impl EtcdConfig {
    /// `endpoints` with a call timeout of 2 s and the largest response
    /// cap.
    pub fn new(endpoints: Vec<String>) -> Self {
        EtcdConfig {
            endpoints,
            call_timeout: Duration::from_secs(2),
            max_response_bytes: codec::MAX_RESPONSE_BYTES,
        }
    }
}

/// What went wrong talking to etcd. Each variant names the endpoint and
/// the call (`/v3/...`) it is about.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// The configuration names no endpoint.
    #[error("no etcd endpoint configured")]
    NoEndpoints,
    /// An endpoint is not `host:port`.
    #[error("etcd endpoint {endpoint:?}: {reason}")]
    BadEndpoint {
        /// The endpoint as configured.
        endpoint: String,
        /// Why it is refused.
        reason: String,
    },
    /// The TCP connection could not be made.
    #[error("etcd {endpoint} {call}: connect failed: {source}")]
    Connect {
        /// The endpoint.
        endpoint: String,
        /// The call.
        call: &'static str,
        /// The socket error.
        source: io::Error,
    },
    /// Writing the request or reading the response failed.
    #[error("etcd {endpoint} {call}: {source}")]
    Http {
        /// The endpoint.
        endpoint: String,
        /// The call.
        call: &'static str,
        /// The HTTP or socket error.
        source: HttpError,
    },
    /// No complete answer within the call timeout.
    #[error("etcd {endpoint} {call}: no answer within {timeout_ms} ms")]
    Timeout {
        /// The endpoint.
        endpoint: String,
        /// The call.
        call: &'static str,
        /// The call timeout.
        timeout_ms: u128,
    },
    /// The response body (or one watch message) is over the cap.
    #[error("etcd {endpoint} {call}: response over the {max_bytes}-byte cap")]
    TooLarge {
        /// The endpoint.
        endpoint: String,
        /// The call.
        call: &'static str,
        /// The cap.
        max_bytes: usize,
    },
    /// etcd answered, with an error or with something that is not the
    /// answer asked for.
    #[error("etcd {endpoint} {call}: {source}")]
    Answer {
        /// The endpoint.
        endpoint: String,
        /// The call.
        call: &'static str,
        /// The error etcd sent, or what was wrong with its answer.
        source: CodecError,
    },
    /// Every endpoint failed; one failure per endpoint, in the order
    /// tried.
    #[error("no etcd endpoint answered: {}", Failures(.failures))]
    Unreachable {
        /// Why each endpoint failed.
        failures: Vec<EtcdError>,
    },
    /// The watch's response ended (etcd closed it).
    #[error("etcd {endpoint} /v3/watch: the stream ended")]
    WatchEnded {
        /// The endpoint.
        endpoint: String,
    },
    /// A [`Watch::next`] future was dropped mid-read, so the stream's
    /// position is lost: open a new watch.
    #[error("etcd {endpoint} /v3/watch: an earlier read was abandoned; watch again")]
    WatchAbandoned {
        /// The endpoint.
        endpoint: String,
    },
}

impl EtcdError {
    /// Whether the next endpoint should be tried after this failure.
    fn tries_next_endpoint(&self) -> bool {
        match self {
            EtcdError::Connect { .. } | EtcdError::Http { .. } | EtcdError::Timeout { .. } => true,
            EtcdError::Answer { source, .. } => source.is_unavailable(),
            _ => false,
        }
    }

    /// The error etcd answered with, if it answered with one.
    pub fn server_error(&self) -> Option<&CodecError> {
        match self {
            EtcdError::Answer { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Formats the failures of [`EtcdError::Unreachable`], `; `-separated.
struct Failures<'a>(&'a [EtcdError]);

impl fmt::Display for Failures<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, failure) in self.0.iter().enumerate() {
            if index > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{failure}")?;
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Endpoint {
    /// As configured, for errors and the `Host` header.
    text: String,
    host: String,
    port: u16,
}

/// etcd client on the current monoio core. Calls take `&self` and may run
/// concurrently; each uses its own connection (idle ones are reused).
pub struct EtcdClient {
    endpoints: Vec<Endpoint>,
    call_timeout: Duration,
    max_response_bytes: usize,
    /// The endpoint that answered last: calls start there.
    preferred: Cell<usize>,
    /// Connections that finished an exchange cleanly, with their endpoint.
    idle: RefCell<Vec<(usize, ClientConn<TcpStream>)>>,
}

impl fmt::Debug for EtcdClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdClient")
            .field("endpoints", &self.endpoints)
            .field("call_timeout", &self.call_timeout)
            .field("preferred", &self.preferred.get())
            .field("idle_connections", &self.idle.borrow().len())
            .finish_non_exhaustive()
    }
}

/// What one exchange brought back.
struct Answer {
    status: u16,
    body: Bytes,
}

impl EtcdClient {
    /// A client for `config`; checks every endpoint is `host:port`. No
    /// connection is made yet.
    pub fn new(config: EtcdConfig) -> Result<Self, EtcdError> {
        if config.endpoints.is_empty() {
            return Err(EtcdError::NoEndpoints);
        }
        let endpoints = config
            .endpoints
            .into_iter()
            .map(|text| match iop_engine::config::split_host_port(&text) {
                Ok((host, port)) => Ok(Endpoint { text, host, port }),
                Err(reason) => Err(EtcdError::BadEndpoint {
                    endpoint: text,
                    reason,
                }),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(EtcdClient {
            endpoints,
            call_timeout: config.call_timeout,
            max_response_bytes: config.max_response_bytes.min(codec::MAX_RESPONSE_BYTES),
            preferred: Cell::new(0),
            idle: RefCell::new(Vec::new()),
        })
    }

    /// The endpoint calls start with: the one that answered last.
    pub fn preferred_endpoint(&self) -> &str {
        &self.endpoints[self.preferred.get()].text
    }

    /// Grants a lease of `ttl_sec` seconds.
    pub async fn lease_grant(&self, ttl_sec: i64) -> Result<LeaseGrant, EtcdError> {
        self.call(codec::lease_grant(ttl_sec), codec::parse_lease_grant)
            .await
    }

    /// Keeps `lease` alive once: `Some(ttl_sec)` left, or `None` when the
    /// lease is gone (expired or revoked).
    pub async fn lease_keepalive(&self, lease: LeaseId) -> Result<Option<i64>, EtcdError> {
        self.call(codec::lease_keepalive(lease), codec::parse_lease_keepalive)
            .await
    }

    /// Revokes `lease`, deleting every key attached to it: `true` if it
    /// was revoked now, `false` if it was already gone.
    pub async fn lease_revoke(&self, lease: LeaseId) -> Result<bool, EtcdError> {
        match self
            .call(codec::lease_revoke(lease), codec::parse_lease_revoke)
            .await
        {
            Ok(_) => Ok(true),
            Err(EtcdError::Answer { source, .. }) if source.is_not_found() => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Puts `key = value` attached to `lease`, unconditionally: the put's
    /// revision (the key's new `mod_revision`).
    pub async fn put_with_lease(
        &self,
        key: &[u8],
        value: &[u8],
        lease: LeaseId,
    ) -> Result<i64, EtcdError> {
        self.call(codec::put_with_lease(key, value, lease), codec::parse_put)
            .await
    }

    /// Puts `key = value` on no lease if the key's `mod_revision` is still
    /// `mod_revision` (0: if it does not exist): the put's revision, or
    /// `None` when the compare failed and nothing was written. A retry on
    /// another endpoint after a lost answer may find its own first put and
    /// answer `None`.
    pub async fn put_if_mod_revision(
        &self,
        key: &[u8],
        value: &[u8],
        mod_revision: i64,
    ) -> Result<Option<i64>, EtcdError> {
        self.call(
            codec::put_if_mod_revision(key, value, mod_revision),
            codec::parse_put_if,
        )
        .await
    }

    /// Deletes `key` if its `mod_revision` is still `mod_revision`:
    /// whether it did.
    pub async fn delete_if_mod_revision(
        &self,
        key: &[u8],
        mod_revision: i64,
    ) -> Result<bool, EtcdError> {
        self.call(
            codec::delete_if_mod_revision(key, mod_revision),
            codec::parse_delete_if,
        )
        .await
    }

    /// Reads every key under `prefix` (linearizable): the store revision
    /// of the read and the keys.
    pub async fn range_prefix(&self, prefix: &[u8]) -> Result<RangeAnswer, EtcdError> {
        self.call(codec::range_prefix(prefix), codec::parse_range)
            .await
    }

    /// Watches every key under `prefix` from `start_revision` (inclusive).
    /// Returns once etcd confirmed the watch (its `created` message, within
    /// the call timeout); the watch then stays on that endpoint.
    pub async fn watch_prefix(
        &self,
        prefix: &[u8],
        start_revision: i64,
    ) -> Result<Watch, EtcdError> {
        let request = &codec::watch_prefix(prefix, start_revision);
        self.over_endpoints(|index| async move {
            let endpoint = &self.endpoints[index];
            let open = async {
                let mut conn = self.connect(index, request.path).await?;
                let status = self.send(&mut conn, index, request).await?;
                let mut watch = Watch {
                    endpoint: endpoint.text.clone(),
                    conn,
                    lines: NdjsonSplitter::new(self.max_response_bytes),
                    max_message_bytes: self.max_response_bytes,
                    reading: false,
                };
                if status != 200 {
                    let body = watch.conn.read_body_to_end(self.max_response_bytes).await;
                    let body = body.map_err(|e| self.http_error(index, request.path, e))?;
                    return Err(EtcdError::Answer {
                        endpoint: endpoint.text.clone(),
                        call: request.path,
                        source: codec::parse_error_body(status, &body),
                    });
                }
                match watch.next().await? {
                    WatchMessage::Created { .. } => Ok(watch),
                    other => Err(EtcdError::Answer {
                        endpoint: endpoint.text.clone(),
                        call: request.path,
                        source: CodecError::Malformed {
                            reason: format!("watch answered {other:?} before created"),
                        },
                    }),
                }
            };
            self.within_timeout(index, request.path, open).await
        })
        .await
    }

    /// Sends `request` to one endpoint after another until one answers
    /// (see the module docs), and parses the answer with `parse`.
    async fn call<T>(
        &self,
        request: EtcdRequest,
        parse: fn(&[u8]) -> Result<T, CodecError>,
    ) -> Result<T, EtcdError> {
        let request = &request;
        self.over_endpoints(|index| async move {
            let answer = self
                .within_timeout(index, request.path, self.exchange(index, request))
                .await?;
            let parsed = if answer.status == 200 {
                parse(&answer.body)
            } else {
                Err(codec::parse_error_body(answer.status, &answer.body))
            };
            parsed.map_err(|source| EtcdError::Answer {
                endpoint: self.endpoints[index].text.clone(),
                call: request.path,
                source,
            })
        })
        .await
    }

    /// Runs `attempt` on each endpoint in turn, starting with the preferred
    /// one, until one succeeds or fails for good; remembers that endpoint.
    async fn over_endpoints<'a, T, F, Fut>(&'a self, mut attempt: F) -> Result<T, EtcdError>
    where
        F: FnMut(usize) -> Fut,
        Fut: std::future::Future<Output = Result<T, EtcdError>> + 'a,
    {
        let count = self.endpoints.len();
        let first = self.preferred.get();
        let mut failures = Vec::new();
        for step in 0..count {
            let index = (first + step) % count;
            match attempt(index).await {
                Err(e) if e.tries_next_endpoint() => failures.push(e),
                outcome => {
                    self.preferred.set(index);
                    return outcome;
                }
            }
        }
        Err(EtcdError::Unreachable { failures })
    }

    async fn within_timeout<T>(
        &self,
        index: usize,
        call: &'static str,
        attempt: impl std::future::Future<Output = Result<T, EtcdError>>,
    ) -> Result<T, EtcdError> {
        // A timed-out attempt drops its connection with it, so the
        // cancelled read leaves nothing behind to misread later.
        match monoio::time::timeout(self.call_timeout, attempt).await {
            Ok(outcome) => outcome,
            Err(_elapsed) => Err(EtcdError::Timeout {
                endpoint: self.endpoints[index].text.clone(),
                call,
                timeout_ms: self.call_timeout.as_millis(),
            }),
        }
    }

    /// One request and its whole answer on endpoint `index`: on an idle
    /// connection if there is one (and again on a fresh connection if the
    /// idle one turns out closed), else on a new one.
    async fn exchange(&self, index: usize, request: &EtcdRequest) -> Result<Answer, EtcdError> {
        if let Some(mut conn) = self.take_idle(index) {
            match self.exchange_on(&mut conn, index, request).await {
                Ok(answer) => {
                    self.put_idle(index, conn);
                    return Ok(answer);
                }
                // The server closed the idle connection before reading
                // the request: nothing was done, try a fresh one.
                Err(EtcdError::Http {
                    source: HttpError::ClosedBeforeResponse,
                    ..
                }) => {}
                Err(e) => return Err(e),
            }
        }
        let mut conn = self.connect(index, request.path).await?;
        let answer = self.exchange_on(&mut conn, index, request).await?;
        self.put_idle(index, conn);
        Ok(answer)
    }

    async fn exchange_on(
        &self,
        conn: &mut ClientConn<TcpStream>,
        index: usize,
        request: &EtcdRequest,
    ) -> Result<Answer, EtcdError> {
        let status = self.send(conn, index, request).await?;
        let body = conn
            .read_body_to_end(self.max_response_bytes)
            .await
            .map_err(|e| self.http_error(index, request.path, e))?;
        Ok(Answer { status, body })
    }

    /// Sends `request` and reads the response head: its status.
    async fn send(
        &self,
        conn: &mut ClientConn<TcpStream>,
        index: usize,
        request: &EtcdRequest,
    ) -> Result<u16, EtcdError> {
        let headers = [("content-type", "application/json"), REQUIRE_LEADER];
        conn.send_request("POST", request.path, headers, request.body.clone())
            .await
            .map_err(|e| self.http_error(index, request.path, e))?;
        let head = conn
            .read_response_head()
            .await
            .map_err(|e| self.http_error(index, request.path, e))?;
        Ok(head.status)
    }

    async fn connect(
        &self,
        index: usize,
        call: &'static str,
    ) -> Result<ClientConn<TcpStream>, EtcdError> {
        let endpoint = &self.endpoints[index];
        let stream = connect_host(&endpoint.host, endpoint.port)
            .await
            .map_err(|source| EtcdError::Connect {
                endpoint: endpoint.text.clone(),
                call,
                source,
            })?;
        Ok(ClientConn::new(stream, Limits::default()).with_host(endpoint.text.clone()))
    }

    fn http_error(&self, index: usize, call: &'static str, source: HttpError) -> EtcdError {
        let endpoint = self.endpoints[index].text.clone();
        match source {
            HttpError::BodyTooLarge { max_bytes } => EtcdError::TooLarge {
                endpoint,
                call,
                max_bytes,
            },
            source => EtcdError::Http {
                endpoint,
                call,
                source,
            },
        }
    }

    fn take_idle(&self, index: usize) -> Option<ClientConn<TcpStream>> {
        let mut idle = self.idle.borrow_mut();
        let at = idle.iter().position(|(owner, _)| *owner == index)?;
        Some(idle.swap_remove(at).1)
    }

    fn put_idle(&self, index: usize, conn: ClientConn<TcpStream>) {
        let mut idle = self.idle.borrow_mut();
        if conn.is_reusable() && idle.len() < MAX_IDLE_CONNECTIONS {
            idle.push((index, conn));
        }
    }
}

/// A watch over a prefix: one long-lived response on one endpoint, read
/// one message at a time. Memory is bounded by one message (the response
/// cap) plus one read.
pub struct Watch {
    endpoint: String,
    conn: ClientConn<TcpStream>,
    lines: NdjsonSplitter,
    max_message_bytes: usize,
    /// A read is under way: if the future that started it was dropped,
    /// the stream's position is lost.
    reading: bool,
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watch")
            .field("endpoint", &self.endpoint)
            .field("buffered_bytes", &self.lines.pending_bytes())
            .finish_non_exhaustive()
    }
}

impl Watch {
    /// The endpoint this watch is on.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The next message, waiting as long as it takes (progress
    /// notifications arrive every few minutes on an idle watch). To bound
    /// the wait, wrap this in a timeout and drop the watch when it fires:
    /// a dropped read loses the stream's position, and later calls say so
    /// ([`EtcdError::WatchAbandoned`]).
    pub async fn next(&mut self) -> Result<WatchMessage, EtcdError> {
        const CALL: &str = "/v3/watch";
        if self.reading {
            return Err(EtcdError::WatchAbandoned {
                endpoint: self.endpoint.clone(),
            });
        }
        loop {
            let line = self.lines.next_line().map_err(|e| match e {
                HttpError::LineTooLong { .. } => EtcdError::TooLarge {
                    endpoint: self.endpoint.clone(),
                    call: CALL,
                    max_bytes: self.max_message_bytes,
                },
                source => EtcdError::Http {
                    endpoint: self.endpoint.clone(),
                    call: CALL,
                    source,
                },
            })?;
            if let Some(line) = line {
                return codec::parse_watch_message(&line).map_err(|source| EtcdError::Answer {
                    endpoint: self.endpoint.clone(),
                    call: CALL,
                    source,
                });
            }
            self.reading = true;
            let piece = self.conn.read_body_chunk().await;
            self.reading = false;
            match piece {
                Ok(Some(data)) => self.lines.feed(&data),
                Ok(None) if self.lines.pending_bytes() > 0 => self.lines.finish(),
                Ok(None) => {
                    return Err(EtcdError::WatchEnded {
                        endpoint: self.endpoint.clone(),
                    })
                }
                Err(source) => {
                    return Err(EtcdError::Http {
                        endpoint: self.endpoint.clone(),
                        call: CALL,
                        source,
                    })
                }
            }
        }
    }
}
