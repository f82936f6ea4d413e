//! Client API keys → principals ([`ClientKeys`]): who sent a request and
//! what its key may do (its models, its scopes, its principal's limits).
//! The keys are stored as blake3 hashes; SIGHUP replaces them for every
//! shard at once ([`ClientKeys::replace`]).

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Instant;

use iop_engine::clock;
use iop_engine::http::Header;
use iop_wire::lease;

use crate::api::error::GatewayError;
use crate::config::ClientKeySpec;
use crate::plane::budget_file::{BudgetFile, BudgetFileStatus, Replay};
use crate::plane::budgets::{BudgetView, Budgets, Exhausted};
use crate::plane::limits::{self, Limiter, RateHeaders, Ticket};

/// The principal of requests when no client keys are configured.
pub const ANONYMOUS_PRINCIPAL: &str = "anonymous";

// ---------------------------------------------------------------------------
// Client API keys

/// blake3 of a client API key: the `key_hash` stored in `[[client_keys]]`.
pub fn hash_client_key(key: &[u8]) -> [u8; 32] {
    *blake3::hash(key).as_bytes()
}

/// [`hash_client_key`] as lowercase hex, the config form.
pub fn client_key_hash_hex(key: &[u8]) -> String {
    lease::encode_hex(&hash_client_key(key))
}

/// The configured client API keys, by hash. Empty = the surface is open and
/// every request runs as [`ANONYMOUS_PRINCIPAL`].
///
/// Clones share one table: the shards of an Edge hold clones, and
/// [`ClientKeys::replace`] (SIGHUP) swaps the keys for all of them at once.
/// Each request is authenticated against the table as it is when its head
/// has been read; a request already authenticated runs on under a key
/// revoked after that.
///
/// The clones also share the principals' [`Limiter`] and [`Budgets`]: a
/// principal's limits hold across shards. Their one lock is taken once
/// when a request is admitted and once when it ends.
#[derive(Clone)]
pub struct ClientKeys {
    table: Arc<RwLock<HashMap<[u8; 32], Caller>>>,
    limiter: Arc<Mutex<Policy>>,
    anonymous: Caller,
}

/// The principals' limits and token budgets, behind one lock.
#[derive(Debug, Default)]
struct Policy {
    limiter: Limiter,
    budgets: Budgets,
    /// Where budget usage is kept across restarts (`edge.budget_file`).
    file: Option<BudgetFile>,
    /// The budget clock's offset from the wall clock
    /// ([`crate::plane::budgets::CLOCK_OFFSET_ENV`], test-only; else 0).
    clock_offset_ms: i64,
}

impl Policy {
    fn budget_now_ms(&self) -> i64 {
        clock::unix_ms().saturating_add(self.clock_offset_ms)
    }
}

/// An admitted request's claim on its principal's limits and budgets; give
/// it back with [`ClientKeys::finish`] exactly once.
#[derive(Debug)]
#[must_use = "a claim holds a concurrency slot until ClientKeys::finish"]
pub struct Claim {
    ticket: Ticket,
    /// For a principal with budgets: its name and the request's estimate
    /// (recorded when no usage is observed).
    budget: Option<(Arc<str>, u64)>,
}

/// [`ClientKeys::admit`]'s outcome.
#[derive(Debug)]
pub enum Admission {
    /// Admitted; the headers are the rates after this request's charge.
    Granted(Claim, RateHeaders),
    /// Over a limit (`max_concurrent`, a rate).
    Limited(limits::Refusal),
    /// A token budget is spent.
    OverBudget(Exhausted),
}

/// The token budgets as `/status` and `/metrics` show them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetsStatus {
    /// The budget clock (Unix ms) the views were taken at.
    pub now_unix_ms: i64,
    /// Each principal with a budget, in config order.
    pub principals: Vec<BudgetView>,
    /// The budget file, when one is open: every record counted in
    /// `principals` is on disk once its `durable` reaches `appended`.
    pub file: Option<BudgetFileStatus>,
}

