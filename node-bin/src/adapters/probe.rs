//! The bounded, fail-closed exact-target health probe (W4, H6) and the
//! read-only provider GET it shares with OLLAMA_QUERY (K2).
//!
//! ```text
//! ProbeTarget::of(adapter, target)        pure: which URL, what proves the target
//!    └─ get(target, path, timeout) ──► (status, body) | GetError  shell: one fresh connection (TLS for https)
//!          └─ classify(status, body) / classify_error(err) ──► ProbeOutcome   pure
//! ```
//!
//! What each adapter probes:
//!
//! | adapter | path | available when |
//! |---|---|---|
//! | openai_compat | `protocol_profile.health_path` | 2xx; and when the health path is the models path, `data[].id` lists the target |
//! | openai_compat, health path answers 404 | then `protocol_profile.models_path` | 2xx and `data[].id` lists the target |
//! | ollama | `/api/tags` | 2xx and `models[].name` (or `.model`) lists the target (`name` and `name:latest` are the same model) |
//!
//! The fallback serves servers without a health route: llama-cpp-python's
//! server answers `/health` 404 where llama.cpp's `llama-server` answers it;
//! both list their model at `/v1/models`. A 404 from the models path
//! itself stays unknown.
//!
//! Normalization (fail closed): 2xx with the target → available; 5xx, a
//! models list without the target, or a refused connection (nothing
//! listens) → unavailable; everything else — timeouts, other statuses,
//! malformed or oversized bodies, other IO errors — → unknown.
//!
//! Probes deliberately bypass the core's provider connection pool
//! ([`crate::calls::pool`]): each one opens its own `connection: close`
//! connection, so its evidence is about the provider now (never a stale
//! pooled socket), and a busy pool can neither starve nor delay it.

use std::time::Duration;

use bytes::Bytes;
use iop_engine::http::{ClientConn, HttpError, Limits, Url};
use iop_engine::tls::{UpstreamTls, UpstreamTlsError};
use iop_wire::pb;

use super::dial::{self, SendError, Target};
use super::{AdapterInstance, AdapterKind};

/// The result of an exact-target health probe, normalized (W5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// The provider answered healthy for the target.
    Available,
    /// The provider answered unhealthy, or nothing listens.
    Unavailable,
    /// No trustworthy answer: error, malformed, timeout (fail closed).
    Unknown,
}

impl ProbeOutcome {
    /// The wire health.
    pub fn health(self) -> pb::ProviderHealth {
        match self {
            ProbeOutcome::Available => pb::ProviderHealth::Available,
            ProbeOutcome::Unavailable => pb::ProviderHealth::Unavailable,
            ProbeOutcome::Unknown => pb::ProviderHealth::Unknown,
        }
    }

    /// The paired liveness classification (W5): exactly
    /// available/request_stalled, unavailable/provider_unhealthy or
    /// unknown/health_unknown.
    pub fn classification(self) -> pb::LivenessClassification {
        match self {
            ProbeOutcome::Available => pb::LivenessClassification::RequestStalled,
            ProbeOutcome::Unavailable => pb::LivenessClassification::ProviderUnhealthy,
            ProbeOutcome::Unknown => pb::LivenessClassification::HealthUnknown,
        }
    }

    /// The wire evidence pair.
    pub fn evidence(self) -> pb::ProviderHealthEvidence {
        pb::ProviderHealthEvidence {
            health: self.health() as i32,
            liveness_classification: self.classification() as i32,
        }
    }
}

/// Largest probe or query response body read.
pub const MAX_GET_BODY_BYTES: usize = 1024 * 1024;

/// The Ollama health path: the local model list, which proves the target.
pub const OLLAMA_HEALTH_PATH: &str = "/api/tags";

/// Why a provider GET failed.
#[derive(Debug, thiserror::Error)]
pub enum GetError {
    /// Nothing listens at the provider address.
    #[error("connection refused")]
    Refused,
    /// Connecting failed otherwise.
    #[error("connect: {0}")]
    Connect(std::io::Error),
    /// The TLS handshake with an `https` provider failed.
    #[error("provider TLS: {0}")]
    Tls(UpstreamTlsError),
    /// The exchange failed (reset, malformed, oversized).
    #[error("{0}")]
    Http(HttpError),
    /// No answer within the bound.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// Where and how to probe one adapter instance for one target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeTarget {
    /// Provider base URL.
    pub base_url: Url,
    /// The adapter's TLS client, for an `https` base URL.
    pub tls: Option<UpstreamTls>,
    /// Request path (already under the base URL's prefix).
    pub path: String,
    /// The model id the answer must list (`None`: any 2xx will do).
    pub expect_model: Option<String>,
    /// Asked instead when `path` answers 404: the models list, which must
    /// list the target (OpenAI-compatible servers without a health route).
    pub fallback: Option<Fallback>,
}

