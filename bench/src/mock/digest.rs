//! Deterministic bytes for the mock's vectors, token ids and audio: a
//! 64-bit FNV-1a hash of the input seeding a SplitMix64 stream, and
//! standard base64. Not cryptographic; only stable across runs and
//! platforms, which is all a test comparing exact bytes needs.

/// FNV-1a (64-bit) of `bytes`.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hasher = Fnv1a::default();
    hasher.update(bytes);
    hasher.finish()
}

/// FNV-1a (64-bit) over bytes fed in pieces.
#[derive(Debug, Clone, Copy)]
pub struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    /// Feeds `bytes`.
    pub fn update(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// The hash of everything fed.
    pub fn finish(&self) -> u64 {
        self.0
    }

    /// The hash as 16 lowercase hex digits.
    pub fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }
}

/// A SplitMix64 stream seeded with `seed`.
#[derive(Debug, Clone)]
pub struct Stream {
    state: u64,
}

impl Stream {
    /// The stream of the FNV-1a hash of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self {
            state: fnv1a(bytes),
        }
    }

    /// The next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// The next value in `[-1, 1)`, a multiple of 2^-23 (exact in `f32`
    /// and in its shortest decimal form).
    pub fn next_unit(&mut self) -> f32 {
        // 24 random bits → an integer in [0, 2^24), exact in f32.
        let bits = (self.next_u64() >> 40) as u32;
        let value = bits as f32 / 8_388_608.0; // 2^23: [0, 2)
        value - 1.0
    }

    /// `len` bytes of the stream.
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len);
        while out.len() < len {
            let word = self.next_u64().to_le_bytes();
            let take = (len - out.len()).min(word.len());
            out.extend_from_slice(&word[..take]);
        }
        out
    }
}

/// The first `hex_chars` lowercase hex digits of the FNV-1a hash of
/// `bytes` (at most 16).
pub fn hex_prefix(bytes: &[u8], hex_chars: usize) -> String {
    let full = format!("{:016x}", fnv1a(bytes));
    full[..hex_chars.min(full.len())].to_string()
}

/// Standard base64 with padding (RFC 4648).
pub fn base64(bytes: &[u8]) -> String {
    iop_engine::base64::encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (bytes, text) in [
            (&b""[..], ""),
            (b"f", "Zg=="),
            (b"fo", "Zm8="),
            (b"foo", "Zm9v"),
            (b"foob", "Zm9vYg=="),
            (b"fooba", "Zm9vYmE="),
            (b"foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(bytes), text);
        }
    }

    #[test]
    fn fnv1a_matches_reference_vectors() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(hex_prefix(b"a", 8), "af63dc4c");
    }

    #[test]
    fn units_are_in_range_and_stable() {
        let mut a = Stream::of(b"hello");
        let mut b = Stream::of(b"hello");
        for _ in 0..1000 {
            let x = a.next_unit();
            assert!((-1.0..1.0).contains(&x), "{x}");
            assert_eq!(x.to_bits(), b.next_unit().to_bits());
        }
        assert_ne!(
            Stream::of(b"hello").next_u64(),
            Stream::of(b"hellp").next_u64()
        );
        assert_eq!(Stream::of(b"x").bytes(11).len(), 11);
        assert_eq!(
            Stream::of(b"x").bytes(11)[..8],
            Stream::of(b"x").bytes(8)[..]
        );
    }
}
