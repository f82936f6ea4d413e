//! A per-connection deadline: arm, re-arm and disarm are writes to a cell;
//! one watchdog task per connection sleeps until the deadline, re-checks it
//! on waking, and on expiry shuts the socket down from outside and records
//! why.
//!
//! Why from outside: a TLS read must never be cancelled (monoio-rustls loses
//! its buffer and the next read panics), and a dropped io_uring read can lose
//! bytes. `shutdown(2)` makes the pending read return (EOF) or the pending
//! write fail (`EPIPE`) on its own, so the reader and writer are never
//! cancelled and simply see the end of the stream.
//!
//! Cost: moving the deadline later (the common case: a read or a write made
//! progress) is a cell write and one clock read, no timer operation. The
//! watchdog wakes at the old deadline, sees the new one and sleeps again.
//! Only moving it *earlier* than the watchdog's current sleep (or arming a
//! disarmed deadline) wakes the watchdog to re-arm its sleep.
//!
//! # Use
//!
//! Reads (a request head, a body, a keep-alive wait):
//!
//! ```text
//! deadline.arm(Wait::Head, head_timeout);     // the whole head
//! loop { read … }                             // EOF? deadline.expired() == Some(Wait::Head)
//! deadline.arm(Wait::Body, body_idle);        // re-arm after each read: an idle timeout
//! deadline.disarm();
//! ```
//!
//! A write-stall cut-off (a peer that accepts no bytes for N ms while a
//! response is written) uses the same calls:
//!
//! ```text
//! deadline.arm(Wait::Write, stall);     // before a write that may block
//! write … (each partial write) ─► deadline.arm(Wait::Write, stall)   // progress pushes it
//! deadline.disarm();                    // the response is written
//! // a failed write with deadline.expired() == Some(Wait::Write): the peer stalled
//! ```
//!
//! On expiry the read-side waits ([`Wait::shuts_down_reads_only`]) shut down
//! only the read side, so the connection can still carry a short answer
//! (408) or a lingering close; [`Wait::Handshake`] and [`Wait::Write`] shut
//! down both directions; a write stall also sets `SO_LINGER` to zero, so
//! the close that follows resets the connection and frees the bytes the
//! peer never took.

use std::cell::{Cell, RefCell};
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::time::{Duration, Instant};

use nix::sys::socket::Shutdown;

use crate::clock;
use crate::sync::Notify;

/// What a connection waits for while its deadline is armed; on expiry,
/// what it was waiting for when it was cut off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Wait {
    /// A TLS handshake to complete.
    Handshake,
    /// The first byte of the next request on a kept-alive connection.
    Idle,
    /// The rest of a request head (the whole head has one deadline).
    Head,
    /// More bytes of a request body (re-armed after each read: an idle
    /// timeout).
    Body,
    /// The peer to accept more bytes of a response (a write stall).
    Write,
    /// The peer to finish sending after an early answer (lingering close).
    Linger,
}

impl Wait {
    /// A short name for logs and metric descriptions.
    pub fn name(self) -> &'static str {
        match self {
            Wait::Handshake => "handshake",
            Wait::Idle => "idle",
            Wait::Head => "head",
            Wait::Body => "body",
            Wait::Write => "write",
            Wait::Linger => "linger",
        }
    }

    /// Whether expiry shuts down only the read side (`SHUT_RD`: the pending
    /// read returns EOF, the connection can still write an answer) rather
    /// than both (`SHUT_RDWR`).
    pub fn shuts_down_reads_only(self) -> bool {
        matches!(self, Wait::Idle | Wait::Head | Wait::Body | Wait::Linger)
    }

    fn shutdown_how(self) -> Shutdown {
        if self.shuts_down_reads_only() {
            Shutdown::Read
        } else {
            Shutdown::Both
        }
    }
}

/// What the watchdog does next ([`DeadlineCore::poll`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadlineStep {
    /// The deadline passed: cut the connection off (then poll again).
    Expire(Wait),
    /// Sleep until this instant (or an earlier wake), then poll again.
    SleepUntil(Instant),
    /// Nothing is armed: wait for a wake, then poll again.
    Idle,
}

/// The deadline's decisions, without a clock or a socket.
///
/// The shell calls [`DeadlineCore::arm`] / [`DeadlineCore::disarm`] from the
/// connection's code and [`DeadlineCore::poll`] from the watchdog each time
/// it wakes.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DeadlineCore {
    armed: Option<(Wait, Instant)>,
    /// What the watchdog sleeps until; `None`: it waits for a wake.
    sleeping_until: Option<Instant>,
    expired: Option<Wait>,
}

