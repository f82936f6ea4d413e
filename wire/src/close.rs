//! Why a frame connection closed: one [`CloseReason`] for the transport,
//! the Edge and the Node.
//!
//! A reason is written onto the wire (`Close.reason`), into logs and into
//! tests by its [`CloseReason::as_str`] text, which is stable: the texts are
//! part of what operators grep for. A reason received from the peer is kept
//! as [`CloseReason::Peer`], the peer's own text (never parsed: any string
//! may arrive).

use std::borrow::Cow;
use std::fmt;
use std::io::ErrorKind;

/// Prefix of [`CloseReason::Peer`]'s text: `peer:<the peer's reason>`.
const PEER_PREFIX: &str = "peer:";
/// Prefix of [`CloseReason::TlsAlert`]'s text: `tls_alert:<alert>`.
const TLS_ALERT_PREFIX: &str = "tls_alert:";

/// Why a frame connection closed, or is being closed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CloseReason {
    // ---- the transport: the frame connection itself ------------------------
    /// `peer_closed`: the peer ended the stream without a `Close` frame.
    PeerClosed,
    /// `peer:<reason>`: the peer sent `Close{reason}`; its reason as sent
    /// (cut to the connection's cap).
    Peer(String),
    /// `heartbeat_timeout`: no heartbeat answer arrived in time (T4).
    HeartbeatTimeout,
    /// `frame_too_large`: a frame over the size cap arrived (T1).
    FrameTooLarge,
    /// `decode_error`: a frame failed to decode (T1).
    DecodeError,
    /// `io_error`: reading or writing the socket failed, not in TLS; the
    /// error's kind is kept for the code, the text does not show it.
    IoError(ErrorKind),
    /// `tls_alert:<alert>`: the peer's TLS stack ended the connection with a
    /// fatal alert, named as RFC 8446 names it (`access_denied`: the Edge
    /// refused the Node's certificate identity).
    TlsAlert(String),
    /// `tls_error`: TLS failed on our side (a record that does not decrypt,
    /// a protocol violation by the peer).
    TlsError,
    /// `control_lane_overflow`: the control lane overflowed (the peer floods
    /// heartbeats while we cannot write, or the application floods control
    /// frames).
    ControlLaneOverflow,
    /// `handle_dropped`: the last connection handle was dropped without a
    /// close.
    HandleDropped,
    /// `aborted`: the connection's tasks were dropped (the runtime stopped)
    /// before any other reason was recorded.
    Aborted,
    /// `connection ended`: the connection's event stream ended without a
    /// `Closed` event.
    ConnectionEnded,

    // ---- the protocol: closes either side orders ---------------------------
    /// `protocol_error`: the peer sent a frame the session cannot take at
    /// this point.
    ProtocolError,
    /// `registration_rejected`: the Edge refused the registration (R2, T3);
    /// the Node closes after such an answer too.
    RegistrationRejected,
    /// `not_ready`: the Edge refused readiness (R3); the Node closes after
    /// such an answer too.
    NotReady,

    // ---- the Edge ----------------------------------------------------------
    /// `register_timeout`: the Node did not register in time.
    RegisterTimeout,
    /// `superseded`: a newer connection registered the same node id (R2).
    Superseded,
    /// `flow_control_overrun`: the Node sent beyond its flow control credit.
    FlowControlOverrun,
    /// `ownership_lost`: in a cluster, this Edge can no longer prove it owns
    /// the node id (its etcd lease may have expired, or the owner key was
    /// deleted): it fences the generation and lets the Node move.
    OwnershipLost,
    /// `node_removed`: a reload took the node id out of the Edge's
    /// configuration; what it was running has ended (or its grace passed).
    NodeRemoved,

    // ---- the Node ----------------------------------------------------------
    /// `config_invalid`: the config the Edge sent cannot be applied.
    ConfigInvalid,
    /// `shutdown`: the process is closing to exit (a Node: with runs still
    /// active, its drain grace passed).
    Shutdown,
    /// `drained`: the Node drained to exit and every run or tunnel it
    /// started on this connection has ended, its terminal sent before this
    /// `Close`; it starts nothing it receives after it. So a run the Edge
    /// sent that got no answer at all never reached a provider: the Edge
    /// dispatches it again (never counted as an attempt).
    Drained,
}

