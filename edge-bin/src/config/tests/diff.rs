//! What changes between two configurations (`ConfigDiff`), and the table
//! of which settings a reload applies.

use super::credentials::{managed, recipient_text, CLIENT_KEY_HASH};
use super::*;
use crate::config::diff::{apply_of, Apply, PoolChange, SETTINGS};

fn config(text: &str) -> EdgeConfig {
    match parse(text) {
        Ok(config) => config,
        Err(e) => panic!("{e}\n{text}"),
    }
}

fn diff(running: &str, next: &str) -> ConfigDiff {
    ConfigDiff::between(&config(running), &config(next))
}

/// The diff's lines, as printed.
fn lines(running: &str, next: &str) -> Vec<String> {
    let diff = diff(running, next);
    let printed: Vec<String> = diff.to_string().lines().map(str::to_owned).collect();
    assert_eq!(printed, diff.lines());
    printed
}

/// `BASE` with `old` replaced by `new` for each pair (each must occur once).
fn edited(edits: &[(&str, &str)]) -> String {
    let mut text = BASE.to_owned();
    for (old, new) in edits {
        assert_eq!(
            text.matches(old).count(),
            1,
            "snippet {old:?} must occur once"
        );
        text = text.replacen(old, new, 1);
    }
    text
}

const QWEN_PROVIDER: &str = "[[nodes.providers]]
id = \"a-qwen\"
adapter = \"ollama\"
target = \"qwen2.5:7b\"
capacity = 4
";

const NODE_B: &str = "
[[nodes]]
id = \"node-b\"

[[nodes.adapters]]
kind = \"ollama\"
base_url = \"http://10.0.0.2:11434\"

[[nodes.providers]]
id = \"b-llama\"
adapter = \"ollama\"
target = \"llama3.1:8b\"
capacity = 2
";

#[test]
fn the_same_file_has_no_changes() {
    let diff = diff(BASE, BASE);
    assert!(diff.is_empty());
    assert_eq!(diff.lines(), Vec::<String>::new());
    assert_eq!(diff.to_string(), "no changes");
    assert_eq!(diff.restart_keys(), Vec::<&str>::new());
}

#[test]
fn nodes_and_providers_added_and_removed() {
    let grown = format!(
        "{}{NODE_B}",
        edited(&[
            (QWEN_PROVIDER, ""),
            (
                "providers = [\"node-a/a-llama\"]",
                "providers = [\"node-a/a-llama\", \"node-b/b-llama\"]"
            ),
        ])
    );
    assert_eq!(
        lines(BASE, &grown),
        [
            "+ node node-b",
            "+ provider node-b/b-llama",
            "- provider node-a/a-qwen",
            "~ model llama-3.1-8b: pool [node-a/a-llama] -> [node-a/a-llama, node-b/b-llama]",
        ]
    );
    let diff = diff(BASE, &grown);
    assert_eq!(
        diff.models.changed[0].pool,
        Some(PoolChange {
            from: vec!["node-a/a-llama".into()],
            to: vec!["node-a/a-llama".into(), "node-b/b-llama".into()],
            added: vec!["node-b/b-llama".into()],
            removed: vec![],
            reordered: false,
        })
    );
    assert!(diff.restart_keys().is_empty());
    // And back: the node and its provider go.
    assert_eq!(
        lines(&grown, BASE),
        [
            "- node node-b",
            "+ provider node-a/a-qwen",
            "- provider node-b/b-llama",
            "~ model llama-3.1-8b: pool [node-a/a-llama, node-b/b-llama] -> [node-a/a-llama]",
        ]
    );
}

