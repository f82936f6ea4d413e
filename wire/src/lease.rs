//! Managed credential leases (C1–C5): sealing at the Edge, opening at the Node.
//!
//! Pure: no clock, no OS randomness, no files. Time (`now_unix_ms`) and the
//! per-lease randomness ([`LeaseEntropy`]) are inputs, so every path is
//! deterministic under test; `iop_engine::keys` supplies OS randomness and
//! key files.
//!
//! ```text
//!  Edge (issuer, Ed25519)                        Node (recipient, X25519)
//!  binding ──► binding_digest ─┐
//!  ephemeral X25519 ⨯ recipient pub ─► shared ─► blake3 derive_key ─► AEAD key
//!  secret ──ChaCha20-Poly1305(AAD = lease header)──► sealed_secret
//!  Ed25519 over every lease field but `signature` ──► CredentialLease ──►
//!                        open: structure → signature → digest → scope →
//!                              recipient → time window → replay → decrypt
//! ```
//!
//! # Canonical encodings
//!
//! Digests, AAD and signatures never depend on protobuf encoding. Each is a
//! byte string built as:
//!
//! ```text
//! field(domain) ‖ field(f1) ‖ field(f2) ‖ …      in field-number order
//! field(x) = tag:u8 ‖ len:u64 BE ‖ bytes        strings and bytes
//!          = tag:u8 ‖ value: 8 bytes BE          u64 / i64 (two's complement)
//! ```
//!
//! where `tag` is the protobuf field number (0 for the domain string). The
//! encoding is injective: every field is tagged and length-prefixed.
//!
//! - Binding digest: `blake3(enc("iop-lease-binding-v1", binding fields 1..=10))`.
//! - AEAD associated data ("lease header"):
//!   `enc("iop-lease-header-v1", lease fields 1..=6, 8, 9, 10)` — every field
//!   but `sealed_secret` and `signature`.
//! - Signed message: `enc("iop-lease-signature-v1", lease fields 1..=10)`.
//! - Seal key: `blake3::derive_key("iop credential lease v1 seal",
//!   shared ‖ ephemeral pub ‖ recipient pub ‖ binding digest)`.
//! - Key ids: lowercase hex of `blake3(public key bytes)` (64 chars).
//!
//! # Failure codes
//!
//! [`LeaseError::failure_code`] maps every rejection to one of the contract's
//! codes: `lease_missing`, `lease_invalid`, `lease_expired`, `lease_replayed`,
//! `lease_scope_mismatch`. Both sides of the validity window (not yet valid,
//! expired) map to `lease_expired`: either way the lease is outside its time
//! window, usually a clock problem. A full replay cache maps to
//! `lease_replayed`: the Node cannot record replay state, so it fails closed.
//!
//! # Secrets in memory
//!
//! Plaintext, derived keys, shared secrets and ephemeral secrets live in
//! zeroize-on-drop containers; every type here that holds one has a redacted
//! `Debug` and no `Display`/`Clone` (C4, C5).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fmt;

use bytes::Bytes;
use chacha20poly1305::aead::AeadInOut;
use chacha20poly1305::{ChaCha20Poly1305, Key, KeyInit, Nonce};
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use x25519_dalek::{PublicKey, StaticSecret};
use zeroize::{Zeroize, ZeroizeOnDrop, Zeroizing};

use crate::pb::{CredentialLease, CredentialLeaseBinding};

/// Length of a binding digest (blake3).
pub const BINDING_DIGEST_BYTES: usize = 32;
/// Length of an X25519 public key.
pub const EPHEMERAL_PUBLIC_KEY_BYTES: usize = 32;
/// Length of a ChaCha20-Poly1305 nonce.
pub const NONCE_BYTES: usize = 12;
/// Length of the Poly1305 tag appended to the sealed secret.
pub const TAG_BYTES: usize = 16;
/// Length of an Ed25519 signature.
pub const SIGNATURE_BYTES: usize = 64;
/// Length of a key id (lowercase hex of a 32-byte blake3 hash).
pub const KEY_ID_CHARS: usize = 64;
/// Longest lease id.
pub const MAX_LEASE_ID_BYTES: usize = 128;
/// Longest string field of a [`CredentialLeaseBinding`].
pub const MAX_BINDING_FIELD_BYTES: usize = 512;
/// Longest header name.
pub const MAX_HEADER_NAME_BYTES: usize = 128;
/// Longest header format.
pub const MAX_HEADER_FORMAT_BYTES: usize = 1024;
/// Longest secret plaintext.
pub const MAX_SECRET_BYTES: usize = 8192;
/// Longest validity window (`expires_at − not_before`) a lease may have.
/// Leases are short-lived; the cap also bounds how long a replay-cache entry
/// is kept.
pub const MAX_LEASE_LIFETIME_MS: i64 = 600_000;
/// The placeholder in `header_format` replaced by the secret.
pub const SECRET_PLACEHOLDER: &str = "{secret}";

