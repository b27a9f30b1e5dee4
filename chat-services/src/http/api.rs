//! The route handlers.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{
    HeaderMap, HeaderValue, CACHE_CONTROL, CONTENT_TYPE, SET_COOKIE, WWW_AUTHENTICATE,
};
use hyper::{Request, Response, StatusCode};
use tracing::error;
use uuid::Uuid;

use super::reply::{self, Body};
use super::{sse, App};
use crate::access::auth::{AuthError, Identity};
use crate::model::{self, InputError};
use crate::store::StoreError;

/// Largest request body read, in bytes (a 4,000-character body is at most ~16 KB of JSON).
const MAX_REQUEST_BYTES: usize = 64 * 1024;
const DEFAULT_HISTORY: i64 = 50;
const MAX_HISTORY: i64 = 500;
/// Bytes of one history answer at most (500 messages of 4,000 escaped control characters
/// would be ~12 MB held for a client that never reads).
const MAX_HISTORY_BYTES: usize = 1024 * 1024;

const PAGE: &str = include_str!("../page.html");
const PAGE_JS: &str = include_str!("../page.js");
const PAGE_CSS: &str = include_str!("../page.css");

/// The page's policy: its script and style are files of this origin (no inline code, so an
/// injected `<script>` never runs), nothing may frame it, forms post only here.
const PAGE_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

pub(super) fn page(app: &App) -> Response<Body> {
    let html = PAGE
        .replace("{{SIDE}}", app.side.as_str())
        .replace("{{OTHER}}", app.side.other().as_str());
    asset(html, "text/html; charset=utf-8")
}

/// `GET /page.js` and `GET /page.css`.
pub(super) fn page_file(name: &str) -> Response<Body> {
    match name {
        "page.js" => asset(PAGE_JS.to_string(), "text/javascript; charset=utf-8"),
        _ => asset(PAGE_CSS.to_string(), "text/css; charset=utf-8"),
    }
}

