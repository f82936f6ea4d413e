//! Token budgets per principal per calendar day and month
//! (`[[client_keys]]` `tokens_per_day`, `tokens_per_month`), counted in
//! UTC: a day ends at 00:00 UTC, a month at 00:00 UTC on the 1st.
//!
//! Sans-IO: every call takes the wall clock as `now_unix_ms`; a period
//! rolls over when a call's clock is past its end, never by a timer. The
//! shell ([`crate::plane::client_keys::ClientKeys`]) holds one [`Budgets`]
//! for the process, behind the limiter's lock, and appends each
//! [`Record`] to the budget file ([`crate::plane::budget_file`]) so the
//! counts outlive a restart.
//!
//! Usage is what [`crate::plane::limits::Limiter::finish`] settles:
//! prompt + completion as observed, or the pre-dispatch estimate when no
//! usage is observed. Admission refuses a principal whose day or month
//! budget is spent (`used >= budget`); a request admitted while budget
//! remained is recorded in full and may overrun it.
//!
//! Usage is kept per [`PrincipalId`] (a hash of the principal's name, the
//! form the file stores): a reload that changes a budget keeps what was
//! used.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Milliseconds of one UTC day.
pub const DAY_MS: i64 = 86_400_000;

/// The **test-only** environment variable that offsets the Edge's wall
/// clock for budget periods by this many milliseconds (signed), read once
/// at startup; the Edge logs a warning when it is set. Never set it in
/// production: it moves when budgets reset.
pub const CLOCK_OFFSET_ENV: &str = "IOP_TEST_BUDGET_CLOCK_OFFSET_MS";

/// A principal as the budget file names it: the first 16 bytes of the
/// blake3 hash of its name (no key material, no name in the file).
pub type PrincipalId = [u8; 16];

/// The [`PrincipalId`] of `principal`.
pub fn principal_id(principal: &str) -> PrincipalId {
    let hash = blake3::hash(principal.as_bytes());
    let mut id = [0; 16];
    id.copy_from_slice(&hash.as_bytes()[..16]);
    id
}

pub use crate::config::BudgetSpec;

/// The part of `budgets` that the Edge of rank `rank` of `edges` live
/// Edges enforces: the rule of [`crate::plane::limits::share_of`] (the
/// parts add up to the budget; the first `budget % edges` Edges get one
/// token more).
pub fn share_of(budgets: BudgetSpec, edges: u32, rank: u32) -> BudgetSpec {
    let edges = u64::from(edges.max(1));
    let rank = u64::from(rank);
    let part = |v: Option<u64>| v.map(|v| v / edges + u64::from(rank < v % edges));
    BudgetSpec {
        tokens_per_day: part(budgets.tokens_per_day),
        tokens_per_month: part(budgets.tokens_per_month),
    }
}

/// A calendar period of a budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Period {
    /// A UTC day.
    Day,
    /// A UTC calendar month.
    Month,
}

impl Period {
    /// The config key of the period's budget.
    pub fn key(self) -> &'static str {
        match self {
            Period::Day => "tokens_per_day",
            Period::Month => "tokens_per_month",
        }
    }

    /// The period as `/status` and `/metrics` name it.
    pub fn as_str(self) -> &'static str {
        match self {
            Period::Day => "day",
            Period::Month => "month",
        }
    }

    /// The index of the period holding `unix_ms`: days or calendar months
    /// since 1970-01.
    pub fn index(self, unix_ms: i64) -> i64 {
        let day = unix_ms.div_euclid(DAY_MS);
        match self {
            Period::Day => day,
            Period::Month => {
                let (y, m, _) = civil_from_days(day);
                (y - 1970) * 12 + i64::from(m) - 1
            }
        }
    }

    /// When the period of index `index` starts (Unix ms).
    pub fn start_ms(self, index: i64) -> i64 {
        match self {
            Period::Day => index * DAY_MS,
            Period::Month => {
                let y = 1970 + index.div_euclid(12);
                let m = index.rem_euclid(12) as u32 + 1;
                days_from_civil(y, m, 1) * DAY_MS
            }
        }
    }

    /// When the period holding `unix_ms` ends (the next one starts).
    pub fn end_ms(self, unix_ms: i64) -> i64 {
        self.start_ms(self.index(unix_ms) + 1)
    }
}

