//! The Node configuration file (`node-bin --config node.toml`).
//!
//! ```text
//! node.toml ──read──► text ──toml + serde (unknown keys rejected, key path kept)──► RawNodeFile
//!     RawNodeFile ──validate (names, edge addresses, S2 reconnect policy)──► NodeConfig
//!     NodeConfig::validate_files ──► the TLS files exist and are readable (S3)
//! ```
//!
//! The Node's adapters are not configured here: the Edge sends them in
//! `RegisterResponse.config` (R2, U4). This file only says who we are, where
//! the Edges are (`edge_addr`: one or several, each dial picks one, see
//! [`crate::edges`]), who they may be (`edge_name`: one or several accepted
//! identities, T2), how to reconnect (S2) and, optionally, the credential
//! plane (`[credentials]`, C2): our recipient key file, the public keys of
//! the lease issuers we trust (one per Edge of a fleet), the allowed clock
//! skew and, per credential slot, the provider origins its secret may
//! reach. With it the Node is *managed*: every tunnel must carry a valid
//! credential lease (C3).
//!
//! `edge_addr`, `edge_name` and `credentials.issuer_public_keys` take a
//! string or an array of strings; each list is bounded
//! ([`MAX_EDGE_ADDRS`], [`MAX_EDGE_NAMES`], [`MAX_ISSUER_KEYS`]) and an empty
//! one is an error.
//!
//! [`NodeConfig::parse`] is pure (no file system access); [`NodeConfig::load`]
//! reads the file, parses it and checks the TLS files. Every error is a
//! [`ConfigError`] that displays as `<file>: <key>: <reason>` (`-` when no key
//! applies); an unreadable certificate or key is one too. The binary prints
//! it and exits 1 (S3).

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ed25519_dalek::VerifyingKey;
use iop_engine::config::{
    check_name, check_trust_domain, parse_toml, read_config_file, resolve_path, split_host_port,
    RawTls,
};
use iop_engine::http::Url;
use iop_engine::keys::decode_issuer_public_key;
use iop_wire::checks::ReconnectPolicy;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use crate::jitter::Jitter;

// The config error (`<file>: <key>: <reason>`), the TLS file set and the
// limits on identity names (node id, edge name) and the trust domain are
// shared with the Edge.
pub use iop_engine::config::{ConfigError, TlsFiles, MAX_NAME_BYTES, MAX_TRUST_DOMAIN_BYTES};
/// Default `credentials.clock_skew_ms`: a lease is accepted from 5 s before
/// its `not_before` until 5 s after its expiry, tolerating that much clock
/// difference between the Edge and this Node.
pub const DEFAULT_CLOCK_SKEW_MS: u32 = 5_000;
/// Largest accepted `credentials.clock_skew_ms` (one minute).
pub const MAX_CLOCK_SKEW_MS: u32 = 60_000;
/// Default `drain_grace_ms`: how long active runs and tunnels may finish
/// after SIGTERM/SIGINT before the Node closes its Edge connection anyway.
pub const DEFAULT_DRAIN_GRACE_MS: u64 = 30_000;
/// Largest accepted `drain_grace_ms` (one hour).
pub const MAX_DRAIN_GRACE_MS: u64 = 3_600_000;
/// Most `edge_addr` entries.
pub const MAX_EDGE_ADDRS: usize = 16;
/// Most `edge_name` entries.
pub const MAX_EDGE_NAMES: usize = 16;
/// Most trusted lease issuer keys (`credentials.issuer_public_key` and
/// `credentials.issuer_public_keys` together).
pub const MAX_ISSUER_KEYS: usize = 16;

// ---------------------------------------------------------------------------
// The validated configuration
// ---------------------------------------------------------------------------

/// The validated Node configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeConfig {
    /// The file this was read from (for messages).
    pub source: PathBuf,
    /// Our node id; must equal our certificate name (T3).
    pub node_id: String,
    /// SPIFFE trust domain shared with the Edge (T2).
    pub trust_domain: String,
    /// Where the Edges' Node listeners are: one or several `host:port`
    /// entries; each dial tries their addresses in a fresh random order.
    pub edge_addr: EdgeAddrs,
    /// The Edge identity names we accept: the Edge's certificate must name
    /// `spiffe://<trust_domain>/edge/<name>` for one of them (T2).
    pub edge_name: EdgeNames,
    /// Dev flag: dial the Edge over plain TCP, credential plane disabled (T5).
    pub insecure_plaintext: bool,
    /// The TLS files, resolved against the config file's directory; `None`
    /// exactly when `insecure_plaintext` is set (T5).
    pub tls: Option<TlsFiles>,
    /// How the supervisor dials and redials the Edge (S2).
    pub reconnect: ReconnectPolicy,
    /// How far each reconnect wait strays from `reconnect.interval` (its
    /// mean), either side (`reconnect.jitter_percent`).
    pub reconnect_jitter: Jitter,
    /// The credential plane (`[credentials]`); `None` = unmanaged. Never set
    /// together with `insecure_plaintext` (T5).
    pub credentials: Option<CredentialsSpec>,
    /// After SIGTERM/SIGINT, how long active runs and tunnels may finish
    /// before the Node closes its Edge connection and exits anyway.
    pub drain_grace_ms: u64,
    /// `[metrics]`: the optional node_exporter textfile.
    pub metrics: MetricsSpec,
    /// `[tracing]`: provider-call spans exported over OTLP
    /// (`docs/tracing.md`); `None`: tracing is off (no `otlp_endpoint`).
    pub tracing: Option<iop_engine::trace::TracingSpec>,
}

/// The `service.name` of the Node's spans unless `[tracing] service_name`
/// says otherwise.
pub const DEFAULT_TRACING_SERVICE_NAME: &str = "iop-node";

/// The `[metrics]` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsSpec {
    /// `textfile`: where the node_exporter textfile is written (resolved
    /// against the config file's directory); `None`: not written.
    pub textfile: Option<PathBuf>,
    /// `textfile_interval_sec`: how often it is rewritten.
    pub textfile_interval: Duration,
}

/// Default `metrics.textfile_interval_sec`.
pub const DEFAULT_TEXTFILE_INTERVAL_SEC: u64 = 15;
/// Largest `metrics.textfile_interval_sec`.
pub const MAX_TEXTFILE_INTERVAL_SEC: u64 = 3600;

impl Default for MetricsSpec {
    fn default() -> Self {
        Self {
            textfile: None,
            textfile_interval: Duration::from_secs(DEFAULT_TEXTFILE_INTERVAL_SEC),
        }
    }
}

