//! Provider health: passive health (outlier detection: failures held
//! against a provider, ejections and re-admissions), the runtime
//! unavailable overlay set by validated stall evidence (H4) and cleared by
//! CAPABILITIES recovery probes (H6).

use std::time::Instant;

use iop_wire::pb;

use super::outlier::{OutlierPolicy, Readmission};
use super::tables::CommandRecord;
use super::{Action, AttemptEnd, ConnId, Control, Event, Generation, ProviderKey};

impl Control {
    // ---- recovery probe timers -----------------------------------------------

    /// Sets when provider `p`'s next recovery probe is due.
    pub(super) fn set_next_probe(&mut self, p: usize, at: Option<Instant>) {
        if let Some(old) = self.providers[p].next_probe {
            self.probe_deadlines.remove(&(old, p));
        }
        self.providers[p].next_probe = at;
        if let Some(at) = at {
            self.probe_deadlines.insert((at, p));
        }
    }

    /// Clears provider `p`'s overlay, sequence and probe (F3, H5).
    pub(super) fn reset_health(&mut self, p: usize) {
        self.providers[p].reset_health();
        self.set_next_probe(p, None);
    }

    // ---- passive health (outlier detection) ----------------------------------

    /// Holds how an attempt on provider `p` ended against its health: a
    /// success starts its failure count over, a failure may eject it.
    pub(super) fn record_end(
        &mut self,
        now: Instant,
        p: usize,
        end: AttemptEnd,
        out: &mut Vec<Action>,
    ) {
        let reason = match end {
            AttemptEnd::Answered => return self.providers[p].outlier.on_success(),
            AttemptEnd::Failed(reason) => reason,
            AttemptEnd::Refused | AttemptEnd::Other => return,
        };
        self.counters.attempt_failures[reason as usize] += 1;
        let Some(policy) = self.tunables.outlier else {
            return;
        };
        if !self.providers[p].outlier.on_failure(&policy) {
            return;
        }
        if !self.may_eject(p, &policy) {
            self.counters.ejections_suppressed += 1;
            return;
        }
        let state = &mut self.providers[p];
        let ejection = state.outlier.eject(now, reason, &policy);
        let consecutive_failures = state.outlier.consecutive_failures();
        let provider = state.key.clone();
        self.ejection_deadlines.insert((ejection.until, p));
        self.counters.ejections[reason as usize] += 1;
        if self.providers[p].next_probe.is_none() {
            // Probed meanwhile: a fresh `available` answer re-admits early.
            self.set_next_probe(p, Some(now + self.tunables.recovery_probe_interval));
        }
        self.refresh(p);
        // An engine that fails may have lost its cache: its prefixes go.
        let requeued = self.forget_routes(p);
        out.push(Action::Event(Event::Ejected {
            provider,
            ejection,
            consecutive_failures,
        }));
        if requeued {
            self.pump(out);
        }
    }

    /// Whether ejecting provider `p` keeps every model it serves within
    /// `max_ejection_percent` of its providers ejected (at least one may
    /// go).
    fn may_eject(&self, p: usize, policy: &OutlierPolicy) -> bool {
        let mut models: Vec<usize> = self.providers[p]
            .pools
            .iter()
            .map(|&(lane, _)| self.lanes[lane].model)
            .collect();
        models.sort_unstable();
        models.dedup();
        models.iter().all(|&m| {
            let pool: Vec<usize> = self.models[m]
                .spec
                .providers
                .iter()
                .filter_map(|key| self.provider_index.get(key).copied())
                .collect();
            let ejected = pool
                .iter()
                .filter(|&&q| self.providers[q].outlier.ejection().is_some())
                .count();
            ejected < policy.max_ejected(pool.len())
        })
    }

    /// Takes ejected provider `p` back into rotation.
    pub(super) fn readmit(
        &mut self,
        now: Instant,
        p: usize,
        via: Readmission,
        out: &mut Vec<Action>,
    ) {
        let state = &mut self.providers[p];
        let Some(ended) = state.outlier.readmit(now) else {
            return;
        };
        let provider = state.key.clone();
        self.ejection_deadlines.remove(&(ended.until, p));
        match via {
            Readmission::Timer => self.counters.readmissions_timer += 1,
            Readmission::Probe => self.counters.readmissions_probe += 1,
        }
        if !self.is_overlaid_index(p) {
            self.set_next_probe(p, None);
        }
        self.refresh(p);
        out.push(Action::Event(Event::Readmitted { provider, via }));
    }

    fn is_overlaid_index(&self, p: usize) -> bool {
        let state = &self.providers[p];
        self.nodes[state.node]
            .owner
            .is_some_and(|owner| state.overlay == Some(owner.generation))
    }

    // ---- the unavailable overlay (H4-H6) -------------------------------------

