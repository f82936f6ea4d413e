//! The `SIGUSR1` dumper shell: each delivery writes one wrk2 dump of the
//! snapshot to the sink, and the dumper keeps listening.
//! One test in this binary: it installs a process-wide signal handler.

use std::cell::RefCell;
use std::io;
use std::rc::Rc;
use std::time::Duration;

use iop_engine::metrics::{self, Latency, Registry, Side};
use iop_engine::rt::{self, Signal, SignalPipe};

/// A sink the test reads while the dumper writes to it.
#[derive(Clone, Default)]
struct Sink(Rc<RefCell<Vec<u8>>>);

impl io::Write for Sink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.borrow_mut().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Sink {
    fn text(&self) -> String {
        String::from_utf8(self.0.borrow().clone()).unwrap()
    }
}

fn snapshot() -> Registry {
    let mut r = Registry::new();
    r.record_us(Latency::NodeProviderCallDuration, 250);
    r
}

/// Waits (bounded, so a broken dumper fails instead of hanging) until the
/// sink holds `dumps` complete dumps.
async fn wait_for_dumps(sink: &Sink, dumps: usize) {
    for _ in 0..10_000 {
        if sink
            .text()
            .matches("# end iop node latency histograms\n")
            .count()
            >= dumps
        {
            return;
        }
        monoio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("no dump #{dumps} after SIGUSR1; sink: {:?}", sink.text());
}

#[test]
fn metrics_each_sigusr1_writes_one_dump_and_the_dumper_keeps_listening() {
    rt::block_on(async {
        let pipe = SignalPipe::install(Signal::Usr1).unwrap();
        let sink = Sink::default();
        monoio::spawn(metrics::dump_on_sigusr1(
            pipe,
            Side::Node,
            snapshot,
            sink.clone(),
        ));
        let one = metrics::render_wrk2(&snapshot(), Side::Node);
        assert!(one.contains("#[Max     =        0.250, Total count    =            1]\n"));
        for round in 1..=2 {
            nix::sys::signal::raise(nix::sys::signal::Signal::SIGUSR1).unwrap();
            wait_for_dumps(&sink, round).await;
            assert_eq!(sink.text(), one.repeat(round));
        }
    })
    .unwrap();
}
