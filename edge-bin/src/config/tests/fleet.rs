//! Nodes, adapters, providers, models and protocol profiles.

use super::*;

#[test]
fn duplicates_are_rejected() {
    assert_eq!(
        error(&format!("{BASE}\n[[nodes]]\nid = \"node-a\"\n")),
        "conf/edge.toml: nodes[1].id: duplicate node id \"node-a\" (also nodes[0])"
    );
    assert_eq!(
        error_of("name = \"vllm-main\"", "name = \"ollama\""),
        "conf/edge.toml: nodes[0].adapters[1].name: duplicate adapter name \"ollama\" on node \"node-a\" \
         (also nodes[0].adapters[0])"
    );
    assert_eq!(
        error_of("id = \"a-qwen\"", "id = \"a-llama\""),
        "conf/edge.toml: nodes[0].providers[1].id: duplicate provider id \"a-llama\" on node \"node-a\" \
         (also nodes[0].providers[0])"
    );
    assert_eq!(
        error(&format!(
            "{BASE}\n[[models]]\nname = \"llama-3.1-8b\"\nproviders = [\"node-a/a-qwen\"]\n"
        )),
        "conf/edge.toml: models[1].name: duplicate model name \"llama-3.1-8b\" (also models[0])"
    );
    // The same provider id on two nodes is fine.
    let second_node = format!(
        "{BASE}\n[[nodes]]\nid = \"node-b\"\n[[nodes.adapters]]\nkind = \"ollama\"\n\
         base_url = \"http://10.0.0.2:11434\"\n[[nodes.providers]]\nid = \"a-qwen\"\n\
         adapter = \"ollama\"\ntarget = \"qwen2.5:7b\"\ncapacity = 1\n"
    );
    assert_eq!(parse(&second_node).unwrap().nodes.len(), 2);
}

#[test]
fn adapter_kind_and_profile_are_checked() {
    assert_eq!(
        error_of("kind = \"ollama\"", "kind = \"tgi\""),
        "conf/edge.toml: nodes[0].adapters[1].kind: unknown adapter kind \"tgi\": \
         expected \"openai_compat\" or \"ollama\""
    );
    assert_eq!(
        error_of("profile = \"vllm\"", "profile = \"vLLM\""),
        "conf/edge.toml: nodes[0].adapters[0].profile: unknown profile \"vLLM\": \
         expected \"openai\", \"vllm\", \"llama_cpp\" or \"sglang\""
    );
    assert_eq!(
        error_of("kind = \"ollama\"", "kind = \"ollama\"\nprofile = \"vllm\""),
        "conf/edge.toml: nodes[0].adapters[1].profile: only an openai_compat adapter has a profile"
    );
    assert_eq!(
        error_of("capacity = 8\n\n", "capacity = -1\n\n"),
        "conf/edge.toml: nodes[0].adapters[0].capacity: must be between 0 and 65536 (got -1)"
    );
}

