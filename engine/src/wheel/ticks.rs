//! Converting between `Duration`/`Instant` and wheel ticks.
//!
//! The wheel itself only knows `u64` ticks. These helpers pick the rounding
//! that keeps a timer from ever firing early:
//!
//! - a *deadline* rounds **up** to the next tick boundary ([`TickLength::ticks_ceil`],
//!   [`TickScale::deadline_tick`]);
//! - *now* rounds **down** ([`TickLength::ticks_floor`], [`TickScale::now_tick`]).
//!
//! So `now_tick >= deadline_tick` implies `now >= deadline`: the wheel fires a
//! timer up to one tick late, never early.

use std::time::{Duration, Instant};

/// Why a tick length was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TickError {
    /// A tick of zero length cannot divide time.
    #[error("tick length must be greater than zero")]
    Zero,
    /// The tick does not fit in `u64` nanoseconds (about 584 years).
    #[error("tick length of {seconds} s exceeds u64 nanoseconds")]
    TooLong {
        /// The refused length, whole seconds.
        seconds: u64,
    },
}

/// The length of one wheel tick: a non-zero number of nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TickLength {
    tick_ns: u64,
}

impl TickLength {
    /// A tick of `tick`; refuses zero and lengths beyond `u64` nanoseconds.
    pub fn new(tick: Duration) -> Result<Self, TickError> {
        let tick_ns = u64::try_from(tick.as_nanos()).map_err(|_| TickError::TooLong {
            seconds: tick.as_secs(),
        })?;
        if tick_ns == 0 {
            return Err(TickError::Zero);
        }
        Ok(Self { tick_ns })
    }

    /// A tick of `tick_ms` milliseconds; refuses zero.
    pub fn from_ms(tick_ms: u64) -> Result<Self, TickError> {
        Self::new(Duration::from_millis(tick_ms))
    }

    /// The tick as a `Duration`.
    pub fn duration(self) -> Duration {
        Duration::from_nanos(self.tick_ns)
    }

    /// The tick in nanoseconds (never zero).
    pub fn tick_ns(self) -> u64 {
        self.tick_ns
    }

    /// Ticks covering `duration`, rounded **up** (use for deadlines and
    /// timeouts). Saturates at `u64::MAX`.
    pub fn ticks_ceil(self, duration: Duration) -> u64 {
        let ns = duration.as_nanos();
        let tick = u128::from(self.tick_ns);
        let ticks = ns / tick + u128::from(ns % tick != 0);
        u64::try_from(ticks).unwrap_or(u64::MAX)
    }

    /// Whole ticks elapsed in `duration`, rounded **down** (use for "now").
    /// Saturates at `u64::MAX`.
    pub fn ticks_floor(self, duration: Duration) -> u64 {
        let ticks = duration.as_nanos() / u128::from(self.tick_ns);
        u64::try_from(ticks).unwrap_or(u64::MAX)
    }

    /// The duration of `ticks` ticks. Saturates at `Duration::MAX`.
    pub fn ticks_to_duration(self, ticks: u64) -> Duration {
        let ns = u128::from(ticks) * u128::from(self.tick_ns);
        let secs = ns / 1_000_000_000;
        let sub_ns = (ns % 1_000_000_000) as u32; // < 1e9, fits
        match u64::try_from(secs) {
            Ok(secs) => Duration::new(secs, sub_ns),
            Err(_) => Duration::MAX,
        }
    }
}

/// Ticks anchored at an origin `Instant`: tick `k` starts at
/// `origin + k * tick`. Reads no clock — callers pass instants in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TickScale {
    origin: Instant,
    length: TickLength,
}

impl TickScale {
    /// Ticks of `length` counted from `origin` (tick 0).
    pub fn new(origin: Instant, length: TickLength) -> Self {
        Self { origin, length }
    }

    /// The instant of tick 0.
    pub fn origin(&self) -> Instant {
        self.origin
    }

    /// The tick length.
    pub fn length(&self) -> TickLength {
        self.length
    }

    /// The tick to advance the wheel to at `now`: whole ticks since the origin,
    /// rounded down. Instants before the origin map to tick 0.
    pub fn now_tick(&self, now: Instant) -> u64 {
        self.length
            .ticks_floor(now.saturating_duration_since(self.origin))
    }

    /// The tick at which a timer for `deadline` may fire: rounded **up**, so
    /// `now_tick(t) >= deadline_tick(deadline)` implies `t >= deadline`.
    pub fn deadline_tick(&self, deadline: Instant) -> u64 {
        self.length
            .ticks_ceil(deadline.saturating_duration_since(self.origin))
    }

    /// The deadline tick for a timeout of `timeout` starting at `now`.
    pub fn deadline_after(&self, now: Instant, timeout: Duration) -> u64 {
        match now.checked_add(timeout) {
            Some(deadline) => self.deadline_tick(deadline),
            None => u64::MAX,
        }
    }

    /// The instant tick `tick` starts (for sleeping until a wheel deadline);
    /// `None` if it is not representable.
    pub fn instant_at(&self, tick: u64) -> Option<Instant> {
        self.origin.checked_add(self.length.ticks_to_duration(tick))
    }
}
