//! Sans-IO codec for etcd's v3 JSON gateway (etcd 3.4+, `/v3/...`).
//!
//! Request builders return the path and the JSON body; parsers take a
//! response body (or one message of a watch stream) and return typed
//! answers. The gateway's conventions, checked against etcd 3.4:
//!
//! - keys and values are base64 (standard alphabet, padded);
//! - `int64` fields are JSON strings (`"revision":"2"`); numbers are
//!   accepted too;
//! - fields at their proto3 default are left out: `succeeded` of a failed
//!   txn, `type` of a PUT event, `kvs`/`count` of an empty range, `TTL`
//!   of a keep-alive for a lease that is gone;
//! - a unary error is `{"error":"…","code":N,"message":"…"}` (with an HTTP
//!   status other than 200); an error inside a stream is
//!   `{"error":{"grpc_code":N,"message":"…",…}}`;
//! - a streamed answer (keep-alive, watch) wraps each message in
//!   `{"result":{…}}`, one message per line.
//!
//! Every parser refuses a body over [`MAX_RESPONSE_BYTES`] before parsing
//! it, and none panics on any input.

use bytes::Bytes;
use iop_engine::keys::pkcs8::{base64_decode, base64_encode};
use serde_json::{json, Map, Value};

/// Hard cap on one response body or one watch message. A client may set a
/// lower cap of its own while reading.
pub const MAX_RESPONSE_BYTES: usize = 16 * 1024 * 1024;

/// gRPC status code etcd uses for "requested lease not found".
pub const CODE_NOT_FOUND: i64 = 5;
/// gRPC status code etcd uses when a member cannot serve now (no leader,
/// request timed out, stopping): another member may.
pub const CODE_UNAVAILABLE: i64 = 14;

/// An etcd lease id (`int64` on the wire; etcd grants positive ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub i64);

impl std::fmt::Display for LeaseId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

/// One request to the gateway: `POST <path>` with a JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdRequest {
    /// Request target, for example `/v3/kv/txn`.
    pub path: &'static str,
    /// The JSON body.
    pub body: Bytes,
}

/// Why a response could not be turned into an answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// The body is longer than the cap; nothing was parsed.
    #[error("response body of {size_bytes} bytes is over the {max_bytes}-byte cap")]
    TooLarge {
        /// Length of the body refused.
        size_bytes: usize,
        /// The cap it exceeded.
        max_bytes: usize,
    },
    /// Not JSON, or JSON that is not the answer asked for.
    #[error("malformed response: {reason}")]
    Malformed {
        /// What was wrong, naming the field.
        reason: String,
    },
    /// etcd answered with an error (gRPC status `code`).
    #[error("etcd error (code {code}): {message}")]
    Server {
        /// gRPC status code ([`CODE_NOT_FOUND`], [`CODE_UNAVAILABLE`], …).
        code: i64,
        /// etcd's message, for example `etcdserver: requested lease not found`.
        message: String,
    },
    /// A status other than 200 whose body is not an etcd error.
    #[error("unexpected HTTP status {status}: {body}")]
    UnexpectedStatus {
        /// The HTTP status.
        status: u16,
        /// The start of the body (lossy UTF-8, at most 200 bytes).
        body: String,
    },
}

impl CodecError {
    /// Whether etcd said the lease (or key) asked for does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, CodecError::Server { code, .. } if *code == CODE_NOT_FOUND)
    }

    /// Whether etcd said this member cannot serve now (another may).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, CodecError::Server { code, .. } if *code == CODE_UNAVAILABLE)
    }
}

/// A granted lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseGrant {
    /// The lease id.
    pub lease: LeaseId,
    /// The TTL etcd granted (it may raise a TTL below its minimum).
    pub ttl_sec: i64,
    /// Store revision when the grant was answered.
    pub revision: i64,
}

