//! Seeded simulation of the queue discipline ([`edge_bin::control::fair`])
//! through [`Control`] itself: keys of random classes and weights flood and
//! trickle into one saturated model while slots free at random, and every
//! admission is checked against two properties.
//!
//! - **No starvation.** While a class waits, at most [`MIN_SHARE_EVERY`] − 1
//!   admissions in a row go to classes above it, plus one for each other
//!   class that is due at the same time.
//! - **Shares within a bound of the weights** (start-time fair queueing's
//!   fairness bound): for two keys of one class, over any stretch in which
//!   both are backlogged, the tokens admitted to each divided by its weight
//!   differ by at most `c_i/w_i + c_j/w_j`, their largest costs over their
//!   weights.
//!
//! Also checked: each request is admitted once, and one key's requests of
//! one class in arrival order. (Queue timeouts, cancels and one terminal per
//! request under random shares are the work of `control_sim.rs`, which draws
//! shares too; this simulation has neither, so that service alone moves the
//! keys' shares.)
//!
//! A failure prints its seed; `IOP_SIM_SEED=<seed>` replays that schedule.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use edge_bin::control::fair::{Share, MIN_SHARE_EVERY};
use edge_bin::control::prefix::PrefixTreeSpec;
use edge_bin::control::{
    Action, AttemptEnd, ConnId, Control, ControlModel, ControlNode, ControlProvider, ControlSpec,
    DispatchKind, Input, Operation, Operations, Outcome, ProviderKey, RequestId, RouteHint,
    RoutingPolicy, RoutingSpec, Terminal, Tunables,
};
use iop_wire::pb;

// Shared with the other simulations, which use all of it.
#[allow(dead_code)]
mod sim_rng;
use sim_rng::Rng;

const SCHEDULES: u64 = 100;
const STEPS: usize = 600;
const CONN: ConnId = ConnId(1);
const CLASSES: [u8; 3] = [10, 50, 90];

fn spec(capacity: u32) -> ControlSpec {
    ControlSpec {
        nodes: vec![ControlNode {
            id: "n1".into(),
            config: pb::NodeConfigPayload::default(),
            providers: vec![ControlProvider {
                id: "p1".into(),
                adapter: "a".into(),
                target: "t".into(),
                capacity,
                long_context_capacity: 0,
                response_stall_timeout_ms: 0,
                category: pb::ProviderCategory::LocalInference,
                kind: DispatchKind::Tunnel,
                operations: Operations::for_kind(DispatchKind::Tunnel),
                enabled: true,
            }],
        }],
        models: vec![ControlModel {
            name: "m".into(),
            providers: vec![ProviderKey {
                node_id: "n1".into(),
                provider_id: "p1".into(),
            }],
            max_queue: 100_000,
            queue_timeout: Duration::from_secs(86_400),
            max_attempts: 1,
            routing: RoutingSpec {
                policy: RoutingPolicy::LeastLoaded,
                tree: PrefixTreeSpec {
                    budget_bytes: 1 << 16,
                    prefix_bytes_max: 64,
                },
                match_threshold_pct: 50,
                balance_abs_threshold: 2,
                balance_rel_threshold_pct: 150,
                affinity_wait: Duration::ZERO,
            },
        }],
        tunables: Tunables::default(),
    }
}

#[derive(Debug, Clone, Copy)]
struct Key {
    class: u8,
    weight: u32,
    max_cost: u64,
}

struct Sim {
    rng: Rng,
    control: Control,
    now: Instant,
    keys: Vec<Key>,
    next: u64,
    /// Queued requests: (key, cost), by id.
    queued: BTreeMap<RequestId, (usize, u64)>,
    /// Dispatched and running, oldest first.
    running: VecDeque<RequestId>,
    admitted: BTreeSet<RequestId>,
    /// Per key, its queued requests.
    backlog: Vec<usize>,
    /// Per waiting class, admissions in a row to classes above it.
    passed_over: BTreeMap<u8, u32>,
    /// Per key: tokens admitted / weight since the pair became backlogged,
    /// for every pair of one class: (i, j) → (normalized i, normalized j).
    pairs: BTreeMap<(usize, usize), (f64, f64)>,
    admissions: u64,
}

