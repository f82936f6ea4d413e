//! Manual-clock tests of the watchdog core. No test here sleeps or reads the
//! OS clock after taking the origin instant: every `now` is `t0 + offset`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use iop_engine::clock::{Clock, ManualClock};
use iop_wire::pb;
use prost::Message;

use super::*;
use crate::attempt::emit::{Emitter, Outbound, RunEmitter, TunnelEmitter};
use crate::attempt::observation::ObservationSeq;
use crate::calls::output::{RunOutput, TunnelOutput};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn config(stall_ms: u64, grace_ms: u64, probe_ms: u64) -> WatchdogConfig {
    WatchdogConfig {
        stall_timeout: ms(stall_ms),
        close_grace: ms(grace_ms),
        probe_timeout: ms(probe_ms),
    }
}

fn t0() -> Instant {
    ManualClock::new(0).now()
}

fn drain(wd: &mut Watchdog) -> Vec<Action> {
    std::iter::from_fn(|| wd.poll_action()).collect()
}

fn identity() -> AttemptIdentity {
    AttemptIdentity {
        node_run_id: "nrun-1".into(),
        attempt_id: "nrun-1-a1".into(),
        adapter: "vllm-main".into(),
        target: "llama".into(),
    }
}

fn stalled_at(wd: &mut Watchdog, now: Instant) {
    wd.handle_timeout(now);
    assert_eq!(
        drain(wd),
        vec![Action::CancelProvider, Action::StartProbe],
        "the watchdog must claim the stall at {now:?}"
    );
}

// CONTRACT: W3, W4 — just below the threshold nothing happens; at it the
// watchdog cancels/fences the attempt and starts the probe.
#[test]
fn stall_fires_at_the_threshold_not_below() {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 300, 200), t0, None);
    assert_eq!(wd.poll_timeout(), Some(t0 + ms(1000)));
    wd.handle_timeout(t0 + ms(999));
    assert_eq!(drain(&mut wd), vec![]);
    assert_eq!(wd.phase(), Phase::Running);
    stalled_at(&mut wd, t0 + ms(1000));
    assert_eq!(
        wd.phase(),
        Phase::Joining {
            claimed_at: t0 + ms(1000),
            idle: ms(1000),
            fence: None,
            probe: None,
            provider_returned: false,
        }
    );
}

// CONTRACT: W3 — a late timer reports the real idle time.
#[test]
fn stall_above_the_threshold_reports_the_observed_idle_time() {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 300, 200), t0, None);
    stalled_at(&mut wd, t0 + ms(1500));
    wd.handle_provider_returned(t0 + ms(1510));
    wd.handle_probe_result(t0 + ms(1520), ProbeOutcome::Available);
    assert_eq!(
        drain(&mut wd),
        vec![
            Action::EmitStall(StallReport {
                idle: ms(1500),
                fence: FenceState::Confirmed,
                health: ProbeOutcome::Available,
            }),
            Action::Release
        ]
    );
}

// CONTRACT: W3 — only progress resets the idle clock; neutral output
// (response head, start) does not.
#[test]
fn only_progress_resets() {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 300, 200), t0, None);
    assert_eq!(
        wd.on_output(t0 + ms(100), Activity::Neutral),
        Verdict::Forward
    );
    assert_eq!(
        wd.on_output(t0 + ms(600), Activity::Progress),
        Verdict::Forward
    );
    assert_eq!(wd.poll_timeout(), Some(t0 + ms(1600)));
    wd.handle_timeout(t0 + ms(1000));
    assert_eq!(
        wd.on_output(t0 + ms(1200), Activity::Neutral),
        Verdict::Forward
    );
    wd.handle_timeout(t0 + ms(1599));
    assert_eq!(drain(&mut wd), vec![]);
    stalled_at(&mut wd, t0 + ms(1600));

    let mut neutral_only = Watchdog::new(config(1000, 300, 200), t0, None);
    neutral_only.on_output(t0 + ms(999), Activity::Neutral);
    stalled_at(&mut neutral_only, t0 + ms(1000));
}

// CONTRACT: W3 — progress arriving exactly at the deadline is too late: the
// watchdog fired first and the output is dropped (W10).
#[test]
fn output_at_the_deadline_is_dropped() {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 300, 200), t0, None);
    assert_eq!(
        wd.on_output(t0 + ms(999), Activity::Progress),
        Verdict::Forward
    );
    assert_eq!(
        wd.on_output(t0 + ms(1999), Activity::Progress),
        Verdict::Drop
    );
    assert_eq!(
        drain(&mut wd),
        vec![Action::CancelProvider, Action::StartProbe]
    );
}

