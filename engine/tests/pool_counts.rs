//! `iop_engine::pool` bookkeeping without IO: loans, returns, exhaustion,
//! zero-copy freeze, late and cross-thread returns.

use bytes::Bytes;
use iop_engine::pool::{
    BufferPool, PoolConfig, PoolConfigError, PooledBuf, BUFFER_COUNT_MAX, BUFFER_SIZE_BYTES_MAX,
};

fn pool(buffer_size_bytes: usize, buffer_count_max: usize) -> BufferPool {
    match BufferPool::new(PoolConfig {
        buffer_size_bytes,
        buffer_count_max,
    }) {
        Ok(pool) => pool,
        Err(error) => panic!("valid config rejected: {error}"),
    }
}

fn take(pool: &BufferPool) -> PooledBuf {
    match pool.try_acquire() {
        Some(buf) => buf,
        None => panic!("pool unexpectedly exhausted: {pool:?}"),
    }
}

/// (available, in_use, allocated)
fn counts(pool: &BufferPool) -> (usize, usize, usize) {
    (pool.available(), pool.in_use(), pool.allocated())
}

#[test]
fn pool_config_limits_are_enforced() {
    let cases = [
        (0, 1, Err(PoolConfigError::BufferSizeZero)),
        (
            BUFFER_SIZE_BYTES_MAX + 1,
            1,
            Err(PoolConfigError::BufferSizeTooLarge {
                buffer_size_bytes: BUFFER_SIZE_BYTES_MAX + 1,
                max_bytes: BUFFER_SIZE_BYTES_MAX,
            }),
        ),
        (1, 0, Err(PoolConfigError::BufferCountZero)),
        (
            1,
            BUFFER_COUNT_MAX + 1,
            Err(PoolConfigError::BufferCountTooLarge {
                buffer_count_max: BUFFER_COUNT_MAX + 1,
                max_count: BUFFER_COUNT_MAX,
            }),
        ),
        (BUFFER_SIZE_BYTES_MAX, BUFFER_COUNT_MAX, Ok(())),
        (1, 1, Ok(())),
    ];
    for (buffer_size_bytes, buffer_count_max, expected) in cases {
        let config = PoolConfig {
            buffer_size_bytes,
            buffer_count_max,
        };
        assert_eq!(config.validate(), expected, "{config:?}");
        assert_eq!(BufferPool::new(config).map(|_| ()), expected, "{config:?}");
    }
    let default = PoolConfig::default();
    assert_eq!(default.buffer_size_bytes, 16 * 1024);
    assert_eq!(default.buffer_count_max, 1024);
    assert_eq!(default.validate(), Ok(()));
}

#[test]
fn pool_acquire_and_drop_move_counts() {
    let pool = pool(256, 3);
    assert_eq!(pool.capacity_max(), 3);
    assert_eq!(pool.buffer_size_bytes(), 256);
    assert_eq!(counts(&pool), (0, 0, 0));

    let a = take(&pool);
    assert_eq!(a.len(), 0);
    assert!(a.is_empty());
    assert_eq!(a.capacity_bytes(), 256);
    assert!(!a.is_overflow());
    assert_eq!(counts(&pool), (0, 1, 1));

    let b = take(&pool);
    assert_eq!(counts(&pool), (0, 2, 2));

    drop(a);
    assert_eq!(counts(&pool), (1, 1, 2));
    drop(b);
    assert_eq!(counts(&pool), (2, 0, 2));
    assert_eq!(pool.overflow_allocations(), 0);
    assert_eq!(pool.stale_returns(), 0);
}

#[test]
fn pool_reused_slot_gets_a_new_generation() {
    let pool = pool(64, 1);
    let first = take(&pool).id();
    let second = take(&pool).id();
    let third = take(&pool).id();
    assert_eq!(first.map(|id| (id.index(), id.generation())), Some((0, 0)));
    assert_eq!(second.map(|id| (id.index(), id.generation())), Some((0, 1)));
    assert_eq!(third.map(|id| (id.index(), id.generation())), Some((0, 2)));
    assert_ne!(first, second);
}

