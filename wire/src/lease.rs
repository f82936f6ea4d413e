//! Managed credential leases (C1–C5): sealing at the Edge, opening at the Node.
//!
//! Pure: no clock, no OS randomness, no files. Time (`now_unix_ms`) and the
//! per-lease randomness ([`LeaseEntropy`]) are inputs, so every path is
//! deterministic under test; `iop_engine::keys` supplies OS randomness and
//! key files.
//!
//! ```text
//!  Edge (issuer, Ed25519)                              Node (recipient, X25519)
//!  request (method, path, headers, body) ─► request_digest ─┐
//!  TLS trust (none, default roots, CAs) ─► provider_trust ──┤
//!  binding (who, which credential, where, which run) ◄──────┘ ─► binding_digest
//!  HPKE base mode to the recipient key, info = binding digest:
//!    secret ──ChaCha20-Poly1305(AAD = lease header)──► sealed_secret
//!  Ed25519 over every lease field but `signature` ──► CredentialLease ──►
//!                 open: structure → signature → digest → scope (node, target,
//!                       origin, trust, run, request, …) → recipient → node policy
//!                       (revoked, pinned origins) → time window → replay
//!                       window → HPKE open
//! ```
//!
//! # What a lease is bound to
//!
//! The binding names who asked (`principal`, `route`), which credential
//! (`slot`, `credential_revision`), where the secret goes (`selected_node`,
//! `recipient`, `upstream_target`, `profile`, `upstream_origin`, the
//! provider origin the Edge resolved, and `provider_trust`, the
//! [`provider_trust_digest`] of whom the Node trusts to be that origin over
//! TLS), and the one request it serves (`run_id` and the [`request_digest`]
//! of the method, path, forwarded headers and body the Node sends). The Node
//! recomputes each of those from the request in hand and from its own
//! adapter, so configuration pushed over the link (a changed `base_url`,
//! other profile paths, another provider CA) cannot send a genuine lease's
//! secret anywhere else, and a captured lease cannot be spent on another
//! request.
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
//! - Request digest: `blake3(enc("iop-lease-request-v2", 1 method, 2 path,
//!   3 header count, (4 name, 5 value)…, 6 body))`.
//! - Binding digest: `blake3(enc("iop-lease-binding-v2", binding fields
//!   1..=14))`.
//! - Provider trust digest: `blake3(enc("iop-lease-provider-trust-v2",
//!   1 kind, [2 certificate count, 3 certificate…]))`, `kind` 1 = plain
//!   HTTP, 2 = the Node's default roots, 3 = a private CA (then its DER
//!   certificates, sorted bytewise and deduplicated), 4 = unverified TLS.
//! - AEAD associated data ("lease header"):
//!   `enc("iop-lease-header-v2", lease fields 1..=5, 8, 9, 10, 12)` — every
//!   field but `sealed_secret` and `signature`.
//! - Signed message: `enc("iop-lease-signature-v2", lease fields 1..=5,
//!   7..=10, 12)`.
//! - Sealing: HPKE (RFC 9180) base mode with DHKEM(X25519, HKDF-SHA256),
//!   HKDF-SHA256 and ChaCha20-Poly1305; `info = "iop credential lease v2" ‖
//!   binding digest`. `ephemeral_public_key` is HPKE's `enc`,
//!   `sealed_secret` the ciphertext followed by its tag. HPKE refuses a key
//!   agreement whose result is all zero (a low-order point).
//! - Key ids: lowercase hex of `blake3(public key bytes)` (64 chars).
//!
//! # Replay
//!
//! Every lease carries a `sequence`, strictly increasing per node and
//! `projection_generation` in issue order. The Node's [`ReplayGuard`] keeps
//! one sliding window of [`REPLAY_WINDOW_LEASES`] sequence numbers per
//! projection (a bitmap, like IPsec's anti-replay window), so its memory is
//! bounded by the number of Edge sessions whose leases are still valid —
//! never by how many leases were issued. It refuses a sequence already
//! opened or older than its window, a lease issued before the guard started
//! (minus skew: replay state does not survive a restart), and reads time
//! through a clock that never goes backwards.
//!
//! # Failure codes
//!
//! [`LeaseError::failure_code`] maps every rejection to one of the contract's
//! codes: `lease_missing`, `lease_invalid`, `lease_expired`, `lease_replayed`,
//! `lease_scope_mismatch`. Both sides of the validity window (not yet valid,
//! expired) map to `lease_expired`: either way the lease is outside its time
//! window, usually a clock problem. Whatever the replay state cannot vouch
//! for (opened before, older than the window, issued before start, no room
//! for another window) maps to `lease_replayed`: the Node fails closed.
//!
//! # Secrets in memory
//!
//! Plaintext, derived keys, shared secrets and ephemeral secrets live in
//! zeroize-on-drop containers (HPKE's own and ours); every type here that
//! holds one has a redacted `Debug` and no `Display`/`Clone` (C4, C5).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::convert::Infallible;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use hpke::aead::{AeadTag, ChaCha20Poly1305};
use hpke::kdf::HkdfSha256;
use hpke::kem::X25519HkdfSha256;
use hpke::rand_core::{TryCryptoRng, TryRng};
use hpke::{Deserializable, Kem as _, OpModeR, OpModeS, Serializable};
use x25519_dalek::{PublicKey, StaticSecret};
use zeroize::{Zeroize, ZeroizeOnDrop, Zeroizing};

