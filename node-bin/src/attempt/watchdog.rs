//! The response-stall watchdog of one provider attempt (W3–W10): a sans-IO
//! state machine shared by normalized runs and tunnels.
//!
//! The shell feeds it what happens — provider output classified as
//! [`Activity`], timer expiries, the provider call returning, probe results,
//! caller cancellation, session end — each with an explicit `now`, and
//! executes the [`Action`]s it queues. It reads no clock and does no IO.
//!
//! ```text
//!                 progress (resets idle)          terminal output (forwarded)
//!          ┌───────────────┐         ┌────────────────────────────────────────┐
//!          ▼               │         │                                        ▼
//!      Running ────────────┴─────────┤                                  Terminated
//!       │  │ stop (cancel, session     │                               { returned? }
//!       │  │ end, hard deadline; W9)   └──► CancelProvider, EmitStopped ──►   │
//!       │  │                                                                  │ provider
//!       │  └ idle ≥ stall timeout ──► CancelProvider, StartProbe              │ returned
//!       ▼                                                                     ▼
//!    Joining { fence?, probe? }  ── both known ──► EmitStall ──► Terminated ─► Release
//!      fence: Confirmed when the provider call returns before the close-grace
//!             deadline, Unconfirmed at the deadline (W4, W10)
//!      probe: the probe result, or Unknown at the probe deadline (W5, fail closed)
//! ```
//!
//! Rules:
//!
//! - **W3** Only progress (body bytes, deltas, non-terminal usage) moves the
//!   idle clock; a terminal type wins over any payload it carries.
//! - **Threshold.** The stall fires when `now - last_progress >= stall_timeout`.
//!   Every input first applies the deadlines due at its `now`, so an output
//!   arriving exactly at the deadline is too late (the watchdog fired).
//! - **W4** On a stall the attempt is cancelled and fenced at once, and the
//!   close-grace wait and the probe run concurrently: the terminal goes out
//!   when both are known, at most `max(close_grace, probe_timeout)` later.
//! - **W8** A probe result is evidence only: it never moves the idle clock,
//!   never changes the fence and never authorizes a retry.
//! - **W9** A hard deadline, caller cancellation or session end that happens
//!   before the watchdog fires keeps its own terminal; at the same instant as
//!   the stall deadline they win too. Once the watchdog claimed the stall,
//!   they change nothing.
//! - **W10** Output after the terminal (or after the claim) is dropped; the
//!   capacity permit, run-manager entry and adapter ownership stay with the
//!   attempt until the provider call returns ([`Action::Release`]).
//! - **Flow control is not a stall.** While the attempt waits for credit
//!   from the Edge ([`Watchdog::flow_blocked`] … [`Watchdog::flow_resumed`])
//!   the provider is not idle, our client is: the idle clock stops, so that
//!   time counts toward no stall and produces no probe or health evidence.
//!   The hard deadline and stop causes still apply.
//!
//! In debug builds every queued action is checked against these rules
//! (one terminal per attempt, nothing after [`Action::Release`]); a break
//! panics naming the rule.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use iop_wire::checks::{self, StallTimeoutError};
use iop_wire::pb;

pub use crate::adapters::probe::ProbeOutcome;

/// Failure code of a stall terminal (W4).
pub const FAILURE_RESPONSE_STALLED: &str = "response_stalled";

/// Close-grace bound when `NodeRuntimeConfig.close_grace_ms` is 0.
pub const DEFAULT_CLOSE_GRACE: Duration = Duration::from_secs(5);
/// Probe bound when `NodeRuntimeConfig.probe_timeout_ms` is 0.
pub const DEFAULT_PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest accepted close-grace or probe bound (`NodeRuntimeConfig`).
pub const MAX_JOIN_BOUND_MS: i64 = 600_000;