// CONTRACT: W3 — a terminal type wins over any payload it carries (usage on
// `complete`, text on a terminal); non-terminal usage is progress.
#[test]
fn terminal_type_wins_over_payload() {
    assert_eq!(
        run_event_activity(pb::RunEventType::Complete, 12, true),
        Activity::Terminal
    );
    assert_eq!(
        run_event_activity(pb::RunEventType::Error, 5, false),
        Activity::Terminal
    );
    assert_eq!(
        run_event_activity(pb::RunEventType::Cancelled, 0, true),
        Activity::Terminal
    );
    assert_eq!(
        run_event_activity(pb::RunEventType::Delta, 0, true),
        Activity::Progress
    );
    assert_eq!(
        run_event_activity(pb::RunEventType::Delta, 3, false),
        Activity::Progress
    );
    assert_eq!(
        run_event_activity(pb::RunEventType::Delta, 0, false),
        Activity::Neutral
    );
    assert_eq!(
        run_event_activity(pb::RunEventType::Start, 0, false),
        Activity::Neutral
    );
    assert_eq!(
        tunnel_activity(pb::TunnelFrameKind::End, 0),
        Activity::Terminal
    );
    assert_eq!(
        tunnel_activity(pb::TunnelFrameKind::Error, 0),
        Activity::Terminal
    );
    assert_eq!(
        tunnel_activity(pb::TunnelFrameKind::Body, 1),
        Activity::Progress
    );
    assert_eq!(
        tunnel_activity(pb::TunnelFrameKind::Body, 0),
        Activity::Neutral
    );
    assert_eq!(
        tunnel_activity(pb::TunnelFrameKind::Usage, 0),
        Activity::Progress
    );
    assert_eq!(
        tunnel_activity(pb::TunnelFrameKind::ResponseStart, 0),
        Activity::Neutral
    );
    // A `complete` carrying usage through the emitter interface: terminal.
    assert_eq!(
        RunEmitter::activity(&RunOutput::Complete {
            finish_reason: "stop".into(),
            usage: Some(pb::Usage::default()),
            metadata: HashMap::new(),
        }),
        Activity::Terminal
    );
}

// CONTRACT: W3, W10 — the provider's own terminal ends the attempt: no
// watchdog afterwards, late output dropped, release when the call returns.
#[test]
fn provider_terminal_ends_the_watch() {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 300, 200), t0, None);
    assert_eq!(
        wd.on_output(t0 + ms(500), Activity::Terminal),
        Verdict::Forward
    );
    assert_eq!(wd.poll_timeout(), None);
    wd.handle_timeout(t0 + ms(5000));
    assert_eq!(
        wd.on_output(t0 + ms(5001), Activity::Progress),
        Verdict::Drop
    );
    wd.stop(t0 + ms(5002), StopCause::Cancelled);
    assert_eq!(drain(&mut wd), vec![]);
    assert!(!wd.is_released());
    wd.handle_provider_returned(t0 + ms(5003));
    assert_eq!(drain(&mut wd), vec![Action::Release]);
    assert!(wd.is_released());
    wd.handle_provider_returned(t0 + ms(5004));
    assert_eq!(drain(&mut wd), vec![]);
}

fn join_with_probe(outcome: Option<ProbeOutcome>) -> Vec<Action> {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 300, 200), t0, None);
    stalled_at(&mut wd, t0 + ms(1000));
    wd.handle_provider_returned(t0 + ms(1010));
    match outcome {
        Some(o) => wd.handle_probe_result(t0 + ms(1100), o),
        // The probe never answers: its bound fails closed.
        None => {
            wd.handle_timeout(t0 + ms(1199));
            assert_eq!(drain(&mut wd), vec![]);
            wd.handle_timeout(t0 + ms(1200));
        }
    }
    drain(&mut wd)
}

// CONTRACT: W4, W5 — probe available/unavailable/unknown/timeout map to the
// three classification pairs, failing closed to unknown/health_unknown.
#[test]
fn probe_outcomes_map_to_the_three_pairs() {
    let report = |health| {
        vec![
            Action::EmitStall(StallReport {
                idle: ms(1000),
                fence: FenceState::Confirmed,
                health,
            }),
            Action::Release,
        ]
    };
    assert_eq!(
        join_with_probe(Some(ProbeOutcome::Available)),
        report(ProbeOutcome::Available)
    );
    assert_eq!(
        join_with_probe(Some(ProbeOutcome::Unavailable)),
        report(ProbeOutcome::Unavailable)
    );
    assert_eq!(
        join_with_probe(Some(ProbeOutcome::Unknown)),
        report(ProbeOutcome::Unknown)
    );
    assert_eq!(join_with_probe(None), report(ProbeOutcome::Unknown));
    let pair = |o: ProbeOutcome| (o.health(), o.classification());
    assert_eq!(
        pair(ProbeOutcome::Available),
        (
            pb::ProviderHealth::Available,
            pb::LivenessClassification::RequestStalled
        )
    );
    assert_eq!(
        pair(ProbeOutcome::Unavailable),
        (
            pb::ProviderHealth::Unavailable,
            pb::LivenessClassification::ProviderUnhealthy
        )
    );
    assert_eq!(
        pair(ProbeOutcome::Unknown),
        (
            pb::ProviderHealth::Unknown,
            pb::LivenessClassification::HealthUnknown
        )
    );
}

