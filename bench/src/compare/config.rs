//! The Edge and Node configuration a comparison writes into its temporary
//! directory: one Node, one OpenAI-compatible adapter pointing at the mock,
//! one provider and one model, with capacities far above any load the
//! harness offers (so the relay, not admission, is what is measured).

/// Names shared by the certificates and both configurations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterNames {
    /// SPIFFE trust domain.
    pub trust_domain: String,
    /// The Edge's identity name.
    pub edge_name: String,
    /// The Node's id.
    pub node_id: String,
    /// The external model clients ask the Edge for.
    pub model: String,
    /// The model name the mock serves (the provider target).
    pub target: String,
}

impl ClusterNames {
    /// The names a comparison uses, serving `target` as `model`.
    pub fn bench(model: &str, target: &str) -> Self {
        ClusterNames {
            trust_domain: "iop.bench".into(),
            edge_name: "edge-bench".into(),
            node_id: "node-bench".into(),
            model: model.into(),
            target: target.into(),
        }
    }
}

/// Edge provider capacity (the config maximum).
pub const PROVIDER_CAPACITY: u32 = 65_536;
/// Edge model queue bound.
pub const MAX_QUEUE: u32 = 1_000_000;

/// A TOML basic string. JSON string escaping is a subset of TOML's.
fn toml_str(value: &str) -> String {
    serde_json::to_string(value).unwrap_or_else(|_| "\"\"".into())
}

/// One model the Edge serves from one mock provider (an adapter and a
/// provider of its own on the one node).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MockRoute {
    /// The adapter's (and provider's) name.
    pub name: String,
    /// The mock's base URL.
    pub base_url: String,
    /// The model name the mock serves (the provider target).
    pub target: String,
    /// The external model clients ask the Edge for.
    pub model: String,
}

/// `edge.toml`, with certificate paths relative to the file (`certs/`).
pub fn edge_toml(names: &ClusterNames, mock_base_url: &str) -> String {
    let route = MockRoute {
        name: "mock".into(),
        base_url: mock_base_url.into(),
        target: names.target.clone(),
        model: names.model.clone(),
    };
    edge_toml_for(names, &[route], &[])
}

/// [`edge_toml`] with more `[edge]` lines (`key = value\n` each).
pub fn edge_toml_with(names: &ClusterNames, mock_base_url: &str, edge_keys: &str) -> String {
    let route = MockRoute {
        name: "mock".into(),
        base_url: mock_base_url.into(),
        target: names.target.clone(),
        model: names.model.clone(),
    };
    let extra: Vec<String> = edge_keys.lines().map(str::to_string).collect();
    edge_toml_for(names, &[route], &extra)
}

/// `edge.toml` for one node serving every route (an adapter, a provider and
/// a model each), with `edge_extra` lines (`key = value`) in `[edge]`.
pub fn edge_toml_for(names: &ClusterNames, routes: &[MockRoute], edge_extra: &[String]) -> String {
    let providers: Vec<PoolProvider> = routes
        .iter()
        .map(|route| PoolProvider {
            adapter: route.name.clone(),
            provider_id: format!("{}-1", route.name),
            base_url: route.base_url.clone(),
            target: route.target.clone(),
            capacity: PROVIDER_CAPACITY,
        })
        .collect();
    let models: Vec<PoolModel> = routes
        .iter()
        .zip(&providers)
        .map(|(route, provider)| PoolModel {
            name: route.model.clone(),
            providers: vec![provider.provider_id.clone()],
            extra: Vec::new(),
        })
        .collect();
    edge_toml_pool(names, &providers, &models, edge_extra)
}

/// One adapter of the one node and the provider on it: a mock at
/// `base_url` serving `target`, at most `capacity` requests at a time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolProvider {
    /// The adapter's name.
    pub adapter: String,
    /// The provider's id on the node.
    pub provider_id: String,
    /// The mock's base URL.
    pub base_url: String,
    /// The model name the mock serves (the provider target).
    pub target: String,
    /// The provider's capacity (concurrent requests).
    pub capacity: u32,
}