/// A `NodeRuntimeConfig` the Node cannot apply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuntimeConfigError {
    /// `default_response_stall_timeout_ms` is negative or overflows (W1).
    #[error("runtime.default_response_stall_timeout_ms: {0}")]
    DefaultStallTimeout(StallTimeoutError),
    /// A bound is negative or above [`MAX_JOIN_BOUND_MS`].
    #[error("runtime.{key}: {value} is outside 0..={MAX_JOIN_BOUND_MS} ms")]
    Bound {
        /// The field.
        key: &'static str,
        /// The value.
        value: i64,
    },
}

/// The Node's runtime watchdog settings, from `NodeRuntimeConfig` (W1, W4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuntimeSettings {
    /// Default stall timeout for requests that carry 0, as sent (0 = the
    /// contract default of 300000 ms).
    pub default_stall_timeout_ms: i64,
    /// Close-grace bound (W4, W10).
    pub close_grace: Duration,
    /// Exact-target probe bound (W4, H6).
    pub probe_timeout: Duration,
}

impl Default for RuntimeSettings {
    fn default() -> Self {
        Self {
            default_stall_timeout_ms: 0,
            close_grace: DEFAULT_CLOSE_GRACE,
            probe_timeout: DEFAULT_PROBE_TIMEOUT,
        }
    }
}

impl RuntimeSettings {
    /// Validates `runtime` (absent = every default). Zero bounds mean the
    /// defaults ([`DEFAULT_CLOSE_GRACE`], [`DEFAULT_PROBE_TIMEOUT`]).
    pub fn from_pb(runtime: Option<&pb::NodeRuntimeConfig>) -> Result<Self, RuntimeConfigError> {
        let Some(runtime) = runtime else {
            return Ok(Self::default());
        };
        checks::effective_stall_timeout_with_default(0, runtime.default_response_stall_timeout_ms)
            .map_err(RuntimeConfigError::DefaultStallTimeout)?;
        let bound = |key: &'static str, value: i64, default: Duration| {
            if !(0..=MAX_JOIN_BOUND_MS).contains(&value) {
                return Err(RuntimeConfigError::Bound { key, value });
            }
            // In range, so the cast is exact.
            Ok(if value == 0 {
                default
            } else {
                Duration::from_millis(value as u64)
            })
        };
        Ok(Self {
            default_stall_timeout_ms: runtime.default_response_stall_timeout_ms,
            close_grace: bound(
                "close_grace_ms",
                runtime.close_grace_ms,
                DEFAULT_CLOSE_GRACE,
            )?,
            probe_timeout: bound(
                "probe_timeout_ms",
                runtime.probe_timeout_ms,
                DEFAULT_PROBE_TIMEOUT,
            )?,
        })
    }

    /// The watchdog config for a request carrying `response_stall_timeout_ms`
    /// (W1): 0 → the Node default; negative or overflowing → error, checked
    /// before any provider call.
    pub fn watchdog_config(
        &self,
        response_stall_timeout_ms: i64,
    ) -> Result<WatchdogConfig, StallTimeoutError> {
        let stall_timeout = checks::effective_stall_timeout_with_default(
            response_stall_timeout_ms,
            self.default_stall_timeout_ms,
        )?;
        Ok(WatchdogConfig {
            stall_timeout,
            close_grace: self.close_grace,
            probe_timeout: self.probe_timeout,
        })
    }
}

/// The bounds of one watchdog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchdogConfig {
    /// Idle time that counts as a stall (W1, W3).
    pub stall_timeout: Duration,
    /// How long to wait for the cancelled provider call to return (W4, W10).
    pub close_grace: Duration,
    /// Bound of the exact-target health probe (W4).
    pub probe_timeout: Duration,
}

/// What a piece of provider output means to the watchdog (W3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activity {
    /// Body bytes, a delta, non-terminal usage: resets the idle clock.
    Progress,
    /// Neither progress nor terminal (response head, `start`, empty pieces).
    Neutral,
    /// The provider's own terminal (whatever payload it carries).
    Terminal,
}

