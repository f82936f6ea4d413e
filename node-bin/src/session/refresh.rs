//! Config refresh (K3): a pure decision about a `NodeConfigRefreshRequest`.
//!
//! | change | outcome |
//! |---|---|
//! | invalid payload (adapters or runtime) | `FAILED` with the reason; the old config stays |
//! | revision older than the one in effect | `FAILED` (stale) |
//! | `credential_leases_required` flips | `RESTART_REQUIRED`: the credential mode is fixed for a session (C3); it takes effect on the next registration |
//! | anything else — adapters added, removed or changed, capacities, targets, profiles, runtime watchdog settings | `APPLIED` at once |
//!
//! Applied means: requests that arrive after the refresh use the new adapter
//! set and settings; requests in flight keep the adapter instance they
//! started with. An instance that keeps its name, kind and base URL keeps
//! its one capacity gate (with the new capacity), so in-flight requests still
//! count against it (P4).

use iop_wire::pb;

use crate::adapters::Adapters;
use crate::attempt::watchdog::RuntimeSettings;

/// What to do with a refresh.
#[derive(Debug)]
pub enum RefreshDecision {
    /// Swap in the new adapters, settings and payload.
    Apply {
        /// The new adapter set (gates carried over where the instance
        /// stays).
        adapters: Adapters,
        /// The new runtime settings.
        settings: RuntimeSettings,
        /// The payload now in effect.
        payload: pb::NodeConfigPayload,
    },
    /// Valid, but only a new session can apply it.
    RestartRequired(String),
    /// Refused; the old config stays.
    Failed(String),
}

impl RefreshDecision {
    /// The wire status.
    pub fn status(&self) -> pb::RefreshStatus {
        match self {
            RefreshDecision::Apply { .. } => pb::RefreshStatus::Applied,
            RefreshDecision::RestartRequired(_) => pb::RefreshStatus::RestartRequired,
            RefreshDecision::Failed(_) => pb::RefreshStatus::Failed,
        }
    }

    /// The response to `refresh_id`.
    pub fn response(&self, refresh_id: &str) -> pb::NodeConfigRefreshResponse {
        let reason = match self {
            RefreshDecision::Apply { .. } => String::new(),
            RefreshDecision::RestartRequired(r) | RefreshDecision::Failed(r) => r.clone(),
        };
        pb::NodeConfigRefreshResponse {
            refresh_id: refresh_id.to_string(),
            status: self.status() as i32,
            reason,
        }
    }
}

