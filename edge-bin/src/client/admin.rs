//! The admin routes: operator commands to a Node, operator drains, and the
//! running configuration.
//!
//! - `POST /admin/nodes/{node_id}/commands` (K2) with
//!   `{"type":"capabilities"|"transport_status"|"provider_status"|
//!   "ollama_query","adapter":"...","path":"..."}` sends a
//!   `NodeCommandRequest` to the node's dispatch-ready connection and
//!   answers with its `NodeCommandResponse` as JSON.
//! - `POST /admin/nodes/{node_id}/drain` and `/undrain`,
//!   `POST /admin/providers/{node_id}/{provider_id}/drain` and `/undrain`:
//!   an operator drain (`Input::SetDrain`): a drained node or provider takes
//!   no new dispatch, what runs there finishes; kept across the node's
//!   reconnects and reloads, not across a restart; undraining lets the
//!   queue in at once. 404 for a node or provider the configuration does
//!   not name (a reload may have removed it). Idempotent.
//! - `GET /admin/config`: the running configuration's reload revision,
//!   the BLAKE3 digest of its file and the configuration as JSON
//!   ([`config_json`]), written field by field from the validated
//!   configuration so that no secret can be in it: no client key hash,
//!   no credential secret nor where it is read from (file or environment
//!   variable name), no key material (TLS and issuer key *paths* are
//!   shown; what is in them is never read here).
//!
//! ```text
//! POST .../commands ─► parse ─► ready owner of node_id? ─no─► 404
//!            │ yes: pending[command_id] = (conn, reply)
//!            ▼
//!   NodeCommandRequest ──► node ──► NodeCommandResponse ──► nodes.rs ─► on_response ─► reply
//!            ├── the connection closed before the command went out ─► 502
//!            └── no answer within COMMAND_WAIT ─► 504
//!
//! POST .../drain ─► Input::SetDrain ──► Control (any shard: in order with the read below)
//!                └─► read: Control::drained(target) ─► 200 {"drained": ...} | 404
//! ```
//!
//! Who may use them ([`authorize`]): with `[[client_keys]]` configured, a
//! key with `scopes = ["admin"]` (another key: 403 `admin_scope_required`;
//! none or an unknown one: 401 as on every route); without client keys,
//! only a peer on a loopback address (another: 403 `admin_loopback_only`),
//! whatever address the client listener is bound to, that names the Edge
//! by a loopback `Host` (another: 403 `admin_host_not_loopback`, so a web
//! page whose name was rebound to 127.0.0.1 gets nothing). A POST's body
//! must be declared `application/json` (else 415), which a cross-site
//! form cannot do.
//!
//! Only dispatch-ready owners receive commands (X6). The command waits for
//! its answer in [`crate::link::commands`]: an answer counts only when it
//! arrives on the connection the command went to.

use std::net::IpAddr;
use std::rc::Rc;

use bytes::Bytes;
use iop_wire::pb;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::config::{AdapterKind, Destination, EdgeConfig, Format, MetricsAccess, SecretSource};
use crate::control::{DrainTarget, Input, ProviderKey};
use crate::link::commands::{send, CommandFailed, COMMAND_WAIT};
use crate::link::edge::Edge;
use crate::plane::client_keys::Authority;
use crate::plane::running::Running;

/// Path prefix of every admin route.
pub const ADMIN_PREFIX: &str = "/admin/";
/// The running configuration (`GET`).
pub const CONFIG_PATH: &str = "/admin/config";
/// Path prefix of the node routes.
pub const COMMANDS_PREFIX: &str = "/admin/nodes/";
/// Path suffix of the command route.
pub const COMMANDS_SUFFIX: &str = "/commands";
/// Path prefix of the provider routes.
pub const PROVIDERS_PREFIX: &str = "/admin/providers/";

/// The node id of a command path, if `path` is one.
pub fn command_node(path: &str) -> Option<&str> {
    let id = path
        .strip_prefix(COMMANDS_PREFIX)?
        .strip_suffix(COMMANDS_SUFFIX)?;
    (!id.is_empty() && !id.contains('/')).then_some(id)
}

/// What an admin `POST` path names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdminPost<'p> {
    /// `/admin/nodes/{node_id}/commands`.
    Command {
        /// The node id.
        node_id: &'p str,
    },
    /// `/admin/nodes/{node_id}/drain|undrain`,
    /// `/admin/providers/{node_id}/{provider_id}/drain|undrain`.
    Drain {
        /// The node or provider.
        target: DrainTarget,
        /// `drain` or `undrain`.
        drained: bool,
    },
}

