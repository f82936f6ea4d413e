//! Per-core recording and the merged read across live and exited threads.
//! One test in this binary: it reads the process-wide registry list.

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use iop_engine::clock;
use iop_engine::metrics::{self, Count, Latency};

#[test]
fn metrics_merged_read_adds_live_and_exited_threads_and_loses_nothing_on_exit() {
    let (recorded_tx, recorded_rx) = mpsc::channel();
    let (exit_tx, exit_rx) = mpsc::channel::<()>();
    // A live core: records, then stays alive until told to exit.
    let live = thread::spawn(move || {
        metrics::record(Latency::EdgeQueueWait, Duration::from_micros(100));
        metrics::record(Latency::EdgeQueueWait, Duration::from_micros(200));
        metrics::add(Count::EdgeRelayBodyBytes, 5);
        recorded_tx.send(()).unwrap();
        exit_rx.recv().unwrap();
    });
    // A core that records and exits before the read.
    thread::spawn(|| {
        metrics::record(Latency::EdgeQueueWait, Duration::from_micros(300));
        metrics::add(Count::EdgeRelayBodyBytes, 7);
        metrics::record(Latency::NodeRelayChunkLatency, Duration::from_micros(9));
    })
    .join()
    .unwrap();
    recorded_rx.recv().unwrap();
    // This thread too; an interval that runs backwards records 0.
    let now = clock::now();
    metrics::record_between(
        Latency::EdgeQueueWait,
        now,
        now + Duration::from_micros(400),
    );
    metrics::record_between(Latency::EdgeEndToEnd, now + Duration::from_secs(1), now);

    let merged = metrics::merged();
    let queue = merged.histogram(Latency::EdgeQueueWait);
    assert_eq!(queue.count(), 4);
    assert_eq!(queue.sum_us(), 1_000);
    assert_eq!(queue.value_at_quantile_us(0.5), 200);
    assert_eq!(queue.max_us(), 400);
    assert_eq!(merged.histogram(Latency::EdgeEndToEnd).count(), 1);
    assert_eq!(merged.histogram(Latency::EdgeEndToEnd).max_us(), 0);
    assert_eq!(merged.histogram(Latency::NodeRelayChunkLatency).count(), 1);
    assert_eq!(merged.counter(Count::EdgeRelayBodyBytes), 12);

    // The live core exits: its samples move to the retired registry.
    exit_tx.send(()).unwrap();
    live.join().unwrap();
    let after = metrics::merged();
    assert_eq!(after.histogram(Latency::EdgeQueueWait).count(), 4);
    assert_eq!(after.histogram(Latency::EdgeQueueWait).sum_us(), 1_000);
    assert_eq!(after.counter(Count::EdgeRelayBodyBytes), 12);

    // A read takes nothing away.
    let again = metrics::merged();
    assert_eq!(again.histogram(Latency::EdgeQueueWait).count(), 4);
}