#[test]
fn adapter_settings_and_recipient_key_changes_name_each_field() {
    let next = edited(&[
        (
            "profile = \"vllm\"",
            "profile = \"sglang\"\nhealth_path = \"/healthz\"",
        ),
        ("http://127.0.0.1:8000", "http://127.0.0.1:8001"),
        (
            "capacity = 8\n\n[[nodes.adapters]]",
            "capacity = 4\n\n[[nodes.adapters]]\nname = \"spare\"\nkind = \"ollama\"\n\
             base_url = \"http://127.0.0.1:11435\"\n\n[[nodes.adapters]]",
        ),
        (
            "id = \"node-a\"",
            &format!("id = \"node-a\"\nrecipient_key = \"{}\"", recipient_text(3)),
        ),
    ]);
    assert_eq!(
        lines(BASE, &next),
        [
            "~ node node-a: + adapter spare".to_owned(),
            "~ node node-a: adapter vllm-main: profile vllm -> sglang, base_url \
             http://127.0.0.1:8000 -> http://127.0.0.1:8001, health_path none -> /healthz, \
             capacity 8 -> 4"
                .to_owned(),
            format!("~ node node-a: recipient_key none -> {}", recipient_text(3)),
        ]
    );

    // An adapter goes (with the provider it served), another changes kind.
    let next = edited(&[
        (QWEN_PROVIDER, ""),
        (
            "kind = \"ollama\"\nbase_url = \"http://127.0.0.1:11434\"\n",
            "",
        ),
        ("[[nodes.adapters]]\n\n", ""),
    ]);
    let next = next.replacen(
        "kind = \"openai_compat\"\nprofile = \"vllm\"",
        "kind = \"ollama\"",
        1,
    );
    assert_eq!(
        lines(BASE, &next),
        [
            "~ node node-a: - adapter ollama",
            "~ node node-a: adapter vllm-main: kind openai_compat -> ollama, profile vllm -> none",
            "- provider node-a/a-qwen",
        ]
    );
}

#[test]
fn a_rotated_provider_ca_shows_as_changed_contents() {
    let https = edited(&[(
        "base_url = \"http://127.0.0.1:8000\"",
        "base_url = \"https://api.example.com\"\nca_file = \"ca/provider.pem\"",
    )]);
    let mut running = config(&https);
    running.nodes[0].adapters[0].tls.ca_pem = Some("old".into());
    let mut next = running.clone();
    next.nodes[0].adapters[0].tls.ca_pem = Some("new".into());
    assert_eq!(
        ConfigDiff::between(&running, &next).lines(),
        [
            "~ node node-a: adapter vllm-main: ca_file conf/ca/provider.pem -> \
          conf/ca/provider.pem (contents changed)"
        ]
    );
    let next = config(&https.replace("ca/provider.pem", "ca/other.pem"));
    let running = config(&https);
    assert_eq!(
        ConfigDiff::between(&running, &next).lines(),
        ["~ node node-a: adapter vllm-main: ca_file conf/ca/provider.pem -> conf/ca/other.pem"]
    );
}

#[test]
fn provider_changes_name_each_field_and_an_emptied_model_says_so() {
    let next = edited(&[
        (
            "target = \"meta-llama/Llama-3.1-8B-Instruct\"\ncapacity = 8\nlong_context_capacity = 2",
            "target = \"meta-llama/Llama-3.1-70B-Instruct\"\ncapacity = 2\n\
             long_context_capacity = 1\nresponse_stall_timeout_ms = 60000\n\
             category = \"api\"\nenabled = false",
        ),
        ("adapter = \"ollama\"", "adapter = \"vllm-main\""),
    ]);
    assert_eq!(
        lines(BASE, &next),
        [
            "~ provider node-a/a-llama: target meta-llama/Llama-3.1-8B-Instruct -> \
             meta-llama/Llama-3.1-70B-Instruct, capacity 8 -> 2, long_context_capacity 2 -> 1, \
             response_stall_timeout_ms 0 -> 60000, category local_inference -> api, \
             enabled true -> false",
            "~ provider node-a/a-qwen: adapter ollama -> vllm-main",
            "~ model llama-3.1-8b: no enabled provider left",
        ]
    );
    let diff = diff(BASE, &next);
    assert!(diff.models.changed[0].no_enabled_provider);
    assert_eq!(diff.models.changed[0].pool, None);
    // Enabled again: the model is not reported (its own keys did not change).
    let back = lines(&next, BASE);
    assert_eq!(back.len(), 2, "{back:?}");
    assert!(
        back.iter().all(|l| l.starts_with("~ provider ")),
        "{back:?}"
    );
}

