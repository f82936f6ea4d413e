//! The `[edge]` table, its limits and the TLS files.

use super::*;

#[test]
fn example_file_parses_into_the_documented_values() {
    let path = example_path();
    let text = std::fs::read_to_string(&path).unwrap();
    let config = EdgeConfig::parse(&text, &path).unwrap();
    let dir = path.parent().unwrap();
    let expected = EdgeConfig {
        source: path.clone(),
        edge: EdgeSettings {
            name: "edge-1".into(),
            trust_domain: "iop.local".into(),
            client_listen: "127.0.0.1:8080".parse().unwrap(),
            node_listen: "127.0.0.1:7443".parse().unwrap(),
            max_request_body_bytes: 8 * 1024 * 1024,
            max_upload_body_bytes: 25 * 1024 * 1024,
            max_frame_bytes: 16 * 1024 * 1024,
            insecure_plaintext_nodes: false,
            allow_anonymous: true,
            metrics_access: MetricsAccess::Open,
            node_metrics_max_age_ms: 5_000,
            drain_grace_ms: 30_000,
            flow_window_bytes: 256 * 1024,
            client_write_stall_timeout_ms: 30_000,
            response_wait_timeout_ms: 600_000,
            limits: ListenerLimits::default(),
        },
        tls: Some(TlsFiles {
            ca: dir.join("certs/ca.pem"),
            cert: dir.join("certs/edge.pem"),
            key: dir.join("certs/edge-key.pem"),
        }),
        client_tls: None,
        access_log: AccessLogSpec::default(),
        usage_log: None,
        budget_file: None,
        nodes: vec![NodeSpec {
            id: "node-a".into(),
            adapters: vec![
                AdapterSpec {
                    name: "vllm-main".into(),
                    kind: AdapterKind::OpenAiCompat {
                        profile: ProfileName::Vllm,
                    },
                    base_url: base_url("http://127.0.0.1:8000"),
                    tls: ProviderTlsSpec::default(),
                    capacity: 8,
                    health_path: None,
                },
                AdapterSpec {
                    name: "ollama".into(),
                    kind: AdapterKind::Ollama,
                    base_url: base_url("http://127.0.0.1:11434"),
                    tls: ProviderTlsSpec::default(),
                    capacity: 4,
                    health_path: None,
                },
            ],
            providers: vec![
                ProviderSpec {
                    id: "a-llama".into(),
                    adapter: "vllm-main".into(),
                    target: "meta-llama/Llama-3.1-8B-Instruct".into(),
                    capacity: 8,
                    long_context_capacity: 2,
                    response_stall_timeout_ms: 0,
                    category: ProviderCategory::LocalInference,
                    enabled: true,
                },
                ProviderSpec {
                    id: "a-qwen".into(),
                    adapter: "ollama".into(),
                    target: "qwen2.5:7b".into(),
                    capacity: 4,
                    long_context_capacity: 0,
                    response_stall_timeout_ms: 120_000,
                    category: ProviderCategory::LocalInference,
                    enabled: true,
                },
            ],
            recipient_key: None,
        }],
        models: vec![
            ModelSpec {
                name: "llama-3.1-8b".into(),
                providers: vec![ProviderRef {
                    node_id: "node-a".into(),
                    provider_id: "a-llama".into(),
                }],
                long_context_threshold_tokens: Some(32_000),
                max_queue: 256,
                queue_timeout_ms: 30_000,
                max_attempts: 2,
                owned_by: "iop".into(),
                routing: RoutingPolicy::LeastLoaded,
            },
            ModelSpec {
                name: "qwen2.5-7b".into(),
                providers: vec![ProviderRef {
                    node_id: "node-a".into(),
                    provider_id: "a-qwen".into(),
                }],
                long_context_threshold_tokens: None,
                max_queue: 256,
                queue_timeout_ms: 30_000,
                max_attempts: 2,
                owned_by: "iop".into(),
                routing: RoutingPolicy::LeastLoaded,
            },
        ],
        credentials: None,
        outlier_detection: OutlierDetection::default(),
        routing: RoutingSettings::default(),
        cluster: None,
        tracing: None,
        client_keys: vec![],
    };
    assert_eq!(config, expected);
}

#[test]
fn omitted_keys_take_their_defaults() {
    let config = parse(BASE).unwrap();
    assert_eq!(config.edge.max_request_body_bytes, 8_388_608);
    assert_eq!(config.edge.max_frame_bytes, 16_777_216);
    assert!(!config.edge.insecure_plaintext_nodes);
    let node = config.node("node-a").unwrap();
    let ollama = node.adapter("ollama").unwrap();
    assert_eq!((ollama.kind, ollama.capacity), (AdapterKind::Ollama, 0));
    let qwen = node.provider("a-qwen").unwrap();
    assert_eq!(qwen.long_context_capacity, 0);
    assert_eq!(qwen.response_stall_timeout_ms, 0);
    assert_eq!(qwen.category, ProviderCategory::LocalInference);
    assert!(qwen.enabled);
    let model = config.model("llama-3.1-8b").unwrap();
    assert_eq!(model.long_context_threshold_tokens, None);
    assert_eq!(model.max_queue, 256);
    assert_eq!(model.queue_timeout_ms, 30_000);
    assert_eq!(model.owned_by, "iop");
    assert!(config.node("node-b").is_none());
    assert!(config.model("gpt-4").is_none());
}

