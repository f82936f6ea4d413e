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
        let name = std::str::from_utf8(&body[value.clone()])
            .ok()
            .filter(|m| !m.is_empty() && m.len() <= MAX_MODEL_BYTES)
            .ok_or_else(|| {
                GatewayError::invalid_request(
                    "`model` must be a non-empty UTF-8 string of at most 256 bytes.",
                    Some("model"),
                )
            })?
            .to_owned();
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

/// One part: its field name and where its value lies in the body.
#[derive(Debug)]
struct Part {
    name: String,
    value: Range<usize>,
}

/// The parts of `body`, in order; an error ends the iteration.
fn parts<'a>(
    body: &'a [u8],
    boundary: &'a [u8],
) -> Result<impl Iterator<Item = Result<Part, GatewayError>> + 'a, GatewayError> {
    let malformed = |why: &str| {
        GatewayError::invalid_request(format!("The multipart body is malformed: {why}."), None)
    };
    // The first delimiter may open the body (no CRLF before it); every
    // later one follows a CRLF, which belongs to it, not to the value.
    let mut opening = Vec::with_capacity(boundary.len() + 2);
    opening.extend_from_slice(b"--");
    opening.extend_from_slice(boundary);
    let mut delimiter = Vec::with_capacity(boundary.len() + 4);
    delimiter.extend_from_slice(b"\r\n--");
    delimiter.extend_from_slice(boundary);
    let start = if body.starts_with(&opening) {
        opening.len()
    } else {
        memmem::find(body, &delimiter)
            .map(|at| at + delimiter.len())
            .ok_or_else(|| malformed("no boundary line"))?
    };
    let finder = memmem::Finder::new(&delimiter).into_owned();
    let mut at = Some(start);
    Ok(std::iter::from_fn(move || {
        let after_delimiter = at.take()?;
        let rest = &body[after_delimiter..];
        if rest.starts_with(b"--") {
            // The close delimiter: the epilogue is ignored.
            return None;
        }
        // Transport padding, then the line's CRLF.
        let padding = rest
            .iter()
            .take_while(|&&b| b == b' ' || b == b'\t')
            .count();
        if !rest[padding..].starts_with(b"\r\n") {
            return Some(Err(malformed("a boundary line does not end in CRLF")));
        }
        let head_start = after_delimiter + padding + 2;
        let head_window = &body[head_start..body.len().min(head_start + MAX_PART_HEAD_BYTES)];
        let Some(head_len) = memmem::find(head_window, b"\r\n\r\n")
            .map(|n| n + 4)
            .or_else(|| head_window.starts_with(b"\r\n").then_some(2))
        else {
            return Some(Err(malformed(
                "a part's headers do not end (or exceed 8 KiB)",
            )));
        };
        let value_start = head_start + head_len;
        let Some(value_len) = finder.find(&body[value_start..]) else {
            return Some(Err(malformed("the body ends inside a part")));
        };
        let value_end = value_start + value_len;
        at = Some(value_end + finder.needle().len());
        let name = match field_name(&body[head_start..value_start]) {
            Some(name) => name,
            None => {
                return Some(Err(malformed(
                    "a part has no Content-Disposition: form-data name",
                )))
            }
        };
        Some(Ok(Part {
            name,
            value: value_start..value_end,
        }))
    }))
}

/// The `name` parameter of a part's `Content-Disposition: form-data`.
fn field_name(head: &[u8]) -> Option<String> {
    let line = head
        .split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
        .find(|l| l.len() > 20 && l[..20].eq_ignore_ascii_case(b"content-disposition:"))?;
    let mut params = line[20..].split(|&b| b == b';');
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

    proptest::proptest! {
        #[test]
        fn arbitrary_bodies_never_panic(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)) {
            let _ = FormRequest::parse(Bytes::from(body), CT);
        }
    }
}
