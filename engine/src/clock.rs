//! Time, injected. This is the only module that reads the OS clock; every
//! protocol core takes `now` as an input, and tests use [`ManualClock`].

use std::cell::Cell;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A source of monotonic and wall-clock time.
pub trait Clock {
    /// Monotonic now.
    fn now(&self) -> Instant;
    /// Milliseconds since the Unix epoch (wall clock; for lease validity and
    /// logs, never for timeouts).
    fn unix_ms(&self) -> i64;
}

/// The operating system's clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[allow(clippy::disallowed_methods)] // the one allowed place
    fn now(&self) -> Instant {
        Instant::now()
    }

    #[allow(clippy::disallowed_methods)] // the one allowed place
    fn unix_ms(&self) -> i64 {
        match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
            Err(e) => -i64::try_from(e.duration().as_millis()).unwrap_or(i64::MAX),
        }
    }
}

/// Monotonic now from the OS clock.
pub fn now() -> Instant {
    SystemClock.now()
}

/// Wall-clock milliseconds since the Unix epoch from the OS clock.
pub fn unix_ms() -> i64 {
    SystemClock.unix_ms()
}

/// Monotonic nanoseconds (`CLOCK_MONOTONIC`), comparable across processes on
/// one machine.
pub fn monotonic_raw_ns() -> u64 {
    // CLOCK_MONOTONIC is system-wide, so two processes on one machine compare
    // these values directly (the bench stamps chunks with it).
    match nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC) {
        Ok(ts) => (ts.tv_sec() as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(ts.tv_nsec() as u64),
        Err(_) => 0,
    }
}

/// A clock tests move by hand.
#[derive(Debug)]
pub struct ManualClock {
    origin: Instant,
    elapsed: Cell<Duration>,
    unix_origin_ms: i64,
}

impl ManualClock {
    /// A manual clock starting at the current instant and the given wall time.
    pub fn new(unix_origin_ms: i64) -> Self {
        Self {
            origin: now(),
            elapsed: Cell::new(Duration::ZERO),
            unix_origin_ms,
        }
    }

    /// Moves time forward.
    pub fn advance(&self, by: Duration) {
        self.elapsed.set(self.elapsed.get() + by);
    }

    /// Time elapsed since creation.
    pub fn elapsed(&self) -> Duration {
        self.elapsed.get()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.origin + self.elapsed.get()
    }

    fn unix_ms(&self) -> i64 {
        self.unix_origin_ms
            .saturating_add(i64::try_from(self.elapsed.get().as_millis()).unwrap_or(i64::MAX))
    }
}
