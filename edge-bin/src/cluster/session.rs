//! The Edge's one etcd lease, as a sans-IO state machine with time passed
//! in.
//!
//! The shell grants a lease, keeps it alive every `keepalive_interval`,
//! and asks [`LeaseSession::poll`] whether it may still act as the owner
//! of what it attached to the lease. The **fence deadline** is
//!
//! ```text
//! deadline = sent_at(last acknowledged keep-alive, or the grant) + TTL − keepalive_interval
//! ```
//!
//! measured on the local clock from when the *request* was sent: etcd
//! extended the lease at some point after that, so the lease cannot expire
//! on the server before `sent_at + TTL`, and fencing one interval earlier
//! leaves the shell a whole interval to close what it owns before anyone
//! else can claim it.
//!
//! ```text
//!            grant_answered                      poll(now ≥ deadline),
//! NotGranted ──────────────► Up{lease, deadline} ─ keepalive_lease_gone, ──► Lost{reason}
//!     ▲                         │  ▲  keepalive_acked:                release
//!     │                         └──┘  deadline = max(deadline,            │
//!     │                               sent_at + TTL − interval)           │
//!     └─────────────── (none: Lost stays Lost) ◄──── grant_answered ◄─────┘ (back to Up)
//! ```
//!
//! Lost is sticky: a keep-alive answered after the deadline passed does
//! not bring the session back; only a new grant does. Tokens carry the
//! grant's epoch, so an answer about an older lease is ignored.

use std::time::{Duration, Instant};

use crate::cluster::etcd::LeaseId;

/// A lease configuration the session refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    /// The keep-alive interval is zero.
    #[error("keep-alive interval must be above zero")]
    IntervalZero,
    /// The TTL does not leave room for one keep-alive before the lease
    /// would have to be fenced.
    #[error(
        "lease TTL {ttl_ms} ms must be above the keep-alive interval {interval_ms} ms \
         (the session fences at TTL − interval after the last acknowledged keep-alive)"
    )]
    TtlNotAboveInterval {
        /// The TTL asked for or granted, in milliseconds.
        ttl_ms: u128,
        /// The keep-alive interval, in milliseconds.
        interval_ms: u128,
    },
    /// The answer is to a grant request older than the latest one sent:
    /// the shell should revoke that lease.
    #[error("grant answer for lease {lease} is stale: a newer grant was sent")]
    StaleGrant {
        /// The lease granted by the stale request.
        lease: LeaseId,
    },
}

/// Why the session lost its lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LostReason {
    /// No keep-alive was acknowledged in time: the fence deadline passed.
    DeadlinePassed {
        /// The deadline that passed.
        deadline: Instant,
    },
    /// etcd said the lease no longer exists.
    LeaseGone,
    /// The shell gave the lease up ([`LeaseSession::release`]).
    Released,
}

/// What the session says at a given instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// No lease was granted yet.
    NotGranted,
    /// The lease is held: the shell may act as owner until `deadline`.
    Up {
        /// The lease.
        lease: LeaseId,
        /// The fence deadline.
        deadline: Instant,
    },
    /// The lease is lost: fence everything attached to it. Stays so until
    /// a new grant.
    Lost {
        /// The lease that was lost.
        lease: LeaseId,
        /// Why.
        reason: LostReason,
    },
}

/// Proof of one grant request, handed back with its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantToken {
    epoch: u64,
    sent_at: Instant,
}

/// Proof of one keep-alive request, handed back with its outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeepAliveToken {
    epoch: u64,
    lease: LeaseId,
    sent_at: Instant,
}

impl KeepAliveToken {
    /// The lease to keep alive.
    pub fn lease(&self) -> LeaseId {
        self.lease
    }
}

#[derive(Debug, Clone, Copy)]
enum State {
    NotGranted,
    Up {
        lease: LeaseId,
        deadline: Instant,
        next_keepalive_at: Instant,
    },
    Lost {
        lease: LeaseId,
        reason: LostReason,
    },
}

/// The lease session; see the module docs.
#[derive(Debug, Clone)]
pub struct LeaseSession {
    ttl: Duration,
    keepalive_interval: Duration,
    /// Grants sent so far; the current lease belongs to this epoch.
    epoch: u64,
    state: State,
}

impl LeaseSession {
    /// A session that asks for leases of `ttl` and keeps them alive every
    /// `keepalive_interval`, which must be above zero and below `ttl`.
    pub fn new(ttl: Duration, keepalive_interval: Duration) -> Result<Self, SessionError> {
        check(ttl, keepalive_interval)?;
        Ok(LeaseSession {
            ttl,
            keepalive_interval,
            epoch: 0,
            state: State::NotGranted,
        })
    }

