//! The nodes' `/metrics` series, pulled over their links and cached per
//! shard.
//!
//! ```text
//! scrape ─► NodeMetricsCache::step(now)
//!             ├─ Serve: a pull younger than edge.node_metrics_max_age_ms (5 s),
//!             │         or the previous one while another scrape pulls
//!             ├─ Wait:  a pull runs and there is nothing yet
//!             └─ Pull:  every ready node at once, a METRICS command each,
//!                       at most NODE_SCRAPE_WAIT
//! ```
//!
//! A flood of scrapes therefore costs every node at most one METRICS
//! command per shard per interval, and never fills the table of commands
//! waiting for nodes that operators' `/admin` commands use.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::{Duration, Instant};

use iop_engine::clock;
use iop_engine::sync::WakeList;
use iop_wire::pb;

use crate::control::ConnId;
use crate::link::edge::Edge;

/// How long a scrape waits for each node's METRICS answer; a node that
/// does not answer in time is left out of that scrape and counted in
/// `iop_edge_node_scrape_errors_total`.
pub const NODE_SCRAPE_WAIT: Duration = Duration::from_secs(2);

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
    async fn series<F, Fut>(&self, max_age: Duration, pull: F) -> NodeSeries
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

/// The series of `nodes` (ready nodes and their connections), every node at
/// once, each answer bounded by [`NODE_SCRAPE_WAIT`].
async fn pull_nodes(edge: &Rc<Edge>, nodes: Vec<(String, ConnId)>) -> Vec<(String, String)> {
    let pulls: Vec<_> = nodes
        .into_iter()
        .map(|(node, conn)| {
            let edge = edge.clone();
            let command = pb::NodeCommandRequest {
                r#type: pb::CommandType::Metrics as i32,
                ..Default::default()
            };
            let pull = monoio::spawn(async move {
                crate::link::commands::send(&edge, conn, command, NODE_SCRAPE_WAIT).await
            });
            (node, pull)
        })
        .collect();
    let requests = &edge.settings.request_metrics;
    let mut answers = Vec::with_capacity(pulls.len());
    for (node, pull) in pulls {
        match pull.await {
            Ok(resp) if resp.ok => answers.push((node, resp.metrics_text)),
            Ok(resp) => {
                tracing::debug!(node, error = %resp.error, "node refused the metrics command");
                requests.node_scrape_failed(&node);
            }
            Err(e) => {
                tracing::debug!(node, error = %e, "node metrics not pulled");
                requests.node_scrape_failed(&node);
            }
        }
    }
    answers
}

/// The nodes' series for a scrape on `edge`'s shard: the cached pull, or a
/// new pull of `nodes` (ready nodes and their connections).
pub async fn node_series(edge: &Rc<Edge>, nodes: Vec<(String, ConnId)>) -> NodeSeries {
    edge.node_metrics
        .series(edge.settings.node_metrics_max_age, || {
            pull_nodes(edge, nodes)
        })
        .await
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