/// Classifies a tunnel frame kind (W3): `END`/`ERROR` are terminal, a
/// non-empty `BODY` and `USAGE` are progress.
pub fn tunnel_activity(kind: pb::TunnelFrameKind, body_bytes: usize) -> Activity {
    match kind {
        pb::TunnelFrameKind::End | pb::TunnelFrameKind::Error => Activity::Terminal,
        pb::TunnelFrameKind::Body if body_bytes > 0 => Activity::Progress,
        pb::TunnelFrameKind::Usage => Activity::Progress,
        pb::TunnelFrameKind::Body
        | pb::TunnelFrameKind::ResponseStart
        | pb::TunnelFrameKind::Unspecified => Activity::Neutral,
    }
}

/// Classifies a run event (W3): `complete`/`error`/`cancelled` are terminal
/// whatever they carry; a `delta` with text or usage is progress.
pub fn run_event_activity(kind: pb::RunEventType, delta_bytes: usize, has_usage: bool) -> Activity {
    match kind {
        pb::RunEventType::Complete | pb::RunEventType::Error | pb::RunEventType::Cancelled => {
            Activity::Terminal
        }
        pb::RunEventType::Delta if delta_bytes > 0 || has_usage => Activity::Progress,
        pb::RunEventType::Delta | pb::RunEventType::Start | pb::RunEventType::Unspecified => {
            Activity::Neutral
        }
    }
}

/// Why an attempt ended before the watchdog fired (W9, K1, F5). These
/// terminals are not stalls: no `ExecutionFailure` (W6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopCause {
    /// The Edge sent `CancelRequest` (K1, U6).
    Cancelled,
    /// The session with the Edge ended (F5).
    SessionEnded,
    /// The request's hard deadline (`timeout_sec`) passed.
    DeadlineExceeded,
}

impl StopCause {
    /// The terminal's failure code.
    pub fn failure_code(self) -> &'static str {
        match self {
            StopCause::Cancelled => "cancelled",
            StopCause::SessionEnded => "session_ended",
            StopCause::DeadlineExceeded => "deadline_exceeded",
        }
    }

    /// The terminal's legacy error string (W6).
    pub fn message(self) -> &'static str {
        match self {
            StopCause::Cancelled => "the run was cancelled",
            StopCause::SessionEnded => "the session with the edge ended",
            StopCause::DeadlineExceeded => "the run's deadline passed",
        }
    }
}

/// Whether the stalled attempt was confirmed closed (W4, W10).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceState {
    /// The provider call returned within close grace (a retryable
    /// capability hint, never retry authorization: W8).
    Confirmed,
    /// It had not returned by the end of close grace.
    Unconfirmed,
}

impl FenceState {
    /// The wire fence.
    pub fn to_pb(self) -> pb::Fence {
        match self {
            FenceState::Confirmed => pb::Fence::Confirmed,
            FenceState::Unconfirmed => pb::Fence::Unconfirmed,
        }
    }
}

/// The Node-owned ids of a run (W5), from its serial in the session; made
/// into strings when asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRunIds(u64);

impl NodeRunIds {
    /// The ids of the run registered `serial`-th in its session.
    pub fn of_serial(serial: u64) -> Self {
        Self(serial)
    }

    /// `nrun-<serial>`, unique per session.
    pub fn node_run_id(self) -> String {
        format!("nrun-{}", self.0)
    }

    /// `nrun-<serial>-a1`: the run's only provider attempt (W8).
    pub fn attempt_id(self) -> String {
        format!("nrun-{}-a1", self.0)
    }
}

/// Node-owned identity of an attempt and its typed evidence (W5): nothing
/// the caller controls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptIdentity {
    /// Node-owned run id (not the Edge's run id).
    pub node_run_id: String,
    /// Node-owned provider attempt id.
    pub attempt_id: String,
    /// Adapter instance name.
    pub adapter: String,
    /// Target.
    pub target: String,
}

/// What a stall terminal reports (W4, W5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StallReport {
    /// Idle time when the watchdog fired.
    pub idle: Duration,
    /// Fence of the attempt.
    pub fence: FenceState,
    /// Probe evidence.
    pub health: ProbeOutcome,
}