#[test]
fn model_changes_name_the_pool_and_each_key() {
    let mixed = |extra: &str, pool: &str| {
        format!("{BASE}\n[[models]]\nname = \"mix\"\nproviders = {pool}\n{extra}")
    };
    let running = mixed("", "[\"node-a/a-llama\", \"node-a/a-qwen\"]");
    let next = mixed(
        "long_context_threshold_tokens = 1000\nmax_queue = 8\nqueue_timeout_ms = 1000\n\
         max_attempts = 1\nowned_by = \"ops\"\n\n[[models]]\nname = \"qwen\"\n\
         providers = [\"node-a/a-qwen\"]\n",
        "[\"node-a/a-qwen\", \"node-a/a-llama\"]",
    );
    assert_eq!(
        lines(&running, &next),
        [
            "+ model qwen",
            "~ model mix: pool [node-a/a-llama, node-a/a-qwen] -> [node-a/a-qwen, node-a/a-llama], \
             long_context_threshold_tokens none -> 1000, max_queue 256 -> 8, \
             queue_timeout_ms 30000 -> 1000, max_attempts 2 -> 1, owned_by iop -> ops",
        ]
    );
    let pool = diff(&running, &next).models.changed[0].pool.clone();
    assert_eq!(
        pool.map(|p| (p.added, p.removed, p.reordered)),
        Some((vec![], vec![], true))
    );
    assert_eq!(lines(&next, &running)[0], "- model qwen");
}

#[test]
fn credentials_changes_name_slots_revisions_and_revocations_never_a_secret() {
    let running = managed("");
    assert_eq!(
        lines(BASE, &running),
        [
            format!("~ node node-a: recipient_key none -> {}", recipient_text(9)),
            "+ credentials".to_owned(),
            "+ credentials.slot openai-main".to_owned(),
            "+ client_key team-a (client_keys[0])".to_owned(),
        ]
    );
    let next = managed("revision = 4\nrevoked_revisions = [1, 2]\nformat = \"Token {secret}\"")
        .replace(
            "secret_file = \"secrets/openai\"",
            "secret_env = \"OPENAI_API_KEY\"",
        )
        .replace(
            "issuer_key = \"keys/issuer.key\"",
            "issuer_key = \"keys/issuer-2.key\"\nlease_ttl_ms = 60000",
        );
    assert_eq!(
        lines(&running, &next),
        [
            "~ credentials.issuer_key: conf/keys/issuer.key -> conf/keys/issuer-2.key",
            "~ credentials.lease_ttl_ms: 30000 -> 60000",
            "~ credentials.slot openai-main: secret secret_file conf/secrets/openai -> \
             secret_env OPENAI_API_KEY, format Bearer {secret} -> Token {secret}, \
             revision 1 -> 4, revoked_revisions [] -> [1, 2]",
        ]
    );
    // A slot replaced by another name, then the plane turned off.
    let renamed = running.replace("name = \"openai-main\"", "name = \"openai-b\"");
    assert_eq!(
        lines(&running, &renamed),
        [
            "+ credentials.slot openai-b",
            "- credentials.slot openai-main"
        ]
    );
    assert_eq!(
        lines(&running, BASE),
        [
            format!("~ node node-a: recipient_key {} -> none", recipient_text(9)),
            "- credentials".to_owned(),
            "- credentials.slot openai-main".to_owned(),
            "- client_key team-a (client_keys[0])".to_owned(),
        ]
    );
    assert!(!diff(BASE, &running).to_string().contains(CLIENT_KEY_HASH));
}

