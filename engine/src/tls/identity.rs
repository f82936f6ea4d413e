//! SPIFFE workload identity: `spiffe://<trust-domain>/<role>/<name>` (T2).
//!
//! [`WorkloadId::parse`] is strict and pure: it accepts exactly the IDs this
//! project issues and names the first rule a string breaks. The rules are the
//! SPIFFE ID rules narrowed to our two-segment path:
//!
//! - at most [`MAX_URI_BYTES`] bytes, scheme exactly `spiffe://` (lower case);
//! - trust domain: 1..=[`MAX_TRUST_DOMAIN_BYTES`] bytes of `[a-z0-9.-_]` (no port,
//!   no user info, no upper case);
//! - path: exactly `/<role>/<name>`; every segment non-empty, not `.` or `..`,
//!   made of `[A-Za-z0-9.-_]` (so no query, fragment or percent-encoding);
//! - role `edge` or `node`.
//!
//! [`workload_id_from_cert`] reads the one URI SAN of a DER certificate with
//! x509-parser (webpki has no accessor for URI SANs).

use std::fmt;
use std::str::FromStr;

use rustls_pki_types::CertificateDer;
use x509_parser::extensions::GeneralName;

/// The SPIFFE scheme prefix, including the authority separator.
pub const SPIFFE_SCHEME: &str = "spiffe://";
/// Longest accepted SPIFFE ID, in bytes (SPIFFE's limit).
pub const MAX_URI_BYTES: usize = 2048;
/// Longest accepted trust domain, in bytes (SPIFFE's limit).
pub const MAX_TRUST_DOMAIN_BYTES: usize = 255;

/// Which side of the Edge–Node link a workload is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// The central gateway (TLS server of the Node link).
    Edge,
    /// A daemon on a GPU host (TLS client of the Node link).
    Node,
}

impl Role {
    /// The path segment naming this role: `edge` or `node`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Edge => "edge",
            Role::Node => "node",
        }
    }

    /// The role named by a path segment, exactly `edge` or `node`.
    pub fn from_segment(segment: &str) -> Option<Role> {
        match segment {
            "edge" => Some(Role::Edge),
            "node" => Some(Role::Node),
            _ => None,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a string is not a valid workload identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkloadIdError {
    /// The ID is longer than [`MAX_URI_BYTES`].
    #[error("SPIFFE ID is {len_bytes} bytes, more than the {MAX_URI_BYTES}-byte maximum")]
    TooLong {
        /// Length of the rejected string.
        len_bytes: usize,
    },
    /// The ID does not start with `spiffe://`.
    #[error("SPIFFE ID must start with \"spiffe://\"")]
    NotSpiffe,
    /// The trust domain is empty.
    #[error("trust domain is empty")]
    EmptyTrustDomain,
    /// The trust domain is longer than [`MAX_TRUST_DOMAIN_BYTES`].
    #[error(
        "trust domain is {len_bytes} bytes, more than the {MAX_TRUST_DOMAIN_BYTES}-byte maximum"
    )]
    TrustDomainTooLong {
        /// Length of the rejected trust domain.
        len_bytes: usize,
    },
    /// The trust domain holds a character outside `[a-z0-9.-_]`.
    #[error("trust domain character {ch:?} is not one of [a-z0-9.-_]")]
    BadTrustDomainChar {
        /// The first offending character.
        ch: char,
    },
    /// The ID has no path after the trust domain.
    #[error("SPIFFE ID has no path; expected /<role>/<name>")]
    MissingPath,
    /// A path segment is empty (`//` or a trailing `/`).
    #[error("SPIFFE ID path has an empty segment")]
    EmptySegment,
    /// A path segment is `.` or `..`.
    #[error("SPIFFE ID path has a \".\" or \"..\" segment")]
    DotSegment,
    /// A path segment holds a character outside `[A-Za-z0-9.-_]`.
    #[error("SPIFFE ID path character {ch:?} is not one of [A-Za-z0-9.-_]")]
    BadPathChar {
        /// The first offending character.
        ch: char,
    },
    /// The path does not have exactly two segments.
    #[error("SPIFFE ID path has {segments} segments; expected /<role>/<name>")]
    WrongSegmentCount {
        /// How many segments the path has.
        segments: usize,
    },
    /// The role segment is neither `edge` nor `node`.
    #[error("role {role:?} is neither \"edge\" nor \"node\"")]
    UnknownRole {
        /// The rejected role segment.
        role: String,
    },
}