/// The admin `POST` route of `path`, if it is one.
pub fn admin_post(path: &str) -> Option<AdminPost<'_>> {
    if let Some(node_id) = command_node(path) {
        return Some(AdminPost::Command { node_id });
    }
    let (rest, drained) = if let Some(rest) = path.strip_suffix("/drain") {
        (rest, true)
    } else {
        (path.strip_suffix("/undrain")?, false)
    };
    let segment = |s: &str| !s.is_empty() && !s.contains('/');
    if let Some(node_id) = rest.strip_prefix(COMMANDS_PREFIX) {
        return segment(node_id).then(|| AdminPost::Drain {
            target: DrainTarget::Node(node_id.to_owned()),
            drained,
        });
    }
    let (node_id, provider_id) = rest.strip_prefix(PROVIDERS_PREFIX)?.split_once('/')?;
    (segment(node_id) && segment(provider_id)).then(|| AdminPost::Drain {
        target: DrainTarget::Provider(ProviderKey {
            node_id: node_id.into(),
            provider_id: provider_id.into(),
        }),
        drained,
    })
}

/// A drain's body: nothing, or an empty JSON object.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DrainBody {}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CommandBody {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    adapter: String,
    #[serde(default)]
    path: String,
}

fn command_type(kind: &str) -> Option<pb::CommandType> {
    match kind {
        "capabilities" => Some(pb::CommandType::Capabilities),
        "transport_status" => Some(pb::CommandType::TransportStatus),
        "provider_status" => Some(pb::CommandType::ProviderStatus),
        "ollama_query" => Some(pb::CommandType::OllamaQuery),
        _ => None,
    }
}

fn error(status: u16, code: &str, message: &str) -> (u16, Bytes) {
    let body = json!({
        "error": {"message": message, "type": "admin_error", "param": null, "code": code}
    });
    (status, Bytes::from(body.to_string()))
}

/// Where a request came from, as the admin routes judge a caller without
/// a key (an Edge without client keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Requester {
    /// The peer address of the connection.
    pub peer: Option<IpAddr>,
    /// Whether its `Host` names this machine's loopback
    /// ([`host_is_loopback`]).
    pub loopback_host: bool,
}

impl Requester {
    /// The requester of a request from `peer` with `host` (its `Host`
    /// header's value, if any).
    pub fn of(peer: Option<IpAddr>, host: Option<&[u8]>) -> Self {
        Self {
            peer,
            loopback_host: host_is_loopback(host),
        }
    }
}

/// Whether a `Host` header value names this machine's loopback:
/// `localhost`, an address in `127.0.0.0/8` or `[::1]`, with or without a
/// port. A browser sends another name for a page of another site even when
/// that site's name resolves to 127.0.0.1 (DNS rebinding), so requiring it
/// keeps such pages from the admin routes of an Edge without keys.
pub fn host_is_loopback(host: Option<&[u8]>) -> bool {
    let Some(host) = host.and_then(|h| std::str::from_utf8(h).ok()) else {
        return false;
    };
    let host = host.trim();
    let name = if let Some(rest) = host.strip_prefix('[') {
        // [v6]:port
        match rest.split_once(']') {
            Some((v6, port)) if port.is_empty() || port.starts_with(':') => v6,
            _ => return false,
        }
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            Some(_) => return false,
            None => host,
        }
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.to_canonical().is_loopback())
}

/// Whether a request let in as `authority` from `from` may use the admin
/// routes; the refusal is the status and JSON body to answer with.
pub fn authorize(authority: Authority, from: Requester) -> Result<(), (u16, Bytes)> {
    authorize_route(authority, from, "/admin")
}

/// Whether an admin command's body is declared JSON: a cross-site form
/// (which a browser may send anywhere without asking) cannot declare it.
pub fn check_content_type(content_type: Option<&[u8]>) -> Result<(), (u16, Bytes)> {
    let json = content_type.is_some_and(|v| {
        let essence = v.split(|&b| b == b';').next().unwrap_or_default();
        essence
            .trim_ascii()
            .eq_ignore_ascii_case(b"application/json")
    });
    if json {
        Ok(())
    } else {
        Err(error(
            415,
            "unsupported_media_type",
            "admin commands take a JSON body: send content-type: application/json",
        ))
    }
}

