//! Credential-lease keys on disk and OS randomness for leases (C1, C4).
//!
//! The Edge holds an Ed25519 issuer key, each managed Node an X25519
//! recipient key. Private keys are PKCS#8 PEM files (RFC 5958 / RFC 8410),
//! what `openssl genpkey -algorithm ed25519` (or `x25519`) writes and
//! `openssl pkey` reads:
//!
//! ```text
//! -----BEGIN PRIVATE KEY-----
//! MC4CAQAwBQYDK2VwBCIEI…            (base64 of 48 bytes of DER)
//! -----END PRIVATE KEY-----
//! ```
//!
//! The DER is decoded by hand ([`pkcs8`]): `PrivateKeyInfo` version 0 or 1,
//! the algorithm OID with no parameters, the 32-byte key in an OCTET STRING,
//! optional attributes (ignored) and, in version 1, an optional public key
//! that must match. Encrypted PKCS#8 is refused with a hint.
//!
//! The format of earlier releases still loads (the body is the lowercase
//! hex of the 32-byte seed); `keys issuer` / `keys recipient` write PKCS#8:
//!
//! ```text
//! -----BEGIN IOP ISSUER KEY-----          -----BEGIN IOP RECIPIENT KEY-----
//! <64 hex digits>                         <64 hex digits>
//! -----END IOP ISSUER KEY-----            -----END IOP RECIPIENT KEY-----
//! ```
//!
//! Files are created with mode 0600 and never overwritten; loading refuses a
//! file any group/other permission bit is set on (`mode & 0o077 != 0`).
//! Errors name the file and the reason, never the contents. Seeds, DER and
//! file contents are zeroized after use.
//!
//! Public keys travel in config files as text: `ed25519:<64 hex>` for the
//! issuer key (held by Nodes), `x25519:<64 hex>` for a recipient key (held in
//! the Edge's node entry).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use ed25519_dalek::{SigningKey, VerifyingKey};
use iop_wire::lease::{decode_hex, decode_hex_into, encode_hex, LeaseEntropy, RecipientKey};
use x25519_dalek::PublicKey;
use zeroize::Zeroizing;

/// Mode of created private key files.
pub const KEY_FILE_MODE: u32 = 0o600;
/// Largest private key file read (the format needs under 128 bytes).
pub const MAX_KEY_FILE_BYTES: u64 = 4096;
/// Text prefix of an encoded issuer public key.
pub const ISSUER_PUBLIC_PREFIX: &str = "ed25519:";
/// Text prefix of an encoded recipient public key.
pub const RECIPIENT_PUBLIC_PREFIX: &str = "x25519:";

/// PEM label of an unencrypted PKCS#8 private key.
pub const PKCS8_LABEL: &str = "PRIVATE KEY";

/// Which of the two private keys a file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    /// The Edge's Ed25519 issuer key.
    Issuer,
    /// A Node's X25519 recipient key.
    Recipient,
}

impl KeyKind {
    /// The PEM label of the earlier IOP format.
    fn legacy_label(self) -> &'static str {
        match self {
            KeyKind::Issuer => "IOP ISSUER KEY",
            KeyKind::Recipient => "IOP RECIPIENT KEY",
        }
    }

    /// The RFC 8410 algorithm this key is.
    fn algorithm(self) -> pkcs8::Algorithm {
        match self {
            KeyKind::Issuer => pkcs8::Algorithm::Ed25519,
            KeyKind::Recipient => pkcs8::Algorithm::X25519,
        }
    }

    fn other(self) -> Self {
        match self {
            KeyKind::Issuer => KeyKind::Recipient,
            KeyKind::Recipient => KeyKind::Issuer,
        }
    }
}