#[test]
fn openai_compat_profile_defaults_to_openai() {
    let config = parse(&variant("profile = \"vllm\"\n", "")).unwrap();
    let adapter = config.node("node-a").unwrap().adapter("vllm-main").unwrap();
    assert_eq!(
        adapter.kind,
        AdapterKind::OpenAiCompat {
            profile: ProfileName::OpenAi
        }
    );
}

#[test]
fn explicit_values_are_kept() {
    let config = parse(&variant(
        "capacity = 4\n",
        "capacity = 4\nresponse_stall_timeout_ms = 5000\ncategory = \"api\"\nenabled = false\n",
    ))
    .unwrap();
    let qwen = config.node("node-a").unwrap().provider("a-qwen").unwrap();
    assert_eq!(qwen.response_stall_timeout_ms, 5000);
    assert_eq!(qwen.category, ProviderCategory::Api);
    assert!(!qwen.enabled);
}

#[test]
fn toml_syntax_error_has_no_key_and_a_location() {
    assert_eq!(
        error_of("id = \"node-a\"", "id = \"node-a"),
        "conf/edge.toml: -: invalid basic string, expected `\"` (line 14, column 13)"
    );
}

#[test]
fn unknown_keys_are_rejected_with_their_path() {
    assert_eq!(
        error_of("[tls]", "colour = \"blue\"\n[tls]"),
        "conf/edge.toml: edge.colour: unknown field `colour`, expected one of `name`, `trust_domain`, \
         `client_listen`, `node_listen`, `max_request_body_bytes`, `max_upload_body_bytes`, `max_frame_bytes`, \
         `insecure_plaintext_nodes`, `allow_anonymous`, `metrics_access`, \
         `node_metrics_max_age_ms`, `drain_grace_ms`, `flow_window_bytes`, \
         `client_write_stall_timeout_ms`, `response_wait_timeout_ms`, \
         `client_head_timeout_ms`, `client_body_idle_timeout_ms`, `client_body_grace_ms`, \
         `client_body_min_rate_bytes_per_sec`, `client_keep_alive_timeout_ms`, \
         `max_client_connections`, `max_client_connections_per_peer`, `client_linger_time_ms`, \
         `client_linger_idle_timeout_ms`, `client_linger_max_bytes`, `node_handshake_timeout_ms`, \
         `max_node_handshakes`, `max_node_handshakes_per_peer`, `node_first_byte_timeout_ms`, \
         `max_json_depth`, `max_json_elements`, `max_json_members`, `client_tls`, `access_log`, \
         `usage_log`, `budget_file` (line 8, column 1)"
    );
    assert_eq!(
        error_of("target = \"qwen2.5:7b\"", "target = \"qwen2.5:7b\"\nmodel = \"x\""),
        "conf/edge.toml: nodes[0].providers[1].model: unknown field `model`, expected one of `id`, \
         `adapter`, `target`, `capacity`, `long_context_capacity`, `response_stall_timeout_ms`, \
         `category`, `enabled` (line 38, column 1)"
    );
    assert_eq!(
        error(&format!("{BASE}\n[metrics]\nlisten = \"x\"\n")),
        "conf/edge.toml: metrics: unknown field `metrics`, expected one of `edge`, `tls`, \
         `credentials`, `client_keys`, `nodes`, `models`, `outlier_detection`, `routing`, `cluster`, `tracing` (line 44, \
         column 2)"
    );
}

#[test]
fn missing_and_mistyped_keys_name_the_key() {
    assert_eq!(
        error(""),
        "conf/edge.toml: edge: required key is missing (line 1, column 1)"
    );
    assert_eq!(
        error_of("name = \"edge-1\"\n", ""),
        "conf/edge.toml: edge.name: required key is missing (line 2, column 1)"
    );
    assert_eq!(
        error_of("capacity = 4\n", ""),
        "conf/edge.toml: nodes[0].providers[1].capacity: required key is missing (line 34, column 1)"
    );
    assert_eq!(
        error_of("capacity = 4\n", "capacity = \"4\"\n"),
        "conf/edge.toml: nodes[0].providers[1].capacity: invalid type: string \"4\", expected i64 \
         (line 38, column 12)"
    );
}

#[test]
fn identity_names_are_spiffe_path_segments() {
    let rule = "must be 1 to 128 characters of A-Z a-z 0-9 . _ -";
    assert_eq!(
        error_of("name = \"edge-1\"", "name = \"edge/1\""),
        format!("conf/edge.toml: edge.name: \"edge/1\" {rule}")
    );
    assert_eq!(
        error_of("id = \"node-a\"", "id = \"\""),
        format!("conf/edge.toml: nodes[0].id: \"\" {rule}")
    );
    let long = "n".repeat(129);
    assert_eq!(
        error_of("id = \"node-a\"", &format!("id = \"{long}\"")),
        format!("conf/edge.toml: nodes[0].id: \"{long}\" {rule}")
    );
    assert_eq!(
        error_of("id = \"node-a\"", "id = \"..\""),
        "conf/edge.toml: nodes[0].id: \"..\" is not a valid name"
    );
    assert_eq!(
        error_of("name = \"vllm-main\"", "name = \"vllm main\""),
        format!("conf/edge.toml: nodes[0].adapters[0].name: \"vllm main\" {rule}")
    );
    assert_eq!(
        error_of("id = \"a-qwen\"", "id = \"a:qwen\""),
        format!("conf/edge.toml: nodes[0].providers[1].id: \"a:qwen\" {rule}")
    );
}