#[test]
fn base_url_must_be_http_host_port_or_https() {
    let url = "base_url = \"http://127.0.0.1:8000\"";
    let key = "conf/edge.toml: nodes[0].adapters[0].base_url:";
    let cases = [
        (
            "ftp://api.openai.com:443",
            "\"ftp://api.openai.com:443\": expected http://host:port[/prefix] or https://host[:port][/prefix]",
        ),
        (
            "https://[::1:8443",
            "\"https://[::1:8443\": unclosed [ in host; expected http://host:port[/prefix] or https://host[:port][/prefix]",
        ),
        ("127.0.0.1:8000", "\"127.0.0.1:8000\": expected http://host:port[/prefix] or https://host[:port][/prefix]"),
        (
            "http://127.0.0.1",
            "\"http://127.0.0.1\": missing :port; expected http://host:port[/prefix] or https://host[:port][/prefix]",
        ),
        (
            "http://127.0.0.1:0",
            "\"http://127.0.0.1:0\": \"0\" is not a port (1-65535); expected http://host:port[/prefix] or https://host[:port][/prefix]",
        ),
        (
            "http://h:8000/x?y=1",
            "\"http://h:8000/x?y=1\": must not have a query or fragment; expected http://host:port[/prefix] or https://host[:port][/prefix]",
        ),
        (
            "http://u:p@h:8000",
            "\"http://u:p@h:8000\": must not contain user info; expected http://host:port[/prefix] or https://host[:port][/prefix]",
        ),
        (
            "http://h_1:8000",
            "\"http://h_1:8000\": \"h_1\" is not a host name or IP address; expected http://host:port[/prefix] or https://host[:port][/prefix]",
        ),
        (
            "http://[::1:8000",
            "\"http://[::1:8000\": unclosed [ in host; expected http://host:port[/prefix] or https://host[:port][/prefix]",
        ),
        (
            "http://h:8000//x",
            "\"http://h:8000//x\": path has an empty segment; expected http://host:port[/prefix] or https://host[:port][/prefix]",
        ),
        (
            "http://h:8000/v1",
            "\"http://h:8000/v1\": drop the trailing /v1: operation paths already start with /v1",
        ),
    ];
    for (bad, reason) in cases {
        assert_eq!(
            error_of(url, &format!("base_url = \"{bad}\"")),
            format!("{key} {reason}")
        );
    }
}

#[test]
fn base_url_parts() {
    let url = base_url("HTTP://gpu-1.lan:8000/serving/");
    assert_eq!(
        (url.host(), url.port(), url.path_prefix()),
        ("gpu-1.lan", 8000, "/serving")
    );
    assert_eq!(url.origin(), "http://gpu-1.lan:8000");
    assert_eq!(url.to_string(), "http://gpu-1.lan:8000/serving");
    assert_eq!(url.join("/health"), "/serving/health");
    let v6 = base_url("http://[::1]:11434");
    assert_eq!((v6.host(), v6.port(), v6.path_prefix()), ("::1", 11434, ""));
    assert_eq!(v6.to_string(), "http://[::1]:11434");
    assert_eq!(base_url("http://h:1/").to_string(), "http://h:1");
    let hosted = base_url("HTTPS://API.openai.com");
    assert!(hosted.is_tls());
    assert_eq!((hosted.host(), hosted.port()), ("API.openai.com", 443));
    assert_eq!(hosted.origin(), "https://api.openai.com:443");
    let gateway = base_url("https://[::1]:8443/gw/");
    assert_eq!((gateway.host(), gateway.port()), ("::1", 8443));
    assert_eq!(gateway.to_string(), "https://[::1]:8443/gw");
    assert!(!base_url("http://h:1").is_tls());
    assert_eq!(
        BaseUrl::parse("httpé://h:1"),
        Err(
            "\"httpé://h:1\": expected http://host:port[/prefix] or https://host[:port][/prefix]"
                .to_owned()
        )
    );
}

#[test]
fn provider_values_are_checked() {
    let key = "conf/edge.toml: nodes[0].providers[1]";
    assert_eq!(
        error_of("capacity = 4\n", "capacity = 0\n"),
        format!("{key}.capacity: must be between 1 and 65536 (got 0)")
    );
    assert_eq!(
        error_of("capacity = 4\n", "capacity = 4\nlong_context_capacity = 5\n"),
        format!("{key}.long_context_capacity: must be between 0 and 4 (got 5) (it may not exceed capacity)")
    );
    assert_eq!(
        error_of(
            "capacity = 4\n",
            "capacity = 4\nresponse_stall_timeout_ms = -1\n"
        ),
        format!("{key}.response_stall_timeout_ms: must not be negative (got -1)")
    );
    assert_eq!(
        error_of(
            "capacity = 4\n",
            "capacity = 4\nresponse_stall_timeout_ms = 9223372036855\n"
        ),
        format!(
            "{key}.response_stall_timeout_ms: 9223372036855 overflows a nanosecond duration \
             (max 9223372036854)"
        )
    );
    assert_eq!(
        error_of("capacity = 4\n", "capacity = 4\ncategory = \"cloud\"\n"),
        format!(
            "{key}.category: unknown category \"cloud\": expected \"api\" or \"local_inference\""
        )
    );
    assert_eq!(
        error_of("target = \"qwen2.5:7b\"", "target = \"\""),
        format!("{key}.target: must not be empty")
    );
    assert_eq!(
        error_of("adapter = \"ollama\"", "adapter = \"olama\""),
        format!("{key}.adapter: node \"node-a\" has no adapter named \"olama\"")
    );
}