#[test]
fn client_keys_are_matched_by_hash_and_shown_by_principal_and_position() {
    let hash = |digit: char| digit.to_string().repeat(64);
    let key = |principal: &str, digit: char, extra: &str| {
        format!(
            "\n[[client_keys]]\nprincipal = \"{principal}\"\nkey_hash = \"{}\"\n{extra}",
            hash(digit)
        )
    };
    let running = format!(
        "{BASE}{}{}{}",
        key("team-a", 'a', ""),
        key("ops", 'b', "scopes = [\"admin\"]\n"),
        key("batch", 'c', "max_concurrent = 4\n"),
    );
    let next = format!(
        "{BASE}{}{}{}",
        key(
            "ops",
            'b',
            "scopes = [\"metrics\"]\nrequests_per_minute = 60\nmodels = [\"llama-3.1-8b\"]\n"
        ),
        key("batch", 'c', "max_concurrent = 4\ntokens_per_day = 100\n"),
        key("team-b", 'd', ""),
    );
    // Budgets need a budget file (the same in both).
    let with_file = |text: &str| {
        text.replacen(
            "client_listen = ",
            "budget_file = \"b.log\"\nclient_listen = ",
            1,
        )
    };
    let (running, next) = (with_file(&running), with_file(&next));
    let printed = lines(&running, &next);
    assert_eq!(
        printed,
        [
            "+ client_key team-b (client_keys[2])",
            "- client_key team-a (client_keys[0])",
            "~ client_key ops (client_keys[0]): scopes [admin] -> [metrics], \
             requests_per_minute none -> 60, models all -> [llama-3.1-8b]",
            "~ client_key batch (client_keys[1]): tokens_per_day none -> 100",
        ]
    );
    // A key renamed to another principal is the same key (same hash).
    let renamed = running.replacen("principal = \"batch\"", "principal = \"jobs\"", 1);
    assert_eq!(
        lines(&running, &renamed),
        ["~ client_key jobs (client_keys[2]): principal batch -> jobs"]
    );
    for digit in ['a', 'b', 'c', 'd'] {
        assert!(printed.iter().all(|l| !l.contains(&hash(digit)[..8])));
    }
}

/// A key that may read `/metrics` (`metrics_access = "key"` needs one).
const SCRAPER_KEY: &str = "\n[[client_keys]]\nprincipal = \"scraper\"\n\
     key_hash = \"eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee\"\n\
     scopes = [\"metrics\"]\n";

#[test]
fn edge_settings_say_whether_a_reload_applies_them() {
    let running = format!("{BASE}{SCRAPER_KEY}");
    let next = edited(&[
        (
            "client_listen = \"127.0.0.1:8080\"",
            "client_listen = \"127.0.0.1:9090\"",
        ),
        (
            "node_listen = \"127.0.0.1:7443\"",
            "node_listen = \"127.0.0.1:7443\"\nmax_request_body_bytes = 1048576\n\
             metrics_access = \"key\"\ndrain_grace_ms = 5000\nclient_head_timeout_ms = 5000\n\
             max_client_connections = 100",
        ),
    ]);
    let next = format!(
        "{next}{SCRAPER_KEY}\n[edge.access_log]\ndestination = \"off\"\nformat = \"json\"\n\n\
         [edge.usage_log]\npath = \"usage.jsonl\"\n\n[outlier_detection]\nconsecutive_failures = 3\n"
    );
    assert_eq!(
        lines(&running, &next),
        [
            "~ edge.client_listen: 127.0.0.1:8080 -> 127.0.0.1:9090 (needs a restart)",
            "~ edge.max_request_body_bytes: 8388608 -> 1048576 (live)",
            "~ edge.metrics_access: open -> key (live)",
            "~ edge.drain_grace_ms: 30000 -> 5000 (needs a restart)",
            "~ edge.client_head_timeout_ms: 10000 -> 5000 (live)",
            "~ edge.max_client_connections: 4096 -> 100 (needs a restart)",
            "~ edge.access_log: stderr -> off (needs a restart)",
            "~ edge.access_log.format: from --log-format -> json (needs a restart)",
            "~ edge.usage_log: off -> on (needs a restart)",
            "~ outlier_detection.consecutive_failures: 5 -> 3 (live)",
        ]
    );
    assert_eq!(
        diff(&running, &next).restart_keys(),
        [
            "edge.client_listen",
            "edge.drain_grace_ms",
            "edge.max_client_connections",
            "edge.access_log",
            "edge.access_log.format",
            "edge.usage_log",
        ]
    );
}

const CLIENT_TLS: &str = "\n[edge.client_tls]\ncert = \"https.pem\"\nkey = \"https-key.pem\"\n";
const CLUSTER: &str = "\n[cluster]\netcd_endpoints = [\"10.0.0.5:2379\"]\n";