/// One key-value pair of a range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    /// The key.
    pub key: Vec<u8>,
    /// The value.
    pub value: Vec<u8>,
    /// Revision of the write that created the key.
    pub create_revision: i64,
    /// Revision of the last write to the key (the fencing token).
    pub mod_revision: i64,
    /// Writes to the key since it was created (1 for a new key).
    pub version: i64,
    /// The lease the key is attached to, if any.
    pub lease: Option<LeaseId>,
}

/// The answer to a range over a prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeAnswer {
    /// Store revision the range was read at: watch from `revision + 1` to
    /// miss nothing after it.
    pub revision: i64,
    /// The keys under the prefix, in key order.
    pub kvs: Vec<Kv>,
}

/// What happened to a key, in a watch event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// The key was written.
    Put,
    /// The key was deleted (explicitly or by its lease expiring).
    Delete,
}

/// One change seen by a watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    /// Put or delete.
    pub kind: EventKind,
    /// The key.
    pub key: Vec<u8>,
    /// The value written (empty for a delete).
    pub value: Vec<u8>,
    /// Revision of this change.
    pub mod_revision: i64,
    /// The lease the key is attached to after a put.
    pub lease: Option<LeaseId>,
}

/// One message of a watch stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchMessage {
    /// The watch is registered; events follow.
    Created {
        /// The watch's id on its stream.
        watch_id: i64,
        /// Store revision when it was created.
        revision: i64,
    },
    /// Changes, in revision order.
    Events {
        /// Store revision when the message was sent.
        revision: i64,
        /// At least one event.
        events: Vec<WatchEvent>,
    },
    /// No change, but everything up to `revision` has been sent (a
    /// progress notification).
    Progress {
        /// Store revision the watch has caught up to.
        revision: i64,
    },
    /// etcd ended the watch: re-read and watch again.
    Canceled {
        /// When non-zero, the start revision was compacted: the oldest
        /// revision still available is this one.
        compact_revision: i64,
        /// etcd's reason, if it gave one.
        reason: String,
    },
}

/// `POST /v3/lease/grant` for a lease of `ttl_sec` seconds.
pub fn lease_grant(ttl_sec: i64) -> EtcdRequest {
    request("/v3/lease/grant", json!({ "TTL": ttl_sec.to_string() }))
}

/// `POST /v3/lease/keepalive` for `lease`. The gateway answers one
/// message and ends the response (one answer per request).
pub fn lease_keepalive(lease: LeaseId) -> EtcdRequest {
    request("/v3/lease/keepalive", json!({ "ID": lease.0.to_string() }))
}

/// `POST /v3/lease/revoke` for `lease`: deletes every key attached to it.
pub fn lease_revoke(lease: LeaseId) -> EtcdRequest {
    request("/v3/lease/revoke", json!({ "ID": lease.0.to_string() }))
}

/// `POST /v3/kv/txn` that puts `key = value` attached to `lease`,
/// unconditionally (no compare).
pub fn put_with_lease(key: &[u8], value: &[u8], lease: LeaseId) -> EtcdRequest {
    request(
        "/v3/kv/txn",
        json!({
            "success": [{ "request_put": {
                "key": b64(key),
                "value": b64(value),
                "lease": lease.0.to_string(),
            }}],
        }),
    )
}

/// `POST /v3/kv/txn` that puts `key = value` (on no lease: it outlives
/// every Edge) only if the key's `mod_revision` is still `mod_revision`
/// (0: only if the key does not exist).
pub fn put_if_mod_revision(key: &[u8], value: &[u8], mod_revision: i64) -> EtcdRequest {
    request(
        "/v3/kv/txn",
        json!({
            "compare": [{
                "key": b64(key),
                "target": "MOD",
                "result": "EQUAL",
                "mod_revision": mod_revision.to_string(),
            }],
            "success": [{ "request_put": { "key": b64(key), "value": b64(value) } }],
        }),
    )
}

