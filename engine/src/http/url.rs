//! Base URLs of upstreams: `http://host[:port][/prefix]` and
//! `https://host[:port][/prefix]`. The scheme decides whether a connection
//! to the upstream is wrapped in TLS ([`crate::tls::UpstreamTls`]) and is
//! part of the origin a credential lease is bound to.

use std::fmt;
use std::str::FromStr;

/// Why a base URL was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// There is no `scheme://` part.
    #[error("URL has no scheme (expected http://host:port/prefix or https://host/prefix)")]
    MissingScheme,
    /// The scheme is neither `http` nor `https`.
    #[error("URL scheme {scheme:?} is not supported: use http:// or https://")]
    UnsupportedScheme {
        /// The refused scheme, lowercased.
        scheme: String,
    },
    /// The host is empty or has characters a host name cannot have.
    #[error("URL host is missing or invalid")]
    BadHost,
    /// The port is not a number in `1..=65535`.
    #[error("URL port is not a number in 1..=65535")]
    BadPort,
    /// The URL carries user info, a query or a fragment, which a base URL
    /// must not.
    #[error("base URL must not carry user info, a query or a fragment")]
    UnexpectedPart,
    /// The path prefix has bytes that cannot appear in a request target.
    #[error("URL path has invalid characters")]
    BadPath,
}

/// The scheme of a base URL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// Plain HTTP over TCP.
    Http,
    /// HTTP over TLS.
    Https,
}

impl Scheme {
    /// `http` or `https`.
    pub fn as_str(self) -> &'static str {
        match self {
            Scheme::Http => "http",
            Scheme::Https => "https",
        }
    }

    /// The port a URL of this scheme means when it names none.
    pub fn default_port(self) -> u16 {
        match self {
            Scheme::Http => 80,
            Scheme::Https => 443,
        }
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A parsed `http(s)://host:port/prefix` base URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Url {
    scheme: Scheme,
    host: String,
    port: u16,
    prefix: String,
}

impl Url {
    /// Parses `http://host[:port][/prefix]` (default port 80) or
    /// `https://host[:port][/prefix]` (default port 443); IPv6 hosts in
    /// brackets. The prefix loses its trailing `/`.
    pub fn parse(input: &str) -> Result<Self, UrlError> {
        let input = input.trim();
        let (scheme, rest) = input.split_once("://").ok_or(UrlError::MissingScheme)?;
        let scheme = match scheme.to_ascii_lowercase().as_str() {
            "http" => Scheme::Http,
            "https" => Scheme::Https,
            other => {
                return Err(UrlError::UnsupportedScheme {
                    scheme: other.to_owned(),
                })
            }
        };
        if rest.contains(['?', '#']) {
            return Err(UrlError::UnexpectedPart);
        }
        let (authority, path) = match rest.find('/') {
            Some(slash) => rest.split_at(slash),
            None => (rest, ""),
        };
        if authority.contains('@') {
            return Err(UrlError::UnexpectedPart);
        }
        let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
            let (host, after) = bracketed.split_once(']').ok_or(UrlError::BadHost)?;
            if host.is_empty()
                || !host
                    .chars()
                    .all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.')
            {
                return Err(UrlError::BadHost);
            }
            let port = match after {
                "" => None,
                _ => Some(after.strip_prefix(':').ok_or(UrlError::BadPort)?),
            };
            (host, port)
        } else {
            let (host, port) = match authority.split_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (authority, None),
            };
            let host_ok = !host.is_empty()
                && host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'));
            if !host_ok {
                return Err(UrlError::BadHost);
            }
            (host, port)
        };
        let port = match port {
            None => scheme.default_port(),
            Some(p) => match p.parse::<u16>() {
                Ok(port) if port != 0 && p.bytes().all(|b| b.is_ascii_digit()) => port,
                _ => return Err(UrlError::BadPort),
            },
        };
        if !path.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            return Err(UrlError::BadPath);
        }
        Ok(Url {
            scheme,
            host: host.to_ascii_lowercase(),
            port,
            prefix: path.trim_end_matches('/').to_owned(),
        })
    }

    /// The scheme.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// Whether connections to this URL use TLS (`https`).
    pub fn is_tls(&self) -> bool {
        self.scheme == Scheme::Https
    }

    /// The host (IPv6 without brackets), lowercased. Also the name a TLS
    /// connection sends as SNI and verifies the certificate against.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port (the scheme's default when the URL gave none).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The path prefix without trailing `/` (`""` for none).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The `Host` header value: `host` or `host:port` (port omitted when
    /// it is the scheme's default), IPv6 in brackets.
    pub fn authority(&self) -> String {
        let host = self.bracketed_host();
        if self.port == self.scheme.default_port() {
            host
        } else {
            format!("{host}:{}", self.port)
        }
    }

    /// `scheme://host:port` with the port always written (IPv6 in
    /// brackets): the origin a credential lease is bound to
    /// ([`iop_wire::lease::upstream_origin`]).
    pub fn origin(&self) -> String {
        iop_wire::lease::upstream_origin(self.scheme.as_str(), &self.host, self.port)
    }

    /// The request target for `path` under the prefix:
    /// `join("/v1/models")` on `http://h/api` is `/api/v1/models`.
    pub fn join(&self, path: &str) -> String {
        let path = path.trim_start_matches('/');
        format!("{}/{}", self.prefix, path)
    }

    fn bracketed_host(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        }
    }
}

