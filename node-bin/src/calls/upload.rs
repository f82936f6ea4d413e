//! A tunnel's request body that arrives in pieces
//! (`ProviderTunnelRequest.body_follows_bytes`): an upload the Edge streams
//! from its client instead of holding it whole.
//!
//! ```text
//!  session core                                  the call's core
//!  ProviderTunnelBody ─► UploadSink ══mailbox══► UploadSource ─► provider socket
//!      (checks credit, length)                      │ written: DrainWindow
//!  Edge ◄── FlowCredit ◄── attempt ◄── TunnelOutput::UploadCredit ◄──┘
//! ```
//!
//! The Edge may send [`TUNNEL_BODY_WINDOW`] charged bytes
//! ([`flow::tunnel_body_charge`]) before the first credit; the source grants
//! more as the provider socket takes them (half a window at a time), so at
//! most a window of the body waits here, whatever the provider's pace. The
//! sink refuses a piece beyond the credit granted or beyond the announced
//! length: a protocol error the session closes the connection for. The
//! per-piece charge bounds the pieces too, so the mailbox's capacity is
//! never the limit.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use iop_engine::mailbox::{self, Mailbox, MailboxSender, TrySendError};
use iop_wire::flow::{self, DrainWindow, TUNNEL_BODY_WINDOW};

/// Why a body piece was refused (the Edge broke the protocol).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UploadError {
    /// Beyond the credit the Node granted.
    #[error("tunnel body overrun: {received} charged bytes received, {granted} granted")]
    Overrun {
        /// Charged bytes received, this piece included.
        received: u64,
        /// Charged bytes granted.
        granted: u64,
    },
    /// Beyond the length the tunnel request announced.
    #[error("tunnel body longer than announced: {excess} bytes beyond body_follows_bytes")]
    TooLong {
        /// Bytes beyond the announced length.
        excess: u64,
    },
}

/// The session's end: takes the pieces as they arrive.
#[derive(Debug)]
pub struct UploadSink {
    /// `None` once every announced byte arrived (the source then sees the
    /// end) or the call is gone.
    tx: Option<MailboxSender<Bytes>>,
    /// Bytes still announced.
    left: u64,
    /// Charged bytes received.
    received: u64,
    /// Charged bytes granted, raised by the source before it sends the
    /// credit (so a piece sent under a credit always finds it here).
    granted: Arc<AtomicU64>,
}

/// The call's end: the pieces in order, and the credit they earn once
/// written.
#[derive(Debug)]
pub struct UploadSource {
    rx: Mailbox<Bytes>,
    left: u64,
    drain: DrainWindow,
    granted: Arc<AtomicU64>,
}

/// The two ends of an upload of `follows` more bytes.
pub fn upload(follows: u64) -> (UploadSink, UploadSource) {
    // One more than the pieces a window can hold: the credit, not the
    // mailbox, is the bound.
    let capacity = (TUNNEL_BODY_WINDOW / flow::FRAME_CHARGE_BYTES) as usize + 1;
    let (tx, rx) = mailbox::mailbox(capacity);
    let granted = Arc::new(AtomicU64::new(TUNNEL_BODY_WINDOW));
    (
        UploadSink {
            tx: Some(tx),
            left: follows,
            received: 0,
            granted: granted.clone(),
        },
        UploadSource {
            rx,
            left: follows,
            drain: DrainWindow::new(TUNNEL_BODY_WINDOW),
            granted,
        },
    )
}