/// Days since 1970-01-01 of the proleptic Gregorian date `y-m-d`
/// (H. Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date `(year, month, day)` of a count of days since 1970-01-01
/// (H. Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// `unix_ms` as RFC 3339 UTC with second precision
/// (`2026-12-08T00:00:00Z`).
pub fn rfc3339_utc(unix_ms: i64) -> String {
    let secs = unix_ms.div_euclid(1000);
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    let s = secs.rem_euclid(86_400);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        s / 3600,
        (s / 60) % 60,
        s % 60
    )
}

/// One line of the budget file: `tokens` used by `principal` at
/// `unix_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// When the usage was recorded (the budget clock).
    pub unix_ms: i64,
    /// Whose usage.
    pub principal: PrincipalId,
    /// Prompt + completion tokens.
    pub tokens: u64,
}

/// What one principal used in the periods it last recorded in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Used {
    day: i64,
    day_tokens: u64,
    month: i64,
    month_tokens: u64,
}

impl Used {
    const NONE: Used = Used {
        day: i64::MIN,
        day_tokens: 0,
        month: i64::MIN,
        month_tokens: 0,
    };

    /// Counts `tokens` at `unix_ms`: a later period starts from zero, an
    /// earlier one (a record older than the last) no longer counts.
    fn add(&mut self, tokens: u64, unix_ms: i64) {
        let day = Period::Day.index(unix_ms);
        if day > self.day {
            (self.day, self.day_tokens) = (day, 0);
        }
        if day == self.day {
            self.day_tokens = self.day_tokens.saturating_add(tokens);
        }
        let month = Period::Month.index(unix_ms);
        if month > self.month {
            (self.month, self.month_tokens) = (month, 0);
        }
        if month == self.month {
            self.month_tokens = self.month_tokens.saturating_add(tokens);
        }
    }

    /// Tokens used in the `period` holding `unix_ms`.
    fn in_period(&self, period: Period, unix_ms: i64) -> u64 {
        let index = period.index(unix_ms);
        match period {
            Period::Day if self.day == index => self.day_tokens,
            Period::Month if self.month == index => self.month_tokens,
            _ => 0,
        }
    }
}

/// Every principal's usage in its current day and month, by
/// [`PrincipalId`]: what the budget file replays into and compacts from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    used: HashMap<PrincipalId, Used>,
}

impl Ledger {
    /// Counts a record.
    pub fn add(&mut self, record: Record) {
        self.used
            .entry(record.principal)
            .or_insert(Used::NONE)
            .add(record.tokens, record.unix_ms);
    }

    /// Tokens `principal` used in the `period` holding `now_unix_ms`.
    pub fn used(&self, principal: &PrincipalId, period: Period, now_unix_ms: i64) -> u64 {
        self.used
            .get(principal)
            .map_or(0, |u| u.in_period(period, now_unix_ms))
    }

    /// The fewest records that replay to this ledger's usage in the day
    /// and month holding `now_unix_ms`, sorted: per principal, the month's
    /// tokens before today at the month's start and today's at the day's
    /// start. Older usage is dropped.
    pub fn totals(&self, now_unix_ms: i64) -> Vec<Record> {
        let day_start = Period::Day.start_ms(Period::Day.index(now_unix_ms));
        let month_start = Period::Month.start_ms(Period::Month.index(now_unix_ms));
        let mut out = Vec::new();
        for (id, u) in &self.used {
            let day = u.in_period(Period::Day, now_unix_ms);
            let month = u.in_period(Period::Month, now_unix_ms);
            let before_today = month.saturating_sub(day);
            for (unix_ms, tokens) in [(month_start, before_today), (day_start, day)] {
                if tokens > 0 {
                    out.push(Record {
                        unix_ms,
                        principal: *id,
                        tokens,
                    });
                }
            }
        }
        out.sort_by_key(|r| (r.unix_ms, r.principal));
        out
    }
}

