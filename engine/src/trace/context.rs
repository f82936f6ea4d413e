//! W3C Trace Context (<https://www.w3.org/TR/trace-context/>): the ids, the
//! `traceparent` header parsed and written, and `tracestate` kept within
//! its bounds. Pure: no IO, no clock.
//!
//! ```text
//! traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01
//!              ^^ version                          ^^ parent span  ^^ flags (bit 0: sampled)
//!                 ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^ trace id
//! ```
//!
//! A header that does not parse is ignored and a new trace is started
//! (the specification's rule); its `tracestate` is ignored with it.

use std::fmt;

/// Length of a version-00 `traceparent` value.
pub const TRACEPARENT_LEN: usize = 55;
/// Longest `tracestate` passed on; a longer one loses entries from its end
/// (the specification lets a vendor drop entries it cannot carry, and asks
/// that at least 512 characters be propagated).
pub const TRACESTATE_MAX_BYTES: usize = 512;
/// The `sampled` bit of the trace flags.
pub const FLAG_SAMPLED: u8 = 0x01;

/// A 16-byte trace id; never all zero once parsed or minted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceId(pub [u8; 16]);

/// An 8-byte span id; never all zero once parsed or minted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SpanId(pub [u8; 8]);

impl TraceId {
    /// The id of `bytes`: exactly 16, not all zero.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let id: [u8; 16] = bytes.try_into().ok()?;
        (id != [0; 16]).then_some(Self(id))
    }
}

impl SpanId {
    /// The id of `bytes`: exactly 8, not all zero.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let id: [u8; 8] = bytes.try_into().ok()?;
        (id != [0; 8]).then_some(Self(id))
    }
}

impl fmt::Display for TraceId {
    /// 32 lowercase hex digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_hex(f, &self.0)
    }
}

impl fmt::Display for SpanId {
    /// 16 lowercase hex digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_hex(f, &self.0)
    }
}

fn write_hex(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    bytes.iter().try_for_each(|b| write!(f, "{b:02x}"))
}

/// A parsed `traceparent`: the trace, the caller's span (the parent of
/// ours) and the trace flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// The trace.
    pub trace_id: TraceId,
    /// The span of the caller.
    pub parent_id: SpanId,
    /// The trace-flags byte.
    pub flags: u8,
}

/// Why a `traceparent` value was ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TraceParentError {
    /// Not `version-traceid-parentid-flags` of the right lengths.
    #[error("traceparent is not version-traceid-parentid-flags of 2, 32, 16 and 2 hex digits")]
    Shape,
    /// A field holds something other than lowercase hex digits.
    #[error("traceparent has a character that is not a lowercase hex digit")]
    NotHex,
    /// Version `ff`, which the specification forbids.
    #[error("traceparent version ff is invalid")]
    ForbiddenVersion,
    /// A version-00 value with something after its flags.
    #[error("a version-00 traceparent has characters after its flags")]
    TrailingData,
    /// The trace id is all zero.
    #[error("traceparent trace id is all zero")]
    ZeroTraceId,
    /// The parent id is all zero.
    #[error("traceparent parent id is all zero")]
    ZeroParentId,
}

impl TraceParent {
    /// Parses a `traceparent` header value (surrounding spaces and tabs
    /// allowed). A version above 00 is read as 00 is, as the specification
    /// asks: its first 55 characters, followed by nothing or by `-` and
    /// more.
    pub fn parse(value: &[u8]) -> Result<Self, TraceParentError> {
        let value = value.trim_ascii();
        if value.len() < TRACEPARENT_LEN {
            return Err(TraceParentError::Shape);
        }
        let (head, rest) = value.split_at(TRACEPARENT_LEN);
        if head[2] != b'-' || head[35] != b'-' || head[52] != b'-' {
            return Err(TraceParentError::Shape);
        }
        let version = hex_byte(&head[0..2])?;
        if version == 0xff {
            return Err(TraceParentError::ForbiddenVersion);
        }
        match (version, rest.first()) {
            (_, None) => {}
            (0, Some(_)) => return Err(TraceParentError::TrailingData),
            (_, Some(b'-')) => {}
            (_, Some(_)) => return Err(TraceParentError::Shape),
        }
        let mut trace = [0u8; 16];
        hex_into(&head[3..35], &mut trace)?;
        let mut parent = [0u8; 8];
        hex_into(&head[36..52], &mut parent)?;
        let flags = hex_byte(&head[53..55])?;
        Ok(Self {
            trace_id: TraceId::from_bytes(&trace).ok_or(TraceParentError::ZeroTraceId)?,
            parent_id: SpanId::from_bytes(&parent).ok_or(TraceParentError::ZeroParentId)?,
            flags,
        })
    }

    /// Whether the caller sampled the trace (flag bit 0).
    pub fn sampled(&self) -> bool {
        self.flags & FLAG_SAMPLED != 0
    }

    /// The version-00 header value (55 characters).
    pub fn to_header(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{}-{}-{:02x}",
            self.trace_id, self.parent_id, self.flags
        )
    }
}

fn hex_digit(c: u8) -> Result<u8, TraceParentError> {
    match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        _ => Err(TraceParentError::NotHex),
    }
}

