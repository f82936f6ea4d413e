//! The mock's audio routes: `POST /v1/audio/transcriptions` and
//! `POST /v1/audio/translations` (`multipart/form-data` uploads, parsed
//! with [`super::multipart`]) and `POST /v1/audio/speech` (JSON in, binary
//! audio out).
//!
//! # Uploads
//!
//! Parts read: `file` (any bytes: counted and hashed while parsed),
//! `model` (required), `response_format` (`json`, the default, `text` or
//! `verbose_json`), `language`; other text fields are accepted and
//! ignored. Text fields longer than [`MAX_FIELD_BYTES`] are refused. The
//! text is `transcript of <n> bytes <h>` (translations: `translation of
//! …`), `<h>` the first 8 hex digits of the FNV-1a hash of the file
//! ([`super::digest`]):
//!
//! ```text
//! json          {"text":"transcript of 5 bytes a430d846"}
//! text          transcript of 5 bytes a430d846            (text/plain)
//! verbose_json  {"task":"transcribe","language":L,"duration":0.0,"text":…}
//! ```
//!
//! A malformed body is a 400 OpenAI error naming what was wrong.
//!
//! # Speech
//!
//! `{"model","input","voice","response_format"?}` → a binary body: the
//! ASCII header `IOPMOCK <format>\n`, then [`SPEECH_BYTES_PER_CHAR`] bytes
//! per byte of `input` from [`super::digest::Stream::of`] the input; the
//! content type follows the format (`mp3`, the default, is `audio/mpeg`).

use serde::Serialize;
use serde_json::{json, Value};

use super::digest::{Fnv1a, Stream};
use super::multipart::{self, MultipartError, Parser, PartHead, Sink};
use super::openai::error_body;

/// Longest text field of an upload.
pub const MAX_FIELD_BYTES: usize = 1024;

/// Longest speech `input`, in characters (OpenAI's limit).
pub const MAX_SPEECH_CHARS: usize = 4096;

/// Audio bytes per byte of speech `input`.
pub const SPEECH_BYTES_PER_CHAR: usize = 32;

/// Which upload route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// `/v1/audio/transcriptions`.
    Transcription,
    /// `/v1/audio/translations`.
    Translation,
}

/// What the last upload carried, as `GET /admin/stats` reports it under
/// `last_audio`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct AudioSeen {
    /// The `model` field.
    pub model: String,
    /// The `file` part's `filename`, if any.
    pub filename: Option<String>,
    /// Bytes of the `file` part.
    pub file_bytes: u64,
    /// FNV-1a of the file, 16 hex digits.
    pub file_hash: String,
    /// The `response_format` field as sent, if any.
    pub response_format: Option<String>,
    /// The `language` field, if any.
    pub language: Option<String>,
}

/// An audio reply: status, content type, body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AudioReply {
    /// HTTP status.
    pub status: u16,
    /// `content-type`.
    pub content_type: &'static str,
    /// The body.
    pub body: Vec<u8>,
}

impl AudioReply {
    fn json(status: u16, body: String) -> Self {
        Self {
            status,
            content_type: "application/json",
            body: body.into_bytes(),
        }
    }

    fn error(message: &str) -> Self {
        Self::json(400, error_body(message))
    }
}

/// Collects the upload's fields while the parser runs.
#[derive(Default)]
struct Form {
    current: Option<String>,
    file_seen: bool,
    in_file: bool,
    hash: Fnv1a,
    file_bytes: u64,
    filename: Option<String>,
    field: Vec<u8>,
    model: Option<String>,
    response_format: Option<String>,
    language: Option<String>,
}

impl Sink for Form {
    fn start(&mut self, head: &PartHead) -> Result<(), MultipartError> {
        self.in_file = head.name == "file";
        if self.in_file {
            if self.file_seen {
                return Err(MultipartError::Form("more than one file part".into()));
            }
            self.file_seen = true;
            self.filename = head.filename.clone();
        }
        self.current = Some(head.name.clone());
        self.field.clear();
        Ok(())
    }

    fn data(&mut self, bytes: &[u8]) -> Result<(), MultipartError> {
        if self.in_file {
            self.hash.update(bytes);
            self.file_bytes += bytes.len() as u64;
            return Ok(());
        }
        if self.field.len() + bytes.len() > MAX_FIELD_BYTES {
            let name = self.current.as_deref().unwrap_or("");
            return Err(MultipartError::Form(format!(
                "form field {name:?} exceeds {MAX_FIELD_BYTES} bytes"
            )));
        }
        self.field.extend_from_slice(bytes);
        Ok(())
    }