/// A refusal: a budget of the key is spent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exhausted {
    /// The spent budget's period.
    pub period: Period,
    /// This Edge's budget (its share in a cluster).
    pub limit: u64,
    /// Tokens used in the period.
    pub used: u64,
    /// When the period ends and the budget is whole again (Unix ms).
    pub resets_at_unix_ms: i64,
    /// The budget clock at refusal.
    pub now_unix_ms: i64,
    /// In a cluster: the live Edges the budget is shared by (1: this Edge
    /// alone).
    pub shared_by: u32,
}

impl Exhausted {
    /// Time until the budget resets.
    pub fn retry_after(&self) -> Duration {
        let ms = self
            .resets_at_unix_ms
            .saturating_sub(self.now_unix_ms)
            .max(0);
        Duration::from_millis(ms as u64)
    }

    /// `retry-after` in whole seconds, rounded up, at least 1.
    pub fn retry_after_secs(&self) -> u64 {
        self.retry_after().as_millis().div_ceil(1000).max(1) as u64
    }

    /// The error message for the client: the budget, its size, when it
    /// resets.
    pub fn message(&self) -> String {
        let resets = rfc3339_utc(self.resets_at_unix_ms);
        if self.limit == 0 && self.shared_by > 1 {
            return format!(
                "token budget exhausted: this key's {} budget is shared by the cluster's {} edges \
                 and this edge's share is 0; send this key's requests to another edge",
                self.period.key(),
                self.shared_by
            );
        }
        format!(
            "token budget exhausted: this key's {} budget of {} tokens is spent ({} used); it \
             resets at {resets}",
            self.period.key(),
            self.limit,
            self.used,
        )
    }
}

/// One period of a principal's budget, as `/status` and `/metrics` show
/// it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeriodView {
    /// Tokens used in the current period.
    pub used: u64,
    /// This Edge's budget (its share in a cluster).
    pub limit: u64,
    /// When the period ends (Unix ms).
    pub resets_at_unix_ms: i64,
}

/// A principal's budgets now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetView {
    /// The principal.
    pub principal: Arc<str>,
    /// Its day budget, if it has one.
    pub day: Option<PeriodView>,
    /// Its month budget, if it has one.
    pub month: Option<PeriodView>,
}

#[derive(Debug, Clone)]
struct Entry {
    id: PrincipalId,
    /// This Edge's share.
    spec: BudgetSpec,
}

/// Every principal's budgets and what they used.
#[derive(Debug, Default)]
pub struct Budgets {
    /// The budgets as configured (for the whole cluster), in config order.
    configured: Vec<(Arc<str>, BudgetSpec)>,
    /// Principals with a budget, under the current share.
    index: HashMap<Arc<str>, Entry>,
    ledger: Ledger,
    /// Live Edges sharing the budgets; 0 and 1 mean this Edge alone.
    edges: u32,
    /// This Edge's rank among them.
    rank: u32,
}

impl Budgets {
    /// Budgets over the usage already in `ledger` (the replayed file).
    pub fn new(ledger: Ledger) -> Budgets {
        Budgets {
            ledger,
            ..Budgets::default()
        }
    }

    /// Replaces the usage with `ledger`'s (the budget file replayed at
    /// startup).
    pub fn load(&mut self, ledger: Ledger) {
        self.ledger = ledger;
    }