const BINDING_DOMAIN: &str = "iop-lease-binding-v1";
const HEADER_DOMAIN: &str = "iop-lease-header-v1";
const SIGNATURE_DOMAIN: &str = "iop-lease-signature-v1";
const SEAL_CONTEXT: &str = "iop credential lease v1 seal";

// ---------------------------------------------------------------------------
// Errors

/// Why a lease was rejected at the Node (C2, C3). Map to the contract's
/// failure code with [`LeaseError::failure_code`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// The request carries no `credential_lease`.
    #[error("credential lease missing")]
    LeaseMissing,
    /// The request carries a lease but no `credential_binding`.
    #[error("credential binding missing")]
    BindingMissing,
    /// A field has the wrong size or content (named).
    #[error("credential lease malformed: {field}")]
    Malformed {
        /// The offending field.
        field: &'static str,
    },
    /// `issuer_key_id` is not the configured issuer's key id.
    #[error("credential lease from an unknown issuer")]
    WrongIssuer,
    /// The Ed25519 signature does not verify under the issuer key.
    #[error("credential lease signature invalid")]
    BadSignature,
    /// The signed binding digest does not match the binding sent with it.
    #[error("credential binding does not match the lease digest")]
    DigestMismatch,
    /// A binding field differs from what the Node computed for this request.
    #[error("credential binding scope mismatch: {field}")]
    ScopeMismatch {
        /// The binding field that differs.
        field: &'static str,
    },
    /// The binding names another recipient key than this Node's.
    #[error("credential lease sealed for another recipient")]
    WrongRecipient,
    /// `now` is before `not_before − skew`.
    #[error("credential lease not yet valid")]
    NotYetValid,
    /// `now` is at or after `expires_at + skew`.
    #[error("credential lease expired")]
    Expired,
    /// This lease id was already opened and has not expired.
    #[error("credential lease replayed")]
    Replayed,
    /// The replay cache is full of unexpired entries; fail closed.
    #[error("credential lease replay cache full")]
    ReplayCacheFull,
    /// Key agreement or authenticated decryption failed.
    #[error("credential lease could not be decrypted")]
    Decrypt,
    /// The decrypted secret is not a valid header value (empty or contains
    /// bytes outside visible ASCII, space and tab).
    #[error("credential lease secret is not a valid header value")]
    BadSecret,
}

impl LeaseError {
    /// The contract failure code for this rejection.
    pub fn failure_code(&self) -> &'static str {
        match self {
            Self::LeaseMissing | Self::BindingMissing => "lease_missing",
            Self::Malformed { .. }
            | Self::WrongIssuer
            | Self::BadSignature
            | Self::DigestMismatch
            | Self::WrongRecipient
            | Self::Decrypt
            | Self::BadSecret => "lease_invalid",
            Self::NotYetValid | Self::Expired => "lease_expired",
            Self::Replayed | Self::ReplayCacheFull => "lease_replayed",
            Self::ScopeMismatch { .. } => "lease_scope_mismatch",
        }
    }
}

/// Why the Edge could not issue a lease.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IssueError {
    /// A parameter is empty, too long or malformed (named); a Node would
    /// reject the lease.
    #[error("credential lease parameter invalid: {field}")]
    Invalid {
        /// The offending parameter.
        field: &'static str,
    },
    /// The recipient public key is a low-order point (no shared secret).
    #[error("recipient public key is not usable for key agreement")]
    NonContributory,
    /// The AEAD refused to seal (plaintext too long for the cipher).
    #[error("credential lease sealing failed")]
    Seal,
}

// ---------------------------------------------------------------------------
// Keys and ids

/// Lowercase hex of `bytes`.
pub fn encode_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