#[test]
fn tables_added_or_removed_need_a_restart_and_their_files_are_live() {
    let secured = format!("{BASE}{CLIENT_TLS}{CLUSTER}");
    assert_eq!(
        lines(BASE, &secured),
        [
            "~ edge.client_tls: off -> on (needs a restart)",
            "~ cluster: off -> on (needs a restart)",
        ]
    );
    let insecure = edited(&[
        ("[tls]\nca = \"certs/ca.pem\"\ncert = \"certs/edge.pem\"\nkey = \"certs/edge-key.pem\"\n", ""),
        ("node_listen = \"127.0.0.1:7443\"", "node_listen = \"127.0.0.1:7443\"\ninsecure_plaintext_nodes = true"),
    ]);
    assert_eq!(
        lines(&secured, &insecure),
        [
            "~ edge.insecure_plaintext_nodes: false -> true (needs a restart)",
            "~ edge.client_tls: on -> off (needs a restart)",
            "~ tls: on -> off (needs a restart)",
            "~ cluster: on -> off (needs a restart)",
        ]
    );
    let moved = secured
        .replace("https.pem", "https-2.pem")
        .replace(
            "key = \"https-key.pem\"",
            "key = \"https-key.pem\"\nclient_ca = \"callers.pem\"",
        )
        .replace("certs/edge.pem", "certs/edge-2.pem")
        .replace("10.0.0.5:2379", "10.0.0.6:2379");
    assert_eq!(
        lines(&secured, &moved),
        [
            "~ edge.client_tls.cert: conf/https.pem -> conf/https-2.pem (live)",
            "~ edge.client_tls.client_ca: none -> conf/callers.pem (live)",
            "~ tls.cert: conf/certs/edge.pem -> conf/certs/edge-2.pem (live)",
            "~ cluster.etcd_endpoints: [10.0.0.5:2379] -> [10.0.0.6:2379] (needs a restart)",
        ]
    );
}

/// Every setting's value is read from the configuration: a file that sets
/// each one differently changes each one (presence keys in a second
/// diff, as a table's keys are compared only when both files have it).
#[test]
fn every_setting_shows_a_change_of_its_value() {
    let running = format!(
        "{BASE}{SCRAPER_KEY}{CLIENT_TLS}{CLUSTER}\n[edge.usage_log]\npath = \"usage.jsonl\"\n\n\
         [tracing]\notlp_endpoint = \"http://127.0.0.1:4318\"\n"
    );
    let edge_keys = "node_listen = \"127.0.0.1:7444\"
name = \"edge-2\"
trust_domain = \"iop.example\"
max_request_body_bytes = 1000
max_upload_body_bytes = 1000
max_frame_bytes = 200000
allow_anonymous = true
metrics_access = \"key\"
node_metrics_max_age_ms = 1
drain_grace_ms = 1
flow_window_bytes = 1000
client_write_stall_timeout_ms = 1000
response_wait_timeout_ms = 1000
client_head_timeout_ms = 1
client_body_idle_timeout_ms = 1
client_body_grace_ms = 1
client_body_min_rate_bytes_per_sec = 1
client_keep_alive_timeout_ms = 1
max_client_connections = 1
max_client_connections_per_peer = 1
client_linger_time_ms = 1
client_linger_idle_timeout_ms = 1
client_linger_max_bytes = 1
node_handshake_timeout_ms = 2
max_node_handshakes = 1
max_node_handshakes_per_peer = 1
node_first_byte_timeout_ms = 1
max_json_depth = 1
max_json_elements = 1
max_json_members = 1
budget_file = \"budgets.log\"";
    let next = running
        .replace("name = \"edge-1\"\n", "")
        .replace("trust_domain = \"iop.local\"\n", "")
        .replace("client_listen = \"127.0.0.1:8080\"", "client_listen = \"127.0.0.1:8081\"")
        .replace("node_listen = \"127.0.0.1:7443\"", edge_keys)
        .replace("https.pem", "https-2.pem")
        .replace(
            "key = \"https-key.pem\"",
            "key = \"https-key-2.pem\"\nclient_ca = \"ca.pem\"",
        )
        .replace("certs/ca.pem", "certs/ca-2.pem")
        .replace("certs/edge.pem", "certs/edge-2.pem")
        .replace("certs/edge-key.pem", "certs/edge-key-2.pem")
        .replace("10.0.0.5:2379\"]", "10.0.0.6:2379\"]\nname = \"prod\"\nlease_ttl_sec = 20\n\
                  keepalive_interval_sec = 4\netcd_timeout_ms = 100\npeer_listen = \"127.0.0.1:7445\"")
        .replace("usage.jsonl", "usage-2.jsonl")
        .replace(
            "otlp_endpoint = \"http://127.0.0.1:4318\"",
            "otlp_endpoint = \"http://127.0.0.1:4319\"\nsample_ratio = 0.5\nservice_name = \"gw\"",
        );
    let next = format!(
        "{next}\n[edge.access_log]\ndestination = \"access.log\"\nformat = \"json\"\n\n\
         [outlier_detection]\nenabled = false\nconsecutive_failures = 3\n\
         base_ejection_time_ms = 1\nmax_ejection_time_ms = 2\nmax_ejection_percent = 1\n\n\
         [routing]\nprefix_tree_bytes = 65536\nprefix_bytes_max = 1\nmatch_threshold_percent = 1\n\
         balance_abs_threshold = 1\nbalance_rel_threshold_percent = 101\naffinity_wait_ms = 1\n"
    );
    // Another access log file (the path is a setting of its own).
    let moved = next.replace("access.log", "access-2.log");
    let insecure = edited(&[
        ("[tls]\nca = \"certs/ca.pem\"\ncert = \"certs/edge.pem\"\nkey = \"certs/edge-key.pem\"\n", ""),
        ("node_listen = \"127.0.0.1:7443\"", "node_listen = \"127.0.0.1:7443\"\ninsecure_plaintext_nodes = true"),
    ]);
    let mut changed: Vec<&str> = diff(&running, &next)
        .settings
        .iter()
        .chain(&diff(&running, &insecure).settings)
        .chain(&diff(&next, &moved).settings)
        .map(|s| s.key)
        .collect();
    changed.sort_unstable();
    changed.dedup();
    let mut all: Vec<&str> = SETTINGS.iter().map(|s| s.key).collect();
    all.sort_unstable();
    assert_eq!(changed, all);
}

