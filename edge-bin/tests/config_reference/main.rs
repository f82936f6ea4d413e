//! `docs/configuration.md` against the code: the page documents exactly the
//! keys `edge.toml` and `node.toml` accept, with their types, defaults,
//! ranges and, for the Edge, how a change applies.
//!
//! - Keys: the serde mirrors of both files are walked ([`trace`], through
//!   each crate's `config::deserialize_file_format`); a key the code accepts
//!   and the page lacks fails, naming the key, and so does a documented key
//!   the code refuses or a type the page misstates.
//! - Defaults: each documented default is written into a base file and must
//!   parse to the same configuration as leaving the key out; each key
//!   documented `required` must be refused when left out.
//! - Ranges: each documented `` `MIN` to `MAX` `` is accepted at both ends
//!   and refused one past each.
//! - Reload (`edge.toml`): each key `config::diff::SETTINGS` classifies is
//!   documented `live` or `restart` as it says, and every one of them is on
//!   the page. The Node's column is not checked: its only live keys are
//!   `[tls]`'s (SIGHUP re-reads the files), which no table classifies.
//!
//! Both files are checked here because `node-bin` is a dev-dependency of
//! `edge-bin` and the page, the walk and the checks are the same.

mod page;
mod trace;

use std::fmt::Debug;
use std::path::PathBuf;

use edge_bin::config::diff::{apply_of, Apply, SETTINGS};
use edge_bin::config::EdgeConfig;
use node_bin::config::NodeConfig;
use page::{DefaultCell, Range, Reload, Row};
use toml::{Table, Value};
use trace::Key;

fn page_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/configuration.md")
}

fn page_rows(file: &str) -> Vec<Row> {
    let path = page_path();
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) => panic!("{}: {e}", path.display()),
    };
    page::rows(&text, file)
}

fn edge_keys() -> Vec<Key> {
    trace::keys(&trace::trace(|t| {
        edge_bin::config::deserialize_file_format(t)
    }))
}

fn node_keys() -> Vec<Key> {
    trace::keys(&trace::trace(|t| {
        node_bin::config::deserialize_file_format(t)
    }))
}

/// A valid `edge.toml` with every table present (so every key has a place
/// to go) and only the keys that must be there, or that the other keys'
/// checks need (`budget_file` for the token budgets, https for the
/// adapter's TLS keys).
const EDGE_BASE: &str = r#"
[edge]
name = "edge-1"
trust_domain = "iop.local"
client_listen = "127.0.0.1:8080"
node_listen = "127.0.0.1:7443"
budget_file = "budgets.log"

[edge.access_log]

[edge.usage_log]
path = "usage.jsonl"

[edge.client_tls]
cert = "certs/api.pem"
key = "certs/api-key.pem"