#[test]
fn a_128_character_node_id_is_accepted() {
    let long = "n".repeat(128);
    let text = variant("id = \"node-a\"", &format!("id = \"{long}\"")).replacen(
        "\"node-a/a-llama\"",
        &format!("\"{long}/a-llama\""),
        1,
    );
    let config = parse(&text).unwrap();
    assert_eq!(config.nodes[0].id, long);
    assert_eq!(config.models[0].providers[0].node_id, long);
}

#[test]
fn trust_domain_is_checked() {
    assert_eq!(
        error_of("trust_domain = \"iop.local\"", "trust_domain = \"IOP.local\""),
        "conf/edge.toml: edge.trust_domain: \"IOP.local\" must be 1 to 255 characters of a-z 0-9 . _ -"
    );
}

#[test]
fn listen_addresses_are_socket_addresses() {
    assert_eq!(
        error_of(
            "client_listen = \"127.0.0.1:8080\"",
            "client_listen = \"localhost:8080\""
        ),
        "conf/edge.toml: edge.client_listen: \"localhost:8080\" is not an IP:port socket address \
         (e.g. 127.0.0.1:8080)"
    );
    assert_eq!(
        error_of(
            "node_listen = \"127.0.0.1:7443\"",
            "node_listen = \"127.0.0.1\""
        ),
        "conf/edge.toml: edge.node_listen: \"127.0.0.1\" is not an IP:port socket address \
         (e.g. 127.0.0.1:8080)"
    );
    assert_eq!(
        error_of(
            "node_listen = \"127.0.0.1:7443\"",
            "node_listen = \"127.0.0.1:8080\""
        ),
        "conf/edge.toml: edge.node_listen: 127.0.0.1:8080 is also edge.client_listen"
    );
    let both_ephemeral = variant(
        "client_listen = \"127.0.0.1:8080\"",
        "client_listen = \"127.0.0.1:0\"",
    )
    .replacen(
        "node_listen = \"127.0.0.1:7443\"",
        "node_listen = \"127.0.0.1:0\"",
        1,
    );
    assert!(parse(&both_ephemeral).is_ok());
}

#[test]
fn frame_and_body_limits_are_in_range() {
    let edge = "node_listen = \"127.0.0.1:7443\"";
    assert_eq!(
        error_of(edge, &format!("{edge}\nmax_frame_bytes = 1000")),
        "conf/edge.toml: edge.max_frame_bytes: must be between 131072 and 1073741824 (got 1000)"
    );
    assert_eq!(
        error_of(
            edge,
            &format!("{edge}\nmax_frame_bytes = 1048576\nmax_request_body_bytes = 1048576")
        ),
        "conf/edge.toml: edge.max_request_body_bytes: must be between 1 and 983040 (got 1048576)"
    );
    assert_eq!(
        error_of(edge, &format!("{edge}\nmax_request_body_bytes = 0")),
        "conf/edge.toml: edge.max_request_body_bytes: must be between 1 and 16711680 (got 0)"
    );
    assert_eq!(
        error_of(edge, &format!("{edge}\nmax_frame_bytes = 1048576")),
        "conf/edge.toml: edge.max_request_body_bytes: the default 8388608 does not fit \
         edge.max_frame_bytes 1048576 minus 65536 bytes of headroom; set it to at most 983040"
    );
    let config = parse(&variant(
        edge,
        &format!("{edge}\nmax_frame_bytes = 1048576\nmax_request_body_bytes = 983040"),
    ))
    .unwrap();
    assert_eq!(
        (
            config.edge.max_frame_bytes,
            config.edge.max_request_body_bytes
        ),
        (1_048_576, 983_040)
    );
}

#[test]
fn drain_grace_defaults_and_is_in_range() {
    let edge = "node_listen = \"127.0.0.1:7443\"";
    assert_eq!(parse(BASE).unwrap().edge.drain_grace_ms, 30_000);
    assert_eq!(
        error_of(edge, &format!("{edge}\ndrain_grace_ms = -1")),
        "conf/edge.toml: edge.drain_grace_ms: must be between 0 and 3600000 (got -1)"
    );
    assert_eq!(
        error_of(edge, &format!("{edge}\ndrain_grace_ms = 3600001")),
        "conf/edge.toml: edge.drain_grace_ms: must be between 0 and 3600000 (got 3600001)"
    );
    assert_eq!(
        error_of(edge, &format!("{edge}\ndrain_grace_ms = \"5s\"")),
        "conf/edge.toml: edge.drain_grace_ms: invalid type: string \"5s\", expected i64 \
         (line 7, column 18)"
    );
    for (value, expected) in [("0", 0), ("3600000", 3_600_000), ("250", 250)] {
        let config = parse(&variant(edge, &format!("{edge}\ndrain_grace_ms = {value}"))).unwrap();
        assert_eq!(config.edge.drain_grace_ms, expected);
    }
}