/// [`authorize`] for any admin-only route (`/admin`, the status page's
/// `/ui/events`); `route` names it in the refusal. A caller without a key
/// (an Edge without client keys) must connect from a loopback address and
/// address the Edge by a loopback name.
pub fn authorize_route(
    authority: Authority,
    from: Requester,
    route: &str,
) -> Result<(), (u16, Bytes)> {
    match authority {
        Authority::Key { admin: true, .. } => Ok(()),
        Authority::Key { admin: false, .. } => Err(error(
            403,
            "admin_scope_required",
            &format!(
                "this API key may not use {route}: give it scopes = [\"admin\"] in [[client_keys]]"
            ),
        )),
        Authority::Anonymous if !from.peer.is_some_and(|ip| ip.to_canonical().is_loopback()) => {
            Err(error(
                403,
                "admin_loopback_only",
                &format!("without [[client_keys]] {route} answers loopback clients only"),
            ))
        }
        Authority::Anonymous if !from.loopback_host => Err(error(
            403,
            "admin_host_not_loopback",
            &format!(
                "without [[client_keys]] {route} answers requests addressed to localhost only \
                 (Host must be localhost, 127.0.0.1 or [::1])"
            ),
        )),
        Authority::Anonymous => Ok(()),
    }
}

/// Handles an admin `POST {path}` with `body` (the caller is authorized and
/// the body declared JSON); returns the status and JSON body.
pub async fn handle(edge: &Rc<Edge>, path: &str, body: &[u8]) -> (u16, Bytes) {
    match admin_post(path) {
        Some(AdminPost::Command { node_id }) => command(edge, node_id, body).await,
        Some(AdminPost::Drain { target, drained }) => {
            if !body.trim_ascii().is_empty() {
                if let Err(e) = serde_json::from_slice::<DrainBody>(body) {
                    return error(
                        400,
                        "invalid_request",
                        &format!("a drain takes no body, or {{}}: {e}"),
                    );
                }
            }
            drain(edge, target, drained).await
        }
        None if path == CONFIG_PATH => {
            error(405, "method_not_allowed", "/admin/config answers GET only")
        }
        None => error(
            404,
            "not_found",
            "expected /admin/nodes/{node_id}/commands, /admin/nodes/{node_id}/drain|undrain \
             or /admin/providers/{node_id}/{provider_id}/drain|undrain",
        ),
    }
}

/// Drains (`drained`) or undrains `target`, then reads back what holds
/// now. The read follows the input on the way to the control shard (one
/// mailbox, in order), so it sees the drain applied; an unknown or removed
/// target changes nothing and reads as `None`: 404.
async fn drain(edge: &Rc<Edge>, target: DrainTarget, drained: bool) -> (u16, Bytes) {
    edge.apply(Input::SetDrain {
        target: target.clone(),
        drained,
    });
    let now = {
        let target = target.clone();
        edge.with_control(move |control| control.drained(&target))
            .await
    };
    match (now, &target) {
        (Some(Some(drained)), DrainTarget::Node(id)) => (
            200,
            Bytes::from(json!({"node": id, "drained": drained}).to_string()),
        ),
        (Some(Some(drained)), DrainTarget::Provider(key)) => (
            200,
            Bytes::from(json!({"provider": key.to_string(), "drained": drained}).to_string()),
        ),
        (Some(None), DrainTarget::Node(id)) => error(
            404,
            "unknown_node",
            &format!("no node `{id}` in the running configuration"),
        ),
        (Some(None), DrainTarget::Provider(key)) => error(
            404,
            "unknown_provider",
            &format!("no provider `{key}` in the running configuration"),
        ),
        (None, _) => error(503, "shutting_down", "the Edge is shutting down"),
    }
}

/// `GET /admin/config` (the caller is authorized): the running
/// configuration, its revision and digest.
pub fn config(edge: &Edge) -> (u16, Bytes) {
    let running = edge.settings.running.get();
    (200, Bytes::from(config_json(&running).to_string()))
}

/// Sends one operator command to `node_id`'s ready owner.
async fn command(edge: &Rc<Edge>, node_id: &str, body: &[u8]) -> (u16, Bytes) {
    let request: CommandBody = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => {
            return error(
                400,
                "invalid_request",
                &format!("invalid command body: {e}"),
            )
        }
    };
    let Some(kind) = command_type(&request.kind) else {
        return error(
            400,
            "invalid_request",
            "type must be capabilities, transport_status, provider_status or ollama_query",
        );
    };
    // X6: only the dispatch-ready owner of the node gets commands.
    let target = {
        let node_id = node_id.to_string();
        edge.with_control(move |control| control.ready_conn(&node_id))
            .await
            .flatten()
    };
    let Some(conn_id) = target else {
        return error(
            404,
            "node_not_ready",
            &format!("node `{node_id}` is not connected and ready"),
        );
    };
    let command = pb::NodeCommandRequest {
        command_id: String::new(),
        r#type: kind as i32,
        adapter: request.adapter,
        path: request.path,
    };
    match send(edge, conn_id, command, COMMAND_WAIT).await {
        Ok(resp) => (200, Bytes::from(response_json(&resp).to_string())),
        Err(CommandFailed::Busy) => error(503, "busy", "too many commands are waiting for nodes"),
        Err(CommandFailed::Closed) => error(502, "node_unavailable", "the node connection closed"),
        Err(CommandFailed::TimedOut) => error(
            504,
            "node_timeout",
            "the node did not answer the command in time",
        ),
    }
}

