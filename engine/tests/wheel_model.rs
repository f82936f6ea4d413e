//! `iop_engine::wheel::Wheel` against a reference model: a
//! `BTreeMap<(deadline, insertion seq), value>` that fires every entry with
//! deadline ≤ now in key order.

use std::collections::{BTreeMap, HashMap};

use iop_engine::wheel::{TimerHandle, Wheel, RANGE_TICKS};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    /// Insert at `now + ahead` (saturating).
    Insert { ahead: u64 },
    /// Insert at `now - behind` (saturating): a past deadline.
    InsertPast { behind: u64 },
    /// Cancel one of every handle ever issued, live or stale.
    Cancel { pick: usize },
    /// Advance by `jump` and drain everything due.
    Advance { jump: u64 },
    /// Advance by `jump` but take only the first due timer.
    PollOne { jump: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => prop_oneof![
            0u64..70,
            0u64..5_000,
            0u64..300_000,
            0u64..(1 << 30),
            (RANGE_TICKS - 100)..(RANGE_TICKS + 100),
            0u64..(1 << 40),
            Just(u64::MAX),
        ]
        .prop_map(|ahead| Op::Insert { ahead }),
        1 => (0u64..200).prop_map(|behind| Op::InsertPast { behind }),
        3 => any::<usize>().prop_map(|pick| Op::Cancel { pick }),
        3 => prop_oneof![
            0u64..3,
            0u64..70,
            0u64..5_000,
            0u64..400_000,
            0u64..(1 << 31),
            0u64..(1 << 38),
        ]
        .prop_map(|jump| Op::Advance { jump }),
        1 => (0u64..100).prop_map(|jump| Op::PollOne { jump }),
    ]
}

#[derive(Default)]
struct Model {
    pending: BTreeMap<(u64, u64), u32>,
    key_of: HashMap<TimerHandle, (u64, u64)>,
    seq: u64,
}

impl Model {
    fn insert(&mut self, handle: TimerHandle, deadline_tick: u64, value: u32) {
        let key = (deadline_tick, self.seq);
        self.seq += 1;
        self.pending.insert(key, value);
        self.key_of.insert(handle, key);
    }

    fn cancel(&mut self, handle: TimerHandle) -> Option<u32> {
        let key = self.key_of.remove(&handle)?;
        self.pending.remove(&key)
    }

    fn pop_due(&mut self, now_tick: u64) -> Option<(u64, u32)> {
        let (&key, _) = self.pending.first_key_value()?;
        if key.0 > now_tick {
            return None;
        }
        let value = self.pending.remove(&key)?;
        self.key_of.retain(|_, k| *k != key);
        Some((key.0, value))
    }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut wheel: Wheel<u32> = Wheel::new();
    let mut model = Model::default();
    let mut handles: Vec<TimerHandle> = Vec::new();
    let mut now_tick = 0u64;
    let mut next_value = 0u32;
    for op in ops {
        match op {
            Op::Insert { .. } | Op::InsertPast { .. } => {
                let deadline_tick = match op {
                    Op::Insert { ahead } => now_tick.saturating_add(ahead),
                    Op::InsertPast { behind } => now_tick.saturating_sub(behind),
                    _ => unreachable!(),
                };
                let handle = wheel.insert(deadline_tick, next_value);
                model.insert(handle, deadline_tick, next_value);
                handles.push(handle);
                next_value += 1;
            }
            Op::Cancel { pick } => {
                if let Some(&handle) = handles.get(pick % handles.len().max(1)) {
                    prop_assert_eq!(wheel.cancel(handle), model.cancel(handle));
                }
            }
            Op::Advance { jump } => {
                now_tick = now_tick.saturating_add(jump);
                let fired: Vec<(u64, u32)> = wheel
                    .drain_expired(now_tick)
                    .into_iter()
                    .map(|e| (e.deadline_tick, e.value))
                    .collect();
                let mut expected = Vec::new();
                while let Some(due) = model.pop_due(now_tick) {
                    expected.push(due);
                }
                prop_assert_eq!(fired, expected, "advance to {}", now_tick);
            }
            Op::PollOne { jump } => {
                now_tick = now_tick.saturating_add(jump);
                let fired = wheel
                    .poll_expired(now_tick)
                    .map(|e| (e.deadline_tick, e.value));
                prop_assert_eq!(fired, model.pop_due(now_tick), "poll at {}", now_tick);
            }
        }
        prop_assert_eq!(wheel.len(), model.pending.len());
        prop_assert_eq!(wheel.is_empty(), model.pending.is_empty());
        let true_next = model.pending.first_key_value().map(|(k, _)| k.0);
        match (wheel.next_deadline(), true_next) {
            (None, None) => {}
            (Some(bound), Some(next)) => prop_assert!(
                bound <= next,
                "next_deadline {} later than the true next expiry {}",
                bound,
                next
            ),
            (got, want) => prop_assert!(false, "next_deadline {:?}, model {:?}", got, want),
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    /// Fired sets and order, cancel results, len and the next-deadline bound
    /// match the reference model after every operation.
    #[test]
    fn wheel_matches_reference_model(ops in proptest::collection::vec(op(), 1..300)) {
        run(ops)?;
    }
}

#[test]
fn wheel_model_check_dense_same_tick_and_boundary_deadlines() {
    // A fixed, dense scenario the random search may miss: many ties on level
    // boundaries, interleaved cancels and one-tick steps.
    let mut ops = Vec::new();
    for round in 0..40u64 {
        for ahead in [0, 1, 63, 64, 65, 4095, 4096, 4097, 262_143, 262_144] {
            ops.push(Op::Insert {
                ahead: ahead + round % 3,
            });
        }
        ops.push(Op::Cancel {
            pick: (round * 7) as usize,
        });
        ops.push(Op::Advance { jump: round * 97 });
        ops.push(Op::PollOne { jump: 1 });
    }
    ops.push(Op::Advance { jump: 1 << 20 });
    if let Err(failure) = run(ops) {
        panic!("{failure}");
    }
}