/// A validated workload identity `spiffe://<trust_domain>/<role>/<name>`.
///
/// Construct it with [`WorkloadId::new`] or [`WorkloadId::parse`]; both apply
/// the same rules, so every value renders to a URI that parses back to itself.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkloadId {
    trust_domain: String,
    role: Role,
    name: String,
}

impl WorkloadId {
    /// Builds an identity from its parts, validating the trust domain and name.
    pub fn new(trust_domain: &str, role: Role, name: &str) -> Result<Self, WorkloadIdError> {
        validate_trust_domain(trust_domain)?;
        validate_segment(name)?;
        let id = WorkloadId {
            trust_domain: trust_domain.to_owned(),
            role,
            name: name.to_owned(),
        };
        let len_bytes = id.uri_len_bytes();
        if len_bytes > MAX_URI_BYTES {
            return Err(WorkloadIdError::TooLong { len_bytes });
        }
        Ok(id)
    }

    /// Parses `spiffe://<trust-domain>/<role>/<name>` strictly (see the module docs).
    pub fn parse(uri: &str) -> Result<Self, WorkloadIdError> {
        if uri.len() > MAX_URI_BYTES {
            return Err(WorkloadIdError::TooLong {
                len_bytes: uri.len(),
            });
        }
        let rest = uri
            .strip_prefix(SPIFFE_SCHEME)
            .ok_or(WorkloadIdError::NotSpiffe)?;
        let (trust_domain, path) = match rest.split_once('/') {
            Some((trust_domain, path)) => (trust_domain, Some(path)),
            None => (rest, None),
        };
        validate_trust_domain(trust_domain)?;
        let path = path.ok_or(WorkloadIdError::MissingPath)?;
        let mut segments = 0usize;
        for segment in path.split('/') {
            validate_segment(segment)?;
            segments += 1;
        }
        let Some((role, name)) = path.split_once('/').filter(|_| segments == 2) else {
            return Err(WorkloadIdError::WrongSegmentCount { segments });
        };
        let role = Role::from_segment(role).ok_or_else(|| WorkloadIdError::UnknownRole {
            role: role.to_owned(),
        })?;
        Ok(WorkloadId {
            trust_domain: trust_domain.to_owned(),
            role,
            name: name.to_owned(),
        })
    }

    /// Checks that `name` could be the `<name>` segment of an identity
    /// (non-empty, not `.`/`..`, `[A-Za-z0-9.-_]` only).
    pub fn validate_name(name: &str) -> Result<(), WorkloadIdError> {
        validate_segment(name)
    }

    /// Checks that `trust_domain` is a valid SPIFFE trust domain.
    pub fn validate_trust_domain(trust_domain: &str) -> Result<(), WorkloadIdError> {
        validate_trust_domain(trust_domain)
    }

    /// The trust domain (`iop` in `spiffe://iop/node/node-a`).
    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// The role (`Node` in `spiffe://iop/node/node-a`).
    pub fn role(&self) -> Role {
        self.role
    }

    /// The workload name (`node-a` in `spiffe://iop/node/node-a`). For a Node
    /// this must equal the `node_id` it registers with (T3).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The URI form, `spiffe://<trust-domain>/<role>/<name>`.
    pub fn uri(&self) -> String {
        self.to_string()
    }

    fn uri_len_bytes(&self) -> usize {
        SPIFFE_SCHEME.len()
            + self.trust_domain.len()
            + 1
            + self.role.as_str().len()
            + 1
            + self.name.len()
    }
}

impl fmt::Display for WorkloadId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{SPIFFE_SCHEME}{}/{}/{}",
            self.trust_domain, self.role, self.name
        )
    }
}