impl Default for ClientKeys {
    fn default() -> Self {
        Self {
            table: Arc::default(),
            limiter: Arc::default(),
            anonymous: Caller {
                principal: Arc::from(ANONYMOUS_PRINCIPAL),
                authority: Authority::Anonymous,
                models: None,
                priority: crate::config::DEFAULT_PRIORITY,
                weight: 1,
                principal_id: principal_id(ANONYMOUS_PRINCIPAL),
            },
        }
    }
}

impl fmt::Debug for ClientKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientKeys")
            .field("keys", &self.len())
            .finish()
    }
}

/// The number a principal's queued requests are charged to: the first 8
/// bytes of the blake3 of its name.
pub fn principal_id(principal: &str) -> u64 {
    let hash = blake3::hash(principal.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&hash.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

/// Who sent a request: the principal of its client key and what the key
/// may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The principal bound into every lease issued for the request.
    pub principal: Arc<str>,
    /// How the request was let in.
    pub authority: Authority,
    /// The only models the key may use (`models = [...]`); `None` = all.
    pub models: Option<Arc<[String]>>,
    /// Its requests' priority class (`priority`), possibly lowered for
    /// one request by the `x-iop-priority` header.
    pub priority: u8,
    /// Its weight among the principals of its class (`weight`).
    pub weight: u32,
    /// A stable number for the principal: whom its queued requests are
    /// charged to.
    pub principal_id: u64,
}

impl Caller {
    /// Whether the caller may use `model`.
    pub fn may_use(&self, model: &str) -> bool {
        self.models
            .as_ref()
            .is_none_or(|allowed| allowed.iter().any(|m| m == model))
    }
}

/// How a request was let in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Authority {
    /// No client keys are configured: every request is let in as
    /// [`ANONYMOUS_PRINCIPAL`] (the `/admin` routes then answer loopback
    /// peers only).
    Anonymous,
    /// A configured client key.
    Key {
        /// The key has `scopes = ["admin"]`: it may use the `/admin` routes.
        admin: bool,
        /// The key has `scopes = ["metrics"]`: it may read `/metrics` (under
        /// `edge.metrics_access = "key"`) and the whole of `/status`.
        metrics: bool,
    },
}

impl Authority {
    /// Whether the caller may see the whole fleet: every provider on
    /// `/status`, and `/metrics` under `edge.metrics_access = "key"`.
    /// Without client keys every caller may.
    pub fn sees_everything(self) -> bool {
        match self {
            Authority::Anonymous => true,
            Authority::Key { admin, metrics } => admin || metrics,
        }
    }
}

/// What [`ClientKeys::replace`] changed, by key (no key or hash appears).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeysChange {
    /// Keys now configured.
    pub keys: usize,
    /// Keys that were not configured before.
    pub added: usize,
    /// Keys no longer configured: their next request gets 401.
    pub revoked: usize,
    /// Keys still configured whose principal or scopes changed.
    pub changed: usize,
}

/// Why a client request was not authenticated (401).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No API key was presented.
    #[error("no API key")]
    Missing,
    /// The presented key is not a configured client key.
    #[error("invalid API key")]
    Invalid,
}

impl AuthError {
    /// The 401 answer. `x_api_key` says whether the route also accepts the
    /// key in `x-api-key` (Anthropic routes), for the message.
    pub fn api_error(&self, x_api_key: bool) -> GatewayError {
        let how = if x_api_key {
            "`Authorization: Bearer <key>` or `x-api-key: <key>`"
        } else {
            "`Authorization: Bearer <key>`"
        };
        match self {
            AuthError::Missing => GatewayError::unauthenticated(
                format!("You didn't provide an API key. Send it as {how}."),
                None,
            ),
            AuthError::Invalid => GatewayError::unauthenticated(
                "Incorrect API key provided.",
                Some("invalid_api_key"),
            ),
        }
    }
}