    /// The TTL to ask for, in whole seconds (rounded up), as etcd takes it.
    pub fn ttl_sec(&self) -> i64 {
        i64::try_from(self.ttl.as_millis().div_ceil(1000)).unwrap_or(i64::MAX)
    }

    /// The keep-alive interval.
    pub fn keepalive_interval(&self) -> Duration {
        self.keepalive_interval
    }

    /// Call when a grant request goes out, at `now`. Any earlier grant
    /// still unanswered becomes stale.
    pub fn grant_sent(&mut self, now: Instant) -> GrantToken {
        self.epoch += 1;
        GrantToken {
            epoch: self.epoch,
            sent_at: now,
        }
    }

    /// Call with the answer to the grant `token` stands for: the lease and
    /// the TTL etcd granted. On success the session is up with deadline
    /// `sent_at + ttl − interval` and the first keep-alive due one
    /// interval after the grant was sent. A TTL not above the interval,
    /// or a stale token, is refused and leaves the session as it was.
    pub fn grant_answered(
        &mut self,
        token: GrantToken,
        lease: LeaseId,
        ttl: Duration,
    ) -> Result<(), SessionError> {
        if token.epoch != self.epoch {
            return Err(SessionError::StaleGrant { lease });
        }
        check(ttl, self.keepalive_interval)?;
        self.state = State::Up {
            lease,
            deadline: token.sent_at + (ttl - self.keepalive_interval),
            next_keepalive_at: token.sent_at + self.keepalive_interval,
        };
        Ok(())
    }

    /// When the next keep-alive is due (`None` unless up). Keep-alives go
    /// out one interval apart, counted from the last one sent, whatever
    /// their outcome.
    pub fn next_keepalive_at(&self) -> Option<Instant> {
        match self.state {
            State::Up {
                next_keepalive_at, ..
            } => Some(next_keepalive_at),
            _ => None,
        }
    }

    /// The next instant the shell must call back: the next keep-alive or
    /// the deadline, whichever is sooner (`None` unless up).
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            State::Up {
                deadline,
                next_keepalive_at,
                ..
            } => Some(deadline.min(next_keepalive_at)),
            _ => None,
        }
    }

    /// Call when a keep-alive request goes out, at `now`: the token to
    /// hand back with its outcome. `None` (send nothing) unless up; the
    /// deadline is checked first.
    pub fn keepalive_sent(&mut self, now: Instant) -> Option<KeepAliveToken> {
        self.poll(now);
        let State::Up {
            lease,
            ref mut next_keepalive_at,
            ..
        } = self.state
        else {
            return None;
        };
        *next_keepalive_at = now + self.keepalive_interval;
        Some(KeepAliveToken {
            epoch: self.epoch,
            lease,
            sent_at: now,
        })
    }

    /// Call when etcd acknowledged the keep-alive `token` stands for with
    /// `ttl` left, at `now`. Moves the deadline to `sent_at + ttl −
    /// interval` if that is later; does nothing once the deadline has
    /// passed (checked at `now` first) or for another lease's token.
    pub fn keepalive_acked(&mut self, token: KeepAliveToken, ttl: Duration, now: Instant) {
        self.poll(now);
        if !self.is_current(token) {
            return;
        }
        if let State::Up {
            ref mut deadline, ..
        } = self.state
        {
            let extended = token.sent_at + ttl.saturating_sub(self.keepalive_interval);
            *deadline = (*deadline).max(extended);
        }
    }

    /// Call when etcd answered the keep-alive `token` stands for with "no
    /// such lease": the session is lost (if the token is about the
    /// current lease).
    pub fn keepalive_lease_gone(&mut self, token: KeepAliveToken, now: Instant) {
        self.poll(now);
        if self.is_current(token) {
            self.state = State::Lost {
                lease: token.lease,
                reason: LostReason::LeaseGone,
            };
        }
    }

    /// Call when the keep-alive `token` stands for got no answer (every
    /// endpoint failed or timed out). The deadline does not move; the next
    /// keep-alive stays due one interval after this one was sent.
    pub fn keepalive_failed(&mut self, token: KeepAliveToken, now: Instant) {
        let _ = token;
        self.poll(now);
    }

    /// Call when the shell gives the lease up (revokes it): the session is
    /// lost with [`LostReason::Released`].
    pub fn release(&mut self) {
        if let State::Up { lease, .. } = self.state {
            self.state = State::Lost {
                lease,
                reason: LostReason::Released,
            };
        }
    }

    /// Where the session stands at `now`. Up turns into Lost once `now`
    /// reaches the deadline, for good (until a new grant).
    pub fn poll(&mut self, now: Instant) -> Status {
        if let State::Up {
            lease, deadline, ..
        } = self.state
        {
            if now >= deadline {
                self.state = State::Lost {
                    lease,
                    reason: LostReason::DeadlinePassed { deadline },
                };
            }
        }
        match self.state {
            State::NotGranted => Status::NotGranted,
            State::Up {
                lease, deadline, ..
            } => Status::Up { lease, deadline },
            State::Lost { lease, reason } => Status::Lost { lease, reason },
        }
    }

    fn is_current(&self, token: KeepAliveToken) -> bool {
        token.epoch == self.epoch
            && matches!(self.state, State::Up { lease, .. } if lease == token.lease)
    }
}