/// `POST /v3/kv/txn` that deletes `key` only if its `mod_revision` is
/// still `mod_revision` (never a newer owner's key).
pub fn delete_if_mod_revision(key: &[u8], mod_revision: i64) -> EtcdRequest {
    request(
        "/v3/kv/txn",
        json!({
            "compare": [{
                "key": b64(key),
                "target": "MOD",
                "result": "EQUAL",
                "mod_revision": mod_revision.to_string(),
            }],
            "success": [{ "request_delete_range": { "key": b64(key) } }],
        }),
    )
}

/// `POST /v3/kv/range` over every key that starts with `prefix`
/// (linearizable read).
pub fn range_prefix(prefix: &[u8]) -> EtcdRequest {
    let (key, range_end) = prefix_range(prefix);
    request(
        "/v3/kv/range",
        json!({ "key": b64(&key), "range_end": b64(&range_end) }),
    )
}

/// `POST /v3/watch` over every key that starts with `prefix`, from
/// `start_revision` (inclusive), with progress notifications.
pub fn watch_prefix(prefix: &[u8], start_revision: i64) -> EtcdRequest {
    let (key, range_end) = prefix_range(prefix);
    request(
        "/v3/watch",
        json!({ "create_request": {
            "key": b64(&key),
            "range_end": b64(&range_end),
            "start_revision": start_revision.to_string(),
            "progress_notify": true,
        }}),
    )
}

/// `[key, range_end)` covering every key that starts with `prefix`: the
/// range end is the prefix with its last byte below 0xff incremented and
/// what follows it dropped; `\0` (to the end of the keyspace) when there
/// is none. The empty prefix is the whole keyspace (`\0` to `\0`).
pub fn prefix_range(prefix: &[u8]) -> (Vec<u8>, Vec<u8>) {
    if prefix.is_empty() {
        return (vec![0], vec![0]);
    }
    let mut end = prefix.to_vec();
    while let Some(&last) = end.last() {
        if last < 0xff {
            if let Some(byte) = end.last_mut() {
                *byte = last + 1;
            }
            return (prefix.to_vec(), end);
        }
        end.pop();
    }
    (prefix.to_vec(), vec![0])
}

/// Parses the answer to [`lease_grant`].
pub fn parse_lease_grant(body: &[u8]) -> Result<LeaseGrant, CodecError> {
    let answer = object(body)?;
    let lease = int(&answer, "ID")?;
    if lease == 0 {
        return Err(malformed("lease grant without an ID"));
    }
    Ok(LeaseGrant {
        lease: LeaseId(lease),
        ttl_sec: int(&answer, "TTL")?,
        revision: header_revision(&answer)?,
    })
}

/// Parses the answer to [`lease_keepalive`]: `Some(ttl_sec)` while the
/// lease lives, `None` when it is gone (no TTL, or TTL 0).
pub fn parse_lease_keepalive(body: &[u8]) -> Result<Option<i64>, CodecError> {
    let answer = result(object(body)?)?;
    let ttl_sec = int(&answer, "TTL")?;
    Ok((ttl_sec > 0).then_some(ttl_sec))
}

/// Parses the answer to [`lease_revoke`]: the store revision after it.
/// A lease that was already gone is a [`CodecError::Server`] with
/// [`CODE_NOT_FOUND`] (see [`parse_error_body`]).
pub fn parse_lease_revoke(body: &[u8]) -> Result<i64, CodecError> {
    header_revision(&object(body)?)
}

/// Parses the answer to [`put_with_lease`]: the put's revision (the key's
/// new `mod_revision`).
pub fn parse_put(body: &[u8]) -> Result<i64, CodecError> {
    let answer = object(body)?;
    if !boolean(&answer, "succeeded")? {
        return Err(malformed("unconditional txn did not succeed"));
    }
    let put = answer
        .get("responses")
        .and_then(Value::as_array)
        .and_then(|responses| responses.first())
        .and_then(|first| first.get("response_put"))
        .and_then(Value::as_object)
        .ok_or_else(|| malformed("txn answer without responses[0].response_put"))?;
    let revision = header_revision(put)?;
    if revision <= 0 {
        return Err(malformed("put without a revision"));
    }
    Ok(revision)
}

