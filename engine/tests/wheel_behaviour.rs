//! Behaviour of `iop_engine::wheel`: exact firing ticks, cascades across level
//! boundaries, cancel, stale handles, past and far-future deadlines, tick
//! conversions.

use std::time::Duration;

use iop_engine::clock;
use iop_engine::wheel::{
    bench_report, Expired, TickError, TickLength, TickScale, TimerHandle, Wheel, RANGE_TICKS,
};

/// `(deadline_tick, value)` of every timer due at `now_tick`, in firing order.
fn fire(wheel: &mut Wheel<u32>, now_tick: u64) -> Vec<(u64, u32)> {
    wheel
        .drain_expired(now_tick)
        .into_iter()
        .map(|e| (e.deadline_tick, e.value))
        .collect()
}

#[test]
fn wheel_fires_exactly_at_deadline_not_before() {
    for deadline in [
        1u64,
        5,
        63,
        64,
        65,
        127,
        4095,
        4096,
        4097,
        262_143,
        262_144,
        1 << 30,
    ] {
        let mut wheel = Wheel::new();
        wheel.insert(deadline, 7u32);
        assert_eq!(
            fire(&mut wheel, deadline - 1),
            vec![],
            "deadline {deadline}"
        );
        assert_eq!(wheel.len(), 1);
        assert_eq!(
            fire(&mut wheel, deadline),
            vec![(deadline, 7)],
            "deadline {deadline}"
        );
        assert!(wheel.is_empty());
        assert_eq!(wheel.elapsed_tick(), deadline);
    }
}

#[test]
fn wheel_fires_exactly_at_deadline_when_stepping_one_tick_at_a_time() {
    let deadlines = [1u64, 63, 64, 65, 128, 4095, 4096, 4097, 8191, 8192, 12_345];
    let mut wheel = Wheel::new();
    for (i, &d) in deadlines.iter().enumerate() {
        wheel.insert(d, i as u32);
    }
    let mut fired_at = Vec::new();
    for now in 0..=12_345u64 {
        for (d, v) in fire(&mut wheel, now) {
            fired_at.push((now, d, v));
        }
    }
    let expected: Vec<(u64, u64, u32)> = deadlines
        .iter()
        .enumerate()
        .map(|(i, &d)| (d, d, i as u32))
        .collect();
    assert_eq!(fired_at, expected);
}

#[test]
fn wheel_cascades_across_level_boundaries_in_deadline_order() {
    let deadlines = [
        262_144u64,
        63,
        4096,
        64,
        16_777_216,
        65,
        4095,
        262_143,
        1_073_741_824,
        RANGE_TICKS - 1,
    ];
    let mut wheel = Wheel::new();
    for (i, &d) in deadlines.iter().enumerate() {
        wheel.insert(d, i as u32);
    }
    // One big jump: every timer fires, in deadline order.
    assert_eq!(
        fire(&mut wheel, RANGE_TICKS),
        vec![
            (63, 1),
            (64, 3),
            (65, 5),
            (4095, 6),
            (4096, 2),
            (262_143, 7),
            (262_144, 0),
            (16_777_216, 4),
            (1_073_741_824, 8),
            (RANGE_TICKS - 1, 9),
        ]
    );
    // Step by step from a non-zero current tick: each fires at its own tick.
    let mut wheel = Wheel::new();
    assert_eq!(fire(&mut wheel, 100), vec![]);
    for &d in &[163u64, 164, 4195, 4196, 262_244] {
        wheel.insert(d, d as u32);
    }
    for &d in &[163u64, 164, 4195, 4196, 262_244] {
        assert_eq!(fire(&mut wheel, d - 1), vec![]);
        assert_eq!(fire(&mut wheel, d), vec![(d, d as u32)]);
    }
}

#[test]
fn wheel_ties_fire_in_insertion_order_even_when_inserted_at_different_levels() {
    let mut wheel = Wheel::new();
    wheel.insert(5000, 1u32); // level 2 at tick 0
    assert_eq!(fire(&mut wheel, 4200), vec![]);
    wheel.insert(5000, 2); // level 1 at tick 4200
    assert_eq!(fire(&mut wheel, 4995), vec![]);
    wheel.insert(5000, 3); // level 0 at tick 4995
    wheel.insert(4999, 4);
    assert_eq!(
        fire(&mut wheel, 6000),
        vec![(4999, 4), (5000, 1), (5000, 2), (5000, 3)]
    );
}

#[test]
fn wheel_cancel_before_fire_returns_value_and_nothing_fires() {
    let mut wheel = Wheel::new();
    let a = wheel.insert(100, 1u32);
    let b = wheel.insert(100, 2);
    let c = wheel.insert(5000, 3);
    assert_eq!(wheel.len(), 3);
    assert_eq!(wheel.cancel(a), Some(1));
    assert_eq!(wheel.cancel(c), Some(3));
    assert_eq!(wheel.len(), 1);
    assert!(!wheel.contains(a));
    assert!(wheel.contains(b));
    assert_eq!(fire(&mut wheel, 10_000), vec![(100, 2)]);
    assert!(wheel.is_empty());
}