/// Decodes exactly `2 * N` hex digits (either case) into `N` bytes; `None` on
/// any other input. Callers decoding secrets should zeroize the result.
pub fn decode_hex<const N: usize>(text: &str) -> Option<[u8; N]> {
    fn digit(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    let text = text.as_bytes();
    if text.len() != N * 2 {
        return None;
    }
    let mut out = [0u8; N];
    for (slot, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        *slot = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    Some(out)
}

/// Key id of a Node's X25519 recipient key: lowercase hex blake3 of the public
/// key (the value of `CredentialLeaseBinding.recipient`).
pub fn recipient_key_id(public_key: &PublicKey) -> String {
    blake3::hash(public_key.as_bytes()).to_hex().to_string()
}

/// Key id of the Edge's Ed25519 issuer key: lowercase hex blake3 of the public
/// key (the value of `CredentialLease.issuer_key_id`).
pub fn issuer_key_id(verifying_key: &VerifyingKey) -> String {
    blake3::hash(verifying_key.as_bytes()).to_hex().to_string()
}

/// A Node's X25519 recipient key pair with its key id, computed once.
pub struct RecipientKey {
    secret: StaticSecret,
    public: PublicKey,
    key_id: String,
}

impl RecipientKey {
    /// Wraps a static secret (zeroized when this value drops).
    pub fn from_secret(secret: StaticSecret) -> Self {
        let public = PublicKey::from(&secret);
        let key_id = recipient_key_id(&public);
        Self {
            secret,
            public,
            key_id,
        }
    }

    /// The public half, published to the Edge.
    pub fn public_key(&self) -> PublicKey {
        self.public
    }

    /// The key id ([`recipient_key_id`] of the public half).
    pub fn key_id(&self) -> &str {
        &self.key_id
    }
}

impl fmt::Debug for RecipientKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecipientKey")
            .field("key_id", &self.key_id)
            .field("secret", &"<redacted>")
            .finish()
    }
}

/// Per-lease randomness: the ephemeral X25519 secret and the AEAD nonce.
/// Zeroized on drop. Fill it from a CSPRNG (`iop_engine::keys::lease_entropy`);
/// fixed bytes are for tests only.
#[derive(Zeroize, ZeroizeOnDrop)]
pub struct LeaseEntropy {
    ephemeral_secret: [u8; 32],
    nonce: [u8; NONCE_BYTES],
}

impl LeaseEntropy {
    /// Wraps caller-supplied random bytes.
    pub fn from_bytes(ephemeral_secret: [u8; 32], nonce: [u8; NONCE_BYTES]) -> Self {
        Self {
            ephemeral_secret,
            nonce,
        }
    }
}

impl fmt::Debug for LeaseEntropy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LeaseEntropy(<redacted>)")
    }
}

// ---------------------------------------------------------------------------
// Canonical encoding

struct Canonical(Vec<u8>);

impl Canonical {
    fn new(domain: &str) -> Self {
        let mut enc = Self(Vec::with_capacity(256));
        enc.bytes(0, domain.as_bytes());
        enc
    }

    fn bytes(&mut self, tag: u8, value: &[u8]) {
        self.0.push(tag);
        // usize → u64 is lossless on every supported target.
        self.0
            .extend_from_slice(&(value.len() as u64).to_be_bytes());
        self.0.extend_from_slice(value);
    }

    fn u64(&mut self, tag: u8, value: u64) {
        self.0.push(tag);
        self.0.extend_from_slice(&value.to_be_bytes());
    }

    fn i64(&mut self, tag: u8, value: i64) {
        self.0.push(tag);
        self.0.extend_from_slice(&value.to_be_bytes());
    }
}

/// blake3 digest of the canonical encoding of `binding` (see the module doc).
pub fn binding_digest(binding: &CredentialLeaseBinding) -> [u8; BINDING_DIGEST_BYTES] {
    let mut enc = Canonical::new(BINDING_DOMAIN);
    enc.bytes(1, binding.principal.as_bytes());
    enc.bytes(2, binding.slot.as_bytes());
    enc.bytes(3, binding.route.as_bytes());
    enc.bytes(4, binding.profile.as_bytes());
    enc.bytes(5, binding.upstream_target.as_bytes());
    enc.bytes(6, binding.selected_node.as_bytes());
    enc.bytes(7, binding.recipient.as_bytes());
    enc.u64(8, binding.credential_revision);
    enc.u64(9, binding.route_revision);
    enc.u64(10, binding.projection_generation);
    *blake3::hash(&enc.0).as_bytes()
}