fn health_name(h: pb::ProviderHealth) -> &'static str {
    match h {
        pb::ProviderHealth::Available => "available",
        pb::ProviderHealth::Unavailable => "unavailable",
        pb::ProviderHealth::Unknown => "unknown",
        pb::ProviderHealth::Offline => "offline",
        pb::ProviderHealth::Unspecified => "unspecified",
    }
}

/// The JSON form of a command answer. An Ollama body that is JSON is
/// embedded as JSON, anything else as a string.
pub fn response_json(resp: &pb::NodeCommandResponse) -> Value {
    let capabilities: Vec<Value> = resp
        .capabilities
        .iter()
        .map(|c| {
            json!({
                "adapter_key": c.adapter_key,
                "target": c.target,
                "provider_status": health_name(c.provider_status()),
                "health_observation_seq": c.health_observation_seq,
                "adapter": c.adapter,
                "instance_key": c.instance_key,
            })
        })
        .collect();
    let providers: Vec<Value> = resp
        .providers
        .iter()
        .map(|p| {
            json!({
                "adapter_key": p.adapter_key,
                "adapter": p.adapter,
                "state": p.state,
                "capacity": p.capacity,
                "in_flight": p.in_flight,
                "targets": p.targets,
            })
        })
        .collect();
    let transport = resp.transport_status.as_ref().map(|t| {
        json!({
            "node_id": t.node_id,
            "session_age_sec": t.session_age_sec,
            "active_runs": t.active_runs,
            "active_tunnels": t.active_tunnels,
            "frames_sent": t.frames_sent,
            "frames_received": t.frames_received,
        })
    });
    let query_body = if resp.query_body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&resp.query_body)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&resp.query_body).into()))
    };
    json!({
        "command_id": resp.command_id,
        "ok": resp.ok,
        "error": resp.error,
        "capabilities": capabilities,
        "transport_status": transport,
        "providers": providers,
        "query_status": resp.query_status,
        "query_body": query_body,
    })
}

/// The `GET /admin/config` document: `{"revision", "digest", "config"}`
/// (`config` is `null` for an Edge built without a file).
pub fn config_json(running: &Running) -> Value {
    json!({
        "revision": running.revision,
        "digest": running.digest,
        "config": running.config.as_deref().map(edge_config_json),
    })
}

fn path(p: &std::path::Path) -> Value {
    Value::String(p.display().to_string())
}

