//! `iop_engine::pool` buffers in real monoio IO over loopback TCP, on both
//! drivers: owned reads into pooled memory, zero-copy freeze and write, and
//! the late return of a buffer held by a cancelled read.

use std::time::Duration;

use bytes::Bytes;
use iop_engine::pool::{BufferPool, PoolConfig, PooledBuf};
use monoio::buf::IoBufMut;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::{TcpListener, TcpStream};

/// Guard against a hang: a test that has not finished by then fails.
const TEST_GUARD: Duration = Duration::from_secs(20);

async fn guarded<F: std::future::Future<Output = ()>>(test: F) {
    if monoio::time::timeout(TEST_GUARD, test).await.is_err() {
        panic!("test did not finish within {TEST_GUARD:?}");
    }
}

fn pool(buffer_size_bytes: usize, buffer_count_max: usize) -> BufferPool {
    BufferPool::new(PoolConfig {
        buffer_size_bytes,
        buffer_count_max,
    })
    .expect("valid pool config")
}

fn take(pool: &BufferPool) -> PooledBuf {
    pool.try_acquire().expect("pool has a free buffer")
}

async fn connected_pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let accept = monoio::spawn(async move { listener.accept().await.map(|(stream, _)| stream) });
    let client = TcpStream::connect(addr).await.expect("connect");
    let server = accept.await.expect("accept");
    (client, server)
}

/// Reads into `buf` (appending) until it holds `want_bytes`.
async fn read_exact_into(
    stream: &mut TcpStream,
    mut buf: PooledBuf,
    want_bytes: usize,
) -> PooledBuf {
    while buf.len() < want_bytes {
        let start = buf.len();
        let (result, slice) = stream.read(buf.slice_mut(start..)).await;
        buf = slice.into_inner();
        let read_bytes = result.expect("read");
        assert_ne!(read_bytes, 0, "peer closed after {start} bytes");
    }
    buf
}

/// Sleeps in 1 ms steps until the pool has nothing on loan (at most 1000
/// steps; the caller asserts the outcome).
async fn settle(pool: &BufferPool) {
    for _ in 0..1000 {
        if pool.in_use() == 0 {
            return;
        }
        monoio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[monoio::test_all(timer_enabled = true)]
async fn pool_read_into_pooled_buf_freeze_and_echo_without_copy() {
    guarded(async {
        let pool = pool(16 * 1024, 4);
        let (mut client, mut server) = connected_pair().await;
        let payload: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();

        let (written, _) = client.write_all(payload.clone()).await;
        assert_eq!(written.expect("write"), 10_000);

        let buf = take(&pool);
        let memory_ptr = buf.as_ptr();
        let buf = read_exact_into(&mut server, buf, payload.len()).await;
        assert_eq!(buf.len(), 10_000);
        assert_eq!(pool.in_use(), 1);

        let body = buf.freeze();
        // The Bytes is the pooled memory itself: no copy on the relay path.
        assert_eq!(body.as_ptr(), memory_ptr);
        assert_eq!(&body[..], &payload[..]);

        // Forward two slices of it with write_all(Bytes): shared, not copied.
        let (head, tail) = (body.slice(..4_000), body.slice(4_000..));
        drop(body);
        let (written, _) = server.write_all(head).await;
        assert_eq!(written.expect("write head"), 4_000);
        let (written, _) = server.write_all(tail).await;
        assert_eq!(written.expect("write tail"), 6_000);

        let echo = read_exact_into(&mut client, take(&pool), payload.len()).await;
        assert_eq!(&echo[..], &payload[..]);
        drop(echo);

        // The echo reused the body's buffer, returned by the last slice.
        assert_eq!(pool.in_use(), 0);
        assert_eq!(pool.available(), 1);
        assert_eq!(pool.allocated(), 1);
        assert_eq!(pool.stale_returns(), 0);
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn pool_appending_reads_fill_capacity_then_stop() {
    guarded(async {
        let pool = pool(8, 1);
        let (mut client, mut server) = connected_pair().await;
        let (written, _) = client.write_all(b"0123456789AB".to_vec()).await;
        assert_eq!(written.expect("write"), 12);

        let buf = read_exact_into(&mut server, take(&pool), 8).await;
        assert_eq!(&buf[..], b"01234567");
        assert_eq!(buf.remaining_bytes(), 0);
        let first = buf.freeze();

        // The remaining bytes go into the next buffer; the pool (cap 1) has
        // none until `first` is dropped, so acquire() overflows.
        let spill = read_exact_into(&mut server, pool.acquire(), 4).await;
        assert!(spill.is_overflow());
        assert_eq!(&spill[..], b"89AB");
        assert_eq!(pool.overflow_allocations(), 1);
        drop(first);
        assert_eq!(pool.available(), 1);
        drop(spill);
        assert_eq!(pool.available(), 1);
        assert_eq!(pool.allocated(), 1);
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn pool_cancelled_read_returns_its_buffer_late_without_leak() {
    guarded(async {
        let pool = pool(16 * 1024, 2);
        let (mut client, mut server) = connected_pair().await;

        let buf = take(&pool);
        let read = server.read(buf);
        monoio::select! {
            _ = read => panic!("a read on an idle socket completed"),
            _ = monoio::time::sleep(Duration::from_millis(10)) => {}
        }
        // The read future is gone. On io_uring the kernel still owns the
        // buffer until the cancellation completes; the legacy driver drops it
        // at once.
        let held_by_kernel = usize::from(!monoio::utils::is_legacy());
        assert_eq!(pool.in_use(), held_by_kernel);

        settle(&pool).await;
        assert_eq!(pool.in_use(), 0);
        assert_eq!(pool.available(), 1);
        assert_eq!(pool.allocated(), 1);
        assert_eq!(pool.stale_returns(), 0);

        // The socket and the returned buffer both still work.
        let (written, _) = client.write_all(b"after".to_vec()).await;
        assert_eq!(written.expect("write"), 5);
        let buf = read_exact_into(&mut server, take(&pool), 5).await;
        assert_eq!(buf.freeze(), Bytes::from_static(b"after"));
        assert_eq!(pool.in_use(), 0);
        assert_eq!(pool.allocated(), 1);
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn pool_repeated_reads_reuse_pooled_buffers() {
    guarded(async {
        let pool = pool(4 * 1024, 2);
        let (mut client, mut server) = connected_pair().await;
        for round in 0..200u32 {
            let message = round.to_be_bytes().repeat(64);
            let (written, _) = client.write_all(message.clone()).await;
            assert_eq!(written.expect("write"), 256);
            let body = read_exact_into(&mut server, pool.acquire(), 256)
                .await
                .freeze();
            assert_eq!(&body[..], &message[..]);
        }
        assert_eq!(pool.allocated(), 1);
        assert_eq!(pool.overflow_allocations(), 0);
        assert_eq!(pool.in_use(), 0);
    })
    .await;
}
