//! Process allocator settings: memory a burst of large bodies or
//! connections used goes back to the operating system afterwards.
//!
//! Both binaries keep glibc's allocator and tune it at startup
//! ([`return_freed_memory`]); the Edge also trims its heaps after
//! connections closed ([`trim`]). Measured with `bench bodies` (6 concurrent
//! 7.45 MiB chat bodies of 220,000 messages, `docs/front-door.md`):
//!
//! | allocator | Edge RSS idle → peak → after | peak growth ÷ (N × body) |
//! |---|---|---|
//! | glibc defaults | 12.0 → 81.9 → 81.9 MiB (kept) | 1.56 |
//! | glibc, fixed mmap and trim thresholds (these settings) | 12.1 → 64.4 → 12.4 MiB | 1.17 |
//! | mimalloc 0.1.52 | 22.7 → 92.5 → 92.5 MiB (kept) | 1.56 |
//! | mimalloc, `MIMALLOC_PURGE_DECOMMITS=1` | 12.6 → 75.1 → 73.9 MiB | 1.40 |
//!
//! Why glibc's default keeps the memory: its mmap threshold is dynamic. The
//! first large buffer is mapped, but freeing it raises the threshold to its
//! size (up to 32 MiB), so every later body-sized buffer comes from a heap
//! arena and stays there after it is freed. A fixed threshold
//! (`M_MMAP_THRESHOLD`, which also turns the dynamic adjustment off) maps
//! every buffer over 128 KiB and unmaps it on free; a fixed trim threshold
//! returns free heap tops over 128 KiB. Small allocations (per-connection
//! read buffers, 16 KiB) still fragment the heaps, so after connections
//! close `malloc_trim(0)` releases the free pages inside them (5,000 idle
//! keep-alive connections: 70 MiB kept without it, see [`trim`]).
//!
//! On a libc other than glibc these calls do nothing.

/// Buffers above this are mapped on their own and unmapped when freed; a
/// free heap top above it is returned.
pub const THRESHOLD_BYTES: usize = 128 * 1024;

/// Fixes glibc's mmap and trim thresholds at [`THRESHOLD_BYTES`]. Call once
/// at startup, before the runtime threads start. Returns whether the
/// settings were accepted (always `false` off glibc).
pub fn return_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let threshold = libc::c_int::try_from(THRESHOLD_BYTES).unwrap_or(libc::c_int::MAX);
        // SAFETY: mallopt takes two integers and only changes allocator
        // parameters under glibc's own lock; it touches no memory of ours
        // and is safe to call at any time from any thread.
        let mmap = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, threshold) };
        // SAFETY: as above.
        let trim = unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, threshold) };
        mmap == 1 && trim == 1
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Returns every free page of every heap arena to the operating system
/// (`malloc_trim(0)`). Costs a walk over the free lists (about a
/// millisecond for a heap of tens of MiB); call it after memory was freed
/// in bulk, not per request. Returns whether memory was released.
pub fn trim() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only walks glibc's own arenas under their
        // locks and releases free pages; it touches no memory of ours.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// A global allocator that forwards to the system's and counts the bytes
/// live in the whole process, for tests that prove memory is given back:
/// install it with `#[global_allocator] static A: CountingAlloc =
/// CountingAlloc;` and read [`CountingAlloc::live_bytes`] around the
/// exchange under test. The count is one relaxed atomic add per call.
#[derive(Debug)]
pub struct CountingAlloc;

static COUNTED_LIVE_BYTES: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

impl CountingAlloc {
    /// Bytes allocated and not yet freed through this allocator, process
    /// wide (every thread's).
    pub fn live_bytes() -> i64 {
        COUNTED_LIVE_BYTES.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn count(delta_bytes: i64) {
        COUNTED_LIVE_BYTES.fetch_add(delta_bytes, std::sync::atomic::Ordering::Relaxed);
    }
}

fn size_i64(size_bytes: usize) -> i64 {
    i64::try_from(size_bytes).unwrap_or(i64::MAX)
}

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged, so `System`'s guarantees carry over; the bookkeeping is one
// atomic add, which never allocates.
unsafe impl std::alloc::GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        Self::count(size_i64(layout.size()));
        // SAFETY: forwarded unchanged; the caller upholds `alloc`'s contract.
        unsafe { std::alloc::System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        Self::count(size_i64(layout.size()));
        // SAFETY: forwarded unchanged; the caller upholds `alloc_zeroed`'s
        // contract.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        Self::count(-size_i64(layout.size()));
        // SAFETY: forwarded unchanged; `ptr` came from this allocator,
        // which is `System`'s.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        Self::count(size_i64(new_size) - size_i64(layout.size()));
        // SAFETY: forwarded unchanged; the caller upholds `realloc`'s
        // contract.
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_accepts_the_settings() {
        assert!(return_freed_memory());
    }
}
