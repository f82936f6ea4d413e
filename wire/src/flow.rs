//! Per-run flow control on the node link: the window arithmetic both sides
//! share (HTTP/2 and QUIC style, absolute offsets), with no IO.
//!
//! ```text
//!  Node (sender)                           Edge (receiver)
//!  ─────────────                           ───────────────
//!  SendWindow                              RecvWindow (node connection's core)
//!    sent ≤ max_offset ──frames (charged)──►  received ≤ granted, else Overrun
//!    on_credit(max_offset) ◄──FlowCredit────  granted = max(granted, credit)
//!                                          DrainWindow (client's core)
//!                                             consumed += charge as the client
//!                                             socket takes the bytes; once half
//!                                             a window is consumed since the
//!                                             last grant: credit consumed + window
//! ```
//!
//! - **Charged bytes** ([`tunnel_frame_charge`], [`run_event_charge`]): a
//!   tunnel `BODY` costs its body length plus [`FRAME_CHARGE_BYTES`], a
//!   `USAGE` frame [`FRAME_CHARGE_BYTES`], a run `DELTA` its delta length
//!   plus [`FRAME_CHARGE_BYTES`]; nothing else is charged (the response
//!   start, run start and terminal come once each). The per-frame part
//!   bounds how many frames a window admits, so the Edge's buffer per run is
//!   bounded in frames as well as bytes.
//! - **Credit is an absolute offset**: a duplicate, late or lower credit is
//!   harmless ([`SendWindow::on_credit`] keeps the maximum).
//! - **Credit follows the client**, not the node: [`DrainWindow`] grants
//!   more only as the client's socket actually takes the bytes, once per
//!   half window, so a stream that never touches its window (token streams
//!   are tiny) costs no credit frames at all.
//! - **A payload larger than the credit left** is split by the sender
//!   ([`SendWindow::payload_allowance`]). A frame that cannot be split (a
//!   usage frame; the last character of a delta) must be charged at most
//!   half a window ([`MIN_WINDOW_BYTES`] guarantees that for every
//!   unsplittable frame the Node sends). Then the window never deadlocks
//!   while the client drains: with everything drained, the credit left is
//!   more than half a window, because credit is granted whenever no more
//!   than half a window is outstanding. (The property test in
//!   `wire/tests/flow_props.rs` found the deadlock an unsplittable frame of
//!   more than half a window causes.)

use crate::pb;

/// The charge of one flow-controlled frame beyond its payload bytes.
pub const FRAME_CHARGE_BYTES: u64 = 64;

/// The flow-control version a Node advertises in `RegisterRequest`.
pub const FLOW_CONTROL_V1: u32 = 1;

/// Smallest window accepted. Half of it must hold the largest frame that
/// cannot be split: a usage frame, or the last character of a delta
/// ([`FRAME_CHARGE_BYTES`] + 4).
pub const MIN_WINDOW_BYTES: u64 = 4 * FRAME_CHARGE_BYTES;

/// The window of a tunnel's streamed request body
/// (`ProviderTunnelRequest.body_follows_bytes`): the charged bytes of
/// `ProviderTunnelBody` frames the Edge may send before the Node's first
/// credit for them. Both sides know it; it travels in no frame.
pub const TUNNEL_BODY_WINDOW: u64 = 256 * 1024;

/// The charge of a `ProviderTunnelBody` frame with `data_len` bytes.
pub fn tunnel_body_charge(data_len: usize) -> u64 {
    FRAME_CHARGE_BYTES + data_len as u64
}

/// The charge of a tunnel frame of `kind` with `body_len` body bytes.
pub fn tunnel_frame_charge(kind: pb::TunnelFrameKind, body_len: usize) -> u64 {
    match kind {
        pb::TunnelFrameKind::Body => FRAME_CHARGE_BYTES + body_len as u64,
        pb::TunnelFrameKind::Usage => FRAME_CHARGE_BYTES,
        _ => 0,
    }
}

/// The charge of a run event of type `kind` with `delta_len` delta bytes.
pub fn run_event_charge(kind: pb::RunEventType, delta_len: usize) -> u64 {
    match kind {
        pb::RunEventType::Delta => FRAME_CHARGE_BYTES + delta_len as u64,
        _ => 0,
    }
}

