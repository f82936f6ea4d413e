//! Capacity summaries between the Edges of a cluster: what each Edge has
//! free per model, so that a request arriving at a full Edge goes where a
//! slot is free ([`crate::cluster::route`]; `docs/multi-edge.md`,
//! "Capacity summaries").
//!
//! ```text
//! control shard, every LOCAL_INTERVAL:  Control::model_capacities ──► ClusterView (this Edge's summary)
//! peer listener, GET /cluster/summary:  ClusterView (this Edge's summary) ──► encode ──► the asking peer
//! control shard, per live peer, every POLL_INTERVAL (each poll within POLL_TIMEOUT):
//!     GET /cluster/summary over mTLS (this Edge's identity; the peer's name checked)
//!         ──► parse (capped) ──► ClusterView (that peer's summary, stamped now)
//!     a failed poll ──► the peer's summary is dropped (nothing free there)
//! every shard, per request: ClusterView::free_slots(model, op, now, MAX_AGE) ──► route::decide
//! ```
//!
//! Pulled, not pushed: the asking Edge knows when it last heard from each
//! peer (a summary older than [`MAX_AGE`] counts as nothing free), the
//! answering side keeps no per-peer state, and the peer listener's mTLS
//! already says who may ask. The encoding is JSON, bounded by
//! [`MAX_SUMMARY_BYTES`], [`MAX_MODELS`] and [`MAX_MODEL_NAME_BYTES`] on
//! both sides: a peer cannot make this Edge hold more than that.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use iop_engine::clock;
use iop_engine::http::{BodyFraming, ClientConn, Limits};
use iop_engine::tls::{MaybeTls, NodeTlsConnector, UpstreamStream};

use crate::control::ModelCapacity;
use crate::link::edge::Edge;
use crate::plane::cluster::{CapacitySummary, ClusterView};

/// The route of the peer listener that answers this Edge's summary.
pub const SUMMARY_PATH: &str = "/cluster/summary";

/// How often this Edge's own summary is computed from Control.
pub const LOCAL_INTERVAL: Duration = Duration::from_millis(50);

/// How often each live peer is asked for its summary.
pub const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// Longest wait for one poll: connect, TLS, request and answer.
pub const POLL_TIMEOUT: Duration = Duration::from_millis(500);

/// A peer's summary older than this counts as nothing free there (ten
/// poll periods: a loaded machine's late answers do not flap the route).
pub const MAX_AGE: Duration = Duration::from_millis(1000);

/// Largest summary sent or accepted.
pub const MAX_SUMMARY_BYTES: usize = 128 * 1024;

/// Most models in one summary.
pub const MAX_MODELS: usize = 1024;

/// Longest model name in a summary; a longer one is left out (requests
/// for it go by ownership, as before summaries).
pub const MAX_MODEL_NAME_BYTES: usize = 256;

/// Why a peer's summary is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SummaryError {
    /// Larger than [`MAX_SUMMARY_BYTES`].
    #[error("summary of {size_bytes} bytes, over {MAX_SUMMARY_BYTES}")]
    TooLarge {
        /// Its size.
        size_bytes: usize,
    },
    /// Not the JSON shape of a summary.
    #[error("not a summary: {0}")]
    Malformed(String),
    /// Sent under another Edge's name than the one asked.
    #[error("summary of edge `{sent}`, asked `{asked}`")]
    WrongEdge {
        /// The name in the summary.
        sent: String,
        /// The Edge that was asked.
        asked: String,
    },
    /// More than [`MAX_MODELS`] models.
    #[error("summary of {models} models, over {MAX_MODELS}")]
    TooManyModels {
        /// How many it lists.
        models: usize,
    },
    /// A model name longer than [`MAX_MODEL_NAME_BYTES`].
    #[error("a model name of {len_bytes} bytes, over {MAX_MODEL_NAME_BYTES}")]
    NameTooLong {
        /// Its length.
        len_bytes: usize,
    },
}

/// How many operations `free_slots` carries: the first ones of
/// `Operation::ALL` (the chat family), as every Edge version sends them.
const WIRE_OPERATIONS: usize = 4;