/// The `[credentials]` table (C2). Holds no secret: the recipient key is
/// read from its file at startup (`node_bin::credentials`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CredentialsSpec {
    /// Our X25519 recipient key file, resolved against the config file's
    /// directory (`node-bin keys recipient --out …` writes one).
    pub recipient_key: PathBuf,
    /// The Ed25519 public keys of the lease issuers we trust (one per Edge
    /// of a fleet): `issuer_public_key`, then `issuer_public_keys`, without
    /// duplicates; never empty, at most [`MAX_ISSUER_KEYS`].
    pub issuer_public_keys: Vec<VerifyingKey>,
    /// Clock difference to the Edge tolerated at both edges of a lease's
    /// validity window.
    pub clock_skew_ms: u32,
    /// `[credentials.allowed_origins]`: per credential slot, the provider
    /// origins (`http://host:port`) its secret may be sent to, whatever a
    /// lease or the Edge's config says. A slot not listed is not pinned.
    pub allowed_origins: BTreeMap<String, Vec<String>>,
}

/// The Edge's address: `host:port`, the host an IP address or a DNS name
/// (resolved at each dial). Usable wherever [`ToSocketAddrs`] is taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EdgeAddr {
    host: String,
    port: u16,
}

impl EdgeAddr {
    /// Parses `host:port` or `[ipv6]:port`. The error is the reason, for a
    /// [`ConfigError`].
    pub fn parse(text: &str) -> Result<Self, String> {
        const FORM: &str = "expected host:port, e.g. 127.0.0.1:7443 or edge.example:7443";
        let (host, port) =
            split_host_port(text).map_err(|why| format!("{text:?}: {why}; {FORM}"))?;
        Ok(Self { host, port })
    }

    /// The host: an IP address (IPv6 without brackets) or a DNS name.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The socket address when the host is an IP literal (no resolution).
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        let ip: IpAddr = self.host.parse().ok()?;
        Some(SocketAddr::new(ip, self.port))
    }
}

impl fmt::Display for EdgeAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl ToSocketAddrs for EdgeAddr {
    type Iter = std::vec::IntoIter<SocketAddr>;

    /// Resolves the host (blocking DNS for a name; none for an IP literal).
    fn to_socket_addrs(&self) -> io::Result<Self::Iter> {
        (self.host.as_str(), self.port).to_socket_addrs()
    }
}

/// `edge_addr`: the Edges this Node may dial, one or more [`EdgeAddr`]s in
/// the order written (duplicates allowed: the dial order drops repeated
/// addresses). Never empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EdgeAddrs(Vec<EdgeAddr>);

impl EdgeAddrs {
    /// The list; `None` when `entries` is empty.
    pub fn new(entries: Vec<EdgeAddr>) -> Option<Self> {
        (!entries.is_empty()).then_some(Self(entries))
    }

    /// The entries, as written.
    pub fn entries(&self) -> &[EdgeAddr] {
        &self.0
    }
}

impl From<EdgeAddr> for EdgeAddrs {
    /// One Edge.
    fn from(addr: EdgeAddr) -> Self {
        Self(vec![addr])
    }
}

impl fmt::Display for EdgeAddrs {
    /// The entries, comma separated (one entry: just it).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, addr) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{addr}")?;
        }
        Ok(())
    }
}

/// `edge_name`: the Edge identity names this Node accepts (T2), in the
/// order written, without duplicates. Never empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EdgeNames(Vec<String>);

impl EdgeNames {
    /// The names, each checked as an identity name, duplicates dropped.
    /// The error is the reason, for a [`ConfigError`].
    pub fn parse<S: AsRef<str>>(names: &[S]) -> Result<Self, String> {
        if names.is_empty() {
            return Err("list at least one Edge identity name".to_owned());
        }
        if names.len() > MAX_EDGE_NAMES {
            return Err(format!(
                "at most {MAX_EDGE_NAMES} names (got {})",
                names.len()
            ));
        }
        let mut out: Vec<String> = Vec::with_capacity(names.len());
        for name in names {
            let name = name.as_ref();
            check_name(name)?;
            if !out.iter().any(|n| n == name) {
                out.push(name.to_owned());
            }
        }
        Ok(Self(out))
    }

    /// The names, in the order written.
    pub fn names(&self) -> &[String] {
        &self.0
    }

    /// The first name.
    pub fn first(&self) -> &str {
        &self.0[0]
    }

    /// Whether `name` is one of them.
    pub fn contains(&self, name: &str) -> bool {
        self.0.iter().any(|n| n == name)
    }
}

impl From<&str> for EdgeNames {
    /// One name, not checked here (the TLS connector checks it when built).
    fn from(name: &str) -> Self {
        Self(vec![name.to_owned()])
    }
}

impl fmt::Display for EdgeNames {
    /// The names, comma separated (one name: just it).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join(", "))
    }
}

impl NodeConfig {
    /// Reads `path`, parses and validates it ([`NodeConfig::parse`]), then
    /// checks the TLS files ([`NodeConfig::validate_files`]).
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = read_config_file(path)?;
        let config = Self::parse(&text, path)?;
        config.validate_files()?;
        Ok(config)
    }

    /// Parses and validates `text`; `path` names the file in errors and
    /// anchors relative TLS paths. Touches no file.
    pub fn parse(text: &str, path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let raw: RawNodeFile = parse_toml(text, path)?;
        validate(raw, path)
    }

    /// Checks that every TLS file exists, is a regular file and can be opened
    /// for reading (nothing to check in insecure mode). The error names the
    /// key (`tls.key`) and the resolved path; like every config error it is
    /// a local credential error that ends the process with exit 1 (S3).
    pub fn validate_files(&self) -> Result<(), ConfigError> {
        match &self.tls {
            Some(tls) => tls.validate_files(&self.source),
            None => Ok(()),
        }
    }
}

// ---------------------------------------------------------------------------
// The file as written
// ---------------------------------------------------------------------------

