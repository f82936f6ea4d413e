//! Request bodies as the Edge reads them: bounded, validated, and kept as
//! the client's bytes.
//!
//! ```text
//! body bytes ─► check_shape (depth, value and top-level member counts: a
//!               byte scan, no allocation)
//!            ─► Members::parse (serde_json, borrowed: every byte validated,
//!               top-level members as spans of the body, duplicates refused
//!               through a hash set)
//!            ─► read the few members the Edge needs, on demand
//!            ─► splice: prefix ‖ new value ‖ suffix (slices of the body and
//!               the new value: no copy)
//! ```
//!
//! No JSON tree is ever built: a body costs its own bytes plus one span per
//! top-level member while it is read, and nothing more when a member is
//! rewritten (`model`, U5): the spliced body is three pieces, two of them
//! the client's own memory, written to the node one after another. Every
//! other byte reaches the provider exactly as the client sent it.
//!
//! Every step is linear in the body: a check that compared each member with
//! every other would let one request of a few megabytes hold its core for
//! minutes (a quarter of a million members is within the value bound).

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::ops::Range;

use bytes::Bytes;
use iop_wire::codec::BodyParts;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// Bounds on a request body's JSON (`edge.max_json_depth`,
/// `edge.max_json_elements`, `edge.max_json_members`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JsonLimits {
    /// Deepest nesting of arrays and objects (the top-level object is 1).
    pub max_depth: u64,
    /// Most values inside containers (array elements and object members),
    /// counted through the whole body.
    pub max_elements: u64,
    /// Most members of the top-level object (each is kept as a span while
    /// the body is read).
    pub max_members: u64,
}

impl Default for JsonLimits {
    fn default() -> Self {
        use crate::config::front_door::{MAX_JSON_DEPTH, MAX_JSON_ELEMENTS, MAX_JSON_MEMBERS};
        Self {
            max_depth: MAX_JSON_DEPTH,
            max_elements: MAX_JSON_ELEMENTS,
            max_members: MAX_JSON_MEMBERS,
        }
    }
}

/// Why a body was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// Nested deeper than [`JsonLimits::max_depth`].
    #[error("The request body nests arrays and objects deeper than {max_depth} levels.")]
    TooDeep {
        /// The limit.
        max_depth: u64,
    },
    /// More values than [`JsonLimits::max_elements`].
    #[error("The request body has more than {max_elements} JSON values.")]
    TooManyElements {
        /// The limit.
        max_elements: u64,
    },
    /// A top-level object with more members than
    /// [`JsonLimits::max_members`].
    #[error("The request body has more than {max_members} top-level members.")]
    TooManyMembers {
        /// The limit.
        max_members: u64,
    },
    /// Not JSON (serde_json's reason).
    #[error("The request body is not valid JSON: {0}")]
    Syntax(String),
    /// Valid JSON, but not an object.
    #[error("The request body must be a JSON object.")]
    NotAnObject,
    /// A top-level member name appears twice (ambiguous: which one a
    /// provider reads is up to it).
    #[error("The request body has the member `{0}` more than once.")]
    DuplicateMember(String),
}

impl BodyError {
    /// Whether this is a [`JsonLimits`] refusal (counted apart).
    pub fn is_limit(&self) -> bool {
        matches!(
            self,
            BodyError::TooDeep { .. }
                | BodyError::TooManyElements { .. }
                | BodyError::TooManyMembers { .. }
        )
    }
}

/// Checks nesting depth, value count and the top-level object's member
/// count with one pass over the bytes, no allocation; stops at the first
/// bound passed. Tolerates any input (it only bounds; [`Members::parse`]
/// validates).
pub fn check_shape(body: &[u8], limits: &JsonLimits) -> Result<(), BodyError> {
    let mut depth = 0u64;
    let mut elements = 0u64;
    let mut members = 0u64;
    // The outermost container is an object (its values are members).
    let mut top_object = false;
    let mut in_string = false;
    let mut escaped = false;
    // Just opened a container: the next token says whether it is empty.
    let mut opened = false;
    // One more value; `member`: of the top-level object.
    let count = |elements: &mut u64, members: &mut u64, member: bool| {
        *elements += 1;
        if *elements > limits.max_elements {
            return Err(BodyError::TooManyElements {
                max_elements: limits.max_elements,
            });
        }
        if member {
            *members += 1;
            if *members > limits.max_members {
                return Err(BodyError::TooManyMembers {
                    max_members: limits.max_members,
                });
            }
        }
        Ok(())
    };
    for &b in body {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        if matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
            continue;
        }
        if opened {
            opened = false;
            if !matches!(b, b']' | b'}') {
                count(&mut elements, &mut members, depth == 1 && top_object)?;
            }
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                if depth == 0 {
                    top_object = b == b'{';
                }
                depth += 1;
                if depth > limits.max_depth {
                    return Err(BodyError::TooDeep {
                        max_depth: limits.max_depth,
                    });
                }
                opened = true;
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            b',' => count(&mut elements, &mut members, depth == 1 && top_object)?,
            _ => {}
        }
    }
    Ok(())
}