impl CloseReason {
    /// The reason's text, as sent in `Close.reason`, logged and matched:
    /// `heartbeat_timeout`, `peer:superseded`, `tls_alert:access_denied`…
    /// Borrowed for every reason without a detail.
    pub fn as_str(&self) -> Cow<'static, str> {
        match self {
            CloseReason::Peer(reason) => Cow::Owned(format!("{PEER_PREFIX}{reason}")),
            CloseReason::TlsAlert(alert) => Cow::Owned(format!("{TLS_ALERT_PREFIX}{alert}")),
            CloseReason::PeerClosed => Cow::Borrowed("peer_closed"),
            CloseReason::HeartbeatTimeout => Cow::Borrowed("heartbeat_timeout"),
            CloseReason::FrameTooLarge => Cow::Borrowed("frame_too_large"),
            CloseReason::DecodeError => Cow::Borrowed("decode_error"),
            CloseReason::IoError(_) => Cow::Borrowed("io_error"),
            CloseReason::TlsError => Cow::Borrowed("tls_error"),
            CloseReason::ControlLaneOverflow => Cow::Borrowed("control_lane_overflow"),
            CloseReason::HandleDropped => Cow::Borrowed("handle_dropped"),
            CloseReason::Aborted => Cow::Borrowed("aborted"),
            CloseReason::ConnectionEnded => Cow::Borrowed("connection ended"),
            CloseReason::ProtocolError => Cow::Borrowed("protocol_error"),
            CloseReason::RegistrationRejected => Cow::Borrowed("registration_rejected"),
            CloseReason::NotReady => Cow::Borrowed("not_ready"),
            CloseReason::RegisterTimeout => Cow::Borrowed("register_timeout"),
            CloseReason::Superseded => Cow::Borrowed("superseded"),
            CloseReason::FlowControlOverrun => Cow::Borrowed("flow_control_overrun"),
            CloseReason::OwnershipLost => Cow::Borrowed("ownership_lost"),
            CloseReason::NodeRemoved => Cow::Borrowed("node_removed"),
            CloseReason::ConfigInvalid => Cow::Borrowed("config_invalid"),
            CloseReason::Shutdown => Cow::Borrowed("shutdown"),
            CloseReason::Drained => Cow::Borrowed("drained"),
        }
    }
}

impl fmt::Display for CloseReason {
    /// Writes [`CloseReason::as_str`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// Every variant and the text it had as a string constant or literal
    /// before the enum existed (logs, metrics, tests and peers rely on them).
    fn every_reason() -> Vec<(CloseReason, &'static str)> {
        vec![
            (CloseReason::PeerClosed, "peer_closed"),
            (CloseReason::Peer("superseded".into()), "peer:superseded"),
            (CloseReason::HeartbeatTimeout, "heartbeat_timeout"),
            (CloseReason::FrameTooLarge, "frame_too_large"),
            (CloseReason::DecodeError, "decode_error"),
            (CloseReason::IoError(ErrorKind::ConnectionReset), "io_error"),
            (
                CloseReason::TlsAlert("access_denied".into()),
                "tls_alert:access_denied",
            ),
            (CloseReason::TlsError, "tls_error"),
            (CloseReason::ControlLaneOverflow, "control_lane_overflow"),
            (CloseReason::HandleDropped, "handle_dropped"),
            (CloseReason::Aborted, "aborted"),
            (CloseReason::ConnectionEnded, "connection ended"),
            (CloseReason::ProtocolError, "protocol_error"),
            (CloseReason::RegistrationRejected, "registration_rejected"),
            (CloseReason::NotReady, "not_ready"),
            (CloseReason::RegisterTimeout, "register_timeout"),
            (CloseReason::Superseded, "superseded"),
            (CloseReason::FlowControlOverrun, "flow_control_overrun"),
            (CloseReason::ConfigInvalid, "config_invalid"),
            (CloseReason::Shutdown, "shutdown"),
            (CloseReason::OwnershipLost, "ownership_lost"),
            (CloseReason::NodeRemoved, "node_removed"),
            (CloseReason::Drained, "drained"),
        ]
    }