#[test]
fn flow_window_and_write_stall_timeout_default_and_are_in_range() {
    let edge = "node_listen = \"127.0.0.1:7443\"";
    let base = parse(BASE).unwrap();
    assert_eq!(base.edge.flow_window_bytes, 262_144);
    assert_eq!(base.edge.client_write_stall_timeout_ms, 30_000);
    assert_eq!(
        error_of(edge, &format!("{edge}\nflow_window_bytes = 255")),
        "conf/edge.toml: edge.flow_window_bytes: must be between 256 and 16777216 (got 255)"
    );
    assert_eq!(
        error_of(edge, &format!("{edge}\nclient_write_stall_timeout_ms = 99")),
        "conf/edge.toml: edge.client_write_stall_timeout_ms: must be between 100 and 3600000 \
         (got 99)"
    );
    let config = parse(&variant(
        edge,
        &format!("{edge}\nflow_window_bytes = 65536\nclient_write_stall_timeout_ms = 2500"),
    ))
    .unwrap();
    assert_eq!(
        (
            config.edge.flow_window_bytes,
            config.edge.client_write_stall_timeout_ms
        ),
        (65_536, 2_500)
    );
}

#[test]
fn response_wait_timeout_defaults_and_is_in_range() {
    let edge = "node_listen = \"127.0.0.1:7443\"";
    assert_eq!(parse(BASE).unwrap().edge.response_wait_timeout_ms, 600_000);
    assert_eq!(
        error_of(edge, &format!("{edge}\nresponse_wait_timeout_ms = 99")),
        "conf/edge.toml: edge.response_wait_timeout_ms: must be between 100 and 86400000 \
         (got 99)"
    );
    let config = parse(&variant(
        edge,
        &format!("{edge}\nresponse_wait_timeout_ms = 1500"),
    ))
    .unwrap();
    assert_eq!(config.edge.response_wait_timeout_ms, 1_500);
}

#[test]
fn outlier_detection_and_max_attempts_default_parse_and_are_in_range() {
    let base = parse(BASE).unwrap();
    assert_eq!(base.outlier_detection, OutlierDetection::default());
    assert_eq!(
        base.outlier_detection,
        OutlierDetection {
            enabled: true,
            consecutive_failures: 5,
            base_ejection_time_ms: 30_000,
            max_ejection_time_ms: 300_000,
            max_ejection_percent: 50,
        }
    );
    assert_eq!(base.models[0].max_attempts, 2);
    let with = |table: &str| format!("{BASE}\n[outlier_detection]\n{table}\n");
    let config = parse(&with(
        "enabled = false\nconsecutive_failures = 3\nbase_ejection_time_ms = 500\n\
         max_ejection_time_ms = 2000\nmax_ejection_percent = 100",
    ))
    .unwrap();
    assert_eq!(
        config.outlier_detection,
        OutlierDetection {
            enabled: false,
            consecutive_failures: 3,
            base_ejection_time_ms: 500,
            max_ejection_time_ms: 2_000,
            max_ejection_percent: 100,
        }
    );
    // A base longer than the default maximum raises the maximum with it.
    let config = parse(&with("base_ejection_time_ms = 600000")).unwrap();
    assert_eq!(config.outlier_detection.max_ejection_time_ms, 600_000);
    for (table, why) in [
        (
            "consecutive_failures = 0",
            "outlier_detection.consecutive_failures: must be between 1 and 1000 (got 0)",
        ),
        (
            "max_ejection_percent = 101",
            "outlier_detection.max_ejection_percent: must be between 0 and 100 (got 101)",
        ),
        (
            "base_ejection_time_ms = 1000\nmax_ejection_time_ms = 999",
            "outlier_detection.max_ejection_time_ms: must be between 1000 and 86400000 (got 999)",
        ),
    ] {
        assert_eq!(error(&with(table)), format!("conf/edge.toml: {why}"));
    }
    assert!(error(&with("colour = 1"))
        .starts_with("conf/edge.toml: outlier_detection.colour: unknown field `colour`"));
    let model = "providers = [\"node-a/a-llama\"]";
    let config = parse(&variant(model, &format!("{model}\nmax_attempts = 1"))).unwrap();
    assert_eq!(config.models[0].max_attempts, 1);
    assert_eq!(
        error_of(model, &format!("{model}\nmax_attempts = 6")),
        "conf/edge.toml: models[0].max_attempts: must be between 1 and 5 (got 6)"
    );
}