#[test]
fn pool_exhaustion_try_acquire_none_acquire_overflows() {
    let pool = pool(128, 2);
    let a = take(&pool);
    let b = take(&pool);
    assert!(pool.try_acquire().is_none());
    assert_eq!(pool.overflow_allocations(), 0);

    let mut extra = pool.acquire();
    assert!(extra.is_overflow());
    assert_eq!(extra.id(), None);
    assert_eq!(extra.capacity_bytes(), 128);
    assert_eq!(extra.extend_from_slice(b"spill"), 5);
    assert_eq!(&extra[..], b"spill");
    assert_eq!(pool.overflow_allocations(), 1);
    // Overflow buffers are not part of the pool.
    assert_eq!(counts(&pool), (0, 2, 2));

    let frozen = extra.freeze();
    assert_eq!(&frozen[..], b"spill");
    drop(frozen);
    assert_eq!(counts(&pool), (0, 2, 2));

    drop(a);
    // With a buffer at home, acquire lends it instead of overflowing.
    let again = pool.acquire();
    assert!(!again.is_overflow());
    assert_eq!(pool.overflow_allocations(), 1);
    drop(again);
    drop(b);
    assert_eq!(counts(&pool), (2, 0, 2));
}

#[test]
fn pool_extend_truncate_clear() {
    let pool = pool(8, 1);
    let mut buf = take(&pool);
    assert_eq!(buf.extend_from_slice(b"hello"), 5);
    assert_eq!(buf.remaining_bytes(), 3);
    assert_eq!(buf.extend_from_slice(b" world"), 3);
    assert_eq!(&buf[..], b"hello wo");
    assert_eq!(buf.remaining_bytes(), 0);
    assert_eq!(buf.extend_from_slice(b"!"), 0);
    buf[0] = b'J';
    assert_eq!(buf.as_ref(), b"Jello wo");
    buf.truncate(20);
    assert_eq!(buf.len(), 8);
    buf.truncate(4);
    assert_eq!(&buf[..], b"Jell");
    buf.clear();
    assert_eq!(buf.len(), 0);
    drop(buf);
    // A re-lent buffer starts empty.
    assert_eq!(take(&pool).len(), 0);
}

#[test]
fn pool_frozen_slices_keep_memory_until_the_last_drops() {
    let pool = pool(64, 2);
    let mut buf = take(&pool);
    buf.extend_from_slice(b"data: {\"x\":1}\n\n");
    let start_ptr = buf.as_ptr();
    let whole = buf.freeze();
    // Zero copy: the Bytes points at the pooled memory itself.
    assert_eq!(whole.as_ptr(), start_ptr);
    assert_eq!(&whole[..], b"data: {\"x\":1}\n\n");
    assert_eq!(counts(&pool), (0, 1, 1));

    let head = whole.slice(0..5);
    let body = whole.slice(6..13);
    let copy = body.clone();
    drop(whole);
    assert_eq!(&head[..], b"data:");
    assert_eq!(&body[..], b"{\"x\":1}");
    assert_eq!(counts(&pool), (0, 1, 1));

    drop(head);
    drop(body);
    assert_eq!(counts(&pool), (0, 1, 1));
    assert_eq!(&copy[..], b"{\"x\":1}");

    drop(copy);
    assert_eq!(counts(&pool), (1, 0, 1));

    // The memory came back: the next loan reuses slot 0, nothing new allocated.
    let next = take(&pool);
    assert_eq!(next.id().map(|id| id.index()), Some(0));
    assert_eq!(next.as_ptr(), start_ptr);
    assert_eq!(pool.allocated(), 1);
}

#[test]
fn pool_empty_freeze_returns_at_once() {
    let pool = pool(64, 1);
    let bytes = take(&pool).freeze();
    assert_eq!(bytes, Bytes::new());
    assert_eq!(counts(&pool), (1, 0, 1));
}