impl ClientKeys {
    /// The keys of `[[client_keys]]`.
    pub fn from_config(specs: &[ClientKeySpec]) -> Self {
        let keys = Self::default();
        keys.replace(specs);
        keys
    }

    fn table_of(specs: &[ClientKeySpec]) -> HashMap<[u8; 32], Caller> {
        specs
            .iter()
            .map(|k| {
                let caller = Caller {
                    principal: Arc::from(k.principal.as_str()),
                    authority: Authority::Key {
                        admin: k.admin,
                        metrics: k.metrics,
                    },
                    models: k.models.as_deref().map(Arc::from),
                    priority: k.priority,
                    weight: k.weight,
                    principal_id: principal_id(&k.principal),
                };
                (k.key_hash, caller)
            })
            .collect()
    }

    /// Makes `specs` the configured keys, for every clone (SIGHUP): keys
    /// not in `specs` are refused from the next request on, new ones
    /// accepted; requests already authenticated are not affected.
    pub fn replace(&self, specs: &[ClientKeySpec]) -> KeysChange {
        let next = Self::table_of(specs);
        let mut table = self.table.write().unwrap_or_else(PoisonError::into_inner);
        let change = KeysChange {
            keys: next.len(),
            added: next.keys().filter(|h| !table.contains_key(*h)).count(),
            revoked: table.keys().filter(|h| !next.contains_key(*h)).count(),
            changed: next
                .iter()
                .filter(|(h, caller)| table.get(*h).is_some_and(|old| old != *caller))
                .count(),
        };
        *table = next;
        drop(table);
        let mut policy = self.policy();
        policy
            .limiter
            .configure(specs.iter().map(|k| (k.principal.as_str(), k.limits)));
        policy
            .budgets
            .configure(specs.iter().map(|k| (k.principal.as_str(), k.budgets)));
        change
    }

    fn policy(&self) -> std::sync::MutexGuard<'_, Policy> {
        self.limiter.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Opens the budget file (`edge.budget_file`, at startup): replays it
    /// into the budgets' usage, compacts it, and from now on appends every
    /// usage record of a principal with a budget. `clock_offset_ms` moves
    /// the budget clock (test-only; 0 in production). The error names the
    /// file.
    pub fn open_budget_file(&self, path: &Path, clock_offset_ms: i64) -> Result<Replay, String> {
        let mut policy = self.policy();
        policy.clock_offset_ms = clock_offset_ms;
        let (file, ledger, replay) = BudgetFile::open(path, policy.budget_now_ms())?;
        policy.budgets.load(ledger);
        if let Some(old) = policy.file.replace(file) {
            old.close();
        }
        Ok(replay)
    }

    /// Writes what waits for the budget file and stops its writer (after
    /// the drain).
    pub fn close_budget_file(&self) {
        let file = self.policy().file.take();
        if let Some(file) = file {
            file.close();
        }
    }

    /// Admits a request of `principal` against its budgets, then its
    /// limits (before it takes a lease); see [`Budgets::admit`] and
    /// [`Limiter::admit`]. The budget clock is read only when some
    /// principal has a budget.
    pub fn admit(&self, principal: &str, estimated_tokens: u64, now: Instant) -> Admission {
        let mut policy = self.policy();
        let budget = if policy.budgets.is_empty() {
            None
        } else {
            let now_unix_ms = policy.budget_now_ms();
            match policy.budgets.admit(principal, now_unix_ms) {
                Ok(name) => name.map(|name| (name, estimated_tokens)),
                Err(exhausted) => return Admission::OverBudget(exhausted),
            }
        };
        match policy.limiter.admit(principal, estimated_tokens, now) {
            limits::Admission::Granted(ticket, headers) => {
                Admission::Granted(Claim { ticket, budget }, headers)
            }
            limits::Admission::Refused(refusal) => Admission::Limited(refusal),
        }
    }

