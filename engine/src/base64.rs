//! Standard base64 with padding (RFC 4648): PEM bodies (zeroizing, in
//! [`crate::keys`]), embeddings' `encoding_format: "base64"` at the Edge,
//! the mock provider's vectors. One small encoder rather than a crate: the
//! key code needs it to write into a zeroizing buffer it sized itself.

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// The base64 of `bytes`.
pub fn encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(encoded_len(bytes.len()));
    encode_into(bytes, &mut out);
    out
}

/// Characters of the base64 of `len` bytes.
pub fn encoded_len(len: usize) -> usize {
    len.div_ceil(3) * 4
}

/// Appends the base64 of `bytes` to `out` (which never grows past the
/// capacity it was given when that is at least [`encoded_len`] more).
pub fn encode_into(bytes: &[u8], out: &mut String) {
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 0x3f) as usize]));
            } else {
                out.push('=');
            }
        }
    }
}

/// Decodes `text` (padding required, as PEM writes it) by appending to
/// `out`; false (with `out` partly written) for anything that is not
/// base64.
pub fn decode_into(text: &str, out: &mut Vec<u8>) -> bool {
    let text = text.as_bytes();
    if text.is_empty() || text.len() % 4 != 0 {
        return false;
    }
    let last = text.len() / 4 - 1;
    for (index, quad) in text.chunks(4).enumerate() {
        let pad = quad.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && index != last) {
            return false;
        }
        let mut n = 0u32;
        for &c in &quad[..4 - pad] {
            let value = match c {
                b'A'..=b'Z' => c - b'A',
                b'a'..=b'z' => c - b'a' + 26,
                b'0'..=b'9' => c - b'0' + 52,
                b'+' => 62,
                b'/' => 63,
                _ => return false,
            };
            n = (n << 6) | u32::from(value);
        }
        n <<= 6 * pad as u32;
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..3 - pad]);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc4648_vectors_both_ways() {
        for (bytes, text) in [
            (&b"f"[..], "Zg=="),
            (b"fo", "Zm8="),
            (b"foo", "Zm9v"),
            (b"foob", "Zm9vYg=="),
            (b"fooba", "Zm9vYmE="),
            (b"foobar", "Zm9vYmFy"),
            (b"\xff\xfe\x00", "//4A"),
        ] {
            assert_eq!(encode(bytes), text);
            assert_eq!(encoded_len(bytes.len()), text.len());
            let mut out = Vec::new();
            assert!(decode_into(text, &mut out));
            assert_eq!(out, bytes);
        }
        for bad in ["", "Zg=", "Zg=a", "Z===", "Zm9v!A==", "Zg==Zg=="] {
            assert!(!decode_into(bad, &mut Vec::new()), "{bad}");
        }
    }
}
