//! The credential plane, client keys and the access log.

use super::*;

pub(super) fn recipient_text(seed: u8) -> String {
    let public = PublicKey::from(&StaticSecret::from([seed; 32]));
    iop_engine::keys::encode_recipient_public_key(&public)
}

pub(super) const CLIENT_KEY_HASH: &str =
    "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

/// `BASE` with a recipient key on node-a, an issuer, one slot serving
/// node-a/a-llama (the only tunnel provider) and one client key;
/// `slot_extra` is added to the slot.
pub(super) fn managed(slot_extra: &str) -> String {
    format!(
        "{}\n[credentials]\nissuer_key = \"keys/issuer.key\"\n\n[[credentials.slots]]\n\
         name = \"openai-main\"\nsecret_file = \"secrets/openai\"\n\
         providers = [\"node-a/a-llama\"]\n{slot_extra}\n\n[[client_keys]]\n\
         principal = \"team-a\"\nkey_hash = \"{CLIENT_KEY_HASH}\"\n",
        variant(
            "id = \"node-a\"",
            &format!("id = \"node-a\"\nrecipient_key = \"{}\"", recipient_text(9))
        )
    )
}

#[test]
fn https_adapters_take_provider_tls_settings() {
    let https = "base_url = \"https://api.example.com/openai\"";
    let config = parse(&variant(
        "base_url = \"http://127.0.0.1:8000\"",
        &format!("{https}\nca_file = \"ca/provider.pem\""),
    ))
    .unwrap();
    let adapter = &config.nodes[0].adapters[0];
    assert!(adapter.base_url.is_tls());
    assert_eq!(adapter.base_url.origin(), "https://api.example.com:443");
    assert_eq!(
        adapter.tls,
        ProviderTlsSpec {
            ca_file: Some(PathBuf::from("conf/ca/provider.pem")),
            ca_pem: None,
            insecure_skip_verify: false,
        }
    );
    // Without a CA file or the dev switch the Node uses its defaults.
    let plain = parse(&variant("base_url = \"http://127.0.0.1:8000\"", https)).unwrap();
    assert_eq!(plain.nodes[0].adapters[0].tls.to_pb(), None);
    let insecure = parse(&variant(
        "base_url = \"http://127.0.0.1:8000\"",
        &format!("{https}\ntls_insecure_skip_verify = true"),
    ))
    .unwrap();
    let payload = insecure.node_config_payload(&insecure.nodes[0], 1);
    assert_eq!(
        payload.adapters[0].tls,
        Some(pb::ProviderTlsConfig {
            ca_pem: String::new(),
            insecure_skip_verify: true,
        })
    );
    assert_eq!(
        payload.adapters[0]
            .kind
            .as_ref()
            .and_then(|k| match k {
                pb::adapter_config::Kind::OpenaiCompat(o) => o.protocol_profile.clone(),
                pb::adapter_config::Kind::Ollama(_) => None,
            })
            .map(|p| (p.base_url, p.chat_completions_path)),
        Some((
            "https://api.example.com:443".to_owned(),
            "/openai/v1/chat/completions".to_owned()
        ))
    );
}

#[test]
fn provider_tls_settings_are_refused_where_they_mean_nothing() {
    let key = "conf/edge.toml: nodes[0].adapters[0]";
    assert_eq!(
        error_of("capacity = 8\n\n", "capacity = 8\nca_file = \"ca.pem\"\n\n"),
        format!("{key}.ca_file: only an https:// base_url has provider TLS settings")
    );
    assert_eq!(
        error_of(
            "capacity = 8\n\n",
            "capacity = 8\ntls_insecure_skip_verify = false\n\n"
        ),
        format!(
            "{key}.tls_insecure_skip_verify: only an https:// base_url has provider TLS \
             settings"
        )
    );
    assert_eq!(
        error_of(
            "base_url = \"http://127.0.0.1:8000\"",
            "base_url = \"https://h\"\nca_file = \"ca.pem\"\ntls_insecure_skip_verify = true"
        ),
        format!(
            "{key}.tls_insecure_skip_verify: verifies nothing, so ca_file would be ignored: \
             set one of them"
        )
    );
}

