//! Which Edge a dial reaches, when the Node knows several (`edge_addr` and
//! `edge_name` lists): the Node still holds one connection to one Edge at a
//! time (T1); each attempt picks the Edge.
//!
//! ```text
//!  attempt ─► resolve every edge_addr entry ─► dial_order: drop repeats,
//!             (a name may give several            shuffle uniformly, keep
//!              addresses; a failed lookup          MAX_DIAL_CANDIDATES
//!              is one failure)                          │
//!     ┌─────────────────────────────────────────────────┘
//!     ▼ for each candidate address, in that order:
//!     TCP connect ─► TLS: the Edge's certificate names one of edge_name (T2)
//!                 ─► session: register, apply config, ready (R2, R3)
//!       ready ─────► this attempt is that session (a lost session redials
//!                    with a fresh shuffle, so a dead Edge's nodes move on)
//!       failed ────► the next candidate; every candidate failed ─► the
//!                    attempt failed, and the reconnect backoff applies (S2)
//! ```
//!
//! [`dial_order`] is pure (the randomness comes in); [`EdgeTls`] and
//! [`resolve_candidates`] are the IO.
//!
//! ## Several accepted Edge names over one-name connectors
//!
//! The engine's [`NodeTlsConnector`] verifies one Edge name. [`EdgeTls`]
//! holds one per accepted name and handshakes with the one expected at the
//! address (the name that last verified there, else the first). When the
//! Edge's certificate names another *listed* name, the connector reports
//! which (`WrongName { found }`); the Node then dials that address once more
//! with that name's connector, which verifies it strictly, and remembers
//! the name for the address. An unlisted name is refused like any wrong
//! name. The cost of a second name is one extra handshake the first time
//! an address is dialled (the Edge logs the aborted one).

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;

use iop_engine::conn::SocketShutdown;
use iop_engine::rng::SplitMix64;
use iop_engine::tls::{
    ClientTls, IdentityRejection, LocalIdentity, NodeTlsConnector, PeerCert, TlsError, TlsMaterial,
    WorkloadId,
};
use monoio::net::TcpStream;

use crate::config::{EdgeAddr, EdgeAddrs, EdgeNames};

/// Most addresses one attempt tries (after the shuffle): the entries are
/// bounded, but a DNS name may resolve to many.
pub const MAX_DIAL_CANDIDATES: usize = 64;
/// Most failures one attempt's reason lists (the rest are counted).
pub const MAX_LISTED_FAILURES: usize = 8;
/// Most addresses whose Edge name is remembered ([`EdgeTls`]); past it
/// the memory starts over.
pub const MAX_REMEMBERED_NAMES: usize = 256;

/// One address to dial and the `edge_addr` entry it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The address.
    pub addr: SocketAddr,
    /// The entry as configured (`host:port`), for messages.
    pub entry: EdgeAddr,
}

impl fmt::Display for Candidate {
    /// The address; for a DNS entry also the name it came from.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.entry.socket_addr() == Some(self.addr) {
            write!(f, "{}", self.addr)
        } else {
            write!(f, "{} ({})", self.entry, self.addr)
        }
    }
}

/// The order one attempt dials `resolved` in: the first occurrence of each
/// address kept, shuffled uniformly (Fisher–Yates with `rng`), at most
/// [`MAX_DIAL_CANDIDATES`].
pub fn dial_order(resolved: Vec<Candidate>, rng: &mut SplitMix64) -> Vec<Candidate> {
    let mut order: Vec<Candidate> = Vec::with_capacity(resolved.len());
    for candidate in resolved {
        if !order.iter().any(|c| c.addr == candidate.addr) {
            order.push(candidate);
        }
    }
    for i in (1..order.len()).rev() {
        // below(i + 1) < i + 1 <= len: the cast and the index hold.
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order.truncate(MAX_DIAL_CANDIDATES);
    order
}

/// Why one candidate did not give a ready session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CandidateFailure {
    /// The entry's name did not resolve, or the TCP connect failed: the
    /// message names the entry or address.
    Dial(String),
    /// The TLS handshake failed or the Edge's identity was refused (T2).
    Tls(String),
    /// The session ended before ready (registration or ready refused, the
    /// connection closed).
    Session(String),
}