    fn end(&mut self) -> Result<(), MultipartError> {
        let name = self.current.take().unwrap_or_default();
        if self.in_file {
            self.in_file = false;
            return Ok(());
        }
        let text = String::from_utf8(std::mem::take(&mut self.field))
            .map_err(|_| MultipartError::Form(format!("form field {name:?} is not UTF-8")))?;
        match name.as_str() {
            "model" => self.model = Some(text),
            "response_format" => self.response_format = Some(text),
            "language" => self.language = Some(text),
            _ => {}
        }
        Ok(())
    }
}

/// Parses an upload of `content_type` with `body`; `Err` is the 400
/// message.
fn parse_upload(content_type: Option<&str>, body: &[u8]) -> Result<Form, String> {
    let content_type = content_type.ok_or("content-type must be multipart/form-data (got none)")?;
    let boundary = multipart::boundary(content_type).map_err(|e| e.to_string())?;
    let mut parser = Parser::new(&boundary);
    let mut form = Form::default();
    // The body is already in memory; feeding it in pieces keeps the parser
    // on the path a streamed body takes.
    for piece in body.chunks(64 * 1024) {
        parser.feed(piece, &mut form).map_err(|e| e.to_string())?;
    }
    parser.finish().map_err(|e| e.to_string())?;
    if !form.file_seen {
        return Err("missing file part \"file\"".into());
    }
    if form.model.as_deref().is_none_or(str::is_empty) {
        return Err("missing form field \"model\"".into());
    }
    Ok(form)
}

/// A transcription or translation upload. Returns what the upload carried
/// (for the counters) when it parsed.
pub fn upload(
    task: Task,
    content_type: Option<&str>,
    body: &[u8],
) -> (AudioReply, Option<AudioSeen>) {
    let form = match parse_upload(content_type, body) {
        Ok(form) => form,
        Err(message) => return (AudioReply::error(&message), None),
    };
    let seen = AudioSeen {
        model: form.model.clone().unwrap_or_default(),
        filename: form.filename.clone(),
        file_bytes: form.file_bytes,
        file_hash: form.hash.hex(),
        response_format: form.response_format.clone(),
        language: form.language.clone(),
    };
    let noun = match task {
        Task::Transcription => "transcript",
        Task::Translation => "translation",
    };
    let text = format!(
        "{noun} of {} bytes {}",
        seen.file_bytes,
        &seen.file_hash[..8]
    );
    let reply = match seen.response_format.as_deref().unwrap_or("json") {
        "json" => AudioReply::json(200, json!({ "text": text }).to_string()),
        "text" => AudioReply {
            status: 200,
            content_type: "text/plain; charset=utf-8",
            body: text.into_bytes(),
        },
        "verbose_json" => AudioReply::json(
            200,
            json!({
                "task": match task { Task::Transcription => "transcribe", Task::Translation => "translate" },
                "language": seen.language.as_deref().unwrap_or("english"),
                "duration": 0.0,
                "text": text,
            })
            .to_string(),
        ),
        other => AudioReply::error(&format!(
            "response_format {other:?} is not supported (json, text, verbose_json)"
        )),
    };
    (reply, Some(seen))
}

/// The content type of a speech `response_format`.
pub fn speech_content_type(format: &str) -> Option<&'static str> {
    Some(match format {
        "mp3" => "audio/mpeg",
        "opus" => "audio/ogg",
        "aac" => "audio/aac",
        "flac" => "audio/flac",
        "wav" => "audio/wav",
        "pcm" => "audio/pcm",
        _ => return None,
    })
}

/// The speech body of `input` in `format` (see the module docs).
pub fn speech_bytes(format: &str, input: &str) -> Vec<u8> {
    let mut body = format!("IOPMOCK {format}\n").into_bytes();
    let len = input.len().saturating_mul(SPEECH_BYTES_PER_CHAR);
    body.extend(Stream::of(input.as_bytes()).bytes(len));
    body
}

