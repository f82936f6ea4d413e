//! Adapter instances applied from the Edge's `NodeConfigPayload` (R3, U4,
//! P4), and operation → path resolution for tunnels (U3).
//!
//! Each instance owns one capacity gate shared by every request it serves
//! (P4); `NodeRuntimeConfig.concurrency` is legacy metadata and gates nothing.
//!
//! An instance is split in two: its [`Endpoint`] (name, kind, base URL,
//! profile: immutable, `Send`, shared by `Arc`) is what a provider call
//! needs and may travel to a worker core ([`crate::calls::workers`]); the capacity
//! gate and its permits stay on the session core.

pub mod dial;
pub mod probe;

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ops::Deref;
use std::rc::Rc;
use std::sync::Arc;

use iop_engine::http::Url;
use iop_engine::tls::{UpstreamTls, UpstreamTlsSettings};
use iop_wire::lease::{self, ProviderTrust, PROVIDER_TRUST_BYTES};
use iop_wire::pb;

use self::dial::Target;

/// The adapter type of an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterKind {
    /// OpenAI-compatible HTTP server (vLLM, llama.cpp, SGLang, OpenAI).
    OpenAiCompat,
    /// Ollama native API.
    Ollama,
}

impl AdapterKind {
    /// The type name, also the default instance name (P4).
    pub fn type_name(self) -> &'static str {
        match self {
            AdapterKind::OpenAiCompat => "openai_compat",
            AdapterKind::Ollama => "ollama",
        }
    }
}

/// A config the Node cannot apply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdapterConfigError {
    /// An adapter entry has no kind.
    #[error("adapter `{0}` has no kind (ollama or openai_compat)")]
    MissingKind(String),
    /// Two instances share a name.
    #[error("adapter name `{0}` is used twice")]
    DuplicateName(String),
    /// The base URL is not usable.
    #[error("adapter `{name}`: base URL {url:?}: {reason}")]
    BadBaseUrl {
        /// Instance name.
        name: String,
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// An openai_compat instance without a protocol profile.
    #[error("adapter `{0}` has no protocol profile")]
    MissingProfile(String),
    /// The provider TLS settings cannot be used.
    #[error("adapter `{name}`: provider TLS: {reason}")]
    BadTls {
        /// Instance name.
        name: String,
        /// Why.
        reason: String,
    },
}

/// Occupancy of one instance's capacity gate (P4).
#[derive(Debug)]
pub struct CapacityGate {
    capacity: Cell<u32>,
    in_flight: Cell<u32>,
}

impl CapacityGate {
    /// A gate admitting `capacity` at once; 0 = unlimited.
    pub fn new(capacity: u32) -> Rc<Self> {
        Rc::new(Self {
            capacity: Cell::new(capacity),
            in_flight: Cell::new(0),
        })
    }

    /// Takes a slot, or `None` when full. The slot is returned when the
    /// permit drops.
    pub fn try_acquire(self: &Rc<Self>) -> Option<Permit> {
        let used = self.in_flight.get();
        let capacity = self.capacity.get();
        if capacity != 0 && used >= capacity {
            return None;
        }
        self.in_flight.set(used + 1);
        Some(Permit { gate: self.clone() })
    }

    /// Slots in use.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.get()
    }

    /// Configured capacity (0 = unlimited).
    pub fn capacity(&self) -> u32 {
        self.capacity.get()
    }

    /// Changes the capacity (config refresh, K3). Slots already held stay
    /// held; new ones are admitted only below the new capacity.
    pub fn set_capacity(&self, capacity: u32) {
        self.capacity.set(capacity);
    }
}

/// A held slot of a [`CapacityGate`].
#[derive(Debug)]
pub struct Permit {
    gate: Rc<CapacityGate>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let used = self.gate.in_flight.get();
        self.gate.in_flight.set(used.saturating_sub(1));
    }
}

/// What a provider call needs of its adapter instance: immutable and
/// `Send`, so a call can run on a worker core while the instance (and its
/// gate) stays on the session core.
#[derive(Debug, Clone, PartialEq)]
pub struct Endpoint {
    /// Stable instance name (P4).
    pub name: String,
    /// Adapter type.
    pub kind: AdapterKind,
    /// Provider base URL.
    pub base_url: Url,
    /// The TLS client for an `https://` base URL (`None` for `http://`).
    pub tls: Option<UpstreamTls>,
    /// [`lease::provider_trust_digest`] of whom `tls` trusts (computed from
    /// the client itself): a credential lease opens only for the trust it
    /// was issued for (C2).
    pub provider_trust: [u8; PROVIDER_TRUST_BYTES],
    /// The resolved protocol profile (openai_compat only, U4).
    pub profile: Option<pb::ProtocolProfile>,
}

