//! The fleet a swarm run configures: `nodes` Nodes, each with
//! `providers_per_node` providers on one OpenAI-compatible adapter, one
//! model per provider slot pooled over every Node, and one model pinned to
//! each Node. The Edge configuration is generated from it, and the
//! in-process selection measurement builds `Control` from that very text,
//! so both see the same topology. In a cluster (`--cluster N`) every Edge
//! gets the same fleet under its own name, certificate and `[cluster]`
//! table ([`EdgeRole::Member`]).
//!
//! ```text
//! node n00000: p0 p1 … p{k-1}      model swarm-m0 = [n00000/p0, n00001/p0, …]   (pool of N)
//! node n00001: p0 p1 … p{k-1}      model swarm-m1 = [n00000/p1, n00001/p1, …]
//! …                                 model swarm-n00042 = [n00042/p0]            (one per node)
//! ```

use std::fmt::Write as _;

/// Largest fleet a run configures (node ids have five digits).
pub const MAX_NODES: usize = 99_999;

/// The shape of a swarm's fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    /// Nodes the Edge expects.
    pub nodes: usize,
    /// Providers per node; model `swarm-m{j}` pools provider `p{j}` of
    /// every node.
    pub providers_per_node: usize,
    /// Lease capacity of every provider.
    pub capacity: u32,
}

/// Names shared by the certificates and the configuration.
pub const TRUST_DOMAIN: &str = "iop.swarm";
/// The Edge's identity name.
pub const EDGE_NAME: &str = "edge-swarm";
/// The cluster's name in a `--cluster` run (its keys: `/iop/swarm/`).
pub const CLUSTER_NAME: &str = "swarm";
/// Most Edges of a `--cluster` run (named `edge-a` to `edge-h`).
pub const MAX_CLUSTER_EDGES: usize = 8;
/// `edge.max_node_handshakes_per_peer` of the swarm's Edge (single or a
/// cluster member): every swarm node dials from 127.0.0.1, where real Nodes each have an address of
/// their own; at the Edge's default (8) all but 8 of a burst would be
/// closed at accept. Raised to the default process-wide cap
/// (`max_node_handshakes`, 64), so that only that cap paces a burst (the
/// rest wait in the accept backlog), as it would for a fleet of hosts.
pub const MEMBER_HANDSHAKES_PER_PEER: u64 = 64;
/// The adapter instance on every node.
pub const ADAPTER: &str = "mock";
/// The provider target (the model name a provider server would know).
pub const TARGET: &str = "swarm-target";

/// The `[cluster]` table every Edge of a `--cluster` run shares.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ClusterTable {
    /// `name`: the keys live under `/iop/<name>/`.
    pub name: String,
    /// `etcd_endpoints` (`host:port`).
    pub etcd_endpoints: Vec<String>,
    /// `lease_ttl_sec`.
    pub lease_ttl_sec: u64,
    /// `keepalive_interval_sec`.
    pub keepalive_interval_sec: u64,
    /// `peer_listen` (`127.0.0.1:0` picks a port): where other Edges
    /// forward requests for the nodes this Edge owns; `None`: no peer
    /// listener (the Edge forwards, but takes no forwarded request).
    pub peer_listen: Option<String>,
}

/// Which Edge a configuration is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EdgeRole<'a> {
    /// The one Edge of a single-Edge run ([`EDGE_NAME`], `certs/edge.pem`).
    Single,
    /// Edge `name` of a cluster.
    Member {
        /// Its name ([`Topology::edge_name`]).
        name: &'a str,
        /// The cluster it belongs to.
        cluster: &'a ClusterTable,
    },
}

impl Topology {
    /// The name of Edge `i` of a cluster (`edge-a`, `edge-b`, …), `None`
    /// past [`MAX_CLUSTER_EDGES`].
    pub fn edge_name(i: usize) -> Option<String> {
        (i < MAX_CLUSTER_EDGES).then(|| format!("edge-{}", char::from(b'a' + i as u8)))
    }

    /// Node `i`'s id (`n00042`).
    pub fn node_id(i: usize) -> String {
        format!("n{i:05}")
    }

    /// The index of a node id minted by [`Topology::node_id`].
    pub fn node_index(id: &str) -> Option<usize> {
        id.strip_prefix('n')
            .filter(|digits| digits.len() == 5)
            .and_then(|digits| digits.parse().ok())
    }

    /// Provider `j`'s id on every node (`p3`).
    pub fn provider_id(j: usize) -> String {
        format!("p{j}")
    }

    /// The model pooled over provider `j` of every node.
    pub fn pooled_model(j: usize) -> String {
        format!("swarm-m{j}")
    }