/// One model as it goes on the wire.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct WireModel {
    /// Free slots per operation, the first [`WIRE_OPERATIONS`] of
    /// `Operation::ALL` in order.
    free_slots: [u32; WIRE_OPERATIONS],
    /// Free slots of the operations after those, in `Operation::ALL`
    /// order. A member of its own, so that an Edge that knows only the
    /// chat family reads the summary as before (serde skips a member it
    /// does not know), and a summary from such an Edge (without it) reads
    /// as nothing free for them. Entries past the operations this Edge
    /// knows are ignored (a later version's).
    #[serde(default)]
    more_free_slots: Vec<u32>,
    queued: u32,
}

/// A summary as it goes on the wire:
/// `{"edge":"<name>","models":{"<model>":{"free_slots":[chat, responses,
/// messages, count_tokens],"more_free_slots":[completions, embeddings,
/// rerank, score, tokenize, detokenize],"queued":n}}}`.
#[derive(Debug, serde::Deserialize)]
struct WireSummary {
    edge: String,
    models: BTreeMap<String, WireModel>,
}

/// `summary` as Edge `edge` shows it to its peers: at most
/// [`MAX_MODELS`] models in name order, names up to
/// [`MAX_MODEL_NAME_BYTES`], and never more than [`MAX_SUMMARY_BYTES`]
/// (models that would not fit are left out: requests for them go by
/// ownership).
pub fn encode(edge: &str, summary: &CapacitySummary) -> Vec<u8> {
    let head = serde_json::json!({ "edge": edge }).to_string();
    // `{"edge":"…"` then `,"models":{` … `}}`.
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(&head.as_bytes()[..head.len() - 1]);
    out.extend_from_slice(br#","models":{"#);
    let mut models = 0;
    for (name, capacity) in summary {
        if models == MAX_MODELS {
            break;
        }
        if name.len() > MAX_MODEL_NAME_BYTES {
            continue;
        }
        let mut free_slots = [0; WIRE_OPERATIONS];
        free_slots.copy_from_slice(&capacity.free_slots[..WIRE_OPERATIONS]);
        let figures = WireModel {
            free_slots,
            more_free_slots: capacity.free_slots[WIRE_OPERATIONS..].to_vec(),
            queued: capacity.queued,
        };
        let entry = format!(
            "{}:{}",
            serde_json::Value::from(name.as_str()),
            serde_json::to_string(&figures).unwrap_or_default()
        );
        // The separator and the closing `}}`.
        if out.len() + 1 + entry.len() + 2 > MAX_SUMMARY_BYTES {
            break;
        }
        if models > 0 {
            out.push(b',');
        }
        out.extend_from_slice(entry.as_bytes());
        models += 1;
    }
    out.extend_from_slice(b"}}");
    out
}

/// The summary `bytes` that Edge `asked` answered, checked against every
/// bound before it is kept.
pub fn parse(asked: &str, bytes: &[u8]) -> Result<CapacitySummary, SummaryError> {
    if bytes.len() > MAX_SUMMARY_BYTES {
        return Err(SummaryError::TooLarge {
            size_bytes: bytes.len(),
        });
    }
    let wire: WireSummary =
        serde_json::from_slice(bytes).map_err(|e| SummaryError::Malformed(e.to_string()))?;
    if wire.edge != asked {
        return Err(SummaryError::WrongEdge {
            sent: wire.edge,
            asked: asked.to_string(),
        });
    }
    if wire.models.len() > MAX_MODELS {
        return Err(SummaryError::TooManyModels {
            models: wire.models.len(),
        });
    }
    if let Some(name) = wire
        .models
        .keys()
        .find(|name| name.len() > MAX_MODEL_NAME_BYTES)
    {
        return Err(SummaryError::NameTooLong {
            len_bytes: name.len(),
        });
    }
    Ok(wire
        .models
        .into_iter()
        .map(|(name, m)| {
            let mut free_slots = [0; crate::control::Operation::ALL.len()];
            free_slots[..WIRE_OPERATIONS].copy_from_slice(&m.free_slots);
            for (slot, free) in free_slots[WIRE_OPERATIONS..]
                .iter_mut()
                .zip(&m.more_free_slots)
            {
                *slot = *free;
            }
            (
                name,
                ModelCapacity {
                    free_slots,
                    queued: m.queued,
                },
            )
        })
        .collect())
}

/// Starts the summary tasks on the control shard: this Edge's own summary
/// every [`LOCAL_INTERVAL`], and a poller per live peer (with a peer
/// listener) when this Edge can dial peers (`peer_tls`).
pub fn start(edge: Rc<Edge>, view: Arc<ClusterView>) {
    monoio::spawn(refresh_local(edge.clone(), view.clone()));
    if edge.settings.peer_tls.is_some() {
        monoio::spawn(follow_peers(edge, view));
    }
}

/// Computes this Edge's summary from Control, for as long as the process
/// runs.
async fn refresh_local(edge: Rc<Edge>, view: Arc<ClusterView>) {
    loop {
        let summary: CapacitySummary = edge.control().model_capacities().into_iter().collect();
        view.set_local_capacity(summary);
        monoio::time::sleep(LOCAL_INTERVAL).await;
    }
}

/// Keeps one poller running per live peer that announced a peer address.
async fn follow_peers(edge: Rc<Edge>, view: Arc<ClusterView>) {
    let running: Rc<RefCell<HashSet<String>>> = Rc::default();
    loop {
        for (name, addr) in view.peer_addrs() {
            if name == view.edge_name || running.borrow().contains(&name) {
                continue;
            }
            running.borrow_mut().insert(name.clone());
            monoio::spawn(poll_peer(
                edge.clone(),
                view.clone(),
                running.clone(),
                name,
                addr,
            ));
        }
        monoio::time::sleep(POLL_INTERVAL).await;
    }
}

type Upstream = ClientConn<UpstreamStream>;

/// Asks peer `name` at `addr` for its summary every [`POLL_INTERVAL`]
/// over one kept-alive connection, until it leaves or announces another
/// address.
async fn poll_peer(
    edge: Rc<Edge>,
    view: Arc<ClusterView>,
    running: Rc<RefCell<HashSet<String>>>,
    name: String,
    addr: SocketAddr,
) {
    let mut conn: Option<Upstream> = None;
    let mut failing = false;
    while view.peer_addrs().get(&name) == Some(&addr) {
        let Some(tls) = edge.settings.peer_tls.as_ref() else {
            break;
        };
        let polled = monoio::time::timeout(POLL_TIMEOUT, poll_once(tls, &name, addr, &mut conn))
            .await
            .unwrap_or_else(|_| Err(format!("no summary within {POLL_TIMEOUT:?}")));
        match polled {
            Ok(summary) => {
                view.peer_capacity_seen(&name, summary, clock::now());
                if failing {
                    tracing::info!(peer = %name, "cluster: capacity summaries from the peer edge again");
                }
                failing = false;
            }
            Err(why) => {
                conn = None;
                view.peer_capacity_lost(&name);
                view.counters
                    .summary_poll_failures
                    .fetch_add(1, Ordering::Relaxed);
                // Once per failing spell: a peer that is down would
                // otherwise log ten lines a second.
                if !failing {
                    tracing::warn!(peer = %name, %addr, error = %why, "cluster: no capacity summary from the peer edge");
                }
                failing = true;
            }
        }
        monoio::time::sleep(POLL_INTERVAL).await;
    }
    view.peer_capacity_lost(&name);
    running.borrow_mut().remove(&name);
}

/// One poll of peer `name`: on `conn` when it is kept alive, else on a new
/// connection (left in `conn` for the next poll when it can carry one).
async fn poll_once(
    tls: &NodeTlsConnector,
    name: &str,
    addr: SocketAddr,
    conn: &mut Option<Upstream>,
) -> Result<CapacitySummary, String> {
    let mut upstream = match conn.take() {
        Some(kept) => kept,
        None => connect(tls, name, addr).await?,
    };
    upstream
        .send_request(
            "GET",
            SUMMARY_PATH,
            std::iter::empty::<(&str, &[u8])>(),
            Bytes::new(),
        )
        .await
        .map_err(|e| format!("writing the request: {e}"))?;
    let head = upstream
        .read_response_head()
        .await
        .map_err(|e| format!("reading the answer: {e}"))?;
    if head.status != 200 {
        return Err(format!("status {}", head.status));
    }
    if let BodyFraming::ContentLength { len_bytes } = head.framing {
        if len_bytes > MAX_SUMMARY_BYTES as u64 {
            return Err(SummaryError::TooLarge {
                size_bytes: usize::try_from(len_bytes).unwrap_or(usize::MAX),
            }
            .to_string());
        }
    }
    let body = upstream
        .read_body_to_end(MAX_SUMMARY_BYTES)
        .await
        .map_err(|e| format!("reading the summary: {e}"))?;
    let summary = parse(name, &body).map_err(|e| e.to_string())?;
    if upstream.is_reusable() {
        *conn = Some(upstream);
    }
    Ok(summary)
}

/// A new mTLS connection to peer `name`'s listener, presenting this
/// Edge's identity and requiring the peer's.
async fn connect(tls: &NodeTlsConnector, name: &str, addr: SocketAddr) -> Result<Upstream, String> {
    let connector = tls.to_edge(name).map_err(|e| e.to_string())?;
    let tcp = iop_engine::http::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let stream = connector
        .connect(tcp)
        .await
        .map_err(|e| format!("TLS handshake: {e}"))?;
    Ok(ClientConn::new(MaybeTls::from(stream), Limits::default()).with_host(addr.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first four operations' free slots (the others have none).
    fn capacity(first: [u32; 4], queued: u32) -> ModelCapacity {
        let mut free_slots = [0; crate::control::Operation::ALL.len()];
        free_slots[..4].copy_from_slice(&first);
        ModelCapacity { free_slots, queued }
    }

    // Every operation's free slots cross to the peer: a forwarded
    // embeddings (or rerank, tokenize …) request is placed by them as a
    // chat request is.
    #[test]
    fn every_operation_goes_and_comes_back() {
        let every = ModelCapacity {
            free_slots: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
            queued: 2,
        };
        let summary = CapacitySummary::from([("m".to_string(), every)]);
        let bytes = encode("e", &summary);
        assert_eq!(
            std::str::from_utf8(&bytes).unwrap(),
            r#"{"edge":"e","models":{"m":{"free_slots":[1,2,3,4],"more_free_slots":[5,6,7,8,9,10,11,12,13],"queued":2}}}"#
        );
        let parsed = parse("e", &bytes).expect("a summary");
        assert_eq!(parsed, summary);
        assert_eq!(
            parsed["m"].free_for(crate::control::Operation::Embeddings),
            6
        );
        assert_eq!(
            parsed["m"].free_for(crate::control::Operation::Detokenize),
            10
        );
        assert_eq!(parsed["m"].free_for(crate::control::Operation::Speech), 13);
    }

    // An Edge that knows only the chat family sends no `more_free_slots`:
    // nothing is free there for the other operations (requests for them go
    // by ownership). One that knows more operations sends longer lists:
    // the operations this Edge knows are read, the rest ignored.
    #[test]
    fn summaries_of_older_and_newer_edges_are_read() {
        let older = br#"{"edge":"e","models":{"m":{"free_slots":[1,0,2,3],"queued":0}}}"#;
        assert_eq!(
            parse("e", older),
            Ok(CapacitySummary::from([(
                "m".to_string(),
                capacity([1, 0, 2, 3], 0)
            )]))
        );
        let newer = br#"{"edge":"e","models":{"m":{"free_slots":[1,1,1,1],"more_free_slots":[2,2,2,2,2,2,3,3,3,9,9],"queued":0}}}"#;
        let parsed = parse("e", newer).expect("a summary");
        assert_eq!(
            parsed["m"].free_slots,
            [1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3]
        );
        let shorter = br#"{"edge":"e","models":{"m":{"free_slots":[1,1,1,1],"more_free_slots":[4],"queued":0}}}"#;
        let parsed = parse("e", shorter).expect("a summary");
        assert_eq!(
            parsed["m"].free_slots,
            [1, 1, 1, 1, 4, 0, 0, 0, 0, 0, 0, 0, 0]
        );
    }

    #[test]
    fn a_summary_goes_and_comes_back_as_it_was() {
        let summary = CapacitySummary::from([
            ("model-a".to_string(), capacity([1, 0, 2, 3], 0)),
            ("mod\"el/ü".to_string(), capacity([0, 0, 0, 0], 7)),
        ]);
        let bytes = encode("edge-2", &summary);
        assert_eq!(
            std::str::from_utf8(&bytes).unwrap(),
            r#"{"edge":"edge-2","models":{"mod\"el/ü":{"free_slots":[0,0,0,0],"more_free_slots":[0,0,0,0,0,0,0,0,0],"queued":7},"model-a":{"free_slots":[1,0,2,3],"more_free_slots":[0,0,0,0,0,0,0,0,0],"queued":0}}}"#
        );
        assert_eq!(parse("edge-2", &bytes), Ok(summary));
        assert_eq!(
            encode("e", &CapacitySummary::new()),
            br#"{"edge":"e","models":{}}"#
        );
        assert_eq!(
            parse("e", br#"{"edge":"e","models":{}}"#),
            Ok(CapacitySummary::new())
        );
    }

    #[test]
    fn a_summary_over_any_bound_or_of_another_edge_is_refused() {
        assert_eq!(
            parse("edge-2", &encode("edge-3", &CapacitySummary::new())),
            Err(SummaryError::WrongEdge {
                sent: "edge-3".into(),
                asked: "edge-2".into()
            })
        );
        let huge = vec![b' '; MAX_SUMMARY_BYTES + 1];
        assert_eq!(
            parse("e", &huge),
            Err(SummaryError::TooLarge {
                size_bytes: MAX_SUMMARY_BYTES + 1
            })
        );
        let many: String = (0..=MAX_MODELS)
            .map(|i| format!(r#""m{i}":{{"free_slots":[0,0,0,0],"queued":0}}"#))
            .collect::<Vec<_>>()
            .join(",");
        let many = format!(r#"{{"edge":"e","models":{{{many}}}}}"#);
        assert!(many.len() <= MAX_SUMMARY_BYTES);
        assert_eq!(
            parse("e", many.as_bytes()),
            Err(SummaryError::TooManyModels {
                models: MAX_MODELS + 1
            })
        );
        let long = "x".repeat(MAX_MODEL_NAME_BYTES + 1);
        let long = format!(
            r#"{{"edge":"e","models":{{"{long}":{{"free_slots":[0,0,0,0],"queued":0}}}}}}"#
        );
        assert_eq!(
            parse("e", long.as_bytes()),
            Err(SummaryError::NameTooLong {
                len_bytes: MAX_MODEL_NAME_BYTES + 1
            })
        );
        for malformed in [
            &b""[..],
            b"{}",
            br#"{"edge":"e"}"#,
            br#"{"edge":"e","models":[]}"#,
            br#"{"edge":"e","models":{"m":{"free_slots":[1,2,3],"queued":0}}}"#,
            br#"{"edge":"e","models":{"m":{"free_slots":[1,2,3,4,5],"queued":0}}}"#,
            br#"{"edge":"e","models":{"m":{"free_slots":[-1,0,0,0],"queued":0}}}"#,
            br#"{"edge":"e","models":{"m":{"free_slots":[4294967296,0,0,0],"queued":0}}}"#,
            br#"{"edge":"e","models":{"m":{"free_slots":[0,0,0,0]}}}"#,
        ] {
            assert!(
                matches!(parse("e", malformed), Err(SummaryError::Malformed(_))),
                "{}",
                String::from_utf8_lossy(malformed)
            );
        }
    }

    #[test]
    fn the_encoder_stays_within_the_bounds_the_parser_checks() {
        // More models than may be sent, some names too long: the first
        // MAX_MODELS acceptable names go, in name order.
        let mut summary = CapacitySummary::new();
        for i in 0..MAX_MODELS + 10 {
            summary.insert(format!("m{i:05}"), capacity([1, 1, 1, 1], 0));
        }
        summary.insert("a".repeat(MAX_MODEL_NAME_BYTES + 1), capacity([9; 4], 0));
        let bytes = encode("e", &summary);
        let parsed = parse("e", &bytes).expect("within the bounds");
        assert_eq!(parsed.len(), MAX_MODELS);
        assert_eq!(parsed.keys().next().map(String::as_str), Some("m00000"));
        assert_eq!(
            parsed.keys().last().cloned(),
            Some(format!("m{:05}", MAX_MODELS - 1))
        );
        // Names so long that the byte budget ends the list first.
        let mut summary = CapacitySummary::new();
        for i in 0..MAX_MODELS {
            let name = format!("{i:04}{}", "n".repeat(MAX_MODEL_NAME_BYTES - 4));
            summary.insert(name, capacity([1, 1, 1, 1], 0));
        }
        let bytes = encode("e", &summary);
        assert!(bytes.len() <= MAX_SUMMARY_BYTES, "{}", bytes.len());
        let parsed = parse("e", &bytes).expect("within the bounds");
        // 22 bytes of head, 332 per entry (a quoted 256-byte name, a colon,
        // 73 bytes of figures) and a comma between, 2 to close: 393 fit in
        // 128 KiB (22 + 393 * 332 + 392 + 2 = 130_892; one more is 131_225).
        assert_eq!(parsed.len(), 393);
    }
}
