//! `iop_engine::pool` against the real allocator: a steady acquire/release
//! cycle performs no heap allocation, and memory that outlives its pool is
//! freed, not leaked.
//!
//! A counting global allocator records allocations per thread, so tests
//! running in parallel on other threads do not disturb each other's counts.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use iop_engine::pool::{BufferPool, PoolConfig, PooledBuf};

struct CountingAlloc;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
    static LIVE_BYTES: Cell<i64> = const { Cell::new(0) };
}

fn record(allocations: u64, live_delta_bytes: i64) {
    // try_with: the thread-locals may already be gone during thread teardown.
    let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + allocations));
    let _ = LIVE_BYTES.try_with(|c| c.set(c.get() + live_delta_bytes));
}

fn size_i64(layout: Layout) -> i64 {
    i64::try_from(layout.size()).unwrap_or(i64::MAX)
}

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged, so `System`'s guarantees carry over; the bookkeeping touches only
// `const`-initialized thread-locals, which never allocate.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        record(1, size_i64(layout));
        // SAFETY: forwarded unchanged; the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        record(1, size_i64(layout));
        // SAFETY: forwarded unchanged; the caller upholds `alloc_zeroed`'s contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        record(0, -size_i64(layout));
        // SAFETY: forwarded unchanged; `ptr` came from this allocator (i.e. `System`).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        record(
            1,
            i64::try_from(new_size).unwrap_or(i64::MAX) - size_i64(layout),
        );
        // SAFETY: forwarded unchanged; the caller upholds `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

fn live_bytes() -> i64 {
    LIVE_BYTES.with(Cell::get)
}

fn pool(buffer_size_bytes: usize, buffer_count_max: usize) -> BufferPool {
    match BufferPool::new(PoolConfig {
        buffer_size_bytes,
        buffer_count_max,
    }) {
        Ok(pool) => pool,
        Err(error) => panic!("valid config rejected: {error}"),
    }
}

fn take(pool: &BufferPool) -> Option<PooledBuf> {
    pool.try_acquire()
}

#[test]
fn pool_steady_acquire_release_does_not_allocate() {
    let pool = pool(16 * 1024, 4);
    // Warm up: allocate every slot once.
    let warm: Vec<Option<PooledBuf>> = (0..4).map(|_| take(&pool)).collect();
    drop(warm);
    assert_eq!(pool.available(), 4);

    let before = allocations();
    let mut filled_bytes = 0usize;
    for round in 0..10_000u32 {
        let a = take(&pool);
        let b = take(&pool);
        if let Some(mut a) = a {
            filled_bytes += a.extend_from_slice(&round.to_le_bytes());
        }
        drop(b);
    }
    let after = allocations();
    assert_eq!(filled_bytes, 40_000);
    assert_eq!(after - before, 0);
    assert_eq!(pool.allocated(), 4);
    assert_eq!(pool.available(), 4);
}

#[test]
fn pool_frozen_cycle_allocates_only_the_bytes_owner() {
    let pool = pool(4096, 2);
    drop(take(&pool));
    // Let the return queue's vectors reach their steady capacity.
    for _ in 0..2 {
        if let Some(mut buf) = take(&pool) {
            buf.extend_from_slice(b"x");
            drop(buf.freeze());
        }
        assert_eq!(pool.available(), 1);
    }

    let before = allocations();
    for _ in 0..1000 {
        if let Some(mut buf) = take(&pool) {
            buf.extend_from_slice(b"payload");
            let bytes = buf.freeze();
            let slice = bytes.slice(3..);
            drop(bytes);
            assert_eq!(&slice[..], b"load");
        }
    }
    let after = allocations();
    // One `Bytes::from_owner` box per freeze; the 4 KiB body is never copied.
    assert_eq!(after - before, 1000);
    assert_eq!(pool.allocated(), 1);
    assert_eq!(pool.available(), 1);
}

#[test]
fn pool_memory_outliving_its_pool_is_freed() {
    let baseline = live_bytes();
    let pool = pool(64 * 1024, 4);
    let mut plain = take(&pool);
    let mut frozen_src = take(&pool);
    if let Some(buf) = plain.as_mut() {
        buf.extend_from_slice(b"kept past the pool");
    }
    let frozen = frozen_src.take().map(|mut buf| {
        buf.extend_from_slice(b"bytes past the pool");
        buf.freeze()
    });
    drop(pool);
    // Both 64 KiB buffers are still alive.
    assert!(live_bytes() - baseline >= 2 * 64 * 1024);

    drop(plain);
    let slice = frozen.as_ref().map(|b| b.slice(6..10));
    drop(frozen);
    assert_eq!(slice.as_deref(), Some(&b"past"[..]));
    drop(slice);
    assert_eq!(live_bytes() - baseline, 0);
}

#[test]
fn pool_drop_with_buffers_at_home_frees_everything() {
    let baseline = live_bytes();
    let pool = pool(32 * 1024, 8);
    let held: Vec<Option<PooledBuf>> = (0..8).map(|_| take(&pool)).collect();
    drop(held);
    assert_eq!(pool.available(), 8);
    drop(pool);
    assert_eq!(live_bytes() - baseline, 0);
}

#[monoio::test_all(timer_enabled = true)]
async fn pool_late_return_after_the_pool_is_gone_frees_the_buffer() {
    use std::time::Duration;

    use monoio::io::AsyncReadRent;
    use monoio::net::{TcpListener, TcpStream};

    const BUFFER_SIZE_BYTES: usize = 1024 * 1024;

    let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let accept = monoio::spawn(async move { listener.accept().await.map(|(stream, _)| stream) });
    let client = TcpStream::connect(addr).await.expect("connect");
    let mut server = accept.await.expect("accept");

    let pool = pool(BUFFER_SIZE_BYTES, 1);
    let buf = take(&pool).expect("a free buffer");
    let read = server.read(buf);
    monoio::select! {
        _ = read => panic!("a read on an idle socket completed"),
        _ = monoio::time::sleep(Duration::from_millis(10)) => {}
    }
    let before_pool_drop = live_bytes();
    drop(pool);
    let freed_by_pool_drop = before_pool_drop - live_bytes();
    let buffer_bytes = i64::try_from(BUFFER_SIZE_BYTES).unwrap_or(i64::MAX);
    if monoio::utils::is_legacy() {
        // The cancelled read dropped the buffer at once; it was at home.
        assert!(freed_by_pool_drop >= buffer_bytes);
    } else {
        // io_uring still holds the buffer for the cancelled read.
        assert!(freed_by_pool_drop < buffer_bytes / 2);
        // Once the cancellation completes, the late drop frees the memory.
        for _ in 0..1000 {
            if before_pool_drop - live_bytes() >= buffer_bytes {
                break;
            }
            monoio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(before_pool_drop - live_bytes() >= buffer_bytes / 2);
    }
    drop(client);
    drop(server);
}