/// Why a key could not be generated, stored, loaded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// Creating or writing the key file failed (including: it already exists).
    #[error("cannot write key file {path}: {source}")]
    Write {
        /// The key file.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// Opening or reading the key file failed.
    #[error("cannot read key file {path}: {source}")]
    Read {
        /// The key file.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The private key file is accessible to group or others.
    #[error(
        "key file {path} has mode {mode:04o}; a private key must not be accessible \
         to group or others (chmod 600)"
    )]
    InsecurePermissions {
        /// The key file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The key file is not in the documented format.
    #[error("key file {path} is invalid: {reason}")]
    Parse {
        /// The key file.
        path: PathBuf,
        /// What is wrong (never the contents).
        reason: &'static str,
    },
    /// A public key string from configuration is not valid.
    #[error("invalid public key: {reason}")]
    PublicKey {
        /// What is wrong.
        reason: &'static str,
    },
    /// The OS random source failed.
    #[error("OS random source failed: {0}")]
    Random(getrandom::Error),
}

/// 32 fresh random bytes from the OS in a zeroizing buffer (a key or seed).
pub fn random_key() -> Result<Zeroizing<[u8; 32]>, KeyError> {
    let mut seed = Zeroizing::new([0u8; 32]);
    getrandom::fill(&mut seed[..]).map_err(KeyError::Random)?;
    Ok(seed)
}

/// Fresh per-lease randomness from the OS, written straight into the
/// zeroizing [`LeaseEntropy`] (no copy of the seed is left on the stack).
pub fn lease_entropy() -> Result<LeaseEntropy, KeyError> {
    LeaseEntropy::fill(getrandom::fill).map_err(KeyError::Random)
}

/// A fresh random lease id: 32 lowercase hex digits (128 bits).
pub fn random_lease_id() -> Result<String, KeyError> {
    let mut id = [0u8; 16];
    getrandom::fill(&mut id).map_err(KeyError::Random)?;
    Ok(encode_hex(&id))
}

/// Removes the environment variable `name` from this process after its
/// secret was read: children no longer inherit it, and its original bytes
/// in the process's initial environment block — what `/proc/<pid>/environ`
/// shows, which removing a variable does not change — are overwritten with
/// zeros (through `/proc/self/mem`). Returns whether the initial block held
/// it. Call it while the process has one thread, before anything else reads
/// the environment concurrently.
pub fn scrub_env_var(name: &str) -> io::Result<bool> {
    std::env::remove_var(name);
    let (env_start, env_end) = initial_environment_range()?;
    let block = Zeroizing::new(fs::read("/proc/self/environ")?);
    if block.len() as u64 > env_end.saturating_sub(env_start) {
        return Err(io::Error::other(
            "/proc/self/environ is larger than the environment block",
        ));
    }
    let mut prefix = Vec::with_capacity(name.len() + 1);
    prefix.extend_from_slice(name.as_bytes());
    prefix.push(b'=');
    let mut memory = None;
    let mut offset = 0u64;
    let mut found = false;
    for entry in block.split(|&b| b == 0) {
        if entry.starts_with(&prefix) {
            let memory = match &mut memory {
                Some(m) => m,
                None => memory.insert(OpenOptions::new().write(true).open("/proc/self/mem")?),
            };
            memory.seek(SeekFrom::Start(env_start + offset))?;
            memory.write_all(&vec![0; entry.len()])?;
            found = true;
        }
        offset += entry.len() as u64 + 1;
    }
    Ok(found)
}

/// `env_start` and `env_end` of this process (fields 50 and 51 of
/// `/proc/self/stat`): where the initial environment block lies.
fn initial_environment_range() -> io::Result<(u64, u64)> {
    let stat = fs::read_to_string("/proc/self/stat")?;
    let malformed = || io::Error::other("unexpected /proc/self/stat format");
    // The command name (field 2) may contain spaces and parentheses; the
    // fields after its closing parenthesis start at field 3.
    let after_name = stat
        .rfind(')')
        .map(|i| &stat[i + 1..])
        .ok_or_else(malformed)?;
    let mut fields = after_name.split_whitespace().skip(50 - 3);
    let mut next = || {
        fields
            .next()
            .and_then(|f| f.parse::<u64>().ok())
            .ok_or_else(malformed)
    };
    let start = next()?;
    let end = next()?;
    if start == 0 || end < start {
        return Err(malformed());
    }
    Ok((start, end))
}