/// The upstream target string both sides put in / expect from
/// `CredentialLeaseBinding.upstream_target`: `"{adapter}/{target}"`.
pub fn upstream_target(adapter: &str, target: &str) -> String {
    format!("{adapter}/{target}")
}

fn lease_header(lease: &CredentialLease) -> Canonical {
    let mut enc = Canonical::new(HEADER_DOMAIN);
    put_header_fields(&mut enc, lease, false);
    enc
}

fn signed_message(lease: &CredentialLease) -> Canonical {
    let mut enc = Canonical::new(SIGNATURE_DOMAIN);
    put_header_fields(&mut enc, lease, true);
    enc
}

fn put_header_fields(enc: &mut Canonical, lease: &CredentialLease, with_sealed: bool) {
    enc.bytes(1, lease.lease_id.as_bytes());
    enc.i64(2, lease.not_before_unix_ms);
    enc.i64(3, lease.expires_at_unix_ms);
    enc.bytes(4, &lease.binding_digest);
    enc.bytes(5, &lease.ephemeral_public_key);
    enc.bytes(6, &lease.nonce);
    if with_sealed {
        enc.bytes(7, &lease.sealed_secret);
    }
    enc.bytes(8, lease.header_name.as_bytes());
    enc.bytes(9, lease.header_format.as_bytes());
    enc.bytes(10, lease.issuer_key_id.as_bytes());
}

fn seal_key(
    shared: &[u8; 32],
    ephemeral_public: &[u8; 32],
    recipient_public: &[u8; 32],
    digest: &[u8; BINDING_DIGEST_BYTES],
) -> Zeroizing<[u8; 32]> {
    let mut ikm = Zeroizing::new([0u8; 128]);
    ikm[..32].copy_from_slice(shared);
    ikm[32..64].copy_from_slice(ephemeral_public);
    ikm[64..96].copy_from_slice(recipient_public);
    ikm[96..].copy_from_slice(digest);
    Zeroizing::new(blake3::derive_key(SEAL_CONTEXT, &ikm[..]))
}

// ---------------------------------------------------------------------------
// Structural checks, shared by issue and open

fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn is_header_value_byte(b: u8) -> bool {
    b == b'\t' || (b' '..=b'~').contains(&b)
}

fn check_text(
    value: &str,
    max_bytes: usize,
    field: &'static str,
    byte_ok: fn(u8) -> bool,
) -> Result<(), &'static str> {
    if value.is_empty() || value.len() > max_bytes || !value.bytes().all(byte_ok) {
        return Err(field);
    }
    Ok(())
}

fn any_byte(_: u8) -> bool {
    true
}

fn is_lower_hex(b: u8) -> bool {
    matches!(b, b'0'..=b'9' | b'a'..=b'f')
}

fn check_binding(binding: &CredentialLeaseBinding) -> Result<(), &'static str> {
    let max = MAX_BINDING_FIELD_BYTES;
    check_text(&binding.principal, max, "binding.principal", any_byte)?;
    check_text(&binding.slot, max, "binding.slot", any_byte)?;
    check_text(&binding.route, max, "binding.route", any_byte)?;
    check_text(&binding.profile, max, "binding.profile", any_byte)?;
    check_text(
        &binding.upstream_target,
        max,
        "binding.upstream_target",
        any_byte,
    )?;
    check_text(
        &binding.selected_node,
        max,
        "binding.selected_node",
        any_byte,
    )?;
    check_text(
        &binding.recipient,
        KEY_ID_CHARS,
        "binding.recipient",
        is_lower_hex,
    )?;
    if binding.recipient.len() != KEY_ID_CHARS {
        return Err("binding.recipient");
    }
    Ok(())
}

fn check_lease_text(
    lease_id: &str,
    header_name: &str,
    header_format: &str,
) -> Result<(), &'static str> {
    check_text(lease_id, MAX_LEASE_ID_BYTES, "lease_id", is_token_byte)?;
    check_text(
        header_name,
        MAX_HEADER_NAME_BYTES,
        "header_name",
        is_token_byte,
    )?;
    check_text(
        header_format,
        MAX_HEADER_FORMAT_BYTES,
        "header_format",
        is_header_value_byte,
    )?;
    if !header_format.contains(SECRET_PLACEHOLDER) {
        return Err("header_format");
    }
    Ok(())
}

