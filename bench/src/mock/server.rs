//! The monoio shell of the mock provider: bind, announce readiness, accept
//! until SIGTERM/SIGINT, and per connection read requests with
//! `iop_engine::http`, ask [`MockProvider`] for the reply and write it —
//! streams event by event, each SSE event its own flushed HTTP chunk.

use std::cell::RefCell;
use std::convert::Infallible;
use std::io::{self, Write};
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use bytes::Bytes;
use monoio::net::{ListenerOpts, TcpListener, TcpStream};
use tracing::{debug, info, warn};

use iop_engine::clock::monotonic_raw_ns;
use iop_engine::http::{HttpError, Limits, ServerConn};
use iop_engine::rt::{yield_now, Signal, SignalPipe};
use iop_engine::tls::{HttpsAcceptor, ListenerStream, MaybeTls};

use super::openai::{error_body, MockFaults, MockProvider, Reply, StreamPlan, StreamStep};
use super::script::Script;
use super::MockConfig;

/// Pause after a failed `accept` (for example `EMFILE`) before trying again,
/// so a persistent error does not spin the core.
const ACCEPT_RETRY_MS: u64 = 10;

/// Why the mock server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Installing the SIGTERM/SIGINT handlers failed.
    #[error("cannot install signal handlers: {0}")]
    Signals(io::Error),
    /// Binding the listening socket failed.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error.
        source: io::Error,
    },
    /// Writing the readiness line to stdout failed.
    #[error("cannot announce readiness on stdout: {0}")]
    Announce(io::Error),
    /// A signal pipe failed while waiting for shutdown.
    #[error("signal pipe failed: {0}")]
    SignalPipe(io::Error),
}

/// The readiness line printed to stdout once the socket listens.
pub fn ready_line(addr: SocketAddr) -> String {
    format!("IOP_READY mock-provider addr={addr}")
}

/// Serves `config` on `addr` until SIGTERM or SIGINT, then returns `Ok`.
/// Open connections are dropped at shutdown, mid-stream or not. Prints
/// [`ready_line`] to stdout (and flushes) once listening.
pub async fn run(addr: SocketAddr, config: MockConfig) -> Result<(), ServeError> {
    run_with(addr, config, MockFaults::default()).await
}

/// [`run`] with `faults` injected into chat completions.
pub async fn run_with(
    addr: SocketAddr,
    config: MockConfig,
    faults: MockFaults,
) -> Result<(), ServeError> {
    run_provider(addr, MockProvider::with_faults(config, faults)).await
}

/// [`run`] with a fully built handler (faults, tool modes).
pub async fn run_provider(addr: SocketAddr, provider: MockProvider) -> Result<(), ServeError> {
    // Handlers first: a signal sent right after the ready line must not find
    // the default action (termination with a non-zero status) still in place.
    let mut term = SignalPipe::install(Signal::Term).map_err(ServeError::Signals)?;
    let mut int = SignalPipe::install(Signal::Int).map_err(ServeError::Signals)?;
    // No SO_REUSEPORT: a port already in use is an error, not a silent share.
    let opts = ListenerOpts::new().reuse_port(false);
    let listener = TcpListener::bind_with_config(addr, &opts)
        .map_err(|source| ServeError::Bind { addr, source })?;
    let local = listener
        .local_addr()
        .map_err(|source| ServeError::Bind { addr, source })?;
    announce(local).map_err(ServeError::Announce)?;
    let config = provider.config();
    info!(
        addr = %local,
        https = provider.tls().is_some(),
        tokens = config.tokens,
        ttft_ms = config.ttft_ms,
        inter_token_ms = config.inter_token_ms,
        models = ?config.models,
        faults = ?provider.faults(),
        modes = ?provider.modes(),
        "mock provider listening"
    );
    let provider = Rc::new(RefCell::new(provider));
    monoio::select! {
        never = accept_loop(listener, provider) => match never {},
        signal = term.recv() => shutdown(signal),
        signal = int.recv() => shutdown(signal),
    }
}