/// `cfg` as JSON, in the file's tables and key names, every field named
/// here (a field added to the configuration shows nowhere until it is
/// added here). Secrets are left
/// out by construction: a client key shows its principal, scopes, limits
/// and models, never its hash; a credential slot shows whether its secret
/// comes from a file or the environment, never the file's path, the
/// variable's name or the secret; the TLS and issuer keys show their
/// paths; a provider CA shows its file, not its PEM.
pub fn edge_config_json(cfg: &EdgeConfig) -> Value {
    let e = &cfg.edge;
    let l = &e.limits;
    let edge = json!({
        "name": e.name,
        "trust_domain": e.trust_domain,
        "client_listen": e.client_listen.to_string(),
        "node_listen": e.node_listen.to_string(),
        "max_request_body_bytes": e.max_request_body_bytes,
        "max_upload_body_bytes": e.max_upload_body_bytes,
        "max_frame_bytes": e.max_frame_bytes,
        "insecure_plaintext_nodes": e.insecure_plaintext_nodes,
        "allow_anonymous": e.allow_anonymous,
        "metrics_access": match e.metrics_access {
            MetricsAccess::Open => "open",
            MetricsAccess::Key => "key",
        },
        "node_metrics_max_age_ms": e.node_metrics_max_age_ms,
        "drain_grace_ms": e.drain_grace_ms,
        "flow_window_bytes": e.flow_window_bytes,
        "client_write_stall_timeout_ms": e.client_write_stall_timeout_ms,
        "response_wait_timeout_ms": e.response_wait_timeout_ms,
        "client_head_timeout_ms": l.client_head_timeout_ms,
        "client_body_idle_timeout_ms": l.client_body_idle_timeout_ms,
        "client_body_grace_ms": l.client_body_grace_ms,
        "client_body_min_rate_bytes_per_sec": l.client_body_min_rate_bytes_per_sec,
        "client_keep_alive_timeout_ms": l.client_keep_alive_timeout_ms,
        "max_client_connections": l.max_client_connections,
        "max_client_connections_per_peer": l.max_client_connections_per_peer,
        "client_linger_time_ms": l.client_linger_time_ms,
        "client_linger_idle_timeout_ms": l.client_linger_idle_timeout_ms,
        "client_linger_max_bytes": l.client_linger_max_bytes,
        "node_handshake_timeout_ms": l.node_handshake_timeout_ms,
        "max_node_handshakes": l.max_node_handshakes,
        "max_node_handshakes_per_peer": l.max_node_handshakes_per_peer,
        "node_first_byte_timeout_ms": l.node_first_byte_timeout_ms,
        "max_json_depth": l.max_json_depth,
        "max_json_elements": l.max_json_elements,
        "max_json_members": l.max_json_members,
        "access_log": {
            "destination": match &cfg.access_log.destination {
                Destination::Off => json!("off"),
                Destination::Stderr => json!("stderr"),
                Destination::File(p) => path(p),
            },
            "format": match cfg.access_log.format {
                Format::Text => "text",
                Format::Json => "json",
            },
        },
        "usage_log": cfg.usage_log.as_deref().map(|p| json!({"path": path(p)})),
        "client_tls": cfg.client_tls.as_ref().map(|t| json!({
            "cert": path(&t.cert),
            "key": path(&t.key),
            "client_ca": t.client_ca.as_deref().map(path),
        })),
    });
    let nodes: Vec<Value> = cfg
        .nodes
        .iter()
        .map(|n| {
            json!({
                "id": n.id,
                "recipient_key": n
                    .recipient_key
                    .as_ref()
                    .map(iop_engine::keys::encode_recipient_public_key),
                "adapters": n.adapters.iter().map(|a| json!({
                    "name": a.name,
                    "kind": a.kind.as_str(),
                    "profile": match a.kind {
                        AdapterKind::OpenAiCompat { profile } => Some(profile.as_str()),
                        AdapterKind::Ollama => None,
                    },
                    "base_url": a.base_url.to_string(),
                    "ca_file": a.tls.ca_file.as_deref().map(path),
                    "tls_insecure_skip_verify": a.tls.insecure_skip_verify,
                    "capacity": a.capacity,
                    "health_path": a.health_path,
                })).collect::<Vec<_>>(),
                "providers": n.providers.iter().map(|p| json!({
                    "id": p.id,
                    "adapter": p.adapter,
                    "target": p.target,
                    "capacity": p.capacity,
                    "long_context_capacity": p.long_context_capacity,
                    "response_stall_timeout_ms": p.response_stall_timeout_ms,
                    "category": p.category.as_str(),
                    "enabled": p.enabled,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let models: Vec<Value> = cfg
        .models
        .iter()
        .map(|m| {
            json!({
                "name": m.name,
                "providers": m.providers.iter().map(ToString::to_string).collect::<Vec<_>>(),
                "long_context_threshold_tokens": m.long_context_threshold_tokens,
                "max_queue": m.max_queue,
                "queue_timeout_ms": m.queue_timeout_ms,
                "max_attempts": m.max_attempts,
                "owned_by": m.owned_by,
            })
        })
        .collect();
    let credentials = cfg.credentials.as_ref().map(|c| {
        json!({
            "issuer_key": path(&c.issuer_key),
            "lease_ttl_ms": c.lease_ttl_ms,
            "slots": c.slots.iter().map(|s| json!({
                "name": s.name,
                // Where the secret is read from is not shown either.
                "secret_from": match s.secret {
                    SecretSource::File(_) => "file",
                    SecretSource::Env(_) => "env",
                },
                "header": s.header_name,
                "format": s.header_format,
                "revision": s.revision,
                "revoked_revisions": s.revoked_revisions,
                "enabled": s.enabled,
                "providers": s.providers.iter().map(ToString::to_string).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })
    });
    let client_keys: Vec<Value> = cfg
        .client_keys
        .iter()
        .map(|k| {
            let scopes: Vec<&str> = [
                (k.admin, crate::config::ADMIN_SCOPE),
                (k.metrics, crate::config::METRICS_SCOPE),
            ]
            .into_iter()
            .filter_map(|(on, scope)| on.then_some(scope))
            .collect();
            json!({
                "principal": k.principal,
                "scopes": scopes,
                "max_concurrent": k.limits.max_concurrent,
                "requests_per_minute": k.limits.requests_per_minute,
                "tokens_per_minute": k.limits.tokens_per_minute,
                "models": k.models,
            })
        })
        .collect();
    let o = &cfg.outlier_detection;
    json!({
        "source": path(&cfg.source),
        "edge": edge,
        "tls": cfg.tls.as_ref().map(|t| json!({
            "ca": path(&t.ca),
            "cert": path(&t.cert),
            "key": path(&t.key),
        })),
        "nodes": nodes,
        "models": models,
        "credentials": credentials,
        "client_keys": client_keys,
        "outlier_detection": {
            "enabled": o.enabled,
            "consecutive_failures": o.consecutive_failures,
            "base_ejection_time_ms": o.base_ejection_time_ms,
            "max_ejection_time_ms": o.max_ejection_time_ms,
            "max_ejection_percent": o.max_ejection_percent,
        },
        "cluster": cfg.cluster.as_ref().map(|c| json!({
            "name": c.name,
            "etcd_endpoints": c.etcd_endpoints,
            "lease_ttl_sec": c.lease_ttl_sec,
            "keepalive_interval_sec": c.keepalive_interval_sec,
            "etcd_timeout_ms": c.etcd_timeout_ms,
            "peer_listen": c.peer_listen.map(|a| a.to_string()),
        })),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_needs_the_scope_or_a_loopback_peer() {
        let code = |r: Result<(), (u16, Bytes)>| {
            r.map_err(|(status, body)| {
                let v: Value = serde_json::from_slice(&body).unwrap();
                (status, v["error"]["code"].as_str().unwrap().to_owned())
            })
        };
        let remote: IpAddr = "192.0.2.7".parse().unwrap();
        let loopback: IpAddr = "127.0.0.1".parse().unwrap();
        let mapped: IpAddr = "::ffff:127.0.0.1".parse().unwrap();
        let mapped_remote: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        let at = |peer: Option<IpAddr>| Requester::of(peer, Some(b"localhost:8080"));
        assert_eq!(
            authorize(
                Authority::Key {
                    admin: true,
                    metrics: false
                },
                Requester::of(Some(remote), Some(b"api.example.com"))
            ),
            Ok(())
        );
        assert_eq!(
            code(authorize(
                Authority::Key {
                    admin: false,
                    metrics: true
                },
                at(Some(loopback))
            )),
            Err((403, "admin_scope_required".into()))
        );
        for ip in [loopback, mapped, "::1".parse().unwrap()] {
            assert_eq!(
                authorize(Authority::Anonymous, at(Some(ip))),
                Ok(()),
                "{ip}"
            );
        }
        for peer in [Some(remote), Some(mapped_remote), None] {
            assert_eq!(
                code(authorize(Authority::Anonymous, at(peer))),
                Err((403, "admin_loopback_only".into())),
                "{peer:?}"
            );
        }
        // DNS rebinding: a loopback peer, but a page of another site.
        for host in [Some(&b"evil.example:8080"[..]), None] {
            assert_eq!(
                code(authorize(
                    Authority::Anonymous,
                    Requester::of(Some(loopback), host)
                )),
                Err((403, "admin_host_not_loopback".into())),
                "{host:?}"
            );
        }
    }

    #[test]
    fn loopback_hosts_are_localhost_127_8_and_v6_loopback_with_any_port() {
        for host in [
            "localhost",
            "LOCALHOST:8080",
            "127.0.0.1",
            "127.9.8.7:1",
            "[::1]",
            "[::1]:8080",
            " 127.0.0.1:80 ",
        ] {
            assert!(host_is_loopback(Some(host.as_bytes())), "{host}");
        }
        for host in [
            "localhost.evil.example",
            "evil.example",
            "10.0.0.1:8080",
            "127.0.0.1.nip.io",
            "[::1",
            "[::2]:80",
            "localhost:80x",
            "",
        ] {
            assert!(!host_is_loopback(Some(host.as_bytes())), "{host}");
        }
        assert!(!host_is_loopback(Some(b"\xff")));
        assert!(!host_is_loopback(None));
    }

    #[test]
    fn admin_commands_must_be_declared_json() {
        for ok in [&b"application/json"[..], b"Application/JSON; charset=utf-8"] {
            assert_eq!(check_content_type(Some(ok)), Ok(()));
        }
        for refused in [
            Some(&b"text/plain"[..]),
            Some(b"application/x-www-form-urlencoded"),
            Some(b"multipart/form-data; boundary=x"),
            None,
        ] {
            let (status, body) = check_content_type(refused).unwrap_err();
            assert_eq!(status, 415);
            let v: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["error"]["code"], "unsupported_media_type");
            assert_eq!(v["error"]["param"], Value::Null);
        }
    }

    #[test]
    fn command_paths() {
        assert_eq!(command_node("/admin/nodes/node-a/commands"), Some("node-a"));
        assert_eq!(command_node("/admin/nodes//commands"), None);
        assert_eq!(command_node("/admin/nodes/a/b/commands"), None);
        assert_eq!(command_node("/admin/nodes/a"), None);
        assert_eq!(
            command_type("capabilities"),
            Some(pb::CommandType::Capabilities)
        );
        assert_eq!(command_type("run"), None);
    }

    #[test]
    fn drain_paths() {
        let node = |id: &str, drained| {
            Some(AdminPost::Drain {
                target: DrainTarget::Node(id.into()),
                drained,
            })
        };
        let provider = |n: &str, p: &str, drained| {
            Some(AdminPost::Drain {
                target: DrainTarget::Provider(ProviderKey {
                    node_id: n.into(),
                    provider_id: p.into(),
                }),
                drained,
            })
        };
        assert_eq!(
            admin_post("/admin/nodes/node-a/drain"),
            node("node-a", true)
        );
        assert_eq!(
            admin_post("/admin/nodes/node-a/undrain"),
            node("node-a", false)
        );
        assert_eq!(
            admin_post("/admin/providers/node-a/a-mock/drain"),
            provider("node-a", "a-mock", true)
        );
        assert_eq!(
            admin_post("/admin/providers/node-a/a-mock/undrain"),
            provider("node-a", "a-mock", false)
        );
        assert_eq!(
            admin_post("/admin/nodes/node-a/commands"),
            Some(AdminPost::Command { node_id: "node-a" })
        );
        for not_a_route in [
            "/admin/nodes//drain",
            "/admin/nodes/a/b/drain",
            "/admin/nodes/a/drained",
            "/admin/providers/node-a/drain",
            "/admin/providers//a-mock/drain",
            "/admin/providers/node-a//drain",
            "/admin/providers/node-a/a/b/drain",
            "/admin/providers/node-a/a-mock",
            "/admin/config",
            "/admin/drain",
        ] {
            assert_eq!(admin_post(not_a_route), None, "{not_a_route}");
        }
    }

    const KEY_HASH: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    /// A configuration with every kind of secret reference: client keys,
    /// a slot read from a file and one from the environment.
    fn secretive_config() -> EdgeConfig {
        let recipient = iop_engine::keys::encode_recipient_public_key(
            &x25519_dalek::PublicKey::from(&x25519_dalek::StaticSecret::from([9u8; 32])),
        );
        let text = format!(
            r#"
[edge]
name = "edge-1"
trust_domain = "iop.local"
client_listen = "127.0.0.1:8080"
node_listen = "127.0.0.1:7443"

[edge.access_log]
destination = "off"

[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge-key.pem"

[[nodes]]
id = "node-a"
recipient_key = "{recipient}"

[[nodes.adapters]]
name = "vllm-main"
kind = "openai_compat"
profile = "vllm"
base_url = "http://127.0.0.1:8000/prefix"
capacity = 8

[[nodes.providers]]
id = "a-llama"
adapter = "vllm-main"
target = "meta-llama/Llama-3.1-8B-Instruct"
capacity = 8
long_context_capacity = 2

[[nodes.providers]]
id = "a-other"
adapter = "vllm-main"
target = "other"
capacity = 1

[[models]]
name = "llama-3.1-8b"
providers = ["node-a/a-llama", "node-a/a-other"]

[credentials]
issuer_key = "keys/issuer.key"

[[credentials.slots]]
name = "openai-main"
secret_file = "secrets/openai-file-sk"
providers = ["node-a/a-llama"]

[[credentials.slots]]
name = "openai-other"
secret_env = "OPENAI_ENV_SECRET_NAME"
header = "x-api-key"
format = "{{secret}}"
providers = ["node-a/a-other"]

[[client_keys]]
principal = "ops"
key_hash = "{KEY_HASH}"
scopes = ["admin"]

[[client_keys]]
principal = "team-a"
key_hash = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100"
models = ["llama-3.1-8b"]
max_concurrent = 3
"#
        );
        EdgeConfig::parse(&text, "conf/edge.toml").expect("the test config parses")
    }

    #[test]
    fn the_config_document_holds_no_secret() {
        let cfg = secretive_config();
        let doc = config_json(&Running::of(&cfg, 7, "ab12".into()));
        let text = doc.to_string();
        for secret in [
            KEY_HASH,
            "ffeeddccbbaa99887766554433221100",
            "openai-file-sk",
            "OPENAI_ENV_SECRET_NAME",
        ] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
        // Neither the hash's bytes in another spelling.
        assert!(!text.to_ascii_lowercase().contains("00112233"), "{text}");
        assert_eq!(
            (&doc["revision"], &doc["digest"]),
            (&json!(7), &json!("ab12"))
        );
        let config = &doc["config"];
        assert_eq!(
            config["client_keys"],
            json!([
                {"principal": "ops", "scopes": ["admin"], "max_concurrent": null,
                 "requests_per_minute": null, "tokens_per_minute": null, "models": null},
                {"principal": "team-a", "scopes": [], "max_concurrent": 3,
                 "requests_per_minute": null, "tokens_per_minute": null,
                 "models": ["llama-3.1-8b"]},
            ])
        );
        let slots = &config["credentials"]["slots"];
        assert_eq!(
            slots[0],
            json!({"name": "openai-main", "secret_from": "file",
                   "header": "Authorization", "format": "Bearer {secret}",
                   "revision": 1, "revoked_revisions": [], "enabled": true,
                   "providers": ["node-a/a-llama"]})
        );
        assert_eq!(slots[1]["secret_from"], "env");
        assert_eq!(slots[1]["format"], "{secret}");
        // Paths of key files are shown (their contents are never read here).
        assert_eq!(config["tls"]["key"], "conf/certs/edge-key.pem");
        assert_eq!(config["credentials"]["issuer_key"], "conf/keys/issuer.key");
        // The fleet, as the file says it.
        assert_eq!(
            config["nodes"][0]["adapters"][0],
            json!({"name": "vllm-main", "kind": "openai_compat", "profile": "vllm",
                   "base_url": "http://127.0.0.1:8000/prefix", "ca_file": null,
                   "tls_insecure_skip_verify": false, "capacity": 8, "health_path": null})
        );
        assert_eq!(
            config["nodes"][0]["providers"][0],
            json!({"id": "a-llama", "adapter": "vllm-main",
                   "target": "meta-llama/Llama-3.1-8B-Instruct", "capacity": 8,
                   "long_context_capacity": 2, "response_stall_timeout_ms": 0,
                   "category": "local_inference", "enabled": true})
        );
        assert_eq!(
            config["nodes"][0]["recipient_key"],
            json!(iop_engine::keys::encode_recipient_public_key(
                cfg.nodes[0].recipient_key.as_ref().unwrap()
            ))
        );
        assert_eq!(
            config["models"][0]["providers"],
            json!(["node-a/a-llama", "node-a/a-other"])
        );
        assert_eq!(config["edge"]["access_log"]["destination"], "off");
        assert_eq!(config["edge"]["client_listen"], "127.0.0.1:8080");
        assert_eq!(config["cluster"], Value::Null);
        // An Edge without a file shows no configuration.
        let bare = Running::bare(1, 1, std::time::Duration::from_secs(1));
        assert_eq!(
            config_json(&bare),
            json!({"revision": 1, "digest": "", "config": null})
        );
    }

    #[test]
    fn response_json_shape() {
        let resp = pb::NodeCommandResponse {
            command_id: "admin-1".into(),
            ok: true,
            capabilities: vec![pb::AdapterCapability {
                adapter_key: "mock".into(),
                target: "m".into(),
                provider_status: pb::ProviderHealth::Available as i32,
                health_observation_seq: Some(3),
                adapter: "openai_compat".into(),
                instance_key: "mock".into(),
            }],
            query_body: Bytes::from_static(b"{\"models\":[]}"),
            query_status: 200,
            ..Default::default()
        };
        assert_eq!(
            response_json(&resp),
            json!({
                "command_id": "admin-1", "ok": true, "error": "",
                "capabilities": [{"adapter_key": "mock", "target": "m",
                    "provider_status": "available", "health_observation_seq": 3,
                    "adapter": "openai_compat", "instance_key": "mock"}],
                "transport_status": null, "providers": [],
                "query_status": 200, "query_body": {"models": []},
            })
        );
    }
}
