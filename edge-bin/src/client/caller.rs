//! The caller's checks before a request takes a place anywhere (the local
//! queue or a peer Edge): may its key use the model, and is its principal
//! within its limits; and the answer when it is not. Used by the local
//! pipeline and by forwarding alike.

use iop_engine::clock;
use iop_engine::http::HttpError;

use super::conn::*;
use crate::api::error::{GatewayError, Surface};
use crate::link::edge::Edge;
use crate::plane::client_keys::Admission;
use crate::plane::{budgets, limits};

/// Why the caller may not send this request: the key may not use the
/// model (403), the principal is over a limit (429), or one of its token
/// budgets is spent (429).
pub(super) enum CallerRefusal {
    Model(GatewayError),
    Limit(limits::Refusal),
    Budget(budgets::Exhausted),
}

/// The key's checks, before the request takes a place in the queue: model
/// access, then the principal's budgets and limits (on admission the
/// request holds a [`Claim`](crate::plane::client_keys::Claim) until its
/// access line is written). A request forwarded by a peer Edge is not
/// charged again: the Edge that took it from its client holds its claim.
pub(super) fn check_caller<S>(
    edge: &Edge,
    server: &mut Client<S>,
    model: &str,
) -> Option<CallerRefusal> {
    let caller = server.caller.as_ref()?;
    if !caller.may_use(model) {
        return Some(CallerRefusal::Model(GatewayError::model_not_allowed(model)));
    }
    if server.rec.peer.is_some() {
        return None;
    }
    let keys = &edge.settings.client_keys;
    let estimate = limits::estimate_prompt_tokens(server.rec.bytes_in as usize);
    match keys.admit(&caller.principal, estimate, clock::now()) {
        Admission::Granted(claim, _) => {
            server.release_limits();
            server.ticket = Some(Box::new((keys.clone(), claim)));
            None
        }
        Admission::Limited(refusal) => Some(CallerRefusal::Limit(refusal)),
        Admission::OverBudget(exhausted) => Some(CallerRefusal::Budget(exhausted)),
    }
}

/// Answers a [`CallerRefusal`]: a 429 carries `retry-after` (seconds, and
/// `retry-after-ms`, which the official SDKs prefer); a rate limit's also
/// OpenAI's `x-ratelimit-*` headers.
pub(super) async fn write_caller_refusal<S>(
    server: &mut Client<S>,
    surface: Surface,
    refusal: &CallerRefusal,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    let r = match refusal {
        CallerRefusal::Model(e) => return write_error(server, surface, e).await,
        CallerRefusal::Budget(b) => {
            let e = GatewayError::budget_exhausted(b.message(), b.retry_after_secs());
            let retry_after = b.retry_after_secs().to_string();
            let retry_after_ms = b.retry_after().as_millis().max(1).to_string();
            let headers = vec![
                ("content-type", "application/json"),
                ("retry-after", retry_after.as_str()),
                ("retry-after-ms", retry_after_ms.as_str()),
            ];
            server.rec.end(e.outcome());
            let body = e.body_for_request(surface, &server.rec.request_id);
            return server.write_response(e.status, headers, body).await;
        }
        CallerRefusal::Limit(r) => r,
    };
    let e = GatewayError::rate_limited(r.kind.as_str(), r.message(), r.retry_after_secs());
    let retry_after = r.retry_after_secs().to_string();
    let retry_after_ms = r.retry_after.as_millis().max(1).to_string();
    let mut rate = String::new();
    r.headers.write_openai(&mut rate);
    let mut headers: Vec<(&str, &str)> = vec![
        ("content-type", "application/json"),
        ("retry-after", &retry_after),
        ("retry-after-ms", &retry_after_ms),
    ];
    headers.extend(
        rate.split_terminator("\r\n")
            .filter_map(|line| line.split_once(": ")),
    );
    server.rec.end(e.outcome());
    let body = e.body_for_request(surface, &server.rec.request_id);
    server.write_response(e.status, headers, body).await
}