impl DeadlineCore {
    /// Arms (or re-arms) the deadline at `at` for `wait`. Returns whether
    /// the watchdog must be woken to re-arm its sleep: only when it sleeps
    /// past `at` or waits with nothing armed.
    pub fn arm(&mut self, wait: Wait, at: Instant) -> bool {
        self.armed = Some((wait, at));
        self.sleeping_until.is_none_or(|sleep| at < sleep)
    }

    /// Disarms the deadline. The watchdog is not woken: it finds nothing
    /// armed at its next wake.
    pub fn disarm(&mut self) {
        self.armed = None;
    }

    /// What is armed, if anything.
    pub fn armed(&self) -> Option<(Wait, Instant)> {
        self.armed
    }

    /// The wait of the last expiry, if the deadline ever expired.
    pub fn expired(&self) -> Option<Wait> {
        self.expired
    }

    /// The watchdog woke at `now` (its sleep ended or it was woken): what
    /// to do next. An expiry disarms the deadline and is recorded.
    pub fn poll(&mut self, now: Instant) -> DeadlineStep {
        match self.armed {
            Some((wait, at)) if at <= now => {
                self.armed = None;
                self.sleeping_until = None;
                self.expired = Some(wait);
                DeadlineStep::Expire(wait)
            }
            Some((_, at)) => {
                self.sleeping_until = Some(at);
                DeadlineStep::SleepUntil(at)
            }
            None => {
                self.sleeping_until = None;
                DeadlineStep::Idle
            }
        }
    }
}

struct Shared {
    core: RefCell<DeadlineCore>,
    wake: Notify,
    /// The socket to shut down; `None` once the handle is dropped.
    fd: Cell<Option<RawFd>>,
}

/// A connection's deadline; see the module docs. Dropping it stops its
/// watchdog.
///
/// The watchdog shuts down the descriptor it was given; drop the
/// `Deadline` before (or in the same synchronous step as) the stream that
/// owns the descriptor, so a number reused by another socket is never shut
/// down. Keeping it in the same struct as the stream, declared before it,
/// does that.
pub struct Deadline {
    shared: Rc<Shared>,
}

impl std::fmt::Debug for Deadline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deadline")
            .field("core", &self.shared.core.borrow())
            .field("fd", &self.shared.fd.get())
            .finish()
    }
}

impl Deadline {
    /// A disarmed deadline for `socket` (a `TcpStream`: take it before
    /// wrapping the stream in TLS), with its watchdog task spawned on the
    /// current monoio runtime, which must have its timer enabled.
    pub fn spawn(socket: &impl AsRawFd) -> Self {
        let shared = Rc::new(Shared {
            core: RefCell::new(DeadlineCore::default()),
            wake: Notify::default(),
            fd: Cell::new(Some(socket.as_raw_fd())),
        });
        monoio::spawn(watchdog(shared.clone()));
        Self { shared }
    }

    /// Arms (or re-arms) the deadline `timeout` from now for `wait`.
    pub fn arm(&self, wait: Wait, timeout: Duration) {
        self.arm_at(wait, clock::now() + timeout);
    }

    /// Arms (or re-arms) the deadline at `at` for `wait`.
    pub fn arm_at(&self, wait: Wait, at: Instant) {
        if self.shared.core.borrow_mut().arm(wait, at) {
            self.shared.wake.notify();
        }
    }

    /// Disarms the deadline (a cell write; the watchdog is not woken).
    pub fn disarm(&self) {
        self.shared.core.borrow_mut().disarm();
    }

    /// What is armed: the wait and its deadline.
    pub fn armed(&self) -> Option<(Wait, Instant)> {
        self.shared.core.borrow().armed()
    }

    /// The wait of the last expiry: why the socket was shut down, if it
    /// was.
    pub fn expired(&self) -> Option<Wait> {
        self.shared.core.borrow().expired()
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        self.shared.fd.set(None);
        self.shared.wake.notify();
    }
}

/// Sleeps until the armed deadline, re-checking on every wake; on expiry
/// shuts the socket down. Ends when the [`Deadline`] is dropped.
async fn watchdog(shared: Rc<Shared>) {
    loop {
        let Some(fd) = shared.fd.get() else { return };
        let step = shared.core.borrow_mut().poll(clock::now());
        match step {
            DeadlineStep::Expire(wait) => {
                if wait == Wait::Write {
                    reset_on_close(fd);
                }
                if let Err(err) = nix::sys::socket::shutdown(fd, wait.shutdown_how()) {
                    // ENOTCONN: the peer already closed or reset.
                    tracing::debug!(fd, error = %err, "deadline shutdown");
                }
            }
            DeadlineStep::SleepUntil(at) => {
                let sleep = monoio::time::sleep_until(monoio::time::Instant::from_std(at));
                monoio::select! {
                    _ = sleep => {}
                    _ = shared.wake.notified() => {}
                }
            }
            DeadlineStep::Idle => shared.wake.notified().await,
        }
    }
}

