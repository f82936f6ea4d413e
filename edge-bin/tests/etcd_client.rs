//! The etcd client against a real etcd (`/usr/bin/etcd`, started by
//! `common::etcd`): leases, puts with a lease, conditional deletes,
//! ranges, watches, failover between members and failure when no member
//! answers.

mod common;

use std::time::Duration;

use common::etcd::EtcdCluster;
use common::guarded;
use edge_bin::cluster::etcd::{
    CodecError, EtcdClient, EtcdConfig, EtcdError, EventKind, Kv, LeaseId, RangeAnswer, Watch,
    WatchEvent, WatchMessage,
};

const PREFIX: &[u8] = b"/iop/test/nodes/";

fn key(name: &str) -> Vec<u8> {
    [PREFIX, name.as_bytes()].concat()
}

fn client(endpoints: Vec<String>, call_timeout: Duration) -> EtcdClient {
    EtcdClient::new(EtcdConfig {
        call_timeout,
        ..EtcdConfig::new(endpoints)
    })
    .expect("valid endpoints")
}

fn run<F: std::future::Future>(body: F) -> F::Output {
    iop_engine::rt::block_on(guarded(body)).expect("monoio runtime")
}

/// Events of the watch until one at `last_revision` arrived (progress
/// notifications skipped).
async fn events_until(watch: &mut Watch, last_revision: i64) -> Vec<WatchEvent> {
    let mut seen = Vec::new();
    while seen.last().map(|e: &WatchEvent| e.mod_revision) != Some(last_revision) {
        match watch.next().await.expect("watch message") {
            WatchMessage::Events { events, .. } => seen.extend(events),
            WatchMessage::Progress { .. } => {}
            other => panic!("unexpected watch message {other:?}"),
        }
    }
    seen
}

fn put(name: &str, value: &str, revision: i64, lease: LeaseId) -> WatchEvent {
    WatchEvent {
        kind: EventKind::Put,
        key: key(name),
        value: value.as_bytes().to_vec(),
        mod_revision: revision,
        lease: Some(lease),
    }
}

fn delete(name: &str, revision: i64) -> WatchEvent {
    WatchEvent {
        kind: EventKind::Delete,
        key: key(name),
        value: Vec::new(),
        mod_revision: revision,
        lease: None,
    }
}

#[test]
fn lease_grant_keepalive_revoke() {
    let cluster = EtcdCluster::start(1);
    let etcd = client(cluster.endpoints(), Duration::from_secs(5));
    run(async {
        let grant = etcd.lease_grant(30).await.expect("grant");
        assert!(grant.lease.0 > 0, "{grant:?}");
        assert_eq!(grant.ttl_sec, 30);
        assert_eq!(
            etcd.lease_keepalive(grant.lease).await.expect("keepalive"),
            Some(30)
        );
        assert!(etcd.lease_revoke(grant.lease).await.expect("revoke"));
        // Gone: the keep-alive says so, a second revoke finds nothing.
        assert_eq!(
            etcd.lease_keepalive(grant.lease).await.expect("keepalive"),
            None
        );
        assert!(!etcd.lease_revoke(grant.lease).await.expect("revoke again"));
        // A put with a lease that does not exist is etcd's error, as is.
        let error = etcd
            .put_with_lease(&key("a"), b"x", grant.lease)
            .await
            .expect_err("put with a revoked lease");
        assert!(
            matches!(
                error.server_error(),
                Some(CodecError::Server { code: 5, .. })
            ),
            "{error}"
        );
        assert_eq!(
            error.to_string(),
            format!(
                "etcd {} /v3/kv/txn: etcd error (code 5): etcdserver: requested lease not found",
                cluster.endpoint(0)
            )
        );
    });
}