/// Serves `config` on an already bound `listener` until the future is
/// dropped: no signal handlers, no readiness line. For in-process tests,
/// which bind `127.0.0.1:0` and read the address from the listener.
pub async fn serve(listener: TcpListener, config: MockConfig) -> Infallible {
    serve_with(listener, config, MockFaults::default()).await
}

/// [`serve`] with `faults` injected into chat completions.
pub async fn serve_with(
    listener: TcpListener,
    config: MockConfig,
    faults: MockFaults,
) -> Infallible {
    serve_provider(listener, MockProvider::with_faults(config, faults)).await
}

/// [`serve`] with a fully built handler (faults, tool modes).
pub async fn serve_provider(listener: TcpListener, provider: MockProvider) -> Infallible {
    accept_loop(listener, Rc::new(RefCell::new(provider))).await
}

/// [`serve_provider`] with a handler the caller keeps a handle to, so an
/// in-process test reads the counters ([`MockProvider::stats`]) without
/// opening a connection of its own.
pub async fn serve_shared(
    listener: TcpListener,
    provider: Rc<RefCell<MockProvider>>,
) -> Infallible {
    accept_loop(listener, provider).await
}

fn announce(addr: SocketAddr) -> io::Result<()> {
    let mut stdout = io::stdout().lock();
    writeln!(stdout, "{}", ready_line(addr))?;
    stdout.flush()
}

fn shutdown(signal: io::Result<Signal>) -> Result<(), ServeError> {
    let signal = signal.map_err(ServeError::SignalPipe)?;
    info!(?signal, "mock provider shutting down");
    Ok(())
}

async fn accept_loop(listener: TcpListener, provider: Rc<RefCell<MockProvider>>) -> Infallible {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                if let Err(err) = iop_engine::http::set_nodelay(&stream) {
                    warn!(%peer, %err, "cannot set TCP_NODELAY");
                }
                debug!(%peer, "connection accepted");
                let tls = provider.borrow().tls().cloned();
                monoio::spawn(handshake_and_serve(stream, peer, tls, Rc::clone(&provider)));
            }
            Err(err) => {
                warn!(%err, "accept failed");
                monoio::time::sleep(Duration::from_millis(ACCEPT_RETRY_MS)).await;
            }
        }
    }
}

/// Headers of every JSON response.
const JSON_HEADERS: [(&str, &str); 1] = [("content-type", "application/json")];

/// Headers of every streamed response.
const SSE_HEADERS: [(&str, &str); 2] = [
    ("content-type", "text/event-stream"),
    ("cache-control", "no-cache"),
];

/// Longest TLS handshake the HTTPS mock waits for.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The TLS handshake of an HTTPS mock (`--tls-cert`), then the requests.
/// A failed handshake (a client that refused the certificate) is counted.
async fn handshake_and_serve(
    tcp: TcpStream,
    peer: SocketAddr,
    tls: Option<HttpsAcceptor>,
    provider: Rc<RefCell<MockProvider>>,
) {
    let Some(tls) = tls else {
        return serve_connection(MaybeTls::Plain(tcp), peer, provider).await;
    };
    let handshake = monoio::select! {
        done = tls.accept(tcp) => Some(done),
        _ = monoio::time::sleep(HANDSHAKE_TIMEOUT) => None,
    };
    match handshake {
        Some(Ok(stream)) => serve_connection(MaybeTls::from(stream), peer, provider).await,
        Some(Err(err)) => {
            provider.borrow_mut().tls_handshake_failed();
            debug!(%peer, error = ?err, "TLS handshake failed");
        }
        None => {
            provider.borrow_mut().tls_handshake_failed();
            debug!(%peer, "TLS handshake timed out");
        }
    }
}

async fn serve_connection(
    stream: ListenerStream,
    peer: SocketAddr,
    provider: Rc<RefCell<MockProvider>>,
) {
    provider.borrow_mut().connection_opened();
    let _open = ConnectionGuard(&provider);
    let mut conn = ServerConn::new(stream, Limits::default());
    match serve_requests(&mut conn, &provider).await {
        Ok(()) => debug!(%peer, "connection closed"),
        Err(err) if err.is_answerable() => {
            debug!(%peer, %err, "bad request; answering and closing");
            let body = Bytes::from(error_body(&err.to_string()));
            if let Err(err) = conn
                .write_response(err.status_code(), JSON_HEADERS, body)
                .await
            {
                debug!(%peer, %err, "cannot answer a bad request");
            }
        }
        Err(err) => debug!(%peer, %err, "connection ended"),
    }
}

