//! A per-connection deadline: arm, re-arm and disarm are writes to a cell;
//! one timing wheel per runtime ([`Deadlines`]) holds at most one entry per
//! connection, and its tick task, on an entry's expiry, re-checks the
//! deadline and shuts the socket down from outside and records why.
//!
//! Why from outside: a TLS read must never be cancelled (monoio-rustls loses
//! its buffer and the next read panics), and a dropped io_uring read can lose
//! bytes. `shutdown(2)` makes the pending read return (EOF) or the pending
//! write fail (`EPIPE`) on its own, so the reader and writer are never
//! cancelled and simply see the end of the stream.
//!
//! Cost: moving the deadline later (the common case: a read or a write made
//! progress) is a cell write and one clock read, no timer operation. The
//! entry comes due at the old deadline, the tick task sees the new one and
//! inserts a new entry. Only moving it *earlier* than its entry (or arming a
//! disarmed deadline) moves the entry at once. A connection holds an `Rc`
//! of ~100 bytes and a wheel slot, not a task with a timer of its own.
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
use std::rc::{Rc, Weak};
use std::time::{Duration, Instant};

use nix::sys::socket::Shutdown;

use crate::clock;
use crate::wheel::{TickLength, TimerHandle, WheelDriver};

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

/// What the timer does next ([`DeadlineCore::poll`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadlineStep {
    /// The deadline passed: cut the connection off.
    Expire(Wait),
    /// Set the timer to this instant, then poll again when it fires.
    SleepUntil(Instant),
    /// Nothing is armed: leave the timer unset until the next arm.
    Idle,
}

/// The deadline's decisions, without a clock or a socket.
///
/// The shell calls [`DeadlineCore::arm`] / [`DeadlineCore::disarm`] from the
/// connection's code and [`DeadlineCore::poll`] each time the deadline's
/// timer (its wheel entry) fires.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DeadlineCore {
    armed: Option<(Wait, Instant)>,
    /// When the timer fires; `None`: it is not set.
    sleeping_until: Option<Instant>,
    expired: Option<Wait>,
}

impl DeadlineCore {
    /// Arms (or re-arms) the deadline at `at` for `wait`. Returns whether
    /// the shell must move its timer to `at`: only when the timer is set
    /// past `at` or not set at all. Otherwise the timer fires first and
    /// [`poll`](Self::poll) sets it again.
    pub fn arm(&mut self, wait: Wait, at: Instant) -> bool {
        self.armed = Some((wait, at));
        let moves = self.sleeping_until.is_none_or(|sleep| at < sleep);
        if moves {
            self.sleeping_until = Some(at);
        }
        moves
    }

    /// Disarms the deadline. The timer is left set: it finds nothing armed
    /// when it fires.
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

    /// Expires the deadline at `now` if what is armed is `wait` (a registry
    /// reclaiming an idle connection); true when it did. Recorded like any
    /// expiry.
    pub fn expire_if(&mut self, wait: Wait, now: Instant) -> bool {
        match self.armed {
            Some((armed, _)) if armed == wait => {
                self.armed = Some((wait, now));
                self.poll(now) == DeadlineStep::Expire(wait)
            }
            _ => false,
        }
    }

    /// The timer fired at `now`: what to do next. An expiry disarms the
    /// deadline and is recorded.
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

/// Length of one tick of a [`Deadlines`] wheel. Deadlines round up to whole
/// ticks, so a cut-off comes at most this much late and never early.
pub const DEADLINE_TICK: Duration = Duration::from_millis(1);

/// The deadlines of one runtime's connections: one timing wheel
/// ([`crate::wheel`]) and one tick task for all of them, so a connection's
/// deadline costs a wheel entry rather than a task with a timer of its own.
///
/// ```text
///  Deadline::arm ──(only when earlier than its entry)──► WheelDriver<Weak<Shared>> ◄── tick task
///                                                                   │ sleeps until next_deadline
///  expiry: DeadlineCore::poll ─► shutdown(2) ◄── fire_due ──────────┘ (or an earlier insert)
/// ```
///
/// Create one per runtime (it is `!Send`) and make each connection's
/// [`Deadline`] with [`Deadlines::watch`]; the tick task is spawned on the
/// current runtime, which must have its timer enabled, with the first
/// deadline and runs until that runtime stops.
pub struct Deadlines {
    wheel: WheelDriver<Weak<Shared>>,
    started: Cell<bool>,
}

impl std::fmt::Debug for Deadlines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deadlines")
            .field("wheel", &self.wheel)
            .field("started", &self.started.get())
            .finish()
    }
}