use crate::pb::{CredentialLease, CredentialLeaseBinding, Header, RevokedCredential};

type Kem = X25519HkdfSha256;
type Kdf = HkdfSha256;
type Aead = ChaCha20Poly1305;

/// Length of a binding digest (blake3).
pub const BINDING_DIGEST_BYTES: usize = 32;
/// Length of a request digest (blake3).
pub const REQUEST_DIGEST_BYTES: usize = 32;
/// Length of a provider trust digest (blake3).
pub const PROVIDER_TRUST_BYTES: usize = 32;
/// Length of an X25519 public key (HPKE `enc`).
pub const EPHEMERAL_PUBLIC_KEY_BYTES: usize = 32;
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
/// Leases are short-lived; the cap also bounds how long a replay window is
/// kept.
pub const MAX_LEASE_LIFETIME_MS: i64 = 600_000;
/// The placeholder in `header_format` replaced by the secret.
pub const SECRET_PLACEHOLDER: &str = "{secret}";
/// Sequence numbers one replay window remembers below the highest opened
/// one: a lease may arrive that many leases late (reordered between the
/// Edge's cores) and still open. 2 KiB of bitmap per window.
pub const REPLAY_WINDOW_LEASES: u64 = 16_384;
/// Replay windows (one per Edge session with valid leases) a
/// [`ReplayGuard`] holds at most: 2 MiB of bitmaps with the default window.
pub const REPLAY_MAX_WINDOWS: usize = 1024;

const BINDING_DOMAIN: &str = "iop-lease-binding-v2";
const REQUEST_DOMAIN: &str = "iop-lease-request-v2";
const PROVIDER_TRUST_DOMAIN: &str = "iop-lease-provider-trust-v2";
const HEADER_DOMAIN: &str = "iop-lease-header-v2";
const SIGNATURE_DOMAIN: &str = "iop-lease-signature-v2";
const HPKE_INFO: &[u8] = b"iop credential lease v2";
const ENTROPY_CONTEXT: &str = "iop credential lease v2 entropy";

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
    /// The Node's configuration pins the lease's slot to other origins.
    #[error("credential slot is not allowed to reach this origin on this node")]
    OriginNotAllowed,
    /// The binding names another recipient key than this Node's.
    #[error("credential lease sealed for another recipient")]
    WrongRecipient,
    /// The lease's credential revision is revoked for its slot.
    #[error("credential revision {revision} is revoked")]
    Revoked {
        /// The revoked revision.
        revision: u64,
    },
    /// `now` is before `not_before − skew`.
    #[error("credential lease not yet valid")]
    NotYetValid,
    /// `now` is at or after `expires_at + skew`.
    #[error("credential lease expired")]
    Expired,
    /// The lease was issued before this Node's replay state began (its
    /// start minus skew): it may have been opened before a restart.
    #[error("credential lease issued before this node started")]
    IssuedBeforeStart,
    /// This lease's sequence number was already opened.
    #[error("credential lease replayed")]
    Replayed,
    /// This lease's sequence number is older than the replay window.
    #[error("credential lease older than the replay window")]
    SequenceTooOld,
    /// Every replay window is in use by valid leases; fail closed.
    #[error("credential lease replay state full")]
    ReplayWindowsFull,
    /// Key agreement gave no shared secret: the ephemeral key is a
    /// low-order point.
    #[error("credential lease key agreement failed (low-order ephemeral key)")]
    NoSharedSecret,
    /// Authenticated decryption failed.
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
            | Self::Revoked { .. }
            | Self::NoSharedSecret
            | Self::Decrypt
            | Self::BadSecret => "lease_invalid",
            Self::NotYetValid | Self::Expired => "lease_expired",
            Self::IssuedBeforeStart
            | Self::Replayed
            | Self::SequenceTooOld
            | Self::ReplayWindowsFull => "lease_replayed",
            Self::ScopeMismatch { .. } | Self::OriginNotAllowed => "lease_scope_mismatch",
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
    /// The AEAD refused to seal.
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

/// Decodes exactly `2 * N` hex digits (either case) into `out`; false (and
/// `out` unspecified) on any other input. Decodes in place, so a secret
/// never passes through a temporary array.
pub fn decode_hex_into<const N: usize>(text: &str, out: &mut [u8; N]) -> bool {
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
        return false;
    }
    for (slot, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        match (digit(pair[0]), digit(pair[1])) {
            (Some(hi), Some(lo)) => *slot = (hi << 4) | lo,
            _ => return false,
        }
    }
    true
}

/// Decodes exactly `2 * N` hex digits (either case) into `N` bytes; `None` on
/// any other input. For secrets use [`decode_hex_into`].
pub fn decode_hex<const N: usize>(text: &str) -> Option<[u8; N]> {
    let mut out = [0u8; N];
    decode_hex_into(text, &mut out).then_some(out)
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
    secret: <Kem as hpke::Kem>::PrivateKey,
    public: PublicKey,
    key_id: String,
}

impl RecipientKey {
    /// The key whose (X25519, clamped on use) secret scalar is `secret`;
    /// the caller keeps and wipes its bytes.
    pub fn from_bytes(secret: &[u8; 32]) -> Self {
        // A 32-byte input always deserializes: HPKE clamps it like X25519.
        let secret = match <Kem as hpke::Kem>::PrivateKey::from_bytes(secret) {
            Ok(secret) => secret,
            Err(_) => unreachable!("an X25519 private key is any 32 bytes"),
        };
        let public_bytes = Kem::sk_to_pk(&secret).to_bytes();
        let mut public = [0u8; 32];
        public.copy_from_slice(&public_bytes);
        let public = PublicKey::from(public);
        let key_id = recipient_key_id(&public);
        Self {
            secret,
            public,
            key_id,
        }
    }