fn hex_byte(pair: &[u8]) -> Result<u8, TraceParentError> {
    Ok((hex_digit(pair[0])? << 4) | hex_digit(pair[1])?)
}

fn hex_into(text: &[u8], out: &mut [u8]) -> Result<(), TraceParentError> {
    for (byte, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        *byte = hex_byte(pair)?;
    }
    Ok(())
}

/// The `tracestate` to pass on, from the header values received (several
/// are one list joined by commas): `None` when there is none or it holds
/// a character outside printable ASCII; entries past
/// [`TRACESTATE_MAX_BYTES`] are dropped from the end.
pub fn tracestate<'a>(values: impl IntoIterator<Item = &'a [u8]>) -> Option<String> {
    let mut joined = String::new();
    for value in values {
        let value = value.trim_ascii();
        if value.is_empty() {
            continue;
        }
        if !value.iter().all(|&b| (0x20..0x7f).contains(&b)) {
            return None;
        }
        if !joined.is_empty() {
            joined.push(',');
        }
        // Printable ASCII, checked above.
        joined.push_str(std::str::from_utf8(value).ok()?);
        if joined.len() > TRACESTATE_MAX_BYTES * 2 {
            break;
        }
    }
    if joined.len() > TRACESTATE_MAX_BYTES {
        let cut = joined[..=TRACESTATE_MAX_BYTES].rfind(',')?;
        joined.truncate(cut);
    }
    let trimmed = joined.trim_matches(|c| c == ',' || c == ' ' || c == '\t');
    (!trimmed.is_empty()).then(|| trimmed.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn the_specification_example_parses_and_writes_back_the_same() {
        let parsed = TraceParent::parse(SPEC.as_bytes()).unwrap();
        assert_eq!(
            parsed.trace_id.0,
            [
                0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e,
                0x47, 0x36
            ]
        );
        assert_eq!(
            parsed.parent_id.0,
            [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]
        );
        assert_eq!(parsed.flags, 0x01);
        assert!(parsed.sampled());
        assert_eq!(parsed.to_header(), SPEC);
        let unsampled =
            TraceParent::parse(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap();
        assert!(!unsampled.sampled());
        // Surrounding optional whitespace of a header value.
        assert_eq!(
            TraceParent::parse(format!(" \t{SPEC} ").as_bytes()),
            Ok(parsed)
        );
    }

    #[test]
    fn invalid_values_are_refused_with_their_reason() {
        let cases: &[(&str, TraceParentError)] = &[
            ("", TraceParentError::Shape),
            (&SPEC[..54], TraceParentError::Shape),
            (
                "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                TraceParentError::Shape,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
                TraceParentError::Shape,
            ),
            (
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                TraceParentError::NotHex,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902bz-01",
                TraceParentError::NotHex,
            ),
            (
                "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                TraceParentError::NotHex,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
                TraceParentError::NotHex,
            ),
            (
                "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                TraceParentError::ForbiddenVersion,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
                TraceParentError::TrailingData,
            ),
            (
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                TraceParentError::ZeroTraceId,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                TraceParentError::ZeroParentId,
            ),
        ];
        for (value, why) in cases {
            assert_eq!(TraceParent::parse(value.as_bytes()), Err(*why), "{value:?}");
        }
    }

    #[test]
    fn a_later_version_is_read_as_version_00() {
        // Exactly 55 characters, or more after a `-`.
        let v1 =
            TraceParent::parse(b"cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(v1.to_header(), SPEC);
        let longer = TraceParent::parse(
            b"cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-holds",
        )
        .unwrap();
        assert_eq!(longer, v1);
        assert_eq!(
            TraceParent::parse(b"cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x"),
            Err(TraceParentError::Shape)
        );
    }

    #[test]
    fn ids_of_the_wrong_length_or_all_zero_are_none() {
        assert_eq!(TraceId::from_bytes(&[0; 16]), None);
        assert_eq!(TraceId::from_bytes(&[1; 15]), None);
        assert_eq!(TraceId::from_bytes(&[1; 16]), Some(TraceId([1; 16])));
        assert_eq!(SpanId::from_bytes(&[0; 8]), None);
        assert_eq!(SpanId::from_bytes(&[1; 9]), None);
        assert_eq!(SpanId([0xab; 8]).to_string(), "abababababababab");
    }

    #[test]
    fn tracestate_is_joined_kept_printable_and_bounded() {
        assert_eq!(tracestate([]), None);
        assert_eq!(tracestate([&b"  "[..]]), None);
        assert_eq!(
            tracestate([&b"rojo=00f067aa0ba902b7"[..], b" congo=t61rcWkgMzE "]),
            Some("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE".to_owned())
        );
        assert_eq!(tracestate([&b"a=\x01"[..]]), None);
        // 40 entries of 15 bytes (plus commas): cut at the last entry that
        // ends within 512 bytes.
        let long: Vec<String> = (0..40).map(|i| format!("vendor{i:02}=abcdef")).collect();
        let joined = long.join(",");
        let kept = tracestate([joined.as_bytes()]).unwrap();
        assert!(kept.len() <= TRACESTATE_MAX_BYTES, "{}", kept.len());
        assert_eq!(kept, long[..32].join(","));
    }
}
