//! The config tests: shared fixtures here, the tables in the submodules.

mod credentials;
mod diff;
mod edge;
mod fleet;

use super::*;

/// A valid file that exercises every table; variants are made by
/// replacing one snippet.
const BASE: &str = r#"
[edge]
name = "edge-1"
trust_domain = "iop.local"
client_listen = "127.0.0.1:8080"
node_listen = "127.0.0.1:7443"

[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge-key.pem"

[[nodes]]
id = "node-a"

[[nodes.adapters]]
name = "vllm-main"
kind = "openai_compat"
profile = "vllm"
base_url = "http://127.0.0.1:8000"
capacity = 8

[[nodes.adapters]]
kind = "ollama"
base_url = "http://127.0.0.1:11434"

[[nodes.providers]]
id = "a-llama"
adapter = "vllm-main"
target = "meta-llama/Llama-3.1-8B-Instruct"
capacity = 8
long_context_capacity = 2

[[nodes.providers]]
id = "a-qwen"
adapter = "ollama"
target = "qwen2.5:7b"
capacity = 4

[[models]]
name = "llama-3.1-8b"
providers = ["node-a/a-llama"]
"#;

/// `BASE` with the one occurrence of `old` replaced by `new`.
fn variant(old: &str, new: &str) -> String {
    assert_eq!(
        BASE.matches(old).count(),
        1,
        "snippet {old:?} must occur once"
    );
    BASE.replacen(old, new, 1)
}

fn parse(text: &str) -> Result<EdgeConfig, ConfigError> {
    EdgeConfig::parse(text, "conf/edge.toml")
}

/// The error text for `text`.
fn error(text: &str) -> String {
    match parse(text) {
        Ok(config) => panic!("expected an error, parsed {config:?}"),
        Err(e) => e.to_string(),
    }
}

fn error_of(old: &str, new: &str) -> String {
    error(&variant(old, new))
}

fn example_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/edge.toml")
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn base_url(text: &str) -> BaseUrl {
    match BaseUrl::parse(text) {
        Ok(url) => url,
        Err(why) => panic!("{why}"),
    }
}