#[test]
fn model_references_resolve() {
    let refs = "providers = [\"node-a/a-llama\"]";
    let key = "conf/edge.toml: models[0].providers";
    assert_eq!(
        error_of(refs, "providers = []"),
        format!(
            "{key}: must list at least one provider (allow_no_providers = true serves the \
             model with none: every request gets 503 no_provider_available)"
        )
    );
    // Said explicitly: a model without providers (e.g. while its last node
    // is replaced by a reload).
    let empty = parse(&variant(refs, "providers = []\nallow_no_providers = true")).unwrap();
    assert!(empty.models[0].providers.is_empty());
    assert_eq!(
        error_of(refs, "providers = [\"a-llama\"]"),
        format!("{key}[0]: \"a-llama\": expected \"<node id>/<provider id>\"")
    );
    assert_eq!(
        error_of(refs, "providers = [\"node-a/a-llama\", \"node-z/a-llama\"]"),
        format!("{key}[1]: \"node-z/a-llama\": no node \"node-z\" is configured")
    );
    assert_eq!(
        error_of(refs, "providers = [\"node-a/a-mistral\"]"),
        format!("{key}[0]: \"node-a/a-mistral\": node \"node-a\" has no provider \"a-mistral\"")
    );
    assert_eq!(
        error_of(refs, "providers = [\"node-a/a-llama\", \"node-a/a-llama\"]"),
        format!("{key}[1]: \"node-a/a-llama\" is listed twice (also models[0].providers[0])")
    );
    let config = parse(&variant(
        refs,
        "providers = [\"node-a/a-llama\", \"node-a/a-qwen\"]",
    ))
    .unwrap();
    let listed: Vec<String> = config.models[0]
        .providers
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(listed, ["node-a/a-llama", "node-a/a-qwen"]);
}

#[test]
fn model_values_are_checked() {
    let refs = "providers = [\"node-a/a-llama\"]";
    let key = "conf/edge.toml: models[0]";
    assert_eq!(
        error_of(refs, &format!("{refs}\nlong_context_threshold_tokens = 0")),
        format!("{key}.long_context_threshold_tokens: must be between 1 and 100000000 (got 0)")
    );
    assert_eq!(
        error_of(refs, &format!("{refs}\nmax_queue = 0")),
        format!("{key}.max_queue: must be between 1 and 1000000 (got 0)")
    );
    assert_eq!(
        error_of(refs, &format!("{refs}\nqueue_timeout_ms = -5")),
        format!("{key}.queue_timeout_ms: must be between 1 and 86400000 (got -5)")
    );
    assert_eq!(
        error_of(refs, &format!("{refs}\nowned_by = \"\"")),
        format!("{key}.owned_by: must not be empty")
    );
    assert_eq!(
        error_of("name = \"llama-3.1-8b\"", "name = \"llama\\u0007\""),
        format!("{key}.name: \"llama\\u{{7}}\" must not contain control characters")
    );
    let long = "m".repeat(513);
    assert_eq!(
        error_of("name = \"llama-3.1-8b\"", &format!("name = \"{long}\"")),
        format!("{key}.name: must be at most 512 bytes (got 513)")
    );
}