    /// In a cluster: `edges` live Edges share every key's limits and
    /// budgets, this one `rank` in name order; see [`Limiter::set_share`].
    pub fn set_cluster_share(&self, edges: u32, rank: u32) {
        let mut policy = self.policy();
        policy.limiter.set_share(edges, rank);
        policy.budgets.set_share(edges, rank);
    }

    /// Ends an admitted request; see [`Limiter::finish`]. A principal with
    /// budgets is charged `observed_tokens` (its estimate when `None`),
    /// and the record goes to the budget file.
    pub fn finish(&self, claim: Claim, observed_tokens: Option<u64>, now: Instant) {
        let mut policy = self.policy();
        policy.limiter.finish(claim.ticket, observed_tokens, now);
        if let Some((name, estimate)) = claim.budget {
            let now_unix_ms = policy.budget_now_ms();
            let tokens = observed_tokens.unwrap_or(estimate);
            if let Some(record) = policy.budgets.record(&name, tokens, now_unix_ms) {
                if let Some(file) = &policy.file {
                    file.append(&record);
                }
            }
        }
    }

    /// The token budgets now; `None` when no principal has one.
    pub fn budgets_status(&self) -> Option<BudgetsStatus> {
        let policy = self.policy();
        if policy.budgets.is_empty() {
            return None;
        }
        let now_unix_ms = policy.budget_now_ms();
        Some(BudgetsStatus {
            now_unix_ms,
            principals: policy.budgets.views(now_unix_ms),
            file: policy.file.as_ref().map(BudgetFile::status),
        })
    }

    fn len(&self) -> usize {
        self.table
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// The caller of a route that needs no key (`/livez`, `/readyz`,
    /// `/metrics`).
    pub fn anonymous(&self) -> Caller {
        self.anonymous.clone()
    }

    /// True when requests must present a key.
    pub fn is_enabled(&self) -> bool {
        self.len() > 0
    }

    /// The caller of a request with `headers`: [`ANONYMOUS_PRINCIPAL`]
    /// when no keys are configured; otherwise the principal of the key in
    /// `Authorization: Bearer <key>` (or, when `x_api_key`, in
    /// `x-api-key: <key>`).
    pub fn authenticate(&self, headers: &[Header], x_api_key: bool) -> Result<Caller, AuthError> {
        let bearer = headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case("authorization"))
            .map(|h| bearer_token(&h.value));
        let api_key = headers
            .iter()
            .filter(|h| x_api_key && h.name.eq_ignore_ascii_case("x-api-key"))
            .map(|h| Some(&h.value[..]));
        let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
        if table.is_empty() {
            return Ok(self.anonymous.clone());
        }
        let mut presented = false;
        for candidate in bearer.chain(api_key) {
            presented = true;
            let Some(key) = candidate.filter(|k| !k.is_empty()) else {
                continue;
            };
            if let Some(caller) = table.get(&hash_client_key(key)) {
                return Ok(caller.clone());
            }
        }
        Err(if presented {
            AuthError::Invalid
        } else {
            AuthError::Missing
        })
    }
}