impl CandidateFailure {
    /// What went wrong, for the log.
    pub fn message(&self) -> &str {
        match self {
            CandidateFailure::Dial(m) | CandidateFailure::Tls(m) | CandidateFailure::Session(m) => {
                m
            }
        }
    }
}

/// The failures of one attempt, in the order they happened.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct AttemptFailures {
    failures: Vec<(Option<String>, CandidateFailure)>,
}

impl AttemptFailures {
    /// A failure at `at` (the candidate; `None` when the message already
    /// names it).
    pub fn push(&mut self, at: Option<String>, failure: CandidateFailure) {
        self.failures.push((at, failure));
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.failures.len()
    }

    /// Whether there were none.
    pub fn is_empty(&self) -> bool {
        self.failures.is_empty()
    }

    /// The attempt's reason: one failure is its message alone (as with a
    /// single Edge); several are each prefixed with their address, joined
    /// by `; `, at most [`MAX_LISTED_FAILURES`] of them.
    pub fn reason(&self) -> String {
        match self.failures.as_slice() {
            [] => "no Edge address to dial".to_owned(),
            [(_, only)] => only.message().to_owned(),
            all => {
                let mut parts: Vec<String> = all
                    .iter()
                    .take(MAX_LISTED_FAILURES)
                    .map(|(at, failure)| match at {
                        Some(at) => format!("{at}: {}", failure.message()),
                        None => failure.message().to_owned(),
                    })
                    .collect();
                if all.len() > MAX_LISTED_FAILURES {
                    parts.push(format!("and {} more", all.len() - MAX_LISTED_FAILURES));
                }
                format!("every Edge address failed: {}", parts.join("; "))
            }
        }
    }
}

/// Resolves every entry (without blocking the core, [`iop_engine::resolve`])
/// into candidates, in the entries' order; an entry that does not resolve
/// is a [`CandidateFailure::Dial`] in `failures`.
pub async fn resolve_candidates(
    addrs: &EdgeAddrs,
    failures: &mut AttemptFailures,
) -> Vec<Candidate> {
    let mut out = Vec::new();
    for entry in addrs.entries() {
        match iop_engine::resolve::resolve(entry.host(), entry.port()).await {
            Ok(resolved) if !resolved.is_empty() => {
                out.extend(resolved.iter().map(|&addr| Candidate {
                    addr,
                    entry: entry.clone(),
                }))
            }
            Ok(_) => failures.push(
                None,
                CandidateFailure::Dial(format!("dial {entry}: address resolved to nothing")),
            ),
            Err(e) => failures.push(None, CandidateFailure::Dial(format!("dial {entry}: {e}"))),
        }
    }
    out
}

/// Connects to `candidate` over TCP (`TCP_NODELAY` set, as for every link).
pub async fn connect(candidate: &Candidate) -> Result<TcpStream, CandidateFailure> {
    iop_engine::http::connect_addrs(&[candidate.addr])
        .await
        .map_err(|e| CandidateFailure::Dial(format!("dial {candidate}: {e}")))
}

/// A verified TLS connection to an Edge.
#[derive(Debug)]
pub struct EdgeLink {
    /// The stream.
    pub tls: ClientTls,
    /// Shuts down the stream's own socket (taken before the handshake).
    pub shutdown: SocketShutdown,
    /// The Edge's certificate (identity and serial).
    pub edge: PeerCert,
}

/// The Node's TLS to its Edges: one engine connector per accepted Edge
/// name (see the module docs), the name last verified at each address.
/// Clones share the connectors' identity ([`EdgeTls::reload`] reaches them)
/// but not the remembered names.
#[derive(Debug, Clone)]
pub struct EdgeTls {
    /// Non-empty; the name each connector verifies.
    connectors: Vec<(String, NodeTlsConnector)>,
    /// Address → index into `connectors` of the name that verified there.
    expected: RefCell<HashMap<SocketAddr, usize>>,
}