// CONTRACT: W4 — close grace and probe run concurrently: with neither
// answering, the terminal goes out at max(grace, probe) after the claim, not
// at their sum.
#[test]
fn join_bounds_overlap() {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 500, 400), t0, None);
    stalled_at(&mut wd, t0 + ms(1000));
    assert_eq!(wd.poll_timeout(), Some(t0 + ms(1400)));
    wd.handle_timeout(t0 + ms(1400));
    assert_eq!(drain(&mut wd), vec![]);
    assert_eq!(wd.poll_timeout(), Some(t0 + ms(1500)));
    wd.handle_timeout(t0 + ms(1499));
    assert_eq!(drain(&mut wd), vec![]);
    wd.handle_timeout(t0 + ms(1500));
    assert_eq!(
        drain(&mut wd),
        vec![Action::EmitStall(StallReport {
            idle: ms(1000),
            fence: FenceState::Unconfirmed,
            health: ProbeOutcome::Unknown,
        })]
    );
    assert_eq!(wd.poll_timeout(), None);
}

// CONTRACT: W4 — the provider returning inside close grace confirms the
// fence; the terminal still waits for the probe, then goes out once.
#[test]
fn confirmed_fence_waits_for_the_probe() {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 500, 400), t0, None);
    stalled_at(&mut wd, t0 + ms(1000));
    wd.handle_provider_returned(t0 + ms(1020));
    assert_eq!(drain(&mut wd), vec![]);
    assert_eq!(wd.poll_timeout(), Some(t0 + ms(1400)));
    wd.handle_probe_result(t0 + ms(1300), ProbeOutcome::Unavailable);
    assert_eq!(
        drain(&mut wd),
        vec![
            Action::EmitStall(StallReport {
                idle: ms(1000),
                fence: FenceState::Confirmed,
                health: ProbeOutcome::Unavailable,
            }),
            Action::Release
        ]
    );
    assert!(wd.is_released());
}

// CONTRACT: W10 — a provider call that has not returned by the end of close
// grace: the terminal is emitted (fence unconfirmed), ownership is kept
// until the call returns, late output is dropped.
#[test]
fn unconfirmed_fence_keeps_ownership_until_return() {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 100, 100), t0, None);
    stalled_at(&mut wd, t0 + ms(1000));
    wd.handle_probe_result(t0 + ms(1050), ProbeOutcome::Available);
    assert_eq!(drain(&mut wd), vec![]);
    wd.handle_timeout(t0 + ms(1100));
    assert_eq!(
        drain(&mut wd),
        vec![Action::EmitStall(StallReport {
            idle: ms(1000),
            fence: FenceState::Unconfirmed,
            health: ProbeOutcome::Available,
        })]
    );
    assert!(!wd.is_released());
    assert_eq!(
        wd.on_output(t0 + ms(2000), Activity::Progress),
        Verdict::Drop
    );
    assert_eq!(
        wd.on_output(t0 + ms(2001), Activity::Terminal),
        Verdict::Drop
    );
    wd.stop(t0 + ms(2002), StopCause::SessionEnded);
    wd.handle_timeout(t0 + ms(9000));
    assert_eq!(drain(&mut wd), vec![]);
    assert!(!wd.is_released());
    wd.handle_provider_returned(t0 + ms(60_000));
    assert_eq!(drain(&mut wd), vec![Action::Release]);
    assert!(wd.is_released());
}

// CONTRACT: W10 — a return after the grace ended but before the probe
// answered: fence stays unconfirmed, release follows the terminal.
#[test]
fn return_after_grace_is_unconfirmed() {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 100, 400), t0, None);
    stalled_at(&mut wd, t0 + ms(1000));
    wd.handle_timeout(t0 + ms(1100));
    wd.handle_provider_returned(t0 + ms(1200));
    assert_eq!(drain(&mut wd), vec![]);
    wd.handle_probe_result(t0 + ms(1300), ProbeOutcome::Available);
    assert_eq!(
        drain(&mut wd),
        vec![
            Action::EmitStall(StallReport {
                idle: ms(1000),
                fence: FenceState::Unconfirmed,
                health: ProbeOutcome::Available,
            }),
            Action::Release
        ]
    );
}