fn check_window(not_before_unix_ms: i64, expires_at_unix_ms: i64) -> Result<(), &'static str> {
    match expires_at_unix_ms.checked_sub(not_before_unix_ms) {
        Some(lifetime_ms) if lifetime_ms > 0 && lifetime_ms <= MAX_LEASE_LIFETIME_MS => Ok(()),
        _ => Err("validity window"),
    }
}

fn check_secret(secret: &[u8]) -> bool {
    !secret.is_empty()
        && secret.len() <= MAX_SECRET_BYTES
        && secret.iter().all(|&b| is_header_value_byte(b))
}

fn fixed<const N: usize>(bytes: &Bytes, field: &'static str) -> Result<[u8; N], LeaseError> {
    <[u8; N]>::try_from(bytes.as_ref()).map_err(|_| LeaseError::Malformed { field })
}

// ---------------------------------------------------------------------------
// Issue (Edge)

/// What the Edge issues a lease for (C1).
pub struct IssueParams<'a> {
    /// Unique lease id (HTTP token characters, at most [`MAX_LEASE_ID_BYTES`]).
    pub lease_id: &'a str,
    /// The exact binding; its `recipient` must be the recipient key's id.
    pub binding: &'a CredentialLeaseBinding,
    /// Provider credential plaintext (visible ASCII, space, tab).
    pub secret: &'a [u8],
    /// Header the Node injects, e.g. `Authorization`.
    pub header_name: &'a str,
    /// Header value format containing [`SECRET_PLACEHOLDER`].
    pub header_format: &'a str,
    /// Not valid before (Unix ms).
    pub not_before_unix_ms: i64,
    /// Not valid at or after (Unix ms); at most [`MAX_LEASE_LIFETIME_MS`]
    /// after `not_before_unix_ms`.
    pub expires_at_unix_ms: i64,
}

impl fmt::Debug for IssueParams<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IssueParams")
            .field("lease_id", &self.lease_id)
            .field("binding", self.binding)
            .field("secret", &"<redacted>")
            .field("header_name", &self.header_name)
            .field("header_format", &self.header_format)
            .field("not_before_unix_ms", &self.not_before_unix_ms)
            .field("expires_at_unix_ms", &self.expires_at_unix_ms)
            .finish()
    }
}

/// Seals `params.secret` to `recipient` and signs the lease with `issuer`
/// (C1). `entropy` must be fresh CSPRNG output for every lease.
///
/// Validates every parameter a Node checks structurally, so a lease this
/// returns is never rejected as malformed.
pub fn issue(
    params: &IssueParams<'_>,
    issuer: &SigningKey,
    recipient: &PublicKey,
    entropy: LeaseEntropy,
) -> Result<CredentialLease, IssueError> {
    let invalid = |field| IssueError::Invalid { field };
    check_lease_text(params.lease_id, params.header_name, params.header_format).map_err(invalid)?;
    check_binding(params.binding).map_err(invalid)?;
    if params.binding.recipient != recipient_key_id(recipient) {
        return Err(invalid("binding.recipient"));
    }
    check_window(params.not_before_unix_ms, params.expires_at_unix_ms).map_err(invalid)?;
    if !check_secret(params.secret) {
        return Err(invalid("secret"));
    }

    let digest = binding_digest(params.binding);
    let ephemeral = StaticSecret::from(entropy.ephemeral_secret);
    let ephemeral_public = PublicKey::from(&ephemeral);
    let shared = ephemeral.diffie_hellman(recipient);
    if !shared.was_contributory() {
        return Err(IssueError::NonContributory);
    }
    let key = seal_key(
        shared.as_bytes(),
        ephemeral_public.as_bytes(),
        recipient.as_bytes(),
        &digest,
    );

    let mut lease = CredentialLease {
        lease_id: params.lease_id.to_owned(),
        not_before_unix_ms: params.not_before_unix_ms,
        expires_at_unix_ms: params.expires_at_unix_ms,
        binding_digest: Bytes::copy_from_slice(&digest),
        ephemeral_public_key: Bytes::copy_from_slice(ephemeral_public.as_bytes()),
        nonce: Bytes::copy_from_slice(&entropy.nonce),
        sealed_secret: Bytes::new(),
        header_name: params.header_name.to_owned(),
        header_format: params.header_format.to_owned(),
        issuer_key_id: issuer_key_id(&issuer.verifying_key()),
        signature: Bytes::new(),
    };

    let aad = lease_header(&lease);
    let cipher = ChaCha20Poly1305::new(<&Key>::from(&*key));
    let mut buffer = Vec::with_capacity(params.secret.len() + TAG_BYTES);
    buffer.extend_from_slice(params.secret);
    cipher
        .encrypt_in_place(<&Nonce>::from(&entropy.nonce), &aad.0, &mut buffer)
        .map_err(|_| IssueError::Seal)?;
    lease.sealed_secret = Bytes::from(buffer);
    sign(&mut lease, issuer);
    Ok(lease)
}

