//! `ServerConn` read deadlines and the lingering close over real loopback
//! TCP, on both monoio drivers: a head sent a byte at a time, a body that
//! stops half way, an idle keep-alive connection, and a client that writes a
//! whole oversized body before it reads the 413; the write-stall cut-off of
//! a client that stops reading a streamed response, and none for one that
//! reads slowly. Bounds are generous (a
//! loaded 2-core machine); what is asserted is the outcome, not the time.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::BytesMut;
use iop_engine::clock;
use iop_engine::http::{
    accept, connect, parse_response_head, BodyRate, HttpError, Limits, Linger, LingerEnd,
    ResponseHead, ServerConn, ServerTimeouts,
};
use iop_engine::net::{Deadlines, Wait};
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::{TcpListener, TcpStream};

/// Named `http` so `cargo test -p iop-engine http` selects these tests.
mod http {
    use super::*;

    const TIMEOUTS: ServerTimeouts = ServerTimeouts {
        keep_alive_idle: Duration::from_millis(300),
        head: Duration::from_millis(300),
        body_idle: Duration::from_millis(300),
        body_min_rate: None,
        write_stall: None,
    };

    /// Far above any of the timeouts, even on a loaded machine.
    const GENEROUS: Duration = Duration::from_secs(20);

    fn listen() -> (TcpListener, SocketAddr) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        (listener, addr)
    }

    async fn server(listener: &TcpListener, timeouts: ServerTimeouts) -> ServerConn<TcpStream> {
        let (tcp, _) = accept(listener).await.unwrap();
        let deadline = Deadlines::new().watch(&tcp);
        ServerConn::new(tcp, Limits::default()).with_deadline(deadline, timeouts)
    }

    async fn write_raw(stream: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
        stream.write_all(bytes.to_vec()).await.0.map(|_| ())
    }

    /// Everything the peer sends until it closes (or resets).
    async fn read_to_end(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
        let mut out = Vec::new();
        loop {
            let (res, buf) = stream.read(Vec::with_capacity(64 * 1024)).await;
            if res? == 0 {
                return Ok(out);
            }
            out.extend_from_slice(&buf);
        }
    }

    fn response(raw: &[u8]) -> (ResponseHead, Vec<u8>) {
        let mut buf = BytesMut::from(raw);
        let head = parse_response_head(&mut buf, &Limits::default(), false)
            .unwrap()
            .unwrap_or_else(|| panic!("no complete response head in {raw:?}"));
        (head, buf.to_vec())
    }

    /// Answers `error` the way the Edge does: the error, then a lingering
    /// close.
    async fn answer(conn: &mut ServerConn<TcpStream>, error: &HttpError) -> LingerEnd {
        conn.write_error(error).await.unwrap();
        conn.linger_close(&Linger {
            time: GENEROUS,
            idle: GENEROUS,
            max_bytes: 1 << 30,
        })
        .await
    }

    // A head trickling in a byte at a time never completes: the head
    // deadline (for the whole head) cuts it off, the server answers 408 and
    // closes, and the client's writes start failing.
    #[monoio::test_all(timer_enabled = true)]
    async fn a_head_sent_a_byte_at_a_time_is_cut_off_with_408() {
        let (listener, addr) = listen();
        let client = monoio::spawn(async move {
            let mut tcp = connect(addr).await.unwrap();
            let started = clock::now();
            for byte in b"GET /slow HTTP/1.1\r\nX-Slow: ".iter().cycle() {
                if write_raw(&mut tcp, &[*byte]).await.is_err() {
                    return true;
                }
                if clock::now().duration_since(started) > GENEROUS {
                    return false;
                }
                monoio::time::sleep(Duration::from_millis(20)).await;
            }
            false
        });
        let mut conn = server(&listener, TIMEOUTS).await;
        let err = conn.read_request().await.unwrap_err();
        assert!(matches!(err, HttpError::TimedOut(Wait::Head)), "{err:?}");
        assert!(err.is_answerable());
        assert_eq!(err.status_code(), 408);
        conn.write_error(&err).await.unwrap();
        drop(conn);
        assert!(client.await, "the client's connection was closed");
    }

    // One `Deadlines` (one wheel, one tick task) serves two connections, as
    // on an Edge shard: the silent one is cut off by its head deadline, the
    // one that sends its request is not; afterwards the same tick task cuts
    // the second off when its keep-alive idle timeout passes.
    #[monoio::test_all(timer_enabled = true)]
    async fn connections_sharing_one_wheel_are_cut_off_only_by_their_own_deadlines() {
        let (listener, addr) = listen();
        let silent = monoio::spawn(async move {
            let mut tcp = connect(addr).await.unwrap();
            read_to_end(&mut tcp).await.unwrap()
        });
        let deadlines = Deadlines::new();
        let (tcp, _) = accept(&listener).await.unwrap();
        let deadline = deadlines.watch(&tcp);
        let mut silent_conn =
            ServerConn::new(tcp, Limits::default()).with_deadline(deadline, TIMEOUTS);

        let talker = monoio::spawn(async move {
            let mut tcp = connect(addr).await.unwrap();
            write_raw(&mut tcp, b"GET /models HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            read_to_end(&mut tcp).await.unwrap()
        });
        let (tcp, _) = accept(&listener).await.unwrap();
        let deadline = deadlines.watch(&tcp);
        let mut talker_conn =
            ServerConn::new(tcp, Limits::default()).with_deadline(deadline, TIMEOUTS);

        let request = talker_conn.read_request().await.unwrap().unwrap();
        assert_eq!(request.head.target, "/models");
        let err = silent_conn.read_request().await.unwrap_err();
        assert!(matches!(err, HttpError::TimedOut(Wait::Head)), "{err:?}");
        assert_eq!(talker_conn.deadline().unwrap().expired(), None);
        drop(silent_conn);
        assert_eq!(
            silent.await,
            b"",
            "the silent client got nothing but the close"
        );

        // Answered; the next request never comes.
        talker_conn
            .write_response(200, [("content-type", "text/plain")], "ok".into())
            .await
            .unwrap();
        let started = clock::now();
        let err = talker_conn.read_request().await.unwrap_err();
        assert!(matches!(err, HttpError::TimedOut(Wait::Idle)), "{err:?}");
        assert!(clock::now().duration_since(started) < GENEROUS);
        drop(talker_conn);
        let (head, body) = response(&talker.await);
        assert_eq!((head.status, &body[..]), (200, &b"ok"[..]));
        assert_eq!(deadlines.pending(), 0, "no entry outlives its connection");
    }

    // A body that stops half way (412 of 1,000 declared bytes) is cut off by
    // the body idle timeout; the client reads 408.
    #[monoio::test_all(timer_enabled = true)]
    async fn a_body_that_stalls_half_way_is_cut_off_with_408() {
        let (listener, addr) = listen();
        let client = monoio::spawn(async move {
            let mut tcp = connect(addr).await.unwrap();
            let mut request =
                b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 1000\r\n\r\n".to_vec();
            request.extend(std::iter::repeat_n(b'x', 412));
            write_raw(&mut tcp, &request).await.unwrap();
            read_to_end(&mut tcp).await.unwrap()
        });
        let mut conn = server(&listener, TIMEOUTS).await;
        let err = conn.read_request().await.unwrap_err();
        assert!(matches!(err, HttpError::TimedOut(Wait::Body)), "{err:?}");
        conn.write_error(&err).await.unwrap();
        drop(conn);
        let (head, body) = response(&client.await);
        assert_eq!(head.status, 408);
        assert_eq!(
            String::from_utf8(body).unwrap(),
            "timed out waiting for the body (deadline passed)\n"
        );
    }

    // A body that keeps coming, each piece within the idle timeout, is read
    // to its end even though the whole takes longer than the timeout.
    #[monoio::test_all(timer_enabled = true)]
    async fn a_slow_body_that_keeps_coming_is_read() {
        let timeouts = ServerTimeouts {
            body_idle: Duration::from_millis(1500),
            ..TIMEOUTS
        };
        let (listener, addr) = listen();
        let client = monoio::spawn(async move {
            let mut tcp = connect(addr).await.unwrap();
            write_raw(&mut tcp, b"POST / HTTP/1.1\r\nContent-Length: 20\r\n\r\n")
                .await
                .unwrap();
            for _ in 0..20 {
                monoio::time::sleep(Duration::from_millis(100)).await;
                write_raw(&mut tcp, b"y").await.unwrap();
            }
            tcp
        });
        let mut conn = server(&listener, timeouts).await;
        let request = conn.read_request().await.unwrap().unwrap();
        assert_eq!(&request.body[..], &[b'y'; 20][..]);
        drop(client.await);
    }

    // A body trickled a byte at a time, each within the idle timeout, is
    // cut off once its grace has passed without the minimum rate: the idle
    // bound alone would read it for as long as the client kept trickling.
    #[monoio::test_all(timer_enabled = true)]
    async fn a_trickled_body_below_the_minimum_rate_is_cut_off_after_its_grace() {
        let timeouts = ServerTimeouts {
            body_idle: GENEROUS,
            body_min_rate: Some(BodyRate {
                grace: Duration::from_millis(400),
                bytes_per_sec: 1024,
            }),
            ..TIMEOUTS
        };
        let (listener, addr) = listen();
        let client = monoio::spawn(async move {
            let mut tcp = connect(addr).await.unwrap();
            write_raw(&mut tcp, b"POST / HTTP/1.1\r\nContent-Length: 1000\r\n\r\n")
                .await
                .unwrap();
            let started = clock::now();
            // 10 bytes a second: far below the rate, and never idle long.
            while clock::now().duration_since(started) < GENEROUS {
                if write_raw(&mut tcp, b"y").await.is_err() {
                    break;
                }
                monoio::time::sleep(Duration::from_millis(100)).await;
            }
            read_to_end(&mut tcp).await.unwrap_or_default()
        });
        let mut conn = server(&listener, timeouts).await;
        let started = clock::now();
        let err = conn.read_request().await.unwrap_err();
        assert!(matches!(err, HttpError::TimedOut(Wait::Body)), "{err:?}");
        // Cut off by the rate, not by the (generous) idle bound.
        assert!(clock::now().duration_since(started) < GENEROUS);
        conn.write_error(&err).await.unwrap();
        drop(conn);
        let (head, _) = response(&client.await);
        assert_eq!(head.status, 408);
    }

    // A body sent at more than the minimum rate is read to its end although
    // it takes longer than the grace.
    #[monoio::test_all(timer_enabled = true)]
    async fn a_body_above_the_minimum_rate_outlives_its_grace() {
        let timeouts = ServerTimeouts {
            body_idle: GENEROUS,
            body_min_rate: Some(BodyRate {
                grace: Duration::from_millis(200),
                bytes_per_sec: 100,
            }),
            ..TIMEOUTS
        };
        let (listener, addr) = listen();
        let client = monoio::spawn(async move {
            let mut tcp = connect(addr).await.unwrap();
            write_raw(&mut tcp, b"POST / HTTP/1.1\r\nContent-Length: 2000\r\n\r\n")
                .await
                .unwrap();
            // 200 bytes every 100 ms: 2,000 bytes a second, 20 times the
            // rate, for about a second (five times the grace).
            for _ in 0..10 {
                write_raw(&mut tcp, &[b'z'; 200]).await.unwrap();
                monoio::time::sleep(Duration::from_millis(100)).await;
            }
            tcp
        });
        let mut conn = server(&listener, timeouts).await;
        let request = conn.read_request().await.unwrap().unwrap();
        assert_eq!(&request.body[..], &[b'z'; 2000][..]);
        drop(client.await);
    }

    // The head is read alone: a request refused on its head is answered
    // before any of its body is read (the client sent none of it), and the
    // connection closes after the answer.
    #[monoio::test_all(timer_enabled = true)]
    async fn a_request_refused_on_its_head_is_answered_without_its_body() {
        let (listener, addr) = listen();
        let client = monoio::spawn(async move {
            let mut tcp = connect(addr).await.unwrap();
            write_raw(
                &mut tcp,
                b"POST /x HTTP/1.1\r\nContent-Length: 10000000\r\n\r\n",
            )
            .await
            .unwrap();
            read_to_end(&mut tcp).await.unwrap()
        });
        let mut conn = server(&listener, TIMEOUTS).await;
        let head = conn.read_head().await.unwrap().unwrap();
        assert_eq!(head.target, "/x");
        conn.skip_body(&head);
        assert!(!conn.keep_alive());
        conn.write_response(401, [("content-type", "text/plain")], "no\n".into())
            .await
            .unwrap();
        let end = conn
            .linger_close(&Linger {
                time: GENEROUS,
                idle: Duration::from_millis(300),
                max_bytes: 1 << 20,
            })
            .await;
        assert!(matches!(
            end,
            LingerEnd::PeerClosed { .. } | LingerEnd::TimedOut { .. }
        ));
        drop(conn);
        let raw = client.await;
        let (head, body) = response(&raw);
        assert_eq!(head.status, 401);
        assert_eq!(&body[..], b"no\n");
        assert!(String::from_utf8_lossy(&raw).contains("connection: close"));
    }

    // A request without a body keeps its connection when refused on its
    // head.
    #[monoio::test_all(timer_enabled = true)]
    async fn a_bodiless_request_refused_on_its_head_keeps_the_connection() {
        let (listener, addr) = listen();
        let client = monoio::spawn(async move {
            let mut tcp = connect(addr).await.unwrap();
            write_raw(
                &mut tcp,
                b"GET /x HTTP/1.1\r\n\r\nGET /y HTTP/1.1\r\nConnection: close\r\n\r\n",
            )
            .await
            .unwrap();
            read_to_end(&mut tcp).await.unwrap()
        });
        let mut conn = server(&listener, TIMEOUTS).await;
        let head = conn.read_head().await.unwrap().unwrap();
        conn.skip_body(&head);
        assert!(conn.keep_alive());
        conn.write_response(401, [("content-type", "text/plain")], "no\n".into())
            .await
            .unwrap();
        let next = conn.read_request().await.unwrap().unwrap();
        assert_eq!(next.head.target, "/y");
        conn.write_response(200, [("content-type", "text/plain")], "ok".into())
            .await
            .unwrap();
        drop(conn);
        let raw = String::from_utf8(client.await).unwrap();
        assert!(raw.starts_with("HTTP/1.1 401"), "{raw}");
        assert!(raw.contains("HTTP/1.1 200"), "{raw}");
    }

    // After a response, a kept-alive connection that sends nothing is closed
    // at the keep-alive idle timeout, with no answer.
    #[monoio::test_all(timer_enabled = true)]
    async fn an_idle_keep_alive_connection_is_closed_silently() {
        let (listener, addr) = listen();
        let client = monoio::spawn(async move {
            let mut tcp = connect(addr).await.unwrap();
            write_raw(&mut tcp, b"GET /a HTTP/1.1\r\n\r\n")
                .await
                .unwrap();
            read_to_end(&mut tcp).await.unwrap()
        });
        let mut conn = server(&listener, TIMEOUTS).await;
        let request = conn.read_request().await.unwrap().unwrap();
        assert_eq!(request.head.target, "/a");
        conn.write_response(200, [("content-type", "text/plain")], "ok".into())
            .await
            .unwrap();
        assert!(conn.keep_alive());
        let err = conn.read_request().await.unwrap_err();
        assert!(matches!(err, HttpError::TimedOut(Wait::Idle)), "{err:?}");
        assert!(!err.is_answerable());
        drop(conn);
        let (head, body) = response(&client.await);
        assert_eq!((head.status, &body[..]), (200, &b"ok"[..]));
    }

    // A connection that never sends a byte is cut off by the head deadline
    // of its first request, which runs from the accept.
    #[monoio::test_all(timer_enabled = true)]
    async fn a_silent_new_connection_is_cut_off_by_the_head_deadline() {
        let (listener, addr) = listen();
        let client = monoio::spawn(async move {
            let mut tcp = connect(addr).await.unwrap();
            read_to_end(&mut tcp).await.unwrap()
        });
        let mut conn = server(&listener, TIMEOUTS).await;
        let err = conn.read_request().await.unwrap_err();
        assert!(matches!(err, HttpError::TimedOut(Wait::Head)), "{err:?}");
        drop(conn);
        assert_eq!(client.await, b"");
    }

    /// A client that writes a whole 64 MiB body before it reads anything
    /// (Python's urllib, many simple clients), then returns what it read.
    async fn write_body_then_read(addr: SocketAddr) -> std::io::Result<Vec<u8>> {
        let mut tcp = connect(addr).await.unwrap();
        let body_bytes = 64 * 1024 * 1024;
        let head =
            format!("POST /v1/chat/completions HTTP/1.1\r\nContent-Length: {body_bytes}\r\n\r\n");
        write_raw(&mut tcp, head.as_bytes()).await?;
        let piece = vec![b'a'; 1024 * 1024];
        for _ in 0..64 {
            write_raw(&mut tcp, &piece).await?;
        }
        read_to_end(&mut tcp).await
    }

    // The 413 for a body over the limit goes out before the body is read; the
    // lingering close reads and discards the body the client still sends, so
    // the client reads the 413 instead of a reset.
    #[monoio::test_all(timer_enabled = true)]
    async fn a_client_that_writes_64_mib_before_reading_receives_the_413() {
        let (listener, addr) = listen();
        let client = monoio::spawn(write_body_then_read(addr));
        let mut conn = server(&listener, TIMEOUTS).await;
        let err = conn.read_request().await.unwrap_err();
        assert!(matches!(err, HttpError::BodyTooLarge { .. }), "{err:?}");
        let end = answer(&mut conn, &err).await;
        assert_eq!(
            end,
            LingerEnd::PeerClosed {
                discarded_bytes: 64 * 1024 * 1024
            }
        );
        drop(conn);
        let raw = client.await.expect("the client reads the answer, no reset");
        let (head, body) = response(&raw);
        assert_eq!(head.status, 413);
        assert_eq!(
            String::from_utf8(body).unwrap(),
            "message body is longer than 8388608 bytes\n"
        );
    }

    /// Starts [`write_body_then_read`] and answers its request with the
    /// 413, before any lingering: the client task and the connection.
    async fn refused_big_body() -> (
        monoio::task::JoinHandle<std::io::Result<Vec<u8>>>,
        ServerConn<TcpStream>,
    ) {
        let (listener, addr) = listen();
        let client = monoio::spawn(write_body_then_read(addr));
        let mut conn = server(&listener, TIMEOUTS).await;
        let err = conn.read_request().await.unwrap_err();
        assert!(matches!(err, HttpError::BodyTooLarge { .. }), "{err:?}");
        conn.write_error(&err).await.unwrap();
        (client, conn)
    }

    // Without the lingering close the same client gets a reset (the bug the
    // lingering close fixes): closing with unread request bytes makes the
    // kernel answer with RST.
    #[monoio::test_all(timer_enabled = true)]
    async fn closing_with_unread_body_bytes_resets_the_client() {
        let (client, conn) = refused_big_body().await;
        drop(conn);
        let err = client.await.expect_err("a reset, not the answer");
        assert!(
            matches!(
                err.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
            ),
            "{err:?}"
        );
    }

    // A client that keeps sending after the answer is cut off at the byte
    // cap, and one that sends nothing more and never closes at the idle
    // bound.
    #[monoio::test_all(timer_enabled = true)]
    async fn lingering_is_bounded_by_bytes_and_by_idle_time() {
        let (client, mut conn) = refused_big_body().await;
        let end = conn
            .linger_close(&Linger {
                time: GENEROUS,
                idle: GENEROUS,
                max_bytes: 1024 * 1024,
            })
            .await;
        assert_eq!(end, LingerEnd::ByteCapReached);
        drop(conn);
        let _ = client.await;

        let (listener, addr) = listen();
        let client = monoio::spawn(async move {
            let mut tcp = connect(addr).await.unwrap();
            write_raw(&mut tcp, b"GET / HTTP/1.1\r\nBad Header\r\n\r\n")
                .await
                .unwrap();
            // Reads the answer and its EOF, then stays open, sending nothing.
            let raw = read_to_end(&mut tcp).await.unwrap();
            (raw, tcp)
        });
        let mut conn = server(&listener, TIMEOUTS).await;
        let err = conn.read_request().await.unwrap_err();
        conn.write_error(&err).await.unwrap();
        let end = conn
            .linger_close(&Linger {
                time: GENEROUS,
                idle: Duration::from_millis(200),
                max_bytes: 1 << 30,
            })
            .await;
        // The unparsed bad head is what was discarded.
        let bad_head_bytes = b"GET / HTTP/1.1\r\nBad Header\r\n\r\n".len() as u64;
        assert_eq!(
            end,
            LingerEnd::TimedOut {
                discarded_bytes: bad_head_bytes
            }
        );
        let (raw, _tcp) = client.await;
        assert_eq!(response(&raw).0.status, 400);
    }

    /// A connected pair (client, server side) whose buffers are shrunk so a
    /// writer blocks after a few KiB: the client's receive buffer and the
    /// server's send buffer. Made with std sockets (a blocking connect on
    /// loopback completes from the backlog) and handed to monoio.
    fn small_buffered_pair() -> (TcpStream, TcpStream) {
        use nix::sys::socket::{setsockopt, sockopt};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        setsockopt(&client, sockopt::RcvBuf, &(32 * 1024)).unwrap();
        setsockopt(&server, sockopt::SndBuf, &(32 * 1024)).unwrap();
        for tcp in [&client, &server] {
            tcp.set_nodelay(true).unwrap();
            tcp.set_nonblocking(true).unwrap();
        }
        (
            TcpStream::from_std(client).unwrap(),
            TcpStream::from_std(server).unwrap(),
        )
    }

    /// One request, then a chunked response of `chunks` chunks of
    /// `chunk_bytes` each, written as fast as the client takes them.
    /// Returns how the writing ended and the bytes written.
    async fn stream_to(
        conn: &mut ServerConn<TcpStream>,
        chunks: usize,
        chunk_bytes: usize,
    ) -> (Result<(), HttpError>, usize) {
        conn.read_request().await.unwrap().expect("a request");
        conn.start_chunked(200, [("content-type", "text/event-stream")])
            .await
            .unwrap();
        let chunk = bytes::Bytes::from(vec![b'~'; chunk_bytes]);
        let mut written = 0;
        for _ in 0..chunks {
            if let Err(e) = conn.write_chunk(chunk.clone()).await {
                return (Err(e), written);
            }
            written += chunk_bytes;
        }
        (conn.finish().await, written)
    }

    // A client that asks for a stream and never reads it: once the socket
    // buffers are full, no byte moves for the stall timeout and the write
    // fails with TimedOut(Write); the connection is reset, so the client's
    // reads end in ECONNRESET, not in an end of stream it could take for a
    // complete answer.
    #[monoio::test_all(timer_enabled = true)]
    async fn a_client_that_stops_reading_is_cut_off_and_reset() {
        let timeouts = ServerTimeouts {
            write_stall: Some(Duration::from_millis(300)),
            ..TIMEOUTS
        };
        let (listener, addr) = listen();
        let (stop_tx, stop_rx) = iop_engine::sync::oneshot::channel::<()>();
        let client = monoio::spawn(async move {
            let mut tcp = connect(addr).await.unwrap();
            write_raw(&mut tcp, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            // Never reads until the server gave up.
            let _ = stop_rx.await;
            read_to_end(&mut tcp).await.map(|bytes| bytes.len())
        });
        let mut conn = server(&listener, timeouts).await;
        // 1 GiB offered: far more than any socket buffer holds.
        let (ended, written) = stream_to(&mut conn, 16 * 1024, 64 * 1024).await;
        assert!(
            matches!(ended, Err(HttpError::TimedOut(Wait::Write))),
            "{ended:?} after {written} bytes"
        );
        assert!(written < 1 << 30, "{written}");
        assert!(!conn.keep_alive());
        drop(conn);
        drop(stop_tx);
        let read = client.await;
        assert_eq!(
            read.map_err(|e| e.kind()),
            Err(std::io::ErrorKind::ConnectionReset)
        );
    }

    // A slow reader that keeps taking bytes, each pause shorter than the
    // stall timeout, gets the whole stream although it takes far longer
    // than the timeout: progress pushes the deadline on.
    #[monoio::test_all(timer_enabled = true)]
    async fn a_slow_reader_that_keeps_reading_gets_the_whole_stream() {
        let timeouts = ServerTimeouts {
            write_stall: Some(Duration::from_millis(1500)),
            ..TIMEOUTS
        };
        const CHUNKS: usize = 64;
        const CHUNK_BYTES: usize = 64 * 1024;
        let (mut tcp, server_side) = small_buffered_pair();
        let client = monoio::spawn(async move {
            write_raw(&mut tcp, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            let started = clock::now();
            let mut body = 0usize;
            loop {
                let (res, buf) = tcp.read(Vec::with_capacity(64 * 1024)).await;
                match res {
                    Ok(0) | Err(_) => break,
                    Ok(_) => body += buf.iter().filter(|b| **b == b'~').count(),
                }
                if body >= CHUNKS * CHUNK_BYTES {
                    break;
                }
                monoio::time::sleep(Duration::from_millis(50)).await;
            }
            (body, clock::now().duration_since(started))
        });
        let deadline = Deadlines::new().watch(&server_side);
        let mut conn =
            ServerConn::new(server_side, Limits::default()).with_deadline(deadline, timeouts);
        let (ended, written) = stream_to(&mut conn, CHUNKS, CHUNK_BYTES).await;
        assert!(ended.is_ok(), "{ended:?} after {written} bytes");
        let (body, took) = client.await;
        assert_eq!(body, CHUNKS * CHUNK_BYTES);
        // Nothing here bounds the time; it only shows the stream outlived
        // the stall timeout (4 MiB through small socket buffers, at most
        // 64 KiB per 50 ms), so progress, not the total, is what the
        // deadline measured.
        assert!(took > Duration::from_millis(1500), "{took:?}");
    }
}