#[test]
fn puts_with_a_lease_return_increasing_revisions_and_range_reads_them() {
    let cluster = EtcdCluster::start(1);
    let etcd = client(cluster.endpoints(), Duration::from_secs(5));
    run(async {
        let lease = etcd.lease_grant(30).await.expect("grant").lease;
        // Outside the prefix: never in the range.
        let outside = etcd
            .put_with_lease(b"/iop/test/nodes", b"o", lease)
            .await
            .expect("put");
        let a1 = etcd
            .put_with_lease(&key("a"), b"1", lease)
            .await
            .expect("put");
        let b1 = etcd
            .put_with_lease(&key("b"), b"1", lease)
            .await
            .expect("put");
        let a2 = etcd
            .put_with_lease(&key("a"), b"2", lease)
            .await
            .expect("put");
        assert!(
            outside < a1 && a1 < b1 && b1 < a2,
            "{outside} {a1} {b1} {a2}"
        );
        let range = etcd.range_prefix(PREFIX).await.expect("range");
        assert_eq!(
            range,
            RangeAnswer {
                revision: a2,
                kvs: vec![
                    Kv {
                        key: key("a"),
                        value: b"2".to_vec(),
                        create_revision: a1,
                        mod_revision: a2,
                        version: 2,
                        lease: Some(lease),
                    },
                    Kv {
                        key: key("b"),
                        value: b"1".to_vec(),
                        create_revision: b1,
                        mod_revision: b1,
                        version: 1,
                        lease: Some(lease),
                    },
                ],
            }
        );
    });
}

// The fleet key's put: created only where absent (revision 0), then
// replaced only by a writer that saw its newest revision; it is on no
// lease, so revoking a writer's lease leaves it.
#[test]
fn put_if_mod_revision_creates_once_and_replaces_only_the_revision_seen() {
    let cluster = EtcdCluster::start(1);
    let etcd = client(cluster.endpoints(), Duration::from_secs(5));
    run(async {
        let fleet = key("fleet");
        let first = etcd
            .put_if_mod_revision(&fleet, b"1", 0)
            .await
            .expect("put")
            .expect("created: the key was absent");
        assert_eq!(
            etcd.put_if_mod_revision(&fleet, b"x", 0)
                .await
                .expect("put"),
            None,
            "a second create finds the key"
        );
        let second = etcd
            .put_if_mod_revision(&fleet, b"2", first)
            .await
            .expect("put")
            .expect("replaced: the revision seen is the newest");
        assert!(second > first);
        assert_eq!(
            etcd.put_if_mod_revision(&fleet, b"y", first)
                .await
                .expect("put"),
            None,
            "a writer that did not see the second put"
        );
        let lease = etcd.lease_grant(30).await.expect("grant").lease;
        etcd.lease_revoke(lease).await.expect("revoke");
        let range = etcd.range_prefix(PREFIX).await.expect("range");
        assert_eq!(range.kvs.len(), 1);
        assert_eq!(range.kvs[0].value, b"2");
        assert_eq!(range.kvs[0].mod_revision, second);
        assert_eq!(range.kvs[0].lease, None);
    });
}

#[test]
fn delete_if_mod_revision_refuses_a_stale_revision() {
    let cluster = EtcdCluster::start(1);
    let etcd = client(cluster.endpoints(), Duration::from_secs(5));
    run(async {
        let lease = etcd.lease_grant(30).await.expect("grant").lease;
        let first = etcd
            .put_with_lease(&key("a"), b"1", lease)
            .await
            .expect("put");
        let second = etcd
            .put_with_lease(&key("a"), b"2", lease)
            .await
            .expect("put");
        assert!(!etcd
            .delete_if_mod_revision(&key("a"), first)
            .await
            .expect("delete"));
        let range = etcd.range_prefix(PREFIX).await.expect("range");
        assert_eq!(range.kvs.len(), 1);
        assert_eq!(range.kvs[0].mod_revision, second);
        assert!(etcd
            .delete_if_mod_revision(&key("a"), second)
            .await
            .expect("delete"));
        let range = etcd.range_prefix(PREFIX).await.expect("range");
        assert_eq!(range.kvs, Vec::new());
        assert_eq!(range.revision, second + 1);
        assert!(!etcd
            .delete_if_mod_revision(&key("a"), second)
            .await
            .expect("delete again"));
    });
}

