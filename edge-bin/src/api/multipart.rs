//! `multipart/form-data` request bodies (RFC 7578), as the audio routes
//! take them (`/v1/audio/transcriptions`, `/v1/audio/translations`): only
//! the `model` and `stream` fields are read; every other byte, the audio
//! file's included, reaches the provider as the client sent it, with the
//! `model` field's value replaced by the provider's target (U5).
//!
//! ```text
//! --B\r\n
//! Content-Disposition: form-data; name="model"\r\n
//! \r\n
//! whisper-1                ◄── value: the only bytes replaced
//! \r\n--B\r\n
//! Content-Disposition: form-data; name="file"; filename="a.wav"\r\n
//! Content-Type: audio/wav\r\n
//! \r\n
//! RIFF....                 ◄── passed through, never copied
//! \r\n--B--\r\n
//! ```
//!
//! Parts are found with a linear-time substring search for the delimiter
//! (`memchr::memmem`), so the work is bounded per byte of body whatever the
//! file holds. Pure: no sockets, no state.

use std::ops::Range;

use bytes::Bytes;
use iop_wire::codec::BodyParts;
use memchr::memmem;

use crate::api::error::GatewayError;

/// Longest boundary RFC 2046 allows.
const MAX_BOUNDARY_BYTES: usize = 70;
/// Longest header block of one part this parser reads.
const MAX_PART_HEAD_BYTES: usize = 8 * 1024;
/// Longest `model` value.
const MAX_MODEL_BYTES: usize = 256;

/// A parsed form: where the `model` value is, and whether `stream` is on.
#[derive(Debug, Clone)]
pub struct FormRequest {
    /// The external model (E2).
    pub model: String,
    /// Whether the client asked for a stream (`stream=true`).
    pub stream: bool,
    body: Bytes,
    model_value: Range<usize>,
}

impl FormRequest {
    /// Parses `body`, a form whose `Content-Type` header value is
    /// `content_type`. Errors are the client's, in the OpenAI shape.
    pub fn parse(body: Bytes, content_type: &[u8]) -> Result<Self, GatewayError> {
        let boundary = boundary(content_type)?;
        let mut model = None;
        let mut stream = false;
        for part in parts(&body, boundary)? {
            let part = part?;
            match part.name.as_str() {
                "model" if model.is_none() => model = Some(part.value),
                "stream" => {
                    stream = body[part.value].eq_ignore_ascii_case(b"true");
                }
                _ => {}
            }
        }
        let Some(value) = model else {
            return Err(GatewayError::invalid_request(
                "The form has no `model` field.",
                Some("model"),
            ));
        };
        let name = model_name(&body[value.clone()])?;
        Ok(Self {
            model: name,
            stream,
            body,
            model_value: value,
        })
    }

    /// The body for the selected provider, the `model` field's value
    /// replaced by `target`, in pieces that share the client's memory.
    pub fn body_for_target(&self, target: &str) -> BodyParts {
        BodyParts::spliced(
            self.body.slice(..self.model_value.start),
            Bytes::copy_from_slice(target.as_bytes()),
            self.body.slice(self.model_value.end..),
        )
    }
}

/// The boundary of a `multipart/form-data` content type.
pub fn boundary(content_type: &[u8]) -> Result<&[u8], GatewayError> {
    let bad = |why: &str| {
        GatewayError::invalid_request(
            format!(
                "The request's Content-Type must be multipart/form-data with a boundary: {why}."
            ),
            None,
        )
    };
    let mut params = content_type.split(|&b| b == b';');
    let media = params.next().unwrap_or_default().trim_ascii();
    if !media.eq_ignore_ascii_case(b"multipart/form-data") {
        return Err(bad("the media type is another"));
    }
    for param in params {
        let Some(eq) = param.iter().position(|&b| b == b'=') else {
            continue;
        };
        if !param[..eq].trim_ascii().eq_ignore_ascii_case(b"boundary") {
            continue;
        }
        let mut value = param[eq + 1..].trim_ascii();
        if let [b'"', inner @ .., b'"'] = value {
            value = inner;
        }
        if value.is_empty() || value.len() > MAX_BOUNDARY_BYTES {
            return Err(bad("the boundary is empty or longer than 70 bytes"));
        }
        return Ok(value);
    }
    Err(bad("it has no boundary parameter"))
}

/// One part: its field name, whether it is a file, and where its value
/// lies in the body.
#[derive(Debug)]
struct Part {
    name: String,
    file: bool,
    value: Range<usize>,
}

/// The delimiters of a form with `boundary`.
struct Delimiters {
    /// `--B`, which may open the body.
    opening: Vec<u8>,
    /// `\r\n--B`, which ends every part.
    finder: memmem::Finder<'static>,
}

