//! The swarm's probe client: chat completions sent one at a time over one
//! keep-alive connection per Edge client listener, each carrying its
//! sequence number in the user message. The node that receives the
//! tunnel request stamps the instant it read it ([`SwarmState`]), so the
//! dispatch latency — request written → tunnel request read by the node —
//! is measured on one clock. The answer names the node that served it.

use std::net::SocketAddr;

use bytes::Bytes;
use iop_engine::clock::monotonic_raw_ns;
use iop_engine::http::{self, ClientConn, Limits};
use monoio::net::TcpStream;
use serde::Serialize;

use super::node::{SwarmState, PROBE_MARKER, SERVED_BY};

/// Largest response body read.
const MAX_BODY_BYTES: usize = 1024 * 1024;

/// One probe to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// Its sequence number (unique in the run).
    pub seq: u64,
    /// The model it asks for.
    pub model: String,
    /// The node that must serve it (pinned models), if any.
    pub expect_node: Option<String>,
}

/// How one probe went.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProbeOutcome {
    /// Its sequence number.
    pub seq: u64,
    /// The model it asked for.
    pub model: String,
    /// The node that had to serve it, if any.
    pub expect_node: Option<String>,
    /// The node the answer names.
    pub served_by: Option<String>,
    /// Request written → tunnel request read by the node.
    pub dispatch_ns: Option<u64>,
    /// Request written → response read to its end.
    pub round_trip_ns: u64,
    /// What went wrong, if anything.
    pub error: Option<String>,
}

impl ProbeOutcome {
    /// Whether it was answered (200) by a node, the expected one if any.
    pub fn is_ok(&self) -> bool {
        self.error.is_none()
            && self.served_by.is_some()
            && (self.expect_node.is_none() || self.expect_node == self.served_by)
    }
}

/// The request body of probe `seq` for `model`.
pub fn probe_body(model: &str, seq: u64) -> Bytes {
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": format!("{PROBE_MARKER}{seq}")}],
        "max_tokens": 4
    });
    Bytes::from(body.to_string())
}

/// The node a chat completion names (`served by <node id>`).
pub fn served_by(body: &[u8]) -> Option<String> {
    let json: serde_json::Value = serde_json::from_slice(body).ok()?;
    let content = json["choices"][0]["message"]["content"].as_str()?;
    content.strip_prefix(SERVED_BY).map(str::to_string)
}

async fn exchange(
    conn: &mut Option<ClientConn<TcpStream>>,
    edge: SocketAddr,
    body: Bytes,
) -> Result<(u16, Bytes), String> {
    if conn.is_none() {
        let tcp = http::connect(edge)
            .await
            .map_err(|e| format!("connect {edge}: {e}"))?;
        *conn = Some(ClientConn::new(tcp, Limits::default()).with_host(edge.to_string()));
    }
    let Some(c) = conn.as_mut() else {
        return Err("no connection".into());
    };
    let headers = [("content-type", "application/json")];
    c.send_request("POST", "/v1/chat/completions", headers, body)
        .await
        .map_err(|e| format!("send: {e}"))?;
    let head = c
        .read_response_head()
        .await
        .map_err(|e| format!("response head: {e}"))?;
    let body = c
        .read_body_to_end(MAX_BODY_BYTES)
        .await
        .map_err(|e| format!("response body: {e}"))?;
    Ok((head.status, body))
}

/// Sends every probe in order, each to the Edge client listener it is
/// paired with, over one keep-alive connection per listener (opened by its
/// first probe); a failed exchange drops that connection and the next
/// probe to that listener opens a new one.
pub async fn run_probes(probes: Vec<(SocketAddr, Probe)>, state: &SwarmState) -> Vec<ProbeOutcome> {
    let mut conns: Vec<(SocketAddr, Option<ClientConn<TcpStream>>)> = Vec::new();
    let mut outcomes = Vec::with_capacity(probes.len());
    for (edge, probe) in probes {
        let at = match conns.iter().position(|(addr, _)| *addr == edge) {
            Some(at) => at,
            None => {
                conns.push((edge, None));
                conns.len() - 1
            }
        };
        let conn = &mut conns[at].1;
        let body = probe_body(&probe.model, probe.seq);
        let sent_ns = monotonic_raw_ns();
        let result = exchange(conn, edge, body).await;
        let done_ns = monotonic_raw_ns();
        let dispatch_ns = state
            .take_probe(probe.seq)
            .map(|read_ns| read_ns.saturating_sub(sent_ns));
        let (served, error) = match result {
            Ok((200, body)) => match served_by(&body) {
                Some(node) => (Some(node), None),
                None => (
                    None,
                    Some(format!(
                        "the answer names no node: {}",
                        String::from_utf8_lossy(&body)
                    )),
                ),
            },
            Ok((status, body)) => (
                None,
                Some(format!("HTTP {status}: {}", String::from_utf8_lossy(&body))),
            ),
            Err(e) => {
                *conn = None;
                (None, Some(e))
            }
        };
        if conn.as_ref().is_some_and(|c| !c.is_reusable()) {
            *conn = None;
        }
        outcomes.push(ProbeOutcome {
            seq: probe.seq,
            model: probe.model,
            expect_node: probe.expect_node,
            served_by: served,
            dispatch_ns,
            round_trip_ns: done_ns.saturating_sub(sent_ns),
            error,
        });
    }
    outcomes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swarm::node::probe_seq;

    #[test]
    fn a_probe_body_carries_its_marker_and_model() {
        let body = probe_body("swarm-m1", 77);
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["model"], "swarm-m1");
        assert_eq!(json["messages"][0]["content"], "swarm-probe-77");
        assert_eq!(probe_seq(&body), Some(77));
    }

    #[test]
    fn the_serving_node_is_read_from_the_answer() {
        let body =
            br#"{"choices":[{"message":{"role":"assistant","content":"served by n00012"}}]}"#;
        assert_eq!(served_by(body), Some("n00012".into()));
        assert_eq!(served_by(br#"{"choices":[]}"#), None);
        assert_eq!(served_by(b"not json"), None);
        let outcome = |expect: Option<&str>, served: Option<&str>| ProbeOutcome {
            seq: 1,
            model: "m".into(),
            expect_node: expect.map(str::to_string),
            served_by: served.map(str::to_string),
            dispatch_ns: Some(1),
            round_trip_ns: 2,
            error: None,
        };
        assert!(outcome(None, Some("n00001")).is_ok());
        assert!(outcome(Some("n00001"), Some("n00001")).is_ok());
        assert!(!outcome(Some("n00001"), Some("n00002")).is_ok());
        assert!(!outcome(None, None).is_ok());
    }
}