impl StallReport {
    /// The wire `ExecutionFailure`: exactly the W5 allowlist, with the
    /// session's observation sequence when the session is bound (W7).
    pub fn execution_failure(
        &self,
        identity: &AttemptIdentity,
        health_observation_seq: Option<u64>,
    ) -> pb::ExecutionFailure {
        pb::ExecutionFailure {
            failure_code: FAILURE_RESPONSE_STALLED.to_string(),
            provider_health: Some(self.health.evidence()),
            idle_duration_ms: i64::try_from(self.idle.as_millis()).unwrap_or(i64::MAX),
            node_run_id: identity.node_run_id.clone(),
            attempt_id: identity.attempt_id.clone(),
            fence: self.fence.to_pb() as i32,
            adapter: identity.adapter.clone(),
            target: identity.target.clone(),
            health_observation_seq,
        }
    }

    /// The legacy error string of the stall terminal.
    pub fn message(&self) -> String {
        format!(
            "provider response stalled: no progress for {} ms",
            self.idle.as_millis()
        )
    }
}

/// What the shell must do, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Cancel and fence the provider attempt: stop its IO. Queued at most
    /// once, never for an attempt that ended with its own terminal.
    CancelProvider,
    /// Start the exact-target health probe and report it with
    /// [`Watchdog::handle_probe_result`]; its bound is enforced here.
    StartProbe,
    /// Emit the one stall terminal (`failure_code=response_stalled` with
    /// `ExecutionFailure`).
    EmitStall(StallReport),
    /// Emit the one terminal of a stop cause (no `ExecutionFailure`, W6).
    EmitStopped(StopCause),
    /// The terminal is out and the provider call returned: release the
    /// capacity permit, run-manager entry and adapter ownership (W10).
    /// Queued exactly once, last.
    Release,
}

/// Whether an output may be emitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Emit it (a terminal output is then the attempt's one terminal).
    Forward,
    /// Drop it: the attempt is fenced or terminated (W10 late output).
    Drop,
}

/// Where an attempt stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Output flows; the idle clock runs.
    Running,
    /// The stall is claimed; waiting for close grace and the probe.
    Joining {
        /// When the watchdog fired.
        claimed_at: Instant,
        /// Idle time at the claim.
        idle: Duration,
        /// `None` while close grace runs.
        fence: Option<FenceState>,
        /// `None` while the probe runs.
        probe: Option<ProbeOutcome>,
        /// The provider call returned (possibly after the grace ended).
        provider_returned: bool,
    },
    /// The terminal was emitted (or forwarded).
    Terminated {
        /// The provider call returned; ownership is released.
        provider_returned: bool,
    },
}

/// The watchdog of one provider attempt. See the module docs.
#[derive(Debug)]
pub struct Watchdog {
    config: WatchdogConfig,
    last_progress_at: Instant,
    /// Since when the attempt waits for flow-control credit (the idle
    /// clock is stopped meanwhile).
    flow_blocked_since: Option<Instant>,
    hard_deadline: Option<Instant>,
    phase: Phase,
    actions: VecDeque<Action>,
    /// A terminal went out: forwarded from the provider, or emitted here.
    terminal_out: bool,
    /// [`Action::Release`] was queued.
    released: bool,
}

impl Watchdog {
    /// A watchdog for an attempt whose provider call starts at `now`, with
    /// an optional hard deadline (`timeout_sec`, W9).
    pub fn new(config: WatchdogConfig, now: Instant, hard_deadline: Option<Instant>) -> Self {
        Self {
            config,
            last_progress_at: now,
            flow_blocked_since: None,
            hard_deadline,
            phase: Phase::Running,
            actions: VecDeque::new(),
            terminal_out: false,
            released: false,
        }
    }