/// Sets `SO_LINGER` to zero seconds: closing the socket then resets the
/// connection and frees the unsent bytes at once. A peer that stopped
/// reading would otherwise keep them queued in the kernel (`FIN_WAIT1`)
/// until the retransmission timers give up.
fn reset_on_close(fd: RawFd) {
    // SAFETY: `fd` comes from `Shared::fd`, which is `Some` only while the
    // `Deadline` lives, and the `Deadline` is dropped before (or together
    // with) the stream that owns the descriptor (see its docs), so the
    // descriptor is open for the duration of this call.
    let socket = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    if let Err(err) =
        nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::Linger, &linger)
    {
        tracing::debug!(fd, error = %err, "deadline linger");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};

    #[test]
    fn pushing_the_deadline_later_needs_no_wake() {
        let clock = ManualClock::new(0);
        let t0 = clock.now();
        let mut core = DeadlineCore::default();
        // Nothing armed yet: the watchdog waits for a wake.
        assert_eq!(core.poll(t0), DeadlineStep::Idle);
        assert!(core.arm(Wait::Body, t0 + Duration::from_secs(5)));
        assert_eq!(
            core.poll(t0),
            DeadlineStep::SleepUntil(t0 + Duration::from_secs(5))
        );
        // Progress: later deadlines are cell writes only.
        for s in 6..100 {
            assert!(!core.arm(Wait::Body, t0 + Duration::from_secs(s)));
        }
        // The watchdog wakes at the old deadline and sleeps again.
        clock.advance(Duration::from_secs(5));
        assert_eq!(
            core.poll(clock.now()),
            DeadlineStep::SleepUntil(t0 + Duration::from_secs(99))
        );
        assert_eq!(core.expired(), None);
    }

    #[test]
    fn an_earlier_deadline_or_arming_from_idle_wakes_the_watchdog() {
        let clock = ManualClock::new(0);
        let t0 = clock.now();
        let mut core = DeadlineCore::default();
        assert!(core.arm(Wait::Idle, t0 + Duration::from_secs(30)));
        core.poll(t0);
        // The head deadline is earlier than the keep-alive one.
        assert!(core.arm(Wait::Head, t0 + Duration::from_secs(10)));
        assert_eq!(
            core.poll(t0),
            DeadlineStep::SleepUntil(t0 + Duration::from_secs(10))
        );
        core.disarm();
        // Disarmed: the watchdog finds nothing at its next wake and idles.
        assert_eq!(core.poll(t0 + Duration::from_secs(10)), DeadlineStep::Idle);
        assert!(core.arm(Wait::Body, t0 + Duration::from_secs(40)));
    }

    #[test]
    fn expiry_disarms_and_is_recorded_until_the_next_expiry() {
        let clock = ManualClock::new(0);
        let t0 = clock.now();
        let mut core = DeadlineCore::default();
        core.arm(Wait::Head, t0 + Duration::from_millis(10));
        assert_eq!(
            core.poll(t0 + Duration::from_millis(9)),
            DeadlineStep::SleepUntil(t0 + Duration::from_millis(10))
        );
        assert_eq!(
            core.poll(t0 + Duration::from_millis(10)),
            DeadlineStep::Expire(Wait::Head)
        );
        assert_eq!(core.armed(), None);
        assert_eq!(core.expired(), Some(Wait::Head));
        assert_eq!(
            core.poll(t0 + Duration::from_millis(11)),
            DeadlineStep::Idle
        );
        // Re-arming after an expiry keeps the record until another expiry.
        assert!(core.arm(Wait::Write, t0 + Duration::from_millis(20)));
        assert_eq!(core.expired(), Some(Wait::Head));
        assert_eq!(
            core.poll(t0 + Duration::from_millis(25)),
            DeadlineStep::Expire(Wait::Write)
        );
        assert_eq!(core.expired(), Some(Wait::Write));
    }

    #[test]
    fn read_waits_shut_down_reads_only() {
        let reads_only: Vec<Wait> = [
            Wait::Handshake,
            Wait::Idle,
            Wait::Head,
            Wait::Body,
            Wait::Write,
            Wait::Linger,
        ]
        .into_iter()
        .filter(|w| w.shuts_down_reads_only())
        .collect();
        assert_eq!(
            reads_only,
            [Wait::Idle, Wait::Head, Wait::Body, Wait::Linger]
        );
    }
}