// CONTRACT: W8 — a probe result never resets progress, never changes the
// fence and authorizes nothing: the join still waits for grace.
#[test]
fn probe_is_evidence_only() {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 500, 100), t0, None);
    wd.on_output(t0 + ms(300), Activity::Progress);
    stalled_at(&mut wd, t0 + ms(1300));
    wd.handle_probe_result(t0 + ms(1310), ProbeOutcome::Available);
    assert_eq!(wd.last_progress_at(), t0 + ms(300));
    assert_eq!(
        wd.phase(),
        Phase::Joining {
            claimed_at: t0 + ms(1300),
            idle: ms(1000),
            fence: None,
            probe: Some(ProbeOutcome::Available),
            provider_returned: false,
        }
    );
    assert_eq!(drain(&mut wd), vec![]);
    // A second (late) probe result changes nothing either.
    wd.handle_probe_result(t0 + ms(1320), ProbeOutcome::Unavailable);
    wd.handle_timeout(t0 + ms(1800));
    assert_eq!(
        drain(&mut wd),
        vec![Action::EmitStall(StallReport {
            idle: ms(1000),
            fence: FenceState::Unconfirmed,
            health: ProbeOutcome::Available,
        })]
    );
    assert_eq!(wd.last_progress_at(), t0 + ms(300));
    // A probe result while running is ignored and resets nothing.
    let mut running = Watchdog::new(config(1000, 500, 100), t0, None);
    running.handle_probe_result(t0 + ms(900), ProbeOutcome::Available);
    assert_eq!(running.last_progress_at(), t0);
    stalled_at(&mut running, t0 + ms(1000));
}

// CONTRACT: W9 — a hard deadline before the stall keeps its own terminal.
#[test]
fn hard_deadline_before_the_stall_wins() {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 300, 200), t0, Some(t0 + ms(800)));
    assert_eq!(wd.poll_timeout(), Some(t0 + ms(800)));
    wd.handle_timeout(t0 + ms(800));
    assert_eq!(
        drain(&mut wd),
        vec![
            Action::CancelProvider,
            Action::EmitStopped(StopCause::DeadlineExceeded)
        ]
    );
    wd.handle_timeout(t0 + ms(5000));
    assert_eq!(drain(&mut wd), vec![]);
    wd.handle_provider_returned(t0 + ms(5001));
    assert_eq!(drain(&mut wd), vec![Action::Release]);
}

// CONTRACT: W9 — a hard deadline at the same instant as the stall wins, also
// when the timer is late for both.
#[test]
fn simultaneous_hard_deadline_beats_the_stall() {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 300, 200), t0, Some(t0 + ms(1000)));
    wd.handle_timeout(t0 + ms(1000));
    assert_eq!(
        drain(&mut wd),
        vec![
            Action::CancelProvider,
            Action::EmitStopped(StopCause::DeadlineExceeded)
        ]
    );
    let mut late = Watchdog::new(config(1000, 300, 200), t0, Some(t0 + ms(1000)));
    late.handle_timeout(t0 + ms(3000));
    assert_eq!(
        drain(&mut late),
        vec![
            Action::CancelProvider,
            Action::EmitStopped(StopCause::DeadlineExceeded)
        ]
    );
}

// CONTRACT: W9, K1, F5 — caller cancellation and session end before or at
// the stall deadline keep their own terminal; strictly after it the
// watchdog had already won.
#[test]
fn cancel_and_disconnect_precedence() {
    let t0 = t0();
    for cause in [StopCause::Cancelled, StopCause::SessionEnded] {
        let mut before = Watchdog::new(config(1000, 300, 200), t0, None);
        before.stop(t0 + ms(400), cause);
        assert_eq!(
            drain(&mut before),
            vec![Action::CancelProvider, Action::EmitStopped(cause)]
        );
        let mut at = Watchdog::new(config(1000, 300, 200), t0, None);
        at.stop(t0 + ms(1000), cause);
        assert_eq!(
            drain(&mut at),
            vec![Action::CancelProvider, Action::EmitStopped(cause)]
        );
        // The stall timer had not been processed yet, but the stall happened
        // first: the watchdog keeps the attempt and the cause changes nothing.
        let mut after = Watchdog::new(config(1000, 300, 200), t0, None);
        after.stop(t0 + ms(1001), cause);
        assert_eq!(
            drain(&mut after),
            vec![Action::CancelProvider, Action::StartProbe]
        );
        after.stop(t0 + ms(1002), cause);
        assert_eq!(drain(&mut after), vec![]);
        assert!(matches!(after.phase(), Phase::Joining { .. }));
    }
}

// CONTRACT: W9 — a hard deadline during the join changes nothing: the
// watchdog already claimed the attempt.
#[test]
fn hard_deadline_after_the_claim_changes_nothing() {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 300, 300), t0, Some(t0 + ms(1100)));
    stalled_at(&mut wd, t0 + ms(1000));
    wd.handle_timeout(t0 + ms(1200));
    assert_eq!(drain(&mut wd), vec![]);
    wd.handle_timeout(t0 + ms(1300));
    assert!(matches!(
        drain(&mut wd).as_slice(),
        [Action::EmitStall(StallReport {
            fence: FenceState::Unconfirmed,
            health: ProbeOutcome::Unknown,
            ..
        })]
    ));
}