    /// Wraps a static secret (both copies are zeroized on drop).
    pub fn from_secret(secret: StaticSecret) -> Self {
        Self::from_bytes(secret.as_bytes())
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

/// Per-lease randomness: a 32-byte seed from which HPKE draws its ephemeral
/// key (through a blake3 stream, so any amount HPKE asks for is covered).
/// Zeroized on drop. Fill it from a CSPRNG (`iop_engine::keys::lease_entropy`);
/// fixed bytes are for tests only.
#[derive(Zeroize, ZeroizeOnDrop)]
pub struct LeaseEntropy {
    seed: [u8; 32],
}

impl LeaseEntropy {
    /// Wraps caller-supplied random bytes.
    pub fn from_seed(seed: [u8; 32]) -> Self {
        Self { seed }
    }

    /// Lets `fill` write the seed in place (no copy of it is left behind).
    pub fn fill<E>(fill: impl FnOnce(&mut [u8]) -> Result<(), E>) -> Result<Self, E> {
        let mut entropy = Self { seed: [0; 32] };
        fill(&mut entropy.seed)?;
        Ok(entropy)
    }

    fn rng(&self) -> EntropyRng {
        let mut hasher = blake3::Hasher::new_derive_key(ENTROPY_CONTEXT);
        hasher.update(&self.seed);
        let stream = hasher.finalize_xof();
        hasher.zeroize();
        EntropyRng(stream)
    }
}

impl fmt::Debug for LeaseEntropy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LeaseEntropy(<redacted>)")
    }
}

/// The random source HPKE draws from: the blake3 output stream of a
/// [`LeaseEntropy`] seed. Wiped on drop.
struct EntropyRng(blake3::OutputReader);

impl TryRng for EntropyRng {
    type Error = Infallible;

    fn try_next_u32(&mut self) -> Result<u32, Infallible> {
        let mut bytes = [0u8; 4];
        self.0.fill(&mut bytes);
        Ok(u32::from_le_bytes(bytes))
    }

    fn try_next_u64(&mut self) -> Result<u64, Infallible> {
        let mut bytes = [0u8; 8];
        self.0.fill(&mut bytes);
        Ok(u64::from_le_bytes(bytes))
    }

    fn try_fill_bytes(&mut self, dst: &mut [u8]) -> Result<(), Infallible> {
        self.0.fill(dst);
        Ok(())
    }
}

impl TryCryptoRng for EntropyRng {}

impl Drop for EntropyRng {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

// ---------------------------------------------------------------------------
// Canonical encoding

/// Where a canonical encoding goes: a byte string (AAD, signed message) or
/// straight into a hash (digests: a request body is never copied).
trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

impl Sink for blake3::Hasher {
    fn put(&mut self, bytes: &[u8]) {
        self.update(bytes);
    }
}

struct Canonical<S>(S);

impl<S: Sink> Canonical<S> {
    fn new(mut sink: S, domain: &str) -> Self {
        field_bytes(&mut sink, 0, domain.as_bytes());
        Self(sink)
    }

    fn bytes(&mut self, tag: u8, value: &[u8]) {
        field_bytes(&mut self.0, tag, value);
    }

    /// Like [`Canonical::bytes`] of the pieces' concatenation.
    fn bytes_in_pieces(&mut self, tag: u8, pieces: &[Bytes]) {
        let len: usize = pieces.iter().map(Bytes::len).sum();
        self.0.put(&[tag]);
        // usize → u64 is lossless on every supported target.
        self.0.put(&(len as u64).to_be_bytes());
        for piece in pieces {
            self.0.put(piece);
        }
    }

    fn u64(&mut self, tag: u8, value: u64) {
        self.0.put(&[tag]);
        self.0.put(&value.to_be_bytes());
    }

    fn i64(&mut self, tag: u8, value: i64) {
        self.0.put(&[tag]);
        self.0.put(&value.to_be_bytes());
    }
}

fn field_bytes<S: Sink>(sink: &mut S, tag: u8, value: &[u8]) {
    sink.put(&[tag]);
    // usize → u64 is lossless on every supported target.
    sink.put(&(value.len() as u64).to_be_bytes());
    sink.put(value);
}

fn digest_of(domain: &str, fill: impl FnOnce(&mut Canonical<blake3::Hasher>)) -> [u8; 32] {
    let mut enc = Canonical::new(blake3::Hasher::new(), domain);
    fill(&mut enc);
    *enc.0.finalize().as_bytes()
}

/// What the Node sends to the provider for one tunnel, as far as a lease is
/// bound to it: the effective method, the request target (path and query,
/// with the base URL's prefix), the forwarded headers exactly as the tunnel
/// request lists them (before hop-by-hop filtering and injection), and the
/// body.
#[derive(Debug, Clone, Copy)]
pub struct BoundRequest<'a> {
    /// Method, e.g. `POST`.
    pub method: &'a str,
    /// Request target under the origin, e.g. `/v1/chat/completions`.
    pub path: &'a str,
    /// `ProviderTunnelRequest.headers`, in order.
    pub headers: &'a [Header],
    /// The body, in the pieces it is sent in (the digest covers their
    /// concatenation, however it is cut).
    pub body: &'a [Bytes],
}