#[test]
fn cluster_table_defaults_parse_and_refuse_bad_values() {
    assert_eq!(parse(BASE).unwrap().cluster, None);
    let with = |table: &str| format!("{BASE}\n[cluster]\n{table}\n");
    let config = parse(&with(
        "etcd_endpoints = [\"127.0.0.1:2379\", \"etcd-2:2379\"]",
    ))
    .unwrap();
    assert_eq!(
        config.cluster,
        Some(ClusterSpec {
            name: "default".into(),
            etcd_endpoints: vec!["127.0.0.1:2379".into(), "etcd-2:2379".into()],
            lease_ttl_sec: 10,
            keepalive_interval_sec: 3,
            etcd_timeout_ms: 2_000,
            peer_listen: None,
        })
    );
    let config = parse(&with(
        "name = \"prod\"\netcd_endpoints = [\"[::1]:2379\"]\nlease_ttl_sec = 4\n\
         keepalive_interval_sec = 2\netcd_timeout_ms = 500\npeer_listen = \"127.0.0.1:7444\"",
    ))
    .unwrap();
    assert_eq!(
        config.cluster,
        Some(ClusterSpec {
            name: "prod".into(),
            etcd_endpoints: vec!["[::1]:2379".into()],
            lease_ttl_sec: 4,
            keepalive_interval_sec: 2,
            etcd_timeout_ms: 500,
            peer_listen: Some("127.0.0.1:7444".parse().unwrap()),
        })
    );
    for (table, why) in [
        (
            "etcd_endpoints = []",
            "cluster.etcd_endpoints: list at least one etcd client endpoint (\"host:port\")",
        ),
        (
            "etcd_endpoints = [\"127.0.0.1\"]",
            "cluster.etcd_endpoints[0]: \"127.0.0.1\" is not host:port (e.g. 127.0.0.1:2379 or \
             etcd-1:2379)",
        ),
        (
            "etcd_endpoints = [\"a:2379\"]\nlease_ttl_sec = 4\nkeepalive_interval_sec = 3",
            "cluster.keepalive_interval_sec: must be at most half of lease_ttl_sec (4): the edge \
             fences what it owns lease_ttl_sec - keepalive_interval_sec after the last \
             acknowledged keep-alive",
        ),
        (
            "etcd_endpoints = [\"a:2379\"]\nlease_ttl_sec = 0",
            "cluster.lease_ttl_sec: must be between 1 and 3600 (got 0)",
        ),
        (
            "etcd_endpoints = [\"a:2379\"]\nname = \"a/b\"",
            "cluster.name: ",
        ),
        (
            "etcd_endpoints = [\"a:2379\"]\npeer_listen = \"peer:7444\"",
            "cluster.peer_listen: \"peer:7444\" is not an IP:port socket address",
        ),
    ] {
        let got = error(&with(table));
        assert!(
            got.starts_with(&format!("conf/edge.toml: {why}")),
            "{table}: {got}"
        );
    }
    // The peer listener serves other Edges with the [tls] identity.
    let insecure = BASE
        .replace(
            "[tls]\nca = \"certs/ca.pem\"\ncert = \"certs/edge.pem\"\nkey = \"certs/edge-key.pem\"\n",
            "",
        )
        .replace(
            "node_listen = \"127.0.0.1:7443\"\n",
            "node_listen = \"127.0.0.1:7443\"\ninsecure_plaintext_nodes = true\n",
        );
    let insecure_peer = format!(
        "{insecure}\n[cluster]\netcd_endpoints = [\"a:2379\"]\npeer_listen = \"127.0.0.1:7444\"\n"
    );
    assert_eq!(
        error(&insecure_peer),
        "conf/edge.toml: cluster.peer_listen: needs [tls]: other Edges are served over mTLS \
         with this Edge's identity"
    );
    let insecure_no_peer = format!("{insecure}\n[cluster]\netcd_endpoints = [\"a:2379\"]\n");
    assert_eq!(
        parse(&insecure_no_peer)
            .unwrap()
            .cluster
            .unwrap()
            .peer_listen,
        None
    );
}