/// One model the Edge serves over some of the node's providers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolModel {
    /// The external model clients ask the Edge for.
    pub name: String,
    /// Its providers' ids on the node, in pool order.
    pub providers: Vec<String>,
    /// More `key = value` lines of its `[[models]]` table.
    pub extra: Vec<String>,
}

/// `edge.toml` for one node (`names.node_id`) with `providers` (an adapter
/// each) and `models` over them, with `edge_extra` lines (`key = value`)
/// in `[edge]`; certificate paths relative to the file (`certs/`).
pub fn edge_toml_pool(
    names: &ClusterNames,
    providers: &[PoolProvider],
    models: &[PoolModel],
    edge_extra: &[String],
) -> String {
    let s = toml_str;
    let mut text = format!(
        r#"[edge]
name = {edge}
trust_domain = {td}
client_listen = "127.0.0.1:0"
node_listen = "127.0.0.1:0"
allow_anonymous = true
max_client_connections_per_peer = 1000000
"#,
        edge = s(&names.edge_name),
        td = s(&names.trust_domain),
    );
    for line in edge_extra {
        text.push_str(line);
        text.push('\n');
    }
    text.push_str(&format!(
        r#"
[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge-key.pem"

[[nodes]]
id = {node}
"#,
        node = s(&names.node_id),
    ));
    for provider in providers {
        text.push_str(&format!(
            r#"
[[nodes.adapters]]
name = {adapter}
kind = "openai_compat"
profile = "openai"
base_url = {base}
capacity = 0
"#,
            adapter = s(&provider.adapter),
            base = s(&provider.base_url),
        ));
    }
    for provider in providers {
        text.push_str(&format!(
            r#"
[[nodes.providers]]
id = {id}
adapter = {adapter}
target = {target}
capacity = {capacity}
"#,
            id = s(&provider.provider_id),
            adapter = s(&provider.adapter),
            target = s(&provider.target),
            capacity = provider.capacity,
        ));
    }
    for model in models {
        let pool: Vec<String> = model
            .providers
            .iter()
            .map(|id| s(&format!("{}/{id}", names.node_id)))
            .collect();
        text.push_str(&format!(
            r#"
[[models]]
name = {model}
providers = [{pool}]
max_queue = {MAX_QUEUE}
"#,
            model = s(&model.name),
            pool = pool.join(", "),
        ));
        for line in &model.extra {
            text.push_str(line);
            text.push('\n');
        }
    }
    text
}

/// `node.toml`, dialling the Edge's node listener `edge_nodes_addr`.
pub fn node_toml(names: &ClusterNames, edge_nodes_addr: &str) -> String {
    let s = toml_str;
    format!(
        r#"node_id = {node}
trust_domain = {td}
edge_addr = {edge_addr}
edge_name = {edge}

[tls]
ca = "certs/ca.pem"
cert = {cert}
key = {key}

[reconnect]
interval_sec = 1
max_attempts = 0
"#,
        node = s(&names.node_id),
        td = s(&names.trust_domain),
        edge_addr = s(edge_nodes_addr),
        edge = s(&names.edge_name),
        cert = s(&format!("certs/node-{}.pem", names.node_id)),
        key = s(&format!("certs/node-{}-key.pem", names.node_id)),
    )
}

/// The `edge-bin certs` arguments that mint every certificate the two
/// configurations name, into `out_dir`.
pub fn certs_args(names: &ClusterNames, out_dir: &str) -> Vec<String> {
    [
        "certs",
        "--out",
        out_dir,
        "--trust-domain",
        &names.trust_domain,
        "--edge-name",
        &names.edge_name,
        "--node",
        &names.node_id,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Whether a `/status` document shows a connected provider.
pub fn status_has_connected_provider(status: &serde_json::Value) -> bool {
    status["providers"].as_array().is_some_and(|ps| {
        ps.iter()
            .any(|p| p["connected"] == serde_json::Value::Bool(true))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edge_config_is_exact() {
        let names = ClusterNames::bench("bench-model", "mock-model");
        assert_eq!(
            edge_toml(&names, "http://127.0.0.1:4000"),
            r#"[edge]
name = "edge-bench"
trust_domain = "iop.bench"
client_listen = "127.0.0.1:0"
node_listen = "127.0.0.1:0"
allow_anonymous = true
max_client_connections_per_peer = 1000000

[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge-key.pem"

[[nodes]]
id = "node-bench"

[[nodes.adapters]]
name = "mock"
kind = "openai_compat"
profile = "openai"
base_url = "http://127.0.0.1:4000"
capacity = 0

[[nodes.providers]]
id = "mock-1"
adapter = "mock"
target = "mock-model"
capacity = 65536

[[models]]
name = "bench-model"
providers = ["node-bench/mock-1"]
max_queue = 1000000
"#
        );
    }

    #[test]
    fn pool_config_shares_providers_between_models() {
        let names = ClusterNames::bench("unused", "mock-model");
        let provider = |i: usize| PoolProvider {
            adapter: format!("a{i}"),
            provider_id: format!("p{i}"),
            base_url: format!("http://127.0.0.1:400{i}"),
            target: "mock-model".into(),
            capacity: 2,
        };
        let models = [
            PoolModel {
                name: "both".into(),
                providers: vec!["p0".into(), "p1".into()],
                extra: vec![r#"routing = "prefix""#.into()],
            },
            PoolModel {
                name: "one".into(),
                providers: vec!["p1".into()],
                extra: Vec::new(),
            },
        ];
        let text = edge_toml_pool(&names, &[provider(0), provider(1)], &models, &[]);
        let tail = text
            .split_once("[[nodes.providers]]")
            .map(|(_, tail)| tail)
            .unwrap();
        assert_eq!(
            tail,
            r#"
id = "p0"
adapter = "a0"
target = "mock-model"
capacity = 2

[[nodes.providers]]
id = "p1"
adapter = "a1"
target = "mock-model"
capacity = 2

[[models]]
name = "both"
providers = ["node-bench/p0", "node-bench/p1"]
max_queue = 1000000
routing = "prefix"

[[models]]
name = "one"
providers = ["node-bench/p1"]
max_queue = 1000000
"#
        );
        assert_eq!(text.matches("[[nodes.adapters]]").count(), 2);
        assert!(text.contains("name = \"a1\"\nkind = \"openai_compat\"\nprofile = \"openai\"\nbase_url = \"http://127.0.0.1:4001\"\ncapacity = 0\n"));
    }

    #[test]
    fn node_config_is_exact_and_escapes_strings() {
        let names = ClusterNames::bench("m", "t\"x");
        assert_eq!(
            node_toml(&names, "127.0.0.1:7443"),
            r#"node_id = "node-bench"
trust_domain = "iop.bench"
edge_addr = "127.0.0.1:7443"
edge_name = "edge-bench"

[tls]
ca = "certs/ca.pem"
cert = "certs/node-node-bench.pem"
key = "certs/node-node-bench-key.pem"

[reconnect]
interval_sec = 1
max_attempts = 0
"#
        );
        assert!(edge_toml(&names, "http://x").contains(r#"target = "t\"x""#));
    }

    #[test]
    fn certs_arguments_name_every_identity() {
        let names = ClusterNames::bench("m", "t");
        assert_eq!(
            certs_args(&names, "/tmp/c"),
            [
                "certs",
                "--out",
                "/tmp/c",
                "--trust-domain",
                "iop.bench",
                "--edge-name",
                "edge-bench",
                "--node",
                "node-bench"
            ]
        );
    }

    #[test]
    fn connected_status_is_recognised() {
        let yes = serde_json::json!({"providers":[{"connected":false},{"connected":true}]});
        let no = serde_json::json!({"providers":[{"connected":false}]});
        assert!(status_has_connected_provider(&yes));
        assert!(!status_has_connected_provider(&no));
        assert!(!status_has_connected_provider(&serde_json::json!({})));
    }
}
