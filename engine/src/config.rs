//! Configuration-file plumbing shared by `edge-bin` and `node-bin` (S3).
//!
//! ```text
//! path ──read_config_file──► text
//!     text ──parse_toml (unknown keys rejected, key path, line and column)──► the binary's Raw* structs
//!     Raw* ──check_name / check_trust_domain / split_host_port / resolve_path──► checked values
//!     RawTls::resolve ──► TlsFiles ──validate_files──► the PEM files exist and are readable
//! ```
//!
//! Each binary owns its file's schema and its validation; this module owns
//! what both do the same way. Every failure is a [`ConfigError`] that
//! displays as `<file>: <key>: <reason>` (`-` when no key applies); the
//! `check_*` helpers and [`split_host_port`] return the bare reason, which the
//! caller pairs with the key it checked. The binaries print the error and
//! exit 1 (S3).

use std::fs::{File, Metadata};
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Deserialize;

pub use crate::tls::MAX_TRUST_DOMAIN_BYTES;

/// Longest accepted identity name (edge name, node id, adapter name,
/// provider id, slot name, principal).
pub const MAX_NAME_BYTES: usize = 128;

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

/// A configuration file that cannot be used: which file, which key, why.
///
/// Displays as `<file>: <key>: <reason>`; `key` is `-` when no key applies.
/// Every `ConfigError` ends the binary with exit code 1 (S3).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {key}: {reason}")]
pub struct ConfigError {
    file: String,
    key: String,
    reason: String,
}

impl ConfigError {
    /// An error about `key` (the dotted key path, or `-`) of the
    /// configuration file `file`.
    pub fn new(file: &Path, key: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            file: file.display().to_string(),
            key: key.into(),
            reason: reason.into(),
        }
    }

    /// The configuration file, as it was named to `load`/`parse`.
    pub fn file(&self) -> &str {
        &self.file
    }

    /// The dotted key path at fault, or `-`.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// What is wrong.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

// ---------------------------------------------------------------------------
// Reading and parsing
// ---------------------------------------------------------------------------

/// Reads the configuration file at `path` as text.
pub fn read_config_file(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path)
        .map_err(|e| ConfigError::new(path, "-", format!("cannot read config file: {e}")))
}

/// Deserializes `text` (the contents of `file`), turning a syntax or schema
/// error into a [`ConfigError`] with the key path and the line and column.
///
/// A missing key is reported under its own path with the reason `required
/// key is missing`; an error at the top level of the file has the key `-`.
pub fn parse_toml<T: DeserializeOwned>(text: &str, file: &Path) -> Result<T, ConfigError> {
    let deserializer = toml::Deserializer::parse(text)
        .map_err(|e| ConfigError::new(file, "-", with_location(e.message(), e.span(), text)))?;
    serde_path_to_error::deserialize(deserializer).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.inner();
        let message = inner.message();
        let (key, message) = match missing_field(message) {
            Some(field) if path == "." => (field.to_owned(), "required key is missing"),
            Some(field) => (format!("{path}.{field}"), "required key is missing"),
            None if path == "." => ("-".to_owned(), message),
            None => (path, message),
        };
        ConfigError::new(file, key, with_location(message, inner.span(), text))
    })
}

/// The field of serde's "missing field `x`" message.
fn missing_field(message: &str) -> Option<&str> {
    message.strip_prefix("missing field `")?.strip_suffix('`')
}

/// `message (line L, column C)`, 1-based, when the span is known.
fn with_location(message: &str, span: Option<Range<usize>>, text: &str) -> String {
    let message = message.trim().replace('\n', "; ");
    match span {
        Some(span) => {
            let before = text.get(..span.start).unwrap_or(text);
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            format!("{message} (line {line}, column {column})")
        }
        None => message,
    }
}

// ---------------------------------------------------------------------------
// Values
// ---------------------------------------------------------------------------

/// `value` (the value of `key`) resolved against the directory of the
/// configuration file `file`; must not be empty. An absolute `value` stays
/// as it is.
pub fn resolve_path(file: &Path, key: &str, value: &str) -> Result<PathBuf, ConfigError> {
    if value.is_empty() {
        return Err(ConfigError::new(file, key, "must not be empty"));
    }
    Ok(file.parent().unwrap_or(Path::new("")).join(value))
}