impl Delimiters {
    fn new(boundary: &[u8]) -> Self {
        let mut opening = Vec::with_capacity(boundary.len() + 2);
        opening.extend_from_slice(b"--");
        opening.extend_from_slice(boundary);
        let mut delimiter = Vec::with_capacity(boundary.len() + 4);
        delimiter.extend_from_slice(b"\r\n");
        delimiter.extend_from_slice(&opening);
        Self {
            opening,
            finder: memmem::Finder::new(&delimiter).into_owned(),
        }
    }
}

/// One step through a form: the next part, the close delimiter, or the
/// point where the bytes so far end (with what is missing).
enum Step {
    Part { part: Part, next: usize },
    Close,
    Incomplete(&'static str),
}

fn malformed(why: &str) -> GatewayError {
    GatewayError::invalid_request(format!("The multipart body is malformed: {why}."), None)
}

/// Where the first part's boundary line ends in `body` (the first
/// delimiter may open the body, with no CRLF before it; a preamble is
/// skipped).
fn first_part(body: &[u8], d: &Delimiters) -> Result<usize, &'static str> {
    if body.starts_with(&d.opening) {
        return Ok(d.opening.len());
    }
    d.finder
        .find(body)
        .map(|at| at + d.finder.needle().len())
        .ok_or("no boundary line")
}

/// The part after the boundary that ends at `at`. Linear in the bytes it
/// looks at: one search for the header block's end (within 8 KiB), one for
/// the delimiter.
fn step(body: &[u8], at: usize, d: &Delimiters) -> Result<Step, GatewayError> {
    let rest = &body[at..];
    if rest.len() < 2 {
        return Ok(Step::Incomplete("the body ends in a boundary line"));
    }
    if rest.starts_with(b"--") {
        // The close delimiter: the epilogue is ignored.
        return Ok(Step::Close);
    }
    // Transport padding, then the line's CRLF.
    let padding = rest
        .iter()
        .take_while(|&&b| b == b' ' || b == b'\t')
        .count();
    match &rest[padding..] {
        [] | [b'\r'] => return Ok(Step::Incomplete("the body ends in a boundary line")),
        [b'\r', b'\n', ..] => {}
        _ => return Err(malformed("a boundary line does not end in CRLF")),
    }
    let head_start = at + padding + 2;
    let head_window = &body[head_start..body.len().min(head_start + MAX_PART_HEAD_BYTES)];
    let head_len = match memmem::find(head_window, b"\r\n\r\n") {
        Some(n) => n + 4,
        None if head_window.starts_with(b"\r\n") => 2,
        None if head_window.len() < MAX_PART_HEAD_BYTES => {
            return Ok(Step::Incomplete("the body ends in a part's headers"))
        }
        None => return Err(malformed("a part's headers exceed 8 KiB")),
    };
    let value_start = head_start + head_len;
    let head = &body[head_start..value_start];
    let name = field_name(head)
        .ok_or_else(|| malformed("a part has no Content-Disposition: form-data name"))?;
    let file = has_filename(head);
    let Some(value_len) = d.finder.find(&body[value_start..]) else {
        return Ok(Step::Incomplete("the body ends inside a part"));
    };
    let value_end = value_start + value_len;
    Ok(Step::Part {
        part: Part {
            name,
            file,
            value: value_start..value_end,
        },
        next: value_end + d.finder.needle().len(),
    })
}

/// The parts of the whole form `body`, in order; an error ends the
/// iteration.
fn parts<'a>(
    body: &'a [u8],
    boundary: &[u8],
) -> Result<impl Iterator<Item = Result<Part, GatewayError>> + 'a, GatewayError> {
    let d = Delimiters::new(boundary);
    let start = first_part(body, &d).map_err(malformed)?;
    let mut at = Some(start);
    Ok(std::iter::from_fn(move || {
        let here = at.take()?;
        match step(body, here, &d) {
            Ok(Step::Part { part, next }) => {
                at = Some(next);
                Some(Ok(part))
            }
            Ok(Step::Close) => None,
            Ok(Step::Incomplete(why)) => Some(Err(malformed(why))),
            Err(e) => Some(Err(e)),
        }
    }))
}

/// What the start of a form, as far as it has arrived, says of its
/// `model` field ([`scan_prefix`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prefix {
    /// The `model` field came whole: its value, and whether a `stream`
    /// field before it said `true`.
    Model {
        /// The model's name.
        model: String,
        /// Where its value lies.
        value: Range<usize>,
        /// A `stream=true` field came before it.
        stream: bool,
    },
    /// A file part starts before any `model` field: the model is known only
    /// once the file was read.
    FileFirst,
    /// The form ended without a `model` field.
    NoModel,
    /// More bytes are needed.
    More,
}