#[test]
fn wheel_stale_handle_after_fire_is_inert() {
    let mut wheel = Wheel::new();
    let a = wheel.insert(10, 1u32);
    let fired = wheel.drain_expired(10);
    assert_eq!(
        fired,
        vec![Expired {
            handle: a,
            deadline_tick: 10,
            value: 1
        }]
    );
    assert_eq!(wheel.cancel(a), None);
    assert_eq!(wheel.deadline_tick(a), None);
}

#[test]
fn wheel_stale_handle_after_cancel_is_inert() {
    let mut wheel = Wheel::new();
    let a = wheel.insert(10, 1u32);
    assert_eq!(wheel.cancel(a), Some(1));
    assert_eq!(wheel.cancel(a), None);
    assert!(wheel.is_empty());
}

#[test]
fn wheel_stale_handle_never_touches_a_timer_reusing_its_slot() {
    let mut wheel = Wheel::new();
    let old = wheel.insert(10, 1u32);
    assert_eq!(wheel.cancel(old), Some(1));
    let new = wheel.insert(20, 2);
    // The slab slot is reused; only the generation tells the two apart.
    assert_eq!(new.index(), old.index());
    assert_ne!(new.generation(), old.generation());
    assert_eq!(wheel.cancel(old), None);
    assert!(!wheel.contains(old));
    assert_eq!(wheel.deadline_tick(new), Some(20));
    assert_eq!(wheel.len(), 1);
    // Same after the reusing timer fires and another takes the slot.
    assert_eq!(fire(&mut wheel, 20), vec![(20, 2)]);
    let newer = wheel.insert(30, 3);
    assert_eq!(newer.index(), old.index());
    assert_eq!(wheel.cancel(old), None);
    assert_eq!(wheel.cancel(new), None);
    assert_eq!(fire(&mut wheel, 30), vec![(30, 3)]);
}

#[test]
fn wheel_past_deadlines_fire_on_next_advance_in_deadline_order() {
    let mut wheel = Wheel::new();
    assert_eq!(fire(&mut wheel, 1000), vec![]);
    wheel.insert(1001, 1u32);
    wheel.insert(500, 2); // past
    wheel.insert(1000, 3); // now
    wheel.insert(0, 4); // past
    wheel.insert(500, 5); // past, tie with value 2
    assert_eq!(wheel.next_deadline(), Some(0));
    // Even an advance to the same (or an earlier) tick fires them.
    assert_eq!(
        fire(&mut wheel, 999),
        vec![(0, 4), (500, 2), (500, 5), (1000, 3)]
    );
    assert_eq!(wheel.elapsed_tick(), 1000);
    assert_eq!(fire(&mut wheel, 1001), vec![(1001, 1)]);
}

#[test]
fn wheel_far_future_beyond_range_is_kept_and_fires_on_time() {
    let mut wheel = Wheel::new();
    let far = [RANGE_TICKS, RANGE_TICKS + 1, 3 * RANGE_TICKS + 17, u64::MAX];
    for (i, &d) in far.iter().enumerate() {
        wheel.insert(d, i as u32);
    }
    assert_eq!(wheel.next_deadline(), Some(RANGE_TICKS));
    assert_eq!(fire(&mut wheel, RANGE_TICKS - 1), vec![]);
    assert_eq!(fire(&mut wheel, RANGE_TICKS), vec![(RANGE_TICKS, 0)]);
    assert_eq!(fire(&mut wheel, RANGE_TICKS), vec![]);
    assert_eq!(
        fire(&mut wheel, RANGE_TICKS + 1),
        vec![(RANGE_TICKS + 1, 1)]
    );
    assert_eq!(fire(&mut wheel, 3 * RANGE_TICKS + 16), vec![]);
    assert_eq!(
        fire(&mut wheel, 3 * RANGE_TICKS + 17),
        vec![(3 * RANGE_TICKS + 17, 2)]
    );
    assert_eq!(fire(&mut wheel, u64::MAX - 1), vec![]);
    assert_eq!(wheel.len(), 1);
    assert_eq!(fire(&mut wheel, u64::MAX), vec![(u64::MAX, 3)]);
    assert!(wheel.is_empty());
}