/// Parses the answer to [`put_if_mod_revision`]: the put's revision if
/// the compare held, `None` if it did not (nothing was written).
pub fn parse_put_if(body: &[u8]) -> Result<Option<i64>, CodecError> {
    let answer = object(body)?;
    header_revision(&answer)?;
    if !boolean(&answer, "succeeded")? {
        return Ok(None);
    }
    parse_put(body).map(Some)
}

/// Parses the answer to [`delete_if_mod_revision`]: whether the compare
/// held and the key was deleted.
pub fn parse_delete_if(body: &[u8]) -> Result<bool, CodecError> {
    let answer = object(body)?;
    header_revision(&answer)?;
    boolean(&answer, "succeeded")
}

/// Parses the answer to [`range_prefix`].
pub fn parse_range(body: &[u8]) -> Result<RangeAnswer, CodecError> {
    let answer = object(body)?;
    let kvs = match answer.get("kvs") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items.iter().map(kv).collect::<Result<_, _>>()?,
        Some(_) => return Err(malformed("kvs is not an array")),
    };
    Ok(RangeAnswer {
        revision: header_revision(&answer)?,
        kvs,
    })
}

/// Parses one message (one line) of a [`watch_prefix`] stream.
pub fn parse_watch_message(line: &[u8]) -> Result<WatchMessage, CodecError> {
    let answer = result(object(line)?)?;
    let revision = header_revision(&answer)?;
    if boolean(&answer, "canceled")? {
        return Ok(WatchMessage::Canceled {
            compact_revision: int(&answer, "compact_revision")?,
            reason: string(&answer, "cancel_reason")?,
        });
    }
    if boolean(&answer, "created")? {
        return Ok(WatchMessage::Created {
            watch_id: int(&answer, "watch_id")?,
            revision,
        });
    }
    let events = match answer.get("events") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items.iter().map(event).collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(malformed("events is not an array")),
    };
    if events.is_empty() {
        Ok(WatchMessage::Progress { revision })
    } else {
        Ok(WatchMessage::Events { revision, events })
    }
}

/// The error a non-200 response stands for: [`CodecError::Server`] when
/// the body is an etcd error, [`CodecError::UnexpectedStatus`] otherwise.
pub fn parse_error_body(status: u16, body: &[u8]) -> CodecError {
    match object(body) {
        Err(e @ CodecError::Server { .. }) => e,
        _ => CodecError::UnexpectedStatus {
            status,
            body: String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
        },
    }
}

fn request(path: &'static str, body: Value) -> EtcdRequest {
    EtcdRequest {
        path,
        body: Bytes::from(body.to_string()),
    }
}

fn b64(bytes: &[u8]) -> String {
    base64_encode(bytes).to_string()
}

fn malformed(reason: impl Into<String>) -> CodecError {
    CodecError::Malformed {
        reason: reason.into(),
    }
}

