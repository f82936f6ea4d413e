//! The codec against the exact bodies etcd 3.4's gateway sends.

use serde_json::Value;

use super::*;

const HEADER: &str = r#""header":{"cluster_id":"15118495548433857066","member_id":"13668033151171901709","revision":"2","raft_term":"2"}"#;

fn json(body: &[u8]) -> Value {
    serde_json::from_slice(body).expect("request bodies are JSON")
}

#[test]
fn requests_have_the_gateway_shape() {
    let grant = lease_grant(10);
    assert_eq!(grant.path, "/v3/lease/grant");
    assert_eq!(json(&grant.body), serde_json::json!({"TTL": "10"}));

    let keepalive = lease_keepalive(LeaseId(2324035862581727749));
    assert_eq!(keepalive.path, "/v3/lease/keepalive");
    assert_eq!(
        json(&keepalive.body),
        serde_json::json!({"ID": "2324035862581727749"})
    );

    let revoke = lease_revoke(LeaseId(7));
    assert_eq!(revoke.path, "/v3/lease/revoke");
    assert_eq!(json(&revoke.body), serde_json::json!({"ID": "7"}));

    let put = put_with_lease(b"/iop/a", b"v1", LeaseId(7));
    assert_eq!(put.path, "/v3/kv/txn");
    assert_eq!(
        json(&put.body),
        serde_json::json!({"success": [{"request_put": {
            "key": "L2lvcC9h", "value": "djE=", "lease": "7"}}]})
    );

    let delete = delete_if_mod_revision(b"/iop/a", 42);
    assert_eq!(delete.path, "/v3/kv/txn");
    assert_eq!(
        json(&delete.body),
        serde_json::json!({
            "compare": [{"key": "L2lvcC9h", "target": "MOD", "result": "EQUAL",
                         "mod_revision": "42"}],
            "success": [{"request_delete_range": {"key": "L2lvcC9h"}}]})
    );

    // "/iop/" .. "/iop0"
    let range = range_prefix(b"/iop/");
    assert_eq!(range.path, "/v3/kv/range");
    assert_eq!(
        json(&range.body),
        serde_json::json!({"key": "L2lvcC8=", "range_end": "L2lvcDA="})
    );

    let watch = watch_prefix(b"/iop/", 5);
    assert_eq!(watch.path, "/v3/watch");
    assert_eq!(
        json(&watch.body),
        serde_json::json!({"create_request": {"key": "L2lvcC8=", "range_end": "L2lvcDA=",
            "start_revision": "5", "progress_notify": true}})
    );
}

#[test]
fn prefix_range_increments_the_last_byte_below_0xff() {
    assert_eq!(prefix_range(b"a/"), (b"a/".to_vec(), b"a0".to_vec()));
    assert_eq!(prefix_range(b"a\xff"), (b"a\xff".to_vec(), b"b".to_vec()));
    assert_eq!(prefix_range(b"\xff\xff"), (b"\xff\xff".to_vec(), vec![0]));
    assert_eq!(prefix_range(b""), (vec![0], vec![0]));
}

