//! The caller's checks before a request takes a place anywhere (the local
//! queue or a peer Edge): may its key use the model, and is its principal
//! within its limits; and the answer when it is not. Used by the local
//! pipeline and by forwarding alike.

use iop_engine::clock;
use iop_engine::http::HttpError;

use super::conn::*;
use crate::api::error::{GatewayError, Surface};
use crate::link::edge::Edge;
use crate::plane::limits;

/// Why the caller may not send this request: the key may not use the
/// model (403), or the principal is over a limit (429).
pub(super) enum CallerRefusal {
    Model(GatewayError),
    Limit(limits::Refusal),
}

/// The key's checks, before the request takes a place in the queue: model
/// access, then the principal's limits (on admission the request holds a
/// [`Ticket`] until its access line is written). A request forwarded by
/// a peer Edge is not charged again: the Edge that took it from its
/// client holds its claim.
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
        limits::Admission::Granted(ticket, _) => {
            server.release_limits();
            server.ticket = Some(Box::new((keys.clone(), ticket)));
            None
        }
        limits::Admission::Refused(refusal) => Some(CallerRefusal::Limit(refusal)),
    }
}

/// Answers a [`CallerRefusal`]: a 429 carries `retry-after` (seconds, and
/// `retry-after-ms`, which the official SDKs prefer) and OpenAI's
/// `x-ratelimit-*` headers.
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