[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge-key.pem"

[credentials]
issuer_key = "keys/issuer.key"

[[credentials.slots]]
name = "openai-main"
secret_file = "secrets/openai"
providers = ["node-a/a-vllm"]

[[client_keys]]
principal = "team-a"
key_hash = "0000000000000000000000000000000000000000000000000000000000000000"

[[nodes]]
id = "node-a"
recipient_key = "x25519:0900000000000000000000000000000000000000000000000000000000000000"

[[nodes.adapters]]
name = "vllm-main"
kind = "openai_compat"
base_url = "https://127.0.0.1:8443"

[[nodes.providers]]
id = "a-vllm"
adapter = "vllm-main"
target = "meta-llama/Llama-3.1-8B-Instruct"
capacity = 8

[[models]]
name = "llama-3.1-8b"
providers = ["node-a/a-vllm"]

[outlier_detection]

[routing]

[cluster]
etcd_endpoints = ["127.0.0.1:2379"]
"#;

/// A valid `node.toml` with every table present.
const NODE_BASE: &str = r#"
node_id = "node-a"
trust_domain = "iop.local"
edge_addr = "127.0.0.1:7443"
edge_name = "edge-1"

[tls]
ca = "certs/ca.pem"
cert = "certs/node-a.pem"
key = "certs/node-a-key.pem"

[reconnect]

[credentials]
recipient_key = "keys/node-a.key"
issuer_public_key = "ed25519:5866666666666666666666666666666666666666666666666666666666666666"

[credentials.allowed_origins]
openai-main = ["https://127.0.0.1:8443"]

[metrics]
"#;

fn parse_edge(text: &str) -> Result<EdgeConfig, String> {
    EdgeConfig::parse(text, "conf/edge.toml").map_err(|e| e.to_string())
}

fn parse_node(text: &str) -> Result<NodeConfig, String> {
    NodeConfig::parse(text, "conf/node.toml").map_err(|e| e.to_string())
}

/// Fails with every disagreement, one per line.
fn assert_agree(file: &str, what: &str, problems: &[String]) {
    assert!(
        problems.is_empty(),
        "docs/configuration.md and the code of {file} disagree ({what}):\n  {}",
        problems.join("\n  ")
    );
}

// ---------------------------------------------------------------------------
// Keys and types
// ---------------------------------------------------------------------------

/// Keys the code accepts and the page lacks, documented keys the code
/// refuses, keys documented twice, and types the page misstates.
fn key_problems(code: &[Key], rows: &[Row]) -> Vec<String> {
    let mut problems = Vec::new();
    for key in code {
        if !rows.iter().any(|r| r.key == key.path) {
            problems.push(format!(
                "{}: accepted by the code, not documented",
                key.path
            ));
        }
    }
    for (i, row) in rows.iter().enumerate() {
        if rows[..i].iter().any(|r| r.key == row.key) {
            problems.push(format!("{} (line {}): documented twice", row.key, row.line));
        }
        let Some(key) = code.iter().find(|k| k.path == row.key) else {
            problems.push(format!(
                "{} (line {}): documented, not accepted by the code",
                row.key, row.line
            ));
            continue;
        };
        if let Some(ty) = key.shape.type_name() {
            if row.ty != ty {
                problems.push(format!(
                    "{} (line {}): the page says type {:?}, the code reads {ty:?}",
                    row.key, row.line, row.ty
                ));
            }
        }
    }
    problems
}

#[test]
fn every_key_of_edge_toml_is_documented_and_every_documented_key_exists() {
    let code = edge_keys();
    // The walk reached the nested tables (a sanity bound, not the check).
    assert!(code.iter().any(|k| k.path == "nodes.adapters.capacity"));
    let problems = key_problems(&code, &page_rows("edge.toml"));
    assert_agree("edge.toml", "keys", &problems);
}

#[test]
fn every_key_of_node_toml_is_documented_and_every_documented_key_exists() {
    let code = node_keys();
    assert!(code
        .iter()
        .any(|k| k.path == "credentials.allowed_origins.<name>"));
    let problems = key_problems(&code, &page_rows("node.toml"));
    assert_agree("node.toml", "keys", &problems);
}

// ---------------------------------------------------------------------------
// Defaults and required keys
// ---------------------------------------------------------------------------

/// The table holding the last segment of `path` (arrays of tables: their
/// first table; `<name>`: the map's first key), or why there is none.
fn parent<'a>(root: &'a mut Table, path: &str) -> Result<(&'a mut Table, String), String> {
    let segments: Vec<&str> = path.split('.').collect();
    let (last, parents) = segments.split_last().expect("a path has a segment");
    let mut table = root;
    for segment in parents {
        let name = resolve(table, segment)?;
        table = match table.get_mut(&name) {
            Some(Value::Table(t)) => t,
            Some(Value::Array(items)) => match items.first_mut() {
                Some(Value::Table(t)) => t,
                _ => return Err(format!("the base file's {name} holds no table")),
            },
            _ => return Err(format!("the base file has no table {name}")),
        };
    }
    let last = resolve(table, last)?;
    Ok((table, last))
}