impl FromStr for WorkloadId {
    type Err = WorkloadIdError;

    fn from_str(uri: &str) -> Result<Self, Self::Err> {
        WorkloadId::parse(uri)
    }
}

fn validate_trust_domain(trust_domain: &str) -> Result<(), WorkloadIdError> {
    if trust_domain.is_empty() {
        return Err(WorkloadIdError::EmptyTrustDomain);
    }
    if trust_domain.len() > MAX_TRUST_DOMAIN_BYTES {
        return Err(WorkloadIdError::TrustDomainTooLong {
            len_bytes: trust_domain.len(),
        });
    }
    match trust_domain
        .chars()
        .find(|&ch| !matches!(ch, 'a'..='z' | '0'..='9' | '.' | '-' | '_'))
    {
        Some(ch) => Err(WorkloadIdError::BadTrustDomainChar { ch }),
        None => Ok(()),
    }
}

fn validate_segment(segment: &str) -> Result<(), WorkloadIdError> {
    if segment.is_empty() {
        return Err(WorkloadIdError::EmptySegment);
    }
    if segment == "." || segment == ".." {
        return Err(WorkloadIdError::DotSegment);
    }
    match segment
        .chars()
        .find(|&ch| !(ch.is_ascii_alphanumeric() || matches!(ch, '.' | '-' | '_')))
    {
        Some(ch) => Err(WorkloadIdError::BadPathChar { ch }),
        None => Ok(()),
    }
}

/// Why a peer's certificate, though it chains to the CA, does not carry the
/// identity this side expects (T2). The handshake fails with an
/// `access_denied` alert.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityRejection {
    /// The certificate could not be parsed to read its SANs.
    #[error("certificate could not be parsed: {detail}")]
    UnparsableCertificate {
        /// The parser's message.
        detail: String,
    },
    /// The certificate has no URI SAN.
    #[error("certificate has no URI SAN (no SPIFFE ID)")]
    NoUriSan,
    /// The certificate has more than one URI SAN (an X.509 SVID has exactly one).
    #[error("certificate has {count} URI SANs; exactly one SPIFFE ID is required")]
    MultipleUriSans {
        /// How many URI SANs it has.
        count: usize,
    },
    /// The URI SAN is not a valid workload identity.
    #[error("URI SAN {uri:?} is not a valid workload identity: {error}")]
    MalformedId {
        /// The URI SAN as found in the certificate.
        uri: String,
        /// The first rule it breaks.
        error: WorkloadIdError,
    },
    /// The identity belongs to another trust domain.
    #[error("trust domain {found:?} is not the configured {expected:?}")]
    WrongTrustDomain {
        /// The configured trust domain.
        expected: String,
        /// The certificate's trust domain.
        found: String,
    },
    /// The identity has the other role.
    #[error("role {found} presented where role {expected} is required")]
    WrongRole {
        /// The role this side requires of its peer.
        expected: Role,
        /// The role in the certificate.
        found: Role,
    },
    /// (Edge side) the node name is not in the configured set of expected nodes.
    #[error("node name {name:?} is not in the allowed set")]
    NameNotAllowed {
        /// The node name in the certificate.
        name: String,
    },
    /// The handshake finished without the verifier having accepted a peer
    /// certificate (a safety net; mandatory client auth makes it unreachable).
    #[error("no peer certificate was verified")]
    NotVerified,
    /// (Node side) the edge name is not the configured edge name.
    #[error("edge name {found:?} is not the configured {expected:?}")]
    WrongName {
        /// The configured edge name.
        expected: String,
        /// The name in the certificate.
        found: String,
    },
}