// CONTRACT: W1 — zero takes the Node default (300000 ms, or the runtime
// default), negative and overflowing values are rejected.
#[test]
fn stall_timeout_from_the_request() {
    let defaults = RuntimeSettings::default();
    assert_eq!(
        defaults.watchdog_config(0).unwrap(),
        WatchdogConfig {
            stall_timeout: ms(300_000),
            close_grace: DEFAULT_CLOSE_GRACE,
            probe_timeout: DEFAULT_PROBE_TIMEOUT,
        }
    );
    assert_eq!(
        defaults.watchdog_config(250).unwrap().stall_timeout,
        ms(250)
    );
    assert_eq!(
        defaults.watchdog_config(-1),
        Err(checks::StallTimeoutError::Negative(-1))
    );
    assert_eq!(
        defaults.watchdog_config(i64::MAX),
        Err(checks::StallTimeoutError::Overflow(i64::MAX))
    );
    let runtime = RuntimeSettings::from_pb(Some(&pb::NodeRuntimeConfig {
        concurrency: 7,
        default_response_stall_timeout_ms: 1234,
        close_grace_ms: 50,
        probe_timeout_ms: 0,
    }))
    .unwrap();
    assert_eq!(
        runtime.watchdog_config(0).unwrap(),
        WatchdogConfig {
            stall_timeout: ms(1234),
            close_grace: ms(50),
            probe_timeout: DEFAULT_PROBE_TIMEOUT,
        }
    );
    assert_eq!(
        RuntimeSettings::from_pb(Some(&pb::NodeRuntimeConfig {
            close_grace_ms: -5,
            ..Default::default()
        })),
        Err(RuntimeConfigError::Bound {
            key: "close_grace_ms",
            value: -5
        })
    );
    assert_eq!(
        RuntimeSettings::from_pb(Some(&pb::NodeRuntimeConfig {
            probe_timeout_ms: MAX_JOIN_BOUND_MS + 1,
            ..Default::default()
        })),
        Err(RuntimeConfigError::Bound {
            key: "probe_timeout_ms",
            value: MAX_JOIN_BOUND_MS + 1
        })
    );
    assert!(matches!(
        RuntimeSettings::from_pb(Some(&pb::NodeRuntimeConfig {
            default_response_stall_timeout_ms: -3,
            ..Default::default()
        })),
        Err(RuntimeConfigError::DefaultStallTimeout(_))
    ));
    assert_eq!(RuntimeSettings::from_pb(None).unwrap(), defaults);
}

// CONTRACT: W1 — the largest accepted timeout never overflows an Instant:
// the watchdog simply has no stall deadline then.
#[test]
fn huge_timeouts_do_not_overflow() {
    let t0 = t0();
    let cfg = RuntimeSettings::default()
        .watchdog_config(checks::MAX_STALL_TIMEOUT_MS)
        .unwrap();
    let mut wd = Watchdog::new(cfg, t0, None);
    wd.handle_timeout(t0 + Duration::from_secs(3600 * 24 * 365));
    assert_eq!(drain(&mut wd), vec![]);
}

/// Finalizes a stall of `wd` whose provider returned, giving the terminal
/// the next observation sequence.
fn finish_stall(
    wd: &mut Watchdog,
    at: Instant,
    seq: &ObservationSeq,
    identity: &AttemptIdentity,
) -> pb::ExecutionFailure {
    wd.handle_provider_returned(at);
    wd.handle_probe_result(at, ProbeOutcome::Available);
    match drain(wd).as_slice() {
        [Action::EmitStall(report), Action::Release] => {
            report.execution_failure(identity, seq.next())
        }
        other => panic!("expected a stall terminal, got {other:?}"),
    }
}

// CONTRACT: W7 — normalized, tunnel and CAPABILITIES observations of one
// session, finalized interleaved, get unique strictly increasing sequence
// values starting at 1; an unbound session omits the key.
#[test]
fn observation_seq_is_shared_and_strictly_increasing() {
    let t0 = t0();
    let session = ObservationSeq::bound();
    let mut watchdogs: Vec<Watchdog> = (0..5)
        .map(|i| Watchdog::new(config(1000 + i * 10, 300, 300), t0, None))
        .collect();
    for (i, wd) in watchdogs.iter_mut().enumerate() {
        stalled_at(wd, t0 + ms(1000 + i as u64 * 10));
    }
    let id = identity();
    let mut stall = |i: usize, at: u64| {
        finish_stall(&mut watchdogs[i], t0 + ms(at), &session, &id).health_observation_seq
    };
    // Interleave: tunnel, run, CAPABILITIES entry, tunnel, run, CAPABILITIES, run.
    let seen = vec![
        stall(3, 1100),
        stall(0, 1101),
        session.next(),
        stall(4, 1102),
        stall(1, 1103),
        session.next(),
        stall(2, 1104),
    ];
    assert_eq!(
        seen,
        vec![
            Some(1),
            Some(2),
            Some(3),
            Some(4),
            Some(5),
            Some(6),
            Some(7)
        ]
    );

    let unbound = ObservationSeq::unbound();
    let mut wd = Watchdog::new(config(1000, 300, 300), t0, None);
    stalled_at(&mut wd, t0 + ms(1000));
    let failure = finish_stall(&mut wd, t0 + ms(1001), &unbound, &id);
    assert_eq!(failure.health_observation_seq, None);
}