impl Deadlines {
    /// A service with no deadlines; its tick task starts with the first
    /// [`watch`](Self::watch).
    pub fn new() -> Rc<Self> {
        #[allow(clippy::expect_used)] // a non-zero constant, not input
        let tick =
            TickLength::new(DEADLINE_TICK).expect("DEADLINE_TICK is a valid non-zero tick length");
        Rc::new(Self {
            wheel: WheelDriver::new(clock::now(), tick),
            started: Cell::new(false),
        })
    }

    /// A disarmed deadline for `socket` (a `TcpStream`: take it before
    /// wrapping the stream in TLS). Spawns the tick task on the current
    /// monoio runtime the first time.
    pub fn watch(self: &Rc<Self>, socket: &impl AsRawFd) -> Deadline {
        if !self.started.replace(true) {
            let service = self.clone();
            monoio::spawn(async move {
                service
                    .wheel
                    .tick(|now| {
                        service.fire_due(now);
                    })
                    .await;
            });
        }
        Deadline {
            shared: Rc::new(Shared {
                core: RefCell::new(DeadlineCore::default()),
                fd: Cell::new(Some(socket.as_raw_fd())),
                entry: Cell::new(None),
            }),
            service: self.clone(),
        }
    }

    /// Wheel entries pending: at most one per armed deadline.
    pub fn pending(&self) -> usize {
        self.wheel.len()
    }

    /// Handles every entry due at `now`: each deadline that passed shuts its
    /// socket down; one that was pushed later gets a new entry. Returns how
    /// many sockets were shut down. The tick task calls this each time it
    /// wakes.
    pub fn fire_due(&self, now: Instant) -> usize {
        let mut cut = 0;
        while let Some(due) = self.wheel.pop_due(now) {
            let Some(shared) = due.upgrade() else {
                continue;
            };
            shared.entry.set(None);
            let step = shared.core.borrow_mut().poll(now);
            match step {
                DeadlineStep::Expire(wait) => {
                    if let Some(fd) = shared.fd.get() {
                        cut_off(fd, wait);
                        cut += 1;
                    }
                }
                DeadlineStep::SleepUntil(at) => self.schedule(&shared, at),
                DeadlineStep::Idle => {}
            }
        }
        cut
    }

    /// Gives `shared` one entry at `at`, replacing the one it had.
    fn schedule(&self, shared: &Rc<Shared>, at: Instant) {
        if let Some(old) = shared.entry.take() {
            self.wheel.cancel(old);
        }
        shared
            .entry
            .set(Some(self.wheel.insert(at, Rc::downgrade(shared))));
    }
}

struct Shared {
    core: RefCell<DeadlineCore>,
    /// The socket to shut down; `None` once the handle is dropped.
    fd: Cell<Option<RawFd>>,
    /// This deadline's wheel entry, if it has one.
    entry: Cell<Option<TimerHandle>>,
}

/// A connection's deadline; see the module docs. Made by
/// [`Deadlines::watch`]; dropping it removes its wheel entry.
///
/// On expiry the tick task shuts down the descriptor it was given; drop the
/// `Deadline` before (or in the same synchronous step as) the stream that
/// owns the descriptor, so a number reused by another socket is never shut
/// down. Keeping it in the same struct as the stream, declared before it,
/// does that.
pub struct Deadline {
    shared: Rc<Shared>,
    service: Rc<Deadlines>,
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
    /// Arms (or re-arms) the deadline `timeout` from now for `wait`.
    pub fn arm(&self, wait: Wait, timeout: Duration) {
        self.arm_at(wait, clock::now() + timeout);
    }