    /// Applies a new configuration (SIGHUP). Usage stays: a changed
    /// budget applies to what was already used in the period.
    pub fn configure<'a>(&mut self, specs: impl IntoIterator<Item = (&'a str, BudgetSpec)>) {
        self.configured = specs
            .into_iter()
            .filter(|(_, spec)| !spec.is_unlimited())
            .map(|(name, spec)| (Arc::<str>::from(name), spec))
            .collect();
        self.apply();
    }

    /// In a cluster: `edges` live Edges share the budgets, this one
    /// `rank` in name order, and this one enforces its
    /// [`share_of`] them.
    pub fn set_share(&mut self, edges: u32, rank: u32) {
        let edges = edges.max(1);
        let rank = rank.min(edges - 1);
        if (edges, rank) != (self.edges.max(1), self.rank) {
            self.edges = edges;
            self.rank = rank;
            self.apply();
        }
    }

    fn apply(&mut self) {
        self.index = self
            .configured
            .iter()
            .map(|(name, spec)| {
                let entry = Entry {
                    id: principal_id(name),
                    spec: share_of(*spec, self.edges, self.rank),
                };
                (Arc::clone(name), entry)
            })
            .collect();
    }

    /// True when no principal has a budget (admission need not read the
    /// clock).
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Admits a request of `principal` at `now_unix_ms`, or says which
    /// budget is spent (the month's when both are). `Ok(Some(name))`: the
    /// principal has budgets; record its usage under `name` when the
    /// request ends. `Ok(None)`: no budget.
    pub fn admit(&self, principal: &str, now_unix_ms: i64) -> Result<Option<Arc<str>>, Exhausted> {
        let Some((name, entry)) = self.index.get_key_value(principal) else {
            return Ok(None);
        };
        for (period, limit) in [
            (Period::Month, entry.spec.tokens_per_month),
            (Period::Day, entry.spec.tokens_per_day),
        ] {
            let Some(limit) = limit else { continue };
            let used = self.ledger.used(&entry.id, period, now_unix_ms);
            if used >= limit {
                return Err(Exhausted {
                    period,
                    limit,
                    used,
                    resets_at_unix_ms: period.end_ms(now_unix_ms),
                    now_unix_ms,
                    shared_by: self.edges.max(1),
                });
            }
        }
        Ok(Some(Arc::clone(name)))
    }

    /// Counts `tokens` used by `principal` at `now_unix_ms`; the record to
    /// append to the budget file, or `None` when the principal no longer
    /// has a budget (a reload removed it).
    pub fn record(&mut self, principal: &str, tokens: u64, now_unix_ms: i64) -> Option<Record> {
        let entry = self.index.get(principal)?;
        let record = Record {
            unix_ms: now_unix_ms,
            principal: entry.id,
            tokens,
        };
        self.ledger.add(record);
        Some(record)
    }

    /// Every principal's budgets at `now_unix_ms`, in config order.
    pub fn views(&self, now_unix_ms: i64) -> Vec<BudgetView> {
        self.configured
            .iter()
            .filter_map(|(name, _)| {
                let entry = self.index.get(name)?;
                let period = |period: Period, limit: Option<u64>| {
                    limit.map(|limit| PeriodView {
                        used: self.ledger.used(&entry.id, period, now_unix_ms),
                        limit,
                        resets_at_unix_ms: period.end_ms(now_unix_ms),
                    })
                };
                Some(BudgetView {
                    principal: Arc::clone(name),
                    day: period(Period::Day, entry.spec.tokens_per_day),
                    month: period(Period::Month, entry.spec.tokens_per_month),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unix ms of `y-m-d hh:mm:ss.mmm` UTC.
    fn at(y: i64, m: u32, d: u32, hh: i64, mm: i64, ss: i64, ms: i64) -> i64 {
        days_from_civil(y, m, d) * DAY_MS + ((hh * 60 + mm) * 60 + ss) * 1000 + ms
    }

    fn budgets(day: Option<u64>, month: Option<u64>) -> Budgets {
        let mut b = Budgets::new(Ledger::default());
        b.configure([(
            "team-a",
            BudgetSpec {
                tokens_per_day: day,
                tokens_per_month: month,
            },
        )]);
        b
    }

    #[test]
    fn civil_dates_round_trip_over_leap_years_and_centuries() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(
            days_from_civil(2000, 3, 1) - days_from_civil(2000, 2, 28),
            2
        );
        assert_eq!(
            days_from_civil(1900, 3, 1) - days_from_civil(1900, 2, 28),
            1
        );
        assert_eq!(
            days_from_civil(2024, 3, 1) - days_from_civil(2024, 2, 28),
            2
        );
        assert_eq!(
            days_from_civil(2026, 3, 1) - days_from_civil(2026, 2, 28),
            1
        );
        for day in -800_000..800_000 {
            let (y, m, d) = civil_from_days(day);
            assert_eq!(days_from_civil(y, m, d), day);
        }
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(
            rfc3339_utc(at(2026, 12, 7, 9, 27, 40, 999)),
            "2026-12-07T09:27:40Z"
        );
        assert_eq!(rfc3339_utc(-1), "1969-12-31T23:59:59Z");
    }

    #[test]
    fn month_lengths_follow_the_calendar() {
        let length_days = |y: i64, m: u32| {
            let start = at(y, m, 1, 0, 0, 0, 0);
            (Period::Month.end_ms(start) - start) / DAY_MS
        };
        let lengths: Vec<i64> = (1..=12).map(|m| length_days(2026, m)).collect();
        assert_eq!(lengths, [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]);
        assert_eq!(length_days(2024, 2), 29);
        assert_eq!(length_days(2000, 2), 29);
        assert_eq!(length_days(2100, 2), 28);
        assert_eq!(Period::Month.index(0), 0);
        assert_eq!(Period::Month.index(at(2026, 12, 31, 23, 59, 59, 999)), 683);
        assert_eq!(Period::Month.start_ms(684), at(2027, 1, 1, 0, 0, 0, 0));
    }

    #[test]
    fn a_day_budget_refuses_once_spent_and_rolls_over_at_midnight_utc_exactly() {
        let mut b = budgets(Some(1000), None);
        let noon = at(2026, 12, 7, 12, 0, 0, 0);
        assert_eq!(b.admit("team-a", noon), Ok(Some(Arc::from("team-a"))));
        b.record("team-a", 999, noon);
        // 999 < 1000: admitted, and the request may overrun the budget.
        assert!(b.admit("team-a", noon).is_ok());
        b.record("team-a", 35, noon);
        let last_ms = at(2026, 12, 7, 23, 59, 59, 999);
        let refused = b.admit("team-a", last_ms).unwrap_err();
        let midnight = at(2026, 12, 8, 0, 0, 0, 0);
        assert_eq!(
            refused,
            Exhausted {
                period: Period::Day,
                limit: 1000,
                used: 1034,
                resets_at_unix_ms: midnight,
                now_unix_ms: last_ms,
                shared_by: 1,
            }
        );
        assert_eq!(refused.retry_after(), Duration::from_millis(1));
        assert_eq!(refused.retry_after_secs(), 1);
        let at_noon = b.admit("team-a", noon).unwrap_err();
        assert_eq!(at_noon.retry_after_secs(), 12 * 3600);
        assert_eq!(
            at_noon.message(),
            "token budget exhausted: this key's tokens_per_day budget of 1000 tokens is spent \
             (1034 used); it resets at 2026-12-08T00:00:00Z"
        );
        // At 00:00:00.000 UTC the day is new.
        assert!(b.admit("team-a", midnight).is_ok());
        assert_eq!(b.views(midnight)[0].day.map(|d| d.used), Some(0));
        // Other principals have no budget.
        assert_eq!(b.admit("team-b", noon), Ok(None));
        assert_eq!(b.record("team-b", 5, noon), None);
    }

    #[test]
    fn a_month_budget_spans_the_month_and_wins_over_the_day_when_both_are_spent() {
        let mut b = budgets(Some(100), Some(250));
        // 2024 is a leap year: February has 29 days.
        b.record("team-a", 100, at(2024, 2, 1, 0, 0, 0, 0));
        b.record("team-a", 100, at(2024, 2, 15, 8, 0, 0, 0));
        let day_spent = b.admit("team-a", at(2024, 2, 15, 9, 0, 0, 0)).unwrap_err();
        assert_eq!(day_spent.period, Period::Day);
        b.record("team-a", 60, at(2024, 2, 29, 23, 0, 0, 0));
        let last_ms = at(2024, 2, 29, 23, 59, 59, 999);
        let month_spent = b.admit("team-a", last_ms).unwrap_err();
        assert_eq!(
            (month_spent.period, month_spent.used, month_spent.limit),
            (Period::Month, 260, 250)
        );
        assert_eq!(month_spent.resets_at_unix_ms, at(2024, 3, 1, 0, 0, 0, 0));
        assert_eq!(
            month_spent.message(),
            "token budget exhausted: this key's tokens_per_month budget of 250 tokens is spent \
             (260 used); it resets at 2024-03-01T00:00:00Z"
        );
        let march = at(2024, 3, 1, 0, 0, 0, 0);
        assert!(b.admit("team-a", march).is_ok());
        let v = &b.views(march)[0];
        assert_eq!(
            (v.day, v.month),
            (
                Some(PeriodView {
                    used: 0,
                    limit: 100,
                    resets_at_unix_ms: at(2024, 3, 2, 0, 0, 0, 0)
                }),
                Some(PeriodView {
                    used: 0,
                    limit: 250,
                    resets_at_unix_ms: at(2024, 4, 1, 0, 0, 0, 0)
                })
            )
        );
    }

    #[test]
    fn a_reload_keeps_usage_and_a_cluster_member_enforces_its_share() {
        let mut b = budgets(Some(1000), None);
        let t = at(2026, 12, 7, 12, 0, 0, 0);
        b.record("team-a", 400, t);
        b.configure([(
            "team-a",
            BudgetSpec {
                tokens_per_day: Some(400),
                tokens_per_month: None,
            },
        )]);
        assert_eq!(b.admit("team-a", t).unwrap_err().used, 400);
        // 1001 over 3 Edges: 334 + 334 + 333.
        let spec = BudgetSpec {
            tokens_per_day: Some(1001),
            tokens_per_month: Some(2),
        };
        let parts: Vec<_> = (0..3).map(|r| share_of(spec, 3, r)).collect();
        assert_eq!(
            parts.iter().map(|p| p.tokens_per_day).collect::<Vec<_>>(),
            [Some(334), Some(334), Some(333)]
        );
        assert_eq!(
            parts.iter().map(|p| p.tokens_per_month).collect::<Vec<_>>(),
            [Some(1), Some(1), Some(0)]
        );
        b.configure([("team-a", spec)]);
        b.set_share(3, 2);
        let r = b.admit("team-a", t).unwrap_err();
        assert_eq!((r.period, r.limit, r.shared_by), (Period::Month, 0, 3));
        assert_eq!(
            r.message(),
            "token budget exhausted: this key's tokens_per_month budget is shared by the \
             cluster's 3 edges and this edge's share is 0; send this key's requests to another \
             edge"
        );
    }

    #[test]
    fn totals_replay_to_the_same_usage_and_drop_old_periods() {
        let mut ledger = Ledger::default();
        let a = principal_id("team-a");
        let b = principal_id("team-b");
        let rec = |principal, tokens, unix_ms| Record {
            unix_ms,
            principal,
            tokens,
        };
        ledger.add(rec(a, 7, at(2026, 11, 30, 10, 0, 0, 0)));
        ledger.add(rec(a, 10, at(2026, 12, 1, 10, 0, 0, 0)));
        ledger.add(rec(a, 20, at(2026, 12, 7, 1, 0, 0, 0)));
        ledger.add(rec(a, 5, at(2026, 12, 7, 2, 0, 0, 0)));
        ledger.add(rec(b, 3, at(2026, 12, 2, 2, 0, 0, 0)));
        let now = at(2026, 12, 7, 12, 0, 0, 0);
        let totals = ledger.totals(now);
        let month_start = at(2026, 12, 1, 0, 0, 0, 0);
        let day_start = at(2026, 12, 7, 0, 0, 0, 0);
        let mut want = vec![
            rec(a, 10, month_start),
            rec(b, 3, month_start),
            rec(a, 25, day_start),
        ];
        want.sort_by_key(|r| (r.unix_ms, r.principal));
        assert_eq!(totals, want);
        let mut replayed = Ledger::default();
        for r in totals {
            replayed.add(r);
        }
        for id in [a, b] {
            for period in [Period::Day, Period::Month] {
                assert_eq!(
                    replayed.used(&id, period, now),
                    ledger.used(&id, period, now)
                );
            }
        }
        assert_eq!(replayed.used(&a, Period::Month, now), 35);
        // A record older than the principal's last period counts nowhere.
        ledger.add(rec(a, 1000, at(2026, 11, 15, 0, 0, 0, 0)));
        assert_eq!(ledger.used(&a, Period::Month, now), 35);
    }
}