/// (Re)computes `lease.signature` over every other field with `issuer`.
/// [`issue`] calls this; it is public so tests can build leases whose
/// signature is valid but whose sealed content is not.
pub fn sign(lease: &mut CredentialLease, issuer: &SigningKey) {
    let signature = issuer.sign(&signed_message(lease).0);
    lease.signature = Bytes::copy_from_slice(&signature.to_bytes());
}

// ---------------------------------------------------------------------------
// Open (Node)

/// The binding the Node expects for the request it serves (C2, C5). Required
/// fields are always known to the Node; optional ones are checked when the
/// Node knows them (`None` = not known here, covered by the signature only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpectedScope<'a> {
    /// This Node's id.
    pub selected_node: &'a str,
    /// [`upstream_target`] of the request's adapter and target.
    pub upstream_target: &'a str,
    /// Protocol profile of the adapter, when known.
    pub profile: Option<&'a str>,
    /// Principal, when known.
    pub principal: Option<&'a str>,
    /// Credential slot, when known.
    pub slot: Option<&'a str>,
    /// Route, when known.
    pub route: Option<&'a str>,
    /// Credential revision of the slot, when known.
    pub credential_revision: Option<u64>,
    /// Route revision, when known.
    pub route_revision: Option<u64>,
    /// Projection generation, when known.
    pub projection_generation: Option<u64>,
}

impl ExpectedScope<'_> {
    fn check(&self, binding: &CredentialLeaseBinding) -> Result<(), LeaseError> {
        fn same<T: PartialEq + ?Sized>(
            expected: Option<&T>,
            actual: &T,
            field: &'static str,
        ) -> Result<(), LeaseError> {
            match expected {
                Some(expected) if expected != actual => Err(LeaseError::ScopeMismatch { field }),
                _ => Ok(()),
            }
        }
        same(self.principal, binding.principal.as_str(), "principal")?;
        same(self.slot, binding.slot.as_str(), "slot")?;
        same(self.route, binding.route.as_str(), "route")?;
        same(self.profile, binding.profile.as_str(), "profile")?;
        same(
            Some(self.upstream_target),
            binding.upstream_target.as_str(),
            "upstream_target",
        )?;
        same(
            Some(self.selected_node),
            binding.selected_node.as_str(),
            "selected_node",
        )?;
        same(
            self.credential_revision.as_ref(),
            &binding.credential_revision,
            "credential_revision",
        )?;
        same(
            self.route_revision.as_ref(),
            &binding.route_revision,
            "route_revision",
        )?;
        same(
            self.projection_generation.as_ref(),
            &binding.projection_generation,
            "projection_generation",
        )
    }
}

/// Everything the Node brings to [`open`].
#[derive(Debug)]
pub struct OpenContext<'a> {
    /// This Node's recipient key.
    pub recipient: &'a RecipientKey,
    /// The configured Edge issuer public key.
    pub issuer: &'a VerifyingKey,
    /// The binding this request must carry.
    pub scope: ExpectedScope<'a>,
    /// Wall-clock now (Unix ms).
    pub now_unix_ms: i64,
    /// Tolerated clock difference to the Edge, applied to both window edges.
    pub clock_skew_ms: u32,
}

/// Lease ids already opened, each kept until its lease can no longer be
/// accepted (`expires_at + skew`). Bounded: when full of unexpired entries,
/// [`open`] fails closed with [`LeaseError::ReplayCacheFull`] instead of
/// evicting (an evicted id could be replayed).
#[derive(Debug)]
pub struct ReplayCache {
    max_entries: usize,
    keep_until_by_id: HashMap<Box<str>, i64>,
    by_keep_until: BinaryHeap<Reverse<(i64, Box<str>)>>,
}

