//! Operator commands to a Node (K2): `POST /admin/nodes/{node_id}/commands`
//! with `{"type":"capabilities"|"transport_status"|"provider_status"|
//! "ollama_query","adapter":"...","path":"..."}` sends a `NodeCommandRequest`
//! to the node's dispatch-ready connection and answers with its
//! `NodeCommandResponse` as JSON.
//!
//! ```text
//! POST ─► parse ─► ready owner of node_id? ─no─► 404
//!            │ yes: pending[command_id] = (conn, reply)
//!            ▼
//!   NodeCommandRequest ──► node ──► NodeCommandResponse ──► nodes.rs ─► on_response ─► reply
//!            ├── the connection closed before the command went out ─► 502
//!            └── no answer within COMMAND_WAIT ─► 504
//! ```
//!
//! Who may send them ([`authorize`]): with `[[client_keys]]` configured, a
//! key with `scopes = ["admin"]` (another key: 403 `admin_scope_required`;
//! none or an unknown one: 401 as on every route); without client keys,
//! only a peer on a loopback address (another: 403 `admin_loopback_only`),
//! whatever address the client listener is bound to, that names the Edge
//! by a loopback `Host` (another: 403 `admin_host_not_loopback`, so a web
//! page whose name was rebound to 127.0.0.1 gets nothing). A command's
//! body must be declared `application/json` (else 415), which a cross-site
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

use crate::link::commands::{send, CommandFailed, COMMAND_WAIT};
use crate::link::edge::Edge;
use crate::plane::client_keys::Authority;

/// Path prefix of the route.
pub const COMMANDS_PREFIX: &str = "/admin/nodes/";
/// Path suffix of the route.
pub const COMMANDS_SUFFIX: &str = "/commands";
/// The node id of a command path, if `path` is one.
pub fn command_node(path: &str) -> Option<&str> {
    let id = path
        .strip_prefix(COMMANDS_PREFIX)?
        .strip_suffix(COMMANDS_SUFFIX)?;
    (!id.is_empty() && !id.contains('/')).then_some(id)
}

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

/// Handles `POST {path}` with `body`; returns the status and JSON body.
pub async fn handle(edge: &Rc<Edge>, path: &str, body: &[u8]) -> (u16, Bytes) {
    let Some(node_id) = command_node(path) else {
        return error(404, "not_found", "expected /admin/nodes/{node_id}/commands");
    };
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