/// Runs the serde mirror of `node.toml` on `deserializer` and drops what it
/// built. Not an API: the configuration reference's test walks the file
/// format with it (every key `docs/configuration.md` must document).
#[doc(hidden)]
pub fn deserialize_file_format<'de, D: Deserializer<'de>>(deserializer: D) -> Result<(), D::Error> {
    RawNodeFile::deserialize(deserializer).map(drop)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNodeFile {
    node_id: String,
    trust_domain: String,
    edge_addr: OneOrMany,
    edge_name: OneOrMany,
    #[serde(default)]
    insecure_plaintext: bool,
    tls: Option<RawTls>,
    #[serde(default)]
    reconnect: RawReconnect,
    credentials: Option<WithIssuer>,
    drain_grace_ms: Option<i64>,
    #[serde(default)]
    metrics: RawMetrics,
    tracing: Option<RawTracing>,
}

/// `[tracing]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTracing {
    otlp_endpoint: Option<String>,
    sample_ratio: Option<f64>,
    service_name: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMetrics {
    textfile: Option<String>,
    textfile_interval_sec: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCredentials {
    recipient_key: String,
    issuer_public_key: Option<String>,
    issuer_public_keys: Option<OneOrMany>,
    clock_skew_ms: Option<i64>,
    #[serde(default)]
    allowed_origins: BTreeMap<String, Vec<String>>,
}

/// `[credentials]` with at least one of `issuer_public_key` and
/// `issuer_public_keys`: neither is serde's missing-key error for
/// `issuer_public_key`, located like any other (as when the key was the
/// only form).
#[derive(Debug, Deserialize)]
#[serde(try_from = "RawCredentials")]
struct WithIssuer(RawCredentials);

impl TryFrom<RawCredentials> for WithIssuer {
    type Error = String;

    fn try_from(raw: RawCredentials) -> Result<Self, String> {
        if raw.issuer_public_key.is_none() && raw.issuer_public_keys.is_none() {
            return Err("missing field `issuer_public_key`".to_owned());
        }
        Ok(Self(raw))
    }
}

/// A key that takes one string or an array of strings.
#[derive(Debug)]
struct OneOrMany(Vec<String>);

impl<'de> Deserialize<'de> for OneOrMany {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Strings;

        impl<'de> Visitor<'de> for Strings {
            type Value = OneOrMany;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or an array of strings")
            }

            fn visit_str<E: de::Error>(self, value: &str) -> Result<OneOrMany, E> {
                Ok(OneOrMany(vec![value.to_owned()]))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<OneOrMany, A::Error> {
                let mut out = Vec::new();
                while let Some(value) = seq.next_element::<String>()? {
                    out.push(value);
                }
                Ok(OneOrMany(out))
            }
        }

        deserializer.deserialize_any(Strings)
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReconnect {
    interval_sec: Option<i64>,
    max_attempts: Option<i64>,
    jitter_percent: Option<i64>,
}

// ---------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------

fn validate(raw: RawNodeFile, file: &Path) -> Result<NodeConfig, ConfigError> {
    let err = |key: &str, reason: String| ConfigError::new(file, key, reason);
    check_name(&raw.node_id).map_err(|why| err("node_id", why))?;
    check_trust_domain(&raw.trust_domain).map_err(|why| err("trust_domain", why))?;
    let edge_addr = edge_addrs(&raw.edge_addr.0).map_err(|why| err("edge_addr", why))?;
    let edge_name = EdgeNames::parse(&raw.edge_name.0).map_err(|why| err("edge_name", why))?;
    let tls = match (raw.insecure_plaintext, raw.tls) {
        (true, _) => None,
        (false, Some(tls)) => Some(tls.resolve(file)?),
        (false, None) => {
            return Err(err(
                "tls",
                "required unless insecure_plaintext = true".to_owned(),
            ))
        }
    };
    let reconnect =
        ReconnectPolicy::from_config(raw.reconnect.interval_sec, raw.reconnect.max_attempts)
            .map_err(|e| {
                let reason = e.to_string();
                // The wire error repeats its key; the message already leads with it.
                let reason = reason
                    .strip_prefix(e.key())
                    .map_or(reason.as_str(), str::trim_start);
                err(e.key(), reason.to_owned())
            })?;
    let reconnect_jitter = match raw.reconnect.jitter_percent {
        None => Jitter::DEFAULT,
        Some(v) => u8::try_from(v).ok().and_then(Jitter::new).ok_or_else(|| {
            err(
                "reconnect.jitter_percent",
                format!("must be between 0 and {} (got {v})", Jitter::MAX_PERCENT),
            )
        })?,
    };
    let credentials = match raw.credentials {
        None => None,
        Some(_) if raw.insecure_plaintext => {
            // T5: plain TCP disables the credential plane; refuse the mix.
            return Err(err(
                "credentials",
                "the credential plane needs mTLS to the edge: remove [credentials] or \
                 insecure_plaintext"
                    .to_owned(),
            ));
        }
        Some(WithIssuer(raw)) => Some(credentials(raw, file)?),
    };
    let drain_grace_ms = match raw.drain_grace_ms {
        None => DEFAULT_DRAIN_GRACE_MS,
        Some(v) => match u64::try_from(v) {
            Ok(v) if v <= MAX_DRAIN_GRACE_MS => v,
            _ => {
                return Err(err(
                    "drain_grace_ms",
                    format!("must be between 0 and {MAX_DRAIN_GRACE_MS} (got {v})"),
                ))
            }
        },
    };
    Ok(NodeConfig {
        source: file.to_path_buf(),
        node_id: raw.node_id,
        trust_domain: raw.trust_domain,
        edge_addr,
        edge_name,
        insecure_plaintext: raw.insecure_plaintext,
        tls,
        reconnect,
        reconnect_jitter,
        credentials,
        drain_grace_ms,
        metrics: metrics(raw.metrics, file)?,
        tracing: match raw.tracing {
            None => None,
            Some(t) => iop_engine::trace::TracingSpec::from_raw(
                t.otlp_endpoint.as_deref(),
                t.sample_ratio,
                t.service_name.as_deref(),
                DEFAULT_TRACING_SERVICE_NAME,
            )
            .map_err(|(key, why)| err(&format!("tracing.{key}"), why))?,
        },
    })
}

/// The `edge_addr` entries, each `host:port`; the error is the reason.
fn edge_addrs(entries: &[String]) -> Result<EdgeAddrs, String> {
    if entries.len() > MAX_EDGE_ADDRS {
        return Err(format!(
            "at most {MAX_EDGE_ADDRS} addresses (got {})",
            entries.len()
        ));
    }
    let parsed = entries
        .iter()
        .map(|entry| EdgeAddr::parse(entry))
        .collect::<Result<Vec<_>, _>>()?;
    EdgeAddrs::new(parsed).ok_or_else(|| "list at least one Edge address (host:port)".to_owned())
}

fn metrics(raw: RawMetrics, file: &Path) -> Result<MetricsSpec, ConfigError> {
    let textfile = match raw.textfile {
        None => None,
        Some(path) => Some(resolve_path(file, "metrics.textfile", &path)?),
    };
    let textfile_interval = match raw.textfile_interval_sec {
        None => Duration::from_secs(DEFAULT_TEXTFILE_INTERVAL_SEC),
        Some(v) => match u64::try_from(v) {
            Ok(v) if (1..=MAX_TEXTFILE_INTERVAL_SEC).contains(&v) => Duration::from_secs(v),
            _ => {
                return Err(ConfigError::new(
                    file,
                    "metrics.textfile_interval_sec",
                    format!("must be between 1 and {MAX_TEXTFILE_INTERVAL_SEC} (got {v})"),
                ))
            }
        },
    };
    Ok(MetricsSpec {
        textfile,
        textfile_interval,
    })
}

fn credentials(raw: RawCredentials, file: &Path) -> Result<CredentialsSpec, ConfigError> {
    let err = |key: &str, reason: String| ConfigError::new(file, key, reason);
    let recipient_key = resolve_path(file, "credentials.recipient_key", &raw.recipient_key)?;
    let issuer_public_keys = issuer_keys(&raw, file)?;
    let clock_skew_ms = match raw.clock_skew_ms {
        None => DEFAULT_CLOCK_SKEW_MS,
        Some(v) => match u32::try_from(v) {
            Ok(v) if v <= MAX_CLOCK_SKEW_MS => v,
            _ => {
                return Err(err(
                    "credentials.clock_skew_ms",
                    format!("must be between 0 and {MAX_CLOCK_SKEW_MS} (got {v})"),
                ))
            }
        },
    };
    let mut allowed_origins = BTreeMap::new();
    for (slot, origins) in raw.allowed_origins {
        let key = format!("credentials.allowed_origins.{slot}");
        if origins.is_empty() {
            return Err(err(
                &key,
                "list at least one origin, or remove the slot (an empty list would refuse \
                 every lease of it)"
                    .into(),
            ));
        }
        let mut canonical = Vec::with_capacity(origins.len());
        for origin in &origins {
            canonical.push(parse_origin(origin).map_err(|why| err(&key, why))?);
        }
        allowed_origins.insert(slot, canonical);
    }
    Ok(CredentialsSpec {
        recipient_key,
        issuer_public_keys,
        clock_skew_ms,
        allowed_origins,
    })
}

/// `issuer_public_key` then `issuer_public_keys` (at least one is present),
/// duplicates dropped, at most [`MAX_ISSUER_KEYS`].
fn issuer_keys(raw: &RawCredentials, file: &Path) -> Result<Vec<VerifyingKey>, ConfigError> {
    let err = |key: &str, reason: String| ConfigError::new(file, key, reason);
    const LIST: &str = "credentials.issuer_public_keys";
    let mut keys: Vec<VerifyingKey> = Vec::new();
    if let Some(text) = &raw.issuer_public_key {
        let key = decode_issuer_public_key(text)
            .map_err(|e| err("credentials.issuer_public_key", e.to_string()))?;
        keys.push(key);
    }
    if let Some(OneOrMany(list)) = &raw.issuer_public_keys {
        if list.is_empty() {
            return Err(err(
                LIST,
                "list at least one key (ed25519:<64 hex digits>), or remove the key".to_owned(),
            ));
        }
        for text in list {
            let key =
                decode_issuer_public_key(text).map_err(|e| err(LIST, format!("{text:?}: {e}")))?;
            if !keys.contains(&key) {
                keys.push(key);
            }
            if keys.len() > MAX_ISSUER_KEYS {
                return Err(err(
                    LIST,
                    format!(
                        "at most {MAX_ISSUER_KEYS} issuer keys in all (issuer_public_key \
                         counts too)"
                    ),
                ));
            }
        }
    }
    Ok(keys)
}

/// An `allowed_origins` entry: `http://host[:port]` or `https://host[:port]`
/// without a path, as the canonical origin a lease is bound to (scheme kept,
/// port written, host lowercased).
fn parse_origin(text: &str) -> Result<String, String> {
    let url = Url::parse(text).map_err(|e| format!("{text:?}: {e}"))?;
    if !url.prefix().is_empty() {
        return Err(format!(
            "{text:?}: an origin has no path (expected http(s)://host:port)"
        ));
    }
    Ok(url.origin())
}

#[cfg(test)]
mod tests {
    use iop_wire::checks::Attempts;

    use super::*;

    /// A valid file; variants are made by replacing one snippet.
    const BASE: &str = r#"node_id = "node-a"
trust_domain = "iop.local"
edge_addr = "127.0.0.1:7443"
edge_name = "edge-1"

[tls]
ca = "certs/ca.pem"
cert = "certs/node-a.pem"
key = "certs/node-a-key.pem"
"#;

    const TLS: &str = "[tls]\nca = \"certs/ca.pem\"\ncert = \"certs/node-a.pem\"\nkey = \"certs/node-a-key.pem\"\n";

    fn variant(old: &str, new: &str) -> String {
        assert_eq!(
            BASE.matches(old).count(),
            1,
            "snippet {old:?} must occur once"
        );
        BASE.replacen(old, new, 1)
    }

    fn parse(text: &str) -> Result<NodeConfig, ConfigError> {
        NodeConfig::parse(text, "conf/node.toml")
    }

    fn error(text: &str) -> String {
        match parse(text) {
            Ok(config) => panic!("expected an error, parsed {config:?}"),
            Err(e) => e.to_string(),
        }
    }

    fn error_of(old: &str, new: &str) -> String {
        error(&variant(old, new))
    }

    /// `BASE` with a `[reconnect]` table of the given lines.
    fn with_reconnect(lines: &str) -> String {
        format!("{BASE}\n[reconnect]\n{lines}\n")
    }

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
    }

    fn edge_addr(text: &str) -> EdgeAddr {
        match EdgeAddr::parse(text) {
            Ok(addr) => addr,
            Err(why) => panic!("{why}"),
        }
    }

    #[test]
    fn example_file_parses_into_the_documented_values() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/node.toml");
        let text = std::fs::read_to_string(&path).unwrap();
        let config = NodeConfig::parse(&text, &path).unwrap();
        let dir = path.parent().unwrap();
        let expected = NodeConfig {
            source: path.clone(),
            node_id: "node-a".into(),
            trust_domain: "iop.local".into(),
            edge_addr: edge_addr("127.0.0.1:7443").into(),
            edge_name: "edge-1".into(),
            insecure_plaintext: false,
            tls: Some(TlsFiles {
                ca: dir.join("certs/ca.pem"),
                cert: dir.join("certs/node-node-a.pem"),
                key: dir.join("certs/node-node-a-key.pem"),
            }),
            reconnect: ReconnectPolicy {
                interval: Duration::from_secs(10),
                attempts: Attempts::Limited(10),
            },
            reconnect_jitter: Jitter::new(50).unwrap(),
            credentials: None,
            drain_grace_ms: 30_000,
            metrics: MetricsSpec::default(),
            tracing: None,
        };
        assert_eq!(config, expected);
    }

    #[test]
    fn drain_grace_defaults_and_is_in_range() {
        assert_eq!(parse(BASE).unwrap().drain_grace_ms, 30_000);
        let with_grace = |value: &str| {
            variant(
                "edge_name = \"edge-1\"",
                &format!("edge_name = \"edge-1\"\ndrain_grace_ms = {value}"),
            )
        };
        assert_eq!(
            error(&with_grace("-1")),
            "conf/node.toml: drain_grace_ms: must be between 0 and 3600000 (got -1)"
        );
        assert_eq!(
            error(&with_grace("3600001")),
            "conf/node.toml: drain_grace_ms: must be between 0 and 3600000 (got 3600001)"
        );
        assert_eq!(
            error(&with_grace("\"30s\"")),
            "conf/node.toml: drain_grace_ms: invalid type: string \"30s\", expected i64 \
             (line 5, column 18)"
        );
        for (value, expected) in [("0", 0), ("3600000", 3_600_000), ("1500", 1_500)] {
            assert_eq!(parse(&with_grace(value)).unwrap().drain_grace_ms, expected);
        }
    }

    /// An issuer public key in config form (a valid Ed25519 point).
    fn issuer_key_text() -> String {
        let key = ed25519_dalek::SigningKey::from_bytes(&[5; 32]).verifying_key();
        iop_engine::keys::encode_issuer_public_key(&key)
    }

    fn with_credentials(lines: &str) -> String {
        format!("{BASE}\n[credentials]\n{lines}\n")
    }

    // CONTRACT: C2 — [credentials] names the recipient key file (resolved
    // against the config directory), the issuer public key and the clock
    // skew (default 5000 ms).
    #[test]
    fn credentials_table_parses() {
        let issuer = issuer_key_text();
        let config = parse(&with_credentials(&format!(
            "recipient_key = \"keys/node-a.key\"\nissuer_public_key = \"{issuer}\""
        )))
        .unwrap();
        assert_eq!(
            config.credentials,
            Some(CredentialsSpec {
                recipient_key: PathBuf::from("conf/keys/node-a.key"),
                issuer_public_keys: vec![decode_issuer_public_key(&issuer).unwrap()],
                clock_skew_ms: 5_000,
                allowed_origins: BTreeMap::new(),
            })
        );
        let config = parse(&with_credentials(&format!(
            "recipient_key = \"/k\"\nissuer_public_key = \"{issuer}\"\n\
             [credentials.allowed_origins]\nopenai-main = [\"HTTP://GPU-1.lan:8000\", \"http://[::1]\", \"https://API.openai.com\"]"
        )))
        .unwrap();
        assert_eq!(
            config.credentials.map(|c| c.allowed_origins),
            Some(BTreeMap::from([(
                "openai-main".to_string(),
                vec![
                    "http://gpu-1.lan:8000".to_string(),
                    "http://[::1]:80".to_string(),
                    "https://api.openai.com:443".to_string()
                ]
            )]))
        );
        let config = parse(&with_credentials(&format!(
            "recipient_key = \"/k\"\nissuer_public_key = \"{issuer}\"\nclock_skew_ms = 0"
        )))
        .unwrap();
        assert_eq!(config.credentials.map(|c| c.clock_skew_ms), Some(0));
        assert_eq!(parse(BASE).unwrap().credentials, None);
    }

    // CONTRACT: C2 — the credential keys are validated with file, key and
    // reason.
    #[test]
    fn credentials_values_are_checked() {
        let issuer = issuer_key_text();
        let key = format!("recipient_key = \"k\"\nissuer_public_key = \"{issuer}\"");
        assert_eq!(
            error(&with_credentials(&format!("{key}\nclock_skew_ms = 60001"))),
            "conf/node.toml: credentials.clock_skew_ms: must be between 0 and 60000 (got 60001)"
        );
        assert_eq!(
            error(&with_credentials(&format!("{key}\nclock_skew_ms = -1"))),
            "conf/node.toml: credentials.clock_skew_ms: must be between 0 and 60000 (got -1)"
        );
        let pins = |list: &str| {
            error(&with_credentials(&format!(
                "{key}\n[credentials.allowed_origins]\ns = {list}"
            )))
        };
        assert_eq!(
            pins("[]"),
            "conf/node.toml: credentials.allowed_origins.s: list at least one origin, or \
             remove the slot (an empty list would refuse every lease of it)"
        );
        assert_eq!(
            pins("[\"http://h:1/v1\"]"),
            "conf/node.toml: credentials.allowed_origins.s: \"http://h:1/v1\": an origin has \
             no path (expected http(s)://host:port)"
        );
        assert!(pins("[\"ftp://h\"]")
            .starts_with("conf/node.toml: credentials.allowed_origins.s: \"ftp://h\": "));
        assert_eq!(
            error(&with_credentials(&format!(
                "recipient_key = \"\"\nissuer_public_key = \"{issuer}\""
            ))),
            "conf/node.toml: credentials.recipient_key: must not be empty"
        );
        assert_eq!(
            error(&with_credentials(
                "recipient_key = \"k\"\nissuer_public_key = \"x25519:00\""
            )),
            "conf/node.toml: credentials.issuer_public_key: invalid public key: expected \
             ed25519:<64 hex digits>"
        );
        assert_eq!(
            error(&with_credentials(&format!("{key}\nsecret = \"x\""))),
            "conf/node.toml: credentials.secret: unknown field `secret`, expected one of \
             `recipient_key`, `issuer_public_key`, `issuer_public_keys`, `clock_skew_ms`, \
             `allowed_origins` (line 14, column 1)"
        );
        assert_eq!(
            error(&with_credentials("issuer_public_key = \"x\"")),
            "conf/node.toml: credentials.recipient_key: required key is missing (line 11, column 1)"
        );
    }

    // CONTRACT: T5, C3 — plain TCP disables the credential plane: a file
    // with both is refused.
    #[test]
    fn credentials_are_refused_in_insecure_mode() {
        let issuer = issuer_key_text();
        let text = variant(TLS, "insecure_plaintext = true\n");
        assert_eq!(
            error(&format!(
                "{text}\n[credentials]\nrecipient_key = \"k\"\nissuer_public_key = \"{issuer}\"\n"
            )),
            "conf/node.toml: credentials: the credential plane needs mTLS to the edge: remove \
             [credentials] or insecure_plaintext"
        );
    }

    #[test]
    fn reconnect_omitted_means_ten_attempts_ten_seconds_apart() {
        // CONTRACT: S2 — omitted interval = 10, omitted max_attempts = 10.
        let expected = ReconnectPolicy {
            interval: Duration::from_secs(10),
            attempts: Attempts::Limited(10),
        };
        assert_eq!(parse(BASE).unwrap().reconnect, expected);
        assert_eq!(parse(&with_reconnect("")).unwrap().reconnect, expected);
    }

    #[test]
    fn reconnect_jitter_defaults_to_half_the_interval_and_is_in_range() {
        // CONTRACT: S2 — the jitter is on by default; interval_sec stays
        // the mean wait.
        assert_eq!(parse(BASE).unwrap().reconnect_jitter, Jitter::DEFAULT);
        assert_eq!(Jitter::DEFAULT.percent(), 50);
        let config = parse(&with_reconnect("jitter_percent = 0")).unwrap();
        assert_eq!(config.reconnect_jitter, Jitter::NONE);
        let config = parse(&with_reconnect("jitter_percent = 100")).unwrap();
        assert_eq!(config.reconnect_jitter.percent(), 100);
        assert_eq!(
            error(&with_reconnect("jitter_percent = 101")),
            "conf/node.toml: reconnect.jitter_percent: must be between 0 and 100 (got 101)"
        );
        assert_eq!(
            error(&with_reconnect("jitter_percent = -1")),
            "conf/node.toml: reconnect.jitter_percent: must be between 0 and 100 (got -1)"
        );
    }

    #[test]
    fn reconnect_zero_attempts_is_unlimited() {
        // CONTRACT: S2 — explicit 0 = unlimited until local shutdown.
        let config = parse(&with_reconnect("max_attempts = 0")).unwrap();
        assert_eq!(
            config.reconnect,
            ReconnectPolicy {
                interval: Duration::from_secs(10),
                attempts: Attempts::Unlimited,
            }
        );
        let config = parse(&with_reconnect("max_attempts = 0\ninterval_sec = 3")).unwrap();
        assert_eq!(config.reconnect.interval, Duration::from_secs(3));
    }

    #[test]
    fn reconnect_positive_attempts_are_exact() {
        // CONTRACT: S2 — positive = exactly that many attempts.
        let config = parse(&with_reconnect("max_attempts = 3\ninterval_sec = 0")).unwrap();
        assert_eq!(
            config.reconnect,
            ReconnectPolicy {
                interval: Duration::ZERO,
                attempts: Attempts::Limited(3),
            }
        );
    }

    #[test]
    fn reconnect_invalid_values_are_config_errors() {
        // CONTRACT: S2 — negative = config validation error; unlimited needs
        // interval_sec > 0.
        assert_eq!(
            error(&with_reconnect("max_attempts = -1")),
            "conf/node.toml: reconnect.max_attempts: must be 0 (unlimited) or positive (got -1)"
        );
        assert_eq!(
            error(&with_reconnect("interval_sec = -5")),
            "conf/node.toml: reconnect.interval_sec: must not be negative (got -5)"
        );
        assert_eq!(
            error(&with_reconnect("max_attempts = 0\ninterval_sec = 0")),
            "conf/node.toml: reconnect.interval_sec: must be > 0 when reconnect.max_attempts = 0 (unlimited)"
        );
        assert_eq!(
            error(&with_reconnect("max_attempts = 4294967296")),
            "conf/node.toml: reconnect.max_attempts: is too large (got 4294967296)"
        );
        assert_eq!(
            error(&with_reconnect("max_attempts = \"10\"")),
            "conf/node.toml: reconnect.max_attempts: invalid type: string \"10\", expected i64 (line 12, column 16)"
        );
    }

    #[test]
    fn the_tracing_table_is_off_by_default_and_its_values_are_checked() {
        assert_eq!(parse(BASE).unwrap().tracing, None);
        let on = parse(&format!(
            "{BASE}\n[tracing]\notlp_endpoint = \"http://127.0.0.1:4318\"\nsample_ratio = 0.25\n"
        ))
        .unwrap()
        .tracing
        .expect("on");
        assert_eq!(on.otlp_endpoint.traces_path(), "/v1/traces");
        assert_eq!(on.sample_ratio, 0.25);
        assert_eq!(on.service_name, DEFAULT_TRACING_SERVICE_NAME);
        assert_eq!(
            error(&format!(
                "{BASE}\n[tracing]\notlp_endpoint = \"http://c:1\"\nsample_ratio = -1\n"
            )),
            "conf/node.toml: tracing.sample_ratio: -1 is not from 0.0 to 1.0"
        );
        assert_eq!(
            error(&format!("{BASE}\n[tracing]\notlp_endpoint = \"c:1\"\n")),
            "conf/node.toml: tracing.otlp_endpoint: \"c:1\" is not an http:// URL \
             (e.g. http://127.0.0.1:4318)"
        );
    }

    #[test]
    fn unknown_keys_are_rejected_with_their_path() {
        assert_eq!(
            error(&with_reconnect("backoff = 2")),
            "conf/node.toml: reconnect.backoff: unknown field `backoff`, expected one of \
             `interval_sec`, `max_attempts`, `jitter_percent` (line 12, column 1)"
        );
        assert_eq!(
            error_of("edge_name = \"edge-1\"", "edge_name = \"edge-1\"\ncores = \"0-3\""),
            "conf/node.toml: cores: unknown field `cores`, expected one of `node_id`, `trust_domain`, \
             `edge_addr`, `edge_name`, `insecure_plaintext`, `tls`, `reconnect`, `credentials`, \
             `drain_grace_ms`, `metrics`, `tracing` (line 5, column 1)"
        );
        assert_eq!(
            error_of("key = \"certs/node-a-key.pem\"", "key = \"certs/node-a-key.pem\"\npassword = \"x\""),
            "conf/node.toml: tls.password: unknown field `password`, expected one of `ca`, `cert`, `key` \
             (line 10, column 1)"
        );
    }

    #[test]
    fn syntax_and_missing_keys() {
        assert_eq!(
            error_of("edge_name = \"edge-1\"", "edge_name = \"edge-1"),
            "conf/node.toml: -: invalid basic string, expected `\"` (line 4, column 20)"
        );
        assert_eq!(
            error_of("edge_name = \"edge-1\"\n", ""),
            "conf/node.toml: edge_name: required key is missing (line 1, column 1)"
        );
        assert_eq!(
            error_of("ca = \"certs/ca.pem\"\n", ""),
            "conf/node.toml: tls.ca: required key is missing (line 6, column 1)"
        );
    }

    #[test]
    fn names_and_trust_domain_are_checked() {
        let rule = "must be 1 to 128 characters of A-Z a-z 0-9 . _ -";
        assert_eq!(
            error_of("node_id = \"node-a\"", "node_id = \"node a\""),
            format!("conf/node.toml: node_id: \"node a\" {rule}")
        );
        assert_eq!(
            error_of("edge_name = \"edge-1\"", "edge_name = \"\""),
            format!("conf/node.toml: edge_name: \"\" {rule}")
        );
        assert_eq!(
            error_of("node_id = \"node-a\"", "node_id = \".\""),
            "conf/node.toml: node_id: \".\" is not a valid name"
        );
        assert_eq!(
            error_of("trust_domain = \"iop.local\"", "trust_domain = \"iop/local\""),
            "conf/node.toml: trust_domain: \"iop/local\" must be 1 to 255 characters of a-z 0-9 . _ -"
        );
    }

    #[test]
    fn edge_addr_is_host_port() {
        let form = "expected host:port, e.g. 127.0.0.1:7443 or edge.example:7443";
        let cases = [
            ("127.0.0.1", format!("\"127.0.0.1\": missing :port; {form}")),
            ("127.0.0.1:0", format!("\"127.0.0.1:0\": \"0\" is not a port (1-65535); {form}")),
            ("127.0.0.1:70000", format!("\"127.0.0.1:70000\": \"70000\" is not a port (1-65535); {form}")),
            (":7443", format!("\":7443\": \"\" is not a host name or IP address; {form}")),
            (
                "https://edge:7443",
                format!("\"https://edge:7443\": \"https://edge\" is not a host name or IP address; {form}"),
            ),
            ("[::1:7443", format!("\"[::1:7443\": unclosed [ in host; {form}")),
            ("[edge]:7443", format!("\"[edge]:7443\": \"edge\" is not an IPv6 address; {form}")),
            ("[::1]7443", format!("\"[::1]7443\": missing :port; {form}")),
        ];
        for (bad, reason) in cases {
            assert_eq!(
                error_of(
                    "edge_addr = \"127.0.0.1:7443\"",
                    &format!("edge_addr = \"{bad}\"")
                ),
                format!("conf/node.toml: edge_addr: {reason}")
            );
        }
    }

    #[test]
    fn edge_addr_forms() {
        let ip = edge_addr("127.0.0.1:7443");
        assert_eq!(ip.socket_addr(), Some("127.0.0.1:7443".parse().unwrap()));
        assert_eq!(
            ip.to_socket_addrs().unwrap().collect::<Vec<_>>(),
            ["127.0.0.1:7443".parse().unwrap()]
        );
        let v6 = edge_addr("[::1]:7443");
        assert_eq!((v6.host(), v6.port()), ("::1", 7443));
        assert_eq!(v6.to_string(), "[::1]:7443");
        assert_eq!(v6.socket_addr(), Some("[::1]:7443".parse().unwrap()));
        let name = edge_addr("edge-1.iop.example:7443");
        assert_eq!((name.host(), name.port()), ("edge-1.iop.example", 7443));
        assert_eq!(name.to_string(), "edge-1.iop.example:7443");
        assert_eq!(name.socket_addr(), None);
    }

    /// `BASE` with `edge_addr` set to `value` (TOML).
    fn with_edge_addr(value: &str) -> String {
        variant(
            "edge_addr = \"127.0.0.1:7443\"",
            &format!("edge_addr = {value}"),
        )
    }

    /// `BASE` with `edge_name` set to `value` (TOML).
    fn with_edge_name(value: &str) -> String {
        variant("edge_name = \"edge-1\"", &format!("edge_name = {value}"))
    }

    #[test]
    fn edge_addr_takes_a_list_of_host_ports() {
        let config = parse(&with_edge_addr(
            "[\"127.0.0.1:7443\", \"edge-2.iop.example:7443\", \"[::1]:7444\", \"127.0.0.1:7443\"]",
        ))
        .unwrap();
        let entries: Vec<String> = config
            .edge_addr
            .entries()
            .iter()
            .map(ToString::to_string)
            .collect();
        // As written, the repeated entry too (the dial order drops it).
        assert_eq!(
            entries,
            [
                "127.0.0.1:7443",
                "edge-2.iop.example:7443",
                "[::1]:7444",
                "127.0.0.1:7443"
            ]
        );
        assert_eq!(
            config.edge_addr.to_string(),
            "127.0.0.1:7443, edge-2.iop.example:7443, [::1]:7444, 127.0.0.1:7443"
        );
        // A one-entry array is the string form.
        assert_eq!(
            parse(&with_edge_addr("[\"127.0.0.1:7443\"]")).unwrap(),
            parse(BASE).unwrap()
        );
        assert_eq!(parse(BASE).unwrap().edge_addr.to_string(), "127.0.0.1:7443");
    }

    #[test]
    fn edge_addr_lists_are_checked() {
        let form = "expected host:port, e.g. 127.0.0.1:7443 or edge.example:7443";
        assert_eq!(
            error(&with_edge_addr("[]")),
            "conf/node.toml: edge_addr: list at least one Edge address (host:port)"
        );
        assert_eq!(
            error(&with_edge_addr("[\"127.0.0.1:7443\", \"edge-2\"]")),
            format!("conf/node.toml: edge_addr: \"edge-2\": missing :port; {form}")
        );
        let seventeen: Vec<String> = (1..=17).map(|i| format!("\"10.0.0.{i}:7443\"")).collect();
        assert_eq!(
            error(&with_edge_addr(&format!("[{}]", seventeen.join(", ")))),
            "conf/node.toml: edge_addr: at most 16 addresses (got 17)"
        );
        let sixteen = &seventeen[..16];
        let config = parse(&with_edge_addr(&format!("[{}]", sixteen.join(", ")))).unwrap();
        assert_eq!(config.edge_addr.entries().len(), MAX_EDGE_ADDRS);
        assert_eq!(
            error(&with_edge_addr("7443")),
            "conf/node.toml: edge_addr: invalid type: integer `7443`, expected a string or an \
             array of strings (line 3, column 13)"
        );
        assert_eq!(
            error(&with_edge_addr("[\"127.0.0.1:7443\", 7443]")),
            "conf/node.toml: edge_addr[1]: invalid type: integer `7443`, expected a string \
             (line 3, column 32)"
        );
    }

    // CONTRACT: T2 — the accepted Edge identity names: one or a list.
    #[test]
    fn edge_name_takes_a_list_of_names() {
        let config = parse(&with_edge_name("[\"edge-1\", \"edge-2\", \"edge-1\"]")).unwrap();
        assert_eq!(config.edge_name.names(), ["edge-1", "edge-2"]);
        assert_eq!(config.edge_name.first(), "edge-1");
        assert!(config.edge_name.contains("edge-2") && !config.edge_name.contains("edge-3"));
        assert_eq!(config.edge_name.to_string(), "edge-1, edge-2");
        assert_eq!(parse(BASE).unwrap().edge_name, EdgeNames::from("edge-1"));
        assert_eq!(
            parse(&with_edge_name("[\"edge-1\"]")).unwrap(),
            parse(BASE).unwrap()
        );
        let rule = "must be 1 to 128 characters of A-Z a-z 0-9 . _ -";
        assert_eq!(
            error(&with_edge_name("[]")),
            "conf/node.toml: edge_name: list at least one Edge identity name"
        );
        assert_eq!(
            error(&with_edge_name("[\"edge-1\", \"edge 2\"]")),
            format!("conf/node.toml: edge_name: \"edge 2\" {rule}")
        );
        let seventeen: Vec<String> = (1..=17).map(|i| format!("\"edge-{i}\"")).collect();
        assert_eq!(
            error(&with_edge_name(&format!("[{}]", seventeen.join(", ")))),
            "conf/node.toml: edge_name: at most 16 names (got 17)"
        );
        assert_eq!(
            error(&with_edge_name("{ name = \"edge-1\" }")),
            "conf/node.toml: edge_name: invalid type: map, expected a string or an array of \
             strings (line 4, column 13)"
        );
    }

    /// Issuer public keys in config form, from seeds.
    fn issuer_keys_text(seeds: &[u8]) -> Vec<String> {
        seeds
            .iter()
            .map(|&seed| {
                let key = ed25519_dalek::SigningKey::from_bytes(&[seed; 32]).verifying_key();
                iop_engine::keys::encode_issuer_public_key(&key)
            })
            .collect()
    }

    fn quoted_list(items: &[String]) -> String {
        let quoted: Vec<String> = items.iter().map(|i| format!("\"{i}\"")).collect();
        format!("[{}]", quoted.join(", "))
    }

    // CONTRACT: C2 — a managed Node trusts the lease issuers of several
    // Edges: issuer_public_key and issuer_public_keys together, in that
    // order, without repeats.
    #[test]
    fn credentials_trust_several_issuer_keys() {
        let keys = issuer_keys_text(&[5, 6, 7]);
        let decoded: Vec<VerifyingKey> = keys
            .iter()
            .map(|k| decode_issuer_public_key(k).unwrap())
            .collect();
        let issuers = |lines: &str| {
            parse(&with_credentials(&format!(
                "recipient_key = \"k\"\n{lines}"
            )))
            .unwrap()
            .credentials
            .unwrap()
            .issuer_public_keys
        };
        assert_eq!(
            issuers(&format!("issuer_public_keys = {}", quoted_list(&keys[1..]))),
            decoded[1..]
        );
        assert_eq!(
            issuers(&format!(
                "issuer_public_key = \"{}\"\nissuer_public_keys = {}",
                keys[0],
                quoted_list(&[keys[1].clone(), keys[0].clone(), keys[2].clone()])
            )),
            decoded
        );
        assert_eq!(
            issuers(&format!("issuer_public_keys = \"{}\"", keys[2])),
            decoded[2..]
        );
    }

    #[test]
    fn issuer_key_lists_are_checked() {
        let keys = issuer_keys_text(&[40, 41]);
        let with = |lines: &str| {
            error(&with_credentials(&format!(
                "recipient_key = \"k\"\n{lines}"
            )))
        };
        // Neither key: the error of the one-key form, unchanged.
        assert_eq!(
            with("clock_skew_ms = 0"),
            "conf/node.toml: credentials.issuer_public_key: required key is missing (line 11, \
             column 1)"
        );
        assert_eq!(
            with("issuer_public_keys = []"),
            "conf/node.toml: credentials.issuer_public_keys: list at least one key \
             (ed25519:<64 hex digits>), or remove the key"
        );
        assert_eq!(
            with(&format!(
                "issuer_public_keys = [\"{}\", \"ed25519:00\"]",
                keys[0]
            )),
            "conf/node.toml: credentials.issuer_public_keys: \"ed25519:00\": invalid public \
             key: expected ed25519:<64 hex digits>"
        );
        let seventeen = issuer_keys_text(&(1..=17).collect::<Vec<u8>>());
        assert_eq!(
            with(&format!("issuer_public_keys = {}", quoted_list(&seventeen))),
            "conf/node.toml: credentials.issuer_public_keys: at most 16 issuer keys in all \
             (issuer_public_key counts too)"
        );
        let sixteen = &seventeen[..16];
        assert_eq!(
            with(&format!(
                "issuer_public_key = \"{}\"\nissuer_public_keys = {}",
                keys[1],
                quoted_list(sixteen)
            )),
            "conf/node.toml: credentials.issuer_public_keys: at most 16 issuer keys in all \
             (issuer_public_key counts too)"
        );
        let config = parse(&with_credentials(&format!(
            "recipient_key = \"k\"\nissuer_public_keys = {}",
            quoted_list(sixteen)
        )))
        .unwrap();
        assert_eq!(
            config.credentials.map(|c| c.issuer_public_keys.len()),
            Some(MAX_ISSUER_KEYS)
        );
    }

    #[test]
    fn tls_is_required_unless_insecure() {
        assert_eq!(
            error_of(TLS, ""),
            "conf/node.toml: tls: required unless insecure_plaintext = true"
        );
        assert_eq!(
            error_of("key = \"certs/node-a-key.pem\"", "key = \"\""),
            "conf/node.toml: tls.key: must not be empty"
        );
        // CONTRACT: T5 — plain TCP only behind the explicit flag; no TLS files then.
        let config = parse(&variant(TLS, "insecure_plaintext = true\n")).unwrap();
        assert!(config.insecure_plaintext);
        assert_eq!(config.tls, None);
        assert_eq!(config.validate_files(), Ok(()));
    }

    #[test]
    fn tls_paths_resolve_against_the_config_directory() {
        let config = parse(&variant(
            "ca = \"certs/ca.pem\"",
            "ca = \"/etc/iop/ca.pem\"",
        ))
        .unwrap();
        assert_eq!(
            config.tls,
            Some(TlsFiles {
                ca: PathBuf::from("/etc/iop/ca.pem"),
                cert: PathBuf::from("conf/certs/node-a.pem"),
                key: PathBuf::from("conf/certs/node-a-key.pem"),
            })
        );
    }

    #[test]
    fn unreadable_credentials_are_config_errors() {
        // CONTRACT: S3 — an unreadable cert/key is a local credential error
        // (a ConfigError, exit 1), reported with its key and path.
        let config = NodeConfig::parse(BASE, "/nonexistent-iop/node.toml").unwrap();
        assert_eq!(
            config.validate_files().unwrap_err().to_string(),
            "/nonexistent-iop/node.toml: tls.ca: cannot read /nonexistent-iop/certs/ca.pem: \
             No such file or directory (os error 2)"
        );
        let text = variant("key = \"certs/node-a-key.pem\"", "key = \"certs\"");
        let config = NodeConfig::parse(&text, fixture("node.toml")).unwrap();
        assert_eq!(
            config.validate_files().unwrap_err().to_string(),
            format!(
                "{}: tls.key: cannot read {}: not a regular file",
                fixture("node.toml").display(),
                fixture("certs").display()
            )
        );
    }

    #[test]
    fn load_reads_parses_and_checks_files() {
        assert_eq!(
            NodeConfig::load("/nonexistent-iop/node.toml").unwrap_err().to_string(),
            "/nonexistent-iop/node.toml: -: cannot read config file: No such file or directory (os error 2)"
        );
        let config = NodeConfig::load(fixture("node.toml")).unwrap();
        assert_eq!(config.source, fixture("node.toml"));
        assert_eq!(config.node_id, "node-a");
        assert_eq!(config.validate_files(), Ok(()));
    }

    #[test]
    fn error_accessors() {
        let e = parse(&with_reconnect("max_attempts = -2")).unwrap_err();
        assert_eq!(e.file(), "conf/node.toml");
        assert_eq!(e.key(), "reconnect.max_attempts");
        assert_eq!(e.reason(), "must be 0 (unlimited) or positive (got -2)");
    }

    #[test]
    fn metrics_textfile_resolves_against_the_file_and_bounds_its_interval() {
        let path = Path::new("/etc/iop/node.toml");
        let with = |lines: &str| NodeConfig::parse(&format!("{BASE}\n[metrics]\n{lines}\n"), path);
        let spec = with("textfile = \"iop_node.prom\"\ntextfile_interval_sec = 30")
            .unwrap()
            .metrics;
        assert_eq!(spec.textfile, Some(PathBuf::from("/etc/iop/iop_node.prom")));
        assert_eq!(spec.textfile_interval, Duration::from_secs(30));
        assert_eq!(
            NodeConfig::parse(BASE, path).unwrap().metrics,
            MetricsSpec::default()
        );
        let e = with("textfile_interval_sec = 0").unwrap_err().to_string();
        assert_eq!(
            e,
            "/etc/iop/node.toml: metrics.textfile_interval_sec: must be between 1 and 3600 (got 0)"
        );
        let e = with("textfile = \"\"").unwrap_err().to_string();
        assert!(
            e.starts_with("/etc/iop/node.toml: metrics.textfile: "),
            "{e}"
        );
        assert!(with("texfile = \"x\"").is_err());
    }
}