impl ReplayCache {
    /// An empty cache holding at most `max_entries` lease ids.
    pub fn new(max_entries: usize) -> Self {
        Self {
            max_entries,
            keep_until_by_id: HashMap::new(),
            by_keep_until: BinaryHeap::new(),
        }
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        self.keep_until_by_id.len()
    }

    /// True when no entry is held.
    pub fn is_empty(&self) -> bool {
        self.keep_until_by_id.is_empty()
    }

    /// Capacity given to [`ReplayCache::new`].
    pub fn max_entries(&self) -> usize {
        self.max_entries
    }

    /// True when `lease_id` was opened and its entry has not been pruned.
    pub fn contains(&self, lease_id: &str) -> bool {
        self.keep_until_by_id.contains_key(lease_id)
    }

    /// Drops entries whose lease can no longer be accepted at `now_unix_ms`
    /// (kept-until ≤ now). Returns how many were dropped. [`open`] calls it.
    pub fn prune(&mut self, now_unix_ms: i64) -> usize {
        let mut dropped = 0;
        while let Some(Reverse((keep_until_ms, _))) = self.by_keep_until.peek() {
            if *keep_until_ms > now_unix_ms {
                break;
            }
            if let Some(Reverse((_, id))) = self.by_keep_until.pop() {
                self.keep_until_by_id.remove(&id);
                dropped += 1;
            }
        }
        dropped
    }

    fn check(&self, lease_id: &str) -> Result<(), LeaseError> {
        if self.contains(lease_id) {
            return Err(LeaseError::Replayed);
        }
        if self.len() >= self.max_entries {
            return Err(LeaseError::ReplayCacheFull);
        }
        Ok(())
    }

    fn insert(&mut self, lease_id: &str, keep_until_ms: i64) {
        let id: Box<str> = lease_id.into();
        self.keep_until_by_id.insert(id.clone(), keep_until_ms);
        self.by_keep_until.push(Reverse((keep_until_ms, id)));
    }
}

/// The opened credential (C2). Zeroized on drop; `Debug` is redacted; there
/// is no `Display` or `Clone`, so it cannot be cached across requests (C5).
pub struct OpenedSecret {
    secret: Zeroizing<Vec<u8>>,
    header_name: String,
    header_format: String,
}

impl OpenedSecret {
    /// The plaintext (visible ASCII, space, tab). Do not copy it out.
    pub fn secret_bytes(&self) -> &[u8] {
        &self.secret
    }

    /// The header name the lease declares.
    pub fn header_name(&self) -> &str {
        &self.header_name
    }

    /// The header value format the lease declares.
    pub fn header_format(&self) -> &str {
        &self.header_format
    }

    /// `format` with every [`SECRET_PLACEHOLDER`] replaced by the secret, in a
    /// zeroize-on-drop string allocated once at its final size.
    pub fn header_value(&self, format: &str) -> Zeroizing<String> {
        let placeholders = format.matches(SECRET_PLACEHOLDER).count();
        // A byte ≥ 0x80 would become a two-byte char; the open path rejects
        // them, but count them so the capacity is exact regardless.
        let secret_chars_bytes: usize = self
            .secret
            .iter()
            .map(|&b| if b < 0x80 { 1 } else { 2 })
            .sum();
        let capacity = format.len() - placeholders * SECRET_PLACEHOLDER.len()
            + placeholders * secret_chars_bytes;
        let mut value = Zeroizing::new(String::with_capacity(capacity));
        for (i, part) in format.split(SECRET_PLACEHOLDER).enumerate() {
            if i > 0 {
                value.extend(self.secret.iter().map(|&b| char::from(b)));
            }
            value.push_str(part);
        }
        value
    }

    /// [`OpenedSecret::header_value`] of the lease's declared format.
    pub fn declared_header_value(&self) -> Zeroizing<String> {
        self.header_value(&self.header_format)
    }
}

impl Zeroize for OpenedSecret {
    fn zeroize(&mut self) {
        self.secret.zeroize();
    }
}

impl ZeroizeOnDrop for OpenedSecret {}

impl fmt::Debug for OpenedSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OpenedSecret(<redacted>)")
    }
}