#[test]
fn revoking_the_lease_deletes_its_keys_and_the_watch_sees_it() {
    let cluster = EtcdCluster::start(1);
    let etcd = client(cluster.endpoints(), Duration::from_secs(5));
    run(async {
        let lease = etcd.lease_grant(30).await.expect("grant").lease;
        let other = etcd.lease_grant(30).await.expect("grant").lease;
        etcd.put_with_lease(&key("a"), b"1", lease)
            .await
            .expect("put");
        etcd.put_with_lease(&key("b"), b"1", lease)
            .await
            .expect("put");
        let kept = etcd
            .put_with_lease(&key("c"), b"1", other)
            .await
            .expect("put");
        let read = etcd.range_prefix(PREFIX).await.expect("range");
        let mut watch = etcd
            .watch_prefix(PREFIX, read.revision + 1)
            .await
            .expect("watch");
        assert_eq!(watch.endpoint(), cluster.endpoint(0));
        assert!(etcd.lease_revoke(lease).await.expect("revoke"));
        // Both keys go in one revision, in no particular order.
        let revoked_at = read.revision + 1;
        let mut seen = events_until(&mut watch, revoked_at).await;
        while seen.len() < 2 {
            seen.extend(events_until(&mut watch, revoked_at).await);
        }
        seen.sort_by(|x, y| x.key.cmp(&y.key));
        assert_eq!(seen, vec![delete("a", revoked_at), delete("b", revoked_at)]);
        let left = etcd.range_prefix(PREFIX).await.expect("range");
        assert_eq!(left.kvs.len(), 1);
        assert_eq!(
            (left.kvs[0].key.clone(), left.kvs[0].mod_revision),
            (key("c"), kept)
        );
    });
}

#[test]
fn a_watch_from_a_revision_sees_every_later_event_in_order() {
    let cluster = EtcdCluster::start(1);
    let etcd = client(cluster.endpoints(), Duration::from_secs(5));
    run(async {
        let lease = etcd.lease_grant(30).await.expect("grant").lease;
        let r0 = etcd
            .put_with_lease(&key("a"), b"0", lease)
            .await
            .expect("put");
        let r1 = etcd
            .put_with_lease(&key("a"), b"1", lease)
            .await
            .expect("put");
        let r2 = etcd
            .put_with_lease(&key("b"), b"1", lease)
            .await
            .expect("put");
        assert!(etcd
            .delete_if_mod_revision(&key("a"), r1)
            .await
            .expect("delete"));
        let r3 = r2 + 1;
        // From r1: history (r1..=r3) first, then what happens live.
        let mut watch = etcd.watch_prefix(PREFIX, r1).await.expect("watch");
        let history = events_until(&mut watch, r3).await;
        assert_eq!(
            history,
            vec![
                put("a", "1", r1, lease),
                put("b", "1", r2, lease),
                delete("a", r3)
            ]
        );
        assert!(r0 < r1);
        let r4 = etcd
            .put_with_lease(&key("c"), b"1", lease)
            .await
            .expect("put");
        let r5 = etcd
            .put_with_lease(&key("b"), b"2", lease)
            .await
            .expect("put");
        let live = events_until(&mut watch, r5).await;
        assert_eq!(
            live,
            vec![put("c", "1", r4, lease), put("b", "2", r5, lease)]
        );
    });
}

#[test]
fn a_watch_from_a_compacted_revision_is_canceled_with_the_compact_revision() {
    let cluster = EtcdCluster::start(1);
    let etcd = client(cluster.endpoints(), Duration::from_secs(5));
    run(async {
        let lease = etcd.lease_grant(30).await.expect("grant").lease;
        let r1 = etcd
            .put_with_lease(&key("a"), b"1", lease)
            .await
            .expect("put");
        let r2 = etcd
            .put_with_lease(&key("a"), b"2", lease)
            .await
            .expect("put");
        cluster.compact(r2);
        let mut watch = etcd.watch_prefix(PREFIX, r1).await.expect("watch");
        assert_eq!(
            watch.next().await.expect("message"),
            WatchMessage::Canceled {
                compact_revision: r2,
                reason: String::new()
            }
        );
    });
}

