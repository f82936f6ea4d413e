//! A provider call that outlives its close grace (W10), on a multi-core
//! Node: a control shard on this thread, the provider call on a worker
//! core, the real session, watchdog, capacity gate and run table.
//!
//! The call is made to outlive the grace the way it happens in production:
//! the worker core that owns it cannot run (here a blocking job holds its
//! thread), so the abort the watchdog sends crosses to a core that does
//! not get to drop the call.

mod common;

use std::rc::Rc;
use std::sync::mpsc;

use common::{
    attach_lease, chat_tunnel, control_with_one_worker_and, node_config, openai_adapter,
    openai_profile, recipient, Edge, Mock, TARGET,
};
use ed25519_dalek::SigningKey;
use iop_wire::lease::opened_secrets_alive;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use node_bin::calls::pool::ProviderPool;
use node_bin::calls::{OutputTx, ProviderCall};
use node_bin::credentials::NodeCredentials;

/// The provider's key, which the mock requires, delivered in each
/// tunnel's credential lease.
const SECRET: &str = "sk-iop-close-grace-5c1e";
const RECIPIENT_SEED: [u8; 32] = [31; 32];
const ISSUER_SEED: [u8; 32] = [32; 32];

fn issuer() -> SigningKey {
    SigningKey::from_bytes(&ISSUER_SEED)
}

/// A job that blocks its worker core's thread until `release` hears from
/// the test (or its sender is dropped); it reports once it holds the
/// thread.
struct BlockTheWorker {
    release: mpsc::Receiver<()>,
}

impl ProviderCall for BlockTheWorker {
    type Output = ();

    async fn run(self, _pool: Rc<ProviderPool>, out: OutputTx<Self::Output>) {
        out.send(()).await;
        // Blocking on purpose: nothing else runs on this core meanwhile.
        let _ = self.release.recv();
    }

    fn not_started(_message: String) -> Self::Output {}
}

/// A streamed chat tunnel with a 300 ms response-stall timeout and a
/// fresh lease for [`SECRET`].
fn stalling_tunnel(mock: &Mock, run_id: &str) -> Body {
    let body = format!(
        r#"{{"model":"{TARGET}","stream":true,"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    let mut tunnel = pb::ProviderTunnelRequest {
        stream: true,
        response_stall_timeout_ms: 300,
        ..chat_tunnel(run_id, body)
    };
    let lease_id = format!("lease-{run_id}");
    attach_lease(
        &mut tunnel,
        &mock.origin(),
        &lease_id,
        SECRET,
        RECIPIENT_SEED,
        &issuer(),
    );
    Body::ProviderTunnelRequest(Box::new(tunnel))
}

