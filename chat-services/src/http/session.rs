//! `GET`, `POST`, `DELETE /session`: the session cookie a browser signs in with.

use super::reply::{self, Body};
use super::request::*;
use super::App;
use crate::access::auth::Identity;
use crate::access::budgets::Kind;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, SET_COOKIE};
use hyper::{Request, Response, StatusCode};

/// The session cookie holding the session token `token` for `max_age` seconds (0: removes
/// it).
pub(super) fn session_cookie(app: &App, token: &str, max_age: u64) -> HeaderValue {
    let secure = if app.cookie_secure { "; Secure" } else { "" };
    let name = app.auth.cookie_name();
    HeaderValue::from_str(&format!(
        "{name}={token}; Path=/; Max-Age={max_age}; HttpOnly; SameSite=Strict{secure}"
    ))
    .expect("a session token is base64url and dots, a valid header value")
}

pub(super) fn identity_json(who: &Identity) -> serde_json::Value {
    serde_json::json!({"user": who.user, "expires_at": who.expires_at, "admin": who.admin})
}

/// `POST /session` with `Authorization: Bearer <token>`: the page signs in. A session token
/// narrowed from it (this side's session only, a user's rights, the same expiry; see
/// `access::auth`) is kept in an `HttpOnly`, `SameSite=Strict` cookie until it expires,
/// because `EventSource` cannot send headers. The provider's token never leaves the page.
/// Each sign-in is charged to the user's budget (`--sign-in-rate`). Admin tokens are
/// refused: a cookie is sent with every request of the page.
pub(super) async fn sign_in(app: &App, req: &Request<Incoming>) -> Response<Body> {
    match app.auth.sign_in(req.headers()) {
        Ok(None) => reply::json(
            StatusCode::OK,
            &serde_json::json!({"user": null, "anonymous": true}),
        ),
        // A page holds its token in a cookie any of its requests carries: never an admin's
        // (a cross-site request could then manage members), nor one for admins only.
        Ok(Some((who, _))) if who.admin => reply::error(
            StatusCode::FORBIDDEN,
            "an admin token cannot sign a page in: sign in with a user's token, and send admin tokens as Authorization headers only",
        ),
        Ok(Some((who, _))) if !who.for_users => admin_only(),
        Ok(Some((who, _))) => {
            if let Err(resp) = charge_budget(app, &who, Kind::SignIn).await {
                return resp;
            }
            let Some(session) = app.auth.session_token(&who) else {
                unreachable!("an identified caller is not anonymous")
            };
            let mut resp = reply::json(StatusCode::OK, &identity_json(&who));
            let cookie = session_cookie(app, &session, who.remaining().as_secs());
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