/// Generates an Ed25519 issuer key, writes it to `path` (new file, mode
/// 0600) and returns the public half.
pub fn generate_issuer_key(path: &Path) -> Result<VerifyingKey, KeyError> {
    let seed = random_key()?;
    let key = SigningKey::from_bytes(&seed);
    write_key_file(path, KeyKind::Issuer, &seed)?;
    Ok(key.verifying_key())
}

/// Generates an X25519 recipient key, writes it to `path` (new file, mode
/// 0600) and returns the public half.
pub fn generate_recipient_key(path: &Path) -> Result<PublicKey, KeyError> {
    let seed = random_key()?;
    let public = RecipientKey::from_bytes(&seed).public_key();
    write_key_file(path, KeyKind::Recipient, &seed)?;
    Ok(public)
}

/// Loads the Edge's Ed25519 issuer key from `path` (PKCS#8 PEM or the
/// earlier IOP format). A PKCS#8 file that carries a public key must carry
/// this key's.
pub fn load_issuer_key(path: &Path) -> Result<SigningKey, KeyError> {
    let KeyFile { private, public } = read_key_file(path, KeyKind::Issuer)?;
    let key = SigningKey::from_bytes(&private);
    if public.is_some_and(|p| p != key.verifying_key().to_bytes()) {
        return Err(KeyError::Parse {
            path: path.to_owned(),
            reason: "the public key in the file does not match its private key",
        });
    }
    Ok(key)
}

/// Loads a Node's X25519 recipient key from `path` (PKCS#8 PEM or the
/// earlier IOP format). A PKCS#8 file that carries a public key must carry
/// this key's.
pub fn load_recipient_key(path: &Path) -> Result<RecipientKey, KeyError> {
    let KeyFile { private, public } = read_key_file(path, KeyKind::Recipient)?;
    let key = RecipientKey::from_bytes(&private);
    if public.is_some_and(|p| p != key.public_key().to_bytes()) {
        return Err(KeyError::Parse {
            path: path.to_owned(),
            reason: "the public key in the file does not match its private key",
        });
    }
    Ok(key)
}

/// `ed25519:<hex>` text form of an issuer public key.
pub fn encode_issuer_public_key(key: &VerifyingKey) -> String {
    format!("{ISSUER_PUBLIC_PREFIX}{}", encode_hex(key.as_bytes()))
}

/// Parses [`encode_issuer_public_key`] output; refuses invalid and weak
/// (small-order) keys.
pub fn decode_issuer_public_key(text: &str) -> Result<VerifyingKey, KeyError> {
    let bytes = decode_public(
        text,
        ISSUER_PUBLIC_PREFIX,
        "expected ed25519:<64 hex digits>",
    )?;
    let key = VerifyingKey::from_bytes(&bytes).map_err(|_| KeyError::PublicKey {
        reason: "not an Ed25519 public key",
    })?;
    if key.is_weak() {
        return Err(KeyError::PublicKey {
            reason: "weak Ed25519 public key",
        });
    }
    Ok(key)
}

/// `x25519:<hex>` text form of a recipient public key.
pub fn encode_recipient_public_key(key: &PublicKey) -> String {
    format!("{RECIPIENT_PUBLIC_PREFIX}{}", encode_hex(key.as_bytes()))
}

/// Parses [`encode_recipient_public_key`] output. (A low-order key is caught
/// when a lease is issued to it.)
pub fn decode_recipient_public_key(text: &str) -> Result<PublicKey, KeyError> {
    let bytes = decode_public(
        text,
        RECIPIENT_PUBLIC_PREFIX,
        "expected x25519:<64 hex digits>",
    )?;
    Ok(PublicKey::from(bytes))
}

fn decode_public(text: &str, prefix: &str, reason: &'static str) -> Result<[u8; 32], KeyError> {
    text.trim()
        .strip_prefix(prefix)
        .and_then(decode_hex::<32>)
        .ok_or(KeyError::PublicKey { reason })
}