#[test]
fn no_credential_is_sent_to_an_unverified_provider() {
    let text = managed("").replace(
        "base_url = \"http://127.0.0.1:8000\"",
        "base_url = \"https://api.example.com\"\ntls_insecure_skip_verify = true",
    );
    assert_eq!(
        error(&text),
        "conf/edge.toml: credentials.slots[0].providers[0]: \"node-a/a-llama\" is served by \
         an adapter with tls_insecure_skip_verify; a credential is never sent to a provider \
         whose certificate is not verified"
    );
}

#[test]
fn client_tls_resolves_its_files_and_load_checks_them() {
    let text = variant(
        "node_listen = \"127.0.0.1:7443\"",
        "node_listen = \"127.0.0.1:7443\"\n[edge.client_tls]\ncert = \"https.pem\"\n\
         key = \"/etc/iop/https-key.pem\"\nclient_ca = \"callers.pem\"",
    );
    let config = parse(&text).unwrap();
    assert_eq!(
        config.client_tls,
        Some(HttpsFiles {
            cert: PathBuf::from("conf/https.pem"),
            key: PathBuf::from("/etc/iop/https-key.pem"),
            client_ca: Some(PathBuf::from("conf/callers.pem")),
        })
    );
    assert_eq!(
        error(&text.replace("client_ca", "client_cert")),
        "conf/edge.toml: edge.client_tls.client_cert: unknown field `client_cert`, expected \
         one of `cert`, `key`, `client_ca` (line 10, column 1)"
    );
    // Files are checked by load: the missing certificate is named.
    let dir = std::env::temp_dir().join(format!("iop-edge-client-tls-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("certs")).unwrap();
    for f in ["certs/ca.pem", "certs/edge.pem", "certs/edge-key.pem"] {
        std::fs::write(dir.join(f), "x").unwrap();
    }
    let path = dir.join("edge.toml");
    std::fs::write(&path, &text).unwrap();
    let err = EdgeConfig::load(&path).unwrap_err().to_string();
    assert!(
        err.starts_with(&format!(
            "{}: edge.client_tls.cert: cannot read {}",
            path.display(),
            dir.join("https.pem").display()
        )),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn load_reads_and_checks_provider_ca_files() {
    let dir = std::env::temp_dir().join(format!("iop-edge-provider-ca-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("certs")).unwrap();
    for f in ["certs/ca.pem", "certs/edge.pem", "certs/edge-key.pem"] {
        std::fs::write(dir.join(f), "x").unwrap();
    }
    let text = variant(
        "base_url = \"http://127.0.0.1:8000\"",
        "base_url = \"https://gw.internal:8443\"\nca_file = \"private-ca.pem\"",
    );
    let path = dir.join("edge.toml");
    std::fs::write(&path, &text).unwrap();
    let key = format!("{}: nodes[0].adapters[0].ca_file", path.display());
    let err = EdgeConfig::load(&path).unwrap_err().to_string();
    assert!(err.starts_with(&format!("{key}: cannot read ")), "{err}");
    std::fs::write(dir.join("private-ca.pem"), "no PEM here").unwrap();
    let err = EdgeConfig::load(&path).unwrap_err().to_string();
    assert!(err.ends_with("no certificate found"), "{err}");
    let ca = iop_engine::certs::DevCa::new("iop").unwrap().cert_pem();
    std::fs::write(dir.join("private-ca.pem"), &ca).unwrap();
    let config = EdgeConfig::load(&path).unwrap();
    let payload = config.node_config_payload(&config.nodes[0], 1);
    assert_eq!(
        payload.adapters[0].tls,
        Some(pb::ProviderTlsConfig {
            ca_pem: ca,
            insecure_skip_verify: false,
        })
    );
    let _ = std::fs::remove_dir_all(&dir);
}

// CONTRACT: C1 — the credential plane parses into slots bound to
// providers, the node's recipient key and hashed client keys, with the
// documented defaults; the issuer key path resolves against the config.
#[test]
fn credentials_parse_with_defaults() {
    let config = parse(&managed("")).unwrap();
    let slot = SlotSpec {
        name: "openai-main".into(),
        secret: SecretSource::File(PathBuf::from("conf/secrets/openai")),
        header_name: "Authorization".into(),
        header_format: "Bearer {secret}".into(),
        revision: 1,
        revoked_revisions: vec![],
        enabled: true,
        providers: vec![ProviderRef {
            node_id: "node-a".into(),
            provider_id: "a-llama".into(),
        }],
    };
    assert_eq!(
        config.credentials,
        Some(CredentialsSpec {
            issuer_key: PathBuf::from("conf/keys/issuer.key"),
            lease_ttl_ms: 30_000,
            slots: vec![slot.clone()],
        })
    );
    let node = config.node("node-a").unwrap();
    assert_eq!(
        node.recipient_key,
        Some(PublicKey::from(&StaticSecret::from([9; 32])))
    );
    assert!(config.credential_leases_required(node));
    assert_eq!(config.slot_for(&slot.providers[0]), Some(&slot));
    let qwen = ProviderRef {
        node_id: "node-a".into(),
        provider_id: "a-qwen".into(),
    };
    assert_eq!(config.slot_for(&qwen), None);
    assert!(slot.is_usable());
    let mut key_hash = [0u8; 32];
    for (i, b) in key_hash.iter_mut().enumerate() {
        *b = ((i % 16) as u8) * 0x11;
    }
    assert_eq!(
        config.client_keys,
        vec![ClientKeySpec {
            principal: "team-a".into(),
            key_hash,
            admin: false,
            metrics: false,
            limits: Default::default(),
            budgets: Default::default(),
            models: None,
            priority: crate::config::DEFAULT_PRIORITY,
            weight: 1,
        }]
    );
    // Without [credentials] a recipient key is inert: no lease required.
    let unmanaged = variant(
        "id = \"node-a\"",
        &format!("id = \"node-a\"\nrecipient_key = \"{}\"", recipient_text(9)),
    );
    let config = parse(&unmanaged).unwrap();
    assert!(!config.credential_leases_required(config.node("node-a").unwrap()));
}

// CONTRACT: C1 — a slot's header, format, revision and state are kept.
#[test]
fn slot_explicit_values_are_kept() {
    let config = parse(&managed(
        "header = \"x-api-key\"\nformat = \"{secret}\"\nrevision = 3\n\
         revoked_revisions = [1, 2]\nenabled = false",
    ))
    .unwrap()
    .credentials
    .unwrap();
    let slot = &config.slots[0];
    assert_eq!(
        (
            slot.header_name.as_str(),
            slot.header_format.as_str(),
            slot.revision,
            slot.revoked_revisions.as_slice(),
            slot.enabled
        ),
        ("x-api-key", "{secret}", 3, &[1u64, 2][..], false)
    );
    assert!(!slot.is_usable());
    let revoked = parse(&managed("revision = 2\nrevoked_revisions = [2]"))
        .unwrap()
        .credentials
        .unwrap();
    // CONTRACT: C3 — a slot whose current revision is revoked may not issue.
    assert!(!revoked.slots[0].is_usable());
    let env = managed("").replacen(
        "secret_file = \"secrets/openai\"",
        "secret_env = \"OPENAI_API_KEY\"",
        1,
    );
    let config = parse(&env).unwrap().credentials.unwrap();
    assert_eq!(
        config.slots[0].secret,
        SecretSource::Env("OPENAI_API_KEY".into())
    );
    let ttl = managed("").replacen(
        "issuer_key = \"keys/issuer.key\"",
        "issuer_key = \"keys/issuer.key\"\nlease_ttl_ms = 5000",
        1,
    );
    assert_eq!(parse(&ttl).unwrap().credentials.unwrap().lease_ttl_ms, 5000);
}

// CONTRACT: C1 — every slot key is validated with file, key and reason.
#[test]
fn slot_values_are_checked() {
    let key = "conf/edge.toml: credentials.slots[0]";
    let cases = [
        (
            "secret_env = \"X\"",
            format!("{key}: set exactly one of secret_file or secret_env"),
        ),
        (
            "header = \"Bad Header\"",
            format!(
                "{key}.header: \"Bad Header\" must be an HTTP header name of 1 to 128 token \
                 characters"
            ),
        ),
        (
            "header = \"Host\"",
            format!("{key}.header: \"Host\" cannot carry a credential"),
        ),
        (
            "format = \"Bearer\"",
            format!("{key}.format: \"Bearer\" must contain {{secret}}"),
        ),
        (
            "format = \"Bearer {secret}\\n\"",
            format!(
                "{key}.format: \"Bearer {{secret}}\\n\" must be 1 to 1024 characters of \
                 visible ASCII, space or tab"
            ),
        ),
        (
            "revision = 0",
            format!("{key}.revision: must be between 1 and 9223372036854775807 (got 0)"),
        ),
        (
            "revoked_revisions = [1, 1]",
            format!("{key}.revoked_revisions[1]: revision 1 is listed twice"),
        ),
    ];
    for (extra, expected) in cases {
        assert_eq!(error(&managed(extra)), expected, "{extra}");
    }
    let no_source = managed("").replacen("secret_file = \"secrets/openai\"\n", "", 1);
    assert_eq!(
        error(&no_source),
        format!("{key}: set exactly one of secret_file or secret_env")
    );
    let bad_env = managed("").replacen(
        "secret_file = \"secrets/openai\"",
        "secret_env = \"1BAD\"",
        1,
    );
    assert_eq!(
        error(&bad_env),
        format!(
            "{key}.secret_env: \"1BAD\" must be an environment variable name \
             ([A-Za-z_][A-Za-z0-9_]*, at most 128 characters)"
        )
    );
    let ttl = managed("").replacen(
        "issuer_key = \"keys/issuer.key\"",
        "issuer_key = \"keys/issuer.key\"\nlease_ttl_ms = 600001",
        1,
    );
    assert_eq!(
        error(&ttl),
        "conf/edge.toml: credentials.lease_ttl_ms: must be between 1000 and 600000 (got 600001)"
    );
    let no_issuer =
        managed("").replacen("issuer_key = \"keys/issuer.key\"", "issuer_key = \"\"", 1);
    assert_eq!(
        error(&no_issuer),
        "conf/edge.toml: credentials.issuer_key: must not be empty"
    );
    assert_eq!(
        error(&managed("colour = \"blue\"")),
        "conf/edge.toml: credentials.slots[0].colour: unknown field `colour`, expected one of \
         `name`, `secret_file`, `secret_env`, `header`, `format`, `revision`, \
         `revoked_revisions`, `enabled`, `providers` (line 52, column 1)"
    );
}

// CONTRACT: C1 — slots serve configured tunnel providers only.
#[test]
fn slot_providers_resolve_to_tunnel_providers() {
    let with_providers = |list: &str| {
        managed("").replacen(
            "providers = [\"node-a/a-llama\"]\n\n\n[[client_keys]]",
            &format!("providers = [{list}]\n\n\n[[client_keys]]"),
            1,
        )
    };
    let key = "conf/edge.toml: credentials.slots[0].providers";
    assert_eq!(
        error(&with_providers("")),
        format!("{key}: must list at least one provider")
    );
    assert_eq!(
        error(&with_providers("\"node-a/nope\"")),
        format!("{key}[0]: \"node-a/nope\": node \"node-a\" has no provider \"nope\"")
    );
    assert_eq!(
        error(&with_providers("\"node-a/a-llama\", \"node-a/a-llama\"")),
        format!(
            "{key}[1]: \"node-a/a-llama\" is listed twice (also credentials.slots[0].providers[0])"
        )
    );
    assert_eq!(
        error(&with_providers("\"node-a/a-llama\", \"node-a/a-qwen\"")),
        format!(
            "{key}[1]: \"node-a/a-qwen\" is not served by an openai_compat adapter; credential \
             leases travel only on provider tunnels"
        )
    );
    // CONTRACT: C5 — a provider is served by at most one slot, so a
    // bound route never has another slot to fall back to.
    let second = format!(
        "{}\n[[credentials.slots]]\nname = \"openai-backup\"\nsecret_env = \"B\"\n\
         providers = [\"node-a/a-llama\"]\n",
        managed("")
    );
    assert_eq!(
        error(&second),
        "conf/edge.toml: credentials.slots[1].providers[0]: \"node-a/a-llama\" is already served \
         by slot \"openai-main\"; a provider is served by at most one slot"
    );
    let duplicate = second.replacen("name = \"openai-backup\"", "name = \"openai-main\"", 1);
    assert_eq!(
        error(&duplicate),
        "conf/edge.toml: credentials.slots[1].name: duplicate slot name \"openai-main\" (also \
         credentials.slots[0])"
    );
}

// CONTRACT: C1, C3 — a node a slot serves needs a recipient key, and
// every tunnel provider of a managed node must be served by a slot
// (the node rejects tunnels without a lease).
#[test]
fn managed_nodes_are_consistent() {
    let without_key = managed("").replacen(
        &format!("recipient_key = \"{}\"\n", recipient_text(9)),
        "",
        1,
    );
    assert_eq!(
        error(&without_key),
        "conf/edge.toml: nodes[0].recipient_key: required: provider \"node-a/a-llama\" is served \
         by credential slot \"openai-main\" (node-bin keys recipient --out … prints it)"
    );
    let unslotted = managed("").replacen(
        "[[nodes.providers]]\nid = \"a-qwen\"",
        "[[nodes.providers]]\nid = \"a-phi\"\nadapter = \"vllm-main\"\ntarget = \"phi\"\n\
         capacity = 1\n\n[[nodes.providers]]\nid = \"a-qwen\"",
        1,
    );
    assert_eq!(
        error(&unslotted),
        "conf/edge.toml: nodes[0].providers[1]: node \"node-a\" is managed (it has a \
         recipient_key), so it rejects tunnels without a credential lease: serve \
         \"node-a/a-phi\" by a credential slot"
    );
    let bad_key = variant(
        "id = \"node-a\"",
        "id = \"node-a\"\nrecipient_key = \"ed25519:00\"",
    );
    assert_eq!(
        error(&bad_key),
        "conf/edge.toml: nodes[0].recipient_key: invalid public key: expected x25519:<64 hex digits>"
    );
    let low_order = variant(
        "id = \"node-a\"",
        &format!(
            "id = \"node-a\"\nrecipient_key = \"x25519:{}\"",
            "0".repeat(64)
        ),
    );
    assert_eq!(
        error(&low_order),
        "conf/edge.toml: nodes[0].recipient_key: invalid public key: a low-order X25519 point"
    );
}

// CONTRACT: T5, C3 — insecure mode disables the credential plane: a
// config with both is refused.
#[test]
fn credentials_are_refused_in_insecure_mode() {
    let tls =
        "[tls]\nca = \"certs/ca.pem\"\ncert = \"certs/edge.pem\"\nkey = \"certs/edge-key.pem\"\n";
    let insecure = managed("").replacen(tls, "", 1).replacen(
        "node_listen = \"127.0.0.1:7443\"",
        "node_listen = \"127.0.0.1:7443\"\ninsecure_plaintext_nodes = true",
        1,
    );
    assert_eq!(
        error(&insecure),
        "conf/edge.toml: credentials: the credential plane needs mTLS to the nodes: remove \
         [credentials] or edge.insecure_plaintext_nodes"
    );
}

// CONTRACT: C1 — client keys (the principals bound into leases) are
// stored hashed and validated.
#[test]
fn client_keys_are_checked() {
    let key = "conf/edge.toml: client_keys[0]";
    let upper = managed("").replacen(CLIENT_KEY_HASH, &CLIENT_KEY_HASH.to_uppercase(), 1);
    let reason = "expected 64 lowercase hex digits (edge-bin keys hash-client-key prints it)";
    assert_eq!(error(&upper), format!("{key}.key_hash: {reason}"));
    let short = managed("").replacen(CLIENT_KEY_HASH, "abcd", 1);
    assert_eq!(error(&short), format!("{key}.key_hash: {reason}"));
    let principal = managed("").replacen("principal = \"team-a\"", "principal = \"team a\"", 1);
    assert_eq!(
        error(&principal),
        format!("{key}.principal: \"team a\" must be 1 to 128 characters of A-Z a-z 0-9 . _ -")
    );
    let twice = format!(
        "{}\n[[client_keys]]\nprincipal = \"team-b\"\nkey_hash = \"{CLIENT_KEY_HASH}\"\n",
        managed("")
    );
    assert_eq!(
        error(&twice),
        "conf/edge.toml: client_keys[1].key_hash: the same key is also client_keys[0]"
    );
    let with_scope = |scopes: &str| {
        managed("").replacen(
            "principal = \"team-a\"",
            &format!("principal = \"team-a\"\nscopes = {scopes}"),
            1,
        )
    };
    assert_eq!(
        error(&with_scope("[\"admin\", \"root\"]")),
        format!(
            "{key}.scopes[1]: unknown scope \"root\"; the scopes are \"admin\" and \"metrics\""
        )
    );
    let admin = parse(&with_scope("[\"admin\"]")).unwrap();
    assert!(admin.client_keys[0].admin);
    let metrics = parse(&with_scope("[\"metrics\"]")).unwrap();
    assert!(metrics.client_keys[0].metrics && !metrics.client_keys[0].admin);
    // `/metrics` behind a key needs a key that may read it.
    let keyed_metrics = |scopes: &str| {
        with_scope(scopes).replacen(
            "name = \"edge-1\"",
            "name = \"edge-1\"\nmetrics_access = \"key\"",
            1,
        )
    };
    assert_eq!(
        parse(&keyed_metrics("[\"metrics\"]"))
            .unwrap()
            .edge
            .metrics_access,
        MetricsAccess::Key
    );
    assert_eq!(
        error(&keyed_metrics("[]")),
        "conf/edge.toml: edge.metrics_access: \"key\" needs a [[client_keys]] entry with \
         scopes = [\"metrics\"] (or \"admin\") to read /metrics"
    );
    assert_eq!(
        error(&keyed_metrics("[]").replace("\"key\"", "\"secret\"")),
        "conf/edge.toml: edge.metrics_access: expected \"open\" or \"key\" (got \"secret\")"
    );
    let none = parse(&with_scope("[]")).unwrap();
    assert!(!none.client_keys[0].admin);
}

// Per-principal limits and model access on client keys.
#[test]
fn client_key_limits_and_models_are_checked() {
    let key = "conf/edge.toml: client_keys[0]";
    let with = |extra: &str| {
        managed("").replacen(
            "principal = \"team-a\"",
            &format!("principal = \"team-a\"\n{extra}"),
            1,
        )
    };
    let ok = parse(&with(
        "max_concurrent = 4\nrequests_per_minute = 60\ntokens_per_minute = 90000\n\
         models = [\"llama-3.1-8b\"]",
    ))
    .unwrap();
    assert_eq!(
        ok.client_keys[0].limits,
        LimitSpec {
            max_concurrent: Some(4),
            requests_per_minute: Some(60),
            tokens_per_minute: Some(90_000),
        }
    );
    assert_eq!(
        ok.client_keys[0].models,
        Some(vec!["llama-3.1-8b".to_string()])
    );
    let plain = parse(&managed("")).unwrap();
    assert!(plain.client_keys[0].limits.is_unlimited());
    assert_eq!(plain.client_keys[0].models, None);

    assert_eq!(
        error(&with("requests_per_minute = 0")),
        format!("{key}.requests_per_minute: must be at least 1 (leave it out for no limit)")
    );
    assert_eq!(
        error(&with("models = [\"llama-3.1-8b\", \"gpt-9\"]")),
        format!("{key}.models[1]: no [[models]] entry is named \"gpt-9\"")
    );
    let second = format!(
        "{}\n[[client_keys]]\nprincipal = \"team-a\"\nkey_hash = \"{}\"\nmax_concurrent = 2\n",
        with("max_concurrent = 4"),
        "ab".repeat(32)
    );
    assert_eq!(
        error(&second),
        "conf/edge.toml: client_keys[1]: principal \"team-a\" already has limits from \
         client_keys[0]; set them on one of its keys"
    );
}

// Token budgets on client keys need the budget file.
#[test]
fn client_key_budgets_are_checked_and_need_the_budget_file() {
    let key = "conf/edge.toml: client_keys[0]";
    let with = |extra: &str, budget_file: bool| {
        let text = managed("").replacen(
            "principal = \"team-a\"",
            &format!("principal = \"team-a\"\n{extra}"),
            1,
        );
        if budget_file {
            text.replacen(
                "client_listen = ",
                "budget_file = \"state/budgets.log\"\nclient_listen = ",
                1,
            )
        } else {
            text
        }
    };
    let ok = parse(&with(
        "tokens_per_day = 5000000000\ntokens_per_month = 90000000000",
        true,
    ))
    .unwrap();
    assert_eq!(
        ok.client_keys[0].budgets,
        BudgetSpec {
            tokens_per_day: Some(5_000_000_000),
            tokens_per_month: Some(90_000_000_000),
        }
    );
    assert!(ok.client_keys[0].limits.is_unlimited());
    assert_eq!(
        ok.budget_file.as_deref(),
        Some(std::path::Path::new("conf/state/budgets.log"))
    );
    assert_eq!(parse(&managed("")).unwrap().budget_file, None);
    assert_eq!(
        error(&with("tokens_per_month = 10", false)),
        format!(
            "{key}.tokens_per_month: a token budget needs edge.budget_file (where the Edge keeps \
             what was used across restarts)"
        )
    );
    assert_eq!(
        error(&with("tokens_per_day = 0", true)),
        format!("{key}.tokens_per_day: must be at least 1 (leave it out for no budget)")
    );
    assert_eq!(
        error(&with("", true).replacen(
            "budget_file = \"state/budgets.log\"",
            "budget_file = \"\"",
            1
        )),
        "conf/edge.toml: edge.budget_file: must be a file path"
    );
    // A principal's limits and budgets are set on one of its keys.
    let second = format!(
        "{}\n[[client_keys]]\nprincipal = \"team-a\"\nkey_hash = \"{}\"\ntokens_per_day = 2\n",
        with("max_concurrent = 4", true),
        "ab".repeat(32)
    );
    assert_eq!(
        error(&second),
        "conf/edge.toml: client_keys[1]: principal \"team-a\" already has limits from \
         client_keys[0]; set them on one of its keys"
    );
}

#[test]
fn client_key_priorities_and_weights_are_checked() {
    let key = "conf/edge.toml: client_keys[0]";
    let with = |extra: &str| {
        managed("").replacen(
            "principal = \"team-a\"",
            &format!("principal = \"team-a\"\n{extra}"),
            1,
        )
    };
    let plain = parse(&managed("")).unwrap();
    assert_eq!(
        (plain.client_keys[0].priority, plain.client_keys[0].weight),
        (50, 1)
    );
    for (text, class) in [
        ("\"interactive\"", 90),
        ("\"Batch\"", 10),
        ("0", 0),
        ("100", 100),
    ] {
        let cfg = parse(&with(&format!("priority = {text}\nweight = 7"))).unwrap();
        assert_eq!(
            (cfg.client_keys[0].priority, cfg.client_keys[0].weight),
            (class, 7),
            "{text}"
        );
    }
    let classes = "the classes are \"interactive\" (90), \"standard\" (50) and \"batch\" (10), \
                   or a number from 0 to 100";
    assert_eq!(
        error(&with("priority = \"urgent\"")),
        format!("{key}.priority: unknown class \"urgent\"; {classes}")
    );
    // A number goes unquoted.
    assert_eq!(
        error(&with("priority = \"60\"")),
        format!("{key}.priority: unknown class \"60\"; {classes}")
    );
    assert_eq!(
        error(&with("priority = 101")),
        format!("{key}.priority: must be between 0 and 100 (got 101)")
    );
    assert_eq!(
        error(&with("weight = 0")),
        format!("{key}.weight: must be between 1 and 1000 (got 0)")
    );
}

#[test]
fn access_log_format_is_explicit_only_when_written() {
    let unset = parse(BASE).unwrap().access_log;
    assert_eq!((unset.format, unset.format_explicit), (Format::Text, false));
    let table = parse(&variant(
        "[tls]\n",
        "[edge.access_log]\ndestination = \"stderr\"\n\n[tls]\n",
    ))
    .unwrap()
    .access_log;
    assert_eq!((table.format, table.format_explicit), (Format::Text, false));
    let text = parse(&variant(
        "[tls]\n",
        "[edge.access_log]\nformat = \"text\"\n\n[tls]\n",
    ))
    .unwrap()
    .access_log;
    assert_eq!((text.format, text.format_explicit), (Format::Text, true));
    let json = parse(&variant(
        "[tls]\n",
        "[edge.access_log]\nformat = \"json\"\n\n[tls]\n",
    ))
    .unwrap()
    .access_log;
    assert_eq!((json.format, json.format_explicit), (Format::Json, true));
}

#[test]
fn error_accessors() {
    let e = parse(&variant("capacity = 4\n", "capacity = 0\n")).unwrap_err();
    assert_eq!(e.file(), "conf/edge.toml");
    assert_eq!(e.key(), "nodes[0].providers[1].capacity");
    assert_eq!(e.reason(), "must be between 1 and 65536 (got 0)");
}