    /// The model served only by node `i` (its provider `p0`).
    pub fn pinned_model(i: usize) -> String {
        format!("swarm-{}", Self::node_id(i))
    }

    /// Every provider of the fleet.
    pub fn provider_count(&self) -> usize {
        self.nodes * self.providers_per_node
    }

    /// `edge.toml` of the single Edge for this fleet: the node listener at
    /// `node_listen`, the client listener at `client_listen` (`127.0.0.1:0`
    /// picks a port), certificates under `certs/` beside the file. The
    /// adapter's base URL names a closed port: swarm nodes answer tunnels
    /// themselves and never dial it.
    pub fn edge_toml(&self, client_listen: &str, node_listen: &str, max_queue: u32) -> String {
        self.edge_toml_as(EdgeRole::Single, client_listen, node_listen, max_queue)
    }

    /// [`Topology::edge_toml`] for the Edge `role` names: a cluster member
    /// has its own name and certificate (`certs/<name>.pem`,
    /// `certs/<name>-key.pem`) and a `[cluster]` table; the fleet is the
    /// same on every Edge.
    pub fn edge_toml_as(
        &self,
        role: EdgeRole<'_>,
        client_listen: &str,
        node_listen: &str,
        max_queue: u32,
    ) -> String {
        let mut t = String::with_capacity(512 + self.nodes * (200 + 120 * self.providers_per_node));
        let (name, cert, key, per_peer) = match role {
            EdgeRole::Single => (
                EDGE_NAME,
                "edge.pem".to_string(),
                "edge-key.pem".to_string(),
                format!("max_node_handshakes_per_peer = {MEMBER_HANDSHAKES_PER_PEER}\n"),
            ),
            EdgeRole::Member { name, .. } => (
                name,
                format!("{name}.pem"),
                format!("{name}-key.pem"),
                format!("max_node_handshakes_per_peer = {MEMBER_HANDSHAKES_PER_PEER}\n"),
            ),
        };
        let _ = write!(
            t,
            r#"[edge]
name = "{name}"
trust_domain = "{TRUST_DOMAIN}"
client_listen = "{client_listen}"
node_listen = "{node_listen}"
allow_anonymous = true
max_client_connections_per_peer = 1000000
{per_peer}
[tls]
ca = "certs/ca.pem"
cert = "certs/{cert}"
key = "certs/{key}"
"#
        );
        if let EdgeRole::Member { cluster, .. } = role {
            let endpoints = cluster
                .etcd_endpoints
                .iter()
                .map(|e| format!("\"{e}\""))
                .collect::<Vec<_>>()
                .join(", ");
            let _ = write!(
                t,
                "\n[cluster]\nname = \"{}\"\netcd_endpoints = [{endpoints}]\nlease_ttl_sec = {}\n\
                 keepalive_interval_sec = {}\n",
                cluster.name, cluster.lease_ttl_sec, cluster.keepalive_interval_sec
            );
            if let Some(peer_listen) = &cluster.peer_listen {
                let _ = writeln!(t, "peer_listen = \"{peer_listen}\"");
            }
        }
        for i in 0..self.nodes {
            let node = Self::node_id(i);
            let _ = write!(
                t,
                r#"
[[nodes]]
id = "{node}"
[[nodes.adapters]]
name = "{ADAPTER}"
kind = "openai_compat"
base_url = "http://127.0.0.1:9"
"#
            );
            for j in 0..self.providers_per_node {
                let _ = write!(
                    t,
                    r#"[[nodes.providers]]
id = "{provider}"
adapter = "{ADAPTER}"
target = "{TARGET}"
capacity = {capacity}
"#,
                    provider = Self::provider_id(j),
                    capacity = self.capacity,
                );
            }
        }
        for j in 0..self.providers_per_node {
            let _ = write!(
                t,
                "\n[[models]]\nname = \"{}\"\nmax_queue = {max_queue}\nproviders = [",
                Self::pooled_model(j)
            );
            for i in 0..self.nodes {
                let sep = if i == 0 { "" } else { ", " };
                let _ = write!(t, "{sep}\"{}/{}\"", Self::node_id(i), Self::provider_id(j));
            }
            t.push_str("]\n");
        }
        for i in 0..self.nodes {
            let _ = write!(
                t,
                "\n[[models]]\nname = \"{}\"\nproviders = [\"{}/{}\"]\n",
                Self::pinned_model(i),
                Self::node_id(i),
                Self::provider_id(0)
            );
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        assert_eq!(Topology::node_id(42), "n00042");
        assert_eq!(Topology::node_index("n00042"), Some(42));
        assert_eq!(Topology::node_index("n42"), None);
        assert_eq!(Topology::node_index("x00042"), None);
        assert_eq!(Topology::pinned_model(7), "swarm-n00007");
        assert_eq!(Topology::pooled_model(1), "swarm-m1");
        assert_eq!(Topology::edge_name(0).as_deref(), Some("edge-a"));
        assert_eq!(Topology::edge_name(7).as_deref(), Some("edge-h"));
        assert_eq!(Topology::edge_name(MAX_CLUSTER_EDGES), None);
    }

    #[test]
    fn a_cluster_member_has_its_name_certificate_and_cluster_table_and_the_same_fleet() {
        let t = Topology {
            nodes: 1,
            providers_per_node: 1,
            capacity: 2,
        };
        let cluster = ClusterTable {
            name: CLUSTER_NAME.into(),
            etcd_endpoints: vec!["127.0.0.1:2379".into(), "127.0.0.1:2381".into()],
            lease_ttl_sec: 4,
            keepalive_interval_sec: 1,
            peer_listen: Some("127.0.0.1:0".into()),
        };
        let toml = t.edge_toml_as(
            EdgeRole::Member {
                name: "edge-b",
                cluster: &cluster,
            },
            "127.0.0.1:0",
            "127.0.0.1:0",
            10,
        );
        let expected = r#"[edge]
name = "edge-b"
trust_domain = "iop.swarm"
client_listen = "127.0.0.1:0"
node_listen = "127.0.0.1:0"
allow_anonymous = true
max_client_connections_per_peer = 1000000
max_node_handshakes_per_peer = 64

[tls]
ca = "certs/ca.pem"
cert = "certs/edge-b.pem"
key = "certs/edge-b-key.pem"

[cluster]
name = "swarm"
etcd_endpoints = ["127.0.0.1:2379", "127.0.0.1:2381"]
lease_ttl_sec = 4
keepalive_interval_sec = 1
peer_listen = "127.0.0.1:0"

[[nodes]]
id = "n00000"
[[nodes.adapters]]
name = "mock"
kind = "openai_compat"
base_url = "http://127.0.0.1:9"
[[nodes.providers]]
id = "p0"
adapter = "mock"
target = "swarm-target"
capacity = 2

[[models]]
name = "swarm-m0"
max_queue = 10
providers = ["n00000/p0"]

[[models]]
name = "swarm-n00000"
providers = ["n00000/p0"]
"#;
        assert_eq!(toml, expected);
        // The fleet part is the single Edge's, byte for byte.
        let single = t.edge_toml("127.0.0.1:0", "127.0.0.1:0", 10);
        let fleet = |text: &str| text[text.find("\n[[nodes]]").unwrap()..].to_string();
        assert_eq!(fleet(&toml), fleet(&single));
    }

    #[test]
    fn a_two_node_fleet_is_exactly_this_file() {
        let t = Topology {
            nodes: 2,
            providers_per_node: 2,
            capacity: 3,
        };
        let toml = t.edge_toml("127.0.0.1:0", "127.0.0.1:7000", 50);
        let expected = r#"[edge]
name = "edge-swarm"
trust_domain = "iop.swarm"
client_listen = "127.0.0.1:0"
node_listen = "127.0.0.1:7000"
allow_anonymous = true
max_client_connections_per_peer = 1000000
max_node_handshakes_per_peer = 64

[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge-key.pem"

[[nodes]]
id = "n00000"
[[nodes.adapters]]
name = "mock"
kind = "openai_compat"
base_url = "http://127.0.0.1:9"
[[nodes.providers]]
id = "p0"
adapter = "mock"
target = "swarm-target"
capacity = 3
[[nodes.providers]]
id = "p1"
adapter = "mock"
target = "swarm-target"
capacity = 3

[[nodes]]
id = "n00001"
[[nodes.adapters]]
name = "mock"
kind = "openai_compat"
base_url = "http://127.0.0.1:9"
[[nodes.providers]]
id = "p0"
adapter = "mock"
target = "swarm-target"
capacity = 3
[[nodes.providers]]
id = "p1"
adapter = "mock"
target = "swarm-target"
capacity = 3

[[models]]
name = "swarm-m0"
max_queue = 50
providers = ["n00000/p0", "n00001/p0"]

[[models]]
name = "swarm-m1"
max_queue = 50
providers = ["n00000/p1", "n00001/p1"]

[[models]]
name = "swarm-n00000"
providers = ["n00000/p0"]

[[models]]
name = "swarm-n00001"
providers = ["n00001/p0"]
"#;
        assert_eq!(toml, expected);
        assert_eq!(t.provider_count(), 4);
    }
}