/// The charge of a received tunnel frame.
pub fn charge_of_tunnel_frame(frame: &pb::ProviderTunnelFrame) -> u64 {
    tunnel_frame_charge(frame.kind(), frame.body.len())
}

/// The charge of a received run event.
pub fn charge_of_run_event(event: &pb::RunEvent) -> u64 {
    run_event_charge(event.r#type(), event.delta.len())
}

/// The sender's side of one run's window (the Node).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWindow {
    /// Charged bytes sent so far.
    sent: u64,
    /// Charged bytes the receiver allows in total; `None`: no window (the
    /// Edge does not speak flow control).
    max_offset: Option<u64>,
}

impl SendWindow {
    /// A window of `initial` charged bytes; 0 means no flow control.
    pub fn new(initial: u64) -> Self {
        Self {
            sent: 0,
            max_offset: (initial > 0).then_some(initial),
        }
    }

    /// Whether a window applies at all.
    pub fn is_limited(&self) -> bool {
        self.max_offset.is_some()
    }

    /// Charged bytes that may be sent now (`u64::MAX` without a window).
    pub fn available(&self) -> u64 {
        match self.max_offset {
            Some(max) => max.saturating_sub(self.sent),
            None => u64::MAX,
        }
    }

    /// Whether a frame charged `charge` fits now.
    pub fn fits(&self, charge: u64) -> bool {
        charge <= self.available()
    }

    /// The most payload bytes one frame may carry now (its charge minus the
    /// per-frame part); 0 when not even a one-byte frame fits.
    pub fn payload_allowance(&self) -> u64 {
        self.available().saturating_sub(FRAME_CHARGE_BYTES)
    }

    /// Records a sent frame of `charge`. The caller checked [`fits`]
    /// (Self::fits); an unchecked charge still never wraps.
    pub fn consume(&mut self, charge: u64) {
        self.sent = self.sent.saturating_add(charge);
    }

    /// Credit arrived: the receiver allows `max_offset` in total. Returns
    /// whether the window grew (a stale or duplicate credit changes
    /// nothing). Ignored without a window.
    pub fn on_credit(&mut self, max_offset: u64) -> bool {
        match &mut self.max_offset {
            Some(max) if max_offset > *max => {
                *max = max_offset;
                true
            }
            _ => false,
        }
    }

    /// Charged bytes sent so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }
}

/// The peer sent beyond the credit it was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("flow control overrun: {received} charged bytes received, {granted} granted")]
pub struct Overrun {
    /// Charged bytes received, this frame included.
    pub received: u64,
    /// Charged bytes granted.
    pub granted: u64,
}

/// The receiver's check of one run's window (the Edge, on the core that
/// reads the node connection).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWindow {
    received: u64,
    granted: u64,
}

impl RecvWindow {
    /// A window that granted `initial` charged bytes.
    pub fn new(initial: u64) -> Self {
        Self {
            received: 0,
            granted: initial,
        }
    }

    /// A frame charged `charge` arrived; an error when it goes beyond what
    /// was granted (the frame is then not accepted).
    pub fn on_received(&mut self, charge: u64) -> Result<(), Overrun> {
        let received = self.received.saturating_add(charge);
        if received > self.granted {
            return Err(Overrun {
                received,
                granted: self.granted,
            });
        }
        self.received = received;
        Ok(())
    }

    /// Credit `max_offset` was sent (keeps the maximum).
    pub fn on_credit_sent(&mut self, max_offset: u64) {
        self.granted = self.granted.max(max_offset);
    }

    /// Charged bytes received so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// Charged bytes granted so far.
    pub fn granted(&self) -> u64 {
        self.granted
    }
}

/// When to grant more, from what the client actually drained (the Edge, on
/// the client's core).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainWindow {
    window: u64,
    consumed: u64,
    granted: u64,
}

impl DrainWindow {
    /// A run granted `window` charged bytes at dispatch.
    pub fn new(window: u64) -> Self {
        Self {
            window,
            consumed: 0,
            granted: window,
        }
    }

