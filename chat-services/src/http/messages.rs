//! `POST /chats/{id}/messages` (a send: the message and its outbox event in one statement)
//! and `GET /chats/{id}/messages` (history pages).

use super::reply::{self, Body};
use super::request::*;
use super::routes::Route;
use super::App;
use crate::access::budgets::Kind;
use crate::model::{self};
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use std::sync::atomic::Ordering;
use uuid::Uuid;

const DEFAULT_HISTORY: i64 = 50;
const MAX_HISTORY: i64 = 500;
/// Bytes of one history answer at most (500 messages of 4,000 escaped control characters
/// would be ~12 MB held for a client that never reads).
const MAX_HISTORY_BYTES: usize = 1024 * 1024;

/// `POST /chats/{id}/messages`, under a server span when spans are on: continuing
/// the request's `traceparent` with `--trust-traceparent`, else a trace of its own linked
/// to it. The outbox row gets the span's context (or, with spans off, the trusted request's
/// unchanged); log lines of the send carry the trace id.
pub(super) async fn send(app: &App, chat_id: &str, req: Request<Incoming>) -> Response<Body> {
    use outbox_core::telemetry::{self, Attribute, Kind, SpanExt as _, Status};
    use tracing::Instrument as _;
    let sent = req
        .headers()
        .get(telemetry::TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(telemetry::parse);
    let (given, linked) = if app.trust_traceparent {
        (sent, None)
    } else {
        (None, sent)
    };
    let mut span = telemetry::start_linked(
        format!("POST {}", Route::Messages.template()),
        Kind::Server,
        given.as_ref(),
        None,
        vec![
            Attribute::new("http.request.method", "POST"),
            Attribute::new("http.route", Route::Messages.template()),
            Attribute::new("chat.side", app.side.as_str()),
        ],
        linked.as_ref(),
    );
    let traceparent = telemetry::passed_on(span.as_ref(), given.as_ref());
    let trace_id = telemetry::trace_id(span.as_ref(), given.as_ref());
    let resp = if trace_id.is_empty() {
        send_message(app, chat_id, req, None).await
    } else {
        send_message(app, chat_id, req, traceparent)
            .instrument(tracing::info_span!("send", trace_id = %trace_id))
            .await
    };
    if let Some(span) = &mut span {
        let status = resp.status();
        span.set_attribute(Attribute::new(
            "http.response.status_code",
            i64::from(status.as_u16()),
        ));
        if status.is_server_error() {
            span.set_status(Status::error(status.to_string()));
        }
        span.end();
    }
    resp
}

/// The send itself (under the span [`send`] opened): admitted, checked, written with its
/// outbox event, announced.
async fn send_message(
    app: &App,
    chat_id: &str,
    req: Request<Incoming>,
    traceparent: Option<String>,
) -> Response<Body> {
    let chat_id = match model::parse_chat_id(chat_id) {
        Ok(id) => id,
        Err(e) => return input_error(e),
    };
    // Before the body is read: a stranger costs no more than its headers. The send is
    // charged here; given back below if it certainly wrote nothing.
    let Admitted { who, place: _place } = match admit(app, req.headers(), chat_id, Kind::Send).await
    {
        Ok(admitted) => admitted,
        Err(resp) => return resp,
    };
    if let Err(resp) = json_content(req.headers()) {
        return resp;
    }
    let idempotency_key = match idempotency_key(req.headers()) {
        Ok(key) => key,
        Err(resp) => return resp,
    };
    let raw = match read_body(app, req.into_body()).await {
        Ok(raw) => raw,
        Err(resp) => return resp,
    };
    let body = match model::parse_send_request(&raw) {
        Ok(body) => body,
        Err(e) => return input_error(e),
    };
    if let Some(resp) = refused_by_failpoint(app, chat_id) {
        return resp;
    }
    let sent = app
        .store
        .send(
            chat_id,
            &body,
            idempotency_key.as_deref(),
            who.as_ref().map(|w| w.user.as_str()),
            traceparent.as_deref(),
        )
        .await;
    // An attempt the database certainly did not run (503, nothing written) is given back,
    // so a client retrying it with its key is not pushed into 429. Everything else is
    // charged: a replay or a mismatch runs the whole statement too, a statement that ran
    // out on a slow server kept it busy, and an unknown outcome may have written.
    if let (Some(who), Err(e)) = (&who, &sent) {
        if e.ran_nothing() {
            app.limits
                .quotas
                .budgets
                .give_back(Kind::Send, &who.user)
                .await;
        }
    }
    match sent {
        Ok(sent) => {
            // Committed: show it on this side's other tabs and devices, on every instance.
            app.announcer.announce(&sent.item, None);
            let mut resp = reply::json(StatusCode::CREATED, &sent.item);
            if sent.replayed {
                resp.headers_mut()
                    .insert("idempotency-replayed", HeaderValue::from_static("true"));
            } else {
                app.metrics.messages_sent_total.inc();
            }
            resp
        }
        Err(e) => store_error(e),
    }
}

/// Required, not assumed: a cross-site `no-cors` fetch can only send text/plain, a form or
/// nothing, so demanding application/json keeps other pages from posting.
// The error is the answer itself, returned once per request: boxing it would buy nothing.
#[allow(clippy::result_large_err)]
fn json_content(headers: &HeaderMap) -> Result<(), Response<Body>> {
    let mime = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(str::trim)
        .unwrap_or_default();
    if mime.eq_ignore_ascii_case("application/json") {
        Ok(())
    } else {
        Err(reply::error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "Content-Type must be application/json",
        ))
    }
}