/// The token of an `Authorization: Bearer <token>` value (scheme
/// case-insensitive), or `None` for another scheme.
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer ";
    if value.len() < SCHEME.len() || !value[..SCHEME.len()].eq_ignore_ascii_case(SCHEME) {
        return None;
    }
    let token = &value[SCHEME.len()..];
    let start = token.iter().position(|&b| b != b' ').unwrap_or(token.len());
    Some(&token[start..])
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn header(name: &str, value: &str) -> Header {
        Header {
            name: name.into(),
            value: Bytes::copy_from_slice(value.as_bytes()),
        }
    }

    // CONTRACT: C1 — the principal bound into a lease comes from the
    // client's key.
    #[test]
    fn client_keys_map_keys_to_principals() {
        let open = ClientKeys::default();
        assert!(!open.is_enabled());
        let anonymous = Caller {
            principal: ANONYMOUS_PRINCIPAL.into(),
            authority: Authority::Anonymous,
            models: None,
            priority: crate::config::DEFAULT_PRIORITY,
            weight: 1,
            principal_id: principal_id(ANONYMOUS_PRINCIPAL),
        };
        assert_eq!(open.authenticate(&[], false), Ok(anonymous));
        let spec = |principal: &str, key: &[u8], admin: bool| ClientKeySpec {
            principal: principal.into(),
            key_hash: hash_client_key(key),
            admin,
            metrics: false,
            limits: Default::default(),
            budgets: Default::default(),
            models: None,
            priority: crate::config::DEFAULT_PRIORITY,
            weight: 1,
        };
        let caller = |principal: &str, admin: bool| {
            Ok(Caller {
                principal: principal.into(),
                authority: Authority::Key {
                    admin,
                    metrics: false,
                },
                models: None,
                priority: crate::config::DEFAULT_PRIORITY,
                weight: 1,
                principal_id: principal_id(principal),
            })
        };
        let keys = ClientKeys::from_config(&[
            spec("team-a", b"key-a", false),
            spec("team-b", b"key-b", true),
        ]);
        assert_eq!(
            keys.authenticate(&[header("Authorization", "Bearer key-a")], false),
            caller("team-a", false)
        );
        assert_eq!(
            keys.authenticate(&[header("authorization", "bearer  key-b")], false),
            caller("team-b", true)
        );
        assert_eq!(keys.authenticate(&[], false), Err(AuthError::Missing));
        assert_eq!(
            keys.authenticate(&[header("Authorization", "Bearer nope")], false),
            Err(AuthError::Invalid)
        );
        assert_eq!(
            keys.authenticate(&[header("Authorization", "Basic key-a")], false),
            Err(AuthError::Invalid)
        );
        assert_eq!(
            keys.authenticate(&[header("Authorization", "Bearer ")], false),
            Err(AuthError::Invalid)
        );
        // x-api-key only where the route accepts it (Anthropic).
        assert_eq!(
            keys.authenticate(&[header("x-api-key", "key-b")], false),
            Err(AuthError::Missing)
        );
        assert_eq!(
            keys.authenticate(&[header("x-api-key", "key-b")], true),
            caller("team-b", true)
        );
        assert_eq!(
            client_key_hash_hex(b"key-a"),
            blake3::hash(b"key-a").to_hex().to_string()
        );
    }

    // A replace reaches every clone: a revoked key is refused from the
    // next request on, an added one accepted, a changed scope applied.
    #[test]
    fn replacing_keys_reaches_every_clone() {
        let spec = |principal: &str, key: &[u8], admin: bool| ClientKeySpec {
            principal: principal.into(),
            key_hash: hash_client_key(key),
            admin,
            metrics: false,
            limits: Default::default(),
            budgets: Default::default(),
            models: None,
            priority: crate::config::DEFAULT_PRIORITY,
            weight: 1,
        };
        let keys = ClientKeys::from_config(&[
            spec("team-a", b"key-a", false),
            spec("team-b", b"key-b", false),
        ]);
        let shard = keys.clone();
        let change = keys.replace(&[
            spec("team-b", b"key-b", true),
            spec("team-c", b"key-c", false),
        ]);
        assert_eq!(
            change,
            KeysChange {
                keys: 2,
                added: 1,
                revoked: 1,
                changed: 1
            }
        );
        let bearer = |key: &str| [header("authorization", &format!("Bearer {key}"))];
        assert_eq!(
            shard.authenticate(&bearer("key-a"), false),
            Err(AuthError::Invalid)
        );
        assert_eq!(
            shard
                .authenticate(&bearer("key-c"), false)
                .map(|c| c.principal),
            Ok("team-c".into())
        );
        assert_eq!(
            shard
                .authenticate(&bearer("key-b"), false)
                .map(|c| c.authority),
            Ok(Authority::Key {
                admin: true,
                metrics: false
            })
        );
        // Removing every key opens the surface again.
        assert_eq!(keys.replace(&[]).revoked, 2);
        assert!(!shard.is_enabled());
        assert_eq!(
            shard
                .authenticate(&bearer("key-b"), false)
                .map(|c| c.authority),
            Ok(Authority::Anonymous)
        );
    }

    // A budgeted principal is charged what the provider reported, or its
    // estimate when nothing was observed; once spent it is refused, and a
    // principal without a budget is not affected. Without a budget file
    // the budgets still hold in memory.
    #[test]
    fn budgets_charge_observed_usage_or_the_estimate_and_refuse_once_spent() {
        let spec = |principal: &str, key: &[u8], day: Option<u64>| ClientKeySpec {
            principal: principal.into(),
            key_hash: hash_client_key(key),
            admin: false,
            metrics: false,
            limits: Default::default(),
            budgets: crate::config::BudgetSpec {
                tokens_per_day: day,
                tokens_per_month: None,
            },
            models: None,
            priority: crate::config::DEFAULT_PRIORITY,
            weight: 1,
        };
        let keys = ClientKeys::from_config(&[
            spec("team-a", b"key-a", Some(100)),
            spec("team-b", b"key-b", None),
        ]);
        let now = clock::now();
        let granted = |principal: &str, estimate: u64| match keys.admit(principal, estimate, now) {
            Admission::Granted(claim, _) => claim,
            other => panic!("{principal}: {other:?}"),
        };
        let claim = granted("team-a", 10);
        keys.finish(claim, Some(60), now);
        let claim = granted("team-a", 45);
        keys.finish(claim, None, now);
        let status = keys.budgets_status().expect("budgets");
        assert_eq!(status.file, None);
        assert_eq!(status.principals.len(), 1);
        assert_eq!(
            status.principals[0].day.map(|d| (d.used, d.limit)),
            Some((105, 100))
        );
        match keys.admit("team-a", 1, now) {
            Admission::OverBudget(e) => {
                use crate::plane::budgets::{rfc3339_utc, Period};
                assert_eq!((e.limit, e.used), (100, 105));
                // The wall clock's next midnight UTC.
                assert_eq!(e.resets_at_unix_ms, Period::Day.end_ms(e.now_unix_ms));
                assert_eq!(
                    e.message(),
                    format!(
                        "token budget exhausted: this key's tokens_per_day budget of 100 tokens \
                         is spent (105 used); it resets at {}",
                        rfc3339_utc(e.resets_at_unix_ms)
                    )
                );
            }
            other => panic!("{other:?}"),
        }
        let claim = granted("team-b", 1_000_000);
        keys.finish(claim, None, now);
        // A reload that removes the budget lets the key in again.
        keys.replace(&[spec("team-a", b"key-a", None)]);
        assert_eq!(keys.budgets_status(), None);
        let claim = granted("team-a", 1);
        keys.finish(claim, None, now);
    }

    // CONTRACT: C1 — no principal, no lease: 401 in the route's shape.
    #[test]
    fn unauthenticated_answers_in_both_shapes() {
        let missing = AuthError::Missing.api_error(false);
        assert_eq!(missing.status, 401);
        assert_eq!(
            missing.body_json(),
            serde_json::json!({"error": {
                "message": "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
                "type": "invalid_request_error",
                "param": null,
                "code": null,
            }})
        );
        let invalid = AuthError::Invalid.api_error(true);
        assert_eq!(
            invalid.body_json()["error"]["code"],
            serde_json::json!("invalid_api_key")
        );
        let anthropic: serde_json::Value =
            serde_json::from_slice(&invalid.body_for(crate::api::error::Surface::Anthropic))
                .expect("json");
        assert_eq!(
            anthropic,
            serde_json::json!({"type": "error", "error": {
                "type": "authentication_error",
                "message": "Incorrect API key provided.",
            }})
        );
    }
}