#[test]
fn wheel_next_deadline_is_exact_without_cancels_and_a_lower_bound_with() {
    let mut wheel = Wheel::new();
    assert_eq!(wheel.next_deadline(), None);
    let a = wheel.insert(5000, 1u32);
    wheel.insert(6000, 2);
    assert_eq!(wheel.next_deadline(), Some(5000));
    wheel.insert(70, 3);
    assert_eq!(wheel.next_deadline(), Some(70));
    assert_eq!(fire(&mut wheel, 70), vec![(70, 3)]);
    assert_eq!(wheel.next_deadline(), Some(5000));
    // Cancelling the earliest leaves a bound that is early, never late.
    assert_eq!(wheel.cancel(a), Some(1));
    let bound = wheel.next_deadline();
    assert!(bound.is_some_and(|b| b <= 6000), "{bound:?}");
    assert_eq!(fire(&mut wheel, 5999), vec![]);
    assert_eq!(wheel.next_deadline(), Some(6000));
    assert_eq!(fire(&mut wheel, 6000), vec![(6000, 2)]);
    assert_eq!(wheel.next_deadline(), None);
}

#[test]
fn wheel_poll_expired_allows_rearming_between_expiries() {
    let mut wheel = Wheel::new();
    let mut handles: Vec<TimerHandle> = Vec::new();
    handles.push(wheel.insert(10, 0u32));
    let mut fired = Vec::new();
    // A heartbeat re-armed every 10 ticks from inside the drain.
    while let Some(e) = wheel.poll_expired(45) {
        fired.push(e.deadline_tick);
        handles.push(wheel.insert(e.deadline_tick + 10, e.value + 1));
    }
    assert_eq!(fired, vec![10, 20, 30, 40]);
    assert_eq!(wheel.len(), 1);
    assert_eq!(wheel.deadline_tick(handles[4]), Some(50));
    assert_eq!(wheel.elapsed_tick(), 45);
}

#[test]
fn wheel_advance_reports_count_and_order() {
    let mut wheel = Wheel::new();
    for d in [3u64, 1, 2] {
        wheel.insert(d, d as u32);
    }
    let mut seen = Vec::new();
    let fired = wheel.advance(2, |e| seen.push(e.value));
    assert_eq!(fired, 2);
    assert_eq!(seen, vec![1, 2]);
}

#[test]
fn wheel_tick_conversions_round_deadlines_up_and_now_down() {
    assert_eq!(TickLength::new(Duration::ZERO), Err(TickError::Zero));
    assert_eq!(TickLength::from_ms(0), Err(TickError::Zero));
    assert_eq!(
        TickLength::new(Duration::from_secs(u64::MAX)),
        Err(TickError::TooLong { seconds: u64::MAX })
    );
    let Ok(ms) = TickLength::from_ms(1) else {
        panic!("1 ms is a valid tick");
    };
    assert_eq!(ms.tick_ns(), 1_000_000);
    assert_eq!(ms.duration(), Duration::from_millis(1));
    assert_eq!(ms.ticks_ceil(Duration::ZERO), 0);
    assert_eq!(ms.ticks_ceil(Duration::from_nanos(1)), 1);
    assert_eq!(ms.ticks_ceil(Duration::from_millis(1)), 1);
    assert_eq!(ms.ticks_ceil(Duration::from_micros(1001)), 2);
    assert_eq!(ms.ticks_floor(Duration::from_micros(1999)), 1);
    assert_eq!(ms.ticks_floor(Duration::from_millis(2)), 2);
    assert_eq!(ms.ticks_ceil(Duration::MAX), u64::MAX);
    assert_eq!(ms.ticks_to_duration(1500), Duration::from_millis(1500));
    assert_eq!(
        ms.ticks_to_duration(u64::MAX),
        Duration::from_millis(u64::MAX)
    );
    let Ok(ns) = TickLength::new(Duration::from_nanos(1)) else {
        panic!("1 ns is a valid tick");
    };
    assert_eq!(ns.ticks_ceil(Duration::MAX), u64::MAX);
    assert_eq!(
        ns.ticks_to_duration(u64::MAX),
        Duration::from_nanos(u64::MAX)
    );

    let origin = clock::now();
    let scale = TickScale::new(origin, ms);
    let start = origin + Duration::from_micros(2500); // tick 2.5
    assert_eq!(scale.now_tick(start), 2);
    assert_eq!(scale.now_tick(origin), 0);
    // A 300 ms timeout from 2.5 ms: due at 302.5 ms, so tick 303.
    let deadline_tick = scale.deadline_after(start, Duration::from_millis(300));
    assert_eq!(deadline_tick, 303);
    assert_eq!(scale.now_tick(origin + Duration::from_micros(302_999)), 302);
    assert_eq!(
        scale.instant_at(deadline_tick),
        Some(origin + Duration::from_millis(303))
    );
    // Never early: the first instant whose now_tick reaches the deadline tick
    // is not before the real deadline.
    assert!(scale.instant_at(deadline_tick) >= Some(start + Duration::from_millis(300)));
}

#[test]
fn wheel_bench_report_yields_finite_positive_figures() {
    let figures = bench_report(1000);
    assert_eq!(figures.timers, 1000);
    assert_eq!(figures.span_ticks, 4096);
    for ns in [figures.insert_ns, figures.cancel_ns, figures.expire_ns] {
        assert!(ns.is_finite() && ns > 0.0, "{figures:?}");
    }
}