/// The send's `Idempotency-Key`, if it has a valid one.
// The error is the answer itself, returned once per request: boxing it would buy nothing.
#[allow(clippy::result_large_err)]
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, Response<Body>> {
    match headers.get("idempotency-key").map(|v| v.to_str()) {
        None => Ok(None),
        Some(Ok(key))
            if !key.is_empty() && key.len() <= 255 && key.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            Ok(Some(key.to_string()))
        }
        Some(_) => Err(reply::error(
            StatusCode::BAD_REQUEST,
            "Idempotency-Key must be 1 to 255 visible ASCII characters",
        )),
    }
}

/// A test's failpoint (`--refuse-sends`): the chat's next sends answer 503, unwritten.
fn refused_by_failpoint(app: &App, chat_id: i64) -> Option<Response<Body>> {
    let (chat, left) = app.refuse_sends.as_ref()?;
    let refuse = *chat == chat_id
        && left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
    refuse.then(|| {
        reply::error(
            StatusCode::SERVICE_UNAVAILABLE,
            "database unavailable (a test's failpoint); nothing was written",
        )
    })
}

/// `GET /chats/{id}/messages?limit=&before=`.
pub(super) async fn history(app: &App, chat_id: &str, req: &Request<Incoming>) -> Response<Body> {
    let query = req.uri().query();
    let chat_id = match model::parse_chat_id(chat_id) {
        Ok(id) => id,
        Err(e) => return input_error(e),
    };
    let place = match admit(app, req.headers(), chat_id, Kind::History).await {
        Ok(admitted) => admitted.place,
        Err(resp) => return resp,
    };
    if let Some((slow, delay)) = app.slow_history {
        if slow == chat_id {
            tokio::time::sleep(delay).await;
        }
    }
    let mut limit = DEFAULT_HISTORY;
    let mut before = None;
    for (key, value) in query_pairs(query) {
        match key.as_str() {
            "limit" => match value.parse::<i64>() {
                Ok(n) if (1..=MAX_HISTORY).contains(&n) => limit = n,
                _ => {
                    return reply::error(
                        StatusCode::BAD_REQUEST,
                        format!("limit must be an integer from 1 to {MAX_HISTORY}, got '{value}'"),
                    )
                }
            },
            "before" => match Uuid::parse_str(&value) {
                Ok(id) => before = Some(id),
                Err(_) => {
                    return reply::error(
                        StatusCode::BAD_REQUEST,
                        format!("before must be a message id (UUID), got '{value}'"),
                    )
                }
            },
            other => {
                return reply::error(
                    StatusCode::BAD_REQUEST,
                    format!("unknown query parameter '{other}'; use limit and before"),
                )
            }
        }
    }
    match app
        .store
        .history(chat_id, limit, before, MAX_HISTORY_BYTES)
        .await
    {
        Ok(page) => hold_until_written(history_page(&page.items, page.more), place),
        Err(e) => store_error(e),
    }
}

/// A history answer of at most [`MAX_HISTORY_BYTES`]: the newest messages that fit, oldest
/// first, and `"truncated": true` when older ones were left out, here or already by the
/// database's byte bound (`more`; the client pages back with `before` the first one it
/// got). A client that reads slowly holds this much at most.
pub(super) fn history_page(messages: &[crate::model::HistoryItem], more: bool) -> Response<Body> {
    let mut kept: Vec<Vec<u8>> = Vec::with_capacity(messages.len());
    let mut bytes = 0;
    for item in messages.iter().rev() {
        let json = serde_json::to_vec(item).expect("a message serializes");
        // 40: the wrapper, `{"messages":[` and `],"truncated":true}`.
        if bytes + json.len() + 1 + 40 > MAX_HISTORY_BYTES && !kept.is_empty() {
            break;
        }
        bytes += json.len() + 1;
        kept.push(json);
    }
    let truncated = more || kept.len() < messages.len();
    let mut body = Vec::with_capacity(bytes + 40);
    body.extend_from_slice(b"{\"messages\":[");
    for (i, json) in kept.iter().rev().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(json);
    }
    body.extend_from_slice(if truncated {
        b"],\"truncated\":true}"
    } else {
        b"]}"
    });
    let mut resp = Response::new(reply::chunked(body));
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}
