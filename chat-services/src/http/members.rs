//! `GET /chats/{id}/members` and `PUT`/`DELETE /chats/{id}/members/{user}`: a chat's
//! members, for tokens with the admin scope.

use super::reply::{self, Body};
use super::request::*;
use super::App;
use crate::access::auth::Identity;
use crate::model::{self};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};

/// The caller, if it may manage members (a token with the admin scope); or the answer.
// The error is the answer itself, returned once per request: boxing it would buy nothing.
#[allow(clippy::result_large_err)]
pub(super) fn admin(app: &App, req: &Request<Incoming>) -> Result<Identity, Response<Body>> {
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
                "managing members needs a token with {}",
                app.auth.admin_needs()
            ),
        ));
    }
    Ok(who)
}

/// `GET /chats/{id}/members` (admin scope).
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

/// `PUT` (`add`) or `DELETE /chats/{id}/members/{user}` (admin scope). A removed
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
    // A member added must have an id that shows as it is; one stored before that check
    // can still be removed.
    let checked = if add {
        model::check_new_user_id(&user)
    } else {
        model::check_user_id(&user)
    };
    if let Err(e) = checked {
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
    let removed = app.store.remove_member(chat_id, &user).await;
    // Whatever the outcome (an unanswered removal may have committed): a membership this
    // instance remembers, or is reading now, is not trusted again.
    app.members.forget(chat_id, &user);
    match removed {
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
