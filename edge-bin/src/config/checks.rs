//! Single-value checks the validator applies (paths, ranges, names, header
//! formats, addresses, keys).

use super::*;

/// Longest accepted `health_path`.
pub const MAX_HEALTH_PATH_BYTES: usize = 256;

/// A request path: starts with `/`, bounded, printable ASCII without
/// spaces, `?` or `#`.
pub(super) fn check_path(path: &str) -> Result<String, String> {
    if !path.starts_with('/') {
        return Err(format!("must start with `/` (got {path:?})"));
    }
    if path.len() > MAX_HEALTH_PATH_BYTES {
        return Err(format!(
            "must be at most {MAX_HEALTH_PATH_BYTES} bytes (got {})",
            path.len()
        ));
    }
    if let Some(c) = path
        .chars()
        .find(|c| !c.is_ascii_graphic() || matches!(c, '?' | '#'))
    {
        return Err(format!(
            "must be a plain path: printable ASCII without spaces, `?` or `#` (found {c:?})"
        ));
    }
    Ok(path.to_string())
}

/// `value` as `u64` when `min <= value <= max`.
pub(super) fn in_range(value: i64, min: u64, max: u64) -> Result<u64, String> {
    match u64::try_from(value) {
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        _ => Err(format!("must be between {min} and {max} (got {value})")),
    }
}

/// Free text such as a model name or target: non-empty, bounded, no control
/// characters.
pub(super) fn check_text(text: &str) -> Result<(), String> {
    if text.is_empty() {
        return Err("must not be empty".to_owned());
    }
    if text.len() > MAX_TEXT_BYTES {
        return Err(format!(
            "must be at most {MAX_TEXT_BYTES} bytes (got {})",
            text.len()
        ));
    }
    if text.chars().any(char::is_control) {
        return Err(format!("{text:?} must not contain control characters"));
    }
    Ok(())
}

/// An `x25519:<64 hex>` recipient public key that yields a shared secret
/// (low-order points are refused: nothing sealed to them is secret).
pub(super) fn parse_recipient_key(text: &str) -> Result<PublicKey, String> {
    let key = decode_recipient_public_key(text).map_err(|e| e.to_string())?;
    // Any fixed scalar works: a low-order point gives a non-contributory
    // result for every scalar.
    if !StaticSecret::from([1u8; 32])
        .diffie_hellman(&key)
        .was_contributory()
    {
        return Err("invalid public key: a low-order X25519 point".to_owned());
    }
    Ok(key)
}

/// A POSIX environment variable name: `[A-Za-z_][A-Za-z0-9_]*`, bounded.
pub(super) fn check_env_name(name: &str) -> Result<(), String> {
    let mut bytes = name.bytes();
    let first_ok = bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
    let rest_ok = bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !first_ok || !rest_ok || name.len() > MAX_ENV_NAME_BYTES {
        return Err(format!(
            "{name:?} must be an environment variable name ([A-Za-z_][A-Za-z0-9_]*, at most \
             {MAX_ENV_NAME_BYTES} characters)"
        ));
    }
    Ok(())
}

/// A header name the Node may inject: an HTTP token, and not a header that
/// frames or routes the request.
pub(super) fn check_header_name(name: &str) -> Result<(), String> {
    let token = name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
    if name.is_empty() || name.len() > MAX_HEADER_NAME_BYTES || !token {
        return Err(format!(
            "{name:?} must be an HTTP header name of 1 to {MAX_HEADER_NAME_BYTES} token characters"
        ));
    }
    const RESERVED: [&str; 6] = [
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "content-type",
        "accept",
    ];
    if RESERVED.iter().any(|r| name.eq_ignore_ascii_case(r)) {
        return Err(format!("{name:?} cannot carry a credential"));
    }
    Ok(())
}

/// A header value format: visible ASCII, space and tab, with `{secret}`.
pub(super) fn check_header_format(format: &str) -> Result<(), String> {
    let valid = format
        .bytes()
        .all(|b| b == b'\t' || (b' '..=b'~').contains(&b));
    if format.is_empty() || format.len() > MAX_HEADER_FORMAT_BYTES || !valid {
        return Err(format!(
            "{format:?} must be 1 to {MAX_HEADER_FORMAT_BYTES} characters of visible ASCII, space \
             or tab"
        ));
    }
    if !format.contains(SECRET_PLACEHOLDER) {
        return Err(format!("{format:?} must contain {SECRET_PLACEHOLDER}"));
    }
    Ok(())
}

pub(super) fn parse_socket_addr(text: &str) -> Result<SocketAddr, String> {
    text.parse()
        .map_err(|_| format!("{text:?} is not an IP:port socket address (e.g. 127.0.0.1:8080)"))
}

/// A `host:port` endpoint: a non-empty host name or IP (IPv6 in brackets)
/// and a port from 1 to 65535. Resolved when used, not here.
pub(super) fn check_host_port(text: &str) -> Result<(), String> {
    let bad = || format!("{text:?} is not host:port (e.g. 127.0.0.1:2379 or etcd-1:2379)");
    let (host, port) = text.rsplit_once(':').ok_or_else(bad)?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let host_ok = !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'_'));
    match port.parse::<u16>() {
        Ok(p) if p > 0 && host_ok => Ok(()),
        _ => Err(bad()),
    }
}