#[test]
fn front_door_limits_default_parse_and_are_in_range() {
    let edge = "node_listen = \"127.0.0.1:7443\"";
    assert_eq!(parse(BASE).unwrap().edge.limits, ListenerLimits::default());
    let all = format!(
        "{edge}\nclient_head_timeout_ms = 1\nclient_body_idle_timeout_ms = 2\n\
         client_keep_alive_timeout_ms = 3\nmax_client_connections = 4\n\
         client_linger_time_ms = 0\nclient_linger_idle_timeout_ms = 6\n\
         client_linger_max_bytes = 7\nnode_handshake_timeout_ms = 8\n\
         max_node_handshakes = 9\nmax_json_depth = 10\nmax_json_elements = 11\n\
         client_body_grace_ms = 12\nclient_body_min_rate_bytes_per_sec = 0\n\
         max_client_connections_per_peer = 14\nmax_node_handshakes_per_peer = 15\n\
         node_first_byte_timeout_ms = 16\nmax_json_members = 17"
    );
    assert_eq!(
        parse(&variant(edge, &all)).unwrap().edge.limits,
        ListenerLimits {
            client_head_timeout_ms: 1,
            client_body_idle_timeout_ms: 2,
            client_body_grace_ms: 12,
            client_body_min_rate_bytes_per_sec: 0,
            client_keep_alive_timeout_ms: 3,
            max_client_connections: 4,
            max_client_connections_per_peer: 14,
            client_linger_time_ms: 0,
            client_linger_idle_timeout_ms: 6,
            client_linger_max_bytes: 7,
            node_handshake_timeout_ms: 8,
            max_node_handshakes: 9,
            max_node_handshakes_per_peer: 15,
            node_first_byte_timeout_ms: 16,
            max_json_depth: 10,
            max_json_elements: 11,
            max_json_members: 17,
        }
    );
    for (key, bad, range) in [
        ("client_head_timeout_ms", "0", "1 and 3600000"),
        ("client_body_idle_timeout_ms", "3600001", "1 and 3600000"),
        ("client_keep_alive_timeout_ms", "-5", "1 and 3600000"),
        ("max_client_connections", "0", "1 and 1000000"),
        ("client_linger_time_ms", "-1", "0 and 3600000"),
        ("client_linger_idle_timeout_ms", "0", "1 and 3600000"),
        (
            "client_linger_max_bytes",
            "17179869185",
            "0 and 17179869184",
        ),
        ("node_handshake_timeout_ms", "0", "1 and 3600000"),
        ("max_node_handshakes", "1000001", "1 and 1000000"),
        ("max_json_depth", "129", "1 and 128"),
        ("max_json_elements", "0", "1 and 16000000"),
        ("client_body_grace_ms", "0", "1 and 3600000"),
        (
            "client_body_min_rate_bytes_per_sec",
            "1073741825",
            "0 and 1073741824",
        ),
        ("max_client_connections_per_peer", "0", "1 and 1000000"),
        ("max_node_handshakes_per_peer", "0", "1 and 1000000"),
        ("node_first_byte_timeout_ms", "0", "1 and 3600000"),
        ("max_json_members", "16000001", "1 and 16000000"),
    ] {
        assert_eq!(
            error_of(edge, &format!("{edge}\n{key} = {bad}")),
            format!("conf/edge.toml: edge.{key}: must be between {range} (got {bad})")
        );
    }
}

#[test]
fn an_edge_without_client_keys_must_say_it_runs_open() {
    let no_keys = parse(BASE).unwrap();
    assert!(no_keys.client_keys.is_empty());
    assert_eq!(
        no_keys.check_open_access().unwrap_err().to_string(),
        "conf/edge.toml: client_keys: no client key is configured, so every client would be \
         served without one; add [[client_keys]], or set edge.allow_anonymous = true to run open"
    );
    let edge = "node_listen = \"127.0.0.1:7443\"";
    let open = parse(&variant(edge, &format!("{edge}\nallow_anonymous = true"))).unwrap();
    assert!(open.edge.allow_anonymous);
    assert_eq!(open.check_open_access(), Ok(()));
}

#[test]
fn the_nodes_metrics_cache_age_defaults_to_five_seconds_and_is_bounded() {
    let edge = "node_listen = \"127.0.0.1:7443\"";
    assert_eq!(parse(BASE).unwrap().edge.node_metrics_max_age_ms, 5_000);
    let off = parse(&variant(
        edge,
        &format!("{edge}\nnode_metrics_max_age_ms = 0"),
    ))
    .unwrap();
    assert_eq!(off.edge.node_metrics_max_age_ms, 0);
    assert_eq!(
        error_of(edge, &format!("{edge}\nnode_metrics_max_age_ms = 600001")),
        "conf/edge.toml: edge.node_metrics_max_age_ms: must be between 0 and 600000 (got 600001)"
    );
}

#[test]
fn tls_is_required_unless_insecure() {
    let tls =
        "[tls]\nca = \"certs/ca.pem\"\ncert = \"certs/edge.pem\"\nkey = \"certs/edge-key.pem\"\n";
    assert_eq!(
        error_of(tls, ""),
        "conf/edge.toml: tls: required unless edge.insecure_plaintext_nodes = true"
    );
    assert_eq!(
        error_of("cert = \"certs/edge.pem\"", "cert = \"\""),
        "conf/edge.toml: tls.cert: must not be empty"
    );
    // CONTRACT: T5 — plain TCP only behind the explicit flag; no TLS files then.
    let insecure = variant(tls, "").replacen(
        "node_listen = \"127.0.0.1:7443\"",
        "node_listen = \"127.0.0.1:7443\"\ninsecure_plaintext_nodes = true",
        1,
    );
    let config = parse(&insecure).unwrap();
    assert!(config.edge.insecure_plaintext_nodes);
    assert_eq!(config.tls, None);
    assert_eq!(config.validate_files(), Ok(()));
}

#[test]
fn tls_paths_resolve_against_the_config_directory() {
    let config = parse(&variant(
        "key = \"certs/edge-key.pem\"",
        "key = \"/etc/iop/edge-key.pem\"",
    ))
    .unwrap();
    assert_eq!(
        config.tls,
        Some(TlsFiles {
            ca: PathBuf::from("conf/certs/ca.pem"),
            cert: PathBuf::from("conf/certs/edge.pem"),
            key: PathBuf::from("/etc/iop/edge-key.pem"),
        })
    );
    let bare = EdgeConfig::parse(BASE, "edge.toml").unwrap();
    assert_eq!(bare.tls.map(|t| t.ca), Some(PathBuf::from("certs/ca.pem")));
}