/// The second probe of a server whose health path does not exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fallback {
    /// Request path (already under the base URL's prefix).
    pub path: String,
    /// The model id the answer must list (`None`: any 2xx will do).
    pub expect_model: Option<String>,
}

impl ProbeTarget {
    /// The probe of `adapter` for `target`.
    pub fn of(adapter: &AdapterInstance, target: &str) -> Self {
        let expect_target = (!target.is_empty()).then(|| target.to_string());
        let (path, expect_model, fallback) = match (adapter.kind, &adapter.profile) {
            (AdapterKind::OpenAiCompat, Some(profile)) => {
                let has_models = !profile.models_path.is_empty();
                let lists_models = has_models && profile.health_path == profile.models_path;
                let path = if profile.health_path.is_empty() {
                    adapter.base_url.join("/health")
                } else {
                    adapter.base_url.join(&profile.health_path)
                };
                let fallback = (has_models && !lists_models).then(|| Fallback {
                    path: adapter.base_url.join(&profile.models_path),
                    expect_model: expect_target.clone(),
                });
                (path, expect_target.filter(|_| lists_models), fallback)
            }
            (AdapterKind::OpenAiCompat, None) => (adapter.base_url.join("/health"), None, None),
            (AdapterKind::Ollama, _) => (
                adapter.base_url.join(OLLAMA_HEALTH_PATH),
                expect_target,
                None,
            ),
        };
        Self {
            base_url: adapter.base_url.clone(),
            tls: adapter.tls.clone(),
            path,
            expect_model,
            fallback,
        }
    }
}

/// Normalizes an answer (pure).
pub fn classify(status: u16, body: &[u8], expect_model: Option<&str>) -> ProbeOutcome {
    match status {
        200..=299 => match expect_model {
            None => ProbeOutcome::Available,
            Some(model) => match listed_models(body) {
                Some(ids) if ids.iter().any(|id| same_model(id, model)) => ProbeOutcome::Available,
                Some(_) => ProbeOutcome::Unavailable,
                None => ProbeOutcome::Unknown,
            },
        },
        500..=599 => ProbeOutcome::Unavailable,
        _ => ProbeOutcome::Unknown,
    }
}

/// Normalizes a failed GET (pure): a refused connection means nothing
/// listens; anything else is not trustworthy evidence.
pub fn classify_error(err: &GetError) -> ProbeOutcome {
    match err {
        GetError::Refused => ProbeOutcome::Unavailable,
        GetError::Connect(_) | GetError::Tls(_) | GetError::Http(_) | GetError::Timeout(_) => {
            ProbeOutcome::Unknown
        }
    }
}

/// `data[].id` of an OpenAI models list, or `models[].name` (else
/// `.model`) of an Ollama tag list; `None` when malformed.
fn listed_models(body: &[u8]) -> Option<Vec<String>> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let (list, keys): (_, &[&str]) = match (value.get("data"), value.get("models")) {
        (Some(data), _) => (data.as_array()?, &["id"]),
        (None, Some(models)) => (models.as_array()?, &["name", "model"]),
        (None, None) => return None,
    };
    list.iter()
        .map(|m| {
            keys.iter()
                .find_map(|k| m.get(*k).and_then(|v| v.as_str()))
                .map(str::to_string)
        })
        .collect()
}

/// Whether a listed model id is the expected one; Ollama lists an untagged
/// model as `name:latest`.
fn same_model(listed: &str, expected: &str) -> bool {
    listed == expected
        || (!expected.contains(':') && listed.strip_suffix(":latest") == Some(expected))
}