fn write_key_file(path: &Path, kind: KeyKind, seed: &[u8; 32]) -> Result<(), KeyError> {
    let der = pkcs8::encode_v1(kind.algorithm(), seed);
    let body = pkcs8::base64_encode(&der[..]);
    let mut text = Zeroizing::new(String::with_capacity(
        2 * PKCS8_LABEL.len() + body.len() + 64,
    ));
    for part in [
        "-----BEGIN ",
        PKCS8_LABEL,
        "-----\n",
        &body,
        "\n-----END ",
        PKCS8_LABEL,
        "-----\n",
    ] {
        text.push_str(part);
    }
    let write_err = |source| KeyError::Write {
        path: path.to_owned(),
        source,
    };
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(KEY_FILE_MODE)
        .open(path)
        .map_err(write_err)?;
    let written = file
        .write_all(text.as_bytes())
        .and_then(|()| file.sync_all());
    if let Err(source) = written {
        drop(file);
        // Best effort: do not leave a truncated key behind.
        let _ = fs::remove_file(path);
        return Err(write_err(source));
    }
    Ok(())
}

/// What a key file holds.
struct KeyFile {
    /// The 32-byte private key (Ed25519 seed or X25519 scalar).
    private: Zeroizing<[u8; 32]>,
    /// The public key a PKCS#8 version-1 structure carries beside it.
    public: Option<[u8; 32]>,
}

fn read_key_file(path: &Path, kind: KeyKind) -> Result<KeyFile, KeyError> {
    let read_err = |source| KeyError::Read {
        path: path.to_owned(),
        source,
    };
    let parse_err = |reason| KeyError::Parse {
        path: path.to_owned(),
        reason,
    };
    let file = File::open(path).map_err(read_err)?;
    // Check the opened file, not the path, so the check and the read agree.
    let meta = file.metadata().map_err(read_err)?;
    if !meta.is_file() {
        return Err(parse_err("not a regular file"));
    }
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(KeyError::InsecurePermissions {
            path: path.to_owned(),
            mode,
        });
    }
    // Allocated once at the cap so reading never reallocates (no stray copies).
    let mut raw = Zeroizing::new(Vec::with_capacity(MAX_KEY_FILE_BYTES as usize + 1));
    file.take(MAX_KEY_FILE_BYTES + 1)
        .read_to_end(&mut raw)
        .map_err(read_err)?;
    if raw.len() as u64 > MAX_KEY_FILE_BYTES {
        return Err(parse_err("file too large"));
    }
    let text = std::str::from_utf8(&raw).map_err(|_| parse_err("not UTF-8 text"))?;
    let mut lines = text.lines().map(str::trim).filter(|line| !line.is_empty());
    let begin = lines.next().ok_or_else(|| parse_err("empty file"))?;
    let label = begin
        .strip_prefix("-----BEGIN ")
        .and_then(|rest| rest.strip_suffix("-----"))
        .ok_or_else(|| parse_err("missing BEGIN line"))?;
    let end_line = |lines: &mut dyn Iterator<Item = &str>| -> Result<(), KeyError> {
        if lines.next().is_some() {
            return Err(parse_err("data after END line"));
        }
        Ok(())
    };
    if label == PKCS8_LABEL {
        let mut body = Zeroizing::new(String::with_capacity(text.len()));
        let mut ended = false;
        for line in lines.by_ref() {
            if let Some(rest) = line.strip_prefix("-----END ") {
                if rest.strip_suffix("-----") != Some(PKCS8_LABEL) {
                    return Err(parse_err("missing END line"));
                }
                ended = true;
                break;
            }
            body.push_str(line);
        }
        if !ended {
            return Err(parse_err("missing END line"));
        }
        end_line(&mut lines)?;
        let der = pkcs8::base64_decode(&body).ok_or_else(|| parse_err("PEM body is not base64"))?;
        let key =
            pkcs8::decode_as(&der, kind.algorithm()).map_err(|e| parse_err(e.reason(kind)))?;
        return Ok(KeyFile {
            private: key.private,
            public: key.public,
        });
    }
    if label == "ENCRYPTED PRIVATE KEY" {
        return Err(parse_err(
            "encrypted PKCS#8 is not supported (decrypt it: openssl pkey -in FILE -out NEW)",
        ));
    }
    if label != kind.legacy_label() {
        return Err(parse_err(
            match (label == kind.other().legacy_label(), kind) {
                (true, KeyKind::Issuer) => {
                    "an IOP RECIPIENT KEY file where an issuer key is expected"
                }
                (true, KeyKind::Recipient) => {
                    "an IOP ISSUER KEY file where a recipient key is expected"
                }
                (false, KeyKind::Issuer) => "not a PKCS#8 PRIVATE KEY or IOP ISSUER KEY file",
                (false, KeyKind::Recipient) => "not a PKCS#8 PRIVATE KEY or IOP RECIPIENT KEY file",
            },
        ));
    }
    let body = lines.next().ok_or_else(|| parse_err("missing key line"))?;
    let mut seed = Zeroizing::new([0u8; 32]);
    if !decode_hex_into(body, &mut seed) {
        return Err(parse_err("key line is not 64 hex digits"));
    }
    let end = lines.next().ok_or_else(|| parse_err("missing END line"))?;
    let end_kind = end
        .strip_prefix("-----END ")
        .and_then(|rest| rest.strip_suffix("-----"));
    if end_kind != Some(kind.legacy_label()) {
        return Err(parse_err("missing END line"));
    }
    end_line(&mut lines)?;
    Ok(KeyFile {
        private: seed,
        public: None,
    })
}

