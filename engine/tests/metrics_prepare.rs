//! A thread that prepares its keys holds their histograms from the start,
//! and only those. One test in this binary: it reads the process-wide
//! registry list.

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use iop_engine::metrics::{self, Latency, Side};

#[test]
fn metrics_prepare_allocates_a_threads_keys_before_its_first_record() {
    let (prepared_tx, prepared_rx) = mpsc::channel();
    let (record_tx, record_rx) = mpsc::channel::<()>();
    let (recorded_tx, recorded_rx) = mpsc::channel();
    let core = thread::spawn(move || {
        metrics::prepare(Latency::of_side(Side::Node));
        prepared_tx.send(()).unwrap();
        record_rx.recv().unwrap();
        metrics::record(Latency::NodeRelayChunkLatency, Duration::from_micros(42));
        recorded_tx.send(()).unwrap();
        record_rx.recv().unwrap();
    });
    prepared_rx.recv().unwrap();

    let merged = metrics::merged();
    for &key in Latency::of_side(Side::Node) {
        assert!(merged.is_allocated(key), "{key:?} prepared");
        assert_eq!(merged.histogram(key).count(), 0, "{key:?} empty");
    }
    for &key in Latency::of_side(Side::Edge) {
        assert!(!merged.is_allocated(key), "{key:?} never prepared");
    }

    record_tx.send(()).unwrap();
    recorded_rx.recv().unwrap();
    let merged = metrics::merged();
    assert_eq!(merged.histogram(Latency::NodeRelayChunkLatency).count(), 1);
    assert_eq!(
        merged.histogram(Latency::NodeRelayChunkLatency).sum_us(),
        42
    );
    assert!(!merged.is_allocated(Latency::EdgeEndToEnd));
    record_tx.send(()).unwrap();
    core.join().unwrap();
}