#[test]
fn validate_files_accepts_readable_files() {
    let config = EdgeConfig::parse(BASE, fixture("edge.toml")).unwrap();
    assert_eq!(config.validate_files(), Ok(()));
}

#[test]
fn validate_files_names_the_key_and_path() {
    let config = EdgeConfig::parse(BASE, "/nonexistent-iop/edge.toml").unwrap();
    assert_eq!(
        config.validate_files().unwrap_err().to_string(),
        "/nonexistent-iop/edge.toml: tls.ca: cannot read /nonexistent-iop/certs/ca.pem: \
         No such file or directory (os error 2)"
    );
    // A directory is not a readable file.
    let dir = fixture("");
    let text = variant("cert = \"certs/edge.pem\"", "cert = \"certs\"");
    let config = EdgeConfig::parse(&text, fixture("edge.toml")).unwrap();
    assert_eq!(
        config.validate_files().unwrap_err().to_string(),
        format!(
            "{}: tls.cert: cannot read {}: not a regular file",
            fixture("edge.toml").display(),
            dir.join("certs").display()
        )
    );
}

#[test]
fn load_reads_parses_and_checks_files() {
    assert_eq!(
        EdgeConfig::load("/nonexistent-iop/edge.toml").unwrap_err().to_string(),
        "/nonexistent-iop/edge.toml: -: cannot read config file: No such file or directory (os error 2)"
    );
    let config = EdgeConfig::load(fixture("edge.toml")).unwrap();
    assert_eq!(config.source, fixture("edge.toml"));
    assert_eq!(config.models[0].name, "qwen2.5-7b");
}

/// A directory of its own under the system's temporary directory.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("iop-config-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The fixture file (its TLS files by absolute path) with these lines
/// added, written as `dir/edge.toml`.
fn fixture_with(dir: &Path, extra: &str) -> PathBuf {
    let text = std::fs::read_to_string(fixture("edge.toml"))
        .unwrap()
        .replace("\"certs/", &format!("\"{}/", fixture("certs").display()));
    let path = dir.join("edge.toml");
    std::fs::write(&path, format!("{text}\n{extra}")).unwrap();
    path
}