/// A validated JSON object body: the client's bytes and the span of each
/// top-level member's value, in order. The default is an empty body with no
/// members (what is left after [`Members::take`]).
#[derive(Debug, Clone, Default)]
pub struct Members {
    body: Bytes,
    members: Vec<(String, Range<usize>)>,
}

impl Members {
    /// Bounds ([`check_shape`]), then validates `body` as one JSON object
    /// whose top-level member names are unique, keeping the bytes (no copy)
    /// and the members' spans. Linear in the body.
    pub fn parse(body: Bytes, limits: &JsonLimits) -> Result<Self, BodyError> {
        check_shape(&body, limits)?;
        let text = std::str::from_utf8(&body)
            .map_err(|e| BodyError::Syntax(format!("invalid UTF-8: {e}")))?;
        let mut de = serde_json::Deserializer::from_str(text);
        let members = ObjectSpans { base: text }
            .deserialize(&mut de)
            .map_err(|e| BodyError::Syntax(e.to_string()))?;
        de.end().map_err(|e| BodyError::Syntax(e.to_string()))?;
        let members = members.ok_or(BodyError::NotAnObject)?;
        let mut seen = HashSet::with_capacity(members.len());
        if let Some((name, _)) = members.iter().find(|(name, _)| !seen.insert(name)) {
            return Err(BodyError::DuplicateMember(name.clone()));
        }
        Ok(Self { body, members })
    }

    /// The top-level member names, in body order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.members.iter().map(|(name, _)| name.as_str())
    }

    /// The raw JSON text of member `name`'s value.
    pub fn raw(&self, name: &str) -> Option<&str> {
        let span = self.span(name)?;
        // The body was validated as UTF-8 and spans lie on token bounds.
        std::str::from_utf8(&self.body[span]).ok()
    }

    /// Where member `name`'s value lies in the body.
    pub fn span(&self, name: &str) -> Option<Range<usize>> {
        self.members
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, span)| span.clone())
    }

    /// Member `name` as a `T`; `None` when absent, `Some(Err)` when it does
    /// not fit `T`.
    pub fn get<'a, T: serde::Deserialize<'a>>(
        &'a self,
        name: &str,
    ) -> Option<Result<T, serde_json::Error>> {
        self.raw(name).map(serde_json::from_str)
    }

    /// The body with member `name`'s value replaced by `value` (serialized
    /// JSON text), every other byte as the client sent it: the bytes before
    /// and after the old value are slices of the client's body, not copies.
    /// `None` when the member is absent.
    pub fn splice(&self, name: &str, value: Bytes) -> Option<BodyParts> {
        let span = self.span(name)?;
        Some(BodyParts::spliced(
            self.body.slice(..span.start),
            value,
            self.body.slice(span.end..),
        ))
    }

    /// The body with each edit applied, every other byte as the client
    /// sent it: an edit `(span, value)` replaces the bytes of `span` (a
    /// range of the body; an empty one inserts there) with `value`. Edits
    /// come in body order and do not overlap (`None` otherwise). The bytes
    /// before the first edit and after the last are slices of the client's
    /// body; the edited middle is one new buffer, so the client's bytes
    /// between two edits are copied (none when they touch; one edit costs
    /// no copy at all).
    pub fn splice_spans(&self, edits: &[(Range<usize>, Bytes)]) -> Option<BodyParts> {
        let (Some(first), Some(last)) = (edits.first(), edits.last()) else {
            return Some(BodyParts::whole(self.body.clone()));
        };
        let ordered = edits
            .windows(2)
            .all(|pair| pair[0].0.end <= pair[1].0.start);
        let valid = edits.iter().all(|(span, _)| span.start <= span.end);
        if !ordered || !valid || last.0.end > self.body.len() {
            return None;
        }
        let middle = if let [(_, value)] = edits {
            value.clone()
        } else {
            let len = edits.iter().map(|(_, value)| value.len()).sum::<usize>()
                + (last.0.end - first.0.start)
                - edits.iter().map(|(span, _)| span.len()).sum::<usize>();
            let mut middle = Vec::with_capacity(len);
            let mut at = first.0.start;
            for (span, value) in edits {
                middle.extend_from_slice(&self.body[at..span.start]);
                middle.extend_from_slice(value);
                at = span.end;
            }
            Bytes::from(middle)
        };
        Some(BodyParts::spliced(
            self.body.slice(..first.0.start),
            middle,
            self.body.slice(last.0.end..),
        ))
    }

    /// The client's bytes.
    pub fn bytes(&self) -> &Bytes {
        &self.body
    }
}

