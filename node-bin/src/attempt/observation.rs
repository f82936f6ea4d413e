//! The session-owned health observation sequence (W7, H6).
//!
//! One [`ObservationSeq`] per transport session (connection): the first
//! finalized observation gets 1, every later one the next integer. Stall
//! terminals of normalized runs and tunnels and CAPABILITIES answers all draw
//! from the same source, so concurrent observations get unique, strictly
//! increasing values. The Node runs every task of a session on one thread, so
//! a `Cell` is the whole synchronization. An unbound source (no transport
//! session behind the observation) hands out nothing: the key is omitted.

use std::cell::Cell;

/// A connection-scoped observation sequence.
#[derive(Debug)]
pub struct ObservationSeq {
    bound: bool,
    last: Cell<u64>,
}

impl ObservationSeq {
    /// The sequence of a transport session: 1, 2, 3, …
    pub fn bound() -> Self {
        Self {
            bound: true,
            last: Cell::new(0),
        }
    }

    /// A source with no session behind it: always `None` (W7).
    pub fn unbound() -> Self {
        Self {
            bound: false,
            last: Cell::new(0),
        }
    }

    /// Whether observations carry a sequence.
    pub fn is_bound(&self) -> bool {
        self.bound
    }

    /// The sequence value of the observation being finalized now; `None`
    /// when unbound. Saturates at `u64::MAX` (never wraps to a smaller
    /// value).
    pub fn next(&self) -> Option<u64> {
        if !self.bound {
            return None;
        }
        let value = self.last.get().saturating_add(1);
        self.last.set(value);
        Some(value)
    }

    /// The last value handed out (0 before the first).
    pub fn last(&self) -> u64 {
        self.last.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // CONTRACT: W7 — starts at 1 per connection; an unbound session omits it.
    #[test]
    fn starts_at_one_per_session_and_unbound_omits() {
        let first = ObservationSeq::bound();
        assert_eq!(first.next(), Some(1));
        assert_eq!(first.next(), Some(2));
        let reconnected = ObservationSeq::bound();
        assert_eq!(reconnected.next(), Some(1));
        let unbound = ObservationSeq::unbound();
        assert_eq!(unbound.next(), None);
        assert_eq!(unbound.next(), None);
        assert_eq!(unbound.last(), 0);
    }
}