    /// Arms (or re-arms) the deadline at `at` for `wait`. A later deadline
    /// than the pending entry is a cell write; an earlier one (or arming a
    /// disarmed deadline) moves the entry.
    pub fn arm_at(&self, wait: Wait, at: Instant) {
        let moves = self.shared.core.borrow_mut().arm(wait, at);
        if moves {
            self.service.schedule(&self.shared, at);
        }
    }

    /// Disarms the deadline (a cell write; a pending entry finds nothing
    /// armed when it comes due).
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

impl Deadline {
    /// A weak handle on this deadline for a registry of connections
    /// ([`DeadlineRef`]).
    pub fn downgrade(&self) -> DeadlineRef {
        DeadlineRef {
            shared: Rc::downgrade(&self.shared),
        }
    }
}

/// A weak handle on a [`Deadline`]: a registry of connections (the accept
/// loop reclaiming idle keep-alive connections at its cap) sees what a
/// connection waits for and can cut it off, without keeping it alive.
#[derive(Clone)]
pub struct DeadlineRef {
    shared: Weak<Shared>,
}

impl std::fmt::Debug for DeadlineRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadlineRef")
            .field("armed", &self.armed())
            .finish()
    }
}

impl DeadlineRef {
    /// What the connection's deadline has armed; `None` also once the
    /// connection is gone.
    pub fn armed(&self) -> Option<(Wait, Instant)> {
        let shared = self.shared.upgrade()?;
        shared.fd.get()?;
        let armed = shared.core.borrow().armed();
        armed
    }

    /// Cuts the connection off now, as if its deadline had passed, when it
    /// waits for `wait` and no byte is waiting on its socket (a request
    /// that just arrived is never cut off); true when it did. The
    /// connection sees the expiry as its own ([`Deadline::expired`]).
    pub fn cut_off_if_waiting(&self, wait: Wait, now: Instant) -> bool {
        let Some(shared) = self.shared.upgrade() else {
            return false;
        };
        let Some(fd) = shared.fd.get() else {
            return false;
        };
        if !matches!(shared.core.borrow().armed(), Some((armed, _)) if armed == wait) {
            return false;
        }
        if has_pending_bytes(fd) {
            return false;
        }
        if !shared.core.borrow_mut().expire_if(wait, now) {
            return false;
        }
        cut_off(fd, wait);
        true
    }
}

/// Whether a byte is waiting to be read on `fd` (a peek that never waits).
fn has_pending_bytes(fd: RawFd) -> bool {
    use nix::sys::socket::{recv, MsgFlags};
    let mut probe = [0u8; 1];
    matches!(
        recv(fd, &mut probe, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT),
        Ok(n) if n > 0
    )
}

impl Drop for Deadline {
    fn drop(&mut self) {
        self.shared.fd.set(None);
        if let Some(entry) = self.shared.entry.take() {
            self.service.wheel.cancel(entry);
        }
    }
}