// The files the Edge writes are checked apart from the rest: a file whose
// only faults are those paths passes `load_structure` (what a reload
// applies), while `load` (startup, check-config) fails on the first one.
#[test]
fn operational_paths_are_checked_apart_from_the_structure() {
    let dir = temp_dir("operational");
    let (missing, usage) = (dir.join("missing/access.log"), dir.join("usage-dir"));
    std::fs::create_dir(&usage).unwrap();
    let path = fixture_with(
        &dir,
        &format!(
            "[edge.access_log]\ndestination = \"{}\"\n\n[edge.usage_log]\npath = \"{}\"\n",
            missing.display(),
            usage.display()
        ),
    );
    let config = EdgeConfig::load_structure(&path).unwrap();
    assert_eq!(config.usage_log.as_deref(), Some(usage.as_path()));
    let broken = vec![
        BrokenPath {
            part: OperationalPath::AccessLog,
            error: ConfigError::new(
                &path,
                "edge.access_log.destination",
                format!(
                    "cannot open {} for appending: No such file or directory (os error 2)",
                    missing.display()
                ),
            ),
        },
        BrokenPath {
            part: OperationalPath::UsageLog,
            error: ConfigError::new(
                &path,
                "edge.usage_log.path",
                format!(
                    "cannot open {} for appending: Is a directory (os error 21)",
                    usage.display()
                ),
            ),
        },
    ];
    assert_eq!(config.check_operational_paths(), broken);
    assert_eq!(EdgeConfig::load(&path), Err(broken[0].error.clone()));
    // Fixed paths: nothing is broken, and load gives what load_structure
    // gives (the files now exist, created by the check).
    std::fs::create_dir(missing.parent().unwrap()).unwrap();
    std::fs::remove_dir(&usage).unwrap();
    assert_eq!(config.check_operational_paths(), Vec::new());
    assert_eq!(EdgeConfig::load(&path), Ok(config));
    assert!(missing.is_file() && usage.is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

// Any other fault still refuses the file in `load_structure`, whatever the
// operational paths are: a reload of it changes nothing.
#[test]
fn a_structural_fault_fails_the_structure_too() {
    let dir = temp_dir("structural");
    let usage = dir.join("usage-dir");
    std::fs::create_dir(&usage).unwrap();
    let path = fixture_with(
        &dir,
        &format!("[edge.usage_log]\npath = \"{}\"\n", usage.display()),
    );
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("capacity = 1", "capacity = 0");
    std::fs::write(&path, text).unwrap();
    let error = EdgeConfig::load_structure(&path).unwrap_err();
    assert_eq!(error, EdgeConfig::load(&path).unwrap_err());
    assert_eq!(
        error.to_string(),
        format!(
            "{}: nodes[0].providers[0].capacity: must be between 1 and 65536 (got 0)",
            path.display()
        )
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn routing_defaults_to_prefix_for_two_openai_compatible_providers_and_is_checked() {
    let base = parse(BASE).unwrap();
    assert_eq!(base.routing, RoutingSettings::default());
    assert_eq!(
        base.models[0].routing,
        RoutingPolicy::LeastLoaded,
        "one provider"
    );
    let second = "[[nodes.providers]]\nid = \"a-llama-2\"\nadapter = \"vllm-main\"\n\
                  target = \"meta-llama/Llama-3.1-8B-Instruct\"\ncapacity = 8\n\n[[models]]";
    let pool =
        |providers: &str| variant("[[models]]", second).replace("[\"node-a/a-llama\"]", providers);
    let two = parse(&pool("[\"node-a/a-llama\", \"node-a/a-llama-2\"]")).unwrap();
    assert_eq!(two.models[0].routing, RoutingPolicy::Prefix);
    // An Ollama provider keeps no cache the tree can know of.
    let mixed = parse(&pool("[\"node-a/a-llama\", \"node-a/a-qwen\"]")).unwrap();
    assert_eq!(mixed.models[0].routing, RoutingPolicy::LeastLoaded);
    for (text, policy) in [
        ("least_loaded", RoutingPolicy::LeastLoaded),
        ("session", RoutingPolicy::Session),
        ("prefix", RoutingPolicy::Prefix),
    ] {
        let model = "providers = [\"node-a/a-llama\"]";
        let config = parse(&variant(model, &format!("{model}\nrouting = \"{text}\""))).unwrap();
        assert_eq!(config.models[0].routing, policy);
    }
    let model = "providers = [\"node-a/a-llama\"]";
    assert_eq!(
        error(&variant(model, &format!("{model}\nrouting = \"random\""))),
        "conf/edge.toml: models[0].routing: \"random\": expected \"least_loaded\", \"session\" \
         or \"prefix\""
    );
    let with = |table: &str| format!("{BASE}\n[routing]\n{table}\n");
    assert_eq!(
        parse(&with(
            "prefix_tree_bytes = 65536\nprefix_bytes_max = 1\nmatch_threshold_percent = 0\n\
             balance_abs_threshold = 0\nbalance_rel_threshold_percent = 100\naffinity_wait_ms = 0"
        ))
        .unwrap()
        .routing,
        RoutingSettings {
            prefix_tree_bytes: 65_536,
            prefix_bytes_max: 1,
            match_threshold_percent: 0,
            balance_abs_threshold: 0,
            balance_rel_threshold_percent: 100,
            affinity_wait_ms: 0,
        }
    );
    for (table, why) in [
        (
            "prefix_tree_bytes = 1024",
            "routing.prefix_tree_bytes: must be between 65536 and 4294967296 (got 1024)",
        ),
        (
            "prefix_bytes_max = 0",
            "routing.prefix_bytes_max: must be between 1 and 1048576 (got 0)",
        ),
        (
            "match_threshold_percent = 101",
            "routing.match_threshold_percent: must be between 0 and 100 (got 101)",
        ),
        (
            "affinity_wait_ms = 60001",
            "routing.affinity_wait_ms: must be between 0 and 60000 (got 60001)",
        ),
        (
            "balance_rel_threshold_percent = 99",
            "routing.balance_rel_threshold_percent: must be between 100 and 10000 (got 99)",
        ),
    ] {
        assert_eq!(error(&with(table)), format!("conf/edge.toml: {why}"));
    }
}

#[test]
fn the_tracing_table_is_off_by_default_and_its_values_are_checked() {
    assert_eq!(parse(BASE).unwrap().tracing, None);
    let on = parse(&format!(
        "{BASE}\n[tracing]\notlp_endpoint = \"http://127.0.0.1:4318/otel\"\nsample_ratio = 0\n"
    ))
    .unwrap()
    .tracing
    .expect("on");
    assert_eq!(on.otlp_endpoint.traces_path(), "/otel/v1/traces");
    assert_eq!(on.sample_ratio, 0.0);
    assert_eq!(on.service_name, DEFAULT_TRACING_SERVICE_NAME);
    let cases = [
        (
            "otlp_endpoint = \"http://c:4318\"\nsample_ratio = 1.5",
            "conf/edge.toml: tracing.sample_ratio: 1.5 is not from 0.0 to 1.0",
        ),
        (
            "otlp_endpoint = \"https://c:4318\"",
            "conf/edge.toml: tracing.otlp_endpoint: https is not supported: give the http:// \
             address of a collector or agent on a trusted network (e.g. http://127.0.0.1:4318)",
        ),
        (
            "sample_ratio = 0.5",
            "conf/edge.toml: tracing.otlp_endpoint: sample_ratio and service_name need \
             otlp_endpoint (tracing is off without it)",
        ),
        (
            "otlp_endpoint = \"http://c:4318\"\nservice_name = \"\"",
            "conf/edge.toml: tracing.service_name: must be 1 to 128 bytes without control \
             characters",
        ),
    ];
    for (table, message) in cases {
        assert_eq!(error(&format!("{BASE}\n[tracing]\n{table}\n")), message);
    }
}