/// blake3 digest of the canonical encoding of `request` (see the module
/// doc): `CredentialLeaseBinding.request_digest`.
pub fn request_digest(request: &BoundRequest<'_>) -> [u8; REQUEST_DIGEST_BYTES] {
    digest_of(REQUEST_DOMAIN, |enc| {
        enc.bytes(1, request.method.as_bytes());
        enc.bytes(2, request.path.as_bytes());
        enc.u64(3, request.headers.len() as u64);
        for header in request.headers {
            enc.bytes(4, header.name.as_bytes());
            enc.bytes(5, &header.value);
        }
        enc.bytes_in_pieces(6, request.body);
    })
}

/// Whom a Node trusts to be the provider at a lease's `upstream_origin`:
/// the TLS trust settings of the adapter's provider client, as the Node
/// builds it (`CredentialLeaseBinding.provider_trust` is their
/// [`provider_trust_digest`]). The host name a certificate must carry is the
/// origin's, bound apart; nothing else the adapter's TLS settings say
/// changes whom the Node trusts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProviderTrust<'a> {
    /// An `http://` origin: no TLS, the origin alone names the peer.
    PlainHttp,
    /// TLS verified against the Node's default trust anchors (its system
    /// store, or the bundled roots): the Node's own, not pushed by the Edge.
    DefaultRoots,
    /// TLS verified against exactly these CA certificates (DER), the only
    /// anchors. Their order and repetitions do not matter: the set does.
    PrivateCa(Vec<&'a [u8]>),
    /// TLS without certificate verification (`tls_insecure_skip_verify`).
    /// A Node never injects a lease there; the kind exists so that every
    /// client has a digest.
    Unverified,
}

impl ProviderTrust<'_> {
    fn kind(&self) -> u64 {
        match self {
            Self::PlainHttp => 1,
            Self::DefaultRoots => 2,
            Self::PrivateCa(_) => 3,
            Self::Unverified => 4,
        }
    }
}

/// blake3 digest of the canonical encoding of `trust` (see the module doc):
/// `CredentialLeaseBinding.provider_trust`. A private CA's certificates are
/// sorted and deduplicated first, so the digest names the set of anchors,
/// whatever order or PEM layout the bundle had.
pub fn provider_trust_digest(trust: &ProviderTrust<'_>) -> [u8; PROVIDER_TRUST_BYTES] {
    digest_of(PROVIDER_TRUST_DOMAIN, |enc| {
        enc.u64(1, trust.kind());
        if let ProviderTrust::PrivateCa(certificates) = trust {
            let mut certificates = certificates.clone();
            certificates.sort_unstable();
            certificates.dedup();
            // usize → u64 is lossless on every supported target.
            enc.u64(2, certificates.len() as u64);
            for certificate in certificates {
                enc.bytes(3, certificate);
            }
        }
    })
}

/// blake3 digest of the canonical encoding of `binding` (see the module doc).
pub fn binding_digest(binding: &CredentialLeaseBinding) -> [u8; BINDING_DIGEST_BYTES] {
    digest_of(BINDING_DOMAIN, |enc| {
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
        enc.bytes(11, binding.upstream_origin.as_bytes());
        enc.bytes(12, binding.run_id.as_bytes());
        enc.bytes(13, &binding.request_digest);
        enc.bytes(14, &binding.provider_trust);
    })
}

/// The upstream target string both sides put in / expect from
/// `CredentialLeaseBinding.upstream_target`: `"{adapter}/{target}"`.
pub fn upstream_target(adapter: &str, target: &str) -> String {
    format!("{adapter}/{target}")
}

/// The canonical origin both sides put in / expect from
/// `CredentialLeaseBinding.upstream_origin`: `{scheme}://{host}:{port}`
/// (`scheme` is `http` or `https`), the port always written, an IPv6 host
/// in brackets. `host` as resolved from the base URL (lowercase). The
/// scheme is part of the origin: a lease for `https://h:443` never
/// authorizes a plain-HTTP call to the same host.
pub fn upstream_origin(scheme: &str, host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("{scheme}://[{host}]:{port}")
    } else {
        format!("{scheme}://{host}:{port}")
    }
}

fn lease_header(lease: &CredentialLease) -> Vec<u8> {
    let mut enc = Canonical::new(Vec::with_capacity(512), HEADER_DOMAIN);
    put_lease_fields(&mut enc, lease, false);
    enc.0
}

fn signed_message(lease: &CredentialLease) -> Vec<u8> {
    let mut enc = Canonical::new(
        Vec::with_capacity(512 + lease.sealed_secret.len()),
        SIGNATURE_DOMAIN,
    );
    put_lease_fields(&mut enc, lease, true);
    enc.0
}

fn put_lease_fields(enc: &mut Canonical<Vec<u8>>, lease: &CredentialLease, with_sealed: bool) {
    enc.bytes(1, lease.lease_id.as_bytes());
    enc.i64(2, lease.not_before_unix_ms);
    enc.i64(3, lease.expires_at_unix_ms);
    enc.bytes(4, &lease.binding_digest);
    enc.bytes(5, &lease.ephemeral_public_key);
    if with_sealed {
        enc.bytes(7, &lease.sealed_secret);
    }
    enc.bytes(8, lease.header_name.as_bytes());
    enc.bytes(9, lease.header_format.as_bytes());
    enc.bytes(10, lease.issuer_key_id.as_bytes());
    enc.u64(12, lease.sequence);
}