/// Byte offset of `inner` (a slice of `base`) in `base`.
fn offset_in(base: &str, inner: &str) -> Range<usize> {
    // Address arithmetic only: serde_json hands out borrowed raw values
    // that are subslices of the input.
    let start = (inner.as_ptr() as usize).saturating_sub(base.as_ptr() as usize);
    start..start + inner.len()
}

/// Deserializes a value: an object into its members' spans (`Some`),
/// anything else validated and skipped (`None`).
struct ObjectSpans<'de> {
    base: &'de str,
}

impl<'de> DeserializeSeed<'de> for ObjectSpans<'de> {
    type Value = Option<Vec<(String, Range<usize>)>>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ObjectSpans<'de> {
    type Value = Option<Vec<(String, Range<usize>)>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut members = Vec::new();
        while let Some(name) = map.next_key::<Cow<'de, str>>()? {
            let value: &'de RawValue = map.next_value()?;
            members.push((name.into_owned(), offset_in(self.base, value.get())));
        }
        Ok(Some(members))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<de::IgnoredAny>()?.is_some() {}
        Ok(None)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

/// Every member of a JSON object given as raw (validated) text, in order
/// and repeats included, with the span of its value in `raw`; `None` when
/// `raw` is not an object.
pub fn member_spans(raw: &str) -> Option<Vec<(String, Range<usize>)>> {
    let mut de = serde_json::Deserializer::from_str(raw);
    ObjectSpans { base: raw }
        .deserialize(&mut de)
        .ok()
        .flatten()
}

/// The members of a JSON object given as raw text, in the order their names
/// first appear, the last value winning for a repeated name (lenient: for
/// nested objects the Edge only reads, such as chat messages). `None` when
/// `raw` is not an object. Linear in `raw` (repeated names are found
/// through a hash map).
pub fn object_members(raw: &str) -> Option<Vec<(Cow<'_, str>, &RawValue)>> {
    struct Lenient;
    impl<'de> Visitor<'de> for Lenient {
        type Value = Option<Vec<(Cow<'de, str>, &'de RawValue)>>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut members: Vec<(Cow<'de, str>, &'de RawValue)> = Vec::new();
            // Where each name is in `members`.
            let mut index: HashMap<Cow<'de, str>, usize> = HashMap::new();
            while let Some(name) = map.next_key::<Cow<'de, str>>()? {
                let value: &'de RawValue = map.next_value()?;
                match index.get(&name) {
                    Some(&at) => members[at].1 = value,
                    None => {
                        index.insert(name.clone(), members.len());
                        members.push((name, value));
                    }
                }
            }
            Ok(Some(members))
        }
    }
    if !raw.trim_start().starts_with('{') {
        return None;
    }
    let mut de = serde_json::Deserializer::from_str(raw);
    de.deserialize_map(Lenient).ok().flatten()
}

/// The elements of a JSON array given as raw text; `None` when `raw` is not
/// an array.
pub fn array_elements(raw: &str) -> Option<Vec<&RawValue>> {
    if !raw.trim_start().starts_with('[') {
        return None;
    }
    serde_json::from_str(raw).ok()
}

/// `raw` as a string when it is a JSON string.
pub fn as_string(raw: &RawValue) -> Option<Cow<'_, str>> {
    if !raw.get().starts_with('"') {
        return None;
    }
    serde_json::from_str::<Cow<'_, str>>(raw.get()).ok()
}