fn check(ttl: Duration, keepalive_interval: Duration) -> Result<(), SessionError> {
    if keepalive_interval.is_zero() {
        return Err(SessionError::IntervalZero);
    }
    if ttl <= keepalive_interval {
        return Err(SessionError::TtlNotAboveInterval {
            ttl_ms: ttl.as_millis(),
            interval_ms: keepalive_interval.as_millis(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(10);
    const INTERVAL: Duration = Duration::from_secs(3);
    const LEASE: LeaseId = LeaseId(77);

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// A session granted at `t0` (request sent then, answered at once).
    fn granted(t0: Instant) -> LeaseSession {
        let mut session = LeaseSession::new(TTL, INTERVAL).unwrap();
        let token = session.grant_sent(t0);
        session.grant_answered(token, LEASE, TTL).unwrap();
        session
    }

    #[test]
    fn interval_must_be_below_ttl() {
        assert_eq!(
            LeaseSession::new(secs(3), secs(3)).unwrap_err(),
            SessionError::TtlNotAboveInterval {
                ttl_ms: 3000,
                interval_ms: 3000
            }
        );
        assert_eq!(
            LeaseSession::new(secs(3), secs(3)).unwrap_err().to_string(),
            "lease TTL 3000 ms must be above the keep-alive interval 3000 ms \
             (the session fences at TTL − interval after the last acknowledged keep-alive)"
        );
        assert_eq!(
            LeaseSession::new(secs(3), Duration::ZERO).unwrap_err(),
            SessionError::IntervalZero
        );
        // A granted TTL at or below the interval is refused too.
        let t0 = iop_engine::clock::now();
        let mut session = LeaseSession::new(TTL, INTERVAL).unwrap();
        let token = session.grant_sent(t0);
        assert_eq!(
            session.grant_answered(token, LEASE, secs(2)),
            Err(SessionError::TtlNotAboveInterval {
                ttl_ms: 2000,
                interval_ms: 3000
            })
        );
        assert_eq!(session.poll(t0), Status::NotGranted);
        assert_eq!(
            LeaseSession::new(Duration::from_millis(2500), INTERVAL).map(|s| s.ttl_sec()),
            Err(SessionError::TtlNotAboveInterval {
                ttl_ms: 2500,
                interval_ms: 3000
            })
        );
        assert_eq!(
            LeaseSession::new(Duration::from_millis(9500), INTERVAL)
                .unwrap()
                .ttl_sec(),
            10
        );
    }

    #[test]
    fn grant_sets_deadline_from_the_send_time() {
        let t0 = iop_engine::clock::now();
        let mut session = LeaseSession::new(TTL, INTERVAL).unwrap();
        assert_eq!(session.poll(t0), Status::NotGranted);
        assert_eq!(session.keepalive_sent(t0), None);
        let token = session.grant_sent(t0);
        // Answered 2 s later: the deadline still counts from the send.
        session.grant_answered(token, LEASE, TTL).unwrap();
        assert_eq!(
            session.poll(t0 + secs(2)),
            Status::Up {
                lease: LEASE,
                deadline: t0 + secs(7)
            }
        );
        assert_eq!(session.next_keepalive_at(), Some(t0 + secs(3)));
        assert_eq!(session.poll_timeout(), Some(t0 + secs(3)));
    }

    #[test]
    fn acked_keepalive_moves_the_deadline() {
        let t0 = iop_engine::clock::now();
        let mut session = granted(t0);
        let token = session.keepalive_sent(t0 + secs(3)).unwrap();
        assert_eq!(token.lease(), LEASE);
        assert_eq!(session.next_keepalive_at(), Some(t0 + secs(6)));
        session.keepalive_acked(token, TTL, t0 + secs(4));
        assert_eq!(
            session.poll(t0 + secs(9)),
            Status::Up {
                lease: LEASE,
                deadline: t0 + secs(10)
            }
        );
        assert!(matches!(
            session.poll(t0 + secs(10)),
            Status::Lost {
                reason: LostReason::DeadlinePassed { .. },
                ..
            }
        ));
    }

    #[test]
    fn an_older_ack_answered_late_does_not_move_the_deadline_back() {
        let t0 = iop_engine::clock::now();
        let mut session = granted(t0);
        let first = session.keepalive_sent(t0 + secs(3)).unwrap();
        let second = session.keepalive_sent(t0 + secs(6)).unwrap();
        session.keepalive_acked(second, TTL, t0 + secs(6));
        session.keepalive_acked(first, TTL, t0 + secs(6));
        assert_eq!(
            session.poll(t0 + secs(6)),
            Status::Up {
                lease: LEASE,
                deadline: t0 + secs(13)
            }
        );
    }

    #[test]
    fn failed_keepalive_does_not_move_the_deadline() {
        let t0 = iop_engine::clock::now();
        let mut session = granted(t0);
        let token = session.keepalive_sent(t0 + secs(3)).unwrap();
        session.keepalive_failed(token, t0 + secs(4));
        assert_eq!(
            session.poll(t0 + secs(4)),
            Status::Up {
                lease: LEASE,
                deadline: t0 + secs(7)
            }
        );
        assert_eq!(session.next_keepalive_at(), Some(t0 + secs(6)));
        assert_eq!(
            session.poll(t0 + secs(7)),
            Status::Lost {
                lease: LEASE,
                reason: LostReason::DeadlinePassed {
                    deadline: t0 + secs(7)
                }
            }
        );
        assert_eq!(session.next_keepalive_at(), None);
        assert_eq!(session.poll_timeout(), None);
    }

    #[test]
    fn late_ack_after_the_deadline_does_not_resurrect() {
        let t0 = iop_engine::clock::now();
        let mut session = granted(t0);
        // Sent in time, acknowledged after the deadline (t0 + 7 s), with
        // no poll in between: still lost.
        let token = session.keepalive_sent(t0 + secs(6)).unwrap();
        session.keepalive_acked(token, TTL, t0 + secs(8));
        assert_eq!(
            session.poll(t0 + secs(8)),
            Status::Lost {
                lease: LEASE,
                reason: LostReason::DeadlinePassed {
                    deadline: t0 + secs(7)
                }
            }
        );
        assert_eq!(session.keepalive_sent(t0 + secs(9)), None);
    }

    #[test]
    fn lease_gone_is_lost_and_a_new_grant_is_up_again() {
        let t0 = iop_engine::clock::now();
        let mut session = granted(t0);
        let token = session.keepalive_sent(t0 + secs(3)).unwrap();
        session.keepalive_lease_gone(token, t0 + secs(3));
        let lost = Status::Lost {
            lease: LEASE,
            reason: LostReason::LeaseGone,
        };
        assert_eq!(session.poll(t0 + secs(3)), lost);
        // An ack of the same keep-alive arriving afterwards changes nothing.
        session.keepalive_acked(token, TTL, t0 + secs(3));
        assert_eq!(session.poll(t0 + secs(3)), lost);

        let grant = session.grant_sent(t0 + secs(4));
        session.grant_answered(grant, LeaseId(78), TTL).unwrap();
        assert_eq!(
            session.poll(t0 + secs(4)),
            Status::Up {
                lease: LeaseId(78),
                deadline: t0 + secs(11)
            }
        );
        // A keep-alive token of the old lease is ignored by the new one.
        session.keepalive_lease_gone(token, t0 + secs(5));
        assert!(matches!(session.poll(t0 + secs(5)), Status::Up { .. }));
    }

    #[test]
    fn stale_grant_answer_is_refused() {
        let t0 = iop_engine::clock::now();
        let mut session = LeaseSession::new(TTL, INTERVAL).unwrap();
        let first = session.grant_sent(t0);
        let second = session.grant_sent(t0 + secs(1));
        assert_eq!(
            session.grant_answered(first, LeaseId(1), TTL),
            Err(SessionError::StaleGrant { lease: LeaseId(1) })
        );
        assert_eq!(session.poll(t0 + secs(1)), Status::NotGranted);
        session.grant_answered(second, LeaseId(2), TTL).unwrap();
        assert_eq!(
            session.poll(t0 + secs(1)),
            Status::Up {
                lease: LeaseId(2),
                deadline: t0 + secs(8)
            }
        );
    }

    #[test]
    fn release_is_lost() {
        let t0 = iop_engine::clock::now();
        let mut session = granted(t0);
        session.release();
        assert_eq!(
            session.poll(t0),
            Status::Lost {
                lease: LEASE,
                reason: LostReason::Released
            }
        );
    }
}