fn tunnel_frame(out: Option<Outbound>) -> pb::ProviderTunnelFrame {
    match out.map(Outbound::into_frame) {
        Some(pb::Frame {
            body: Some(pb::frame::Body::ProviderTunnelFrame(f)),
        }) => *f,
        other => panic!("expected a tunnel frame, got {other:?}"),
    }
}

fn run_event(out: Option<Outbound>) -> pb::RunEvent {
    match out {
        Some(Outbound::Frame(pb::Frame {
            body: Some(pb::frame::Body::RunEvent(e)),
        })) => *e,
        other => panic!("expected a run event, got {other:?}"),
    }
}

/// Drives a watchdog and an emitter the way the driver does: forward what
/// the watchdog lets through, emit what it decides.
fn feed<E: Emitter>(
    wd: &mut Watchdog,
    emitter: &mut E,
    now: Instant,
    output: E::Output,
) -> Option<Outbound> {
    match wd.on_output(now, E::activity(&output)) {
        Verdict::Forward => emitter.forward(output),
        Verdict::Drop => None,
    }
}

// CONTRACT: W4, W5 — a stalled tunnel ends with one ERROR frame carrying
// failure_code=response_stalled and ExecutionFailure (field 15) holding
// exactly the allowlist; late body bytes are dropped.
#[test]
fn stalled_tunnel_emits_one_allowlisted_error() {
    let t0 = t0();
    let session = ObservationSeq::bound();
    let mut wd = Watchdog::new(config(1000, 300, 200), t0, None);
    let mut e = TunnelEmitter::new("edge-run-7", "vllm-main", "llama");
    let start = tunnel_frame(feed(
        &mut wd,
        &mut e,
        t0 + ms(10),
        TunnelOutput::Start {
            status: 200,
            headers: vec![],
        },
    ));
    let body = tunnel_frame(feed(
        &mut wd,
        &mut e,
        t0 + ms(20),
        TunnelOutput::Body(Bytes::from_static(b"data: 1\n\n")),
    ));
    stalled_at(&mut wd, t0 + ms(1020));
    assert!(feed(
        &mut wd,
        &mut e,
        t0 + ms(1030),
        TunnelOutput::Body(Bytes::from_static(b"late"))
    )
    .is_none());
    wd.handle_provider_returned(t0 + ms(1040));
    wd.handle_probe_result(t0 + ms(1050), ProbeOutcome::Unavailable);
    let actions = drain(&mut wd);
    let [Action::EmitStall(report), Action::Release] = actions.as_slice() else {
        panic!("unexpected actions {actions:?}");
    };
    let failure = report.execution_failure(&identity(), session.next());
    let error = tunnel_frame(e.stall(&report.message(), failure));
    assert_eq!(
        (start.seq, body.seq, error.seq),
        (1, 2, 3),
        "ordered frames"
    );
    assert_eq!(error.kind(), pb::TunnelFrameKind::Error);
    assert_eq!(error.failure_code, "response_stalled");
    assert_eq!(
        error.error,
        "provider response stalled: no progress for 1000 ms"
    );
    assert_eq!(
        error.failure,
        Some(Box::new(pb::ExecutionFailure {
            failure_code: "response_stalled".into(),
            provider_health: Some(pb::ProviderHealthEvidence {
                health: pb::ProviderHealth::Unavailable as i32,
                liveness_classification: pb::LivenessClassification::ProviderUnhealthy as i32,
            }),
            idle_duration_ms: 1000,
            node_run_id: "nrun-1".into(),
            attempt_id: "nrun-1-a1".into(),
            fence: pb::Fence::Confirmed as i32,
            adapter: "vllm-main".into(),
            target: "llama".into(),
            health_observation_seq: Some(1),
        }))
    );
    assert!(error.metadata.is_empty());
    assert!(
        e.stopped(StopCause::Cancelled).is_none(),
        "exactly one terminal"
    );
}