/// Counts a connection as open for its lifetime (also when its task is
/// dropped at shutdown).
struct ConnectionGuard<'a>(&'a RefCell<MockProvider>);

impl Drop for ConnectionGuard<'_> {
    fn drop(&mut self) {
        self.0.borrow_mut().connection_closed();
    }
}

/// Counts a stream as active for its lifetime.
struct StreamGuard<'a>(&'a RefCell<MockProvider>);

impl<'a> StreamGuard<'a> {
    fn start(provider: &'a RefCell<MockProvider>) -> Self {
        provider.borrow_mut().stream_started();
        Self(provider)
    }
}

impl Drop for StreamGuard<'_> {
    fn drop(&mut self) {
        self.0.borrow_mut().stream_ended();
    }
}

/// What happens to the connection after a reply.
enum After {
    /// Serve the next request if the connection may be kept.
    Continue,
    /// Close it now (injected drop, or the client hung up on a hang).
    Close,
}

/// Serves requests until the client closes, the connection may not be kept,
/// an error ends it, or it served `--close-after-requests` requests (then
/// it is closed silently after the last reply).
async fn serve_requests(
    conn: &mut ServerConn<ListenerStream>,
    provider: &RefCell<MockProvider>,
) -> Result<(), HttpError> {
    let close_after = provider.borrow().close_after_requests();
    let mut served: u32 = 0;
    while let Some(request) = conn.read_request().await? {
        served = served.saturating_add(1);
        debug!(
            method = %request.head.method,
            target = %request.head.target,
            body_bytes = request.body.len(),
            "request"
        );
        let refused = provider.borrow().required_api_key().and_then(|key| {
            super::auth::unauthorized(key, &request.head.target, &request.head.headers)
        });
        if let Some(body) = refused {
            conn.write_response(401, JSON_HEADERS, Bytes::from(body))
                .await?;
            if !conn.keep_alive() || close_after.is_some_and(|limit| served >= limit) {
                break;
            }
            continue;
        }
        if let Some(traceparent) = request.head.header("traceparent") {
            provider.borrow_mut().saw_traceparent(traceparent);
        }
        let content_type = request
            .head
            .header("content-type")
            .and_then(|v| std::str::from_utf8(v).ok());
        let reply = provider.borrow_mut().handle_typed(
            &request.head.method,
            &request.head.target,
            content_type,
            &request.body,
        );
        match reply {
            Reply::Json { status, body } => {
                conn.write_response(status, JSON_HEADERS, Bytes::from(body))
                    .await?;
            }
            Reply::Body {
                status,
                content_type,
                body,
            } => {
                conn.write_response(status, [("content-type", content_type)], Bytes::from(body))
                    .await?;
            }
            Reply::Completion {
                delay_ms,
                completion,
            } => {
                if delay_ms > 0 {
                    monoio::time::sleep(Duration::from_millis(delay_ms)).await;
                }
                let body = completion.json_body(monotonic_raw_ns());
                conn.write_response(200, JSON_HEADERS, Bytes::from(body))
                    .await?;
            }
            Reply::Stream(plan) => {
                let _active = StreamGuard::start(provider);
                let after = stream_reply(conn, provider, plan).await;
                if let After::Close = counted(provider, after)? {
                    return Ok(());
                }
            }
            Reply::Scripted(script) if script.chunked => {
                let _active = StreamGuard::start(provider);
                let after = scripted_stream(conn, provider, script).await;
                if let After::Close = counted(provider, after)? {
                    return Ok(());
                }
            }
            Reply::Scripted(script) => {
                if let After::Close = scripted_body(conn, script).await? {
                    return Ok(());
                }
            }
            Reply::Hang => {
                hang(conn).await;
                return Ok(());
            }
            Reply::Drop => return Ok(()),
        }
        if !conn.keep_alive() || close_after.is_some_and(|limit| served >= limit) {
            break;
        }
    }
    Ok(())
}