#[test]
fn a_response_over_the_cap_is_refused() {
    let cluster = EtcdCluster::start(1);
    let etcd = EtcdClient::new(EtcdConfig {
        max_response_bytes: 1024,
        ..EtcdConfig::new(cluster.endpoints())
    })
    .expect("client");
    run(async {
        let lease = etcd.lease_grant(30).await.expect("grant").lease;
        etcd.put_with_lease(&key("big"), &[b'v'; 2048], lease)
            .await
            .expect("put");
        let error = etcd.range_prefix(PREFIX).await.expect_err("over the cap");
        assert!(
            matches!(
                error,
                EtcdError::TooLarge {
                    max_bytes: 1024,
                    ..
                }
            ),
            "{error:?}"
        );
        assert_eq!(
            error.to_string(),
            format!(
                "etcd {} /v3/kv/range: response over the 1024-byte cap",
                cluster.endpoint(0)
            )
        );
        // The same cap holds for one watch message.
        let mut watch = etcd.watch_prefix(PREFIX, 1).await.expect("watch");
        let error = watch.next().await.expect_err("message over the cap");
        assert!(
            matches!(
                error,
                EtcdError::TooLarge {
                    max_bytes: 1024,
                    ..
                }
            ),
            "{error:?}"
        );
    });
}

#[test]
fn an_endpoint_that_never_answers_times_out_and_the_next_one_serves() {
    let cluster = EtcdCluster::start(1);
    // Accepts connections (the kernel's backlog) but never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let silent_endpoint = silent.local_addr().expect("addr").to_string();
    let timeout = Duration::from_millis(500);
    let etcd = client(vec![silent_endpoint.clone(), cluster.endpoint(0)], timeout);
    run(async {
        assert_eq!(etcd.preferred_endpoint(), silent_endpoint);
        let started = iop_engine::clock::now();
        let lease = etcd
            .lease_grant(30)
            .await
            .expect("grant on the second endpoint");
        assert!(
            started.elapsed() >= timeout,
            "the silent endpoint was waited for"
        );
        assert_eq!(etcd.preferred_endpoint(), cluster.endpoint(0));
        // Remembered: the next calls go straight to the endpoint that
        // worked (they would wait another timeout otherwise, and the
        // silent one stays preferred if tried first and failed).
        assert_eq!(
            etcd.lease_keepalive(lease.lease).await.expect("keepalive"),
            Some(30)
        );
        assert_eq!(etcd.preferred_endpoint(), cluster.endpoint(0));
    });
    drop(silent);
}

#[test]
fn stopping_the_member_in_use_moves_calls_to_another_member() {
    let mut cluster = EtcdCluster::start(3);
    // Use a follower first, so stopping it leaves the leader in place.
    let leader = cluster.leader();
    let follower = (leader + 1) % 3;
    let mut endpoints = vec![cluster.endpoint(follower)];
    endpoints.extend(
        (0..3)
            .filter(|&i| i != follower)
            .map(|i| cluster.endpoint(i)),
    );
    let etcd = client(endpoints, Duration::from_secs(5));
    run(async {
        let lease = etcd.lease_grant(30).await.expect("grant").lease;
        let r1 = etcd
            .put_with_lease(&key("a"), b"1", lease)
            .await
            .expect("put");
        assert_eq!(etcd.preferred_endpoint(), cluster.endpoint(follower));

        cluster.stop(follower);
        let r2 = etcd
            .put_with_lease(&key("a"), b"2", lease)
            .await
            .expect("put after stop");
        assert!(r2 > r1);
        let now_using = etcd.preferred_endpoint().to_owned();
        assert_ne!(now_using, cluster.endpoint(follower));
        assert!(cluster.endpoints().contains(&now_using));
        let range = etcd.range_prefix(PREFIX).await.expect("range");
        assert_eq!(range.kvs[0].mod_revision, r2);
        assert_eq!(
            etcd.lease_keepalive(lease).await.expect("keepalive"),
            Some(30)
        );

        // Back again, it serves once it is tried.
        cluster.restart(follower);
        let back = client(vec![cluster.endpoint(follower)], Duration::from_secs(5));
        let range = back
            .range_prefix(PREFIX)
            .await
            .expect("range on the restarted member");
        assert_eq!(range.kvs[0].mod_revision, r2);
    });
}