#[test]
fn profile_table() {
    let url = base_url("http://10.1.2.3:8000");
    for profile in ProfileName::ALL {
        let spec = protocol_profile(profile, &url);
        let health = if profile == ProfileName::OpenAi {
            "/v1/models"
        } else {
            "/health"
        };
        // The operations beyond the chat family each profile serves.
        let served = |path: &str, by: &[ProfileName]| {
            if by.contains(&profile) {
                path.to_owned()
            } else {
                String::new()
            }
        };
        let not_openai = [
            ProfileName::Vllm,
            ProfileName::LlamaCpp,
            ProfileName::Sglang,
        ];
        assert_eq!(
            spec,
            ProtocolProfileSpec {
                name: profile,
                base_url: "http://10.1.2.3:8000".into(),
                models_path: "/v1/models".into(),
                chat_completions_path: "/v1/chat/completions".into(),
                messages_path: "/v1/messages".into(),
                count_tokens_path: "/v1/messages/count_tokens".into(),
                responses_path: "/v1/responses".into(),
                completions_path: "/v1/completions".into(),
                embeddings_path: "/v1/embeddings".into(),
                rerank_path: served("/v1/rerank", &not_openai),
                score_path: served("/v1/score", &[ProfileName::Vllm, ProfileName::Sglang]),
                tokenize_path: served("/tokenize", &not_openai),
                detokenize_path: served("/detokenize", &not_openai),
                transcriptions_path: served(
                    "/v1/audio/transcriptions",
                    &[ProfileName::OpenAi, ProfileName::Vllm],
                ),
                translations_path: served(
                    "/v1/audio/translations",
                    &[ProfileName::OpenAi, ProfileName::Vllm],
                ),
                speech_path: served("/v1/audio/speech", &[ProfileName::OpenAi]),
                health_path: health.into(),
                auth_header_name: "Authorization".into(),
                auth_header_format: "Bearer {secret}".into(),
            }
        );
        assert_eq!(ProfileName::from_name(profile.as_str()), Some(profile));
    }
    let names: Vec<&str> = ProfileName::ALL.iter().map(ProfileName::as_str).collect();
    assert_eq!(names, ["openai", "vllm", "llama_cpp", "sglang"]);
    assert_eq!(ProfileName::from_name("tgi"), None);
}

#[test]
fn an_adapter_health_path_replaces_the_profiles() {
    let adapter = "base_url = \"http://127.0.0.1:8000\"\ncapacity = 8";
    let config = parse(&variant(
        adapter,
        "base_url = \"http://127.0.0.1:8000/llama\"\ncapacity = 8\nhealth_path = \"/v1/models\"",
    ))
    .unwrap();
    let spec = config.nodes[0].adapters[0].protocol_profile().unwrap();
    assert_eq!(spec.health_path, "/llama/v1/models");
    assert_eq!(spec.models_path, "/llama/v1/models");
    let payload = config.node_config_payload(&config.nodes[0], 1);
    let Some(pb::adapter_config::Kind::OpenaiCompat(oa)) = &payload.adapters[0].kind else {
        panic!("an openai_compat adapter");
    };
    assert_eq!(
        oa.protocol_profile.as_ref().unwrap().health_path,
        "/llama/v1/models"
    );
    // Without one, the profile's.
    let base = parse(BASE).unwrap();
    assert_eq!(
        base.nodes[0].adapters[0]
            .protocol_profile()
            .unwrap()
            .health_path,
        "/health"
    );
    assert_eq!(base.nodes[0].adapters[1].protocol_profile(), None);
    let key = "conf/edge.toml: nodes[0].adapters[0].health_path";
    for (bad, why) in [
        ("health", "must start with `/` (got \"health\")"),
        (
            "/health?x=1",
            "must be a plain path: printable ASCII without spaces, `?` or `#` (found '?')",
        ),
        (
            "/he alth",
            "must be a plain path: printable ASCII without spaces, `?` or `#` (found ' ')",
        ),
    ] {
        assert_eq!(
            error_of(adapter, &format!("{adapter}\nhealth_path = \"{bad}\"")),
            format!("{key}: {why}")
        );
    }
    assert_eq!(
        error_of(
            "kind = \"ollama\"",
            "kind = \"ollama\"\nhealth_path = \"/api/version\""
        ),
        "conf/edge.toml: nodes[0].adapters[1].health_path: only an openai_compat adapter \
         has a health path (Ollama's is /api/tags)"
    );
}

