//! Credential-lease keys on disk and OS randomness for leases (C1, C4).
//!
//! The Edge holds an Ed25519 issuer key, each managed Node an X25519
//! recipient key. Private keys live in files of this format (not PEM/PKCS#8;
//! the body is the lowercase hex of the 32-byte seed):
//!
//! ```text
//! -----BEGIN IOP ISSUER KEY-----          -----BEGIN IOP RECIPIENT KEY-----
//! <64 hex digits>                         <64 hex digits>
//! -----END IOP ISSUER KEY-----            -----END IOP RECIPIENT KEY-----
//! ```
//!
//! Files are created with mode 0600 and never overwritten; loading refuses a
//! file any group/other permission bit is set on (`mode & 0o077 != 0`).
//! Errors name the file and the reason, never the contents. Seeds and file
//! contents are zeroized after use.
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

const ISSUER_LABEL: &str = "IOP ISSUER KEY";
const RECIPIENT_LABEL: &str = "IOP RECIPIENT KEY";

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
    write_key_file(path, ISSUER_LABEL, &seed)?;
    Ok(key.verifying_key())
}

/// Generates an X25519 recipient key, writes it to `path` (new file, mode
/// 0600) and returns the public half.
pub fn generate_recipient_key(path: &Path) -> Result<PublicKey, KeyError> {
    let seed = random_key()?;
    let public = RecipientKey::from_bytes(&seed).public_key();
    write_key_file(path, RECIPIENT_LABEL, &seed)?;
    Ok(public)
}

/// Loads the Edge's Ed25519 issuer key from `path`.
pub fn load_issuer_key(path: &Path) -> Result<SigningKey, KeyError> {
    let seed = read_key_file(path, ISSUER_LABEL)?;
    Ok(SigningKey::from_bytes(&seed))
}

/// Loads a Node's X25519 recipient key from `path`.
pub fn load_recipient_key(path: &Path) -> Result<RecipientKey, KeyError> {
    let seed = read_key_file(path, RECIPIENT_LABEL)?;
    Ok(RecipientKey::from_bytes(&seed))
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

fn write_key_file(path: &Path, label: &str, seed: &[u8; 32]) -> Result<(), KeyError> {
    let hex = Zeroizing::new(encode_hex(seed));
    let mut text = Zeroizing::new(String::with_capacity(2 * label.len() + hex.len() + 64));
    for part in [
        "-----BEGIN ",
        label,
        "-----\n",
        &hex,
        "\n-----END ",
        label,
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

fn read_key_file(path: &Path, label: &str) -> Result<Zeroizing<[u8; 32]>, KeyError> {
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
    let kind = begin
        .strip_prefix("-----BEGIN ")
        .and_then(|rest| rest.strip_suffix("-----"))
        .ok_or_else(|| parse_err("missing BEGIN line"))?;
    if kind != label {
        return Err(parse_err(if label == ISSUER_LABEL {
            "not an IOP ISSUER KEY file"
        } else {
            "not an IOP RECIPIENT KEY file"
        }));
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
    if end_kind != Some(label) {
        return Err(parse_err("missing END line"));
    }
    if lines.next().is_some() {
        return Err(parse_err("data after END line"));
    }
    Ok(seed)
}