    /// Applies one validated health observation of `key` in `generation`:
    /// only a fresh (higher-sequence) `unavailable` sets the overlay (H4).
    pub(super) fn observe(
        &mut self,
        now: Instant,
        key: &ProviderKey,
        generation: Generation,
        seq: u64,
        health: pb::ProviderHealth,
        out: &mut Vec<Action>,
    ) {
        let interval = self.tunables.recovery_probe_interval;
        let Some(&p) = self.provider_index.get(key) else {
            return;
        };
        let state = &mut self.providers[p];
        if !state.is_fresh(generation, seq) {
            return;
        }
        state.last_seq = Some((generation, seq));
        if health == pb::ProviderHealth::Unavailable && state.overlay != Some(generation) {
            state.overlay = Some(generation);
            self.set_next_probe(p, Some(now + interval));
            self.refresh(p);
            self.counters.health_transitions_unavailable += 1;
            out.push(Action::Event(Event::HealthTransition {
                provider: key.clone(),
                unavailable: true,
            }));
        }
    }

    pub(super) fn send_recovery_probe(&mut self, now: Instant, p: usize, out: &mut Vec<Action>) {
        let interval = self.tunables.recovery_probe_interval;
        let state = &self.providers[p];
        match self.nodes[state.node].ready_owner() {
            Some(owner)
                if state.overlay == Some(owner.generation)
                    || state.outlier.ejection().is_some() =>
            {
                let key = state.key.clone();
                let adapter = state.spec.adapter.clone();
                self.set_next_probe(p, Some(now + interval));
                self.next_command += 1;
                let command_id = format!("recovery-{}", self.next_command);
                // At most one outstanding probe per provider: a node that
                // never answers cannot grow this table.
                self.commands.retain(|_, c| c.provider != key);
                self.commands.insert(
                    command_id.clone(),
                    CommandRecord {
                        node_id: key.node_id.to_string(),
                        provider: key,
                        conn: owner.conn,
                        generation: owner.generation,
                    },
                );
                out.push(Action::SendCommand {
                    conn: owner.conn,
                    command: pb::NodeCommandRequest {
                        command_id,
                        r#type: pb::CommandType::Capabilities as i32,
                        adapter: adapter.to_string(),
                        path: String::new(),
                    },
                });
            }
            _ => self.set_next_probe(p, None),
        }
    }

    /// H6: a CAPABILITIES answer clears an overlay only when a higher-sequence
    /// `available` answer identifies exactly one same-generation binding.
    /// The same answer re-admits that binding's provider if passive health
    /// ejected it.
    pub(super) fn on_command_result(
        &mut self,
        conn: ConnId,
        response: &pb::NodeCommandResponse,
        out: &mut Vec<Action>,
    ) {
        let now = self.now;
        match self.commands.get(&response.command_id) {
            Some(record) if record.conn == conn => {}
            // Unknown, or answered on another connection: stale (F2).
            _ => return,
        }
        let Some(record) = self.commands.remove(&response.command_id) else {
            return;
        };
        let Some(&n) = self.node_index.get(&record.node_id) else {
            return;
        };
        let current = self.nodes[n]
            .ready_owner()
            .is_some_and(|o| o.conn == record.conn && o.generation == record.generation);
        let mut recovered = false;
        let mut readmitted = false;
        if current && response.ok {
            for cap in &response.capabilities {
                if cap.provider_status != pb::ProviderHealth::Available as i32 {
                    continue;
                }
                let Some(seq) = cap.health_observation_seq else {
                    continue;
                };
                let matching = {
                    let mut it = self.nodes[n].providers.clone().filter(|&p| {
                        let spec = &self.providers[p].spec;
                        *spec.adapter == *cap.adapter_key && *spec.target == *cap.target
                    });
                    (it.next(), it.next())
                };
                let (Some(p), None) = matching else {
                    continue; // none, or ambiguous
                };
                let state = &mut self.providers[p];
                if !state.is_fresh(record.generation, seq) {
                    continue;
                }
                // A fresh available observation is recorded even when there is
                // no overlay to clear, so an older unavailable one arriving
                // later cannot set one (H4).
                state.last_seq = Some((record.generation, seq));
                if let (Some(now), Some(_)) = (now, state.outlier.ejection()) {
                    self.readmit(now, p, Readmission::Probe, out);
                    readmitted = true;
                }
                let state = &mut self.providers[p];
                if state.overlay != Some(record.generation) {
                    continue;
                }
                state.overlay = None;
                let key = state.key.clone();
                self.set_next_probe(p, None);
                self.refresh(p);
                recovered = true;
                self.counters.health_transitions_available += 1;
                out.push(Action::Event(Event::HealthTransition {
                    provider: key,
                    unavailable: false,
                }));
            }
        }
        if recovered {
            self.counters.recovery_probe_recovered += 1;
        } else {
            self.counters.recovery_probe_unchanged += 1;
        }
        if recovered || readmitted {
            self.pump(out);
        }
    }
}
