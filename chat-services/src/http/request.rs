//! What every handler shares: admitting a request (who is asking, may they use the chat),
//! reading its body and query within limits, and the error answers.

use super::reply::{self, Body};
use super::App;
use crate::access::auth::{AuthError, Identity};
use crate::access::budgets::Kind;
use crate::access::quota::Place;
use crate::model::InputError;
use crate::store::StoreError;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderValue, WWW_AUTHENTICATE};
use hyper::{Response, StatusCode};
use std::time::Duration;
use tracing::error;

/// Largest request body read, in bytes (a 4,000-character body is at most ~16 KB of JSON).
const MAX_REQUEST_BYTES: usize = 64 * 1024;

pub(super) fn input_error(e: InputError) -> Response<Body> {
    let status = StatusCode::from_u16(e.status()).expect("valid status");
    reply::error(status, e)
}

pub(super) fn store_error(e: StoreError) -> Response<Body> {
    match e {
        StoreError::Unavailable(_) => {
            reply::unavailable("the database is unavailable; nothing was written, retry shortly")
        }
        StoreError::Busy(_) => {
            reply::unavailable("the database is busy; nothing was written, retry shortly")
        }
        StoreError::OutcomeUnknown {
            ref idempotency_key,
        } => {
            let mut resp = reply::json(
                StatusCode::SERVICE_UNAVAILABLE,
                &serde_json::json!({"error": e.to_string(), "idempotency_key": idempotency_key}),
            );
            let headers = resp.headers_mut();
            headers.insert("retry-after", HeaderValue::from_static("1"));
            if let Ok(key) = HeaderValue::from_str(idempotency_key) {
                headers.insert("idempotency-key", key);
            }
            resp
        }
        StoreError::IdempotencyMismatch { .. } => reply::error(StatusCode::UNPROCESSABLE_ENTITY, e),
        StoreError::UnknownCursor(_) => reply::error(StatusCode::BAD_REQUEST, e),
        StoreError::NotMember { chat_id } => no_chat(chat_id),
        StoreError::Fenced { .. } => {
            error!(error = %e, "inbox fencing error on a request path");
            reply::error(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
        }
        StoreError::Other(ref detail) | StoreError::RowRefused(ref detail) => {
            error!(error = %detail, "database error");
            reply::error(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
        }
    }
}

/// Marks an answer to credentials refused after a signature check (a token forged, expired
/// or for another service): the client address is charged for it.
#[derive(Debug, Clone, Copy)]
pub(super) struct InvalidCredentials;

impl InvalidCredentials {
    pub(super) fn marks(resp: &Response<Body>) -> bool {
        resp.extensions().get::<Self>().is_some()
    }
}

/// 401 naming why, with the challenge RFC 6750 asks for.
pub(super) fn unauthorized(app: &App, e: AuthError) -> Response<Body> {
    let (reason, challenge) = match e {
        // Not the caller's fault: the keys to judge the token are not there yet.
        AuthError::NoKeys => return reply::unavailable(e),
        AuthError::Invalid(_) | AuthError::Refused(_) => (
            "invalid_token",
            r#"Bearer realm="chat", error="invalid_token""#,
        ),
        AuthError::Missing | AuthError::NotBearer => ("no_credentials", r#"Bearer realm="chat""#),
        AuthError::DuplicateCookie => ("duplicate_cookie", r#"Bearer realm="chat""#),
    };
    app.metrics
        .requests_refused_total
        .with_label_values(&[reason])
        .inc();
    // Only a refusal that cost a signature check is charged to the sender's address.
    let invalid = matches!(e, AuthError::Refused(_));
    let duplicate = matches!(e, AuthError::DuplicateCookie);
    let mut resp = reply::error(StatusCode::UNAUTHORIZED, e);
    resp.headers_mut()
        .insert(WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
    if invalid {
        resp.extensions_mut().insert(InvalidCredentials);
    }
    if duplicate {
        // This host's own is removed; the page signs in again.
        resp.headers_mut().insert(
            hyper::header::SET_COOKIE,
            super::session::session_cookie(app, "", 0),
        );
    }
    resp
}

/// 429 with `Retry-After` (whole seconds, at least 1), counted under `reason`.
pub(super) fn too_many(app: &App, reason: &str, wait: Duration, message: String) -> Response<Body> {
    app.metrics
        .requests_refused_total
        .with_label_values(&[reason])
        .inc();
    let mut resp = reply::error(StatusCode::TOO_MANY_REQUESTS, message);
    let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
    resp.headers_mut()
        .insert("retry-after", HeaderValue::from(secs));
    resp
}

/// What a chat that does not exist, and a chat the caller is not in, both answer: a
/// non-member learns nothing, not even that the chat exists.
pub(super) fn no_chat(chat_id: i64) -> Response<Body> {
    reply::error(StatusCode::NOT_FOUND, format!("no chat {chat_id}"))
}

/// A caller let into a chat: who they are (`None` with `--allow-anonymous`, where every
/// chat is open), and their place among their requests in flight on this instance (given
/// back when dropped; [`hold_until_written`] keeps it until the answer is written).
pub(super) struct Admitted {
    pub who: Option<Identity>,
    pub place: Option<Place>,
}

/// The caller, let into chat `chat_id`: identified, within their requests in flight, charged
/// one of `charge` from their budget, and a member of the chat; or the answer to give
/// instead. The charge comes before the membership check, so a user guessing at chats pays
/// for each guess.
pub(super) async fn admit(
    app: &App,
    headers: &HeaderMap,
    chat_id: i64,
    charge: Kind,
) -> Result<Admitted, Response<Body>> {
    let Some(who) = app
        .auth
        .identify(headers)
        .map_err(|e| unauthorized(app, e))?
    else {
        return Ok(Admitted {
            who: None,
            place: None,
        });
    };
    if !who.for_users {
        return Err(admin_only());
    }
    let Some(place) = app.limits.quotas.start_request(&who.user) else {
        return Err(too_many(
            app,
            "requests_per_user",
            Duration::from_secs(1),
            format!(
                "{} has {} requests in flight on this instance, the most allowed; wait for their answers",
                who.user,
                app.limits.quotas.max_in_flight()
            ),
        ));
    };
    charge_budget(app, &who, charge).await?;
    if !app.members.knows(chat_id, &who.user) {
        let asked = app.members.asking();
        match app.store.is_member(chat_id, &who.user).await {
            Ok(true) => app.members.saw(asked, chat_id, &who.user),
            Ok(false) => {
                app.metrics
                    .requests_refused_total
                    .with_label_values(&["not_member"])
                    .inc();
                return Err(no_chat(chat_id));
            }
            Err(e) => return Err(store_error(e)),
        }
    }
    Ok(Admitted {
        who: Some(who),
        place: Some(place),
    })
}

/// What a token meant for administration only answers where a user's is needed.
pub(super) fn admin_only() -> Response<Body> {
    reply::error(
        StatusCode::FORBIDDEN,
        "this token is for managing members only (its audience is the admin audience): read, post and sign in with a user's token",
    )
}

/// One of `kind` from `who`'s budget, or 429 saying how long to wait.
pub(super) async fn charge_budget(
    app: &App,
    who: &Identity,
    kind: Kind,
) -> Result<(), Response<Body>> {
    let budgets = &app.limits.quotas.budgets;
    budgets.take(kind, &who.user).await.map_err(|wait| {
        let budget = budgets.budget(kind);
        let doing = match kind {
            Kind::Send => "sending",
            Kind::History => "reading history",
            Kind::StreamOpen => "opening event streams",
            Kind::SignIn => "signing in",
        };
        too_many(
            app,
            kind.refusal(),
            wait,
            format!(
                "{} is {doing} faster than allowed ({}/s, bursts of {}); retry after the Retry-After seconds",
                who.user, budget.rate, budget.burst
            ),
        )
    })
}

/// `resp` with its body holding `place` until the body is written whole or dropped (the
/// connection closed): an answer a client does not read counts against its user's requests
/// in flight, so one user's unread answers are bounded.
pub(super) fn hold_until_written(resp: Response<Body>, place: Option<Place>) -> Response<Body> {
    let Some(place) = place else {
        return resp;
    };
    resp.map(|body| {
        body.map_frame(move |frame| {
            let _held = &place;
            frame
        })
        .boxed()
    })
}

/// A request's body, whole: at most [`MAX_REQUEST_BYTES`], arrived within
/// `--body-read-timeout` (else 408, and the connection closes); or the answer to give.
pub(super) async fn read_body(app: &App, body: Incoming) -> Result<bytes::Bytes, Response<Body>> {
    let body = Limited::new(body, MAX_REQUEST_BYTES).collect();
    let Ok(raw) = tokio::time::timeout(app.limits.body_read_timeout, body).await else {
        app.metrics
            .requests_refused_total
            .with_label_values(&["body_timeout"])
            .inc();
        let mut resp = reply::error(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {:?}",
                app.limits.body_read_timeout
            ),
        );
        resp.headers_mut()
            .insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
        return Err(resp);
    };
    match raw {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(reply::error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body is over {MAX_REQUEST_BYTES} bytes"),
            ))
        }
        Err(_) => Err(reply::error(
            StatusCode::BAD_REQUEST,
            "could not read the request body",
        )),
    }
}

/// `key=value` pairs of a query string, percent-decoded.
pub(super) fn query_pairs(query: Option<&str>) -> Vec<(String, String)> {
    query
        .unwrap_or_default()
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

/// A path segment, percent-decoded (`+` is itself there, unlike in a query); `None` if
/// the bytes are not UTF-8, so two spellings never name one user.
pub(super) fn path_decode(s: &str) -> Option<String> {
    String::from_utf8(decode(s, false)).ok()
}

pub(super) fn percent_decode(s: &str) -> String {
    String::from_utf8_lossy(&decode(s, true)).into_owned()
}

/// `%XX` decoded, and `+` as a space where `plus_is_space` (query strings).
pub(super) fn decode(s: &str, plus_is_space: bool) -> Vec<u8> {
    fn hex(b: u8) -> Option<u8> {
        match b {
            b'0'..=b'9' => Some(b - b'0'),
            b'a'..=b'f' => Some(b - b'a' + 10),
            b'A'..=b'F' => Some(b - b'A' + 10),
            _ => None,
        }
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' if plus_is_space => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(high), Some(low)) => {
                    out.push(high * 16 + low);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_strings_decode() {
        assert_eq!(
            query_pairs(Some("limit=5&before=a%2Db&x")),
            vec![
                ("limit".into(), "5".into()),
                ("before".into(), "a-b".into()),
                ("x".into(), "".into())
            ]
        );
        assert_eq!(percent_decode("%"), "%");
        assert_eq!(percent_decode("%4"), "%4");
        assert_eq!(percent_decode("a%20b+c"), "a b c");
        assert_eq!(percent_decode("%zz"), "%zz");
        assert_eq!(percent_decode("%é1"), "%é1");
        assert_eq!(path_decode("a+b%40x").as_deref(), Some("a+b@x"));
        assert_eq!(path_decode("%ff"), None);
    }
}