/// Verifies and opens a lease for the request the Node serves (C2, C3, C5).
///
/// `lease` and `binding` are the request's optional fields; either absent is
/// `lease_missing`. Checks run in this order, the first failure wins:
/// structure → issuer key id and Ed25519 signature → binding digest → scope
/// (every field in `ctx.scope`) → recipient key id → time window
/// (`not_before − skew ≤ now < expires_at + skew`) → replay state → key
/// agreement and decryption → secret is a valid header value. Only a lease
/// that passes all of them is recorded in `replay` (kept until
/// `expires_at + skew`), so a rejected lease never poisons the cache.
pub fn open(
    lease: Option<&CredentialLease>,
    binding: Option<&CredentialLeaseBinding>,
    ctx: &OpenContext<'_>,
    replay: &mut ReplayCache,
) -> Result<OpenedSecret, LeaseError> {
    let lease = lease.ok_or(LeaseError::LeaseMissing)?;
    let binding = binding.ok_or(LeaseError::BindingMissing)?;

    // Structure.
    let malformed = |field| LeaseError::Malformed { field };
    check_lease_text(&lease.lease_id, &lease.header_name, &lease.header_format)
        .map_err(malformed)?;
    check_binding(binding).map_err(malformed)?;
    check_window(lease.not_before_unix_ms, lease.expires_at_unix_ms).map_err(malformed)?;
    let digest: [u8; BINDING_DIGEST_BYTES] = fixed(&lease.binding_digest, "binding_digest")?;
    let ephemeral_public: [u8; EPHEMERAL_PUBLIC_KEY_BYTES] =
        fixed(&lease.ephemeral_public_key, "ephemeral_public_key")?;
    let nonce: [u8; NONCE_BYTES] = fixed(&lease.nonce, "nonce")?;
    let signature: [u8; SIGNATURE_BYTES] = fixed(&lease.signature, "signature")?;
    let sealed_len = lease.sealed_secret.len();
    if sealed_len <= TAG_BYTES || sealed_len > MAX_SECRET_BYTES + TAG_BYTES {
        return Err(malformed("sealed_secret"));
    }

    // Signature.
    if lease.issuer_key_id != issuer_key_id(ctx.issuer) {
        return Err(LeaseError::WrongIssuer);
    }
    ctx.issuer
        .verify_strict(&signed_message(lease).0, &Signature::from_bytes(&signature))
        .map_err(|_| LeaseError::BadSignature)?;

    // Binding digest, scope, recipient.
    if digest != binding_digest(binding) {
        return Err(LeaseError::DigestMismatch);
    }
    ctx.scope.check(binding)?;
    if binding.recipient != ctx.recipient.key_id() {
        return Err(LeaseError::WrongRecipient);
    }

    // Time window.
    let skew_ms = i64::from(ctx.clock_skew_ms);
    if ctx.now_unix_ms < lease.not_before_unix_ms.saturating_sub(skew_ms) {
        return Err(LeaseError::NotYetValid);
    }
    let keep_until_ms = lease.expires_at_unix_ms.saturating_add(skew_ms);
    if ctx.now_unix_ms >= keep_until_ms {
        return Err(LeaseError::Expired);
    }

    // Replay state.
    replay.prune(ctx.now_unix_ms);
    replay.check(&lease.lease_id)?;

    // Decrypt.
    let shared = ctx
        .recipient
        .secret
        .diffie_hellman(&PublicKey::from(ephemeral_public));
    if !shared.was_contributory() {
        return Err(LeaseError::Decrypt);
    }
    let key = seal_key(
        shared.as_bytes(),
        &ephemeral_public,
        ctx.recipient.public.as_bytes(),
        &digest,
    );
    let cipher = ChaCha20Poly1305::new(<&Key>::from(&*key));
    let mut secret = Zeroizing::new(lease.sealed_secret.to_vec());
    cipher
        .decrypt_in_place(<&Nonce>::from(&nonce), &lease_header(lease).0, &mut *secret)
        .map_err(|_| LeaseError::Decrypt)?;
    if !check_secret(&secret) {
        return Err(LeaseError::BadSecret);
    }

    replay.insert(&lease.lease_id, keep_until_ms);
    Ok(OpenedSecret {
        secret,
        header_name: lease.header_name.clone(),
        header_format: lease.header_format.clone(),
    })
}