impl EdgeTls {
    /// Connectors presenting `material` and accepting any of `names` in
    /// `trust_domain`. Fails as [`NodeTlsConnector::new`] does.
    pub fn new(
        material: &TlsMaterial,
        trust_domain: &str,
        names: &EdgeNames,
    ) -> Result<Self, TlsError> {
        let connectors = names
            .names()
            .iter()
            .map(|name| {
                NodeTlsConnector::new(material, trust_domain, name).map(|c| (name.clone(), c))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self::from_connectors(connectors))
    }

    /// One connector, verifying `name` (the name it was built with).
    pub fn single(name: &str, connector: NodeTlsConnector) -> Self {
        Self::from_connectors(vec![(name.to_owned(), connector)])
    }

    fn from_connectors(connectors: Vec<(String, NodeTlsConnector)>) -> Self {
        assert!(!connectors.is_empty(), "at least one accepted Edge name");
        Self {
            connectors,
            expected: RefCell::new(HashMap::new()),
        }
    }

    /// The accepted names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.connectors.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// The Node's own identity (its certificate's name is the `node_id`,
    /// T3).
    pub fn local_identity(&self) -> WorkloadId {
        self.connectors[0].1.local_identity()
    }

    /// The Node's own certificate as presented now.
    pub fn local_certificate(&self) -> LocalIdentity {
        self.connectors[0].1.local_certificate()
    }

    /// Replaces the certificate, key and CA bundle of every connector for
    /// later dials ([`NodeTlsConnector::reload`]). The connectors hold the
    /// same identity, so `material` is accepted by all or refused by the
    /// first, before any changed.
    pub fn reload(&self, material: &TlsMaterial) -> Result<LocalIdentity, TlsError> {
        let id = self.connectors[0].1.reload(material)?;
        for (_, connector) in &self.connectors[1..] {
            connector.reload(material)?;
        }
        Ok(id)
    }

    /// Runs the TLS handshake on `tcp` (connected to `candidate`),
    /// accepting any listed Edge name; when the Edge there is another
    /// listed name, dials `candidate` again for it (see the module docs).
    pub async fn handshake(
        &self,
        candidate: &Candidate,
        tcp: TcpStream,
    ) -> Result<EdgeLink, CandidateFailure> {
        let first = self
            .expected
            .borrow()
            .get(&candidate.addr)
            .copied()
            .unwrap_or(0);
        let shutdown = SocketShutdown::for_socket(&tcp);
        let found = match self.connectors[first].1.connect_verified(tcp).await {
            Ok((tls, edge)) => return Ok(self.verified(candidate, first, tls, edge, shutdown)),
            Err(TlsError::IdentityRejected {
                reason: IdentityRejection::WrongName { found, .. },
            }) if self.connectors.len() > 1 => found,
            Err(e) => return Err(CandidateFailure::Tls(tls_reason(&e))),
        };
        let Some(index) = self.connectors.iter().position(|(name, _)| *name == found) else {
            return Err(CandidateFailure::Tls(format!(
                "tls handshake with the edge: peer identity rejected: edge name {found:?} is \
                 not one of the configured {:?}",
                self.names()
            )));
        };
        tracing::debug!(
            edge_addr = %candidate,
            edge_name = %found,
            "the edge at this address is another listed name; dialling it again to verify \
             that name"
        );
        let tcp = connect(candidate).await?;
        let shutdown = SocketShutdown::for_socket(&tcp);
        match self.connectors[index].1.connect_verified(tcp).await {
            Ok((tls, edge)) => Ok(self.verified(candidate, index, tls, edge, shutdown)),
            Err(e) => Err(CandidateFailure::Tls(tls_reason(&e))),
        }
    }

    fn verified(
        &self,
        candidate: &Candidate,
        index: usize,
        tls: ClientTls,
        edge: PeerCert,
        shutdown: SocketShutdown,
    ) -> EdgeLink {
        let mut expected = self.expected.borrow_mut();
        if expected.len() >= MAX_REMEMBERED_NAMES && !expected.contains_key(&candidate.addr) {
            expected.clear();
        }
        expected.insert(candidate.addr, index);
        EdgeLink {
            tls,
            shutdown,
            edge,
        }
    }
}

/// The attempt reason of a failed handshake (as with a single Edge).
fn tls_reason(e: &TlsError) -> String {
    format!("tls handshake with the edge: {e}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(text: &str) -> Candidate {
        let addr: SocketAddr = text.parse().unwrap();
        Candidate {
            addr,
            entry: EdgeAddr::parse(text).unwrap(),
        }
    }

    fn addrs(order: &[Candidate]) -> Vec<String> {
        order.iter().map(|c| c.addr.to_string()).collect()
    }

    // Every permutation of three addresses comes out about equally often
    // (a uniform shuffle), repeats are dropped, and one seed replays.
    #[test]
    fn dial_order_is_a_uniform_shuffle_without_repeats() {
        let three = || {
            vec![
                candidate("10.0.0.1:7443"),
                candidate("10.0.0.2:7443"),
                candidate("10.0.0.1:7443"),
                candidate("10.0.0.3:7443"),
            ]
        };
        let mut rng = SplitMix64::new(11);
        let mut counts: HashMap<Vec<String>, u32> = HashMap::new();
        const DRAWS: u32 = 60_000;
        for _ in 0..DRAWS {
            let order = dial_order(three(), &mut rng);
            assert_eq!(order.len(), 3, "the repeated address is dropped");
            *counts.entry(addrs(&order)).or_default() += 1;
        }
        assert_eq!(counts.len(), 6, "every permutation: {counts:?}");
        // 10,000 expected each (σ ≈ 91); 9,400 and 10,600 are > 6σ away.
        for (order, n) in &counts {
            assert!((9_400..=10_600).contains(n), "{order:?}: {n} of {DRAWS}");
        }
        let replay = |seed| dial_order(three(), &mut SplitMix64::new(seed));
        assert_eq!(replay(5), replay(5));
        assert_eq!(dial_order(Vec::new(), &mut rng), Vec::new());
    }

    #[test]
    fn dial_order_keeps_at_most_the_candidate_cap() {
        let many: Vec<Candidate> = (0..200u16)
            .map(|i| candidate(&format!("10.0.{}.{}:7443", i / 250, i % 250 + 1)))
            .collect();
        let order = dial_order(many, &mut SplitMix64::new(1));
        assert_eq!(order.len(), MAX_DIAL_CANDIDATES);
    }

    #[test]
    fn candidates_name_their_entry() {
        assert_eq!(candidate("127.0.0.1:7443").to_string(), "127.0.0.1:7443");
        let named = Candidate {
            addr: "10.0.0.7:7443".parse().unwrap(),
            entry: EdgeAddr::parse("edge.example:7443").unwrap(),
        };
        assert_eq!(named.to_string(), "edge.example:7443 (10.0.0.7:7443)");
    }

    // One failure reads as it did with a single Edge; several name their
    // address and are capped.
    #[test]
    fn attempt_reasons() {
        let mut one = AttemptFailures::default();
        assert_eq!(one.reason(), "no Edge address to dial");
        one.push(
            Some("127.0.0.1:1".into()),
            CandidateFailure::Session("registration rejected: x".into()),
        );
        assert_eq!(one.reason(), "registration rejected: x");
        let mut many = AttemptFailures::default();
        many.push(
            None,
            CandidateFailure::Dial("dial 127.0.0.1:1: refused".into()),
        );
        many.push(
            Some("127.0.0.1:2".into()),
            CandidateFailure::Tls("tls handshake with the edge: bad".into()),
        );
        assert_eq!(
            many.reason(),
            "every Edge address failed: dial 127.0.0.1:1: refused; 127.0.0.1:2: tls handshake \
             with the edge: bad"
        );
        for i in 0..10 {
            many.push(None, CandidateFailure::Dial(format!("d{i}")));
        }
        assert_eq!(many.len(), 12);
        assert!(
            many.reason().ends_with("; d5; and 4 more"),
            "{}",
            many.reason()
        );
    }
}
