//! The exact-target health probe against a real provider socket (the bench
//! mock): each profile's health check works on the servers it names —
//! a server with `/health` answers it, one without (404, as
//! llama-cpp-python's) is probed at its models list instead.

mod common;

use std::time::Duration;

use common::*;
use iop_wire::pb;
use node_bin::adapters::probe::{probe, ProbeOutcome, ProbeTarget};
use node_bin::adapters::Adapters;

const TIMEOUT: Duration = Duration::from_secs(5);

/// The probe of the mock's OpenAI-compatible adapter serving `target`,
/// its profile's health path being `health_path`.
fn target(mock: &Mock, health_path: &str, target: &str) -> ProbeTarget {
    let profile = pb::ProtocolProfile {
        health_path: health_path.into(),
        ..openai_profile(mock)
    };
    let mut adapter = openai_adapter("mock", 1, profile);
    adapter.targets = vec![target.to_string()];
    let adapters = Adapters::from_payload(&node_config(vec![adapter], false)).expect("adapters");
    ProbeTarget::of(adapters.get("mock").expect("the adapter"), target)
}

// CONTRACT: W4, W5, H6 — `/health` answered: its status decides, no
// second request; missing (404): the models list decides, and it must
// list the exact target; a 5xx health answer is unavailable without a
// fallback.
#[monoio::test(timer_enabled = true)]
async fn a_missing_health_route_falls_back_to_the_models_list() {
    let mock = Mock::with_faults(1, 0, Default::default());
    let health = target(&mock, "/health", TARGET);
    assert_eq!(probe(&health, TIMEOUT).await, ProbeOutcome::Available);
    mock.set_health("unhealthy").await;
    assert_eq!(probe(&health, TIMEOUT).await, ProbeOutcome::Unavailable);
    mock.set_health("missing").await;
    assert_eq!(probe(&health, TIMEOUT).await, ProbeOutcome::Available);
    // The models list must name the target: another target is not served.
    let other = target(&mock, "/health", "not-served-here");
    assert_eq!(probe(&other, TIMEOUT).await, ProbeOutcome::Unavailable);
    // A health path that is the models list has no fallback: its own 404
    // is not evidence (unknown, fail closed).
    let models = target(&mock, "/v1/missing-models", TARGET);
    assert!(models.fallback.is_some());
    let no_fallback = ProbeTarget {
        fallback: None,
        ..models
    };
    assert_eq!(probe(&no_fallback, TIMEOUT).await, ProbeOutcome::Unknown);
}