/// Reads the start of a form, `prefix` (the first bytes of a body with
/// `Content-Type` `content_type`), up to its `model` field. A caller
/// scanning a growing prefix again starts over: the fields before a model
/// are small, and the caller bounds the prefix.
pub fn scan_prefix(prefix: &[u8], content_type: &[u8]) -> Result<Prefix, GatewayError> {
    let d = Delimiters::new(boundary(content_type)?);
    let mut at = match first_part(prefix, &d) {
        Ok(at) => at,
        Err(_) => return Ok(Prefix::More),
    };
    let mut stream = false;
    loop {
        match step(prefix, at, &d)? {
            Step::Part { part, next } => {
                if part.name == "model" {
                    let model = model_name(&prefix[part.value.clone()])?;
                    return Ok(Prefix::Model {
                        model,
                        value: part.value,
                        stream,
                    });
                }
                if part.file {
                    return Ok(Prefix::FileFirst);
                }
                if part.name == "stream" {
                    stream = prefix[part.value].eq_ignore_ascii_case(b"true");
                }
                at = next;
            }
            Step::Close => return Ok(Prefix::NoModel),
            // A file part whose headers came: a file, wherever its value
            // ends.
            Step::Incomplete(_) if file_head_arrived(prefix, at) => return Ok(Prefix::FileFirst),
            Step::Incomplete(_) => return Ok(Prefix::More),
        }
    }
}

/// Whether the part after the boundary ending at `at` is a file whose
/// header block arrived whole.
fn file_head_arrived(prefix: &[u8], at: usize) -> bool {
    let rest = &prefix[at..];
    let window = &rest[..rest.len().min(MAX_PART_HEAD_BYTES)];
    memmem::find(window, b"\r\n\r\n").is_some_and(|end| has_filename(&window[..end + 2]))
}

/// A `model` field's value as a name: non-empty UTF-8 of at most 256 bytes.
fn model_name(value: &[u8]) -> Result<String, GatewayError> {
    std::str::from_utf8(value)
        .ok()
        .filter(|m| !m.is_empty() && m.len() <= MAX_MODEL_BYTES)
        .map(str::to_owned)
        .ok_or_else(|| {
            GatewayError::invalid_request(
                "`model` must be a non-empty UTF-8 string of at most 256 bytes.",
                Some("model"),
            )
        })
}

/// Whether a part's header block has a `filename` parameter in its
/// `Content-Disposition` (a file, not a field).
fn has_filename(head: &[u8]) -> bool {
    disposition(head).is_some_and(|line| {
        line.split(|&b| b == b';').skip(1).any(|param| {
            let param = param.trim_ascii();
            param.len() >= 8 && param[..8].eq_ignore_ascii_case(b"filename")
        })
    })
}

/// The `Content-Disposition` line of a part's header block, after the
/// colon.
fn disposition(head: &[u8]) -> Option<&[u8]> {
    head.split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
        .find(|l| l.len() > 20 && l[..20].eq_ignore_ascii_case(b"content-disposition:"))
        .map(|l| &l[20..])
}