fn resolve(table: &Table, segment: &str) -> Result<String, String> {
    if segment != "<name>" {
        return Ok(segment.to_owned());
    }
    table
        .keys()
        .next()
        .cloned()
        .ok_or_else(|| "the base file's map has no key".to_owned())
}

fn without(base: &Table, path: &str) -> Result<(Table, bool), String> {
    let mut table = base.clone();
    let (parent, last) = parent(&mut table, path)?;
    let removed = parent.remove(&last).is_some();
    Ok((table, removed))
}

fn with(base: &Table, path: &str, value: Value) -> Result<Table, String> {
    let (mut table, _) = without(base, path)?;
    let (parent, last) = parent(&mut table, path)?;
    parent.insert(last, value);
    Ok(table)
}

fn text(table: &Table) -> String {
    match toml::to_string(table) {
        Ok(text) => text,
        Err(e) => panic!("{e}"),
    }
}

/// The test's base file as a table; panics when the code refuses it (the
/// other checks would all fail for that one reason).
fn base_table<C>(base: &str, parse: impl Fn(&str) -> Result<C, String>) -> Table {
    let table: Table = match toml::from_str(base) {
        Ok(t) => t,
        Err(e) => panic!("the test's base file: {e}"),
    };
    if let Err(e) = parse(&text(&table)) {
        panic!(
            "the code refuses the test's base file: {e} (a newly required key: document it and \
             add it to the base file)"
        );
    }
    table
}

/// A TOML value as the page writes it (`30000`, `"open"`, `{}`, `[]`).
fn toml_value(literal: &str) -> Result<Value, String> {
    let mut doc: Table =
        toml::from_str(&format!("v = {literal}")).map_err(|e| format!("not a TOML value: {e}"))?;
    doc.remove("v").ok_or_else(|| "not a TOML value".to_owned())
}

fn default_problems<C: PartialEq + Debug>(
    rows: &[Row],
    base: &str,
    parse: impl Fn(&str) -> Result<C, String>,
) -> Vec<String> {
    let base = base_table(base, &parse);
    let mut problems = Vec::new();
    for row in rows {
        let at = |why: String| format!("{} (line {}): {why}", row.key, row.line);
        match &row.default {
            DefaultCell::Prose => {}
            DefaultCell::Required => match without(&base, &row.key) {
                Err(why) => problems.push(at(why)),
                // The base file holds only what must be there, and parses.
                Ok((_, false)) => problems.push(at(
                    "documented required, but a file without it (the test's base file) parses"
                        .into(),
                )),
                Ok((table, true)) => {
                    if let Ok(config) = parse(&text(&table)) {
                        problems.push(at(format!(
                            "documented required, but a file without it parses: {config:?}"
                        )));
                    }
                }
            },
            DefaultCell::Value(literal) => {
                let value = match toml_value(literal) {
                    Ok(v) => v,
                    Err(why) => {
                        problems.push(at(format!("default `{literal}`: {why}")));
                        continue;
                    }
                };
                let (absent, set) = match (without(&base, &row.key), with(&base, &row.key, value)) {
                    (Ok((absent, _)), Ok(set)) => (absent, set),
                    (Err(why), _) | (_, Err(why)) => {
                        problems.push(at(why));
                        continue;
                    }
                };
                match (parse(&text(&absent)), parse(&text(&set))) {
                    (Err(e), _) => problems.push(at(format!(
                        "documented with a default, but a file without it is refused: {e}"
                    ))),
                    (_, Err(e)) => problems.push(at(format!(
                        "the documented default `{literal}` is refused: {e}"
                    ))),
                    (Ok(absent), Ok(set)) => {
                        if absent != set {
                            problems.push(at(format!(
                                "the documented default `{literal}` is not what leaving the key \
                                 out gives"
                            )));
                        }
                    }
                }
            }
        }
    }
    problems
}