/// `POST /v1/audio/speech`.
pub fn speech(body: &[u8]) -> AudioReply {
    let result = (|| -> Result<AudioReply, String> {
        let value: Value = serde_json::from_slice(body)
            .map_err(|e| format!("invalid speech request body: {e}"))?;
        for field in ["model", "voice"] {
            if !value.get(field).is_some_and(Value::is_string) {
                return Err(format!("{field} is required (a string)"));
            }
        }
        let input = value
            .get("input")
            .and_then(Value::as_str)
            .ok_or("input is required (a string)")?;
        if input.chars().count() > MAX_SPEECH_CHARS {
            return Err(format!("input exceeds {MAX_SPEECH_CHARS} characters"));
        }
        let format = match value.get("response_format") {
            None | Some(Value::Null) => "mp3",
            Some(v) => v.as_str().ok_or("response_format must be a string")?,
        };
        let content_type = speech_content_type(format)
            .ok_or(format!("response_format {format:?} is not supported"))?;
        Ok(AudioReply {
            status: 200,
            content_type,
            body: speech_bytes(format, input),
        })
    })();
    result.unwrap_or_else(|message| AudioReply::error(&message))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CT: &str = "multipart/form-data; boundary=b0";

    fn form(parts: &[(&str, &[u8])]) -> Vec<u8> {
        let mut body = Vec::new();
        for (name, value) in parts {
            body.extend_from_slice(b"--b0\r\nContent-Disposition: form-data; name=\"");
            body.extend_from_slice(name.as_bytes());
            body.extend_from_slice(b"\"");
            if *name == "file" {
                body.extend_from_slice(b"; filename=\"a.wav\"");
            }
            body.extend_from_slice(b"\r\n\r\n");
            body.extend_from_slice(value);
            body.extend_from_slice(b"\r\n");
        }
        body.extend_from_slice(b"--b0--\r\n");
        body
    }

    #[test]
    fn transcription_counts_and_hashes_the_file() {
        let body = form(&[
            ("file", b"hello"),
            ("model", b"whisper-1"),
            ("language", b"de"),
        ]);
        let (reply, seen) = upload(Task::Transcription, Some(CT), &body);
        let hash = Fnv1a::default();
        let mut hash = hash;
        hash.update(b"hello");
        let expected = format!(r#"{{"text":"transcript of 5 bytes {}"}}"#, &hash.hex()[..8]);
        assert_eq!(
            (reply.status, reply.content_type),
            (200, "application/json")
        );
        assert_eq!(String::from_utf8(reply.body).expect("utf-8"), expected);
        let seen = seen.expect("parsed");
        assert_eq!(seen.model, "whisper-1");
        assert_eq!(seen.file_bytes, 5);
        assert_eq!(seen.language.as_deref(), Some("de"));
        assert_eq!(seen.filename.as_deref(), Some("a.wav"));
    }

    #[test]
    fn text_format_is_plain() {
        let body = form(&[("model", b"w"), ("response_format", b"text"), ("file", b"")]);
        let (reply, _) = upload(Task::Translation, Some(CT), &body);
        assert_eq!(reply.content_type, "text/plain; charset=utf-8");
        assert_eq!(reply.body, b"translation of 0 bytes cbf29ce4");
    }

    #[test]
    fn malformed_uploads_are_400_naming_the_fault() {
        let cases: [(Option<&str>, Vec<u8>, &str); 6] = [
            (None, form(&[("file", b"x"), ("model", b"w")]), "got none"),
            (
                Some("multipart/form-data"),
                form(&[("file", b"x")]),
                "no boundary",
            ),
            (Some(CT), form(&[("model", b"w")]), "missing file part"),
            (
                Some(CT),
                form(&[("file", b"x")]),
                "missing form field \\\"model\\\"",
            ),
            (
                Some(CT),
                b"--b0\r\nContent-Disposition: form-data; name=file\r\n\r\nabc".to_vec(),
                "truncated",
            ),
            (
                Some(CT),
                form(&[("file", b"x"), ("model", &[b'm'; 1025])]),
                "exceeds 1024 bytes",
            ),
        ];
        for (content_type, body, needle) in cases {
            let (reply, seen) = upload(Task::Transcription, content_type, &body);
            assert_eq!(reply.status, 400);
            assert!(seen.is_none());
            let text = String::from_utf8(reply.body).expect("utf-8");
            assert!(text.contains(needle), "{text} lacks {needle}");
            assert!(
                text.contains("\"type\":\"invalid_request_error\""),
                "{text}"
            );
        }
    }

    #[test]
    fn speech_is_deterministic_and_sized_by_input() {
        let reply = speech(br#"{"model":"tts-1","input":"hi","voice":"alloy"}"#);
        assert_eq!((reply.status, reply.content_type), (200, "audio/mpeg"));
        assert_eq!(&reply.body[..12], b"IOPMOCK mp3\n");
        assert_eq!(reply.body.len(), 12 + 2 * SPEECH_BYTES_PER_CHAR);
        assert_eq!(reply.body, speech_bytes("mp3", "hi"));
        assert_ne!(reply.body[12..], speech_bytes("mp3", "ho")[12..]);
        let wav = speech(br#"{"model":"t","input":"hi","voice":"v","response_format":"wav"}"#);
        assert_eq!(wav.content_type, "audio/wav");
        assert_eq!(speech(br#"{"model":"t","input":"hi"}"#).status, 400);
        assert_eq!(
            speech(br#"{"model":"t","input":"hi","voice":"v","response_format":"ogg"}"#).status,
            400
        );
    }
}