#[test]
fn pool_buffer_and_bytes_outlive_the_pool() {
    let pool = pool(64, 2);
    let mut buf = take(&pool);
    buf.extend_from_slice(b"late");
    let mut frozen_src = take(&pool);
    frozen_src.extend_from_slice(b"frozen");
    let frozen = frozen_src.freeze();
    let clone = pool.clone();
    drop(pool);
    // A second handle keeps the pool alive.
    assert_eq!(counts(&clone), (0, 2, 2));
    drop(clone);

    // The pool is gone: these drops free memory and must not panic.
    assert_eq!(&buf[..], b"late");
    drop(buf);
    let slice = frozen.slice(1..3);
    drop(frozen);
    assert_eq!(&slice[..], b"ro");
    drop(slice);
}

#[test]
fn pool_freeze_after_the_pool_is_gone_still_works() {
    let pool = pool(64, 1);
    let mut buf = take(&pool);
    buf.extend_from_slice(b"orphan");
    drop(pool);
    let bytes = buf.freeze();
    assert_eq!(&bytes[..], b"orphan");
    let moved = std::thread::spawn(move || bytes.slice(2..).to_vec()).join();
    assert_eq!(moved.ok(), Some(b"phan".to_vec()));
}

#[test]
fn pool_bytes_dropped_on_another_thread_return_to_the_owner_pool() {
    let pool = pool(64, 2);
    let mut buf = take(&pool);
    buf.extend_from_slice(b"cross-core body");
    let bytes = buf.freeze();
    let kept = bytes.slice(0..5);
    assert_eq!(counts(&pool), (0, 1, 1));

    let seen = std::thread::spawn(move || {
        let seen = bytes[6..].to_vec();
        drop(bytes);
        seen
    })
    .join();
    assert_eq!(seen.ok(), Some(b"core body".to_vec()));
    // Another clone is still alive here.
    assert_eq!(counts(&pool), (0, 1, 1));

    let last = std::thread::spawn(move || drop(kept)).join();
    assert!(last.is_ok());
    assert_eq!(counts(&pool), (1, 0, 1));
    assert_eq!(pool.stale_returns(), 0);

    // Returned memory is lent again (drained by try_acquire), no new slot.
    let again = take(&pool);
    assert_eq!(
        again.id().map(|id| (id.index(), id.generation())),
        Some((0, 1))
    );
    assert_eq!(pool.allocated(), 1);
}

#[test]
fn pool_many_threads_return_all_buffers() {
    let pool = pool(32, 16);
    let mut frozen = Vec::new();
    for i in 0..16u8 {
        let mut buf = take(&pool);
        buf.extend_from_slice(&[i; 32]);
        frozen.push(buf.freeze());
    }
    assert!(pool.try_acquire().is_none());
    let handles: Vec<_> = frozen
        .into_iter()
        .map(|bytes| std::thread::spawn(move || bytes.iter().map(|&b| u32::from(b)).sum::<u32>()))
        .collect();
    let sums: Vec<u32> = handles.into_iter().filter_map(|h| h.join().ok()).collect();
    let expected: Vec<u32> = (0..16u32).map(|i| i * 32).collect();
    assert_eq!(sums, expected);
    assert_eq!(counts(&pool), (16, 0, 16));
    assert_eq!(pool.stale_returns(), 0);
}

#[test]
fn pool_repeated_acquire_release_reuses_the_same_buffers() {
    let pool = pool(1024, 4);
    let warm: Vec<PooledBuf> = (0..4).map(|_| take(&pool)).collect();
    drop(warm);
    assert_eq!(counts(&pool), (4, 0, 4));
    for round in 0..1000u32 {
        let mut a = take(&pool);
        let b = take(&pool);
        a.extend_from_slice(&round.to_le_bytes());
        let frozen = a.freeze();
        assert_eq!(&frozen[..], &round.to_le_bytes());
        drop(b);
        drop(frozen);
        assert_eq!(pool.allocated(), 4);
    }
    assert_eq!(counts(&pool), (4, 0, 4));
    assert_eq!(pool.overflow_allocations(), 0);
    assert_eq!(pool.stale_returns(), 0);
}
