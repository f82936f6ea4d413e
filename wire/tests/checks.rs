//! Edge values of the pure value checks: the stall timeout (W1) and the Node
//! reconnect policy (S2).

use std::time::Duration;

use iop_wire::checks::{
    effective_stall_timeout, effective_stall_timeout_with_default, Attempts, ReconnectPolicy,
    ReconnectPolicyError, StallTimeoutError, DEFAULT_RECONNECT_INTERVAL_SEC,
    DEFAULT_RECONNECT_MAX_ATTEMPTS, MAX_STALL_TIMEOUT_MS,
};
use iop_wire::limits::DEFAULT_RESPONSE_STALL_TIMEOUT_MS;

// ---------------------------------------------------------------------------
// W1: response_stall_timeout_ms
// ---------------------------------------------------------------------------

#[test]
fn stall_timeout_edge_values() {
    // CONTRACT: W1 — 0 = Node default 300000 ms; negative or overflowing
    // values are rejected.
    assert_eq!(DEFAULT_RESPONSE_STALL_TIMEOUT_MS, 300_000);
    assert_eq!(MAX_STALL_TIMEOUT_MS, 9_223_372_036_854);
    let cases: [(i64, Result<Duration, StallTimeoutError>); 8] = [
        (0, Ok(Duration::from_millis(300_000))),
        (1, Ok(Duration::from_millis(1))),
        (300_000, Ok(Duration::from_secs(300))),
        (-1, Err(StallTimeoutError::Negative(-1))),
        (i64::MIN, Err(StallTimeoutError::Negative(i64::MIN))),
        (
            MAX_STALL_TIMEOUT_MS,
            Ok(Duration::from_millis(9_223_372_036_854)),
        ),
        (
            MAX_STALL_TIMEOUT_MS + 1,
            Err(StallTimeoutError::Overflow(MAX_STALL_TIMEOUT_MS + 1)),
        ),
        (i64::MAX, Err(StallTimeoutError::Overflow(i64::MAX))),
    ];
    for (timeout_ms, expected) in cases {
        assert_eq!(
            effective_stall_timeout(timeout_ms),
            expected,
            "timeout_ms {timeout_ms}"
        );
    }
}

#[test]
fn largest_stall_timeout_fits_signed_nanoseconds() {
    // CONTRACT: W1 — "overflowing" means: does not fit an i64 nanosecond
    // duration (peers in other languages hold durations that way).
    let largest = effective_stall_timeout(MAX_STALL_TIMEOUT_MS)
        .unwrap_or_else(|e| panic!("largest accepted value refused: {e}"));
    assert!(largest.as_nanos() <= i64::MAX as u128);
    let one_more_ns = (MAX_STALL_TIMEOUT_MS as i128 + 1) * 1_000_000;
    assert!(one_more_ns > i64::MAX as i128);
}

#[test]
fn stall_timeout_with_node_default() {
    // CONTRACT: W1 — the Node-configured default replaces only 0; a
    // configured default of 0 itself means the contract default 300000 ms.
    let cases: [((i64, i64), Result<Duration, StallTimeoutError>); 9] = [
        ((0, 5_000), Ok(Duration::from_millis(5_000))),
        ((7, 5_000), Ok(Duration::from_millis(7))),
        ((0, 0), Ok(Duration::from_millis(300_000))),
        ((1, 0), Ok(Duration::from_millis(1))),
        ((-3, 5_000), Err(StallTimeoutError::Negative(-3))),
        ((0, -1), Err(StallTimeoutError::Negative(-1))),
        (
            (0, MAX_STALL_TIMEOUT_MS + 1),
            Err(StallTimeoutError::Overflow(MAX_STALL_TIMEOUT_MS + 1)),
        ),
        (
            (i64::MAX, 5_000),
            Err(StallTimeoutError::Overflow(i64::MAX)),
        ),
        (
            (MAX_STALL_TIMEOUT_MS, -1),
            Ok(Duration::from_millis(MAX_STALL_TIMEOUT_MS as u64)),
        ),
    ];
    for ((timeout_ms, default_ms), expected) in cases {
        assert_eq!(
            effective_stall_timeout_with_default(timeout_ms, default_ms),
            expected,
            "timeout_ms {timeout_ms}, default_ms {default_ms}"
        );
    }
}

#[test]
fn stall_timeout_error_messages() {
    // CONTRACT: W1
    assert_eq!(
        StallTimeoutError::Negative(-1).to_string(),
        "response_stall_timeout_ms must not be negative (got -1)"
    );
    assert_eq!(
        StallTimeoutError::Overflow(i64::MAX).to_string(),
        "response_stall_timeout_ms 9223372036854775807 overflows a nanosecond duration \
         (max 9223372036854)"
    );
}

// ---------------------------------------------------------------------------
// S2: reconnect policy
// ---------------------------------------------------------------------------

fn policy(interval_sec: u64, attempts: Attempts) -> Result<ReconnectPolicy, ReconnectPolicyError> {
    Ok(ReconnectPolicy {
        interval: Duration::from_secs(interval_sec),
        attempts,
    })
}

