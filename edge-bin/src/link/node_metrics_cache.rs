//! One shard's cache of its nodes' `/metrics` series: serve a recent pull,
//! share a running one, or pull (at most one pull at a time); see
//! [`crate::link::node_metrics`] for the whole scrape.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::{Duration, Instant};

use iop_engine::clock;
use iop_engine::sync::WakeList;

/// The nodes' series of one pull: `(node id, exposition text)`.
pub type NodeSeries = Rc<[(String, String)]>;

/// One shard's last pull of its nodes' series; see the module docs.
#[derive(Debug, Default)]
pub struct NodeMetricsCache {
    last: RefCell<Option<(Instant, NodeSeries)>>,
    pulling: Cell<bool>,
    pulled: WakeList,
}

/// What a scrape does for the nodes' series ([`NodeMetricsCache::step`]).
#[derive(Debug, Clone, PartialEq)]
pub enum CacheStep {
    /// Use these series.
    Serve(NodeSeries),
    /// Pull them now (this scrape is the one pull).
    Pull,
    /// A pull runs and there is nothing to serve yet: wait for it.
    Wait,
}

impl NodeMetricsCache {
    /// What a scrape at `now` does: serve a pull younger than `max_age`,
    /// else the previous pull while another scrape pulls, else pull (or
    /// wait for the pull that runs).
    pub fn step(&self, now: Instant, max_age: Duration) -> CacheStep {
        let last = self.last.borrow();
        match (&*last, self.pulling.get()) {
            (Some((at, series)), _) if now.saturating_duration_since(*at) < max_age => {
                CacheStep::Serve(series.clone())
            }
            (Some((_, series)), true) => CacheStep::Serve(series.clone()),
            (None, true) => CacheStep::Wait,
            (_, false) => CacheStep::Pull,
        }
    }

    /// Records the series pulled at `at`, ending the pull.
    pub fn store(&self, at: Instant, series: NodeSeries) {
        *self.last.borrow_mut() = Some((at, series));
    }

    /// The nodes' series for a scrape: cached (younger than `max_age`),
    /// shared, or pulled by `pull` (at most one at a time on this shard).
    pub(super) async fn series<F, Fut>(&self, max_age: Duration, pull: F) -> NodeSeries
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Vec<(String, String)>>,
    {
        loop {
            match self.step(clock::now(), max_age) {
                CacheStep::Serve(series) => return series,
                CacheStep::Wait => self.pulled.wait().await,
                CacheStep::Pull => break,
            }
        }
        self.pulling.set(true);
        // A scrape dropped mid-pull (its client left) must not leave the
        // cache marked as pulling.
        let _end = PullEnd(self);
        let series: NodeSeries = pull().await.into();
        self.store(clock::now(), series.clone());
        series
    }
}

/// Ends a pull when dropped: clears the flag and wakes the waiters.
struct PullEnd<'a>(&'a NodeMetricsCache);

impl Drop for PullEnd<'_> {
    fn drop(&mut self) {
        self.0.pulling.set(false);
        self.0.pulled.wake_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iop_engine::clock::{Clock, ManualClock};

    fn series(node: &str) -> NodeSeries {
        vec![(node.to_string(), "x 1\n".to_string())].into()
    }

    #[test]
    fn a_pull_serves_the_scrapes_of_the_next_seconds() {
        let clock = ManualClock::new(0);
        let cache = NodeMetricsCache::default();
        let t0 = clock.now();
        let max_age = Duration::from_secs(5);
        assert_eq!(cache.step(t0, max_age), CacheStep::Pull);
        cache.store(t0, series("a"));
        let young = t0 + max_age - Duration::from_millis(1);
        assert_eq!(cache.step(young, max_age), CacheStep::Serve(series("a")));
        let old = t0 + max_age;
        assert_eq!(cache.step(old, max_age), CacheStep::Pull);
        // No caching: every scrape pulls.
        assert_eq!(cache.step(t0, Duration::ZERO), CacheStep::Pull);
        // While a pull runs, the previous one is served; with none, wait.
        cache.pulling.set(true);
        assert_eq!(cache.step(old, max_age), CacheStep::Serve(series("a")));
        let empty = NodeMetricsCache::default();
        empty.pulling.set(true);
        assert_eq!(empty.step(t0, max_age), CacheStep::Wait);
    }

    // Many scrapes at once pull the nodes once: the flood costs the nodes
    // (and the admin command table) one command each, not one per scrape.
    #[monoio::test_all(timer_enabled = true)]
    async fn concurrent_scrapes_share_one_pull() {
        let cache = Rc::new(NodeMetricsCache::default());
        let pulls = Rc::new(Cell::new(0u32));
        let scrapes: Vec<_> = (0..8)
            .map(|_| {
                let (cache, pulls) = (cache.clone(), pulls.clone());
                monoio::spawn(async move {
                    cache
                        .series(Duration::from_secs(5), || async move {
                            pulls.set(pulls.get() + 1);
                            monoio::time::sleep(Duration::from_millis(20)).await;
                            vec![("node-a".to_string(), "x 1\n".to_string())]
                        })
                        .await
                })
            })
            .collect();
        for scrape in scrapes {
            assert_eq!(scrape.await, series("node-a"));
        }
        assert_eq!(pulls.get(), 1);
        assert!(!cache.pulling.get());
    }

    // A scrape dropped while it pulls (its client left) leaves no pull
    // marked as running: the next scrape pulls.
    #[monoio::test_all(timer_enabled = true)]
    async fn a_dropped_pull_does_not_wedge_the_cache() {
        let cache = NodeMetricsCache::default();
        {
            let pull = cache.series(Duration::from_secs(5), || async {
                monoio::time::sleep(Duration::from_secs(3600)).await;
                Vec::new()
            });
            let mut pull = std::pin::pin!(pull);
            monoio::select! {
                _ = &mut pull => panic!("the pull cannot finish"),
                _ = monoio::time::sleep(Duration::from_millis(5)) => {}
            }
            assert!(cache.pulling.get());
        }
        assert!(!cache.pulling.get());
        assert_eq!(
            cache.step(clock::now(), Duration::from_secs(5)),
            CacheStep::Pull
        );
    }
}