#[test]
fn with_every_member_down_calls_fail_within_their_timeout() {
    let mut cluster = EtcdCluster::start(3);
    let timeout = Duration::from_millis(500);
    let etcd = client(cluster.endpoints(), timeout);
    run(async {
        let lease = etcd.lease_grant(30).await.expect("grant").lease;

        // Frozen: every endpoint accepts and never answers.
        for member in 0..3 {
            cluster.freeze(member);
        }
        let started = iop_engine::clock::now();
        let error = etcd
            .lease_keepalive(lease)
            .await
            .expect_err("frozen cluster");
        let elapsed = started.elapsed();
        assert!(elapsed >= 3 * timeout, "{elapsed:?}");
        assert!(
            elapsed < 3 * timeout + Duration::from_secs(20),
            "{elapsed:?}"
        );
        let EtcdError::Unreachable { failures } = &error else {
            panic!("{error:?}")
        };
        let tried: Vec<String> = failures
            .iter()
            .map(|failure| match failure {
                EtcdError::Timeout {
                    endpoint,
                    call: "/v3/lease/keepalive",
                    timeout_ms: 500,
                } => endpoint.clone(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(tried, cluster.endpoints());
        assert_eq!(
            error.to_string(),
            format!(
                "no etcd endpoint answered: {}",
                cluster
                    .endpoints()
                    .iter()
                    .map(|e| format!("etcd {e} /v3/lease/keepalive: no answer within 500 ms"))
                    .collect::<Vec<_>>()
                    .join("; ")
            )
        );

        // Killed: every connection is refused, at once.
        cluster.stop_all();
        let started = iop_engine::clock::now();
        let error = etcd
            .range_prefix(PREFIX)
            .await
            .expect_err("stopped cluster");
        assert!(started.elapsed() < 3 * timeout + Duration::from_secs(20));
        let EtcdError::Unreachable { failures } = &error else {
            panic!("{error:?}")
        };
        assert_eq!(failures.len(), 3);
        for (failure, endpoint) in failures.iter().zip(cluster.endpoints()) {
            match failure {
                EtcdError::Connect {
                    endpoint: failed,
                    call: "/v3/kv/range",
                    source,
                } => {
                    assert_eq!(*failed, endpoint);
                    assert_eq!(source.kind(), std::io::ErrorKind::ConnectionRefused);
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(
            error.to_string().starts_with(&format!(
                "no etcd endpoint answered: etcd {} /v3/kv/range: connect failed: ",
                cluster.endpoint(0)
            )),
            "{error}"
        );
    });
}

#[test]
fn bad_configuration_is_refused_with_its_reason() {
    assert!(matches!(
        EtcdClient::new(EtcdConfig::new(Vec::new())),
        Err(EtcdError::NoEndpoints)
    ));
    let error = EtcdClient::new(EtcdConfig::new(vec!["127.0.0.1".into()])).unwrap_err();
    assert_eq!(
        error.to_string(),
        r#"etcd endpoint "127.0.0.1": missing :port"#
    );
}

/// Without `Grpc-Metadata-Hasleader` a leaderless member keeps a watch
/// open and silent, and answers a read only after its own 7 s request
/// timeout; with it, both are refused with "no leader".
#[test]
fn a_member_without_a_leader_refuses_and_ends_its_watch() {
    let mut cluster = EtcdCluster::start(3);
    let endpoint = cluster.endpoint(0);
    let etcd = client(vec![endpoint.clone()], Duration::from_secs(5));
    let no_leader = |call: &'static str| {
        format!("etcd {endpoint} {call}: etcd error (code 14): etcdserver: no leader")
    };
    run(async {
        let mut watch = etcd.watch_prefix(PREFIX, 1).await.expect("watch");
        cluster.stop(1);
        cluster.stop(2);
        // etcd ends the watch once it has had no leader for a few
        // election timeouts (about 4 s here).
        let ended = monoio::time::timeout(Duration::from_secs(40), watch.next())
            .await
            .expect("the watch ends on its own");
        let error = ended.expect_err("no leader");
        assert!(
            matches!(error.server_error(), Some(e) if e.is_unavailable()),
            "{error:?}"
        );
        assert_eq!(error.to_string(), no_leader("/v3/watch"));
        // Refused, not waited out: within the 5 s call timeout.
        let error = etcd.range_prefix(PREFIX).await.expect_err("no leader");
        assert_eq!(
            error.to_string(),
            format!("no etcd endpoint answered: {}", no_leader("/v3/kv/range"))
        );
        let error = etcd.watch_prefix(PREFIX, 1).await.expect_err("no leader");
        assert_eq!(
            error.to_string(),
            format!("no etcd endpoint answered: {}", no_leader("/v3/watch"))
        );
    });
}