/// Reads the workload identity from the single URI SAN of a DER certificate.
///
/// This does not verify the certificate; callers run it after path validation.
pub fn workload_id_from_cert(cert: &CertificateDer<'_>) -> Result<WorkloadId, IdentityRejection> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).map_err(|e| {
        IdentityRejection::UnparsableCertificate {
            detail: e.to_string(),
        }
    })?;
    let san = parsed
        .subject_alternative_name()
        .map_err(|e| IdentityRejection::UnparsableCertificate {
            detail: e.to_string(),
        })?
        .ok_or(IdentityRejection::NoUriSan)?;
    let mut uris = san
        .value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::URI(uri) => Some(*uri),
            _ => None,
        });
    let uri = uris.next().ok_or(IdentityRejection::NoUriSan)?;
    let extra = uris.count();
    if extra > 0 {
        return Err(IdentityRejection::MultipleUriSans { count: 1 + extra });
    }
    WorkloadId::parse(uri).map_err(|error| IdentityRejection::MalformedId {
        uri: uri.to_owned(),
        error,
    })
}

/// Checks that `id` is in `trust_domain` and has role `role`.
pub(crate) fn check_domain_and_role(
    id: &WorkloadId,
    trust_domain: &str,
    role: Role,
) -> Result<(), IdentityRejection> {
    if id.trust_domain() != trust_domain {
        return Err(IdentityRejection::WrongTrustDomain {
            expected: trust_domain.to_owned(),
            found: id.trust_domain().to_owned(),
        });
    }
    if id.role() != role {
        return Err(IdentityRejection::WrongRole {
            expected: role,
            found: id.role(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(trust_domain: &str, role: Role, name: &str) -> WorkloadId {
        WorkloadId {
            trust_domain: trust_domain.to_owned(),
            role,
            name: name.to_owned(),
        }
    }

    #[test]
    fn parses_node_and_edge_ids() {
        assert_eq!(
            WorkloadId::parse("spiffe://iop/node/node-a"),
            Ok(id("iop", Role::Node, "node-a"))
        );
        assert_eq!(
            WorkloadId::parse("spiffe://prod.example.org/edge/Edge_1.eu-west"),
            Ok(id("prod.example.org", Role::Edge, "Edge_1.eu-west"))
        );
        assert_eq!(
            "spiffe://iop/node/gpu-7".parse::<WorkloadId>(),
            Ok(id("iop", Role::Node, "gpu-7"))
        );
    }

    #[test]
    fn renders_and_round_trips() {
        let node = id("iop", Role::Node, "node-a");
        assert_eq!(node.to_string(), "spiffe://iop/node/node-a");
        assert_eq!(node.uri(), "spiffe://iop/node/node-a");
        assert_eq!(WorkloadId::parse(&node.uri()), Ok(node));
        assert_eq!(
            WorkloadId::new("iop", Role::Edge, "edge-1").map(|id| id.to_string()),
            Ok("spiffe://iop/edge/edge-1".to_owned())
        );
    }

    #[test]
    fn accessors_return_parts() {
        let parsed = WorkloadId::parse("spiffe://iop/node/node-a");
        assert_eq!(
            parsed
                .as_ref()
                .map(|id| (id.trust_domain(), id.role(), id.name())),
            Ok(("iop", Role::Node, "node-a"))
        );
    }

    #[test]
    fn rejects_bad_ids_with_the_broken_rule() {
        let cases: &[(&str, WorkloadIdError)] = &[
            ("", WorkloadIdError::NotSpiffe),
            ("https://iop/node/a", WorkloadIdError::NotSpiffe),
            ("SPIFFE://iop/node/a", WorkloadIdError::NotSpiffe),
            ("spiffe:/iop/node/a", WorkloadIdError::NotSpiffe),
            ("spiffe:///node/a", WorkloadIdError::EmptyTrustDomain),
            (
                "spiffe://IOP/node/a",
                WorkloadIdError::BadTrustDomainChar { ch: 'I' },
            ),
            (
                "spiffe://iop:443/node/a",
                WorkloadIdError::BadTrustDomainChar { ch: ':' },
            ),
            (
                "spiffe://user@iop/node/a",
                WorkloadIdError::BadTrustDomainChar { ch: '@' },
            ),
            ("spiffe://iop", WorkloadIdError::MissingPath),
            ("spiffe://iop/", WorkloadIdError::EmptySegment),
            (
                "spiffe://iop/node",
                WorkloadIdError::WrongSegmentCount { segments: 1 },
            ),
            (
                "spiffe://iop/node/a/b",
                WorkloadIdError::WrongSegmentCount { segments: 3 },
            ),
            ("spiffe://iop/node/a/", WorkloadIdError::EmptySegment),
            ("spiffe://iop//node/a", WorkloadIdError::EmptySegment),
            ("spiffe://iop/node/..", WorkloadIdError::DotSegment),
            ("spiffe://iop/./a", WorkloadIdError::DotSegment),
            (
                "spiffe://iop/node/a%20b",
                WorkloadIdError::BadPathChar { ch: '%' },
            ),
            (
                "spiffe://iop/node/a?x=1",
                WorkloadIdError::BadPathChar { ch: '?' },
            ),
            (
                "spiffe://iop/node/a#f",
                WorkloadIdError::BadPathChar { ch: '#' },
            ),
            (
                "spiffe://iop/node/ä",
                WorkloadIdError::BadPathChar { ch: 'ä' },
            ),
            (
                "spiffe://iop/client/a",
                WorkloadIdError::UnknownRole {
                    role: "client".to_owned(),
                },
            ),
            (
                "spiffe://iop/Node/a",
                WorkloadIdError::UnknownRole {
                    role: "Node".to_owned(),
                },
            ),
        ];
        for (uri, expected) in cases {
            assert_eq!(
                WorkloadId::parse(uri).as_ref(),
                Err(expected),
                "uri {uri:?}"
            );
        }
    }

    #[test]
    fn rejects_overlong_ids() {
        let long_name = "a".repeat(MAX_URI_BYTES);
        let uri = format!("spiffe://iop/node/{long_name}");
        assert_eq!(
            WorkloadId::parse(&uri),
            Err(WorkloadIdError::TooLong {
                len_bytes: uri.len()
            })
        );
        assert_eq!(
            WorkloadId::new("iop", Role::Node, &long_name),
            Err(WorkloadIdError::TooLong {
                len_bytes: uri.len()
            })
        );
        let long_domain = "d".repeat(MAX_TRUST_DOMAIN_BYTES + 1);
        assert_eq!(
            WorkloadId::parse(&format!("spiffe://{long_domain}/node/a")),
            Err(WorkloadIdError::TrustDomainTooLong {
                len_bytes: MAX_TRUST_DOMAIN_BYTES + 1
            })
        );
    }

    #[test]
    fn new_validates_parts() {
        assert_eq!(
            WorkloadId::new("", Role::Node, "a"),
            Err(WorkloadIdError::EmptyTrustDomain)
        );
        assert_eq!(
            WorkloadId::new("iop", Role::Node, "a/b"),
            Err(WorkloadIdError::BadPathChar { ch: '/' })
        );
        assert_eq!(
            WorkloadId::new("iop", Role::Node, ""),
            Err(WorkloadIdError::EmptySegment)
        );
        assert_eq!(WorkloadId::validate_name("node-a"), Ok(()));
        assert_eq!(
            WorkloadId::validate_trust_domain("Iop"),
            Err(WorkloadIdError::BadTrustDomainChar { ch: 'I' })
        );
    }

    #[test]
    fn role_segments() {
        assert_eq!(Role::from_segment("edge"), Some(Role::Edge));
        assert_eq!(Role::from_segment("node"), Some(Role::Node));
        assert_eq!(Role::from_segment("EDGE"), None);
        assert_eq!(Role::Node.to_string(), "node");
    }

    #[test]
    fn domain_and_role_checks() {
        let node = id("iop", Role::Node, "node-a");
        assert_eq!(check_domain_and_role(&node, "iop", Role::Node), Ok(()));
        assert_eq!(
            check_domain_and_role(&node, "other", Role::Node),
            Err(IdentityRejection::WrongTrustDomain {
                expected: "other".to_owned(),
                found: "iop".to_owned()
            })
        );
        assert_eq!(
            check_domain_and_role(&node, "iop", Role::Edge),
            Err(IdentityRejection::WrongRole {
                expected: Role::Edge,
                found: Role::Node
            })
        );
    }
}