impl FromStr for Url {
    type Err = UrlError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Url::parse(s)
    }
}

impl fmt::Display for Url {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}://{}:{}{}",
            self.scheme,
            self.bracketed_host(),
            self.port,
            self.prefix
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_host_port_prefix() {
        let url = Url::parse("http://127.0.0.1:11434/api/").unwrap();
        assert_eq!(url.host(), "127.0.0.1");
        assert_eq!(url.port(), 11434);
        assert_eq!(url.prefix(), "/api");
        assert_eq!(url.authority(), "127.0.0.1:11434");
        assert_eq!(url.join("/chat"), "/api/chat");
        assert_eq!(url.join("chat"), "/api/chat");
        assert_eq!(url.to_string(), "http://127.0.0.1:11434/api");
        assert_eq!(url.origin(), "http://127.0.0.1:11434");
    }

    #[test]
    fn defaults_and_ipv6() {
        let url = Url::parse(" HTTP://LocalHost ").unwrap();
        assert_eq!(
            (url.host(), url.port(), url.prefix()),
            ("localhost", 80, "")
        );
        assert_eq!(url.authority(), "localhost");
        assert_eq!(url.origin(), "http://localhost:80");
        assert_eq!(url.join("/v1/models"), "/v1/models");
        let url = Url::parse("http://[::1]:8000/v1").unwrap();
        assert_eq!((url.host(), url.port(), url.prefix()), ("::1", 8000, "/v1"));
        assert_eq!(url.authority(), "[::1]:8000");
        assert_eq!(url.origin(), "http://[::1]:8000");
        assert_eq!(url.join("chat/completions"), "/v1/chat/completions");
    }

    #[test]
    fn https_defaults_to_port_443_and_keeps_the_scheme_in_the_origin() {
        let url = Url::parse("HTTPS://API.Example.com/openai/").unwrap();
        assert_eq!(url.scheme(), Scheme::Https);
        assert!(url.is_tls());
        assert_eq!(
            (url.host(), url.port(), url.prefix()),
            ("api.example.com", 443, "/openai")
        );
        assert_eq!(url.authority(), "api.example.com");
        assert_eq!(url.origin(), "https://api.example.com:443");
        assert_eq!(url.to_string(), "https://api.example.com:443/openai");
        let url = Url::parse("https://127.0.0.1:8443").unwrap();
        assert_eq!(url.authority(), "127.0.0.1:8443");
        assert_eq!(url.origin(), "https://127.0.0.1:8443");
        // Port 80 is not the default of https, nor 443 of http.
        assert_eq!(Url::parse("https://h:80").unwrap().authority(), "h:80");
        assert_eq!(Url::parse("http://h:443").unwrap().authority(), "h:443");
        assert!(!Url::parse("http://h").unwrap().is_tls());
        // Same host and port, different scheme: different origins.
        assert_ne!(
            Url::parse("http://h:8443").unwrap().origin(),
            Url::parse("https://h:8443").unwrap().origin()
        );
    }

    #[test]
    fn refusals() {
        assert_eq!(
            Url::parse("ftp://files.example.com"),
            Err(UrlError::UnsupportedScheme {
                scheme: "ftp".into()
            })
        );
        let cases = [
            ("localhost:80", UrlError::MissingScheme),
            ("http://", UrlError::BadHost),
            ("http://:80", UrlError::BadHost),
            ("http://a b", UrlError::BadHost),
            ("http://[::1", UrlError::BadHost),
            ("http://h:0", UrlError::BadPort),
            ("http://h:65536", UrlError::BadPort),
            ("http://h:+80", UrlError::BadPort),
            ("http://h:", UrlError::BadPort),
            ("http://[::1]x", UrlError::BadPort),
            ("http://u:p@h", UrlError::UnexpectedPart),
            ("http://h/a?x=1", UrlError::UnexpectedPart),
            ("http://h/a#f", UrlError::UnexpectedPart),
            ("http://h/a b", UrlError::BadPath),
        ];
        for (input, err) in cases {
            assert_eq!(Url::parse(input), Err(err), "{input}");
        }
    }
}
