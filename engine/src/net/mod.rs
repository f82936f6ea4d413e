//! Socket guards shared by every listener and connection: a per-connection
//! [`Deadline`] that cuts a stalled peer off without cancelling a read, a
//! [`Gate`] that caps connections in progress by not accepting more, a
//! [`PeerLimit`] that caps what one peer address holds across the cores, a
//! [`LogThrottle`] that keeps a flood of failing peers out of the logs, and
//! [`set_send_buffer_bytes`] for a connection whose backlog must stay small.
//!
//! ```text
//! accept loop:  gate.enter().await ─► accept() ─► spawn(conn(permit, socket))
//!                (at the cap: wait; new connections stay in the kernel backlog)
//! connection:   deadline = deadlines.watch(&socket)   (one Deadlines per runtime)
//!               arm(Wait::Head, 10 s) ─► read … read ─► disarm()
//!                      └─ expiry: shutdown(2) from the wheel's tick task;
//!                         the pending read returns EOF, expired() says why
//! ```
//!
//! Pure cores ([`DeadlineCore`], [`LogThrottle`]) take `now` as an input and
//! are tested with a manual clock; the shells only sleep and shut sockets.

mod buffers;
mod deadline;
mod gate;
mod peers;
mod throttle;

pub use buffers::{answer_and_shut_now, set_send_buffer_bytes};
pub use deadline::{
    Deadline, DeadlineCore, DeadlineRef, DeadlineStep, Deadlines, Wait, DEADLINE_TICK,
};
pub use gate::{Gate, Permit};
pub use peers::{peer_key, PeerLimit, PeerPermit};
pub use throttle::LogThrottle;