fn asset(content: String, mime: &'static str) -> Response<Body> {
    let mut resp = Response::new(reply::full(content));
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(mime));
    headers.insert(
        "content-security-policy",
        HeaderValue::from_static(PAGE_POLICY),
    );
    headers.insert("x-frame-options", HeaderValue::from_static("DENY"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

fn input_error(e: InputError) -> Response<Body> {
    let status = StatusCode::from_u16(e.status()).expect("valid status");
    reply::error(status, e)
}

fn store_error(e: StoreError) -> Response<Body> {
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

/// 401 naming why, with the challenge RFC 6750 asks for.
fn unauthorized(app: &App, e: AuthError) -> Response<Body> {
    let (reason, challenge) = match e {
        // Not the caller's fault: the keys to judge the token are not there yet.
        AuthError::NoKeys => return reply::unavailable(e),
        AuthError::Invalid(_) => (
            "invalid_token",
            r#"Bearer realm="chat", error="invalid_token""#,
        ),
        AuthError::Missing | AuthError::NotBearer => ("no_credentials", r#"Bearer realm="chat""#),
    };
    app.metrics
        .requests_refused_total
        .with_label_values(&[reason])
        .inc();
    let mut resp = reply::error(StatusCode::UNAUTHORIZED, e);
    resp.headers_mut()
        .insert(WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
    resp
}

/// 429 with `Retry-After` (whole seconds, at least 1), counted under `reason`.
fn too_many(app: &App, reason: &str, wait: Duration, message: String) -> Response<Body> {
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
fn no_chat(chat_id: i64) -> Response<Body> {
    reply::error(StatusCode::NOT_FOUND, format!("no chat {chat_id}"))
}

/// The caller, let into chat `chat_id`: identified, and a member of it (`None` with
/// `--allow-anonymous`, where every chat is open); or the answer to give instead.
async fn admit(
    app: &App,
    headers: &HeaderMap,
    chat_id: i64,
) -> Result<Option<Identity>, Response<Body>> {
    let Some(who) = app
        .auth
        .identify(headers)
        .map_err(|e| unauthorized(app, e))?
    else {
        return Ok(None);
    };
    match app.store.is_member(chat_id, &who.user).await {
        Ok(true) => Ok(Some(who)),
        Ok(false) => {
            app.metrics
                .requests_refused_total
                .with_label_values(&["not_member"])
                .inc();
            Err(no_chat(chat_id))
        }
        Err(e) => Err(store_error(e)),
    }
}

/// A request's body, whole: at most [`MAX_REQUEST_BYTES`], arrived within
/// `--body-read-timeout` (else 408, and the connection closes); or the answer to give.
async fn read_body(app: &App, body: Incoming) -> Result<bytes::Bytes, Response<Body>> {
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

/// `POST /chats/{chat_id}/messages`, under a server span when spans are on: continuing
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
        "POST /chats/{chat_id}/messages",
        Kind::Server,
        given.as_ref(),
        None,
        vec![
            Attribute::new("http.request.method", "POST"),
            Attribute::new("http.route", "/chats/{chat_id}/messages"),
            Attribute::new("chat.side", app.side.as_str()),
        ],
        linked.as_ref(),
    );
    let traceparent = telemetry::passed_on(span.as_ref(), given.as_ref());
    let trace_id = telemetry::trace_id(span.as_ref(), given.as_ref());
    let resp = if trace_id.is_empty() {
        send_traced(app, chat_id, req, None).await
    } else {
        send_traced(app, chat_id, req, traceparent)
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

async fn send_traced(
    app: &App,
    chat_id: &str,
    req: Request<Incoming>,
    traceparent: Option<String>,
) -> Response<Body> {
    let chat_id = match model::parse_chat_id(chat_id) {
        Ok(id) => id,
        Err(e) => return input_error(e),
    };
    // Before the body is read: a stranger costs no more than its headers.
    let who = match admit(app, req.headers(), chat_id).await {
        Ok(who) => who,
        Err(resp) => return resp,
    };
    // Required, not assumed: a cross-site `no-cors` fetch can only send text/plain, a
    // form or nothing, so demanding application/json keeps other pages from posting.
    let mime = req
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(str::trim)
        .unwrap_or_default();
    if !mime.eq_ignore_ascii_case("application/json") {
        return reply::error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "Content-Type must be application/json",
        );
    }
    let idempotency_key = match req.headers().get("idempotency-key").map(|v| v.to_str()) {
        None => None,
        Some(Ok(key))
            if !key.is_empty() && key.len() <= 255 && key.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            Some(key.to_string())
        }
        Some(_) => {
            return reply::error(
                StatusCode::BAD_REQUEST,
                "Idempotency-Key must be 1 to 255 visible ASCII characters",
            )
        }
    };
    if let Some(who) = &who {
        if let Err(wait) = app.limits.quotas.take_send(&who.user) {
            return too_many(
                app,
                "send_rate",
                wait,
                format!(
                    "{} is sending faster than this instance allows ({}/s, bursts of {}); retry after the Retry-After seconds",
                    who.user, app.limits.quotas.rate(), app.limits.quotas.burst()
                ),
            );
        }
    }
    let raw = match read_body(app, req.into_body()).await {
        Ok(raw) => raw,
        Err(resp) => return resp,
    };
    let body = match model::parse_send_request(&raw) {
        Ok(body) => body,
        Err(e) => return input_error(e),
    };
    if let Some((chat, left)) = &app.refuse_sends {
        let refuse = *chat == chat_id
            && left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok();
        if refuse {
            return reply::error(
                StatusCode::SERVICE_UNAVAILABLE,
                "database unavailable (a test's failpoint); nothing was written",
            );
        }
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
            app.limits.quotas.give_back(&who.user);
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

/// `GET /chats/{chat_id}/messages?limit=&before=`.
pub(super) async fn history(app: &App, chat_id: &str, req: &Request<Incoming>) -> Response<Body> {
    let query = req.uri().query();
    let chat_id = match model::parse_chat_id(chat_id) {
        Ok(id) => id,
        Err(e) => return input_error(e),
    };
    if let Err(resp) = admit(app, req.headers(), chat_id).await {
        return resp;
    }
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
    match app.store.history(chat_id, limit, before).await {
        Ok(messages) => history_page(&messages),
        Err(e) => store_error(e),
    }
}

/// A history answer of at most [`MAX_HISTORY_BYTES`]: the newest messages that fit, oldest
/// first, and `"truncated": true` when older ones were left out (the client pages back
/// with `before` the first one it got). A client that reads slowly holds this much at most.
fn history_page(messages: &[crate::model::HistoryItem]) -> Response<Body> {
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
    let truncated = kept.len() < messages.len();
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
    let mut resp = Response::new(reply::full(body));
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// `GET /chats/{chat_id}/events`.
pub(super) async fn events(
    app: Arc<App>,
    chat_id: &str,
    req: &Request<Incoming>,
) -> Response<Body> {
    let chat_id = match model::parse_chat_id(chat_id) {
        Ok(id) => id,
        Err(e) => return input_error(e),
    };
    let who = match admit(&app, req.headers(), chat_id).await {
        Ok(who) => who,
        Err(resp) => return resp,
    };
    let entitlement = match who {
        None => None,
        Some(who) => {
            let Some(slot) = app.limits.quotas.open_stream(&who.user) else {
                return too_many(
                    &app,
                    "streams_per_user",
                    Duration::from_secs(1),
                    format!(
                    "{} has {} event streams open on this instance, the most allowed; close one",
                    who.user, app.limits.quotas.max_streams()
                ),
                );
            };
            Some(sse::Entitlement {
                watch: app.streams.watch(chat_id, &who.user),
                expires_in: who.remaining(),
                _slot: slot,
            })
        }
    };
    let bad_position = |name: &str, raw: &str| {
        reply::error(
            StatusCode::BAD_REQUEST,
            format!("{name} must be an event id like p42 (a feed position), got '{raw}'"),
        )
    };
    // Last-Event-ID (sent by a reconnecting EventSource) wins over the URL's ?after=.
    let after = if let Some(header) = req.headers().get("last-event-id") {
        let raw = header.to_str().unwrap_or_default();
        match sse::Cursor::parse(raw) {
            Some(cursor) => Some(cursor),
            None => return bad_position("Last-Event-ID", raw),
        }
    } else {
        let mut after = None;
        for (key, value) in query_pairs(req.uri().query()) {
            if key != "after" {
                return reply::error(
                    StatusCode::BAD_REQUEST,
                    format!("unknown query parameter '{key}'; use after"),
                );
            }
            match sse::Cursor::parse(&value) {
                Some(cursor) => after = Some(cursor),
                None => return bad_position("after", &value),
            }
        }
        after
    };
    let after = match sse::clamp(&app, chat_id, after).await {
        Ok(after) => after,
        Err(e) => return store_error(e),
    };
    sse::respond(app, chat_id, after, entitlement)
}

/// The session cookie holding `token` for `max_age` seconds (0: removes it).
fn session_cookie(app: &App, token: &str, max_age: u64) -> HeaderValue {
    let secure = if app.cookie_secure { "; Secure" } else { "" };
    let name = app.auth.cookie_name();
    HeaderValue::from_str(&format!(
        "{name}={token}; Path=/; Max-Age={max_age}; HttpOnly; SameSite=Strict{secure}"
    ))
    .expect("a token from a header is a valid header value")
}

fn identity_json(who: &Identity) -> serde_json::Value {
    serde_json::json!({"user": who.user, "expires_at": who.expires_at, "admin": who.admin})
}

/// `POST /session` with `Authorization: Bearer <token>`: the page signs in. The token is
/// kept in an `HttpOnly`, `SameSite=Strict` cookie until it expires, because
/// `EventSource` cannot send headers.
pub(super) fn sign_in(app: &App, req: &Request<Incoming>) -> Response<Body> {
    match app.auth.sign_in(req.headers()) {
        Ok(None) => reply::json(
            StatusCode::OK,
            &serde_json::json!({"user": null, "anonymous": true}),
        ),
        Ok(Some((who, token))) => {
            let mut resp = reply::json(StatusCode::OK, &identity_json(&who));
            let cookie = session_cookie(app, token, who.remaining().as_secs());
            resp.headers_mut().insert(SET_COOKIE, cookie);
            resp
        }
        Err(e) => unauthorized(app, e),
    }
}

/// `GET /session`: who the cookie (or a bearer token) says the caller is.
pub(super) fn session(app: &App, req: &Request<Incoming>) -> Response<Body> {
    match app.auth.identify(req.headers()) {
        Ok(None) => reply::json(
            StatusCode::OK,
            &serde_json::json!({"user": null, "anonymous": true}),
        ),
        Ok(Some(who)) => reply::json(StatusCode::OK, &identity_json(&who)),
        Err(e) => unauthorized(app, e),
    }
}

/// `DELETE /session`: sign out (the cookie is removed).
pub(super) fn sign_out(app: &App) -> Response<Body> {
    let mut resp = reply::json(StatusCode::OK, &serde_json::json!({"signed_out": true}));
    resp.headers_mut()
        .insert(SET_COOKIE, session_cookie(app, "", 0));
    resp
}

/// The caller, if it may manage members (a token with the admin scope); or the answer.
// The error is the answer itself, returned once per request: boxing it would buy nothing.
#[allow(clippy::result_large_err)]
fn admin(app: &App, req: &Request<Incoming>) -> Result<Identity, Response<Body>> {
    if app.auth.is_anonymous() {
        return Err(reply::error(
            StatusCode::FORBIDDEN,
            "members are not used with --allow-anonymous (every chat is open); configure --jwks-file to manage them",
        ));
    }
    let who = app
        .auth
        .identify_bearer(req.headers())
        .map_err(|e| unauthorized(app, e))?
        .expect("not anonymous");
    if !who.admin {
        app.metrics
            .requests_refused_total
            .with_label_values(&["not_admin"])
            .inc();
        return Err(reply::error(
            StatusCode::FORBIDDEN,
            format!(
                "managing members needs a token with scope '{}'",
                app.auth.admin_scope()
            ),
        ));
    }
    Ok(who)
}

/// `GET /chats/{chat_id}/members` (admin scope).
pub(super) async fn members(app: &App, chat_id: &str, req: &Request<Incoming>) -> Response<Body> {
    let chat_id = match model::parse_chat_id(chat_id) {
        Ok(id) => id,
        Err(e) => return input_error(e),
    };
    if let Err(resp) = admin(app, req) {
        return resp;
    }
    match app.store.members(chat_id).await {
        Ok(members) => reply::json(
            StatusCode::OK,
            &serde_json::json!({"chat_id": chat_id, "members": members}),
        ),
        Err(e) => store_error(e),
    }
}

/// `PUT` (`add`) or `DELETE /chats/{chat_id}/members/{user}` (admin scope). A removed
/// member's open streams on this instance end at once, on the others within a second.
pub(super) async fn set_member(
    app: &App,
    chat_id: &str,
    user: &str,
    add: bool,
    req: &Request<Incoming>,
) -> Response<Body> {
    let chat_id = match model::parse_chat_id(chat_id) {
        Ok(id) => id,
        Err(e) => return input_error(e),
    };
    let Some(user) = path_decode(user) else {
        return reply::error(
            StatusCode::BAD_REQUEST,
            "the user id in the path is not valid percent-encoded UTF-8",
        );
    };
    if let Err(e) = model::check_user_id(&user) {
        return reply::error(StatusCode::BAD_REQUEST, e);
    }
    let by = match admin(app, req) {
        Ok(who) => who.user,
        Err(resp) => return resp,
    };
    if add {
        return match app.store.add_member(chat_id, &user, &by).await {
            Ok(added) => {
                tracing::info!(chat_id, user = %user, by = %by, added, "member added");
                let status = if added {
                    StatusCode::CREATED
                } else {
                    StatusCode::OK
                };
                reply::json(
                    status,
                    &serde_json::json!({"chat_id": chat_id, "user": user, "added": added}),
                )
            }
            Err(e) => store_error(e),
        };
    }
    match app.store.remove_member(chat_id, &user).await {
        Ok(true) => {
            let streams = app.streams.revoke(chat_id, &user);
            app.metrics
                .event_streams_revoked_total
                .inc_by(streams as u64);
            tracing::info!(chat_id, user = %user, by = %by, streams, "member removed");
            reply::json(
                StatusCode::OK,
                &serde_json::json!({"chat_id": chat_id, "user": user, "removed": true}),
            )
        }
        Ok(false) => reply::error(
            StatusCode::NOT_FOUND,
            format!("{user} is not a member of chat {chat_id}"),
        ),
        Err(e) => store_error(e),
    }
}

/// `key=value` pairs of a query string, percent-decoded.
fn query_pairs(query: Option<&str>) -> Vec<(String, String)> {
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
fn path_decode(s: &str) -> Option<String> {
    String::from_utf8(decode(s, false)).ok()
}

fn percent_decode(s: &str) -> String {
    String::from_utf8_lossy(&decode(s, true)).into_owned()
}

/// `%XX` decoded, and `+` as a space where `plus_is_space` (query strings).
fn decode(s: &str, plus_is_space: bool) -> Vec<u8> {
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