#[test]
fn settings_are_listed_once() {
    let mut keys: Vec<&str> = SETTINGS.iter().map(|s| s.key).collect();
    let listed = keys.len();
    keys.sort_unstable();
    keys.dedup();
    assert_eq!(keys.len(), listed);
    assert_eq!(apply_of("edge.client_listen"), Some(Apply::Restart));
    assert_eq!(apply_of("edge.client_head_timeout_ms"), Some(Apply::Live));
    assert_eq!(apply_of("edge.bogus"), None);
}

/// The keys a table of the file format accepts, as serde lists them when
/// it refuses an unknown one.
fn accepted_keys(text_with_unknown_key: &str) -> Vec<String> {
    let message = error(text_with_unknown_key);
    let Some((_, expected)) = message.split_once("expected") else {
        panic!("{message}");
    };
    expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// Every key of the settings tables of the file format is in SETTINGS, or
/// is a table whose keys are: a key added to the format without a
/// classification fails here.
#[test]
fn every_key_of_the_settings_tables_is_classified() {
    let unknown = "bogus_key = 1\n";
    let tables = [
        (
            "edge",
            edited(&[(
                "node_listen = \"127.0.0.1:7443\"",
                "node_listen = \"127.0.0.1:7443\"\nbogus_key = 1",
            )]),
        ),
        (
            "edge.access_log",
            format!("{BASE}\n[edge.access_log]\n{unknown}"),
        ),
        (
            "edge.usage_log",
            format!("{BASE}\n[edge.usage_log]\npath = \"u\"\n{unknown}"),
        ),
        ("edge.client_tls", format!("{BASE}{CLIENT_TLS}{unknown}")),
        (
            "tls",
            variant(
                "key = \"certs/edge-key.pem\"",
                &format!("key = \"certs/edge-key.pem\"\n{unknown}"),
            ),
        ),
        (
            "outlier_detection",
            format!("{BASE}\n[outlier_detection]\n{unknown}"),
        ),
        ("cluster", format!("{BASE}{CLUSTER}{unknown}")),
    ];
    for (table, text) in tables {
        let keys = accepted_keys(&text);
        assert!(
            keys.len() > 1 || table == "edge.usage_log",
            "{table}: {keys:?}"
        );
        for key in keys {
            let key = format!("{table}.{key}");
            let classified = apply_of(&key).is_some()
                || SETTINGS
                    .iter()
                    .any(|s| s.key.starts_with(&format!("{key}.")));
            assert!(classified, "{key} is not in SETTINGS");
        }
    }
}

/// A key line of `examples/edge.toml` (`key = value`, or `# key = value`
/// in a table shown commented out) and the comment block that documents
/// it.
#[derive(Debug)]
struct ExampleKey {
    key: String,
    comment: String,
}

/// The settings keys of `examples/edge.toml` with their comments: for a
/// key, the comment lines right above it, else those of the key above it
/// (keys documented together), else those above its table's header.
fn example_settings_keys() -> Vec<ExampleKey> {
    let text = match std::fs::read_to_string(example_path()) {
        Ok(text) => text,
        Err(e) => panic!("{}: {e}", example_path().display()),
    };
    let settings_tables = [
        "edge",
        "edge.access_log",
        "edge.usage_log",
        "edge.client_tls",
        "tls",
        "outlier_detection",
        "routing",
        "cluster",
        "tracing",
    ];
    let is_key = |line: &str| -> Option<String> {
        let (name, _) = line.split_once(" = ")?;
        name.chars()
            .all(|c| c.is_ascii_lowercase() || c == '_')
            .then(|| name.to_owned())
    };
    let mut keys = Vec::new();
    let mut table: Option<&str> = None;
    let mut block: Vec<&str> = Vec::new();
    let mut last_comment = String::new();
    for raw in text.lines() {
        let line = raw.trim();
        // A table shown commented out reads `# [name]` / `# key = …` /
        // `# # comment`.
        let uncommented = line.strip_prefix("# ").unwrap_or(line);
        if let Some(header) = uncommented
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
        {
            table = settings_tables.iter().copied().find(|t| *t == header);
            last_comment = block.join(" ");
            block.clear();
            // A table that may be left out: its presence is a setting.
            if table.is_some() && apply_of(header).is_some() {
                keys.push(ExampleKey {
                    key: header.to_owned(),
                    comment: last_comment.clone(),
                });
            }
            continue;
        }
        let Some(table) = table else {
            continue;
        };
        if line.is_empty() {
            block.clear();
            continue;
        }
        if let Some(name) = is_key(uncommented) {
            if !block.is_empty() {
                last_comment = block.join(" ");
            }
            block.clear();
            keys.push(ExampleKey {
                key: format!("{table}.{name}"),
                comment: last_comment.clone(),
            });
            continue;
        }
        block.push(uncommented.trim_start_matches('#').trim());
    }
    keys
}

#[test]
fn every_setting_of_the_example_is_classified_and_its_comment_says_how_it_applies() {
    let text = std::fs::read_to_string(example_path()).unwrap_or_default();
    // The example parses: its keys are real.
    if let Err(e) = EdgeConfig::parse(&text, example_path()) {
        panic!("{e}");
    }
    let keys = example_settings_keys();
    for key in &keys {
        assert!(
            apply_of(&key.key).is_some(),
            "{} is not in SETTINGS",
            key.key
        );
    }
    // The example shows every setting (tables that may be left out
    // commented out).
    let mut shown: Vec<&str> = keys.iter().map(|k| k.key.as_str()).collect();
    shown.sort_unstable();
    let mut all: Vec<&str> = SETTINGS.iter().map(|s| s.key).collect();
    all.sort_unstable();
    assert_eq!(shown, all);
    // Each [edge] setting's comment says how a change of it applies.
    for key in keys.iter().filter(|k| k.key.starts_with("edge.")) {
        let (says, not) = match apply_of(&key.key) {
            Some(Apply::Live) => ("live on reload", "needs a restart"),
            _ => ("needs a restart", "live on reload"),
        };
        assert!(
            key.comment.contains(says) && !key.comment.contains(not),
            "the comment of {} must say {says:?}: {:?}",
            key.key,
            key.comment
        );
    }
}