fn hpke_info(digest: &[u8; BINDING_DIGEST_BYTES]) -> [u8; HPKE_INFO.len() + BINDING_DIGEST_BYTES] {
    let mut info = [0u8; HPKE_INFO.len() + BINDING_DIGEST_BYTES];
    info[..HPKE_INFO.len()].copy_from_slice(HPKE_INFO);
    info[HPKE_INFO.len()..].copy_from_slice(digest);
    info
}

// ---------------------------------------------------------------------------
// Structural checks, shared by issue and open

fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn is_header_value_byte(b: u8) -> bool {
    b == b'\t' || (b' '..=b'~').contains(&b)
}

fn is_visible_byte(b: u8) -> bool {
    (b'!'..=b'~').contains(&b)
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
    check_text(
        &binding.upstream_origin,
        max,
        "binding.upstream_origin",
        is_visible_byte,
    )?;
    let origin = &binding.upstream_origin;
    if !(origin.starts_with("http://") || origin.starts_with("https://")) {
        return Err("binding.upstream_origin");
    }
    check_text(&binding.run_id, max, "binding.run_id", is_visible_byte)?;
    if binding.request_digest.len() != REQUEST_DIGEST_BYTES {
        return Err("binding.request_digest");
    }
    if binding.provider_trust.len() != PROVIDER_TRUST_BYTES {
        return Err("binding.provider_trust");
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
    /// Position in issue order for the binding's node and projection, from
    /// 1 (the Node's replay window key).
    pub sequence: u64,
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
            .field("sequence", &self.sequence)
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
    if params.sequence == 0 {
        return Err(invalid("sequence"));
    }
    check_binding(params.binding).map_err(invalid)?;
    if params.binding.recipient != recipient_key_id(recipient) {
        return Err(invalid("binding.recipient"));
    }
    check_window(params.not_before_unix_ms, params.expires_at_unix_ms).map_err(invalid)?;
    if !check_secret(params.secret) {
        return Err(invalid("secret"));
    }

    let digest = binding_digest(params.binding);
    let recipient = <Kem as hpke::Kem>::PublicKey::from_bytes(recipient.as_bytes())
        .map_err(|_| IssueError::NonContributory)?;
    let mut rng = entropy.rng();
    let (encapped, mut sealer) = hpke::setup_sender_with_rng::<Aead, Kdf, Kem>(
        &OpModeS::Base,
        &recipient,
        &hpke_info(&digest),
        &mut rng,
    )
    .map_err(|_| IssueError::NonContributory)?;
    drop(rng);

    let mut lease = CredentialLease {
        lease_id: params.lease_id.to_owned(),
        not_before_unix_ms: params.not_before_unix_ms,
        expires_at_unix_ms: params.expires_at_unix_ms,
        binding_digest: Bytes::copy_from_slice(&digest),
        ephemeral_public_key: Bytes::copy_from_slice(&encapped.to_bytes()),
        sealed_secret: Bytes::new(),
        header_name: params.header_name.to_owned(),
        header_format: params.header_format.to_owned(),
        issuer_key_id: issuer_key_id(&issuer.verifying_key()),
        signature: Bytes::new(),
        sequence: params.sequence,
    };

    // Sealed in a wiping buffer sized once; only ciphertext leaves it.
    let mut buffer = Zeroizing::new(Vec::with_capacity(params.secret.len() + TAG_BYTES));
    buffer.extend_from_slice(params.secret);
    let tag = sealer
        .seal_inout_detached((&mut buffer[..]).into(), &lease_header(&lease))
        .map_err(|_| IssueError::Seal)?;
    buffer.extend_from_slice(&tag.to_bytes());
    lease.sealed_secret = Bytes::copy_from_slice(&buffer);
    sign(&mut lease, issuer);
    Ok(lease)
}

/// (Re)computes `lease.signature` over every other field with `issuer`.
/// [`issue`] calls this; it is public so tests can build leases whose
/// signature is valid but whose sealed content is not.
pub fn sign(lease: &mut CredentialLease, issuer: &SigningKey) {
    let signature = issuer.sign(&signed_message(lease));
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
    /// [`upstream_origin`] of the adapter the request would go to.
    pub upstream_origin: &'a str,
    /// [`provider_trust_digest`] of the TLS trust of the client the request
    /// would go out on.
    pub provider_trust: &'a [u8; PROVIDER_TRUST_BYTES],
    /// The tunnel's run id.
    pub run_id: &'a str,
    /// [`request_digest`] of what the Node would send.
    pub request_digest: &'a [u8; REQUEST_DIGEST_BYTES],
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

impl<'a> ExpectedScope<'a> {
    /// The scope a Node computes itself — its node id, and the target,
    /// origin, provider trust, run, request and profile of the call it is
    /// about to make — with the Edge's own facts (principal, slot, route,
    /// revisions, projection) left to the signature.
    pub fn computed_by_node(
        selected_node: &'a str,
        upstream_target: &'a str,
        upstream_origin: &'a str,
        provider_trust: &'a [u8; PROVIDER_TRUST_BYTES],
        run_id: &'a str,
        request_digest: &'a [u8; REQUEST_DIGEST_BYTES],
        profile: Option<&'a str>,
    ) -> Self {
        Self {
            selected_node,
            upstream_target,
            upstream_origin,
            provider_trust,
            run_id,
            request_digest,
            profile,
            principal: None,
            slot: None,
            route: None,
            credential_revision: None,
            route_revision: None,
            projection_generation: None,
        }
    }

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
        same(
            Some(self.selected_node),
            binding.selected_node.as_str(),
            "selected_node",
        )?;
        same(
            Some(self.upstream_target),
            binding.upstream_target.as_str(),
            "upstream_target",
        )?;
        same(
            Some(self.upstream_origin),
            binding.upstream_origin.as_str(),
            "upstream_origin",
        )?;
        same(
            Some(&self.provider_trust[..]),
            &binding.provider_trust[..],
            "provider_trust",
        )?;
        same(Some(self.run_id), binding.run_id.as_str(), "run_id")?;
        same(
            Some(&self.request_digest[..]),
            &binding.request_digest[..],
            "request_digest",
        )?;
        same(self.profile, binding.profile.as_str(), "profile")?;
        same(self.principal, binding.principal.as_str(), "principal")?;
        same(self.slot, binding.slot.as_str(), "slot")?;
        same(self.route, binding.route.as_str(), "route")?;
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

/// Origins a Node lets each credential slot's secret reach (`node.toml`
/// `[credentials.allowed_origins]`): even a genuine, signed lease of a
/// pinned slot opens only for a request to one of its origins. A slot
/// without an entry is not pinned (the signed `upstream_origin` alone
/// decides).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OriginPins {
    by_slot: BTreeMap<String, BTreeSet<String>>,
}

impl OriginPins {
    /// No slot pinned.
    pub fn new() -> Self {
        Self::default()
    }

    /// Allows `slot` to reach `origin` (an [`upstream_origin`] string).
    pub fn allow(&mut self, slot: impl Into<String>, origin: impl Into<String>) {
        self.by_slot
            .entry(slot.into())
            .or_default()
            .insert(origin.into());
    }

    /// True when `slot` may reach `origin`: it is not pinned, or `origin`
    /// is one of its pins.
    pub fn allows(&self, slot: &str, origin: &str) -> bool {
        self.by_slot
            .get(slot)
            .is_none_or(|origins| origins.contains(origin))
    }

    /// True when no slot is pinned.
    pub fn is_empty(&self) -> bool {
        self.by_slot.is_empty()
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
    /// Revoked revisions per slot (`NodeConfigPayload.revoked_credentials`).
    pub revoked: &'a [RevokedCredential],
    /// The Node's own origin pins.
    pub origin_pins: &'a OriginPins,
    /// Wall-clock now (Unix ms); [`ReplayGuard`] keeps it from going back.
    pub now_unix_ms: i64,
    /// Tolerated clock difference to the Edge, applied to both window edges.
    pub clock_skew_ms: u32,
}

/// One projection's anti-replay window: the highest sequence opened and a
/// bitmap of the [`ReplayGuard::window_leases`] sequences at and below it.
#[derive(Debug)]
struct SequenceWindow {
    highest: u64,
    seen: Box<[u64]>,
    keep_until_unix_ms: i64,
}

impl SequenceWindow {
    fn new(window_leases: u64) -> Self {
        // window_leases is a multiple of 64 ≤ u32::MAX: the cast is exact.
        let words = (window_leases / 64) as usize;
        Self {
            highest: 0,
            seen: vec![0; words].into_boxed_slice(),
            keep_until_unix_ms: i64::MIN,
        }
    }

    fn window_leases(&self) -> u64 {
        self.seen.len() as u64 * 64
    }

    fn slot(&self, sequence: u64) -> (usize, u64) {
        let index = sequence % self.window_leases();
        // index < window_leases, which fits usize.
        ((index / 64) as usize, 1 << (index % 64))
    }

    fn check(&self, sequence: u64) -> Result<(), LeaseError> {
        if sequence > self.highest {
            return Ok(());
        }
        if self.highest - sequence >= self.window_leases() {
            return Err(LeaseError::SequenceTooOld);
        }
        let (word, bit) = self.slot(sequence);
        if self.seen[word] & bit != 0 {
            return Err(LeaseError::Replayed);
        }
        Ok(())
    }

    fn record(&mut self, sequence: u64, keep_until_unix_ms: i64) {
        if sequence > self.highest {
            let advance = sequence - self.highest;
            if advance >= self.window_leases() {
                self.seen.fill(0);
            } else {
                // The slots now covering highest+1..sequence held sequences
                // that slid out of the window.
                for skipped in self.highest + 1..sequence {
                    let (word, bit) = self.slot(skipped);
                    self.seen[word] &= !bit;
                }
            }
            self.highest = sequence;
        }
        let (word, bit) = self.slot(sequence);
        self.seen[word] |= bit;
        self.keep_until_unix_ms = self.keep_until_unix_ms.max(keep_until_unix_ms);
    }
}

/// The Node's replay state (C2): one sliding window of sequence numbers per
/// `projection_generation`, each kept until every lease opened through it
/// is past `expires_at + skew`. Bounded by construction:
///
/// - memory: at most `max_windows × window_leases / 8` bytes of bitmap
///   (2 MiB with the defaults), whatever the issue rate — a flood of leases
///   on one session slides one window, it does not fill anything;
/// - windows: one per Edge session of this Node whose leases are still
///   valid, at most about `(MAX_LEASE_LIFETIME_MS + 2 × skew) /
///   reconnect interval`; past `max_windows` a lease of a *new* session is
///   refused ([`LeaseError::ReplayWindowsFull`], fail closed; warn from
///   [`ReplayGuard::is_near_full`]) and the sessions in use go on;
/// - restart: a lease issued before `started_unix_ms − skew` is refused
///   ([`LeaseError::IssuedBeforeStart`]): whatever was opened before a
///   restart can no longer be replayed after it;
/// - time: the guard's clock is the highest `now` it was ever given, so a
///   wall clock stepped back neither re-admits nor un-expires anything.
#[derive(Debug)]
pub struct ReplayGuard {
    started_unix_ms: i64,
    clock_unix_ms: i64,
    window_leases: u64,
    max_windows: usize,
    windows: HashMap<u64, SequenceWindow>,
}

impl ReplayGuard {
    /// A guard that started at `started_unix_ms`, with
    /// [`REPLAY_WINDOW_LEASES`] and [`REPLAY_MAX_WINDOWS`].
    pub fn new(started_unix_ms: i64) -> Self {
        Self::with_limits(started_unix_ms, REPLAY_WINDOW_LEASES, REPLAY_MAX_WINDOWS)
    }

    /// A guard with other bounds: `window_leases` is rounded up to a
    /// multiple of 64 (at least 64, at most 2³²), `max_windows` at least 1.
    pub fn with_limits(started_unix_ms: i64, window_leases: u64, max_windows: usize) -> Self {
        let window_leases = window_leases.clamp(64, 1 << 32).div_ceil(64) * 64;
        Self {
            started_unix_ms,
            clock_unix_ms: started_unix_ms,
            window_leases,
            max_windows: max_windows.max(1),
            windows: HashMap::new(),
        }
    }

    /// Windows held now.
    pub fn windows(&self) -> usize {
        self.windows.len()
    }

    /// Most windows held at once.
    pub fn max_windows(&self) -> usize {
        self.max_windows
    }

    /// Sequences one window remembers.
    pub fn window_leases(&self) -> u64 {
        self.window_leases
    }

    /// Upper bound of the bitmap memory, in bytes.
    pub fn memory_bound_bytes(&self) -> u64 {
        self.max_windows as u64 * (self.window_leases / 8)
    }

    /// True when three quarters or more of the windows are in use: time to
    /// warn before new sessions are refused.
    pub fn is_near_full(&self) -> bool {
        self.windows.len() * 4 >= self.max_windows * 3
    }

    /// When the replay state began (Unix ms).
    pub fn started_unix_ms(&self) -> i64 {
        self.started_unix_ms
    }

    /// The guard's clock: the highest `now` it has been given.
    pub fn clock_unix_ms(&self) -> i64 {
        self.clock_unix_ms
    }

    /// Advances the guard's clock to `now_unix_ms` if that is later and
    /// returns the clock: a reading behind it is read as the clock.
    pub fn observe_clock(&mut self, now_unix_ms: i64) -> i64 {
        self.clock_unix_ms = self.clock_unix_ms.max(now_unix_ms);
        self.clock_unix_ms
    }

    /// True when `sequence` of `projection` was opened and its window is
    /// still held.
    pub fn contains(&self, projection: u64, sequence: u64) -> bool {
        self.windows
            .get(&projection)
            .is_some_and(|w| w.check(sequence) == Err(LeaseError::Replayed))
    }

    /// Drops the windows whose every lease is past `expires_at + skew` on
    /// the guard's clock (after observing `now_unix_ms`). Returns how many
    /// were dropped. [`open`] calls it.
    pub fn prune(&mut self, now_unix_ms: i64) -> usize {
        let now = self.observe_clock(now_unix_ms);
        let before = self.windows.len();
        self.windows.retain(|_, w| w.keep_until_unix_ms > now);
        before - self.windows.len()
    }

    /// Whether `sequence` of `projection` may be opened: not opened before,
    /// within its window, and room for the window if it is new.
    pub fn check(&self, projection: u64, sequence: u64) -> Result<(), LeaseError> {
        match self.windows.get(&projection) {
            Some(window) => window.check(sequence),
            None if self.windows.len() >= self.max_windows => Err(LeaseError::ReplayWindowsFull),
            None => Ok(()),
        }
    }

    /// Records `sequence` of `projection` as opened, its window kept at
    /// least until `keep_until_unix_ms`. Call only after [`Self::check`]
    /// passed ([`open`] does, once the lease decrypted).
    pub fn record(&mut self, projection: u64, sequence: u64, keep_until_unix_ms: i64) {
        let window_leases = self.window_leases;
        self.windows
            .entry(projection)
            .or_insert_with(|| SequenceWindow::new(window_leases))
            .record(sequence, keep_until_unix_ms);
    }
}

/// The opened credential (C2). Zeroized on drop; `Debug` is redacted; there
/// is no `Display` or `Clone`, so it cannot be cached across requests (C5).
pub struct OpenedSecret {
    secret: Zeroizing<Vec<u8>>,
    header_name: String,
    header_format: String,
    _alive: Alive,
}

/// Opened credentials in this process now: every [`OpenedSecret`] from
/// [`open`] until it is dropped (and zeroized). A provider call holds its
/// credential until the call returns (W10), so this counts the plaintext
/// secrets in memory, for diagnostics and tests.
pub fn opened_secrets_alive() -> usize {
    ALIVE.load(Ordering::Relaxed)
}

static ALIVE: AtomicUsize = AtomicUsize::new(0);

/// One count of [`opened_secrets_alive`], given back on drop.
struct Alive;

impl Alive {
    fn new() -> Self {
        ALIVE.fetch_add(1, Ordering::Relaxed);
        Self
    }
}

impl Drop for Alive {
    fn drop(&mut self) {
        ALIVE.fetch_sub(1, Ordering::Relaxed);
    }
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

fn is_revoked(revoked: &[RevokedCredential], binding: &CredentialLeaseBinding) -> bool {
    revoked
        .iter()
        .filter(|r| r.slot == binding.slot)
        .any(|r| r.revisions.contains(&binding.credential_revision))
}

/// Verifies and opens a lease for the request the Node serves (C2, C3, C5).
///
/// `lease` and `binding` are the request's optional fields; either absent is
/// `lease_missing`. Checks run in this order, the first failure wins:
/// structure → issuer key id and Ed25519 signature → binding digest → scope
/// (every field in `ctx.scope`) → recipient key id → revoked revision →
/// pinned origins → time window on the guard's clock (`not_before − skew ≤
/// now < expires_at + skew`) → issued after the guard started (minus skew)
/// → replay window → HPKE key agreement and decryption → secret is a valid
/// header value. Only a lease that passes all of them is recorded in
/// `replay` (its window kept until `expires_at + skew`), so a rejected lease
/// never poisons the replay state.
pub fn open(
    lease: Option<&CredentialLease>,
    binding: Option<&CredentialLeaseBinding>,
    ctx: &OpenContext<'_>,
    replay: &mut ReplayGuard,
) -> Result<OpenedSecret, LeaseError> {
    let lease = lease.ok_or(LeaseError::LeaseMissing)?;
    let binding = binding.ok_or(LeaseError::BindingMissing)?;

    // Structure.
    let malformed = |field| LeaseError::Malformed { field };
    check_lease_text(&lease.lease_id, &lease.header_name, &lease.header_format)
        .map_err(malformed)?;
    check_binding(binding).map_err(malformed)?;
    check_window(lease.not_before_unix_ms, lease.expires_at_unix_ms).map_err(malformed)?;
    if lease.sequence == 0 {
        return Err(malformed("sequence"));
    }
    let digest: [u8; BINDING_DIGEST_BYTES] = fixed(&lease.binding_digest, "binding_digest")?;
    let ephemeral_public: [u8; EPHEMERAL_PUBLIC_KEY_BYTES] =
        fixed(&lease.ephemeral_public_key, "ephemeral_public_key")?;
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
        .verify_strict(&signed_message(lease), &Signature::from_bytes(&signature))
        .map_err(|_| LeaseError::BadSignature)?;

    // Binding digest, scope, recipient.
    if digest != binding_digest(binding) {
        return Err(LeaseError::DigestMismatch);
    }
    ctx.scope.check(binding)?;
    if binding.recipient != ctx.recipient.key_id() {
        return Err(LeaseError::WrongRecipient);
    }

    // The Node's own policy: revocations and origin pins.
    if is_revoked(ctx.revoked, binding) {
        return Err(LeaseError::Revoked {
            revision: binding.credential_revision,
        });
    }
    if !ctx
        .origin_pins
        .allows(&binding.slot, &binding.upstream_origin)
    {
        return Err(LeaseError::OriginNotAllowed);
    }

    // Time window, on a clock that never goes back.
    let now = replay.observe_clock(ctx.now_unix_ms);
    let skew_ms = i64::from(ctx.clock_skew_ms);
    if now < lease.not_before_unix_ms.saturating_sub(skew_ms) {
        return Err(LeaseError::NotYetValid);
    }
    let keep_until_ms = lease.expires_at_unix_ms.saturating_add(skew_ms);
    if now >= keep_until_ms {
        return Err(LeaseError::Expired);
    }
    if lease.not_before_unix_ms < replay.started_unix_ms().saturating_sub(skew_ms) {
        return Err(LeaseError::IssuedBeforeStart);
    }

    // Replay state.
    replay.prune(now);
    replay.check(binding.projection_generation, lease.sequence)?;

    // Decrypt.
    let encapped = <Kem as hpke::Kem>::EncappedKey::from_bytes(&ephemeral_public)
        .map_err(|_| malformed("ephemeral_public_key"))?;
    let mut opener = hpke::setup_receiver::<Aead, Kdf, Kem>(
        &OpModeR::Base,
        &ctx.recipient.secret,
        &encapped,
        &hpke_info(&digest),
    )
    .map_err(|_| LeaseError::NoSharedSecret)?;
    let (ciphertext, tag) = lease.sealed_secret.split_at(sealed_len - TAG_BYTES);
    let tag = AeadTag::<Aead>::from_bytes(tag).map_err(|_| malformed("sealed_secret"))?;
    let mut secret = Zeroizing::new(ciphertext.to_vec());
    opener
        .open_inout_detached((&mut secret[..]).into(), &lease_header(lease), &tag)
        .map_err(|_| LeaseError::Decrypt)?;
    if !check_secret(&secret) {
        return Err(LeaseError::BadSecret);
    }

    replay.record(binding.projection_generation, lease.sequence, keep_until_ms);
    Ok(OpenedSecret {
        secret,
        header_name: lease.header_name.clone(),
        header_format: lease.header_format.clone(),
        _alive: Alive::new(),
    })
}