    /// The bounds.
    pub fn config(&self) -> &WatchdogConfig {
        &self.config
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// When progress was last seen (W8 tests: probes never move it).
    pub fn last_progress_at(&self) -> Instant {
        self.last_progress_at
    }

    /// True once [`Action::Release`] was queued: the shell may drop the
    /// attempt.
    pub fn is_released(&self) -> bool {
        matches!(
            self.phase,
            Phase::Terminated {
                provider_returned: true
            }
        )
    }

    /// The next action to execute; call until `None` after every input.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// The earliest instant at which [`handle_timeout`](Self::handle_timeout)
    /// has something to do; `None` when nothing is timed. Re-read it after
    /// every input.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.phase {
            Phase::Running => earliest(self.stall_deadline(), self.hard_deadline),
            Phase::Joining {
                claimed_at,
                fence,
                probe,
                ..
            } => earliest(
                fence
                    .is_none()
                    .then(|| claimed_at.checked_add(self.config.close_grace))
                    .flatten(),
                probe
                    .is_none()
                    .then(|| claimed_at.checked_add(self.config.probe_timeout))
                    .flatten(),
            ),
            Phase::Terminated { .. } => None,
        }
    }

    /// Provider output at `now`, classified. Returns whether to emit it.
    pub fn on_output(&mut self, now: Instant, activity: Activity) -> Verdict {
        self.advance(now, Due::AtOrBefore);
        if self.phase != Phase::Running {
            return Verdict::Drop;
        }
        match activity {
            Activity::Progress => self.last_progress_at = now,
            Activity::Neutral => {}
            Activity::Terminal => {
                debug_assert!(!self.terminal_out, "U1: a second terminal forwarded");
                self.terminal_out = true;
                self.phase = Phase::Terminated {
                    provider_returned: false,
                };
            }
        }
        Verdict::Forward
    }

    /// The attempt could not forward its output at `now` for want of
    /// flow-control credit: the idle clock stops until
    /// [`flow_resumed`](Self::flow_resumed). Deadlines due before `now`
    /// still apply first.
    pub fn flow_blocked(&mut self, now: Instant) {
        self.advance(now, Due::AtOrBefore);
        if self.phase == Phase::Running && self.flow_blocked_since.is_none() {
            self.flow_blocked_since = Some(now);
        }
    }

    /// Credit arrived and the held output went out at `now`: the idle clock
    /// runs again from where it stopped (the blocked time is not idle time).
    pub fn flow_resumed(&mut self, now: Instant) {
        if let Some(since) = self.flow_blocked_since.take() {
            let blocked = now.saturating_duration_since(since);
            self.last_progress_at = self
                .last_progress_at
                .checked_add(blocked)
                .unwrap_or(self.last_progress_at)
                .min(now);
        }
        self.advance(now, Due::AtOrBefore);
    }

    /// Whether the attempt waits for flow-control credit.
    pub fn is_flow_blocked(&self) -> bool {
        self.flow_blocked_since.is_some()
    }

    /// Whether provider output is still forwarded (no terminal emitted or
    /// claimed yet).
    pub fn accepts_output(&self) -> bool {
        self.phase == Phase::Running
    }

    /// Applies every deadline due at `now` (stall, hard deadline, close
    /// grace, probe bound). Call when the timer for
    /// [`poll_timeout`](Self::poll_timeout) fires; early calls are harmless.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.advance(now, Due::AtOrBefore);
    }

    /// Caller cancellation or session end at `now` (W9, K1, F5): wins unless
    /// the watchdog fired strictly before `now`.
    pub fn stop(&mut self, now: Instant, cause: StopCause) {
        self.advance(now, Due::Before);
        if self.phase == Phase::Running {
            self.stop_running(cause);
        }
    }

    /// The provider call returned at `now` (its task ended). The shell
    /// forwards the provider's own terminal through
    /// [`on_output`](Self::on_output) before reporting the return.
    pub fn handle_provider_returned(&mut self, now: Instant) {
        self.advance(now, Due::AtOrBefore);
        match &mut self.phase {
            Phase::Running => {
                // No terminal was forwarded: nothing more can be emitted for
                // this attempt, so only ownership is closed.
                self.phase = Phase::Terminated {
                    provider_returned: true,
                };
                self.queue(Action::Release);
            }
            Phase::Joining {
                fence,
                provider_returned,
                ..
            } => {
                *provider_returned = true;
                if fence.is_none() {
                    *fence = Some(FenceState::Confirmed);
                }
                self.finish_join();
            }
            Phase::Terminated { provider_returned } => {
                if !*provider_returned {
                    *provider_returned = true;
                    self.queue(Action::Release);
                }
            }
        }
    }

    /// The probe finished at `now` (W4). Evidence only (W8): it moves no
    /// idle clock and no fence. Ignored outside the join or after the probe
    /// bound.
    pub fn handle_probe_result(&mut self, now: Instant, outcome: ProbeOutcome) {
        self.advance(now, Due::AtOrBefore);
        if let Phase::Joining { probe, .. } = &mut self.phase {
            if probe.is_none() {
                *probe = Some(outcome);
                self.finish_join();
            }
        }
    }

    /// Queues `action`, checking in debug builds what the module docs
    /// promise: one terminal per attempt (forwarded or emitted, U1, W9),
    /// and [`Action::Release`] exactly once and last (W10).
    fn queue(&mut self, action: Action) {
        debug_assert!(!self.released, "W10: {action:?} queued after the release");
        match action {
            Action::EmitStall(_) | Action::EmitStopped(_) => {
                debug_assert!(!self.terminal_out, "U1, W9: a second terminal ({action:?})");
                self.terminal_out = true;
            }
            Action::Release => self.released = true,
            Action::CancelProvider | Action::StartProbe => {}
        }
        self.actions.push_back(action);
    }

    fn stall_deadline(&self) -> Option<Instant> {
        if self.flow_blocked_since.is_some() {
            return None;
        }
        self.last_progress_at.checked_add(self.config.stall_timeout)
    }

    fn stop_running(&mut self, cause: StopCause) {
        self.phase = Phase::Terminated {
            provider_returned: false,
        };
        self.queue(Action::CancelProvider);
        self.queue(Action::EmitStopped(cause));
    }

    /// Applies the deadlines that are due at `now`.
    fn advance(&mut self, now: Instant, due: Due) {
        let is_due = |deadline: Option<Instant>| {
            deadline.is_some_and(|d| match due {
                Due::AtOrBefore => d <= now,
                Due::Before => d < now,
            })
        };
        if self.phase == Phase::Running {
            // W9: a hard deadline at the same instant as the stall wins.
            if is_due(self.hard_deadline) {
                self.stop_running(StopCause::DeadlineExceeded);
                return;
            }
            if is_due(self.stall_deadline()) {
                self.phase = Phase::Joining {
                    claimed_at: now,
                    idle: now.saturating_duration_since(self.last_progress_at),
                    fence: None,
                    probe: None,
                    provider_returned: false,
                };
                self.queue(Action::CancelProvider);
                self.queue(Action::StartProbe);
            }
        }
        if let Phase::Joining {
            claimed_at,
            fence,
            probe,
            ..
        } = &mut self.phase
        {
            let grace_end = claimed_at.checked_add(self.config.close_grace);
            let probe_end = claimed_at.checked_add(self.config.probe_timeout);
            if fence.is_none() && is_due(grace_end) {
                *fence = Some(FenceState::Unconfirmed);
            }
            if probe.is_none() && is_due(probe_end) {
                // Fail closed: a probe that did not answer in time.
                *probe = Some(ProbeOutcome::Unknown);
            }
            self.finish_join();
        }
    }

    /// Emits the stall terminal once both the fence and the probe are known.
    fn finish_join(&mut self) {
        let Phase::Joining {
            idle,
            fence: Some(fence),
            probe: Some(health),
            provider_returned,
            ..
        } = self.phase
        else {
            return;
        };
        self.queue(Action::EmitStall(StallReport {
            idle,
            fence,
            health,
        }));
        self.phase = Phase::Terminated { provider_returned };
        if provider_returned {
            self.queue(Action::Release);
        }
    }
}

/// Which deadlines count as due.
#[derive(Debug, Clone, Copy)]
enum Due {
    /// Deadline ≤ now (timer expiry, output, return, probe).
    AtOrBefore,
    /// Deadline < now (a stop cause at the deadline instant wins, W9).
    Before,
}

fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests;