impl Sim {
    fn new(seed: u64) -> Self {
        let mut rng = Rng(seed);
        let capacity = rng.range(1, 4) as u32;
        let keys: Vec<Key> = (0..rng.range(2, 4))
            .map(|_| Key {
                class: CLASSES[rng.below(3) as usize],
                weight: rng.range(1, 4) as u32,
                max_cost: rng.range(1, 3_000),
            })
            .collect();
        let mut control = Control::new(spec(capacity));
        let now = iop_engine::clock::now();
        let mut out = Vec::new();
        control.handle(
            now,
            Input::Register {
                conn: CONN,
                tls_name: "n1".into(),
                node_id: "n1".into(),
            },
            &mut out,
        );
        control.handle(
            now,
            Input::Ready {
                conn: CONN,
                node_id: "n1".into(),
            },
            &mut out,
        );
        let backlog = vec![0; keys.len()];
        Self {
            rng,
            control,
            now,
            keys,
            next: 0,
            queued: BTreeMap::new(),
            running: VecDeque::new(),
            admitted: BTreeSet::new(),
            backlog,
            passed_over: BTreeMap::new(),
            pairs: BTreeMap::new(),
            admissions: 0,
        }
    }

    fn handle(&mut self, input: Input) -> Result<(), String> {
        self.now += Duration::from_millis(1);
        let mut out = Vec::new();
        self.control.handle(self.now, input, &mut out);
        for action in out {
            match action {
                Action::Dispatch(d) => self.on_admitted(d.request)?,
                // Only an answered request ends: none is refused, cancelled
                // or timed out here.
                Action::Done {
                    outcome: Outcome::Completed,
                    ..
                } => {}
                Action::Done { request, outcome } => {
                    return Err(format!("{request:?} ended unexpectedly: {outcome:?}"))
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn backlogged(&self, key: usize) -> bool {
        self.backlog[key] > 0
    }

    fn class_waits(&self, class: u8) -> bool {
        (0..self.keys.len()).any(|k| self.keys[k].class == class && self.backlog[k] > 0)
    }

    fn on_admitted(&mut self, request: RequestId) -> Result<(), String> {
        if !self.admitted.insert(request) {
            return Err(format!("{request:?} admitted twice"));
        }
        self.admissions += 1;
        self.running.push_back(request);
        // A new arrival that found a free slot was never queued.
        let Some((key, cost)) = self.queued.get(&request).copied() else {
            return Ok(());
        };
        let class = self.keys[key].class;
        // One key's requests of one class, in arrival order.
        if let Some((earlier, _)) = self.queued.range(..request).find(|(_, &(k, _))| k == key) {
            return Err(format!(
                "{request:?} of key {key} admitted while its earlier {earlier:?} waits"
            ));
        }
        self.queued.remove(&request);
        self.backlog[key] -= 1;
        // No starvation.
        self.passed_over.remove(&class);
        let classes: BTreeSet<u8> = self.keys.iter().map(|k| k.class).collect();
        let allowed = MIN_SHARE_EVERY - 1 + (classes.len() as u32 - 1);
        for &lower in classes.range(..class) {
            if !self.class_waits(lower) {
                self.passed_over.remove(&lower);
                continue;
            }
            let passed = self.passed_over.entry(lower).or_insert(0);
            *passed += 1;
            if *passed > allowed {
                return Err(format!(
                    "class {lower} waits while {passed} admissions in a row went above it"
                ));
            }
        }
        // Shares: the pairs of its class that are both backlogged.
        for (&(i, j), served) in self.pairs.iter_mut() {
            if i == key {
                served.0 += cost as f64 / f64::from(self.keys[i].weight);
            } else if j == key {
                served.1 += cost as f64 / f64::from(self.keys[j].weight);
            } else {
                continue;
            }
            let bound = self.keys[i].max_cost as f64 / f64::from(self.keys[i].weight)
                + self.keys[j].max_cost as f64 / f64::from(self.keys[j].weight);
            if (served.0 - served.1).abs() > bound + 1e-6 {
                return Err(format!(
                    "keys {i} and {j} ({:?}, {:?}): normalized service {:.1} and {:.1} differ \
                     by more than {bound:.1}",
                    self.keys[i], self.keys[j], served.0, served.1
                ));
            }
        }
        self.refresh_pairs();
        Ok(())
    }

    /// Pairs of one class that are both backlogged are tracked; a pair
    /// stops being tracked (its stretch ends) when either drains.
    fn refresh_pairs(&mut self) {
        let n = self.keys.len();
        for i in 0..n {
            for j in i + 1..n {
                let same = self.keys[i].class == self.keys[j].class;
                let both = same && self.backlogged(i) && self.backlogged(j);
                match (both, self.pairs.contains_key(&(i, j))) {
                    (true, false) => {
                        self.pairs.insert((i, j), (0.0, 0.0));
                    }
                    (false, true) => {
                        self.pairs.remove(&(i, j));
                    }
                    _ => {}
                }
            }
        }
    }

    fn submit(&mut self, key: usize) -> Result<(), String> {
        self.next += 1;
        let request = RequestId(self.next);
        let k = self.keys[key];
        let cost = self.rng.range(1, k.max_cost);
        self.queued.insert(request, (key, cost));
        self.backlog[key] += 1;
        self.refresh_pairs();
        self.handle(Input::Submit {
            request,
            model: "m".into(),
            operation: Operation::ChatCompletions,
            long: false,
            hint: RouteHint::default(),
            share: Share {
                principal: key as u64,
                class: k.class,
                weight: k.weight,
                cost,
            },
        })
    }

    fn finish_oldest(&mut self) -> Result<(), String> {
        let Some(request) = self.running.pop_front() else {
            return Ok(());
        };
        let lease = self
            .control
            .leases()
            .find(|l| l.request == request)
            .ok_or_else(|| format!("{request:?} runs without a lease"))?
            .clone();
        self.handle(Input::Terminal(Terminal {
            conn: lease.conn,
            run_id: lease.run_id.clone(),
            adapter: lease.adapter.to_string(),
            target: lease.target.to_string(),
            stall: None,
            end: AttemptEnd::Answered,
            committed: true,
        }))
    }

    fn step(&mut self) -> Result<(), String> {
        match self.rng.below(100) {
            // A flood: one key sends a burst.
            0..=7 => {
                let key = self.rng.below(self.keys.len() as u64) as usize;
                for _ in 0..self.rng.range(5, 20) {
                    self.submit(key)?;
                }
                Ok(())
            }
            8..=37 => {
                let key = self.rng.below(self.keys.len() as u64) as usize;
                self.submit(key)
            }
            _ => self.finish_oldest(),
        }
    }
}

fn run(seed: u64) -> Result<u64, String> {
    let mut sim = Sim::new(seed);
    for step in 0..STEPS {
        sim.step().map_err(|e| format!("step {step}: {e}"))?;
    }
    // Drain: every queued request is admitted in the end.
    while !sim.running.is_empty() {
        sim.finish_oldest()?;
    }
    if !sim.queued.is_empty() {
        return Err(format!("{} requests never admitted", sim.queued.len()));
    }
    Ok(sim.admissions)
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[test]
fn fair_queueing_keeps_its_bounds_in_every_schedule() {
    if let Some(seed) = env_u64("IOP_SIM_SEED") {
        match run(seed) {
            Ok(n) => return println!("control_fair_sim: seed {seed} passed, {n} admissions"),
            Err(e) => panic!("control_fair_sim: seed {seed} failed: {e}"),
        }
    }
    let base = env_u64("IOP_SIM_BASE_SEED").unwrap_or(0x6a1e_5eed);
    println!("control_fair_sim: base seed {base:#x} (IOP_SIM_BASE_SEED), {SCHEDULES} schedules");
    let mut admissions = 0;
    for i in 0..SCHEDULES {
        let seed = base.wrapping_add(i);
        match run(seed) {
            Ok(n) => admissions += n,
            Err(e) => panic!(
                "control_fair_sim: seed {seed} failed: {e}\n\
                 replay with: IOP_SIM_SEED={seed} cargo test -p edge-bin --test control_fair_sim -- --nocapture"
            ),
        }
    }
    println!("control_fair_sim: {SCHEDULES} schedules, {admissions} admissions");
}