/// One adapter instance: its [`Endpoint`] (reachable through `Deref`:
/// `instance.base_url`), its targets and its capacity gate.
#[derive(Debug)]
pub struct AdapterInstance {
    /// Name, kind, base URL and profile, shared with provider calls on
    /// any core.
    pub endpoint: Arc<Endpoint>,
    /// Targets this instance serves.
    pub targets: Vec<String>,
    /// Its capacity gate (P4).
    pub gate: Rc<CapacityGate>,
}

impl Deref for AdapterInstance {
    type Target = Endpoint;

    fn deref(&self) -> &Endpoint {
        &self.endpoint
    }
}

/// Why a tunnel's path could not be resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// The operation is not one of the profile operations (U3).
    #[error("unknown operation `{0}`")]
    UnknownOperation(String),
    /// The profile has no path for this operation.
    #[error("the protocol profile has no path for operation `{0}`")]
    NoPath(String),
    /// Neither operation nor path given.
    #[error("the request names neither an operation nor a path")]
    Empty,
}

impl Endpoint {
    /// Where provider connections of this instance go.
    pub fn target(&self) -> Target<'_> {
        Target::new(&self.base_url, self.tls.as_ref())
    }

    /// The provider path for a tunnel (U3): the profile's path of
    /// `operation`, or `fallback_path` when the operation is empty
    /// (mixed-version fallback), joined under the base URL's prefix.
    pub fn tunnel_path(&self, operation: &str, fallback_path: &str) -> Result<String, PathError> {
        if operation.is_empty() {
            if fallback_path.is_empty() {
                return Err(PathError::Empty);
            }
            return Ok(self.base_url.join(fallback_path));
        }
        let profile_path = self.profile.as_ref().map(|p| {
            p.operation_path(operation)
                .ok_or_else(|| PathError::UnknownOperation(operation.to_string()))
        });
        match profile_path {
            Some(Ok(path)) if !path.is_empty() => Ok(self.base_url.join(path)),
            Some(Ok(_)) | None => Err(PathError::NoPath(operation.to_string())),
            Some(Err(e)) => Err(e),
        }
    }
}

/// The TLS client of an instance: built for an `https://` base URL from the
/// pushed settings (a private CA, or the default trust anchors); settings on
/// an `http://` base URL are refused (the Edge never sends them).
fn upstream_tls(
    name: &str,
    base_url: &Url,
    settings: Option<&pb::ProviderTlsConfig>,
) -> Result<Option<UpstreamTls>, AdapterConfigError> {
    let bad = |reason: String| AdapterConfigError::BadTls {
        name: name.to_owned(),
        reason,
    };
    if !base_url.is_tls() {
        return match settings {
            Some(_) => Err(bad(format!(
                "TLS settings for the plain-http base URL {base_url}"
            ))),
            None => Ok(None),
        };
    }
    let settings = UpstreamTlsSettings {
        ca_pem: settings
            .filter(|s| !s.ca_pem.is_empty())
            .map(|s| s.ca_pem.clone()),
        insecure_skip_verify: settings.is_some_and(|s| s.insecure_skip_verify),
    };
    if settings.insecure_skip_verify {
        tracing::warn!(
            adapter = name,
            base_url = %base_url,
            "tls_insecure_skip_verify: this adapter's provider certificate is NOT verified \
             (dev only)"
        );
    }
    UpstreamTls::new(&settings)
        .map(Some)
        .map_err(|e| bad(e.to_string()))
}

/// Whom `tls` trusts to be the provider, as a credential lease binds it:
/// read from the client the provider calls go out on, so what the lease is
/// checked against is what the handshake will verify.
fn provider_trust(tls: Option<&UpstreamTls>) -> [u8; PROVIDER_TRUST_BYTES] {
    let trust = match tls {
        None => ProviderTrust::PlainHttp,
        Some(tls) if tls.is_insecure() => ProviderTrust::Unverified,
        Some(tls) => match tls.private_ca() {
            Some(certificates) => {
                ProviderTrust::PrivateCa(certificates.iter().map(|c| c.as_ref()).collect())
            }
            None => ProviderTrust::DefaultRoots,
        },
    };
    lease::provider_trust_digest(&trust)
}

