//! Opening a connection to a provider: where it goes ([`Target`]: an
//! adapter's base URL and TLS client), the dial itself ([`connect`]: TCP,
//! then TLS for `https`), and why an exchange with a provider failed
//! ([`SendError`], with its W6 failure code). Provider calls dial through
//! their core's keep-alive pool; health probes ([`super::probe`]) dial a
//! fresh connection each time.

use std::io;

use iop_engine::http::{self, HttpError, Url};
use iop_engine::tls::{MaybeTls, UpstreamStream, UpstreamTls, UpstreamTlsError};

use crate::codes;

/// Where a provider connection goes: its base URL and, for `https`, the
/// adapter's TLS client (which also decides how the certificate is
/// verified). A plain `&Url` converts into a target without TLS.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// The base URL (scheme, host, port; the path prefix does not matter
    /// for a connection).
    pub url: &'a Url,
    /// The TLS client, for an `https` URL.
    pub tls: Option<&'a UpstreamTls>,
}

impl<'a> Target<'a> {
    /// `url`, over TLS with `tls` when it is an `https` URL.
    pub fn new(url: &'a Url, tls: Option<&'a UpstreamTls>) -> Self {
        Target { url, tls }
    }
}

impl<'a> From<&'a Url> for Target<'a> {
    fn from(url: &'a Url) -> Self {
        Target { url, tls: None }
    }
}

/// Why a provider exchange failed: no connection or a refused TLS
/// handshake ([`connect`]), or the HTTP exchange after connecting (the
/// provider pool's `send`).
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// No connection to the provider could be made.
    #[error("connect {authority}: {source}")]
    Connect {
        /// The provider's authority (`Host` form).
        authority: String,
        /// The OS error.
        source: io::Error,
    },
    /// The TLS handshake with an `https` provider failed: its certificate
    /// was refused (wrong host name, expired, unknown issuer) or the
    /// handshake broke off.
    #[error("provider TLS: {0}")]
    Tls(UpstreamTlsError),
    /// The exchange failed after connecting.
    #[error("provider: {0}")]
    Http(HttpError),
}

impl SendError {
    /// The terminal failure code and message (W6):
    /// `provider_unreachable`, `provider_tls` or `provider_error`.
    pub fn into_failure(self) -> (&'static str, String) {
        let code = match self {
            SendError::Connect { .. } => codes::PROVIDER_UNREACHABLE,
            SendError::Tls(_) => codes::PROVIDER_TLS,
            SendError::Http(_) => codes::PROVIDER_ERROR,
        };
        (code, self.to_string())
    }
}

/// Opens a connection to `target`: TCP (the host name resolved without
/// blocking the core), then the TLS handshake for an `https` URL. An
/// `https` URL without a TLS client is refused rather than sent in clear.
pub async fn connect(target: Target<'_>) -> Result<UpstreamStream, SendError> {
    let url = target.url;
    let tcp = http::connect_url(url)
        .await
        .map_err(|source| SendError::Connect {
            authority: url.authority(),
            source,
        })?;
    match (url.is_tls(), target.tls) {
        (false, _) => Ok(MaybeTls::Plain(tcp)),
        (true, Some(tls)) => tls
            .connect(tcp, url.host())
            .await
            .map(MaybeTls::from)
            .map_err(SendError::Tls),
        (true, None) => Err(SendError::Tls(UpstreamTlsError::Io {
            host: url.host().to_owned(),
            source: io::Error::other("https base URL without a TLS client configured"),
        })),
    }
}
