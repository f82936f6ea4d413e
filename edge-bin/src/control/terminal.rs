//! What a node's terminal tells Control: how the attempt ended
//! ([`AttemptEnd`], [`FailureReason`]) and the stall evidence it carries
//! ([`StallEvidence`]), as the node connection shell decoded them into a
//! [`Terminal`].

use iop_wire::pb;

use super::ids::ConnId;

/// Stall evidence carried by a terminal (W4, W5), as the shell decoded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StallEvidence {
    /// Probe health (available / unavailable / unknown).
    pub health: pb::ProviderHealth,
    /// Its paired classification.
    pub classification: pb::LivenessClassification,
    /// The session's observation sequence, when the session was bound (W7).
    pub seq: Option<u64>,
}

impl StallEvidence {
    /// Decodes the stall evidence of a terminal's `ExecutionFailure`.
    pub fn from_failure(failure: &pb::ExecutionFailure) -> Option<Self> {
        if failure.failure_code != "response_stalled" {
            return None;
        }
        let evidence = failure.provider_health.as_ref()?;
        Some(Self {
            health: pb::ProviderHealth::try_from(evidence.health)
                .unwrap_or(pb::ProviderHealth::Unspecified),
            classification: pb::LivenessClassification::try_from(evidence.liveness_classification)
                .unwrap_or(pb::LivenessClassification::Unspecified),
            seq: failure.health_observation_seq,
        })
    }

    /// Whether health and classification form one of the three allowed pairs
    /// (W5); anything else is malformed evidence.
    pub fn is_well_formed(&self) -> bool {
        use pb::LivenessClassification as L;
        use pb::ProviderHealth as H;
        matches!(
            (self.health, self.classification),
            (H::Available, L::RequestStalled)
                | (H::Unavailable, L::ProviderUnhealthy)
                | (H::Unknown, L::HealthUnknown)
        )
    }
}

/// Why an attempt counts against its provider's health (outlier
/// detection): the provider is unreachable or failing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FailureReason {
    /// The Node could not connect (refused, reset, timed out:
    /// `provider_unreachable`) or its TLS handshake with the provider
    /// failed (`provider_tls`): nothing reached the provider.
    ConnectFailure,
    /// The provider's response broke off before it started
    /// (`provider_error` before any response head).
    ResetBeforeResponse,
    /// The provider answered 5xx and nothing reached the client yet.
    UpstreamStatus,
    /// The Node's stall watchdog ended the attempt (`response_stalled`).
    Stalled,
    /// No response started within the response-wait timeout (U6).
    ResponseWaitTimeout,
}

impl FailureReason {
    /// Every reason, in label order.
    pub const ALL: [FailureReason; 5] = [
        FailureReason::ConnectFailure,
        FailureReason::ResetBeforeResponse,
        FailureReason::UpstreamStatus,
        FailureReason::Stalled,
        FailureReason::ResponseWaitTimeout,
    ];

    /// Its metric label and `/status` spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::ConnectFailure => "connect_failure",
            FailureReason::ResetBeforeResponse => "reset_before_response",
            FailureReason::UpstreamStatus => "upstream_5xx",
            FailureReason::Stalled => "stalled",
            FailureReason::ResponseWaitTimeout => "response_wait_timeout",
        }
    }
}

/// How one attempt ended, as its node connection classified its frames
/// (`crate::control::attempt`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptEnd {
    /// The provider answered: a response below 500, or a complete run.
    Answered,
    /// The provider is unreachable or failing: counts toward its ejection;
    /// another provider may take the request if nothing reached the client.
    Failed(FailureReason),
    /// The Node refused the attempt for a reason another provider would not
    /// share (its capacity gate full, the adapter or operation unknown
    /// there): another provider may take it; not held against this one.
    Refused,
    /// Anything else (cancelled, a request another provider would refuse
    /// too, a credential lease failure, C5): final, not counted.
    Other,
}

impl AttemptEnd {
    /// Whether another provider may take the request (when nothing reached
    /// the client).
    pub fn is_retryable(self) -> bool {
        matches!(self, AttemptEnd::Failed(_) | AttemptEnd::Refused)
    }
}

/// A terminal received from a node (H1): its reception identity is the
/// connection it arrived on, never a payload field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Terminal {
    /// The connection it arrived on.
    pub conn: ConnId,
    /// The run it ends.
    pub run_id: String,
    /// Typed adapter evidence (H2).
    pub adapter: String,
    /// Typed target evidence (H2).
    pub target: String,
    /// Stall evidence, when the terminal is a `response_stalled` error.
    pub stall: Option<StallEvidence>,
    /// How the attempt ended.
    pub end: AttemptEnd,
    /// Whether a byte of its response reached (or is about to reach) the
    /// client: then it is never retried.
    pub committed: bool,
}