/// Writes a streamed reply: each event one chunk, written and flushed
/// before the next step.
async fn stream_reply(
    conn: &mut ServerConn<ListenerStream>,
    provider: &RefCell<MockProvider>,
    mut plan: StreamPlan,
) -> Result<After, HttpError> {
    conn.start_chunked(200, SSE_HEADERS).await?;
    while let Some(step) = plan.next_step(monotonic_raw_ns()) {
        match step {
            StreamStep::Sleep { duration_ms } => {
                monoio::time::sleep(Duration::from_millis(duration_ms)).await;
            }
            StreamStep::Event(event) => write_event(conn, provider, event).await?,
            StreamStep::Hang => {
                hang(conn).await;
                return Ok(After::Close);
            }
            StreamStep::Drop => {
                debug!("injected drop: closing mid-stream");
                return Ok(After::Close);
            }
        }
    }
    conn.finish().await?;
    Ok(After::Continue)
}

/// Writes one event as a chunk and counts its bytes once written.
async fn write_event(
    conn: &mut ServerConn<ListenerStream>,
    provider: &RefCell<MockProvider>,
    event: impl Into<Bytes>,
) -> Result<(), HttpError> {
    let event: Bytes = event.into();
    let len = event.len();
    conn.write_chunk(event).await?;
    provider.borrow_mut().stream_wrote(len);
    // Every stream takes turns with the others and with `/admin/stats`,
    // whichever driver runs (see `yield_now`).
    yield_now().await;
    Ok(())
}

/// Counts a stream whose writing failed as aborted (U6 seen from the
/// provider side).
fn counted(
    provider: &RefCell<MockProvider>,
    after: Result<After, HttpError>,
) -> Result<After, HttpError> {
    if after.is_err() {
        provider.borrow_mut().stream_aborted();
    }
    after
}

/// Writes a chunked scripted reply: each event one flushed chunk.
async fn scripted_stream(
    conn: &mut ServerConn<ListenerStream>,
    provider: &RefCell<MockProvider>,
    script: Script,
) -> Result<After, HttpError> {
    conn.start_chunked(
        script.status,
        [
            ("content-type", script.content_type),
            ("cache-control", "no-cache"),
        ],
    )
    .await?;
    for step in script.steps {
        match step {
            StreamStep::Sleep { duration_ms } => {
                monoio::time::sleep(Duration::from_millis(duration_ms)).await;
            }
            StreamStep::Event(event) => write_event(conn, provider, event).await?,
            StreamStep::Hang => {
                hang(conn).await;
                return Ok(After::Close);
            }
            StreamStep::Drop => {
                debug!("injected drop: closing mid-stream");
                return Ok(After::Close);
            }
        }
    }
    conn.finish().await?;
    Ok(After::Continue)
}

/// Writes a non-chunked scripted reply: waits out its sleeps, then sends
/// its events as one body (or hangs/drops as scripted).
async fn scripted_body(
    conn: &mut ServerConn<ListenerStream>,
    script: Script,
) -> Result<After, HttpError> {
    let body = script.body();
    for step in &script.steps {
        match step {
            StreamStep::Sleep { duration_ms } => {
                monoio::time::sleep(Duration::from_millis(*duration_ms)).await;
            }
            StreamStep::Event(_) => {}
            StreamStep::Hang => {
                hang(conn).await;
                return Ok(After::Close);
            }
            StreamStep::Drop => return Ok(After::Close),
        }
    }
    conn.write_response(
        script.status,
        [("content-type", script.content_type)],
        Bytes::from(body),
    )
    .await?;
    Ok(After::Continue)
}

/// Answers nothing until the client closes the connection (or sends more
/// bytes, which also ends the connection).
async fn hang(conn: &ServerConn<ListenerStream>) {
    debug!("injected hang: waiting for the client to close");
    if let Err(err) = conn.stream().tcp().readable(false).await {
        debug!(%err, "hang ended");
    }
}