/// The applied adapter set of a session.
#[derive(Debug, Default)]
pub struct Adapters {
    by_name: BTreeMap<String, Rc<AdapterInstance>>,
}

impl Adapters {
    /// Applies `payload`'s adapters (R3).
    pub fn from_payload(payload: &pb::NodeConfigPayload) -> Result<Self, AdapterConfigError> {
        Self::from_payload_reusing(payload, None)
    }

    /// Applies `payload`'s adapters for a config refresh (K3): an instance
    /// that keeps its name, kind and base URL keeps its capacity gate (with
    /// the new capacity), so requests in flight on the old instance still
    /// count against the one gate of that adapter instance (P4).
    pub fn from_payload_reusing(
        payload: &pb::NodeConfigPayload,
        previous: Option<&Adapters>,
    ) -> Result<Self, AdapterConfigError> {
        let mut by_name = BTreeMap::new();
        // Applied only once the whole payload is valid.
        let mut capacity_updates = Vec::new();
        for cfg in &payload.adapters {
            let (kind, base, profile) = match &cfg.kind {
                Some(pb::adapter_config::Kind::Ollama(o)) => {
                    (AdapterKind::Ollama, o.base_url.clone(), None)
                }
                Some(pb::adapter_config::Kind::OpenaiCompat(o)) => {
                    let profile = o
                        .protocol_profile
                        .clone()
                        .ok_or_else(|| AdapterConfigError::MissingProfile(cfg.name.clone()))?;
                    (
                        AdapterKind::OpenAiCompat,
                        profile.base_url.clone(),
                        Some(profile),
                    )
                }
                None => return Err(AdapterConfigError::MissingKind(cfg.name.clone())),
            };
            let name = if cfg.name.is_empty() {
                kind.type_name().to_string()
            } else {
                cfg.name.clone()
            };
            let base_url = Url::parse(&base).map_err(|e| AdapterConfigError::BadBaseUrl {
                name: name.clone(),
                url: base.clone(),
                reason: e.to_string(),
            })?;
            let tls = upstream_tls(&name, &base_url, cfg.tls.as_ref())?;
            let provider_trust = provider_trust(tls.as_ref());
            let reused = previous
                .and_then(|p| p.get(&name))
                .filter(|old| old.kind == kind && old.base_url == base_url)
                .map(|old| {
                    capacity_updates.push((old.gate.clone(), cfg.capacity));
                    old.gate.clone()
                });
            let instance = AdapterInstance {
                endpoint: Arc::new(Endpoint {
                    name: name.clone(),
                    kind,
                    base_url,
                    tls,
                    provider_trust,
                    profile,
                }),
                targets: cfg.targets.clone(),
                gate: reused.unwrap_or_else(|| CapacityGate::new(cfg.capacity)),
            };
            if by_name.insert(name.clone(), Rc::new(instance)).is_some() {
                return Err(AdapterConfigError::DuplicateName(name));
            }
        }
        for (gate, capacity) in capacity_updates {
            gate.set_capacity(capacity);
        }
        Ok(Self { by_name })
    }

    /// The instance named `name`.
    pub fn get(&self, name: &str) -> Option<&Rc<AdapterInstance>> {
        self.by_name.get(name)
    }

    /// All instances, by name.
    pub fn iter(&self) -> impl Iterator<Item = &Rc<AdapterInstance>> {
        self.by_name.values()
    }

