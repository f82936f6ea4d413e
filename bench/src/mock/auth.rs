//! `bench mock-provider --require-api-key KEY`: the mock refuses provider
//! requests that do not carry the key, so the credential a Node injects from
//! a lease (C2) is checked end to end.
//!
//! A request is authorized by `Authorization: Bearer KEY` or
//! `x-api-key: KEY`; otherwise it gets 401 in the OpenAI error shape with
//! code `invalid_api_key`. `GET /health` and `/admin/*` stay open (probes and
//! test instrumentation carry no provider credential).

use std::fmt;

use iop_engine::http::Header;
use serde_json::json;

/// The API key the mock requires. `Debug` is redacted.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// Wraps `key`.
    pub fn new(key: impl Into<String>) -> Self {
        Self(key.into())
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// The 401 body when a request to `target` with `headers` lacks `required`;
/// `None` when it may proceed.
pub fn unauthorized(required: &ApiKey, target: &str, headers: &[Header]) -> Option<String> {
    let route = target.split_once('?').map_or(target, |(route, _)| route);
    if route == "/health" || route.starts_with("/admin/") {
        return None;
    }
    let key = required.0.as_bytes();
    let authorized = headers.iter().any(|h| {
        if h.name.eq_ignore_ascii_case("authorization") {
            h.value
                .strip_prefix(b"Bearer ")
                .is_some_and(|token| token == key)
        } else {
            h.name.eq_ignore_ascii_case("x-api-key") && &h.value[..] == key
        }
    });
    if authorized {
        return None;
    }
    let presented = headers.iter().any(|h| {
        h.name.eq_ignore_ascii_case("authorization") || h.name.eq_ignore_ascii_case("x-api-key")
    });
    let message = if presented {
        "Incorrect API key provided."
    } else {
        "You didn't provide an API key."
    };
    Some(
        json!({"error": {
            "message": message,
            "type": "invalid_request_error",
            "param": null,
            "code": "invalid_api_key",
        }})
        .to_string(),
    )
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn header(name: &str, value: &str) -> Header {
        Header {
            name: name.into(),
            value: Bytes::copy_from_slice(value.as_bytes()),
        }
    }

    // The mock checks the header a Node injects (the credential tests rely
    // on its 401 without it).
    #[test]
    fn the_key_is_required_in_either_header() {
        let key = ApiKey::new("sk-mock");
        let path = "/v1/chat/completions";
        assert_eq!(
            unauthorized(&key, path, &[header("Authorization", "Bearer sk-mock")]),
            None
        );
        assert_eq!(
            unauthorized(&key, path, &[header("X-Api-Key", "sk-mock")]),
            None
        );
        assert_eq!(
            unauthorized(&key, path, &[]).as_deref(),
            Some(
                r#"{"error":{"message":"You didn't provide an API key.","type":"invalid_request_error","param":null,"code":"invalid_api_key"}}"#
            )
        );
        assert_eq!(
            unauthorized(&key, path, &[header("authorization", "Bearer sk-other")]).as_deref(),
            Some(
                r#"{"error":{"message":"Incorrect API key provided.","type":"invalid_request_error","param":null,"code":"invalid_api_key"}}"#
            )
        );
        assert!(unauthorized(&key, "/v1/models", &[]).is_some());
        assert_eq!(unauthorized(&key, "/health", &[]), None);
        assert_eq!(unauthorized(&key, "/admin/stats", &[]), None);
        assert_eq!(format!("{key:?}"), "ApiKey(<redacted>)");
    }
}