#[test]
fn the_defaults_and_required_keys_of_edge_toml_are_the_code_s() {
    let problems = default_problems(&page_rows("edge.toml"), EDGE_BASE, parse_edge);
    assert_agree("edge.toml", "defaults", &problems);
}

#[test]
fn the_defaults_and_required_keys_of_node_toml_are_the_code_s() {
    let problems = default_problems(&page_rows("node.toml"), NODE_BASE, parse_node);
    assert_agree("node.toml", "defaults", &problems);
}

// ---------------------------------------------------------------------------
// Ranges
// ---------------------------------------------------------------------------

fn range_problems<C: Debug>(
    code: &[Key],
    rows: &[Row],
    base: &str,
    parse: impl Fn(&str) -> Result<C, String>,
) -> Vec<String> {
    let base = base_table(base, &parse);
    let mut problems = Vec::new();
    for row in rows {
        let at = |why: String| format!("{} (line {}): {why}", row.key, row.line);
        let integer = code
            .iter()
            .find(|k| k.path == row.key)
            .is_some_and(|k| k.shape.is_integer());
        let (min, max) = match row.range {
            Range::Integers(min, max) => (min, max),
            Range::None if integer => {
                problems.push(at("an integer key documents its range".into()));
                continue;
            }
            Range::None | Range::Prose => continue,
        };
        let name = row.key.rsplit('.').next().unwrap_or(&row.key);
        let parsed = |v: i64| with(&base, &row.key, Value::Integer(v)).map(|t| parse(&text(&t)));
        for (v, inside) in [
            (Some(min), true),
            (Some(max), true),
            (min.checked_sub(1), false),
            (max.checked_add(1), false),
        ] {
            let Some(v) = v else { continue };
            match (parsed(v), inside) {
                (Err(why), _) => problems.push(at(why)),
                (Ok(Err(e)), true) => problems.push(at(format!(
                    "{v} is inside the documented range `{min}` to `{max}`, but refused: {e}"
                ))),
                (Ok(Ok(config)), false) => problems.push(at(format!(
                    "{v} is outside the documented range `{min}` to `{max}`, but accepted: \
                     {config:?}"
                ))),
                (Ok(Err(e)), false) if !e.contains(name) => {
                    problems.push(at(format!("{v} is refused, but not for this key: {e}")))
                }
                _ => {}
            }
        }
    }
    problems
}

#[test]
fn the_ranges_of_edge_toml_are_the_code_s() {
    let problems = range_problems(&edge_keys(), &page_rows("edge.toml"), EDGE_BASE, parse_edge);
    assert_agree("edge.toml", "ranges", &problems);
}

#[test]
fn the_ranges_of_node_toml_are_the_code_s() {
    let problems = range_problems(&node_keys(), &page_rows("node.toml"), NODE_BASE, parse_node);
    assert_agree("node.toml", "ranges", &problems);
}

// ---------------------------------------------------------------------------
// Reload
// ---------------------------------------------------------------------------

#[test]
fn the_reload_column_of_edge_toml_is_config_diff_s() {
    let rows = page_rows("edge.toml");
    let mut problems = Vec::new();
    for row in &rows {
        let documented = match row.reload {
            Reload::Live => Some(Apply::Live),
            Reload::Restart => Some(Apply::Restart),
            Reload::None => None,
        };
        if let Some(apply) = apply_of(&row.key) {
            if documented != Some(apply) {
                problems.push(format!(
                    "{} (line {}): config::diff says {:?}, the page {:?}",
                    row.key, row.line, apply, row.reload
                ));
            }
        }
    }
    for setting in SETTINGS {
        if !rows.iter().any(|r| r.key == setting.key) {
            problems.push(format!(
                "{}: a setting config::diff classifies, not documented",
                setting.key
            ));
        }
    }
    assert_agree("edge.toml", "reload", &problems);
}