impl UploadSink {
    /// Takes the next piece. `Ok` also when the call is gone (the piece is
    /// dropped: its run ends on its own).
    pub fn on_piece(&mut self, data: Bytes) -> Result<(), UploadError> {
        let received = self
            .received
            .saturating_add(flow::tunnel_body_charge(data.len()));
        let granted = self.granted.load(Ordering::Acquire);
        if received > granted {
            return Err(UploadError::Overrun { received, granted });
        }
        let Some(left) = self.left.checked_sub(data.len() as u64) else {
            return Err(UploadError::TooLong {
                excess: data.len() as u64 - self.left,
            });
        };
        self.received = received;
        self.left = left;
        if let Some(tx) = &self.tx {
            match tx.try_send(data) {
                Ok(()) => {}
                // Full cannot happen under the credit (see the module
                // docs); closed: the call is gone.
                Err(TrySendError::Full(_)) | Err(TrySendError::Closed(_)) => self.tx = None,
            }
        }
        if left == 0 {
            // The end: the source sees it once it took every piece.
            self.tx = None;
        }
        Ok(())
    }
}

impl UploadSource {
    /// Bytes still to come.
    pub fn left(&self) -> u64 {
        self.left
    }

    /// The next piece; `None` at the end, or when the run ended before the
    /// body was whole (then [`UploadSource::left`] is not 0).
    pub async fn next(&mut self) -> Option<Bytes> {
        if self.left == 0 {
            return None;
        }
        let piece = self.rx.recv().await?;
        self.left = self.left.saturating_sub(piece.len() as u64);
        Some(piece)
    }

    /// A piece of `len` bytes was written to the provider: the credit to
    /// send the Edge, when half a window or more was written since the
    /// last one.
    pub fn written(&mut self, len: usize) -> Option<u64> {
        let credit = self.drain.on_consumed(flow::tunnel_body_charge(len))?;
        // Raised before the credit leaves, so the sink accepts what it
        // allows.
        self.granted.fetch_max(credit, Ordering::AcqRel);
        Some(credit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(n: usize) -> Bytes {
        Bytes::from(vec![b'x'; n])
    }

    #[monoio::test_all]
    async fn pieces_arrive_in_order_and_credit_follows_what_was_written() {
        let (mut sink, mut source) = upload(300_000);
        // A window's worth of pieces (each charged 64 more than its bytes).
        let chunk = 64 * 1024 - 64;
        for _ in 0..4 {
            sink.on_piece(piece(chunk)).unwrap();
        }
        // The fifth piece is beyond the first window.
        assert_eq!(
            sink.on_piece(piece(1)),
            Err(UploadError::Overrun {
                received: TUNNEL_BODY_WINDOW + 65,
                granted: TUNNEL_BODY_WINDOW
            })
        );
        assert_eq!(source.next().await.map(|p| p.len()), Some(chunk));
        assert_eq!(
            source.written(chunk),
            None,
            "a quarter window: no credit yet"
        );
        assert_eq!(source.next().await.map(|p| p.len()), Some(chunk));
        // Half a window written: the grant moves to written + window.
        assert_eq!(
            source.written(chunk),
            Some(2 * 64 * 1024 + TUNNEL_BODY_WINDOW)
        );
        let rest = 300_000 - 4 * chunk as u64;
        sink.on_piece(piece(rest as usize)).unwrap();
        assert_eq!(source.next().await.map(|p| p.len()), Some(chunk));
        assert_eq!(source.next().await.map(|p| p.len()), Some(chunk));
        assert_eq!(source.next().await.map(|p| p.len() as u64), Some(rest));
        assert_eq!((source.next().await, source.left()), (None, 0));
        // Nothing beyond the announced length.
        assert_eq!(
            sink.on_piece(piece(1)),
            Err(UploadError::TooLong { excess: 1 })
        );
    }

    #[monoio::test_all]
    async fn a_run_that_ends_early_leaves_bytes_unread() {
        let (mut sink, mut source) = upload(10);
        sink.on_piece(piece(4)).unwrap();
        drop(sink);
        assert_eq!(source.next().await.map(|p| p.len()), Some(4));
        assert_eq!((source.next().await, source.left()), (None, 6));
    }

    #[test]
    fn pieces_for_a_gone_call_are_dropped_not_refused() {
        let (mut sink, source) = upload(10);
        drop(source);
        assert_eq!(sink.on_piece(piece(5)), Ok(()));
        assert_eq!(sink.on_piece(piece(5)), Ok(()));
    }
}