    /// The client's socket took a frame charged `charge`. Returns the new
    /// credit (`max_offset`) to send when half a window or more has been
    /// consumed since the last grant; `None` otherwise (and always when
    /// the window is 0: no flow control).
    pub fn on_consumed(&mut self, charge: u64) -> Option<u64> {
        self.consumed = self.consumed.saturating_add(charge);
        if self.window == 0 {
            return None;
        }
        let outstanding = self.granted.saturating_sub(self.consumed);
        if outstanding > self.window / 2 {
            return None;
        }
        self.granted = self.consumed.saturating_add(self.window);
        Some(self.granted)
    }

    /// Charged bytes the client took so far.
    pub fn consumed(&self) -> u64 {
        self.consumed
    }

    /// The last credit granted (`max_offset`).
    pub fn granted(&self) -> u64 {
        self.granted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_cover_payload_frames_only() {
        use pb::TunnelFrameKind as K;
        assert_eq!(tunnel_frame_charge(K::Body, 100), 164);
        assert_eq!(tunnel_frame_charge(K::Usage, 0), 64);
        for kind in [K::ResponseStart, K::End, K::Error, K::Unspecified] {
            assert_eq!(tunnel_frame_charge(kind, 100), 0, "{kind:?}");
        }
        use pb::RunEventType as R;
        assert_eq!(run_event_charge(R::Delta, 5), 69);
        for kind in [R::Start, R::Complete, R::Error, R::Cancelled] {
            assert_eq!(run_event_charge(kind, 5), 0, "{kind:?}");
        }
        let frame = pb::ProviderTunnelFrame {
            kind: pb::TunnelFrameKind::Body as i32,
            body: bytes::Bytes::from_static(b"abc"),
            ..Default::default()
        };
        assert_eq!(charge_of_tunnel_frame(&frame), 67);
        let event = pb::RunEvent {
            r#type: pb::RunEventType::Delta as i32,
            delta: "hé".into(),
            ..Default::default()
        };
        assert_eq!(charge_of_run_event(&event), 64 + 3);
    }

    #[test]
    fn the_sender_stops_at_its_credit_and_keeps_the_highest() {
        let mut w = SendWindow::new(1000);
        assert!(w.is_limited());
        assert!(w.fits(1000));
        assert!(!w.fits(1001));
        w.consume(700);
        assert_eq!(w.available(), 300);
        assert_eq!(w.payload_allowance(), 236);
        assert!(!w.on_credit(900), "a lower credit changes nothing");
        assert!(!w.on_credit(1000), "a duplicate changes nothing");
        assert!(w.on_credit(1500));
        assert_eq!(w.available(), 800);
        w.consume(800);
        assert_eq!((w.available(), w.payload_allowance()), (0, 0));
        assert_eq!(w.sent(), 1500);
    }

    #[test]
    fn no_window_means_no_limit() {
        let mut w = SendWindow::new(0);
        assert!(!w.is_limited());
        w.consume(u64::MAX);
        assert_eq!(w.available(), u64::MAX);
        assert!(!w.on_credit(10));
    }

    #[test]
    fn the_receiver_refuses_an_overrun_and_accepts_up_to_the_grant() {
        let mut r = RecvWindow::new(200);
        assert_eq!(r.on_received(150), Ok(()));
        assert_eq!(
            r.on_received(51),
            Err(Overrun {
                received: 201,
                granted: 200
            })
        );
        assert_eq!(r.received(), 150, "the refused frame is not counted");
        assert_eq!(r.on_received(50), Ok(()));
        r.on_credit_sent(100);
        assert_eq!(r.granted(), 200, "credit never shrinks");
        r.on_credit_sent(400);
        assert_eq!(r.on_received(200), Ok(()));
        assert!(r.on_received(1).is_err());
    }

    #[test]
    fn credit_is_granted_per_half_window_as_the_client_drains() {
        let mut d = DrainWindow::new(1000);
        assert_eq!(d.on_consumed(400), None);
        assert_eq!(d.on_consumed(99), None, "outstanding 501 > 500");
        assert_eq!(
            d.on_consumed(1),
            Some(1500),
            "half consumed: consumed + window"
        );
        assert_eq!(d.on_consumed(10), None);
        assert_eq!(d.granted(), 1500);
        assert_eq!(d.consumed(), 510);
        // A window of 0: no flow control, never any credit.
        let mut off = DrainWindow::new(0);
        assert_eq!(off.on_consumed(1 << 40), None);
    }
}
