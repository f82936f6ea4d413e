//! `iop_engine::http` shells over real loopback TCP, on both monoio drivers
//! (io_uring and legacy epoll): a `ServerConn` and a `ClientConn` (or raw
//! socket bytes where the client shell cannot produce the input).

use std::net::SocketAddr;

use bytes::{Bytes, BytesMut};
use iop_engine::http::{
    accept, connect, parse_response_head, BodyFraming, ClientConn, HttpError, Limits, ResponseHead,
    ServerConn,
};
use monoio::io::{AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt};
use monoio::net::{TcpListener, TcpStream};

/// Named `http` so `cargo test -p iop-engine http` selects these tests.
mod http {
    use super::*;

    fn listen() -> (TcpListener, SocketAddr) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        (listener, addr)
    }

    async fn client(addr: SocketAddr) -> ClientConn<TcpStream> {
        ClientConn::new(connect(addr).await.unwrap(), Limits::default()).with_host("test")
    }

    async fn write_raw(stream: &mut TcpStream, bytes: &[u8]) {
        let (res, _) = stream.write_all(bytes.to_vec()).await;
        res.unwrap();
    }

    async fn read_exact_raw(stream: &mut TcpStream, len: usize) -> Vec<u8> {
        let mut out = Vec::new();
        while out.len() < len {
            let (res, buf) = stream.read(Vec::with_capacity(len - out.len())).await;
            assert!(res.unwrap() > 0, "EOF after {out:?}");
            out.extend_from_slice(&buf);
        }
        out
    }

    async fn read_to_eof(stream: &mut TcpStream) -> Vec<u8> {
        let mut out = Vec::new();
        loop {
            let (res, buf) = stream.read(Vec::with_capacity(4096)).await;
            if res.unwrap() == 0 {
                return out;
            }
            out.extend_from_slice(&buf);
        }
    }

    /// Parses a whole raw response: head and the bytes after it.
    fn split_response(raw: &[u8]) -> (ResponseHead, Vec<u8>) {
        let mut buf = BytesMut::from(raw);
        let head = parse_response_head(&mut buf, &Limits::default(), false)
            .unwrap()
            .unwrap();
        (head, buf.to_vec())
    }

    async fn drain_body(conn: &mut ClientConn<TcpStream>) -> Vec<u8> {
        let mut body = Vec::new();
        while let Some(piece) = conn.read_body_chunk().await.unwrap() {
            assert!(!piece.is_empty());
            body.extend_from_slice(&piece);
        }
        body
    }

    /// Answers a request error the way a server should, then waits for the
    /// client to go away (closing with unread input would reset the socket and
    /// could destroy the answer before the client reads it).
    async fn answer_error_and_linger(conn: &mut ServerConn<TcpStream>, error: &HttpError) {
        assert!(error.is_answerable());
        conn.write_error(error).await.unwrap();
        assert!(!conn.keep_alive());
        conn.close().await.unwrap();
    }

    // The exchange's own headers go on every response head of that
    // exchange (whole and streamed) and not on the next one; the stats
    // count exactly the bytes the client read, the status and whether a
    // body byte went out.
    #[monoio::test_all]
    async fn exchange_headers_and_stats_follow_each_response() {
        let (listener, addr) = listen();
        let server = monoio::spawn(async move {
            let (stream, _) = accept(&listener).await.unwrap();
            let mut conn = ServerConn::new(stream, Limits::default());
            let mut stats = Vec::new();
            // 1: a whole response, the header set twice (the last wins).
            conn.read_request().await.unwrap().unwrap();
            conn.set_exchange_header("x-request-id", Bytes::from_static(b"first"));
            conn.set_exchange_header("x-request-id", Bytes::from_static(b"req-1"));
            conn.write_response(
                200,
                [("content-type", "text/plain")],
                Bytes::from_static(b"hello"),
            )
            .await
            .unwrap();
            stats.push(conn.exchange());
            // 2: streamed.
            conn.read_request().await.unwrap().unwrap();
            assert_eq!(conn.exchange(), Default::default(), "reset per request");
            conn.set_exchange_header("x-request-id", Bytes::from_static(b"req-2"));
            conn.start_chunked(200, [("content-type", "text/event-stream")])
                .await
                .unwrap();
            conn.write_chunk(Bytes::from_static(b"data: x\n\n"))
                .await
                .unwrap();
            conn.finish().await.unwrap();
            stats.push(conn.exchange());
            // 3: no exchange header, no body.
            conn.read_request().await.unwrap().unwrap();
            conn.write_response(204, [("x-empty", "1")], Bytes::new())
                .await
                .unwrap();
            stats.push(conn.exchange());
            assert!(conn.read_request().await.unwrap().is_none());
            stats
        });
        let mut stream = connect(addr).await.unwrap();
        write_raw(
            &mut stream,
            b"GET /a HTTP/1.1\r\nhost: t\r\n\r\nGET /b HTTP/1.1\r\nhost: t\r\n\r\n\
              GET /c HTTP/1.1\r\nhost: t\r\n\r\n",
        )
        .await;
        stream.shutdown().await.unwrap();
        let raw = read_to_eof(&mut stream).await;
        let stats = server.await;
        let text = String::from_utf8(raw.clone()).unwrap();
        let first = text.find("HTTP/1.1 200").unwrap();
        let second = text[first + 1..].find("HTTP/1.1 200").unwrap() + first + 1;
        let third = text.find("HTTP/1.1 204").unwrap();
        let (r1, r2, r3) = (&text[first..second], &text[second..third], &text[third..]);
        assert!(
            r1.contains("x-request-id: req-1\r\n") && !r1.contains("first"),
            "{r1}"
        );
        assert!(r2.contains("x-request-id: req-2\r\n"), "{r2}");
        assert!(!r3.contains("x-request-id"), "{r3}");
        assert_eq!(
            stats.iter().map(|s| s.status).collect::<Vec<_>>(),
            [Some(200), Some(200), Some(204)]
        );
        let lens: Vec<u64> = [r1, r2, r3].iter().map(|r| r.len() as u64).collect();
        assert_eq!(
            stats.iter().map(|s| s.bytes_out).collect::<Vec<_>>(),
            lens,
            "every byte the client read, counted once"
        );
        assert!(stats[0].first_body_byte_at.is_some() && stats[1].first_body_byte_at.is_some());
        assert_eq!(stats[2].first_body_byte_at, None);
    }

    // A request read with nothing behind it leaves the connection no read
    // buffer (its head and small body are copies), so a streaming response
    // or an idle kept-alive connection holds none; bytes pipelined behind a
    // request stay buffered, exact, for the next read.
    #[monoio::test_all]
    async fn a_request_read_leaves_no_read_buffer_behind() {
        let (listener, addr) = listen();
        let server = monoio::spawn(async move {
            let (stream, _) = accept(&listener).await.unwrap();
            let mut conn = ServerConn::new(stream, Limits::default());
            assert_eq!(conn.read_buffer_bytes(), 0, "nothing before the first read");
            let one = conn.read_request().await.unwrap().unwrap();
            assert_eq!(&one.body[..], b"{\"n\":1}");
            assert_eq!(one.head.header("x-tag").map(|v| &v[..]), Some(&b"one"[..]));
            assert_eq!(conn.read_buffer_bytes(), 0);
            conn.write_response(200, [("x", "1")], Bytes::from_static(b"a"))
                .await
                .unwrap();
            // Two requests in one write: the second waits in the buffer.
            let two = conn.read_request().await.unwrap().unwrap();
            assert_eq!(&two.body[..], b"{\"n\":2}");
            assert!(
                conn.read_buffer_bytes() > 0,
                "the pipelined request is kept"
            );
            conn.write_response(200, [("x", "2")], Bytes::from_static(b"b"))
                .await
                .unwrap();
            let three = conn.read_request().await.unwrap().unwrap();
            assert_eq!(&three.body[..], b"{\"n\":3}");
            assert_eq!(
                three.head.header("x-tag").map(|v| &v[..]),
                Some(&b"three"[..])
            );
            assert_eq!(conn.read_buffer_bytes(), 0);
            conn.write_response(200, [("x", "3")], Bytes::from_static(b"c"))
                .await
                .unwrap();
            assert!(conn.read_request().await.unwrap().is_none(), "clean EOF");
            assert_eq!(conn.read_buffer_bytes(), 0);
        });
        let request = |n: u8, tag: &str| {
            format!(
                "POST /r HTTP/1.1\r\nhost: t\r\nx-tag: {tag}\r\ncontent-length: 7\r\n\r\n{{\"n\":{n}}}"
            )
        };
        let mut raw = connect(addr).await.unwrap();
        write_raw(&mut raw, request(1, "one").as_bytes()).await;
        let first = read_exact_raw(&mut raw, 1).await;
        let pipelined = format!("{}{}", request(2, "two"), request(3, "three"));
        write_raw(&mut raw, pipelined.as_bytes()).await;
        raw.shutdown().await.unwrap();
        let rest = read_to_eof(&mut raw).await;
        let all = [first, rest].concat();
        let text = String::from_utf8(all).unwrap();
        assert_eq!(text.matches("HTTP/1.1 200").count(), 3, "{text}");
        assert!(text.ends_with("\r\n\r\nc"), "{text}");
        server.await;
    }

    #[monoio::test_all]
    async fn content_length_request_and_response() {
        let (listener, addr) = listen();
        let server = monoio::spawn(async move {
            let (stream, _) = accept(&listener).await.unwrap();
            let mut conn = ServerConn::new(stream, Limits::default());
            let req = conn.read_request().await.unwrap().unwrap();
            assert_eq!(req.head.method, "POST");
            assert_eq!(req.head.target, "/v1/chat/completions");
            assert_eq!(req.head.header("host").map(|v| &v[..]), Some(&b"test"[..]));
            assert_eq!(
                req.head.header("content-type").map(|v| &v[..]),
                Some(&b"application/json"[..])
            );
            assert_eq!(
                req.head.framing,
                BodyFraming::ContentLength { len_bytes: 13 }
            );
            assert_eq!(&req.body[..], b"{\"model\":\"m\"}");
            conn.write_response(
                200,
                [("content-type", "application/json")],
                Bytes::from_static(b"{\"ok\":true}"),
            )
            .await
            .unwrap();
            assert!(conn.read_request().await.unwrap().is_none(), "clean EOF");
        });
        let mut conn = client(addr).await;
        conn.send_request(
            "POST",
            "/v1/chat/completions",
            [("content-type", "application/json")],
            Bytes::from_static(b"{\"model\":\"m\"}"),
        )
        .await
        .unwrap();
        let head = conn.read_response_head().await.unwrap();
        assert_eq!(head.status, 200);
        assert_eq!(head.reason, "OK");
        assert_eq!(head.framing, BodyFraming::ContentLength { len_bytes: 11 });
        assert_eq!(drain_body(&mut conn).await, b"{\"ok\":true}");
        assert!(conn.is_reusable());
        drop(conn);
        server.await;
    }

    #[monoio::test_all]
    async fn chunked_request_body_is_decoded_in_full() {
        let (listener, addr) = listen();
        let server = monoio::spawn(async move {
            let (stream, _) = accept(&listener).await.unwrap();
            let mut conn = ServerConn::new(stream, Limits::default());
            let req = conn.read_request().await.unwrap().unwrap();
            assert_eq!(req.head.framing, BodyFraming::Chunked);
            assert_eq!(&req.body[..], b"hello, chunked world");
            conn.write_response(201, [("x-n", "1")], Bytes::new())
                .await
                .unwrap();
        });
        let mut stream = connect(addr).await.unwrap();
        // The body arrives in two writes, split inside a chunk-size line.
        write_raw(
            &mut stream,
            b"POST /upload HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n7;ext=1\r\nhello, \r\n",
        )
        .await;
        write_raw(
            &mut stream,
            b"d\r\nchunked world\r\n0\r\nX-Trailer: 1\r\n\r\n",
        )
        .await;
        let raw = read_exact_raw(
            &mut stream,
            b"HTTP/1.1 201 Created\r\nx-n: 1\r\ncontent-length: 0\r\n\r\n".len(),
        )
        .await;
        assert_eq!(
            raw,
            b"HTTP/1.1 201 Created\r\nx-n: 1\r\ncontent-length: 0\r\n\r\n"
        );
        server.await;
    }

    #[monoio::test_all]
    async fn keep_alive_carries_two_requests_on_one_connection() {
        let (listener, addr) = listen();
        let server = monoio::spawn(async move {
            let (stream, _) = accept(&listener).await.unwrap();
            let mut conn = ServerConn::new(stream, Limits::default());
            let mut targets = Vec::new();
            while let Some(req) = conn.read_request().await.unwrap() {
                targets.push(req.head.target.clone());
                let body = Bytes::from(format!("answer to {}", req.head.target));
                conn.write_response(200, [("content-type", "text/plain")], body)
                    .await
                    .unwrap();
                if !conn.keep_alive() {
                    break;
                }
            }
            targets
        });
        let mut conn = client(addr).await;
        for (i, target) in ["/one", "/two"].iter().enumerate() {
            conn.send_request("GET", target, [("accept", "*/*")], Bytes::new())
                .await
                .unwrap();
            let head = conn.read_response_head().await.unwrap();
            assert_eq!(head.status, 200);
            assert!(head.keep_alive);
            assert_eq!(
                drain_body(&mut conn).await,
                format!("answer to {target}").as_bytes()
            );
            assert!(conn.is_reusable(), "after response {i}");
        }
        drop(conn);
        assert_eq!(server.await, vec!["/one".to_owned(), "/two".to_owned()]);
    }

    #[monoio::test_all]
    async fn streamed_chunked_response_reaches_the_client_chunk_by_chunk() {
        let (listener, addr) = listen();
        let (first_received_tx, first_received_rx) = iop_engine::sync::oneshot::channel::<()>();
        let server = monoio::spawn(async move {
            let (stream, _) = accept(&listener).await.unwrap();
            let mut conn = ServerConn::new(stream, Limits::default());
            let _req = conn.read_request().await.unwrap().unwrap();
            conn.start_chunked(200, [("content-type", "text/event-stream")])
                .await
                .unwrap();
            conn.write_chunk(Bytes::from_static(b"data: first\n\n"))
                .await
                .unwrap();
            // The second chunk is written only after the client has the first:
            // the client cannot be waiting for the whole body.
            first_received_rx.await.unwrap();
            conn.write_chunk(Bytes::new()).await.unwrap(); // no-op, must not end the body
            conn.write_chunk(Bytes::from_static(b"data: second\n\n"))
                .await
                .unwrap();
            conn.finish().await.unwrap();
            assert!(conn.keep_alive());
            assert!(conn.read_request().await.unwrap().is_none());
        });
        let mut conn = client(addr).await;
        conn.send_request(
            "POST",
            "/stream",
            [("accept", "text/event-stream")],
            Bytes::from_static(b"{}"),
        )
        .await
        .unwrap();
        let head = conn.read_response_head().await.unwrap();
        assert_eq!(head.framing, BodyFraming::Chunked);
        assert_eq!(
            head.header("content-type").map(|v| &v[..]),
            Some(&b"text/event-stream"[..])
        );
        let first = conn.read_body_chunk().await.unwrap().unwrap();
        assert_eq!(&first[..], b"data: first\n\n");
        first_received_tx.send(()).unwrap();
        let second = conn.read_body_chunk().await.unwrap().unwrap();
        assert_eq!(&second[..], b"data: second\n\n");
        assert_eq!(conn.read_body_chunk().await.unwrap(), None);
        assert!(conn.is_reusable());
        drop(conn);
        server.await;
    }

    #[monoio::test_all]
    async fn head_and_first_chunk_go_out_in_one_write() {
        let (listener, addr) = listen();
        let (first_read_tx, first_read_rx) = iop_engine::sync::oneshot::channel::<()>();
        let server = monoio::spawn(async move {
            let (stream, _) = accept(&listener).await.unwrap();
            let mut conn = ServerConn::new(stream, Limits::default());
            let _req = conn.read_request().await.unwrap().unwrap();
            conn.start_chunked_with(
                200,
                [("content-type", "text/event-stream")],
                Bytes::from_static(b"data: first\n\n"),
            )
            .await
            .unwrap();
            // Nothing more until the client's first read returned.
            first_read_rx.await.unwrap();
            conn.finish().await.unwrap();
        });
        let mut stream = connect(addr).await.unwrap();
        write_raw(&mut stream, b"GET /s HTTP/1.1\r\nhost: t\r\n\r\n").await;
        // One read returns the head and the whole first chunk: they were
        // written together, not the head alone first.
        let (res, buf) = stream.read(Vec::with_capacity(4096)).await;
        let n = res.unwrap();
        first_read_tx.send(()).unwrap();
        let (head, body) = split_response(&buf[..n]);
        assert_eq!(head.status, 200);
        assert_eq!(head.framing, BodyFraming::Chunked);
        assert_eq!(body, b"d\r\ndata: first\n\n\r\n");
        let rest = read_exact_raw(&mut stream, 5).await;
        assert_eq!(rest, b"0\r\n\r\n");
        drop(stream);
        server.await;
    }

    #[monoio::test_all]
    async fn head_request_gets_no_first_chunk() {
        let (listener, addr) = listen();
        let server = monoio::spawn(async move {
            let (stream, _) = accept(&listener).await.unwrap();
            let mut conn = ServerConn::new(stream, Limits::default());
            let _req = conn.read_request().await.unwrap().unwrap();
            conn.start_chunked_with(200, [("x", "y")], Bytes::from_static(b"body"))
                .await
                .unwrap();
            conn.finish().await.unwrap();
            conn.close().await.unwrap();
        });
        let mut stream = connect(addr).await.unwrap();
        write_raw(&mut stream, b"HEAD /s HTTP/1.1\r\nhost: t\r\n\r\n").await;
        let raw = read_to_eof(&mut stream).await;
        let (head, body) = split_response(&raw);
        assert_eq!(head.status, 200);
        assert_eq!(body, b"");
        server.await;
    }

    #[monoio::test_all]
    async fn raw_read_relays_chunk_framing_unchanged() {
        let (listener, addr) = listen();
        let server = monoio::spawn(async move {
            let (stream, _) = accept(&listener).await.unwrap();
            let mut conn = ServerConn::new(stream, Limits::default());
            let _req = conn.read_request().await.unwrap().unwrap();
            conn.start_chunked(200, [("x", "y")]).await.unwrap();
            conn.write_chunk(Bytes::from_static(b"abc")).await.unwrap();
            conn.write_chunk(Bytes::from(vec![b'z'; 26])).await.unwrap();
            conn.finish().await.unwrap();
        });
        let mut conn = client(addr).await;
        conn.send_request("GET", "/", [("a", "b")], Bytes::new())
            .await
            .unwrap();
        conn.read_response_head().await.unwrap();
        let mut wire = Vec::new();
        while let Some(piece) = conn.read_raw().await.unwrap() {
            wire.extend_from_slice(&piece);
        }
        let mut expected = b"3\r\nabc\r\n1a\r\n".to_vec();
        expected.extend_from_slice(&[b'z'; 26]);
        expected.extend_from_slice(b"\r\n0\r\n\r\n");
        assert_eq!(wire, expected);
        assert!(conn.is_reusable());
        drop(conn);
        server.await;
    }

    #[monoio::test_all]
    async fn close_delimited_response_ends_at_eof() {
        let (listener, addr) = listen();
        let server = monoio::spawn(async move {
            let (mut stream, _) = accept(&listener).await.unwrap();
            let mut buf = BytesMut::new();
            loop {
                let (res, b) = stream.read(Vec::with_capacity(1024)).await;
                assert!(res.unwrap() > 0);
                buf.extend_from_slice(&b);
                if buf.ends_with(b"\r\n\r\n") {
                    break;
                }
            }
            write_raw(
                &mut stream,
                b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nhello ",
            )
            .await;
            write_raw(&mut stream, b"until close").await;
            // Dropping the stream closes it: the end of the body.
        });
        let mut conn = client(addr).await;
        conn.send_request("GET", "/", [("a", "b")], Bytes::new())
            .await
            .unwrap();
        let head = conn.read_response_head().await.unwrap();
        assert_eq!(head.framing, BodyFraming::CloseDelimited);
        assert!(!head.keep_alive);
        assert_eq!(drain_body(&mut conn).await, b"hello until close");
        assert!(!conn.is_reusable());
        server.await;
    }

    #[monoio::test_all]
    async fn http10_client_gets_a_close_delimited_stream() {
        let (listener, addr) = listen();
        let server = monoio::spawn(async move {
            let (stream, _) = accept(&listener).await.unwrap();
            let mut conn = ServerConn::new(stream, Limits::default());
            let req = conn.read_request().await.unwrap().unwrap();
            assert!(!req.head.keep_alive);
            conn.start_chunked(200, [("content-type", "text/plain")])
                .await
                .unwrap();
            conn.write_chunk(Bytes::from_static(b"one ")).await.unwrap();
            conn.write_chunk(Bytes::from_static(b"two")).await.unwrap();
            conn.finish().await.unwrap();
            assert!(!conn.keep_alive());
        });
        let mut stream = connect(addr).await.unwrap();
        write_raw(&mut stream, b"GET / HTTP/1.0\r\n\r\n").await;
        let raw = read_to_eof(&mut stream).await;
        assert_eq!(
            raw,
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\none two"
        );
        server.await;
    }

    #[monoio::test_all]
    async fn expect_100_continue_is_answered_before_the_body() {
        let (listener, addr) = listen();
        let server = monoio::spawn(async move {
            let (stream, _) = accept(&listener).await.unwrap();
            let mut conn = ServerConn::new(stream, Limits::default());
            let req = conn.read_request().await.unwrap().unwrap();
            assert!(req.head.expect_continue);
            assert_eq!(&req.body[..], b"12345");
            conn.write_response(200, [("a", "b")], Bytes::from_static(b"ok"))
                .await
                .unwrap();
        });
        let mut stream = connect(addr).await.unwrap();
        write_raw(
            &mut stream,
            b"PUT /x HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n",
        )
        .await;
        // The client holds the body back until the interim answer.
        let interim = read_exact_raw(&mut stream, b"HTTP/1.1 100 Continue\r\n\r\n".len()).await;
        assert_eq!(interim, b"HTTP/1.1 100 Continue\r\n\r\n");
        write_raw(&mut stream, b"12345").await;
        let expected = b"HTTP/1.1 200 OK\r\na: b\r\ncontent-length: 2\r\n\r\nok";
        assert_eq!(read_exact_raw(&mut stream, expected.len()).await, expected);
        server.await;
    }

    #[monoio::test_all]
    async fn oversized_head_is_answered_with_431() {
        let (listener, addr) = listen();
        let limits = Limits {
            max_head_bytes: 1024,
            ..Limits::default()
        };
        let server = monoio::spawn(async move {
            let (stream, _) = accept(&listener).await.unwrap();
            let mut conn = ServerConn::new(stream, limits);
            let err = conn.read_request().await.unwrap_err();
            assert!(
                matches!(err, HttpError::HeadTooLarge { max_bytes: 1024 }),
                "{err:?}"
            );
            answer_error_and_linger(&mut conn, &err).await;
            conn
        });
        let mut conn = client(addr).await;
        let big = "x".repeat(2048);
        conn.send_request("GET", "/", [("x-big", big.as_str())], Bytes::new())
            .await
            .unwrap();
        let head = conn.read_response_head().await.unwrap();
        assert_eq!(head.status, 431);
        assert_eq!(head.reason, "Request Header Fields Too Large");
        assert!(!head.keep_alive);
        assert_eq!(
            head.header("connection").map(|v| &v[..]),
            Some(&b"close"[..])
        );
        assert_eq!(
            drain_body(&mut conn).await,
            b"message head is longer than 1024 bytes\n"
        );
        assert!(!conn.is_reusable());
        drop(conn);
        drop(server.await);
    }

    #[monoio::test_all]
    async fn oversized_content_length_is_answered_with_413_without_100_continue() {
        let (listener, addr) = listen();
        let limits = Limits {
            max_body_bytes: 1024,
            ..Limits::default()
        };
        let server = monoio::spawn(async move {
            let (stream, _) = accept(&listener).await.unwrap();
            let mut conn = ServerConn::new(stream, limits);
            let err = conn.read_request().await.unwrap_err();
            assert!(
                matches!(err, HttpError::BodyTooLarge { max_bytes: 1024 }),
                "{err:?}"
            );
            answer_error_and_linger(&mut conn, &err).await;
            conn
        });
        let mut stream = connect(addr).await.unwrap();
        write_raw(
            &mut stream,
            b"POST / HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 1025\r\n\r\n",
        )
        .await;
        let raw = read_to_eof(&mut stream).await;
        let (head, body) = split_response(&raw);
        assert_eq!(head.status, 413);
        assert!(!head.keep_alive);
        assert_eq!(body, b"message body is longer than 1024 bytes\n");
        drop(server.await);
    }

    #[monoio::test_all]
    async fn oversized_chunked_body_is_answered_with_413() {
        let (listener, addr) = listen();
        let limits = Limits {
            max_body_bytes: 1024,
            ..Limits::default()
        };
        let server = monoio::spawn(async move {
            let (stream, _) = accept(&listener).await.unwrap();
            let mut conn = ServerConn::new(stream, limits);
            let err = conn.read_request().await.unwrap_err();
            assert!(
                matches!(err, HttpError::BodyTooLarge { max_bytes: 1024 }),
                "{err:?}"
            );
            answer_error_and_linger(&mut conn, &err).await;
            conn
        });
        let mut stream = connect(addr).await.unwrap();
        let mut request =
            b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        for _ in 0..3 {
            request.extend_from_slice(b"200\r\n");
            request.extend_from_slice(&[b'a'; 0x200]);
            request.extend_from_slice(b"\r\n");
        }
        request.extend_from_slice(b"0\r\n\r\n");
        write_raw(&mut stream, &request).await;
        let raw = read_to_eof(&mut stream).await;
        let (head, body) = split_response(&raw);
        assert_eq!(head.status, 413);
        assert_eq!(body, b"message body is longer than 1024 bytes\n");
        drop(server.await);
    }

    #[monoio::test_all]
    async fn stale_pooled_connection_reports_closed_before_response() {
        let (listener, addr) = listen();
        let server = monoio::spawn(async move {
            let (stream, _) = accept(&listener).await.unwrap();
            let mut conn = ServerConn::new(stream, Limits::default());
            let _req = conn.read_request().await.unwrap().unwrap();
            // Close without answering, as a server dropping an idle connection.
        });
        let mut conn = client(addr).await;
        conn.send_request("GET", "/", [("a", "b")], Bytes::new())
            .await
            .unwrap();
        server.await;
        let err = conn.read_response_head().await.unwrap_err();
        assert!(matches!(err, HttpError::ClosedBeforeResponse), "{err:?}");
        assert!(!conn.is_reusable());
    }

    #[monoio::test_all]
    async fn head_response_has_length_but_no_body_and_keeps_the_connection() {
        let (listener, addr) = listen();
        let server = monoio::spawn(async move {
            let (stream, _) = accept(&listener).await.unwrap();
            let mut conn = ServerConn::new(stream, Limits::default());
            while let Some(req) = conn.read_request().await.unwrap() {
                let body = Bytes::from(format!("{} body", req.head.method));
                conn.write_response(200, [("x", "1")], body).await.unwrap();
            }
        });
        let mut conn = client(addr).await;
        conn.send_request("HEAD", "/", [("a", "b")], Bytes::new())
            .await
            .unwrap();
        let head = conn.read_response_head().await.unwrap();
        assert_eq!(head.framing, BodyFraming::None);
        assert_eq!(
            head.header("content-length").map(|v| &v[..]),
            Some(&b"9"[..])
        );
        assert_eq!(drain_body(&mut conn).await, b"");
        assert!(conn.is_reusable());
        // No body bytes leaked into the connection: the next response parses.
        conn.send_request("GET", "/", [("a", "b")], Bytes::new())
            .await
            .unwrap();
        let head = conn.read_response_head().await.unwrap();
        assert_eq!(head.framing, BodyFraming::ContentLength { len_bytes: 8 });
        assert_eq!(drain_body(&mut conn).await, b"GET body");
        drop(conn);
        server.await;
    }

    #[monoio::test_all]
    async fn request_trickling_in_byte_by_byte_is_parsed() {
        let (listener, addr) = listen();
        let server = monoio::spawn(async move {
            let (stream, _) = accept(&listener).await.unwrap();
            let mut conn = ServerConn::new(stream, Limits::default());
            let req = conn.read_request().await.unwrap().unwrap();
            conn.write_response(200, [("a", "b")], req.body)
                .await
                .unwrap();
        });
        let mut stream = connect(addr).await.unwrap();
        let request = b"POST /t HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\nbody";
        for byte in request {
            write_raw(&mut stream, &[*byte]).await;
        }
        let expected = b"HTTP/1.1 200 OK\r\na: b\r\ncontent-length: 4\r\n\r\nbody";
        assert_eq!(read_exact_raw(&mut stream, expected.len()).await, expected);
        server.await;
    }
}
