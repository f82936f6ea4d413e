//! Base URLs of plain-HTTP upstreams: `http://host[:port][/prefix]`.
//! Only `http` is accepted; `https` is refused with a clear error (TLS to
//! providers is out of scope for this layer).

use std::fmt;
use std::str::FromStr;

/// Why a base URL was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// There is no `scheme://` part.
    #[error("URL has no scheme (expected http://host:port/prefix)")]
    MissingScheme,
    /// The scheme is not `http` (`https` included: not supported here).
    #[error("URL scheme {scheme:?} is not supported: only plain http:// base URLs are")]
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

/// A parsed `http://host:port/prefix` base URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Url {
    host: String,
    port: u16,
    prefix: String,
}

impl Url {
    /// Parses `http://host[:port][/prefix]` (default port 80; IPv6 hosts in
    /// brackets). The prefix loses its trailing `/`.
    pub fn parse(input: &str) -> Result<Self, UrlError> {
        let input = input.trim();
        let (scheme, rest) = input.split_once("://").ok_or(UrlError::MissingScheme)?;
        let scheme = scheme.to_ascii_lowercase();
        if scheme != "http" {
            return Err(UrlError::UnsupportedScheme { scheme });
        }
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
            None => 80,
            Some(p) => match p.parse::<u16>() {
                Ok(port) if port != 0 && p.bytes().all(|b| b.is_ascii_digit()) => port,
                _ => return Err(UrlError::BadPort),
            },
        };
        if !path.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            return Err(UrlError::BadPath);
        }
        Ok(Url {
            host: host.to_ascii_lowercase(),
            port,
            prefix: path.trim_end_matches('/').to_owned(),
        })
    }

    /// The host (IPv6 without brackets), lowercased.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port (80 when the URL gave none).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The path prefix without trailing `/` (`""` for none).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The `Host` header value: `host` or `host:port` (port omitted when
    /// 80), IPv6 in brackets.
    pub fn authority(&self) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        if self.port == 80 {
            host
        } else {
            format!("{host}:{}", self.port)
        }
    }

    /// `http://host:port` with the port always written (IPv6 in
    /// brackets): the origin a credential lease is bound to
    /// ([`iop_wire::lease::upstream_origin`]).
    pub fn origin(&self) -> String {
        iop_wire::lease::upstream_origin(&self.host, self.port)
    }

    /// The request target for `path` under the prefix:
    /// `join("/v1/models")` on `http://h/api` is `/api/v1/models`.
    pub fn join(&self, path: &str) -> String {
        let path = path.trim_start_matches('/');
        format!("{}/{}", self.prefix, path)
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
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        write!(f, "http://{host}:{}{}", self.port, self.prefix)
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
    fn refusals() {
        assert_eq!(
            Url::parse("https://api.example.com"),
            Err(UrlError::UnsupportedScheme {
                scheme: "https".into()
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
