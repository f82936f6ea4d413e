//! Typed TLS errors.
//!
//! monoio-rustls reports every handshake failure as its own `TlsError`, whose
//! `Display` is just "io error"; the rustls cause hides inside an
//! `io::Error`. [`TlsError`] digs it out so logs say what happened.

use std::io;
use std::path::PathBuf;

use super::identity::{IdentityRejection, WorkloadIdError};

/// Why a PEM file or the certificate in it cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigProblem {
    /// The file does not exist.
    #[error("file not found")]
    Missing,
    /// The file exists but could not be read.
    #[error("unreadable: {detail}")]
    Unreadable {
        /// The OS error.
        detail: String,
    },
    /// The file is not valid PEM.
    #[error("malformed PEM: {detail}")]
    Malformed {
        /// The PEM parser's message.
        detail: String,
    },
    /// The file holds no `CERTIFICATE` block.
    #[error("no certificate found")]
    NoCertificate,
    /// The file holds no private key block.
    #[error("no private key found")]
    NoPrivateKey,
    /// A `CERTIFICATE` block does not hold a certificate that can be used
    /// (bad DER, unsupported key type).
    #[error("not a usable certificate: {detail}")]
    UnusableCertificate {
        /// rustls' or webpki's message.
        detail: String,
    },
    /// The key is not the private key of the configured certificate.
    #[error("private key does not match the certificate")]
    KeyMismatch,
    /// The key cannot be loaded by the crypto provider.
    #[error("bad private key: {detail}")]
    BadKey {
        /// The crypto provider's message.
        detail: String,
    },
    /// A CA certificate cannot be used as a trust anchor.
    #[error("bad CA certificate: {detail}")]
    BadCertificate {
        /// webpki's message.
        detail: String,
    },
    /// The certificate's own identity does not fit this side (for example an
    /// edge certificate configured on a Node, or another trust domain).
    #[error("certificate identity unusable here: {rejection}")]
    OwnIdentity {
        /// What is wrong with it.
        rejection: IdentityRejection,
    },
}

/// A TLS setup or handshake failure.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The socket failed or the peer closed it during the handshake.
    #[error("TLS I/O error: {0}")]
    Io(#[source] io::Error),
    /// rustls failed the handshake: the chain did not verify (unknown CA,
    /// expired, not yet valid), the peer sent an alert, or the protocols did
    /// not match (TLS 1.3 only).
    #[error("TLS handshake failed: {0}")]
    Handshake(#[source] rustls::Error),
    /// The peer's certificate chains to the CA but its workload identity is
    /// not the one this side expects (T2).
    #[error("peer identity rejected: {reason}")]
    IdentityRejected {
        /// What was wrong with the identity.
        reason: IdentityRejection,
    },
    /// A PEM file could not be used.
    #[error("{}: {reason}", file.display())]
    Config {
        /// The file (or `<ca pem>`/`<cert pem>`/`<key pem>` for in-memory PEM).
        file: PathBuf,
        /// What is wrong with it.
        reason: ConfigProblem,
    },
    /// An identity setting (trust domain, expected name) is not valid.
    #[error("setting {setting}: {error}")]
    BadSetting {
        /// The setting's name, such as `trust_domain`.
        setting: &'static str,
        /// The rule it breaks.
        error: WorkloadIdError,
    },
}

impl TlsError {
    /// Classifies an I/O error from a handshake: a rustls failure becomes
    /// [`TlsError::Handshake`], anything else stays [`TlsError::Io`].
    pub fn from_io(err: io::Error) -> Self {
        match rustls_cause(&err) {
            Some(cause) => TlsError::Handshake(cause.clone()),
            None => TlsError::Io(err),
        }
    }

    /// Converts monoio-rustls' error, whose `Display` ("io error") hides the
    /// cause; for callers that drive monoio-rustls directly.
    pub fn from_monoio(err: monoio_rustls::TlsError) -> Self {
        match err {
            monoio_rustls::TlsError::Io(e) => TlsError::from_io(e),
            monoio_rustls::TlsError::Rustls(e) => TlsError::Handshake(e),
        }
    }
}

/// The rustls error inside an `io::Error` from a monoio-rustls stream, if any.
///
/// Reads and writes on an established stream report TLS failures (such as a
/// `access_denied` alert a TLS 1.3 server sends after the client's handshake
/// already returned) as `io::ErrorKind::InvalidData` wrapping a
/// [`rustls::Error`]; log that, not the bare `io::Error`.
pub fn rustls_cause(err: &io::Error) -> Option<&rustls::Error> {
    err.get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
}

/// The name of a TLS alert as RFC 8446 spells it (`access_denied`,
/// `bad_certificate`, `unknown_ca`, ...), or `alert_<code>` for one rustls
/// does not know.
pub fn alert_name(alert: rustls::AlertDescription) -> String {
    let Some(camel) = alert.as_str() else {
        return format!("alert_{}", u8::from(alert));
    };
    // CamelCase to snake_case, an acronym staying one word (`UnknownCA`,
    // `UnknownPSKIdentity`).
    let chars: Vec<char> = camel.chars().collect();
    let mut name = String::with_capacity(camel.len() + 4);
    for (i, &c) in chars.iter().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            let after_lower = chars[i - 1].is_ascii_lowercase();
            let acronym_ends = chars[i - 1].is_ascii_uppercase()
                && chars.get(i + 1).is_some_and(char::is_ascii_lowercase);
            if after_lower || acronym_ends {
                name.push('_');
            }
        }
        name.push(c.to_ascii_lowercase());
    }
    name
}

#[cfg(test)]
mod tests {
    use rustls::AlertDescription;

    use super::alert_name;

    #[test]
    fn alert_names_are_the_rfc_names() {
        assert_eq!(alert_name(AlertDescription::AccessDenied), "access_denied");
        assert_eq!(
            alert_name(AlertDescription::BadCertificate),
            "bad_certificate"
        );
        assert_eq!(alert_name(AlertDescription::UnknownCA), "unknown_ca");
        assert_eq!(
            alert_name(AlertDescription::UnknownPSKIdentity),
            "unknown_psk_identity"
        );
        assert_eq!(alert_name(AlertDescription::BadRecordMac), "bad_record_mac");
        assert_eq!(
            alert_name(AlertDescription::CertificateExpired),
            "certificate_expired"
        );
        assert_eq!(alert_name(AlertDescription::from(0xfe)), "alert_254");
    }
}