/// Runs the probe within `timeout` (fail closed): the health path, then
/// the fallback when the health path answers 404. Each GET has the whole
/// bound, so the probe takes at most twice `timeout`.
pub async fn probe(target: &ProbeTarget, timeout: Duration) -> ProbeOutcome {
    let dial = || Target::new(&target.base_url, target.tls.as_ref());
    let first = get(dial(), &target.path, timeout).await;
    if let (Ok((404, _)), Some(fallback)) = (&first, &target.fallback) {
        tracing::debug!(path = %target.path, fallback = %fallback.path, "no health route; probing the models list");
        return outcome(
            &fallback.path,
            get(dial(), &fallback.path, timeout).await,
            fallback.expect_model.as_deref(),
        );
    }
    outcome(&target.path, first, target.expect_model.as_deref())
}

fn outcome(
    path: &str,
    answer: Result<(u16, Bytes), GetError>,
    expect: Option<&str>,
) -> ProbeOutcome {
    match answer {
        Ok((status, body)) => classify(status, &body, expect),
        Err(e) => {
            tracing::debug!(%path, error = %e, "probe failed");
            classify_error(&e)
        }
    }
}

/// Runs [`probe`] in its own task; the receiver yields the outcome (a task
/// that vanished counts as [`ProbeOutcome::Unknown`] for the caller).
pub fn spawn_probe(
    target: ProbeTarget,
    timeout: Duration,
) -> iop_engine::sync::oneshot::Receiver<ProbeOutcome> {
    let (tx, rx) = iop_engine::sync::oneshot::channel();
    monoio::spawn(async move {
        let _ = tx.send(probe(&target, timeout).await);
    });
    rx
}

/// One `GET path` on a fresh connection to `target` (TLS for an `https`
/// base URL), bounded by `timeout` and [`MAX_GET_BODY_BYTES`]. Dropping the
/// exchange on timeout drops the connection with it, so no read on it is
/// ever resumed (a TLS stream is never read again after a dropped read).
pub async fn get(
    target: Target<'_>,
    path: &str,
    timeout: Duration,
) -> Result<(u16, Bytes), GetError> {
    let exchange = async {
        let stream = dial::connect(target).await.map_err(|e| match e {
            SendError::Connect { source, .. }
                if source.kind() == std::io::ErrorKind::ConnectionRefused =>
            {
                GetError::Refused
            }
            SendError::Connect { source, .. } => GetError::Connect(source),
            SendError::Tls(e) => GetError::Tls(e),
            SendError::Http(e) => GetError::Http(e),
        })?;
        let mut client =
            ClientConn::new(stream, Limits::default()).with_host(target.url.authority());
        client
            .send_request(
                "GET",
                path,
                [("accept", "application/json"), ("connection", "close")],
                Bytes::new(),
            )
            .await
            .map_err(GetError::Http)?;
        let head = client.read_response_head().await.map_err(GetError::Http)?;
        let body = client
            .read_body_to_end(MAX_GET_BODY_BYTES)
            .await
            .map_err(GetError::Http)?;
        Ok((head.status, body))
    };
    monoio::select! {
        result = exchange => result,
        _ = monoio::time::sleep(timeout) => Err(GetError::Timeout(timeout)),
    }
}

#[cfg(test)]
mod tests {
    use iop_wire::pb;

    use super::*;
    use crate::adapters::Adapters;

    fn adapters(health_path: &str) -> Adapters {
        let profile = pb::ProtocolProfile {
            name: "openai".into(),
            base_url: "http://127.0.0.1:9".into(),
            models_path: "/v1/models".into(),
            chat_completions_path: "/v1/chat/completions".into(),
            health_path: health_path.into(),
            ..Default::default()
        };
        Adapters::from_payload(&pb::NodeConfigPayload {
            adapters: vec![
                pb::AdapterConfig {
                    tls: None,
                    name: "oa".into(),
                    capacity: 1,
                    targets: vec!["m1".into()],
                    kind: Some(pb::adapter_config::Kind::OpenaiCompat(
                        pb::OpenAiCompatAdapterConfig {
                            protocol_profile: Some(profile),
                        },
                    )),
                },
                pb::AdapterConfig {
                    tls: None,
                    name: "ol".into(),
                    capacity: 1,
                    targets: vec!["llama3".into()],
                    kind: Some(pb::adapter_config::Kind::Ollama(pb::OllamaAdapterConfig {
                        base_url: "http://127.0.0.1:11434".into(),
                    })),
                },
            ],
            ..Default::default()
        })
        .unwrap()
    }

