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
//! The cache is [`NodeMetricsCache`](crate::link::node_metrics_cache::NodeMetricsCache),
//! one per shard; this module pulls for it.
//!
//! A flood of scrapes therefore costs every node at most one METRICS
//! command per shard per interval, and never fills the table of commands
//! waiting for nodes that operators' `/admin` commands use.

use std::rc::Rc;
use std::time::Duration;

use iop_wire::pb;

use crate::control::ConnId;
use crate::link::edge::Edge;
use crate::link::node_metrics_cache::NodeSeries;

/// How long a scrape waits for each node's METRICS answer; a node that
/// does not answer in time is left out of that scrape and counted in
/// `iop_edge_node_scrape_errors_total`.
pub const NODE_SCRAPE_WAIT: Duration = Duration::from_secs(2);

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
        .series(edge.settings.running.get().node_metrics_max_age, || {
            pull_nodes(edge, nodes)
        })
        .await
}