/// PKCS#8 `PrivateKeyInfo` / `OneAsymmetricKey` for the two RFC 8410 curve
/// keys, decoded and encoded by hand (a few fixed DER shapes), and the
/// base64 of PEM bodies. Every buffer that holds key bytes is zeroizing.
pub mod pkcs8 {
    use zeroize::Zeroizing;

    /// `id-Ed25519`, 1.3.101.112.
    const OID_ED25519: &[u8] = &[0x2b, 0x65, 0x70];
    /// `id-X25519`, 1.3.101.110.
    const OID_X25519: &[u8] = &[0x2b, 0x65, 0x6e];

    /// DER length of a version-0 key: SEQUENCE { INTEGER 0, SEQUENCE { OID },
    /// OCTET STRING { OCTET STRING (32) } }.
    pub const V1_DER_BYTES: usize = 48;

    /// An RFC 8410 algorithm.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Algorithm {
        /// Ed25519 signatures (the issuer key).
        Ed25519,
        /// X25519 key agreement (a recipient key).
        X25519,
    }

    impl Algorithm {
        fn oid(self) -> &'static [u8] {
            match self {
                Algorithm::Ed25519 => OID_ED25519,
                Algorithm::X25519 => OID_X25519,
            }
        }
    }

    /// A decoded key.
    #[derive(Debug)]
    pub struct DecodedKey {
        /// Its algorithm.
        pub algorithm: Algorithm,
        /// The 32-byte private key (Ed25519 seed or X25519 scalar).
        pub private: Zeroizing<[u8; 32]>,
        /// The public key a version-1 structure carries, if it does.
        pub public: Option<[u8; 32]>,
    }

    /// Why a DER structure is not a key we read.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Pkcs8Error {
        /// Not DER of a PKCS#8 `PrivateKeyInfo` of the shape RFC 8410 gives.
        Malformed,
        /// A well-formed key of another algorithm (RSA, EC, …).
        OtherAlgorithm,
        /// The other one of Ed25519 and X25519.
        WrongCurve(Algorithm),
    }

    impl Pkcs8Error {
        /// The reason for a key file error, for a file that should hold a
        /// `kind` key.
        pub(super) fn reason(self, kind: super::KeyKind) -> &'static str {
            use super::KeyKind;
            match (self, kind) {
                (Pkcs8Error::Malformed, _) => {
                    "not an unencrypted RFC 8410 PKCS#8 key (expected what openssl genpkey writes)"
                }
                (Pkcs8Error::OtherAlgorithm, KeyKind::Issuer) => {
                    "the PKCS#8 key is not Ed25519; an issuer key must be \
                     (openssl genpkey -algorithm ed25519)"
                }
                (Pkcs8Error::OtherAlgorithm, KeyKind::Recipient) => {
                    "the PKCS#8 key is not X25519; a recipient key must be \
                     (openssl genpkey -algorithm x25519)"
                }
                (Pkcs8Error::WrongCurve(_), KeyKind::Issuer) => {
                    "the PKCS#8 key is X25519 (a recipient key); an issuer key must be Ed25519 \
                     (openssl genpkey -algorithm ed25519)"
                }
                (Pkcs8Error::WrongCurve(_), KeyKind::Recipient) => {
                    "the PKCS#8 key is Ed25519 (an issuer key); a recipient key must be X25519 \
                     (openssl genpkey -algorithm x25519)"
                }
            }
        }
    }

    /// Reads DER tag-length-value items from a slice (definite lengths of
    /// at most two bytes, which every key here fits in).
    struct Der<'a>(&'a [u8]);

    impl<'a> Der<'a> {
        fn next(&mut self) -> Result<(u8, &'a [u8]), Pkcs8Error> {
            let malformed = Pkcs8Error::Malformed;
            let (&tag, rest) = self.0.split_first().ok_or(malformed)?;
            let (&first, mut rest) = rest.split_first().ok_or(malformed)?;
            let len = if first < 0x80 {
                usize::from(first)
            } else {
                let count = usize::from(first & 0x7f);
                if count == 0 || count > 2 || rest.len() < count {
                    return Err(malformed);
                }
                let len = rest[..count]
                    .iter()
                    .fold(0usize, |len, &b| (len << 8) | usize::from(b));
                rest = &rest[count..];
                // DER: the long form only for lengths that need it.
                if len < 0x80 || (count == 2 && len < 0x100) {
                    return Err(malformed);
                }
                len
            };
            if rest.len() < len {
                return Err(malformed);
            }
            let (value, rest) = rest.split_at(len);
            self.0 = rest;
            Ok((tag, value))
        }

        fn expect(&mut self, tag: u8) -> Result<&'a [u8], Pkcs8Error> {
            match self.next()? {
                (seen, value) if seen == tag => Ok(value),
                _ => Err(Pkcs8Error::Malformed),
            }
        }

        fn is_empty(&self) -> bool {
            self.0.is_empty()
        }

        fn peek_tag(&self) -> Option<u8> {
            self.0.first().copied()
        }
    }

    const SEQUENCE: u8 = 0x30;
    const INTEGER: u8 = 0x02;
    const OCTET_STRING: u8 = 0x04;
    const BIT_STRING: u8 = 0x03;
    const OID: u8 = 0x06;
    /// `[0] IMPLICIT Attributes` (constructed).
    const ATTRIBUTES: u8 = 0xa0;
    /// `[1] IMPLICIT BIT STRING` publicKey (RFC 5958).
    const PUBLIC_KEY: u8 = 0x81;
    /// The explicitly tagged form some libraries write (`[1] { BIT STRING }`).
    const PUBLIC_KEY_EXPLICIT: u8 = 0xa1;

    /// Decodes a `PrivateKeyInfo` (version 0) or `OneAsymmetricKey`
    /// (version 1) holding an Ed25519 or X25519 key.
    pub fn decode(der: &[u8]) -> Result<DecodedKey, Pkcs8Error> {
        let mut outer = Der(der);
        let mut info = Der(outer.expect(SEQUENCE)?);
        if !outer.is_empty() {
            return Err(Pkcs8Error::Malformed);
        }
        let version = match info.expect(INTEGER)? {
            [0] => 0,
            [1] => 1,
            _ => return Err(Pkcs8Error::Malformed),
        };
        let mut algorithm_id = Der(info.expect(SEQUENCE)?);
        let oid = algorithm_id.expect(OID)?;
        let algorithm = if oid == OID_ED25519 {
            Algorithm::Ed25519
        } else if oid == OID_X25519 {
            Algorithm::X25519
        } else {
            return Err(Pkcs8Error::OtherAlgorithm);
        };
        // RFC 8410: the parameters are absent.
        if !algorithm_id.is_empty() {
            return Err(Pkcs8Error::Malformed);
        }
        let mut wrapped = Der(info.expect(OCTET_STRING)?);
        let key = wrapped.expect(OCTET_STRING)?;
        if !wrapped.is_empty() || key.len() != 32 {
            return Err(Pkcs8Error::Malformed);
        }
        let mut private = Zeroizing::new([0u8; 32]);
        private.copy_from_slice(key);
        if info.peek_tag() == Some(ATTRIBUTES) {
            info.next()?;
        }
        let mut public = None;
        if version == 1 && !info.is_empty() {
            let bits = match info.next()? {
                (PUBLIC_KEY, bits) => bits,
                (PUBLIC_KEY_EXPLICIT, inner) => {
                    let mut inner = Der(inner);
                    let bits = inner.expect(BIT_STRING)?;
                    if !inner.is_empty() {
                        return Err(Pkcs8Error::Malformed);
                    }
                    bits
                }
                _ => return Err(Pkcs8Error::Malformed),
            };
            match bits {
                [0, key @ ..] if key.len() == 32 => {
                    let mut bytes = [0u8; 32];
                    bytes.copy_from_slice(key);
                    public = Some(bytes);
                }
                _ => return Err(Pkcs8Error::Malformed),
            }
        }
        if !info.is_empty() {
            return Err(Pkcs8Error::Malformed);
        }
        Ok(DecodedKey {
            algorithm,
            private,
            public,
        })
    }

    /// Decodes `der` as a key of `expected`'s algorithm.
    pub fn decode_as(der: &[u8], expected: Algorithm) -> Result<DecodedKey, Pkcs8Error> {
        let key = decode(der)?;
        if key.algorithm != expected {
            return Err(Pkcs8Error::WrongCurve(key.algorithm));
        }
        Ok(key)
    }

    /// The version-0 DER of a key (what `openssl genpkey` writes).
    pub fn encode_v1(algorithm: Algorithm, private: &[u8; 32]) -> Zeroizing<[u8; V1_DER_BYTES]> {
        let mut der = Zeroizing::new([0u8; V1_DER_BYTES]);
        let head = [
            SEQUENCE, 0x2e, INTEGER, 0x01, 0x00, SEQUENCE, 0x05, OID, 0x03,
        ];
        der[..9].copy_from_slice(&head);
        der[9..12].copy_from_slice(algorithm.oid());
        der[12..16].copy_from_slice(&[OCTET_STRING, 0x22, OCTET_STRING, 0x20]);
        der[16..].copy_from_slice(private);
        der
    }

    /// Standard base64 with padding (RFC 4648), into a zeroizing string
    /// sized up front (it never reallocates, so no copy is left behind).
    pub fn base64_encode(bytes: &[u8]) -> Zeroizing<String> {
        let mut out = Zeroizing::new(String::with_capacity(crate::base64::encoded_len(
            bytes.len(),
        )));
        crate::base64::encode_into(bytes, &mut out);
        out
    }

    /// Decodes standard base64 (padding required, as PEM writes it) into a
    /// zeroizing buffer sized up front; `None` for anything else.
    pub fn base64_decode(text: &str) -> Option<Zeroizing<Vec<u8>>> {
        let mut out = Zeroizing::new(Vec::with_capacity(text.len() / 4 * 3));
        crate::base64::decode_into(text, &mut out).then_some(out)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn base64_matches_rfc4648_vectors() {
            let vectors: [(&[u8], &str); 7] = [
                (b"", ""),
                (b"f", "Zg=="),
                (b"fo", "Zm8="),
                (b"foo", "Zm9v"),
                (b"foob", "Zm9vYg=="),
                (b"fooba", "Zm9vYmE="),
                (b"foobar", "Zm9vYmFy"),
            ];
            for (bytes, text) in vectors {
                assert_eq!(&base64_encode(bytes)[..], text);
                if !text.is_empty() {
                    assert_eq!(base64_decode(text).as_deref().map(|v| &v[..]), Some(bytes));
                }
            }
            for bad in ["", "Zg=", "Z===", "Zg==Zm8=", "Zm9*", "Zm 9"] {
                assert!(base64_decode(bad).is_none(), "{bad}");
            }
        }

        #[test]
        fn decodes_the_rfc8410_examples() {
            // RFC 8410 section 10.3, version 0.
            let v0 =
                base64_decode("MC4CAQAwBQYDK2VwBCIEINTuctv5E1hK1bbY8fdp+K06/nwoy/HU++CXqI9EdVhC");
            let key = v0.as_deref().map(|der| decode(der));
            let Some(Ok(key)) = key else {
                panic!("{key:?}");
            };
            assert_eq!(key.algorithm, Algorithm::Ed25519);
            assert_eq!(key.private[..4], [0xd4, 0xee, 0x72, 0xdb]);
            assert_eq!(key.public, None);
            assert_eq!(
                &encode_v1(Algorithm::Ed25519, &key.private)[..],
                &v0.as_deref().map(|v| v.to_vec()).unwrap_or_default()[..]
            );

            // Version 1 with attributes and the public key.
            let v1 = base64_decode(
                "MHICAQEwBQYDK2VwBCIEINTuctv5E1hK1bbY8fdp+K06/nwoy/HU++CXqI9EdVhC\
                 oB8wHQYKKoZIhvcNAQkJFDEPDA1DdXJkbGUgQ2hhaXJzgSEAGb9ECWmEzf6FQbrB\
                 Z9w7lshQhqowtrbLDFw4rXAxZuE=",
            );
            let key = v1.as_deref().map(|der| decode(der));
            let Some(Ok(key)) = key else {
                panic!("{key:?}");
            };
            assert_eq!(key.private[..4], [0xd4, 0xee, 0x72, 0xdb]);
            assert_eq!(
                key.public.map(|p| [p[0], p[1], p[31]]),
                Some([0x19, 0xbf, 0xe1])
            );
        }

        #[test]
        fn refuses_other_shapes_and_curves() {
            let good = encode_v1(Algorithm::X25519, &[7; 32]);
            assert!(matches!(
                decode_as(&good[..], Algorithm::Ed25519),
                Err(Pkcs8Error::WrongCurve(Algorithm::X25519))
            ));
            assert!(decode_as(&good[..], Algorithm::X25519).is_ok());
            // Every truncation and a trailing byte are malformed.
            for len in 0..good.len() {
                assert_eq!(
                    decode(&good[..len]).err(),
                    Some(Pkcs8Error::Malformed),
                    "{len}"
                );
            }
            let mut longer = good.to_vec();
            longer.push(0);
            assert_eq!(decode(&longer).err(), Some(Pkcs8Error::Malformed));
            // Version 2 is not PKCS#8.
            let mut v2 = good.to_vec();
            v2[4] = 2;
            assert_eq!(decode(&v2).err(), Some(Pkcs8Error::Malformed));
            // Another algorithm: id-ecPublicKey with prime256v1 parameters.
            let mut ec = vec![0x30, 0x00, 0x02, 0x01, 0x00, 0x30, 0x13, 0x06, 0x07];
            ec.extend_from_slice(&[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01]);
            ec.extend_from_slice(&[0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07]);
            ec.extend_from_slice(&[0x04, 0x22, 0x04, 0x20]);
            ec.extend_from_slice(&[1; 32]);
            ec[1] = (ec.len() - 2) as u8;
            assert_eq!(decode(&ec).err(), Some(Pkcs8Error::OtherAlgorithm));
        }
    }
}