/// An identity name (edge name, node id, adapter name, provider id, …): 1 to
/// [`MAX_NAME_BYTES`] characters of `[A-Za-z0-9._-]`, not `.` or `..`. It
/// goes into a SPIFFE URI path segment or a `"<node id>/<provider id>"`
/// reference. The error is the reason.
pub fn check_name(name: &str) -> Result<(), String> {
    let valid_chars = name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if name.is_empty() || name.len() > MAX_NAME_BYTES || !valid_chars {
        return Err(format!(
            "{name:?} must be 1 to {MAX_NAME_BYTES} characters of A-Z a-z 0-9 . _ -"
        ));
    }
    if name == "." || name == ".." {
        return Err(format!("{name:?} is not a valid name"));
    }
    Ok(())
}

/// A SPIFFE trust domain: 1 to [`MAX_TRUST_DOMAIN_BYTES`] lowercase letters,
/// digits, `.`, `_`, `-`. The error is the reason.
pub fn check_trust_domain(domain: &str) -> Result<(), String> {
    let valid_chars = domain
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-'));
    if domain.is_empty() || domain.len() > MAX_TRUST_DOMAIN_BYTES || !valid_chars {
        return Err(format!(
            "{domain:?} must be 1 to {MAX_TRUST_DOMAIN_BYTES} characters of a-z 0-9 . _ -"
        ));
    }
    Ok(())
}

/// Splits `host:port` / `[v6]:port`; the host is an IP address or a DNS name
/// (returned without brackets), the port 1 to 65535. The error is the reason.
pub fn split_host_port(authority: &str) -> Result<(String, u16), String> {
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let (v6, after) = rest.split_once(']').ok_or("unclosed [ in host")?;
        v6.parse::<std::net::Ipv6Addr>()
            .map_err(|_| format!("{v6:?} is not an IPv6 address"))?;
        let port = after.strip_prefix(':').ok_or("missing :port")?;
        (v6, port)
    } else {
        let (host, port) = authority.rsplit_once(':').ok_or("missing :port")?;
        let valid_host = host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-'));
        if host.is_empty() || !valid_host {
            return Err(format!("{host:?} is not a host name or IP address"));
        }
        (host, port)
    };
    match port.parse::<u16>() {
        Ok(port) if port != 0 => Ok((host.to_owned(), port)),
        _ => Err(format!("{port:?} is not a port (1-65535)")),
    }
}

// ---------------------------------------------------------------------------
// Files named by a configuration
// ---------------------------------------------------------------------------

/// Opens `path` for reading and checks that it is a regular file. The error
/// is the reason (`cannot read <path>: …`).
pub fn open_regular_file(path: &Path) -> Result<(File, Metadata), String> {
    let file = File::open(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let metadata = file
        .metadata()
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if !metadata.is_file() {
        return Err(format!(
            "cannot read {}: not a regular file",
            path.display()
        ));
    }
    Ok((file, metadata))
}

/// The `[tls]` table as written: three PEM file paths, relative to the
/// configuration file's directory unless absolute. (The name shows in serde's
/// type errors: `expected struct RawTls`.)
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    /// `ca`: the CA certificate(s).
    pub ca: String,
    /// `cert`: our certificate chain.
    pub cert: String,
    /// `key`: our private key.
    pub key: String,
}

impl RawTls {
    /// The three paths resolved against the directory of `file` (the
    /// configuration file); an empty one is an error under `tls.<name>`.
    pub fn resolve(&self, file: &Path) -> Result<TlsFiles, ConfigError> {
        Ok(TlsFiles {
            ca: resolve_path(file, "tls.ca", &self.ca)?,
            cert: resolve_path(file, "tls.cert", &self.cert)?,
            key: resolve_path(file, "tls.key", &self.key)?,
        })
    }
}

/// The PEM files of a TLS identity, resolved against the config file's
/// directory. [`crate::tls::TlsFiles`] is the same three paths in the form
/// [`crate::tls::TlsMaterial::from_files`] loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The CA certificate(s) that sign every peer and us (T2).
    pub ca: PathBuf,
    /// Our certificate chain.
    pub cert: PathBuf,
    /// Our private key.
    pub key: PathBuf,
}

