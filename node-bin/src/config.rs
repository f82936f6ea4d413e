//! The Node configuration file (`node-bin --config node.toml`).
//!
//! ```text
//! node.toml ──read──► text ──toml + serde (unknown keys rejected, key path kept)──► RawNodeFile
//!     RawNodeFile ──validate (names, edge address, S2 reconnect policy)──► NodeConfig
//!     NodeConfig::validate_files ──► the TLS files exist and are readable (S3)
//! ```
//!
//! The Node's adapters are not configured here: the Edge sends them in
//! `RegisterResponse.config` (R2, U4). This file only says who we are, where
//! the Edge is, who it must be (T2), how to reconnect (S2) and, optionally,
//! the credential plane (`[credentials]`, C2): our recipient key file, the
//! Edge issuer's public key, the allowed clock skew and, per credential
//! slot, the provider origins its secret may reach. With it the Node is
//! *managed*: every tunnel must carry a valid credential lease (C3).
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
    /// Where the Edge's Node listener is.
    pub edge_addr: EdgeAddr,
    /// The Edge identity name we require: `spiffe://<trust_domain>/edge/<edge_name>` (T2).
    pub edge_name: String,
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
}

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
    /// The Edge issuer's Ed25519 public key (`ed25519:<hex>`).
    pub issuer_public_key: VerifyingKey,
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNodeFile {
    node_id: String,
    trust_domain: String,
    edge_addr: String,
    edge_name: String,
    #[serde(default)]
    insecure_plaintext: bool,
    tls: Option<RawTls>,
    #[serde(default)]
    reconnect: RawReconnect,
    credentials: Option<RawCredentials>,
    drain_grace_ms: Option<i64>,
    #[serde(default)]
    metrics: RawMetrics,
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
    issuer_public_key: String,
    clock_skew_ms: Option<i64>,
    #[serde(default)]
    allowed_origins: BTreeMap<String, Vec<String>>,
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
    let edge_addr = EdgeAddr::parse(&raw.edge_addr).map_err(|why| err("edge_addr", why))?;
    check_name(&raw.edge_name).map_err(|why| err("edge_name", why))?;
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
        Some(raw) => Some(credentials(raw, file)?),
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
        edge_name: raw.edge_name,
        insecure_plaintext: raw.insecure_plaintext,
        tls,
        reconnect,
        reconnect_jitter,
        credentials,
        drain_grace_ms,
        metrics: metrics(raw.metrics, file)?,
    })
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
    let issuer_public_key = decode_issuer_public_key(&raw.issuer_public_key)
        .map_err(|e| err("credentials.issuer_public_key", e.to_string()))?;
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
        issuer_public_key,
        clock_skew_ms,
        allowed_origins,
    })
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
            edge_addr: edge_addr("127.0.0.1:7443"),
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
                issuer_public_key: decode_issuer_public_key(&issuer).unwrap(),
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
             `recipient_key`, `issuer_public_key`, `clock_skew_ms`, `allowed_origins` (line 14, \
             column 1)"
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
             `drain_grace_ms`, `metrics` (line 5, column 1)"
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