// CONTRACT: W4, W5 — a stalled normalized run ends with one RunEvent{error}
// carrying ExecutionFailure (field 13); a `complete` after the claim is
// dropped.
#[test]
fn stalled_run_emits_one_error_event() {
    let t0 = t0();
    let session = ObservationSeq::bound();
    let mut wd = Watchdog::new(config(500, 300, 200), t0, None);
    let mut e = RunEmitter::new("edge-run-8", "ollama", "llama3", "s-1");
    let start = run_event(feed(
        &mut wd,
        &mut e,
        t0 + ms(5),
        RunOutput::Start {
            metadata: HashMap::new(),
        },
    ));
    let delta = run_event(feed(
        &mut wd,
        &mut e,
        t0 + ms(100),
        RunOutput::Delta {
            text: "hel".into(),
            usage: None,
        },
    ));
    stalled_at(&mut wd, t0 + ms(600));
    assert!(feed(
        &mut wd,
        &mut e,
        t0 + ms(610),
        RunOutput::Complete {
            finish_reason: "stop".into(),
            usage: None,
            metadata: HashMap::new(),
        }
    )
    .is_none());
    wd.handle_probe_result(t0 + ms(650), ProbeOutcome::Available);
    wd.handle_timeout(t0 + ms(900));
    let actions = drain(&mut wd);
    let [Action::EmitStall(report)] = actions.as_slice() else {
        panic!("unexpected actions {actions:?}");
    };
    let id = AttemptIdentity {
        node_run_id: "nrun-2".into(),
        attempt_id: "nrun-2-a1".into(),
        adapter: "ollama".into(),
        target: "llama3".into(),
    };
    let error = run_event(e.stall(
        &report.message(),
        report.execution_failure(&id, session.next()),
    ));
    assert_eq!((start.seq, delta.seq, error.seq), (1, 2, 3));
    assert_eq!(error.r#type(), pb::RunEventType::Error);
    assert_eq!(error.failure_code, "response_stalled");
    let failure = error.failure.clone().unwrap();
    assert_eq!(failure.fence(), pb::Fence::Unconfirmed);
    assert_eq!(failure.idle_duration_ms, 500);
    assert_eq!(
        failure.provider_health,
        Some(ProbeOutcome::Available.evidence())
    );
    assert_eq!(failure.health_observation_seq, Some(1));
    // W10: ownership is kept until the provider call returns.
    assert!(!wd.is_released());
    wd.handle_provider_returned(t0 + ms(5000));
    assert_eq!(drain(&mut wd), vec![Action::Release]);
}

// CONTRACT: W5 — nothing the caller controls reaches the stall terminal:
// request metadata, session id, headers and body never appear in the
// ExecutionFailure or anywhere in the encoded ERROR frame.
#[test]
fn stall_terminal_leaks_no_caller_data() {
    let t0 = t0();
    let caller_secrets = ["user-4711@example.com", "sk-live-SECRET", "prompt text"];
    let request = pb::ProviderTunnelRequest {
        run_id: "edge-run-1".into(),
        adapter: "vllm-main".into(),
        target: "llama".into(),
        metadata: HashMap::from([
            ("user".to_string(), caller_secrets[0].to_string()),
            ("api_key".to_string(), caller_secrets[1].to_string()),
        ]),
        body: Bytes::from_static(b"{\"messages\":[{\"content\":\"prompt text\"}]}"),
        session_id: caller_secrets[0].into(),
        ..Default::default()
    };
    let mut wd = Watchdog::new(config(100, 50, 50), t0, None);
    let mut e = TunnelEmitter::new(&request.run_id, &request.adapter, &request.target);
    stalled_at(&mut wd, t0 + ms(100));
    wd.handle_timeout(t0 + ms(150));
    let actions = drain(&mut wd);
    let [Action::EmitStall(report)] = actions.as_slice() else {
        panic!("unexpected actions {actions:?}");
    };
    let failure = report.execution_failure(&identity(), Some(9));
    let frame = tunnel_frame(e.stall(&report.message(), failure.clone()));
    let encoded = frame.encode_to_vec();
    for secret in caller_secrets {
        assert!(
            !encoded
                .windows(secret.len())
                .any(|w| w == secret.as_bytes()),
            "{secret} leaked into the terminal"
        );
    }
    // Exactly the allowlisted fields, each with its Node-owned value.
    assert_eq!(
        failure,
        pb::ExecutionFailure {
            failure_code: "response_stalled".into(),
            provider_health: Some(ProbeOutcome::Unknown.evidence()),
            idle_duration_ms: 100,
            node_run_id: "nrun-1".into(),
            attempt_id: "nrun-1-a1".into(),
            fence: pb::Fence::Unconfirmed as i32,
            adapter: "vllm-main".into(),
            target: "llama".into(),
            health_observation_seq: Some(9),
        }
    );
}

// CONTRACT: W6 — stop causes and provider failures are not stalls: their
// terminals carry the legacy error string and no ExecutionFailure.
#[test]
fn non_stall_terminals_have_no_failure() {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 300, 200), t0, None);
    let mut tunnel = TunnelEmitter::new("r1", "a", "t");
    let f = tunnel_frame(feed(
        &mut wd,
        &mut tunnel,
        t0 + ms(10),
        TunnelOutput::Failed {
            code: "provider_error",
            message: "provider: connection reset".into(),
        },
    ));
    assert_eq!(f.kind(), pb::TunnelFrameKind::Error);
    assert_eq!(f.failure_code, "provider_error");
    assert_eq!(f.error, "provider: connection reset");
    assert!(f.failure.is_none());

    for cause in [
        StopCause::Cancelled,
        StopCause::SessionEnded,
        StopCause::DeadlineExceeded,
    ] {
        let mut tunnel = TunnelEmitter::new("r2", "a", "t");
        let f = tunnel_frame(tunnel.stopped(cause));
        assert_eq!(f.failure_code, cause.failure_code());
        assert_eq!(f.error, cause.message());
        assert!(f.failure.is_none());
        let mut run = RunEmitter::new("r3", "a", "t", "");
        let ev = run_event(run.stopped(cause));
        assert_eq!(ev.failure_code, cause.failure_code());
        assert!(ev.failure.is_none());
    }
}