/// `text` as a JSON string literal.
pub fn json_string(text: &str) -> Vec<u8> {
    // Serializing a &str cannot fail.
    serde_json::to_vec(text).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_depth: u64, max_elements: u64) -> JsonLimits {
        JsonLimits {
            max_depth,
            max_elements,
            max_members: u64::MAX,
        }
    }

    #[test]
    fn shape_counts_depth_and_values_outside_strings() {
        let ok = |body: &str, l: JsonLimits| check_shape(body.as_bytes(), &l);
        // {"a":[1,2,{"b":[]}]} has depth 4 and 5 values: a, 1, 2, {..}, b.
        let body = r#"{"a":[1,2,{"b":[]}]}"#;
        assert_eq!(ok(body, limits(4, 5)), Ok(()));
        assert_eq!(
            ok(body, limits(3, 5)),
            Err(BodyError::TooDeep { max_depth: 3 })
        );
        assert_eq!(
            ok(body, limits(4, 4)),
            Err(BodyError::TooManyElements { max_elements: 4 })
        );
        // Brackets, commas and escaped quotes inside strings do not count.
        let body = r#"{"a":"[[[,,,\"{{"}"#;
        assert_eq!(ok(body, limits(1, 1)), Ok(()));
        assert_eq!(ok("{ }", limits(1, 0)), Ok(()));
        assert_eq!(ok("[ ]", limits(1, 0)), Ok(()));
        assert_eq!(
            ok(&"[".repeat(65), limits(64, 100)),
            Err(BodyError::TooDeep { max_depth: 64 })
        );
    }

    #[test]
    fn shape_counts_the_top_level_objects_members_only() {
        let members = |max_members: u64| JsonLimits {
            max_members,
            ..limits(64, 100)
        };
        let ok = |body: &str, l: JsonLimits| check_shape(body.as_bytes(), &l);
        // Three members; the nested object's, the array's elements and
        // commas in strings are not top-level members.
        let body = r#" { "a" : {"x":1,"y":2}, "b":[1,2,3], "c":"d,e,f" } "#;
        assert_eq!(ok(body, members(3)), Ok(()));
        assert_eq!(
            ok(body, members(2)),
            Err(BodyError::TooManyMembers { max_members: 2 })
        );
        assert!(BodyError::TooManyMembers { max_members: 2 }.is_limit());
        assert_eq!(ok("{}", members(0)), Ok(()));
        assert_eq!(
            ok(r#"{"a":1}"#, members(0)),
            Err(BodyError::TooManyMembers { max_members: 0 })
        );
        // A top-level array has elements, not members.
        assert_eq!(ok("[1,2,3,{}]", members(1)), Ok(()));
        // The value bound is checked first when both are passed.
        assert_eq!(
            ok(
                r#"{"a":1,"b":2}"#,
                JsonLimits {
                    max_members: 1,
                    ..limits(64, 1)
                }
            ),
            Err(BodyError::TooManyElements { max_elements: 1 })
        );
        let parsed = Members::parse(Bytes::from_static(br#"{"a":1,"b":2,"c":3}"#), &members(2));
        assert_eq!(
            parsed.unwrap_err().to_string(),
            "The request body has more than 2 top-level members."
        );
    }

    // Repeated names are found through a hash set: the first member whose
    // name came before is named, wherever it is.
    #[test]
    fn the_first_repeated_name_is_reported_among_many() {
        let many = |tail: &str| {
            let mut body = String::from("{");
            for i in 0..10_000 {
                body.push_str(&format!("\"k{i}\":{i},"));
            }
            body.push_str(tail);
            Members::parse(Bytes::from(body), &limits(64, 1_000_000))
        };
        let members = many(r#""last":0}"#).unwrap();
        assert_eq!(members.names().count(), 10_001);
        assert_eq!(members.names().nth(9_999), Some("k9999"));
        assert_eq!(members.raw("k9999"), Some("9999"));
        assert_eq!(
            many(r#""k5":0,"k3":1}"#).unwrap_err(),
            BodyError::DuplicateMember("k5".into())
        );
    }

    #[test]
    fn members_are_spans_of_the_body_and_duplicates_are_refused() {
        let body = Bytes::from_static(br#" {"model" : "m\u0031", "n":[1, {"x":2}] ,"s":null} "#);
        let members = Members::parse(body.clone(), &JsonLimits::default()).unwrap();
        assert_eq!(members.raw("model"), Some(r#""m\u0031""#));
        assert_eq!(members.get::<String>("model").unwrap().unwrap(), "m1");
        assert_eq!(members.raw("n"), Some(r#"[1, {"x":2}]"#));
        assert_eq!(members.raw("s"), Some("null"));
        assert_eq!(members.raw("x"), None);
        // The body is shared, not copied.
        assert_eq!(members.bytes().as_ptr(), body.as_ptr());
        let spliced = members
            .splice("model", Bytes::from_static(br#""target""#))
            .unwrap();
        assert_eq!(
            &spliced.to_bytes()[..],
            br#" {"model" : "target", "n":[1, {"x":2}] ,"s":null} "#
        );
        // Before and after the value: the client's memory, not a copy.
        let [before, _, after] = spliced.parts() else {
            panic!("three pieces")
        };
        assert_eq!(before.as_ptr(), body.as_ptr());
        assert_eq!(after.as_ptr(), body[21..].as_ptr());
        // An escaped name is the same name.
        let dup = Bytes::from_static(br#"{"model":"a","mod\u0065l":"b"}"#);
        assert_eq!(
            Members::parse(dup, &JsonLimits::default()).unwrap_err(),
            BodyError::DuplicateMember("model".into())
        );
    }

    #[test]
    fn spliced_spans_keep_the_ends_shared_and_copy_only_between_edits() {
        let body = Bytes::from_static(br#"{"a":1,"b":{"c":2,"c":3},"d":4}"#);
        let members = Members::parse(body.clone(), &JsonLimits::default()).unwrap();
        let a = members.span("a").unwrap();
        let b = members.span("b").unwrap();
        let nested = member_spans(members.raw("b").unwrap()).unwrap();
        let names: Vec<&str> = nested.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["c", "c"]);
        let last_c = b.start + nested[1].1.start..b.start + nested[1].1.end;
        let spliced = members
            .splice_spans(&[
                (a.clone(), Bytes::from_static(b"10")),
                (a.end..a.end, Bytes::from_static(b",\"x\":0")),
                (last_c, Bytes::from_static(b"30")),
            ])
            .unwrap();
        assert_eq!(
            &spliced.to_bytes()[..],
            br#"{"a":10,"x":0,"b":{"c":2,"c":30},"d":4}"#
        );
        let [before, _, after] = spliced.parts() else {
            panic!("three pieces")
        };
        assert_eq!(before.as_ptr(), body.as_ptr());
        assert_eq!(&after[..], b"},\"d\":4}");
        // No edit: the body; overlapping or out-of-order edits: refused.
        assert_eq!(members.splice_spans(&[]).unwrap().to_bytes(), body);
        assert!(members
            .splice_spans(&[(b.clone(), Bytes::new()), (a.clone(), Bytes::new())])
            .is_none());
        assert!(members
            .splice_spans(&[(0..body.len() + 1, Bytes::new())])
            .is_none());
        assert!(member_spans("[1]").is_none());
    }

    #[test]
    fn bodies_that_are_not_one_object_are_refused() {
        let parse = |b: &'static [u8]| {
            Members::parse(Bytes::from_static(b), &JsonLimits::default()).map(|_| ())
        };
        assert_eq!(parse(b"[1]"), Err(BodyError::NotAnObject));
        assert_eq!(parse(b"\"s\""), Err(BodyError::NotAnObject));
        assert!(matches!(parse(b"{} {}"), Err(BodyError::Syntax(_))));
        assert!(matches!(parse(b"{\"a\":}"), Err(BodyError::Syntax(_))));
        assert!(matches!(parse(b"{\"a\":1"), Err(BodyError::Syntax(_))));
        assert!(matches!(parse(b"\xff"), Err(BodyError::Syntax(_))));
        assert!(matches!(parse(b""), Err(BodyError::Syntax(_))));
    }

    #[test]
    fn nested_objects_are_read_leniently() {
        let members = object_members(r#"{"role":"user","n":1,"r\u006fle":"tool"}"#).unwrap();
        let names: Vec<&str> = members.iter().map(|(n, _)| n.as_ref()).collect();
        // In first-appearance order, the last value winning.
        assert_eq!(names, ["role", "n"]);
        assert_eq!(as_string(members[0].1).as_deref(), Some("tool"));
        assert_eq!(as_string(members[1].1), None);
        let mut wide = String::from("{");
        for i in 0..10_000 {
            wide.push_str(&format!("\"k{}\":{i},", i % 5_000));
        }
        wide.push_str("\"end\":true}");
        let members = object_members(&wide).unwrap();
        assert_eq!(members.len(), 5_001);
        assert_eq!((members[7].0.as_ref(), members[7].1.get()), ("k7", "5007"));
        assert!(object_members("[1]").is_none());
        assert!(object_members("\"x\"").is_none());
        assert_eq!(array_elements("[1, \"a\"]").map(|a| a.len()), Some(2));
        assert!(array_elements("{}").is_none());
        assert_eq!(json_string("a\"b\n"), br#""a\"b\n""#.to_vec());
    }
}
