//! At most one log line per key (a peer address) per interval, in bounded
//! memory: a flood of failing handshakes from one peer logs once, and a
//! flood from many peers logs each at most once per interval while the
//! table stays at its cap.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// Per-key log throttle; see the module docs.
#[derive(Debug)]
pub struct LogThrottle<K> {
    interval: Duration,
    max_keys: usize,
    /// When each key last logged, and the events suppressed since.
    last: HashMap<K, (Instant, u64)>,
    /// Events of keys that found the table full (logged with the next key
    /// that gets in).
    overflow_suppressed: u64,
}

impl<K: Eq + Hash> LogThrottle<K> {
    /// A throttle allowing one line per key per `interval`, remembering at
    /// most `max_keys` keys (at least one).
    pub fn new(interval: Duration, max_keys: usize) -> Self {
        Self {
            interval,
            max_keys: max_keys.max(1),
            last: HashMap::new(),
            overflow_suppressed: 0,
        }
    }

    /// An event for `key` at `now`. `Some(suppressed)`: log it, mentioning
    /// the `suppressed` events not logged since this key's last line (plus
    /// those of keys that found the table full). `None`: stay quiet.
    pub fn check(&mut self, key: K, now: Instant) -> Option<u64> {
        if let Some((at, suppressed)) = self.last.get_mut(&key) {
            if now.saturating_duration_since(*at) < self.interval {
                *suppressed += 1;
                return None;
            }
            let earlier =
                std::mem::take(suppressed) + std::mem::take(&mut self.overflow_suppressed);
            *at = now;
            return Some(earlier);
        }
        if self.last.len() >= self.max_keys {
            let interval = self.interval;
            self.last
                .retain(|_, (at, _)| now.saturating_duration_since(*at) < interval);
        }
        if self.last.len() >= self.max_keys {
            self.overflow_suppressed += 1;
            return None;
        }
        self.last.insert(key, (now, 0));
        Some(std::mem::take(&mut self.overflow_suppressed))
    }

    /// Keys remembered now.
    pub fn len(&self) -> usize {
        self.last.len()
    }

    /// True when no key is remembered.
    pub fn is_empty(&self) -> bool {
        self.last.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};

    #[test]
    fn one_line_per_key_per_interval_with_the_suppressed_count() {
        let clock = ManualClock::new(0);
        let mut throttle = LogThrottle::new(Duration::from_secs(60), 16);
        assert_eq!(throttle.check("a", clock.now()), Some(0));
        assert_eq!(throttle.check("a", clock.now()), None);
        assert_eq!(throttle.check("b", clock.now()), Some(0));
        clock.advance(Duration::from_secs(59));
        assert_eq!(throttle.check("a", clock.now()), None);
        clock.advance(Duration::from_secs(1));
        assert_eq!(throttle.check("a", clock.now()), Some(2));
        assert_eq!(throttle.check("a", clock.now()), None);
    }

    #[test]
    fn a_full_table_drops_stale_keys_and_counts_what_it_cannot_hold() {
        let clock = ManualClock::new(0);
        let mut throttle = LogThrottle::new(Duration::from_secs(10), 2);
        assert_eq!(throttle.check(1, clock.now()), Some(0));
        assert_eq!(throttle.check(2, clock.now()), Some(0));
        // Full of fresh keys: a third stays quiet and is counted.
        assert_eq!(throttle.check(3, clock.now()), None);
        assert_eq!(throttle.check(4, clock.now()), None);
        assert_eq!(throttle.len(), 2);
        clock.advance(Duration::from_secs(10));
        // Stale keys make room; the first key in reports the overflow.
        assert_eq!(throttle.check(3, clock.now()), Some(2));
        assert_eq!(throttle.len(), 1);
        assert_eq!(throttle.check(1, clock.now()), Some(0));
    }
}