// Flow control is not a stall: an attempt that waits for credit far longer
// than its stall timeout neither stalls nor probes; once it resumes, the
// idle time it had before blocking still counts, the blocked time does not.
#[test]
fn waiting_for_credit_is_not_idle_time() {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 300, 200), t0, None);
    assert_eq!(
        wd.on_output(t0 + ms(100), Activity::Progress),
        Verdict::Forward
    );
    // 400 ms idle, then the output could not be forwarded.
    wd.flow_blocked(t0 + ms(500));
    assert!(wd.is_flow_blocked());
    assert_eq!(wd.poll_timeout(), None, "no stall deadline while blocked");
    wd.handle_timeout(t0 + ms(60_000));
    assert_eq!(drain(&mut wd), vec![], "no stall, no probe");
    assert_eq!(wd.phase(), Phase::Running);
    // Resumed after a minute: 400 ms of idle time were used before.
    wd.flow_resumed(t0 + ms(60_500));
    assert!(!wd.is_flow_blocked());
    assert_eq!(wd.poll_timeout(), Some(t0 + ms(61_100)));
    wd.handle_timeout(t0 + ms(61_099));
    assert_eq!(drain(&mut wd), vec![]);
    stalled_at(&mut wd, t0 + ms(61_100));
}

// W9 still holds while blocked: the hard deadline and a cancel end the
// attempt with their own terminal; nothing is forwarded after it.
#[test]
fn a_blocked_attempt_still_meets_its_hard_deadline_and_its_cancel() {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 300, 200), t0, Some(t0 + ms(5000)));
    wd.flow_blocked(t0 + ms(10));
    assert_eq!(wd.poll_timeout(), Some(t0 + ms(5000)));
    wd.handle_timeout(t0 + ms(5000));
    assert_eq!(
        drain(&mut wd),
        vec![
            Action::CancelProvider,
            Action::EmitStopped(StopCause::DeadlineExceeded)
        ]
    );
    assert!(!wd.accepts_output());

    let mut wd = Watchdog::new(config(1000, 300, 200), t0, None);
    wd.flow_blocked(t0 + ms(10));
    wd.stop(t0 + ms(3000), StopCause::Cancelled);
    assert_eq!(
        drain(&mut wd),
        vec![
            Action::CancelProvider,
            Action::EmitStopped(StopCause::Cancelled)
        ]
    );
    assert_eq!(
        wd.on_output(t0 + ms(3001), Activity::Progress),
        Verdict::Drop
    );
}

// A stall already due when the attempt blocks is still a stall: blocking
// never erases idle time that was over before it.
#[test]
fn blocking_after_the_stall_deadline_does_not_save_the_attempt() {
    let t0 = t0();
    let mut wd = Watchdog::new(config(1000, 300, 200), t0, None);
    wd.flow_blocked(t0 + ms(1000));
    assert_eq!(
        drain(&mut wd),
        vec![Action::CancelProvider, Action::StartProbe]
    );
    assert!(!wd.is_flow_blocked());
}

// The watchdog's own checks (debug builds) can fail: a second terminal or
// an action after the release panics, naming the rule.

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "U1, W9: a second terminal")]
fn a_second_emitted_terminal_is_caught() {
    let mut wd = Watchdog::new(config(1_000, 100, 100), t0(), None);
    assert_eq!(wd.on_output(t0(), Activity::Terminal), Verdict::Forward);
    wd.queue(Action::EmitStopped(StopCause::Cancelled));
}

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "W10: CancelProvider queued after the release")]
fn an_action_after_the_release_is_caught() {
    let mut wd = Watchdog::new(config(1_000, 100, 100), t0(), None);
    wd.handle_provider_returned(t0());
    assert_eq!(drain(&mut wd), vec![Action::Release]);
    wd.queue(Action::CancelProvider);
}