#[test]
fn reconnect_policy_from_config() {
    // CONTRACT: S2 — explicit 0 = unlimited; omitted = 10; positive = exactly
    // that many; negative = error; unlimited needs interval > 0; omitted
    // interval = 10 s.
    assert_eq!(DEFAULT_RECONNECT_INTERVAL_SEC, 10);
    assert_eq!(DEFAULT_RECONNECT_MAX_ATTEMPTS, 10);
    type Case = (
        (Option<i64>, Option<i64>),
        Result<ReconnectPolicy, ReconnectPolicyError>,
    );
    let too_many = i64::from(u32::MAX) + 1;
    let cases: [Case; 14] = [
        ((None, None), policy(10, Attempts::Limited(10))),
        ((None, Some(0)), policy(10, Attempts::Unlimited)),
        ((Some(3), Some(0)), policy(3, Attempts::Unlimited)),
        (
            (Some(0), Some(0)),
            Err(ReconnectPolicyError::UnlimitedNeedsInterval),
        ),
        ((Some(5), Some(7)), policy(5, Attempts::Limited(7))),
        ((Some(1), Some(1)), policy(1, Attempts::Limited(1))),
        ((None, Some(4)), policy(10, Attempts::Limited(4))),
        ((Some(2), None), policy(2, Attempts::Limited(10))),
        // A zero interval is fine with a finite budget.
        ((Some(0), Some(3)), policy(0, Attempts::Limited(3))),
        ((Some(0), None), policy(0, Attempts::Limited(10))),
        (
            (Some(10), Some(-1)),
            Err(ReconnectPolicyError::NegativeMaxAttempts(-1)),
        ),
        (
            (Some(-1), Some(5)),
            Err(ReconnectPolicyError::NegativeInterval(-1)),
        ),
        (
            (None, Some(too_many)),
            Err(ReconnectPolicyError::MaxAttemptsTooLarge(too_many)),
        ),
        (
            (None, Some(i64::from(u32::MAX))),
            policy(10, Attempts::Limited(u32::MAX)),
        ),
    ];
    for ((interval_sec, max_attempts), expected) in cases {
        assert_eq!(
            ReconnectPolicy::from_config(interval_sec, max_attempts),
            expected,
            "interval_sec {interval_sec:?}, max_attempts {max_attempts:?}"
        );
    }
}

#[test]
fn reconnect_policy_extreme_values() {
    // CONTRACT: S2
    assert_eq!(
        ReconnectPolicy::from_config(Some(i64::MAX), Some(0)),
        policy(i64::MAX as u64, Attempts::Unlimited)
    );
    assert_eq!(
        ReconnectPolicy::from_config(Some(i64::MIN), None),
        Err(ReconnectPolicyError::NegativeInterval(i64::MIN))
    );
    assert_eq!(
        ReconnectPolicy::from_config(None, Some(i64::MIN)),
        Err(ReconnectPolicyError::NegativeMaxAttempts(i64::MIN))
    );
    assert_eq!(
        ReconnectPolicy::from_config(None, Some(i64::MAX)),
        Err(ReconnectPolicyError::MaxAttemptsTooLarge(i64::MAX))
    );
}

#[test]
fn reconnect_policy_errors_name_the_config_key() {
    // CONTRACT: S2 — the binary reports the key at fault and exits 1 (S3).
    let max_attempts = ReconnectPolicy::from_config(None, Some(-2));
    assert_eq!(
        max_attempts.map_err(|e| (e.key(), e.to_string())),
        Err((
            "reconnect.max_attempts",
            "reconnect.max_attempts must be 0 (unlimited) or positive (got -2)".to_owned()
        ))
    );
    let interval = ReconnectPolicy::from_config(Some(-5), None);
    assert_eq!(
        interval.map_err(|e| (e.key(), e.to_string())),
        Err((
            "reconnect.interval_sec",
            "reconnect.interval_sec must not be negative (got -5)".to_owned()
        ))
    );
    assert_eq!(
        ReconnectPolicyError::MaxAttemptsTooLarge(1 << 40).key(),
        "reconnect.max_attempts"
    );
    assert_eq!(
        ReconnectPolicyError::UnlimitedNeedsInterval.key(),
        "reconnect.interval_sec"
    );
}

#[test]
fn allows_attempt_counts_exactly() {
    // CONTRACT: S2 — a positive `max_attempts` means exactly that many.
    for max_attempts in [1u32, 2, 3, 10] {
        let policy = ReconnectPolicy::from_config(Some(1), Some(i64::from(max_attempts)))
            .unwrap_or_else(|e| panic!("{e}"));
        let allowed = (0..=max_attempts + 5)
            .filter(|&made| policy.allows_attempt(made))
            .count();
        assert_eq!(allowed, max_attempts as usize);
        assert!(policy.allows_attempt(max_attempts - 1));
        assert!(!policy.allows_attempt(max_attempts));
        assert!(!policy.allows_attempt(u32::MAX));
    }
    let default = ReconnectPolicy::from_config(None, None).unwrap_or_else(|e| panic!("{e}"));
    assert!(default.allows_attempt(9));
    assert!(!default.allows_attempt(10));

    let unlimited = ReconnectPolicy::from_config(None, Some(0)).unwrap_or_else(|e| panic!("{e}"));
    for made in [0, 1, 10, 1_000_000, u32::MAX] {
        assert!(unlimited.allows_attempt(made));
    }
}