/// The body as a JSON object, after the size cap; an etcd error body
/// (either form) becomes [`CodecError::Server`].
fn object(body: &[u8]) -> Result<Map<String, Value>, CodecError> {
    if body.len() > MAX_RESPONSE_BYTES {
        return Err(CodecError::TooLarge {
            size_bytes: body.len(),
            max_bytes: MAX_RESPONSE_BYTES,
        });
    }
    let value: Value =
        serde_json::from_slice(body).map_err(|e| malformed(format!("not JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(malformed("not a JSON object"));
    };
    match map.get("error") {
        None | Some(Value::Null) => Ok(map),
        // Unary form: {"error":"…","code":N,"message":"…"}.
        Some(Value::String(error)) => Err(CodecError::Server {
            code: int(&map, "code")?,
            message: match string(&map, "message")? {
                message if message.is_empty() => error.clone(),
                message => message,
            },
        }),
        // Stream form: {"error":{"grpc_code":N,"message":"…",…}}.
        Some(Value::Object(error)) => Err(CodecError::Server {
            code: int(error, "grpc_code")?,
            message: string(error, "message")?,
        }),
        Some(_) => Err(malformed("error is neither a string nor an object")),
    }
}

/// The `result` object of a streamed message.
fn result(mut map: Map<String, Value>) -> Result<Map<String, Value>, CodecError> {
    match map.remove("result") {
        Some(Value::Object(inner)) => Ok(inner),
        Some(_) => Err(malformed("result is not an object")),
        None => Err(malformed("streamed message without result")),
    }
}

fn header_revision(map: &Map<String, Value>) -> Result<i64, CodecError> {
    match map.get("header") {
        Some(Value::Object(header)) => int(header, "revision"),
        None | Some(Value::Null) => Ok(0),
        Some(_) => Err(malformed("header is not an object")),
    }
}

/// An `int64` field: a JSON string of decimal digits or a JSON integer;
/// absent or null is 0 (proto3 default).
fn int(map: &Map<String, Value>, field: &str) -> Result<i64, CodecError> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(0),
        Some(Value::String(text)) => text
            .parse()
            .map_err(|_| malformed(format!("{field} is not an int64: {text:?}"))),
        Some(Value::Number(number)) => number
            .as_i64()
            .ok_or_else(|| malformed(format!("{field} is not an int64: {number}"))),
        Some(_) => Err(malformed(format!("{field} is not an int64"))),
    }
}

fn boolean(map: &Map<String, Value>, field: &str) -> Result<bool, CodecError> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(value)) => Ok(*value),
        Some(_) => Err(malformed(format!("{field} is not a boolean"))),
    }
}

fn string(map: &Map<String, Value>, field: &str) -> Result<String, CodecError> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(text)) => Ok(text.clone()),
        Some(_) => Err(malformed(format!("{field} is not a string"))),
    }
}

/// A `bytes` field: base64; absent, null or empty is no bytes.
fn bytes(map: &Map<String, Value>, field: &str) -> Result<Vec<u8>, CodecError> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(text)) if text.is_empty() => Ok(Vec::new()),
        Some(Value::String(text)) => base64_decode(text)
            .map(|decoded| decoded.to_vec())
            .ok_or_else(|| malformed(format!("{field} is not base64"))),
        Some(_) => Err(malformed(format!("{field} is not a base64 string"))),
    }
}

fn lease(map: &Map<String, Value>) -> Result<Option<LeaseId>, CodecError> {
    let id = int(map, "lease")?;
    Ok((id != 0).then_some(LeaseId(id)))
}

fn kv(value: &Value) -> Result<Kv, CodecError> {
    let map = value
        .as_object()
        .ok_or_else(|| malformed("kv is not an object"))?;
    Ok(Kv {
        key: bytes(map, "key")?,
        value: bytes(map, "value")?,
        create_revision: int(map, "create_revision")?,
        mod_revision: int(map, "mod_revision")?,
        version: int(map, "version")?,
        lease: lease(map)?,
    })
}

fn event(value: &Value) -> Result<WatchEvent, CodecError> {
    let map = value
        .as_object()
        .ok_or_else(|| malformed("event is not an object"))?;
    let kind = match map.get("type") {
        None | Some(Value::Null) => EventKind::Put,
        Some(Value::String(kind)) if kind == "PUT" => EventKind::Put,
        Some(Value::String(kind)) if kind == "DELETE" => EventKind::Delete,
        Some(Value::Number(n)) if n.as_i64() == Some(0) => EventKind::Put,
        Some(Value::Number(n)) if n.as_i64() == Some(1) => EventKind::Delete,
        Some(other) => return Err(malformed(format!("unknown event type {other}"))),
    };
    let kv = match map.get("kv") {
        Some(Value::Object(kv)) => kv,
        _ => return Err(malformed("event without kv")),
    };
    Ok(WatchEvent {
        kind,
        key: bytes(kv, "key")?,
        value: bytes(kv, "value")?,
        mod_revision: int(kv, "mod_revision")?,
        lease: lease(kv)?,
    })
}

#[cfg(test)]
#[path = "codec_tests.rs"]
mod tests;