/// Cuts the connection on `fd` off for an expired `wait`: a write stall
/// first sets the socket to reset on close.
fn cut_off(fd: RawFd, wait: Wait) {
    if wait == Wait::Write {
        reset_on_close(fd);
    }
    if let Err(err) = nix::sys::socket::shutdown(fd, wait.shutdown_how()) {
        // ENOTCONN: the peer already closed or reset.
        tracing::debug!(fd, error = %err, "deadline shutdown");
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
    fn expire_if_cuts_off_only_the_wait_it_names() {
        let clock = ManualClock::new(0);
        let t0 = clock.now();
        let mut core = DeadlineCore::default();
        assert!(!core.expire_if(Wait::Idle, t0), "nothing armed");
        core.arm(Wait::Body, t0 + Duration::from_secs(5));
        assert!(!core.expire_if(Wait::Idle, t0), "a body read is not idle");
        assert_eq!(core.expired(), None);
        core.arm(Wait::Idle, t0 + Duration::from_secs(60));
        assert!(core.expire_if(Wait::Idle, t0));
        assert_eq!(core.expired(), Some(Wait::Idle));
        assert_eq!(core.armed(), None);
        // The old timer entry finds nothing armed when it fires.
        assert_eq!(core.poll(t0 + Duration::from_secs(60)), DeadlineStep::Idle);
    }

    #[test]
    fn pushing_the_deadline_later_needs_no_wake() {
        let clock = ManualClock::new(0);
        let t0 = clock.now();
        let mut core = DeadlineCore::default();
        // Nothing armed yet: no timer.
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
        // The timer fires at the old deadline and is set again.
        clock.advance(Duration::from_secs(5));
        assert_eq!(
            core.poll(clock.now()),
            DeadlineStep::SleepUntil(t0 + Duration::from_secs(99))
        );
        assert_eq!(core.expired(), None);
    }

    #[test]
    fn an_earlier_deadline_or_arming_from_idle_moves_the_timer() {
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
        // Disarmed: the timer finds nothing when it fires.
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

    fn socket_pair() -> (std::net::TcpStream, std::net::TcpStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let client =
            std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (server, _) = listener.accept().expect("accept");
        (server, client)
    }

    fn read_ends(socket: &mut std::net::TcpStream) -> bool {
        use std::io::Read;
        socket
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut byte = [0u8; 1];
        matches!(socket.read(&mut byte), Ok(0))
    }

    // The shell on the wheel, with `now` passed in (the tick task is
    // spawned but never polled: nothing here awaits): one entry per armed
    // deadline, a later deadline moves nothing, the entry re-checks when it
    // comes due, an expiry shuts down only its own socket, and drop removes
    // the entry.
    #[test]
    fn deadlines_share_one_wheel_and_cut_off_only_the_expired_socket() {
        crate::rt::block_on(async {
            let deadlines = Deadlines::new();
            let (mut slow_server, _slow_client) = socket_pair();
            let (mut busy_server, _busy_client) = socket_pair();
            let slow = deadlines.watch(&slow_server);
            let busy = deadlines.watch(&busy_server);
            assert_eq!(deadlines.pending(), 0, "disarmed deadlines hold no entry");

            let t0 = clock::now();
            let ms = Duration::from_millis;
            slow.arm_at(Wait::Head, t0 + ms(10));
            busy.arm_at(Wait::Body, t0 + ms(10));
            assert_eq!(deadlines.pending(), 2);
            // Progress on the busy one: later deadlines, no wheel operation.
            for later in 11..60 {
                busy.arm_at(Wait::Body, t0 + ms(later));
            }
            assert_eq!(deadlines.pending(), 2);

            // Not due yet: nothing happens.
            assert_eq!(deadlines.fire_due(t0 + ms(5)), 0);
            assert_eq!(deadlines.pending(), 2);
            // Both entries come due: the slow one is cut off; the busy one
            // finds its later deadline and gets a new entry there.
            assert_eq!(deadlines.fire_due(t0 + ms(12)), 1);
            assert_eq!(slow.expired(), Some(Wait::Head));
            assert_eq!(slow.armed(), None);
            assert_eq!(busy.expired(), None);
            assert_eq!(busy.armed(), Some((Wait::Body, t0 + ms(59))));
            assert_eq!(deadlines.pending(), 1);
            assert!(read_ends(&mut slow_server), "the slow socket's reads end");

            // An earlier deadline moves the entry at once.
            busy.arm_at(Wait::Write, t0 + ms(30));
            assert_eq!(deadlines.pending(), 1);
            assert_eq!(deadlines.fire_due(t0 + ms(31)), 1);
            assert_eq!(busy.expired(), Some(Wait::Write));
            assert!(
                read_ends(&mut busy_server),
                "a write stall shuts down both ways"
            );
            assert_eq!(deadlines.pending(), 0);

            // Dropping an armed deadline removes its entry; a disarmed one
            // whose entry comes due just lets it go.
            let (third_server, _third_client) = socket_pair();
            let third = deadlines.watch(&third_server);
            third.arm_at(Wait::Idle, t0 + ms(100));
            slow.arm_at(Wait::Idle, t0 + ms(100));
            slow.disarm();
            assert_eq!(deadlines.pending(), 2);
            drop(third);
            assert_eq!(deadlines.pending(), 1);
            assert_eq!(deadlines.fire_due(t0 + ms(101)), 0);
            assert_eq!(deadlines.pending(), 0);
            assert_eq!(slow.expired(), Some(Wait::Head), "the old record stays");
        })
        .expect("runtime");
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