#[test]
fn lease_grant_answer() {
    let body = r#"{"header":{"revision":"1"},"ID":"2324035862581727749","TTL":"10"}"#;
    assert_eq!(
        parse_lease_grant(body.as_bytes()),
        Ok(LeaseGrant {
            lease: LeaseId(2324035862581727749),
            ttl_sec: 10,
            revision: 1
        })
    );
    // Numbers are accepted as well as strings.
    let body = r#"{"header":{"revision":1},"ID":3,"TTL":2}"#;
    assert_eq!(
        parse_lease_grant(body.as_bytes()),
        Ok(LeaseGrant {
            lease: LeaseId(3),
            ttl_sec: 2,
            revision: 1
        })
    );
    assert!(matches!(
        parse_lease_grant(br#"{"header":{"revision":"1"},"TTL":"10"}"#),
        Err(CodecError::Malformed { .. })
    ));
}

#[test]
fn keepalive_answer_alive_and_gone() {
    let alive = format!(r#"{{"result":{{{HEADER},"ID":"1","TTL":"10"}}}}"#);
    assert_eq!(parse_lease_keepalive(alive.as_bytes()), Ok(Some(10)));
    // A lease that is gone: the ID comes back without a TTL.
    let gone = format!(r#"{{"result":{{{HEADER},"ID":"123"}}}}"#);
    assert_eq!(parse_lease_keepalive(gone.as_bytes()), Ok(None));
    let zero = r#"{"result":{"ID":"1","TTL":"0"}}"#;
    assert_eq!(parse_lease_keepalive(zero.as_bytes()), Ok(None));
    // Not wrapped in "result": refused, not read as "gone".
    assert!(matches!(
        parse_lease_keepalive(br#"{"ID":"1","TTL":"10"}"#),
        Err(CodecError::Malformed { .. })
    ));
}

#[test]
fn revoke_answer_and_lease_not_found() {
    let body = format!("{{{HEADER}}}");
    assert_eq!(parse_lease_revoke(body.as_bytes()), Ok(2));
    let not_found = br#"{"error":"etcdserver: requested lease not found","message":"etcdserver: requested lease not found","code":5}"#;
    let error = parse_error_body(404, not_found);
    assert_eq!(
        error,
        CodecError::Server {
            code: CODE_NOT_FOUND,
            message: "etcdserver: requested lease not found".into()
        }
    );
    assert!(error.is_not_found());
    assert!(!error.is_unavailable());
    // The same body under a 200 is still an error.
    assert_eq!(parse_lease_revoke(not_found), Err(error));
}

#[test]
fn put_answer_gives_the_put_revision() {
    let body = r#"{"header":{"revision":"2"},"succeeded":true,"responses":[{"response_put":{"header":{"revision":"2"}}}]}"#;
    assert_eq!(parse_put(body.as_bytes()), Ok(2));
    let failed = format!("{{{HEADER}}}");
    assert!(matches!(
        parse_put(failed.as_bytes()),
        Err(CodecError::Malformed { .. })
    ));
    let no_response = r#"{"header":{"revision":"2"},"succeeded":true,"responses":[]}"#;
    assert!(matches!(
        parse_put(no_response.as_bytes()),
        Err(CodecError::Malformed { .. })
    ));
}

#[test]
fn put_if_is_a_txn_comparing_the_mod_revision_on_no_lease() {
    let put = put_if_mod_revision(b"/iop/c/fleet", b"v", 0);
    assert_eq!(put.path, "/v3/kv/txn");
    assert_eq!(
        json(&put.body),
        serde_json::json!({
            "compare": [{"key": "L2lvcC9jL2ZsZWV0", "target": "MOD", "result": "EQUAL", "mod_revision": "0"}],
            "success": [{"request_put": {"key": "L2lvcC9jL2ZsZWV0", "value": "dg=="}}],
        })
    );
    let done = r#"{"header":{"revision":"5"},"succeeded":true,"responses":[{"response_put":{"header":{"revision":"5"}}}]}"#;
    assert_eq!(parse_put_if(done.as_bytes()), Ok(Some(5)));
    // A failed compare leaves "succeeded" out (proto3 default).
    let refused = format!("{{{HEADER}}}");
    assert_eq!(parse_put_if(refused.as_bytes()), Ok(None));
    assert!(parse_put_if(br#"{"succeeded":true}"#).is_err());
}

#[test]
fn delete_if_answer_says_whether_the_compare_held() {
    let deleted = r#"{"header":{"revision":"3"},"succeeded":true,"responses":[{"response_delete_range":{"header":{"revision":"3"},"deleted":"1"}}]}"#;
    assert_eq!(parse_delete_if(deleted.as_bytes()), Ok(true));
    // A failed compare leaves "succeeded" out (proto3 default).
    let refused = format!("{{{HEADER}}}");
    assert_eq!(parse_delete_if(refused.as_bytes()), Ok(false));
}

#[test]
fn range_answer_with_and_without_kvs() {
    let body = format!(
        r#"{{{HEADER},"kvs":[{{"key":"L2lvcC9h","create_revision":"2","mod_revision":"2","version":"1","value":"djE=","lease":"4111120489733234954"}},{{"key":"L2lvcC9i","create_revision":"4","mod_revision":"5","version":"2"}}],"count":"2"}}"#
    );
    assert_eq!(
        parse_range(body.as_bytes()),
        Ok(RangeAnswer {
            revision: 2,
            kvs: vec![
                Kv {
                    key: b"/iop/a".to_vec(),
                    value: b"v1".to_vec(),
                    create_revision: 2,
                    mod_revision: 2,
                    version: 1,
                    lease: Some(LeaseId(4111120489733234954)),
                },
                Kv {
                    key: b"/iop/b".to_vec(),
                    value: Vec::new(),
                    create_revision: 4,
                    mod_revision: 5,
                    version: 2,
                    lease: None,
                },
            ],
        })
    );
    let empty = r#"{"header":{"revision":"3"}}"#;
    assert_eq!(
        parse_range(empty.as_bytes()),
        Ok(RangeAnswer {
            revision: 3,
            kvs: Vec::new()
        })
    );
    let bad_key = r#"{"kvs":[{"key":"not base64!"}]}"#;
    assert_eq!(
        parse_range(bad_key.as_bytes()),
        Err(CodecError::Malformed {
            reason: "key is not base64".into()
        })
    );
}

#[test]
fn watch_messages() {
    let created = format!(r#"{{"result":{{{HEADER},"created":true}}}}"#);
    assert_eq!(
        parse_watch_message(created.as_bytes()),
        Ok(WatchMessage::Created {
            watch_id: 0,
            revision: 2
        })
    );
    let events = r#"{"result":{"header":{"revision":"3"},"events":[{"kv":{"key":"L2lvcC9h","create_revision":"2","mod_revision":"2","version":"1","value":"djE=","lease":"4111120489733234954"}},{"type":"DELETE","kv":{"key":"L2lvcC9h","mod_revision":"3"}}]}}"#;
    assert_eq!(
        parse_watch_message(events.as_bytes()),
        Ok(WatchMessage::Events {
            revision: 3,
            events: vec![
                WatchEvent {
                    kind: EventKind::Put,
                    key: b"/iop/a".to_vec(),
                    value: b"v1".to_vec(),
                    mod_revision: 2,
                    lease: Some(LeaseId(4111120489733234954)),
                },
                WatchEvent {
                    kind: EventKind::Delete,
                    key: b"/iop/a".to_vec(),
                    value: Vec::new(),
                    mod_revision: 3,
                    lease: None,
                },
            ],
        })
    );
    let compacted =
        r#"{"result":{"header":{"raft_term":"2"},"canceled":true,"compact_revision":"3"}}"#;
    assert_eq!(
        parse_watch_message(compacted.as_bytes()),
        Ok(WatchMessage::Canceled {
            compact_revision: 3,
            reason: String::new()
        })
    );
    let progress = r#"{"result":{"header":{"revision":"9"}}}"#;
    assert_eq!(
        parse_watch_message(progress.as_bytes()),
        Ok(WatchMessage::Progress { revision: 9 })
    );
    let stream_error = r#"{"error":{"grpc_code":14,"http_code":503,"message":"etcdserver: no leader","http_status":"Service Unavailable"}}"#;
    let error = parse_watch_message(stream_error.as_bytes()).unwrap_err();
    assert_eq!(
        error,
        CodecError::Server {
            code: CODE_UNAVAILABLE,
            message: "etcdserver: no leader".into()
        }
    );
    assert!(error.is_unavailable());
    let unknown_type = r#"{"result":{"events":[{"type":"TRUNCATE","kv":{}}]}}"#;
    assert!(matches!(
        parse_watch_message(unknown_type.as_bytes()),
        Err(CodecError::Malformed { .. })
    ));
}

#[test]
fn error_bodies_and_unexpected_statuses() {
    let body = br#"{"error":"invalid character 'g' looking for beginning of value","message":"invalid character 'g' looking for beginning of value","code":3}"#;
    assert_eq!(
        parse_error_body(400, body),
        CodecError::Server {
            code: 3,
            message: "invalid character 'g' looking for beginning of value".into()
        }
    );
    assert_eq!(
        parse_error_body(502, b"Bad Gateway"),
        CodecError::UnexpectedStatus {
            status: 502,
            body: "Bad Gateway".into()
        }
    );
    assert_eq!(
        parse_error_body(500, &[b'x'; 300]).to_string(),
        format!("unexpected HTTP status 500: {}", "x".repeat(200))
    );
}

#[test]
fn oversized_bodies_are_refused_before_parsing() {
    let mut body = vec![b' '; MAX_RESPONSE_BYTES + 1];
    body[0] = b'{';
    let error = parse_range(&body).unwrap_err();
    assert_eq!(
        error,
        CodecError::TooLarge {
            size_bytes: MAX_RESPONSE_BYTES + 1,
            max_bytes: MAX_RESPONSE_BYTES
        }
    );
    assert_eq!(
        error.to_string(),
        "response body of 16777217 bytes is over the 16777216-byte cap"
    );
}

#[test]
fn hostile_bodies_are_errors_not_panics() {
    /// A parser's name and whether it refuses a body.
    type Refuses = (&'static str, fn(&[u8]) -> bool);
    let parsers: [Refuses; 7] = [
        ("grant", |b| parse_lease_grant(b).is_err()),
        ("keepalive", |b| parse_lease_keepalive(b).is_err()),
        ("revoke", |b| parse_lease_revoke(b).is_err()),
        ("put", |b| parse_put(b).is_err()),
        ("delete_if", |b| parse_delete_if(b).is_err()),
        ("range", |b| parse_range(b).is_err()),
        ("watch", |b| parse_watch_message(b).is_err()),
    ];
    let refused_by_all: &[&[u8]] = &[
        b"",
        b"[]",
        b"null",
        b"{",
        b"\xff\xfe",
        br#"{"header":"x"}"#,
        br#"{"header":{"revision":"-"}}"#,
        br#"{"header":{"revision":1.5}}"#,
        br#"{"header":{"revision":"99999999999999999999"}}"#,
        br#"{"error":5}"#,
        br#"{"error":{"grpc_code":"x"}}"#,
    ];
    for body in refused_by_all {
        for (name, refuses) in &parsers {
            assert!(
                refuses(body),
                "{name} accepted {:?}",
                String::from_utf8_lossy(body)
            );
        }
    }
    assert!(parse_range(br#"{"kvs":{}}"#).is_err());
    assert!(parse_range(br#"{"kvs":[1]}"#).is_err());
    assert!(parse_lease_keepalive(br#"{"result":[]}"#).is_err());
    assert!(parse_watch_message(br#"{"result":[]}"#).is_err());
    assert!(parse_watch_message(br#"{"result":{"events":[{"kv":null}]}}"#).is_err());
    assert!(parse_put(br#"{"succeeded":"yes"}"#).is_err());
    assert!(parse_delete_if(br#"{"succeeded":"yes"}"#).is_err());
    // Deep nesting stops at serde_json's recursion limit.
    let deep = "[".repeat(100_000);
    assert!(matches!(
        parse_range(deep.as_bytes()),
        Err(CodecError::Malformed { .. })
    ));
}