    // CONTRACT: W4, H6 — the probe addresses the exact adapter instance: its
    // profile's health path (proving the target when that is the models
    // list), or Ollama's /api/version.
    #[test]
    fn probe_targets_follow_the_adapter() {
        let a = adapters("/v1/models");
        let oa = ProbeTarget::of(a.get("oa").unwrap(), "m1");
        assert_eq!(oa.path, "/v1/models");
        assert_eq!(oa.expect_model.as_deref(), Some("m1"));
        // The models list is the health path: nothing to fall back to.
        assert_eq!(oa.fallback, None);
        let a = adapters("/health");
        let oa = ProbeTarget::of(a.get("oa").unwrap(), "m1");
        assert_eq!(oa.path, "/health");
        assert_eq!(oa.expect_model, None);
        // A /health that is missing (404) falls back to the models list,
        // which must name the target.
        assert_eq!(
            oa.fallback,
            Some(Fallback {
                path: "/v1/models".into(),
                expect_model: Some("m1".into()),
            })
        );
        // No health path in the profile: /health, with the same fallback.
        let oa = ProbeTarget::of(adapters("").get("oa").unwrap(), "m1");
        assert_eq!(oa.path, "/health");
        assert_eq!(oa.fallback.map(|f| f.path).as_deref(), Some("/v1/models"));
        let ol = ProbeTarget::of(a.get("ol").unwrap(), "llama3");
        assert_eq!(ol.path, "/api/tags");
        assert_eq!(ol.fallback, None);
        assert_eq!(ol.expect_model.as_deref(), Some("llama3"));
        assert_eq!(ProbeTarget::of(a.get("ol").unwrap(), "").expect_model, None);
        assert_eq!(ol.base_url.authority(), "127.0.0.1:11434");
    }

    // CONTRACT: W5 — normalization fails closed to unknown.
    #[test]
    fn classification_fails_closed() {
        let list = br#"{"object":"list","data":[{"id":"m0"},{"id":"m1"}]}"#;
        assert_eq!(classify(200, b"ok", None), ProbeOutcome::Available);
        assert_eq!(classify(204, b"", None), ProbeOutcome::Available);
        assert_eq!(classify(200, list, Some("m1")), ProbeOutcome::Available);
        assert_eq!(classify(200, list, Some("m9")), ProbeOutcome::Unavailable);
        assert_eq!(
            classify(200, b"not json", Some("m1")),
            ProbeOutcome::Unknown
        );
        assert_eq!(
            classify(200, br#"{"data":[{"name":"m1"}]}"#, Some("m1")),
            ProbeOutcome::Unknown
        );
        // Ollama's tag list proves the exact target (W4, H6).
        let tags = br#"{"models":[{"name":"llama3:latest","model":"llama3:latest"},{"name":"qwen2.5:7b"}]}"#;
        assert_eq!(classify(200, tags, Some("llama3")), ProbeOutcome::Available);
        assert_eq!(
            classify(200, tags, Some("llama3:latest")),
            ProbeOutcome::Available
        );
        assert_eq!(
            classify(200, tags, Some("qwen2.5:7b")),
            ProbeOutcome::Available
        );
        assert_eq!(
            classify(200, tags, Some("qwen2.5")),
            ProbeOutcome::Unavailable
        );
        assert_eq!(
            classify(200, br#"{"models":{}}"#, Some("x")),
            ProbeOutcome::Unknown
        );
        assert_eq!(classify(503, b"", None), ProbeOutcome::Unavailable);
        assert_eq!(classify(500, b"", Some("m1")), ProbeOutcome::Unavailable);
        assert_eq!(classify(404, b"", None), ProbeOutcome::Unknown);
        assert_eq!(classify(429, b"", None), ProbeOutcome::Unknown);
        assert_eq!(classify(302, b"", None), ProbeOutcome::Unknown);
        assert_eq!(
            classify_error(&GetError::Refused),
            ProbeOutcome::Unavailable
        );
        assert_eq!(
            classify_error(&GetError::Timeout(Duration::from_millis(5))),
            ProbeOutcome::Unknown
        );
        assert_eq!(
            classify_error(&GetError::Http(HttpError::UnexpectedEof)),
            ProbeOutcome::Unknown
        );
    }
}
