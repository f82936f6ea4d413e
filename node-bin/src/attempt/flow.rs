//! One run's flow-control window on the Node: the [`SendWindow`] core
//! behind a handle the session credits and the attempt spends.
//!
//! ```text
//!  session: FlowCredit{run_id, max_offset} ──► RunTable ──► FlowGate::on_credit ──┐
//!  attempt: output ─► fits? ─yes─► frame out, consume(charge)                     │
//!                        └─no──► split what fits; hold the rest ◄─ credited() ◄───┘
//!                                (the provider queue fills, its socket is not read)
//! ```
//!
//! While an attempt holds an output it reads nothing more from its
//! provider call: the call's bounded output queue fills, the call stops
//! reading the provider socket, and the provider's TCP window closes. That
//! is the back-pressure; every other run on the connection keeps flowing.

use std::cell::RefCell;
use std::rc::Rc;

use iop_engine::sync::Notify;
use iop_wire::flow::{SendWindow, MIN_WINDOW_BYTES};

/// A window the Edge granted that is too small to work (a unit that
/// cannot be split must fit in half of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("flow_window_bytes {0} is below the minimum of {MIN_WINDOW_BYTES}")]
pub struct WindowTooSmall(pub u64);

/// One run's send window, shared by the session (credit in) and the
/// attempt (bytes out).
#[derive(Debug)]
pub struct FlowGate {
    window: RefCell<SendWindow>,
    credited: Notify,
}

impl FlowGate {
    /// The gate of a run whose request granted `initial` charged bytes
    /// (0: the Edge speaks no flow control; nothing is limited).
    pub fn new(initial: u64) -> Result<Rc<Self>, WindowTooSmall> {
        if initial != 0 && initial < MIN_WINDOW_BYTES {
            return Err(WindowTooSmall(initial));
        }
        Ok(Rc::new(Self {
            window: RefCell::new(SendWindow::new(initial)),
            credited: Notify::default(),
        }))
    }

    /// A gate that limits nothing (requests that never produce frames,
    /// tests).
    pub fn unlimited() -> Rc<Self> {
        Rc::new(Self {
            window: RefCell::new(SendWindow::new(0)),
            credited: Notify::default(),
        })
    }

    /// Credit from the Edge (absolute, stale values ignored); wakes the
    /// attempt when the window grew.
    pub fn on_credit(&self, max_offset: u64) -> bool {
        let grew = self.window.borrow_mut().on_credit(max_offset);
        if grew {
            self.credited.notify();
        }
        grew
    }

    /// Whether a frame charged `charge` may go now.
    pub fn fits(&self, charge: u64) -> bool {
        self.window.borrow().fits(charge)
    }

    /// The most payload one frame may carry now.
    pub fn payload_allowance(&self) -> u64 {
        self.window.borrow().payload_allowance()
    }

    /// Records a frame charged `charge` as sent.
    pub fn consume(&self, charge: u64) {
        self.window.borrow_mut().consume(charge);
    }

    /// A copy of the window now.
    pub fn window(&self) -> SendWindow {
        *self.window.borrow()
    }

    /// Completes after the next credit that grew the window (or at once if
    /// one arrived since the last wait). One task waits: the attempt.
    pub async fn credited(&self) {
        self.credited.notified().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_below_the_minimum_are_refused_and_zero_means_unlimited() {
        assert_eq!(FlowGate::new(10).err(), Some(WindowTooSmall(10)));
        assert!(FlowGate::new(MIN_WINDOW_BYTES).is_ok());
        let off = FlowGate::new(0).expect("no window");
        assert!(off.fits(u64::MAX));
        assert!(!off.on_credit(100));
    }

    #[monoio::test_all(timer_enabled = true)]
    async fn credit_that_grows_the_window_wakes_the_attempt() {
        let gate = FlowGate::new(1000).expect("window");
        gate.consume(1000);
        assert!(!gate.fits(1));
        assert!(!gate.on_credit(900), "stale");
        let waiter = {
            let gate = gate.clone();
            monoio::spawn(async move {
                gate.credited().await;
                gate.fits(500)
            })
        };
        assert!(gate.on_credit(1500));
        assert!(waiter.await);
        assert_eq!(gate.window().available(), 500);
    }
}
