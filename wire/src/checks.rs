//! Pure value checks fixed by the contract.
//!
//! - [`effective_stall_timeout`]: `response_stall_timeout_ms` → the watchdog
//!   duration (W1).
//! - [`ReconnectPolicy::from_config`]: the Node's reconnect settings (S2).

use std::time::Duration;

use crate::limits::DEFAULT_RESPONSE_STALL_TIMEOUT_MS;

/// A `response_stall_timeout_ms` the Node must reject before any router or
/// provider call (W1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StallTimeoutError {
    /// The value is below zero.
    #[error("response_stall_timeout_ms must not be negative (got {0})")]
    Negative(i64),
    /// The value does not fit a signed 64-bit nanosecond duration.
    #[error("response_stall_timeout_ms {0} overflows a nanosecond duration (max {max})", max = MAX_STALL_TIMEOUT_MS)]
    Overflow(i64),
}

/// The largest accepted `response_stall_timeout_ms`: the largest millisecond
/// count whose nanosecond value fits an `i64` (peers written in other
/// languages hold durations as signed nanoseconds).
pub const MAX_STALL_TIMEOUT_MS: i64 = i64::MAX / 1_000_000;

/// The watchdog duration for a request's `response_stall_timeout_ms` (W1):
/// 0 → the Node default of 300000 ms; negative or overflowing → error.
pub fn effective_stall_timeout(timeout_ms: i64) -> Result<Duration, StallTimeoutError> {
    effective_stall_timeout_with_default(timeout_ms, DEFAULT_RESPONSE_STALL_TIMEOUT_MS)
}

/// As [`effective_stall_timeout`], with a Node-configured default for 0
/// (`NodeRuntimeConfig.default_response_stall_timeout_ms`). A default of 0
/// itself means the contract default of 300000 ms (W1). An error carries the
/// offending value: the request's, or the default's when the request is 0.
pub fn effective_stall_timeout_with_default(
    timeout_ms: i64,
    default_ms: i64,
) -> Result<Duration, StallTimeoutError> {
    let ms = match (timeout_ms, default_ms) {
        (0, 0) => DEFAULT_RESPONSE_STALL_TIMEOUT_MS,
        (0, default_ms) => default_ms,
        (v, _) => v,
    };
    if ms < 0 {
        return Err(StallTimeoutError::Negative(ms));
    }
    if ms > MAX_STALL_TIMEOUT_MS {
        return Err(StallTimeoutError::Overflow(ms));
    }
    // `ms` is non-negative here, so the cast is exact.
    Ok(Duration::from_millis(ms as u64))
}

/// Default reconnect interval when `reconnect.interval_sec` is omitted (S2).
pub const DEFAULT_RECONNECT_INTERVAL_SEC: u64 = 10;
/// Default attempt count when `reconnect.max_attempts` is omitted (S2).
pub const DEFAULT_RECONNECT_MAX_ATTEMPTS: u32 = 10;

/// How many connection attempts the Node supervisor makes (S2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempts {
    /// Retry until local shutdown (`max_attempts = 0`).
    Unlimited,
    /// Exactly this many attempts, then exit 1 (S3).
    Limited(u32),
}

/// The Node's validated reconnect policy (S2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconnectPolicy {
    /// Wait between attempts.
    pub interval: Duration,
    /// Attempt budget.
    pub attempts: Attempts,
}

/// An invalid reconnect setting (S2). Names the config key at fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReconnectPolicyError {
    /// `reconnect.max_attempts` is negative.
    #[error("reconnect.max_attempts must be 0 (unlimited) or positive (got {0})")]
    NegativeMaxAttempts(i64),
    /// `reconnect.max_attempts` does not fit 32 bits.
    #[error("reconnect.max_attempts is too large (got {0})")]
    MaxAttemptsTooLarge(i64),
    /// `reconnect.interval_sec` is negative.
    #[error("reconnect.interval_sec must not be negative (got {0})")]
    NegativeInterval(i64),
    /// Unlimited retries need a positive interval.
    #[error("reconnect.interval_sec must be > 0 when reconnect.max_attempts = 0 (unlimited)")]
    UnlimitedNeedsInterval,
}

impl ReconnectPolicyError {
    /// The config key this error is about.
    pub fn key(&self) -> &'static str {
        match self {
            Self::NegativeMaxAttempts(_) | Self::MaxAttemptsTooLarge(_) => "reconnect.max_attempts",
            Self::NegativeInterval(_) | Self::UnlimitedNeedsInterval => "reconnect.interval_sec",
        }
    }
}

impl ReconnectPolicy {
    /// Validates the raw config values (S2): `max_attempts` explicit 0 =
    /// unlimited, omitted = 10, positive = exactly that many, negative =
    /// error; unlimited needs `interval_sec > 0`; omitted interval = 10 s.
    pub fn from_config(
        interval_sec: Option<i64>,
        max_attempts: Option<i64>,
    ) -> Result<Self, ReconnectPolicyError> {
        let interval_sec = match interval_sec {
            None => DEFAULT_RECONNECT_INTERVAL_SEC,
            Some(v) if v < 0 => return Err(ReconnectPolicyError::NegativeInterval(v)),
            Some(v) => v as u64,
        };
        let attempts = match max_attempts {
            None => Attempts::Limited(DEFAULT_RECONNECT_MAX_ATTEMPTS),
            Some(0) => Attempts::Unlimited,
            Some(v) if v < 0 => return Err(ReconnectPolicyError::NegativeMaxAttempts(v)),
            Some(v) => Attempts::Limited(
                u32::try_from(v).map_err(|_| ReconnectPolicyError::MaxAttemptsTooLarge(v))?,
            ),
        };
        if attempts == Attempts::Unlimited && interval_sec == 0 {
            return Err(ReconnectPolicyError::UnlimitedNeedsInterval);
        }
        Ok(Self {
            interval: Duration::from_secs(interval_sec),
            attempts,
        })
    }

    /// Whether another attempt is allowed after `attempts_made` failed ones.
    pub fn allows_attempt(&self, attempts_made: u32) -> bool {
        match self.attempts {
            Attempts::Unlimited => true,
            Attempts::Limited(n) => attempts_made < n,
        }
    }
}