    /// The row of `reason` in [`every_reason`]. The match has no wildcard,
    /// so a new variant does not compile until it has a row.
    fn row_of(reason: &CloseReason) -> usize {
        match reason {
            CloseReason::PeerClosed => 0,
            CloseReason::Peer(_) => 1,
            CloseReason::HeartbeatTimeout => 2,
            CloseReason::FrameTooLarge => 3,
            CloseReason::DecodeError => 4,
            CloseReason::IoError(_) => 5,
            CloseReason::TlsAlert(_) => 6,
            CloseReason::TlsError => 7,
            CloseReason::ControlLaneOverflow => 8,
            CloseReason::HandleDropped => 9,
            CloseReason::Aborted => 10,
            CloseReason::ConnectionEnded => 11,
            CloseReason::ProtocolError => 12,
            CloseReason::RegistrationRejected => 13,
            CloseReason::NotReady => 14,
            CloseReason::RegisterTimeout => 15,
            CloseReason::Superseded => 16,
            CloseReason::FlowControlOverrun => 17,
            CloseReason::ConfigInvalid => 18,
            CloseReason::Shutdown => 19,
            CloseReason::OwnershipLost => 20,
            CloseReason::NodeRemoved => 21,
            CloseReason::Drained => 22,
        }
    }

    #[test]
    fn every_variant_has_its_established_text() {
        let rows = every_reason();
        assert_eq!(rows.len(), 23);
        for (i, (reason, text)) in rows.iter().enumerate() {
            assert_eq!(row_of(reason), i, "{reason:?} is listed out of place");
            assert_eq!(reason.as_str(), *text);
            assert_eq!(reason.to_string(), *text);
        }
    }

    #[test]
    fn texts_are_distinct() {
        let texts: HashSet<String> = every_reason()
            .iter()
            .map(|(reason, _)| reason.as_str().into_owned())
            .collect();
        assert_eq!(texts.len(), every_reason().len());
    }

    #[test]
    fn details_are_carried_into_the_text() {
        assert_eq!(
            CloseReason::Peer("flow_control_overrun".into()).as_str(),
            "peer:flow_control_overrun"
        );
        assert_eq!(CloseReason::Peer(String::new()).as_str(), "peer:");
        assert_eq!(
            CloseReason::TlsAlert("unknown_ca".into()).to_string(),
            "tls_alert:unknown_ca"
        );
        // The io error's kind is for the code; the text stays `io_error`.
        assert_eq!(
            CloseReason::IoError(ErrorKind::BrokenPipe).as_str(),
            CloseReason::IoError(ErrorKind::UnexpectedEof).as_str()
        );
        assert_ne!(
            CloseReason::IoError(ErrorKind::BrokenPipe),
            CloseReason::IoError(ErrorKind::UnexpectedEof)
        );
    }

    #[test]
    fn fixed_texts_are_borrowed() {
        assert!(matches!(CloseReason::Shutdown.as_str(), Cow::Borrowed(_)));
        assert!(matches!(
            CloseReason::IoError(ErrorKind::Other).as_str(),
            Cow::Borrowed(_)
        ));
        assert!(matches!(
            CloseReason::Peer("x".into()).as_str(),
            Cow::Owned(_)
        ));
    }
}