#[test]
fn profile_paths_sit_under_the_base_url_prefix() {
    let spec = protocol_profile(ProfileName::Sglang, &base_url("http://gw:80/sglang/a"));
    assert_eq!(spec.base_url, "http://gw:80");
    assert_eq!(spec.models_path, "/sglang/a/v1/models");
    assert_eq!(spec.chat_completions_path, "/sglang/a/v1/chat/completions");
    assert_eq!(spec.messages_path, "/sglang/a/v1/messages");
    assert_eq!(spec.count_tokens_path, "/sglang/a/v1/messages/count_tokens");
    assert_eq!(spec.responses_path, "/sglang/a/v1/responses");
    assert_eq!(spec.completions_path, "/sglang/a/v1/completions");
    assert_eq!(spec.embeddings_path, "/sglang/a/v1/embeddings");
    assert_eq!(spec.rerank_path, "/sglang/a/v1/rerank");
    assert_eq!(spec.score_path, "/sglang/a/v1/score");
    assert_eq!(spec.tokenize_path, "/sglang/a/tokenize");
    assert_eq!(spec.detokenize_path, "/sglang/a/detokenize");
    assert_eq!(spec.health_path, "/sglang/a/health");
}

#[test]
fn node_config_payload_carries_adapters_targets_and_profiles() {
    // CONTRACT: U4 — the resolved profile travels in
    // OpenAICompatAdapterConfig.protocol_profile of NodeConfigPayload.
    let text = variant(
        "capacity = 4\n",
        "capacity = 4\n\n[[nodes.providers]]\nid = \"a-llama-long\"\nadapter = \"vllm-main\"\n\
         target = \"meta-llama/Llama-3.1-8B-Instruct\"\ncapacity = 1\n\n[[nodes.providers]]\n\
         id = \"a-phi\"\nadapter = \"vllm-main\"\ntarget = \"phi-4\"\ncapacity = 1\n",
    );
    let config = parse(&text).unwrap();
    let payload = config.node("node-a").unwrap().config_payload(7, true);
    let expected = pb::NodeConfigPayload {
        runtime: Some(pb::NodeRuntimeConfig::default()),
        adapters: vec![
            pb::AdapterConfig {
                tls: None,
                name: "vllm-main".into(),
                capacity: 8,
                targets: vec!["meta-llama/Llama-3.1-8B-Instruct".into(), "phi-4".into()],
                kind: Some(pb::adapter_config::Kind::OpenaiCompat(
                    pb::OpenAiCompatAdapterConfig {
                        protocol_profile: Some(pb::ProtocolProfile {
                            name: "vllm".into(),
                            base_url: "http://127.0.0.1:8000".into(),
                            models_path: "/v1/models".into(),
                            chat_completions_path: "/v1/chat/completions".into(),
                            messages_path: "/v1/messages".into(),
                            count_tokens_path: "/v1/messages/count_tokens".into(),
                            responses_path: "/v1/responses".into(),
                            completions_path: "/v1/completions".into(),
                            embeddings_path: "/v1/embeddings".into(),
                            rerank_path: "/v1/rerank".into(),
                            score_path: "/v1/score".into(),
                            tokenize_path: "/tokenize".into(),
                            detokenize_path: "/detokenize".into(),
                            transcriptions_path: "/v1/audio/transcriptions".into(),
                            translations_path: "/v1/audio/translations".into(),
                            speech_path: String::new(),
                            health_path: "/health".into(),
                            auth_header_name: "Authorization".into(),
                            auth_header_format: "Bearer {secret}".into(),
                        }),
                    },
                )),
            },
            pb::AdapterConfig {
                tls: None,
                name: "ollama".into(),
                capacity: 0,
                targets: vec!["qwen2.5:7b".into()],
                kind: Some(pb::adapter_config::Kind::Ollama(pb::OllamaAdapterConfig {
                    base_url: "http://127.0.0.1:11434".into(),
                })),
            },
        ],
        revision: 7,
        credential_leases_required: true,
        revoked_credentials: Vec::new(),
    };
    assert_eq!(payload, expected);
    assert!(
        !config
            .node("node-a")
            .unwrap()
            .config_payload(1, false)
            .credential_leases_required
    );
}