// CONTRACT: W10, C2 — a stalled tunnel whose provider call cannot be
// dropped (its worker core is blocked) gets its one stall terminal at the
// end of close grace, fenced `unconfirmed`; until the call really returns,
// the capacity permit and the run entry stay held: the adapter reports one
// call in flight, the session one active run, and a new tunnel on the full
// gate is refused (`capacity_exhausted`) without its lease being opened or
// the provider called. The credential is the call's alone: opened once for
// it, and its plaintext zeroized once the request head is written, while
// the call still runs. When the worker runs again it drops the aborted
// call: only then are the permit and the entry released; the refused
// request, sent again, opens its still-unused lease and reaches the
// provider; nothing of the fenced attempt follows its terminal.
#[monoio::test(timer_enabled = true)]
async fn a_call_outliving_close_grace_holds_its_permit_until_it_returns() {
    let handler = Mock::handler_with_faults(
        8,
        0,
        bench::mock::MockFaults {
            stall_after_tokens: Some(2),
            ..Default::default()
        },
    )
    .with_required_api_key(bench::mock::auth::ApiKey::new(SECRET));
    let mock = Mock::start(handler);
    let profile = pb::ProtocolProfile {
        auth_header_name: "Authorization".into(),
        auth_header_format: "Bearer {secret}".into(),
        ..openai_profile(&mock)
    };
    let config = node_config(vec![openai_adapter("mock", 1, profile)], true);
    let credentials =
        NodeCredentials::new(recipient(RECIPIENT_SEED), issuer().verifying_key(), 5_000);
    let mut edge = Edge::start_on(control_with_one_worker_and(Some(credentials)), config).await;

    edge.send(stalling_tunnel(&mock, "w10-stalled"));
    let mut frames = Vec::new();
    while !frames
        .iter()
        .any(|f: &pb::ProviderTunnelFrame| f.kind() == pb::TunnelFrameKind::Body)
    {
        frames.push(edge.recv_tunnel().await);
    }
    // The call is on the worker, waiting for the stalled provider: block
    // the worker's thread behind it.
    let (release, blocked) = mpsc::channel();
    let mut blocker = edge
        .core
        .calls
        .workers()
        .expect("a multi-core node")
        .dispatch(None, BlockTheWorker { release: blocked });
    assert_eq!(blocker.next_output().await, Some(()), "the worker is held");

    // Stall timeout, then close grace: the terminal comes without the
    // call's return.
    frames.extend(edge.tunnel_frames("w10-stalled").await);
    let terminal = frames.last().expect("a terminal");
    assert_eq!(
        (terminal.kind(), terminal.failure_code.as_str()),
        (pb::TunnelFrameKind::Error, "response_stalled")
    );
    let failure = terminal.failure.clone().expect("ExecutionFailure");
    assert_eq!(failure.fence(), pb::Fence::Unconfirmed);
    assert_eq!(
        frames
            .iter()
            .filter(|f| common::is_tunnel_terminal(f.kind()))
            .count(),
        1
    );

    // The fenced call still holds the gate and its run entry. Its
    // credential's plaintext is already gone: the lease was opened once,
    // its header written with the request head, and zeroized then (C2), so
    // nothing of it lingers for the call's remaining life.
    assert_eq!(edge.adapter_in_flight("mock").await, 1);
    assert_eq!(edge.core.active_runs(), 1);
    assert_eq!(opened_secrets_alive(), 0);
    let requests_before = mock.counters().chat_requests;
    let refused_tunnel = stalling_tunnel(&mock, "w10-refused");
    edge.send(refused_tunnel.clone());
    let refused = edge.tunnel_frames("w10-refused").await;
    let last = refused.last().expect("a terminal");
    assert_eq!(
        (refused.len(), last.kind(), last.failure_code.as_str()),
        (1, pb::TunnelFrameKind::Error, "capacity_exhausted")
    );
    assert_eq!(
        mock.counters().chat_requests,
        requests_before,
        "never called"
    );

    // The worker runs again and drops the aborted call: released only now.
    release.send(()).expect("the blocker waits");
    assert_eq!(blocker.next_output().await, None);
    edge.all_released().await;
    assert_eq!(edge.adapter_in_flight("mock").await, 0);
    assert_eq!(edge.worker().aborted, 1, "dropped by the abort");

    // The gate admits again, and the refused request's lease was never
    // opened (a second open would be `lease_replayed`): sent again as it
    // was, it reaches the provider, which requires the key. The fenced
    // attempt sent nothing after its terminal (the next frame is this
    // tunnel's).
    edge.send(refused_tunnel);
    let start = edge.recv_tunnel().await;
    assert_eq!(
        (start.run_id.as_str(), start.kind(), start.status),
        ("w10-refused", pb::TunnelFrameKind::ResponseStart, 200)
    );
    edge.send(Body::CancelRequest(pb::CancelRequest {
        run_id: "w10-refused".into(),
        reason: "client_disconnect".into(),
    }));
    let rest = edge.tunnel_frames("w10-refused").await;
    assert_eq!(
        rest.last().map(|f| f.failure_code.as_str()),
        Some("cancelled")
    );
    edge.all_released().await;
    assert_eq!(opened_secrets_alive(), 0);
}