/// Decides a refresh of `current` (with its applied `adapters`) to `new`.
/// Only an `Apply` decision touches the current gates (their capacities).
pub fn decide(
    current: &pb::NodeConfigPayload,
    adapters: &Adapters,
    new: Option<&pb::NodeConfigPayload>,
) -> RefreshDecision {
    let Some(new) = new else {
        return RefreshDecision::Failed("the refresh carries no config".into());
    };
    let settings = match RuntimeSettings::from_pb(new.runtime.as_ref()) {
        Ok(s) => s,
        Err(e) => return RefreshDecision::Failed(e.to_string()),
    };
    // Validate on fresh gates first: a refused refresh changes nothing.
    if let Err(e) = Adapters::from_payload(new) {
        return RefreshDecision::Failed(e.to_string());
    }
    if new.revision != 0 && new.revision < current.revision {
        return RefreshDecision::Failed(format!(
            "stale revision {} (revision {} is in effect)",
            new.revision, current.revision
        ));
    }
    if new.credential_leases_required != current.credential_leases_required {
        return RefreshDecision::RestartRequired(
            "credential_leases_required changed; the credential mode applies from the next registration"
                .into(),
        );
    }
    match Adapters::from_payload_reusing(new, Some(adapters)) {
        Ok(adapters) => RefreshDecision::Apply {
            adapters,
            settings,
            payload: new.clone(),
        },
        Err(e) => RefreshDecision::Failed(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use super::*;

    fn adapter(name: &str, capacity: u32, base: &str) -> pb::AdapterConfig {
        pb::AdapterConfig {
            tls: None,
            name: name.into(),
            capacity,
            targets: vec!["m".into()],
            kind: Some(pb::adapter_config::Kind::OpenaiCompat(
                pb::OpenAiCompatAdapterConfig {
                    protocol_profile: Some(pb::ProtocolProfile {
                        base_url: base.into(),
                        chat_completions_path: "/v1/chat/completions".into(),
                        ..Default::default()
                    }),
                },
            )),
        }
    }

    fn payload(revision: u64, adapters: Vec<pb::AdapterConfig>) -> pb::NodeConfigPayload {
        pb::NodeConfigPayload {
            runtime: Some(pb::NodeRuntimeConfig::default()),
            adapters,
            revision,
            credential_leases_required: false,
            revoked_credentials: Vec::new(),
        }
    }

    // CONTRACT: K3, P4 — a valid refresh is applied; an instance that stays
    // keeps its gate (new capacity, in-flight slots still counted); a new
    // instance gets a fresh gate; the old set is untouched for in-flight
    // requests.
    #[test]
    fn applied_refresh_keeps_the_gate_of_a_staying_instance() {
        let old_payload = payload(
            1,
            vec![
                adapter("a", 2, "http://127.0.0.1:1"),
                adapter("b", 1, "http://127.0.0.1:2"),
            ],
        );
        let old = Adapters::from_payload(&old_payload).unwrap();
        let old_a: Rc<_> = old.get("a").unwrap().clone();
        let held = old_a.gate.try_acquire().unwrap();
        let new_payload = payload(
            2,
            vec![
                adapter("a", 5, "http://127.0.0.1:1"),
                adapter("b", 1, "http://127.0.0.1:3"),
                adapter("c", 1, "http://127.0.0.1:4"),
            ],
        );
        let decision = decide(&old_payload, &old, Some(&new_payload));
        assert_eq!(decision.status(), pb::RefreshStatus::Applied);
        assert_eq!(
            decision.response("r-1"),
            pb::NodeConfigRefreshResponse {
                refresh_id: "r-1".into(),
                status: pb::RefreshStatus::Applied as i32,
                reason: String::new(),
            }
        );
        let RefreshDecision::Apply { adapters, .. } = decision else {
            unreachable!()
        };
        let new_a = adapters.get("a").unwrap();
        assert!(
            Rc::ptr_eq(&new_a.gate, &old_a.gate),
            "same instance, same gate"
        );
        assert_eq!(new_a.gate.capacity(), 5);
        assert_eq!(new_a.gate.in_flight(), 1, "the in-flight slot still counts");
        let new_b = adapters.get("b").unwrap();
        assert!(!Rc::ptr_eq(&new_b.gate, &old.get("b").unwrap().gate));
        assert_eq!(adapters.len(), 3);
        assert_eq!(old.len(), 2, "in-flight requests keep the old set");
        drop(held);
        assert_eq!(new_a.gate.in_flight(), 0);
    }

    // CONTRACT: K3 — invalid, stale and empty refreshes fail and change
    // nothing; flipping the credential mode needs a restart.
    #[test]
    fn failed_and_restart_required() {
        let old_payload = payload(3, vec![adapter("a", 2, "http://127.0.0.1:1")]);
        let old = Adapters::from_payload(&old_payload).unwrap();
        let mut dup = payload(4, vec![adapter("a", 9, "http://127.0.0.1:1")]);
        dup.adapters.push(adapter("a", 9, "http://127.0.0.1:1"));
        let d = decide(&old_payload, &old, Some(&dup));
        assert_eq!(d.status(), pb::RefreshStatus::Failed);
        assert_eq!(d.response("r").reason, "adapter name `a` is used twice");
        assert_eq!(old.get("a").unwrap().gate.capacity(), 2, "unchanged");

        let mut bad_runtime = payload(4, vec![adapter("a", 9, "http://127.0.0.1:1")]);
        bad_runtime.runtime = Some(pb::NodeRuntimeConfig {
            probe_timeout_ms: -1,
            ..Default::default()
        });
        let d = decide(&old_payload, &old, Some(&bad_runtime));
        assert_eq!(
            d.response("r").reason,
            "runtime.probe_timeout_ms: -1 is outside 0..=600000 ms"
        );

        let stale = payload(2, vec![adapter("a", 9, "http://127.0.0.1:1")]);
        let d = decide(&old_payload, &old, Some(&stale));
        assert_eq!(
            d.response("r").reason,
            "stale revision 2 (revision 3 is in effect)"
        );
        assert_eq!(old.get("a").unwrap().gate.capacity(), 2, "unchanged");

        let d = decide(&old_payload, &old, None);
        assert_eq!(d.status(), pb::RefreshStatus::Failed);

        let mut managed = payload(4, vec![adapter("a", 9, "http://127.0.0.1:1")]);
        managed.credential_leases_required = true;
        let d = decide(&old_payload, &old, Some(&managed));
        assert_eq!(d.status(), pb::RefreshStatus::RestartRequired);
        assert_eq!(old.get("a").unwrap().gate.capacity(), 2, "unchanged");
    }
}