    /// Number of instances.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Whether there is no instance.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> pb::ProtocolProfile {
        pb::ProtocolProfile {
            name: "vllm".into(),
            base_url: "http://127.0.0.1:8000/prefix".into(),
            models_path: "/v1/models".into(),
            chat_completions_path: "/v1/chat/completions".into(),
            messages_path: "/v1/messages".into(),
            count_tokens_path: "/v1/messages/count_tokens".into(),
            responses_path: "/v1/responses".into(),
            health_path: "/health".into(),
            auth_header_name: "Authorization".into(),
            auth_header_format: "Bearer {secret}".into(),
            ..Default::default()
        }
    }

    fn payload() -> pb::NodeConfigPayload {
        pb::NodeConfigPayload {
            adapters: vec![
                pb::AdapterConfig {
                    tls: None,
                    name: "vllm-main".into(),
                    capacity: 2,
                    targets: vec!["llama".into()],
                    kind: Some(pb::adapter_config::Kind::OpenaiCompat(
                        pb::OpenAiCompatAdapterConfig {
                            protocol_profile: Some(profile()),
                        },
                    )),
                },
                pb::AdapterConfig {
                    tls: None,
                    name: String::new(),
                    capacity: 0,
                    targets: vec![],
                    kind: Some(pb::adapter_config::Kind::Ollama(pb::OllamaAdapterConfig {
                        base_url: "http://127.0.0.1:11434".into(),
                    })),
                },
            ],
            ..Default::default()
        }
    }

    // CONTRACT: P4 — an empty adapter name means the type's name; each
    // instance has its own gate.
    #[test]
    fn applies_payload_with_default_names() {
        let adapters = Adapters::from_payload(&payload()).unwrap();
        let names: Vec<&str> = adapters.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(names, ["ollama", "vllm-main"]);
        assert_eq!(adapters.get("vllm-main").unwrap().gate.capacity(), 2);
        assert_eq!(adapters.get("ollama").unwrap().kind, AdapterKind::Ollama);
    }

    #[test]
    fn rejects_duplicates_and_missing_profiles() {
        let mut p = payload();
        p.adapters[1] = p.adapters[0].clone();
        assert_eq!(
            Adapters::from_payload(&p).unwrap_err(),
            AdapterConfigError::DuplicateName("vllm-main".into())
        );
        let mut p = payload();
        p.adapters[0].kind = Some(pb::adapter_config::Kind::OpenaiCompat(
            pb::OpenAiCompatAdapterConfig::default(),
        ));
        assert_eq!(
            Adapters::from_payload(&p).unwrap_err(),
            AdapterConfigError::MissingProfile("vllm-main".into())
        );
    }

    // CONTRACT: U3, U4 — the operation resolves through the pushed profile;
    // an empty operation falls back to the request path.
    #[test]
    fn tunnel_paths_follow_the_profile() {
        let adapters = Adapters::from_payload(&payload()).unwrap();
        let a = adapters.get("vllm-main").unwrap();
        assert_eq!(
            a.tunnel_path("chat_completions", "/ignored").unwrap(),
            "/prefix/v1/chat/completions"
        );
        assert_eq!(
            a.tunnel_path("count_tokens", "").unwrap(),
            "/prefix/v1/messages/count_tokens"
        );
        assert_eq!(
            a.tunnel_path("", "/v1/custom").unwrap(),
            "/prefix/v1/custom"
        );
        assert_eq!(
            a.tunnel_path("images", ""),
            Err(PathError::UnknownOperation("images".into()))
        );
        // A profile operation this profile has no path for.
        assert_eq!(
            a.tunnel_path("embeddings", ""),
            Err(PathError::NoPath("embeddings".into()))
        );
        assert_eq!(a.tunnel_path("", ""), Err(PathError::Empty));
    }

    #[test]
    fn https_adapters_get_a_tls_client_and_plain_ones_refuse_tls_settings() {
        let mut p = payload();
        let Some(pb::adapter_config::Kind::OpenaiCompat(o)) = &mut p.adapters[0].kind else {
            panic!("openai_compat first")
        };
        o.protocol_profile.as_mut().unwrap().base_url = "https://gw.internal:8443/prefix".into();
        let adapters = Adapters::from_payload(&p).unwrap();
        let a = adapters.get("vllm-main").unwrap();
        assert!(a.base_url.is_tls());
        let tls = a.tls.as_ref().expect("a TLS client");
        assert!(!tls.is_insecure());
        assert!(adapters.get("ollama").unwrap().tls.is_none());
        // The target carries the client: its connections are pooled apart.
        assert_eq!(a.target().tls, Some(tls));
        // A private CA and the dev switch arrive from the Edge.
        p.adapters[0].tls = Some(pb::ProviderTlsConfig {
            ca_pem: String::new(),
            insecure_skip_verify: true,
        });
        let adapters = Adapters::from_payload(&p).unwrap();
        assert!(adapters
            .get("vllm-main")
            .unwrap()
            .tls
            .as_ref()
            .unwrap()
            .is_insecure());
        p.adapters[0].tls = Some(pb::ProviderTlsConfig {
            ca_pem: "not PEM".into(),
            insecure_skip_verify: false,
        });
        assert_eq!(
            Adapters::from_payload(&p).unwrap_err(),
            AdapterConfigError::BadTls {
                name: "vllm-main".into(),
                reason: "<ca_pem>: no certificate found".into(),
            }
        );
        // TLS settings for a plain-http adapter are refused.
        let mut p = payload();
        p.adapters[1].tls = Some(pb::ProviderTlsConfig::default());
        assert_eq!(
            Adapters::from_payload(&p).unwrap_err().to_string(),
            "adapter `ollama`: provider TLS: TLS settings for the plain-http base URL \
             http://127.0.0.1:11434"
        );
    }

    // CONTRACT: C2, C5 — the provider trust a lease must be bound to is read
    // from the TLS client the adapter's calls go out on: plain HTTP, the
    // default roots, exactly the pushed CA set (whatever its order or the
    // text around its blocks), or no verification — each a different value.
    #[test]
    fn provider_trust_is_read_from_the_built_client() {
        use iop_engine::certs::DevCa;
        use iop_wire::lease::provider_trust_digest;

        let ca_a = DevCa::new("provider.test").unwrap().cert_pem();
        let ca_b = DevCa::new("provider.test").unwrap().cert_pem();
        let der = |pem: &str| {
            UpstreamTlsSettings {
                ca_pem: Some(pem.to_owned()),
                insecure_skip_verify: false,
            }
            .private_ca_certificates()
            .unwrap()
            .unwrap()
        };
        let (der_a, der_b) = (der(&ca_a), der(&ca_b));
        let trust_of = |tls: Option<pb::ProviderTlsConfig>| {
            let mut p = payload();
            let Some(pb::adapter_config::Kind::OpenaiCompat(o)) = &mut p.adapters[0].kind else {
                panic!("openai_compat first")
            };
            o.protocol_profile.as_mut().unwrap().base_url = "https://gw.internal:8443".into();
            p.adapters[0].tls = tls;
            let adapters = Adapters::from_payload(&p).unwrap();
            assert_eq!(
                adapters.get("ollama").unwrap().provider_trust,
                provider_trust_digest(&ProviderTrust::PlainHttp)
            );
            adapters.get("vllm-main").unwrap().provider_trust
        };
        let ca = |ca_pem: String| {
            Some(pb::ProviderTlsConfig {
                ca_pem,
                insecure_skip_verify: false,
            })
        };
        assert_eq!(
            trust_of(None),
            provider_trust_digest(&ProviderTrust::DefaultRoots)
        );
        assert_eq!(
            trust_of(ca(ca_a.clone())),
            provider_trust_digest(&ProviderTrust::PrivateCa(vec![der_a[0].as_ref()]))
        );
        assert_ne!(trust_of(ca(ca_a.clone())), trust_of(ca(ca_b.clone())));
        let both = trust_of(ca(format!("{ca_a}{ca_b}")));
        assert_eq!(
            both,
            provider_trust_digest(&ProviderTrust::PrivateCa(vec![
                der_a[0].as_ref(),
                der_b[0].as_ref()
            ]))
        );
        assert_eq!(
            trust_of(ca(format!("# bundle\n\n{ca_b}\n\n{ca_a}\n"))),
            both
        );
        assert_eq!(
            trust_of(Some(pb::ProviderTlsConfig {
                ca_pem: String::new(),
                insecure_skip_verify: true,
            })),
            provider_trust_digest(&ProviderTrust::Unverified)
        );
    }

    #[test]
    fn capacity_gate_admits_up_to_capacity_and_frees_on_drop() {
        let gate = CapacityGate::new(2);
        let a = gate.try_acquire().unwrap();
        let _b = gate.try_acquire().unwrap();
        assert!(gate.try_acquire().is_none());
        drop(a);
        assert_eq!(gate.in_flight(), 1);
        assert!(gate.try_acquire().is_some());
        let unlimited = CapacityGate::new(0);
        let permits: Vec<_> = (0..100).filter_map(|_| unlimited.try_acquire()).collect();
        assert_eq!(permits.len(), 100);
    }
}