impl TlsFiles {
    /// Checks that every file exists, is a regular file and can be opened for
    /// reading. The error names `source` (the configuration file), the key
    /// (`tls.cert`) and the resolved path; like every config error it is a
    /// local credential error that ends the process with exit 1 (S3).
    pub fn validate_files(&self, source: &Path) -> Result<(), ConfigError> {
        for (key, path) in [
            ("tls.ca", &self.ca),
            ("tls.cert", &self.cert),
            ("tls.key", &self.key),
        ] {
            open_regular_file(path).map_err(|why| ConfigError::new(source, key, why))?;
        }
        Ok(())
    }
}

impl From<&TlsFiles> for crate::tls::TlsFiles {
    fn from(files: &TlsFiles) -> Self {
        Self {
            ca_path: files.ca.clone(),
            cert_path: files.cert.clone(),
            key_path: files.key.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Doc {
        name: String,
        tls: Option<RawTls>,
        #[serde(default)]
        limits: BTreeMap<String, u32>,
    }

    fn parse_error(text: &str) -> String {
        match parse_toml::<Doc>(text, Path::new("conf/x.toml")) {
            Ok(doc) => panic!("expected an error, parsed {doc:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn error_displays_file_key_reason() {
        // CONTRACT: S3 — a config error names the file, the key and the reason.
        let e = ConfigError::new(Path::new("/etc/iop/edge.toml"), "edge.name", "bad");
        assert_eq!(e.to_string(), "/etc/iop/edge.toml: edge.name: bad");
        assert_eq!(
            (e.file(), e.key(), e.reason()),
            ("/etc/iop/edge.toml", "edge.name", "bad")
        );
    }

    #[test]
    fn toml_parses_into_the_callers_schema() {
        let doc: Doc = parse_toml(
            "name = \"a\"\n[tls]\nca = \"c\"\ncert = \"d\"\nkey = \"e\"\n[limits]\nrps = 7\n",
            Path::new("conf/x.toml"),
        )
        .unwrap();
        assert_eq!(doc.name, "a");
        let tls = doc.tls.unwrap();
        assert_eq!(
            (tls.ca.as_str(), tls.cert.as_str(), tls.key.as_str()),
            ("c", "d", "e")
        );
        assert_eq!(doc.limits, BTreeMap::from([("rps".to_owned(), 7)]));
    }

    #[test]
    fn toml_errors_carry_the_key_path_and_location() {
        assert_eq!(
            parse_error("name = \"a"),
            "conf/x.toml: -: invalid basic string, expected `\"` (line 1, column 10)"
        );
        assert_eq!(
            parse_error("[limits]\nrps = 1\n"),
            "conf/x.toml: name: required key is missing (line 1, column 1)"
        );
        assert_eq!(
            parse_error("name = \"a\"\n[tls]\nca = \"c\"\ncert = \"d\"\n"),
            "conf/x.toml: tls.key: required key is missing (line 2, column 1)"
        );
        assert_eq!(
            parse_error("name = \"a\"\n[tls]\nca = \"c\"\ncert = \"d\"\nkey = \"e\"\npin = 1\n"),
            "conf/x.toml: tls.pin: unknown field `pin`, expected one of `ca`, `cert`, `key` \
             (line 6, column 1)"
        );
        assert_eq!(
            parse_error("name = \"a\"\ntls = 5\n"),
            "conf/x.toml: tls: invalid type: integer `5`, expected struct RawTls (line 2, column 7)"
        );
        assert_eq!(
            parse_error("name = \"a\"\n[limits]\nrps = -1\n"),
            "conf/x.toml: limits.rps: invalid value: integer `-1`, expected u32 (line 3, column 7)"
        );
        assert_eq!(
            parse_error("name = \"a\"\ncolor = 1\n"),
            "conf/x.toml: color: unknown field `color`, expected one of `name`, `tls`, `limits` \
             (line 2, column 1)"
        );
    }

    #[test]
    fn read_config_file_names_the_file() {
        assert_eq!(
            read_config_file(Path::new("/nonexistent-iop/x.toml"))
                .unwrap_err()
                .to_string(),
            "/nonexistent-iop/x.toml: -: cannot read config file: No such file or directory (os error 2)"
        );
    }

    #[test]
    fn names() {
        let rule = "must be 1 to 128 characters of A-Z a-z 0-9 . _ -";
        assert_eq!(check_name("node-a_1.x"), Ok(()));
        assert_eq!(check_name(&"n".repeat(128)), Ok(()));
        let long = "n".repeat(129);
        assert_eq!(check_name(&long), Err(format!("{long:?} {rule}")));
        assert_eq!(check_name(""), Err(format!("\"\" {rule}")));
        assert_eq!(check_name("a/b"), Err(format!("\"a/b\" {rule}")));
        assert_eq!(
            check_name(".."),
            Err("\"..\" is not a valid name".to_owned())
        );
    }

    #[test]
    fn trust_domains() {
        let rule = "must be 1 to 255 characters of a-z 0-9 . _ -";
        assert_eq!(check_trust_domain("iop.local"), Ok(()));
        assert_eq!(check_trust_domain(&"d".repeat(255)), Ok(()));
        assert_eq!(check_trust_domain("Iop"), Err(format!("\"Iop\" {rule}")));
        assert_eq!(check_trust_domain(""), Err(format!("\"\" {rule}")));
    }

    #[test]
    fn host_port_forms() {
        assert_eq!(
            split_host_port("127.0.0.1:80"),
            Ok(("127.0.0.1".to_owned(), 80))
        );
        assert_eq!(split_host_port("[::1]:7443"), Ok(("::1".to_owned(), 7443)));
        assert_eq!(
            split_host_port("edge-1.example:1"),
            Ok(("edge-1.example".to_owned(), 1))
        );
        let cases = [
            ("h", "missing :port"),
            ("[::1]7443", "missing :port"),
            ("[::1:7443", "unclosed [ in host"),
            ("[h]:1", "\"h\" is not an IPv6 address"),
            (":1", "\"\" is not a host name or IP address"),
            ("a_b:1", "\"a_b\" is not a host name or IP address"),
            ("h:0", "\"0\" is not a port (1-65535)"),
            ("h:65536", "\"65536\" is not a port (1-65535)"),
        ];
        for (text, reason) in cases {
            assert_eq!(split_host_port(text), Err(reason.to_owned()), "{text}");
        }
    }

    #[test]
    fn tls_paths_resolve_against_the_config_directory() {
        let raw = RawTls {
            ca: "/etc/iop/ca.pem".into(),
            cert: "certs/a.pem".into(),
            key: "a-key.pem".into(),
        };
        assert_eq!(
            raw.resolve(Path::new("conf/x.toml")),
            Ok(TlsFiles {
                ca: PathBuf::from("/etc/iop/ca.pem"),
                cert: PathBuf::from("conf/certs/a.pem"),
                key: PathBuf::from("conf/a-key.pem"),
            })
        );
        assert_eq!(
            raw.resolve(Path::new("x.toml")).map(|f| f.cert),
            Ok(PathBuf::from("certs/a.pem"))
        );
        let empty = RawTls {
            cert: String::new(),
            ..raw
        };
        assert_eq!(
            empty
                .resolve(Path::new("conf/x.toml"))
                .unwrap_err()
                .to_string(),
            "conf/x.toml: tls.cert: must not be empty"
        );
    }

    #[test]
    fn tls_files_must_be_readable_regular_files() {
        // CONTRACT: S3 — an unreadable cert/key is a config error naming the
        // key and the path.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let manifest = dir.join("Cargo.toml");
        let files = TlsFiles {
            ca: manifest.clone(),
            cert: manifest.clone(),
            key: manifest.clone(),
        };
        let source = Path::new("conf/x.toml");
        assert_eq!(files.validate_files(source), Ok(()));
        let missing = TlsFiles {
            cert: PathBuf::from("/nonexistent-iop/a.pem"),
            ..files.clone()
        };
        assert_eq!(
            missing.validate_files(source).unwrap_err().to_string(),
            "conf/x.toml: tls.cert: cannot read /nonexistent-iop/a.pem: No such file or directory \
             (os error 2)"
        );
        let directory = TlsFiles {
            key: dir.to_path_buf(),
            ..files.clone()
        };
        assert_eq!(
            directory.validate_files(source).unwrap_err().to_string(),
            format!(
                "conf/x.toml: tls.key: cannot read {}: not a regular file",
                dir.display()
            )
        );
        assert_eq!(
            crate::tls::TlsFiles::from(&missing),
            crate::tls::TlsFiles {
                ca_path: manifest.clone(),
                cert_path: PathBuf::from("/nonexistent-iop/a.pem"),
                key_path: manifest,
            }
        );
    }
}