/// The `name` parameter of a part's `Content-Disposition: form-data`.
fn field_name(head: &[u8]) -> Option<String> {
    let mut params = disposition(head)?.split(|&b| b == b';');
    if !params
        .next()?
        .trim_ascii()
        .eq_ignore_ascii_case(b"form-data")
    {
        return None;
    }
    params.find_map(|param| {
        let param = param.trim_ascii();
        let eq = param.iter().position(|&b| b == b'=')?;
        if !param[..eq].trim_ascii().eq_ignore_ascii_case(b"name") {
            return None;
        }
        let mut value = param[eq + 1..].trim_ascii();
        if let [b'"', inner @ .., b'"'] = value {
            value = inner;
        }
        String::from_utf8(value.to_vec()).ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const CT: &[u8] = b"multipart/form-data; boundary=XyZ";

    fn form(parts: &[(&str, Option<&str>, &[u8])]) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, filename, value) in parts {
            out.extend_from_slice(b"--XyZ\r\nContent-Disposition: form-data; name=\"");
            out.extend_from_slice(name.as_bytes());
            out.push(b'"');
            if let Some(f) = filename {
                out.extend_from_slice(
                    format!("; filename=\"{f}\"\r\nContent-Type: audio/wav").as_bytes(),
                );
            }
            out.extend_from_slice(b"\r\n\r\n");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"--XyZ--\r\n");
        out
    }

    #[test]
    fn the_model_value_alone_is_replaced() {
        // The file holds CRLFs, dashes and a near-delimiter.
        let audio: &[u8] = b"RIFF\r\n--Xy\r\n--XyY\x00\xff--XyZ";
        let body = form(&[
            ("file", Some("a.wav"), audio),
            ("model", None, b"whisper-1"),
            ("language", None, b"en"),
        ]);
        let req = FormRequest::parse(Bytes::from(body.clone()), CT).unwrap();
        assert_eq!(req.model, "whisper-1");
        assert!(!req.stream);
        let out = req.body_for_target("openai/whisper-large-v3").to_bytes();
        let expected =
            String::from_utf8_lossy(&body).replace("whisper-1", "openai/whisper-large-v3");
        assert_eq!(String::from_utf8_lossy(&out), expected);
        // Everything but the value is the client's bytes, the file exactly.
        let at = memmem::find(&out, audio).unwrap();
        assert_eq!(&out[at..at + audio.len()], audio);
    }

    #[test]
    fn stream_and_quoted_boundaries_are_read() {
        let body = form(&[("model", None, b"m"), ("stream", None, b"true")]);
        let req = FormRequest::parse(
            Bytes::from(body),
            b"Multipart/Form-Data ; boundary=\"XyZ\"; charset=utf-8",
        )
        .unwrap();
        assert_eq!((req.model.as_str(), req.stream), ("m", true));
    }

    #[test]
    fn bad_forms_are_the_clients_errors() {
        let cases: [(&[u8], Vec<u8>, &str); 6] = [
            (b"application/json", b"{}".to_vec(), "multipart/form-data"),
            (
                b"multipart/form-data",
                form(&[("model", None, b"m")]),
                "no boundary",
            ),
            (CT, form(&[("file", Some("a"), b"x")]), "no `model` field"),
            (CT, form(&[("model", None, b"")]), "non-empty"),
            (
                CT,
                b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm".to_vec(),
                "ends inside a part",
            ),
            (CT, b"no delimiter at all".to_vec(), "no boundary line"),
        ];
        for (ct, body, want) in cases {
            let e = FormRequest::parse(Bytes::from(body), ct).unwrap_err();
            let msg = e.body_json()["error"]["message"]
                .as_str()
                .unwrap()
                .to_owned();
            assert!(msg.contains(want), "{msg:?} lacks {want:?}");
            assert_eq!(e.body_json()["error"]["type"], "invalid_request_error");
        }
    }

    #[test]
    fn a_preamble_and_padding_are_allowed() {
        let mut body = b"preamble\r\n--XyZ  \r\n".to_vec();
        body.extend_from_slice(b"Content-Disposition: form-data; name=model\r\n\r\nm2\r\n--XyZ--");
        let req = FormRequest::parse(Bytes::from(body), CT).unwrap();
        assert_eq!(req.model, "m2");
    }

    #[test]
    fn a_prefix_says_where_the_model_is_once_it_came_whole() {
        let body = form(&[
            ("stream", None, b"true"),
            ("model", None, b"whisper-1"),
            ("file", Some("a.wav"), b"RIFF...."),
        ]);
        // Every cut before the model's value ends needs more bytes.
        let model_end = memmem::find(&body, b"whisper-1").unwrap() + 9;
        for cut in 0..model_end + 2 {
            assert_eq!(
                scan_prefix(&body[..cut], CT).unwrap(),
                Prefix::More,
                "cut {cut}"
            );
        }
        // Once the delimiter after it came, the model is known.
        let after = model_end + 2 + 2 + 3;
        let found = scan_prefix(&body[..after], CT).unwrap();
        assert_eq!(
            found,
            Prefix::Model {
                model: "whisper-1".into(),
                value: model_end - 9..model_end,
                stream: true
            }
        );
        assert_eq!(scan_prefix(&body, CT).unwrap(), found);
    }

    #[test]
    fn a_file_before_the_model_is_said_as_soon_as_its_headers_came() {
        let body = form(&[("file", Some("a.wav"), &[0u8; 1000]), ("model", None, b"m")]);
        let head_end = memmem::find(&body, b"audio/wav\r\n\r\n").unwrap() + 13;
        assert_eq!(
            scan_prefix(&body[..head_end - 1], CT).unwrap(),
            Prefix::More
        );
        assert_eq!(
            scan_prefix(&body[..head_end], CT).unwrap(),
            Prefix::FileFirst
        );
        assert_eq!(scan_prefix(&body, CT).unwrap(), Prefix::FileFirst);
        let no_model = form(&[("language", None, b"en")]);
        assert_eq!(scan_prefix(&no_model, CT).unwrap(), Prefix::NoModel);
        let bad = b"--XyZ\r\nno colon here\r\n\r\nx\r\n--XyZ--".to_vec();
        assert!(scan_prefix(&bad, CT).is_err());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bodies_never_panic(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)) {
            let _ = FormRequest::parse(Bytes::from(body), CT);
        }
    }
}
